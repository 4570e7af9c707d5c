/* kvf_server_conn.c: the server's side of a connection, the bottom of its
 * request path (the loop, kvf_server.c, is the top; docs/ARCHITECTURE.md has
 * the layers). Posts the connection's receives (header, metadata, a PUT
 * object into its slot, a drain), starts closing it, parks it for space, and
 * owns its per-request buffers and budgets: a request's batch arrays, what is
 * given back after each request, whether its queued replies hold it. Every
 * function here returns to its caller: none calls up into the handlers (a
 * finished receive is dispatched by the loop's CQE handling; a PUT object
 * already whole in its staging buffer is reported by kvf_conn_recv_obj's
 * return value).
 */
#define _GNU_SOURCE
#include "kvf_server_int.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvf_copy.h"
#include "kvf_hash.h"

/* ---------------------------------------------------------------- ring and clock */

struct io_uring_sqe *kvf_sqe_get(struct kvf_server *s)
{
    struct io_uring_sqe *q = kvf_ring_sqe(&s->ring);
    if (!q) {
        kvf_ring_submit_wait(&s->ring, 0, 0);
        q = kvf_ring_sqe(&s->ring);
    }
    return q; /* NULL only if the kernel consumed nothing: callers treat it as -EBUSY */
}

/* The min_rate bound of a frame or reply of `bytes` starting at `now` (as the
 * Python server: stall timeout + size / min_rate); 0 when there is none. */
int64_t kvf_rate_deadline(const struct kvf_server *s, int64_t now, uint64_t bytes)
{
    if (!s->cfg.min_rate || !s->cfg.stall_ms) return 0;
    return now + (int64_t)s->cfg.stall_ms + (int64_t)((double)bytes * 1000.0 / (double)s->cfg.min_rate) + 1;
}

void kvf_server_wake(struct kvf_server *s)
{
    uint64_t one = 1;
    if (write(s->efd, &one, sizeof one) < 0) { /* counter saturated: a wake is pending anyway */ }
}

/* ---------------------------------------------------------------- receives */

void kvf_conn_close(struct conn *c)
{
    if (c->closing) return;
    c->closing = 1;
    shutdown(c->fd, SHUT_RDWR); /* completes any recv/send in flight */
}

void kvf_conn_recv_more(struct conn *c)
{
    struct io_uring_sqe *q = kvf_sqe_get(c->srv);
    if (!q) { kvf_conn_close(c); return; }
    uint64_t n = c->want - c->got;
    if (n > (1u << 30)) n = 1u << 30;
    if (c->rs == RS_OBJ && n > KVF_OBJ_CHUNK) n = KVF_OBJ_CHUNK;
    q->opcode = IORING_OP_RECV;
    q->fd = c->fd;
    q->addr = (uint64_t)(uintptr_t)(c->rbuf + c->got);
    q->len = (uint32_t)n;
    /* A header is read without MSG_WAITALL, so that each byte of a trickled
     * one completes (and counts as a frame in progress for the stall and
     * min_rate checks); the rest of a frame has a known length: WAITALL. */
    q->msg_flags = c->rs == RS_HDR ? 0 : MSG_WAITALL;
    q->user_data = KVF_TAG(c, T_RECV);
    c->refs++;
    c->recv_posted = 1;
}

void kvf_conn_recv_into(struct conn *c, void *buf, uint64_t n, enum rs stage)
{
    if (stage == RS_OBJ) {
        if (!c->xxh && !(c->xxh = kvf_hash_new())) { kvf_conn_close(c); return; }
        /* RS_OBJ receives object b.cur of the PUT batch (kvf_batch_step, kvf_put.c):
         * its checksum is seeded from its key (kvf_hash.h) */
        kvf_hash_reset_key(c->xxh, c->b.keys[c->b.cur], c->b.klens[c->b.cur]);
    }
    c->rs = stage;
    c->rbuf = buf;
    c->want = n;
    c->got = 0;
    kvf_conn_recv_more(c);
}

void kvf_conn_drain(struct conn *c, uint64_t n)
{
    if (!c->scratch && !(c->scratch = malloc(1 << 16))) { kvf_conn_close(c); return; }
    c->drain_left = n;
    kvf_conn_recv_into(c, c->scratch, n < (1 << 16) ? n : (1 << 16), RS_DRAIN);
}

/* Ready for the next header, unless too many replies (or bytes of them) are
 * queued, or the server is stopping (then close once the replies are out). */
void kvf_conn_next_request(struct conn *c)
{
    c->batch_op = 0;
    c->rx_deadline_ms = 0;
    kvf_conn_shrink(c);
    if (c->closing) return;
    if (c->srv->stop) c->close_after_send = 1;
    if (c->close_after_send) {
        c->rs = RS_STOP;
        if (!c->q_head) kvf_conn_close(c);
        return;
    }
    if (kvf_conn_replies_over_budget(c)) {
        if (c->rs != RS_BLOCKED && c->nreplies < c->srv->cfg.max_in_flight) c->srv->ctr.reply_waits++;
        c->rs = RS_BLOCKED;
        return;
    }
    kvf_conn_recv_into(c, &c->hdr, KVF_HEADER_SIZE, RS_HDR);
}

