/* kvf_shm.c: the same-host (shm) side of the native server, run on the loop thread.
 *
 * A client on this host connects to the unix socket (a filesystem socket the
 * Python side creates 0600 / 0660 in a private directory), is checked with
 * SO_PEERCRED as it is accepted (kvf_shm_peer_refused), says HELLO (with the
 * token when one is set: no other frame is served before it), and asks for
 * the arena (SHM_ATTACH: the reply carries the memfd, sealed against shrink
 * and grow by kvf_store_new). Then:
 *
 *   SHM_LEASE   keys -> offsets/sizes/checksums; the found entries stay
 *               pinned until SHM_RELEASE, disconnect, or the lease cap
 *               (max_lease_ms) runs out: the periodic sweep drops it.
 *   SHM_RELEASE drop a lease (no reply).
 *   SHM_RESERVE keys + sizes (+ parents) -> slots in no index; one open
 *               reservation per connection. The parent keys are copied out
 *               of the request and kept until COMMIT, where they reach the
 *               eviction policy with the INSERT events. An open reservation
 *               expires after the stall timeout (sweep); its slots are freed
 *               and a later COMMIT is answered "reservation expired".
 *   SHM_COMMIT  reservation + checksums: each slot is verified against its
 *               checksum, then indexed.
 *
 * An attached client maps the whole arena read-write: see docs/notes/security.md.
 * The wire messages are kvfabric.protocol.messages Shm*Request / Shm*Reply.
 */
#define _GNU_SOURCE
#include "kvf_server_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvf_hash.h"
#include "kvf_tier.h"

#define LEASE_CAP_DEFAULT_MS ((int64_t)KVF_MAX_LEASE_MS) /* the protocol's cap when max_lease_ms is 0 */

static int64_t lease_cap_ms(const struct kvf_server *s)
{
    return s->cfg.max_lease_ms ? (int64_t)s->cfg.max_lease_ms : LEASE_CAP_DEFAULT_MS;
}

/* How long an open reservation may wait for its COMMIT. */
static int64_t reserve_ms(const struct kvf_server *s)
{
    return s->cfg.stall_ms ? (int64_t)s->cfg.stall_ms : lease_cap_ms(s);
}

/* ---------------------------------------------------------------- leases, reservations */

static void lease_drop(struct conn *c, uint32_t i)
{
    struct lease *l = &c->leases[i];
    for (uint32_t k = 0; k < l->n; k++) kvf_store_release(c->srv->st, l->entries[k]);
    free(l->entries);
    c->leases[i] = c->leases[--c->nleases];
}

/* Free the slots of the open (or half-handed-out) reservation. No return. */
static void resv_abort(struct conn *c)
{
    struct batch *b = &c->resv;
    if (!c->resv_open && c->batch_op != KVF_OP_SHM_RESERVE) return;
    uint32_t upto = c->resv_open ? b->n : b->cur;
    for (uint32_t i = 0; i < upto; i++)
        if (b->status[i] == KVF_PUT_STORED) kvf_store_unreserve(c->srv->st, b->offs[i], b->sizes[i]);
    c->resv_open = 0;
    c->resv_until_ms = 0;
}

void kvf_shm_conn_gone(struct conn *c)
{
    while (c->nleases) lease_drop(c, c->nleases - 1);
    free(c->leases);
    c->leases = NULL;
    resv_abort(c);
    kvf_batch_free(&c->resv);
    free(c->resv_parents);
    c->resv_parents = NULL;
    free(c->resv_groups);
    c->resv_groups = NULL;
}

/* groups + group_parts (kvf_parse_groups), the group keys copied into c->resv_groups so they
 * outlive the metadata buffer until COMMIT. Returns 0 or a wire error code. */
static int reserve_groups(struct conn *c, const uint8_t *m, size_t mn, uint32_t n)
{
    struct batch *b = &c->resv;
    b->nsref = 0; /* shm puts carry no namespace tag (the client sends tagged PUTs over the socket) */
    int e = kvf_parse_groups(c, (struct kvf_meta){m, mn}, b, n);
    if (e || n == 0 || !b->groups[0]) return e;
    if (!c->resv_groups && !(c->resv_groups = malloc((size_t)c->srv->cfg.max_keys * KVF_KEY_MAX)))
        return KVF_E_INTERNAL;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *dst = c->resv_groups + (size_t)i * KVF_KEY_MAX;
        memcpy(dst, b->groups[i], b->glens[i]);
        b->groups[i] = dst;
    }
    return 0;
}

