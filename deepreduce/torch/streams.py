"""The CUDA streams of deepreduce's work and the events that order them (docs/cuda.md).

Every torch transport has a :class:`Lane`: the stream of its communication thread on
the device of the tensors it serves. A piece of work goes through it in three steps:

1. The producer's thread (DDP's autograd thread at a bucket, the training loop's at an
   outer step) hands it over: :meth:`Lane.hand_over` records an event on that thread's
   current stream (where the bucket was written, even a user's ``torch.cuda.stream``).
2. The communication thread runs it with the lane's stream current, after that event
   (:meth:`Lane.running`): its copies, collectives and sums wait for what the producer
   queued before the hand-over and for nothing else, and the backward pass never waits
   for them. A collective's ``wait()`` orders the lane's stream, not the default one.
3. Its result is handed back with the lane's stream current (:meth:`Lane.current`): a
   ``torch.futures.Future(devices=[d])`` set then records its event on the lane's
   stream, and the consumer's stream waits for that event only.

On the CPU (or for a transport that serves CPU tensors) the lane has no stream: the
same calls order nothing, since the host runs them in program order. Its ``trace``,
set to a list, records every call with its thread, on a GPU too: tests check the
order of the hand-offs without one.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import torch

__all__ = ["Lane", "used_on_current_stream"]

_MARKS = itertools.count()


class Lane:
    """The communication thread's stream on ``device`` and the events that order it.

    Parameters
    ----------
    device : torch.device or str
        The device of the tensors the transport serves; a CUDA device gets a stream of
        its own (``torch.cuda.Stream``), any other none.

    Attributes
    ----------
    stream : torch.cuda.Stream or None
    trace : list or None
        When a list: ``(what, mark, thread name)`` of every :meth:`hand_over`
        ("hand_over"), :meth:`running` ("wait") and :meth:`current` ("complete"),
        ``mark`` numbering the hand-over a wait is for.

    Examples
    --------
    >>> lane = Lane("cpu")
    >>> lane.trace = []
    >>> event = lane.hand_over()
    >>> with lane.running(event):
    ...     pass
    >>> [what for what, _, _ in lane.trace]
    ['hand_over', 'wait']
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device) \
            if self.device.type == "cuda" else None
        self.trace = None

    def hand_over(self) -> "_Event":
        """On the producer's thread: an event on its current stream for the lane's
        device, which the work handed over waits for (:meth:`running`)."""
        event = _Event(next(_MARKS))
        if self.stream is not None:
            event.cuda = torch.cuda.Event()
            event.cuda.record(torch.cuda.current_stream(self.device))
        self._note("hand_over", event.mark)
        return event

    @contextlib.contextmanager
    def running(self, event: "_Event"):
        """On the communication thread: the lane's stream current, ordered after
        ``event``."""
        self._note("wait", event.mark)
        if self.stream is None or event.cuda is None:  # (handed over before it had one)
            with self._current_if_any():
                yield
            return
        self.stream.wait_event(event.cuda)
        with torch.cuda.stream(self.stream):
            yield

    @contextlib.contextmanager
    def current(self):
        """The lane's stream current, without a wait: for completing the future of work
        that ran on it, on whichever thread completes it."""
        self._note("complete", None)
        with self._current_if_any():
            yield

    def _current_if_any(self):
        return torch.cuda.stream(self.stream) if self.stream is not None \
            else contextlib.nullcontext()

    def _note(self, what, mark) -> None:
        if self.trace is not None:
            self.trace.append((what, mark, threading.current_thread().name))


class _Event:
    """A hand-over: its number (for the trace), and its CUDA event where there is one."""

    __slots__ = ("mark", "cuda")

    def __init__(self, mark: int):
        self.mark, self.cuda = mark, None


#: The lane of a transport that has none (not a torch one): nothing to order.
HOST_LANE = Lane("cpu")


def lane_of(transport) -> Lane:
    """``transport``'s lane (through a guarded transport too); :data:`HOST_LANE` for one
    without."""
    inner = getattr(transport, "inner", transport)
    return getattr(inner, "lane", None) or HOST_LANE


def used_on_current_stream(*tensors) -> None:
    """Tell the caching allocator that the CUDA ``tensors`` (None and others skipped),
    made on another stream, are used on the current one: their memory is not handed out
    again before the work queued there now is done (``Tensor.record_stream``)."""
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))
