/* kvf_py_bench.c: bindings of the benchmark ceilings (kvf_bench.c): memcpy_ceiling()
 * and socket_ceiling(), measured with the GIL released. */
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

/* ------------------------------------------------------------------ method table */

PyMethodDef kvf_py_bench_methods[] = {
    {"memcpy_ceiling", py_memcpy_ceiling, METH_VARARGS, memcpy_ceiling_doc},
    {"socket_ceiling", py_socket_ceiling, METH_VARARGS, socket_ceiling_doc},
    {NULL, NULL, 0, NULL},
};
