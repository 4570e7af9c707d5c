/* kvf_shared.h: the shared-filesystem tier (`kvfabric serve --shared-path DIR`).
 *
 * A directory that every pool server mounts (DingoFS, JuiceFS, CephFS, NFS,
 * Lustre, or a local directory for several servers on one host). Objects are
 * written once by key and any server can read any key found there, so the
 * pool survives the loss of a server and its capacity is the filesystem's.
 *
 * Layout: DIR/xx/yy/<hex key>.kvf, where xxyy are the low two bytes of
 * xxh3_64(key) in hex (two levels of 256 directories, uniform whatever the
 * key looks like; created on first use). A file is written as a temporary
 * DIR/xx/yy/.<hex key>.<nonce>.<seq>.tmp (O_EXCL), fdatasync'ed with
 * KVF_SHARED_FSYNC_ALWAYS, then linked into place without replacing anything
 * (renameat2 RENAME_NOREPLACE; link() + unlink where the filesystem lacks
 * it; a plain rename as the last resort, harmless because whoever wrote the
 * same key wrote a verified copy of the same object). Readers open only
 * final names, so a temporary left by a crashed writer is never served;
 * writers remove the stale ones as they go (KVF_SHARED_SWEEP_EVERY).
 *
 * Trust (docs/notes/security.md, "shared tier"): every path component below
 * DIR is opened with openat(O_NOFOLLOW | O_DIRECTORY) (a fan-out directory
 * that is a symlink, not a directory, not ours or writable by others is
 * refused), every object with O_NOFOLLOW | O_NONBLOCK (a FIFO never blocks
 * the tier thread) and fstat'ed: a regular file, owned by the uid our files
 * get (or of the tier group), not writable by others; anything else is
 * refused (counted in `refused`, a miss). Created directories are 0700 and
 * files 0600 (0770 / 0640 and chgrp'ed with a tier group), whatever the umask.
 *
 * File format (all little-endian). Version 1 without a MAC key, version 2
 * with one (the pool's --auth-token):
 *
 *   off  size  field
 *   0    4     magic "KVFS"
 *   4    2     version: 1, or 2 (with a MAC)
 *   6    2     header_len = 40 + key_len (+ 32 in version 2): the value starts here
 *   8    1     key_len (1..64)
 *   9    7     reserved, 0
 *   16   8     value size
 *   24   8     value checksum: kvf_obj_hash(key, value) (protocol v2)
 *   32   k     key
 *   32+k 8     header checksum: xxh3_64 of bytes [0, 32 + key_len)
 *   40+k 32    version 2 only: MAC = HMAC-SHA256(token, KVF_SHARED_MAC_LABEL (with its NUL)
 *              || bytes [0, 32 + key_len) || value)
 *   hlen size  value
 *   +size 32   only when flags (byte 9) has KVF_SHARED_F_NS: the namespace trailer (issue 27):
 *              tag[16], generation u32, zero u32, checksum u64 = kvf_obj_hash(the header
 *              checksum's 8 bytes, trailer bytes [0, 24)); in version 2 the MAC covers it:
 *              HMAC-SHA256(token, label || bytes [0, 32 + key_len) || value || trailer)
 *
 * Namespace tags (kvf_ns.h, RETIRE): a tagged object's file carries its tag and the
 * generation its writer stored it under, in a trailer after the value (so a reader still
 * reads header and value in one preadv: the trailer lands after the value in the same
 * buffer). Byte 9 (flags; the rest of the reserved bytes stay 0) says so and is covered by
 * the header checksum and the MAC. Untagged files keep the bytes above (flags 0), so files
 * written before stay readable; a server older than this change reads a tagged file as
 * corrupt (a nonzero reserved byte) and drops it: a miss, never an untagged hit. A read
 * returns the tag and generation (struct kvf_shared_ns); the caller (the tier) decides
 * whether that generation is retired.
 *
 * Retirement records (kvf_shared_retired_open): every RETIRE this server applies is also
 * appended to DIR/KVF_SHARED_RETIRED_DIR/<16 hex nonce>-<n>.rec, a file of this server's
 * own (created at its first RETIRE since start, O_EXCL, fdatasync'd before the RETIRE is
 * answered), as 72-byte records: magic "KVFR", version u16 (1, or 2 with a MAC key), length
 * u16 = 72, tag[16], generation u32, zero u32, checksum u64 = xxh3_64 of bytes [0, 32),
 * MAC[32] = HMAC-SHA256(token, KVF_SHARED_RETIRE_LABEL (with its NUL) || bytes [0, 32))
 * in version 2 (zeros in version 1). Each server loads every records file at start (the
 * highest generation per tag wins) and reads their new whole records again before it
 * judges a file of a tag it has not interned, and every few seconds (the server's control
 * thread, kvfabric/server/native.py). One writer per file, so appends never
 * interleave on a filesystem without atomic O_APPEND (NFS). A record that fails its
 * checksum, magic, version or MAC is skipped and counted (`retire_bad`); a partial record
 * at a file's end (an append in progress, or one cut by a crash) is left for a later read.
 * A record can only raise a generation: a planted one retires more (misses), never less.
 *
 * A file whose header, key, length or value checksum does not verify (torn
 * by a crash, truncated, corrupted) is dropped (unlinked, if it is still the
 * same file), counted in `corrupt` and reported as -EBADMSG: never served.
 * With a MAC key, a file that is not version 2 or whose MAC fails (written
 * by someone without the token) is refused: counted in `mac_refused`, never
 * served, left in place; without one, a version 2 file is refused the same
 * way. A write whose key's name holds a file that would be refused replaces
 * it atomically (temporary + rename over it; counted in `replaced`), so a
 * file planted before the server's own PUT never blocks its write-through.
 *
 * The functions do plain blocking file I/O (no O_DIRECT: many FUSE
 * filesystems lack it, and every read is verified anyway); they are meant
 * for the tier thread, never the io_uring loop. They are thread-safe (the
 * only shared state is the counters, updated atomically) and return 0 or
 * -errno as documented per function.
 */
