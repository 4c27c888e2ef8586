/*
 * Compiled universe scan of deepreduce's Bloom-filter codec (deepreduce.codecs.index.bloom).
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
 *
 *   conflict_sets(words, masks, positives, r, seed, selection_seed, key_bytes, m, k,
 *                 block_k, rounds, out) -> None
 *
 * writes the r positives the conflict_sets policy selects to out, increasing
 * (the selection is described in codecs/bloom.py, whose numpy fallback selects
 * the same positions). All three run without the GIL, so other Python threads
 * (Horovod's) keep going.
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
 * in L1 when tested (of 128 to 1024, 256 gave the fastest scan;
 * benchmarks/lossy_codecs.py times it). */
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

/* ------------------------------------------------------------ conflict sets */

/* The P2 policy's selection (conflict_sets in codecs/bloom.py describes the algorithm;
 * its numpy fallback there selects the same positions). The conflict set of a filter
 * bit is the positives hashing to it; a set is named by the bit's rank among the
 * filter's set bits, so the arrays indexed by set hold popcount entries (at most k for
 * each value sent, which the decoder checks before its scan), and the members of all
 * sets, 4 bytes each, are the one array that grows with positives x k. Nothing grows
 * with the universe.
 *
 * Cache behaviour decides the speed once the sets outgrow the cache (a filter of a
 * 1% Top-k): the (set, member) pairs are grouped by set in two passes, first into
 * 2048 ranges of sets, then within each range, rather than scattered one by one; the
 * sets of one size are visited in set order, and their order of the paper (by a key
 * per set) is only needed where it changes the result: when a visit nominates more
 * members than are still wanted, and for the shortfall. A set's next member (its
 * unselected member of smallest (pair key, position)) is found when the set is
 * visited and remembered until it is selected: a set is visited once per round at
 * most, so that costs at most `rounds` passes over its members. */

#define NO_MEMBER 0xFFFFFFFFu   /* not looked for yet */
#define NO_MEMBER_LEFT 0xFFFFFFFEu /* every member selected: stays so */
#define RANGE_BITS 11

/* Inline, where __builtin_popcountll without a -mpopcnt target is a library call. */
static inline uint32_t popcount64(uint64_t x)
{
    x = x - ((x >> 1) & 0x5555555555555555ull);
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
    return (uint32_t)((x * 0x0101010101010101ull) >> 56);
}

typedef struct {
    filter_t f;
    uint32_t selection_seed;
    const uint32_t *rank;     /* set bits before each filter word */
    const uint32_t *set_bit;  /* the filter bit of each set */
    const uint32_t *key;      /* each positive's key: murmur(position, selection seed) */
    const uint32_t *start;    /* members of set s: member[start[s] .. start[s + 1]) */
    const uint32_t *member;
} sets_t;

/* The distinct sets of `position` in ids (room for 2 * MAX_HASHES), in no particular
 * order; their count, or -1 when one of its bits is not set (the position is not a
 * positive). The bits are those of bloom.py's bit_positions: the pattern's bits in the
 * blocked word, then the single bits by double hashing. */
static int position_sets(const sets_t *c, uint64_t position, uint32_t *ids)
{
    const filter_t *f = &c->f;
    uint32_t low = scramble((uint32_t)position), high = scramble((uint32_t)(position >> 32));
    uint32_t h1 = murmur_key(low, high, f->key_bytes, f->seed);
    uint32_t g = murmur_key(low, high, f->key_bytes, f->seed ^ SECOND_HASH_SEED);
    uint64_t bits[2 * MAX_HASHES], word_bit = block_word(f, h1) * 64;
    uint64_t mask = f->masks[h1 & (PATTERNS - 1)];
    int count = 0, distinct = 0;
    for (; mask && count < MAX_HASHES; mask &= mask - 1)
        bits[count++] = word_bit + (uint64_t)LOWEST_BIT(mask);
    for (int j = f->block_k; j < f->k; j++, g += h1)
        bits[count++] = single_bit(f, g);
    for (int j = 0; j < count; j++) {
        uint64_t bit = bits[j], word = f->words[bit >> 6];
        if (!((word >> (bit & 63)) & 1u))
            return -1;
        uint32_t id = c->rank[bit >> 6] + popcount64(word & ((1ull << (bit & 63)) - 1u));
        int i = 0;  /* a position's own bits rarely collide: a linear check is enough */
        while (i < distinct && ids[i] != id)
            i++;
        if (i == distinct)
            ids[distinct++] = id;
    }
    return distinct;
}

