/* kvf_client.c: native client I/O for one connection (see kvf_client.h).
 *
 * GET payloads are received with recvmsg() into an iovec that points at the
 * caller's buffers, so object bytes go from the socket straight into the
 * engine's memory; PUT payloads are sent with sendmsg() from the caller's
 * buffers (gathered, no staging copy). IOV_MAX bounds each call, partial
 * transfers advance the iovec and continue. Asked for checksums, the GET
 * receive hashes each slice as it lands (kvf_rxhash.c).
 */
#define _GNU_SOURCE
#include "kvf_client.h"
#include "kvf_copy.h"
#include "kvf_mpack.h"
#include "kvf_rxhash.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define KVF_IOV_CHUNK 512

static __thread int64_t tl_deadline_ns;
/* The last socket timeout armed on this thread (arm): which fd and option,
 * for which deadline (0: cleared, the call has none), when. A receive loop of
 * many slices re-arms only when the last arming is over KVF_REARM_NS old, so
 * a call can overrun the deadline by at most that much (instead of one
 * setsockopt per slice). */
static __thread struct { int fd, opt; int64_t deadline, at; } tl_armed = {-1, 0, 0, 0};
#define KVF_REARM_NS 2000000LL

void kvf_set_deadline(int64_t deadline_ns)
{
    tl_deadline_ns = deadline_ns;
    tl_armed.fd = -1; /* every call arms afresh: an fd number may have been reused */
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Arm the socket timeout for the next syscall; -ETIMEDOUT once past. */
static int arm(int fd, int opt)
{
    if (tl_deadline_ns == 0) {
        /* No deadline: block. The fd may still carry a timeout an earlier call
         * armed, on this thread or another (pooled connections move between
         * threads): cleared once per call and fd. */
        if (tl_armed.fd != fd || tl_armed.deadline != 0) {
            struct timeval tv = {0, 0};
            if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) ||
                setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv))
                return -errno;
            tl_armed.fd = fd;
            tl_armed.opt = 0;
            tl_armed.deadline = 0;
            tl_armed.at = 0;
        }
        return 0;
    }
    int64_t now = now_ns(), left = tl_deadline_ns - now;
    if (left <= 0) return -ETIMEDOUT;
    if (tl_armed.fd == fd && tl_armed.opt == opt && tl_armed.deadline == tl_deadline_ns &&
        now - tl_armed.at < KVF_REARM_NS)
        return 0; /* armed moments ago for this deadline: still within KVF_REARM_NS of it */
    if (left < 1000000) left = 1000000;
    struct timeval tv = {(time_t)(left / 1000000000LL), (suseconds_t)((left % 1000000000LL) / 1000)};
    if (setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof tv)) return -errno;
    tl_armed.fd = fd;
    tl_armed.opt = opt;
    tl_armed.deadline = tl_deadline_ns;
    tl_armed.at = now;
    return 0;
}

static void advance(struct iovec **iov, int *n, size_t done)
{
    while (*n > 0 && done >= (*iov)->iov_len) {
        done -= (*iov)->iov_len;
        (*iov)++;
        (*n)--;
    }
    if (*n > 0 && done) {
        (*iov)->iov_base = (char *)(*iov)->iov_base + done;
        (*iov)->iov_len -= done;
    }
}

/* iov is modified (advanced in place). */
int kvf_sendv_all(int fd, struct iovec *iov, int n)
{
    while (n > 0 && iov->iov_len == 0) { iov++; n--; }
    while (n > 0) {
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)(n < KVF_IOV_CHUNK ? n : KVF_IOV_CHUNK);
        int rc = arm(fd, SO_SNDTIMEO);
        if (rc) return rc;
        ssize_t r = sendmsg(fd, &mh, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN && tl_deadline_ns) continue; /* re-armed: times out above */
            if (errno == EPIPE) return -ECONNRESET;
            return -errno;
        }
        advance(&iov, &n, (size_t)r);
        while (n > 0 && iov->iov_len == 0) { iov++; n--; }
    }
    return 0;
}

/* ---------------------------------------------------------------- receiving */

