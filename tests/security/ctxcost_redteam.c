/*
 * Red-team driver for the shim's context cost (tests/security/test_redteam_ctxcost.py).
 * Linked against the fake libcuda, run with the shim preloaded.
 *
 *   ctxcost_redteam hold DEV     a neighbour: creates a context on DEV, prints "ready", holds it until
 *                                stdin closes.
 *   ctxcost_redteam hold DEV BYTES  the same, and allocates BYTES in its context before "ready".
 *   ctxcost_redteam steps        a tenant driven by commands on stdin, one a line, each answered by one
 *                                line on stdout ("ok CMD ..." or "fail CMD ..."):
 *       env K V        setenv (the fakes read their knobs at each call)
 *       ctx DEV [V]    cuCtxCreate (V = v1, v2 (default), v3, v4) on DEV; the context gets the next index
 *       destroy I      cuCtxDestroy_v2 of context I
 *       cur I          cuCtxSetCurrent of context I
 *       primary DEV    cuDevicePrimaryCtxRetain on DEV and make it current
 *       release DEV    cuDevicePrimaryCtxRelease_v2
 *       reset DEV      cuDevicePrimaryCtxReset_v2
 *       bgctx DEV      cuCtxCreate_v2 on DEV in a new thread (answers at once; "join" joins it, and the
 *                      context gets the next index)
 *       join           join the thread; says its result
 *       alloc BYTES    cuMemAlloc_v2 in the current context (kept: freed with its context)
 *       vmm DEV BYTES  cuMemCreate of BYTES located on DEV (from the current context, whatever its device)
 *       vmmrelease     cuMemRelease of the last "vmm" handle (never mapped: its memory goes at once)
 *       fork DEV       fork; the child creates a context on DEV, answers "child used=U total=T" from
 *                      cuMemGetInfo_v2 and exits (exit(3)); the parent answers with the child's exit status
 *       meminfo        cuMemGetInfo_v2 in the current context (the shim answers from its accounting)
 *       own DEV        what NVML shows this process using on DEV (its process list), bytes
 *       quit
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "nvml_abi.h"
#include "redteam.h"

CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice);
CUresult cuCtxCreate(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxCreate_v3(CUcontext *, CUexecAffinityParam *, int, unsigned int, CUdevice);
CUresult cuCtxCreate_v4(CUcontext *, CUctxCreateParams *, unsigned int, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);


static CUmemGenericAllocationHandle g_vmm;

struct job {
    pthread_t th;
    int dev, on;
    CUresult rc;
    CUcontext ctx;
};

static void *create_thread(void *arg)
{
    struct job *j = arg;
    j->rc = cuCtxCreate_v2(&j->ctx, 0, j->dev);
    return NULL;
}

static void wait_stdin_closed(void)
{
    char line[64];
    while (fgets(line, sizeof line, stdin))
        ;
}

static int hold(int dev, unsigned long long bytes)
{
    CUcontext c;
    CUdeviceptr p;
    CUresult rc = cuCtxCreate_v2(&c, 0, dev);
    if (rc == CUDA_SUCCESS && bytes)
        rc = cuMemAlloc_v2(&p, bytes);
    printf("ready rc=%d pid=%d\n", rc, (int)getpid());
    wait_stdin_closed();
    return rc == CUDA_SUCCESS ? 0 : 1;
}

/* What NVML lists this process using on dev (0 if not listed, -1 if NVML cannot say). */
static long long own_used(int dev)
{
    typedef nvmlReturn_t (*init_fn)(void);
    typedef nvmlReturn_t (*handle_fn)(unsigned, nvmlDevice_t *);
    typedef nvmlReturn_t (*procs_fn)(nvmlDevice_t, unsigned *, nvmlProcessInfo_t *);
    static nvmlProcessInfo_t buf[1024];
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    init_fn init = lib ? (init_fn)dlsym(lib, "nvmlInit_v2") : NULL;
    handle_fn handle = lib ? (handle_fn)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2") : NULL;
    procs_fn procs = lib ? (procs_fn)dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3") : NULL;
    nvmlDevice_t h;
    unsigned n = 1024;
    if (!init || !handle || !procs || init() != NVML_SUCCESS || handle((unsigned)dev, &h) != NVML_SUCCESS ||
        procs(h, &n, buf) != NVML_SUCCESS)
        return -1;
    for (unsigned i = 0; i < n; i++)
        if (buf[i].pid == (unsigned)getpid())
            return (long long)buf[i].usedGpuMemory;
    return 0;
}

