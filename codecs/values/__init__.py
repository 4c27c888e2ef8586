"""The value codecs: a 1-D array of values to bytes.

One module per codec id (``codecs/values/<id>.py``, installed as
``deepreduce.codecs.values.<id>``), except ``floats``, which holds the three casts
``fp32``, ``fp16`` and ``bf16``; importing this registers them all. Beside them:
``dtypes`` (the dtypes every value codec accepts, their checks, byte images and casts),
``_compressed`` (the value half of ``deflate`` and ``zstd``) and the C sources
``_qsgd.c`` and ``_halfcast.c``.
"""

# (the registry keeps this order)
from deepreduce.codecs.values import raw  # noqa: F401
from deepreduce.codecs.values import floats  # noqa: F401
from deepreduce.codecs.values import deflate  # noqa: F401
from deepreduce.codecs.values import zstd  # noqa: F401
from deepreduce.codecs.values import qsgd  # noqa: F401
from deepreduce.codecs.values import statq  # noqa: F401
from deepreduce.codecs.values import sign  # noqa: F401
from deepreduce.codecs.values import polyfit  # noqa: F401
from deepreduce.codecs.values import dexp  # noqa: F401
