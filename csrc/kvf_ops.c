/* kvf_ops.c: request handlers of the native server, run on the loop thread.
 *
 * Each handler parses the request's metadata with the bounds-checked msgpack
 * reader, applies the same checks as kvfabric/protocol/ (in the same
 * order, with the same error codes), and queues the reply. Errors after
 * which the stream cannot be trusted (LENGTH_MISMATCH, PAYLOAD_TOO_LARGE,
 * AUTH_FAILED, BAD_VERSION) answer and close; other errors consume the
 * request's payload, answer and keep the connection.
 *
 * PUT and the shm RESERVE are "batches": objects are handled one at a time
 * (kvf_ops_batch_step), because a slot may have to wait for the control
 * thread to evict (the connection parks) and a PUT object is received
 * straight into its slot before the next one is looked at.
 */
#define _GNU_SOURCE
#include "kvf_server_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_hash.h"
#include "kvf_tier.h"

/* ---------------------------------------------------------------- errors */

static void reject(struct conn *c, int code, const char *msg)
{
    if (kvf_err_is_fatal(code) || c->hdr.payload_len == 0) {
        kvf_reply_error(c, code, msg);
        kvf_conn_next_request(c);
        return;
    }
    c->pend_code = code;
    snprintf(c->pend_msg, sizeof c->pend_msg, "%s", msg);
    c->batch_op = 0;
    kvf_conn_drain(c, c->hdr.payload_len);
}

/* ---------------------------------------------------------------- batches */

/* Arrays for `cap` entries (and a key buffer when keybuf, or when b had one),
 * sized to the request: kept when b already holds as many, else replaced.
 * Arrays over KVF_BATCH_KEEP entries are charged to the server's request
 * budget (and freed after the request, kvf_conn_next_request). Returns 0,
 * -EBUSY over the budget, -ENOMEM. */
static int batch_alloc(struct conn *c, struct batch *b, uint32_t cap, int keybuf)
{
    struct kvf_server *s = c->srv;
    if (cap == 0) cap = 1;
    keybuf = keybuf || b->keybuf != NULL;
    if (b->keys && b->cap >= cap && (!keybuf || b->keybuf)) return 0;
    kvf_batch_free(b);
    size_t mem = (size_t)cap * (sizeof *b->keys + 1 + 4 * sizeof(uint64_t) + sizeof *b->parents + 2) +
                 (keybuf ? (size_t)cap * KVF_KEY_MAX : 0);
    size_t charge = cap > KVF_BATCH_KEEP ? mem : 0;
    if (charge && s->ctr.request_bytes + charge > s->cfg.request_budget) {
        s->ctr.request_busy++;
        return -EBUSY;
    }
    b->keys = calloc(cap, sizeof *b->keys);
    b->klens = calloc(cap, 1);
    b->sizes = calloc(cap, sizeof(uint64_t));
    b->csums = calloc(cap, sizeof(uint64_t));
    b->offs = calloc(cap, sizeof(uint64_t));
    b->parents = calloc(cap, sizeof *b->parents);
    b->plens = calloc(cap, 1);
    b->status = calloc(cap, 1);
    b->keybuf = keybuf ? malloc((size_t)cap * KVF_KEY_MAX) : NULL;
    if (!b->keys || !b->klens || !b->sizes || !b->csums || !b->offs || !b->parents || !b->plens || !b->status ||
        (keybuf && !b->keybuf)) {
        kvf_batch_free(b);
        return -ENOMEM;
    }
    b->cap = cap;
    b->mem = charge;
    b->acct = &s->ctr.request_bytes;
    s->ctr.request_bytes += charge;
    return 0;
}

void kvf_batch_free(struct batch *b)
{
    if (b->acct) *b->acct -= b->mem;
    free(b->keys); free(b->klens); free(b->sizes); free(b->csums); free(b->offs);
    free(b->parents); free(b->plens); free(b->status); free(b->keybuf);
    memset(b, 0, sizeof *b);
}

/* ---------------------------------------------------------------- parsing */

struct meta {
    const uint8_t *p;
    size_t n;
};

