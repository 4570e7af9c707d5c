/* kvf_ops.c: the request dispatcher of the native server and the handlers of
 * the simple requests (HELLO, AUTH, PING, GET, EXISTS, LOOKUP, DELETE), on the
 * loop thread; the loop (kvf_server.c) calls it once a request's header and
 * metadata are in, and the handlers of the other requests sit below it: PUT
 * (kvf_put.c), STATS (kvf_stats.c), the shm requests (kvf_shm.c), and keys
 * missing DRAM but on a tier (kvf_tier_ops.c parks the request; the loop runs
 * it again once its reads are back).
 *
 * Each handler parses the request's metadata with the bounds-checked msgpack
 * reader (kvf_request.c), applies the same checks as kvfabric/protocol/ (in
 * the same order, with the same error codes), and queues the reply. Errors
 * after which the stream cannot be trusted (LENGTH_MISMATCH,
 * PAYLOAD_TOO_LARGE, AUTH_FAILED, BAD_VERSION) answer and close (an
 * AUTH_FAILED peer's address is kept for the control thread's log); other errors
 * consume the request's payload, answer and keep the connection.
 */
#define _GNU_SOURCE
#include "kvf_server_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include "kvf_hash.h"
#include "kvf_mac.h"
#include "kvf_ns.h"
#include "kvf_tier.h"

/* ---------------------------------------------------------------- HELLO, AUTH (protocol 3)
 *
 * kvfabric/protocol/auth.py owns the exchange; C only moves the nonces and
 * checks the MACs. With a token: HELLO draws a fresh server nonce and proves
 * the server holds the token over both nonces and its id; AUTH checks the
 * client's proof over them (constant time) and only then marks the connection
 * authenticated. Without one, HELLO authenticates and AUTH is not expected. */

/* The peer of c as the log names it: "host:port", "[v6]:port" or "unix:pid=P,uid=U". */
static void peer_name(const struct conn *c, char *out, size_t cap)
{
    snprintf(out, cap, "?");
    if (c->is_unix) {
        struct ucred cr;
        socklen_t l = sizeof cr;
        if (getsockopt(c->fd, SOL_SOCKET, SO_PEERCRED, &cr, &l) == 0)
            snprintf(out, cap, "unix:pid=%d,uid=%u", (int)cr.pid, (unsigned)cr.uid);
        return;
    }
    struct sockaddr_storage ss;
    socklen_t l = sizeof ss;
    char host[INET6_ADDRSTRLEN];
    if (getpeername(c->fd, (struct sockaddr *)&ss, &l)) return;
    if (ss.ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)&ss;
        if (inet_ntop(AF_INET, &a->sin_addr, host, sizeof host)) snprintf(out, cap, "%s:%u", host, ntohs(a->sin_port));
    } else if (ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&ss;
        if (inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host)) snprintf(out, cap, "[%s]:%u", host, ntohs(a->sin6_port));
    }
}

/* Refuse c with AUTH_FAILED (counted by code, then closed) and keep its address for the log. */
static void auth_failed(struct conn *c, const char *why)
{
    struct kvf_server *s = c->srv;
    char peer[KVF_PEER_NAME];
    peer_name(c, peer, sizeof peer);
    pthread_mutex_lock(&s->auth_mu);
    if (s->auth_n < KVF_AUTH_LOG) memcpy(s->auth_log[s->auth_n++], peer, sizeof peer);
    else s->auth_lost++;
    pthread_mutex_unlock(&s->auth_mu);
    kvf_reject(c, KVF_E_AUTH_FAILED, why);
}

size_t kvf_server_auth_failures(struct kvf_server *s, char (*out)[KVF_PEER_NAME], size_t max, uint64_t *lost)
{
    pthread_mutex_lock(&s->auth_mu);
    size_t n = s->auth_n < max ? s->auth_n : max;
    memcpy(out, s->auth_log, n * KVF_PEER_NAME);
    *lost = s->auth_lost + (s->auth_n - n);
    s->auth_n = 0;
    s->auth_lost = 0;
    pthread_mutex_unlock(&s->auth_mu);
    return n;
}

/* A bin field of exactly n bytes: 0 and *out set, or -1 (absent, another type or size). */
static int find_bin(struct kvf_meta m, const char *name, uint32_t n, const uint8_t **out)
{
    struct kvf_mr r;
    uint32_t len;
    return kvf_mr_find(m.p, m.n, name, &r) || kvf_mr_bin(&r, out, &len) || len != n ? -1 : 0;
}