void kvf_shm_sweep(struct kvf_server *s, int64_t now)
{
    for (struct conn *c = s->conns; c; c = c->next) {
        if (!(c->is_unix || c->remote_arena) || c->closing) continue;
        for (uint32_t i = 0; i < c->nleases;) {
            if (now > c->leases[i].until_ms) {
                lease_drop(c, i); /* the last one moved into i: look at i again */
                s->ctr.shm_leases_expired++;
            } else {
                i++;
            }
        }
        if (c->resv_open && c->batch_op != KVF_OP_SHM_RESERVE) {
            /* the clock starts at the first sweep after the RESERVE reply (<= 500 ms late) */
            if (!c->resv_until_ms) {
                c->resv_until_ms = now + reserve_ms(s);
            } else if (now > c->resv_until_ms) {
                resv_abort(c);
                c->resv_expired = c->resv_id;
                s->ctr.shm_reservations_expired++;
            }
        }
    }
}

/* ---------------------------------------------------------------- peers */

static int id_in(uint32_t id, const uint32_t *list, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (list[i] == id) return 1;
    return 0;
}

/* 1 if the peer on fd may use shm: same uid as the server, or a uid / gid (its
 * effective gid or any supplementary group) in the configured lists. */
static int peer_allowed(const struct kvf_server *s, int fd, struct ucred *cr)
{
    socklen_t l = sizeof *cr;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, cr, &l) || l != sizeof *cr) return 0;
    if (cr->uid == geteuid() || id_in(cr->uid, s->cfg.shm_uids, s->cfg.n_shm_uids)) return 1;
    if (!s->cfg.n_shm_gids) return 0;
    if (id_in(cr->gid, s->cfg.shm_gids, s->cfg.n_shm_gids)) return 1;
    gid_t groups[256];
    socklen_t gl = sizeof groups;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &gl)) return 0; /* ERANGE: > 256 groups */
    for (socklen_t i = 0; i < gl / sizeof(gid_t); i++)
        if (id_in(groups[i], s->cfg.shm_gids, s->cfg.n_shm_gids)) return 1;
    return 0;
}

