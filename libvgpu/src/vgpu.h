/* libvgpu internal declarations. */
#ifndef LIBVGPU_VGPU_H
#define LIBVGPU_VGPU_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <stdint.h>
#include <stddef.h>

#include "cuda_abi.h"
#include "nvml_abi.h"

#define EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

#define VGPU_MAX_DEV 16

/* ------------------------------------------------------------------ real driver entry points */
#define HOOK(name, ret, params, args) typedef ret(*name##_fn) params; extern name##_fn real_##name;
#define REAL(name, ret, params) typedef ret(*name##_fn) params; extern name##_fn real_##name;
#include "hooks_list.h"
#undef HOOK
#undef REAL

/* ------------------------------------------------------------------ NVML (nvml.c owns its table)
 * vgpu_nvml_load: loads and initialises libnvidia-ml.so.1 once; 1 when it is usable. The vnvml_* calls
 * forward to the real entry point (after vgpu_nvml_load), or return NVML_ERROR_FUNCTION_NOT_FOUND when
 * the library or that entry point is missing. */
int vgpu_nvml_load(void);
nvmlReturn_t vnvml_handle_by_index(unsigned index, nvmlDevice_t *out);
nvmlReturn_t vnvml_handle_by_uuid(const char *uuid, nvmlDevice_t *out);
nvmlReturn_t vnvml_index(nvmlDevice_t d, unsigned *index);
nvmlReturn_t vnvml_uuid(nvmlDevice_t d, char *uuid, unsigned len);
nvmlReturn_t vnvml_memory(nvmlDevice_t d, nvmlMemory_t *m);
nvmlReturn_t vnvml_memory_v2(nvmlDevice_t d, nvmlMemory_v2_t *m);
nvmlReturn_t vnvml_utilization(nvmlDevice_t d, nvmlUtilization_t *u);
nvmlReturn_t vnvml_process_utilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *buf, unsigned *n,
                                       unsigned long long since_us);
nvmlReturn_t vnvml_running_processes(nvmlDevice_t d, unsigned *n, nvmlProcessInfo_t *buf);
int vnvml_lists_processes(void); /* 1: vnvml_running_processes has a real entry point */
#define VNVML_MAX_PROCS 512
/* The running compute processes on d (at most max, at most VNVML_MAX_PROCS): pids and, unless used is
 * NULL, the device memory in bytes NVML says each uses (UINT64_MAX where the driver cannot tell).
 * Returns 0, or -1 when NVML gives no list. */
int vnvml_process_memory(nvmlDevice_t d, unsigned *pids, uint64_t *used, unsigned max, unsigned *n);

/* ------------------------------------------------------------------ configuration (read once) */
struct vgpu_config {
    int enabled;                        /* 0 when CUDA_DISABLE_CONTROL=true */
    int log_level;                      /* LIBVGPU_LOG_LEVEL, 0..4 */
    uint64_t mem_limit[VGPU_MAX_DEV];   /* bytes (meaningful only where mem_set) */
    uint8_t mem_set[VGPU_MAX_DEV];      /* 1: a memory limit applies (an invalid or 0 value: limit 0) */
    int sm_limit[VGPU_MAX_DEV];         /* percent, 0 = none */
    int sm_any;                         /* any device has an SM limit */
    int64_t context_cost;               /* LIBVGPU_CONTEXT_COST bytes, -1 = measure */
    unsigned sm_period_ms;              /* LIBVGPU_SM_PERIOD_MS */
    char visible[VGPU_MAX_DEV][96];     /* CUDA_VISIBLE_DEVICES entries */
    int nvisible;                       /* -1: unset */
    char cache_path[512];               /* shared accounting file ("" = per process) */
    int from_file;                      /* 1: limits came from the container's limits file */
    char uuid[VGPU_MAX_DEV][96];        /* the container's GPUs (limits file or NVIDIA_VISIBLE_DEVICES) */
    int nuuid;                          /* 0: unknown */
    int priority;                       /* 0 high, 1 low, -1 unset */
    int core_disabled;                  /* the SM limit is switched off (core policy "disable") */
    int sm_yield;                       /* low priority: yield compute to busy neighbours (limiter.c) */
    int sm_conserving;                  /* work-conserving SM limit (limits file core_sharing, admin's policy) */
    int graph_peak;                     /* a graph's launch checked against the peak of its allocations, not their
                                         * sum (limits file graph_memory=peak, admin's policy; without a file,
                                         * LIBVGPU_GRAPH_MEMORY_BOUND=peak) */
};

/* The container's limits file: fixed path, read-only mount (see docs/env-contract.md). Not taken
 * from the environment on purpose: a process must not be able to point the shim elsewhere. */
#ifndef VGPU_LIMITS_PATH
#define VGPU_LIMITS_PATH "/usr/local/vgpu/limits/vgpu.limits"
#endif
/* The process's configuration. config.c owns it and alone writes it (vgpu_read_config, once, from
 * vgpu_base_init before any hook reads it); every other file reads it through this read-only view.
 * tests/libvgpu/test_shim_ownership.py fails when a file shares writable state with another. */
