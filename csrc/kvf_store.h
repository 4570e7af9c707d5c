/* kvf_store.h: the native server's arena, allocator and index.
 *
 * The arena is one memfd of `capacity` bytes mapped MAP_SHARED, so that the
 * same pages can be registered with io_uring and mapped by same-host (shm)
 * clients. Space is handed out in runs of 4 KiB pages by a segregated-fit
 * allocator with boundary tags (neighbouring free runs always merge).
 *
 * The index maps key -> entry {offset, size, checksum, pins, lease}. A pinned
 * entry (pins > 0: being sent, leased by an shm client; or lease_until in the
 * future: LOOKUP lease) is never evicted; deleting a pinned entry unindexes it
 * and frees its slot when the last pin drops.
 *
 * Python decides what to evict: the store records INSERT/ACCESS/REMOVE events
 * in a bounded ring that a control thread drains in batches into the
 * eviction policy, and asks for space (kvf_store_want_space) when an
 * allocation fails; the control thread then evicts keys by name.
 *
 * Locking: every function takes the store mutex itself. Returns: 0 or
 * -errno as documented per function.
 */
#ifndef KVF_STORE_H
#define KVF_STORE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define KVF_PAGE 4096u
#define KVF_KEY_MAX 64u

enum kvf_event_type { KVF_EV_INSERT = 1, KVF_EV_ACCESS = 2, KVF_EV_REMOVE = 3 };

/* One event per object, or per GROUP (issue 23): a group's objects are one
 * entry of the policy, named by the group's representative (its first part
 * stored), `key`; `size` is then the group's bytes and `group` its group key
 * (glen 0: not grouped), gparts the parts it stated. */
struct kvf_event {
    uint8_t type, klen, plen, glen;
    uint32_t gparts;
    uint64_t size;
    uint8_t key[KVF_KEY_MAX];
    uint8_t parent[KVF_KEY_MAX];
    uint8_t group[KVF_KEY_MAX];
};

/* Every figure is kept as it changes: kvf_store_stats is O(1). */
struct kvf_store_stats {
    uint64_t objects, bytes_used, capacity, free_bytes, evictions, checksum_failures, events_dropped;
    uint64_t pinned; /* indexed objects held by a send in progress or an shm lease (pins > 0; LOOKUP
                        leases, which expire by the clock, are not counted) */
    uint64_t groups, group_objects; /* groups indexed, and the objects that belong to one */
    uint64_t groups_incomplete;     /* of them, groups holding fewer objects than their parts (see commit_group) */
};

struct kvf_store;

/* Create the arena (memfd + mmap) and index. -EINVAL for a capacity below one
 * page, -ENOMEM / other -errno when the memory cannot be had. */
int kvf_store_new(struct kvf_store **out, uint64_t capacity, uint32_t event_ring);
void kvf_store_free(struct kvf_store *st);
/* Fault in the arena pages of [off, off + len) (clipped to the arena) without
 * changing their bytes, so that the data plane does not take a page fault per
 * 4 KiB on its first pass through the arena. Not a pin. 0, -EOPNOTSUPP (no
 * MADV_POPULATE_WRITE here) or -errno. */
int kvf_store_populate(struct kvf_store *st, uint64_t off, uint64_t len);
/* MADV_HUGEPAGE on the whole arena (before it is populated); 0 or -errno */
int kvf_store_advise_huge(struct kvf_store *st);
uint8_t *kvf_store_base(struct kvf_store *st);
int kvf_store_memfd(struct kvf_store *st);
uint64_t kvf_store_capacity(struct kvf_store *st);

/* Allocate a slot for `size` bytes. -EFBIG if it can never fit, -ENOSPC if
 * it does not fit now (the caller asks for space and retries). */
int kvf_store_reserve(struct kvf_store *st, uint64_t size, uint64_t *off);
void kvf_store_unreserve(struct kvf_store *st, uint64_t off, uint64_t size);
/* Index a reserved, filled slot. Returns 0 (stored) or 1 (key already held:
 * the slot is freed). Records an INSERT event. nsref (every commit): the
 * objects' namespace ref (kvf_ns_ref; 0 untagged): once its generation is
 * retired the objects are misses, unindexed by whatever looks them up. */
int kvf_store_commit(struct kvf_store *st, const uint8_t *key, uint32_t klen, uint64_t off, uint64_t size,
                     uint64_t csum, const uint8_t *parent, uint32_t plen, uint64_t nsref);
/* Index the n reserved, filled slots of ONE group (issue 23) as one unit, under one
 * lock; part k is entry idx[k] of the arrays: status[idx[k]] = 0 stored or 1 already held (that slot freed; an object is in at
 * most one group, so a held part stays in the group it has). The stored parts form
 * the group (gkey, gparts); one INSERT event names it by its first stored part, with
 * the parts' total size and the first part's parent (mapped to the parent's group's
 * representative when the parent is grouped). -ENOMEM: nothing indexed, every slot
 * freed. From then on the group's objects are evicted, deleted, dropped and counted
 * as pinned together (below). */
int kvf_store_commit_group(struct kvf_store *st, uint32_t n, const uint32_t *idx, const uint8_t *const *keys,
                           const uint8_t *klens,
                           const uint64_t *offs, const uint64_t *sizes, const uint64_t *csums,
                           const uint8_t *parent, uint32_t plen, const uint8_t *gkey, uint32_t glen,
                           uint32_t gparts, uint64_t nsref, uint8_t *status);
