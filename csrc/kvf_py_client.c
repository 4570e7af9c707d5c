/* kvf_py_client.c: bindings of the native client (kvf_client.c): request(), send_frame(),
 * recv_frame() and ConnRing (caller buffers registered as io_uring fixed buffers).
 * Arguments are parsed and the GIL released here; errors go through raise_errno. */
#include "kvf_module_int.h"

#include "kvf_client.h"
#include "kvf_mpack.h"
#include "kvf_protocol.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ registered buffers */

/* ConnRing: caller buffers registered as io_uring fixed buffers on a ring of
 * their own, used by request()/recv_frame() (ring=...) for GET objects that
 * land inside them. The views are held until close(), so the memory stays put. */
typedef struct {
    PyObject_HEAD
    struct kvf_creg reg;
    struct bufset views;
    unsigned long long nbytes;
    int busy; /* a call with the GIL released is using it */
} RingObject;

static void Ring_close_impl(RingObject *self)
{
    kvf_creg_close(&self->reg);
    bufset_release(&self->views);
    self->nbytes = 0;
}

static void Ring_dealloc(RingObject *self)
{
    Ring_close_impl(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(Ring_doc,
"ConnRing(buffers)\n"
"Register writable contiguous buffers as io_uring fixed buffers on a new ring.\n"
"Limits are the caller's to check first. Raises ValueError (not a writable contiguous\n"
"buffer, none given, one over 1 GiB), NativeError (io_uring setup or registration failed,\n"
"e.g. ENOMEM over RLIMIT_MEMLOCK, EOPNOTSUPP without IORING_OP_READ_FIXED).");

static int Ring_init(RingObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"buffers", NULL};
    PyObject *bufs;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O", kwlist, &bufs)) return -1;
    if (self->views.n || self->reg.n) { PyErr_SetString(PyExc_ValueError, "ConnRing already initialised"); return -1; }
    if (bufset_get(&self->views, bufs, 1, "buffers")) return -1;
    Py_ssize_t n = self->views.n;
    if (n == 0 || n > 16384) {
        bufset_release(&self->views);
        PyErr_Format(PyExc_ValueError, "ConnRing: %zd buffers (1..16384)", n);
        return -1;
    }
    struct iovec *iov = PyMem_Malloc(sizeof(struct iovec) * (size_t)n);
    if (!iov) { bufset_release(&self->views); PyErr_NoMemory(); return -1; }
    unsigned long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        iov[i].iov_base = self->views.views[i].buf;
        iov[i].iov_len = (size_t)self->views.views[i].len;
        total += (unsigned long long)iov[i].iov_len;
        if (iov[i].iov_len == 0 || iov[i].iov_len > (1ull << 30)) {
            PyMem_Free(iov);
            bufset_release(&self->views);
            PyErr_Format(PyExc_ValueError, "ConnRing: buffer %zd holds %zd bytes (1 B..1 GiB)", i,
                         self->views.views[i].len);
            return -1;
        }
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_creg_open(&self->reg, iov, (unsigned)n);
    Py_END_ALLOW_THREADS
    PyMem_Free(iov);
    if (rc) {
        bufset_release(&self->views);
        raise_errno(rc, 0, "registering buffers with io_uring");
        return -1;
    }
    self->nbytes = total;
    return 0;
}

static PyObject *Ring_close(RingObject *self, PyObject *noargs)
{
    if (self->busy) return PyErr_Format(PyExc_RuntimeError, "ConnRing is in use by another thread");
    Ring_close_impl(self);
    Py_RETURN_NONE;
}

static PyObject *Ring_stats(RingObject *self, PyObject *noargs)
{
    return Py_BuildValue("{s:I,s:K,s:K,s:K}", "buffers", self->reg.n, "bytes", self->nbytes, "fixed_reads",
                         (unsigned long long)self->reg.fixed_reads, "fixed_bytes",
                         (unsigned long long)self->reg.fixed_bytes);
}

PyDoc_STRVAR(Ring_find_doc, "find(buffers) -> list[int]: the registered buffer holding each one, or -1");

static PyObject *Ring_find(RingObject *self, PyObject *arg)
{
    struct bufset b;
    if (bufset_get(&b, arg, 0, "buffers")) return NULL;
    PyObject *out = PyList_New(b.n);
    for (Py_ssize_t i = 0; out && i < b.n; i++)
        PyList_SET_ITEM(out, i, PyLong_FromLong(kvf_creg_find(&self->reg, b.views[i].buf, (size_t)b.views[i].len)));
    bufset_release(&b);
    return out;
}

static PyMethodDef Ring_methods[] = {
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "unregister the buffers and close the ring"},
    {"stats", (PyCFunction)Ring_stats, METH_NOARGS, "{buffers, bytes, fixed_reads, fixed_bytes}"},
    {"find", (PyCFunction)Ring_find, METH_O, Ring_find_doc},
    {NULL, NULL, 0, NULL},
};

