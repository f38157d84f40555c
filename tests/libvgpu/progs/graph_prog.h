/* What the graph test programs (review_graphs.c here, tests/security/graphpeak_redteam.c) share: the shim's
 * charge on GPU 0, the "name=rc:charged" reply, and an allocation node. Include after cuda_abi.h. */
#ifndef KUBE_VGPU_GRAPH_PROG_H
#define KUBE_VGPU_GRAPH_PROG_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

CUresult cuGraphAddMemAllocNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *);

/* Bytes the shim charges on GPU 0 (its vgpu_get_usage), or (unsigned long long)-1 without the shim. */
static inline unsigned long long charged(void)
{
    int (*get)(int, uint64_t *, uint64_t *) = (int (*)(int, uint64_t *, uint64_t *))dlsym(RTLD_DEFAULT,
                                                                                          "vgpu_get_usage");
    uint64_t used = 0;
    if (!get || get(0, &used, NULL) != 0)
        return (unsigned long long)-1;
    return (unsigned long long)used;
}

/* One step's reply: "name=rc:charged". */
static inline void show(const char *name, CUresult rc)
{
    printf("%s=%d:%llu\n", name, rc, charged());
}

/* An allocation node of `bytes` on GPU 0 after deps[0..n): its address in *dptr. */
static inline CUresult alloc_node(CUgraph g, const CUgraphNode *deps, size_t n, size_t bytes, CUgraphNode *node,
                                  CUdeviceptr *dptr)
{
    CUDA_MEM_ALLOC_NODE_PARAMS a;
    memset(&a, 0, sizeof a);
    a.poolProps.allocType = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    a.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.bytesize = bytes;
    CUresult rc = cuGraphAddMemAllocNode(node, g, n ? deps : NULL, n, &a);
    *dptr = a.dptr;
    return rc;
}

#endif
