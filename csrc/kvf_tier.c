/* kvf_tier.c: the SSD tier's open, rebuild and loop-side interface (see
 * kvf_tier.h for the interface and kvf_tier_int.h for the format); above the
 * tier thread (kvf_tier_io.c), which is above the index and record format
 * (kvf_tier_index.c).
 *
 * Rebuild (kvf_tier_open, before the tier thread and the server run): every
 * segment is read in 1 MiB steps; a block holding a valid record header is
 * indexed (highest seq per key wins; tombstones remove) and the scan skips
 * the record's length; any other block is skipped (a torn or corrupt header:
 * counted in ssd_corrupt when it carries the record magic). Values are not
 * read at rebuild: a value whose checksum fails is found on its first read,
 * dropped, counted and answered as a miss. The head continues after the
 * record with the highest seq.
 */
#define _GNU_SOURCE
#include "kvf_tier_int.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvf_copy.h"
#include "kvf_hash.h"
#include "kvf_mpack.h"

#define SEG_MIN (1ull << 20)
#define SEG_MAX (64ull << 20)
#define SCAN_BUF (1u << 20)

static uint64_t super_hash(const struct tier_super *s) { return kvf_xxh3_64(s, offsetof(struct tier_super, csum)); }

/* ---------------------------------------------------------------- rebuild */

static void rebuild_record(struct kvf_tier *t, uint64_t loc, const struct tier_rec *h)
{
    uint8_t gkey[KVF_KEY_MAX];
    uint32_t glen, gparts;
    if (kvf_tier_grp_get((const uint8_t *)h, gkey, &glen, &gparts)) { t->st.corrupt++; return; } /* its group part torn */
    uint64_t nsref = 0;
    int nsr = (h->flags & TIER_F_TOMB) ? 0 : kvf_tier_ns_get(t, (const uint8_t *)h, &nsref);
    if (nsr < 0) { t->st.corrupt++; return; } /* its namespace part torn, or no room for its tag */
    uint32_t i = kvf_tier_ifind(t, h->key, h->klen);
    if (i != TIER_NONE && t->ents[i].seq >= h->seq) return; /* a later record of the key is indexed */
    if (i != TIER_NONE) kvf_tier_iremove(t, i);
    i = kvf_tier_iadd(t, h->key, h->klen);
    if (i == TIER_NONE) return;
    struct tent *e = &t->ents[i];
    e->loc = loc;
    e->seq = h->seq;
    e->size = h->size;
    e->csum = h->csum;
    e->ghash = glen ? kvf_tier_ghash(gkey, glen) : 0;
    e->gparts = gparts;
    e->nsref = nsref;
    /* a retired generation's record removes the key like a tombstone would */
    e->state = (h->flags & TIER_F_TOMB) || nsr == 1 ? TE_TOMB : TE_LIVE;
    if (nsr == 1) kvf_ns_count_freed(t->ns, 1);
    if (e->state == TE_LIVE) {
        t->st.objects++;
        t->st.bytes += e->size;
        kvf_tier_event(t, KVF_TIER_EV_STORED, e, gkey, glen);
    }
}