static void op_hello(struct conn *c, struct kvf_meta m)
{
    struct kvf_server *s = c->srv;
    struct kvf_mr r;
    int64_t version;
    const uint8_t *nonce;
    if (kvf_mr_find(m.p, m.n, KVF_F_VERSION, &r) || kvf_mr_int(&r, &version)) {
        kvf_reject(c, KVF_E_MALFORMED, "missing field '" KVF_F_VERSION "'");
        return;
    }
    /* the version before the nonce: an older peer's HELLO has none, and BAD_VERSION says why */
    if (version != KVF_VERSION) { kvf_reject(c, KVF_E_BAD_VERSION, KVF_BAD_VERSION_MSG); return; }
    _Static_assert(KVF_NONCE_BYTES == 32, "the message below names the nonce's size");
    if (find_bin(m, KVF_F_NONCE, KVF_NONCE_BYTES, &nonce)) {
        kvf_reject(c, KVF_E_MALFORMED, KVF_F_NONCE " must be 32 bytes (bin)");
        return;
    }
    uint8_t proof[KVF_PROOF_BYTES];
    if (s->cfg.auth) {
        if (kvf_random_bytes(c->snonce, KVF_NONCE_BYTES)) { kvf_reject(c, KVF_E_INTERNAL, "no random bytes"); return; }
        memcpy(c->cnonce, nonce, KVF_NONCE_BYTES);
        c->hello_seen = 1;
        const void *parts[] = {KVF_HELLO_SERVER_LABEL, c->cnonce, c->snonce, s->cfg.server_id};
        size_t lens[] = {sizeof KVF_HELLO_SERVER_LABEL - 1, KVF_NONCE_BYTES, KVF_NONCE_BYTES, strlen(s->cfg.server_id)};
        kvf_hmac_sha256(s->cfg.auth, strlen(s->cfg.auth), 4, parts, lens, proof);
    } else {
        c->authed = 1;
    }
    if (!c->is_unix && kvf_mr_find(m.p, m.n, KVF_F_TRANSPORTS, &r) == 0) {
        uint32_t n;
        if (kvf_mr_array(&r, &n) == 0) {
            for (uint32_t i = 0; i < n && i < 16; i++) {
                const char *t;
                uint32_t tl;
                if (kvf_mr_str(&r, &t, &tl)) break;
                if (tl == 6 && memcmp(t, "native", 6) == 0) c->transport = TR_NATIVE;
                if (tl == 4 && memcmp(t, "nixl", 4) == 0 && s->nixl_md) {
                    c->remote_arena = 1;
                    c->transport = TR_NIXL;
                }
            }
        }
    }
    s->ctr.by_transport[c->transport]++;
    /* the static entries, then this connection's; map_close counts them */
    KVF_REPLY_BEGIN(s->cfg.hello_len + 128, 0);
    size_t at = kvf_mw_map_open(&w);
    kvf_mw_raw(&w, s->cfg.hello_pairs, s->cfg.hello_len);
    kvf_mw_cstr(&w, KVF_F_AUTH_REQUIRED);
    kvf_mw_bool(&w, s->cfg.auth != NULL);
    if (s->cfg.auth) {
        kvf_mw_cstr(&w, KVF_F_NONCE);
        kvf_mw_bin(&w, c->snonce, KVF_NONCE_BYTES);
        kvf_mw_cstr(&w, KVF_F_PROOF);
        kvf_mw_bin(&w, proof, KVF_PROOF_BYTES);
    }
    kvf_mw_map_close(&w, at);
    if (w.overflow) { kvf_reply_drop(c, rp); kvf_reject(c, KVF_E_INTERNAL, "HELLO reply does not fit"); return; }
    kvf_reply_finish(c, rp, KVF_OP_HELLO, KVF_FLAG_REPLY, w.len, 0);
    kvf_conn_next_request(c);
}

static void op_auth(struct conn *c, struct kvf_meta m)
{
    struct kvf_server *s = c->srv;
    if (!s->cfg.auth) { kvf_reject(c, KVF_E_MALFORMED, "this server has no pool token: AUTH is not expected"); return; }
    if (!c->hello_seen) { auth_failed(c, "AUTH without a HELLO to answer"); return; }
    const uint8_t *got;
    if (find_bin(m, KVF_F_PROOF, KVF_PROOF_BYTES, &got)) { auth_failed(c, "AUTH needs a 32-byte proof"); return; }
    uint8_t want[KVF_PROOF_BYTES];
    const void *parts[] = {KVF_HELLO_CLIENT_LABEL, c->snonce, c->cnonce};
    size_t lens[] = {sizeof KVF_HELLO_CLIENT_LABEL - 1, KVF_NONCE_BYTES, KVF_NONCE_BYTES};
    kvf_hmac_sha256(s->cfg.auth, strlen(s->cfg.auth), 3, parts, lens, want);
    c->hello_seen = 0; /* one AUTH per HELLO: a second try needs a fresh server nonce */
    if (!kvf_ct_equal(want, got, KVF_PROOF_BYTES)) {
        auth_failed(c, "wrong proof: this peer does not hold the pool token");
        return;
    }
    c->authed = 1;
    KVF_REPLY_BEGIN(8, 0);
    kvf_mw_map(&w, 0);
    kvf_reply_finish(c, rp, KVF_OP_AUTH, KVF_FLAG_REPLY, w.len, 0);
    kvf_conn_next_request(c);
}

