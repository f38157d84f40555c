/*
 * Red-team driver for the shim's host-pid learning (tests/security/test_redteam_hostpid_probe.py).
 * Linked against the fake libcuda, run with the shim preloaded.
 *
 *   hostpid_redteam hold DEV     a neighbour: creates a context on DEV, prints "ready", holds it until
 *                                stdin closes.
 *   hostpid_redteam mimic DEV    a hostile neighbour: creates a context on DEV and, until stdin closes,
 *                                polls NVML's process list and, whenever another process's memory
 *                                rises, allocates as much at once (frees it when the other's falls), so
 *                                that a probing process sees this pid match its probe.
 *   hostpid_redteam steps        a tenant driven by commands on stdin, one a line, each answered by
 *                                one line on stdout ("ok CMD ..." or "fail CMD ..."):
 *       env K V        setenv (the fakes read their knobs at each call)
 *       ctx DEV        cuCtxCreate_v2 on DEV; says whether the new context is then current
 *       pop            cuCtxPopCurrent_v2; says whether it popped the last "ctx" context and the one
 *                      current before that is current again
 *       primary DEV    cuDevicePrimaryCtxRetain on DEV; says whether the current context is unchanged
 *       bgctx DEV      cuCtxCreate_v2 on DEV in a new thread (joined by "join")
 *       blockedctx DEV cuCtxCreate_v2 on DEV in a second new thread; answers once that thread waits
 *                      on a futex (a lock another thread holds); joined by "join"
 *       join           join the threads; says each one's result and whether its context was current
 *       threads N DEV  N threads create a context on DEV at once; says whether each kept its own current
 *       fork           fork; the child creates a context on device 0 (under alarm(20)) and exits;
 *                      answers with the child's exit status
 *       peak DEV       the most device memory this process held at once on DEV (fake hook), bytes
 *       meminfo        cuMemGetInfo_v2 in the current context (the shim answers from its accounting)
 *       quit
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "nvml_abi.h"
#include "redteam.h"

CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxGetCurrent(CUcontext *);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);

#define MAXT 64

struct job {
    pthread_t th;
    int dev;
    CUresult rc;
    CUcontext ctx, cur;
    pid_t tid;
};

static pthread_barrier_t g_bar;
static int g_use_bar;

static void *create_thread(void *arg)
{
    struct job *j = arg;
    __atomic_store_n(&j->tid, (pid_t)syscall(SYS_gettid), __ATOMIC_RELEASE);
    if (g_use_bar)
        pthread_barrier_wait(&g_bar);
    j->rc = cuCtxCreate_v2(&j->ctx, 0, j->dev);
    cuCtxGetCurrent(&j->cur);
    return NULL;
}

static void wait_stdin_closed(void)
{
    char line[64];
    while (fgets(line, sizeof line, stdin))
        ;
}

static int hold(int dev)
{
    CUcontext c;
    CUresult rc = cuCtxCreate_v2(&c, 0, dev);
    printf("ready rc=%d pid=%d\n", rc, (int)getpid());
    wait_stdin_closed();
    return rc == CUDA_SUCCESS ? 0 : 1;
}

static volatile int g_stop;

static void *stdin_watch(void *arg)
{
    (void)arg;
    wait_stdin_closed();
    __atomic_store_n(&g_stop, 1, __ATOMIC_RELEASE);
    return NULL;
}

static int mimic(int dev)
{
    typedef nvmlReturn_t (*init_fn)(void);
    typedef nvmlReturn_t (*handle_fn)(unsigned, nvmlDevice_t *);
    typedef nvmlReturn_t (*procs_fn)(nvmlDevice_t, unsigned *, nvmlProcessInfo_t *);
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    init_fn init = lib ? (init_fn)dlsym(lib, "nvmlInit_v2") : NULL;
    handle_fn handle = lib ? (handle_fn)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2") : NULL;
    procs_fn procs = lib ? (procs_fn)dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3") : NULL;
    nvmlDevice_t h;
    CUcontext c;
    if (!init || !handle || !procs || init() != NVML_SUCCESS || handle((unsigned)dev, &h) != NVML_SUCCESS ||
        cuCtxCreate_v2(&c, 0, dev) != CUDA_SUCCESS) {
        printf("ready rc=1\n");
        return 1;
    }
    pthread_t w;
    pthread_create(&w, NULL, stdin_watch, NULL);
    printf("ready rc=0 pid=%d\n", (int)getpid());
    static nvmlProcessInfo_t buf[256];
    static unsigned seen_pid[256];
    static unsigned long long seen_used[256], held_size[256];
    static CUdeviceptr held[256];
    unsigned nseen = 0;
    long mimicked = 0;
    while (!__atomic_load_n(&g_stop, __ATOMIC_ACQUIRE)) {
        unsigned n = 256;
        if (procs(h, &n, buf) != NVML_SUCCESS)
            continue;
        for (unsigned i = 0; i < n; i++) {
            if (buf[i].pid == (unsigned)getpid())
                continue;
            unsigned k = 0;
            while (k < nseen && seen_pid[k] != buf[i].pid)
                k++;
            if (k == nseen) {
                if (nseen == 256)
                    continue;
                seen_pid[nseen] = buf[i].pid;
                seen_used[nseen++] = buf[i].usedGpuMemory;
                continue;
            }
            unsigned long long u = buf[i].usedGpuMemory;
            if (u > seen_used[k] && !held[k]) { /* it rose: copy the rise */
                held_size[k] = u - seen_used[k];
                if (cuMemAlloc_v2(&held[k], held_size[k]) != CUDA_SUCCESS)
                    held[k] = 0;
                else
                    mimicked++;
            } else if (u < seen_used[k] && held[k]) {
                cuMemFree_v2(held[k]);
                held[k] = 0;
            }
            seen_used[k] = u;
        }
    }
    printf("mimicked=%ld\n", mimicked);
    return 0;
}