/* Scan every segment; returns 0 or -errno (a read error). */
static int rebuild(struct kvf_tier *t)
{
    uint8_t *buf;
    if (posix_memalign((void **)&buf, KVF_TIER_BLOCK, SCAN_BUF)) return -ENOMEM;
    uint64_t best_seq = 0, best_end = 0;
    int found = 0, rc = 0;
    for (uint64_t g = 0; g < t->nsegs && !rc; g++) {
        if (t->fresh[g % t->nfiles]) continue; /* just initialised: nothing of its generation yet */
        uint64_t pos = 0, buf_lo = 0, buf_len = 0; /* buffer holds segment bytes [buf_lo, buf_lo + buf_len) */
        uint64_t last_len = 0;
        while (pos + KVF_TIER_BLOCK <= t->seg_size) {
            if (pos < buf_lo || pos + KVF_TIER_BLOCK > buf_lo + buf_len) {
                /* after a large record only its successor's header block is read, so the
                 * scan reads ~4 KiB per record of large objects, not the whole file */
                uint64_t n = t->seg_size - pos < SCAN_BUF ? t->seg_size - pos : SCAN_BUF;
                if (last_len > SCAN_BUF / 4) n = KVF_TIER_BLOCK;
                int fd;
                uint64_t off;
                kvf_tier_where(t, g * t->seg_size + pos, &fd, &off);
                ssize_t r = pread(fd, buf, n, (off_t)off);
                if (r < (ssize_t)KVF_TIER_BLOCK) { rc = r < 0 ? -errno : -EIO; break; }
                buf_lo = pos;
                buf_len = (uint64_t)r & ~(uint64_t)(KVF_TIER_BLOCK - 1);
            }
            const struct tier_rec *h = (const struct tier_rec *)(buf + (pos - buf_lo));
            uint64_t loc = g * t->seg_size + pos;
            if (kvf_tier_rec_check(t, loc, h) == 0) {
                rebuild_record(t, loc, h);
                uint64_t len = (h->flags & TIER_F_TOMB) ? KVF_TIER_BLOCK : tier_rec_len(h->size);
                if (!found || h->seq > best_seq) {
                    found = 1;
                    best_seq = h->seq;
                    best_end = loc + len;
                }
                pos += len;
                last_len = len;
            } else {
                /* a damaged header of this file counts; a record of an earlier file generation does not */
                if (memcmp(h->magic, TIER_MAGIC_REC, 8) == 0 && h->file_id == t->file_id[g % t->nfiles]) t->st.corrupt++;
                pos += KVF_TIER_BLOCK;
                last_len = 0;
                static const uint8_t zero[sizeof(struct tier_rec)];
                if (memcmp(h, zero, sizeof zero) == 0) {
                    /* never written (preallocated, unwritten extents read as zeros): jump to
                     * the next data the filesystem knows of, if it can tell */
                    int fd;
                    uint64_t off;
                    kvf_tier_where(t, g * t->seg_size + pos, &fd, &off);
                    off_t d = lseek(fd, (off_t)off, SEEK_DATA);
                    uint64_t seg_end = off + (t->seg_size - pos);
                    if (d < 0 && errno == ENXIO) pos = t->seg_size;
                    else if (d > (off_t)off) pos += ((uint64_t)d < seg_end ? (uint64_t)d - off : seg_end - off) &
                                                    ~(uint64_t)(KVF_TIER_BLOCK - 1);
                }
            }
        }
    }
    free(buf);
    /* tombstones only served to outrank older records */
    for (uint32_t i = 0; i < t->nents; i++)
        if (t->ents[i].state == TE_TOMB) kvf_tier_iremove(t, i);
    if (found) {
        t->next_seq = best_seq + 1;
        t->head_seg = best_end / t->seg_size;
        t->head_off = best_end % t->seg_size;
        if (t->head_seg >= t->nsegs) t->head_seg = 0; /* ended exactly at the log's end */
        /* records after the head in its segment are a lap older and about to be overwritten */
        uint64_t lo = t->head_seg * t->seg_size + t->head_off, hi = (t->head_seg + 1) * t->seg_size;
        for (uint32_t i = 0; i < t->nents; i++)
            if (t->ents[i].state == TE_LIVE && t->ents[i].loc >= lo && t->ents[i].loc < hi) kvf_tier_iremove(t, i);
    }
    /* a group missing a record (torn by a crash mid-write-behind, a dropped write, a wrapped log) goes whole */
    t->st.groups_torn += kvf_tier_drop_torn_groups(t);
    if (!found) {
        t->next_seq = 1;
        t->head_seg = 0;
        t->head_off = 0;
    }
    return rc;
}

/* ---------------------------------------------------------------- open */

#define ERR(...) do { snprintf(err, errlen, __VA_ARGS__); } while (0)

/* Open or create path's file with the geometry asked; a file whose superblock
 * differs (another geometry, version, or none) is re-initialised: a new
 * random file id makes every old record invalid without rewriting it. */
/* The tier file fd opened (st its fstat): refuse what another user could have
 * put there or could read (kvf_tier_open). 0, or -EPERM with the reason in err. */
