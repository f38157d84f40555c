/*
 * Red-team driver for the peak of a graph's allocations (docs/shim.md "Sum or peak: the admin's choice";
 * tests/security/test_redteam_graphpeak.py). Linked against the fake libcuda, run with the shim preloaded under a
 * 1 GiB limit and LIBVGPU_GRAPH_MEMORY_BOUND=peak (or not). Each step prints "name=rc:charged" (the driver's result
 * and what the shim charges on GPU 0, bytes); timed steps also "name_ms=MS".
 *
 *   graphpeak_redteam grow BYTES ADD GATE   a graph of two allocations of BYTES in sequence (the first freed
 *                        before the second is made: peak BYTES, sum 2 x BYTES). A second thread waits until the
 *                        fake driver holds a count query of the graph's nodes or edges (FAKE_CUDA_GRAPH_GATE=GATE:
 *                        GATE.in appears), adds ADD memcpy nodes in a chain after the last free (ADD nodes and
 *                        edges more; ADD -1: one allocation of BYTES not ordered with the others nor freed), then
 *                        creates GATE. Instantiate (the shim's query is the one held), launch; "raced=0" when
 *                        no query was held (the thread is let go then).
 *   graphpeak_redteam pair BYTES ORDERED    two allocations of BYTES, each freed, the second made after the first's
 *                        free (ORDERED 1: peak BYTES) or not (0: both can be live): instantiate, launch.
 *   graphpeak_redteam update BYTES          the pair in sequence instantiated, the executable updated
 *                        (cuGraphExecUpdate_v2) to the pair unordered, launched.
 *   graphpeak_redteam procaddr BYTES        the pair unordered, instantiated through every instantiation entry
 *                        point cuGetProcAddress_v2 hands out (per-thread variants too), launched.
 *   graphpeak_redteam flow BYTES N PAD      N allocations (N <= 128), each made after the one before, allocation i
 *                        freed before allocation j is made when j >= i + 2 (a dense order: i and i + 1 can be live
 *                        together, nothing more), sizes BYTES x (1 + i % 7) / 8,
 *                        then PAD memcpy nodes each after up to 4 earlier ones (edges to the graph's bound):
 *                        instantiate (timed: instantiate_ms), launch.
 *   graphpeak_redteam clones BYTES K M D    a child graph of M memcpy nodes, each after the D (1..4) before it
 *                        (cloned into the parent K times with
 *                        cuGraphAddChildGraphNode, K <= 14) between two allocations of BYTES in sequence (the first
 *                        freed before the clones, the second made after them): instantiate, launch.
 *   graphpeak_redteam deep BYTES L          two allocations of BYTES in sequence with, between the first's free and
 *                        the second, a memcpy node nested L child graph levels down (each moved into its parent with
 *                        cuGraphAddNode): instantiate, launch.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "../libvgpu/progs/graph_prog.h"
#include "redteam.h"

CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuGraphCreate(CUgraph *, unsigned int);
CUresult cuGraphAddNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraphNodeParams *);
CUresult cuGraphAddMemAllocNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *);
CUresult cuGraphAddMemFreeNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUdeviceptr);
CUresult cuGraphAddMemcpyNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, const void *, CUcontext);
CUresult cuGraphAddChildGraphNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraph);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphExecUpdate_v2(CUgraphExec, CUgraph, void *);
CUresult cuGraphExecDestroy(CUgraphExec);
CUresult cuGraphDestroy(CUgraph);
CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

static CUcontext g_ctx;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static CUresult copy_node(CUgraph g, const CUgraphNode *deps, size_t n, CUgraphNode *node)
{
    unsigned char copy[256]; /* a CUDA_MEMCPY3D the fake does not read */
    memset(copy, 0, sizeof copy);
    return cuGraphAddMemcpyNode(node, g, n ? deps : NULL, n, copy, g_ctx);
}

