/* kvf_shared.c: the shared-filesystem tier: write once by key, read and verify by key (see kvf_shared.h).
 *
 * Every path is relative to the directory's fd (openat & co.), so the tier
 * keeps working on the directory it validated even if the path is replaced;
 * each fan-out level is opened on its own (O_NOFOLLOW | O_DIRECTORY, then
 * fstat: ours, not writable by others), so no symlink below the root is ever
 * followed (open_leaf). A write is: skip if the final name holds a file of
 * ours (with a MAC key: one whose MAC is this object's); write header + value
 * to an O_EXCL temporary in the final directory; fdatasync (fsync "always");
 * close (NFS reports write errors there); link it into place without
 * replacing (renameat2 NOREPLACE, else link + unlink, else rename), or rename
 * it over a file that readers refuse; fsync the directory ("always"). A read
 * is: open the final name (O_NOFOLLOW | O_NONBLOCK), fstat (a regular file of
 * ours), one preadv of header and value, verify the header (magic, version,
 * lengths, key, header checksum, file length), the value's checksum under the
 * key asked for, then the MAC.
 */
#define _GNU_SOURCE
#include "kvf_shared.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "kvf_hash.h"
#include "kvf_mac.h"
#include "kvf_mpack.h"
#include "kvf_store.h" /* KVF_KEY_MAX */

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the shared tier's file format is little-endian; this file assumes a little-endian host"
#endif

#define HDR_MAX (KVF_SHARED_HEADER_FIXED + KVF_KEY_MAX + KVF_SHARED_MAC_BYTES)
/* a name inside the leaf directory: 2 hex per key byte + ".kvf" / ".<hex>.<16 hex>.<16 hex>.tmp" + NUL */
#define NAME_MAX_LEN (1 + 2 * KVF_KEY_MAX + 2 + 16 + 1 + 16 + 5)

struct kvf_shared {
    int dirfd;
    int fsync_mode;
    uid_t uid, euid;   /* the owner our files get (the probe's), and ours */
    int64_t gid;       /* the tier group, or -1 */
    mode_t fmode, dmode; /* of the files and directories we create */
    uint32_t mac_len;  /* 0: no MAC (version 1 files) */
    uint8_t mac_key[KVF_SHARED_KEY_MAX];
    int no_noreplace; /* renameat2(RENAME_NOREPLACE) unsupported here: use link() */
    int no_link;      /* link() unsupported too: plain rename */
    uint64_t nonce;   /* random per open: temporaries of servers sharing the directory never collide */
    uint64_t seq;
    uint64_t nwritten; /* objects written: every KVF_SHARED_SWEEP_EVERY-th sweeps its directory */
    struct kvf_shared_counters ctr; /* updated with atomics (read by STATS on other threads) */
    /* retirement records (kvf_shared.h). Lock order: rmu, then the tag table's mutex. */
    pthread_mutex_t rmu;
    int rdir;          /* DIR/KVF_SHARED_RETIRED_DIR, or -1 before kvf_shared_retired_open (then fixed) */
    int rfd;           /* this server's records file (appends), or -1 until its first RETIRE: the sink's,
                          serialised by the tag table's mutex (retired_append) */
    uint32_t rfile_n;  /* files this server created (a failed append starts a new one); the sink's */
    struct rfile { dev_t dev; ino_t ino; uint64_t off; } *rfiles; /* under rmu: files read and how far */
    uint32_t nrfiles, caprfiles;
};

#define CTR_ADD(sh, f, v) __atomic_fetch_add(&(sh)->ctr.f, (uint64_t)(v), __ATOMIC_RELAXED)

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* ---------------------------------------------------------------- names */

/* The fan-out directory names of key: "xx" and "yy" (NUL-terminated). */
static void fanout(const uint8_t *key, uint32_t klen, char xx[3], char yy[3])
{
    static const char hx[] = "0123456789abcdef";
    uint64_t h = kvf_xxh3_64(key, klen);
    uint8_t a = (uint8_t)h, b = (uint8_t)(h >> 8);
    xx[0] = hx[a >> 4]; xx[1] = hx[a & 15]; xx[2] = 0;
    yy[0] = hx[b >> 4]; yy[1] = hx[b & 15]; yy[2] = 0;
}

static size_t hexkey(const uint8_t *key, uint32_t klen, char *out)
{
    static const char hx[] = "0123456789abcdef";
    for (uint32_t i = 0; i < klen; i++) { out[2 * i] = hx[key[i] >> 4]; out[2 * i + 1] = hx[key[i] & 15]; }
    return 2 * (size_t)klen;
}

/* The final name "<hex>.kvf" inside the key's leaf directory. */
static void final_name(const uint8_t *key, uint32_t klen, char *out)
{
    size_t n = hexkey(key, klen, out);
    memcpy(out + n, ".kvf", 5);
}

/* ---------------------------------------------------------------- trust */

static int refused(struct kvf_shared *sh)
{
    CTR_ADD(sh, refused, 1);
    return -EPERM;
}

/* 1 when what st describes may be used: owned by the uid our files get (or ours, or of the tier
 * group) and not writable by others. */
static int trusted(const struct kvf_shared *sh, const struct stat *st)
{
    int owner = st->st_uid == sh->uid || st->st_uid == sh->euid || (sh->gid >= 0 && st->st_gid == (gid_t)sh->gid);
    return owner && !(st->st_mode & S_IWOTH);
}

/* Give a file or directory we just created its exact mode (the umask may have cut it) and the tier
 * group; 0 or -errno. */
static int set_mode(const struct kvf_shared *sh, int fd, mode_t mode)
{
    if (sh->gid >= 0 && fchown(fd, (uid_t)-1, (gid_t)sh->gid)) return -errno;
    return fchmod(fd, mode) ? -errno : 0;
}

