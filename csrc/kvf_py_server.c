/* kvf_py_server.c: the Server type: the io_uring server (kvf_server.c) and its C store
 * (kvf_store.c) as the Python control thread of kvfabric/server/native.py sees
 * them (run/stop, event drain, evict by key, stats). Eviction policy stays in Python. */
#include "kvf_module_int.h"

#include "kvf_ns.h"
#include "kvf_protocol.h"
#include "kvf_server.h"
#include "kvf_shared.h"
#include "kvf_store.h"
#include "kvf_tier.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ server */

typedef struct {
    PyObject_HEAD
    struct kvf_store *st;
    struct kvf_server *srv;
    struct kvf_tier *tier; /* attached to srv, or NULL */
    struct kvf_shared *shared; /* --shared-path tier, or NULL (the C config points at it) */
    struct kvf_ns *ns; /* namespace tags and generations (the store's, issue 27) */
    char *auth, *server_id;
    uint32_t *shm_uids, *shm_gids; /* the C config points at these */
    PyObject *hello, *extra; /* bytes kept alive for the C config */
    int running;
    int evicting; /* evict() is in kvf_store_evict with the GIL released: tier_close() must wait */
} ServerObject;

static void tier_close(ServerObject *self)
{
    if (!self->tier) return;
    kvf_server_detach_tier(self->srv);
    struct kvf_tier *t = self->tier;
    self->tier = NULL;
    Py_BEGIN_ALLOW_THREADS
    kvf_tier_close(t); /* finishes the queued write-behind */
    Py_END_ALLOW_THREADS
}

static void Server_dealloc(ServerObject *self)
{
    if (!self->running) tier_close(self);
    if (self->srv && !self->running) kvf_server_free(self->srv);
    if (self->st && !self->running) kvf_store_free(self->st);
    if (self->ns && !self->running) kvf_ns_free(self->ns);
    if (self->shared && !self->running) kvf_shared_close(self->shared);
    PyMem_Free(self->auth);
    PyMem_Free(self->server_id);
    PyMem_Free(self->shm_uids);
    PyMem_Free(self->shm_gids);
    Py_XDECREF(self->hello);
    Py_XDECREF(self->extra);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(Server_doc,
"Server(tcp_fd, unix_fd, capacity, *, hello_pairs, stats_extra=b'', auth=None,\n"
"       max_conns=1024, max_keys=4096, max_key_bytes=64, max_meta=1<<20, max_payload=1<<30,\n"
"       max_object=64<<20, max_in_flight=64, zerocopy=-1, event_ring=65536, stall_ms=0,\n"
"       max_lease_ms=0, min_rate=0, shm_uids=(), shm_gids=(), idle_ms=0,\n"
"       preauth_ms=0, drain_ms=0, reply_conn_budget=0, reply_budget=0, request_budget=0, reserve_budget=0,\n"
"       shared_path=None, shared_fsync=0, tier_gid=-1, server_id='', ns_max=65535)\n"
"The io_uring data plane over a memfd arena of `capacity` bytes. hello_pairs: the HELLO reply's\n"
"static entries (msgpack key/value pairs, no map header); C adds auth_required and, with auth\n"
"(the pool token), the connection's nonce and its proof over server_id (kvfabric.protocol.auth). The caller owns the\n"
"bound sockets (-1 = none); run() listens on them, then blocks (GIL released) until stop()\n"
"has drained the connections (drain_ms). Budgets of 0 take kvf_server.h's defaults. The control\n"
"methods (wait, drain, evict, is_pinned, space_done) are for one Python control thread.\n"
"shm_uids / shm_gids: peers of the unix socket allowed besides the server's own uid\n"
"(SO_PEERCRED; a gid matches the peer's effective or any supplementary group).\n"
"shared_path: the shared-filesystem tier's directory (kvf_shared.h; shared_fsync 1: fdatasync\n"
"every object before it is linked into place); NativeError when it cannot be used. With auth, its\n"
"files carry a MAC keyed by the token (format 2). tier_gid: the tier group (-1 none).\n"
"ns_max: namespace tags the server can know (PUT ns, RETIRE; issue 27), 1..65535; a new tag past\n"
"it is refused BUSY. With an SSD tier its retirements persist in the first path (kvf_ns.h).\n"
"Raises ValueError for bad sizes, NativeError when io_uring or the memory is unavailable.");

/* A sequence of at most 64 uids/gids -> a PyMem array (NULL when empty). 0 or -1 with an exception. */
static int id_list(PyObject *o, uint32_t **out, uint32_t *n, const char *what)
{
    *n = 0;
    if (!o || o == Py_None) return 0;
    PyObject *seq = PySequence_Fast(o, "a sequence of ids");
    if (!seq) return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (len > 64) { Py_DECREF(seq); PyErr_Format(PyExc_ValueError, "%s: at most 64 ids", what); return -1; }
    PyMem_Free(*out);
    *out = len ? PyMem_Malloc(sizeof(uint32_t) * (size_t)len) : NULL;
    if (len && !*out) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < len; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xfffffffful) {
            Py_DECREF(seq);
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: ids are 32-bit", what);
            return -1;
        }
        (*out)[i] = (uint32_t)v;
    }
    *n = (uint32_t)len;
    Py_DECREF(seq);
    return 0;
}

