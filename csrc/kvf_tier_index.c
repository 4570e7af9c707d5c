/* kvf_tier_index.c: the SSD tier's index and record format, the bottom of the
 * tier: called by the tier thread (kvf_tier_io.c) and by open, rebuild and the
 * loop-side interface (kvf_tier.c); calls neither.
 *
 * Index: a chained hash table of entries (key -> log position, seq, size,
 * checksum), entries recycled through a free list, all under t->mu. An entry
 * is PENDING from the moment an evicted object is staged until its record is
 * written (a lookup treats it as absent; a second eviction of the key is
 * skipped), then LIVE.
 */
#define _GNU_SOURCE
#include "kvf_tier_int.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_hash.h"

/* ---------------------------------------------------------------- index */

static inline uint32_t ibucket(struct kvf_tier *t, const uint8_t *key, uint32_t klen)
{
    return (uint32_t)kvf_xxh3_64(key, klen) & (t->nbuckets - 1);
}

/* An entry of a retired namespace generation (issue 27) is unindexed when found (a miss;
 * a PENDING write then indexes nothing) and counted freed; the log reclaims its record. */
uint32_t kvf_tier_ifind(struct kvf_tier *t, const uint8_t *key, uint32_t klen)
{
    for (uint32_t i = t->buckets[ibucket(t, key, klen)]; i != TIER_NONE; i = t->ents[i].next)
        if (t->ents[i].klen == klen && memcmp(t->ents[i].key, key, klen) == 0) {
            if (t->ents[i].nsref && t->ns && kvf_ns_stale(t->ns, t->ents[i].nsref)) {
                kvf_tier_iremove(t, i);
                kvf_ns_count_freed(t->ns, 1);
                return TIER_NONE;
            }
            return i;
        }
    return TIER_NONE;
}

/* Twice the buckets, every entry not free relinked into them: 1, or 0 when out
 * of memory (the old buckets stay: longer chains rather than a failure). */
static int grow_buckets(struct kvf_tier *t)
{
    uint32_t nb = t->nbuckets * 2;
    uint32_t *b = malloc(sizeof(uint32_t) * nb);
    if (!b) return 0;
    memset(b, 0xff, sizeof(uint32_t) * nb);
    free(t->buckets);
    t->buckets = b;
    t->nbuckets = nb;
    for (uint32_t i = 0; i < t->nents; i++) {
        if (t->ents[i].state == TE_FREE) continue;
        uint32_t h = ibucket(t, t->ents[i].key, t->ents[i].klen);
        t->ents[i].next = b[h];
        b[h] = i;
    }
    return 1;
}

uint32_t kvf_tier_iadd(struct kvf_tier *t, const uint8_t *key, uint32_t klen)
{
    uint32_t i;
    if (t->ent_free != TIER_NONE) {
        i = t->ent_free;
        t->ent_free = t->ents[i].next;
    } else {
        if (t->nents == t->ents_cap) {
            uint32_t cap = t->ents_cap ? t->ents_cap * 2 : 1024;
            struct tent *e = realloc(t->ents, sizeof *e * cap);
            if (!e) return TIER_NONE;
            t->ents = e;
            t->ents_cap = cap;
        }
        i = t->nents++;
    }
    /* The entry is whole before the buckets may grow: a fresh one (past the old
     * nents) is uninitialised memory, and grow_buckets links every entry that
     * is not TE_FREE. It used to grow first: a fresh entry whose garbage read
     * as in use was linked under a garbage hash, then linked again under its
     * key, cutting that other chain (later misses, and a remove that walked off
     * the chain's end: the servers' GP fault in kvf_tier_iremove). */
    struct tent *e = &t->ents[i];
    memset(e, 0, sizeof *e);
    memcpy(e->key, key, klen);
    e->klen = (uint8_t)klen;
    e->state = TE_PENDING;
    if (t->nents > t->nbuckets && grow_buckets(t)) return i; /* e linked with the rest */
    uint32_t h = ibucket(t, key, klen);
    e->next = t->buckets[h];
    t->buckets[h] = i;
    return i;
}

void kvf_tier_iremove(struct kvf_tier *t, uint32_t i)
{
    struct tent *e = &t->ents[i];
    uint32_t *pp = &t->buckets[ibucket(t, e->key, e->klen)];
    while (*pp != i) pp = &t->ents[*pp].next;
    *pp = e->next;
    if (e->state == TE_LIVE) {
        t->st.objects--;
        t->st.bytes -= e->size;
        kvf_tier_event(t, KVF_TIER_EV_REMOVED, e, NULL, 0);
    }
    e->state = TE_FREE;
    e->next = t->ent_free;
    t->ent_free = i;
}

