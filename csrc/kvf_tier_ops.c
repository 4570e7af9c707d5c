/* kvf_tier_ops.c: the loop thread's side of the tiers: park a request whose
 * keys miss DRAM but are on a tier, post the reads, promote what comes back,
 * re-dispatch the request (see kvf_tier.h).
 *
 * A GET (or LOOKUP) whose keys miss the arena but are in the SSD index (or,
 * with a shared tier, are not in the SSD index) parks its connection
 * (RS_TIER: nothing more is read from it, the loop goes on serving others).
 * For each such key an arena slot is reserved (parking for the control
 * thread's eviction like a PUT when the arena is full) and a read job posted;
 * the tier thread reads the record straight into the slot and verifies it.
 * When every job is back, verified objects are committed into the arena
 * (promotion on hit: an object read from a tier goes back to DRAM, and stays
 * on the tier too), failed ones give their slot back, and the same request
 * is dispatched again with c->tier_pass set: it now finds the promoted keys
 * in DRAM, and whatever is still missing is a miss (a second pass never goes
 * to a tier). One request promotes at most promote_max bytes of arena slots
 * (each object rounded up to whole KVF_PAGE pages); keys beyond that are misses. LOOKUP promotes only the leading run it counts (a
 * prefetch, so the GET that follows is a DRAM hit). EXISTS answers from the
 * index without reading (kvf_ops.c).
 *
 * A GET whose tier keys are all on the SSD tier is streamed instead: once
 * every slot is reserved (the only wait, for eviction), the reply is built at
 * once (sizes and checksums from the SSD index; the DRAM keys pinned as
 * usual; each SSD object a segment that waits, struct seg.wait) and queued,
 * the reads are posted, and the connection goes on to its next request. Each
 * object is sent as soon as its read is verified (kvf_conn_send_more) and
 * promoted then: committed and pinned at once (kvf_store_commit_pinned), so
 * the reply sends from a slot no eviction can take; a part of a group is
 * committed with its group's other parts when the request's last read is
 * back, its slot the reply's until then. A read that fails (corrupt, deleted
 * or overwritten meanwhile, I/O error) cannot be answered as a miss any more
 * (the size went out in the metadata): the connection is closed before the
 * object's last chunk, which the client sees as a miss. A value over two
 * KVF_TIER_CHUNKs is read in up to 8 chunks at once and sent chunk by chunk
 * as the tier thread checks them (stream_progress), its last chunk held back
 * until the whole checksum matched, as a large DRAM object is sent. A connection may have
 * several streamed GETs in flight (a client pipelining its GETs) while the
 * slots of its streamed replies not yet sent stay within one request's
 * promotion cap (c->tstream_bytes, given back as each reply is sent); a
 * streamed GET over it waits (RS_TIER, tier_wait) until a reply is sent, and
 * a request that needs a tier otherwise (LOOKUP, DELETE, a shared-tier read)
 * until the reads are back. So what one connection holds of the arena for
 * streamed reads is bounded by one request's promotion cap, whether or not
 * its peer reads (plus what its DRAM GET replies pin, as before).
 *
 * A connection with jobs in flight holds one ref per job, so it is not
 * destroyed under them; a closing one gives its slots back when they return.
 */
#define _GNU_SOURCE
#include "kvf_server_int.h"
#include "kvf_copy.h"
#include "kvf_tier.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { J_WAIT = 0, J_POSTED = 1, J_DONE = 2 };
#define SEG_NONE UINT32_MAX

struct kvf_tier_req {
    struct conn *conn;
    uint32_t n, posted, done;
    uint64_t park_round;
    int lookup_stop;              /* a LOOKUP's shared read missed (jobs' stop points here) */
    uint64_t park_ns, posted_ns, reap_ns; /* stage trace (KVFABRIC_TIER_TRACE) */
    uint64_t fin_ns;                      /* promotion done, second pass next (trace) */
    uint32_t space_parks;                 /* times it parked for the control thread's eviction */
    int stream;                   /* a GET served as its reads complete (all jobs SSD_READ) */
    uint64_t bytes;               /* stream: arena slot bytes of its reads (whole pages) */
    struct kvf_tier_req *snext;   /* stream: the connection's list (c->tstream) */
    int rerun;                    /* kvf_tier_rerun_begin: its request is running again */
    struct reply *rp;             /* stream: the reply queued for it */
    uint32_t *seg;                /* stream: each job's segment of rp (SEG_NONE: none) */
    uint64_t hits, misses, prom;  /* stream: counted as the jobs come back */
    uint8_t *state;               /* J_* per job */
    struct kvf_tier_job *jobs[];  /* n */
};

