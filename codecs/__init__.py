"""Built-in codecs, one module per codec family; importing this registers them all.

Installed as ``deepreduce.codecs`` (see ``package_dir`` in setup.cfg): this folder
is never importable as a top-level ``codecs``, which is the standard library's.
"""

from deepreduce.codecs.base import Codec, IndexCodec, ValueCodec  # noqa: F401
from deepreduce.codecs import raw  # noqa: F401
from deepreduce.codecs import bitpack  # noqa: F401
from deepreduce.codecs import varint  # noqa: F401
from deepreduce.codecs import deflate  # noqa: F401
from deepreduce.codecs import zstd  # noqa: F401
from deepreduce.codecs import bitmap  # noqa: F401
from deepreduce.codecs import rle  # noqa: F401
from deepreduce.codecs import eliasfano  # noqa: F401
from deepreduce.codecs import floats  # noqa: F401
from deepreduce.codecs import golomb  # noqa: F401
from deepreduce.codecs import blockpack  # noqa: F401
from deepreduce.codecs import bloom  # noqa: F401
from deepreduce.codecs import huffman  # noqa: F401
from deepreduce.codecs import runs  # noqa: F401
from deepreduce.codecs import auto  # noqa: F401
from deepreduce.codecs import chunked  # noqa: F401
from deepreduce.codecs import qsgd  # noqa: F401
from deepreduce.codecs import statq  # noqa: F401
from deepreduce.codecs import sign  # noqa: F401
from deepreduce.codecs import polyfit  # noqa: F401
from deepreduce.codecs import dexp  # noqa: F401