static int steps(void)
{
    char line[256];
    struct job jobs[MAXT];
    int nj = 0;
    CUcontext last = NULL, prev = NULL; /* the last "ctx" context, and the one current before it */
    memset(jobs, 0, sizeof jobs);
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
            CUcontext c = NULL, cur = NULL;
            cuCtxGetCurrent(&prev);
            CUresult rc = cuCtxCreate_v2(&c, 0, atoi(a));
            last = c;
            cuCtxGetCurrent(&cur);
            printf("%s ctx rc=%d current_is_new=%d\n", rc ? "fail" : "ok", rc, rc == 0 && cur == c);
        } else if (!strcmp(cmd, "pop")) {
            CUcontext popped = NULL, cur = NULL;
            CUresult rc = cuCtxPopCurrent_v2(&popped);
            cuCtxGetCurrent(&cur);
            printf("%s pop rc=%d popped_last=%d prev_current=%d\n", rc ? "fail" : "ok", rc, popped == last,
                   cur == prev);
        } else if (!strcmp(cmd, "primary")) {
            CUcontext c = NULL, before = NULL, after = NULL;
            cuCtxGetCurrent(&before);
            CUresult rc = cuDevicePrimaryCtxRetain(&c, atoi(a));
            cuCtxGetCurrent(&after);
            printf("%s primary rc=%d current_unchanged=%d\n", rc ? "fail" : "ok", rc, before == after);
        } else if (!strcmp(cmd, "bgctx") || !strcmp(cmd, "blockedctx")) {
            struct job *j = &jobs[nj++];
            j->dev = atoi(a);
            pthread_create(&j->th, NULL, create_thread, j);
            if (!strcmp(cmd, "blockedctx")) {
                pid_t tid;
                while (!(tid = __atomic_load_n(&j->tid, __ATOMIC_ACQUIRE)) || !rt_in_futex(tid))
                    sched_yield();
            }
            printf("ok %s\n", cmd);
        } else if (!strcmp(cmd, "threads")) {
            int n = atoi(a);
            if (n < 1 || n > MAXT - nj)
                n = 1;
            g_use_bar = 1;
            pthread_barrier_init(&g_bar, NULL, (unsigned)n);
            for (int i = 0; i < n; i++) {
                jobs[nj + i].dev = atoi(b);
                pthread_create(&jobs[nj + i].th, NULL, create_thread, &jobs[nj + i]);
            }
            int good = 0;
            for (int i = 0; i < n; i++) {
                pthread_join(jobs[nj + i].th, NULL);
                good += jobs[nj + i].rc == CUDA_SUCCESS && jobs[nj + i].cur == jobs[nj + i].ctx;
            }
            g_use_bar = 0;
            pthread_barrier_destroy(&g_bar);
            printf("ok threads n=%d own_current=%d\n", n, good);
        } else if (!strcmp(cmd, "join")) {
            int good = 0;
            for (int i = 0; i < nj; i++) {
                pthread_join(jobs[i].th, NULL);
                good += jobs[i].rc == CUDA_SUCCESS && jobs[i].cur == jobs[i].ctx;
            }
            printf("ok join n=%d own_current=%d\n", nj, good);
            nj = 0;
            memset(jobs, 0, sizeof jobs);
        } else if (!strcmp(cmd, "fork")) {
            fflush(stdout);
            pid_t child = fork();
            if (child == 0) {
                alarm(20);
                setenv("FAKE_CUDA_CTX_RENDEZVOUS", "0", 1);
                CUcontext c;
                CUresult rc = cuCtxCreate_v2(&c, 0, 0);
                _exit(rc == CUDA_SUCCESS ? 0 : 3);
            }
            int st = 0;
            while (waitpid(child, &st, 0) < 0 && errno == EINTR)
                ;
            printf("ok fork exited=%d status=%d signal=%d\n", WIFEXITED(st), WIFEXITED(st) ? WEXITSTATUS(st) : -1,
                   WIFSIGNALED(st) ? WTERMSIG(st) : 0);
        } else if (!strcmp(cmd, "meminfo")) {
            rt_meminfo();
        } else if (!strcmp(cmd, "peak")) {
            typedef unsigned long long (*peak_fn)(int);
            peak_fn f = (peak_fn)dlsym(RTLD_DEFAULT, "fake_cuda_debug_peak_bytes");
            printf("ok peak bytes=%llu\n", f ? f(atoi(a)) : 0ull);
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
        return hold(atoi(argv[2]));
    if (argc >= 3 && !strcmp(argv[1], "mimic"))
        return mimic(atoi(argv[2]));
    if (argc >= 2 && !strcmp(argv[1], "steps"))
        return steps();
    fprintf(stderr, "usage: %s hold DEV | mimic DEV | steps\n", argv[0]);
    return 2;
}
