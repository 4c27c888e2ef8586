/*
 * Compiled loops of deepreduce's Huffman, Golomb and block-packed index codecs
 * (deepreduce.codecs.index.huffman, deepreduce.codecs.index.golomb, deepreduce.codecs.index.blockpack).
 *
 * A prefix code is sequential by nature: numpy decodes it in lockstep lanes, a dozen
 * whole-array operations per three symbols, and packs variable-width fields with
 * running sums over four arrays, after gathers from the code tables. Here each
 * direction is a few passes over the data. The numpy code (codecs/huffman.py and
 * codecs/_entropy.py) stays as the fallback when this module is not built; both must
 * give the same bits, and the tests compare them. Streams are MSB-first (stream bit b
 * is bit 7 - b % 8 of byte b // 8); "tables" below are indexed by bucket symbol.
 *
 *   bucket_symbols(values, precision, symbols, offset_bits, counts) -> None
 *       _entropy.bucket_symbols into uint8 arrays, and the symbols' histogram.
 *   huffman_encode(indices, precision, block) -> bytes
 *   huffman_decode(data, n, precision, block, out) -> None, str or int
 *       huffman.HuffmanIndices.encode and decode in one call each: the gaps, their
 *       symbols and histogram, the length-limited code, the tables and both streams;
 *       the tables parsed and checked in the numpy path's order (a malformed stream
 *       gets its message), the lanes, the offsets and the running sum. For small sets
 *       the dozens of numpy calls of the fallback's steps cost more than the passes.
 *   huffman_estimate(indices, step, precision, block) -> (bits, gaps)
 *       huffman.estimate_bits of a sample of the gaps, which auto weighs.
 *   huffman_depths(weights, depths) -> None
 *       _entropy._huffman_depths: the Huffman tree, equal weights merged alike.
 *   golomb_encode(indices, m, prefix) -> (data, adjacent)
 *   golomb_decode(data, m, n, out) -> None or str
 *       golomb.encode_index_gaps and decode_index_gaps in one pass each (two for true
 *       Golomb codes, whose extra bits precede the unary part): the index gaps, split,
 *       planes and unary codes without intermediate arrays.
 *   blockpack_encode(indices) -> bytes
 *   blockpack_decode(data, n, out) -> None or str
 *       deepreduce.codecs.index.blockpack's stream, the gaps and their running sum in the
 *       same pass.
 *   run_fields(indices, zeros, lengths) -> (unit, runs)
 *   golomb_bits(values, m) -> int or None
 *       deepreduce.codecs.index.runs.fields and golomb.field_bits: the runs code's two
 *       sequences and the exact size of a Golomb code, which auto weighs on every
 *       clustered set, in one pass each instead of a dozen numpy ones.
 *
 * The varints of deepreduce.bits, which the core uses too, are compiled apart
 * (deepreduce/_varint.c): the core never imports deepreduce.codecs.
 *
 * Decoders are handed untrusted streams: every read is bounded by the buffer's size
 * (bits past the end read as zeros, as numpy's zero padding does), and every write by
 * its output's. Bad arguments raise TypeError or ValueError; those found only by the
 * pass itself (values that are not positive, indices that do not increase) after it,
 * leaving its outputs unspecified. The passes over the data run without the GIL, so
 * other Python threads (Horovod's) keep going.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_buffer.h"
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>

/* Longest code the lane decoder accepts: deepreduce.codecs.index._entropy.MAX_CODE_LENGTH. */
#define MAX_CODE_LENGTH 15
/* Symbols are bytes. */
#define MAX_ALPHABET 256
/* Lanes decoded at once: their dependency chains (position, window, lookup) are
 * independent, so the processor overlaps them. */
#define LANE_GROUP 4
/* Bucket symbols of precision 0..2 fit in one byte (at most 247). */
#define MAX_PRECISION 2
/* Fewer indices than this keep the GIL in the Golomb and Huffman loops (see
 * RELEASED_BEGIN): a few nanoseconds an index. */
#define RELEASE_INDICES (1 << 13)
/* Largest block of huffman_encode and huffman_decode (HuffmanIndices takes 8 to 4096):
 * a block's code bits (at most 15 each) fit in 32 bits. */
#define MAX_BLOCK (1 << 24)
/* deepreduce.bits.MAX_VARINT_BYTES: a varint of 64 bits takes at most 10 bytes. */
#define MAX_VARINT_GROUPS 10

/* ------------------------------------------------------------ bit access */

#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

#if defined(__GNUC__) || defined(__clang__)
#define BSWAP64(x) __builtin_bswap64(x)
#define LOG2_64(x) (63 - __builtin_clzll(x))
#else
static inline uint64_t BSWAP64(uint64_t x)
{
    uint64_t y = 0;
    for (int i = 0; i < 8; i++, x >>= 8)
        y = (y << 8) | (x & 0xFF);
    return y;
}
static inline int LOG2_64(uint64_t x)
{
    int log = 0;
    while (x >>= 1)
        log++;
    return log;
}
#endif

static inline uint64_t load_be64(const uint8_t *p)
{
    uint64_t word;
    memcpy(&word, p, 8);
#if PY_LITTLE_ENDIAN
    word = BSWAP64(word);
#endif
    return word;
}

static inline void store_be64(uint8_t *p, uint64_t word)
{
#if PY_LITTLE_ENDIAN
    word = BSWAP64(word);
#endif
    memcpy(p, &word, 8);
}

/* The 64 stream bits starting at byte `byte`, zeros past the end of the data. */
static inline uint64_t window_at(const uint8_t *data, uint64_t size, uint64_t byte)
{
    if (byte + 8 <= size)
        return load_be64(data + byte);
    uint64_t word = 0;
    for (uint64_t i = 0; i < 8; i++)
        word = (word << 8) | (byte + i < size ? data[byte + i] : 0u);
    return word;
}

/* The `width` (0..64) stream bits starting at bit `position`, as a number. Empty
 * fields, frequent and mixed with others, take no branch: the selection at the end
 * compiles to a conditional move. */
static inline uint64_t read_bits(const uint8_t *data, uint64_t size, uint64_t position,
                                 unsigned width)
{
    uint64_t byte = position >> 3;
    unsigned shift = (unsigned)(position & 7);
    uint64_t word = window_at(data, size, byte) << shift;
    /* A field of more than 64 - shift bits ends in the ninth byte. */
    if (width + shift > 64 && byte + 8 < size)
        word |= (uint64_t)data[byte + 8] >> (8 - shift);
    uint64_t value = word >> ((64 - width) & 63);
    return width ? value : 0;
}

/* ------------------------------------------------------------ argument checks */

/* Whether the buffer's items are itemsize bytes of one of the struct codes. */
static int has_format(const Py_buffer *view, Py_ssize_t itemsize, const char *codes)
{
    char code = native_item_code(view);
    return view->itemsize == itemsize && code != 0 && strchr(codes, code) != NULL;
}

typedef enum { BYTES, UINT8, INT64, UINT64 } kind_t;

static const char *const KIND_NAMES[] = {"bytes-like", "uint8", "int64", "uint64"};

/* A C-contiguous one-dimensional buffer of the kind, else TypeError. BYTES takes any
 * buffer of one-byte items (bytes, bytearray, memoryview, uint8 arrays). */
static int get_array(PyObject *object, Py_buffer *view, const char *name, kind_t kind,
                     int writable)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer of %s", name,
                     writable ? " writable" : "", KIND_NAMES[kind]);
        return -1;
    }
    int ok = view->ndim <= 1;
    if (kind == BYTES)
        ok = ok && has_format(view, 1, "Bbc");
    else if (kind == UINT8)
        ok = ok && has_format(view, 1, "B");
    else if (kind == INT64)
        ok = ok && has_format(view, 8, "lq");
    else
        ok = ok && has_format(view, 8, "LQ");
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must be a one-dimensional %s array, got format "
                     "'%s' with %zd dimensions and %zd-byte items", name, KIND_NAMES[kind],
                     view->format ? view->format : "B", (Py_ssize_t)view->ndim,
                     view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release_all(Py_buffer **views, int count)
{
    for (int i = 0; i < count; i++)
        PyBuffer_Release(views[i]);
}

/* Gets every buffer of an entry point (None passes for the optional ones, whose view
 * then has buf NULL); on failure releases those it got. */