PyTypeObject kvf_py_RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvfabric._native.ConnRing",
    .tp_basicsize = sizeof(RingObject),
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Ring_doc,
    .tp_methods = Ring_methods,
    .tp_init = (initproc)Ring_init,
    .tp_new = PyType_GenericNew,
};

/* ring argument: None -> NULL; a ConnRing -> its registration, marked busy. */
static int ring_arg(PyObject *o, RingObject **out)
{
    *out = NULL;
    if (!o || o == Py_None) return 0;
    if (!PyObject_TypeCheck(o, &kvf_py_RingType)) { PyErr_SetString(PyExc_TypeError, "ring must be a ConnRing or None"); return -1; }
    RingObject *r = (RingObject *)o;
    if (r->busy) { PyErr_SetString(PyExc_RuntimeError, "ConnRing is in use by another thread"); return -1; }
    if (!r->reg.n) return 0; /* closed: nothing registered, plain path */
    r->busy = 1;
    *out = r;
    return 0;
}

static void ring_done(RingObject *r)
{
    if (r) r->busy = 0;
}

/* ------------------------------------------------------------------ client frames */

/* Where a GET reply's objects go: views of the caller's buffers, flat, and
 * (scatter form) how many consecutive views each object owns. */
struct recvset {
    struct bufset b;
    uint32_t *nseg; /* PyMem; NULL: one view per object */
    uint32_t nobj;
};

#define KVF_MAX_SEGMENTS 64 /* buffers one object may be scattered over */

static void recvset_release(struct recvset *rs)
{
    bufset_release(&rs->b);
    PyMem_Free(rs->nseg);
    rs->nseg = NULL;
    rs->nobj = 0;
}

/* recv: one item per key, a writable buffer or a tuple of 1..KVF_MAX_SEGMENTS
 * writable buffers (the object fills them in order). 0, or -1 with a Python
 * exception set (nothing held). GIL held. */
static int recvset_get(struct recvset *rs, PyObject *recv)
{
    memset(rs, 0, sizeof *rs);
    PyObject *fast = PySequence_Fast(recv, "recv");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > UINT32_MAX) { Py_DECREF(fast); PyErr_SetString(PyExc_ValueError, "recv: too many buffers"); return -1; }
    int scatter = 0;
    for (Py_ssize_t i = 0; i < n && !scatter; i++) scatter = PyTuple_Check(PySequence_Fast_GET_ITEM(fast, i));
    if (!scatter) {
        int rc = bufset_get(&rs->b, fast, 1, "recv");
        Py_DECREF(fast);
        rs->nobj = (uint32_t)rs->b.n;
        return rc;
    }
    rs->nseg = PyMem_Malloc(sizeof(uint32_t) * (size_t)(n ? n : 1));
    PyObject *flat = PyList_New(0);
    if (!rs->nseg || !flat) { Py_XDECREF(flat); Py_DECREF(fast); recvset_release(rs); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        Py_ssize_t k = PyTuple_Check(item) ? PyTuple_GET_SIZE(item) : 1;
        if (k < 1 || k > KVF_MAX_SEGMENTS) {
            PyErr_Format(PyExc_ValueError, "recv[%zd]: a scatter entry holds 1..%d buffers, got %zd", i,
                         KVF_MAX_SEGMENTS, k);
            goto fail;
        }
        rs->nseg[i] = (uint32_t)k;
        for (Py_ssize_t j = 0; j < k; j++)
            if (PyList_Append(flat, PyTuple_Check(item) ? PyTuple_GET_ITEM(item, j) : item)) goto fail;
    }
    Py_DECREF(fast);
    fast = NULL;
    if (bufset_get(&rs->b, flat, 1, "recv")) goto fail;
    Py_DECREF(flat);
    rs->nobj = (uint32_t)n;
    return 0;
