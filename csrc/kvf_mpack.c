/* kvf_mpack.c: msgpack subset reader/writer (see kvf_mpack.h). */
#include "kvf_mpack.h"

#include <stdlib.h>
#include <string.h>

static inline int need(struct kvf_mr *r, size_t n) { return (size_t)(r->end - r->p) >= n ? 0 : -1; }
static inline uint16_t be16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t be64(const uint8_t *p) { return ((uint64_t)be32(p) << 32) | be32(p + 4); }

static int container(struct kvf_mr *r, uint32_t *n, uint8_t fixmask, uint8_t fixbits, uint8_t c16, uint8_t c32)
{
    if (need(r, 1)) return -1;
    uint8_t b = r->p[0];
    if ((b & fixmask) == fixbits) { *n = b & (uint8_t)~fixmask; r->p++; return 0; }
    if (b == c16) { if (need(r, 3)) return -1; *n = be16(r->p + 1); r->p += 3; return 0; }
    if (b == c32) { if (need(r, 5)) return -1; *n = be32(r->p + 1); r->p += 5; return 0; }
    return -1;
}

int kvf_mr_map(struct kvf_mr *r, uint32_t *n) { return container(r, n, 0xf0, 0x80, 0xde, 0xdf); }
int kvf_mr_array(struct kvf_mr *r, uint32_t *n) { return container(r, n, 0xf0, 0x90, 0xdc, 0xdd); }

int kvf_mr_str(struct kvf_mr *r, const char **s, uint32_t *n)
{
    if (need(r, 1)) return -1;
    uint8_t b = r->p[0];
    uint32_t len, hl;
    if ((b & 0xe0) == 0xa0) { len = b & 0x1f; hl = 1; }
    else if (b == 0xd9) { if (need(r, 2)) return -1; len = r->p[1]; hl = 2; }
    else if (b == 0xda) { if (need(r, 3)) return -1; len = be16(r->p + 1); hl = 3; }
    else if (b == 0xdb) { if (need(r, 5)) return -1; len = be32(r->p + 1); hl = 5; }
    else return -1;
    if (need(r, (size_t)hl + len)) return -1;
    *s = (const char *)r->p + hl; *n = len; r->p += hl + len;
    return 0;
}

int kvf_mr_bin(struct kvf_mr *r, const uint8_t **bp, uint32_t *n)
{
    if (need(r, 1)) return -1;
    uint8_t b = r->p[0];
    uint32_t len, hl;
    if (b == 0xc4) { if (need(r, 2)) return -1; len = r->p[1]; hl = 2; }
    else if (b == 0xc5) { if (need(r, 3)) return -1; len = be16(r->p + 1); hl = 3; }
    else if (b == 0xc6) { if (need(r, 5)) return -1; len = be32(r->p + 1); hl = 5; }
    else return -1;
    if (need(r, (size_t)hl + len)) return -1;
    *bp = r->p + hl; *n = len; r->p += hl + len;
    return 0;
}

int kvf_mr_int(struct kvf_mr *r, int64_t *v)
{
    if (need(r, 1)) return -1;
    const uint8_t *p = r->p;
    uint8_t b = p[0];
    if (b <= 0x7f) { *v = b; r->p += 1; return 0; }
    if (b >= 0xe0) { *v = (int8_t)b; r->p += 1; return 0; }
    switch (b) {
    case 0xcc: if (need(r, 2)) return -1; *v = p[1]; r->p += 2; return 0;
    case 0xcd: if (need(r, 3)) return -1; *v = be16(p + 1); r->p += 3; return 0;
    case 0xce: if (need(r, 5)) return -1; *v = be32(p + 1); r->p += 5; return 0;
    case 0xcf: { if (need(r, 9)) return -1; uint64_t u = be64(p + 1); if (u > INT64_MAX) return -1;
                 *v = (int64_t)u; r->p += 9; return 0; }
    case 0xd0: if (need(r, 2)) return -1; *v = (int8_t)p[1]; r->p += 2; return 0;
    case 0xd1: if (need(r, 3)) return -1; *v = (int16_t)be16(p + 1); r->p += 3; return 0;
    case 0xd2: if (need(r, 5)) return -1; *v = (int32_t)be32(p + 1); r->p += 5; return 0;
    case 0xd3: if (need(r, 9)) return -1; *v = (int64_t)be64(p + 1); r->p += 9; return 0;
    default: return -1;
    }
}

