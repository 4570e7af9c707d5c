/* kvf_py_common.c: what every binding file of kvfabric._native calls: the
 * single -errno -> kvfabric.errors exception mapping (raise_errno) and the
 * buffer-list helpers (bufset_*), declared in kvf_module_int.h. The bottom of
 * the bindings: it calls no other binding file (kvf_module.c, at the top,
 * loads the exception classes into it at import, kvf_py_errors_init).
 */
#include "kvf_module_int.h"

#include <errno.h>
#include <string.h>

#include "kvf_protocol.h"

static PyObject *ErrTransport, *ErrClosed, *ErrDeadline, *ErrProtocol, *ErrNative, *ErrorCodeEnum;

int kvf_py_errors_init(void)
{
    PyObject *errors = PyImport_ImportModule("kvfabric.errors");
    if (!errors) return -1;
    ErrTransport = PyObject_GetAttrString(errors, "TransportError");
    ErrClosed = PyObject_GetAttrString(errors, "ConnectionClosed");
    ErrDeadline = PyObject_GetAttrString(errors, "DeadlineExceeded");
    ErrProtocol = PyObject_GetAttrString(errors, "ProtocolError");
    ErrNative = PyObject_GetAttrString(errors, "NativeError");
    ErrorCodeEnum = PyObject_GetAttrString(errors, "ErrorCode");
    Py_DECREF(errors);
    return ErrTransport && ErrClosed && ErrDeadline && ErrProtocol && ErrNative && ErrorCodeEnum ? 0 : -1;
}

/* The single errno -> exception mapping. `what` names the operation. */
PyObject *raise_errno(int rc, int wire_err, const char *what)
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


void bufset_release(struct bufset *b)
{
    for (Py_ssize_t i = 0; i < b->n; i++) PyBuffer_Release(&b->views[i]);
    PyMem_Free(b->views);
    b->views = NULL;
    b->n = 0;
}

/* Get contiguous byte views of every item of `seq` (writable if asked). */
int bufset_get(struct bufset *b, PyObject *seq, int writable, const char *what)
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