fail:
    Py_XDECREF(fast);
    Py_DECREF(flat);
    recvset_release(rs);
    return -1;
}

/* Checksums while receiving (hash_keys=, digests=): the keys' bytes (held
 * by the caller's list for the call) and the caller's output buffer. */
struct hashset {
    PyObject *fast;      /* the keys, as a fast sequence; NULL: no hashing */
    const void **keys;   /* PyMem */
    size_t *key_lens;    /* PyMem */
    Py_buffer out;       /* n uint64 digests */
};

static void hashset_release(struct hashset *hs)
{
    if (!hs->fast) return;
    Py_CLEAR(hs->fast);
    PyMem_Free(hs->keys);
    PyMem_Free(hs->key_lens);
    hs->keys = NULL;
    hs->key_lens = NULL;
    PyBuffer_Release(&hs->out);
}

/* hash_keys (bytes, one per GET object) and digests (a writable buffer of
 * at least 8 bytes per object, 8-byte aligned): both None or both given,
 * and only with recv buffers. 0, or -1 with a Python exception set (nothing held). GIL held. */
static int hashset_get(struct hashset *hs, PyObject *keys, PyObject *digests, const struct recvset *rs)
{
    memset(hs, 0, sizeof *hs);
    if (keys == Py_None && digests == Py_None) return 0;
    if (keys == Py_None || digests == Py_None || !rs) {
        PyErr_SetString(PyExc_ValueError, "hash_keys and digests go together, with recv buffers");
        return -1;
    }
    PyObject *fast = PySequence_Fast(keys, "hash_keys");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if ((uint64_t)n != rs->nobj) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "hash_keys: %zd keys for %u objects", n, rs->nobj);
        return -1;
    }
    if (PyObject_GetBuffer(digests, &hs->out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)) { Py_DECREF(fast); return -1; }
    if (hs->out.len < n * (Py_ssize_t)sizeof(uint64_t) || ((uintptr_t)hs->out.buf % sizeof(uint64_t))) {
        PyBuffer_Release(&hs->out);
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "digests: an 8-byte aligned buffer of 8 bytes per key");
        return -1;
    }
    hs->fast = fast;
    hs->keys = PyMem_Malloc(sizeof(void *) * (size_t)(n ? n : 1));
    hs->key_lens = PyMem_Malloc(sizeof(size_t) * (size_t)(n ? n : 1));
    if (!hs->keys || !hs->key_lens) { hashset_release(hs); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyBytes_Check(k)) { hashset_release(hs); PyErr_SetString(PyExc_TypeError, "hash_keys: bytes"); return -1; }
        hs->keys[i] = PyBytes_AS_STRING(k);
        hs->key_lens[i] = (size_t)PyBytes_GET_SIZE(k);
    }
    return 0;
}

struct recv_result {
    struct kvf_header h;
    uint8_t *meta;       /* malloc'd */
    PyObject *payload;   /* bytearray when no recv buffers were given */
    int wire_err;
    uint32_t bad_index;
};