/* keys -> b->keys/klens (b sized to them). Returns 0 or a wire error code
 * (BUSY when the arrays are over the request budget). */
static int parse_keys(struct conn *c, struct meta m, struct batch *b, uint32_t *n)
{
    struct kvf_mr r;
    uint32_t cnt;
    if (kvf_mr_find(m.p, m.n, "keys", &r) || kvf_mr_array(&r, &cnt)) return KVF_E_MALFORMED;
    if (cnt > c->srv->cfg.max_keys) return KVF_E_TOO_MANY_KEYS;
    int rc = batch_alloc(c, b, cnt, 0);
    if (rc) return rc == -EBUSY ? KVF_E_BUSY : KVF_E_INTERNAL;
    for (uint32_t i = 0; i < cnt; i++) {
        const uint8_t *k;
        uint32_t kl;
        if (kvf_mr_bin(&r, &k, &kl) || kl == 0 || kl > c->srv->cfg.max_key_bytes || kl > KVF_KEY_MAX)
            return KVF_E_BAD_KEY;
        b->keys[i] = k;
        b->klens[i] = (uint8_t)kl;
    }
    *n = cnt;
    return 0;
}

static const char *keys_error(int e)
{
    return e == KVF_E_TOO_MANY_KEYS ? "too many keys" : e == KVF_E_BAD_KEY ? "bad key" : e == KVF_E_BUSY
           ? "server busy: request buffers over their budget" : e == KVF_E_INTERNAL ? "out of memory"
           : "missing field 'keys'";
}

static int parse_uints(struct meta m, const char *name, uint64_t *out, uint32_t n)
{
    struct kvf_mr r;
    uint32_t cnt;
    if (kvf_mr_find(m.p, m.n, name, &r) || kvf_mr_array(&r, &cnt) || cnt != n) return KVF_E_MALFORMED;
    for (uint32_t i = 0; i < n; i++)
        if (kvf_mr_uint(&r, &out[i])) return KVF_E_MALFORMED;
    return 0;
}

static int parse_uint(struct meta m, const char *name, uint64_t *v, int required)
{
    struct kvf_mr r;
    if (kvf_mr_find(m.p, m.n, name, &r)) return required ? KVF_E_MALFORMED : 0;
    return kvf_mr_uint(&r, v) ? KVF_E_MALFORMED : 0;
}

/* ---------------------------------------------------------------- simple ops */

/* Whether the al bytes at a are the token, in time that depends only on the
 * token's length (not on where a guess first differs, nor on al). */
static int token_equal(const char *a, uint32_t al, const char *token)
{
    size_t tl = strlen(token);
    volatile uint8_t diff = (uint8_t)(al != tl);
    for (size_t i = 0; i < tl; i++) diff |= (uint8_t)(token[i] ^ (i < al ? a[i] : 0));
    return diff == 0;
}

static void op_hello(struct conn *c, struct meta m)
{
    struct kvf_server *s = c->srv;
    struct kvf_mr r;
    int64_t version;
    if (kvf_mr_find(m.p, m.n, "version", &r) || kvf_mr_int(&r, &version)) {
        reject(c, KVF_E_MALFORMED, "missing field 'version'");
        return;
    }
    if (version != KVF_VERSION) { reject(c, KVF_E_BAD_VERSION, KVF_BAD_VERSION_MSG); return; }
    if (s->cfg.auth) {
        const char *a;
        uint32_t al;
        if (kvf_mr_find(m.p, m.n, "auth", &r) || kvf_mr_str(&r, &a, &al) || !token_equal(a, al, s->cfg.auth)) {
            reject(c, KVF_E_AUTH_FAILED, "authentication failed");
            return;
        }
    }
    c->authed = 1;
    if (!c->is_unix && kvf_mr_find(m.p, m.n, "transports", &r) == 0) {
        uint32_t n;
        if (kvf_mr_array(&r, &n) == 0) {
            for (uint32_t i = 0; i < n && i < 16; i++) {
                const char *t;
                uint32_t tl;
                if (kvf_mr_str(&r, &t, &tl)) break;
                if (tl == 6 && memcmp(t, "native", 6) == 0) c->transport = TR_NATIVE;
            }
        }
    }
    s->ctr.by_transport[c->transport]++;
    KVF_REPLY_BEGIN(s->cfg.hello_len, 0);
    kvf_mw_raw(&w, s->cfg.hello_meta, s->cfg.hello_len);
    kvf_reply_finish(c, rp, KVF_OP_HELLO, KVF_FLAG_REPLY, w.len, 0);
    kvf_conn_next_request(c);
}