int kvf_shm_peer_refused(struct kvf_server *s, int fd)
{
    struct ucred cr = {0, (uid_t)-1, (gid_t)-1};
    if (peer_allowed(s, fd, &cr)) return 0;
    s->ctr.shm_refused++;
    s->ctr.errors[KVF_E_AUTH_FAILED]++;
    /* One AUTH_FAILED error frame (request id 0), then close. A fresh socket's
     * send buffer is empty, so the small frame fits; MSG_DONTWAIT: never block. */
    uint8_t frame[KVF_HEADER_SIZE + 160];
    char msg[128];
    snprintf(msg, sizeof msg, "shm peer uid %u gid %u is not allowed (see --shm-allow-uid / --shm-allow-gid)",
             (unsigned)cr.uid, (unsigned)cr.gid);
    size_t n = kvf_error_frame(frame, sizeof frame, KVF_E_AUTH_FAILED, msg);
    if (n && send(fd, frame, n, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) { /* plain close */ }
    close(fd);
    return 1;
}

/* ---------------------------------------------------------------- handlers */

static void op_attach(struct conn *c)
{
    struct kvf_server *s = c->srv;
    KVF_REPLY_BEGIN(64 + (c->is_unix ? 0 : s->nixl_md_len), 0);
    kvf_mw_map(&w, c->is_unix ? 1 : 3);
    kvf_mw_cstr(&w, KVF_F_CAPACITY);
    kvf_mw_uint(&w, kvf_store_capacity(s->st));
    if (c->is_unix) {
        rp->pass_fd = kvf_store_memfd(s->st);
    } else { /* remote (nixl): where the arena is registered, and the agent that registered it */
        kvf_mw_cstr(&w, KVF_F_NIXL_AGENT);
        kvf_mw_bin(&w, s->nixl_md, s->nixl_md_len);
        kvf_mw_cstr(&w, KVF_F_ARENA_BASE);
        kvf_mw_uint(&w, s->nixl_base);
    }
    kvf_reply_finish(c, rp, KVF_OP_SHM_ATTACH, KVF_FLAG_REPLY, w.len, 0);
    kvf_conn_next_request(c);
}

static void op_release(struct conn *c, const uint8_t *m, size_t mn)
{
    uint64_t id;
    if (kvf_parse_uint((struct kvf_meta){m, mn}, KVF_F_LEASE, &id, 1)) { kvf_reject(c, KVF_E_MALFORMED, "missing field '" KVF_F_LEASE "'"); return; }
    for (uint32_t i = 0; i < c->nleases; i++)
        if (c->leases[i].id == id) { lease_drop(c, i); break; } /* an expired lease is already gone */
    kvf_conn_next_request(c); /* no reply: the client does not wait for it */
}

static void op_lease(struct conn *c, const uint8_t *m, size_t mn)
{
    struct kvf_server *s = c->srv;
    uint32_t n;
    int e = kvf_parse_keys(c, (struct kvf_meta){m, mn}, &c->b, &n);
    if (e) { kvf_reject(c, e, "bad keys"); return; }
    if (c->nleases >= s->cfg.max_in_flight) { kvf_reject(c, KVF_E_BUSY, "too many open leases"); return; }
    if (!c->leases && !(c->leases = calloc(s->cfg.max_in_flight, sizeof(struct lease)))) {
        kvf_reject(c, KVF_E_INTERNAL, "out of memory");
        return;
    }
    struct lease *l = &c->leases[c->nleases];
    l->entries = malloc(sizeof(uint32_t) * (n ? n : 1));
    if (!l->entries) { kvf_reject(c, KVF_E_INTERNAL, "out of memory"); return; }
    l->id = ++c->next_lease;
    l->n = 0;
    l->until_ms = kvf_now_ms() + lease_cap_ms(s);
    c->nleases++;
    KVF_REPLY_BEGIN(48 + (size_t)n * 30, 0);
    struct batch *b = &c->b;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id;
        b->status[i] = kvf_store_acquire(s->st, b->keys[i], b->klens[i], &id, &b->offs[i], &b->sizes[i],
                                         &b->csums[i]) == 0;
        if (b->status[i]) { l->entries[l->n++] = id; s->ctr.hits++; } else s->ctr.misses++;
    }
    kvf_mw_map(&w, 4);
    kvf_mw_cstr(&w, KVF_F_LEASE);
    kvf_mw_uint(&w, l->id);
    kvf_mw_cstr(&w, KVF_F_OFFSETS);
    kvf_mw_array(&w, n);
    for (uint32_t i = 0; i < n; i++) kvf_mw_int(&w, b->status[i] ? (int64_t)b->offs[i] : -1);
    kvf_mw_cstr(&w, KVF_F_SIZES);
    kvf_mw_array(&w, n);
    for (uint32_t i = 0; i < n; i++) kvf_mw_int(&w, b->status[i] ? (int64_t)b->sizes[i] : -1);
    kvf_mw_cstr(&w, KVF_F_CHECKSUMS);
    kvf_mw_array(&w, n);
    for (uint32_t i = 0; i < n; i++) kvf_mw_uint(&w, b->status[i] ? b->csums[i] : 0);
    kvf_reply_finish(c, rp, KVF_OP_SHM_LEASE, KVF_FLAG_REPLY, w.len, 0);
    kvf_conn_next_request(c);
}

/* parents (nil, or a list as long as keys of keys-or-nil) copied into
 * c->resv_parents, so they outlive the request's metadata buffer until COMMIT.
 * Returns 0 or a wire error code. */
