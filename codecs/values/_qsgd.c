/*
 * Compiled quantisation and dequantisation of deepreduce's QSGD value codec
 * (deepreduce.codecs.values.qsgd).
 *
 * numpy quantises in about ten whole-array passes (widen into padded buckets, abs,
 * scale, add the dither, floor, clip, narrow, sign, pack, and as many again for what
 * the receiver will see); here one pass per bucket finds its peak while the bucket is
 * in the L1 cache, and a second one, vectorised, draws each value's dither, writes its
 * packed code and, when asked, its dequantised value. The dither of value i is the
 * MurmurHash3 of i with the call's seed (deepreduce.codecs.values.qsgd.dither, which the numpy
 * fallback uses), so both give the same bits; the tests compare them.
 *
 *   quantize(values, bucket, bits, seed, norms, find_peaks, received) -> bytes
 *
 * values: a C-contiguous one-dimensional float32 or float64 array of n values.
 * seed: the uint32 seed of the dither. norms: writable float32, one per
 * bucket of `bucket` values; with find_peaks each becomes the smallest float32 not
 * below the bucket's largest magnitude (NaN when it holds a NaN), else it is read (the
 * L2 norms numpy computes). A bucket whose norm is positive and finite scales its
 * values to a = |x| * (levels / norm) and takes level min(floor(a + dither), levels),
 * computed in double as numpy does; any other bucket codes level 0. The result packs
 * each code 2 * level + (x < 0 and level > 0) in `bits` bits, MSB first, zero-padded
 * to a byte. received (None, or writable float32 or float64 of n) gets
 * (+-level) * (norm / levels) in double, rounded once to its type: the decoder's
 * values.
 *
 *   dequantize(data, norms, bucket, bits, out) -> bool
 *
 * the decoder: out (writable float32 or float64 of n values) gets the values of the
 * n codes packed in data (at least ceil(n * bits / 8) bytes), as received above.
 * False when a code is 1 (level 0 with the sign bit set, which no encoder writes).
 *
 * Results are deterministic: the arithmetic is the same IEEE double operations in the
 * same order as numpy's (setup.py turns off contraction into fused multiply-adds).
 * The passes run without the GIL.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_buffer.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The codec's limits (deepreduce.codecs.values.qsgd.MIN_BITS, MAX_BITS). */
#define MIN_BITS 2
#define MAX_BITS 8

/* ------------------------------------------------------------ buffers */

/* A C-contiguous one-dimensional float buffer named `name` with at least `count`
 * items (count < 0: any), of format `want` ('f', 'd', or 0 for either), writable when
 * asked; else TypeError or ValueError. Its format goes to *format. */
static int get_floats(PyObject *object, const char *name, Py_buffer *view, char want,
                      Py_ssize_t count, int writable, char *format)
{
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT
                           | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s float array", name,
                     writable ? ", writable" : "");
        return -1;
    }
    char found = native_float_code(view);
    if (view->ndim != 1 || found == 0 || (want && found != want)) {
        PyErr_Format(PyExc_TypeError, "%s must be a one-dimensional %s array", name,
                     want == 'f' ? "float32" : want == 'd' ? "float64" : "float32 or float64");
        PyBuffer_Release(view);
        return -1;
    }
    if (count >= 0 && view->len / view->itemsize < count) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd values, needs %zd", name,
                     view->len / view->itemsize, count);
        PyBuffer_Release(view);
        return -1;
    }
    if (format)
        *format = found;
    return 0;
}

/* ------------------------------------------------------------ the passes */

typedef struct {
    Py_ssize_t count, bucket;
    int levels, bits;
} Shape;

/* The smallest float32 not below x >= 0 (numpy's float32_at_least); NaN stays NaN. */
static float float32_at_least(double x)
{
    float rounded = (float)x;
    if ((double)rounded < x)
        rounded = nextafterf(rounded, INFINITY);
    return rounded;
}

#if defined(__GNUC__) && defined(__x86_64__) && defined(__ELF__)
#define WITH_AVX2_CLONE __attribute__((target_clones("avx2", "default")))
#else
#define WITH_AVX2_CLONE
#endif

/* The smallest float32 not below the largest magnitude of values[start:end], NaN
 * when one is NaN. Magnitudes are compared as integers, their bits without the sign:
 * those order as the floats do, above infinity's come the NaNs, and the loop has no
 * branch on the data (and vectorises: unsigned maxima need AVX2, chosen at load time). */
