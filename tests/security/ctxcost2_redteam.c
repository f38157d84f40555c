/*
 * Red-team driver for the shim's context cost, second round (tests/security/test_redteam_ctxcost2.py):
 * threads that retain the primary context together, retain/release and create/destroy loops, a fork
 * while another thread is inside a context creation. Linked against the fake libcuda, run with the
 * shim preloaded.
 *
 *   ctxcost2_redteam steps       a tenant driven by commands on stdin, one a line, each answered by one
 *                                line on stdout ("ok CMD ..." or "fail CMD ..."):
 *       env K V          setenv (the fakes read their knobs at each call)
 *       ctx DEV          cuCtxCreate_v2 on DEV; the context gets the next index
 *       destroy I        cuCtxDestroy_v2 of context I
 *       cur I            cuCtxSetCurrent of context I
 *       primary DEV      cuDevicePrimaryCtxRetain on DEV and make it current
 *       release DEV      cuDevicePrimaryCtxRelease_v2
 *       reset DEV        cuDevicePrimaryCtxReset_v2
 *       bg K OP DEV      in background thread K (0-7): OP = primary (cuDevicePrimaryCtxRetain), ctx
 *                        (cuCtxCreate_v2) or release (cuDevicePrimaryCtxRelease_v2) on DEV; answers at once
 *       blocked K        waits until thread K sleeps in a futex (a lock inside the shim) or has finished
 *       join K           joins thread K; says its result
 *       churn DEV T N    T threads each retain and release the primary context on DEV N times; answers
 *                        with the number of failed calls
 *       loop DEV N       N times: cuCtxCreate_v2 on DEV, cuMemAlloc_v2 of 1 MiB in it, cuCtxDestroy_v2
 *       fork DEV         fork; the child (without FAKE_CUDA_CTX_GATE) creates a context on DEV, answers
 *                        "child used=U" and exits; the parent answers with the child's exit status
 *       alloc BYTES      cuMemAlloc_v2 in the current context (kept: freed with its context)
 *       meminfo          cuMemGetInfo_v2 in the current context
 *       quit
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "redteam.h"

CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);

#define MAXT 8


struct job {
    pthread_t th;
    int on, dev, op; /* op: 0 primary, 1 ctx, 2 release */
    volatile pid_t tid;
    volatile int done;
    CUresult rc;
    CUcontext ctx;
};
static struct job g_job[MAXT];