/* Slice of the stream received per recvmsg / READ_FIXED while objects are
 * hashed: each slice is hashed right after it lands, while it is still in
 * this core's cache; a separate pass after the whole reply re-reads every
 * byte from memory. Measured with perf on loopback (8 x 32 MiB GETs, hash
 * cycles / copy-out cycles): 64 KiB 0.15, 256 KiB 0.23, 1 MiB 0.21, 8 MiB
 * 0.60, a pass after the reply 0.47. Whole-process CPU of the same GETs
 * (client and server with client_verifies, 4 alternating runs each): 64 KiB
 * 205-261 ms/GiB client, 191-257 server; 256 KiB 189-206 client, 192-211
 * server (4x fewer receive calls, and fewer window updates for the sender). */
#define KVF_HASH_SLICE (256u << 10)

/* recvmsg until the iovec is full (advanced in place). With h, at most
 * KVF_HASH_SLICE bytes per call, each slice hashed as soon as it lands. */
static int recvv_hashed(int fd, struct iovec *iov, int n, struct kvf_rxhash *h)
{
    while (n > 0 && iov->iov_len == 0) { iov++; n--; }
    while (n > 0) {
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)(n < KVF_IOV_CHUNK ? n : KVF_IOV_CHUNK);
        /* with h: cut the iovec at the slice (the last entry shortened, restored after) */
        struct iovec *cut = NULL;
        size_t cut_len = 0;
        if (h) {
            size_t room = KVF_HASH_SLICE;
            for (size_t j = 0; j < mh.msg_iovlen; j++) {
                if (iov[j].iov_len >= room) {
                    cut = &iov[j];
                    cut_len = iov[j].iov_len;
                    iov[j].iov_len = room;
                    mh.msg_iovlen = j + 1;
                    break;
                }
                room -= iov[j].iov_len;
            }
        }
        int rc = arm(fd, SO_RCVTIMEO);
        /* No MSG_WAITALL: with it TCP wakes the receiver only once the whole
         * remainder is queued, so the copy out cannot overlap the sender's
         * transmission; without it each wake-up copies what has arrived
         * (measured 12-18% faster for 1 MiB on loopback, raw C ceiling too). */
        ssize_t r = rc ? -1 : recvmsg(fd, &mh, 0);
        int err = errno;
        if (cut) cut->iov_len = cut_len;
        if (rc) return rc;
        if (r < 0) {
            if (err == EINTR) continue;
            if (err == EAGAIN && tl_deadline_ns) continue;
            return -err;
        }
        if (r == 0) return -ECONNRESET;
        if (h) kvf_rxhash_feed(h, (size_t)r);
        advance(&iov, &n, (size_t)r);
        while (n > 0 && iov->iov_len == 0) { iov++; n--; }
    }
    return 0;
}

int kvf_recvv_all(int fd, struct iovec *iov, int n)
{
    return recvv_hashed(fd, iov, n, NULL);
}

int kvf_recv_all(int fd, void *buf, size_t n)
{
    struct iovec iov = {buf, n};
    return kvf_recvv_all(fd, &iov, 1);
}

int kvf_drain(int fd, uint64_t n)
{
    char scratch[16384];
    while (n > 0) {
        size_t k = n < sizeof scratch ? (size_t)n : sizeof scratch;
        int rc = kvf_recv_all(fd, scratch, k);
        if (rc) return rc;
        n -= k;
    }
    return 0;
}

int kvf_send_frame(int fd, uint8_t opcode, uint8_t flags, uint64_t request_id, const void *meta,
                   uint32_t meta_len, const struct iovec *parts, int nparts)
{
    struct kvf_header h;
    uint64_t payload = 0;
    for (int i = 0; i < nparts; i++) payload += parts[i].iov_len;
    kvf_header_pack(&h, opcode, flags, request_id, meta_len, payload);
    struct iovec small[8];
    struct iovec *iov = small;
    int n = 2 + nparts;
    if (n > 8) {
        iov = malloc(sizeof(struct iovec) * (size_t)n);
        if (!iov) return -ENOMEM;
    }
    iov[0].iov_base = &h;
    iov[0].iov_len = sizeof h;
    iov[1].iov_base = (void *)meta;
    iov[1].iov_len = meta_len;
    if (nparts) memcpy(iov + 2, parts, sizeof(struct iovec) * (size_t)nparts);
    int rc = kvf_sendv_all(fd, iov, n);
    if (iov != small) free(iov);
    return rc;
}

