/* kvf_module.c: the one binding file of kvfabric._native.
 *
 * It parses arguments, releases the GIL around every call into the C data
 * plane, and turns a negative errno into a kvfabric.errors exception in one
 * place (raise_errno). Nothing here decides policy: routing, retries,
 * eviction, configuration and logging stay in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <string.h>

#include "kvf_conn.h"
#include "kvf_mpack.h"
#include "kvf_protocol.h"

#include "kvf_hash.h"

static PyObject *ErrTransport, *ErrClosed, *ErrDeadline, *ErrProtocol, *ErrNative, *ErrorCodeEnum;

/* The single errno -> exception mapping. `what` names the operation. */
static PyObject *raise_errno(int rc, int wire_err, const char *what)
{
    int e = -rc;
    switch (e) {
    case ECONNRESET:
    case EPIPE:
    case ENOTCONN:
    case ESHUTDOWN:
        return PyErr_Format(ErrClosed, "%s: the peer closed the connection", what);
    case EAGAIN:
    case ETIMEDOUT:
        return PyErr_Format(ErrDeadline, "%s: timed out", what);
    case EPROTO: {
        PyObject *code = PyObject_CallFunction(ErrorCodeEnum, "i", wire_err ? wire_err : KVF_E_MALFORMED);
        if (!code) return NULL;
        PyObject *exc = PyObject_CallFunction(ErrProtocol, "Os", code, what);
        Py_DECREF(code);
        if (exc) { PyErr_SetObject(ErrProtocol, exc); Py_DECREF(exc); }
        return NULL;
    }
    case ENOMEM:
        return PyErr_NoMemory();
    case EINVAL:
        return PyErr_Format(PyExc_ValueError, "%s: invalid argument", what);
    default: {
        PyObject *exc = PyObject_CallFunction(ErrNative, "is", e, strerror(e));
        if (exc) {
            PyObject *msg = PyUnicode_FromFormat("%s: %s", what, strerror(e));
            if (msg) { PyObject_SetAttrString(exc, "what", msg); Py_DECREF(msg); }
            PyErr_SetObject(ErrNative, exc);
            Py_DECREF(exc);
        }
        return NULL;
    }
    }
}

/* ------------------------------------------------------------------ buffers */

struct bufset {
    Py_buffer *views;
    Py_ssize_t n;
};

static void bufset_release(struct bufset *b)
{
    for (Py_ssize_t i = 0; i < b->n; i++) PyBuffer_Release(&b->views[i]);
    PyMem_Free(b->views);
    b->views = NULL;
    b->n = 0;
}

/* Get contiguous byte views of every item of `seq` (writable if asked). */
static int bufset_get(struct bufset *b, PyObject *seq, int writable, const char *what)
{
    b->views = NULL;
    b->n = 0;
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    b->views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (!b->views) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &b->views[i],
                               writable ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) : PyBUF_C_CONTIGUOUS)) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] must be a %scontiguous buffer", what, i, writable ? "writable " : "");
            bufset_release(b);
            Py_DECREF(fast);
            return -1;
        }
        b->n = i + 1;
    }
    Py_DECREF(fast);
    return 0;
}

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

static PyTypeObject RingType = {
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
    if (!PyObject_TypeCheck(o, &RingType)) { PyErr_SetString(PyExc_TypeError, "ring must be a ConnRing or None"); return -1; }
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

struct recv_result {
    struct kvf_header h;
    uint8_t *meta;       /* malloc'd */
    PyObject *payload;   /* bytearray when no recv buffers were given */
    int wire_err;
    uint32_t bad_index;
};

/* GIL released. Receives one reply into r; object payload into bufs when given. */
static int recv_reply_nogil(int fd, struct recv_result *r, struct bufset *bufs, uint32_t max_meta,
                            uint64_t max_payload, char *payload_buf, struct kvf_creg *reg)
{
    int rc = kvf_recv_header(fd, &r->h, max_meta, max_payload, &r->wire_err);
    if (rc) return rc;
    r->meta = malloc(r->h.meta_len ? r->h.meta_len : 1);
    if (!r->meta) return -ENOMEM;
    rc = kvf_recv_all(fd, r->meta, r->h.meta_len);
    if (rc || r->h.payload_len == 0) return rc;
    if (r->h.flags & KVF_FLAG_ERROR) { r->wire_err = KVF_E_MALFORMED; return -EPROTO; }
    if (payload_buf) return 1; /* caller allocates, then receives */
    if (!bufs) return 1;
    uint32_t n = (uint32_t)bufs->n;
    int64_t *sizes = malloc(sizeof(int64_t) * (n ? n : 1));
    void **ptrs = malloc(sizeof(void *) * (n ? n : 1));
    size_t *lens = malloc(sizeof(size_t) * (n ? n : 1));
    if (!sizes || !ptrs || !lens) { free(sizes); free(ptrs); free(lens); return -ENOMEM; }
    rc = kvf_parse_sizes(r->meta, r->h.meta_len, sizes, n);
    if (rc == 0) {
        for (uint32_t i = 0; i < n; i++) { ptrs[i] = bufs->views[i].buf; lens[i] = (size_t)bufs->views[i].len; }
        rc = kvf_recv_objects(fd, r->h.payload_len, sizes, ptrs, lens, n, &r->bad_index, reg);
        if (rc == -EPROTO) r->wire_err = KVF_E_LENGTH_MISMATCH;
    } else {
        r->wire_err = KVF_E_MALFORMED;
    }
    free(sizes); free(ptrs); free(lens);
    return rc;
}

static PyObject *finish_recv(int fd, struct recv_result *r, struct bufset *bufs, int rc, uint64_t max_payload)
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
"        ring=None)\n"
"Send one frame and receive one reply on the blocking socket fd, GIL released.\n"
"ring: a ConnRing; GET objects whose recv buffer lies in one of its registered buffers are\n"
"read with io_uring READ_FIXED, the others with recvmsg.\n"
"recv: writable buffers (one per key) that a GET reply's objects go into, or None\n"
"(the payload then comes back as one bytearray). Returns (opcode, flags, request_id,\n"
"meta_bytes, payload_len, payload_or_None). Raises ConnectionClosed, DeadlineExceeded\n"
"(the absolute time.monotonic() deadline passed), ProtocolError, ValueError (an object larger than its buffer;\n"
"the payload was drained) or NativeError.");