void kvf_tier_event(struct kvf_tier *t, int type, const struct tent *e, const uint8_t *gkey, uint32_t glen)
{
    if (!t->ev_cap) return;
    if (t->ev_len == t->ev_cap) {
        t->ev_dropped++;
        return;
    }
    struct kvf_tier_event *v = &t->ev[(t->ev_head + t->ev_len++) % t->ev_cap];
    v->type = (uint8_t)type;
    v->klen = e->klen;
    memcpy(v->key, e->key, e->klen);
    v->size = e->size;
    v->ghash = e->ghash;
    v->gparts = e->gparts;
    v->glen = gkey && e->ghash ? (uint8_t)glen : 0;
    if (v->glen) memcpy(v->gkey, gkey, glen);
}

static int u64_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Sort and dedupe hs[0..n); returns the new n. */
static size_t sort_unique(uint64_t *hs, size_t n)
{
    qsort(hs, n, sizeof *hs, u64_cmp);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (k == 0 || hs[i] != hs[k - 1]) hs[k++] = hs[i];
    return k;
}

/* Unindex every live record of the groups in hs[0..n) (sorted, unique); returns how many of those
 * groups had a record here to lose. */
static uint64_t drop_groups(struct kvf_tier *t, const uint64_t *hs, size_t n)
{
    uint8_t *hit = n ? calloc(n, 1) : NULL;
    uint64_t dropped = 0;
    for (uint32_t i = 0; i < t->nents && n; i++) {
        struct tent *e = &t->ents[i];
        const uint64_t *f = e->state == TE_LIVE && e->ghash ? bsearch(&e->ghash, hs, n, sizeof *hs, u64_cmp) : NULL;
        if (!f) continue;
        kvf_tier_iremove(t, i);
        if (hit && !hit[f - hs]) { hit[f - hs] = 1; dropped++; }
    }
    free(hit);
    return dropped;
}

void kvf_tier_drop_segment(struct kvf_tier *t, uint64_t g)
{
    uint64_t lo = g * t->seg_size, hi = lo + t->seg_size;
    uint64_t *hs = NULL;
    size_t n = 0, cap = 0;
    for (uint32_t i = 0; i < t->nents; i++) {
        struct tent *e = &t->ents[i];
        if (!((e->state == TE_LIVE || e->state == TE_TOMB) && e->loc >= lo && e->loc < hi)) continue;
        if (e->state == TE_LIVE && e->ghash) { /* its group's records elsewhere go with it */
            if (n == cap) {
                uint64_t *p = realloc(hs, sizeof *hs * (cap = cap ? cap * 2 : 64));
                if (p) hs = p; else cap = n;
            }
            if (n < cap) hs[n++] = e->ghash;
        }
        kvf_tier_iremove(t, i);
    }
    if (n) t->st.groups_torn += drop_groups(t, hs, sort_unique(hs, n)); /* those that had a part elsewhere */
    free(hs);
}

uint64_t kvf_tier_drop_torn_groups(struct kvf_tier *t)
{
    struct gc { uint64_t h; uint32_t parts; } *v = NULL;
    size_t n = 0;
    for (uint32_t i = 0; i < t->nents; i++) n += t->ents[i].state == TE_LIVE && t->ents[i].ghash;
    if (!n || !(v = malloc(sizeof *v * n))) return 0; /* no memory: the groups stay as found (reads verify) */
    n = 0;
    for (uint32_t i = 0; i < t->nents; i++)
        if (t->ents[i].state == TE_LIVE && t->ents[i].ghash) v[n++] = (struct gc){t->ents[i].ghash, t->ents[i].gparts};
    qsort(v, n, sizeof *v, u64_cmp); /* h is the first member */
    uint64_t *torn = (uint64_t *)v; /* written behind the reads: k <= i always */
    size_t k = 0;
    for (size_t i = 0, j; i < n; i = j) {
        uint32_t parts = v[i].parts;
        for (j = i; j < n && v[j].h == v[i].h; j++) if (v[j].parts > parts) parts = v[j].parts;
        if (j - i < parts) torn[k++] = v[i].h;
    }
    uint64_t dropped = drop_groups(t, torn, k); /* sorted and unique already */
    free(v);
    return dropped;
}

/* ---------------------------------------------------------------- format */

void kvf_tier_where(struct kvf_tier *t, uint64_t loc, int *fd, uint64_t *off)
{
    uint64_t g = loc / t->seg_size;
    *fd = t->fds[g % t->nfiles];
    *off = KVF_TIER_BLOCK + (g / t->nfiles) * t->seg_size + loc % t->seg_size;
}

