/* Workspace allocation for the kernels: aligned blocks, and a small cache
 * of freed large ones.
 *
 * Why a cache: every call packs weights and builds chunks in buffers of a
 * few hundred KiB to tens of MiB.  glibc serves those with mmap and gives
 * them back with munmap, so each call page-faults its workspace in again;
 * in the VMs we measure on a fault costs ~1.5 us, which made a batch-1
 * Winograd 3x3 64->64 @56 take 1.7-2.9 ms instead of 0.5 (4.7 MiB of
 * workspace, 1,150 faults per call).  Freed blocks of at least
 * FC_POOL_MIN_BYTES are kept (up to FC_POOL_SLOTS blocks and
 * FC_POOL_MAX_BYTES in all, least recently returned evicted first; evicting
 * the largest instead thrashed when stale blocks of earlier layers filled
 * the slots: every call then evicted the block it needed next, 2x slower
 * on a 512-channel backward) and handed to the next
 * request they fit without wasting more than half of them.  Blocks are
 * taken under a mutex, so concurrent calls never share one.  The cap
 * covers one call's working set on the largest layers we measure: ResNet's
 * 3x3 512->512 at batch 8, backward, keeps 67 MiB (Winograd filters 38 MiB,
 * grad-weight accumulators 19 MiB, chunks); under a 64 MiB cap its blocks
 * were evicted and faulted in again every call (9,200 faults, +10 ms).
 *
 * Each ISA module includes this and has its own cache; only the module in
 * use fills it.
 */
#ifndef FASTCONV_WORKSPACE_H
#define FASTCONV_WORKSPACE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define FC_ALIGN 64
#define FC_POOL_SLOTS 16
#define FC_POOL_MIN_BYTES ((size_t)128 << 10)
#define FC_POOL_MAX_BYTES ((size_t)128 << 20)

typedef struct {
    void *raw;          /* what malloc returned */
    size_t capacity;    /* usable bytes from the aligned pointer */
} fc_block;

static fc_block fc_pool[FC_POOL_SLOTS];
static size_t fc_pool_count, fc_pool_bytes;
static pthread_mutex_t fc_pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t fc_pool_once = PTHREAD_ONCE_INIT;

/* A child of fork() may inherit the mutex locked by a parent thread that
 * does not exist in it: start the child with a fresh one. */
static void fc_pool_after_fork(void)
{
    pthread_mutex_init(&fc_pool_lock, NULL);
}

static void fc_pool_init(void)
{
    pthread_atfork(NULL, NULL, fc_pool_after_fork);
}

/* Slot i out of the pool, keeping the others in the order they were
 * returned (oldest first): eviction takes the oldest, so blocks of layers
 * no longer running go first and the current layer's stay.  Call with the
 * lock held. */
static void fc_pool_remove(size_t i)
{
    fc_pool_bytes -= fc_pool[i].capacity;
    for (; i + 1 < fc_pool_count; i++)
        fc_pool[i] = fc_pool[i + 1];
    fc_pool_count--;
}

/* The block header sits just below the aligned pointer. */
static inline fc_block *fc_header(void *p)
{
    return (fc_block *)p - 1;
}

static void *fc_align_block(fc_block b)
{
    uintptr_t p = ((uintptr_t)b.raw + sizeof(fc_block) + FC_ALIGN - 1)
                  & ~(uintptr_t)(FC_ALIGN - 1);
    *fc_header((void *)p) = b;
    return (void *)p;
}

static void *fc_ws_alloc(size_t nbytes)
{
    if (nbytes >= FC_POOL_MIN_BYTES) {
        size_t i, best = FC_POOL_SLOTS;
        pthread_once(&fc_pool_once, fc_pool_init);
        pthread_mutex_lock(&fc_pool_lock);
        for (i = 0; i < fc_pool_count; i++)   /* the smallest that fits */
            if (fc_pool[i].capacity >= nbytes && fc_pool[i].capacity / 2 <= nbytes
                && (best == FC_POOL_SLOTS || fc_pool[i].capacity < fc_pool[best].capacity))
                best = i;
        if (best != FC_POOL_SLOTS) {
            fc_block b = fc_pool[best];
            fc_pool_remove(best);
            pthread_mutex_unlock(&fc_pool_lock);
            return fc_align_block(b);
        }
        pthread_mutex_unlock(&fc_pool_lock);
    }
    fc_block b;
    b.raw = malloc(nbytes + sizeof(fc_block) + FC_ALIGN);
    if (b.raw == NULL)
        return NULL;
    b.capacity = nbytes;
    return fc_align_block(b);
}

static void fc_ws_free(void *p)
{
    if (p == NULL)
        return;
    fc_block b = *fc_header(p);
    if (b.capacity >= FC_POOL_MIN_BYTES && b.capacity <= FC_POOL_MAX_BYTES) {
        pthread_once(&fc_pool_once, fc_pool_init);
        pthread_mutex_lock(&fc_pool_lock);
        while (fc_pool_count > 0 && (fc_pool_count == FC_POOL_SLOTS
                                     || fc_pool_bytes + b.capacity > FC_POOL_MAX_BYTES)) {
            void *oldest = fc_pool[0].raw;    /* least recently returned */
            fc_pool_remove(0);
            free(oldest);
        }
        fc_pool[fc_pool_count++] = b;
        fc_pool_bytes += b.capacity;
        pthread_mutex_unlock(&fc_pool_lock);
        return;
    }
    free(b.raw);
}

/* Frees every cached block; returns the bytes released. */
static size_t fc_ws_release_cache(void)
{
    size_t released;
    pthread_once(&fc_pool_once, fc_pool_init);
    pthread_mutex_lock(&fc_pool_lock);
    released = fc_pool_bytes;
    while (fc_pool_count > 0)
        free(fc_pool[--fc_pool_count].raw);
    fc_pool_bytes = 0;
    pthread_mutex_unlock(&fc_pool_lock);
    return released;
}

static size_t fc_ws_cached_bytes(void)
{
    size_t n;
    pthread_once(&fc_pool_once, fc_pool_init);
    pthread_mutex_lock(&fc_pool_lock);
    n = fc_pool_bytes;
    pthread_mutex_unlock(&fc_pool_lock);
    return n;
}

#endif