static PyObject *py_request(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"fd", "opcode", "request_id", "meta", "parts", "recv", "max_meta", "max_payload",
                             "flags", "send", "deadline", "ring", NULL};
    int fd, opcode, flags = 0, do_send = 1;
    double deadline = 0;
    unsigned long long rid, max_payload;
    unsigned int max_meta;
    Py_buffer meta;
    PyObject *parts, *recv, *ring_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiKy*OOIK|ipdO", kwlist, &fd, &opcode, &rid, &meta, &parts, &recv,
                                     &max_meta, &max_payload, &flags, &do_send, &deadline, &ring_o))
        return NULL;
    if (opcode < 0 || opcode > 255 || flags < 0 || flags > 255 || meta.len > UINT32_MAX) {
        PyBuffer_Release(&meta);
        return PyErr_Format(PyExc_ValueError, "opcode/flags out of range or meta too large");
    }
    struct bufset pb = {0}, rb = {0};
    if (bufset_get(&pb, parts, 0, "parts")) { PyBuffer_Release(&meta); return NULL; }
    int have_recv = recv != Py_None;
    if (have_recv && bufset_get(&rb, recv, 1, "recv")) { bufset_release(&pb); PyBuffer_Release(&meta); return NULL; }
    struct iovec *iov = PyMem_Malloc(sizeof(struct iovec) * (size_t)(pb.n ? pb.n : 1));
    if (!iov) { bufset_release(&pb); bufset_release(&rb); PyBuffer_Release(&meta); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < pb.n; i++) { iov[i].iov_base = pb.views[i].buf; iov[i].iov_len = (size_t)pb.views[i].len; }
    RingObject *ring = NULL;
    if (ring_arg(ring_o, &ring)) { PyMem_Free(iov); bufset_release(&pb); bufset_release(&rb); PyBuffer_Release(&meta); return NULL; }
    struct kvf_creg *reg = ring ? &ring->reg : NULL;
    struct recv_result r;
    memset(&r, 0, sizeof r);
    int rc = 0, sent_ok = 1;
    kvf_set_deadline(deadline > 0 ? (int64_t)(deadline * 1e9) : 0);
    Py_BEGIN_ALLOW_THREADS
    if (do_send) rc = kvf_send_frame(fd, (uint8_t)opcode, (uint8_t)flags, rid, meta.buf, (uint32_t)meta.len, iov, (int)pb.n);
    if (rc) sent_ok = 0;
    else rc = recv_reply_nogil(fd, &r, have_recv ? &rb : NULL, max_meta, max_payload, NULL, reg);
    Py_END_ALLOW_THREADS
    ring_done(ring);
    PyMem_Free(iov);
    bufset_release(&pb);
    PyBuffer_Release(&meta);
    PyObject *out;
    if (!sent_ok) out = raise_errno(rc, 0, "sending a request");
    else out = finish_recv(fd, &r, &rb, rc, max_payload);
    bufset_release(&rb);
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

PyDoc_STRVAR(recv_frame_doc,
"recv_frame(fd, recv, max_meta, max_payload, deadline=0, ring=None)\n"
"Receive one frame; same result and errors as request().");

static PyObject *py_recv_frame(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    PyObject *recv, *ring_o = Py_None;
    unsigned int max_meta;
    unsigned long long max_payload;
    double deadline = 0;
    if (!PyArg_ParseTuple(args, "iOIK|dO", &fd, &recv, &max_meta, &max_payload, &deadline, &ring_o)) return NULL;
    struct bufset rb = {0};
    int have_recv = recv != Py_None;
    if (have_recv && bufset_get(&rb, recv, 1, "recv")) return NULL;
    RingObject *ring = NULL;
    if (ring_arg(ring_o, &ring)) { bufset_release(&rb); return NULL; }
    struct kvf_creg *reg = ring ? &ring->reg : NULL;
    struct recv_result r;
    memset(&r, 0, sizeof r);
    int rc;
    kvf_set_deadline(deadline > 0 ? (int64_t)(deadline * 1e9) : 0);
    Py_BEGIN_ALLOW_THREADS
    rc = recv_reply_nogil(fd, &r, have_recv ? &rb : NULL, max_meta, max_payload, NULL, reg);
    Py_END_ALLOW_THREADS
    ring_done(ring);
    PyObject *out = finish_recv(fd, &r, &rb, rc, max_payload);
    bufset_release(&rb);
    return out;
}

