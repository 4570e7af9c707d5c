/* kvf_store.c: arena, index and event ring (see kvf_store.h); the arena's
 * pages are handed out by kvf_pages.c (segregated fit, boundary tags).
 *
 * Index: chained hash table of entry indices; entries live in a growable
 * array and are recycled through a free list.
 *
 * Groups (issue 23): a grouped entry names its group record (grp) and the next
 * member of the group's ring (gnext). The group record keeps the group key, the
 * parts it stated, its members, bytes and representative (rep: the first member
 * stored, which names the group to the policy and in every event). A group is
 * indexed whole (kvf_store_commit_group) and leaves whole: evicted (refused while
 * any member is pinned), deleted or dropped through any member.
 */
#define _GNU_SOURCE
#include "kvf_store.h"
#include "kvf_pages.h"
#include "kvf_ns.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

#define NONE 0xffffffffu

enum { E_FREE = 0, E_LIVE = 1, E_DEAD = 2 };

struct entry {
    uint8_t key[KVF_KEY_MAX];
    uint8_t klen, state;
    uint32_t pins;
    uint32_t hits; /* GETs since stored (the tier's --ssd-admit hit) */
    uint32_t next; /* hash chain or free list */
    uint32_t grp;  /* group record, NONE when not grouped */
    uint32_t gnext; /* next member of the group (a ring) */
    uint64_t off, size, csum;
    uint64_t nsref; /* its namespace tag's slot and generation when stored (kvf_ns.h), 0 untagged */
    int64_t lease_until_ms;
};

struct group {
    uint8_t key[KVF_KEY_MAX];
    uint8_t klen;
    uint32_t parts, members, rep, next_free;
    uint64_t bytes;
};

struct kvf_store {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int memfd;
    uint8_t *base;
    uint64_t capacity;
    struct kvf_pages pages;
    struct entry *ents;
    uint32_t nents, ents_cap, ent_free;
    uint32_t *buckets;
    uint32_t nbuckets; /* power of two */
    uint64_t objects, bytes_used, evictions, checksum_failures, events_dropped;
    uint64_t pinned; /* indexed entries with pins > 0, kept as pins change (STATS is O(1)) */
    struct group *grps;
    uint32_t ngrps, grps_cap, grp_free;
    uint64_t groups, group_objects, groups_incomplete;
    struct kvf_event *ring;
    uint32_t ring_cap, ring_head, ring_len;
    uint64_t want_bytes, round, low_bytes;
    int exhausted, low_signaled;
    kvf_evict_hook evict_hook;
    void *evict_arg;
    uint32_t sweep_at; /* kvf_store_sweep's cursor */
    struct kvf_ns *ns; /* namespace generations (NULL: none): a stale entry is a miss, freed when found */
};

int64_t kvf_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---------------------------------------------------------------- index */

static inline uint32_t pages_for(uint64_t size) { return size ? (uint32_t)((size + KVF_PAGE - 1) / KVF_PAGE) : 1; }

static inline uint32_t bucket(struct kvf_store *st, const uint8_t *key, uint32_t klen)
{
    return (uint32_t)XXH3_64bits(key, klen) & (st->nbuckets - 1);
}

static void drop_stale(struct kvf_store *st, uint32_t id);

/* The live entry of key, or NONE. An entry of a retired namespace generation (issue 27)
 * is unindexed here (its whole group; freed now, or on its last pin's release) and
 * counted freed: every caller sees a miss, and the policy a REMOVE. */
static uint32_t find(struct kvf_store *st, const uint8_t *key, uint32_t klen)
{
    for (uint32_t i = st->buckets[bucket(st, key, klen)]; i != NONE; i = st->ents[i].next) {
        struct entry *e = &st->ents[i];
        if (e->klen == klen && memcmp(e->key, key, klen) == 0) {
            if (e->nsref && st->ns && kvf_ns_stale(st->ns, e->nsref)) {
                drop_stale(st, i);
                return NONE;
            }
            return i;
        }
    }
    return NONE;
}

static int grow_buckets(struct kvf_store *st)
{
    uint32_t nb = st->nbuckets * 2;
    uint32_t *b = malloc(sizeof(uint32_t) * nb);
    if (!b) return -ENOMEM;
    memset(b, 0xff, sizeof(uint32_t) * nb);
    free(st->buckets);
    st->buckets = b;
    st->nbuckets = nb;
    for (uint32_t i = 0; i < st->nents; i++) {
        struct entry *e = &st->ents[i];
        if (e->state != E_LIVE) continue;
        uint32_t h = bucket(st, e->key, e->klen);
        e->next = b[h];
        b[h] = i;
    }
    return 0;
}

