/* Per-call cost of the driver entry points the shim hooks, measured against the fake libcuda.
 * Run once plain and once with the shim in LD_PRELOAD; benchmarks/shim_bench.py compares. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_abi.h"

CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void **, void **);

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

int main(int argc, char **argv)
{
    long n_launch = argc > 1 ? atol(argv[1]) : 2000000;
    long n_alloc = argc > 2 ? atol(argv[2]) : 200000;
    int reps = argc > 3 ? atoi(argv[3]) : 5;
    CUcontext c;
    CUmodule m;
    CUfunction f;
    if (cuInit(0) || cuDevicePrimaryCtxRetain(&c, 0) || cuCtxSetCurrent(c) || cuModuleLoadData(&m, "x") ||
        cuModuleGetFunction(&f, m, "k")) {
        fprintf(stderr, "init failed\n");
        return 1;
    }
    double best_launch = 1e30, best_alloc = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        for (long i = 0; i < n_launch; i++)
            cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        double per = (now() - t0) / (double)n_launch;
        if (per < best_launch)
            best_launch = per;
        t0 = now();
        for (long i = 0; i < n_alloc; i++) {
            CUdeviceptr p;
            if (cuMemAlloc_v2(&p, 1 << 20) == CUDA_SUCCESS)
                cuMemFree_v2(p);
        }
        per = (now() - t0) / (double)n_alloc;
        if (per < best_alloc)
            best_alloc = per;
    }
    printf("launch_ns=%.1f alloc_free_ns=%.1f\n", best_launch, best_alloc);
    return 0;
}
