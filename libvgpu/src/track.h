/*
 * The per-process tracking table (track.c): what this process allocated, keyed by (kind, key), so a
 * free subtracts exactly what its allocation added; plus the list of VMM mappings (cuMemMap).
 *
 * Locking: one mutex, the track lock, guards the table and the mapping list. track_put, track_get and
 * track_take take it themselves (call them without it). Every function named *_locked must be called
 * with it held (track_lock() ... track_unlock()), and an entry returned by track_find_locked is valid
 * only until the lock is released or the table changes. memory.c also keeps its pool accounts under
 * this lock, since a context teardown settles pool memory while it walks the table.
 */
#ifndef LIBVGPU_TRACK_H
#define LIBVGPU_TRACK_H

#include "vgpu.h"

/* kinds of tracked objects: allocations (memory.c), graph costs (limiter.c) and what an executable graph's
 * allocation nodes can take (TK_GRAPHMEM, memory.c: per CUDA ordinal, and the ordinals in the exec's own maps);
 * the device memory of loaded modules (TK_MODULE, per module), of loaded libraries (TK_LIBRARY, per library
 * and container GPU) and of the copies of libraries a context created while they were loaded holds
 * (TK_LIBCTX, per context), memory.c "modules and libraries" */
enum { TK_PTR = 1, TK_ARRAY, TK_MIPMAP, TK_HANDLE, TK_GRAPHEXEC, TK_POOL, TK_CTX, TK_LIMIT, TK_GRAPHMEM,
       TK_MODULE, TK_LIBRARY, TK_LIBCTX };

struct track_entry {
    uint64_t key;
    uint64_t size;
    CUcontext ctx;
    int16_t dev;
    uint8_t kind;     /* 0 = empty */
    uint8_t released; /* TK_HANDLE: cuMemRelease done, physical memory lives on while mapped */
    uint32_t maps;    /* TK_HANDLE: live mappings */
    uint16_t pool;    /* TK_PTR from a memory pool: index + 1 in memory.c's pool accounts */
    uint32_t refs;    /* TK_HANDLE: references beyond the creating one (cuMemRetainAllocationHandle) */
    uint8_t exported; /* TK_HANDLE: exported as a shareable handle, which keeps the memory alive */
    uint32_t exporting; /* TK_HANDLE: exports in the driver now (the handle is kept until they return) */
};

/* Take themselves the track lock. put: records (or updates) an entry, 0 or -1 out of memory.
 * get: 1 and its size/dev (each may be NULL) when present. take: as get (neither NULL), and removes it. */
int track_put(int kind, uint64_t key, uint64_t size, int dev, CUcontext ctx);
int track_get(int kind, uint64_t key, uint64_t *size, int *dev);
int track_take(int kind, uint64_t key, uint64_t *size, int *dev);

void track_lock(void);
void track_unlock(void);

/* Called with the track lock held. */
struct track_entry *track_find_locked(int kind, uint64_t key); /* NULL: not tracked */
void track_remove_locked(struct track_entry *e);
/* Removes every entry for which drop(e, arg) returns 1 (drop is called with the lock held). */
void track_remove_if_locked(int (*drop)(struct track_entry *e, void *arg), void *arg);
/* Records a mapping of handle at [va, va + size): 0, or -1 when it cannot be recorded (out of memory). */
int track_map_add_locked(uint64_t va, uint64_t size, uint64_t handle);
/* The handle of the recorded mapping holding address va: 1 (and *handle), or 0 when none does. */
int track_map_find_locked(uint64_t va, uint64_t *handle);
/* Forgets every mapping whose start lies in [va, va + size), calling unmapped(handle, arg) for each. */
void track_unmap_range_locked(uint64_t va, uint64_t size, void (*unmapped)(uint64_t handle, void *arg), void *arg);

/* In a forked child (no other thread): a fresh lock, an empty table, no mappings. */
void track_after_fork_child(void);

#endif
