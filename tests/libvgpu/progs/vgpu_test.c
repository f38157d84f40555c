/*
 * Scenario driver for the libvgpu tests.  Linked directly against libcuda.so.1 (the fake), run
 * with the shim in LD_PRELOAD.  argv[1] picks how CUDA entry points are found:
 *   direct   - the program's own imports (resolved by the dynamic linker: shim interposes)
 *   dlsym    - dlopen("libcuda.so.1") + dlsym (the shim's dlsym override)
 *   procaddr - cuGetProcAddress_v2 (the shim's cuGetProcAddress hook)
 * argv[2] is the scenario; results are printed as "key=value" lines for pytest to assert.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"

/* prototypes of the driver API as linked directly */
CUresult cuInit(unsigned int);
CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuCtxSetLimit(int, size_t);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned int);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuArrayCreate_v2(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
CUresult cuArray3DCreate_v2(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
CUresult cuArrayDestroy(CUarray);
CUresult cuMipmappedArrayCreate(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned int);
CUresult cuMipmappedArrayDestroy(CUmipmappedArray);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuMemPoolCreate(CUmemoryPool *, const CUmemPoolProps *);
CUresult cuMemPoolDestroy(CUmemoryPool);
CUresult cuMemPoolTrimTo(CUmemoryPool, size_t);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *, CUdevice);
CUresult cuMemPoolSetAttribute(CUmemoryPool, int, void *);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamBeginCapture_v2(CUstream, int);
CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphExecDestroy(CUgraphExec);
CUresult cuGraphDestroy(CUgraph);

#define API(X)                                                                                           \
    X(cuInit) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease_v2) X(cuCtxCreate_v2) X(cuCtxDestroy_v2) \
    X(cuCtxSetCurrent) X(cuCtxSynchronize) X(cuMemAlloc_v2) X(cuMemAllocManaged) X(cuMemAllocPitch_v2)      \
    X(cuMemAllocAsync) X(cuMemAllocFromPoolAsync) X(cuMemFree_v2) X(cuMemFreeAsync) X(cuMemCreate)           \
    X(cuMemRelease) X(cuArrayCreate_v2) X(cuArray3DCreate_v2) X(cuArrayDestroy) X(cuMipmappedArrayCreate)    \
    X(cuMipmappedArrayDestroy) X(cuMemGetInfo_v2) X(cuDeviceTotalMem_v2) X(cuMemPoolCreate)                  \
    X(cuMemPoolDestroy) X(cuStreamCreate) X(cuStreamDestroy_v2) X(cuStreamSynchronize)                       \
    X(cuStreamBeginCapture_v2) X(cuStreamEndCapture) X(cuModuleLoadData) X(cuModuleGetFunction)              \
    X(cuLaunchKernel) X(cuLaunchKernelEx) X(cuGraphInstantiateWithFlags) X(cuGraphLaunch)                    \
    X(cuGraphExecDestroy) X(cuGraphDestroy) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap)  \
    X(cuMemPoolTrimTo) X(cuDeviceGetDefaultMemPool) X(cuMemPoolSetAttribute) X(cuCtxSetLimit)

/* name as passed to cuGetProcAddress (unversioned) */
static const char *base_name(const char *n, char *buf, size_t len)
{
    snprintf(buf, len, "%s", n);
    char *v = strstr(buf, "_v2");
    if (v && v[3] == 0)
        *v = 0;
    return buf;
}

#define DECL(n) static __typeof__(&n) p_##n;
API(DECL)

static int g_hooked = 0, g_total = 0;
static const char *g_mode;

static char g_hooked_names[4096];

static void check_hooked_name(const char *name, void *p)
{
    Dl_info info;
    g_total++;
    if (p && dladdr(p, &info) && info.dli_fname && strstr(info.dli_fname, "libvgpu")) {
        g_hooked++;
        strncat(g_hooked_names, name, sizeof g_hooked_names - strlen(g_hooked_names) - 2);
        strcat(g_hooked_names, ",");
    }
}

static void load_api(const char *mode)
{
    g_mode = mode;
    if (!strcmp(mode, "direct")) {
#define DIRECT(n) p_##n = n; check_hooked_name(#n, (void *)p_##n);
        API(DIRECT)
    } else if (!strcmp(mode, "dlsym")) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW);
        if (!h) {
            printf("error=dlopen\n");
            exit(3);
        }
