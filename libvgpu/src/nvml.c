/*
 * libvgpu's NVML: the real libnvidia-ml.so.1 entry points the shim itself calls, loaded once. This file
 * owns the table (nobody else sees it); every other file calls the functions below, declared in vgpu.h.
 * Each returns NVML_ERROR_FUNCTION_NOT_FOUND when the library or that entry point is missing.
 */
#include "vgpu.h"
#include "config.h"

#include <dlfcn.h>

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

static struct {
    int ok; /* loaded and nvmlInit_v2 succeeded */
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
} g_nvml;

static pthread_once_t g_nvml_once = PTHREAD_ONCE_INIT;

static void nvml_load(void)
{
    void *lib = vgpu_open_library(VGPU_ENV_NVML_LIBRARY, "libnvidia-ml.so.1");
    if (!lib) {
        LOG_INFO("libnvidia-ml.so.1 not loadable: %s", dlerror());
        return;
    }
#define SYM(field, type, name) g_nvml.field = (type)vgpu_real_dlsym(lib, name)
    SYM(init, nvmlInit_v2_fn, "nvmlInit_v2");
    SYM(handle_by_index, nvmlDeviceGetHandleByIndex_v2_fn, "nvmlDeviceGetHandleByIndex_v2");
    SYM(get_index, nvmlDeviceGetIndex_fn, "nvmlDeviceGetIndex");
    SYM(get_uuid, nvmlDeviceGetUUID_fn, "nvmlDeviceGetUUID");
    SYM(by_uuid, nvmlDeviceGetHandleByUUID_fn, "nvmlDeviceGetHandleByUUID");
    SYM(mem_info, nvmlDeviceGetMemoryInfo_fn, "nvmlDeviceGetMemoryInfo");
    SYM(mem_info_v2, nvmlDeviceGetMemoryInfo_v2_fn, "nvmlDeviceGetMemoryInfo_v2");
    SYM(util, nvmlDeviceGetUtilizationRates_fn, "nvmlDeviceGetUtilizationRates");
    SYM(proc_util, nvmlDeviceGetProcessUtilization_fn, "nvmlDeviceGetProcessUtilization");
    SYM(running, nvmlDeviceGetComputeRunningProcesses_v3_fn, "nvmlDeviceGetComputeRunningProcesses_v3");
    if (!g_nvml.running)
        SYM(running, nvmlDeviceGetComputeRunningProcesses_v3_fn, "nvmlDeviceGetComputeRunningProcesses_v2");
#undef SYM
    g_nvml.ok = g_nvml.init && g_nvml.handle_by_index && g_nvml.init() == NVML_SUCCESS;
}

int vgpu_nvml_load(void)
{
    pthread_once(&g_nvml_once, nvml_load);
    return g_nvml.ok;
}

/* One wrapper per entry point: the real call, or NVML_ERROR_FUNCTION_NOT_FOUND when it is missing. */
#define CALL(field, args) return g_nvml.field ? g_nvml.field args : NVML_ERROR_FUNCTION_NOT_FOUND

nvmlReturn_t vnvml_handle_by_index(unsigned index, nvmlDevice_t *out)
{
    CALL(handle_by_index, (index, out));
}

nvmlReturn_t vnvml_handle_by_uuid(const char *uuid, nvmlDevice_t *out)
{
    CALL(by_uuid, (uuid, out));
}

nvmlReturn_t vnvml_index(nvmlDevice_t d, unsigned *index)
{
    CALL(get_index, (d, index));
}

nvmlReturn_t vnvml_uuid(nvmlDevice_t d, char *uuid, unsigned len)
{
    CALL(get_uuid, (d, uuid, len));
}

nvmlReturn_t vnvml_memory(nvmlDevice_t d, nvmlMemory_t *m)
{
    CALL(mem_info, (d, m));
}

nvmlReturn_t vnvml_memory_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    CALL(mem_info_v2, (d, m));
}

nvmlReturn_t vnvml_utilization(nvmlDevice_t d, nvmlUtilization_t *u)
{
    CALL(util, (d, u));
}

nvmlReturn_t vnvml_process_utilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *buf, unsigned *n,
                                       unsigned long long since_us)
{
    CALL(proc_util, (d, buf, n, since_us));
}

nvmlReturn_t vnvml_running_processes(nvmlDevice_t d, unsigned *n, nvmlProcessInfo_t *buf)
{
    CALL(running, (d, n, buf));
}
#undef CALL

int vnvml_lists_processes(void)
{
    return g_nvml.running != NULL;
}

int vnvml_process_memory(nvmlDevice_t d, unsigned *pids, uint64_t *used, unsigned max, unsigned *n)
{
    static __thread nvmlProcessInfo_t buf[VNVML_MAX_PROCS];
    unsigned cap = max < VNVML_MAX_PROCS ? max : VNVML_MAX_PROCS, cnt = cap;
    if (vnvml_running_processes(d, &cnt, buf) != NVML_SUCCESS)
        return -1;
    *n = cnt < cap ? cnt : cap;
    for (unsigned i = 0; i < *n; i++) {
        pids[i] = buf[i].pid;
        if (used)
            used[i] = buf[i].usedGpuMemory == NVML_VALUE_NOT_AVAILABLE_ULL ? UINT64_MAX : buf[i].usedGpuMemory;
    }
    return 0;
}
