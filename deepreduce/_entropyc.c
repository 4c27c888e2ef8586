/*
 * Compiled loops of deepreduce's Huffman index codec (deepreduce.codecs.huffman).
 *
 * A prefix code is sequential by nature: numpy decodes it in lockstep lanes, a dozen
 * whole-array operations per three symbols, and packs variable-width fields with
 * running sums over four arrays, after gathers from the code tables. Here each
 * direction is a few passes over the data. The numpy code (codecs/huffman.py and
 * codecs/_entropy.py) stays as the fallback when this module is not built; both must
 * give the same bits, and the tests compare them. Streams are MSB-first (stream bit b
 * is bit 7 - b % 8 of byte b // 8); "tables" below are indexed by bucket symbol.
 *
 *   bucket_symbols(values, precision, symbols, offset_bits) -> None
 *       _entropy.bucket_symbols into two uint8 arrays.
 *   pack_buckets(values, symbols, codes, code_lengths, base, offset_bits, block,
 *                block_bits) -> (code_bytes, offset_bytes)
 *       the encoder's codes and offsets streams and the bit length of every block.
 *   decode_lanes(data, starts, steps, code_lengths, symbols, ends, bad) -> None
 *       huffman.decode_lanes, from the canonical code's lengths.
 *   bucket_values(data, bit_offset, symbols, base, offset_bits, out) -> None
 *       _entropy.unpack_varlen of the offsets plus _entropy.bucket_values.
 *
 * Decoders are handed untrusted streams: every read is bounded by the buffer's size
 * (bits past the end read as zeros, as numpy's zero padding does), and argument
 * errors raise TypeError or ValueError before any loop runs. The loops run without
 * the GIL, so other Python threads (Horovod's) keep going.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Longest code the lane decoder accepts: deepreduce.codecs._entropy.MAX_CODE_LENGTH. */
#define MAX_CODE_LENGTH 15
/* Symbols are bytes. */
#define MAX_ALPHABET 256
/* Lanes decoded at once: their dependency chains (position, window, lookup) are
 * independent, so the processor overlaps them. */
#define LANE_GROUP 4
/* Bucket symbols of precision 0..2 fit in one byte (at most 247). */
#define MAX_PRECISION 2

/* ------------------------------------------------------------ bit access */

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

/* The `width` (0..64) stream bits starting at bit `position`, as a number. */
static inline uint64_t read_bits(const uint8_t *data, uint64_t size, uint64_t position,
                                 unsigned width)
{
    if (width == 0)
        return 0;
    uint64_t byte = position >> 3;
    unsigned shift = (unsigned)(position & 7);
    uint64_t word = window_at(data, size, byte) << shift;
    /* A field of more than 64 - shift bits ends in the ninth byte. */
    if (width + shift > 64 && byte + 8 < size)
        word |= (uint64_t)data[byte + 8] >> (8 - shift);
    return word >> (64 - width);
}

/* ------------------------------------------------------------ argument checks */

/* numpy exports uint8 as 'B', uint64 as 'L' (or 'Q' where long is 4 bytes), int64 as
 * 'l'/'q'; an optional native/little-endian prefix is fine on a little-endian host. */
static int has_format(const Py_buffer *view, Py_ssize_t itemsize, const char *codes)
{
    const char *format = view->format ? view->format : "B";
    if (*format == '@' || *format == '=' || (*format == '<' && PY_LITTLE_ENDIAN)
            || (*format == '>' && !PY_LITTLE_ENDIAN))
        format++;
    return view->itemsize == itemsize && strlen(format) == 1 && strchr(codes, *format);
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

/* Index of the first length above `limit`, or -1. */
static Py_ssize_t first_above(const uint8_t *lengths, Py_ssize_t count, unsigned limit)
{
    for (Py_ssize_t i = 0; i < count; i++)
        if (lengths[i] > limit)
            return i;
    return -1;
}

/* ------------------------------------------------------------ bucket_symbols */

/* Inlined once per precision, so that the shifts by it are constants. Returns the
 * index of the first value below 1, or -1 (what the symbols then hold is unspecified). */
static inline Py_ssize_t bucket_loop(const int64_t *restrict value, Py_ssize_t count,
                                     const int precision, uint8_t *restrict symbol,
                                     uint8_t *restrict offset)
{
    int nonpositive = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        nonpositive |= value[i] < 1;
        uint64_t v = (uint64_t)value[i];
        /* OR-ing 1 keeps the logarithm of 0 defined and no other changes. */
        int exponent = LOG2_64(v | 1);
        int bits = exponent > precision ? exponent - precision : 0;
        /* v >> bits is the leading one and `precision` bits below it, in
         * [2**precision, 2**(precision + 1)), unless v is small (bits == 0). */
        symbol[i] = (uint8_t)((v >> bits) + ((uint64_t)bits << precision));
        offset[i] = (uint8_t)bits;
    }
    if (nonpositive)
        for (Py_ssize_t i = 0; i < count; i++)
            if (value[i] < 1)
                return i;
    return -1;
}

