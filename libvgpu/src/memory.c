/*
 * Memory limit: every allocation path reserves its size in the shared region before calling
 * the driver (so concurrent allocations can never overshoot the limit), rolls the reservation
 * back if the driver fails, and records the allocation in a per-process table so that frees
 * subtract exactly what was added: double, unknown and late frees subtract nothing.
 * Destroying a context drops the allocations it owned.  Reporting hooks (cuMemGetInfo,
 * cuDeviceTotalMem, nvmlDeviceGetMemoryInfo) show the limit as the total.
 */
#include "vgpu.h"
#include "track.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ context teardown */
static uint64_t pool_freed_locked(int ix, uint64_t bytes);
static void pools_sync_all(void);
static void pools_after_fork_child(void);
static void ctx_after_fork_child(void);
static void gmem_sync_all(void);
static void gmem_after_fork_child(void);

/* give back to the shared region what was freed, per device (called without the track lock) */
static void release_freed(const uint64_t freed[VGPU_MAX_DEV])
{
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        if (freed[d])
            region_release(d, freed[d]);
}

struct ctx_drop {
    CUcontext ctx;
    uint64_t freed[VGPU_MAX_DEV];
    int pooled;
};

/* Called with the track lock held: 1 when e is memory owned by the context being destroyed (its modules and
 * its copies of libraries included). VMM memory (cuMemCreate, TK_HANDLE) is not: the driver documents that
 * cuCtxDestroy does not free it (it belongs to no context and stays allocated until released and unmapped, or
 * the process exits), so it stays charged. */
static int drop_if_ctx_locked(struct track_entry *e, void *arg)
{
    struct ctx_drop *c = arg;
    if (!((e->kind < TK_HANDLE || e->kind == TK_LIMIT || e->kind == TK_MODULE || e->kind == TK_LIBCTX) &&
          e->ctx == c->ctx))
        return 0;
    uint64_t b = e->pool ? pool_freed_locked(e->pool, e->size) : e->size;
    c->pooled |= e->pool != 0;
    if (e->dev >= 0 && e->dev < VGPU_MAX_DEV)
        c->freed[e->dev] += b;
    return 1;
}

/* Drops every memory entry owned by ctx (the driver freed them with the context; memory from a pool
 * goes back to the pool's reserve). */
static void drop_context_entries(CUcontext ctx)
{
    struct ctx_drop c = {.ctx = ctx};
    track_lock();
    track_remove_if_locked(drop_if_ctx_locked, &c);
    track_unlock();
    release_freed(c.freed);
    if (c.pooled)
        pools_sync_all();
}

void memory_after_fork_child(void)
{
    /* the child owns none of the parent's device memory */
    track_after_fork_child();
    ctx_after_fork_child();
    pools_after_fork_child();
    gmem_after_fork_child();
    region_after_fork_child();
}

__attribute__((constructor)) static void memory_atfork(void)
{
    pthread_atfork(NULL, NULL, memory_after_fork_child);
}

/* ------------------------------------------------------------------ memory pools
 * A pool keeps freed memory reserved (device memory the container holds) until the driver releases it:
 * at a synchronisation beyond the pool's release threshold, at cuMemPoolTrimTo, or when the pool is
 * destroyed. Each pool an allocation of this process came from is charged to this process for
 * max(reserved, live): its live allocations (each charged when allocated) plus `excess`, the reserve
 * beyond them, re-read from the driver (cuMemPoolGetAttribute RESERVED_MEM_CURRENT) after every
 * allocation, free and trim from it, before refusing an allocation, and on every memory report. An
 * allocation first takes from the pool's excess (already charged) before reserving more. Memory is
 * uncharged only when the driver says the pool no longer reserves it; if it cannot be asked, it stays
 * charged. */
#define MAX_POOLS 64
#define POOL_ATTR_RESERVED_MEM_CURRENT 5 /* CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT */
struct poolacct {
    CUmemoryPool pool;
    int dev;          /* container GPU */
    int gone;         /* destroyed: its memory returns to the driver as it is freed */
    uint64_t live;    /* bytes of this process's live allocations from it */
    uint64_t excess;  /* bytes of reserve beyond them, charged to this process */
};
static struct poolacct g_pools[MAX_POOLS]; /* under the track lock (track.h) */
static int g_npools;
/* Serialises every operation on pools (allocation, free, re-read), so a re-read never sees an allocation
 * half done; recursive: a refused reservation re-reads the pools from inside an allocation. */
static pthread_mutex_t g_pool_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
#define POOL_GRAIN (2ull << 20) /* the driver reserves device memory in 2 MiB steps */

/* Index + 1 of pool in g_pools (registered on first use, in the place of a destroyed pool that holds
 * nothing any more when there is one), 0 when the table is full: the allocation is then refused
 * (pooled_alloc), since what the pool keeps reserved after a free could not be charged. */
static int pool_index(CUmemoryPool pool, int dev)
{
    track_lock();
    int ix = 0, spare = 0;
    for (int i = 0; i < g_npools && !ix; i++) {
        if (g_pools[i].pool == pool && !g_pools[i].gone)
            ix = i + 1;
        else if (!spare && g_pools[i].gone && !g_pools[i].live && !g_pools[i].excess)
            spare = i + 1;
    }
    if (!ix && (spare || g_npools < MAX_POOLS)) {
        ix = spare ? spare : ++g_npools;
        g_pools[ix - 1] = (struct poolacct){.pool = pool, .dev = dev};
    }
    track_unlock();
    return ix;
}

/* Re-reads pool ix's reserve from the driver and charges (or, when the driver released it, uncharges)
 * the part beyond its live allocations. */
static void pool_sync(int ix)
{
    if (ix <= 0 || !real_cuMemPoolGetAttribute)
        return;
    pthread_mutex_lock(&g_pool_mu);
    track_lock();
    struct poolacct p = g_pools[ix - 1];
    track_unlock();
    uint64_t reserved = 0;
    if (p.gone || real_cuMemPoolGetAttribute(p.pool, POOL_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS) {
        pthread_mutex_unlock(&g_pool_mu);
        return; /* not known: what is charged stays charged */
    }
    track_lock();
    struct poolacct *q = &g_pools[ix - 1];
    uint64_t want = reserved > q->live ? reserved - q->live : 0, have = q->excess;
    q->excess = want;
    track_unlock();
    if (want > have)
        region_reserve(p.dev, want - have, 1, NULL, NULL); /* held by the driver already: never refused */
    else if (want < have)
        region_release(p.dev, have - want);
    pthread_mutex_unlock(&g_pool_mu);
}

static void pools_after_fork_child(void)
{
    g_npools = 0; /* the child holds no allocation of the parent's */
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&g_pool_mu, &a);
    pthread_mutexattr_destroy(&a);
}

static void pools_sync_all(void)
{
    track_lock();
    int n = g_npools;
    track_unlock();
    for (int i = 1; i <= n; i++)
        pool_sync(i);
}

/* Moves up to `bytes` of pool ix's charged excess to its live allocations; returns how much. */
static uint64_t pool_take(int ix, uint64_t bytes)
{
    if (ix <= 0)
        return 0;
    track_lock();
    struct poolacct *q = &g_pools[ix - 1];
    uint64_t t = bytes < q->excess ? bytes : q->excess;
    q->excess -= t;
    q->live += t;
    track_unlock();
    return t;
}

/* An allocation of `bytes` from pool ix ended (freed, or never made: `failed`, with `taken` of it from
 * the excess). Freed memory goes back to the pool's reserve, still charged, until pool_sync learns the
 * driver released it. Returns the bytes to uncharge now (a destroyed pool, a failed allocation). */
static uint64_t pool_put(int ix, uint64_t bytes, int failed, uint64_t taken)
{
    track_lock();
    struct poolacct *q = &g_pools[ix - 1];
    uint64_t now;
    if (failed) {
        q->live = q->live > taken ? q->live - taken : 0;
        q->excess += taken;
        now = bytes - taken;
    } else {
        now = pool_freed_locked(ix, bytes);
    }
    track_unlock();
    return now;
}

/* Caller holds the track lock. A live allocation of pool ix was freed: back to the reserve (still charged), or
 * to the driver if the pool is destroyed. Returns the bytes to uncharge now. */
static uint64_t pool_freed_locked(int ix, uint64_t bytes)
{
    struct poolacct *q = &g_pools[ix - 1];
    q->live = q->live > bytes ? q->live - bytes : 0;
    if (q->gone)
        return bytes;
    q->excess += bytes;
    return 0;
}

/* ------------------------------------------------------------------ helpers */
/* The container GPU (vgpu.h) of the current context: 0, or -1 without a context (the driver refuses
 * the call itself). A GPU outside the container's list yields VGPU_FOREIGN, whose limit is 0. */
int current_device(CUdevice *dev, CUcontext *ctx)
{
    CUdevice ord;
    if (!real_cuCtxGetDevice || real_cuCtxGetDevice(&ord) != CUDA_SUCCESS)
        return -1;
    if (ctx && (!real_cuCtxGetCurrent || real_cuCtxGetCurrent(ctx) != CUDA_SUCCESS))
        *ctx = NULL;
    *dev = vgpu_dev_of_cuda(ord);
    return *dev >= 0 && *dev <= VGPU_FOREIGN ? 0 : -1;
}

/* Per container GPU: while a new context's measured cost is charged as the smallest rise (until this
 * process's pid is learned, see ctx_created), how much more the largest rise is. An allocation must fit
 * next to it, so that none fits only until the context's own cost is charged. */
static uint64_t g_ctx_pending[VGPU_MAX_DEV];

/* Reserves bytes, and for the check only, what is pending on dev (force: see region_reserve). */
static int reserve_with_pending(int dev, uint64_t bytes, int force, uint64_t *used, uint64_t *limit)
{
    uint64_t pend = dev >= 0 && dev < VGPU_MAX_DEV ? __atomic_load_n(&g_ctx_pending[dev], __ATOMIC_ACQUIRE) : 0;
    if (LIKELY(!pend))
        return region_reserve(dev, bytes, force, used, limit);
    if (bytes + pend < bytes || region_reserve(dev, bytes + pend, force, used, limit) != 0)
        return -1;
    region_release(dev, pend);
    return 0;
}