static void wake_loop(void *arg) { kvf_server_wake(arg); }

/* Debug: KVFABRIC_TIER_TRACE=FILE appends one line per parked request with
 * the time of each stage of the tier path (docs/notes/bench-tier.md, "SSD
 * GET path: where the time goes"). Opened at attach; loop thread only. */
static FILE *trace_fp;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void trace_req(const struct kvf_tier_req *r, int op, uint64_t fin_ns, uint64_t end_ns)
{
    uint64_t q = 0, io = 0, ver = 0, end = 0;
    for (uint32_t i = 0; i < r->n; i++) {
        const struct kvf_tier_job *j = r->jobs[i];
        if (!j->run_ns) continue; /* never posted (no space, too large) */
        if (j->run_ns - j->post_ns > q) q = j->run_ns - j->post_ns;
        if (j->cqe_ns > j->run_ns && j->cqe_ns - j->run_ns > io) io = j->cqe_ns - j->run_ns;
        if (j->end_ns > j->cqe_ns && j->cqe_ns && j->end_ns - j->cqe_ns > ver) ver = j->end_ns - j->cqe_ns;
        if (j->end_ns > end) end = j->end_ns;
    }
    /* space: park to last job posted (waits for eviction); queue: post to the tier thread's batch
     * start; io: batch start to the read's completion; verify: header and value checksum; back: last completion to the loop reaping it;
     * promote: reap to commit done; redispatch: the second pass (reply queued) */
    fprintf(trace_fp, "op=%d n=%u parks=%u space_us=%llu queue_us=%llu io_us=%llu verify_us=%llu back_us=%llu promote_us=%llu "
            "redispatch_us=%llu total_us=%llu\n", op, r->n, r->space_parks,
            (unsigned long long)((r->posted_ns - r->park_ns) / 1000), (unsigned long long)(q / 1000),
            (unsigned long long)(io / 1000), (unsigned long long)(ver / 1000),
            (unsigned long long)(end && r->reap_ns > end ? (r->reap_ns - end) / 1000 : 0),
            (unsigned long long)((fin_ns - r->reap_ns) / 1000), (unsigned long long)((end_ns - fin_ns) / 1000),
            (unsigned long long)((end_ns - r->park_ns) / 1000));
    fflush(trace_fp);
}

int kvf_server_attach_tier(struct kvf_server *s, struct kvf_tier *t)
{
    if (s->tier) return -EBUSY;
    s->tier = t;
    const char *tr = getenv("KVFABRIC_TIER_TRACE");
    if (tr && *tr && !trace_fp) trace_fp = fopen(tr, "ae");
    kvf_tier_set_wake(t, wake_loop, s);
    kvf_store_set_evict_hook(s->st, kvf_tier_on_evict, t);
    return 0;
}

struct kvf_tier *kvf_server_detach_tier(struct kvf_server *s)
{
    struct kvf_tier *t = s->tier;
    kvf_store_set_evict_hook(s->st, NULL, NULL);
    s->tier = NULL;
    return t;
}

static void req_free(struct kvf_tier_req *r)
{
    free(r->state);
    free(r->seg);
    free(r);
}

/* Shared-tier values wait in staging buffers (their size was unknown until
 * read): reserve their slots and copy them in, parking for the control
 * thread's eviction like a PUT when the arena is full (its steady state).
 * 1 parked (kvf_tier_step calls finish again), 0 done (a job that got no
 * slot has its result set). */
static int shared_slots(struct conn *c, struct kvf_tier_req *r)
{
    struct kvf_server *s = c->srv;
    for (uint32_t i = 0; i < r->n; i++) {
        struct kvf_tier_job *j = r->jobs[i];
        if (j->op != KVF_JOB_SHARED_READ || j->result || j->dst) continue;
        if (j->size > s->cfg.max_object) { j->result = -EFBIG; continue; }
        uint64_t off;
        int rc = kvf_store_reserve(s->st, j->size, &off);
        if (rc == -ENOSPC) {
            int exhausted;
            uint64_t round = kvf_store_round(s->st, &exhausted);
            if (!(r->park_round && r->park_round != round + 1 && exhausted)) {
                r->park_round = round + 1;
                kvf_conn_park(c, j->size);
                return 1;
            }
        }
        r->park_round = 0;
        if (rc) { j->result = rc; continue; } /* too large, or everything evictable is pinned: a miss */
        if (j->size) kvf_copy(s->base + off, j->buf, j->size);
        j->dst = s->base + off;
        j->slot_off = off;
    }
    return 0;
}