#define DLSYM(n) p_##n = (__typeof__(&n))dlsym(h, #n); check_hooked_name(#n, (void *)p_##n);
        API(DLSYM)
    } else {
        void *h = dlopen("libcuda.so.1", RTLD_NOW);
        __typeof__(&cuGetProcAddress_v2) gpa = h ? (__typeof__(&cuGetProcAddress_v2))dlsym(h, "cuGetProcAddress_v2") : NULL;
        if (!gpa) {
            printf("error=gpa\n");
            exit(3);
        }
        /* the runtime first asks for cuGetProcAddress itself, then uses what it got */
        void *again = NULL;
        gpa("cuGetProcAddress", &again, 12040, 0, NULL);
        if (again)
            gpa = (__typeof__(&cuGetProcAddress_v2))again;
        char buf[128];
        CUdriverProcAddressQueryResult st;
#define GPA(n) gpa(base_name(#n, buf, sizeof buf), (void **)&p_##n, 12040, 0, &st); check_hooked_name(#n, (void *)p_##n);
        API(GPA)
    }
}

static int (*vgpu_get_usage)(int, uint64_t *, uint64_t *);

static unsigned long long usage(int dev)
{
    uint64_t u = 0, l = 0;
    if (!vgpu_get_usage)
        vgpu_get_usage = (int (*)(int, uint64_t *, uint64_t *))dlsym(RTLD_DEFAULT, "vgpu_get_usage");
    if (!vgpu_get_usage || vgpu_get_usage(dev, &u, &l) != 0)
        return ~0ull;
    return u;
}

#define MIB (1024ull * 1024ull)
#define GIB (1024ull * MIB)

static CUcontext init_ctx(int dev)
{
    CUcontext c = NULL;
    CUresult rc = p_cuInit(0);
    if (rc == CUDA_SUCCESS)
        rc = p_cuDevicePrimaryCtxRetain(&c, dev);
    if (rc == CUDA_SUCCESS)
        rc = p_cuCtxSetCurrent(c);
    if (rc != CUDA_SUCCESS) {
        printf("error=init rc=%d\n", rc);
        exit(3);
    }
    return c;
}

#define SHOW(label, call)                                          \
    do {                                                           \
        CUresult r_ = (call);                                      \
        printf("%s=%d:%llu\n", label, r_, usage(0));               \
    } while (0)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ------------------------------------------------------------------ scenarios */
static int sc_basic(void)
{
    /* limit expected 1 GiB, context cost 0 */
    init_ctx(0);
    printf("hooked=%d total=%d\n", g_hooked, g_total);
    printf("hooked_names=%s\n", g_hooked_names);
    CUdeviceptr a = 0, b = 0;
    SHOW("alloc512", p_cuMemAlloc_v2(&a, 512 * MIB));
    SHOW("alloc768", p_cuMemAlloc_v2(&b, 768 * MIB));
    size_t fr = 0, tot = 0, dt = 0;
    CUresult rc = p_cuMemGetInfo_v2(&fr, &tot);
    printf("meminfo_rc=%d free=%zu total=%zu\n", rc, fr, tot);
    rc = p_cuDeviceTotalMem_v2(&dt, 0);
    printf("totalmem_rc=%d totalmem=%zu\n", rc, dt);
    SHOW("freed", p_cuMemFree_v2(a));
    return 0;
}

/* ---- memory pools keep freed memory reserved (limit expected 1 GiB, context cost 0) */
static int sc_pool(void)
{
    init_ctx(0);
    CUstream s;
    p_cuStreamCreate(&s, 0);
    CUdeviceptr a = 0, b = 0;
    SHOW("async600", p_cuMemAllocAsync(&a, 600 * MIB, s));
    SHOW("freeasync", p_cuMemFreeAsync(a, s)); /* back to the pool, which keeps it reserved */
    SHOW("alloc600_pool_holds", p_cuMemAlloc_v2(&b, 600 * MIB));
    SHOW("async600_reuse", p_cuMemAllocAsync(&a, 600 * MIB, s)); /* from the pool's reserve */
    SHOW("freeasync2", p_cuMemFreeAsync(a, s));
    SHOW("sync", p_cuStreamSynchronize(s)); /* release threshold 0: the pool gives the memory back */
    SHOW("alloc600_released", p_cuMemAlloc_v2(&b, 600 * MIB));
    SHOW("free", p_cuMemFree_v2(b));
    CUmemoryPool pool;
    unsigned long long keep = ~0ull;
    p_cuDeviceGetDefaultMemPool(&pool, 0);
    p_cuMemPoolSetAttribute(pool, 4 /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */, &keep);
    SHOW("async600_keep", p_cuMemAllocAsync(&a, 600 * MIB, s));
    SHOW("freeasync3", p_cuMemFreeAsync(a, s));
    SHOW("sync_keep", p_cuStreamSynchronize(s)); /* threshold: the pool keeps it */
    SHOW("alloc600_kept", p_cuMemAlloc_v2(&b, 600 * MIB));
    SHOW("trim", p_cuMemPoolTrimTo(pool, 0));
    SHOW("alloc600_trimmed", p_cuMemAlloc_v2(&b, 600 * MIB));
    return 0;
}

