/* kvf_tier_io.c: the tier I/O thread, its job queue and its io_uring (see
 * kvf_tier.h).
 *
 * The thread takes up to BATCH jobs at a time from one FIFO queue (so a
 * DELETE's tombstone always follows a queued write of the same key), gives
 * each SSD write its place at the log head (entering a segment first drops
 * every index entry in it), submits all SSD I/O of the batch at once on its
 * own ring (IORING_OP_WRITE / IORING_OP_READV on the O_DIRECT files, from
 * 4 KiB-aligned buffers; an SSD read lands straight in the arena slot the
 * loop thread reserved), runs shared-tier jobs synchronously meanwhile, then
 * reaps every completion: a written record is indexed (unless deleted
 * meanwhile), a read record is verified (header, key, seq, value checksum);
 * finished reads go to the done list after each round of completions (not
 * at the end of the batch) and the loop thread is woken.
 *
 * Failures are values: an I/O error is counted (ssd_errors) and the write
 * dropped (ssd_write_drops) or the read a miss; a record that fails its
 * checksum is unindexed and counted (ssd_corrupt), never served.
 */
#define _GNU_SOURCE
#include "kvf_tier_int.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "kvf_copy.h"
#include "kvf_hash.h"
#include "kvf_shared.h"

#define BATCH 64u
#define MAX_INFLIGHT 192u /* a kick takes posted reads into the running batch up to this many in flight */

uint64_t kvf_tier_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

struct kvf_tier_job *kvf_tier_job_new(void) { return calloc(1, sizeof(struct kvf_tier_job)); }

void kvf_tier_job_free(struct kvf_tier_job *j)
{
    if (!j) return;
    if (j->xh) kvf_hash_free(j->xh);
    free(j->buf);
    free(j);
}

uint8_t *kvf_tier_buf_get(struct kvf_tier *t, uint64_t cap)
{
    uint8_t *b = NULL;
    pthread_mutex_lock(&t->mu);
    for (uint32_t i = 0; i < t->nbc; i++) {
        if (t->bcache[i].cap != cap) continue;
        b = t->bcache[i].p;
        t->bc_bytes -= cap;
        t->bcache[i] = t->bcache[--t->nbc];
        break;
    }
    pthread_mutex_unlock(&t->mu);
    if (!b && posix_memalign((void **)&b, KVF_TIER_BLOCK, cap)) b = NULL;
    return b;
}

void kvf_tier_buf_put(struct kvf_tier *t, uint8_t *b, uint64_t cap)
{
    if (!b) return;
    pthread_mutex_lock(&t->mu);
    int keep = t->nbc < 64 && t->st.queue_bytes + t->bc_bytes + cap <= t->write_queue && !t->stop;
    if (keep) {
        t->bcache[t->nbc].p = b;
        t->bcache[t->nbc++].cap = cap;
        t->bc_bytes += cap;
    }
    pthread_mutex_unlock(&t->mu);
    if (!keep) free(b);
}

void kvf_tier_buf_drain(struct kvf_tier *t)
{
    for (uint32_t i = 0; i < t->nbc; i++) free(t->bcache[i].p);
    t->nbc = 0;
    t->bc_bytes = 0;
}

/* A finished write job: its buffer back to the cache (queue_bytes already lowered). */
static void write_job_free(struct kvf_tier *t, struct kvf_tier_job *j)
{
    kvf_tier_buf_put(t, j->buf, j->buf_cap);
    j->buf = NULL;
    kvf_tier_job_free(j);
}

void kvf_tier_post(struct kvf_tier *t, struct kvf_tier_job *list)
{
    if (!list) return;
    uint64_t now = kvf_tier_now_ns();
    struct kvf_tier_job *last = list;
    int reads = 0;
    for (struct kvf_tier_job *j = list; j; j = j->next) { j->post_ns = now; last = j; reads |= j->op == KVF_JOB_SSD_READ; }
    pthread_mutex_lock(&t->mu);
    if (t->q_tail) t->q_tail->next = list; else t->q_head = list;
    t->q_tail = last;
    pthread_cond_signal(&t->cv);
    int kick = reads && t->in_io && t->kick_fd >= 0;
    pthread_mutex_unlock(&t->mu);
    uint64_t one = 1;
    if (kick && write(t->kick_fd, &one, sizeof one) < 0) { /* saturated: a kick is pending anyway */ }
}