/* The request is done with its reads: trace it, release its jobs (and a
 * slot none of them handed over: a streamed GET that was never answered),
 * forget it. */
static void req_done(struct conn *c)
{
    struct kvf_tier_req *r = c->treq;
    if (trace_fp && !c->closing) trace_req(r, r->n ? r->jobs[0]->op : 0, r->fin_ns, now_ns());
    for (uint32_t i = 0; i < r->n; i++) {
        struct kvf_tier_job *j = r->jobs[i];
        if (j->dst && r->state[i] != J_POSTED) kvf_store_unreserve(c->srv->st, j->slot_off, j->size);
        j->dst = NULL;
        kvf_tier_job_release(c->srv->tier, j);
    }
    req_free(r);
    c->treq = NULL;
    c->tier_pass = 0;
}

/* Grouped SSD reads of one request (issue 23): the parts of a group read back are
 * committed into DRAM together (kvf_store_commit_group), so they are one unit of
 * the policy again, as when they were PUT. */
struct promo {
    uint8_t *ok, *status;
    uint32_t *idx, *job, *ids; /* commit's part order (identity); the job of each part; pinned entries */
    const uint8_t **keys;
    uint8_t *klens;
    uint64_t *offs, *sizes, *csums;
};

static struct promo *promo_new(uint32_t n)
{
    size_t m = n ? n : 1;
    struct promo *p = calloc(1, sizeof *p + m * (3 * sizeof(uint64_t) + sizeof(uint8_t *) + 3 * sizeof(uint32_t) + 3));
    if (!p) return NULL; /* then each object is promoted alone */
    uint8_t *q = (uint8_t *)(p + 1);
    p->offs = (uint64_t *)q; q += m * sizeof(uint64_t);
    p->sizes = (uint64_t *)q; q += m * sizeof(uint64_t);
    p->csums = (uint64_t *)q; q += m * sizeof(uint64_t);
    p->keys = (const uint8_t **)q; q += m * sizeof(uint8_t *);
    p->idx = (uint32_t *)q; q += m * sizeof(uint32_t);
    p->job = (uint32_t *)q; q += m * sizeof(uint32_t);
    p->ids = (uint32_t *)q; q += m * sizeof(uint32_t);
    p->ok = q; q += m;
    p->status = q; q += m;
    p->klens = q;
    return p;
}

/* The parts of job i's group marked in pr->ok (i first), taken out of it into the
 * commit arrays: returns how many. */
static uint32_t gather_group(struct kvf_tier_req *r, struct promo *pr, uint32_t i)
{
    struct kvf_tier_job *g = r->jobs[i];
    uint32_t m = 0;
    for (uint32_t k = i; k < r->n; k++) {
        struct kvf_tier_job *j = r->jobs[k];
        if (!pr->ok[k] || j->glen != g->glen || memcmp(j->gkey, g->gkey, g->glen)) continue;
        pr->ok[k] = 0;
        pr->keys[m] = j->key;
        pr->klens[m] = j->klen;
        pr->offs[m] = j->slot_off;
        pr->sizes[m] = j->size;
        pr->csums[m] = j->csum;
        pr->idx[m] = m;
        pr->job[m] = k;
        m++;
    }
    return m;
}

/* Commit the jobs marked in pr->ok, a group at a time; returns the objects stored. */
static uint64_t promote_groups(struct kvf_server *s, struct kvf_tier_req *r, struct promo *pr)
{
    uint64_t stored = 0;
    for (uint32_t i = 0; i < r->n; i++) {
        if (!pr->ok[i]) continue;
        struct kvf_tier_job *g = r->jobs[i];
        uint32_t m = gather_group(r, pr, i);
        for (uint32_t k = 0; k < m; k++)
            r->jobs[pr->job[k]]->dst = NULL; /* the slot is the store's now (or given back): never unreserved again */
        /* commit frees the slots of keys that arrived meanwhile, and every slot on ENOMEM */
        if (kvf_store_commit_group(s->st, m, pr->idx, pr->keys, pr->klens, pr->offs, pr->sizes, pr->csums, NULL, 0,
                                   g->gkey, g->glen, g->gparts, g->nsref, pr->status) == 0)
            for (uint32_t k = 0; k < m; k++) stored += pr->status[k] == 0;
    }
    return stored;
}

