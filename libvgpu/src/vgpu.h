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

/* real NVML entry points used internally */
typedef nvmlReturn_t (*nvmlInit_v2_fn)(void);
typedef nvmlReturn_t (*nvmlDeviceGetHandleByIndex_v2_fn)(unsigned int, nvmlDevice_t *);
typedef nvmlReturn_t (*nvmlDeviceGetIndex_fn)(nvmlDevice_t, unsigned int *);
typedef nvmlReturn_t (*nvmlDeviceGetUUID_fn)(nvmlDevice_t, char *, unsigned int);
typedef nvmlReturn_t (*nvmlDeviceGetHandleByUUID_fn)(const char *, nvmlDevice_t *);
typedef nvmlReturn_t (*nvmlDeviceGetMemoryInfo_fn)(nvmlDevice_t, nvmlMemory_t *);
typedef nvmlReturn_t (*nvmlDeviceGetMemoryInfo_v2_fn)(nvmlDevice_t, nvmlMemory_v2_t *);
typedef nvmlReturn_t (*nvmlDeviceGetUtilizationRates_fn)(nvmlDevice_t, nvmlUtilization_t *);
typedef nvmlReturn_t (*nvmlDeviceGetComputeRunningProcesses_v3_fn)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *);
typedef nvmlReturn_t (*nvmlDeviceGetProcessUtilization_fn)(nvmlDevice_t, nvmlProcessUtilizationSample_t *,
                                                           unsigned int *, unsigned long long);
struct nvml_api {
    int ok;
    nvmlInit_v2_fn init;
    nvmlDeviceGetHandleByIndex_v2_fn handle_by_index;
    nvmlDeviceGetIndex_fn get_index;
    nvmlDeviceGetUUID_fn get_uuid;
    nvmlDeviceGetHandleByUUID_fn by_uuid;
    nvmlDeviceGetMemoryInfo_fn mem_info;
    nvmlDeviceGetMemoryInfo_v2_fn mem_info_v2;
    nvmlDeviceGetUtilizationRates_fn util;
    nvmlDeviceGetProcessUtilization_fn proc_util;
    nvmlDeviceGetComputeRunningProcesses_v3_fn running; /* _v3, else _v2 (same layout) */
};
extern struct nvml_api g_nvml;

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
};

/* The container's limits file: fixed path, read-only mount (see docs/env-contract.md). Not taken
 * from the environment on purpose: a process must not be able to point the shim elsewhere. */
#ifndef VGPU_LIMITS_PATH
#define VGPU_LIMITS_PATH "/usr/local/vgpu/limits/vgpu.limits"
#endif
extern struct vgpu_config g_cfg;
extern int g_cuda_ready;
extern int g_sm_active;

void vgpu_read_config(void); /* config.c: the limits file, else the environment, into g_cfg (once) */
void vgpu_cuda_init_slow(void);
void vgpu_base_init(void);
int vgpu_nvml_load(void);

static inline void ensure_cuda(void)
{
    if (UNLIKELY(!__atomic_load_n(&g_cuda_ready, __ATOMIC_ACQUIRE)))
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
void region_release(int dev, uint64_t bytes);
void region_count_refusal(void); /* one more refusal past the limit, for the node's metrics */
uint64_t region_used(int dev);
void region_procs(int *pids, int *prio, int *n, int max); /* NVML pid, priority of the container's processes */
void region_release_self(void);
void region_after_fork_child(void);
int vgpu_self_pid(void); /* this process's pid as the container's /proc shows it (NSpid[0]) */
int vgpu_host_pid(void); /* the pid NVML reports for this process (learned, see region.c), else vgpu_self_pid() */
void hostpid_before_ctx(int cdev); /* around this process's first context creation (region.c) */
void hostpid_after_ctx(int created);

/* ------------------------------------------------------------------ memory / contexts (memory.c) */
int current_device(CUdevice *dev, CUcontext *ctx);
void memory_after_fork_child(void);
/* the tracking table used for allocations and graph costs: track.h */

/* ------------------------------------------------------------------ SM limiter (limiter.c) */
void limiter_start(void);
void limiter_throttle(uint64_t blocks, CUstream s);

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