static int Server_init(ServerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"tcp_fd", "unix_fd", "capacity", "hello_pairs", "stats_extra",
                             "auth", "max_conns", "max_keys", "max_key_bytes", "max_meta", "max_payload",
                             "max_object", "max_in_flight", "zerocopy", "event_ring", "stall_ms", "max_lease_ms", "min_rate",
                             "shm_uids", "shm_gids", "idle_ms", "preauth_ms", "drain_ms", "reply_conn_budget",
                             "reply_budget", "request_budget", "reserve_budget", "shared_path", "shared_fsync", "tier_gid",
                             "server_id", "ns_max", NULL};
    struct kvf_server_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    unsigned long long capacity;
    PyObject *hello = NULL, *extra = NULL;
    const char *auth = NULL, *shared_path = NULL, *server_id = "";
    int shared_fsync = KVF_SHARED_FSYNC_NEVER;
    long long tier_gid = -1;
    cfg.max_conns = 1024;
    cfg.max_keys = KVF_MAX_KEYS_PER_BATCH;
    cfg.max_key_bytes = KVF_MAX_KEY_BYTES;
    cfg.max_meta = KVF_MAX_META_BYTES;
    unsigned long long max_payload = KVF_MAX_PAYLOAD_BYTES, max_object = KVF_MAX_OBJECT_BYTES;
    cfg.max_in_flight = KVF_MAX_IN_FLIGHT;
    cfg.zerocopy = -1;
    unsigned int event_ring = 65536, ns_max = KVF_NS_MAX_SLOTS;
    unsigned long long min_rate = 0, reply_conn_budget = 0, reply_budget = 0, request_budget = 0, reserve_budget = 0;
    PyObject *uids_o = NULL, *gids_o = NULL;
    if (self->srv) { PyErr_SetString(PyExc_RuntimeError, "Server already initialised"); return -1; }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiK|$SSzIIIIKKIiIIIKOOIIIKKKKziLzI", kwlist, &cfg.tcp_fd, &cfg.unix_fd, &capacity,
                                     &hello, &extra, &auth, &cfg.max_conns, &cfg.max_keys,
                                     &cfg.max_key_bytes, &cfg.max_meta, &max_payload, &max_object,
                                     &cfg.max_in_flight, &cfg.zerocopy, &event_ring, &cfg.stall_ms,
                                     &cfg.max_lease_ms, &min_rate, &uids_o, &gids_o, &cfg.idle_ms, &cfg.preauth_ms,
                                     &cfg.drain_ms, &reply_conn_budget, &reply_budget, &request_budget, &reserve_budget,
                                     &shared_path, &shared_fsync, &tier_gid, &server_id, &ns_max))
        return -1;
    if (id_list(uids_o, &self->shm_uids, &cfg.n_shm_uids, "shm_uids") ||
        id_list(gids_o, &self->shm_gids, &cfg.n_shm_gids, "shm_gids"))
        return -1;
    cfg.shm_uids = self->shm_uids;
    cfg.shm_gids = self->shm_gids;
    if (cfg.max_keys > KVF_MAX_KEYS_PER_BATCH || cfg.max_key_bytes > KVF_MAX_KEY_BYTES || !cfg.max_in_flight ||
        event_ring == 0 || event_ring > (1u << 22)) {
        PyErr_SetString(PyExc_ValueError, "limits out of range");
        return -1;
    }
    if (!hello) { PyErr_SetString(PyExc_TypeError, "hello_pairs is required"); return -1; }
    if (!server_id) server_id = "";
    cfg.max_payload = max_payload;
    cfg.max_object = max_object;
    cfg.min_rate = min_rate;
    cfg.reply_conn_budget = reply_conn_budget;
    cfg.reply_budget = reply_budget;
    cfg.request_budget = request_budget;
    cfg.reserve_budget = reserve_budget;
    int rc;
    if (shared_path) {
        if (shared_fsync != KVF_SHARED_FSYNC_NEVER && shared_fsync != KVF_SHARED_FSYNC_ALWAYS) {
            PyErr_SetString(PyExc_ValueError, "shared_fsync must be 0 (never) or 1 (always)");
            return -1;
        }
        /* with a token, every file carries a MAC keyed by it (kvf_shared.h, format 2) */
        size_t alen = auth ? strlen(auth) : 0;
        if (alen > KVF_SHARED_KEY_MAX) {
            PyErr_Format(PyExc_ValueError, "auth token over %u bytes", KVF_SHARED_KEY_MAX);
            return -1;
        }
        struct kvf_shared_cfg sc = {shared_path, shared_fsync, tier_gid, (const uint8_t *)auth, (uint32_t)alen};
        rc = kvf_shared_open(&self->shared, &sc);
        if (rc) { raise_errno(rc, 0, "opening the shared tier directory"); return -1; }
        cfg.shared = self->shared;
    }
    rc = kvf_store_new(&self->st, capacity, event_ring);
    if (rc) { raise_errno(rc, 0, "creating the arena"); return -1; }
    rc = kvf_ns_new(&self->ns, ns_max);
    if (rc) { raise_errno(rc, 0, "creating the namespace tag table (ns_max 1..65535)"); return -1; }
    kvf_store_set_ns(self->st, self->ns);
    if (self->shared) { /* the pool's retirements in the shared directory: loaded now, appended at each RETIRE */
        rc = kvf_shared_retired_open(self->shared, self->ns);
        if (rc) {
            raise_errno(rc, 0, rc == -EPERM ? "reading the shared tier's retirement records (" KVF_SHARED_RETIRED_DIR
                                              " is refused: a symlink, not a directory, not this user's, or "
                                              "writable by others)"
                                            : "reading the shared tier's retirement records (" KVF_SHARED_RETIRED_DIR ")");
            return -1;
        }
    }
    if (auth) {
        self->auth = PyMem_Malloc(strlen(auth) + 1);
        if (!self->auth) { PyErr_NoMemory(); return -1; }
        strcpy(self->auth, auth);
    }
    self->server_id = PyMem_Malloc(strlen(server_id) + 1);
    if (!self->server_id) { PyErr_NoMemory(); return -1; }
    strcpy(self->server_id, server_id);
    Py_INCREF(hello);
    self->hello = hello;
    if (!extra) extra = PyBytes_FromStringAndSize("", 0); else Py_INCREF(extra);
    if (!extra) return -1;
    self->extra = extra;
    cfg.store = self->st;
    cfg.auth = self->auth;
    cfg.server_id = self->server_id;
    cfg.hello_pairs = (const uint8_t *)PyBytes_AS_STRING(hello);
    cfg.hello_len = (size_t)PyBytes_GET_SIZE(hello);
    cfg.stats_extra = (const uint8_t *)PyBytes_AS_STRING(extra);
    cfg.stats_extra_len = (size_t)PyBytes_GET_SIZE(extra);
    rc = kvf_server_new(&self->srv, &cfg);
    if (rc) { raise_errno(rc, 0, "starting the io_uring data plane"); return -1; }
    return 0;
}