static void *job_thread(void *arg)
{
    struct job *j = arg;
    __atomic_store_n(&j->tid, (pid_t)syscall(SYS_gettid), __ATOMIC_RELEASE);
    if (j->op == 0)
        j->rc = cuDevicePrimaryCtxRetain(&j->ctx, j->dev);
    else if (j->op == 1)
        j->rc = cuCtxCreate_v2(&j->ctx, 0, j->dev);
    else
        j->rc = cuDevicePrimaryCtxRelease_v2(j->dev);
    __atomic_store_n(&j->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

struct churn {
    pthread_t th;
    int dev, n, fails;
};

static void *churn_thread(void *arg)
{
    struct churn *c = arg;
    for (int i = 0; i < c->n; i++) {
        CUcontext ctx;
        if (cuDevicePrimaryCtxRetain(&ctx, c->dev) != CUDA_SUCCESS)
            c->fails++;
        else if (cuDevicePrimaryCtxRelease_v2(c->dev) != CUDA_SUCCESS)
            c->fails++;
    }
    return NULL;
}

static void steps(void)
{
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        char cmd[32] = {0}, a[128] = {0}, b[128] = {0}, c[128] = {0};
        if (sscanf(line, "%31s %127s %127s %127s", cmd, a, b, c) < 1)
            continue;
        if (!strcmp(cmd, "quit"))
            break;
        if (!strcmp(cmd, "env")) {
            setenv(a, b, 1);
            printf("ok env %s=%s\n", a, b);
        } else if (!strcmp(cmd, "ctx")) {
            CUcontext ctx = NULL;
            CUresult rc = cuCtxCreate_v2(&ctx, 0, atoi(a));
            int i = rt_keep(rc, ctx);
            printf("%s ctx rc=%d i=%d\n", rc ? "fail" : "ok", rc, i);
        } else if (rt_ctx_cmd(cmd, a)) {
            /* replied */
        } else if (!strcmp(cmd, "bg")) {
            int k = atoi(a);
            struct job *j = &g_job[k & (MAXT - 1)];
            memset(j, 0, sizeof *j);
            j->on = 1;
            j->op = !strcmp(b, "primary") ? 0 : !strcmp(b, "ctx") ? 1 : 2;
            j->dev = atoi(c);
            pthread_create(&j->th, NULL, job_thread, j);
            printf("ok bg\n");
        } else if (!strcmp(cmd, "blocked")) {
            struct job *j = &g_job[atoi(a) & (MAXT - 1)];
            pid_t tid;
            while (!(tid = __atomic_load_n(&j->tid, __ATOMIC_ACQUIRE)))
                sched_yield();
            while (!__atomic_load_n(&j->done, __ATOMIC_ACQUIRE) && !rt_in_futex(tid))
                sched_yield();
            printf("%s blocked\n", __atomic_load_n(&j->done, __ATOMIC_ACQUIRE) ? "fail" : "ok");
        } else if (!strcmp(cmd, "join")) {
            struct job *j = &g_job[atoi(a) & (MAXT - 1)];
            if (j->on) {
                pthread_join(j->th, NULL);
                j->on = 0;
            }
            int i = j->op == 1 ? rt_keep(j->rc, j->ctx) : -1;
            printf("%s join rc=%d i=%d\n", j->rc ? "fail" : "ok", j->rc, i);
        } else if (!strcmp(cmd, "churn")) {
            struct churn ch[MAXT];
            int t = atoi(b) > MAXT ? MAXT : atoi(b), fails = 0;
            for (int i = 0; i < t; i++) {
                ch[i] = (struct churn){.dev = atoi(a), .n = atoi(c)};
                pthread_create(&ch[i].th, NULL, churn_thread, &ch[i]);
            }
            for (int i = 0; i < t; i++) {
                pthread_join(ch[i].th, NULL);
                fails += ch[i].fails;
            }
            printf("%s churn fails=%d\n", fails ? "fail" : "ok", fails);
        } else if (!strcmp(cmd, "loop")) {
            int fails = 0, n = atoi(b);
            for (int i = 0; i < n; i++) {
                CUcontext ctx;
                CUdeviceptr p;
                if (cuCtxCreate_v2(&ctx, 0, atoi(a)) != CUDA_SUCCESS) {
                    fails++;
                    continue;
                }
                fails += cuMemAlloc_v2(&p, 1 << 20) != CUDA_SUCCESS;
                fails += cuCtxDestroy_v2(ctx) != CUDA_SUCCESS;
            }
            printf("%s loop fails=%d\n", fails ? "fail" : "ok", fails);
        } else if (!strcmp(cmd, "fork")) {
            fflush(stdout);
            pid_t child = fork();
            if (child == 0) {
                alarm(20);
                unsetenv("FAKE_CUDA_CTX_GATE");
                CUcontext ctx;
                size_t fr = 0, tot = 0;
                CUresult rc = cuCtxCreate_v2(&ctx, 0, atoi(a));
                if (rc == CUDA_SUCCESS)
                    rc = cuMemGetInfo_v2(&fr, &tot);
                printf("child used=%zu rc=%d\n", tot - fr, rc);
                exit(rc == CUDA_SUCCESS ? 0 : 3);
            }
            int st = 0;
            while (waitpid(child, &st, 0) < 0 && errno == EINTR)
                ;
            printf("ok fork exited=%d status=%d\n", WIFEXITED(st), WIFEXITED(st) ? WEXITSTATUS(st) : -1);
        } else if (!strcmp(cmd, "alloc")) {
            CUdeviceptr p = 0;
            CUresult rc = cuMemAlloc_v2(&p, strtoull(a, NULL, 10));
            printf("%s alloc rc=%d\n", rc ? "fail" : "ok", rc);
        } else if (!strcmp(cmd, "meminfo")) {
            rt_meminfo();
        } else {
            printf("fail unknown %s\n", cmd);
        }
    }
}

int main(int argc, char **argv)
{
    if (rt_start() != 0)
        return 2;
    if (argc >= 2 && !strcmp(argv[1], "steps")) {
        steps();
        return 0;
    }
    fprintf(stderr, "usage: %s steps\n", argv[0]);
    return 2;
}
