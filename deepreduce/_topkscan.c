/*
 * Compiled candidate scan of deepreduce's Top-k sparsifier (deepreduce.sparsifiers.TopK).
 *
 * TopK estimates a threshold from a sample and then needs every position whose
 * magnitude reaches it: about 1-2% of a gradient. numpy does that in three passes
 * per slice (abs, compare, flatnonzero), each writing a temporary; here one pass
 * reads the values once, 64 at a time into a mask of hits, and writes only the
 * positions found. The numpy code (sparsifiers._at_least) stays as the fallback
 * when this module is not built; both give the same positions, and the tests
 * compare them.
 *
 *   at_least(values, low) -> numpy int64 array
 *
 * the positions i, increasing, where fabs(values[i]) >= low, values a C-contiguous
 * one-dimensional float32 or float64 buffer. low is compared in the values' own
 * precision (rounded to float for float32; the caller passes a value of that type,
 * so nothing is rounded). NaN values never qualify, and a NaN low selects nothing,
 * as IEEE comparisons have it. The pass runs without the GIL, so other Python
 * threads (Horovod's) keep going.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Values tested together, one bit each in a 64-bit mask of hits. */
#define BLOCK 64
/* The first output buffer holds 1/64 of the values plus 1024, at most all of them
 * (Top-k's candidates are 1-2%): one allocation in the usual case, doubling when
 * more are found. */
#define FIRST_CAPACITY_SHIFT 6
#define MIN_CAPACITY 1024

/* Prefetching every line of the values this far ahead of the test keeps more
 * memory reads in flight than the hardware's own prefetch does: a third less time
 * on a gradient that is not in cache (3.3 -> 2.1 ms for 4M float32 values), the
 * same from 1 to 16 KB ahead. */
#define PREFETCH_BYTES 4096
#define CACHE_LINE 64

/* A hint only: compilers without it lose speed, not correctness. */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address) __builtin_prefetch(address)
#else
#define PREFETCH(address) ((void)(address))
#endif

/* SSE2 is part of every x86-64 processor. Defining DEEPREDUCE_PORTABLE_SCAN builds
 * the plain C block test instead, which other processors get, to try it on x86. */
#if (defined(__SSE2__) || defined(_M_X64)) && !defined(DEEPREDUCE_PORTABLE_SCAN)
#define SSE2_SCAN 1
#include <emmintrin.h>
#else
#define SSE2_SCAN 0
#endif

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

/* numpy.empty, looked up once: the result is a numpy array that owns its data. */
static PyObject *numpy_empty;

/* ------------------------------------------------------------ the block test */

/* Bit i of the result is set when fabs(block[i]) >= low, for the BLOCK values of
 * block. Comparisons are ordered, as C's >= is: false whenever a NaN is involved. */
#if SSE2_SCAN
/* Clearing the sign bit is fabs. Compares give all-ones lanes; two saturating
 * packs narrow 16 of them to bytes, and one movemask makes 16 bits. */
static inline uint64_t bits_of_16(__m128i a, __m128i b, __m128i c, __m128i d)
{
    __m128i bytes = _mm_packs_epi16(_mm_packs_epi32(a, b), _mm_packs_epi32(c, d));
    return (uint64_t)_mm_movemask_epi8(bytes);
}

static inline __m128i float_lanes(const float *at, __m128 sign, __m128 limit)
{
    return _mm_castps_si128(_mm_cmpge_ps(_mm_andnot_ps(sign, _mm_loadu_ps(at)), limit));
}

static inline uint64_t float_hits(const float *block, float low)
{
    const __m128 sign = _mm_set1_ps(-0.0f), limit = _mm_set1_ps(low);
    uint64_t mask = 0;
    for (int j = 0; j < BLOCK; j += 16)
        mask |= bits_of_16(float_lanes(block + j, sign, limit),
                           float_lanes(block + j + 4, sign, limit),
                           float_lanes(block + j + 8, sign, limit),
                           float_lanes(block + j + 12, sign, limit)) << j;
    return mask;
}

/* Four doubles' 64-bit lanes, as four 32-bit lanes (one half of each). */
static inline __m128i double_lanes(const double *at, __m128d sign, __m128d limit)
{
    __m128d low_half = _mm_cmpge_pd(_mm_andnot_pd(sign, _mm_loadu_pd(at)), limit);
    __m128d high_half = _mm_cmpge_pd(_mm_andnot_pd(sign, _mm_loadu_pd(at + 2)), limit);
    return _mm_castps_si128(_mm_shuffle_ps(_mm_castpd_ps(low_half), _mm_castpd_ps(high_half),
                                           _MM_SHUFFLE(2, 0, 2, 0)));
}

