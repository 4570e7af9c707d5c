/* kvf_copy.c: the bulk copy of object bytes (see kvf_copy.h). */
#include "kvf_copy.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>

#define KVF_COPY_MIN 4096u

void kvf_copy(void *dst, const void *src, size_t n)
{
    if (n < KVF_COPY_MIN) {
        memcpy(dst, src, n);
        return;
    }
    uint8_t *d = dst;
    const uint8_t *s = src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; s += 64, d += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_store_si128((__m128i *)d, a);
        _mm_store_si128((__m128i *)(d + 16), b);
        _mm_store_si128((__m128i *)(d + 32), c);
        _mm_store_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
}
#else
void kvf_copy(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
#endif
