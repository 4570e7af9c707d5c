/* kvf_server.c: the io_uring event loop of the native server (see kvf_server.h).
 *
 * user_data of every SQE is a pointer with a tag in its low 3 bits:
 *   T_ACCEPT   &srv->tag_tcp / &srv->tag_unix  (listener)
 *   T_EFD      &srv->tag_efd                   (eventfd: stop / space round done)
 *   T_RECV     struct conn *                   (one recv in flight per conn)
 *   T_SEND     struct conn *                   (copying send of a reply part)
 *   T_ZC       struct reply *                  (SEND_ZC of an object; its
 *              notification CQE carries the same user_data with F_NOTIF)
 * A conn is destroyed only when it is closing and no SQE points at it; a
 * reply outlives its conn until its last zero-copy notification, because the
 * kernel may still read the slot's pages until then (the slot stays pinned).
 */
#define _GNU_SOURCE
#include "kvf_server_int.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "kvf_hash.h"

enum { T_ACCEPT = 1, T_EFD = 2, T_RECV = 3, T_SEND = 4, T_ZC = 5 };
#define TAG(p, t) ((uint64_t)(uintptr_t)(p) | (t))
#define ZC_MIN 16384u          /* smaller objects are cheaper to copy than to pin */
#define FIXED_CHUNK (1ull << 30) /* registered buffers are at most 1 GiB each */

static struct io_uring_sqe *sqe_get(struct kvf_server *s)
{
    struct io_uring_sqe *q = kvf_ring_sqe(&s->ring);
    if (!q) {
        kvf_ring_submit_wait(&s->ring, 0, 0);
        q = kvf_ring_sqe(&s->ring);
    }
    return q; /* NULL only if the kernel consumed nothing: callers treat it as -EBUSY */
}

/* ---------------------------------------------------------------- listeners */

static void arm_accept(struct kvf_server *s, int fd, uint64_t *tag)
{
    struct io_uring_sqe *q = sqe_get(s);
    if (!q) return;
    q->opcode = IORING_OP_ACCEPT;
    q->fd = fd;
    q->accept_flags = SOCK_CLOEXEC;
    q->user_data = TAG(tag, T_ACCEPT);
}

static void arm_efd(struct kvf_server *s)
{
    struct io_uring_sqe *q = sqe_get(s);
    if (!q) return;
    q->opcode = IORING_OP_READ;
    q->fd = s->efd;
    q->addr = (uint64_t)(uintptr_t)&s->efd_buf;
    q->len = sizeof s->efd_buf;
    q->user_data = TAG(&s->tag_efd, T_EFD);
}

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
    c->srv->live_replies++;
    return r;
}

static void reply_try_free(struct kvf_server *s, struct reply *r)
{
    if (!r->done || r->notifs) return;
    for (uint32_t i = 0; i < r->nseg; i++) kvf_store_release(s->st, r->segs[i].entry);
    free(r->head);
    free(r->segs);
    free(r->iovs);
    free(r);
    s->live_replies--;
}

static void start_send(struct conn *c);

void kvf_reply_drop(struct conn *c, struct reply *r)
{
    r->done = 1;
    r->nseg = 0;
    reply_try_free(c->srv, r);
}

