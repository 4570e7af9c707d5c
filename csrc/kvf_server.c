/* kvf_server.c: the io_uring event loop of the native server (see kvf_server.h).
 *
 * The top of the server's request path (the layers are listed in
 * kvf_server_int.h): owns the server object (new/run/stop/free), the
 * listeners and accept, the connection's destruction, CQE dispatch and what a
 * finished receive leads to (header checks, then the dispatcher kvf_ops.c, a
 * PUT object's next step in kvf_put.c, a drain's end), the drain on stop, the
 * retry of requests parked waiting for space and the second pass of requests
 * whose keys were read from a tier. Timeouts and budget wake-ups are
 * kvf_limits.c; posting receives, closing and the per-connection budgets
 * kvf_server_conn.c; the reply send path kvf_send.c.
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
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "kvf_hash.h"

/* ---------------------------------------------------------------- listeners */

static void arm_accept(struct kvf_server *s, int fd, uint64_t *tag)
{
    struct io_uring_sqe *q = kvf_sqe_get(s);
    if (!q) return;
    q->opcode = IORING_OP_ACCEPT;
    q->fd = fd;
    q->accept_flags = SOCK_CLOEXEC;
    q->user_data = KVF_TAG(tag, T_ACCEPT);
}

static void arm_efd(struct kvf_server *s)
{
    struct io_uring_sqe *q = kvf_sqe_get(s);
    if (!q) return;
    q->opcode = IORING_OP_READ;
    q->fd = s->efd;
    q->addr = (uint64_t)(uintptr_t)&s->efd_buf;
    q->len = sizeof s->efd_buf;
    q->user_data = KVF_TAG(&s->tag_efd, T_EFD);
}

/* ---------------------------------------------------------------- conns */

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
        kvf_reply_try_free(s, r);
    }
    kvf_ops_conn_gone(c);
    if (c->batch_op == KVF_OP_PUT && c->rs == RS_OBJ) /* a half-received object */
        kvf_store_unreserve(s->st, c->b.offs[c->b.cur], c->b.sizes[c->b.cur]);
    kvf_put_conn_gone(c); /* and the received parts of its group, if any */
    kvf_conn_unreserved(c);
    kvf_batch_free(&c->b);
    close(c->fd);
    if (c->xxh) kvf_hash_free(c->xxh);
    if (c->xxh_tx) kvf_hash_free(c->xxh_tx);
    s->ctr.request_bytes -= c->meta_mem;
    s->freed_since_trim += c->meta_cap + (c->scratch ? 1u << 16 : 0) + sizeof *c;
    free(c->meta);
    free(c->scratch);
    free(c->stage);
    if (c->prev) c->prev->next = c->next; else s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->ctr.connections--;
    free(c);
}

static void conn_check(struct conn *c)
{
    if (c->closing && c->refs == 0) conn_destroy(c);
}

static void on_header(struct conn *c)
{
    struct kvf_server *s = c->srv;
    c->req_us = kvf_now_us(); /* service time starts: recorded when the reply is queued (kvf_send.c) */
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
                                     ? KVF_BAD_VERSION_MSG : code == KVF_E_MALFORMED
                                     ? "malformed header" : "frame exceeds the limits");
        c->rs = RS_STOP;
        return;
    }
    /* the rest of the frame has stall + its size / min_rate, however it trickles */
    c->rx_deadline_ms = kvf_rate_deadline(s, c->progress_ms, (uint64_t)c->hdr.meta_len + c->hdr.payload_len);
    if (c->hdr.meta_len > c->meta_cap) {
        /* Metadata beyond the keep size is charged to the server-wide request
         * budget; over it the frame is read past (not stored) and answered BUSY. */
        uint32_t cap = c->hdr.meta_len > KVF_META_KEEP ? c->hdr.meta_len : KVF_META_KEEP;
        size_t charge = cap > KVF_META_KEEP ? cap : 0;
        if (charge && s->ctr.request_bytes + charge > s->cfg.request_budget) {
            s->ctr.request_busy++;
            c->pend_code = KVF_E_BUSY;
            snprintf(c->pend_msg, sizeof c->pend_msg, "server busy: request buffers over their budget");
            c->batch_op = 0;
            kvf_conn_drain(c, (uint64_t)c->hdr.meta_len + c->hdr.payload_len);
            return;
        }
        s->ctr.request_bytes -= c->meta_mem;
        free(c->meta);
        c->meta_cap = 0;
        c->meta_mem = 0;
        if (!(c->meta = malloc(cap))) { kvf_conn_close(c); return; }
        c->meta_cap = cap;
        c->meta_mem = charge;
        s->ctr.request_bytes += charge;
    }
    if (c->hdr.meta_len) kvf_conn_recv_into(c, c->meta, c->hdr.meta_len, RS_META);
    else kvf_ops_request(c);
}

