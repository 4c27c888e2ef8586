/*
 * What deepreduce's C extensions share: reading the item type of a buffer argument,
 * releasing the GIL around long loops, the lowest set bit of a mask, numpy.empty for
 * the arrays they return, and the module's definition with its init function.
 */

#ifndef DEEPREDUCE_BUFFER_H
#define DEEPREDUCE_BUFFER_H

#include <Python.h>
#include <stdint.h>

/* The struct code of a buffer's items when its format is one code, after an optional
 * native-order prefix ('@', '=', or the host's own '<' or '>'); else 0. numpy exports
 * uint8 as 'B', float16 as 'e', float32 as 'f', float64 as 'd', int64 as 'l' or 'q'
 * and uint64 as 'L' or 'Q'. A missing format means bytes ('B'). */
static inline char native_item_code(const Py_buffer *view)
{
    const char *format = view->format ? view->format : "B";
    if (*format == '@' || *format == '=' || (*format == '<' && PY_LITTLE_ENDIAN)
            || (*format == '>' && !PY_LITTLE_ENDIAN))
        format++;
    return format[0] != '\0' && format[1] == '\0' ? format[0] : 0;
}

/* 'f' for a buffer of native-order float32, 'd' for float64, else 0. */
static inline char native_float_code(const Py_buffer *view)
{
    char code = native_item_code(view);
    if (code == 'f' && view->itemsize == (Py_ssize_t)sizeof(float))
        return 'f';
    if (code == 'd' && view->itemsize == (Py_ssize_t)sizeof(double))
        return 'd';
    return 0;
}

/* Releases the GIL around a loop that touches no Python object when `work` (its input,
 * in bytes or items as the caller says) reaches `least`: below that, handing the GIL to
 * a waiting thread and taking it back costs more than the loop (two thread wake-ups,
 * some microseconds each, tens where the threads run on virtual cores). The buffers the
 * loop reads and writes must stay held (their Py_buffer views, or objects not yet
 * shared) until RELEASED_END. */
#define RELEASED_BEGIN(work, least) \
    { PyThreadState *released_state_ = (work) >= (least) ? PyEval_SaveThread() : NULL;
#define RELEASED_END \
    if (released_state_ != NULL) PyEval_RestoreThread(released_state_); }

/* Lowest set bit of a non-zero mask. */
#if defined(__GNUC__) || defined(__clang__)
#define LOWEST_BIT(x) __builtin_ctzll(x)
#else
static inline int LOWEST_BIT(uint64_t x)
{
    int bit = 0;
    while (!(x & 1u)) {
        x >>= 1;
        bit++;
    }
    return bit;
}
#endif

/* numpy.empty into *empty the first time (the extensions that return new arrays keep it
 * for the module's life): 0, or -1 with the exception set. */
static inline int import_numpy_empty(PyObject **empty)
{
    if (*empty != NULL)
        return 0;
    PyObject *numpy = PyImport_ImportModule("numpy");
    if (numpy == NULL)
        return -1;
    *empty = PyObject_GetAttrString(numpy, "empty");
    Py_DECREF(numpy);
    return *empty == NULL ? -1 : 0;
}

/* The module `full_name` (documented by `doc`, its functions the file's `methods`
 * table) and its init function PyInit_<short_name>, which evaluates `prepare` first: an
 * int expression, 0 to go on, or -1 with an exception set (ImportError, say, where the
 * processor lacks what the module needs) to refuse the import. */
#define DEFINE_MODULE(short_name, full_name, doc, prepare)              \
    static struct PyModuleDef module_definition = {                    \
        PyModuleDef_HEAD_INIT, full_name, doc, -1, methods,            \
    };                                                                  \
    PyMODINIT_FUNC PyInit_##short_name(void)                            \
    {                                                                   \
        return (prepare) < 0 ? NULL : PyModule_Create(&module_definition); \
    }

#endif /* DEEPREDUCE_BUFFER_H */
