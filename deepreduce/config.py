"""The settings of a gradient exchange: one home, the same on every integration.

Every front end (:class:`deepreduce.exchange.GradientExchange`, PyTorch's
:class:`deepreduce.torch.DeepReduceState` and
:class:`deepreduce.torch.OuterOptimizer`, torchft's
:class:`deepreduce.torch.torchft.DeepReduceManager`, Horovod's
:class:`deepreduce.horovod.tensorflow.Compression`) takes ``config=`` an
:class:`ExchangeConfig`, or its fields by name, with these defaults; the DiLoCo family's
presets are :meth:`ExchangeConfig.sparseloco` and :meth:`ExchangeConfig.diloco`.

Why the defaults differ from the codec layer's: a :class:`~deepreduce.Pipeline` (and
:func:`deepreduce.compress`) keeps every value exactly unless asked (no sparsifier, raw
values): it is a file format first, and a file must come back as it went in. A
gradient exchange sends Top-1% in fp16 because error feedback carries what a step does
not deliver to the next step, and that is where the papers' accuracy holds.
:func:`deepreduce.collectives.allreduce` defaults to SparCML's ``"sparse_allreduce"``:
it reduces one tensor that is sparse already, where the split allgather sends less
than every rank's payload to every rank; the exchange's ``"allgather"`` sends one
bundle per step whatever the tensors, which is what the papers measured.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers

from deepreduce import collectives
from deepreduce.exchange.memory import ResidualMemory
from deepreduce.pipeline import DEFAULT_INDEX
from deepreduce.sparsifiers import Sparsifier


@dataclasses.dataclass
class ExchangeConfig:
    """What travels of each gradient, and how.

    Parameters
    ----------
    sparsifier : callable, str or None, default ``"topk:0.01"``
        What travels of each gradient: ``dr.TopK(0.01)``, ``"randomk:0.01"``,
        ``dr.Threshold(1e-3)``... None sends every non-zero (lossless with a
        lossless value codec). Top-1% is where the papers' accuracy holds with
        error feedback on.
    index : str, dict or IndexCodec, default ``"auto"``
        Index codec; ``"auto"`` picks the smallest exact code per tensor, and
        ``"auto:link_gbits=10"`` the cheapest to code and send over a 10 Gbit/s
        link (each rank may give its own bandwidth).
    value : str, dict or ValueCodec, default ``"fp16"``
        Value codec: ``"raw"`` (lossless), ``"fp16"``, ``"bf16"``,
        ``"qsgd:bits=8"``... fp16 halves the values' bytes and error feedback
        carries its rounding to the next step.
    error_feedback : float or bool, default 1.0
        Error feedback: keep, per tensor name, what was not delivered (``input -
        received``, exactly) and add it, times this decay, to the next input of that
        name (:class:`~deepreduce.ResidualMemory`'s ``beta``). 1.0 is classic error
        feedback (EF-SGD, DeepReduce), which Top-k needs to converge; below 1 stale
        error decays (SparseLoCo's 0.95 takes the place of DiLoCo's outer momentum);
        False (or None) turns it off; True means 1.0. The residual of a sparse (row)
        gradient is kept dense, as every residual is.
    min_size : int, default 1024
        Tensors with fewer elements (biases, norms) travel losslessly (every
        non-zero, raw values) beside the others, those of one dtype in one
        payload: they cost little and lose nothing. 0 compresses everything.
    seed : int, default 0
        Seed of sparsifiers and codecs named by a spec that take one and do
        not set it (RandomK, stochastic rounding, Bloom hashing): runs are
        reproducible. The same seed on every rank makes RandomK draw the same
        coordinates everywhere; ``seed=base + rank`` gives independent draws.
    communicator : {"allgather", "sparse_allreduce", "block", "hierarchical"}, default "allgather"
        How the gradients travel: every rank's payloads to every rank
        (DeepReduce), SparCML's split allgather, OmniReduce's non-zero
        blocks (see :mod:`deepreduce.collectives`), or dense inside each node
        and compressed between nodes (:mod:`deepreduce.exchange.hierarchical`).
    communicator_options : dict, optional
        Options of that communicator: ``algorithm`` (``"auto"``, ``"split"``,
        ``"recursive_doubling"``) for ``"sparse_allreduce"``; ``block_size``
        and ``threshold`` for ``"block"``; ``"allgather"`` takes none;
        ``local_size`` (ranks per node; None: torchrun's ``LOCAL_WORLD_SIZE``
        or Horovod's local size), ``inter`` (the communicator between nodes,
        ``"allgather"``) and ``inter_options`` for ``"hierarchical"``.
    codec_threads : int or None, default None
        Threads that code a bundle's payloads side by side (the compiled codec
        loops release the GIL) and decode the ranks' payloads: None takes this
        rank's share of the cores it may run on (divided by torchrun's
        ``LOCAL_WORLD_SIZE`` or horovodrun's ``HOROVOD_LOCAL_SIZE`` unless the
        ranks are pinned to their own cores), at most 4; 1 codes on the
        caller's thread alone. Only payloads of 8,192 entries or more go on
        the other threads: on smaller ones the Python around the loops, which
        holds the GIL, outweighs them (tensors below 4,194,304 elements share
        payloads of up to that many, so few payloads are that small).
        The payloads, error feedback and sums are the same whatever the
        number. Allgather communicator only.

    Examples
    --------
    >>> from deepreduce.config import ExchangeConfig
    >>> ExchangeConfig(value="raw", min_size=0)
    ExchangeConfig(sparsifier='topk:0.01', index='auto', value='raw', error_feedback=1.0, \
min_size=0, seed=0, communicator='allgather', communicator_options={}, codec_threads=None)
    >>> ExchangeConfig.sparseloco().value, ExchangeConfig.sparseloco(error_feedback=0.9).error_feedback
    ('statq:bits=2,sigmas=6', 0.9)
    >>> ExchangeConfig(error_feedback=1.5)
    Traceback (most recent call last):
    ...
    ValueError: error_feedback must be a decay in [0, 1], True (1.0) or False (off), got 1.5
    >>> ExchangeConfig(communicator="block", communicator_options={"size": 8})
    Traceback (most recent call last):
    ...
    ValueError: communicator 'block' takes the options block_size, threshold; got size
    """

    sparsifier: object = "topk:0.01"
    index: object = DEFAULT_INDEX
    value: object = "fp16"
    error_feedback: float | None = 1.0
    min_size: int = 1024
    seed: int = 0
    communicator: str = "allgather"
    communicator_options: dict = dataclasses.field(default_factory=dict)
    codec_threads: int | None = None

    def __post_init__(self):
        self.seed = check_count("seed", self.seed, least=None)
        self.min_size = check_count("min_size", self.min_size)
        if self.codec_threads is not None:
            self.codec_threads = check_count("codec_threads", self.codec_threads, least=1,
                                             what="None (automatic) or an integer >= 1")
        self.error_feedback = _decay(self.error_feedback)
        self.communicator_options = _check_communicator(self.communicator,
                                                        self.communicator_options)

    @classmethod
    def from_settings(cls, config: ExchangeConfig | None = None, **settings) -> ExchangeConfig:
        """``config``, or one made of ``settings`` (its fields by name): the integrations
        take either, and this is where both end up."""
        if config is None:
            return cls(**settings)
        if not isinstance(config, cls):
            raise ValueError(f"config must be an ExchangeConfig, got {config!r}")
        if settings:
            raise ValueError(f"give a config or its settings, not both (got {sorted(settings)})")
        return config

    @classmethod
    def sparseloco(cls, **settings) -> ExchangeConfig:
        """SparseLoCo's outer step (Sarfi et al. 2025, arXiv 2508.15706), as ``settings``
        do not override it: 64 of every 4,096 entries (64 x 64 tiles of a matrix), the
        index code that knows each chunk holds exactly 64, 2-bit statistical
        quantisation over +-6 sigma, every tensor chunk-wise (``min_size`` 0), and error
        feedback whose residual decays by 0.95 at every outer step (in place of DiLoCo's
        outer momentum)."""
        return cls(**{"sparsifier": "chunktopk:k=64,chunk=4096", "index": "chunked",
                      "value": "statq:bits=2,sigmas=6", "min_size": 0,
                      "error_feedback": 0.95, **settings})

    @classmethod
    def diloco(cls, **settings) -> ExchangeConfig:
        """DiLoCo's outer step (Douillard et al. 2023, arXiv 2311.08105), as ``settings``
        do not override it: every element (no sparsifier), float32 values exactly
        (``value="bf16"`` halves them), and error feedback (decay 1.0) only when the
        pipeline loses anything (a sparsifier, a lossy value codec): a lossless one has
        nothing to feed back."""
        settings = {"sparsifier": None, "value": "raw", **settings}
        if "error_feedback" not in settings:
            from deepreduce.registry import get_codec  # (the codecs register on import)
            lossless = settings["sparsifier"] is None and \
                get_codec(settings["value"], family="value").lossless
            settings["error_feedback"] = None if lossless else 1.0
        return cls(**settings)

    def shared_settings(self, pipeline) -> dict:
        """What every rank's exchange of this configuration must agree on, as text:
        the sparsifier and codecs of ``pipeline`` (the configured one, as the exchange
        made it: a curve fit chooses its index codec) less their seeds, which may
        differ between ranks, and less the options that only steer each rank's own
        encoder (``auto``'s ``link_gbits``); the communicator, its options, error
        feedback and ``min_size``. What the integrations compare across ranks before
        the first step, and checkpoints carry."""
        return {"sparsifier": shared_setting(pipeline.sparsifier),
                "index": shared_setting(pipeline.index_codec),
                "value": shared_setting(pipeline.value_codec),
                "communicator": self.communicator,
                "communicator_options": repr(self.communicator_options),
                "error_feedback": "off" if self.error_feedback is None else self.error_feedback,
                "min_size": self.min_size}

    def memory(self) -> ResidualMemory | None:
        """A new residual memory of this configuration's decay, or None without error
        feedback."""
        return None if self.error_feedback is None else ResidualMemory(self.error_feedback)


#: What a reduction decides per call: never an option of the communicator's settings.
_PER_CALL = ("pipeline", "op", "process_set", "transport")


def check_flag(name: str, value) -> bool:
    """``value`` of the setting ``name`` when it is a bool (not a string, not a number)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_count(name: str, value, least: int | None = 0, what: str | None = None) -> int:
    """``value`` of the setting ``name`` as an int, when it is an integer of at least
    ``least`` (None: any); ``what`` it must be, as the error says it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or (least is not None and value < least):
        what = what or "an integer" + ("" if least is None else f" >= {least}")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value)


def check_number(name: str, value, least: float = 0.0, most: float = float("inf")) -> float:
    """``value`` of the setting ``name`` as a float, when it is a finite real number in
    ``[least, most]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or not least <= value <= most:
        span = f">= {least:g}" if most == float("inf") else f"in [{least:g}, {most:g}]"
        raise ValueError(f"{name} must be a finite number {span}, got {value!r}")
    return float(value)


def _decay(feedback) -> float | None:
    """``error_feedback`` as its one meaning: the decay of the residuals, or None (off)."""
    if feedback is None or feedback is False:
        return None
    if feedback is True:
        return 1.0
    if isinstance(feedback, numbers.Real) and 0.0 <= feedback <= 1.0:
        return float(feedback)
    raise ValueError("error_feedback must be a decay in [0, 1], True (1.0) or False (off), "
                     f"got {feedback!r}")


def shared_setting(part) -> str:
    """A sparsifier or codec as :meth:`ExchangeConfig.shared_settings` writes it: its class
    and parameters, less its seed and a codec's :attr:`encoder_options`."""
    if part is None:
        return "None"
    if hasattr(part, "get_config"):  # a codec
        params, skip = part.get_config(), ("id", "seed", *part.encoder_options)
    elif isinstance(part, Sparsifier):  # (its repr's parameters)
        params = {k: v for k, v in vars(part).items() if not k.startswith("_") and v is not None}
        skip = ("seed",)
    else:  # a callable of the user's
        return repr(part)
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items() if k not in skip)
    return f"{type(part).__name__}({shown})"


def _check_communicator(name, options) -> dict:
    """The options of communicator ``name``, checked against its constructor."""
    names = tuple(collectives.COMMUNICATORS) + ("hierarchical",)
    if name not in names:
        raise ValueError(f"communicator must be one of {', '.join(map(repr, names))}, "
                         f"got {name!r}")
    options = {} if options is None else dict(options)
    if name == "hierarchical":  # dense inside a node, another communicator between nodes
        from deepreduce.exchange.topology import check_options
        return check_options(options, _check_communicator)
    if name == "allgather":
        if options:
            raise ValueError(f"communicator 'allgather' takes no options, got {sorted(options)}")
        return options
    accepted = [p for p in inspect.signature(collectives.COMMUNICATORS[name]).parameters
                if p not in _PER_CALL]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        reason = (" (the pipeline comes from the exchange's settings; op and process_set "
                  "are arguments of each reduction)" if set(unknown) & set(_PER_CALL) else "")
        raise ValueError(f"communicator {name!r} takes the options {', '.join(accepted)}; "
                         f"got {', '.join(unknown)}{reason}")
    return options