static void op_keys(struct conn *c, struct meta m, int op)
{
    struct kvf_server *s = c->srv;
    uint32_t n;
    int e = parse_keys(c, m, &c->b, &n);
    if (e) { reject(c, e, keys_error(e)); return; }
    uint64_t lease_ms = 0;
    if (op == KVF_OP_LOOKUP && (parse_uint(m, "lease_ms", &lease_ms, 0) || lease_ms > KVF_MAX_LEASE_MS)) {
        _Static_assert(KVF_MAX_LEASE_MS == 3600000u, "the message below names the protocol's lease cap");
        reject(c, KVF_E_MALFORMED, "lease_ms must be in 0..3600000");
        return;
    }
    struct batch *b = &c->b;
    if (s->tier && kvf_tier_park(c, op, b, n)) return; /* keys on a tier: read, promote, come back */
    if (op == KVF_OP_GET) {
        /* client_verifies: the client checks each object against the reply's
         * checksum itself (and asks again without the flag on a mismatch),
         * so the objects go out unchecked: one pass over the bytes fewer */
        int trust = 0;
        struct kvf_mr fr;
        if (!kvf_mr_find(m.p, m.n, "client_verifies", &fr) && kvf_mr_bool(&fr, &trust)) {
            reject(c, KVF_E_MALFORMED, "client_verifies must be a bool");
            return;
        }
        /* over the server-wide reply budget only small replies are made */
        size_t need = sizeof(struct reply) + KVF_HEADER_SIZE + 32 + (size_t)n * (20 + sizeof(struct seg));
        if (need > KVF_REPLY_SMALL && s->ctr.reply_bytes + need > s->cfg.reply_budget) {
            s->ctr.reply_busy++;
            reject(c, KVF_E_BUSY, "server busy: queued replies over their budget");
            return;
        }
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
            }
            if (b->status[i]) s->ctr.hits++; else s->ctr.misses++;
        }
        rp->nseg = found;
        kvf_mw_map(&w, 2);
        kvf_mw_cstr(&w, "sizes");
        kvf_mw_array(&w, n);
        for (uint32_t i = 0; i < n; i++) kvf_mw_int(&w, b->status[i] ? (int64_t)b->sizes[i] : -1);
        kvf_mw_cstr(&w, "checksums");
        kvf_mw_array(&w, n);
        for (uint32_t i = 0; i < n; i++) kvf_mw_uint(&w, b->status[i] ? b->csums[i] : 0);
        kvf_reply_finish(c, rp, KVF_OP_GET, KVF_FLAG_REPLY, w.len, payload);
    } else if (op == KVF_OP_EXISTS) {
        KVF_REPLY_BEGIN(32 + (size_t)n, 0);
        kvf_mw_map(&w, 1);
        kvf_mw_cstr(&w, "present");
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
        while (count < n && kvf_store_lookup(s->st, b->keys[count], b->klens[count], until)) count++;
        KVF_REPLY_BEGIN(32, 0);
        kvf_mw_map(&w, 1);
        kvf_mw_cstr(&w, "count");
        kvf_mw_uint(&w, count);
        kvf_reply_finish(c, rp, KVF_OP_LOOKUP, KVF_FLAG_REPLY, w.len, 0);
    } else { /* DELETE */
        uint32_t del = 0;
        for (uint32_t i = 0; i < n; i++) {
            int d = kvf_store_delete(s->st, b->keys[i], b->klens[i]);
            if (s->tier) d |= kvf_tier_delete(s->tier, b->keys[i], b->klens[i]); /* + a tombstone on disk */
            if (s->tier) kvf_tier_shared_delete(s->tier, b->keys[i], b->klens[i]); /* and the shared file, if any */
            del += (uint32_t)d;
        }
        KVF_REPLY_BEGIN(32, 0);
        kvf_mw_map(&w, 1);
        kvf_mw_cstr(&w, "deleted");
        kvf_mw_uint(&w, del);
        kvf_reply_finish(c, rp, KVF_OP_DELETE, KVF_FLAG_REPLY, w.len, 0);
    }
    kvf_conn_next_request(c);
}

