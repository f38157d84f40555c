/*
 * libvgpu configuration: every environment variable and limits-file key the shim reads, with its
 * parser (config.c). One place: the names are defined here only, and tests/libvgpu/test_shim_config.py
 * checks them against the writer's, kube_vgpu/envcontract.py (vgpu_config_names() lists them).
 */
#include "vgpu.h"
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------------ configuration */
/* The process's configuration: written here only (vgpu_read_config), read elsewhere through vgpu_cfg. */
static struct vgpu_config g_cfg = {
    .enabled = 1, .log_level = 2, .context_cost = -1, .sm_period_ms = 100, .nvisible = -1};
const struct vgpu_config *const vgpu_cfg = &g_cfg;

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
    c->enabled = !is_true(getenv(VGPU_ENV_DISABLE_CONTROL));
    int bad;
    uint64_t all = 0;
    int all_set = read_mem_limit(VGPU_ENV_MEMORY_LIMIT, &all, quiet);
    int sm_all = parse_percent(getenv(VGPU_ENV_SM_LIMIT), &bad);
    if (bad && !quiet)
        LOG_WARN("ignoring invalid " VGPU_ENV_SM_LIMIT "=%s", getenv(VGPU_ENV_SM_LIMIT));
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        char name[64];
        snprintf(name, sizeof name, VGPU_ENV_MEMORY_LIMIT_PREFIX "%d", i);
        uint64_t b = 0;
        if (read_mem_limit(name, &b, quiet)) {
            c->mem_limit[i] = b;
            c->mem_set[i] = 1;
        } else {
            c->mem_limit[i] = all;
            c->mem_set[i] = (uint8_t)all_set;
        }
        snprintf(name, sizeof name, VGPU_ENV_SM_LIMIT_PREFIX "%d", i);
        const char *v = getenv(name);
        int pct = parse_percent(v, &bad);
        if (bad && !quiet)
            LOG_WARN("ignoring invalid %s=%s", name, v);
        c->sm_limit[i] = (v && *v && !bad) ? pct : sm_all;
    }
    const char *pol = getenv(VGPU_ENV_CORE_POLICY);
    c->core_disabled = pol && !strcasecmp(pol, VGPU_POLICY_DISABLE);
    if (c->core_disabled)
        for (int i = 0; i < VGPU_MAX_DEV; i++)
            c->sm_limit[i] = 0;
    const char *cache = getenv(VGPU_ENV_SHARED_CACHE);
    snprintf(c->cache_path, sizeof c->cache_path, "%s", cache ? cache : "");
    const char *nv = getenv(VGPU_ENV_VISIBLE_DEVICES);
    c->nuuid = 0;
    if (nv && !strncmp(nv, "GPU-", 4))
        c->nuuid = split_list(nv, c->uuid, VGPU_MAX_DEV);
    const char *pr = getenv(VGPU_ENV_TASK_PRIORITY);
    c->priority = pr && (!strcmp(pr, "0") || !strcmp(pr, "1")) ? atoi(pr) : -1;
    const char *gm = getenv(VGPU_ENV_GRAPH_MEMORY_BOUND);
    c->graph_peak = gm && !strcmp(gm, VGPU_GRAPH_MEMORY_PEAK);
    if (gm && *gm && strcmp(gm, VGPU_GRAPH_MEMORY_PEAK) && strcmp(gm, VGPU_GRAPH_MEMORY_SUM) && !quiet)
        LOG_WARN("ignoring invalid " VGPU_ENV_GRAPH_MEMORY_BOUND "=%s (expected " VGPU_GRAPH_MEMORY_SUM " or "
                 VGPU_GRAPH_MEMORY_PEAK "): the sum", gm);
}

/* ------------------------------------------------------------------ the container's limits file
 * Format (version 1, written by kube_vgpu.envcontract.limits_file, docs/env-contract.md):
 * "key=value" lines, '#' comments and blank lines ignored, unknown keys ignored, no key twice.
 * Required: version=1, devices=<1..16>, and per device i: uuid_<i>, memory_mib_<i> (> 0),
 * cores_<i> (0..100). Optional: shared_cache=<absolute path>, core_policy=default|disable,
 * core_sharing=strict|work_conserving, graph_memory=sum|peak (absent: sum), disable_control=true|false,
 * priority=0|1. A "state" key other than "ready" (the device plugin's placeholder at Allocate says "pending")
 * makes the file unusable.
 * Key names: config.h. */
