"""Old path of :mod:`deepreduce.exchange.stats` (issue 44), kept for code that imports the
stats from here (``deepreduce.torch.ddp`` does, and training scripts may)."""

from deepreduce.exchange.stats import CompressionStats, StepStats

__all__ = ["CompressionStats", "StepStats"]