WITH_AVX2_CLONE
static float bucket_peak(const void *values, char format, Py_ssize_t start, Py_ssize_t end)
{
    if (format == 'f') {
        const uint32_t *bits = (const uint32_t *)values;
        uint32_t top = 0;
        for (Py_ssize_t i = start; i < end; i++) {
            uint32_t magnitude = bits[i] & 0x7FFFFFFFu;
            top = magnitude > top ? magnitude : top;
        }
        float peak;
        memcpy(&peak, &top, sizeof peak);
        return top > 0x7F800000u ? NAN : peak;
    }
    const uint64_t *bits = (const uint64_t *)values;
    uint64_t top = 0;
    for (Py_ssize_t i = start; i < end; i++) {
        uint64_t magnitude = bits[i] & 0x7FFFFFFFFFFFFFFFu;
        top = magnitude > top ? magnitude : top;
    }
    double peak;
    memcpy(&peak, &top, sizeof peak);
    return top > 0x7FF0000000000000u ? NAN : float32_at_least(peak);
}

/* MSB-first writer of codes of `bits` bits. */
typedef struct {
    uint8_t *out;
    uint32_t pending;
    int pending_bits;
} Packer;

static inline void put_code(Packer *packer, unsigned code, int bits)
{
    packer->pending = (packer->pending << bits) | code;
    packer->pending_bits += bits;
    if (packer->pending_bits >= 8) {
        packer->pending_bits -= 8;
        *packer->out++ = (uint8_t)(packer->pending >> packer->pending_bits);
    }
}

static inline void flush_codes(Packer *packer)
{
    if (packer->pending_bits > 0)
        *packer->out = (uint8_t)(packer->pending << (8 - packer->pending_bits));
}

/* Reads codes of `bits` bits, MSB first. */
typedef struct {
    const uint8_t *in;
    uint32_t pending;
    int pending_bits;
} Unpacker;

static inline unsigned get_code(Unpacker *unpacker, int bits)
{
    if (unpacker->pending_bits < bits) {
        unpacker->pending = (unpacker->pending << 8) | *unpacker->in++;
        unpacker->pending_bits += 8;
    }
    unpacker->pending_bits -= bits;
    return (unpacker->pending >> unpacker->pending_bits) & ((1u << bits) - 1);
}

/* Element i of a float32 ('f') or float64 ('d') array, widened (exactly). The format
 * is the same for a whole pass, so the compiler hoists the test out of the loops. */
static inline double load(const void *array, char format, Py_ssize_t i)
{
    return format == 'f' ? (double)((const float *)array)[i] : ((const double *)array)[i];
}

/* What the receiver sees of a code 2 * level + negative: the level, signed, times the
 * bucket's step in double, rounded once to the output's type. */
static inline void store_received(void *out, char format, Py_ssize_t i, unsigned code,
                                  double step)
{
    int negative = (int)(code & 1);  /* signs are random: no branch on them */
    double value = (double)(((int)(code >> 1) ^ -negative) + negative) * step;
    if (format == 'f')
        ((float *)out)[i] = (float)value;
    else
        ((double *)out)[i] = value;
}



/* dequantize_codes for one bucket of 8-bit codes into float32, with a finite step: a
 * loop with no packer state carried from one code to the next, which the compiler
 * vectorises (four doubles at a time with AVX2, chosen at load time). The sign is
 * set on the rounded magnitude, which is the rounded signed value since rounding to
 * nearest is symmetric; a NaN step would differ (its sign passes through the product
 * unchanged), which is why it takes the general loop. Returns nonzero when a code is 1. */
WITH_AVX2_CLONE
static unsigned dequantize_bytes(const uint8_t *restrict data, Py_ssize_t count, double step,
                                 float *restrict out)
{
    unsigned bad = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t code = data[i];
        bad |= code == 1;
        float magnitude = (float)((double)(int32_t)(code >> 1) * step);
        uint32_t bits;
        memcpy(&bits, &magnitude, sizeof bits);
        bits |= code << 31;
        memcpy(out + i, &bits, sizeof bits);
    }
    return bad;
}


/* MurmurHash3 x86_32 of the 4-byte little-endian key `key` (deepreduce.codecs._murmur):
 * value i's dither is its top 24 bits over 2**24, with key i and the call's seed. A
 * hash of (seed, i) instead of a generator's stream keeps values independent of one
 * another, so the loop below vectorises, and numpy computes the same draws whole-array. */