static void on_recv(struct conn *c, int res)
{
    c->recv_posted = 0;
    if (res <= 0 || c->closing) { kvf_conn_close(c); return; }
    c->progress_ms = kvf_now_ms();
    if (c->rs == RS_HDR && c->got == 0) c->rx_deadline_ms = kvf_rate_deadline(c->srv, c->progress_ms, KVF_HEADER_SIZE);
    if (c->rs == RS_OBJ) kvf_hash_update(c->xxh, c->rbuf + c->got, (size_t)res);
    c->got += (uint64_t)res;
    if (c->rs != RS_DRAIN) c->srv->ctr.bytes_in += (uint64_t)res;
    if (c->got < c->want) { kvf_conn_recv_more(c); return; }
    switch (c->rs) {
    case RS_HDR: on_header(c); break;
    case RS_META: kvf_ops_request(c); break;
    case RS_OBJ: kvf_put_object_done(c); break;
    case RS_GATE: kvf_put_staged(c); break;
    case RS_DRAIN:
        c->srv->ctr.bytes_in += c->want;
        c->drain_left -= c->want;
        if (c->drain_left) {
            kvf_conn_recv_into(c, c->scratch, c->drain_left < (1 << 16) ? c->drain_left : (1 << 16), RS_DRAIN);
        } else if (c->batch_op) {
            c->b.cur++;
            kvf_batch_step(c);
        } else { /* the request was rejected; its payload is consumed, answer now */
            kvf_reply_error(c, c->pend_code, c->pend_msg);
            kvf_conn_next_request(c);
        }
        break;
    default: break;
    }
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
    if (is_unix && kvf_shm_peer_refused(s, res)) return; /* SO_PEERCRED: answered and closed */
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
    c->progress_ms = c->accepted_ms = kvf_now_ms();
    kvf_conn_next_request(c);
}

/* ---------------------------------------------------------------- loop */

/* A request parked on a tier's reads has them (promoted into DRAM), or a
 * streamed GET has its slots, or a request waited for the connection's
 * streamed reads: run it again, from its metadata still in c->meta. */
static void rerun(struct conn *c)
{
    kvf_tier_rerun_begin(c);
    if (!c->closing) kvf_ops_request(c);
    kvf_tier_rerun_done(c);
}

/* A streamed GET's reply was sent: a request waiting for its share of the read-ahead tries again. */
static void tier_kicked(struct conn *c)
{
    if (!c->tier_kick) return;
    c->tier_kick = 0;
    if (c->tier_wait && !c->closing && !c->tier_listed) {
        c->tier_wait = 0;
        rerun(c);
    }
}

static void tier_reap(struct kvf_server *s)
{
    for (struct conn *c = kvf_tier_reap(s), *n; c; c = n) {
        n = c->tier_next;
        c->tier_next = NULL;
        c->tier_listed = 0;
        if (c->tier_run) {
            c->tier_run = 0;
            rerun(c);
        }
        conn_check(c);
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
        c->progress_ms = kvf_now_ms(); /* nor is it a stall of the peer */
        if (!c->treq) kvf_batch_step(c);
        else if (kvf_tier_step(c)) rerun(c); /* a promotion from a tier waited for space */
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
        kvf_conn_sent(c, cqe->res);
        tier_kicked(c);
        conn_check(c);
        break;
    }

    case T_ZC: {
        struct reply *r = p;
        if (cqe->flags & IORING_CQE_F_NOTIF) {
            kvf_reply_zc_notif(s, r, cqe->res);
            break;
        }
        if (cqe->flags & IORING_CQE_F_MORE) r->notifs++;
        struct conn *c = r->conn;
        c->refs--;
        kvf_conn_sent(c, cqe->res);
        tier_kicked(c);
        conn_check(c);
        break;
    }
    default: break;
    }
}

/* The BUSY frame a connection over max_conns gets before it is closed. */
static void busy_frame_build(struct kvf_server *s)
{
    char msg[64];
    snprintf(msg, sizeof msg, "too many connections (max %u)", s->cfg.max_conns);
    s->busy_len = kvf_error_frame(s->busy_frame, sizeof s->busy_frame, KVF_E_BUSY, msg);
}

