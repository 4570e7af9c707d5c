/* kvf_server.h: the io_uring data plane of the native pool server.
 *
 * One thread runs kvf_server_run(): it accepts connections on a TCP listener
 * (and, for same-host clients, a unix listener), reads each request header
 * and metadata, receives PUT objects straight into arena slots reserved for
 * them, verifies and commits them, and sends GET replies from the slots with
 * IORING_OP_SEND_ZC to off-host peers when the kernel supports it (the arena
 * registered as fixed buffers only when zero-copy is forced on), keeping each
 * slot pinned until the kernel's notification says it is done with the
 * pages. Requests on one connection are read and answered in order while
 * earlier replies are still being sent; reading pauses at max_in_flight
 * queued replies or over the reply budgets (kvf_limits.c).
 *
 * No Python runs per frame: decisions arrive as data (limits, the pre-encoded
 * HELLO reply, which keys to evict via kvf_store_evict from the control
 * thread). All functions return 0 or -errno.
 */
#ifndef KVF_SERVER_H
#define KVF_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "kvf_shared.h"
#include "kvf_store.h"

/* backlog of the listen() that kvf_server_run() calls on the owner's sockets */
#define KVF_LISTEN_BACKLOG 1024

struct kvf_server_cfg {
    int tcp_fd;  /* bound TCP socket (kvf_server_run listens on it), or -1 */
    int unix_fd; /* bound unix socket for shm clients (listened on likewise), or -1 */
    struct kvf_store *store;
    uint32_t max_conns;
    uint32_t max_keys, max_key_bytes, max_meta, max_in_flight;
    uint64_t max_payload, max_object;
    const char *auth; /* the pool token (NUL-terminated; its bytes key the HELLO proofs), NULL: none */
    const char *server_id; /* the id the HELLO reply names and the server's proof covers (NUL-terminated) */
    /* The HELLO reply's static entries: msgpack key/value pairs (no map header).
     * C writes the map around them, plus auth_required and, with a token, the
     * connection's nonce and proof (kvfabric.protocol.auth). */
    const uint8_t *hello_pairs;
    size_t hello_len;
    const uint8_t *stats_extra; /* msgpack key/value pairs appended to STATS */
    size_t stats_extra_len;
    int zerocopy; /* -1 auto (probe), 0 never, 1 required (-EOPNOTSUPP if absent) */
    uint32_t max_lease_ms; /* cap on LOOKUP leases (0: the protocol's 3600000) */
    uint32_t stall_ms; /* a peer stalled this long mid-frame (or not reading a reply) is dropped; 0 = never */
    /* shm peers (SO_PEERCRED): the server's own uid always; these uids and gids
     * (effective or supplementary group of the peer) too. Arrays owned by the caller. */
    const uint32_t *shm_uids, *shm_gids;
    uint32_t n_shm_uids, n_shm_gids;
    uint64_t min_rate; /* bytes/s: a frame (from its header) or a reply (from its first byte out) of S bytes
                          must be done within stall_ms + S / min_rate even if bytes keep trickling, else the
                          peer is dropped (counted in `too_slow`); 0, or stall_ms 0: no such bound */
    uint32_t idle_ms;    /* a connection idle between frames this long is closed; 0 = never */
    uint32_t preauth_ms; /* with auth: a connection not authenticated this long after accept is closed; 0 = never */
    uint32_t drain_ms;   /* after kvf_server_stop(): frames in flight may finish for this long (0: 5000) */
    /* Memory budgets (0: the default in brackets). Replies queued on one
     * connection [1 MiB] or on all [32 MiB] over their budget pause reading
     * (the connection's next request waits until replies went out); request
     * buffers above the per-connection keep sizes (metadata > KVF_META_KEEP,
     * batch arrays > KVF_BATCH_KEEP keys) over request_budget [32 MiB] answer
     * BUSY; PUT slots reserved but not yet received over reserve_budget
     * [capacity / 4] make the next PUT object wait (one object may always go). */
    uint64_t reply_conn_budget, reply_budget, request_budget, reserve_budget;
    /* The shared-filesystem tier (kvf_shared.h), opened and owned by the caller; NULL: none. */
    struct kvf_shared *shared;
};

/* Service-time histograms (struct kvf_server_counters.lat): one per measured
 * opcode, KVF_LAT_BUCKETS log2 buckets of microseconds. The time runs from the
 * request's header being in to its reply being queued (kvf_reply_finish), so
 * it includes receiving a PUT's objects and waiting for eviction space, not
 * sending a GET's bytes. Bucket i < KVF_LAT_BUCKETS - 1 counts times t with
 * t < 2^i us (and t >= 2^(i-1) us for i > 0); the last bucket counts the rest
 * (>= 2^(KVF_LAT_BUCKETS-2) us, about 8.4 s). Recorded by the loop thread only,
 * read without locks (kvf_server_counters). */
