"""Parallel layouts as pure arithmetic (no torch): the rank grid, the pipeline partition and the one set of
rules every layout is checked against."""

from .grid import AXES, DEFAULT_ORDER, GROUPS, RankGrid
from .rules import Problem, check_layout, default_replica_slots, layout_problems, replica_slots
from .sharding import (
    ZERO0_ALLREDUCE_BUCKET,
    ZERO_BUCKET,
    check_divisibility,
    divisors,
    expert_block,
    has_moe,
    sharding_problems,
    zero_bucket_elements,
)
from .stages import stage_layers

__all__ = ["AXES", "DEFAULT_ORDER", "GROUPS", "RankGrid", "Problem", "check_layout", "layout_problems", "replica_slots",
           "default_replica_slots", "check_divisibility", "divisors", "expert_block", "has_moe", "sharding_problems",
           "stage_layers", "ZERO_BUCKET", "ZERO0_ALLREDUCE_BUCKET", "zero_bucket_elements"]
