/* kvf_client.h: the native client side of one connection: blocking syscalls
 * on a connected stream socket (TCP or unix), called with the GIL released.
 *
 * Every function returns 0 or -errno:
 *   -ECONNRESET  the peer closed the connection (EOF) or reset it
 *   -ETIMEDOUT   the deadline (kvf_set_deadline) passed
 *   -EPROTO      the peer sent a frame that fails the header checks
 *                (*wire_err, when given, holds the kvf_err code)
 *   -EMSGSIZE    a reply object does not fit the caller's buffer; the
 *                payload was drained, so the connection stays usable
 *   other        as reported by the kernel
 */
#ifndef KVF_CLIENT_H
#define KVF_CLIENT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "kvf_protocol.h"
#include "kvf_uring.h"

/* Absolute CLOCK_MONOTONIC deadline (ns) for the calls this thread makes
 * next; 0 = none. Before every syscall the socket timeout is set to the time
 * left, and -ETIMEDOUT is returned once it has passed, so a call never blocks
 * past it (the caller then closes the connection: the stream is out of step). */
void kvf_set_deadline(int64_t deadline_ns);

int kvf_sendv_all(int fd, struct iovec *iov, int n);
int kvf_recv_all(int fd, void *buf, size_t n);
int kvf_recvv_all(int fd, struct iovec *iov, int n);
int kvf_drain(int fd, uint64_t n);

/* Send header + meta + payload parts as one gathered stream. */
int kvf_send_frame(int fd, uint8_t opcode, uint8_t flags, uint64_t request_id, const void *meta,
                   uint32_t meta_len, const struct iovec *parts, int nparts);

/* Most frames one kvf_send_frames call takes. */
#define KVF_SEND_FRAMES_MAX 64

/* Send n (<= KVF_SEND_FRAMES_MAX) metadata-only frames (header + metas[i]),
 * frame i on its own socket fds[i], with as few syscalls as the kernel
 * allows: all of them are handed to one io_uring_enter (a ring of this
 * thread's, made on first use, closed when the thread exits) as non-blocking
 * sendmsg, so every server is woken before this thread can be preempted by
 * the first one it woke (sending one after another, a loaded machine runs
 * each woken server in between, and the calling thread waits its turn
 * again after every send). A frame the socket could not take whole is
 * finished with blocking sends under the thread's deadline; without
 * io_uring (or for one frame) every frame is sent that way. rcs[i] gets
 * frame i's result (0 or -errno, as kvf_send_frame); the function returns
 * 0, -EINVAL (n too large, nothing sent) or the ring's -errno when it fails
 * mid-way (which frames went out is then unknown: the caller closes them all). */
int kvf_send_frames(uint32_t n, const int *fds, const uint8_t *opcodes, const uint64_t *rids,
                    const void *const *metas, const uint32_t *meta_lens, int *rcs);

/* Receive and check a header. */
int kvf_recv_header(int fd, struct kvf_header *h, uint32_t max_meta, uint64_t max_payload, int *wire_err);

/* Parse the "sizes" array of a GET reply's metadata into sizes[0..n).
 * Returns 0, or -EPROTO when absent, malformed or not exactly n entries. */
int kvf_parse_sizes(const uint8_t *meta, size_t meta_len, int64_t *sizes, uint32_t n);

/* Caller buffers registered with a per-connection io_uring as fixed buffers
 * (kvf_creg_open). GET objects whose buffer lies inside one of them are
 * received with IORING_OP_READ_FIXED on the socket; the others with recvmsg.
 * The struct only moves bytes: which buffers to register, and whether to use
 * it at all, is the caller's (Python's) choice. Not thread-safe. */
struct kvf_creg {
    struct kvf_ring ring;
    struct iovec *bufs; /* the registered ranges, buf_index = position */
    unsigned n;
    uint64_t fixed_reads; /* READ_FIXED completions with data */
    uint64_t fixed_bytes; /* bytes that landed through them */
};

/* Set up a ring and register bufs[0..n) as its fixed buffers. -EOPNOTSUPP when
 * the kernel lacks IORING_OP_READ_FIXED; other -errno from io_uring_setup /
 * IORING_REGISTER_BUFFERS (e.g. -ENOMEM over RLIMIT_MEMLOCK). On failure
 * nothing is left open. */
