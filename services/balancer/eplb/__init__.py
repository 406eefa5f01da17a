"""Expert-parallelism load balancer (EPLB) for DeepSeek-V3-style MoE layers.

Same contract as DeepSeek's published ``eplb.py`` (``rebalance_experts``), vectorised over layers
(the only Python loops run over items or steps, each step one array operation for all layers) and
better balanced. Per layer it builds two candidates and keeps the one whose heaviest GPU is lighter:

A. the published greedy itself (``greedy``: same float32 arithmetic and tie-breaking, identical
   placements), which makes every layer at least as balanced as the published plan;
B. the same steps, each improved (``improve``: refined group packing, capped and evenly split
   replica counts, look-ahead packing, local search swaps, other counts for the hottest experts).

Finally nodes and GPUs are relabelled per layer so that heavy GPUs of successive layers land on
different devices (``plan``). ``replan`` (``replanning``) moves from a current placement to one for
new loads (or a resized cluster), keeping most slots in place. ``stats`` measures placements
(``gpu_loads``, ``placement_stats``, ``load_lower_bound``); ``checks`` validates arguments.
Layering, bottom up: checks, stats, greedy, improve, plan, replanning.

Everything here is a pure function: torch tensors in and out, numpy inside (cheaper per operation
than torch for arrays this small).

Shapes: ``weight [layers, logical_experts]`` (e.g. tokens per expert, non-negative);
``phy2log [layers, num_replicas]`` (physical slot -> logical expert); ``log2phy [layers,
logical_experts, num_replicas - logical_experts + 1]`` (slots of each expert, padded with -1);
``logcnt [layers, logical_experts]``. Slot p is on GPU p // (num_replicas / num_gpus), GPU g on node
g // (num_gpus / num_nodes). The load of a slot is weight[expert] / logcnt[expert]; the load of a
GPU is the sum over its slots.
"""

from .plan import rebalance_experts
from .replanning import DEFAULT_TOLERANCE, Replan, replan
from .stats import PlacementStats, gpu_loads, load_lower_bound, placement_stats

__all__ = [
    "DEFAULT_TOLERANCE",
    "PlacementStats",
    "Replan",
    "gpu_loads",
    "load_lower_bound",
    "placement_stats",
    "rebalance_experts",
    "replan",
]
