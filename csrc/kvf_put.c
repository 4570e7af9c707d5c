/* kvf_put.c: the PUT pipeline of the native server (and the slot hand-out of
 * an shm RESERVE, which is the same batch without the bytes on the socket).
 *
 * PUT and the shm RESERVE are "batches": objects are handled one at a time
 * (kvf_batch_step), because a slot may have to wait for the control thread to
 * evict (the connection parks) and a PUT object is received straight into its
 * slot before the next one is looked at. A PUT object's first bytes are
 * staged before its slot is reserved (kvf_conn_stage; kvf_put_staged when
 * they are in), the rest received into the slot and hashed as it lands
 * (kvf_put_object_done when it is whole), checked against the key-bound
 * checksum and committed. Called by the dispatcher (kvf_ops.c), the shm
 * handlers (kvf_shm.c), the budgets' wake-up (kvf_limits.c) and the loop's
 * receive completions (kvf_server.c); calls only the request helpers
 * (kvf_request.c), the connection (kvf_server_conn.c), the store and the
 * shared tier's write-through.
 *
 * Groups (issue 23): the parts of a group come consecutively (kvf_parse_groups
 * checked it). Each part is reserved, received and verified as above but not
 * committed (KVF_PUT_PENDING, its slot kept); after the run's last part the
 * group is committed whole (kvf_store_commit_group) or, when any part was too
 * large, found no space or failed its checksum, every kept slot is given back
 * and every part of the run answers that status. A group larger than the arena
 * is refused before anything is reserved. A connection that dies mid-group
 * gives its kept slots back (kvf_put_conn_gone): nothing of the group is indexed.
 */
#define _GNU_SOURCE
#include "kvf_server_int.h"

#include <errno.h>
#include <string.h>

#include "kvf_hash.h"
#include "kvf_tier.h"

void kvf_op_put(struct conn *c, struct kvf_meta m)
{
    struct kvf_server *s = c->srv;
    struct batch *b = &c->b;
    uint32_t n;
    int e = kvf_parse_keys(c, m, b, &n);
    if (e) { kvf_reject(c, e, kvf_keys_error(e)); return; }
    if (kvf_parse_uints(m, KVF_F_SIZES, b->sizes, n) || kvf_parse_uints(m, KVF_F_CHECKSUMS, b->csums, n)) {
        kvf_reject(c, KVF_E_MALFORMED, "sizes and checksums must be lists of ints as long as keys");
        return;
    }
    struct kvf_mr r;
    for (uint32_t i = 0; i < n; i++) b->parents[i] = NULL, b->plens[i] = 0;
    if (kvf_mr_find(m.p, m.n, KVF_F_PARENTS, &r) == 0 && !kvf_mr_is_nil(&r)) {
        uint32_t cnt;
        if (kvf_mr_array(&r, &cnt) || cnt != n) { kvf_reject(c, KVF_E_MALFORMED, "parents must be a list as long as keys"); return; }
        for (uint32_t i = 0; i < n; i++) {
            if (kvf_mr_is_nil(&r)) continue;
            const uint8_t *p;
            uint32_t pl;
            if (kvf_mr_bin(&r, &p, &pl) || pl == 0 || pl > s->cfg.max_key_bytes || pl > KVF_KEY_MAX) {
                kvf_reject(c, KVF_E_BAD_KEY, "parents must be keys or nil");
                return;
            }
            b->parents[i] = p;
            b->plens[i] = (uint8_t)pl;
        }
    }
    if ((e = kvf_parse_groups(c, m, b, n))) { kvf_reject(c, e, kvf_groups_error(e)); return; }
    if ((e = kvf_parse_ns(c, m, &b->nsref))) { kvf_reject(c, e, kvf_ns_error(e)); return; }
    b->gopen = 0;
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (b->sizes[i] > s->cfg.max_object) { kvf_reject(c, KVF_E_PAYLOAD_TOO_LARGE, "object exceeds the object size limit"); return; }
        total += b->sizes[i];
    }
    if (total != c->hdr.payload_len) { kvf_reject(c, KVF_E_LENGTH_MISMATCH, "PUT payload length disagrees with its sizes"); return; }
    b->n = n;
    b->cur = 0;
    b->park_round = 0;
    c->staged_idx = 0;
    c->batch_op = KVF_OP_PUT;
    kvf_batch_step(c);
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
        if (b->gopen && !b->gfail) b->gfail = KVF_PUT_CHECKSUM_MISMATCH;
        return;
    }
    if (b->gopen) { b->status[i] = KVF_PUT_PENDING; return; } /* committed with its group */
    int rc = kvf_store_commit(s->st, b->keys[i], b->klens[i], b->offs[i], b->sizes[i], b->csums[i], b->parents[i],
                              b->plens[i], b->nsref);
    b->status[i] = rc == 0 ? KVF_PUT_STORED : rc == 1 ? KVF_PUT_EXISTS : KVF_PUT_NO_SPACE;
    if (rc == 0) s->ctr.puts++;
    if (rc == 0 && s->tier) /* written through to the shared tier, if any (a copy, queued) */
        kvf_tier_shared_put(s->tier, b->keys[i], b->klens[i], s->base + b->offs[i], b->sizes[i], b->csums[i],
                                b->nsref);
}

