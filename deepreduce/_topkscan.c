/*
 * Compiled candidate scan and selection of deepreduce's Top-k sparsifier
 * (deepreduce.sparsifiers.TopK), and the chunk-wise Top-k's selection (ChunkTopK).
 *
 * TopK estimates a threshold from a sample and then needs every position whose
 * magnitude reaches it: about 1-2% of a gradient. numpy does that in three passes
 * per slice (abs, compare, flatnonzero), each writing a temporary; here one pass
 * reads the values once, 64 at a time into a mask of hits, and writes only the
 * positions found. The numpy code (sparsifiers._at_least) stays as the fallback
 * when this module is not built; both give the same positions, and the tests
 * compare them.
 *
 *   at_least(values, low, addend=None) -> numpy int64 array
 *
 * the positions i, increasing, where fabs(values[i]) >= low, values a C-contiguous
 * one-dimensional float32 or float64 buffer. low is compared in the values' own
 * precision (rounded to float for float32; the caller passes a value of that type,
 * so nothing is rounded). NaN values never qualify, and a NaN low selects nothing,
 * as IEEE comparisons have it. The pass runs without the GIL, so other Python
 * threads (Horovod's) keep going.
 *
 * With an addend (same type and length, C-contiguous), values must be writable and
 * the pass first adds it in, values[i] += addend[i], one IEEE addition in the
 * values' type as numpy's add does, and tests the sums: error feedback adds the
 * gradient into the residual and Top-k scans the result, and doing both block by
 * block, while the block is in the L1 cache, reads the residual from memory once
 * instead of twice.
 *
 *   largest_at_least(values, low, k, addend=None) -> (positions, selected) or None
 *
 * the same scan (and addition), then the k positions of largest fabs(values) among
 * those found, increasing, as a numpy int64 array, and the values there (after the
 * addition), as an array of the values' dtype; ties at the k-th magnitude go to the
 * lowest positions, as sparsifiers._largest has it. None when fewer than k values
 * reach low. The scan keeps each hit's value and magnitude bits while the block is
 * in the L1 cache, and a radix select on the bits finds the k-th: where numpy
 * gathers the candidates from a gradient that has left the cache and partitions
 * them, this costs two short passes over the hits, and the selected values need no
 * second gather.
 *
 *   sampled_low(values, k, count, seed, addend=None) -> float
 *
 * the threshold those scans take: the magnitude that about k plus a margin of the
 * values (plus the addend's, summed in the values' type, values left unchanged)
 * reach, estimated from count of them, one drawn at random in each of count equal
 * strata (the draws come from seed). The (count - j)-th smallest of the sampled
 * magnitudes, NaN counting as -inf, where j is the expected count of the top k in
 * the sample plus four standard deviations plus 2, at most count: the rule of
 * TopK's numpy code, which stays as the fallback and draws its own positions. On
 * the tensors of 16K-64K values a model has dozens of, the sample cost more than
 * the scan when numpy drew, gathered, added and partitioned it in eight calls.
 *
 *   chunk_largest(values, k, chunk, side, columns) -> numpy int64 array
 *
 * the dense selection of the chunk-wise Top-k (deepreduce.sparsifiers.ChunkTopK):
 * in every chunk the k positions of largest fabs(values), NaN lowest, ties to the
 * lowest positions (a chunk of at most k values is kept whole), all of them
 * increasing. The chunks are consecutive runs of chunk values when side is 0, else
 * the side x side tiles (chunk == side * side) of the matrix whose rows hold
 * columns values. One pass per chunk reads its values (a tile row by row) into
 * their magnitude keys and counts a histogram of the keys' top bits; a radix
 * select on the keys of the bin that holds the k-th largest finds it, and a last
 * pass over the keys writes the positions. numpy's form (ChunkTopK._select_dense,
 * the fallback) pays for an abs, a transposing copy of the tiles, a partition of
 * every row, masks and flatnonzero, each a pass over the whole tensor.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_buffer.h"
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
 * memory reads in flight than the hardware's own prefetch does, which is what a
 * gradient that is not in cache waits on; the distance matters little from 1 to
 * 16 KB ahead. */
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

/* GCC and clang compile an AVX2 block beside the SSE2 one, taken when the processor
 * has AVX2 (see use_avx2). */
#if SSE2_SCAN && (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define AVX2_SCAN 1
#include <immintrin.h>
#define AVX2_TARGET __attribute__((target("avx2")))
#else
#define AVX2_SCAN 0
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

/* Keys that order magnitudes, from a value's bits: with the sign cleared, the bits
 * of a float grow with its magnitude; NaN (bits above infinity's) gets 0, below
 * every number, and the numbers their bits plus one. */
static inline uint64_t key_32(uint32_t bits)
{
    bits &= 0x7fffffffu;
    return bits > 0x7f800000u ? 0 : (uint64_t)bits + 1;
}

static inline uint64_t key_64(uint64_t bits)
{
    bits &= 0x7fffffffffffffffull;
    return bits > 0x7ff0000000000000ull ? 0 : bits + 1;
}

/* What a scan found: the positions and the values there, with room for `capacity`
 * of each, values of up to 8 bytes (raw memory: it is grown without the GIL). */
typedef struct {
    int64_t *position;
    char *value;
    Py_ssize_t capacity;
} Hits;

#define MAX_ITEMSIZE 8

/* Room for `needed` hits, doubling up to `limit`, the values' count, which no result
 * exceeds; 0, or -1 when an allocation fails (what the buffers held is kept). Values
 * are at least 4 bytes, so 2 * limit positions cannot overflow a size. */
