"""Built-in codecs, one module per codec family; importing this registers them all.

Installed as ``deepreduce.codecs`` (see ``package_dir`` in setup.cfg): this folder
is never importable as a top-level ``codecs``, which is the standard library's.
"""

from deepreduce.codecs.base import Codec, IndexCodec, ValueCodec  # noqa: F401
