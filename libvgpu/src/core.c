/*
 * libvgpu core: configuration from the environment (read once), logging, loading of the real
 * libcuda.so.1 / libnvidia-ml.so.1, and the three lookup paths that hand out hooks:
 * exported symbols (direct linking), an overridden dlsym(), and cuGetProcAddress(_v2).
 */
#include "vgpu.h"

#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define HOOK(name, ret, params, args) name##_fn real_##name;
#define REAL(name, ret, params) name##_fn real_##name;
#include "hooks_list.h"
#undef HOOK
#undef REAL

/* hook prototypes (defined in memory.c / limiter.c / below) */
#define HOOK(name, ret, params, args) EXPORT ret name params;
#define REAL(name, ret, params)
#include "hooks_list.h"
#undef HOOK
#undef REAL
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m);
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m);

struct vgpu_config g_cfg = {.enabled = 1, .log_level = 2, .context_cost = -1, .sm_period_ms = 100, .nvisible = -1};
struct nvml_api g_nvml;
int g_cuda_ready;
int g_sm_active;

static void *g_libcuda;
static void *g_libnvml;
static void *(*real_dlsym)(void *, const char *);

/* ------------------------------------------------------------------ hook table */
struct hook {
    const char *name;
    void *hook;
    void **real;
};

#define HOOK(name, ret, params, args) {#name, (void *)name, (void **)&real_##name},
#define REAL(name, ret, params)
static struct hook g_hooks[] = {
#include "hooks_list.h"
    {"nvmlDeviceGetMemoryInfo", (void *)nvmlDeviceGetMemoryInfo, NULL},
    {"nvmlDeviceGetMemoryInfo_v2", (void *)nvmlDeviceGetMemoryInfo_v2, NULL},
};
#undef HOOK
#undef REAL
#define NHOOKS (sizeof g_hooks / sizeof g_hooks[0])

static struct hook *g_by_name[NHOOKS];
struct realmap {
    void *real;
    void *hook;
};
static struct realmap g_by_real[NHOOKS];
static size_t g_nreal;
static pthread_once_t g_table_once = PTHREAD_ONCE_INIT;

static int cmp_name(const void *a, const void *b)
{
    return strcmp((*(struct hook *const *)a)->name, (*(struct hook *const *)b)->name);
}

static void table_init(void)
{
    for (size_t i = 0; i < NHOOKS; i++)
        g_by_name[i] = &g_hooks[i];
    qsort(g_by_name, NHOOKS, sizeof g_by_name[0], cmp_name);
}

static void *hook_by_name(const char *name)
{
    pthread_once(&g_table_once, table_init);
    size_t lo = 0, hi = NHOOKS;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(name, g_by_name[mid]->name);
        if (c == 0)
            return g_by_name[mid]->hook;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

static int cmp_real(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)((const struct realmap *)a)->real, y = (uintptr_t)((const struct realmap *)b)->real;
    return x < y ? -1 : x > y;
}

static void *hook_by_real(void *real)
{
    size_t lo = 0, hi = g_nreal;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (g_by_real[mid].real == real)
            return g_by_real[mid].hook;
        if ((uintptr_t)real < (uintptr_t)g_by_real[mid].real)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

/* ------------------------------------------------------------------ logging */
void vgpu_log(int level, const char *fmt, ...)
{
    if (level > g_cfg.log_level)
        return;
    static const char *names[] = {"", "ERROR", "WARN", "INFO", "DEBUG"};
    char buf[512];
    int n = snprintf(buf, sizeof buf, "[libvgpu %d] %s: ", (int)getpid(), names[level < 0 ? 0 : level > 4 ? 4 : level]);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof buf)
        n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof buf - 1)
        n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t w = write(2, buf, (size_t)n);
    (void)w;
}

uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ configuration */
/* Strict "<digits>[k|m|g]" (suffix case-insensitive; none = bytes). No sign, no spaces, no
 * fraction, no overflow. Returns the value; *bad = 1 (and 0 returned) for anything else. */