static int reserve(Hits *hits, Py_ssize_t needed, Py_ssize_t limit)
{
    if (needed <= hits->capacity)
        return 0;
    Py_ssize_t grown = 2 * hits->capacity < limit ? 2 * hits->capacity : limit;
    grown = grown > needed ? grown : needed;
    int64_t *position = PyMem_RawRealloc(hits->position, (size_t)grown * sizeof *position);
    if (position == NULL)
        return -1;
    hits->position = position;
    char *value = PyMem_RawRealloc(hits->value, (size_t)grown * MAX_ITEMSIZE);
    if (value == NULL)
        return -1;
    hits->value = value;
    hits->capacity = grown;
    return 0;
}

/* The buffers of the last scan, lent to the next one. A large gradient's hits fill
 * about a megabyte, and memory fresh from the allocator costs a page fault at the
 * first write to each page: more than the scan's own stores. One slot, taken and
 * given back while holding the GIL, so scans running together each have their own
 * buffers; a slot larger than SPARE_CAPACITY hits is not kept. */
static Hits spare;
#define SPARE_CAPACITY ((Py_ssize_t)1 << 20)

/* Buffers for at least `capacity` hits (of at most `limit`): the spare ones when
 * there are; 0, or -1 when an allocation fails. Called with the GIL held. */
static int borrow_hits(Hits *hits, Py_ssize_t capacity, Py_ssize_t limit)
{
    *hits = spare;
    spare = (Hits){NULL, NULL, 0};
    return reserve(hits, capacity < limit ? capacity : limit, limit);
}

/* Ends a scan's use of `hits`: they become the spare buffers, or are freed. Called
 * with the GIL held. */
static void return_hits(Hits *hits)
{
    if (spare.position == NULL && spare.value == NULL && hits->capacity <= SPARE_CAPACITY) {
        spare = *hits;
        return;
    }
    PyMem_RawFree(hits->position);
    PyMem_RawFree(hits->value);
}

/* The scan for one value type. Each block's hits are written without a branch on
 * whether there is one (the position and value of the lowest hit, or junk, are
 * stored, and the count advances by one or zero): at Top-1% about half the blocks
 * hold one and few hold three, and a branch on "any hit" would be mispredicted about
 * once per candidate. ORing the top bit gives LOWEST_BIT a defined input when the
 * mask is empty. The values are kept while the block is in the L1 cache; reading
 * them later from a gradient that has left it costs more than the scan (one cache
 * miss each). The last values (fewer than a block) go one by one. Returns the
 * number of hits, or -1 when the output could not grow. */
#define TAKE_LOWEST(type)                                                              \
    do {                                                                               \
        int bit = LOWEST_BIT(mask | (1ull << 63));                                     \
        hits->position[found] = (int64_t)(base + bit);                                 \
        ((type *)hits->value)[found] = value[base + bit];                              \
        found += mask != 0;                                                            \
        mask &= mask - 1;                                                              \
    } while (0)

/* One block's addition (with an addend) and test, as one step of the scan: the
 * values are added in and tested while they are in registers or the L1 cache. */
#define DEFINE_BLOCK(name, type, block_hits)                                           \
    static inline uint64_t name(type *block, const type *addend, type low)             \
    {                                                                                  \
        if (addend)                                                                    \
            for (int i = 0; i < BLOCK; i++)                                            \
                block[i] += addend[i];                                                 \
        return block_hits(block, low);                                                 \
    }

DEFINE_BLOCK(float_block, float, float_hits)
DEFINE_BLOCK(double_block, double, double_hits)

#define DEFINE_SCAN(name, type, absolute, block_step, attributes)                      \
    attributes static Py_ssize_t name(type *value, const type *addend, Py_ssize_t count, \
                                      type low, Hits *hits)                            \
    {                                                                                  \
        const Py_ssize_t ahead = PREFETCH_BYTES / (Py_ssize_t)sizeof(type);            \
        Py_ssize_t found = 0, base = 0;                                                \
        for (; base + BLOCK <= count; base += BLOCK) {                                 \
            if (base + ahead + BLOCK <= count)                                         \
                for (size_t line = 0; line < BLOCK * sizeof(type); line += CACHE_LINE) { \
                    PREFETCH((const char *)(value + base + ahead) + line);             \
                    if (addend)                                                        \
                        PREFETCH((const char *)(addend + base + ahead) + line);        \
                }                                                                      \
            uint64_t mask = block_step(value + base, addend ? addend + base : NULL, low); \
            if (reserve(hits, found + BLOCK, count) < 0)                               \
                return -1;                                                             \
            TAKE_LOWEST(type);                                                         \
            TAKE_LOWEST(type);                                                         \
            while (mask)                                                               \
                TAKE_LOWEST(type);                                                     \
        }                                                                              \
        for (; base < count; base++) {                                                 \
            if (addend)                                                                \
                value[base] += addend[base];                                           \
            if (absolute(value[base]) >= low) {                                        \
                if (reserve(hits, found + 1, count) < 0)                               \
                    return -1;                                                         \
                hits->position[found] = (int64_t)base;                                 \
                ((type *)hits->value)[found] = value[base];                            \
                found++;                                                               \
            }                                                                          \
        }                                                                              \
        return found;                                                                  \
    }

DEFINE_SCAN(scan_float, float, fabsf, float_block, )
DEFINE_SCAN(scan_double, double, fabs, double_block, )

#if AVX2_SCAN
/* The float32 block on AVX2 processors (checked at import): eight lanes a compare,
 * the addition fused in, one movemask per eight values; the same IEEE additions and
 * ordered compares as above, so the same hits and sums bit for bit, in a quarter
 * less time or more on gradients that are in cache (on larger ones the pass is
 * bound by memory, and the gain is smaller). */