static int check_file(const struct stat *st, int64_t gid, const char *dir, const char *path, char *err, size_t errlen)
{
    mode_t allowed = 0600 | (gid >= 0 && st->st_gid == (gid_t)gid ? 0060 : 0);
    if (!S_ISREG(st->st_mode)) ERR("--ssd-path %s: %s is not a regular file; remove it", dir, path);
    else if (st->st_uid != geteuid())
        ERR("--ssd-path %s: %s belongs to uid %u, not to this server (uid %u): another user could read or forge "
            "its records; remove it", dir, path, (unsigned)st->st_uid, (unsigned)geteuid());
    else if (st->st_nlink != 1)
        ERR("--ssd-path %s: %s has %lu links: it may be another file too; remove it", dir, path,
            (unsigned long)st->st_nlink);
    else if (st->st_mode & 07777 & ~allowed)
        ERR("--ssd-path %s: %s has mode %03o: group or others may read or write the tier (at most %03o%s); "
            "remove it or chmod it", dir, path, (unsigned)(st->st_mode & 07777), (unsigned)allowed,
            gid >= 0 ? " with --tier-group" : "");
    else return 0;
    return -EPERM;
}

static int open_file(struct kvf_tier *t, uint32_t idx, const char *dir, uint64_t segs, int64_t gid, char *err,
                     size_t errlen)
{
    struct stat sb;
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) {
        int e = errno;
        ERR("--ssd-path %s: %s", dir, e == ENOENT || e == ENOTDIR ? "no such directory" : strerror(e));
        return -ENOENT;
    }
    char path[4096];
    if (snprintf(path, sizeof path, "%s/%s", dir, KVF_TIER_FILE) >= (int)sizeof path) {
        close(dfd);
        ERR("--ssd-path %s: path too long", dir);
        return -ENAMETOOLONG;
    }
    /* never through a symlink, never blocking on a FIFO; checked with fstat before any use */
    int fd = openat(dfd, KVF_TIER_FILE, O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
    int e = errno;
    close(dfd);
    if (fd < 0) {
        if (e == ELOOP) ERR("--ssd-path %s: %s is a symbolic link; refusing to write through it (remove it)", dir, path);
        else if (e == EINVAL) ERR("--ssd-path %s: the filesystem does not support O_DIRECT (tmpfs?); the tier needs it", dir);
        else ERR("--ssd-path %s: cannot open %s for writing: %s", dir, path, strerror(e));
        return -e;
    }
    t->fds[idx] = fd;
    int fl = fcntl(fd, F_GETFL);
    if (fstat(fd, &sb) || fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK)) { /* io_uring honours O_NONBLOCK */
        e = errno;
        ERR("--ssd-path %s: cannot inspect %s: %s", dir, path, strerror(e));
        return -e;
    }
    int rc = check_file(&sb, gid, dir, path, err, errlen);
    if (rc) return rc;
    if (gid >= 0 && sb.st_size == 0 && (fchown(fd, (uid_t)-1, (gid_t)gid) || fchmod(fd, 0640))) {
        e = errno; /* a new file: the tier group's */
        ERR("--ssd-path %s: cannot give %s to group %lld: %s", dir, path, (long long)gid, strerror(e));
        return -e;
    }
    /* one server per tier file: a second one would interleave its records with ours */
    if (flock(fd, LOCK_EX | LOCK_NB)) {
        int e = errno;
        ERR("--ssd-path %s: %s is in use by another server (%s)", dir, path, strerror(e));
        return -EBUSY;
    }
    uint64_t size = KVF_TIER_BLOCK + segs * t->seg_size;
    struct tier_super *sup;
    if (posix_memalign((void **)&sup, KVF_TIER_BLOCK, KVF_TIER_BLOCK)) return -ENOMEM;
    ssize_t r = pread(fd, sup, KVF_TIER_BLOCK, 0);
    if (r < 0 && errno == EINVAL) {
        free(sup);
        ERR("--ssd-path %s: the filesystem does not support O_DIRECT reads (EINVAL); the tier needs it", dir);
        return -EINVAL;
    }
    int ok = r == (ssize_t)KVF_TIER_BLOCK && memcmp(sup->magic, TIER_MAGIC_SUPER, 8) == 0 &&
             sup->version == KVF_TIER_FORMAT_VERSION && sup->csum == super_hash(sup) && sup->file_index == idx &&
             sup->nfiles == t->nfiles && sup->seg_size == t->seg_size && sup->nsegs == segs &&
             fstat(fd, &sb) == 0 && (uint64_t)sb.st_size == size;
    rc = 0;
    if (ok) {
        t->file_id[idx] = sup->file_id;
    } else {
        if (fstat(fd, &sb) == 0 && (uint64_t)sb.st_size > size && ftruncate(fd, (off_t)size)) { /* shrunk below */ }
        if (fallocate(fd, 0, 0, (off_t)size)) {
            rc = -errno;
            if (rc == -ENOSPC)
                ERR("--ssd-path %s: not enough space to preallocate %llu bytes (--ssd-capacity over the free space)",
                    dir, (unsigned long long)size);
            else ERR("--ssd-path %s: cannot preallocate %s: %s", dir, path, strerror(-rc));
            if (ftruncate(fd, 0)) { /* nothing more to do */ }
            free(sup);
            return rc;
        }
        memset(sup, 0, KVF_TIER_BLOCK);
        memcpy(sup->magic, TIER_MAGIC_SUPER, 8);
        sup->version = KVF_TIER_FORMAT_VERSION;
        sup->file_index = idx;
        sup->nfiles = t->nfiles;
        if (getrandom(&sup->file_id, sizeof sup->file_id, 0) != sizeof sup->file_id) sup->file_id = (uint64_t)kvf_tier_now_ns();
        sup->seg_size = t->seg_size;
        sup->nsegs = segs;
        sup->csum = super_hash(sup);
        r = pwrite(fd, sup, KVF_TIER_BLOCK, 0);
        if (r != (ssize_t)KVF_TIER_BLOCK) {
            rc = r < 0 ? -errno : -EIO;
            if (rc == -EINVAL) ERR("--ssd-path %s: the filesystem does not support O_DIRECT writes (EINVAL); the tier needs it", dir);
            else ERR("--ssd-path %s: cannot write %s: %s", dir, path, strerror(-rc));
            free(sup);
            return rc;
        }
        if (fdatasync(fd)) { /* the superblock reaches the disk with the first records anyway */ }
        t->file_id[idx] = sup->file_id;
        t->fresh[idx] = 1;
    }
    free(sup);
    return 0;
}