struct kvf_tier_job *kvf_tier_take_done(struct kvf_tier *t)
{
    if (!__atomic_load_n(&t->done, __ATOMIC_ACQUIRE)) return NULL; /* the common case: no lock */
    pthread_mutex_lock(&t->mu);
    struct kvf_tier_job *d = t->done;
    t->done = NULL;
    pthread_mutex_unlock(&t->mu);
    /* the list was built newest first: give it back in posting order */
    struct kvf_tier_job *rev = NULL;
    while (d) { struct kvf_tier_job *n = d->next; d->next = rev; rev = d; d = n; }
    return rev;
}

uint32_t kvf_tier_take_progress(struct kvf_tier *t, struct kvf_tier_job **out, uint32_t max)
{
    if (!__atomic_load_n(&t->prog, __ATOMIC_ACQUIRE)) return 0;
    uint32_t n = 0;
    pthread_mutex_lock(&t->mu);
    while (t->prog && n < max) { /* copied out: the tier thread may put a job on the list again at once */
        struct kvf_tier_job *j = t->prog;
        t->prog = j->prog_next;
        j->on_prog = 0;
        out[n++] = j;
    }
    pthread_mutex_unlock(&t->mu);
    return n;
}

void kvf_tier_set_wake(struct kvf_tier *t, void (*wake)(void *), void *arg)
{
    t->wake = wake;
    t->wake_arg = arg;
}

void kvf_tier_set_shared(struct kvf_tier *t, struct kvf_shared *sh, int write_evicted)
{
    t->sh = sh;
    t->sh_write_evicted = write_evicted;
}

int kvf_tier_has_shared(struct kvf_tier *t) { return t->sh != NULL; }
int kvf_tier_has_ssd(struct kvf_tier *t) { return t->nfiles != 0; }

/* ---------------------------------------------------------------- one batch */

/* Under t->mu: the log position of a record of rec bytes at the head. */
static uint64_t place(struct kvf_tier *t, uint64_t rec)
{
    if (t->head_off + rec > t->seg_size) {
        t->head_seg = (t->head_seg + 1) % t->nsegs;
        t->head_off = 0;
        kvf_tier_drop_segment(t, t->head_seg); /* FIFO: the oldest segment goes */
    }
    uint64_t loc = t->head_seg * t->seg_size + t->head_off;
    t->head_off += rec;
    return loc;
}

struct shared_room {
    struct kvf_tier *t;
    struct kvf_tier_job *j;
};

/* kvf_shared_read_alloc's allocator: the job's staging buffer. All staging
 * buffers alive (read, not yet promoted by the loop) stay within promote_max:
 * over it the read is a miss (-ENOBUFS), as keys over a request's promotion
 * cap are. */
static int shared_alloc(void *arg, uint64_t size, uint8_t **dst)
{
    struct shared_room *r = arg;
    uint64_t cap = tier_round(size);
    if (size > r->t->promote_max) return -EFBIG;
    if (__atomic_add_fetch(&r->t->sh_staged, cap, __ATOMIC_RELAXED) > r->t->promote_max) {
        __atomic_sub_fetch(&r->t->sh_staged, cap, __ATOMIC_RELAXED);
        return -ENOBUFS;
    }
    r->j->staged = cap;
    if (posix_memalign((void **)&r->j->buf, KVF_TIER_BLOCK, cap)) { r->j->buf = NULL; return -ENOMEM; }
    r->j->buf_cap = cap;
    *dst = r->j->buf;
    return 0;
}

void kvf_tier_job_release(struct kvf_tier *t, struct kvf_tier_job *j)
{
    if (t && j && j->staged) __atomic_sub_fetch(&t->sh_staged, j->staged, __ATOMIC_RELAXED);
    kvf_tier_job_free(j);
}

/* A copy of a stored (PUT) or evicted object for the shared tier (its own
 * job; the same write-queue bound; drops counted by the shared tier). */
void kvf_tier_shared_put(struct kvf_tier *t, const uint8_t *key, uint32_t klen, const uint8_t *val, uint64_t size,
                         uint64_t csum, uint64_t nsref)
{
    if (!t->sh) return;
    uint64_t rec = tier_rec_len(size);
    pthread_mutex_lock(&t->mu);
    int over = t->st.queue_bytes + rec > t->write_queue || t->stop;
    if (!over) t->st.queue_bytes += rec;
    pthread_mutex_unlock(&t->mu);
    if (over) { kvf_shared_count_drop(t->sh); return; }
    struct kvf_tier_job *j = kvf_tier_job_new();
    uint8_t *buf = NULL;
    if (!j || !(buf = kvf_tier_buf_get(t, rec))) {
        free(j);
        pthread_mutex_lock(&t->mu);
        t->st.queue_bytes -= rec;
        pthread_mutex_unlock(&t->mu);
        kvf_shared_count_drop(t->sh);
        return;
    }
    kvf_copy(buf + KVF_TIER_BLOCK, val, size);
    j->nsref = nsref;
    kvf_tier_post_write(t, j, KVF_JOB_SHARED_WRITE, key, klen, size, csum, buf, rec);
}

