"""The per-tensor step of an exchange: which pipeline, error feedback, the sparsifier.

Every way of moving gradients (the allgather exchange, the reducing
communicators, the framework integrations) asks a :class:`Selector` what to send
of each tensor (:meth:`~Selector.select_all`) and tells it what was delivered
(:meth:`~Selector.settle_all`); tensors on a device are summed where they live
(:meth:`~Selector.sum_into_device`). The rules live here once:

- a tensor below ``min_size`` elements travels losslessly (every non-zero, a
  bitmap of positions, raw values);
- every other tensor gets its own pipeline, whose random streams are seeded from
  the configured seed and the tensor's name, so what it draws does not depend on
  the order tensors come in;
- with error feedback and a name, the residual is added before the sparsifier
  (in one pass for Top-k) and becomes ``corrected - received`` after.
"""

from __future__ import annotations

import dataclasses
import inspect
import zlib

import numpy as np

from deepreduce.config import ExchangeConfig
from deepreduce.pipeline import Pipeline
from deepreduce.registry import get_codec
from deepreduce.sparse import SparseTensor
from deepreduce.sparsifiers import _as_float_array, get_sparsifier
from deepreduce.spec import parse_spec


@dataclasses.dataclass
class Selection:
    """What a :class:`Selector` chose to send of one tensor.

    Attributes
    ----------
    name : str or None
        The tensor's name (its residual's key).
    pipeline : Pipeline
        The pipeline that codes it (the lossless one below ``min_size``).
    selected : SparseTensor
        What the sparsifier took.
    dense : numpy.ndarray or None
        The flat dense tensor it was taken from, for codecs that read it (None
        for a sparse input).
    corrected : numpy.ndarray, SparseTensor or None
        With error feedback, the gradient plus its residual, which
        :meth:`Selector.settle` finishes; None without.
    """

    name: str | None
    pipeline: Pipeline
    selected: SparseTensor
    dense: np.ndarray | None
    corrected: object = None