/* Open the directory `name` under `at` without following a symlink; with `create`, make it when it
 * is absent (0700, or 0770 of the tier group). Returns an fd, -ENOENT (absent), -EPERM (refused: a
 * symlink, not a directory, not ours or writable by others; counted) or -errno. */
static int open_subdir(struct kvf_shared *sh, int at, const char *name, int create)
{
    int made = 0, tried = 0;
    for (;;) {
        int fd = openat(at, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd >= 0) {
            struct stat st;
            int rc = fstat(fd, &st) ? -errno : 0;
            if (!rc && !trusted(sh, &st)) rc = refused(sh);
            if (!rc && made) rc = set_mode(sh, fd, sh->dmode);
            if (rc) { close(fd); return rc; }
            return fd;
        }
        int e = errno;
        if (e == ELOOP || e == ENOTDIR) return refused(sh); /* a symlink, or not a directory */
        if (e != ENOENT || !create || tried) return -e;
        tried = 1;
        if (mkdirat(at, name, 0700) == 0) made = 1;
        else if (errno != EEXIST) return -errno;
    }
}

/* The key's leaf directory DIR/xx/yy, each level opened by open_subdir; an fd or -errno as it. */
static int open_leaf(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, int create)
{
    char xx[3], yy[3];
    fanout(key, klen, xx, yy);
    int a = open_subdir(sh, sh->dirfd, xx, create);
    if (a < 0) return a;
    int b = open_subdir(sh, a, yy, create);
    close(a);
    return b;
}

/* ---------------------------------------------------------------- header */

/* Header bytes of a file of key under this tier: 40 + klen, + the MAC with a MAC key. */
static uint32_t header_len(const struct kvf_shared *sh, uint32_t klen)
{
    return KVF_SHARED_HEADER_FIXED + klen + (sh->mac_len ? KVF_SHARED_MAC_BYTES : 0);
}

/* The file's MAC: HMAC-SHA256(token, label || header bytes [0, 32 + klen) || value [|| trailer]). */
static void file_mac(const struct kvf_shared *sh, const uint8_t *h, uint32_t klen, const uint8_t *val,
                     uint64_t size, const uint8_t *trailer, uint8_t out[KVF_SHARED_MAC_BYTES])
{
    const void *parts[4] = {KVF_SHARED_MAC_LABEL, h};
    size_t lens[4] = {sizeof KVF_SHARED_MAC_LABEL, 32 + (size_t)klen};
    size_t n = 2;
    if (size) { parts[n] = val; lens[n++] = (size_t)size; }
    if (trailer) { parts[n] = trailer; lens[n++] = KVF_SHARED_NS_BYTES; }
    kvf_hmac_sha256(sh->mac_key, sh->mac_len, n, parts, lens, out);
}

/* The namespace trailer of a tagged file whose header is h (its checksum at h + 32 + klen). */
static uint64_t trailer_csum(const uint8_t *h, uint32_t klen, const uint8_t *tr)
{
    return kvf_obj_hash(h + 32 + klen, 8, tr, 24);
}

static void trailer_build(const uint8_t *h, uint32_t klen, const struct kvf_shared_ns *ns, uint8_t *tr)
{
    memset(tr, 0, KVF_SHARED_NS_BYTES);
    memcpy(tr, ns->tag, KVF_NS_TAG_BYTES);
    memcpy(tr + 16, &ns->gen, 4);
    put64(tr + 24, trailer_csum(h, klen, tr));
}

/* 0 and *ns filled when tr is a valid trailer of the header h; -EBADMSG. */
static int trailer_check(const uint8_t *h, uint32_t klen, const uint8_t *tr, struct kvf_shared_ns *ns)
{
    uint32_t zero;
    memcpy(&zero, tr + 20, 4);
    if (zero || get64(tr + 24) != trailer_csum(h, klen, tr)) return -EBADMSG;
    ns->tagged = 1;
    memcpy(ns->tag, tr, KVF_NS_TAG_BYTES);
    memcpy(&ns->gen, tr + 16, 4);
    return 0;
}

/* The header of key's file into h (and with ns tagged, its trailer into tr); its length. */
static size_t header_build(const struct kvf_shared *sh, uint8_t *h, const uint8_t *key, uint32_t klen,
                           const uint8_t *val, uint64_t size, uint64_t csum, const struct kvf_shared_ns *ns,
                           uint8_t *tr)
{
    int tagged = ns && ns->tagged;
    uint32_t hlen = header_len(sh, klen);
    memset(h, 0, 32);
    memcpy(h, KVF_SHARED_MAGIC, 4);
    put16(h + 4, sh->mac_len ? KVF_SHARED_VERSION_MAC : KVF_SHARED_VERSION);
    put16(h + 6, (uint16_t)hlen);
    h[8] = (uint8_t)klen;
    h[9] = tagged ? KVF_SHARED_F_NS : 0;
    put64(h + 16, size);
    put64(h + 24, csum);
    memcpy(h + 32, key, klen);
    put64(h + 32 + klen, kvf_xxh3_64(h, 32 + klen));
    if (tagged) trailer_build(h, klen, ns, tr);
    if (sh->mac_len) file_mac(sh, h, klen, val, size, tagged ? tr : NULL, h + KVF_SHARED_HEADER_FIXED + klen);
    return hlen;
}

/* -EPERM (counted in mac_refused) when h (8 bytes at least) starts a file of
 * the other version: with a MAC when this tier has no key, or without one
 * when it has; else 0. */
