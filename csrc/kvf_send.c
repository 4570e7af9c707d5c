/* kvf_send.c: the reply send path of the native server (the loop is kvf_server.c).
 *
 * Owns the replies (allocate, queue, error frames, free once sent and every
 * zero-copy notification is in) and getting them out: one SENDMSG of the
 * header + the slots straight from the arena, or SEND_ZC of a large object
 * from the registered arena; a large GET object is verified chunk by chunk
 * while it is sent, its unverified rest held back.
 */
#define _GNU_SOURCE
#include "kvf_server_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_hash.h"

#define ZC_MIN 16384u          /* smaller objects are cheaper to copy than to pin */

/* ---------------------------------------------------------------- replies */

struct reply *kvf_reply_new(struct conn *c, size_t meta_cap, uint32_t nseg)
{
    struct reply *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->head = malloc(KVF_HEADER_SIZE + meta_cap);
    r->segs = nseg ? calloc(nseg, sizeof(struct seg)) : NULL;
    if (!r->head || (nseg && !r->segs)) { free(r->head); free(r->segs); free(r); return NULL; }
    r->conn = c;
    r->pass_fd = -1;
    /* counted in full (the iovec array comes when it is sent) against the
     * connection's and the server's reply budgets */
    r->mem = sizeof *r + KVF_HEADER_SIZE + meta_cap + (size_t)nseg * sizeof(struct seg) +
             sizeof(struct iovec) * KVF_SEND_IOV;
    c->reply_mem += r->mem;
    c->srv->ctr.reply_bytes += r->mem;
    c->srv->live_replies++;
    return r;
}

void kvf_reply_try_free(struct kvf_server *s, struct reply *r)
{
    if (!r->done || r->notifs) return;
    for (uint32_t i = 0; i < r->nseg; i++) {
        if (r->segs[i].entry == KVF_SEG_SLOT) kvf_store_unreserve(s->st, r->segs[i].off, r->segs[i].len);
        else kvf_store_release(s->st, r->segs[i].entry);
    }
    free(r->head);
    free(r->segs);
    free(r->iovs);
    s->ctr.reply_bytes -= r->mem;
    s->freed_since_trim += r->mem;
    free(r);
    s->live_replies--;
}

static void start_send(struct conn *c);

void kvf_reply_drop(struct conn *c, struct reply *r)
{
    c->reply_mem -= r->mem;
    r->done = 1;
    r->nseg = 0;
    kvf_reply_try_free(c->srv, r);
}

/* ------------------------------------------------------ service times */

const char *const kvf_lat_names[KVF_LAT_OPS] = {"get", "put", "lookup", "exists", "delete"};

static int lat_op(uint8_t opcode)
{
    switch (opcode) {
    case KVF_OP_GET: return KVF_LAT_GET;
    case KVF_OP_PUT: return KVF_LAT_PUT;
    case KVF_OP_LOOKUP: return KVF_LAT_LOOKUP;
    case KVF_OP_EXISTS: return KVF_LAT_EXISTS;
    case KVF_OP_DELETE: return KVF_LAT_DELETE;
    default: return -1;
    }
}

/* The request of c is answered: count its service time (header in -> reply
 * queued) in its opcode's histogram, once. No return. */
static void lat_record(struct conn *c)
{
    int k = lat_op(c->hdr.opcode);
    if (!c->req_us || k < 0) { c->req_us = 0; return; }
    int64_t d = kvf_now_us() - c->req_us;
    uint64_t t = d > 0 ? (uint64_t)d : 0;
    c->req_us = 0;
    unsigned b = t ? 64u - (unsigned)__builtin_clzll(t) : 0; /* t < 2^b */
    if (b > KVF_LAT_BUCKETS - 1) b = KVF_LAT_BUCKETS - 1;
    c->srv->ctr.lat[k][b]++;
    c->srv->ctr.lat_sum_us[k] += t;
}

