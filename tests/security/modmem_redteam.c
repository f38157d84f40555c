/*
 * Red-team driver for module and library memory (tests/security/test_redteam_modmem.py). Linked against the
 * fake libcuda, run with the shim preloaded (or not). Loading a module makes the driver allocate device memory
 * for its code and static __device__ globals; on the fake driver an image "FAKEMOD:<bytes>" takes that many
 * (tests/fakes/README.md). One scenario per run, on device 0 in a context of its own; each step prints
 * "name=rc:charged:held" (the driver's result, what the shim charges on GPU 0, and the device memory this
 * process holds on GPU 0 now, as NVML's per-process usage shows it, its context included), bytes.
 *
 *   modmem_redteam module HOW BYTES ALLOC   load a module of BYTES (HOW: data, dataex, fatbin, file, proc:
 *                                     cuModuleLoadData, ...DataEx, ...FatBinary, cuModuleLoad of a file, or
 *                                     cuModuleLoadData looked up with cuGetProcAddress), cuMemAlloc ALLOC,
 *                                     unload the module, cuMemAlloc ALLOC again.
 *   modmem_redteam loop N BYTES ALLOC  load and unload a module of BYTES N times (prints failed=, drift=: loads
 *                                     or unloads that failed, and iterations whose charge after the load
 *                                     differed from the first), then cuMemAlloc ALLOC.
 *   modmem_redteam ctxgone BYTES ALLOC a second context, a module of BYTES loaded into it, the context destroyed
 *                                     (the driver frees the module with it), then cuMemAlloc ALLOC.
 *   modmem_redteam library HOW BYTES ALLOC  cuLibraryLoadData (HOW data, or file: cuLibraryLoadFromFile) of
 *                                     BYTES while the context exists, cuMemAlloc ALLOC, cuLibraryUnload,
 *                                     cuMemAlloc ALLOC again.
 *   modmem_redteam race N BYTES        two threads N times each: one loads and unloads a library of BYTES, the
 *                                     other creates a context, loads and unloads a module of BYTES in it and
 *                                     destroys it (prints failed=: calls that failed); then "end".
 *   modmem_redteam libnoctx BYTES ALLOC [primary]   the context destroyed first: cuLibraryLoadData of BYTES with
 *                                     no context (the driver allocates nothing yet), then a context created (the
 *                                     driver loads the library into it; `primary`: the primary context retained),
 *                                     cuMemAlloc ALLOC, cuLibraryUnload.
 *   modmem_redteam lazy USE BYTES ALLOC  cuLibraryLoadData of BYTES while the context exists ("load"), then its
 *                                     first use in it ("use"; USE: launch: cuLaunchKernel of a CUkernel cast to
 *                                     CUfunction, kernel: cuKernelGetFunction, global: cuLibraryGetGlobal,
 *                                     managed: cuLibraryGetManaged, module: cuLibraryGetModule), cuMemAlloc
 *                                     ALLOC, cuLibraryUnload, cuMemAlloc ALLOC again. With lazy loading (the
 *                                     driver's default) the library takes its memory at the first use.
 *   modmem_redteam lazyother BYTES ALLOC created|primary [nocur]  a second context (not current; primary:
 *                                     the primary context retained) exists when the library is loaded in the
 *                                     first (nocur: with no context current at the load); then a CUkernel of
 *                                     it is launched in the second ("use2"), cuMemAlloc ALLOC, cuLibraryUnload.
 *   modmem_redteam libloop N BYTES ALLOC  N times: cuLibraryLoadData of BYTES, a CUkernel of it launched,
 *                                     cuLibraryUnload (prints failed=, drift= as loop does); then cuMemAlloc ALLOC.
 *   modmem_redteam inflight BYTES ALLOC [free]  a module of BYTES loaded while another thread's cuMemAlloc of
 *                                     ALLOC is in the driver (reserved by the shim, not yet on the GPU) at the
 *                                     load's closing NVML reading: the fake NVML's listing gate (FAKE_NVML_LIST_GATE,
 *                                     set once the context exists) holds each listing, its figures taken, until
 *                                     the program's other thread (reading the fake's stderr notes through a pipe)
 *                                     lets it pass; the second listing of the load passes only after the
 *                                     allocation returned ("load", then "alloc": the allocation's result). free:
 *                                     ALLOC is allocated before the load and freed by the other thread while the
 *                                     load's opening listing is held (its figures taken with ALLOC still held).
 *   modmem_redteam reuse KIND SMALL BIG ALLOC  KIND (library or module) of SMALL loaded, then unloaded by another
 *                                     thread that the fake driver holds after the unload (FAKE_CUDA_UNLOAD_GATE,
 *                                     set then) while this one loads one of BIG ("load2": the driver hands out the
 *                                     same handle again; waited for up to 300 ms, then the unload is let go,
 *                                     "same=1" when the handle was the same), cuMemAlloc ALLOC ("alloc"), the
 *                                     second unloaded ("unload2").
 *   modmem_redteam twice BYTES ALLOC   double unloads: a library of BYTES loaded and unloaded twice ("lib1",
 *                                     "lib2"); a module of BYTES loaded into a second context, the context
 *                                     destroyed, then the module unloaded ("modgone") and again ("modgone2");
 *                                     a module loaded and unloaded twice ("mod1", "mod2"); then cuMemAlloc ALLOC.
 *   modmem_redteam destroyrace BYTES ALLOC  a second context holding ALLOC is destroyed by another thread while a
 *                                     module of BYTES is loaded in the first: the destroy starts while the load's
 *                                     opening NVML listing is held at its gate (its figures taken; waited for up
 *                                     to 300 ms to reach the driver), and the fake driver holds it after the
 *                                     context is freed (FAKE_CUDA_DESTROY_GATE) until the load returned.
 *   modmem_redteam libfirst BYTES ALLOC [primary]  no context yet (as the CUDA runtime registers a program's
 *                                     fatbins): cuLibraryLoadData of BYTES, the process's first context created
 *                                     ("ctx"; primary: the primary context retained and made current), a
 *                                     CUkernel launched ("use"), cuMemAlloc ALLOC, cuLibraryUnload.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "redteam.h"

CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuModuleLoad(CUmodule *, const char *);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleLoadDataEx(CUmodule *, const void *, unsigned int, int *, void **);
CUresult cuModuleLoadFatBinary(CUmodule *, const void *);
CUresult cuModuleUnload(CUmodule);
CUresult cuLibraryLoadData(CUlibrary *, const void *, int *, void **, unsigned int, int *, void **, unsigned int);
CUresult cuLibraryLoadFromFile(CUlibrary *, const char *, int *, void **, unsigned int, int *, void **,
                               unsigned int);
CUresult cuLibraryUnload(CUlibrary);
CUresult cuLibraryGetModule(CUmodule *, CUlibrary);
CUresult cuLibraryGetKernel(CUkernel *, CUlibrary, const char *);
CUresult cuKernelGetFunction(CUfunction *, CUkernel);
CUresult cuLibraryGetGlobal(CUdeviceptr *, size_t *, CUlibrary, const char *);
CUresult cuLibraryGetManaged(CUdeviceptr *, size_t *, CUlibrary, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void **, void **);
CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
unsigned long long fake_cuda_debug_held_bytes(int dev);

static unsigned long long charged(void)
{
    int (*get)(int, uint64_t *, uint64_t *) = (int (*)(int, uint64_t *, uint64_t *))dlsym(RTLD_DEFAULT,
                                                                                          "vgpu_get_usage");
    uint64_t used = 0;
    if (!get || get(0, &used, NULL) != 0)
        return 0; /* no shim: nothing charged */
    return (unsigned long long)used;
}

