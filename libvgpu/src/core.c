/*
 * libvgpu core: configuration from the environment (read once), logging, loading of the real
 * libcuda.so.1 / libnvidia-ml.so.1, and the three lookup paths that hand out hooks:
 * exported symbols (direct linking), an overridden dlsym(), and cuGetProcAddress(_v2).
 */
#include "vgpu.h"

#include <ctype.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define HOOK(name, ret, params, args) name##_fn real_##name;
#define REAL(name, ret, params) name##_fn real_##name;
#include "hooks_list.h"
#undef HOOK
#undef REAL

/* hook prototypes (defined in memory.c / limiter.c / below) */
#define HOOK(name, ret, params, args) EXPORT ret name params;
#define REAL(name, ret, params)
#include "hooks_list.h"
#undef HOOK
#undef REAL
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m);
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m);

struct vgpu_config g_cfg = {.enabled = 1, .log_level = 2, .context_cost = -1, .sm_period_ms = 100, .nvisible = -1};
struct nvml_api g_nvml;
int g_cuda_ready;
int g_sm_active;

static void *g_libcuda;
static void *g_libnvml;
static void *(*real_dlsym)(void *, const char *);

/* ------------------------------------------------------------------ hook table */
struct hook {
    const char *name;
    void *hook;
    void **real;
};

#define HOOK(name, ret, params, args) {#name, (void *)name, (void **)&real_##name},
#define REAL(name, ret, params)
static struct hook g_hooks[] = {
#include "hooks_list.h"
    {"nvmlDeviceGetMemoryInfo", (void *)nvmlDeviceGetMemoryInfo, NULL},
    {"nvmlDeviceGetMemoryInfo_v2", (void *)nvmlDeviceGetMemoryInfo_v2, NULL},
};
#undef HOOK
#undef REAL
#define NHOOKS (sizeof g_hooks / sizeof g_hooks[0])

static struct hook *g_by_name[NHOOKS];
struct realmap {
    void *real;
    void *hook;
};
static struct realmap g_by_real[NHOOKS];
static size_t g_nreal;
static pthread_once_t g_table_once = PTHREAD_ONCE_INIT;

static int cmp_name(const void *a, const void *b)
{
    return strcmp((*(struct hook *const *)a)->name, (*(struct hook *const *)b)->name);
}

static void table_init(void)
{
    for (size_t i = 0; i < NHOOKS; i++)
        g_by_name[i] = &g_hooks[i];
    qsort(g_by_name, NHOOKS, sizeof g_by_name[0], cmp_name);
}

static void *hook_by_name(const char *name)
{
    pthread_once(&g_table_once, table_init);
    size_t lo = 0, hi = NHOOKS;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(name, g_by_name[mid]->name);
        if (c == 0)
            return g_by_name[mid]->hook;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

static int cmp_real(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)((const struct realmap *)a)->real, y = (uintptr_t)((const struct realmap *)b)->real;
    return x < y ? -1 : x > y;
}

static void *hook_by_real(void *real)
{
    size_t lo = 0, hi = g_nreal;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (g_by_real[mid].real == real)
            return g_by_real[mid].hook;
        if ((uintptr_t)real < (uintptr_t)g_by_real[mid].real)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

/* ------------------------------------------------------------------ logging */
void vgpu_log(int level, const char *fmt, ...)
{
    if (level > g_cfg.log_level)
        return;
    static const char *names[] = {"", "ERROR", "WARN", "INFO", "DEBUG"};
    char buf[512];
    int n = snprintf(buf, sizeof buf, "[libvgpu %d] %s: ", (int)getpid(), names[level < 0 ? 0 : level > 4 ? 4 : level]);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof buf)
        n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof buf - 1)
        n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t w = write(2, buf, (size_t)n);
    (void)w;
}

uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ configuration */
/* Strict "<digits>[k|m|g]" (suffix case-insensitive; none = bytes). No sign, no spaces, no
 * fraction, no overflow. Returns the value; *bad = 1 (and 0 returned) for anything else. */
