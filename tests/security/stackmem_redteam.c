/*
 * Red-team driver for the stack a kernel launch grows (tests/security/test_redteam_stackmem.py). Linked
 * against the fake libcuda, run with the shim preloaded (or not). The fake gives the kernel "deep" the local
 * memory per thread FAKE_CUDA_LOCAL_BYTES names (a large local array, a deep stack); "plain" has none. One
 * run on device 0 in a context of its own (LIBVGPU_CONTEXT_COST=0 in the tests); each step prints
 * "name=rc:charged:peak" (the driver's result, what the shim charges on GPU 0, the most device memory this
 * process has held at once so far, its context included), bytes.
 *
 *   stackmem_redteam API KERNEL MORE   cuFuncGetAttribute(LOCAL_SIZE_BYTES) of KERNEL ("local=N"), one
 *        launch of it through API (kernel, kernel_ptsz, ex, ex_ptsz, coop, coop_ptsz, launch: cuLaunch, grid:
 *        cuLaunchGrid, gridasync: cuLaunchGridAsync, multi: cuLaunchCooperativeKernelMultiDevice, graph: a
 *        graph with one kernel node, instantiated then launched: step "instantiate"; graphset: the same graph of
 *        the kernel "plain", its executable's node then given KERNEL by cuGraphExecKernelNodeSetParams: step
 *        "setparams"; graphupdate: the executable of that graph updated by cuGraphExecUpdate_v2 to a graph of
 *        KERNEL: step "update"; graphnode: as graphset through cuGraphExecNodeSetParams), a synchronisation
 *        (step "launch"), the stack size the context reports ("stack=N"), cuMemAlloc of MORE bytes (step
 *        "more"), the same launch again (step "again"), then the context destroyed (step "destroy";
 *        "held=N": what the process holds on the GPU after it).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_abi.h"
#include "redteam.h"

#include <dlfcn.h>

CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxSynchronize(void);
CUresult cuCtxGetLimit(size_t *, int);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuFuncGetAttribute(int *, int, CUfunction);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuLaunchKernel(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                        unsigned int, unsigned int, CUstream, void **, void **);
CUresult cuLaunchKernel_ptsz(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                             unsigned int, unsigned int, CUstream, void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuLaunchCooperativeKernel(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                                   unsigned int, unsigned int, unsigned int, CUstream, void **);
CUresult cuLaunchCooperativeKernel_ptsz(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                                        unsigned int, unsigned int, unsigned int, CUstream, void **);
CUresult cuLaunch(CUfunction);
CUresult cuLaunchGrid(CUfunction, int, int);
CUresult cuLaunchGridAsync(CUfunction, int, int, CUstream);
CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *, unsigned int, unsigned int);
CUresult cuGraphCreate(CUgraph *, unsigned int);
CUresult cuGraphAddKernelNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, const CUDA_KERNEL_NODE_PARAMS *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphExecKernelNodeSetParams(CUgraphExec, CUgraphNode, const CUDA_KERNEL_NODE_PARAMS *);
CUresult cuGraphExecUpdate_v2(CUgraphExec, CUgraph, void *);
CUresult cuGraphExecNodeSetParams(CUgraphExec, CUgraphNode, CUgraphNodeParams *);
unsigned long long fake_cuda_debug_peak_bytes(int dev);
unsigned long long fake_cuda_debug_held_bytes(int dev);

static unsigned long long charged(void)
{
    int (*get)(int, uint64_t *, uint64_t *) = (int (*)(int, uint64_t *, uint64_t *))dlsym(RTLD_DEFAULT,
                                                                                          "vgpu_get_usage");
    uint64_t used = 0;
    if (!get)
        return 0; /* no shim */
    if (get(0, &used, NULL) != 0)
        return (unsigned long long)-1;
    return (unsigned long long)used;
}

static void show(const char *name, CUresult rc)
{
    printf("%s=%d:%llu:%llu\n", name, rc, charged(), fake_cuda_debug_peak_bytes(0));
}

