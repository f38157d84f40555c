/*
 * SM (compute) limit: a token bucket per device, in units of thread blocks, throttles kernel
 * launches (cuLaunchKernel, cuLaunchKernelEx, cuLaunchCooperativeKernel, cuGraphLaunch, and their
 * _ptsz forms).  A background thread samples utilisation through NVML every
 * LIBVGPU_SM_PERIOD_MS (default 100 ms) and sets the refill rate:
 *
 *   cost  = GPU time per block, estimated as (own busy fraction * period) / blocks launched
 *   share = limit - (container busy - own busy) + integral correction
 *   rate  = share / cost   blocks per ns
 *
 * Own busy time comes from nvmlDeviceGetProcessUtilization for this container's pids (the
 * processes in the shared region); if per-process figures are unavailable, from the device's
 * utilisation.  The integral term corrects the residual error while launches are being held back.
 * With no SM limit the launch hooks are a single predictable branch in front of the driver.
 */
#include "vgpu.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BURST_NS 10000000.0 /* bucket depth: 10 ms of budget */
/* Task priority (a low-priority process yields to busy neighbours): GPU busy fraction of the others above
 * which it yields, the headroom it leaves them to grow into, and the share it always keeps. */
#define PRIO_BUSY 0.02
#define PRIO_HEADROOM 0.10
#define PRIO_FLOOR 0.02

struct smdev {
    pthread_mutex_t mu;
    int limit;
    double tokens;
    double rate; /* blocks per ns */
    double cost; /* GPU ns per block */
    double integ;
    uint64_t last_ns;
    uint64_t launched; /* blocks, atomic */
    int throttled;     /* a launch waited since the last sample */
    int have_cost;
    int prio_only;     /* no SM limit: limited only to yield to busier neighbours (low priority) */
    /* sampler state */
    uint64_t prev_launched, prev_ns, prev_rt_us;
    nvmlDevice_t nvh;
    int nvh_state; /* 0 unknown, 1 ok, -1 unavailable */
};

static struct smdev g_sm[VGPU_MAX_DEV];
static int g_pid_match;

static uint64_t realtime_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000ull;
}

static void sleep_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    nanosleep(&ts, NULL);
}

static void refill_locked(struct smdev *d, uint64_t now)
{
    if (now > d->last_ns) {
        d->tokens += d->rate * (double)(now - d->last_ns);
        d->last_ns = now;
    }
    double burst = d->rate * BURST_NS;
    if (burst < 1.0)
        burst = 1.0;
    if (d->tokens > burst)
        d->tokens = burst;
}

void limiter_throttle(uint64_t blocks, CUstream s)
{
    CUdevice dev;
    if (current_device(&dev, NULL) || dev >= VGPU_MAX_DEV)
        return;
    struct smdev *d = &g_sm[dev];
    if (!d->limit)
        return;
    if (real_cuStreamIsCapturing) {
        int st = 0;
        if (real_cuStreamIsCapturing(s, &st) == CUDA_SUCCESS && st == CU_STREAM_CAPTURE_STATUS_ACTIVE)
            return; /* recorded into a graph, charged when the graph is launched */
    }
    if (!blocks)
        blocks = 1;
    for (;;) {
        pthread_mutex_lock(&d->mu);
        refill_locked(d, now_ns());
        if (d->tokens >= 0) {
            d->tokens -= (double)blocks;
            pthread_mutex_unlock(&d->mu);
            __atomic_fetch_add(&d->launched, blocks, __ATOMIC_RELAXED);
            return;
        }
        double wait = d->rate > 0 ? -d->tokens / d->rate : 1e6;
        d->throttled = 1;
        pthread_mutex_unlock(&d->mu);
        if (wait > 50e6)
            wait = 50e6;
        if (wait < 20e3)
            wait = 20e3;
        sleep_ns((uint64_t)wait);
    }
}

/* ------------------------------------------------------------------ sampling */
static int nvml_handle(int dev, nvmlDevice_t *out)
{
    return vgpu_nvml_of_dev(dev, out);
}

/* Busy fractions over [since_us, now]: of this process (self), of the whole container (all), and the
 * busy fraction a low-priority process yields to (yield): every process on the GPU that is not a
 * low-priority process of this container — other containers' processes (whose priority cannot be seen
 * from here) and this container's high-priority ones. Returns 0 when NVML has no sample for the window
 * yet (no information), 1 otherwise. */
