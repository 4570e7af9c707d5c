/* kvf_py_bench.c: bindings of the benchmark ceilings (kvf_bench.c): memcpy_ceiling(),
 * socket_ceiling(), direct_read_file() + direct_read_ceiling(), measured with the GIL released. */
#include "kvf_module_int.h"

#include "kvf_bench.h"


/* ------------------------------------------------------------------ ceilings */

PyDoc_STRVAR(memcpy_ceiling_doc,
"memcpy_ceiling(nbytes, iters, span=0) -> seconds: one thread copying nbytes iters times (GIL released)\n"
"into a second warm buffer (span 0) or into consecutive slots of a pre-faulted span-byte region (cold\n"
"destination, as a fresh arena slot): the ceilings of the shm transport's one copy.");

static PyObject *py_memcpy_ceiling(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long nbytes, span = 0;
    unsigned int iters;
    if (!PyArg_ParseTuple(args, "KI|K", &nbytes, &iters, &span)) return NULL;
    double secs;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_bench_memcpy(nbytes, span, iters, &secs);
    Py_END_ALLOW_THREADS
    if (rc) return raise_errno(rc, 0, "memcpy ceiling");
    return PyFloat_FromDouble(secs);
}

PyDoc_STRVAR(socket_ceiling_doc,
"socket_ceiling(nbytes, iters, put, unix=False) -> seconds: a C client and a C server process on\n"
"loopback TCP (or a unix socket pair) doing iters request/reply exchanges of nbytes objects with plain\n"
"send/recv (GET: 32-byte request, 32 + nbytes reply; PUT: 32 + nbytes request, 32-byte reply), GIL\n"
"released: the raw-socket ceiling; a small nbytes gives the round-trip time.");

static PyObject *py_socket_ceiling(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long nbytes;
    unsigned int iters;
    int put, unix_sock = 0;
    if (!PyArg_ParseTuple(args, "KIp|p", &nbytes, &iters, &put, &unix_sock)) return NULL;
    double secs;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_bench_socket(nbytes, iters, put, unix_sock, &secs);
    Py_END_ALLOW_THREADS
    if (rc) return raise_errno(rc, 0, "socket ceiling");
    return PyFloat_FromDouble(secs);
}

PyDoc_STRVAR(direct_read_file_doc,
"direct_read_file(dir, file_bytes, chunk) -> fd: creates the O_DIRECT read ceiling's file in dir (unlinked at\n"
"once; close the fd with os.close), filled with file_bytes of chunk-sized stamped chunks and fsynced (GIL\n"
"released). ValueError (EINVAL) for bad sizes or a filesystem without O_DIRECT; NativeError(errno) else.");

static PyObject *py_direct_read_file(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *dir_obj;
    unsigned long long file_bytes, chunk;
    if (!PyArg_ParseTuple(args, "O&KK", PyUnicode_FSConverter, &dir_obj, &file_bytes, &chunk)) return NULL;
    const char *dir = PyBytes_AS_STRING(dir_obj);
    int fd;
    Py_BEGIN_ALLOW_THREADS
    fd = kvf_bench_direct_file(dir, file_bytes, chunk);
    Py_END_ALLOW_THREADS
    Py_DECREF(dir_obj);
    if (fd < 0) return raise_errno(fd, 0, "O_DIRECT ceiling file");
    return PyLong_FromLong(fd);
}

PyDoc_STRVAR(direct_read_ceiling_doc,
"direct_read_ceiling(fd, file_bytes, read_bytes, depth, reads) -> (seconds, [latency_ns, ...]): the raw\n"
"io_uring O_DIRECT read loop on a direct_read_file() file (read_bytes = its chunk), GIL released: `reads`\n"
"READ_FIXED reads at pseudo-random chunk offsets, `depth` in flight, into registered 4096-aligned buffers,\n"
"each checked against its chunk's stamp. seconds covers the loop; the list holds each read's\n"
"submit-to-completion time. ValueError (EINVAL) for bad sizes; NativeError(errno) for other failures.");

#define DIRECT_MAX_READS (1u << 22)

static PyObject *py_direct_read_ceiling(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    unsigned long long file_bytes, read_bytes;
    unsigned int depth, reads;
    if (!PyArg_ParseTuple(args, "iKKII", &fd, &file_bytes, &read_bytes, &depth, &reads)) return NULL;
    if (reads == 0 || reads > DIRECT_MAX_READS) {
        PyErr_Format(PyExc_ValueError, "reads must be in 1..%u", DIRECT_MAX_READS);
        return NULL;
    }
    uint64_t *lat = PyMem_RawMalloc(sizeof *lat * reads);
    if (!lat) return PyErr_NoMemory();
    double secs = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvf_bench_direct_read(fd, file_bytes, read_bytes, depth, reads, &secs, lat);
    Py_END_ALLOW_THREADS
    if (rc) { PyMem_RawFree(lat); return raise_errno(rc, 0, "O_DIRECT read ceiling"); }
    PyObject *list = PyList_New(reads);
    for (unsigned i = 0; list && i < reads; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(lat[i]);
        if (!v) { Py_CLEAR(list); break; }
        PyList_SET_ITEM(list, i, v);
    }
    PyMem_RawFree(lat);
    if (!list) return NULL;
    return Py_BuildValue("(dN)", secs, list);
}

/* ------------------------------------------------------------------ method table */

PyMethodDef kvf_py_bench_methods[] = {
    {"memcpy_ceiling", py_memcpy_ceiling, METH_VARARGS, memcpy_ceiling_doc},
    {"socket_ceiling", py_socket_ceiling, METH_VARARGS, socket_ceiling_doc},
    {"direct_read_file", py_direct_read_file, METH_VARARGS, direct_read_file_doc},
    {"direct_read_ceiling", py_direct_read_ceiling, METH_VARARGS, direct_read_ceiling_doc},
    {NULL, NULL, 0, NULL},
};
