/*
 * Compiled sum of sparse parts into a dense tensor
 * (deepreduce.sums.sum_sorted_into).
 *
 * Every rank of an allgather decodes P payloads of one gradient, each a sorted set
 * of positions with their values, and writes their sum into the dense gradient it
 * hands back. numpy does that with temporaries per step: np.add.at per part, the
 * touched positions concatenated, gathered, scaled for an average in float64 and
 * scattered back. The positions spread over the whole tensor, so every access
 * misses the cache, and what counts is how many there are. Here last step's
 * positions are zeroed, then, for one or two parts (two ranks, the usual case
 * here), one merge writes every position of their union once, in increasing order,
 * with no branch on which part comes next (one that branches mispredicts about once
 * per entry and was slower than numpy). More parts are summed a window of positions
 * at a time: each part adds its entries in the window, in part order, into sums
 * that stay in the L1 cache, and a bitmap of the touched positions gives the union
 * in increasing order, written to total once. Added one after the other into total,
 * then scaled, they cost three scattered passes instead of one, and a merge of the
 * growing running sum with each part grows with the square of the parts. The
 * scattered loops announce their writes ahead.
 *
 *   sum_sorted(total, indices, values, scale, stale) -> numpy int64 array
 *
 * total: a writable C-contiguous one-dimensional float32 or float64 array, zero
 * except perhaps at the positions of stale (an increasing int64 array, or None when
 * it is all zero). indices and values: sequences of the same length P, one
 * strictly increasing int64 array of positions below len(total) and one array of
 * total's dtype and the same length per part. scale: a float, or None for 1.
 *
 * Afterwards total[i] is, at every position of some part, the parts' values there
 * added in part order to +0 in total's type, then (with a scale) multiplied by it
 * in double precision and rounded to total's type; zero everywhere else. The
 * result is the increasing positions of the parts' union: the next call's stale.
 * These are the bits of numpy's zero, add.at, then multiply of the touched entries
 * (sum_into and the exchange's _finish), which stays as the fallback.
 *
 * Parts that are not strictly increasing or leave the array raise ValueError
 * (total may then be partly written); the work runs without the GIL.
 *
 *   localize(indices, ends) -> list
 *
 * The step before: a payload that several tensors share holds the increasing
 * positions of their concatenation; each tensor's start is taken off its positions in
 * place, in one pass, and the list says where each tensor's positions begin (and,
 * last, len(indices)). numpy needs a search and a subtraction per tensor, each
 * handing the GIL to the other codec threads and back (deepreduce.exchange.parallel).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_buffer.h"
#include <stdint.h>
#include <string.h>

/* The positions a merge writes are scattered over a tensor mostly out of cache;
 * announcing the writes this many entries ahead keeps that many in flight. A hint
 * only: compilers without it lose speed, not correctness. */
#define AHEAD 16
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH_WRITE(address) __builtin_prefetch((address), 1)
#else
#define PREFETCH_WRITE(address) ((void)(address))
#endif

/* numpy.empty, looked up once: results are numpy arrays that own their data. */
static PyObject *numpy_empty;

/* ------------------------------------------------------------ the sum */

/* One part: its positions and values. */
typedef struct {
    const int64_t *index;
    const void *value;
    Py_ssize_t length;
} Part;

/* Zeroes total at stale[0..stales); -1 when they do not increase or leave [0, count). */
#define DEFINE_ZERO(name, type)                                                          \
    static int name(type *total, Py_ssize_t count, const int64_t *stale, Py_ssize_t stales) \
    {                                                                                    \
        for (Py_ssize_t i = 0; i < stales; i++) {                                        \
            if (stale[i] < (i ? stale[i - 1] + 1 : 0) || stale[i] >= count)              \
                return -1;                                                               \
            if (i + AHEAD < stales && stale[i + AHEAD] >= 0 && stale[i + AHEAD] < count) \
                PREFETCH_WRITE(total + stale[i + AHEAD]);                                \
            total[stale[i]] = 0;                                                         \
        }                                                                                \
        return 0;                                                                        \
    }

DEFINE_ZERO(zero_float, float)
DEFINE_ZERO(zero_double, double)