static inline uint64_t double_hits(const double *block, double low)
{
    const __m128d sign = _mm_set1_pd(-0.0), limit = _mm_set1_pd(low);
    uint64_t mask = 0;
    for (int j = 0; j < BLOCK; j += 16)
        mask |= bits_of_16(double_lanes(block + j, sign, limit),
                           double_lanes(block + j + 4, sign, limit),
                           double_lanes(block + j + 8, sign, limit),
                           double_lanes(block + j + 12, sign, limit)) << j;
    return mask;
}
#else
/* A count of the hits, in an integer as wide as the values, is a reduction the
 * compiler vectorises; the mask is built only for the blocks with a hit. */
#define DEFINE_HITS(name, type, absolute, counter)                                     \
    static inline uint64_t name(const type *block, type low)                           \
    {                                                                                  \
        counter any = 0;                                                               \
        for (int i = 0; i < BLOCK; i++)                                                \
            any += absolute(block[i]) >= low;                                          \
        if (!any)                                                                      \
            return 0;                                                                  \
        uint64_t mask = 0;                                                             \
        for (int i = 0; i < BLOCK; i++)                                                \
            mask |= (uint64_t)(absolute(block[i]) >= low) << i;                        \
        return mask;                                                                   \
    }

DEFINE_HITS(float_hits, float, fabsf, int32_t)
DEFINE_HITS(double_hits, double, fabs, int64_t)
#endif

/* ------------------------------------------------------------ the scan */

/* Room for `needed` positions in *out (raw memory: it is grown without the GIL),
 * doubling up to `limit`, the values' count, which no result exceeds; 0, or -1 when
 * the allocation fails (then *out is unchanged). Values are at least 4 bytes, so
 * 2 * limit positions cannot overflow a size. */
static int reserve(int64_t **out, Py_ssize_t *capacity, Py_ssize_t needed, Py_ssize_t limit)
{
    if (needed <= *capacity)
        return 0;
    Py_ssize_t grown = 2 * *capacity < limit ? 2 * *capacity : limit;
    grown = grown > needed ? grown : needed;
    int64_t *bigger = PyMem_RawRealloc(*out, (size_t)grown * sizeof **out);
    if (bigger == NULL)
        return -1;
    *out = bigger;
    *capacity = grown;
    return 0;
}

/* Stores the position of the lowest hit of *mask (or junk when there is none) and
 * keeps it by advancing the count: no branch. ORing the top bit keeps the lowest
 * bit of a non-zero mask and gives LOWEST_BIT a defined input when it is zero. */
static inline Py_ssize_t take_lowest(int64_t *out, Py_ssize_t found, Py_ssize_t base,
                                     uint64_t *mask)
{
    out[found] = (int64_t)(base + LOWEST_BIT(*mask | (1ull << 63)));
    found += *mask != 0;
    *mask &= *mask - 1;
    return found;
}

/* The scan for one value type. A block's first two hits are taken without a
 * branch: at Top-1% about half the blocks hold one and few hold three, and a
 * branch on "any hit" would be mispredicted about once per candidate. The last
 * values (fewer than a block) go one by one. Returns the number of positions
 * found, or -1 when the output could not grow. */
#define DEFINE_SCAN(name, type, absolute, block_hits)                                  \
    static Py_ssize_t name(const type *value, Py_ssize_t count, type low,              \
                           int64_t **out, Py_ssize_t *capacity)                        \
    {                                                                                  \
        const Py_ssize_t ahead = PREFETCH_BYTES / (Py_ssize_t)sizeof(type);            \
        Py_ssize_t found = 0, base = 0;                                                \
        for (; base + BLOCK <= count; base += BLOCK) {                                 \
            if (base + ahead + BLOCK <= count)                                         \
                for (size_t line = 0; line < BLOCK * sizeof(type); line += CACHE_LINE) \
                    PREFETCH((const char *)(value + base + ahead) + line);             \
            uint64_t mask = block_hits(value + base, low);                             \
            if (reserve(out, capacity, found + BLOCK, count) < 0)                      \
                return -1;                                                             \
            int64_t *position = *out;                                                  \
            found = take_lowest(position, found, base, &mask);                         \
            found = take_lowest(position, found, base, &mask);                         \
            for (; mask; mask &= mask - 1)                                             \
                position[found++] = (int64_t)(base + LOWEST_BIT(mask));                \
        }                                                                              \
        for (; base < count; base++)                                                   \
            if (absolute(value[base]) >= low) {                                        \
                if (reserve(out, capacity, found + 1, count) < 0)                      \
                    return -1;                                                         \
                (*out)[found++] = (int64_t)base;                                       \
            }                                                                          \
        return found;                                                                  \
    }