static uint64_t parse_bytes(const char *s, int *bad)
{
    *bad = 0;
    if (!s || !*s) {
        *bad = 1;
        return 0;
    }
    uint64_t v = 0;
    const char *p = s;
    for (; *p >= '0' && *p <= '9'; p++) {
        unsigned d = (unsigned)(*p - '0');
        if (v > (UINT64_MAX - d) / 10) {
            *bad = 1;
            return 0;
        }
        v = v * 10 + d;
    }
    if (p == s) {
        *bad = 1;
        return 0;
    }
    unsigned shift = 0;
    switch (*p) {
    case 0:
        break;
    case 'k':
    case 'K':
        shift = 10;
        break;
    case 'm':
    case 'M':
        shift = 20;
        break;
    case 'g':
    case 'G':
        shift = 30;
        break;
    default:
        *bad = 1;
        return 0;
    }
    if (shift && p[1]) {
        *bad = 1;
        return 0;
    }
    if (shift && v > (UINT64_MAX >> shift)) {
        *bad = 1;
        return 0;
    }
    return v << shift;
}

/* A memory limit variable: absent -> no limit from it (returns 0). Present -> a limit applies
 * (returns 1): its value when valid and > 0, else 0 bytes (fail closed), with one WARN. */
static int read_mem_limit(const char *name, uint64_t *out)
{
    const char *v = getenv(name);
    if (!v)
        return 0;
    int bad;
    uint64_t b = parse_bytes(v, &bad);
    if (bad || b == 0) {
        LOG_WARN("%s %s=\"%s\"; failing closed: memory limit 0 on the device(s) it covers, every allocation "
                 "is refused", bad ? "invalid" : "zero", name, v);
        b = 0;
    }
    *out = b;
    return 1;
}

static int parse_percent(const char *s, int *bad)
{
    *bad = 0;
    if (!s || !*s)
        return 0;
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < 0) {
        *bad = 1;
        return 0;
    }
    return v >= 100 ? 0 : (int)v;
}

static void read_config(void)
{
    const char *lv = getenv("LIBVGPU_LOG_LEVEL");
    if (lv && *lv)
        g_cfg.log_level = atoi(lv);
    const char *dis = getenv("CUDA_DISABLE_CONTROL");
    if (dis && (!strcasecmp(dis, "true") || !strcmp(dis, "1")))
        g_cfg.enabled = 0;

    int bad;
    uint64_t all = 0;
    int all_set = read_mem_limit("CUDA_DEVICE_MEMORY_LIMIT", &all);
    int sm_all = parse_percent(getenv("CUDA_DEVICE_SM_LIMIT"), &bad);
    if (bad)
        LOG_WARN("ignoring invalid CUDA_DEVICE_SM_LIMIT=%s", getenv("CUDA_DEVICE_SM_LIMIT"));
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        char name[64];
        snprintf(name, sizeof name, "CUDA_DEVICE_MEMORY_LIMIT_%d", i);
        uint64_t b = 0;
        if (read_mem_limit(name, &b)) {
            g_cfg.mem_limit[i] = b;
            g_cfg.mem_set[i] = 1;
        } else {
            g_cfg.mem_limit[i] = all;
            g_cfg.mem_set[i] = (uint8_t)all_set;
        }
        const char *v;
        snprintf(name, sizeof name, "CUDA_DEVICE_SM_LIMIT_%d", i);
        v = getenv(name);
        int p = parse_percent(v, &bad);
        if (bad)
            LOG_WARN("ignoring invalid %s=%s", name, v);
        g_cfg.sm_limit[i] = (v && *v && !bad) ? p : sm_all;
    }
    const char *pol = getenv("GPU_CORE_UTILIZATION_POLICY");
    int sm_disabled = pol && !strcasecmp(pol, "disable");
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        if (sm_disabled)
            g_cfg.sm_limit[i] = 0;
        if (g_cfg.sm_limit[i])
            g_cfg.sm_any = 1;
    }
    const char *cc = getenv("LIBVGPU_CONTEXT_COST");
    if (cc && *cc) {
        uint64_t b = parse_bytes(cc, &bad);
        if (!bad && b <= (uint64_t)INT64_MAX)
            g_cfg.context_cost = (int64_t)b;
        else
            LOG_WARN("ignoring invalid LIBVGPU_CONTEXT_COST=\"%s\"", cc);
    }
    const char *per = getenv("LIBVGPU_SM_PERIOD_MS");
    if (per && atoi(per) > 0)
        g_cfg.sm_period_ms = (unsigned)atoi(per);
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    if (vis) {
        g_cfg.nvisible = 0;
        const char *p = vis;
        while (*p && g_cfg.nvisible < VGPU_MAX_DEV) {
            size_t n = strcspn(p, ",");
            size_t c = n < 95 ? n : 95;
            memcpy(g_cfg.visible[g_cfg.nvisible], p, c);
            g_cfg.visible[g_cfg.nvisible][c] = 0;
            g_cfg.nvisible++;
            p += n;
            if (*p == ',')
                p++;
        }
    }
    if (!g_cfg.enabled)
        g_cfg.sm_any = 0;
}