class Selector:
    """Error feedback and selection per tensor, with the random streams of each name.

    Parameters
    ----------
    config : ExchangeConfig
        The sparsifier, codecs, ``min_size``, ``seed`` and error feedback.

    Attributes
    ----------
    pipeline : Pipeline
        The configured pipeline (a spec without a seed gets ``config.seed``).
    small_pipeline : Pipeline
        The lossless one of tensors below ``min_size``.
    memory : ResidualMemory or None
        The residuals, None without error feedback.

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> from deepreduce.config import ExchangeConfig
    >>> from deepreduce.exchange.selection import Selector
    >>> selector = Selector(ExchangeConfig(sparsifier=dr.TopK(1), value="raw", min_size=0))
    >>> selection = selector.select("w", np.array([0.5, -2.0, 1.0], np.float32))
    >>> payload, received = selection.pipeline.encode_sparse(selection.selected, selection.dense)
    >>> selector.settle(selection, received)
    >>> received.values, selector.memory.residual("w")
    (array([-2.], dtype=float32), array([0.5, 0. , 1. ], dtype=float32))
    """

    def __init__(self, config: ExchangeConfig):
        self.min_size, self.seed = config.min_size, config.seed
        value = _seeded_codec(config.value, "value", self.seed)
        index = config.index
        if not value.sorts_values:  # curve fits: the pipeline decides the index coding
            index = _seeded_codec(index, "index", self.seed)
        self.pipeline = Pipeline(_seeded_sparsifier(config.sparsifier, self.seed),
                                 index=index, value=value)
        # a bitmap (n/8 bytes) is exact whatever the configured index codec is (which
        # may be lossy) and costs nothing to choose
        self.small_pipeline = Pipeline(None, index="bitmap", value="raw")
        self.memory = config.memory()
        self._pipelines = {}  # per tensor name, see pipeline_of

    def size(self, x) -> int:
        """Elements of ``x`` (a dense array or SparseTensor)."""
        return _size(x)

    def floating(self, x):
        """``x`` as the floating-point array the sparsifier reads."""
        return x if isinstance(x, np.ndarray) and x.dtype.kind == "f" else _as_float_array(x)

    def is_small(self, x) -> bool:
        """Whether ``x`` travels losslessly (below ``min_size`` elements)."""
        return self.size(x) < self.min_size

    def select(self, name, x, lossless: bool = False) -> Selection:
        """What to send of ``x`` (a dense array or SparseTensor) named ``name``.

        ``lossless`` forces the lossless pipeline (several small tensors
        concatenated, say). With error feedback on and a name, ``x`` plus its
        residual is what the sparsifier sees; :meth:`settle` must follow once
        the receivers' view is known (if coding raises, a dense tensor's
        residual already holds the whole corrected gradient, as error feedback
        wants).
        """
        if lossless or self.is_small(x):
            return Selection(name, self.small_pipeline, *self.small_pipeline.sparsify(x))
        pipeline = self.pipeline_of(name)
        if self.memory is None or name is None:
            return Selection(name, pipeline, *pipeline.sparsify(x))
        if isinstance(x, SparseTensor):
            # the residual is dense: its non-zeros join the sparse gradient's, and the
            # sparsifier chooses among the union
            if name in self.memory:
                x = SparseTensor.from_dense(self.memory.accumulate(name, x))
            return Selection(name, pipeline, *pipeline.sparsify(x), corrected=x)
        # the addition into the residual and the selection in one pass
        corrected, selected = self.memory.accumulate_and_select(name, x, pipeline.sparsifier)
        return Selection(name, pipeline, selected, _as_float_array(corrected).reshape(-1),
                         corrected)

    def all_finite(self, tensors) -> bool:
        """Whether every tensor of ``tensors`` (dense arrays or SparseTensors) holds only
        finite values: what a step checks before it touches a residual or a random
        stream (see :meth:`deepreduce.exchange.GradientExchange.reduce_async`'s
        ``finite``). One read pass over each floating-point tensor."""
        return all(all_finite(x) for x in tensors)

    def select_all(self, requests) -> list[Selection]:
        """:meth:`select` of each ``(name, x)`` of ``requests``, in order: what an exchange
        sends of a step's tensors. (A selector of tensors on a device brings their
        selections to the host together.)"""
        return [self.select(name, x) for name, x in requests]

    def settle(self, selection: Selection, received: SparseTensor,
               selected: SparseTensor | None = None) -> None:
        """Finish error feedback: the residual becomes ``corrected - received``.

        ``received`` is what the receivers decode; ``selected``, when the
        selection travelled re-indexed (several tensors in one payload), is
        its selection at ``received``'s indices.
        """
        if selection.corrected is not None:
            self.memory.settle(selection.name, selection.corrected, received,
                               selection.selected if selected is None else selected)

    def settle_all(self, settles) -> None:
        """:meth:`settle` of each ``(selection, received)`` of ``settles``: a step's."""
        for selection, received in settles:
            self.settle(selection, received)

    def sum_into_device(self, jobs) -> None:
        """For each ``(target, parts, scale)`` of ``jobs``, make ``target``, a tensor on a
        device, the sum of the ranks' decoded ``parts`` (SparseTensors) times ``scale``
        (None: 1), as :func:`deepreduce.sums.sum_sorted_into` sums into a host array.
        A ``target`` that is a list of tensors (a shared payload's, in order) receives
        the sum in slices: the first tensor's elements first.

        The gathering strategy calls it for the ``out`` tensors that are not numpy
        arrays; a selector of tensors on a device
        (:class:`deepreduce.torch.device.DeviceSelector`) sums there. This one has none.
        """
        target = jobs[0][0]
        target = target[0] if isinstance(target, list) else target
        raise TypeError(f"{type(self).__name__} sums into numpy arrays only: out holds "
                        f"{type(target).__name__}; pass a selector of that device "
                        "(deepreduce.torch.device.DeviceSelector for torch tensors)")

    def pipeline_of(self, name) -> Pipeline:
        """The pipeline of tensor ``name``: the configured one, with every random stream
        (RandomK, stochastic rounding, Bloom hashing) seeded from ``seed`` and the name,
        and codecs that learn from the sets they code its own
        (:meth:`~deepreduce.codecs.base.Codec.for_one_tensor`).

        A stream per tensor makes what a tensor draws independent of the order
        in which tensors are encoded (DDP hands its buckets over in a different
        order after its first iteration, and again after a restart), so a
        resumed run draws exactly what an uninterrupted one does.
        """
        pipeline = self._pipelines.get(name)
        if pipeline is None:
            base = self.pipeline
            pipeline = self._pipelines[name] = Pipeline(
                _with_seed(base.sparsifier, name), index=_one_tensors(base.index_codec, name),
                value=_one_tensors(base.value_codec, name))
        return pipeline

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint needs to continue exactly: every residual (copies) and
        :meth:`random_state`. Plain numpy arrays and ints: ``pickle`` or ``torch.save``
        it."""
        memory = self.memory
        residuals = {} if memory is None else {name: memory.residual(name).copy()
                                               for name in memory.names()}
        return {"residuals": residuals, "random_state": self.random_state()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (of a selector with the same settings)."""
        if self.memory is not None:
            self.memory.reset()
            for name, residual in state["residuals"].items():
                self.memory.restore(name, residual)
        self.set_random_state(state["random_state"])

    def random_state(self) -> dict:
        """Where every tensor's random streams stand (see :meth:`pipeline_of`), and what
        its ``auto`` index codec remembers of its last choice (see
        :data:`deepreduce.codecs.index.auto.RECHECK`).

        Checkpoint it with the residuals: :meth:`set_random_state` on a new
        selector of the same configuration continues the same sequences.
        """
        state = {}
        for name, pipeline in self._pipelines.items():
            for role, part in _random_parts(pipeline):
                if hasattr(part, "step"):
                    state[f"{name}/{role}.step"] = int(part.step)
                rng = getattr(part, "_rng", None)
                if isinstance(rng, np.random.Generator):
                    state[f"{name}/{role}.rng"] = rng.bit_generator.state
                memory = getattr(part, "_memory", None)  # (a tensor's auto index codec)
                if isinstance(memory, tuple):
                    state[f"{name}/{role}.memory"] = [int(m) for m in memory]
        return state

    def set_random_state(self, state: dict) -> None:
        """Restore what :meth:`random_state` returned."""
        names = {key.split("/", 1)[0] for key in state}
        for name in names:
            for role, part in _random_parts(self.pipeline_of(name)):
                if f"{name}/{role}.step" in state:
                    part.step = int(state[f"{name}/{role}.step"])
                if f"{name}/{role}.rng" in state:
                    part._rng.bit_generator.state = state[f"{name}/{role}.rng"]
                if f"{name}/{role}.memory" in state:
                    part._memory = tuple(int(m) for m in state[f"{name}/{role}.memory"])


