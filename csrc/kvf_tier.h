/* kvf_tier.h: the tiers below the DRAM arena, and the job queue of the tier
 * I/O thread that moves their bytes.
 *
 * One struct kvf_tier per server (kvf_tier_open). It owns:
 *   - the local SSD tier (zero or more --ssd-path files; format and index in
 *     kvf_tier.c, docs/notes/tier.md): a circular log of fixed-size segments
 *     of 4 KiB-aligned records, opened O_DIRECT;
 *   - one tier I/O thread with its own io_uring (kvf_tier_io.c) that runs
 *     jobs posted by the loop thread (reads, promotions) and by the control
 *     thread (write-behind of evicted objects), and hands finished read jobs
 *     back to the loop thread (kvf_tier_take_done), waking it through the
 *     server's eventfd;
 *   - optionally a shared-filesystem tier (kvf_tier_set_shared): functions
 *     that the tier thread calls synchronously for KVF_JOB_SHARED_* jobs.
 *
 * Threads: the loop thread (GET/LOOKUP/EXISTS/DELETE hooks, promotion,
 * completions), the control thread (kvf_store_evict -> kvf_tier_on_evict),
 * the tier thread (I/O). The index, the queues and the counters are under
 * one mutex (t->mu), never held across I/O or a copy of object bytes.
 *
 * C moves bytes; Python decides: what the tier does is configured at open
 * (paths, capacity, admission rule, write-queue bound, promotion cap).
 * Functions return 0 or -errno unless documented otherwise.
 */
#ifndef KVF_TIER_H
#define KVF_TIER_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "kvf_store.h"

#define KVF_TIER_FORMAT_VERSION 1u
#define KVF_TIER_BLOCK 4096u          /* alignment of every record, buffer and I/O */
#define KVF_TIER_MAX_PATHS 8u
#define KVF_TIER_FILE "kvfabric-tier.v1"

enum kvf_tier_admit {
    KVF_ADMIT_ALL = 0, /* every evicted object (whose key is not on the tier already) */
    KVF_ADMIT_HIT = 1, /* only objects read (GET) at least once while in DRAM */
};

/* ------------------------------------------------------------------ jobs
 *
 * A job is one unit of tier I/O. Whoever posts it owns nothing of it until
 * it comes back: write jobs (SSD_WRITE, SSD_TOMB, SHARED_WRITE) are freed by
 * the tier thread; read jobs (SSD_READ, SHARED_READ) come back to the loop
 * thread through kvf_tier_take_done with `result` set, and the loop frees
 * them (kvf_tier_job_free).
 */
enum kvf_job_op {
    KVF_JOB_SSD_WRITE = 1,    /* append the record in buf (header block + value) at the log head; index it */
    KVF_JOB_SSD_TOMB = 2,     /* append a tombstone for key (DELETE must not resurrect after a restart) */
    KVF_JOB_SSD_READ = 3,     /* read the record at loc: value into dst, verify key, seq and checksum */
    KVF_JOB_SHARED_READ = 4,  /* shared_read(key) into a staging buffer (buf) the tier thread allocates */
    KVF_JOB_SHARED_WRITE = 5, /* shared_write(key, buf + KVF_TIER_BLOCK, size, csum) */
    KVF_JOB_SHARED_DELETE = 6, /* shared_delete(key): a DELETE must not come back from the shared tier */
};