/* force 2: let through also when nothing is charged on dev (a process's first context, see ctx_before) */
static CUresult reserve_as(int dev, uint64_t bytes, const char *api, int force)
{
    uint64_t used = 0, limit = 0;
    if (reserve_with_pending(dev, bytes, force, &used, &limit) == 0)
        return CUDA_SUCCESS;
    if (__atomic_load_n(&g_npools, __ATOMIC_RELAXED)) { /* pools may have released reserve since */
        pools_sync_all();
        if (reserve_with_pending(dev, bytes, force, &used, &limit) == 0)
            return CUDA_SUCCESS;
    }
    region_count_refusal();
    /* one line per second at most: programs probe memory by allocating in a loop */
    static uint64_t last_ns, suppressed;
    uint64_t now = now_ns(), skipped = 0;
    int log = 0;
    track_lock();
    if (!last_ns || now - last_ns >= 1000000000ull) {
        last_ns = now;
        skipped = suppressed;
        suppressed = 0;
        log = 1;
    } else {
        suppressed++;
    }
    track_unlock();
    if (log)
        LOG_WARN("%s: out of memory on device %d: request %llu bytes, used %llu of limit %llu (%llu similar "
                 "refusals not logged in the last second)", api, dev, (unsigned long long)bytes,
                 (unsigned long long)used, (unsigned long long)limit, (unsigned long long)skipped);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult reserve(int dev, uint64_t bytes, const char *api)
{
    return reserve_as(dev, bytes, api, 0);
}

/* Common tail of every allocation: roll back on driver failure, record on success. */
static CUresult finish(CUresult rc, int kind, uint64_t key, uint64_t bytes, int dev, CUcontext ctx)
{
    if (rc != CUDA_SUCCESS) {
        region_release(dev, bytes);
        return rc;
    }
    if (track_put(kind, key, bytes, dev, ctx) != 0) {
        LOG_ERROR("cannot record allocation of %llu bytes; usage stays charged", (unsigned long long)bytes);
    }
    return rc;
}

static void release_tracked(int kind, uint64_t key, CUresult rc, uint64_t size, int dev, CUcontext ctx)
{
    if (rc == CUDA_SUCCESS)
        region_release(dev, size);
    else
        track_put(kind, key, size, dev, ctx); /* the driver kept it */
}

#define PASS_IF_OFF(call)             \
    do {                              \
        ensure_cuda();                \
        if (!vgpu_cfg->enabled)           \
            return call;              \
    } while (0)

#define REAL_OR_FAIL(name)                    \
    do {                                      \
        if (UNLIKELY(!real_##name))           \
            return CUDA_ERROR_NOT_INITIALIZED; \
    } while (0)

/* ------------------------------------------------------------------ contexts
 * Every context this process holds on a device is charged the cost of one context there (the unit):
 * measured at its first context on the device (see below), or LIBVGPU_CONTEXT_COST. The charge is
 * count x unit, adjusted under g_cmu whenever a context comes or goes, so nothing is charged twice or
 * given back twice, and the unit is kept once measured: a context created while the last other one is
 * destroyed is charged like any other. Context creations on a device are serialised (g_cnew), so that a
 * measurement sees this process's one new context and nothing else of its own. */
static int g_primary_refs[VGPU_MAX_DEV];
static CUcontext g_primary_ctx[VGPU_MAX_DEV];
static int g_ctx_count[VGPU_MAX_DEV];       /* contexts held: created ones + the primary while retained */
static uint64_t g_ctx_unit[VGPU_MAX_DEV];   /* bytes one context costs; 0 until measured */
static uint64_t g_ctx_charged[VGPU_MAX_DEV]; /* bytes charged for them: g_ctx_count x g_ctx_unit */
static pthread_mutex_t g_cmu = PTHREAD_MUTEX_INITIALIZER;
/* held across a context creation on a device */
static pthread_mutex_t g_cnew[VGPU_MAX_DEV] = {[0 ... VGPU_MAX_DEV - 1] = PTHREAD_MUTEX_INITIALIZER};
/* Held by cuCtxDestroy across the driver's call and by a library load while it makes the process's contexts
 * current in turn (library_force_all); taken after the g_cnew locks. */
static pthread_mutex_t g_ctxuse = PTHREAD_MUTEX_INITIALIZER;

/* Charges (or gives back) the difference between what dev's contexts cost and what is charged for
 * them. Caller holds g_cmu (the region's own lock nests inside it; nothing takes them the other way). */
static void ctx_recharge_locked(int dev)
{
    uint64_t want = (uint64_t)g_ctx_count[dev] * g_ctx_unit[dev], have = g_ctx_charged[dev];
    int cdev = vgpu_dev_of_cuda(dev);
    if (want > have)
        region_reserve(cdev, want - have, 1, NULL, NULL); /* never fails: a context always succeeds */
    else if (want < have)
        region_release(cdev, have - want);
    g_ctx_charged[dev] = want;
}

/* NVML used memory of container GPU cdev. */
static int64_t nvml_used(int cdev)
{
    nvmlDevice_t h;
    nvmlMemory_t m;
    if (!vgpu_nvml_load() || vgpu_nvml_of_dev(cdev, &h) != 0 || vnvml_memory(h, &m) != NVML_SUCCESS)
        return -1;
    return (int64_t)m.used;
}

/* The unit is measured as the memory NVML shows this process using once its first context on a GPU
 * exists: per process, so that a neighbour's context created at the same moment (containers started
 * together) is not charged to this one. Until this process's pid is known (it is learned right after,
 * see region.c "host pid"), the smallest rise among the processes listed is charged (so that the
 * learning's probe fits under the limit next to it), then this process's own rise (ctx_settle), or
 * the largest if the pid stays unknown; without per-process figures, the device's used-memory rise.
 * The listing holds as many processes as NVML's helper does (VNVML_MAX_PROCS): with more on the GPU,
 * NVML refuses it and the device-wide rise is used. */
#define CM_MAX VNVML_MAX_PROCS
#define CTX_DEVICE_RISE_MAX (2ull << 30) /* a rise others can move: past this, another tenant moved */
struct procmem {
    int valid; /* listed */
    unsigned n;
    unsigned pid[CM_MAX];
    uint64_t used[CM_MAX]; /* before the creation; after it, the rise (UINT64_MAX: unknown) */
};
static struct procmem g_cm[VGPU_MAX_DEV], g_cm_after[VGPU_MAX_DEV]; /* under g_cnew[dev] */

static int list_procmem(int cdev, struct procmem *out)
{
    nvmlDevice_t h;
    out->valid = 0;
    if (!vgpu_nvml_load() || !vnvml_lists_processes() || vgpu_nvml_of_dev(cdev, &h) != 0 ||
        vnvml_process_memory(h, out->pid, out->used, CM_MAX, &out->n) != 0)
        return -1;
    out->valid = 1;
    return 0;
}

/* ---- measuring what a driver call allocates implicitly (modules and libraries, below; a context created
 * while libraries are loaded). One reading of CUDA ordinal ord: what NVML shows this process using there
 * when its NVML pid is known (-1: not known, or the driver gives no per-process figure), the device's used
 * memory (-1: unknown) and what this process has charged there. Caller holds g_cnew[ord] (g_cm_after[ord]
 * is the listing's scratch space; no context of this process comes or goes meanwhile). */
struct mem_reading {
    unsigned pid; /* this process's NVML pid at the first reading (0: not known) */
    int64_t own, dev;
    uint64_t charged;
};

/* closing: the reading after the driver's call (mem_rise); else the one before it. The charge is read before
 * NVML's figures at the opening and after them at the closing: a free the driver does meanwhile (NVML
 * falls first, then the charge) then makes the call look larger, never smaller. NVML's listing takes its
 * figures at its start and may take milliseconds: with the charge read after it at the opening, a free
 * done during it left the opening figure holding memory the charge no longer did (the rise read low). */
static void mem_read_at(int ord, struct mem_reading *r, int closing)
{
    int cdev = vgpu_dev_of_cuda(ord);
    struct procmem *pm = &g_cm_after[ord];
    if (!closing)
        r->charged = region_own(cdev);
    r->own = -1;
    if (r->pid && list_procmem(cdev, pm) == 0) {
        r->own = 0; /* not listed: nothing on the device */
        for (unsigned i = 0; i < pm->n; i++)
            if (pm->pid[i] == r->pid)
                r->own = pm->used[i] == UINT64_MAX ? -1 : (int64_t)pm->used[i];
    }
    r->dev = nvml_used(cdev);
    if (closing) /* read after NVML: a free the driver has done is then given back here too (as in ctx_created) */
        r->charged = region_own(cdev);
}

static void mem_read(int ord, struct mem_reading *r)
{
    mem_read_at(ord, r, 0);
}

/* What the driver allocated on ord between reading a and now: the rise of this process's own NVML figure
 * (else the device's), plus what this process's charge there fell by meanwhile (its other threads' frees,
 * which NVML shows as a fall). A rise of the charge (another thread's allocation) is not subtracted: the
 * shim reserves an allocation's size before the driver's call, so the closing reading can count it while
 * NVML does not show it yet (a large cuMemAlloc takes milliseconds in the driver), and subtracting it let a
 * module that big come in uncharged. An allocation the driver completes during the load is therefore
 * charged to the load as well (more than is held, until the module or library is unloaded). 0 when NVML
 * cannot tell. */
static uint64_t mem_rise(int ord, const struct mem_reading *a)
{
    struct mem_reading b = {.pid = a->pid};
    mem_read_at(ord, &b, 1);
    int64_t rise;
    if (a->own >= 0 && b.own >= 0)
        rise = b.own - a->own;
    else if (a->dev >= 0 && b.dev >= 0)
        rise = b.dev - a->dev;
    else
        return 0;
    if (b.charged < a->charged) /* frees: NVML's figure fell by as much */
        rise += (int64_t)(a->charged - b.charged);
    return rise > 0 ? (uint64_t)rise : 0;
}

/* Libraries this process has loaded and not unloaded (see "modules and libraries"). */
static int g_nlibs;
static int ctx_libs_force(int dev, CUcontext ctx);
static CUresult primary_release_locked(cuDevicePrimaryCtxRelease_v2_fn fn, CUdevice dev, int reset);

/* What a context creation on a device carries from before the driver's call to after it. */
struct ctx_token {
    int locked;     /* g_cnew[dev] is held */
    int measure;    /* this creation measures the unit */
    int created;    /* the context exists and was counted (ctx_created) */
    int64_t before; /* NVML used memory of the device before it (-1: unknown) */
    uint64_t own;   /* what this process had charged on the device before it */
    uint64_t reserved; /* bytes reserved for it before the driver's call (its cost, when known) */
    int refused;    /* no room under the limit for it: CUDA_ERROR_OUT_OF_MEMORY, the driver not called */
    int libs;       /* libraries are loaded: the copies the new context gets are measured (ctx_libs_charge) */
    struct mem_reading lib_before;
    int hold;       /* ctx_settle keeps g_cnew[dev] held (the caller loads the libraries into it, ctx_libs_force) */
};

/* Called before a context may be created on dev (api: the caller's name, for a refusal's log line). */
static struct ctx_token ctx_before(int dev, const char *api)
{
    struct ctx_token t = {.before = -1};
    if (!vgpu_cfg->enabled || dev < 0 || dev >= VGPU_MAX_DEV)
        return t;
    int cdev = vgpu_dev_of_cuda(dev);
    hostpid_before_ctx(cdev); /* may hold the learning's lock until hostpid_after_ctx: taken first */
    pthread_mutex_lock(&g_cnew[dev]);
    t.locked = 1;
    pthread_mutex_lock(&g_cmu);
    if (!g_ctx_unit[dev] && vgpu_cfg->context_cost >= 0)
        g_ctx_unit[dev] = (uint64_t)vgpu_cfg->context_cost;
    t.measure = !g_ctx_unit[dev] && vgpu_cfg->context_cost < 0;
    uint64_t unit = g_ctx_unit[dev];
    pthread_mutex_unlock(&g_cmu);
    /* a cost known before the creation must fit under the limit: reserved now, refused like an
     * allocation. For the process's later contexts there, its own cost; for its first, the cost another
     * process of the container measured (region_ctx_cost), let through when nothing is charged on the
     * GPU (a limit below one context). Else the first is charged after it exists, whatever it costs. */
    int force = 0;
    if (!unit && t.measure && cdev != VGPU_FOREIGN) {
        unit = region_ctx_cost(cdev);
        force = 2;
    }
    if (unit) {
        if (reserve_as(cdev, unit, api, force) != CUDA_SUCCESS)
            t.refused = 1;
        else
            t.reserved = unit;
    }
    if (t.measure) {
        t.own = region_own(cdev);
        list_procmem(cdev, &g_cm[dev]);
        t.before = nvml_used(cdev);
    } else if (!t.refused && __atomic_load_n(&g_nlibs, __ATOMIC_ACQUIRE) > 0) {
        /* its first context's measurement includes them in the unit; a later one's is measured here */
        t.libs = 1;
        t.lib_before.pid = (unsigned)hostpid_learned();
        mem_read(dev, &t.lib_before);
    }
    return t;
}

/* A context created (ctx) while libraries are loaded holds a copy of each, which the driver allocated with
 * it: what its creation added beyond the context's own cost is charged to it (freed with it, or when the
 * last library is unloaded). 0, or -1 when that does not fit under the limit (the caller destroys it).
 * Caller holds g_cnew[dev] (t->locked). */
static int ctx_libs_charge(int dev, struct ctx_token *t, CUcontext ctx)
{
    if (!t->libs || !ctx)
        return 0;
    t->libs = 0;
    pthread_mutex_lock(&g_cmu);
    uint64_t unit = g_ctx_unit[dev];
    pthread_mutex_unlock(&g_cmu);
    uint64_t rise = mem_rise(dev, &t->lib_before);
    if (rise <= unit)
        return 0;
    int cdev = vgpu_dev_of_cuda(dev);
    if (reserve_as(cdev, rise - unit, "cuCtxCreate (loaded libraries)", 0) != CUDA_SUCCESS)
        return -1;
    if (track_put(TK_LIBCTX, (uint64_t)(uintptr_t)ctx, rise - unit, cdev, ctx) != 0)
        LOG_ERROR("cannot record a context's libraries of %llu bytes; usage stays charged",
                  (unsigned long long)(rise - unit));
    return 0;
}

/* The smallest rise of a listed process across the creation, from the listing after it (whose figures
 * become the rises, copied into g_cm[dev] for ctx_settle); UINT64_MAX when NVML gives no per-process
 * figures. back: what this process gave back on the device meanwhile (its charge fell by as much: its
 * memory freed while the context came up), added to its own figure after the creation (to every
 * figure while its pid is not known), so that freeing memory during the measurement does not make
 * the context look cheaper. Caller holds g_cnew[dev]. */
static uint64_t least_rise(int dev, struct procmem *after, uint64_t back)
{
    struct procmem *cm = &g_cm[dev];
    unsigned pid = (unsigned)hostpid_learned();
    uint64_t least = UINT64_MAX;
    for (unsigned i = 0; i < after->n; i++) {
        uint64_t b = 0, a = after->used[i];
        for (unsigned j = 0; j < cm->n; j++)
            if (cm->pid[j] == after->pid[i])
                b = cm->used[j];
        if (a != UINT64_MAX && (!pid || after->pid[i] == pid))
            a = a + back < a || a + back == UINT64_MAX ? UINT64_MAX - 1 : a + back;
        uint64_t rise = a == UINT64_MAX || b == UINT64_MAX ? UINT64_MAX : a > b ? a - b : 0;
        after->used[i] = rise;
        if (rise && rise < least)
            least = rise;
    }
    *cm = *after;
    return least;
}

/* A context now exists on dev: count it, measure the unit if this creation does, charge. */
static void ctx_created(int dev, struct ctx_token *t)
{
    if (!vgpu_cfg->enabled || dev < 0 || dev >= VGPU_MAX_DEV)
        return;
    uint64_t cost = 0;
    t->created = 1;
    if (t->measure && t->locked) {
        int cdev = vgpu_dev_of_cuda(dev);
        uint64_t least = UINT64_MAX;
        struct procmem *after = &g_cm_after[dev];
        int listed = g_cm[dev].valid && list_procmem(cdev, after) == 0;
        int64_t used = nvml_used(cdev);
        /* read after NVML: a free the driver has done is then given back here too (never the reverse) */
        uint64_t own = region_own(cdev), back = t->own > own ? t->own - own : 0;
        if (listed)
            least = least_rise(dev, after, back);
        else
            g_cm[dev].valid = 0;
        uint64_t most = 0;
        for (unsigned i = 0; listed && least != UINT64_MAX && i < g_cm[dev].n; i++)
            if (g_cm[dev].used[i] != UINT64_MAX && g_cm[dev].used[i] > most)
                most = g_cm[dev].used[i];
        if (most > least && cdev >= 0 && cdev < VGPU_MAX_DEV) /* until ctx_settle */
            __atomic_store_n(&g_ctx_pending[cdev], most - least, __ATOMIC_RELEASE);
        if (least != UINT64_MAX) {
            cost = least; /* per process: no other tenant moves it, however large */
        } else if (t->before >= 0 && used >= 0) {
            uint64_t u = (uint64_t)used + back < back ? UINT64_MAX : (uint64_t)used + back;
            if (u > (uint64_t)t->before)
                cost = u - (uint64_t)t->before;
            if (cost > CTX_DEVICE_RISE_MAX) /* other tenants moved: do not trust the delta */
                cost = 0;
        }
    }
    pthread_mutex_lock(&g_cmu);
    g_ctx_count[dev]++;
    g_ctx_charged[dev] += t->reserved; /* what was reserved for it is part of the charge now */
    if (!cost && !g_ctx_unit[dev]) /* not measured: the container's cost it was reserved at, if any */
        cost = t->reserved;
    t->reserved = 0;
    if (cost && !g_ctx_unit[dev])
        g_ctx_unit[dev] = cost;
    ctx_recharge_locked(dev);
    pthread_mutex_unlock(&g_cmu);
    if (cost)
        LOG_DEBUG("device %d: context costs %llu bytes", dev, (unsigned long long)cost);
}

/* After the host pid is learned: the measured unit becomes this process's own rise. If it could not be
 * learned, the largest rise among the processes listed (never less than its own). Then the creation
 * on dev is over. */
static void ctx_settle(int dev, struct ctx_token *t)
{
    if (dev < 0 || dev >= VGPU_MAX_DEV || !t->locked)
        return;
    struct procmem *cm = &g_cm[dev];
    if (t->measure && t->created && cm->valid) {
        unsigned pid = (unsigned)hostpid_learned();
        uint64_t own = 0, most = 0;
        for (unsigned i = 0; i < cm->n; i++) {
            if (cm->used[i] == UINT64_MAX)
                continue;
            if (cm->pid[i] == pid)
                own = cm->used[i];
            if (cm->used[i] > most)
                most = cm->used[i];
        }
        uint64_t rise = pid ? own : most;
        pthread_mutex_lock(&g_cmu);
        /* the largest rise may be a neighbour's that allocated meanwhile: past the bound, keep the least */
        int settle = g_ctx_unit[dev] && rise && (pid || rise <= CTX_DEVICE_RISE_MAX) && rise != g_ctx_unit[dev];
        if (settle) {
            g_ctx_unit[dev] = rise;
            ctx_recharge_locked(dev);
        }
        pthread_mutex_unlock(&g_cmu);
        if (settle)
            LOG_DEBUG("device %d: context costs %llu bytes (%s)", dev, (unsigned long long)rise,
                      pid ? "this process's own" : "the largest rise: this process's pid is not known");
        if (pid && own) /* its own rise: what every process of the container reserves for its first */
            region_note_ctx_cost(vgpu_dev_of_cuda(dev), own);
    }
    cm->valid = 0; /* settled once */
    int cdev = vgpu_dev_of_cuda(dev);
    if (t->measure && cdev >= 0 && cdev < VGPU_MAX_DEV)
        __atomic_store_n(&g_ctx_pending[cdev], 0, __ATOMIC_RELEASE);
    if (t->reserved) /* reserved for a context that was not created */
        region_release(cdev, t->reserved);
    t->reserved = 0;
    t->locked = 0;
    if (!t->hold)
        pthread_mutex_unlock(&g_cnew[dev]);
}

static void ctx_gone(int dev, CUcontext ctx)
{
    drop_context_entries(ctx);
    gmem_sync_all(); /* the graph pool's memory may have gone with it */
    if (dev < 0 || dev >= VGPU_MAX_DEV)
        return;
    pthread_mutex_lock(&g_cmu);
    if (g_ctx_count[dev] > 0)
        g_ctx_count[dev]--;
    ctx_recharge_locked(dev);
    pthread_mutex_unlock(&g_cmu);
}

/* In a fork()ed child: it holds none of the parent's contexts (the driver gives it none) and measures
 * anew; a lock another thread held at the fork is free in the child. */
static void ctx_after_fork_child(void)
{
    pthread_mutex_init(&g_cmu, NULL);
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        pthread_mutex_init(&g_cnew[d], NULL);
    pthread_mutex_init(&g_ctxuse, NULL);
    memset(g_primary_refs, 0, sizeof g_primary_refs);
    memset(g_primary_ctx, 0, sizeof g_primary_ctx);
    memset(g_ctx_count, 0, sizeof g_ctx_count);
    memset(g_ctx_unit, 0, sizeof g_ctx_unit);
    memset(g_ctx_charged, 0, sizeof g_ctx_charged);
    memset(g_ctx_pending, 0, sizeof g_ctx_pending); /* a measurement another thread was making */
    g_nlibs = 0; /* the child holds no context, and its table no library (track_after_fork_child) */
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        g_cm[d].valid = 0;
}

/* The context's cost is charged before the host-pid probe runs in it, so that the probe has to fit
 * under the limit next to the context (it used to be made first: context + probe past the limit). */
static CUresult ctx_after(CUresult rc, CUcontext *pctx, CUdevice dev, struct ctx_token t)
{
    if (rc == CUDA_SUCCESS && pctx && ctx_libs_charge(dev, &t, *pctx) != 0) { /* its libraries do not fit */
        if (real_cuCtxDestroy_v2)
            real_cuCtxDestroy_v2(*pctx);
        else if (real_cuCtxDestroy)
            real_cuCtxDestroy(*pctx);
        *pctx = NULL;
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc == CUDA_SUCCESS && vgpu_cfg->enabled && pctx) {
        track_put(TK_CTX, (uint64_t)(uintptr_t)*pctx, 0, dev, *pctx);
        ctx_created(dev, &t);
    }
    hostpid_after_ctx(rc == CUDA_SUCCESS, rc == CUDA_SUCCESS && pctx ? *pctx : NULL);
    int held = t.locked;
    t.hold = held;
    ctx_settle(dev, &t);
    if (!held)
        return rc;
    /* still under g_cnew[dev]: the loaded libraries go into it now, measured (lazy loading) */
    if (rc == CUDA_SUCCESS && pctx && ctx_libs_force(dev, *pctx) != 0) {
        CUcontext gone = *pctx;
        CUresult d = real_cuCtxDestroy_v2 ? real_cuCtxDestroy_v2(gone)
                     : real_cuCtxDestroy ? real_cuCtxDestroy(gone) : CUDA_ERROR_NOT_SUPPORTED;
        uint64_t unused;
        int tdev = -1;
        if (d == CUDA_SUCCESS && track_take(TK_CTX, (uint64_t)(uintptr_t)gone, &unused, &tdev))
            ctx_gone(tdev, gone);
        *pctx = NULL;
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&g_cnew[dev]);
    return rc;
}

/* A creation refused before the driver's call (no room for its cost): the learning ctx_before may have
 * begun ends, and so does the creation. */
static CUresult ctx_refused(int dev, struct ctx_token *t)
{
    hostpid_after_ctx(0, NULL);
    ctx_settle(dev, t);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* Every versioned cuCtxCreate has its own hook with its own ABI (cuGetProcAddress hands out the one
 * the driver's table names for the requested version). */
EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    ensure_cuda();
    REAL_OR_FAIL(cuCtxCreate_v2);
    struct ctx_token before = ctx_before(dev, "cuCtxCreate");
    if (before.refused)
        return ctx_refused(dev, &before);
    return ctx_after(real_cuCtxCreate_v2(pctx, flags, dev), pctx, dev, before);
}

EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    ensure_cuda();
    REAL_OR_FAIL(cuCtxCreate);
    struct ctx_token before = ctx_before(dev, "cuCtxCreate");
    if (before.refused)
        return ctx_refused(dev, &before);
    return ctx_after(real_cuCtxCreate(pctx, flags, dev), pctx, dev, before);
}

EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int nparams, unsigned int flags,
                               CUdevice dev)
{
    ensure_cuda();
    REAL_OR_FAIL(cuCtxCreate_v3);
    struct ctx_token before = ctx_before(dev, "cuCtxCreate");
    if (before.refused)
        return ctx_refused(dev, &before);
    return ctx_after(real_cuCtxCreate_v3(pctx, params, nparams, flags, dev), pctx, dev, before);
}

EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev)
{
    ensure_cuda();
    REAL_OR_FAIL(cuCtxCreate_v4);
    struct ctx_token before = ctx_before(dev, "cuCtxCreate");
    if (before.refused)
        return ctx_refused(dev, &before);
    return ctx_after(real_cuCtxCreate_v4(pctx, params, flags, dev), pctx, dev, before);
}

/* A context is destroyed under g_ctxuse, which a module or library load holds from its first reading to its
 * charge (load_begin): it makes each context of the process current to load a library into it
 * (library_force_all), and the driver wants no call using a context while cuCtxDestroy runs; and a destroy
 * between the readings would make the load look smaller by all the context held. Not g_cnew: a destroy must
 * not wait for a creation in the driver. */
static CUresult ctx_destroy(cuCtxDestroy_v2_fn fn, CUcontext ctx)
{
    if (vgpu_cfg->enabled)
        pthread_mutex_lock(&g_ctxuse);
    CUresult rc = fn(ctx);
    if (rc == CUDA_SUCCESS && vgpu_cfg->enabled) {
        uint64_t unused;
        int dev = -1;
        if (track_take(TK_CTX, (uint64_t)(uintptr_t)ctx, &unused, &dev))
            ctx_gone(dev, ctx);
        else
            drop_context_entries(ctx);
    }
    if (vgpu_cfg->enabled)
        pthread_mutex_unlock(&g_ctxuse);
    return rc;
}

EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    ensure_cuda();
    REAL_OR_FAIL(cuCtxDestroy_v2);
    return ctx_destroy(real_cuCtxDestroy_v2, ctx);
}