static void show(const char *name, CUresult rc)
{
    printf("%s=%d:%llu:%llu\n", name, rc, charged(), fake_cuda_debug_held_bytes(0));
}

/* The image of a module of `bytes` on the fake driver (a cubin's code and __device__ globals), and the same
 * written to a file for the loads that take a path. */
static char g_image[64];
static char g_path[] = "/tmp/modmem_redteam.XXXXXX";

static void make_image(unsigned long long bytes)
{
    snprintf(g_image, sizeof g_image, "FAKEMOD:%llu\n", bytes);
    int fd = mkstemp(g_path);
    if (fd < 0 || write(fd, g_image, strlen(g_image)) < 0)
        printf("fail image file\n");
    if (fd >= 0)
        close(fd);
}

static CUresult load(const char *how, CUmodule *m)
{
    if (!strcmp(how, "dataex"))
        return cuModuleLoadDataEx(m, g_image, 0, NULL, NULL);
    if (!strcmp(how, "fatbin"))
        return cuModuleLoadFatBinary(m, g_image);
    if (!strcmp(how, "file"))
        return cuModuleLoad(m, g_path);
    if (!strcmp(how, "proc")) {
        CUresult (*fn)(CUmodule *, const void *) = NULL;
        CUresult rc = cuGetProcAddress("cuModuleLoadData", (void **)&fn, 12000, 0);
        return rc != CUDA_SUCCESS ? rc : fn(m, g_image);
    }
    return cuModuleLoadData(m, g_image);
}

