"""Planning a K3 run before buying the hours: parameters, FLOPs, memory, communication and time per device
for a model, a cluster and a parallel layout (`planner`), and the layouts that fit (`search_training`,
`search_inference`). `tools/plan.py` is the command line; `measure` checks the estimates on CPU."""

from .candidates import Layout
from .flops import model_flops
from .memory import Workload
from .planner import (
                      InferPlan,
                      SearchResult,
                      TrainPlan,
                      plan_inference,
                      plan_training,
                      search_inference,
                      search_training,
)

__all__ = ["model_flops", "Layout", "Workload", "TrainPlan", "InferPlan", "SearchResult", "plan_training",
           "plan_inference", "search_training", "search_inference"]