static uint64_t parse_bytes(const char *s, int *bad)
{
    *bad = 0;
    if (!s || !*s) {
        *bad = 1;
        return 0;
    }
    uint64_t v = 0;
    const char *p = s;
    for (; *p >= '0' && *p <= '9'; p++) {
        unsigned d = (unsigned)(*p - '0');
        if (v > (UINT64_MAX - d) / 10) {
            *bad = 1;
            return 0;
        }
        v = v * 10 + d;
    }
    if (p == s) {
        *bad = 1;
        return 0;
    }
    unsigned shift = 0;
    switch (*p) {
    case 0:
        break;
    case 'k':
    case 'K':
        shift = 10;
        break;
    case 'm':
    case 'M':
        shift = 20;
        break;
    case 'g':
    case 'G':
        shift = 30;
        break;
    default:
        *bad = 1;
        return 0;
    }
    if (shift && p[1]) {
        *bad = 1;
        return 0;
    }
    if (shift && v > (UINT64_MAX >> shift)) {
        *bad = 1;
        return 0;
    }
    return v << shift;
}

/* A memory limit variable: absent -> no limit from it (returns 0). Present -> a limit applies
 * (returns 1): its value when valid and > 0, else 0 bytes (fail closed), with one WARN unless quiet. */
static int read_mem_limit(const char *name, uint64_t *out, int quiet)
{
    const char *v = getenv(name);
    if (!v)
        return 0;
    int bad;
    uint64_t b = parse_bytes(v, &bad);
    if ((bad || b == 0) && !quiet)
        LOG_WARN("%s %s=\"%s\"; failing closed: memory limit 0 on the device(s) it covers, every allocation "
                 "is refused", bad ? "invalid" : "zero", name, v);
    *out = bad ? 0 : b;
    return 1;
}

static int parse_percent(const char *s, int *bad)
{
    *bad = 0;
    if (!s || !*s)
        return 0;
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < 0) {
        *bad = 1;
        return 0;
    }
    return v >= 100 ? 0 : (int)v;
}

static int is_true(const char *v)
{
    return v && (!strcasecmp(v, "true") || !strcmp(v, "1"));
}

/* Splits a comma-separated list into out[][96]; returns the count. */
static int split_list(const char *v, char out[][96], int max)
{
    int n = 0;
    const char *p = v;
    while (*p && n < max) {
        size_t len = strcspn(p, ",");
        size_t c = len < 95 ? len : 95;
        memcpy(out[n], p, c);
        out[n][c] = 0;
        n++;
        p += len;
        if (*p == ',')
            p++;
    }
    return n;
}

/* The limits and policy knobs a process's environment asks for (the regime without a limits file,
 * and the comparison with the file). quiet: no warnings (the file decides anyway). */
static void env_config(struct vgpu_config *c, int quiet)
{
    c->enabled = !is_true(getenv("CUDA_DISABLE_CONTROL"));
    int bad;
    uint64_t all = 0;
    int all_set = read_mem_limit("CUDA_DEVICE_MEMORY_LIMIT", &all, quiet);
    int sm_all = parse_percent(getenv("CUDA_DEVICE_SM_LIMIT"), &bad);
    if (bad && !quiet)
        LOG_WARN("ignoring invalid CUDA_DEVICE_SM_LIMIT=%s", getenv("CUDA_DEVICE_SM_LIMIT"));
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        char name[64];
        snprintf(name, sizeof name, "CUDA_DEVICE_MEMORY_LIMIT_%d", i);
        uint64_t b = 0;
        if (read_mem_limit(name, &b, quiet)) {
            c->mem_limit[i] = b;
            c->mem_set[i] = 1;
        } else {
            c->mem_limit[i] = all;
            c->mem_set[i] = (uint8_t)all_set;
        }
        snprintf(name, sizeof name, "CUDA_DEVICE_SM_LIMIT_%d", i);
        const char *v = getenv(name);
        int pct = parse_percent(v, &bad);
        if (bad && !quiet)
            LOG_WARN("ignoring invalid %s=%s", name, v);
        c->sm_limit[i] = (v && *v && !bad) ? pct : sm_all;
    }
    const char *pol = getenv("GPU_CORE_UTILIZATION_POLICY");
    c->core_disabled = pol && !strcasecmp(pol, "disable");
    if (c->core_disabled)
        for (int i = 0; i < VGPU_MAX_DEV; i++)
            c->sm_limit[i] = 0;
    const char *cache = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    snprintf(c->cache_path, sizeof c->cache_path, "%s", cache ? cache : "");
    const char *nv = getenv("NVIDIA_VISIBLE_DEVICES");
    c->nuuid = 0;
    if (nv && !strncmp(nv, "GPU-", 4))
        c->nuuid = split_list(nv, c->uuid, VGPU_MAX_DEV);
    const char *pr = getenv("CUDA_TASK_PRIORITY");
    c->priority = pr && (!strcmp(pr, "0") || !strcmp(pr, "1")) ? atoi(pr) : -1;
}

