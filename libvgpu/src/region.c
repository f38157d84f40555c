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
 * Limits are always this process's own; the file only shares usage.
 * Self-healing: a header that stops matching while the process runs, or a file truncated under it
 * (SIGBUS guard below), is rebuilt in place under flock (keeping live processes' slots) and shared
 * again; every process checks on each operation that its own slot still names it and, if the slot
 * was lost, registers its own usage again. A lock held for over 2 s (a stuck holder, or a damaged
 * lock word) is re-initialised by one waiter (the recoveries counter tells the others it was done)
 * and the totals are rebuilt from the slots. Only when healing is impossible (other live processes
 * use the file with other limits, the file cannot be mapped, or it was damaged more than
 * MAX_HEALS times) does the process fall back to private accounting of its own usage: damage can
 * unshare accounting, never lift a limit.
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
#include <time.h>
#include <stddef.h>
#include <unistd.h>

static struct vgpu_region *g_reg;
static int g_slot = -1;
static int g_need_slot = 1;
static int g_shared;
/* Every region operation of this process runs under g_pmu first: one thread at a time touches the
 * shared mutex, g_own stays exact, and the switch to private accounting happens in one place. */
static pthread_mutex_t g_pmu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_own[VGPU_REGION_DEVS]; /* bytes this process has charged (its own accounting) */
static struct vgpu_region g_static_region;  /* last resort when even an anonymous mapping fails */
/* SIGBUS guard: the shared file mapping, and whether it was replaced after the file shrank. */
static void *volatile g_map_base;
static size_t g_map_len;
static volatile sig_atomic_t g_map_lost;
static struct sigaction g_prev_bus;
static int g_guard_installed;
/* Self-healing state: rebuilds done by this process, the start time its slot was registered with,
 * and whether the totals must be rebuilt once the lock is next taken (after a forced lock reset). */
#define MAX_HEALS 64
static int g_heals;
static uint64_t g_slot_start;
static int g_rebuild_on_lock;

/* ------------------------------------------------------------------ liveness
 * A slot is keyed by (pid as seen through this container's /proc, process start time, the /proc
 * mount's device) and backed by an open-file-description lock on one byte of the cache file that the
 * process holds while it lives (the kernel drops it at exit, before the process becomes a zombie).
 * The pid is the first NSpid entry of /proc/self/status, i.e. the pid in the namespace of the /proc
 * mount, so a process in a nested PID namespace (`unshare --pid --fork`) is recorded with the pid the
 * container's other processes see. Verdicts, never releasing what is not surely free:
 *   same /proc: dead if /proc/<pid> is gone, its start time differs (pid reused), or it is a zombie
 *               (state Z or X: the driver has freed its memory already);
 *   another /proc (a process that mounted its own): dead only if nobody holds the slot's lock. */
#define SLOT_LOCK_BASE (1ull << 32) /* lock offsets, beyond the file's data */
static int g_self_pid;
static int g_nspid_levels; /* entries on the NSpid line of /proc/self/status */
static int g_host_pid;     /* the pid NVML reports for this process; 0 = not known yet */
static int g_hp_learned;  /* g_host_pid was learned from NVML's listing (not a fallback) */
static uint64_t g_proc_dev;
static int g_lock_fd = -1;

/* Reads /proc/<pid>/stat: returns 1 and the state/start time, 0 when there is no such process. */
static int proc_stat(int pid, char *state, uint64_t *start)
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
    if (!p || p[1] != ' ')
        return 0;
    *state = p[2];
    /* fields after ")": state(3) ... starttime(22) */
    int field = 2;
    for (; *p && field < 22; p++)
        if (*p == ' ')
            field++;
    *start = strtoull(p, NULL, 10);
    return 1;
}

static uint64_t proc_start_time(int pid)
{
    char st;
    uint64_t t = 0;
    return proc_stat(pid, &st, &t) ? t : 0;
}

/* This process's pid in the namespace of the /proc mount (NSpid's first entry), else getpid(). */
static int self_pid(void)
{
    int pid = (int)getpid();
    int fd = open("/proc/self/status", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return pid;
    char buf[4096];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return pid;
    buf[n] = 0;
    char *l = strstr(buf, "\nNSpid:");
    if (l) {
        long v = strtol(l + 7, NULL, 10);
        if (v > 0)
            pid = (int)v;
        g_nspid_levels = 0;
        for (char *p = l + 7; *p && *p != '\n';) {
            while (*p == ' ' || *p == '\t')
                p++;
            if (*p >= '0' && *p <= '9')
                g_nspid_levels++;
            while (*p && *p != '\n' && *p != ' ' && *p != '\t')
                p++;
        }
    }
    return pid;
}

static void ident_init(void)
{
    g_self_pid = self_pid();
    struct stat st;
    g_proc_dev = stat("/proc/self", &st) == 0 ? (uint64_t)st.st_dev + 1 : 0; /* 0 = unknown */
}

int vgpu_self_pid(void)
{
    return g_self_pid ? g_self_pid : (int)getpid();
}

/* an OFD lock request of `type` (F_WRLCK, F_RDLCK, F_UNLCK) on one byte of the lock file */
static struct flock byte_lock(int type, uint64_t byte)
{
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = (short)type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)byte;
    fl.l_len = 1;
    return fl;
}

static int slot_lock_held(int i)
{
    if (g_lock_fd < 0)
        return 1; /* cannot tell: alive */
    struct flock fl = byte_lock(F_WRLCK, SLOT_LOCK_BASE + (uint64_t)i);
    if (fcntl(g_lock_fd, F_OFD_GETLK, &fl) != 0)
        return 1;
    return fl.l_type != F_UNLCK;
}

static int slot_take_lock(int i)
{
    if (g_lock_fd < 0)
        return -1;
    struct flock fl = byte_lock(F_WRLCK, SLOT_LOCK_BASE + (uint64_t)i);
    return fcntl(g_lock_fd, F_OFD_SETLK, &fl);
}

