/* kvf_hash.c: xxh3_64 with run-time CPU dispatch on x86-64 (see kvf_hash.h). */
#include "kvf_hash.h"

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

#if defined(__x86_64__) && defined(KVF_XXH_DISPATCH)
#include "third_party/xxhash/xxh_x86dispatch.h"
#define H64 XXH3_64bits_dispatch
#define HUPD XXH3_64bits_update_dispatch
#else
#define H64 XXH3_64bits
#define HUPD XXH3_64bits_update
#endif

uint64_t kvf_hash(const void *data, size_t len) { return H64(data, len); }
void *kvf_hash_new(void) { return XXH3_createState(); }
void kvf_hash_reset(void *state) { XXH3_64bits_reset(state); }
void kvf_hash_update(void *state, const void *data, size_t len) { HUPD(state, data, len); }
uint64_t kvf_hash_digest(void *state) { return XXH3_64bits_digest(state); }
void kvf_hash_free(void *state) { XXH3_freeState(state); }
