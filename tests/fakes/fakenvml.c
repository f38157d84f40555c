/*
 * fakenvml.c - a fake libnvidia-ml.so.1 for tests (no GPU needed).
 *
 * DEVICE LIST: the file named by env FAKE_NVML_CONFIG (re-read whenever its mtime changes, so a
 * test can flip a GPU to "fail" while a process runs).  Without it: one GPU, defaults below.
 * Text format, one GPU per line, "key=value" tokens, '#' starts a comment line, values with
 * spaces in double quotes, unknown keys ignored (so the format can grow additively):
 *
 *     driver=550.54.15 cuda=12040
 *     gpu index=0 uuid=GPU-00000000-0000-4000-8000-000000000000 name="NVIDIA H200" memory_mib=143771 numa=0 mig=0 util=0 fail=0
 *     gpu index=1 name="NVIDIA H200" memory_mib=143771 numa=1 fail=1
 *
 *   index       NVML index (default: line number, from 0)        uuid    default GPU-00000000-0000-4000-8000-<index, 12 digits>
 *   name        default "NVIDIA H200"                            memory_mib  default 143771
 *   numa        NUMA node (nvmlDeviceGetNumaNodeId), default 0   mig     current MIG mode 0/1, default 0
 *   util        baseline GPU utilisation percent, added to the simulated kernel activity
 *   fail        1: every query on this GPU returns NVML_ERROR_GPU_IS_LOST (15)
 *   minor       /dev/nvidia<minor>, default index                pci     bus id, default 00000000:<0x17+index>:00.0
 *   cc          compute capability "9.0"                         sm_count  default 132
 *   switch      PCIe switch id: two GPUs with the same one are NVML_TOPOLOGY_SINGLE apart (default none)
 *   nvlink      NVLink peers by NVML index, one link each (nvlink=1,1,2: two links to GPU 1, one to 2);
 *               nvmlDeviceGetNvLinkState / nvmlDeviceGetNvLinkRemotePciInfo_v2 report them
 *
 * TOPOLOGY (nvmlDeviceGetTopologyCommonAncestor): the same GPU INTERNAL, the same switch SINGLE, the
 * same NUMA node HOSTBRIDGE, else SYSTEM.
 *
 * XID EVENTS: env FAKE_NVML_EVENTS names a file that nvmlEventSetWait(_v2) re-reads on every
 * poll; each line "<gpu-index> <xid> [<event-type-hex>]" is delivered once to a waiting event set
 * that registered that GPU for that type (default type 0x8 = nvmlEventTypeXidCriticalError) and
 * is then removed from the file (under flock, so several processes never get the same line).
 *
 * ACTIVITY: with FAKE_GPU_STATE set (see fakegpu.h) utilisation, per-process utilisation, used
 * memory and the running-process list come from what the fake libcuda simulates.
 * FAKE_NVML_UTIL_WINDOW_MS (default 1000) is the window nvmlDeviceGetUtilizationRates averages.
 *
 * Build: gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1.  To use it from pynvml in-process,
 * load it first: ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL); pynvml's CDLL("libnvidia-ml.so.1")
 * then finds the already-loaded object by its soname.
 */
#include "fakegpu.h"
#include "nvml_abi.h"

#define EXPORT __attribute__((visibility("default")))
#define MIB (1024ull * 1024ull)

