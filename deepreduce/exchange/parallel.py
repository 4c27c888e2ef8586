"""The host codecs of one bundle on a few threads: how many, and running them in order.

A bundle holds a few payloads (a large tensor's, or consecutive tensors'
together), and each payload's coding is independent of the others' (each has
its own pipeline, random streams included). The compiled codec loops release
the GIL, so a few threads code a bundle's payloads side by side; the Python
between the loops still runs one thread at a time, which is why a few threads
are enough. :func:`run_in_order` gives the results, and raises the error,
that coding them one after another would.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

#: The most threads the automatic setting of ``codec_threads`` picks: the Python
#: between the compiled loops (a sizeable part of a payload's coding) holds the GIL,
#: so more threads mostly wait for it.
MAX_CODEC_THREADS = 4


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (macOS and Windows have no affinity call)
        return os.cpu_count() or 1


def codec_threads(setting: int | None) -> int:
    """The threads that code a bundle: ``setting``, or for None as many as the rank's
    share of the cores, at most :data:`MAX_CODEC_THREADS`.

    A rank's share is the cores it may run on, divided by the ranks on its host
    (torchrun's ``LOCAL_WORLD_SIZE``, horovodrun's ``HOROVOD_LOCAL_SIZE``) unless
    a launcher pinned it to its own cores already (an affinity narrower than the
    machine).
    """
    if setting is not None:
        return setting
    cores, machine = available_cores(), os.cpu_count() or 1
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE")
                          or os.environ.get("HOROVOD_LOCAL_SIZE") or "1")
    except ValueError:
        local_ranks = 1
    if local_ranks > 1 and cores >= machine:
        cores //= local_ranks
    return max(1, min(cores, MAX_CODEC_THREADS))


#: Codings of fewer selected entries, and decodings of shorter payloads (about 3 bytes
#: an entry with fp16 values), stay on the caller's thread (see :func:`run_in_order`'s
#: ``least``): a payload's Python, which holds the GIL, outweighs their compiled
#: loops, and a second thread costs more in handing the GIL over than it saves. The
#: exchanges gather tensors into payloads of millions of elements
#: (:data:`deepreduce.exchange.gathering.PAYLOAD_ELEMENTS`) so that few are that small
#: (``benchmarks/codec_threads.py`` counts, per model, the payloads above these sizes).
PARALLEL_ENTRIES = 1 << 13
PARALLEL_BYTES = 1 << 15

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(helpers: int) -> ThreadPoolExecutor:
    """The process's pool of ``helpers`` threads, shared by every exchange."""
    with _pools_lock:
        pool = _pools.get(helpers)
        if pool is None:
            pool = _pools[helpers] = ThreadPoolExecutor(
                helpers, thread_name_prefix="deepreduce-codec")
        return pool


def _forget_pools() -> None:
    # a forked child has none of its parent's threads: its pools must start afresh
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def run_in_order(function, items, threads: int, cost=None, least: float = 0) -> list:
    """``[function(item) for item in items]``, on ``threads`` threads (the caller's one
    of them).

    Each thread takes the next item until none is left, the costliest first
    when ``cost`` (a function of an item) says which those are, so that no
    thread is left with a large one at the end. Items that cost less than
    ``least`` are the caller's alone, and with fewer than two above it the
    caller runs them all: in work that small the Python between the
    compiled loops, which holds the GIL, outweighs the loops, and a second
    thread costs more in handing the GIL back and forth than it saves. Every
    item is tried, whatever fails; the error raised is the one of the first
    item that failed, in the order of ``items``, as a loop would raise it.
    ``function`` must not depend on the order in which the items run.

    Examples
    --------
    >>> from deepreduce.exchange.parallel import run_in_order
    >>> run_in_order(lambda x: x * x, [3, 1, 2], threads=2, cost=lambda x: x)
    [9, 1, 4]
    """
    items = list(items)
    costs = [1] * len(items) if cost is None else [cost(item) for item in items]
    heavy = sum(c >= least for c in costs)
    if threads <= 1 or heavy <= 1:
        return [function(item) for item in items]
    order = sorted(range(len(items)), key=costs.__getitem__, reverse=True)
    results, errors = [None] * len(items), {}
    taken, taking = [0], threading.Lock()

    def work(last):
        while True:
            with taking:
                if taken[0] >= last:
                    return
                i = order[taken[0]]
                taken[0] += 1
            try:
                results[i] = function(items[i])
            except BaseException as error:  # (raised below, after every item ran)
                errors[i] = error

    helpers = [_pool(threads - 1).submit(work, heavy) for _ in range(min(threads, heavy) - 1)]
    work(len(order))
    for helper in helpers:
        # a helper still queued behind another bundle's work finds nothing left: drop it
        if not helper.cancel():
            helper.result()
    if errors:
        raise errors[min(errors)]
    return results
