"""What Streaming DiLoCo adds to the outer step: fragments on a staggered schedule, and
exchanges that overlap the next inner steps (Douillard et al. 2025, arXiv 2501.18512).

:class:`~deepreduce.torch.outer.OuterOptimizer` holds one :class:`FragmentSchedule` (which
parameters each fragment holds, and at which inner steps it is synced) and at most one
:class:`InFlight` exchange at a time; :func:`merge` is the rule that folds an averaged
update into parameters that trained on meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["FragmentSchedule", "InFlight", "MERGES", "merge"]

#: The rules :func:`merge` knows.
MERGES = ("mix", "carry")


class FragmentSchedule:
    """``fragments`` runs of consecutive parameters of about equal bytes, each synced every
    ``sync_every`` inner steps at an offset of its own.

    Fragment ``i`` is synced at the inner steps ``t`` with ``t % sync_every ==
    ((i + 1) * sync_every // fragments) % sync_every``: evenly spread over the period,
    the last fragment at the multiples of ``sync_every`` (one fragment: every
    ``sync_every``-th step, plain DiLoCo). Each exchange then carries about
    ``1 / fragments`` of the model, so the peak bytes per exchange drop as many times.

    Parameters
    ----------
    sizes : list of int
        Bytes of each parameter, in model order.
    fragments : int
        How many runs to cut them into (at most one per parameter).
    sync_every : int
        H, the inner steps between two syncs of the same fragment (at least
        ``fragments``, so that no two fragments share a step).

    Examples
    --------
    >>> from deepreduce.torch.streaming import FragmentSchedule
    >>> schedule = FragmentSchedule([400, 100, 300, 200, 40], fragments=2, sync_every=30)
    >>> schedule.members, schedule.offsets, schedule.gap
    ([[0, 1], [2, 3, 4]], [15, 0], 15)
    >>> [schedule.due(t) for t in (14, 15, 30, 45)]
    [None, 0, 1, 0]
    """

    def __init__(self, sizes, fragments: int, sync_every: int):
        if fragments > len(sizes):
            raise ValueError(f"fragments must be at most the {len(sizes)} synced parameters, "
                             f"got {fragments}")
        if fragments > sync_every:
            raise ValueError(f"fragments ({fragments}) must be at most sync_every "
                             f"({sync_every}): each fragment is synced at a step of its own")
        self.sync_every = sync_every
        self.members = _runs_of_equal_bytes(list(sizes), fragments)
        self.offsets = [((i + 1) * sync_every // fragments) % sync_every
                        for i in range(fragments)]
        ordered = sorted(offset or sync_every for offset in self.offsets)
        #: The fewest inner steps between two consecutive syncs (of any fragments).
        self.gap = min(b - a for a, b in zip([ordered[-1] - sync_every] + ordered, ordered))

    def due(self, step: int):
        """The fragment synced at inner step ``step`` (counted from 1), or None."""
        phase = step % self.sync_every
        return self.offsets.index(phase) if phase in self.offsets else None


def _runs_of_equal_bytes(sizes: list, parts: int) -> list:
    """``parts`` non-empty runs of consecutive indices of ``sizes``, each cut where the
    running total comes closest to its share of the whole."""
    total, cuts, running = sum(sizes), [], 0
    bounds = [0]
    for i, size in enumerate(sizes[:-1]):
        running += size
        cuts.append((running, i + 1))
    for k in range(1, parts):
        target = k * total / parts
        # the cut nearest the target that leaves room for the runs still to come
        allowed = [(abs(r - target), at) for r, at in cuts
                   if bounds[-1] < at <= len(sizes) - (parts - k)]
        bounds.append(min(allowed)[1])
    bounds.append(len(sizes))
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


@dataclass
class InFlight:
    """One fragment's exchange, started at inner step ``started_at`` and merged at
    ``merge_at``; ``future`` holds ``(averaged, nonfinite)`` (the averaged
    pseudo-gradients, or None for a step skipped because ``nonfinite``, ``{rank:
    parameter}``, is not empty), ``stepped`` whether the outer step of the synced copy
    is taken already (by the background thread), and ``anchor`` the parameters as they
    were at the start (the ``"carry"`` rule's)."""

    fragment: int
    members: list
    started_at: int
    merge_at: int
    future: object = None
    stepped: bool = False
    anchor: list = field(default_factory=list)


def merge(rule: str, mixing: float, params, synced, anchor) -> None:
    """Fold the synced copy (just stepped by the outer optimizer) into parameters that
    trained on since the exchange started, in place, as ``rule`` says:

    * ``"carry"``: ``param = synced + (param - anchor)``, the new synced copy plus what
      this worker's inner steps added since the start (``anchor``: the parameters then):
      no inner step is lost; the average arrives one overlap late, as DeMo/Psyche and
      PCCL's asynchronous DiLoCo apply it.
    * ``"mix"``: ``param = mixing * param + (1 - mixing) * synced``, Streaming DiLoCo's
      merge (Douillard et al. 2025, arXiv 2501.18512; ``mixing`` is its alpha, torchft's
      ``fragment_update_alpha``; 0 keeps the synced copy alone, dropping the inner steps
      taken meanwhile).

    >>> import torch
    >>> from deepreduce.torch.streaming import merge
    >>> p, s, a = [torch.tensor([3.0])], [torch.tensor([10.0])], [torch.tensor([2.0])]
    >>> merge("carry", 0.5, p, s, a); p
    [tensor([11.])]
    >>> p = [torch.tensor([3.0])]; merge("mix", 0.5, p, s, a); p
    [tensor([6.5000])]
    """
    with torch.no_grad():
        if rule == "carry":
            for p, s, a in zip(params, synced, anchor):
                p.sub_(a.to(p.device)).add_(s.to(p.device))
        else:
            for p, s in zip(params, synced):
                p.lerp_(s.to(device=p.device, dtype=p.dtype), 1.0 - mixing)