/* One launch of f through api (graph: exec, made once by the caller). */
static CUresult launch(const char *api, CUfunction f, CUstream s, CUgraphExec exec)
{
    CUlaunchConfig c;
    memset(&c, 0, sizeof c);
    c.gridDimX = c.gridDimY = c.gridDimZ = 1;
    c.blockDimX = c.blockDimY = c.blockDimZ = 1;
    c.hStream = s;
    CUDA_LAUNCH_PARAMS lp;
    memset(&lp, 0, sizeof lp);
    lp.function = f;
    lp.gridDimX = lp.gridDimY = lp.gridDimZ = 1;
    lp.blockDimX = lp.blockDimY = lp.blockDimZ = 1;
    lp.hStream = s;
    if (!strcmp(api, "kernel"))
        return cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
    if (!strcmp(api, "kernel_ptsz"))
        return cuLaunchKernel_ptsz(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
    if (!strcmp(api, "ex"))
        return cuLaunchKernelEx(&c, f, NULL, NULL);
    if (!strcmp(api, "ex_ptsz"))
        return cuLaunchKernelEx_ptsz(&c, f, NULL, NULL);
    if (!strcmp(api, "coop"))
        return cuLaunchCooperativeKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL);
    if (!strcmp(api, "coop_ptsz"))
        return cuLaunchCooperativeKernel_ptsz(f, 1, 1, 1, 1, 1, 1, 0, s, NULL);
    if (!strcmp(api, "launch"))
        return cuLaunch(f);
    if (!strcmp(api, "grid"))
        return cuLaunchGrid(f, 1, 1);
    if (!strcmp(api, "gridasync"))
        return cuLaunchGridAsync(f, 1, 1, s);
    if (!strcmp(api, "multi"))
        return cuLaunchCooperativeKernelMultiDevice(&lp, 1, 0);
    if (!strncmp(api, "graph", 5))
        return exec ? cuGraphLaunch(exec, s) : CUDA_ERROR_INVALID_VALUE;
    return CUDA_ERROR_INVALID_VALUE;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: stackmem_redteam API KERNEL MORE\n");
        return 2;
    }
    const char *api = argv[1];
    CUcontext ctx = NULL;
    CUmodule m = NULL;
    CUfunction f = NULL;
    CUstream s = NULL;
    if (cuInit(0) || cuCtxCreate_v2(&ctx, 0, 0) || cuModuleLoadData(&m, "fake") ||
        cuModuleGetFunction(&f, m, argv[2]) || cuStreamCreate(&s, 0)) {
        printf("fail setup\n");
        return 1;
    }
    int local = -1;
    CUresult arc = cuFuncGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f);
    printf("local=%d\nlocal_rc=%d\n", local, arc);
    CUgraphExec exec = NULL;
    int set = !strcmp(api, "graphset"), upd = !strcmp(api, "graphupdate"), gen = !strcmp(api, "graphnode");
    if (!strcmp(api, "graph") || set || upd || gen) {
        CUgraph g = NULL;
        CUgraphNode n;
        CUDA_KERNEL_NODE_PARAMS p;
        memset(&p, 0, sizeof p);
        p.func = f;
        if ((set || upd || gen) && cuModuleGetFunction(&p.func, m, "plain")) {
            printf("fail plain\n");
            return 1;
        }
        p.gridDimX = p.gridDimY = p.gridDimZ = 1;
        p.blockDimX = p.blockDimY = p.blockDimZ = 1;
        if (cuGraphCreate(&g, 0) || cuGraphAddKernelNode(&n, g, NULL, 0, &p)) {
            printf("fail graph\n");
            return 1;
        }
        CUresult rc = cuGraphInstantiateWithFlags(&exec, g, 0);
        show("instantiate", rc);
        if (rc)
            exec = NULL;
        if (set && exec) {
            p.func = f;
            show("setparams", cuGraphExecKernelNodeSetParams(exec, n, &p));
        }
        if (gen && exec) {
            CUgraphNodeParams np;
            memset(&np, 0, sizeof np);
            np.type = CU_GRAPH_NODE_TYPE_KERNEL;
            np.u.kernel = p;
            np.u.kernel.func = f;
            show("setparams", cuGraphExecNodeSetParams(exec, n, &np));
        }
        CUgraph g2 = NULL;
        unsigned char info[64] = {0};
        if (upd && exec) {
            p.func = f;
            if (cuGraphCreate(&g2, 0) || cuGraphAddKernelNode(&n, g2, NULL, 0, &p)) {
                printf("fail graph2\n");
                return 1;
            }
            show("update", cuGraphExecUpdate_v2(exec, g2, info));
        }
    }
    CUresult rc = launch(api, f, s, exec);
    CUresult sync = cuCtxSynchronize();
    show("launch", rc ? rc : sync);
    size_t stack = 0;
    cuCtxGetLimit(&stack, CU_LIMIT_STACK_SIZE);
    printf("stack=%zu\n", stack);
    CUdeviceptr d = 0;
    rc = cuMemAlloc_v2(&d, strtoull(argv[3], NULL, 10));
    show("more", rc);
    show("again", launch(api, f, s, exec));
    cuCtxSynchronize();
    if (rc == CUDA_SUCCESS)
        cuMemFree_v2(d);
    show("destroy", cuCtxDestroy_v2(ctx));
    printf("held=%llu\n", fake_cuda_debug_held_bytes(0));
    return 0;
}
