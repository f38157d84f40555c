/*
 * Walking a CUDA graph's nodes, child graphs included: the one walk behind the graph checks (SM cost of its
 * kernels in limiter.c; allocation nodes and kernels' stacks in memory.c). It runs at instantiation and
 * update, never on a launch path: one node list per graph level, as the graph has.
 */
#include "vgpu.h"

#include <stdlib.h>
#include <string.h>

static int walk(CUgraph g, int depth, graph_visit_fn visit, void *arg)
{
    size_t n = 0;
    if (depth > GRAPH_WALK_DEPTH || !real_cuGraphGetNodes || !real_cuGraphNodeGetType ||
        real_cuGraphGetNodes(g, NULL, &n) != CUDA_SUCCESS)
        return -1;
    if (n == 0)
        return 0;
    CUgraphNode *nodes = calloc(n, sizeof *nodes);
    if (!nodes || real_cuGraphGetNodes(g, nodes, &n) != CUDA_SUCCESS) {
        free(nodes);
        return -1;
    }
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        int type = -1;
        if (real_cuGraphNodeGetType(nodes[i], &type) != CUDA_SUCCESS) {
            rc = -1;
        } else if (type == CU_GRAPH_NODE_TYPE_GRAPH) {
            CUgraph child = NULL;
            if (!real_cuGraphChildGraphNodeGetGraph ||
                real_cuGraphChildGraphNodeGetGraph(nodes[i], &child) != CUDA_SUCCESS || !child ||
                walk(child, depth + 1, visit, arg) != 0)
                rc = -1;
        } else if (visit(nodes[i], type, arg) != 0) {
            rc = -1;
        }
    }
    free(nodes);
    return rc;
}

int graph_walk(CUgraph g, graph_visit_fn visit, void *arg)
{
    return walk(g, 0, visit, arg);
}

struct kernel_walk {
    graph_kernel_fn fn;
    void *arg;
};

static int kernel_node(CUgraphNode node, int type, void *arg)
{
    struct kernel_walk *k = arg;
    CUDA_KERNEL_NODE_PARAMS p;
    int got = GRAPH_NODE_PARAMS(node, type, CU_GRAPH_NODE_TYPE_KERNEL, real_cuGraphKernelNodeGetParams, p);
    if (got <= 0)
        return got;
    k->fn(&p, k->arg);
    return 0;
}

int graph_walk_kernels(CUgraph g, graph_kernel_fn fn, void *arg)
{
    struct kernel_walk k = {fn, arg};
    return graph_walk(g, kernel_node, &k);
}