int kvf_tier_open(struct kvf_tier **out, const struct kvf_tier_cfg *cfg, char *err, size_t errlen)
{
    err[0] = 0;
    if (cfg->npaths > KVF_TIER_MAX_PATHS) { ERR("at most %u --ssd-path", KVF_TIER_MAX_PATHS); return -EINVAL; }
    struct kvf_tier *t = calloc(1, sizeof *t);
    if (!t) return -ENOMEM;
    for (uint32_t i = 0; i < KVF_TIER_MAX_PATHS; i++) t->fds[i] = -1;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    t->nfiles = cfg->npaths;
    t->ns = cfg->ns;
    t->admit = cfg->admit;
    t->write_queue = cfg->write_queue ? cfg->write_queue : 64ull << 20;
    t->promote_max = cfg->promote_max ? cfg->promote_max : 1ull << 30;
    t->ent_free = TIER_NONE;
    t->nbuckets = 1024;
    t->buckets = malloc(sizeof(uint32_t) * t->nbuckets);
    int rc = -ENOMEM;
    if (cfg->events > KVF_TIER_EVENTS_MAX) { ERR("at most %u SSD events kept", KVF_TIER_EVENTS_MAX); rc = -EINVAL; goto fail; }
    if (cfg->events && !(t->ev = malloc(sizeof *t->ev * cfg->events))) goto fail;
    t->ev_cap = cfg->events; /* before the scan: the objects it finds are STORED events too */
    if (!t->buckets || posix_memalign((void **)&t->scratch, KVF_TIER_BLOCK, KVF_TIER_BLOCK)) goto fail;
    memset(t->buckets, 0xff, sizeof(uint32_t) * t->nbuckets);
    memset(t->scratch, 0, KVF_TIER_BLOCK);
    if (t->nfiles) {
        uint64_t per = cfg->capacity / t->nfiles;
        /* ~16 segments per file, 1..64 MiB each: a reused segment drops at most 1/16 of the tier */
        uint64_t seg = per / 16;
        seg = seg < SEG_MIN ? SEG_MIN : seg > SEG_MAX ? SEG_MAX : seg;
        seg &= ~(uint64_t)(KVF_TIER_BLOCK - 1);
        t->seg_size = seg;
        uint64_t segs = per > KVF_TIER_BLOCK ? (per - KVF_TIER_BLOCK) / seg : 0;
        if (segs < 2) {
            ERR("--ssd-capacity %llu is too small: each path needs at least two segments of %llu bytes + 4 KiB",
                (unsigned long long)cfg->capacity, (unsigned long long)seg);
            rc = -EINVAL;
            goto fail;
        }
        t->nsegs = segs * t->nfiles;
        t->capacity = t->nfiles * (KVF_TIER_BLOCK + segs * seg);
        t->st.capacity = t->nsegs * seg;
        for (uint32_t i = 0; i < t->nfiles; i++)
            if ((rc = open_file(t, i, cfg->paths[i], segs, cfg->gid, err, errlen))) goto fail;
        /* the retirements (kvf_ns.h) beside the first file, its directory checked by open_file:
         * loaded before the scan, which drops the records of retired generations */
        if (t->ns && (rc = kvf_ns_persist(t->ns, cfg->paths[0]))) {
            ERR("the namespace retirements file %s/%s: %s", cfg->paths[0], KVF_NS_FILE,
                rc == -EBADMSG ? "a record before the last fails its checksum (not a torn append)"
                : rc == -EPERM ? "not a regular file of this user with one link" : strerror(-rc));
            goto fail;
        }
        if ((rc = rebuild(t))) { ERR("reading the SSD tier: %s", strerror(-rc)); goto fail; }
    }
    if ((rc = kvf_ring_init(&t->ring, 256))) { ERR("io_uring for the tier: %s", strerror(-rc)); goto fail; }
    if ((rc = kvf_tier_thread_start(t))) { ERR("tier thread: %s", strerror(-rc)); kvf_ring_exit(&t->ring); goto fail; }
    *out = t;
    return 0;
fail:
    if (!err[0]) ERR("%s", strerror(-rc));
    for (uint32_t i = 0; i < KVF_TIER_MAX_PATHS; i++)
        if (t->fds[i] >= 0) close(t->fds[i]);
    free(t->buckets);
    free(t->ents);
    free(t->scratch);
    free(t->ev);
    free(t);
    return rc;
}

