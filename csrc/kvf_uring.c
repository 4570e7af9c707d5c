/* kvf_uring.c: raw-syscall io_uring (see kvf_uring.h). */
#define _GNU_SOURCE
#include "kvf_uring.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int sys_setup(unsigned entries, struct io_uring_params *p)
{
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags, void *arg, size_t argsz)
{
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, arg, argsz);
}

int kvf_ring_init(struct kvf_ring *r, unsigned entries)
{
    memset(r, 0, sizeof *r);
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    p.flags = IORING_SETUP_CQSIZE;
    p.cq_entries = entries * 4;
    int fd = sys_setup(entries, &p);
    if (fd < 0) return -errno;
    r->fd = fd;
    r->features = p.features;
    r->sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_sz > r->sq_sz) r->sq_sz = r->cq_sz;
        r->cq_sz = r->sq_sz;
    }
    r->sq_ptr = mmap(NULL, r->sq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (r->sq_ptr == MAP_FAILED) { int e = -errno; close(fd); return e; }
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_ptr = r->sq_ptr;
    } else {
        r->cq_ptr = mmap(NULL, r->cq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
        if (r->cq_ptr == MAP_FAILED) { int e = -errno; munmap(r->sq_ptr, r->sq_sz); close(fd); return e; }
    }
    r->sqes_sz = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) {
        int e = -errno;
        munmap(r->sq_ptr, r->sq_sz);
        if (r->cq_ptr != r->sq_ptr) munmap(r->cq_ptr, r->cq_sz);
        close(fd);
        return e;
    }
    char *sq = r->sq_ptr, *cq = r->cq_ptr;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->sq_flags = (unsigned *)(sq + p.sq_off.flags);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    r->sq_entries = p.sq_entries;
    r->cq_entries = p.cq_entries;
    r->sq_local_tail = *r->sq_tail;
    return 0;
}

void kvf_ring_exit(struct kvf_ring *r)
{
    if (r->fd <= 0) return;
    munmap(r->sqes, r->sqes_sz);
    if (r->cq_ptr != r->sq_ptr) munmap(r->cq_ptr, r->cq_sz);
    munmap(r->sq_ptr, r->sq_sz);
    close(r->fd);
    r->fd = -1;
}

struct io_uring_sqe *kvf_ring_sqe(struct kvf_ring *r)
{
    unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
    if (r->sq_local_tail - head >= r->sq_entries) return NULL;
    unsigned idx = r->sq_local_tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[idx];
    r->sq_array[idx] = idx;
    r->sq_local_tail++;
    memset(sqe, 0, sizeof *sqe);
    return sqe;
}

int kvf_ring_submit_wait(struct kvf_ring *r, unsigned wait_nr, int timeout_ms)
{
    unsigned to_submit = r->sq_local_tail - *r->sq_tail;
    __atomic_store_n(r->sq_tail, r->sq_local_tail, __ATOMIC_RELEASE);
    unsigned flags = wait_nr ? IORING_ENTER_GETEVENTS : 0;
    struct __kernel_timespec ts;
    struct io_uring_getevents_arg arg;
    void *argp = NULL;
    size_t argsz = 0;
    if (wait_nr && timeout_ms >= 0) {
        ts.tv_sec = timeout_ms / 1000;
        ts.tv_nsec = (long long)(timeout_ms % 1000) * 1000000LL;
        memset(&arg, 0, sizeof arg);
        arg.ts = (uint64_t)(uintptr_t)&ts;
        flags |= IORING_ENTER_EXT_ARG;
        argp = &arg;
        argsz = sizeof arg;
    }
    for (;;) {
        int rc = sys_enter(r->fd, to_submit, wait_nr, flags, argp, argsz);
        if (rc >= 0) return 0;
        if (errno == EINTR) { to_submit = 0; continue; }
        if (errno == ETIME) return -ETIME;
        if (errno == EBUSY || errno == EAGAIN) return 0; /* CQ overflow pending: reap first */
        return -errno;
    }
}

struct io_uring_cqe *kvf_ring_peek(struct kvf_ring *r)
{
    unsigned head = *r->cq_head;
    unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    if (head == tail) return NULL;
    return &r->cqes[head & *r->cq_mask];
}

void kvf_ring_cqe_seen(struct kvf_ring *r)
{
    __atomic_store_n(r->cq_head, *r->cq_head + 1, __ATOMIC_RELEASE);
}

int kvf_ring_probe_op(struct kvf_ring *r, int op)
{
    size_t sz = sizeof(struct io_uring_probe) + 256 * sizeof(struct io_uring_probe_op);
    struct io_uring_probe *p = calloc(1, sz);
    if (!p) return 0;
    int ok = 0;
    if (syscall(__NR_io_uring_register, r->fd, IORING_REGISTER_PROBE, p, 256) == 0 && op <= p->last_op)
        ok = (p->ops[op].flags & IO_URING_OP_SUPPORTED) != 0;
    free(p);
    return ok;
}

int kvf_ring_register_buffers(struct kvf_ring *r, const struct iovec *iov, unsigned n)
{
    if (syscall(__NR_io_uring_register, r->fd, IORING_REGISTER_BUFFERS, iov, n) < 0) return -errno;
    return 0;
}
