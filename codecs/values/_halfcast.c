/*
 * Compiled float32 <-> IEEE float16 casts of the fp16 value codec
 * (deepreduce.codecs.values.floats.Float16Values), with the F16C instructions of x86-64.
 *
 * numpy casts to and from float16 one value at a time with integer arithmetic, and
 * every value a rank sends is cast three times (narrowed and widened again by the
 * sender for its residual, widened by each receiver). F16C converts eight values per
 * instruction (benchmarks/index_codecs.py times the codec).
 *
 *   to_half(values, out)
 *
 * values: a C-contiguous one-dimensional float32 array; out: a writable uint16 array
 * of the same length. out gets the float16 bits of each value rounded to nearest
 * even, finite values beyond +-65504 saturated to +-65504 (the codec's rule), the
 * infinities kept, and NaN as numpy casts it: the sign, 0x7c00 plus the top ten
 * significand bits, 0x7c01 when those are all zero.
 *
 *   to_single(halves, out)
 *
 * halves: a C-contiguous one-dimensional uint16 array of float16 bits; out: a
 * writable float32 array of the same length, which gets their exact values (a NaN
 * keeps its significand bits, shifted up, as numpy's cast does).
 *
 * Both give numpy's bits for every input (the tests compare them); F16C differs
 * only in quieting signalling NaNs, so the lanes of a block that holds a NaN are
 * redone one by one. The rounding mode is the instruction's own, and the conversions
 * ignore MXCSR's flush-to-zero and denormals-are-zero (TensorFlow's threads set them;
 * the tests check it). Without F16C (or off x86-64) the import fails and the codec
 * uses numpy. The loops run without the GIL.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_buffer.h"
#include <stdint.h>
#include <string.h>

/* Casts of fewer values keep the GIL (see RELEASED_BEGIN): handing it to another thread
 * and back costs more than casting them. Narrowing rounds and saturates; widening is
 * exact and takes a fraction of narrowing's time a value, so it keeps the GIL up to
 * eight times as many values. */
#define RELEASE_NARROW (1 << 14)
#define RELEASE_WIDEN (1 << 17)

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define HAVE_F16C 1
#include <immintrin.h>
#endif

#ifdef HAVE_F16C

#define TARGET __attribute__((target("avx,f16c")))

/* numpy's float16 bits of the NaN with float32 bits `bits`. */
static uint16_t nan_to_half(uint32_t bits)
{
    uint16_t half = (uint16_t)(0x7c00u + ((bits & 0x007fffffu) >> 13));
    return (uint16_t)(((bits >> 16) & 0x8000u) | (half == 0x7c00u ? 0x7c01u : half));
}

/* numpy's float32 bits of the float16 NaN `half`. */
static uint32_t nan_to_single(uint16_t half)
{
    return ((uint32_t)(half & 0x8000u) << 16) | 0x7f800000u | ((uint32_t)(half & 0x03ffu) << 13);
}

TARGET static void narrow(const float *values, uint16_t *out, Py_ssize_t n)
{
    const __m256 limit = _mm256_set1_ps(65504.0f), low = _mm256_set1_ps(-65504.0f);
    const __m256 infinity = _mm256_set1_ps(INFINITY);
    const __m256 magnitude_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(values + i);
        __m256 finite = _mm256_cmp_ps(_mm256_and_ps(x, magnitude_mask), infinity, _CMP_LT_OQ);
        __m256 clamped = _mm256_min_ps(_mm256_max_ps(x, low), limit);
        x = _mm256_blendv_ps(x, clamped, finite);
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
        int nans = _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        for (int lane = 0; nans; lane++, nans >>= 1)
            if (nans & 1) {
                uint32_t bits;
                memcpy(&bits, values + i + lane, sizeof bits);
                out[i + lane] = nan_to_half(bits);
            }
    }
    for (; i < n; i++) {  /* the tail, one value at a time through the same instruction */
        uint32_t bits;
        memcpy(&bits, values + i, sizeof bits);
        float x = values[i];
        if ((bits & 0x7fffffffu) > 0x7f800000u) {
            out[i] = nan_to_half(bits);
            continue;
        }
        if ((bits & 0x7fffffffu) < 0x7f800000u)
            x = x > 65504.0f ? 65504.0f : x < -65504.0f ? -65504.0f : x;
        out[i] = (uint16_t)_mm_extract_epi16(
            _mm_cvtps_ph(_mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT), 0);
    }
}

