/* kvf_server_int.h: state shared by the files of the native server's request
 * path. Not part of the extension's interface. They are layers, calls going
 * down only (scripts/c-layers.py checks it in CI), top first:
 *
 *   kvf_server.c       the io_uring loop: accept, CQE dispatch, receive
 *                      completions, connection lifetime, parked retries
 *   kvf_limits.c       timeouts (the 500 ms sweep) and budget wake-ups
 *   kvf_ops.c          the dispatcher; HELLO, PING, GET, EXISTS, LOOKUP, DELETE
 *   kvf_shm.c, kvf_stats.c, kvf_tier_ops.c
 *                      shm requests; STATS; requests parked on a tier's reads
 *   kvf_put.c          the PUT pipeline (and the shm RESERVE's slots)
 *   kvf_request.c      metadata parsing, rejects, status replies
 *   kvf_send.c         replies: queue, send, zero-copy, verify while sending
 *   kvf_server_conn.c  the connection: receives, close, park, buffers, budgets
 *
 * A lower layer hands work back by its return value or by state the loop
 * reads (a finished tier request is on kvf_tier_reap's list), never by a call
 * up. The declarations below follow the same order. */
#ifndef KVF_SERVER_INT_H
#define KVF_SERVER_INT_H

#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "kvf_mpack.h"
#include "kvf_protocol.h"
#include "kvf_server.h"
#include "kvf_store.h"
#include "kvf_uring.h"

/* RS_GATE: the first bytes of a PUT object are received into c->stage before
 * a slot is reserved for it; RS_RESV_WAIT: it waits for the server-wide
 * reserve budget. */
enum rs { RS_HDR, RS_META, RS_OBJ, RS_DRAIN, RS_PARKED, RS_BLOCKED, RS_STOP, RS_GATE, RS_RESV_WAIT,
          RS_TIER /* keys being read from a tier (kvf_tier_ops.c) */ };

/* Per-connection buffers kept between requests: a metadata buffer of up to
 * KVF_META_KEEP bytes and batch arrays of up to KVF_BATCH_KEEP keys; larger
 * ones are charged to the request budget and freed once the request is done. */
#define KVF_META_KEEP 4096u
#define KVF_BATCH_KEEP 64u
/* A PUT object's slot is reserved (and space evicted for it) only once its
 * first min(size, KVF_PUT_GATE) bytes have arrived, received into a staging
 * buffer and then copied into the slot: never for a bare header. */
#define KVF_PUT_GATE (16u << 10)
/* Over the server-wide reply budget, a connection with no reply queued may
 * still get a reply of up to this many bytes (a larger GET is answered BUSY). */
#define KVF_REPLY_SMALL 4096u

/* A PUT object is received in chunks of this size, each hashed while it is
 * still in cache and while the next one is on its way. */
#define KVF_OBJ_CHUNK (256u << 10)
/* GET objects up to this size are verified before their reply is queued;
 * larger ones chunk by chunk while they are sent (bounded loop stalls). */
#define KVF_VERIFY_WHOLE (4u << 20)
/* A streamed-verified object is hashed this far ahead of what is sent: one
 * send's worth, so no object holds the loop for more than one window's hash
 * (~0.2 ms), and the bytes are still in cache when the kernel copies them.
 * benchmarks/get_cpu.py (server verifies, 8 x 32 MiB): 2 MiB 224-234 client
 * CPU-ms/GiB, 512 KiB 258-267 (more, smaller sends to receive). */
#define KVF_HASH_AHEAD (2048u << 10)
#define KVF_SEND_IOV 64
#define KVF_FIXED_CHUNK (1ull << 30) /* registered buffers are at most 1 GiB each */
/* SQE user_data: a pointer tagged in its low 3 bits (see kvf_server.c) */
enum { T_ACCEPT = 1, T_EFD = 2, T_RECV = 3, T_SEND = 4, T_ZC = 5 };
#define KVF_TAG(p, t) ((uint64_t)(uintptr_t)(p) | (t))
enum tr { TR_TCP = 0, TR_NATIVE = 1, TR_SHM = 2, TR_NIXL = 3 };