void kvf_tier_close(struct kvf_tier *t)
{
    if (!t) return;
    kvf_tier_thread_stop(t);
    kvf_tier_buf_drain(t);
    kvf_ring_exit(&t->ring);
    for (struct kvf_tier_job *j = t->done, *n; j; j = n) { n = j->next; kvf_tier_job_free(j); }
    for (uint32_t i = 0; i < KVF_TIER_MAX_PATHS; i++)
        if (t->fds[i] >= 0) close(t->fds[i]);
    free(t->buckets);
    free(t->ents);
    free(t->scratch);
    free(t->ev);
    free(t);
}

/* ---------------------------------------------------------------- lookups */

int kvf_tier_find(struct kvf_tier *t, const uint8_t *key, uint32_t klen, uint64_t *loc, uint64_t *seq,
                  uint64_t *size, uint64_t *csum)
{
    if (!t->nfiles) return 0;
    pthread_mutex_lock(&t->mu);
    uint32_t i = kvf_tier_ifind(t, key, klen);
    int r = i != TIER_NONE && t->ents[i].state == TE_LIVE;
    if (r) {
        *loc = t->ents[i].loc;
        *seq = t->ents[i].seq;
        *size = t->ents[i].size;
        *csum = t->ents[i].csum;
    }
    pthread_mutex_unlock(&t->mu);
    return r;
}