TARGET static void widen(const uint16_t *halves, float *out, Py_ssize_t n)
{
    const __m128i magnitude_mask = _mm_set1_epi16(0x7fff), infinity = _mm_set1_epi16(0x7c00);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(halves + i));
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
        __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, magnitude_mask), infinity);
        int nans = _mm_movemask_epi8(nan);
        for (int lane = 0; nans; lane++, nans >>= 2)
            if (nans & 1) {
                uint32_t bits = nan_to_single(halves[i + lane]);
                memcpy(out + i + lane, &bits, sizeof bits);
            }
    }
    for (; i < n; i++) {
        if ((halves[i] & 0x7fffu) > 0x7c00u) {
            uint32_t bits = nan_to_single(halves[i]);
            memcpy(out + i, &bits, sizeof bits);
        }
        else
            out[i] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(halves[i])));
    }
}

#endif /* HAVE_F16C */

/* ------------------------------------------------------------ arguments */

/* Parses args (`format`: two objects) into `source` (codes source_codes, items of
 * source_size bytes) and the writable `target` (target_codes, target_size bytes) of
 * the same length, or raises `usage` as a TypeError. */
static int get_pair(PyObject *args, const char *format, Py_buffer *source, Py_buffer *target,
                    const char *source_codes, Py_ssize_t source_size,
                    const char *target_codes, Py_ssize_t target_size, const char *usage)
{
    PyObject *source_object, *target_object;
    if (!PyArg_ParseTuple(args, format, &source_object, &target_object)
            || PyObject_GetBuffer(source_object, source, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (PyObject_GetBuffer(target_object, target, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT
                           | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(source);
        return -1;
    }
    char s = native_item_code(source), t = native_item_code(target);
    if (source->ndim != 1 || !s || !strchr(source_codes, s) || source->itemsize != source_size
            || target->ndim != 1 || !t || !strchr(target_codes, t)
            || target->itemsize != target_size
            || source->len / source_size != target->len / target_size) {
        PyErr_SetString(PyExc_TypeError, usage);
        PyBuffer_Release(source);
        PyBuffer_Release(target);
        return -1;
    }
    return 0;
}

/* Releases both buffers of get_pair; None. */
static PyObject *release_pair(Py_buffer *source, Py_buffer *target)
{
    PyBuffer_Release(source);
    PyBuffer_Release(target);
    Py_RETURN_NONE;
}

static PyObject *to_half(PyObject *module, PyObject *args)
{
    Py_buffer values, out;
    (void)module;
    if (get_pair(args, "OO:to_half", &values, &out, "f", 4, "HhBe", 2,
                 "to_half takes a one-dimensional float32 array and a writable 2-byte "
                 "array of the same length") < 0)
        return NULL;
#ifdef HAVE_F16C
    RELEASED_BEGIN(values.len / 4, RELEASE_NARROW)
    narrow(values.buf, out.buf, values.len / 4);
    RELEASED_END
#endif
    return release_pair(&values, &out);
}

static PyObject *to_single(PyObject *module, PyObject *args)
{
    Py_buffer halves, out;
    (void)module;
    if (get_pair(args, "OO:to_single", &halves, &out, "Hhe", 2, "f", 4,
                 "to_single takes a one-dimensional 2-byte array and a writable float32 "
                 "array of the same length") < 0)
        return NULL;
#ifdef HAVE_F16C
    RELEASED_BEGIN(halves.len / 2, RELEASE_WIDEN)
    widen(halves.buf, out.buf, halves.len / 2);
    RELEASED_END
#endif
    return release_pair(&halves, &out);
}

static PyMethodDef methods[] = {
    {"to_half", to_half, METH_VARARGS,
     "to_half(values, out)\n\nWrite into out (uint16) the float16 bits of the float32 "
     "values, rounded to\nnearest even, finite values saturated to +-65504; numpy's "
     "bits for NaN."},
    {"to_single", to_single, METH_VARARGS,
     "to_single(halves, out)\n\nWrite into out (float32) the exact values of the float16 "
     "bits in halves;\nnumpy's bits for NaN."},
    {NULL, NULL, 0, NULL},
};

/* 0 where the processor has F16C (and the AVX it comes with), else -1 with an
 * ImportError: the codec then casts with numpy. */
static int check_processor(void)
{
#ifdef HAVE_F16C
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c"))
        return 0;
#endif
    PyErr_SetString(PyExc_ImportError, "deepreduce.codecs.values._halfcast needs an x86-64 processor "
                    "with F16C; the fp16 codec casts with numpy instead");
    return -1;
}

DEFINE_MODULE(_halfcast, "deepreduce.codecs.values._halfcast",
              "float32 <-> float16 casts with F16C (deepreduce.codecs.values.floats.Float16Values).",
              check_processor())