static CUresult create(const char *ver, int dev, CUcontext *c)
{
    if (!strcmp(ver, "v1"))
        return cuCtxCreate(c, 0, dev);
    if (!strcmp(ver, "v3"))
        return cuCtxCreate_v3(c, NULL, 0, 0, dev);
    if (!strcmp(ver, "v4")) {
        CUctxCreateParams p;
        memset(&p, 0, sizeof p);
        return cuCtxCreate_v4(c, &p, 0, dev);
    }
    return cuCtxCreate_v2(c, 0, dev);
}

static int steps(void)
{
    char line[256];
    struct job job;
    memset(&job, 0, sizeof job);
    while (fgets(line, sizeof line, stdin)) {
        char cmd[32] = {0}, a[128] = {0}, b[128] = {0};
        if (sscanf(line, "%31s %127s %127s", cmd, a, b) < 1)
            continue;
        if (!strcmp(cmd, "quit"))
            break;
        if (!strcmp(cmd, "env")) {
            setenv(a, b, 1);
            printf("ok env %s=%s\n", a, b);
        } else if (!strcmp(cmd, "ctx")) {
            CUcontext c = NULL;
            CUresult rc = create(b[0] ? b : "v2", atoi(a), &c);
            int i = rt_keep(rc, c);
            printf("%s ctx rc=%d i=%d\n", rc ? "fail" : "ok", rc, i);
        } else if (rt_ctx_cmd(cmd, a)) {
            /* replied */
        } else if (!strcmp(cmd, "bgctx")) {
            job.dev = atoi(a);
            job.on = 1;
            pthread_create(&job.th, NULL, create_thread, &job);
            printf("ok bgctx\n");
        } else if (!strcmp(cmd, "join")) {
            if (job.on) {
                pthread_join(job.th, NULL);
                job.on = 0;
            }
            int i = rt_keep(job.rc, job.ctx);
            printf("%s join rc=%d i=%d\n", job.rc ? "fail" : "ok", job.rc, i);
        } else if (!strcmp(cmd, "alloc")) {
            CUdeviceptr p = 0;
            CUresult rc = cuMemAlloc_v2(&p, strtoull(a, NULL, 10));
            printf("%s alloc rc=%d\n", rc ? "fail" : "ok", rc);
        } else if (!strcmp(cmd, "vmm")) {
            CUmemAllocationProp prop;
            memset(&prop, 0, sizeof prop);
            prop.type = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
            prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            prop.location.id = atoi(a);
            CUresult rc = cuMemCreate(&g_vmm, strtoull(b, NULL, 10), &prop, 0);
            printf("%s vmm rc=%d\n", rc ? "fail" : "ok", rc);
        } else if (!strcmp(cmd, "vmmrelease")) {
            CUresult rc = cuMemRelease(g_vmm);
            printf("%s vmmrelease rc=%d\n", rc ? "fail" : "ok", rc);
        } else if (!strcmp(cmd, "fork")) {
            fflush(stdout);
            pid_t child = fork();
            if (child == 0) {
                alarm(20);
                CUcontext c;
                size_t fr = 0, tot = 0;
                CUresult rc = cuCtxCreate_v2(&c, 0, atoi(a));
                if (rc == CUDA_SUCCESS)
                    rc = cuMemGetInfo_v2(&fr, &tot);
                printf("child used=%zu total=%zu\n", tot - fr, tot);
                exit(rc == CUDA_SUCCESS ? 0 : 3); /* as a program ends: the shim gives its slot back */
            }
            int st = 0;
            while (waitpid(child, &st, 0) < 0 && errno == EINTR)
                ;
            printf("ok fork exited=%d status=%d\n", WIFEXITED(st), WIFEXITED(st) ? WEXITSTATUS(st) : -1);
        } else if (!strcmp(cmd, "meminfo")) {
            rt_meminfo();
        } else if (!strcmp(cmd, "own")) {
            printf("ok own bytes=%lld\n", own_used(atoi(a)));
        } else {
            printf("fail unknown %s\n", cmd);
        }
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (rt_start() != 0)
        return 2;
    if (argc >= 3 && !strcmp(argv[1], "hold"))
        return hold(atoi(argv[2]), argc >= 4 ? strtoull(argv[3], NULL, 10) : 0);
    if (argc >= 2 && !strcmp(argv[1], "steps"))
        return steps();
    fprintf(stderr, "usage: %s hold DEV [BYTES] | steps\n", argv[0]);
    return 2;
}
