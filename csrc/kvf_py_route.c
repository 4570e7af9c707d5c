/* kvf_py_route.c: bindings of kvf_route.c, the batch rendezvous routing behind
 * kvfabric.sharding.owner_table / group_by_owner:
 *
 *   route_owners(keys, seeds, replicas) -> list[list[int]] | None
 *   route_groups(keys, seeds)           -> dict[int, list[int]] | None
 *   check_keys(keys, max_len)           -> bool
 *
 * `seeds` is the servers' seeds as native-endian uint64s (array("Q") bytes;
 * kvfabric.sharding computes and caches them per server list). Both return
 * None when a key is not a non-empty `bytes`: the caller then runs the
 * pure-Python reference, which raises the documented error (or accepts a
 * bytearray/memoryview key), so the error messages live in one place.
 * The hashing runs with the GIL released (above a small batch); the keys are
 * held through a tuple of strong references meanwhile, so another thread
 * mutating the caller's list cannot free them.
 */
#include "kvf_module_int.h"

#include <errno.h>
#include <string.h>

#include "kvf_route.h"

/* Below this many key x server hashes (~20 ns each) the GIL is kept: handing
 * it over and back costs more than the work, and may wait for another
 * thread's switch interval. */
#define ROUTE_NOGIL_MIN 2048

struct routed {
    PyObject *tuple;   /* strong references to the keys */
    uint32_t *owners;  /* n * replicas */
    Py_ssize_t n;
};

static void routed_free(struct routed *r)
{
    Py_CLEAR(r->tuple);
    PyMem_RawFree(r->owners);
    r->owners = NULL;
}

/* Route every key of `keys_obj`. Returns 1 (routed), 0 (a key is not a
 * non-empty bytes: nothing held, no exception) or -1 (exception set). */
static int route(PyObject *keys_obj, PyObject *seeds_obj, Py_ssize_t replicas, struct routed *r)
{
    r->tuple = NULL;
    r->owners = NULL;
    r->n = 0;
    Py_buffer sb;
    if (PyObject_GetBuffer(seeds_obj, &sb, PyBUF_C_CONTIGUOUS)) return -1;
    size_t nservers = (size_t)sb.len / sizeof(uint64_t);
    if (sb.len <= 0 || sb.len % (Py_ssize_t)sizeof(uint64_t) || nservers > UINT32_MAX) {
        PyBuffer_Release(&sb);
        PyErr_SetString(PyExc_ValueError, "seeds must be 1 or more native uint64s");
        return -1;
    }
    if (replicas < 1 || (size_t)replicas > nservers) {
        PyBuffer_Release(&sb);
        PyErr_Format(PyExc_ValueError, "replicas must be in 1..%zu, got %zd", nservers, replicas);
        return -1;
    }
    r->tuple = PySequence_Tuple(keys_obj);
    if (!r->tuple) { PyBuffer_Release(&sb); return -1; }
    Py_ssize_t n = PyTuple_GET_SIZE(r->tuple);
    r->n = n;
    if ((size_t)n > SIZE_MAX / sizeof(struct kvf_route_key) / (size_t)replicas) {  /* before allocating */
        PyBuffer_Release(&sb);
        routed_free(r);
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *seeds = PyMem_RawMalloc(nservers * sizeof *seeds);
    struct kvf_route_key *keys = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof *keys);
    r->owners = PyMem_RawMalloc((size_t)(n ? n : 1) * (size_t)replicas * sizeof *r->owners);
    if (seeds) memcpy(seeds, sb.buf, nservers * sizeof *seeds);
    PyBuffer_Release(&sb);
    int rc = 1;
    if (!seeds || !keys || !r->owners) {
        PyErr_NoMemory();
        rc = -1;
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyTuple_GET_ITEM(r->tuple, i);
        if (!PyBytes_CheckExact(k) || PyBytes_GET_SIZE(k) == 0) {
            rc = 0;
            goto out;
        }
        keys[i].data = PyBytes_AS_STRING(k);
        keys[i].len = (size_t)PyBytes_GET_SIZE(k);
    }
    int err;
    if ((size_t)n * nservers >= ROUTE_NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        err = kvf_route_owners(keys, (size_t)n, seeds, nservers, (size_t)replicas, r->owners);
        Py_END_ALLOW_THREADS
    } else {
        err = kvf_route_owners(keys, (size_t)n, seeds, nservers, (size_t)replicas, r->owners);
    }
    if (err) {
        raise_errno(err, 0, "routing keys");
        rc = -1;
    }
out:
    PyMem_RawFree(seeds);
    PyMem_RawFree(keys);
    if (rc != 1) routed_free(r);
    return rc;
}

PyDoc_STRVAR(route_owners_doc,
"route_owners(keys, seeds, replicas) -> list[list[int]] | None: for each key the indices of its `replicas`\n"
"highest-scoring servers, best first (kvfabric.sharding.owner_table); None when a key is not a non-empty\n"
"bytes. `seeds`: the servers' xxh3_64 seeds as native uint64s.");