EXPORT CUresult cuCtxDestroy(CUcontext ctx)
{
    ensure_cuda();
    REAL_OR_FAIL(cuCtxDestroy);
    return ctx_destroy(real_cuCtxDestroy, ctx);
}

/* Whether a retain creates the primary context is decided under g_cnew[dev], which every release and
 * reset of it on dev holds across the driver's call: a retain that finds it retained adds a reference
 * at no cost (never refused, however full the limit), and one that finds it not retained is a context
 * creation (ctx_before: reserved when its cost is known, refused past the limit). A retain that waited
 * in ctx_before while another thread created the primary context finds it retained and is not refused.
 * Lock order: the host-pid learning's lock, g_cnew[dev], g_cmu (ctx_before takes the first two, so a
 * retain gives g_cnew[dev] up before it). */
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    ensure_cuda();
    REAL_OR_FAIL(cuDevicePrimaryCtxRetain);
    if (!vgpu_cfg->enabled || dev < 0 || dev >= VGPU_MAX_DEV)
        return real_cuDevicePrimaryCtxRetain(pctx, dev);
    struct ctx_token t = {.before = -1};
    pthread_mutex_lock(&g_cnew[dev]);
    pthread_mutex_lock(&g_cmu);
    int first = g_primary_refs[dev] == 0;
    pthread_mutex_unlock(&g_cmu);
    if (first) {
        pthread_mutex_unlock(&g_cnew[dev]);
        t = ctx_before(dev, "cuDevicePrimaryCtxRetain"); /* holds g_cnew[dev] again (t.locked) */
        pthread_mutex_lock(&g_cmu);
        first = g_primary_refs[dev] == 0; /* another thread may have retained it meanwhile */
        pthread_mutex_unlock(&g_cmu);
        if (t.refused && first)
            return ctx_refused(dev, &t);
        t.refused = 0; /* retained already: what ctx_before reserved goes back in ctx_settle */
    }
    CUresult rc = real_cuDevicePrimaryCtxRetain(pctx, dev);
    if (rc == CUDA_SUCCESS && pctx && t.locked && ctx_libs_charge(dev, &t, *pctx) != 0) {
        /* the copies of the loaded libraries it holds do not fit: this retain's reference goes again */
        if (real_cuDevicePrimaryCtxRelease_v2)
            real_cuDevicePrimaryCtxRelease_v2(dev);
        else if (real_cuDevicePrimaryCtxRelease)
            real_cuDevicePrimaryCtxRelease(dev);
        *pctx = NULL;
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc == CUDA_SUCCESS && pctx) {
        pthread_mutex_lock(&g_cmu);
        first = g_primary_refs[dev]++ == 0;
        g_primary_ctx[dev] = *pctx;
        pthread_mutex_unlock(&g_cmu);
        if (first)
            ctx_created(dev, &t);
    }
    if (!t.locked) { /* a reference to a retained context: no creation, no learning */
        pthread_mutex_unlock(&g_cnew[dev]);
        return rc;
    }
    hostpid_after_ctx(rc == CUDA_SUCCESS, rc == CUDA_SUCCESS && pctx ? *pctx : NULL); /* after the charge */
    t.hold = 1;
    ctx_settle(dev, &t);
    /* still under g_cnew[dev]: the loaded libraries go into the new primary context now, measured */
    if (rc == CUDA_SUCCESS && pctx && ctx_libs_force(dev, *pctx) != 0) {
        cuDevicePrimaryCtxRelease_v2_fn rel =
            real_cuDevicePrimaryCtxRelease_v2 ? real_cuDevicePrimaryCtxRelease_v2 : real_cuDevicePrimaryCtxRelease;
        if (rel)
            primary_release_locked(rel, dev, 0);
        *pctx = NULL;
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&g_cnew[dev]);
    return rc;
}

static CUresult primary_release(cuDevicePrimaryCtxRelease_v2_fn fn, CUdevice dev, int reset)
{
    if (!vgpu_cfg->enabled || dev < 0 || dev >= VGPU_MAX_DEV)
        return fn(dev);
    pthread_mutex_lock(&g_cnew[dev]); /* see cuDevicePrimaryCtxRetain */
    CUresult rc = primary_release_locked(fn, dev, reset);
    pthread_mutex_unlock(&g_cnew[dev]);
    return rc;
}

/* A primary context release or reset, with g_cnew[dev] held. */
static CUresult primary_release_locked(cuDevicePrimaryCtxRelease_v2_fn fn, CUdevice dev, int reset)
{
    CUresult rc = fn(dev);
    CUcontext ctx = NULL;
    int gone = 0;
    pthread_mutex_lock(&g_cmu);
    if (rc == CUDA_SUCCESS && g_primary_refs[dev] > 0) {
        if (reset)
            g_primary_refs[dev] = 0;
        else
            g_primary_refs[dev]--;
        gone = g_primary_refs[dev] == 0;
        ctx = g_primary_ctx[dev];
        if (gone)
            g_primary_ctx[dev] = NULL;
    }
    pthread_mutex_unlock(&g_cmu);
    if (gone && ctx) /* before a retain can create it anew (the driver may hand out the same handle) */
        ctx_gone(dev, ctx);
    return rc;
}

/* The four ABI entry points that drop a primary context reference (reset: 1 for the _Reset forms). */
#define PRIMARY_RELEASE_HOOK(name, reset)                   \
    EXPORT CUresult name(CUdevice dev)                      \
    {                                                       \
        ensure_cuda();                                      \
        REAL_OR_FAIL(name);                                 \
        return primary_release(real_##name, dev, reset);    \
    }

PRIMARY_RELEASE_HOOK(cuDevicePrimaryCtxRelease_v2, 0)
PRIMARY_RELEASE_HOOK(cuDevicePrimaryCtxRelease, 0)
PRIMARY_RELEASE_HOOK(cuDevicePrimaryCtxReset_v2, 1)
PRIMARY_RELEASE_HOOK(cuDevicePrimaryCtxReset, 1)

/* ------------------------------------------------------------------ modules and libraries
 * Loading a module (cuModuleLoad, cuModuleLoadData, cuModuleLoadDataEx, cuModuleLoadFatBinary) makes the
 * driver allocate device memory in the current context for the module's code and its static __device__
 * globals (.nv.global, .bss): a cubin may declare gigabytes of them. Loading a library (cuLibraryLoadData,
 * cuLibraryLoadFromFile, CUDA 12) does so in every context the process holds and in each one it creates
 * while the library is loaded. The size is known only to the driver, so the shim measures it as it measures
 * a context's cost: under the creation lock of each device concerned (g_cnew, so no context of the process
 * comes or goes meanwhile), what NVML shows this process using there (its NVML pid known) else the device's
 * used memory, before and after the driver's call, less what the process's own charge there moved meanwhile
 * (mem_rise). That is charged to the module (to the library, per GPU); when it does not fit under the limit,
 * what was just loaded is unloaded again and the call returns CUDA_ERROR_OUT_OF_MEMORY. The charge goes back
 * at cuModuleUnload / cuLibraryUnload and, for a module, when its context is destroyed (the driver frees it
 * with the context). A library's copies in contexts created later: ctx_libs_charge. */
#define LIB_KEY(lib, slot) (((uint64_t)(uintptr_t)(lib) << 5) | (uint64_t)(slot)) /* slot <= VGPU_MAX_DEV */
#define LIB_LIVE VGPU_MAX_DEV /* the slot of a library's own entry (0 bytes): the shim saw it loaded */

struct load_meter {
    uint32_t locked; /* CUDA ordinals whose g_cnew is held (a bit each) */
    uint32_t mask;   /* those measured */
    struct mem_reading before[VGPU_MAX_DEV];
};

/* Takes the creation lock of every ordinal in `lock` (in increasing order) and g_ctxuse, then reads each
 * ordinal in mask (mask(): computed once the locks are held; NULL: lock itself). g_ctxuse holds off
 * cuCtxDestroy until load_unlock: a context destroyed between the readings lowered NVML's figure by all it
 * held before its charge was given back, and a load next to it was measured that much low (a 1000 MiB module
 * charged nothing next to a 900 MiB context destroyed meanwhile). */
static void load_begin(struct load_meter *lm, uint32_t lock, uint32_t (*mask)(void))
{
    lm->locked = lock;
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        if (lock & (1u << d))
            pthread_mutex_lock(&g_cnew[d]);
    pthread_mutex_lock(&g_ctxuse);
    lm->mask = mask ? mask() & lock : lock;
    unsigned pid = (unsigned)hostpid_learned();
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        if (!(lm->mask & (1u << d)))
            continue;
        lm->before[d].pid = pid;
        mem_read(d, &lm->before[d]);
    }
}

static void load_unlock(struct load_meter *lm)
{
    pthread_mutex_unlock(&g_ctxuse);
    for (int d = VGPU_MAX_DEV - 1; d >= 0; d--)
        if (lm->locked & (1u << d))
            pthread_mutex_unlock(&g_cnew[d]);
    lm->locked = lm->mask = 0;
}

/* After the driver loaded something: reserves what each ordinal rose by (cost[d], container GPU cdev[d]).
 * 0, or -1 (nothing kept reserved) when it does not fit under the limit. */
