/* What the red-team programs (hostpid_redteam.c, ctxcost_redteam.c) share: the start of main() and
 * the replies of their common commands, and the driver calls these make. Include after cuda_abi.h. */
#ifndef KUBE_VGPU_REDTEAM_H
#define KUBE_VGPU_REDTEAM_H

#include <stddef.h>
#include <stdio.h>

CUresult cuInit(unsigned int);
CUresult cuMemGetInfo_v2(size_t *, size_t *);

/* Line-buffered replies and cuInit; 0, or -1 after replying "fail cuInit". */
static inline int rt_start(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (cuInit(0) != CUDA_SUCCESS) {
        printf("fail cuInit\n");
        return -1;
    }
    return 0;
}

/* "meminfo": cuMemGetInfo_v2 in the current context (the shim answers from its accounting). */
static inline void rt_meminfo(void)
{
    size_t fr = 0, tot = 0;
    CUresult rc = cuMemGetInfo_v2(&fr, &tot);
    printf("%s meminfo rc=%d used=%zu total=%zu\n", rc ? "fail" : "ok", rc, tot - fr, tot);
}

#endif
