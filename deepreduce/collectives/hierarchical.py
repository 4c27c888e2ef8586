"""Old path of :mod:`deepreduce.exchange.topology` (issue 44), kept for code that imports
the hierarchical helpers from here (``deepreduce.config`` does). The one module of
:mod:`deepreduce.collectives` that imports from above it."""

from deepreduce.exchange.topology import (Failures, Segment, Topology, check_options,
                                          node_transports, pack_shards, resolve_local_size,
                                          shard_bounds, unpack_shards)

__all__ = ["Failures", "Segment", "Topology", "check_options", "node_transports", "pack_shards",
           "resolve_local_size", "shard_bounds", "unpack_shards"]