/* ---------------------------------------------------------------- PUT */

static void op_put(struct conn *c, struct meta m)
{
    struct kvf_server *s = c->srv;
    struct batch *b = &c->b;
    uint32_t n;
    int e = parse_keys(c, m, b, &n);
    if (e) { reject(c, e, keys_error(e)); return; }
    if (parse_uints(m, "sizes", b->sizes, n) || parse_uints(m, "checksums", b->csums, n)) {
        reject(c, KVF_E_MALFORMED, "sizes and checksums must be lists of ints as long as keys");
        return;
    }
    struct kvf_mr r;
    for (uint32_t i = 0; i < n; i++) b->parents[i] = NULL, b->plens[i] = 0;
    if (kvf_mr_find(m.p, m.n, "parents", &r) == 0 && !kvf_mr_is_nil(&r)) {
        uint32_t cnt;
        if (kvf_mr_array(&r, &cnt) || cnt != n) { reject(c, KVF_E_MALFORMED, "parents must be a list as long as keys"); return; }
        for (uint32_t i = 0; i < n; i++) {
            if (kvf_mr_is_nil(&r)) continue;
            const uint8_t *p;
            uint32_t pl;
            if (kvf_mr_bin(&r, &p, &pl) || pl == 0 || pl > s->cfg.max_key_bytes || pl > KVF_KEY_MAX) {
                reject(c, KVF_E_BAD_KEY, "parents must be keys or nil");
                return;
            }
            b->parents[i] = p;
            b->plens[i] = (uint8_t)pl;
        }
    }
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (b->sizes[i] > s->cfg.max_object) { reject(c, KVF_E_PAYLOAD_TOO_LARGE, "object exceeds the object size limit"); return; }
        total += b->sizes[i];
    }
    if (total != c->hdr.payload_len) { reject(c, KVF_E_LENGTH_MISMATCH, "PUT payload length disagrees with its sizes"); return; }
    b->n = n;
    b->cur = 0;
    b->park_round = 0;
    c->staged_idx = 0;
    c->batch_op = KVF_OP_PUT;
    kvf_ops_batch_step(c);
}

/* received: the object arrived through RS_OBJ and was hashed chunk by chunk */
static void finish_object(struct conn *c, uint32_t i, int received)
{
    struct kvf_server *s = c->srv;
    struct batch *b = &c->b;
    uint64_t sum = received ? kvf_conn_obj_digest(c)
                            : kvf_obj_hash(b->keys[i], b->klens[i], s->base + b->offs[i], b->sizes[i]);
    if (sum != b->csums[i]) { /* refused and counted: nothing is stored under a key its bytes do not match */
        kvf_store_unreserve(s->st, b->offs[i], b->sizes[i]);
        b->status[i] = KVF_PUT_CHECKSUM_MISMATCH;
        s->ctr.checksum_rejects++;
        return;
    }
    int rc = kvf_store_commit(s->st, b->keys[i], b->klens[i], b->offs[i], b->sizes[i], b->csums[i], b->parents[i],
                              b->plens[i]);
    b->status[i] = rc == 0 ? KVF_PUT_STORED : rc == 1 ? KVF_PUT_EXISTS : KVF_PUT_NO_SPACE;
    if (rc == 0) s->ctr.puts++;
    if (rc == 0 && s->tier) /* written through to the shared tier, if any (a copy, queued) */
        kvf_tier_shared_put(s->tier, b->keys[i], b->klens[i], s->base + b->offs[i], b->sizes[i], b->csums[i]);
}

void kvf_ops_staged(struct conn *c)
{
    c->staged = (uint32_t)c->want;
    c->staged_idx = c->b.cur + 1;
    kvf_ops_batch_step(c);
}

