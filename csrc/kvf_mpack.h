/* kvf_mpack.h: the small msgpack subset the C data plane needs.
 *
 * Reader: a bounds-checked cursor over a metadata section. Every reader
 * returns 0 on success or -1 when the bytes are truncated or of another type;
 * nothing is allocated, so a hostile length prefix cannot make it allocate.
 * Writer: appends to a caller-owned buffer with a fixed capacity; it sets
 * w->overflow instead of writing past the end (check it once at the end).
 */
#ifndef KVF_MPACK_H
#define KVF_MPACK_H

#include <stddef.h>
#include <stdint.h>

struct kvf_mr {
    const uint8_t *p;
    const uint8_t *end;
};

int kvf_mr_map(struct kvf_mr *r, uint32_t *n);
int kvf_mr_array(struct kvf_mr *r, uint32_t *n);
int kvf_mr_str(struct kvf_mr *r, const char **s, uint32_t *n);
int kvf_mr_bin(struct kvf_mr *r, const uint8_t **b, uint32_t *n);
int kvf_mr_int(struct kvf_mr *r, int64_t *v);   /* signed or unsigned that fits int64 */
int kvf_mr_uint(struct kvf_mr *r, uint64_t *v); /* non-negative only */
int kvf_mr_bool(struct kvf_mr *r, int *v);
int kvf_mr_is_nil(struct kvf_mr *r);            /* 1 and consumed if nil, else 0 */
int kvf_mr_skip(struct kvf_mr *r);              /* skip one value (depth-limited) */
/* Check that meta[0..len) is exactly one msgpack map, as kvfabric/protocol/wire.py
 * decode_meta accepts it: nothing truncated, no byte after the map, map keys
 * are str or bin, every str is UTF-8, no map (at any depth) holds the same key
 * twice, nesting at most 32 deep. 0 valid, -1 malformed. Allocates only for a map of more than
 * 32 keys (its key list, freed before returning; -1 if it cannot be had). */
int kvf_mr_check_meta(const uint8_t *meta, size_t len);
/* Position on the value of top-level map key `name`; 0 found, -1 absent or bad. */
int kvf_mr_find(const uint8_t *meta, size_t len, const char *name, struct kvf_mr *out);

struct kvf_mw {
    uint8_t *buf;
    size_t cap;
    size_t len;
    int overflow;
};

void kvf_mw_init(struct kvf_mw *w, uint8_t *buf, size_t cap);
void kvf_mw_map(struct kvf_mw *w, uint32_t n);
/* A map whose length nobody counts by hand: open writes a map32 header and
 * returns where; close counts the keys and values written since (each a whole
 * msgpack value) and fills the header in (overflow set when they are not
 * pairs of whole values). */
size_t kvf_mw_map_open(struct kvf_mw *w);
void kvf_mw_map_close(struct kvf_mw *w, size_t at);
void kvf_mw_array(struct kvf_mw *w, uint32_t n);
void kvf_mw_str(struct kvf_mw *w, const char *s, size_t n);
void kvf_mw_cstr(struct kvf_mw *w, const char *s);
void kvf_mw_bin(struct kvf_mw *w, const void *b, size_t n);
void kvf_mw_int(struct kvf_mw *w, int64_t v);
void kvf_mw_uint(struct kvf_mw *w, uint64_t v);
void kvf_mw_bool(struct kvf_mw *w, int v);
void kvf_mw_nil(struct kvf_mw *w);
void kvf_mw_raw(struct kvf_mw *w, const void *b, size_t n);

#endif