static inline uint32_t set_key(const sets_t *c, uint32_t set)
{
    return murmur_key(scramble(c->set_bit[set]), 0, 4, c->selection_seed);
}

static inline uint32_t pair_key(const sets_t *c, uint32_t set, uint32_t member)
{
    return murmur_key(scramble(c->set_bit[set]), 0, 4, c->key[member]);
}

/* The unselected member of `set` with the smallest (pair key, position), or
 * NO_MEMBER_LEFT; `best` remembers it across visits. */
static uint32_t next_member(const sets_t *c, uint32_t set, uint32_t *best,
                            const uint8_t *selected)
{
    uint32_t known = best[set];
    if (known == NO_MEMBER_LEFT || (known != NO_MEMBER && !selected[known]))
        return known;
    uint32_t chosen = NO_MEMBER_LEFT, chosen_key = 0;
    for (uint32_t i = c->start[set]; i < c->start[set + 1]; i++) {
        uint32_t member = c->member[i];
        if (selected[member])
            continue;
        uint32_t key = pair_key(c, set, member);
        /* members are in position order: on equal keys the first stays */
        if (chosen == NO_MEMBER_LEFT || key < chosen_key) {
            chosen = member;
            chosen_key = key;
        }
    }
    best[set] = chosen;
    return chosen;
}

/* Stable sort of keys by their high 32 bits (LSD radix, RANGE_BITS a pass; a pass
 * whose digit is the same for every key is skipped); spare has the same room. */
static void sort_by_high_word(uint64_t *keys, uint64_t *spare, size_t count)
{
    size_t histogram[1 << RANGE_BITS];
    for (int shift = 32; shift < 64; shift += RANGE_BITS) {
        memset(histogram, 0, sizeof histogram);
        for (size_t i = 0; i < count; i++)
            histogram[(keys[i] >> shift) & ((1u << RANGE_BITS) - 1)]++;
        if (count == 0 || histogram[(keys[0] >> shift) & ((1u << RANGE_BITS) - 1)] == count)
            continue;
        for (size_t d = 0, total = 0; d < (1u << RANGE_BITS); d++) {
            size_t here = histogram[d];
            histogram[d] = total;
            total += here;
        }
        for (size_t i = 0; i < count; i++)
            spare[histogram[(keys[i] >> shift) & ((1u << RANGE_BITS) - 1)]++] = keys[i];
        memcpy(keys, spare, count * sizeof *keys);
    }
}

enum { SELECT_OK, SELECT_NO_MEMORY, SELECT_NOT_POSITIVE, SELECT_TOO_MANY };

/* Every buffer of one selection; all freed together. */
typedef struct {
    uint32_t *rank, *set_bit, *key, *start, *member, *rows, *range_set, *scratch, *order;
    uint32_t *pickers, *picked, *chosen, *best, *rank_of_set, *counts;
    uint64_t *sort_keys, *sort_spare;
    size_t *level_end;
    uint8_t *row_length, *selected, *nominated, *touched;
} buffers_t;

static void free_buffers(buffers_t *b)
{
    void *all[] = {b->rank, b->set_bit, b->key, b->start, b->member, b->rows, b->range_set,
                   b->scratch, b->order, b->pickers, b->picked, b->chosen, b->best,
                   b->rank_of_set, b->counts, b->sort_keys, b->sort_spare, b->level_end,
                   b->row_length, b->selected, b->nominated, b->touched};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        PyMem_RawFree(all[i]);
}

