/*
 * Driver for tests/libvgpu/test_shim_review.py: CUDA graphs as frameworks build them, on the fake libcuda with
 * the shim preloaded. Each step prints "name=rc:charged" (the driver's result and what the shim charges on
 * GPU 0, bytes).
 *
 *   review_graphs copychild BYTES   cuMemAlloc BYTES, then a graph holding a memcpy node and a child graph
 *                                   (moved into it with cuGraphAddNode) that allocates BYTES: instantiate,
 *                                   launch. Under a limit below 2 x BYTES the launch must be refused.
 *   review_graphs sequence BYTES N  a graph of N allocations of BYTES, each freed in the graph before the next
 *                                   is made (alloc, free, alloc, free, ...: at most BYTES live at once):
 *                                   instantiate, launch twice.
 *   review_graphs parallel BYTES N  N branches, each an allocation of BYTES and its free, not ordered among
 *                                   themselves (all N can be live at once): instantiate, launch.
 *   review_graphs unordered BYTES   allocation A, its free; allocation B after A (not after A's free), its free:
 *                                   both can be live at once. Instantiate, launch.
 *   review_graphs early BYTES       allocation A, its free made with no dependency (not after A); allocation B
 *                                   after that free, its free: A's free need not follow A, so A can be live
 *                                   with B.
 *   review_graphs diamond BYTES     allocation A of BYTES and its free, then two branches after that free, each
 *                                   an allocation of BYTES / 2 and its free: at most BYTES live at once.
 *   review_graphs childseq BYTES    a child graph (moved in) allocating and freeing BYTES, then in the parent an
 *                                   allocation of BYTES after the child graph node and its free: one at a time.
 *   review_graphs childpar BYTES    the same, the parent's allocation not after the child graph node.
 *   review_graphs unfreed BYTES     allocation A that the graph does not free; allocation B after it and B's free:
 *                                   both live at once. Instantiate, launch, then trim the graph pool
 *                                   (cuDeviceGraphMemTrim): A stays allocated.
 *   review_graphs long BYTES N      a chain of N memcpy nodes, then two allocations of BYTES in sequence (each
 *                                   freed before the next is made) after it: instantiate, launch.
 *   review_graphs capture BYTES N   N allocations of BYTES captured from a stream (cuMemAllocAsync, cuMemFreeAsync
 *                                   before the next): instantiate, launch twice.
 *   review_graphs spec UNIT NODE... a graph made of the NODEs in order, each `TYPE:DEPS` with DEPS a comma-separated
 *                                   list of earlier nodes' positions (maybe empty): TYPE aN an allocation of
 *                                   N x UNIT bytes, fI a free of node I's allocation, k a memcpy node.
 *                                   Instantiate, launch.
 *   review_graphs retainrace BYTES GATE   cuMemCreate BYTES, mapped; a thread retains the handle
 *                                   (cuMemRetainAllocationHandle) and the fake driver holds it in the call
 *                                   (FAKE_CUDA_RETAIN_GATE=GATE) while this thread unmaps and releases the
 *                                   handle; then the retained reference is released.
 *   review_graphs maprace BYTES GATE   cuMemCreate BYTES; a thread maps it and the fake driver holds it in
 *                                   cuMemMap (FAKE_CUDA_MAP_GATE=GATE) while this thread releases the handle;
 *                                   then the mapping is unmapped.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_abi.h"
#include "graph_prog.h"

CUresult cuInit(unsigned int);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuGraphCreate(CUgraph *, unsigned int);
CUresult cuGraphAddMemAllocNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *);
CUresult cuGraphAddMemcpyNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, const void *, CUcontext);
CUresult cuGraphAddNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraphNodeParams *);
CUresult cuGraphAddMemFreeNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUdeviceptr);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *, void *);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamBeginCapture_v2(CUstream, int);
CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuDeviceGraphMemTrim(CUdevice);

struct retainer {
    CUcontext ctx;
    CUdeviceptr va;
    CUmemGenericAllocationHandle h, h2; /* maprace: h is the size, h2 the handle */
    CUresult rc;
};

static void *retain_thread(void *arg)
{
    struct retainer *r = arg;
    cuCtxSetCurrent(r->ctx);
    r->rc = cuMemRetainAllocationHandle(&r->h, (void *)(uintptr_t)r->va);
    return NULL;
}

static void *map_thread(void *arg)
{
    struct retainer *r = arg;
    cuCtxSetCurrent(r->ctx);
    r->rc = cuMemMap(r->va, (size_t)r->h, 0, r->h2, 0);
    return NULL;
}