static PyObject *bucket_symbols(PyObject *module, PyObject *args)
{
    PyObject *values_object, *symbols_object, *offset_bits_object;
    int precision;
    (void)module;
    if (!PyArg_ParseTuple(args, "OiOO:bucket_symbols", &values_object, &precision,
                          &symbols_object, &offset_bits_object))
        return NULL;
    if (precision < 0 || precision > MAX_PRECISION)
        return PyErr_Format(PyExc_ValueError, "precision must be in [0, %d], got %d",
                            MAX_PRECISION, precision);
    Py_buffer values, symbols, offset_bits;
    if (get_array(values_object, &values, "values", INT64, 0) < 0)
        return NULL;
    if (get_array(symbols_object, &symbols, "symbols", UINT8, 1) < 0) {
        PyBuffer_Release(&values);
        return NULL;
    }
    if (get_array(offset_bits_object, &offset_bits, "offset_bits", UINT8, 1) < 0) {
        PyBuffer_Release(&values);
        PyBuffer_Release(&symbols);
        return NULL;
    }
    Py_buffer *views[] = {&values, &symbols, &offset_bits};
    Py_ssize_t count = values.len / 8, bad = -1;
    PyObject *result = NULL;
    if (symbols.len != count || offset_bits.len != count)
        PyErr_Format(PyExc_ValueError, "symbols and offset_bits must hold %zd entries, got "
                     "%zd and %zd", count, symbols.len, offset_bits.len);
    else {
        const int64_t *value = values.buf;
        Py_BEGIN_ALLOW_THREADS
        bad = precision == 0 ? bucket_loop(value, count, 0, symbols.buf, offset_bits.buf)
            : precision == 1 ? bucket_loop(value, count, 1, symbols.buf, offset_bits.buf)
                             : bucket_loop(value, count, 2, symbols.buf, offset_bits.buf);
        Py_END_ALLOW_THREADS
        if (bad >= 0)
            PyErr_Format(PyExc_ValueError, "values[%zd] = %lld is not positive", bad,
                         (long long)value[bad]);
        else {
            result = Py_None;
            Py_INCREF(result);
        }
    }
    release_all(views, 3);
    return result;
}

/* ------------------------------------------------------------ bit writer */

/* Pending bits (`held` of them, in the low end of a 64-bit accumulator) and where
 * the next full word goes; words are stored big-endian. */
typedef struct {
    uint8_t *out;
    uint64_t pending;
    unsigned held;
} writer_t;

/* Appends the low `width` (1..64) bits of value, which has no bits above them. */
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
    store_be64(w->out, word);
    w->out += 8;
    w->pending = rest ? value & ((1ull << rest) - 1) : 0;
    w->held = rest;
}

/* The last partial word, zero-padded to a byte. */
static inline void flush_bits(writer_t *w)
{
    uint64_t pending = w->held ? w->pending << (64 - w->held) : 0;
    for (unsigned i = 0; i < (w->held + 7) / 8; i++)
        w->out[i] = (uint8_t)(pending >> (56 - 8 * i));
}

static inline uint64_t low_bits(uint64_t value, unsigned width)
{
    return width >= 64 ? value : value & ((1ull << width) - 1);
}

/* ------------------------------------------------------------ symbol tables */

/* The per-symbol tables the entry points take: `count` (1..MAX_ALPHABET) entries each,
 * widths at most `limit`. -1 with ValueError set otherwise. */