static uint32_t new_entry(struct kvf_store *st)
{
    if (st->ent_free != NONE) {
        uint32_t i = st->ent_free;
        st->ent_free = st->ents[i].next;
        return i;
    }
    if (st->nents == st->ents_cap) {
        uint32_t cap = st->ents_cap ? st->ents_cap * 2 : 1024;
        struct entry *e = realloc(st->ents, sizeof(struct entry) * cap);
        if (!e) return NONE;
        st->ents = e;
        st->ents_cap = cap;
    }
    return st->nents++;
}

static void unlink_entry(struct kvf_store *st, uint32_t id)
{
    struct entry *e = &st->ents[id];
    uint32_t *pp = &st->buckets[bucket(st, e->key, e->klen)];
    while (*pp != id) pp = &st->ents[*pp].next;
    *pp = e->next;
    st->objects--;
    st->bytes_used -= e->size;
    if (e->pins) st->pinned--; /* a DEAD entry's pins are no longer an indexed object's */
}

static void release_entry(struct kvf_store *st, uint32_t id)
{
    struct entry *e = &st->ents[id];
    kvf_pages_free(&st->pages, (uint32_t)(e->off / KVF_PAGE), pages_for(e->size));
    e->state = E_FREE;
    e->next = st->ent_free;
    st->ent_free = id;
}

/* Unindex; free now unless pinned (then on last release). */
static void remove_entry(struct kvf_store *st, uint32_t id)
{
    unlink_entry(st, id);
    if (st->ents[id].pins) st->ents[id].state = E_DEAD;
    else release_entry(st, id);
}

static inline int pinned(struct entry *e, int64_t now)
{
    return e->pins > 0 || e->lease_until_ms > now;
}

/* ---------------------------------------------------------------- groups */

static inline struct group *group_of(struct kvf_store *st, uint32_t id)
{
    return st->ents[id].grp == NONE ? NULL : &st->grps[st->ents[id].grp];
}

/* The entry that names id's policy entry: its group's representative, or itself. */
static inline struct entry *rep_of(struct kvf_store *st, uint32_t id)
{
    struct group *g = group_of(st, id);
    return &st->ents[g ? g->rep : id];
}

/* Pinned: the entry, or any member of its group. */
static int unit_pinned(struct kvf_store *st, uint32_t id, int64_t now)
{
    if (st->ents[id].grp == NONE) return pinned(&st->ents[id], now);
    uint32_t i = id;
    do {
        if (pinned(&st->ents[i], now)) return 1;
        i = st->ents[i].gnext;
    } while (i != id);
    return 0;
}

static void group_free(struct kvf_store *st, uint32_t gi)
{
    struct group *g = &st->grps[gi];
    st->groups--;
    st->group_objects -= g->members;
    if (g->members < g->parts) st->groups_incomplete--;
    g->members = 0;
    g->next_free = st->grp_free;
    st->grp_free = gi;
}

/* Unindex every member of id's group but `keep` (which the caller handles; NONE: none)
 * and free the group record; members still pinned are freed on their last release. */
static void remove_group_but(struct kvf_store *st, uint32_t id, uint32_t keep)
{
    uint32_t gi = st->ents[id].grp, i = id;
    do {
        uint32_t nx = st->ents[i].gnext;
        st->ents[i].grp = NONE;
        if (i != keep) remove_entry(st, i);
        i = nx;
    } while (i != id);
    group_free(st, gi);
}

/* ---------------------------------------------------------------- events */

static void event(struct kvf_store *st, int type, const uint8_t *key, uint32_t klen, uint64_t size,
                  const uint8_t *parent, uint32_t plen, const struct group *g);

/* Unindex id (a stale entry: its namespace generation was retired) and its group, as a
 * DELETE would, and count the objects freed. Lock held. */
static void drop_stale(struct kvf_store *st, uint32_t id)
{
    struct group *g = id < st->nents && st->ents[id].grp != NONE ? &st->grps[st->ents[id].grp] : NULL;
    uint32_t rep = g ? g->rep : id;
    event(st, KVF_EV_REMOVE, st->ents[rep].key, st->ents[rep].klen, 0, NULL, 0, g);
    kvf_ns_count_freed(st->ns, g ? g->members : 1);
    if (g) remove_group_but(st, id, NONE);
    else remove_entry(st, id);
}