static int measure(struct smdev *d, uint64_t since_us, uint64_t blocks, double *self, double *all, double *yield)
{
    *self = *all = *yield = 0;
    if (g_nvml.proc_util) {
        nvmlProcessUtilizationSample_t buf[256];
        unsigned n = 256;
        nvmlReturn_t rc = g_nvml.proc_util(d->nvh, buf, &n, since_us);
        if (rc == NVML_ERROR_NOT_FOUND)
            return 0; /* no sample since since_us */
        if (rc == NVML_SUCCESS) {
            int pids[256], prio[256], np = 0, me = vgpu_host_pid();
            region_procs(pids, prio, &np, 256);
            double s = 0, a = 0, y = 0;
            int matched = 0;
            for (unsigned i = 0; i < n && i < 256; i++) {
                int p = (int)buf[i].pid, k;
                for (k = 0; k < np && pids[k] != p; k++) {
                }
                if (k < np) {
                    a += buf[i].smUtil;
                    if (p == me)
                        s += buf[i].smUtil;
                    else if (prio[k] == 0)
                        y += buf[i].smUtil; /* a high-priority process of this container */
                    matched = 1;
                } else {
                    y += buf[i].smUtil; /* another container's process */
                }
            }
            if (matched)
                g_pid_match = 1;
            if (matched || g_pid_match || blocks == 0) {
                *self = s / 100.0;
                *all = a / 100.0;
                *yield = y / 100.0;
                return 1;
            }
            /* our pids are not NVML's (pid namespace): fall through to device utilisation */
        }
    }
    nvmlUtilization_t u;
    if (g_nvml.util && g_nvml.util(d->nvh, &u) == NVML_SUCCESS) {
        *self = *all = u.gpu / 100.0; /* nothing can be told apart: no yielding */
        return 1;
    }
    return 0;
}

static void update(struct smdev *d)
{
    uint64_t now = now_ns(), rt = realtime_us();
    uint64_t launched = __atomic_load_n(&d->launched, __ATOMIC_RELAXED);
    uint64_t blocks = launched - d->prev_launched;
    uint64_t dt = now - d->prev_ns;
    double self, all, yield;
    if (!measure(d, d->prev_rt_us, blocks, &self, &all, &yield) && dt < 1000000000ull)
        return; /* no sample yet: keep the window open (up to 1 s), then treat it as idle */
    d->prev_launched = launched;
    d->prev_ns = now;
    d->prev_rt_us = rt;
    if (dt == 0)
        return;
    double L = d->limit / 100.0;
    pthread_mutex_lock(&d->mu);
    if (blocks > 0) {
        if (self > 0.005) {
            double c = self * (double)dt / (double)blocks;
            d->cost = d->have_cost ? 0.5 * d->cost + 0.5 * c : c;
            d->have_cost = 1;
        } else {
            d->cost *= 0.5; /* launches left no trace: blocks are cheaper than assumed */
            if (d->cost < 0.01)
                d->cost = 0.01;
        }
    }
    /* Low priority: while others are busy, keep at most what they leave, minus headroom for them to grow
     * into (they are throttled by their own limits only, so they take the GPU back within a few periods). */
    double cap = 1.0;
    if (g_cfg.sm_yield && yield > PRIO_BUSY) {
        cap = 1.0 - yield - PRIO_HEADROOM;
        if (cap < PRIO_FLOOR)
            cap = PRIO_FLOOR;
    }
    int yielding = cap < L - (all - self);
    /* integral correction only while the bucket is the bottleneck (anti-windup), never while yielding */
    if (yielding) {
        d->integ *= 0.5;
    } else if (d->throttled || all > L) {
        d->integ += 0.3 * (L - all);
        if (d->integ > 0.5 * L)
            d->integ = 0.5 * L;
        if (d->integ < -0.5 * L)
            d->integ = -0.5 * L;
    }
    d->throttled = 0;
    double share = L - (all - self) + d->integ;
    if (share < 0.02 * L)
        share = 0.02 * L;
    if (share > cap)
        share = cap;
    if (share > 1.0)
        share = 1.0;
    d->rate = share / d->cost;
    pthread_mutex_unlock(&d->mu);
    LOG_DEBUG("sm: limit %d%% self %.1f%% container %.1f%% yield-to %.1f%% blocks %llu cost %.1fns rate %.3g/ms",
              d->limit, self * 100, all * 100, yield * 100, (unsigned long long)blocks, d->cost, d->rate * 1e6);
}