AVX2_TARGET static inline uint64_t float_block_avx2(float *block, const float *addend,
                                                    float low)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), limit = _mm256_set1_ps(low);
    uint64_t mask = 0;
    for (int j = 0; j < BLOCK; j += 8) {
        __m256 x = _mm256_loadu_ps(block + j);
        if (addend) {
            x = _mm256_add_ps(x, _mm256_loadu_ps(addend + j));
            _mm256_storeu_ps(block + j, x);
        }
        __m256 hit = _mm256_cmp_ps(_mm256_andnot_ps(sign, x), limit, _CMP_GE_OQ);
        mask |= (uint64_t)(uint32_t)_mm256_movemask_ps(hit) << j;
    }
    return mask;
}

DEFINE_SCAN(scan_float_avx2, float, fabsf, float_block_avx2, AVX2_TARGET)
#endif

/* Whether the float32 scan takes its AVX2 block: set at import where the processor
 * has AVX2; _set_avx2 lets the tests run both blocks on such a machine. */
static int use_avx2;

static Py_ssize_t scan_float_any(float *value, const float *addend, Py_ssize_t count,
                                 float low, Hits *hits)
{
#if AVX2_SCAN
    if (use_avx2)
        return scan_float_avx2(value, addend, count, low, hits);
#endif
    return scan_float(value, addend, count, low, hits);
}

/* ------------------------------------------------------------ the k largest hits */

/* Bits of the keys the selection compares at a time: Top-1% candidates of a
 * Gaussian span about 24 bits of keys, two digits of 12 (digits of 11 would take
 * a third pass over the candidates); the histogram's 32 KB stay in L1. */
#define DIGIT_BITS 12

/* The key of the k-th largest of the keys of value[0..count) (1 <= k <= count),
 * and in *ties how many keys equal to it belong to the k largest.
 *
 * A radix select on the digits of key - smallest key: Top-k's candidates all lie a
 * little above a threshold, so their keys share their top bits, and a first digit
 * taken from the keys' own range spreads them over all its bins. Each digit counts
 * the keys that share the digits found so far, rereading the values (a few hundred
 * KB, in the cache) rather than copying keys. One function per value width. */
#define DEFINE_KTH_LARGEST(name, bits_type, key_of)                                    \
    static uint64_t name(const bits_type *value, Py_ssize_t count, Py_ssize_t k,       \
                         Py_ssize_t *ties)                                             \
    {                                                                                  \
        uint64_t smallest = key_of(value[0]), largest = smallest;                      \
        for (Py_ssize_t i = 1; i < count; i++) {                                       \
            uint64_t key = key_of(value[i]);                                           \
            smallest = key < smallest ? key : smallest;                                \
            largest = key > largest ? key : largest;                                   \
        }                                                                              \
        int shift = 0;                                                                 \
        while (shift < 64 && (largest - smallest) >> shift)                            \
            shift++;                                                                   \
        Py_ssize_t rank = k;                                                           \
        uint64_t found = 0; /* the digits found so far, of key - smallest */           \
        while (shift > 0) {                                                            \
            int width = shift < DIGIT_BITS ? shift : DIGIT_BITS;                       \
            /* the digits already found */                                             \
            uint64_t above = shift == 64 ? 0 : ~0ull << shift;                         \
            shift -= width;                                                            \
            uint64_t mask = (1ull << width) - 1;                                       \
            Py_ssize_t histogram[1 << DIGIT_BITS] = {0};                               \
            for (Py_ssize_t i = 0; i < count; i++) {                                   \
                uint64_t key = key_of(value[i]) - smallest;                            \
                if ((key & above) == found)                                            \
                    histogram[(key >> shift) & mask]++;                                \
            }                                                                          \
            /* the digit of the rank-th largest, counting down from the top bin */     \
            uint64_t digit = mask;                                                     \
            while (histogram[digit] < rank) {                                          \
                rank -= histogram[digit];                                              \
                digit--;                                                               \
            }                                                                          \
            found |= digit << shift;                                                   \
        }                                                                              \
        *ties = rank;                                                                  \
        return found + smallest;                                                       \
    }

/* Writes to out, in order, the positions of the k hits of largest keys (ties: the
 * first ones), and their values' bits to selected: one function per value width, so
 * that each value is one move, not a call to memcpy. */
#define DEFINE_TAKE(name, bits_type, key_of, kth_largest)                              \
    static void name(const Hits *hits, Py_ssize_t count, Py_ssize_t k, int64_t *out,   \
                     bits_type *selected)                                              \
    {                                                                                  \
        const bits_type *value = (const bits_type *)hits->value;                       \
        Py_ssize_t ties, taken = 0;                                                    \
        uint64_t threshold = kth_largest(value, count, k, &ties);                      \
        for (Py_ssize_t i = 0; i < count && taken < k; i++) {                          \
            uint64_t key = key_of(value[i]);                                           \
            out[taken] = hits->position[i];                                            \
            selected[taken] = value[i];                                                \
            /* flags combined with & and |, not && and ||: the compiler then */        \
            /* branches on neither, which would mispredict on about half the hits */   \
            Py_ssize_t above = key > threshold, equal = key == threshold;              \
            taken += above | (equal & (ties > 0));                                     \
            ties -= equal;                                                             \
        }                                                                              \
    }

DEFINE_KTH_LARGEST(kth_largest_32, uint32_t, key_32)
DEFINE_KTH_LARGEST(kth_largest_64, uint64_t, key_64)
DEFINE_TAKE(take_largest_32, uint32_t, key_32, kth_largest_32)
DEFINE_TAKE(take_largest_64, uint64_t, key_64, kth_largest_64)

/* ------------------------------------------------------------ argument checks */

/* A C-contiguous one-dimensional float32 or float64 buffer (writable when asked),
 * else TypeError. */
static int get_values(PyObject *object, Py_buffer *view, char *format, int writable)
{
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT
                           | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Format(PyExc_TypeError, "values must be a C-contiguous%s buffer of float32 or "
                     "float64", writable ? ", writable" : "");
        return -1;
    }
    *format = native_float_code(view);
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

