"""The names ``deepreduce.collectives.base`` held before it was split by job (issue 44):
:mod:`~deepreduce.collectives.communicator`, :mod:`~deepreduce.collectives.signed`,
:mod:`~deepreduce.collectives.ownership` and the sums of :mod:`deepreduce.sums`. Kept for
code outside the package that imports them from here; the package imports them from
their homes."""

from deepreduce.collectives.communicator import Communicator, Handle, Reduction, op_name
from deepreduce.collectives.ownership import GRANULE, Ownership
from deepreduce.collectives.signed import (check_peers, fail_collectively, signed_allgather,
                                           signed_alltoall)
from deepreduce.sums import (SUM_IMPLEMENTATION, localize_sorted, return_masks,
                             returns_only_what_ranks_lack, scale_at, sum_into, sum_sorted_into,
                             sum_sparse)

__all__ = ["Communicator", "Handle", "Reduction", "op_name", "GRANULE", "Ownership",
           "check_peers", "fail_collectively", "signed_allgather", "signed_alltoall",
           "SUM_IMPLEMENTATION", "localize_sorted", "return_masks",
           "returns_only_what_ranks_lack", "scale_at", "sum_into", "sum_sorted_into",
           "sum_sparse"]
