/*
 * SM (compute) limit: a budget of GPU time per device, counted in thread blocks, throttles kernel
 * launches (cuLaunchKernel, cuLaunchKernelEx, cuLaunchCooperativeKernel, cuGraphLaunch, and their
 * _ptsz forms).  A background thread samples utilisation through NVML every
 * LIBVGPU_SM_PERIOD_MS (default 100 ms) and sets the refill rate:
 *
 *   cost  = GPU time per block, estimated as (own busy fraction * period) / blocks launched
 *   share = target - (container busy - own busy) + integral correction, capped for priority
 *   rate  = share / cost   blocks per ns
 *
 * target is the SM limit (strict), or in work-conserving mode whatever other containers leave idle
 * (never less than the limit). Own busy time comes from nvmlDeviceGetProcessUtilization for this
 * container's pids (the processes in the shared region); if per-process figures are unavailable,
 * from the device's utilisation.
 *
 * Launch path: one atomic subtraction from the budget (`credit`, in blocks). While the budget was not
 * in debt the launch goes on (it may overdraw); only a launch that finds debt takes the slow path,
 * which refills by elapsed time and sleeps until the debt is repaid. No clock read, lock or driver
 * call on the fast path.
 *
 * Real duration: a launch is charged blocks * cost, an estimate. Every sample replaces the estimates
 * of the period by the GPU time NVML measured for this process (refunding an over-estimate, charging
 * the rest as debt), so long kernels, kernels still running after the period of their launch, and a
 * change of kernel shape (a wrong cost per block) are charged what they really used.
 */
#include "vgpu.h"
#include "track.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BURST_NS 10000000.0 /* bucket depth: 10 ms of budget */
#define DEBT_NS 2000000000.0 /* the debt is kept below 2 s of budget */
#define STOP_NS 20000000.0   /* a measured overrun stops launches for at most 20 ms; the rest is deferred */
/* Task priority (a low-priority process yields to busy neighbours): GPU busy fraction of the others above
 * which it yields, the headroom it leaves them to grow into, and the share it always keeps. */
#define PRIO_BUSY 0.02
#define PRIO_HEADROOM 0.10
#define PRIO_FLOOR 0.02
/* Work-conserving mode: the idle capacity a bursting container leaves, so newcomers show up */
#define WC_HEADROOM 0.10

struct smdev {
    int64_t credit;    /* budget in 1/1024 blocks (atomic); launches subtract, refills and corrections add */
    int limit;
    int prio_only;     /* no SM limit: limited only to yield to busier neighbours (low priority) */
    char pad[64];      /* the launch path's line apart from the slow path's */
    pthread_mutex_t mu; /* slow path and sampler */
    double rate;       /* blocks per ns */
    double cost;       /* GPU ns per block */
    double integ;
    double deferred_ns; /* GPU time used beyond the budget, repaid by a lower rate (see update) */
    uint64_t last_ns;  /* last refill */
    int64_t added;     /* total added to credit (refills and corrections, 1/1024 blocks), under mu */
    int throttled;     /* a launch waited since the last sample */
    int have_cost;
    /* sampler state */
    int64_t prev_used; /* taken from the budget up to the previous sample (1/1024 blocks) */
    uint64_t prev_ns, prev_rt_us;
    nvmlDevice_t nvh;
    int nvh_state; /* 0 unknown, 1 ok, -1 unavailable */
};

static struct smdev g_sm[VGPU_MAX_DEV];
static int g_sm_active; /* launches are throttled: set once by limiter_init, before any launch hook runs */
static int g_pid_match;
/* The container GPU of every launch when the process sees exactly one device (no context lookup then);
 * -1: look it up per launch; -2: not known yet. */
static int g_only_dev = -2;

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

#define Q 1024.0 /* credit units per block */

/* The budget in blocks. */
static double credit_blocks(const struct smdev *d)
{
    return (double)__atomic_load_n(&d->credit, __ATOMIC_RELAXED) / Q;
}

/* Caller holds d->mu. Adds x blocks to the budget, keeping it within [-DEBT_NS, BURST_NS] of budget. */
static void credit_add_locked(struct smdev *d, double x)
{
    double c = credit_blocks(d);
    double full = d->limit / 100.0 / d->cost; /* blocks per ns at the limit (rate may be 0 while repaying) */
    double hi = d->rate * BURST_NS, lo = -full * DEBT_NS;
    if (hi < 1.0)
        hi = 1.0;
    if ((double)c + x > hi)
        x = hi - (double)c;
    if ((double)c + x < lo)
        x = lo - (double)c;
    x *= Q;
    if (x > 9e18 || x < -9e18)
        return;
    int64_t add = (int64_t)x;
    __atomic_add_fetch(&d->credit, add, __ATOMIC_RELAXED);
    d->added += add;
}