int kvf_mr_uint(struct kvf_mr *r, uint64_t *v)
{
    if (need(r, 1)) return -1;
    if (r->p[0] == 0xcf) {
        if (need(r, 9)) return -1;
        *v = be64(r->p + 1); r->p += 9; return 0;
    }
    int64_t s;
    struct kvf_mr save = *r;
    if (kvf_mr_int(r, &s) || s < 0) { *r = save; return -1; }
    *v = (uint64_t)s;
    return 0;
}

int kvf_mr_bool(struct kvf_mr *r, int *v)
{
    if (need(r, 1)) return -1;
    if (r->p[0] == 0xc2) { *v = 0; r->p++; return 0; }
    if (r->p[0] == 0xc3) { *v = 1; r->p++; return 0; }
    return -1;
}

int kvf_mr_is_nil(struct kvf_mr *r)
{
    if (need(r, 1) == 0 && r->p[0] == 0xc0) { r->p++; return 1; }
    return 0;
}

static int skip_depth(struct kvf_mr *r, int depth)
{
    if (depth > 32 || need(r, 1)) return -1;
    uint8_t b = r->p[0];
    uint32_t n;
    const char *s; const uint8_t *bb;
    int64_t i; int bl;
    if (b == 0xc0) { r->p++; return 0; }
    if (b == 0xc2 || b == 0xc3) return kvf_mr_bool(r, &bl);
    if ((b & 0xe0) == 0xa0 || b == 0xd9 || b == 0xda || b == 0xdb) return kvf_mr_str(r, &s, &n);
    if (b == 0xc4 || b == 0xc5 || b == 0xc6) return kvf_mr_bin(r, &bb, &n);
    if (b == 0xcf) { if (need(r, 9)) return -1; r->p += 9; return 0; }
    if (b == 0xca) { if (need(r, 5)) return -1; r->p += 5; return 0; }
    if (b == 0xcb) { if (need(r, 9)) return -1; r->p += 9; return 0; }
    if ((b & 0xf0) == 0x80 || b == 0xde || b == 0xdf) {
        if (kvf_mr_map(r, &n)) return -1;
        for (uint32_t k = 0; k < n; k++)
            if (skip_depth(r, depth + 1) || skip_depth(r, depth + 1)) return -1;
        return 0;
    }
    if ((b & 0xf0) == 0x90 || b == 0xdc || b == 0xdd) {
        if (kvf_mr_array(r, &n)) return -1;
        for (uint32_t k = 0; k < n; k++)
            if (skip_depth(r, depth + 1)) return -1;
        return 0;
    }
    return kvf_mr_int(r, &i);
}

int kvf_mr_skip(struct kvf_mr *r) { return skip_depth(r, 0); }

/* ---------------------------------------------------------------- strict check */

struct mkey {
    const uint8_t *p; /* the key's data */
    uint32_t n;       /* its length, top bit set for a bin key */
};

static int mkey_cmp(const void *a, const void *b)
{
    const struct mkey *x = a, *y = b;
    if (x->n != y->n) return x->n < y->n ? -1 : 1;
    return memcmp(x->p, y->p, x->n & 0x7fffffffu);
}

static int check_value(struct kvf_mr *r, int depth);

/* 1 if s[0..n) is strict UTF-8 (no overlong forms, no surrogates, <= U+10FFFF),
 * as Python's decoder demands of a msgpack str. */
static int utf8_ok(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) { i++; continue; }
        size_t len;
        uint32_t cp, min;
        if ((c & 0xe0) == 0xc0) { len = 2; cp = c & 0x1f; min = 0x80; }
        else if ((c & 0xf0) == 0xe0) { len = 3; cp = c & 0x0f; min = 0x800; }
        else if ((c & 0xf8) == 0xf0) { len = 4; cp = c & 0x07; min = 0x10000; }
        else return 0;
        if (n - i < len) return 0;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
        i += len;
    }
    return 1;
}

/* A map whose header was read: n key/value pairs, keys str or bin, no key twice.
 * Keys are compared by type class (str or bin) and data, not by encoding, so
 * "a" as fixstr and as str8 are the same key (as they are to msgpack-python). */
