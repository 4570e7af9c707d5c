/* kvf_protocol.h: the C mirror of kvfabric/protocol/ (wire version KVF_VERSION, below).
 *
 * A frame is a 32-byte little-endian header, meta_len bytes of msgpack
 * metadata (a map), then payload_len raw payload bytes. This header only
 * describes the layout and the limits; the Python module stays the owner of
 * the format, and tests/native/test_layout.py checks that both agree
 * (offsets, sizes, constants and golden frames).
 *
 * Functions here return 0 or a negative kvf error (-KVF_E_*), never errno.
 */
#ifndef KVF_PROTOCOL_H
#define KVF_PROTOCOL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvfabric's C data plane assumes a little-endian host (the wire is little-endian)"
#endif

#define KVF_MAGIC "KVFB"
/* Version 3: HELLO proves both sides hold the pool token (kvfabric/protocol/auth.py;
 * object checksums bind keys as since version 2, kvf_hash.h). No other version
 * is spoken; a peer with another one gets BAD_VERSION with this message. */
#define KVF_VERSION 3
#define KVF_BAD_VERSION_MSG "this server speaks protocol 3: HELLO proves both sides hold the pool token"
#define KVF_HEADER_SIZE 32

#define KVF_FLAG_REPLY 0x01
#define KVF_FLAG_ERROR 0x02
#define KVF_KNOWN_FLAGS (KVF_FLAG_REPLY | KVF_FLAG_ERROR)

enum kvf_op {
    KVF_OP_HELLO = 1,
    KVF_OP_PING = 2,
    KVF_OP_EXISTS = 3,
    KVF_OP_LOOKUP = 4,
    KVF_OP_GET = 5,
    KVF_OP_PUT = 6,
    KVF_OP_DELETE = 7,
    KVF_OP_STATS = 8,
    KVF_OP_AUTH = 9, /* the client's proof over the server's HELLO nonce */
    KVF_OP_RETIRE = 10, /* bump a namespace tag's generation: its objects are misses (issue 27) */
    /* Same-host (shm) control operations, only on a unix-socket connection
     * that negotiated "shm". See kvfabric/transport/shm.py. */
    KVF_OP_SHM_ATTACH = 32,  /* reply carries the arena memfd (SCM_RIGHTS) */
    KVF_OP_SHM_LEASE = 33,   /* keys -> offsets/sizes/checksums, pinned */
    KVF_OP_SHM_RELEASE = 34, /* drop a lease; no reply */
    KVF_OP_SHM_RESERVE = 35, /* keys+sizes -> offsets of reserved slots */
    KVF_OP_SHM_COMMIT = 36,  /* reservation + checksums -> status per key */
};

/* Wire error codes (kvfabric.errors.ErrorCode). */
enum kvf_err {
    KVF_E_BAD_MAGIC = 1,
    KVF_E_BAD_VERSION = 2,
    KVF_E_UNKNOWN_OPCODE = 3,
    KVF_E_MALFORMED = 4,
    KVF_E_TOO_MANY_KEYS = 5,
    KVF_E_PAYLOAD_TOO_LARGE = 6,
    KVF_E_META_TOO_LARGE = 7,
    KVF_E_LENGTH_MISMATCH = 8,
    KVF_E_AUTH_FAILED = 9,
    KVF_E_TOO_MANY_IN_FLIGHT = 10,
    KVF_E_BUSY = 11,
    KVF_E_INTERNAL = 12,
    KVF_E_BAD_KEY = 13,
};

/* PUT status per key (kvfabric.protocol.PutStatus). */
enum kvf_put_status {
    KVF_PUT_STORED = 0,
    KVF_PUT_EXISTS = 1,
    KVF_PUT_TOO_LARGE = 2,
    KVF_PUT_NO_SPACE = 3,
    KVF_PUT_CHECKSUM_MISMATCH = 4,
};

/* Default limits (kvfabric.protocol.DEFAULT_LIMITS). */
#define KVF_MAX_KEYS_PER_BATCH 4096u
#define KVF_MAX_KEY_BYTES 64u
#define KVF_MAX_META_BYTES (1u << 20)
#define KVF_MAX_PAYLOAD_BYTES (1ull << 30)
#define KVF_MAX_OBJECT_BYTES (64ull << 20)
#define KVF_MAX_IN_FLIGHT 64u
#define KVF_PRE_AUTH_META_BYTES 4096u
/* HELLO's proofs (kvfabric.protocol.auth): each side's nonce, each proof (an
 * HMAC-SHA256 keyed by the token), and the labels that keep the two
 * directions apart: server = HMAC(token, SERVER_LABEL || Nc || Ns || server_id),
 * client = HMAC(token, CLIENT_LABEL || Ns || Nc). */