def all_finite(x) -> bool:
    """Whether the array or SparseTensor ``x`` holds no inf or NaN.

    A sum is finite only when every term is, so one pass that reads ``x`` and writes
    nothing answers almost always; a non-finite sum (a term that is, or finite terms
    whose sum overflows) is checked element by element.

    >>> import numpy as np
    >>> from deepreduce.exchange.selection import all_finite
    >>> all_finite(np.ones(3, np.float32)), all_finite(np.array([1.0, np.nan]))
    (True, False)
    >>> all_finite(np.full(4, 6e4, np.float16)), all_finite(np.arange(3))
    (True, True)
    """
    values = np.asarray(x.values if isinstance(x, SparseTensor) else x)
    if values.dtype.kind in "biu":  # integers are finite
        return True
    with np.errstate(all="ignore"):
        wide = np.float64 if values.dtype.itemsize >= 8 else np.float32
        try:
            total = np.add.reduce(values.reshape(-1), dtype=wide)
        except TypeError:  # a dtype numpy cannot sum in float32
            total = np.nan
        if np.isfinite(total):
            return True
        return bool(np.isfinite(values.astype(wide, copy=False)).all())


def _size(x) -> int:
    if type(x) is np.ndarray:  # (np.size is a Python function: a microsecond a call)
        return x.size
    return x.size if isinstance(x, SparseTensor) else int(np.size(x))


def _accepts_seed(factory) -> bool:
    try:
        return "seed" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _seeded_sparsifier(spec, seed: int):
    """The sparsifier of ``spec``; a spec string without a seed gets ``seed``."""
    sparsifier = get_sparsifier(spec)
    if isinstance(spec, str) and _accepts_seed(type(sparsifier)) and \
            "seed" not in parse_spec(spec)[2]:
        sparsifier = get_sparsifier(spec + ("," if ":" in spec else ":") + f"seed={seed}")
    return sparsifier


def _seeded_codec(spec, family: str, seed: int):
    """The codec of ``spec``; a spec string or config without a seed gets ``seed``."""
    codec = get_codec(spec, family=family)
    if isinstance(spec, (str, dict)) and _accepts_seed(type(codec)):
        given = parse_spec(spec)[2] if isinstance(spec, str) else spec
        if "seed" not in given:
            codec = type(codec).from_config({**codec.get_config(), "seed": seed})
    return codec


def _with_seed(part, name):
    """The sparsifier or codec ``part`` with its random stream seeded from its own seed
    and the tensor ``name`` (``part`` itself when it draws nothing)."""
    seed = getattr(part, "seed", None)
    if seed is None:
        return part
    seed = zlib.crc32(str(name).encode(), seed)
    if hasattr(part, "with_seed"):  # a sparsifier
        return part.with_seed(seed)
    return type(part).from_config({**part.get_config(), "seed": seed})


def _one_tensors(codec, name):
    """The codec of tensor ``name``: seeded from its name, and its own where the codec
    learns from what it codes (None stays None)."""
    return None if codec is None else _with_seed(codec, name).for_one_tensor()


def _random_parts(pipeline):
    return [(role, part) for role, part in (("sparsifier", pipeline.sparsifier),
                                            ("index", pipeline.index_codec),
                                            ("value", pipeline.value_codec))
            if part is not None]
