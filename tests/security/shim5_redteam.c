/*
 * Red-team driver for VMM references the shim must follow (tests/security/test_redteam_shim5.py).
 * Linked against the fake libcuda, run with the shim preloaded. One scenario per run, on device 0 in a
 * context of its own (LIBVGPU_CONTEXT_COST=0 in the tests); each step prints "name=rc:charged:peak" (the
 * driver's result, what the shim charges on GPU 0, and the most device memory this process has held at
 * once so far, as the fake driver counts it, its context included), bytes.
 *
 *   shim5_redteam retain BYTES   cuMemCreate, map, cuMemRelease (the samples' order), then
 *                                cuMemRetainAllocationHandle on the mapping and cuMemUnmap: the retained
 *                                reference keeps the memory; map it again, and cuMemCreate BYTES more.
 *                                Then the program gives everything back in order.
 *   shim5_redteam export BYTES   cuMemCreate, cuMemExportToShareableHandle (a file descriptor), cuMemRelease:
 *                                the descriptor keeps the memory; import it, map it, and cuMemCreate BYTES
 *                                more.
 *   shim5_redteam export_fail    an export the driver refuses (an unsupported handle type) of a handle
 *                                released meanwhile in the same order: its memory goes and is uncharged.
 *   shim5_redteam pools N MODE BYTES   N memory pools, 2 MiB allocated from each and freed (MODE keep: the
 *                                pools stay; destroy: each is destroyed after), then one more pool whose
 *                                release threshold keeps everything: BYTES from it, freed (the pool keeps
 *                                it), and cuMemAlloc of BYTES.
 *   shim5_redteam lookup WAY      cuCtxCreate_v2 and cuMemAlloc_v2 of 2 GiB (under a 1 GiB limit) through
 *                                entry points found another way (deepbind: dlopen RTLD_DEEPBIND + dlsym,
 *                                next: dlsym(RTLD_NEXT), mopen: dlmopen into a new namespace + dlsym,
 *                                procaddr: cuGetProcAddress_v2 at version 3020 with the per-thread-stream
 *                                flag); prints "alloc=RC" and "hooked=1" when the allocation entry point
 *                                is the shim's (dladdr names libvgpu).
 *   shim5_redteam launch API N BLOCKS   N kernels of BLOCKS blocks back to back through one launch API
 *                                (grid: cuLaunchGrid, gridasync: cuLaunchGridAsync on a stream, launch:
 *                                cuLaunch, multi: cuLaunchCooperativeKernelMultiDevice on one device,
 *                                kernel: cuLaunchKernel), then a synchronisation; prints "rc=R" and
 *                                "busy=F", the simulated device time over the wall time (1: never throttled).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "redteam.h"

CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *, void *);
CUresult cuMemExportToShareableHandle(void *, CUmemGenericAllocationHandle, int, unsigned long long);
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *, void *, int);
unsigned long long fake_cuda_debug_peak_bytes(int dev);
CUresult cuMemPoolCreate(CUmemoryPool *, const CUmemPoolProps *);
CUresult cuMemPoolDestroy(CUmemoryPool);
CUresult cuMemPoolSetAttribute(CUmemoryPool, int, void *);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamSynchronize(CUstream);
CUresult cuCtxSynchronize(void);
CUresult cuFuncSetBlockShape(CUfunction, int, int, int);
CUresult cuLaunch(CUfunction);
CUresult cuLaunchGrid(CUfunction, int, int);
CUresult cuLaunchGridAsync(CUfunction, int, int, CUstream);
CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *, unsigned int, unsigned int);
CUresult cuLaunchKernel(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                        unsigned int, unsigned int, CUstream, void **, void **);

#define MIB (1024ull * 1024ull)

static unsigned long long charged(void)
{
    int (*get)(int, uint64_t *, uint64_t *) = (int (*)(int, uint64_t *, uint64_t *))dlsym(RTLD_DEFAULT,
                                                                                          "vgpu_get_usage");
    uint64_t used = 0;
    if (!get || get(0, &used, NULL) != 0)
        return (unsigned long long)-1;
    return (unsigned long long)used;
}

/* The most this process held on device 0 at once so far, as the fake driver counts it. */
static unsigned long long held(void)
{
    return fake_cuda_debug_peak_bytes(0);
}

