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
 *   spin <warm_s> <s> - launch a spin kernel (about 100 us) back to back; print kernels per second after warm-up
 *   graphmem <MiB>    - graph memory nodes (the driver's figures, cuDeviceGetGraphMemAttribute): a graph allocating
 *                       MiB launched, the allocation freed with cuMemFreeAsync, cuDeviceGraphMemTrim; then a graph
 *                       allocating and freeing MiB in itself (a free node), launched, trimmed
 *   graphlimit <limit MiB> - (under the shim) a graph allocating and freeing half the limit launched, then one
 *                       allocating the whole limit
 *   vmmctx <MiB>      - with the primary context kept, a context created, MiB of cuMemCreate in it (half mapped,
 *                       half not, neither released), the context destroyed, then both unmapped and released from
 *                       the primary context: NVML used memory before, while held, after each
 *   retain <MiB>      - cuMemCreate MiB mapped, cuMemRetainAllocationHandle, unmapped, released twice: NVML used
 *                       memory after each step
 *   modmem <MiB>      - a module (PTX) with a MiB `.global` array (a __device__ array) loaded and unloaded: NVML's
 *                       used memory of this process (and of the GPU) before, loaded, unloaded
 *   modlimit <limit MiB> - (under the shim) modules with a `.global` array of half the limit, then of 1.5x the
 *                       limit: each load's result, what cuMemGetInfo shows used, NVML's figure for this process
 *   stack <bytes>     - a kernel (PTX) with a local array of `bytes` per thread launched once: its
 *                       CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, the context's stack size (cuCtxGetLimit) and NVML's
 *                       used memory of this process before and after
 *   stacklimit <limit MiB> - (under the shim) the same with a frame taking a quarter of the limit over every
 *                       resident thread, then one taking 1.5x the limit: each launch's result, what cuMemGetInfo
 *                       shows used, NVML's figure for this process */
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
/* the graph memory, VMM-context and retained-handle modes (loaded by those modes only) */
FN(cuCtxCreate_v2, CUresult, (CUcontext *, unsigned, CUdevice));
FN(cuCtxDestroy_v2, CUresult, (CUcontext));
FN(cuStreamCreate, CUresult, (CUstream *, unsigned));
FN(cuStreamSynchronize, CUresult, (CUstream));
FN(cuMemFreeAsync, CUresult, (CUdeviceptr, CUstream));
FN(cuMemRetainAllocationHandle, CUresult, (CUmemGenericAllocationHandle *, void *));
FN(cuGraphCreate, CUresult, (CUgraph *, unsigned));
FN(cuGraphDestroy, CUresult, (CUgraph));
FN(cuGraphAddMemAllocNode, CUresult, (CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *));
FN(cuGraphAddMemFreeNode, CUresult, (CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUdeviceptr));
FN(cuGraphInstantiateWithFlags, CUresult, (CUgraphExec *, CUgraph, unsigned long long));
FN(cuGraphLaunch, CUresult, (CUgraphExec, CUstream));
FN(cuGraphExecDestroy, CUresult, (CUgraphExec));
FN(cuDeviceGetGraphMemAttribute, CUresult, (CUdevice, int, void *));
FN(cuDeviceGraphMemTrim, CUresult, (CUdevice));

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

/* ---- graph memory nodes, VMM memory of a destroyed context, retained handles */
#define NVML_NA (~0ULL) /* NVML cannot tell */
static nvmlDevice_t g_nvd;
static nvmlReturn_t (*g_nvml_mem)(nvmlDevice_t, nvmlMemory_t *);

/* NVML's used memory of device 0 in bytes (the whole GPU, every process), or ~0 when NVML cannot tell. */
static unsigned long long nvml_used(void)
{
    if (!g_nvml_mem) {
        void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        nvmlReturn_t (*init)(void) = h ? (nvmlReturn_t (*)(void))dlsym(h, "nvmlInit_v2") : NULL;
        nvmlReturn_t (*get)(unsigned, nvmlDevice_t *) =
            h ? (nvmlReturn_t (*)(unsigned, nvmlDevice_t *))dlsym(h, "nvmlDeviceGetHandleByIndex_v2") : NULL;
        if (!init || !get || init() || get(0, &g_nvd))
            return NVML_NA;
        g_nvml_mem = (nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t *))dlsym(h, "nvmlDeviceGetMemoryInfo");
        if (!g_nvml_mem)
            return NVML_NA;
    }
    nvmlMemory_t m;
    return g_nvml_mem(g_nvd, &m) ? NVML_NA : (unsigned long long)m.used;
}