/* ------------------------------------------------------------------ the container's limits file
 * Format (version 1, written by kube_vgpu.envcontract.limits_file, docs/env-contract.md):
 * "key=value" lines, '#' comments and blank lines ignored, unknown keys ignored, no key twice.
 * Required: version=1, devices=<1..16>, and per device i: uuid_<i>, memory_mib_<i> (> 0),
 * cores_<i> (0..100). Optional: shared_cache=<absolute path>, core_policy=default|disable,
 * core_sharing=strict|work_conserving, disable_control=true|false, priority=0|1. A "state" key other than "ready" (the device plugin's
 * placeholder at Allocate says "pending") makes the file unusable. */
struct limits_file {
    int version, ndev;
    uint64_t mem_mib[VGPU_MAX_DEV];
    int cores[VGPU_MAX_DEV];
    char uuid[VGPU_MAX_DEV][96];
    char cache[512];
    int core_disable, core_conserving, disable_control, priority;
};

static int lf_uint(const char *key, const char *v, uint64_t max, uint64_t *out, char *err, size_t errlen)
{
    int bad;
    uint64_t x = (*v >= '0' && *v <= '9') ? parse_bytes(v, &bad) : (bad = 1, 0);
    if (!bad) {
        const char *q = v;
        while (*q >= '0' && *q <= '9')
            q++;
        bad = *q != 0; /* digits only, no suffix */
    }
    if (bad || x > max) {
        snprintf(err, errlen, "%.40s=\"%.40s\": expected an integer 0..%llu", key, v, (unsigned long long)max);
        return -1;
    }
    *out = x;
    return 0;
}

/* Whether the directory holding `path` exists (the device plugin mounted the container's limits
 * directory: a missing file in it is not "no limits file" but "limits not written"). */
static int limits_dir_exists(const char *path)
{
    char dir[512];
    const char *slash = strrchr(path, '/');
    if (!slash || (size_t)(slash - path) >= sizeof dir)
        return 0;
    memcpy(dir, path, (size_t)(slash - path));
    dir[slash - path] = 0;
    struct stat st;
    return stat(dir[0] ? dir : "/", &st) == 0 && S_ISDIR(st.st_mode);
}

/* Returns 0 when there is no file (and no limits directory), 1 when it was read, -1 when it is present
 * but unusable or the limits directory is mounted without it (err says why). */