#define NEED_SRV(self) \
    if (!(self)->srv) { PyErr_SetString(PyExc_RuntimeError, "Server not initialised"); return NULL; }

static PyObject *Server_run(ServerObject *self, PyObject *noargs)
{
    (void)noargs;
    NEED_SRV(self);
    if (self->running) return PyErr_Format(PyExc_RuntimeError, "already running");
    self->running = 1;
    Py_INCREF(self); /* the loop must not lose its object while it runs */
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_server_run(self->srv);
    Py_END_ALLOW_THREADS
    self->running = 0;
    Py_DECREF(self);
    if (rc) return raise_errno(rc, 0, "io_uring loop");
    Py_RETURN_NONE;
}

static PyObject *Server_stop(ServerObject *self, PyObject *noargs)
{
    (void)noargs;
    NEED_SRV(self);
    kvf_server_stop(self->srv);
    Py_RETURN_NONE;
}

static PyObject *Server_wait(ServerObject *self, PyObject *arg)
{
    NEED_SRV(self);
    int ms = (int)PyLong_AsLong(arg);
    if (ms == -1 && PyErr_Occurred()) return NULL;
    uint64_t want, free_bytes, dropped;
    Py_BEGIN_ALLOW_THREADS
    want = kvf_store_wait(self->st, ms, &free_bytes, &dropped);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(KKK)", (unsigned long long)want, (unsigned long long)free_bytes,
                         (unsigned long long)dropped);
}