/* Instantiates g (timed when `timed`) and launches it once, showing each step. */
static int run(CUgraph g, int timed)
{
    CUgraphExec e = NULL;
    double t0 = now_ms();
    CUresult rc = cuGraphInstantiateWithFlags(&e, g, 0);
    double t1 = now_ms();
    show("instantiate", rc);
    if (timed)
        printf("instantiate_ms=%.3f\n", t1 - t0);
    show("launch", cuGraphLaunch(e, NULL));
    return 0;
}

struct grower {
    CUgraph g;
    CUgraphNode last;
    int add;
    size_t bytes;
    const char *gate;
    CUresult rc;
};

static void *grow_thread(void *arg)
{
    struct grower *w = arg;
    char in[4096];
    snprintf(in, sizeof in, "%s.in", w->gate);
    for (int i = 0; i < 60000 && access(in, F_OK) != 0; i++) /* the fake creates it when it holds the query */
        usleep(1000);
    cuCtxSetCurrent(g_ctx);
    w->rc = CUDA_SUCCESS;
    for (int i = 0; i < w->add && w->rc == CUDA_SUCCESS; i++)
        w->rc = copy_node(w->g, &w->last, 1, &w->last);
    if (w->add < 0) { /* an allocation not ordered with the others and not freed */
        CUgraphNode a;
        CUdeviceptr p;
        w->rc = alloc_node(w->g, NULL, 0, w->bytes, &a, &p);
    }
    FILE *f = fopen(w->gate, "w");
    if (f)
        fclose(f);
    return NULL;
}

/* Two allocations of bytes, each freed, the second made after the first's free when `ordered`; NULL on failure.
 * *last (when not NULL): the second free node. */
static CUgraph pair_graph(size_t bytes, int ordered, CUgraphNode *last)
{
    CUgraph g = NULL;
    CUgraphNode a1, f1, a2, f2 = NULL;
    CUdeviceptr p1, p2;
    CUresult rc = cuGraphCreate(&g, 0);
    rc = rc ? rc : alloc_node(g, NULL, 0, bytes, &a1, &p1);
    rc = rc ? rc : cuGraphAddMemFreeNode(&f1, g, &a1, 1, p1);
    rc = rc ? rc : alloc_node(g, &f1, ordered != 0, bytes, &a2, &p2);
    rc = rc ? rc : cuGraphAddMemFreeNode(&f2, g, &a2, 1, p2);
    show("nodes", rc);
    if (last)
        *last = f2;
    return rc ? NULL : g;
}

static int grow(size_t bytes, int add, const char *gate)
{
    CUgraphNode f2 = NULL;
    CUgraph g = pair_graph(bytes, 1, &f2);
    struct grower w = {g, f2, add, bytes, gate, CUDA_ERROR_NOT_FOUND};
    pthread_t t;
    if (!g || pthread_create(&t, NULL, grow_thread, &w) != 0)
        return 2;
    run(g, 0);
    char in[4096];
    snprintf(in, sizeof in, "%s.in", gate);
    int raced = access(in, F_OK) == 0; /* else no count query was held: the thread is let go */
    printf("raced=%d\n", raced);
    if (!raced) {
        FILE *f = fopen(in, "w");
        if (f)
            fclose(f);
    }
    pthread_join(t, NULL);
    show("grown", w.rc);
    return 0;
}

static int pair(size_t bytes, int ordered)
{
    CUgraph g = pair_graph(bytes, ordered, NULL);
    return g ? run(g, 0) : 2;
}

/* The pair in sequence instantiated (its peak recorded), then the executable updated to the pair unordered. */
static int update(size_t bytes)
{
    CUgraph seq = pair_graph(bytes, 1, NULL), par = pair_graph(bytes, 0, NULL);
    if (!seq || !par)
        return 2;
    CUgraphExec e = NULL;
    show("instantiate", cuGraphInstantiateWithFlags(&e, seq, 0));
    show("update", cuGraphExecUpdate_v2(e, par, NULL));
    show("launch", cuGraphLaunch(e, NULL));
    return 0;
}