/* ------------------------------------------------------------------ test hooks */

PyDoc_STRVAR(pack_header_doc, "pack_header(opcode, flags, request_id, meta_len, payload_len) -> bytes (C layout)");

static PyObject *py_pack_header(PyObject *self, PyObject *args)
{
    (void)self;
    int opcode, flags;
    unsigned long long rid, plen;
    unsigned int mlen;
    if (!PyArg_ParseTuple(args, "iiKIK", &opcode, &flags, &rid, &mlen, &plen)) return NULL;
    struct kvf_header h;
    kvf_header_pack(&h, (uint8_t)opcode, (uint8_t)flags, rid, mlen, plen);
    return PyBytes_FromStringAndSize((const char *)&h, sizeof h);
}

PyDoc_STRVAR(check_header_doc, "check_header(bytes32, max_meta, max_payload) -> 0 or the kvf error code");

static PyObject *py_check_header(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer b;
    unsigned int max_meta;
    unsigned long long max_payload;
    if (!PyArg_ParseTuple(args, "y*IK", &b, &max_meta, &max_payload)) return NULL;
    if (b.len != KVF_HEADER_SIZE) { PyBuffer_Release(&b); return PyErr_Format(PyExc_ValueError, "need 32 bytes"); }
    struct kvf_header h;
    memcpy(&h, b.buf, sizeof h);
    PyBuffer_Release(&b);
    return PyLong_FromLong(-kvf_header_check(&h, max_meta, max_payload));
}

static PyObject *py_layout(PyObject *self, PyObject *noargs)
{
    (void)self; (void)noargs;
    return Py_BuildValue(
        "{s:n,s:(nn),s:(nn),s:(nn),s:(nn),s:(nn),s:(nn),s:(nn),s:(nn),s:i,s:i,s:i,s:y}",
        "size", (Py_ssize_t)sizeof(struct kvf_header),
        "magic", (Py_ssize_t)offsetof(struct kvf_header, magic), (Py_ssize_t)4,
        "version", (Py_ssize_t)offsetof(struct kvf_header, version), (Py_ssize_t)2,
        "opcode", (Py_ssize_t)offsetof(struct kvf_header, opcode), (Py_ssize_t)1,
        "flags", (Py_ssize_t)offsetof(struct kvf_header, flags), (Py_ssize_t)1,
        "request_id", (Py_ssize_t)offsetof(struct kvf_header, request_id), (Py_ssize_t)8,
        "meta_len", (Py_ssize_t)offsetof(struct kvf_header, meta_len), (Py_ssize_t)4,
        "payload_len", (Py_ssize_t)offsetof(struct kvf_header, payload_len), (Py_ssize_t)8,
        "reserved", (Py_ssize_t)offsetof(struct kvf_header, reserved), (Py_ssize_t)4,
        "VERSION", KVF_VERSION, "FLAG_REPLY", KVF_FLAG_REPLY, "FLAG_ERROR", KVF_FLAG_ERROR, "MAGIC", KVF_MAGIC);
}

static PyObject *py_constants(PyObject *self, PyObject *noargs)
{
    (void)self; (void)noargs;
    return Py_BuildValue(
        "{s:{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i},"
        "s:{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i},"
        "s:{s:i,s:i,s:i,s:i,s:i},"
        "s:{s:I,s:I,s:I,s:K,s:K,s:I},"
        "s:{s:i,s:i,s:i,s:i,s:i}}",
        "ops", "HELLO", KVF_OP_HELLO, "PING", KVF_OP_PING, "EXISTS", KVF_OP_EXISTS, "LOOKUP", KVF_OP_LOOKUP,
        "GET", KVF_OP_GET, "PUT", KVF_OP_PUT, "DELETE", KVF_OP_DELETE, "STATS", KVF_OP_STATS,
        "errors", "BAD_MAGIC", KVF_E_BAD_MAGIC, "BAD_VERSION", KVF_E_BAD_VERSION, "UNKNOWN_OPCODE",
        KVF_E_UNKNOWN_OPCODE, "MALFORMED", KVF_E_MALFORMED, "TOO_MANY_KEYS", KVF_E_TOO_MANY_KEYS,
        "PAYLOAD_TOO_LARGE", KVF_E_PAYLOAD_TOO_LARGE, "META_TOO_LARGE", KVF_E_META_TOO_LARGE, "LENGTH_MISMATCH",
        KVF_E_LENGTH_MISMATCH, "AUTH_FAILED", KVF_E_AUTH_FAILED, "TOO_MANY_IN_FLIGHT", KVF_E_TOO_MANY_IN_FLIGHT,
        "BUSY", KVF_E_BUSY, "INTERNAL", KVF_E_INTERNAL, "BAD_KEY", KVF_E_BAD_KEY,
        "put_status", "STORED", KVF_PUT_STORED, "EXISTS", KVF_PUT_EXISTS, "TOO_LARGE", KVF_PUT_TOO_LARGE,
        "NO_SPACE", KVF_PUT_NO_SPACE, "CHECKSUM_MISMATCH", KVF_PUT_CHECKSUM_MISMATCH,
        "limits", "max_keys_per_batch", KVF_MAX_KEYS_PER_BATCH, "max_key_bytes", KVF_MAX_KEY_BYTES,
        "max_meta_bytes", KVF_MAX_META_BYTES, "max_payload_bytes", (unsigned long long)KVF_MAX_PAYLOAD_BYTES,
        "max_object_bytes", (unsigned long long)KVF_MAX_OBJECT_BYTES, "max_in_flight", KVF_MAX_IN_FLIGHT,
        "shm_ops", "ATTACH", KVF_OP_SHM_ATTACH, "LEASE", KVF_OP_SHM_LEASE, "RELEASE", KVF_OP_SHM_RELEASE,
        "RESERVE", KVF_OP_SHM_RESERVE, "COMMIT", KVF_OP_SHM_COMMIT);
}