/* seg.entry of a slot the reply holds reserved (no store entry): a GET object
 * streamed from the SSD tier, unreserved when the reply is done unless it was
 * promoted (then entry is its pinned store entry). */
#define KVF_SEG_SLOT UINT32_MAX

struct seg {
    uint64_t off, len;
    uint32_t entry;  /* pinned store entry, released when the reply is done; KVF_SEG_SLOT: see above */
    int verify;      /* large object: checksum verified chunk by chunk while it is sent */
    uint64_t csum;   /* expected checksum when verify is set */
    uint64_t hashed; /* bytes hashed so far; never more than this is sent */
    int wait;        /* its bytes are still being read from the SSD tier: the reply sends up to
                        `hashed` (the chunks checked so far) and waits there (kvf_conn_send_more) */
};

/* One queued reply. Freed when fully sent (or orphaned by a closed
 * connection) and every zero-copy notification has arrived. */
struct reply {
    struct reply *next;
    struct conn *conn;
    uint8_t *head; /* header + metadata */
    size_t head_len, head_off;
    struct seg *segs;
    uint32_t nseg, seg;
    uint64_t seg_off;
    uint32_t notifs;     /* zero-copy notifications outstanding */
    int done;            /* sent or orphaned */
    int pass_fd;         /* >= 0: send with SCM_RIGHTS (shm attach) */
    int64_t deadline_ms; /* min_rate bound, set when it starts going out; 0: none */
    size_t mem;          /* bytes allocated for it (the reply budgets count these) */
    uint64_t tier_bytes; /* arena slots of its objects streamed from the SSD tier: counted in the
                            connection's tstream_bytes until it is sent (then tier_kick) */
    struct msghdr mh;
    struct iovec *iovs;  /* KVF_SEND_IOV entries, for SENDMSG */
    union { struct cmsghdr align; char buf[CMSG_SPACE(sizeof(int))]; } cmsg;
};

struct lease {
    uint32_t id, n;
    uint32_t *entries;
    int64_t until_ms; /* dropped by kvf_shm_sweep after this (max_lease_ms) */
};

/* Batch state of a PUT (objects arriving) or shm RESERVE (slots handed out). */
/* a group part received (or written, shm) and verified, its slot kept until its group is
 * committed whole (kvf_put_group_close); a batch status, never on the wire */
#define KVF_PUT_PENDING 0xff

struct batch {
    uint32_t n, cur;
    const uint8_t **keys;
    uint8_t *klens;
    uint64_t *sizes, *csums, *offs;
    const uint8_t **parents;
    uint8_t *plens;
    /* groups (issue 23; NULL/0 for an ungrouped object): the group key, its length, the
     * group's number of parts; gruns: scratch for kvf_parse_groups's duplicate check */
    const uint8_t **groups;
    uint8_t *glens;
    uint32_t *gparts, *gruns;
    uint32_t gstart, gend; /* PUT: the group run being received, [gstart, gend), while gopen */
    uint8_t gopen, gfail;  /* gfail: the status that refuses the whole run (0: none yet) */
    uint8_t *status;
    uint64_t nsref;  /* PUT: the frame's namespace ref (kvf_ns_ref of its ns tag; 0 untagged) */
    uint8_t *keybuf; /* RESERVE: keys copied out of the meta buffer */
    uint64_t park_round;
    uint32_t cap;    /* entries allocated (batch_alloc sizes them to the request) */
    size_t mem;      /* bytes charged to *acct (arrays over KVF_BATCH_KEEP keys), 0 otherwise */
    uint64_t *acct;  /* the server's request-buffer gauge */
};

