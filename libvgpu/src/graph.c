/*
 * Walking a CUDA graph's nodes, child graphs included: the one walk behind the graph checks (SM cost of its
 * kernels in limiter.c; allocation nodes and kernels' stacks in memory.c). It runs at instantiation and
 * update, never on a launch path: one node list per graph level, as the graph has. Also a graph's dependency
 * order (graph_dag, for the peak of its allocations in memory.c), read at instantiation only, within fixed bounds.
 */
#include "vgpu.h"

#include <stdlib.h>
#include <string.h>

/* Graph g's nodes, listed into *out (the caller frees it; NULL when there are none), their number in *n: 0, 1 when
 * the graph kept growing (*out: a listing of some of its nodes), or -1 when they cannot be read. The count and the
 * listing are two calls, and another thread may add nodes between them: the driver then fills the buffer and may
 * answer a count larger than it (its documentation leaves that count open). A listing is complete when the count
 * before it, the count it answers and the count after it agree; else it is taken again, GRAPH_LIST_TRIES times at
 * most. Nothing is read past the buffer. */
#define GRAPH_LIST_TRIES 4
int graph_nodes(CUgraph g, CUgraphNode **out, size_t *n)
{
    *out = NULL;
    *n = 0;
    if (!real_cuGraphGetNodes)
        return -1;
    for (int t = 1;; t++) {
        size_t want = 0, got, after = 0;
        if (real_cuGraphGetNodes(g, NULL, &want) != CUDA_SUCCESS)
            return -1;
        if (want == 0)
            return 0;
        CUgraphNode *nodes = calloc(want, sizeof *nodes);
        if (!nodes)
            return -1;
        got = want;
        if (real_cuGraphGetNodes(g, nodes, &got) != CUDA_SUCCESS ||
            real_cuGraphGetNodes(g, NULL, &after) != CUDA_SUCCESS) {
            free(nodes);
            return -1;
        }
        if ((got == want && after == want) || t == GRAPH_LIST_TRIES) {
            *out = nodes;
            *n = got < want ? got : want;
            return got == want && after == want ? 0 : 1;
        }
        free(nodes);
    }
}

static int walk(CUgraph g, int depth, graph_visit_fn visit, void *arg)
{
    size_t n = 0;
    CUgraphNode *nodes = NULL;
    if (depth > GRAPH_WALK_DEPTH || !real_cuGraphNodeGetType)
        return -1;
    int rc = graph_nodes(g, &nodes, &n); /* a graph that kept growing: what was listed is visited, incomplete */
    if (rc < 0)
        return -1;
    rc = -rc;
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
    GRAPH_VISIT_PARAMS(CUDA_KERNEL_NODE_PARAMS, p, CU_GRAPH_NODE_TYPE_KERNEL, real_cuGraphKernelNodeGetParams);
    k->fn(&p, k->arg);
    return 0;
}

int graph_walk_kernels(CUgraph g, graph_kernel_fn fn, void *arg)
{
    struct kernel_walk k = {fn, arg};
    return graph_walk(g, kernel_node, &k);
}

/* ------------------------------------------------------------------ dependency order */
struct dag_build {
    struct graph_dag *d;
    uint32_t (*edge)[2]; /* GRAPH_DAG_EDGES (from, to) vertex pairs */
    size_t nedge;
};

/* A node of one level: its handle and the vertices an edge into it reaches and an edge out of it leaves (a child
 * graph node: its entry and its exit; any other node: itself). */
struct level_node {
    uintptr_t h;
    uint32_t in, out;
};

static int cmp_level_node(const void *a, const void *b)
{
    uintptr_t x = ((const struct level_node *)a)->h, y = ((const struct level_node *)b)->h;
    return x < y ? -1 : x > y;
}

static int dag_edge(struct dag_build *b, uint32_t from, uint32_t to)
{
    if (b->nedge >= GRAPH_DAG_EDGES)
        return -1;
    b->edge[b->nedge][0] = from;
    b->edge[b->nedge++][1] = to;
    return 0;
}

/* The edges of one level (ln: its n nodes). An edge that is not an ordinary dependency (edge data not zero: it may
 * let the downstream node start before the upstream one completes), or names a node not read, orders nothing: it is
 * left out, which can only make the order weaker. */
static int level_edges(struct dag_build *b, CUgraph g, struct level_node *ln, size_t n)
{
    size_t ne = 0;
    if (real_cuGraphGetEdges_v2) {
        if (real_cuGraphGetEdges_v2(g, NULL, NULL, NULL, &ne) != CUDA_SUCCESS)
            return -1;
    } else if (!real_cuGraphGetEdges || real_cuGraphGetEdges(g, NULL, NULL, &ne) != CUDA_SUCCESS) {
        return -1; /* a driver before CUDA 12.3 has no edge data: its edges are all ordinary */
    }
    if (ne == 0)
        return 0;
    if (ne > GRAPH_DAG_EDGES - b->nedge)
        return -1;
    size_t cap = ne;
    CUgraphNode *from = calloc(cap, sizeof *from), *to = calloc(cap, sizeof *to);
    CUgraphEdgeData *data = real_cuGraphGetEdges_v2 ? calloc(cap, sizeof *data) : NULL;
    int rc = -1;
    if (!from || !to || (real_cuGraphGetEdges_v2 && !data))
        goto out;
    if (data ? real_cuGraphGetEdges_v2(g, from, to, data, &ne) != CUDA_SUCCESS
             : real_cuGraphGetEdges(g, from, to, &ne) != CUDA_SUCCESS)
        goto out;
    if (ne > cap)
        ne = cap;
    qsort(ln, n, sizeof *ln, cmp_level_node);
    rc = 0;
    for (size_t i = 0; i < ne && rc == 0; i++) {
        if (!from[i] || !to[i] || (data && (data[i].from_port || data[i].to_port || data[i].type)))
            continue;
        struct level_node kf = {(uintptr_t)from[i], 0, 0}, kt = {(uintptr_t)to[i], 0, 0};
        const struct level_node *f = bsearch(&kf, ln, n, sizeof *ln, cmp_level_node);
        const struct level_node *t = bsearch(&kt, ln, n, sizeof *ln, cmp_level_node);
        if (f && t)
            rc = dag_edge(b, f->out, t->in);
    }
out:
    free(from);
    free(to);
    free(data);
    return rc;
}

