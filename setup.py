"""Only the compiled part of the build; the metadata is in setup.cfg.

The six extensions are optional: where they cannot be compiled (no C compiler)
the install goes on and deepreduce falls back to numpy, which gives the same
results more slowly. deepreduce._bloomscan is the Bloom-filter scan and build
(deepreduce.codecs.bloom, a quarter of the speed or less without it);
deepreduce._entropyc the bit packing and prefix-code decoding of the Huffman index
codec (deepreduce.codecs.huffman through deepreduce.codecs._entropy), the Golomb
code's encoder and decoder (deepreduce.codecs.golomb, about three times as fast
as numpy), the block-packed code (deepreduce.codecs.blockpack) and varints
(deepreduce.bits);
deepreduce._topkscan the candidate scan and selection of the Top-k sparsifier
(deepreduce.sparsifiers.TopK), error feedback's addition included;
deepreduce._sparsesum the sum of the ranks' sparse parts into the dense result
(deepreduce.collectives.base.sum_sorted_into);
deepreduce._qsgd the quantisation and dequantisation of the QSGD value codec
(deepreduce.codecs.qsgd), which must give numpy's bits: no fused multiply-adds;
deepreduce._halfcast the float16 casts of the fp16 value codec
(deepreduce.codecs.floats), with the F16C instructions of x86-64 (elsewhere it is
not built, or not imported where the processor lacks them).
"""

import sys

from setuptools import Extension, setup

OPTIMISE = [] if sys.platform == "win32" else ["-O3"]
EXACT = [] if sys.platform == "win32" else ["-ffp-contract=off"]
SHARED = ["deepreduce/_buffer.h"]  # included by every extension


def extension(name, extra=()):
    return Extension(f"deepreduce.{name}", [f"deepreduce/{name}.c"], depends=SHARED,
                     extra_compile_args=OPTIMISE + list(extra), optional=True)


setup(ext_modules=[extension("_bloomscan"), extension("_entropyc"), extension("_topkscan"),
                   extension("_sparsesum"), extension("_qsgd", EXACT), extension("_halfcast")])