#ifndef KVF_SHARED_H
#define KVF_SHARED_H

#include <stdint.h>

#include "kvf_ns.h"

struct kvf_mw;

enum { KVF_SHARED_FSYNC_NEVER = 0, KVF_SHARED_FSYNC_ALWAYS = 1 };

#define KVF_SHARED_MAGIC "KVFS"
#define KVF_SHARED_VERSION 1     /* without a MAC key */
#define KVF_SHARED_VERSION_MAC 2 /* with one: the header carries the file's MAC */
#define KVF_SHARED_HEADER_FIXED 40u /* header bytes besides the key (and the MAC) */
#define KVF_SHARED_MAC_BYTES 32u
#define KVF_SHARED_MAC_LABEL "kvfabric shared-tier object v2" /* the MAC's domain label, NUL included */
#define KVF_SHARED_F_NS 1u          /* flags (byte 9): the file has the namespace trailer */
#define KVF_SHARED_NS_BYTES 32u     /* the trailer */
#define KVF_SHARED_RETIRED_DIR "kvfabric-retired"
#define KVF_SHARED_RETIRE_REC 72u   /* bytes per retirement record */
#define KVF_SHARED_RETIRE_LABEL "kvfabric shared-tier retirement v1" /* its MAC's label, NUL included */
#define KVF_SHARED_RETIRED_FILES_MAX 65536u /* records files read at most (more: the read fails, closed) */
#define KVF_SHARED_KEY_MAX 4096u /* bytes of MAC key (token) accepted */
/* Every KVF_SHARED_SWEEP_EVERY-th object a server writes (its first one
 * included), the writer also removes the temporaries older than
 * KVF_SHARED_TMP_STALE_S seconds (mtime) in that object's directory. */
#define KVF_SHARED_SWEEP_EVERY 64u
#define KVF_SHARED_TMP_STALE_S 3600