static inline uint32_t murmur_key32(uint32_t key, uint32_t seed)
{
    uint32_t k = key * 0xCC9E2D51u;
    k = (k << 15 | k >> 17) * 0x1B873593u;
    uint32_t h = seed ^ k;
    h = (h << 13 | h >> 19) * 5u + 0xE6546B64u;
    h ^= 4u;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ h >> 16;
}

/* Codes of values[start:start + count] in a bucket with a positive finite norm:
 * a = |x| * (levels / norm) + dither in double, level min(floor(a), levels), code
 * 2 * level + (x < 0 and level > 0). One format per call, so each loop vectorises. */
#define CODE_LOOP(type)                                                                     \
    for (Py_ssize_t j = 0; j < count; j++) {                                                \
        double x = (double)((const type *)values)[start + j];                               \
        double dither = (double)(int32_t)(murmur_key32((uint32_t)(start + j), seed) >> 8) * 0x1p-24; \
        /* a >= 0 and below levels + 1: truncation is numpy's floor */                      \
        int level = (int)(fabs(x) * factor + dither);                                       \
        level = level < levels ? level : levels;                                            \
        codes[j] = (uint8_t)(level << 1 | ((x < 0) & (level > 0)));                         \
    }

WITH_AVX2_CLONE
static void bucket_codes(const void *values, char format, Py_ssize_t start, Py_ssize_t count,
                         double factor, int levels, uint32_t seed, uint8_t *restrict codes)
{
    if (format == 'f')
        CODE_LOOP(float)
    else
        CODE_LOOP(double)
}

/* Codes are made a chunk at a time, so that packing and the received values read them
 * from the L1 cache. */
#define CHUNK 1024

static void quantize_values(const void *values, char format, uint32_t seed, float *norms,
                            int find_peaks, Shape shape, uint8_t *packed, void *received,
                            char received_format)
{
    Packer packer = {packed, 0, 0};
    uint8_t codes[CHUNK];
    for (Py_ssize_t start = 0; start < shape.count; start += shape.bucket) {
        Py_ssize_t end = start + shape.bucket < shape.count ? start + shape.bucket
                                                            : shape.count;
        Py_ssize_t b = start / shape.bucket;
        if (find_peaks)
            norms[b] = bucket_peak(values, format, start, end);
        double norm = norms[b];
        int usable = isfinite(norm) && norm > 0;
        double factor = usable ? shape.levels / norm : 0.0;
        double step = norm / shape.levels;
        for (Py_ssize_t from = start; from < end; from += CHUNK) {
            Py_ssize_t count = end - from < CHUNK ? end - from : CHUNK;
            if (usable)
                bucket_codes(values, format, from, count, factor, shape.levels, seed, codes);
            else
                memset(codes, 0, (size_t)count);
            if (shape.bits == 8) {
                memcpy(packer.out, codes, (size_t)count);
                packer.out += count;
            } else {
                for (Py_ssize_t j = 0; j < count; j++)
                    put_code(&packer, codes[j], shape.bits);
            }
            if (received == NULL)
                continue;
            if (usable && received_format == 'f')  /* a finite step: the vectorised loop */
                dequantize_bytes(codes, count, step, (float *)received + from);
            else
                for (Py_ssize_t j = 0; j < count; j++)
                    store_received(received, received_format, from + j, codes[j], step);
        }
    }
    flush_codes(&packer);
}

/* Whether every code is canonical (none is 1). */
static int dequantize_codes(const uint8_t *data, const float *norms, Shape shape, void *out,
                            char out_format)
{
    Unpacker unpacker = {data, 0, 0};
    unsigned bad = 0;
    for (Py_ssize_t start = 0; start < shape.count; start += shape.bucket) {
        Py_ssize_t end = start + shape.bucket < shape.count ? start + shape.bucket
                                                            : shape.count;
        double step = (double)norms[start / shape.bucket] / shape.levels;
        if (shape.bits == 8 && out_format == 'f' && isfinite(step)) {
            bad |= dequantize_bytes(unpacker.in, end - start, step, (float *)out + start);
            unpacker.in += end - start;
            continue;
        }
        for (Py_ssize_t i = start; i < end; i++) {
            unsigned code = shape.bits == 8 ? *unpacker.in++ : get_code(&unpacker, shape.bits);
            bad |= code == 1;
            store_received(out, out_format, i, code, step);
        }
    }
    return !bad;
}

/* ------------------------------------------------------------ Python */