static int check_tables(Py_ssize_t count, const Py_buffer *const *tables,
                        const char *const *names, int ntables)
{
    for (int i = 0; i < ntables; i++) {
        Py_ssize_t entries = tables[i]->len / tables[i]->itemsize;
        if (entries != count || count < 1 || count > MAX_ALPHABET) {
            PyErr_Format(PyExc_ValueError, "%s must hold one entry per symbol of an alphabet "
                         "of 1 to %d (that of %s: %zd), got %zd", names[i], MAX_ALPHABET,
                         names[0], count, entries);
            return -1;
        }
    }
    return 0;
}

static int check_widths(const Py_buffer *table, const char *name, unsigned limit)
{
    Py_ssize_t bad = first_above(table->buf, table->len, limit);
    if (bad < 0)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s[%zd] = %u is above %u", name, bad,
                 (unsigned)((const uint8_t *)table->buf)[bad], limit);
    return -1;
}

/* Index of the first symbol outside an alphabet of `alphabet`, or -1. */
static Py_ssize_t first_outside(const uint8_t *symbols, Py_ssize_t count, Py_ssize_t alphabet)
{
    for (Py_ssize_t i = 0; i < count; i++)
        if (symbols[i] >= alphabet)
            return i;
    return -1;
}

static int check_symbols(const Py_buffer *symbols, Py_ssize_t alphabet)
{
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = first_outside(symbols->buf, symbols->len, alphabet);
    Py_END_ALLOW_THREADS
    if (bad < 0)
        return 0;
    PyErr_Format(PyExc_ValueError, "symbols[%zd] = %u is outside the alphabet of %zd", bad,
                 (unsigned)((const uint8_t *)symbols->buf)[bad], alphabet);
    return -1;
}

/* Gets every buffer of an entry point; on failure releases those it got. */
static int get_arrays(PyObject *const *objects, Py_buffer **views, const char *const *names,
                      const kind_t *kinds, const int *writable, int count)
{
    for (int i = 0; i < count; i++)
        if (get_array(objects[i], views[i], names[i], kinds[i], writable[i]) < 0) {
            release_all(views, i);
            return -1;
        }
    return 0;
}

/* ------------------------------------------------------------ pack_buckets */

/* Code and offset bits of the values, in total and per block of `block` symbols. */
static void measure_buckets(const uint8_t *symbols, Py_ssize_t count, const uint8_t *code_length,
                            const uint8_t *offset_bits, Py_ssize_t block, int64_t *block_bits,
                            uint64_t *code_total, uint64_t *offset_total)
{
    uint64_t codes = 0, offsets = 0;
    for (Py_ssize_t first = 0; first < count; first += block) {
        Py_ssize_t stop = count - first < block ? count : first + block;
        uint64_t bits = 0;
        for (Py_ssize_t i = first; i < stop; i++) {
            bits += code_length[symbols[i]];
            offsets += offset_bits[symbols[i]];
        }
        block_bits[first / block] = (int64_t)bits;
        codes += bits;
    }
    *code_total = codes;
    *offset_total = offsets;
}

static void pack_streams(const int64_t *values, const uint8_t *symbols, Py_ssize_t count,
                         const uint64_t *codes, const uint8_t *code_length, const int64_t *base,
                         const uint8_t *offset_bits, uint8_t *code_out, uint8_t *offset_out)
{
    writer_t code = {code_out, 0, 0}, offset = {offset_out, 0, 0};
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned symbol = symbols[i], length = code_length[symbol], width = offset_bits[symbol];
        if (length)
            put_bits(&code, low_bits(codes[symbol], length), length);
        if (width)
            put_bits(&offset, low_bits((uint64_t)values[i] - (uint64_t)base[symbol], width),
                     width);
    }
    flush_bits(&code);
    flush_bits(&offset);
}

