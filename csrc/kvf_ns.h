/* kvf_ns.h: namespace tags and their generations (issue 27: retire a namespace pool-wide).
 *
 * A PUT may tag its objects with a namespace tag (KVF_NS_TAG_BYTES bytes, a digest of the
 * namespace; kvfabric.protocol.NS_TAG_BYTES). The table interns each tag into a slot
 * (1..max) and keeps the slot's generation; an object records a ref = gen << 16 | slot
 * taken when it was stored (0: untagged). RETIRE bumps the tag's generation: every object
 * whose ref carries an older one is stale from then on (kvf_ns_stale, O(1)), and whoever
 * finds one frees it (the store on a lookup or an eviction, the SSD tier on a lookup or
 * at rebuild). Nothing is scanned.
 *
 * A slot is never reused (a retired tag must stay retired), so the table is bounded by
 * `max` tags for the server's life: interning a new tag past it is -ENOSPC, which a PUT
 * and a RETIRE answer with a clear refusal.
 *
 * Persistence (with an SSD tier; a shared tier keeps its own records, below): kvf_ns_persist loads DIR/KVF_NS_FILE and appends one
 * 32-byte record per RETIRE (tag, generation, checksum), fdatasync'd before the RETIRE
 * is answered, so that after a restart the SSD tier's older records stay retired.
 *
 * Shared tier (kvf_shared.h): a sink (kvf_ns_set_sink) gets every RETIRE's (tag, generation)
 * after the local file and before the generation changes; a sink that fails fails the RETIRE
 * (nothing changed). The shared tier loads other servers' retirements with kvf_ns_reref (the
 * generation only grows: a record can retire more, never less).
 *
 * Threads: intern and retire under the table's mutex (the loop thread; the tier's
 * rebuild before the loop starts); kvf_ns_stale reads a generation with an atomic
 * load from any thread. Returns 0 or -errno unless documented otherwise; calls nothing
 * of kvfabric's (bottom layer).
 */
#ifndef KVF_NS_H
#define KVF_NS_H

#include <stdint.h>

#ifndef KVF_NS_TAG_BYTES
#define KVF_NS_TAG_BYTES 16u /* the wire's (kvf_protocol.h) */
#endif
#define KVF_NS_MAX_SLOTS 65535u /* refs keep the slot in 16 bits */
#define KVF_NS_FILE "kvfabric-retired.v1"

struct kvf_ns;

struct kvf_ns_stats {
    uint64_t tags, retires, freed;
};

/* A table of at most max tags (1..KVF_NS_MAX_SLOTS; -EINVAL otherwise), or -ENOMEM. */
int kvf_ns_new(struct kvf_ns **out, uint32_t max);
void kvf_ns_free(struct kvf_ns *ns);
/* The ref an object stored now under tag records (*ref). -ENOSPC: the table is full. */
int kvf_ns_ref(struct kvf_ns *ns, const uint8_t tag[KVF_NS_TAG_BYTES], uint64_t *ref);
/* 1: ref is of a retired generation (the object must not be served); 0 live or untagged. */
int kvf_ns_stale(struct kvf_ns *ns, uint64_t ref);
/* Bump tag's generation (*gen: the new one). -ENOSPC: table full; -EOVERFLOW: its
 * generation cannot grow; -errno: the record could not be persisted (nothing changed). */
int kvf_ns_retire(struct kvf_ns *ns, const uint8_t tag[KVF_NS_TAG_BYTES], uint64_t *gen);
/* The tag and generation of a ref (for the SSD tier's record). -ENOENT for 0 or a bad slot. */
int kvf_ns_unref(struct kvf_ns *ns, uint64_t ref, uint8_t tag[KVF_NS_TAG_BYTES], uint32_t *gen);
/* The ref of a record read back (tag, gen); *ref 0 with return 1 when that generation is
 * retired (the record must be dropped). -ENOSPC: the table is full. */
int kvf_ns_reref(struct kvf_ns *ns, const uint8_t tag[KVF_NS_TAG_BYTES], uint32_t gen, uint64_t *ref);
/* Load dir/KVF_NS_FILE (created 0600 if absent) and append every later RETIRE to it.
 * Call before anything is interned. A torn last record (a crash mid-append) is ignored;
 * -EBADMSG for a record that fails its checksum elsewhere; -ENOSPC more tags than max. */
int kvf_ns_persist(struct kvf_ns *ns, const char *dir);
/* 1: tag is interned; 0: it is not and the table has room; -ENOSPC: it is not and the table is full. */
int kvf_ns_known(struct kvf_ns *ns, const uint8_t tag[KVF_NS_TAG_BYTES]);
/* Called by kvf_ns_retire under the table's mutex with the new generation, after the local
 * file's record: 0, or -errno to refuse the RETIRE (nothing changed). fn must not call kvf_ns. */
typedef int (*kvf_ns_sink_fn)(void *arg, const uint8_t tag[KVF_NS_TAG_BYTES], uint32_t gen);
void kvf_ns_set_sink(struct kvf_ns *ns, kvf_ns_sink_fn fn, void *arg);
void kvf_ns_count_freed(struct kvf_ns *ns, uint64_t n);
void kvf_ns_stats(struct kvf_ns *ns, struct kvf_ns_stats *s);

#endif