void kvf_conn_stage(struct conn *c, uint32_t n)
{
    if (!c->stage && !(c->stage = malloc(KVF_PUT_GATE))) { kvf_conn_close(c); return; }
    kvf_conn_recv_into(c, c->stage, n, RS_GATE);
}

int kvf_conn_recv_obj(struct conn *c, uint8_t *slot, uint64_t size, uint32_t staged)
{
    if (!c->xxh && !(c->xxh = kvf_hash_new())) { kvf_conn_close(c); return 0; }
    /* object b.cur of the PUT batch: its checksum is seeded from its key (kvf_hash.h) */
    kvf_hash_reset_key(c->xxh, c->b.keys[c->b.cur], c->b.klens[c->b.cur]);
    if (staged) {
        kvf_copy(slot, c->stage, staged);
        kvf_hash_update(c->xxh, slot, staged);
    }
    c->rs = RS_OBJ;
    c->rbuf = slot;
    c->want = size;
    c->got = staged;
    if (c->got == c->want) return 1;
    kvf_conn_recv_more(c);
    return 0;
}

uint64_t kvf_conn_obj_digest(struct conn *c) { return kvf_hash_digest(c->xxh); }

void kvf_conn_park(struct conn *c, uint64_t bytes)
{
    struct kvf_server *s = c->srv;
    c->rs = RS_PARKED;
    c->parked = 1;
    c->park_ms = kvf_now_ms();
    c->park_next = s->parked;
    s->parked = c;
    kvf_store_want_space(s->st, bytes);
}

/* ---------------------------------------------------------------- buffers and budgets */

/* Arrays for `cap` entries (and a key buffer when keybuf, or when b had one),
 * sized to the request: kept when b already holds as many, else replaced.
 * Arrays over KVF_BATCH_KEEP entries are charged to the server's request
 * budget (and freed after the request, kvf_conn_next_request). Returns 0,
 * -EBUSY over the budget, -ENOMEM. */
int kvf_batch_alloc(struct conn *c, struct batch *b, uint32_t cap, int keybuf)
{
    struct kvf_server *s = c->srv;
    if (cap == 0) cap = 1;
    keybuf = keybuf || b->keybuf != NULL;
    if (b->keys && b->cap >= cap && (!keybuf || b->keybuf)) return 0;
    kvf_batch_free(b);
    size_t mem = (size_t)cap * (sizeof *b->keys + 1 + 4 * sizeof(uint64_t) + 2 * sizeof *b->parents + 3 +
                                2 * sizeof(uint32_t)) +
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
    b->groups = calloc(cap, sizeof *b->groups);
    b->glens = calloc(cap, 1);
    b->gparts = calloc(cap, sizeof *b->gparts);
    b->gruns = calloc(cap, sizeof *b->gruns);
    b->status = calloc(cap, 1);
    b->keybuf = keybuf ? malloc((size_t)cap * KVF_KEY_MAX) : NULL;
    if (!b->keys || !b->klens || !b->sizes || !b->csums || !b->offs || !b->parents || !b->plens || !b->status ||
        !b->groups || !b->glens || !b->gparts || !b->gruns ||
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
    free(b->groups); free(b->glens); free(b->gparts); free(b->gruns);
    memset(b, 0, sizeof *b);
}

/* Give back what the request just done needed beyond the per-connection keep
 * sizes (a large metadata buffer, large batch arrays, the drain buffer). */
void kvf_conn_shrink(struct conn *c)
{
    struct kvf_server *s = c->srv;
    if (c->meta_cap > KVF_META_KEEP) {
        s->ctr.request_bytes -= c->meta_mem;
        s->freed_since_trim += c->meta_cap;
        free(c->meta);
        c->meta = NULL;
        c->meta_cap = 0;
        c->meta_mem = 0;
    }
    if (c->b.cap > KVF_BATCH_KEEP) {
        s->freed_since_trim += c->b.mem;
        kvf_batch_free(&c->b);
    }
    if (!c->resv_open && c->resv.cap > KVF_BATCH_KEEP) {
        s->freed_since_trim += c->resv.mem;
        kvf_batch_free(&c->resv);
    }
    free(c->scratch);
    c->scratch = NULL;
    free(c->stage);
    c->stage = NULL;
}

/* Whether c must wait for its replies to go out before reading another request. */
int kvf_conn_replies_over_budget(struct conn *c)
{
    struct kvf_server *s = c->srv;
    if (c->nreplies >= s->cfg.max_in_flight) return 1;
    if (c->nreplies && c->reply_mem > s->cfg.reply_conn_budget) return 1;
    /* Over the server-wide budget, connections with replies queued wait; one
     * with none may read its next request (a large GET reply is then
     * answered BUSY in op_keys), so fresh and well-behaved peers are never
     * held up by others that do not read. */
    if (c->nreplies && s->ctr.reply_bytes > s->cfg.reply_budget) {
        s->wake_blocked = 1; /* woken by the loop once replies were freed */
        return 1;
    }
    return 0;
}

void kvf_conn_unreserved(struct conn *c)
{
    if (!c->reserved) return;
    c->srv->ctr.reserved_bytes -= c->reserved;
    c->reserved = 0;
    if (c->srv->resv_waiting) c->srv->wake_resv = 1;
}
