/* kvf_shared.c: the shared-filesystem tier: write once by key, read and verify by key (see kvf_shared.h).
 *
 * Every path is relative to the directory's fd (openat & co.), so the tier
 * keeps working on the directory it validated even if the path is replaced.
 * A write is: skip if the final name exists; write header + value to an
 * O_EXCL temporary in the final directory; fdatasync (fsync "always"); close
 * (NFS reports write errors there); link it into place without replacing
 * (renameat2 NOREPLACE, else link + unlink, else rename); fsync the directory
 * ("always"). A read is: open the final name, fstat, one preadv of header and
 * value, verify the header (magic, version, lengths, key, header checksum,
 * file length) and then the value's checksum under the key asked for.
 */
#define _GNU_SOURCE
#include "kvf_shared.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "kvf_hash.h"
#include "kvf_mpack.h"
#include "kvf_store.h" /* KVF_KEY_MAX */

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the shared tier's file format is little-endian; this file assumes a little-endian host"
#endif

#define HDR_MAX (KVF_SHARED_HEADER_FIXED + KVF_KEY_MAX)
/* "xx/yy/" + 2 hex per key byte + ".kvf" / ".<hex>.<16 hex>.<16 hex>.tmp" + NUL */
#define NAME_MAX_LEN (6 + 1 + 2 * KVF_KEY_MAX + 2 + 16 + 1 + 16 + 5)

