/* kvf_ns.c: the namespace tag table (kvf_ns.h): tags interned into slots by open
 * addressing over the tag's first 8 bytes (tags are digests), one generation per slot,
 * and the append-only file of retirements.
 *
 * File record (32 bytes, little-endian): tag[16], gen u32, zero u32, csum u64 =
 * xxh3_64 of the 24 bytes before it. The last record of a tag holds its generation.
 */
#define _GNU_SOURCE
#include "kvf_ns.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

struct ns_rec {
    uint8_t tag[KVF_NS_TAG_BYTES];
    uint32_t gen, zero;
    uint64_t csum;
};
_Static_assert(sizeof(struct ns_rec) == 32, "ns_rec is 32 bytes");

struct kvf_ns {
    pthread_mutex_t mu;
    uint32_t max, n;         /* slots 1..n used */
    uint32_t *hash, hcap;    /* slot numbers, 0 empty; hcap a power of two >= 2 * max */
    uint8_t (*tags)[KVF_NS_TAG_BYTES]; /* [max + 1] */
    uint32_t *gens;          /* [max + 1], atomic loads by readers */
    int fd;                  /* the retirements file, or -1 */
    kvf_ns_sink_fn sink;     /* the shared tier's records (kvf_ns_set_sink), or NULL */
    void *sink_arg;
    uint64_t retires, freed;
};

int kvf_ns_new(struct kvf_ns **out, uint32_t max)
{
    if (max == 0 || max > KVF_NS_MAX_SLOTS) return -EINVAL;
    struct kvf_ns *ns = calloc(1, sizeof *ns);
    if (!ns) return -ENOMEM;
    ns->max = max;
    ns->hcap = 16;
    while (ns->hcap < 2 * max) ns->hcap *= 2;
    ns->hash = calloc(ns->hcap, sizeof *ns->hash);
    ns->tags = calloc(max + 1, sizeof *ns->tags);
    ns->gens = calloc(max + 1, sizeof *ns->gens);
    ns->fd = -1;
    if (!ns->hash || !ns->tags || !ns->gens) { kvf_ns_free(ns); return -ENOMEM; }
    pthread_mutex_init(&ns->mu, NULL);
    *out = ns;
    return 0;
}

void kvf_ns_free(struct kvf_ns *ns)
{
    if (!ns) return;
    if (ns->fd >= 0) close(ns->fd);
    if (ns->hash && ns->tags && ns->gens) pthread_mutex_destroy(&ns->mu);
    free(ns->hash);
    free(ns->tags);
    free(ns->gens);
    free(ns);
}

/* Under mu: the slot of tag, interned when new. 0 and -ENOSPC in *err when full. */
static uint32_t intern(struct kvf_ns *ns, const uint8_t *tag, int *err)
{
    uint64_t h;
    memcpy(&h, tag, sizeof h);
    for (uint32_t i = (uint32_t)h & (ns->hcap - 1);; i = (i + 1) & (ns->hcap - 1)) {
        uint32_t s = ns->hash[i];
        if (s && memcmp(ns->tags[s], tag, KVF_NS_TAG_BYTES) == 0) return s;
        if (!s) {
            if (ns->n == ns->max) { *err = -ENOSPC; return 0; }
            s = ++ns->n;
            memcpy(ns->tags[s], tag, KVF_NS_TAG_BYTES);
            ns->hash[i] = s;
            return s;
        }
    }
}

static inline uint64_t mkref(uint32_t slot, uint32_t gen) { return (uint64_t)gen << 16 | slot; }

int kvf_ns_ref(struct kvf_ns *ns, const uint8_t tag[KVF_NS_TAG_BYTES], uint64_t *ref)
{
    int err = 0;
    pthread_mutex_lock(&ns->mu);
    uint32_t s = intern(ns, tag, &err);
    if (s) *ref = mkref(s, __atomic_load_n(&ns->gens[s], __ATOMIC_ACQUIRE));
    pthread_mutex_unlock(&ns->mu);
    return err;
}

int kvf_ns_stale(struct kvf_ns *ns, uint64_t ref)
{
    uint32_t s = (uint32_t)(ref & 0xffff);
    if (!s || s > ns->max) return 0;
    return (uint32_t)(ref >> 16) != __atomic_load_n(&ns->gens[s], __ATOMIC_ACQUIRE);
}

static int append(int fd, const uint8_t *tag, uint32_t gen)
{
    struct ns_rec r;
    memset(&r, 0, sizeof r);
    memcpy(r.tag, tag, KVF_NS_TAG_BYTES);
    r.gen = gen;
    r.csum = XXH3_64bits(&r, offsetof(struct ns_rec, csum));
    ssize_t w = write(fd, &r, sizeof r);
    if (w != (ssize_t)sizeof r) return w < 0 ? -errno : -EIO;
    return fdatasync(fd) ? -errno : 0;
}

