/* kvf_rxhash.c: object checksums computed while a GET reply lands (see kvf_rxhash.h). */
#include "kvf_rxhash.h"

#include "kvf_hash.h"

#include <errno.h>
#include <string.h>

int kvf_rxhash_open(struct kvf_rxhash *h, const int64_t *sizes, void *const *bufs, const size_t *buf_lens,
                    const uint32_t *nseg, uint32_t n, const void *const *keys, const size_t *key_lens,
                    uint64_t *digests)
{
    memset(h, 0, sizeof *h);
    h->sizes = sizes;
    h->bufs = bufs;
    h->buf_lens = buf_lens;
    h->nseg = nseg;
    h->n = n;
    h->keys = keys;
    h->key_lens = key_lens;
    h->digests = digests;
    h->state = kvf_hash_new();
    return h->state ? 0 : -ENOMEM;
}

/* Finish every object that needs no more bytes (misses skipped, empty
 * objects digested) and open the next one that does. */
static void settle(struct kvf_rxhash *h)
{
    while (h->i < h->n) {
        if (h->sizes[h->i] >= 0) {
            if (!h->open) {
                kvf_hash_reset_key(h->state, h->keys[h->i], h->key_lens[h->i]);
                h->open = 1;
                h->left = (uint64_t)h->sizes[h->i];
                h->seg = 0;
                h->seg_off = 0;
            }
            if (h->left) return;
            h->digests[h->i] = kvf_hash_digest(h->state);
        }
        h->first += h->nseg ? h->nseg[h->i] : 1;
        h->i++;
        h->open = 0;
    }
}

void kvf_rxhash_feed(struct kvf_rxhash *h, size_t len)
{
    while (len) {
        settle(h);
        if (h->i >= h->n) return; /* cannot happen: the sizes add up to the payload */
        size_t cap = h->buf_lens[h->first + h->seg];
        if (h->seg_off >= cap) { h->seg++; h->seg_off = 0; continue; }
        size_t take = cap - h->seg_off;
        if (take > len) take = len;
        if (take > h->left) take = (size_t)h->left;
        kvf_hash_update(h->state, (const char *)h->bufs[h->first + h->seg] + h->seg_off, take);
        h->seg_off += take;
        h->left -= take;
        len -= take;
    }
    settle(h);
}

void kvf_rxhash_finish(struct kvf_rxhash *h) { settle(h); }

void kvf_rxhash_close(struct kvf_rxhash *h)
{
    kvf_hash_free(h->state);
    h->state = NULL;
}