/* ------------------------------------------------------------------ init */
static pthread_once_t g_base_once = PTHREAD_ONCE_INIT;
static pthread_once_t g_cuda_once = PTHREAD_ONCE_INIT;
static pthread_once_t g_nvml_once = PTHREAD_ONCE_INIT;

/* dlsym() runs before the sanitizer runtime is initialised when libasan is preloaded (ASan looks
 * up its interceptors through it): no instrumentation and no intercepted libc calls on that path. */
#define NO_SANITIZE __attribute__((no_sanitize_address))

NO_SANITIZE static void resolve_real_dlsym(void)
{
    static const char *versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0", NULL};
    for (int i = 0; versions[i] && !real_dlsym; i++)
        real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}

static void base_init(void)
{
    if (!real_dlsym)
        resolve_real_dlsym();
    read_config();
    if (g_cfg.enabled)
        region_open();
    LOG_INFO("libvgpu initialised (control %s)", g_cfg.enabled ? "on" : "off");
}

void vgpu_base_init(void)
{
    pthread_once(&g_base_once, base_init);
}

static void nvml_load(void)
{
    vgpu_base_init();
    const char *path = getenv("LIBVGPU_NVML_LIBRARY");
    g_libnvml = dlopen(path && *path ? path : "libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!g_libnvml) {
        LOG_INFO("libnvidia-ml.so.1 not loadable: %s", dlerror());
        return;
    }
    g_nvml.init = (nvmlInit_v2_fn)real_dlsym(g_libnvml, "nvmlInit_v2");
    g_nvml.handle_by_index = (nvmlDeviceGetHandleByIndex_v2_fn)real_dlsym(g_libnvml, "nvmlDeviceGetHandleByIndex_v2");
    g_nvml.get_index = (nvmlDeviceGetIndex_fn)real_dlsym(g_libnvml, "nvmlDeviceGetIndex");
    g_nvml.get_uuid = (nvmlDeviceGetUUID_fn)real_dlsym(g_libnvml, "nvmlDeviceGetUUID");
    g_nvml.mem_info = (nvmlDeviceGetMemoryInfo_fn)real_dlsym(g_libnvml, "nvmlDeviceGetMemoryInfo");
    g_nvml.mem_info_v2 = (nvmlDeviceGetMemoryInfo_v2_fn)real_dlsym(g_libnvml, "nvmlDeviceGetMemoryInfo_v2");
    g_nvml.util = (nvmlDeviceGetUtilizationRates_fn)real_dlsym(g_libnvml, "nvmlDeviceGetUtilizationRates");
    g_nvml.proc_util = (nvmlDeviceGetProcessUtilization_fn)real_dlsym(g_libnvml, "nvmlDeviceGetProcessUtilization");
    g_nvml.ok = g_nvml.init && g_nvml.handle_by_index && g_nvml.init() == NVML_SUCCESS;
}

int vgpu_nvml_load(void)
{
    pthread_once(&g_nvml_once, nvml_load);
    return g_nvml.ok;
}

static void cuda_init(void)
{
    vgpu_base_init();
    const char *path = getenv("LIBVGPU_CUDA_LIBRARY");
    g_libcuda = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!g_libcuda) {
        LOG_ERROR("cannot load libcuda.so.1: %s", dlerror());
    } else {
#define HOOK(name, ret, params, args) real_##name = (name##_fn)real_dlsym(g_libcuda, #name);
#define REAL(name, ret, params) real_##name = (name##_fn)real_dlsym(g_libcuda, #name);
#include "hooks_list.h"
#undef HOOK
#undef REAL
    }
    g_nreal = 0;
    for (size_t i = 0; i < NHOOKS; i++) {
        if (g_hooks[i].real && *g_hooks[i].real) {
            g_by_real[g_nreal].real = *g_hooks[i].real;
            g_by_real[g_nreal].hook = g_hooks[i].hook;
            g_nreal++;
        }
    }
    qsort(g_by_real, g_nreal, sizeof g_by_real[0], cmp_real);
    g_sm_active = g_cfg.enabled && g_cfg.sm_any;
    __atomic_store_n(&g_cuda_ready, 1, __ATOMIC_RELEASE);
    if (g_sm_active)
        limiter_start();
}

void vgpu_cuda_init_slow(void)
{
    pthread_once(&g_cuda_once, cuda_init);
}