static int reserve_parents(struct conn *c, const uint8_t *m, size_t mn, uint32_t n)
{
    struct kvf_server *s = c->srv;
    struct batch *b = &c->resv;
    struct kvf_mr r;
    for (uint32_t i = 0; i < n; i++) b->parents[i] = NULL, b->plens[i] = 0;
    if (kvf_mr_find(m, mn, KVF_F_PARENTS, &r) || kvf_mr_is_nil(&r)) return 0;
    uint32_t cnt;
    if (kvf_mr_array(&r, &cnt) || cnt != n) return KVF_E_MALFORMED;
    if (!c->resv_parents && !(c->resv_parents = malloc((size_t)s->cfg.max_keys * KVF_KEY_MAX)))
        return KVF_E_INTERNAL;
    for (uint32_t i = 0; i < n; i++) {
        if (kvf_mr_is_nil(&r)) continue;
        const uint8_t *p;
        uint32_t pl;
        if (kvf_mr_bin(&r, &p, &pl) || pl == 0 || pl > s->cfg.max_key_bytes || pl > KVF_KEY_MAX) return KVF_E_BAD_KEY;
        uint8_t *dst = c->resv_parents + (size_t)i * KVF_KEY_MAX;
        memcpy(dst, p, pl);
        b->parents[i] = dst;
        b->plens[i] = (uint8_t)pl;
    }
    return 0;
}

static void op_reserve(struct conn *c, const uint8_t *m, size_t mn)
{
    struct kvf_server *s = c->srv;
    resv_abort(c); /* one open reservation per connection */
    if (kvf_batch_alloc(c, &c->resv, 1, 1)) { /* a key buffer; parse_keys sizes it to the keys */ kvf_reject(c, KVF_E_INTERNAL, "out of memory"); return; }
    struct batch *b = &c->resv;
    uint32_t n;
    int e = kvf_parse_keys(c, (struct kvf_meta){m, mn}, b, &n);
    if (e) { kvf_reject(c, e, "bad keys"); return; }
    if (kvf_parse_uints((struct kvf_meta){m, mn}, KVF_F_SIZES, b->sizes, n)) {
        kvf_reject(c, KVF_E_MALFORMED, "sizes must be as long as keys");
        return;
    }
    e = reserve_parents(c, m, mn, n);
    if (e) {
        kvf_reject(c, e, e == KVF_E_BAD_KEY ? "parents must be keys or nil" : e == KVF_E_INTERNAL
                                 ? "out of memory" : "parents must be a list as long as keys");
        return;
    }
    if ((e = reserve_groups(c, m, mn, n))) {
        kvf_reject(c, e, e == KVF_E_INTERNAL ? "out of memory" : kvf_groups_error(e));
        return;
    }
    b->gopen = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (b->sizes[i] > s->cfg.max_object) {
            kvf_reject(c, KVF_E_PAYLOAD_TOO_LARGE, "object exceeds the object size limit");
            return;
        }
        memcpy(b->keybuf + (size_t)i * KVF_KEY_MAX, b->keys[i], b->klens[i]);
        b->keys[i] = b->keybuf + (size_t)i * KVF_KEY_MAX;
        b->status[i] = KVF_PUT_NO_SPACE;
    }
    b->n = n;
    b->cur = 0;
    b->park_round = 0;
    c->resv_id++;
    c->resv_until_ms = 0;
    c->batch_op = KVF_OP_SHM_RESERVE;
    kvf_batch_step(c); /* replies (offsets) and sets resv_open once every slot is handed out */
}