static int load_limits_file(const char *path, struct limits_file *L, char *err, size_t errlen)
{
    memset(L, 0, sizeof *L);
    L->priority = -1;
    for (int i = 0; i < VGPU_MAX_DEV; i++)
        L->cores[i] = -1;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT && limits_dir_exists(path)) {
            snprintf(err, errlen, "absent, but its directory is mounted: the device plugin has not written this "
                                  "container's limits");
            return -1;
        }
        if (errno == ENOENT || errno == ENOTDIR)
            return 0;
        snprintf(err, errlen, "cannot open it: %s", strerror(errno));
        return -1;
    }
    static char buf[16384];
    size_t n = 0;
    for (;;) {
        ssize_t r = read(fd, buf + n, sizeof buf - 1 - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        n += (size_t)r;
        if (n == sizeof buf - 1)
            break;
    }
    close(fd);
    if (n == sizeof buf - 1) {
        snprintf(err, errlen, "larger than %zu bytes", sizeof buf - 2);
        return -1;
    }
    buf[n] = 0;
    if (memchr(buf, 0, n)) {
        snprintf(err, errlen, "not a text file of key=value lines (NUL byte)");
        return -1;
    }
    char seen_names[64][32]; /* keys seen, to refuse repeats */
    int nseen = 0;
    for (char *line = buf, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next)
            *next++ = 0;
        if (!*line || *line == '#')
            continue;
        char *eq = strchr(line, '=');
        if (!eq) {
            snprintf(err, errlen, "line \"%.60s\" is not key=value", line);
            return -1;
        }
        *eq = 0;
        const char *key = line, *v = eq + 1;
        for (int k = 0; k < nseen; k++)
            if (!strcmp(seen_names[k], key)) {
                snprintf(err, errlen, "key %.60s appears twice", key);
                return -1;
            }
        size_t keylen = strlen(key);
        if (keylen >= sizeof seen_names[0] || nseen >= 64) {
            snprintf(err, errlen, "key %.60s: too long, or too many keys", key);
            return -1;
        }
        memcpy(seen_names[nseen++], key, keylen + 1);
        uint64_t x;
        int idx = -1;
        const char *us = strrchr(key, '_');
        if (us && us[1] >= '0' && us[1] <= '9') {
            char *end;
            long l = strtol(us + 1, &end, 10);
            if (*end || l < 0 || l >= VGPU_MAX_DEV) {
                snprintf(err, errlen, "key %.60s: device index must be 0..%d", key, VGPU_MAX_DEV - 1);
                return -1;
            }
            idx = (int)l;
        }
        size_t klen = us && idx >= 0 ? (size_t)(us - key) : strlen(key);
        if (!strcmp(key, "version")) {
            if (lf_uint(key, v, 1000000, &x, err, errlen))
                return -1;
            L->version = (int)x;
        } else if (!strcmp(key, "devices")) {
            if (lf_uint(key, v, VGPU_MAX_DEV, &x, err, errlen))
                return -1;
            L->ndev = (int)x;
        } else if (idx >= 0 && klen == 4 && !strncmp(key, "uuid", 4)) {
            if (!*v || strlen(v) > 95) {
                snprintf(err, errlen, "%.40s=\"%.60s\": expected a GPU UUID", key, v);
                return -1;
            }
            snprintf(L->uuid[idx], sizeof L->uuid[idx], "%s", v);
        } else if (idx >= 0 && klen == 10 && !strncmp(key, "memory_mib", 10)) {
            if (lf_uint(key, v, 1ull << 40, &x, err, errlen))
                return -1;
            if (x == 0) {
                snprintf(err, errlen, "%.40s=0: a booking is never 0 MiB", key);
                return -1;
            }
            L->mem_mib[idx] = x;
        } else if (idx >= 0 && klen == 5 && !strncmp(key, "cores", 5)) {
            if (lf_uint(key, v, 100, &x, err, errlen))
                return -1;
            L->cores[idx] = (int)x;
        } else if (!strcmp(key, "shared_cache")) {
            if (v[0] != '/' || strlen(v) >= sizeof L->cache) {
                snprintf(err, errlen, "shared_cache=\"%.60s\": expected an absolute path", v);
                return -1;
            }
            snprintf(L->cache, sizeof L->cache, "%s", v);
        } else if (!strcmp(key, "core_policy")) {
            if (!strcmp(v, "default"))
                L->core_disable = 0;
            else if (!strcmp(v, "disable"))
                L->core_disable = 1;
            else {
                snprintf(err, errlen, "core_policy=\"%.30s\": expected default or disable", v);
                return -1;
            }
        } else if (!strcmp(key, "core_sharing")) {
            if (!strcmp(v, "strict"))
                L->core_conserving = 0;
            else if (!strcmp(v, "work_conserving"))
                L->core_conserving = 1;
            else {
                snprintf(err, errlen, "core_sharing=\"%.30s\": expected strict or work_conserving", v);
                return -1;
            }
        } else if (!strcmp(key, "disable_control")) {
            if (strcmp(v, "true") && strcmp(v, "false")) {
                snprintf(err, errlen, "disable_control=\"%.30s\": expected true or false", v);
                return -1;
            }
            L->disable_control = !strcmp(v, "true");
        } else if (!strcmp(key, "state")) {
            if (strcmp(v, "ready")) {
                snprintf(err, errlen, "state=%.30s: the device plugin has not written this container's limits yet "
                                      "(kubelet's PreStartContainer has not run or was refused)", v);
                return -1;
            }
        } else if (!strcmp(key, "priority")) {
            if (strcmp(v, "0") && strcmp(v, "1")) {
                snprintf(err, errlen, "priority=\"%.30s\": expected 0 or 1", v);
                return -1;
            }
            L->priority = v[0] - '0';
        } /* unknown keys: ignored, the format grows additively */
    }
    if (L->version != 1) {
        snprintf(err, errlen, "version=%d: this shim reads version 1", L->version);
        return -1;
    }
    if (L->ndev < 1) {
        snprintf(err, errlen, "devices missing or 0");
        return -1;
    }
    for (int i = 0; i < L->ndev; i++) {
        if (!L->uuid[i][0] || !L->mem_mib[i] || L->cores[i] < 0) {
            snprintf(err, errlen, "device %d: uuid_%d, memory_mib_%d and cores_%d are required", i, i, i, i);
            return -1;
        }
    }
    return 1;
}

