"""The STATS schema: the keys every pool server reports, defined once.

Both implementations fill exactly :data:`STATS_KEYS` (the product server,
``csrc/kvf_stats.c`` ``kvf_op_stats``, and the test reference,
``kvfabric/testing/reference/handlers.py``), plus only the implementation-specific keys
listed in :data:`STATS_OPTIONAL_KEYS`. ``tests/native/test_stats.py`` checks
both against these tuples, so a key added to one server and not to the
schema (or to the other server) fails the suite.

Counts are since start; gauges (``connections``, ``pinned``, ``*_bytes``) are
now. Where a server has no such mechanism the value is 0 (the reference has
no reply, request or reserve budgets and no idle or pre-auth timeout).
"""

from __future__ import annotations

#: Every server reports these keys (name: meaning).
STATS_FIELDS: dict[str, str] = {
    # store
    "objects": "objects indexed",
    "bytes_used": "bytes of the indexed objects",
    "bytes_allocated": "arena bytes in slots (objects and reservations, whole pages)",
    "capacity": "arena bytes",
    "free_bytes": "arena bytes free",
    "pinned": "indexed objects held by a send in progress or an shm lease (LOOKUP leases not counted)",
    "hits": "GET keys found",
    "misses": "GET keys not found",
    "puts": "objects stored",
    "evictions": "objects evicted by the policy",
    "checksum_failures": "stored objects whose bytes failed their checksum when read (dropped, a miss)",
    "checksum_rejects": "PUT objects refused because their checksum did not match their key and bytes",
    # groups (issue 23): a PUT's group is admitted, evicted and deleted whole
    "groups": "groups indexed (each one entry of the eviction policy)",
    "group_objects": "indexed objects that belong to a group",
    "groups_incomplete": "indexed groups holding fewer objects than their group_parts (parts already held "
                         "elsewhere when the group was stored); never a group cut by a fault",
    "groups_stored": "PUT groups admitted whole",
    "groups_refused": "PUT groups refused whole (a part too large, no space, or a checksum mismatch)",
    "groups_torn": "PUT groups dropped whole because their connection died before the last part arrived",
    # namespaces (issue 27): RETIRE bumps a tag's generation; older objects are misses at once
    "namespaces": "namespace tags known (stored under by PUT, or retired), at most the server's tag table",
    "retires": "RETIRE requests applied (each bumps its tag's generation)",
    "retired_objects_freed": "objects of a retired generation freed since (found by a lookup, evicted, "
                             "or dropped by an SSD rebuild); the rest go with eviction",
    # traffic and connections
    "bytes_in": "bytes received in frames",
    "bytes_out": "bytes sent in frames",
    "connections": "connections open",
    "connections_total": "connections accepted",
    "connections_refused": "connections refused (over --max-connections, or while stopping)",
    "stalled_connections": "peers dropped for making no progress mid-frame or not reading a reply",
    "slow_connections": "peers dropped over the --min-rate bound while still trickling bytes",
    "idle_timeouts": "connections closed after --idle-timeout between frames",
    "preauth_timeouts": "connections closed for not authenticating in time (with a token)",
    # memory budgets (docs/notes/server.md)
    "reply_budget_waits": "times a connection stopped reading over its or the server's reply budget",
    "reply_budget_busy": "GETs answered BUSY over the server-wide reply budget",
    "request_budget_busy": "requests answered BUSY over the request-buffer budget",
    "reserve_budget_waits": "times a PUT object waited for the reserve budget",
    "reply_bytes": "bytes of queued replies now",
    "request_bytes": "bytes of large request buffers now",
    "reserved_bytes": "bytes of PUT slots reserved and not yet received now",
    # identity
    "errors": "error replies by code name {NAME: count}",
    "policy": "eviction policy",
    "transports": "transports offered",
    "server_id": "the id reported in HELLO",
    "uptime_s": "seconds since start",
}

STATS_KEYS: tuple[str, ...] = tuple(STATS_FIELDS)