static int load_charge(struct load_meter *lm, const char *api, uint64_t cost[VGPU_MAX_DEV], int cdev[VGPU_MAX_DEV])
{
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        cost[d] = 0;
        cdev[d] = vgpu_dev_of_cuda(d);
        if (lm->mask & (1u << d))
            cost[d] = mem_rise(d, &lm->before[d]);
    }
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        if (cost[d] && reserve_as(cdev[d], cost[d], api, 0) != CUDA_SUCCESS) {
            while (--d >= 0)
                if (cost[d])
                    region_release(cdev[d], cost[d]);
            return -1;
        }
    }
    return 0;
}

/* Before a module load: 1 (and the current context in *ctx) when it is measured; the caller then calls
 * module_loaded with the driver's result. */
static int module_begin(CUmodule *m, struct load_meter *lm, CUcontext *ctx)
{
    CUdevice ord;
    if (!vgpu_cfg->enabled || !m || !real_cuCtxGetDevice || real_cuCtxGetDevice(&ord) != CUDA_SUCCESS ||
        ord < 0 || ord >= VGPU_MAX_DEV)
        return 0;
    if (!real_cuCtxGetCurrent || real_cuCtxGetCurrent(ctx) != CUDA_SUCCESS)
        *ctx = NULL;
    load_begin(lm, 1u << ord, NULL);
    return 1;
}

static CUresult module_loaded(CUresult rc, CUmodule *m, struct load_meter *lm, CUcontext ctx, const char *api)
{
    uint64_t cost[VGPU_MAX_DEV];
    int cdev[VGPU_MAX_DEV];
    if (rc == CUDA_SUCCESS && load_charge(lm, api, cost, cdev) != 0) {
        if (real_cuModuleUnload)
            real_cuModuleUnload(*m); /* the driver frees it now */
        *m = NULL;
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (rc == CUDA_SUCCESS) {
        for (int d = 0; d < VGPU_MAX_DEV; d++)
            if ((lm->mask & (1u << d)) &&
                track_put(TK_MODULE, (uint64_t)(uintptr_t)*m, cost[d], cdev[d], ctx) != 0)
                LOG_ERROR("cannot record a module of %llu bytes; usage stays charged", (unsigned long long)cost[d]);
    }
    load_unlock(lm);
    return rc;
}

#define MODULE_LOAD_HOOK(name, params, args)                                  \
    EXPORT CUresult name params                                             \
    {                                                                       \
        ensure_cuda();                                                      \
        REAL_OR_FAIL(name);                                                 \
        struct load_meter lm;                                               \
        CUcontext ctx = NULL;                                               \
        if (!module_begin(m, &lm, &ctx))                                    \
            return real_##name args;                                        \
        return module_loaded(real_##name args, m, &lm, ctx, #name);         \
    }

MODULE_LOAD_HOOK(cuModuleLoad, (CUmodule *m, const char *fname), (m, fname))
MODULE_LOAD_HOOK(cuModuleLoadData, (CUmodule *m, const void *image), (m, image))
MODULE_LOAD_HOOK(cuModuleLoadDataEx, (CUmodule *m, const void *image, unsigned int n, int *opts, void **vals),
                 (m, image, n, opts, vals))
MODULE_LOAD_HOOK(cuModuleLoadFatBinary, (CUmodule *m, const void *fatbin), (m, fatbin))

/* An unload holds off loads and context creations on every GPU (their creation locks, as a library load takes
 * them) from the driver's call until its charge is given back: the driver may hand the same handle to a load
 * as soon as it freed the old one, and that load's charge, recorded under the handle, would otherwise be the
 * one this unload takes (the new module held uncharged, the old charge kept for nothing); a load measured
 * meanwhile would also see the memory gone while it is still charged. */
static uint32_t no_ordinal(void)
{
    return 0;
}

static void unload_begin(struct load_meter *lm)
{
    load_begin(lm, ~0u >> (32 - VGPU_MAX_DEV), no_ordinal); /* nothing measured */
}

EXPORT CUresult cuModuleUnload(CUmodule m)
{
    ensure_cuda();
    REAL_OR_FAIL(cuModuleUnload);
    if (!vgpu_cfg->enabled)
        return real_cuModuleUnload(m);
    struct load_meter lm;
    unload_begin(&lm);
    CUresult rc = real_cuModuleUnload(m);
    uint64_t size = 0;
    int dev = -1;
    if (rc == CUDA_SUCCESS && track_take(TK_MODULE, (uint64_t)(uintptr_t)m, &size, &dev) && size)
        region_release(dev, size);
    load_unlock(&lm);
    return rc;
}

/* The ordinals where this process holds a context. */
static uint32_t ctx_mask(void)
{
    uint32_t mask = 0;
    pthread_mutex_lock(&g_cmu);
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        if (g_ctx_count[d] > 0)
            mask |= 1u << d;
    pthread_mutex_unlock(&g_cmu);
    return mask;
}

/* Libraries: measured on every GPU where the process holds a context (the driver loads a copy into each),
 * with context creations held off on every GPU, so that none is in the driver (getting a copy) unmeasured:
 * one that begins after the load finds the library counted (g_nlibs, ctx_before). */
static void library_begin(struct load_meter *lm)
{
    load_begin(lm, ~0u >> (32 - VGPU_MAX_DEV), ctx_mask);
}

/* ---- lazy loading. With CUDA_MODULE_LOADING=LAZY (the driver's default since CUDA 12.2) the driver loads a
 * library into a context only at its first use there: cuLibraryGetModule, cuLibraryGetKernel/cuKernelGetFunction,
 * cuLibraryGetGlobal/GetManaged, or a launch of a CUkernel. A launch is the shim's hot path and is not
 * measured, so a library's __device__ globals would come in unmeasured. Instead, the shim loads each library
 * into every context it knows of inside the measurements: at the load (library_force_all, into each context
 * the process holds) and at a context's creation (ctx_libs_force, every loaded library into the new one).
 * cuLibraryGetModule is the driver's documented way to force that load into the current context; with
 * eager loading the library is there already and it costs nothing. */

/* A growable list of handles (contexts or libraries) collected under the track lock; failed: out of memory. */
struct handle_list {
    void **v;
    size_t n, cap;
    int failed;
};

static void handle_add(struct handle_list *l, void *h)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        void **v = realloc(l->v, cap * sizeof *v);
        if (!v) {
            l->failed = 1;
            return;
        }
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = h;
}

/* Called with the track lock held: collects (never removes) the contexts (TK_CTX) or the loaded libraries
 * (TK_LIBRARY, their LIB_LIVE entry). */
static int collect_ctx_locked(struct track_entry *e, void *arg)
{
    if (e->kind == TK_CTX && e->ctx)
        handle_add(arg, e->ctx);
    return 0;
}

static int collect_lib_locked(struct track_entry *e, void *arg)
{
    if (e->kind == TK_LIBRARY && (e->key & 31) == LIB_LIVE)
        handle_add(arg, (void *)(uintptr_t)(e->key >> 5));
    return 0;
}

static void collect(struct handle_list *l, int (*fn)(struct track_entry *, void *))
{
    track_lock();
    track_remove_if_locked(fn, l);
    track_unlock();
}

/* Loads library lib into context c (its first use there): the driver's result, CUDA_SUCCESS when c cannot
 * be made current (destroyed meanwhile: nothing to load into). */
static CUresult lib_force(CUlibrary lib, CUcontext c)
{
    if (!real_cuLibraryGetModule || !real_cuCtxPushCurrent_v2 || !real_cuCtxPopCurrent_v2)
        return CUDA_SUCCESS;
    if (real_cuCtxPushCurrent_v2(c) != CUDA_SUCCESS)
        return CUDA_SUCCESS;
    CUmodule m = NULL;
    CUresult rc = real_cuLibraryGetModule(&m, lib);
    CUcontext popped = NULL;
    real_cuCtxPopCurrent_v2(&popped);
    return rc;
}

/* After a library's load, with the creation lock of every GPU held (library_begin): loads it into every
 * context the process holds (the contexts the shim saw created, and the retained primary ones), so that
 * load_charge measures its copies. 0, or -1 when one does not fit on its GPU (or the list cannot be made):
 * the caller unloads it. Only CUDA_ERROR_OUT_OF_MEMORY refuses: another error (say, no code for that GPU's
 * architecture) loads nothing there, and a first use there fails the same way. */
static int library_force_all(CUlibrary lib)
{
    struct handle_list l = {0};
    /* g_ctxuse is held (load_begin): no context of the list is destroyed meanwhile */
    collect(&l, collect_ctx_locked);
    pthread_mutex_lock(&g_cmu);
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        if (g_primary_refs[d] > 0 && g_primary_ctx[d])
            handle_add(&l, g_primary_ctx[d]);
    pthread_mutex_unlock(&g_cmu);
    int rc = l.failed ? -1 : 0;
    for (size_t i = 0; i < l.n && rc == 0; i++)
        if (lib_force(lib, l.v[i]) == CUDA_ERROR_OUT_OF_MEMORY)
            rc = -1;
    free(l.v);
    return rc;
}

/* A context ctx just created on ordinal dev while libraries are loaded, with g_cnew[dev] held and its own
 * cost settled: loads every loaded library into it, measured as a load is (mem_rise), and charges that to
 * the context (TK_LIBCTX: freed with it, or when the last library is unloaded). 0, or -1 when that does not
 * fit under the limit or on the GPU (the caller destroys or releases the context). */
static int ctx_libs_force(int dev, CUcontext ctx)
{
    if (!vgpu_cfg->enabled || !ctx || __atomic_load_n(&g_nlibs, __ATOMIC_ACQUIRE) <= 0)
        return 0;
    struct handle_list l = {0};
    collect(&l, collect_lib_locked);
    if (l.failed) {
        free(l.v);
        return -1;
    }
    struct mem_reading before = {.pid = (unsigned)hostpid_learned()};
    pthread_mutex_lock(&g_ctxuse); /* no other context destroyed between the readings (see load_begin) */
    mem_read(dev, &before);
    int oom = 0;
    for (size_t i = 0; i < l.n && !oom; i++)
        oom = lib_force(l.v[i], ctx) == CUDA_ERROR_OUT_OF_MEMORY;
    free(l.v);
    uint64_t rise = mem_rise(dev, &before);
    pthread_mutex_unlock(&g_ctxuse);
    if (oom)
        return -1;
    if (!rise)
        return 0;
    int cdev = vgpu_dev_of_cuda(dev);
    if (reserve_as(cdev, rise, "cuCtxCreate (loaded libraries)", 0) != CUDA_SUCCESS)
        return -1;
    uint64_t prev = 0;
    int pdev = -1;
    track_get(TK_LIBCTX, (uint64_t)(uintptr_t)ctx, &prev, &pdev);
    if (track_put(TK_LIBCTX, (uint64_t)(uintptr_t)ctx, prev + rise, cdev, ctx) != 0)
        LOG_ERROR("cannot record a context's libraries of %llu bytes; usage stays charged",
                  (unsigned long long)rise);
    return 0;
}

static CUresult library_loaded(CUresult rc, CUlibrary *lib, struct load_meter *lm, const char *api)
{
    uint64_t cost[VGPU_MAX_DEV];
    int cdev[VGPU_MAX_DEV];
    if (rc == CUDA_SUCCESS && library_force_all(*lib) != 0) { /* lazy loading: its copies come in now */
        if (real_cuLibraryUnload)
            real_cuLibraryUnload(*lib);
        *lib = NULL;
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (rc == CUDA_SUCCESS && load_charge(lm, api, cost, cdev) != 0) {
        if (real_cuLibraryUnload)
            real_cuLibraryUnload(*lib);
        *lib = NULL;
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (rc == CUDA_SUCCESS) {
        for (int d = 0; d < VGPU_MAX_DEV; d++)
            if (cost[d] && track_put(TK_LIBRARY, LIB_KEY(*lib, d), cost[d], cdev[d], NULL) != 0)
                LOG_ERROR("cannot record a library of %llu bytes; usage stays charged", (unsigned long long)cost[d]);
        track_put(TK_LIBRARY, LIB_KEY(*lib, LIB_LIVE), 0, -1, NULL);
        /* from now on, a new context's copy of it is measured (ctx_before) */
        __atomic_add_fetch(&g_nlibs, 1, __ATOMIC_ACQ_REL);
    }
    load_unlock(lm);
    return rc;
}

#define LIBRARY_LOAD_HOOK(name, src_t, src)                                                               \
    EXPORT CUresult name(CUlibrary *lib, src_t src, int *jitOptions, void **jitValues, unsigned int nJit,        \
                         int *libOptions, void **libValues, unsigned int nLib)                                  \
    {                                                                                                           \
        ensure_cuda();                                                                                          \
        REAL_OR_FAIL(name);                                                                                     \
        if (!vgpu_cfg->enabled || !lib)                                                                         \
            return real_##name(lib, src, jitOptions, jitValues, nJit, libOptions, libValues, nLib);             \
        struct load_meter lm;                                                                                   \
        library_begin(&lm);                                                                                     \
        return library_loaded(real_##name(lib, src, jitOptions, jitValues, nJit, libOptions, libValues, nLib),  \
                              lib, &lm, #name);                                                                 \
    }

LIBRARY_LOAD_HOOK(cuLibraryLoadData, const void *, code)
LIBRARY_LOAD_HOOK(cuLibraryLoadFromFile, const char *, fileName)

/* Called with the track lock held: every context's copies of libraries (the last library is gone). */
static int drop_libctx_locked(struct track_entry *e, void *arg)
{
    uint64_t *freed = arg;
    if (e->kind != TK_LIBCTX)
        return 0;
    if (e->dev >= 0 && e->dev < VGPU_MAX_DEV)
        freed[e->dev] += e->size;
    return 1;
}

EXPORT CUresult cuLibraryUnload(CUlibrary lib)
{
    ensure_cuda();
    REAL_OR_FAIL(cuLibraryUnload);
    if (!vgpu_cfg->enabled)
        return real_cuLibraryUnload(lib);
    struct load_meter lm;
    unload_begin(&lm); /* see cuModuleUnload */
    CUresult rc = real_cuLibraryUnload(lib);
    if (rc != CUDA_SUCCESS) {
        load_unlock(&lm);
        return rc;
    }
    uint64_t size = 0;
    int dev = -1;
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        if (track_take(TK_LIBRARY, LIB_KEY(lib, d), &size, &dev) && size)
            region_release(dev, size);
    if (track_take(TK_LIBRARY, LIB_KEY(lib, LIB_LIVE), &size, &dev) &&
        __atomic_sub_fetch(&g_nlibs, 1, __ATOMIC_ACQ_REL) == 0) {
        /* no library is loaded any more: no context holds a copy of one */
        uint64_t freed[VGPU_MAX_DEV] = {0};
        track_lock();
        track_remove_if_locked(drop_libctx_locked, freed);
        track_unlock();
        release_freed(freed);
    }
    load_unlock(&lm);
    return rc;
}

/* ------------------------------------------------------------------ allocations */
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemAlloc_v2);
    CUdevice dev;
    CUcontext ctx;
    if (!vgpu_cfg->enabled || !dptr || !bytesize || current_device(&dev, &ctx))
        return real_cuMemAlloc_v2(dptr, bytesize);
    CUresult rc = reserve(dev, bytesize, "cuMemAlloc");
    if (rc)
        return rc;
    rc = real_cuMemAlloc_v2(dptr, bytesize);
    return finish(rc, TK_PTR, rc ? 0 : *dptr, bytesize, dev, ctx);
}

/* cuCtxSetLimit: the limits the driver backs with device memory of the context's device -- the
 * in-kernel malloc heap (CU_LIMIT_MALLOC_HEAP_SIZE, 2), the printf FIFO (1) and the stack of every
 * thread that can be resident (CU_LIMIT_STACK_SIZE, 0: bytes per thread x SMs x threads per SM) --
 * are charged like allocations, to the context (released when it goes), and refused with
 * CUDA_ERROR_OUT_OF_MEMORY when they would pass the limit. Raising a limit charges the difference;
 * lowering it gives the difference back once the driver took the new value. A kernel launch that makes
 * the driver grow the stack is charged by the same rule (stack_cover). */
static pthread_mutex_t g_limit_mu = PTHREAD_MUTEX_INITIALIZER; /* one limit change of the process at a time */

/* The device memory limit `limit` set to `value` takes on dev (bytes). */
static uint64_t limit_bytes(CUdevice dev, int limit, size_t value)
{
    if (limit != CU_LIMIT_STACK_SIZE)
        return value;
    int sms = 0, threads = 0;
    if (!real_cuDeviceGetAttribute || real_cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) ||
        real_cuDeviceGetAttribute(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev) ||
        sms <= 0 || threads <= 0) {
        sms = 256; /* unknown: assume a large GPU (never under-count) */
        threads = 2048;
    }
    uint64_t per = (uint64_t)sms * (uint64_t)threads;
    return value > UINT64_MAX / per ? UINT64_MAX : (uint64_t)value * per;
}

/* Charges context ctx's limit at value. driver: cuCtxSetLimit (the driver takes the new value; a lower one
 * gives the difference back); else a launch about to make the driver grow it: only ever raises the charge,
 * the driver not called. CUDA_ERROR_OUT_OF_MEMORY (nothing changed) when the rise does not fit. */
static CUresult limit_charge(CUdevice dev, CUcontext ctx, int limit, size_t value, int driver, const char *api)
{
    uint64_t bytes = limit_bytes(dev, limit, value);
    uint64_t key = (uint64_t)(uintptr_t)ctx + (uint64_t)limit; /* contexts are aligned: unique per limit */
    uint64_t old = 0;
    int odev = dev;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_limit_mu);
    if (!track_get(TK_LIMIT, key, &old, &odev))
        old = 0;
    if (!driver && bytes <= old) {
        pthread_mutex_unlock(&g_limit_mu);
        return CUDA_SUCCESS; /* already charged */
    }
    if (bytes > old) {
        rc = reserve(dev, bytes - old, api);
        if (rc == CUDA_SUCCESS && driver) {
            rc = real_cuCtxSetLimit(limit, value);
            if (rc != CUDA_SUCCESS)
                region_release(dev, bytes - old);
        }
    } else {
        rc = real_cuCtxSetLimit(limit, value);
        if (rc == CUDA_SUCCESS && old > bytes)
            region_release(dev, old - bytes);
    }
    if (rc == CUDA_SUCCESS && track_put(TK_LIMIT, key, bytes, dev, ctx) != 0)
        LOG_ERROR("cannot record a context limit of %llu bytes; it stays charged", (unsigned long long)bytes);
    pthread_mutex_unlock(&g_limit_mu);
    return rc;
}