typedef CUresult (*inst_fn)(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t);
typedef CUresult (*inst_flags_fn)(CUgraphExec *, CUgraph, unsigned long long);
typedef CUresult (*inst_params_fn)(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *);

/* The pair unordered instantiated through each instantiation entry point cuGetProcAddress_v2 hands out (a fresh
 * graph each: one executable at a time for a graph with memory nodes), then launched; "NAME_VER_FLAGS=rc:charged"
 * for the launch, "NAME_VER_FLAGS_inst=..." for the instantiation. */
static int procaddr(size_t bytes)
{
    static const struct {
        const char *name;
        int ver, kind; /* 0: (exec, graph, err, log, size); 1: with flags; 2: with params */
    } e[] = {{"cuGraphInstantiate", 10000, 0}, {"cuGraphInstantiate", 11000, 0}, {"cuGraphInstantiate", 12000, 1},
             {"cuGraphInstantiateWithFlags", 11040, 1}, {"cuGraphInstantiateWithParams", 12000, 2}};
    for (size_t i = 0; i < sizeof e / sizeof e[0]; i++)
        for (int flags = 0; flags <= (e[i].kind == 2 ? 2 : 0); flags += 2) {
            char name[96];
            snprintf(name, sizeof name, "%s_%d_%d", e[i].name, e[i].ver, flags);
            void *fn = NULL;
            CUdriverProcAddressQueryResult st = 0;
            CUresult rc = cuGetProcAddress_v2(e[i].name, &fn, e[i].ver, (cuuint64_t)flags, &st);
            CUgraph g = rc == CUDA_SUCCESS && fn ? pair_graph(bytes, 0, NULL) : NULL;
            CUgraphExec x = NULL;
            if (!g) {
                printf("%s=fail:%d\n", name, rc);
                continue;
            }
            if (e[i].kind == 0) {
                rc = ((inst_fn)fn)(&x, g, NULL, NULL, 0);
            } else if (e[i].kind == 1) {
                rc = ((inst_flags_fn)fn)(&x, g, 0);
            } else {
                CUDA_GRAPH_INSTANTIATE_PARAMS prm;
                memset(&prm, 0, sizeof prm);
                rc = ((inst_params_fn)fn)(&x, g, &prm);
            }
            char inst[112];
            snprintf(inst, sizeof inst, "%s_inst", name);
            show(inst, rc);
            show(name, cuGraphLaunch(x, NULL));
            cuGraphExecDestroy(x);
            cuGraphDestroy(g);
        }
    return 0;
}

static int flow(size_t bytes, int n, int pad)
{
    CUgraph g = NULL;
    CUgraphNode a[128], f[128], last[4] = {0};
    CUdeviceptr p[128];
    CUresult rc = cuGraphCreate(&g, 0);
    if (n > 128)
        return 2;
    for (int i = 0; i < n && rc == CUDA_SUCCESS; i++) {
        /* allocation i after allocation i - 1 and the free of i - 2: i is freed before every j >= i + 2 */
        size_t sz = bytes * (size_t)(1 + i % 7) / 8;
        CUgraphNode deps[2] = {i >= 1 ? a[i - 1] : NULL, i >= 2 ? f[i - 2] : NULL};
        rc = alloc_node(g, deps, (size_t)(i < 2 ? i : 2), sz, &a[i], &p[i]);
        rc = rc ? rc : cuGraphAddMemFreeNode(&f[i], g, &a[i], 1, p[i]);
    }
    show("allocs", rc);
    for (int i = 0; i < pad && rc == CUDA_SUCCESS; i++) {
        CUgraphNode c;
        size_t nd = i < 4 ? (size_t)i : 4;
        rc = copy_node(g, last, nd, &c);
        last[i % 4] = c;
    }
    show("pad", rc);
    return rc ? 2 : run(g, 1);
}