/* Checks bucket and bits, and sets the levels they give: 2**(bits-1) - 1. */
static int check_shape(Shape *shape)
{
    if (shape->bucket < 1 || shape->bits < MIN_BITS || shape->bits > MAX_BITS) {
        PyErr_Format(PyExc_ValueError, "bad shape: bucket %zd, bits %d (bucket >= 1, bits "
                     "in [%d, %d])", shape->bucket, shape->bits, MIN_BITS, MAX_BITS);
        return -1;
    }
    shape->levels = (1 << (shape->bits - 1)) - 1;
    return 0;
}

static Py_ssize_t bucket_count(const Shape *shape)
{
    return shape->count / shape->bucket + (shape->count % shape->bucket != 0);
}

static Py_ssize_t packed_size(const Shape *shape)
{
    return (shape->count / 8) * shape->bits + ((shape->count % 8) * shape->bits + 7) / 8;
}

static PyObject *quantize(PyObject *module, PyObject *args)
{
    PyObject *values_object, *norms_object, *received_object;
    Shape shape;
    unsigned int seed;
    int find_peaks;
    (void)module;
    if (!PyArg_ParseTuple(args, "OniIOpO:quantize", &values_object, &shape.bucket,
                          &shape.bits, &seed, &norms_object, &find_peaks,
                          &received_object) || check_shape(&shape) < 0)
        return NULL;
    Py_buffer values, norms, received = {0};
    char format, received_format = 0;
    if (get_floats(values_object, "values", &values, 0, -1, 0, &format) < 0)
        return NULL;
    shape.count = values.len / values.itemsize;
    PyObject *result = NULL;
    if (get_floats(norms_object, "norms", &norms, 'f', bucket_count(&shape), 1, NULL) < 0)
        goto release_values;
    if (received_object != Py_None && get_floats(received_object, "received", &received, 0,
                                                 shape.count, 1, &received_format) < 0)
        goto release_norms;
    result = PyBytes_FromStringAndSize(NULL, packed_size(&shape));
    if (result != NULL) {
        uint8_t *packed = (uint8_t *)PyBytes_AS_STRING(result);
        Py_BEGIN_ALLOW_THREADS
        quantize_values(values.buf, format, (uint32_t)seed, norms.buf, find_peaks, shape,
                        packed, received.buf, received_format);
        Py_END_ALLOW_THREADS
    }
    if (received_object != Py_None)
        PyBuffer_Release(&received);
release_norms:
    PyBuffer_Release(&norms);
release_values:
    PyBuffer_Release(&values);
    return result;
}

static PyObject *dequantize(PyObject *module, PyObject *args)
{
    PyObject *norms_object, *out_object;
    Py_buffer data, norms, out;
    Shape shape;
    char out_format;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*OniO:dequantize", &data, &norms_object, &shape.bucket,
                          &shape.bits, &out_object))
        return NULL;
    PyObject *result = NULL;
    if (check_shape(&shape) < 0
            || get_floats(out_object, "out", &out, 0, -1, 1, &out_format) < 0)
        goto release_data;
    shape.count = out.len / out.itemsize;
    if (data.len < packed_size(&shape)) {
        PyErr_Format(PyExc_ValueError, "data holds %zd bytes, %zd codes need %zd", data.len,
                     shape.count, packed_size(&shape));
        goto release_out;
    }
    if (get_floats(norms_object, "norms", &norms, 'f', bucket_count(&shape), 0, NULL) < 0)
        goto release_out;
    int canonical;
    Py_BEGIN_ALLOW_THREADS
    canonical = dequantize_codes(data.buf, norms.buf, shape, out.buf, out_format);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(canonical);
    PyBuffer_Release(&norms);
release_out:
    PyBuffer_Release(&out);
release_data:
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"quantize", quantize, METH_VARARGS,
     "quantize(values, bucket, bits, seed, norms, find_peaks, received) -> bytes\n\n"
     "QSGD's packed codes of values (float32 or float64) with the dither of seed,\n"
     "finding each bucket's norm (find_peaks) or reading it from norms (float32), and\n"
     "the dequantised values into received (None, or float32 or float64). See\n"
     "deepreduce.codecs.values.qsgd."},
    {"dequantize", dequantize, METH_VARARGS,
     "dequantize(data, norms, bucket, bits, out) -> bool\n\n"
     "The values of the len(out) codes packed in data, into out (float32 or float64);\n"
     "False when a code is 1. See deepreduce.codecs.values.qsgd."},
    {NULL, NULL, 0, NULL},
};

DEFINE_MODULE(_qsgd, "deepreduce.codecs.values._qsgd",
              "Compiled loops of the QSGD value codec (see deepreduce.codecs.values.qsgd).", 0)