int kvf_ns_retire(struct kvf_ns *ns, const uint8_t tag[KVF_NS_TAG_BYTES], uint64_t *gen)
{
    int err = 0;
    pthread_mutex_lock(&ns->mu);
    uint32_t s = intern(ns, tag, &err);
    if (s) {
        uint32_t g = ns->gens[s];
        if (g == UINT32_MAX) err = -EOVERFLOW;
        else if (ns->fd >= 0) err = append(ns->fd, tag, g + 1);
        if (!err && ns->sink) err = ns->sink(ns->sink_arg, tag, g + 1);
        if (!err) {
            __atomic_store_n(&ns->gens[s], g + 1, __ATOMIC_RELEASE);
            ns->retires++;
            *gen = g + 1;
        }
    }
    pthread_mutex_unlock(&ns->mu);
    return err;
}

int kvf_ns_unref(struct kvf_ns *ns, uint64_t ref, uint8_t tag[KVF_NS_TAG_BYTES], uint32_t *gen)
{
    uint32_t s = (uint32_t)(ref & 0xffff);
    pthread_mutex_lock(&ns->mu);
    int ok = s && s <= ns->n;
    if (ok) memcpy(tag, ns->tags[s], KVF_NS_TAG_BYTES);
    pthread_mutex_unlock(&ns->mu);
    if (!ok) return -ENOENT;
    *gen = (uint32_t)(ref >> 16);
    return 0;
}

int kvf_ns_reref(struct kvf_ns *ns, const uint8_t tag[KVF_NS_TAG_BYTES], uint32_t gen, uint64_t *ref)
{
    int err = 0, stale = 0;
    pthread_mutex_lock(&ns->mu);
    uint32_t s = intern(ns, tag, &err);
    if (s) {
        stale = gen < ns->gens[s];
        *ref = stale ? 0 : mkref(s, gen);
        /* a record newer than the file knows (the file lost its tail): keep the newer one */
        if (gen > ns->gens[s]) __atomic_store_n(&ns->gens[s], gen, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&ns->mu);
    return err ? err : stale;
}

int kvf_ns_persist(struct kvf_ns *ns, const char *dir)
{
    char path[4096];
    if (snprintf(path, sizeof path, "%s/%s", dir, KVF_NS_FILE) >= (int)sizeof path) return -ENAMETOOLONG;
    int fd = open(path, O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return -errno;
    struct stat sb;
    if (fstat(fd, &sb)) { int e = -errno; close(fd); return e; }
    if (!S_ISREG(sb.st_mode) || sb.st_uid != geteuid() || sb.st_nlink != 1) { close(fd); return -EPERM; }
    uint64_t whole = (uint64_t)sb.st_size / sizeof(struct ns_rec), keep = whole;
    int err = 0;
    pthread_mutex_lock(&ns->mu);
    for (uint64_t i = 0; i < whole && !err; i++) {
        struct ns_rec r;
        if (pread(fd, &r, sizeof r, (off_t)(i * sizeof r)) != (ssize_t)sizeof r) { err = -EIO; break; }
        if (r.zero || r.csum != XXH3_64bits(&r, offsetof(struct ns_rec, csum))) {
            err = i + 1 == whole ? 0 : -EBADMSG; /* a torn last record: the RETIRE was never answered */
            keep = i;
            break;
        }
        uint32_t s = intern(ns, r.tag, &err);
        if (s && r.gen > ns->gens[s]) __atomic_store_n(&ns->gens[s], r.gen, __ATOMIC_RELEASE);
    }
    if (!err && (uint64_t)sb.st_size != keep * sizeof(struct ns_rec)) /* a torn tail: cut it, appends stay aligned */
        err = ftruncate(fd, (off_t)(keep * sizeof(struct ns_rec))) ? -errno : 0;
    if (!err) ns->fd = fd;
    pthread_mutex_unlock(&ns->mu);
    if (err) close(fd);
    return err;
}

int kvf_ns_known(struct kvf_ns *ns, const uint8_t tag[KVF_NS_TAG_BYTES])
{
    uint64_t h;
    memcpy(&h, tag, sizeof h);
    int rc = 0;
    pthread_mutex_lock(&ns->mu);
    for (uint32_t i = (uint32_t)h & (ns->hcap - 1);; i = (i + 1) & (ns->hcap - 1)) {
        uint32_t s = ns->hash[i];
        if (s && memcmp(ns->tags[s], tag, KVF_NS_TAG_BYTES) == 0) { rc = 1; break; }
        if (!s) { rc = ns->n == ns->max ? -ENOSPC : 0; break; }
    }
    pthread_mutex_unlock(&ns->mu);
    return rc;
}

void kvf_ns_set_sink(struct kvf_ns *ns, kvf_ns_sink_fn fn, void *arg)
{
    pthread_mutex_lock(&ns->mu);
    ns->sink = fn;
    ns->sink_arg = arg;
    pthread_mutex_unlock(&ns->mu);
}

void kvf_ns_count_freed(struct kvf_ns *ns, uint64_t n) { __atomic_add_fetch(&ns->freed, n, __ATOMIC_RELAXED); }

void kvf_ns_stats(struct kvf_ns *ns, struct kvf_ns_stats *s)
{
    pthread_mutex_lock(&ns->mu);
    s->tags = ns->n;
    s->retires = ns->retires;
    pthread_mutex_unlock(&ns->mu);
    s->freed = __atomic_load_n(&ns->freed, __ATOMIC_RELAXED);
}