PyDoc_STRVAR(xxh3_doc, "xxh3_64(buffer) -> int: the object checksum as the C data plane computes it");

static PyObject *py_xxh3(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS)) return NULL;
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = kvf_hash(b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(parse_sizes_doc, "parse_sizes(meta, n) -> list[int]: the C reading of a GET reply's sizes");

static PyObject *py_parse_sizes(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer b;
    unsigned int n;
    if (!PyArg_ParseTuple(args, "y*I", &b, &n)) return NULL;
    if (n > KVF_MAX_KEYS_PER_BATCH) { PyBuffer_Release(&b); return PyErr_Format(PyExc_ValueError, "too many sizes"); }
    int64_t sizes[KVF_MAX_KEYS_PER_BATCH];
    int rc = kvf_parse_sizes(b.buf, (size_t)b.len, sizes, n);
    PyBuffer_Release(&b);
    if (rc) return raise_errno(rc, KVF_E_MALFORMED, "parsing sizes");
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (unsigned int i = 0; i < n; i++) PyList_SET_ITEM(out, i, PyLong_FromLongLong(sizes[i]));
    return out;
}

/* ------------------------------------------------------------------ server */

#include "kvf_server.h"
#include "kvf_store.h"
#include "kvf_bench.h"

typedef struct {
    PyObject_HEAD
    struct kvf_store *st;
    struct kvf_server *srv;
    char *auth;
    PyObject *hello, *extra; /* bytes kept alive for the C config */
    int running;
} ServerObject;

static void Server_dealloc(ServerObject *self)
{
    if (self->srv && !self->running) kvf_server_free(self->srv);
    if (self->st && !self->running) kvf_store_free(self->st);
    PyMem_Free(self->auth);
    Py_XDECREF(self->hello);
    Py_XDECREF(self->extra);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(Server_doc,
"Server(tcp_fd, unix_fd, capacity, *, hello_meta, stats_extra=b'', stats_extra_pairs=0, auth=None,\n"
"       max_conns=1024, max_keys=4096, max_key_bytes=64, max_meta=1<<20, max_payload=1<<30,\n"
"       max_object=64<<20, max_in_flight=64, zerocopy=-1, event_ring=65536)\n"
"The io_uring data plane over a memfd arena of `capacity` bytes. The caller owns the\n"
"listening fds (-1 = none). run() blocks (GIL released) until stop(). The control\n"
"methods (wait, drain, evict, is_pinned, space_done) are for one Python control thread.\n"
"Raises ValueError for bad sizes, NativeError when io_uring or the memory is unavailable.");

static int Server_init(ServerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"tcp_fd", "unix_fd", "capacity", "hello_meta", "stats_extra", "stats_extra_pairs",
                             "auth", "max_conns", "max_keys", "max_key_bytes", "max_meta", "max_payload",
                             "max_object", "max_in_flight", "zerocopy", "event_ring", "stall_ms", "max_lease_ms", NULL};
    struct kvf_server_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    unsigned long long capacity;
    PyObject *hello = NULL, *extra = NULL;
    const char *auth = NULL;
    cfg.max_conns = 1024;
    cfg.max_keys = KVF_MAX_KEYS_PER_BATCH;
    cfg.max_key_bytes = KVF_MAX_KEY_BYTES;
    cfg.max_meta = KVF_MAX_META_BYTES;
    unsigned long long max_payload = KVF_MAX_PAYLOAD_BYTES, max_object = KVF_MAX_OBJECT_BYTES;
    cfg.max_in_flight = KVF_MAX_IN_FLIGHT;
    cfg.zerocopy = -1;
    unsigned int event_ring = 65536, extra_pairs = 0;
    if (self->srv) { PyErr_SetString(PyExc_RuntimeError, "Server already initialised"); return -1; }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiK|$SSIzIIIIKKIiIII", kwlist, &cfg.tcp_fd, &cfg.unix_fd, &capacity,
                                     &hello, &extra, &extra_pairs, &auth, &cfg.max_conns, &cfg.max_keys,
                                     &cfg.max_key_bytes, &cfg.max_meta, &max_payload, &max_object,
                                     &cfg.max_in_flight, &cfg.zerocopy, &event_ring, &cfg.stall_ms,
                                     &cfg.max_lease_ms))
        return -1;
    if (cfg.max_keys > KVF_MAX_KEYS_PER_BATCH || cfg.max_key_bytes > KVF_MAX_KEY_BYTES || !cfg.max_in_flight ||
        event_ring == 0 || event_ring > (1u << 22)) {
        PyErr_SetString(PyExc_ValueError, "limits out of range");
        return -1;
    }
    if (!hello) { PyErr_SetString(PyExc_TypeError, "hello_meta is required"); return -1; }
    cfg.max_payload = max_payload;
    cfg.max_object = max_object;
    int rc = kvf_store_new(&self->st, capacity, event_ring);
    if (rc) { raise_errno(rc, 0, "creating the arena"); return -1; }
    if (auth) {
        self->auth = PyMem_Malloc(strlen(auth) + 1);
        if (!self->auth) { PyErr_NoMemory(); return -1; }
        strcpy(self->auth, auth);
    }
    Py_INCREF(hello);
    self->hello = hello;
    if (!extra) extra = PyBytes_FromStringAndSize("", 0); else Py_INCREF(extra);
    if (!extra) return -1;
    self->extra = extra;
    cfg.store = self->st;
    cfg.auth = self->auth;
    cfg.hello_meta = (const uint8_t *)PyBytes_AS_STRING(hello);
    cfg.hello_len = (size_t)PyBytes_GET_SIZE(hello);
    cfg.stats_extra = (const uint8_t *)PyBytes_AS_STRING(extra);
    cfg.stats_extra_len = (size_t)PyBytes_GET_SIZE(extra);
    cfg.stats_extra_pairs = extra_pairs;
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
        PyObject *t = Py_BuildValue("(iy#Ky#)", ev[i].type, (const char *)ev[i].key, (Py_ssize_t)ev[i].klen,
                                    (unsigned long long)ev[i].size, ev[i].plen ? (const char *)ev[i].parent : NULL,
                                    (Py_ssize_t)ev[i].plen);
        if (!t) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, t);
    }
    PyMem_Free(ev);
    return out;
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
    int64_t rc = kvf_store_evict(self->st, b.buf, (uint32_t)b.len);
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