static int other_version(struct kvf_shared *sh, const uint8_t *h)
{
    uint16_t v = get16(h + 4), other = sh->mac_len ? KVF_SHARED_VERSION : KVF_SHARED_VERSION_MAC;
    if (memcmp(h, KVF_SHARED_MAGIC, 4) || v != other) return 0;
    CTR_ADD(sh, mac_refused, 1);
    return -EPERM;
}

/* 0 when h (header_len bytes read) is a valid header of this tier's version
 * for key whose value is file_size - hlen bytes long (- the trailer when the
 * flags say tagged: *tagged); its size and checksum out; -EPERM for a file of
 * the other version (other_version); -EBADMSG otherwise. The MAC itself is
 * checked once the value is read. */
static int header_check(struct kvf_shared *sh, const uint8_t *h, const uint8_t *key, uint32_t klen,
                        uint64_t file_size, uint64_t *size, uint64_t *csum, int *tagged)
{
    uint32_t hlen = header_len(sh, klen);
    uint16_t want = sh->mac_len ? KVF_SHARED_VERSION_MAC : KVF_SHARED_VERSION;
    if (other_version(sh, h)) return -EPERM;
    if (memcmp(h, KVF_SHARED_MAGIC, 4) || get16(h + 4) != want || get16(h + 6) != hlen ||
        h[8] != klen || memcmp(h + 32, key, klen))
        return -EBADMSG;
    if (h[9] & ~KVF_SHARED_F_NS) return -EBADMSG;
    for (int i = 10; i < 16; i++)
        if (h[i]) return -EBADMSG;
    if (get64(h + 32 + klen) != kvf_xxh3_64(h, 32 + klen)) return -EBADMSG;
    *size = get64(h + 16);
    *csum = get64(h + 24);
    *tagged = h[9] & KVF_SHARED_F_NS;
    uint64_t extra = *tagged ? KVF_SHARED_NS_BYTES : 0;
    if (file_size < hlen + extra || *size != file_size - hlen - extra) return -EBADMSG; /* torn or grown */
    return 0;
}

/* ---------------------------------------------------------------- open */

int kvf_shared_open(struct kvf_shared **out, const struct kvf_shared_cfg *cfg)
{
    *out = NULL;
    if (cfg->fsync_mode != KVF_SHARED_FSYNC_NEVER && cfg->fsync_mode != KVF_SHARED_FSYNC_ALWAYS) return -EINVAL;
    if (cfg->gid < -1 || cfg->gid >= (int64_t)UINT32_MAX) return -EINVAL;
    if (cfg->mac_key && (cfg->mac_key_len == 0 || cfg->mac_key_len > KVF_SHARED_KEY_MAX)) return -EINVAL;
    int dfd = open(cfg->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return -errno;
    struct kvf_shared *sh = calloc(1, sizeof *sh);
    if (!sh) { close(dfd); return -ENOMEM; }
    sh->dirfd = dfd;
    sh->rdir = sh->rfd = -1;
    pthread_mutex_init(&sh->rmu, NULL);
    sh->fsync_mode = cfg->fsync_mode;
    sh->gid = cfg->gid;
    sh->fmode = cfg->gid >= 0 ? 0640 : 0600;
    sh->dmode = cfg->gid >= 0 ? 0770 : 0700;
    sh->euid = geteuid();
    if (cfg->mac_key) {
        memcpy(sh->mac_key, cfg->mac_key, cfg->mac_key_len);
        sh->mac_len = cfg->mac_key_len;
    }
    if (getrandom(&sh->nonce, sizeof sh->nonce, GRND_NONBLOCK) != (ssize_t)sizeof sh->nonce)
        sh->nonce = now_us() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)sh;
    /* probe: can we create, write and remove a file here? Its owner is the uid our files get. */
    char probe[48];
    snprintf(probe, sizeof probe, ".probe.%016llx.tmp", (unsigned long long)sh->nonce);
    int fd = openat(dfd, probe, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    int rc = 0;
    if (fd < 0) {
        rc = -errno;
    } else {
        struct stat st;
        if (fstat(fd, &st)) rc = -errno;
        else sh->uid = st.st_uid;
        if (!rc && write(fd, "k", 1) != 1) rc = errno ? -errno : -EIO;
        if (!rc && cfg->fsync_mode == KVF_SHARED_FSYNC_ALWAYS && fdatasync(fd)) rc = -errno;
        if (close(fd) && !rc) rc = -errno;
        if (unlinkat(dfd, probe, 0) && !rc) rc = -errno;
    }
    if (rc) {
        close(dfd);
        pthread_mutex_destroy(&sh->rmu);
        explicit_bzero(sh->mac_key, sizeof sh->mac_key);
        free(sh);
        return rc;
    }
    *out = sh;
    return 0;
}

void kvf_shared_close(struct kvf_shared *sh)
{
    if (!sh) return;
    close(sh->dirfd);
    if (sh->rdir >= 0) close(sh->rdir);
    if (sh->rfd >= 0) close(sh->rfd);
    free(sh->rfiles);
    pthread_mutex_destroy(&sh->rmu);
    explicit_bzero(sh->mac_key, sizeof sh->mac_key);
    free(sh);
}

/* ---------------------------------------------------------------- read */

/* A file that failed verification: unlink name (in the leaf directory dfd)
 * if it is still the file fd has open (a writer may have put a good one
 * there since), count it. */
static int drop_corrupt(struct kvf_shared *sh, int dfd, const char *name, int fd)
{
    struct stat a, b;
    if (fstat(fd, &a) == 0 && fstatat(dfd, name, &b, AT_SYMLINK_NOFOLLOW) == 0 && a.st_dev == b.st_dev &&
        a.st_ino == b.st_ino)
        unlinkat(dfd, name, 0);
    CTR_ADD(sh, corrupt, 1);
    return -EBADMSG;
}

/* Read exactly the iovecs' bytes at offset off; 0, -EBADMSG at a short read
 * (the file is shorter than it said: torn), -errno. */
static int read_full_at(int fd, off_t off, struct iovec *iov, int n)
{
    while (n > 0) {
        ssize_t r = preadv(fd, iov, n, off);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) return -EBADMSG;
        off += r;
        while (n > 0 && (size_t)r >= iov->iov_len) { r -= (ssize_t)iov->iov_len; iov++; n--; }
        if (n > 0) { iov->iov_base = (uint8_t *)iov->iov_base + r; iov->iov_len -= (size_t)r; }
    }
    return 0;
}