struct conn {
    struct kvf_server *srv;
    struct conn *prev, *next;      /* all connections */
    struct conn *park_next;        /* waiting for space */
    int fd, is_unix, closing, close_after_send, authed, transport, parked;
    int remote_arena;              /* a TCP connection whose HELLO asked for nixl (kvf_server_set_remote_arena):
                                    * the shm LEASE/RELEASE/RESERVE/COMMIT are served on it, ATTACH answers the
                                    * arena's NIXL agent metadata instead of its memfd */
    /* HELLO's challenge (server with a token): the nonces of the last HELLO, ours fresh per HELLO;
     * hello_seen until an AUTH answers them (one AUTH per HELLO) */
    int hello_seen;
    uint8_t cnonce[KVF_NONCE_BYTES], snonce[KVF_NONCE_BYTES];
    int zc;                        /* GET objects go out with SEND_ZC (see on_accept) */
    int64_t progress_ms;           /* last time a frame or a reply made progress */
    int64_t rx_deadline_ms;        /* min_rate bound of the frame being read (0: none / between frames) */
    int64_t park_ms;               /* when it parked (waiting for space is not the peer's time) */
    int64_t accepted_ms;           /* pre-auth timeout */
    int64_t req_us;                /* when the current request's header was in (kvf_now_us); 0: not timed */
    size_t reply_mem;              /* bytes of its queued replies */
    size_t meta_mem;               /* bytes of c->meta charged to the request budget */
    uint64_t reserved;             /* bytes of the PUT slot reserved and not yet received */
    uint8_t *stage;                /* RS_GATE: an object's first bytes (KVF_PUT_GATE), freed after the request */
    uint32_t staged;               /* bytes of object staged_idx - 1 in stage (0: none) */
    uint32_t staged_idx;
    uint32_t refs;                 /* SQEs in flight that point at this conn */
    enum rs rs;
    struct kvf_header hdr;
    uint8_t *meta;
    uint32_t meta_cap;
    uint8_t *rbuf;                 /* where the current recv goes */
    uint64_t want, got;
    uint64_t drain_left;           /* RS_DRAIN: bytes still to discard */
    void *xxh;                     /* XXH3 state: a PUT object is hashed chunk by chunk as it lands */
    void *xxh_tx;                  /* XXH3 state of the GET object being verified while sent */
    int pend_code;                 /* error to answer once a rejected payload is drained */
    char pend_msg[160];
    int recv_posted, send_posted;
    uint8_t *scratch;              /* drain target */
    int batch_op;                  /* KVF_OP_PUT or KVF_OP_SHM_RESERVE, 0 = none */
    struct batch b;
    struct reply *q_head, *q_tail;
    uint32_t nreplies;
    /* shm */
    struct lease *leases;
    uint32_t nleases, next_lease;
    struct batch resv;             /* one open reservation (shm PUT) */
    uint32_t resv_id;
    int resv_open;
    uint8_t *resv_parents;         /* RESERVE: parent keys copied out of the meta buffer, kept until COMMIT */
    uint8_t *resv_groups;          /* RESERVE: group keys likewise (issue 23) */
    int64_t resv_until_ms;         /* open reservation expires after this (0: clock not started) */
    uint32_t resv_expired;         /* id of the last reservation that expired (for COMMIT's answer) */
    /* tiers (kvf_tier_ops.c) */
    struct kvf_tier_req *treq;     /* reads in flight for the parked request, or NULL */
    struct kvf_tier_req *tstream;  /* streamed GET replies already queued whose reads are in flight (a list) */
    uint64_t tstream_bytes;        /* arena slots of its streamed GET replies not yet sent (reads in flight or
                                      bytes unsent): at most the tier's promotion cap */
    int tier_kick;                 /* a streamed reply was sent: a request in tier_wait may go on (the loop) */
    int tier_wait;                 /* RS_TIER: this request waits for tstream's reads (over the cap) */
    int tier_run;                  /* on kvf_tier_reap's list: its request runs again (else only checked) */
    int tier_listed;               /* on kvf_tier_reap's list (once, however many reads of it came back) */
    int tier_pass;                 /* the request is being re-dispatched: never to a tier again */
    struct conn *tier_next;        /* kvf_tier_reap's list of requests to dispatch again */
};