void kvf_lat_write(struct kvf_mw *w, const struct kvf_server_counters *ctr)
{
    char name[40];
    for (int k = 0; k < KVF_LAT_OPS; k++) {
        snprintf(name, sizeof name, "lat_%s_us_buckets", kvf_lat_names[k]);
        kvf_mw_cstr(w, name);
        kvf_mw_array(w, KVF_LAT_BUCKETS);
        for (int i = 0; i < KVF_LAT_BUCKETS; i++) kvf_mw_uint(w, ctr->lat[k][i]);
        snprintf(name, sizeof name, "lat_%s_us_sum", kvf_lat_names[k]);
        kvf_mw_cstr(w, name);
        kvf_mw_uint(w, ctr->lat_sum_us[k]);
    }
}

/* ---------------------------------------------------------------- queueing */

/* Queue a reply whose metadata (meta_len bytes) is already at head + 32, and
 * record the request's service time. */
void kvf_reply_finish(struct conn *c, struct reply *r, uint8_t opcode, uint8_t flags, size_t meta_len,
                      uint64_t payload_len)
{
    lat_record(c);
    kvf_header_pack((struct kvf_header *)r->head, opcode, flags, c->hdr.request_id, (uint32_t)meta_len,
                    payload_len);
    r->head_len = KVF_HEADER_SIZE + meta_len;
    if (c->q_tail) c->q_tail->next = r; else c->q_head = r;
    c->q_tail = r;
    c->nreplies++;
    start_send(c);
}

const char *const kvf_err_names[16] = {
    "", "BAD_MAGIC", "BAD_VERSION", "UNKNOWN_OPCODE", "MALFORMED", "TOO_MANY_KEYS", "PAYLOAD_TOO_LARGE",
    "META_TOO_LARGE", "LENGTH_MISMATCH", "AUTH_FAILED", "TOO_MANY_IN_FLIGHT", "BUSY", "INTERNAL", "BAD_KEY",
};

/* An error reply's metadata: {"code": code, "message": msg} (protocol.ErrorReply). */
static void error_meta(struct kvf_mw *w, int code, const char *msg)
{
    kvf_mw_map(w, 2);
    kvf_mw_cstr(w, KVF_F_CODE);
    kvf_mw_int(w, code);
    kvf_mw_cstr(w, KVF_F_MESSAGE);
    kvf_mw_cstr(w, msg);
}

void kvf_reply_error(struct conn *c, int code, const char *msg)
{
    struct kvf_server *s = c->srv;
    if (code > 0 && code < 16) s->ctr.errors[code]++;
    if (kvf_err_is_fatal(code)) c->close_after_send = 1;
    struct reply *r = kvf_reply_new(c, 64 + strlen(msg), 0);
    if (!r) { c->closing = 1; return; }
    struct kvf_mw w;
    kvf_mw_init(&w, r->head + KVF_HEADER_SIZE, 64 + strlen(msg));
    error_meta(&w, code, msg);
    kvf_reply_finish(c, r, c->hdr.opcode, KVF_FLAG_REPLY | KVF_FLAG_ERROR, w.len, 0);
}

size_t kvf_error_frame(uint8_t *frame, size_t cap, int code, const char *msg)
{
    if (cap <= KVF_HEADER_SIZE) return 0;
    struct kvf_mw w;
    kvf_mw_init(&w, frame + KVF_HEADER_SIZE, cap - KVF_HEADER_SIZE);
    error_meta(&w, code, msg);
    if (w.overflow) return 0;
    kvf_header_pack((struct kvf_header *)frame, 0, KVF_FLAG_REPLY | KVF_FLAG_ERROR, 0, (uint32_t)w.len, 0);
    return KVF_HEADER_SIZE + w.len;
}

/* ---------------------------------------------------------------- sending */

/* Hash the next chunk of a streamed-verified GET object. Returns 0, or -1
 * after a checksum mismatch: the object is dropped and the connection closed
 * before the object's last bytes go out. */
