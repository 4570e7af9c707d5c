/* kvf_module.c: module init of kvfabric._native and what its bindings share.
 *
 * The bindings parse arguments, release the GIL around every call into the C
 * data plane, and turn a negative errno into a kvfabric.errors exception in one
 * place (raise_errno, kvf_py_common.c). Nothing in them decides policy: routing, retries,
 * eviction, configuration and logging stay in Python.
 *
 * This file, the top of the bindings: module init and its method table, and
 * the wire test hooks (header layout, constants, checksum, sizes parser). The
 * rest, by owner:
 *   kvf_py_client.c  request/send_frame/recv_frame, ConnRing (native client)
 *   kvf_py_server.c  the Server type (io_uring server + C store)
 *   kvf_py_shm.c     copy_out/copy_in, shm_get/shm_put (same-host client)
 *   kvf_py_bench.c   memcpy_ceiling/socket_ceiling
 *   kvf_py_route.c   route_owners/route_groups (batch rendezvous routing)
 *   kvf_py_common.c  raise_errno and bufset_*, which all of them call
 */
#include "kvf_module_int.h"

#include <errno.h>
#include <string.h>

#include "kvf_client.h"
#include "kvf_mpack.h"
#include "kvf_protocol.h"

#include "kvf_hash.h"
#include "kvf_mac.h"
#include "kvf_server.h"
#include "kvf_store.h"

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

/* What Python mirrors beyond the enums (tests/native/test_layout.py compares
 * each with its Python twin): the wire version, the errors after which a
 * connection closes, the service-time histograms' shape, the arena's page. */
static int add_mirrors(PyObject *d)
{
    PyObject *fatal = PyList_New(0), *ops = PyTuple_New(KVF_LAT_OPS), *v;
    if (!fatal || !ops) goto fail;
    for (int code = 0; code < 256; code++) {
        if (!kvf_err_is_fatal(code)) continue;
        if (!(v = PyLong_FromLong(code)) || PyList_Append(fatal, v)) { Py_XDECREF(v); goto fail; }
        Py_DECREF(v);
    }
    for (int k = 0; k < KVF_LAT_OPS; k++) {
        if (!(v = PyUnicode_FromString(kvf_lat_names[k]))) goto fail;
        PyTuple_SET_ITEM(ops, k, v);
    }
    if (PyDict_SetItemString(d, "fatal_errors", fatal) || PyDict_SetItemString(d, "lat_ops", ops)) goto fail;
    Py_DECREF(fatal);
    Py_DECREF(ops);
    struct { const char *name; long long v; } ints[] = {
        {"version", KVF_VERSION}, {"lat_buckets", KVF_LAT_BUCKETS}, {"page_bytes", KVF_PAGE},
        {"nonce_bytes", KVF_NONCE_BYTES}, {"proof_bytes", KVF_PROOF_BYTES},
        {"ns_tag_bytes", KVF_NS_TAG_BYTES}, {"medium_dram", KVF_MEDIUM_DRAM}, {"medium_ssd", KVF_MEDIUM_SSD},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        if (!(v = PyLong_FromLongLong(ints[i].v)) || PyDict_SetItemString(d, ints[i].name, v)) { Py_XDECREF(v); return -1; }
        Py_DECREF(v);
    }
    const char *labels[][2] = {{"hello_server_label", KVF_HELLO_SERVER_LABEL}, {"hello_client_label", KVF_HELLO_CLIENT_LABEL}};
    for (size_t i = 0; i < sizeof labels / sizeof labels[0]; i++) {
        if (!(v = PyBytes_FromString(labels[i][1])) || PyDict_SetItemString(d, labels[i][0], v)) { Py_XDECREF(v); return -1; }
        Py_DECREF(v);
    }
    return 0;
fail:
    Py_XDECREF(fatal);
    Py_XDECREF(ops);
    return -1;
}

static PyObject *py_constants(PyObject *self, PyObject *noargs)
{
    (void)self; (void)noargs;
    PyObject *d = Py_BuildValue(
        "{s:{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i},"
        "s:{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i},"
        "s:{s:i,s:i,s:i,s:i,s:i},"
        "s:{s:I,s:I,s:I,s:K,s:K,s:I},"
        "s:{s:i,s:i,s:i,s:i,s:i},s:I}",
        "ops", "HELLO", KVF_OP_HELLO, "PING", KVF_OP_PING, "EXISTS", KVF_OP_EXISTS, "LOOKUP", KVF_OP_LOOKUP,
        "GET", KVF_OP_GET, "PUT", KVF_OP_PUT, "DELETE", KVF_OP_DELETE, "STATS", KVF_OP_STATS,
        "AUTH", KVF_OP_AUTH, "RETIRE", KVF_OP_RETIRE, "errors", "BAD_MAGIC", KVF_E_BAD_MAGIC, "BAD_VERSION", KVF_E_BAD_VERSION, "UNKNOWN_OPCODE",
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
        "RESERVE", KVF_OP_SHM_RESERVE, "COMMIT", KVF_OP_SHM_COMMIT, "max_lease_ms", KVF_MAX_LEASE_MS);
    if (d && add_mirrors(d)) Py_CLEAR(d);
    return d;
}

