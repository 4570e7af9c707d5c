/* kvf_pages.h: the arena's page allocator (segregated fit, boundary tags).
 *
 * Free runs of pages are kept in 32 bins by floor(log2(npages)), as doubly
 * linked lists threaded through per-page arrays. run_len[start] holds a free
 * run's length at its first page and run_start[end] its first page at its
 * last page (KVF_PAGES_NONE elsewhere), so a freed run merges with free
 * neighbours in O(1). An allocation of n pages scans a few runs of n's own bin
 * for a fit, else takes the head of any larger bin (all fit) and splits it.
 * Every object wastes < 1 page; with one object size (the KV-cache case)
 * freed slots are reused exactly. Not locked: the store (kvf_store.c) calls
 * it under its own mutex.
 */
#ifndef KVF_PAGES_H
#define KVF_PAGES_H

#include <stdint.h>

#define KVF_PAGES_NONE 0xffffffffu
#define KVF_PAGES_BINS 32

struct kvf_pages {
    uint32_t npages, free; /* pages in all, pages in free runs */
    uint32_t *run_len, *run_start, *fnext, *fprev;
    uint32_t bins[KVF_PAGES_BINS];
};

/* npages (1..KVF_PAGES_NONE-1) pages, all free; -ENOMEM. kvf_pages_destroy frees
 * what init allocated, also after a failed init (on a zeroed struct). */
int kvf_pages_init(struct kvf_pages *p, uint32_t npages);
void kvf_pages_destroy(struct kvf_pages *p);
/* The first page of a run of n >= 1 pages, or KVF_PAGES_NONE when no free run fits. */
uint32_t kvf_pages_alloc(struct kvf_pages *p, uint32_t n);
/* Gives back the n pages at start (as allocated), merged with free neighbours. */
void kvf_pages_free(struct kvf_pages *p, uint32_t start, uint32_t n);
/* 0 when every bin holds well-formed, fully merged runs that add up to p->free; -EFAULT otherwise. */
int kvf_pages_check(const struct kvf_pages *p);

#endif
