/* kvf_rxhash.h: object checksums computed while a GET reply's objects land
 * (kvf_recv_objects in kvf_client.c, the native client's receive path).
 *
 * A cursor walks the objects' buffers in stream order: after each receive
 * call the bytes it wrote are fed in (kvf_rxhash_feed), while they are still
 * in this core's cache, into one streaming xxh3 state per object in turn;
 * digests[i] gets object i's checksum (kvf_hash.h: xxh3_64(value, seed =
 * xxh3_64(key))) once its last byte is in. Misses (sizes[i] < 0) are skipped
 * and their digest left alone. The layout is kvf_recv_objects': object i owns
 * nseg[i] (NULL: 1) consecutive entries of bufs/buf_lens and fills them in
 * order; the sizes add up to the payload and each object fits its entries
 * (checked by the caller first).
 */
#ifndef KVF_RXHASH_H
#define KVF_RXHASH_H

#include <stddef.h>
#include <stdint.h>

struct kvf_rxhash {
    const int64_t *sizes;
    void *const *bufs;
    const size_t *buf_lens;
    const uint32_t *nseg;
    uint32_t n;
    const void *const *keys;
    const size_t *key_lens;
    uint64_t *digests;
    void *state;    /* the streaming xxh3 state */
    uint32_t i;     /* current object */
    size_t first;   /* index in bufs of object i's first segment */
    uint32_t seg;   /* segment of object i being filled */
    size_t seg_off; /* bytes of that segment hashed */
    uint64_t left;  /* bytes of object i not hashed yet */
    int open;       /* state reset for object i */
};

/* Start a cursor at the payload's first byte; the arrays must outlive it.
 * 0, or -ENOMEM (nothing to close). */
int kvf_rxhash_open(struct kvf_rxhash *h, const int64_t *sizes, void *const *bufs, const size_t *buf_lens,
                    const uint32_t *nseg, uint32_t n, const void *const *keys, const size_t *key_lens,
                    uint64_t *digests);
/* The next len bytes of the payload have landed in the buffers: hash them. */
void kvf_rxhash_feed(struct kvf_rxhash *h, size_t len);
/* After the whole payload: digest the empty objects that follow the last byte. */
void kvf_rxhash_finish(struct kvf_rxhash *h);
void kvf_rxhash_close(struct kvf_rxhash *h);

#endif