static void refill_locked(struct smdev *d, uint64_t now)
{
    if (now > d->last_ns) {
        double x = d->rate * (double)(now - d->last_ns);
        d->last_ns = now;
        credit_add_locked(d, x > 0 ? x : 0);
    }
}

static int only_device(void)
{
    int n = 0;
    CUdevice dev;
    int d = -1;
    if (real_cuDeviceGetCount && real_cuDeviceGetCount(&n) == CUDA_SUCCESS && n == 1 && !current_device(&dev, NULL))
        d = dev;
    __atomic_store_n(&g_only_dev, d, __ATOMIC_RELAXED);
    return d;
}

/* A launch found the budget in debt (its blocks are charged already): wait until the debt is repaid.
 * A launch into a stream being captured is recorded into a graph, not run: it never waits (the graph is
 * charged when launched; what this launch was charged is refunded at the next sample, which charges
 * only measured GPU time). */
static void throttle_slow(struct smdev *d, int64_t blocks, CUstream s)
{
    if (real_cuStreamIsCapturing) {
        int st = 0;
        if (real_cuStreamIsCapturing(s, &st) == CUDA_SUCCESS && st == CU_STREAM_CAPTURE_STATUS_ACTIVE)
            return;
    }
    for (;;) {
        pthread_mutex_lock(&d->mu);
        refill_locked(d, now_ns());
        double c = credit_blocks(d) + (double)blocks; /* as it was before this launch */
        if (c >= 0 || !d->limit) {
            pthread_mutex_unlock(&d->mu);
            return;
        }
        double wait = d->rate > 0 ? -c / d->rate : 1e6;
        d->throttled = 1;
        pthread_mutex_unlock(&d->mu);
        if (wait > 50e6)
            wait = 50e6;
        if (wait < 20e3)
            wait = 20e3;
        sleep_ns((uint64_t)wait);
    }
}

void limiter_throttle(uint64_t blocks, CUstream s)
{
    int dev = __atomic_load_n(&g_only_dev, __ATOMIC_RELAXED);
    if (UNLIKELY(dev < 0)) {
        CUdevice cd;
        if (dev == -2)
            dev = only_device();
        if (dev < 0) {
            if (current_device(&cd, NULL))
                return;
            dev = cd;
        }
    }
    if (UNLIKELY(dev >= VGPU_MAX_DEV))
        return;
    struct smdev *d = &g_sm[dev];
    if (!d->limit)
        return;
    int64_t b = blocks == 0 ? 1 : blocks > (1ull << 40) ? (int64_t)(1ull << 40) : (int64_t)blocks;
    if (LIKELY(__atomic_fetch_sub(&d->credit, b << 10, __ATOMIC_RELAXED) >= 0))
        return;
    throttle_slow(d, b, s);
}

/* ------------------------------------------------------------------ sampling */
static int nvml_handle(int dev, nvmlDevice_t *out)
{
    return vgpu_nvml_of_dev(dev, out);
}

/* Busy fractions over [since_us, now]: of this process (self), of the whole container (all), of other
 * containers' processes (foreign), and the busy fraction a low-priority process yields to (yield):
 * every process on the GPU that is not a low-priority process of this container — other containers'
 * processes (whose priority cannot be seen from here) and this container's high-priority ones. With a
 * limits file every process of the container has the file's priority, and the shared file (which its
 * processes can write) must not decide whom to yield to — a process that lists a neighbour's host pid
 * in it would stop yielding to that neighbour — so then it yields to every process but itself.
 * *exact: the figures are per process (host pids matched). Returns 0 when NVML has no sample for the
 * window yet (no information), 1 otherwise. */
