/*
 * Red-team driver for CUDA graph memory nodes (tests/security/test_redteam_graphmem.py). Linked against the
 * fake libcuda, run with the shim preloaded. One scenario per run, on device 0 in a context of its own
 * (LIBVGPU_CONTEXT_COST=0 in the tests); each step prints "name=rc:charged:peak" (the driver's result, what
 * the shim charges on GPU 0, and the most device memory this process has held at once so far, as the fake
 * driver counts it, its context included), bytes.
 *
 *   graphmem_redteam node BYTES       a graph with one allocation node of BYTES (not freed in the graph):
 *                                     instantiate, launch, then cuMemAlloc BYTES more.
 *   graphmem_redteam prealloc BYTES   cuMemAlloc BYTES, then launch a graph allocating BYTES.
 *   graphmem_redteam capture BYTES    cuMemAllocAsync BYTES captured from a stream into a graph (not freed):
 *                                     instantiate, launch, then cuMemAlloc BYTES more; free the graph's
 *                                     allocation (the graph pool keeps it), cuDeviceGraphMemTrim, again.
 *   graphmem_redteam capture_ptsz BYTES   the same on the per-thread default stream (cuMemAllocAsync_ptsz with
 *                                     the NULL stream while CU_STREAM_PER_THREAD is captured): launch, then
 *                                     cuMemAlloc BYTES more.
 *   graphmem_redteam relaunch N BYTES MODE   a graph allocating BYTES launched N times (MODE inner: a free
 *                                     node frees it in the graph; outer: cuMemFree after each launch); then
 *                                     cuMemAlloc of what the limit leaves (LEFT, the last argument).
 *   graphmem_redteam trim BYTES       launch a graph that allocates and frees BYTES, cuDeviceGraphMemTrim,
 *                                     then cuMemAlloc 900 MiB.
 *   graphmem_redteam update SMALL BIG PRE   cuMemAlloc PRE, an executable of a graph allocating and freeing
 *                                     SMALL launched, updated (cuGraphExecUpdate_v2) with a graph of the same
 *                                     shape allocating BIG, launched again.
 *   graphmem_redteam child BYTES      cuMemAlloc BYTES, then a graph whose only node is a child graph (moved
 *                                     into it with cuGraphAddNode) allocating BYTES: instantiate, launch.
 *   graphmem_redteam race BYTES PRE N cuMemAlloc PRE, then two threads, each with an executable graph of its
 *                                     own allocating BYTES (not freed in it), launch it and cuMemFree the
 *                                     allocation N times each; prints "launched=L" "refused=R".
 *   graphmem_redteam multidev B0 B1 PRE1   (two GPUs) cuMemAlloc PRE1 on device 1 (a context there), then a
 *                                     graph allocating B0 on device 0 and B1 on device 1 launched from device
 *                                     0's context; steps print device 1's figures as "name@1=rc:charged:peak".
 *   graphmem_redteam upload BYTES     cuMemAlloc BYTES, then a graph allocating BYTES uploaded (cuGraphUpload)
 *                                     and instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_abi.h"
#include "redteam.h"

CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *, size_t, CUstream);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamBeginCapture_v2(CUstream, int);
CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuGraphCreate(CUgraph *, unsigned int);
CUresult cuGraphDestroy(CUgraph);
CUresult cuGraphAddMemAllocNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *);
CUresult cuGraphAddMemFreeNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUdeviceptr);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphInstantiateWithParams(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *);
CUresult cuGraphUpload(CUgraphExec, CUstream);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphExecDestroy(CUgraphExec);
CUresult cuGraphExecUpdate_v2(CUgraphExec, CUgraph, void *);
CUresult cuDeviceGraphMemTrim(CUdevice);
CUresult cuGraphAddNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraphNodeParams *);
unsigned long long fake_cuda_debug_peak_bytes(int dev);

#define MIB (1024ull * 1024ull)

static unsigned long long charged_on(int dev)
{
    int (*get)(int, uint64_t *, uint64_t *) = (int (*)(int, uint64_t *, uint64_t *))dlsym(RTLD_DEFAULT,
                                                                                          "vgpu_get_usage");
    uint64_t used = 0;
    if (!get || get(dev, &used, NULL) != 0)
        return (unsigned long long)-1;
    return (unsigned long long)used;
}

static unsigned long long charged(void)
{
    return charged_on(0);
}

static void show_on(const char *name, int dev, CUresult rc)
{
    printf("%s@%d=%d:%llu:%llu\n", name, dev, rc, charged_on(dev), fake_cuda_debug_peak_bytes(dev));
}

static void show(const char *name, CUresult rc)
{
    printf("%s=%d:%llu:%llu\n", name, rc, charged(), fake_cuda_debug_peak_bytes(0));
}

/* A graph allocating bytes on device 0 (*dptr: the allocation's address), freed in it when `inner`. */
static CUgraph graph_of(size_t bytes, int inner, CUdeviceptr *dptr)
{
    CUgraph g = NULL;
    if (cuGraphCreate(&g, 0) != CUDA_SUCCESS)
        return NULL;
    CUDA_MEM_ALLOC_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.poolProps.allocType = 1;
    p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.poolProps.location.id = 0;
    p.bytesize = bytes;
    CUgraphNode a = NULL, f = NULL;
    CUresult rc = cuGraphAddMemAllocNode(&a, g, NULL, 0, &p);
    if (rc == CUDA_SUCCESS && inner)
        rc = cuGraphAddMemFreeNode(&f, g, &a, 1, p.dptr);
    if (rc != CUDA_SUCCESS)
        printf("fail graph rc=%d\n", rc);
    if (dptr)
        *dptr = p.dptr;
    return g;
}