static int read_full(int fd, struct iovec *iov, int n) { return read_full_at(fd, 0, iov, n); }

/* Open name in the leaf directory dfd for reading: never following a
 * symlink, never blocking (a FIFO), and only a regular file of ours (fstat
 * into *st). An fd, -ENOENT, -EPERM (refused, counted) or -errno. */
static int open_file(struct kvf_shared *sh, int dfd, const char *name, struct stat *st)
{
    int fd = openat(dfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT) return -ENOENT;
        if (e == ELOOP || e == ENXIO) return refused(sh); /* a symlink; a socket */
        return -e;
    }
    if (fstat(fd, st)) { int e = errno; close(fd); return -e; }
    if (!S_ISREG(st->st_mode) || !trusted(sh, st)) { close(fd); return refused(sh); }
    return fd;
}

/* Where a read puts the value: dst[0..cap), or a buffer alloc gives once the size is known. */
struct dest {
    uint8_t *dst;
    uint64_t cap;
    kvf_shared_alloc_fn alloc;
    void *arg;
};

/* The open object of a read: its leaf directory, its name there, the file and its header. */
struct obj {
    int dfd, fd;
    char name[NAME_MAX_LEN];
    uint8_t h[HDR_MAX];
    int tagged;
    uint8_t tr[KVF_SHARED_NS_BYTES]; /* the namespace trailer (tagged) */
    struct kvf_shared_ns ns;
};

static void obj_close(struct obj *o)
{
    if (o->fd >= 0) close(o->fd);
    if (o->dfd >= 0) close(o->dfd);
}

/* Open key's file and read (and check) its header; the value too when it
 * fits in d (or alloc made room for it). 0 with o's fds open (obj_close);
 * -ENOENT; -EPERM (refused, counted); -EBADMSG (dropped, counted); alloc's
 * -errno; other -errno (counted). */
static int open_object(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, struct obj *o, struct dest *d,
                       uint64_t *size, uint64_t *csum)
{
    o->dfd = o->fd = -1;
    o->tagged = 0;
    memset(&o->ns, 0, sizeof o->ns);
    int rc = open_leaf(sh, key, klen, 0);
    if (rc < 0) {
        if (rc == -ENOENT || rc == -EPERM) return rc;
        CTR_ADD(sh, errors, 1);
        return rc;
    }
    o->dfd = rc;
    final_name(key, klen, o->name);
    struct stat st;
    rc = open_file(sh, o->dfd, o->name, &st);
    if (rc < 0) {
        if (rc != -ENOENT && rc != -EPERM) CTR_ADD(sh, errors, 1);
        return rc;
    }
    o->fd = rc;
    uint32_t hlen = header_len(sh, klen);
    uint64_t file_size = (uint64_t)st.st_size;
    if (file_size < hlen) {
        /* too short for a header of ours: a file of the other version (refused) or torn */
        struct iovec iov = {o->h, 8};
        rc = file_size >= 8 ? read_full(o->fd, &iov, 1) : -EBADMSG;
        if (rc == 0 && other_version(sh, o->h)) return -EPERM;
        if (rc == 0 || rc == -EBADMSG) return drop_corrupt(sh, o->dfd, o->name, o->fd);
        CTR_ADD(sh, errors, 1);
        return rc;
    }
    uint64_t vs = file_size - hlen; /* the value's size if the header agrees (checked below) */
    if (d->alloc && vs) {
        rc = d->alloc(d->arg, vs, &d->dst);
        if (rc) return rc;
        d->cap = vs;
    }
    struct iovec iov[2] = {{o->h, hlen}, {d->dst, vs}};
    int whole = d->dst && vs && vs <= d->cap; /* the value (and a trailer) read with the header */
    rc = read_full(o->fd, iov, whole ? 2 : 1);
    if (rc == 0) rc = header_check(sh, o->h, key, klen, file_size, size, csum, &o->tagged);
    if (rc == 0 && o->tagged) {
        if (whole) {
            memcpy(o->tr, d->dst + *size, KVF_SHARED_NS_BYTES); /* the trailer landed after the value */
        } else { /* the value (when it fits) and the trailer, after the header */
            int val = d->dst && *size && *size <= d->cap;
            struct iovec tv[2] = {{d->dst, *size}, {o->tr, KVF_SHARED_NS_BYTES}};
            rc = read_full_at(o->fd, (off_t)(hlen + (val ? 0 : *size)), val ? tv : tv + 1, val ? 2 : 1);
        }
        if (rc == 0) rc = trailer_check(o->h, klen, o->tr, &o->ns);
    }
    if (rc == -EBADMSG) return drop_corrupt(sh, o->dfd, o->name, o->fd);
    if (rc && rc != -EPERM) CTR_ADD(sh, errors, 1);
    return rc;
}

