"""Which rank owns which elements of a tensor: the split of SparCML's and OmniReduce's
communicators."""

from __future__ import annotations

import numpy as np

#: Elements per granule of the interleaved ownership (:class:`Ownership`).
GRANULE = 16384


class Ownership:
    """Which rank owns which elements of ``[0, n)``: granules dealt round-robin.

    The index space is cut into granules of ``granule`` elements; granule g
    belongs to rank ``g % parts``. A rank's local index space is its granules
    laid end to end, in order, so local indices keep the order, the runs
    (when ``granule`` is a multiple of the run length) and the density of the
    global ones. Interleaving spreads skewed supports (hot embedding rows
    have low ids) over all owners; a granule of at least ``ceil(n / parts)``
    gives one contiguous range per rank.

    Examples
    --------
    >>> owners = Ownership.of(10, 2, granule=3)
    >>> owners.granule, [owners.length(r) for r in range(2)]
    (3, [6, 4])
    >>> order, cuts, local = owners.split(np.array([0, 4, 6, 9]))
    >>> [order[cuts[r]:cuts[r + 1]].tolist() for r in range(2)], local.tolist()
    ([[0, 2], [1, 3]], [0, 1, 3, 3])
    >>> owners.to_global(0, np.array([0, 3, 5])).tolist()
    [0, 6, 8]
    """

    def __init__(self, n: int, parts: int, granule: int):
        self.n, self.parts, self.granule = int(n), int(parts), int(granule)
        self.stride = self.granule * self.parts
        self.sweeps, self.rest = divmod(self.n, self.stride)

    @classmethod
    def of(cls, n: int, parts: int, granule: int = GRANULE, unit: int = 1) -> "Ownership":
        """Granules of about ``granule`` elements, a multiple of ``unit`` (the block size),
        never more than one granule per rank needs."""
        units = -(-n // unit)
        per_granule = max(1, min(max(granule, unit) // unit, -(-units // parts)))
        return cls(n, parts, per_granule * unit)

    def length(self, rank: int) -> int:
        """Elements owned by ``rank``."""
        return self.sweeps * self.granule + min(self.granule,
                                                max(0, self.rest - rank * self.granule))

    def split(self, indices: np.ndarray):
        """Group sorted global ``indices`` by owner.

        Returns ``(order, cuts, local)``: ``order[cuts[r]:cuts[r + 1]]`` are the
        positions in ``indices`` of rank r's entries, increasing, and ``local``
        their local indices (aligned with ``indices``).
        """
        owners = (indices // self.granule) % self.parts
        local = (indices // self.stride) * self.granule + indices % self.granule
        if self.n <= self.stride:  # one granule per rank at most: already grouped
            order = np.arange(indices.size)
        else:
            order = np.argsort(owners.astype(np.int32), kind="stable")
        cuts = np.concatenate([[0], np.cumsum(np.bincount(owners, minlength=self.parts))])
        return order, cuts.tolist(), local

    def to_global(self, rank: int, local: np.ndarray) -> np.ndarray:
        """Global indices of ``rank``'s ``local`` indices."""
        return (local // self.granule) * self.stride + rank * self.granule \
            + local % self.granule

    def _pieces(self, rank):
        """(the strided view's rows, the tail's global start, its length) of ``rank``."""
        tail = self.length(rank) - self.sweeps * self.granule
        return self.sweeps, self.sweeps * self.stride + rank * self.granule, tail

    def take(self, x: np.ndarray, rank: int) -> np.ndarray:
        """``rank``'s elements of the flat array ``x``, in local order."""
        rows, start, tail = self._pieces(rank)
        g = self.granule
        swept = x[:rows * self.stride].reshape(rows, self.parts, g)[:, rank, :].reshape(-1)
        return np.concatenate([swept, x[start:start + tail]])

    def place(self, output: np.ndarray, rank: int, values: np.ndarray) -> None:
        """Write ``rank``'s elements, in local order, into the flat array ``output``."""
        rows, start, tail = self._pieces(rank)
        g = self.granule
        output[:rows * self.stride].reshape(rows, self.parts, g)[:, rank, :] = \
            values[:rows * g].reshape(rows, g)
        output[start:start + tail] = values[rows * g:]