/* ---- allocate `mib` with cuMemAllocAsync, free it (the pool keeps it reserved), then wait */
static int sc_pool_hold(unsigned long long mib, double seconds)
{
    init_ctx(0);
    CUstream s;
    p_cuStreamCreate(&s, 0);
    CUdeviceptr a = 0;
    CUresult r = p_cuMemAllocAsync(&a, mib * MIB, s);
    printf("held=%d:%llu\n", r ? r : p_cuMemFreeAsync(a, s), usage(0));
    fflush(stdout);
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    nanosleep(&ts, NULL);
    return 0;
}

/* cuCtxSetLimit takes device memory: malloc heap (2), printf FIFO (1), per-thread stack (0) */
static int sc_limits(void)
{
    init_ctx(0);
    CUdeviceptr a = 0;
    SHOW("heap300", p_cuCtxSetLimit(2, 300 * MIB));
    SHOW("heap2g", p_cuCtxSetLimit(2, 2 * GIB));
    SHOW("alloc800", p_cuMemAlloc_v2(&a, 800 * MIB));
    SHOW("heap0", p_cuCtxSetLimit(2, 0));
    SHOW("alloc800again", p_cuMemAlloc_v2(&a, 800 * MIB));
    SHOW("stack1k", p_cuCtxSetLimit(0, 1024));
    SHOW("fifo100m", p_cuCtxSetLimit(1, 100 * MIB));
    SHOW("fifo50m", p_cuCtxSetLimit(1, 50 * MIB));
    return 0;
}

static int sc_kf20(void)
{
    init_ctx(0);
    unsigned long long before = usage(0);
    CUdeviceptr p = 0;
    CUresult rc = p_cuMemAlloc_v2(&p, 2 * GIB);
    unsigned long long after = usage(0);
    printf("rc=%d usage_before=%llu usage_after=%llu\n", rc, before, after);
    return 0;
}

static int sc_kf22(void)
{
    CUcontext ctx = NULL;
    p_cuInit(0);
    p_cuCtxCreate_v2(&ctx, 0, 0);
    CUstream s;
    p_cuStreamCreate(&s, 0);
    CUdeviceptr p = 0;
    SHOW("alloc", p_cuMemAllocAsync(&p, GIB, s));
    SHOW("free1", p_cuMemFreeAsync(p, s)); /* back to the device's pool, which keeps it reserved */
    CUmemoryPool pool;
    p_cuDeviceGetDefaultMemPool(&pool, 0);
    SHOW("trim", p_cuMemPoolTrimTo(pool, 0));
    SHOW("free2", p_cuMemFreeAsync(p, s));
    SHOW("unknown", p_cuMemFree_v2((CUdeviceptr)0x1234567000ull));
    CUdeviceptr q = 0;
    SHOW("q", p_cuMemAlloc_v2(&q, 256 * MIB));
    SHOW("ctx_destroy", p_cuCtxDestroy_v2(ctx));
    CUcontext ctx2;
    SHOW("ctx2", p_cuCtxCreate_v2(&ctx2, 0, 0));
    SHOW("late", p_cuMemFree_v2(q));
    CUdeviceptr r = 0;
    SHOW("again", p_cuMemAlloc_v2(&r, GIB));
    SHOW("end", p_cuMemFree_v2(r));
    return 0;
}

static int sc_kf23(void)
{
    init_ctx(0);
    CUstream s;
    p_cuStreamCreate(&s, 0);
    int ooms = 0, errs = 0;
    unsigned long long base = usage(0), maxu = 0;
    for (int i = 0; i < 1000; i++) {
        CUdeviceptr p = 0;
        CUresult rc = p_cuMemAllocAsync(&p, 256 * MIB, s);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY)
            ooms++;
        else if (rc)
            errs++;
        unsigned long long u = usage(0);
        if (u > maxu)
            maxu = u;
        if (rc == CUDA_SUCCESS && p_cuMemFreeAsync(p, s))
            errs++;
        p_cuStreamSynchronize(s);
    }
    size_t fr = 0, tot = 0;
    p_cuMemGetInfo_v2(&fr, &tot); /* a memory report re-reads what the pool still holds */
    printf("ooms=%d errs=%d base=%llu max=%llu end=%llu\n", ooms, errs, base, maxu, usage(0));
    return 0;
}