/* Slot i of r (r need not be g_reg yet: region_open asks before it is). */
static int slot_dead_at(const struct vgpu_region *r, int i)
{
    const struct vgpu_slot *s = &r->slots[i];
    if (s->pid <= 0)
        return 0;
    if (!g_proc_dev || s->reserved[0] != g_proc_dev)
        return s->reserved[0] && !slot_lock_held(i); /* pids of another /proc: only the lock tells */
    char st;
    uint64_t start;
    if (!proc_stat(s->pid, &st, &start))
        return 1;
    if (st == 'Z' || st == 'X')
        return 1;
    return s->start_time && start != s->start_time;
}

static int slot_dead(const struct vgpu_slot *s)
{
    return slot_dead_at(g_reg, (int)(s - g_reg->slots));
}

/* Strict: the process exists, is not a zombie, and its start time is exactly the recorded one
 * (garbage never matches). */
static int slot_live(const struct vgpu_slot *s)
{
    if (s->pid <= 0 || !s->start_time || !g_proc_dev || s->reserved[0] != g_proc_dev)
        return 0;
    char st;
    uint64_t start;
    return proc_stat(s->pid, &st, &start) && st != 'Z' && st != 'X' && start == s->start_time;
}

/* Caller holds the lock. Frees dead processes' slots and their usage. */
static void reap_locked(void)
{
    for (int i = 0; i < VGPU_REGION_SLOTS; i++) {
        struct vgpu_slot *s = &g_reg->slots[i];
        if (s->pid && i != g_slot && slot_dead(s)) {
            LOG_INFO("reclaiming slot of dead process %d", s->pid);
            for (int d = 0; d < VGPU_REGION_DEVS; d++)
                g_reg->used[d] = g_reg->used[d] > s->used[d] ? g_reg->used[d] - s->used[d] : 0;
            memset(s, 0, sizeof(*s));
        }
    }
}

static void rebuild_totals(struct vgpu_region *r)
{
    for (int d = 0; d < VGPU_REGION_DEVS; d++) {
        uint64_t t = 0;
        for (int i = 0; i < VGPU_REGION_SLOTS; i++)
            if (r->slots[i].pid)
                t += r->slots[i].used[d];
        r->used[d] = t;
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

static uint64_t file_limit(int d)
{
    return d < VGPU_MAX_DEV && vgpu_cfg->mem_set[d] ? vgpu_cfg->mem_limit[d] : 0;
}

/* Writes a fresh header. keep_live: slots of live processes (strictly checked) are kept and the
 * totals rebuilt from them; every other slot is cleared. Returns the number of slots kept. */
static int fill_header(struct vgpu_region *r, int keep_live)
{
    int kept = 0;
    __atomic_store_n(&r->magic, 0, __ATOMIC_RELEASE);
    memset(r, 0, offsetof(struct vgpu_region, slots));
    for (int i = 0; i < VGPU_REGION_SLOTS; i++) {
        if (keep_live && slot_live(&r->slots[i]))
            kept++;
        else
            memset(&r->slots[i], 0, sizeof r->slots[i]);
    }
    r->version = VGPU_REGION_VERSION;
    r->size = sizeof(*r);
    r->ndev = VGPU_REGION_DEVS;
    r->nslots = VGPU_REGION_SLOTS;
    for (int d = 0; d < VGPU_REGION_DEVS; d++) {
        r->limit[d] = file_limit(d);
        r->sm_limit[d] = (uint32_t)vgpu_cfg->sm_limit[d];
    }
    rebuild_totals(r);
    init_mutex(&r->lock.mu);
    __atomic_store_n(&r->magic, VGPU_REGION_MAGIC, __ATOMIC_RELEASE);
    return kept;
}

static int layout_ok(const struct vgpu_region *r)
{
    return r->magic == VGPU_REGION_MAGIC && r->version == VGPU_REGION_VERSION && r->size == sizeof(*r) &&
           r->ndev == VGPU_REGION_DEVS && r->nslots == VGPU_REGION_SLOTS;
}

static int limits_match(const struct vgpu_region *r)
{
    for (int d = 0; d < VGPU_REGION_DEVS; d++)
        if (r->limit[d] != file_limit(d) || r->sm_limit[d] != (uint32_t)vgpu_cfg->sm_limit[d])
            return 0;
    return 1;
}

/* Still the header this process joined? (A read of a truncated file is caught by the SIGBUS guard,
 * which maps zeros there, so this answers "no" instead of crashing.) */
static int header_ok(const struct vgpu_region *r)
{
    if (g_map_lost && (void *)r == g_map_base)
        return 0;
    return layout_ok(r) && limits_match(r);
}

static int live_slots(struct vgpu_region *r)
{
    int n = 0;
    for (int i = 0; i < VGPU_REGION_SLOTS; i++)
        if (r->slots[i].pid && !slot_dead_at(r, i))
            n++;
    return n;
}

/* ------------------------------------------------------------------ SIGBUS guard
 * Any process of the container may shrink the shared file (it is 0666 on a rw mount); touching a
 * page of the mapping beyond the new end of file raises SIGBUS. The guard, installed once when the
 * file is mapped, replaces the whole mapping in place with zeroed anonymous memory and returns, so
 * the faulting instruction re-executes on valid memory. The zeroed header then fails header_ok()
 * and the process continues with private accounting (its own usage, its own limits). Faults at
 * other addresses go to the handler that was installed before (or the default action). */
static void bus_guard(int sig, siginfo_t *si, void *uc)
{
    uintptr_t base = (uintptr_t)g_map_base, a = (uintptr_t)si->si_addr;
    if (base && si->si_code > 0 && a >= base && a < base + g_map_len) {
        int e = errno;
        void *p = mmap((void *)base, g_map_len, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_SHARED | MAP_ANONYMOUS, -1,
                       0);
        errno = e;
        if (p != MAP_FAILED) {
            g_map_lost = 1;
            return;
        }
    }
    if (g_prev_bus.sa_flags & SA_SIGINFO) {
        if (g_prev_bus.sa_sigaction) {
            g_prev_bus.sa_sigaction(sig, si, uc);
            return;
        }
    } else if (g_prev_bus.sa_handler != SIG_DFL && g_prev_bus.sa_handler != SIG_IGN) {
        g_prev_bus.sa_handler(sig);
        return;
    }
    signal(sig, SIG_DFL);
    if (si->si_code <= 0)
        raise(sig); /* sent, not a fault: deliver it with the default action */
    /* a fault re-executes and now takes the default action */
}

static void install_guard(void)
{
    if (g_guard_installed)
        return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = bus_guard;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_RESTART | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &g_prev_bus) == 0)
        g_guard_installed = 1;
    else
        LOG_WARN("cannot install the SIGBUS guard: %s", strerror(errno));
}