/* cuMemGetInfo's used memory (total - free) in the current context, or ~0. */
static unsigned long long cu_used(void)
{
    size_t fr = 0, tot = 0;
    return p_cuMemGetInfo_v2(&fr, &tot) ? ~0ULL : (unsigned long long)(tot - fr);
}

/* The graph pool of device 0 as the driver reports it: prints "<tag>_used=" and "<tag>_reserved=" (bytes, or
 * -1 when the attribute cannot be read) and NVML's device used memory as "<tag>_nvml=". */
static void graph_attrs(const char *tag)
{
    cuuint64_t u = 0, r = 0;
    long long used = p_cuDeviceGetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &u) ? -1 : (long long)u;
    long long res =
        p_cuDeviceGetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &r) ? -1 : (long long)r;
    printf("%s_used=%lld %s_reserved=%lld %s_nvml=%lld\n", tag, used, tag, res, tag, (long long)nvml_used());
}

/* A graph with one allocation node of `bytes` on device 0 (and, with `free_node`, a free node of it ordered after
 * it), instantiated; 0, or the failing call's result. */
static CUresult graph_alloc(size_t bytes, int free_node, CUgraph *g, CUgraphExec *e, CUdeviceptr *dptr)
{
    CUDA_MEM_ALLOC_NODE_PARAMS np;
    memset(&np, 0, sizeof np);
    np.poolProps.allocType = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    np.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    np.poolProps.location.id = 0;
    np.bytesize = bytes;
    CUgraphNode an, fn;
    CUresult rc = p_cuGraphCreate(g, 0);
    if (rc)
        return rc;
    rc = p_cuGraphAddMemAllocNode(&an, *g, NULL, 0, &np);
    if (!rc && free_node)
        rc = p_cuGraphAddMemFreeNode(&fn, *g, &an, 1, np.dptr); /* the free is ordered after the allocation */
    if (!rc)
        rc = p_cuGraphInstantiateWithFlags(e, *g, 0);
    *dptr = np.dptr;
    return rc;
}

static void load_graph_syms(void)
{
    LOAD(cuStreamCreate);
    LOAD(cuStreamSynchronize);
    LOAD(cuMemFreeAsync);
    LOAD(cuGraphCreate);
    LOAD(cuGraphDestroy);
    LOAD(cuGraphAddMemAllocNode);
    LOAD(cuGraphAddMemFreeNode);
    LOAD(cuGraphInstantiateWithFlags);
    LOAD(cuGraphLaunch);
    LOAD(cuGraphExecDestroy);
    LOAD(cuDeviceGetGraphMemAttribute);
    LOAD(cuDeviceGraphMemTrim);
}

/* The driver's graph pool around launches, frees and trims (no shim): see the header. */
static int mode_graphmem(size_t bytes)
{
    load_graph_syms();
    if (ctx_up())
        return 2;
    CUstream s;
    CK(p_cuStreamCreate(&s, 0));
    CK(p_cuDeviceGraphMemTrim(0));
    graph_attrs("base");
    /* an allocation the graph does not free: it outlives the launch until cuMemFreeAsync */
    CUgraph g;
    CUgraphExec e;
    CUdeviceptr d;
    CK(graph_alloc(bytes, 0, &g, &e, &d));
    CUresult launch = p_cuGraphLaunch(e, s);
    CK(p_cuStreamSynchronize(s));
    printf("launch=%d\n", launch);
    graph_attrs("launched");
    CUresult fr = launch ? launch : p_cuMemFreeAsync(d, s);
    CK(p_cuStreamSynchronize(s));
    printf("free_async=%d\n", fr);
    graph_attrs("freed");
    CUresult trim = p_cuDeviceGraphMemTrim(0);
    printf("trim=%d\n", trim);
    graph_attrs("trimmed");
    p_cuGraphExecDestroy(e);
    p_cuGraphDestroy(g);
    /* an allocation the graph frees itself (a free node): the pool keeps the reserve after the launch */
    CK(graph_alloc(bytes, 1, &g, &e, &d));
    CUresult fn_launch = p_cuGraphLaunch(e, s);
    CK(p_cuStreamSynchronize(s));
    printf("fn_launch=%d\n", fn_launch);
    graph_attrs("fn_launched");
    CUresult fn_trim = p_cuDeviceGraphMemTrim(0);
    printf("fn_trim=%d\n", fn_trim);
    graph_attrs("fn_trimmed");
    p_cuGraphExecDestroy(e);
    p_cuGraphDestroy(g);
    return 0;
}