void kvf_tier_post_write(struct kvf_tier *t, struct kvf_tier_job *j, int op, const uint8_t *key, uint32_t klen,
                         uint64_t size, uint64_t csum, uint8_t *buf, uint64_t rec)
{
    j->op = (uint8_t)op;
    j->klen = (uint8_t)klen;
    memcpy(j->key, key, klen);
    j->size = size;
    j->csum = csum;
    j->buf = buf;
    j->buf_cap = rec;
    kvf_tier_post(t, j);
}

void kvf_tier_shared_delete(struct kvf_tier *t, const uint8_t *key, uint32_t klen)
{
    if (!t->sh) return;
    struct kvf_tier_job *j = kvf_tier_job_new();
    if (!j) return; /* out of memory: the file stays (a later GET may still find it) */
    j->op = KVF_JOB_SHARED_DELETE;
    j->klen = (uint8_t)klen;
    memcpy(j->key, key, klen);
    kvf_tier_post(t, j);
}

/* A tagged shared file read (fns): 0 and its ref in *nsref when its generation is live here
 * (a newer one than this server knew is adopted: its writer saw more retirements, so this
 * server retires more, never less); -ESTALE when it is retired, its tag does not fit the table
 * (never served untagged), or the records could not be read for a tag not seen before. */
static int shared_ns_ref(struct kvf_tier *t, const struct kvf_shared_ns *fns, uint64_t *nsref)
{
    *nsref = 0;
    if (!fns->tagged || !t->ns) return 0; /* no table: nothing is ever retired */
    int known = kvf_ns_known(t->ns, fns->tag);
    if (known == 0 && kvf_shared_retired_load(t->sh, t->ns)) known = -EIO; /* other servers' retirements first */
    int rc = known < 0 ? known : kvf_ns_reref(t->ns, fns->tag, fns->gen, nsref);
    if (rc == 0) return 0;
    kvf_shared_count_retired(t->sh);
    *nsref = 0;
    return -ESTALE;
}

/* The shared tier (kvf_shared.h) counts its own outcomes (shared_* STATS). */
static void shared_job(struct kvf_tier *t, struct kvf_tier_job *j)
{
    if (!t->sh) { j->result = -ENOENT; return; }
    if (j->op == KVF_JOB_SHARED_WRITE) {
        struct kvf_shared_ns fns;
        memset(&fns, 0, sizeof fns);
        if (j->nsref && t->ns) {
            if (kvf_ns_stale(t->ns, j->nsref)) return; /* retired before it reached the filesystem: not written */
            fns.tagged = kvf_ns_unref(t->ns, j->nsref, fns.tag, &fns.gen) == 0;
        }
        (void)kvf_shared_write(t->sh, j->key, j->klen, j->buf + KVF_TIER_BLOCK, j->size, j->csum, &fns);
        return;
    }
    if (j->op == KVF_JOB_SHARED_DELETE) {
        (void)kvf_shared_delete(t->sh, j->key, j->klen);
        return;
    }
    if (j->stop && __atomic_load_n(j->stop, __ATOMIC_RELAXED)) { j->result = -ECANCELED; return; }
    uint64_t size = 0, csum = 0;
    struct shared_room room = {t, j}; /* one open, one read into a staging buffer sized from the file */
    struct kvf_shared_ns fns;
    int rc = kvf_shared_read_alloc(t->sh, j->key, j->klen, shared_alloc, &room, &size, &csum, &fns);
    if (rc == 0) rc = shared_ns_ref(t, &fns, &j->nsref); /* promoted with its ref: retirable in DRAM */
    if (rc && j->stop) __atomic_store_n(j->stop, 1, __ATOMIC_RELAXED); /* a LOOKUP's run ends here */
    j->result = rc;
    j->size = size;
    j->csum = csum;
}

