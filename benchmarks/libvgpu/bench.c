/* Per-call cost of the driver entry points the shim hooks, measured against the fake libcuda.
 * Run once plain and once with the shim in LD_PRELOAD; the Python benchmarks compare:
 *
 *   bench calls LAUNCHES ALLOCS REPS  ns per cuLaunchKernel and per cuMemAlloc_v2+cuMemFree_v2 pair
 *                                     (benchmarks/shim_bench.py); prints launch_ns=... alloc_free_ns=...
 *   bench launch LAUNCHES REPS WARMUP ns per cuLaunchKernel the fake refuses at once (a NULL function),
 *                                     after WARMUP seconds of real launches: the shim's own launch path
 *                                     (benchmarks/shim_launch_bench.py); prints launch_ns=...
 *
 * Each figure is the best of REPS timed loops. Exit status 2 for bad arguments, 1 when the fake
 * driver cannot be set up. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

static double min_of(double a, double b)
{
    return a < b ? a : b;
}

/* ns per launch of a loop of n launches of f (1 block of 1 thread) */
static double launch_ns(CUfunction f, long n)
{
    double t0 = now();
    for (long i = 0; i < n; i++)
        cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    return (now() - t0) / (double)n;
}

/* ns per pair of a loop of n cuMemAlloc_v2 (1 MiB) + cuMemFree_v2 pairs */
static double alloc_free_ns(long n)
{
    double t0 = now();
    for (long i = 0; i < n; i++) {
        CUdeviceptr p;
        if (cuMemAlloc_v2(&p, 1 << 20) == CUDA_SUCCESS)
            cuMemFree_v2(p);
    }
    return (now() - t0) / (double)n;
}

int main(int argc, char **argv)
{
    int calls = argc == 5 && strcmp(argv[1], "calls") == 0;
    int launch = argc == 5 && strcmp(argv[1], "launch") == 0;
    if (!calls && !launch) {
        fprintf(stderr, "usage: bench calls LAUNCHES ALLOCS REPS | bench launch LAUNCHES REPS WARMUP_SECONDS\n");
        return 2;
    }
    long n_launch = atol(argv[2]);
    CUcontext c;
    CUmodule m;
    CUfunction f;
    if (cuInit(0) || cuDevicePrimaryCtxRetain(&c, 0) || cuCtxSetCurrent(c) || cuModuleLoadData(&m, "x") ||
        cuModuleGetFunction(&f, m, "k")) {
        fprintf(stderr, "init failed\n");
        return 1;
    }
    if (calls) {
        long n_alloc = atol(argv[3]);
        int reps = atoi(argv[4]);
        double best_launch = 1e30, best_alloc = 1e30;
        for (int r = 0; r < reps; r++) {
            best_launch = min_of(best_launch, launch_ns(f, n_launch));
            best_alloc = min_of(best_alloc, alloc_free_ns(n_alloc));
        }
        printf("launch_ns=%.1f alloc_free_ns=%.1f\n", best_launch, best_alloc);
        return 0;
    }
    int reps = atoi(argv[3]);
    double warm = atof(argv[4]) * 1e9;
    for (double t0 = now(); now() - t0 < warm;)
        launch_ns(f, 10000);
    double best = 1e30;
    for (int r = 0; r < reps; r++)
        best = min_of(best, launch_ns(NULL, n_launch)); /* refused by the fake at once: the shim's path dominates */
    printf("launch_ns=%.2f\n", best);
    return 0;
}