static PyObject *pack_buckets(PyObject *module, PyObject *args)
{
    PyObject *objects[7];
    Py_ssize_t block;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOOOOOnO:pack_buckets", &objects[0], &objects[1], &objects[2],
                          &objects[3], &objects[4], &objects[5], &block, &objects[6]))
        return NULL;
    if (block < 1)
        return PyErr_Format(PyExc_ValueError, "block must be positive, got %zd", block);
    static const char *const names[7] = {"values", "symbols", "codes", "code_lengths", "base",
                                         "offset_bits", "block_bits"};
    static const kind_t kinds[7] = {INT64, UINT8, UINT64, UINT8, INT64, UINT8, INT64};
    static const int writable[7] = {0, 0, 0, 0, 0, 0, 1};
    Py_buffer storage[7], *views[7];
    for (int i = 0; i < 7; i++)
        views[i] = &storage[i];
    if (get_arrays(objects, views, names, kinds, writable, 7) < 0)
        return NULL;
    Py_buffer *values = views[0], *symbols = views[1], *codes = views[2];
    Py_buffer *code_lengths = views[3], *base = views[4], *offset_bits = views[5];
    Py_buffer *block_bits = views[6];
    Py_ssize_t count = symbols->len, alphabet = code_lengths->len;
    Py_ssize_t blocks = count / block + (count % block != 0);
    const Py_buffer *tables[4] = {code_lengths, codes, base, offset_bits};
    const char *const table_names[4] = {"code_lengths", "codes", "base", "offset_bits"};
    PyObject *code_data = NULL, *offset_data = NULL, *result = NULL;
    if (values->len / 8 != count)
        PyErr_Format(PyExc_ValueError, "values and symbols differ in size: %zd and %zd",
                     values->len / 8, count);
    else if (block_bits->len / 8 != blocks)
        PyErr_Format(PyExc_ValueError, "block_bits must hold %zd entries, got %zd", blocks,
                     block_bits->len / 8);
    else if (check_tables(alphabet, tables, table_names, 4) == 0
             && check_widths(code_lengths, "code_lengths", 64) == 0
             && check_widths(offset_bits, "offset_bits", 64) == 0
             && check_symbols(symbols, alphabet) == 0) {
        uint64_t code_total, offset_total;
        Py_BEGIN_ALLOW_THREADS
        measure_buckets(symbols->buf, count, code_lengths->buf, offset_bits->buf, block,
                        block_bits->buf, &code_total, &offset_total);
        Py_END_ALLOW_THREADS
        code_data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((code_total + 7) / 8));
        offset_data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((offset_total + 7) / 8));
        if (code_data != NULL && offset_data != NULL) {
            uint8_t *code_out = (uint8_t *)PyBytes_AS_STRING(code_data);
            uint8_t *offset_out = (uint8_t *)PyBytes_AS_STRING(offset_data);
            /* Not shared yet: filling them without the GIL is safe. */
            Py_BEGIN_ALLOW_THREADS
            pack_streams(values->buf, symbols->buf, count, codes->buf, code_lengths->buf,
                         base->buf, offset_bits->buf, code_out, offset_out);
            Py_END_ALLOW_THREADS
            result = PyTuple_Pack(2, code_data, offset_data);
        }
    }
    Py_XDECREF(code_data);
    Py_XDECREF(offset_data);
    release_all(views, 7);
    return result;
}

/* ------------------------------------------------------------ decode_lanes */

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

static void decode_all_lanes(const uint8_t *data, uint64_t size, const int64_t *starts,
                             Py_ssize_t lanes, Py_ssize_t steps, unsigned peek,
                             const uint16_t *table, uint8_t *symbols, int64_t *ends,
                             uint8_t *bad)
{
    unsigned drop = 64 - peek;
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
        for (int j = 0; j < LANE_GROUP; j++) {
            ends[lane + j] = (int64_t)position[j];
            bad[lane + j] = lane_bad[j];
        }
    }
    for (; lane < lanes; lane++) {
        uint64_t position = (uint64_t)starts[lane];
        uint8_t lane_bad = 0;
        for (Py_ssize_t step = 0; step < steps; step += 3)
            position = decode_window(data, size, table, drop, position,
                                     symbols + lane * steps + step,
                                     steps - step < 3 ? steps - step : 3, &lane_bad);
        ends[lane] = (int64_t)position;
        bad[lane] = lane_bad;
    }
}

