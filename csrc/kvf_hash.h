/* kvf_hash.h: the object checksum, protocol version 2 (as kvfabric.protocol.checksum):
 *
 *     checksum(key, value) = xxh3_64(value, seed = xxh3_64(key))
 *
 * The key is bound into the checksum, so bytes checksummed under one key do
 * not verify under another (an integrity check, not authentication). kvf_obj_hash is the one-shot form;
 * kvf_hash_reset_key + kvf_hash_update + kvf_hash_digest the streaming form
 * (same result for the same key and value, however the value is split).
 * kvf_xxh3_64 is plain unseeded xxh3_64 (the key's seed; the test hook): it
 * is not an object checksum.
 *
 * On x86-64 the vendored xxh_x86dispatch.c picks the widest vector unit the
 * CPU has (SSE2 / AVX2 / AVX-512) at run time for the one-shot and the
 * streaming update; resetting a stream with a seed derives its 192-byte
 * secret with the compile-time code path (the dispatcher has no seeded
 * reset; it is a fixed, small cost per object). Elsewhere the portable build.
 * The streaming state is heap-allocated (xxh3 wants it 64-byte aligned).
 * kvf_hash_new returns NULL when out of memory.
 */
#ifndef KVF_HASH_H
#define KVF_HASH_H

#include <stddef.h>
#include <stdint.h>

uint64_t kvf_xxh3_64(const void *data, size_t len);
uint64_t kvf_obj_hash(const void *key, size_t klen, const void *data, size_t len);
void *kvf_hash_new(void);
/* Start the streaming checksum of the value stored under key[0..klen). */
void kvf_hash_reset_key(void *state, const void *key, size_t klen);
void kvf_hash_update(void *state, const void *data, size_t len);
uint64_t kvf_hash_digest(void *state);
void kvf_hash_free(void *state);

#endif