/* Names the first setting where the environment asks for something other than the file. */
static const char *env_differs(const struct vgpu_config *e, const struct vgpu_config *f, char *buf, size_t len)
{
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        char name[64];
        snprintf(name, sizeof name, "CUDA_DEVICE_MEMORY_LIMIT_%d", i);
        const char *v = getenv(name);
        if (!v) {
            snprintf(name, sizeof name, "CUDA_DEVICE_MEMORY_LIMIT");
            v = getenv(name);
        }
        if (v && (e->mem_set[i] != f->mem_set[i] || e->mem_limit[i] != f->mem_limit[i])) {
            snprintf(buf, len, "%s=%s", name, v);
            return buf;
        }
        snprintf(name, sizeof name, "CUDA_DEVICE_SM_LIMIT_%d", i);
        v = getenv(name);
        if (!v) {
            snprintf(name, sizeof name, "CUDA_DEVICE_SM_LIMIT");
            v = getenv(name);
        }
        if (v && e->sm_limit[i] != f->sm_limit[i] && i < f->nuuid) {
            snprintf(buf, len, "%s=%s", name, v);
            return buf;
        }
    }
    const char *v = getenv("GPU_CORE_UTILIZATION_POLICY");
    if (v && !strcasecmp(v, "disable")) {
        for (int i = 0; i < f->nuuid; i++)
            if (f->sm_limit[i]) {
                snprintf(buf, len, "GPU_CORE_UTILIZATION_POLICY=%s", v);
                return buf;
            }
    }
    v = getenv("CUDA_DISABLE_CONTROL");
    if (v && e->enabled != f->enabled) {
        snprintf(buf, len, "CUDA_DISABLE_CONTROL=%s", v);
        return buf;
    }
    v = getenv("CUDA_TASK_PRIORITY");
    if (v && e->priority != f->priority) {
        snprintf(buf, len, "CUDA_TASK_PRIORITY=%s", v);
        return buf;
    }
    v = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    if (v && strcmp(v, f->cache_path)) {
        snprintf(buf, len, "CUDA_DEVICE_MEMORY_SHARED_CACHE=%s", v);
        return buf;
    }
    return NULL;
}

static void read_config(void)
{
    const char *lv = getenv("LIBVGPU_LOG_LEVEL");
    if (lv && *lv)
        g_cfg.log_level = atoi(lv);
    struct limits_file L;
    char err[256] = "";
    int lf = load_limits_file(VGPU_LIMITS_PATH, &L, err, sizeof err);
    static struct vgpu_config e; /* what the environment asks for */
    e = g_cfg;
    env_config(&e, lf != 0);
    if (lf == 0) {
        g_cfg = e;
    } else if (lf < 0) {
        /* present but unusable: fail closed on every device, share nothing */
        LOG_WARN("limits file %s: %s; failing closed: memory limit 0 on every device, every allocation is refused",
                 VGPU_LIMITS_PATH, err);
        g_cfg.from_file = 1;
        g_cfg.enabled = 1;
        for (int i = 0; i < VGPU_MAX_DEV; i++) {
            g_cfg.mem_set[i] = 1;
            g_cfg.mem_limit[i] = 0;
            g_cfg.sm_limit[i] = 0;
        }
        g_cfg.cache_path[0] = 0;
        g_cfg.nuuid = 0;
        g_cfg.priority = -1;
        g_cfg.core_disabled = 0;
    } else {
        g_cfg.from_file = 1;
        g_cfg.enabled = !L.disable_control;
        g_cfg.core_disabled = L.core_disable;
        g_cfg.sm_conserving = L.core_conserving;
        g_cfg.nuuid = L.ndev;
        for (int i = 0; i < VGPU_MAX_DEV; i++) {
            /* a GPU that is not the container's gets nothing */
            g_cfg.mem_set[i] = 1;
            g_cfg.mem_limit[i] = i < L.ndev ? L.mem_mib[i] << 20 : 0;
            g_cfg.sm_limit[i] = i < L.ndev && !L.core_disable && L.cores[i] < 100 ? L.cores[i] : 0;
            if (i < L.ndev)
                snprintf(g_cfg.uuid[i], sizeof g_cfg.uuid[i], "%s", L.uuid[i]);
        }
        snprintf(g_cfg.cache_path, sizeof g_cfg.cache_path, "%s", L.cache);
        g_cfg.priority = L.priority;
        char buf[160];
        const char *d = env_differs(&e, &g_cfg, buf, sizeof buf);
        if (d)
            LOG_WARN("the environment (%s) differs from the container's limits file %s; running under the file's "
                     "limits", d, VGPU_LIMITS_PATH);
    }
    g_cfg.sm_any = 0;
    for (int i = 0; i < VGPU_MAX_DEV; i++)
        if (g_cfg.sm_limit[i])
            g_cfg.sm_any = 1;
    const char *cc = g_cfg.from_file ? NULL : getenv("LIBVGPU_CONTEXT_COST"); /* the file's regime measures */
    int bad;
    if (cc && *cc) {
        uint64_t b = parse_bytes(cc, &bad);
        if (!bad && b <= (uint64_t)INT64_MAX)
            g_cfg.context_cost = (int64_t)b;
        else
            LOG_WARN("ignoring invalid LIBVGPU_CONTEXT_COST=\"%s\"", cc);
    }
    const char *per = getenv("LIBVGPU_SM_PERIOD_MS");
    if (per && atoi(per) > 0)
        g_cfg.sm_period_ms = (unsigned)atoi(per);
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    if (vis)
        g_cfg.nvisible = split_list(vis, g_cfg.visible, VGPU_MAX_DEV);
    if (!g_cfg.enabled)
        g_cfg.sm_any = 0;
    g_cfg.sm_yield = g_cfg.enabled && g_cfg.priority == 1 && !g_cfg.core_disabled;
}

