/*
 * Compiled universe scan of deepreduce's Bloom-filter codec (deepreduce.codecs.bloom).
 *
 * The decoder of a Bloom filter must test every position of [0, n). In numpy the
 * test costs about 20 whole-array passes per chunk (hashing, gathers, masks), each
 * reading and writing memory; here a block of positions goes from hashes to
 * verdicts in three short loops over small stack arrays. The filter layout is the one documented at the top of
 * codecs/bloom.py and this file must follow it bit for bit: the numpy scan there
 * stays as the fallback when this module is not built, and the tests compare both.
 *
 *   scan(words, masks, start, count, seed, key_bytes, m, k, block_k, out) -> int
 *
 * writes the positives among start .. start+count-1, increasing, to out (int64,
 * at least count long) and returns how many it wrote. The caller chunks the
 * universe, which bounds the output buffer and lets it stop early (limit=).
 *
 *   build(words, masks, indices, seed, key_bytes, m, k, block_k) -> None
 *
 * sets the bits of the indices in words, the encoder's side of the same layout.
 * Both run without the GIL, so other Python threads (Horovod's) keep going.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_buffer.h"
#include <stdint.h>
#include <string.h>

#define PATTERNS 4096u
#define MAX_HASHES 64
#define MAX_BLOCK_HASHES 4
#define SECOND_HASH_SEED 0x9E3779B9u
/* Filters stay at or below 2**32 bits, so (g * m) >> 32 fits in 64 bits. */
#define MAX_FILTER_BITS (1ull << 32)
/* Positions hashed, then word-tested, then probed together: enough prefetched
 * loads in flight to hide the misses, few enough that their lines are still
 * in L1 when tested (256 measured best among 128-1024). */
#define BLOCK 256

/* A hint only: compilers without it lose speed, not correctness. */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address) __builtin_prefetch(address)
#else
#define PREFETCH(address) ((void)(address))
#endif

/* ------------------------------------------------------------ MurmurHash3 x86_32 */

static inline uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

/* One key word through the body of MurmurHash3: the part that does not depend on
 * the seed, so h1 and h2 of a position can share it. */
static inline uint32_t scramble(uint32_t word)
{
    return rotl32(word * 0xCC9E2D51u, 15) * 0x1B873593u;
}

static inline uint32_t mix_in(uint32_t h, uint32_t scrambled)
{
    return rotl32(h ^ scrambled, 13) * 5u + 0xE6546B64u;
}

