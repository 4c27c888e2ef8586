/*
 * The range coder of the chunked index codec (deepreduce.codecs.index.chunked): every chunk's
 * bitmap, one binary decision per position, coded with the probability
 * (ones left) / (positions left) of the chunk, which is exactly what a uniformly drawn
 * k-subset gives: the product over a chunk is 1 / C(size, k), so the stream is the
 * bound log2 C(size, k) per chunk plus the coder's rounding (a few bytes per stream).
 *
 *   encode(keys, chunk, chunks, last, k) -> bytes
 *
 * keys: C-contiguous int64, strictly increasing "chunk keys" (chunk * number + position
 * within the chunk); `chunks` chunks of `chunk` positions, the last of `last` (1 to
 * chunk); chunk number c holds min(k, its size) keys. Raises ValueError when the keys
 * are not such a set.
 *
 *   decode(data, chunk, chunks, last, k, out) -> None or a message
 *
 * out: a writable C-contiguous int64 array that gets the keys (its length is the
 * count the geometry implies, which the caller checked). Returns a message saying what
 * is wrong with a stream that the encoder cannot have written; every other stream
 * decodes to a set of the right counts (reading at most four implied zero bytes past
 * its end). Both loops cost one 64-bit division per
 * position and run without the GIL; the numpy module gives the same bytes in Python
 * (deepreduce.codecs.index.chunked, which documents the coder).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_buffer.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TOP (1u << 24)
#define RELEASE_POSITIONS (1 << 16)

typedef struct {
    unsigned char *out;
    size_t size, capacity;
    uint64_t low;
    uint32_t range;
    unsigned char cache;
    uint64_t pending;   /* bytes held back for a carry: the cache and the 0xFF after it */
    int failed;
} encoder;

static void put(encoder *e, unsigned char byte)
{
    if (e->size == e->capacity) {
        size_t capacity = e->capacity ? 2 * e->capacity : 256;
        unsigned char *grown = realloc(e->out, capacity);
        if (grown == NULL) {
            e->failed = 1;
            return;
        }
        e->out = grown;
        e->capacity = capacity;
    }
    e->out[e->size++] = byte;
}

static void shift_low(encoder *e)
{
    if (e->low < 0xFF000000u || e->low >= (1ull << 32)) {
        unsigned char carry = (unsigned char)(e->low >> 32);
        unsigned char byte = e->cache;
        do {
            put(e, (unsigned char)(byte + carry));
            byte = 0xFF;
        } while (--e->pending != 0);
        e->cache = (unsigned char)(e->low >> 24);
    }
    e->pending++;
    e->low = (e->low & 0x00FFFFFFu) << 8;
}

static inline void encode_bit(encoder *e, int one, uint64_t ones, uint64_t positions)
{
    uint32_t bound = (uint32_t)(((uint64_t)e->range * ones) / positions);
    if (one)
        e->range = bound;
    else {
        e->low += bound;
        e->range -= bound;
    }
    while (e->range < TOP) {
        e->range <<= 8;
        shift_low(e);
    }
}

/* The value with the most trailing zero bytes in [low, low + range), then the flush. */
static void finish(encoder *e)
{
    for (int shift = 32; shift >= 0; shift -= 8) {
        uint64_t mask = (1ull << shift) - 1;
        uint64_t value = (e->low + mask) & ~mask;
        if (value < e->low + e->range) {
            e->low = value;
            break;
        }
    }
    for (int i = 0; i < 5; i++)
        shift_low(e);
}