static int verify_chunk(struct conn *c, struct seg *g)
{
    struct kvf_server *s = c->srv;
    if (!g->verify || g->hashed >= g->len) return 0;
    if (!c->xxh_tx && !(c->xxh_tx = kvf_hash_new())) { kvf_conn_close(c); return -1; }
    if (g->hashed == 0) { /* the checksum binds the key the entry is stored under */
        uint8_t key[KVF_KEY_MAX];
        uint32_t klen = kvf_store_key(s->st, g->entry, key);
        kvf_hash_reset_key(c->xxh_tx, key, klen);
    }
    uint64_t n = g->len - g->hashed;
    if (n > KVF_OBJ_CHUNK) n = KVF_OBJ_CHUNK;
    kvf_hash_update(c->xxh_tx, s->base + g->off + g->hashed, (size_t)n);
    g->hashed += n;
    if (g->hashed == g->len && kvf_hash_digest(c->xxh_tx) != g->csum) {
        kvf_store_drop_corrupt(s->st, g->entry);
        kvf_conn_close(c);
        return -1;
    }
    return 0;
}

/* Consume n sent bytes of reply r: head first, then the segments in order. */
static void advance_reply(struct kvf_server *s, struct reply *r, uint64_t n)
{
    size_t h = r->head_len - r->head_off;
    size_t take = n < h ? (size_t)n : h;
    r->head_off += take;
    n -= take;
    while (n && r->seg < r->nseg) {
        struct seg *g = &r->segs[r->seg];
        uint64_t t = g->len - r->seg_off < n ? g->len - r->seg_off : n;
        r->seg_off += t;
        n -= t;
        s->ctr.bytes_out += t;
        if (r->seg_off == g->len) { r->seg++; r->seg_off = 0; }
    }
}

/* Copying send: one SENDMSG of the head and as many verified segments as fit
 * (KVF_SEND_IOV iovecs), straight from the arena. */
static void post_sendmsg(struct conn *c, struct reply *r, struct io_uring_sqe *q)
{
    struct kvf_server *s = c->srv;
    int n = 0;
    uint64_t total = 0;
    if (r->head_off < r->head_len) {
        r->iovs[n].iov_base = r->head + r->head_off;
        r->iovs[n].iov_len = r->head_len - r->head_off;
        total += r->iovs[n++].iov_len;
    }
    for (uint32_t k = r->seg; k < r->nseg && n < KVF_SEND_IOV && total < (1u << 30); k++) {
        struct seg *g = &r->segs[k];
        uint64_t from = k == r->seg ? r->seg_off : 0;
        if (c->zc && g->len >= ZC_MIN) break; /* goes out zero-copy, on its own */
        if (g->hashed > from) {
            r->iovs[n].iov_base = s->base + g->off + from;
            r->iovs[n].iov_len = g->hashed - from;
            total += r->iovs[n++].iov_len;
        }
        if (g->hashed < g->len) break; /* the rest waits for its checksum */
    }
    memset(&r->mh, 0, sizeof r->mh);
    r->mh.msg_iov = r->iovs;
    r->mh.msg_iovlen = (size_t)n;
    if (r->pass_fd >= 0) {
        r->mh.msg_control = r->cmsg.buf;
        r->mh.msg_controllen = sizeof r->cmsg.buf;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&r->mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &r->pass_fd, sizeof(int));
        r->pass_fd = -1; /* attached to the first byte, sent once */
    }
    q->opcode = IORING_OP_SENDMSG;
    q->fd = c->fd;
    q->addr = (uint64_t)(uintptr_t)&r->mh;
    /* MSG_WAITALL: io_uring retries a short send itself instead of
     * completing it and having the loop resubmit the rest */
    q->msg_flags = MSG_NOSIGNAL | MSG_WAITALL;
    q->user_data = KVF_TAG(c, T_SEND);
    s->ctr.copy_sends++;
}