/* Every job is back: promote and count. 1: the request is to run again (the
 * loop dispatches it, then calls kvf_tier_rerun_done) or, on a closing
 * connection, is gone; 0: parked for space (kvf_tier_step calls this again). */
static int finish(struct conn *c)
{
    struct kvf_server *s = c->srv;
    struct kvf_tier_req *r = c->treq;
    uint64_t hits = 0, misses = 0, prom = 0;
    if (!c->closing && s->tier && shared_slots(c, r)) return 0;
    if (trace_fp && !r->reap_ns) r->reap_ns = now_ns(); /* finished without any job posted */
    struct promo *pr = promo_new(r->n);
    for (uint32_t i = 0; i < r->n; i++) {
        struct kvf_tier_job *j = r->jobs[i];
        if (j->op == KVF_JOB_SSD_TOMB) continue; /* a DELETE's, on disk (or counted) */
        int ssd = j->op == KVF_JOB_SSD_READ;
        int ok = j->result == 0 && !c->closing && s->tier;
        if (ok && ssd && !kvf_tier_still(s->tier, j->key, j->klen, j->seq)) ok = 0; /* deleted meanwhile */
        if (ok && !ssd && !j->dst) ok = 0; /* a shared-tier value that got no slot (shared_slots) */
        if (ok && ssd && j->glen && pr) { pr->ok[i] = 1; hits++; continue; } /* promoted with its group, below */
        if (ok) {
            /* commit frees the slot itself when the key arrived meanwhile (1) or on ENOMEM */
            int rc = kvf_store_commit(s->st, j->key, j->klen, j->slot_off, j->size, j->csum, NULL, 0, j->nsref);
            if (ssd) { hits++; prom += rc == 0; }
        } else {
            if (j->dst) kvf_store_unreserve(s->st, j->slot_off, j->size);
            if (ssd) misses++;
        }
        j->dst = NULL; /* the slot is the store's now (or given back): never unreserved again */
    }
    if (pr) prom += promote_groups(s, r, pr);
    free(pr);
    if (s->tier) kvf_tier_count(s->tier, hits, misses, prom);
    if (c->closing) {
        req_done(c);
        return 1;
    }
    if (trace_fp) r->fin_ns = now_ns();
    c->tier_pass = 1; /* the second pass never goes to a tier */
    c->rs = RS_META;  /* the same request again, its metadata still in c->meta */
    return 1;
}

void kvf_tier_rerun_begin(struct conn *c)
{
    if (c->treq) c->treq->rerun = 1;
}

void kvf_tier_rerun_done(struct conn *c)
{
    /* a request that parked during this pass (a fresh one after tier_wait) is not this one */
    if (c->treq && c->treq->rerun) req_done(c);
    c->tier_pass = 0;
}

/* Job i of r goes on the list to post (*post .. *tail); it holds a ref on c until it is back. */
static void add_post(struct conn *c, struct kvf_tier_req *r, uint32_t i, struct kvf_tier_job **post,
                     struct kvf_tier_job **tail)
{
    struct kvf_tier_job *j = r->jobs[i];
    j->owner = r;
    j->next = NULL;
    if (*tail) (*tail)->next = j; else *post = j;
    *tail = j;
    c->refs++;
    r->state[i] = J_POSTED;
}

/* Reserve slots and post the jobs not posted yet; park for space when the
 * arena is full. 1 when every job is back already (finish's value), else 0. */