static PyObject *Server_set_low(ServerObject *self, PyObject *arg)
{
    NEED_SRV(self);
    unsigned long long b = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    kvf_store_set_low(self->st, b);
    Py_RETURN_NONE;
}

static PyObject *Server_drain(ServerObject *self, PyObject *arg)
{
    NEED_SRV(self);
    long max = PyLong_AsLong(arg);
    if (max <= 0 || max > 1 << 20) return PyErr_Format(PyExc_ValueError, "max must be in 1..2**20");
    struct kvf_event *ev = PyMem_Malloc(sizeof(struct kvf_event) * (size_t)max);
    if (!ev) return PyErr_NoMemory();
    uint32_t n = kvf_store_drain(self->st, ev, (uint32_t)max);
    PyObject *out = PyList_New(n);
    for (uint32_t i = 0; out && i < n; i++) {
        PyObject *t = Py_BuildValue("(iy#Ky#y#)", ev[i].type, (const char *)ev[i].key, (Py_ssize_t)ev[i].klen,
                                    (unsigned long long)ev[i].size, ev[i].plen ? (const char *)ev[i].parent : NULL,
                                    (Py_ssize_t)ev[i].plen, ev[i].glen ? (const char *)ev[i].group : NULL,
                                    (Py_ssize_t)ev[i].glen);
        if (!t) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, t);
    }
    PyMem_Free(ev);
    return out;
}