static PyObject *decode_lanes(PyObject *module, PyObject *args)
{
    PyObject *objects[6];
    Py_ssize_t steps;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOnOOOO:decode_lanes", &objects[0], &objects[1], &steps,
                          &objects[2], &objects[3], &objects[4], &objects[5]))
        return NULL;
    /* Positions stay far from overflow: at most 8 * len(data) + 15 * steps. */
    if (steps < 0 || steps > (PY_SSIZE_T_MAX >> 8))
        return PyErr_Format(PyExc_ValueError, "steps must be in [0, %zd], got %zd",
                            PY_SSIZE_T_MAX >> 8, steps);
    static const char *const names[6] = {"data", "starts", "code_lengths", "symbols", "ends",
                                         "bad"};
    static const kind_t kinds[6] = {BYTES, INT64, UINT8, UINT8, INT64, UINT8};
    static const int writable[6] = {0, 0, 0, 1, 1, 1};
    Py_buffer storage[6], *views[6];
    for (int i = 0; i < 6; i++)
        views[i] = &storage[i];
    if (get_arrays(objects, views, names, kinds, writable, 6) < 0)
        return NULL;
    Py_buffer *data = views[0], *starts = views[1], *code_lengths = views[2];
    Py_buffer *symbols = views[3], *ends = views[4], *bad = views[5];
    Py_ssize_t lanes = starts->len / 8, alphabet = code_lengths->len, late = -1;
    uint64_t size = (uint64_t)data->len;
    const int64_t *start = starts->buf;
    const uint8_t *length = code_lengths->buf;
    const Py_buffer *tables[1] = {code_lengths};
    const char *const table_names[1] = {"code_lengths"};
    unsigned peek = 0;
    uint16_t *table = NULL;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < lanes && late < 0; i++)
        if (start[i] < 0 || (uint64_t)start[i] > 8 * size)
            late = i;
    for (Py_ssize_t i = 0; i < alphabet; i++)
        peek = length[i] > peek ? length[i] : peek;
    if (ends->len / 8 != lanes || bad->len != lanes)
        PyErr_Format(PyExc_ValueError, "ends and bad must hold one entry per lane (%zd), got "
                     "%zd and %zd", lanes, ends->len / 8, bad->len);
    else if (lanes && symbols->len / lanes < steps)
        PyErr_Format(PyExc_ValueError, "symbols holds %zd entries, fewer than %zd lanes of %zd "
                     "steps", symbols->len, lanes, steps);
    else if (late >= 0)
        PyErr_Format(PyExc_ValueError, "starts[%zd] = %lld is outside the %llu bits of data",
                     late, (long long)start[late], (unsigned long long)(8 * size));
    else if (check_tables(alphabet, tables, table_names, 1) < 0
             || check_widths(code_lengths, "code_lengths", MAX_CODE_LENGTH) < 0)
        ;
    else if (peek == 0)
        PyErr_SetString(PyExc_ValueError, "code_lengths gives no symbol a code");
    else if ((table = PyMem_Malloc(sizeof *table << peek)) == NULL)
        PyErr_NoMemory();
    else if (fill_table(length, alphabet, peek, table) < 0)
        PyErr_SetString(PyExc_ValueError, "code_lengths do not form a prefix code");
    else {
        Py_BEGIN_ALLOW_THREADS
        decode_all_lanes(data->buf, size, start, lanes, steps, peek, table, symbols->buf,
                         ends->buf, bad->buf);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyMem_Free(table);
    release_all(views, 6);
    return result;
}

/* ------------------------------------------------------------ bucket_values */