int kvf_tier_still(struct kvf_tier *t, const uint8_t *key, uint32_t klen, uint64_t seq)
{
    pthread_mutex_lock(&t->mu);
    uint32_t i = kvf_tier_ifind(t, key, klen);
    int r = i != TIER_NONE && t->ents[i].state == TE_LIVE && t->ents[i].seq == seq;
    pthread_mutex_unlock(&t->mu);
    return r;
}

int kvf_tier_has_key(struct kvf_tier *t, const uint8_t *key, uint32_t klen)
{
    if (!t->nfiles) return 0;
    pthread_mutex_lock(&t->mu);
    int r = kvf_tier_ifind(t, key, klen) != TIER_NONE;
    pthread_mutex_unlock(&t->mu);
    return r;
}

int kvf_tier_delete(struct kvf_tier *t, const uint8_t *key, uint32_t klen)
{
    if (!t->nfiles) return 0;
    pthread_mutex_lock(&t->mu);
    uint32_t i = kvf_tier_ifind(t, key, klen);
    int had = i != TIER_NONE;
    int live = had && t->ents[i].state == TE_LIVE;
    uint64_t gh = had ? t->ents[i].ghash : 0;
    if (had) kvf_tier_iremove(t, i); /* a PENDING write finds no entry and indexes nothing */
    if (gh) /* a grouped part takes its group's other records out of the index (an O(index) walk; they
             * get no tombstone: at a restart the group is short of this part and dropped whole) */
        for (uint32_t k = 0; k < t->nents; k++)
            if ((t->ents[k].state == TE_LIVE || t->ents[k].state == TE_PENDING) && t->ents[k].ghash == gh) {
                live += t->ents[k].state == TE_LIVE;
                kvf_tier_iremove(t, k);
            }
    pthread_mutex_unlock(&t->mu);
    if (!had) return 0;
    /* The tombstone goes behind any queued write of the key (one FIFO queue,
     * one writer): its seq is higher, so a restart cannot bring the key back. */
    struct kvf_tier_job *j = kvf_tier_job_new();
    if (j) {
        j->op = KVF_JOB_SSD_TOMB;
        j->klen = (uint8_t)klen;
        memcpy(j->key, key, klen);
        kvf_tier_post(t, j);
    } else {
        pthread_mutex_lock(&t->mu);
        t->st.errors++;
        pthread_mutex_unlock(&t->mu);
    }
    return live;
}

/* ---------------------------------------------------------------- write-behind */

void kvf_tier_on_evict(void *arg, const uint8_t *key, uint32_t klen, const uint8_t *val, uint64_t size,
                       uint64_t csum, uint32_t hits, const uint8_t *gkey, uint32_t glen, uint32_t gparts,
                       uint64_t nsref)
{
    struct kvf_tier *t = arg;
    if (t->sh && t->sh_write_evicted) kvf_tier_shared_put(t, key, klen, val, size, csum, nsref);
    if (!t->nfiles) return;
    uint64_t rec = tier_rec_len(size);
    pthread_mutex_lock(&t->mu);
    if ((t->admit == KVF_ADMIT_HIT && hits == 0) || rec > t->seg_size || kvf_tier_ifind(t, key, klen) != TIER_NONE) {
        t->st.admit_skips++; /* not worth writing, larger than a segment, or on the tier already */
        pthread_mutex_unlock(&t->mu);
        return;
    }
    if (t->st.queue_bytes + rec > t->write_queue || t->stop) {
        t->st.write_drops++; /* never a stall: the object is simply not kept */
        pthread_mutex_unlock(&t->mu);
        return;
    }
    t->st.queue_bytes += rec;
    pthread_mutex_unlock(&t->mu);
    /* the copy is made outside the lock (the store keeps the slot until this returns) */
    struct kvf_tier_job *j = kvf_tier_job_new();
    uint8_t *buf = NULL;
    if (j && (buf = kvf_tier_buf_get(t, rec))) {
        memset(buf, 0, KVF_TIER_BLOCK);
        kvf_copy(buf + KVF_TIER_BLOCK, val, size);
        memset(buf + KVF_TIER_BLOCK + size, 0, rec - KVF_TIER_BLOCK - size);
    } else {
        buf = NULL;
    }
    pthread_mutex_lock(&t->mu);
    /* PENDING, tagged with its job: a second eviction of the key is skipped, a
     * DELETE meanwhile unindexes it and the write then indexes nothing */
    uint32_t i = buf ? kvf_tier_iadd(t, key, klen) : TIER_NONE;
    if (i == TIER_NONE) {
        t->st.queue_bytes -= rec;
        t->st.write_drops++;
        pthread_mutex_unlock(&t->mu);
        free(buf);
        free(j);
        return;
    }
    t->ents[i].size = size;
    t->ents[i].csum = csum;
    t->ents[i].loc = (uint64_t)(uintptr_t)j;
    t->ents[i].ghash = glen ? kvf_tier_ghash(gkey, glen) : 0;
    t->ents[i].gparts = gparts;
    t->ents[i].nsref = nsref;
    pthread_mutex_unlock(&t->mu);
    j->nsref = nsref; /* its tag and generation go into the record's header block */
    j->glen = (uint8_t)glen; /* written into the record's header block (kvf_tier_grp_fill) */
    j->gparts = gparts;
    if (glen) memcpy(j->gkey, gkey, glen);
    kvf_tier_post_write(t, j, KVF_JOB_SSD_WRITE, key, klen, size, csum, buf, rec);
}