static void show(const char *name, CUresult rc)
{
    printf("%s=%d:%llu:%llu\n", name, rc, charged(), held());
}

static CUmemAllocationProp prop_dev0(void)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = 1;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    return p;
}

static int sc_retain(size_t bytes)
{
    CUmemAllocationProp p = prop_dev0();
    CUmemGenericAllocationHandle h = 0, h2 = 0, h3 = 0;
    CUdeviceptr va = 0;
    cuMemAddressReserve(&va, bytes, 0, 0, 0);
    show("create", cuMemCreate(&h, bytes, &p, 0));
    show("map", cuMemMap(va, bytes, 0, h, 0));
    show("release", cuMemRelease(h));
    CUresult rc = cuMemRetainAllocationHandle(&h2, (void *)(uintptr_t)va);
    printf("same_handle=%d\n", rc == CUDA_SUCCESS && h2 == h);
    show("retain", rc);
    show("unmap", cuMemUnmap(va, bytes));
    show("remap", cuMemMap(va, bytes, 0, h2, 0));
    CUresult more = cuMemCreate(&h3, bytes, &p, 0);
    show("more", more);
    if (more == CUDA_SUCCESS)
        cuMemRelease(h3);
    show("release_retained", cuMemRelease(h2)); /* still mapped */
    show("unmap_last", cuMemUnmap(va, bytes));
    cuMemAddressFree(va, bytes);
    return 0;
}