static int get_arrays(PyObject *const *objects, Py_buffer **views, const char *const *names,
                      const kind_t *kinds, const int *writable, const int *optional, int count)
{
    for (int i = 0; i < count; i++) {
        if (optional != NULL && optional[i] && objects[i] == Py_None) {
            memset(views[i], 0, sizeof *views[i]);
            continue;
        }
        if (get_array(objects[i], views[i], names[i], kinds[i], writable[i]) < 0) {
            release_all(views, i);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------ bucket_symbols */

/* Inlined once per precision, so that the shifts by it are constants; offset and
 * counts may be NULL. Returns the index of the first value below 1, or -1 (what the
 * outputs then hold is unspecified). */
static inline Py_ssize_t bucket_loop(const int64_t *restrict value, Py_ssize_t count,
                                     const int precision, uint8_t *restrict symbol,
                                     uint8_t *restrict offset, int64_t *restrict counts)
{
    int nonpositive = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        nonpositive |= value[i] < 1;
        uint64_t v = (uint64_t)value[i];
        /* OR-ing 1 keeps the logarithm of 0 defined and changes no other. */
        int exponent = LOG2_64(v | 1);
        int bits = exponent > precision ? exponent - precision : 0;
        /* v >> bits is the leading one and `precision` bits below it, in
         * [2**precision, 2**(precision + 1)), unless v is small (bits == 0). */
        uint8_t s = (uint8_t)((v >> bits) + ((uint64_t)bits << precision));
        symbol[i] = s;
        if (offset != NULL)
            offset[i] = (uint8_t)bits;
        if (counts != NULL)
            counts[s]++;
    }
    if (nonpositive)
        for (Py_ssize_t i = 0; i < count; i++)
            if (value[i] < 1)
                return i;
    return -1;
}

static PyObject *bucket_symbols(PyObject *module, PyObject *args)
{
    PyObject *objects[4];
    int precision;
    (void)module;
    if (!PyArg_ParseTuple(args, "OiOOO:bucket_symbols", &objects[0], &precision, &objects[1],
                          &objects[2], &objects[3]))
        return NULL;
    if (precision < 0 || precision > MAX_PRECISION)
        return PyErr_Format(PyExc_ValueError, "precision must be in [0, %d], got %d",
                            MAX_PRECISION, precision);
    static const char *const names[4] = {"values", "symbols", "offset_bits", "counts"};
    static const kind_t kinds[4] = {INT64, UINT8, UINT8, INT64};
    static const int writable[4] = {0, 1, 1, 1}, optional[4] = {0, 0, 1, 1};
    Py_buffer storage[4], *views[4];
    for (int i = 0; i < 4; i++)
        views[i] = &storage[i];
    if (get_arrays(objects, views, names, kinds, writable, optional, 4) < 0)
        return NULL;
    Py_buffer *values = views[0], *symbols = views[1], *offset_bits = views[2];
    Py_buffer *counts = views[3];
    Py_ssize_t count = values->len / 8, bad = -1;
    PyObject *result = NULL;
    if (symbols->len != count || (offset_bits->buf != NULL && offset_bits->len != count))
        PyErr_Format(PyExc_ValueError, "symbols and offset_bits must hold %zd entries, got "
                     "%zd and %zd", count, symbols->len, offset_bits->len);
    else if (counts->buf != NULL && counts->len / 8 != MAX_ALPHABET)
        PyErr_Format(PyExc_ValueError, "counts must hold %d entries, got %zd", MAX_ALPHABET,
                     counts->len / 8);
    else {
        const int64_t *value = values->buf;
        uint8_t *symbol = symbols->buf, *offset = offset_bits->buf;
        int64_t *histogram = counts->buf;
        Py_BEGIN_ALLOW_THREADS
        if (histogram != NULL)
            memset(histogram, 0, MAX_ALPHABET * sizeof *histogram);
        bad = precision == 0 ? bucket_loop(value, count, 0, symbol, offset, histogram)
            : precision == 1 ? bucket_loop(value, count, 1, symbol, offset, histogram)
                             : bucket_loop(value, count, 2, symbol, offset, histogram);
        Py_END_ALLOW_THREADS
        if (bad >= 0)
            PyErr_Format(PyExc_ValueError, "values[%zd] = %lld is not positive", bad,
                         (long long)value[bad]);
        else {
            result = Py_None;
            Py_INCREF(result);
        }
    }
    release_all(views, 4);
    return result;
}

/* ------------------------------------------------------------ bit writer */

/* Pending bits (`held` of them, in the low end of a 64-bit accumulator) and where the
 * next full word goes; words are stored big-endian, never at or past `end`. */
typedef struct {
    uint8_t *out, *end;
    uint64_t pending;
    unsigned held;
    int overflow;
} writer_t;

/* Appends the low `width` (0..64) bits of value, which has no bits above them (so a
 * width of 0 appends nothing, without a branch). */
static inline void put_bits(writer_t *w, uint64_t value, unsigned width)
{
    if (w->held + width < 64) {
        w->pending = (w->pending << width) | value;
        w->held += width;
        return;
    }
    unsigned rest = w->held + width - 64;
    /* held == 0 only with width == 64, whose value is the whole word. */
    uint64_t word = w->held ? (w->pending << (64 - w->held)) | (value >> rest) : value;
    if (w->end - w->out >= 8) {
        store_be64(w->out, word);
        w->out += 8;
    } else
        w->overflow = 1;
    w->pending = rest ? value & ((1ull << rest) - 1) : 0;
    w->held = rest;
}

/* The last partial word, zero-padded to a byte. Returns whether everything written
 * fitted and filled the output exactly. */
static inline int flush_bits(writer_t *w)
{
    unsigned tail = (w->held + 7) / 8;
    if (w->overflow || w->end - w->out != (Py_ssize_t)tail)
        return 0;
    uint64_t pending = w->held ? w->pending << (64 - w->held) : 0;
    for (unsigned i = 0; i < tail; i++)
        w->out[i] = (uint8_t)(pending >> (56 - 8 * i));
    return 1;
}

/* ------------------------------------------------------------ lane decoding */

/* The lookup table of a canonical code: entry w is (length << 8) | symbol of the code
 * that is a prefix of the peek-bit word w; words no code starts stay 0 (length 0).
 * Codes go shortest first, by symbol within a length (_entropy.canonical_codes).
 * Returns -1 when the lengths overfill the table (not a prefix code). */
static int fill_table(const uint8_t *lengths, Py_ssize_t alphabet, unsigned peek,
                      uint16_t *table)
{
    uint64_t size = 1ull << peek, next = 0;
    memset(table, 0, size * sizeof *table);
    /* In units of table entries: a code of length l covers 2**(peek - l). */
    for (unsigned length = 1; length <= peek; length++)
        for (Py_ssize_t symbol = 0; symbol < alphabet; symbol++) {
            if (lengths[symbol] != length)
                continue;
            uint64_t span = 1ull << (peek - length);
            if (next + span > size)
                return -1;
            for (uint64_t w = next; w < next + span; w++)
                table[w] = (uint16_t)(length << 8 | (unsigned)symbol);
            next += span;
        }
    return 0;
}

/* Decodes up to three symbols of a lane from one window read at the lane's position: a
 * window read at a byte holds at least 57 bits from the position, three codes of at
 * most 15 bits and the lookup of the third. A length of 0 (bits that start no code)
 * marks the lane bad and leaves it where it is, as the numpy lockstep decoder does. */
static inline uint64_t decode_window(const uint8_t *data, uint64_t size, const uint16_t *table,
                                     unsigned drop, uint64_t position, uint8_t *out,
                                     Py_ssize_t count, uint8_t *bad)
{
    uint64_t window = window_at(data, size, position >> 3) << (position & 7);
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned entry = table[window >> drop], length = entry >> 8;
        out[i] = (uint8_t)entry;
        *bad |= length == 0;
        window <<= length;
        position += length;
    }
    return position;
}

/* ------------------------------------------------------------ huffman_depths */

/* Nodes are leaves 0 .. n-1 and merged nodes n, n+1, ... in creation order; the heap
 * orders them by (weight, node), as _entropy._huffman_depths's heap of
 * (weight, tie, leaves) tuples does, so both merge the same pairs. */
typedef struct {
    uint64_t weight;
    Py_ssize_t node;
} heap_entry_t;

static inline int before(heap_entry_t a, heap_entry_t b)
{
    return a.weight < b.weight || (a.weight == b.weight && a.node < b.node);
}

static void sift_down(heap_entry_t *heap, Py_ssize_t size, Py_ssize_t at)
{
    for (;;) {
        Py_ssize_t child = 2 * at + 1;
        if (child >= size)
            return;
        if (child + 1 < size && before(heap[child + 1], heap[child]))
            child++;
        if (!before(heap[child], heap[at]))
            return;
        heap_entry_t swap = heap[at];
        heap[at] = heap[child];
        heap[child] = swap;
        at = child;
    }
}

static heap_entry_t pop_min(heap_entry_t *heap, Py_ssize_t *size)
{
    heap_entry_t top = heap[0];
    heap[0] = heap[--*size];
    sift_down(heap, *size, 0);
    return top;
}

static void push(heap_entry_t *heap, Py_ssize_t *size, heap_entry_t entry)
{
    Py_ssize_t at = (*size)++;
    heap[at] = entry;
    while (at > 0 && before(heap[at], heap[(at - 1) / 2])) {
        heap_entry_t swap = heap[at];
        heap[at] = heap[(at - 1) / 2];
        heap[(at - 1) / 2] = swap;
        at = (at - 1) / 2;
    }
}

/* Leaf depths of the Huffman tree of n weights; scratch holds 2n heap entries and 2n
 * parents. A leaf's depth is its merged ancestors' count: parents come after their
 * children, so one backward pass gives every node's depth from its parent's. */
static void tree_depths(const int64_t *weights, Py_ssize_t n, heap_entry_t *heap,
                        Py_ssize_t *parent, int64_t *depths)
{
    Py_ssize_t size = 0, next = n;
    for (Py_ssize_t i = 0; i < n; i++)
        heap[size++] = (heap_entry_t){(uint64_t)weights[i], i};
    for (Py_ssize_t i = size / 2 - 1; i >= 0; i--)
        sift_down(heap, size, i);
    while (size > 1) {
        heap_entry_t first = pop_min(heap, &size), second = pop_min(heap, &size);
        parent[first.node] = parent[second.node] = next;
        push(heap, &size, (heap_entry_t){first.weight + second.weight, next});
        next++;
    }
    /* next - 1 is the root (or the only leaf); depths are written over the parents. */
    parent[next - 1] = -1;
    for (Py_ssize_t node = next - 1; node >= 0; node--)
        parent[node] = parent[node] < 0 ? 0 : parent[parent[node]] + 1;
    for (Py_ssize_t i = 0; i < n; i++)
        depths[i] = (int64_t)parent[i];
}

static PyObject *huffman_depths(PyObject *module, PyObject *args)
{
    PyObject *objects[2];
    (void)module;
    if (!PyArg_ParseTuple(args, "OO:huffman_depths", &objects[0], &objects[1]))
        return NULL;
    static const char *const names[2] = {"weights", "depths"};
    static const kind_t kinds[2] = {INT64, INT64};
    static const int writable[2] = {0, 1};
    Py_buffer storage[2], *views[2] = {&storage[0], &storage[1]};
    if (get_arrays(objects, views, names, kinds, writable, NULL, 2) < 0)
        return NULL;
    const int64_t *weight = views[0]->buf;
    Py_ssize_t n = views[0]->len / 8;
    uint64_t total = 0;
    int overflow = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        overflow |= weight[i] < 0;
        total += (uint64_t)weight[i];
        overflow |= total >= (1ull << 63);
    }
    PyObject *result = NULL;
    void *scratch = NULL;
    if (views[1]->len / 8 != n)
        PyErr_Format(PyExc_ValueError, "depths must hold %zd entries, got %zd", n,
                     views[1]->len / 8);
    else if (n < 1 || n > MAX_ALPHABET)
        PyErr_Format(PyExc_ValueError, "weights must hold 1 to %d entries, got %zd",
                     MAX_ALPHABET, n);
    else if (overflow)
        PyErr_SetString(PyExc_ValueError, "weights must be non-negative and add up to less "
                        "than 2**63");
    else if ((scratch = PyMem_Malloc(2 * n * (sizeof(heap_entry_t) + sizeof(Py_ssize_t))))
             == NULL)
        PyErr_NoMemory();
    else {
        heap_entry_t *heap = scratch;
        tree_depths(weight, n, heap, (Py_ssize_t *)(heap + 2 * n), views[1]->buf);
        result = Py_None;
        Py_INCREF(result);
    }
    PyMem_Free(scratch);
    release_all(views, 2);
    return result;
}

/* ------------------------------------------------------------ huffman_estimate */

/* deepreduce.codecs.index._entropy.huffman_lengths of a histogram of MAX_ALPHABET symbols with
 * at least one used and a total below 2**63: the Huffman code of the used symbols, in
 * symbol order, flattened (every weight halved, used ones kept at 1 or more) and
 * rebuilt until no code passes MAX_CODE_LENGTH; tree_depths merges ties as
 * _entropy._huffman_depths does, so the lengths are the numpy path's. Writes every
 * symbol's length (0 if unused) and the first and last used symbols. */
static void limited_lengths(const int64_t *counts, int64_t *lengths, unsigned *first,
                            unsigned *last)
{
    int64_t weights[MAX_ALPHABET], depths[MAX_ALPHABET];
    Py_ssize_t parent[2 * MAX_ALPHABET], used = 0, symbol[MAX_ALPHABET];
    heap_entry_t heap[2 * MAX_ALPHABET];
    memset(lengths, 0, MAX_ALPHABET * sizeof *lengths);
    for (int s = 0; s < MAX_ALPHABET; s++)
        if (counts[s]) {
            symbol[used] = s;
            weights[used++] = counts[s];
        }
    *first = (unsigned)symbol[0];
    *last = (unsigned)symbol[used - 1];
    if (used == 1)
        lengths[symbol[0]] = 1;
    while (used > 1) {
        int64_t deepest = 0;
        tree_depths(weights, used, heap, parent, depths);
        for (Py_ssize_t i = 0; i < used; i++)
            deepest = depths[i] > deepest ? depths[i] : deepest;
        if (deepest <= MAX_CODE_LENGTH) {
            for (Py_ssize_t i = 0; i < used; i++)
                lengths[symbol[i]] = depths[i];
            return;
        }
        for (Py_ssize_t i = 0; i < used; i++)
            weights[i] = weights[i] >> 1 ? weights[i] >> 1 : 1;
    }
}

/* deepreduce.codecs.index.huffman.estimate_bits of the gaps at every step-th position of
 * strictly increasing indices (the gap before the first index counts from -1), in one
 * call: auto weighs it on every large set, where its dozen numpy calls on small arrays
 * cost more than the pass. Returns 0 with the bits in *bits and the number of gaps in
 * *gaps, or -1 if a sampled gap is below 1 (the indices do not increase). */