EXPORT CUresult cuCtxSetLimit(int limit, size_t value)
{
    ensure_cuda();
    REAL_OR_FAIL(cuCtxSetLimit);
    CUdevice dev;
    CUcontext ctx;
    if (!vgpu_cfg->enabled || limit < 0 || limit > 2 || current_device(&dev, &ctx))
        return real_cuCtxSetLimit(limit, value);
    return limit_charge(dev, ctx, limit, value, 1, "cuCtxSetLimit");
}

/* ------------------------------------------------------------------ stacks grown at launch */
/* A kernel whose threads need more local memory (CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: local arrays, a deep
 * stack) than the context's stack size makes the driver grow the stack at launch, for every thread that can
 * be resident, and keep it: the same memory cuCtxSetLimit(CU_LIMIT_STACK_SIZE) takes. Before such a launch
 * the growth is charged to the context by cuCtxSetLimit's rule (limit_charge, kept until the context goes or
 * the program sets a lower stack) or the launch is refused with CUDA_ERROR_OUT_OF_MEMORY. A kernel within
 * the default stack costs one cuFuncGetAttribute: no lock, no I/O, no allocation. No per-function cache: a
 * function's handle may be another kernel's after its module is unloaded. */
#define STACK_DEFAULT 1024u /* the driver's default stack (bytes per thread): part of the context's cost */

/* The local memory per thread of f (a CUfunction, or a CUkernel cast to one); 0 when the driver cannot tell
 * (the launch then fails there). */
static uint64_t func_local(CUfunction f)
{
    int local = 0;
    if (real_cuFuncGetAttribute && real_cuFuncGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f) == CUDA_SUCCESS)
        return local > 0 ? (uint64_t)local : 0;
    CUdevice ord;
    if (real_cuKernelGetAttribute && real_cuCtxGetDevice && real_cuCtxGetDevice(&ord) == CUDA_SUCCESS &&
        real_cuKernelGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, (CUkernel)f, ord) == CUDA_SUCCESS)
        return local > 0 ? (uint64_t)local : 0;
    return 0;
}

/* Charges the current context's stack for `local` bytes per thread (api: for the log). */
static CUresult stack_cover(uint64_t local, const char *api)
{
    CUdevice dev;
    CUcontext ctx;
    if (local <= STACK_DEFAULT || current_device(&dev, &ctx))
        return CUDA_SUCCESS;
    return limit_charge(dev, ctx, CU_LIMIT_STACK_SIZE, (size_t)local, 0, api);
}

CUresult memory_launch_stack(CUfunction f)
{
    if (!vgpu_cfg->enabled || !f)
        return CUDA_SUCCESS;
    uint64_t local = func_local(f);
    return UNLIKELY(local > STACK_DEFAULT) ? stack_cover(local, "a kernel launch (its stack)") : CUDA_SUCCESS;
}

/* cuLaunchCooperativeKernelMultiDevice: each entry's kernel in its stream's context (the current one for
 * the NULL stream). */
CUresult memory_launch_stack_multi(const CUDA_LAUNCH_PARAMS *list, unsigned int n)
{
    if (!vgpu_cfg->enabled || !list)
        return CUDA_SUCCESS;
    for (unsigned int i = 0; i < n && i < VGPU_MAX_DEV; i++) {
        uint64_t local = func_local(list[i].function);
        if (local <= STACK_DEFAULT)
            continue;
        CUcontext sc = NULL, cur = NULL;
        int pushed = list[i].hStream && real_cuStreamGetCtx && real_cuStreamGetCtx(list[i].hStream, &sc) == CUDA_SUCCESS &&
                     sc && real_cuCtxGetCurrent && real_cuCtxGetCurrent(&cur) == CUDA_SUCCESS && sc != cur &&
                     real_cuCtxPushCurrent_v2 && real_cuCtxPopCurrent_v2 && real_cuCtxPushCurrent_v2(sc) == CUDA_SUCCESS;
        CUresult rc = stack_cover(local, "cuLaunchCooperativeKernelMultiDevice (its stack)");
        if (pushed)
            real_cuCtxPopCurrent_v2(&cur);
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    return CUDA_SUCCESS;
}

/* graph_walk_kernels visitor: raises *(uint64_t *)arg to a kernel node's local memory per thread. */
static void most_local(const CUDA_KERNEL_NODE_PARAMS *p, void *arg)
{
    uint64_t *most = arg;
    uint64_t local = func_local(p->func);
    *most = local > *most ? local : *most;
}

CUresult memory_graph_stack(CUgraph graph)
{
    if (!vgpu_cfg->enabled || !graph)
        return CUDA_SUCCESS;
    uint64_t most = 0;
    graph_walk_kernels(graph, most_local, &most); /* what cannot be read is not checked (docs/shim.md) */
    return stack_cover(most, "a graph instantiation (its kernels' stack)");
}

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemAllocManaged);
    CUdevice dev;
    CUcontext ctx;
    if (!vgpu_cfg->enabled || !dptr || !bytesize || current_device(&dev, &ctx))
        return real_cuMemAllocManaged(dptr, bytesize, flags);
    CUresult rc = reserve(dev, bytesize, "cuMemAllocManaged");
    if (rc)
        return rc;
    rc = real_cuMemAllocManaged(dptr, bytesize, flags);
    return finish(rc, TK_PTR, rc ? 0 : *dptr, bytesize, dev, ctx);
}

EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemAllocPitch_v2);
    CUdevice dev;
    CUcontext ctx;
    if (!vgpu_cfg->enabled || !dptr || !pitch || !width || !height || current_device(&dev, &ctx))
        return real_cuMemAllocPitch_v2(dptr, pitch, width, height, elem);
    /* the driver picks the pitch: reserve the usual 512-byte-aligned estimate, then adjust */
    uint64_t est = (((uint64_t)width + 511) & ~511ull) * height;
    CUresult rc = reserve(dev, est, "cuMemAllocPitch");
    if (rc)
        return rc;
    rc = real_cuMemAllocPitch_v2(dptr, pitch, width, height, elem);
    if (rc != CUDA_SUCCESS) {
        region_release(dev, est);
        return rc;
    }
    uint64_t actual = (uint64_t)*pitch * height;
    if (actual > est) {
        if (reserve(dev, actual - est, "cuMemAllocPitch") != CUDA_SUCCESS) {
            if (real_cuMemFree_v2)
                real_cuMemFree_v2(*dptr);
            region_release(dev, est);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else if (actual < est) {
        region_release(dev, est - actual);
    }
    return finish(rc, TK_PTR, *dptr, actual, dev, ctx);
}

/* An allocation from pool `pool` (NULL: unknown) of container GPU dev: takes from the pool's charged
 * excess first, reserves the rest, records the pool with the allocation and re-reads its reserve. */
static CUresult pooled_alloc(CUresult (*call)(void *), void *arg, CUdeviceptr *dptr, size_t bytesize,
                             CUmemoryPool pool, int dev, CUcontext ctx, const char *api)
{
    int ix = pool ? pool_index(pool, dev) : 0;
    if (pool && !ix) { /* every pool account in use: its reserve could not be charged, so nothing is let through */
        region_count_refusal();
        LOG_WARN("%s: more than %d memory pools in use by this process; allocation refused", api, MAX_POOLS);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (!ix) { /* no pool known: the allocation alone */
        CUresult rc = reserve(dev, bytesize, api);
        if (rc)
            return rc;
        rc = call(arg);
        return finish(rc, TK_PTR, rc ? 0 : *dptr, bytesize, dev, ctx);
    }
    pthread_mutex_lock(&g_pool_mu);
    uint64_t taken = pool_take(ix, bytesize), need = bytesize - taken;
    /* what the pool's reserve grows by, in the driver's steps, is charged before the driver is called */
    uint64_t charge = need ? (need + POOL_GRAIN - 1) & ~(POOL_GRAIN - 1) : 0;
    if (charge < need)
        charge = need;
    CUresult rc = charge ? reserve(dev, charge, api) : CUDA_SUCCESS;
    if (rc) {
        pool_put(ix, bytesize, 1, taken); /* nothing was reserved for the rest */
        pthread_mutex_unlock(&g_pool_mu);
        return rc;
    }
    rc = call(arg);
    if (rc != CUDA_SUCCESS) {
        uint64_t back = pool_put(ix, bytesize, 1, taken) + (charge - need);
        if (back)
            region_release(dev, back);
        pthread_mutex_unlock(&g_pool_mu);
        return rc;
    }
    track_lock();
    g_pools[ix - 1].live += need;
    g_pools[ix - 1].excess += charge - need; /* until the re-read below says what the pool holds */
    track_unlock();
    if (track_put(TK_PTR, *dptr, bytesize, dev, ctx) != 0)
        LOG_ERROR("cannot record allocation of %llu bytes; usage stays charged", (unsigned long long)bytesize);
    else {
        track_lock();
        struct track_entry *e = track_find_locked(TK_PTR, *dptr);
        if (e)
            e->pool = (uint16_t)ix;
        track_unlock();
    }
    pool_sync(ix);
    pthread_mutex_unlock(&g_pool_mu);
    return rc;
}

struct async_args {
    cuMemAllocAsync_fn fn;
    cuMemAllocFromPoolAsync_fn pfn;
    CUdeviceptr *dptr;
    size_t bytes;
    CUmemoryPool pool;
    CUstream s;
};

static CUresult call_async(void *a)
{
    struct async_args *x = a;
    return x->fn ? x->fn(x->dptr, x->bytes, x->s) : x->pfn(x->dptr, x->bytes, x->pool, x->s);
}

/* 1 when stream s is being captured: an allocation or free on it is recorded into a graph (an allocation
 * or free node), not made; the graph's memory is charged when it is launched (graph memory nodes, below).
 * ptsz: the caller is a _ptsz entry point, whose NULL stream is the thread's per-thread default stream
 * (CU_STREAM_PER_THREAD), which can be captured; the legacy NULL stream cannot. */
static int capturing(CUstream s, int ptsz)
{
    int st = CU_STREAM_CAPTURE_STATUS_NONE;
    if (!s && ptsz)
        s = (CUstream)(uintptr_t)2; /* CU_STREAM_PER_THREAD */
    return s && real_cuStreamIsCapturing && real_cuStreamIsCapturing(s, &st) == CUDA_SUCCESS &&
           st != CU_STREAM_CAPTURE_STATUS_NONE;
}

static CUresult alloc_async(cuMemAllocAsync_fn fn, CUdeviceptr *dptr, size_t bytesize, CUstream s, int ptsz)
{
    CUdevice dev;
    CUcontext ctx;
    if (!vgpu_cfg->enabled || !dptr || !bytesize || capturing(s, ptsz) || current_device(&dev, &ctx))
        return fn(dptr, bytesize, s);
    /* the device's current pool, which cuMemAllocAsync allocates from */
    CUdevice ord;
    CUmemoryPool pool = NULL;
    if (!real_cuCtxGetDevice || real_cuCtxGetDevice(&ord) != CUDA_SUCCESS || !real_cuDeviceGetMemPool ||
        real_cuDeviceGetMemPool(&pool, ord) != CUDA_SUCCESS)
        pool = NULL;
    struct async_args a = {.fn = fn, .dptr = dptr, .bytes = bytesize, .s = s};
    return pooled_alloc(call_async, &a, dptr, bytesize, pool, dev, ctx, "cuMemAllocAsync");
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemAllocAsync);
    return alloc_async(real_cuMemAllocAsync, dptr, bytesize, s, 0);
}

EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream s)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemAllocAsync_ptsz);
    return alloc_async(real_cuMemAllocAsync_ptsz, dptr, bytesize, s, 1);
}

static CUresult alloc_pool(cuMemAllocFromPoolAsync_fn fn, CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                           CUstream s, int ptsz)
{
    CUdevice dev;
    CUcontext ctx;
    if (!vgpu_cfg->enabled || !dptr || !bytesize || capturing(s, ptsz) || current_device(&dev, &ctx))
        return fn(dptr, bytesize, pool, s);
    uint64_t unused;
    int pdev;
    if (track_get(TK_POOL, (uint64_t)(uintptr_t)pool, &unused, &pdev))
        dev = pdev; /* a pool created for another device */
    struct async_args a = {.pfn = fn, .dptr = dptr, .bytes = bytesize, .pool = pool, .s = s};
    return pooled_alloc(call_async, &a, dptr, bytesize, pool, dev, ctx, "cuMemAllocFromPoolAsync");
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemAllocFromPoolAsync);
    return alloc_pool(real_cuMemAllocFromPoolAsync, dptr, bytesize, pool, s, 0);
}

EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemAllocFromPoolAsync_ptsz);
    return alloc_pool(real_cuMemAllocFromPoolAsync_ptsz, dptr, bytesize, pool, s, 1);
}

EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemPoolCreate);
    CUresult rc = real_cuMemPoolCreate(pool, props);
    if (rc == CUDA_SUCCESS && vgpu_cfg->enabled && pool && props && props->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        track_put(TK_POOL, (uint64_t)(uintptr_t)*pool, 0, vgpu_dev_of_cuda(props->location.id), NULL);
    return rc;
}

EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemPoolDestroy);
    CUresult rc = real_cuMemPoolDestroy(pool);
    if (rc == CUDA_SUCCESS && vgpu_cfg->enabled) {
        uint64_t s;
        int d;
        track_take(TK_POOL, (uint64_t)(uintptr_t)pool, &s, &d);
        /* the driver releases the pool's reserve; live allocations stay charged until freed */
        uint64_t excess[MAX_POOLS];
        int devs[MAX_POOLS], n = 0;
        pthread_mutex_lock(&g_pool_mu);
        track_lock();
        for (int i = 0; i < g_npools; i++)
            if (g_pools[i].pool == pool && !g_pools[i].gone) {
                g_pools[i].gone = 1;
                excess[n] = g_pools[i].excess;
                devs[n++] = g_pools[i].dev;
                g_pools[i].excess = 0;
            }
        track_unlock();
        for (int i = 0; i < n; i++)
            if (excess[i])
                region_release(devs[i], excess[i]);
        pthread_mutex_unlock(&g_pool_mu);
    }
    return rc;
}

EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemPoolTrimTo);
    CUresult rc = real_cuMemPoolTrimTo(pool, keep);
    if (rc == CUDA_SUCCESS && vgpu_cfg->enabled) {
        int ix = 0;
        track_lock();
        for (int i = 0; i < g_npools && !ix; i++)
            if (g_pools[i].pool == pool && !g_pools[i].gone)
                ix = i + 1;
        track_unlock();
        pool_sync(ix);
    }
    return rc;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemCreate);
    if (!vgpu_cfg->enabled || !handle || !size || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        prop->location.id < 0 || prop->location.id >= VGPU_MAX_DEV)
        return real_cuMemCreate(handle, size, prop, flags); /* host-located memory is not counted */
    int dev = vgpu_dev_of_cuda(prop->location.id);
    if (dev < 0)
        return real_cuMemCreate(handle, size, prop, flags);
    CUcontext ctx = NULL;
    if (real_cuCtxGetCurrent)
        real_cuCtxGetCurrent(&ctx);
    CUresult rc = reserve(dev, size, "cuMemCreate");
    if (rc)
        return rc;
    rc = real_cuMemCreate(handle, size, prop, flags);
    return finish(rc, TK_HANDLE, rc ? 0 : *handle, size, dev, ctx);
}

static uint64_t format_bytes(int f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
        return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
        return 2;
    default:
        return 4;
    }
}

static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, int fmt, unsigned ch)
{
    return w * (h ? h : 1) * (d ? d : 1) * format_bytes(fmt) * (ch ? ch : 1);
}

/* cuArrayCreate_v2 and cuArray3DCreate_v2: the same rule over their two descriptor types (depth: the
 * descriptor's depth expression, 0 for 2D). */
#define ARRAY_CREATE_HOOK(name, desc_t, depth, what)                                                 \
    EXPORT CUresult name(CUarray *arr, const desc_t *desc)                                           \
    {                                                                                                \
        ensure_cuda();                                                                               \
        REAL_OR_FAIL(name);                                                                          \
        CUdevice dev;                                                                                \
        CUcontext ctx;                                                                               \
        if (!vgpu_cfg->enabled || !arr || !desc || current_device(&dev, &ctx))                       \
            return real_##name(arr, desc);                                                           \
        uint64_t b = array_bytes(desc->Width, desc->Height, depth, desc->Format, desc->NumChannels); \
        CUresult rc = reserve(dev, b, what);                                                         \
        if (rc)                                                                                      \
            return rc;                                                                               \
        rc = real_##name(arr, desc);                                                                 \
        return finish(rc, TK_ARRAY, rc ? 0 : (uint64_t)(uintptr_t)*arr, b, dev, ctx);                \
    }

ARRAY_CREATE_HOOK(cuArrayCreate_v2, CUDA_ARRAY_DESCRIPTOR, 0, "cuArrayCreate")
ARRAY_CREATE_HOOK(cuArray3DCreate_v2, CUDA_ARRAY3D_DESCRIPTOR, desc->Depth, "cuArray3DCreate")

EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned int levels)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMipmappedArrayCreate);
    CUdevice dev;
    CUcontext ctx;
    if (!vgpu_cfg->enabled || !arr || !desc || !levels || current_device(&dev, &ctx))
        return real_cuMipmappedArrayCreate(arr, desc, levels);
    uint64_t w = desc->Width, h = desc->Height, d = desc->Depth, b = 0;
    for (unsigned l = 0; l < levels && l < 64; l++) {
        b += array_bytes(w, h, d, desc->Format, desc->NumChannels);
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : h;
        d = d > 1 ? d / 2 : d;
    }
    CUresult rc = reserve(dev, b, "cuMipmappedArrayCreate");
    if (rc)
        return rc;
    rc = real_cuMipmappedArrayCreate(arr, desc, levels);
    return finish(rc, TK_MIPMAP, rc ? 0 : (uint64_t)(uintptr_t)*arr, b, dev, ctx);
}

/* ------------------------------------------------------------------ frees */
#define FREE_BODY(kind, key, call)                                  \
    do {                                                            \
        uint64_t size_;                                             \
        int dev_;                                                   \
        if (!vgpu_cfg->enabled)                                         \
            return call;                                            \
        int found_ = track_take(kind, key, &size_, &dev_);          \
        CUresult rc_ = call;                                        \
        if (found_)                                                 \
            release_tracked(kind, key, rc_, size_, dev_, NULL);     \
        return rc_;                                                 \
    } while (0)

/* Frees of device pointers: as FREE_BODY, but memory from a pool goes back to the pool's reserve. */
#define FREE_PTR_BODY(key, call)                                    \
    do {                                                            \
        if (!vgpu_cfg->enabled)                                         \
            return call;                                            \
        uint64_t size_ = 0;                                         \
        int dev_ = -1, ix_ = 0;                                     \
        CUcontext ctx_ = NULL;                                      \
        track_lock();                                               \
        struct track_entry *e_ = track_find_locked(TK_PTR, key);    \
        if (e_) {                                                   \
            size_ = e_->size;                                       \
            dev_ = e_->dev;                                         \
            ix_ = e_->pool;                                         \
            ctx_ = e_->ctx;                                         \
            track_remove_locked(e_);                                \
        }                                                           \
        track_unlock();                                             \
        CUresult rc_ = call;                                        \
        if (!e_) { /* perhaps a graph's allocation: its pool's reserve */ \
            if (rc_ == CUDA_SUCCESS)                                \
                gmem_sync_all();                                    \
            return rc_;                                             \
        }                                                           \
        if (rc_ != CUDA_SUCCESS) {                                  \
            free_failed(key, size_, dev_, ctx_, ix_);               \
        } else if (ix_) {                                           \
            pthread_mutex_lock(&g_pool_mu);                         \
            uint64_t now_ = pool_put(ix_, size_, 0, 0);             \
            if (now_)                                               \
                region_release(dev_, now_);                         \
            pool_sync(ix_);                                         \
            pthread_mutex_unlock(&g_pool_mu);                       \
        } else {                                                    \
            region_release(dev_, size_);                            \
        }                                                           \
        return rc_;                                                 \
    } while (0)

/* The driver kept an allocation the program tried to free: record it again. */
static void free_failed(uint64_t key, uint64_t size, int dev, CUcontext ctx, int ix)
{
    track_put(TK_PTR, key, size, dev, ctx);
    if (ix) {
        track_lock();
        struct track_entry *e = track_find_locked(TK_PTR, key);
        if (e)
            e->pool = (uint16_t)ix;
        track_unlock();
    }
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemFree_v2);
    if (!dptr)
        return real_cuMemFree_v2(dptr);
    FREE_PTR_BODY(dptr, real_cuMemFree_v2(dptr));
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemFreeAsync);
    if (vgpu_cfg->enabled && capturing(s, 0)) /* a free node: frees when the graph runs, charged till then */
        return real_cuMemFreeAsync(dptr, s);
    FREE_PTR_BODY(dptr, real_cuMemFreeAsync(dptr, s));
}

EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemFreeAsync_ptsz);
    if (vgpu_cfg->enabled && capturing(s, 1))
        return real_cuMemFreeAsync_ptsz(dptr, s);
    FREE_PTR_BODY(dptr, real_cuMemFreeAsync_ptsz(dptr, s));
}

/* ---- VMM: cuMemCreate's physical memory stays charged until the handle is released *and* every
 * mapping of it is unmapped, as the driver keeps it (release-while-mapped is the CUDA samples'
 * pattern). The mappings are recorded in track.c. */
/* Caller holds the track lock. Drops a released, unmapped handle no other reference holds; returns 1
 * (and its size/dev) if it was. A handle ever exported as a shareable handle is never dropped here: the
 * file descriptor (or a process it was passed to) keeps the memory allocated, and the shim cannot see it
 * closed, so it stays charged until its context goes or the process exits. */
static int handle_gone_locked(struct track_entry *e, uint64_t *size, int *dev)
{
    if (!e->released || e->maps || e->refs || e->exported || e->exporting)
        return 0;
    *size = e->size;
    *dev = e->dev;
    track_remove_locked(e);
    return 1;
}

/* Caller holds the track lock. A mapping of handle is gone: a released handle with no mapping left is
 * added to freed[] (per device). */
static void unmapped_locked(uint64_t handle, void *freed_)
{
    uint64_t *freed = freed_;
    struct track_entry *e = track_find_locked(TK_HANDLE, handle);
    if (e && e->maps)
        e->maps--;
    uint64_t b;
    int d;
    if (e && handle_gone_locked(e, &b, &d) && d >= 0 && d < VGPU_MAX_DEV)
        freed[d] += b;
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemRelease);
    CUresult rc = real_cuMemRelease(handle);
    if (rc != CUDA_SUCCESS || !vgpu_cfg->enabled)
        return rc;
    uint64_t size = 0;
    int dev = -1, gone = 0;
    track_lock();
    struct track_entry *e = track_find_locked(TK_HANDLE, handle);
    if (e && e->refs) { /* a reference cuMemRetainAllocationHandle took (the same handle value) */
        e->refs--;
        gone = handle_gone_locked(e, &size, &dev);
    } else if (e && !e->released) {
        e->released = 1;
        gone = handle_gone_locked(e, &size, &dev);
    }
    track_unlock();
    if (gone)
        region_release(dev, size);
    return rc;
}

/* The driver hands out the mapped handle again with one more reference, which needs its own cuMemRelease:
 * until then the physical memory stays allocated (and charged), unmapped or not. The reference is counted
 * before the driver's call (the handle of the mapping holding addr), so that another thread's unmap and
 * release meanwhile cannot drop the handle the driver is handing out; given back if the call fails. */
EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemRetainAllocationHandle);
    if (!vgpu_cfg->enabled || !handle)
        return real_cuMemRetainAllocationHandle(handle, addr);
    uint64_t held = 0;
    track_lock();
    struct track_entry *e = track_map_find_locked((uint64_t)(uintptr_t)addr, &held) ?
                            track_find_locked(TK_HANDLE, held) : NULL;
    if (e && e->refs < UINT32_MAX)
        e->refs++;
    else
        held = 0;
    track_unlock();
    CUresult rc = real_cuMemRetainAllocationHandle(handle, addr);
    uint64_t size = 0;
    int dev = -1, gone = 0;
    track_lock();
    if (held && (rc != CUDA_SUCCESS || *handle != held)) { /* the early reference was not the one handed out */
        e = track_find_locked(TK_HANDLE, held);
        if (e) { /* a release meanwhile may have taken the reference from refs, as cuMemRelease counts */
            if (e->refs)
                e->refs--;
            else
                e->released = 1;
            gone = handle_gone_locked(e, &size, &dev);
        }
        held = 0;
    }
    if (rc == CUDA_SUCCESS && !held) {
        e = track_find_locked(TK_HANDLE, *handle);
        if (e && e->refs < UINT32_MAX)
            e->refs++;
    }
    track_unlock();
    if (gone)
        region_release(dev, size);
    return rc;
}

/* A shareable handle (a file descriptor, or one passed to another process) keeps the memory allocated after
 * every cuMemRelease and cuMemUnmap here: the handle stays charged (handle_gone_locked). While the driver
 * exports it, another thread's release and unmap cannot drop it either (exporting). */
EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                             int handleType, unsigned long long flags)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemExportToShareableHandle);
    if (!vgpu_cfg->enabled)
        return real_cuMemExportToShareableHandle(shareableHandle, handle, handleType, flags);
    track_lock();
    struct track_entry *e = track_find_locked(TK_HANDLE, handle);
    int held = e && e->exporting < UINT32_MAX;
    if (held)
        e->exporting++;
    track_unlock();
    CUresult rc = real_cuMemExportToShareableHandle(shareableHandle, handle, handleType, flags);
    if (!held)
        return rc;
    uint64_t size = 0;
    int dev = -1, gone = 0;
    track_lock();
    e = track_find_locked(TK_HANDLE, handle); /* kept while exporting: found */
    if (e) {
        if (e->exporting)
            e->exporting--;
        if (rc == CUDA_SUCCESS)
            e->exported = 1;
        gone = handle_gone_locked(e, &size, &dev); /* a failed export of a handle released meanwhile */
    }
    track_unlock();
    if (gone)
        region_release(dev, size);
    return rc;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemMap);
    if (!vgpu_cfg->enabled)
        return real_cuMemMap(ptr, size, offset, handle, flags);
    /* the mapping is counted before the driver's call, so that another thread's cuMemRelease meanwhile cannot
     * drop a handle the driver is mapping; given back if the call fails */
    track_lock();
    struct track_entry *e = track_find_locked(TK_HANDLE, handle);
    int held = e && e->maps < UINT32_MAX; /* handles the shim did not create (imported) are not charged here */
    if (held)
        e->maps++;
    track_unlock();
    CUresult rc = real_cuMemMap(ptr, size, offset, handle, flags);
    if (!held)
        return rc;
    uint64_t bytes = 0;
    int dev = -1, gone = 0;
    track_lock();
    e = track_find_locked(TK_HANDLE, handle); /* kept while counted as mapped: found */
    if (e && rc == CUDA_SUCCESS) {
        if (track_map_add_locked(ptr, size, handle) != 0) /* never unmapped in our books: stays charged */
            LOG_ERROR("cannot record a mapping; its memory stays charged until the process exits");
    } else if (e) {
        if (e->maps)
            e->maps--;
        gone = handle_gone_locked(e, &bytes, &dev);
    }
    track_unlock();
    if (gone)
        region_release(dev, bytes);
    return rc;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemUnmap);
    CUresult rc = real_cuMemUnmap(ptr, size);
    if (rc != CUDA_SUCCESS || !vgpu_cfg->enabled)
        return rc;
    uint64_t freed[VGPU_MAX_DEV] = {0};
    track_lock();
    track_unmap_range_locked(ptr, size, unmapped_locked, freed);
    track_unlock();
    release_freed(freed);
    return rc;
}

