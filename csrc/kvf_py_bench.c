/* kvf_py_bench.c: bindings of the benchmark ceilings (kvf_bench.c): memcpy_ceiling()
 * and socket_ceiling(), measured with the GIL released. */
#include "kvf_module_int.h"

#include "kvf_bench.h"


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

/* ------------------------------------------------------------------ method table */

PyMethodDef kvf_py_bench_methods[] = {
    {"memcpy_ceiling", py_memcpy_ceiling, METH_VARARGS, memcpy_ceiling_doc},
    {"socket_ceiling", py_socket_ceiling, METH_VARARGS, socket_ceiling_doc},
    {NULL, NULL, 0, NULL},
};