struct fdev {
    struct fg_gpu g;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_refs;
static struct fg_config g_cfg;
static struct fdev g_dev[FG_MAX_DEV];
static struct fg_state *g_st;
static struct timespec g_cfg_mtime;
static int g_cfg_loaded;

struct eventset {
    unsigned long long types[FG_MAX_DEV];
};

static void refresh_locked(void)
{
    const char *path = getenv("FAKE_NVML_CONFIG");
    struct stat st;
    int have = path && *path && stat(path, &st) == 0;
    if (g_cfg_loaded && (!have || (st.st_mtim.tv_sec == g_cfg_mtime.tv_sec && st.st_mtim.tv_nsec == g_cfg_mtime.tv_nsec)))
        return;
    struct fg_config c;
    fg_load_config(&c);
    g_cfg = c;
    for (int i = 0; i < FG_MAX_DEV; i++)
        g_dev[i].g = c.gpu[i];
    if (have)
        g_cfg_mtime = st.st_mtim;
    g_cfg_loaded = 1;
}

static int inited(void)
{
    pthread_mutex_lock(&g_mu);
    int r = g_refs > 0;
    if (r)
        refresh_locked();
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* Validates a handle; returns its position or a negative NVML error. */
static int dev_index(nvmlDevice_t d)
{
    if (!inited())
        return -NVML_ERROR_UNINITIALIZED;
    struct fdev *f = (struct fdev *)d;
    if (f < g_dev || f >= g_dev + g_cfg.count)
        return -NVML_ERROR_INVALID_ARGUMENT;
    if (f->g.fail)
        return -NVML_ERROR_GPU_IS_LOST;
    return (int)(f - g_dev);
}

#define DEV_OR_RETURN(var, handle)      \
    int var = dev_index(handle);        \
    if (var < 0)                        \
        return -var

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&g_mu);
    if (!g_st)
        g_st = fg_open_state();
    g_refs++;
    g_cfg_loaded = 0;
    refresh_locked();
    pthread_mutex_unlock(&g_mu);
    return g_st ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

EXPORT nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

EXPORT nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&g_mu);
    int was = g_refs;
    if (g_refs > 0)
        g_refs--;
    pthread_mutex_unlock(&g_mu);
    return was ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS:
        return "Success";
    case NVML_ERROR_UNINITIALIZED:
        return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT:
        return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED:
        return "Not Supported";
    case NVML_ERROR_NOT_FOUND:
        return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE:
        return "Insufficient Size";
    case NVML_ERROR_TIMEOUT:
        return "Timeout";
    case NVML_ERROR_GPU_IS_LOST:
        return "GPU is lost";
    case NVML_ERROR_FUNCTION_NOT_FOUND:
        return "Function Not Found";
    default:
        return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int len)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!v || len < strlen(g_cfg.driver) + 1)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    fg_copy(v, len, g_cfg.driver);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *v, unsigned int len)
{
    if (!v || len < 16)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    fg_copy(v, len, "12.550.54.15");
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    if (!v)
        return NVML_ERROR_INVALID_ARGUMENT;
    *v = g_cfg_loaded ? g_cfg.cuda_version : 12040;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v)
{
    return nvmlSystemGetCudaDriverVersion(v);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!n)
        return NVML_ERROR_INVALID_ARGUMENT;
    *n = (unsigned)g_cfg.count;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *n)
{
    return nvmlDeviceGetCount_v2(n);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!d || i >= (unsigned)g_cfg.count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *d = (nvmlDevice_t)&g_dev[i];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *d)
{
    return nvmlDeviceGetHandleByIndex_v2(i, d);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *d)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !d)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < g_cfg.count; i++) {
        if (!strcmp(g_dev[i].g.uuid, uuid)) {
            *d = (nvmlDevice_t)&g_dev[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus, nvmlDevice_t *d)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!bus || !d)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < g_cfg.count; i++) {
        if (!strcasecmp(g_dev[i].g.pci, bus)) {
            *d = (nvmlDevice_t)&g_dev[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

static nvmlReturn_t copy_str(char *dst, unsigned int len, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (len < strlen(src) + 1)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    fg_copy(dst, len, src);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int len)
{
    DEV_OR_RETURN(i, d);
    return copy_str(uuid, len, g_dev[i].g.uuid);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int len)
{
    DEV_OR_RETURN(i, d);
    return copy_str(name, len, g_dev[i].g.name);
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *idx)
{
    DEV_OR_RETURN(i, d);
    if (!idx)
        return NVML_ERROR_INVALID_ARGUMENT;
    *idx = (unsigned)g_dev[i].g.index;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor)
{
    DEV_OR_RETURN(i, d);
    if (!minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    *minor = g_dev[i].g.minor;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t d, unsigned int *node)
{
    DEV_OR_RETURN(i, d);
    if (!node)
        return NVML_ERROR_INVALID_ARGUMENT;
    *node = (unsigned)g_dev[i].g.numa;
    return NVML_SUCCESS;
}

/* CPU affinity: NUMA node n owns CPUs [n*64, n*64+63] in this fake. */
EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t d, unsigned int n, unsigned long *set)
{
    DEV_OR_RETURN(i, d);
    if (!set || !n)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(set, 0, n * sizeof(unsigned long));
    unsigned w = (unsigned)g_dev[i].g.numa;
    if (w < n)
        set[w] = ~0ul;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t d, unsigned int n, unsigned long *set, int scope)
{
    (void)scope;
    return nvmlDeviceGetCpuAffinity(d, n, set);
}

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *cur, unsigned int *pending)
{
    DEV_OR_RETURN(i, d);
    if (!cur || !pending)
        return NVML_ERROR_INVALID_ARGUMENT;
    *cur = *pending = (unsigned)g_dev[i].g.mig;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned int *n)
{
    DEV_OR_RETURN(i, d);
    if (!n)
        return NVML_ERROR_INVALID_ARGUMENT;
    *n = g_dev[i].g.mig ? 7 : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor)
{
    DEV_OR_RETURN(i, d);
    if (!major || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = g_dev[i].g.cc_major;
    *minor = g_dev[i].g.cc_minor;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *p)
{
    DEV_OR_RETURN(i, d);
    if (!p)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(p, 0, sizeof(*p));
    const char *bus = g_dev[i].g.pci;
    fg_copy(p->busId, sizeof p->busId, bus);
    fg_copy(p->busIdLegacy, sizeof p->busIdLegacy, strlen(bus) > 12 ? bus + 4 : bus);
    unsigned dom = 0, b = 0, dv = 0;
    sscanf(bus, "%x:%x:%x", &dom, &b, &dv);
    p->domain = dom;
    p->bus = b;
    p->device = dv;
    p->pciDeviceId = 0x233510de;
    p->pciSubSystemId = 0x18d810de;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t d1, nvmlDevice_t d2, int *level)
{
    DEV_OR_RETURN(i, d1);
    DEV_OR_RETURN(j, d2);
    if (!level)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct fg_gpu *a = &g_dev[i].g, *b = &g_dev[j].g;
    if (i == j)
        *level = 0; /* NVML_TOPOLOGY_INTERNAL */
    else if (a->pcie_switch >= 0 && a->pcie_switch == b->pcie_switch)
        *level = 10; /* NVML_TOPOLOGY_SINGLE */
    else if (a->numa == b->numa)
        *level = 30; /* NVML_TOPOLOGY_HOSTBRIDGE */
    else
        *level = 50; /* NVML_TOPOLOGY_SYSTEM */
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, unsigned int *active)
{
    DEV_OR_RETURN(i, d);
    if (!active || link >= FG_MAX_LINKS)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (g_dev[i].g.n_nvlink == 0)
        return NVML_ERROR_NOT_SUPPORTED; /* a GPU without NVLink, as NVML answers */
    *active = link < (unsigned)g_dev[i].g.n_nvlink;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t d, unsigned int link, nvmlPciInfo_t *p)
{
    DEV_OR_RETURN(i, d);
    if (!p || link >= (unsigned)g_dev[i].g.n_nvlink)
        return NVML_ERROR_INVALID_ARGUMENT;
    int peer = g_dev[i].g.nvlink[link];
    for (int k = 0; k < g_cfg.count; k++)
        if (g_dev[k].g.index == peer) {
            memset(p, 0, sizeof(*p));
            fg_copy(p->busId, sizeof p->busId, g_dev[k].g.pci);
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t d, nvmlPciInfo_t *p)
{
    return nvmlDeviceGetPciInfo_v3(d, p);
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t d, nvmlPciInfo_t *p)
{
    return nvmlDeviceGetPciInfo_v3(d, p);
}

static void mem_of(int i, unsigned long long *total, unsigned long long *used)
{
    *total = g_dev[i].g.memory_mib * MIB;
    fg_lock(g_st);
    fg_reap_locked(g_st);
    *used = i < FG_MAX_DEV ? g_st->dev[i].used : 0;
    fg_unlock(g_st);
    if (*used > *total)
        *used = *total;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    DEV_OR_RETURN(i, d);
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    mem_of(i, &m->total, &m->used);
    m->free = m->total - m->used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    DEV_OR_RETURN(i, d);
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mem_of(i, &m->total, &m->used);
    m->reserved = 0;
    m->free = m->total - m->used;
    return NVML_SUCCESS;
}

static uint64_t util_window_ns(void)
{
    const char *w = getenv("FAKE_NVML_UTIL_WINDOW_MS");
    uint64_t ms = w && *w ? strtoull(w, NULL, 10) : 1000;
    return (ms ? ms : 1000) * 1000000ull;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{
    DEV_OR_RETURN(i, d);
    if (!u)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t now = fg_now_ns(), w = util_window_ns();
    fg_lock(g_st);
    uint64_t busy = fg_busy_locked(g_st, i, -1, now > w ? now - w : 0, now);
    fg_unlock(g_st);
    unsigned pct = (unsigned)((busy * 100 + w / 2) / w) + g_dev[i].g.util;
    u->gpu = pct > 100 ? 100 : pct;
    u->memory = u->gpu / 2;
    return NVML_SUCCESS;
}

/* Per-process SM utilisation over [lastSeenTimeStamp, now] (µs, CLOCK_REALTIME; 0 or older than
 * 10 s means the last second).  NVML_ERROR_NOT_FOUND when no process ran in that window. */
EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *out,
                                                    unsigned int *count, unsigned long long last_seen)
{
    DEV_OR_RETURN(i, d);
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t now = fg_now_ns(), rt = fg_realtime_us();
    uint64_t win = 1000000000ull;
    if (last_seen && last_seen < rt && rt - last_seen < 10000000ull)
        win = (rt - last_seen) * 1000ull;
    if (win == 0)
        win = 1000;
    uint64_t t0 = now > win ? now - win : 0;
    int pids[64];
    uint64_t busy[64];
    int np = 0;
    fg_lock(g_st);
    struct fg_dev *dv = &g_st->dev[i];
    uint64_t n = dv->head < FG_RING ? dv->head : FG_RING;
    for (uint64_t k = 0; k < n; k++) {
        const struct fg_interval *iv = &dv->ring[(dv->head - 1 - k) % FG_RING];
        if (iv->end_ns <= t0)
            break;
        int j;
        for (j = 0; j < np; j++)
            if (pids[j] == iv->pid)
                break;
        if (j == np) {
            if (np == 64)
                continue;
            pids[np] = iv->pid;
            busy[np] = 0;
            np++;
        }
        uint64_t a = iv->start_ns > t0 ? iv->start_ns : t0;
        uint64_t b = iv->end_ns < now ? iv->end_ns : now;
        if (b > a)
            busy[j] += b - a;
    }
    fg_unlock(g_st);
    if (np == 0) {
        *count = 0;
        return NVML_ERROR_NOT_FOUND;
    }
    if (!out || *count < (unsigned)np) {
        *count = (unsigned)np;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int j = 0; j < np; j++) {
        out[j].pid = (unsigned)pids[j];
        out[j].timeStamp = rt;
        uint64_t pct = (busy[j] * 100 + win / 2) / win;
        out[j].smUtil = (unsigned)(pct > 100 ? 100 : pct);
        out[j].memUtil = out[j].smUtil / 2;
        out[j].encUtil = 0;
        out[j].decUtil = 0;
    }
    *count = (unsigned)np;
    return NVML_SUCCESS;
}

static nvmlReturn_t running_procs(nvmlDevice_t d, unsigned int *count, void *out, size_t stride, int v1)
{
    DEV_OR_RETURN(i, d);
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct fg_proc found[FG_MAX_PROC];
    unsigned n = 0;
    fg_lock(g_st);
    fg_reap_locked(g_st);
    for (int k = 0; k < FG_MAX_PROC; k++)
        if (g_st->procs[k].pid && g_st->procs[k].dev == i)
            found[n++] = g_st->procs[k];
    fg_unlock(g_st);
    if (n == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (!out || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned k = 0; k < n; k++) {
        char *p = (char *)out + k * stride;
        if (v1) {
            nvmlProcessInfo_v1_t *e = (nvmlProcessInfo_v1_t *)p;
            e->pid = (unsigned)found[k].pid;
            e->usedGpuMemory = found[k].used;
        } else {
            nvmlProcessInfo_t *e = (nvmlProcessInfo_t *)p;
            e->pid = (unsigned)found[k].pid;
            e->usedGpuMemory = found[k].used;
            e->gpuInstanceId = 0xffffffffu;
            e->computeInstanceId = 0xffffffffu;
        }
    }
    *count = n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_v1_t *p)
{
    return running_procs(d, c, p, sizeof(*p), 1);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p)
{
    return running_procs(d, c, p, sizeof(*p), 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p)
{
    return running_procs(d, c, p, sizeof(*p), 0);
}

/* ------------------------------------------------------------------ events */
#define SUPPORTED_EVENTS                                                                        \
    (nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypePState |  \
     nvmlEventTypeXidCriticalError | nvmlEventTypeClock)

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types)
{
    DEV_OR_RETURN(i, d);
    (void)i;
    if (!types)
        return NVML_ERROR_INVALID_ARGUMENT;
    *types = SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct eventset *es = calloc(1, sizeof(*es));
    if (!es)
        return NVML_ERROR_UNKNOWN;
    *set = (nvmlEventSet_t)es;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    free(set);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set)
{
    DEV_OR_RETURN(i, d);
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (types & ~SUPPORTED_EVENTS)
        return NVML_ERROR_NOT_SUPPORTED;
    ((struct eventset *)set)->types[i] |= types;
    return NVML_SUCCESS;
}

/* Takes the first matching line out of FAKE_NVML_EVENTS. Returns 1 if an event was delivered. */
static int consume_event(struct eventset *es, nvmlEventData_t *data)
{
    const char *path = getenv("FAKE_NVML_EVENTS");
    if (!path || !*path)
        return 0;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return 0;
    flock(fd, LOCK_EX);
    char buf[65536];
    ssize_t len = read(fd, buf, sizeof buf - 1);
    int delivered = 0;
    if (len > 0) {
        buf[len] = 0;
        char *line = buf;
        while (*line) {
            char *nl = strchr(line, '\n');
            char *next = nl ? nl + 1 : line + strlen(line);
            int idx = -1;
            unsigned long long xid = 0, type = nvmlEventTypeXidCriticalError;
            char one[256];
            size_t ll = (size_t)(next - line) < sizeof one - 1 ? (size_t)(next - line) : sizeof one - 1;
            memcpy(one, line, ll);
            one[ll] = 0; /* parse this line only */
            int nf = sscanf(one, "%d %llu %llx", &idx, &xid, &type);
            if (nf >= 2 && idx >= 0 && idx < g_cfg.count && idx < FG_MAX_DEV && (es->types[idx] & type)) {
                memset(data, 0, sizeof(*data));
                data->device = (nvmlDevice_t)&g_dev[idx];
                data->eventType = type;
                data->eventData = xid;
                data->gpuInstanceId = 0xffffffffu;
                data->computeInstanceId = 0xffffffffu;
                size_t rest = strlen(next);
                memmove(line, next, rest + 1);
                size_t total = strlen(buf);
                if (ftruncate(fd, 0) == 0 && lseek(fd, 0, SEEK_SET) == 0) {
                    ssize_t w = write(fd, buf, total);
                    (void)w;
                }
                delivered = 1;
                break;
            }
            line = next;
        }
    }
    flock(fd, LOCK_UN);
    close(fd);
    return delivered;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!set || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t deadline = fg_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        if (consume_event((struct eventset *)set, data))
            return NVML_SUCCESS;
        uint64_t now = fg_now_ns();
        if (now >= deadline)
            return NVML_ERROR_TIMEOUT;
        uint64_t step = deadline - now < 10000000ull ? deadline - now : 10000000ull;
        fg_sleep_until(now + step);
    }
}

EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms)
{
    return nvmlEventSetWait_v2(set, data, timeout_ms);
}
