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
 *   (mig=1: GPU instances, compute instances and MIG devices, see the MIG section at the end)
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
 * PROCESS LISTS come in no documented order; FAKE_NVML_PROCS_REVERSED=1 lists the newest first.
 * FAKE_NVML_EXTRA_PROCS=N lists N more processes (pids 4000001 and up, 64 MiB each: other containers' the
 * caller cannot see) after the node's own.
 * FAKE_NVML_LIST_GATE=PATH: each process listing says so on stderr and waits (at most 60 s) until PATH
 * exists, then removes it (one listing per file a test creates).
 * FAKE_NVML_USED_NA=1 reports each process's usedGpuMemory as not available (NVML_VALUE_NOT_AVAILABLE,
 * as drivers do under some virtualisation modes). FAKE_NVML_TWIN=1 plays a perfect mimic: every other
 * process's usedGpuMemory includes the calling process's, so whatever the caller allocates shows on
 * every neighbour at the same moment. FAKE_NVML_STALL_ABOVE_MIB=M: a listing made while the caller
 * holds more than M MiB on the device writes "fake nvml: listing stalled" to stderr and never returns
 * (a process to kill at that point). The knobs are read at each call.
 *
 * Build: gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1.  To use it from pynvml in-process,
 * load it first: ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL); pynvml's CDLL("libnvidia-ml.so.1")
 * then finds the already-loaded object by its soname.
 */
#include "fakegpu.h"
#include "nvml_abi.h"

#define EXPORT __attribute__((visibility("default")))
#define NVML_ERROR_IN_USE 19
#define NVML_ERROR_INSUFFICIENT_RESOURCES 23
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

/* MIG devices (the MIG section at the end): facts of a MIG device handle, 1 when h is one */
static int mig_device_facts(nvmlDevice_t h, char *uuid, size_t ulen, char *name, size_t nlen,
                            unsigned long long *mib, int *pid);
