/*
 * What deepreduce's C extensions share: reading the item type of a buffer argument.
 */

#ifndef DEEPREDUCE_BUFFER_H
#define DEEPREDUCE_BUFFER_H

#include <Python.h>

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

#endif /* DEEPREDUCE_BUFFER_H */
