"""Automatic parallelization: meshes, placements, rules, connect, cost model, search, partition.

Typical use::

    plan = search(graph, {"mesh_shape": [2, 2]})
    rank_graphs = partition(graph, plan)
    outputs = simulate(rank_graphs, inputs)    # the single-process oracle
"""
from .config import DistributedConfig
from .connect import connect
from .cost import CostModel, DeviceProfile
from .mesh import DeviceMesh
from .partition import partition
from .placement import Partial, Placement, Replicate, Shard, TensorShardSpec
from .plan import ShardingPlan
from .rules import OpShardSpec, op_strategies
from .search import search
from .simulate import simulate

__all__ = ["DeviceMesh", "Shard", "Replicate", "Partial", "Placement", "TensorShardSpec", "OpShardSpec", "connect",
           "search", "partition", "simulate", "ShardingPlan", "CostModel", "DeviceProfile", "DistributedConfig",
           "op_strategies"]