static int estimate_gap_bits(const int64_t *indices, Py_ssize_t count, Py_ssize_t step,
                             int precision, uint64_t block, uint64_t *bits, uint64_t *gaps)
{
    int64_t counts[MAX_ALPHABET] = {0};
    uint64_t samples = 0;
    for (Py_ssize_t i = 0; i < count; i += step) {
        int64_t previous = i ? indices[i - 1] : -1;
        if (indices[i] <= previous)
            return -1;
        uint64_t v = (uint64_t)indices[i] - (uint64_t)previous;
        int exponent = LOG2_64(v), shift = exponent > precision ? exponent - precision : 0;
        counts[(v >> shift) + ((uint64_t)shift << precision)]++;
        samples++;
    }
    int64_t lengths[MAX_ALPHABET];
    unsigned first, last;
    limited_lengths(counts, lengths, &first, &last);
    /* codes and offsets; the table; the block lengths from the spread of the code
     * lengths, in exact integers: floor(8 sqrt(block * variance)) */
    int small = 1 << (precision + 1);
    uint64_t payload = 0;
    unsigned __int128 sum = 0, squares = 0;
    for (int s = 0; s < MAX_ALPHABET; s++) {
        uint64_t offset_bits = s < small ? 0 : (uint64_t)((s - small) >> precision) + 1;
        payload += (uint64_t)counts[s] * ((uint64_t)lengths[s] + offset_bits);
        sum += (unsigned __int128)counts[s] * (uint64_t)lengths[s];
        squares += (unsigned __int128)counts[s] * (uint64_t)(lengths[s] * lengths[s]);
    }
    uint64_t table = 8 * (2 + (4 * (last - first + 1) + 7) / 8);
    uint64_t blocks = samples / block + (samples % block != 0);
    if (blocks > 1) {
        /* floor(64 block variance), the variance being (squares samples - sum**2) /
         * samples**2, split so that with block < samples < 2**40 no product passes 2**128 */
        unsigned __int128 spread = 64 * (squares * samples - sum * sum);
        unsigned __int128 square = (unsigned __int128)samples * samples;
        uint64_t scaled = (uint64_t)(spread / square * block + spread % square * block / square);
        uint64_t root = (uint64_t)sqrt((double)scaled);
        while (root * root > scaled)
            root--;
        while ((root + 1) * (root + 1) <= scaled)
            root++;
        table += 16 + (blocks - 1) * (uint64_t)(root ? LOG2_64(root) + 1 : 0);
    }
    *bits = payload + table;
    *gaps = samples;
    return 0;
}

static PyObject *huffman_estimate(PyObject *module, PyObject *args)
{
    PyObject *object;
    Py_ssize_t step;
    int precision;
    unsigned long long block;
    (void)module;
    if (!PyArg_ParseTuple(args, "OniK:huffman_estimate", &object, &step, &precision, &block))
        return NULL;
    if (precision < 0 || precision > MAX_PRECISION || step < 1 || block < 1)
        return PyErr_Format(PyExc_ValueError, "huffman_estimate needs precision in [0, %d], "
                            "step >= 1 and block >= 1", MAX_PRECISION);
    Py_buffer view;
    if (get_array(object, &view, "indices", INT64, 0) < 0)
        return NULL;
    uint64_t bits = 0, gaps = 0;
    int bad = 1;
    /* the view holds the array's memory while other threads run; the sample (at most
     * HUFFMAN_SAMPLE, 8,192, gaps) is scanned once and the code lengths of its
     * histogram built, which together are worth handing the GIL over from a quarter
     * of the Golomb loops' count */
    RELEASED_BEGIN(view.len / 8 / step, RELEASE_INDICES / 4)
    if (view.len >= 8)
        bad = estimate_gap_bits(view.buf, view.len / 8, step, precision, block, &bits, &gaps);
    RELEASED_END
    PyBuffer_Release(&view);
    if (bad)
        return PyErr_Format(PyExc_ValueError, "huffman_estimate needs 1 or more strictly "
                            "increasing indices from 0");
    return Py_BuildValue("KK", (unsigned long long)bits, (unsigned long long)gaps);
}

/* ------------------------------------------------------------ golomb */

/* The Golomb code of deepreduce.codecs.index.golomb.encode_fields for parameter m: quotient
 * q = gap / m in unary (q zeros and a one), remainder r = gap % m in truncated binary,
 * `width` bits below `threshold`, else width + 1 bits of r + threshold, sent as a
 * width-bit head and one extra bit. The heads of the first `aligned` (count rounded down
 * to 8) values lie in byte planes of `part` bits (8s, then 4, 2, 1:
 * _entropy.plane_widths): a group of 8 values fills `part` bytes of each plane. The
 * tail bitstream holds the heads of the last count % 8 values, the extra bits, then the
 * unary codes.
 *
 * Value i's terminator is unary bit t[i] = (q[0] + ... + q[i]) + i, so index i =
 * m * (t[i] - i) + (r[0] + ... + r[i]) + i: the decoder first lists the terminators'
 * positions (two instructions a bit, no dependency between values) and then adds. The
 * encoder writes the unary part, and the extra bits, in scratch buffers a word at a
 * time without reading memory back, and moves them behind the heads at the end. */
typedef struct {
    uint64_t m, threshold;
    double inverse;
    unsigned width, parts[16], planes;
    int rice;
} golomb_t;

static void golomb_layout(golomb_t *g, uint64_t m)
{
    g->m = m;
    g->width = (unsigned)LOG2_64(m);
    g->threshold = (2ull << g->width) - m;   /* m itself for a power of two */
    g->rice = (m & (m - 1)) == 0;
    g->inverse = 1.0 / (double)m;
    g->planes = 0;
    for (unsigned i = 0; i < g->width / 8; i++)
        g->parts[g->planes++] = 8;
    for (unsigned part = 4; part; part >>= 1)
        if (g->width & part)
            g->parts[g->planes++] = part;
}

/* value / m, and the remainder. Below 2**52 a double reciprocal is at most one off and
 * much cheaper than a 64-bit division. */
static inline uint64_t golomb_divide(const golomb_t *g, uint64_t value, uint64_t *remainder)
{
    uint64_t q;
    if (g->rice)
        q = value >> g->width;
    else if (value < (1ull << 52)) {
        q = (uint64_t)((double)value * g->inverse);
        if (q * g->m > value)
            q--;
        else if (value - q * g->m >= g->m)
            q++;
    } else
        q = value / g->m;
    *remainder = value - q * g->m;
    return q;
}

/* Writes a group's 8 heads into the planes (each groups * part bytes). An 8-byte store
 * spills into the bytes of later groups, written after it; the last groups, whose
 * spill would reach the next plane, are copied exactly. */
static inline void write_group(const golomb_t *g, const uint64_t *head, uint8_t *planes,
                               Py_ssize_t group, Py_ssize_t groups)
{
    unsigned shift = g->width;
    for (unsigned p = 0; p < g->planes; p++) {
        unsigned part = g->parts[p];
        uint64_t mask = (1ull << part) - 1, word = 0;
        shift -= part;
        for (unsigned j = 0; j < 8; j++)
            word |= ((head[j] >> shift) & mask) << (part * (7 - j));
        word <<= 64 - 8 * part;
        if (group + 8 / part <= groups)
            store_be64(planes + group * part, word);
        else
            for (unsigned b = 0; b < part; b++)
                planes[group * part + b] = (uint8_t)(word >> (56 - 8 * b));
        planes += groups * part;
    }
}

/* The `part` (8, 4, 2 or 1) bytes at the top of `word` as 8 digits of `part` bits,
 * the first in byte 0: shifts and masks move the halves, quarters and eighths apart
 * (no table, so nothing waits on a load). */
static ALWAYS_INLINE uint64_t spread_digits(uint64_t word, unsigned part)
{
    uint64_t x = word >> (64 - 8 * part);
    if (part == 4) {
        x = (x | x << 16) & 0x0000FFFF0000FFFFull;
        x = (x | x << 8) & 0x00FF00FF00FF00FFull;
        x = (x | x << 4) & 0x0F0F0F0F0F0F0F0Full;
    }
    else if (part == 2) {
        x = (x | x << 24) & 0x000000FF000000FFull;
        x = (x | x << 12) & 0x000F000F000F000Full;
        x = (x | x << 6) & 0x0303030303030303ull;
    }
    else if (part == 1) {
        x = (x | x << 28) & 0x0000000F0000000Full;
        x = (x | x << 14) & 0x0003000300030003ull;
        x = (x | x << 7) & 0x0101010101010101ull;
    }
    return BSWAP64(x);   /* the digits came out last first */
}

/* Shifts plane `part`'s digits of a group into `lanes`. */
static ALWAYS_INLINE uint64_t add_plane(uint64_t lanes, unsigned width, unsigned part,
                                        const uint8_t *data, uint64_t size, uint64_t *plane,
                                        Py_ssize_t group, Py_ssize_t groups)
{
    if (!(width & part))
        return lanes;
    uint64_t word = window_at(data, size, *plane + (uint64_t)group * part);
    *plane += (uint64_t)groups * part;
    return (lanes << part) | spread_digits(word, part);
}

/* For widths up to 8: a group's 8 heads as the bytes of one word (head j in byte j).
 * Written out rather than looped so that, inlined with a constant width, only that
 * width's planes are left. */
static ALWAYS_INLINE uint64_t read_lanes(unsigned width, const uint8_t *data, uint64_t size,
                                         Py_ssize_t group, Py_ssize_t groups)
{
    uint64_t plane = 0, lanes = 0;
    lanes = add_plane(lanes, width, 8, data, size, &plane, group, groups);
    lanes = add_plane(lanes, width, 4, data, size, &plane, group, groups);
    lanes = add_plane(lanes, width, 2, data, size, &plane, group, groups);
    return add_plane(lanes, width, 1, data, size, &plane, group, groups);
}

static inline void split_lanes(uint64_t lanes, uint64_t *head)
{
    for (unsigned j = 0; j < 8; j++)
        head[j] = (lanes >> (8 * j)) & 0xFF;
}

static ALWAYS_INLINE void read_group(const golomb_t *g, unsigned width, const uint8_t *data,
                                     uint64_t size, Py_ssize_t group, Py_ssize_t groups,
                                     uint64_t *head)
{
    if (width <= 8) {
        split_lanes(read_lanes(width, data, size, group, groups), head);
        return;
    }
    uint64_t plane = 0;
    for (unsigned j = 0; j < 8; j++)
        head[j] = 0;
    for (unsigned p = 0; p < g->planes; p++) {
        unsigned part = g->parts[p];
        uint64_t mask = (1ull << part) - 1;
        uint64_t word = window_at(data, size, plane + (uint64_t)group * part) >> (64 - 8 * part);
        for (unsigned j = 0; j < 8; j++)
            head[j] = (head[j] << part) | ((word >> (part * (7 - j))) & mask);
        plane += (uint64_t)groups * part;
    }
}

/* ORs the first `bits` bits of src (whose bits past them are zero) into dst from bit
 * `at` on; dst needs a byte of slack past the last one. */
static void or_bits_at(uint8_t *dst, uint64_t at, const uint8_t *src, uint64_t bits)
{
    uint8_t *d = dst + (at >> 3);
    unsigned shift = (unsigned)(at & 7);
    uint64_t size = (bits + 7) / 8, b = 0, carry = 0;
    for (; b + 8 <= size; b += 8) {
        uint64_t word = load_be64(src + b);
        store_be64(d + b, load_be64(d + b) | carry | (word >> shift));
        carry = shift ? word << (64 - shift) : 0;
    }
    d[b] |= (uint8_t)(carry >> 56);
    for (; b < size; b++) {
        d[b] |= (uint8_t)(src[b] >> shift);
        d[b + 1] |= (uint8_t)(src[b] << (8 - shift));
    }
}

typedef struct {
    uint64_t quotients, long_codes, adjacent;
} golomb_totals_t;

/* Appends bit `bit` (0 or 1) at `position` of a zeroed, word-aligned stream. The word
 * holding it is stored after every change: no branch (on the bit either), no read back,
 * and words a long quotient skips stay zero; a 0 rewrites the word as it is (or a zero
 * word where the next one starts). */
static ALWAYS_INLINE void put_stream_bit(uint8_t *stream, uint64_t position, uint64_t bit,
                                         uint64_t *word, uint64_t *at)
{
    uint64_t next = position >> 6;
    *word = next == *at ? *word : 0;
    *at = next;
    *word |= (bit << 63) >> (position & 63);
    store_be64(stream + 8 * next, *word);
}

/* The fields of strictly increasing indices: the heads' planes (and, for the last
 * count % 8 values, tail bits) into `out`, zero past the planes; the unary codes into
 * `unary` and the extra bits into `extras`, both zeroed, word-aligned and long enough
 * (with a word of slack). Returns -1, before writing out of bounds, for indices that
 * do not increase from 0. `rice` is a constant where this is inlined: the Rice loop
 * has no division and no extra bits. */