PyDoc_STRVAR(xxh3_doc, "xxh3_64(buffer) -> int: plain xxh3_64 as the C data plane computes it (the key's seed)");

static PyObject *py_xxh3(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS)) return NULL;
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = kvf_xxh3_64(b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(obj_checksum_doc,
"obj_checksum(key, value, chunk=0) -> int: the object checksum (protocol 2, bound to the key) as the C\n"
"data plane computes it: one-shot (kvf_obj_hash) when chunk is 0, else streamed chunk bytes at a time\n"
"(kvf_hash_reset_key + kvf_hash_update), as the server hashes a PUT being received.");

static PyObject *py_obj_checksum(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer k, v;
    Py_ssize_t chunk = 0;
    if (!PyArg_ParseTuple(args, "y*y*|n", &k, &v, &chunk)) return NULL;
    uint64_t h = 0;
    void *st = chunk > 0 ? kvf_hash_new() : NULL;
    if (chunk > 0 && !st) { PyBuffer_Release(&k); PyBuffer_Release(&v); return PyErr_NoMemory(); }
    Py_BEGIN_ALLOW_THREADS
    if (st) {
        kvf_hash_reset_key(st, k.buf, (size_t)k.len);
        for (Py_ssize_t off = 0; off < v.len; off += chunk)
            kvf_hash_update(st, (const char *)v.buf + off, (size_t)(v.len - off < chunk ? v.len - off : chunk));
        h = kvf_hash_digest(st);
        kvf_hash_free(st);
    } else {
        h = kvf_obj_hash(k.buf, (size_t)k.len, v.buf, (size_t)v.len);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&k);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(hmac_sha256_doc,
"hmac_sha256(key, *parts) -> bytes: HMAC-SHA256 of the concatenated parts as the C data plane computes\n"
"it (kvf_mac.c; hmac.new(key, b''.join(parts), 'sha256').digest()), at most 16 parts.");

static PyObject *py_hmac_sha256(PyObject *self, PyObject *args)
{
    (void)self;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n < 1 || n > 17) return PyErr_Format(PyExc_TypeError, "hmac_sha256(key, *parts): 0..16 parts");
    Py_buffer b[17];
    const void *parts[16];
    size_t lens[16];
    Py_ssize_t got = 0;
    for (; got < n; got++)
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(args, got), &b[got], PyBUF_C_CONTIGUOUS)) break;
    uint8_t out[KVF_SHA256_BYTES];
    if (got == n) {
        for (Py_ssize_t i = 1; i < n; i++) { parts[i - 1] = b[i].buf; lens[i - 1] = (size_t)b[i].len; }
        kvf_hmac_sha256(b[0].buf, (size_t)b[0].len, (size_t)(n - 1), parts, lens, out);
    }
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&b[i]);
    return got == n ? PyBytes_FromStringAndSize((const char *)out, sizeof out) : NULL;
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

/* ------------------------------------------------------------------ module */

static PyMethodDef methods[] = {
    {"pack_header", py_pack_header, METH_VARARGS, pack_header_doc},
    {"check_header", py_check_header, METH_VARARGS, check_header_doc},
    {"layout", py_layout, METH_NOARGS, "the C header layout: {field: (offset, size)} and constants"},
    {"constants", py_constants, METH_NOARGS, "opcodes, error codes, put statuses, limits and the other constants Python mirrors, as C sees them"},
    {"xxh3_64", py_xxh3, METH_O, xxh3_doc},
    {"obj_checksum", py_obj_checksum, METH_VARARGS, obj_checksum_doc},
    {"parse_sizes", py_parse_sizes, METH_VARARGS, parse_sizes_doc},
    {"hmac_sha256", py_hmac_sha256, METH_VARARGS, hmac_sha256_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvfabric._native",
    "The C data plane of kvfabric (csrc/): moves bytes, decides nothing.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    if (kvf_py_errors_init()) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (PyModule_AddFunctions(m, kvf_py_client_methods) || PyModule_AddFunctions(m, kvf_py_shm_methods) ||
        PyModule_AddFunctions(m, kvf_py_bench_methods) || PyModule_AddFunctions(m, kvf_py_route_methods)) { Py_DECREF(m); return NULL; }
    if (PyType_Ready(&kvf_py_ServerType) < 0) { Py_DECREF(m); return NULL; }
    Py_INCREF(&kvf_py_ServerType);
    if (PyModule_AddObject(m, "Server", (PyObject *)&kvf_py_ServerType)) { Py_DECREF(&kvf_py_ServerType); Py_DECREF(m); return NULL; }
    if (PyType_Ready(&kvf_py_RingType) < 0) { Py_DECREF(m); return NULL; }
    Py_INCREF(&kvf_py_RingType);
    if (PyModule_AddObject(m, "ConnRing", (PyObject *)&kvf_py_RingType)) { Py_DECREF(&kvf_py_RingType); Py_DECREF(m); return NULL; }
    return m;
}