/* The same, for a slot the caller keeps sending from (a GET streamed while it is read from
 * the SSD tier): the stored entry is pinned at once (*id, kvf_store_release it), so no
 * eviction can take the slot in between; a held key (1) or ENOMEM leaves the slot
 * reserved, the caller's to unreserve. commit_group_pinned: ids[idx[k]] likewise, for the
 * parts stored (status 0); held parts' slots stay the caller's, and all of them on ENOMEM. */
int kvf_store_commit_pinned(struct kvf_store *st, const uint8_t *key, uint32_t klen, uint64_t off, uint64_t size,
                            uint64_t csum, uint64_t nsref, uint32_t *id);
int kvf_store_commit_group_pinned(struct kvf_store *st, uint32_t n, const uint32_t *idx, const uint8_t *const *keys,
                                  const uint8_t *klens, const uint64_t *offs, const uint64_t *sizes,
                                  const uint64_t *csums, const uint8_t *gkey, uint32_t glen, uint32_t gparts,
                                  uint64_t nsref, uint8_t *status, uint32_t *ids);
/* Pin an entry for reading. -ENOENT on a miss. Records an ACCESS event. */
int kvf_store_acquire(struct kvf_store *st, const uint8_t *key, uint32_t klen, uint32_t *id, uint64_t *off,
                      uint64_t *size, uint64_t *csum);
void kvf_store_release(struct kvf_store *st, uint32_t id);
/* Unindex a pinned entry whose bytes failed their checksum (counts it). */
void kvf_store_drop_corrupt(struct kvf_store *st, uint32_t id);
/* Copy the key of a pinned entry (live or dropped) into key; returns its length. */
uint32_t kvf_store_key(struct kvf_store *st, uint32_t id, uint8_t key[KVF_KEY_MAX]);
int kvf_store_exists(struct kvf_store *st, const uint8_t *key, uint32_t klen);
/* 1 held (lease extended to lease_until_ms when > 0, ACCESS recorded), 0 not. */
int kvf_store_lookup(struct kvf_store *st, const uint8_t *key, uint32_t klen, int64_t lease_until_ms);
/* Objects removed (a grouped object takes its whole group), 0 absent. Records REMOVE. */
int kvf_store_delete(struct kvf_store *st, const uint8_t *key, uint32_t klen);
/* Evict on the policy's word: bytes freed (whole pages, > 0), -ENOENT absent, -EBUSY pinned.
 * A grouped key evicts its whole group, and is pinned while any of its objects is. Records REMOVE
 * (the policy has forgotten the victim already; the KV events publish it). */
int64_t kvf_store_evict(struct kvf_store *st, const uint8_t *key, uint32_t klen);
int kvf_store_is_pinned(struct kvf_store *st, const uint8_t *key, uint32_t klen);
/* Copy up to `max` events out; returns how many. */
uint32_t kvf_store_drain(struct kvf_store *st, struct kvf_event *out, uint32_t max);
void kvf_store_stats(struct kvf_store *st, struct kvf_store_stats *s);
/* Every policy entry, for resynchronising the policy after dropped events:
 * calls fn(key, klen, size, arg) under the lock, once per ungrouped object and
 * once per group (its representative's key, the group's bytes). */
void kvf_store_each(struct kvf_store *st, void (*fn)(const uint8_t *, uint32_t, uint64_t, void *), void *arg);

/* Space requests between the data plane and the control thread. */
void kvf_store_want_space(struct kvf_store *st, uint64_t bytes);
/* Free space below which an allocation wakes the control thread. */
void kvf_store_set_low(struct kvf_store *st, uint64_t bytes);
/* Control thread: wait up to timeout_ms for events, a space request or free
 * space below the low watermark. Returns the bytes wanted (0 when none) and
 * sets *free_bytes and *dropped (events lost to a full ring, ever). */
uint64_t kvf_store_wait(struct kvf_store *st, int timeout_ms, uint64_t *free_bytes, uint64_t *dropped);
/* Control thread: an eviction round finished; exhausted=1 means nothing more
 * could be evicted. Returns the new round number. */
uint64_t kvf_store_space_done(struct kvf_store *st, int exhausted);
/* Data plane: round number and whether the last round was exhausted. */
uint64_t kvf_store_round(struct kvf_store *st, int *exhausted);
int64_t kvf_now_ms(void);

/* Called by kvf_store_evict with an evicted object's bytes, outside the store
 * lock (the slot is freed when it returns): the tiers' write-behind. hits:
 * GETs of the object since it was stored (of a group: its most read part's);
 * gkey/glen/gparts: its group (glen 0: none), every part of which is evicted
 * (and handed here) in the same call.
 * NULL fn: none. Set it while no eviction runs (before the control thread
 * starts, after it stopped). */
typedef void (*kvf_evict_hook)(void *arg, const uint8_t *key, uint32_t klen, const uint8_t *val, uint64_t size,
                               uint64_t csum, uint32_t hits, const uint8_t *gkey, uint32_t glen, uint32_t gparts,
                               uint64_t nsref);
void kvf_store_set_evict_hook(struct kvf_store *st, kvf_evict_hook fn, void *arg);

/* The namespace table (kvf_ns.h) whose generations decide which entries are stale;
 * set once before the store is used (NULL: none). The store does not own it. */
struct kvf_ns;
void kvf_store_set_ns(struct kvf_store *st, struct kvf_ns *ns);
struct kvf_ns *kvf_store_ns(struct kvf_store *st);
/* Control thread: look at up to max entries from where the last call stopped and
 * unindex those of a retired generation (a bounded sweep: retired objects free their
 * space without waiting for eviction). Returns the objects freed. */
uint32_t kvf_store_sweep(struct kvf_store *st, uint32_t max);

/* Allocator self-check for tests: 0 when free lists and tags agree. */
int kvf_store_check(struct kvf_store *st);

#endif
