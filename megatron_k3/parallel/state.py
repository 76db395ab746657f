"""The process groups of this rank: one `ParallelState` built from the rank grid (megatron_k3.layout.grid), and
Megatron-style getters that read it.

``initialize_model_parallel`` validates the layout (the rank grid and the model's divisibility, both from
megatron_k3.layout) before its first collective, then builds every group of ``GROUPS`` with
``torch.distributed.new_group`` and keeps them in one ``ParallelState``. With every size 1 and torch.distributed
not initialized, the getters answer size 1, rank 0, group None, so single-process runs use the same code. Modules
never read this state: `megatron_k3.parallel.parallelize` passes them their groups.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from ..layout.grid import DEFAULT_ORDER, GROUPS, RankGrid

logger = logging.getLogger(__name__)


class ParallelState:
    """The grid, this rank, and its process group of every kind (None where torch.distributed is off)."""

    def __init__(self, grid: RankGrid, rank: int, groups: Dict[str, object]):
        self.grid, self.rank, self._groups = grid, rank, groups
        self._ranks = {name: grid.group_of(name, rank) for name in GROUPS}
        self.coords = grid.coords(rank)

    def group(self, name: str):
        return self._groups[name]

    def ranks(self, name: str) -> List[int]:
        return list(self._ranks[name])

    def size(self, name: str) -> int:
        return len(self._ranks[name])

    def rank_in(self, name: str) -> int:
        # torch.distributed numbers a group's members in ascending global rank, as listed here.
        return self._ranks[name].index(self.rank)


_STATE: Optional[ParallelState] = None
_TRIVIAL: Optional[ParallelState] = None


def initialize_model_parallel(tp: int = 1, cp: int = 1, ep: int = 1, pp: int = 1, etp: int = 1,
                              order: str = DEFAULT_ORDER, supernode_size: Optional[int] = None, *,
                              backend: Optional[str] = None, timeout: Optional[timedelta] = None,
                              model_cfg=None) -> ParallelState:
    """Validate the layout, then build every group of ``GROUPS`` on every rank and make it current.

    ``torch.distributed.new_group`` is collective over the whole world, so every rank creates every
    group in the same order (the grid is the same everywhere). Validation happens before the first
    collective: a bad layout raises the same ``ParallelConfigError`` on every rank instead of hanging.
    Groups with identical members share one communicator (e.g. ``dp`` and ``dp-cp`` when cp == 1).
    Without torch.distributed, only the all-ones layout is possible and every group is None.
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError("model parallel state is already initialized; call destroy_model_parallel() first")
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    rank = dist.get_rank() if initialized else 0
    if not initialized and max(tp, cp, ep, pp, etp) > 1:
        raise RuntimeError(f"parallel sizes tp={tp} cp={cp} ep={ep} pp={pp} etp={etp} need torch.distributed: "
                           "launch with torchrun/deepspeed (init_process_group before initialize_model_parallel)")
    grid = RankGrid(world, tp=tp, cp=cp, ep=ep, pp=pp, etp=etp, order=order, supernode_size=supernode_size)
    if model_cfg is not None:
        grid.check_divisibility(model_cfg)

    groups: Dict[str, object] = {name: None for name in GROUPS}
    if initialized:
        made: Dict[Tuple[int, ...], object] = {}
        kwargs = {k: v for k, v in (("backend", backend), ("timeout", timeout)) if v is not None}
        for name in GROUPS:
            for members in grid._groups(name):
                if members not in made:
                    made[members] = dist.new_group(list(members), **kwargs)
                if rank in members:
                    groups[name] = made[members]
    _STATE = ParallelState(grid, rank, groups)
    if rank == 0:
        logger.info(grid.summary())
    return _STATE


def initialize_from_config(cfg, **kwargs) -> ParallelState:
    """``initialize_model_parallel`` from a ``RunConfig`` (parallel.*, cluster.supernode_size, model)."""
    p = cfg.parallel
    return initialize_model_parallel(tp=p.tp, cp=p.cp, ep=p.ep, pp=p.pp, etp=getattr(p, "etp", 1), order=p.order,
                                     supernode_size=cfg.cluster.supernode_size, model_cfg=cfg.model, **kwargs)


