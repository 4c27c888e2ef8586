"""Old path of :mod:`deepreduce.exchange.selection` (issue 44), kept for code that imports
the selector from here (``deepreduce.torch.ddp`` does)."""

from deepreduce.exchange.selection import Selection, Selector, all_finite

__all__ = ["Selection", "Selector", "all_finite"]
