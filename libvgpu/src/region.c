/*
 * Cross-process memory accounting for the processes of one container.
 *
 * The file at $CUDA_DEVICE_MEMORY_SHARED_CACHE holds a header (magic, version, limits), the
 * per-device totals and one slot per process.  A robust, process-shared mutex guards updates:
 * if its owner dies, the next locker gets EOWNERDEAD, rebuilds the totals from the slots (the
 * slots are the source of truth), reclaims dead processes and marks the mutex consistent.
 * Initialisation is serialised with flock(), which the kernel drops when a process dies.
 * A file written with other limits is re-initialised when no live process uses it, and
 * refused (this process falls back to private accounting, with an error log line) otherwise.
 */
#include "vgpu.h"
#include "region.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static struct vgpu_region *g_reg;
static int g_slot = -1;
static int g_need_slot = 1;
static int g_shared;

static uint64_t proc_start_time(int pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p)
        return 0;
    /* fields after ")": state(3) ... starttime(22) */
    int field = 2;
    for (; *p && field < 22; p++)
        if (*p == ' ')
            field++;
    return strtoull(p, NULL, 10);
}

static int slot_dead(const struct vgpu_slot *s)
{
    if (s->pid <= 0)
        return 0;
    if (kill(s->pid, 0) != 0 && errno == ESRCH)
        return 1;
    uint64_t st = proc_start_time(s->pid);
    return st && s->start_time && st != s->start_time;
}

/* Caller holds the lock. Frees dead processes' slots and their usage. */
static void reap_locked(void)
{
    for (int i = 0; i < VGPU_REGION_SLOTS; i++) {
        struct vgpu_slot *s = &g_reg->slots[i];
        if (s->pid && s->pid != (int32_t)getpid() && slot_dead(s)) {
            LOG_INFO("reclaiming slot of dead process %d", s->pid);
            for (int d = 0; d < VGPU_REGION_DEVS; d++)
                g_reg->used[d] = g_reg->used[d] > s->used[d] ? g_reg->used[d] - s->used[d] : 0;
            memset(s, 0, sizeof(*s));
        }
    }
}

static void rebuild_totals_locked(void)
{
    for (int d = 0; d < VGPU_REGION_DEVS; d++) {
        uint64_t t = 0;
        for (int i = 0; i < VGPU_REGION_SLOTS; i++)
            if (g_reg->slots[i].pid)
                t += g_reg->slots[i].used[d];
        g_reg->used[d] = t;
    }
}

static void init_mutex(pthread_mutex_t *mu)
{
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(mu, &a);
    pthread_mutexattr_destroy(&a);
}

static void rlock(void)
{
    int rc = pthread_mutex_lock(&g_reg->lock.mu);
    if (UNLIKELY(rc == EOWNERDEAD)) {
        LOG_WARN("shared lock owner died; recovering accounting");
        rebuild_totals_locked();
        reap_locked();
        g_reg->recoveries++;
        pthread_mutex_consistent(&g_reg->lock.mu);
    } else if (UNLIKELY(rc == ENOTRECOVERABLE)) {
        LOG_ERROR("shared lock not recoverable; re-initialising it");
        init_mutex(&g_reg->lock.mu);
        pthread_mutex_lock(&g_reg->lock.mu);
        rebuild_totals_locked();
        reap_locked();
    }
}

static void runlock(void)
{
    pthread_mutex_unlock(&g_reg->lock.mu);
}

static void fill_header(struct vgpu_region *r)
{
    memset(r, 0, sizeof(*r));
    r->version = VGPU_REGION_VERSION;
    r->size = sizeof(*r);
    r->ndev = VGPU_REGION_DEVS;
    r->nslots = VGPU_REGION_SLOTS;
    for (int d = 0; d < VGPU_REGION_DEVS; d++) {
        r->limit[d] = g_cfg.mem_limit[d];
        r->sm_limit[d] = (uint32_t)g_cfg.sm_limit[d];
    }
    init_mutex(&r->lock.mu);
    __atomic_store_n(&r->magic, VGPU_REGION_MAGIC, __ATOMIC_RELEASE);
}

static int limits_match(const struct vgpu_region *r)
{
    for (int d = 0; d < VGPU_REGION_DEVS; d++)
        if (r->limit[d] != g_cfg.mem_limit[d] || r->sm_limit[d] != (uint32_t)g_cfg.sm_limit[d])
            return 0;
    return 1;
}

static int live_slots(struct vgpu_region *r)
{
    int n = 0;
    for (int i = 0; i < VGPU_REGION_SLOTS; i++)
        if (r->slots[i].pid && !slot_dead(&r->slots[i]))
            n++;
    return n;
}

static void open_private(void)
{
    void *p = mmap(NULL, sizeof(struct vgpu_region), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        LOG_ERROR("cannot allocate accounting region");
        return;
    }
    fill_header(p);
    g_reg = p;
    g_shared = 0;
}