static int measure(struct smdev *d, uint64_t since_us, uint64_t blocks, double *self, double *all, double *foreign,
                   double *yield, int *exact)
{
    *self = *all = *foreign = *yield = 0;
    *exact = 0;
    nvmlProcessUtilizationSample_t buf[256];
    unsigned n = 256;
    nvmlReturn_t rc = vnvml_process_utilization(d->nvh, buf, &n, since_us);
    if (rc == NVML_ERROR_NOT_FOUND)
        return 0; /* no sample since since_us */
    if (rc == NVML_SUCCESS) {
        int pids[256], prio[256], np = 0, me = vgpu_host_pid();
        region_procs(pids, prio, &np, 256);
        double s = 0, a = 0, f = 0, y = 0;
        int matched = 0;
        for (unsigned i = 0; i < n && i < 256; i++) {
            int p = (int)buf[i].pid, k;
            for (k = 0; k < np && pids[k] != p; k++) {
            }
            if (k < np) {
                a += buf[i].smUtil;
                if (p == me)
                    s += buf[i].smUtil;
                else if (vgpu_cfg->from_file || prio[k] == 0)
                    y += buf[i].smUtil; /* see below */
                matched = 1;
            } else {
                f += buf[i].smUtil; /* another container's process */
            }
        }
        if (matched)
            g_pid_match = 1;
        if (matched || g_pid_match || blocks == 0) {
            *self = s / 100.0;
            *all = a / 100.0;
            *foreign = f / 100.0;
            *yield = (f + y) / 100.0;
            *exact = g_pid_match;
            return 1;
        }
        /* our pids are not NVML's (pid namespace): fall through to device utilisation */
    }
    nvmlUtilization_t u;
    if (vnvml_utilization(d->nvh, &u) == NVML_SUCCESS) {
        *self = *all = u.gpu / 100.0; /* nothing can be told apart: no yielding, no bursting */
        return 1;
    }
    return 0;
}

static void update(struct smdev *d)
{
    uint64_t now = now_ns(), rt = realtime_us();
    pthread_mutex_lock(&d->mu);
    int64_t used = d->added - __atomic_load_n(&d->credit, __ATOMIC_RELAXED); /* taken so far */
    pthread_mutex_unlock(&d->mu);
    uint64_t blocks = used > d->prev_used ? (uint64_t)((double)(used - d->prev_used) / Q + 0.5) : 0;
    uint64_t dt = now - d->prev_ns;
    double self, all, foreign, yield;
    int exact;
    if (!measure(d, d->prev_rt_us, blocks, &self, &all, &foreign, &yield, &exact) && dt < 1000000000ull)
        return; /* no sample yet: keep the window open (up to 1 s), then treat it as idle */
    d->prev_used = used;
    d->prev_ns = now;
    d->prev_rt_us = rt;
    if (dt == 0)
        return;
    double L = d->limit / 100.0;
    pthread_mutex_lock(&d->mu);
    double old_cost = d->cost;
    if (blocks > 0) {
        double c = self * (double)dt / (double)blocks;
        if (self > 0.005) {
            /* smoothed, except after a change of kernel shape (off by more than 2x): take it at once */
            d->cost = d->have_cost && c < 2 * d->cost && c > 0.5 * d->cost ? 0.5 * d->cost + 0.5 * c : c;
            d->have_cost = 1;
        } else {
            d->cost *= 0.5; /* launches left no trace: blocks are cheaper than assumed */
            if (d->cost < 0.01)
                d->cost = 0.01;
        }
    }
    refill_locked(d, now); /* what accrued at the old rate, in blocks at the old cost */
    /* Charge the period what NVML measured for this process instead of the launches' estimates: refund
     * what was charged (its blocks) and charge the measured GPU time (in blocks at the period's cost).
     * Only with per-process figures (device-wide figures include other processes). */
    if (exact) {
        double x = (double)blocks - self * (double)dt / old_cost;
        double c = credit_blocks(d);
        if (x < 0) {
            /* A debt that would stop the process for more than STOP_NS (GPU time it used beyond its
             * estimates: a long kernel, a change of kernel shape) is deferred: repaid below by running at a
             * lower rate for a while rather than by stopping at once. Nothing is forgiven. */
            double room = c + d->limit / 100.0 / old_cost * STOP_NS, take = -x < room ? -x : room > 0 ? room : 0;
            d->deferred_ns += (-x - take) * old_cost;
            x = -take;
        } else if (d->deferred_ns > 0) { /* a refund first pays the deferred debt */
            double pay = x * old_cost < d->deferred_ns ? x * old_cost : d->deferred_ns;
            d->deferred_ns -= pay;
            x -= pay / old_cost;
        }
        credit_add_locked(d, x);
    }
    /* Target: the limit, or in work-conserving mode what the other containers leave (never less). */
    double target = L;
    int bursting = 0;
    if (vgpu_cfg->sm_conserving && exact && 1.0 - foreign - WC_HEADROOM > L) {
        target = 1.0 - foreign - WC_HEADROOM;
        bursting = 1;
    }
    /* Low priority: while others are busy, keep at most what they leave, minus headroom for them to grow
     * into (they are throttled by their own limits only, so they take the GPU back within a few periods). */
    double cap = 1.0;
    if (vgpu_cfg->sm_yield && yield > PRIO_BUSY) {
        cap = 1.0 - yield - PRIO_HEADROOM;
        if (cap < PRIO_FLOOR)
            cap = PRIO_FLOOR;
    }
    double base = target - (all - self);
    int yielding = cap < base;
    /* integral correction only without per-process figures (with them every period is charged what it
     * used), and only while the limit is the bottleneck (anti-windup) */
    if (yielding || bursting || exact) {
        d->integ *= 0.5;
    } else if (d->throttled || all > L) {
        d->integ += 0.3 * (L - all);
        if (d->integ > 0.5 * L)
            d->integ = 0.5 * L;
        if (d->integ < -0.5 * L)
            d->integ = -0.5 * L;
    }
    d->throttled = 0;
    double share = base + d->integ;
    if (share < 0.02 * L)
        share = 0.02 * L;
    if (share > cap)
        share = cap;
    if (share > 1.0)
        share = 1.0;
    if (d->deferred_ns > 0) { /* repay a deferred debt by a lower rate: a debt of x ms takes x % off */
        double r = d->deferred_ns / 1e9;
        if (r > share)
            r = share;
        share -= r;
        d->deferred_ns -= r * (double)dt;
        if (d->deferred_ns < 0)
            d->deferred_ns = 0;
    }
    d->rate = share / d->cost;
    if (d->cost != old_cost) { /* the budget is GPU time: keep it, in blocks at the new cost */
        double c = credit_blocks(d);
        credit_add_locked(d, c * (old_cost / d->cost) - c);
    }
    pthread_mutex_unlock(&d->mu);
    LOG_DEBUG("sm: limit %d%% self %.1f%% container %.1f%% others %.1f%% yield-to %.1f%% blocks %llu cost %.1fns "
              "rate %.3g/ms", d->limit, self * 100, all * 100, foreign * 100, yield * 100, (unsigned long long)blocks,
              d->cost, d->rate * 1e6);
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
    uint64_t period = (uint64_t)vgpu_cfg->sm_period_ms * 1000000ull;
    for (;;) {
        sleep_ns(period);
        for (int i = 0; i < VGPU_MAX_DEV; i++)
            if (g_sm[i].limit && g_sm[i].nvh_state > 0)
                update(&g_sm[i]);
    }
    return NULL;
}

