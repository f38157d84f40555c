/*
 * libvgpu core: logging, loading of the real
 * libcuda.so.1 / libnvidia-ml.so.1, and the three lookup paths that hand out hooks:
 * exported symbols (direct linking), an overridden dlsym(), and cuGetProcAddress(_v2).
 */
#include "vgpu.h"
#include "config.h"

#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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

static int g_cuda_ready;
const int *const vgpu_cuda_ready = &g_cuda_ready;

static void *g_libcuda;
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
    if (level > vgpu_cfg->log_level)
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

/* ------------------------------------------------------------------ init */
static pthread_once_t g_base_once = PTHREAD_ONCE_INIT;
static pthread_once_t g_cuda_once = PTHREAD_ONCE_INIT;

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
    vgpu_read_config();
    if (vgpu_cfg->enabled)
        region_open();
    LOG_INFO("libvgpu initialised (control %s)", vgpu_cfg->enabled ? "on" : "off");
}

void vgpu_base_init(void)
{
    pthread_once(&g_base_once, base_init);
}

void *vgpu_open_library(const char *env, const char *dflt)
{
    vgpu_base_init();
    const char *path = getenv(env);
    return dlopen(path && *path ? path : dflt, RTLD_NOW | RTLD_GLOBAL);
}

void *vgpu_real_dlsym(void *handle, const char *symbol)
{
    if (!real_dlsym)
        resolve_real_dlsym();
    return real_dlsym(handle, symbol);
}

static void cuda_init(void)
{
    g_libcuda = vgpu_open_library(VGPU_ENV_CUDA_LIBRARY, "libcuda.so.1");
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
    int throttled = limiter_init();
    __atomic_store_n(&g_cuda_ready, 1, __ATOMIC_RELEASE);
    if (throttled)
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
/* The hook for the entry point the driver returned. The driver's own table picks the versioned symbol
 * for (name, cudaVersion, flags) and returns its exported address, so the hook is found by that
 * address: exactly the ABI the caller asked for (cuCtxCreate at 11040 is cuCtxCreate_v3, never the
 * _v2 hook). An address that is not one of the resolved exports is named with dladdr(); one that
 * cannot be named is passed through unhooked (never guessed by name: a wrong ABI corrupts the call). */
static void *proc_hook(const char *symbol, void *real)
{
    void *h = hook_by_real(real);
    if (h)
        return h;
    Dl_info di;
    if (dladdr(real, &di) && di.dli_sname && di.dli_saddr == real)
        return hooked_symbol(di.dli_sname);
    static int warned;
    if (!warned) {
        warned = 1;
        LOG_WARN("cuGetProcAddress(\"%s\") returned an address that is not an exported entry point; passed through "
                 "unhooked", symbol ? symbol : "");
    }
    return NULL;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    ensure_cuda();
    if (!real_cuGetProcAddress)
        return CUDA_ERROR_NOT_FOUND;
    CUresult rc = real_cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn && *pfn) {
        void *h = proc_hook(symbol, *pfn);
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
        void *h = proc_hook(symbol, *pfn);
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

/* ------------------------------------------------------------------ device mapping (see vgpu.h) */
static int g_ord_dev[VGPU_MAX_DEV]; /* container GPU index + 1 per CUDA ordinal, 0 = not known yet */

static int dev_of_uuid(const char *uuid)
{
    if (vgpu_cfg->nuuid > 0) {
        for (int i = 0; i < vgpu_cfg->nuuid; i++)
            if (!strcasecmp(vgpu_cfg->uuid[i], uuid))
                return i;
        return VGPU_FOREIGN;
    }
    nvmlDevice_t h;
    unsigned idx;
    if (vgpu_nvml_load() && vnvml_handle_by_uuid(uuid, &h) == NVML_SUCCESS && vnvml_index(h, &idx) == NVML_SUCCESS &&
        idx < VGPU_MAX_DEV)
        return (int)idx;
    return -1;
}

int vgpu_dev_of_cuda(CUdevice ord)
{
    if (ord < 0 || ord >= VGPU_MAX_DEV)
        return vgpu_cfg->nuuid > 0 ? VGPU_FOREIGN : -1;
    int c = __atomic_load_n(&g_ord_dev[ord], __ATOMIC_RELAXED);
    if (LIKELY(c))
        return c - 1;
    CUuuid u;
    int d = -1, known = 0;
    if (real_cuDeviceGetUuid && real_cuDeviceGetUuid(&u, ord) == CUDA_SUCCESS) {
        char uuid[48];
        const unsigned char *b = u.bytes;
        snprintf(uuid, sizeof uuid, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
        d = dev_of_uuid(uuid);
        known = d >= 0;
    }
    if (d < 0) {
        if (vgpu_cfg->nuuid > 0)
            return VGPU_FOREIGN; /* the container's GPUs are known and this one cannot be named: nothing */
        /* no UUID and no list (no NVML): the process's numbering, through a numeric CUDA_VISIBLE_DEVICES */
        d = ord;
        if (vgpu_cfg->nvisible > 0 && ord < vgpu_cfg->nvisible && isdigit((unsigned char)vgpu_cfg->visible[ord][0]) &&
            atoi(vgpu_cfg->visible[ord]) < VGPU_MAX_DEV)
            d = atoi(vgpu_cfg->visible[ord]);
    }
    if (known)
        __atomic_store_n(&g_ord_dev[ord], d + 1, __ATOMIC_RELAXED);
    return d;
}

int vgpu_dev_of_nvml(nvmlDevice_t h)
{
    char uuid[96] = "";
    if (vnvml_uuid(h, uuid, sizeof uuid) == NVML_SUCCESS)
        return dev_of_uuid(uuid);
    return -1;
}

int vgpu_nvml_of_dev(int dev, nvmlDevice_t *out)
{
    if (dev < 0 || dev >= VGPU_MAX_DEV || !vgpu_nvml_load())
        return -1;
    if (vgpu_cfg->nuuid > 0)
        return dev < vgpu_cfg->nuuid && vnvml_handle_by_uuid(vgpu_cfg->uuid[dev], out) == NVML_SUCCESS ? 0 : -1;
    return vnvml_handle_by_index((unsigned)dev, out) == NVML_SUCCESS ? 0 : -1;
}

int vgpu_mem_limit(int dev, uint64_t *limit)
{
    if (dev == VGPU_FOREIGN) {
        *limit = 0;
        return 1;
    }
    if (dev < 0 || dev >= VGPU_MAX_DEV || !vgpu_cfg->mem_set[dev])
        return 0;
    *limit = vgpu_cfg->mem_limit[dev];
    return 1;
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
        *limit = vgpu_cfg->mem_set[dev] ? vgpu_cfg->mem_limit[dev] : 0;
    return 0;
}

EXPORT const char *vgpu_version(void)
{
    return "libvgpu 0.1.0";
}