/* The group run starting at i: its bounds, and TOO_LARGE at once when it can never fit whole. */
static void group_open(struct kvf_server *s, struct batch *b, uint32_t i)
{
    b->gopen = 1;
    b->gfail = 0;
    b->gstart = i;
    b->gend = i + b->gparts[i];
    uint64_t total = 0;
    for (uint32_t k = i; k < b->gend; k++) total += b->sizes[k];
    if (total > kvf_store_capacity(s->st)) b->gfail = KVF_PUT_TOO_LARGE;
}

/* Every part of the run is answered: commit the group whole, or refuse it whole.
 * Its parts verified and kept are KVF_PUT_PENDING (the shm COMMIT marks them so too). */
void kvf_put_group_close(struct kvf_server *s, struct batch *b)
{
    uint32_t m = 0, g = b->gstart;
    b->gopen = 0;
    if (!b->gfail) {
        for (uint32_t k = g; k < b->gend; k++)
            if (b->status[k] == KVF_PUT_PENDING) b->gruns[m++] = k;
        if (m && kvf_store_commit_group(s->st, m, b->gruns, b->keys, b->klens, b->offs, b->sizes, b->csums,
                                        b->parents[b->gruns[0]], b->plens[b->gruns[0]], b->groups[g], b->glens[g],
                                        b->gparts[g], b->nsref, b->status) < 0) {
            b->gfail = KVF_PUT_NO_SPACE; /* out of index memory: the slots were given back */
            for (uint32_t k = 0; k < m; k++) b->status[b->gruns[k]] = KVF_PUT_NO_SPACE;
        }
    }
    if (b->gfail) {
        for (uint32_t k = g; k < b->gend; k++) {
            if (b->status[k] == KVF_PUT_PENDING) kvf_store_unreserve(s->st, b->offs[k], b->sizes[k]);
            b->status[k] = b->gfail;
        }
        s->ctr.groups_refused++;
        return;
    }
    if (m) s->ctr.groups_stored++;
    for (uint32_t k = 0; k < m; k++) {
        uint32_t i = b->gruns[k];
        if (b->status[i] != KVF_PUT_STORED) continue;
        s->ctr.puts++;
        if (s->tier) /* written through to the shared tier, if any (a copy, queued) */
            kvf_tier_shared_put(s->tier, b->keys[i], b->klens[i], s->base + b->offs[i], b->sizes[i], b->csums[i],
                                b->nsref);
    }
}

void kvf_put_conn_gone(struct conn *c)
{
    struct batch *b = &c->b;
    if (c->batch_op != KVF_OP_PUT || !b->gopen) return;
    for (uint32_t k = b->gstart; k < b->cur && k < b->gend; k++)
        if (b->status[k] == KVF_PUT_PENDING) kvf_store_unreserve(c->srv->st, b->offs[k], b->sizes[k]);
    b->gopen = 0;
    c->srv->ctr.groups_torn++;
}