static void event(struct kvf_store *st, int type, const uint8_t *key, uint32_t klen, uint64_t size,
                  const uint8_t *parent, uint32_t plen, const struct group *g)
{
    if (type == KVF_EV_ACCESS && g && st->ring_len) {
        /* the parts of one group read one after another (a GET of a chunk) are one access of it */
        const struct kvf_event *last = &st->ring[(st->ring_head + st->ring_len - 1) % st->ring_cap];
        if (last->type == KVF_EV_ACCESS && last->klen == klen && !memcmp(last->key, key, klen)) return;
    }
    if (st->ring_len == st->ring_cap) {
        st->events_dropped++;
        pthread_cond_signal(&st->cv);
        return;
    }
    struct kvf_event *ev = &st->ring[(st->ring_head + st->ring_len) % st->ring_cap];
    st->ring_len++;
    ev->type = (uint8_t)type;
    ev->klen = (uint8_t)klen;
    ev->plen = (uint8_t)(parent ? plen : 0);
    ev->size = size;
    memcpy(ev->key, key, klen);
    if (parent && plen) memcpy(ev->parent, parent, plen);
    ev->glen = g ? g->klen : 0;
    ev->gparts = g ? g->parts : 0;
    if (g) memcpy(ev->group, g->key, g->klen);
    if (st->ring_len * 2 >= st->ring_cap) pthread_cond_signal(&st->cv);
}

/* ---------------------------------------------------------------- API */

