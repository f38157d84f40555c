/* What the red-team programs (hostpid_redteam.c, ctxcost_redteam.c) share: the start of main() and
 * the replies of their common commands, and the driver calls these make. Include after cuda_abi.h. */
#ifndef KUBE_VGPU_REDTEAM_H
#define KUBE_VGPU_REDTEAM_H

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>

CUresult cuInit(unsigned int);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice);

/* The contexts the program created, by index (the "i=" of its replies). */
#define RT_MAXC 256
static CUcontext rt_ctx[RT_MAXC];
static int rt_nctx;

/* Keeps a context a creation returned (rc): its index, or -1 (failed, or the table is full). */
static inline int rt_keep(CUresult rc, CUcontext ctx)
{
    int i = rc == CUDA_SUCCESS && rt_nctx < RT_MAXC ? rt_nctx++ : -1;
    if (i >= 0)
        rt_ctx[i] = ctx;
    return i;
}

/* The commands on kept contexts and the primary context: "destroy I", "cur I", "primary DEV" (retain
 * and make current), "release DEV", "reset DEV". Returns 1 when cmd was one of them (it replied). */
static inline int rt_ctx_cmd(const char *cmd, const char *a)
{
    if (!strcmp(cmd, "destroy") || !strcmp(cmd, "cur")) {
        int i = atoi(a);
        CUcontext c = i >= 0 && i < rt_nctx ? rt_ctx[i] : NULL;
        CUresult rc = !strcmp(cmd, "destroy") ? cuCtxDestroy_v2(c) : cuCtxSetCurrent(c);
        printf("%s %s rc=%d\n", rc ? "fail" : "ok", cmd, rc);
    } else if (!strcmp(cmd, "primary")) {
        CUcontext c = NULL;
        CUresult rc = cuDevicePrimaryCtxRetain(&c, atoi(a));
        if (rc == CUDA_SUCCESS)
            cuCtxSetCurrent(c);
        printf("%s primary rc=%d\n", rc ? "fail" : "ok", rc);
    } else if (!strcmp(cmd, "release") || !strcmp(cmd, "reset")) {
        CUresult rc = !strcmp(cmd, "release") ? cuDevicePrimaryCtxRelease_v2(atoi(a))
                                              : cuDevicePrimaryCtxReset_v2(atoi(a));
        printf("%s %s rc=%d\n", rc ? "fail" : "ok", cmd, rc);
    } else {
        return 0;
    }
    return 1;
}

/* Whether thread tid is blocked in futex(2) (a lock held elsewhere): the first field of
 * /proc/self/task/TID/syscall. */
static inline int rt_in_futex(pid_t tid)
{
    char path[64], buf[128] = {0};
    snprintf(path, sizeof path, "/proc/self/task/%d/syscall", (int)tid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    int ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    return ok && atol(buf) == SYS_futex;
}

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
