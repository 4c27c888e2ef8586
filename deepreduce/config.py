"""The settings of a gradient exchange: one home, the same on every integration.

Horovod's :class:`deepreduce.horovod.tensorflow.Compression`, PyTorch's
:class:`deepreduce.torch.DeepReduceState` and the framework-neutral
:class:`deepreduce.exchange.GradientExchange` all take these settings, by these
names, with these defaults.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import warnings

from deepreduce import collectives
from deepreduce.exchange.memory import ResidualMemory
from deepreduce.pipeline import DEFAULT_INDEX
from deepreduce.sparsifiers import Sparsifier

#: Old keyword names still accepted, with a DeprecationWarning: old name -> new name.
_RENAMED = {"memory": "error_feedback", "use_error_feedback": "error_feedback"}


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
    error_feedback : bool or ResidualMemory, default True
        Keep, per tensor name, what was not delivered (``input - received``,
        exactly) and add it to the next gradient of that name: Top-k needs it
        to converge. Pass a :class:`~deepreduce.ResidualMemory` to share or
        inspect it (its ``beta`` < 1 lets stale error decay). The residual of
        a sparse (row) gradient is kept dense, as every residual is.
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
    ExchangeConfig(sparsifier='topk:0.01', index='auto', value='raw', error_feedback=True, \
min_size=0, seed=0, communicator='allgather', communicator_options={}, codec_threads=None)
    >>> ExchangeConfig(communicator="block", communicator_options={"size": 8})
    Traceback (most recent call last):
    ...
    ValueError: communicator 'block' takes the options block_size, threshold; got size
    """

    sparsifier: object = "topk:0.01"
    index: object = DEFAULT_INDEX
    value: object = "fp16"
    error_feedback: object = True
    min_size: int = 1024
    seed: int = 0
    communicator: str = "allgather"
    communicator_options: dict = dataclasses.field(default_factory=dict)
    codec_threads: int | None = None

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.min_size, bool) or not isinstance(self.min_size, numbers.Integral) \
                or self.min_size < 0:
            raise ValueError(f"min_size must be an integer >= 0, got {self.min_size!r}")
        self.seed, self.min_size = int(self.seed), int(self.min_size)
        threads = self.codec_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(
                threads, numbers.Integral) or threads < 1):
            raise ValueError(f"codec_threads must be None (automatic) or an integer >= 1, "
                             f"got {threads!r}")
        self.codec_threads = None if threads is None else int(threads)
        feedback = self.error_feedback
        if feedback is ResidualMemory or (isinstance(feedback, str) and feedback == "residual"):
            feedback = True  # the old spellings of memory="residual"
        elif feedback is None:
            feedback = False
        if not isinstance(feedback, (bool, ResidualMemory)):
            raise ValueError("error_feedback must be True, False or a ResidualMemory, got "
                             f"{feedback!r}")
        self.error_feedback = feedback
        self.communicator_options = _check_communicator(self.communicator,
                                                        self.communicator_options)

    @classmethod
    def from_settings(cls, config: ExchangeConfig | None = None, *args,
                      **settings) -> ExchangeConfig:
        """``config``, or one made of ``args`` and ``settings`` (its fields, in order or by
        name; the old names accepted with a DeprecationWarning).

        The integrations take either a config or its fields; this is where both
        end up.
        """
        for old, new in _RENAMED.items():
            if old in settings:
                warnings.warn(f"{old}= is deprecated; use {new}= (the same in every "
                              "deepreduce integration)", DeprecationWarning, stacklevel=3)
                if new in settings:
                    raise ValueError(f"give {new}= or {old}=, not both")
                settings[new] = settings.pop(old)
        if config is None:
            return cls(*args, **settings)
        if not isinstance(config, cls):
            raise ValueError(f"config must be an ExchangeConfig, got {config!r}")
        if args or settings:
            raise ValueError("give a config or its settings, not both (got "
                             f"{len(args)} positional and {sorted(settings)})")
        return config

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
                "use_error_feedback": self.memory() is not None,  # (the key checkpoints carry)
                "min_size": self.min_size}

    def memory(self) -> ResidualMemory | None:
        """The residual memory this configuration asks for: a new one, the one given, or
        None."""
        if isinstance(self.error_feedback, ResidualMemory):
            return self.error_feedback
        return ResidualMemory() if self.error_feedback else None


#: What a reduction decides per call: never an option of the communicator's settings.
_PER_CALL = ("pipeline", "op", "process_set", "transport")


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