int kvf_tier_step(struct conn *c)
{
    struct kvf_server *s = c->srv;
    struct kvf_tier_req *r = c->treq;
    struct kvf_tier_job *post = NULL, *tail = NULL;
    c->rs = RS_TIER;
    while (r->posted < r->n) {
        struct kvf_tier_job *j = r->jobs[r->posted];
        if (j->op == KVF_JOB_SSD_READ) {
            uint64_t off;
            int rc = kvf_store_reserve(s->st, j->size, &off);
            if (rc == -ENOSPC) {
                int exhausted;
                uint64_t round = kvf_store_round(s->st, &exhausted);
                if (!(r->park_round && r->park_round != round + 1 && exhausted)) {
                    r->park_round = round + 1;
                    r->space_parks++;
                    if (post) kvf_tier_post(s->tier, post);
                    /* ask for every slot still to reserve at once: one eviction round, not one per key */
                    uint64_t want = 0;
                    for (uint32_t k = r->posted; k < r->n; k++)
                        if (r->jobs[k]->op == KVF_JOB_SSD_READ) want += (r->jobs[k]->size + KVF_PAGE - 1) / KVF_PAGE * KVF_PAGE;
                    kvf_conn_park(c, want); /* retry_parked calls kvf_tier_step again */
                    return 0;
                }
                /* everything evictable is pinned: the rest are misses */
                for (; r->posted < r->n; r->posted++) {
                    r->jobs[r->posted]->result = -ENOSPC;
                    r->state[r->posted] = J_DONE;
                    r->done++;
                }
                break;
            }
            r->park_round = 0;
            if (rc) { /* too large for the arena */
                j->result = rc;
                r->state[r->posted++] = J_DONE;
                r->done++;
                continue;
            }
            j->dst = s->base + off;
            j->slot_off = off;
        }
        if (r->stream) { /* posted by kvf_tier_stream_start, once the reply is queued */
            r->state[r->posted++] = J_WAIT;
            continue;
        }
        add_post(c, r, r->posted++, &post, &tail);
    }
    if (post) kvf_tier_post(s->tier, post);
    if (trace_fp) r->posted_ns = now_ns();
    if (r->stream) { /* every slot reserved: the request runs (again) now and answers at once */
        c->tier_pass = 1;
        c->rs = RS_META;
        return 1;
    }
    return r->done == r->n ? finish(c) : 0;
}

static int park_jobs(struct conn *c, int op, struct kvf_tier_job *head, uint32_t cnt);

/* DELETE of keys on the SSD tier: a tombstone for each is written before the
 * request runs (and answers), so an acknowledged DELETE survives a SIGKILL.
 * The second pass unindexes the keys and queues one more tombstone each
 * (redundant, harmless: a tombstone is 4 KiB). */
static int park_delete(struct conn *c, struct batch *b, uint32_t n)
{
    struct kvf_tier *t = c->srv->tier;
    struct kvf_tier_job *head = NULL, *tail = NULL;
    uint32_t cnt = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!kvf_tier_has_key(t, b->keys[i], b->klens[i])) continue;
        struct kvf_tier_job *j = kvf_tier_job_new();
        if (!j) break;
        j->op = KVF_JOB_SSD_TOMB;
        j->klen = b->klens[i];
        memcpy(j->key, b->keys[i], b->klens[i]);
        if (tail) tail->next = j; else head = j;
        tail = j;
        cnt++;
    }
    return cnt ? park_jobs(c, KVF_OP_DELETE, head, cnt) : 0;
}

int kvf_tier_park(struct conn *c, int op, struct batch *b, uint32_t n)
{
    struct kvf_server *s = c->srv;
    struct kvf_tier *t = s->tier;
    if (!t || c->tier_pass) return 0;
    if (c->treq) req_done(c); /* a streamed GET's slots left by a request that ended unanswered (out of memory) */
    if (op == KVF_OP_DELETE) return park_delete(c, b, n);
    if (op != KVF_OP_GET && op != KVF_OP_LOOKUP) return 0;
    int shared = kvf_tier_has_shared(t);
    uint64_t budget = kvf_tier_promote_max(t), bytes = 0, misses = 0;
    struct kvf_tier_job *head = NULL, *tail = NULL;
    uint32_t cnt = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (kvf_store_exists(s->st, b->keys[i], b->klens[i])) continue;
        uint64_t loc, seq, size, csum;
        int on_ssd = kvf_tier_find(t, b->keys[i], b->klens[i], &loc, &seq, &size, &csum);
        /* the cap counts arena slots: an object takes whole pages, however small (the replay's
         * simulator caps a request at a quarter of the slots; counting bytes let 1 KiB blocks
         * promote 4x as many) */
        uint64_t slots = (size + KVF_PAGE - 1) / KVF_PAGE * KVF_PAGE;
        if (on_ssd && bytes + slots > budget) on_ssd = -1; /* over this request's promotion cap: a miss */
        if (on_ssd <= 0 && !(shared && on_ssd == 0)) {
            if (op == KVF_OP_GET) misses++;
            if (op == KVF_OP_LOOKUP) break; /* the leading run ends here */
            continue;
        }
        struct kvf_tier_job *j = kvf_tier_job_new();
        if (!j) break;
        j->op = on_ssd > 0 ? KVF_JOB_SSD_READ : KVF_JOB_SHARED_READ;
        j->klen = b->klens[i];
        memcpy(j->key, b->keys[i], b->klens[i]);
        if (on_ssd > 0) {
            j->loc = loc;
            j->seq = seq;
            j->size = size;
            j->csum = csum;
            bytes += slots;
        }
        if (tail) tail->next = j; else head = j;
        tail = j;
        cnt++;
    }
    if (misses) kvf_tier_count(t, 0, misses, 0);
    if (!cnt) return 0;
    return park_jobs(c, op, head, cnt);
}