static int mig_uuid_handle(const char *uuid, nvmlDevice_t *d);

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
    case NVML_ERROR_IN_USE:
        return "In use by another client";
    case NVML_ERROR_INSUFFICIENT_RESOURCES:
        return "Insufficient resources";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH:
        return "Argument version mismatch";
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
    return mig_uuid_handle(uuid, d) ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
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
    char mu[48];
    if (mig_device_facts(d, mu, sizeof mu, NULL, 0, NULL, NULL))
        return copy_str(uuid, len, mu);
    DEV_OR_RETURN(i, d);
    return copy_str(uuid, len, g_dev[i].g.uuid);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int len)
{
    char mn[160];
    if (mig_device_facts(d, NULL, 0, mn, sizeof mn, NULL, NULL))
        return copy_str(name, len, mn);
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
    unsigned long long mib;
    if (mig_device_facts(d, NULL, 0, NULL, 0, &mib, NULL)) {
        if (!m)
            return NVML_ERROR_INVALID_ARGUMENT;
        m->total = mib * MIB;
        m->used = 0;
        m->free = m->total;
        return NVML_SUCCESS;
    }
    DEV_OR_RETURN(i, d);
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    mem_of(i, &m->total, &m->used);
    m->free = m->total - m->used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    unsigned long long mib;
    if (mig_device_facts(d, NULL, 0, NULL, 0, &mib, NULL)) {
        if (!m)
            return NVML_ERROR_INVALID_ARGUMENT;
        if (m->version != nvmlMemory_v2)
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        m->total = mib * MIB;
        m->used = m->reserved = 0;
        m->free = m->total;
        return NVML_SUCCESS;
    }
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
    int mpid = 0;
    if (mig_device_facts(d, NULL, 0, NULL, 0, NULL, &mpid)) { /* a MIG device: the process run on it */
        if (!count)
            return NVML_ERROR_INVALID_ARGUMENT;
        unsigned want = mpid > 0;
        if (want && (!out || *count < want)) {
            *count = want;
            return NVML_ERROR_INSUFFICIENT_SIZE;
        }
        if (want) {
            if (v1) {
                ((nvmlProcessInfo_v1_t *)out)->pid = (unsigned)mpid;
                ((nvmlProcessInfo_v1_t *)out)->usedGpuMemory = 0;
            } else {
                nvmlProcessInfo_t *e = (nvmlProcessInfo_t *)out;
                memset(e, 0, sizeof *e);
                e->pid = (unsigned)mpid;
            }
        }
        *count = want;
        return NVML_SUCCESS;
    }
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
    const char *rev = getenv("FAKE_NVML_PROCS_REVERSED");
    for (unsigned k = 0; rev && *rev == '1' && k < n / 2; k++) {
        struct fg_proc t = found[k];
        found[k] = found[n - 1 - k];
        found[n - 1 - k] = t;
    }
    const char *extra_s = getenv("FAKE_NVML_EXTRA_PROCS");
    unsigned extra = extra_s ? (unsigned)strtoul(extra_s, NULL, 10) : 0;
    if (extra > 100000)
        extra = 100000;
    if (n + extra == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (!out || *count < n + extra) {
        *count = n + extra;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    const char *gate = getenv("FAKE_NVML_LIST_GATE");
    if (gate && *gate) { /* one listing per appearance of the file: say so, wait for it, take it */
        static const char msg[] = "fake nvml: listing waits at the gate\n";
        if (write(2, msg, sizeof msg - 1) >= 0)
            for (uint64_t end = fg_now_ns() + 60000000000ull; fg_now_ns() < end && unlink(gate) != 0;)
                fg_sleep_until(fg_now_ns() + 1000000);
    }
    const char *stall = getenv("FAKE_NVML_STALL_ABOVE_MIB");
    for (unsigned k = 0; stall && *stall && k < n; k++) {
        if (found[k].pid == fg_host_pid() && found[k].used > strtoull(stall, NULL, 10) * (1ull << 20)) {
            static const char msg[] = "fake nvml: listing stalled\n";
            if (write(2, msg, sizeof msg - 1) < 0)
                break;
            for (;;)
                pause();
        }
    }
    const char *twin = getenv("FAKE_NVML_TWIN");
    if (twin && *twin == '1') {
        int me = fg_host_pid();
        uint64_t mine = 0;
        for (unsigned k = 0; k < n; k++)
            if (found[k].pid == me)
                mine = found[k].used;
        for (unsigned k = 0; k < n; k++)
            if (found[k].pid != me)
                found[k].used += mine;
    }
    const char *na = getenv("FAKE_NVML_USED_NA");
    for (unsigned k = 0; k < n; k++) {
        char *p = (char *)out + k * stride;
        if (na && *na == '1')
            found[k].used = 0xffffffffffffffffull; /* NVML_VALUE_NOT_AVAILABLE */
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
    for (unsigned k = 0; k < extra; k++) { /* other containers' processes, listed after this node's */
        char *p = (char *)out + (n + k) * stride;
        unsigned pid = 4000001u + k;
        uint64_t used = na && *na == '1' ? 0xffffffffffffffffull : 64ull << 20;
        if (v1) {
            nvmlProcessInfo_v1_t *e = (nvmlProcessInfo_v1_t *)p;
            e->pid = pid;
            e->usedGpuMemory = used;
        } else {
            nvmlProcessInfo_t *e = (nvmlProcessInfo_t *)p;
            e->pid = pid;
            e->usedGpuMemory = used;
            e->gpuInstanceId = 0xffffffffu;
            e->computeInstanceId = 0xffffffffu;
        }
    }
    *count = n + extra;
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

/* ------------------------------------------------------------------ MIG
 *
 * A GPU whose config line says mig=1 is in MIG mode. Its profile table is chosen by name and memory
 * like kube_vgpu/mig.py's table_for (H200 -> H200-141GB, H100 with >= 70000 MiB -> H100-80GB, A100
 * over 51200 MiB -> A100-80GB, other A100 -> A100-40GB; anything else has no MIG profiles). The
 * geometry: 8 memory slices, 7 compute slices; a GPU instance of a profile takes memory_slices
 * consecutive slices at one of the profile's allowed starts (nvmlDeviceGetGpuInstancePossiblePlacements_v2).
 * Behaves like the driver: a placement that overlaps an instance, or past a profile's instance count,
 * is NVML_ERROR_INSUFFICIENT_RESOURCES; a start the profile does not allow INVALID_ARGUMENT; MIG calls on
 * a GPU not in MIG mode NOT_SUPPORTED; destroying a GPU instance that still has compute instances, or a
 * compute instance with a running process, NVML_ERROR_IN_USE. Every compute instance is one MIG device
 * (nvmlDeviceGetMigDeviceHandleByIndex) with its own "MIG-..." UUID, memory = its GPU instance's.
 *
 * STATE: with FAKE_NVML_MIG_STATE naming a file, the instances live there (read and written under flock
 * by every MIG call), so they outlive the process and are shared, as the driver's are; without it they
 * live in the process. fake_nvml_mig_run(uuid, pid) (a test hook, not NVML) records that process pid runs
 * on MIG device uuid (0: none); the device is busy while that pid is alive.
 */
#define MIG_SLICES 8
#define MIG_MAX_GI 8
#define MIG_MAX_CI 8
#define MIG_NPROF 7
#define MIG_MAGIC 0x4d494731u /* "MIG1" */

typedef struct {
    unsigned int start, size;
} fk_placement_t;

typedef struct {
    unsigned int id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount, copyEngineCount, decoderCount,
        encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
} fk_gi_profile_t;

typedef struct {
    unsigned int version, id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount, copyEngineCount,
        decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
    char name[96];
} fk_gi_profile_v2_t;
#define FK_GI_PROFILE_V2 0x02000098u

typedef struct {
    unsigned int id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount,
        sharedEncoderCount, sharedJpegCount, sharedOfaCount;
} fk_ci_profile_t;

typedef struct {
    unsigned int version, id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount,
        sharedDecoderCount, sharedEncoderCount, sharedJpegCount, sharedOfaCount;
    char name[96];
} fk_ci_profile_v2_t;
#define FK_CI_PROFILE_V2 0x02000088u

typedef struct {
    nvmlDevice_t device;
    unsigned int id, profileId;
    fk_placement_t placement;
} fk_gi_info_t;

typedef struct {
    nvmlDevice_t device;
    void *gpuInstance;
    unsigned int id, profileId;
    fk_placement_t placement;
} fk_ci_info_t;

typedef struct {
    unsigned int multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount, sharedEncoderCount,
        sharedJpegCount, sharedOfaCount, gpuInstanceSliceCount, computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} fk_attributes_t;

struct mig_profile {
    const char *name;
    unsigned index, id, compute, mem_slices, count, starts_mask, media;
    unsigned long long mib;
};

struct mig_table {
    const char *key;
    unsigned sm_per_slice;
    struct mig_profile p[MIG_NPROF];
};

/* The facts of docs/mig.md (NVIDIA's MIG user guide; MiB as NVML reports them). Per profile: name,
 * NVML_GPU_INSTANCE_PROFILE_* index, profile id (nvidia-smi's), compute slices, memory slices, instance
 * count, allowed starts (bit mask), media extensions, MiB. */
#define MIG_LAYOUT(n1, n1me, n1big, n2, n3, n4, n7, m1, m2, m2g, m4, m8)                                        \
    {{n1, 0, 19, 1, 1, 7, 0x7f, 0, m1},    {n1me, 7, 20, 1, 1, 1, 0x7f, 1, m1}, {n1big, 9, 15, 1, 2, 4, 0x55, 0, m2}, \
     {n2, 1, 14, 2, 2, 3, 0x15, 0, m2g},   {n3, 2, 9, 3, 4, 2, 0x11, 0, m4},     {n4, 3, 5, 4, 4, 1, 0x01, 0, m4},    \
     {n7, 4, 0, 7, 8, 1, 0x01, 0, m8}}

static const struct mig_table g_mig_tables[] = {
    {"A100-40GB", 14,
     MIG_LAYOUT("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb", 4864, 9856, 9856,
                19968, 40192)},
    {"A100-80GB", 14,
     MIG_LAYOUT("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", 9856, 19968, 19968,
                40192, 80384)},
    {"H100-80GB", 16,
     MIG_LAYOUT("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", 10240, 20480,
                20480, 40960, 81920)},
    {"H200-141GB", 16,
     MIG_LAYOUT("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb", 18432, 35840,
                35840, 72704, 144384)},
};

struct mig_ci {
    int used;
    unsigned id, slices, start;
    int pid; /* a process running on it (fake_nvml_mig_run), 0 none */
    char uuid[48];
};

struct mig_gi {
    int used;
    unsigned id, start;
    int prof; /* position in the table */
    struct mig_ci ci[MIG_MAX_CI];
};

struct mig_state {
    unsigned magic, serial;
    struct mig_gi gi[FG_MAX_DEV][MIG_MAX_GI];
};

/* handles: a MIG device is a compute instance seen as a device */
struct mig_dev {
    int dev, gi, ci;
};

static struct mig_state g_mig;
static struct mig_dev g_migdev[FG_MAX_DEV][MIG_MAX_GI][MIG_MAX_CI];
static pthread_mutex_t g_mig_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_mig_fd = -1;

static const struct mig_table *mig_table_of(int d)
{
    const struct fg_gpu *g = &g_dev[d].g;
    int want = -1;
    if (strstr(g->name, "H200"))
        want = 3;
    else if (strstr(g->name, "H100") && g->memory_mib >= 70000)
        want = 2;
    else if (strstr(g->name, "A100"))
        want = g->memory_mib > 51200 ? 1 : 0;
    return want < 0 ? NULL : &g_mig_tables[want];
}

/* Lock the MIG state and load it from FAKE_NVML_MIG_STATE (if set). */
static void mig_lock(void)
{
    pthread_mutex_lock(&g_mig_mu);
    const char *path = getenv("FAKE_NVML_MIG_STATE");
    g_mig_fd = -1;
    if (!path || !*path)
        return;
    g_mig_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (g_mig_fd < 0)
        return;
    flock(g_mig_fd, LOCK_EX);
    struct mig_state s;
    if (pread(g_mig_fd, &s, sizeof s, 0) == (ssize_t)sizeof s && s.magic == MIG_MAGIC)
        g_mig = s;
    else
        memset(&g_mig, 0, sizeof g_mig);
}

/* Write the state back (when changed) and unlock. */
static void mig_unlock(int changed)
{
    if (g_mig_fd >= 0) {
        if (changed) {
            g_mig.magic = MIG_MAGIC;
            ssize_t w = pwrite(g_mig_fd, &g_mig, sizeof g_mig, 0);
            (void)w;
        }
        flock(g_mig_fd, LOCK_UN);
        close(g_mig_fd);
        g_mig_fd = -1;
    }
    pthread_mutex_unlock(&g_mig_mu);
}

/* The GPU's table when it is in MIG mode; else an NVML error through *err. */
static const struct mig_table *mig_gpu(nvmlDevice_t d, int *dev, nvmlReturn_t *err)
{
    int i = dev_index(d);
    if (i < 0) {
        *err = (nvmlReturn_t)-i;
        return NULL;
    }
    const struct mig_table *t = mig_table_of(i);
    if (!g_dev[i].g.mig || !t) {
        *err = NVML_ERROR_NOT_SUPPORTED;
        return NULL;
    }
    *dev = i;
    return t;
}

static int mig_prof_by_index(const struct mig_table *t, unsigned index)
{
    for (int k = 0; k < MIG_NPROF; k++)
        if (t->p[k].index == index)
            return k;
    return -1;
}

static int mig_prof_by_id(const struct mig_table *t, unsigned id)
{
    for (int k = 0; k < MIG_NPROF; k++)
        if (t->p[k].id == id)
            return k;
    return -1;
}

static unsigned mig_used_mask(int dev)
{
    unsigned m = 0;
    for (int k = 0; k < MIG_MAX_GI; k++) {
        const struct mig_gi *gi = &g_mig.gi[dev][k];
        if (gi->used) {
            const struct mig_profile *p = &mig_table_of(dev)->p[gi->prof];
            m |= ((1u << p->mem_slices) - 1u) << gi->start;
        }
    }
    return m;
}

static int mig_count(int dev, int prof, int media)
{
    int n = 0;
    for (int k = 0; k < MIG_MAX_GI; k++) {
        const struct mig_gi *gi = &g_mig.gi[dev][k];
        if (gi->used && (gi->prof == prof || (media && mig_table_of(dev)->p[gi->prof].media)))
            n++;
    }
    return n;
}

/* NVML_SUCCESS when profile prof can take start now; else INVALID_ARGUMENT (a start it does not allow)
 * or INSUFFICIENT_RESOURCES (overlap, or no instance left). */
static nvmlReturn_t mig_can_place(int dev, int prof, unsigned start)
{
    const struct mig_profile *p = &mig_table_of(dev)->p[prof];
    if (start >= MIG_SLICES || !(p->starts_mask & (1u << start)))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (mig_count(dev, prof, 0) >= (int)p->count || (p->media && mig_count(dev, prof, 1) >= 1))
        return NVML_ERROR_INSUFFICIENT_RESOURCES;
    unsigned want = ((1u << p->mem_slices) - 1u) << start;
    return (mig_used_mask(dev) & want) ? NVML_ERROR_INSUFFICIENT_RESOURCES : NVML_SUCCESS;
}

static nvmlReturn_t mig_gi_of(void *h, int *dev, int *gi)
{
    struct mig_gi *g = (struct mig_gi *)h;
    struct mig_gi *base = &g_mig.gi[0][0];
    if (!h || g < base || g >= base + FG_MAX_DEV * MIG_MAX_GI)
        return NVML_ERROR_INVALID_ARGUMENT;
    long off = g - base;
    *dev = (int)(off / MIG_MAX_GI);
    *gi = (int)(off % MIG_MAX_GI);
    if (!g->used || *dev >= g_cfg.count || !g_dev[*dev].g.mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

static nvmlReturn_t mig_ci_of(void *h, int *dev, int *gi, int *ci)
{
    unsigned char *p = (unsigned char *)h;
    for (int d = 0; d < FG_MAX_DEV; d++)
        for (int k = 0; k < MIG_MAX_GI; k++) {
            struct mig_ci *c0 = g_mig.gi[d][k].ci;
            if (p >= (unsigned char *)c0 && p < (unsigned char *)(c0 + MIG_MAX_CI)) {
                long j = (struct mig_ci *)p - c0;
                if (!g_mig.gi[d][k].used || !c0[j].used || d >= g_cfg.count || !g_dev[d].g.mig)
                    return NVML_ERROR_INVALID_ARGUMENT;
                *dev = d, *gi = k, *ci = (int)j;
                return NVML_SUCCESS;
            }
        }
    return NVML_ERROR_INVALID_ARGUMENT;
}

/* A MIG device handle -> (dev, gi, ci) of a live compute instance: 1, else 0. Call under mig_lock. */
static int mig_dev_of(nvmlDevice_t h, int *dev, int *gi, int *ci)
{
    struct mig_dev *m = (struct mig_dev *)h;
    struct mig_dev *base = &g_migdev[0][0][0];
    if (m < base || m >= base + FG_MAX_DEV * MIG_MAX_GI * MIG_MAX_CI)
        return 0;
    long off = m - base;
    *dev = (int)(off / (MIG_MAX_GI * MIG_MAX_CI));
    *gi = (int)(off / MIG_MAX_CI % MIG_MAX_GI);
    *ci = (int)(off % MIG_MAX_CI);
    return *dev < g_cfg.count && g_dev[*dev].g.mig && g_mig.gi[*dev][*gi].used && g_mig.gi[*dev][*gi].ci[*ci].used;
}

static int mig_busy(const struct mig_ci *c)
{
    return c->pid > 0 && fg_pid_alive(c->pid);
}

static void mig_fill_v1(const struct mig_table *t, const struct mig_profile *p, fk_gi_profile_t *o)
{
    memset(o, 0, sizeof *o);
    o->id = p->id;
    o->isP2pSupported = 0;
    o->sliceCount = p->compute;
    o->instanceCount = p->count;
    o->multiprocessorCount = p->compute * t->sm_per_slice;
    o->copyEngineCount = p->compute;
    o->decoderCount = p->compute >= 7 ? 5 : (p->compute + 1) / 2;
    o->jpegCount = o->ofaCount = p->media || p->compute == 7;
    o->memorySizeMB = p->mib;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t d, unsigned int profile, fk_gi_profile_t *info)
{
    nvmlReturn_t err = NVML_SUCCESS;
    int dev;
    const struct mig_table *t = mig_gpu(d, &dev, &err);
    if (!t)
        return err;
    int k = mig_prof_by_index(t, profile);
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (k < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    mig_fill_v1(t, &t->p[k], info);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t d, unsigned int profile, fk_gi_profile_v2_t *info)
{
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != FK_GI_PROFILE_V2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    fk_gi_profile_t v1;
    nvmlReturn_t r = nvmlDeviceGetGpuInstanceProfileInfo(d, profile, &v1);
    if (r != NVML_SUCCESS)
        return r;
    int dev;
    const struct mig_table *t = mig_gpu(d, &dev, &r);
    const struct mig_profile *p = &t->p[mig_prof_by_index(t, profile)];
    info->id = v1.id;
    info->isP2pSupported = v1.isP2pSupported;
    info->sliceCount = v1.sliceCount;
    info->instanceCount = v1.instanceCount;
    info->multiprocessorCount = v1.multiprocessorCount;
    info->copyEngineCount = v1.copyEngineCount;
    info->decoderCount = v1.decoderCount;
    info->encoderCount = v1.encoderCount;
    info->jpegCount = v1.jpegCount;
    info->ofaCount = v1.ofaCount;
    info->memorySizeMB = v1.memorySizeMB;
    snprintf(info->name, sizeof info->name, "MIG %s", p->name);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t d, unsigned int profileId,
                                                                  fk_placement_t *out, unsigned int *count)
{
    nvmlReturn_t err = NVML_SUCCESS;
    int dev;
    const struct mig_table *t = mig_gpu(d, &dev, &err);
    if (!t)
        return err;
    int k = mig_prof_by_id(t, profileId);
    if (k < 0 || !count)
        return k < 0 ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = 0;
    for (unsigned s = 0; s < MIG_SLICES; s++)
        if (t->p[k].starts_mask & (1u << s)) {
            if (out) {
                if (n >= *count)
                    return NVML_ERROR_INSUFFICIENT_SIZE;
                out[n].start = s;
                out[n].size = t->p[k].mem_slices;
            }
            n++;
        }
    *count = n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t d, unsigned int profileId, unsigned int *count)
{
    nvmlReturn_t err = NVML_SUCCESS;
    int dev;
    const struct mig_table *t = mig_gpu(d, &dev, &err);
    if (!t)
        return err;
    int k = mig_prof_by_id(t, profileId);
    if (k < 0 || !count)
        return k < 0 ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
    mig_lock();
    /* place greedily at the lowest free starts on a copy: how many more fit */
    struct mig_state saved = g_mig;
    unsigned n = 0;
    for (int again = 1; again;) {
        again = 0;
        for (unsigned s = 0; s < MIG_SLICES; s++) {
            if (mig_can_place(dev, k, s) != NVML_SUCCESS)
                continue;
            for (int g = 0; g < MIG_MAX_GI; g++)
                if (!g_mig.gi[dev][g].used) {
                    g_mig.gi[dev][g].used = 1;
                    g_mig.gi[dev][g].prof = k;
                    g_mig.gi[dev][g].start = s;
                    n++;
                    again = 1;
                    break;
                }
            break;
        }
    }
    g_mig = saved;
    mig_unlock(0);
    *count = n;
    return NVML_SUCCESS;
}

static nvmlReturn_t mig_create_gi(nvmlDevice_t d, unsigned profileId, const fk_placement_t *pl, void **out)
{
    nvmlReturn_t err = NVML_SUCCESS;
    int dev;
    const struct mig_table *t = mig_gpu(d, &dev, &err);
    if (!t)
        return err;
    int k = mig_prof_by_id(t, profileId);
    if (k < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!out || (pl && pl->size != t->p[k].mem_slices))
        return NVML_ERROR_INVALID_ARGUMENT;
    mig_lock();
    nvmlReturn_t r = NVML_ERROR_INSUFFICIENT_RESOURCES;
    unsigned start = 0;
    if (pl) {
        start = pl->start;
        r = mig_can_place(dev, k, start);
    } else {
        for (start = 0; start < MIG_SLICES; start++)
            if ((r = mig_can_place(dev, k, start)) == NVML_SUCCESS)
                break;
        if (r != NVML_SUCCESS)
            r = NVML_ERROR_INSUFFICIENT_RESOURCES;
    }
    int slot = -1;
    if (r == NVML_SUCCESS) {
        for (int g = 0; g < MIG_MAX_GI && slot < 0; g++)
            if (!g_mig.gi[dev][g].used)
                slot = g;
        if (slot < 0)
            r = NVML_ERROR_INSUFFICIENT_RESOURCES;
    }
    if (r == NVML_SUCCESS) {
        unsigned id = 1; /* the lowest id not in use (ids start at 1 unless the whole GPU: 0) */
        if (t->p[k].compute == 7)
            id = 0;
        else
            for (int again = 1; again;) {
                again = 0;
                for (int g = 0; g < MIG_MAX_GI; g++)
                    if (g_mig.gi[dev][g].used && g_mig.gi[dev][g].id == id) {
                        id++;
                        again = 1;
                    }
            }
        struct mig_gi *gi = &g_mig.gi[dev][slot];
        memset(gi, 0, sizeof *gi);
        gi->used = 1;
        gi->id = id;
        gi->prof = k;
        gi->start = start;
        *out = gi;
    }
    mig_unlock(r == NVML_SUCCESS);
    return r;
}

EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t d, unsigned int profileId, void **gi)
{
    return mig_create_gi(d, profileId, NULL, gi);
}

EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t d, unsigned int profileId,
                                                             const fk_placement_t *placement, void **gi)
{
    if (!placement)
        return NVML_ERROR_INVALID_ARGUMENT;
    return mig_create_gi(d, profileId, placement, gi);
}

EXPORT nvmlReturn_t nvmlGpuInstanceDestroy(void *h)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    mig_lock();
    int dev, g;
    nvmlReturn_t r = mig_gi_of(h, &dev, &g);
    if (r == NVML_SUCCESS) {
        for (int j = 0; j < MIG_MAX_CI; j++)
            if (g_mig.gi[dev][g].ci[j].used)
                r = NVML_ERROR_IN_USE;
        if (r == NVML_SUCCESS)
            memset(&g_mig.gi[dev][g], 0, sizeof g_mig.gi[dev][g]);
    }
    mig_unlock(r == NVML_SUCCESS);
    return r;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t d, unsigned int profileId, void **out, unsigned int *count)
{
    nvmlReturn_t err = NVML_SUCCESS;
    int dev;
    const struct mig_table *t = mig_gpu(d, &dev, &err);
    if (!t)
        return err;
    int k = mig_prof_by_id(t, profileId);
    if (k < 0 || !count)
        return k < 0 ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
    mig_lock();
    unsigned n = 0;
    for (int g = 0; g < MIG_MAX_GI; g++)
        if (g_mig.gi[dev][g].used && g_mig.gi[dev][g].prof == k) {
            if (out)
                out[n] = &g_mig.gi[dev][g];
            n++;
        }
    mig_unlock(0);
    *count = n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t d, unsigned int id, void **out)
{
    nvmlReturn_t err = NVML_SUCCESS;
    int dev;
    if (!mig_gpu(d, &dev, &err))
        return err;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    mig_lock();
    nvmlReturn_t r = NVML_ERROR_NOT_FOUND;
    for (int g = 0; g < MIG_MAX_GI; g++)
        if (g_mig.gi[dev][g].used && g_mig.gi[dev][g].id == id) {
            *out = &g_mig.gi[dev][g];
            r = NVML_SUCCESS;
        }
    mig_unlock(0);
    return r;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(void *h, fk_gi_info_t *info)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    mig_lock();
    int dev, g;
    nvmlReturn_t r = mig_gi_of(h, &dev, &g);
    if (r == NVML_SUCCESS) {
        const struct mig_gi *gi = &g_mig.gi[dev][g];
        const struct mig_profile *p = &mig_table_of(dev)->p[gi->prof];
        info->device = (nvmlDevice_t)&g_dev[dev];
        info->id = gi->id;
        info->profileId = p->id;
        info->placement.start = gi->start;
        info->placement.size = p->mem_slices;
    }
    mig_unlock(0);
    return r;
}

/* compute instance profiles: NVML_COMPUTE_INSTANCE_PROFILE_{1,2,3,4,7}_SLICE = 0..4 */
static const unsigned g_ci_slices[] = {1, 2, 3, 4, 7};

static int ci_profile_ok(unsigned gi_compute, unsigned ci_index)
{
    if (ci_index >= sizeof g_ci_slices / sizeof g_ci_slices[0])
        return 0;
    unsigned s = g_ci_slices[ci_index];
    return s == gi_compute || (s < gi_compute && s <= 3 && !(s == 3 && gi_compute == 4));
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(void *h, unsigned int profile, unsigned int eng,
                                                                 fk_ci_profile_t *info)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!info || eng != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    mig_lock();
    int dev, g;
    nvmlReturn_t r = mig_gi_of(h, &dev, &g);
    if (r == NVML_SUCCESS) {
        const struct mig_table *t = mig_table_of(dev);
        unsigned gc = t->p[g_mig.gi[dev][g].prof].compute;
        if (!ci_profile_ok(gc, profile)) {
            r = NVML_ERROR_NOT_SUPPORTED;
        } else {
            memset(info, 0, sizeof *info);
            info->id = profile;
            info->sliceCount = g_ci_slices[profile];
            info->instanceCount = gc / g_ci_slices[profile];
            info->multiprocessorCount = g_ci_slices[profile] * t->sm_per_slice;
            info->sharedCopyEngineCount = gc;
        }
    }
    mig_unlock(0);
    return r;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(void *h, unsigned int profile, unsigned int eng,
                                                                  fk_ci_profile_v2_t *info)
{
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != FK_CI_PROFILE_V2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    fk_ci_profile_t v1;
    nvmlReturn_t r = nvmlGpuInstanceGetComputeInstanceProfileInfo(h, profile, eng, &v1);
    if (r != NVML_SUCCESS)
        return r;
    info->id = v1.id;
    info->sliceCount = v1.sliceCount;
    info->instanceCount = v1.instanceCount;
    info->multiprocessorCount = v1.multiprocessorCount;
    info->sharedCopyEngineCount = v1.sharedCopyEngineCount;
    snprintf(info->name, sizeof info->name, "MIG %uc", v1.sliceCount);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(void *h, unsigned int profile, void **out)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    mig_lock();
    int dev, g;
    nvmlReturn_t r = mig_gi_of(h, &dev, &g);
    if (r == NVML_SUCCESS) {
        struct mig_gi *gi = &g_mig.gi[dev][g];
        unsigned gc = mig_table_of(dev)->p[gi->prof].compute, used = 0, same = 0, id = 0;
        if (!ci_profile_ok(gc, profile)) {
            r = NVML_ERROR_NOT_SUPPORTED;
        } else {
            unsigned s = g_ci_slices[profile];
            int slot = -1;
            for (int j = 0; j < MIG_MAX_CI; j++) {
                if (gi->ci[j].used) {
                    used += gi->ci[j].slices;
                    same += gi->ci[j].slices == s;
                } else if (slot < 0) {
                    slot = j;
                }
            }
            if (slot < 0 || used + s > gc || same >= gc / s) {
                r = NVML_ERROR_INSUFFICIENT_RESOURCES;
            } else {
                for (int again = 1; again;) {
                    again = 0;
                    for (int j = 0; j < MIG_MAX_CI; j++)
                        if (gi->ci[j].used && gi->ci[j].id == id) {
                            id++;
                            again = 1;
                        }
                }
                struct mig_ci *c = &gi->ci[slot];
                memset(c, 0, sizeof *c);
                c->used = 1;
                c->id = id;
                c->slices = s;
                c->start = used;
                unsigned n = ++g_mig.serial;
                snprintf(c->uuid, sizeof c->uuid, "MIG-%08x-%04x-4%03x-8%03x-%012x", 0x6d160000u + n,
                         (unsigned)dev, (unsigned)gi->id & 0xfff, (unsigned)id & 0xfff, n * 2654435761u);
                *out = c;
            }
        }
    }
    mig_unlock(r == NVML_SUCCESS);
    return r;
}

EXPORT nvmlReturn_t nvmlComputeInstanceDestroy(void *h)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    mig_lock();
    int dev, g, j;
    nvmlReturn_t r = mig_ci_of(h, &dev, &g, &j);
    if (r == NVML_SUCCESS) {
        struct mig_ci *c = &g_mig.gi[dev][g].ci[j];
        if (mig_busy(c))
            r = NVML_ERROR_IN_USE;
        else
            memset(c, 0, sizeof *c);
    }
    mig_unlock(r == NVML_SUCCESS);
    return r;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstances(void *h, unsigned int profile, void **out, unsigned int *count)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    mig_lock();
    int dev, g;
    nvmlReturn_t r = mig_gi_of(h, &dev, &g);
    unsigned n = 0;
    if (r == NVML_SUCCESS) {
        struct mig_gi *gi = &g_mig.gi[dev][g];
        for (int j = 0; j < MIG_MAX_CI; j++)
            if (gi->ci[j].used && profile < 5 && gi->ci[j].slices == g_ci_slices[profile]) {
                if (out)
                    out[n] = &gi->ci[j];
                n++;
            }
        *count = n;
    }
    mig_unlock(0);
    return r;
}

EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(void *h, fk_ci_info_t *info)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    mig_lock();
    int dev, g, j;
    nvmlReturn_t r = mig_ci_of(h, &dev, &g, &j);
    if (r == NVML_SUCCESS) {
        const struct mig_ci *c = &g_mig.gi[dev][g].ci[j];
        info->device = (nvmlDevice_t)&g_dev[dev];
        info->gpuInstance = &g_mig.gi[dev][g];
        info->id = c->id;
        for (unsigned k = 0; k < 5; k++)
            if (g_ci_slices[k] == c->slices)
                info->profileId = k;
        info->placement.start = c->start;
        info->placement.size = c->slices;
    }
    mig_unlock(0);
    return r;
}

/* The MIG devices of GPU dev in NVML's order: by GPU instance start, then compute instance start. */
static int mig_list(int dev, struct mig_dev *out, int max)
{
    int n = 0;
    for (unsigned s = 0; s < MIG_SLICES; s++)
        for (int g = 0; g < MIG_MAX_GI; g++) {
            const struct mig_gi *gi = &g_mig.gi[dev][g];
            if (!gi->used || gi->start != s)
                continue;
            for (unsigned cs = 0; cs < 8; cs++)
                for (int j = 0; j < MIG_MAX_CI; j++)
                    if (gi->ci[j].used && gi->ci[j].start == cs && n < max) {
                        out[n].dev = dev, out[n].gi = g, out[n].ci = j;
                        n++;
                    }
        }
    return n;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned int index, nvmlDevice_t *mig)
{
    nvmlReturn_t err = NVML_SUCCESS;
    int dev;
    if (!mig_gpu(d, &dev, &err))
        return err;
    if (!mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct mig_dev all[MIG_MAX_GI * MIG_MAX_CI];
    mig_lock();
    int n = mig_list(dev, all, MIG_MAX_GI * MIG_MAX_CI);
    mig_unlock(0);
    if (index >= (unsigned)n)
        return NVML_ERROR_NOT_FOUND;
    struct mig_dev *h = &g_migdev[dev][all[index].gi][all[index].ci];
    *h = all[index];
    *mig = (nvmlDevice_t)h;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t d, unsigned int *is)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!is)
        return NVML_ERROR_INVALID_ARGUMENT;
    int dev, g, j;
    mig_lock();
    int m = mig_dev_of(d, &dev, &g, &j);
    mig_unlock(0);
    if (!m && dev_index(d) < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    *is = (unsigned)m;
    return NVML_SUCCESS;
}

#define MIG_DEV_OR_RETURN(h)                         \
    int md, mg, mc;                                  \
    if (!inited())                                   \
        return NVML_ERROR_UNINITIALIZED;             \
    mig_lock();                                      \
    int mok = mig_dev_of((h), &md, &mg, &mc);        \
    mig_unlock(0);                                   \
    if (!mok)                                        \
        return NVML_ERROR_INVALID_ARGUMENT

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t h, nvmlDevice_t *d)
{
    MIG_DEV_OR_RETURN(h);
    if (!d)
        return NVML_ERROR_INVALID_ARGUMENT;
    *d = (nvmlDevice_t)&g_dev[md];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t h, unsigned int *id)
{
    MIG_DEV_OR_RETURN(h);
    if (!id)
        return NVML_ERROR_INVALID_ARGUMENT;
    *id = g_mig.gi[md][mg].id;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t h, unsigned int *id)
{
    MIG_DEV_OR_RETURN(h);
    if (!id)
        return NVML_ERROR_INVALID_ARGUMENT;
    *id = g_mig.gi[md][mg].ci[mc].id;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t h, fk_attributes_t *a)
{
    MIG_DEV_OR_RETURN(h);
    if (!a)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct mig_table *t = mig_table_of(md);
    const struct mig_profile *p = &t->p[g_mig.gi[md][mg].prof];
    memset(a, 0, sizeof *a);
    a->computeInstanceSliceCount = g_mig.gi[md][mg].ci[mc].slices;
    a->multiprocessorCount = a->computeInstanceSliceCount * t->sm_per_slice;
    a->gpuInstanceSliceCount = p->compute;
    a->sharedCopyEngineCount = p->compute;
    a->memorySizeMB = p->mib;
    return NVML_SUCCESS;
}

/* For the calls that take a device or a MIG device: fills what the MIG device answers. Returns 1 when
 * h is a MIG device (uuid, name, total MiB, pid running on it), else 0. */
static int mig_device_facts(nvmlDevice_t h, char *uuid, size_t ulen, char *name, size_t nlen,
                            unsigned long long *mib, int *pid)
{
    struct mig_dev *base = &g_migdev[0][0][0];
    if ((struct mig_dev *)h < base || (struct mig_dev *)h >= base + FG_MAX_DEV * MIG_MAX_GI * MIG_MAX_CI || !inited())
        return 0; /* not a MIG device handle: no lock taken */
    int dev, g, j;
    mig_lock();
    int ok = mig_dev_of(h, &dev, &g, &j);
    if (ok) {
        const struct mig_gi *gi = &g_mig.gi[dev][g];
        const struct mig_profile *p = &mig_table_of(dev)->p[gi->prof];
        if (uuid)
            fg_copy(uuid, ulen, gi->ci[j].uuid);
        if (name)
            snprintf(name, nlen, "%s MIG %s", g_dev[dev].g.name, p->name);
        if (mib)
            *mib = p->mib;
        if (pid)
            *pid = mig_busy(&gi->ci[j]) ? gi->ci[j].pid : 0;
    }
    mig_unlock(0);
    return ok;
}

/* Test hook (not NVML): process pid runs on MIG device uuid from now on (0: nothing runs there).
 * Returns 0, or -1 when no MIG device has that uuid. */
EXPORT int fake_nvml_mig_run(const char *uuid, int pid)
{
    if (!uuid)
        return -1;
    pthread_mutex_lock(&g_mu);
    refresh_locked();
    pthread_mutex_unlock(&g_mu);
    mig_lock();
    int found = -1;
    for (int d = 0; d < FG_MAX_DEV; d++)
        for (int g = 0; g < MIG_MAX_GI; g++)
            for (int j = 0; j < MIG_MAX_CI; j++) {
                struct mig_ci *c = &g_mig.gi[d][g].ci[j];
                if (g_mig.gi[d][g].used && c->used && !strcmp(c->uuid, uuid)) {
                    c->pid = pid;
                    found = 0;
                }
            }
    mig_unlock(found == 0);
    return found;
}

static int mig_uuid_handle(const char *uuid, nvmlDevice_t *d)
{
    int found = 0;
    mig_lock();
    for (int dev = 0; dev < g_cfg.count && !found; dev++) {
        if (!g_dev[dev].g.mig)
            continue;
        struct mig_dev all[MIG_MAX_GI * MIG_MAX_CI];
        int n = mig_list(dev, all, MIG_MAX_GI * MIG_MAX_CI);
        for (int k = 0; k < n && !found; k++)
            if (!strcmp(g_mig.gi[dev][all[k].gi].ci[all[k].ci].uuid, uuid)) {
                struct mig_dev *h = &g_migdev[dev][all[k].gi][all[k].ci];
                *h = all[k];
                *d = (nvmlDevice_t)h;
                found = 1;
            }
    }
    mig_unlock(0);
    return found;
}
