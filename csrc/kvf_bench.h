/* kvf_bench.h: ceilings the transport benchmark measures in the same run.
 * Both return 0 or -errno and write the elapsed wall seconds to *secs. */
#ifndef KVF_BENCH_H
#define KVF_BENCH_H

#include <stdint.h>

/* One thread copying nbytes iters times from one warm buffer: into another
 * warm buffer (span 0), or into consecutive nbytes slots of a pre-faulted
 * region of span bytes (span >= nbytes), so the destination is cold as a
 * fresh arena slot is. */
int kvf_bench_memcpy(uint64_t nbytes, uint64_t span, unsigned iters, double *secs);
/* A C client and a C server (forked child process) doing iters exchanges on
 * loopback TCP (unix_sock 0) or a unix socket pair (unix_sock 1):
 * GET (put=0): 32-byte request, 32 + nbytes reply; PUT (put=1): 32 + nbytes
 * request, 32-byte reply. Plain blocking send/recv, no framing work. A small
 * nbytes measures the round trip. */
int kvf_bench_socket(uint64_t nbytes, unsigned iters, int put, int unix_sock, double *secs);
/* The raw O_DIRECT read ceiling of the filesystem holding `dir`: creates a
 * file of file_bytes there (O_DIRECT, unlinked at once, so nothing is left
 * behind), fills it with aligned writes (each read_bytes chunk stamped with its
 * offset) and fsyncs it, then does `reads` reads of read_bytes at pseudo-random
 * chunk offsets through io_uring (IORING_OP_READ_FIXED into `depth` registered,
 * 4096-aligned buffers, `depth` reads in flight). *secs is the wall time of the
 * read loop only; lat_ns (NULL or `reads` entries) gets each read's
 * submit-to-completion time in completion order. Every read must return
 * read_bytes with its chunk's stamp, else -EIO. Returns 0, -EINVAL for bad
 * sizes (read_bytes a multiple of 4096, file_bytes a multiple of read_bytes
 * holding at least `depth` chunks, depth 1..256), the open's -errno (-EINVAL
 * where the filesystem has no O_DIRECT, as tmpfs), or another -errno. */
int kvf_bench_direct_read(const char *dir, uint64_t file_bytes, uint64_t read_bytes, unsigned depth,
                          unsigned reads, double *secs, uint64_t *lat_ns);

#endif