/* ---------------------------------------------------------------- batched sends */

/* This thread's ring for kvf_send_frames: made on first use, closed by the
 * key's destructor when the thread exits. A forked child does not use its
 * parent's ring (the pid is checked): it makes its own. */
static pthread_key_t send_ring_key;
static pthread_once_t send_ring_once = PTHREAD_ONCE_INIT;
static int send_ring_key_ok;
static __thread struct kvf_ring *tl_send_ring;
static __thread pid_t tl_send_ring_pid;
static __thread int tl_send_ring_failed;

static void send_ring_free(void *p)
{
    struct kvf_ring *r = p;
    if (r && tl_send_ring_pid == getpid()) kvf_ring_exit(r);
    free(r);
}

static void send_ring_key_init(void)
{
    send_ring_key_ok = pthread_key_create(&send_ring_key, send_ring_free) == 0;
}

static struct kvf_ring *send_ring(void)
{
    pid_t pid = getpid();
    if (tl_send_ring && tl_send_ring_pid == pid) return tl_send_ring;
    if (tl_send_ring_failed == pid) return NULL;
    tl_send_ring = NULL; /* a parent's ring, inherited by fork: left alone */
    pthread_once(&send_ring_once, send_ring_key_init);
    struct kvf_ring *r = send_ring_key_ok ? calloc(1, sizeof *r) : NULL;
    if (!r || kvf_ring_init(r, KVF_SEND_FRAMES_MAX)) {
        free(r);
        tl_send_ring_failed = pid;
        return NULL;
    }
    if (pthread_setspecific(send_ring_key, r)) {
        kvf_ring_exit(r);
        free(r);
        tl_send_ring_failed = pid;
        return NULL;
    }
    tl_send_ring = r;
    tl_send_ring_pid = pid;
    return r;
}

int kvf_send_frames(uint32_t n, const int *fds, const uint8_t *opcodes, const uint64_t *rids,
                    const void *const *metas, const uint32_t *meta_lens, int *rcs)
{
    if (n > KVF_SEND_FRAMES_MAX) return -EINVAL;
    if (!n) return 0;
    struct kvf_header hs[KVF_SEND_FRAMES_MAX];
    struct iovec iov[2 * KVF_SEND_FRAMES_MAX];
    struct msghdr mh[KVF_SEND_FRAMES_MAX];
    for (uint32_t i = 0; i < n; i++) {
        kvf_header_pack(&hs[i], opcodes[i], 0, rids[i], meta_lens[i], 0);
        iov[2 * i].iov_base = &hs[i];
        iov[2 * i].iov_len = sizeof hs[i];
        iov[2 * i + 1].iov_base = (void *)metas[i];
        iov[2 * i + 1].iov_len = meta_lens[i];
        memset(&mh[i], 0, sizeof mh[i]);
        mh[i].msg_iov = &iov[2 * i];
        mh[i].msg_iovlen = 2;
        rcs[i] = 1; /* not sent yet */
    }
    struct kvf_ring *r = n > 1 ? send_ring() : NULL;
    if (r) {
        uint32_t queued = 0;
        for (uint32_t i = 0; i < n; i++) {
            struct io_uring_sqe *sqe = kvf_ring_sqe(r);
            if (!sqe) break; /* (the ring holds KVF_SEND_FRAMES_MAX): the rest go below */
            sqe->opcode = IORING_OP_SENDMSG;
            sqe->fd = fds[i];
            sqe->addr = (uint64_t)(uintptr_t)&mh[i];
            sqe->len = 1;
            /* MSG_DONTWAIT: each send completes within the submission (a full socket answers
             * -EAGAIN instead of arming a poll that would outlive this call's buffers) */
            sqe->msg_flags = MSG_NOSIGNAL | MSG_DONTWAIT;
            sqe->user_data = i;
            queued++;
        }
        uint32_t got = 0;
        while (got < queued) {
            int rc = kvf_ring_submit_wait(r, queued - got, -1);
            struct io_uring_cqe *cqe;
            while ((cqe = kvf_ring_peek(r)) != NULL) {
                uint64_t i = cqe->user_data;
                int res = cqe->res;
                kvf_ring_cqe_seen(r);
                if (i >= n || rcs[i] != 1) continue;
                got++;
                size_t total = iov[2 * i].iov_len + iov[2 * i + 1].iov_len;
                if (res == -EAGAIN) res = 0;
                if (res < 0) {
                    rcs[i] = res == -EPIPE ? -ECONNRESET : res;
                } else if ((size_t)res < total) {
                    struct iovec *v = &iov[2 * i];
                    int k = 2;
                    advance(&v, &k, (size_t)res);
                    rcs[i] = kvf_sendv_all(fds[i], v, k); /* the rest, blocking, under the deadline */
                } else {
                    rcs[i] = 0;
                }
            }
            if (rc && got < queued) return rc; /* the ring failed: nothing in flight can be told apart */
        }
    }
    for (uint32_t i = 0; i < n; i++)
        if (rcs[i] == 1) rcs[i] = kvf_sendv_all(fds[i], &iov[2 * i], 2);
    return 0;
}

