/* kvf_stats.c: the STATS reply of the native server (run on the loop thread).
 *
 * One msgpack map: protocol/stats.py STATS_KEYS, then the product server's
 * optional keys (kvfabric.protocol.stats.STATS_OPTIONAL_KEYS["native"]):
 * send counters, data plane, connections by transport, errors by name, the
 * service-time histograms (lat_*), ssd_* with an SSD tier, shared_* with a
 * shared tier, and the Python front end's extras (stats_extra). Built once,
 * here: the STATS reply (kvf_op_stats, dispatched by kvf_ops.c) and the
 * binding's Server.stats_map() (kvfabric/server/native.py's stats(), which
 * /metrics reads) are the same bytes. The map's length is counted as it is
 * written (kvf_mw_map_open/close), never by hand.
 */
#define _GNU_SOURCE
#include "kvf_server_int.h"

#include <errno.h>
#include <stdlib.h>

#include "kvf_ns.h"
#include "kvf_tier.h"

static const char *const tr_names[4] = {"tcp", "native", "shm", "nixl"};

/* A bound on the map's size (what overflows it is answered INTERNAL, never cut). */
static size_t stats_cap(const struct kvf_server *s)
{
    return 2048 + 2048 /* service-time histograms */ + s->cfg.stats_extra_len + 1024 /* ssd_* */ +
           40 * kvf_shared_stats_pairs(s->cfg.shared);
}

/* The STATS map into w; 0, or -ENOSPC when it did not fit. Any thread: the
 * counters are read as they are (each a word; a snapshot only per counter). */
static int stats_write(struct kvf_server *s, struct kvf_mw *w)
{
    struct kvf_store_stats ss;
    kvf_store_stats(s->st, &ss);
    int ssd = s->tier && kvf_tier_has_ssd(s->tier); /* ssd_* only with --ssd-path (a tier may run a shared tier alone) */
    size_t map = kvf_mw_map_open(w);
#define KV(name, v) do { kvf_mw_cstr(w, name); kvf_mw_uint(w, (uint64_t)(v)); } while (0)
    KV("objects", ss.objects);
    KV("bytes_used", ss.bytes_used);
    KV("capacity", ss.capacity);
    KV("free_bytes", ss.free_bytes);
    KV("bytes_allocated", ss.capacity - ss.free_bytes); /* slots of objects and reservations, whole pages */
    KV("pinned", ss.pinned);
    KV("hits", s->ctr.hits);
    KV("misses", s->ctr.misses);
    KV("puts", s->ctr.puts);
    KV("evictions", ss.evictions);
    KV("checksum_failures", ss.checksum_failures);
    KV("checksum_rejects", s->ctr.checksum_rejects);
    KV("groups", ss.groups);
    KV("group_objects", ss.group_objects);
    KV("groups_incomplete", ss.groups_incomplete);
    KV("groups_stored", s->ctr.groups_stored);
    KV("groups_refused", s->ctr.groups_refused);
    KV("groups_torn", s->ctr.groups_torn);
    struct kvf_ns_stats ns = {0, 0, 0};
    if (kvf_store_ns(s->st)) kvf_ns_stats(kvf_store_ns(s->st), &ns);
    KV("namespaces", ns.tags);
    KV("retires", ns.retires);
    KV("retired_objects_freed", ns.freed);
    KV("bytes_in", s->ctr.bytes_in);
    KV("bytes_out", s->ctr.bytes_out);
    KV("connections", s->ctr.connections);
    KV("connections_total", s->ctr.connections_total);
    KV("connections_refused", s->ctr.rejected);
    KV("events_dropped", ss.events_dropped);
    KV("zc_sends", s->ctr.zc_sends);
    KV("copy_sends", s->ctr.copy_sends);
    KV("client_verified_sends", s->ctr.client_verified);
    KV("zc_copied_notifs", s->ctr.zc_copied_notifs);
    KV("stalled_connections", s->ctr.stalled);
    KV("slow_connections", s->ctr.too_slow);
    KV("shm_refused", s->ctr.shm_refused);
    KV("shm_leases_expired", s->ctr.shm_leases_expired);
    KV("shm_reservations_expired", s->ctr.shm_reservations_expired);
    KV("idle_timeouts", s->ctr.idle_closed);
    KV("preauth_timeouts", s->ctr.preauth_closed);
    KV("reply_budget_waits", s->ctr.reply_waits);
    KV("reserve_budget_waits", s->ctr.reserve_waits);
    KV("request_budget_busy", s->ctr.request_busy);
    KV("reply_budget_busy", s->ctr.reply_busy);
    KV("reply_bytes", s->ctr.reply_bytes);
    KV("request_bytes", s->ctr.request_bytes);
    KV("reserved_bytes", s->ctr.reserved_bytes);
    KV("uptime_s", (kvf_now_ms() - s->start_ms) / 1000);
#undef KV
    kvf_mw_cstr(w, "data_plane");
    kvf_mw_cstr(w, s->zerocopy ? (s->fixed ? "io_uring+send_zc+fixed" : "io_uring+send_zc") : "io_uring");
    kvf_mw_cstr(w, "transports_in_use");
    kvf_mw_map(w, 4);
    for (int i = 0; i < 4; i++) { kvf_mw_cstr(w, tr_names[i]); kvf_mw_uint(w, s->ctr.by_transport[i]); }
    kvf_mw_cstr(w, "errors"); /* by name, only the codes seen */
    size_t errs = kvf_mw_map_open(w);
    for (int i = 1; i < 14; i++)
        if (s->ctr.errors[i]) { kvf_mw_cstr(w, kvf_err_names[i]); kvf_mw_uint(w, s->ctr.errors[i]); }
    kvf_mw_map_close(w, errs);
    kvf_lat_write(w, &s->ctr);
    if (ssd) kvf_tier_stats_mw(s->tier, w);
    kvf_shared_stats_write(s->cfg.shared, w); /* shared_*: only with a shared tier */
    kvf_mw_raw(w, s->cfg.stats_extra, s->cfg.stats_extra_len);
    kvf_mw_map_close(w, map);
    return w->overflow ? -ENOSPC : 0;
}

void kvf_op_stats(struct conn *c)
{
    struct kvf_server *s = c->srv;
    size_t cap = stats_cap(s);
    KVF_REPLY_BEGIN(cap, 0);
    if (stats_write(s, &w)) { kvf_reply_drop(c, rp); kvf_reject(c, KVF_E_INTERNAL, "stats too large"); return; }
    kvf_reply_finish(c, rp, KVF_OP_STATS, KVF_FLAG_REPLY, w.len, 0);
    kvf_conn_next_request(c);
}

int kvf_server_stats_map(struct kvf_server *s, uint8_t **out, size_t *len)
{
    size_t cap = stats_cap(s);
    uint8_t *buf = malloc(cap);
    if (!buf) return -ENOMEM;
    struct kvf_mw w;
    kvf_mw_init(&w, buf, cap);
    int rc = stats_write(s, &w);
    if (rc) { free(buf); return rc; }
    *out = buf;
    *len = w.len;
    return 0;
}