static PyObject *Server_tier_events(ServerObject *self, PyObject *arg)
{
    NEED_SRV(self);
    long max = PyLong_AsLong(arg);
    if (max <= 0 || max > 1 << 16) return PyErr_Format(PyExc_ValueError, "max must be in 1..2**16");
    if (!self->tier) return Py_BuildValue("([]K)", 0ull);
    struct kvf_tier_event *ev = PyMem_Malloc(sizeof(struct kvf_tier_event) * (size_t)max);
    if (!ev) return PyErr_NoMemory();
    uint64_t dropped = 0;
    uint32_t n = kvf_tier_events_drain(self->tier, ev, (uint32_t)max, &dropped);
    PyObject *out = PyList_New(n);
    for (uint32_t i = 0; out && i < n; i++) {
        PyObject *t = Py_BuildValue("(iy#Ky#IK)", ev[i].type, (const char *)ev[i].key, (Py_ssize_t)ev[i].klen,
                                    (unsigned long long)ev[i].size, ev[i].glen ? (const char *)ev[i].gkey : NULL,
                                    (Py_ssize_t)ev[i].glen, ev[i].gparts, (unsigned long long)ev[i].ghash);
        if (!t) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, t);
    }
    PyMem_Free(ev);
    if (!out) return NULL;
    return Py_BuildValue("(NK)", out, (unsigned long long)dropped);
}

static int key_arg(PyObject *arg, Py_buffer *b)
{
    if (PyObject_GetBuffer(arg, b, PyBUF_SIMPLE)) return -1;
    if (b->len < 1 || b->len > KVF_KEY_MAX) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_ValueError, "keys are 1..%d bytes", KVF_KEY_MAX);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(evict_doc, "evict(key) -> int: bytes freed (whole pages); 0 when absent or pinned");

static PyObject *Server_evict(ServerObject *self, PyObject *arg)
{
    NEED_SRV(self);
    Py_buffer b;
    if (key_arg(arg, &b)) return NULL;
    int64_t rc;
    /* GIL released: with a tier the eviction copies the object (1 MiB KV blocks) for write-behind */
    self->evicting++;
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_store_evict(self->st, b.buf, (uint32_t)b.len);
    Py_END_ALLOW_THREADS
    self->evicting--;
    PyBuffer_Release(&b);
    return PyLong_FromLongLong(rc > 0 ? rc : 0);
}

static PyObject *Server_is_pinned(ServerObject *self, PyObject *arg)
{
    NEED_SRV(self);
    Py_buffer b;
    if (key_arg(arg, &b)) return NULL;
    int rc = kvf_store_is_pinned(self->st, b.buf, (uint32_t)b.len);
    PyBuffer_Release(&b);
    return PyBool_FromLong(rc);
}

static PyObject *Server_space_done(ServerObject *self, PyObject *arg)
{
    NEED_SRV(self);
    int exhausted = PyObject_IsTrue(arg);
    if (exhausted < 0) return NULL;
    uint64_t r = kvf_store_space_done(self->st, exhausted);
    kvf_server_wake(self->srv);
    return PyLong_FromUnsignedLongLong(r);
}

static PyObject *Server_sweep(ServerObject *self, PyObject *arg)
{
    NEED_SRV(self);
    unsigned long max = PyLong_AsUnsignedLong(arg);
    if (PyErr_Occurred()) return NULL;
    if (max > (1ul << 20)) return PyErr_Format(PyExc_ValueError, "sweep looks at most %lu entries a call", 1ul << 20);
    uint32_t freed;
    Py_BEGIN_ALLOW_THREADS
    freed = kvf_store_sweep(self->st, (uint32_t)max);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(freed);
}

static PyObject *Server_shared_retired_refresh(ServerObject *self, PyObject *noargs)
{
    (void)noargs;
    NEED_SRV(self);
    if (!self->shared) Py_RETURN_NONE;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_shared_retired_load(self->shared, self->ns); /* the records other servers appended since */
    Py_END_ALLOW_THREADS
    if (rc) return raise_errno(rc, 0, "reading the shared tier's retirement records");
    Py_RETURN_NONE;
}

