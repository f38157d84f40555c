/* The probe program of benchmarks/gpu/gpu_check.py: driver API and NVML only, both reached through
 * dlopen("libcuda.so.1") / dlopen("libnvidia-ml.so.1") + dlsym (no link-time -lcuda), as the CUDA
 * runtime and PyTorch reach them. The kernel is PTX JIT-compiled by the driver, so no nvcc is needed.
 * Every mode prints key=value tokens; gpu_check.py decides pass or miss.
 *   procaddr          - for every name libvgpu hooks: what cuGetProcAddress hands out, per version and flag
 *   mem <limit MiB>   - cuMemGetInfo view, then an allocation of half the limit and one of all of it
 *   vmm <limit MiB>   - cuMemCreate + cuMemMap of 60% of the limit, cuMemRelease while mapped, then 60% more
 *                       before and after cuMemUnmap
 *   nvml              - nvmlDeviceGetMemoryInfo of NVML device 0
 *   hold <MiB>        - allocate, print held=<rc>, then wait to be killed
 *   alloc <MiB>       - allocate and print alloc=<rc>
 *   spin <warm_s> <s> - launch a spin kernel (about 100 us) back to back; print kernels per second after warm-up */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "nvml_abi.h"

#define MIB (1024ULL * 1024ULL)

static void *g_cuda;

static void *sym(const char *name)
{
    void *p = dlsym(g_cuda, name);
    if (!p) {
        printf("missing_symbol=%s\n", name);
        exit(3);
    }
    return p;
}

#define FN(name, ret, params) static ret(*p_##name) params
FN(cuInit, CUresult, (unsigned));
FN(cuDriverGetVersion, CUresult, (int *));
FN(cuDevicePrimaryCtxRetain, CUresult, (CUcontext *, CUdevice));
FN(cuCtxSetCurrent, CUresult, (CUcontext));
FN(cuCtxSynchronize, CUresult, (void));
FN(cuMemAlloc_v2, CUresult, (CUdeviceptr *, size_t));
FN(cuMemFree_v2, CUresult, (CUdeviceptr));
FN(cuMemGetInfo_v2, CUresult, (size_t *, size_t *));
FN(cuDeviceTotalMem_v2, CUresult, (size_t *, CUdevice));
FN(cuDeviceGetAttribute, CUresult, (int *, int, CUdevice));
FN(cuModuleLoadData, CUresult, (CUmodule *, const void *));
FN(cuModuleGetFunction, CUresult, (CUfunction *, CUmodule, const char *));
FN(cuLaunchKernel, CUresult,
   (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **));
FN(cuGetProcAddress, CUresult, (const char *, void **, int, cuuint64_t));
FN(cuMemCreate, CUresult, (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long));
FN(cuMemRelease, CUresult, (CUmemGenericAllocationHandle));
FN(cuMemAddressReserve, CUresult, (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long));
FN(cuMemAddressFree, CUresult, (CUdeviceptr, size_t));
FN(cuMemMap, CUresult, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long));
FN(cuMemUnmap, CUresult, (CUdeviceptr, size_t));
FN(cuMemGetAllocationGranularity, CUresult, (size_t *, const CUmemAllocationProp *, int));

#define LOAD(name) p_##name = (__typeof__(p_##name))sym(#name)