static ALWAYS_INLINE int golomb_write_with(const golomb_t *g, int rice, const int64_t *indices,
                                           Py_ssize_t count, uint8_t *out, uint8_t *unary,
                                           uint8_t *extras, golomb_totals_t *totals)
{
    Py_ssize_t aligned = count & ~(Py_ssize_t)7, groups = aligned / 8;
    uint8_t *tail = out + groups * g->width;
    const uint64_t threshold = g->threshold, low = g->m - 1;
    const unsigned width = g->width;
    const int64_t last = indices[count - 1];
    int64_t previous = -1;
    uint64_t position = 0, adjacent = 0, long_codes = 0, word = 0, at = 0;
    uint64_t extra_word = 0, extra_at = 0, head[8], quotient[8];
    for (Py_ssize_t i = 0; i < count; i += 8) {
        unsigned size = i < aligned ? 8 : (unsigned)(count - i);
        int64_t order = 0;
        for (unsigned j = 0; j < size; j++) {
            int64_t gap = indices[i + j] - previous - 1;
            previous = indices[i + j];
            /* negative unless the indices increase up to the last: that bounds what
             * the unary part can reach (last / m + count bits) before anything is written */
            order |= gap | (last - previous);
            adjacent += gap == 0;
            if (rice) {
                quotient[j] = (uint64_t)gap >> width;
                head[j] = (uint64_t)gap & low;
            } else
                quotient[j] = golomb_divide(g, (uint64_t)gap, &head[j]);
        }
        if (order < 0)
            return -1;
        for (unsigned j = 0; j < size; j++) {
            position += quotient[j];
            put_stream_bit(unary, position++, 1, &word, &at);
            if (!rice) {
                /* about as many long codes as short ones, in random order: no branch */
                uint64_t r = head[j] + threshold, is_long = head[j] >= threshold;
                put_stream_bit(extras, long_codes, r & is_long, &extra_word, &extra_at);
                long_codes += is_long;
                head[j] = is_long ? r >> 1 : head[j];
            }
        }
        if (size == 8)
            write_group(g, head, out, i / 8, groups);
        else
            for (unsigned j = 0; j < size; j++)
                for (unsigned b = 0, bit = j * width; b < width; b++, bit++)
                    tail[bit >> 3] |= (uint8_t)(((head[j] >> (width - 1 - b)) & 1)
                                                << (7 - (bit & 7)));
    }
    totals->quotients = position - (uint64_t)count;
    totals->long_codes = long_codes;
    totals->adjacent = adjacent;
    return 0;
}

static int golomb_write(const golomb_t *g, const int64_t *indices, Py_ssize_t count,
                        uint8_t *out, uint8_t *unary, uint8_t *extras,
                        golomb_totals_t *totals)
{
    if (g->rice)
        return golomb_write_with(g, 1, indices, count, out, unary, extras, totals);
    return golomb_write_with(g, 0, indices, count, out, unary, extras, totals);
}

static PyObject *golomb_encode(PyObject *module, PyObject *args)
{
    PyObject *object;
    unsigned long long m;
    Py_buffer prefix;
    (void)module;
    if (!PyArg_ParseTuple(args, "OKy*:golomb_encode", &object, &m, &prefix))
        return NULL;
    Py_buffer view;
    if (get_array(object, &view, "indices", INT64, 0) < 0) {
        PyBuffer_Release(&prefix);
        return NULL;
    }
    Py_ssize_t count = view.len / 8;
    const int64_t *indices = view.buf;
    PyObject *data = NULL, *result = NULL;
    uint8_t *unary = NULL, *extras = NULL;
    if (m < 1 || count < 1 || indices[count - 1] >= (1ll << 58)) {
        PyErr_SetString(PyExc_ValueError, "golomb_encode needs m >= 1 and 1 or more indices "
                        "below 2**58");
        goto done;
    }
    golomb_t g;
    golomb_totals_t totals;
    golomb_layout(&g, m);
    if (indices[count - 1] < count - 1)
        goto unordered;
    /* The quotients add up to at most (sum of the gaps) / m; before the order is checked,
     * the unary part can only be bounded by last / m + count bits. */
    uint64_t most = ((uint64_t)indices[count - 1] - (uint64_t)(count - 1)) / m;
    Py_ssize_t aligned = count & ~(Py_ssize_t)7, head_bytes = aligned / 8 * g.width;
    uint64_t lead = (uint64_t)(count - aligned) * g.width;
    uint64_t unary_words = ((uint64_t)indices[count - 1] / m + count) / 64 + 2;
    uint64_t extra_words = (uint64_t)count / 64 + 2;
    Py_ssize_t reserve = prefix.len + head_bytes
                         + (Py_ssize_t)((lead + 2 * (uint64_t)count + most + 7) / 8) + 16;
    unary = PyMem_Calloc(unary_words, 8);
    extras = PyMem_Calloc(extra_words, 8);
    data = unary && extras ? PyBytes_FromStringAndSize(NULL, reserve) : PyErr_NoMemory();
    if (data == NULL)
        goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(data);
    int bad;
    memcpy(out, prefix.buf, prefix.len);
    out += prefix.len;
    RELEASED_BEGIN(count, RELEASE_INDICES)
    memset(out + head_bytes, 0, reserve - prefix.len - head_bytes);
    bad = golomb_write(&g, indices, count, out, unary, extras, &totals);
    if (!bad) {
        or_bits_at(out + head_bytes, lead, extras, totals.long_codes);
        or_bits_at(out + head_bytes, lead + totals.long_codes, unary,
                   totals.quotients + (uint64_t)count);
    }
    RELEASED_END
    if (bad) {
        Py_CLEAR(data);
        goto unordered;
    }
    uint64_t tail_bits = lead + totals.long_codes + totals.quotients + (uint64_t)count;
    if (_PyBytes_Resize(&data, prefix.len + head_bytes + (Py_ssize_t)((tail_bits + 7) / 8)) == 0)
        result = Py_BuildValue("NK", data, (unsigned long long)totals.adjacent);
    goto done;
unordered:
    PyErr_SetString(PyExc_ValueError, "indices must be strictly increasing (sorted, unique) "
                    "from 0");
done:
    PyMem_Free(unary);
    PyMem_Free(extras);
    PyBuffer_Release(&view);
    PyBuffer_Release(&prefix);
    return result;
}

/* The stream's 64 bits from byte `byte` with bit b of the stream at bit b of the word
 * (each byte's bits reversed), zeros past the end: set bits come out in stream order
 * from the bottom. */
static inline uint64_t reversed_window(const uint8_t *data, uint64_t size, uint64_t byte)
{
    uint64_t x = BSWAP64(window_at(data, size, byte));   /* stream byte k at bits 8k.. */
    x = ((x >> 1) & 0x5555555555555555ull) | ((x & 0x5555555555555555ull) << 1);
    x = ((x >> 2) & 0x3333333333333333ull) | ((x & 0x3333333333333333ull) << 2);
    return ((x >> 4) & 0x0F0F0F0F0F0F0F0Full) | ((x & 0x0F0F0F0F0F0F0F0Full) << 4);
}

/* Decodes `count` indices below n < 2**58 into out; returns NULL or what is wrong.
 * A true Golomb code (not Rice) reads the heads twice, once to count its long codes (the
 * unary part starts after their extra bits) and once to add them up; `lanes` (room for
 * count / 8 words, or NULL) keeps them between the two when they are bytes. `width` is
 * g->width, a constant where golomb_read inlines this for widths up to 8. */
static ALWAYS_INLINE const char *golomb_read_width(const golomb_t *g, unsigned width,
                                                   const uint8_t *data, uint64_t size,
                                                   Py_ssize_t count, uint64_t n, int64_t *out,
                                                   uint64_t *lanes)
{
    Py_ssize_t aligned = count & ~(Py_ssize_t)7, groups = aligned / 8;
    const uint8_t *tail = data + groups * width;
    uint64_t tail_size = size - (uint64_t)groups * width, tail_bits = 8 * tail_size;
    uint64_t lead = (uint64_t)(count - aligned) * width, long_codes = 0, head[8];
    const uint64_t m = g->m, threshold = g->threshold;
    if (!g->rice) {
        for (Py_ssize_t group = 0; group < groups; group++) {
            if (lanes) {
                lanes[group] = read_lanes(width, data, size, group, groups);
                split_lanes(lanes[group], head);
            }
            else
                read_group(g, width, data, size, group, groups, head);
            for (unsigned j = 0; j < 8; j++)
                long_codes += head[j] >= threshold;
        }
        for (Py_ssize_t i = aligned; i < count; i++)
            long_codes += read_bits(tail, tail_size, (uint64_t)(i - aligned) * width,
                                    width) >= threshold;
    }
    uint64_t start = lead + long_codes;
    if (start > tail_bits)
        return "stream ends inside the remainder bits";
    /* First the terminators' positions (from `start`) into out: bit b of the stream is
     * bit b of `word`, the bits before `start` cleared. */
    Py_ssize_t found = 0;
    uint64_t byte = start >> 3, base = 8 * byte - start;
    uint64_t word = reversed_window(tail, tail_size, byte) & (~0ull << (start & 7));
    for (;;) {
        int64_t *at = out + found;
        Py_ssize_t room = count - found;
        for (; word; word &= word - 1, at++) {
            if (room-- == 0)
                return "unary part holds more terminators than codes (corrupt)";
            *at = (int64_t)(base + LOWEST_BIT(word));
        }
        found = at - out;
        byte += 8;
        base += 64;
        if (byte >= tail_size)
            break;
        word = reversed_window(tail, tail_size, byte);
    }
    if (found < count)
        return "unary part holds fewer terminators than codes (truncated or corrupt)";
    /* Only zero padding, less than a byte of it, may follow the last code. */
    if (tail_bits - (start + (uint64_t)out[count - 1] + 1) > 7)
        return "trailing bytes after the last code";
    if ((uint64_t)out[count - 1] - (uint64_t)(count - 1) > n / m)
        return "quotients alone pass n";
    /* Then index i = m * (t[i] - i) + (r[0] + ... + r[i]) + i. Every m * (t[i] - i) is
     * at most n (t[i] - i grows with i) and the indices increase: with n below 2**58 no
     * sum wraps while a group starts below n. */
    uint64_t remainders = 0, extra_at = lead;
    for (Py_ssize_t i = 0; i < count; i += 8) {
        unsigned size_group = count - i < 8 ? (unsigned)(count - i) : 8;
        if (i < aligned && lanes)
            split_lanes(lanes[i / 8], head);
        else if (i < aligned)
            read_group(g, width, data, size, i / 8, groups, head);
        else
            for (unsigned j = 0; j < size_group; j++)
                head[j] = read_bits(tail, tail_size, (uint64_t)(i + j - aligned) * width,
                                    width);
        /* Long and short codes come in random order: no branch on which. extra_at
         * stays below start, before the count terminators checked above, so the byte
         * read is in the stream even after the last long code. */
        if (!g->rice)
            for (unsigned j = 0; j < size_group; j++) {
                uint64_t is_long = head[j] >= threshold;
                uint64_t extra = (tail[extra_at >> 3] >> (7 - (extra_at & 7))) & 1;
                head[j] = is_long ? 2 * head[j] - threshold + extra : head[j];
                extra_at += is_long;
            }
        int64_t *index = out + i;
        for (unsigned j = 0; j < size_group; j++) {
            remainders += head[j];
            index[j] = (int64_t)(m * ((uint64_t)index[j] - (uint64_t)(i + j)) + remainders
                                 + (uint64_t)(i + j));
        }
        if ((uint64_t)index[size_group - 1] >= n)
            return "gaps add up to an index past n";
    }
    return NULL;
}

static const char *golomb_read(const golomb_t *g, const uint8_t *data, uint64_t size,
                               Py_ssize_t count, uint64_t n, int64_t *out, uint64_t *lanes)
{
#define READ_WIDTH(w) golomb_read_width(g, w, data, size, count, n, out, lanes)
    switch (g->width) {
    case 0: return READ_WIDTH(0);
    case 1: return READ_WIDTH(1);
    case 2: return READ_WIDTH(2);
    case 3: return READ_WIDTH(3);
    case 4: return READ_WIDTH(4);
    case 5: return READ_WIDTH(5);
    case 6: return READ_WIDTH(6);
    case 7: return READ_WIDTH(7);
    case 8: return READ_WIDTH(8);
    default: return READ_WIDTH(g->width);
    }
#undef READ_WIDTH
}

/* The buffers of a decoder's (data, out): a bytes-like stream, a writable int64 array. */
static int get_stream_and_out(PyObject *const *objects, Py_buffer **views)
{
    static const char *const names[2] = {"data", "out"};
    static const kind_t kinds[2] = {BYTES, INT64};
    static const int writable[2] = {0, 1};
    return get_arrays(objects, views, names, kinds, writable, NULL, 2);
}