/* Check a read record's header block; 0, -ESTALE (overwritten since looked up), -EBADMSG. */
static int verify_header(struct kvf_tier *t, struct kvf_tier_job *j)
{
    const struct tier_rec *h = j->iov[0].iov_base;
    if (kvf_tier_rec_check(t, j->loc, h)) return -EBADMSG;
    if (h->klen != j->klen || memcmp(h->key, j->key, j->klen) || h->seq != j->seq || (h->flags & TIER_F_TOMB))
        return -ESTALE;
    if (h->size != j->size || h->csum != j->csum) return -EBADMSG;
    uint32_t glen, gparts; /* its group, for the promotion (kvf_tier_ops.c commits a group's parts together) */
    if (kvf_tier_grp_get(j->iov[0].iov_base, j->gkey, &glen, &gparts)) return -EBADMSG;
    j->glen = (uint8_t)glen;
    j->gparts = gparts;
    int ns = kvf_tier_ns_get(t, j->iov[0].iov_base, &j->nsref); /* its namespace, for the promotion */
    return ns == 1 ? -ESTALE : ns ? -EBADMSG : 0;  /* a retired generation: a miss, not corrupt */
}

/* Verify a read record; 0, -ESTALE (overwritten since looked up), -EBADMSG. */
static int verify_read(struct kvf_tier *t, struct kvf_tier_job *j)
{
    int rc = verify_header(t, j);
    if (rc) return rc;
    return kvf_obj_hash(j->key, j->klen, j->dst, j->size) == j->csum ? 0 : -EBADMSG;
}

/* Value bytes of chunk c of a chunked read (the last one up to the rounded value end). */
static uint64_t chunk_len(const struct kvf_tier_job *j, unsigned c)
{
    uint64_t end = tier_round(j->size), from = (uint64_t)c * j->chunk;
    return from + j->chunk < end ? j->chunk : end - from;
}

/* Chunk c of a chunked read completed with res: check the header (chunk 0), hash
 * the chunks landed in order, and raise `sendable` (all but the last chunk, which
 * waits for the whole checksum). 1 when the job is complete (result set), 0 when
 * chunks are still in flight; *progressed when sendable grew. */
static int chunk_done(struct kvf_tier *t, struct kvf_tier_job *j, unsigned c, int res, int *progressed)
{
    uint64_t want = chunk_len(j, c) + (c == 0 ? KVF_TIER_BLOCK : 0);
    if (!j->cerr && (res < 0 || (uint64_t)res != want)) j->cerr = res < 0 ? res : -EIO;
    j->landed |= (uint8_t)(1u << c);
    if (!j->cerr && c == 0) {
        j->cerr = verify_header(t, j);
        if (!j->cerr && !j->xh && !(j->xh = kvf_hash_new())) j->cerr = -ENOMEM;
        if (!j->cerr) kvf_hash_reset_key(j->xh, j->key, j->klen);
    }
    while (!j->cerr && j->hashed_chunks < j->nchunks && (j->landed & (1u << j->hashed_chunks))) {
        uint64_t from = (uint64_t)j->hashed_chunks * j->chunk, n = chunk_len(j, j->hashed_chunks);
        if (from + n > j->size) n = j->size - from; /* the record's padding is not the object's */
        kvf_hash_update(j->xh, j->dst + from, n);
        j->hashed_chunks++;
        if (j->hashed_chunks < j->nchunks) { /* never the last chunk before the whole checksum */
            __atomic_store_n(&j->sendable, from + n, __ATOMIC_RELEASE);
            *progressed = 1;
        }
    }
    if (--j->chunks_left) return 0;
    if (!j->cerr && kvf_hash_digest(j->xh) != j->csum) j->cerr = -EBADMSG;
    j->result = j->cerr;
    return 1;
}

static int read_sqe(struct kvf_tier *t, struct kvf_tier_job *j, struct io_uring_sqe *q);

/* Submit SSD_READ job j: one READV (read_sqe), or for a streamed GET's large value the header
 * block + first chunk and one READ per further chunk, all at once. Returns the SQEs taken
 * (each completes once), 0 when none could be had; -ENOMEM (q taken, nothing read). */
