"""Built-in codecs by family; importing this registers them all.

- ``index/``: the index codecs, one module per codec id (``deepreduce.codecs.index.golomb``);
- ``values/``: the value codecs, one module per codec id (``deepreduce.codecs.values.qsgd``);
- here, what both families use: ``base`` (``Codec``, ``IndexCodec``, ``ValueCodec``) and the
  private helpers ``_murmur`` (MurmurHash3: Bloom filters, QSGD's dither), ``_deflate`` and
  ``_zstd`` (the byte compressors of the ``deflate`` and ``zstd`` codecs of both families).

Installed as ``deepreduce.codecs`` (see ``package_dir`` in setup.cfg): this folder
is never importable as a top-level ``codecs``, which is the standard library's.

The flat layout's module paths keep working (see :data:`MOVED`): ``import
deepreduce.codecs.golomb`` gives ``deepreduce.codecs.index.golomb`` itself, and pickles of
codecs made before the move still load.
"""

import importlib
import sys
import types

from deepreduce.codecs.base import Codec, IndexCodec, ValueCodec  # noqa: F401
from deepreduce.codecs import index, values  # noqa: F401

#: ``deepreduce.codecs.<old>`` of the flat layout (before issue 44) -> the modules that hold
#: its code now, relative to this package. An old path with one new home is that module
#: (same object: patching either patches both); one whose module was split by family
#: (``deflate``, ``zstd``, ``floats``, ``_compressed``) is a module that looks each name up
#: in its new homes.
MOVED = {
    "raw": ("index.raw",),
    "bitpack": ("index.bitpack",),
    "varint": ("index.varint",),
    "bitmap": ("index.bitmap",),
    "rle": ("index.rle",),
    "eliasfano": ("index.eliasfano",),
    "golomb": ("index.golomb",),
    "blockpack": ("index.blockpack",),
    "bloom": ("index.bloom",),
    "huffman": ("index.huffman",),
    "runs": ("index.runs",),
    "auto": ("index.auto",),
    "chunked": ("index.chunked",),
    "_entropy": ("index._entropy",),
    "qsgd": ("values.qsgd",),
    "statq": ("values.statq",),
    "sign": ("values.sign",),
    "polyfit": ("values.polyfit",),
    "dexp": ("values.dexp",),
    "floats": ("values.floats", "values.raw", "values.dtypes"),
    "deflate": ("index.deflate", "values.deflate", "_deflate"),
    "zstd": ("index.zstd", "values.zstd", "_zstd"),
    "_compressed": ("index._compressed", "values._compressed"),
}


def _old_module(old: str, homes: tuple) -> types.ModuleType:
    modules = [importlib.import_module(f"{__name__}.{home}") for home in homes]
    if len(modules) == 1:
        return modules[0]
    module = types.ModuleType(f"{__name__}.{old}", f"Moved (issue 44): the code of this module "
                              f"lives in {', '.join(m.__name__ for m in modules)}.")

    def __getattr__(name):
        for home in modules:
            if hasattr(home, name):
                return getattr(home, name)
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

    module.__getattr__ = __getattr__
    module.__dir__ = lambda: sorted(set().union(*map(dir, modules)))
    return module


for _old, _homes in MOVED.items():
    sys.modules[f"{__name__}.{_old}"] = globals()[_old] = _old_module(_old, _homes)
del _old, _homes
