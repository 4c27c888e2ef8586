"""Built-in codecs by family; importing this registers them all.

- ``index/``: the index codecs, one module per codec id (``deepreduce.codecs.index.golomb``);
- ``values/``: the value codecs, one module per codec id (``deepreduce.codecs.values.qsgd``);
- here, what both families use: ``base`` (``Codec``, ``IndexCodec``, ``ValueCodec``) and the
  private helpers ``_murmur`` (MurmurHash3: Bloom filters, QSGD's dither), ``_deflate`` and
  ``_zstd`` (the byte compressors of the ``deflate`` and ``zstd`` codecs of both families).

Installed as ``deepreduce.codecs`` (see ``package_dir`` in setup.cfg): this folder
is never importable as a top-level ``codecs``, which is the standard library's.
"""

from deepreduce.codecs.base import Codec, IndexCodec, ValueCodec  # noqa: F401
from deepreduce.codecs import index, values  # noqa: F401