static CUresult load_library(const char *how, CUlibrary *l)
{
    if (!strcmp(how, "file"))
        return cuLibraryLoadFromFile(l, g_path, NULL, NULL, 0, NULL, NULL, 0);
    return cuLibraryLoadData(l, g_image, NULL, NULL, 0, NULL, NULL, 0);
}

/* The first use of library l in the current context (see "lazy" above). */
static CUresult use_library(const char *how, CUlibrary l)
{
    CUmodule m = NULL;
    CUkernel k = NULL;
    CUfunction f = NULL;
    CUdeviceptr p = 0;
    size_t n = 0;
    if (!strcmp(how, "module"))
        return cuLibraryGetModule(&m, l);
    if (!strcmp(how, "global"))
        return cuLibraryGetGlobal(&p, &n, l, "big");
    if (!strcmp(how, "managed"))
        return cuLibraryGetManaged(&p, &n, l, "big");
    CUresult rc = cuLibraryGetKernel(&k, l, "touch_big");
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!strcmp(how, "kernel"))
        return cuKernelGetFunction(&f, k);
    return cuLaunchKernel((CUfunction)k, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
}

struct racer {
    int n, failed;
};

static void *race_libraries(void *arg)
{
    struct racer *r = arg;
    for (int i = 0; i < r->n; i++) {
        CUlibrary l = NULL;
        if (cuLibraryLoadData(&l, g_image, NULL, NULL, 0, NULL, NULL, 0) != CUDA_SUCCESS ||
            cuLibraryUnload(l) != CUDA_SUCCESS)
            r->failed++;
    }
    return NULL;
}

static void *race_contexts(void *arg)
{
    struct racer *r = arg;
    for (int i = 0; i < r->n; i++) {
        CUcontext c = NULL;
        CUmodule m = NULL;
        if (cuCtxCreate_v2(&c, 0, 0) != CUDA_SUCCESS) {
            r->failed++;
            continue;
        }
        if (cuModuleLoadData(&m, g_image) != CUDA_SUCCESS || cuModuleUnload(m) != CUDA_SUCCESS)
            r->failed++;
        if (cuCtxDestroy_v2(c) != CUDA_SUCCESS)
            r->failed++;
    }
    return NULL;
}

/* "inflight": see above. The opener thread lets the load's first listing pass, and the second (its figures
 * taken before the allocation) only once cuMemAlloc returned. */
struct inflight {
    int rfd;
    CUcontext ctx;
    size_t alloc;
    CUresult rc;
    CUdeviceptr p;
    int free_first; /* free p at the opening listing instead of allocating at the closing one */
    char gate[64];
};

static void gate_open(const char *path)
{
    int fd = open(path, O_CREAT | O_WRONLY, 0600);
    if (fd >= 0)
        close(fd);
}