struct kvf_shared {
    int dirfd;
    int fsync_mode;
    int no_noreplace; /* renameat2(RENAME_NOREPLACE) unsupported here: use link() */
    int no_link;      /* link() unsupported too: plain rename */
    uint64_t nonce;   /* random per open: temporaries of servers sharing the directory never collide */
    uint64_t seq;
    uint64_t nwritten; /* objects written: every KVF_SHARED_SWEEP_EVERY-th sweeps its directory */
    struct kvf_shared_counters ctr; /* updated with atomics (read by STATS on other threads) */
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

/* "xx/yy/" of key into out (6 chars, no NUL). */
static void fanout(const uint8_t *key, uint32_t klen, char *out)
{
    static const char hx[] = "0123456789abcdef";
    uint64_t h = kvf_xxh3_64(key, klen);
    uint8_t a = (uint8_t)h, b = (uint8_t)(h >> 8);
    out[0] = hx[a >> 4]; out[1] = hx[a & 15]; out[2] = '/';
    out[3] = hx[b >> 4]; out[4] = hx[b & 15]; out[5] = '/';
}

static size_t hexkey(const uint8_t *key, uint32_t klen, char *out)
{
    static const char hx[] = "0123456789abcdef";
    for (uint32_t i = 0; i < klen; i++) { out[2 * i] = hx[key[i] >> 4]; out[2 * i + 1] = hx[key[i] & 15]; }
    return 2 * (size_t)klen;
}

/* The final name "xx/yy/<hex>.kvf" relative to the directory. */
static void final_name(const uint8_t *key, uint32_t klen, char *out)
{
    fanout(key, klen, out);
    size_t n = 6 + hexkey(key, klen, out + 6);
    memcpy(out + n, ".kvf", 5);
}

/* ---------------------------------------------------------------- header */

static size_t header_build(uint8_t *h, const uint8_t *key, uint32_t klen, uint64_t size, uint64_t csum)
{
    memset(h, 0, 32);
    memcpy(h, KVF_SHARED_MAGIC, 4);
    put16(h + 4, KVF_SHARED_VERSION);
    put16(h + 6, (uint16_t)(KVF_SHARED_HEADER_FIXED + klen));
    h[8] = (uint8_t)klen;
    put64(h + 16, size);
    put64(h + 24, csum);
    memcpy(h + 32, key, klen);
    put64(h + 32 + klen, kvf_xxh3_64(h, 32 + klen));
    return KVF_SHARED_HEADER_FIXED + klen;
}

/* 0 when h (hlen bytes read) is a valid version-1 header for key whose value
 * is file_size - hlen bytes long (its size and checksum out); -EBADMSG otherwise. */
static int header_check(const uint8_t *h, const uint8_t *key, uint32_t klen, uint64_t file_size, uint64_t *size,
                        uint64_t *csum)
{
    uint32_t hlen = KVF_SHARED_HEADER_FIXED + klen;
    if (memcmp(h, KVF_SHARED_MAGIC, 4) || get16(h + 4) != KVF_SHARED_VERSION || get16(h + 6) != hlen ||
        h[8] != klen || memcmp(h + 32, key, klen))
        return -EBADMSG;
    for (int i = 9; i < 16; i++)
        if (h[i]) return -EBADMSG;
    if (get64(h + 32 + klen) != kvf_xxh3_64(h, 32 + klen)) return -EBADMSG;
    *size = get64(h + 16);
    *csum = get64(h + 24);
    if (file_size < hlen || *size != file_size - hlen) return -EBADMSG; /* torn or grown */
    return 0;
}

/* ---------------------------------------------------------------- open */

int kvf_shared_open(struct kvf_shared **out, const char *dir, int fsync_mode)
{
    *out = NULL;
    if (fsync_mode != KVF_SHARED_FSYNC_NEVER && fsync_mode != KVF_SHARED_FSYNC_ALWAYS) return -EINVAL;
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return -errno;
    struct kvf_shared *sh = calloc(1, sizeof *sh);
    if (!sh) { close(dfd); return -ENOMEM; }
    sh->dirfd = dfd;
    sh->fsync_mode = fsync_mode;
    if (getrandom(&sh->nonce, sizeof sh->nonce, GRND_NONBLOCK) != (ssize_t)sizeof sh->nonce)
        sh->nonce = now_us() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)sh;
    /* probe: can we create, write and remove a file here? */
    char probe[48];
    snprintf(probe, sizeof probe, ".probe.%016llx.tmp", (unsigned long long)sh->nonce);
    int fd = openat(dfd, probe, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    int rc = 0;
    if (fd < 0) {
        rc = -errno;
    } else {
        if (write(fd, "k", 1) != 1) rc = errno ? -errno : -EIO;
        if (!rc && fsync_mode == KVF_SHARED_FSYNC_ALWAYS && fdatasync(fd)) rc = -errno;
        if (close(fd) && !rc) rc = -errno;
        if (unlinkat(dfd, probe, 0) && !rc) rc = -errno;
    }
    if (rc) { close(dfd); free(sh); return rc; }
    *out = sh;
    return 0;
}

void kvf_shared_close(struct kvf_shared *sh)
{
    if (!sh) return;
    close(sh->dirfd);
    free(sh);
}

/* ---------------------------------------------------------------- read */

/* A file that failed verification: unlink name if it is still the file fd
 * has open (a writer may have put a good one there since), count it. */
static int drop_corrupt(struct kvf_shared *sh, const char *name, int fd)
{
    struct stat a, b;
    if (fstat(fd, &a) == 0 && fstatat(sh->dirfd, name, &b, AT_SYMLINK_NOFOLLOW) == 0 && a.st_dev == b.st_dev &&
        a.st_ino == b.st_ino)
        unlinkat(sh->dirfd, name, 0);
    CTR_ADD(sh, corrupt, 1);
    return -EBADMSG;
}

/* Read exactly the iovecs' bytes at offset 0; 0, -EBADMSG at a short read
 * (the file is shorter than it said: torn), -errno. */
static int read_full(int fd, struct iovec *iov, int n)
{
    off_t off = 0;
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

/* Where a read puts the value: dst[0..cap), or a buffer alloc gives once the size is known. */
struct dest {
    uint8_t *dst;
    uint64_t cap;
    kvf_shared_alloc_fn alloc;
    void *arg;
};

/* Open key's file and read (and check) its header; the value too when it
 * fits in d (or alloc made room for it). 0 with *fdp open; -ENOENT; -EBADMSG
 * (dropped, counted); alloc's -errno; other -errno (counted). */
static int open_object(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, char *name, int *fdp,
                       struct dest *d, uint64_t *size, uint64_t *csum)
{
    final_name(key, klen, name);
    int fd = openat(sh->dirfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT || e == ENOTDIR) return -ENOENT;
        CTR_ADD(sh, errors, 1);
        return -e;
    }
    struct stat st;
    if (fstat(fd, &st)) { int e = errno; close(fd); CTR_ADD(sh, errors, 1); return -e; }
    uint32_t hlen = KVF_SHARED_HEADER_FIXED + klen;
    uint8_t h[HDR_MAX];
    uint64_t file_size = (uint64_t)st.st_size;
    if (!S_ISREG(st.st_mode) || file_size < hlen) { int rc = drop_corrupt(sh, name, fd); close(fd); return rc; }
    uint64_t vs = file_size - hlen; /* the value's size if the header agrees (checked below) */
    if (d->alloc && vs) {
        int rc = d->alloc(d->arg, vs, &d->dst);
        if (rc) { close(fd); return rc; }
        d->cap = vs;
    }
    struct iovec iov[2] = {{h, hlen}, {d->dst, vs}};
    int rc = read_full(fd, iov, d->dst && vs && vs <= d->cap ? 2 : 1);
    if (rc == 0) rc = header_check(h, key, klen, file_size, size, csum);
    if (rc == -EBADMSG) { drop_corrupt(sh, name, fd); close(fd); return rc; }
    if (rc) { close(fd); CTR_ADD(sh, errors, 1); return rc; }
    *fdp = fd;
    return 0;
}

static int read_object(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, struct dest *d, uint64_t *size,
                       uint64_t *csum)
{
    if (klen == 0 || klen > KVF_KEY_MAX) return -EINVAL;
    if (!d->dst && !d->alloc) d->cap = 0;
    uint64_t t0 = now_us();
    char name[NAME_MAX_LEN];
    int fd = -1;
    uint64_t sz = 0, cs = 0;
    int rc = open_object(sh, key, klen, name, &fd, d, &sz, &cs);
    if (rc == -ENOENT) {
        CTR_ADD(sh, misses, 1);
    } else if (rc == 0) {
        if (sz > d->cap) {
            *size = sz;
            rc = -E2BIG;
        } else {
            CTR_ADD(sh, reads, 1);
            if (kvf_obj_hash(key, klen, d->dst, sz) != cs) {
                rc = drop_corrupt(sh, name, fd);
            } else {
                *size = sz;
                *csum = cs;
                CTR_ADD(sh, hits, 1);
                CTR_ADD(sh, read_bytes, sz);
            }
        }
        close(fd);
    } else if (rc == -EBADMSG) {
        CTR_ADD(sh, reads, 1);
    }
    CTR_ADD(sh, read_us, now_us() - t0);
    return rc;
}

int kvf_shared_read(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, uint8_t *dst, uint64_t cap,
                    uint64_t *size, uint64_t *csum)
{
    struct dest d = {dst, cap, NULL, NULL};
    return read_object(sh, key, klen, &d, size, csum);
}

int kvf_shared_read_alloc(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, kvf_shared_alloc_fn alloc,
                          void *arg, uint64_t *size, uint64_t *csum)
{
    struct dest d = {NULL, 0, alloc, arg};
    return read_object(sh, key, klen, &d, size, csum);
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

/* Create the fan-out directories of name ("xx/yy/..."); 0 or -errno. */
static int make_dirs(struct kvf_shared *sh, const char *name)
{
    char d[6];
    memcpy(d, name, 2);
    d[2] = 0;
    if (mkdirat(sh->dirfd, d, 0755) && errno != EEXIST) return -errno;
    memcpy(d, name, 5);
    d[5] = 0;
    if (mkdirat(sh->dirfd, d, 0755) && errno != EEXIST) return -errno;
    return 0;
}

/* Move tmp to name unless name exists. 0 moved, -EEXIST (tmp left for the caller), -errno. */
static int link_into_place(struct kvf_shared *sh, const char *tmp, const char *name)
{
    if (!__atomic_load_n(&sh->no_noreplace, __ATOMIC_RELAXED)) {
        if (renameat2(sh->dirfd, tmp, sh->dirfd, name, RENAME_NOREPLACE) == 0) return 0;
        if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP) return -errno;
        __atomic_store_n(&sh->no_noreplace, 1, __ATOMIC_RELAXED);
    }
    if (!__atomic_load_n(&sh->no_link, __ATOMIC_RELAXED)) {
        if (linkat(sh->dirfd, tmp, sh->dirfd, name, 0) == 0) {
            unlinkat(sh->dirfd, tmp, 0);
            return 0;
        }
        if (errno != EPERM && errno != ENOSYS && errno != EOPNOTSUPP) return -errno;
        __atomic_store_n(&sh->no_link, 1, __ATOMIC_RELAXED);
    }
    /* No exclusive link on this filesystem: a concurrent writer of the same key
     * wrote a verified copy of the same object, so replacing it is harmless. */
    if (faccessat(sh->dirfd, name, F_OK, AT_SYMLINK_NOFOLLOW) == 0) return -EEXIST;
    return renameat(sh->dirfd, tmp, sh->dirfd, name) ? -errno : 0;
}

/* Remove the temporaries older than KVF_SHARED_TMP_STALE_S in name's
 * directory: what writers that died before their rename left (a live
 * writer's temporary is seconds old). Best effort, no return. */
static void sweep_dir(struct kvf_shared *sh, const char *name)
{
    char d[6];
    memcpy(d, name, 5);
    d[5] = 0;
    int fd = openat(sh->dirfd, d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
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

static int sync_dir(struct kvf_shared *sh, const char *name)
{
    char d[6];
    memcpy(d, name, 5);
    d[5] = 0;
    int fd = openat(sh->dirfd, d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -errno;
    int rc = fsync(fd) ? -errno : 0;
    close(fd);
    return rc == -EINVAL ? 0 : rc; /* some filesystems cannot sync a directory */
}

int kvf_shared_write(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, const uint8_t *src, uint64_t size,
                     uint64_t csum)
{
    if (klen == 0 || klen > KVF_KEY_MAX) return -EINVAL;
    if (kvf_obj_hash(key, klen, src, size) != csum) { CTR_ADD(sh, errors, 1); return -EBADMSG; }
    uint64_t t0 = now_us();
    char name[NAME_MAX_LEN], tmp[NAME_MAX_LEN];
    final_name(key, klen, name);
    if (faccessat(sh->dirfd, name, F_OK, AT_SYMLINK_NOFOLLOW) == 0) {
        CTR_ADD(sh, exists, 1);
        CTR_ADD(sh, write_us, now_us() - t0);
        return -EEXIST;
    }
    fanout(key, klen, tmp);
    tmp[6] = '.';
    size_t n = 7 + hexkey(key, klen, tmp + 7);
    snprintf(tmp + n, sizeof tmp - n, ".%016llx.%016llx.tmp", (unsigned long long)sh->nonce,
             (unsigned long long)__atomic_fetch_add(&sh->seq, 1, __ATOMIC_RELAXED));
    int fd = openat(sh->dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno == ENOENT) {
        int rc = make_dirs(sh, name);
        if (rc) errno = -rc;
        else fd = openat(sh->dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    }
    if (fd < 0) {
        int e = errno;
        CTR_ADD(sh, errors, 1);
        CTR_ADD(sh, write_us, now_us() - t0);
        return -e;
    }
    uint8_t h[HDR_MAX];
    size_t hlen = header_build(h, key, klen, size, csum);
    struct iovec iov[2] = {{h, hlen}, {(void *)src, size}};
    int rc = write_full(fd, iov, size ? 2 : 1);
    if (!rc && sh->fsync_mode == KVF_SHARED_FSYNC_ALWAYS && fdatasync(fd)) rc = -errno;
    if (close(fd) && !rc) rc = -errno; /* NFS reports write errors at close */
    if (!rc) rc = link_into_place(sh, tmp, name);
    if (rc) {
        unlinkat(sh->dirfd, tmp, 0);
        if (rc == -EEXIST) CTR_ADD(sh, exists, 1); else CTR_ADD(sh, errors, 1);
        CTR_ADD(sh, write_us, now_us() - t0);
        return rc;
    }
    if (sh->fsync_mode == KVF_SHARED_FSYNC_ALWAYS && sync_dir(sh, name)) CTR_ADD(sh, errors, 1);
    if (__atomic_fetch_add(&sh->nwritten, 1, __ATOMIC_RELAXED) % KVF_SHARED_SWEEP_EVERY == 0) sweep_dir(sh, name);
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
    if (unlinkat(sh->dirfd, name, 0) == 0) return 1;
    if (errno == ENOENT || errno == ENOTDIR) return 0;
    int e = errno;
    CTR_ADD(sh, errors, 1);
    return -e;
}

/* ---------------------------------------------------------------- counters */

void kvf_shared_count_drop(struct kvf_shared *sh) { CTR_ADD(sh, write_drops, 1); }

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
        "shared_write_us_total"};
    const uint64_t v[KVF_SHARED_STATS_PAIRS] = {c.hits, c.misses, c.reads, c.read_bytes, c.writes, c.write_bytes,
                                                c.write_drops, c.errors, c.corrupt, c.exists, c.read_us, c.write_us};
    for (uint32_t i = 0; i < KVF_SHARED_STATS_PAIRS; i++) {
        kvf_mw_cstr(w, names[i]);
        kvf_mw_uint(w, v[i]);
    }
}