/* One or two parts (b may be empty), total zero at their positions: at each position
 * of either, in increasing order, total = (0 + a's value + b's value) times scale
 * where a part has one; the union goes to out. Returns its size, or -1 when a part
 * does not increase or leaves [0, count).
 *
 * Nothing branches on the data: a part without a value at a position adds -0,
 * which changes no sum (0 + -0 is +0), and conditional moves choose the values. The
 * stale positions are zeroed before, in a loop of their own: folded into this merge
 * as a third stream they lengthen the chain of dependent steps from one position to
 * the next, the more so the more the supports change from step to step. */
#define DEFINE_SUM_TWO(name, type, bits_type, SCALED)                                  \
    static Py_ssize_t name(type *total, Py_ssize_t count, const Part *a, const Part *b,  \
                           double scale, int64_t *out)                                   \
    {                                                                                    \
        const int64_t *ia = a->index, *ib = b->index;                                    \
        const type *va = a->value, *vb = b->value;                                       \
        const bits_type sign = (bits_type)1 << (8 * sizeof(type) - 1);                   \
        Py_ssize_t i = 0, j = 0, size = 0, na = a->length, nb = b->length;               \
        int64_t last = -1;                                                               \
        while (i < na || j < nb) {                                                       \
            PREFETCH_AHEAD(ia, i, na);                                                   \
            PREFETCH_AHEAD(ib, j, nb);                                                   \
            int64_t x = i < na ? ia[i] : INT64_MAX, y = j < nb ? ib[j] : INT64_MAX;      \
            int64_t position = x < y ? x : y;                                            \
            if (position <= last || position >= count)                                   \
                return -1;                                                               \
            bits_type in_a = x == position, in_b = y == position, from_a = sign, from_b = sign; \
            if (i < na)                                                                  \
                memcpy(&from_a, va + i, sizeof(type));                                   \
            if (j < nb)                                                                  \
                memcpy(&from_b, vb + j, sizeof(type));                                   \
            /* the value where the part has one, else -0 (the sign bit alone) */         \
            from_a = (from_a & -in_a) | (sign & (in_a - 1));                             \
            from_b = (from_b & -in_b) | (sign & (in_b - 1));                             \
            type add_a, add_b;                                                           \
            memcpy(&add_a, &from_a, sizeof(type));                                       \
            memcpy(&add_b, &from_b, sizeof(type));                                       \
            type sum = (type)0 + add_a;                                                  \
            sum += add_b;                                                                \
            if (SCALED)                                                                  \
                sum = (type)((double)sum * scale);                                       \
            total[position] = sum;                                                       \
            out[size++] = last = position;                                               \
            i += in_a;                                                                   \
            j += in_b;                                                                   \
        }                                                                                \
        return size;                                                                     \
    }

#define PREFETCH_AHEAD(index, at, length)                                                \
    if ((at) + AHEAD < (length) && (index)[(at) + AHEAD] >= 0 && (index)[(at) + AHEAD] < count) \
        PREFETCH_WRITE(total + (index)[(at) + AHEAD])

DEFINE_SUM_TWO(sum_two_float, float, uint32_t, 0)
DEFINE_SUM_TWO(sum_two_double, double, uint64_t, 0)
DEFINE_SUM_TWO(scaled_sum_two_float, float, uint32_t, 1)
DEFINE_SUM_TWO(scaled_sum_two_double, double, uint64_t, 1)

/* Positions summed at a time by sum_many: their sums (16 or 32 KB) stay in the L1 cache. */
#define WINDOW 4096

/* Three or more parts, total zero at their positions: as DEFINE_SUM_TWO, a window of
 * WINDOW positions at a time. window holds WINDOW sums, +0 on entry (and on return,
 * unless it fails); next holds nparts cursors, 0 on entry. Returns the union's size,
 * or -1 when a part does not increase or leaves [0, count). */
