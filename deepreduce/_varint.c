/*
 * Compiled LEB128 encoder of deepreduce.bits.varint_encode: the varints of the
 * bundle framing (deepreduce.bundle) and of the varint-based index codecs, without
 * numpy's fixed costs on short inputs (a bundle's table is a few dozen numbers).
 * The numpy encoder in deepreduce/bits.py stays as the fallback when this module is
 * not built; both give the same bytes, and the tests compare them.
 *
 *   varint_encode(values) -> bytes
 *
 * values: a C-contiguous one-dimensional uint64 array; every value as LEB128, low
 * 7-bit group first, each byte but a value's last with its top bit set.
 *
 * It lies in the core, apart from the codecs' loops (codecs/_entropyc.c), because
 * the core uses it and never imports deepreduce.codecs. The loop runs without the GIL.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_buffer.h"
#include <stdint.h>

/* Fewer values keep the GIL (see RELEASED_BEGIN): a nanosecond or two a value. */
#define RELEASE_VALUES (1 << 15)

static PyObject *varint_encode(PyObject *module, PyObject *args)
{
    PyObject *object;
    Py_buffer view;
    (void)module;
    if (!PyArg_ParseTuple(args, "O:varint_encode", &object))
        return NULL;
    if (PyObject_GetBuffer(object, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_SetString(PyExc_TypeError, "values must be a C-contiguous buffer of uint64");
        return NULL;
    }
    char code = native_item_code(&view);
    if (view.ndim > 1 || view.itemsize != 8 || (code != 'L' && code != 'Q')) {
        PyErr_Format(PyExc_TypeError, "values must be a one-dimensional uint64 array, got "
                     "format '%s' with %zd dimensions and %zd-byte items",
                     view.format ? view.format : "B", (Py_ssize_t)view.ndim, view.itemsize);
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t count = view.len / 8;
    const uint64_t *values = view.buf;
    PyObject *data = PyBytes_FromStringAndSize(NULL, 10 * count);
    if (data != NULL) {
        uint8_t *start = (uint8_t *)PyBytes_AS_STRING(data), *out = start;
        RELEASED_BEGIN(count, RELEASE_VALUES)
        for (Py_ssize_t i = 0; i < count; i++) {
            uint64_t value = values[i];
            for (; value >= 0x80; value >>= 7)
                *out++ = (uint8_t)(value | 0x80);
            *out++ = (uint8_t)value;
        }
        RELEASED_END
        if (_PyBytes_Resize(&data, out - start) < 0)
            data = NULL;
    }
    PyBuffer_Release(&view);
    return data;
}

static PyMethodDef methods[] = {
    {"varint_encode", varint_encode, METH_VARARGS,
     "varint_encode(values) -> bytes\n\n"
     "deepreduce.bits.varint_encode: LEB128 of every uint64, low 7-bit group first."},
    {NULL, NULL, 0, NULL},
};

DEFINE_MODULE(_varint, "deepreduce._varint",
              "Compiled LEB128 varint encoder of deepreduce.bits.", 0)