int kvf_recv_header(int fd, struct kvf_header *h, uint32_t max_meta, uint64_t max_payload, int *wire_err)
{
    int rc = kvf_recv_all(fd, h, sizeof *h);
    if (rc) return rc;
    rc = kvf_header_check(h, max_meta, max_payload);
    if (rc) {
        if (wire_err) *wire_err = -rc;
        return -EPROTO;
    }
    return 0;
}

int kvf_parse_sizes(const uint8_t *meta, size_t meta_len, int64_t *sizes, uint32_t n)
{
    struct kvf_mr r;
    uint32_t count;
    if (kvf_mr_find(meta, meta_len, KVF_F_SIZES, &r) || kvf_mr_array(&r, &count) || count != n)
        return -EPROTO;
    for (uint32_t i = 0; i < n; i++) {
        if (kvf_mr_int(&r, &sizes[i]) || sizes[i] < -1) return -EPROTO;
    }
    return 0;
}

/* ---------------------------------------------------------------- registered buffers */

#define KVF_UD_READ 1
#define KVF_UD_CANCEL 2

int kvf_creg_open(struct kvf_creg *c, const struct iovec *bufs, unsigned n)
{
    memset(c, 0, sizeof *c);
    if (n == 0) return -EINVAL;
    c->bufs = malloc(sizeof(struct iovec) * n);
    if (!c->bufs) return -ENOMEM;
    memcpy(c->bufs, bufs, sizeof(struct iovec) * n);
    int rc = kvf_ring_init(&c->ring, 8);
    if (rc) {
        free(c->bufs);
        memset(c, 0, sizeof *c);
        return rc;
    }
    if (!kvf_ring_probe_op(&c->ring, IORING_OP_READ_FIXED) || !kvf_ring_probe_op(&c->ring, IORING_OP_ASYNC_CANCEL))
        rc = -EOPNOTSUPP;
    if (!rc) rc = kvf_ring_register_buffers(&c->ring, c->bufs, n);
    if (rc) {
        kvf_ring_exit(&c->ring);
        free(c->bufs);
        memset(c, 0, sizeof *c);
        return rc;
    }
    c->n = n;
    return 0;
}

void kvf_creg_close(struct kvf_creg *c)
{
    if (c->n) kvf_ring_exit(&c->ring); /* closing the ring unregisters the buffers */
    free(c->bufs);
    memset(c, 0, sizeof *c);
}

int kvf_creg_find(const struct kvf_creg *c, const void *p, size_t len)
{
    uintptr_t a = (uintptr_t)p;
    for (unsigned i = 0; i < c->n; i++) {
        uintptr_t b = (uintptr_t)c->bufs[i].iov_base;
        if (a >= b && len <= c->bufs[i].iov_len && a - b <= c->bufs[i].iov_len - len) return (int)i;
    }
    return -1;
}

/* Cancel the read in flight and reap it (its buffer must not be written after
 * we return). A cancel that does not complete within a second is helped by
 * shutting the socket down, which ends any read on it. */
