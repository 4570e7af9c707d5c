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

#include <errno.h>
#include <stdio.h>
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
