"""The rank grid: Megatron's rank arithmetic for one world, pure integers, no communication.

One order string lists the axes, the leftmost varying fastest, so with the default ``tp-cp-ep-dp-pp``

    global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))        (dense grid)
    global_rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))    (expert grid)

Two grids fold onto the same ranks ("MoE parallel folding"): the dense grid (tp, cp, dp, pp; ep treated as 1)
serves attention and dense layers, the expert grid (etp, ep, edp, pp; cp treated as 1) serves routed experts.
Both must give the same pipeline groups. A group named by a set of axes is every set of ranks that agree on all
the other coordinates of its grid; groups are listed in the order of their first member's remaining coordinates
(first axis fastest), members in ascending rank. Results equal megatron-core's ``RankGenerator.get_ranks``
(tests compare them). Worlds of thousands of ranks are cheap: construction checks the supernode rule on residues
(O(supernode size)), not by listing every group.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import ParallelConfigError
from .sharding import check_divisibility, divisors

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
AXES = ("tp", "cp", "ep", "dp", "pp")
# Size-1 axes the order leaves out are appended in this order, as megatron-core does (a size-1 axis changes no
# group; appending keeps the internal order identical to megatron-core's).
_APPEND_ORDER = ("tp", "pp", "dp", "ep", "cp")

# Group name -> (grid, axes of that grid). In the expert grid the order's "tp" and "dp" slots hold etp and edp;
# megatron-core's expert tokens are "tp", "ep", "dp", "tp-ep", "tp-ep-pp".
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


def positive_int(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ParallelConfigError(key, value, "must be a positive integer", "a positive integer")
    return value


def _require_divides(world: int, name: str, value: int, others: Dict[str, int]) -> None:
    """Refuse ``parallel.<name>`` unless value * prod(others) divides the world size."""
    rest = 1
    for v in others.values():
        rest *= v
    if world % (value * rest) == 0:
        return
    valid = [d for d in divisors(world) if world % (d * rest) == 0]
    rule = "divides the world size" if not others else f"{'*'.join([name, *others])} divides the world size"
    if not others:
        raise ParallelConfigError(f"parallel.{name}", value, f"must divide the world size {world}; valid: {valid}",
                                  rule)
    expr = "*".join([name, *others])
    nums = "*".join(str(v) for v in [value, *others.values()])
    fixed = ", ".join(f"parallel.{k}={v}" for k, v in others.items())
    raise ParallelConfigError(f"parallel.{name}", value, f"{expr} = {nums} = {value * rest} must divide the world "
                              f"size {world}; with {fixed} valid {name}: {valid}", rule)


def _offsets(axes: Sequence[Tuple[int, int]]) -> List[int]:
    """All sums of coord * stride over (size, stride) axes, the first axis varying fastest."""
    offs = [0]
    for size, stride in axes:
        offs = [o + i * stride for i in range(size) for o in offs]
    return offs


class RankGrid:
    """Megatron's rank arithmetic for one world: sizes, order, groups, coordinates; no communication.

    ``RankGrid(world_size, tp, cp, ep, pp, etp, order, supernode_size)`` validates at construction and raises
    ``ParallelConfigError`` naming the offending key (``parallel.tp``, ``parallel.order``,
    ``cluster.supernode_size``, ...). ``dp = world / (tp*cp*pp)``, ``edp = world / (etp*ep*pp)``. With
    ``supernode_size`` set, every TP, EP, expert-TP and expert-TP x EP group must lie inside one supernode
    (ranks r sharing r // supernode_size).
    """

    def __init__(self, world_size: int, tp: int = 1, cp: int = 1, ep: int = 1, pp: int = 1, etp: int = 1,
                 order: str = DEFAULT_ORDER, supernode_size: Optional[int] = None):
        self.world_size = positive_int("world_size", world_size)
        self.tp = positive_int("parallel.tp", tp)
        self.cp = positive_int("parallel.cp", cp)
        self.ep = positive_int("parallel.ep", ep)
        self.pp = positive_int("parallel.pp", pp)
        self.etp = positive_int("parallel.etp", etp)
        if supernode_size is not None:
            positive_int("cluster.supernode_size", supernode_size)
        self.supernode_size = supernode_size

        world = self.world_size
        # Blame the outermost factor that fails: pp, then cp (dense) / etp (expert), then tp / ep.
        _require_divides(world, "pp", pp, {})
        _require_divides(world, "cp", cp, {"pp": pp})
        _require_divides(world, "tp", tp, {"cp": cp, "pp": pp})
        _require_divides(world, "etp", etp, {"pp": pp})
        _require_divides(world, "ep", ep, {"etp": etp, "pp": pp})
        self.dp = world // (tp * cp * pp)
        self.edp = world // (etp * ep * pp)

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
                f"sizes must match (dp={self.dp}, edp={self.edp}); put pp last, e.g. {DEFAULT_ORDER}",
                "dense and expert data-parallel sizes match unless pp is last")
        if not self._pp_outermost() and self._enumerate("dense", ("pp",)) != self._enumerate("expert", ("pp",)):
            raise ParallelConfigError(
                "parallel.order", order, f"the dense (tp={tp}, cp={cp}) and expert (etp={etp}, ep={ep}) grids give "
                f"different pipeline groups; put pp last in the order or make tp*cp equal etp*ep",
                "dense and expert grids give the same pipeline groups")
        if supernode_size is not None:
            self._check_supernodes()

    # ------------------------------------------------------------------ order
    def _parse_order(self, order) -> Tuple[str, ...]:
        valid = f"a '-'-joined permutation of {'-'.join(AXES)} (size-1 axes may be left out), e.g. {DEFAULT_ORDER}"
        if not isinstance(order, str) or not order:
            raise ParallelConfigError("parallel.order", order, valid, "a valid order")
        tokens = order.lower().split("-")
        unknown = [t for t in tokens if t not in AXES]
        if unknown:
            raise ParallelConfigError("parallel.order", order, f"unknown axis {unknown[0]!r}; {valid}", "a valid order")
        if len(set(tokens)) != len(tokens):
            dup = next(t for t in tokens if tokens.count(t) > 1)
            raise ParallelConfigError("parallel.order", order, f"axis {dup!r} appears twice; {valid}", "a valid order")
        sizes = {"tp": {"tp": self.tp, "etp": self.etp}, "cp": {"cp": self.cp}, "ep": {"ep": self.ep},
                 "dp": {"dp": self.dp, "edp": self.edp}, "pp": {"pp": self.pp}}
        for axis in AXES:
            if axis not in tokens and max(sizes[axis].values()) > 1:
                shown = ", ".join(f"{k}={v}" for k, v in sizes[axis].items())
                raise ParallelConfigError("parallel.order", order, f"axis {axis!r} is missing but {shown}; {valid}",
                                          "a valid order")
        self._given_order = tuple(tokens)
        return tuple(tokens) + tuple(a for a in _APPEND_ORDER if a not in tokens)

    def _pp_outermost(self) -> bool:
        """Every axis after pp has size 1 in both grids: both give PP groups {r + k world/pp} in the same order."""
        after = self.order.index("pp") + 1
        return all(s == 1 for grid in self._shape.values() for s in grid[after:])

    @property
    def order_string(self) -> str:
        return "-".join(self.order)

    # ------------------------------------------------------------------ groups
    def _axes(self, name: str) -> Tuple[str, Tuple[str, ...]]:
        if name not in GROUPS:
            raise KeyError(f"unknown group {name!r}; known: {', '.join(GROUPS)}")
        return GROUPS[name]

    def _split(self, grid: str, axes: Tuple[str, ...]):
        shape, strides = self._shape[grid], self._strides[grid]
        inner = [(s, d) for a, s, d in zip(self.order, shape, strides) if a in axes]
        outer = [(s, d) for a, s, d in zip(self.order, shape, strides) if a not in axes]
        return inner, outer

    def _enumerate(self, grid: str, axes: Tuple[str, ...]) -> List[Tuple[int, ...]]:
        inner, outer = self._split(grid, axes)
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
        inner, _ = self._split(grid, axes)
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
    def _any_crossing(self, name: str) -> bool:
        """Whether some ``name`` group spans two supernodes, from residues: a group is a translate b + O of one
        offset set O (0 .. M), and crosses iff (b mod s) + M >= s for its base b. Only outer axes whose stride is
        not a multiple of s move b mod s, so at most s residues are visited."""
        s = self.supernode_size
        grid, axes = self._axes(name)
        inner, outer = self._split(grid, axes)
        span = sum((size - 1) * stride for size, stride in inner)
        if span == 0:
            return False
        if span >= s:
            return True
        residues = {0}
        for size, stride in outer:
            if size > 1 and stride % s:
                residues = {(r + i * stride) % s for r in residues for i in range(size)}
        return max(residues) + span >= s

    def _crossing(self, name: str) -> Optional[Tuple[int, ...]]:
        """The first group of kind ``name`` (megatron-core's order) that spans two supernodes, or None."""
        if not self._any_crossing(name):
            return None
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
            for v in divisors(self.world_size):
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
                   "contiguous"), f"{what} groups inside one supernode")

    def _sizes(self) -> Dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "pp": self.pp, "etp": self.etp}

    # ------------------------------------------------------------------ model
    def check_divisibility(self, model_cfg) -> None:
        """Refuse a model this layout cannot shard (layout.sharding)."""
        check_divisibility(model_cfg, tp=self.tp, ep=self.ep, etp=self.etp)

    # ------------------------------------------------------------------ description
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


__all__ = ["RankGrid", "GROUPS", "DEFAULT_ORDER", "AXES", "divisors", "positive_int"]