static int sc_kf24(void)
{
    init_ctx(0);
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = 1;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    CUmemoryPool pool;
    SHOW("pool", p_cuMemPoolCreate(&pool, &props));
    CUstream s;
    p_cuStreamCreate(&s, 0);
    CUdeviceptr p = 0;
    SHOW("big", p_cuMemAllocFromPoolAsync(&p, 2 * GIB, pool, s));
    CUdeviceptr q = 0;
    SHOW("small", p_cuMemAllocFromPoolAsync(&q, 512 * MIB, pool, s));
    CUdeviceptr r = 0;
    SHOW("second", p_cuMemAllocFromPoolAsync(&r, 600 * MIB, pool, s));
    SHOW("free", p_cuMemFreeAsync(q, s)); /* the pool keeps it reserved */
    SHOW("destroy", p_cuMemPoolDestroy(pool));
    return 0;
}

/* every allocation path and its free, each checked against the accounted usage */
static int sc_paths(void)
{
    init_ctx(0);
    CUstream s;
    p_cuStreamCreate(&s, 0);
    CUdeviceptr p;
    size_t pitch = 0;
    SHOW("managed", p_cuMemAllocManaged(&p, 8 * MIB, 1));
    SHOW("managed_free", p_cuMemFree_v2(p));
    SHOW("pitch", p_cuMemAllocPitch_v2(&p, &pitch, 1000, 1024, 4));
    printf("pitch_bytes=%zu\n", pitch * 1024);
    SHOW("pitch_free", p_cuMemFree_v2(p));
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUmemGenericAllocationHandle h;
    SHOW("create", p_cuMemCreate(&h, 64 * MIB, &prop, 0));
    SHOW("release", p_cuMemRelease(h));
    CUDA_ARRAY_DESCRIPTOR ad = {1024, 1024, CU_AD_FORMAT_FLOAT, 4};
    CUarray a;
    SHOW("array", p_cuArrayCreate_v2(&a, &ad));
    SHOW("array_free", p_cuArrayDestroy(a));
    CUDA_ARRAY_DESCRIPTOR bad = {1024, 1024, 0x77, 1}; /* no such format: refused, nothing kept */
    SHOW("array_badformat", p_cuArrayCreate_v2(&a, &bad));
    CUDA_ARRAY3D_DESCRIPTOR d3 = {256, 256, 16, CU_AD_FORMAT_HALF, 2, 0};
    SHOW("array3d", p_cuArray3DCreate_v2(&a, &d3));
    SHOW("array3d_free", p_cuArrayDestroy(a));
    CUDA_ARRAY3D_DESCRIPTOR dm = {1024, 1024, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 0};
    CUmipmappedArray m;
    SHOW("mipmap", p_cuMipmappedArrayCreate(&m, &dm, 3));
    SHOW("mipmap_free", p_cuMipmappedArrayDestroy(m));
    /* over the limit on each path (limit 1 GiB): usage unchanged */
    CUDA_ARRAY_DESCRIPTOR big = {65536, 8192, CU_AD_FORMAT_FLOAT, 1};
    SHOW("array_oom", p_cuArrayCreate_v2(&a, &big));
    prop.location.id = 0;
    SHOW("create_oom", p_cuMemCreate(&h, 2 * GIB, &prop, 0));
    SHOW("managed_oom", p_cuMemAllocManaged(&p, 2 * GIB, 1));
    SHOW("pitch_oom", p_cuMemAllocPitch_v2(&p, &pitch, 65536, 32768, 4));
    SHOW("async_oom", p_cuMemAllocAsync(&p, 2 * GIB, s));
    return 0;
}

