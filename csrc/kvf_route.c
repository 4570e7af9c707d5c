/* kvf_route.c: rendezvous (highest-random-weight) owners of a batch of keys.
 *
 * The spec is kvfabric/sharding.py (docs/ARCHITECTURE.md "Sharding"): each
 * server scores each key with xxh3_64(key, seed = xxh3_64(server id)); the
 * owners are the top `replicas` scores, ties to the lower server index. The
 * Python reference sorts (-score, index) pairs; here one pass per key keeps
 * the best `replicas` in a small array by insertion, which gives the same
 * order: a new score moves only past strictly smaller ones, so of two equal
 * scores the earlier (lower index) server stays first, and a score equal to
 * the worst kept one does not displace it.
 *
 * A key equal to the one before it (a placement key repeated for every part
 * of a group, kvfabric.Client's `placement=`) is not hashed again: its owners
 * are the previous key's, which is what hashing it again would give.
 *
 * Keys are short (block keys are 16 bytes, at most 64), where xxh3 takes its
 * scalar short-input paths, so the inlined copy of xxHash is used directly
 * (the x86 dispatch of kvf_hash.c only matters above 240 bytes).
 */
#include "kvf_route.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

/* Whether key k is the same bytes as key k - 1 (k > 0). */
static int same_as_previous(const struct kvf_route_key *keys, size_t k)
{
    const struct kvf_route_key *a = &keys[k - 1], *b = &keys[k];
    return a->len == b->len && (a->data == b->data || memcmp(a->data, b->data, a->len) == 0);
}

int kvf_route_owners(const struct kvf_route_key *keys, size_t nkeys, const uint64_t *seeds, size_t nservers,
                     size_t replicas, uint32_t *out)
{
    if (nservers == 0 || nservers > UINT32_MAX || replicas < 1 || replicas > nservers || !seeds)
        return -EINVAL;
    if (nkeys && (!keys || !out)) return -EINVAL;
    if (replicas == 1) {  /* the common case: the arg-max, first maximum wins */
        for (size_t k = 0; k < nkeys; k++) {
            if (k && same_as_previous(keys, k)) {
                out[k] = out[k - 1];
                continue;
            }
            const void *d = keys[k].data;
            size_t n = keys[k].len;
            uint64_t best = XXH3_64bits_withSeed(d, n, seeds[0]);
            uint32_t who = 0;
            for (size_t s = 1; s < nservers; s++) {
                uint64_t h = XXH3_64bits_withSeed(d, n, seeds[s]);
                if (h > best) {
                    best = h;
                    who = (uint32_t)s;
                }
            }
            out[k] = who;
        }
        return 0;
    }
    uint64_t *top = malloc(replicas * sizeof *top);
    if (!top) return -ENOMEM;
    for (size_t k = 0; k < nkeys; k++) {
        uint32_t *o = out + k * replicas;
        if (k && same_as_previous(keys, k)) {
            memcpy(o, o - replicas, replicas * sizeof *o);
            continue;
        }
        size_t kept = 0;
        for (size_t s = 0; s < nservers; s++) {
            uint64_t h = XXH3_64bits_withSeed(keys[k].data, keys[k].len, seeds[s]);
            if (kept == replicas && h <= top[kept - 1]) continue;  /* not better than the worst kept */
            size_t j = kept < replicas ? kept++ : kept - 1;        /* full: the worst kept drops out */
            while (j > 0 && top[j - 1] < h) {
                top[j] = top[j - 1];
                o[j] = o[j - 1];
                j--;
            }
            top[j] = h;
            o[j] = (uint32_t)s;
        }
    }
    free(top);
    return 0;
}
