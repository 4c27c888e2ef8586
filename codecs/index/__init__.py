"""The index codecs: sorted unique indices and their universe size to bytes.

One module per codec id (``codecs/index/<id>.py``, installed as
``deepreduce.codecs.index.<id>``); importing this registers them all. The private
modules beside them serve only this family: ``_entropy`` (the Huffman, Golomb,
block-packed and runs codes, compiled in ``_entropyc.c``), ``_compressed`` (the index
half of ``deflate`` and ``zstd``), and the C sources ``_bloomscan.c`` and ``_chunkc.c``.
"""

# (the registry keeps this order: auto and chunked build on the codecs above them)
from deepreduce.codecs.index import raw  # noqa: F401
from deepreduce.codecs.index import bitpack  # noqa: F401
from deepreduce.codecs.index import varint  # noqa: F401
from deepreduce.codecs.index import deflate  # noqa: F401
from deepreduce.codecs.index import zstd  # noqa: F401
from deepreduce.codecs.index import bitmap  # noqa: F401
from deepreduce.codecs.index import rle  # noqa: F401
from deepreduce.codecs.index import eliasfano  # noqa: F401
from deepreduce.codecs.index import golomb  # noqa: F401
from deepreduce.codecs.index import blockpack  # noqa: F401
from deepreduce.codecs.index import bloom  # noqa: F401
from deepreduce.codecs.index import huffman  # noqa: F401
from deepreduce.codecs.index import runs  # noqa: F401
from deepreduce.codecs.index import auto  # noqa: F401
from deepreduce.codecs.index import chunked  # noqa: F401