static int check_map(struct kvf_mr *r, uint32_t n, int depth)
{
    struct mkey small[32];
    struct mkey *keys = small;
    if (n > 32) {
        if ((size_t)(r->end - r->p) / 2 < n) return -1; /* each pair takes >= 2 bytes */
        keys = malloc(sizeof *keys * n);
        if (!keys) return -1;
    }
    int rc = 0;
    for (uint32_t i = 0; i < n && !rc; i++) {
        const char *s;
        const uint8_t *b;
        uint32_t l;
        uint8_t t = r->p < r->end ? r->p[0] : 0;
        int is_str = (t & 0xe0) == 0xa0 || t == 0xd9 || t == 0xda || t == 0xdb;
        if (is_str) rc = kvf_mr_str(r, &s, &l), b = (const uint8_t *)s;
        else rc = kvf_mr_bin(r, &b, &l);
        if (rc) break;
        if ((l & 0x80000000u) || (is_str && !utf8_ok(b, l))) { rc = -1; break; }
        keys[i].p = b;
        keys[i].n = is_str ? l : l | 0x80000000u; /* class bit: a bin key never equals a str key */
        rc = check_value(r, depth + 1);
    }
    if (!rc && n > 1) {
        if (n <= 32) {
            for (uint32_t i = 1; i < n && !rc; i++)
                for (uint32_t j = 0; j < i; j++)
                    if (keys[i].n == keys[j].n && memcmp(keys[i].p, keys[j].p, keys[i].n & 0x7fffffffu) == 0) {
                        rc = -1;
                        break;
                    }
        } else {
            qsort(keys, n, sizeof *keys, mkey_cmp);
            for (uint32_t i = 1; i < n; i++)
                if (keys[i].n == keys[i - 1].n && memcmp(keys[i].p, keys[i - 1].p, keys[i].n & 0x7fffffffu) == 0) {
                    rc = -1;
                    break;
                }
        }
    }
    if (keys != small) free(keys);
    return rc;
}

static int check_value(struct kvf_mr *r, int depth)
{
    if (depth > 32 || need(r, 1)) return -1;
    uint8_t b = r->p[0];
    uint32_t n;
    if ((b & 0xf0) == 0x80 || b == 0xde || b == 0xdf) {
        if (kvf_mr_map(r, &n)) return -1;
        return check_map(r, n, depth);
    }
    if ((b & 0xf0) == 0x90 || b == 0xdc || b == 0xdd) {
        if (kvf_mr_array(r, &n)) return -1;
        if ((size_t)(r->end - r->p) < n) return -1; /* each element takes >= 1 byte */
        for (uint32_t k = 0; k < n; k++)
            if (check_value(r, depth + 1)) return -1;
        return 0;
    }
    if ((b & 0xe0) == 0xa0 || b == 0xd9 || b == 0xda || b == 0xdb) {
        const char *s;
        if (kvf_mr_str(r, &s, &n)) return -1;
        return utf8_ok((const uint8_t *)s, n) ? 0 : -1;
    }
    return skip_depth(r, depth);
}

int kvf_mr_check_meta(const uint8_t *meta, size_t len)
{
    struct kvf_mr r = {meta, meta + len};
    uint32_t n;
    if (kvf_mr_map(&r, &n) || check_map(&r, n, 0)) return -1;
    return r.p == r.end ? 0 : -1;
}

int kvf_mr_find(const uint8_t *meta, size_t len, const char *name, struct kvf_mr *out)
{
    struct kvf_mr r = {meta, meta + len};
    uint32_t n;
    size_t nl = strlen(name);
    if (kvf_mr_map(&r, &n)) return -1;
    for (uint32_t i = 0; i < n; i++) {
        const char *s; uint32_t sl;
        if (kvf_mr_str(&r, &s, &sl)) return -1;
        if (sl == nl && memcmp(s, name, nl) == 0) { *out = r; return 0; }
        if (kvf_mr_skip(&r)) return -1;
    }
    return -1;
}

/* ---------------------------------------------------------------- writer */

void kvf_mw_init(struct kvf_mw *w, uint8_t *buf, size_t cap)
{
    w->buf = buf; w->cap = cap; w->len = 0; w->overflow = 0;
}

void kvf_mw_raw(struct kvf_mw *w, const void *b, size_t n)
{
    if (w->overflow || w->cap - w->len < n) { w->overflow = 1; return; }
    memcpy(w->buf + w->len, b, n);
    w->len += n;
}

