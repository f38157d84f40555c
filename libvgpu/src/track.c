/*
 * The per-process tracking table (see track.h for the locking contract): an open-addressing hash
 * table of (kind, key) -> size, device, context, with backward-shift deletion, and the list of VMM
 * mappings (few, and cuMemUnmap may cover several, so a plain array).
 */
#include "track.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t g_tmu = PTHREAD_MUTEX_INITIALIZER;
/* VMM mappings (under g_tmu) */
struct vmap {
    uint64_t va, size, handle;
};
static struct vmap *g_maps;
static size_t g_nmaps, g_capmaps;
static struct track_entry *g_tab;
static size_t g_cap; /* power of two */
static size_t g_cnt;

void track_lock(void)
{
    pthread_mutex_lock(&g_tmu);
}

void track_unlock(void)
{
    pthread_mutex_unlock(&g_tmu);
}

static inline size_t slot_of(int kind, uint64_t key)
{
    uint64_t k = key * 0x9e3779b97f4a7c15ull + (uint64_t)kind;
    k ^= k >> 29;
    return (size_t)k & (g_cap - 1);
}

struct track_entry *track_find_locked(int kind, uint64_t key)
{
    if (!g_tab)
        return NULL;
    for (size_t i = slot_of(kind, key);; i = (i + 1) & (g_cap - 1)) {
        struct track_entry *e = &g_tab[i];
        if (!e->kind)
            return NULL;
        if (e->kind == kind && e->key == key)
            return e;
    }
}

static void t_insert_raw(struct track_entry *tab, size_t cap, const struct track_entry *src)
{
    uint64_t k = src->key * 0x9e3779b97f4a7c15ull + (uint64_t)src->kind;
    k ^= k >> 29;
    for (size_t i = (size_t)k & (cap - 1);; i = (i + 1) & (cap - 1)) {
        if (!tab[i].kind) {
            tab[i] = *src;
            return;
        }
    }
}

static int t_grow(void)
{
    size_t ncap = g_cap ? g_cap * 2 : 4096;
    struct track_entry *nt = calloc(ncap, sizeof *nt);
    if (!nt)
        return -1;
    for (size_t i = 0; i < g_cap; i++)
        if (g_tab[i].kind)
            t_insert_raw(nt, ncap, &g_tab[i]);
    free(g_tab);
    g_tab = nt;
    g_cap = ncap;
    return 0;
}

void track_remove_locked(struct track_entry *e)
{
    size_t i = (size_t)(e - g_tab);
    g_tab[i].kind = 0;
    g_cnt--;
    size_t j = i;
    for (;;) {
        j = (j + 1) & (g_cap - 1);
        if (!g_tab[j].kind)
            return;
        size_t h = slot_of(g_tab[j].kind, g_tab[j].key);
        int move = (j > i) ? (h <= i || h > j) : (h <= i && h > j);
        if (move) {
            g_tab[i] = g_tab[j];
            g_tab[j].kind = 0;
            i = j;
        }
    }
}

void track_remove_if_locked(int (*drop)(struct track_entry *e, void *arg), void *arg)
{
    for (size_t i = 0; i < g_cap;) {
        struct track_entry *e = &g_tab[i];
        if (e->kind && drop(e, arg)) {
            track_remove_locked(e); /* may move a later entry into i: look at i again */
            continue;
        }
        i++;
    }
}

int track_put(int kind, uint64_t key, uint64_t size, int dev, CUcontext ctx)
{
    pthread_mutex_lock(&g_tmu);
    if ((g_cnt + 1) * 2 > g_cap && t_grow() != 0) {
        pthread_mutex_unlock(&g_tmu);
        return -1;
    }
    struct track_entry *e = track_find_locked(kind, key);
    if (!e) {
        struct track_entry n = {.key = key, .size = size, .ctx = ctx, .dev = (int16_t)dev, .kind = (uint8_t)kind,
                                .released = 0, .maps = 0, .pool = 0};
        t_insert_raw(g_tab, g_cap, &n);
        g_cnt++;
    } else {
        e->size = size;
        e->dev = (int16_t)dev;
        e->ctx = ctx;
    }
    pthread_mutex_unlock(&g_tmu);
    return 0;
}

int track_get(int kind, uint64_t key, uint64_t *size, int *dev)
{
    pthread_mutex_lock(&g_tmu);
    struct track_entry *e = track_find_locked(kind, key);
    if (e) {
        if (size)
            *size = e->size;
        if (dev)
            *dev = e->dev;
    }
    pthread_mutex_unlock(&g_tmu);
    return e != NULL;
}

int track_take(int kind, uint64_t key, uint64_t *size, int *dev)
{
    pthread_mutex_lock(&g_tmu);
    struct track_entry *e = track_find_locked(kind, key);
    if (e) {
        *size = e->size;
        *dev = e->dev;
        track_remove_locked(e);
    }
    pthread_mutex_unlock(&g_tmu);
    return e != NULL;
}

int track_map_add_locked(uint64_t va, uint64_t size, uint64_t handle)
{
    if (g_nmaps == g_capmaps) {
        size_t ncap = g_capmaps ? g_capmaps * 2 : 64;
        struct vmap *n = realloc(g_maps, ncap * sizeof *n);
        if (n) {
            g_maps = n;
            g_capmaps = ncap;
        }
    }
    if (g_nmaps < g_capmaps) {
        g_maps[g_nmaps++] = (struct vmap){va, size, handle};
        return 0;
    }
    return -1;
}

int track_map_find_locked(uint64_t va, uint64_t *handle)
{
    for (size_t i = 0; i < g_nmaps; i++)
        if (va >= g_maps[i].va && va - g_maps[i].va < g_maps[i].size) {
            *handle = g_maps[i].handle;
            return 1;
        }
    return 0;
}

void track_unmap_range_locked(uint64_t va, uint64_t size, void (*unmapped)(uint64_t handle, void *arg), void *arg)
{
    for (size_t i = 0; i < g_nmaps;) {
        struct vmap *m = &g_maps[i];
        if (m->va >= va && m->va < va + size) {
            unmapped(m->handle, arg);
            *m = g_maps[--g_nmaps];
            continue;
        }
        i++;
    }
}

void track_after_fork_child(void)
{
    /* the child owns none of the parent's device memory */
    pthread_mutex_init(&g_tmu, NULL);
    if (g_tab)
        memset(g_tab, 0, g_cap * sizeof *g_tab);
    g_cnt = 0;
    g_nmaps = 0;
}
