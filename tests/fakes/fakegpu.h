/*
 * State shared by the fake libcuda.so.1 and the fake libnvidia-ml.so.1 (test doubles only).
 *
 * Device list: both fakes read the file named by FAKE_NVML_CONFIG (format in fakenvml.c and
 * README.md).  Simulated GPU activity: when FAKE_GPU_STATE names a file, it is mmap'd by every
 * process that loads a fake; the fake libcuda records each kernel's simulated busy interval
 * there (per device, with the launching pid) and the fake NVML derives utilisation, per-process
 * utilisation, used memory and the running-process list from it.  Without FAKE_GPU_STATE each
 * process keeps a private state and NVML sees no activity.
 */
#ifndef FAKEGPU_H
#define FAKEGPU_H

#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FG_MAX_DEV 8
#define FG_MAX_LINKS 18
#define FG_RING 16384
#define FG_MAX_PROC 256
#define FG_MAGIC 0x46474731u /* "FGG1" */

struct fg_interval {
    int32_t pid;
    uint32_t pad;
    uint64_t start_ns; /* CLOCK_MONOTONIC */
    uint64_t end_ns;
};

struct fg_proc {
    int32_t pid;
    int32_t dev;
    uint64_t used; /* bytes of simulated device memory held by pid on dev */
};

struct fg_dev {
    uint64_t used;    /* bytes, all processes */
    uint64_t tail_ns; /* when the device's queued work ends */
    uint64_t head;    /* number of intervals ever recorded */
    uint64_t launches;
    struct fg_interval ring[FG_RING];
};

struct fg_state {
    uint32_t magic;
    uint32_t pad;
    pthread_mutex_t lock;
    char lockpad[64 - sizeof(pthread_mutex_t) % 64];
    struct fg_proc procs[FG_MAX_PROC];
    struct fg_dev dev[FG_MAX_DEV];
};

/* ------------------------------------------------------------------ device config */

struct fg_gpu {
    int index;
    char uuid[96];
    char name[96];
    unsigned long long memory_mib;
    int numa;
    int mig;
    unsigned util; /* baseline utilisation percent added to simulated activity */
    int fail;      /* 1: NVML queries on this GPU return NVML_ERROR_GPU_IS_LOST */
    unsigned minor;
    char pci[32];
    int cc_major, cc_minor;
    int sm_count;
    int pcie_switch;           /* PCIe switch id (GPUs sharing one: NVML_TOPOLOGY_SINGLE); -1 none */
    int n_nvlink;              /* NVLink links, each to the GPU of NVML index nvlink[k] */
    int nvlink[FG_MAX_LINKS];
};

struct fg_config {
    int count;
    char driver[32];
    int cuda_version;
    struct fg_gpu gpu[FG_MAX_DEV];
};

static inline void fg_default_gpu(struct fg_gpu *g, int i)
{
    memset(g, 0, sizeof(*g));
    g->index = i;
    snprintf(g->uuid, sizeof g->uuid, "GPU-00000000-0000-4000-8000-%012d", i);
    snprintf(g->name, sizeof g->name, "NVIDIA H200");
    g->memory_mib = 143771;
    g->numa = 0;
    g->minor = (unsigned)i;
    snprintf(g->pci, sizeof g->pci, "00000000:%02X:00.0", 0x17 + i);
    g->cc_major = 9;
    g->cc_minor = 0;
    g->pcie_switch = -1;
    g->sm_count = 132;
}

static inline void fg_copy(char *dst, size_t n, const char *src)
{
    size_t l = strlen(src);
    if (l >= n)
        l = n - 1;
    memcpy(dst, src, l);
    dst[l] = 0;
}

/* Parse one "key=value" token; value may be double-quoted. Returns pointer after token. */
static inline const char *fg_token(const char *p, char *key, size_t klen, char *val, size_t vlen)
{
    size_t k = 0, v = 0;
    while (*p && isspace((unsigned char)*p))
        p++;
    while (*p && *p != '=' && !isspace((unsigned char)*p)) {
        if (k + 1 < klen)
            key[k++] = *p;
        p++;
    }
    key[k] = 0;
    if (*p == '=') {
        p++;
        if (*p == '"') {
            p++;
            while (*p && *p != '"') {
                if (v + 1 < vlen)
                    val[v++] = *p;
                p++;
            }
            if (*p == '"')
                p++;
        } else {
            while (*p && !isspace((unsigned char)*p)) {
                if (v + 1 < vlen)
                    val[v++] = *p;
                p++;
            }
        }
    }
    val[v] = 0;
    return p;
}