static int read_object(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, struct dest *d, uint64_t *size,
                       uint64_t *csum, struct kvf_shared_ns *ns)
{
    memset(ns, 0, sizeof *ns);
    if (klen == 0 || klen > KVF_KEY_MAX) return -EINVAL;
    if (!d->dst && !d->alloc) d->cap = 0;
    uint64_t t0 = now_us();
    struct obj o;
    uint64_t sz = 0, cs = 0;
    int rc = open_object(sh, key, klen, &o, d, &sz, &cs);
    if (rc == -ENOENT) {
        CTR_ADD(sh, misses, 1);
    } else if (rc == 0) {
        if (sz > d->cap) {
            *size = sz;
            rc = -E2BIG;
        } else {
            CTR_ADD(sh, reads, 1);
            uint8_t mac[KVF_SHARED_MAC_BYTES];
            if (kvf_obj_hash(key, klen, d->dst, sz) != cs) {
                rc = drop_corrupt(sh, o.dfd, o.name, o.fd);
            } else if (sh->mac_len &&
                       (file_mac(sh, o.h, klen, d->dst, sz, o.tagged ? o.tr : NULL, mac),
                        !kvf_ct_equal(mac, o.h + KVF_SHARED_HEADER_FIXED + klen, KVF_SHARED_MAC_BYTES))) {
                CTR_ADD(sh, mac_refused, 1); /* written without the token: refused, left for the writer to replace */
                rc = -EPERM;
            } else {
                *size = sz;
                *csum = cs;
                *ns = o.ns;
                CTR_ADD(sh, hits, 1);
                CTR_ADD(sh, read_bytes, sz);
            }
        }
    } else if (rc == -EBADMSG) {
        CTR_ADD(sh, reads, 1);
    }
    obj_close(&o);
    CTR_ADD(sh, read_us, now_us() - t0);
    return rc;
}

int kvf_shared_read(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, uint8_t *dst, uint64_t cap,
                    uint64_t *size, uint64_t *csum, struct kvf_shared_ns *ns)
{
    struct dest d = {dst, cap, NULL, NULL};
    return read_object(sh, key, klen, &d, size, csum, ns);
}

int kvf_shared_read_alloc(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, kvf_shared_alloc_fn alloc,
                          void *arg, uint64_t *size, uint64_t *csum, struct kvf_shared_ns *ns)
{
    struct dest d = {NULL, 0, alloc, arg};
    return read_object(sh, key, klen, &d, size, csum, ns);
}

/* ---------------------------------------------------------------- write */

static int write_full(int fd, struct iovec *iov, int n)
{
    off_t off = 0;
    while (n > 0) {
        ssize_t r = pwritev(fd, iov, n, off);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) return -EIO;
        off += r;
        while (n > 0 && (size_t)r >= iov->iov_len) { r -= (ssize_t)iov->iov_len; iov++; n--; }
        if (n > 0) { iov->iov_base = (uint8_t *)iov->iov_base + r; iov->iov_len -= (size_t)r; }
    }
    return 0;
}

/* Move tmp to name (both in the leaf directory dfd) unless name exists. 0 moved, -EEXIST (tmp left
 * for the caller), -errno. */
static int link_into_place(struct kvf_shared *sh, int dfd, const char *tmp, const char *name)
{
    if (!__atomic_load_n(&sh->no_noreplace, __ATOMIC_RELAXED)) {
        if (renameat2(dfd, tmp, dfd, name, RENAME_NOREPLACE) == 0) return 0;
        if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP) return -errno;
        __atomic_store_n(&sh->no_noreplace, 1, __ATOMIC_RELAXED);
    }
    if (!__atomic_load_n(&sh->no_link, __ATOMIC_RELAXED)) {
        if (linkat(dfd, tmp, dfd, name, 0) == 0) {
            unlinkat(dfd, tmp, 0);
            return 0;
        }
        if (errno != EPERM && errno != ENOSYS && errno != EOPNOTSUPP) return -errno;
        __atomic_store_n(&sh->no_link, 1, __ATOMIC_RELAXED);
    }
    /* No exclusive link on this filesystem: a concurrent writer of the same key
     * wrote a verified copy of the same object, so replacing it is harmless. */
    if (faccessat(dfd, name, F_OK, AT_SYMLINK_NOFOLLOW) == 0) return -EEXIST;
    return renameat(dfd, tmp, dfd, name) ? -errno : 0;
}

/* Remove the temporaries older than KVF_SHARED_TMP_STALE_S in the leaf
 * directory dfd: what writers that died before their rename left (a live
 * writer's temporary is seconds old). Best effort, no return. */
static void sweep_dir(int dfd)
{
    int fd = dup(dfd);
    if (fd < 0) return;
    DIR *dp = fdopendir(fd);
    if (!dp) { close(fd); return; }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    struct dirent *e;
    while ((e = readdir(dp))) {
        size_t n = strlen(e->d_name);
        struct stat st;
        if (e->d_name[0] != '.' || n < 6 || strcmp(e->d_name + n - 4, ".tmp")) continue;
        if (fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) || !S_ISREG(st.st_mode)) continue;
        if (now.tv_sec - st.st_mtime >= KVF_SHARED_TMP_STALE_S) unlinkat(fd, e->d_name, 0);
    }
    closedir(dp); /* closes fd */
}

/* What a write finds at the key's name (the leaf directory dfd): 0 nothing, 1 a file of this object
 * that readers serve and that need not be replaced, 2 something to replace: what readers refuse (a
 * symlink, a FIFO, another uid's file, another version, a wrong MAC, another length), or a file of
 * this key whose namespace differs from ns (untagged where ns is tagged or the reverse, another tag,
 * an older generation: readers would miss it). With a MAC key, 1 only for a file whose MAC is `mac`
 * (the same object at the same generation); without one, a file of this tag at a newer generation
 * than ns's is kept (1). Anything it cannot look at counts as 2 as well. */