/* ---------------------------------------------------------------- RETIRE (issue 27)
 *
 * Bumps the tag's generation (kvf_ns.h): from the reply on, every object stored under an
 * older one is a miss in DRAM (kvf_store.c's find) and on the SSD tier (kvf_tier_ifind),
 * each freed where it is found, by the control thread's bounded sweep, or by eviction.
 * O(1): no object is visited here. With an SSD tier the new generation is appended to the
 * retirements file and fdatasync'd on this thread before the reply (RETIRE is rare). */
static void op_retire(struct conn *c, struct kvf_meta m)
{
    const uint8_t *tag;
    _Static_assert(KVF_NS_TAG_BYTES == 16, "the message below names the tag's size");
    if (find_bin(m, KVF_F_NS, KVF_NS_TAG_BYTES, &tag)) {
        kvf_reject(c, KVF_E_MALFORMED, KVF_F_NS " must be a 16-byte namespace tag (bin)");
        return;
    }
    struct kvf_ns *ns = kvf_store_ns(c->srv->st);
    uint64_t gen = 0;
    int rc = ns ? kvf_ns_retire(ns, tag, &gen) : -ENOSYS;
    if (rc == -ENOSPC) {
        kvf_reject(c, KVF_E_BUSY, "namespace tag table full: this server knows as many tags as it can hold; "
                                  "nothing retired");
        return;
    }
    if (rc) {
        char msg[160];
        snprintf(msg, sizeof msg, "RETIRE not applied: %s", rc == -EOVERFLOW ? "the tag's generation cannot grow"
                 : rc == -ENOSYS ? "this server has no namespace table" : strerror(-rc));
        kvf_reject(c, KVF_E_INTERNAL, msg);
        return;
    }
    KVF_REPLY_BEGIN(32, 0);
    kvf_mw_map(&w, 1);
    kvf_mw_cstr(&w, KVF_F_GENERATION);
    kvf_mw_uint(&w, gen);
    kvf_reply_finish(c, rp, KVF_OP_RETIRE, KVF_FLAG_REPLY, w.len, 0);
    kvf_conn_next_request(c);
}

/* ---------------------------------------------------------------- keys */