static PyObject *Server_stats(ServerObject *self, PyObject *noargs)
{
    (void)noargs;
    NEED_SRV(self);
    struct kvf_store_stats ss;
    struct kvf_server_counters c;
    kvf_store_stats(self->st, &ss);
    kvf_server_counters(self->srv, &c);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:O,s:O,s:K,s:K,s:K}",
        "objects", ss.objects, "bytes_used", ss.bytes_used, "capacity", ss.capacity, "free_bytes", ss.free_bytes,
        "evictions", ss.evictions, "checksum_failures", ss.checksum_failures, "events_dropped", ss.events_dropped,
        "pinned", ss.pinned, "hits", c.hits, "misses", c.misses, "puts", c.puts, "bytes_in", c.bytes_in,
        "bytes_out", c.bytes_out, "connections", c.connections, "connections_total", c.connections_total,
        "zc_sends", c.zc_sends, "zerocopy", c.zerocopy ? Py_True : Py_False,
        "fixed_buffers", c.fixed_buffers ? Py_True : Py_False, "tcp", c.by_transport[0],
        "native", c.by_transport[1], "shm", c.by_transport[2]);
}

static PyObject *Server_check(ServerObject *self, PyObject *noargs)
{
    (void)noargs;
    NEED_SRV(self);
    return PyBool_FromLong(kvf_store_check(self->st) == 0);
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
    {"drain", (PyCFunction)Server_drain, METH_O, "drain(max) -> [(type, key, size, parent|None)] (1 insert, 2 access, 3 remove)"},
    {"evict", (PyCFunction)Server_evict, METH_O, evict_doc},
    {"is_pinned", (PyCFunction)Server_is_pinned, METH_O, "is_pinned(key) -> bool"},
    {"space_done", (PyCFunction)Server_space_done, METH_O, "space_done(exhausted) -> round; wakes parked PUTs"},
    {"keys", (PyCFunction)Server_keys, METH_NOARGS, "[(key, size)] of every indexed object (policy resync)"},
    {"stats", (PyCFunction)Server_stats, METH_NOARGS, "store and data-plane counters"},
    {"check", (PyCFunction)Server_check, METH_NOARGS, "allocator self-check -> bool"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Server_getset[] = {
    {"memfd", (getter)Server_memfd, NULL, "the arena's memfd", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ServerType = {
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

/* ------------------------------------------------------------------ shm copies */

PyDoc_STRVAR(copy_out_doc,
"copy_out(arena, offsets, sizes, bufs, verify) -> list[int | None]\n"
"Copy object i (sizes[i] >= 0) from arena[offsets[i]:] into bufs[i], GIL released; with verify\n"
"the xxh3_64 of each copied object is returned (None for a miss). ValueError when an object\n"
"does not fit its buffer or lies outside the arena (nothing is copied then).");

static PyObject *py_copy_out(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer arena;
    PyObject *offs_o, *sizes_o, *bufs_o;
    int verify;
    if (!PyArg_ParseTuple(args, "y*OOOp", &arena, &offs_o, &sizes_o, &bufs_o, &verify)) return NULL;
    struct bufset bs;
    if (bufset_get(&bs, bufs_o, 1, "bufs")) { PyBuffer_Release(&arena); return NULL; }
    Py_ssize_t n = bs.n;
    int64_t *offs = PyMem_Malloc(sizeof(int64_t) * (size_t)(n + 1));
    int64_t *sizes = PyMem_Malloc(sizeof(int64_t) * (size_t)(n + 1));
    uint64_t *sums = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n + 1));
    PyObject *out = NULL;
    if (!offs || !sizes || !sums) { PyErr_NoMemory(); goto done; }
    if (PySequence_Size(offs_o) != n || PySequence_Size(sizes_o) != n) {
        PyErr_SetString(PyExc_ValueError, "offsets, sizes and bufs must have the same length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_GetItem(offs_o, i), *s = PySequence_GetItem(sizes_o, i);
        offs[i] = o ? PyLong_AsLongLong(o) : -1;
        sizes[i] = s ? PyLong_AsLongLong(s) : -1;
        Py_XDECREF(o);
        Py_XDECREF(s);
        if (PyErr_Occurred()) goto done;
        if (sizes[i] < 0) continue;
        if (offs[i] < 0 || offs[i] + sizes[i] > arena.len || sizes[i] > bs.views[i].len) {
            PyErr_Format(PyExc_ValueError, "object %zd (%lld bytes at %lld) does not fit its buffer or the arena", i,
                         (long long)sizes[i], (long long)offs[i]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sizes[i] < 0) continue;
        memcpy(bs.views[i].buf, (char *)arena.buf + offs[i], (size_t)sizes[i]);
        if (verify) sums[i] = kvf_hash(bs.views[i].buf, (size_t)sizes[i]);
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v;
        if (sizes[i] >= 0 && verify) v = PyLong_FromUnsignedLongLong(sums[i]);
        else { v = Py_None; Py_INCREF(v); }
        PyList_SET_ITEM(out, i, v);
    }
done:
    PyMem_Free(offs); PyMem_Free(sizes); PyMem_Free(sums);
    bufset_release(&bs);
    PyBuffer_Release(&arena);
    return out;
}

PyDoc_STRVAR(copy_in_doc,
"copy_in(arena, offsets, parts)\n"
"Copy parts[i] into arena[offsets[i]:] for every offsets[i] >= 0, GIL released.\n"
"ValueError when a part lies outside the arena (nothing is copied then).");

static PyObject *py_copy_in(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer arena;
    PyObject *offs_o, *parts_o;
    if (!PyArg_ParseTuple(args, "w*OO", &arena, &offs_o, &parts_o)) return NULL;
    struct bufset bs;
    if (bufset_get(&bs, parts_o, 0, "parts")) { PyBuffer_Release(&arena); return NULL; }
    Py_ssize_t n = bs.n;
    int64_t *offs = PyMem_Malloc(sizeof(int64_t) * (size_t)(n + 1));
    PyObject *out = NULL;
    if (!offs) { PyErr_NoMemory(); goto done; }
    if (PySequence_Size(offs_o) != n) { PyErr_SetString(PyExc_ValueError, "offsets and parts differ in length"); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_GetItem(offs_o, i);
        offs[i] = o ? PyLong_AsLongLong(o) : -1;
        Py_XDECREF(o);
        if (PyErr_Occurred()) goto done;
        if (offs[i] >= 0 && offs[i] + bs.views[i].len > arena.len) {
            PyErr_Format(PyExc_ValueError, "part %zd does not fit the arena at %lld", i, (long long)offs[i]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        if (offs[i] >= 0) memcpy((char *)arena.buf + offs[i], bs.views[i].buf, (size_t)bs.views[i].len);
    Py_END_ALLOW_THREADS
    out = Py_None;
    Py_INCREF(out);
done:
    PyMem_Free(offs);
    bufset_release(&bs);
    PyBuffer_Release(&arena);
    return out;
}

/* ------------------------------------------------------------------ shm ops */

static PyObject *shm_result(int rc, struct kvf_header *h, uint8_t *meta, int wire_err, uint32_t bad, const char *what)
{
    if (rc == -EMSGSIZE) {
        free(meta);
        return PyErr_Format(PyExc_ValueError, "GET buffer %u is too small for its object", bad);
    }
    if (rc) {
        free(meta);
        return raise_errno(rc, wire_err, what);
    }
    PyObject *m = PyBytes_FromStringAndSize((const char *)meta, h->meta_len);
    free(meta);
    if (!m) return NULL;
    return Py_BuildValue("(iiKN)", h->opcode, h->flags, (unsigned long long)h->request_id, m);
}

PyDoc_STRVAR(shm_get_doc,
"shm_get(fd, arena, request_id, lease_meta, bufs, max_meta, deadline=0) -> (opcode, flags, rid, meta)\n"
"SHM_LEASE + one copy per found object into bufs + SHM_RELEASE (uses request ids rid and rid+1),\n"
"GIL released. meta is the LEASE reply's metadata (an error reply comes back as is, nothing copied).\n"
"ValueError when an object does not fit its buffer (nothing copied, lease released).");

static PyObject *py_shm_get(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    Py_buffer arena, lm;
    unsigned long long rid;
    PyObject *bufs_o;
    unsigned int max_meta;
    double deadline = 0;
    if (!PyArg_ParseTuple(args, "iw*Ky*OI|d", &fd, &arena, &rid, &lm, &bufs_o, &max_meta, &deadline)) return NULL;
    struct bufset bs;
    if (bufset_get(&bs, bufs_o, 1, "bufs")) { PyBuffer_Release(&arena); PyBuffer_Release(&lm); return NULL; }
    uint32_t n = (uint32_t)bs.n;
    void **ptrs = PyMem_Malloc(sizeof(void *) * (n + 1));
    size_t *lens = PyMem_Malloc(sizeof(size_t) * (n + 1));
    PyObject *out = NULL;
    if (!ptrs || !lens) { PyErr_NoMemory(); goto done; }
    for (uint32_t i = 0; i < n; i++) { ptrs[i] = bs.views[i].buf; lens[i] = (size_t)bs.views[i].len; }
    struct kvf_header h;
    uint8_t *meta = NULL;
    uint32_t bad = 0;
    int wire_err = 0, rc;
    kvf_set_deadline(deadline > 0 ? (int64_t)(deadline * 1e9) : 0);
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_shm_get(fd, arena.buf, (uint64_t)arena.len, rid, lm.buf, (uint32_t)lm.len, n, ptrs, lens, max_meta, &h,
                     &meta, &bad, &wire_err);
    Py_END_ALLOW_THREADS
    out = shm_result(rc, &h, meta, wire_err, bad, "shm GET");
done:
    PyMem_Free(ptrs);
    PyMem_Free(lens);
    bufset_release(&bs);
    PyBuffer_Release(&arena);
    PyBuffer_Release(&lm);
    return out;
}

PyDoc_STRVAR(shm_put_doc,
"shm_put(fd, arena, request_id, reserve_meta, sizes, checksums, parts, max_meta, deadline=0) -> (opcode, flags, rid, meta)\n"
"SHM_RESERVE + one copy of the parts (any split) into the reserved slots + SHM_COMMIT (request ids\n"
"rid and rid+1), GIL released. meta is the COMMIT reply's (or the RESERVE error reply's) metadata.");

static PyObject *py_shm_put(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    Py_buffer arena, rm;
    unsigned long long rid;
    PyObject *sizes_o, *sums_o, *parts_o;
    unsigned int max_meta;
    double deadline = 0;
    if (!PyArg_ParseTuple(args, "iw*Ky*OOOI|d", &fd, &arena, &rid, &rm, &sizes_o, &sums_o, &parts_o, &max_meta,
                          &deadline))
        return NULL;
    struct bufset bs;
    if (bufset_get(&bs, parts_o, 0, "parts")) { PyBuffer_Release(&arena); PyBuffer_Release(&rm); return NULL; }
    Py_ssize_t n = PySequence_Size(sizes_o);
    uint64_t *sizes = NULL, *sums = NULL;
    struct iovec *iov = NULL;
    PyObject *out = NULL;
    if (n < 0 || PySequence_Size(sums_o) != n || n > KVF_MAX_KEYS_PER_BATCH) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "sizes and checksums differ in length");
        goto done;
    }
    sizes = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n + 1));
    sums = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n + 1));
    iov = PyMem_Malloc(sizeof(struct iovec) * (size_t)(bs.n + 1));
    if (!sizes || !sums || !iov) { PyErr_NoMemory(); goto done; }
    uint64_t total = 0, have = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PySequence_GetItem(sizes_o, i), *b = PySequence_GetItem(sums_o, i);
        sizes[i] = a ? PyLong_AsUnsignedLongLong(a) : 0;
        sums[i] = b ? PyLong_AsUnsignedLongLong(b) : 0;
        Py_XDECREF(a);
        Py_XDECREF(b);
        if (PyErr_Occurred()) goto done;
        total += sizes[i];
    }
    for (Py_ssize_t i = 0; i < bs.n; i++) {
        iov[i].iov_base = bs.views[i].buf;
        iov[i].iov_len = (size_t)bs.views[i].len;
        have += (uint64_t)bs.views[i].len;
    }
    if (have != total) { PyErr_SetString(PyExc_ValueError, "payload parts do not add up to the sizes"); goto done; }
    struct kvf_header h;
    uint8_t *meta = NULL;
    int wire_err = 0, rc;
    kvf_set_deadline(deadline > 0 ? (int64_t)(deadline * 1e9) : 0);
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_shm_put(fd, arena.buf, (uint64_t)arena.len, rid, rm.buf, (uint32_t)rm.len, (uint32_t)n, sizes, sums, iov,
                     (int)bs.n, max_meta, &h, &meta, &wire_err);
    Py_END_ALLOW_THREADS
    out = shm_result(rc, &h, meta, wire_err, 0, "shm PUT");
done:
    PyMem_Free(sizes);
    PyMem_Free(sums);
    PyMem_Free(iov);
    bufset_release(&bs);
    PyBuffer_Release(&arena);
    PyBuffer_Release(&rm);
    return out;
}

/* ------------------------------------------------------------------ ceilings */

PyDoc_STRVAR(memcpy_ceiling_doc,
"memcpy_ceiling(nbytes, iters) -> seconds: one thread copying nbytes between two buffers iters times\n"
"(GIL released): the ceiling the shm transport's one copy is measured against.");

static PyObject *py_memcpy_ceiling(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long nbytes;
    unsigned int iters;
    if (!PyArg_ParseTuple(args, "KI", &nbytes, &iters)) return NULL;
    double secs;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_bench_memcpy(nbytes, iters, &secs);
    Py_END_ALLOW_THREADS
    if (rc) return raise_errno(rc, 0, "memcpy ceiling");
    return PyFloat_FromDouble(secs);
}

PyDoc_STRVAR(socket_ceiling_doc,
"socket_ceiling(nbytes, iters, put) -> seconds: a C client and a C server thread on loopback TCP\n"
"doing iters request/reply exchanges of nbytes objects with plain send/recv (GET: 32-byte request,\n"
"nbytes reply; PUT: nbytes request, 32-byte reply), GIL released: the raw-socket ceiling.");

static PyObject *py_socket_ceiling(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long nbytes;
    unsigned int iters;
    int put;
    if (!PyArg_ParseTuple(args, "KIp", &nbytes, &iters, &put)) return NULL;
    double secs;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_bench_socket(nbytes, iters, put, &secs);
    Py_END_ALLOW_THREADS
    if (rc) return raise_errno(rc, 0, "socket ceiling");
    return PyFloat_FromDouble(secs);
}

static PyMethodDef methods[] = {
    {"request", (PyCFunction)(void (*)(void))py_request, METH_VARARGS | METH_KEYWORDS, request_doc},
    {"send_frame", py_send_frame, METH_VARARGS, send_frame_doc},
    {"recv_frame", py_recv_frame, METH_VARARGS, recv_frame_doc},
    {"pack_header", py_pack_header, METH_VARARGS, pack_header_doc},
    {"check_header", py_check_header, METH_VARARGS, check_header_doc},
    {"layout", py_layout, METH_NOARGS, "the C header layout: {field: (offset, size)} and constants"},
    {"constants", py_constants, METH_NOARGS, "opcodes, error codes, put statuses and limits as C sees them"},
    {"xxh3_64", py_xxh3, METH_O, xxh3_doc},
    {"parse_sizes", py_parse_sizes, METH_VARARGS, parse_sizes_doc},
    {"copy_out", py_copy_out, METH_VARARGS, copy_out_doc},
    {"copy_in", py_copy_in, METH_VARARGS, copy_in_doc},
    {"shm_get", py_shm_get, METH_VARARGS, shm_get_doc},
    {"shm_put", py_shm_put, METH_VARARGS, shm_put_doc},
    {"memcpy_ceiling", py_memcpy_ceiling, METH_VARARGS, memcpy_ceiling_doc},
    {"socket_ceiling", py_socket_ceiling, METH_VARARGS, socket_ceiling_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvfabric._native",
    "The C data plane of kvfabric (csrc/): moves bytes, decides nothing.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *errors = PyImport_ImportModule("kvfabric.errors");
    if (!errors) return NULL;
    ErrTransport = PyObject_GetAttrString(errors, "TransportError");
    ErrClosed = PyObject_GetAttrString(errors, "ConnectionClosed");
    ErrDeadline = PyObject_GetAttrString(errors, "DeadlineExceeded");
    ErrProtocol = PyObject_GetAttrString(errors, "ProtocolError");
    ErrNative = PyObject_GetAttrString(errors, "NativeError");
    ErrorCodeEnum = PyObject_GetAttrString(errors, "ErrorCode");
    Py_DECREF(errors);
    if (!ErrTransport || !ErrClosed || !ErrDeadline || !ErrProtocol || !ErrNative || !ErrorCodeEnum) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (PyType_Ready(&ServerType) < 0) { Py_DECREF(m); return NULL; }
    Py_INCREF(&ServerType);
    if (PyModule_AddObject(m, "Server", (PyObject *)&ServerType)) { Py_DECREF(&ServerType); Py_DECREF(m); return NULL; }
    if (PyType_Ready(&RingType) < 0) { Py_DECREF(m); return NULL; }
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "ConnRing", (PyObject *)&RingType)) { Py_DECREF(&RingType); Py_DECREF(m); return NULL; }
    return m;
}