#define KVF_NONCE_BYTES 32u
#define KVF_PROOF_BYTES 32u
#define KVF_HELLO_SERVER_LABEL "kvfabric-hello-server-v3"
#define KVF_HELLO_CLIENT_LABEL "kvfabric-hello-client-v3"
/* A namespace tag's bytes (PUT ns, RETIRE ns; kvfabric.protocol.NS_TAG_BYTES, kvf_ns.h). */
#define KVF_NS_TAG_BYTES 16u
/* Cap on a LOOKUP / shm lease, ms (kvfabric.protocol.MAX_LEASE_MS). */
#define KVF_MAX_LEASE_MS 3600000u
/* LOOKUP with media: each counted key's medium, one byte each (kvfabric.protocol.MEDIUM_DRAM / MEDIUM_SSD). */
#define KVF_MEDIUM_DRAM 0u
#define KVF_MEDIUM_SSD 1u

/* Metadata field names C reads or writes (kvfabric.protocol.META_FIELDS owns
 * them; tests/unit/test_meta_fields.py checks every one is spelled as there and
 * that no C file names a field with a bare string). STATS keys are another
 * schema: kvf_stats.c (kvfabric.protocol.stats). */
#define KVF_F_AUTH_REQUIRED "auth_required"
#define KVF_F_CAPACITY "capacity"
#define KVF_F_CHECKSUMS "checksums"
#define KVF_F_CLIENT_VERIFIES "client_verifies"
#define KVF_F_CODE "code"
#define KVF_F_COUNT "count"
#define KVF_F_DELETED "deleted"
#define KVF_F_GENERATION "generation"
#define KVF_F_GROUPS "groups"
#define KVF_F_GROUP_PARTS "group_parts"
#define KVF_F_KEYS "keys"
#define KVF_F_LEASE "lease"
#define KVF_F_LEASE_MS "lease_ms"
#define KVF_F_MEDIA "media"
#define KVF_F_MESSAGE "message"
#define KVF_F_NONCE "nonce"
#define KVF_F_NS "ns"
#define KVF_F_OFFSETS "offsets"
#define KVF_F_PARENTS "parents"
#define KVF_F_PRESENT "present"
#define KVF_F_PROOF "proof"
#define KVF_F_RES "res"
#define KVF_F_SIZES "sizes"
#define KVF_F_STATUS "status"
#define KVF_F_TRANSPORTS "transports"
#define KVF_F_NIXL_AGENT "nixl_agent"
#define KVF_F_ARENA_BASE "arena_base"
#define KVF_F_VERSION "version"

struct kvf_header {
    char magic[4];
    uint16_t version;
    uint8_t opcode;
    uint8_t flags;
    uint64_t request_id;
    uint32_t meta_len;
    uint64_t payload_len;
    uint32_t reserved;
} __attribute__((packed));

_Static_assert(sizeof(struct kvf_header) == KVF_HEADER_SIZE, "header is 32 bytes");
_Static_assert(offsetof(struct kvf_header, version) == 4, "version at 4");
_Static_assert(offsetof(struct kvf_header, opcode) == 6, "opcode at 6");
_Static_assert(offsetof(struct kvf_header, flags) == 7, "flags at 7");
_Static_assert(offsetof(struct kvf_header, request_id) == 8, "request_id at 8");
_Static_assert(offsetof(struct kvf_header, meta_len) == 16, "meta_len at 16");
_Static_assert(offsetof(struct kvf_header, payload_len) == 20, "payload_len at 20");
_Static_assert(offsetof(struct kvf_header, reserved) == 28, "reserved at 28");

static inline void kvf_header_pack(struct kvf_header *h, uint8_t opcode, uint8_t flags,
                                   uint64_t request_id, uint32_t meta_len, uint64_t payload_len)
{
    memcpy(h->magic, KVF_MAGIC, 4);
    h->version = KVF_VERSION;
    h->opcode = opcode;
    h->flags = flags;
    h->request_id = request_id;
    h->meta_len = meta_len;
    h->payload_len = payload_len;
    h->reserved = 0;
}

/* Check a received header against the limits, in the order kvfabric.protocol's
 * unpack_header does. Returns 0 or -KVF_E_BAD_MAGIC / -KVF_E_BAD_VERSION /
 * -KVF_E_MALFORMED / -KVF_E_META_TOO_LARGE / -KVF_E_PAYLOAD_TOO_LARGE. */
static inline int kvf_header_check(const struct kvf_header *h, uint32_t max_meta, uint64_t max_payload)
{
    if (memcmp(h->magic, KVF_MAGIC, 4) != 0)
        return -KVF_E_BAD_MAGIC;
    if (h->version != KVF_VERSION)
        return -KVF_E_BAD_VERSION;
    if ((h->flags & ~KVF_KNOWN_FLAGS) || h->reserved != 0)
        return -KVF_E_MALFORMED;
    if (h->meta_len > max_meta)
        return -KVF_E_META_TOO_LARGE;
    if (h->payload_len > max_payload)
        return -KVF_E_PAYLOAD_TOO_LARGE;
    return 0;
}

/* After these errors the server replies and closes the connection. */
static inline int kvf_err_is_fatal(int code)
{
    return code == KVF_E_BAD_MAGIC || code == KVF_E_BAD_VERSION || code == KVF_E_LENGTH_MISMATCH ||
           code == KVF_E_PAYLOAD_TOO_LARGE || code == KVF_E_META_TOO_LARGE || code == KVF_E_AUTH_FAILED;
}

#endif
