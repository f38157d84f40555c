/* libvgpu check on a real GPU (driver API only; the kernel is PTX JIT-compiled by the driver, so
 * no nvcc is needed).  Modes:
 *   mem           - limit enforcement and the cuMemGetInfo view
 *   sm <seconds>  - launch a spin kernel as fast as allowed; print kernels per second */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_abi.h"

CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuDeviceGetAttribute(int *, int, CUdevice);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void **, void **);

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

#define CK(x)                                                   \
    do {                                                        \
        CUresult r_ = (x);                                      \
        if (r_) {                                               \
            printf("FAILED %s -> %d\n", #x, r_);                 \
            return 1;                                           \
        }                                                       \
    } while (0)

int main(int argc, char **argv)
{
    CUcontext c;
    CK(cuInit(0));
    CK(cuDevicePrimaryCtxRetain(&c, 0));
    CK(cuCtxSetCurrent(c));
    if (argc > 1 && !strcmp(argv[1], "mem")) {
        size_t fr, tot, dt;
        CK(cuMemGetInfo_v2(&fr, &tot));
        CK(cuDeviceTotalMem_v2(&dt, 0));
        printf("cuMemGetInfo free=%zu MiB total=%zu MiB; cuDeviceTotalMem=%zu MiB\n", fr >> 20, tot >> 20, dt >> 20);
        CUdeviceptr a, b;
        CUresult r1 = cuMemAlloc_v2(&a, tot / 2);
        CUresult r2 = cuMemAlloc_v2(&b, tot);
        CK(cuMemGetInfo_v2(&fr, &tot));
        printf("alloc half of total -> %d (expect 0); alloc total more -> %d (expect 2 OUT_OF_MEMORY)\n", r1, r2);
        printf("after: cuMemGetInfo free=%zu MiB total=%zu MiB\n", fr >> 20, tot >> 20);
        if (!r1)
            cuMemFree_v2(a);
        return 0;
    }
    double secs = argc > 2 ? atof(argv[2]) : 3.0;
    int sms = 0;
    CK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0));
    CUmodule m;
    CUfunction f;
    CK(cuModuleLoadData(&m, PTX));
    CK(cuModuleGetFunction(&f, m, "spin"));
    unsigned long long cycles = 200000; /* ~100 us per kernel at ~2 GHz */
    void *params[] = {&cycles};
    double t0 = now();
    long n = 0;
    while (now() - t0 < secs) {
        CK(cuLaunchKernel(f, (unsigned)sms * 2, 1, 1, 128, 1, 1, 0, NULL, params, NULL));
        if (++n % 64 == 0)
            CK(cuCtxSynchronize());
    }
    CK(cuCtxSynchronize());
    printf("kernels_per_s=%.1f\n", (double)n / (now() - t0));
    return 0;
}