struct kvf_server {
    struct kvf_server_cfg cfg;
    struct kvf_store *st;
    uint8_t *base;
    struct kvf_ring ring;
    int efd;
    uint64_t efd_buf;
    volatile int stop;
    int zerocopy, fixed;
    struct conn *conns;
    struct conn *parked;
    uint64_t seen_round;
    int64_t start_ms;
    struct kvf_server_counters ctr;
    uint64_t live_replies;
    uint64_t freed_since_trim;     /* heap bytes freed since the last malloc_trim */
    int wake_blocked;              /* a connection waits for the server-wide reply budget */
    int resv_waiting, wake_resv;   /* one waits for the reserve budget / some of it was freed */
    uint64_t tag_tcp, tag_unix, tag_efd; /* 8-aligned addresses used as user_data for listeners */
    uint8_t busy_frame[KVF_HEADER_SIZE + 96]; /* BUSY error frame (request id 0) for a peer over max_conns */
    size_t busy_len;
    struct kvf_tier *tier;         /* tiers below DRAM (kvf_tier.h), or NULL */
    /* peers refused AUTH_FAILED, for the control thread's log (kvf_server_auth_failures) */
    pthread_mutex_t auth_mu;
    char auth_log[KVF_AUTH_LOG][KVF_PEER_NAME];
    uint32_t auth_n;
    uint64_t auth_lost;
    /* remote arena access (nixl): the NIXL agent metadata of the process hosting this server and the
     * address the arena is registered at there; NULL until kvf_server_set_remote_arena */
    uint8_t *nixl_md;
    uint32_t nixl_md_len;
    uint64_t nixl_base;
};

/* Monotonic clock in microseconds (service-time histograms). */
static inline int64_t kvf_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* A request's metadata: what the handlers parse. */
struct kvf_meta {
    const uint8_t *p;
    size_t n;
};

/* ---- kvf_server.c, kvf_limits.c: the loop (kvf_server.h is its interface) */
void kvf_sweep(struct kvf_server *s, int64_t now); /* timeouts (every 500 ms) and heap trim */
void kvf_wake_waiters(struct kvf_server *s);      /* a budget was freed: resume who waits on it */

/* ---- kvf_ops.c: the dispatcher */
void kvf_ops_request(struct conn *c);          /* header + meta are in */
void kvf_ops_conn_gone(struct conn *c);        /* free leases, reservations, tier reads */

/* ---- kvf_shm.c */
void kvf_shm_op(struct conn *c, const uint8_t *meta, size_t len, int op); /* SHM_* on the unix socket */
void kvf_shm_conn_gone(struct conn *c);  /* release leases, free the reservation */
/* Loop thread, every ~500 ms: drop leases past max_lease_ms and reservations past the stall timeout. */
void kvf_shm_sweep(struct kvf_server *s, int64_t now);
/* A unix peer just accepted on fd: 0 allowed (same uid as the server, or in the
 * configured uid / gid lists, SO_PEERCRED); 1 refused: an AUTH_FAILED frame was
 * sent, fd is closed and counted (shm_refused). */
int kvf_shm_peer_refused(struct kvf_server *s, int fd);

/* ---- kvf_stats.c */
void kvf_op_stats(struct conn *c);             /* STATS: queue the reply, then the next request */

/* ---- kvf_tier_ops.c */
/* GET/LOOKUP/DELETE keys missing DRAM but on a tier: park c and read them (1),
 * or 0 (serve now: nothing to read, or read already; a streamed GET: its
 * slots are reserved, the reply is built with kvf_tier_stream_slot and
 * started with kvf_tier_stream_start). */
int kvf_tier_park(struct conn *c, int op, struct batch *b, uint32_t n);
/* Parked for space: reserve and post the rest. 1: every read is back (or, for
 * a streamed GET, every slot reserved), the request is to be dispatched again
 * (kvf_tier_rerun_begin, kvf_ops_request, kvf_tier_rerun_done); 0: waiting. */
int kvf_tier_step(struct conn *c);
/* A streamed GET being answered: the reserved slot of key (the first one not
 * yet given to a segment): 1 and off/size/csum set, the job bound to segment
 * seg of the reply; 0: none (a miss). */
int kvf_tier_stream_slot(struct conn *c, const uint8_t *key, uint32_t klen, uint32_t seg, uint64_t *off,
                         uint64_t *size, uint64_t *csum);