/* ---- VMM: the CUDA samples' pattern (create, reserve, map, release while mapped), limit 1 GiB */
static int sc_vmm(void)
{
    init_ctx(0);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUdeviceptr va[8];
    CUmemGenericAllocationHandle h;
    int mapped = 0;
    for (int i = 0; i < 8; i++) {
        p_cuMemAddressReserve(&va[i], 512 * MIB, 0, 0, 0);
        CUresult rc = p_cuMemCreate(&h, 512 * MIB, &prop, 0);
        if (rc == CUDA_SUCCESS && p_cuMemMap(va[i], 512 * MIB, 0, h, 0) == CUDA_SUCCESS) {
            mapped++;
            p_cuMemRelease(h); /* still mapped: the memory stays allocated */
        }
        char label[32];
        snprintf(label, sizeof label, "loop%d", i);
        printf("%s=%d:%llu\n", label, rc, usage(0));
    }
    printf("mapped_mib=%d\n", mapped * 512);
    SHOW("unmap0", p_cuMemUnmap(va[0], 512 * MIB));
    SHOW("again", p_cuMemCreate(&h, 512 * MIB, &prop, 0));
    SHOW("map_again", p_cuMemMap(va[0], 512 * MIB, 0, h, 0));
    SHOW("unmap_again", p_cuMemUnmap(va[0], 512 * MIB)); /* handle not released yet: stays charged */
    SHOW("release_again", p_cuMemRelease(h));
    SHOW("unmap1", p_cuMemUnmap(va[1], 512 * MIB));
    /* two handles mapped side by side, released, then unmapped in one call */
    CUdeviceptr big;
    CUmemGenericAllocationHandle a, b;
    p_cuMemAddressReserve(&big, GIB, 0, 0, 0);
    SHOW("a", p_cuMemCreate(&a, 512 * MIB, &prop, 0));
    SHOW("b", p_cuMemCreate(&b, 512 * MIB, &prop, 0));
    p_cuMemMap(big, 512 * MIB, 0, a, 0);
    p_cuMemMap(big + 512 * MIB, 512 * MIB, 0, b, 0);
    p_cuMemRelease(a);
    SHOW("released_both", p_cuMemRelease(b));
    SHOW("unmap_both", p_cuMemUnmap(big, GIB));
    SHOW("double_release", p_cuMemRelease(a));
    p_cuMemAddressFree(big, GIB);
    size_t fr = 0, tot = 0;
    p_cuMemGetInfo_v2(&fr, &tot);
    printf("meminfo free=%zu total=%zu\n", fr, tot);
    return 0;
}

/* ---- multi-threaded stress */
static unsigned long long g_limit;
static int g_iters;
static volatile int g_over;
static unsigned long long g_max;
static int g_ooms;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static void *stress_thread(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg * 7919u + (unsigned)getpid();
    CUcontext c = NULL;
    p_cuDevicePrimaryCtxRetain(&c, 0);
    p_cuCtxSetCurrent(c);
    CUstream s;
    p_cuStreamCreate(&s, 0);
    CUdeviceptr held[8] = {0};
    int ooms = 0;
    for (int i = 0; i < g_iters; i++) {
        int k = (int)(rand_r(&seed) % 8);
        if (held[k]) {
            if (k & 1)
                p_cuMemFreeAsync(held[k], s);
            else
                p_cuMemFree_v2(held[k]);
            held[k] = 0;
        } else {
            size_t sz = (size_t)(1 + rand_r(&seed) % 64) * MIB;
            CUresult rc = (k & 1) ? p_cuMemAllocAsync(&held[k], sz, s) : p_cuMemAlloc_v2(&held[k], sz);
            if (rc == CUDA_ERROR_OUT_OF_MEMORY)
                ooms++;
            if (rc)
                held[k] = 0;
        }
        unsigned long long u = usage(0);
        if (u > g_limit)
            g_over = 1;
        pthread_mutex_lock(&g_mu);
        if (u > g_max)
            g_max = u;
        pthread_mutex_unlock(&g_mu);
    }
    for (int k = 0; k < 8; k++)
        if (held[k])
            p_cuMemFree_v2(held[k]);
    p_cuStreamDestroy_v2(s);
    pthread_mutex_lock(&g_mu);
    g_ooms += ooms;
    pthread_mutex_unlock(&g_mu);
    return NULL;
}

static int sc_stress(int threads, int iters, unsigned long long limit)
{
    init_ctx(0);
    g_limit = limit;
    g_iters = iters;
    pthread_t t[64];
    for (int i = 0; i < threads && i < 64; i++)
        pthread_create(&t[i], NULL, stress_thread, (void *)(uintptr_t)i);
    for (int i = 0; i < threads && i < 64; i++)
        pthread_join(t[i], NULL);
    printf("over=%d max=%llu ooms=%d end_process=%llu\n", g_over, g_max, g_ooms, usage(0));
    return 0;
}