/* GIL released. Receives one reply into r; object payload into rs when given. */
static int recv_reply_nogil(int fd, struct recv_result *r, struct recvset *rs, uint32_t max_meta,
                            uint64_t max_payload, char *payload_buf, struct kvf_creg *reg, struct hashset *hs)
{
    int rc = kvf_recv_header(fd, &r->h, max_meta, max_payload, &r->wire_err);
    if (rc) return rc;
    r->meta = malloc(r->h.meta_len ? r->h.meta_len : 1);
    if (!r->meta) return -ENOMEM;
    rc = kvf_recv_all(fd, r->meta, r->h.meta_len);
    if (rc || r->h.payload_len == 0) return rc;
    if (r->h.flags & KVF_FLAG_ERROR) { r->wire_err = KVF_E_MALFORMED; return -EPROTO; }
    if (payload_buf) return 1; /* caller allocates, then receives */
    if (!rs) return 1;
    uint32_t n = rs->nobj;
    size_t nb = (size_t)rs->b.n;
    int64_t *sizes = malloc(sizeof(int64_t) * (n ? n : 1));
    void **ptrs = malloc(sizeof(void *) * (nb ? nb : 1));
    size_t *lens = malloc(sizeof(size_t) * (nb ? nb : 1));
    if (!sizes || !ptrs || !lens) { free(sizes); free(ptrs); free(lens); return -ENOMEM; }
    rc = kvf_parse_sizes(r->meta, r->h.meta_len, sizes, n);
    if (rc == 0) {
        for (size_t i = 0; i < nb; i++) { ptrs[i] = rs->b.views[i].buf; lens[i] = (size_t)rs->b.views[i].len; }
        int hashing = hs && hs->fast;
        rc = kvf_recv_objects(fd, r->h.payload_len, sizes, ptrs, lens, n, rs->nseg, &r->bad_index, reg,
                              hashing ? hs->keys : NULL, hashing ? hs->key_lens : NULL,
                              hashing ? (uint64_t *)hs->out.buf : NULL);
        if (rc == -EPROTO) r->wire_err = KVF_E_LENGTH_MISMATCH;
    } else {
        r->wire_err = KVF_E_MALFORMED;
    }
    free(sizes); free(ptrs); free(lens);
    return rc;
}

static PyObject *finish_recv(int fd, struct recv_result *r, struct recvset *bufs, int rc, uint64_t max_payload)
{
    PyObject *payload = Py_None;
    Py_INCREF(payload);
    if (rc == 1) {
        /* payload with no caller buffers: one bytearray (limit already checked) */
        (void)max_payload;
        Py_DECREF(payload);
        payload = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)r->h.payload_len);
        if (!payload) { free(r->meta); return NULL; }
        char *dst = PyByteArray_AS_STRING(payload);
        Py_BEGIN_ALLOW_THREADS
        rc = kvf_recv_all(fd, dst, r->h.payload_len);
        Py_END_ALLOW_THREADS
    }
    if (rc == -EMSGSIZE) {
        Py_DECREF(payload);
        free(r->meta);
        return PyErr_Format(PyExc_ValueError, "GET buffer %u is too small for its object", r->bad_index);
    }
    if (rc) {
        Py_DECREF(payload);
        free(r->meta);
        if (rc == -EPROTO && r->wire_err == KVF_E_BAD_VERSION) { /* name both versions */
            char what[128];
            snprintf(what, sizeof what,
                     "the peer speaks protocol %u, this side protocol %d (checksums bind keys since protocol 2)",
                     (unsigned)r->h.version, KVF_VERSION);
            return raise_errno(rc, r->wire_err, what);
        }
        return raise_errno(rc, r->wire_err, "receiving a reply");
    }
    (void)bufs;
    PyObject *meta = PyBytes_FromStringAndSize((const char *)r->meta, r->h.meta_len);
    free(r->meta);
    if (!meta) { Py_DECREF(payload); return NULL; }
    return Py_BuildValue("(iiKNKN)", r->h.opcode, r->h.flags, (unsigned long long)r->h.request_id, meta,
                         (unsigned long long)r->h.payload_len, payload);
}