static void start_send(struct conn *c)
{
    struct kvf_server *s = c->srv;
    while (!c->send_posted && c->q_head && !c->closing) {
        struct reply *r = c->q_head;
        while (r->seg < r->nseg && !r->segs[r->seg].wait && r->seg_off == r->segs[r->seg].len) {
            r->seg++;
            r->seg_off = 0;
        }
        if (r->head_off == r->head_len && r->seg >= r->nseg) {
            /* reply fully sent */
            c->q_head = r->next;
            if (!c->q_head) c->q_tail = NULL;
            c->nreplies--;
            c->reply_mem -= r->mem;
            if (r->tier_bytes) { /* its SSD slots no longer count against the connection's read-ahead */
                c->tstream_bytes -= r->tier_bytes;
                c->tier_kick = 1;
            }
            r->done = 1;
            r->conn = NULL;
            kvf_reply_try_free(s, r);
            if (c->close_after_send && !c->q_head) { kvf_conn_close(c); return; }
            if (c->rs == RS_BLOCKED) kvf_conn_next_request(c); /* blocks again if still over a budget */
            continue;
        }
        if (!r->deadline_ms && s->cfg.min_rate && s->cfg.stall_ms) {
            /* a reply starts going out: the peer has stall + its size / min_rate to read it */
            uint64_t total = r->head_len;
            for (uint32_t k = 0; k < r->nseg; k++) total += r->segs[k].len;
            r->deadline_ms = kvf_rate_deadline(s, kvf_now_ms(), total);
        }
        struct seg *g = r->seg < r->nseg ? &r->segs[r->seg] : NULL;
        if (g && g->hashed <= r->seg_off && verify_chunk(c, g)) return; /* corrupt: connection closed */
        if (g && g->wait && g->hashed <= r->seg_off && r->head_off == r->head_len)
            return; /* its next bytes are still being read from the SSD tier: kvf_conn_send_more */
        if (!r->iovs && !(r->iovs = malloc(sizeof(struct iovec) * KVF_SEND_IOV))) { kvf_conn_close(c); return; }
        struct io_uring_sqe *q = kvf_sqe_get(s);
        if (!q) { kvf_conn_close(c); return; }
        if (r->head_off == r->head_len && g && c->zc && g->len >= ZC_MIN) {
            uint64_t off = g->off + r->seg_off, n = g->hashed - r->seg_off;
            uint64_t chunk_end = (off / KVF_FIXED_CHUNK + 1) * KVF_FIXED_CHUNK;
            if (off + n > chunk_end) n = chunk_end - off;
            q->opcode = IORING_OP_SEND_ZC;
            q->fd = c->fd;
            q->addr = (uint64_t)(uintptr_t)(s->base + off);
            q->len = (uint32_t)n;
            q->msg_flags = MSG_NOSIGNAL | MSG_WAITALL |
                           (r->seg + 1 < r->nseg || off + n < g->off + g->len ? MSG_MORE : 0);
            if (s->fixed) {
                q->ioprio = IORING_RECVSEND_FIXED_BUF;
                q->buf_index = (uint16_t)(off / KVF_FIXED_CHUNK);
            }
            q->user_data = KVF_TAG(r, T_ZC);
            s->ctr.zc_sends++;
        } else {
            post_sendmsg(c, r, q);
        }
        c->refs++;
        c->send_posted = 1;
        if (g && g->verify && g->hashed < g->len) {
            /* Hash the next KVF_HASH_AHEAD bytes while the kernel sends what
             * is verified: the next send carries them while they are still
             * in cache, and no object, however large, holds the loop for more
             * than one window (it used to hash the whole rest here). */
            kvf_ring_submit_wait(&s->ring, 0, 0);
            uint64_t until = g->hashed + KVF_HASH_AHEAD;
            while (g->hashed < g->len && g->hashed < until)
                if (verify_chunk(c, g)) return;
        }
        return;
    }
}

void kvf_conn_send_more(struct conn *c)
{
    /* the wait was the disk's, not the peer's: its min_rate bound starts again from now */
    if (c->q_head && !c->send_posted) c->q_head->deadline_ms = 0;
    start_send(c);
}

void kvf_conn_sent(struct conn *c, int res)
{
    c->send_posted = 0;
    struct reply *r = c->q_head;
    if (res < 0 || c->closing || !r) { kvf_conn_close(c); return; }
    c->progress_ms = kvf_now_ms();
    advance_reply(c->srv, r, (uint64_t)res);
    start_send(c);
}

void kvf_reply_zc_notif(struct kvf_server *s, struct reply *r, int res)
{
    if (res & IORING_NOTIF_USAGE_ZC_COPIED) s->ctr.zc_copied_notifs++;
    r->notifs--;
    kvf_reply_try_free(s, r);
}
