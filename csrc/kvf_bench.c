/* kvf_bench.c: the memcpy, raw-socket and O_DIRECT read ceilings (see kvf_bench.h). */
#define _GNU_SOURCE
#include "kvf_bench.h"
#include "kvf_client.h"
#include "kvf_uring.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/wait.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int kvf_bench_memcpy(uint64_t nbytes, uint64_t span, unsigned iters, double *secs)
{
    if (nbytes == 0 || iters == 0 || (span && span < nbytes)) return -EINVAL;
    uint64_t blen = span ? span : nbytes, slots = span ? span / nbytes : 1;
    char *a = malloc(nbytes);
    char *b = mmap(NULL, blen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (!a || b == MAP_FAILED) {
        free(a);
        if (b != MAP_FAILED) munmap(b, blen);
        return -ENOMEM;
    }
    memset(a, 1, nbytes);
    memset(b, 2, blen);
    double t0 = now_s();
    for (unsigned i = 0; i < iters; i++) {
        char *d = b + (i % slots) * nbytes;
        memcpy(d, a, nbytes);
        __asm__ volatile("" ::"r"(d) : "memory"); /* keep the copy */
    }
    *secs = now_s() - t0;
    free(a);
    munmap(b, blen);
    return 0;
}

struct sock_job {
    int fd;
    uint64_t nbytes;
    unsigned iters;
    int put, rc;
    char *buf;
};

static void *sock_server(void *arg)
{
    struct sock_job *j = arg;
    char hdr[32];
    memset(hdr, 0, sizeof hdr);
    for (unsigned i = 0; i < j->iters && !j->rc; i++) {
        if ((j->rc = kvf_recv_all(j->fd, hdr, sizeof hdr))) break;
        if (j->put) {
            if ((j->rc = kvf_recv_all(j->fd, j->buf, j->nbytes))) break;
            struct iovec iov = {hdr, sizeof hdr};
            j->rc = kvf_sendv_all(j->fd, &iov, 1);
        } else {
            struct iovec iov[2] = {{hdr, sizeof hdr}, {j->buf, j->nbytes}};
            j->rc = kvf_sendv_all(j->fd, iov, 2);
        }
    }
    return NULL;
}

/* The server side runs in a forked child process (only syscalls and _exit
 * there; its buffer is allocated before the fork), so client and server are
 * two processes like a real client and pool server. */
int kvf_bench_socket(uint64_t nbytes, unsigned iters, int put, int unix_sock, double *secs)
{
    if (nbytes == 0 || iters == 0) return -EINVAL;
    int rc = 0, ls = -1, cs = -1, sv[2] = {-1, -1};
    struct sockaddr_in a;
    socklen_t al = sizeof a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    char *cbuf = malloc(nbytes), *sbuf = malloc(nbytes);
    if (!cbuf || !sbuf) { rc = -ENOMEM; goto out; }
    memset(cbuf, 3, nbytes);
    memset(sbuf, 4, nbytes);
    if (unix_sock) {
        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)) { rc = -errno; goto out; }
    } else if ((ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0 ||
               bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1) ||
               getsockname(ls, (struct sockaddr *)&a, &al)) {
        rc = -errno;
        goto out;
    }
    pid_t pid = fork();
    if (pid < 0) { rc = -errno; goto out; }
    int one = 1;
    if (pid == 0) {
        if (unix_sock) close(sv[0]); /* the client's end: EOF reaches us if it quits */
        int ss = unix_sock ? sv[1] : accept4(ls, NULL, NULL, SOCK_CLOEXEC);
        if (ss < 0) _exit(1);
        if (!unix_sock) setsockopt(ss, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct sock_job j = {ss, nbytes, iters, put, 0, sbuf};
        sock_server(&j);
        _exit(j.rc ? 1 : 0);
    }
    if (unix_sock) {
        cs = sv[0];
        sv[0] = -1;
        close(sv[1]);
        sv[1] = -1;
    } else if ((cs = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0 ||
               connect(cs, (struct sockaddr *)&a, sizeof a)) {
        rc = -errno;
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        goto out;
    } else {
        setsockopt(cs, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    char hdr[32];
    memset(hdr, 0, sizeof hdr);
    kvf_set_deadline(0);
    double t0 = now_s();
    for (unsigned i = 0; i < iters && !rc; i++) {
        if (put) {
            struct iovec iov[2] = {{hdr, sizeof hdr}, {cbuf, nbytes}};
            if ((rc = kvf_sendv_all(cs, iov, 2))) break;
            rc = kvf_recv_all(cs, hdr, sizeof hdr);
        } else {
            struct iovec iov = {hdr, sizeof hdr};
            if ((rc = kvf_sendv_all(cs, &iov, 1))) break;
            if ((rc = kvf_recv_all(cs, hdr, sizeof hdr))) break;
            rc = kvf_recv_all(cs, cbuf, nbytes);
        }
    }
    *secs = now_s() - t0;
    close(cs);
    cs = -1;
    int status = 0;
    if (waitpid(pid, &status, 0) < 0 && !rc) rc = -errno;
    if (!rc && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) rc = -EIO;
out:
    if (cs >= 0) close(cs);
    if (ls >= 0) close(ls);
    if (sv[0] >= 0) close(sv[0]);
    if (sv[1] >= 0) close(sv[1]);
    free(cbuf);
    free(sbuf);
    return rc;
}

/* ------------------------------------------------------------ O_DIRECT reads */

#define DIRECT_ALIGN 4096u
#define DIRECT_MAX_DEPTH 256u

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Creates, opens (O_RDWR | O_DIRECT) and unlinks a file in dir; returns the fd or -errno. */
static int direct_tmpfile(const char *dir)
{
    size_t n = strlen(dir);
    char *path = malloc(n + 32);
    if (!path) return -ENOMEM;
    memcpy(path, dir, n);
    strcpy(path + n, "/.kvf-direct-ceiling-XXXXXX");
    int tfd = mkstemp(path);
    if (tfd < 0) { int e = -errno; free(path); return e; }
    close(tfd);
    int fd = open(path, O_RDWR | O_DIRECT | O_CLOEXEC);
    int e = fd < 0 ? -errno : 0;
    unlink(path);
    free(path);
    return fd < 0 ? e : fd;
}

/* Writes file_bytes of stamped chunks to fd from buf (read_bytes, aligned), then fsyncs. 0 or -errno. */
static int direct_fill(int fd, char *buf, uint64_t file_bytes, uint64_t read_bytes)
{
    for (uint64_t off = 0; off < file_bytes; off += read_bytes) {
        memcpy(buf, &off, sizeof off);
        uint64_t done = 0;
        while (done < read_bytes) {
            ssize_t w = pwrite(fd, buf + done, read_bytes - done, (off_t)(off + done));
            if (w < 0 && errno == EINTR) continue;
            if (w < 0) return -errno;
            if (w == 0) return -EIO;
            done += (uint64_t)w;
        }
    }
    return fsync(fd) ? -errno : 0;
}

/* Queues one fixed-buffer read of chunk `chunk` into slot `slot`; 0 or -EBUSY when the SQ is full. */
static int direct_queue(struct kvf_ring *r, int fd, uint64_t chunk, uint64_t read_bytes, char *buf, unsigned slot)
{
    struct io_uring_sqe *sqe = kvf_ring_sqe(r);
    if (!sqe) return -EBUSY;
    sqe->opcode = IORING_OP_READ_FIXED;
    sqe->fd = fd;
    sqe->off = chunk * read_bytes;
    sqe->addr = (uint64_t)(uintptr_t)buf;
    sqe->len = (uint32_t)read_bytes;
    sqe->buf_index = (uint16_t)slot;
    sqe->user_data = slot;
    return 0;
}

static int direct_sizes_ok(uint64_t file_bytes, uint64_t chunk)
{
    return chunk && chunk % DIRECT_ALIGN == 0 && chunk <= (1u << 30) && file_bytes && file_bytes % chunk == 0;
}

int kvf_bench_direct_file(const char *dir, uint64_t file_bytes, uint64_t chunk)
{
    if (!dir || !direct_sizes_ok(file_bytes, chunk)) return -EINVAL;
    char *buf = NULL;
    if (posix_memalign((void **)&buf, DIRECT_ALIGN, chunk)) return -ENOMEM;
    memset(buf, 0x5a, chunk);
    int fd = direct_tmpfile(dir);
    if (fd >= 0) {
        int rc = direct_fill(fd, buf, file_bytes, chunk);
        if (rc) { close(fd); fd = rc; }
    }
    free(buf);
    return fd;
}

int kvf_bench_direct_read(int fd, uint64_t file_bytes, uint64_t read_bytes, unsigned depth, unsigned reads,
                          double *secs, uint64_t *lat_ns)
{
    if (fd < 0 || !direct_sizes_ok(file_bytes, read_bytes) || depth == 0 || depth > DIRECT_MAX_DEPTH ||
        reads == 0 || file_bytes / read_bytes < depth)
        return -EINVAL;
    uint64_t nchunks = file_bytes / read_bytes, state = 0x9e3779b97f4a7c15ull;
    uint64_t t_sub[DIRECT_MAX_DEPTH], want[DIRECT_MAX_DEPTH];
    struct iovec iov[DIRECT_MAX_DEPTH];
    struct kvf_ring ring;
    int rc, ring_ok = 0;
    char *bufs = NULL;
    if (posix_memalign((void **)&bufs, DIRECT_ALIGN, read_bytes * depth)) return -ENOMEM;
    memset(bufs, 0, read_bytes * depth);
    if ((rc = kvf_ring_init(&ring, depth))) goto out;
    ring_ok = 1;
    for (unsigned i = 0; i < depth; i++) iov[i] = (struct iovec){bufs + i * read_bytes, read_bytes};
    if ((rc = kvf_ring_register_buffers(&ring, iov, depth))) goto out;
    unsigned issued = 0, done = 0;
    double t0 = now_s();
    for (unsigned s = 0; s < depth && issued < reads; s++, issued++) {
        state ^= state << 13; state ^= state >> 7; state ^= state << 17; /* xorshift64 */
        want[s] = state % nchunks;
        t_sub[s] = now_ns();
        if ((rc = direct_queue(&ring, fd, want[s], read_bytes, bufs + s * read_bytes, s))) goto out;
    }
    while (done < reads) {
        if ((rc = kvf_ring_submit_wait(&ring, 1, -1))) goto out;
        struct io_uring_cqe *cqe;
        while ((cqe = kvf_ring_peek(&ring))) {
            unsigned s = (unsigned)cqe->user_data;
            int res = cqe->res;
            kvf_ring_cqe_seen(&ring);
            uint64_t t = now_ns(), stamp;
            if (s >= depth) { rc = -EIO; goto out; }
            if (res < 0) { rc = res; goto out; }
            uint64_t expect = want[s] * read_bytes;
            memcpy(&stamp, bufs + s * read_bytes, sizeof stamp);
            if ((uint64_t)res != read_bytes || stamp != expect) { rc = -EIO; goto out; }
            if (lat_ns) lat_ns[done] = t - t_sub[s];
            done++;
            if (issued < reads) {
                state ^= state << 13; state ^= state >> 7; state ^= state << 17;
                want[s] = state % nchunks;
                t_sub[s] = now_ns();
                if ((rc = direct_queue(&ring, fd, want[s], read_bytes, bufs + s * read_bytes, s))) goto out;
                issued++;
            }
        }
    }
    *secs = now_s() - t0;
    rc = 0;
out:
    if (ring_ok) kvf_ring_exit(&ring);
    free(bufs);
    return rc;
}