/* Under the shim and a limit: a graph allocating (and freeing) half the limit runs; one allocating the whole
 * limit is refused. */
static int mode_graphlimit(size_t limit)
{
    load_graph_syms();
    if (ctx_up())
        return 2;
    CUstream s;
    CK(p_cuStreamCreate(&s, 0));
    CUgraph g1, g2;
    CUgraphExec e1, e2;
    CUdeviceptr d1, d2;
    CK(graph_alloc(limit / 2, 1, &g1, &e1, &d1));
    CUresult half = p_cuGraphLaunch(e1, s);
    CK(p_cuStreamSynchronize(s));
    unsigned long long charged = cu_used();
    CK(graph_alloc(limit, 1, &g2, &e2, &d2));
    CUresult all = p_cuGraphLaunch(e2, s);
    CK(p_cuStreamSynchronize(s));
    printf("graph_half=%d graph_all=%d charged_after_half=%llu\n", half, all, charged);
    p_cuGraphExecDestroy(e1);
    p_cuGraphExecDestroy(e2);
    p_cuGraphDestroy(g1);
    p_cuGraphDestroy(g2);
    p_cuDeviceGraphMemTrim(0);
    return 0;
}

/* cuMemCreate of `bytes` on device 0 at granularity; 0 or the driver's result. */
static CUresult vmm_create(size_t bytes, CUmemGenericAllocationHandle *h, size_t *size)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t gran = 0;
    CUresult rc = p_cuMemGetAllocationGranularity(&gran, &prop, 0);
    if (rc)
        return rc;
    *size = (bytes + gran - 1) / gran * gran;
    return p_cuMemCreate(h, *size, &prop, 0);
}

/* VMM memory of a destroyed context (no shim), the primary context kept alive meanwhile: the driver documents
 * that cuCtxDestroy does not free cuMemCreate memory (it belongs to no context); then unmapped and released from
 * the primary context. */
static int mode_vmmctx(size_t bytes)
{
    LOAD(cuCtxCreate_v2);
    LOAD(cuCtxDestroy_v2);
    if (ctx_up())
        return 2;
    CUcontext primary, c;
    CK(p_cuDevicePrimaryCtxRetain(&primary, 0));
    unsigned long long nv0 = nvml_used();
    CK(p_cuCtxCreate_v2(&c, 0, 0));
    unsigned long long nv1 = nvml_used();
    CUmemGenericAllocationHandle mapped, unmapped;
    size_t sz1, sz2;
    CUdeviceptr va;
    CK(vmm_create(bytes / 2, &mapped, &sz1));
    CK(p_cuMemAddressReserve(&va, sz1, 0, 0, 0));
    CK(p_cuMemMap(va, sz1, 0, mapped, 0));
    CK(vmm_create(bytes / 2, &unmapped, &sz2));
    unsigned long long nv2 = nvml_used();
    CUresult destroy = p_cuCtxDestroy_v2(c); /* neither handle released, one still mapped */
    CK(p_cuCtxSetCurrent(primary));
    CK(p_cuCtxSynchronize());
    unsigned long long nv3 = nvml_used();
    CUresult unmap = p_cuMemUnmap(va, sz1);
    CUresult rel1 = p_cuMemRelease(mapped), rel2 = p_cuMemRelease(unmapped);
    p_cuMemAddressFree(va, sz1);
    unsigned long long nv4 = nvml_used();
    printf("vmm_bytes=%zu destroy=%d unmap=%d release_mapped=%d release_unmapped=%d nvml_before=%llu nvml_ctx=%llu "
           "nvml_held=%llu nvml_destroyed=%llu nvml_released=%llu\n", sz1 + sz2, destroy, unmap, rel1, rel2, nv0, nv1,
           nv2, nv3, nv4);
    return 0;
}