static void put1(struct kvf_mw *w, uint8_t b) { kvf_mw_raw(w, &b, 1); }
static void putb16(struct kvf_mw *w, uint8_t tag, uint16_t v) { uint8_t t[3] = {tag, (uint8_t)(v >> 8), (uint8_t)v}; kvf_mw_raw(w, t, 3); }
static void putb32(struct kvf_mw *w, uint8_t tag, uint32_t v)
{
    uint8_t t[5] = {tag, (uint8_t)(v >> 24), (uint8_t)(v >> 16), (uint8_t)(v >> 8), (uint8_t)v};
    kvf_mw_raw(w, t, 5);
}
static void putb64(struct kvf_mw *w, uint8_t tag, uint64_t v)
{
    uint8_t t[9];
    t[0] = tag;
    for (int i = 0; i < 8; i++) t[1 + i] = (uint8_t)(v >> (56 - 8 * i));
    kvf_mw_raw(w, t, 9);
}

void kvf_mw_map(struct kvf_mw *w, uint32_t n)
{
    if (n < 16) put1(w, (uint8_t)(0x80 | n)); else if (n <= 0xffff) putb16(w, 0xde, (uint16_t)n); else putb32(w, 0xdf, n);
}
size_t kvf_mw_map_open(struct kvf_mw *w)
{
    size_t at = w->len;
    putb32(w, 0xdf, 0);
    return at;
}

void kvf_mw_map_close(struct kvf_mw *w, size_t at)
{
    if (w->overflow) return;
    struct kvf_mr r = {w->buf + at + 5, w->buf + w->len};
    uint32_t items = 0;
    while (r.p < r.end) {
        if (kvf_mr_skip(&r)) { w->overflow = 1; return; } /* not whole values: a writer's bug */
        items++;
    }
    if (items % 2) { w->overflow = 1; return; } /* a key without its value */
    uint32_t n = items / 2;
    uint8_t *h = w->buf + at + 1;
    h[0] = (uint8_t)(n >> 24), h[1] = (uint8_t)(n >> 16), h[2] = (uint8_t)(n >> 8), h[3] = (uint8_t)n;
}

void kvf_mw_array(struct kvf_mw *w, uint32_t n)
{
    if (n < 16) put1(w, (uint8_t)(0x90 | n)); else if (n <= 0xffff) putb16(w, 0xdc, (uint16_t)n); else putb32(w, 0xdd, n);
}
void kvf_mw_str(struct kvf_mw *w, const char *s, size_t n)
{
    if (n < 32) put1(w, (uint8_t)(0xa0 | n));
    else if (n <= 0xff) { uint8_t t[2] = {0xd9, (uint8_t)n}; kvf_mw_raw(w, t, 2); }
    else if (n <= 0xffff) putb16(w, 0xda, (uint16_t)n);
    else putb32(w, 0xdb, (uint32_t)n);
    kvf_mw_raw(w, s, n);
}
void kvf_mw_cstr(struct kvf_mw *w, const char *s) { kvf_mw_str(w, s, strlen(s)); }
void kvf_mw_bin(struct kvf_mw *w, const void *b, size_t n)
{
    if (n <= 0xff) { uint8_t t[2] = {0xc4, (uint8_t)n}; kvf_mw_raw(w, t, 2); }
    else if (n <= 0xffff) putb16(w, 0xc5, (uint16_t)n);
    else putb32(w, 0xc6, (uint32_t)n);
    kvf_mw_raw(w, b, n);
}
/* Same encodings as msgpack-python's packb, so golden frames match byte for byte. */
void kvf_mw_uint(struct kvf_mw *w, uint64_t v)
{
    if (v <= 0x7f) put1(w, (uint8_t)v);
    else if (v <= 0xff) { uint8_t t[2] = {0xcc, (uint8_t)v}; kvf_mw_raw(w, t, 2); }
    else if (v <= 0xffff) putb16(w, 0xcd, (uint16_t)v);
    else if (v <= 0xffffffffu) putb32(w, 0xce, (uint32_t)v);
    else putb64(w, 0xcf, v);
}
void kvf_mw_int(struct kvf_mw *w, int64_t v)
{
    if (v >= 0) { kvf_mw_uint(w, (uint64_t)v); return; }
    if (v >= -32) put1(w, (uint8_t)(int8_t)v);
    else if (v >= -128) { uint8_t t[2] = {0xd0, (uint8_t)(int8_t)v}; kvf_mw_raw(w, t, 2); }
    else if (v >= -32768) putb16(w, 0xd1, (uint16_t)(int16_t)v);
    else if (v >= INT32_MIN) putb32(w, 0xd2, (uint32_t)(int32_t)v);
    else putb64(w, 0xd3, (uint64_t)v);
}
void kvf_mw_bool(struct kvf_mw *w, int v) { put1(w, v ? 0xc3 : 0xc2); }
void kvf_mw_nil(struct kvf_mw *w) { put1(w, 0xc0); }