static PyObject *bucket_values(PyObject *module, PyObject *args)
{
    PyObject *objects[5];
    long long bit_offset;
    (void)module;
    if (!PyArg_ParseTuple(args, "OLOOOO:bucket_values", &objects[0], &bit_offset, &objects[1],
                          &objects[2], &objects[3], &objects[4]))
        return NULL;
    static const char *const names[5] = {"data", "symbols", "base", "offset_bits", "out"};
    static const kind_t kinds[5] = {BYTES, UINT8, INT64, UINT8, INT64};
    static const int writable[5] = {0, 0, 0, 0, 1};
    Py_buffer storage[5], *views[5];
    for (int i = 0; i < 5; i++)
        views[i] = &storage[i];
    if (get_arrays(objects, views, names, kinds, writable, 5) < 0)
        return NULL;
    Py_buffer *data = views[0], *symbols = views[1], *base = views[2];
    Py_buffer *offset_bits = views[3], *out = views[4];
    Py_ssize_t count = symbols->len, alphabet = base->len / 8;
    uint64_t size = (uint64_t)data->len;
    const Py_buffer *tables[2] = {base, offset_bits};
    const char *const table_names[2] = {"base", "offset_bits"};
    PyObject *result = NULL;
    if (out->len / 8 != count)
        PyErr_Format(PyExc_ValueError, "out holds %zd values, symbols %zd", out->len / 8,
                     count);
    else if (check_tables(alphabet, tables, table_names, 2) == 0
             && check_widths(offset_bits, "offset_bits", 64) == 0
             && check_symbols(symbols, alphabet) == 0) {
        const uint8_t *symbol = symbols->buf, *width = offset_bits->buf, *bytes = data->buf;
        const int64_t *first = base->buf;
        int64_t *value = out->buf;
        uint64_t nbits = 0;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++)
            nbits += width[symbol[i]];
        Py_END_ALLOW_THREADS
        if (bit_offset < 0 || (uint64_t)bit_offset > 8 * size
                || nbits > 8 * size - (uint64_t)bit_offset)
            PyErr_Format(PyExc_ValueError, "offsets of %llu bits from bit %lld do not fit %zd "
                         "bytes", (unsigned long long)nbits, bit_offset, data->len);
        else {
            uint64_t position = (uint64_t)bit_offset;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < count; i++) {
                unsigned s = symbol[i];
                /* Wraps modulo 2**64 as numpy's int64 sum does. */
                value[i] = (int64_t)((uint64_t)first[s]
                                     + read_bits(bytes, size, position, width[s]));
                position += width[s];
            }
            Py_END_ALLOW_THREADS
            result = Py_None;
            Py_INCREF(result);
        }
    }
    release_all(views, 5);
    return result;
}

static PyMethodDef methods[] = {
    {"bucket_symbols", bucket_symbols, METH_VARARGS,
     "bucket_symbols(values, precision, symbols, offset_bits) -> None\n\n"
     "Bucket symbol and offset bit length (writable uint8 arrays) of every positive\n"
     "int64 value, precision 0..2; see deepreduce.codecs._entropy.bucket_symbols."},
    {"pack_buckets", pack_buckets, METH_VARARGS,
     "pack_buckets(values, symbols, codes, code_lengths, base, offset_bits, block,\n"
     "             block_bits) -> (code_bytes, offset_bytes)\n\n"
     "The Huffman encoder's two bit streams: codes[s] in code_lengths[s] bits for every\n"
     "symbol s, and values[i] - base[s] in offset_bits[s] bits for every value, each\n"
     "MSB first and zero-padded to a byte. Writes the code bits of every block of\n"
     "block symbols to block_bits (int64). Tables: one entry per symbol; values int64,\n"
     "symbols uint8, codes uint64, widths uint8 (0..64). Bits above a width are ignored."},
    {"decode_lanes", decode_lanes, METH_VARARGS,
     "decode_lanes(data, starts, steps, code_lengths, symbols, ends, bad) -> None\n\n"
     "Decode steps symbols of the canonical code of code_lengths (uint8, 0..15 per\n"
     "symbol) from every bit position of starts (int64) in data. Writes lane after lane\n"
     "of symbols (uint8, at least len(starts) * steps), each lane's end bit position to\n"
     "ends (int64) and whether it met bits that start no code to bad (uint8). Bits past\n"
     "the end of data read as zeros. See deepreduce.codecs.huffman.decode_lanes."},
    {"bucket_values", bucket_values, METH_VARARGS,
     "bucket_values(data, bit_offset, symbols, base, offset_bits, out) -> None\n\n"
     "out[i] = base[s] + the next offset_bits[s] bits of data (from bit_offset) for\n"
     "every symbol s = symbols[i]; ValueError unless data holds them all. Tables: one\n"
     "entry per symbol, base int64, offset_bits uint8; out int64."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "deepreduce._entropyc",
    "Compiled loops of the Huffman index codec (see deepreduce.codecs.huffman).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__entropyc(void) { return PyModule_Create(&module); }