/* ------------------------------------------------------------------ dlsym override */
/* Returns our hook for a CUDA/NVML name we intercept, else NULL. */
NO_SANITIZE __attribute__((noinline)) static void *hooked_symbol(const char *sym)
{
    if (sym && ((sym[0] == 'c' && sym[1] == 'u') || (sym[0] == 'n' && sym[1] == 'v' && sym[2] == 'm' && sym[3] == 'l')))
        return hook_by_name(sym);
    return NULL;
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnonnull-compare"
/* Everything else goes to glibc as a tail call (a jmp, no new frame): glibc then sees the
 * original caller's return address, so RTLD_NEXT keeps its meaning for every caller. */
EXPORT NO_SANITIZE __attribute__((optimize("O2", "optimize-sibling-calls", "no-stack-protector")))
void *dlsym(void *handle, const char *symbol)
{
    if (UNLIKELY(!real_dlsym))
        resolve_real_dlsym();
    void *h = hooked_symbol(symbol);
    if (h)
        return h;
    return real_dlsym(handle, symbol);
}
#pragma GCC diagnostic pop

/* ------------------------------------------------------------------ cuGetProcAddress */
static void *proc_hook(const char *symbol, void *real, int ver, cuuint64_t flags)
{
    void *h = hook_by_real(real);
    if (h || !symbol || ver < 11000)
        return h;
    /* the driver handed out an address that is not one of its exported symbols: pick by name */
    char buf[128];
    if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) {
        snprintf(buf, sizeof buf, "%s_ptsz", symbol);
        if ((h = hook_by_name(buf)))
            return h;
    }
    snprintf(buf, sizeof buf, "%s_v2", symbol);
    if ((h = hook_by_name(buf)))
        return h;
    return hook_by_name(symbol);
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    ensure_cuda();
    if (!real_cuGetProcAddress)
        return CUDA_ERROR_NOT_FOUND;
    CUresult rc = real_cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn && *pfn) {
        void *h = proc_hook(symbol, *pfn, cudaVersion, flags);
        if (h)
            *pfn = h;
    }
    return rc;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status)
{
    ensure_cuda();
    if (!real_cuGetProcAddress_v2)
        return CUDA_ERROR_NOT_FOUND;
    CUresult rc = real_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, status);
    if (rc == CUDA_SUCCESS && pfn && *pfn) {
        void *h = proc_hook(symbol, *pfn, cudaVersion, flags);
        if (h)
            *pfn = h;
    }
    return rc;
}

EXPORT CUresult cuInit(unsigned int flags)
{
    ensure_cuda();
    if (!real_cuInit)
        return CUDA_ERROR_NOT_INITIALIZED;
    return real_cuInit(flags);
}

/* ------------------------------------------------------------------ NVML <-> CUDA index */
/* Maps an NVML device to the CUDA ordinal the limits are indexed by (CUDA_VISIBLE_DEVICES
 * order when set, else the NVML index). Returns -1 when the device is not visible. */
int nvml_to_cuda_index(nvmlDevice_t d)
{
    unsigned idx = 0;
    if (!g_nvml.get_index || g_nvml.get_index(d, &idx) != NVML_SUCCESS)
        return -1;
    if (g_cfg.nvisible < 0)
        return idx < VGPU_MAX_DEV ? (int)idx : -1;
    char uuid[96] = "";
    int have_uuid = 0;
    for (int i = 0; i < g_cfg.nvisible; i++) {
        const char *v = g_cfg.visible[i];
        if (isdigit((unsigned char)v[0])) {
            if ((unsigned)atoi(v) == idx)
                return i;
        } else {
            if (!have_uuid) {
                if (!g_nvml.get_uuid || g_nvml.get_uuid(d, uuid, sizeof uuid) != NVML_SUCCESS)
                    return -1;
                have_uuid = 1;
            }
            if (!strncmp(uuid, v, strlen(v)))
                return i;
        }
    }
    return -1;
}

/* ------------------------------------------------------------------ test/diagnostic API */
/* Accounted usage and limit of CUDA device `dev` for this container (bytes). Returns 0 on success. */
EXPORT int vgpu_get_usage(int dev, uint64_t *used, uint64_t *limit)
{
    vgpu_base_init();
    if (dev < 0 || dev >= VGPU_MAX_DEV)
        return -1;
    if (used)
        *used = region_used(dev);
    if (limit)
        *limit = g_cfg.mem_set[dev] ? g_cfg.mem_limit[dev] : 0;
    return 0;
}

EXPORT const char *vgpu_version(void)
{
    return "libvgpu 0.1.0";
}