static int found_at_name(struct kvf_shared *sh, int dfd, const char *name, uint32_t klen, uint64_t size,
                         const uint8_t *mac, const struct kvf_shared_ns *ns)
{
    struct stat st;
    int tagged = ns && ns->tagged;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW)) return errno == ENOENT ? 0 : 2;
    if (!S_ISREG(st.st_mode) || !trusted(sh, &st)) return 2;
    uint32_t hlen = header_len(sh, klen);
    if ((uint64_t)st.st_size != hlen + size + (tagged ? KVF_SHARED_NS_BYTES : 0)) return 2;
    if (!sh->mac_len && !tagged) return 1; /* as before namespaces: the file's flags are checked below only when
                                              tagged (an untagged file of this length is this object's) */
    int fd = openat(dfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return 2;
    uint8_t h[HDR_MAX], tr[KVF_SHARED_NS_BYTES];
    struct iovec iov = {h, hlen}, tv = {tr, sizeof tr};
    struct kvf_shared_ns fns;
    memset(&fns, 0, sizeof fns);
    int ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && read_full(fd, &iov, 1) == 0 &&
             get16(h + 4) == (sh->mac_len ? KVF_SHARED_VERSION_MAC : KVF_SHARED_VERSION) &&
             (h[9] & KVF_SHARED_F_NS) == (tagged ? KVF_SHARED_F_NS : 0);
    if (ok && sh->mac_len) ok = kvf_ct_equal(h + KVF_SHARED_HEADER_FIXED + klen, mac, KVF_SHARED_MAC_BYTES);
    else if (ok) /* tagged, no MAC: keep a valid trailer of this tag at this generation or a newer one */
        ok = read_full_at(fd, (off_t)(hlen + size), &tv, 1) == 0 && get64(h + 32 + klen) == kvf_xxh3_64(h, 32 + klen) &&
             trailer_check(h, klen, tr, &fns) == 0 && memcmp(fns.tag, ns->tag, KVF_NS_TAG_BYTES) == 0 &&
             fns.gen >= ns->gen;
    close(fd);
    return ok ? 1 : 2;
}

int kvf_shared_write(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, const uint8_t *src, uint64_t size,
                     uint64_t csum, const struct kvf_shared_ns *ns)
{
    if (ns && !ns->tagged) ns = NULL;
    if (klen == 0 || klen > KVF_KEY_MAX) return -EINVAL;
    if (kvf_obj_hash(key, klen, src, size) != csum) { CTR_ADD(sh, errors, 1); return -EBADMSG; }
    uint64_t t0 = now_us();
    char name[NAME_MAX_LEN], tmp[NAME_MAX_LEN];
    uint8_t h[HDR_MAX], tr[KVF_SHARED_NS_BYTES];
    size_t hlen = header_build(sh, h, key, klen, src, size, csum, ns, tr);
    final_name(key, klen, name);
    int dfd = open_leaf(sh, key, klen, 1);
    int rc = dfd < 0 ? dfd : 0, replace = 0;
    if (!rc) {
        replace = found_at_name(sh, dfd, name, klen, size, h + KVF_SHARED_HEADER_FIXED + klen, ns);
        if (replace == 1) rc = -EEXIST;
    }
    int fd = -1;
    if (!rc) {
        tmp[0] = '.';
        size_t n = 1 + hexkey(key, klen, tmp + 1);
        snprintf(tmp + n, sizeof tmp - n, ".%016llx.%016llx.tmp", (unsigned long long)sh->nonce,
                 (unsigned long long)__atomic_fetch_add(&sh->seq, 1, __ATOMIC_RELAXED));
        fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, sh->fmode);
        if (fd < 0) rc = -errno;
        else rc = set_mode(sh, fd, sh->fmode); /* whatever the umask */
    }
    if (fd >= 0) {
        struct iovec iov[3] = {{h, hlen}, {(void *)src, size}, {tr, KVF_SHARED_NS_BYTES}};
        int n = 1;
        if (size) n++;
        else iov[1] = iov[2];
        if (ns) n++;
        if (!rc) rc = write_full(fd, iov, n);
        if (!rc && sh->fsync_mode == KVF_SHARED_FSYNC_ALWAYS && fdatasync(fd)) rc = -errno;
        if (close(fd) && !rc) rc = -errno; /* NFS reports write errors at close */
        if (!rc) rc = replace ? (renameat(dfd, tmp, dfd, name) ? -errno : 0) : link_into_place(sh, dfd, tmp, name);
        if (rc) unlinkat(dfd, tmp, 0);
    }
    if (rc) {
        if (rc == -EEXIST) CTR_ADD(sh, exists, 1);
        else if (rc != -EPERM) CTR_ADD(sh, errors, 1); /* a refused fan-out directory is counted in refused */
        if (dfd >= 0) close(dfd);
        CTR_ADD(sh, write_us, now_us() - t0);
        return rc;
    }
    if (sh->fsync_mode == KVF_SHARED_FSYNC_ALWAYS && fsync(dfd) && errno != EINVAL)
        CTR_ADD(sh, errors, 1); /* EINVAL: some filesystems cannot sync a directory */
    if (__atomic_fetch_add(&sh->nwritten, 1, __ATOMIC_RELAXED) % KVF_SHARED_SWEEP_EVERY == 0) sweep_dir(dfd);
    close(dfd);
    if (replace) CTR_ADD(sh, replaced, 1);
    CTR_ADD(sh, writes, 1);
    CTR_ADD(sh, write_bytes, size);
    CTR_ADD(sh, write_us, now_us() - t0);
    return 0;
}