struct kvf_tier_job {
    struct kvf_tier_job *next; /* queue link; the holder's */
    uint8_t op, klen;
    uint8_t key[KVF_KEY_MAX];
    /* Set by the tier thread: 0 done (read: value verified in dst or buf);
     * -ENOENT absent, -EBADMSG corrupt (dropped and counted), -ESTALE the
     * record was overwritten since it was looked up (a miss, not corrupt),
     * -ENOSPC/-EIO/-errno an I/O failure (counted in ssd_errors). */
    int result;
    uint64_t size, csum;   /* value bytes and kvf_obj_hash(key, value); SHARED_READ: filled in */
    uint8_t *buf;          /* aligned staging buffer owned by the job (KVF_TIER_BLOCK header + value), or NULL */
    uint64_t buf_cap;
    uint8_t *dst;          /* SSD_READ: where the value goes (page aligned, room for roundup(size, 4096)) */
    uint64_t slot_off;     /* loop thread: arena offset of dst (0 and dst NULL: not reserved) */
    uint64_t loc, seq;     /* SSD: record position in the log and its sequence number */
    void *owner;           /* loop thread: the request (struct kvf_tier_req) the job belongs to */
    uint64_t staged;       /* SHARED_READ: bytes of buf charged to the tier's staging bound (released by
                              kvf_tier_job_release) */
    int *stop;             /* SHARED_READ of a LOOKUP: set by the tier thread on a miss; the request's
                              later SHARED_READs are then skipped (-ECANCELED): its leading run ended */
    uint64_t post_ns;      /* when it was posted (latency counters) */
    uint64_t run_ns, cqe_ns, end_ns; /* tier thread: batch start, I/O completed, verified (stage trace) */
    struct iovec iov[2];   /* tier thread: SSD_READ's header block + value */
    /* the object's group (issue 23; glen 0: none): SSD_WRITE writes it into the record's header
     * block, SSD_READ reads it back (verified) so that a promotion commits a group's parts together */
    uint8_t gkey[KVF_KEY_MAX];
    uint8_t glen;
    uint32_t gparts;
    /* its namespace ref (kvf_ns.h; 0 untagged): SSD_WRITE writes the tag and generation into
     * the header block, SSD_READ reads them back (a retired generation is -ESTALE, a miss) so
     * that a promotion keeps the object retirable */
    uint64_t nsref;
    /* SSD_READ of a streamed GET (stream set by the loop before posting): a value over
     * 2 x KVF_TIER_CHUNK is read in up to 8 chunks at once; as they land in order the tier
     * thread checks the header, hashes them and raises `sendable` (atomic: value bytes the
     * loop may send now; never the last chunk, which waits for the whole checksum), and
     * puts the job on the progress list (kvf_tier_take_progress) */
    uint8_t stream, nchunks, chunks_left, hashed_chunks, on_prog, landed;
    int cerr;              /* the first chunk's failure (-errno, -EIO short, or the header's) */
    uint64_t chunk;        /* bytes per chunk (a multiple of KVF_TIER_BLOCK) */
    uint64_t sendable;
    void *xh;              /* the chunks' running checksum (kvf_hash.h) */
    struct kvf_tier_job *prog_next;
};
#define KVF_TIER_CHUNK (256u << 10)

/* ------------------------------------------------------------------ shared tier
 *
 * The shared-filesystem tier (kvf_shared.h, --shared-path): its functions
 * run on the tier thread, synchronously, one job at a time (plain blocking
 * file I/O). A GET/LOOKUP key that misses DRAM and the SSD index becomes a
 * SHARED_READ job when a shared tier is set (kvf_shared_read_alloc: one
 * open and one read into a staging buffer sized from the file); what it
 * reads is promoted into the arena like an SSD hit. A LOOKUP's shared reads
 * stop at its first miss (the leading run ends there: no I/O for the rest).
 * Every committed PUT is written through (kvf_tier_shared_put: a copy in a
 * SHARED_WRITE job, within the write-queue bound; over it a counted drop),
 * so the pool keeps it when this server is lost. Evicted objects are written
 * too only with set_shared's write_evicted (off in `kvfabric serve`: they
 * were written at PUT). A DELETE posts SHARED_DELETE (kvf_tier_shared_delete).
 * Namespaces (issue 27): a tagged object's file carries its tag and generation; a
 * SHARED_READ of a tagged file whose generation this server has retired is a miss
 * (-ESTALE, counted in shared_retired), and one of a tag the table has not interned
 * first reads the shared retirement records again (kvf_shared_retired_load); a
 * promoted object keeps its ref (j->nsref), so it stays retirable in DRAM.
 */
struct kvf_shared;

/* ------------------------------------------------------------------ the tier */