/* Park c (request opcode op) on the cnt jobs of the list head: 1, or 0 when
 * out of memory (the jobs freed; the request then runs without the tier). */
static int park_jobs(struct conn *c, int op, struct kvf_tier_job *head, uint32_t cnt)
{
    int stream = op == KVF_OP_GET;
    uint64_t bytes = 0;
    for (struct kvf_tier_job *j = head; j; j = j->next) {
        stream &= j->op == KVF_JOB_SSD_READ;
        bytes += (j->size + KVF_PAGE - 1) / KVF_PAGE * KVF_PAGE;
    }
    /* streamed GETs of this connection not yet sent: another streamed GET joins them while their
     * slots stay within one request's promotion cap; anything else waits until their reads are back */
    if ((c->tstream && !stream) ||
        (stream && c->tstream_bytes && c->tstream_bytes + bytes > kvf_tier_promote_max(c->srv->tier))) {
        for (struct kvf_tier_job *j = head, *nx; j; j = nx) { nx = j->next; kvf_tier_job_free(j); }
        c->tier_wait = 1;
        c->rs = RS_TIER;
        return 1;
    }
    struct kvf_tier_req *r = calloc(1, sizeof *r + sizeof(struct kvf_tier_job *) * cnt);
    uint8_t *state = calloc(cnt, 1);
    uint32_t *seg = stream ? malloc(sizeof *seg * cnt) : NULL;
    if (!r || !state || (stream && !seg)) {
        free(r);
        free(state);
        free(seg);
        for (struct kvf_tier_job *j = head, *nx; j; j = nx) { nx = j->next; kvf_tier_job_free(j); }
        return 0; /* served from DRAM alone: the tier keys are misses */
    }
    r->conn = c;
    r->n = cnt;
    r->state = state;
    r->stream = stream;
    r->bytes = bytes;
    r->seg = seg;
    uint32_t k = 0;
    for (struct kvf_tier_job *j = head, *nx; j; j = nx) {
        nx = j->next;
        j->next = NULL;
        if (op == KVF_OP_LOOKUP && j->op == KVF_JOB_SHARED_READ) j->stop = &r->lookup_stop;
        if (seg) seg[k] = SEG_NONE;
        r->jobs[k++] = j;
    }
    c->treq = r;
    if (trace_fp) r->park_ns = now_ns();
    if (kvf_tier_step(c)) {
        if (stream) return 0; /* every slot reserved at once: answered now (kvf_tier_stream_slot) */
        r->rerun = 1; /* nothing to wait for (no slot, nothing posted): serve it now */
        kvf_tier_rerun_done(c);
        return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------- streamed GET */

int kvf_tier_stream_slot(struct conn *c, const uint8_t *key, uint32_t klen, uint32_t seg, uint64_t *off,
                         uint64_t *size, uint64_t *csum)
{
    struct kvf_tier_req *r = c->treq;
    if (!r || !r->stream) return 0;
    for (uint32_t i = 0; i < r->n; i++) {
        struct kvf_tier_job *j = r->jobs[i];
        if (!j->dst || r->seg[i] != SEG_NONE || j->klen != klen || memcmp(j->key, key, klen)) continue;
        r->seg[i] = seg;
        *off = j->slot_off;
        *size = j->size;
        *csum = j->csum;
        return 1;
    }
    return 0;
}

/* Every read of a streamed GET is back: commit its groups' parts (pinned, the
 * reply still sends from their slots), count, forget it. */
static void stream_end(struct conn *c, struct kvf_tier_req *r)
{
    struct kvf_server *s = c->srv;
    struct promo *pr = NULL;
    for (uint32_t i = 0; i < r->n && !c->closing && s->tier; i++) {
        struct kvf_tier_job *j = r->jobs[i];
        if (!j->glen || !j->dst || r->seg[i] == SEG_NONE || j->result) continue;
        if (!pr && !(pr = promo_new(r->n))) break; /* out of memory: not promoted, the reply keeps the slots */
        pr->ok[i] = 1;
    }
    for (uint32_t i = 0; pr && i < r->n; i++) {
        if (!pr->ok[i]) continue;
        struct kvf_tier_job *g = r->jobs[i];
        uint32_t m = gather_group(r, pr, i);
        if (kvf_store_commit_group_pinned(s->st, m, pr->idx, pr->keys, pr->klens, pr->offs, pr->sizes, pr->csums,
                                          g->gkey, g->glen, g->gparts, g->nsref, pr->status, pr->ids))
            continue; /* out of memory: not promoted, the reply keeps the slots */
        for (uint32_t k = 0; k < m; k++) {
            if (pr->status[k]) continue; /* held already: the slot stays the reply's */
            struct kvf_tier_job *j = r->jobs[pr->job[k]];
            r->rp->segs[r->seg[pr->job[k]]].entry = pr->ids[k]; /* promoted, pinned until the reply is done */
            j->dst = NULL;
            r->prom++;
        }
    }
    free(pr);
    if (s->tier) kvf_tier_count(s->tier, r->hits, r->misses, r->prom);
    if (trace_fp && !c->closing) trace_req(r, KVF_OP_GET, r->fin_ns ? r->fin_ns : now_ns(), now_ns());
    for (uint32_t i = 0; i < r->n; i++) {
        r->jobs[i]->dst = NULL; /* a slot not promoted is the reply's (KVF_SEG_SLOT), given back with it */
        kvf_tier_job_release(s->tier, r->jobs[i]);
    }
    struct kvf_tier_req **pp = &c->tstream;
    while (*pp && *pp != r) pp = &(*pp)->snext;
    if (*pp) *pp = r->snext;
    req_free(r);
}

void kvf_tier_stream_start(struct conn *c, struct reply *rp)
{
    struct kvf_server *s = c->srv;
    struct kvf_tier_req *r = c->treq;
    if (!r || !r->stream) return;
    c->treq = NULL;
    c->tier_pass = 0;
    r->rp = rp;
    r->rerun = 0;
    struct kvf_tier_job *post = NULL, *tail = NULL;
    for (uint32_t i = 0; i < r->n; i++) {
        struct kvf_tier_job *j = r->jobs[i];
        if (r->state[i] != J_WAIT) { r->misses++; continue; } /* no slot: a miss in the reply */
        if (r->seg[i] == SEG_NONE) { /* no segment (in DRAM by now, or no reply): its slot back */
            if (j->dst) kvf_store_unreserve(s->st, j->slot_off, j->size);
            j->dst = NULL;
            r->state[i] = J_DONE;
            r->done++;
            continue;
        }
        j->stream = 1; /* a large value is read in chunks, each sent as it is checked (kvf_tier_io.c) */
        add_post(c, r, i, &post, &tail);
    }
    r->snext = c->tstream;
    c->tstream = r;
    rp->tier_bytes = r->bytes; /* until the reply is sent (kvf_send.c gives them back) */
    c->tstream_bytes += r->bytes;
    if (post) kvf_tier_post(s->tier, post);
    if (trace_fp) r->posted_ns = now_ns();
    if (r->done == r->n) stream_end(c, r);
}

/* A streamed GET's read j (job i) is back: promote it and send it, or close. */
static void stream_job(struct conn *c, struct kvf_tier_req *r, uint32_t i)
{
    struct kvf_server *s = c->srv;
    struct kvf_tier_job *j = r->jobs[i];
    struct seg *g = &r->rp->segs[r->seg[i]];
    int ok = j->result == 0 && !c->closing && s->tier && kvf_tier_still(s->tier, j->key, j->klen, j->seq);
    if (!ok) {
        r->misses++;
        j->result = j->result ? j->result : -ESTALE;
        /* its size and checksum went out in the metadata: the bytes cannot follow. Closed before
         * its last chunk is sent, the whole reply is a miss for the client, never wrong bytes. */
        kvf_conn_close(c);
        return;
    }
    r->hits++;
    if (!j->glen) {
        uint32_t id;
        if (kvf_store_commit_pinned(s->st, j->key, j->klen, j->slot_off, j->size, j->csum, j->nsref, &id) == 0) {
            g->entry = id; /* promoted, and pinned until the reply is done */
            j->dst = NULL;
            r->prom++;
        } /* else held already (or out of memory): the slot stays the reply's */
    }
    g->hashed = g->len; /* verified by the tier thread (header, key, seq, whole checksum) */
    g->wait = 0;
    kvf_conn_send_more(c);
}

/* A streamed read's chunks were checked: send them (the job is still the tier thread's). */
static void stream_progress(struct kvf_tier_job *j)
{
    struct kvf_tier_req *r = j->owner;
    struct conn *c = r->conn;
    uint32_t i = 0;
    while (i < r->n && r->jobs[i] != j) i++;
    if (i == r->n || r->seg[i] == SEG_NONE || c->closing) return;
    struct seg *g = &r->rp->segs[r->seg[i]];
    uint64_t n = __atomic_load_n(&j->sendable, __ATOMIC_ACQUIRE);
    if (n <= g->hashed || !g->wait) return;
    g->hashed = n; /* the rest (its last chunk at least) waits for the whole checksum */
    kvf_conn_send_more(c);
}

struct conn *kvf_tier_reap(struct kvf_server *s)
{
    struct conn *ready = NULL;
    /* progress first: a job that is done as well is freed below, and the tier thread takes a
     * finished job off the progress list when it hands it back */
    struct kvf_tier_job *prog[64];
    for (uint32_t n; (n = kvf_tier_take_progress(s->tier, prog, 64));)
        for (uint32_t k = 0; k < n; k++) stream_progress(prog[k]);
    struct kvf_tier_job *d = kvf_tier_take_done(s->tier);
    while (d) {
        struct kvf_tier_job *j = d;
        d = d->next;
        j->next = NULL;
        struct kvf_tier_req *r = j->owner;
        struct conn *c = r->conn;
        uint32_t i = 0;
        while (i < r->n && r->jobs[i] != j) i++;
        if (i < r->n) r->state[i] = J_DONE;
        r->done++;
        c->refs--;
        if (r->stream) {
            if (i < r->n) stream_job(c, r, i);
            if (r->done == r->n) {
                if (trace_fp) r->reap_ns = r->fin_ns = now_ns();
                stream_end(c, r);
                /* a request waiting for these reads runs now (a fresh pass); a closing one is checked */
                c->tier_run |= c->tier_wait;
                c->tier_wait = 0;
                if (!c->tier_listed) { c->tier_listed = 1; c->tier_next = ready; ready = c; }
            }
            continue;
        }
        if (r->done == r->n) {
            if (trace_fp) r->reap_ns = now_ns();
            if (finish(c)) {
                c->tier_run = 1;
                if (!c->tier_listed) { c->tier_listed = 1; c->tier_next = ready; ready = c; }
            }
        }
    }
    return ready;
}

/* The connection is being destroyed (no job of it in flight: each holds a ref). */
void kvf_tier_conn_gone(struct conn *c)
{
    while (c->tstream) { /* only at server teardown (each read in flight holds a ref) */
        struct kvf_tier_req *r = c->tstream;
        c->tstream = r->snext;
        for (uint32_t i = 0; i < r->n; i++)
            if (r->state[i] != J_POSTED) kvf_tier_job_release(c->srv->tier, r->jobs[i]);
        req_free(r);
    }
    c->tstream_bytes = 0;
    struct kvf_tier_req *r = c->treq;
    if (!r) return;
    for (uint32_t i = 0; i < r->n; i++) {
        struct kvf_tier_job *j = r->jobs[i];
        if (r->state[i] == J_POSTED) continue; /* only at server teardown: the tier frees it */
        if (j->dst) kvf_store_unreserve(c->srv->st, j->slot_off, j->size);
        kvf_tier_job_release(c->srv->tier, j);
    }
    req_free(r);
    c->treq = NULL;
}
