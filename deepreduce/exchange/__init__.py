"""One step's gradients across ranks: select, encode, move, decode, sum.

Every training integration (Horovod + TensorFlow in :mod:`deepreduce.horovod`,
PyTorch DDP in :mod:`deepreduce.torch`) converts its tensors to numpy, provides a
transport, and holds a :class:`GradientExchange`, which does the rest. The package
is the data path of a step, one job a module:

- :mod:`~deepreduce.exchange.gradient_exchange`: the facade, :class:`GradientExchange`,
  which picks a strategy once from ``communicator``;
- :mod:`~deepreduce.exchange.selection`: per tensor, the min-size rule, seeding, error
  feedback (:mod:`~deepreduce.exchange.memory`) and the sparsifier;
- :mod:`~deepreduce.exchange.strategy`: the one interface of the strategies, which
  the three implement:

  - :mod:`~deepreduce.exchange.gathering`: bundles of payloads to every rank, decoded
    and summed there (the default, DeepReduce's scheme): its encoding side in
    :mod:`~deepreduce.exchange.encoding`, its decoding side in
    :mod:`~deepreduce.exchange.decoding` and :mod:`~deepreduce.exchange.summing`;
  - :mod:`~deepreduce.exchange.reducing`: SparCML's and OmniReduce's communicators,
    which sum inside the collective;
  - :mod:`~deepreduce.exchange.hierarchical`: dense inside a node, one of the two above
    between nodes, with its nodes and shards in :mod:`~deepreduce.exchange.topology`
    and the layout of a step's shards in :mod:`~deepreduce.exchange.shards`;
- :mod:`~deepreduce.exchange.stats`: bytes and times of every step;
  :mod:`~deepreduce.exchange.parallel`: the codec threads.

Below it: the wire format (:mod:`deepreduce.bundle`), the collectives
(:mod:`deepreduce.collectives`) and the sums (:mod:`deepreduce.sums`).

There is one way to run a step, :meth:`GradientExchange.reduce_async`, over any
transport and communicator. Horovod's graph mode, which allgathers inside the
TensorFlow graph, uses its two halves: :meth:`GradientExchange.encode_bundle` and
:meth:`GradientExchange.decode_groups`.
"""

# (error feedback first: deepreduce.config, which the facade imports, imports it)
from deepreduce.exchange.memory import ResidualMemory
from deepreduce.exchange.gradient_exchange import (BUNDLE_SIGNATURE, FINITE_SIGNATURE,
                                                   ExchangeConfig, GradientExchange)

__all__ = ["GradientExchange", "ExchangeConfig", "ResidualMemory", "BUNDLE_SIGNATURE",
           "FINITE_SIGNATURE"]
