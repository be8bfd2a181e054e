"""`plait plan`: choose a parallel layout for a model, a cluster and a batch, with predicted memory per rank,
step time, MFU and tokens/s, and the reasons it wins (docs/planner.md)."""

from plait.planner.cluster import PRESETS as CLUSTERS
from plait.planner.cluster import Cluster, get_cluster, measure_local
from plait.planner.cost import Layouts, Workload, evaluate
from plait.planner.search import Plan, enumerate_layouts, plan

__all__ = [
    "CLUSTERS",
    "Cluster",
    "Layouts",
    "Plan",
    "Workload",
    "enumerate_layouts",
    "evaluate",
    "get_cluster",
    "measure_local",
    "plan",
]