/* The streamed GET's reply rp is queued: post its reads (each object goes out
 * as its read is verified, kvf_conn_send_more), give back unused slots. */
void kvf_tier_stream_start(struct conn *c, struct reply *rp);
/* Read jobs came back: promote (and send a streamed GET's objects). Returns
 * the connections whose requests are to run again, linked by tier_next: each
 * not closing is to be dispatched again (kvf_tier_rerun_begin,
 * kvf_ops_request, kvf_tier_rerun_done); each may be destroyable. */
struct conn *kvf_tier_reap(struct kvf_server *s);
void kvf_tier_rerun_begin(struct conn *c); /* the request found by kvf_tier_reap/step runs again now */
void kvf_tier_rerun_done(struct conn *c); /* the second pass is done: free the request's reads */
void kvf_tier_conn_gone(struct conn *c);

/* ---- kvf_put.c: the PUT pipeline */
void kvf_op_put(struct conn *c, struct kvf_meta m);
void kvf_batch_step(struct conn *c);           /* continue a PUT/RESERVE */
void kvf_put_object_done(struct conn *c);      /* a PUT object landed in its slot */
void kvf_put_staged(struct conn *c);           /* a PUT object's first bytes are in c->stage */
void kvf_put_conn_gone(struct conn *c);        /* a PUT's connection died: its open group is dropped, counted */
void kvf_put_group_close(struct kvf_server *s, struct batch *b); /* commit or refuse b's group run whole */

/* ---- kvf_request.c: what the handlers share; parse_* return 0 or a wire error code (KVF_E_*) */
/* Answer code: at once (and close, for the codes after which the stream cannot
 * be trusted), or once the request's payload is consumed. No return. */
void kvf_reject(struct conn *c, int code, const char *msg);
/* In a handler of conn c: a reply rp with meta_cap cap and nseg payload segments, and a msgpack
 * writer w over its metadata; out of memory: rejected with KVF_E_INTERNAL and the handler returns. */
#define KVF_REPLY_BEGIN(cap, nseg)                                              \
    struct reply *rp = kvf_reply_new(c, (cap), (nseg));                         \
    if (!rp) { kvf_reject(c, KVF_E_INTERNAL, "out of memory"); return; }       \
    struct kvf_mw w;                                                            \
    kvf_mw_init(&w, rp->head + KVF_HEADER_SIZE, (cap))
/* keys -> b->keys/klens (b sized to them; BUSY when over the request budget) */
int kvf_parse_keys(struct conn *c, struct kvf_meta m, struct batch *b, uint32_t *n);
const char *kvf_keys_error(int e);             /* the message of kvf_parse_keys's code */
int kvf_parse_groups(struct conn *c, struct kvf_meta m, struct batch *b, uint32_t n);
const char *kvf_groups_error(int e);           /* the message of kvf_parse_groups's code */
/* ns (PUT, issue 27): absent or nil -> *nsref 0; a KVF_NS_TAG_BYTES bin -> its ref (interned);
 * else MALFORMED; BUSY when the server's tag table is full. */
int kvf_parse_ns(struct conn *c, struct kvf_meta m, uint64_t *nsref);
const char *kvf_ns_error(int e);
int kvf_parse_uints(struct kvf_meta m, const char *name, uint64_t *out, uint32_t n);
int kvf_parse_uint(struct kvf_meta m, const char *name, uint64_t *v, int required);
/* an optional bool field: absent leaves *v as it is; not a bool -> MALFORMED */
int kvf_parse_bool(struct kvf_meta m, const char *name, int *v);
/* {"status": [...]} (with_offsets: + "res" and "offsets", the shm RESERVE's) */
void kvf_put_reply(struct conn *c, struct batch *b, int op, int with_offsets);

/* ---- kvf_send.c: replies */
/* Append the service-time histograms to a STATS map: 2 * KVF_LAT_OPS pairs,
 * lat_<op>_us_buckets (array of KVF_LAT_BUCKETS counts) and lat_<op>_us_sum. */