extern const struct vgpu_config *const vgpu_cfg;
void vgpu_read_config(void); /* config.c: the limits file, else the environment (once) */

/* ------------------------------------------------------------------ init (core.c) */
void vgpu_cuda_init_slow(void);
void vgpu_base_init(void);
/* glibc's dlsym (never the shim's hooks), and the library named by env `env` when set and not empty,
 * else `dflt` (dlopen after the base init; NULL when it cannot be loaded) */
void *vgpu_real_dlsym(void *handle, const char *symbol);
void *vgpu_open_library(const char *env, const char *dflt);

/* 1 once the real driver's entry points are resolved (core.c writes it, once, with release order). */
extern const int *const vgpu_cuda_ready;

static inline void ensure_cuda(void)
{
    if (UNLIKELY(!__atomic_load_n(vgpu_cuda_ready, __ATOMIC_ACQUIRE)))
        vgpu_cuda_init_slow();
}

/* ------------------------------------------------------------------ logging (slow paths only) */
void vgpu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define LOG_ERROR(...) vgpu_log(1, __VA_ARGS__)
#define LOG_WARN(...) vgpu_log(2, __VA_ARGS__)
#define LOG_INFO(...) vgpu_log(3, __VA_ARGS__)
#define LOG_DEBUG(...) vgpu_log(4, __VA_ARGS__)

/* ------------------------------------------------------------------ shared region (region.c) */
int region_open(void);
/* Reserve bytes on dev. force: never fails. Returns 0, or -1 when the limit would be exceeded
 * (then *used_out / *limit_out tell why). */
int region_reserve(int dev, uint64_t bytes, int force, uint64_t *used_out, uint64_t *limit_out);
uint64_t region_ctx_cost(int dev);
void region_note_ctx_cost(int dev, uint64_t bytes);
void region_release(int dev, uint64_t bytes);
void region_count_refusal(void); /* one more refusal past the limit, for the node's metrics */
uint64_t region_used(int dev);
uint64_t region_own(int dev); /* bytes this process has charged on dev */
void region_procs(int *pids, int *prio, int *n, int max); /* NVML pid, priority of the container's processes */
void region_release_self(void);
void region_after_fork_child(void);
int vgpu_self_pid(void); /* this process's pid as the container's /proc shows it (NSpid[0]) */
int vgpu_host_pid(void); /* the pid NVML reports for this process (learned, see region.c), else vgpu_self_pid() */
void hostpid_before_ctx(int cdev); /* around this process's first context creation (region.c) */
void hostpid_after_ctx(int created, CUcontext ctx); /* ctx: the new context, for the probe */
int hostpid_learned(void); /* the pid NVML reports for this process if learned from its listing, else 0 */

/* ------------------------------------------------------------------ memory / contexts (memory.c) */
int current_device(CUdevice *dev, CUcontext *ctx);
void memory_after_fork_child(void);
/* Graph memory nodes (memory.c): what an executable graph's allocation nodes can take is recorded at its
 * instantiation (and update); a launch or upload is refused with CUDA_ERROR_OUT_OF_MEMORY when what it could
 * add to the device's graph pool does not fit under the limit, and the pool's reserve is charged after it.
 * A begin that returns CUDA_SUCCESS with t->mask set holds a lock until its end: call the driver between. */
struct gmem_launch {
    uint32_t mask;                  /* CUDA ordinals checked (a bit each); 0: nothing to do after the call */
    uint64_t need[VGPU_MAX_DEV];    /* reserved for the call, per ordinal */
    uint64_t before[VGPU_MAX_DEV];  /* the pool's charge before it */
};
/* Read before the driver instantiates graph (its order then can only grow: edges cannot be removed from a graph with
 * memory nodes); NULL when there is nothing to gain over the sum. memory_graph_instantiated takes (and frees) it. */
struct gmem_order;
struct gmem_order *memory_graph_order(CUgraph graph);
void memory_graph_instantiated(CUgraphExec exec, CUgraph graph, struct gmem_order *pre);
void memory_graph_order_free(struct gmem_order *pre);
CUresult memory_graph_launch_begin(CUgraphExec exec, const char *api, struct gmem_launch *t);
void memory_graph_launch_end(struct gmem_launch *t, CUresult rc);
void memory_graph_exec_gone(CUgraphExec exec);
/* Stacks grown at launch (memory.c): a kernel needing more local memory per thread than the context's stack
 * has charged makes the driver grow it; charged before the launch (graph: at instantiation) or refused with
 * CUDA_ERROR_OUT_OF_MEMORY. One cuFuncGetAttribute per kernel launched. */
CUresult memory_launch_stack(CUfunction f);
CUresult memory_launch_stack_multi(const CUDA_LAUNCH_PARAMS *list, unsigned int n);
CUresult memory_graph_stack(CUgraph graph);
/* the tracking table used for allocations and graph costs: track.h */

/* ------------------------------------------------------------------ graphs (graph.c) */
/* Child graph levels walked below a graph (a child graph node's own children included); nodes deeper down are
 * not visited and make the walk incomplete. */
