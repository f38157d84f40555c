/*
 * Red-team driver for the SM limit of CUDA graphs whose kernels sit in child graph nodes
 * (tests/security/test_redteam_childgraph.py). Linked against the fake libcuda, run with the shim preloaded
 * under CUDA_DEVICE_SM_LIMIT. One run:
 *
 *   childgraph_redteam WRAP SECONDS KERNELS BLOCKS
 *
 * builds a graph of KERNELS kernel nodes of BLOCKS blocks each, wrapped as WRAP says, instantiates it and
 * launches it back to back for SECONDS, then prints "instantiate=RC graphs=N util=U": U is the busy % of the
 * GPU the launches made (N x KERNELS x BLOCKS x FAKE_CUDA_NS_PER_BLOCK over the elapsed time, as the fake
 * driver runs them).
 *   plain   the kernel nodes in the launched graph itself
 *   child   the kernel nodes in a graph added as a child graph node (cuGraphAddChildGraphNode)
 *   nested  the child graph of "child" added in turn as the only node of another child graph (two levels)
 *   update  instantiated from a graph of the same shape as "child" whose kernels have ONE block each, then
 *           updated (cuGraphExecUpdate_v2) to the BLOCKS-block graph before the launches
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_abi.h"
#include "redteam.h"

CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamSynchronize(CUstream);
CUresult cuGraphCreate(CUgraph *, unsigned int);
CUresult cuGraphDestroy(CUgraph);
CUresult cuGraphAddKernelNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, const CUDA_KERNEL_NODE_PARAMS *);
CUresult cuGraphAddChildGraphNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraph);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphExecUpdate_v2(CUgraphExec, CUgraph, void *);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphExecDestroy(CUgraphExec);

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A graph of `kernels` kernel nodes of `blocks` blocks each, wrapped `levels` child graph levels deep (0: the
 * kernels in the graph itself). Returns the outermost graph, or NULL after printing "fail". */
static CUgraph build(CUfunction f, unsigned kernels, unsigned blocks, int levels)
{
    CUgraph g = NULL;
    if (cuGraphCreate(&g, 0) != CUDA_SUCCESS) {
        printf("fail cuGraphCreate\n");
        return NULL;
    }
    CUDA_KERNEL_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.func = f;
    p.gridDimX = blocks;
    p.gridDimY = p.gridDimZ = 1;
    p.blockDimX = p.blockDimY = p.blockDimZ = 1;
    for (unsigned i = 0; i < kernels; i++) {
        CUgraphNode n;
        if (cuGraphAddKernelNode(&n, g, NULL, 0, &p) != CUDA_SUCCESS) {
            printf("fail cuGraphAddKernelNode\n");
            return NULL;
        }
    }
    for (int l = 0; l < levels; l++) {
        CUgraph parent = NULL;
        CUgraphNode n;
        CUresult rc = cuGraphCreate(&parent, 0);
        if (rc == CUDA_SUCCESS)
            rc = cuGraphAddChildGraphNode(&n, parent, NULL, 0, g); /* clones g into the node */
        if (rc != CUDA_SUCCESS) {
            printf("fail cuGraphAddChildGraphNode rc=%d\n", rc);
            return NULL;
        }
        cuGraphDestroy(g);
        g = parent;
    }
    return g;
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: %s plain|child|nested|update SECONDS KERNELS BLOCKS\n", argv[0]);
        return 64;
    }
    if (rt_start())
        return 1;
    const char *wrap = argv[1];
    double seconds = atof(argv[2]);
    unsigned kernels = (unsigned)atoi(argv[3]), blocks = (unsigned)atoi(argv[4]);
    int levels = !strcmp(wrap, "plain") ? 0 : !strcmp(wrap, "nested") ? 2 : 1;
    CUcontext ctx;
    CUmodule mod;
    CUfunction f;
    CUstream s;
    if (cuCtxCreate_v2(&ctx, 0, 0) || cuModuleLoadData(&mod, "fake") || cuModuleGetFunction(&f, mod, "busy") ||
        cuStreamCreate(&s, 0)) {
        printf("fail setup\n");
        return 1;
    }
    int update = !strcmp(wrap, "update");
    CUgraph g = build(f, kernels, update ? 1 : blocks, levels);
    if (!g)
        return 1;
    CUgraphExec e;
    CUresult rc = cuGraphInstantiateWithFlags(&e, g, 0);
    printf("instantiate=%d\n", rc);
    if (rc)
        return 1;
    if (update) {
        CUgraph big = build(f, kernels, blocks, levels);
        if (!big)
            return 1;
        rc = cuGraphExecUpdate_v2(e, big, NULL);
        printf("update=%d\n", rc);
        if (rc)
            return 1;
        cuGraphDestroy(big);
    }
    double ns_per_block = getenv("FAKE_CUDA_NS_PER_BLOCK") ? atof(getenv("FAKE_CUDA_NS_PER_BLOCK")) : 1000.0;
    double t0 = now_s();
    unsigned long long n = 0;
    while (now_s() - t0 < seconds) {
        rc = cuGraphLaunch(e, s);
        if (rc) {
            printf("fail cuGraphLaunch rc=%d\n", rc);
            return 1;
        }
        n++;
    }
    cuStreamSynchronize(s);
    double el = now_s() - t0;
    printf("graphs=%llu util=%.2f\n", n, 100.0 * (double)n * kernels * blocks * ns_per_block / 1e9 / el);
    cuGraphExecDestroy(e);
    cuGraphDestroy(g);
    return 0;
}
