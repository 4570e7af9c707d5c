/* kvf_route.h: rendezvous owners of many block keys at once (kvfabric.sharding's spec, in C).
 *
 * score(server s, key) = xxh3_64(key, seed = seeds[s]), seeds[s] = xxh3_64(server id)
 * (computed and cached by the caller). A key's owners are the `replicas`
 * servers with the highest scores, best first; equal scores rank the lower
 * server index first. Bit for bit the result of kvfabric.sharding's
 * reference (pure-Python) functions; tests/native/test_route.py compares
 * them on random keys, server lists and replica counts.
 *
 * A key equal to the one before it is routed once (its owners copied): the
 * parts of one group share a placement key, listed one after another.
 *
 * Pure computation: no allocation in the replicas == 1 path, no locks, safe
 * to call without the GIL as long as the key bytes stay alive and unchanged.
 */
#ifndef KVF_ROUTE_H
#define KVF_ROUTE_H

#include <stddef.h>
#include <stdint.h>

/* One key: `len` bytes at `data`. */
struct kvf_route_key {
    const void *data;
    size_t len;
};

/* Owners of every key: out[k * replicas + r] is the index (into seeds) of
 * key k's r-th best server. `out` holds nkeys * replicas entries.
 * Returns 0; -EINVAL when nservers is 0 or over UINT32_MAX, replicas is not
 * in 1..nservers, or a pointer needed is NULL; -ENOMEM when the scratch of
 * `replicas` scores (replicas > 1 only) cannot be allocated. */
int kvf_route_owners(const struct kvf_route_key *keys, size_t nkeys, const uint64_t *seeds, size_t nservers,
                     size_t replicas, uint32_t *out);

#endif