static int read_sqes(struct kvf_tier *t, struct kvf_tier_job *j, struct io_uring_sqe *q)
{
    if (!j->stream || j->size <= 2u * KVF_TIER_CHUNK) return read_sqe(t, j, q) ? -ENOMEM : 1;
    uint64_t per = (tier_round(j->size) + 7) / 8;
    j->chunk = tier_round(per > KVF_TIER_CHUNK ? per : KVF_TIER_CHUNK);
    j->nchunks = (uint8_t)((tier_round(j->size) + j->chunk - 1) / j->chunk);
    if (read_sqe(t, j, q)) return -ENOMEM;
    j->iov[1].iov_len = chunk_len(j, 0);
    q->user_data = (uint64_t)(uintptr_t)j; /* chunk 0 */
    int fd;
    uint64_t off;
    kvf_tier_where(t, j->loc, &fd, &off);
    unsigned c = 1;
    for (; c < j->nchunks; c++) {
        struct io_uring_sqe *e = kvf_ring_sqe(&t->ring);
        if (!e) break;
        e->opcode = IORING_OP_READ;
        e->fd = fd;
        e->off = off + KVF_TIER_BLOCK + (uint64_t)c * j->chunk;
        e->addr = (uint64_t)(uintptr_t)(j->dst + (uint64_t)c * j->chunk);
        e->len = (uint32_t)chunk_len(j, c);
        e->user_data = (uint64_t)(uintptr_t)j | c;
    }
    if (c < j->nchunks) { /* the ring is full: the rest are chunks that failed (the job completes as -EIO) */
        j->cerr = -EIO;
        j->landed = (uint8_t)~0u;
    }
    j->chunks_left = (uint8_t)c;
    return (int)c;
}

/* Fill q with SSD_READ job j's READV (header block + value straight into dst); 0 or -ENOMEM. */
static int read_sqe(struct kvf_tier *t, struct kvf_tier_job *j, struct io_uring_sqe *q)
{
    int fd;
    uint64_t off;
    if (!j->buf && posix_memalign((void **)&j->buf, KVF_TIER_BLOCK, KVF_TIER_BLOCK)) { j->buf = NULL; return -ENOMEM; }
    j->buf_cap = KVF_TIER_BLOCK;
    j->iov[0].iov_base = j->buf;
    j->iov[0].iov_len = KVF_TIER_BLOCK;
    j->iov[1].iov_base = j->dst;
    j->iov[1].iov_len = tier_round(j->size);
    kvf_tier_where(t, j->loc, &fd, &off);
    q->opcode = IORING_OP_READV;
    q->addr = (uint64_t)(uintptr_t)j->iov;
    q->len = j->size ? 2 : 1;
    q->fd = fd;
    q->off = off;
    q->user_data = (uint64_t)(uintptr_t)j;
    return 0;
}

/* While a batch's I/O is in flight: take the SSD reads posted since (out of the FIFO queue: a read
 * overtaking queued writes is safe, verify_read catches a record overwritten meanwhile) and submit
 * them now; arm the kick's READ so the next post wakes the wait. Returns the SQEs added. */
static unsigned take_late_reads(struct kvf_tier *t, unsigned inflight, struct kvf_tier_job **done,
                                struct kvf_tier_job **done_tail)
{
    struct kvf_tier_job *reads = NULL, **rt = &reads;
    pthread_mutex_lock(&t->mu);
    t->in_io = 1;
    unsigned n = 0;
    struct kvf_tier_job **pp = &t->q_head, *prev = NULL;
    while (*pp && inflight + n < MAX_INFLIGHT) {
        struct kvf_tier_job *j = *pp;
        if (j->op != KVF_JOB_SSD_READ) { prev = j; pp = &j->next; continue; }
        *pp = j->next;
        if (t->q_tail == j) t->q_tail = prev;
        j->next = NULL;
        *rt = j;
        rt = &j->next;
        n++;
    }
    pthread_mutex_unlock(&t->mu);
    unsigned added = 0;
    uint64_t now = kvf_tier_now_ns();
    for (struct kvf_tier_job *j = reads, *next; j; j = next) {
        next = j->next;
        j->next = NULL;
        j->run_ns = now;
        struct io_uring_sqe *q = kvf_ring_sqe(&t->ring);
        int taken = q ? read_sqes(t, j, q) : 0;
        if (taken > 0) { added += (unsigned)taken; continue; }
        if (q) { q->opcode = IORING_OP_NOP; q->user_data = 0; added++; } /* the SQE was taken */
        j->result = -ENOMEM;
        pthread_mutex_lock(&t->mu);
        t->st.errors++;
        pthread_mutex_unlock(&t->mu);
        if (*done_tail) (*done_tail)->next = j; else *done = j;
        *done_tail = j;
    }
    if (!t->kick_armed && t->kick_fd >= 0) {
        struct io_uring_sqe *q = kvf_ring_sqe(&t->ring);
        if (q) {
            q->opcode = IORING_OP_READ;
            q->fd = t->kick_fd;
            q->addr = (uint64_t)(uintptr_t)&t->kick_val;
            q->len = sizeof t->kick_val;
            q->off = (uint64_t)-1;
            q->user_data = (uint64_t)(uintptr_t)&t->kick_val;
            t->kick_armed = 1;
        }
    }
    return added;
}