#define GRAPH_WALK_DEPTH 8
/* Called for each node that is not a child graph node, with its CU_GRAPH_NODE_TYPE_*; nonzero: the node
 * could not be read (the walk goes on, and reports it incomplete). */
typedef int (*graph_visit_fn)(CUgraphNode node, int type, void *arg);
/* Visits every node of g and of its child graphs, depth first in node order. 0, or -1 when some level or node
 * could not be read in full (what could be read is still visited). */
int graph_walk(CUgraph g, graph_visit_fn visit, void *arg);
/* Graph g's nodes (one level) in *out, calloc'ed (NULL when none; the caller frees), their number in *n: 0, 1 when
 * the graph kept growing between the count and the listing (*out: some of its nodes), -1 when they cannot be read
 * (graph.c). */
int graph_nodes(CUgraph g, CUgraphNode **out, size_t *n);
/* In a graph_visit_fn: 0 when the node's type is not `want`; else reads the node's parameters into the struct
 * `p` with `getter` (a real_cuGraph*NodeGetParams, which may be unresolved): 1 when read, -1 when not. */
#define GRAPH_NODE_PARAMS(node, type, want, getter, p)                                                          \
    ((type) != (want) ? 0                                                                                      \
                      : (memset(&(p), 0, sizeof(p)), (getter) && (getter)((node), &(p)) == CUDA_SUCCESS ? 1 : -1))
/* The same over the kernel nodes only: fn gets each one's parameters (a kernel node that cannot be read makes
 * the walk incomplete). */
typedef void (*graph_kernel_fn)(const CUDA_KERNEL_NODE_PARAMS *p, void *arg);
int graph_walk_kernels(CUgraph g, graph_kernel_fn fn, void *arg);
/* A graph's dependency order, child graphs flattened into it: a vertex per node, and a child graph node is two, its
 * entry (before every node of its graph) and its exit (after them). v's successors are succ[first[v] ..
 * first[v + 1]); u runs before v when v is reachable from u. Only edges that order their nodes (cuGraphGetEdges_v2,
 * else cuGraphGetEdges; an edge with data, such as a programmatic one, is left out) are taken: the order is never
 * stronger than the driver's. Bounded: at most GRAPH_DAG_NODES vertices and GRAPH_DAG_EDGES edges. */
#define GRAPH_DAG_NODES 2048
#define GRAPH_DAG_EDGES 8192
struct graph_dag {
    uint32_t n;
    CUgraphNode *node; /* the node of each vertex (a child graph node's exit: NULL) */
    int *type;         /* its CU_GRAPH_NODE_TYPE_* (an exit: CU_GRAPH_NODE_TYPE_GRAPH) */
    uint32_t *first;
    uint32_t *succ;
};
/* 0, or -1 when g could not be read in full, is over the bounds, or the driver lists no edges (d is empty then).
 * graph_dag_free releases what a 0 gave. */
int graph_dag(CUgraph g, struct graph_dag *d);
void graph_dag_free(struct graph_dag *d);
/* In a graph_visit_fn (parameters node and type): declares `p` of type T and reads the node's parameters into it,
 * or returns from the visitor (0: another type, -1: unreadable). */
#define GRAPH_VISIT_PARAMS(T, p, want, getter)                                                                 \
    T p;                                                                                                       \
    do {                                                                                                       \
        int got_ = GRAPH_NODE_PARAMS(node, type, want, getter, p);                                             \
        if (got_ <= 0)                                                                                         \
            return got_;                                                                                       \
    } while (0)

/* ------------------------------------------------------------------ SM limiter (limiter.c) */
/* Decides from the configuration whether kernel launches are throttled (SM limit or low priority);
 * returns 1 when they are. core.c calls it once, before it publishes the driver as ready, and then
 * limiter_start() when it returned 1. */
int limiter_init(void);
void limiter_start(void);
void limiter_throttle(uint64_t blocks, CUstream s);
void limiter_graph_updated(CUgraphExec exec, CUgraph graph); /* cuGraphExecUpdate(_v2) succeeded */

/* ------------------------------------------------------------------ device mapping (core.c)
 * One mapping, by GPU UUID: a CUDA ordinal (this process's numbering, after its own
 * CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER) -> the GPU's UUID (the driver's cuDeviceGetUuid) -> the
 * container GPU index: its position in the container's list (limits file, else NVIDIA_VISIBLE_DEVICES),
 * else its NVML index. Limits and shared accounting are indexed by the container GPU index, so every
 * process charges a physical GPU to the same slot. VGPU_FOREIGN: a GPU that is not in the container's
 * list; its limit is 0 (fail closed). */
#define VGPU_FOREIGN VGPU_MAX_DEV
int vgpu_dev_of_cuda(CUdevice ordinal);            /* -1: unknown (no driver answer, no list) */
int vgpu_dev_of_nvml(nvmlDevice_t d);              /* -1: not determinable */
int vgpu_nvml_of_dev(int dev, nvmlDevice_t *out);  /* 0 on success */
/* 1 and the limit in bytes when a memory limit applies to container GPU dev (VGPU_FOREIGN: 0 bytes) */
int vgpu_mem_limit(int dev, uint64_t *limit);
uint64_t now_ns(void);

#endif