static int clones(size_t bytes, int k, int m, int deps)
{
    CUgraph g = NULL, child = NULL;
    CUgraphNode a1, f1, a2, f2, last4[4] = {0};
    CUdeviceptr p1, p2;
    CUresult rc = cuGraphCreate(&g, 0);
    rc = rc ? rc : cuGraphCreate(&child, 0);
    for (int i = 0; i < m && rc == CUDA_SUCCESS; i++) { /* node i after nodes i - deps .. i - 1 */
        CUgraphNode c, d[4];
        int nd = i < deps ? i : deps;
        for (int j = 0; j < nd; j++)
            d[j] = last4[(i - 1 - j) % 4];
        rc = copy_node(child, d, (size_t)nd, &c);
        last4[i % 4] = c;
    }
    rc = rc ? rc : alloc_node(g, NULL, 0, bytes, &a1, &p1);
    rc = rc ? rc : cuGraphAddMemFreeNode(&f1, g, &a1, 1, p1);
    CUgraphNode last = f1;
    for (int i = 0; i < k && rc == CUDA_SUCCESS; i++)
        rc = cuGraphAddChildGraphNode(&last, g, &last, 1, child);
    rc = rc ? rc : alloc_node(g, &last, 1, bytes, &a2, &p2);
    rc = rc ? rc : cuGraphAddMemFreeNode(&f2, g, &a2, 1, p2);
    show("nodes", rc);
    return rc ? 2 : run(g, 0);
}

static int deep(size_t bytes, int levels)
{
    CUgraph inner = NULL;
    CUgraphNode n, a1, f1, a2, f2;
    CUdeviceptr p1, p2;
    CUresult rc = cuGraphCreate(&inner, 0);
    rc = rc ? rc : copy_node(inner, NULL, 0, &n);
    for (int l = 0; l < levels && rc == CUDA_SUCCESS; l++) {
        CUgraph outer = NULL;
        rc = cuGraphCreate(&outer, 0);
        CUgraphNodeParams p;
        memset(&p, 0, sizeof p);
        p.type = CU_GRAPH_NODE_TYPE_GRAPH;
        p.u.graph.graph = inner;
        p.u.graph.ownership = CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE;
        rc = rc ? rc : cuGraphAddNode(&n, outer, NULL, 0, &p); /* inner moved into the node */
        inner = outer;
    }
    CUgraph g = inner;
    rc = rc ? rc : alloc_node(g, NULL, 0, bytes, &a1, &p1);
    rc = rc ? rc : cuGraphAddMemFreeNode(&f1, g, &a1, 1, p1);
    CUgraphNode deps[2] = {f1, n};
    rc = rc ? rc : alloc_node(g, deps, 2, bytes, &a2, &p2);
    rc = rc ? rc : cuGraphAddMemFreeNode(&f2, g, &a2, 1, p2);
    show("nodes", rc);
    return rc ? 2 : run(g, 0);
}

int main(int argc, char **argv)
{
    if (argc < 3 || rt_start() != 0)
        return 2;
    if (cuCtxCreate_v2(&g_ctx, 0, 0) != CUDA_SUCCESS) {
        printf("fail cuCtxCreate\n");
        return 2;
    }
    size_t bytes = strtoull(argv[2], NULL, 0);
    if (!strcmp(argv[1], "grow") && argc == 5)
        return grow(bytes, atoi(argv[3]), argv[4]);
    if (!strcmp(argv[1], "pair") && argc == 4)
        return pair(bytes, atoi(argv[3]));
    if (!strcmp(argv[1], "procaddr") && argc == 3)
        return procaddr(bytes);
    if (!strcmp(argv[1], "update") && argc == 3)
        return update(bytes);
    if (!strcmp(argv[1], "flow") && argc == 5)
        return flow(bytes, atoi(argv[3]), atoi(argv[4]));
    if (!strcmp(argv[1], "clones") && argc == 6 && atoi(argv[5]) >= 1 && atoi(argv[5]) <= 4)
        return clones(bytes, atoi(argv[3]), atoi(argv[4]), atoi(argv[5]));
    if (!strcmp(argv[1], "deep") && argc == 4)
        return deep(bytes, atoi(argv[3]));
    return 2;
}