/* Give the finished read jobs to the loop thread and wake it. Called after each round of
 * completions, not once per batch: a batch that keeps taking late reads (a client pipelining its
 * GETs) would otherwise hold every finished read back until its last one completed. */
static void hand_back(struct kvf_tier *t, struct kvf_tier_job **done, struct kvf_tier_job **done_tail)
{
    if (!*done) return;
    pthread_mutex_lock(&t->mu);
    /* t->done is newest first (kvf_tier_take_done reverses it) */
    for (struct kvf_tier_job *j = *done, *n; j; j = n) {
        n = j->next;
        j->next = t->done;
        t->done = j;
        if (j->on_prog) { /* the loop frees it once done: never on the progress list then */
            struct kvf_tier_job **pp = &t->prog;
            while (*pp && *pp != j) pp = &(*pp)->prog_next;
            if (*pp) *pp = j->prog_next;
            j->on_prog = 0;
        }
    }
    pthread_mutex_unlock(&t->mu);
    *done = *done_tail = NULL;
    if (t->wake) t->wake(t->wake_arg);
}

static void run_batch(struct kvf_tier *t, struct kvf_tier_job *list)
{
    struct kvf_tier_job *done = NULL, *done_tail = NULL;
    int prog = 0;
    unsigned inflight = 0;
    uint64_t run_ns = kvf_tier_now_ns();
    /* The segment of the batch's first write: a batch never wraps the log back
     * onto it, so no two writes in flight together ever overlap, and a record
     * is indexed only if its segment was not reused before it completed. */
    uint64_t first_seg = 0;
    int placed = 0;
    for (struct kvf_tier_job *j = list, *next; j; j = next) {
        next = j->next;
        j->next = NULL;
        j->run_ns = run_ns;
        if (j->op == KVF_JOB_SHARED_READ || j->op == KVF_JOB_SHARED_WRITE || j->op == KVF_JOB_SHARED_DELETE) {
            shared_job(t, j);
            if (j->op != KVF_JOB_SHARED_READ) { /* SHARED_DELETE: buf_cap 0 */
                pthread_mutex_lock(&t->mu);
                t->st.queue_bytes -= j->buf_cap;
                pthread_mutex_unlock(&t->mu);
                write_job_free(t, j);
            } else {
                if (done_tail) done_tail->next = j; else done = j;
                done_tail = j;
            }
            continue;
        }
        struct io_uring_sqe *q = t->nfiles ? kvf_ring_sqe(&t->ring) : NULL;
        if (j->op == KVF_JOB_SSD_TOMB && !j->buf) {
            if (posix_memalign((void **)&j->buf, KVF_TIER_BLOCK, KVF_TIER_BLOCK)) j->buf = NULL;
            else { memset(j->buf, 0, KVF_TIER_BLOCK); j->buf_cap = KVF_TIER_BLOCK; }
        }
        if (!q || (j->op != KVF_JOB_SSD_READ && !j->buf)) { /* no SSD tier, a full ring (not with BATCH < 256), no memory */
            j->result = -ENOMEM;
            q = NULL;
        }
        int fd = -1;
        uint64_t off = 0;
        if (q && j->op == KVF_JOB_SSD_READ) {
            int taken = read_sqes(t, j, q);
            if (taken < 0) {
                q->opcode = IORING_OP_NOP; /* the SQE was taken: complete it as nothing */
                q->user_data = 0;
                inflight++;
                j->result = -ENOMEM;
                q = NULL;
            } else {
                inflight += (unsigned)taken;
                continue;
            }
        } else if (q) {
            pthread_mutex_lock(&t->mu);
            if (placed && t->head_off + j->buf_cap > t->seg_size && (t->head_seg + 1) % t->nsegs == first_seg) {
                /* the log would wrap onto this batch's own writes: this job and the rest wait
                 * for the next batch (back at the head of the queue, order kept) */
                j->next = next;
                struct kvf_tier_job *last = j;
                while (last->next) last = last->next;
                last->next = t->q_head;
                t->q_head = j;
                if (!t->q_tail) t->q_tail = last;
                pthread_mutex_unlock(&t->mu);
                q->opcode = IORING_OP_NOP; /* the SQE was taken: complete it as nothing */
                q->user_data = 0;
                inflight++;
                break;
            }
            j->seq = t->next_seq++;
            j->loc = place(t, j->buf_cap);
            if (!placed) first_seg = j->loc / t->seg_size;
            placed = 1;
            pthread_mutex_unlock(&t->mu);
            kvf_tier_rec_fill(t, j->loc, (struct tier_rec *)j->buf, j->key, j->klen, j->op == KVF_JOB_SSD_TOMB ? 0 : j->size,
                              j->op == KVF_JOB_SSD_TOMB ? 0 : j->csum, j->seq, j->op == KVF_JOB_SSD_TOMB ? TIER_F_TOMB : 0);
            kvf_tier_grp_fill(j->buf, j->gkey, j->op == KVF_JOB_SSD_TOMB ? 0 : j->glen, j->gparts);
            kvf_tier_ns_fill(t, j->buf, j->op == KVF_JOB_SSD_TOMB ? 0 : j->nsref);
            kvf_tier_where(t, j->loc, &fd, &off);
            q->opcode = IORING_OP_WRITE;
            q->addr = (uint64_t)(uintptr_t)j->buf;
            q->len = (uint32_t)j->buf_cap;
        }
        if (q) {
            q->fd = fd;
            q->off = off;
            q->user_data = (uint64_t)(uintptr_t)j;
            inflight++;
            continue;
        }
        /* could not be submitted: finish it as failed */
        pthread_mutex_lock(&t->mu);
        t->st.errors++;
        if (j->op == KVF_JOB_SSD_WRITE) {
            uint32_t i = kvf_tier_ifind(t, j->key, j->klen);
            if (i != TIER_NONE && t->ents[i].state == TE_PENDING && t->ents[i].loc == (uint64_t)(uintptr_t)j)
                kvf_tier_iremove(t, i);
            t->st.queue_bytes -= j->buf_cap;
            t->st.write_drops++;
        }
        pthread_mutex_unlock(&t->mu);
        if (j->op == KVF_JOB_SSD_READ || j->owner) {
            if (done_tail) done_tail->next = j; else done = j;
            done_tail = j;
        } else if (j->op == KVF_JOB_SSD_WRITE) {
            write_job_free(t, j);
        } else {
            kvf_tier_job_free(j);
        }
    }
    while (inflight) {
        if (t->nfiles) inflight += take_late_reads(t, inflight, &done, &done_tail);
        int rc = kvf_ring_submit_wait(&t->ring, 1, 1000);
        if (rc && rc != -ETIME && rc != -EINTR) break; /* the ring is broken: what is in flight is lost */
        struct io_uring_cqe *cqe;
        while ((cqe = kvf_ring_peek(&t->ring))) {
            uint64_t ud = cqe->user_data;
            int res = cqe->res;
            kvf_ring_cqe_seen(&t->ring);
            if (ud == (uint64_t)(uintptr_t)&t->kick_val) { t->kick_armed = 0; continue; } /* a kick: late reads next round */
            inflight--;
            /* job pointers are 16-byte aligned (calloc): the low bits name a chunked read's chunk */
            struct kvf_tier_job *j = (struct kvf_tier_job *)(uintptr_t)(ud & ~(uint64_t)15);
            if (!j) continue; /* the NOP of a deferred job */
            uint64_t us = (kvf_tier_now_ns() - j->post_ns) / 1000;
            if (j->op == KVF_JOB_SSD_READ && j->nchunks) {
                int progressed = 0;
                int whole = chunk_done(t, j, (unsigned)(ud & 15), res, &progressed);
                if (progressed && !j->on_prog) {
                    pthread_mutex_lock(&t->mu);
                    j->on_prog = 1;
                    j->prog_next = t->prog;
                    t->prog = j;
                    pthread_mutex_unlock(&t->mu);
                    prog = 1;
                }
                if (!whole) continue;
                /* for the accounting below: the I/O's outcome (an error, or the record's bytes) */
                res = j->result < 0 && j->result != -EBADMSG && j->result != -ESTALE
                          ? j->result : (int)(KVF_TIER_BLOCK + tier_round(j->size));
            }
            if (j->op == KVF_JOB_SSD_READ) {
                j->cqe_ns = kvf_tier_now_ns();
                uint64_t want = KVF_TIER_BLOCK + (j->size ? tier_round(j->size) : 0);
                if (!j->nchunks) j->result = res < 0 ? res : (uint64_t)res != want ? -EIO : verify_read(t, j);
                pthread_mutex_lock(&t->mu);
                t->st.reads++;
                t->st.read_us_total += us;
                if (res >= 0) t->st.read_bytes += (uint64_t)res;
                if (res < 0 || j->result == -EIO) t->st.errors++;
                if (j->result == -EBADMSG) {
                    uint32_t i = kvf_tier_ifind(t, j->key, j->klen);
                    if (i != TIER_NONE && t->ents[i].state == TE_LIVE && t->ents[i].seq == j->seq) {
                        t->st.corrupt++; /* dropped: never served, a miss from now on */
                        kvf_tier_iremove(t, i);
                    } else {
                        j->result = -ESTALE; /* its segment was reused while it was read: a miss, not damage */
                    }
                }
                pthread_mutex_unlock(&t->mu);
                j->end_ns = kvf_tier_now_ns();
                if (done_tail) done_tail->next = j; else done = j;
                done_tail = j;
                continue;
            }
            pthread_mutex_lock(&t->mu);
            uint32_t i = j->op == KVF_JOB_SSD_WRITE ? kvf_tier_ifind(t, j->key, j->klen) : TIER_NONE;
            int mine = i != TIER_NONE && t->ents[i].state == TE_PENDING && t->ents[i].loc == (uint64_t)(uintptr_t)j;
            if (res == (int)j->buf_cap) {
                t->st.writes++;
                t->st.write_bytes += j->buf_cap;
                t->st.write_us_total += us;
                if (mine) {
                    struct tent *e = &t->ents[i];
                    e->state = TE_LIVE;
                    e->loc = j->loc;
                    e->seq = j->seq;
                    t->st.objects++;
                    t->st.bytes += e->size;
                    kvf_tier_event(t, KVF_TIER_EV_STORED, e, j->gkey, j->glen);
                }
            } else { /* EIO, ENOSPC, EROFS, a short write: counted, the object is not kept */
                t->st.errors++;
                if (j->op == KVF_JOB_SSD_WRITE) t->st.write_drops++;
                if (mine) kvf_tier_iremove(t, i);
            }
            if (j->op == KVF_JOB_SSD_WRITE) t->st.queue_bytes -= j->buf_cap;
            pthread_mutex_unlock(&t->mu);
            if (j->op == KVF_JOB_SSD_TOMB && j->owner) { /* a DELETE waits for it: back to the loop */
                j->result = res == (int)j->buf_cap ? 0 : res < 0 ? res : -EIO;
                if (done_tail) done_tail->next = j; else done = j;
                done_tail = j;
            } else if (j->op == KVF_JOB_SSD_WRITE) {
                write_job_free(t, j);
            } else {
                kvf_tier_job_free(j);
            }
        }
        hand_back(t, &done, &done_tail);
        if (prog) { /* streamed reads' chunks: the loop sends them while the rest are read */
            prog = 0;
            if (t->wake) t->wake(t->wake_arg);
        }
    }
    pthread_mutex_lock(&t->mu);
    t->in_io = 0;
    pthread_mutex_unlock(&t->mu);
    hand_back(t, &done, &done_tail);
}