/* Groups the (set, member) pairs of the positives by set, position order within a set:
 * fills c->key, b->start and b->member. The sets of every position are found once,
 * kept in b->rows (4 bytes a pair) while the pairs are counted, then dealt out. */
static int group_pairs(sets_t *c, buffers_t *b, const int64_t *positives, size_t p,
                       uint64_t sets, size_t *bad)
{
    int shift = 0;
    while (((sets - 1) >> shift) >> RANGE_BITS)
        shift++;
    size_t ranges = (size_t)((sets - 1) >> shift) + 1, range_start[(1 << RANGE_BITS) + 2];
    memset(range_start, 0, sizeof range_start);
    if ((uint64_t)p * (uint64_t)c->f.k > 0xFFFFFFFFull)  /* pairs are numbered with 4 bytes */
        return SELECT_TOO_MANY;
    b->rows = PyMem_RawMalloc(((size_t)p * (size_t)c->f.k + 1) * sizeof *b->rows);
    b->row_length = PyMem_RawMalloc(p + 1);
    if (b->rows == NULL || b->row_length == NULL)
        return SELECT_NO_MEMORY;
    size_t pairs = 0;
    for (size_t i = 0; i < p; i++) {
        uint64_t position = (uint64_t)positives[i];
        uint32_t *ids = b->rows + pairs;
        int count = position_sets(c, position, ids);
        if (count < 0) {
            *bad = i;
            return SELECT_NOT_POSITIVE;
        }
        for (int j = 0; j < count; j++)
            range_start[(ids[j] >> shift) + 1]++;
        b->row_length[i] = (uint8_t)count;
        pairs += (size_t)count;
        b->key[i] = murmur_key(scramble((uint32_t)position),
                               scramble((uint32_t)(position >> 32)), c->f.key_bytes,
                               c->selection_seed);
    }
    size_t longest = 0;
    for (size_t r = 0; r < ranges; r++) {
        longest = range_start[r + 1] > longest ? range_start[r + 1] : longest;
        range_start[r + 1] += range_start[r];
    }
    b->member = PyMem_RawMalloc((pairs + 1) * sizeof *b->member);
    b->start = PyMem_RawMalloc((sets + 2) * sizeof *b->start);
    if (b->member == NULL || b->start == NULL)
        return SELECT_NO_MEMORY;
    if (shift == 0) {
        /* a range is one set: dealing the pairs out groups them */
        for (size_t s = 0; s <= sets; s++)
            b->start[s] = (uint32_t)range_start[s];
        for (size_t i = 0, at = 0; i < p; i++)
            for (size_t end = at + b->row_length[i]; at < end; at++)
                b->member[range_start[b->rows[at]]++] = (uint32_t)i;
    } else {
        /* each pair to its range of sets, then within each range to its set */
        b->range_set = PyMem_RawMalloc((pairs + 1) * sizeof *b->range_set);
        if (b->range_set == NULL)
            return SELECT_NO_MEMORY;
        for (size_t i = 0, at = 0; i < p; i++)
            for (size_t end = at + b->row_length[i]; at < end; at++) {
                size_t to = range_start[b->rows[at] >> shift]++;
                b->range_set[to] = b->rows[at];
                b->member[to] = (uint32_t)i;
            }
        PyMem_RawFree(b->rows);
        b->rows = NULL;
        for (size_t r = ranges; r > 0; r--)  /* range_start[r] moved on to [r + 1] */
            range_start[r] = range_start[r - 1];
        range_start[0] = 0;
        memset(b->start, 0, (sets + 2) * sizeof *b->start);
        for (size_t i = 0; i < pairs; i++)
            b->start[b->range_set[i] + 1]++;
        for (uint64_t s = 0; s < sets; s++)
            b->start[s + 1] += b->start[s];
        b->scratch = PyMem_RawMalloc((longest + 1) * sizeof *b->scratch);
        if (b->scratch == NULL)
            return SELECT_NO_MEMORY;
        for (size_t r = 0; r < ranges; r++) {
            size_t low = range_start[r], high = range_start[r + 1];
            for (size_t i = low; i < high; i++)
                b->scratch[b->start[b->range_set[i]]++ - low] = b->member[i];
            memcpy(b->member + low, b->scratch, (high - low) * sizeof *b->member);
        }
        for (uint64_t s = sets; s > 0; s--)  /* start[s] moved on to start[s + 1] */
            b->start[s] = b->start[s - 1];
        b->start[0] = 0;
    }
    PyMem_RawFree(b->rows);
    PyMem_RawFree(b->range_set);
    PyMem_RawFree(b->scratch);
    PyMem_RawFree(b->row_length);
    b->rows = b->range_set = b->scratch = NULL;
    b->row_length = NULL;
    c->start = b->start;
    c->member = b->member;
    return SELECT_OK;
}