/* The fake driver's notes on stderr, read from a pipe: a note may straddle two reads. */
#define GATE_NOTE "listing waits at the gate"
struct notes {
    int fd;
    size_t have;
    char buf[4096];
};

/* Waits for the next GATE_NOTE; 1 when one came, 0 at the end of the pipe. */
static int next_gate_note(struct notes *n)
{
    for (;;) {
        char *hit = strstr(n->buf, GATE_NOTE);
        if (hit) {
            size_t used = (size_t)(hit - n->buf) + strlen(GATE_NOTE);
            memmove(n->buf, n->buf + used, n->have - used + 1);
            n->have -= used;
            return 1;
        }
        if (n->have > sizeof n->buf / 2) { /* keep the tail */
            memmove(n->buf, n->buf + n->have - 64, 65);
            n->have = 64;
        }
        ssize_t r = read(n->fd, n->buf + n->have, sizeof n->buf - 1 - n->have);
        if (r <= 0)
            return 0;
        n->have += (size_t)r;
        n->buf[n->have] = 0;
    }
}

static void *inflight_opener(void *arg)
{
    struct inflight *f = arg;
    struct notes nt = {.fd = f->rfd};
    cuCtxSetCurrent(f->ctx);
    for (int seen = 1; seen <= 2 && next_gate_note(&nt); seen++) {
        if (seen == 1 && f->free_first) { /* the load's opening reading: its figures are taken */
            f->rc = cuMemFree_v2(f->p);
            f->p = 0;
        } else if (seen == 2 && !f->free_first) { /* the closing one: the allocation comes now */
            f->rc = cuMemAlloc_v2(&f->p, f->alloc);
        }
        gate_open(f->gate);
    }
    return NULL;
}

static int inflight(CUcontext ctx, unsigned long long bytes, size_t alloc, int free_first)
{
    struct inflight f = {.ctx = ctx, .alloc = alloc, .rc = (CUresult)999, .free_first = free_first};
    if (free_first)
        show("before", cuMemAlloc_v2(&f.p, alloc));
    int pfd[2];
    snprintf(f.gate, sizeof f.gate, "/tmp/modmem_gate.%d", (int)getpid());
    unlink(f.gate);
    make_image(bytes);
    fflush(stderr);
    int saved = dup(2);
    if (pipe(pfd) != 0 || saved < 0 || dup2(pfd[1], 2) < 0)
        return 2;
    f.rfd = pfd[0];
    setenv("FAKE_NVML_LIST_GATE", f.gate, 1);
    pthread_t t;
    pthread_create(&t, NULL, inflight_opener, &f);
    CUmodule m = NULL;
    CUresult rc = cuModuleLoadData(&m, g_image);
    unsetenv("FAKE_NVML_LIST_GATE");
    dup2(saved, 2);
    close(pfd[1]); /* the opener sees the end if it did not see two listings */
    pthread_join(t, NULL);
    close(pfd[0]);
    unlink(f.gate);
    show("load", rc);
    show("alloc", f.rc);
    if (rc == CUDA_SUCCESS)
        show("unload", cuModuleUnload(m));
    if (f.p)
        cuMemFree_v2(f.p);
    show("end", CUDA_SUCCESS);
    unlink(g_path);
    return 0;
}