DEFINE_SCAN(scan_float, float, fabsf, float_hits)
DEFINE_SCAN(scan_double, double, fabs, double_hits)

/* ------------------------------------------------------------ argument checks */

/* numpy exports float32 as 'f' and float64 as 'd'; an optional native/little-endian
 * prefix is fine on a little-endian host. The item code, or 0 for anything else. */
static char float_format(const Py_buffer *view)
{
    const char *format = view->format ? view->format : "B";
    if (*format == '@' || *format == '=' || (*format == '<' && PY_LITTLE_ENDIAN)
            || (*format == '>' && !PY_LITTLE_ENDIAN))
        format++;
    if (strlen(format) != 1)
        return 0;
    if (*format == 'f' && view->itemsize == (Py_ssize_t)sizeof(float))
        return 'f';
    if (*format == 'd' && view->itemsize == (Py_ssize_t)sizeof(double))
        return 'd';
    return 0;
}

/* A C-contiguous one-dimensional float32 or float64 buffer, else TypeError. */
static int get_values(PyObject *object, Py_buffer *view, char *format)
{
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_SetString(PyExc_TypeError,
                        "values must be a C-contiguous buffer of float32 or float64");
        return -1;
    }
    *format = float_format(view);
    if (view->ndim != 1 || *format == 0) {
        PyErr_Format(PyExc_TypeError, "values must be a one-dimensional float32 or float64 "
                     "array, got format '%s' with %zd dimensions and %zd-byte items",
                     view->format ? view->format : "B", (Py_ssize_t)view->ndim,
                     view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* A new numpy int64 array holding the count positions. */
static PyObject *as_array(const int64_t *positions, Py_ssize_t count)
{
    PyObject *array = PyObject_CallFunction(numpy_empty, "ns", count, "int64");
    if (array == NULL || count == 0)
        return array;
    Py_buffer view;
    if (PyObject_GetBuffer(array, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        Py_DECREF(array);
        return NULL;
    }
    memcpy(view.buf, positions, (size_t)count * sizeof *positions);
    PyBuffer_Release(&view);
    return array;
}

static PyObject *at_least(PyObject *module, PyObject *args)
{
    PyObject *values_object;
    double low;
    (void)module;
    if (!PyArg_ParseTuple(args, "Od:at_least", &values_object, &low))
        return NULL;
    Py_buffer values;
    char format;
    if (get_values(values_object, &values, &format) < 0)
        return NULL;
    Py_ssize_t count = values.len / values.itemsize;
    Py_ssize_t capacity = (count >> FIRST_CAPACITY_SHIFT) + MIN_CAPACITY, found;
    capacity = capacity < count ? capacity : count;
    int64_t *positions = PyMem_RawMalloc((size_t)capacity * sizeof *positions);
    PyObject *result = NULL;
    if (positions == NULL)
        PyErr_NoMemory();
    else {
        Py_BEGIN_ALLOW_THREADS
        found = format == 'f'
            ? scan_float(values.buf, count, (float)low, &positions, &capacity)
            : scan_double(values.buf, count, low, &positions, &capacity);
        Py_END_ALLOW_THREADS
        result = found < 0 ? PyErr_NoMemory() : as_array(positions, found);
    }
    PyMem_RawFree(positions);
    PyBuffer_Release(&values);
    return result;
}

static PyMethodDef methods[] = {
    {"at_least", at_least, METH_VARARGS,
     "at_least(values, low) -> numpy int64 array\n\n"
     "The positions, increasing, where abs(values) >= low (NaN never; a NaN low\n"
     "selects nothing). values: a C-contiguous one-dimensional float32 or float64\n"
     "array; low is compared in its precision. See deepreduce.sparsifiers._at_least."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "deepreduce._topkscan",
    "Compiled candidate scan of the Top-k sparsifier (see deepreduce.sparsifiers.TopK).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__topkscan(void)
{
    if (numpy_empty == NULL) {
        PyObject *numpy = PyImport_ImportModule("numpy");
        if (numpy == NULL)
            return NULL;
        numpy_empty = PyObject_GetAttrString(numpy, "empty");
        Py_DECREF(numpy);
        if (numpy_empty == NULL)
            return NULL;
    }
    return PyModule_Create(&module);
}