PyDoc_STRVAR(request_doc,
"request(fd, opcode, request_id, meta, parts, recv, max_meta, max_payload, flags=0, send=True, deadline=0,\n"
"        ring=None, hash_keys=None, digests=None)\n"
"Send one frame and receive one reply on the blocking socket fd, GIL released.\n"
"hash_keys, digests (with recv): the GET's keys and a writable 8-byte aligned buffer of one\n"
"uint64 per key; each object found gets its checksum (protocol.checksum) there, computed\n"
"as its bytes land; entries of misses are left as they are.\n"
"ring: a ConnRing; GET objects whose recv buffer lies in one of its registered buffers are\n"
"read with io_uring READ_FIXED, the others with recvmsg.\n"
"recv: writable buffers (one per key) that a GET reply's objects go into (an entry may be\n"
"a tuple of 1..64 writable buffers: that object fills them in order), or None\n"
"(the payload then comes back as one bytearray). Returns (opcode, flags, request_id,\n"
"meta_bytes, payload_len, payload_or_None). Raises ConnectionClosed, DeadlineExceeded\n"
"(the absolute time.monotonic() deadline passed), ProtocolError, ValueError (an object larger than its buffer;\n"
"the payload was drained) or NativeError.");

static PyObject *py_request(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"fd", "opcode", "request_id", "meta", "parts", "recv", "max_meta", "max_payload",
                             "flags", "send", "deadline", "ring", "hash_keys", "digests", NULL};
    int fd, opcode, flags = 0, do_send = 1;
    double deadline = 0;
    unsigned long long rid, max_payload;
    unsigned int max_meta;
    Py_buffer meta;
    PyObject *parts, *recv, *ring_o = Py_None, *hkeys = Py_None, *digests = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiKy*OOIK|ipdOOO", kwlist, &fd, &opcode, &rid, &meta, &parts, &recv,
                                     &max_meta, &max_payload, &flags, &do_send, &deadline, &ring_o, &hkeys,
                                     &digests))
        return NULL;
    if (opcode < 0 || opcode > 255 || flags < 0 || flags > 255 || meta.len > UINT32_MAX) {
        PyBuffer_Release(&meta);
        return PyErr_Format(PyExc_ValueError, "opcode/flags out of range or meta too large");
    }
    struct bufset pb = {0};
    struct recvset rb = {{0}, NULL, 0};
    if (bufset_get(&pb, parts, 0, "parts")) { PyBuffer_Release(&meta); return NULL; }
    int have_recv = recv != Py_None;
    if (have_recv && recvset_get(&rb, recv)) { bufset_release(&pb); PyBuffer_Release(&meta); return NULL; }
    struct hashset hs;
    if (hashset_get(&hs, hkeys, digests, have_recv ? &rb : NULL)) {
        bufset_release(&pb); recvset_release(&rb); PyBuffer_Release(&meta); return NULL;
    }
    struct iovec *iov = PyMem_Malloc(sizeof(struct iovec) * (size_t)(pb.n ? pb.n : 1));
    if (!iov) {
        hashset_release(&hs); bufset_release(&pb); recvset_release(&rb); PyBuffer_Release(&meta);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < pb.n; i++) { iov[i].iov_base = pb.views[i].buf; iov[i].iov_len = (size_t)pb.views[i].len; }
    RingObject *ring = NULL;
    if (ring_arg(ring_o, &ring)) {
        PyMem_Free(iov); hashset_release(&hs); bufset_release(&pb); recvset_release(&rb); PyBuffer_Release(&meta);
        return NULL;
    }
    struct kvf_creg *reg = ring ? &ring->reg : NULL;
    struct recv_result r;
    memset(&r, 0, sizeof r);
    int rc = 0, sent_ok = 1;
    kvf_set_deadline(deadline > 0 ? (int64_t)(deadline * 1e9) : 0);
    Py_BEGIN_ALLOW_THREADS
    if (do_send) rc = kvf_send_frame(fd, (uint8_t)opcode, (uint8_t)flags, rid, meta.buf, (uint32_t)meta.len, iov, (int)pb.n);
    if (rc) sent_ok = 0;
    else rc = recv_reply_nogil(fd, &r, have_recv ? &rb : NULL, max_meta, max_payload, NULL, reg, &hs);
    Py_END_ALLOW_THREADS
    ring_done(ring);
    hashset_release(&hs);
    PyMem_Free(iov);
    bufset_release(&pb);
    PyBuffer_Release(&meta);
    PyObject *out;
    if (!sent_ok) out = raise_errno(rc, 0, "sending a request");
    else out = finish_recv(fd, &r, &rb, rc, max_payload);
    recvset_release(&rb);
    return out;
}