int kvf_server_new(struct kvf_server **out, const struct kvf_server_cfg *cfg)
{
    if (!cfg->store || (cfg->tcp_fd < 0 && cfg->unix_fd < 0) || !cfg->max_in_flight || !cfg->max_conns)
        return -EINVAL;
    struct kvf_server *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    s->cfg = *cfg;
    if (!s->cfg.server_id) s->cfg.server_id = "";
    pthread_mutex_init(&s->auth_mu, NULL);
    s->st = cfg->store;
    s->base = kvf_store_base(s->st);
    if (!s->cfg.drain_ms) s->cfg.drain_ms = 5000;
    if (!s->cfg.reply_conn_budget) s->cfg.reply_conn_budget = 1u << 20;
    if (!s->cfg.reply_budget) s->cfg.reply_budget = 32u << 20;
    if (!s->cfg.request_budget) s->cfg.request_budget = 32u << 20;
    if (!s->cfg.reserve_budget) s->cfg.reserve_budget = kvf_store_capacity(s->st) / 4;
    /* A fixed mmap threshold (glibc otherwise raises it after large frees,
     * keeping later large buffers in the heap): reply and request buffers of
     * 128 KiB or more are mapped and go back to the kernel when freed. */
    mallopt(M_MMAP_THRESHOLD, 128 * 1024);
    int rc = kvf_ring_init(&s->ring, 1024);
    if (rc) { free(s); return rc; }
    s->efd = eventfd(0, EFD_CLOEXEC);
    if (s->efd < 0) { rc = -errno; kvf_ring_exit(&s->ring); free(s); return rc; }
    int zc = kvf_ring_probe_op(&s->ring, IORING_OP_SEND_ZC);
    if (cfg->zerocopy == 1 && !zc) { close(s->efd); kvf_ring_exit(&s->ring); free(s); return -EOPNOTSUPP; }
    s->zerocopy = cfg->zerocopy != 0 && zc;
    /* Registering the arena as fixed buffers pins every page of it (7.8 s for
     * 3 GiB here), so it is done only when zero-copy is forced on (every TCP
     * peer then sends from it); with `auto` SEND_ZC goes to off-host peers
     * from unregistered memory (the kernel pins the pages per send), and the
     * server starts in milliseconds at any capacity. */
    if (s->zerocopy && cfg->zerocopy == 1) {
        uint64_t cap = kvf_store_capacity(s->st);
        unsigned n = (unsigned)((cap + KVF_FIXED_CHUNK - 1) / KVF_FIXED_CHUNK);
        struct iovec iov[64];
        if (n <= 64) {
            for (unsigned i = 0; i < n; i++) {
                iov[i].iov_base = s->base + (uint64_t)i * KVF_FIXED_CHUNK;
                uint64_t left = cap - (uint64_t)i * KVF_FIXED_CHUNK;
                iov[i].iov_len = left < KVF_FIXED_CHUNK ? left : KVF_FIXED_CHUNK;
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
    /* The owner hands over bound sockets that are not listening yet: a peer
     * can connect only from here on, when this loop is about to answer it
     * (listen() on a socket that already listens just sets its backlog). */
    if (s->cfg.tcp_fd >= 0 && listen(s->cfg.tcp_fd, KVF_LISTEN_BACKLOG)) return -errno;
    if (s->cfg.unix_fd >= 0 && listen(s->cfg.unix_fd, KVF_LISTEN_BACKLOG)) return -errno;
    if (s->cfg.tcp_fd >= 0) arm_accept(s, s->cfg.tcp_fd, &s->tag_tcp);
    if (s->cfg.unix_fd >= 0) arm_accept(s, s->cfg.unix_fd, &s->tag_unix);
    arm_efd(s);
    /* Stopping drains: accepts are cancelled, idle connections closed at
     * once, frames being received finish and their replies go out (each
     * connection closes after its last reply, kvf_conn_next_request), for at
     * most drain_ms; then every connection is closed, and zero-copy sends get
     * 2 s more for their notifications. */
    int64_t drain_until = 0, stop_at = 0, last_sweep = kvf_now_ms();
    for (;;) {
        if (s->stop) {
            int64_t now = kvf_now_ms();
            if (!drain_until) {
                drain_until = now + s->cfg.drain_ms;
                for (struct conn *c = s->conns; c; c = c->next) {
                    if (c->closing) continue;
                    c->close_after_send = 1;
                    int idle = (c->rs == RS_HDR && c->got == 0) || c->rs == RS_BLOCKED || c->rs == RS_STOP;
                    if (idle && !c->q_head) kvf_conn_close(c);
                }
                /* listeners: the owner closes the fds; cancel our accepts */
                struct io_uring_sqe *q;
                if ((q = kvf_sqe_get(s))) { q->opcode = IORING_OP_ASYNC_CANCEL; q->addr = KVF_TAG(&s->tag_tcp, T_ACCEPT); }
                if ((q = kvf_sqe_get(s))) { q->opcode = IORING_OP_ASYNC_CANCEL; q->addr = KVF_TAG(&s->tag_unix, T_ACCEPT); }
            }
            if (!stop_at && (!s->conns || now > drain_until)) {
                stop_at = now + 2000;
                for (struct conn *c = s->conns; c; c = c->next) kvf_conn_close(c);
            }
            if ((!s->conns && !s->live_replies) || (stop_at && now > stop_at)) break;
        }
        int rc = kvf_ring_submit_wait(&s->ring, 1, s->stop ? 50 : 500);
        if (rc && rc != -ETIME) return rc;
        struct io_uring_cqe *cqe;
        while ((cqe = kvf_ring_peek(&s->ring))) {
            struct io_uring_cqe copy = *cqe;
            kvf_ring_cqe_seen(&s->ring);
            dispatch(s, &copy);
        }
        if (s->tier) tier_reap(s);
        if (s->parked) retry_parked(s);
        if (s->wake_blocked || s->wake_resv) kvf_wake_waiters(s);
        int64_t now = kvf_now_ms();
        if (now - last_sweep >= 500) {
            last_sweep = now;
            kvf_sweep(s, now);
            kvf_shm_sweep(s, now);
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
    pthread_mutex_destroy(&s->auth_mu);
    free(s->nixl_md);
    free(s);
}