struct kvf_tier_cfg {
    const char *const *paths; /* directories (one file each, KVF_TIER_FILE); npaths 0: no SSD tier */
    uint32_t npaths;
    uint64_t capacity;        /* SSD bytes in all, split evenly over the paths; the files never exceed it */
    uint64_t write_queue;     /* bytes of staging buffers for write-behind (full: counted drop) */
    int admit;                /* enum kvf_tier_admit */
    uint64_t promote_max;     /* bytes of arena slots (whole pages per object) one request may promote (over: misses) */
    int64_t gid;              /* the tier group (--tier-group), -1 none: a new tier file is 0640 of this group,
                                 and an existing one may be readable and writable by it */
    struct kvf_ns *ns;        /* namespace generations (the store's, kvf_store_ns), NULL: none */
    uint32_t events;          /* SSD index events kept for kvf_tier_events_drain (0: none recorded; the
                                 server's --kv-events, issue 26), at most KVF_TIER_EVENTS_MAX */
};

/* SSD index events (issue 26): STORED when an object's record becomes live (written, or found by the
 * start-up scan), REMOVED when a live object leaves the index (reclaimed with its segment, deleted,
 * superseded, corrupt, retired). A group's objects name it by gkey on STORED and by ghash
 * (kvf_tier_ghash) on both, so that a reader can name a group's removal after its store. A full
 * ring drops the event and counts it: the reader then knows its view is no longer exact. */
#define KVF_TIER_EVENTS_MAX (1u << 22)
enum { KVF_TIER_EV_STORED = 1, KVF_TIER_EV_REMOVED = 2 };
struct kvf_tier_event {
    uint8_t type, klen, glen;
    uint32_t gparts;
    uint64_t ghash, size;
    uint8_t key[KVF_KEY_MAX];
    uint8_t gkey[KVF_KEY_MAX]; /* STORED of a group's object only */
};

/* Every counter is kept as it changes: kvf_tier_stats is O(1). */
struct kvf_tier_stats {
    uint64_t capacity, objects, bytes, hits, misses, reads, read_bytes, writes, write_bytes, write_drops,
        admit_skips, errors, corrupt, read_us_total, write_us_total, promotions, queue_bytes;
    uint64_t groups_torn; /* groups dropped whole from the index: a part missing at the start-up scan, or
                             a part's segment reused (issue 23) */
};

struct kvf_tier;
struct kvf_mw;

/* Open (or create) the tier files, rebuild the index from them and start the
 * tier thread. On failure returns -errno and writes a one-line reason for the
 * operator into err: a missing or unwritable directory, O_DIRECT unsupported
 * (-EINVAL), a capacity too small for two segments, ENOSPC when the file
 * cannot be preallocated; a tier file that is a symlink (-ELOOP: never
 * written through), not a regular file or hard-linked elsewhere, owned by
 * another uid, or open to group / others beyond cfg's gid (-EPERM). The
 * file is opened relative to its directory with O_NOFOLLOW | O_NONBLOCK
 * (a FIFO never blocks the start) and checked with fstat before anything is
 * read, fallocated or written. */
int kvf_tier_open(struct kvf_tier **out, const struct kvf_tier_cfg *cfg, char *err, size_t errlen);
/* Stop taking jobs, finish the queued ones (write-behind included), join the
 * thread, close the files. No return. */
void kvf_tier_close(struct kvf_tier *t);
/* Who to wake when read jobs finished (the server's eventfd). */
void kvf_tier_set_wake(struct kvf_tier *t, void (*wake)(void *), void *arg);
/* Plug in a shared tier (see above; the caller keeps it open until kvf_tier_close);
 * write_evicted: post SHARED_WRITE for evicted objects too. Before the loop runs. */
void kvf_tier_set_shared(struct kvf_tier *t, struct kvf_shared *sh, int write_evicted);
int kvf_tier_has_shared(struct kvf_tier *t);
int kvf_tier_has_ssd(struct kvf_tier *t); /* 1 with --ssd-path files; 0: the tier thread runs a shared tier alone */
/* Loop thread, after a PUT (or shm COMMIT) stored key: post a copy of its
 * bytes as a SHARED_WRITE job; over the write-queue bound (or out of memory)
 * it is dropped and counted (shared_write_drops). Nothing without a shared tier.
 * nsref: the object's namespace ref (kvf_ns.h, 0 untagged): the file carries its tag
 * and generation; an object retired before the tier thread reaches it is not written. */
