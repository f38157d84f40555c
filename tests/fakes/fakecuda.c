/*
 * fakecuda.c - a fake libcuda.so.1 for tests (no GPU needed).
 *
 * Simulates: devices with memory (from FAKE_NVML_CONFIG, see fakenvml.c; default one H200 of
 * 143771 MiB), contexts (primary and created; each costs FAKE_CUDA_CTX_MIB of device memory,
 * default 300), streams, memory pools, VMM handles, arrays, modules/functions, kernel launches
 * with simulated execution time, modules and libraries that take device memory (an image declares its
 * size with a "FAKEMOD:<bytes>" header, see image_bytes), stream capture and CUDA graphs (graph memory nodes with a graph memory
 * pool per device, see tests/fakes/README.md), and cuGetProcAddress.
 *
 * Kernel time: a launch of gridDimX*gridDimY*gridDimZ blocks keeps its device busy for
 * FAKE_CUDA_NS_PER_LAUNCH + blocks * FAKE_CUDA_NS_PER_BLOCK ns (defaults 0 and 1000; a fixed cost
 * per launch makes the cost per block depend on the kernel's shape, as on a real GPU).  Work on one device runs serially, across
 * all processes that share FAKE_GPU_STATE.  A launch blocks while the device has more than
 * FAKE_CUDA_MAX_QUEUE_US of queued work (default 5000), like a full hardware queue.
 *
 * Context creation: FAKE_CUDA_CTX_RENDEZVOUS=N makes a new context wait, once it shows in NVML's process
 * list, until N processes are listed on its device (at most 10 s): processes started together each see
 * the others' contexts appear during their own creation, as with the real driver, where creating a
 * context takes a fraction of a second. FAKE_CUDA_CTX_GATE=PATH makes a new context say so on stderr and
 * wait (at most 60 s) until PATH exists.
 * FAKE_CUDA_RETAIN_GATE=PATH (FAKE_CUDA_MAP_GATE=PATH): cuMemRetainAllocationHandle, its reference taken
 * (cuMemMap, its mapping made), creates PATH.in and waits (at most 60 s) until PATH exists.
 * FAKE_CUDA_UNLOAD_GATE=PATH: the same for cuModuleUnload and cuLibraryUnload, the memory freed (the handle
 * can be handed out again meanwhile).
 * FAKE_CUDA_DESTROY_GATE=PATH: the same for cuCtxDestroy_v2, the context and its memory freed.
 * FAKE_CUDA_GRAPH_GATE=PATH (FAKE_CUDA_GRAPH_GATE_SKIP=N): the same for the (N + 1)th count query of a graph's
 * nodes or edges; FAKE_CUDA_GRAPH_COUNT_TOTAL=1: a listing into a smaller buffer answers the graph's total count;
 * FAKE_CUDA_GRAPH_GROW=1: each count query of a graph's nodes adds a node to it once answered.
 * FAKE_CUDA_EDGE_PROGRAMMATIC=K (FAKE_CUDA_EDGE_PORT=K): edge K of every graph is listed with programmatic data.
 * fake_cuda_debug_peak_bytes(dev) (exported, test hook) returns the most device memory this process held
 * at once on a device, as NVML's per-process usage showed it.
 * Busy intervals go to the shared state so the fake NVML reports utilisation.
 *
 * Errors follow the driver: calls before cuInit -> CUDA_ERROR_NOT_INITIALIZED, no current
 * context -> CUDA_ERROR_INVALID_CONTEXT, unknown or double free -> CUDA_ERROR_INVALID_VALUE,
 * beyond device memory -> CUDA_ERROR_OUT_OF_MEMORY.  Destroying a context frees its memory, its modules'
 * included.
 *
 * Build: gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -Wl,-Bsymbolic (Bsymbolic: the addresses
 * cuGetProcAddress hands out are the fake's own, as with the real driver, not interposed ones).
 */
#include "fakegpu.h"
#include "cuda_abi.h"

#define EXPORT __attribute__((visibility("default")))
#define MIB (1024ull * 1024ull)

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_inited;
static struct fg_config g_cfg;
static struct fg_state *g_st;
static uint64_t g_ns_per_block = 1000;
static uint64_t g_ns_per_launch = 0;
static uint64_t g_ctx_bytes[FG_MAX_DEV]; /* per GPU (config index): FAKE_CUDA_CTX_MIB */
static uint64_t g_max_queue_ns = 5000000;
static uint64_t g_next_addr = 0x7f0000000000ull;

/* ------------------------------------------------------------------ contexts */
struct fctx {
    int used;
    int dev;
    int primary;
    int refs;
    uint64_t tail_ns;
    size_t limits[3]; /* cuCtxSetLimit: stack (per thread), printf FIFO, malloc heap (bytes) */
    uint64_t stack_bytes; /* local memory a launch grew the stack by (stack_grow), freed with the context */
};
/* The stack size (bytes per thread) a context starts with, as the driver's default: its memory is part of
 * the context's (FAKE_CUDA_CTX_MIB). */
#define STACK_DEFAULT 1024
#define MAX_CTX 4096
static struct fctx g_ctx[MAX_CTX];
static int g_nctx;
static struct fctx *g_primary[FG_MAX_DEV];
static __thread struct fctx *t_cur;
static __thread struct fctx *t_stack[32];
static __thread int t_depth;

/* ------------------------------------------------------------------ allocations */
enum { K_PTR = 1, K_ARRAY = 2, K_MIPMAP = 3, K_HANDLE = 4 };
struct falloc {
    uint64_t key;
    uint64_t size;
    struct fctx *ctx;
    int dev;
    int kind;
    int maps;     /* K_HANDLE: live mappings of this physical allocation */
    int released; /* K_HANDLE: cuMemRelease was called; freed when the last mapping goes */
    int refs;     /* K_HANDLE: references beyond the creating one (cuMemRetainAllocationHandle, imports) */
    int xfd;      /* K_HANDLE: the last exported file descriptor (-1: none), alive while open */
    uint64_t xino; /* K_HANDLE: its inode, to tell it from a later file on the same number */
    int pool;     /* K_PTR from a memory pool: index + 1 in g_pool (its memory goes back to the pool) */
    int gpool;    /* K_PTR a graph's allocation node made: its memory goes back to the device's graph pool */
};
#define ATAB (1u << 17)
static struct falloc g_alloc[ATAB];

static unsigned a_hash(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (unsigned)k & (ATAB - 1);
}

static struct falloc *a_find(uint64_t key)
{
    for (unsigned i = a_hash(key), n = 0; n < ATAB; i = (i + 1) & (ATAB - 1), n++) {
        if (g_alloc[i].key == key)
            return &g_alloc[i];
        if (g_alloc[i].key == 0)
            return NULL;
    }
    return NULL;
}

static int a_insert(const struct falloc *a)
{
    for (unsigned i = a_hash(a->key), n = 0; n < ATAB; i = (i + 1) & (ATAB - 1), n++) {
        if (g_alloc[i].key == 0) {
            g_alloc[i] = *a;
            return 0;
        }
    }
    return -1;
}

static void a_remove(struct falloc *e)
{
    unsigned i = (unsigned)(e - g_alloc);
    g_alloc[i].key = 0;
    /* backward-shift deletion keeps linear probing chains intact */
    unsigned j = i;
    for (;;) {
        j = (j + 1) & (ATAB - 1);
        if (g_alloc[j].key == 0)
            return;
        unsigned h = a_hash(g_alloc[j].key);
        int move = (j > i) ? (h <= i || h > j) : (h <= i && h > j);
        if (move) {
            g_alloc[i] = g_alloc[j];
            g_alloc[j].key = 0;
            i = j;
        }
    }
}

/* ------------------------------------------------------------------ streams, pools, graphs */
struct fstream {
    int used;
    struct fctx *ctx;
    uint64_t tail_ns;
    int capturing;
    struct fgraph *cap;
    int cap_last; /* the node last captured from the stream (an index in cap), -1: none yet */
};
#define MAX_STREAM 4096
static struct fstream g_stream[MAX_STREAM];

/* Memory pools as the driver keeps them: an allocation takes from the pool's reserve, growing it (in
 * 2 MiB steps) when short; a free returns it to the pool, which keeps it reserved (device memory stays
 * used) until a synchronisation (cuStreamSynchronize, cuCtxSynchronize) releases what exceeds the
 * pool's release threshold (default 0), or cuMemPoolTrimTo. cuMemPoolGetAttribute reports it. */
struct fpool {
    int used;
    int dev;
    uint64_t reserved, in_use, threshold;
};
#define MAX_POOL 256
static struct fpool g_pool[MAX_POOL]; /* index < FG_MAX_DEV: default pools */
static void pools_sync(int dev);
static void pool_trim(struct fpool *fp, uint64_t keep);
struct fgraph;
static CUresult graph_mem_alloc(struct fgraph *fg, int dev, uint64_t bytes, CUdeviceptr *dptr, CUgraphNode *node,
                                const CUgraphNode *deps, size_t ndeps, struct fstream *cs);
static CUresult graph_mem_free(struct fgraph *fg, CUdeviceptr dptr, CUgraphNode *node, const CUgraphNode *deps,
                               size_t ndeps, struct fstream *cs);

struct fnode {
    int type;
    CUDA_KERNEL_NODE_PARAMS p;
    /* CU_GRAPH_NODE_TYPE_MEM_ALLOC / _MEM_FREE: the allocation's address, size and device (config index) */
    CUdeviceptr dptr;
    uint64_t bytes;
    int dev;
    struct fgraph *child; /* CU_GRAPH_NODE_TYPE_GRAPH: the child graph (owned by this node) */
};
#define GRAPH_NODES 4096
#define GRAPH_EDGES 8192
/* A graph's dependency edges, as the driver keeps them: node to[i] runs after node from[i] has completed (indices in
 * nodes[]). A node's dependencies are given when it is added (or, captured from a stream, the node captured before
 * it); cuGraphGetEdges(_v2) lists them. Nodes run in the order they were added, which respects every edge. */
struct fgraph {
    int used;
    int n;
    int mem;  /* holds memory nodes: at most one executable of it may exist at a time */
    int inst; /* executables of it alive */
    int owned; /* moved into a child graph node: its parent owns it */
    struct fnode nodes[GRAPH_NODES];
    int nedge;
    struct {
        int from, to;
    } edges[GRAPH_EDGES];
};
#define MAX_GRAPH 16
static struct fgraph g_graph[MAX_GRAPH];

/* 1 when each of deps is a node of fg and the edges a new node adds fit (captured from stream cs: one edge from the
 * node captured before it). */
static int deps_ok(const struct fgraph *fg, const CUgraphNode *deps, size_t ndeps, const struct fstream *cs)
{
    size_t need = cs ? (cs->cap_last >= 0) : ndeps;
    if ((ndeps && !deps) || need > (size_t)(GRAPH_EDGES - fg->nedge))
        return 0;
    for (size_t i = 0; !cs && i < ndeps; i++) {
        const struct fnode *d = (const struct fnode *)deps[i];
        if (d < fg->nodes || d >= fg->nodes + fg->n)
            return 0;
    }
    return 1;
}

/* Node k of fg depends on deps, or (captured from stream cs) on the node captured before it. deps_ok was true. */
static void node_link(struct fgraph *fg, int k, const CUgraphNode *deps, size_t ndeps, struct fstream *cs)
{
    if (cs) {
        if (cs->cap_last >= 0) {
            fg->edges[fg->nedge].from = cs->cap_last;
            fg->edges[fg->nedge++].to = k;
        }
        cs->cap_last = k;
        return;
    }
    for (size_t i = 0; i < ndeps; i++) {
        fg->edges[fg->nedge].from = (int)((const struct fnode *)deps[i] - fg->nodes);
        fg->edges[fg->nedge++].to = k;
    }
}

/* An executable graph keeps its memory nodes in order: each launch allocates (alloc nodes) and frees
 * (free nodes) in the device's graph memory pool. */
#define EXEC_MEMOPS 320
struct fmemop {
    int type; /* CU_GRAPH_NODE_TYPE_MEM_ALLOC or _MEM_FREE */
    int dev;
    CUdeviceptr dptr;
    uint64_t bytes;
};
struct fexec {
    int used;
    int n;
    uint64_t blocks;
    uint64_t local; /* the most local memory per thread of its kernels */
    struct fgraph *g;
    int nmem;
    struct fmemop mem[EXEC_MEMOPS];
};
#define MAX_EXEC 256
static struct fexec g_exec[MAX_EXEC];

/* The graph memory pool of each device (config index), per process as the driver keeps it: a launch's
 * allocation nodes take from its reserve, which grows (2 MiB steps, charged to the device) when short;
 * memory freed (a free node, cuMemFree, cuMemFreeAsync) goes back to the pool, which keeps it reserved
 * until cuDeviceGraphMemTrim. cuDeviceGetGraphMemAttribute reports it. */
struct fgpool {
    uint64_t reserved, used, reserved_high, used_high;
};
static struct fgpool g_gpool[FG_MAX_DEV];

/* A loaded module takes device memory in its context, as the driver's does for the module's code and its
 * static __device__ globals: the size an image declares (image_bytes), charged to the context's device,
 * freed at cuModuleUnload, at cuLibraryUnload for a library's modules, and with the context. */
struct flib;
struct fmod {
    int used;
    struct fctx *ctx;  /* the context it is loaded into */
    uint64_t bytes;    /* device memory it takes there */
    struct flib *lib;  /* the library it was loaded for (NULL: cuModuleLoad*) */
    struct {
        char name[32];
        uint64_t local; /* bytes of `.local` arrays per thread (ptx_frames) */
    } frames[8];
    int nframes;
};
#define MAX_MOD 1024
static struct fmod g_mod[MAX_MOD];
/* cuLibraryLoadData / cuLibraryLoadFromFile (CUDA 12, context-independent loading). With eager loading
 * (CUDA_MODULE_LOADING=EAGER at cuInit) the library is loaded into every context of the process at once and
 * into each later one; with lazy loading (unset or LAZY, the driver's default since CUDA 12.2) into a context
 * only at its first use there (lib_in: cuLibraryGetModule, cuKernelGetFunction, cuLibraryGetGlobal,
 * cuLibraryGetManaged, a launch of a CUkernel). */
struct flib {
    int used;
    uint64_t bytes; /* what each context's copy takes */
};
#define MAX_LIB 64
static struct flib g_lib[MAX_LIB];
static int g_lazy = 1; /* CUDA_MODULE_LOADING, read at cuInit */
static int lib_load_into(struct fctx *c);
/* A CUkernel (cuLibraryGetKernel): context-independent, a kernel of library lib. */
struct fkern {
    int used;
    struct flib *lib;
    char name[64];
};
#define MAX_KERN 256
static struct fkern g_kern[MAX_KERN];
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name);
static uint64_t local_bytes(const char *name);
struct ffunc {
    int used;
    char name[64];
    uint64_t local; /* bytes of local memory per thread (FAKE_CUDA_LOCAL_BYTES) */
};
static struct ffunc g_func[1024];

/* ------------------------------------------------------------------ helpers */
static uint64_t env_u64(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    return v && *v ? strtoull(v, NULL, 10) : dflt;
}

#define CHECK_INIT()                         \
    do {                                     \
        if (!__atomic_load_n(&g_inited, __ATOMIC_ACQUIRE)) \
            return CUDA_ERROR_NOT_INITIALIZED; \
    } while (0)

/* CUDA ordinals, like the driver's: the devices in CUDA_DEVICE_ORDER (FASTEST_FIRST, the default:
 * more SMs first, ties in PCI bus order; PCI_BUS_ID: bus order), then filtered and reordered by
 * CUDA_VISIBLE_DEVICES (indices into that order, or GPU UUIDs / unique UUID prefixes; the list ends
 * at the first entry that matches nothing). g_phys[ordinal] = position in the config = NVML index. */
