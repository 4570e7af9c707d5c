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

#endif