static void cancel_and_reap(struct kvf_creg *c, int fd)
{
    struct io_uring_sqe *sqe = kvf_ring_sqe(&c->ring);
    if (sqe) {
        sqe->opcode = IORING_OP_ASYNC_CANCEL;
        sqe->addr = KVF_UD_READ;
        sqe->user_data = KVF_UD_CANCEL;
    }
    int read_done = 0, tries = 0;
    while (!read_done && tries < 30) {
        struct io_uring_cqe *cqe;
        while ((cqe = kvf_ring_peek(&c->ring))) {
            if (cqe->user_data == KVF_UD_READ) read_done = 1;
            kvf_ring_cqe_seen(&c->ring);
        }
        if (read_done) break;
        int rc = kvf_ring_submit_wait(&c->ring, 1, 1000);
        if (rc && ++tries == 1) shutdown(fd, SHUT_RDWR);
    }
    /* the cancel's own completion may still come: drain what is there */
    struct io_uring_cqe *cqe;
    while ((cqe = kvf_ring_peek(&c->ring))) kvf_ring_cqe_seen(&c->ring);
}

/* Submit what is prepared and wait for the read's completion (*res),
 * honouring the thread's deadline. */
static int reap_read(struct kvf_creg *c, int fd, int *res)
{
    for (;;) {
        struct io_uring_cqe *cqe = kvf_ring_peek(&c->ring);
        if (cqe) {
            int hit = cqe->user_data == KVF_UD_READ;
            if (hit) *res = cqe->res;
            kvf_ring_cqe_seen(&c->ring);
            if (hit) return 0;
            continue;
        }
        int ms = -1;
        if (tl_deadline_ns) {
            int64_t left = tl_deadline_ns - now_ns();
            if (left <= 0) {
                /* publish the read if it never was, then cancel it */
                kvf_ring_submit_wait(&c->ring, 0, 0);
                cancel_and_reap(c, fd);
                return -ETIMEDOUT;
            }
            ms = (int)((left + 999999) / 1000000);
        }
        int rc = kvf_ring_submit_wait(&c->ring, 1, ms);
        if (rc && rc != -ETIME) {
            cancel_and_reap(c, fd);
            return rc;
        }
    }
}

/* Read exactly len bytes of the stream into p, inside registered buffer idx
 * (with h: at most KVF_HASH_SLICE per read, each hashed as it lands). */
static int read_fixed_all(int fd, struct kvf_creg *c, int idx, void *p, size_t len, struct kvf_rxhash *h)
{
    size_t most = h ? KVF_HASH_SLICE : (1u << 30);
    char *at = p;
    while (len) {
        struct io_uring_sqe *sqe = kvf_ring_sqe(&c->ring);
        if (!sqe) return -EBUSY; /* one read at a time: cannot happen */
        sqe->opcode = IORING_OP_READ_FIXED;
        sqe->fd = fd;
        sqe->addr = (uint64_t)(uintptr_t)at;
        sqe->len = (unsigned)(len > most ? most : len);
        sqe->off = 0;
        sqe->buf_index = (uint16_t)idx;
        sqe->user_data = KVF_UD_READ;
        int res = 0;
        int rc = reap_read(c, fd, &res);
        if (rc) return rc;
        if (res == -EINTR || res == -EAGAIN) continue;
        if (res == -EPIPE) return -ECONNRESET;
        if (res < 0) return res;
        if (res == 0) return -ECONNRESET;
        c->fixed_reads++;
        c->fixed_bytes += (uint64_t)res;
        if (h) kvf_rxhash_feed(h, (size_t)res);
        at += res;
        len -= (size_t)res;
    }
    return 0;
}