static int g_phys[FG_MAX_DEV];
static int g_nvis;
#define PH(d) (g_phys[(d)])

static void map_devices(void)
{
    int order[FG_MAX_DEV], n = g_cfg.count;
    for (int i = 0; i < n; i++)
        order[i] = i;
    const char *ord = getenv("CUDA_DEVICE_ORDER");
    int fastest = !ord || strcmp(ord, "PCI_BUS_ID");
    for (int i = 1; i < n; i++) { /* insertion sort, stable */
        for (int j = i; j > 0; j--) {
            const struct fg_gpu *a = &g_cfg.gpu[order[j - 1]], *b = &g_cfg.gpu[order[j]];
            int cmp = fastest && a->sm_count != b->sm_count ? (a->sm_count < b->sm_count) : strcmp(a->pci, b->pci) > 0;
            if (!cmp)
                break;
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    }
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    if (!vis) {
        memcpy(g_phys, order, sizeof(int) * (size_t)n);
        g_nvis = n;
        return;
    }
    g_nvis = 0;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", vis);
    for (char *tok = strtok(buf, ","); tok && g_nvis < FG_MAX_DEV; tok = strtok(NULL, ",")) {
        int found = -1;
        if (isdigit((unsigned char)tok[0])) {
            int k = atoi(tok);
            found = k >= 0 && k < n ? order[k] : -1;
        } else {
            for (int i = 0; i < n; i++)
                if (!strncasecmp(g_cfg.gpu[order[i]].uuid, tok, strlen(tok)))
                    found = found < 0 ? order[i] : -2; /* ambiguous prefix */
        }
        if (found < 0)
            break;
        g_phys[g_nvis++] = found;
    }
}

static int dev_ok(CUdevice d)
{
    return d >= 0 && d < g_nvis;
}

static int ordinal_of(int phys)
{
    for (int i = 0; i < g_nvis; i++)
        if (g_phys[i] == phys)
            return i;
    return -1;
}

static uint64_t dev_total(int dev)
{
    return g_cfg.gpu[dev].memory_mib * MIB;
}

/* The most device memory this process ever held on each device (fake_cuda_debug_peak_bytes). */
static uint64_t g_peak[FG_MAX_DEV];

static CUresult charge(int dev, uint64_t size)
{
    CUresult rc = CUDA_SUCCESS;
    fg_lock(g_st);
    /* the memory of processes that have exited is free, as the driver frees it at their exit */
    if (size <= dev_total(dev) && g_st->dev[dev].used > dev_total(dev) - size)
        fg_reap_locked(g_st);
    /* larger than the device, or more than is free: refuse (no wrap-around of the counter) */
    if (size > dev_total(dev) || g_st->dev[dev].used > dev_total(dev) - size) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        g_st->dev[dev].used += size;
        int me = fg_host_pid();
        fg_proc_add_locked(g_st, me, dev, (int64_t)size);
        for (int k = 0; k < FG_MAX_PROC; k++)
            if (g_st->procs[k].pid == me && g_st->procs[k].dev == dev && g_st->procs[k].used > g_peak[dev])
                g_peak[dev] = g_st->procs[k].used;
    }
    fg_unlock(g_st);
    return rc;
}

/* Test hook: the most device memory (bytes) this process held at once on device index dev since it
 * loaded the fake, as NVML's per-process usage showed it; 0 for an unknown device. */
EXPORT unsigned long long fake_cuda_debug_peak_bytes(int dev)
{
    if (dev < 0 || dev >= FG_MAX_DEV || !g_st)
        return 0;
    fg_lock(g_st);
    unsigned long long v = g_peak[dev];
    fg_unlock(g_st);
    return v;
}

/* Test hook: the device memory (bytes) this process holds on device index dev now, as NVML's per-process
 * usage shows it; 0 for an unknown device. */
EXPORT unsigned long long fake_cuda_debug_held_bytes(int dev)
{
    if (dev < 0 || dev >= FG_MAX_DEV || !g_st)
        return 0;
    unsigned long long v = 0;
    int me = fg_host_pid();
    fg_lock(g_st);
    for (int k = 0; k < FG_MAX_PROC; k++)
        if (g_st->procs[k].pid == me && g_st->procs[k].dev == dev)
            v += g_st->procs[k].used;
    fg_unlock(g_st);
    return v;
}

static void uncharge(int dev, uint64_t size)
{
    fg_lock(g_st);
    g_st->dev[dev].used = g_st->dev[dev].used > size ? g_st->dev[dev].used - size : 0;
    fg_proc_add_locked(g_st, fg_host_pid(), dev, -(int64_t)size);
    fg_unlock(g_st);
}

static uint64_t next_addr(uint64_t size)
{
    uint64_t a = __atomic_fetch_add(&g_next_addr, (size + 0xffffull) & ~0xffffull ? (size + 0xffffull) & ~0xffffull : 0x10000ull, __ATOMIC_RELAXED);
    return a;
}