int kvf_shared_delete(struct kvf_shared *sh, const uint8_t *key, uint32_t klen)
{
    if (klen == 0 || klen > KVF_KEY_MAX) return -EINVAL;
    char name[NAME_MAX_LEN];
    final_name(key, klen, name);
    int dfd = open_leaf(sh, key, klen, 0);
    if (dfd == -ENOENT || dfd == -EPERM) return 0; /* no leaf directory of ours: nothing of ours to remove */
    if (dfd < 0) { CTR_ADD(sh, errors, 1); return dfd; }
    int rc = unlinkat(dfd, name, 0) == 0 ? 1 : (errno == ENOENT || errno == ENOTDIR) ? 0 : -errno;
    close(dfd);
    if (rc < 0) CTR_ADD(sh, errors, 1);
    return rc;
}

/* ---------------------------------------------------------------- retirement records */

/* The record of (tag, gen) into r (KVF_SHARED_RETIRE_REC bytes). */
static void rec_build(const struct kvf_shared *sh, uint8_t *r, const uint8_t *tag, uint32_t gen)
{
    memset(r, 0, KVF_SHARED_RETIRE_REC);
    memcpy(r, "KVFR", 4);
    put16(r + 4, sh->mac_len ? 2 : 1);
    put16(r + 6, KVF_SHARED_RETIRE_REC);
    memcpy(r + 8, tag, KVF_NS_TAG_BYTES);
    memcpy(r + 24, &gen, 4);
    put64(r + 32, kvf_xxh3_64(r, 32));
    if (sh->mac_len) {
        const void *parts[2] = {KVF_SHARED_RETIRE_LABEL, r};
        const size_t lens[2] = {sizeof KVF_SHARED_RETIRE_LABEL, 32};
        kvf_hmac_sha256(sh->mac_key, sh->mac_len, 2, parts, lens, r + 40);
    }
}

/* 0 and (tag, gen) out when r is a valid record for this server (with a MAC key: version 2 and
 * its MAC; without: version 1), -EBADMSG. */
static int rec_check(const struct kvf_shared *sh, const uint8_t *r, uint8_t *tag, uint32_t *gen)
{
    uint32_t zero;
    memcpy(&zero, r + 28, 4);
    if (memcmp(r, "KVFR", 4) || get16(r + 4) != (sh->mac_len ? 2 : 1) || get16(r + 6) != KVF_SHARED_RETIRE_REC ||
        zero || get64(r + 32) != kvf_xxh3_64(r, 32))
        return -EBADMSG;
    if (sh->mac_len) {
        uint8_t mac[KVF_SHARED_MAC_BYTES];
        const void *parts[2] = {KVF_SHARED_RETIRE_LABEL, r};
        const size_t lens[2] = {sizeof KVF_SHARED_RETIRE_LABEL, 32};
        kvf_hmac_sha256(sh->mac_key, sh->mac_len, 2, parts, lens, mac);
        if (!kvf_ct_equal(mac, r + 40, KVF_SHARED_MAC_BYTES)) return -EBADMSG;
    }
    memcpy(tag, r + 8, KVF_NS_TAG_BYTES);
    memcpy(gen, r + 24, 4);
    return 0;
}

/* Under rmu: the new whole records of the records file `name` (in sh->rdir) into ns. Refused
 * files (a symlink, a FIFO, not ours) are skipped and counted; 0 or -errno (-E2BIG: too many files). */
static int load_file(struct kvf_shared *sh, struct kvf_ns *ns, const char *name)
{
    int fd = openat(sh->rdir, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        if (errno == ENOENT) return 0;
        if (errno == ELOOP || errno == ENXIO) { refused(sh); return 0; }
        return -errno;
    }
    struct stat st;
    if (fstat(fd, &st)) { int e = -errno; close(fd); return e; }
    if (!S_ISREG(st.st_mode) || !trusted(sh, &st)) { close(fd); refused(sh); return 0; }
    struct rfile *f = NULL;
    for (uint32_t i = 0; i < sh->nrfiles && !f; i++)
        if (sh->rfiles[i].dev == st.st_dev && sh->rfiles[i].ino == st.st_ino) f = &sh->rfiles[i];
    if (!f) {
        if (sh->nrfiles == KVF_SHARED_RETIRED_FILES_MAX) { close(fd); return -E2BIG; }
        if (sh->nrfiles == sh->caprfiles) {
            uint32_t cap = sh->caprfiles ? 2 * sh->caprfiles : 16;
            struct rfile *nf = realloc(sh->rfiles, cap * sizeof *nf);
            if (!nf) { close(fd); return -ENOMEM; }
            sh->rfiles = nf;
            sh->caprfiles = cap;
        }
        f = &sh->rfiles[sh->nrfiles++];
        f->dev = st.st_dev;
        f->ino = st.st_ino;
        f->off = 0;
    }
    uint64_t end = (uint64_t)st.st_size - (uint64_t)st.st_size % KVF_SHARED_RETIRE_REC; /* whole records only */
    int rc = 0;
    uint8_t buf[KVF_SHARED_RETIRE_REC * 64];
    while (f->off < end && !rc) {
        uint64_t n = end - f->off < sizeof buf ? end - f->off : sizeof buf;
        struct iovec iov = {buf, (size_t)n};
        if ((rc = read_full_at(fd, (off_t)f->off, &iov, 1))) break;
        for (uint64_t o = 0; o < n; o += KVF_SHARED_RETIRE_REC) {
            uint8_t tag[KVF_NS_TAG_BYTES];
            uint32_t gen;
            uint64_t ref;
            if (rec_check(sh, buf + o, tag, &gen)) { CTR_ADD(sh, retire_bad, 1); continue; }
            /* the generation only grows; a tag past a full table is not held (its files are misses) */
            (void)kvf_ns_reref(ns, tag, gen, &ref);
        }
        f->off += n;
    }
    close(fd);
    return rc == -EBADMSG ? 0 : rc; /* shorter than fstat said: truncated meanwhile, read again next time */
}