EXPORT CUresult cuArrayDestroy(CUarray arr)
{
    ensure_cuda();
    REAL_OR_FAIL(cuArrayDestroy);
    FREE_BODY(TK_ARRAY, (uint64_t)(uintptr_t)arr, real_cuArrayDestroy(arr));
}

EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray arr)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMipmappedArrayDestroy);
    FREE_BODY(TK_MIPMAP, (uint64_t)(uintptr_t)arr, real_cuMipmappedArrayDestroy(arr));
}

/* ------------------------------------------------------------------ reporting */
EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b)
{
    ensure_cuda();
    REAL_OR_FAIL(cuMemGetInfo_v2);
    if (vgpu_cfg->enabled && __atomic_load_n(&g_npools, __ATOMIC_RELAXED))
        pools_sync_all(); /* report what the pools hold now */
    if (vgpu_cfg->enabled)
        gmem_sync_all(); /* and the graph pools */
    CUresult rc = real_cuMemGetInfo_v2(free_b, total_b);
    CUdevice dev;
    if (rc != CUDA_SUCCESS || !vgpu_cfg->enabled || !free_b || !total_b || current_device(&dev, NULL))
        return rc;
    uint64_t lim;
    if (!vgpu_mem_limit(dev, &lim))
        return rc;
    uint64_t total = lim < *total_b ? lim : *total_b;
    uint64_t used = region_used(dev);
    uint64_t avail = used >= total ? 0 : total - used;
    if (avail > *free_b)
        avail = *free_b; /* never promise more than the GPU has free */
    *total_b = (size_t)total;
    *free_b = (size_t)avail;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    ensure_cuda();
    REAL_OR_FAIL(cuDeviceTotalMem_v2);
    CUresult rc = real_cuDeviceTotalMem_v2(bytes, dev);
    uint64_t lim;
    if (rc == CUDA_SUCCESS && vgpu_cfg->enabled && bytes && vgpu_mem_limit(vgpu_dev_of_cuda(dev), &lim) && lim < *bytes)
        *bytes = (size_t)lim;
    return rc;
}

/* The container's view of GPU `d`'s memory, over what NVML answered: *total = the limit (never more
 * than the GPU has), *used = the container's accounted usage (at most the limit), *free = the rest.
 * Returns 0, changing nothing, when the GPU has no memory limit; 1 otherwise. */
static int nvml_mem_view(nvmlDevice_t d, unsigned long long *total, unsigned long long *used,
                         unsigned long long *free_)
{
    int dev = vgpu_dev_of_nvml(d);
    uint64_t lim;
    if (!vgpu_mem_limit(dev, &lim))
        return 0;
    uint64_t u = region_used(dev);
    if (lim > *total)
        lim = *total; /* never more than the GPU has */
    *total = lim;
    *used = u > lim ? lim : u;
    *free_ = lim - *used;
    return 1;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    vgpu_nvml_load();
    nvmlReturn_t rc = vnvml_memory(d, m);
    if (rc == NVML_SUCCESS && vgpu_cfg->enabled && m)
        nvml_mem_view(d, &m->total, &m->used, &m->free);
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    vgpu_nvml_load();
    nvmlReturn_t rc = vnvml_memory_v2(d, m);
    if (rc == NVML_SUCCESS && vgpu_cfg->enabled && m && nvml_mem_view(d, &m->total, &m->used, &m->free))
        m->reserved = 0;
    return rc;
}

/* ------------------------------------------------------------------ graph memory nodes
 * A graph's allocation nodes (cuGraphAddMemAllocNode, or cuMemAllocAsync captured from a stream) take their
 * memory from the device's graph memory pool when the graph is launched (or uploaded), not when the node is
 * made; the pool keeps what it reserved (device memory the process holds) until cuDeviceGraphMemTrim, and an
 * allocation the graph does not free stays allocated after the launch until cuMemFree / cuMemFreeAsync.
 * Two rules, per CUDA ordinal:
 * - before a launch or upload, what its allocation nodes can take on the device (recorded at instantiation,
 *   TK_GRAPHMEM: their sizes summed, or, where the admin chose it (graph_memory=peak), the most they can hold
 *   at once over the graph's order, see "the peak of a graph's allocations"; child graphs walked) beyond what
 *   the pool has reserved and unused is reserved under the limit, or the call is refused with
 *   CUDA_ERROR_OUT_OF_MEMORY: never more than the limit on the GPU;
 * - the pool's reserve, read from the driver (cuDeviceGetGraphMemAttribute RESERVED_MEM_CURRENT) after every
 *   launch, upload, trim, executable graph destroyed, context destroyed, free of memory the shim did not
 *   allocate, and at every cuMemGetInfo, is what the process is charged for the pool (g_gmem). Not known
 *   (the driver cannot be asked): what is charged stays charged.
 * g_gmu serialises the reads and the charge, and is held from the check of a launch (or upload) of a graph
 * with allocation nodes to the read after it, so that two launches never both count on the same unused
 * reserve; it is taken before the pools' lock, never after it. */
static uint64_t g_gmem[VGPU_MAX_DEV]; /* bytes charged for the graph pool of CUDA ordinal d */
static uint32_t g_gmem_seen;         /* ordinals whose graph pool this process may use (a bit each) */
static pthread_mutex_t g_gmu = PTHREAD_MUTEX_INITIALIZER;

/* The graph pool's reserve and use on ordinal ord: 0, or -1 when the driver cannot tell. */
static int gmem_read(int ord, uint64_t *reserved, uint64_t *used)
{
    cuuint64_t r = 0, u = 0;
    if (!real_cuDeviceGetGraphMemAttribute ||
        real_cuDeviceGetGraphMemAttribute(ord, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &r) != CUDA_SUCCESS ||
        real_cuDeviceGetGraphMemAttribute(ord, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &u) != CUDA_SUCCESS)
        return -1;
    *reserved = r;
    *used = u;
    return 0;
}

/* Caller holds g_gmu: the pool of ord is charged `want` bytes (held by the driver already: never refused). */
static void gmem_set_locked(int ord, uint64_t want)
{
    uint64_t have = g_gmem[ord];
    int cdev = vgpu_dev_of_cuda(ord);
    if (want > have)
        region_reserve(cdev, want - have, 1, NULL, NULL);
    else if (want < have)
        region_release(cdev, have - want);
    g_gmem[ord] = want;
}

static void gmem_sync(int ord)
{
    uint64_t r, u;
    pthread_mutex_lock(&g_gmu);
    if (gmem_read(ord, &r, &u) == 0)
        gmem_set_locked(ord, r);
    pthread_mutex_unlock(&g_gmu);
}

static void gmem_sync_all(void)
{
    uint32_t seen = __atomic_load_n(&g_gmem_seen, __ATOMIC_ACQUIRE);
    for (int d = 0; seen && d < VGPU_MAX_DEV; d++)
        if (seen & (1u << d))
            gmem_sync(d);
}

static void gmem_after_fork_child(void)
{
    pthread_mutex_init(&g_gmu, NULL);
    memset(g_gmem, 0, sizeof g_gmem); /* the child has no graph pool of the parent's */
    g_gmem_seen = 0;
}

/* An allocation node on a device: the node, its size and CUDA ordinal. */
struct gmem_alloc {
    CUgraphNode node;
    uint64_t size;
    int dev;
};

/* What a walk of a graph's allocation nodes gathers: their sizes summed per CUDA ordinal and, when list is set,
 * the nodes themselves (n counts them all; the first cap are in list). */
struct gmem_sum {
    uint64_t per[VGPU_MAX_DEV];
    struct gmem_alloc *list;
    size_t n, cap;
};

/* graph_walk visitor: an allocation node on a device is added to the struct gmem_sum at arg. */
static int add_alloc(CUgraphNode node, int type, void *arg)
{
    struct gmem_sum *sum = arg;
    GRAPH_VISIT_PARAMS(CUDA_MEM_ALLOC_NODE_PARAMS, p, CU_GRAPH_NODE_TYPE_MEM_ALLOC, real_cuGraphMemAllocNodeGetParams);
    if (p.poolProps.location.type == CU_MEM_LOCATION_TYPE_DEVICE && p.poolProps.location.id >= 0 &&
        p.poolProps.location.id < VGPU_MAX_DEV) {
        uint64_t *s = &sum->per[p.poolProps.location.id];
        *s = *s + p.bytesize < *s ? UINT64_MAX : *s + p.bytesize;
        if (sum->list && sum->n < sum->cap)
            sum->list[sum->n] = (struct gmem_alloc){node, p.bytesize, p.poolProps.location.id};
        sum->n++;
    }
    return 0;
}

/* Adds the sizes of graph g's allocation nodes (and its child graphs', GRAPH_WALK_DEPTH levels down) per
 * CUDA ordinal to sum; returns -1 when the graph could not be read in full. */
static int gmem_walk(CUgraph g, struct gmem_sum *sum)
{
    return graph_walk(g, add_alloc, sum);
}

/* ---- the peak of a graph's allocations
 * Allocation A is freed before allocation B when A's free node (in the graph) precedes B's allocation node in the
 * graph's dependency order (graph_dag): A's memory is given back before B's is taken, so the two are never live
 * together. Every other pair may be: an allocation the graph does not free (or frees from a node that its own
 * allocation node does not precede, or that an address shared with another allocation node makes ambiguous) stays
 * live to the end of the launch and after it. "Freed before" is a partial order (transitive: A's free precedes B's
 * allocation, which precedes B's free, which precedes C's allocation), and the allocations live at any moment of a
 * launch are pairwise unordered: an antichain. The bound on a device is the heaviest antichain of its allocations,
 * by Dilworth's theorem the total size less the most that chains can pair up (a maximum flow from each allocation to
 * those freed after it): the peak of a graph that frees each allocation before the next is made, never less than what
 * can be live at once. Only with graph_memory=peak (vgpu_cfg->graph_peak, the admin's policy): the driver may reserve
 * more than the peak for a graph (it may, not must, reuse memory between allocations never live together), and the
 * difference would then be held past the limit until the reserve is read back after the launch. Bounded:
 * GMEM_ORDER_ALLOCS allocation nodes in a graph (and graph_dag's bounds); beyond them, or when the order cannot be
 * read, the sum. */
#define GMEM_ORDER_ALLOCS 128
#define GMEM_ORDER_WORDS (GMEM_ORDER_ALLOCS / 64)

struct gmem_order {
    uint64_t bound[VGPU_MAX_DEV]; /* per CUDA ordinal */
    size_t n;
    struct gmem_alloc a[GMEM_ORDER_ALLOCS]; /* the allocation nodes it was computed for, by node */
};

/* Maximum flow (Dinic) in a network of at most 2 * GMEM_ORDER_ALLOCS + 2 vertices. */
struct flow {
    uint32_t na;
    uint32_t *head, *next, *to, *it, *queue;
    int32_t *level;
    uint64_t *cap;
};
#define FLOW_NONE UINT32_MAX

static void flow_arc(struct flow *f, uint32_t u, uint32_t v, uint64_t c)
{
    f->to[f->na] = v;
    f->cap[f->na] = c;
    f->next[f->na] = f->head[u];
    f->head[u] = f->na++;
    f->to[f->na] = u;
    f->cap[f->na] = 0;
    f->next[f->na] = f->head[v];
    f->head[v] = f->na++;
}

static int flow_levels(struct flow *f, uint32_t nv, uint32_t s, uint32_t t)
{
    for (uint32_t v = 0; v < nv; v++) {
        f->level[v] = -1;
        f->it[v] = f->head[v];
    }
    uint32_t qh = 0, qt = 0;
    f->level[s] = 0;
    f->queue[qt++] = s;
    while (qh < qt) {
        uint32_t v = f->queue[qh++];
        for (uint32_t a = f->head[v]; a != FLOW_NONE; a = f->next[a])
            if (f->cap[a] && f->level[f->to[a]] < 0) {
                f->level[f->to[a]] = f->level[v] + 1;
                f->queue[qt++] = f->to[a];
            }
    }
    return f->level[t] >= 0;
}

/* One augmenting path from v along the levels (recursion at most as deep as the network has vertices). */
static uint64_t flow_push(struct flow *f, uint32_t v, uint32_t t, uint64_t lim)
{
    if (v == t)
        return lim;
    for (; f->it[v] != FLOW_NONE; f->it[v] = f->next[f->it[v]]) {
        uint32_t a = f->it[v], w = f->to[a];
        if (!f->cap[a] || f->level[w] != f->level[v] + 1)
            continue;
        uint64_t got = flow_push(f, w, t, lim < f->cap[a] ? lim : f->cap[a]);
        if (got) {
            f->cap[a] -= got;
            f->cap[a ^ 1] += got;
            return got;
        }
    }
    return 0;
}

/* The heaviest antichain of the m allocations ix[] (weights w[], ordered by before[]): their total less the
 * maximum flow from source -> left(i) (w[i]) -> right(j) (i freed before j) -> sink (w[j]). The total when the
 * network cannot be allocated, or the sizes overflow. */
static uint64_t gmem_peak(const uint64_t *w, const uint64_t (*before)[GMEM_ORDER_WORDS], const uint32_t *ix,
                          uint32_t m)
{
    uint64_t sum = 0;
    size_t pairs = 0;
    for (uint32_t i = 0; i < m; i++) {
        if (sum + w[ix[i]] < sum)
            return UINT64_MAX;
        sum += w[ix[i]];
        for (uint32_t j = 0; j < m; j++)
            pairs += (before[ix[i]][ix[j] / 64] >> (ix[j] % 64)) & 1;
    }
    if (!pairs)
        return sum;
    uint32_t nv = 2 * m + 2, s = 0, t = 1;
    size_t na = 2 * (pairs + 2 * (size_t)m);
    struct flow f = {0};
    f.head = malloc(nv * sizeof *f.head);
    f.it = malloc(nv * sizeof *f.it);
    f.queue = malloc(nv * sizeof *f.queue);
    f.level = malloc(nv * sizeof *f.level);
    f.next = malloc(na * sizeof *f.next);
    f.to = malloc(na * sizeof *f.to);
    f.cap = malloc(na * sizeof *f.cap);
    uint64_t flow = 0;
    if (f.head && f.it && f.queue && f.level && f.next && f.to && f.cap) {
        for (uint32_t v = 0; v < nv; v++)
            f.head[v] = FLOW_NONE;
        for (uint32_t i = 0; i < m; i++) {
            flow_arc(&f, s, 2 + i, w[ix[i]]);
            flow_arc(&f, 2 + m + i, t, w[ix[i]]);
            for (uint32_t j = 0; j < m; j++)
                if ((before[ix[i]][ix[j] / 64] >> (ix[j] % 64)) & 1)
                    flow_arc(&f, 2 + i, 2 + m + j, UINT64_MAX);
        }
        while (flow_levels(&f, nv, s, t))
            for (uint64_t got; (got = flow_push(&f, s, t, UINT64_MAX)) != 0;)
                flow += got;
    }
    free(f.head);
    free(f.it);
    free(f.queue);
    free(f.level);
    free(f.next);
    free(f.to);
    free(f.cap);
    return sum - flow;
}