def destroy_model_parallel() -> None:
    """Forget the current state (the process groups stay alive until torch.distributed is torn down)."""
    global _STATE
    _STATE = None


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def get_parallel_state() -> ParallelState:
    """The current state; with none and a single process, the all-ones layout with no groups."""
    global _TRIVIAL
    if _STATE is not None:
        return _STATE
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if _TRIVIAL is None:
            _TRIVIAL = ParallelState(RankGrid(1), 0, {name: None for name in GROUPS})
        return _TRIVIAL
    raise RuntimeError(f"model parallel state is not initialized on a world of {dist.get_world_size()} ranks: "
                       "call megatron_k3.parallel.initialize_model_parallel(...) first")


def get_group(name: str):
    return get_parallel_state().group(name)


def get_group_ranks(name: str) -> List[int]:
    return get_parallel_state().ranks(name)


def describe() -> Dict[str, object]:
    """The current layout as a flat dict (for metrics)."""
    return get_parallel_state().grid.describe()


# ---- tensor parallel
def get_tensor_model_parallel_group():
    return get_group("tp")


def get_tensor_model_parallel_world_size() -> int:
    return get_parallel_state().size("tp")


def get_tensor_model_parallel_rank() -> int:
    return get_parallel_state().rank_in("tp")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group (the broadcast source)."""
    return get_parallel_state().ranks("tp")[0]


# ---- pipeline parallel
def get_pipeline_model_parallel_group():
    return get_group("pp")


def get_pipeline_model_parallel_world_size() -> int:
    return get_parallel_state().size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return get_parallel_state().rank_in("pp")


def get_pipeline_model_parallel_first_rank() -> int:
    return get_parallel_state().ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return get_parallel_state().ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    s = get_parallel_state()
    r = s.ranks("pp")
    return r[(s.rank_in("pp") + 1) % len(r)]


def get_pipeline_model_parallel_prev_rank() -> int:
    s = get_parallel_state()
    r = s.ranks("pp")
    return r[(s.rank_in("pp") - 1) % len(r)]


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


# ---- data parallel (dense); with_context_parallel: the dp x cp group gradients are reduced over
def _dp(with_context_parallel: bool) -> str:
    return "dp-cp" if with_context_parallel else "dp"


def get_data_parallel_group(with_context_parallel: bool = False):
    return get_group(_dp(with_context_parallel))


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return get_parallel_state().size(_dp(with_context_parallel))


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return get_parallel_state().rank_in(_dp(with_context_parallel))


# ---- context parallel
def get_context_parallel_group():
    return get_group("cp")


def get_context_parallel_world_size() -> int:
    return get_parallel_state().size("cp")


def get_context_parallel_rank() -> int:
    return get_parallel_state().rank_in("cp")


# ---- model parallel: tp x pp, every shard of one dense replica
def get_model_parallel_group():
    return get_group("tp-pp")


def get_model_parallel_world_size() -> int:
    return get_parallel_state().size("tp-pp")


def get_model_parallel_rank() -> int:
    return get_parallel_state().rank_in("tp-pp")


# ---- experts
def get_expert_model_parallel_group():
    return get_group("ep")


def get_expert_model_parallel_world_size() -> int:
    return get_parallel_state().size("ep")


def get_expert_model_parallel_rank() -> int:
    return get_parallel_state().rank_in("ep")


def get_expert_tensor_parallel_group():
    return get_group("etp")


def get_expert_tensor_parallel_world_size() -> int:
    return get_parallel_state().size("etp")


def get_expert_tensor_parallel_rank() -> int:
    return get_parallel_state().rank_in("etp")


def get_expert_tensor_and_model_parallel_group():
    return get_group("etp-ep")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return get_parallel_state().size("etp-ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return get_parallel_state().rank_in("etp-ep")


def get_expert_data_parallel_group():
    return get_group("edp")


def get_expert_data_parallel_world_size() -> int:
    return get_parallel_state().size("edp")


def get_expert_data_parallel_rank() -> int:
    return get_parallel_state().rank_in("edp")