static int sc_export(size_t bytes)
{
    CUmemAllocationProp p = prop_dev0();
    CUmemGenericAllocationHandle h = 0, h2 = 0, h3 = 0;
    CUdeviceptr va = 0;
    int fd = -1;
    cuMemAddressReserve(&va, bytes, 0, 0, 0);
    show("create", cuMemCreate(&h, bytes, &p, 0));
    show("export", cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    show("release", cuMemRelease(h));
    show("import", cuMemImportFromShareableHandle(&h2, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    show("map", cuMemMap(va, bytes, 0, h2, 0));
    CUresult more = cuMemCreate(&h3, bytes, &p, 0);
    show("more", more);
    if (more == CUDA_SUCCESS)
        cuMemRelease(h3);
    cuMemUnmap(va, bytes);
    cuMemRelease(h2);
    close(fd);
    cuMemAddressFree(va, bytes);
    return 0;
}

static int sc_export_fail(void)
{
    CUmemAllocationProp p = prop_dev0();
    CUmemGenericAllocationHandle h = 0;
    int fd = -1;
    show("create", cuMemCreate(&h, 64 * MIB, &p, 0));
    show("export_bad_type", cuMemExportToShareableHandle(&fd, h, 0x40 /* not supported */, 0));
    show("release", cuMemRelease(h));
    return 0;
}

static int sc_pools(unsigned n, int destroy, size_t bytes)
{
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = 1;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    CUstream s;
    if (cuStreamCreate(&s, 0))
        return 1;
    unsigned made = 0;
    for (unsigned i = 0; i < n; i++) {
        CUmemoryPool pool;
        CUdeviceptr d;
        if (cuMemPoolCreate(&pool, &props) || cuMemAllocFromPoolAsync(&d, 2 * MIB, pool, s) || cuMemFreeAsync(d, s))
            break;
        if (destroy && cuMemPoolDestroy(pool))
            break;
        made++;
    }
    printf("pools=%u\n", made);
    CUmemoryPool last;
    CUdeviceptr d = 0, more = 0;
    unsigned long long keep = ~0ull;
    show("last_pool", cuMemPoolCreate(&last, &props));
    show("threshold", cuMemPoolSetAttribute(last, 4 /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */, &keep));
    CUresult rc = cuMemAllocFromPoolAsync(&d, bytes, last, s);
    show("pool_alloc", rc);
    if (rc == CUDA_SUCCESS)
        show("pool_free", cuMemFreeAsync(d, s)); /* the pool keeps it reserved: no synchronisation */
    show("more", cuMemAlloc_v2(&more, bytes));
    return 0;
}

typedef CUresult (*ctx_fn)(CUcontext *, unsigned int, CUdevice);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*gpa_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

static int sc_lookup(const char *way)
{
    void *h = NULL, *mk = NULL, *al = NULL;
    if (!strcmp(way, "deepbind"))
        h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    else if (!strcmp(way, "mopen"))
        h = dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW);
    if (h) {
        mk = dlsym(h, "cuCtxCreate_v2");
        al = dlsym(h, "cuMemAlloc_v2");
    } else if (!strcmp(way, "next")) {
        mk = dlsym(RTLD_NEXT, "cuCtxCreate_v2");
        al = dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    } else if (!strcmp(way, "procaddr")) {
        gpa_fn gpa = (gpa_fn)dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2");
        if (gpa) {
            gpa("cuCtxCreate", &mk, 3020, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, NULL);
            gpa("cuMemAlloc", &al, 3020, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, NULL);
        }
    }
    if (!mk || !al) {
        printf("alloc=-1\n");
        return 1;
    }
    Dl_info di;
    printf("hooked=%d\n", dladdr(al, &di) && di.dli_fname && strstr(di.dli_fname, "libvgpu") != NULL);
    CUcontext ctx = NULL;
    CUdeviceptr d = 0;
    CUresult rc = ((ctx_fn)mk)(&ctx, 0, 0);
    if (rc == CUDA_SUCCESS)
        rc = ((alloc_fn)al)(&d, 2ull << 30);
    printf("alloc=%d\n", rc);
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double env_ns(const char *name, double dflt)
{
    const char *v = getenv(name);
    return v && *v ? atof(v) : dflt;
}

static int sc_launch(const char *api, unsigned n, unsigned blocks)
{
    CUmodule mod;
    CUfunction f;
    CUstream s;
    if (cuModuleLoadData(&mod, "fake") || cuModuleGetFunction(&f, mod, "busy") || cuStreamCreate(&s, 0) ||
        cuFuncSetBlockShape(f, 1, 1, 1)) {
        printf("rc=-1\n");
        return 1;
    }
    int one = !strcmp(api, "launch"); /* cuLaunch runs a single block */
    CUDA_LAUNCH_PARAMS lp;
    memset(&lp, 0, sizeof lp);
    lp.function = f;
    lp.gridDimX = blocks;
    lp.gridDimY = lp.gridDimZ = lp.blockDimX = lp.blockDimY = lp.blockDimZ = 1;
    lp.hStream = s;
    CUresult rc = CUDA_SUCCESS;
    double t0 = now_s();
    for (unsigned i = 0; i < n && rc == CUDA_SUCCESS; i++) {
        if (!strcmp(api, "grid"))
            rc = cuLaunchGrid(f, (int)blocks, 1);
        else if (!strcmp(api, "gridasync"))
            rc = cuLaunchGridAsync(f, (int)blocks, 1, s);
        else if (one)
            rc = cuLaunch(f);
        else if (!strcmp(api, "multi"))
            rc = cuLaunchCooperativeKernelMultiDevice(&lp, 1, 0);
        else
            rc = cuLaunchKernel(f, blocks, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
    }
    cuStreamSynchronize(s);
    cuCtxSynchronize();
    double wall = now_s() - t0;
    double per = env_ns("FAKE_CUDA_NS_PER_LAUNCH", 0) + (one ? 1.0 : (double)blocks) * env_ns("FAKE_CUDA_NS_PER_BLOCK", 1000);
    printf("rc=%d\nbusy=%.3f\n", rc, (double)n * per / 1e9 / wall);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2 || rt_start() != 0)
        return 2;
    if (!strcmp(argv[1], "lookup") && argc >= 3)
        return sc_lookup(argv[2]);
    CUcontext ctx = NULL;
    if (cuCtxCreate_v2(&ctx, 0, 0) != CUDA_SUCCESS) {
        printf("fail ctx\n");
        return 2;
    }
    if (!strcmp(argv[1], "retain") && argc >= 3)
        return sc_retain(strtoull(argv[2], NULL, 10));
    if (!strcmp(argv[1], "export") && argc >= 3)
        return sc_export(strtoull(argv[2], NULL, 10));
    if (!strcmp(argv[1], "export_fail"))
        return sc_export_fail();
    if (!strcmp(argv[1], "pools") && argc >= 5)
        return sc_pools((unsigned)atoi(argv[2]), !strcmp(argv[3], "destroy"), strtoull(argv[4], NULL, 10));
    if (!strcmp(argv[1], "launch") && argc >= 5)
        return sc_launch(argv[2], (unsigned)atoi(argv[3]), (unsigned)atoi(argv[4]));
    printf("unknown scenario\n");
    return 2;
}
