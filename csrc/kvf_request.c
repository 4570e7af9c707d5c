/* kvf_request.c: what every request handler of the native server shares,
 * below them all (kvf_ops.c, kvf_put.c, kvf_shm.c, kvf_stats.c) and above the
 * reply send path (kvf_send.c): the bounds-checked parsing of a request's
 * metadata fields, the reject that answers an error (and consumes the
 * request's payload, or closes on the errors after which the stream cannot be
 * trusted), and the status reply of a PUT, an shm RESERVE or an shm COMMIT.
 * Parsers return 0 or a wire error code (KVF_E_*).
 */
#define _GNU_SOURCE
#include "kvf_server_int.h"

#include "kvf_ns.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- errors */

void kvf_reject(struct conn *c, int code, const char *msg)
{
    if (kvf_err_is_fatal(code) || c->hdr.payload_len == 0) {
        kvf_reply_error(c, code, msg);
        kvf_conn_next_request(c);
        return;
    }
    c->pend_code = code;
    snprintf(c->pend_msg, sizeof c->pend_msg, "%s", msg);
    c->batch_op = 0;
    kvf_conn_drain(c, c->hdr.payload_len);
}

/* ---------------------------------------------------------------- parsing */

/* keys -> b->keys/klens (b sized to them). Returns 0 or a wire error code
 * (BUSY when the arrays are over the request budget). */
int kvf_parse_keys(struct conn *c, struct kvf_meta m, struct batch *b, uint32_t *n)
{
    struct kvf_mr r;
    uint32_t cnt;
    if (kvf_mr_find(m.p, m.n, KVF_F_KEYS, &r) || kvf_mr_array(&r, &cnt)) return KVF_E_MALFORMED;
    if (cnt > c->srv->cfg.max_keys) return KVF_E_TOO_MANY_KEYS;
    int rc = kvf_batch_alloc(c, b, cnt, 0);
    if (rc) return rc == -EBUSY ? KVF_E_BUSY : KVF_E_INTERNAL;
    for (uint32_t i = 0; i < cnt; i++) {
        const uint8_t *k;
        uint32_t kl;
        if (kvf_mr_bin(&r, &k, &kl) || kl == 0 || kl > c->srv->cfg.max_key_bytes || kl > KVF_KEY_MAX)
            return KVF_E_BAD_KEY;
        b->keys[i] = k;
        b->klens[i] = (uint8_t)kl;
    }
    *n = cnt;
    return 0;
}

const char *kvf_keys_error(int e)
{
    return e == KVF_E_TOO_MANY_KEYS ? "too many keys" : e == KVF_E_BAD_KEY ? "bad key" : e == KVF_E_BUSY
           ? "server busy: request buffers over their budget" : e == KVF_E_INTERNAL ? "out of memory"
           : "missing field '" KVF_F_KEYS "'";
}

static int run_cmp(const void *x, const void *y, void *arg)
{
    const struct batch *b = arg;
    uint32_t i = *(const uint32_t *)x, j = *(const uint32_t *)y;
    if (b->glens[i] != b->glens[j]) return b->glens[i] < b->glens[j] ? -1 : 1;
    return memcmp(b->groups[i], b->groups[j], b->glens[i]);
}

/* groups + group_parts (PUT, shm RESERVE; kvfabric.protocol.messages._groups, same
 * checks in the same order) -> b->groups/glens/gparts, all NULL/0 when both are
 * absent. Both lists as long as keys (MALFORMED), each group a key (BAD_KEY), each
 * count 1..max_keys (MALFORMED); a group's parts consecutive, as many as each states,
 * and no group named by two runs (MALFORMED). Everything is checked on the metadata
 * the header's limits bounded, into arrays sized before; nothing is allocated. */