static int maprace(CUcontext ctx, size_t bytes, const char *gate)
{
    char in[4096];
    snprintf(in, sizeof in, "%s.in", gate);
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = 1;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    struct retainer r = {.ctx = ctx, .h = bytes};
    cuMemAddressReserve(&r.va, bytes, 0, 0, 0);
    show("create", cuMemCreate(&r.h2, bytes, &p, 0));
    pthread_t t;
    if (pthread_create(&t, NULL, map_thread, &r) != 0)
        return 2;
    while (access(in, F_OK) != 0) /* the mapping is made in the driver */
        usleep(1000);
    show("release", cuMemRelease(r.h2));
    int fd = open(gate, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    if (fd >= 0)
        close(fd);
    pthread_join(t, NULL);
    show("mapped", r.rc);
    show("unmap", cuMemUnmap(r.va, bytes));
    return 0;
}

static int retainrace(CUcontext ctx, size_t bytes, const char *gate)
{
    char in[4096];
    snprintf(in, sizeof in, "%s.in", gate);
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUmemGenericAllocationHandle h = 0;
    struct retainer r = {.ctx = ctx};
    cuMemAddressReserve(&r.va, bytes, 0, 0, 0);
    show("create", cuMemCreate(&h, bytes, &p, 0));
    show("map", cuMemMap(r.va, bytes, 0, h, 0));
    pthread_t t;
    if (pthread_create(&t, NULL, retain_thread, &r) != 0)
        return 2;
    while (access(in, F_OK) != 0) /* the retain is in the driver, its reference taken there */
        usleep(1000);
    show("unmap", cuMemUnmap(r.va, bytes));
    show("release", cuMemRelease(h));
    int fd = open(gate, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    if (fd >= 0)
        close(fd);
    pthread_join(t, NULL);
    show("retained", r.rc);
    show("release_retained", cuMemRelease(r.h));
    return 0;
}

/* Instantiates g and launches it `launches` times, showing each step. */
static int run(CUgraph g, int launches)
{
    CUgraphExec e = NULL;
    show("instantiate", cuGraphInstantiateWithFlags(&e, g, 0));
    show("launch", cuGraphLaunch(e, NULL));
    if (launches > 1)
        show("relaunch", cuGraphLaunch(e, NULL));
    return 0;
}

/* The graphs of the modes parallel, unordered, early, diamond, childseq, childpar, unfreed and long (see the top). */
static int shapes(const char *mode, size_t bytes, int n, CUcontext ctx)
{
    CUgraph g = NULL;
    show("create", cuGraphCreate(&g, 0));
    CUgraphNode a1 = NULL, f1 = NULL, a2 = NULL, f2 = NULL, c = NULL;
    CUdeviceptr p1 = 0, p2 = 0;
    CUresult rc = CUDA_SUCCESS;
    if (!strcmp(mode, "parallel")) {
        for (int i = 0; i < n && rc == CUDA_SUCCESS; i++) {
            rc = alloc_node(g, NULL, 0, bytes, &a1, &p1);
            if (rc == CUDA_SUCCESS)
                rc = cuGraphAddMemFreeNode(&f1, g, &a1, 1, p1);
        }
    } else if (!strcmp(mode, "unordered")) {
        rc = alloc_node(g, NULL, 0, bytes, &a1, &p1);
        rc = rc ? rc : cuGraphAddMemFreeNode(&f1, g, &a1, 1, p1);
        rc = rc ? rc : alloc_node(g, &a1, 1, bytes, &a2, &p2); /* after A, not after A's free */
        rc = rc ? rc : cuGraphAddMemFreeNode(&f2, g, &a2, 1, p2);
    } else if (!strcmp(mode, "early")) {
        rc = alloc_node(g, NULL, 0, bytes, &a1, &p1);
        rc = rc ? rc : cuGraphAddMemFreeNode(&f1, g, NULL, 0, p1); /* not after A's allocation */
        rc = rc ? rc : alloc_node(g, &f1, 1, bytes, &a2, &p2);
        rc = rc ? rc : cuGraphAddMemFreeNode(&f2, g, &a2, 1, p2);
    } else if (!strcmp(mode, "diamond")) {
        rc = alloc_node(g, NULL, 0, bytes, &a1, &p1);
        rc = rc ? rc : cuGraphAddMemFreeNode(&f1, g, &a1, 1, p1);
        for (int i = 0; i < 2 && rc == CUDA_SUCCESS; i++) {
            rc = alloc_node(g, &f1, 1, bytes / 2, &a2, &p2);
            rc = rc ? rc : cuGraphAddMemFreeNode(&f2, g, &a2, 1, p2);
        }
    } else if (!strcmp(mode, "childseq") || !strcmp(mode, "childpar")) {
        CUgraph child = NULL;
        rc = cuGraphCreate(&child, 0);
        rc = rc ? rc : alloc_node(child, NULL, 0, bytes, &a1, &p1);
        rc = rc ? rc : cuGraphAddMemFreeNode(&f1, child, &a1, 1, p1);
        CUgraphNodeParams p;
        memset(&p, 0, sizeof p);
        p.type = CU_GRAPH_NODE_TYPE_GRAPH;
        p.u.graph.graph = child;
        p.u.graph.ownership = CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE;
        rc = rc ? rc : cuGraphAddNode(&c, g, NULL, 0, &p);
        int seq = !strcmp(mode, "childseq");
        rc = rc ? rc : alloc_node(g, &c, seq ? 1 : 0, bytes, &a2, &p2);
        rc = rc ? rc : cuGraphAddMemFreeNode(&f2, g, &a2, 1, p2);
    } else if (!strcmp(mode, "unfreed")) {
        rc = alloc_node(g, NULL, 0, bytes, &a1, &p1);
        rc = rc ? rc : alloc_node(g, &a1, 1, bytes, &a2, &p2);
        rc = rc ? rc : cuGraphAddMemFreeNode(&f2, g, &a2, 1, p2);
    } else if (!strcmp(mode, "long")) {
        unsigned char copy[256]; /* a CUDA_MEMCPY3D the fake does not read */
        memset(copy, 0, sizeof copy);
        for (int i = 0; i < n && rc == CUDA_SUCCESS; i++) {
            CUgraphNode prev = c;
            rc = cuGraphAddMemcpyNode(&c, g, prev ? &prev : NULL, prev ? 1 : 0, copy, ctx);
        }
        rc = rc ? rc : alloc_node(g, &c, 1, bytes, &a1, &p1);
        rc = rc ? rc : cuGraphAddMemFreeNode(&f1, g, &a1, 1, p1);
        rc = rc ? rc : alloc_node(g, &f1, 1, bytes, &a2, &p2);
        rc = rc ? rc : cuGraphAddMemFreeNode(&f2, g, &a2, 1, p2);
    } else {
        return 2;
    }
    show("nodes", rc);
    run(g, 1);
    if (!strcmp(mode, "unfreed"))
        show("trim", cuDeviceGraphMemTrim(0));
    return 0;
}

/* The graph of mode spec (see the top). */
static int spec(size_t unit, int n, char **tok, CUcontext ctx)
{
    enum { MAXN = 64 };
    CUgraph g = NULL;
    CUgraphNode node[MAXN];
    CUdeviceptr ptr[MAXN];
    show("create", cuGraphCreate(&g, 0));
    CUresult rc = n <= MAXN ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < n && rc == CUDA_SUCCESS; i++) {
        char *colon = strchr(tok[i], ':');
        if (!colon)
            return 2;
        CUgraphNode deps[MAXN];
        size_t nd = 0;
        for (char *d = colon + 1; *d && nd < MAXN;) {
            long k = strtol(d, &d, 10);
            if (k < 0 || k >= i)
                return 2;
            deps[nd++] = node[k];
            if (*d == ',')
                d++;
            else if (*d)
                return 2;
        }
        long arg = strtol(tok[i] + 1, NULL, 10);
        ptr[i] = 0;
        if (tok[i][0] == 'a') {
            rc = alloc_node(g, deps, nd, (size_t)arg * unit, &node[i], &ptr[i]);
        } else if (tok[i][0] == 'f' && arg >= 0 && arg < i) {
            rc = cuGraphAddMemFreeNode(&node[i], g, nd ? deps : NULL, nd, ptr[arg]);
        } else if (tok[i][0] == 'k') {
            unsigned char copy[256]; /* a CUDA_MEMCPY3D the fake does not read */
            memset(copy, 0, sizeof copy);
            rc = cuGraphAddMemcpyNode(&node[i], g, nd ? deps : NULL, nd, copy, ctx);
        } else {
            return 2;
        }
    }
    show("nodes", rc);
    return run(g, 1);
}

/* N allocations captured from a stream, each freed before the next is made (PyTorch's cudaMallocAsync backend). */
static int capture(size_t bytes, int n)
{
    CUstream s = NULL;
    CUgraph g = NULL;
    show("stream", cuStreamCreate(&s, 0));
    show("begin", cuStreamBeginCapture_v2(s, 0));
    CUresult rc = CUDA_SUCCESS;
    for (int i = 0; i < n && rc == CUDA_SUCCESS; i++) {
        CUdeviceptr p = 0;
        rc = cuMemAllocAsync(&p, bytes, s);
        rc = rc ? rc : cuMemFreeAsync(p, s);
    }
    show("nodes", rc);
    show("end", cuStreamEndCapture(s, &g));
    return run(g, 2);
}

int main(int argc, char **argv)
{
    if (argc < 3 || cuInit(0) != CUDA_SUCCESS)
        return 2;
    CUcontext ctx = NULL;
    if (cuCtxCreate_v2(&ctx, 0, 0) != CUDA_SUCCESS) {
        printf("fail ctx\n");
        return 2;
    }
    size_t bytes = strtoull(argv[2], NULL, 10);
    if (!strcmp(argv[1], "maprace") && argc > 3)
        return maprace(ctx, bytes, argv[3]);
    if (!strcmp(argv[1], "retainrace") && argc > 3)
        return retainrace(ctx, bytes, argv[3]);
    if (!strcmp(argv[1], "spec"))
        return spec(bytes, argc - 3, argv + 3, ctx);
    if (!strcmp(argv[1], "capture") && argc > 3)
        return capture(bytes, atoi(argv[3]));
    static const char *const shaped[] = {"parallel", "unordered", "early",   "diamond",
                                         "childseq", "childpar",  "unfreed", "long"};
    for (size_t i = 0; i < sizeof shaped / sizeof shaped[0]; i++)
        if (!strcmp(argv[1], shaped[i]))
            return shapes(argv[1], bytes, argc > 3 ? atoi(argv[3]) : 0, ctx);
    if (!strcmp(argv[1], "sequence") && argc > 3) {
        CUgraph g = NULL;
        show("create", cuGraphCreate(&g, 0));
        CUgraphNode last = NULL;
        for (int i = 0; i < atoi(argv[3]); i++) {
            CUDA_MEM_ALLOC_NODE_PARAMS a;
            memset(&a, 0, sizeof a);
            a.poolProps.allocType = 1;
            a.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            a.bytesize = bytes;
            CUgraphNode an = NULL, fn = NULL;
            CUresult rc = cuGraphAddMemAllocNode(&an, g, last ? &last : NULL, last ? 1 : 0, &a);
            if (rc == CUDA_SUCCESS)
                rc = cuGraphAddMemFreeNode(&fn, g, &an, 1, a.dptr);
            if (rc != CUDA_SUCCESS)
                show("nodes", rc);
            last = fn;
        }
        CUgraphExec e = NULL;
        show("instantiate", cuGraphInstantiateWithFlags(&e, g, 0));
        show("launch", cuGraphLaunch(e, NULL));
        show("relaunch", cuGraphLaunch(e, NULL));
        return 0;
    }
    if (strcmp(argv[1], "copychild") != 0)
        return 2;
    CUdeviceptr pre = 0;
    show("pre", cuMemAlloc_v2(&pre, bytes));
    CUgraph parent = NULL, child = NULL;
    show("create", cuGraphCreate(&parent, 0) || cuGraphCreate(&child, 0) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS);
    CUDA_MEM_ALLOC_NODE_PARAMS a;
    memset(&a, 0, sizeof a);
    a.poolProps.allocType = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    a.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.poolProps.location.id = 0;
    a.bytesize = bytes;
    CUgraphNode an = NULL, cn = NULL, gn = NULL;
    show("alloc_node", cuGraphAddMemAllocNode(&an, child, NULL, 0, &a));
    unsigned char copy[256]; /* a CUDA_MEMCPY3D the fake does not read */
    memset(copy, 0, sizeof copy);
    show("memcpy_node", cuGraphAddMemcpyNode(&cn, parent, NULL, 0, copy, ctx));
    CUgraphNodeParams p;
    memset(&p, 0, sizeof p);
    p.type = CU_GRAPH_NODE_TYPE_GRAPH;
    p.u.graph.graph = child;
    p.u.graph.ownership = CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE;
    show("child_node", cuGraphAddNode(&gn, parent, &cn, 1, &p));
    CUgraphExec e = NULL;
    show("instantiate", cuGraphInstantiateWithFlags(&e, parent, 0));
    show("launch", cuGraphLaunch(e, NULL));
    return 0;
}
