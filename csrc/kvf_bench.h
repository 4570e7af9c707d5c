/* kvf_bench.h: ceilings the transport benchmark measures in the same run.
 * Both return 0 or -errno and write the elapsed wall seconds to *secs. */
#ifndef KVF_BENCH_H
#define KVF_BENCH_H

#include <stdint.h>

/* One thread copying nbytes from one warm buffer to another, iters times. */
int kvf_bench_memcpy(uint64_t nbytes, unsigned iters, double *secs);
/* A C client and a C server (forked child process) on loopback TCP doing iters exchanges:
 * GET (put=0): 32-byte request, nbytes reply; PUT (put=1): 32 + nbytes
 * request, 32-byte reply. Plain blocking send/recv, no framing work. */
int kvf_bench_socket(uint64_t nbytes, unsigned iters, int put, double *secs);

#endif