struct limits_file {
    int version, ndev;
    uint64_t mem_mib[VGPU_MAX_DEV];
    int cores[VGPU_MAX_DEV];
    char uuid[VGPU_MAX_DEV][96];
    char cache[512];
    int core_disable, core_conserving, graph_peak, disable_control, priority;
};

/* key (klen characters before its "_<i>") is the indexed key name */
static int key_is(const char *key, size_t klen, const char *name)
{
    return klen == strlen(name) && !strncmp(key, name, klen);
}

/* `v` is `no` (*out = 0) or `yes` (*out = 1); else -1 with `err` naming the key, the value and both. */
static int lf_choice(const char *key, const char *v, const char *no, const char *yes, int *out, char *err,
                     size_t errlen)
{
    if (!strcmp(v, no))
        *out = 0;
    else if (!strcmp(v, yes))
        *out = 1;
    else {
        snprintf(err, errlen, "%s=\"%.30s\": expected %s or %s", key, v, no, yes);
        return -1;
    }
    return 0;
}

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
        if (!strcmp(key, VGPU_KEY_VERSION)) {
            if (lf_uint(key, v, 1000000, &x, err, errlen))
                return -1;
            L->version = (int)x;
        } else if (!strcmp(key, VGPU_KEY_DEVICES)) {
            if (lf_uint(key, v, VGPU_MAX_DEV, &x, err, errlen))
                return -1;
            L->ndev = (int)x;
        } else if (idx >= 0 && key_is(key, klen, VGPU_KEY_UUID)) {
            if (!*v || strlen(v) > 95) {
                snprintf(err, errlen, "%.40s=\"%.60s\": expected a GPU UUID", key, v);
                return -1;
            }
            snprintf(L->uuid[idx], sizeof L->uuid[idx], "%s", v);
        } else if (idx >= 0 && key_is(key, klen, VGPU_KEY_MEMORY_MIB)) {
            if (lf_uint(key, v, 1ull << 40, &x, err, errlen))
                return -1;
            if (x == 0) {
                snprintf(err, errlen, "%.40s=0: a booking is never 0 MiB", key);
                return -1;
            }
            L->mem_mib[idx] = x;
        } else if (idx >= 0 && key_is(key, klen, VGPU_KEY_CORES)) {
            if (lf_uint(key, v, 100, &x, err, errlen))
                return -1;
            L->cores[idx] = (int)x;
        } else if (!strcmp(key, VGPU_KEY_SHARED_CACHE)) {
            if (v[0] != '/' || strlen(v) >= sizeof L->cache) {
                snprintf(err, errlen, "shared_cache=\"%.60s\": expected an absolute path", v);
                return -1;
            }
            snprintf(L->cache, sizeof L->cache, "%s", v);
        } else if (!strcmp(key, VGPU_KEY_CORE_POLICY)) {
            if (lf_choice(key, v, VGPU_POLICY_DEFAULT, VGPU_POLICY_DISABLE, &L->core_disable, err, errlen))
                return -1;
        } else if (!strcmp(key, VGPU_KEY_CORE_SHARING)) {
            if (lf_choice(key, v, VGPU_SHARING_STRICT, VGPU_SHARING_CONSERVING, &L->core_conserving, err, errlen))
                return -1;
        } else if (!strcmp(key, VGPU_KEY_GRAPH_MEMORY)) {
            if (lf_choice(key, v, VGPU_GRAPH_MEMORY_SUM, VGPU_GRAPH_MEMORY_PEAK, &L->graph_peak, err, errlen))
                return -1;
        } else if (!strcmp(key, VGPU_KEY_DISABLE_CONTROL)) {
            if (lf_choice(key, v, "false", "true", &L->disable_control, err, errlen))
                return -1;
        } else if (!strcmp(key, VGPU_KEY_STATE)) {
            if (strcmp(v, "ready")) {
                snprintf(err, errlen, "state=%.30s: the device plugin has not written this container's limits yet "
                                      "(kubelet's PreStartContainer has not run or was refused)", v);
                return -1;
            }
        } else if (!strcmp(key, VGPU_KEY_PRIORITY)) {
            if (strcmp(v, "0") && strcmp(v, "1")) {
                snprintf(err, errlen, "priority=\"%.30s\": expected 0 or 1", v);
                return -1;
            }
            L->priority = v[0] - '0';
        } /* unknown keys: ignored, the format grows additively */
    }
    if (L->version != VGPU_LIMITS_VERSION) {
        snprintf(err, errlen, "version=%d: this shim reads version %d", L->version, VGPU_LIMITS_VERSION);
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
        snprintf(name, sizeof name, VGPU_ENV_MEMORY_LIMIT_PREFIX "%d", i);
        const char *v = getenv(name);
        if (!v) {
            snprintf(name, sizeof name, VGPU_ENV_MEMORY_LIMIT);
            v = getenv(name);
        }
        if (v && (e->mem_set[i] != f->mem_set[i] || e->mem_limit[i] != f->mem_limit[i])) {
            snprintf(buf, len, "%s=%s", name, v);
            return buf;
        }
        snprintf(name, sizeof name, VGPU_ENV_SM_LIMIT_PREFIX "%d", i);
        v = getenv(name);
        if (!v) {
            snprintf(name, sizeof name, VGPU_ENV_SM_LIMIT);
            v = getenv(name);
        }
        if (v && e->sm_limit[i] != f->sm_limit[i] && i < f->nuuid) {
            snprintf(buf, len, "%s=%s", name, v);
            return buf;
        }
    }
    const char *v = getenv(VGPU_ENV_CORE_POLICY);
    if (v && !strcasecmp(v, VGPU_POLICY_DISABLE)) {
        for (int i = 0; i < f->nuuid; i++)
            if (f->sm_limit[i]) {
                snprintf(buf, len, VGPU_ENV_CORE_POLICY "=%s", v);
                return buf;
            }
    }
    const char *cache = getenv(VGPU_ENV_SHARED_CACHE);
    const struct {
        const char *name;
        int differs; /* what the environment asks for (when set) is not what the file says */
    } single[] = {
        {VGPU_ENV_DISABLE_CONTROL, e->enabled != f->enabled},
        {VGPU_ENV_TASK_PRIORITY, e->priority != f->priority},
        {VGPU_ENV_SHARED_CACHE, cache && strcmp(cache, f->cache_path)},
        {VGPU_ENV_GRAPH_MEMORY_BOUND, e->graph_peak != f->graph_peak},
    };
    for (size_t i = 0; i < sizeof single / sizeof single[0]; i++) {
        v = getenv(single[i].name);
        if (v && single[i].differs) {
            snprintf(buf, len, "%s=%s", single[i].name, v);
            return buf;
        }
    }
    return NULL;
}

