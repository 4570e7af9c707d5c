/* kvf_limits.c: the native server's timeouts and budget wake-ups (see kvf_server.h).
 *
 * Runs on the loop thread, called by the loop only. The 500 ms sweep drops
 * peers that stall mid-frame, trickle under the min-rate bound, sit idle past
 * the idle timeout or do not authenticate in time, and trims the heap; a freed
 * budget wakes the connections waiting on it. The budgets themselves (buffers
 * given back after each request, replies held to the per-connection and
 * server-wide reply budgets, the reserve budget) are kept by the connection,
 * kvf_server_conn.c.
 */
#define _GNU_SOURCE
#include "kvf_server_int.h"

#include <malloc.h>
#include <stdlib.h>

/* Every 500 ms: drop peers that stall mid-frame (a trickled header
 * included) or stop reading their replies (a slow reader or writer would
 * otherwise hold slots and pins forever), and, with min_rate, peers whose
 * frame or reply overruns stall + size / min_rate while trickling bytes
 * (slowloris); close connections idle between frames past idle_ms and, with
 * a token, ones not authenticated preauth_ms after their accept. A PUT
 * waiting for space or for the reserve budget is waiting on us: left alone.
 * Then trim the heap once 4 MiB were freed since the last trim. */
void kvf_sweep(struct kvf_server *s, int64_t now)
{
    for (struct conn *c = s->conns; c; c = c->next) {
        if (c->closing) continue;
        int idle = c->rs == RS_HDR && c->got == 0 && !c->q_head;
        /* with a token, silent unauthenticated sockets must not fill max_conns */
        if (s->cfg.auth && !c->authed && s->cfg.preauth_ms && now - c->accepted_ms >= (int64_t)s->cfg.preauth_ms) {
            s->ctr.preauth_closed++;
            kvf_conn_close(c);
            continue;
        }
        if (idle && s->cfg.idle_ms && now - c->progress_ms >= (int64_t)s->cfg.idle_ms) {
            s->ctr.idle_closed++;
            kvf_conn_close(c);
            continue;
        }
        if (!s->cfg.stall_ms) continue;
        int mid_frame = c->rs == RS_META || c->rs == RS_OBJ || c->rs == RS_DRAIN || c->rs == RS_GATE ||
                        (c->rs == RS_HDR && c->got > 0);
        int sending = c->send_posted;
        int late = (mid_frame && c->rx_deadline_ms && now > c->rx_deadline_ms) ||
                   (sending && c->q_head && c->q_head->deadline_ms && now > c->q_head->deadline_ms);
        int stalled = now - c->progress_ms >= (int64_t)s->cfg.stall_ms && (mid_frame || sending);
        if (stalled || late) {
            if (stalled) s->ctr.stalled++; else s->ctr.too_slow++;
            kvf_conn_close(c);
        }
    }
    /* glibc keeps freed heap (and the loop thread's arena) unless asked */
    if (s->freed_since_trim >= (4u << 20)) {
        s->freed_since_trim = 0;
        malloc_trim(0);
    }
}

/* A budget was freed: connections paused on it go on (each checks again). */
void kvf_wake_waiters(struct kvf_server *s)
{
    int blocked = s->wake_blocked && s->ctr.reply_bytes <= s->cfg.reply_budget;
    int resv = s->wake_resv;
    if (!blocked && !resv) return;
    if (blocked) s->wake_blocked = 0; /* set again by a connection still over it */
    if (resv) s->wake_resv = s->resv_waiting = 0;
    int64_t now = kvf_now_ms();
    for (struct conn *c = s->conns, *n; c; c = n) {
        n = c->next;
        if (c->closing) continue;
        if (blocked && c->rs == RS_BLOCKED) {
            kvf_conn_next_request(c);
        } else if (resv && c->rs == RS_RESV_WAIT) {
            if (c->rx_deadline_ms) c->rx_deadline_ms += now - c->park_ms; /* the wait was ours */
            c->progress_ms = now;
            kvf_batch_step(c);
        }
    }
}