/* What a decoder returns: None, or what is wrong with the stream. */
static PyObject *problem_or_none(const char *problem)
{
    if (problem)
        return PyUnicode_FromString(problem);
    Py_RETURN_NONE;
}

static PyObject *golomb_decode(PyObject *module, PyObject *args)
{
    PyObject *objects[2];
    unsigned long long m, n;
    (void)module;
    if (!PyArg_ParseTuple(args, "OKKO:golomb_decode", &objects[0], &m, &n, &objects[1]))
        return NULL;
    Py_buffer storage[2], *views[2] = {&storage[0], &storage[1]};
    if (get_stream_and_out(objects, views) < 0)
        return NULL;
    Py_ssize_t count = views[1]->len / 8;
    PyObject *result = NULL;
    golomb_t g;
    if (m < 1 || m > n || n >= (1ull << 58) || count < 1)
        PyErr_SetString(PyExc_ValueError, "golomb_decode needs 1 <= m <= n < 2**58 and "
                        "1 or more outputs");
    else if ((uint64_t)views[0]->len * 8 < (uint64_t)count * (LOG2_64(m) + 1))
        PyErr_SetString(PyExc_ValueError, "data is shorter than count codes");
    else {
        const char *problem;
        golomb_layout(&g, m);
        /* without the memory, the heads are read twice */
        uint64_t *lanes = g.rice || g.width > 8 || count < 8 ? NULL
                          : PyMem_RawMalloc((size_t)(count / 8) * sizeof *lanes);
        RELEASED_BEGIN(count, RELEASE_INDICES)
        problem = golomb_read(&g, views[0]->buf, (uint64_t)views[0]->len, count, n,
                              views[1]->buf, lanes);
        RELEASED_END
        PyMem_RawFree(lanes);
        result = problem_or_none(problem);
    }
    release_all(views, 2);
    return result;
}

/* ------------------------------------------------------------ block packing */

/* deepreduce.codecs.index.blockpack: the gaps (i[0], then i[j] - i[j-1] - 1) in blocks of
 * BLOCK_GAPS, each block at the bit length of its largest gap, MSB first and from a byte
 * boundary, after one width byte per block. No variable-length code: a gap costs a few
 * instructions each way, and none depends on the one before but for the running sum. */
#define BLOCK_GAPS 128
/* Widest field the branch-free loops take: it and up to 7 bits before it fit in 64. */
#define FAST_WIDTH 56

static inline unsigned bit_length(uint64_t x)
{
    return x ? (unsigned)LOG2_64(x) + 1 : 0;
}

/* Appends the low `width` (1..FAST_WIDTH) bits of value, MSB first, at *at, after the
 * *waiting (< 8) low bits of *pending: one unaligned 8-byte store of all that waits
 * (zero bits after it), then the finished bytes are passed, with no branch. The store
 * reaches up to 8 bytes past the field: the buffer needs that much slack. */
static inline void append_field(uint8_t **at, uint64_t *pending, unsigned *waiting,
                                uint64_t value, unsigned width)
{
    *pending = (*pending << width) | value;
    *waiting += width;
    store_be64(*at, *pending << (64 - *waiting));
    *at += *waiting >> 3;
    *waiting &= 7;
}

/* The width of every block into widths; -1 unless the indices increase from 0. */
static int blockpack_widths(const int64_t *indices, Py_ssize_t count, uint8_t *widths)
{
    int64_t previous = -1, order = 0;
    for (Py_ssize_t start = 0; start < count; start += BLOCK_GAPS) {
        Py_ssize_t end = start + BLOCK_GAPS < count ? start + BLOCK_GAPS : count;
        uint64_t seen = 0;
        for (Py_ssize_t i = start; i < end; i++) {
            int64_t gap = indices[i] - previous - 1;
            previous = indices[i];
            order |= gap;
            seen |= (uint64_t)gap;
        }
        widths[start / BLOCK_GAPS] = (uint8_t)bit_length(seen);
    }
    return order < 0 ? -1 : 0;
}

static PyObject *blockpack_encode(PyObject *module, PyObject *args)
{
    PyObject *object;
    (void)module;
    if (!PyArg_ParseTuple(args, "O:blockpack_encode", &object))
        return NULL;
    Py_buffer view;
    if (get_array(object, &view, "indices", INT64, 0) < 0)
        return NULL;
    const int64_t *indices = view.buf;
    Py_ssize_t count = view.len / 8, blocks = (count + BLOCK_GAPS - 1) / BLOCK_GAPS;
    PyObject *data = NULL;
    uint8_t *widths = PyMem_Malloc(blocks ? (size_t)blocks : 1);
    if (widths == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int order;
    Py_BEGIN_ALLOW_THREADS
    order = blockpack_widths(indices, count, widths);
    Py_END_ALLOW_THREADS
    if (order < 0) {
        PyErr_SetString(PyExc_ValueError, "indices must be strictly increasing (sorted, "
                        "unique) from 0");
        goto done;
    }
    Py_ssize_t size = blocks;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t gaps = b + 1 < blocks ? BLOCK_GAPS : count - b * BLOCK_GAPS;
        size += (gaps * widths[b] + 7) / 8;
    }
    /* 8 bytes of slack for append_field's stores, cut off at the end */
    data = PyBytes_FromStringAndSize(NULL, size + 8);
    if (data == NULL)
        goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(data);
    memcpy(out, widths, (size_t)blocks);
    Py_BEGIN_ALLOW_THREADS
    uint8_t *at = out + blocks;
    int64_t previous = -1;
    for (Py_ssize_t start = 0; start < count; start += BLOCK_GAPS) {
        Py_ssize_t gaps = count - start < BLOCK_GAPS ? count - start : BLOCK_GAPS;
        unsigned width = widths[start / BLOCK_GAPS];
        const int64_t *block = indices + start;
        if (width == 0) {  /* gaps of 0 only: no bytes */
            previous = block[gaps - 1];
            continue;
        }
        uint64_t pending = 0;
        unsigned waiting = 0;
        for (Py_ssize_t j = 0; j < gaps; j++) {
            uint64_t gap = (uint64_t)(block[j] - previous - 1);
            if (width <= FAST_WIDTH)
                append_field(&at, &pending, &waiting, gap, width);
            else {  /* (universes past 2**56) in two fields: width - 32 and 32 bits */
                append_field(&at, &pending, &waiting, gap >> 32, width - 32);
                append_field(&at, &pending, &waiting, gap & 0xFFFFFFFFu, 32);
            }
            previous = block[j];
        }
        at += waiting != 0;  /* the zero-padded last byte, stored already */
    }
    Py_END_ALLOW_THREADS
    _PyBytes_Resize(&data, size);  /* on failure: NULL, the error set */
done:
    PyMem_Free(widths);
    PyBuffer_Release(&view);
    return data;
}

/* Decodes `count` (>= 1) indices below n (<= 2**62) into out; NULL or what is wrong.
 * A width above n - 1's bit length is rejected first, so every gap is below 2**63 and
 * a sum from an index below n cannot wrap: the first one to pass n marks the set. */
static const char *blockpack_read(const uint8_t *data, uint64_t size, Py_ssize_t count,
                                  uint64_t n, int64_t *out)
{
    Py_ssize_t blocks = (count + BLOCK_GAPS - 1) / BLOCK_GAPS;
    if (size < (uint64_t)blocks)
        return "stream ends inside the block widths";
    unsigned widest = bit_length(n - 1);
    uint64_t at = (uint64_t)blocks, previous = UINT64_MAX, past = 0;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        unsigned width = data[b];
        if (width > widest)
            return "a block width exceeds the universe's";
        Py_ssize_t start = b * BLOCK_GAPS, gaps = b + 1 < blocks ? BLOCK_GAPS : count - start;
        uint64_t bytes = ((uint64_t)gaps * width + 7) / 8;
        if (size - at < bytes)
            return "stream ends inside a block";
        const uint8_t *block = data + at;
        uint64_t seen = 0;
        if (width >= 1 && width <= FAST_WIDTH && size - at >= bytes + 8) {
            /* the field's 8-byte window lies in the stream: no bounds to check */
            for (Py_ssize_t j = 0; j < gaps; j++) {
                uint64_t bit = (uint64_t)j * width;
                uint64_t gap = (load_be64(block + (bit >> 3)) << (bit & 7)) >> (64 - width);
                seen |= gap;
                previous += gap + 1;
                past |= previous >= n;
                out[start + j] = (int64_t)previous;
            }
        }
        else
            for (Py_ssize_t j = 0; j < gaps; j++) {
                uint64_t gap = read_bits(block, bytes, (uint64_t)j * width, width);
                seen |= gap;
                previous += gap + 1;
                past |= previous >= n;
                out[start + j] = (int64_t)previous;
            }
        if (bit_length(seen) != width)
            return "a block width is not its largest gap's bit length";
        if (past)
            return "gaps add up to an index past n";
        unsigned padding = (unsigned)(8 * bytes - (uint64_t)gaps * width);
        if (padding && (block[bytes - 1] & ((1u << padding) - 1)))
            return "padding bits of a block are not zero";
        at += bytes;
    }
    return at == size ? NULL : "trailing bytes after the last block";
}

static PyObject *blockpack_decode(PyObject *module, PyObject *args)
{
    PyObject *objects[2];
    unsigned long long n;
    (void)module;
    if (!PyArg_ParseTuple(args, "OKO:blockpack_decode", &objects[0], &n, &objects[1]))
        return NULL;
    Py_buffer storage[2], *views[2] = {&storage[0], &storage[1]};
    if (get_stream_and_out(objects, views) < 0)
        return NULL;
    Py_ssize_t count = views[1]->len / 8;
    PyObject *result = NULL;
    if (count < 1 || n < (unsigned long long)count || n > (1ull << 62))
        PyErr_SetString(PyExc_ValueError, "blockpack_decode needs 1 <= len(out) <= n <= 2**62");
    else {
        const char *problem;
        Py_BEGIN_ALLOW_THREADS
        problem = blockpack_read(views[0]->buf, (uint64_t)views[0]->len, count, n,
                                 views[1]->buf);
        Py_END_ALLOW_THREADS
        result = problem_or_none(problem);
    }
    release_all(views, 2);
    return result;
}

/* ------------------------------------------------------------ huffman_encode */

/* deepreduce.codecs.index._entropy.bucket_count: the bucket alphabet of values in [1, 2**63). */
static unsigned bucket_count(int precision)
{
    return (2u << precision) + (62u - (unsigned)precision) * (1u << precision);
}

/* Symbol s's smallest value and offset bits (deepreduce.codecs.index._entropy.bucket_base). */
static void bucket_entry(int precision, unsigned s, uint64_t *base, uint8_t *width)
{
    unsigned small = 2u << precision;
    if (s < small) {
        *base = s;
        *width = 0;
        return;
    }
    unsigned bits = ((s - small) >> precision) + 1;
    uint64_t mantissa = (s - small) & ((1u << precision) - 1);
    *base = ((1ull << precision) + mantissa) << bits;
    *width = (uint8_t)bits;
}

/* The bucket symbols of the gaps of indices (the first counted from -1) and their
 * histogram, as bucket_loop finds them; inlined once per precision. Returns non-zero
 * unless the indices increase strictly from 0 (with every gap below 2**63, so that every
 * symbol lies in the alphabet); what the outputs then hold is unspecified. */
static ALWAYS_INLINE int gap_symbols(const int64_t *restrict index, Py_ssize_t count,
                                     const int precision, uint8_t *restrict symbol,
                                     int64_t *restrict counts)
{
    int64_t previous = -1;
    uint64_t bad = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t current = index[i];
        uint64_t v = (uint64_t)current - (uint64_t)previous;
        bad |= (uint64_t)(current <= previous) | v >> 63;
        previous = current;
        int exponent = LOG2_64(v | 1);
        int bits = exponent > precision ? exponent - precision : 0;
        uint8_t s = (uint8_t)((v >> bits) + ((uint64_t)bits << precision));
        symbol[i] = s;
        counts[s]++;
    }
    return bad != 0;
}

