/* kvf_tier_int.h: the tier object and the on-disk format, shared by its three
 * layers, top first: kvf_tier.c (open, rebuild, the loop-side interface),
 * kvf_tier_io.c (thread, queue, io_uring) and kvf_tier_index.c (index, record
 * format). Not part of the tier's interface (kvf_tier.h).
 *
 * On-disk format, version 1 (docs/notes/tier.md). Every integer little-endian
 * (the hosts this builds for). One file per path, DIR/kvfabric-tier.v1:
 *
 *   block 0             superblock (struct tier_super), 4096 bytes
 *   then nsegs segments of seg_size bytes each (a multiple of 4096)
 *
 * The segments of all files form one circular log: global segment g lives in
 * file g % nfiles at segment g / nfiles. Records are appended at the head;
 * a record never crosses a segment end; when the head enters a segment, every
 * index entry in it is dropped first (FIFO over segments). A record:
 *
 *   4096-byte header block: struct tier_rec (128 bytes), then zeros
 *   value, padded with zeros to a multiple of 4096 (absent for a tombstone)
 *
 * rec.hdr_csum = xxh3_64 of the 120 bytes before it, seeded with the file's
 * random id (superblock), so a value that happens to hold header-like bytes
 * or a record of an earlier file generation is never taken for a record.
 * rec.csum is the object's protocol v2 checksum (kvf_obj_hash), checked on
 * every read. The highest seq of a key wins at rebuild; a tombstone (flags
 * bit 0) with a higher seq removes the key.
 *
 * Groups (issue 23): a grouped object's header block carries struct tier_grp
 * at offset 128 (the group key and its part count, grp.csum = xxh3_64 of the
 * bytes before it seeded with rec.hdr_csum, so it belongs to this record);
 * all zeros there: not grouped (so files written before keep their meaning,
 * version 1 still). The index keeps a hash of each record's group key; the
 * start-up scan drops every group that has fewer records than parts, whole,
 * and the log dropping a segment drops the groups of its records whole too.
 */
#ifndef KVF_TIER_INT_H
#define KVF_TIER_INT_H

#include <pthread.h>
#include <stdint.h>

#include "kvf_ns.h"
#include "kvf_tier.h"
#include "kvf_uring.h"

#define TIER_MAGIC_SUPER "KVFTIER1"
#define TIER_MAGIC_REC "KVFTREC1"
#define TIER_F_TOMB 1u
#define TIER_NONE 0xffffffffu

struct tier_super {
    char magic[8];
    uint32_t version, file_index, nfiles, _pad;
    uint64_t file_id, seg_size, nsegs; /* nsegs: segments in this file */
    uint64_t csum;                     /* xxh3_64 of the bytes before it */
};

struct tier_rec {
    char magic[8];
    uint32_t version, flags;
    uint64_t file_id, seq, size, csum;
    uint32_t klen, _pad;
    uint8_t key[KVF_KEY_MAX];
    uint64_t hdr_csum;
};
_Static_assert(sizeof(struct tier_rec) == 128, "tier_rec is 128 bytes");

struct tier_grp {
    uint32_t glen, gparts;
    uint8_t gkey[KVF_KEY_MAX];
    uint64_t csum;
};
_Static_assert(sizeof(struct tier_grp) == 80, "tier_grp is 80 bytes");
#define TIER_GRP_OFF sizeof(struct tier_rec)
/* Namespace tags (issue 27): a tagged object's header block carries struct tier_ns after
 * tier_grp (its tag and the generation it was stored under; csum = xxh3_64 of the bytes
 * before it seeded with rec.hdr_csum); all zeros: untagged (files written before keep
 * their meaning, version 1 still). A record whose generation the server's retirements
 * file (kvf_ns.h) has retired is dropped at the start-up scan and read as a miss. */
struct tier_ns {
    uint8_t tag[KVF_NS_TAG_BYTES];
    uint32_t gen, used;
    uint64_t csum;
};
_Static_assert(sizeof(struct tier_ns) == 32, "tier_ns is 32 bytes");
#define TIER_NS_OFF (TIER_GRP_OFF + sizeof(struct tier_grp))
_Static_assert(sizeof(struct tier_super) == 56, "tier_super is 56 bytes");

enum { TE_FREE = 0, TE_LIVE = 1, TE_PENDING = 2, TE_TOMB = 3 /* rebuild only */ };

struct tent {
    uint8_t key[KVF_KEY_MAX];
    uint8_t klen, state;
    uint32_t next; /* hash chain or free list */
    uint64_t loc;  /* global log position: g * seg_size + offset in the segment */
    uint64_t size, csum, seq;
    uint64_t ghash;  /* its group: kvf_tier_ghash of the group key, 0 not grouped */
    uint32_t gparts; /* the parts the group stated */
    uint64_t nsref;  /* its namespace ref (kvf_ns.h), 0 untagged: a retired one is unindexed when found */
};