/* Queue a reply whose metadata (meta_len bytes) is already at head + 32. */
void kvf_reply_finish(struct conn *c, struct reply *r, uint8_t opcode, uint8_t flags, size_t meta_len,
                      uint64_t payload_len)
{
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

void kvf_reply_error(struct conn *c, int code, const char *msg)
{
    struct kvf_server *s = c->srv;
    if (code > 0 && code < 16) s->ctr.errors[code]++;
    if (kvf_err_is_fatal(code)) c->close_after_send = 1;
    struct reply *r = kvf_reply_new(c, 64 + strlen(msg), 0);
    if (!r) { c->closing = 1; return; }
    struct kvf_mw w;
    kvf_mw_init(&w, r->head + KVF_HEADER_SIZE, 64 + strlen(msg));
    kvf_mw_map(&w, 2);
    kvf_mw_cstr(&w, "code");
    kvf_mw_int(&w, code);
    kvf_mw_cstr(&w, "message");
    kvf_mw_cstr(&w, msg);
    kvf_reply_finish(c, r, c->hdr.opcode, KVF_FLAG_REPLY | KVF_FLAG_ERROR, w.len, 0);
}

/* ---------------------------------------------------------------- conns */

/* The min_rate bound of a frame or reply of `bytes` starting at `now` (as the
 * Python server: stall timeout + size / min_rate); 0 when there is none. */
static int64_t rate_deadline(const struct kvf_server *s, int64_t now, uint64_t bytes)
{
    if (!s->cfg.min_rate || !s->cfg.stall_ms) return 0;
    return now + (int64_t)s->cfg.stall_ms + (int64_t)((double)bytes * 1000.0 / (double)s->cfg.min_rate) + 1;
}

static void conn_close(struct conn *c)
{
    if (c->closing) return;
    c->closing = 1;
    shutdown(c->fd, SHUT_RDWR); /* completes any recv/send in flight */
}

static void conn_destroy(struct conn *c)
{
    struct kvf_server *s = c->srv;
    if (c->parked) {
        struct conn **pp = &s->parked;
        while (*pp && *pp != c) pp = &(*pp)->park_next;
        if (*pp) *pp = c->park_next;
    }
    for (struct reply *r = c->q_head, *n; r; r = n) {
        n = r->next;
        r->done = 1;
        r->conn = NULL;
        reply_try_free(s, r);
    }
    kvf_ops_conn_gone(c);
    if (c->batch_op == KVF_OP_PUT && c->rs == RS_OBJ) /* a half-received object */
        kvf_store_unreserve(s->st, c->b.offs[c->b.cur], c->b.sizes[c->b.cur]);
    kvf_batch_free(&c->b);
    close(c->fd);
    if (c->xxh) kvf_hash_free(c->xxh);
    if (c->xxh_tx) kvf_hash_free(c->xxh_tx);
    free(c->meta);
    free(c->scratch);
    if (c->prev) c->prev->next = c->next; else s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->ctr.connections--;
    free(c);
}

static void conn_check(struct conn *c)
{
    if (c->closing && c->refs == 0) conn_destroy(c);
}

static void post_recv(struct conn *c)
{
    struct io_uring_sqe *q = sqe_get(c->srv);
    if (!q) { conn_close(c); return; }
    uint64_t n = c->want - c->got;
    if (n > (1u << 30)) n = 1u << 30;
    if (c->rs == RS_OBJ && n > KVF_OBJ_CHUNK) n = KVF_OBJ_CHUNK;
    q->opcode = IORING_OP_RECV;
    q->fd = c->fd;
    q->addr = (uint64_t)(uintptr_t)(c->rbuf + c->got);
    q->len = (uint32_t)n;
    q->msg_flags = MSG_WAITALL;
    q->user_data = TAG(c, T_RECV);
    c->refs++;
    c->recv_posted = 1;
}

void kvf_conn_recv_into(struct conn *c, void *buf, uint64_t n, enum rs stage)
{
    if (stage == RS_OBJ) {
        if (!c->xxh && !(c->xxh = kvf_hash_new())) { conn_close(c); return; }
        kvf_hash_reset(c->xxh);
    }
    c->rs = stage;
    c->rbuf = buf;
    c->want = n;
    c->got = 0;
    post_recv(c);
}

void kvf_conn_drain(struct conn *c, uint64_t n)
{
    if (!c->scratch && !(c->scratch = malloc(1 << 16))) { conn_close(c); return; }
    c->drain_left = n;
    kvf_conn_recv_into(c, c->scratch, n < (1 << 16) ? n : (1 << 16), RS_DRAIN);
}

/* Ready for the next header, unless too many replies are queued. */
void kvf_conn_next_request(struct conn *c)
{
    c->batch_op = 0;
    c->rx_deadline_ms = 0;
    if (c->closing) return;
    if (c->close_after_send) { c->rs = RS_STOP; return; }
    if (c->nreplies >= c->srv->cfg.max_in_flight) { c->rs = RS_BLOCKED; return; }
    kvf_conn_recv_into(c, &c->hdr, KVF_HEADER_SIZE, RS_HDR);
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

static void on_header(struct conn *c)
{
    struct kvf_server *s = c->srv;
    int pre = s->cfg.auth && !c->authed;
    int rc = kvf_header_check(&c->hdr, pre ? KVF_PRE_AUTH_META_BYTES : s->cfg.max_meta,
                              pre ? 0 : s->cfg.max_payload);
    if (rc == 0 && (c->hdr.flags & KVF_FLAG_REPLY)) rc = -KVF_E_MALFORMED;
    if (rc) {
        int code = -rc;
        /* The stream cannot be trusted after a bad header: answer and close. */
        c->close_after_send = 1;
        if (code == KVF_E_BAD_MAGIC) c->hdr.request_id = 0;
        kvf_reply_error(c, code, code == KVF_E_BAD_MAGIC ? "bad magic" : code == KVF_E_BAD_VERSION
                                     ? "unsupported protocol version" : code == KVF_E_MALFORMED
                                     ? "malformed header" : "frame exceeds the limits");
        c->rs = RS_STOP;
        return;
    }
    /* the rest of the frame has stall + its size / min_rate, however it trickles */
    c->rx_deadline_ms = rate_deadline(s, c->progress_ms, (uint64_t)c->hdr.meta_len + c->hdr.payload_len);
    if (c->hdr.meta_len > c->meta_cap) {
        uint8_t *m = realloc(c->meta, c->hdr.meta_len);
        if (!m) { conn_close(c); return; }
        c->meta = m;
        c->meta_cap = c->hdr.meta_len;
    }
    if (c->hdr.meta_len) kvf_conn_recv_into(c, c->meta, c->hdr.meta_len, RS_META);
    else kvf_ops_request(c);
}

static void on_recv(struct conn *c, int res)
{
    c->recv_posted = 0;
    if (res <= 0 || c->closing) { conn_close(c); return; }
    c->progress_ms = kvf_now_ms();
    if (c->rs == RS_HDR && c->got == 0) c->rx_deadline_ms = rate_deadline(c->srv, c->progress_ms, KVF_HEADER_SIZE);
    if (c->rs == RS_OBJ) kvf_hash_update(c->xxh, c->rbuf + c->got, (size_t)res);
    c->got += (uint64_t)res;
    if (c->rs != RS_DRAIN) c->srv->ctr.bytes_in += (uint64_t)res;
    if (c->got < c->want) { post_recv(c); return; }
    switch (c->rs) {
    case RS_HDR: on_header(c); break;
    case RS_META: kvf_ops_request(c); break;
    case RS_OBJ: kvf_ops_object_done(c); break;
    case RS_DRAIN:
        c->srv->ctr.bytes_in += c->want;
        c->drain_left -= c->want;
        if (c->drain_left) {
            kvf_conn_recv_into(c, c->scratch, c->drain_left < (1 << 16) ? c->drain_left : (1 << 16), RS_DRAIN);
        } else if (c->batch_op) {
            c->b.cur++;
            kvf_ops_batch_step(c);
        } else { /* the request was rejected; its payload is consumed, answer now */
            kvf_reply_error(c, c->pend_code, c->pend_msg);
            kvf_conn_next_request(c);
        }
        break;
    default: break;
    }
}

/* ---------------------------------------------------------------- sending */

/* Hash the next chunk of a streamed-verified GET object. Returns 0, or -1
 * after a checksum mismatch: the object is dropped and the connection closed
 * before the object's last bytes go out. */
static int verify_chunk(struct conn *c, struct seg *g)
{
    struct kvf_server *s = c->srv;
    if (!g->verify || g->hashed >= g->len) return 0;
    if (!c->xxh_tx && !(c->xxh_tx = kvf_hash_new())) { conn_close(c); return -1; }
    if (g->hashed == 0) kvf_hash_reset(c->xxh_tx);
    uint64_t n = g->len - g->hashed;
    if (n > KVF_OBJ_CHUNK) n = KVF_OBJ_CHUNK;
    kvf_hash_update(c->xxh_tx, s->base + g->off + g->hashed, (size_t)n);
    g->hashed += n;
    if (g->hashed == g->len && kvf_hash_digest(c->xxh_tx) != g->csum) {
        kvf_store_drop_corrupt(s->st, g->entry);
        conn_close(c);
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
    q->user_data = TAG(c, T_SEND);
    s->ctr.copy_sends++;
}

static void start_send(struct conn *c)
{
    struct kvf_server *s = c->srv;
    while (!c->send_posted && c->q_head && !c->closing) {
        struct reply *r = c->q_head;
        while (r->seg < r->nseg && r->seg_off == r->segs[r->seg].len) { r->seg++; r->seg_off = 0; }
        if (r->head_off == r->head_len && r->seg >= r->nseg) {
            /* reply fully sent */
            c->q_head = r->next;
            if (!c->q_head) c->q_tail = NULL;
            c->nreplies--;
            r->done = 1;
            r->conn = NULL;
            reply_try_free(s, r);
            if (c->close_after_send && !c->q_head) { conn_close(c); return; }
            if (c->rs == RS_BLOCKED && c->nreplies < s->cfg.max_in_flight) kvf_conn_next_request(c);
            continue;
        }
        if (!r->deadline_ms && s->cfg.min_rate && s->cfg.stall_ms) {
            /* a reply starts going out: the peer has stall + its size / min_rate to read it */
            uint64_t total = r->head_len;
            for (uint32_t k = 0; k < r->nseg; k++) total += r->segs[k].len;
            r->deadline_ms = rate_deadline(s, kvf_now_ms(), total);
        }
        struct seg *g = r->seg < r->nseg ? &r->segs[r->seg] : NULL;
        if (g && g->hashed <= r->seg_off && verify_chunk(c, g)) return; /* corrupt: connection closed */
        if (!r->iovs && !(r->iovs = malloc(sizeof(struct iovec) * KVF_SEND_IOV))) { conn_close(c); return; }
        struct io_uring_sqe *q = sqe_get(s);
        if (!q) { conn_close(c); return; }
        if (r->head_off == r->head_len && g && c->zc && g->len >= ZC_MIN) {
            uint64_t off = g->off + r->seg_off, n = g->hashed - r->seg_off;
            uint64_t chunk_end = (off / FIXED_CHUNK + 1) * FIXED_CHUNK;
            if (off + n > chunk_end) n = chunk_end - off;
            q->opcode = IORING_OP_SEND_ZC;
            q->fd = c->fd;
            q->addr = (uint64_t)(uintptr_t)(s->base + off);
            q->len = (uint32_t)n;
            q->msg_flags = MSG_NOSIGNAL | MSG_WAITALL |
                           (r->seg + 1 < r->nseg || off + n < g->off + g->len ? MSG_MORE : 0);
            if (s->fixed) {
                q->ioprio = IORING_RECVSEND_FIXED_BUF;
                q->buf_index = (uint16_t)(off / FIXED_CHUNK);
            }
            q->user_data = TAG(r, T_ZC);
            s->ctr.zc_sends++;
        } else {
            post_sendmsg(c, r, q);
        }
        c->refs++;
        c->send_posted = 1;
        if (g && g->hashed < g->len) {
            /* hash the rest while the kernel sends what is verified; the rest
             * then goes out once it has matched */
            kvf_ring_submit_wait(&s->ring, 0, 0);
            while (g->hashed < g->len)
                if (verify_chunk(c, g)) return;
        }
        return;
    }
}

static void on_sent(struct conn *c, int res)
{
    c->send_posted = 0;
    struct reply *r = c->q_head;
    if (res < 0 || c->closing || !r) { conn_close(c); return; }
    c->progress_ms = kvf_now_ms();
    advance_reply(c->srv, r, (uint64_t)res);
    start_send(c);
}

/* ---------------------------------------------------------------- accept */

static int peer_is_loopback(int fd)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getpeername(fd, (struct sockaddr *)&ss, &len)) return 0;
    if (ss.ss_family == AF_INET)
        return (ntohl(((struct sockaddr_in *)&ss)->sin_addr.s_addr) >> 24) == 127;
    if (ss.ss_family == AF_INET6) {
        const struct in6_addr *a = &((struct sockaddr_in6 *)&ss)->sin6_addr;
        if (IN6_IS_ADDR_LOOPBACK(a)) return 1;
        return IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127;
    }
    return 0;
}

static void on_accept(struct kvf_server *s, uint64_t *tag, int res)
{
    int is_unix = tag == &s->tag_unix;
    if (!s->stop) arm_accept(s, is_unix ? s->cfg.unix_fd : s->cfg.tcp_fd, tag);
    if (res < 0) return;
    if (s->stop) {
        s->ctr.rejected++;
        close(res);
        return;
    }
    if (s->ctr.connections >= s->cfg.max_conns) {
        /* Over the bound: one BUSY error frame, as the Python server answers,
         * then close. A fresh socket's send buffer is empty, so the ~70-byte
         * frame fits; MSG_DONTWAIT makes sure the loop never blocks on it
         * (a failed send just means the peer sees a plain close). */
        s->ctr.rejected++;
        s->ctr.errors[KVF_E_BUSY]++;
        if (send(res, s->busy_frame, s->busy_len, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) { /* plain close */ }
        close(res);
        return;
    }
    struct conn *c = calloc(1, sizeof *c);
    if (!c) { close(res); return; }
    c->srv = s;
    c->fd = res;
    c->is_unix = is_unix;
    c->transport = is_unix ? TR_SHM : TR_TCP;
    c->authed = s->cfg.auth == NULL;
    if (!is_unix) {
        int one = 1;
        setsockopt(res, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        /* Zero-copy pays off only when the bytes leave the host: a loopback
         * receiver copies out of the pinned pages anyway, and pinning plus the
         * notification made GETs about 2x slower on loopback in our measurements.
         * zerocopy=1 (forced) uses it for every TCP peer. */
        c->zc = s->zerocopy && (s->cfg.zerocopy == 1 || !peer_is_loopback(res));
    }
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    s->ctr.connections++;
    s->ctr.connections_total++;
    c->progress_ms = kvf_now_ms();
    kvf_conn_next_request(c);
}

/* ---------------------------------------------------------------- loop */

/* Drop peers that stall mid-frame or stop reading their replies (a slow
 * reader or writer would otherwise hold slots and pins forever), and, with
 * min_rate, peers whose frame or reply overruns stall + size / min_rate while
 * trickling bytes (slowloris). Idle connections between requests are left
 * alone, and so is a PUT parked waiting for space. */
static void sweep_stalled(struct kvf_server *s, int64_t now)
{
    if (!s->cfg.stall_ms) return;
    for (struct conn *c = s->conns; c; c = c->next) {
        if (c->closing) continue;
        int mid_frame = c->rs == RS_META || c->rs == RS_OBJ || c->rs == RS_DRAIN || (c->rs == RS_HDR && c->got > 0);
        int sending = c->send_posted;
        int late = (mid_frame && c->rx_deadline_ms && now > c->rx_deadline_ms) ||
                   (sending && c->q_head && c->q_head->deadline_ms && now > c->q_head->deadline_ms);
        int stalled = now - c->progress_ms >= (int64_t)s->cfg.stall_ms && (mid_frame || sending);
        if (stalled || late) {
            if (stalled) s->ctr.stalled++; else s->ctr.too_slow++;
            conn_close(c);
        }
    }
}

static void retry_parked(struct kvf_server *s)
{
    int exhausted;
    uint64_t round = kvf_store_round(s->st, &exhausted);
    if (round == s->seen_round) return;
    s->seen_round = round;
    struct conn *list = s->parked;
    s->parked = NULL;
    while (list) {
        struct conn *c = list;
        list = c->park_next;
        c->parked = 0;
        c->park_next = NULL;
        if (c->closing) { conn_check(c); continue; }
        if (c->rx_deadline_ms) c->rx_deadline_ms += kvf_now_ms() - c->park_ms; /* the wait was ours */
        kvf_ops_batch_step(c);
    }
}

static void dispatch(struct kvf_server *s, struct io_uring_cqe *cqe)
{
    uint64_t ud = cqe->user_data;
    int tag = (int)(ud & 7);
    void *p = (void *)(uintptr_t)(ud & ~(uint64_t)7);
    switch (tag) {
    case T_ACCEPT: on_accept(s, p, cqe->res); break;
    case T_EFD:
        if (!s->stop) arm_efd(s);
        retry_parked(s);
        break;
    case T_RECV: {
        struct conn *c = p;
        c->refs--;
        on_recv(c, cqe->res);
        conn_check(c);
        break;
    }
    case T_SEND: {
        struct conn *c = p;
        c->refs--;
        on_sent(c, cqe->res);
        conn_check(c);
        break;
    }
    case T_ZC: {
        struct reply *r = p;
        if (cqe->flags & IORING_CQE_F_NOTIF) {
            if (cqe->res & IORING_NOTIF_USAGE_ZC_COPIED) s->ctr.zc_copied_notifs++;
            r->notifs--;
            reply_try_free(s, r);
            break;
        }
        if (cqe->flags & IORING_CQE_F_MORE) r->notifs++;
        struct conn *c = r->conn;
        c->refs--;
        on_sent(c, cqe->res);
        conn_check(c);
        break;
    }
    default: break;
    }
}

/* The frame protocol.encode_error(0, 0, BUSY, "too many connections (max N)")
 * makes: header (opcode 0, request id 0, REPLY|ERROR) + {"code", "message"}. */
static void busy_frame_build(struct kvf_server *s)
{
    char msg[64];
    snprintf(msg, sizeof msg, "too many connections (max %u)", s->cfg.max_conns);
    struct kvf_mw w;
    kvf_mw_init(&w, s->busy_frame + KVF_HEADER_SIZE, sizeof s->busy_frame - KVF_HEADER_SIZE);
    kvf_mw_map(&w, 2);
    kvf_mw_cstr(&w, "code");
    kvf_mw_int(&w, KVF_E_BUSY);
    kvf_mw_cstr(&w, "message");
    kvf_mw_cstr(&w, msg);
    kvf_header_pack((struct kvf_header *)s->busy_frame, 0, KVF_FLAG_REPLY | KVF_FLAG_ERROR, 0, (uint32_t)w.len, 0);
    s->busy_len = KVF_HEADER_SIZE + w.len;
}

int kvf_server_new(struct kvf_server **out, const struct kvf_server_cfg *cfg)
{
    if (!cfg->store || (cfg->tcp_fd < 0 && cfg->unix_fd < 0) || !cfg->max_in_flight || !cfg->max_conns)
        return -EINVAL;
    struct kvf_server *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    s->cfg = *cfg;
    s->st = cfg->store;
    s->base = kvf_store_base(s->st);
    int rc = kvf_ring_init(&s->ring, 1024);
    if (rc) { free(s); return rc; }
    s->efd = eventfd(0, EFD_CLOEXEC);
    if (s->efd < 0) { rc = -errno; kvf_ring_exit(&s->ring); free(s); return rc; }
    int zc = kvf_ring_probe_op(&s->ring, IORING_OP_SEND_ZC);
    if (cfg->zerocopy == 1 && !zc) { close(s->efd); kvf_ring_exit(&s->ring); free(s); return -EOPNOTSUPP; }
    s->zerocopy = cfg->zerocopy != 0 && zc;
    if (s->zerocopy) {
        uint64_t cap = kvf_store_capacity(s->st);
        unsigned n = (unsigned)((cap + FIXED_CHUNK - 1) / FIXED_CHUNK);
        struct iovec iov[64];
        if (n <= 64) {
            for (unsigned i = 0; i < n; i++) {
                iov[i].iov_base = s->base + (uint64_t)i * FIXED_CHUNK;
                uint64_t left = cap - (uint64_t)i * FIXED_CHUNK;
                iov[i].iov_len = left < FIXED_CHUNK ? left : FIXED_CHUNK;
            }
            s->fixed = kvf_ring_register_buffers(&s->ring, iov, n) == 0;
        }
    }
    busy_frame_build(s);
    s->ctr.zerocopy = s->zerocopy;
    s->ctr.fixed_buffers = s->fixed;
    s->start_ms = kvf_now_ms();
    *out = s;
    return 0;
}

int kvf_server_run(struct kvf_server *s)
{
    if (s->cfg.tcp_fd >= 0) arm_accept(s, s->cfg.tcp_fd, &s->tag_tcp);
    if (s->cfg.unix_fd >= 0) arm_accept(s, s->cfg.unix_fd, &s->tag_unix);
    arm_efd(s);
    int64_t stop_at = 0, last_sweep = kvf_now_ms();
    for (;;) {
        if (s->stop) {
            if (!stop_at) {
                stop_at = kvf_now_ms() + 2000;
                for (struct conn *c = s->conns; c; c = c->next) conn_close(c);
                /* listeners: the owner closes the fds; cancel our accepts */
                struct io_uring_sqe *q;
                if ((q = sqe_get(s))) { q->opcode = IORING_OP_ASYNC_CANCEL; q->addr = TAG(&s->tag_tcp, T_ACCEPT); }
                if ((q = sqe_get(s))) { q->opcode = IORING_OP_ASYNC_CANCEL; q->addr = TAG(&s->tag_unix, T_ACCEPT); }
            }
            if ((!s->conns && !s->live_replies) || kvf_now_ms() > stop_at) break;
        }
        int rc = kvf_ring_submit_wait(&s->ring, 1, s->stop ? 50 : 500);
        if (rc && rc != -ETIME) return rc;
        struct io_uring_cqe *cqe;
        while ((cqe = kvf_ring_peek(&s->ring))) {
            struct io_uring_cqe copy = *cqe;
            kvf_ring_cqe_seen(&s->ring);
            dispatch(s, &copy);
        }
        if (s->parked) retry_parked(s);
        int64_t now = kvf_now_ms();
        if (now - last_sweep >= 500) {
            last_sweep = now;
            sweep_stalled(s, now);
        }
    }
    return 0;
}

void kvf_server_stop(struct kvf_server *s)
{
    s->stop = 1;
    uint64_t one = 1;
    if (write(s->efd, &one, sizeof one) < 0) { /* the 1 s wait timeout sees s->stop anyway */ }
}

void kvf_server_wake(struct kvf_server *s)
{
    uint64_t one = 1;
    if (write(s->efd, &one, sizeof one) < 0) { /* counter saturated: a wake is pending anyway */ }
}

void kvf_server_counters(struct kvf_server *s, struct kvf_server_counters *c) { *c = s->ctr; }

void kvf_server_free(struct kvf_server *s)
{
    if (!s) return;
    /* run() has returned: anything left (stuck notifications) is dropped here */
    while (s->conns) {
        struct conn *c = s->conns;
        c->refs = 0;
        conn_destroy(c);
    }
    kvf_ring_exit(&s->ring);
    close(s->efd);
    free(s);
}