/* ---- module memory: a module's __device__ globals are device memory the driver allocates at load */
FN(cuModuleUnload, CUresult, (CUmodule));
static nvmlReturn_t (*g_nvml_procs)(nvmlDevice_t, unsigned *, nvmlProcessInfo_t *);

/* NVML's used memory of this process on device 0 (host pid: run without a PID namespace), 0 when not listed, or
 * ~0 when NVML cannot tell. */
static unsigned long long nvml_own(void)
{
    if (nvml_used() == NVML_NA)
        return NVML_NA;
    if (!g_nvml_procs) {
        void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        g_nvml_procs = h ? (nvmlReturn_t (*)(nvmlDevice_t, unsigned *, nvmlProcessInfo_t *))dlsym(
                               h, "nvmlDeviceGetComputeRunningProcesses_v3")
                         : NULL;
        if (!g_nvml_procs)
            return NVML_NA;
    }
    static nvmlProcessInfo_t procs[512];
    unsigned n = 512;
    if (g_nvml_procs(g_nvd, &n, procs))
        return NVML_NA;
    for (unsigned i = 0; i < n; i++)
        if (procs[i].pid == (unsigned)getpid())
            return procs[i].usedGpuMemory;
    return 0;
}

/* Loads a PTX module declaring a visible `.global` byte array of `bytes` (kept by the JIT: it can be looked up
 * with cuModuleGetGlobal) and a kernel writing to it. */
static CUresult load_big_module(size_t bytes, CUmodule *m)
{
    static char ptx[1024];
    snprintf(ptx, sizeof ptx,
             ".version 7.0\n.target sm_70\n.address_size 64\n"
             ".visible .global .align 1 .b8 vgpu_big[%zu];\n"
             ".visible .entry touch()\n{\n .reg .u64 a;\n .reg .u16 v;\n mov.u64 a, vgpu_big;\n"
             " mov.u16 v, 1;\n st.global.u8 [a], v;\n ret;\n}\n", bytes);
    return p_cuModuleLoadData(m, ptx);
}

/* Without the shim: NVML's used memory around a module load and unload. */
static int mode_modmem(size_t bytes)
{
    LOAD(cuModuleUnload);
    if (ctx_up())
        return 2;
    CK(p_cuCtxSynchronize());
    unsigned long long own0 = nvml_own(), dev0 = nvml_used();
    CUmodule m = NULL;
    CUresult load = load_big_module(bytes, &m);
    CK(p_cuCtxSynchronize());
    unsigned long long own1 = nvml_own(), dev1 = nvml_used();
    CUresult unload = load ? load : p_cuModuleUnload(m);
    CK(p_cuCtxSynchronize());
    unsigned long long own2 = nvml_own(), dev2 = nvml_used();
    printf("module_load=%d module_unload=%d own_before=%llu own_loaded=%llu own_unloaded=%llu dev_before=%llu "
           "dev_loaded=%llu dev_unloaded=%llu\n", load, unload, own0, own1, own2, dev0, dev1, dev2);
    return 0;
}

/* Under the shim and a limit: a module holding half the limit is loaded and charged; one holding 1.5x the limit
 * is refused with CUDA_ERROR_OUT_OF_MEMORY and leaves nothing behind. */
