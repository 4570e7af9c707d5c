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
/* The raw O_DIRECT read ceiling of a filesystem, in two steps.
 * kvf_bench_direct_file creates a file of file_bytes in `dir`, opened
 * O_RDWR | O_DIRECT and unlinked at once (nothing is left behind), fills it
 * with aligned writes of `chunk` bytes, each stamped with its offset in its
 * first 8 bytes, and fsyncs it. Returns the fd (the caller closes it), or
 * -EINVAL for bad sizes (chunk a multiple of 4096, at most 1 GiB; file_bytes
 * a multiple of chunk) or where the filesystem has no O_DIRECT, or the
 * failing call's -errno. */
int kvf_bench_direct_file(const char *dir, uint64_t file_bytes, uint64_t chunk);
/* `reads` reads of read_bytes (= the file's chunk) at pseudo-random chunk
 * offsets of that file through io_uring: IORING_OP_READ_FIXED into `depth`
 * registered 4096-aligned buffers, `depth` reads in flight. *secs is the
 * wall time of the loop; lat_ns (NULL or `reads` entries) gets each read's
 * submit-to-completion time in completion order. Every read must return
 * read_bytes carrying its chunk's stamp, else -EIO. Returns 0, -EINVAL for bad
 * sizes (depth 1..256, at most file_bytes / read_bytes), or another -errno. */
int kvf_bench_direct_read(int fd, uint64_t file_bytes, uint64_t read_bytes, unsigned depth, unsigned reads,
                          double *secs, uint64_t *lat_ns);

#endif
