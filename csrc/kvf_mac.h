/* kvf_mac.h: HMAC-SHA256 keyed by the pool secret (the --auth-token), as
 * Python's hmac.new(key, msg, hashlib.sha256) computes it, and what goes with
 * a MAC: a constant-time compare and fresh random bytes.
 *
 * Where it is used: HELLO's mutual proof (protocol 3: each side proves it
 * holds the token over the other's fresh nonce; kvfabric.protocol owns the
 * message layout) and the shared tier's file MAC. SHA-256 is FIPS 180-4,
 * HMAC is FIPS 198-1 / RFC 2104; tests/native/test_mac.py checks both
 * against RFC 4231's vectors and against Python's hmac on random inputs.
 *
 * kvf_hmac_sha256 hashes the message given as n parts (parts[i], lens[i]),
 * concatenated, so callers need no buffer to join a label, nonces and an id.
 * Nothing here allocates.
 */
#ifndef KVF_MAC_H
#define KVF_MAC_H

#include <stddef.h>
#include <stdint.h>

#define KVF_SHA256_BYTES 32
#define KVF_SHA256_BLOCK 64

struct kvf_sha256 {
    uint32_t h[8];
    uint64_t len;                   /* bytes hashed so far */
    uint8_t buf[KVF_SHA256_BLOCK];  /* a partial block */
    size_t nbuf;
};

void kvf_sha256_init(struct kvf_sha256 *s);
void kvf_sha256_update(struct kvf_sha256 *s, const void *data, size_t len);
void kvf_sha256_final(struct kvf_sha256 *s, uint8_t out[KVF_SHA256_BYTES]);

/* out = HMAC-SHA256(key, parts[0] || ... || parts[n-1]). */
void kvf_hmac_sha256(const void *key, size_t klen, size_t n, const void *const *parts, const size_t *lens,
                     uint8_t out[KVF_SHA256_BYTES]);

/* 1 when a[0..n) == b[0..n), in a time that depends on n only. */
int kvf_ct_equal(const void *a, const void *b, size_t n);

/* Fill buf[0..n) from the kernel's CSPRNG (getrandom); 0, or -errno. */
int kvf_random_bytes(void *buf, size_t n);

#endif
