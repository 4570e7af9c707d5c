/* kvf_module_int.h: what the binding files of kvfabric._native share
 * (kvf_py_common.c defines the helpers; kvf_module.c adds the types and
 * method tables below). Not part of the extension's interface. */
#ifndef KVF_MODULE_INT_H
#define KVF_MODULE_INT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The single -errno -> kvfabric.errors exception mapping; always returns NULL
 * with the exception set. `wire_err` is the kvf error code for -EPROTO (0:
 * MALFORMED), `what` names the operation. */
PyObject *raise_errno(int rc, int wire_err, const char *what);
/* Loads the exception classes raise_errno uses (module init): 0, or -1 with an exception set. */
int kvf_py_errors_init(void);

/* Contiguous byte views of every item of a sequence. */
struct bufset {
    Py_buffer *views;
    Py_ssize_t n;
};

/* 0, or -1 with a Python exception set (nothing held). GIL held. */
int bufset_get(struct bufset *b, PyObject *seq, int writable, const char *what);
void bufset_release(struct bufset *b);

/* Types and method tables of the other binding files, added by PyInit__native. */
extern PyTypeObject kvf_py_RingType;    /* kvf_py_client.c: ConnRing */
extern PyTypeObject kvf_py_ServerType;  /* kvf_py_server.c: Server */
extern PyMethodDef kvf_py_client_methods[];
extern PyMethodDef kvf_py_shm_methods[];
extern PyMethodDef kvf_py_bench_methods[];
extern PyMethodDef kvf_py_route_methods[];  /* kvf_py_route.c: route_owners/route_groups */

#endif