/* ------------------------------------------------------------------ init */
static pthread_once_t g_base_once = PTHREAD_ONCE_INIT;
static pthread_once_t g_cuda_once = PTHREAD_ONCE_INIT;
static pthread_once_t g_nvml_once = PTHREAD_ONCE_INIT;

/* dlsym() runs before the sanitizer runtime is initialised when libasan is preloaded (ASan looks
 * up its interceptors through it): no instrumentation and no intercepted libc calls on that path. */
#define NO_SANITIZE __attribute__((no_sanitize_address))

NO_SANITIZE static void resolve_real_dlsym(void)
{
    static const char *versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0", NULL};
    for (int i = 0; versions[i] && !real_dlsym; i++)
        real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}

static void base_init(void)
{
    if (!real_dlsym)
        resolve_real_dlsym();
    read_config();
    if (g_cfg.enabled)
        region_open();
    LOG_INFO("libvgpu initialised (control %s)", g_cfg.enabled ? "on" : "off");
}

void vgpu_base_init(void)
{
    pthread_once(&g_base_once, base_init);
}

static void nvml_load(void)
{
    vgpu_base_init();
    const char *path = getenv("LIBVGPU_NVML_LIBRARY");
    g_libnvml = dlopen(path && *path ? path : "libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!g_libnvml) {
        LOG_INFO("libnvidia-ml.so.1 not loadable: %s", dlerror());
        return;
    }
    g_nvml.init = (nvmlInit_v2_fn)real_dlsym(g_libnvml, "nvmlInit_v2");
    g_nvml.handle_by_index = (nvmlDeviceGetHandleByIndex_v2_fn)real_dlsym(g_libnvml, "nvmlDeviceGetHandleByIndex_v2");
    g_nvml.get_index = (nvmlDeviceGetIndex_fn)real_dlsym(g_libnvml, "nvmlDeviceGetIndex");
    g_nvml.get_uuid = (nvmlDeviceGetUUID_fn)real_dlsym(g_libnvml, "nvmlDeviceGetUUID");
    g_nvml.by_uuid = (nvmlDeviceGetHandleByUUID_fn)real_dlsym(g_libnvml, "nvmlDeviceGetHandleByUUID");
    g_nvml.mem_info = (nvmlDeviceGetMemoryInfo_fn)real_dlsym(g_libnvml, "nvmlDeviceGetMemoryInfo");
    g_nvml.mem_info_v2 = (nvmlDeviceGetMemoryInfo_v2_fn)real_dlsym(g_libnvml, "nvmlDeviceGetMemoryInfo_v2");
    g_nvml.util = (nvmlDeviceGetUtilizationRates_fn)real_dlsym(g_libnvml, "nvmlDeviceGetUtilizationRates");
    g_nvml.proc_util = (nvmlDeviceGetProcessUtilization_fn)real_dlsym(g_libnvml, "nvmlDeviceGetProcessUtilization");
    g_nvml.running = (nvmlDeviceGetComputeRunningProcesses_v3_fn)real_dlsym(g_libnvml,
                                                                            "nvmlDeviceGetComputeRunningProcesses_v3");
    if (!g_nvml.running)
        g_nvml.running = (nvmlDeviceGetComputeRunningProcesses_v3_fn)real_dlsym(
            g_libnvml, "nvmlDeviceGetComputeRunningProcesses_v2");
    g_nvml.ok = g_nvml.init && g_nvml.handle_by_index && g_nvml.init() == NVML_SUCCESS;
}