int kvf_parse_groups(struct conn *c, struct kvf_meta m, struct batch *b, uint32_t n)
{
    struct kvf_mr g, p;
    uint32_t cg, cp;
    for (uint32_t i = 0; i < n; i++) b->groups[i] = NULL, b->glens[i] = 0, b->gparts[i] = 0;
    int hg = kvf_mr_find(m.p, m.n, KVF_F_GROUPS, &g) == 0 && !kvf_mr_is_nil(&g);
    int hp = kvf_mr_find(m.p, m.n, KVF_F_GROUP_PARTS, &p) == 0 && !kvf_mr_is_nil(&p);
    if (!hg && !hp) return 0;
    if (!hg || !hp || kvf_mr_array(&g, &cg) || kvf_mr_array(&p, &cp) || cg != n || cp != n) return KVF_E_MALFORMED;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *k;
        uint32_t kl;
        if (kvf_mr_bin(&g, &k, &kl) || kl == 0 || kl > c->srv->cfg.max_key_bytes || kl > KVF_KEY_MAX)
            return KVF_E_BAD_KEY;
        b->groups[i] = k;
        b->glens[i] = (uint8_t)kl;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint64_t v;
        if (kvf_mr_uint(&p, &v) || v == 0 || v > c->srv->cfg.max_keys) return KVF_E_MALFORMED;
        b->gparts[i] = (uint32_t)v;
    }
    uint32_t runs = 0;
    for (uint32_t i = 0, j; i < n; i = j) {
        for (j = i; j < n && b->glens[j] == b->glens[i] && !memcmp(b->groups[j], b->groups[i], b->glens[i]); j++)
            if (b->gparts[j] != b->gparts[i]) return KVF_E_MALFORMED;
        if (b->gparts[i] != j - i) return KVF_E_MALFORMED;
        b->gruns[runs++] = i;
    }
    qsort_r(b->gruns, runs, sizeof *b->gruns, run_cmp, b);
    for (uint32_t r = 1; r < runs; r++)
        if (run_cmp(&b->gruns[r - 1], &b->gruns[r], b) == 0) return KVF_E_MALFORMED;
    return 0;
}

const char *kvf_groups_error(int e)
{
    return e == KVF_E_BAD_KEY ? "groups must be keys"
           : "groups and group_parts: both lists as long as keys, and every part of each group named, consecutively";
}

int kvf_parse_ns(struct conn *c, struct kvf_meta m, uint64_t *nsref)
{
    struct kvf_mr r;
    const uint8_t *tag;
    uint32_t len;
    *nsref = 0;
    if (kvf_mr_find(m.p, m.n, KVF_F_NS, &r) || kvf_mr_is_nil(&r)) return 0;
    if (kvf_mr_bin(&r, &tag, &len) || len != KVF_NS_TAG_BYTES) return KVF_E_MALFORMED;
    struct kvf_ns *ns = kvf_store_ns(c->srv->st);
    return !ns || kvf_ns_ref(ns, tag, nsref) ? KVF_E_BUSY : 0;
}

const char *kvf_ns_error(int e)
{
    _Static_assert(KVF_NS_TAG_BYTES == 16, "the message below names the tag's size");
    return e == KVF_E_BUSY ? "namespace tag table full: this server knows as many tags as it can hold; nothing stored"
                           : KVF_F_NS " must be a 16-byte namespace tag (bin) or nil";
}

int kvf_parse_uints(struct kvf_meta m, const char *name, uint64_t *out, uint32_t n)
{
    struct kvf_mr r;
    uint32_t cnt;
    if (kvf_mr_find(m.p, m.n, name, &r) || kvf_mr_array(&r, &cnt) || cnt != n) return KVF_E_MALFORMED;
    for (uint32_t i = 0; i < n; i++)
        if (kvf_mr_uint(&r, &out[i])) return KVF_E_MALFORMED;
    return 0;
}

int kvf_parse_uint(struct kvf_meta m, const char *name, uint64_t *v, int required)
{
    struct kvf_mr r;
    if (kvf_mr_find(m.p, m.n, name, &r)) return required ? KVF_E_MALFORMED : 0;
    return kvf_mr_uint(&r, v) ? KVF_E_MALFORMED : 0;
}

int kvf_parse_bool(struct kvf_meta m, const char *name, int *v)
{
    struct kvf_mr r;
    if (kvf_mr_find(m.p, m.n, name, &r)) return 0;
    return kvf_mr_bool(&r, v) ? KVF_E_MALFORMED : 0;
}

/* ---------------------------------------------------------------- replies */

void kvf_put_reply(struct conn *c, struct batch *b, int op, int with_offsets)
{
    KVF_REPLY_BEGIN(48 + (size_t)b->n * 10, 0);
    kvf_mw_map(&w, with_offsets ? 3 : 1);
    if (with_offsets) {
        kvf_mw_cstr(&w, KVF_F_RES);
        kvf_mw_uint(&w, c->resv_id);
        kvf_mw_cstr(&w, KVF_F_OFFSETS);
        kvf_mw_array(&w, b->n);
        for (uint32_t i = 0; i < b->n; i++)
            kvf_mw_int(&w, b->status[i] == KVF_PUT_STORED ? (int64_t)b->offs[i] : -1);
    }
    kvf_mw_cstr(&w, KVF_F_STATUS);
    kvf_mw_array(&w, b->n);
    for (uint32_t i = 0; i < b->n; i++) kvf_mw_uint(&w, b->status[i]);
    kvf_reply_finish(c, rp, (uint8_t)op, KVF_FLAG_REPLY, w.len, 0);
}
