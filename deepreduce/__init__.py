"""deepreduce: cheap-to-send sparse tensors for data-parallel workers.

>>> import numpy as np, deepreduce as dr
>>> g = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
>>> st = dr.decompress(dr.compress(g, sparsifier=dr.TopK(0.1), value="fp16"))
>>> st.nnz, st.shape
(100, (1000,))
"""

from deepreduce.errors import DecodeError
from deepreduce.registry import get_codec, register_codec, registered_codecs
import deepreduce.codecs  # noqa: F401,E402  (registers the built-in codecs)
from deepreduce.codecs.base import Codec, IndexCodec, ValueCodec
from deepreduce.sparse import SparseTensor
from deepreduce.sparsifiers import BlockTopK, ChunkTopK, NonZero, RandomK, Threshold, TopK, get_sparsifier
from deepreduce.pipeline import Pipeline, compress, decompress, index_entropy_bits
from deepreduce.container import read_header
from deepreduce.exchange.memory import ResidualMemory
from deepreduce.config import ExchangeConfig

__version__ = "0.2.1"

__all__ = [
    "DecodeError", "get_codec", "register_codec", "registered_codecs", "Codec", "IndexCodec",
    "ValueCodec", "SparseTensor", "TopK", "RandomK", "Threshold", "BlockTopK", "ChunkTopK", "NonZero",
    "get_sparsifier", "Pipeline", "compress", "decompress", "index_entropy_bits", "read_header",
    "ResidualMemory", "ExchangeConfig",
]
