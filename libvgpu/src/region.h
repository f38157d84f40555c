/*
 * Layout of the shared accounting file (the limits file's shared_cache, else
 * $CUDA_DEVICE_MEMORY_SHARED_CACHE), version 2.
 * All processes of one container map it. Native byte order (little-endian on x86-64/arm64).
 * libvgpu/region.py reads the same layout; keep both in step (bump VGPU_REGION_VERSION).
 */
#ifndef LIBVGPU_REGION_H
#define LIBVGPU_REGION_H

#include <stdint.h>
#include <pthread.h>

#define VGPU_REGION_MAGIC 0x55504756u /* "VGPU" */
#define VGPU_REGION_VERSION 2u
#define VGPU_REGION_DEVS 16
#define VGPU_REGION_SLOTS 1024

struct vgpu_slot {
    int32_t pid;                      /* 0 = free; the pid in the namespace of the /proc mount (NSpid[0]) */
    int32_t flags;
    uint64_t start_time;              /* /proc/<pid>/stat starttime, detects pid reuse */
    uint64_t used[VGPU_REGION_DEVS];  /* bytes accounted to this process, per container GPU */
    uint64_t reserved[4];             /* [0]: st_dev of /proc/self + 1 (which /proc the pid is valid in);
                                         [1]: the pid NVML reports for the process (host pid), 0 = unknown;
                                         [2]: task priority + 1 (1 = high, 2 = low), 0 = unset */
};
/* Version 2: pid is NSpid[0] (was getpid()), reserved[0] names the /proc, and a live process holds an
 * open-file-description lock (F_OFD_SETLK) on byte 2^32 + slot index of the file. */

struct vgpu_region {
    uint32_t magic;                      /* 0   */
    uint32_t version;                    /* 4   */
    uint64_t size;                       /* 8   sizeof(struct vgpu_region) */
    uint32_t ndev;                       /* 16  VGPU_REGION_DEVS */
    uint32_t nslots;                     /* 20  VGPU_REGION_SLOTS */
    uint64_t limit[VGPU_REGION_DEVS];    /* 24  bytes, 0 = none */
    uint32_t sm_limit[VGPU_REGION_DEVS]; /* 152 percent, 0 = none */
    uint64_t used[VGPU_REGION_DEVS];     /* 216 bytes, sum over slots */
    union {
        pthread_mutex_t mu;              /* 344 robust, process-shared */
        uint64_t pad[8];
    } lock;
    uint64_t recoveries;                 /* 408 times a dead lock owner was recovered */
    uint64_t oom_refusals;               /* 416 allocations and limits refused past the limit, all devices */
    uint64_t ctx_cost_any;               /* 424 not read (an earlier shim kept one cost for all GPUs here) */
    uint16_t ctx_cost_mib[VGPU_REGION_DEVS]; /* 432 per container GPU: the largest context cost a process of
                                            the container measured there with its own pid known (MiB, rounded
                                            up; 0 = none yet); cleared when a process opens the file and no
                                            process of the container is alive */
    uint64_t reserved[1];                /* 464 */
    struct vgpu_slot slots[VGPU_REGION_SLOTS]; /* 472 */
};

_Static_assert(sizeof(pthread_mutex_t) <= 64, "mutex fits");
_Static_assert(__builtin_offsetof(struct vgpu_region, lock) == 344, "layout");
_Static_assert(__builtin_offsetof(struct vgpu_region, ctx_cost_mib) == 432, "layout");
_Static_assert(__builtin_offsetof(struct vgpu_region, slots) == 472, "layout");
_Static_assert(sizeof(struct vgpu_slot) == 176, "layout");

#endif