int vgpu_nvml_load(void)
{
    pthread_once(&g_nvml_once, nvml_load);
    return g_nvml.ok;
}

static void cuda_init(void)
{
    vgpu_base_init();
    const char *path = getenv("LIBVGPU_CUDA_LIBRARY");
    g_libcuda = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!g_libcuda) {
        LOG_ERROR("cannot load libcuda.so.1: %s", dlerror());
    } else {
#define HOOK(name, ret, params, args) real_##name = (name##_fn)real_dlsym(g_libcuda, #name);
#define REAL(name, ret, params) real_##name = (name##_fn)real_dlsym(g_libcuda, #name);
#include "hooks_list.h"
#undef HOOK
#undef REAL
    }
    g_nreal = 0;
    for (size_t i = 0; i < NHOOKS; i++) {
        if (g_hooks[i].real && *g_hooks[i].real) {
            g_by_real[g_nreal].real = *g_hooks[i].real;
            g_by_real[g_nreal].hook = g_hooks[i].hook;
            g_nreal++;
        }
    }
    qsort(g_by_real, g_nreal, sizeof g_by_real[0], cmp_real);
    g_sm_active = g_cfg.enabled && (g_cfg.sm_any || g_cfg.sm_yield);
    __atomic_store_n(&g_cuda_ready, 1, __ATOMIC_RELEASE);
    if (g_sm_active)
        limiter_start();
}

void vgpu_cuda_init_slow(void)
{
    pthread_once(&g_cuda_once, cuda_init);
}

/* ------------------------------------------------------------------ dlsym override */
/* Returns our hook for a CUDA/NVML name we intercept, else NULL. */
NO_SANITIZE __attribute__((noinline)) static void *hooked_symbol(const char *sym)
{
    if (sym && ((sym[0] == 'c' && sym[1] == 'u') || (sym[0] == 'n' && sym[1] == 'v' && sym[2] == 'm' && sym[3] == 'l')))
        return hook_by_name(sym);
    return NULL;
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnonnull-compare"
/* Everything else goes to glibc as a tail call (a jmp, no new frame): glibc then sees the
 * original caller's return address, so RTLD_NEXT keeps its meaning for every caller. */
EXPORT NO_SANITIZE __attribute__((optimize("O2", "optimize-sibling-calls", "no-stack-protector")))
void *dlsym(void *handle, const char *symbol)
{
    if (UNLIKELY(!real_dlsym))
        resolve_real_dlsym();
    void *h = hooked_symbol(symbol);
    if (h)
        return h;
    return real_dlsym(handle, symbol);
}
#pragma GCC diagnostic pop

/* ------------------------------------------------------------------ cuGetProcAddress */
/* The hook for the entry point the driver returned. The driver's own table picks the versioned symbol
 * for (name, cudaVersion, flags) and returns its exported address, so the hook is found by that
 * address: exactly the ABI the caller asked for (cuCtxCreate at 11040 is cuCtxCreate_v3, never the
 * _v2 hook). An address that is not one of the resolved exports is named with dladdr(); one that
 * cannot be named is passed through unhooked (never guessed by name: a wrong ABI corrupts the call). */
static void *proc_hook(const char *symbol, void *real)
{
    void *h = hook_by_real(real);
    if (h)
        return h;
    Dl_info di;
    if (dladdr(real, &di) && di.dli_sname && di.dli_saddr == real)
        return hooked_symbol(di.dli_sname);
    static int warned;
    if (!warned) {
        warned = 1;
        LOG_WARN("cuGetProcAddress(\"%s\") returned an address that is not an exported entry point; passed through "
                 "unhooked", symbol ? symbol : "");
    }
    return NULL;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    ensure_cuda();
    if (!real_cuGetProcAddress)
        return CUDA_ERROR_NOT_FOUND;
    CUresult rc = real_cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn && *pfn) {
        void *h = proc_hook(symbol, *pfn);
        if (h)
            *pfn = h;
    }
    return rc;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status)
{
    ensure_cuda();
    if (!real_cuGetProcAddress_v2)
        return CUDA_ERROR_NOT_FOUND;
    CUresult rc = real_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, status);
    if (rc == CUDA_SUCCESS && pfn && *pfn) {
        void *h = proc_hook(symbol, *pfn);
        if (h)
            *pfn = h;
    }
    return rc;
}

