/* kvf_uring.h: a minimal io_uring built on the raw syscalls and the kernel's
 * <linux/io_uring.h> (no liburing). One ring, one thread.
 *
 * Functions return 0 or -errno; kvf_ring_sqe returns NULL when the SQ is full
 * (submit, then try again).
 */
#ifndef KVF_URING_H
#define KVF_URING_H

#include <linux/io_uring.h>
#include <stdint.h>
#include <sys/uio.h>

struct kvf_ring {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *sq_flags;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    unsigned sq_entries, cq_entries;
    unsigned sq_local_tail; /* SQEs prepared but not yet published */
    void *sq_ptr, *cq_ptr;
    size_t sq_sz, cq_sz, sqes_sz;
    uint32_t features;
};

int kvf_ring_init(struct kvf_ring *r, unsigned entries);
void kvf_ring_exit(struct kvf_ring *r);
/* A zeroed SQE, or NULL when the submission queue is full. */
struct io_uring_sqe *kvf_ring_sqe(struct kvf_ring *r);
/* Publish prepared SQEs and wait for at least wait_nr completions, at most
 * timeout_ms (-1 = forever). Returns 0, -ETIME on timeout, or -errno. */
int kvf_ring_submit_wait(struct kvf_ring *r, unsigned wait_nr, int timeout_ms);
/* Next completion or NULL; call kvf_ring_cqe_seen after using it. */
struct io_uring_cqe *kvf_ring_peek(struct kvf_ring *r);
void kvf_ring_cqe_seen(struct kvf_ring *r);
/* 1 when the kernel supports opcode `op` (IORING_REGISTER_PROBE), else 0. */
int kvf_ring_probe_op(struct kvf_ring *r, int op);
int kvf_ring_register_buffers(struct kvf_ring *r, const struct iovec *iov, unsigned n);

#endif
