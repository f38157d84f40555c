/*
 * Every environment variable and limits-file key the shim reads, in one place (parsers: config.c).
 * The device plugin writes them through kube_vgpu/envcontract.py; tests/libvgpu/test_shim_config.py
 * checks both sides agree (vgpu_config_names() lists these tables).
 */
#ifndef LIBVGPU_CONFIG_H
#define LIBVGPU_CONFIG_H

/* ---- environment: written by the device plugin (envcontract.container_env) ---- */
#define VGPU_ENV_VISIBLE_DEVICES "NVIDIA_VISIBLE_DEVICES"          /* envcontract.VISIBLE_DEVICES */
#define VGPU_ENV_MEMORY_LIMIT "CUDA_DEVICE_MEMORY_LIMIT"           /* all devices */
#define VGPU_ENV_MEMORY_LIMIT_PREFIX "CUDA_DEVICE_MEMORY_LIMIT_"   /* envcontract.MEMORY_LIMIT_PREFIX + i */
#define VGPU_ENV_SM_LIMIT "CUDA_DEVICE_SM_LIMIT"                   /* envcontract.SM_LIMIT */
#define VGPU_ENV_SM_LIMIT_PREFIX "CUDA_DEVICE_SM_LIMIT_"           /* envcontract.SM_LIMIT_PREFIX + i */
#define VGPU_ENV_SHARED_CACHE "CUDA_DEVICE_MEMORY_SHARED_CACHE"    /* envcontract.SHARED_CACHE */
#define VGPU_ENV_DISABLE_CONTROL "CUDA_DISABLE_CONTROL"            /* envcontract.DISABLE_CONTROL */
#define VGPU_ENV_LOG_LEVEL "LIBVGPU_LOG_LEVEL"                     /* envcontract.LOG_LEVEL */
#define VGPU_ENV_TASK_PRIORITY "CUDA_TASK_PRIORITY"                /* envcontract.TASK_PRIORITY */
/* ---- environment: the shim's own knobs (HAMi-compatible policy, tuning, tests) ---- */
#define VGPU_ENV_CORE_POLICY "GPU_CORE_UTILIZATION_POLICY"
#define VGPU_ENV_CONTEXT_COST "LIBVGPU_CONTEXT_COST"
#define VGPU_ENV_SM_PERIOD_MS "LIBVGPU_SM_PERIOD_MS"
#define VGPU_ENV_CUDA_VISIBLE_DEVICES "CUDA_VISIBLE_DEVICES"
#define VGPU_ENV_CUDA_LIBRARY "LIBVGPU_CUDA_LIBRARY"
#define VGPU_ENV_NVML_LIBRARY "LIBVGPU_NVML_LIBRARY"
/* a graph's memory bound (VGPU_GRAPH_MEMORY_VALUES) without a limits file only (development, tests); a container's
 * limits file decides it there (graph_memory), and the environment is then not read for it */
#define VGPU_ENV_GRAPH_MEMORY_BOUND "LIBVGPU_GRAPH_MEMORY_BOUND"

#define VGPU_ENV_NAMES(X)                                                                                      \
    X(VISIBLE_DEVICES, VGPU_ENV_VISIBLE_DEVICES) X(MEMORY_LIMIT, VGPU_ENV_MEMORY_LIMIT)                        \
    X(MEMORY_LIMIT_PREFIX, VGPU_ENV_MEMORY_LIMIT_PREFIX) X(SM_LIMIT, VGPU_ENV_SM_LIMIT)                        \
    X(SM_LIMIT_PREFIX, VGPU_ENV_SM_LIMIT_PREFIX) X(SHARED_CACHE, VGPU_ENV_SHARED_CACHE)                        \
    X(DISABLE_CONTROL, VGPU_ENV_DISABLE_CONTROL) X(LOG_LEVEL, VGPU_ENV_LOG_LEVEL)                              \
    X(TASK_PRIORITY, VGPU_ENV_TASK_PRIORITY) X(CORE_POLICY, VGPU_ENV_CORE_POLICY)                              \
    X(CONTEXT_COST, VGPU_ENV_CONTEXT_COST) X(SM_PERIOD_MS, VGPU_ENV_SM_PERIOD_MS)                              \
    X(CUDA_VISIBLE_DEVICES, VGPU_ENV_CUDA_VISIBLE_DEVICES) X(CUDA_LIBRARY, VGPU_ENV_CUDA_LIBRARY)              \
    X(NVML_LIBRARY, VGPU_ENV_NVML_LIBRARY) X(GRAPH_MEMORY_BOUND, VGPU_ENV_GRAPH_MEMORY_BOUND)

/* ---- the limits file (envcontract.limits_file / pending_limits_file; docs/env-contract.md) ---- */
#define VGPU_LIMITS_VERSION 1 /* envcontract.LIMITS_FILE_VERSION */
#define VGPU_KEY_VERSION "version"
#define VGPU_KEY_DEVICES "devices"
#define VGPU_KEY_UUID "uuid"             /* uuid_<i> */
#define VGPU_KEY_MEMORY_MIB "memory_mib" /* memory_mib_<i> */
#define VGPU_KEY_CORES "cores"           /* cores_<i> */
#define VGPU_KEY_SHARED_CACHE "shared_cache"
#define VGPU_KEY_CORE_POLICY "core_policy"
#define VGPU_KEY_CORE_SHARING "core_sharing"
#define VGPU_KEY_GRAPH_MEMORY "graph_memory"
#define VGPU_KEY_DISABLE_CONTROL "disable_control"
#define VGPU_KEY_PRIORITY "priority"
#define VGPU_KEY_STATE "state"

#define VGPU_KEY_NAMES(X)                                                                                      \
    X(VERSION, VGPU_KEY_VERSION) X(DEVICES, VGPU_KEY_DEVICES) X(UUID, VGPU_KEY_UUID)                           \
    X(MEMORY_MIB, VGPU_KEY_MEMORY_MIB) X(CORES, VGPU_KEY_CORES) X(SHARED_CACHE, VGPU_KEY_SHARED_CACHE)         \
    X(CORE_POLICY, VGPU_KEY_CORE_POLICY) X(CORE_SHARING, VGPU_KEY_CORE_SHARING)                                \
    X(GRAPH_MEMORY, VGPU_KEY_GRAPH_MEMORY) X(DISABLE_CONTROL, VGPU_KEY_DISABLE_CONTROL)                        \
    X(PRIORITY, VGPU_KEY_PRIORITY) X(STATE, VGPU_KEY_STATE)

/* values of core_policy (envcontract.CORE_POLICIES), core_sharing (envcontract.CORE_SHARING) and graph_memory
 * (envcontract.GRAPH_MEMORY_BOUNDS) */
#define VGPU_POLICY_DEFAULT "default"
#define VGPU_POLICY_DISABLE "disable"
#define VGPU_CORE_POLICY_VALUES VGPU_POLICY_DEFAULT "," VGPU_POLICY_DISABLE
#define VGPU_SHARING_STRICT "strict"
#define VGPU_SHARING_CONSERVING "work_conserving"
#define VGPU_CORE_SHARING_VALUES VGPU_SHARING_STRICT "," VGPU_SHARING_CONSERVING
#define VGPU_GRAPH_MEMORY_SUM "sum"
#define VGPU_GRAPH_MEMORY_PEAK "peak"
#define VGPU_GRAPH_MEMORY_VALUES VGPU_GRAPH_MEMORY_SUM "," VGPU_GRAPH_MEMORY_PEAK

#endif