/* The vertices reachable from `from` in d (from included) are marked in seen[]. */
static void dag_reach(const struct graph_dag *d, uint32_t from, uint8_t *seen, uint32_t *queue)
{
    memset(seen, 0, d->n);
    uint32_t qh = 0, qt = 0;
    seen[from] = 1;
    queue[qt++] = from;
    while (qh < qt) {
        uint32_t v = queue[qh++];
        for (uint32_t e = d->first[v]; e < d->first[v + 1]; e++)
            if (!seen[d->succ[e]]) {
                seen[d->succ[e]] = 1;
                queue[qt++] = d->succ[e];
            }
    }
}

static int cmp_gmem_alloc(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)((const struct gmem_alloc *)a)->node, y = (uintptr_t)((const struct gmem_alloc *)b)->node;
    return x < y ? -1 : x > y;
}

/* o->bound (and o->a) from graph's order: 0, or -1 when it cannot be read or is over the bounds. */
static int gmem_analyse(CUgraph graph, struct gmem_order *o)
{
    struct graph_dag d;
    if (graph_dag(graph, &d) != 0)
        return -1;
    static const int64_t UNFREED = -1;
    uint32_t vert[GMEM_ORDER_ALLOCS], m = 0;
    int64_t freev[GMEM_ORDER_ALLOCS];
    CUdeviceptr ptr[GMEM_ORDER_ALLOCS];
    uint64_t w[GMEM_ORDER_ALLOCS];
    uint64_t(*before)[GMEM_ORDER_WORDS] = calloc(GMEM_ORDER_ALLOCS, sizeof *before);
    uint8_t *seen = malloc(d.n);
    uint32_t *queue = malloc(d.n * sizeof *queue);
    int rc = -1;
    if (!before || !seen || !queue || !real_cuGraphMemAllocNodeGetParams)
        goto out;
    for (uint32_t v = 0; v < d.n; v++) {
        CUDA_MEM_ALLOC_NODE_PARAMS p;
        int got = GRAPH_NODE_PARAMS(d.node[v], d.type[v], CU_GRAPH_NODE_TYPE_MEM_ALLOC,
                                    real_cuGraphMemAllocNodeGetParams, p);
        if (got < 0)
            goto out;
        if (got == 0 || p.poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE || p.poolProps.location.id < 0 ||
            p.poolProps.location.id >= VGPU_MAX_DEV)
            continue;
        if (m == GMEM_ORDER_ALLOCS)
            goto out;
        o->a[m] = (struct gmem_alloc){d.node[v], p.bytesize, p.poolProps.location.id};
        w[m] = p.bytesize;
        vert[m] = v;
        ptr[m] = p.dptr;
        freev[m++] = UNFREED;
    }
    /* each free node frees the one allocation node of its address; a free that cannot be read, of an address no
     * allocation node here (or more than one) returned, or a second free of one: not taken (the longer life) */
    for (uint32_t v = 0; v < d.n && real_cuGraphMemFreeNodeGetParams; v++) {
        CUdeviceptr p = 0;
        if (d.type[v] != CU_GRAPH_NODE_TYPE_MEM_FREE || !d.node[v] ||
            real_cuGraphMemFreeNodeGetParams(d.node[v], &p) != CUDA_SUCCESS)
            continue;
        uint32_t hits = 0, k = 0;
        for (uint32_t i = 0; i < m; i++)
            if (ptr[i] == p) {
                hits++;
                k = i;
            }
        for (uint32_t i = 0; hits > 1 && i < m; i++)
            if (ptr[i] == p)
                freev[i] = -2;
        if (hits == 1)
            freev[k] = freev[k] == UNFREED ? (int64_t)v : -2;
    }
    for (uint32_t i = 0; i < m; i++) { /* a free its allocation does not precede is not taken */
        if (freev[i] < 0)
            continue;
        dag_reach(&d, vert[i], seen, queue);
        if (!seen[freev[i]])
            freev[i] = UNFREED;
    }
    for (uint32_t i = 0; i < m; i++) {
        if (freev[i] < 0)
            continue;
        dag_reach(&d, (uint32_t)freev[i], seen, queue);
        for (uint32_t j = 0; j < m; j++)
            if (j != i && seen[vert[j]])
                before[i][j / 64] |= 1ull << (j % 64);
    }
    for (int dev = 0; dev < VGPU_MAX_DEV; dev++) {
        uint32_t ix[GMEM_ORDER_ALLOCS], k = 0;
        for (uint32_t i = 0; i < m; i++)
            if (o->a[i].dev == dev)
                ix[k++] = i;
        o->bound[dev] = k ? gmem_peak(w, (const uint64_t(*)[GMEM_ORDER_WORDS])before, ix, k) : 0;
    }
    o->n = m;
    qsort(o->a, m, sizeof o->a[0], cmp_gmem_alloc);
    rc = 0;
out:
    free(before);
    free(seen);
    free(queue);
    graph_dag_free(&d);
    return rc;
}

struct gmem_order *memory_graph_order(CUgraph graph)
{
    /* the peak only where the admin chose it (graph_memory=peak): the driver may reserve more than the peak */
    if (!vgpu_cfg->enabled || !vgpu_cfg->graph_peak || !graph)
        return NULL;
    struct gmem_order *o = calloc(1, sizeof *o);
    if (!o)
        return NULL;
    /* worth it only where a device has two allocation nodes or more (one: its size is the peak) */
    struct gmem_sum sum = {.list = o->a, .cap = GMEM_ORDER_ALLOCS};
    int worth = 0;
    if (gmem_walk(graph, &sum) == 0 && sum.n <= GMEM_ORDER_ALLOCS)
        for (size_t i = 0; i < sum.n && !worth; i++)
            for (size_t j = 0; j < i && !worth; j++)
                worth = o->a[i].dev == o->a[j].dev;
    memset(o, 0, sizeof *o);
    if (!worth || gmem_analyse(graph, o) != 0) {
        free(o);
        return NULL;
    }
    return o;
}

void memory_graph_order_free(struct gmem_order *pre)
{
    free(pre);
}

/* The TK_GRAPHMEM key of exec's bound on CUDA ordinal d (exec's own key holds the ordinals, in maps). Handles
 * are user-space addresses, below 2^56. */
static uint64_t gmem_key(CUgraphExec exec, int d)
{
    return (uint64_t)(uintptr_t)exec | (uint64_t)(d + 1) << 56;
}

/* Records (merge: with what exec already had, never less, for an update) what exec's allocation nodes can
 * take on each device: the peak pre found before the instantiation when the graph's allocation nodes are still the
 * ones it was found for, else the sum of their sizes there. A graph that could not be read is recorded on the
 * current device with nothing to check before a launch; its pool is still charged after. */
static void gmem_record(CUgraphExec exec, CUgraph graph, int merge, const struct gmem_order *pre)
{
    struct gmem_alloc now[GMEM_ORDER_ALLOCS];
    struct gmem_sum sum = {.list = pre ? now : NULL, .cap = GMEM_ORDER_ALLOCS};
    uint64_t *per = sum.per;
    uint32_t mask = 0;
    int unread = gmem_walk(graph, &sum) != 0;
    if (pre && !unread && sum.n == pre->n) {
        qsort(now, sum.n, sizeof now[0], cmp_gmem_alloc);
        int same = 1;
        for (size_t i = 0; i < sum.n && same; i++)
            same = now[i].node == pre->a[i].node && now[i].size == pre->a[i].size && now[i].dev == pre->a[i].dev;
        for (int d = 0; same && d < VGPU_MAX_DEV; d++)
            if (pre->bound[d] < per[d])
                per[d] = pre->bound[d];
    }
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        if (per[d])
            mask |= 1u << d;
    CUdevice ord;
    if (unread && real_cuCtxGetDevice && real_cuCtxGetDevice(&ord) == CUDA_SUCCESS && ord >= 0 && ord < VGPU_MAX_DEV)
        mask |= 1u << ord;
    uint64_t key = (uint64_t)(uintptr_t)exec;
    if (unread)
        LOG_WARN("cannot read the nodes of a graph; what it allocates is charged after each launch");
    uint32_t old = 0;
    track_lock();
    struct track_entry *e = track_find_locked(TK_GRAPHMEM, key);
    if (e)
        old = e->maps;
    for (int d = 0; merge && d < VGPU_MAX_DEV; d++) {
        struct track_entry *x = old & (1u << d) ? track_find_locked(TK_GRAPHMEM, gmem_key(exec, d)) : NULL;
        if (x && x->size > per[d])
            per[d] = x->size;
    }
    track_unlock();
    if (merge)
        mask |= old;
    else if (old) /* an old record under a reused handle */
        memory_graph_exec_gone(exec);
    if (!mask)
        return;
    __atomic_fetch_or(&g_gmem_seen, mask, __ATOMIC_RELEASE);
    int failed = 0;
    for (int d = 0; d < VGPU_MAX_DEV; d++) /* the bounds first: a launch finds them once the ordinals are set */
        if (mask & (1u << d))
            failed |= track_put(TK_GRAPHMEM, gmem_key(exec, d), per[d], d, NULL) != 0;
    failed |= track_put(TK_GRAPHMEM, key, 0, -1, NULL) != 0;
    track_lock();
    e = track_find_locked(TK_GRAPHMEM, key);
    if (e)
        e->maps = mask;
    track_unlock();
    if (failed)
        LOG_ERROR("cannot record a graph's memory nodes; what it allocates is charged after each launch");
}

void memory_graph_instantiated(CUgraphExec exec, CUgraph graph, struct gmem_order *pre)
{
    if (vgpu_cfg->enabled && exec)
        gmem_record(exec, graph, 0, pre);
    memory_graph_order_free(pre);
}

void memory_graph_exec_gone(CUgraphExec exec)
{
    if (!vgpu_cfg->enabled)
        return;
    track_lock();
    struct track_entry *e = track_find_locked(TK_GRAPHMEM, (uint64_t)(uintptr_t)exec);
    uint32_t mask = e ? e->maps : 0;
    if (e)
        track_remove_locked(e);
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        struct track_entry *x = mask & (1u << d) ? track_find_locked(TK_GRAPHMEM, gmem_key(exec, d)) : NULL;
        if (x)
            track_remove_locked(x);
    }
    track_unlock();
    if (mask)
        gmem_sync_all();
}

CUresult memory_graph_launch_begin(CUgraphExec exec, const char *api, struct gmem_launch *t)
{
    t->mask = 0;
    if (!vgpu_cfg->enabled || !__atomic_load_n(&g_gmem_seen, __ATOMIC_RELAXED))
        return CUDA_SUCCESS;
    uint64_t bound[VGPU_MAX_DEV];
    uint32_t mask = 0;
    track_lock();
    struct track_entry *e = track_find_locked(TK_GRAPHMEM, (uint64_t)(uintptr_t)exec);
    if (e)
        mask = e->maps;
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        struct track_entry *x = mask & (1u << d) ? track_find_locked(TK_GRAPHMEM, gmem_key(exec, d)) : NULL;
        bound[d] = x ? x->size : 0;
    }
    track_unlock();
    if (!mask)
        return CUDA_SUCCESS; /* no memory nodes */
    pthread_mutex_lock(&g_gmu); /* held until memory_graph_launch_end */
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        if (!(mask & (1u << d)))
            continue;
        uint64_t r = 0, u = 0, spare = 0;
        if (gmem_read(d, &r, &u) == 0) {
            gmem_set_locked(d, r);
            spare = r > u ? r - u : 0; /* reserved and unused: a relaunch takes it again */
        }
        uint64_t need = bound[d] > spare ? bound[d] - spare : 0;
        if (need && reserve(vgpu_dev_of_cuda(d), need, api) != CUDA_SUCCESS) {
            for (int k = 0; k < d; k++)
                if (t->mask & (1u << k))
                    region_release(vgpu_dev_of_cuda(k), t->need[k]);
            t->mask = 0;
            pthread_mutex_unlock(&g_gmu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        t->need[d] = need;
        t->before[d] = g_gmem[d];
        t->mask |= 1u << d;
    }
    return CUDA_SUCCESS; /* g_gmu stays held across the driver's call */
}

/* After the driver's call: the pool is charged what the driver says it reserves (the driver accounts a
 * launched graph's memory when it is launched: a trim keeps what a scheduled graph uses), and what was
 * reserved for the call goes back. When the driver cannot be asked, what was reserved for a call that
 * succeeded stays charged. */
void memory_graph_launch_end(struct gmem_launch *t, CUresult rc)
{
    if (!t->mask)
        return; /* nothing checked: g_gmu is not held */
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        if (!(t->mask & (1u << d)))
            continue;
        uint64_t r = 0, u = 0, want = g_gmem[d];
        if (gmem_read(d, &r, &u) == 0)
            want = r;
        else if (rc == CUDA_SUCCESS && t->before[d] + t->need[d] > want)
            want = t->before[d] + t->need[d];
        gmem_set_locked(d, want);
        if (t->need[d])
            region_release(vgpu_dev_of_cuda(d), t->need[d]);
    }
    pthread_mutex_unlock(&g_gmu);
    t->mask = 0;
}

/* An upload reserves the executable's graph memory ahead of its launch: the same rules. */
static CUresult graph_upload(cuGraphUpload_fn fn, CUgraphExec exec, CUstream s)
{
    struct gmem_launch t;
    CUresult rc = memory_graph_launch_begin(exec, "cuGraphUpload", &t);
    if (rc)
        return rc;
    rc = fn(exec, s);
    memory_graph_launch_end(&t, rc);
    return rc;
}

EXPORT CUresult cuGraphUpload(CUgraphExec exec, CUstream s)
{
    ensure_cuda();
    REAL_OR_FAIL(cuGraphUpload);
    return graph_upload(real_cuGraphUpload, exec, s);
}

EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec exec, CUstream s)
{
    ensure_cuda();
    REAL_OR_FAIL(cuGraphUpload_ptsz);
    return graph_upload(real_cuGraphUpload_ptsz, exec, s);
}

/* An updated executable takes the new graph's parameters, allocation sizes included: what it can take is
 * recorded again (never below what it was), and its launch cost (SM limit, limiter.c) is the new graph's. */
EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec exec, CUgraph graph, void *info)
{
    ensure_cuda();
    REAL_OR_FAIL(cuGraphExecUpdate_v2);
    CUresult rc = memory_graph_stack(graph); /* the new kernels' stack, before the driver takes them */
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real_cuGraphExecUpdate_v2(exec, graph, info);
    if (rc == CUDA_SUCCESS && vgpu_cfg->enabled)
        gmem_record(exec, graph, 1, NULL);
    if (rc == CUDA_SUCCESS)
        limiter_graph_updated(exec, graph);
    return rc;
}

EXPORT CUresult cuGraphExecUpdate(CUgraphExec exec, CUgraph graph, CUgraphNode *err, int *result)
{
    ensure_cuda();
    REAL_OR_FAIL(cuGraphExecUpdate);
    CUresult rc = memory_graph_stack(graph); /* the new kernels' stack, before the driver takes them */
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real_cuGraphExecUpdate(exec, graph, err, result);
    if (rc == CUDA_SUCCESS && vgpu_cfg->enabled)
        gmem_record(exec, graph, 1, NULL);
    if (rc == CUDA_SUCCESS)
        limiter_graph_updated(exec, graph);
    return rc;
}

EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    ensure_cuda();
    REAL_OR_FAIL(cuDeviceGraphMemTrim);
    CUresult rc = real_cuDeviceGraphMemTrim(dev);
    if (rc == CUDA_SUCCESS && vgpu_cfg->enabled && dev >= 0 && dev < VGPU_MAX_DEV)
        gmem_sync(dev);
    return rc;
}