PyDoc_STRVAR(send_frame_doc,
"send_frame(fd, opcode, flags, request_id, meta, parts, deadline=0)\n"
"Send one frame (header + meta + gathered payload parts), GIL released.");

static PyObject *py_send_frame(PyObject *self, PyObject *args)
{
    (void)self;
    int fd, opcode, flags;
    unsigned long long rid;
    Py_buffer meta;
    PyObject *parts;
    double deadline = 0;
    if (!PyArg_ParseTuple(args, "iiiKy*O|d", &fd, &opcode, &flags, &rid, &meta, &parts, &deadline)) return NULL;
    if (opcode < 0 || opcode > 255 || flags < 0 || flags > 255 || meta.len > UINT32_MAX) {
        PyBuffer_Release(&meta);
        return PyErr_Format(PyExc_ValueError, "opcode/flags out of range or meta too large");
    }
    struct bufset pb;
    if (bufset_get(&pb, parts, 0, "parts")) { PyBuffer_Release(&meta); return NULL; }
    struct iovec *iov = PyMem_Malloc(sizeof(struct iovec) * (size_t)(pb.n ? pb.n : 1));
    if (!iov) { bufset_release(&pb); PyBuffer_Release(&meta); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < pb.n; i++) { iov[i].iov_base = pb.views[i].buf; iov[i].iov_len = (size_t)pb.views[i].len; }
    int rc;
    kvf_set_deadline(deadline > 0 ? (int64_t)(deadline * 1e9) : 0);
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_send_frame(fd, (uint8_t)opcode, (uint8_t)flags, rid, meta.buf, (uint32_t)meta.len, iov, (int)pb.n);
    Py_END_ALLOW_THREADS
    PyMem_Free(iov);
    bufset_release(&pb);
    PyBuffer_Release(&meta);
    if (rc) return raise_errno(rc, 0, "sending a frame");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(send_frames_doc,
"send_frames(fds, opcodes, request_ids, metas, deadline=0) -> list[int]\n"
"Send frame i (opcode, request id, metadata bytes; no payload) on socket fds[i], every frame\n"
"handed to the kernel in one io_uring submission (see kvf_send_frames), GIL released. Returns\n"
"each frame's result: 0, or the -errno that frame's socket failed with (the others are sent).\n"
"At most 64 frames; ValueError for lists of different lengths or a bad opcode.");

static PyObject *py_send_frames(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *fds_o, *ops_o, *rids_o, *metas_o;
    double deadline = 0;
    if (!PyArg_ParseTuple(args, "OOOO|d", &fds_o, &ops_o, &rids_o, &metas_o, &deadline)) return NULL;
    Py_ssize_t n = PySequence_Size(fds_o);
    if (n < 0) return NULL;
    if (n > KVF_SEND_FRAMES_MAX || PySequence_Size(ops_o) != n || PySequence_Size(rids_o) != n ||
        PySequence_Size(metas_o) != n) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "send_frames: 0..%d frames, the four lists of one length",
                         KVF_SEND_FRAMES_MAX);
        return NULL;
    }
    int fds[KVF_SEND_FRAMES_MAX], rcs[KVF_SEND_FRAMES_MAX];
    uint8_t ops[KVF_SEND_FRAMES_MAX];
    uint64_t rids[KVF_SEND_FRAMES_MAX];
    const void *metas[KVF_SEND_FRAMES_MAX];
    uint32_t lens[KVF_SEND_FRAMES_MAX];
    struct bufset mb;
    if (bufset_get(&mb, metas_o, 0, "metas")) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PySequence_GetItem(fds_o, i), *o = PySequence_GetItem(ops_o, i), *r = PySequence_GetItem(rids_o, i);
        long fd = f ? PyLong_AsLong(f) : -1, op = o ? PyLong_AsLong(o) : -1;
        unsigned long long rid = r ? PyLong_AsUnsignedLongLong(r) : 0;
        Py_XDECREF(f);
        Py_XDECREF(o);
        Py_XDECREF(r);
        if (PyErr_Occurred()) { bufset_release(&mb); return NULL; }
        if (fd < 0 || fd > INT_MAX || op < 0 || op > 255 || mb.views[i].len > UINT32_MAX) {
            bufset_release(&mb);
            return PyErr_Format(PyExc_ValueError, "send_frames: frame %zd has a bad fd, opcode or metadata", i);
        }
        fds[i] = (int)fd;
        ops[i] = (uint8_t)op;
        rids[i] = rid;
        metas[i] = mb.views[i].buf;
        lens[i] = (uint32_t)mb.views[i].len;
    }
    int rc;
    kvf_set_deadline(deadline > 0 ? (int64_t)(deadline * 1e9) : 0);
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_send_frames((uint32_t)n, fds, ops, rids, metas, lens, rcs);
    Py_END_ALLOW_THREADS
    bufset_release(&mb);
    if (rc) return raise_errno(rc, 0, "sending frames");
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLong(rcs[i]);
        if (!v) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