int kvf_creg_open(struct kvf_creg *c, const struct iovec *bufs, unsigned n);
void kvf_creg_close(struct kvf_creg *c);
/* Index of the registered buffer that holds [p, p+len) entirely, or -1. */
int kvf_creg_find(const struct kvf_creg *c, const void *p, size_t len);

/* Scatter a GET reply payload: object i (sizes[i] >= 0) goes into bufs[i].
 * nseg (may be NULL: one buffer per object): object i owns nseg[i] >= 1
 * consecutive entries of bufs/buf_lens and fills them in order (a header
 * buffer, then the payload's); entries past the object's end get nothing.
 * Checks that the sizes add up to payload_len (-EPROTO otherwise, nothing
 * read) and that each object fits (-EMSGSIZE, payload drained; *bad_index
 * is the first object that did not fit). reg (may be NULL): pieces whose
 * buffer lies in a registered buffer are read with READ_FIXED through it;
 * no request is left in flight on return (a timed-out read is cancelled and
 * reaped first). keys (may be NULL): object i's key is keys[i][0..key_lens[i]);
 * then each object found gets its checksum (kvf_hash.h) in digests[i],
 * computed slice by slice as the bytes land (no second pass over the
 * memory); digests of misses are left as they are. Returns 0 or -errno. */
int kvf_recv_objects(int fd, uint64_t payload_len, const int64_t *sizes, void *const *bufs,
                     const size_t *buf_lens, uint32_t n, const uint32_t *nseg, uint32_t *bad_index,
                     struct kvf_creg *reg, const void *const *keys, const size_t *key_lens, uint64_t *digests);

#endif

/* ---- same-host (shm) operations, one call each (see kvfabric/transport/shm.py) ---- */

/* GET through the arena: send SHM_LEASE of keys[0..n) (its metadata built
 * here: {"keys": [...]}, kvfabric.protocol.ShmLeaseRequest), receive its
 * reply, copy object i (size >= 0) from arena[offset] into bufs[i], send
 * SHM_RELEASE. On return *h and *meta (malloc'd; caller frees) hold the LEASE
 * reply, and for a reply that is not an error sizes[i] (-1: a miss) and
 * sums[i] (the stored checksums) its parsed fields, checked as
 * ShmLeaseReply.from_meta checks them (one map, no key twice, n of each,
 * sizes -1..max_object, every found object inside the arena). An error reply
 * (h->flags & ERROR) returns 0 with nothing copied or parsed. -EMSGSIZE: an
 * object did not fit its buffer (*bad_index; nothing copied, lease released).
 * -EPROTO: a malformed lease reply (the lease is released when its id could
 * be read). With digests (n; NULL: none) each copied object's checksum under
 * keys[i] goes to digests[i] (misses left alone), hashed slice by slice right
 * after each slice is copied, while it is still in cache (as
 * kvf_recv_objects does). */
int kvf_shm_get(int fd, uint8_t *arena, uint64_t arena_len, uint64_t rid, uint32_t n, const void *const *keys,
                const size_t *key_lens, void *const *bufs, const size_t *buf_lens, uint32_t max_meta,
                uint64_t max_object, struct kvf_header *h, uint8_t **meta, uint32_t *bad_index, int *wire_err,
                int64_t *sizes, uint64_t *sums, uint64_t *digests);

/* PUT through the arena: send SHM_RESERVE (reserve_meta = {"keys", "sizes"}),
 * copy the payload parts (any split) into the reserved slots, send
 * SHM_COMMIT with checksums[0..n), receive its reply. *h and *meta hold
 * the COMMIT reply, or the RESERVE reply when that was an error. */
int kvf_shm_put(int fd, uint8_t *arena, uint64_t arena_len, uint64_t rid, const void *reserve_meta,
                uint32_t reserve_meta_len, uint32_t n, const uint64_t *sizes, const uint64_t *checksums,
                const struct iovec *parts, int nparts, uint32_t max_meta, struct kvf_header *h, uint8_t **meta,
                int *wire_err);