static PyObject *py_route_owners(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *keys, *seeds;
    Py_ssize_t replicas;
    if (!PyArg_ParseTuple(args, "OOn", &keys, &seeds, &replicas)) return NULL;
    struct routed r;
    int rc = route(keys, seeds, replicas, &r);
    if (rc < 0) return NULL;
    if (rc == 0) Py_RETURN_NONE;
    PyObject *out = PyList_New(r.n);
    for (Py_ssize_t i = 0; out && i < r.n; i++) {
        PyObject *row = PyList_New(replicas);
        if (!row) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, row);
        for (Py_ssize_t j = 0; j < replicas; j++) {
            PyObject *v = PyLong_FromUnsignedLong(r.owners[(size_t)i * (size_t)replicas + (size_t)j]);
            if (!v) { Py_CLEAR(out); break; }
            PyList_SET_ITEM(row, j, v);
        }
    }
    routed_free(&r);
    return out;
}

PyDoc_STRVAR(route_groups_doc,
"route_groups(keys, seeds) -> dict[int, list[int]] | None: key indices grouped by primary owner, each\n"
"list ascending, servers in order of their first key (kvfabric.sharding.group_by_owner); None when a key\n"
"is not a non-empty bytes.");

static PyObject *py_route_groups(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *keys, *seeds;
    if (!PyArg_ParseTuple(args, "OO", &keys, &seeds)) return NULL;
    struct routed r;
    int rc = route(keys, seeds, 1, &r);
    if (rc < 0) return NULL;
    if (rc == 0) Py_RETURN_NONE;
    PyObject *out = PyDict_New();
    PyObject **lists = NULL;
    Py_ssize_t *fill = NULL;
    if (!out) goto done;
    /* server indices are < len(seeds) <= UINT32_MAX; count per owner seen */
    uint32_t top = 0;
    for (Py_ssize_t i = 0; i < r.n; i++)
        if (r.owners[i] > top) top = r.owners[i];
    size_t ns = r.n ? (size_t)top + 1 : 1;
    lists = PyMem_Calloc(ns, sizeof *lists);
    fill = PyMem_Calloc(ns, sizeof *fill);
    if (!lists || !fill) { PyErr_NoMemory(); Py_CLEAR(out); goto done; }
    for (Py_ssize_t i = 0; i < r.n; i++) fill[r.owners[i]]++;
    for (Py_ssize_t i = 0; i < r.n; i++) {  /* dict order: by each server's first key, as the reference */
        uint32_t s = r.owners[i];
        if (lists[s]) continue;
        lists[s] = PyList_New(fill[s]);
        PyObject *key = lists[s] ? PyLong_FromUnsignedLong(s) : NULL;
        int bad = !key || PyDict_SetItem(out, key, lists[s]);
        Py_XDECREF(key);
        if (bad) { Py_CLEAR(out); goto done; }
        fill[s] = 0;
    }
    for (Py_ssize_t i = 0; i < r.n; i++) {
        uint32_t s = r.owners[i];
        PyObject *v = PyLong_FromSsize_t(i);
        if (!v) { Py_CLEAR(out); goto done; }
        PyList_SET_ITEM(lists[s], fill[s]++, v);
    }
done:
    if (lists) {  /* the dict holds the lists now (or they go with it) */
        for (size_t s = 0; s < ns; s++) Py_XDECREF(lists[s]);
        PyMem_Free(lists);
    }
    PyMem_Free(fill);
    routed_free(&r);
    return out;
}

PyDoc_STRVAR(check_keys_doc,
"check_keys(keys, max_len) -> bool: True when `keys` is a list or tuple of `bytes` (exactly) of 1..max_len\n"
"bytes each; False otherwise (kvfabric.Client then names the first bad key). The client's key check in\n"
"one C pass (a 2,000-key prompt: ~170 us as a Python loop).");

static PyObject *py_check_keys(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *keys;
    Py_ssize_t max_len;
    if (!PyArg_ParseTuple(args, "On", &keys, &max_len)) return NULL;
    if (!PyList_CheckExact(keys) && !PyTuple_CheckExact(keys)) Py_RETURN_FALSE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);  /* no Python code runs below: the list cannot change */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(items[i])) Py_RETURN_FALSE;
        Py_ssize_t len = PyBytes_GET_SIZE(items[i]);
        if (len < 1 || len > max_len) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

PyMethodDef kvf_py_route_methods[] = {
    {"check_keys", py_check_keys, METH_VARARGS, check_keys_doc},
    {"route_owners", py_route_owners, METH_VARARGS, route_owners_doc},
    {"route_groups", py_route_groups, METH_VARARGS, route_groups_doc},
    {NULL, NULL, 0, NULL},
};