/* Adds graph g's nodes (its child graphs' too) to the order: every node of g runs after `entry` starts and before
 * `exit` (both UINT32_MAX at the top level). */
static int dag_level(struct dag_build *b, CUgraph g, int depth, uint32_t entry, uint32_t exit_)
{
    struct graph_dag *d = b->d;
    size_t n = 0;
    CUgraphNode *nodes = NULL;
    if (depth > GRAPH_WALK_DEPTH)
        return -1;
    int got = graph_nodes(g, &nodes, &n);
    if (got == 0 && n == 0)
        return 0;
    struct level_node *ln = got == 0 && n <= GRAPH_DAG_NODES - d->n ? calloc(n, sizeof *ln) : NULL;
    int rc = -1;
    if (!ln)
        goto out;
    rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        uint32_t v = d->n++;
        d->node[v] = nodes[i];
        if (!nodes[i] || real_cuGraphNodeGetType(nodes[i], &d->type[v]) != CUDA_SUCCESS)
            rc = -1;
        ln[i] = (struct level_node){(uintptr_t)nodes[i], v, v};
        if (rc == 0 && entry != UINT32_MAX)
            rc = dag_edge(b, entry, v);
    }
    for (size_t i = 0; i < n && rc == 0; i++) {
        if (d->type[ln[i].in] != CU_GRAPH_NODE_TYPE_GRAPH)
            continue;
        CUgraph child = NULL;
        if (d->n >= GRAPH_DAG_NODES || !real_cuGraphChildGraphNodeGetGraph ||
            real_cuGraphChildGraphNodeGetGraph(nodes[i], &child) != CUDA_SUCCESS || !child) {
            rc = -1;
            break;
        }
        uint32_t x = d->n++; /* the child graph node's exit: after all of its graph */
        d->node[x] = NULL;
        d->type[x] = CU_GRAPH_NODE_TYPE_GRAPH;
        ln[i].out = x;
        rc = dag_level(b, child, depth + 1, ln[i].in, x);
        if (rc == 0)
            rc = dag_edge(b, ln[i].in, x);
    }
    for (size_t i = 0; i < n && rc == 0 && exit_ != UINT32_MAX; i++)
        rc = dag_edge(b, ln[i].out, exit_);
    if (rc == 0)
        rc = level_edges(b, g, ln, n);
out:
    free(nodes);
    free(ln);
    return rc;
}

void graph_dag_free(struct graph_dag *d)
{
    free(d->node);
    free(d->type);
    free(d->first);
    free(d->succ);
    memset(d, 0, sizeof *d);
}

int graph_dag(CUgraph g, struct graph_dag *d)
{
    memset(d, 0, sizeof *d);
    if (!real_cuGraphGetNodes || !real_cuGraphNodeGetType || (!real_cuGraphGetEdges && !real_cuGraphGetEdges_v2))
        return -1;
    struct dag_build b = {d, calloc(GRAPH_DAG_EDGES, sizeof *b.edge), 0};
    d->node = calloc(GRAPH_DAG_NODES, sizeof *d->node);
    d->type = calloc(GRAPH_DAG_NODES, sizeof *d->type);
    int rc = b.edge && d->node && d->type ? dag_level(&b, g, 0, UINT32_MAX, UINT32_MAX) : -1;
    if (rc == 0) { /* successors in one array, vertex by vertex */
        d->first = calloc((size_t)d->n + 1, sizeof *d->first);
        d->succ = calloc(b.nedge ? b.nedge : 1, sizeof *d->succ);
        if (!d->first || !d->succ)
            rc = -1;
    }
    if (rc == 0) {
        for (size_t i = 0; i < b.nedge; i++)
            d->first[b.edge[i][0] + 1]++;
        for (uint32_t v = 0; v < d->n; v++)
            d->first[v + 1] += d->first[v];
        uint32_t *fill = calloc((size_t)d->n + 1, sizeof *fill);
        if (!fill) {
            rc = -1;
        } else {
            for (size_t i = 0; i < b.nedge; i++) {
                uint32_t f = b.edge[i][0];
                d->succ[d->first[f] + fill[f]++] = b.edge[i][1];
            }
            free(fill);
        }
    }
    free(b.edge);
    if (rc != 0)
        graph_dag_free(d);
    return rc;
}