/* The encoder's tables, by bucket symbol. */
typedef struct {
    uint64_t code[MAX_ALPHABET], base[MAX_ALPHABET];
    uint8_t code_length[MAX_ALPHABET], offset_bits[MAX_ALPHABET];
} pack_tables_t;

/* Everything the encoder decides before it writes: the code, the tables' fields and
 * the size of every part of the stream. */
typedef struct {
    pack_tables_t t;                /* per symbol: code, base, code length, offset bits */
    int64_t counts[MAX_ALPHABET];
    unsigned first, last;           /* the used symbols' range: the code-length table */
    uint64_t low;                   /* the shortest block but the last, in bits */
    unsigned width;                 /* bits of each block's excess over it */
    uint64_t header, block_table, code_bytes, offset_bytes;
} huffman_plan_t;

static unsigned varint_size(uint64_t value)
{
    unsigned size = 1;
    while (value >>= 7)
        size++;
    return size;
}

/* A bit writer without branches, for fields of up to 56 bits: `acc` holds the `held`
 * (0..7) bits of the byte not yet complete at its top; each field stores the whole
 * word and moves on by the bytes it completed. The branches of put_bits, taken at
 * random with fields of a few bits, cost more than the stores. The output needs 8
 * bytes of slack past its end; a partial last byte is stored zero-padded. */
typedef struct {
    uint8_t *out;
    uint64_t acc;
    unsigned held;
} fast_writer_t;

static ALWAYS_INLINE void fast_put(fast_writer_t *w, uint64_t value, unsigned width)
{
    /* held + width <= 63 keeps the shift defined; a width of 0 adds nothing */
    w->acc |= (value << 1) << (63 - w->held - width);
    w->held += width;
    store_be64(w->out, w->acc);
    w->out += w->held >> 3;
    w->acc <<= w->held & ~7u;
    w->held &= 7;
}

/* Fields of up to 64 bits: the offsets of gaps from 2**57 on come in two parts. */
static ALWAYS_INLINE void fast_put_wide(fast_writer_t *w, uint64_t value, unsigned width)
{
    if (width > 56) {
        fast_put(w, value >> 32, width - 32);
        value &= 0xFFFFFFFFu;
        width = 32;
    }
    fast_put(w, value, width);
}

/* The bytes a fast writer has written, from `start`. */
static inline uint64_t fast_size(const fast_writer_t *w, const uint8_t *start)
{
    return (uint64_t)(w->out - start) + (w->held != 0);
}

/* The first passes of huffman_encode, into scratch it allocates (*scratch, to be freed
 * with PyMem_RawFree: it runs without the GIL): the symbols of the indices' gaps and
 * their histogram, their Huffman code, then the codes and offsets streams (each after
 * 8 bytes of slack, at *codes and *offsets) with the code bits of every block, and the
 * plan of the tables. Returns 0, -1 for indices that do not increase, -2 when out of
 * memory or -3 when the streams do not come out at the sizes the histogram gives. */
static int huffman_plan(const int64_t *indices, Py_ssize_t count, int precision,
                        Py_ssize_t block, huffman_plan_t *p, uint8_t **scratch,
                        uint8_t **codes, uint8_t **offsets)
{
    Py_ssize_t blocks = count / block + (count % block != 0);
    uint8_t *symbols = PyMem_RawMalloc((size_t)count);
    *scratch = NULL;
    if (symbols == NULL)
        return -2;
    memset(p->counts, 0, sizeof p->counts);
    int bad = precision == 0 ? gap_symbols(indices, count, 0, symbols, p->counts)
            : precision == 1 ? gap_symbols(indices, count, 1, symbols, p->counts)
                             : gap_symbols(indices, count, 2, symbols, p->counts);
    if (bad) {
        PyMem_RawFree(symbols);
        return -1;
    }
    int64_t lengths[MAX_ALPHABET];
    limited_lengths(p->counts, lengths, &p->first, &p->last);
    /* canonical codes (_entropy.canonical_codes): by length, then by symbol */
    pack_tables_t *t = &p->t;
    memset(t->code_length, 0, sizeof t->code_length);
    memset(t->offset_bits, 0, sizeof t->offset_bits);
    uint64_t code = 0, code_bits = 0, offset_bits = 0;
    unsigned previous_length = 0;
    for (unsigned length = 1; length <= MAX_CODE_LENGTH; length++)
        for (unsigned s = p->first; s <= p->last; s++)
            if (lengths[s] == (int64_t)length) {
                code <<= length - previous_length;
                t->code[s] = code++;
                previous_length = length;
            }
    for (unsigned s = p->first; s <= p->last; s++) {
        t->code_length[s] = (uint8_t)lengths[s];
        bucket_entry(precision, s, &t->base[s], &t->offset_bits[s]);
        code_bits += (uint64_t)p->counts[s] * t->code_length[s];
        offset_bits += (uint64_t)p->counts[s] * t->offset_bits[s];
    }
    p->code_bytes = (code_bits + 7) / 8;
    p->offset_bytes = (offset_bits + 7) / 8;
    /* block bits, then both streams, each with 8 bytes of slack */
    size_t size = (size_t)blocks * sizeof(uint32_t) + (size_t)p->code_bytes + 8
                  + (size_t)p->offset_bytes + 8;
    uint8_t *streams = PyMem_RawMalloc(size);
    if (streams == NULL) {
        PyMem_RawFree(symbols);
        return -2;
    }
    *scratch = streams;
    uint32_t *block_bits = (uint32_t *)streams;
    *codes = streams + (size_t)blocks * sizeof(uint32_t);
    *offsets = *codes + p->code_bytes + 8;
    fast_writer_t code_writer = {*codes, 0, 0}, offset_writer = {*offsets, 0, 0};
    int64_t previous = -1;
    for (Py_ssize_t first = 0; first < count; first += block) {
        Py_ssize_t stop = count - first < block ? count : first + block;
        uint32_t bits = 0;
        for (Py_ssize_t i = first; i < stop; i++) {
            unsigned s = symbols[i], length = t->code_length[s];
            uint64_t gap = (uint64_t)indices[i] - (uint64_t)previous;
            previous = indices[i];
            bits += length;
            fast_put(&code_writer, t->code[s], length);
            fast_put_wide(&offset_writer, gap - t->base[s], t->offset_bits[s]);
        }
        block_bits[first / block] = bits;
    }
    PyMem_RawFree(symbols);
    if (fast_size(&code_writer, *codes) != p->code_bytes
            || fast_size(&offset_writer, *offsets) != p->offset_bytes)
        return -3;
    /* the block-length table (huffman._pack_block_lengths): all blocks but the last */
    uint64_t low = UINT64_MAX, high = 0;
    for (Py_ssize_t b = 0; b + 1 < blocks; b++) {
        low = block_bits[b] < low ? block_bits[b] : low;
        high = block_bits[b] > high ? block_bits[b] : high;
    }
    p->low = low;
    p->width = blocks > 1 && high > low ? (unsigned)LOG2_64(high - low) + 1 : 0;
    p->header = 2 + (4 * (uint64_t)(p->last - p->first + 1) + 7) / 8;
    p->block_table = blocks > 1 ? varint_size(low) + 1
                                  + ((uint64_t)(blocks - 1) * p->width + 7) / 8 : 0;
    return 0;
}

/* The stream of huffman_plan's plan into out (exactly its size): the code-length table
 * (_entropy.pack_code_lengths), the block-length table, the codes, the offsets. Returns
 * -3 if the block-length table did not fill its place exactly (which a right plan rules
 * out). */
static int huffman_write(Py_ssize_t count, Py_ssize_t block, const uint32_t *block_bits,
                         const uint8_t *codes, const uint8_t *offsets,
                         const huffman_plan_t *p, uint8_t *out)
{
    uint8_t *at = out;
    /* first symbol, span - 1, then the lengths as 4-bit fields, MSB first */
    at[0] = (uint8_t)p->first;
    at[1] = (uint8_t)(p->last - p->first);
    memset(at + 2, 0, (size_t)(p->header - 2));
    for (unsigned s = p->first; s <= p->last; s++) {
        unsigned j = s - p->first;
        at[2 + j / 2] |= (uint8_t)(p->t.code_length[s] << (j & 1 ? 0 : 4));
    }
    at += p->header;
    int ok = 1;
    Py_ssize_t blocks = count / block + (count % block != 0);
    if (blocks > 1) {
        /* varint minimum (LEB128), width byte, excesses as deepreduce.bits.pack_fixed */
        uint64_t value = p->low;
        for (; value >= 0x80; value >>= 7)
            *at++ = (uint8_t)(value | 0x80);
        *at++ = (uint8_t)value;
        *at++ = (uint8_t)p->width;
        uint8_t *table_end = out + p->header + p->block_table;
        writer_t excess = {at, table_end, 0, 0, 0};
        for (Py_ssize_t b = 0; b + 1 < blocks; b++)
            put_bits(&excess, block_bits[b] - p->low, p->width);
        ok = flush_bits(&excess);
        at = table_end;
    }
    memcpy(at, codes, (size_t)p->code_bytes);
    memcpy(at + p->code_bytes, offsets, (size_t)p->offset_bytes);
    return ok ? 0 : -3;
}

/* huffman.HuffmanIndices.encode of a non-empty set, in one call: about twenty numpy
 * calls on small arrays cost more than the passes themselves. */
static PyObject *huffman_encode(PyObject *module, PyObject *args)
{
    PyObject *object;
    int precision;
    Py_ssize_t block;
    (void)module;
    if (!PyArg_ParseTuple(args, "Oin:huffman_encode", &object, &precision, &block))
        return NULL;
    if (precision < 0 || precision > MAX_PRECISION || block < 1 || block > MAX_BLOCK)
        return PyErr_Format(PyExc_ValueError, "huffman_encode needs precision in [0, %d] and "
                            "block in [1, %d]", MAX_PRECISION, MAX_BLOCK);
    Py_buffer view;
    if (get_array(object, &view, "indices", INT64, 0) < 0)
        return NULL;
    Py_ssize_t count = view.len / 8;
    PyObject *data = NULL;
    huffman_plan_t plan;
    uint8_t *scratch = NULL, *codes = NULL, *offsets = NULL;
    int status = 0;
    if (count < 1) {
        PyErr_SetString(PyExc_ValueError, "huffman_encode needs 1 or more indices");
        goto done;
    }
    /* the view holds the array's memory while other threads run */
    RELEASED_BEGIN(count, RELEASE_INDICES)
    status = huffman_plan(view.buf, count, precision, block, &plan, &scratch, &codes,
                          &offsets);
    RELEASED_END
    if (status == -1)
        /* deepreduce.bits.check_order_of's error: the Python caller leaves the order to us */
        PyErr_SetString(PyExc_ValueError, "indices must be strictly increasing (sorted, unique)");
    else if (status == -2)
        PyErr_NoMemory();
    else if (status == 0) {
        uint64_t size = plan.header + plan.block_table + plan.code_bytes + plan.offset_bytes;
        data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
        if (data == NULL)
            goto done;
        /* The bytes object is not shared yet: filling it without the GIL is safe. */
        RELEASED_BEGIN(count, RELEASE_INDICES)
        status = huffman_write(count, block, (const uint32_t *)scratch, codes, offsets, &plan,
                               (uint8_t *)PyBytes_AS_STRING(data));
        RELEASED_END
    }
    if (status == -3) {
        Py_CLEAR(data);
        PyErr_SetString(PyExc_SystemError, "huffman_encode: the streams do not fill their plan");
    }
done:
    PyMem_RawFree(scratch);
    PyBuffer_Release(&view);
    return data;
}

/* ------------------------------------------------------------ huffman_decode */

/* The Python int high * 2**64 + low. */
static PyObject *sum_of(uint64_t high, uint64_t low)
{
    PyObject *high_part = PyLong_FromUnsignedLongLong(high);
    PyObject *shift = PyLong_FromLong(64);
    PyObject *shifted = high_part && shift ? PyNumber_Lshift(high_part, shift) : NULL;
    PyObject *low_part = shifted ? PyLong_FromUnsignedLongLong(low) : NULL;
    PyObject *result = low_part ? PyNumber_Or(shifted, low_part) : NULL;
    Py_XDECREF(high_part);
    Py_XDECREF(shift);
    Py_XDECREF(shifted);
    Py_XDECREF(low_part);
    return result;
}