int kvf_recv_objects(int fd, uint64_t payload_len, const int64_t *sizes, void *const *bufs,
                     const size_t *buf_lens, uint32_t n, const uint32_t *nseg, uint32_t *bad_index,
                     struct kvf_creg *reg, const void *const *keys, const size_t *key_lens, uint64_t *digests)
{
    uint64_t total = 0;
    uint64_t pieces = 0;
    int too_small = -1;
    size_t first = 0; /* index in bufs of object i's first segment */
    for (uint32_t i = 0; i < n; i++) {
        uint32_t k = nseg ? nseg[i] : 1;
        if (sizes[i] >= 0) {
            uint64_t cap = 0;
            for (uint32_t j = 0; j < k; j++) cap += (uint64_t)buf_lens[first + j];
            total += (uint64_t)sizes[i];
            pieces += k;
            if ((uint64_t)sizes[i] > cap && too_small < 0) too_small = (int)i;
        }
        first += k;
    }
    if (total != payload_len) return -EPROTO;
    if (too_small >= 0) {
        if (bad_index) *bad_index = (uint32_t)too_small;
        int rc = kvf_drain(fd, payload_len);
        return rc ? rc : -EMSGSIZE;
    }
    struct kvf_rxhash oh, *h = NULL;
    if (keys) {
        if (kvf_rxhash_open(&oh, sizes, bufs, buf_lens, nseg, n, keys, key_lens, digests)) return -ENOMEM;
        h = &oh;
    }
    if (!pieces) {
        if (h) { kvf_rxhash_finish(h); kvf_rxhash_close(h); }
        return 0;
    }
    struct iovec *iov = malloc(sizeof(struct iovec) * pieces);
    if (!iov) {
        if (h) kvf_rxhash_close(h);
        return -ENOMEM;
    }
    uint32_t k = 0;
    first = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t segs = nseg ? nseg[i] : 1;
        if (sizes[i] >= 0) {
            /* object i fills its segments in order; the ones past its end get nothing */
            uint64_t left = (uint64_t)sizes[i];
            for (uint32_t j = 0; j < segs && (left || (j == 0 && segs == 1)); j++) {
                size_t take = left < buf_lens[first + j] ? (size_t)left : buf_lens[first + j];
                iov[k].iov_base = bufs[first + j];
                iov[k].iov_len = take;
                k++;
                left -= take;
            }
        }
        first += segs;
    }
    int rc;
    if (!k) {
        rc = 0;
    } else if (!reg || !reg->n) {
        rc = recvv_hashed(fd, iov, (int)k, h);
    } else {
        /* runs of unregistered pieces go through recvmsg, each registered
         * piece through READ_FIXED, in stream order */
        rc = 0;
        uint32_t start = 0;
        for (uint32_t j = 0; j < k && !rc; j++) {
            int idx = iov[j].iov_len ? kvf_creg_find(reg, iov[j].iov_base, iov[j].iov_len) : -1;
            if (idx < 0) continue;
            if (j > start) rc = recvv_hashed(fd, iov + start, (int)(j - start), h);
            if (!rc) rc = read_fixed_all(fd, reg, idx, iov[j].iov_base, iov[j].iov_len, h);
            start = j + 1;
        }
        if (!rc && start < k) rc = recvv_hashed(fd, iov + start, (int)(k - start), h);
    }
    free(iov);
    if (h) {
        if (!rc) kvf_rxhash_finish(h); /* objects of 0 bytes after the last byte */
        kvf_rxhash_close(h);
    }
    return rc;
}

/* ---------------------------------------------------------------- shm */

/* Receive one reply (header + metadata) into *h / *meta (malloc'd). */
static int recv_reply_meta(int fd, uint32_t max_meta, struct kvf_header *h, uint8_t **meta, int *wire_err)
{
    int rc = kvf_recv_header(fd, h, max_meta, 0, wire_err);
    if (rc) return rc;
    *meta = malloc(h->meta_len ? h->meta_len : 1);
    if (!*meta) return -ENOMEM;
    return kvf_recv_all(fd, *meta, h->meta_len);
}

static int find_int_array(const uint8_t *meta, size_t len, const char *name, int64_t *out, uint32_t n)
{
    struct kvf_mr r;
    uint32_t cnt;
    if (kvf_mr_find(meta, len, name, &r) || kvf_mr_array(&r, &cnt) || cnt != n) return -EPROTO;
    for (uint32_t i = 0; i < n; i++)
        if (kvf_mr_int(&r, &out[i])) return -EPROTO;
    return 0;
}

static int find_uint_array(const uint8_t *meta, size_t len, const char *name, uint64_t *out, uint32_t n)
{
    struct kvf_mr r;
    uint32_t cnt;
    if (kvf_mr_find(meta, len, name, &r) || kvf_mr_array(&r, &cnt) || cnt != n) return -EPROTO;
    for (uint32_t i = 0; i < n; i++)
        if (kvf_mr_uint(&r, &out[i])) return -EPROTO;
    return 0;
}