static void *tier_main(void *arg)
{
    struct kvf_tier *t = arg;
    for (;;) {
        pthread_mutex_lock(&t->mu);
        while (!t->q_head && !t->stop) pthread_cond_wait(&t->cv, &t->mu);
        if (!t->q_head) { pthread_mutex_unlock(&t->mu); break; }
        struct kvf_tier_job *list = t->q_head, *last = list;
        unsigned n = 1;
        while (last->next && n < BATCH) { last = last->next; n++; }
        t->q_head = last->next;
        if (!t->q_head) t->q_tail = NULL;
        last->next = NULL;
        pthread_mutex_unlock(&t->mu);
        run_batch(t, list);
    }
    return NULL;
}

int kvf_tier_thread_start(struct kvf_tier *t)
{
    t->kick_fd = eventfd(0, EFD_CLOEXEC); /* -1: no kicks, late reads wait for the batch */
    int rc = pthread_create(&t->th, NULL, tier_main, t);
    if (rc) {
        if (t->kick_fd >= 0) close(t->kick_fd);
        t->kick_fd = -1;
        return -rc;
    }
    t->started = 1;
    return 0;
}

/* Queued jobs are finished first (write-behind reaches the disk on a clean stop). */
void kvf_tier_thread_stop(struct kvf_tier *t)
{
    if (!t->started) return;
    pthread_mutex_lock(&t->mu);
    t->stop = 1;
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->th, NULL);
    t->started = 0;
    /* a kick READ may still be armed: the ring's exit cancels it (kick_val lives until then) */
    if (t->kick_fd >= 0) close(t->kick_fd);
    t->kick_fd = -1;
}