/* How huffman_read ended. */
enum { READ_OK, READ_PROBLEM, READ_PAST_N, READ_NO_MEMORY };

typedef struct {
    char message[128];              /* READ_PROBLEM: what is wrong, worded as in Python */
    uint64_t high, low;             /* READ_PAST_N: the exact sum of the gaps */
} read_result_t;

#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 2, 3)))
#endif
static int read_problem(read_result_t *r, const char *format, ...)
{
    va_list arguments;
    va_start(arguments, format);
    vsnprintf(r->message, sizeof r->message, format, arguments);
    va_end(arguments);
    return READ_PROBLEM;
}

/* _entropy.kraft_ok: the lengths (0..15) form a complete prefix code, or one 1-bit code. */
static int kraft_complete(const uint8_t *lengths, unsigned alphabet)
{
    unsigned used = 0, top = 0, single = 0;
    for (unsigned s = 0; s < alphabet; s++)
        if (lengths[s]) {
            used++;
            single = lengths[s];
            top = lengths[s] > top ? lengths[s] : top;
        }
    if (used <= 1)
        return used == 1 && single == 1;
    uint64_t sum = 0;
    for (unsigned s = 0; s < alphabet; s++)
        if (lengths[s])
            sum += 1ull << (top - lengths[s]);
    return sum == 1ull << top;
}

/* Lanes 0 .. lanes-1 of `steps` symbols each, from starts[lane] on, into symbols lane
 * after lane: LANE_GROUP lanes at a time (their chains of window reads are independent)
 * and up to three symbols a window (decode_window). Returns whether a lane met bits that
 * start no code or ended anywhere but at starts[lane + 1] (starts holds lanes + 1
 * entries). */
static int decode_blocks(const uint8_t *data, uint64_t size, const int64_t *starts,
                         Py_ssize_t lanes, Py_ssize_t steps, unsigned peek,
                         const uint16_t *table, uint8_t *symbols)
{
    unsigned drop = 64 - peek;
    uint64_t wrong = 0;
    Py_ssize_t lane = 0;
    for (; lane + LANE_GROUP <= lanes; lane += LANE_GROUP) {
        uint64_t position[LANE_GROUP];
        uint8_t lane_bad[LANE_GROUP] = {0};
        for (int j = 0; j < LANE_GROUP; j++)
            position[j] = (uint64_t)starts[lane + j];
        for (Py_ssize_t step = 0; step < steps; step += 3) {
            Py_ssize_t count = steps - step < 3 ? steps - step : 3;
            for (int j = 0; j < LANE_GROUP; j++)
                position[j] = decode_window(data, size, table, drop, position[j],
                                            symbols + (lane + j) * steps + step, count,
                                            &lane_bad[j]);
        }
        for (int j = 0; j < LANE_GROUP; j++)
            wrong |= (position[j] != (uint64_t)starts[lane + j + 1]) | lane_bad[j];
    }
    for (; lane < lanes; lane++) {
        uint64_t position = (uint64_t)starts[lane];
        uint8_t lane_bad = 0;
        for (Py_ssize_t step = 0; step < steps; step += 3)
            position = decode_window(data, size, table, drop, position,
                                     symbols + lane * steps + step,
                                     steps - step < 3 ? steps - step : 3, &lane_bad);
        wrong |= (position != (uint64_t)starts[lane + 1]) | lane_bad;
    }
    return wrong != 0;
}

/* The gaps of symbols i.. from the offsets at *position on, summed into out (*low and
 * *high: the running sum in 128 bits), while 9 bytes of data lie from the position on:
 * the window is read without a bounds check or a branch on the width (an empty field
 * shifts its window out), which leaves the loop a chain of adds. Offsets are at most 62
 * bits wide. Returns the first symbol not read. */
static ALWAYS_INLINE Py_ssize_t offsets_loop(const uint8_t *data, uint64_t size,
                                             uint64_t *position, Py_ssize_t i,
                                             Py_ssize_t count, const uint8_t *symbols,
                                             const uint64_t *base, const uint8_t *width,
                                             int64_t *out, uint64_t *low, uint64_t *high)
{
    uint64_t at = *position, sum = *low, carry = *high;
    for (; i < count && (at >> 3) + 9 <= size; i++) {
        unsigned s = symbols[i], w = width[s], shift = (unsigned)(at & 7);
        const uint8_t *bytes = data + (at >> 3);
        /* 64 bits from the position: the ninth byte fills the shifted-out end */
        uint64_t word = load_be64(bytes) << shift | (uint64_t)bytes[8] >> (8 - shift);
        uint64_t gap = base[s] + ((word >> 1) >> (63 - w));
        at += w;
        sum += gap;
        carry += sum < gap;
        out[i] = (int64_t)(sum - 1);
    }
    *position = at;
    *low = sum;
    *high = carry;
    return i;
}

/* The gaps base[s] + offset of every symbol, summed into out as they are read (out[i]:
 * the sum of gaps 0..i less one; *total_high:*total_low, their exact sum in 128 bits):
 * offsets_loop on the data, then on a zero-padded copy of its last bytes (dense sets
 * have few offset bits: their whole stream may lie there), then bit by bit for fields
 * past that (only in malformed streams). Returns the position after the last offset. */
static uint64_t read_offsets(const uint8_t *data, uint64_t size, uint64_t position,
                             const uint8_t *symbols, Py_ssize_t count, const uint64_t *base,
                             const uint8_t *width, int64_t *out, uint64_t *total_high,
                             uint64_t *total_low)
{
    uint64_t low = 0, high = 0;
    Py_ssize_t i = offsets_loop(data, size, &position, 0, count, symbols, base, width, out,
                                &low, &high);
    if (i < count) {
        /* fewer than 9 bytes are left from the position's byte (or none, past the end) */
        uint8_t tail[24] = {0};
        uint64_t first = position >> 3, relative = position & 7;
        if (first < size)
            memcpy(tail, data + first, (size_t)(size - first));
        i = offsets_loop(tail, sizeof tail, &relative, i, count, symbols, base, width, out,
                         &low, &high);
        position = 8 * first + relative;
    }
    for (; i < count; i++) {
        unsigned s = symbols[i];
        uint64_t gap = base[s] + read_bits(data, size, position, width[s]);
        position += width[s];
        low += gap;
        high += low < gap;
        out[i] = (int64_t)(low - 1);
    }
    *total_high = high;
    *total_low = low;
    return position;
}

/* huffman.HuffmanIndices.decode (numpy path) of nnz >= 1 indices below n into out,
 * with its checks in its order, so that a malformed stream gets its message. Scratch
 * (the block starts, the decode table and the symbols) is sized from the stream, which
 * must hold a bit per index before anything is allocated. */
static int huffman_read(const uint8_t *data, uint64_t size, Py_ssize_t nnz, int precision,
                        Py_ssize_t block, uint64_t n, int64_t *out, read_result_t *r)
{
    if (8 * size < (uint64_t)nnz)
        return read_problem(r, "%llu bytes cannot hold %lld codes", (unsigned long long)size,
                       (long long)nnz);
    /* the code lengths (_entropy.unpack_code_lengths) */
    unsigned alphabet = bucket_count(precision);
    if (size < 2)
        return read_problem(r, "code table truncated");
    unsigned first = data[0], span = data[1] + 1u;
    if (first + span > alphabet)
        return read_problem(r, "code table names symbols up to %u, the alphabet has %u",
                       first + span - 1, alphabet);
    uint64_t offset = 2 + (4 * span + 7) / 8;
    if (size < offset)
        return read_problem(r, "code table truncated");
    if ((span & 1) && (data[offset - 1] & 0x0F))
        return read_problem(r, "padding bits of the last byte are not zero");
    uint8_t lengths[MAX_ALPHABET] = {0}, offset_bits[MAX_ALPHABET] = {0};
    uint64_t base[MAX_ALPHABET] = {0};
    unsigned peek = 0;
    for (unsigned j = 0; j < span; j++) {
        unsigned length = (data[2 + j / 2] >> (j & 1 ? 0 : 4)) & 0x0F;
        lengths[first + j] = (uint8_t)length;
        peek = length > peek ? length : peek;
        bucket_entry(precision, first + j, &base[first + j], &offset_bits[first + j]);
    }
    if (!lengths[first] || !lengths[first + span - 1] || !kraft_complete(lengths, alphabet))
        return read_problem(r, "code lengths do not form a complete prefix code");
    if (lengths[0])
        return read_problem(r, "code table gives a code to symbol 0 (a zero gap)");
    /* the block lengths (huffman._unpack_block_lengths) */
    Py_ssize_t blocks = nnz / block + (nnz % block != 0);
    uint64_t limit = (uint64_t)block * MAX_CODE_LENGTH, low = 0;
    unsigned width = 0;
    const uint8_t *table_bytes = NULL;
    uint64_t table_size = 0;
    if (blocks > 1) {
        /* deepreduce.bits.read_varint, with its checks in its order */
        int overflow = 0, group = 0;
        for (;; group++) {
            if (group == MAX_VARINT_GROUPS)
                return read_problem(r, "varint longer than %d bytes", MAX_VARINT_GROUPS);
            if (offset + group >= size)
                return read_problem(r, "varint truncated at the end of the stream");
            uint64_t byte = data[offset + group], bits = byte & 0x7F;
            overflow |= group == MAX_VARINT_GROUPS - 1 && bits > 1;
            low |= bits << (7 * group);
            if (byte < 0x80) {
                if (group && byte == 0)
                    return read_problem(r, "varint not in its shortest form");
                if (overflow)
                    return read_problem(r, "varint overflows 64 bits");
                break;
            }
        }
        offset += group + 1;
        if (offset >= size)
            return read_problem(r, "block length table truncated");
        width = data[offset++];
        if (low > limit || width > (unsigned)LOG2_64(limit) + 1)
            return read_problem(r, "block lengths exceed %llu bits", (unsigned long long)limit);
        table_size = ((uint64_t)(blocks - 1) * width + 7) / 8;
        if (size - offset < table_size)
            return read_problem(r, "block length table truncated");
        table_bytes = data + offset;
        unsigned padding = (unsigned)(8 * table_size - (uint64_t)(blocks - 1) * width);
        if (padding && (table_bytes[table_size - 1] & ((1u << padding) - 1)))
            return read_problem(r, "padding bits of the last byte are not zero");
        offset += table_size;
    }
    /* Every index has a code of a bit at least: nnz bounds the scratch by the stream. */
    size_t table_entries = (size_t)1 << peek;
    uint8_t *scratch = PyMem_RawMalloc((size_t)blocks * sizeof(int64_t)
                                       + table_entries * sizeof(uint16_t) + (size_t)nnz);
    if (scratch == NULL)
        return READ_NO_MEMORY;
    int64_t *starts = (int64_t *)scratch;
    uint16_t *table = (uint16_t *)(starts + blocks);
    uint8_t *symbols = (uint8_t *)(table + table_entries);
    int status = READ_OK;
    uint64_t longest = 0;
    starts[0] = 0;
    for (Py_ssize_t b = 1; b < blocks; b++) {
        uint64_t bits = low + read_bits(table_bytes, table_size, (uint64_t)(b - 1) * width,
                                        width);
        longest = bits > longest ? bits : longest;
        starts[b] = starts[b - 1] + (int64_t)bits;
    }
    const uint8_t *stream = data + offset;
    uint64_t stream_size = size - offset;
    if (longest > limit)
        status = read_problem(r, "block lengths exceed %llu bits", (unsigned long long)limit);
    else if (8 * stream_size < (uint64_t)nnz)
        status = read_problem(r, "%llu bytes cannot hold %lld codes",
                         (unsigned long long)stream_size, (long long)nnz);
    else if ((uint64_t)starts[blocks - 1] > 8 * stream_size)
        status = read_problem(r, "block lengths run past the end of the stream");
    if (status != READ_OK)
        goto done;
    /* The lengths form a complete code (checked above): the table fills exactly. */
    fill_table(lengths, alphabet, peek, table);
    int wrong = decode_blocks(stream, stream_size, starts, blocks - 1, block, peek, table,
                              symbols);
    /* The last lane decodes only its own symbols; it is checked through them. */
    Py_ssize_t tail_start = (blocks - 1) * block;
    uint8_t tail_bad = 0;
    uint64_t code_end = (uint64_t)starts[blocks - 1];
    for (Py_ssize_t i = tail_start; i < nnz; i += 3)
        code_end = decode_window(stream, stream_size, table, 64 - peek, code_end, symbols + i,
                                 nnz - i < 3 ? nnz - i : 3, &tail_bad);
    uint64_t code_bytes = (code_end + 7) / 8;
    if (wrong)
        status = read_problem(r, "a block does not decode to its stored length");
    else if (tail_bad)
        status = read_problem(r, "bits that start no code in the last block");
    else if (code_bytes > stream_size)
        status = read_problem(r, "stream ends inside the codes");
    else if (code_end % 8 && (stream[code_bytes - 1] & ((1u << (8 - code_end % 8)) - 1)))
        status = read_problem(r, "padding bits after the codes are not zero");
    if (status != READ_OK)
        goto done;
    /* The offsets, read and summed into indices at once; reads past the end of the stream
     * see zeros, and the length check below refuses such streams. */
    uint64_t end = read_offsets(stream, stream_size, 8 * code_bytes, symbols, nnz, base,
                                offset_bits, out, &r->high, &r->low);
    uint64_t total = end - 8 * code_bytes, expected = code_bytes + (total + 7) / 8;
    if (stream_size != expected)
        status = read_problem(r, "stream holds %llu bytes after the tables, the codes and offsets "
                         "take %llu", (unsigned long long)stream_size,
                         (unsigned long long)expected);
    else if (total % 8 && (stream[stream_size - 1] & ((1u << (8 - total % 8)) - 1)))
        status = read_problem(r, "padding bits after the offsets are not zero");
    else if (r->high || r->low > n)
        status = READ_PAST_N;
done:
    PyMem_RawFree(scratch);
    return status;
}