static void keys_cb(const uint8_t *k, uint32_t kl, uint64_t size, void *arg)
{
    PyObject *t = Py_BuildValue("(y#K)", (const char *)k, (Py_ssize_t)kl, (unsigned long long)size);
    if (!t || PyList_Append((PyObject *)arg, t)) PyErr_Clear();
    Py_XDECREF(t);
}

static PyObject *Server_keys(ServerObject *self, PyObject *noargs)
{
    (void)noargs;
    NEED_SRV(self);
    PyObject *out = PyList_New(0);
    if (out) kvf_store_each(self->st, keys_cb, out); /* GIL held: the callback builds objects */
    return out;
}

static PyObject *Server_stats_map(ServerObject *self, PyObject *noargs)
{
    (void)noargs;
    NEED_SRV(self);
    uint8_t *buf;
    size_t len;
    int rc = kvf_server_stats_map(self->srv, &buf, &len);
    if (rc) return raise_errno(rc, 0, "building the STATS map");
    PyObject *out = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)len);
    free(buf);
    return out;
}

static PyObject *Server_auth_failures(ServerObject *self, PyObject *noargs)
{
    (void)noargs;
    NEED_SRV(self);
    char peers[KVF_AUTH_LOG][KVF_PEER_NAME];
    uint64_t lost;
    size_t n = kvf_server_auth_failures(self->srv, peers, KVF_AUTH_LOG, &lost);
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (!list) return NULL;
    for (size_t i = 0; i < n; i++) {
        PyObject *v = PyUnicode_DecodeUTF8(peers[i], (Py_ssize_t)strnlen(peers[i], KVF_PEER_NAME), "replace");
        if (!v) { Py_DECREF(list); return NULL; }
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    return Py_BuildValue("(NK)", list, (unsigned long long)lost);
}

PyDoc_STRVAR(tier_open_doc,
"tier_open(paths, capacity, admit=0, write_queue=64<<20, promote_max=0, gid=-1, events=0)\n"
"Open the SSD tier (one file per directory in paths; capacity bytes in all), rebuild its index from\n"
"the files and attach it: evicted objects are written behind, GET/LOOKUP read missing keys back.\n"
"admit: 0 all, 1 only objects read at least once. promote_max: bytes of arena slots (whole 4 KiB\n"
"pages per object) one request may promote "
"(0: capacity of the arena / 4). Before run(). Raises OSError(errno, reason) when a path is missing\n"
"or unwritable, O_DIRECT is unsupported (EINVAL), the space cannot be preallocated (ENOSPC).\n"
"paths may be empty (no SSD tier: the tier thread alone, for the shared tier of shared_path).\n"
"events: SSD index events kept for tier_events() (0: none recorded).\n"
"gid: the tier group (-1 none): a new tier file is 0640 of it, an existing one may be group-readable.\n"
"A tier file that is a symlink, not a regular file, has other links, belongs to another uid or is\n"
"open to group or others beyond that is refused (OSError with the reason).");

static PyObject *Server_tier_open(ServerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"paths", "capacity", "admit", "write_queue", "promote_max", "gid", "events", NULL};
    PyObject *paths_o;
    unsigned long long capacity, write_queue = 64ull << 20, promote_max = 0;
    int admit = 0;
    long long gid = -1;
    unsigned int events = 0;
    NEED_SRV(self);
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OK|iKKLI", kwlist, &paths_o, &capacity, &admit, &write_queue,
                                     &promote_max, &gid, &events))
        return NULL;
    if (events > KVF_TIER_EVENTS_MAX) return PyErr_Format(PyExc_ValueError, "events must be 0..%u", KVF_TIER_EVENTS_MAX);
    if (self->tier || self->running) return PyErr_Format(PyExc_RuntimeError, "tier already open, or running");
    if (admit != KVF_ADMIT_ALL && admit != KVF_ADMIT_HIT) return PyErr_Format(PyExc_ValueError, "admit is 0 or 1");
    PyObject *seq = PySequence_Fast(paths_o, "paths must be a sequence of str");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > (Py_ssize_t)KVF_TIER_MAX_PATHS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "at most %u paths", KVF_TIER_MAX_PATHS);
    }
    const char *paths[KVF_TIER_MAX_PATHS];
    for (Py_ssize_t i = 0; i < n; i++) {
        paths[i] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
        if (!paths[i]) { Py_DECREF(seq); return NULL; }
    }
    if (gid < -1 || gid >= (long long)UINT32_MAX) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "gid must be -1 (none) or a group id");
    }
    struct kvf_tier_cfg cfg = {paths, (uint32_t)n, capacity, write_queue, admit,
                               promote_max ? promote_max : kvf_store_capacity(self->st) / 4, gid, self->ns,
                               events};
    char err[512];
    int rc = 0;
    struct kvf_tier *t = NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_tier_open(&t, &cfg, err, sizeof err); /* loads the namespace retirements (cfg.ns) before its scan */
    Py_END_ALLOW_THREADS
    Py_DECREF(seq);
    if (rc) {
        PyObject *e = Py_BuildValue("(is)", -rc, err);
        if (e) { PyErr_SetObject(PyExc_OSError, e); Py_DECREF(e); }
        return NULL;
    }
    if (self->shared) kvf_tier_set_shared(t, self->shared, 0); /* PUTs are written through: not evictions */
    kvf_server_attach_tier(self->srv, t);
    self->tier = t;
    Py_RETURN_NONE;
}