#define DEFINE_SUM_MANY(name, type, bits_type, quiet_bit)                               \
    static Py_ssize_t name(type *total, Py_ssize_t count, const Part *parts,             \
                           Py_ssize_t nparts, int scaled, double scale, int64_t *out,    \
                           type *window, Py_ssize_t *next)                               \
    {                                                                                    \
        uint64_t touched[WINDOW / 64];                                                   \
        Py_ssize_t size = 0;                                                             \
        for (;;) {                                                                       \
            int64_t first = INT64_MAX;                                                   \
            for (Py_ssize_t p = 0; p < nparts; p++)                                      \
                if (next[p] < parts[p].length && parts[p].index[next[p]] < first)        \
                    first = parts[p].index[next[p]];                                     \
            if (first == INT64_MAX)                                                      \
                return size;                                                             \
            if (first < 0 || first >= count)                                             \
                return -1;                                                               \
            int64_t base = first - first % WINDOW, end = base + WINDOW;                  \
            memset(touched, 0, sizeof touched);                                          \
            for (Py_ssize_t p = 0; p < nparts; p++) {                                    \
                const int64_t *index = parts[p].index;                                   \
                const type *value = parts[p].value;                                      \
                Py_ssize_t i = next[p];                                                  \
                int64_t previous = i ? index[i - 1] : -1;                                \
                for (; i < parts[p].length && index[i] < end; i++) {                     \
                    int64_t position = index[i];                                         \
                    if (position <= previous || position >= count)                       \
                        return -1;                                                       \
                    previous = position;                                                 \
                    type add = value[i], current = window[position - base];             \
                    type sum = current + add;                                            \
                    if (current != current && add != add) {                              \
                        /* both NaN: numpy's add.at keeps the running sum's, quieted     \
                         * (x86 returns the first operand's, and the compiler may put   \
                         * either first); one NaN gives its own, quieted, either way */ \
                        bits_type bits;                                                  \
                        memcpy(&bits, &current, sizeof bits);                            \
                        bits |= quiet_bit;                                               \
                        memcpy(&sum, &bits, sizeof sum);                                 \
                    }                                                                    \
                    window[position - base] = sum;                                       \
                    touched[(position - base) >> 6] |= (uint64_t)1 << ((position - base) & 63); \
                }                                                                        \
                next[p] = i;                                                             \
            }                                                                            \
            for (int word = 0; word < WINDOW / 64; word++)                               \
                for (uint64_t bits = touched[word]; bits; bits &= bits - 1) {            \
                    Py_ssize_t slot = 64 * word + LOWEST_BIT(bits);                      \
                    type sum = window[slot];                                             \
                    window[slot] = 0;                                                    \
                    if (scaled)                                                          \
                        sum = (type)((double)sum * scale);                               \
                    total[base + slot] = sum;                                            \
                    out[size++] = base + slot;                                           \
                }                                                                        \
        }                                                                                \
    }

DEFINE_SUM_MANY(sum_many_float, float, uint32_t, (uint32_t)1 << 22)
DEFINE_SUM_MANY(sum_many_double, double, uint64_t, (uint64_t)1 << 51)

/* ------------------------------------------------------------ arguments */

/* A C-contiguous one-dimensional buffer of int64 ('i') or of the float code, or an
 * exception naming `what`. */