/* Counts since open (read_us / write_us: microseconds spent in reads / writes). */
struct kvf_shared_counters {
    uint64_t hits;        /* reads that returned an object */
    uint64_t misses;      /* reads that found no file */
    uint64_t reads;       /* files read (header and value), verified or not */
    uint64_t read_bytes;  /* value bytes returned */
    uint64_t writes;      /* objects written and linked into place */
    uint64_t write_bytes; /* value bytes written */
    uint64_t write_drops; /* write jobs dropped before reaching the filesystem (kvf_shared_count_drop) */
    uint64_t errors;      /* I/O errors (open, read, write, sync, link) other than "absent" */
    uint64_t corrupt;     /* files that failed verification: dropped, never served */
    uint64_t exists;      /* writes skipped: the key's file was already there */
    uint64_t read_us, write_us;
    uint64_t refused;     /* objects or fan-out directories refused: a symlink, a FIFO or other non-regular
                             file, not ours (another uid), writable by others; a miss, never opened for data */
    uint64_t mac_refused; /* files refused for their MAC: none or a wrong one under a token (written without
                             it), or one when this server has no token; never served */
    uint64_t replaced;    /* writes that replaced a file readers refuse (atomically: temporary + rename) */
    uint64_t retired;     /* tagged files not served: their generation is retired here, their tag did not
                             fit the tag table, or the records could not be read (kvf_shared_count_retired) */
    uint64_t retire_bad;  /* retirement records skipped: bad magic, version, checksum or MAC */
};

/* The namespace of a file read or written (kvf_ns.h): tagged 0 untagged (tag, gen unused). */
struct kvf_shared_ns {
    uint8_t tagged;
    uint8_t tag[KVF_NS_TAG_BYTES];
    uint32_t gen;
};

struct kvf_shared;

struct kvf_shared_cfg {
    const char *dir;        /* must exist; its owner and mode are checked by the caller (Python, at start-up) */
    int fsync_mode;         /* KVF_SHARED_FSYNC_* */
    int64_t gid;            /* the tier group (--tier-group): -1 none; else files 0640 and directories 0770 of
                               this group, and files of this group are trusted like our own */
    const uint8_t *mac_key; /* the pool token: files carry a MAC (version 2); NULL: version 1, no MAC */
    uint32_t mac_key_len;   /* 1..KVF_SHARED_KEY_MAX with mac_key */
};

/* Open the tier as cfg says. Checks that the directory is writable by
 * creating, writing and removing a probe file in it (whose owner is the uid
 * our files get: on a squashing NFS mount not our own). 0, or -ENOENT /
 * -ENOTDIR / -EACCES / -EROFS / -ENOSPC / other -errno (nothing is left
 * open), -EINVAL for a bad fsync_mode, gid or MAC key length, -ENOMEM. */
int kvf_shared_open(struct kvf_shared **out, const struct kvf_shared_cfg *cfg);
void kvf_shared_close(struct kvf_shared *sh);

/* Read the object stored under key[0..klen) into dst[0..cap).
 * 0: *size bytes written to dst, their checksum in *csum (verified under this key);
 * -ENOENT: no such object (counted as a miss);
 * -EBADMSG: the file is torn or corrupt (dropped and counted; never served);
 * -EPERM: refused (not a regular file of ours, a fan-out directory that is
 *         not ours, or its MAC failed; counted in refused / mac_refused);
 * -E2BIG: the object is larger than cap; *size is set to its size (the header
 *         verified; nothing is counted), so a caller may read with cap = 0 to
 *         learn the size, reserve a slot, and read again;
 * -EINVAL: bad key length; other -errno: I/O error (counted).
 * On 0, *ns (never NULL) says the file's namespace tag and generation (verified with the
 * header; the caller decides whether it is retired: kvf_shared_count_retired). */
int kvf_shared_read(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, uint8_t *dst, uint64_t cap,
                    uint64_t *size, uint64_t *csum, struct kvf_shared_ns *ns);