int limiter_init(void)
{
    const struct vgpu_config *c = vgpu_cfg;
    g_sm_active = c->enabled && (c->sm_any || c->sm_yield);
    return g_sm_active;
}

void limiter_start(void)
{
    uint64_t now = now_ns();
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        struct smdev *d = &g_sm[i];
        pthread_mutex_init(&d->mu, NULL);
        d->limit = vgpu_cfg->sm_limit[i];
        /* low priority without an SM limit: limited to 100 % so it can yield (the container's GPUs only) */
        if (!d->limit && vgpu_cfg->sm_yield && (vgpu_cfg->nuuid == 0 || i < vgpu_cfg->nuuid)) {
            d->limit = 100;
            d->prio_only = 1;
        }
        d->cost = 1000.0; /* initial guess: 1 us of GPU time per block */
        d->rate = d->limit / 100.0 / d->cost;
        d->credit = (int64_t)Q;
        d->added = (int64_t)Q;
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
/* stack: the check of the kernel's stack against the memory limit (memory.c memory_launch_stack), first: a
 * refused launch never takes budget. */
#define LAUNCH_HOOK(name, blocks, stream, stack, params, args) \
    EXPORT CUresult name params                                \
    {                                                          \
        ensure_cuda();                                         \
        if (UNLIKELY(!real_##name))                            \
            return CUDA_ERROR_NOT_INITIALIZED;                 \
        CUresult src_ = stack;                                 \
        if (UNLIKELY(src_ != CUDA_SUCCESS))                    \
            return src_;                                       \
        if (UNLIKELY(g_sm_active))                             \
            limiter_throttle(blocks, stream);                  \
        return real_##name args;                               \
    }

LAUNCH_HOOK(cuLaunchKernel, (uint64_t)gx * gy * gz, s, memory_launch_stack(f),
            (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
             unsigned int bz, unsigned int shmem, CUstream s, void **params, void **extra),
            (f, gx, gy, gz, bx, by, bz, shmem, s, params, extra))
LAUNCH_HOOK(cuLaunchKernel_ptsz, (uint64_t)gx * gy * gz, s, memory_launch_stack(f),
            (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
             unsigned int bz, unsigned int shmem, CUstream s, void **params, void **extra),
            (f, gx, gy, gz, bx, by, bz, shmem, s, params, extra))
LAUNCH_HOOK(cuLaunchCooperativeKernel, (uint64_t)gx * gy * gz, s, memory_launch_stack(f),
            (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
             unsigned int bz, unsigned int shmem, CUstream s, void **params),
            (f, gx, gy, gz, bx, by, bz, shmem, s, params))
LAUNCH_HOOK(cuLaunchCooperativeKernel_ptsz, (uint64_t)gx * gy * gz, s, memory_launch_stack(f),
            (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
             unsigned int bz, unsigned int shmem, CUstream s, void **params),
            (f, gx, gy, gz, bx, by, bz, shmem, s, params))
LAUNCH_HOOK(cuLaunchKernelEx, config ? (uint64_t)config->gridDimX * config->gridDimY * config->gridDimZ : 1,
            config ? config->hStream : NULL, memory_launch_stack(f),
            (const CUlaunchConfig *config, CUfunction f, void **params, void **extra), (config, f, params, extra))
LAUNCH_HOOK(cuLaunchKernelEx_ptsz, config ? (uint64_t)config->gridDimX * config->gridDimY * config->gridDimZ : 1,
            config ? config->hStream : NULL, memory_launch_stack(f),
            (const CUlaunchConfig *config, CUfunction f, void **params, void **extra), (config, f, params, extra))

/* The legacy launches (deprecated, still exported by the driver): cuLaunch runs one block, cuLaunchGrid(Async)
 * a grid of w x h blocks. */
static uint64_t grid_blocks(int w, int h)
{
    return w > 0 && h > 0 ? (uint64_t)w * (uint64_t)h : 1;
}

LAUNCH_HOOK(cuLaunch, 1, NULL, memory_launch_stack(f), (CUfunction f), (f))
LAUNCH_HOOK(cuLaunchGrid, grid_blocks(w, h), NULL, memory_launch_stack(f), (CUfunction f, int w, int h), (f, w, h))
LAUNCH_HOOK(cuLaunchGridAsync, grid_blocks(w, h), s, memory_launch_stack(f), (CUfunction f, int w, int h, CUstream s), (f, w, h, s))

/* One kernel per device (at most one entry per device: more is the driver's error, and never read here): the
 * blocks of them all, charged to the current device. */
static uint64_t multi_blocks(const CUDA_LAUNCH_PARAMS *list, unsigned int n)
{
    uint64_t b = 0;
    for (unsigned int i = 0; list && i < n && i < VGPU_MAX_DEV; i++) {
        uint64_t k = (uint64_t)list[i].gridDimX * list[i].gridDimY * list[i].gridDimZ; /* < 2^63 */
        b = b + k < b ? UINT64_MAX : b + k;
    }
    return b;
}

LAUNCH_HOOK(cuLaunchCooperativeKernelMultiDevice, multi_blocks(list, n), list && n ? list[0].hStream : NULL,
            memory_launch_stack_multi(list, n),
            (CUDA_LAUNCH_PARAMS *list, unsigned int n, unsigned int flags), (list, n, flags))

/* ------------------------------------------------------------------ graphs */
/* graph_walk_kernels visitor: adds a kernel node's blocks to *(uint64_t *)arg (saturating). */
static void add_blocks(const CUDA_KERNEL_NODE_PARAMS *p, void *arg)
{
    uint64_t *blocks = arg, b = (uint64_t)p->gridDimX * p->gridDimY * p->gridDimZ;
    *blocks = *blocks + b < *blocks ? UINT64_MAX : *blocks + b;
}

/* The blocks of graph g's kernel nodes, child graph nodes' kernels included (GRAPH_WALK_DEPTH levels down;
 * what cannot be read counts nothing). */
static uint64_t graph_blocks(CUgraph g)
{
    uint64_t blocks = 0;
    graph_walk_kernels(g, add_blocks, &blocks);
    return blocks;
}

/* Records exec's launch cost: the blocks of the graph it runs. */
static void graph_record(CUgraphExec exec, CUgraph g)
{
    uint64_t blocks = graph_blocks(g);
    track_put(TK_GRAPHEXEC, (uint64_t)(uintptr_t)exec, blocks ? blocks : 1, 0, NULL);
}

/* cuGraphExecUpdate(_v2) succeeded (memory.c): the executable runs the new graph's kernels (their grids
 * included) from now on, so its cost is the new graph's. */
void limiter_graph_updated(CUgraphExec exec, CUgraph graph)
{
    if (g_sm_active)
        graph_record(exec, graph);
}

/* Every instantiation records the graph's launch cost (SM limit) and what its memory nodes can take
 * (memory.c; pre: the graph's order read before the driver's call, taken). */
static void graph_instantiated(CUgraphExec *exec, CUgraph graph, struct gmem_order *pre)
{
    if (!exec) {
        memory_graph_order_free(pre);
        return;
    }
    if (g_sm_active)
        graph_record(*exec, graph);
    memory_graph_instantiated(*exec, graph, pre);
}

/* The new executable *exec is given up (its memory check or upload refused, or failed): forgotten and
 * destroyed. */
static void graph_abandon(CUgraphExec *exec)
{
    if (!exec || !real_cuGraphExecDestroy)
        return;
    CUgraphExec e = *exec;
    memory_graph_exec_gone(e);
    uint64_t s;
    int d;
    if (g_sm_active)
        track_take(TK_GRAPHEXEC, (uint64_t)(uintptr_t)e, &s, &d);
    real_cuGraphExecDestroy(e);
}

/* An instantiation the driver made (rc): recorded, and its kernels' stack charged (memory.c), which the
 * driver grows at its launches; refused (the executable destroyed) with CUDA_ERROR_OUT_OF_MEMORY when that
 * does not fit. */
static CUresult graph_made(CUresult rc, CUgraphExec *exec, CUgraph graph, struct gmem_order *pre)
{
    if (rc != CUDA_SUCCESS || !exec) {
        memory_graph_order_free(pre);
        return rc;
    }
    graph_instantiated(exec, graph, pre);
    rc = memory_graph_stack(graph);
    if (rc != CUDA_SUCCESS)
        graph_abandon(exec);
    return rc;
}

EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, unsigned long long flags)
{
    ensure_cuda();
    if (!real_cuGraphInstantiateWithFlags)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct gmem_order *pre = memory_graph_order(graph);
    return graph_made(real_cuGraphInstantiateWithFlags(exec, graph, flags), exec, graph, pre);
}

EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *exec, CUgraph graph, CUgraphNode *err, char *log, size_t logsz)
{
    ensure_cuda();
    if (!real_cuGraphInstantiate_v2)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct gmem_order *pre = memory_graph_order(graph);
    return graph_made(real_cuGraphInstantiate_v2(exec, graph, err, log, logsz), exec, graph, pre);
}

EXPORT CUresult cuGraphInstantiate(CUgraphExec *exec, CUgraph graph, CUgraphNode *err, char *log, size_t logsz)
{
    ensure_cuda();
    if (!real_cuGraphInstantiate)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct gmem_order *pre = memory_graph_order(graph);
    return graph_made(real_cuGraphInstantiate(exec, graph, err, log, logsz), exec, graph, pre);
}

/* CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD also uploads the graph, which reserves its allocations' memory: the
 * graph is instantiated without it, then uploaded through the rules of a launch (memory.c); an upload that
 * is refused or fails destroys the new executable and returns its error, as a failed instantiation. */
static CUresult instantiate_with_params(cuGraphInstantiateWithParams_fn fn, cuGraphUpload_fn upload,
                                        CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    struct gmem_order *pre = memory_graph_order(graph);
    if (!params || !exec || !(params->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) || !upload || !vgpu_cfg->enabled) {
        return graph_made(fn(exec, graph, params), exec, graph, pre);
    }
    CUDA_GRAPH_INSTANTIATE_PARAMS q = *params;
    q.flags &= ~(cuuint64_t)CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD;
    CUresult rc = fn(exec, graph, &q);
    params->hErrNode_out = q.hErrNode_out;
    params->result_out = q.result_out;
    rc = graph_made(rc, exec, graph, pre);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct gmem_launch t;
    rc = memory_graph_launch_begin(*exec, "cuGraphInstantiateWithParams", &t);
    if (rc == CUDA_SUCCESS) {
        rc = upload(*exec, q.hUploadStream);
        memory_graph_launch_end(&t, rc);
    }
    if (rc != CUDA_SUCCESS)
        graph_abandon(exec);
    return rc;
}

EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    ensure_cuda();
    if (!real_cuGraphInstantiateWithParams)
        return CUDA_ERROR_NOT_INITIALIZED;
    return instantiate_with_params(real_cuGraphInstantiateWithParams, real_cuGraphUpload, exec, graph, params);
}

EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *exec, CUgraph graph,
                                                  CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    ensure_cuda();
    if (!real_cuGraphInstantiateWithParams_ptsz)
        return CUDA_ERROR_NOT_INITIALIZED;
    return instantiate_with_params(real_cuGraphInstantiateWithParams_ptsz, real_cuGraphUpload_ptsz, exec, graph,
                                   params);
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
    CUresult rc = real_cuGraphExecDestroy(exec);
    if (rc == CUDA_SUCCESS)
        memory_graph_exec_gone(exec);
    return rc;
}

/* An executable graph's kernel node given another kernel (CUDA 10.1; _v2, CUDA 12, the same layout up to the
 * function): the new kernel's stack is checked like a launch's (memory.c), before the driver takes it, as the
 * graph's launches will grow the stack for it; refused with CUDA_ERROR_OUT_OF_MEMORY when it does not fit. */
#define EXEC_KERNEL_HOOK(name)                                                                \
    EXPORT CUresult name(CUgraphExec exec, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *p) \
    {                                                                                         \
        ensure_cuda();                                                                        \
        if (UNLIKELY(!real_##name))                                                           \
            return CUDA_ERROR_NOT_INITIALIZED;                                                \
        CUresult rc = p ? memory_launch_stack(p->func) : CUDA_SUCCESS;                        \
        return rc != CUDA_SUCCESS ? rc : real_##name(exec, node, p);                          \
    }

EXEC_KERNEL_HOOK(cuGraphExecKernelNodeSetParams)
EXEC_KERNEL_HOOK(cuGraphExecKernelNodeSetParams_v2)

/* CUDA 12.2's generic setter: a kernel node's parameters checked the same way. */
EXPORT CUresult cuGraphExecNodeSetParams(CUgraphExec exec, CUgraphNode node, CUgraphNodeParams *p)
{
    ensure_cuda();
    if (UNLIKELY(!real_cuGraphExecNodeSetParams))
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = p && p->type == CU_GRAPH_NODE_TYPE_KERNEL ? memory_launch_stack(p->u.kernel.func) : CUDA_SUCCESS;
    return rc != CUDA_SUCCESS ? rc : real_cuGraphExecNodeSetParams(exec, node, p);
}

static uint64_t exec_blocks(CUgraphExec exec)
{
    uint64_t b = 1;
    int d;
    track_get(TK_GRAPHEXEC, (uint64_t)(uintptr_t)exec, &b, &d);
    return b;
}

/* A graph launch meets the SM limiter, and its memory nodes the memory limit (memory.c): refused with
 * CUDA_ERROR_OUT_OF_MEMORY before the driver is called when they could take the GPU past it. */
#define GRAPH_LAUNCH_HOOK(name)                                                    \
    EXPORT CUresult name(CUgraphExec exec, CUstream s)                             \
    {                                                                              \
        ensure_cuda();                                                             \
        if (UNLIKELY(!real_##name))                                                \
            return CUDA_ERROR_NOT_INITIALIZED;                                     \
        if (UNLIKELY(g_sm_active)) /* first: the memory check holds a lock until the end */ \
            limiter_throttle(exec_blocks(exec), s);                                \
        struct gmem_launch t;                                                      \
        CUresult rc = memory_graph_launch_begin(exec, "cuGraphLaunch", &t);        \
        if (rc)                                                                    \
            return rc;                                                             \
        rc = real_##name(exec, s);                                                 \
        memory_graph_launch_end(&t, rc);                                           \
        return rc;                                                                 \
    }

GRAPH_LAUNCH_HOOK(cuGraphLaunch)
GRAPH_LAUNCH_HOOK(cuGraphLaunch_ptsz)