static int get_array(PyObject *object, Py_buffer *view, char kind, int writable,
                     const char *what)
{
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT
                           | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s array", what,
                     writable ? ", writable" : "");
        return -1;
    }
    char code = native_item_code(view);
    int fits = kind == 'i' ? view->itemsize == 8 && (code == 'q' || code == 'l')
                           : native_float_code(view) == kind;
    if (view->ndim != 1 || !fits) {
        PyErr_Format(PyExc_TypeError, "%s must be a one-dimensional %s array", what,
                     kind == 'i' ? "int64" : kind == 'f' ? "float32" : "float64");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *sum_sorted(PyObject *module, PyObject *args)
{
    PyObject *total_object, *indices_object, *values_object, *scale_object, *stale_object;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOOOO:sum_sorted", &total_object, &indices_object,
                          &values_object, &scale_object, &stale_object))
        return NULL;
    Py_buffer total, stale = {0};
    if (PyObject_GetBuffer(total_object, &total, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT
                           | PyBUF_WRITABLE) < 0)
        return NULL;
    char kind = native_float_code(&total);
    if (total.ndim != 1 || !kind) {
        PyErr_SetString(PyExc_TypeError, "total must be a one-dimensional float32 or "
                        "float64 array");
        PyBuffer_Release(&total);
        return NULL;
    }
    double scale = 1.0;
    int scaled = scale_object != Py_None;
    if (scaled && (scale = PyFloat_AsDouble(scale_object)) == -1.0 && PyErr_Occurred()) {
        PyBuffer_Release(&total);
        return NULL;
    }
    PyObject *indices = PySequence_Fast(indices_object, "indices must be a sequence");
    PyObject *values = indices ? PySequence_Fast(values_object, "values must be a sequence")
                               : NULL;
    Py_ssize_t nparts = indices ? PySequence_Fast_GET_SIZE(indices) : 0, held = 0;
    Py_buffer *views = NULL;
    Part *parts = NULL;
    Py_ssize_t *next = NULL;
    int64_t *merged = NULL;
    void *window = NULL;
    PyObject *result = NULL;
    if (values == NULL)
        goto done;
    if (PySequence_Fast_GET_SIZE(values) != nparts) {
        PyErr_SetString(PyExc_ValueError, "indices and values must have the same length");
        goto done;
    }
    if (stale_object != Py_None && get_array(stale_object, &stale, 'i', 0, "stale") < 0)
        goto done;
    views = PyMem_Calloc(2 * (size_t)nparts + 1, sizeof *views);
    parts = PyMem_Calloc((size_t)nparts + 1, sizeof *parts);
    next = PyMem_Calloc((size_t)nparts + 1, sizeof *next);
    window = PyMem_Calloc(WINDOW, (size_t)total.itemsize);
    if (views == NULL || parts == NULL || next == NULL || window == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t entries = 0;
    for (; held < nparts; held++) {
        Py_buffer *index = &views[2 * held], *value = &views[2 * held + 1];
        if (get_array(PySequence_Fast_GET_ITEM(indices, held), index, 'i', 0,
                      "every indices array") < 0)
            goto done;
        if (get_array(PySequence_Fast_GET_ITEM(values, held), value, kind, 0,
                      "every values array (total's dtype)") < 0) {
            PyBuffer_Release(index);
            goto done;
        }
        if (index->len / 8 != value->len / value->itemsize) {
            PyErr_Format(PyExc_ValueError, "part %zd has %zd indices and %zd values", held,
                         index->len / 8, value->len / value->itemsize);
            PyBuffer_Release(index);
            PyBuffer_Release(value);
            goto done;
        }
        parts[held] = (Part){index->buf, value->buf, index->len / 8};
        entries += index->len / 8;
    }
    merged = PyMem_RawMalloc(((size_t)entries + 1) * sizeof *merged);
    if (merged == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t count = total.len / total.itemsize, stales = stale.buf ? stale.len / 8 : 0;
    Py_ssize_t union_size = 0;
    const int64_t *positions = merged;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = kind == 'f' ? zero_float(total.buf, count, stale.buf, stales)
                         : zero_double(total.buf, count, stale.buf, stales);
    if (failed)
        ;
    else if (nparts <= 2) {
        Part none = {NULL, NULL, 0};
        const Part *a = nparts ? &parts[0] : &none, *b = nparts == 2 ? &parts[1] : &none;
        union_size = (kind == 'f' ? (scaled ? scaled_sum_two_float : sum_two_float)(
                          total.buf, count, a, b, scale, merged)
                      : (scaled ? scaled_sum_two_double : sum_two_double)(
                          total.buf, count, a, b, scale, merged));
        failed = union_size < 0;
    }
    else {
        union_size = kind == 'f'
            ? sum_many_float(total.buf, count, parts, nparts, scaled, scale, merged, window, next)
            : sum_many_double(total.buf, count, parts, nparts, scaled, scale, merged, window,
                              next);
        failed = union_size < 0;
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_Format(PyExc_ValueError, "every part's indices and stale must be strictly "
                     "increasing positions in [0, %zd)", count);
        goto done;
    }
    result = PyObject_CallFunction(numpy_empty, "ns", union_size, "int64");
    if (result != NULL && union_size) {
        Py_buffer view;
        if (PyObject_GetBuffer(result, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
            Py_CLEAR(result);
        else {
            memcpy(view.buf, positions, (size_t)union_size * sizeof *positions);
            PyBuffer_Release(&view);
        }
    }
done:
    for (Py_ssize_t p = 0; p < held; p++) {
        PyBuffer_Release(&views[2 * p]);
        PyBuffer_Release(&views[2 * p + 1]);
    }
    PyMem_RawFree(merged);
    PyMem_Free(window);
    PyMem_Free(next);
    PyMem_Free(parts);
    PyMem_Free(views);
    if (stale.buf)
        PyBuffer_Release(&stale);
    Py_XDECREF(values);
    Py_XDECREF(indices);
    PyBuffer_Release(&total);
    return result;
}

/* ------------------------------------------------------------ the split */

/* Fewer positions keep the GIL (see RELEASED_BEGIN): a fraction of a nanosecond each, and
 * every hand-over of the GIL to another thread and back costs microseconds. */
#define RELEASE_SPLIT (1 << 16)

static PyObject *localize(PyObject *module, PyObject *args)
{
    PyObject *indices_object, *ends_object;
    (void)module;
    if (!PyArg_ParseTuple(args, "OO:localize", &indices_object, &ends_object))
        return NULL;
    Py_buffer indices, ends;
    if (get_array(indices_object, &indices, 'i', 1, "indices") < 0)
        return NULL;
    if (get_array(ends_object, &ends, 'i', 0, "ends") < 0) {
        PyBuffer_Release(&indices);
        return NULL;
    }
    Py_ssize_t count = indices.len / 8, parts = ends.len / 8;
    Py_ssize_t *cuts = parts ? PyMem_Calloc((size_t)parts + 1, sizeof *cuts) : NULL;
    PyObject *result = NULL;
    if (cuts == NULL) {
        if (parts)
            PyErr_NoMemory();
        else
            PyErr_SetString(PyExc_ValueError, "ends must name at least one tensor");
        goto done;
    }
    int64_t *index = indices.buf;
    const int64_t *end = ends.buf;
    RELEASED_BEGIN(count, RELEASE_SPLIT)
    /* the part moves on, never back: any input ends in bounds, increasing ones split */
    Py_ssize_t part = 0;
    int64_t start = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        while (part < parts - 1 && index[i] >= end[part]) {
            start = end[part++];
            cuts[part] = i;
        }
        index[i] -= start;
    }
    while (part < parts - 1)
        cuts[++part] = count;
    cuts[parts] = count;
    RELEASED_END
    result = PyList_New(parts + 1);
    for (Py_ssize_t j = 0; result != NULL && j <= parts; j++) {
        PyObject *cut = PyLong_FromSsize_t(cuts[j]);
        if (cut == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, j, cut);
    }
done:
    PyMem_Free(cuts);
    PyBuffer_Release(&ends);
    PyBuffer_Release(&indices);
    return result;
}

static PyMethodDef methods[] = {
    {"sum_sorted", sum_sorted, METH_VARARGS,
     "sum_sorted(total, indices, values, scale, stale) -> numpy int64 array\n\n"
     "Write into total (zero except at the increasing positions stale, or None) the\n"
     "sum of the parts (strictly increasing int64 indices with values of total's\n"
     "dtype), added in part order, times scale (None: 1) in double precision, and\n"
     "zero elsewhere; return the increasing union of the parts' indices. See\n"
     "deepreduce.sums.sum_sorted_into."},
    {"localize", localize, METH_VARARGS,
     "localize(indices, ends) -> list\n\n"
     "Split the increasing int64 positions indices of tensors laid end to end (their\n"
     "ends, an int64 array) into the tensors': take each tensor's start off its\n"
     "positions, in place, and return where each tensor's positions begin, and\n"
     "len(indices). See deepreduce.sums.localize_sorted."},
    {NULL, NULL, 0, NULL},
};

DEFINE_MODULE(_sparsesum, "deepreduce._sparsesum",
              "Compiled sum of sorted sparse parts into a dense tensor (see "
              "deepreduce.sums.sum_sorted_into).",
              import_numpy_empty(&numpy_empty))