EXPORT CUresult cuInit(unsigned int flags)
{
    ensure_cuda();
    if (!real_cuInit)
        return CUDA_ERROR_NOT_INITIALIZED;
    return real_cuInit(flags);
}

/* ------------------------------------------------------------------ device mapping (see vgpu.h) */
static int g_ord_dev[VGPU_MAX_DEV]; /* container GPU index + 1 per CUDA ordinal, 0 = not known yet */

static int dev_of_uuid(const char *uuid)
{
    if (g_cfg.nuuid > 0) {
        for (int i = 0; i < g_cfg.nuuid; i++)
            if (!strcasecmp(g_cfg.uuid[i], uuid))
                return i;
        return VGPU_FOREIGN;
    }
    nvmlDevice_t h;
    unsigned idx;
    if (vgpu_nvml_load() && g_nvml.by_uuid && g_nvml.get_index && g_nvml.by_uuid(uuid, &h) == NVML_SUCCESS &&
        g_nvml.get_index(h, &idx) == NVML_SUCCESS && idx < VGPU_MAX_DEV)
        return (int)idx;
    return -1;
}

int vgpu_dev_of_cuda(CUdevice ord)
{
    if (ord < 0 || ord >= VGPU_MAX_DEV)
        return g_cfg.nuuid > 0 ? VGPU_FOREIGN : -1;
    int c = __atomic_load_n(&g_ord_dev[ord], __ATOMIC_RELAXED);
    if (LIKELY(c))
        return c - 1;
    CUuuid u;
    int d = -1, known = 0;
    if (real_cuDeviceGetUuid && real_cuDeviceGetUuid(&u, ord) == CUDA_SUCCESS) {
        char uuid[48];
        const unsigned char *b = u.bytes;
        snprintf(uuid, sizeof uuid, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
        d = dev_of_uuid(uuid);
        known = d >= 0;
    }
    if (d < 0) {
        if (g_cfg.nuuid > 0)
            return VGPU_FOREIGN; /* the container's GPUs are known and this one cannot be named: nothing */
        /* no UUID and no list (no NVML): the process's numbering, through a numeric CUDA_VISIBLE_DEVICES */
        d = ord;
        if (g_cfg.nvisible > 0 && ord < g_cfg.nvisible && isdigit((unsigned char)g_cfg.visible[ord][0]) &&
            atoi(g_cfg.visible[ord]) < VGPU_MAX_DEV)
            d = atoi(g_cfg.visible[ord]);
    }
    if (known)
        __atomic_store_n(&g_ord_dev[ord], d + 1, __ATOMIC_RELAXED);
    return d;
}

int vgpu_dev_of_nvml(nvmlDevice_t h)
{
    char uuid[96] = "";
    if (g_nvml.get_uuid && g_nvml.get_uuid(h, uuid, sizeof uuid) == NVML_SUCCESS)
        return dev_of_uuid(uuid);
    return -1;
}

int vgpu_nvml_of_dev(int dev, nvmlDevice_t *out)
{
    if (dev < 0 || dev >= VGPU_MAX_DEV || !vgpu_nvml_load())
        return -1;
    if (g_cfg.nuuid > 0)
        return dev < g_cfg.nuuid && g_nvml.by_uuid && g_nvml.by_uuid(g_cfg.uuid[dev], out) == NVML_SUCCESS ? 0 : -1;
    return g_nvml.handle_by_index((unsigned)dev, out) == NVML_SUCCESS ? 0 : -1;
}

int vgpu_mem_limit(int dev, uint64_t *limit)
{
    if (dev == VGPU_FOREIGN) {
        *limit = 0;
        return 1;
    }
    if (dev < 0 || dev >= VGPU_MAX_DEV || !g_cfg.mem_set[dev])
        return 0;
    *limit = g_cfg.mem_limit[dev];
    return 1;
}

/* ------------------------------------------------------------------ test/diagnostic API */
/* Accounted usage and limit of CUDA device `dev` for this container (bytes). Returns 0 on success. */
EXPORT int vgpu_get_usage(int dev, uint64_t *used, uint64_t *limit)
{
    vgpu_base_init();
    if (dev < 0 || dev >= VGPU_MAX_DEV)
        return -1;
    if (used)
        *used = region_used(dev);
    if (limit)
        *limit = g_cfg.mem_set[dev] ? g_cfg.mem_limit[dev] : 0;
    return 0;
}

EXPORT const char *vgpu_version(void)
{
    return "libvgpu 0.1.0";
}
