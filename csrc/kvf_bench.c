/* kvf_bench.c: the memcpy and raw-socket ceilings (see kvf_bench.h). */
#define _GNU_SOURCE
#include "kvf_bench.h"
#include "kvf_conn.h"

#include <arpa/inet.h>
#include <errno.h>
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