int kvf_shared_retired_load(struct kvf_shared *sh, struct kvf_ns *ns)
{
    pthread_mutex_lock(&sh->rmu);
    int rc = sh->rdir < 0 ? -EBADF : 0;
    int fd = rc ? -1 : dup(sh->rdir);
    DIR *dp = fd < 0 ? NULL : fdopendir(fd);
    if (!rc && !dp) { rc = -errno; if (fd >= 0) close(fd); }
    if (dp) {
        rewinddir(dp);
        struct dirent *e;
        while (!rc && (e = readdir(dp))) {
            size_t n = strlen(e->d_name);
            if (e->d_name[0] == '.' || n < 5 || strcmp(e->d_name + n - 4, ".rec")) continue;
            rc = load_file(sh, ns, e->d_name);
        }
        closedir(dp); /* closes fd */
    }
    pthread_mutex_unlock(&sh->rmu);
    if (rc && rc != -E2BIG && rc != -EBADF) CTR_ADD(sh, errors, 1);
    return rc;
}

/* kvf_ns's sink (kvf_ns_retire, under the table's mutex, which serialises the appends: rfd and
 * rfile_n are only touched here; rmu is NOT taken, since kvf_shared_retired_load holds rmu while
 * it takes the table's mutex): append (tag, gen) to this server's records file, created on first
 * use, and fdatasync it. A failed or short append closes the file (its tail may be a partial
 * record) and the next RETIRE starts a new one. */
static int retired_append(void *arg, const uint8_t tag[KVF_NS_TAG_BYTES], uint32_t gen)
{
    struct kvf_shared *sh = arg;
    uint8_t r[KVF_SHARED_RETIRE_REC];
    rec_build(sh, r, tag, gen);
    int rc = 0;
    if (sh->rfd < 0) {
        char name[64];
        snprintf(name, sizeof name, "%016llx-%u.rec", (unsigned long long)sh->nonce, sh->rfile_n++);
        int fd = openat(sh->rdir, name, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC | O_NOFOLLOW, sh->fmode);
        if (fd < 0) rc = -errno;
        else if ((rc = set_mode(sh, fd, sh->fmode))) close(fd);
        else sh->rfd = fd;
        if (!rc && sh->fsync_mode == KVF_SHARED_FSYNC_ALWAYS && fsync(sh->rdir) && errno != EINVAL) rc = -errno;
    }
    if (!rc) {
        ssize_t w = write(sh->rfd, r, sizeof r);
        rc = w == (ssize_t)sizeof r ? 0 : w < 0 ? -errno : -EIO;
        if (!rc && fdatasync(sh->rfd)) rc = -errno; /* always: a retirement must outlive this server */
        if (rc) { close(sh->rfd); sh->rfd = -1; }
    }
    if (rc) CTR_ADD(sh, errors, 1);
    return rc;
}

int kvf_shared_retired_open(struct kvf_shared *sh, struct kvf_ns *ns)
{
    pthread_mutex_lock(&sh->rmu);
    int rc = sh->rdir >= 0 ? -EALREADY : open_subdir(sh, sh->dirfd, KVF_SHARED_RETIRED_DIR, 1);
    if (rc >= 0) { sh->rdir = rc; rc = 0; }
    pthread_mutex_unlock(&sh->rmu);
    if (!rc) rc = kvf_shared_retired_load(sh, ns);
    if (!rc) kvf_ns_set_sink(ns, retired_append, sh);
    return rc;
}

/* ---------------------------------------------------------------- counters */

void kvf_shared_count_drop(struct kvf_shared *sh) { CTR_ADD(sh, write_drops, 1); }
void kvf_shared_count_retired(struct kvf_shared *sh) { CTR_ADD(sh, retired, 1); }

void kvf_shared_counters(struct kvf_shared *sh, struct kvf_shared_counters *out)
{
    const uint64_t *src = (const uint64_t *)&sh->ctr;
    uint64_t *dst = (uint64_t *)out;
    for (size_t i = 0; i < sizeof *out / sizeof(uint64_t); i++) dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
}

uint32_t kvf_shared_stats_pairs(const struct kvf_shared *sh) { return sh ? KVF_SHARED_STATS_PAIRS : 0; }

void kvf_shared_stats_write(struct kvf_shared *sh, struct kvf_mw *w)
{
    if (!sh) return;
    struct kvf_shared_counters c;
    kvf_shared_counters(sh, &c);
    const char *names[KVF_SHARED_STATS_PAIRS] = {
        "shared_hits", "shared_misses", "shared_reads", "shared_read_bytes", "shared_writes", "shared_write_bytes",
        "shared_write_drops", "shared_errors", "shared_corrupt", "shared_exists", "shared_read_us_total",
        "shared_write_us_total", "shared_refused", "shared_mac_refused", "shared_replaced", "shared_retired",
        "shared_retire_bad"};
    const uint64_t v[KVF_SHARED_STATS_PAIRS] = {c.hits,        c.misses,   c.reads,    c.read_bytes,  c.writes,
                                                c.write_bytes, c.write_drops, c.errors, c.corrupt,    c.exists,
                                                c.read_us,     c.write_us, c.refused,  c.mac_refused, c.replaced,
                                                c.retired,     c.retire_bad};
    for (uint32_t i = 0; i < KVF_SHARED_STATS_PAIRS; i++) {
        kvf_mw_cstr(w, names[i]);
        kvf_mw_uint(w, v[i]);
    }
}
