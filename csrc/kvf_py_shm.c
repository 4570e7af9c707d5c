/* kvf_py_shm.c: bindings of the same-host (shm) client: copy_out()/copy_in() between
 * the mapped arena and caller buffers, shm_get()/shm_put() (one call into C per
 * operation, GIL released; kvf_client.c does the frames). */
#include "kvf_module_int.h"

#include "kvf_client.h"
#include "kvf_copy.h"
#include "kvf_hash.h"
#include "kvf_mpack.h"
#include "kvf_protocol.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ shm copies */

PyDoc_STRVAR(copy_out_doc,
"copy_out(arena, offsets, sizes, bufs, keys) -> list[int | None]\n"
"Copy object i (sizes[i] >= 0) from arena[offsets[i]:] into bufs[i], GIL released; when keys is a\n"
"list of the objects' keys (not None/False) the checksum of each copied object under keys[i]\n"
"(protocol 2, kvfabric.protocol.checksum) is returned (None for a miss). ValueError when an object\n"
"does not fit its buffer or lies outside the arena, or keys is not as long as bufs (nothing is copied then).");

static PyObject *py_copy_out(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer arena;
    PyObject *offs_o, *sizes_o, *bufs_o, *keys_o;
    if (!PyArg_ParseTuple(args, "y*OOOO", &arena, &offs_o, &sizes_o, &bufs_o, &keys_o)) return NULL;
    int verify = PyObject_IsTrue(keys_o);
    if (verify < 0) { PyBuffer_Release(&arena); return NULL; }
    struct bufset bs, ks = {NULL, 0};
    if (bufset_get(&bs, bufs_o, 1, "bufs")) { PyBuffer_Release(&arena); return NULL; }
    if (verify && bufset_get(&ks, keys_o, 0, "keys")) { bufset_release(&bs); PyBuffer_Release(&arena); return NULL; }
    Py_ssize_t n = bs.n;
    int64_t *offs = PyMem_Malloc(sizeof(int64_t) * (size_t)(n + 1));
    int64_t *sizes = PyMem_Malloc(sizeof(int64_t) * (size_t)(n + 1));
    uint64_t *sums = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n + 1));
    PyObject *out = NULL;
    if (!offs || !sizes || !sums) { PyErr_NoMemory(); goto done; }
    if (PySequence_Size(offs_o) != n || PySequence_Size(sizes_o) != n || (verify && ks.n != n)) {
        PyErr_SetString(PyExc_ValueError, "offsets, sizes, bufs (and keys) must have the same length");
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
        kvf_copy(bs.views[i].buf, (char *)arena.buf + offs[i], (size_t)sizes[i]);
        if (verify) sums[i] = kvf_obj_hash(ks.views[i].buf, (size_t)ks.views[i].len, bs.views[i].buf, (size_t)sizes[i]);
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
    if (verify) bufset_release(&ks);
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
        if (offs[i] >= 0) kvf_copy((char *)arena.buf + offs[i], bs.views[i].buf, (size_t)bs.views[i].len);
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
"shm_get(fd, arena, request_id, keys, bufs, max_meta, max_object, deadline=0, digests=None)\n"
"    -> (opcode, flags, rid, meta, sizes, checksums)\n"
"SHM_LEASE of keys + one copy per found object into bufs + SHM_RELEASE (uses request ids rid and rid+1),\n"
"GIL released. meta is the LEASE reply's metadata; for a reply that is not an error sizes (-1: a miss)\n"
"and checksums are its fields, parsed and checked in C (ShmLeaseReply's checks); an error reply comes\n"
"back as is with sizes and checksums None, nothing copied.\n"
"digests: a writable 8-byte aligned buffer of one uint64 per key: each copied object's checksum under\n"
"its key (kvfabric.protocol.checksum) goes to its slot, computed slice by slice as it is copied (a miss's\n"
"slot is left alone).\n"
"ValueError when an object does not fit its buffer (nothing copied, lease released).");

static PyObject *int_list(const int64_t *v, uint32_t n)
{
    PyObject *l = PyList_New(n);
    for (uint32_t i = 0; l && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (!x) { Py_CLEAR(l); break; }
        PyList_SET_ITEM(l, i, x);
    }
    return l;
}

static PyObject *uint_list(const uint64_t *v, uint32_t n)
{
    PyObject *l = PyList_New(n);
    for (uint32_t i = 0; l && i < n; i++) {
        PyObject *x = PyLong_FromUnsignedLongLong(v[i]);
        if (!x) { Py_CLEAR(l); break; }
        PyList_SET_ITEM(l, i, x);
    }
    return l;
}