#define CK(x)                                                   \
    do {                                                        \
        CUresult r_ = (x);                                      \
        if (r_) {                                               \
            printf("failed=%s rc=%d\n", #x, r_);                 \
            return 2;                                           \
        }                                                       \
    } while (0)

/* names libvgpu hooks, from its own list */
static const char *const HOOKED[] = {
#define HOOK(name, ret, params, args) #name,
#define REAL(name, ret, params)
#include "hooks_list.h"
#undef HOOK
#undef REAL
};
#define NHOOKED (sizeof HOOKED / sizeof HOOKED[0])

static const char *PTX = ".version 7.0\n.target sm_70\n.address_size 64\n"
                         ".visible .entry spin(.param .u64 cycles)\n{\n"
                         " .reg .pred p;\n .reg .u64 t0, t1, d, c;\n"
                         " ld.param.u64 c, [cycles];\n mov.u64 t0, %clock64;\n"
                         "LOOP:\n mov.u64 t1, %clock64;\n sub.u64 d, t1, t0;\n"
                         " setp.lt.u64 p, d, c;\n @p bra LOOP;\n ret;\n}\n";

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int ctx_up(void)
{
    CUcontext c;
    CK(p_cuInit(0));
    CK(p_cuDevicePrimaryCtxRetain(&c, 0));
    CK(p_cuCtxSetCurrent(c));
    return 0;
}

/* The request name for a hooked name: without _ptsz, then without a _v<N> suffix. */
static void base_name(const char *name, char *out, size_t n, int *ptsz)
{
    snprintf(out, n, "%s", name);
    size_t l = strlen(out);
    *ptsz = l > 5 && !strcmp(out + l - 5, "_ptsz");
    if (*ptsz)
        out[l -= 5] = 0;
    char *v = strrchr(out, '_');
    if (v && v[1] == 'v' && v[2] >= '0' && v[2] <= '9' && strspn(v + 2, "0123456789") == strlen(v + 2))
        *v = 0;
}

/* One line per (requested name, flags, answer) at the lowest CUDA version giving that answer:
 * (versions up to the driver's or 13.9, whichever is higher: the driver picks the highest entry <= the request)
 *   P req=<name> ver=<v> flags=<f> sym=<dladdr name of the address> lib=<file> exported=<1 if it is
 *   dlsym(libcuda, sym)> ; and one line per hooked name: H name=<n> exported=<dlsym(libcuda, n) != NULL>. */
static int mode_procaddr(void)
{
    int drv = 0;
    CK(p_cuInit(0));
    CK(p_cuDriverGetVersion(&drv));
    printf("driver_version=%d hooked=%zu\n", drv, NHOOKED);
    for (size_t i = 0; i < NHOOKED; i++)
        printf("H name=%s exported=%d\n", HOOKED[i], dlsym(g_cuda, HOOKED[i]) != NULL);
    for (size_t i = 0; i < NHOOKED; i++) {
        char base[128];
        int ptsz;
        base_name(HOOKED[i], base, sizeof base, &ptsz);
        const char *reqs[2] = {base, HOOKED[i]};
        for (int r = 0; r < 2; r++) {
            if (r == 1 && !strcmp(reqs[0], reqs[1]))
                break;
            for (cuuint64_t flags = 0; flags <= 2; flags += 2) {
                void *last = NULL;
                for (int ver = 2000; ver <= (drv > 13090 ? drv : 13090); ver += 10) {
                    void *p = NULL;
                    if (p_cuGetProcAddress(reqs[r], &p, ver, flags) || !p || p == last)
                        continue;
                    last = p;
                    Dl_info di;
                    const char *sname = "?", *lib = "?";
                    if (dladdr(p, &di)) {
                        sname = di.dli_sname ? di.dli_sname : "?";
                        lib = di.dli_fname ? di.dli_fname : "?";
                        const char *slash = strrchr(lib, '/');
                        lib = slash ? slash + 1 : lib;
                    }
                    int exported = strcmp(sname, "?") && dlsym(g_cuda, sname) == p;
                    printf("P req=%s ver=%d flags=%llu sym=%s lib=%s exported=%d\n", reqs[r], ver, flags, sname, lib,
                           exported);
                }
            }
        }
    }
    return 0;
}

static int mode_mem(size_t limit)
{
    size_t fr, tot, dt;
    if (ctx_up())
        return 2;
    CK(p_cuMemGetInfo_v2(&fr, &tot));
    CK(p_cuDeviceTotalMem_v2(&dt, 0));
    printf("total=%zu free=%zu devtotal=%zu\n", tot, fr, dt);
    CUdeviceptr a, b;
    CUresult r1 = p_cuMemAlloc_v2(&a, limit / 2);
    CUresult r2 = p_cuMemAlloc_v2(&b, limit);
    size_t fr2, tot2;
    CK(p_cuMemGetInfo_v2(&fr2, &tot2));
    printf("half=%d all_more=%d free_after=%zu\n", r1, r2, fr2);
    if (!r1)
        p_cuMemFree_v2(a);
    if (!r2)
        p_cuMemFree_v2(b);
    return 0;
}

static int mode_vmm(size_t limit)
{
    size_t gran = 0;
    if (ctx_up())
        return 2;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CK(p_cuMemGetAllocationGranularity(&gran, &prop, 0));
    size_t part = (limit * 6 / 10) / gran * gran; /* 60% of the limit: two of them do not fit */
    CUdeviceptr va;
    CUmemGenericAllocationHandle h, h2;
    CK(p_cuMemAddressReserve(&va, part, 0, 0, 0));
    CUresult create = p_cuMemCreate(&h, part, &prop, 0);
    CUresult map = create ? create : p_cuMemMap(va, part, 0, h, 0);
    CUresult release = create ? create : p_cuMemRelease(h); /* the CUDA samples' order: release while mapped */
    CUresult while_mapped = p_cuMemCreate(&h2, part, &prop, 0);
    if (!while_mapped)
        p_cuMemRelease(h2);
    CUresult unmap = map ? map : p_cuMemUnmap(va, part);
    CUresult after_unmap = p_cuMemCreate(&h2, part, &prop, 0);
    if (!after_unmap)
        p_cuMemRelease(h2);
    p_cuMemAddressFree(va, part);
    printf("part=%zu create=%d map=%d release=%d while_mapped=%d unmap=%d after_unmap=%d\n", part, create, map,
           release, while_mapped, unmap, after_unmap);
    return 0;
}

static int mode_nvml(void)
{
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h) {
        printf("nvml=unavailable\n");
        return 2;
    }
    nvmlReturn_t (*init)(void) = (nvmlReturn_t (*)(void))dlsym(h, "nvmlInit_v2");
    nvmlReturn_t (*get)(unsigned, nvmlDevice_t *) =
        (nvmlReturn_t (*)(unsigned, nvmlDevice_t *))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    nvmlReturn_t (*mem)(nvmlDevice_t, nvmlMemory_t *) =
        (nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t *))dlsym(h, "nvmlDeviceGetMemoryInfo");
    if (!init || !get || !mem) {
        printf("nvml=symbols_missing\n");
        return 2;
    }
    nvmlDevice_t d;
    nvmlMemory_t m;
    if (init() || get(0, &d) || mem(d, &m)) {
        printf("nvml=query_failed\n");
        return 2;
    }
    printf("nvml_total=%llu nvml_used=%llu nvml_free=%llu\n", (unsigned long long)m.total,
           (unsigned long long)m.used, (unsigned long long)m.free);
    return 0;
}

