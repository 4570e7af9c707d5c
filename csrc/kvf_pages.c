/* kvf_pages.c: the arena's page allocator (see kvf_pages.h). */
#include "kvf_pages.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define NONE KVF_PAGES_NONE
#define BIN_SCAN 16

static inline int bin_of(uint32_t n) { return 31 - __builtin_clz(n); }

static void add_free(struct kvf_pages *p, uint32_t start, uint32_t n)
{
    int b = bin_of(n);
    p->run_len[start] = n;
    p->run_start[start + n - 1] = start;
    p->fprev[start] = NONE;
    p->fnext[start] = p->bins[b];
    if (p->bins[b] != NONE) p->fprev[p->bins[b]] = start;
    p->bins[b] = start;
    p->free += n;
}

static void remove_free(struct kvf_pages *p, uint32_t start)
{
    uint32_t n = p->run_len[start];
    int b = bin_of(n);
    if (p->fprev[start] != NONE) p->fnext[p->fprev[start]] = p->fnext[start];
    else p->bins[b] = p->fnext[start];
    if (p->fnext[start] != NONE) p->fprev[p->fnext[start]] = p->fprev[start];
    p->run_len[start] = 0;
    p->run_start[start + n - 1] = NONE;
    p->free -= n;
}

int kvf_pages_init(struct kvf_pages *p, uint32_t npages)
{
    if (npages == 0 || npages == NONE) return -EINVAL;
    memset(p, 0, sizeof *p);
    p->npages = npages;
    p->run_len = calloc(npages, sizeof(uint32_t));
    p->run_start = malloc(npages * sizeof(uint32_t));
    p->fnext = malloc(npages * sizeof(uint32_t));
    p->fprev = malloc(npages * sizeof(uint32_t));
    if (!p->run_len || !p->run_start || !p->fnext || !p->fprev) return -ENOMEM;
    memset(p->run_start, 0xff, npages * sizeof(uint32_t));
    for (int b = 0; b < KVF_PAGES_BINS; b++) p->bins[b] = NONE;
    add_free(p, 0, npages);
    return 0;
}

void kvf_pages_destroy(struct kvf_pages *p)
{
    free(p->run_len); free(p->run_start); free(p->fnext); free(p->fprev);
    p->run_len = p->run_start = p->fnext = p->fprev = NULL;
}

uint32_t kvf_pages_alloc(struct kvf_pages *p, uint32_t n)
{
    int b = bin_of(n);
    uint32_t found = NONE;
    int k = 0;
    for (uint32_t s = p->bins[b]; s != NONE && k < BIN_SCAN; s = p->fnext[s], k++) {
        if (p->run_len[s] >= n) { found = s; break; }
    }
    for (int bb = b + 1; found == NONE && bb < KVF_PAGES_BINS; bb++)
        if (p->bins[bb] != NONE) found = p->bins[bb];
    if (found == NONE) return NONE;
    uint32_t len = p->run_len[found];
    remove_free(p, found);
    if (len > n) add_free(p, found + n, len - n);
    return found;
}

void kvf_pages_free(struct kvf_pages *p, uint32_t start, uint32_t n)
{
    if (start > 0 && p->run_start[start - 1] != NONE) {
        uint32_t ls = p->run_start[start - 1];
        uint32_t ln = p->run_len[ls];
        remove_free(p, ls);
        start = ls;
        n += ln;
    }
    uint32_t end = start + n;
    if (end < p->npages && p->run_len[end]) {
        uint32_t rn = p->run_len[end];
        remove_free(p, end);
        n += rn;
    }
    add_free(p, start, n);
}

int kvf_pages_check(const struct kvf_pages *p)
{
    uint64_t total = 0;
    for (int b = 0; b < KVF_PAGES_BINS; b++) {
        for (uint32_t s = p->bins[b]; s != NONE; s = p->fnext[s]) {
            uint32_t n = p->run_len[s];
            if (n == 0 || bin_of(n) != b || p->run_start[s + n - 1] != s) return -EFAULT;
            if (s + n < p->npages && p->run_len[s + n]) return -EFAULT; /* unmerged neighbour */
            total += n;
        }
    }
    return total == p->free ? 0 : -EFAULT;
}
