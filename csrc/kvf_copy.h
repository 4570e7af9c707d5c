/* kvf_copy.h: the bulk copy of object bytes (shm GET and PUT, the arena <-> staging copies).
 *
 * Why not memcpy: glibc before 2.39 copies sizes between ~2 KiB and the L2
 * cache size with REP MOVSB, and on AMD Zen 3/4 REP MOVSB is up to 20x slower
 * when the destination is a little ahead of the source modulo the page
 * (glibc bug 30994; e.g. a caller's numpy buffer at page offset 16 and an
 * arena slot at offset 0). Measured on this project's AMD EPYC machines
 * (Debian 12, glibc 2.36): 256 KiB copies at 360 us per MiB into such a
 * buffer vs 27-36 us into an aligned one; a 1 MiB copy is not affected
 * (glibc uses vector loops above L2). kvfabric does not choose the alignment
 * of the buffers callers hand it, so it copies with its own vector loop:
 * SSE2 (every x86-64 CPU), 64 bytes per step, the destination aligned to
 * 16; as fast as glibc's best case at every size measured, hot and cold
 * (tests/native/test_copy.py checks the bytes; `kvfabric bench
 * transport_native` the speed). Elsewhere, and below 4 KiB, it is memcpy.
 * The regions must not overlap.
 */
#ifndef KVF_COPY_H
#define KVF_COPY_H

#include <stddef.h>

void kvf_copy(void *dst, const void *src, size_t n);

#endif