int region_open(void)
{
    const char *path = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    if (!path || !*path) {
        open_private();
        return 0;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        LOG_ERROR("cannot open %s: %s; accounting is per process", path, strerror(errno));
        open_private();
        return -1;
    }
    fchmod(fd, 0666);
    while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {
    }
    struct stat st;
    size_t need = sizeof(struct vgpu_region);
    int fresh = 0;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < need) {
        if (ftruncate(fd, (off_t)need) != 0) {
            LOG_ERROR("cannot size %s: %s; accounting is per process", path, strerror(errno));
            flock(fd, LOCK_UN);
            close(fd);
            open_private();
            return -1;
        }
        fresh = 1;
    }
    struct vgpu_region *r = mmap(NULL, need, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED) {
        LOG_ERROR("cannot map %s: %s; accounting is per process", path, strerror(errno));
        flock(fd, LOCK_UN);
        close(fd);
        open_private();
        return -1;
    }
    int valid = !fresh && r->magic == VGPU_REGION_MAGIC && r->version == VGPU_REGION_VERSION && r->size == need &&
                r->ndev == VGPU_REGION_DEVS && r->nslots == VGPU_REGION_SLOTS;
    if (!valid) {
        if (!fresh && r->magic)
            LOG_WARN("%s has an unknown layout; re-initialising it", path);
        fill_header(r);
    } else if (!limits_match(r)) {
        if (live_slots(r) == 0) {
            LOG_WARN("%s was created with other limits and no process uses it; re-initialising", path);
            fill_header(r);
        } else {
            LOG_ERROR("%s is in use with other limits; refusing to mix, accounting for this process is private",
                      path);
            munmap(r, need);
            flock(fd, LOCK_UN);
            close(fd);
            open_private();
            return -1;
        }
    }
    g_reg = r;
    g_shared = 1;
    flock(fd, LOCK_UN);
    close(fd);
    return 0;
}

/* Caller holds the lock. */
static void ensure_slot_locked(void)
{
    if (LIKELY(!g_need_slot))
        return;
    g_need_slot = 0;
    int pid = (int)getpid();
    reap_locked();
    int free_i = -1;
    for (int i = 0; i < VGPU_REGION_SLOTS; i++) {
        if (g_reg->slots[i].pid == pid) {
            /* a previous process with our pid (container restart): its usage is gone */
            for (int d = 0; d < VGPU_REGION_DEVS; d++)
                g_reg->used[d] -= g_reg->slots[i].used[d] < g_reg->used[d] ? g_reg->slots[i].used[d] : g_reg->used[d];
            memset(&g_reg->slots[i], 0, sizeof g_reg->slots[i]);
        }
        if (free_i < 0 && g_reg->slots[i].pid == 0)
            free_i = i;
    }
    if (free_i < 0) {
        LOG_ERROR("no free process slot in the shared region; usage is counted without reclaim");
        g_slot = -1;
        return;
    }
    struct vgpu_slot *s = &g_reg->slots[free_i];
    memset(s, 0, sizeof(*s));
    s->start_time = proc_start_time(pid);
    s->pid = pid;
    g_slot = free_i;
}

int region_reserve(int dev, uint64_t bytes, int force, uint64_t *used_out, uint64_t *limit_out)
{
    if (!g_reg || dev < 0 || dev >= VGPU_REGION_DEVS)
        return 0;
    rlock();
    ensure_slot_locked();
    uint64_t lim = g_reg->limit[dev];
    if (!force && lim && (g_reg->used[dev] + bytes > lim || g_reg->used[dev] + bytes < bytes)) {
        /* over the limit: dead processes may still hold usage; look at most every 50 ms */
        static uint64_t last_reap;
        uint64_t now = now_ns();
        if (now - last_reap > 50000000ull) {
            last_reap = now;
            reap_locked();
        }
        if (g_reg->used[dev] + bytes > lim || g_reg->used[dev] + bytes < bytes) {
            if (used_out)
                *used_out = g_reg->used[dev];
            if (limit_out)
                *limit_out = lim;
            runlock();
            return -1;
        }
    }
    g_reg->used[dev] += bytes;
    if (g_slot >= 0)
        g_reg->slots[g_slot].used[dev] += bytes;
    runlock();
    return 0;
}

void region_release(int dev, uint64_t bytes)
{
    if (!g_reg || dev < 0 || dev >= VGPU_REGION_DEVS)
        return;
    rlock();
    ensure_slot_locked();
    uint64_t b = bytes;
    if (g_slot >= 0) {
        uint64_t *mine = &g_reg->slots[g_slot].used[dev];
        if (b > *mine)
            b = *mine;
        *mine -= b;
    }
    g_reg->used[dev] = g_reg->used[dev] > b ? g_reg->used[dev] - b : 0;
    runlock();
}

uint64_t region_used(int dev)
{
    if (!g_reg || dev < 0 || dev >= VGPU_REGION_DEVS)
        return 0;
    return __atomic_load_n(&g_reg->used[dev], __ATOMIC_RELAXED);
}

void region_pids(int *pids, int *n, int max)
{
    *n = 0;
    if (!g_reg)
        return;
    for (int i = 0; i < VGPU_REGION_SLOTS && *n < max; i++) {
        int p = __atomic_load_n(&g_reg->slots[i].pid, __ATOMIC_RELAXED);
        if (p)
            pids[(*n)++] = p;
    }
    if (*n == 0 && max > 0)
        pids[(*n)++] = (int)getpid();
}

void region_release_self(void)
{
    if (!g_reg || g_slot < 0 || g_need_slot)
        return;
    rlock();
    struct vgpu_slot *s = &g_reg->slots[g_slot];
    if (s->pid == (int32_t)getpid()) {
        for (int d = 0; d < VGPU_REGION_DEVS; d++)
            g_reg->used[d] = g_reg->used[d] > s->used[d] ? g_reg->used[d] - s->used[d] : 0;
        memset(s, 0, sizeof(*s));
    }
    g_slot = -1;
    runlock();
}

void region_after_fork_child(void)
{
    g_slot = -1;
    g_need_slot = 1;
}

/* Test hook (KF-29): take the shared lock and keep it; the caller is expected to be killed. */
EXPORT int vgpu_debug_hold_lock(void)
{
    vgpu_base_init();
    if (!g_reg)
        return -1;
    rlock();
    return g_shared ? 0 : 1;
}

__attribute__((destructor)) static void region_fini(void)
{
    region_release_self();
}