/* ---- KF-29: take the shared lock and wait to be killed */
static int sc_hold_lock(void)
{
    init_ctx(0);
    CUdeviceptr p;
    p_cuMemAlloc_v2(&p, 100 * MIB);
    int (*hold)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "vgpu_debug_hold_lock");
    printf("hold=%d\n", hold ? hold() : -1);
    printf("locked\n");
    fflush(stdout);
    for (;;)
        pause();
    return 0;
}

/* ---- SM limit: launch kernels of `blocks` blocks as fast as allowed; report busy share per window */
static int sc_sm(double seconds, unsigned blocks, double window, int use_ex)
{
    init_ctx(0);
    CUmodule mod;
    CUfunction f;
    p_cuModuleLoadData(&mod, "fake");
    p_cuModuleGetFunction(&f, mod, "busy");
    CUstream s;
    p_cuStreamCreate(&s, 0);
    double ns_per_block = getenv("FAKE_CUDA_NS_PER_BLOCK") ? atof(getenv("FAKE_CUDA_NS_PER_BLOCK")) : 1000.0;
    /* Windows close at the first launch past t0 + k * window (fixed boundaries: a late close, the host
     * having run something else, shortens the next window instead of pushing every later one back), and
     * the run lasts `seconds` but at least until floor(seconds / window) windows have closed. */
    double t0 = now_s(), wstart = t0, wnext = t0 + window;
    unsigned closed = 0, want = (unsigned)(seconds / window);
    unsigned long long n = 0, total = 0;
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDimX = blocks;
    cfg.gridDimY = cfg.gridDimZ = cfg.blockDimX = cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.hStream = s;
    while (now_s() - t0 < seconds || closed < want) {
        CUresult rc = use_ex ? p_cuLaunchKernelEx(&cfg, f, NULL, NULL)
                             : p_cuLaunchKernel(f, blocks, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        if (rc) {
            printf("error=launch rc=%d\n", rc);
            return 1;
        }
        n++;
        total++;
        double t = now_s();
        if (t >= wnext) {
            p_cuStreamSynchronize(s);
            t = now_s();
            printf("window util=%.2f kernels=%llu\n", 100.0 * (double)n * blocks * ns_per_block / 1e9 / (t - wstart), n);
            fflush(stdout);
            n = 0;
            wstart = t;
            closed++;
            wnext += window;
            if (wnext < t + window / 2) /* closed more than half a window late: the next one is whole */
                wnext = t + window;
        }
    }
    printf("total_kernels=%llu\n", total);
    return 0;
}

/* ---- kernel-shape change: `small`-block kernels for `before` s, then `big`-block kernels for `after` s.
 * Every launch's simulated duration (FAKE_CUDA_NS_PER_LAUNCH + blocks * FAKE_CUDA_NS_PER_BLOCK) is booked
 * to the bin of its launch time; prints the busy share of each `bin`-second bin after the change, and
 * of the last second before it and the last second of the run. */
static int sc_shape(double before, double after, unsigned small, unsigned big, double bin)
{
    init_ctx(0);
    CUmodule mod;
    CUfunction f;
    p_cuModuleLoadData(&mod, "fake");
    p_cuModuleGetFunction(&f, mod, "busy");
    CUstream s;
    p_cuStreamCreate(&s, 0);
    double per_block = getenv("FAKE_CUDA_NS_PER_BLOCK") ? atof(getenv("FAKE_CUDA_NS_PER_BLOCK")) : 1000.0;
    double per_launch = getenv("FAKE_CUDA_NS_PER_LAUNCH") ? atof(getenv("FAKE_CUDA_NS_PER_LAUNCH")) : 0.0;
    size_t nbins = (size_t)((before + after) / bin) + 2;
    double *busy = calloc(nbins, sizeof *busy);
    if (!busy)
        return 1;
    double t0 = now_s(), t;
    while ((t = now_s()) - t0 < before + after) {
        unsigned blocks = t - t0 < before ? small : big;
        if (p_cuLaunchKernel(f, blocks, 1, 1, 1, 1, 1, 0, s, NULL, NULL)) {
            printf("error=launch\n");
            return 1;
        }
        size_t b = (size_t)((t - t0) / bin);
        if (b < nbins)
            busy[b] += (per_launch + blocks * per_block) / 1e9;
    }
    p_cuStreamSynchronize(s);
    size_t change = (size_t)(before / bin), last = (size_t)((before + after) / bin);
    size_t per_s = (size_t)(1.0 / bin);
    double pre = 0, post = 0;
    for (size_t b = change - per_s; b < change; b++)
        pre += busy[b];
    for (size_t b = last - per_s; b < last; b++)
        post += busy[b];
    printf("before util=%.2f\nafter util=%.2f\n", 100.0 * pre / (per_s * bin), 100.0 * post / (per_s * bin));
    for (size_t b = change; b < last; b++)
        printf("bin t=%.0f util=%.2f\n", (double)(b - change) * bin * 1000, 100.0 * busy[b] / bin);
    free(busy);
    return 0;
}

/* ---- KF-26: 1000 kernels captured into a graph, graph launched in a loop */
static int sc_graph(double seconds, unsigned kernels, unsigned blocks)
{
    init_ctx(0);
    CUmodule mod;
    CUfunction f;
    p_cuModuleLoadData(&mod, "fake");
    p_cuModuleGetFunction(&f, mod, "busy");
    CUstream s;
    p_cuStreamCreate(&s, 0);
    CUgraph g;
    p_cuStreamBeginCapture_v2(s, 0);
    for (unsigned i = 0; i < kernels; i++)
        p_cuLaunchKernel(f, blocks, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
    p_cuStreamEndCapture(s, &g);
    CUgraphExec e;
    SHOW("instantiate", p_cuGraphInstantiateWithFlags(&e, g, 0));
    double ns_per_block = getenv("FAKE_CUDA_NS_PER_BLOCK") ? atof(getenv("FAKE_CUDA_NS_PER_BLOCK")) : 1000.0;
    double t0 = now_s();
    unsigned long long n = 0;
    while (now_s() - t0 < seconds) {
        if (p_cuGraphLaunch(e, s))
            return 1;
        n++;
    }
    p_cuStreamSynchronize(s);
    double el = now_s() - t0;
    printf("graphs=%llu util=%.2f\n", n, 100.0 * (double)n * kernels * blocks * ns_per_block / 1e9 / el);
    p_cuGraphExecDestroy(e);
    p_cuGraphDestroy(g);
    return 0;
}

/* ---- tiny limit below the context's cost */
static int sc_tiny(void)
{
    init_ctx(0);
    size_t fr = 1, tot = 0;
    CUresult rc = p_cuMemGetInfo_v2(&fr, &tot);
    unsigned long long u = usage(0);
    printf("meminfo_rc=%d free=%zu total=%zu usage=%llu\n", rc, fr, tot, u);
    CUdeviceptr p;
    SHOW("alloc", p_cuMemAlloc_v2(&p, MIB));
    SHOW("release", p_cuDevicePrimaryCtxRelease_v2(0));
    return 0;
}

/* ---- hold an allocation for a while (multi-process tests) */
static int sc_hold(unsigned long long mib, double seconds)
{
    init_ctx(0);
    CUdeviceptr p;
    SHOW("hold", p_cuMemAlloc_v2(&p, mib * MIB));
    fflush(stdout);
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    nanosleep(&ts, NULL);
    return 0;
}

/* ---- hold an allocation on CUDA ordinal `ord` (this process's numbering); usage of container GPUs 0 and 1 */
static int sc_hold_on(int ord, unsigned long long mib, double seconds)
{
    init_ctx(ord);
    CUdeviceptr p;
    CUresult r = p_cuMemAlloc_v2(&p, mib * MIB);
    printf("hold=%d used0=%llu used1=%llu\n", r, usage(0), usage(1));
    fflush(stdout);
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    nanosleep(&ts, NULL);
    return 0;
}

/* ---- allocate, wait for a line on stdin (the test damages the shared file meanwhile), then go on:
 * "step" allocations of the given sizes (MiB) print rc:usage; then cuMemGetInfo and a free. */
static int sc_hold_then(unsigned long long first, int n, char **sizes)
{
    init_ctx(0);
    CUdeviceptr p0;
    SHOW("first", p_cuMemAlloc_v2(&p0, first * MIB));
    printf("ready\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin))
        return 3;
    for (int i = 0; i < n; i++) {
        CUdeviceptr p;
        char label[32];
        snprintf(label, sizeof label, "step%d", i);
        CUresult r = p_cuMemAlloc_v2(&p, strtoull(sizes[i], NULL, 10) * MIB);
        printf("%s=%d:%llu\n", label, r, usage(0));
        if (r == CUDA_SUCCESS && i + 1 == n)
            p_cuMemFree_v2(p);
    }
    size_t fr = 0, tot = 0;
    CUresult rc = p_cuMemGetInfo_v2(&fr, &tot);
    printf("meminfo_rc=%d free=%zu total=%zu\n", rc, fr, tot);
    SHOW("free0", p_cuMemFree_v2(p0));
    return 0;
}

/* ---- allocate on request: each stdin line "<MiB>" allocates that much and prints alloc=rc:usage */
static int sc_steps(void)
{
    init_ctx(0);
    printf("ready\n");
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        CUdeviceptr p;
        CUresult r = p_cuMemAlloc_v2(&p, strtoull(line, NULL, 10) * MIB);
        printf("alloc=%d:%llu\n", r, usage(0));
        fflush(stdout);
    }
    return 0;
}

/* ---- n refused allocations in a row (log volume) */
static int sc_oomloop(int n)
{
    init_ctx(0);
    int ooms = 0;
    for (int i = 0; i < n; i++) {
        CUdeviceptr p;
        if (p_cuMemAlloc_v2(&p, 4 * GIB) == CUDA_ERROR_OUT_OF_MEMORY)
            ooms++;
    }
    printf("ooms=%d\n", ooms);
    return 0;
}

/* ---- one allocation of the given size in bytes (SIZE_MAX: "max") */
static int sc_alloc_bytes(const char *arg)
{
    init_ctx(0);
    size_t sz = !strcmp(arg, "max") ? SIZE_MAX : (size_t)strtoull(arg, NULL, 10);
    CUdeviceptr p = 0;
    SHOW("alloc", p_cuMemAlloc_v2(&p, sz));
    size_t fr = 0, tot = 0;
    CUresult rc = p_cuMemGetInfo_v2(&fr, &tot);
    printf("meminfo_rc=%d free=%zu total=%zu\n", rc, fr, tot);
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 3) {
        fprintf(stderr, "usage: %s direct|dlsym|procaddr scenario [args]\n", argv[0]);
        return 2;
    }
    load_api(argv[1]);
    const char *sc = argv[2];
    if (!strcmp(sc, "basic"))
        return sc_basic();
    if (!strcmp(sc, "vmm"))
        return sc_vmm();
    if (!strcmp(sc, "limits"))
        return sc_limits();
    if (!strcmp(sc, "kf20"))
        return sc_kf20();
    if (!strcmp(sc, "kf22"))
        return sc_kf22();
    if (!strcmp(sc, "kf23"))
        return sc_kf23();
    if (!strcmp(sc, "kf24"))
        return sc_kf24();
    if (!strcmp(sc, "paths"))
        return sc_paths();
    if (!strcmp(sc, "stress") && argc >= 6)
        return sc_stress(atoi(argv[3]), atoi(argv[4]), strtoull(argv[5], NULL, 10));
    if (!strcmp(sc, "hold_lock"))
        return sc_hold_lock();
    if (!strcmp(sc, "sm") && argc >= 6)
        return sc_sm(atof(argv[3]), (unsigned)atoi(argv[4]), atof(argv[5]), argc >= 7 && !strcmp(argv[6], "ex"));
    if (!strcmp(sc, "pool"))
        return sc_pool();
    if (!strcmp(sc, "pool_hold") && argc >= 5)
        return sc_pool_hold(strtoull(argv[3], NULL, 10), atof(argv[4]));
    if (!strcmp(sc, "shape") && argc >= 8)
        return sc_shape(atof(argv[3]), atof(argv[4]), (unsigned)atoi(argv[5]), (unsigned)atoi(argv[6]),
                        atof(argv[7]));
    if (!strcmp(sc, "graph") && argc >= 6)
        return sc_graph(atof(argv[3]), (unsigned)atoi(argv[4]), (unsigned)atoi(argv[5]));
    if (!strcmp(sc, "tiny"))
        return sc_tiny();
    if (!strcmp(sc, "hold_on") && argc >= 6)
        return sc_hold_on(atoi(argv[3]), strtoull(argv[4], NULL, 10), atof(argv[5]));
    if (!strcmp(sc, "hold") && argc >= 5)
        return sc_hold(strtoull(argv[3], NULL, 10), atof(argv[4]));
    if (!strcmp(sc, "steps"))
        return sc_steps();
    if (!strcmp(sc, "hold_then") && argc >= 4)
        return sc_hold_then(strtoull(argv[3], NULL, 10), argc - 4, argv + 4);
    if (!strcmp(sc, "oomloop") && argc >= 4)
        return sc_oomloop(atoi(argv[3]));
    if (!strcmp(sc, "alloc_bytes") && argc >= 4)
        return sc_alloc_bytes(argv[3]);
    fprintf(stderr, "unknown scenario %s\n", sc);
    return 2;
}