/* kvf_shared_read_alloc's allocator: room for `size` value bytes in *dst
 * (kept by the caller), or -errno (returned by the read as is: -ENOMEM, or
 * -EFBIG for an object over the caller's limit). */
typedef int (*kvf_shared_alloc_fn)(void *arg, uint64_t size, uint8_t **dst);

/* kvf_shared_read in one open and one read: the value's size is taken from
 * the file's length (and checked against the header), alloc gives the room
 * for it before anything is read. Returns as kvf_shared_read (never
 * -E2BIG), or alloc's -errno. On every return but 0 the caller frees
 * whatever alloc gave (it may have been called). */
int kvf_shared_read_alloc(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, kvf_shared_alloc_fn alloc,
                          void *arg, uint64_t *size, uint64_t *csum, struct kvf_shared_ns *ns);

/* Write src[0..size) under key, whose checksum (kvf_obj_hash) is csum, tagged with ns
 * (NULL or !ns->tagged: untagged), unless the key's file is already there (with a MAC
 * key: a file whose header MAC is the one this object gets; without one, a file of the
 * same length, flags, and with a tag the same tag at this generation or a newer one). A
 * file of the key at an older generation, another tag, or tagged where this is not (or
 * the reverse) is replaced. A file there that readers would refuse is
 * replaced (counted in `replaced` as well as `writes`). 0 written; -EEXIST
 * already there (counted in `exists`, nothing written); -EPERM a fan-out
 * directory refused (counted in `refused`); -EBADMSG csum does not match key + bytes
 * (nothing written: the tier never stores bytes that would not verify;
 * counted as an error); -EINVAL bad key length; other -errno: I/O error
 * (-ENOSPC, -EDQUOT, -EIO, ...; counted, the temporary removed). */
int kvf_shared_write(struct kvf_shared *sh, const uint8_t *key, uint32_t klen, const uint8_t *src, uint64_t size,
                     uint64_t csum, const struct kvf_shared_ns *ns);

/* Remove the object stored under key (DELETE: a deleted key must not come
 * back from the shared tier). 1 removed, 0 absent, -EINVAL bad key length,
 * other -errno (counted). */
int kvf_shared_delete(struct kvf_shared *sh, const uint8_t *key, uint32_t klen);

/* A write job for this tier was dropped before it reached the filesystem
 * (its queue was full); counted in `write_drops`. */
void kvf_shared_count_drop(struct kvf_shared *sh);
/* A tagged file read was not served: its generation is retired (the tier decides). */
void kvf_shared_count_retired(struct kvf_shared *sh);

/* Retirement records (above). Load every records file into ns (the directory created if
 * absent) and make ns append this server's RETIREs to a file of its own (kvf_ns_set_sink).
 * Once, before the loop runs. 0, or -errno (-EPERM: the records directory is refused: a
 * symlink, not ours, writable by others; -E2BIG: more than KVF_SHARED_RETIRED_FILES_MAX
 * files); bad records are skipped and counted, never an error. */
int kvf_shared_retired_open(struct kvf_shared *sh, struct kvf_ns *ns);
/* Read the records appended since the last load (new files and the new whole records of
 * known ones) into ns: generations only grow. The tier calls it before it judges a file
 * whose tag ns has not interned. Thread-safe. 0 or -errno as kvf_shared_retired_open. */
int kvf_shared_retired_load(struct kvf_shared *sh, struct kvf_ns *ns);
void kvf_shared_counters(struct kvf_shared *sh, struct kvf_shared_counters *out);

/* STATS: the number of key/value pairs kvf_shared_stats_write appends
 * (0 when sh is NULL: no shared tier configured, no keys), and the pairs
 * themselves ("shared_hits": n, ...; names in kvfabric/protocol/stats.py). */
#define KVF_SHARED_STATS_PAIRS 17u
uint32_t kvf_shared_stats_pairs(const struct kvf_shared *sh);
void kvf_shared_stats_write(struct kvf_shared *sh, struct kvf_mw *w);

#endif