static void op_commit(struct conn *c, const uint8_t *m, size_t mn)
{
    struct kvf_server *s = c->srv;
    uint64_t id;
    struct batch *b = &c->resv;
    if (kvf_parse_uint((struct kvf_meta){m, mn}, KVF_F_RES, &id, 1)) { kvf_reject(c, KVF_E_MALFORMED, "missing field '" KVF_F_RES "'"); return; }
    if (!c->resv_open && id && id == c->resv_expired) {
        kvf_reject(c, KVF_E_MALFORMED, "reservation expired (not committed within the stall timeout): "
                                           "its slots were freed; PUT again");
        return;
    }
    if (!c->resv_open || id != c->resv_id) {
        kvf_reject(c, KVF_E_MALFORMED, "no open reservation with that id");
        return;
    }
    uint64_t *cs; /* scratch for the sent checksums */
    if (kvf_batch_alloc(c, &c->b, b->n, 0) || kvf_parse_uints((struct kvf_meta){m, mn}, KVF_F_CHECKSUMS, (cs = c->b.csums), b->n)) {
        kvf_reject(c, KVF_E_MALFORMED, "checksums must be as long as the reservation");
        return;
    }
    for (uint32_t i = 0; i < b->n; i++) {
        if (b->groups[i]) { /* a group run: verified part by part, then committed or refused whole */
            b->gstart = i;
            b->gend = i + b->gparts[i];
            b->gopen = 1;
            b->gfail = 0;
            for (; i < b->gend; i++) {
                if (b->status[i] != KVF_PUT_STORED) continue;
                if (kvf_obj_hash(b->keys[i], b->klens[i], s->base + b->offs[i], b->sizes[i]) != cs[i]) {
                    kvf_store_unreserve(s->st, b->offs[i], b->sizes[i]);
                    b->status[i] = KVF_PUT_CHECKSUM_MISMATCH;
                    s->ctr.checksum_rejects++;
                    if (!b->gfail) b->gfail = KVF_PUT_CHECKSUM_MISMATCH;
                    continue;
                }
                b->csums[i] = cs[i];
                b->status[i] = KVF_PUT_PENDING;
                s->ctr.bytes_in += b->sizes[i];
            }
            i--;
            kvf_put_group_close(s, b);
            continue;
        }
        if (b->status[i] != KVF_PUT_STORED) continue;
        if (kvf_obj_hash(b->keys[i], b->klens[i], s->base + b->offs[i], b->sizes[i]) != cs[i]) {
            kvf_store_unreserve(s->st, b->offs[i], b->sizes[i]);
            b->status[i] = KVF_PUT_CHECKSUM_MISMATCH;
            s->ctr.checksum_rejects++;
            continue;
        }
        int rc = kvf_store_commit(s->st, b->keys[i], b->klens[i], b->offs[i], b->sizes[i], cs[i], b->parents[i],
                                  b->plens[i], 0);
        b->status[i] = rc == 0 ? KVF_PUT_STORED : rc == 1 ? KVF_PUT_EXISTS : KVF_PUT_NO_SPACE;
        if (rc == 0) s->ctr.puts++;
        if (rc == 0 && s->tier) /* written through to the shared tier, if any (a copy, queued) */
            kvf_tier_shared_put(s->tier, b->keys[i], b->klens[i], s->base + b->offs[i], b->sizes[i], cs[i], 0);
        s->ctr.bytes_in += b->sizes[i];
    }
    c->resv_open = 0;
    c->resv_until_ms = 0;
    kvf_put_reply(c, b, KVF_OP_SHM_COMMIT, 0);
    kvf_conn_next_request(c);
}

int kvf_server_set_remote_arena(struct kvf_server *s, const void *md, size_t len, uint64_t base)
{
    if (len == 0 || len + 64 > s->cfg.max_meta) return -EINVAL; /* the ATTACH reply must fit a reply's metadata */
    uint8_t *copy = malloc(len);
    if (!copy) return -ENOMEM;
    memcpy(copy, md, len);
    free(s->nixl_md);
    s->nixl_md = copy;
    s->nixl_md_len = (uint32_t)len;
    s->nixl_base = base;
    return 0;
}

void kvf_shm_op(struct conn *c, const uint8_t *meta, size_t len, int op)
{
    if (!c->is_unix && !c->remote_arena) {
        kvf_reject(c, KVF_E_UNKNOWN_OPCODE, "shm operations need a same-host (unix socket) or nixl connection");
        return;
    }
    switch (op) {
    case KVF_OP_SHM_ATTACH: op_attach(c); break;
    case KVF_OP_SHM_RELEASE: op_release(c, meta, len); break;
    case KVF_OP_SHM_LEASE: op_lease(c, meta, len); break;
    case KVF_OP_SHM_RESERVE: op_reserve(c, meta, len); break;
    default: op_commit(c, meta, len); break;
    }
}