static CUresult new_alloc(unsigned long long *out, uint64_t size, int dev, struct fctx *ctx, int kind)
{
    if (size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = charge(dev, size);
    if (rc)
        return rc;
    struct falloc a = {.key = next_addr(size), .size = size, .ctx = ctx, .dev = dev, .kind = kind, .xfd = -1};
    pthread_mutex_lock(&g_mu);
    int ok = a_insert(&a);
    pthread_mutex_unlock(&g_mu);
    if (ok != 0) {
        uncharge(dev, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = a.key;
    return CUDA_SUCCESS;
}

static CUresult free_alloc(uint64_t key, int kind)
{
    pthread_mutex_lock(&g_mu);
    struct falloc *e = a_find(key);
    if (!e || e->kind != kind || !e->ctx->used) {
        pthread_mutex_unlock(&g_mu);
        return kind == K_PTR ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_INVALID_HANDLE;
    }
    int dev = e->dev;
    uint64_t size = e->size;
    int pool = e->pool;
    int gpool = e->gpool;
    a_remove(e);
    if (gpool) { /* back to the graph pool, which keeps it reserved until cuDeviceGraphMemTrim */
        g_gpool[dev].used = g_gpool[dev].used > size ? g_gpool[dev].used - size : 0;
        pthread_mutex_unlock(&g_mu);
        return CUDA_SUCCESS;
    }
    if (pool) { /* back to its pool, which keeps it reserved (a destroyed pool gives it back to the device) */
        struct fpool *fp = &g_pool[pool - 1];
        fp->in_use -= size;
        int gone = !fp->used;
        pthread_mutex_unlock(&g_mu);
        if (gone)
            pool_trim(fp, 0);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mu);
    uncharge(dev, size);
    return CUDA_SUCCESS;
}

/* FAKE_CUDA_CTX_GATE=PATH: a new context (its memory taken) says so on stderr and waits, at most 60 s,
 * until PATH exists: a test plays what other threads do while a context creation is in the driver. */
static void gate(void)
{
    const char *path = getenv("FAKE_CUDA_CTX_GATE");
    if (!path || !*path)
        return;
    static const char msg[] = "fake cuda: context creation waits at the gate\n";
    if (write(2, msg, sizeof msg - 1) < 0)
        return;
    for (uint64_t deadline = fg_now_ns() + 60000000000ull; access(path, F_OK) != 0 && fg_now_ns() < deadline;)
        fg_sleep_until(fg_now_ns() + 1000000);
}

/* FAKE_CUDA_CTX_RENDEZVOUS (see the top of this file) */
static void rendezvous(int dev)
{
    uint64_t want = env_u64("FAKE_CUDA_CTX_RENDEZVOUS", 0), deadline = fg_now_ns() + 10000000000ull;
    while (want > 1 && fg_now_ns() < deadline) {
        uint64_t n = 0;
        fg_lock(g_st);
        for (int k = 0; k < FG_MAX_PROC; k++)
            n += g_st->procs[k].pid && g_st->procs[k].dev == dev;
        fg_unlock(g_st);
        if (n >= want)
            return;
        fg_sleep_until(fg_now_ns() + 1000000);
    }
}

static struct fctx *ctx_new(int dev, int primary)
{
    pthread_mutex_lock(&g_mu);
    if (g_nctx >= MAX_CTX) {
        pthread_mutex_unlock(&g_mu);
        return NULL;
    }
    struct fctx *c = &g_ctx[g_nctx++];
    c->used = 1;
    c->dev = dev;
    c->primary = primary;
    c->refs = 1;
    c->limits[0] = STACK_DEFAULT;
    c->stack_bytes = 0;
    pthread_mutex_unlock(&g_mu);
    if (charge(dev, g_ctx_bytes[dev]) != CUDA_SUCCESS) {
        c->used = 0;
        return NULL;
    }
    if (lib_load_into(c) != 0) { /* the libraries loaded (a copy of each in every context) do not fit */
        uncharge(dev, g_ctx_bytes[dev]);
        c->used = 0;
        return NULL;
    }
    rendezvous(dev);
    gate();
    return c;
}

static void ctx_free(struct fctx *c)
{
    uint64_t freed = 0;
    pthread_mutex_lock(&g_mu);
    if (!c->used) {
        pthread_mutex_unlock(&g_mu);
        return;
    }
    c->used = 0;
    for (unsigned i = 0; i < ATAB;) {
        if (g_alloc[i].key && g_alloc[i].ctx == c && g_alloc[i].kind == K_HANDLE) {
            g_alloc[i].ctx = NULL; /* cuMemCreate memory belongs to no context: the driver keeps it */
        } else if (g_alloc[i].key && g_alloc[i].ctx == c) {
            if (g_alloc[i].pool)
                g_pool[g_alloc[i].pool - 1].in_use -= g_alloc[i].size;
            else if (g_alloc[i].gpool)
                g_gpool[g_alloc[i].dev].used -= g_alloc[i].size;
            else
                freed += g_alloc[i].size;
            a_remove(&g_alloc[i]); /* may shift a later entry into i: re-examine i */
            continue;
        }
        i++;
    }
    for (int i = 0; i < MAX_STREAM; i++)
        if (g_stream[i].used && g_stream[i].ctx == c)
            g_stream[i].used = 0;
    for (int i = 0; i < MAX_MOD; i++) { /* its modules, libraries' copies included, go with it */
        if (g_mod[i].used && g_mod[i].ctx == c) {
            freed += g_mod[i].bytes;
            g_mod[i].used = 0;
        }
    }
    freed += c->stack_bytes; /* what launches grew its stack by */
    c->stack_bytes = 0;
    pthread_mutex_unlock(&g_mu);
    uncharge(c->dev, freed + g_ctx_bytes[c->dev]);
}

static struct fstream *stream_of(CUstream s)
{
    uintptr_t v = (uintptr_t)s;
    if (v == 0 || v == 1 || v == 2)
        return NULL;
    struct fstream *fs = (struct fstream *)s;
    if (fs < g_stream || fs >= g_stream + MAX_STREAM || !fs->used)
        return NULL;
    return fs;
}

/* The per-thread default stream (CU_STREAM_PER_THREAD, or NULL through a _ptsz entry point): only its
 * capture state is its own (work on it runs like the default stream's). */
#define PTDS ((CUstream)(uintptr_t)2)
static __thread struct fstream t_ptds;

/* The stream whose capture state s names: the per-thread default stream's, or stream_of(s). */
static struct fstream *cap_stream(CUstream s)
{
    return s == PTDS ? &t_ptds : stream_of(s);
}

static int stream_valid(CUstream s)
{
    uintptr_t v = (uintptr_t)s;
    return v <= 2 || stream_of(s) != NULL;
}

/* Queue `dur` ns of work on the device of ctx, for stream fs (NULL: default stream). */
static void schedule(struct fctx *ctx, struct fstream *fs, uint64_t dur)
{
    int dev = ctx->dev;
    uint64_t now = fg_now_ns();
    fg_lock(g_st);
    struct fg_dev *d = &g_st->dev[dev];
    uint64_t start = d->tail_ns > now ? d->tail_ns : now;
    uint64_t end = start + dur;
    d->tail_ns = end;
    if (dur) {
        struct fg_interval *iv = &d->ring[d->head % FG_RING];
        iv->pid = fg_host_pid();
        iv->start_ns = start;
        iv->end_ns = end;
        d->head++;
    }
    d->launches++;
    if (fs)
        fs->tail_ns = end;
    if (ctx->tail_ns < end)
        ctx->tail_ns = end;
    fg_unlock(g_st);
    if (end > now + g_max_queue_ns)
        fg_sleep_until(end - g_max_queue_ns);
}

/* ------------------------------------------------------------------ init, device */
EXPORT CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    if (!g_inited) {
        if (fg_load_config(&g_cfg) != 0 || g_cfg.count == 0) {
            pthread_mutex_unlock(&g_mu);
            return CUDA_ERROR_NO_DEVICE;
        }
        g_st = fg_open_state();
        if (!g_st) {
            pthread_mutex_unlock(&g_mu);
            return CUDA_ERROR_NOT_INITIALIZED;
        }
        map_devices();
        if (g_nvis == 0) {
            pthread_mutex_unlock(&g_mu);
            return CUDA_ERROR_NO_DEVICE;
        }
        g_ns_per_block = env_u64("FAKE_CUDA_NS_PER_BLOCK", 1000);
        g_ns_per_launch = env_u64("FAKE_CUDA_NS_PER_LAUNCH", 0);
        const char *ml = getenv("CUDA_MODULE_LOADING");
        g_lazy = !(ml && !strcmp(ml, "EAGER"));
        /* one value for every GPU, or a comma-separated list, one per GPU index (the last repeats):
         * GPUs of different models have different context costs */
        const char *cm = getenv("FAKE_CUDA_CTX_MIB");
        uint64_t mib = 300;
        for (int d = 0; d < FG_MAX_DEV; d++) {
            if (cm && *cm) {
                mib = strtoull(cm, NULL, 10);
                cm = strchr(cm, ',');
                cm = cm ? cm + 1 : NULL;
            }
            g_ctx_bytes[d] = mib * MIB;
        }
        g_max_queue_ns = env_u64("FAKE_CUDA_MAX_QUEUE_US", 5000) * 1000;
        __atomic_store_n(&g_inited, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int *v)
{
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    *v = g_inited ? g_cfg.cuda_version : 12040;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *n)
{
    CHECK_INIT();
    if (!n)
        return CUDA_ERROR_INVALID_VALUE;
    *n = g_nvis;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    CHECK_INIT();
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice d)
{
    CHECK_INIT();
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", g_cfg.gpu[PH(d)].name);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d)
{
    CHECK_INIT();
    if (!u)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    memset(u, 0, sizeof(*u));
    const char *p = g_cfg.gpu[PH(d)].uuid;
    if (!strncmp(p, "GPU-", 4))
        p += 4;
    int n = 0;
    while (*p && n < 32) {
        if (*p == '-') {
            p++;
            continue;
        }
        unsigned v;
        if (sscanf(p, "%1x", &v) != 1)
            break;
        u->bytes[n / 2] = (unsigned char)(u->bytes[n / 2] | (n % 2 ? v : v << 4));
        n++;
        p++;
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d)
{
    return cuDeviceGetUuid(u, d);
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d)
{
    CHECK_INIT();
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = dev_total(PH(d));
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice d)
{
    size_t b = 0;
    CUresult rc = cuDeviceTotalMem_v2(&b, d);
    if (rc == CUDA_SUCCESS)
        *bytes = b > 0xffffffffull ? 0xffffffffu : (unsigned)b;
    return rc;
}

EXPORT CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d)
{
    CHECK_INIT();
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    switch (attr) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
        *v = g_cfg.gpu[PH(d)].sm_count;
        break;
    case 39: /* MAX_THREADS_PER_MULTIPROCESSOR */
        *v = 2048;
        break;
    case 75: /* COMPUTE_CAPABILITY_MAJOR */
        *v = g_cfg.gpu[PH(d)].cc_major;
        break;
    case 76:
        *v = g_cfg.gpu[PH(d)].cc_minor;
        break;
    default:
        *v = 0;
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorString(CUresult e, const char **s)
{
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    switch (e) {
    case CUDA_SUCCESS:
        *s = "no error";
        break;
    case CUDA_ERROR_OUT_OF_MEMORY:
        *s = "out of memory";
        break;
    case CUDA_ERROR_INVALID_VALUE:
        *s = "invalid argument";
        break;
    default:
        *s = "fake cuda error";
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorName(CUresult e, const char **s)
{
    return cuGetErrorString(e, s);
}

/* ------------------------------------------------------------------ contexts */
EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice d)
{
    (void)flags;
    CHECK_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    struct fctx *c = ctx_new(PH(d), 0);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (t_cur && t_depth < 32)
        t_stack[t_depth++] = t_cur;
    t_cur = c;
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice d)
{
    return cuCtxCreate_v2(pctx, flags, d);
}

/* CUDA 11.4: execution-affinity parameters before the flags */
EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int nparams, unsigned int flags,
                               CUdevice d)
{
    if (nparams < 0 || (nparams > 0 && !params))
        return CUDA_ERROR_INVALID_VALUE;
    return cuCtxCreate_v2(pctx, flags, d);
}

/* CUDA 12.5: a parameter struct before the flags */
EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice d)
{
    if (params && params->numExecAffinityParams < 0)
        return CUDA_ERROR_INVALID_VALUE;
    return cuCtxCreate_v2(pctx, flags, d);
}

static struct fctx *ctx_of(CUcontext c)
{
    struct fctx *f = (struct fctx *)c;
    if (f < g_ctx || f >= g_ctx + MAX_CTX || !f->used)
        return NULL;
    return f;
}

static void call_gate(const char *env);

EXPORT CUresult cuCtxDestroy_v2(CUcontext c)
{
    CHECK_INIT();
    struct fctx *f = ctx_of(c);
    if (!f)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_cur == f)
        t_cur = t_depth ? t_stack[--t_depth] : NULL;
    if (f->primary) {
        pthread_mutex_lock(&g_mu);
        if (g_primary[f->dev] == f)
            g_primary[f->dev] = NULL;
        pthread_mutex_unlock(&g_mu);
    }
    ctx_free(f);
    call_gate("FAKE_CUDA_DESTROY_GATE");
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxDestroy(CUcontext c)
{
    return cuCtxDestroy_v2(c);
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    CHECK_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = (t_cur && t_cur->used) ? (CUcontext)t_cur : NULL;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext c)
{
    CHECK_INIT();
    if (c && !ctx_of(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    t_cur = (struct fctx *)c;
    return CUDA_SUCCESS;
}

/* Context c's stack size becomes `size` bytes per thread (lower: 0, only ever raised, as a launch grows it;
 * 1, cuCtxSetLimit, also lowered). Its memory is taken for every thread that can be resident: (size - 1024)
 * x 2048 threads per SM x SMs above the default (STACK_DEFAULT, part of the context's memory), kept by the
 * context and freed with it; CUDA_ERROR_OUT_OF_MEMORY (nothing changed) when the device has no room. */
static CUresult stack_set(struct fctx *c, uint64_t size, int lower)
{
    uint64_t per = (uint64_t)g_cfg.gpu[c->dev].sm_count * 2048u;
    uint64_t want = size > STACK_DEFAULT ? size - STACK_DEFAULT : 0;
    want = want > UINT64_MAX / per ? UINT64_MAX : want * per;
    pthread_mutex_lock(&g_mu);
    if (size <= c->limits[0] && !lower) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_SUCCESS;
    }
    uint64_t had = c->stack_bytes;
    if (want > had) {
        pthread_mutex_unlock(&g_mu);
        CUresult rc = charge(c->dev, want - had);
        if (rc != CUDA_SUCCESS)
            return rc;
        pthread_mutex_lock(&g_mu);
        if (c->stack_bytes != had) { /* another thread changed it meanwhile: give back, retry */
            pthread_mutex_unlock(&g_mu);
            uncharge(c->dev, want - had);
            return stack_set(c, size, lower);
        }
    }
    c->stack_bytes = want;
    c->limits[0] = size;
    pthread_mutex_unlock(&g_mu);
    if (had > want)
        uncharge(c->dev, had - want);
    return CUDA_SUCCESS;
}

/* cuCtxSetLimit / cuCtxGetLimit for the limits that take device memory: 0 stack size (per thread),
 * 1 printf FIFO size, 2 malloc heap size; like the driver, stored per context. */
EXPORT CUresult cuCtxSetLimit(int limit, size_t value)
{
    CHECK_INIT();
    if (!t_cur || !t_cur->used)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (limit < 0 || limit > 2)
        return CUDA_ERROR_INVALID_VALUE;
    if (limit == 0) /* the stack: its memory as a launch's growth takes it (stack_set) */
        return stack_set(t_cur, value, 1);
    t_cur->limits[limit] = value;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetLimit(size_t *value, int limit)
{
    CHECK_INIT();
    if (!value || limit < 0 || limit > 2)
        return CUDA_ERROR_INVALID_VALUE;
    if (!t_cur || !t_cur->used)
        return CUDA_ERROR_INVALID_CONTEXT;
    *value = t_cur->limits[limit];
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext c)
{
    CHECK_INIT();
    if (!ctx_of(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_cur && t_depth < 32)
        t_stack[t_depth++] = t_cur;
    t_cur = (struct fctx *)c;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    CHECK_INIT();
    if (!t_cur)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (pctx)
        *pctx = (CUcontext)t_cur;
    t_cur = t_depth ? t_stack[--t_depth] : NULL;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *d)
{
    CHECK_INIT();
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    if (!t_cur || !t_cur->used)
        return CUDA_ERROR_INVALID_CONTEXT;
    *d = ordinal_of(t_cur->dev);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSynchronize(void)
{
    CHECK_INIT();
    if (!t_cur || !t_cur->used)
        return CUDA_ERROR_INVALID_CONTEXT;
    fg_sleep_until(t_cur->tail_ns);
    pools_sync(t_cur->dev);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice d)
{
    CHECK_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    struct fctx *c = g_primary[PH(d)];
    if (c && c->used) {
        c->refs++;
        pthread_mutex_unlock(&g_mu);
        *pctx = (CUcontext)c;
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mu);
    c = ctx_new(PH(d), 1);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_mu);
    g_primary[PH(d)] = c;
    pthread_mutex_unlock(&g_mu);
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d)
{
    CHECK_INIT();
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    struct fctx *c = g_primary[PH(d)];
    if (!c || !c->used) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    int last = --c->refs == 0;
    if (last)
        g_primary[PH(d)] = NULL;
    pthread_mutex_unlock(&g_mu);
    if (last) {
        if (t_cur == c)
            t_cur = NULL;
        ctx_free(c);
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice d)
{
    CHECK_INIT();
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    struct fctx *c = g_primary[PH(d)];
    g_primary[PH(d)] = NULL;
    pthread_mutex_unlock(&g_mu);
    if (c) {
        if (t_cur == c)
            t_cur = NULL;
        ctx_free(c);
    }
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ memory */
#define NEED_CTX()                                  \
    do {                                            \
        CHECK_INIT();                               \
        if (!t_cur || !t_cur->used)                 \
            return CUDA_ERROR_INVALID_CONTEXT;      \
    } while (0)

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size)
{
    NEED_CTX();
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    return new_alloc(p, size, t_cur->dev, t_cur, K_PTR);
}

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t size, unsigned int flags)
{
    (void)flags;
    return cuMemAlloc_v2(p, size);
}

EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t width, size_t height, unsigned int elem)
{
    NEED_CTX();
    if (!p || !pitch || !width || !height || (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t pt = (width + 511) & ~(size_t)511;
    CUresult rc = new_alloc(p, (uint64_t)pt * height, t_cur->dev, t_cur, K_PTR);
    if (rc == CUDA_SUCCESS)
        *pitch = pt;
    return rc;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p)
{
    NEED_CTX();
    if (p == 0)
        return CUDA_SUCCESS;
    return free_alloc(p, K_PTR);
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b)
{
    NEED_CTX();
    if (!free_b || !total_b)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t tot = dev_total(t_cur->dev);
    fg_lock(g_st);
    uint64_t used = g_st->dev[t_cur->dev].used;
    fg_unlock(g_st);
    *total_b = tot;
    *free_b = used < tot ? tot - used : 0;
    return CUDA_SUCCESS;
}

static struct fpool *pool_of(CUmemoryPool p)
{
    struct fpool *fp = (struct fpool *)p;
    if (fp < g_pool || fp >= g_pool + MAX_POOL || !fp->used)
        return NULL;
    return fp;
}

/* An allocation from pool fp: taken from its reserve, which grows (2 MiB steps) when short. */
static CUresult pool_alloc(unsigned long long *out, uint64_t size, struct fpool *fp, struct fctx *ctx)
{
    if (size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    uint64_t avail = fp->reserved - fp->in_use;
    uint64_t grow = size > avail ? ((size - avail) + (2 * MIB - 1)) & ~(2 * MIB - 1) : 0;
    pthread_mutex_unlock(&g_mu);
    if (grow && charge(fp->dev, grow))
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct falloc a = {.key = next_addr(size), .size = size, .ctx = ctx, .dev = fp->dev, .kind = K_PTR, .xfd = -1,
                       .pool = (int)(fp - g_pool) + 1};
    pthread_mutex_lock(&g_mu);
    fp->reserved += grow;
    int ok = a_insert(&a);
    if (ok == 0)
        fp->in_use += size;
    pthread_mutex_unlock(&g_mu);
    if (ok != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *out = a.key;
    return CUDA_SUCCESS;
}

/* Releases what pool fp holds beyond max(in use, keep). */
static void pool_trim(struct fpool *fp, uint64_t keep)
{
    pthread_mutex_lock(&g_mu);
    uint64_t floor = fp->in_use > keep ? fp->in_use : keep, drop = 0;
    if (floor < fp->reserved)
        floor = (floor + (2 * MIB - 1)) & ~(2 * MIB - 1);
    if (fp->reserved > floor) {
        drop = fp->reserved - floor;
        fp->reserved = floor;
    }
    pthread_mutex_unlock(&g_mu);
    if (drop)
        uncharge(fp->dev, drop);
}

/* A synchronisation: every pool of the device releases what exceeds its release threshold. */
static void pools_sync(int dev)
{
    for (int i = 0; i < MAX_POOL; i++)
        if (g_pool[i].used && g_pool[i].dev == dev)
            pool_trim(&g_pool[i], g_pool[i].threshold);
}

enum { FAKE_POOL_THRESHOLD = 4, FAKE_POOL_RESERVED = 5, FAKE_POOL_USED = 7 }; /* CUmemPool_attribute */

EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value)
{
    CHECK_INIT();
    struct fpool *fp = pool_of(pool);
    if (!fp || !value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    uint64_t v = attr == FAKE_POOL_THRESHOLD ? fp->threshold : attr == FAKE_POOL_RESERVED ? fp->reserved
                 : attr == FAKE_POOL_USED ? fp->in_use : UINT64_MAX;
    pthread_mutex_unlock(&g_mu);
    if (v == UINT64_MAX && attr != FAKE_POOL_THRESHOLD)
        return CUDA_ERROR_INVALID_VALUE;
    *(uint64_t *)value = v;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
    CHECK_INIT();
    struct fpool *fp = pool_of(pool);
    if (!fp || !value || attr != FAKE_POOL_THRESHOLD)
        return CUDA_ERROR_INVALID_VALUE;
    fp->threshold = *(uint64_t *)value;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice d)
{
    CHECK_INIT();
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    g_pool[d].used = 1;
    g_pool[d].dev = PH(d);
    *pool = (CUmemoryPool)&g_pool[d];
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice d)
{
    return cuDeviceGetDefaultMemPool(pool, d);
}

EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    CHECK_INIT();
    if (!pool || !props || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE || !dev_ok(props->location.id))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    for (int i = FG_MAX_DEV; i < MAX_POOL; i++) {
        if (!g_pool[i].used && !g_pool[i].reserved) { /* a destroyed pool's place once it holds nothing */
            g_pool[i] = (struct fpool){.used = 1, .dev = PH(props->location.id)};
            pthread_mutex_unlock(&g_mu);
            *pool = (CUmemoryPool)&g_pool[i];
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    CHECK_INIT();
    struct fpool *fp = pool_of(pool);
    if (!fp || fp < g_pool + FG_MAX_DEV)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    fp->used = 0;
    pthread_mutex_unlock(&g_mu);
    pool_trim(fp, 0); /* the reserve goes back to the device; what is still allocated, as it is freed */
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    CHECK_INIT();
    struct fpool *fp = pool_of(pool);
    if (!fp)
        return CUDA_ERROR_INVALID_VALUE;
    pool_trim(fp, keep);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t size, CUstream s)
{
    NEED_CTX();
    if (!p || !stream_valid(s))
        return CUDA_ERROR_INVALID_VALUE;
    struct fstream *fs = stream_of(s);
    struct fctx *c = fs ? fs->ctx : t_cur;
    int ord = 0;
    while (ord < g_nvis - 1 && PH(ord) != c->dev)
        ord++;
    struct fstream *cs = cap_stream(s);
    if (cs && cs->capturing) /* recorded as an allocation node: the graph allocates at each launch */
        return size ? graph_mem_alloc(cs->cap, c->dev, size, p, NULL, NULL, 0, cs) : CUDA_ERROR_INVALID_VALUE;
    CUmemoryPool def;
    cuDeviceGetDefaultMemPool(&def, ord); /* the device's current pool */
    return pool_alloc(p, size, pool_of(def), c);
}

EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t size, CUstream s)
{
    return cuMemAllocAsync(p, size, s ? s : PTDS);
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t size, CUmemoryPool pool, CUstream s)
{
    NEED_CTX();
    struct fpool *fp = pool_of(pool);
    if (!p || !fp || !stream_valid(s))
        return CUDA_ERROR_INVALID_VALUE;
    struct fstream *cs = cap_stream(s);
    if (cs && cs->capturing)
        return size ? graph_mem_alloc(cs->cap, fp->dev, size, p, NULL, NULL, 0, cs) : CUDA_ERROR_INVALID_VALUE;
    return pool_alloc(p, size, fp, t_cur);
}

EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t size, CUmemoryPool pool, CUstream s)
{
    return cuMemAllocFromPoolAsync(p, size, pool, s ? s : PTDS);
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    NEED_CTX();
    if (!stream_valid(s))
        return CUDA_ERROR_INVALID_VALUE;
    struct fstream *cs = cap_stream(s);
    if (cs && cs->capturing) /* a free node: only a graph's allocation can be freed by one */
        return graph_mem_free(cs->cap, p, NULL, NULL, 0, cs);
    return free_alloc(p, K_PTR);
}

EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s)
{
    return cuMemFreeAsync(p, s ? s : PTDS);
}

/* ---- virtual memory management, with the driver's semantics: cuMemCreate allocates physical memory
 * (sizes in multiples of the 2 MiB granularity); cuMemMap maps it into a range reserved with
 * cuMemAddressReserve; cuMemRelease drops the handle but the physical memory stays allocated until
 * every mapping of it is unmapped (the CUDA samples release right after mapping); cuMemUnmap may
 * cover several adjacent mappings. */
#define VMM_GRAN (2ull * MIB)
struct fva {
    uint64_t va, size;
    int used;
};
struct fmap {
    uint64_t va, size, handle;
    int used;
};
#define MAX_VA 1024
#define MAX_MAP 8192
static struct fva g_va[MAX_VA];
static struct fmap g_map[MAX_MAP];

EXPORT CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option)
{
    (void)option;
    CHECK_INIT();
    if (!g || !prop)
        return CUDA_ERROR_INVALID_VALUE;
    *g = VMM_GRAN;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags)
{
    (void)flags;
    NEED_CTX();
    if (!h || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || !dev_ok(prop->location.id) ||
        size % VMM_GRAN)
        return CUDA_ERROR_INVALID_VALUE;
    return new_alloc(h, size, PH(prop->location.id), t_cur, K_HANDLE);
}

/* Whether the file descriptor exported last from e is still open (the driver keeps the memory while a
 * shareable handle refers to it). */
static int export_alive(const struct falloc *e)
{
    struct stat st;
    return e->xfd >= 0 && fstat(e->xfd, &st) == 0 && (uint64_t)st.st_ino == e->xino;
}

/* Caller holds g_mu. Frees a released handle's physical memory once unmapped, no other reference to it
 * is held and no exported file descriptor of it is open; returns bytes to uncharge. */
static uint64_t handle_maybe_free_locked(struct falloc *e, int *dev)
{
    if (!e->released || e->maps > 0 || e->refs > 0 || export_alive(e))
        return 0;
    uint64_t size = e->size;
    *dev = e->dev;
    a_remove(e);
    return size;
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    NEED_CTX();
    pthread_mutex_lock(&g_mu);
    struct falloc *e = a_find(h);
    if (!e || e->kind != K_HANDLE || (e->released && !e->refs)) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (e->refs) /* one of the references taken since (they share the handle's value) */
        e->refs--;
    else
        e->released = 1;
    int dev = 0;
    uint64_t freed = handle_maybe_free_locked(e, &dev);
    pthread_mutex_unlock(&g_mu);
    if (freed)
        uncharge(dev, freed);
    return CUDA_SUCCESS;
}

/* The handle backing the mapping at addr (the same value that was mapped), with one more reference that
 * needs its own cuMemRelease, as the driver's. */
/* FAKE_CUDA_RETAIN_GATE / FAKE_CUDA_MAP_GATE=PATH (env): a retain that took its reference, or a map that made
 * its mapping, creates PATH.in and waits, at most 60 s, until PATH exists before returning: a test plays what
 * other threads do while the call is in the driver. */
static void call_gate(const char *env)
{
    const char *path = getenv(env);
    char in[4096];
    if (!path || !*path || snprintf(in, sizeof in, "%s.in", path) >= (int)sizeof in)
        return;
    int fd = open(in, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    if (fd >= 0)
        close(fd);
    for (uint64_t deadline = fg_now_ns() + 60000000000ull; access(path, F_OK) != 0 && fg_now_ns() < deadline;)
        fg_sleep_until(fg_now_ns() + 1000000);
}

EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
    CHECK_INIT();
    if (!h)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t a = (uint64_t)(uintptr_t)addr;
    pthread_mutex_lock(&g_mu);
    for (int k = 0; k < MAX_MAP; k++) {
        struct falloc *e = g_map[k].used && a >= g_map[k].va && a < g_map[k].va + g_map[k].size
                               ? a_find(g_map[k].handle) : NULL;
        if (e && e->kind == K_HANDLE) {
            e->refs++;
            *h = g_map[k].handle;
            pthread_mutex_unlock(&g_mu);
            call_gate("FAKE_CUDA_RETAIN_GATE");
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_INVALID_VALUE;
}

/* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR only: a new file descriptor (*(int *)out) that keeps the
 * physical memory allocated while it is open, whatever happens to the handle. */
EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                             unsigned long long flags)
{
    CHECK_INIT();
    if (!out || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || flags)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct falloc *e = a_find(h);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (e && e->kind == K_HANDLE && (!e->released || e->refs)) {
        uint64_t rec[2] = {(uint64_t)getpid(), h};
        struct stat st;
        int fd = memfd_create("fake-cuda-shareable", MFD_CLOEXEC);
        if (fd >= 0 && pwrite(fd, rec, sizeof rec, 0) == (ssize_t)sizeof rec && fstat(fd, &st) == 0) {
            e->xfd = fd;
            e->xino = (uint64_t)st.st_ino;
            *(int *)out = fd;
            rc = CUDA_SUCCESS;
        } else {
            if (fd >= 0)
                close(fd);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* A handle to the memory an exported file descriptor refers to (passed as the integer value of
 * osHandle), with a reference of its own. The fake's allocations live in their process: memory exported
 * by another process is CUDA_ERROR_NOT_SUPPORTED here. */
EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *osHandle, int type)
{
    CHECK_INIT();
    if (!h || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t rec[2];
    if (pread((int)(intptr_t)osHandle, rec, sizeof rec, 0) != (ssize_t)sizeof rec)
        return CUDA_ERROR_INVALID_VALUE;
    if (rec[0] != (uint64_t)getpid())
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&g_mu);
    struct falloc *e = a_find(rec[1]);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (e && e->kind == K_HANDLE) {
        e->refs++;
        *h = rec[1];
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                                    unsigned long long flags)
{
    (void)align;
    (void)addr;
    (void)flags;
    CHECK_INIT();
    if (!ptr || !size || size % VMM_GRAN)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < MAX_VA; i++) {
        if (!g_va[i].used) {
            g_va[i].used = 1;
            g_va[i].size = size;
            g_va[i].va = next_addr(size);
            *ptr = g_va[i].va;
            pthread_mutex_unlock(&g_mu);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    CHECK_INIT();
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < MAX_VA; i++) {
        if (g_va[i].used && g_va[i].va == ptr && g_va[i].size == size) {
            for (int k = 0; k < MAX_MAP; k++)
                if (g_map[k].used && g_map[k].va >= ptr && g_map[k].va < ptr + size) {
                    pthread_mutex_unlock(&g_mu);
                    return CUDA_ERROR_INVALID_VALUE; /* still mapped */
                }
            g_va[i].used = 0;
            pthread_mutex_unlock(&g_mu);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long flags)
{
    CHECK_INIT();
    if (flags || !size || size % VMM_GRAN)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct falloc *e = a_find(h);
    int in_va = 0;
    for (int i = 0; i < MAX_VA; i++)
        if (g_va[i].used && ptr >= g_va[i].va && ptr + size <= g_va[i].va + g_va[i].size)
            in_va = 1;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (e && e->kind == K_HANDLE && (!e->released || e->refs) && in_va && offset + size <= e->size) {
        for (int k = 0; k < MAX_MAP; k++) /* overlapping an existing mapping */
            if (g_map[k].used && ptr < g_map[k].va + g_map[k].size && g_map[k].va < ptr + size)
                goto out;
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        for (int k = 0; k < MAX_MAP; k++) {
            if (!g_map[k].used) {
                g_map[k] = (struct fmap){ptr, size, h, 1};
                e->maps++;
                rc = CUDA_SUCCESS;
                break;
            }
        }
    }
out:
    pthread_mutex_unlock(&g_mu);
    if (rc == CUDA_SUCCESS)
        call_gate("FAKE_CUDA_MAP_GATE");
    return rc;
}

/* Unmaps every mapping inside [ptr, ptr + size); the range must start and end on mapping boundaries. */
EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CHECK_INIT();
    if (!size)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t freed[FG_MAX_DEV] = {0};
    pthread_mutex_lock(&g_mu);
    uint64_t covered = 0;
    for (int k = 0; k < MAX_MAP; k++) {
        struct fmap *m = &g_map[k];
        if (!m->used || m->va + m->size <= ptr || m->va >= ptr + size)
            continue;
        if (m->va < ptr || m->va + m->size > ptr + size) {
            pthread_mutex_unlock(&g_mu);
            return CUDA_ERROR_INVALID_VALUE; /* would split a mapping */
        }
        covered += m->size;
    }
    if (covered == 0) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (int k = 0; k < MAX_MAP; k++) {
        struct fmap *m = &g_map[k];
        if (!m->used || m->va < ptr || m->va >= ptr + size)
            continue;
        m->used = 0;
        struct falloc *e = a_find(m->handle);
        if (e && e->kind == K_HANDLE) {
            e->maps--;
            int dev = 0;
            uint64_t b = handle_maybe_free_locked(e, &dev);
            if (b && dev >= 0 && dev < FG_MAX_DEV)
                freed[dev] += b;
        }
    }
    pthread_mutex_unlock(&g_mu);
    for (int d = 0; d < FG_MAX_DEV; d++)
        if (freed[d])
            uncharge(d, freed[d]);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *desc, size_t count)
{
    (void)ptr;
    (void)size;
    (void)desc;
    (void)count;
    CHECK_INIT();
    return CUDA_SUCCESS;
}

/* Bytes of one channel of an array element, per format (in the order of CUarray_format); 0 for a
 * format the driver does not know: the create calls then fail with CUDA_ERROR_INVALID_VALUE, as the
 * driver's do. */
static uint64_t fmt_bytes(int f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
        return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
        return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
        return 4;
    case CU_AD_FORMAT_SIGNED_INT8:
        return 1;
    case CU_AD_FORMAT_SIGNED_INT16:
        return 2;
    case CU_AD_FORMAT_SIGNED_INT32:
        return 4;
    case CU_AD_FORMAT_HALF:
        return 2;
    case CU_AD_FORMAT_FLOAT:
        return 4;
    default:
        return 0;
    }
}

EXPORT CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d)
{
    NEED_CTX();
    if (!a || !d || !d->Width || !d->NumChannels || !fmt_bytes(d->Format))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t sz = (uint64_t)d->Width * (d->Height ? d->Height : 1) * fmt_bytes(d->Format) * d->NumChannels;
    unsigned long long k;
    CUresult rc = new_alloc(&k, sz, t_cur->dev, t_cur, K_ARRAY);
    if (rc == CUDA_SUCCESS)
        *a = (CUarray)(uintptr_t)k;
    return rc;
}

EXPORT CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    NEED_CTX();
    if (!a || !d || !d->Width || !d->NumChannels || !fmt_bytes(d->Format))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t sz = (uint64_t)d->Width * (d->Height ? d->Height : 1) * (d->Depth ? d->Depth : 1) *
                  fmt_bytes(d->Format) * d->NumChannels;
    unsigned long long k;
    CUresult rc = new_alloc(&k, sz, t_cur->dev, t_cur, K_ARRAY);
    if (rc == CUDA_SUCCESS)
        *a = (CUarray)(uintptr_t)k;
    return rc;
}

EXPORT CUresult cuArrayDestroy(CUarray a)
{
    NEED_CTX();
    return free_alloc((uint64_t)(uintptr_t)a, K_ARRAY);
}

EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *m, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels)
{
    NEED_CTX();
    if (!m || !d || !d->Width || !d->NumChannels || !levels || !fmt_bytes(d->Format))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t w = d->Width, h = d->Height, z = d->Depth, sz = 0;
    for (unsigned l = 0; l < levels; l++) {
        sz += w * (h ? h : 1) * (z ? z : 1) * fmt_bytes(d->Format) * d->NumChannels;
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : h;
        z = z > 1 ? z / 2 : z;
    }
    unsigned long long k;
    CUresult rc = new_alloc(&k, sz, t_cur->dev, t_cur, K_MIPMAP);
    if (rc == CUDA_SUCCESS)
        *m = (CUmipmappedArray)(uintptr_t)k;
    return rc;
}

EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray m)
{
    NEED_CTX();
    return free_alloc((uint64_t)(uintptr_t)m, K_MIPMAP);
}

/* ------------------------------------------------------------------ streams */
EXPORT CUresult cuStreamCreate(CUstream *s, unsigned int flags)
{
    (void)flags;
    NEED_CTX();
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < MAX_STREAM; i++) {
        if (!g_stream[i].used) {
            memset(&g_stream[i], 0, sizeof g_stream[i]);
            g_stream[i].used = 1;
            g_stream[i].ctx = t_cur;
            pthread_mutex_unlock(&g_mu);
            *s = (CUstream)&g_stream[i];
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream s)
{
    CHECK_INIT();
    struct fstream *fs = stream_of(s);
    if (!fs)
        return CUDA_ERROR_INVALID_HANDLE;
    fs->used = 0;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(CUstream s)
{
    NEED_CTX();
    if (!stream_valid(s))
        return CUDA_ERROR_INVALID_HANDLE;
    struct fstream *fs = stream_of(s);
    fg_sleep_until(fs ? fs->tail_ns : t_cur->tail_ns);
    pools_sync(t_cur->dev);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s)
{
    return cuStreamSynchronize(s);
}

EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, int mode)
{
    (void)mode;
    NEED_CTX();
    struct fstream *fs = cap_stream(s);
    if (!fs || fs->capturing)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < MAX_GRAPH; i++) {
        if (!g_graph[i].used) {
            g_graph[i].used = 1;
            g_graph[i].n = 0;
            g_graph[i].mem = g_graph[i].inst = g_graph[i].owned = g_graph[i].nedge = 0;
            fs->cap = &g_graph[i];
            fs->cap_last = -1;
            fs->capturing = 1;
            pthread_mutex_unlock(&g_mu);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuStreamBeginCapture(CUstream s, int mode)
{
    return cuStreamBeginCapture_v2(s, mode);
}

EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *g)
{
    NEED_CTX();
    struct fstream *fs = cap_stream(s);
    if (!fs || !fs->capturing || !g)
        return CUDA_ERROR_INVALID_VALUE;
    fs->capturing = 0;
    *g = (CUgraph)fs->cap;
    fs->cap = NULL;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamIsCapturing(CUstream s, int *status)
{
    CHECK_INIT();
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    struct fstream *fs = cap_stream(s);
    *status = fs && fs->capturing ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream s, int *status)
{
    return cuStreamIsCapturing(s ? s : PTDS, status);
}

/* ------------------------------------------------------------------ modules, libraries, launches */
/* The bytes of the PTX `.global` arrays a text image declares (`.visible .global .align 1 .b8 big[N];`:
 * element size from its .b/.u/.s/.f type, times N), as the driver allocates a module's __device__ globals;
 * instructions such as `ld.global` are not declarations. Reads at most 1 MiB of text. */
static uint64_t ptx_global_bytes(const char *p)
{
    uint64_t total = 0;
    size_t len = strnlen(p, 1u << 20);
    for (const char *g = p; (g = memmem(g, len - (size_t)(g - p), ".global", 7)) != NULL; g += 7) {
        if (g != p && !isspace((unsigned char)g[-1]))
            continue; /* ld.global, st.global, ... */
        const char *end = memchr(g, ';', len - (size_t)(g - p));
        const char *br = end ? memchr(g, '[', (size_t)(end - g)) : NULL;
        if (!br)
            continue;
        uint64_t elem = 1;
        for (const char *t = g; t < br; t++)
            if (*t == '.' && strchr("busf", t[1]) && isdigit((unsigned char)t[2]))
                elem = strtoull(t + 2, NULL, 10) / 8 ? strtoull(t + 2, NULL, 10) / 8 : 1;
        uint64_t n = strtoull(br + 1, NULL, 10);
        total += n > UINT64_MAX / elem / 2 ? UINT64_MAX / 2 : n * elem;
    }
    return total;
}

/* Device memory an image's module takes, rounded up to 2 MiB as the driver's allocations are: an image that
 * starts with "FAKEMOD:" followed by a decimal byte count (the fake's stand-in for a cubin's code and
 * .nv.global/.bss size, e.g. "FAKEMOD:1073741824\n") takes that many; PTX text its `.global` arrays
 * (ptx_global_bytes); anything else ("fake") none. */
#define MOD_MAGIC "FAKEMOD:"
static uint64_t image_bytes(const void *image)
{
    const char *p = image;
    if (!p)
        return 0;
    uint64_t v = strncmp(p, MOD_MAGIC, sizeof MOD_MAGIC - 1) ? ptx_global_bytes(p)
                                                              : strtoull(p + sizeof MOD_MAGIC - 1, NULL, 10);
    uint64_t page = 2 * MIB;
    return v > UINT64_MAX - page ? UINT64_MAX : (v + page - 1) / page * page;
}

/* The first bytes of a file (NUL-terminated) for image_bytes: 0, or -1 when it cannot be read. */
static int file_head(const char *path, char *buf, size_t len)
{
    FILE *f = path ? fopen(path, "rb") : NULL;
    if (!f)
        return -1;
    size_t n = fread(buf, 1, len - 1, f);
    fclose(f);
    buf[n] = 0;
    return 0;
}

/* Loads a module of `bytes` into context c (for library lib, or NULL): its memory is taken on c's device. */
static CUresult mod_new(struct fctx *c, uint64_t bytes, struct flib *lib, struct fmod **out)
{
    pthread_mutex_lock(&g_mu);
    struct fmod *fm = NULL;
    for (int i = 0; i < MAX_MOD && !fm; i++)
        if (!g_mod[i].used)
            fm = &g_mod[i];
    if (fm)
        *fm = (struct fmod){.used = 1, .ctx = c, .bytes = 0, .lib = lib};
    pthread_mutex_unlock(&g_mu);
    if (!fm)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (bytes && charge(c->dev, bytes) != CUDA_SUCCESS) {
        fm->used = 0;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    fm->bytes = bytes;
    if (out)
        *out = fm;
    return CUDA_SUCCESS;
}

/* Unloads a module: its memory is free again. */
static void mod_free(struct fmod *fm)
{
    pthread_mutex_lock(&g_mu);
    int dev = fm->used && fm->ctx ? fm->ctx->dev : -1;
    uint64_t bytes = fm->bytes;
    fm->used = 0;
    pthread_mutex_unlock(&g_mu);
    if (dev >= 0 && bytes)
        uncharge(dev, bytes);
}

static CUresult mod_load(CUmodule *m, uint64_t bytes)
{
    NEED_CTX();
    if (!m)
        return CUDA_ERROR_INVALID_VALUE;
    struct fmod *fm = NULL;
    CUresult rc = mod_new(t_cur, bytes, NULL, &fm);
    if (rc == CUDA_SUCCESS)
        *m = (CUmodule)fm;
    return rc;
}

/* The local memory per thread of the first 8 `.entry` kernels of a PTX text image: the bytes of the `.local`
 * arrays each declares (`.local .align 8 .b8 buf[65536];`, element size times count, as ptx_global_bytes), as
 * ptxas gives a kernel's local arrays a frame per thread. Reads at most 1 MiB of text. */
static void ptx_frames(const char *p, struct fmod *fm)
{
    size_t len = strnlen(p, 1u << 20);
    const char *end = p + len;
    for (const char *e = memmem(p, len, ".entry", 6); e && fm->nframes < 8;) {
        const char *n = e + 6;
        while (n < end && isspace((unsigned char)*n))
            n++;
        size_t k = 0;
        while (n + k < end && (isalnum((unsigned char)n[k]) || n[k] == '_' || n[k] == '$'))
            k++;
        const char *next = memmem(n, (size_t)(end - n), ".entry", 6);
        const char *stop = next ? next : end;
        uint64_t local = 0;
        for (const char *l = n; (l = memmem(l, (size_t)(stop - l), ".local", 6)) != NULL; l += 6) {
            const char *semi = memchr(l, ';', (size_t)(stop - l));
            const char *br = semi ? memchr(l, '[', (size_t)(semi - l)) : NULL;
            if (!br || (l != p && !isspace((unsigned char)l[-1])))
                continue; /* st.local / ld.local, or no array */
            uint64_t elem = 1;
            for (const char *t = l; t < br; t++)
                if (*t == '.' && strchr("busf", t[1]) && isdigit((unsigned char)t[2]))
                    elem = strtoull(t + 2, NULL, 10) / 8 ? strtoull(t + 2, NULL, 10) / 8 : 1;
            local += strtoull(br + 1, NULL, 10) * elem;
        }
        if (k && k < sizeof fm->frames[0].name) {
            memcpy(fm->frames[fm->nframes].name, n, k);
            fm->frames[fm->nframes].name[k] = 0;
            fm->frames[fm->nframes++].local = local;
        }
        e = next;
    }
}

/* A module from an image in memory: a PTX text image's kernels' frames recorded (ptx_frames). */
static CUresult mod_load_image(CUmodule *m, const void *image)
{
    CUresult rc = mod_load(m, image_bytes(image));
    const char *p = image;
    if (rc == CUDA_SUCCESS && p && strncmp(p, MOD_MAGIC, sizeof MOD_MAGIC - 1)) {
        struct fmod *fm = (struct fmod *)*m;
        pthread_mutex_lock(&g_mu);
        fm->nframes = 0;
        ptx_frames(p, fm);
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image)
{
    return mod_load_image(m, image);
}

EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned int n, int *options, void **values)
{
    (void)options;
    if (n && (!options || !values))
        return CUDA_ERROR_INVALID_VALUE;
    return mod_load_image(m, image);
}

EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *fatbin)
{
    return mod_load(m, image_bytes(fatbin));
}

EXPORT CUresult cuModuleLoad(CUmodule *m, const char *fname)
{
    char head[64];
    CHECK_INIT();
    if (file_head(fname, head, sizeof head) != 0)
        return CUDA_ERROR_FILE_NOT_FOUND;
    return mod_load(m, image_bytes(head));
}

static struct fmod *mod_of(CUmodule m)
{
    struct fmod *fm = (struct fmod *)m;
    return fm >= g_mod && fm < g_mod + MAX_MOD && fm->used ? fm : NULL;
}

EXPORT CUresult cuModuleUnload(CUmodule m)
{
    CHECK_INIT();
    struct fmod *fm = mod_of(m);
    if (!fm || fm->lib) /* a library's module goes with the library */
        return CUDA_ERROR_INVALID_HANDLE;
    mod_free(fm);
    call_gate("FAKE_CUDA_UNLOAD_GATE");
    return CUDA_SUCCESS;
}

/* Loads every live library into a new context c (eager loading only; lazy: nothing until a first use): 0, or
 * -1 (nothing of it kept) when one does not fit. */
static int lib_load_into(struct fctx *c)
{
    for (int i = 0; i < MAX_LIB && !g_lazy; i++) {
        if (!g_lib[i].used)
            continue;
        if (mod_new(c, g_lib[i].bytes, &g_lib[i], NULL) != CUDA_SUCCESS) {
            for (int k = 0; k < MAX_MOD; k++)
                if (g_mod[k].used && g_mod[k].ctx == c && g_mod[k].lib)
                    mod_free(&g_mod[k]);
            return -1;
        }
    }
    return 0;
}

static void lib_free(struct flib *fl)
{
    for (int k = 0; k < MAX_MOD; k++)
        if (g_mod[k].used && g_mod[k].lib == fl)
            mod_free(&g_mod[k]);
    for (int k = 0; k < MAX_KERN; k++)
        if (g_kern[k].used && g_kern[k].lib == fl)
            g_kern[k].used = 0;
    fl->used = 0;
}

/* The library's module in context c, loaded there now if it is not yet (its first use there, with lazy
 * loading): CUDA_ERROR_OUT_OF_MEMORY when its memory does not fit. */
static CUresult lib_in(struct flib *fl, struct fctx *c, struct fmod **out)
{
    static pthread_mutex_t once = PTHREAD_MUTEX_INITIALIZER; /* two threads' first uses load one copy */
    pthread_mutex_lock(&once);
    CUresult rc = CUDA_SUCCESS;
    struct fmod *fm = NULL;
    for (int k = 0; k < MAX_MOD && !fm; k++)
        if (g_mod[k].used && g_mod[k].lib == fl && g_mod[k].ctx == c)
            fm = &g_mod[k];
    if (!fm)
        rc = mod_new(c, fl->bytes, fl, &fm);
    pthread_mutex_unlock(&once);
    if (rc == CUDA_SUCCESS && out)
        *out = fm;
    return rc;
}

/* jit and library options (CUjit_option, CUlibraryOption) are accepted and ignored */
static CUresult lib_load(CUlibrary *l, uint64_t bytes)
{
    CHECK_INIT();
    if (!l)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct flib *fl = NULL;
    for (int i = 0; i < MAX_LIB && !fl; i++)
        if (!g_lib[i].used)
            fl = &g_lib[i];
    if (fl)
        *fl = (struct flib){.used = 1, .bytes = bytes};
    int nctx = g_nctx;
    pthread_mutex_unlock(&g_mu);
    if (!fl)
        return CUDA_ERROR_OUT_OF_MEMORY;
    for (int i = 0; i < nctx && !g_lazy; i++) { /* eager: a copy in every context the process holds */
        if (g_ctx[i].used && mod_new(&g_ctx[i], bytes, fl, NULL) != CUDA_SUCCESS) {
            lib_free(fl);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    *l = (CUlibrary)fl;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuLibraryLoadData(CUlibrary *l, const void *code, int *jitOptions, void **jitValues,
                                  unsigned int nJit, int *libOptions, void **libValues, unsigned int nLib)
{
    (void)jitOptions, (void)jitValues, (void)nJit, (void)libOptions, (void)libValues, (void)nLib;
    if (!code)
        return CUDA_ERROR_INVALID_VALUE;
    return lib_load(l, image_bytes(code));
}

EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *l, const char *fileName, int *jitOptions, void **jitValues,
                                      unsigned int nJit, int *libOptions, void **libValues, unsigned int nLib)
{
    (void)jitOptions, (void)jitValues, (void)nJit, (void)libOptions, (void)libValues, (void)nLib;
    char head[64];
    CHECK_INIT();
    if (file_head(fileName, head, sizeof head) != 0)
        return CUDA_ERROR_FILE_NOT_FOUND;
    return lib_load(l, image_bytes(head));
}

static struct flib *lib_of(CUlibrary l)
{
    struct flib *fl = (struct flib *)l;
    return fl >= g_lib && fl < g_lib + MAX_LIB && fl->used ? fl : NULL;
}

EXPORT CUresult cuLibraryUnload(CUlibrary l)
{
    CHECK_INIT();
    struct flib *fl = lib_of(l);
    if (!fl)
        return CUDA_ERROR_INVALID_HANDLE;
    lib_free(fl);
    call_gate("FAKE_CUDA_UNLOAD_GATE");
    return CUDA_SUCCESS;
}

/* The library's module in the current context (loaded there now, as the driver documents: it forces the load). */
EXPORT CUresult cuLibraryGetModule(CUmodule *m, CUlibrary l)
{
    NEED_CTX();
    struct flib *fl = lib_of(l);
    if (!m || !fl)
        return CUDA_ERROR_INVALID_VALUE;
    struct fmod *fm = NULL;
    CUresult rc = lib_in(fl, t_cur, &fm);
    if (rc == CUDA_SUCCESS)
        *m = (CUmodule)fm;
    return rc;
}

/* A kernel of the library, context-independent: nothing is loaded until it is used in a context. */
EXPORT CUresult cuLibraryGetKernel(CUkernel *k, CUlibrary l, const char *name)
{
    CHECK_INIT();
    struct flib *fl = lib_of(l);
    if (!k || !fl || !name)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < MAX_KERN; i++) {
        if (!g_kern[i].used) {
            g_kern[i] = (struct fkern){.used = 1, .lib = fl};
            snprintf(g_kern[i].name, sizeof g_kern[i].name, "%s", name);
            pthread_mutex_unlock(&g_mu);
            *k = (CUkernel)&g_kern[i];
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static struct fkern *kern_of(const void *k)
{
    const struct fkern *fk = k;
    return fk >= g_kern && fk < g_kern + MAX_KERN && fk->used ? (struct fkern *)fk : NULL;
}

/* The kernel's function in the current context: its library is loaded there now if it is not yet. */
EXPORT CUresult cuKernelGetFunction(CUfunction *f, CUkernel k)
{
    NEED_CTX();
    struct fkern *fk = kern_of(k);
    if (!f || !fk)
        return CUDA_ERROR_INVALID_VALUE;
    struct fmod *fm = NULL;
    CUresult rc = lib_in(fk->lib, t_cur, &fm);
    return rc != CUDA_SUCCESS ? rc : cuModuleGetFunction(f, (CUmodule)fm, fk->name);
}

/* A __device__ (or __managed__) variable of the library in the current context, loaded there now: its
 * address (a fake one, in the module's memory) and size (the whole module's). */
static CUresult lib_var(CUdeviceptr *dptr, size_t *bytes, CUlibrary l, const char *name)
{
    NEED_CTX();
    struct flib *fl = lib_of(l);
    if (!fl || !name)
        return CUDA_ERROR_INVALID_VALUE;
    struct fmod *fm = NULL;
    CUresult rc = lib_in(fl, t_cur, &fm);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (dptr)
        *dptr = ((CUdeviceptr)0x7e0000000000ull) + (CUdeviceptr)(fm - g_mod) * (CUdeviceptr)(1ull << 30);
    if (bytes)
        *bytes = (size_t)fl->bytes;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary l, const char *name)
{
    return lib_var(dptr, bytes, l, name);
}

EXPORT CUresult cuLibraryGetManaged(CUdeviceptr *dptr, size_t *bytes, CUlibrary l, const char *name)
{
    return lib_var(dptr, bytes, l, name);
}

EXPORT CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{
    CHECK_INIT();
    struct fmod *fm = mod_of(m);
    if (!f || !name || !fm)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < 1024; i++) {
        if (!g_func[i].used) {
            g_func[i].used = 1;
            snprintf(g_func[i].name, sizeof g_func[i].name, "%s", name);
            g_func[i].local = local_bytes(name);
            for (int j = 0; j < fm->nframes && !g_func[i].local; j++)
                if (!strcmp(fm->frames[j].name, name))
                    g_func[i].local = fm->frames[j].local; /* its PTX's .local arrays */
            pthread_mutex_unlock(&g_mu);
            *f = (CUfunction)&g_func[i];
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* FAKE_CUDA_LOCAL_BYTES ("name=bytes,name2=bytes"): the local memory per thread of the kernels of those
 * names (a deep stack or a large local array: CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES); other kernels none. */
static uint64_t local_bytes(const char *name)
{
    const char *v = getenv("FAKE_CUDA_LOCAL_BYTES");
    size_t n = name ? strlen(name) : 0;
    for (const char *p = v; p && *p && n;) {
        const char *eq = strchr(p, '=');
        if (!eq)
            break;
        if ((size_t)(eq - p) == n && !strncmp(p, name, n))
            return strtoull(eq + 1, NULL, 10);
        p = strchr(eq, ',');
        p = p ? p + 1 : NULL;
    }
    return 0;
}

/* The local memory per thread of a CUfunction, or of a CUkernel cast to one. */
static uint64_t func_local(CUfunction f)
{
    struct ffunc *ff = (struct ffunc *)f;
    if (ff >= g_func && ff < g_func + 1024 && ff->used)
        return ff->local;
    struct fkern *fk = kern_of(f);
    return fk ? local_bytes(fk->name) : 0;
}

/* Like the driver: a kernel needing more local memory per thread than context c's stack size grows it
 * (stack_set, lower 0) before it runs. */
static CUresult stack_grow(struct fctx *c, uint64_t local)
{
    return stack_set(c, local, 0);
}

/* cuFuncGetAttribute: CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES (3) reports the kernel's local memory per thread;
 * the other attributes 0. A CUkernel cast to CUfunction is accepted, as the driver's launches accept it. */
EXPORT CUresult cuFuncGetAttribute(int *v, int attr, CUfunction f)
{
    CHECK_INIT();
    struct ffunc *ff = (struct ffunc *)f;
    if (!v || attr < 0 || (!(ff >= g_func && ff < g_func + 1024 && ff->used) && !kern_of(f)))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t local = func_local(f);
    *v = attr == 3 ? (int)(local > INT32_MAX ? INT32_MAX : local) : 0;
    return CUDA_SUCCESS;
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shmem, CUstream s)
{
    NEED_CTX();
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || !stream_valid(s))
        return CUDA_ERROR_INVALID_VALUE;
    struct fkern *fk = kern_of(f); /* a CUkernel cast to CUfunction: its library loads here at first use */
    if (fk) {
        CUresult rc = lib_in(fk->lib, t_cur, NULL);
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    struct fstream *fs = stream_of(s);
    if (!(fs && fs->capturing)) { /* a captured launch runs (and grows the stack) when its graph does */
        CUresult rc = stack_grow(t_cur, func_local(f));
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    if (fs && fs->capturing) {
        struct fgraph *g = fs->cap;
        if (g->n >= GRAPH_NODES || !deps_ok(g, NULL, 0, fs))
            return CUDA_ERROR_OUT_OF_MEMORY;
        struct fnode *n = &g->nodes[g->n++];
        memset(n, 0, sizeof(*n));
        node_link(g, g->n - 1, NULL, 0, fs);
        n->type = CU_GRAPH_NODE_TYPE_KERNEL;
        n->p.func = f;
        n->p.gridDimX = gx;
        n->p.gridDimY = gy;
        n->p.gridDimZ = gz;
        n->p.blockDimX = bx;
        n->p.blockDimY = by;
        n->p.blockDimZ = bz;
        n->p.sharedMemBytes = shmem;
        return CUDA_SUCCESS;
    }
    schedule(t_cur, fs, g_ns_per_launch + (uint64_t)gx * gy * gz * g_ns_per_block);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shmem, CUstream s, void **params, void **extra)
{
    (void)params;
    (void)extra;
    return launch(f, gx, gy, gz, bx, by, bz, shmem, s);
}

EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                    unsigned bz, unsigned shmem, CUstream s, void **params, void **extra)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}

EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
    (void)params;
    (void)extra;
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ,
                  c->sharedMemBytes, c->hStream);
}

EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
    return cuLaunchKernelEx(c, f, params, extra);
}

EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                          unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params)
{
    (void)params;
    return launch(f, gx, gy, gz, bx, by, bz, shmem, s);
}

EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                               unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params)
{
    return cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params);
}

/* ------------------------------------------------------------------ graphs */
/* The legacy launches (deprecated, still exported by the driver): the block shape set with
 * cuFuncSetBlockShape (the fake's kernel time depends on the number of blocks only), a grid of
 * width x height blocks, or cuLaunch's single block. */
EXPORT CUresult cuFuncSetBlockShape(CUfunction f, int x, int y, int z)
{
    CHECK_INIT();
    return f && x > 0 && y > 0 && z > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s)
{
    if (w <= 0 || h <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, (unsigned)w, (unsigned)h, 1, 1, 1, 1, 0, s);
}

EXPORT CUresult cuLaunchGrid(CUfunction f, int w, int h)
{
    return cuLaunchGridAsync(f, w, h, NULL);
}

EXPORT CUresult cuLaunch(CUfunction f)
{
    return cuLaunchGridAsync(f, 1, 1, NULL);
}

/* Deprecated, still exported: one entry per device, each on a stream of its own device's context. */
EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *list, unsigned int n, unsigned int flags)
{
    (void)flags;
    CHECK_INIT();
    if (!list || !n || n > (unsigned)g_nvis)
        return CUDA_ERROR_INVALID_VALUE;
    struct fctx *cur = t_cur;
    CUresult rc = CUDA_SUCCESS;
    for (unsigned i = 0; i < n && rc == CUDA_SUCCESS; i++) {
        struct fstream *fs = list[i].hStream ? stream_of(list[i].hStream) : NULL;
        if (list[i].hStream && !fs)
            rc = CUDA_ERROR_INVALID_HANDLE;
        else {
            t_cur = fs ? fs->ctx : cur; /* the stream's context */
            rc = launch(list[i].function, list[i].gridDimX, list[i].gridDimY, list[i].gridDimZ, list[i].blockDimX,
                        list[i].blockDimY, list[i].blockDimZ, list[i].sharedMemBytes, list[i].hStream);
        }
    }
    t_cur = cur;
    return rc;
}

static struct fgraph *graph_of(CUgraph g)
{
    struct fgraph *fg = (struct fgraph *)g;
    if (fg < g_graph || fg >= g_graph + MAX_GRAPH || !fg->used)
        return NULL;
    return fg;
}

EXPORT CUresult cuGraphCreate(CUgraph *g, unsigned int flags)
{
    (void)flags;
    CHECK_INIT();
    if (!g)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < MAX_GRAPH; i++) {
        if (!g_graph[i].used) {
            g_graph[i].used = 1;
            g_graph[i].n = 0;
            g_graph[i].mem = g_graph[i].inst = g_graph[i].owned = g_graph[i].nedge = 0;
            pthread_mutex_unlock(&g_mu);
            *g = (CUgraph)&g_graph[i];
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* Frees graph fg and the child graphs its child graph nodes own, every level down. Caller holds g_mu. */
static void graph_free_locked(struct fgraph *fg, int depth)
{
    for (int i = 0; i < fg->n && depth < 8; i++)
        if (fg->nodes[i].type == CU_GRAPH_NODE_TYPE_GRAPH && fg->nodes[i].child)
            graph_free_locked(fg->nodes[i].child, depth + 1);
    fg->used = fg->owned = 0;
}

/* A copy of graph src owned by a child graph node, its own child graphs copied too (every level down, as the
 * driver clones a graph), or NULL when the graph table is full (nothing taken then). Caller holds g_mu. */
static struct fgraph *graph_clone_locked(const struct fgraph *src, int depth)
{
    struct fgraph *copy = NULL;
    for (int i = 0; i < MAX_GRAPH && !copy && depth < 8; i++)
        if (!g_graph[i].used)
            copy = &g_graph[i];
    if (!copy)
        return NULL;
    memcpy(copy, src, sizeof(*copy));
    copy->owned = 1;
    copy->inst = 0;
    for (int i = 0; i < copy->n; i++) {
        struct fnode *n = &copy->nodes[i];
        if (n->type != CU_GRAPH_NODE_TYPE_GRAPH || !n->child)
            continue;
        struct fgraph *c = graph_clone_locked(n->child, depth + 1);
        if (!c) {
            for (int k = 0; k < i; k++) /* give back what this copy took */
                if (copy->nodes[k].type == CU_GRAPH_NODE_TYPE_GRAPH && copy->nodes[k].child)
                    graph_free_locked(copy->nodes[k].child, depth + 1);
            copy->used = copy->owned = 0;
            return NULL;
        }
        n->child = c;
    }
    return copy;
}

EXPORT CUresult cuGraphDestroy(CUgraph g)
{
    CHECK_INIT();
    struct fgraph *fg = graph_of(g);
    if (!fg || fg->owned) /* a moved child graph goes with its parent */
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    graph_free_locked(fg, 0); /* and so do its own children, every level down */
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddKernelNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                     const CUDA_KERNEL_NODE_PARAMS *p)
{
    CHECK_INIT();
    struct fgraph *fg = graph_of(g);
    if (!node || !fg || !p || fg->n >= GRAPH_NODES || !deps_ok(fg, deps, ndeps, NULL))
        return CUDA_ERROR_INVALID_VALUE;
    struct fnode *n = &fg->nodes[fg->n++];
    memset(n, 0, sizeof(*n));
    node_link(fg, fg->n - 1, deps, ndeps, NULL);
    n->type = CU_GRAPH_NODE_TYPE_KERNEL;
    memcpy(&n->p, p, offsetof(CUDA_KERNEL_NODE_PARAMS, v2_kern));
    *node = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                        const CUDA_KERNEL_NODE_PARAMS *p)
{
    return cuGraphAddKernelNode(node, g, deps, ndeps, p);
}

/* The node types cuGraphNodeGetType reports are cuda.h's CUgraphNodeType numbers, whatever the shim's header
 * says (a shim that took a memcpy node, 1, for a child graph node, 4, misread every graph with a copy). */
#define FAKE_NODE_TYPE_MEMCPY 1
_Static_assert(CU_GRAPH_NODE_TYPE_KERNEL == 0 && CU_GRAPH_NODE_TYPE_GRAPH == 4 && CU_GRAPH_NODE_TYPE_MEM_ALLOC == 10 &&
                   CU_GRAPH_NODE_TYPE_MEM_FREE == 11,
               "CUgraphNodeType values as cuda.h numbers them");

/* A memcpy node (its CUDA_MEMCPY3D is not read: the fake copies nothing); it runs no kernel and allocates nothing. */
EXPORT CUresult cuGraphAddMemcpyNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                     const void *copyParams, CUcontext ctx)
{
    (void)ctx;
    CHECK_INIT();
    struct fgraph *fg = graph_of(g);
    if (!node || !fg || !copyParams || fg->n >= GRAPH_NODES || !deps_ok(fg, deps, ndeps, NULL))
        return CUDA_ERROR_INVALID_VALUE;
    struct fnode *n = &fg->nodes[fg->n++];
    memset(n, 0, sizeof(*n));
    node_link(fg, fg->n - 1, deps, ndeps, NULL);
    n->type = FAKE_NODE_TYPE_MEMCPY;
    *node = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

/* FAKE_CUDA_GRAPH_COUNT_TOTAL=1: a listing (cuGraphGetNodes, cuGraphGetEdges(_v2)) given a buffer smaller than the
 * graph's nodes or edges fills the buffer and answers the graph's total count, which the driver's documentation
 * leaves open (it says only what is written when the buffer is larger); default: the entries written. */
static int count_total(void)
{
    const char *v = getenv("FAKE_CUDA_GRAPH_COUNT_TOTAL");
    return v && !strcmp(v, "1");
}

/* FAKE_CUDA_GRAPH_GATE=PATH: the (FAKE_CUDA_GRAPH_GATE_SKIP + 1)th count query of a graph's nodes or edges in the
 * process (default: the first) answers, then creates PATH.in and waits (at most 60 s) until PATH exists before
 * returning: a test plays another thread growing the graph between a caller's count query and its listing. */
static void count_gate(void)
{
    static int queries;
    const char *skip = getenv("FAKE_CUDA_GRAPH_GATE_SKIP");
    if (__atomic_fetch_add(&queries, 1, __ATOMIC_RELAXED) == (skip ? atoi(skip) : 0))
        call_gate("FAKE_CUDA_GRAPH_GATE");
}

/* FAKE_CUDA_GRAPH_GROW=1: each count query of a graph's nodes, once answered, adds a node (a memcpy node with no
 * dependency) to the graph, as another thread adding nodes without pause would. */
static void count_grow(struct fgraph *fg)
{
    const char *v = getenv("FAKE_CUDA_GRAPH_GROW");
    if (!v || strcmp(v, "1") || fg->n >= GRAPH_NODES)
        return;
    pthread_mutex_lock(&g_mu);
    memset(&fg->nodes[fg->n], 0, sizeof fg->nodes[fg->n]);
    fg->nodes[fg->n].type = FAKE_NODE_TYPE_MEMCPY;
    fg->n++;
    pthread_mutex_unlock(&g_mu);
}

EXPORT CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *count)
{
    CHECK_INIT();
    struct fgraph *fg = graph_of(g);
    if (!fg || !count)
        return CUDA_ERROR_INVALID_VALUE;
    if (!nodes) {
        *count = (size_t)fg->n;
        count_gate();
        count_grow(fg);
        return CUDA_SUCCESS;
    }
    size_t n = *count < (size_t)fg->n ? *count : (size_t)fg->n;
    for (size_t i = 0; i < n; i++)
        nodes[i] = (CUgraphNode)&fg->nodes[i];
    for (size_t i = n; i < *count; i++)
        nodes[i] = NULL;
    *count = count_total() ? (size_t)fg->n : n;
    return CUDA_SUCCESS;
}

/* The graph's edges (this level's: a child graph's own edges are its graph's), as the driver lists them: from and to
 * both NULL: the count; else up to *num edges, the entries past the last edge NULL and *num the edges given. The
 * fake's edges carry default (zeroed) data. */
static CUresult get_edges(CUgraph g, CUgraphNode *from, CUgraphNode *to, CUgraphEdgeData *data, size_t *num)
{
    CHECK_INIT();
    struct fgraph *fg = graph_of(g);
    if (!fg || !num || !from != !to || (data && !from))
        return CUDA_ERROR_INVALID_VALUE;
    /* FAKE_CUDA_EDGE_PROGRAMMATIC=K (FAKE_CUDA_EDGE_PORT=K): edge K of every graph carries data, the type
     * CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC (the upstream kernel's programmatic out-port), as a CUDA 12.3 driver
     * lists it; a listing without data then fails with CUDA_ERROR_LOSSY_QUERY, as the driver's */
    const char *ptype = getenv("FAKE_CUDA_EDGE_PROGRAMMATIC"), *pport = getenv("FAKE_CUDA_EDGE_PORT");
    long etype = ptype ? atol(ptype) : -1, eport = pport ? atol(pport) : -1;
    pthread_mutex_lock(&g_mu);
    size_t ne = (size_t)fg->nedge, k = from && *num < ne ? *num : ne;
    if (from && !data && ((etype >= 0 && (size_t)etype < k) || (eport >= 0 && (size_t)eport < k))) {
        pthread_mutex_unlock(&g_mu);
        return 214; /* CUDA_ERROR_LOSSY_QUERY */
    }
    for (size_t i = 0; from && i < *num; i++) {
        from[i] = i < k ? (CUgraphNode)&fg->nodes[fg->edges[i].from] : NULL;
        to[i] = i < k ? (CUgraphNode)&fg->nodes[fg->edges[i].to] : NULL;
        if (data) {
            memset(&data[i], 0, sizeof data[i]);
            data[i].type = (long)i == etype ? 1 : 0;
            data[i].from_port = (long)i == eport ? 1 : 0;
        }
    }
    *num = from && count_total() ? ne : k;
    pthread_mutex_unlock(&g_mu);
    if (!from)
        count_gate();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphGetEdges(CUgraph g, CUgraphNode *from, CUgraphNode *to, size_t *num)
{
    return get_edges(g, from, to, NULL, num);
}

EXPORT CUresult cuGraphGetEdges_v2(CUgraph g, CUgraphNode *from, CUgraphNode *to, CUgraphEdgeData *data, size_t *num)
{
    return get_edges(g, from, to, data, num);
}

EXPORT CUresult cuGraphNodeGetType(CUgraphNode node, int *type)
{
    CHECK_INIT();
    if (!node || !type)
        return CUDA_ERROR_INVALID_VALUE;
    *type = ((struct fnode *)node)->type;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphKernelNodeGetParams(CUgraphNode node, CUDA_KERNEL_NODE_PARAMS *p)
{
    CHECK_INIT();
    if (!node || !p)
        return CUDA_ERROR_INVALID_VALUE;
    memcpy(p, &((struct fnode *)node)->p, offsetof(CUDA_KERNEL_NODE_PARAMS, v2_kern));
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode node, CUDA_KERNEL_NODE_PARAMS *p)
{
    CHECK_INIT();
    if (!node || !p)
        return CUDA_ERROR_INVALID_VALUE;
    *p = ((struct fnode *)node)->p;
    return CUDA_SUCCESS;
}

/* Memory nodes (cuGraphAddMemAllocNode, cuGraphAddMemFreeNode, or cuMemAllocAsync / cuMemFreeAsync captured
 * from a stream): the allocation's address is fixed when the node is made; the memory is taken from the
 * device's graph pool at each launch (or cuGraphUpload) and, when the graph does not free it, stays
 * allocated after the launch until cuMemFree / cuMemFreeAsync (or a free node of another graph). A graph
 * launched while its allocation from a previous launch is still allocated fails (the address is taken). */
static CUresult graph_mem_alloc(struct fgraph *fg, int dev, uint64_t bytes, CUdeviceptr *dptr, CUgraphNode *node,
                                const CUgraphNode *deps, size_t ndeps, struct fstream *cs)
{
    if (!fg || !dptr || !bytes)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    if (!deps_ok(fg, deps, ndeps, cs)) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (fg->n >= GRAPH_NODES) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct fnode *n = &fg->nodes[fg->n++];
    memset(n, 0, sizeof(*n));
    node_link(fg, fg->n - 1, deps, ndeps, cs);
    n->type = CU_GRAPH_NODE_TYPE_MEM_ALLOC;
    n->dptr = next_addr(bytes);
    n->bytes = bytes;
    n->dev = dev;
    fg->mem = 1;
    pthread_mutex_unlock(&g_mu);
    *dptr = n->dptr;
    if (node)
        *node = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

/* The allocation node (of any graph) that returned dptr, or NULL. Caller holds g_mu. */
static struct fnode *alloc_node_of_locked(CUdeviceptr dptr)
{
    for (int i = 0; i < MAX_GRAPH; i++)
        for (int k = 0; g_graph[i].used && k < g_graph[i].n; k++)
            if (g_graph[i].nodes[k].type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && g_graph[i].nodes[k].dptr == dptr)
                return &g_graph[i].nodes[k];
    return NULL;
}

static CUresult graph_mem_free(struct fgraph *fg, CUdeviceptr dptr, CUgraphNode *node, const CUgraphNode *deps,
                               size_t ndeps, struct fstream *cs)
{
    if (!fg)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct fnode *a = alloc_node_of_locked(dptr);
    int twice = 0;
    for (int k = 0; k < fg->n; k++)
        twice |= fg->nodes[k].type == CU_GRAPH_NODE_TYPE_MEM_FREE && fg->nodes[k].dptr == dptr;
    if (!a || twice || fg->n >= GRAPH_NODES || !deps_ok(fg, deps, ndeps, cs)) { /* not an allocation node's
                                                                                    address, or freed twice */
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct fnode *n = &fg->nodes[fg->n++];
    memset(n, 0, sizeof(*n));
    node_link(fg, fg->n - 1, deps, ndeps, cs);
    n->type = CU_GRAPH_NODE_TYPE_MEM_FREE;
    n->dptr = dptr;
    n->bytes = a->bytes;
    n->dev = a->dev;
    fg->mem = 1;
    pthread_mutex_unlock(&g_mu);
    if (node)
        *node = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                       CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    CHECK_INIT();
    struct fgraph *fg = graph_of(g);
    if (!node || !fg || !p || !p->bytesize || p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        !dev_ok(p->poolProps.location.id))
        return CUDA_ERROR_INVALID_VALUE;
    return graph_mem_alloc(fg, PH(p->poolProps.location.id), p->bytesize, &p->dptr, node, deps, ndeps, NULL);
}

EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                      CUdeviceptr dptr)
{
    CHECK_INIT();
    if (!node)
        return CUDA_ERROR_INVALID_VALUE;
    return graph_mem_free(graph_of(g), dptr, node, deps, ndeps, NULL);
}

EXPORT CUresult cuGraphMemAllocNodeGetParams(CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    CHECK_INIT();
    struct fnode *n = (struct fnode *)node;
    if (!n || !p || n->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        return CUDA_ERROR_INVALID_VALUE;
    memset(p, 0, sizeof(*p));
    p->poolProps.allocType = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    p->poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p->poolProps.location.id = ordinal_of(n->dev);
    p->bytesize = n->bytes;
    p->dptr = n->dptr;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphMemFreeNodeGetParams(CUgraphNode node, CUdeviceptr *dptr)
{
    CHECK_INIT();
    struct fnode *n = (struct fnode *)node;
    if (!n || !dptr || n->type != CU_GRAPH_NODE_TYPE_MEM_FREE)
        return CUDA_ERROR_INVALID_VALUE;
    *dptr = n->dptr;
    return CUDA_SUCCESS;
}

/* Adds graph fg's launch cost and memory nodes (its child graphs' included, in place) to fe. Caller holds g_mu. */
static CUresult exec_add_locked(struct fexec *fe, const struct fgraph *fg, int depth)
{
    for (int i = 0; i < fg->n; i++) {
        const struct fnode *n = &fg->nodes[i];
        if (n->type == CU_GRAPH_NODE_TYPE_KERNEL) {
            fe->blocks += (uint64_t)n->p.gridDimX * n->p.gridDimY * n->p.gridDimZ;
            uint64_t local = func_local(n->p.func);
            fe->local = local > fe->local ? local : fe->local;
        } else if (n->type == CU_GRAPH_NODE_TYPE_GRAPH && n->child && depth < 8) {
            CUresult rc = exec_add_locked(fe, n->child, depth + 1);
            if (rc)
                return rc;
        } else if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC || n->type == CU_GRAPH_NODE_TYPE_MEM_FREE) {
            if (fe->nmem >= EXEC_MEMOPS)
                return CUDA_ERROR_OUT_OF_MEMORY;
            fe->mem[fe->nmem++] = (struct fmemop){.type = n->type, .dev = n->dev, .dptr = n->dptr, .bytes = n->bytes};
        }
    }
    return CUDA_SUCCESS;
}

/* Copies graph fg's launch cost and memory nodes into fe. Caller holds g_mu. */
static CUresult exec_fill_locked(struct fexec *fe, struct fgraph *fg)
{
    fe->blocks = 0;
    fe->local = 0;
    fe->nmem = 0;
    fe->n = fg->n;
    return exec_add_locked(fe, fg, 0);
}

/* The classic child graph node clones the child (its own child graphs included); a graph with memory nodes
 * cannot be cloned (use cuGraphAddNode with the ownership moved). */
EXPORT CUresult cuGraphAddChildGraphNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                         CUgraph child)
{
    CHECK_INIT();
    struct fgraph *fg = graph_of(g), *fc = graph_of(child);
    if (!node || !fg || !fc || fc == fg || fc->mem || !deps_ok(fg, deps, ndeps, NULL))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct fgraph *copy = fg->n < GRAPH_NODES ? graph_clone_locked(fc, 0) : NULL;
    if (!copy) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct fnode *n = &fg->nodes[fg->n++];
    memset(n, 0, sizeof(*n));
    node_link(fg, fg->n - 1, deps, ndeps, NULL);
    n->type = CU_GRAPH_NODE_TYPE_GRAPH;
    n->child = copy;
    pthread_mutex_unlock(&g_mu);
    *node = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

/* Only child graph nodes (CU_GRAPH_NODE_TYPE_GRAPH): cloned (no memory nodes), or moved into the parent,
 * which then owns the child graph (a graph with memory nodes may be used so). */
EXPORT CUresult cuGraphAddNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                               CUgraphNodeParams *p)
{
    CHECK_INIT();
    if (!node || !p)
        return CUDA_ERROR_INVALID_VALUE;
    if (p->type != CU_GRAPH_NODE_TYPE_GRAPH)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (p->u.graph.ownership != CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE)
        return cuGraphAddChildGraphNode(node, g, deps, ndeps, p->u.graph.graph);
    struct fgraph *fg = graph_of(g), *fc = graph_of(p->u.graph.graph);
    if (!fg || !fc || fc == fg || fc->owned || fc->inst || !deps_ok(fg, deps, ndeps, NULL))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    if (fg->n >= GRAPH_NODES) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    fc->owned = 1;
    fg->mem |= fc->mem;
    struct fnode *n = &fg->nodes[fg->n++];
    memset(n, 0, sizeof(*n));
    node_link(fg, fg->n - 1, deps, ndeps, NULL);
    n->type = CU_GRAPH_NODE_TYPE_GRAPH;
    n->child = fc;
    pthread_mutex_unlock(&g_mu);
    *node = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode node, CUgraph *g)
{
    CHECK_INIT();
    struct fnode *n = (struct fnode *)node;
    if (!n || !g || n->type != CU_GRAPH_NODE_TYPE_GRAPH)
        return CUDA_ERROR_INVALID_VALUE;
    *g = (CUgraph)n->child;
    return CUDA_SUCCESS;
}

static CUresult graph_upload(CUgraphExec e, CUstream s);

EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags)
{
    (void)flags;
    CHECK_INIT();
    struct fgraph *fg = graph_of(g);
    if (!e || !fg)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    if (fg->mem && fg->inst) { /* only one instantiation of a graph with memory nodes at a time */
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (int i = 0; i < MAX_EXEC; i++) {
        if (!g_exec[i].used) {
            CUresult rc = exec_fill_locked(&g_exec[i], fg);
            if (rc) {
                pthread_mutex_unlock(&g_mu);
                return rc;
            }
            g_exec[i].used = 1;
            g_exec[i].g = fg;
            fg->inst++;
            pthread_mutex_unlock(&g_mu);
            *e = (CUgraphExec)&g_exec[i];
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *e, CUgraph g, CUgraphNode *err, char *log, size_t logsz)
{
    (void)err;
    if (log && logsz)
        log[0] = 0;
    return cuGraphInstantiateWithFlags(e, g, 0);
}

/* The CUDA 10-11 symbol, same arguments as _v2. */
EXPORT CUresult cuGraphInstantiate(CUgraphExec *e, CUgraph g, CUgraphNode *err, char *log, size_t logsz)
{
    return cuGraphInstantiate_v2(e, g, err, log, logsz);
}

/* CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD: also uploads it to hUploadStream (its allocations' memory reserved). */
EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuGraphInstantiateWithFlags(e, g, p->flags & ~(cuuint64_t)CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD);
    p->result_out = rc ? 1 : 0;
    if (rc == CUDA_SUCCESS && (p->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD))
        rc = graph_upload(*e, p->hUploadStream);
    return rc;
}

EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    return cuGraphInstantiateWithParams(e, g, p);
}

static struct fexec *exec_of(CUgraphExec e)
{
    struct fexec *fe = (struct fexec *)e;
    if (fe < g_exec || fe >= g_exec + MAX_EXEC || !fe->used)
        return NULL;
    return fe;
}

/* An executable graph takes the parameters of a graph of the same shape (the same node types in the same
 * order), allocation sizes included. */
EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec e, CUgraph g, void *result_info)
{
    (void)result_info;
    CHECK_INIT();
    struct fexec *fe = exec_of(e);
    struct fgraph *fg = graph_of(g);
    if (!fe || !fg)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    int same = fg->n == fe->n, k = 0;
    for (int i = 0; same && i < fg->n; i++) {
        int t = fg->nodes[i].type;
        if (t == CU_GRAPH_NODE_TYPE_MEM_ALLOC || t == CU_GRAPH_NODE_TYPE_MEM_FREE)
            same = k < fe->nmem && fe->mem[k++].type == t;
    }
    same = same && k == fe->nmem;
    struct fexec upd = *fe;
    CUresult rc = same ? exec_fill_locked(&upd, fg) : CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
    if (rc == CUDA_SUCCESS) {
        for (int i = 0; i < upd.nmem; i++)
            upd.mem[i].dptr = fe->mem[i].dptr; /* the executable's allocations keep their addresses */
        *fe = upd;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

EXPORT CUresult cuGraphExecDestroy(CUgraphExec e)
{
    CHECK_INIT();
    struct fexec *fe = exec_of(e);
    if (!fe)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    fe->used = 0;
    if (fe->g && fe->g->inst > 0)
        fe->g->inst--;
    fe->g = NULL;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* Grows the graph pools so that fe's allocations fit (run: also makes them, in order with its frees).
 * The reserve grows by what the sequence needs at its peak beyond it, in 2 MiB steps, charged to the
 * device; a device without room: CUDA_ERROR_OUT_OF_MEMORY and nothing changes. */
static CUresult graph_mem_run(struct fexec *fe, int run)
{
    uint64_t grow[FG_MAX_DEV] = {0};
    pthread_mutex_lock(&g_mu);
    for (int i = 0; run && i < fe->nmem; i++) {
        struct falloc *a = fe->mem[i].type == CU_GRAPH_NODE_TYPE_MEM_ALLOC ? a_find(fe->mem[i].dptr) : NULL;
        if (a) { /* allocated by a previous launch and not freed yet */
            pthread_mutex_unlock(&g_mu);
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    for (int d = 0; d < FG_MAX_DEV; d++) {
        uint64_t cur = g_gpool[d].used, peak = cur;
        for (int i = 0; i < fe->nmem; i++) {
            if (fe->mem[i].dev != d)
                continue;
            if (fe->mem[i].type == CU_GRAPH_NODE_TYPE_MEM_ALLOC)
                cur += fe->mem[i].bytes;
            else
                cur = cur > fe->mem[i].bytes ? cur - fe->mem[i].bytes : 0;
            peak = cur > peak ? cur : peak;
        }
        if (peak > g_gpool[d].reserved)
            grow[d] = (peak - g_gpool[d].reserved + (2 * MIB - 1)) & ~(2 * MIB - 1);
    }
    pthread_mutex_unlock(&g_mu);
    for (int d = 0; d < FG_MAX_DEV; d++) {
        if (grow[d] && charge(d, grow[d]) != CUDA_SUCCESS) {
            for (int k = 0; k < d; k++)
                if (grow[k])
                    uncharge(k, grow[k]);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    pthread_mutex_lock(&g_mu);
    for (int d = 0; d < FG_MAX_DEV; d++) {
        g_gpool[d].reserved += grow[d];
        if (g_gpool[d].reserved > g_gpool[d].reserved_high)
            g_gpool[d].reserved_high = g_gpool[d].reserved;
    }
    for (int i = 0; run && i < fe->nmem; i++) {
        const struct fmemop *m = &fe->mem[i];
        struct fgpool *gp = &g_gpool[m->dev];
        if (m->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
            struct falloc a = {.key = m->dptr, .size = m->bytes, .ctx = t_cur, .dev = m->dev, .kind = K_PTR,
                               .xfd = -1, .gpool = 1};
            if (a_insert(&a) == 0)
                gp->used += m->bytes;
        } else {
            struct falloc *a = a_find(m->dptr);
            if (a && a->gpool) {
                gp->used = gp->used > a->size ? gp->used - a->size : 0;
                a_remove(a);
            }
        }
        if (gp->used > gp->used_high)
            gp->used_high = gp->used;
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* An executable graph's kernel node given another kernel: its launches grow the stack for the new one too (the
 * executable keeps the largest frame it ever had: the fake does not copy its nodes). */
EXPORT CUresult cuGraphExecKernelNodeSetParams(CUgraphExec e, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *p)
{
    CHECK_INIT();
    struct fexec *fe = exec_of(e);
    struct fnode *n = (struct fnode *)node;
    if (!fe || !n || !p || !p->func || n->type != CU_GRAPH_NODE_TYPE_KERNEL)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t local = func_local(p->func);
    pthread_mutex_lock(&g_mu);
    fe->local = local > fe->local ? local : fe->local;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec e, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *p)
{
    return cuGraphExecKernelNodeSetParams(e, node, p);
}

/* CUDA 12.2's generic setter: kernel nodes only. */
EXPORT CUresult cuGraphExecNodeSetParams(CUgraphExec e, CUgraphNode node, CUgraphNodeParams *p)
{
    if (!p || p->type != CU_GRAPH_NODE_TYPE_KERNEL)
        return CUDA_ERROR_INVALID_VALUE;
    return cuGraphExecKernelNodeSetParams(e, node, &p->u.kernel);
}

EXPORT CUresult cuGraphLaunch(CUgraphExec e, CUstream s)
{
    NEED_CTX();
    struct fexec *fe = exec_of(e);
    if (!fe || !stream_valid(s))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = stack_grow(t_cur, fe->local);
    if (rc)
        return rc;
    rc = fe->nmem ? graph_mem_run(fe, 1) : CUDA_SUCCESS;
    if (rc)
        return rc;
    schedule(t_cur, stream_of(s), fe->blocks * g_ns_per_block);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream s)
{
    return cuGraphLaunch(e, s);
}

/* Reserves in the graph pools what fe's allocations need, without running it. */
static CUresult graph_upload(CUgraphExec e, CUstream s)
{
    NEED_CTX();
    struct fexec *fe = exec_of(e);
    if (!fe || !stream_valid(s))
        return CUDA_ERROR_INVALID_VALUE;
    return fe->nmem ? graph_mem_run(fe, 0) : CUDA_SUCCESS;
}

EXPORT CUresult cuGraphUpload(CUgraphExec e, CUstream s)
{
    return graph_upload(e, s);
}

EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec e, CUstream s)
{
    return graph_upload(e, s);
}

EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice d, int attr, void *value)
{
    CHECK_INIT();
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    if (!value || attr < CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT || attr > CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    const struct fgpool *gp = &g_gpool[PH(d)];
    uint64_t v = attr == CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT ? gp->used
                 : attr == CU_GRAPH_MEM_ATTR_USED_MEM_HIGH  ? gp->used_high
                 : attr == CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT ? gp->reserved : gp->reserved_high;
    pthread_mutex_unlock(&g_mu);
    *(cuuint64_t *)value = v;
    return CUDA_SUCCESS;
}

/* Only the high watermarks can be set, and only to 0 (a reset to the current value). */
EXPORT CUresult cuDeviceSetGraphMemAttribute(CUdevice d, int attr, void *value)
{
    CHECK_INIT();
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    if (!value || *(cuuint64_t *)value || (attr != CU_GRAPH_MEM_ATTR_USED_MEM_HIGH && attr != CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct fgpool *gp = &g_gpool[PH(d)];
    if (attr == CU_GRAPH_MEM_ATTR_USED_MEM_HIGH)
        gp->used_high = gp->used;
    else
        gp->reserved_high = gp->reserved;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* Gives the graph pool's reserve beyond what its live allocations use (in 2 MiB steps) back to the device. */
EXPORT CUresult cuDeviceGraphMemTrim(CUdevice d)
{
    CHECK_INIT();
    if (!dev_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    struct fgpool *gp = &g_gpool[PH(d)];
    uint64_t keep = (gp->used + (2 * MIB - 1)) & ~(2 * MIB - 1), drop = 0;
    if (gp->reserved > keep) {
        drop = gp->reserved - keep;
        gp->reserved = keep;
    }
    pthread_mutex_unlock(&g_mu);
    if (drop)
        uncharge(PH(d), drop);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ cuGetProcAddress
 * Like the real driver: a table maps (name as requested, CUDA version it appeared in) to the
 * exported, versioned entry point, e.g. ("cuCtxCreate", 3020) -> cuCtxCreate_v2, ("cuCtxCreate",
 * 11040) -> cuCtxCreate_v3, ("cuCtxCreate", 12050) -> cuCtxCreate_v4. A request picks the entry with the
 * highest version <= cudaVersion (CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT below the lowest);
 * CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM picks the entry's _ptsz symbol where it has one. The
 * addresses handed out are the exported symbols' own (-Bsymbolic). */
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, cuuint64_t flags);
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *st);
struct procent {
    const char *name;
    int ver;
    const char *sym;
    void *fn;
    void *ptsz;
};
#define PE(n, v, s) {#n, v, #s, (void *)s, NULL}
#define PT(n, v, s) {#n, v, #s, (void *)s, (void *)s##_ptsz}
static const struct procent g_proc[] = {
    PE(cuInit, 2000, cuInit), PE(cuDriverGetVersion, 2020, cuDriverGetVersion),
    PE(cuDeviceGetCount, 2000, cuDeviceGetCount), PE(cuDeviceGet, 2000, cuDeviceGet),
    PE(cuDeviceGetName, 2000, cuDeviceGetName), PE(cuDeviceGetUuid, 9020, cuDeviceGetUuid),
    PE(cuDeviceGetUuid, 11040, cuDeviceGetUuid_v2), PE(cuDeviceTotalMem, 2000, cuDeviceTotalMem),
    PE(cuDeviceTotalMem, 3020, cuDeviceTotalMem_v2), PE(cuDeviceGetAttribute, 2000, cuDeviceGetAttribute),
    PE(cuGetErrorString, 6000, cuGetErrorString), PE(cuGetErrorName, 6000, cuGetErrorName),
    PE(cuCtxCreate, 2000, cuCtxCreate), PE(cuCtxCreate, 3020, cuCtxCreate_v2), PE(cuCtxCreate, 11040, cuCtxCreate_v3),
    PE(cuCtxCreate, 12050, cuCtxCreate_v4), PE(cuCtxDestroy, 2000, cuCtxDestroy), PE(cuCtxDestroy, 4000, cuCtxDestroy_v2),
    PE(cuCtxGetCurrent, 4000, cuCtxGetCurrent), PE(cuCtxSetCurrent, 4000, cuCtxSetCurrent),
    PE(cuCtxSetLimit, 3010, cuCtxSetLimit), PE(cuCtxGetLimit, 3010, cuCtxGetLimit),
    PE(cuCtxPushCurrent, 4000, cuCtxPushCurrent_v2), PE(cuCtxPopCurrent, 4000, cuCtxPopCurrent_v2),
    PE(cuCtxGetDevice, 2000, cuCtxGetDevice), PE(cuCtxSynchronize, 2000, cuCtxSynchronize),
    PE(cuDevicePrimaryCtxRetain, 7000, cuDevicePrimaryCtxRetain),
    PE(cuDevicePrimaryCtxRelease, 11000, cuDevicePrimaryCtxRelease_v2),
    PE(cuDevicePrimaryCtxReset, 11000, cuDevicePrimaryCtxReset_v2),
    PE(cuMemAlloc, 3020, cuMemAlloc_v2), PE(cuMemAllocManaged, 6000, cuMemAllocManaged),
    PE(cuMemAllocPitch, 3020, cuMemAllocPitch_v2), PE(cuMemFree, 3020, cuMemFree_v2),
    PE(cuMemGetInfo, 3020, cuMemGetInfo_v2), PE(cuDeviceGetDefaultMemPool, 11020, cuDeviceGetDefaultMemPool),
    PE(cuDeviceGetMemPool, 11020, cuDeviceGetMemPool), PE(cuMemPoolCreate, 11020, cuMemPoolCreate),
    PE(cuMemPoolDestroy, 11020, cuMemPoolDestroy), PE(cuMemPoolTrimTo, 11020, cuMemPoolTrimTo),
    PE(cuMemPoolGetAttribute, 11020, cuMemPoolGetAttribute), PE(cuMemPoolSetAttribute, 11020, cuMemPoolSetAttribute),
    PT(cuMemAllocAsync, 11020, cuMemAllocAsync), PT(cuMemAllocFromPoolAsync, 11020, cuMemAllocFromPoolAsync),
    PT(cuMemFreeAsync, 11020, cuMemFreeAsync), PE(cuMemCreate, 10020, cuMemCreate),
    PE(cuMemRelease, 10020, cuMemRelease), PE(cuMemRetainAllocationHandle, 11000, cuMemRetainAllocationHandle),
    PE(cuMemExportToShareableHandle, 10020, cuMemExportToShareableHandle),
    PE(cuMemImportFromShareableHandle, 10020, cuMemImportFromShareableHandle), PE(cuMemGetAllocationGranularity, 10020, cuMemGetAllocationGranularity),
    PE(cuMemAddressReserve, 10020, cuMemAddressReserve), PE(cuMemAddressFree, 10020, cuMemAddressFree),
    PE(cuMemMap, 10020, cuMemMap), PE(cuMemUnmap, 10020, cuMemUnmap), PE(cuMemSetAccess, 10020, cuMemSetAccess),
    PE(cuArrayCreate, 3020, cuArrayCreate_v2), PE(cuArray3DCreate, 3020, cuArray3DCreate_v2),
    PE(cuArrayDestroy, 2000, cuArrayDestroy), PE(cuMipmappedArrayCreate, 5000, cuMipmappedArrayCreate),
    PE(cuMipmappedArrayDestroy, 5000, cuMipmappedArrayDestroy), PE(cuStreamCreate, 2000, cuStreamCreate),
    PE(cuStreamDestroy, 4000, cuStreamDestroy_v2), PT(cuStreamSynchronize, 2000, cuStreamSynchronize),
    PE(cuStreamBeginCapture, 10000, cuStreamBeginCapture), PE(cuStreamBeginCapture, 10010, cuStreamBeginCapture_v2),
    PE(cuStreamEndCapture, 10000, cuStreamEndCapture), PT(cuStreamIsCapturing, 10000, cuStreamIsCapturing),
    PE(cuModuleLoad, 2000, cuModuleLoad), PE(cuModuleLoadData, 2000, cuModuleLoadData),
    PE(cuModuleUnload, 2000, cuModuleUnload), PE(cuModuleGetFunction, 2000, cuModuleGetFunction),
    PE(cuModuleLoadDataEx, 2010, cuModuleLoadDataEx), PE(cuModuleLoadFatBinary, 2000, cuModuleLoadFatBinary),
    PE(cuLibraryLoadData, 12000, cuLibraryLoadData), PE(cuLibraryLoadFromFile, 12000, cuLibraryLoadFromFile),
    PE(cuLibraryUnload, 12000, cuLibraryUnload), PE(cuLibraryGetModule, 12000, cuLibraryGetModule),
    PE(cuLibraryGetKernel, 12000, cuLibraryGetKernel), PE(cuKernelGetFunction, 12000, cuKernelGetFunction),
    PE(cuLibraryGetGlobal, 12000, cuLibraryGetGlobal), PE(cuLibraryGetManaged, 12000, cuLibraryGetManaged),
    PT(cuLaunchKernel, 4000, cuLaunchKernel), PT(cuLaunchKernelEx, 11060, cuLaunchKernelEx),
    PT(cuLaunchCooperativeKernel, 9000, cuLaunchCooperativeKernel), PE(cuLaunchCooperativeKernelMultiDevice, 9000, cuLaunchCooperativeKernelMultiDevice),
    PE(cuFuncGetAttribute, 2020, cuFuncGetAttribute), PE(cuFuncSetBlockShape, 2000, cuFuncSetBlockShape),
    PE(cuLaunch, 2000, cuLaunch), PE(cuLaunchGrid, 2000, cuLaunchGrid),
    PE(cuLaunchGridAsync, 2000, cuLaunchGridAsync), PE(cuGraphCreate, 10000, cuGraphCreate),
    PE(cuGraphDestroy, 10000, cuGraphDestroy), PE(cuGraphAddKernelNode, 10000, cuGraphAddKernelNode),
    PE(cuGraphAddKernelNode, 12000, cuGraphAddKernelNode_v2), PE(cuGraphGetNodes, 10000, cuGraphGetNodes),
    PE(cuGraphNodeGetType, 10000, cuGraphNodeGetType),
    PE(cuGraphKernelNodeGetParams, 10000, cuGraphKernelNodeGetParams),
    PE(cuGraphKernelNodeGetParams, 12000, cuGraphKernelNodeGetParams_v2),
    PE(cuGraphInstantiate, 10000, cuGraphInstantiate), PE(cuGraphInstantiate, 11000, cuGraphInstantiate_v2),
    PE(cuGraphInstantiate, 12000, cuGraphInstantiateWithFlags),
    PT(cuGraphInstantiateWithParams, 12000, cuGraphInstantiateWithParams), PT(cuGraphUpload, 11010, cuGraphUpload),
    PE(cuGraphExecUpdate, 12000, cuGraphExecUpdate_v2),
    PE(cuGraphExecKernelNodeSetParams, 10010, cuGraphExecKernelNodeSetParams),
    PE(cuGraphExecKernelNodeSetParams, 12000, cuGraphExecKernelNodeSetParams_v2),
    PE(cuGraphExecNodeSetParams, 12020, cuGraphExecNodeSetParams), PE(cuGraphAddMemAllocNode, 11040, cuGraphAddMemAllocNode),
    PE(cuGraphAddMemFreeNode, 11040, cuGraphAddMemFreeNode),
    PE(cuGraphMemAllocNodeGetParams, 11040, cuGraphMemAllocNodeGetParams),
    PE(cuGraphMemFreeNodeGetParams, 11040, cuGraphMemFreeNodeGetParams),
    PE(cuDeviceGetGraphMemAttribute, 11040, cuDeviceGetGraphMemAttribute),
    PE(cuDeviceSetGraphMemAttribute, 11040, cuDeviceSetGraphMemAttribute),
    PE(cuDeviceGraphMemTrim, 11040, cuDeviceGraphMemTrim), PE(cuGraphAddNode, 12020, cuGraphAddNode),
    PE(cuGraphAddChildGraphNode, 10000, cuGraphAddChildGraphNode),
    PE(cuGraphChildGraphNodeGetGraph, 10000, cuGraphChildGraphNodeGetGraph),
    PE(cuGraphInstantiateWithFlags, 11040, cuGraphInstantiateWithFlags), PE(cuGraphExecDestroy, 10000, cuGraphExecDestroy),
    PT(cuGraphLaunch, 10000, cuGraphLaunch), PE(cuGetProcAddress, 11030, cuGetProcAddress),
    PE(cuGetProcAddress, 12000, cuGetProcAddress_v2),
};
#define NPROC (sizeof g_proc / sizeof g_proc[0])

/* Test access to the table: entry i (name requested, version, symbol, has a _ptsz form). 0, or -1 past the end. */
EXPORT int fake_cuda_proc_table(int i, const char **name, int *ver, const char **sym, int *has_ptsz)
{
    if (i < 0 || (size_t)i >= NPROC)
        return -1;
    *name = g_proc[i].name;
    *ver = g_proc[i].ver;
    *sym = g_proc[i].sym;
    *has_ptsz = g_proc[i].ptsz != NULL;
    return 0;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *st)
{
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    const struct procent *best = NULL;
    int known = 0;
    for (size_t i = 0; i < NPROC; i++) {
        if (strcmp(g_proc[i].name, symbol))
            continue;
        known = 1;
        if (g_proc[i].ver <= ver && (!best || g_proc[i].ver > best->ver))
            best = &g_proc[i];
    }
    void *fn = NULL;
    if (best)
        fn = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best->ptsz ? best->ptsz : best->fn;
    *pfn = fn;
    if (st)
        *st = fn ? CU_GET_PROC_ADDRESS_SUCCESS
                 : known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return fn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, ver, flags, NULL);
}