PyDoc_STRVAR(recv_frame_doc,
"recv_frame(fd, recv, max_meta, max_payload, deadline=0, ring=None, hash_keys=None, digests=None)\n"
"Receive one frame; same result and errors as request().");

static PyObject *py_recv_frame(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    PyObject *recv, *ring_o = Py_None, *hkeys = Py_None, *digests = Py_None;
    unsigned int max_meta;
    unsigned long long max_payload;
    double deadline = 0;
    if (!PyArg_ParseTuple(args, "iOIK|dOOO", &fd, &recv, &max_meta, &max_payload, &deadline, &ring_o, &hkeys,
                          &digests))
        return NULL;
    struct recvset rb = {{0}, NULL, 0};
    int have_recv = recv != Py_None;
    if (have_recv && recvset_get(&rb, recv)) return NULL;
    struct hashset hs;
    if (hashset_get(&hs, hkeys, digests, have_recv ? &rb : NULL)) { recvset_release(&rb); return NULL; }
    RingObject *ring = NULL;
    if (ring_arg(ring_o, &ring)) { hashset_release(&hs); recvset_release(&rb); return NULL; }
    struct kvf_creg *reg = ring ? &ring->reg : NULL;
    struct recv_result r;
    memset(&r, 0, sizeof r);
    int rc;
    kvf_set_deadline(deadline > 0 ? (int64_t)(deadline * 1e9) : 0);
    Py_BEGIN_ALLOW_THREADS
    rc = recv_reply_nogil(fd, &r, have_recv ? &rb : NULL, max_meta, max_payload, NULL, reg, &hs);
    Py_END_ALLOW_THREADS
    ring_done(ring);
    hashset_release(&hs);
    PyObject *out = finish_recv(fd, &r, &rb, rc, max_payload);
    recvset_release(&rb);
    return out;
}

/* ------------------------------------------------------------------ method table */

PyMethodDef kvf_py_client_methods[] = {
    {"request", (PyCFunction)(void (*)(void))py_request, METH_VARARGS | METH_KEYWORDS, request_doc},
    {"send_frame", py_send_frame, METH_VARARGS, send_frame_doc},
    {"send_frames", py_send_frames, METH_VARARGS, send_frames_doc},
    {"recv_frame", py_recv_frame, METH_VARARGS, recv_frame_doc},
    {NULL, NULL, 0, NULL},
};