/* "reuse": see above. */
struct reuser {
    int lib;
    CUcontext ctx;
    void *h;
    CUresult rc;
    int done;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

static void *reuse_unload(void *arg)
{
    struct reuser *r = arg;
    cuCtxSetCurrent(r->ctx);
    r->rc = r->lib ? cuLibraryUnload((CUlibrary)r->h) : cuModuleUnload((CUmodule)r->h);
    return NULL;
}

static void *reuse_load(void *arg)
{
    struct reuser *r = arg;
    cuCtxSetCurrent(r->ctx);
    if (r->lib)
        r->rc = cuLibraryLoadData((CUlibrary *)&r->h, g_image, NULL, NULL, 0, NULL, NULL, 0);
    else
        r->rc = cuModuleLoadData((CUmodule *)&r->h, g_image);
    pthread_mutex_lock(&r->mu);
    r->done = 1;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

static int reuse(CUcontext ctx, int lib, unsigned long long small, unsigned long long big, size_t alloc)
{
    struct reuser u = {.lib = lib, .ctx = ctx}, l = {.lib = lib, .ctx = ctx};
    pthread_mutex_init(&l.mu, NULL);
    pthread_cond_init(&l.cv, NULL);
    char gate[64], in[80];
    snprintf(gate, sizeof gate, "/tmp/modmem_unload.%d", (int)getpid());
    snprintf(in, sizeof in, "%s.in", gate);
    unlink(gate);
    unlink(in);
    make_image(small);
    CUresult rc = lib ? cuLibraryLoadData((CUlibrary *)&u.h, g_image, NULL, NULL, 0, NULL, NULL, 0)
                      : cuModuleLoadData((CUmodule *)&u.h, g_image);
    show("load1", rc);
    void *first = u.h;
    snprintf(g_image, sizeof g_image, "FAKEMOD:%llu\n", big);
    setenv("FAKE_CUDA_UNLOAD_GATE", gate, 1);
    pthread_t tu, tl;
    pthread_create(&tu, NULL, reuse_unload, &u);
    while (access(in, F_OK) != 0) /* the unload is in the driver, the memory freed */
        usleep(1000);
    pthread_create(&tl, NULL, reuse_load, &l);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    long long ns = now.tv_nsec + 300000000LL; /* 300 ms from now */
    struct timespec until = {.tv_sec = now.tv_sec + (time_t)(ns / 1000000000LL), .tv_nsec = (long)(ns % 1000000000LL)};
    pthread_mutex_lock(&l.mu); /* the load may wait for the unload: it is let go after 300 ms at most */
    while (!l.done && pthread_cond_timedwait(&l.cv, &l.mu, &until) == 0)
        ;
    pthread_mutex_unlock(&l.mu);
    gate_open(gate);
    pthread_join(tu, NULL);
    pthread_join(tl, NULL);
    unsetenv("FAKE_CUDA_UNLOAD_GATE");
    unlink(gate);
    unlink(in);
    show("unload1", u.rc);
    show("load2", l.rc);
    printf("same=%d\n", l.h == first);
    CUdeviceptr p = 0;
    show("alloc", cuMemAlloc_v2(&p, alloc));
    if (p)
        cuMemFree_v2(p);
    if (l.rc == CUDA_SUCCESS)
        show("unload2", lib ? cuLibraryUnload((CUlibrary)l.h) : cuModuleUnload((CUmodule)l.h));
    show("end", CUDA_SUCCESS);
    unlink(g_path);
    return 0;
}

/* "destroyrace": see above. */
struct destroyer {
    int rfd;
    CUcontext victim;
    CUresult rc;
    char lgate[64], dgate[64], din[80];
};

static void *destroy_victim(void *arg)
{
    struct destroyer *d = arg;
    d->rc = cuCtxDestroy_v2(d->victim);
    return NULL;
}

static void *destroy_opener(void *arg)
{
    struct destroyer *d = arg;
    struct notes nt = {.fd = d->rfd};
    pthread_t t;
    int started = 0;
    for (int seen = 1; seen <= 2 && next_gate_note(&nt); seen++) {
        if (seen == 1) { /* the opening reading's figures are taken: the destroy starts */
            pthread_create(&t, NULL, destroy_victim, d);
            started = 1;
            for (int i = 0; i < 300 && access(d->din, F_OK) != 0; i++) /* in the driver, or held off */
                usleep(1000);
        }
        gate_open(d->lgate);
    }
    if (started) /* finishes once the load returned (destroy_race opens its gate then) */
        pthread_join(t, NULL);
    return NULL;
}

static int destroy_race(CUcontext ctx, unsigned long long bytes, size_t alloc)
{
    struct destroyer d = {.rc = (CUresult)999};
    CUdeviceptr p = 0;
    snprintf(d.lgate, sizeof d.lgate, "/tmp/modmem_lgate.%d", (int)getpid());
    snprintf(d.dgate, sizeof d.dgate, "/tmp/modmem_dgate.%d", (int)getpid());
    snprintf(d.din, sizeof d.din, "%s.in", d.dgate);
    unlink(d.lgate);
    unlink(d.dgate);
    unlink(d.din);
    make_image(bytes);
    show("ctx2", cuCtxCreate_v2(&d.victim, 0, 0));
    show("alloc", cuMemAlloc_v2(&p, alloc));
    cuCtxSetCurrent(ctx);
    int pfd[2];
    fflush(stderr);
    int saved = dup(2);
    if (pipe(pfd) != 0 || saved < 0 || dup2(pfd[1], 2) < 0)
        return 2;
    d.rfd = pfd[0];
    setenv("FAKE_CUDA_DESTROY_GATE", d.dgate, 1);
    setenv("FAKE_NVML_LIST_GATE", d.lgate, 1);
    pthread_t t;
    pthread_create(&t, NULL, destroy_opener, &d);
    CUmodule m = NULL;
    CUresult rc = cuModuleLoadData(&m, g_image);
    unsetenv("FAKE_NVML_LIST_GATE");
    gate_open(d.dgate); /* the load is over: the destroy may finish */
    dup2(saved, 2);
    close(pfd[1]);
    pthread_join(t, NULL);
    close(pfd[0]);
    unsetenv("FAKE_CUDA_DESTROY_GATE");
    unlink(d.lgate);
    unlink(d.dgate);
    unlink(d.din);
    show("load", rc);
    show("destroy", d.rc);
    if (rc == CUDA_SUCCESS)
        show("unload", cuModuleUnload(m));
    show("end", CUDA_SUCCESS);
    unlink(g_path);
    return 0;
}

/* "libfirst": the library loaded before the process's first context (see above). */
static int lib_first(unsigned long long bytes, size_t alloc, int primary)
{
    CUlibrary l = NULL;
    CUcontext c = NULL;
    CUdeviceptr p = 0;
    make_image(bytes);
    printf("load=%d\n", cuLibraryLoadData(&l, g_image, NULL, NULL, 0, NULL, NULL, 0));
    CUresult rc = primary ? cuDevicePrimaryCtxRetain(&c, 0) : cuCtxCreate_v2(&c, 0, 0);
    if (primary && rc == CUDA_SUCCESS)
        cuCtxSetCurrent(c);
    show("ctx", rc);
    if (rc == CUDA_SUCCESS) {
        show("use", use_library("launch", l));
        show("alloc", cuMemAlloc_v2(&p, alloc));
        if (p)
            cuMemFree_v2(p);
    }
    show("unload", cuLibraryUnload(l));
    unlink(g_path);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 4 || rt_start() != 0)
        return 2;
    if (!strcmp(argv[1], "libfirst"))
        return lib_first(strtoull(argv[2], NULL, 10), strtoull(argv[3], NULL, 10),
                         argc > 4 && !strcmp(argv[4], "primary"));
    CUcontext ctx = NULL;
    if (cuCtxCreate_v2(&ctx, 0, 0) != CUDA_SUCCESS) {
        printf("fail ctx\n");
        return 2;
    }
    const char *sc = argv[1];
    if (!strcmp(sc, "destroyrace"))
        return destroy_race(ctx, strtoull(argv[2], NULL, 10), strtoull(argv[3], NULL, 10));
    if (!strcmp(sc, "twice")) {
        CUlibrary l = NULL;
        CUmodule m = NULL;
        CUcontext c2 = NULL;
        CUdeviceptr p = 0;
        make_image(strtoull(argv[2], NULL, 10));
        show("libload", cuLibraryLoadData(&l, g_image, NULL, NULL, 0, NULL, NULL, 0));
        show("lib1", cuLibraryUnload(l));
        show("lib2", cuLibraryUnload(l));
        show("ctx2", cuCtxCreate_v2(&c2, 0, 0));
        show("modload", cuModuleLoadData(&m, g_image));
        show("destroy", cuCtxDestroy_v2(c2));
        cuCtxSetCurrent(ctx);
        show("modgone", cuModuleUnload(m));
        show("modgone2", cuModuleUnload(m));
        show("modload2", cuModuleLoadData(&m, g_image));
        show("mod1", cuModuleUnload(m));
        show("mod2", cuModuleUnload(m));
        show("alloc", cuMemAlloc_v2(&p, strtoull(argv[3], NULL, 10)));
        unlink(g_path);
        return 0;
    }
    if (!strcmp(sc, "reuse") && argc > 5)
        return reuse(ctx, !strcmp(argv[2], "library"), strtoull(argv[3], NULL, 10), strtoull(argv[4], NULL, 10),
                     strtoull(argv[5], NULL, 10));
    if (!strcmp(sc, "inflight"))
        return inflight(ctx, strtoull(argv[2], NULL, 10), strtoull(argv[3], NULL, 10),
                        argc > 4 && !strcmp(argv[4], "free"));
    CUmodule m = NULL;
    CUlibrary l = NULL;
    CUdeviceptr p = 0;
    if (!strcmp(sc, "module") && argc > 4) {
        size_t alloc = strtoull(argv[4], NULL, 10);
        make_image(strtoull(argv[3], NULL, 10));
        CUresult rc = load(argv[2], &m);
        show("load", rc);
        show("alloc", cuMemAlloc_v2(&p, alloc));
        if (p)
            cuMemFree_v2(p);
        p = 0;
        show("unload", rc == CUDA_SUCCESS ? cuModuleUnload(m) : CUDA_SUCCESS);
        show("alloc_after", cuMemAlloc_v2(&p, alloc));
    } else if (!strcmp(sc, "loop") && argc > 4) {
        int n = atoi(argv[2]), failed = 0, drift = 0;
        unsigned long long first = 0;
        make_image(strtoull(argv[3], NULL, 10));
        for (int i = 0; i < n; i++) {
            failed += load("data", &m) != CUDA_SUCCESS;
            if (i == 0)
                first = charged();
            else
                drift += charged() != first;
            failed += cuModuleUnload(m) != CUDA_SUCCESS;
        }
        printf("failed=%d\ndrift=%d\n", failed, drift);
        show("end", CUDA_SUCCESS);
        show("alloc", cuMemAlloc_v2(&p, strtoull(argv[4], NULL, 10)));
    } else if (!strcmp(sc, "ctxgone")) {
        CUcontext c2 = NULL;
        make_image(strtoull(argv[2], NULL, 10));
        show("ctx2", cuCtxCreate_v2(&c2, 0, 0));
        show("load", cuModuleLoadData(&m, g_image));
        show("destroy", cuCtxDestroy_v2(c2));
        cuCtxSetCurrent(ctx);
        show("alloc", cuMemAlloc_v2(&p, strtoull(argv[3], NULL, 10)));
    } else if (!strcmp(sc, "library") && argc > 4) {
        size_t alloc = strtoull(argv[4], NULL, 10);
        make_image(strtoull(argv[3], NULL, 10));
        CUresult rc = load_library(argv[2], &l);
        show("load", rc);
        show("alloc", cuMemAlloc_v2(&p, alloc));
        if (p)
            cuMemFree_v2(p);
        p = 0;
        show("unload", rc == CUDA_SUCCESS ? cuLibraryUnload(l) : CUDA_SUCCESS);
        show("alloc_after", cuMemAlloc_v2(&p, alloc));
    } else if (!strcmp(sc, "lazy") && argc > 4) {
        size_t alloc = strtoull(argv[4], NULL, 10);
        make_image(strtoull(argv[3], NULL, 10));
        CUresult rc = cuLibraryLoadData(&l, g_image, NULL, NULL, 0, NULL, NULL, 0);
        show("load", rc);
        if (rc == CUDA_SUCCESS)
            show("use", use_library(argv[2], l));
        show("alloc", cuMemAlloc_v2(&p, alloc));
        if (p)
            cuMemFree_v2(p);
        p = 0;
        show("unload", rc == CUDA_SUCCESS ? cuLibraryUnload(l) : CUDA_SUCCESS);
        show("alloc_after", cuMemAlloc_v2(&p, alloc));
    } else if (!strcmp(sc, "lazyother")) {
        CUcontext c2 = NULL;
        make_image(strtoull(argv[2], NULL, 10));
        int primary = argc > 4 && !strcmp(argv[4], "primary");
        show("ctx2", primary ? cuDevicePrimaryCtxRetain(&c2, 0) : cuCtxCreate_v2(&c2, 0, 0));
        /* the second context exists but is not current at the load */
        cuCtxSetCurrent(argc > 5 && !strcmp(argv[5], "nocur") ? NULL : ctx);
        CUresult rc = cuLibraryLoadData(&l, g_image, NULL, NULL, 0, NULL, NULL, 0);
        show("load", rc);
        cuCtxSetCurrent(c2);
        if (rc == CUDA_SUCCESS)
            show("use2", use_library("launch", l));
        show("alloc", cuMemAlloc_v2(&p, strtoull(argv[3], NULL, 10)));
        if (p)
            cuMemFree_v2(p);
        show("unload", rc == CUDA_SUCCESS ? cuLibraryUnload(l) : CUDA_SUCCESS);
    } else if (!strcmp(sc, "libloop") && argc > 4) {
        int n = atoi(argv[2]), failed = 0, drift = 0;
        unsigned long long first = 0;
        make_image(strtoull(argv[3], NULL, 10));
        for (int i = 0; i < n; i++) {
            failed += cuLibraryLoadData(&l, g_image, NULL, NULL, 0, NULL, NULL, 0) != CUDA_SUCCESS;
            failed += use_library("launch", l) != CUDA_SUCCESS;
            if (i == 0)
                first = charged();
            else
                drift += charged() != first;
            failed += cuLibraryUnload(l) != CUDA_SUCCESS;
        }
        printf("failed=%d\ndrift=%d\n", failed, drift);
        show("end", CUDA_SUCCESS);
        show("alloc", cuMemAlloc_v2(&p, strtoull(argv[4], NULL, 10)));
    } else if (!strcmp(sc, "race")) {
        make_image(strtoull(argv[3], NULL, 10));
        struct racer r[2] = {{atoi(argv[2]), 0}, {atoi(argv[2]), 0}};
        pthread_t t[2];
        pthread_create(&t[0], NULL, race_libraries, &r[0]);
        pthread_create(&t[1], NULL, race_contexts, &r[1]);
        for (int i = 0; i < 2; i++)
            pthread_join(t[i], NULL);
        cuCtxSetCurrent(ctx);
        printf("failed=%d\n", r[0].failed + r[1].failed);
        show("end", CUDA_SUCCESS);
    } else if (!strcmp(sc, "libnoctx")) {
        make_image(strtoull(argv[2], NULL, 10));
        show("destroy", cuCtxDestroy_v2(ctx));
        CUresult rc = cuLibraryLoadData(&l, g_image, NULL, NULL, 0, NULL, NULL, 0);
        printf("load=%d\n", rc);
        CUcontext c2 = NULL;
        int primary = argc > 4 && !strcmp(argv[4], "primary");
        rc = primary ? cuDevicePrimaryCtxRetain(&c2, 0) : cuCtxCreate_v2(&c2, 0, 0);
        if (primary && rc == CUDA_SUCCESS)
            cuCtxSetCurrent(c2);
        show("ctx", rc);
        if (rc == CUDA_SUCCESS) {
            show("alloc", cuMemAlloc_v2(&p, strtoull(argv[3], NULL, 10)));
            if (p)
                cuMemFree_v2(p);
        }
        show("unload", cuLibraryUnload(l));
    } else {
        printf("fail usage\n");
        return 2;
    }
    if (g_path[strlen(g_path) - 1] != 'X')
        unlink(g_path);
    return 0;
}
