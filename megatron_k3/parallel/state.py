"""Who talks to whom: the rank grid (pure arithmetic) and the process groups built from it.

Layout, as Megatron-core's: one order string lists the axes, the leftmost varying fastest, so with the
default ``tp-cp-ep-dp-pp``

    global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))        (dense grid)
    global_rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))    (expert grid)

Two grids fold onto the same ranks ("MoE parallel folding"): the dense grid (tp, cp, dp, pp; ep
treated as 1) serves attention and dense layers, the expert grid (etp, ep, edp, pp; cp treated as 1)
serves routed experts. Both must give the same pipeline groups. A group named by a set of axes is
every set of ranks that agree on all the other coordinates of its grid; groups are listed in the
order of their first member's remaining coordinates (first axis fastest), members in ascending rank.
Results equal megatron-core's ``RankGenerator.get_ranks`` (tests compare them).

``RankGrid`` is the arithmetic alone (no torch.distributed; worlds of thousands of ranks are cheap).
``initialize_model_parallel`` builds every group with ``torch.distributed.new_group`` and keeps them in
one ``ParallelState``; the Megatron-style getters read it. With every size 1 and torch.distributed not
initialized, the getters answer size 1, rank 0, group None, so single-process runs use the same code.
``get_mpu()`` returns the object ``deepspeed.initialize(mpu=...)`` expects (see ``MPU``).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron_k3.config import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
AXES = ("tp", "cp", "ep", "dp", "pp")
# Size-1 axes the order leaves out are appended in this order, as megatron-core does (a size-1 axis
# changes no group; appending keeps the internal order identical to megatron-core's).
_APPEND_ORDER = ("tp", "pp", "dp", "ep", "cp")

# Group name -> (grid, axes of that grid). In the expert grid the order's "tp" and "dp" slots hold
# etp and edp; megatron-core's expert tokens are "tp", "ep", "dp", "tp-ep", "tp-ep-pp".
GROUPS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "tp": ("dense", ("tp",)),
    "cp": ("dense", ("cp",)),
    "dp": ("dense", ("dp",)),
    "pp": ("dense", ("pp",)),
    "dp-cp": ("dense", ("dp", "cp")),          # data parallel with context parallel (gradient reduction)
    "tp-cp": ("dense", ("tp", "cp")),
    "tp-pp": ("dense", ("tp", "pp")),          # model parallel: every shard of one model replica
    "tp-dp-cp": ("dense", ("tp", "dp", "cp")),  # one pipeline stage across all replicas
    "ep": ("expert", ("ep",)),
    "etp": ("expert", ("tp",)),
    "edp": ("expert", ("dp",)),
    "etp-ep": ("expert", ("tp", "ep")),        # the dispatcher's all-to-all domain
    "etp-ep-pp": ("expert", ("tp", "ep", "pp")),  # every expert shard of one replica
}


class ParallelConfigError(ConfigError):
    """A parallel layout is impossible or breaks a rule; the message names the key, the value and what
    is valid. A ``ConfigError`` (hence a ``ValueError``)."""


def _positive_int(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ParallelConfigError(key, value, "must be a positive integer")
    return value


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _require_divides(world: int, name: str, value: int, others: Dict[str, int]) -> None:
    """Refuse ``parallel.<name>`` unless value * prod(others) divides the world size."""
    rest = 1
    for v in others.values():
        rest *= v
    if world % (value * rest) == 0:
        return
    valid = [d for d in _divisors(world) if world % (d * rest) == 0]
    if not others:
        raise ParallelConfigError(f"parallel.{name}", value, f"must divide the world size {world}; valid: {valid}")
    expr = "*".join([name, *others])
    nums = "*".join(str(v) for v in [value, *others.values()])
    fixed = ", ".join(f"parallel.{k}={v}" for k, v in others.items())
    raise ParallelConfigError(f"parallel.{name}", value, f"{expr} = {nums} = {value * rest} must divide the world "
                              f"size {world}; with {fixed} valid {name}: {valid}")


def _offsets(axes: Sequence[Tuple[int, int]]) -> List[int]:
    """All sums of coord * stride over (size, stride) axes, the first axis varying fastest."""
    offs = [0]
    for size, stride in axes:
        offs = [o + i * stride for i in range(size) for o in offs]
    return offs


class RankGrid:
    """Megatron's rank arithmetic for one world: sizes, order, groups, coordinates; no communication.

    ``RankGrid(world_size, tp, cp, ep, pp, etp, order, supernode_size)`` validates at construction
    and raises ``ParallelConfigError`` naming the offending key (``parallel.tp``, ``parallel.order``,
    ``cluster.supernode_size``, ...). ``dp = world / (tp*cp*pp)``, ``edp = world / (etp*ep*pp)``.
    With ``supernode_size`` set, every TP, EP, expert-TP and expert-TP x EP group must lie inside
    one supernode (ranks r sharing r // supernode_size).
    """

    def __init__(self, world_size: int, tp: int = 1, cp: int = 1, ep: int = 1, pp: int = 1, etp: int = 1,
                 order: str = DEFAULT_ORDER, supernode_size: Optional[int] = None):
        self.world_size = _positive_int("world_size", world_size)
        self.tp = _positive_int("parallel.tp", tp)
        self.cp = _positive_int("parallel.cp", cp)
        self.ep = _positive_int("parallel.ep", ep)
        self.pp = _positive_int("parallel.pp", pp)
        self.etp = _positive_int("parallel.etp", etp)
        if supernode_size is not None:
            _positive_int("cluster.supernode_size", supernode_size)
        self.supernode_size = supernode_size

        world = self.world_size
        # Blame the outermost factor that fails: pp, then cp (dense) / etp (expert), then tp / ep.
        _require_divides(world, "pp", pp, {})
        _require_divides(world, "cp", cp, {"pp": pp})
        _require_divides(world, "tp", tp, {"cp": cp, "pp": pp})
        _require_divides(world, "etp", etp, {"pp": pp})
        _require_divides(world, "ep", ep, {"etp": etp, "pp": pp})
        dense_mp, expert_mp = tp * cp * pp, etp * ep * pp
        self.dp = world // dense_mp
        self.edp = world // expert_mp

        self.order = self._parse_order(order)
        dense = {"tp": tp, "cp": cp, "ep": 1, "dp": self.dp, "pp": pp}
        expert = {"tp": etp, "cp": 1, "ep": ep, "dp": self.edp, "pp": pp}
        self._shape = {"dense": [dense[a] for a in self.order], "expert": [expert[a] for a in self.order]}
        self._strides = {}
        for grid, shape in self._shape.items():
            strides, acc = [], 1
            for s in shape:
                strides.append(acc)
                acc *= s
            self._strides[grid] = strides
        self._cache: Dict[str, List[Tuple[int, ...]]] = {}

        # Megatron's rule: unless pp is the outermost axis, attention and MoE see the same DP size.
        if self._given_order[-1] != "pp" and pp > 1 and self.edp != self.dp:
            raise ParallelConfigError(
                "parallel.order", order, f"with pp={pp} not last in the order the dense and expert data-parallel "
                f"sizes must match (dp={self.dp}, edp={self.edp}); put pp last, e.g. {DEFAULT_ORDER}")
        if self._enumerate("dense", ("pp",)) != self._enumerate("expert", ("pp",)):
            raise ParallelConfigError(
                "parallel.order", order, f"the dense (tp={tp}, cp={cp}) and expert (etp={etp}, ep={ep}) grids give "
                f"different pipeline groups; put pp last in the order or make tp*cp equal etp*ep")
        if supernode_size is not None:
            self._check_supernodes()

    # ------------------------------------------------------------------ order
    def _parse_order(self, order) -> Tuple[str, ...]:
        valid = f"a '-'-joined permutation of {'-'.join(AXES)} (size-1 axes may be left out), e.g. {DEFAULT_ORDER}"
        if not isinstance(order, str) or not order:
            raise ParallelConfigError("parallel.order", order, valid)
        tokens = order.lower().split("-")
        unknown = [t for t in tokens if t not in AXES]
        if unknown:
            raise ParallelConfigError("parallel.order", order, f"unknown axis {unknown[0]!r}; {valid}")
        if len(set(tokens)) != len(tokens):
            dup = next(t for t in tokens if tokens.count(t) > 1)
            raise ParallelConfigError("parallel.order", order, f"axis {dup!r} appears twice; {valid}")
        sizes = {"tp": {"tp": self.tp, "etp": self.etp}, "cp": {"cp": self.cp}, "ep": {"ep": self.ep},
                 "dp": {"dp": self.dp, "edp": self.edp}, "pp": {"pp": self.pp}}
        for axis in AXES:
            if axis not in tokens and max(sizes[axis].values()) > 1:
                shown = ", ".join(f"{k}={v}" for k, v in sizes[axis].items())
                raise ParallelConfigError("parallel.order", order, f"axis {axis!r} is missing but {shown}; {valid}")
        self._given_order = tuple(tokens)
        return tuple(tokens) + tuple(a for a in _APPEND_ORDER if a not in tokens)

    @property
    def order_string(self) -> str:
        return "-".join(self.order)

    # ------------------------------------------------------------------ groups
    def _axes(self, name: str) -> Tuple[str, Tuple[str, ...]]:
        if name not in GROUPS:
            raise KeyError(f"unknown group {name!r}; known: {', '.join(GROUPS)}")
        return GROUPS[name]

    def _enumerate(self, grid: str, axes: Tuple[str, ...]) -> List[Tuple[int, ...]]:
        shape, strides = self._shape[grid], self._strides[grid]
        inner = [(s, d) for a, s, d in zip(self.order, shape, strides) if a in axes]
        outer = [(s, d) for a, s, d in zip(self.order, shape, strides) if a not in axes]
        members = _offsets(inner)
        return [tuple(b + m for m in members) for b in _offsets(outer)]

    def _groups(self, name: str) -> List[Tuple[int, ...]]:
        if name not in self._cache:
            self._cache[name] = self._enumerate(*self._axes(name))
        return self._cache[name]

    def groups(self, name: str) -> List[List[int]]:
        """Every group of kind ``name`` (see ``GROUPS``), in megatron-core's order."""
        return [list(g) for g in self._groups(name)]

    def _coords(self, grid: str, rank: int) -> Dict[str, int]:
        return {a: (rank // d) % s for a, s, d in zip(self.order, self._shape[grid], self._strides[grid])}

    def coords(self, rank: int) -> Dict[str, int]:
        """This rank's index along every axis: tp, cp, dp, pp (dense grid), etp, ep, edp (expert grid)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        d, e = self._coords("dense", rank), self._coords("expert", rank)
        return {"tp": d["tp"], "cp": d["cp"], "dp": d["dp"], "pp": d["pp"],
                "etp": e["tp"], "ep": e["ep"], "edp": e["dp"]}

    def group_of(self, name: str, rank: int) -> List[int]:
        """The members of the ``name`` group that holds ``rank`` (O(group size), no enumeration)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        grid, axes = self._axes(name)
        c = self._coords(grid, rank)
        inner = [(s, d) for a, s, d in zip(self.order, self._shape[grid], self._strides[grid]) if a in axes]
        base = rank - sum(c[a] * d for a, d in zip(self.order, self._strides[grid]) if a in axes)
        return [base + m for m in _offsets(inner)]

    def size(self, name: str) -> int:
        grid, axes = self._axes(name)
        n = 1
        for a, s in zip(self.order, self._shape[grid]):
            if a in axes:
                n *= s
        return n

    # ------------------------------------------------------------------ supernodes
    def _crossing(self, name: str) -> Optional[Tuple[int, ...]]:
        s = self.supernode_size
        return next((g for g in self._groups(name) if g[0] // s != g[-1] // s), None)

    def _check_supernodes(self) -> None:
        s = self.supernode_size
        for name, key, what in (("tp", "parallel.tp", "TP"), ("ep", "parallel.ep", "EP"),
                                ("etp", "parallel.etp", "expert-TP"), ("etp-ep", "parallel.ep", "expert-TP x EP")):
            bad = self._crossing(name)
            if bad is None:
                continue
            axis = key.split(".")[1]
            valid = []
            for v in _divisors(self.world_size):
                try:
                    g = RankGrid(self.world_size, **{**self._sizes(), axis: v}, order=self.order_string)
                except ParallelConfigError:
                    continue
                g.supernode_size = s
                if g._crossing(name) is None:
                    valid.append(v)
            shown = ", ".join(map(str, bad[:4])) + (", ..., " + str(bad[-1]) if len(bad) > 4 else "")
            raise ParallelConfigError(
                key, getattr(self, axis),
                f"the {what} group [{shown}] spans supernodes {bad[0] // s}..{bad[-1] // s} of "
                f"cluster.supernode_size={s}, but every {what} group must lie inside one supernode; "
                f"with parallel.order={self.order_string} and the other sizes fixed, valid {key}: {valid}"
                + ("" if what == "TP" else "; placing ep (and tp) left of dp and pp in the order keeps EP groups "
                   "contiguous"))

    def _sizes(self) -> Dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "pp": self.pp, "etp": self.etp}

    # ------------------------------------------------------------------ model
    def check_divisibility(self, model_cfg) -> None:
        check_divisibility(model_cfg, tp=self.tp, ep=self.ep, etp=self.etp)

    def describe(self) -> Dict[str, object]:
        """The layout as a flat dict (for metrics and run metadata); the same on every rank."""
        return {"world_size": self.world_size, "tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp,
                "ep": self.ep, "etp": self.etp, "edp": self.edp, "order": self.order_string,
                "supernode_size": self.supernode_size}

    def summary(self) -> str:
        d = self.describe()
        return (f"parallel layout: world={d['world_size']} | dense tp={d['tp']} cp={d['cp']} dp={d['dp']} "
                f"pp={d['pp']} | expert etp={d['etp']} ep={d['ep']} edp={d['edp']} | order={d['order']}"
                + (f" | supernode={d['supernode_size']}" if d["supernode_size"] else ""))

    def __repr__(self) -> str:
        keys = ("world_size", "tp", "cp", "ep", "pp", "etp", "dp", "edp", "supernode_size")
        return f"RankGrid({', '.join(f'{k}={getattr(self, k, None)!r}' for k in keys)})"


def check_divisibility(model_cfg, tp: int = 1, ep: int = 1, etp: int = 1) -> None:
    """Refuse sizes that cannot shard ``model_cfg`` (a ``megatron_k3.config.ModelConfig``): tp must divide
    the KDA and MLA head counts, ep the number of routed experts, etp the expert FFN width."""
    for key in ("kda_num_heads", "mla_num_heads"):
        n = getattr(model_cfg, key)
        if n % tp:
            raise ParallelConfigError("parallel.tp", tp, f"must divide model.{key}={n}; valid: {_divisors(n)}")
    has_moe = getattr(model_cfg, "first_k_dense", 0) < getattr(model_cfg, "num_layers", 1)
    if has_moe:
        n = model_cfg.num_experts
        if n % ep:
            raise ParallelConfigError("parallel.ep", ep, f"must divide model.num_experts={n}; valid: {_divisors(n)}")
        n = model_cfg.moe_intermediate_size
        if n % etp:
            raise ParallelConfigError("parallel.etp", etp,
                                      f"must divide model.moe_intermediate_size={n}; valid: {_divisors(n)}")


# ====================================================================== process groups


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


# ====================================================================== DeepSpeed's mpu


class MPU:
    """What ``deepspeed.initialize(mpu=...)`` (DeepSpeed 0.19.8) calls, answered from the current state.

    Every method reads the current ``ParallelState`` at call time. Who calls what in DeepSpeed 0.19.8:

    - ``get_data_parallel_world_size``: ``runtime/config.py`` (batch-size arithmetic: train_batch =
      micro_batch * grad_accum * this), ``utils/groups._get_data_parallel_world_size`` -> engine
      ``dp_world_size``; ``runtime/engine.py`` (data sampler); ``model_checkpointing/utils.py``.
    - ``get_data_parallel_group``: ``utils/groups._get_data_parallel_group`` -> engine
      ``data_parallel_group``, the norm averaging in ``runtime/utils.clip_grad_norm_``, ZeRO-3
      ``zero.Init``/``parameter_offload``. (ZeRO 1/2 partition and reduce over the sequence-data group.)
    - ``get_data_parallel_rank``, ``get_data_parallel_group_ranks``: engine data sampler,
      ``model_checkpointing/utils.py``, ``utils/groups._get_data_parallel_group_ranks``.
    - ``get_model_parallel_group``: overflow check (``runtime/utils.CheckOverflow``), gradient/weight norms
      (``runtime/utils.py``, ZeRO 1/2/3 ``model_parallel_group``), inference/hybrid engines. Here tp x pp,
      so a global norm sums every model shard.
    - ``get_model_parallel_rank`` / ``get_model_parallel_world_size``: checkpoint file names
      (``mp_rank_XX``, ``zero_pp_rank_D_mp_rank_XX``; engine ``checkpoint_mp_rank`` when the size > 1),
      ``runtime/utils.clip_grad_norm_`` (non-ZeRO path: counts replicated params where the rank is 0),
      ZeRO 1/2 ``model_parallel_world_size``. Rank in tp x pp, so names are unique per shard.
    - ``get_tensor_model_parallel_rank`` / ``_world_size`` / ``_group`` (through ``utils/bwc.py``):
      ZeRO 1/2 and bf16/fp16 optimizers (count TP-replicated params once in norms), activation
      checkpointing (RNG tracker), checkpoint metadata (TP degree), Domino, model_checkpointing.
      ``get_tensor_model_parallel_src_rank``: the AutoTP data-consistency check (there DeepSpeed swaps
      in its own ``groups`` module, so ours is for completeness).
    - ``get_pipeline_model_parallel_world_size`` / ``_rank`` / ``_group`` (``utils/bwc.py``): checkpoint
      metadata (PP degree), MoE gradient norms, ``model_checkpointing/utils.py``.
    - ``get_sequence_parallel_world_size`` / ``_rank`` / ``_group`` and ``get_sequence_data_parallel_*``
      (``utils/groups.py``): DeepSpeed's sequence parallelism. Context parallelism maps onto it: the
      sequence group is the CP group and the sequence-data group is dp x cp, so ZeRO partitions and
      reduces gradients over dp x cp and divides the sum by dp only. The loss of each CP rank must
      therefore be its share of the sequence loss (local token sum / global token count).

    Deliberately absent: ``initialize_sequence_parallel`` (its presence makes DeepSpeed treat the mpu as
    a Ulysses-only one and ignore the data-parallel and model-parallel groups), ``get_slice_parallel_*``
    and ``get_pipe_parallel_*`` (names of DeepSpeed's own ``PipelineParallelGrid``; ``bwc`` prefers the
    tensor/pipeline names above), ``_init_tp_mesh_device`` (called on DeepSpeed's ``groups``).

    The expert getters are not called by DeepSpeed 0.19.8 (its MoE builds its own groups); they are here
    so our engine code can ask one object for everything.
    """

    # model parallel (tp x pp)
    get_model_parallel_group = staticmethod(get_model_parallel_group)
    get_model_parallel_world_size = staticmethod(get_model_parallel_world_size)
    get_model_parallel_rank = staticmethod(get_model_parallel_rank)
    # tensor parallel
    get_tensor_model_parallel_group = staticmethod(get_tensor_model_parallel_group)
    get_tensor_model_parallel_world_size = staticmethod(get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_rank = staticmethod(get_tensor_model_parallel_rank)
    get_tensor_model_parallel_src_rank = staticmethod(get_tensor_model_parallel_src_rank)
    # pipeline parallel
    get_pipeline_model_parallel_group = staticmethod(get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_world_size = staticmethod(get_pipeline_model_parallel_world_size)
    get_pipeline_model_parallel_rank = staticmethod(get_pipeline_model_parallel_rank)
    # data parallel (dense, without cp)
    get_data_parallel_group = staticmethod(get_data_parallel_group)
    get_data_parallel_world_size = staticmethod(get_data_parallel_world_size)
    get_data_parallel_rank = staticmethod(get_data_parallel_rank)

    @staticmethod
    def get_data_parallel_group_ranks() -> List[int]:
        return get_group_ranks("dp")

    # context parallel, in DeepSpeed's sequence-parallel vocabulary
    get_sequence_parallel_group = staticmethod(get_context_parallel_group)
    get_sequence_parallel_world_size = staticmethod(get_context_parallel_world_size)
    get_sequence_parallel_rank = staticmethod(get_context_parallel_rank)

    @staticmethod
    def get_sequence_data_parallel_group():
        return get_data_parallel_group(with_context_parallel=True)

    @staticmethod
    def get_sequence_data_parallel_world_size() -> int:
        return get_data_parallel_world_size(with_context_parallel=True)

    @staticmethod
    def get_sequence_data_parallel_rank() -> int:
        return get_data_parallel_rank(with_context_parallel=True)

    # experts (ours; not called by DeepSpeed 0.19.8)
    get_expert_model_parallel_group = staticmethod(get_expert_model_parallel_group)
    get_expert_model_parallel_world_size = staticmethod(get_expert_model_parallel_world_size)
    get_expert_model_parallel_rank = staticmethod(get_expert_model_parallel_rank)
    get_expert_tensor_parallel_group = staticmethod(get_expert_tensor_parallel_group)
    get_expert_tensor_parallel_world_size = staticmethod(get_expert_tensor_parallel_world_size)
    get_expert_tensor_parallel_rank = staticmethod(get_expert_tensor_parallel_rank)
    get_expert_data_parallel_group = staticmethod(get_expert_data_parallel_group)
    get_expert_data_parallel_world_size = staticmethod(get_expert_data_parallel_world_size)
    get_expert_data_parallel_rank = staticmethod(get_expert_data_parallel_rank)


_MPU = MPU()


def get_mpu() -> MPU:
    """The object to pass as ``deepspeed.initialize(mpu=...)``."""
    return _MPU