static void op_keys(struct conn *c, struct kvf_meta m, int op)
{
    struct kvf_server *s = c->srv;
    uint32_t n;
    int e = kvf_parse_keys(c, m, &c->b, &n);
    if (e) { kvf_reject(c, e, kvf_keys_error(e)); return; }
    uint64_t lease_ms = 0;
    if (op == KVF_OP_LOOKUP && (kvf_parse_uint(m, KVF_F_LEASE_MS, &lease_ms, 0) || lease_ms > KVF_MAX_LEASE_MS)) {
        _Static_assert(KVF_MAX_LEASE_MS == 3600000u, "the message below names the protocol's lease cap");
        kvf_reject(c, KVF_E_MALFORMED, "lease_ms must be in 0..3600000");
        return;
    }
    /* LOOKUP media: where each counted key is (a byte each: KVF_MEDIUM_*), and nothing is read
     * from a tier: a key only on the SSD tier counts from its index, unleased and not promoted
     * (the client decides whether reading it is worth it); the shared tier is not consulted */
    int media = 0;
    if (op == KVF_OP_LOOKUP && kvf_parse_bool(m, KVF_F_MEDIA, &media)) {
        kvf_reject(c, KVF_E_MALFORMED, "media must be a bool");
        return;
    }
    struct batch *b = &c->b;
    int trust = 0;
    if (op == KVF_OP_GET) {
        /* client_verifies: the client checks each object against the reply's
         * checksum itself (and asks again without the flag on a mismatch),
         * so the objects go out unchecked: one pass over the bytes fewer */
        if (kvf_parse_bool(m, KVF_F_CLIENT_VERIFIES, &trust)) {
            kvf_reject(c, KVF_E_MALFORMED, "client_verifies must be a bool");
            return;
        }
        /* over the server-wide reply budget only small replies are made */
        size_t need = sizeof(struct reply) + KVF_HEADER_SIZE + 32 + (size_t)n * (20 + sizeof(struct seg));
        if (need > KVF_REPLY_SMALL && s->ctr.reply_bytes + need > s->cfg.reply_budget) {
            s->ctr.reply_busy++;
            kvf_reject(c, KVF_E_BUSY, "server busy: queued replies over their budget");
            return;
        }
    }
    if (s->tier && !media && kvf_tier_park(c, op, b, n)) return; /* keys on a tier: read, promote, come back */
    if (op == KVF_OP_GET) {
        KVF_REPLY_BEGIN(32 + (size_t)n * 20, n);
        uint32_t found = 0;
        uint64_t payload = 0;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t id;
            uint64_t off, size, csum;
            b->status[i] = 0;
            if (kvf_store_acquire(s->st, b->keys[i], b->klens[i], &id, &off, &size, &csum) == 0) {
                /* Small objects are verified now; a large one is verified chunk by
                 * chunk as it is sent, its last chunk held back until the whole
                 * checksum matched (a mismatch closes the connection: the client
                 * sees a broken reply, i.e. a miss, never wrong bytes). */
                int stream = !trust && size > KVF_VERIFY_WHOLE;
                if (trust) s->ctr.client_verified++;
                if (!trust && !stream && kvf_obj_hash(b->keys[i], b->klens[i], s->base + off, size) != csum) {
                    kvf_store_drop_corrupt(s->st, id);
                    kvf_store_release(s->st, id);
                } else {
                    rp->segs[found].off = off;
                    rp->segs[found].len = size;
                    rp->segs[found].entry = id;
                    rp->segs[found].verify = stream;
                    rp->segs[found].csum = csum;
                    rp->segs[found].hashed = stream ? 0 : size;
                    found++;
                    payload += size;
                    b->sizes[i] = size;
                    b->csums[i] = csum;
                    b->status[i] = 1;
                }
            } else if (s->tier && kvf_tier_stream_slot(c, b->keys[i], b->klens[i], found, &off, &size, &csum)) {
                /* on the SSD tier, its slot reserved: sent as soon as its read is verified */
                rp->segs[found] = (struct seg){.off = off, .len = size, .entry = KVF_SEG_SLOT, .csum = csum,
                                               .wait = 1};
                found++;
                payload += size;
                b->sizes[i] = size;
                b->csums[i] = csum;
                b->status[i] = 1;
            }
            if (b->status[i]) s->ctr.hits++; else s->ctr.misses++;
        }
        rp->nseg = found;
        kvf_mw_map(&w, 2);
        kvf_mw_cstr(&w, KVF_F_SIZES);
        kvf_mw_array(&w, n);
        for (uint32_t i = 0; i < n; i++) kvf_mw_int(&w, b->status[i] ? (int64_t)b->sizes[i] : -1);
        kvf_mw_cstr(&w, KVF_F_CHECKSUMS);
        kvf_mw_array(&w, n);
        for (uint32_t i = 0; i < n; i++) kvf_mw_uint(&w, b->status[i] ? b->csums[i] : 0);
        kvf_reply_finish(c, rp, KVF_OP_GET, KVF_FLAG_REPLY, w.len, payload);
        if (s->tier) kvf_tier_stream_start(c, rp); /* its SSD reads, if any */
    } else if (op == KVF_OP_EXISTS) {
        KVF_REPLY_BEGIN(32 + (size_t)n, 0);
        kvf_mw_map(&w, 1);
        kvf_mw_cstr(&w, KVF_F_PRESENT);
        kvf_mw_array(&w, n);
        for (uint32_t i = 0; i < n; i++) {
            uint64_t loc, seq, size, csum; /* on the SSD tier counts as held; nothing is read */
            kvf_mw_bool(&w, kvf_store_exists(s->st, b->keys[i], b->klens[i]) ||
                                (s->tier && kvf_tier_find(s->tier, b->keys[i], b->klens[i], &loc, &seq, &size, &csum)));
        }
        kvf_reply_finish(c, rp, KVF_OP_EXISTS, KVF_FLAG_REPLY, w.len, 0);
    } else if (op == KVF_OP_LOOKUP) {
        if (s->cfg.max_lease_ms && lease_ms > s->cfg.max_lease_ms) lease_ms = s->cfg.max_lease_ms;
        int64_t until = lease_ms ? kvf_now_ms() + (int64_t)lease_ms : 0;
        uint32_t count = 0;
        uint8_t *medium = b->status; /* n bytes, free in a LOOKUP */
        /* SSD keys count up to one request's promotion cap, in arena slots, as the prefetch and a GET
         * do: the run is what one GET can serve (past the cap a GET's SSD keys are misses) */
        uint64_t budget = media && s->tier ? kvf_tier_promote_max(s->tier) : 0, slots = 0;
        for (; count < n; count++) {
            uint64_t loc, seq, size, csum;
            if (kvf_store_lookup(s->st, b->keys[count], b->klens[count], until)) {
                medium[count] = KVF_MEDIUM_DRAM;
                continue;
            }
            if (!media || !s->tier ||
                kvf_tier_find(s->tier, b->keys[count], b->klens[count], &loc, &seq, &size, &csum) <= 0)
                break;
            slots += (size + KVF_PAGE - 1) / KVF_PAGE * KVF_PAGE;
            if (slots > budget) break;
            medium[count] = KVF_MEDIUM_SSD;
        }
        KVF_REPLY_BEGIN(48 + (size_t)count, 0);
        kvf_mw_map(&w, media ? 2 : 1);
        kvf_mw_cstr(&w, KVF_F_COUNT);
        kvf_mw_uint(&w, count);
        if (media) {
            kvf_mw_cstr(&w, KVF_F_MEDIA);
            kvf_mw_bin(&w, medium, count);
        }
        kvf_reply_finish(c, rp, KVF_OP_LOOKUP, KVF_FLAG_REPLY, w.len, 0);
    } else { /* DELETE */
        uint32_t del = 0;
        for (uint32_t i = 0; i < n; i++) {
            int d = kvf_store_delete(s->st, b->keys[i], b->klens[i]); /* objects removed: a group whole */
            int t = s->tier ? kvf_tier_delete(s->tier, b->keys[i], b->klens[i]) : 0; /* + a tombstone on disk */
            if (s->tier) kvf_tier_shared_delete(s->tier, b->keys[i], b->klens[i]); /* and the shared file, if any */
            del += (uint32_t)(d > 0 ? d : t);
        }
        KVF_REPLY_BEGIN(32, 0);
        kvf_mw_map(&w, 1);
        kvf_mw_cstr(&w, KVF_F_DELETED);
        kvf_mw_uint(&w, del);
        kvf_reply_finish(c, rp, KVF_OP_DELETE, KVF_FLAG_REPLY, w.len, 0);
    }
    kvf_conn_next_request(c);
}