/* The task priority recorded in a slot (reserved[2]): the process's own (limits file, else env) + 1, 0 unset. */
static uint64_t slot_priority(void)
{
    return vgpu_cfg->priority == 0 || vgpu_cfg->priority == 1 ? (uint64_t)vgpu_cfg->priority + 1 : 0;
}

/* ------------------------------------------------------------------ private accounting */
static struct vgpu_region *new_private(void)
{
    void *p = mmap(NULL, sizeof(struct vgpu_region), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        LOG_ERROR("cannot allocate accounting region; using a static one");
        p = &g_static_region;
        memset(p, 0, sizeof g_static_region);
    }
    fill_header(p, 0);
    return p;
}

static void open_private(void)
{
    g_reg = new_private();
    g_shared = 0;
}

/* Caller holds g_pmu. Leaves the shared region (never unmapped: other threads may still read it)
 * for a private one that starts from this process's own usage. Logged once per process. */
static void fall_private(const char *why)
{
    if (!g_shared)
        return;
    static int warned;
    if (!warned) {
        warned = 1;
        LOG_WARN("shared accounting file %s; accounting for this process is now private (its own usage "
                 "against its own limits)", why);
    }
    struct vgpu_region *p = new_private();
    struct vgpu_slot *s = &p->slots[0];
    s->pid = (int32_t)vgpu_self_pid();
    s->start_time = proc_start_time(s->pid);
    s->reserved[0] = g_proc_dev;
    s->reserved[1] = (uint64_t)__atomic_load_n(&g_host_pid, __ATOMIC_RELAXED);
    s->reserved[2] = slot_priority();
    g_slot_start = s->start_time;
    for (int d = 0; d < VGPU_REGION_DEVS; d++)
        s->used[d] = p->used[d] = g_own[d];
    g_slot = 0;
    g_need_slot = 0;
    __atomic_store_n(&g_shared, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&g_reg, p, __ATOMIC_RELEASE);
}

static const char *lost_reason(void)
{
    return g_map_lost ? "was truncated under this process" : "no longer has the header this process joined";
}

/* ------------------------------------------------------------------ self-healing */
/* flock(LOCK_EX) within about `ms` milliseconds (a process stopped inside region_open must not hang
 * the others). Returns 0 when held. */
static int flock_within(int fd, int ms)
{
    for (int waited = 0;; waited += 10) {
        if (flock(fd, LOCK_EX | LOCK_NB) == 0)
            return 0;
        if (errno != EWOULDBLOCK && errno != EINTR)
            return -1;
        if (waited >= ms)
            return -1;
        struct timespec ts = {0, 10000000L};
        nanosleep(&ts, NULL);
    }
}

/* Live slots other than this process's own. */
static int other_live_slots(struct vgpu_region *r)
{
    int n = 0;
    for (int i = 0; i < VGPU_REGION_SLOTS; i++) {
        const struct vgpu_slot *s = &r->slots[i];
        if (s->pid && !(s->pid == vgpu_self_pid() && s->reserved[0] == g_proc_dev) && !slot_dead(s))
            n++;
    }
    return n;
}

/* Caller holds g_pmu, not the region lock. The shared file's header is damaged, or the file was
 * truncated under this process: rebuild it in place (remapping the file after a truncation), keep
 * the live processes' slots, and share it again; this process registers its own usage again at its
 * next operation. Falls back to private accounting when that is impossible. */
static void heal(const char *why)
{
    if (!g_shared)
        return;
    if (g_heals >= MAX_HEALS || g_lock_fd < 0 || flock_within(g_lock_fd, 2000) != 0) {
        fall_private(why);
        return;
    }
    g_heals++;
    size_t need = sizeof(struct vgpu_region);
    struct vgpu_region *r = g_reg;
    int remapped = 0;
    if (g_map_lost) {
        struct stat st;
        if (fstat(g_lock_fd, &st) != 0 || ((size_t)st.st_size < need && ftruncate(g_lock_fd, (off_t)need) != 0)) {
            flock(g_lock_fd, LOCK_UN);
            fall_private(why);
            return;
        }
        void *m = mmap(NULL, need, PROT_READ | PROT_WRITE, MAP_SHARED, g_lock_fd, 0);
        if (m == MAP_FAILED) {
            flock(g_lock_fd, LOCK_UN);
            fall_private(why);
            return;
        }
        r = m; /* the old (now anonymous) mapping stays: other threads may still read it */
        remapped = 1;
    }
    int kept = -1;
    if (!layout_ok(r)) {
        kept = fill_header(r, 1);
    } else if (!limits_match(r)) {
        if (other_live_slots(r)) {
            flock(g_lock_fd, LOCK_UN);
            fall_private("is in use with other limits");
            return;
        }
        kept = fill_header(r, 1);
    }
    if (remapped) {
        __atomic_store_n(&g_map_base, r, __ATOMIC_RELEASE);
        g_map_len = need;
        g_map_lost = 0;
        __atomic_store_n(&g_reg, r, __ATOMIC_RELEASE);
    }
    flock(g_lock_fd, LOCK_UN);
    if (kept >= 0)
        LOG_WARN("shared accounting file %s; rebuilt it (keeping the usage of %d live process(es)) and sharing it "
                 "again", why, kept);
    else
        LOG_WARN("shared accounting file %s; another process rebuilt it, sharing it again", why);
    g_need_slot = 1; /* register this process's own usage again */
}