static int mode_modlimit(size_t limit)
{
    LOAD(cuModuleUnload);
    if (ctx_up())
        return 2;
    unsigned long long used0 = cu_used(), own0 = nvml_own();
    CUmodule half = NULL, big = NULL;
    CUresult rh = load_big_module(limit / 2, &half);
    unsigned long long used1 = cu_used();
    CUresult ru = rh ? rh : p_cuModuleUnload(half);
    unsigned long long used2 = cu_used();
    CUresult rb = load_big_module(limit + limit / 2, &big);
    if (rb == CUDA_SUCCESS)
        p_cuModuleUnload(big);
    CK(p_cuCtxSynchronize());
    unsigned long long own3 = nvml_own();
    printf("mod_half=%d mod_unload=%d mod_big=%d used_before=%llu used_half=%llu used_unloaded=%llu own_before=%llu "
           "own_after_big=%llu\n", rh, ru, rb, used0, used1, used2, own0, own3);
    return 0;
}

/* ---- stacks grown at launch: a kernel needing more local memory per thread than the stack grows it */
FN(cuFuncGetAttribute, CUresult, (int *, int, CUfunction));
FN(cuCtxGetLimit, CUresult, (size_t *, int));

/* Loads a PTX kernel `deep` whose threads keep a local array of `bytes` (indexed by a parameter, so it stays in
 * local memory). */
static CUresult load_deep(size_t bytes, CUmodule *m, CUfunction *f)
{
    static char ptx[1024];
    snprintf(ptx, sizeof ptx,
             ".version 7.0\n.target sm_70\n.address_size 64\n"
             ".visible .entry deep(.param .u64 out, .param .u32 idx)\n{\n"
             " .local .align 8 .b8 buf[%zu];\n .reg .u64 a, b, o, off;\n .reg .u32 i, v;\n"
             " ld.param.u64 o, [out];\n ld.param.u32 i, [idx];\n mov.u64 a, buf;\n cvt.u64.u32 off, i;\n"
             " add.u64 b, a, off;\n st.local.u32 [b], i;\n ld.local.u32 v, [a];\n cvta.to.global.u64 o, o;\n"
             " st.global.u32 [o], v;\n ret;\n}\n", bytes);
    CUresult rc = p_cuModuleLoadData(m, ptx);
    return rc ? rc : p_cuModuleGetFunction(f, *m, "deep");
}

/* One launch of deep (one block of one thread) writing to out, synchronised. */
static CUresult launch_deep(CUfunction f, size_t bytes, CUdeviceptr out)
{
    unsigned idx = (unsigned)((bytes - 4) & ~(size_t)3);
    void *args[] = {&out, &idx};
    CUresult rc = p_cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL);
    CUresult sync = p_cuCtxSynchronize();
    return rc ? rc : sync;
}

/* Without the shim: the stack size and NVML's used memory around one launch of a `bytes` frame. */
static int mode_stack(size_t bytes)
{
    LOAD(cuFuncGetAttribute);
    LOAD(cuCtxGetLimit);
    if (ctx_up())
        return 2;
    CUmodule m;
    CUfunction f;
    CUdeviceptr out;
    CK(load_deep(bytes, &m, &f));
    CK(p_cuMemAlloc_v2(&out, 4));
    int local = -1, sms = 0, threads = 0;
    size_t before = 0, after = 0;
    p_cuFuncGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f);
    p_cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0);
    p_cuDeviceGetAttribute(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, 0);
    p_cuCtxGetLimit(&before, CU_LIMIT_STACK_SIZE);
    CK(p_cuCtxSynchronize());
    unsigned long long own0 = nvml_own();
    CUresult rc = launch_deep(f, bytes, out);
    unsigned long long own1 = nvml_own();
    p_cuCtxGetLimit(&after, CU_LIMIT_STACK_SIZE);
    printf("stack_launch=%d local=%d sms=%d threads=%d stack_before=%zu stack_after=%zu own_before=%llu "
           "own_after=%llu\n", rc, local, sms, threads, before, after, own0, own1);
    return 0;
}

/* Under the shim and a limit: a frame whose stack takes a quarter of the limit runs and is charged; one taking 1.5x
 * the limit is refused with CUDA_ERROR_OUT_OF_MEMORY and the process's NVML figure stays. */