static uint64_t rec_hash(const struct tier_rec *h, uint64_t file_id)
{
    return kvf_obj_hash(&file_id, sizeof file_id, h, offsetof(struct tier_rec, hdr_csum));
}

void kvf_tier_rec_fill(struct kvf_tier *t, uint64_t loc, struct tier_rec *h, const uint8_t *key, uint32_t klen,
                       uint64_t size, uint64_t csum, uint64_t seq, uint32_t flags)
{
    uint64_t fid = t->file_id[(loc / t->seg_size) % t->nfiles];
    memset(h, 0, sizeof *h);
    memcpy(h->magic, TIER_MAGIC_REC, 8);
    h->version = KVF_TIER_FORMAT_VERSION;
    h->flags = flags;
    h->file_id = fid;
    h->seq = seq;
    h->size = size;
    h->csum = csum;
    h->klen = klen;
    memcpy(h->key, key, klen);
    h->hdr_csum = rec_hash(h, fid);
}

uint64_t kvf_tier_ghash(const uint8_t *gkey, uint32_t glen)
{
    uint64_t h = kvf_xxh3_64(gkey, glen);
    return h ? h : 1;
}

void kvf_tier_grp_fill(uint8_t *block, const uint8_t *gkey, uint32_t glen, uint32_t gparts)
{
    struct tier_grp *g = (struct tier_grp *)(block + TIER_GRP_OFF);
    memset(g, 0, sizeof *g);
    if (!glen) return;
    uint64_t seed = ((const struct tier_rec *)block)->hdr_csum;
    g->glen = glen;
    g->gparts = gparts;
    memcpy(g->gkey, gkey, glen);
    g->csum = kvf_obj_hash(&seed, sizeof seed, g, offsetof(struct tier_grp, csum));
}

int kvf_tier_grp_get(const uint8_t *block, uint8_t gkey[KVF_KEY_MAX], uint32_t *glen, uint32_t *gparts)
{
    const struct tier_grp *g = (const struct tier_grp *)(block + TIER_GRP_OFF);
    uint64_t seed = ((const struct tier_rec *)block)->hdr_csum;
    *glen = 0;
    *gparts = 0;
    if (g->glen == 0) return 0;
    if (g->glen > KVF_KEY_MAX || g->gparts == 0 ||
        kvf_obj_hash(&seed, sizeof seed, g, offsetof(struct tier_grp, csum)) != g->csum)
        return -EBADMSG;
    memcpy(gkey, g->gkey, g->glen);
    *glen = g->glen;
    *gparts = g->gparts;
    return 0;
}

void kvf_tier_ns_fill(struct kvf_tier *t, uint8_t *block, uint64_t nsref)
{
    struct tier_ns *n = (struct tier_ns *)(block + TIER_NS_OFF);
    memset(n, 0, sizeof *n);
    if (!nsref || !t->ns || kvf_ns_unref(t->ns, nsref, n->tag, &n->gen)) return;
    uint64_t seed = ((const struct tier_rec *)block)->hdr_csum;
    n->used = 1;
    n->csum = kvf_obj_hash(&seed, sizeof seed, n, offsetof(struct tier_ns, csum));
}

int kvf_tier_ns_get(struct kvf_tier *t, const uint8_t *block, uint64_t *nsref)
{
    const struct tier_ns *n = (const struct tier_ns *)(block + TIER_NS_OFF);
    uint64_t seed = ((const struct tier_rec *)block)->hdr_csum;
    *nsref = 0;
    if (n->used == 0) return 0;
    if (n->used != 1 || kvf_obj_hash(&seed, sizeof seed, n, offsetof(struct tier_ns, csum)) != n->csum)
        return -EBADMSG;
    if (!t->ns) return 0; /* no table: nothing is ever retired */
    return kvf_ns_reref(t->ns, n->tag, n->gen, nsref);
}

int kvf_tier_rec_check(struct kvf_tier *t, uint64_t loc, const struct tier_rec *h)
{
    uint64_t fid = t->file_id[(loc / t->seg_size) % t->nfiles];
    if (memcmp(h->magic, TIER_MAGIC_REC, 8) || h->version != KVF_TIER_FORMAT_VERSION || h->file_id != fid ||
        h->klen == 0 || h->klen > KVF_KEY_MAX || rec_hash(h, fid) != h->hdr_csum)
        return -EBADMSG;
    if ((h->flags & TIER_F_TOMB) ? h->size != 0 : tier_rec_len(h->size) > t->seg_size - loc % t->seg_size)
        return -EBADMSG;
    return 0;
}
