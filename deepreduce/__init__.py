"""deepreduce: cheap-to-send sparse tensors for data-parallel workers."""

from deepreduce.errors import DecodeError
from deepreduce.registry import get_codec, register_codec, registered_codecs
import deepreduce.codecs  # noqa: F401  (registers the built-in codecs)
from deepreduce.codecs.base import Codec, IndexCodec, ValueCodec

__version__ = "0.1.0"