static PyObject *huffman_decode(PyObject *module, PyObject *args)
{
    PyObject *objects[2];
    unsigned long long n;
    int precision;
    Py_ssize_t block;
    (void)module;
    if (!PyArg_ParseTuple(args, "OKinO:huffman_decode", &objects[0], &n, &precision, &block,
                          &objects[1]))
        return NULL;
    if (precision < 0 || precision > MAX_PRECISION || block < 1 || block > MAX_BLOCK
            || n > (1ull << 62))
        return PyErr_Format(PyExc_ValueError, "huffman_decode needs precision in [0, %d], "
                            "block in [1, %d] and n <= 2**62", MAX_PRECISION, MAX_BLOCK);
    Py_buffer storage[2], *views[2] = {&storage[0], &storage[1]};
    if (get_stream_and_out(objects, views) < 0)
        return NULL;
    Py_ssize_t nnz = views[1]->len / 8;
    PyObject *result = NULL;
    read_result_t outcome;
    int status = READ_OK;
    if (nnz < 1)
        PyErr_SetString(PyExc_ValueError, "huffman_decode needs room for 1 or more indices");
    else {
        RELEASED_BEGIN(nnz, RELEASE_INDICES)
        status = huffman_read(views[0]->buf, (uint64_t)views[0]->len, nnz, precision, block,
                              n, views[1]->buf, &outcome);
        RELEASED_END
        if (status == READ_OK) {
            result = Py_None;
            Py_INCREF(result);
        }
        else if (status == READ_PROBLEM)
            result = PyUnicode_FromString(outcome.message);
        else if (status == READ_PAST_N)
            result = sum_of(outcome.high, outcome.low);
        else
            PyErr_NoMemory();
    }
    release_all(views, 2);
    return result;
}

/* ------------------------------------------------------------ runs */

static uint64_t gcd64(uint64_t a, uint64_t b)
{
    while (b) {
        uint64_t rest = a % b;
        a = b;
        b = rest;
    }
    return a;
}

/* deepreduce.codecs.index.runs.fields: the runs of a strictly increasing set of indices
 * >= 0 in units of the largest number dividing every run's start and length, as the
 * zero gaps before each run and each length less one, written to zeros and lengths
 * (room for one entry per index; only the first `runs` are written). */
static PyObject *run_fields(PyObject *module, PyObject *args)
{
    PyObject *objects[3];
    (void)module;
    if (!PyArg_ParseTuple(args, "OOO:run_fields", &objects[0], &objects[1], &objects[2]))
        return NULL;
    static const char *const names[3] = {"indices", "zeros", "lengths"};
    static const kind_t kinds[3] = {INT64, INT64, INT64};
    static const int writable[3] = {0, 1, 1};
    Py_buffer storage[3], *views[3] = {&storage[0], &storage[1], &storage[2]};
    if (get_arrays(objects, views, names, kinds, writable, NULL, 3) < 0)
        return NULL;
    Py_ssize_t count = views[0]->len / 8, runs = 0;
    const int64_t *index = views[0]->buf;
    int64_t *zeros = views[1]->buf, *lengths = views[2]->buf;
    uint64_t unit = 0;
    int bad = count < 1 || views[1]->len < views[0]->len || views[2]->len < views[0]->len;
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        /* Where each run starts, without a branch on it: every position is written
         * to the current slot, which advances past the starts. */
        bad = index[0] < 0;
        zeros[0] = 0;
        runs = 1;
        for (Py_ssize_t i = 1; i < count; i++) {
            zeros[runs] = i;
            bad |= index[i] <= index[i - 1];
            runs += index[i] != index[i - 1] + 1;
        }
        /* Each run's start and length, and the gcd of the lengths (then starts). */
        for (Py_ssize_t j = 0; j < runs; j++) {
            Py_ssize_t first = (Py_ssize_t)zeros[j], next = j + 1 < runs ? zeros[j + 1] : count;
            zeros[j] = index[first];
            lengths[j] = next - first;
            if (unit != 1)
                unit = gcd64(unit, (uint64_t)lengths[j]);
        }
        for (Py_ssize_t j = 0; j < runs && unit > 1; j++)
            unit = gcd64(unit, (uint64_t)zeros[j]);
        int64_t end = 0;   /* of the run before, in units */
        for (Py_ssize_t j = 0; j < runs; j++) {
            int64_t start = zeros[j] / (int64_t)unit, length = lengths[j] / (int64_t)unit;
            zeros[j] = j ? start - end - 1 : start;
            lengths[j] = length - 1;
            end = start + length;
        }
        Py_END_ALLOW_THREADS
    }
    release_all(views, 3);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "run_fields needs 1 or more strictly increasing "
                        "indices >= 0 and room for as many fields");
        return NULL;
    }
    return Py_BuildValue("Kn", (unsigned long long)unit, runs);
}

/* golomb.field_bits: the bits of the Golomb code of non-negative int64 values with
 * parameter m; None when a value is negative or the total would pass 2**64. */
static PyObject *golomb_bits(PyObject *module, PyObject *args)
{
    PyObject *object;
    unsigned long long m;
    (void)module;
    if (!PyArg_ParseTuple(args, "OK:golomb_bits", &object, &m))
        return NULL;
    if (m < 1) {
        PyErr_SetString(PyExc_ValueError, "golomb_bits needs m >= 1");
        return NULL;
    }
    Py_buffer view;
    if (get_array(object, &view, "values", INT64, 0) < 0)
        return NULL;
    Py_ssize_t count = view.len / 8;
    const int64_t *value = view.buf;
    golomb_t g;
    golomb_layout(&g, m);
    uint64_t quotients = 0, long_codes = 0;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t remainder, q = golomb_divide(&g, (uint64_t)value[i], &remainder);
        bad |= value[i] < 0;
        quotients += q;
        bad |= quotients < q;   /* wrapped */
        long_codes += remainder >= g.threshold;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    uint64_t fixed = (uint64_t)count * (g.width + 1) + long_codes;
    if (bad || quotients + fixed < fixed)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(quotients + fixed);
}

static PyMethodDef methods[] = {
    {"bucket_symbols", bucket_symbols, METH_VARARGS,
     "bucket_symbols(values, precision, symbols, offset_bits, counts) -> None\n\n"
     "Bucket symbol and offset bit length (writable uint8 arrays, offset_bits may be\n"
     "None) of every positive int64 value, precision 0..2 (see\n"
     "deepreduce.codecs.index._entropy.bucket_symbols); counts (writable int64 of 256 entries,\n"
     "or None) receives the histogram of the symbols."},
    {"huffman_depths", huffman_depths, METH_VARARGS,
     "huffman_depths(weights, depths) -> None\n\n"
     "Leaf depths (writable int64) of the Huffman tree of 1 to 256 weights (int64,\n"
     "non-negative, total below 2**63), equal weights merged in the order of\n"
     "deepreduce.codecs.index._entropy._huffman_depths (by weight, then creation)."},
    {"huffman_estimate", huffman_estimate, METH_VARARGS,
     "huffman_estimate(indices, step, precision, block) -> (bits, gaps)\n\n"
     "deepreduce.codecs.index.huffman.estimate_bits of the gaps of every step-th index of\n"
     "1 or more strictly increasing int64 indices from 0 (the first counted from -1),\n"
     "and the number of those gaps; ValueError if they do not increase."},
    {"huffman_encode", huffman_encode, METH_VARARGS,
     "huffman_encode(indices, precision, block) -> bytes\n\n"
     "deepreduce.codecs.index.huffman.HuffmanIndices(precision, block).encode of 1 or more\n"
     "strictly increasing int64 indices from 0 (precision 0..2, block 1..2**24): the\n"
     "numpy path's bytes. ValueError if the indices do not increase."},
    {"huffman_decode", huffman_decode, METH_VARARGS,
     "huffman_decode(data, n, precision, block, out) -> None, str or int\n\n"
     "The inverse of huffman_encode into out (int64, one entry per index, at least one):\n"
     "None; or what is wrong with the stream, worded as the numpy path's DecodeError; or,\n"
     "when the gaps add up past n (<= 2**62), their exact sum, with out holding their\n"
     "running sums less one, modulo 2**64. out is unspecified unless None is returned."},
    {"golomb_encode", golomb_encode, METH_VARARGS,
     "golomb_encode(indices, m, prefix) -> (data, adjacent)\n\n"
     "prefix (bytes) followed by deepreduce.codecs.index.golomb.encode_fields of the gaps of\n"
     "indices (int64, strictly increasing from 0, at least one, all below 2**58)\n"
     "with parameter m, and the number of zero gaps (adjacent indices)."},
    {"golomb_decode", golomb_decode, METH_VARARGS,
     "golomb_decode(data, m, n, out) -> None or str\n\n"
     "The inverse of golomb_encode (without the prefix) into out (int64, one entry\n"
     "per index), for 1 <= m <= n < 2**58: None, or what is wrong with the stream\n"
     "(too few or too many codes, an index at or past n); out is then unspecified."},
    {"blockpack_encode", blockpack_encode, METH_VARARGS,
     "blockpack_encode(indices) -> bytes\n\n"
     "The block-packed stream of strictly increasing int64 indices from 0 (see\n"
     "deepreduce.codecs.index.blockpack); ValueError if they do not increase."},
    {"blockpack_decode", blockpack_decode, METH_VARARGS,
     "blockpack_decode(data, n, out) -> None or str\n\n"
     "Decodes len(out) indices below n from a block-packed stream into out (int64);\n"
     "returns what is wrong with a malformed stream (out then unspecified)."},
    {"run_fields", run_fields, METH_VARARGS,
     "run_fields(indices, zeros, lengths) -> (unit, runs)\n\n"
     "The runs of 1 or more strictly increasing int64 indices >= 0, in units of the\n"
     "largest number dividing every run's start and length: the zero gaps before each\n"
     "run and each length less one, in the first runs entries of zeros and lengths\n"
     "(writable int64, as long as indices). See deepreduce.codecs.index.runs.fields."},
    {"golomb_bits", golomb_bits, METH_VARARGS,
     "golomb_bits(values, m) -> int or None\n\n"
     "The bit length of the Golomb code of int64 values with parameter m (see\n"
     "deepreduce.codecs.index.golomb.field_bits); None when a value is negative or the\n"
     "total passes 2**64."},
    {NULL, NULL, 0, NULL},
};

DEFINE_MODULE(_entropyc, "deepreduce.codecs.index._entropyc",
              "Compiled loops of the Huffman and Golomb index codecs "
              "(deepreduce.codecs.index.huffman, golomb).", 0)