static int mode_stacklimit(size_t limit)
{
    LOAD(cuFuncGetAttribute);
    LOAD(cuCtxGetLimit);
    if (ctx_up())
        return 2;
    int sms = 0, threads = 0;
    CK(p_cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0));
    CK(p_cuDeviceGetAttribute(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, 0));
    size_t per = (size_t)sms * (size_t)threads;
    size_t small = (limit / 4 / per) & ~(size_t)15, big = (limit + limit / 2) / per + 16;
    CUmodule m1, m2;
    CUfunction f1, f2;
    CUdeviceptr out;
    CK(load_deep(small, &m1, &f1));
    CK(load_deep(big, &m2, &f2));
    CK(p_cuMemAlloc_v2(&out, 4));
    CK(p_cuCtxSynchronize());
    unsigned long long used0 = cu_used(), own0 = nvml_own();
    CUresult rs = launch_deep(f1, small, out);
    unsigned long long used1 = cu_used(), own1 = nvml_own();
    CUresult rb = launch_deep(f2, big, out);
    unsigned long long used2 = cu_used(), own2 = nvml_own();
    printf("stack_small=%d stack_big=%d frame_small=%zu frame_big=%zu used_before=%llu used_small=%llu used_big=%llu "
           "own_before=%llu own_small=%llu own_big=%llu\n", rs, rb, small, big, used0, used1, used2, own0, own1, own2);
    return 0;
}

/* A retained handle (no shim): NVML used memory after each step. */
static int mode_retain(size_t bytes)
{
    LOAD(cuMemRetainAllocationHandle);
    if (ctx_up())
        return 2;
    CUmemGenericAllocationHandle h, h2 = 0;
    size_t sz;
    CUdeviceptr va;
    unsigned long long nv0 = nvml_used();
    CK(vmm_create(bytes, &h, &sz));
    CK(p_cuMemAddressReserve(&va, sz, 0, 0, 0));
    CK(p_cuMemMap(va, sz, 0, h, 0));
    CUresult retain = p_cuMemRetainAllocationHandle(&h2, (void *)(uintptr_t)va);
    CK(p_cuMemUnmap(va, sz));
    unsigned long long nv1 = nvml_used();
    CUresult rel1 = p_cuMemRelease(h);
    unsigned long long nv2 = nvml_used();
    CUresult rel2 = retain ? retain : p_cuMemRelease(h2);
    unsigned long long nv3 = nvml_used();
    p_cuMemAddressFree(va, sz);
    printf("retain_bytes=%zu retain=%d same_handle=%d release1=%d release2=%d nvml_base=%llu nvml_unmapped=%llu "
           "nvml_released_once=%llu nvml_released_twice=%llu\n", sz, retain, h2 == h, rel1, rel2, nv0, nv1, nv2, nv3);
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
        fprintf(stderr, "usage: %s procaddr|mem MIB|vmm MIB|nvml|hold MIB|alloc MIB|spin WARM_S SECONDS|graphmem MIB|"
                        "graphlimit MIB|vmmctx MIB|retain MIB|modmem MIB|modlimit MIB\n", argv[0]);
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
    if (!strcmp(argv[1], "graphmem") && argc > 2)
        return mode_graphmem((size_t)strtoull(argv[2], NULL, 10) * MIB);
    if (!strcmp(argv[1], "graphlimit") && argc > 2)
        return mode_graphlimit((size_t)strtoull(argv[2], NULL, 10) * MIB);
    if (!strcmp(argv[1], "vmmctx") && argc > 2)
        return mode_vmmctx((size_t)strtoull(argv[2], NULL, 10) * MIB);
    if (!strcmp(argv[1], "retain") && argc > 2)
        return mode_retain((size_t)strtoull(argv[2], NULL, 10) * MIB);
    if (!strcmp(argv[1], "modmem") && argc > 2)
        return mode_modmem((size_t)strtoull(argv[2], NULL, 10) * MIB);
    if (!strcmp(argv[1], "modlimit") && argc > 2)
        return mode_modlimit((size_t)strtoull(argv[2], NULL, 10) * MIB);
    if (!strcmp(argv[1], "stack") && argc > 2)
        return mode_stack((size_t)strtoull(argv[2], NULL, 10));
    if (!strcmp(argv[1], "stacklimit") && argc > 2)
        return mode_stacklimit((size_t)strtoull(argv[2], NULL, 10) * MIB);
    fprintf(stderr, "unknown mode %s\n", argv[1]);
    return 64;
}