/* A waiter found the region lock held for over 2 s. Under flock, and only if nobody recovered the
 * lock since this waiter started (`seen` = the recoveries counter then), re-initialise it: its holder
 * is stopped or stuck, or the lock word is damaged. The totals are rebuilt once the lock is taken.
 * Returns 0 when the lock was reset or may be retried, -1 when flock could not be had. */
static int heal_lock(struct vgpu_region *r, uint64_t seen)
{
    if (g_lock_fd < 0 || flock_within(g_lock_fd, 200) != 0)
        return -1;
    if (__atomic_load_n(&r->recoveries, __ATOMIC_ACQUIRE) == seen) {
        int rc = pthread_mutex_trylock(&r->lock.mu);
        if (rc == EBUSY) {
            LOG_WARN("shared accounting lock held for over 2 s (its holder is stuck or the lock is damaged); "
                     "re-initialising it");
            init_mutex(&r->lock.mu);
            __atomic_add_fetch(&r->recoveries, 1, __ATOMIC_ACQ_REL);
            g_rebuild_on_lock = 1;
        } else if (rc == 0 || rc == EOWNERDEAD) {
            if (rc == EOWNERDEAD) {
                rebuild_totals(r);
                pthread_mutex_consistent(&r->lock.mu);
            }
            pthread_mutex_unlock(&r->lock.mu);
        }
    }
    flock(g_lock_fd, LOCK_UN);
    return 0;
}

/* ------------------------------------------------------------------ locking */
static void recover_locked(int rc)
{
    if (rc == EOWNERDEAD) {
        LOG_WARN("shared lock owner died; recovering accounting");
        rebuild_totals(g_reg);
        reap_locked();
        g_reg->recoveries++;
        pthread_mutex_consistent(&g_reg->lock.mu);
    }
}

/* Caller holds g_pmu. Takes the lock of the current region, validating the shared header before and
 * after; on any sign of a damaged file the process falls back to private accounting. */
static void rlock(void)
{
    int waited_ms = 0, stuck_ms = 0;
    uint64_t seen = 0;
    for (;;) {
        struct vgpu_region *r = g_reg;
        if (g_shared && !header_ok(r)) {
            heal(lost_reason());
            continue;
        }
        int rc = pthread_mutex_trylock(&r->lock.mu);
        if (rc == EBUSY) {
            if (!waited_ms)
                seen = __atomic_load_n(&r->recoveries, __ATOMIC_ACQUIRE);
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 200000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            rc = pthread_mutex_timedlock(&r->lock.mu, &ts);
            if (rc == ETIMEDOUT) {
                waited_ms += 200;
                if (g_shared && waited_ms >= 2000) {
                    if (heal_lock(r, seen) == 0) {
                        waited_ms = stuck_ms = 0;
                    } else if ((stuck_ms += 200) >= 10000) {
                        fall_private("lock has been held for over 2 s and could not be re-initialised");
                        waited_ms = stuck_ms = 0;
                    }
                }
                continue; /* re-validate the header, then wait again */
            }
        }
        if (rc == EOWNERDEAD) {
            recover_locked(rc);
        } else if (rc == ENOTRECOVERABLE) {
            LOG_ERROR("shared lock not recoverable; re-initialising it");
            init_mutex(&r->lock.mu);
            if (pthread_mutex_lock(&r->lock.mu) != 0) {
                if (!g_shared)
                    return; /* cannot happen on a private region we just initialised */
                fall_private("lock is unusable");
                continue;
            }
            rebuild_totals(r);
            reap_locked();
        } else if (rc != 0) {
            if (!g_shared) {
                init_mutex(&r->lock.mu);
                continue;
            }
            fall_private("lock is unusable");
            continue;
        }
        if (g_shared && !header_ok(r)) {
            pthread_mutex_unlock(&r->lock.mu);
            heal(lost_reason());
            continue;
        }
        if (UNLIKELY(g_rebuild_on_lock)) { /* after a forced lock reset: the stuck holder may have been mid-update */
            g_rebuild_on_lock = 0;
            rebuild_totals(r);
            reap_locked();
        }
        return;
    }
}

static void runlock(void)
{
    pthread_mutex_unlock(&g_reg->lock.mu);
}

int region_open(void)
{
    ident_init();
    const char *path = vgpu_cfg->cache_path;
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
    long long old_size = 0;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < need) {
        old_size = fstat(fd, &st) == 0 ? (long long)st.st_size : 0;
        if (ftruncate(fd, (off_t)need) != 0) {
            LOG_ERROR("cannot size %s: %s; accounting is per process", path, strerror(errno));
            flock(fd, LOCK_UN);
            close(fd);
            open_private();
            return -1;
        }
        fresh = 1;
    }
    install_guard();
    struct vgpu_region *r = mmap(NULL, need, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED) {
        LOG_ERROR("cannot map %s: %s; accounting is per process", path, strerror(errno));
        flock(fd, LOCK_UN);
        close(fd);
        open_private();
        return -1;
    }
    g_map_len = need;
    g_map_base = r;
    if (fresh) {
        if (old_size > 0)
            LOG_WARN("%s has an unknown layout (%lld bytes, expected %zu); re-initialised", path, old_size, need);
        fill_header(r, 0);
    } else if (!layout_ok(r)) {
        int kept = fill_header(r, 1);
        if (kept)
            LOG_WARN("%s has an unknown layout (bad header); re-initialised, keeping the usage of %d live "
                     "process(es)", path, kept);
        else
            LOG_WARN("%s has an unknown layout (bad header); re-initialised", path);
    } else if (!limits_match(r)) {
        if (live_slots(r) == 0) {
            LOG_WARN("%s was created with other limits and no process uses it; re-initialising", path);
            fill_header(r, 0);
        } else {
            LOG_ERROR("%s is in use with other limits; refusing to mix, accounting for this process is private",
                      path);
            g_map_base = NULL;
            munmap(r, need);
            flock(fd, LOCK_UN);
            close(fd);
            open_private();
            return -1;
        }
    }
    if (!fresh && layout_ok(r) && live_slots(r) == 0) {
        /* no process of the container is alive (a restarted container reusing the file, maybe on another
         * driver): the context costs measured then are not this one's. Nothing is charged either, so a
         * first context is let through and measured anew. */
        for (int d = 0; d < VGPU_REGION_DEVS; d++)
            __atomic_store_n(&r->ctx_cost_mib[d], 0, __ATOMIC_RELAXED);
    }
    if (g_map_lost) { /* shrunk again while we initialised it */
        LOG_WARN("%s was truncated while being opened; accounting is per process", path);
        flock(fd, LOCK_UN);
        close(fd);
        open_private();
        return -1;
    }
    g_reg = r;
    g_shared = 1;
    flock(fd, LOCK_UN);
    g_lock_fd = fd; /* kept open: this description holds the slot's liveness lock */
    return 0;
}