/* Selects r of the p positives (increasing, int64) into out, increasing. *bad names
 * the offending position for SELECT_NOT_POSITIVE. Runs without the GIL. */
static int conflict_select(const filter_t *f, const int64_t *positives, size_t p, size_t r,
                           uint32_t selection_seed, int rounds, int64_t *out, size_t *bad)
{
    buffers_t b;
    memset(&b, 0, sizeof b);
    uint32_t ids[2 * MAX_HASHES];
    int status = SELECT_NO_MEMORY;
    size_t nwords = (size_t)(f->m / 64 + (f->m % 64 != 0));
    b.rank = PyMem_RawMalloc((nwords + 1) * sizeof *b.rank);
    if (b.rank == NULL)
        goto done;
    uint64_t sets = 0;
    for (size_t w = 0; w < nwords; w++) {
        b.rank[w] = (uint32_t)sets;
        sets += popcount64(f->words[w]);
    }
    b.set_bit = PyMem_RawMalloc((sets + 1) * sizeof *b.set_bit);
    b.key = PyMem_RawMalloc((p + 1) * sizeof *b.key);
    if (b.set_bit == NULL || b.key == NULL)
        goto done;
    if (sets == 0 || sets >= 0xFFFFFFFFull) {  /* no positive at all, or too many sets */
        *bad = 0;
        status = sets ? SELECT_TOO_MANY : SELECT_NOT_POSITIVE;
        goto done;
    }
    for (size_t w = 0, s = 0; w < nwords; w++)
        for (uint64_t word = f->words[w]; word; word &= word - 1)
            b.set_bit[s++] = (uint32_t)(w * 64 + (size_t)LOWEST_BIT(word));
    sets_t c = {*f, selection_seed, b.rank, b.set_bit, b.key, NULL, NULL};
    status = group_pairs(&c, &b, positives, p, sets, bad);
    if (status != SELECT_OK)
        goto done;
    status = SELECT_NO_MEMORY;

    /* The sets by size (the order of their visits), in set order within a size:
     * level_end[z] is the end of size z's sets in order. */
    size_t largest = 0, nonempty = 0, longest = 0;
    for (uint64_t s = 0; s < sets; s++) {
        size_t size = b.start[s + 1] - b.start[s];
        largest = size > largest ? size : largest;
    }
    b.level_end = PyMem_RawCalloc(largest + 2, sizeof *b.level_end);
    if (b.level_end == NULL)
        goto done;
    for (uint64_t s = 0; s < sets; s++)
        b.level_end[b.start[s + 1] - b.start[s]]++;
    for (size_t z = 1; z <= largest; z++) {
        longest = b.level_end[z] > longest ? b.level_end[z] : longest;
        size_t here = b.level_end[z];
        b.level_end[z] = nonempty;  /* for now the start of the level */
        nonempty += here;
    }
    b.order = PyMem_RawMalloc((nonempty + 1) * sizeof *b.order);
    if (b.order == NULL)
        goto done;
    for (uint64_t s = 0; s < sets; s++) {
        size_t size = b.start[s + 1] - b.start[s];
        if (size)
            b.order[b.level_end[size]++] = (uint32_t)s;
    }

    b.best = PyMem_RawMalloc((sets + 1) * sizeof *b.best);
    b.touched = PyMem_RawCalloc(sets + 1, 1);
    b.selected = PyMem_RawCalloc(p + 1, 1);
    b.nominated = PyMem_RawCalloc(p + 1, 1);
    b.chosen = PyMem_RawMalloc((longest + 1) * sizeof *b.chosen);
    b.pickers = PyMem_RawMalloc((longest + 1) * sizeof *b.pickers);
    b.picked = PyMem_RawMalloc((longest + 1) * sizeof *b.picked);
    if (b.best == NULL || b.touched == NULL || b.selected == NULL || b.nominated == NULL
            || b.chosen == NULL || b.pickers == NULL || b.picked == NULL)
        goto done;
    for (uint64_t s = 0; s < sets; s++)
        b.best[s] = NO_MEMBER;

    size_t count = 0;
    for (int round = 0; round < rounds && count < r; round++) {
        for (size_t z = 1, first = 0; z <= largest && count < r; first = b.level_end[z++]) {
            size_t end = b.level_end[z];
            /* Every set of this size nominates from the state before any of them: its
             * next member, if it gained no selected member since its last visit. */
            size_t nchosen = 0, npickers = 0;
            for (size_t i = first; i < end; i++) {
                uint32_t set = b.order[i];
                int open = !b.touched[set];
                b.touched[set] = 0;
                if (!open)
                    continue;
                uint32_t nominee = next_member(&c, set, b.best, b.selected);
                if (nominee == NO_MEMBER_LEFT)
                    continue;
                b.pickers[npickers] = set;
                b.picked[npickers++] = nominee;
                if (!b.nominated[nominee]) {
                    b.nominated[nominee] = 1;
                    b.chosen[nchosen++] = nominee;
                }
            }
            size_t take = nchosen < r - count ? nchosen : r - count;
            uint32_t *taken = b.chosen;
            if (take < nchosen) {
                /* More nominees than still wanted (happens once): the first in the
                 * paper's order, by the sets' keys, then set order. */
                b.sort_keys = PyMem_RawMalloc((npickers + 1) * sizeof *b.sort_keys);
                b.sort_spare = PyMem_RawMalloc((npickers + 1) * sizeof *b.sort_spare);
                if (b.sort_keys == NULL || b.sort_spare == NULL)
                    goto done;
                for (size_t i = 0; i < npickers; i++)
                    b.sort_keys[i] = ((uint64_t)set_key(&c, b.pickers[i]) << 32) | i;
                sort_by_high_word(b.sort_keys, b.sort_spare, npickers);
                taken = (uint32_t *)b.sort_spare;  /* free once sorted */
                for (size_t i = 0, n = 0; n < take; i++) {
                    uint32_t nominee = b.picked[b.sort_keys[i] & 0xFFFFFFFFu];
                    if (b.nominated[nominee] == 1) {
                        b.nominated[nominee] = 2;
                        taken[n++] = nominee;
                    }
                }
            }
            for (size_t i = 0; i < take; i++) {
                b.selected[taken[i]] = 1;
                int n = position_sets(&c, (uint64_t)positives[taken[i]], ids);
                for (int j = 0; j < n; j++)
                    b.touched[ids[j]] = 1;
            }
            for (size_t i = 0; i < npickers; i++)
                b.touched[b.pickers[i]] = 0;  /* a set's own pick does not compromise it */
            for (size_t i = 0; i < nchosen; i++)
                b.nominated[b.chosen[i]] = 0;
            count += take;
        }
    }

    if (count < r) {
        /* Shortfall: the unselected positives whose first set in the paper's order
         * (size, key, bit) comes first, ties by position: ranked, counted by rank,
         * then taken below a threshold. */
        size_t need = r - count;
        b.rank_of_set = PyMem_RawMalloc((sets + 1) * sizeof *b.rank_of_set);
        b.counts = PyMem_RawCalloc(nonempty + 1, sizeof *b.counts);
        PyMem_RawFree(b.sort_keys);
        PyMem_RawFree(b.sort_spare);
        b.sort_keys = PyMem_RawMalloc((longest + 1) * sizeof *b.sort_keys);
        b.sort_spare = PyMem_RawMalloc((longest + 1) * sizeof *b.sort_spare);
        if (b.rank_of_set == NULL || b.counts == NULL || b.sort_keys == NULL
                || b.sort_spare == NULL)
            goto done;
        for (size_t z = 1, first = 0; z <= largest; first = b.level_end[z++]) {
            size_t size = b.level_end[z] - first;
            for (size_t i = 0; i < size; i++)
                b.sort_keys[i] = ((uint64_t)set_key(&c, b.order[first + i]) << 32) | i;
            sort_by_high_word(b.sort_keys, b.sort_spare, size);
            for (size_t i = 0; i < size; i++)
                b.rank_of_set[b.order[first + (b.sort_keys[i] & 0xFFFFFFFFu)]] =
                    (uint32_t)(first + i);
        }
        size_t threshold = 0, below = 0, at_threshold = 0;
        for (int pass = 0; pass < 2; pass++) {
            if (pass == 1) {
                while (below + b.counts[threshold] < need)
                    below += b.counts[threshold++];
                at_threshold = need - below;
            }
            for (size_t i = 0; i < p; i++) {
                if (b.selected[i])
                    continue;
                int n = position_sets(&c, (uint64_t)positives[i], ids);
                uint32_t first_rank = UINT32_MAX;
                for (int j = 0; j < n; j++)
                    first_rank = b.rank_of_set[ids[j]] < first_rank ? b.rank_of_set[ids[j]]
                                                                     : first_rank;
                if (pass == 0)
                    b.counts[first_rank]++;
                else if (first_rank < threshold
                         || (first_rank == threshold && at_threshold && at_threshold--))
                    b.nominated[i] = 1;
            }
        }
        for (size_t i = 0; i < p; i++)
            b.selected[i] |= b.nominated[i];
    }
    for (size_t i = 0, n = 0; i < p; i++)
        if (b.selected[i])
            out[n++] = positives[i];
    status = SELECT_OK;
done:
    free_buffers(&b);
    return status;
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

static PyObject *conflict_sets(PyObject *module, PyObject *args)
{
    PyObject *words_object, *masks_object, *positives_object, *out_object;
    long long r, seed, selection_seed, key_bytes, m, k, block_k, rounds;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOOLLLLLLLLO:conflict_sets", &words_object, &masks_object,
                          &positives_object, &r, &seed, &selection_seed, &key_bytes, &m, &k,
                          &block_k, &rounds, &out_object))
        return NULL;
    if (check_parameters(seed, key_bytes, m, k, block_k) < 0)
        return NULL;
    if (selection_seed < 0 || selection_seed > 0xFFFFFFFFll || rounds < 0 || rounds > 1000)
        return PyErr_Format(PyExc_ValueError, "selection_seed must be in [0, 2**32) and "
                            "rounds in [0, 1000], got %lld and %lld", selection_seed, rounds);
    Py_buffer words, masks, positives, out;
    if (get_filter(words_object, masks_object, m, 0, &words, &masks) < 0)
        return NULL;
    if (get_array(positives_object, &positives, "positives", 1, 0) < 0) {
        PyBuffer_Release(&words);
        PyBuffer_Release(&masks);
        return NULL;
    }
    if (get_array(out_object, &out, "out", 1, 1) < 0) {
        PyBuffer_Release(&words);
        PyBuffer_Release(&masks);
        PyBuffer_Release(&positives);
        return NULL;
    }
    const int64_t *position = positives.buf;
    Py_ssize_t p = positives.len / 8, bad = -1;
    /* members are 4-byte positive numbers; positions must be increasing keys */
    for (Py_ssize_t i = 0; i < p && bad < 0; i++)
        if (position[i] < 0 || (unsigned long long)position[i] >= key_limit(key_bytes)
                || (i && position[i] <= position[i - 1]))
            bad = i;
    PyObject *result = NULL;
    if (p >= (Py_ssize_t)1 << 31)
        PyErr_Format(PyExc_ValueError, "%zd positives, more than 2**31 - 1", p);
    else if (bad >= 0)
        PyErr_Format(PyExc_ValueError, "positives[%zd] = %lld is not an increasing position "
                     "of %lld-byte keys", bad, (long long)position[bad], key_bytes);
    else if (r < 0 || r >= (long long)p || out.len / 8 < r)
        PyErr_Format(PyExc_ValueError, "r must be in [0, %zd) with room in out (%zd), got "
                     "%lld", p, out.len / 8, r);
    else {
        filter_t filter = {words.buf, masks.buf, (uint64_t)m, (uint64_t)m / 64,
                           (uint32_t)seed, (int)key_bytes, (int)k, (int)block_k};
        size_t offender = 0;
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = conflict_select(&filter, position, (size_t)p, (size_t)r,
                                 (uint32_t)selection_seed, (int)rounds, out.buf, &offender);
        Py_END_ALLOW_THREADS
        if (status == SELECT_NO_MEMORY)
            PyErr_NoMemory();
        else if (status == SELECT_TOO_MANY)
            PyErr_SetString(PyExc_ValueError, "2**32 or more (positive, filter bit) pairs");
        else if (status == SELECT_NOT_POSITIVE)
            PyErr_Format(PyExc_ValueError, "positives[%zu] = %lld is not a positive of the "
                         "filter", offender, (long long)position[offender]);
        else {
            Py_INCREF(Py_None);
            result = Py_None;
        }
    }
    PyBuffer_Release(&words);
    PyBuffer_Release(&masks);
    PyBuffer_Release(&positives);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(words, masks, start, count, seed, key_bytes, m, k, block_k, out) -> int\n\n"
     "Write the Bloom-filter positives among positions start .. start+count-1 to out\n"
     "(int64, at least count long), increasing; return how many. words: the filter as\n"
     "uint64 words; masks: the 4096 uint64 blocked-word patterns of block_k bits;\n"
     "m: filter bits; k: hash count. Layout: deepreduce.codecs.index.bloom."},
    {"build", build, METH_VARARGS,
     "build(words, masks, indices, seed, key_bytes, m, k, block_k) -> None\n\n"
     "Set the k filter bits of every index (int64, each within the key width) in\n"
     "words (writable uint64), the other arguments as for scan."},
    {"conflict_sets", conflict_sets, METH_VARARGS,
     "conflict_sets(words, masks, positives, r, seed, selection_seed, key_bytes, m, k,\n"
     "              block_k, rounds, out) -> None\n\n"
     "Write to out (int64, room for r) the r positives (increasing int64 positions whose\n"
     "bits are all set, r < their count) that the conflict_sets policy selects, increasing:\n"
     "rounds of set visits, then the shortfall (deepreduce.codecs.index.bloom describes it).\n"
     "Memory: 4 bytes per (positive, distinct bit) and a few per set filter bit."},
    {NULL, NULL, 0, NULL},
};

DEFINE_MODULE(_bloomscan, "deepreduce.codecs.index._bloomscan",
              "Compiled universe scan of the Bloom-filter index codec "
              "(see deepreduce.codecs.index.bloom).", 0)