struct kvf_tier {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* files and geometry */
    uint32_t nfiles;
    int fds[KVF_TIER_MAX_PATHS];
    uint64_t file_id[KVF_TIER_MAX_PATHS];
    uint8_t fresh[KVF_TIER_MAX_PATHS]; /* initialised at this open: the start-up scan skips it */
    uint64_t seg_size, nsegs; /* nsegs: all files */
    uint64_t capacity;
    /* log head (tier thread, and rebuild before it starts) */
    uint64_t head_seg, head_off, next_seq;
    /* index */
    struct tent *ents;
    uint32_t nents, ents_cap, ent_free;
    uint32_t *buckets;
    uint32_t nbuckets;
    /* queues */
    struct kvf_tier_job *q_head, *q_tail;
    struct kvf_tier_job *done;
    struct kvf_tier_job *prog; /* streamed reads that progressed (prog_next), for the loop */
    int stop, started;
    pthread_t th;
    struct kvf_ring ring;
    uint8_t *scratch; /* KVF_TIER_BLOCK, aligned: read headers and tombstones (tier thread) */
    void (*wake)(void *);
    void *wake_arg;
    /* kick: a read posted while the tier thread waits on a batch's I/O (in_io) writes kick_fd, whose
     * READ the thread keeps armed on its ring, so the read is submitted at once, not after the batch */
    int kick_fd, kick_armed, in_io;
    uint64_t kick_val;
    /* shared tier */
    struct kvf_shared *sh; /* kvf_shared.h, or NULL */
    uint64_t sh_staged;    /* bytes of shared-read staging buffers alive (atomic): at most promote_max, over it a
                              shared read is a miss (the heap outside the arena stays bounded) */
    int sh_write_evicted;
    /* staging buffers of finished writes, kept for the next ones (KV blocks are mostly one
     * size): cached + queued bytes stay within write_queue */
    struct { uint8_t *p; uint64_t cap; } bcache[64];
    uint32_t nbc;
    uint64_t bc_bytes;
    struct kvf_ns *ns; /* namespace generations (the store's), or NULL */
    /* policy */
    int admit;
    uint64_t write_queue, promote_max;
    struct kvf_tier_stats st;
    /* SSD index events (kvf_tier_events_drain), a ring of ev_cap (0: none recorded) */
    struct kvf_tier_event *ev;
    uint32_t ev_cap, ev_head, ev_len;
    uint64_t ev_dropped;
};

static inline uint64_t tier_round(uint64_t n) { return (n + KVF_TIER_BLOCK - 1) & ~(uint64_t)(KVF_TIER_BLOCK - 1); }
static inline uint64_t tier_rec_len(uint64_t size) { return KVF_TIER_BLOCK + tier_round(size); }

/* kvf_tier_index.c (the bottom of the tier: calls neither file below), under t->mu */
uint32_t kvf_tier_ifind(struct kvf_tier *t, const uint8_t *key, uint32_t klen);
uint32_t kvf_tier_iadd(struct kvf_tier *t, const uint8_t *key, uint32_t klen); /* TIER_NONE: out of memory */
void kvf_tier_iremove(struct kvf_tier *t, uint32_t i);
/* Record an SSD index event for entry e (under t->mu; gkey: STORED of a group's object, else NULL). */
void kvf_tier_event(struct kvf_tier *t, int type, const struct tent *e, const uint8_t *gkey, uint32_t glen);
void kvf_tier_drop_segment(struct kvf_tier *t, uint64_t g); /* unindex every record in global segment g */
/* file and file offset of a global log position */
void kvf_tier_where(struct kvf_tier *t, uint64_t loc, int *fd, uint64_t *off);
/* fill h for a record of key (size, csum, seq, flags); hdr_csum computed */
void kvf_tier_rec_fill(struct kvf_tier *t, uint64_t loc, struct tier_rec *h, const uint8_t *key, uint32_t klen,
                       uint64_t size, uint64_t csum, uint64_t seq, uint32_t flags);
/* 0 when h is a valid record header for the file holding loc */
int kvf_tier_rec_check(struct kvf_tier *t, uint64_t loc, const struct tier_rec *h);
/* The group part of a header block whose tier_rec is filled (glen 0: none written) */
void kvf_tier_grp_fill(uint8_t *block, const uint8_t *gkey, uint32_t glen, uint32_t gparts);
/* Read it back from a checked header block: 0 (glen 0: not grouped) or -EBADMSG */
int kvf_tier_grp_get(const uint8_t *block, uint8_t gkey[KVF_KEY_MAX], uint32_t *glen, uint32_t *gparts);
/* The namespace part of a header block whose tier_rec is filled (nsref 0: none written) */
void kvf_tier_ns_fill(struct kvf_tier *t, uint8_t *block, uint64_t nsref);
/* Read it back from a checked header block: 0 (*nsref set, 0 untagged), 1 its generation is
 * retired, -EBADMSG torn, -ENOSPC the tag table is full */
int kvf_tier_ns_get(struct kvf_tier *t, const uint8_t *block, uint64_t *nsref);
/* The index's hash of a group key (never 0) */
uint64_t kvf_tier_ghash(const uint8_t *gkey, uint32_t glen);
/* Unindex every group with fewer live records than its parts (the start-up scan); returns how many */
uint64_t kvf_tier_drop_torn_groups(struct kvf_tier *t);

/* kvf_tier_io.c */
int kvf_tier_thread_start(struct kvf_tier *t);
void kvf_tier_thread_stop(struct kvf_tier *t);
uint64_t kvf_tier_now_ns(void);
/* An aligned staging buffer of cap bytes (a cached one of that size, else new), or NULL. Any thread. */
uint8_t *kvf_tier_buf_get(struct kvf_tier *t, uint64_t cap);
/* Give a staging buffer back: cached while queue + cache stay within write_queue, else freed. */
void kvf_tier_buf_put(struct kvf_tier *t, uint8_t *b, uint64_t cap);
/* Fill j as a write of key's staged record (buf: header block + value, rec bytes) and post it. No return. */
void kvf_tier_post_write(struct kvf_tier *t, struct kvf_tier_job *j, int op, const uint8_t *key, uint32_t klen,
                         uint64_t size, uint64_t csum, uint8_t *buf, uint64_t rec);
void kvf_tier_buf_drain(struct kvf_tier *t);

#endif
