"""Only the compiled part of the build; the metadata is in setup.cfg.

The extensions are optional: where they cannot be compiled (no C compiler) the
install goes on and deepreduce falls back to numpy, which gives the same results
more slowly. Each C source lies beside the module that imports it (codecs/ is the
package deepreduce.codecs, its index/ and values/ folders deepreduce.codecs.index and
deepreduce.codecs.values, see setup.cfg); EXTENSIONS below says which serves what.

DEEPREDUCE_NO_EXTENSIONS=1 in the environment builds none of them: a pure-Python wheel
(py3-none-any) whose numpy fallbacks serve, as on a machine without a C compiler. `make
test-wheel` builds one that way and runs the core tests on it.
"""

import os
import sys

from setuptools import Extension, setup

OPTIMISE = [] if sys.platform == "win32" else ["-O3"]
#: QSGD must give numpy's bits: no contraction into fused multiply-adds.
EXACT = [] if sys.platform == "win32" else ["-ffp-contract=off"]
#: Included by every extension (as "_buffer.h", found through include_dirs).
SHARED = "deepreduce/_buffer.h"

#: (extension, C source, extra compile flags, what it serves). Each import of an
#: extension falls back to numpy when it is missing.
EXTENSIONS = [
    ("deepreduce.codecs.index._bloomscan", "codecs/index/_bloomscan.c", [],
     "the Bloom-filter scan and build of deepreduce.codecs.index.bloom (hashing and probing "
     "every position of the universe, which numpy does in several passes)"),
    ("deepreduce.codecs.index._entropyc", "codecs/index/_entropyc.c", [],
     "the Huffman index codec's encoder and decoder (one call each), its size estimate, "
     "tree and buckets (deepreduce.codecs.index.huffman through "
     "deepreduce.codecs.index._entropy), the Golomb code's encoder and decoder "
     "(deepreduce.codecs.index.golomb), the block-packed code (deepreduce.codecs.index.blockpack) "
     "and the runs code's fields (deepreduce.codecs.index.runs)"),
    ("deepreduce.codecs.index._chunkc", "codecs/index/_chunkc.c", [],
     "the range coder of the chunked index codec (deepreduce.codecs.index.chunked): one "
     "arithmetic step per position, which no whole-array numpy form has"),
    ("deepreduce.codecs.values._qsgd", "codecs/values/_qsgd.c", EXACT,
     "the quantisation and dequantisation of the QSGD value codec "
     "(deepreduce.codecs.values.qsgd), which must give numpy's bits"),
    ("deepreduce.codecs.values._halfcast", "codecs/values/_halfcast.c", [],
     "the float16 casts of the fp16 value codec (deepreduce.codecs.values.floats), with the F16C "
     "instructions of x86-64 (elsewhere not built, or not imported where the processor "
     "lacks them)"),
    ("deepreduce._varint", "deepreduce/_varint.c", [],
     "the LEB128 encoder of deepreduce.bits.varint_encode (the bundles' framing and the "
     "varint-based index codecs); in the core, which never imports deepreduce.codecs"),
    ("deepreduce._topkscan", "deepreduce/_topkscan.c", [],
     "the candidate scan and selection of the Top-k sparsifier (deepreduce.sparsifiers.TopK), "
     "error feedback's addition included, and the chunk-wise Top-k's dense selection (ChunkTopK)"),
    ("deepreduce._sparsesum", "deepreduce/_sparsesum.c", [],
     "the sum of the ranks' sparse parts into the dense result "
     "(deepreduce.sums.sum_sorted_into)"),
]

#: The switch that leaves every extension out (any value but "" and "0").
NO_EXTENSIONS = os.environ.get("DEEPREDUCE_NO_EXTENSIONS", "") not in ("", "0")

setup(ext_modules=[] if NO_EXTENSIONS else [
    Extension(name, [source], include_dirs=["deepreduce"], depends=[SHARED],
              extra_compile_args=OPTIMISE + flags, optional=True)
    for name, source, flags, _ in EXTENSIONS])