static PyObject *py_shm_get(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    Py_buffer arena;
    unsigned long long rid, max_object;
    PyObject *keys_o, *bufs_o;
    unsigned int max_meta;
    double deadline = 0;
    PyObject *digests_o = Py_None;
    if (!PyArg_ParseTuple(args, "iw*KOOIK|dO", &fd, &arena, &rid, &keys_o, &bufs_o, &max_meta, &max_object,
                          &deadline, &digests_o))
        return NULL;
    struct bufset bs, ks = {NULL, 0};
    Py_buffer dg = {0};
    const void **kptrs = NULL;
    size_t *klens = NULL;
    int64_t *sizes = NULL;
    uint64_t *sums = NULL;
    if (bufset_get(&bs, bufs_o, 1, "bufs")) { PyBuffer_Release(&arena); return NULL; }
    uint32_t n = (uint32_t)bs.n;
    void **ptrs = PyMem_Malloc(sizeof(void *) * (n + 1));
    size_t *lens = PyMem_Malloc(sizeof(size_t) * (n + 1));
    PyObject *out = NULL;
    if (!ptrs || !lens) { PyErr_NoMemory(); goto done; }
    for (uint32_t i = 0; i < n; i++) { ptrs[i] = bs.views[i].buf; lens[i] = (size_t)bs.views[i].len; }
    if (bufset_get(&ks, keys_o, 0, "keys")) goto done;
    if ((uint64_t)ks.n != n) {
        PyErr_SetString(PyExc_ValueError, "keys: one per buf");
        goto done;
    }
    if (digests_o != Py_None) {
        if (PyObject_GetBuffer(digests_o, &dg, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)) { dg.obj = NULL; goto done; }
        if (dg.len < (Py_ssize_t)(sizeof(uint64_t) * n) || ((uintptr_t)dg.buf % sizeof(uint64_t))) {
            PyErr_SetString(PyExc_ValueError, "digests: 8-byte aligned, 8 bytes per key");
            goto done;
        }
    }
    kptrs = PyMem_Malloc(sizeof(void *) * (n + 1));
    klens = PyMem_Malloc(sizeof(size_t) * (n + 1));
    sizes = PyMem_Malloc(sizeof(int64_t) * (n + 1));
    sums = PyMem_Malloc(sizeof(uint64_t) * (n + 1));
    if (!kptrs || !klens || !sizes || !sums) { PyErr_NoMemory(); goto done; }
    for (uint32_t i = 0; i < n; i++) { kptrs[i] = ks.views[i].buf; klens[i] = (size_t)ks.views[i].len; }
    struct kvf_header h;
    uint8_t *meta = NULL;
    uint32_t bad = 0;
    int wire_err = 0, rc;
    kvf_set_deadline(deadline > 0 ? (int64_t)(deadline * 1e9) : 0);
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_shm_get(fd, arena.buf, (uint64_t)arena.len, rid, n, kptrs, klens, ptrs, lens, max_meta,
                     (uint64_t)max_object, &h, &meta, &bad, &wire_err, sizes, sums, dg.obj ? (uint64_t *)dg.buf : NULL);
    Py_END_ALLOW_THREADS
    if (rc) {
        out = shm_result(rc, &h, meta, wire_err, bad, "shm GET"); /* raises */
        goto done;
    }
    PyObject *m = PyBytes_FromStringAndSize((const char *)meta, h.meta_len), *sl, *cl;
    free(meta);
    if (h.flags & KVF_FLAG_ERROR) {
        sl = Py_None;
        cl = Py_None;
        Py_INCREF(sl);
        Py_INCREF(cl);
    } else {
        sl = int_list(sizes, n);
        cl = uint_list(sums, n);
    }
    if (m && sl && cl)
        out = Py_BuildValue("(iiKOOO)", h.opcode, h.flags, (unsigned long long)h.request_id, m, sl, cl);
    Py_XDECREF(m);
    Py_XDECREF(sl);
    Py_XDECREF(cl);
done:
    PyMem_Free(ptrs);
    PyMem_Free(lens);
    PyMem_Free(kptrs);
    PyMem_Free(klens);
    PyMem_Free(sizes);
    PyMem_Free(sums);
    if (dg.obj) PyBuffer_Release(&dg);
    if (ks.views) bufset_release(&ks);
    bufset_release(&bs);
    PyBuffer_Release(&arena);
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

/* ------------------------------------------------------------------ method table */

PyMethodDef kvf_py_shm_methods[] = {
    {"copy_out", py_copy_out, METH_VARARGS, copy_out_doc},
    {"copy_in", py_copy_in, METH_VARARGS, copy_in_doc},
    {"shm_get", py_shm_get, METH_VARARGS, shm_get_doc},
    {"shm_put", py_shm_put, METH_VARARGS, shm_put_doc},
    {NULL, NULL, 0, NULL},
};