static CUgraphExec instantiate(CUgraph g)
{
    CUgraphExec e = NULL;
    show("instantiate", cuGraphInstantiateWithFlags(&e, g, 0));
    return e;
}

struct racer {
    CUcontext ctx;
    CUgraphExec exec;
    CUdeviceptr dptr;
    int n, launched, refused, other;
};

static void *race(void *arg)
{
    struct racer *r = arg;
    cuCtxSetCurrent(r->ctx);
    for (int i = 0; i < r->n; i++) {
        CUresult rc = cuGraphLaunch(r->exec, NULL);
        if (rc == CUDA_SUCCESS) {
            r->launched++;
            if (cuMemFree_v2(r->dptr) != CUDA_SUCCESS)
                r->other++;
        } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            r->refused++;
        } else {
            r->other++;
        }
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 2 || rt_start() != 0)
        return 2;
    CUcontext ctx = NULL;
    if (cuCtxCreate_v2(&ctx, 0, 0) != CUDA_SUCCESS) {
        printf("fail ctx\n");
        return 2;
    }
    const char *sc = argv[1];
    size_t bytes = argc > 2 ? strtoull(argv[2], NULL, 10) : 0;
    CUdeviceptr d = 0, more = 0;
    if (!strcmp(sc, "node") || !strcmp(sc, "prealloc")) {
        if (!strcmp(sc, "prealloc"))
            show("pre", cuMemAlloc_v2(&more, bytes));
        CUgraphExec e = instantiate(graph_of(bytes, 0, &d));
        show("launch", cuGraphLaunch(e, NULL));
        if (!strcmp(sc, "node"))
            show("more", cuMemAlloc_v2(&more, bytes));
    } else if (!strcmp(sc, "capture")) {
        CUstream s = NULL;
        CUgraph g = NULL;
        cuStreamCreate(&s, 0);
        cuStreamBeginCapture_v2(s, 0);
        show("captured_alloc", cuMemAllocAsync(&d, bytes, s));
        show("end_capture", cuStreamEndCapture(s, &g));
        CUgraphExec e = instantiate(g);
        show("launch", cuGraphLaunch(e, s));
        show("more", cuMemAlloc_v2(&more, bytes));
        show("free_graph_alloc", cuMemFreeAsync(d, s));
        show("sync", cuStreamSynchronize(s));
        show("more_after_free", cuMemAlloc_v2(&more, bytes));
        show("trim", cuDeviceGraphMemTrim(0));
        show("more_after_trim", cuMemAlloc_v2(&more, bytes));
    } else if (!strcmp(sc, "capture_ptsz")) {
        CUstream ptds = (CUstream)(uintptr_t)2; /* CU_STREAM_PER_THREAD */
        CUgraph g = NULL;
        show("begin_capture", cuStreamBeginCapture_v2(ptds, 0));
        show("captured_alloc", cuMemAllocAsync_ptsz(&d, bytes, NULL));
        show("end_capture", cuStreamEndCapture(ptds, &g));
        CUgraphExec e = instantiate(g);
        show("launch", cuGraphLaunch(e, ptds));
        show("more", cuMemAlloc_v2(&more, bytes));
    } else if (!strcmp(sc, "relaunch") && argc > 5) {
        int n = atoi(argv[2]), inner = !strcmp(argv[4], "inner");
        bytes = strtoull(argv[3], NULL, 10);
        CUgraphExec e = instantiate(graph_of(bytes, inner, &d));
        int bad = 0;
        unsigned long long first = 0, drift = 0;
        for (int i = 0; i < n; i++) {
            CUresult rc = cuGraphLaunch(e, NULL);
            if (rc == CUDA_SUCCESS && !inner)
                rc = cuMemFree_v2(d);
            bad += rc != CUDA_SUCCESS;
            if (i == 0)
                first = charged();
            else if (charged() != first)
                drift++;
        }
        printf("failed=%d\ndrift=%llu\n", bad, drift);
        show("last", CUDA_SUCCESS);
        show("fill", cuMemAlloc_v2(&more, strtoull(argv[5], NULL, 10)));
    } else if (!strcmp(sc, "trim")) {
        CUgraphExec e = instantiate(graph_of(bytes, 1, &d));
        show("launch", cuGraphLaunch(e, NULL));
        show("more_before_trim", cuMemAlloc_v2(&more, 900 * MIB));
        show("trim", cuDeviceGraphMemTrim(0));
        show("more", cuMemAlloc_v2(&more, 900 * MIB));
    } else if (!strcmp(sc, "update") && argc > 4) {
        size_t big = strtoull(argv[3], NULL, 10), pre = strtoull(argv[4], NULL, 10);
        show("pre", cuMemAlloc_v2(&more, pre));
        CUgraphExec e = instantiate(graph_of(bytes, 1, &d));
        show("launch_small", cuGraphLaunch(e, NULL));
        show("update", cuGraphExecUpdate_v2(e, graph_of(big, 1, NULL), NULL));
        show("launch_big", cuGraphLaunch(e, NULL));
    } else if (!strcmp(sc, "child")) {
        show("pre", cuMemAlloc_v2(&more, bytes));
        CUgraph parent = NULL;
        cuGraphCreate(&parent, 0);
        CUgraphNodeParams p;
        memset(&p, 0, sizeof p);
        p.type = CU_GRAPH_NODE_TYPE_GRAPH;
        p.u.graph.graph = graph_of(bytes, 0, &d);
        p.u.graph.ownership = CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE;
        CUgraphNode n = NULL;
        show("add_child", cuGraphAddNode(&n, parent, NULL, 0, &p));
        CUgraphExec e = instantiate(parent);
        show("launch", cuGraphLaunch(e, NULL));
    } else if (!strcmp(sc, "race") && argc > 4) {
        size_t pre = strtoull(argv[3], NULL, 10);
        show("pre", cuMemAlloc_v2(&more, pre));
        struct racer r[2];
        pthread_t t[2];
        memset(r, 0, sizeof r);
        for (int i = 0; i < 2; i++) {
            r[i].ctx = ctx;
            r[i].n = atoi(argv[4]);
            r[i].exec = instantiate(graph_of(bytes, 0, &r[i].dptr));
        }
        for (int i = 0; i < 2; i++)
            pthread_create(&t[i], NULL, race, &r[i]);
        for (int i = 0; i < 2; i++)
            pthread_join(t[i], NULL);
        printf("per_thread=%d/%d,%d/%d\n", r[0].launched, r[0].refused, r[1].launched, r[1].refused);
        printf("launched=%d\nrefused=%d\nother=%d\n", r[0].launched + r[1].launched, r[0].refused + r[1].refused,
               r[0].other + r[1].other);
        show("end", CUDA_SUCCESS);
    } else if (!strcmp(sc, "multidev") && argc > 4) {
        size_t b1 = strtoull(argv[3], NULL, 10), pre1 = strtoull(argv[4], NULL, 10);
        CUcontext c1 = NULL;
        show_on("ctx1", 1, cuCtxCreate_v2(&c1, 0, 1));
        show_on("pre1", 1, cuMemAlloc_v2(&more, pre1));
        cuCtxSetCurrent(ctx);
        CUgraph g = graph_of(bytes, 0, &d);
        CUDA_MEM_ALLOC_NODE_PARAMS p;
        memset(&p, 0, sizeof p);
        p.poolProps.allocType = 1;
        p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        p.poolProps.location.id = 1;
        p.bytesize = b1;
        CUgraphNode n = NULL;
        show_on("add1", 1, cuGraphAddMemAllocNode(&n, g, NULL, 0, &p));
        CUgraphExec e = instantiate(g);
        CUresult rc = cuGraphLaunch(e, NULL);
        show("launch", rc);
        show_on("launch", 1, rc);
    } else if (!strcmp(sc, "upload")) {
        CUstream s = NULL;
        cuStreamCreate(&s, 0);
        show("pre", cuMemAlloc_v2(&more, bytes));
        CUgraph g = graph_of(bytes, 0, &d);
        CUgraphExec e = instantiate(g);
        show("upload", cuGraphUpload(e, s));
        show("destroy", cuGraphExecDestroy(e));
        CUDA_GRAPH_INSTANTIATE_PARAMS p;
        memset(&p, 0, sizeof p);
        p.flags = CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD;
        p.hUploadStream = s;
        CUgraphExec e2 = NULL;
        show("instantiate_upload", cuGraphInstantiateWithParams(&e2, g, &p));
        show("free_pre", cuMemFree_v2(more));
        CUgraphExec e3 = NULL;
        show("instantiate_upload_fits", cuGraphInstantiateWithParams(&e3, g, &p));
        show("launch", cuGraphLaunch(e3, s));
    } else {
        printf("fail usage\n");
        return 2;
    }
    return 0;
}