/* The LEASE request's metadata, {"keys": [bin, ...]} (kvfabric.protocol.ShmLeaseRequest), malloc'd. */
static uint8_t *lease_meta(uint32_t n, const void *const *keys, const size_t *key_lens, uint32_t *len)
{
    size_t cap = 16;
    for (uint32_t i = 0; i < n; i++) cap += key_lens[i] + 5;
    uint8_t *m = malloc(cap);
    if (!m) return NULL;
    struct kvf_mw w;
    kvf_mw_init(&w, m, cap);
    kvf_mw_map(&w, 1);
    kvf_mw_cstr(&w, KVF_F_KEYS);
    kvf_mw_array(&w, n);
    for (uint32_t i = 0; i < n; i++) kvf_mw_bin(&w, keys[i], key_lens[i]);
    *len = (uint32_t)w.len;
    return m;
}

int kvf_shm_get(int fd, uint8_t *arena, uint64_t arena_len, uint64_t rid, uint32_t n, const void *const *keys,
                const size_t *key_lens, void *const *bufs, const size_t *buf_lens, uint32_t max_meta,
                uint64_t max_object, struct kvf_header *h, uint8_t **meta, uint32_t *bad_index, int *wire_err,
                int64_t *sizes, uint64_t *sums, uint64_t *digests)
{
    *meta = NULL;
    uint32_t lm_len = 0;
    uint8_t *lm = lease_meta(n, keys, key_lens, &lm_len);
    if (!lm) return -ENOMEM;
    int rc = kvf_send_frame(fd, KVF_OP_SHM_LEASE, 0, rid, lm, lm_len, NULL, 0);
    free(lm);
    if (!rc) rc = recv_reply_meta(fd, max_meta, h, meta, wire_err);
    if (rc) return rc;
    if (h->flags & KVF_FLAG_ERROR) return 0;
    if (h->request_id != rid || h->opcode != KVF_OP_SHM_LEASE || h->payload_len) { *wire_err = KVF_E_MALFORMED; return -EPROTO; }
    struct kvf_mr r;
    uint64_t lease;
    if (kvf_mr_check_meta(*meta, h->meta_len) || kvf_mr_find(*meta, h->meta_len, KVF_F_LEASE, &r) ||
        kvf_mr_uint(&r, &lease)) {
        *wire_err = KVF_E_MALFORMED;
        return -EPROTO;
    }
    int64_t *offs = malloc(sizeof(int64_t) * (n ? n : 1));
    if (!offs) return -ENOMEM;
    rc = find_int_array(*meta, h->meta_len, KVF_F_OFFSETS, offs, n);
    if (!rc) rc = find_int_array(*meta, h->meta_len, KVF_F_SIZES, sizes, n);
    if (!rc) rc = find_uint_array(*meta, h->meta_len, KVF_F_CHECKSUMS, sums, n);
    for (uint32_t i = 0; !rc && i < n; i++) {
        if (sizes[i] < -1 || offs[i] < -1 || (sizes[i] >= 0 && (uint64_t)sizes[i] > max_object)) rc = -EPROTO;
        else if (sizes[i] < 0) continue;
        else if (offs[i] < 0 || (uint64_t)offs[i] + (uint64_t)sizes[i] > arena_len) rc = -EPROTO;
        else if ((uint64_t)sizes[i] > buf_lens[i]) { *bad_index = i; rc = -EMSGSIZE; }
    }
    if (rc == -EPROTO) *wire_err = KVF_E_MALFORMED;
    struct kvf_rxhash oh, *hh = NULL;
    if (!rc && digests) {
        if (kvf_rxhash_open(&oh, sizes, bufs, buf_lens, NULL, n, keys, key_lens, digests)) rc = -ENOMEM;
        else hh = &oh;
    }
    for (uint32_t i = 0; !rc && i < n; i++) {
        if (sizes[i] < 0) continue;
        if (!hh) {
            kvf_copy(bufs[i], arena + offs[i], (size_t)sizes[i]);
            continue;
        }
        /* copy a slice, hash it while it is in cache: one pass over memory, not two */
        for (size_t off = 0, len = (size_t)sizes[i]; off < len;) {
            size_t take = len - off < KVF_HASH_SLICE ? len - off : KVF_HASH_SLICE;
            kvf_copy((char *)bufs[i] + off, arena + offs[i] + off, take);
            kvf_rxhash_feed(hh, take);
            off += take;
        }
    }
    if (hh) {
        if (!rc) kvf_rxhash_finish(hh); /* objects of 0 bytes after the last byte */
        kvf_rxhash_close(hh);
    }
    free(offs);
    /* release the lease whatever happened to the copy (not awaited) */
    uint8_t rm[32];
    struct kvf_mw w;
    kvf_mw_init(&w, rm, sizeof rm);
    kvf_mw_map(&w, 1);
    kvf_mw_cstr(&w, KVF_F_LEASE);
    kvf_mw_uint(&w, lease);
    int rc2 = kvf_send_frame(fd, KVF_OP_SHM_RELEASE, 0, rid + 1, rm, (uint32_t)w.len, NULL, 0);
    return rc ? rc : rc2;
}