void kvf_tier_shared_put(struct kvf_tier *t, const uint8_t *key, uint32_t klen, const uint8_t *val, uint64_t size,
                         uint64_t csum, uint64_t nsref);
/* Loop thread, DELETE: post a SHARED_DELETE job (FIFO: after any queued write of the key). */
void kvf_tier_shared_delete(struct kvf_tier *t, const uint8_t *key, uint32_t klen);

/* Post jobs (a NULL-terminated list through ->next) to the tier thread. Any thread. */
void kvf_tier_post(struct kvf_tier *t, struct kvf_tier_job *list);
/* Loop thread: the read jobs finished since the last call (a list), or NULL. */
struct kvf_tier_job *kvf_tier_take_done(struct kvf_tier *t);
/* Loop thread, BEFORE kvf_tier_take_done: up to max streamed reads whose `sendable` grew since
 * the last call, into out; returns how many (each still the tier thread's: read `sendable` only). */
uint32_t kvf_tier_take_progress(struct kvf_tier *t, struct kvf_tier_job **out, uint32_t max);
struct kvf_tier_job *kvf_tier_job_new(void); /* zeroed, or NULL */
void kvf_tier_job_free(struct kvf_tier_job *j); /* frees buf too */
/* Loop thread, a read job that came back: give its shared-read staging bytes
 * back to the tier's bound (t may be NULL at teardown), then free it. */
void kvf_tier_job_release(struct kvf_tier *t, struct kvf_tier_job *j);

/* Index lookups (any thread). 1 on the SSD tier (loc, seq, size, csum set), 0 not. */
int kvf_tier_find(struct kvf_tier *t, const uint8_t *key, uint32_t klen, uint64_t *loc, uint64_t *seq,
                  uint64_t *size, uint64_t *csum);
/* 1 when key is on the tier with this seq (still there, not deleted since). */
int kvf_tier_still(struct kvf_tier *t, const uint8_t *key, uint32_t klen, uint64_t seq);
/* 1 when key is in the SSD index, written or still queued (PENDING). */
int kvf_tier_has_key(struct kvf_tier *t, const uint8_t *key, uint32_t klen);
/* DELETE: unindex key (a grouped one: its whole group) and append a tombstone for key.
 * Returns the records removed that were on the tier (0: none). */
int kvf_tier_delete(struct kvf_tier *t, const uint8_t *key, uint32_t klen);
/* Store eviction hook (kvf_store_set_evict_hook; control thread): stage a copy of the evicted object
 * for write-behind, or count why not (admission, already on the tier, queue full). */
void kvf_tier_on_evict(void *arg, const uint8_t *key, uint32_t klen, const uint8_t *val, uint64_t size,
                       uint64_t csum, uint32_t hits, const uint8_t *gkey, uint32_t glen, uint32_t gparts,
                       uint64_t nsref);

/* The server's side (kvf_tier_ops.c). Attach before kvf_server_run: the loop
 * then parks GET/LOOKUP keys found on a tier, EXISTS and DELETE see the tier,
 * and the store's evictions are written behind (kvf_store_set_evict_hook).
 * Detach after the loop and the control thread stopped, then kvf_tier_close.
 * attach: 0 or -EBUSY (one is attached); detach returns it (or NULL). */
struct kvf_server;
int kvf_server_attach_tier(struct kvf_server *s, struct kvf_tier *t);
struct kvf_tier *kvf_server_detach_tier(struct kvf_server *s);

/* Counters the loop thread adds (under t->mu). */
void kvf_tier_count(struct kvf_tier *t, uint64_t hits, uint64_t misses, uint64_t promotions);
uint64_t kvf_tier_promote_max(struct kvf_tier *t);
void kvf_tier_stats(struct kvf_tier *t, struct kvf_tier_stats *s);
/* Move up to max recorded SSD index events, oldest first, into out; returns how many. *dropped: the
 * events dropped ever because the ring was full (0 with cfg.events 0, which records none). */
uint32_t kvf_tier_events_drain(struct kvf_tier *t, struct kvf_tier_event *out, uint32_t max, uint64_t *dropped);
/* The "ssd_*" STATS pairs, msgpack (inside a map the caller opened). */
void kvf_tier_stats_mw(struct kvf_tier *t, struct kvf_mw *w);

#endif