/* Load FAKE_NVML_CONFIG (or defaults: one H200). Returns 0 on success. */
static inline int fg_load_config(struct fg_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    snprintf(cfg->driver, sizeof cfg->driver, "550.54.15");
    cfg->cuda_version = 12040;
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *f = path && *path ? fopen(path, "r") : NULL;
    if (!f) {
        cfg->count = 1;
        fg_default_gpu(&cfg->gpu[0], 0);
        return path && *path ? -1 : 0;
    }
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        const char *p = line;
        while (*p && isspace((unsigned char)*p))
            p++;
        if (*p == '#' || *p == 0)
            continue;
        char key[64], val[256];
        if (strncmp(p, "gpu", 3) == 0 && isspace((unsigned char)p[3])) {
            if (cfg->count >= FG_MAX_DEV)
                continue;
            struct fg_gpu *g = &cfg->gpu[cfg->count];
            fg_default_gpu(g, cfg->count);
            p += 3;
            while (*p && *p != '\n') {
                p = fg_token(p, key, sizeof key, val, sizeof val);
                if (!key[0])
                    break;
                if (!strcmp(key, "index"))
                    g->index = atoi(val);
                else if (!strcmp(key, "uuid"))
                    fg_copy(g->uuid, sizeof g->uuid, val);
                else if (!strcmp(key, "name"))
                    fg_copy(g->name, sizeof g->name, val);
                else if (!strcmp(key, "memory_mib"))
                    g->memory_mib = strtoull(val, NULL, 10);
                else if (!strcmp(key, "numa"))
                    g->numa = atoi(val);
                else if (!strcmp(key, "mig"))
                    g->mig = atoi(val);
                else if (!strcmp(key, "util"))
                    g->util = (unsigned)atoi(val);
                else if (!strcmp(key, "fail"))
                    g->fail = atoi(val);
                else if (!strcmp(key, "minor"))
                    g->minor = (unsigned)atoi(val);
                else if (!strcmp(key, "pci"))
                    fg_copy(g->pci, sizeof g->pci, val);
                else if (!strcmp(key, "cc")) {
                    g->cc_major = atoi(val);
                    const char *dot = strchr(val, '.');
                    g->cc_minor = dot ? atoi(dot + 1) : 0;
                } else if (!strcmp(key, "sm_count"))
                    g->sm_count = atoi(val);
                else if (!strcmp(key, "switch"))
                    g->pcie_switch = atoi(val);
                else if (!strcmp(key, "nvlink")) { /* peer NVML indexes, one link each: nvlink=1,1,2 */
                    g->n_nvlink = 0;
                    for (const char *q = val; *q && g->n_nvlink < FG_MAX_LINKS;) {
                        g->nvlink[g->n_nvlink++] = atoi(q);
                        const char *comma = strchr(q, ',');
                        if (!comma)
                            break;
                        q = comma + 1;
                    }
                }
                /* unknown keys are ignored so the format can grow additively */
            }
            cfg->count++;
        } else {
            /* global settings: driver=..., cuda=... */
            while (*p && *p != '\n') {
                p = fg_token(p, key, sizeof key, val, sizeof val);
                if (!key[0])
                    break;
                if (!strcmp(key, "driver"))
                    fg_copy(cfg->driver, sizeof cfg->driver, val);
                else if (!strcmp(key, "cuda"))
                    cfg->cuda_version = atoi(val);
            }
        }
    }
    fclose(f);
    return 0;
}

/* ------------------------------------------------------------------ shared state */

static inline uint64_t fg_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t fg_realtime_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000ull;
}