/* Caller holds the lock. */
static int slot_is_mine(int i)
{
    const struct vgpu_slot *s = &g_reg->slots[i];
    return s->pid == (int32_t)vgpu_self_pid() && s->start_time == g_slot_start && s->reserved[0] == g_proc_dev;
}

static void slot_drop_lock(int i)
{
    if (g_lock_fd < 0 || i < 0)
        return;
    struct flock fl = byte_lock(F_UNLCK, SLOT_LOCK_BASE + (uint64_t)i);
    fcntl(g_lock_fd, F_OFD_SETLK, &fl);
}

/* Caller holds the lock. Registers this process's slot (carrying the usage it has charged so far, so
 * a process whose slot was lost to damage counts again), or checks that its slot still names it. */
static void ensure_slot_locked(void)
{
    if (LIKELY(!g_need_slot)) {
        if (LIKELY(g_slot < 0 || slot_is_mine(g_slot)))
            return;
        static int warned;
        if (!warned) {
            warned = 1;
            LOG_WARN("this process's slot in the shared accounting file was overwritten; registering its usage "
                     "again");
        }
    }
    g_need_slot = 0;
    if (g_shared)
        slot_drop_lock(g_slot);
    int pid = vgpu_self_pid();
    reap_locked();
    int free_i = -1;
    for (int i = 0; i < VGPU_REGION_SLOTS; i++) {
        if (g_reg->slots[i].pid == pid && g_reg->slots[i].reserved[0] == g_proc_dev) {
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
    s->reserved[0] = g_proc_dev;
    s->reserved[1] = (uint64_t)__atomic_load_n(&g_host_pid, __ATOMIC_RELAXED);
    s->reserved[2] = slot_priority();
    for (int d = 0; d < VGPU_REGION_DEVS; d++) {
        s->used[d] = g_own[d];
        g_reg->used[d] += g_own[d];
    }
    s->pid = pid;
    g_slot = free_i;
    g_slot_start = s->start_time;
    if (g_shared && slot_take_lock(free_i) != 0)
        LOG_DEBUG("cannot lock slot %d: %s", free_i, strerror(errno));
}

/* The limit is always this process's own (from its environment), never the file's: a damaged or
 * rewritten file can make accounting private, but it can never lift the limit. */
int region_reserve(int dev, uint64_t bytes, int force, uint64_t *used_out, uint64_t *limit_out)
{
    if (dev == VGPU_FOREIGN && !force) { /* not one of the container's GPUs: nothing */
        if (used_out)
            *used_out = 0;
        if (limit_out)
            *limit_out = 0;
        return -1;
    }
    if (!g_reg || dev < 0 || dev >= VGPU_REGION_DEVS)
        return 0;
    int limited = dev < VGPU_MAX_DEV && vgpu_cfg->mem_set[dev];
    uint64_t lim = limited ? vgpu_cfg->mem_limit[dev] : 0;
    pthread_mutex_lock(&g_pmu);
    for (;;) {
        rlock();
        ensure_slot_locked();
        int over = force != 1 && limited && (g_reg->used[dev] + bytes > lim || g_reg->used[dev] + bytes < bytes);
        if (over && g_shared) {
            /* over the limit: dead processes may still hold usage; look at most every 50 ms */
            static uint64_t last_reap;
            uint64_t now = now_ns();
            if (now - last_reap > 50000000ull) {
                last_reap = now;
                reap_locked();
            }
            over = g_reg->used[dev] + bytes > lim || g_reg->used[dev] + bytes < bytes;
        }
        if (over && force == 2 && !g_reg->used[dev]) /* nothing charged on dev: it is let through */
            over = 0;
        if (UNLIKELY(g_shared && g_map_lost)) { /* the file shrank during this operation: heal, then redo it */
            runlock();
            heal(lost_reason());
            continue;
        }
        if (over) {
            if (used_out)
                *used_out = g_reg->used[dev];
            if (limit_out)
                *limit_out = lim;
            runlock();
            pthread_mutex_unlock(&g_pmu);
            return -1;
        }
        break;
    }
    g_reg->used[dev] += bytes;
    if (g_slot >= 0)
        g_reg->slots[g_slot].used[dev] += bytes;
    g_own[dev] += bytes;
    runlock();
    pthread_mutex_unlock(&g_pmu);
    return 0;
}

/* Lock-free: the largest context cost a process of the container has measured on container GPU dev
 * (bytes, rounded up to a MiB; 0: none yet, or the header was rewritten, or no process of the container
 * was alive when one opened the file); a process's first context there is reserved at it (memory.c).
 * Per GPU: GPUs of different models in one container have different context costs. */
uint64_t region_ctx_cost(int dev)
{
    struct vgpu_region *r = __atomic_load_n(&g_reg, __ATOMIC_ACQUIRE);
    if (!r || dev < 0 || dev >= VGPU_REGION_DEVS)
        return 0;
    return (uint64_t)__atomic_load_n(&r->ctx_cost_mib[dev], __ATOMIC_RELAXED) << 20;
}

/* Raises the container's context cost on dev to bytes (it never falls while a process of the container
 * is alive: a process cannot lower what another measured). */
void region_note_ctx_cost(int dev, uint64_t bytes)
{
    struct vgpu_region *r = __atomic_load_n(&g_reg, __ATOMIC_ACQUIRE);
    if (!r || dev < 0 || dev >= VGPU_REGION_DEVS || !bytes)
        return;
    uint64_t mib = (bytes >> 20) + ((bytes & ((1u << 20) - 1)) != 0);
    uint16_t want = mib > UINT16_MAX ? UINT16_MAX : (uint16_t)mib;
    uint16_t cur = __atomic_load_n(&r->ctx_cost_mib[dev], __ATOMIC_RELAXED);
    while (cur < want && !__atomic_compare_exchange_n(&r->ctx_cost_mib[dev], &cur, want, 0, __ATOMIC_RELAXED,
                                                      __ATOMIC_RELAXED))
        ;
}

/* Counted without the lock: a monitor reads it as a counter (kube_vgpu.shimregion). */
void region_count_refusal(void)
{
    if (g_reg)
        __atomic_add_fetch(&g_reg->oom_refusals, 1, __ATOMIC_RELAXED);
}

void region_release(int dev, uint64_t bytes)
{
    if (!g_reg || dev < 0 || dev >= VGPU_REGION_DEVS)
        return;
    pthread_mutex_lock(&g_pmu);
    rlock();
    ensure_slot_locked();
    if (UNLIKELY(g_shared && g_map_lost)) {
        runlock();
        heal(lost_reason());
        rlock();
        ensure_slot_locked();
    }
    uint64_t b = bytes < g_own[dev] ? bytes : g_own[dev];
    if (g_slot >= 0) {
        uint64_t *mine = &g_reg->slots[g_slot].used[dev];
        if (b > *mine)
            b = *mine;
        *mine -= b;
    }
    g_own[dev] -= b;
    g_reg->used[dev] = g_reg->used[dev] > b ? g_reg->used[dev] - b : 0;
    runlock();
    pthread_mutex_unlock(&g_pmu);
}

uint64_t region_used(int dev)
{
    if (!g_reg || dev < 0 || dev >= VGPU_REGION_DEVS)
        return 0;
    pthread_mutex_lock(&g_pmu);
    if (g_shared && !header_ok(g_reg))
        heal(lost_reason());
    uint64_t u = __atomic_load_n(&g_reg->used[dev], __ATOMIC_RELAXED);
    pthread_mutex_unlock(&g_pmu);
    return u;
}

/* Bytes this process has charged on dev (its allocations, pools' reserves and contexts). */
uint64_t region_own(int dev)
{
    if (dev < 0 || dev >= VGPU_REGION_DEVS)
        return 0;
    pthread_mutex_lock(&g_pmu);
    uint64_t b = g_own[dev];
    pthread_mutex_unlock(&g_pmu);
    return b;
}

/* Lock-free (sampler thread): the NVML (host) pid and the task priority (0, 1, -1 unset) of every process
 * of the container. A damaged shared header yields only this process. prio may be NULL. */
void region_procs(int *pids, int *prio, int *n, int max)
{
    *n = 0;
    struct vgpu_region *r = __atomic_load_n(&g_reg, __ATOMIC_ACQUIRE);
    if (!r)
        return;
    if (!__atomic_load_n(&g_shared, __ATOMIC_ACQUIRE) || header_ok(r)) {
        for (int i = 0; i < VGPU_REGION_SLOTS && *n < max; i++) {
            int p = __atomic_load_n(&r->slots[i].pid, __ATOMIC_RELAXED);
            uint64_t h = __atomic_load_n(&r->slots[i].reserved[1], __ATOMIC_RELAXED);
            uint64_t pr = __atomic_load_n(&r->slots[i].reserved[2], __ATOMIC_RELAXED);
            if (p > 0) {
                if (prio)
                    prio[*n] = pr == 1 || pr == 2 ? (int)pr - 1 : -1;
                pids[(*n)++] = h > 0 && h < (1u << 31) ? (int)h : p;
            }
        }
    }
    if (*n == 0 && max > 0) {
        if (prio)
            prio[*n] = vgpu_cfg->priority;
        pids[(*n)++] = vgpu_host_pid();
    }
}

void region_release_self(void)
{
    if (!g_reg || g_slot < 0 || g_need_slot)
        return;
    pthread_mutex_lock(&g_pmu);
    rlock();
    if (g_slot >= 0) {
        struct vgpu_slot *s = &g_reg->slots[g_slot];
        if (s->pid == (int32_t)vgpu_self_pid()) {
            for (int d = 0; d < VGPU_REGION_DEVS; d++)
                g_reg->used[d] = g_reg->used[d] > s->used[d] ? g_reg->used[d] - s->used[d] : 0;
            memset(s, 0, sizeof(*s));
        }
    }
    g_slot = -1;
    runlock();
    pthread_mutex_unlock(&g_pmu);
}

static void hostpid_after_fork_child(void);

void region_after_fork_child(void)
{
    pthread_mutex_init(&g_pmu, NULL);
    hostpid_after_fork_child();
    memset(g_own, 0, sizeof g_own);
    g_slot = -1;
    g_need_slot = 1;
    g_host_pid = 0;
    g_hp_learned = 0;
    ident_init();
    if (g_lock_fd >= 0) { /* the inherited description is the parent's lock holder: get our own */
        close(g_lock_fd);
        g_lock_fd = vgpu_cfg->cache_path[0] ? open(vgpu_cfg->cache_path, O_RDWR | O_CLOEXEC) : -1;
    }
}

/* ------------------------------------------------------------------ host pid
 * NVML reports host pids; inside a container without hostPID a process sees only its own namespace's.
 * Each process learns the pid the driver gives it by listing NVML's running compute processes on the
 * device before and after its first context creation: the one new pid is its own. The listing and the
 * creation are serialised across the container's processes with an open-file-description lock on one
 * byte of the shared file (HP_LOCK, beyond the slot locks; waited for at most 5 s), and pids that other
 * slots of the container already own are excluded. Several new pids (another container created a
 * context at the same moment: containers starting together on one GPU, each context taking the real
 * driver a fraction of a second) are told apart by a probe the driver reports per process (hp_probe).
 * If that fails too, and without NVML, NSpid[0] is used when /proc/self/status shows more than one
 * level (the /proc is an ancestor namespace's), else the process's own pid. The result goes into the
 * process's slot (reserved[1]), from where the SM limiter matches NVML's per-process utilisation.
 * Learning is retried at the next context creation when it failed; once the process has created (or
 * tried to create) a context on a GPU, NVML may list it there already, so a new pid on that GPU is
 * not its own: every listed pid is then a candidate and only the probe decides. The same holds while
 * another thread creates a context there (g_hp_tries). */
#define HP_LOCK (SLOT_LOCK_BASE + VGPU_REGION_SLOTS)
#define HP_MAX VNVML_MAX_PROCS
static pthread_mutex_t g_hp_mu = PTHREAD_MUTEX_INITIALIZER;
static __thread int t_hp_active;
static unsigned g_hp_n, g_hp_before[HP_MAX];
static nvmlDevice_t g_hp_dev; /* written only with g_hp_mu held */
static int g_hp_cdev;         /* the container GPU of g_hp_dev */
static int g_hp_locked;
static int g_hp_all; /* this learning cannot use the listing before: every listed pid is a candidate */
static unsigned g_hp_tries[VGPU_REGION_DEVS]; /* context creations begun on each GPU while learning */

/* In a forked child: the lock may have been held by a thread the child does not have; the child is a
 * new process with no context, and learns anew. */
static void hostpid_after_fork_child(void)
{
    pthread_mutex_init(&g_hp_mu, NULL);
    memset(g_hp_tries, 0, sizeof g_hp_tries);
    g_hp_locked = 0;
    g_hp_all = 0;
}

int hostpid_learned(void)
{
    return __atomic_load_n(&g_hp_learned, __ATOMIC_ACQUIRE) ? __atomic_load_n(&g_host_pid, __ATOMIC_RELAXED) : 0;
}

int vgpu_host_pid(void)
{
    int h = __atomic_load_n(&g_host_pid, __ATOMIC_RELAXED);
    if (h)
        return h;
    return vgpu_self_pid();
}

/* The running compute processes on g_hp_dev (see vnvml_process_memory). */
static int hp_list(unsigned *pids, uint64_t *used, unsigned *n)
{
    return vnvml_process_memory(g_hp_dev, pids, used, HP_MAX, n);
}

/* The device memory NVML reports for pid in a listing, 0 if it is not listed, UINT64_MAX if unknown. */
static uint64_t hp_used_of(unsigned pid, const unsigned *pids, const uint64_t *used, unsigned n)
{
    for (unsigned i = 0; i < n; i++)
        if (pids[i] == pid)
            return used[i];
    return 0;
}

/* Several new pids around the context creation: which is this process's? It allocates P bytes in its new
 * context (charged to its own memory limit for the moment), lists the running processes with the memory
 * each uses, and frees them: its own pid's memory rose by P, up to the driver's 2 MiB rounding. Each round
 * draws P anew (2 to 32 MiB, or up to what is left under the limit when that is less), so another process matches only by allocating as much at the same moment;
 * a candidate must match every round, and the last one left must match once more. A round that no
 * candidate matches (its own pid did not show the probe) ends it. Returns the pid, or 0. */
#define HP_ROUNDS 5
#define HP_PAGE (2ull << 20)
static unsigned hp_probe(int cdev, CUcontext ctx, unsigned *cand, unsigned nc)
{
    static unsigned pb[HP_MAX], pa[HP_MAX]; /* pids listed before and after the allocation */
    static uint64_t ub[HP_MAX], ua[HP_MAX]; /* and the memory each used */
    if (!ctx || !real_cuCtxPushCurrent_v2 || !real_cuCtxPopCurrent_v2 || !real_cuMemAlloc_v2 || !real_cuMemFree_v2)
        return 0;
    if (real_cuCtxPushCurrent_v2(ctx) != CUDA_SUCCESS)
        return 0;
    uint64_t seed = now_ns() ^ ((uint64_t)(unsigned)vgpu_self_pid() << 32) ^ (uint64_t)(uintptr_t)ctx;
    int confirmed = 0;
    for (int round = 0; round < HP_ROUNDS && nc > 0 && !confirmed; round++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        uint64_t p = HP_PAGE * (1 + (seed >> 33) % 16), used = 0, lim = 0;
        unsigned nb = 0, na = 0, keep = 0;
        CUdeviceptr ptr = 0;
        if (hp_list(pb, ub, &nb) != 0)
            break;
        if (region_reserve(cdev, p, 0, &used, &lim) != 0) {
            /* less room under this process's limit: a size drawn from what fits (a neighbour still has
             * to match every round, and its own pid always does, so a smaller choice only costs rounds) */
            uint64_t pages = lim > used ? (lim - used) / HP_PAGE : 0;
            p = HP_PAGE * (1 + (pages ? (seed >> 33) % pages : 0));
            if (!pages || region_reserve(cdev, p, 0, NULL, NULL) != 0)
                break; /* no room for the probe */
        }
        int ok = real_cuMemAlloc_v2(&ptr, p) == CUDA_SUCCESS;
        if (ok) {
            ok = hp_list(pa, ua, &na) == 0;
            real_cuMemFree_v2(ptr);
        }
        region_release(cdev, p);
        if (!ok)
            break;
        for (unsigned i = 0; i < nc; i++) {
            uint64_t b = hp_used_of(cand[i], pb, ub, nb), a = hp_used_of(cand[i], pa, ua, na);
            if (a != UINT64_MAX && b != UINT64_MAX && a >= b + p && a - b <= p + HP_PAGE)
                cand[keep++] = cand[i];
        }
        confirmed = nc == 1 && keep == 1;
        nc = keep;
    }
    CUcontext popped;
    real_cuCtxPopCurrent_v2(&popped);
    return confirmed ? cand[0] : 0;
}

static int hp_lock(int type)
{
    if (g_lock_fd < 0)
        return 0; /* no shared file: nothing to serialise with */
    struct flock fl = byte_lock(type, HP_LOCK);
    for (int waited = 0;; waited += 5) {
        if (fcntl(g_lock_fd, F_OFD_SETLK, &fl) == 0)
            return 0;
        if (type == F_UNLCK || waited >= 5000 || (errno != EAGAIN && errno != EACCES && errno != EINTR))
            return -1;
        struct timespec ts = {0, 5000000L};
        nanosleep(&ts, NULL);
    }
}

static void hp_fallback(void)
{
    if (!__atomic_load_n(&g_host_pid, __ATOMIC_RELAXED) && g_nspid_levels > 1)
        __atomic_store_n(&g_host_pid, vgpu_self_pid(), __ATOMIC_RELAXED);
}

void hostpid_before_ctx(int cdev)
{
    if (__atomic_load_n(&g_host_pid, __ATOMIC_RELAXED) || t_hp_active)
        return;
    /* from here a context may exist on cdev (even if this creation fails, or learning is not tried) */
    int known = cdev >= 0 && cdev < VGPU_REGION_DEVS;
    if (known)
        __atomic_add_fetch(&g_hp_tries[cdev], 1, __ATOMIC_ACQ_REL);
    nvmlDevice_t h; /* not g_hp_dev: another thread may be learning with it */
    if (!vgpu_nvml_load() || !vnvml_lists_processes() || vgpu_nvml_of_dev(cdev, &h) != 0) {
        hp_fallback();
        return;
    }
    pthread_mutex_lock(&g_hp_mu);
    if (__atomic_load_n(&g_host_pid, __ATOMIC_RELAXED) || vgpu_nvml_of_dev(cdev, &g_hp_dev) != 0) {
        pthread_mutex_unlock(&g_hp_mu);
        return;
    }
    g_hp_cdev = cdev;
    /* only this creation, and the first on cdev: no context of this process can be listed there yet */
    g_hp_all = !known || __atomic_load_n(&g_hp_tries[cdev], __ATOMIC_ACQUIRE) != 1;
    g_hp_locked = hp_lock(F_WRLCK) == 0;
    if (!g_hp_locked || hp_list(g_hp_before, NULL, &g_hp_n) != 0) {
        if (g_hp_locked)
            hp_lock(F_UNLCK);
        pthread_mutex_unlock(&g_hp_mu);
        hp_fallback();
        return;
    }
    LOG_DEBUG("NVML lists %u processes on the device before this process's first context", g_hp_n);
    t_hp_active = 1; /* g_hp_mu stays held until hostpid_after_ctx in this thread */
}

void hostpid_after_ctx(int created, CUcontext ctx)
{
    if (!t_hp_active)
        return;
    t_hp_active = 0;
    static unsigned after[HP_MAX], cand[HP_MAX];
    unsigned n = 0, found = 0, count = 0;
    if (created && hp_list(after, NULL, &n) == 0) {
        struct vgpu_region *r = __atomic_load_n(&g_reg, __ATOMIC_ACQUIRE);
        for (unsigned i = 0; i < n; i++) {
            int seen = 0;
            for (unsigned j = 0; j < g_hp_n && !seen && !g_hp_all; j++)
                seen = g_hp_before[j] == after[i];
            /* pids other processes of the container already learned (their context on another GPU) */
            for (int k = 0; r && k < VGPU_REGION_SLOTS && !seen; k++)
                seen = k != g_slot && __atomic_load_n(&r->slots[k].reserved[1], __ATOMIC_RELAXED) == after[i];
            if (!seen) {
                found = after[i];
                cand[count++] = after[i];
            }
        }
    }
    int sure = count == 1 && !g_hp_all; /* the one new pid is this process's */
    if (count > 1 || (g_hp_all && count > 0)) {
        found = hp_probe(g_hp_cdev, ctx, cand, count);
        sure = found != 0;
        LOG_INFO("%u %s pids around this process's context creation; a memory probe %s", count,
                 g_hp_all ? "listed (this process may be one already)" : "new",
                 sure ? "told its own apart" : "could not tell them apart");
    }
    if (g_hp_locked)
        hp_lock(F_UNLCK);
    if (sure && found > 0 && found < (1u << 31)) {
        __atomic_store_n(&g_host_pid, (int)found, __ATOMIC_RELAXED);
        __atomic_store_n(&g_hp_learned, 1, __ATOMIC_RELEASE);
        LOG_INFO("NVML reports this process as pid %u (pid %d here)", found, vgpu_self_pid());
    } else if (created) {
        LOG_INFO("could not learn this process's NVML pid (%u candidate pids around its context creation)", count);
    }
    pthread_mutex_unlock(&g_hp_mu);
    hp_fallback();
    int h = __atomic_load_n(&g_host_pid, __ATOMIC_RELAXED);
    if (h && g_reg) { /* record it in this process's slot */
        pthread_mutex_lock(&g_pmu);
        rlock();
        ensure_slot_locked();
        if (g_slot >= 0)
            __atomic_store_n(&g_reg->slots[g_slot].reserved[1], (uint64_t)h, __ATOMIC_RELAXED);
        runlock();
        pthread_mutex_unlock(&g_pmu);
    }
}

/* Test hook (KF-29): take the shared lock and keep it; the caller is expected to be killed. */
EXPORT int vgpu_debug_hold_lock(void)
{
    vgpu_base_init();
    if (!g_reg)
        return -1;
    pthread_mutex_lock(&g_pmu);
    rlock();
    return g_shared ? 0 : 1;
}

__attribute__((destructor)) static void region_fini(void)
{
    region_release_self();
}