int kvf_store_new(struct kvf_store **out, uint64_t capacity, uint32_t event_ring)
{
    if (capacity < KVF_PAGE || capacity / KVF_PAGE >= NONE || event_ring == 0) return -EINVAL;
    struct kvf_store *st = calloc(1, sizeof *st);
    if (!st) return -ENOMEM;
    st->memfd = -1;
    int rc = -ENOMEM;
    st->capacity = (capacity / KVF_PAGE) * KVF_PAGE;
    /* Sealed against shrink and grow once sized: shm clients get this fd, and a
     * client's ftruncate(fd, 0) would otherwise SIGBUS the server on its next
     * access. F_SEAL_SEAL: nobody can lift or add seals afterwards. (Writes stay
     * allowed: attached clients copy PUT objects in; see docs/notes/security.md.) */
    st->memfd = memfd_create("kvfabric-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (st->memfd < 0) { rc = -errno; goto fail; }
    if (ftruncate(st->memfd, (off_t)st->capacity)) { rc = -errno; goto fail; }
    if (fcntl(st->memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) { rc = -errno; goto fail; }
    st->base = mmap(NULL, st->capacity, PROT_READ | PROT_WRITE, MAP_SHARED, st->memfd, 0);
    if (st->base == MAP_FAILED) { st->base = NULL; rc = -errno; goto fail; }
    if ((rc = kvf_pages_init(&st->pages, (uint32_t)(capacity / KVF_PAGE)))) goto fail;
    rc = -ENOMEM;
    st->nbuckets = 1024;
    st->buckets = malloc(st->nbuckets * sizeof(uint32_t));
    st->ring_cap = event_ring;
    st->ring = malloc(sizeof(struct kvf_event) * event_ring);
    if (!st->buckets || !st->ring) goto fail;
    memset(st->buckets, 0xff, st->nbuckets * sizeof(uint32_t));
    st->ent_free = NONE;
    st->grp_free = NONE;
    pthread_mutex_init(&st->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&st->cv, &ca);
    pthread_condattr_destroy(&ca);
    *out = st;
    return 0;
fail:
    st->capacity = st->base ? st->capacity : 0;
    kvf_store_free(st);
    return rc;
}

void kvf_store_free(struct kvf_store *st)
{
    if (!st) return;
    if (st->base) munmap(st->base, st->capacity);
    if (st->memfd >= 0) close(st->memfd);
    kvf_pages_destroy(&st->pages);
    free(st->buckets); free(st->ents); free(st->ring); free(st->grps);
    free(st);
}

int kvf_store_advise_huge(struct kvf_store *st)
{
#ifdef MADV_HUGEPAGE
    /* Advice: the kernel backs the arena with 2 MiB pages only where the host
     * allows transparent huge pages for shared memory (shmem_enabled advise,
     * within_size, always); at the usual "never" nothing changes. */
    return madvise(st->base, st->capacity, MADV_HUGEPAGE) ? -errno : 0;
#else
    (void)st;
    return -EOPNOTSUPP;
#endif
}

int kvf_store_populate(struct kvf_store *st, uint64_t off, uint64_t len)
{
#ifdef MADV_POPULATE_WRITE
    if (off >= st->capacity) return 0;
    if (len > st->capacity - off) len = st->capacity - off;
    /* faults the pages in writable without writing them: safe while the
     * data plane fills slots in the same range */
    return madvise(st->base + off, len, MADV_POPULATE_WRITE) ? -errno : 0;
#else
    (void)st; (void)off; (void)len;
    return -EOPNOTSUPP;
#endif
}

uint8_t *kvf_store_base(struct kvf_store *st) { return st->base; }
int kvf_store_memfd(struct kvf_store *st) { return st->memfd; }
uint64_t kvf_store_capacity(struct kvf_store *st) { return st->capacity; }

int kvf_store_reserve(struct kvf_store *st, uint64_t size, uint64_t *off)
{
    if (size > st->capacity) return -EFBIG;
    uint32_t n = pages_for(size);
    pthread_mutex_lock(&st->mu);
    uint32_t p = kvf_pages_alloc(&st->pages, n);
    if (p != NONE && (uint64_t)st->pages.free * KVF_PAGE < st->low_bytes && !st->low_signaled) {
        st->low_signaled = 1;
        pthread_cond_signal(&st->cv);
    }
    pthread_mutex_unlock(&st->mu);
    if (p == NONE) return -ENOSPC;
    *off = (uint64_t)p * KVF_PAGE;
    return 0;
}

void kvf_store_unreserve(struct kvf_store *st, uint64_t off, uint64_t size)
{
    pthread_mutex_lock(&st->mu);
    kvf_pages_free(&st->pages, (uint32_t)(off / KVF_PAGE), pages_for(size));
    pthread_mutex_unlock(&st->mu);
}

/* Fill entry id (from new_entry) as a live object of group grp (NONE: none) and link it in. */
static void index_entry(struct kvf_store *st, uint32_t id, const uint8_t *key, uint32_t klen, uint64_t off,
                        uint64_t size, uint64_t csum, uint32_t grp, uint64_t nsref)
{
    struct entry *e = &st->ents[id];
    e->nsref = nsref;
    memcpy(e->key, key, klen);
    e->klen = (uint8_t)klen;
    e->state = E_LIVE;
    e->pins = 0;
    e->hits = 0;
    e->off = off;
    e->size = size;
    e->csum = csum;
    e->lease_until_ms = 0;
    e->grp = grp;
    e->gnext = id;
    uint32_t h = bucket(st, key, klen);
    e->next = st->buckets[h];
    st->buckets[h] = id;
    st->objects++;
    st->bytes_used += size;
}

/* pins NULL: a held key's slot is freed (kvf_store_commit); else the stored entry is pinned
 * (*pins = its id) and a held key's slot, or every slot on ENOMEM, stays the caller's. */
static int commit_one(struct kvf_store *st, const uint8_t *key, uint32_t klen, uint64_t off, uint64_t size,
                      uint64_t csum, const uint8_t *parent, uint32_t plen, uint64_t nsref, uint32_t *pins)
{
    if (klen == 0 || klen > KVF_KEY_MAX) return -EINVAL;
    pthread_mutex_lock(&st->mu);
    if (find(st, key, klen) != NONE) {
        if (!pins) kvf_pages_free(&st->pages, (uint32_t)(off / KVF_PAGE), pages_for(size));
        pthread_mutex_unlock(&st->mu);
        return 1;
    }
    if (st->objects >= st->nbuckets && grow_buckets(st)) { /* keep chains long rather than fail */ }
    uint32_t id = new_entry(st);
    if (id == NONE) {
        if (!pins) kvf_pages_free(&st->pages, (uint32_t)(off / KVF_PAGE), pages_for(size));
        pthread_mutex_unlock(&st->mu);
        return -ENOMEM;
    }
    index_entry(st, id, key, klen, off, size, csum, NONE, nsref);
    if (pins) { /* pinned for the GET that read it (a hit, as kvf_store_acquire counts one) */
        st->ents[id].pins = 1;
        st->ents[id].hits = 1;
        st->pinned++;
        *pins = id;
    }
    event(st, KVF_EV_INSERT, key, klen, size, parent, plen, NULL);
    pthread_mutex_unlock(&st->mu);
    return 0;
}

int kvf_store_commit(struct kvf_store *st, const uint8_t *key, uint32_t klen, uint64_t off, uint64_t size,
                     uint64_t csum, const uint8_t *parent, uint32_t plen, uint64_t nsref)
{
    return commit_one(st, key, klen, off, size, csum, parent, plen, nsref, NULL);
}

int kvf_store_commit_pinned(struct kvf_store *st, const uint8_t *key, uint32_t klen, uint64_t off, uint64_t size,
                            uint64_t csum, uint64_t nsref, uint32_t *id)
{
    return commit_one(st, key, klen, off, size, csum, NULL, 0, nsref, id);
}

/* Room for `n` more entries and one group record, so that nothing fails halfway. */
static int ensure_room(struct kvf_store *st, uint32_t n)
{
    uint32_t spare = st->ents_cap - st->nents;
    for (uint32_t i = st->ent_free; i != NONE && spare < n; i = st->ents[i].next) spare++;
    if (spare < n) {
        uint32_t cap = st->ents_cap ? st->ents_cap : 1024;
        while (cap - st->nents < n) cap *= 2;
        struct entry *e = realloc(st->ents, sizeof(struct entry) * cap);
        if (!e) return -ENOMEM;
        st->ents = e;
        st->ents_cap = cap;
    }
    if (st->grp_free == NONE && st->ngrps == st->grps_cap) {
        uint32_t cap = st->grps_cap ? st->grps_cap * 2 : 256;
        struct group *g = realloc(st->grps, sizeof(struct group) * cap);
        if (!g) return -ENOMEM;
        st->grps = g;
        st->grps_cap = cap;
    }
    return 0;
}

static int commit_group(struct kvf_store *st, uint32_t n, const uint32_t *idx, const uint8_t *const *keys,
                        const uint8_t *klens, const uint64_t *offs, const uint64_t *sizes, const uint64_t *csums,
                        const uint8_t *parent, uint32_t plen, const uint8_t *gkey, uint32_t glen, uint32_t gparts,
                        uint64_t nsref, uint8_t *status, uint32_t *pins)
{
    if (n == 0 || glen == 0 || glen > KVF_KEY_MAX || gparts == 0) return -EINVAL;
    pthread_mutex_lock(&st->mu);
    if (ensure_room(st, n)) {
        for (uint32_t k = 0; k < n && !pins; k++)
            kvf_pages_free(&st->pages, (uint32_t)(offs[idx[k]] / KVF_PAGE), pages_for(sizes[idx[k]]));
        pthread_mutex_unlock(&st->mu);
        return -ENOMEM;
    }
    uint32_t gi = NONE, first = NONE, prev = NONE;
    for (uint32_t kk = 0; kk < n; kk++) {
        uint32_t k = idx[kk];
        if (klens[k] == 0 || klens[k] > KVF_KEY_MAX || find(st, keys[k], klens[k]) != NONE) {
            if (!pins) kvf_pages_free(&st->pages, (uint32_t)(offs[k] / KVF_PAGE), pages_for(sizes[k]));
            status[k] = 1;
            continue;
        }
        if (gi == NONE) {
            if (st->grp_free != NONE) { gi = st->grp_free; st->grp_free = st->grps[gi].next_free; }
            else gi = st->ngrps++;
            struct group *g = &st->grps[gi];
            memcpy(g->key, gkey, glen);
            g->klen = (uint8_t)glen;
            g->parts = gparts;
            g->members = 0;
            g->bytes = 0;
            g->next_free = NONE;
            st->groups++;
        }
        if (st->objects >= st->nbuckets && grow_buckets(st)) { /* keep chains long rather than fail */ }
        uint32_t id = new_entry(st); /* cannot fail: ensure_room */
        index_entry(st, id, keys[k], klens[k], offs[k], sizes[k], csums[k], gi, nsref);
        st->ents[id].gnext = first == NONE ? id : first; /* the ring: first -> ... -> id -> first */
        if (prev != NONE) st->ents[prev].gnext = id;
        if (first == NONE) first = id;
        prev = id;
        st->grps[gi].members++;
        st->grps[gi].bytes += sizes[k];
        st->group_objects++;
        status[k] = 0;
        if (pins) {
            st->ents[id].pins = 1;
            st->ents[id].hits = 1;
            st->pinned++;
            pins[k] = id;
        }
    }
    if (gi != NONE) {
        struct group *g = &st->grps[gi];
        g->rep = first;
        if (g->members < g->parts) st->groups_incomplete++;
        /* the parent as the policy knows it: its group's representative when it is grouped */
        uint32_t pi = parent && plen ? find(st, parent, plen) : NONE;
        struct entry *pe = pi != NONE ? rep_of(st, pi) : NULL;
        struct entry *r = &st->ents[first];
        event(st, KVF_EV_INSERT, r->key, r->klen, g->bytes, pe ? pe->key : parent, pe ? pe->klen : plen, g);
    }
    pthread_mutex_unlock(&st->mu);
    return 0;
}

int kvf_store_commit_group(struct kvf_store *st, uint32_t n, const uint32_t *idx, const uint8_t *const *keys,
                           const uint8_t *klens,
                           const uint64_t *offs, const uint64_t *sizes, const uint64_t *csums,
                           const uint8_t *parent, uint32_t plen, const uint8_t *gkey, uint32_t glen,
                           uint32_t gparts, uint64_t nsref, uint8_t *status)
{
    return commit_group(st, n, idx, keys, klens, offs, sizes, csums, parent, plen, gkey, glen, gparts, nsref, status,
                        NULL);
}

int kvf_store_commit_group_pinned(struct kvf_store *st, uint32_t n, const uint32_t *idx, const uint8_t *const *keys,
                                  const uint8_t *klens, const uint64_t *offs, const uint64_t *sizes,
                                  const uint64_t *csums, const uint8_t *gkey, uint32_t glen, uint32_t gparts,
                                  uint64_t nsref, uint8_t *status, uint32_t *ids)
{
    return commit_group(st, n, idx, keys, klens, offs, sizes, csums, NULL, 0, gkey, glen, gparts, nsref, status, ids);
}

int kvf_store_acquire(struct kvf_store *st, const uint8_t *key, uint32_t klen, uint32_t *id, uint64_t *off,
                      uint64_t *size, uint64_t *csum)
{
    pthread_mutex_lock(&st->mu);
    uint32_t i = find(st, key, klen);
    if (i == NONE) { pthread_mutex_unlock(&st->mu); return -ENOENT; }
    struct entry *e = &st->ents[i];
    if (e->pins++ == 0) st->pinned++;
    if (e->hits != UINT32_MAX) e->hits++;
    *id = i; *off = e->off; *size = e->size; *csum = e->csum;
    struct entry *r = rep_of(st, i);
    event(st, KVF_EV_ACCESS, r->key, r->klen, 0, NULL, 0, group_of(st, i));
    pthread_mutex_unlock(&st->mu);
    return 0;
}

void kvf_store_release(struct kvf_store *st, uint32_t id)
{
    pthread_mutex_lock(&st->mu);
    struct entry *e = &st->ents[id];
    if (e->pins && --e->pins == 0 && e->state == E_LIVE) st->pinned--;
    if (e->pins == 0 && e->state == E_DEAD) release_entry(st, id);
    pthread_mutex_unlock(&st->mu);
}

void kvf_store_drop_corrupt(struct kvf_store *st, uint32_t id)
{
    pthread_mutex_lock(&st->mu);
    struct entry *e = &st->ents[id];
    if (e->state == E_LIVE) {
        st->checksum_failures++;
        struct entry *r = rep_of(st, id);
        event(st, KVF_EV_REMOVE, r->key, r->klen, 0, NULL, 0, group_of(st, id));
        if (e->grp != NONE) remove_group_but(st, id, id); /* a group with a corrupt part is dropped whole */
        unlink_entry(st, id);
        e->state = E_DEAD; /* the caller holds a pin; freed on release */
    }
    pthread_mutex_unlock(&st->mu);
}

uint32_t kvf_store_key(struct kvf_store *st, uint32_t id, uint8_t key[KVF_KEY_MAX])
{
    pthread_mutex_lock(&st->mu);
    struct entry *e = &st->ents[id];
    uint32_t klen = e->klen;
    memcpy(key, e->key, klen);
    pthread_mutex_unlock(&st->mu);
    return klen;
}

int kvf_store_exists(struct kvf_store *st, const uint8_t *key, uint32_t klen)
{
    pthread_mutex_lock(&st->mu);
    int r = find(st, key, klen) != NONE;
    pthread_mutex_unlock(&st->mu);
    return r;
}

int kvf_store_lookup(struct kvf_store *st, const uint8_t *key, uint32_t klen, int64_t lease_until_ms)
{
    pthread_mutex_lock(&st->mu);
    uint32_t i = find(st, key, klen);
    if (i != NONE) {
        struct entry *e = &st->ents[i];
        if (lease_until_ms > e->lease_until_ms) e->lease_until_ms = lease_until_ms; /* pins its group too */
        struct entry *r = rep_of(st, i);
        event(st, KVF_EV_ACCESS, r->key, r->klen, 0, NULL, 0, group_of(st, i));
    }
    pthread_mutex_unlock(&st->mu);
    return i != NONE;
}

int kvf_store_delete(struct kvf_store *st, const uint8_t *key, uint32_t klen)
{
    pthread_mutex_lock(&st->mu);
    uint32_t i = find(st, key, klen);
    int n = 0;
    if (i != NONE) {
        struct group *g = group_of(st, i);
        struct entry *r = rep_of(st, i);
        event(st, KVF_EV_REMOVE, r->key, r->klen, 0, NULL, 0, g);
        n = g ? (int)g->members : 1;
        if (g) remove_group_but(st, i, NONE);
        else remove_entry(st, i);
    }
    pthread_mutex_unlock(&st->mu);
    return n;
}

static int64_t evict_group(struct kvf_store *st, uint32_t id);

/* The REMOVE event of an eviction (lock held): the policy, which chose the victim, has forgotten it
 * already and skips it; the server's KV events (--kv-events) publish it. */
static void evicted_event(struct kvf_store *st, uint32_t id)
{
    const struct entry *r = rep_of(st, id);
    event(st, KVF_EV_REMOVE, r->key, r->klen, 0, NULL, 0, group_of(st, id));
}

int64_t kvf_store_evict(struct kvf_store *st, const uint8_t *key, uint32_t klen)
{
    pthread_mutex_lock(&st->mu);
    uint32_t i = find(st, key, klen);
    int64_t rc;
    if (i == NONE) rc = -ENOENT;
    else if (unit_pinned(st, i, kvf_now_ms())) rc = -EBUSY;
    else {
        evicted_event(st, i);
        if (st->ents[i].grp != NONE) rc = evict_group(st, i);
        else if (st->evict_hook) {
            /* unindexed now, its slot kept (DEAD, one pin) while the hook copies it out */
            struct entry *e = &st->ents[i];
            rc = (int64_t)pages_for(e->size) * KVF_PAGE;
            unlink_entry(st, i);
            e->state = E_DEAD;
            e->pins = 1;
            st->evictions++;
            kvf_evict_hook fn = st->evict_hook;
            void *arg = st->evict_arg;
            uint8_t key2[KVF_KEY_MAX]; /* copies: the entry array may be reallocated while unlocked */
            uint32_t klen2 = e->klen, hits = e->hits;
            uint64_t off = e->off, size = e->size, csum = e->csum, nsref = e->nsref;
            memcpy(key2, e->key, klen2);
            pthread_mutex_unlock(&st->mu);
            fn(arg, key2, klen2, st->base + off, size, csum, hits, NULL, 0, 0, nsref);
            pthread_mutex_lock(&st->mu);
            e = &st->ents[i]; /* the array may have grown meanwhile */
            e->pins = 0;
            release_entry(st, i);
        } else {
            rc = (int64_t)pages_for(st->ents[i].size) * KVF_PAGE;
            remove_entry(st, i);
            st->evictions++;
        }
    }
    pthread_mutex_unlock(&st->mu);
    return rc;
}

/* Evict id's whole group (none of it pinned; lock held, and held again on return).
 * With a hook every member is unindexed first (DEAD, one pin), then copied out
 * unlocked one by one, then released. Returns the bytes freed (whole pages). */
static int64_t evict_group(struct kvf_store *st, uint32_t id)
{
    uint32_t gi = st->ents[id].grp, n = st->grps[gi].members;
    int64_t freed = 0;
    uint32_t *ids = st->evict_hook ? malloc(sizeof *ids * n) : NULL;
    uint32_t k = 0, i = id;
    do {
        struct entry *e = &st->ents[i];
        uint32_t nx = e->gnext;
        freed += (int64_t)pages_for(e->size) * KVF_PAGE;
        st->evictions++;
        if (ids) {
            unlink_entry(st, i);
            e->state = E_DEAD;
            e->pins = 1;
            ids[k++] = i;
        } else {
            e->grp = NONE;
            remove_entry(st, i);
        }
        i = nx;
    } while (i != id);
    if (!ids) { /* no hook, or no memory for the list: evicted without write-behind */
        group_free(st, gi);
        return freed;
    }
    kvf_evict_hook fn = st->evict_hook;
    void *arg = st->evict_arg;
    uint8_t gkey[KVF_KEY_MAX]; /* a copy: the group array may be reallocated while unlocked */
    uint32_t glen = st->grps[gi].klen, gparts = st->grps[gi].parts, hits = 0;
    memcpy(gkey, st->grps[gi].key, glen);
    for (k = 0; k < n; k++) /* the group's GETs: --ssd-admit hit takes or skips its parts together */
        if (st->ents[ids[k]].hits > hits) hits = st->ents[ids[k]].hits;
    for (k = 0; k < n; k++) {
        struct entry *e = &st->ents[ids[k]];
        uint8_t key2[KVF_KEY_MAX]; /* copies: the entry array may be reallocated while unlocked */
        uint32_t klen2 = e->klen;
        uint64_t off = e->off, size = e->size, csum = e->csum, nsref = e->nsref;
        memcpy(key2, e->key, klen2);
        pthread_mutex_unlock(&st->mu);
        fn(arg, key2, klen2, st->base + off, size, csum, hits, gkey, glen, gparts, nsref);
        pthread_mutex_lock(&st->mu);
    }
    for (k = 0; k < n; k++) {
        struct entry *e = &st->ents[ids[k]];
        e->grp = NONE;
        e->pins = 0;
        release_entry(st, ids[k]);
    }
    group_free(st, gi);
    free(ids);
    return freed;
}

int kvf_store_is_pinned(struct kvf_store *st, const uint8_t *key, uint32_t klen)
{
    pthread_mutex_lock(&st->mu);
    uint32_t i = find(st, key, klen);
    int r = i != NONE && unit_pinned(st, i, kvf_now_ms());
    pthread_mutex_unlock(&st->mu);
    return r;
}

uint32_t kvf_store_drain(struct kvf_store *st, struct kvf_event *out, uint32_t max)
{
    pthread_mutex_lock(&st->mu);
    uint32_t n = st->ring_len < max ? st->ring_len : max;
    for (uint32_t k = 0; k < n; k++) out[k] = st->ring[(st->ring_head + k) % st->ring_cap];
    st->ring_head = (st->ring_head + n) % st->ring_cap;
    st->ring_len -= n;
    pthread_mutex_unlock(&st->mu);
    return n;
}

void kvf_store_stats(struct kvf_store *st, struct kvf_store_stats *s)
{
    pthread_mutex_lock(&st->mu);
    s->objects = st->objects;
    s->bytes_used = st->bytes_used;
    s->capacity = st->capacity;
    s->free_bytes = (uint64_t)st->pages.free * KVF_PAGE;
    s->evictions = st->evictions;
    s->checksum_failures = st->checksum_failures;
    s->events_dropped = st->events_dropped;
    s->pinned = st->pinned;
    s->groups = st->groups;
    s->group_objects = st->group_objects;
    s->groups_incomplete = st->groups_incomplete;
    pthread_mutex_unlock(&st->mu);
}

void kvf_store_each(struct kvf_store *st, void (*fn)(const uint8_t *, uint32_t, uint64_t, void *), void *arg)
{
    pthread_mutex_lock(&st->mu);
    for (uint32_t i = 0; i < st->nents; i++) {
        struct entry *e = &st->ents[i];
        if (e->state != E_LIVE) continue;
        struct group *g = group_of(st, i);
        if (!g) fn(e->key, e->klen, e->size, arg);
        else if (g->rep == i) fn(e->key, e->klen, g->bytes, arg);
    }
    pthread_mutex_unlock(&st->mu);
}

void kvf_store_set_evict_hook(struct kvf_store *st, kvf_evict_hook fn, void *arg)
{
    pthread_mutex_lock(&st->mu);
    st->evict_hook = fn;
    st->evict_arg = arg;
    pthread_mutex_unlock(&st->mu);
}

void kvf_store_want_space(struct kvf_store *st, uint64_t bytes)
{
    pthread_mutex_lock(&st->mu);
    if (bytes > st->want_bytes) st->want_bytes = bytes;
    pthread_cond_signal(&st->cv);
    pthread_mutex_unlock(&st->mu);
}

void kvf_store_set_low(struct kvf_store *st, uint64_t bytes)
{
    pthread_mutex_lock(&st->mu);
    st->low_bytes = bytes;
    pthread_mutex_unlock(&st->mu);
}

uint64_t kvf_store_wait(struct kvf_store *st, int timeout_ms, uint64_t *free_bytes, uint64_t *dropped)
{
    pthread_mutex_lock(&st->mu);
    int low = (uint64_t)st->pages.free * KVF_PAGE < st->low_bytes;
    if (st->want_bytes == 0 && !low && st->ring_len * 2 < st->ring_cap && timeout_ms > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_sec += timeout_ms / 1000;
        ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        pthread_cond_timedwait(&st->cv, &st->mu, &ts);
    }
    uint64_t w = st->want_bytes;
    *free_bytes = (uint64_t)st->pages.free * KVF_PAGE;
    *dropped = st->events_dropped;
    if (*free_bytes >= st->low_bytes) st->low_signaled = 0; /* re-arm */
    pthread_mutex_unlock(&st->mu);
    return w;
}

uint64_t kvf_store_space_done(struct kvf_store *st, int exhausted)
{
    pthread_mutex_lock(&st->mu);
    st->want_bytes = 0;
    st->low_signaled = 0;
    st->exhausted = exhausted;
    uint64_t r = ++st->round;
    pthread_mutex_unlock(&st->mu);
    return r;
}

uint64_t kvf_store_round(struct kvf_store *st, int *exhausted)
{
    pthread_mutex_lock(&st->mu);
    uint64_t r = st->round;
    *exhausted = st->exhausted;
    pthread_mutex_unlock(&st->mu);
    return r;
}

void kvf_store_set_ns(struct kvf_store *st, struct kvf_ns *ns) { st->ns = ns; }
struct kvf_ns *kvf_store_ns(struct kvf_store *st) { return st->ns; }

uint32_t kvf_store_sweep(struct kvf_store *st, uint32_t max)
{
    uint32_t freed = 0;
    if (!st->ns) return 0;
    pthread_mutex_lock(&st->mu);
    for (uint32_t k = 0; k < max && st->nents; k++) {
        uint32_t i = st->sweep_at++ % st->nents;
        struct entry *e = &st->ents[i];
        if (e->state == E_LIVE && e->nsref && kvf_ns_stale(st->ns, e->nsref)) {
            uint32_t n = e->grp != NONE ? st->grps[e->grp].members : 1;
            drop_stale(st, i);
            freed += n;
        }
    }
    pthread_mutex_unlock(&st->mu);
    return freed;
}

int kvf_store_check(struct kvf_store *st)
{
    pthread_mutex_lock(&st->mu);
    int bad = kvf_pages_check(&st->pages) != 0;
    uint64_t used = 0;
    for (uint32_t i = 0; i < st->nents; i++)
        if (st->ents[i].state != E_FREE) used += pages_for(st->ents[i].size);
    if (used > (uint64_t)st->pages.npages - st->pages.free) bad = 1;
    pthread_mutex_unlock(&st->mu);
    return bad ? -EFAULT : 0;
}