static int mode_hold(unsigned long long mib, int wait)
{
    if (ctx_up())
        return 2;
    CUdeviceptr p;
    CUresult r = p_cuMemAlloc_v2(&p, mib * MIB);
    printf("%s=%d\n", wait ? "held" : "alloc", r);
    fflush(stdout);
    if (wait)
        for (;;)
            pause();
    return 0;
}

static int mode_spin(double warm, double secs)
{
    int sms = 0;
    if (ctx_up())
        return 2;
    CK(p_cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0));
    CUmodule m;
    CUfunction f;
    CK(p_cuModuleLoadData(&m, PTX));
    CK(p_cuModuleGetFunction(&f, m, "spin"));
    unsigned long long cycles = 200000; /* about 100 us at 2 GHz */
    void *params[] = {&cycles};
    double t0 = now(), tm = 0;
    long n = 0, counted = 0;
    for (;;) {
        CK(p_cuLaunchKernel(f, (unsigned)sms * 2, 1, 1, 128, 1, 1, 0, NULL, params, NULL));
        if (++n % 16 == 0) {
            CK(p_cuCtxSynchronize());
            double t = now();
            if (!tm && t - t0 >= warm) {
                tm = t;
                counted = n;
            }
            if (tm && t - tm >= secs)
                break;
        }
    }
    printf("kernels_per_s=%.3f\n", (double)(n - counted) / (now() - tm));
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) {
        fprintf(stderr, "usage: %s procaddr|mem MIB|vmm MIB|nvml|hold MIB|alloc MIB|spin WARM_S SECONDS\n", argv[0]);
        return 64;
    }
    if (!strcmp(argv[1], "nvml"))
        return mode_nvml();
    g_cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!g_cuda) {
        printf("libcuda=unavailable (%s)\n", dlerror());
        return 3;
    }
    LOAD(cuInit);
    LOAD(cuDriverGetVersion);
    LOAD(cuDevicePrimaryCtxRetain);
    LOAD(cuCtxSetCurrent);
    LOAD(cuCtxSynchronize);
    LOAD(cuMemAlloc_v2);
    LOAD(cuMemFree_v2);
    LOAD(cuMemGetInfo_v2);
    LOAD(cuDeviceTotalMem_v2);
    LOAD(cuDeviceGetAttribute);
    LOAD(cuModuleLoadData);
    LOAD(cuModuleGetFunction);
    LOAD(cuLaunchKernel);
    LOAD(cuGetProcAddress);
    LOAD(cuMemCreate);
    LOAD(cuMemRelease);
    LOAD(cuMemAddressReserve);
    LOAD(cuMemAddressFree);
    LOAD(cuMemMap);
    LOAD(cuMemUnmap);
    LOAD(cuMemGetAllocationGranularity);
    if (!strcmp(argv[1], "procaddr"))
        return mode_procaddr();
    if (!strcmp(argv[1], "mem") && argc > 2)
        return mode_mem((size_t)strtoull(argv[2], NULL, 10) * MIB);
    if (!strcmp(argv[1], "vmm") && argc > 2)
        return mode_vmm((size_t)strtoull(argv[2], NULL, 10) * MIB);
    if (!strcmp(argv[1], "hold") && argc > 2)
        return mode_hold(strtoull(argv[2], NULL, 10), 1);
    if (!strcmp(argv[1], "alloc") && argc > 2)
        return mode_hold(strtoull(argv[2], NULL, 10), 0);
    if (!strcmp(argv[1], "spin") && argc > 3)
        return mode_spin(atof(argv[2]), atof(argv[3]));
    fprintf(stderr, "unknown mode %s\n", argv[1]);
    return 64;
}
