"""Old path of :mod:`deepreduce.exchange.memory` (issue 44), kept for code that imports
error feedback from here (``deepreduce.config`` does; the package exports
``deepreduce.ResidualMemory``)."""

from deepreduce.exchange.memory import ResidualMemory

__all__ = ["ResidualMemory"]