static inline void fg_sleep_until(uint64_t t_ns)
{
    struct timespec ts = {(time_t)(t_ns / 1000000000ull), (long)(t_ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

/* Like the driver: a process that exited has no GPU memory, zombie or not (its device files are
 * closed before it becomes a zombie). pid: as /proc shows it. */
/* The host's /proc: $FAKE_HOST_PROC (a test that runs a process with its own PID namespace and its own
 * /proc mount, as a container has, bind-mounts the host's /proc there first), else /proc. The driver
 * knows host pids whatever the process's /proc shows; this is how the fakes learn them. */
static inline const char *fg_host_proc(void)
{
    const char *p = getenv("FAKE_HOST_PROC");
    return p && *p ? p : "/proc";
}

static inline int fg_pid_alive(int pid)
{
    if (pid <= 0)
        return 0;
    char path[4200], buf[512];
    snprintf(path, sizeof path, "%s/%d/stat", fg_host_proc(), pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kill(pid, 0) == 0 || errno != ESRCH;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    const char *p = strrchr(buf, ')');
    return !(p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X'));
}

/* The pid the driver reports for this process: the host's (outermost) pid, NSpid[0] of the host /proc's
 * self/status (fg_host_proc). NVML reports host pids even inside a PID namespace. */
static inline int fg_host_pid(void)
{
    static __thread int cached, cached_for;
    int me = (int)getpid();
    if (cached && cached_for == me)
        return cached;
    int pid = me;
    char path[4200];
    snprintf(path, sizeof path, "%s/self/status", fg_host_proc());
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        char buf[4096];
        ssize_t n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n > 0) {
            buf[n] = 0;
            const char *l = strstr(buf, "\nNSpid:");
            if (l && atoi(l + 7) > 0)
                pid = atoi(l + 7);
        }
    }
    cached = pid;
    cached_for = me;
    return pid;
}

static inline void fg_lock(struct fg_state *s)
{
    int rc = pthread_mutex_lock(&s->lock);
    if (rc == EOWNERDEAD)
        pthread_mutex_consistent(&s->lock);
}

static inline void fg_unlock(struct fg_state *s)
{
    pthread_mutex_unlock(&s->lock);
}

/* Reclaim the simulated memory of processes that died without freeing it (the driver does). */
static inline void fg_reap_locked(struct fg_state *s)
{
    for (int i = 0; i < FG_MAX_PROC; i++) {
        struct fg_proc *p = &s->procs[i];
        if (p->pid && !fg_pid_alive(p->pid)) {
            if (p->dev >= 0 && p->dev < FG_MAX_DEV) {
                uint64_t u = p->used;
                s->dev[p->dev].used = s->dev[p->dev].used > u ? s->dev[p->dev].used - u : 0;
            }
            memset(p, 0, sizeof(*p));
        }
    }
}

static inline struct fg_state *fg_open_state(void)
{
    const char *path = getenv("FAKE_GPU_STATE");
    struct fg_state *s;
    if (!path || !*path) {
        s = mmap(NULL, sizeof(struct fg_state), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (s == MAP_FAILED)
            return NULL;
        pthread_mutexattr_t a;
        pthread_mutexattr_init(&a);
        pthread_mutex_init(&s->lock, &a);
        pthread_mutexattr_destroy(&a);
        s->magic = FG_MAGIC;
        return s;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0)
        return NULL;
    flock(fd, LOCK_EX);
    struct stat st;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size < sizeof(struct fg_state)) {
        if (ftruncate(fd, (off_t)sizeof(struct fg_state)) != 0) {
            flock(fd, LOCK_UN);
            close(fd);
            return NULL;
        }
    }
    s = mmap(NULL, sizeof(struct fg_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (s == MAP_FAILED) {
        flock(fd, LOCK_UN);
        close(fd);
        return NULL;
    }
    if (s->magic != FG_MAGIC) {
        memset(s, 0, sizeof(*s));
        pthread_mutexattr_t a;
        pthread_mutexattr_init(&a);
        pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&s->lock, &a);
        pthread_mutexattr_destroy(&a);
        s->magic = FG_MAGIC;
    }
    flock(fd, LOCK_UN);
    close(fd);
    fg_lock(s);
    fg_reap_locked(s);
    fg_unlock(s);
    return s;
}

/* Busy nanoseconds of device `dev` within [t0, t1), only intervals of `pid` (or all if pid < 0).
 * Caller holds the lock. */
static inline uint64_t fg_busy_locked(struct fg_state *s, int dev, int pid, uint64_t t0, uint64_t t1)
{
    struct fg_dev *d = &s->dev[dev];
    uint64_t busy = 0;
    uint64_t n = d->head < FG_RING ? d->head : FG_RING;
    for (uint64_t k = 0; k < n; k++) {
        const struct fg_interval *iv = &d->ring[(d->head - 1 - k) % FG_RING];
        if (iv->end_ns <= t0) {
            /* intervals are recorded in start order on a serial device; once an interval ends
             * before the window, all older ones do too */
            break;
        }
        if (pid >= 0 && iv->pid != pid)
            continue;
        uint64_t a = iv->start_ns > t0 ? iv->start_ns : t0;
        uint64_t b = iv->end_ns < t1 ? iv->end_ns : t1;
        if (b > a)
            busy += b - a;
    }
    return busy;
}

/* Add delta bytes (may be negative) to pid's usage on dev. Caller holds the lock. */
static inline void fg_proc_add_locked(struct fg_state *s, int pid, int dev, int64_t delta)
{
    struct fg_proc *slot = NULL, *empty = NULL;
    for (int i = 0; i < FG_MAX_PROC; i++) {
        if (s->procs[i].pid == pid && s->procs[i].dev == dev) {
            slot = &s->procs[i];
            break;
        }
        if (!empty && s->procs[i].pid == 0)
            empty = &s->procs[i];
    }
    if (!slot) {
        if (!empty || delta <= 0)
            return;
        slot = empty;
        slot->pid = pid;
        slot->dev = dev;
        slot->used = 0;
    }
    if (delta < 0 && (uint64_t)(-delta) > slot->used)
        slot->used = 0;
    else
        slot->used = (uint64_t)((int64_t)slot->used + delta);
    if (slot->used == 0)
        memset(slot, 0, sizeof(*slot));
}

#endif