int kvf_shm_put(int fd, uint8_t *arena, uint64_t arena_len, uint64_t rid, const void *reserve_meta,
                uint32_t reserve_meta_len, uint32_t n, const uint64_t *sizes, const uint64_t *checksums,
                const struct iovec *parts, int nparts, uint32_t max_meta, struct kvf_header *h, uint8_t **meta,
                int *wire_err)
{
    *meta = NULL;
    int rc = kvf_send_frame(fd, KVF_OP_SHM_RESERVE, 0, rid, reserve_meta, reserve_meta_len, NULL, 0);
    if (!rc) rc = recv_reply_meta(fd, max_meta, h, meta, wire_err);
    if (rc) return rc;
    if (h->flags & KVF_FLAG_ERROR) return 0;
    if (h->request_id != rid || h->opcode != KVF_OP_SHM_RESERVE || h->payload_len) { *wire_err = KVF_E_MALFORMED; return -EPROTO; }
    struct kvf_mr r;
    uint64_t res;
    if (kvf_mr_find(*meta, h->meta_len, KVF_F_RES, &r) || kvf_mr_uint(&r, &res)) { *wire_err = KVF_E_MALFORMED; return -EPROTO; }
    int64_t *offs = malloc(sizeof(int64_t) * (n ? n : 1));
    if (!offs) return -ENOMEM;
    rc = find_int_array(*meta, h->meta_len, KVF_F_OFFSETS, offs, n);
    for (uint32_t i = 0; !rc && i < n; i++)
        if (offs[i] >= 0 && (uint64_t)offs[i] + sizes[i] > arena_len) rc = -EPROTO;
    if (rc) { free(offs); *wire_err = KVF_E_MALFORMED; return rc; }
    /* copy: walk objects and parts together (parts may split objects anyhow) */
    int pi = 0;
    size_t po = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t left = sizes[i], at = offs[i] >= 0 ? (uint64_t)offs[i] : 0;
        while (left) {
            while (pi < nparts && po == parts[pi].iov_len) { pi++; po = 0; }
            if (pi >= nparts) { free(offs); return -EINVAL; }
            size_t take = parts[pi].iov_len - po < left ? parts[pi].iov_len - po : (size_t)left;
            if (offs[i] >= 0) kvf_copy(arena + at, (const char *)parts[pi].iov_base + po, take);
            at += take;
            left -= take;
            po += take;
        }
    }
    free(offs);
    size_t cap = 32 + (size_t)n * 9;
    uint8_t *cm = malloc(cap);
    if (!cm) return -ENOMEM;
    struct kvf_mw w;
    kvf_mw_init(&w, cm, cap);
    kvf_mw_map(&w, 2);
    kvf_mw_cstr(&w, KVF_F_RES);
    kvf_mw_uint(&w, res);
    kvf_mw_cstr(&w, KVF_F_CHECKSUMS);
    kvf_mw_array(&w, n);
    for (uint32_t i = 0; i < n; i++) kvf_mw_uint(&w, checksums[i]);
    free(*meta);
    *meta = NULL;
    rc = kvf_send_frame(fd, KVF_OP_SHM_COMMIT, 0, rid + 1, cm, (uint32_t)w.len, NULL, 0);
    free(cm);
    if (!rc) rc = recv_reply_meta(fd, max_meta, h, meta, wire_err);
    if (!rc && !(h->flags & KVF_FLAG_ERROR) && (h->request_id != rid + 1 || h->opcode != KVF_OP_SHM_COMMIT || h->payload_len)) {
        *wire_err = KVF_E_MALFORMED;
        rc = -EPROTO;
    }
    return rc;
}