static void *sampler(void *arg)
{
    (void)arg;
    int nvml = vgpu_nvml_load();
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        struct smdev *d = &g_sm[i];
        if (!d->limit)
            continue;
        d->nvh_state = nvml && nvml_handle(i, &d->nvh) == 0 ? 1 : -1;
        if (d->nvh_state < 0 && d->prio_only) {
            d->limit = 0; /* nothing to yield to that can be seen: run unthrottled */
            continue;
        }
        if (d->nvh_state < 0)
            LOG_DEBUG("device %d: no NVML handle; SM limit uses the initial cost estimate", i);
        d->prev_ns = now_ns();
        d->prev_rt_us = realtime_us();
    }
    if (!nvml) {
        LOG_WARN("NVML unavailable: SM limit enforced with the initial cost estimate only");
        return NULL;
    }
    uint64_t period = (uint64_t)g_cfg.sm_period_ms * 1000000ull;
    for (;;) {
        sleep_ns(period);
        for (int i = 0; i < VGPU_MAX_DEV; i++)
            if (g_sm[i].limit && g_sm[i].nvh_state > 0)
                update(&g_sm[i]);
    }
    return NULL;
}

void limiter_start(void)
{
    uint64_t now = now_ns();
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        struct smdev *d = &g_sm[i];
        pthread_mutex_init(&d->mu, NULL);
        d->limit = g_cfg.sm_limit[i];
        /* low priority without an SM limit: limited to 100 % so it can yield (the container's GPUs only) */
        if (!d->limit && g_cfg.sm_yield && (g_cfg.nuuid == 0 || i < g_cfg.nuuid)) {
            d->limit = 100;
            d->prio_only = 1;
        }
        d->cost = 1000.0; /* initial guess: 1 us of GPU time per block */
        d->rate = d->limit / 100.0 / d->cost;
        d->tokens = 1.0;
        d->last_ns = now;
        if (d->limit)
            LOG_INFO("device %d: SM limit %d%%", i, d->limit);
    }
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the sampler never takes the program's signals */
    if (pthread_create(&t, &a, sampler, NULL) != 0)
        LOG_ERROR("cannot start the utilisation sampler; SM limit uses the initial cost estimate");
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&a);
}