void vgpu_read_config(void)
{
    const char *lv = getenv(VGPU_ENV_LOG_LEVEL);
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
        g_cfg.graph_peak = 0;
    } else {
        g_cfg.from_file = 1;
        g_cfg.enabled = !L.disable_control;
        g_cfg.core_disabled = L.core_disable;
        g_cfg.sm_conserving = L.core_conserving;
        g_cfg.graph_peak = L.graph_peak;
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
    const char *cc = g_cfg.from_file ? NULL : getenv(VGPU_ENV_CONTEXT_COST); /* the file's regime measures */
    int bad;
    if (cc && *cc) {
        uint64_t b = parse_bytes(cc, &bad);
        if (!bad && b <= (uint64_t)INT64_MAX)
            g_cfg.context_cost = (int64_t)b;
        else
            LOG_WARN("ignoring invalid " VGPU_ENV_CONTEXT_COST "=\"%s\"", cc);
    }
    const char *per = getenv(VGPU_ENV_SM_PERIOD_MS);
    if (per && atoi(per) > 0)
        g_cfg.sm_period_ms = (unsigned)atoi(per);
    const char *vis = getenv(VGPU_ENV_CUDA_VISIBLE_DEVICES);
    if (vis)
        g_cfg.nvisible = split_list(vis, g_cfg.visible, VGPU_MAX_DEV);
    if (!g_cfg.enabled)
        g_cfg.sm_any = 0;
    g_cfg.sm_yield = g_cfg.enabled && g_cfg.priority == 1 && !g_cfg.core_disabled;
}


/* ------------------------------------------------------------------ the names, for the contract test */
/* "env=A,B,...;keys=a,b,...;core_policy=...;core_sharing=...;graph_memory=...;version=N;limits_path=P" */
EXPORT const char *vgpu_config_names(void)
{
#define STR(name, value) value ","
    static const char text[] = "env=" VGPU_ENV_NAMES(STR) ";keys=" VGPU_KEY_NAMES(STR) ";core_policy="
        VGPU_CORE_POLICY_VALUES ";core_sharing=" VGPU_CORE_SHARING_VALUES ";graph_memory=" VGPU_GRAPH_MEMORY_VALUES
        ";limits_path=" VGPU_LIMITS_PATH;
#undef STR
    static char out[sizeof text + 32];
    snprintf(out, sizeof out, "%s;version=%d", text, VGPU_LIMITS_VERSION);
    return out;
}