enum { KVF_LAT_GET, KVF_LAT_PUT, KVF_LAT_LOOKUP, KVF_LAT_EXISTS, KVF_LAT_DELETE, KVF_LAT_OPS };
#define KVF_LAT_BUCKETS 25

struct kvf_server_counters {
    uint64_t hits, misses, puts, bytes_in, bytes_out, connections, connections_total, rejected;
    uint64_t zc_sends, copy_sends, zc_copied_notifs, stalled;
    uint64_t too_slow; /* dropped over the min_rate bound while still making progress */
    uint64_t checksum_rejects; /* PUT objects refused: their checksum did not match key + bytes */
    uint64_t groups_stored;    /* PUT groups admitted whole (issue 23) */
    uint64_t groups_refused;   /* PUT groups refused whole: a part too large, no space, a checksum mismatch */
    uint64_t groups_torn;      /* PUT groups dropped whole: the connection died before their last part */
    uint64_t client_verified;  /* GET objects sent unchecked: the client said it verifies them (client_verifies) */
    uint64_t shm_refused;              /* unix peers refused by the SO_PEERCRED check */
    uint64_t shm_leases_expired;       /* shm leases dropped at max_lease_ms */
    uint64_t shm_reservations_expired; /* shm reservations freed uncommitted after the stall timeout */
    uint64_t idle_closed, preauth_closed; /* closed by idle_ms / preauth_ms */
    uint64_t reply_waits;   /* times a connection paused reading on a reply budget */
    uint64_t reserve_waits; /* times a PUT object waited for the reserve budget */
    uint64_t request_busy;  /* requests answered BUSY over the request budget */
    uint64_t reply_busy;    /* GETs answered BUSY over the server-wide reply budget */
    uint64_t reply_bytes, request_bytes, reserved_bytes; /* now: queued replies, large request buffers,
                                                            PUT slots reserved and not yet received */
    uint64_t errors[16];
    uint64_t by_transport[4]; /* tcp, native, shm, nixl: connections that said HELLO */
    uint64_t lat[KVF_LAT_OPS][KVF_LAT_BUCKETS]; /* service-time histograms (see KVF_LAT_BUCKETS) */
    uint64_t lat_sum_us[KVF_LAT_OPS];           /* their sums, microseconds */
    int zerocopy, fixed_buffers;
};

struct kvf_server;

/* Wire error code -> name as STATS reports it ("" or NULL: unused code). */
extern const char *const kvf_err_names[16];
/* KVF_LAT_* -> the op's name in STATS keys: "get", "put", "lookup", "exists", "delete". */
extern const char *const kvf_lat_names[KVF_LAT_OPS];

int kvf_server_new(struct kvf_server **out, const struct kvf_server_cfg *cfg);
/* Listen on the configured sockets, then run the loop on this thread until
 * kvf_server_stop(). Returns 0, or -errno when listen() or io_uring fails. */
int kvf_server_run(struct kvf_server *s);
/* Any thread: ask the loop to stop (run returns once connections are closed). */
void kvf_server_stop(struct kvf_server *s);
/* Any thread: wake the loop after an eviction round (kvf_store_space_done). */
void kvf_server_wake(struct kvf_server *s);
/* Peers refused with AUTH_FAILED are kept (their address, "host:port" or
 * "unix:pid=P,uid=U") for the control thread to log: at most KVF_AUTH_LOG
 * between two reads, the rest only counted. */
#define KVF_AUTH_LOG 16
#define KVF_PEER_NAME 72
/* Any thread: move the kept peers into out (at most max) and return how many;
 * *lost: how many more were refused since the last call and not kept. */
size_t kvf_server_auth_failures(struct kvf_server *s, char (*out)[KVF_PEER_NAME], size_t max, uint64_t *lost);
/* The STATS map (msgpack, what a STATS request is answered with) in a malloc'd
 * buffer the caller frees: 0, -ENOMEM, -ENOSPC. Any thread (kvf_stats.c). */
int kvf_server_stats_map(struct kvf_server *s, uint8_t **out, size_t *len);
/* Offer the arena to remote clients (the nixl transport, kvfabric/transport/nixl.py): md (copied) is the
 * NIXL agent metadata of the process that registered the arena at address base. Before kvf_server_run().
 * Returns 0, -EINVAL (empty or over max_meta - 64 bytes), -ENOMEM. */
int kvf_server_set_remote_arena(struct kvf_server *s, const void *md, size_t len, uint64_t base);
void kvf_server_free(struct kvf_server *s);

#endif