/* ---------------------------------------------------------------- stats */

void kvf_tier_count(struct kvf_tier *t, uint64_t hits, uint64_t misses, uint64_t promotions)
{
    pthread_mutex_lock(&t->mu);
    t->st.hits += hits;
    t->st.misses += misses;
    t->st.promotions += promotions;
    pthread_mutex_unlock(&t->mu);
}

uint64_t kvf_tier_promote_max(struct kvf_tier *t) { return t->promote_max; }

uint32_t kvf_tier_events_drain(struct kvf_tier *t, struct kvf_tier_event *out, uint32_t max, uint64_t *dropped)
{
    pthread_mutex_lock(&t->mu);
    uint32_t n = t->ev_len < max ? t->ev_len : max;
    for (uint32_t i = 0; i < n; i++) out[i] = t->ev[(t->ev_head + i) % t->ev_cap];
    if (n) {
        t->ev_head = (t->ev_head + n) % t->ev_cap;
        t->ev_len -= n;
    }
    *dropped = t->ev_dropped;
    pthread_mutex_unlock(&t->mu);
    return n;
}

void kvf_tier_stats(struct kvf_tier *t, struct kvf_tier_stats *s)
{
    pthread_mutex_lock(&t->mu);
    *s = t->st;
    pthread_mutex_unlock(&t->mu);
}

void kvf_tier_stats_mw(struct kvf_tier *t, struct kvf_mw *w)
{
    struct kvf_tier_stats s;
    kvf_tier_stats(t, &s);
#define KV(name, v) do { kvf_mw_cstr(w, name); kvf_mw_uint(w, (uint64_t)(v)); } while (0)
    KV("ssd_capacity", s.capacity);
    KV("ssd_objects", s.objects);
    KV("ssd_bytes", s.bytes);
    KV("ssd_hits", s.hits);
    KV("ssd_misses", s.misses);
    KV("ssd_reads", s.reads);
    KV("ssd_read_bytes", s.read_bytes);
    KV("ssd_writes", s.writes);
    KV("ssd_write_bytes", s.write_bytes);
    KV("ssd_write_drops", s.write_drops);
    KV("ssd_admit_skips", s.admit_skips);
    KV("ssd_errors", s.errors);
    KV("ssd_corrupt", s.corrupt);
    KV("ssd_read_us_total", s.read_us_total);
    KV("ssd_write_us_total", s.write_us_total);
    KV("ssd_promotions", s.promotions);
    KV("ssd_groups_torn", s.groups_torn);
    KV("ssd_queue_bytes", s.queue_bytes);
#undef KV
}