void kvf_ops_object_done(struct conn *c)
{
    kvf_conn_unreserved(c);
    finish_object(c, c->b.cur, 1);
    c->b.cur++;
    kvf_ops_batch_step(c);
}

/* Reserve a slot for object i of batch b. 0 reserved, 1 answered (status set,
 * nothing reserved), -1 parked (wait for the control thread). */
static int reserve_one(struct conn *c, struct batch *b, uint32_t i)
{
    struct kvf_server *s = c->srv;
    if (kvf_store_exists(s->st, b->keys[i], b->klens[i])) { b->status[i] = KVF_PUT_EXISTS; return 1; }
    int on_wire = b == &c->b && b->sizes[i]; /* a PUT object still to arrive on the socket */
    if (on_wire) {
        /* Never reserve (and evict) for a bare header: the server-wide bytes
         * reserved and not yet received stay within reserve_budget (one
         * object may always go), and the object's first bytes must be there. */
        if (s->ctr.reserved_bytes && s->ctr.reserved_bytes + b->sizes[i] > s->cfg.reserve_budget) {
            if (c->rs != RS_RESV_WAIT) {
                s->ctr.reserve_waits++;
                c->park_ms = kvf_now_ms();
            }
            c->rs = RS_RESV_WAIT;
            s->resv_waiting = 1;
            return -1;
        }
        if (c->staged_idx != i + 1) {
            if (b->sizes[i] > kvf_store_capacity(s->st)) { b->status[i] = KVF_PUT_TOO_LARGE; return 1; }
            kvf_conn_stage(c, b->sizes[i] < KVF_PUT_GATE ? (uint32_t)b->sizes[i] : KVF_PUT_GATE);
            return -1;
        }
    }
    int rc = kvf_store_reserve(s->st, b->sizes[i], &b->offs[i]);
    if (rc == -EFBIG) { b->status[i] = KVF_PUT_TOO_LARGE; return 1; }
    if (rc == -ENOSPC) {
        int exhausted;
        uint64_t round = kvf_store_round(s->st, &exhausted);
        if (b->park_round && b->park_round != round + 1 && exhausted) {
            b->status[i] = KVF_PUT_NO_SPACE;
            b->park_round = 0;
            return 1;
        }
        b->park_round = round + 1;
        kvf_conn_park(c, b->sizes[i]);
        return -1;
    }
    b->park_round = 0;
    if (on_wire) {
        c->reserved = b->sizes[i];
        s->ctr.reserved_bytes += b->sizes[i];
    }
    return 0;
}

static void put_reply(struct conn *c, struct batch *b, int op, int with_offsets)
{
    KVF_REPLY_BEGIN(48 + (size_t)b->n * 10, 0);
    kvf_mw_map(&w, with_offsets ? 3 : 1);
    if (with_offsets) {
        kvf_mw_cstr(&w, "res");
        kvf_mw_uint(&w, c->resv_id);
        kvf_mw_cstr(&w, "offsets");
        kvf_mw_array(&w, b->n);
        for (uint32_t i = 0; i < b->n; i++)
            kvf_mw_int(&w, b->status[i] == KVF_PUT_STORED ? (int64_t)b->offs[i] : -1);
    }
    kvf_mw_cstr(&w, "status");
    kvf_mw_array(&w, b->n);
    for (uint32_t i = 0; i < b->n; i++) kvf_mw_uint(&w, b->status[i]);
    kvf_reply_finish(c, rp, (uint8_t)op, KVF_FLAG_REPLY, w.len, 0);
}