static inline uint32_t finish(uint32_t h, uint32_t length)
{
    h ^= length;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

/* Hash of a position's key (4 or 8 little-endian bytes) whose key words are
 * already scrambled; `high` is only used with 8-byte keys. */
static inline uint32_t murmur_key(uint32_t low, uint32_t high, int key_bytes, uint32_t seed)
{
    uint32_t h = mix_in(seed, low);
    if (key_bytes == 8)
        h = mix_in(h, high);
    return finish(h, (uint32_t)key_bytes);
}

/* ------------------------------------------------------------ the scan */

typedef struct {
    const uint64_t *words;   /* filter words, bit b is bit b % 64 of word b / 64 */
    const uint64_t *masks;   /* PATTERNS blocked-word patterns */
    uint64_t m;              /* filter bits */
    uint64_t block_words;    /* m / 64: words the blocked bits may land in */
    uint32_t seed;
    int key_bytes, k, block_k;
} filter_t;

static inline uint64_t block_word(const filter_t *f, uint32_t h1)
{
    return ((uint64_t)h1 * f->block_words) >> 32;
}

static inline uint64_t single_bit(const filter_t *f, uint32_t g)
{
    return ((uint64_t)g * f->m) >> 32;
}

/* Inlined twice with a constant key_bytes, so the 4-byte scan carries no trace
 * of the high key word. */
static inline Py_ssize_t scan_keys(const filter_t *f, uint64_t start, uint64_t count,
                                   int64_t *out, const int key_bytes)
{
    uint32_t h1[BLOCK], g[BLOCK];
    Py_ssize_t found = 0;
    uint64_t end = start + count;
    for (uint64_t base = start; base < end; base += BLOCK) {
        size_t length = end - base < BLOCK ? (size_t)(end - base) : BLOCK;
        /* Hash the whole block first and ask for each position's word: a
         * filter of a 10% Top-k no longer fits in cache, and prefetched loads
         * overlap where a load per position would wait for each miss. */
        for (size_t i = 0; i < length; i++) {
            uint64_t pos = base + i;
            h1[i] = murmur_key(scramble((uint32_t)pos), scramble((uint32_t)(pos >> 32)),
                               key_bytes, f->seed);
            PREFETCH(&f->words[block_word(f, h1[i])]);
        }
        /* The word test keeps about 7% of the positions. Survivors are stored
         * unconditionally and kept by advancing the count (no branch to
         * mispredict), straight into out: there are never more candidates
         * than positions scanned, which out has room for. */
        int64_t *candidate = out + found;
        size_t alive = 0;
        for (size_t i = 0; i < length; i++) {
            uint32_t hash = h1[i];
            uint64_t word = f->words[block_word(f, hash)];
            uint64_t mask = f->masks[hash & (PATTERNS - 1)];
            candidate[alive] = (int64_t)(base + i);
            h1[alive] = hash;
            alive += (word & mask) == mask;
        }
        /* The single bits, one probe at a time over all the candidates still
         * alive (compacted the same way): the probes of different candidates
         * are independent loads that overlap, where probing one candidate to
         * its end would chain a likely cache miss per bit. */
        if (f->k > f->block_k) {
            for (size_t s = 0; s < alive; s++) {
                uint64_t pos = (uint64_t)candidate[s];
                g[s] = murmur_key(scramble((uint32_t)pos), scramble((uint32_t)(pos >> 32)),
                                  key_bytes, f->seed ^ SECOND_HASH_SEED);
                PREFETCH(&f->words[single_bit(f, g[s]) >> 6]);
            }
            for (int j = f->block_k; j < f->k && alive; j++) {
                size_t kept = 0;
                for (size_t s = 0; s < alive; s++) {
                    uint64_t bit = single_bit(f, g[s]);
                    uint32_t hash = h1[s], next = g[s] + hash;
                    PREFETCH(&f->words[single_bit(f, next) >> 6]);
                    candidate[kept] = candidate[s];
                    h1[kept] = hash;
                    g[kept] = next;
                    kept += (f->words[bit >> 6] >> (bit & 63)) & 1u;
                }
                alive = kept;
            }
        }
        found += (Py_ssize_t)alive;
    }
    return found;
}

static Py_ssize_t scan_range(const filter_t *f, uint64_t start, uint64_t count, int64_t *out)
{
    return f->key_bytes == 4 ? scan_keys(f, start, count, out, 4)
                             : scan_keys(f, start, count, out, 8);
}

/* ------------------------------------------------------------ the build */

/* Sets the k bits of each index, a block of indices at a time: their hashes
 * first, with a prefetch of each blocked word, so that the read-modify-writes
 * of a filter larger than cache overlap their misses. */
static inline void build_keys(const filter_t *f, uint64_t *words, const int64_t *indices,
                              Py_ssize_t count, const int key_bytes)
{
    uint32_t h1[BLOCK];
    for (Py_ssize_t base = 0; base < count; base += BLOCK) {
        size_t length = count - base < BLOCK ? (size_t)(count - base) : BLOCK;
        const int64_t *block = indices + base;
        for (size_t i = 0; i < length; i++) {
            uint64_t pos = (uint64_t)block[i];
            h1[i] = murmur_key(scramble((uint32_t)pos), scramble((uint32_t)(pos >> 32)),
                               key_bytes, f->seed);
            PREFETCH(&words[block_word(f, h1[i])]);
        }
        for (size_t i = 0; i < length; i++) {
            uint64_t pos = (uint64_t)block[i];
            words[block_word(f, h1[i])] |= f->masks[h1[i] & (PATTERNS - 1)];
            uint32_t g = murmur_key(scramble((uint32_t)pos), scramble((uint32_t)(pos >> 32)),
                                    key_bytes, f->seed ^ SECOND_HASH_SEED);
            for (int j = f->block_k; j < f->k; j++, g += h1[i]) {
                uint64_t bit = single_bit(f, g);
                words[bit >> 6] |= 1ull << (bit & 63);
            }
        }
    }
}

/* ------------------------------------------------------------ argument checks */

/* Whether the buffer holds signed (or unsigned) 8-byte integers. */
static int is_8_byte_integer(const Py_buffer *view, int is_signed)
{
    char code = native_item_code(view);
    return view->itemsize == 8 && code != 0 && strchr(is_signed ? "ql" : "QL", code) != NULL;
}

/* A C-contiguous one-dimensional buffer of 8-byte integers, else TypeError. */
static int get_array(PyObject *object, Py_buffer *view, const char *name, int is_signed,
                     int writable)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer of %s", name,
                     writable ? " writable" : "", is_signed ? "int64" : "uint64");
        return -1;
    }
    if (view->ndim != 1 || !is_8_byte_integer(view, is_signed)) {
        PyErr_Format(PyExc_TypeError, "%s must be a one-dimensional %s array, got format "
                     "'%s' with %zd dimensions and %zd-byte items", name,
                     is_signed ? "int64" : "uint64", view->format ? view->format : "B",
                     (Py_ssize_t)view->ndim, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The hashing parameters both entry points take, checked; -1 with ValueError set. */
static int check_parameters(long long seed, long long key_bytes, long long m, long long k,
                            long long block_k)
{
    if (key_bytes != 4 && key_bytes != 8)
        PyErr_Format(PyExc_ValueError, "key_bytes must be 4 or 8, got %lld", key_bytes);
    else if (seed < 0 || seed > 0xFFFFFFFFll)
        PyErr_Format(PyExc_ValueError, "seed must be in [0, 2**32), got %lld", seed);
    else if (k < 1 || k > MAX_HASHES)
        PyErr_Format(PyExc_ValueError, "k must be in [1, %d], got %lld", MAX_HASHES, k);
    else if (block_k < 1 || block_k > MAX_BLOCK_HASHES || block_k > k)
        PyErr_Format(PyExc_ValueError, "block_k must be in [1, min(k, %d)], got %lld",
                     MAX_BLOCK_HASHES, block_k);
    else if (m < 64 || (unsigned long long)m > MAX_FILTER_BITS)
        PyErr_Format(PyExc_ValueError, "m must be in [64, 2**32] bits, got %lld", m);
    else
        return 0;
    return -1;
}

/* Keys past the width would be hashed truncated: positions that are not theirs. */
static unsigned long long key_limit(long long key_bytes)
{
    return key_bytes == 4 ? 1ull << 32 : (unsigned long long)LLONG_MAX;
}

/* words (filter words for m bits) and masks (PATTERNS patterns), checked; on
 * success both views are held and the caller releases them. */
static int get_filter(PyObject *words_object, PyObject *masks_object, long long m,
                      int writable, Py_buffer *words, Py_buffer *masks)
{
    if (get_array(words_object, words, "words", 0, writable) < 0)
        return -1;
    if (get_array(masks_object, masks, "masks", 0, 0) < 0) {
        PyBuffer_Release(words);
        return -1;
    }
    Py_ssize_t nwords = words->len / 8, nmasks = masks->len / 8;
    if ((unsigned long long)nwords < (unsigned long long)m / 64 + (m % 64 != 0))
        PyErr_Format(PyExc_ValueError, "words holds %zd words, fewer than the %lld bits of "
                     "the filter need", nwords, m);
    else if (nmasks != (Py_ssize_t)PATTERNS)
        PyErr_Format(PyExc_ValueError, "masks must hold %u patterns, got %zd", PATTERNS,
                     nmasks);
    else
        return 0;
    PyBuffer_Release(words);
    PyBuffer_Release(masks);
    return -1;
}

static PyObject *scan(PyObject *module, PyObject *args)
{
    PyObject *words_object, *masks_object, *out_object;
    long long start, count, seed, key_bytes, m, k, block_k;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOLLLLLLLO:scan", &words_object, &masks_object, &start,
                          &count, &seed, &key_bytes, &m, &k, &block_k, &out_object))
        return NULL;
    if (check_parameters(seed, key_bytes, m, k, block_k) < 0)
        return NULL;
    if (start < 0 || count < 0)
        return PyErr_Format(PyExc_ValueError, "start and count must be non-negative, got "
                            "%lld and %lld", start, count);
    if ((unsigned long long)start > key_limit(key_bytes)
            || (unsigned long long)count > key_limit(key_bytes) - start)
        return PyErr_Format(PyExc_ValueError, "positions %lld .. %lld + %lld do not fit "
                            "%lld-byte keys", start, start, count, key_bytes);

    Py_buffer words, masks, out;
    if (get_filter(words_object, masks_object, m, 0, &words, &masks) < 0)
        return NULL;
    if (get_array(out_object, &out, "out", 1, 1) < 0) {
        PyBuffer_Release(&words);
        PyBuffer_Release(&masks);
        return NULL;
    }
    PyObject *result = NULL;
    if ((unsigned long long)(out.len / 8) < (unsigned long long)count)
        PyErr_Format(PyExc_ValueError, "out holds %zd positions, fewer than count=%lld",
                     out.len / 8, count);
    else {
        filter_t filter = {words.buf, masks.buf, (uint64_t)m, (uint64_t)m / 64,
                           (uint32_t)seed, (int)key_bytes, (int)k, (int)block_k};
        Py_ssize_t found;
        Py_BEGIN_ALLOW_THREADS
        found = scan_range(&filter, (uint64_t)start, (uint64_t)count, out.buf);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(found);
    }
    PyBuffer_Release(&words);
    PyBuffer_Release(&masks);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *build(PyObject *module, PyObject *args)
{
    PyObject *words_object, *masks_object, *indices_object;
    long long seed, key_bytes, m, k, block_k;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOOLLLLL:build", &words_object, &masks_object,
                          &indices_object, &seed, &key_bytes, &m, &k, &block_k))
        return NULL;
    if (check_parameters(seed, key_bytes, m, k, block_k) < 0)
        return NULL;
    Py_buffer words, masks, indices;
    if (get_filter(words_object, masks_object, m, 1, &words, &masks) < 0)
        return NULL;
    if (get_array(indices_object, &indices, "indices", 1, 0) < 0) {
        PyBuffer_Release(&words);
        PyBuffer_Release(&masks);
        return NULL;
    }
    const int64_t *index = indices.buf;
    Py_ssize_t count = indices.len / 8, bad = -1;
    /* Checked before any bit is set, so a refused call leaves words as it was. (The
     * views hold the arrays' memory while other threads run.) */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count && bad < 0; i++)
        if (index[i] < 0 || (unsigned long long)index[i] >= key_limit(key_bytes))
            bad = i;
    Py_END_ALLOW_THREADS
    if (bad >= 0)
        PyErr_Format(PyExc_ValueError, "indices[%zd] = %lld does not fit %lld-byte keys",
                     bad, (long long)index[bad], key_bytes);
    else {
        filter_t filter = {words.buf, masks.buf, (uint64_t)m, (uint64_t)m / 64,
                           (uint32_t)seed, (int)key_bytes, (int)k, (int)block_k};
        Py_BEGIN_ALLOW_THREADS
        if (key_bytes == 4)
            build_keys(&filter, words.buf, index, count, 4);
        else
            build_keys(&filter, words.buf, index, count, 8);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&words);
    PyBuffer_Release(&masks);
    PyBuffer_Release(&indices);
    if (bad >= 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(words, masks, start, count, seed, key_bytes, m, k, block_k, out) -> int\n\n"
     "Write the Bloom-filter positives among positions start .. start+count-1 to out\n"
     "(int64, at least count long), increasing; return how many. words: the filter as\n"
     "uint64 words; masks: the 4096 uint64 blocked-word patterns of block_k bits;\n"
     "m: filter bits; k: hash count. Layout: deepreduce.codecs.bloom."},
    {"build", build, METH_VARARGS,
     "build(words, masks, indices, seed, key_bytes, m, k, block_k) -> None\n\n"
     "Set the k filter bits of every index (int64, each within the key width) in\n"
     "words (writable uint64), the other arguments as for scan."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "deepreduce.codecs._bloomscan",
    "Compiled universe scan of the Bloom-filter index codec (see deepreduce.codecs.bloom).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__bloomscan(void) { return PyModule_Create(&module); }