void kvf_put_staged(struct conn *c)
{
    c->staged = (uint32_t)c->want;
    c->staged_idx = c->b.cur + 1;
    kvf_batch_step(c);
}

/* The current object is whole in its slot (hashed as it landed): give its
 * reservation back, commit or refuse it, go to the next one. */
static void object_received(struct conn *c)
{
    kvf_conn_unreserved(c);
    finish_object(c, c->b.cur, 1);
    c->b.cur++;
}

void kvf_put_object_done(struct conn *c)
{
    object_received(c);
    kvf_batch_step(c);
}

static int reserve_one(struct conn *c, struct batch *b, uint32_t i);

/* shm RESERVE: a group's slots are handed out whole or not at all (the run's
 * refusal status for every part); COMMIT then commits or refuses it whole. */
static void resv_group_close(struct kvf_server *s, struct batch *b)
{
    b->gopen = 0;
    if (!b->gfail) return;
    for (uint32_t k = b->gstart; k < b->gend; k++) {
        if (b->status[k] == KVF_PUT_STORED) kvf_store_unreserve(s->st, b->offs[k], b->sizes[k]);
        b->status[k] = b->gfail;
    }
    s->ctr.groups_refused++;
}

/* Reserve a slot for object i of batch b. 0 reserved, 1 answered (status set,
 * nothing reserved), -1 parked (wait for the control thread). */
static int reserve_one(struct conn *c, struct batch *b, uint32_t i)
{
    struct kvf_server *s = c->srv;
    if (b->gopen && b->gfail) { b->status[i] = b->gfail; return 1; } /* its group is refused already */
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

void kvf_batch_step(struct conn *c)
{
    struct kvf_server *s = c->srv;
    if (c->batch_op == KVF_OP_SHM_RESERVE) {
        struct batch *b = &c->resv;
        for (;; b->cur++) {
            if (b->gopen && b->cur >= b->gend) resv_group_close(s, b);
            if (b->cur >= b->n) break;
            if (!b->gopen && b->groups[b->cur]) group_open(s, b, b->cur);
            int rc = reserve_one(c, b, b->cur);
            if (rc < 0) return;
            if (rc == 0) b->status[b->cur] = KVF_PUT_STORED; /* reserved: becomes STORED at commit */
            else if (b->gopen && !b->gfail && b->status[b->cur] != KVF_PUT_EXISTS) b->gfail = b->status[b->cur];
        }
        c->resv_open = 1;
        kvf_put_reply(c, b, KVF_OP_SHM_RESERVE, 1);
        kvf_conn_next_request(c);
        return;
    }
    struct batch *b = &c->b;
    for (;;) {
        if (b->gopen && b->cur >= b->gend) kvf_put_group_close(s, b);
        if (b->cur >= b->n) break;
        uint32_t i = b->cur;
        if (!b->gopen && b->groups[i]) group_open(s, b, i);
        int rc = reserve_one(c, b, i);
        if (rc < 0) return;
        uint32_t staged = c->staged_idx == i + 1 ? c->staged : 0; /* consumed from the socket already */
        c->staged_idx = 0;
        if (rc == 1 && b->gopen && !b->gfail && b->status[i] != KVF_PUT_EXISTS)
            b->gfail = b->status[i]; /* too large or no space: the whole group is refused */
        if (rc == 1) {
            if (b->sizes[i] > staged) { kvf_conn_drain(c, b->sizes[i] - staged); return; }
            b->cur++;
            continue;
        }
        if (b->sizes[i] == 0) { finish_object(c, i, 0); b->cur++; continue; }
        /* received straight into its slot; whole already when it fit in the staging buffer */
        if (!kvf_conn_recv_obj(c, s->base + b->offs[i], b->sizes[i], staged)) return;
        object_received(c);
    }
    kvf_put_reply(c, b, KVF_OP_PUT, 0);
    kvf_conn_next_request(c);
}
