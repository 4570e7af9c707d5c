/* kvf_hash.h: the object checksum (xxh3_64, as kvfabric.protocol.checksum).
 *
 * On x86-64 the vendored xxh_x86dispatch.c picks the widest vector unit the
 * CPU has (SSE2 / AVX2 / AVX-512) at run time; elsewhere the portable build.
 * The streaming state is heap-allocated (xxh3 wants it 64-byte aligned).
 * kvf_hash_new returns NULL when out of memory.
 */
#ifndef KVF_HASH_H
#define KVF_HASH_H

#include <stddef.h>
#include <stdint.h>

uint64_t kvf_hash(const void *data, size_t len);
void *kvf_hash_new(void);
void kvf_hash_reset(void *state);
void kvf_hash_update(void *state, const void *data, size_t len);
uint64_t kvf_hash_digest(void *state);
void kvf_hash_free(void *state);

#endif
