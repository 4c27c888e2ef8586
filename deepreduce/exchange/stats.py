"""Per-step traffic and timing of the communicators of the Horovod wrappers.

``compression.stats`` is a :class:`CompressionStats`: ``last`` describes the
latest completed step, ``total`` sums every step since the start (or the last
:meth:`CompressionStats.reset`). Both are :class:`StepStats`; subtracting two
``total`` snapshots gives the counters of the steps in between, which is how
:class:`~deepreduce.horovod.keras.CompressionStatsCallback` reports epochs.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import asdict, dataclass, fields


@dataclass
class StepStats:
    """Counters of one step, or sums over several (``steps`` says how many).

    Attributes
    ----------
    steps : int
        Number of exchanges these counters cover.
    tensors : int
        Gradients exchanged (summed over the steps).
    compressed_tensors : int
        Of those, the ones large enough (``>= min_size`` elements) to go
        through the configured pipeline; the others travel losslessly.
    bytes_sent : int
        Bytes this rank handed to the collectives for the other ranks, as the
        transport frames them (:class:`~deepreduce.collectives.Traffic`'s
        ``sent``). Allgather: its bundle of payloads behind a signature, in the
        transport's frame: over torch.distributed, a slot of its length and a
        capacity the bundle is padded to (:class:`~deepreduce.torch.transport.
        TorchTransport`); over Horovod, the frame itself. Sparse allreduce and
        block: what it handed to the alltoall and the allgather.
    framing_bytes : int
        Of ``bytes_sent``, what the transport and the signature added around this
        rank's bundle (lengths, padding; 0 where nothing frames it):
        ``bundle_bytes`` is the bundle's own bytes.
    bytes_received : int
        The bytes the collectives brought from the other ranks, as the
        transport framed them (``Traffic.received``). Where a graph runs the
        allgather (Horovod's graph path, :meth:`~deepreduce.exchange.
        GradientExchange.decode_bundles`): the bytes of all ranks' bundles that
        this rank decoded, its own included.
    dense_bytes : int
        What the same gradients weigh dense (elements times item size): the
        bytes each rank contributes to Horovod's dense allreduce.
    encode_seconds, decode_seconds : float
        Wall time of error feedback + sparsification + encoding, and of
        decoding + summing every rank's payloads. Sparse allreduce and block
        decode and sum inside the exchange (at the range owners, then the
        gathered ranges): there ``decode_seconds`` is what follows it, the
        residual update and unpacking.
    exchange_seconds : float
        Wall time from the end of encoding to the start of decoding: the
        collectives, including waiting for the slowest rank.
    codec_seconds : float
        Of ``encode_seconds + decode_seconds``, the time inside the index and
        value codecs: coding the selected entries into payloads and decoding
        every rank's payloads. The rest (error feedback, the sparsifier,
        summing into dense tensors) is what any Top-k scheme pays, raw pairs
        included. The wall time of the codings, which overlap on several
        ``codec_threads``: what they add to the step, not the threads' CPU
        time. Allgather communicator only: the reducing communicators
        code inside their collectives, and leave it 0.
    nonfinite_steps : int
        Of the steps, those some rank's gradients made non-finite: their tensors
        travelled whole and exact, without error feedback, and left the residuals
        and random streams as they were (see
        :meth:`~deepreduce.exchange.GradientExchange.reduce_async`).

    Examples
    --------
    >>> from deepreduce.exchange.stats import StepStats
    >>> s = StepStats(steps=2, bytes_sent=1000, dense_bytes=40000, encode_seconds=0.004)
    >>> s.ratio, s.per_step()["bytes_sent"], round(s.per_step()["encode_ms"], 3)
    (40.0, 500.0, 2.0)
    """

    steps: int = 0
    tensors: int = 0
    compressed_tensors: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes: int = 0
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0
    exchange_seconds: float = 0.0
    codec_seconds: float = 0.0
    nonfinite_steps: int = 0
    framing_bytes: int = 0

    @property
    def bundle_bytes(self) -> int:
        """The bundle's own bytes (``bytes_sent`` less ``framing_bytes``)."""
        return self.bytes_sent - self.framing_bytes

    @property
    def ratio(self) -> float:
        """Dense bytes over bytes sent (how many times less this rank sent)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("nan")

    def __add__(self, other: "StepStats") -> "StepStats":
        return StepStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: "StepStats") -> "StepStats":
        return StepStats(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def as_dict(self) -> dict:
        """The counters plus ``ratio`` and ``bundle_bytes``."""
        return {**asdict(self), "ratio": self.ratio, "bundle_bytes": self.bundle_bytes}

    def per_step(self) -> dict:
        """Means per step: bytes, tensor counts, ``ratio`` and times in milliseconds."""
        steps = max(self.steps, 1)
        return {"steps": self.steps, "tensors": self.tensors / steps,
                "compressed_tensors": self.compressed_tensors / steps,
                "bytes_sent": self.bytes_sent / steps,
                "bundle_bytes": self.bundle_bytes / steps,
                "bytes_received": self.bytes_received / steps,
                "dense_bytes": self.dense_bytes / steps, "ratio": self.ratio,
                "encode_ms": 1e3 * self.encode_seconds / steps,
                "decode_ms": 1e3 * self.decode_seconds / steps,
                "exchange_ms": 1e3 * self.exchange_seconds / steps,
                "codec_ms": 1e3 * self.codec_seconds / steps}


class CompressionStats:
    """What a :class:`~deepreduce.horovod.tensorflow.Compression` sent and how long it took.

    Attributes
    ----------
    last : StepStats
        The latest completed step (``steps == 1``; all zero before the first).
    total : StepStats
        Sums over every completed step.

    Examples
    --------
    >>> from deepreduce.exchange.stats import CompressionStats
    >>> stats = CompressionStats()
    >>> stats.record_encode(tensors=3, compressed_tensors=1, bytes_sent=120, dense_bytes=4000,
    ...                     seconds=0.001)
    >>> stats.record_decode(bytes_received=250, seconds=0.002)
    >>> stats.last.ratio, stats.total.steps
    (33.333333333333336, 1)
    >>> sorted(stats.as_dict())[:4]
    ['bundle_bytes', 'bytes_received', 'bytes_sent', 'codec_ms']
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__.setdefault("_pending_groups", set())  # pickled before groups
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget every step."""
        with self._lock:
            self.last = StepStats()
            self.total = StepStats()
            self._pending = None
            self._pending_groups = set()
            self._encoded_at = 0.0

    def record_encode(self, *, tensors: int, compressed_tensors: int, bytes_sent: int,
                      dense_bytes: int, seconds: float, codec_seconds: float = 0.0,
                      group: int = 0, nonfinite: bool = False) -> None:
        """Open a step with what the encoder did (the communicator calls this).

        A step whose tensors travel in several bundles records one encode per
        ``group``: a group the open step does not hold yet adds to it, and the
        step closes at its decode.
        """
        with self._lock:
            encoded = StepStats(1, tensors, compressed_tensors, bytes_sent, 0,
                                dense_bytes, seconds, codec_seconds=codec_seconds,
                                nonfinite_steps=int(nonfinite))
            if self._pending is not None and group not in self._pending_groups:
                encoded = self._pending + encoded
                encoded.steps = 1
                encoded.nonfinite_steps = min(encoded.nonfinite_steps, 1)
            else:
                self._pending_groups = set()
            self._pending_groups.add(group)
            self._pending = encoded
            self._encoded_at = time.perf_counter()

    def record_decode(self, *, bytes_received: int, seconds: float,
                      codec_seconds: float = 0.0) -> None:
        """Close the open step with what the decoder did."""
        now = time.perf_counter()
        with self._lock:
            step = self._pending or StepStats(steps=1)
            step.bytes_received += bytes_received
            step.decode_seconds += seconds
            step.codec_seconds += codec_seconds
            if self._pending is not None:
                step.exchange_seconds += max(0.0, now - seconds - self._encoded_at)
            self._pending = None
            self.last = step
            self.total = self.total + step

    def record_step(self, step: StepStats) -> None:
        """Record a whole step at once (the reducing communicators call this)."""
        with self._lock:
            self.last = step
            self.total = self.total + step

    def amend_last(self, extra: StepStats) -> None:
        """Add ``extra`` (counters of the same step, ``steps`` 0) to the latest step and to
        the totals: what an integration sends beside the exchange's own collectives for
        that step (the outer step's all-finite flags)."""
        with self._lock:
            self.last = self.last + extra
            self.total = self.total + extra

    def snapshot(self) -> StepStats:
        """A copy of ``total``, to subtract from a later one."""
        with self._lock:
            return copy.copy(self.total)

    def as_dict(self) -> dict:
        """The latest step (per-step means of ``last``) and running totals.

        Keys: ``steps`` (completed so far), ``tensors``, ``compressed_tensors``,
        ``bytes_sent``, ``bytes_received``, ``dense_bytes``, ``ratio``,
        ``encode_ms``, ``decode_ms``, ``exchange_ms``, ``codec_ms`` of the latest step, and
        ``total_bytes_sent``,
        ``total_dense_bytes``, ``total_ratio``, ``total_encode_seconds``,
        ``total_decode_seconds``.
        """
        with self._lock:
            last, total = self.last, self.total
        return {**last.per_step(), "steps": total.steps,
                "total_bytes_sent": total.bytes_sent, "total_dense_bytes": total.dense_bytes,
                "total_ratio": total.ratio, "total_encode_seconds": total.encode_seconds,
                "total_decode_seconds": total.decode_seconds}

    def __repr__(self):
        d = self.as_dict()
        return (f"CompressionStats(steps={d['steps']}, last: {d['bytes_sent']:.0f} B sent for "
                f"{d['dense_bytes']:.0f} B dense (x{d['ratio']:.1f}), encode "
                f"{d['encode_ms']:.2f} ms, decode {d['decode_ms']:.2f} ms)")