static PyObject *encode(PyObject *self, PyObject *args)
{
    Py_buffer keys;
    long long chunk, chunks, last, k;
    if (!PyArg_ParseTuple(args, "y*LLLL:encode", &keys, &chunk, &chunks, &last, &k))
        return NULL;
    if (keys.len % 8 != 0) {   /* (the buffer's bytes: the caller passes int64) */
        PyBuffer_Release(&keys);
        PyErr_SetString(PyExc_TypeError, "keys must be int64");
        return NULL;
    }
    const int64_t *key = keys.buf;
    Py_ssize_t count = keys.len / 8, j = 0;
    encoder e = {NULL, 0, 0, 0, 0xFFFFFFFFu, 0, 1, 0};
    const char *problem = NULL;
    RELEASED_BEGIN(chunks * chunk, RELEASE_POSITIONS)
    for (long long c = 0; c < chunks && problem == NULL; c++) {
        long long size = c == chunks - 1 ? last : chunk;
        long long base = c * chunk;
        uint64_t ones = (uint64_t)(k < size ? k : size), left = (uint64_t)size;
        for (long long p = 0; p < size; p++, left--) {
            if (ones == 0) {   /* the rest of the chunk is empty: nothing to say */
                if (j < count && key[j] < base + size)
                    problem = "a chunk holds more keys than its count";
                break;
            }
            if (ones == left) {   /* the rest is full */
                for (; p < size; p++, j++)
                    if (j >= count || key[j] != base + p) {
                        problem = "a chunk holds fewer keys than its count";
                        break;
                    }
                break;
            }
            int one = j < count && key[j] == base + p;
            encode_bit(&e, one, ones, left);
            if (one) {
                j++;
                ones--;
            }
        }
    }
    if (problem == NULL && j != count)
        problem = "keys are not increasing or leave their chunks";
    if (problem == NULL) {
        finish(&e);
    }
    RELEASED_END
    PyBuffer_Release(&keys);
    if (problem != NULL || e.failed) {
        free(e.out);
        if (e.failed)
            return PyErr_NoMemory();
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    /* The first byte is always zero (the coded value is below one), and up to four
     * zero bytes at the end (the flush's) are implied: neither is sent. */
    size_t end = e.size;
    while (end > 1 && end + 4 > e.size && e.out[end - 1] == 0)
        end--;
    PyObject *result = PyBytes_FromStringAndSize((const char *)e.out + 1,
                                                 (Py_ssize_t)(end > 1 ? end - 1 : 0));
    free(e.out);
    return result;
}

static PyObject *decode(PyObject *self, PyObject *args)
{
    Py_buffer data, out;
    long long chunk, chunks, last, k;
    if (!PyArg_ParseTuple(args, "y*LLLLw*:decode", &data, &chunk, &chunks, &last, &k, &out))
        return NULL;
    const unsigned char *in = data.buf;
    Py_ssize_t length = data.len, read = 0, count = out.len / 8, j = 0;
    int64_t *key = out.buf;
    const char *problem = NULL;
    RELEASED_BEGIN(chunks * chunk, RELEASE_POSITIONS)
    uint32_t range = 0xFFFFFFFFu, code = 0, window;
    for (int i = 0; i < 4; i++, read++)
        code = (code << 8) | (read < length ? in[read] : 0);
    window = code;   /* the last four bytes read */
    if (code >= range)
        problem = "stream starts outside its range";
    for (long long c = 0; c < chunks && problem == NULL; c++) {
        long long size = c == chunks - 1 ? last : chunk;
        long long base = c * chunk;
        uint64_t ones = (uint64_t)(k < size ? k : size), left = (uint64_t)size;
        if (count - j < (Py_ssize_t)ones) {
            problem = "more keys than the output holds";
            break;
        }
        for (long long p = 0; p < size && ones; p++, left--) {
            if (ones == left) {   /* the rest is full */
                for (; p < size; p++)
                    key[j++] = base + p;
                break;
            }
            uint32_t bound = (uint32_t)(((uint64_t)range * ones) / left);
            if (code < bound) {
                range = bound;
                key[j++] = base + p;
                ones--;
            }
            else {
                code -= bound;
                range -= bound;
            }
            while (range < TOP) {
                if (read == length + 4) {
                    problem = "the stream ends inside its coded chunks";
                    break;
                }
                unsigned char byte = read < length ? in[read] : 0;
                range <<= 8;
                code = (code << 8) | byte;
                window = (window << 8) | byte;
                read++;
            }
            if (problem != NULL)
                break;
        }
    }
    if (problem == NULL && j != count)
        problem = "fewer keys than the geometry implies";
    if (problem == NULL && read < length)
        problem = "trailing bytes after the coded chunks";
    if (problem == NULL && read < length + 4 && length > 0 && in[length - 1] == 0)
        problem = "a zero byte at the end that the encoder leaves out";
    if (problem == NULL) {
        /* The encoder ends on the value of [low, low + range) with the most zero bytes
         * at its end: low is window - code, and code must be that value's offset. */
        uint32_t low = window - code, offset = 0;
        for (int shift = 32; shift >= 0; shift -= 8) {
            uint64_t modulus = 1ull << shift;
            offset = (uint32_t)((modulus - low % modulus) % modulus);
            if (offset < range)
                break;
        }
        if (code != offset)
            problem = "the stream does not end where the encoder ends it";
    }
    RELEASED_END
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (problem == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromString(problem);
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(keys, chunk, chunks, last, k) -> bytes: the range-coded chunk bitmaps."},
    {"decode", decode, METH_VARARGS,
     "decode(data, chunk, chunks, last, k, out) -> None or what is wrong with the stream."},
    {NULL, NULL, 0, NULL},
};

DEFINE_MODULE(_chunkc, "deepreduce.codecs.index._chunkc",
              "Range coder of the chunked index codec (see deepreduce.codecs.index.chunked).", 0)
