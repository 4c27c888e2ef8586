"""Only the compiled part of the build; the metadata is in setup.cfg.

The Bloom-filter scan extension is optional: where it cannot be compiled (no C
compiler) the install goes on and deepreduce.codecs.bloom uses its numpy scan,
which gives the same positives at a quarter of the speed or less.
"""

import sys

from setuptools import Extension, setup

OPTIMISE = [] if sys.platform == "win32" else ["-O3"]

setup(ext_modules=[Extension("deepreduce._bloomscan", ["deepreduce/_bloomscan.c"],
                             extra_compile_args=OPTIMISE, optional=True)])