void kvf_ops_batch_step(struct conn *c)
{
    struct kvf_server *s = c->srv;
    if (c->batch_op == KVF_OP_SHM_RESERVE) {
        struct batch *b = &c->resv;
        for (; b->cur < b->n; b->cur++) {
            int rc = reserve_one(c, b, b->cur);
            if (rc < 0) return;
            if (rc == 0) b->status[b->cur] = KVF_PUT_STORED; /* reserved: becomes STORED at commit */
        }
        c->resv_open = 1;
        put_reply(c, b, KVF_OP_SHM_RESERVE, 1);
        kvf_conn_next_request(c);
        return;
    }
    struct batch *b = &c->b;
    while (b->cur < b->n) {
        uint32_t i = b->cur;
        int rc = reserve_one(c, b, i);
        if (rc < 0) return;
        uint32_t staged = c->staged_idx == i + 1 ? c->staged : 0; /* consumed from the socket already */
        c->staged_idx = 0;
        if (rc == 1) {
            if (b->sizes[i] > staged) { kvf_conn_drain(c, b->sizes[i] - staged); return; }
            b->cur++;
            continue;
        }
        if (b->sizes[i] == 0) { finish_object(c, i, 0); b->cur++; continue; }
        kvf_conn_recv_obj(c, s->base + b->offs[i], b->sizes[i], staged);
        return;
    }
    put_reply(c, b, KVF_OP_PUT, 0);
    kvf_conn_next_request(c);
}

/* ---------------------------------------------------------------- shm (kvf_shm.c) */

/* The shm handlers (kvf_shm.c) share the parsing and reply helpers above. */
void kvf_ops_reject(struct conn *c, int code, const char *msg) { reject(c, code, msg); }
int kvf_ops_batch_alloc(struct conn *c, struct batch *b, uint32_t cap, int keybuf) { return batch_alloc(c, b, cap, keybuf); }
int kvf_ops_parse_keys(struct conn *c, const uint8_t *p, size_t n, struct batch *b, uint32_t *cnt)
{
    return parse_keys(c, (struct meta){p, n}, b, cnt);
}
int kvf_ops_parse_uints(const uint8_t *p, size_t n, const char *name, uint64_t *out, uint32_t cnt)
{
    return parse_uints((struct meta){p, n}, name, out, cnt);
}
int kvf_ops_parse_uint(const uint8_t *p, size_t n, const char *name, uint64_t *v, int required)
{
    return parse_uint((struct meta){p, n}, name, v, required);
}
void kvf_ops_put_reply(struct conn *c, struct batch *b, int op) { put_reply(c, b, op, 0); }

void kvf_ops_conn_gone(struct conn *c)
{
    kvf_shm_conn_gone(c);
    kvf_tier_conn_gone(c);
}

/* ---------------------------------------------------------------- dispatch */

void kvf_ops_request(struct conn *c)
{
    int op = c->hdr.opcode;
    struct meta m = {c->meta, c->hdr.meta_len};
    if (!c->authed && op != KVF_OP_HELLO) { reject(c, KVF_E_AUTH_FAILED, "authenticate with HELLO first"); return; }
    if (op < KVF_OP_HELLO || (op > KVF_OP_STATS && (op < KVF_OP_SHM_ATTACH || op > KVF_OP_SHM_COMMIT))) {
        reject(c, KVF_E_UNKNOWN_OPCODE, "unknown opcode");
        return;
    }
    /* the same rule as protocol.decode_meta: one map, nothing truncated or after it, no key twice */
    if (kvf_mr_check_meta(m.p, m.n)) {
        reject(c, KVF_E_MALFORMED, "metadata must be one msgpack map (no key twice, nothing truncated or after it)");
        return;
    }
    if (op != KVF_OP_PUT && c->hdr.payload_len) {
        reject(c, KVF_E_LENGTH_MISMATCH, "this request carries no payload");
        return;
    }
    switch (op) {
    case KVF_OP_HELLO: op_hello(c, m); break;
    case KVF_OP_PING: {
        KVF_REPLY_BEGIN(8, 0);
        kvf_mw_map(&w, 0);
        kvf_reply_finish(c, rp, KVF_OP_PING, KVF_FLAG_REPLY, w.len, 0);
        kvf_conn_next_request(c);
        break;
    }
    case KVF_OP_STATS: kvf_op_stats(c); break;
    case KVF_OP_PUT: op_put(c, m); break;
    case KVF_OP_GET:
    case KVF_OP_EXISTS:
    case KVF_OP_LOOKUP:
    case KVF_OP_DELETE: op_keys(c, m, op); break;
    default: kvf_shm_op(c, m.p, m.n, op); break;
    }
}