/* ------------------------------------------------------------------ launch hooks */
#define LAUNCH_HOOK(name, blocks, stream, params, args)       \
    EXPORT CUresult name params                                \
    {                                                          \
        ensure_cuda();                                         \
        if (UNLIKELY(!real_##name))                            \
            return CUDA_ERROR_NOT_INITIALIZED;                 \
        if (UNLIKELY(g_sm_active))                             \
            limiter_throttle(blocks, stream);                  \
        return real_##name args;                               \
    }

LAUNCH_HOOK(cuLaunchKernel, (uint64_t)gx * gy * gz, s,
            (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
             unsigned int bz, unsigned int shmem, CUstream s, void **params, void **extra),
            (f, gx, gy, gz, bx, by, bz, shmem, s, params, extra))
LAUNCH_HOOK(cuLaunchKernel_ptsz, (uint64_t)gx * gy * gz, s,
            (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
             unsigned int bz, unsigned int shmem, CUstream s, void **params, void **extra),
            (f, gx, gy, gz, bx, by, bz, shmem, s, params, extra))
LAUNCH_HOOK(cuLaunchCooperativeKernel, (uint64_t)gx * gy * gz, s,
            (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
             unsigned int bz, unsigned int shmem, CUstream s, void **params),
            (f, gx, gy, gz, bx, by, bz, shmem, s, params))
LAUNCH_HOOK(cuLaunchCooperativeKernel_ptsz, (uint64_t)gx * gy * gz, s,
            (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
             unsigned int bz, unsigned int shmem, CUstream s, void **params),
            (f, gx, gy, gz, bx, by, bz, shmem, s, params))
LAUNCH_HOOK(cuLaunchKernelEx, config ? (uint64_t)config->gridDimX * config->gridDimY * config->gridDimZ : 1,
            config ? config->hStream : NULL,
            (const CUlaunchConfig *config, CUfunction f, void **params, void **extra), (config, f, params, extra))
LAUNCH_HOOK(cuLaunchKernelEx_ptsz, config ? (uint64_t)config->gridDimX * config->gridDimY * config->gridDimZ : 1,
            config ? config->hStream : NULL,
            (const CUlaunchConfig *config, CUfunction f, void **params, void **extra), (config, f, params, extra))

/* ------------------------------------------------------------------ graphs */
static uint64_t graph_blocks(CUgraph g)
{
    size_t n = 0;
    if (!real_cuGraphGetNodes || !real_cuGraphNodeGetType || !real_cuGraphKernelNodeGetParams ||
        real_cuGraphGetNodes(g, NULL, &n) != CUDA_SUCCESS || n == 0)
        return 0;
    CUgraphNode *nodes = calloc(n, sizeof *nodes);
    if (!nodes)
        return 0;
    uint64_t blocks = 0;
    if (real_cuGraphGetNodes(g, nodes, &n) == CUDA_SUCCESS) {
        for (size_t i = 0; i < n; i++) {
            int type = -1;
            CUDA_KERNEL_NODE_PARAMS p;
            memset(&p, 0, sizeof p);
            if (real_cuGraphNodeGetType(nodes[i], &type) == CUDA_SUCCESS && type == CU_GRAPH_NODE_TYPE_KERNEL &&
                real_cuGraphKernelNodeGetParams(nodes[i], &p) == CUDA_SUCCESS)
                blocks += (uint64_t)p.gridDimX * p.gridDimY * p.gridDimZ;
        }
    }
    free(nodes);
    return blocks;
}

static void graph_record(CUgraphExec exec, CUgraph g)
{
    uint64_t blocks = graph_blocks(g);
    track_put(TK_GRAPHEXEC, (uint64_t)(uintptr_t)exec, blocks ? blocks : 1, 0, NULL);
}

EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, unsigned long long flags)
{
    ensure_cuda();
    if (!real_cuGraphInstantiateWithFlags)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real_cuGraphInstantiateWithFlags(exec, graph, flags);
    if (rc == CUDA_SUCCESS && g_sm_active && exec)
        graph_record(*exec, graph);
    return rc;
}

EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *exec, CUgraph graph, CUgraphNode *err, char *log, size_t logsz)
{
    ensure_cuda();
    if (!real_cuGraphInstantiate_v2)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real_cuGraphInstantiate_v2(exec, graph, err, log, logsz);
    if (rc == CUDA_SUCCESS && g_sm_active && exec)
        graph_record(*exec, graph);
    return rc;
}

EXPORT CUresult cuGraphExecDestroy(CUgraphExec exec)
{
    ensure_cuda();
    if (!real_cuGraphExecDestroy)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (g_sm_active) {
        uint64_t s;
        int d;
        track_take(TK_GRAPHEXEC, (uint64_t)(uintptr_t)exec, &s, &d);
    }
    return real_cuGraphExecDestroy(exec);
}

static uint64_t exec_blocks(CUgraphExec exec)
{
    uint64_t b = 1;
    int d;
    track_get(TK_GRAPHEXEC, (uint64_t)(uintptr_t)exec, &b, &d);
    return b;
}

EXPORT CUresult cuGraphLaunch(CUgraphExec exec, CUstream s)
{
    ensure_cuda();
    if (UNLIKELY(!real_cuGraphLaunch))
        return CUDA_ERROR_NOT_INITIALIZED;
    if (UNLIKELY(g_sm_active))
        limiter_throttle(exec_blocks(exec), s);
    return real_cuGraphLaunch(exec, s);
}

EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream s)
{
    ensure_cuda();
    if (UNLIKELY(!real_cuGraphLaunch_ptsz))
        return CUDA_ERROR_NOT_INITIALIZED;
    if (UNLIKELY(g_sm_active))
        limiter_throttle(exec_blocks(exec), s);
    return real_cuGraphLaunch_ptsz(exec, s);
}