#: The SSD tier's keys (docs/notes/tier.md), reported by the product server only when it runs with
#: ``--ssd-path`` (name: meaning). Counts are since start; ``ssd_capacity``, ``ssd_objects``,
#: ``ssd_bytes`` and ``ssd_queue_bytes`` are now.
SSD_STATS_FIELDS: dict[str, str] = {
    "ssd_capacity": "bytes of the SSD tier's log (its segments; the files add 4 KiB each)",
    "ssd_objects": "objects indexed on the SSD tier",
    "ssd_bytes": "bytes of the objects indexed on the SSD tier (values, unpadded)",
    "ssd_hits": "keys read back from the SSD tier and verified (GET and LOOKUP promotions)",
    "ssd_misses": "GET keys missing DRAM and the SSD tier, over the per-request promotion cap, or whose "
                  "read failed or was corrupt",
    "ssd_reads": "records read from the SSD tier",
    "ssd_read_bytes": "bytes read from the SSD tier (header blocks and padding included)",
    "ssd_writes": "records written to the SSD tier (objects and DELETE tombstones)",
    "ssd_write_bytes": "bytes written to the SSD tier (header blocks and padding included)",
    "ssd_write_drops": "evicted objects not written: the write queue was full, or the write failed",
    "ssd_admit_skips": "evicted objects not written by rule: --ssd-admit hit and never read, already on "
                       "the tier, or larger than a segment",
    "ssd_errors": "SSD I/O errors (EIO, ENOSPC, EROFS, short transfers)",
    "ssd_corrupt": "records dropped as torn or corrupt (at the start-up scan or on a read; never served)",
    "ssd_read_us_total": "microseconds from posting to completion, summed over the reads",
    "ssd_write_us_total": "microseconds from posting to completion, summed over the writes",
    "ssd_promotions": "objects read back from the SSD tier and stored into DRAM",
    "ssd_groups_torn": "groups dropped whole from the SSD tier's index: one had fewer records than parts at the "
                       "start-up scan (a crash mid-write-behind, a dropped write, a wrapped log, a DELETEd part), "
                       "or the log reused the segment of one of its records",
    "ssd_queue_bytes": "bytes staged for writing now (bounded by --ssd-write-queue)",
}

#: The shared-filesystem tier's keys (``--shared-path``; docs/notes/tier-shared.md): present only when a
#: shared tier is configured.
SHARED_STATS_FIELDS: dict[str, str] = {
    "shared_hits": "shared-tier reads that returned an object (verified under the key asked for; tagged ones "
                   "of a retired generation included, counted again in shared_retired and not served)",
    "shared_misses": "shared-tier reads that found no file for the key",
    "shared_reads": "shared-tier files read (header and value), verified or not",
    "shared_read_bytes": "value bytes returned by shared-tier reads",
    "shared_writes": "objects written to the shared tier and linked into place",
    "shared_write_bytes": "value bytes written to the shared tier",
    "shared_write_drops": "shared-tier writes dropped before reaching the filesystem (the tier queue was full)",
    "shared_errors": "shared-tier I/O errors (open, read, write, sync, link; not 'absent')",
    "shared_corrupt": "shared-tier files torn or corrupt (failed verification): removed, never served",
    "shared_exists": "shared-tier writes skipped because the key's file was already there",
    "shared_read_us_total": "microseconds spent in shared-tier reads (all: hits, misses, failures)",
    "shared_write_us_total": "microseconds spent in shared-tier writes (all: written, already there, failed)",
    "shared_refused": "shared-tier objects or fan-out directories refused unread: a symlink, a FIFO or other "
                      "non-regular file, another uid's, or writable by others (a miss)",
    "shared_mac_refused": "shared-tier files refused for their MAC: none or a wrong one under --auth-token "
                          "(written without the token), or one on a server without a token (never served)",
    "shared_replaced": "shared-tier writes that replaced a file readers refuse, or a file of the key at an older "
                       "namespace generation or another tag (atomically: temporary + rename)",
    "shared_retired": "tagged shared-tier files not served: their namespace generation is retired on this server, "
                      "their tag did not fit the tag table, or the retirement records could not be read (a miss)",
    "shared_retire_bad": "retirement records in the shared directory skipped: bad magic, version, checksum or MAC",
}

#: Implementation-specific keys a server may add, by implementation.
STATS_OPTIONAL_KEYS: dict[str, tuple[str, ...]] = {
    # the product server (C io_uring data plane)
    "native": (
        "events_dropped",  # eviction events lost to a full ring (the policy was resynchronised)
        "zc_sends", "copy_sends", "zc_copied_notifs",  # how GET objects went out
        "client_verified_sends",  # GET objects sent unchecked: their client verifies them (client_verifies)
        "data_plane",  # io_uring[+send_zc[+fixed]]
        "transports_in_use",  # {tcp, native, shm, nixl}: connections by what they said at HELLO
        "shm_refused",  # unix peers refused by the SO_PEERCRED check
        "shm_leases_expired",  # shm leases dropped at --max-lease-ms
        "shm_reservations_expired",  # shm reservations freed uncommitted
        *SSD_STATS_FIELDS,  # with --ssd-path only
        *SHARED_STATS_FIELDS,  # shared_*: only with --shared-path
        # service time (header in -> reply queued) of GET, PUT, LOOKUP, EXISTS, DELETE: per-bucket counts
        # of log2 microsecond buckets, and their sum in microseconds (bounds: kvfabric/metrics.py)
        *(f"lat_{op}_us_{part}" for op in ("get", "put", "lookup", "exists", "delete") for part in ("buckets", "sum")),
    ),
    # the test reference (pure Python)
    "reference": (
        "leased", "free_extents", "put_exists", "put_too_large", "put_no_space", "put_checksum_mismatches",
        "evicted_bytes", "deletes", "lookups", "lookup_keys", "lookup_hits", "exists_keys", "requests",
        "drops",  # {reason: n} connections dropped without an error reply
    ),
}