static PyObject *Server_tier_close(ServerObject *self, PyObject *noargs)
{
    (void)noargs;
    NEED_SRV(self);
    if (self->running) return PyErr_Format(PyExc_RuntimeError, "stop the loop first");
    if (self->evicting) return PyErr_Format(PyExc_RuntimeError, "an eviction is running: stop the control thread first");
    tier_close(self);
    Py_RETURN_NONE;
}

static PyObject *Server_populate(ServerObject *self, PyObject *args)
{
    NEED_SRV(self);
    unsigned long long off, len;
    if (!PyArg_ParseTuple(args, "KK", &off, &len)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_store_populate(self->st, off, len);
    Py_END_ALLOW_THREADS
    if (rc) return raise_errno(rc, 0, "populating the arena");
    Py_RETURN_NONE;
}

static PyObject *Server_advise_huge_pages(ServerObject *self, PyObject *noargs)
{
    (void)noargs;
    NEED_SRV(self);
    int rc = kvf_store_advise_huge(self->st);
    if (rc) return raise_errno(rc, 0, "advising huge pages on the arena");
    Py_RETURN_NONE;
}

static PyObject *Server_check(ServerObject *self, PyObject *noargs)
{
    (void)noargs;
    NEED_SRV(self);
    return PyBool_FromLong(kvf_store_check(self->st) == 0);
}

static PyObject *Server_set_remote_arena(ServerObject *self, PyObject *args)
{
    NEED_SRV(self);
    Py_buffer md;
    unsigned long long base;
    if (!PyArg_ParseTuple(args, "y*K", &md, &base)) return NULL;
    int rc = kvf_server_set_remote_arena(self->srv, md.buf, (size_t)md.len, base);
    PyBuffer_Release(&md);
    if (rc == -EINVAL) {
        PyErr_SetString(PyExc_ValueError, "remote arena metadata is empty or does not fit max_meta - 64 bytes");
        return NULL;
    }
    if (rc) return raise_errno(rc, 0, "offering the arena to remote clients");
    Py_RETURN_NONE;
}

static PyObject *Server_memfd(ServerObject *self, void *closure)
{
    (void)closure;
    NEED_SRV(self);
    return PyLong_FromLong(kvf_store_memfd(self->st));
}

static PyMethodDef Server_methods[] = {
    {"run", (PyCFunction)Server_run, METH_NOARGS, "run the io_uring loop on this thread until stop() (GIL released)"},
    {"stop", (PyCFunction)Server_stop, METH_NOARGS, "ask the loop to stop; run() returns once connections closed"},
    {"wait", (PyCFunction)Server_wait, METH_O,
     "wait(timeout_ms) -> (bytes wanted, free bytes, events dropped ever); wakes on events, a waiting PUT\n"
     "or free space below the low watermark; GIL released"},
    {"set_low_watermark", (PyCFunction)Server_set_low, METH_O, "free bytes below which an allocation wakes wait()"},
    {"drain", (PyCFunction)Server_drain, METH_O, "drain(max) -> [(type, key, size, parent|None, group|None)] (1 insert, 2 access, 3 remove; a group's "
     "events name it by its representative key, size its bytes)"},
    {"evict", (PyCFunction)Server_evict, METH_O, evict_doc},
    {"tier_events", (PyCFunction)Server_tier_events, METH_O,
     "tier_events(max) -> ([(type, key, size, gkey|None, gparts, ghash)], dropped ever): the SSD index's events "
     "(1 stored, 2 removed; gkey on a group object's STORED only) kept since tier_open(events=N), oldest first"},
    {"is_pinned", (PyCFunction)Server_is_pinned, METH_O, "is_pinned(key) -> bool"},
    {"space_done", (PyCFunction)Server_space_done, METH_O, "space_done(exhausted) -> round; wakes parked PUTs"},
    {"sweep", (PyCFunction)Server_sweep, METH_O,
     "sweep(max) -> objects freed: look at up to max entries (from where the last call stopped) and free those of "
     "a retired namespace generation"},
    {"keys", (PyCFunction)Server_keys, METH_NOARGS, "[(key, size)] of every indexed object (policy resync)"},
    {"auth_failures", (PyCFunction)Server_auth_failures, METH_NOARGS,
     "auth_failures() -> ([peer, ...], lost): peers refused AUTH_FAILED since the last call (at most 16 kept)"},
    {"stats_map", (PyCFunction)Server_stats_map, METH_NOARGS,
     "the STATS map, msgpack: the bytes a STATS request is answered with (csrc/kvf_stats.c builds both)"},
    {"shared_retired_refresh", (PyCFunction)Server_shared_retired_refresh, METH_NOARGS,
     "shared_retired_refresh(): read the retirement records other servers appended to the shared directory "
     "since the last read (generations only grow); nothing without a shared tier. OSError when they cannot "
     "be read."},
    {"tier_open", (PyCFunction)(void (*)(void))Server_tier_open, METH_VARARGS | METH_KEYWORDS, tier_open_doc},
    {"tier_close", (PyCFunction)Server_tier_close, METH_NOARGS,
     "detach and close the tier after the loop and the control thread stopped (queued writes finish first)"},
    {"check", (PyCFunction)Server_check, METH_NOARGS, "allocator self-check -> bool"},
    {"set_remote_arena", (PyCFunction)Server_set_remote_arena, METH_VARARGS,
     "set_remote_arena(agent_metadata, base): offer the arena to nixl clients (before run()); ValueError when the\n"
     "metadata is empty or over max_meta - 64 bytes"},
    {"populate", (PyCFunction)Server_populate, METH_VARARGS,
     "populate(offset, length): fault arena pages in without changing them (GIL released); NativeError"},
    {"advise_huge_pages", (PyCFunction)Server_advise_huge_pages, METH_NOARGS,
     "advise_huge_pages(): MADV_HUGEPAGE on the arena, taken where the host's shmem THP mode allows; NativeError"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Server_getset[] = {
    {"memfd", (getter)Server_memfd, NULL, "the arena's memfd", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject kvf_py_ServerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvfabric._native.Server",
    .tp_basicsize = sizeof(ServerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Server_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Server_init,
    .tp_dealloc = (destructor)Server_dealloc,
    .tp_methods = Server_methods,
    .tp_getset = Server_getset,
};