void kvf_lat_write(struct kvf_mw *w, const struct kvf_server_counters *ctr);
struct reply *kvf_reply_new(struct conn *c, size_t meta_cap, uint32_t nseg);
void kvf_reply_finish(struct conn *c, struct reply *r, uint8_t opcode, uint8_t flags, size_t meta_len,
                      uint64_t payload_len);
void kvf_reply_error(struct conn *c, int code, const char *msg);
/* A whole error frame (opcode 0, request id 0, REPLY|ERROR; the frame
 * protocol.encode_error(0, 0, code, msg) makes) into frame[0..cap), for a
 * peer refused before it has a connection; returns its length, or 0 if it
 * does not fit. */
size_t kvf_error_frame(uint8_t *frame, size_t cap, int code, const char *msg);
void kvf_reply_drop(struct conn *c, struct reply *r); /* never queued */
/* Free r (releasing its slot pins) once it is done and no zero-copy
 * notification is outstanding; otherwise nothing. No return. */
void kvf_reply_try_free(struct kvf_server *s, struct reply *r);
/* A segment of a queued reply became sendable (its SSD read is in, hashed = len): send on. */
void kvf_conn_send_more(struct conn *c);
/* A SENDMSG/SEND_ZC of c's head reply completed with res (bytes or -errno):
 * account it and post the next send; closes c on error. No return. */
void kvf_conn_sent(struct conn *c, int res);
/* A SEND_ZC notification CQE (res: its flags) for r: the kernel is done with
 * the pages; frees r if nothing else is pending. No return. */
void kvf_reply_zc_notif(struct kvf_server *s, struct reply *r, int res);

/* ---- kvf_server_conn.c: the connection, the bottom of the request path */
/* A free SQE (submits pending ones first when the ring is full); NULL if none
 * could be freed: callers close the connection (treat it as -EBUSY). */
struct io_uring_sqe *kvf_sqe_get(struct kvf_server *s);
/* min_rate bound of a frame or reply of `bytes` starting at `now`: an absolute
 * time in ms, or 0 when there is none. */
int64_t kvf_rate_deadline(const struct kvf_server *s, int64_t now, uint64_t bytes);
/* Start closing c (shutdown completes its SQEs; destroyed by the loop once
 * none is left); no return, idempotent. */
void kvf_conn_close(struct conn *c);
void kvf_conn_drain(struct conn *c, uint64_t n);
void kvf_conn_recv_into(struct conn *c, void *buf, uint64_t n, enum rs stage);
void kvf_conn_recv_more(struct conn *c); /* post the rest of the current receive (c->want - c->got) */
/* Ready for the next header (or blocked on the reply budgets, or closing). */
void kvf_conn_next_request(struct conn *c);
void kvf_conn_park(struct conn *c, uint64_t bytes);
/* Receive the first n (<= KVF_PUT_GATE) bytes of the current PUT object into
 * c->stage (RS_GATE; the loop calls kvf_put_staged when they are in). No return. */
void kvf_conn_stage(struct conn *c, uint32_t n);
/* Receive a PUT object of `size` bytes into its slot, the first `staged` of
 * them already in c->stage (copied and hashed here). 1: the object is whole
 * already; 0: a receive is posted (kvf_put_object_done when it is in) or the
 * connection is closing. */
int kvf_conn_recv_obj(struct conn *c, uint8_t *slot, uint64_t size, uint32_t staged);
/* A PUT slot of c is received (or given up): return its bytes to the reserve budget. */
void kvf_conn_unreserved(struct conn *c);
uint64_t kvf_conn_obj_digest(struct conn *c); /* checksum of the object just received */
void kvf_conn_shrink(struct conn *c);             /* free buffers over the keep sizes (request done) */
int kvf_conn_replies_over_budget(struct conn *c); /* 1: c waits for its replies before its next request */
/* Arrays for cap entries (and a key buffer when keybuf) sized to the request;
 * over KVF_BATCH_KEEP entries charged to the request budget: 0, -EBUSY, -ENOMEM. */
int kvf_batch_alloc(struct conn *c, struct batch *b, uint32_t cap, int keybuf);
void kvf_batch_free(struct batch *b);

#endif