void kvf_ops_conn_gone(struct conn *c)
{
    kvf_shm_conn_gone(c);
    kvf_tier_conn_gone(c);
}

/* ---------------------------------------------------------------- dispatch */

void kvf_ops_request(struct conn *c)
{
    int op = c->hdr.opcode;
    struct kvf_meta m = {c->meta, c->hdr.meta_len};
    if (!c->authed && op != KVF_OP_HELLO && op != KVF_OP_AUTH) {
        auth_failed(c, "authenticate with HELLO and AUTH first");
        return;
    }
    if (op < KVF_OP_HELLO || (op > KVF_OP_RETIRE && (op < KVF_OP_SHM_ATTACH || op > KVF_OP_SHM_COMMIT))) {
        kvf_reject(c, KVF_E_UNKNOWN_OPCODE, "unknown opcode");
        return;
    }
    /* the same rule as protocol.decode_meta: one map, nothing truncated or after it, no key twice */
    if (kvf_mr_check_meta(m.p, m.n)) {
        kvf_reject(c, KVF_E_MALFORMED, "metadata must be one msgpack map (no key twice, nothing truncated or after it)");
        return;
    }
    if (op != KVF_OP_PUT && c->hdr.payload_len) {
        kvf_reject(c, KVF_E_LENGTH_MISMATCH, "this request carries no payload");
        return;
    }
    switch (op) {
    case KVF_OP_HELLO: op_hello(c, m); break;
    case KVF_OP_AUTH: op_auth(c, m); break;
    case KVF_OP_RETIRE: op_retire(c, m); break;
    case KVF_OP_PING: {
        KVF_REPLY_BEGIN(8, 0);
        kvf_mw_map(&w, 0);
        kvf_reply_finish(c, rp, KVF_OP_PING, KVF_FLAG_REPLY, w.len, 0);
        kvf_conn_next_request(c);
        break;
    }
    case KVF_OP_STATS: kvf_op_stats(c); break;
    case KVF_OP_PUT: kvf_op_put(c, m); break;
    case KVF_OP_GET:
    case KVF_OP_EXISTS:
    case KVF_OP_LOOKUP:
    case KVF_OP_DELETE: op_keys(c, m, op); break;
    default: kvf_shm_op(c, m.p, m.n, op); break;
    }
}