/* A new writable numpy array of `size` items of `dtype`, and its buffer in *view. */
static PyObject *new_array(Py_ssize_t size, const char *dtype, Py_buffer *view)
{
    PyObject *array = PyObject_CallFunction(numpy_empty, "ns", size, dtype);
    if (array != NULL && PyObject_GetBuffer(array, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        Py_CLEAR(array);
    return array;
}

/* The positions of the count hits (k < 0, a numpy int64 array) or the k largest of
 * them and their values (a tuple of two arrays, the values of `dtype`). */
static PyObject *found_arrays(const Hits *hits, Py_ssize_t count, Py_ssize_t k,
                              const char *dtype, Py_ssize_t itemsize)
{
    Py_buffer positions_view, values_view;
    PyObject *positions = new_array(k < 0 ? count : k, "int64", &positions_view);
    if (positions == NULL)
        return NULL;
    if (k < 0) {
        memcpy(positions_view.buf, hits->position, (size_t)count * sizeof *hits->position);
        PyBuffer_Release(&positions_view);
        return positions;
    }
    PyObject *values = new_array(k, dtype, &values_view);
    if (values == NULL) {
        PyBuffer_Release(&positions_view);
        Py_DECREF(positions);
        return NULL;
    }
    if (k > 0) {
        Py_BEGIN_ALLOW_THREADS
        if (itemsize == (Py_ssize_t)sizeof(uint32_t))
            take_largest_32(hits, count, k, positions_view.buf, values_view.buf);
        else
            take_largest_64(hits, count, k, positions_view.buf, values_view.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&positions_view);
    PyBuffer_Release(&values_view);
    PyObject *result = PyTuple_Pack(2, positions, values);
    Py_DECREF(positions);
    Py_DECREF(values);
    return result;
}

/* The scan of at_least and largest_at_least: k < 0 returns every hit, k >= 0 the k
 * largest (None when fewer than k values reach low). */
static PyObject *scan(PyObject *values_object, double low, Py_ssize_t k,
                      PyObject *addend_object)
{
    int adding = addend_object != Py_None;
    Py_buffer values, addend = {0};
    char format, addend_format;
    if (get_values(values_object, &values, &format, adding) < 0)
        return NULL;
    Py_ssize_t count = values.len / values.itemsize;
    if (adding) {
        if (get_values(addend_object, &addend, &addend_format, 0) < 0) {
            PyBuffer_Release(&values);
            return NULL;
        }
        if (addend_format != format || addend.len != values.len) {
            PyErr_SetString(PyExc_TypeError, "addend must have the values' dtype and length");
            PyBuffer_Release(&addend);
            PyBuffer_Release(&values);
            return NULL;
        }
    }
    Hits hits;
    Py_ssize_t found = -1;
    if (borrow_hits(&hits, (count >> FIRST_CAPACITY_SHIFT) + MIN_CAPACITY, count) == 0) {
        Py_BEGIN_ALLOW_THREADS
        found = format == 'f' ? scan_float_any(values.buf, addend.buf, count, (float)low, &hits)
                              : scan_double(values.buf, addend.buf, count, low, &hits);
        Py_END_ALLOW_THREADS
    }
    PyObject *result = NULL;
    if (found < 0)
        PyErr_NoMemory();
    else if (found < k) {
        Py_INCREF(Py_None);
        result = Py_None;
    }
    else
        result = found_arrays(&hits, found, k, format == 'f' ? "float32" : "float64",
                              values.itemsize);
    return_hits(&hits);
    if (adding)
        PyBuffer_Release(&addend);
    PyBuffer_Release(&values);
    return result;
}

static PyObject *at_least(PyObject *module, PyObject *args)
{
    PyObject *values, *addend = Py_None;
    double low;
    (void)module;
    if (!PyArg_ParseTuple(args, "Od|O:at_least", &values, &low, &addend))
        return NULL;
    return scan(values, low, -1, addend);
}

static PyObject *largest_at_least(PyObject *module, PyObject *args)
{
    PyObject *values, *addend = Py_None;
    double low;
    Py_ssize_t k;
    (void)module;
    if (!PyArg_ParseTuple(args, "Odn|O:largest_at_least", &values, &low, &k, &addend))
        return NULL;
    if (k < 0) {
        PyErr_Format(PyExc_ValueError, "k must be >= 0, got %zd", k);
        return NULL;
    }
    return scan(values, low, k, addend);
}

/* ------------------------------------------------------------ the sampled threshold */

/* splitmix64: the next of a stream of well-mixed 64-bit values. */
static inline uint64_t next_random(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* The rank-th smallest (from 0) of a[0..n), reordering a; no NaN in a. */
static double select_rank(double *a, Py_ssize_t n, Py_ssize_t rank)
{
    Py_ssize_t lo = 0, hi = n - 1;
    while (lo < hi) {
        double pivot = a[lo + (hi - lo) / 2];
        Py_ssize_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot)
                i++;
            while (a[j] > pivot)
                j--;
            if (i <= j) {
                double swap = a[i];
                a[i++] = a[j];
                a[j--] = swap;
            }
        }
        if (rank <= j)
            hi = j;
        else if (rank >= i)
            lo = i;
        else
            return a[rank];  /* between the two parts: equal to the pivot */
    }
    return a[rank];
}

/* |value| as a double, NaN as -inf (it ranks lowest, as in sparsifiers._magnitudes). */
static inline double magnitude(double value)
{
    return isnan(value) ? -INFINITY : fabs(value);
}

static PyObject *sampled_low(PyObject *module, PyObject *args)
{
    PyObject *values_object, *addend_object = Py_None;
    Py_ssize_t k, count;
    unsigned long long seed;
    (void)module;
    if (!PyArg_ParseTuple(args, "OnnK|O:sampled_low", &values_object, &k, &count, &seed,
                          &addend_object))
        return NULL;
    int adding = addend_object != Py_None;
    Py_buffer values, addend = {0};
    char format, addend_format;
    if (get_values(values_object, &values, &format, 0) < 0)
        return NULL;
    Py_ssize_t n = values.len / values.itemsize;
    PyObject *result = NULL;
    double *sample = NULL;
    if (adding) {
        if (get_values(addend_object, &addend, &addend_format, 0) < 0)
            goto done;
        if (addend_format != format || addend.len != values.len) {
            PyErr_SetString(PyExc_TypeError, "addend must have the values' dtype and length");
            goto done;
        }
    }
    if (count < 1 || count > n || k < 0 || k > n) {
        PyErr_Format(PyExc_ValueError, "need 1 <= count <= n and 0 <= k <= n, got count=%zd, "
                     "k=%zd for n=%zd values", count, k, n);
        goto done;
    }
    sample = PyMem_Malloc((size_t)count * (sizeof *sample + sizeof(Py_ssize_t)));
    if (sample == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t stride = n / count;
    uint64_t state = seed;
    double low;
    /* the views hold the arrays' memory while other threads run */
    Py_BEGIN_ALLOW_THREADS
    /* positions first, each line asked for at once: the reads below then wait for
     * many cache misses together, not one after the other */
    Py_ssize_t *position = (Py_ssize_t *)(sample + count);
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t at = i * stride + (Py_ssize_t)(next_random(&state) % (uint64_t)stride);
        position[i] = at;
        PREFETCH((const char *)values.buf + at * values.itemsize);
        if (adding)
            PREFETCH((const char *)addend.buf + at * values.itemsize);
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t at = position[i];
        if (format == 'f') {
            float value = ((const float *)values.buf)[at];
            if (adding)
                value += ((const float *)addend.buf)[at];
            sample[i] = magnitude(value);
        }
        else {
            double value = ((const double *)values.buf)[at];
            if (adding)
                value += ((const double *)addend.buf)[at];
            sample[i] = magnitude(value);
        }
    }
    double expected = (double)count * (double)k / (double)n;
    double margin = expected + 4.0 * sqrt(expected) + 2.0;
    Py_ssize_t j = margin >= (double)count ? count : (Py_ssize_t)margin;
    low = select_rank(sample, count, count - j);
    Py_END_ALLOW_THREADS
    result = PyFloat_FromDouble(low);
done:
    PyMem_Free(sample);
    if (adding && addend.obj != NULL)
        PyBuffer_Release(&addend);
    PyBuffer_Release(&values);
    return result;
}

/* ------------------------------------------------------------ chunk-wise selection */

/* Most bits of key - smallest that one level of the chunk selection's radix select
 * counts: a histogram of 16 KB at most, in the L1 cache. */
#define CHUNK_DIGIT_BITS 11
/* Candidates this few are settled by an insertion sort: cheaper than another level. */
#define CHUNK_FEW 48

/* A float32's magnitude key (key_32) fits in a signed 32-bit integer, which the
 * vector units of every x86-64 processor compare; a float64's takes 64 bits. */
static inline int32_t chunk_key_32(uint32_t bits)
{
    int32_t magnitude = (int32_t)(bits & 0x7fffffffu);
    return magnitude > 0x7f800000 ? 0 : magnitude + 1;
}

/* Bit i of the result is set when key[i] >= low, for the BLOCK keys at key. */
static inline uint64_t keys_reaching_32(const int32_t *key, int32_t low)
{
#if SSE2_SCAN
    /* low >= 0 (keys are), so key >= low is key > low - 1, a signed compare */
    const __m128i limit = _mm_set1_epi32(low - 1);
#define REACHES(at) _mm_cmpgt_epi32(_mm_loadu_si128((const __m128i *)(key + (at))), limit)
    uint64_t mask = 0;
    for (int j = 0; j < BLOCK; j += 16)
        mask |= bits_of_16(REACHES(j), REACHES(j + 4), REACHES(j + 8), REACHES(j + 12)) << j;
#undef REACHES
    return mask;
#else
    uint64_t mask = 0;
    for (int i = 0; i < BLOCK; i++)
        mask |= (uint64_t)(key[i] >= low) << i;
    return mask;
#endif
}

static inline uint64_t keys_reaching_64(const uint64_t *key, uint64_t low)
{
    uint64_t mask = 0;
    for (int i = 0; i < BLOCK; i++)
        mask |= (uint64_t)(key[i] >= low) << i;
    return mask;
}

/* The rank-th largest (from 1) of candidate[0..count) (reordered), and in *ties how
 * many keys equal to it are among the rank largest. A radix select: each level
 * counts the candidates' digits of key - smallest, keeps those of the bin that holds
 * the rank-th and so narrows their range by the digit's bits; a 64-bit key takes
 * at most 6 levels of 11 bits, and the few candidates left are sorted. */
#define DEFINE_CHUNK_KTH(name, key_type)                                               \
    static key_type name(key_type *candidate, Py_ssize_t count, Py_ssize_t rank,       \
                         Py_ssize_t *histogram, Py_ssize_t *ties)                      \
    {                                                                                  \
        for (;;) {                                                                     \
            if (count <= CHUNK_FEW) {                                                  \
                for (Py_ssize_t i = 1; i < count; i++) { /* descending */              \
                    key_type key = candidate[i];                                       \
                    Py_ssize_t j = i;                                                  \
                    for (; j > 0 && candidate[j - 1] < key; j--)                       \
                        candidate[j] = candidate[j - 1];                               \
                    candidate[j] = key;                                                \
                }                                                                      \
                key_type kth = candidate[rank - 1];                                    \
                Py_ssize_t above = 0;                                                  \
                while (candidate[above] > kth)                                         \
                    above++;                                                           \
                *ties = rank - above;                                                  \
                return kth;                                                            \
            }                                                                          \
            key_type smallest = candidate[0], largest = candidate[0];                  \
            for (Py_ssize_t i = 1; i < count; i++) {                                   \
                smallest = candidate[i] < smallest ? candidate[i] : smallest;          \
                largest = candidate[i] > largest ? candidate[i] : largest;             \
            }                                                                          \
            /* about one candidate a bin: a histogram no larger than they need */     \
            int width = 1;                                                             \
            while (width < CHUNK_DIGIT_BITS && ((Py_ssize_t)1 << width) < count)       \
                width++;                                                               \
            key_type range = largest - smallest;                                       \
            int shift = 0;                                                             \
            while (shift < (int)(8 * sizeof(key_type)) && (range >> shift) >> width)   \
                shift++;                                                               \
            Py_ssize_t bins = (Py_ssize_t)(range >> shift) + 1;                        \
            memset(histogram, 0, (size_t)bins * sizeof *histogram);                    \
            for (Py_ssize_t i = 0; i < count; i++)                                     \
                histogram[(candidate[i] - smallest) >> shift]++;                       \
            Py_ssize_t digit = bins - 1;                                               \
            while (histogram[digit] < rank)                                            \
                rank -= histogram[digit--];                                            \
            if (shift == 0) { /* one key a bin: the rank-th is found */                \
                *ties = rank;                                                          \
                return smallest + (key_type)digit;                                     \
            }                                                                          \
            Py_ssize_t kept = 0;                                                       \
            for (Py_ssize_t i = 0; i < count; i++) {                                   \
                key_type key = candidate[i];                                           \
                candidate[kept] = key;                                                 \
                kept += (Py_ssize_t)((key - smallest) >> shift) == digit;              \
            }                                                                          \
            count = kept;                                                              \
        }                                                                              \
    }

DEFINE_CHUNK_KTH(chunk_kth_32, int32_t)
DEFINE_CHUNK_KTH(chunk_kth_64, uint64_t)

/* The buffers of one chunk selection: the chunk's keys in position order; the
 * candidates' keys, positions in the chunk and a copy of the keys that the radix
 * select reorders; a level's histogram; and, for tiles, each tile of a row of tiles'
 * kept positions within it and how many of them the merge has written. */
typedef struct {
    char *key;
    char *candidate;
    char *scratch;
    Py_ssize_t *position;
    Py_ssize_t *histogram;
    Py_ssize_t *kept;
    Py_ssize_t *cursor;
} ChunkBuffers;

/* out[0..k) gets the positions, increasing, of the k largest of key[0..length)
 * (1 <= k < length; ties to the first). The k-th largest is at least the smallest of
 * the largest keys of any k disjoint groups (they are k keys): with groups of
 * length / k consecutive keys, whose largest the vector units find, that bound
 * leaves a few times k candidates, the only keys that the radix select and the
 * last pass look at. */
#define DEFINE_CHUNK_SELECT(name, key_type, reaching, kth_of, attributes)              \
    attributes static void name(const ChunkBuffers *buffers, const key_type *key,      \
                                Py_ssize_t length, Py_ssize_t k, Py_ssize_t *out)      \
    {                                                                                  \
        Py_ssize_t group = length / k;                                                 \
        key_type low = key[0];                                                         \
        for (Py_ssize_t j = 0; j < k; j++) {                                           \
            const key_type *member = key + j * group;                                  \
            key_type largest = member[0];                                              \
            for (Py_ssize_t i = 1; i < group; i++)                                     \
                largest = member[i] > largest ? member[i] : largest;                   \
            low = j == 0 || largest < low ? largest : low;                             \
        }                                                                              \
        key_type *candidate = (key_type *)buffers->candidate;                          \
        Py_ssize_t *position = buffers->position, count = 0;                           \
        Py_ssize_t base = 0;                                                           \
        for (; base + BLOCK <= length; base += BLOCK)                                  \
            for (uint64_t mask = reaching(key + base, low); mask; mask &= mask - 1) {  \
                Py_ssize_t at = base + LOWEST_BIT(mask);                               \
                candidate[count] = key[at];                                            \
                position[count++] = at;                                                \
            }                                                                          \
        for (; base < length; base++) {                                                \
            candidate[count] = key[base];                                              \
            position[count] = base;                                                    \
            count += key[base] >= low;                                                 \
        }                                                                              \
        key_type *scratch = (key_type *)buffers->scratch;                              \
        memcpy(scratch, candidate, (size_t)count * sizeof *scratch);                   \
        Py_ssize_t ties, taken = 0;                                                    \
        key_type threshold = kth_of(scratch, count, k, buffers->histogram, &ties);     \
        for (Py_ssize_t i = 0; i < count && taken < k; i++) {                          \
            out[taken] = position[i];                                                  \
            Py_ssize_t above = candidate[i] > threshold, equal = candidate[i] == threshold; \
            taken += above | (equal & (ties > 0));                                     \
            ties -= equal;                                                             \
        }                                                                              \
    }

DEFINE_CHUNK_SELECT(chunk_select_32, int32_t, keys_reaching_32, chunk_kth_32, )
DEFINE_CHUNK_SELECT(chunk_select_64, uint64_t, keys_reaching_64, chunk_kth_64, )

/* The whole selection for one key width: flat chunks (side == 0) or tiles of side x
 * side in rows of `columns` values; the positions, increasing, into out, which holds
 * exactly as many as the chunks keep. */
#define DEFINE_CHUNK_LARGEST(name, key_type, bits_type, key_of, select, attributes)    \
    attributes static void name(const ChunkBuffers *buffers, const bits_type *value,   \
                                Py_ssize_t n, Py_ssize_t k, Py_ssize_t chunk,          \
                                Py_ssize_t side, Py_ssize_t columns, int64_t *out)     \
    {                                                                                  \
        key_type *key = (key_type *)buffers->key;                                      \
        Py_ssize_t written = 0;                                                        \
        if (side == 0) {                                                               \
            for (Py_ssize_t start = 0; start < n; start += chunk) {                    \
                Py_ssize_t length = n - start < chunk ? n - start : chunk;             \
                if (k >= length) { /* the last, shorter chunk may be kept whole */     \
                    for (Py_ssize_t i = 0; i < length; i++)                            \
                        out[written++] = start + i;                                    \
                    continue;                                                          \
                }                                                                      \
                for (Py_ssize_t i = 0; i < length; i++)                                \
                    key[i] = key_of(value[start + i]);                                 \
                select(buffers, key, length, k, buffers->kept);                        \
                for (Py_ssize_t i = 0; i < k; i++)                                     \
                    out[written++] = start + buffers->kept[i];                         \
            }                                                                          \
            return;                                                                    \
        }                                                                              \
        /* tiles: each row of tiles is selected tile by tile, then its positions are */ \
        /* merged row by row of values, so that they come out increasing */           \
        Py_ssize_t across = columns / side;                                            \
        for (Py_ssize_t top = 0; top < n; top += side * columns) {                     \
            for (Py_ssize_t tile = 0; tile < across; tile++) {                         \
                for (Py_ssize_t row = 0; row < side; row++) {                          \
                    const bits_type *from = value + top + row * columns + tile * side; \
                    for (Py_ssize_t i = 0; i < side; i++)                              \
                        key[row * side + i] = key_of(from[i]);                         \
                }                                                                      \
                /* the next tile's rows lie a row of the matrix apart, in different */ \
                /* pages, where the hardware's prefetch does not follow: asked for */ \
                /* now, they arrive while this tile is selected */                    \
                Py_ssize_t next = tile + 1 < across ? top + (tile + 1) * side           \
                                                    : top + side * columns;            \
                if (next < n)                                                          \
                    for (Py_ssize_t row = 0; row < side; row++)                        \
                        for (size_t line = 0; line < side * sizeof *value;             \
                             line += CACHE_LINE)                                       \
                            PREFETCH((const char *)(value + next + row * columns) + line); \
                select(buffers, key, chunk, k, buffers->kept + tile * k);              \
                buffers->cursor[tile] = 0;                                             \
            }                                                                          \
            for (Py_ssize_t row = 0; row < side; row++) {                              \
                Py_ssize_t row_end = (row + 1) * side;                                 \
                for (Py_ssize_t tile = 0; tile < across; tile++) {                     \
                    const Py_ssize_t *kept = buffers->kept + tile * k;                 \
                    Py_ssize_t at = buffers->cursor[tile];                             \
                    for (; at < k && kept[at] < row_end; at++)                         \
                        out[written++] = top + row * columns + tile * side             \
                                         + kept[at] - row * side;                      \
                    buffers->cursor[tile] = at;                                        \
                }                                                                      \
            }                                                                          \
        }                                                                              \
    }

DEFINE_CHUNK_LARGEST(chunk_largest_32, int32_t, uint32_t, chunk_key_32, chunk_select_32, )
DEFINE_CHUNK_LARGEST(chunk_largest_64, uint64_t, uint64_t, key_64, chunk_select_64, )

#if AVX2_SCAN
/* The float32 selection compiled for AVX2 (taken where use_avx2 says): the same
 * keys and comparisons, eight lanes wide, and the largest of a group in one
 * instruction a vector where SSE2 has no signed 32-bit maximum. */
DEFINE_CHUNK_SELECT(chunk_select_32_avx2, int32_t, keys_reaching_32, chunk_kth_32, AVX2_TARGET)
DEFINE_CHUNK_LARGEST(chunk_largest_32_avx2, int32_t, uint32_t, chunk_key_32,
                     chunk_select_32_avx2, AVX2_TARGET)
#endif

static void chunk_largest_32_any(const ChunkBuffers *buffers, const uint32_t *value,
                                 Py_ssize_t n, Py_ssize_t k, Py_ssize_t chunk,
                                 Py_ssize_t side, Py_ssize_t columns, int64_t *out)
{
#if AVX2_SCAN
    if (use_avx2) {
        chunk_largest_32_avx2(buffers, value, n, k, chunk, side, columns, out);
        return;
    }
#endif
    chunk_largest_32(buffers, value, n, k, chunk, side, columns, out);
}

/* Tiles with every tile kept whole: the positions are all of them, 0..n. */
static void every_position(Py_ssize_t n, int64_t *out)
{
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = i;
}

static PyObject *chunk_largest(PyObject *module, PyObject *args)
{
    PyObject *values_object;
    Py_ssize_t k, chunk, side, columns;
    (void)module;
    if (!PyArg_ParseTuple(args, "Onnnn:chunk_largest", &values_object, &k, &chunk, &side,
                          &columns))
        return NULL;
    Py_buffer values;
    char format;
    if (get_values(values_object, &values, &format, 0) < 0)
        return NULL;
    Py_ssize_t n = values.len / values.itemsize;
    PyObject *result = NULL;
    ChunkBuffers buffers = {0};
    if (k < 0 || chunk < 1 || side < 0
            || (side > 0 && (side > chunk / side || side * side != chunk || columns < side
                             || columns % side || n % (side * columns)))) {
        PyErr_Format(PyExc_ValueError, "need k >= 0, chunk >= 1 and, for tiles (side > 0), "
                     "chunk == side * side and rows of columns values that tile; got k=%zd, "
                     "chunk=%zd, side=%zd, columns=%zd for %zd values", k, chunk, side,
                     columns, n);
        goto done;
    }
    Py_ssize_t chunks = n / chunk, rest = n % chunk;
    Py_ssize_t keep = k < chunk ? k : chunk;
    Py_ssize_t total = chunks * keep + (k < rest ? k : rest);
    Py_buffer out;
    result = new_array(total, "int64", &out);
    if (result == NULL)
        goto done;
    if (total == n || total == 0) { /* every chunk kept whole, or none of any */
        RELEASED_BEGIN(n, 1 << 16)
        every_position(total, out.buf);
        RELEASED_END
        PyBuffer_Release(&out);
        goto done;
    }
    Py_ssize_t length = chunk < n ? chunk : n, across = side ? columns / side : 1;
    buffers.key = PyMem_RawMalloc((size_t)length * values.itemsize);
    buffers.candidate = PyMem_RawMalloc((size_t)length * values.itemsize);
    buffers.scratch = PyMem_RawMalloc((size_t)length * values.itemsize);
    buffers.position = PyMem_RawMalloc((size_t)length * sizeof *buffers.position);
    buffers.histogram = PyMem_RawMalloc(((size_t)1 << CHUNK_DIGIT_BITS)
                                        * sizeof *buffers.histogram);
    buffers.kept = PyMem_RawMalloc((size_t)across * (size_t)keep * sizeof *buffers.kept);
    buffers.cursor = PyMem_RawMalloc((size_t)across * sizeof *buffers.cursor);
    if (!buffers.key || !buffers.candidate || !buffers.scratch || !buffers.position
            || !buffers.histogram || !buffers.kept || !buffers.cursor) {
        PyBuffer_Release(&out);
        Py_CLEAR(result);
        PyErr_NoMemory();
        goto done;
    }
    RELEASED_BEGIN(n, 1 << 12)
    if (format == 'f')
        chunk_largest_32_any(&buffers, values.buf, n, k, chunk, side, columns, out.buf);
    else
        chunk_largest_64(&buffers, values.buf, n, k, chunk, side, columns, out.buf);
    RELEASED_END
    PyBuffer_Release(&out);
done:
    PyMem_RawFree(buffers.key);
    PyMem_RawFree(buffers.candidate);
    PyMem_RawFree(buffers.scratch);
    PyMem_RawFree(buffers.position);
    PyMem_RawFree(buffers.histogram);
    PyMem_RawFree(buffers.kept);
    PyMem_RawFree(buffers.cursor);
    PyBuffer_Release(&values);
    return result;
}

static PyObject *set_avx2(PyObject *module, PyObject *args)
{
    int on;
    (void)module;
    if (!PyArg_ParseTuple(args, "p:_set_avx2", &on))
        return NULL;
    PyObject *previous = PyBool_FromLong(use_avx2);
#if AVX2_SCAN
    use_avx2 = on && __builtin_cpu_supports("avx2");
#else
    (void)on;
#endif
    return previous;
}

static PyMethodDef methods[] = {
    {"at_least", at_least, METH_VARARGS,
     "at_least(values, low, addend=None) -> numpy int64 array\n\n"
     "The positions, increasing, where abs(values) >= low (NaN never; a NaN low\n"
     "selects nothing). values: a C-contiguous one-dimensional float32 or float64\n"
     "array; low is compared in its precision. With an addend of the same dtype and\n"
     "length, values (writable) += addend first, in the same pass. See\n"
     "deepreduce.sparsifiers._at_least."},
    {"largest_at_least", largest_at_least, METH_VARARGS,
     "largest_at_least(values, low, k, addend=None) -> (positions, selected) or None\n\n"
     "As at_least, then the k of those positions of largest abs(values), increasing\n"
     "(ties at the k-th magnitude: the lowest positions), and the values there; None\n"
     "when fewer than k values reach low. See deepreduce.sparsifiers.TopK."},
    {"sampled_low", sampled_low, METH_VARARGS,
     "sampled_low(values, k, count, seed, addend=None) -> float\n\n"
     "The threshold of TopK's sampled selection: from count of values (+ addend),\n"
     "one drawn at random in each of count equal strata, the magnitude about k plus\n"
     "a safe margin of them reach. See deepreduce.sparsifiers.TopK._sampled_low."},
    {"chunk_largest", chunk_largest, METH_VARARGS,
     "chunk_largest(values, k, chunk, side, columns) -> numpy int64 array\n\n"
     "The positions, increasing, of the k largest abs(values) of every chunk (NaN\n"
     "lowest, ties to the lowest position; a chunk of at most k values is kept\n"
     "whole): consecutive chunks of chunk values when side is 0, else side x side\n"
     "tiles (chunk == side * side) of the matrix of rows of columns values. values:\n"
     "a C-contiguous one-dimensional float32 or float64 array. See\n"
     "deepreduce.sparsifiers.ChunkTopK."},
    {"_set_avx2", set_avx2, METH_VARARGS,
     "_set_avx2(on) -> bool\n\n"
     "For the tests: whether the float32 scan takes its AVX2 block from now on (only\n"
     "where the processor has AVX2); returns the setting it replaces."},
    {NULL, NULL, 0, NULL},
};

/* numpy.empty, and whether the processor takes the AVX2 scan: 0, or -1 with the
 * exception set. */
static int prepare_module(void)
{
    if (import_numpy_empty(&numpy_empty) < 0)
        return -1;
#if AVX2_SCAN
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    return 0;
}

DEFINE_MODULE(_topkscan, "deepreduce._topkscan",
              "Compiled candidate scan of the Top-k sparsifier and selection of the chunk-wise "
              "one (see deepreduce.sparsifiers.TopK and ChunkTopK).",
              prepare_module())
