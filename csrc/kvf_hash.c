/* kvf_hash.c: the keyed object checksum, xxh3_64 with run-time CPU dispatch on x86-64 (see kvf_hash.h). */
#include "kvf_hash.h"

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

#if defined(__x86_64__) && defined(KVF_XXH_DISPATCH)
#include "third_party/xxhash/xxh_x86dispatch.h"
#define H64 XXH3_64bits_dispatch
#define H64S XXH3_64bits_withSeed_dispatch
#define HUPD XXH3_64bits_update_dispatch
#else
#define H64 XXH3_64bits
#define H64S XXH3_64bits_withSeed
#define HUPD XXH3_64bits_update
#endif

uint64_t kvf_xxh3_64(const void *data, size_t len) { return H64(data, len); }

uint64_t kvf_obj_hash(const void *key, size_t klen, const void *data, size_t len)
{
    return H64S(data, len, H64(key, klen));
}

void *kvf_hash_new(void) { return XXH3_createState(); }
void kvf_hash_reset_key(void *state, const void *key, size_t klen)
{
    XXH3_64bits_reset_withSeed(state, H64(key, klen));
}
void kvf_hash_update(void *state, const void *data, size_t len) { HUPD(state, data, len); }
uint64_t kvf_hash_digest(void *state) { return XXH3_64bits_digest(state); }
void kvf_hash_free(void *state) { XXH3_freeState(state); }
