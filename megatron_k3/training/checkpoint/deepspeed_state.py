"""The optimizer state a checkpoint holds, seen per parameter, whatever keeps it: the torch optimizer itself (ZeRO-0:
per-parameter states, every data-parallel replica holding all of them), DeepSpeed's ZeRO-1/2 optimizer (fp32 masters
and states in flat per-group partitions over data parallelism; Muon's momentum per whole matrix, optim/zero.py), and
the routed experts' optimizer under expert parallelism (training/expert_optimizer.py).

What each rank writes to a sharded checkpoint (`owned_pieces`: views of what it owns, no copies), what it reads back
under any layout (`load_pieces`), and the gathered full-size view (`full_states`, a collective: tests compare layouts
with it). `_ZeroPartitions` is the one place that reads DeepSpeed's internals (DeepSpeed 0.19.8, pinned in
requirements.txt): the fragment mappings it links to every parameter (`_hp_mapping`), which partitions a parameter
lies in (`param_to_partition_ids`, `params_in_partition`), its groups (`bit16_groups`, `real_dp_process_group`).
The process groups come from the rank's `ParallelState`, passed in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...annotations import full_shape, meta, shard_offsets
from ...optim.zero import ZeroMuon, momentum_offsets
from ..engine import base_optimizer, zero_optimizer
from .shards import RankPieces, share

MOMENTUM = "momentum_buffer"  # Muon's state key, per matrix in one process, per partition in DeepSpeed's ZeRO


def _state_keys(opt) -> tuple:
    """(per-element state keys, scalar state keys) of a torch optimizer, from the states it holds."""
    elem, scalar = set(), set()
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                elem.add(k)
            else:
                scalar.add(k)
    return tuple(sorted(elem)), tuple(sorted(scalar))


def _group_key(group: dict, gi: int, prefix: str) -> str:
    """A group's name in the checkpoint: its rule where it has one (the same under every layout, also when the
    experts leave the dense optimizer under ep > 1), else its index."""
    return f"{prefix}.{group['rule']}" if "rule" in group else f"{prefix}.{gi}"


def _group_scalars(opt, prefix: str) -> dict:
    scalar_keys = _state_keys(opt)[1]
    out = {}
    for gi, group in enumerate(opt.param_groups):
        st = next((opt.state[q] for q in group["params"] if opt.state.get(q)), None)
        if st:
            out[_group_key(group, gi, prefix)] = {k: float(v.item()) if torch.is_tensor(v) else v
                                                  for k, v in st.items() if k in scalar_keys}
    return out


def _ensure_states(opt, keys_of: dict, scalars: dict, prefix: str) -> None:
    """Optimizer states are created lazily at the first step; build them now, shaped like the tensors they track,
    so saved values have somewhere to go: `keys_of` {id(tensor): state keys} for the tensors the checkpoint
    holds states of, which also get their group's scalars (a step count). A group whose rule the checkpoint has
    only under the other optimizer (the routed experts move between the dense and the experts' optimizer when the
    expert-parallel size changes) takes that one's scalars: both step together."""
    for gi, group in enumerate(opt.param_groups):
        sc = scalars.get(_group_key(group, gi, prefix))
        if sc is None and "rule" in group:
            sc = next((v for k, v in scalars.items() if k.split(".", 1)[-1] == group["rule"]), None)
        if sc is None:
            sc = scalars.get(f"{prefix}.{gi}", {})
        for q in group["params"]:
            keys = keys_of.get(id(q))
            if not keys:
                continue
            st = opt.state[q]
            for k in keys:
                if k not in st:
                    st[k] = torch.zeros_like(q, memory_format=torch.preserve_format)
            for k, v in sc.items():
                st[k] = torch.tensor(float(v), dtype=torch.float32) if isinstance(v, float) else v


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("a checkpointed tensor must be contiguous")
    return t.detach().reshape(-1)


class _PlainStates:
    """ZeRO-0: the torch optimizer holds each parameter's states; the dp x cp replicas (times tp for a tensor every
    TP rank holds whole) write one share each of every tensor."""

    def __init__(self, opt, ps):
        self.opt, self.ps = opt, ps
        self.elem = _state_keys(opt)[0]

    def _share(self, p) -> tuple:
        count, idx = self.ps.size("dp-cp"), self.ps.rank_in("dp-cp")
        if meta(p).tp_dim is None and self.ps.size("tp") > 1:
            count, idx = count * self.ps.size("tp"), self.ps.rank_in("tp") * count + idx
        return share(p.numel(), count, idx)

    def add_pieces(self, out: RankPieces, name: str, p) -> None:
        G, O = full_shape(p), shard_offsets(p)
        start, n = self._share(p)
        out.add_range(name, p.shape, G, O, start, _flat(p).narrow(0, start, n))
        st = self.opt.state.get(p, {})
        for k in self.elem:
            if k in st:
                out.add_range(f"{name}::{k}", p.shape, G, O, start, _flat(st[k]).narrow(0, start, n))

    def full(self, p) -> tuple:
        st = self.opt.state.get(p, {})
        return self.master(p), {k: st[k].detach().cpu() for k in self.elem if k in st}

    def master(self, p) -> torch.Tensor:
        return p.detach().float().cpu()

    def prepare_load(self, dense: list, states_of: dict, scalars: dict) -> None:
        _ensure_states(self.opt, {id(p): sorted(states_of.get(n, [])) for n, p in dense}, scalars, "dense")

    def read(self, index, name: str, p, keys: list) -> None:
        O = shard_offsets(p)
        index.read(name, O, p.data)
        for k in keys:
            index.read(f"{name}::{k}", O, self.opt.state[p][k])

    def finish_load(self, dense: list, index, states_of: dict) -> None:
        pass

    def masters_from_module(self) -> None:
        pass


class _ZeroPartitions:
    """DeepSpeed's ZeRO-1/2 optimizer: each parameter's fragment of the fp32 master and of each per-element state in
    the rank's flat partition of its group (a TP-replicated tensor's fragments written by tensor-parallel rank 0
    only); for Muon groups DeepSpeed's flat momentum of whole matrices, each matrix written by the lowest
    data-parallel rank whose partition touches it."""

    def __init__(self, zero, opt, ps):
        self.zero, self.opt, self.ps = zero, opt, ps
        # DeepSpeed links the fragments once, possibly before the first step created the states: point them at the
        # current ones
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
        self.group_of = {id(q): gi for gi, g in enumerate(zero.bit16_groups) for q in g}
        self.flat = [g["params"][0] for g in opt.param_groups]
        self.muon = {gi for gi, g in enumerate(opt.param_groups) if isinstance(opt, ZeroMuon) and g.get("use_muon")}
        self._offsets = {}

    def _elem_keys(self, gi: int) -> list:
        """The per-element states of group gi that DeepSpeed's fragments map (Muon's momentum is not one)."""
        st = self.opt.state.get(self.flat[gi], {})
        return sorted(k for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0
                      and not (gi in self.muon and k == MOMENTUM))

    def _momentum_source(self, gi: int, p) -> int:
        """The lowest data-parallel rank (in the group's process group) whose partition holds part of p."""
        return min(self.zero.param_to_partition_ids[gi][self.zero.get_param_id(p)])

    def _momentum_view(self, gi: int, p):
        """p's whole momentum in this rank's flat Muon momentum (a rank whose partition touches p), or None (before
        the first step)."""
        buf = self.opt.state.get(self.flat[gi], {}).get(MOMENTUM)
        if buf is None:
            return None
        if gi not in self._offsets:
            self._offsets[gi] = momentum_offsets(self.zero, gi)
        return buf.narrow(0, self._offsets[gi][id(p)], p.numel())

    def add_pieces(self, out: RankPieces, name: str, p) -> None:
        if meta(p).tp_dim is None and self.ps.size("tp") > 1 and self.ps.rank_in("tp") != 0:
            return
        G, O = full_shape(p), shard_offsets(p)
        gi = self.group_of[id(p)]
        hpm = p._hp_mapping
        if hpm is not None:  # None: no element of p lies in this rank's partition
            start = hpm.lp_fragment_address.start
            out.add_range(name, p.shape, G, O, start, hpm.hp_fragment)
            for k in self._elem_keys(gi):
                out.add_range(f"{name}::{k}", p.shape, G, O, start, hpm.get_optim_state_fragment(k))
        if gi in self.muon and dist.get_rank(self.zero.real_dp_process_group[gi]) == self._momentum_source(gi, p):
            view = self._momentum_view(gi, p)
            if view is not None:
                out.add_range(f"{name}::{MOMENTUM}", p.shape, G, O, 0, view)

    def full(self, p) -> tuple:
        gi = self.group_of[id(p)]
        states = {k: p.get_full_hp_param(k).detach().cpu() for k in self._elem_keys(gi)}
        if gi in self.muon:  # sent by a rank that holds it (every such rank holds the same); zeros before step 1
            group, src = self.zero.real_dp_process_group[gi], self._momentum_source(gi, p)
            t = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            view = self._momentum_view(gi, p) if dist.get_rank(group) == src else None
            if view is not None:
                t.copy_(view.view(p.shape))
            if dist.get_world_size(group) > 1:
                dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
            states[MOMENTUM] = t.cpu()
        return self.master(p), states

    def master(self, p) -> torch.Tensor:
        return p.get_full_hp_param().detach().cpu()

    def prepare_load(self, dense: list, states_of: dict, scalars: dict) -> None:
        keys_of = {}
        for name, p in dense:
            gi = self.group_of[id(p)]
            keys = [k for k in states_of.get(name, []) if not (gi in self.muon and k == MOMENTUM)]
            flat = id(self.flat[gi])
            keys_of[flat] = sorted(set(keys_of.get(flat, [])) | set(keys))
        _ensure_states(self.opt, keys_of, scalars, "dense")
        self.zero._hp_optimizer_states_linked = False  # the states just made: link the fragments to them
        self.zero._lazy_init_hp_params_optimizer_state()

    def read(self, index, name: str, p, keys: list) -> None:
        O = shard_offsets(p)
        index.read(name, O, p.data)
        hpm = p._hp_mapping
        if hpm is None:
            return
        gi = self.group_of[id(p)]
        start = hpm.lp_fragment_address.start
        index.read_range(name, p.shape, O, start, hpm.hp_fragment)
        for k in keys:
            if not (gi in self.muon and k == MOMENTUM):
                index.read_range(f"{name}::{k}", p.shape, O, start, hpm.get_optim_state_fragment(k))

    def finish_load(self, dense: list, index, states_of: dict) -> None:
        """Each Muon group's flat momentum, from every matrix's whole one in the checkpoint (zeros where absent)."""
        name_of = {id(p): n for n, p in dense}
        for gi in sorted(self.muon):
            params = self.zero.params_in_partition[gi]
            if not params:
                continue
            parts = []
            for q in params:
                name = name_of[id(q)]
                if MOMENTUM in states_of.get(name, []):
                    v = index.read(f"{name}::{MOMENTUM}", shard_offsets(q), torch.empty(q.shape, dtype=torch.float32))
                    parts.append(v.flatten())
                else:
                    parts.append(torch.zeros(q.numel()))
            flat = self.flat[gi]
            old = self.opt.state[flat].get(MOMENTUM)
            dtype = old.dtype if old is not None else torch.float32
            self.opt.state[flat][MOMENTUM] = torch.cat(parts).to(device=flat.device, dtype=dtype)

    def masters_from_module(self) -> None:
        self.zero.refresh_fp32_params()


def _dense_states(engine, ps):
    zero = zero_optimizer(engine)
    base = base_optimizer(engine)
    return _PlainStates(base, ps) if zero is None else _ZeroPartitions(zero, base, ps)


def _gather_experts(t: torch.Tensor, ps) -> torch.Tensor:
    """This EP rank's experts of a master (or state) gathered over EP: global expert order."""
    parts = [torch.empty_like(t) for _ in range(ps.size("ep"))]
    dist.all_gather(parts, t.contiguous(), group=ps.group("ep"))
    return torch.cat(parts, 0)


def _dense(named_params, experts) -> list:
    expert_names = set(experts.names) if experts is not None else set()
    return [(n, p) for n, p in named_params if n not in expert_names]


def full_states(engine, named_params, ps, experts=None) -> tuple:
    """({name: fp32 master weight}, {name: {state key: full tensor}}, {'dense.<rule>'|'experts.<rule>': {scalar
    key: value}}), at full size for this tensor-parallel shard: ZeRO's partitions gathered over data parallel
    (Muon's momentum, which DeepSpeed keeps per whole matrix, sent by a rank that holds it), expert-parallel
    weights gathered over the EP group (global expert order).

    Every rank must call this, in the same order everywhere (it is made of collectives)."""
    dense_states = _dense_states(engine, ps)
    weights, states = {}, {}
    for name, p in _dense(named_params, experts):
        weights[name], states[name] = dense_states.full(p)
    scalars = scalars_of(engine, experts)
    if experts is not None:
        elem = _state_keys(experts.optimizer)[0]
        for i, (name, m) in enumerate(zip(experts.names, experts.masters)):  # each block whole over edp, then ep
            weights[name] = _gather_experts(experts.whole(i, m.detach()), ps).cpu()
            st = experts.optimizer.state.get(m, {})
            states[name] = {k: _gather_experts(experts.whole(i, st[k].detach()), ps).cpu() for k in elem if k in st}
    return weights, states, scalars


def owned_pieces(engine, named_params, ps, experts=None, buffers=None) -> RankPieces:
    """What this rank writes to a sharded checkpoint (shards.RankPieces): views, no copies, of
    - its share of every dense fp32 master weight and per-element optimizer state (`_ZeroPartitions` under
      ZeRO-1/2, `_PlainStates` without);
    - under expert parallelism, its block of whole experts' fp32 masters and states (ExpertOptimizer.blocks);
    - the buffers (router bias), from the rank that is tensor- and data-parallel rank 0 of its stage.
    Every element of every global tensor is written by exactly one rank (shards.merge_index checks it).
    Tensor names: the parameter's, and `name::state key` for its optimizer states."""
    out = RankPieces()
    dense_states = _dense_states(engine, ps)
    for name, p in _dense(named_params, experts):
        dense_states.add_pieces(out, name, p)
    if experts is not None:
        elem = _state_keys(experts.optimizer)[0]
        for i, (name, mst) in enumerate(zip(experts.names, experts.masters)):
            if not mst.numel():  # an edp rank past the last block of experts
                continue
            G, O = experts.placement(i)
            out.add(name, G, O, tuple(mst.shape), mst.detach())
            st = experts.optimizer.state.get(mst, {})
            for k in elem:
                if k in st:
                    out.add(f"{name}::{k}", G, O, tuple(mst.shape), st[k].detach())
    if buffers and ps.rank_in("tp") == 0 and ps.rank_in("dp-cp") == 0:
        for name, b in buffers.items():
            out.add(name, b.shape, (0,) * b.dim(), b.shape, b.detach())
    return out


def scalars_of(engine, experts=None) -> dict:
    """The optimizers' scalar states (step counts) by group: {'dense.<rule>'|'experts.<rule>': {key: value}}."""
    out = _group_scalars(base_optimizer(engine), "dense")
    if experts is not None:
        out.update(_group_scalars(experts.optimizer, "experts"))
    return out


@torch.no_grad()
def load_pieces(engine, named_params, index, scalars: dict, ps, experts=None) -> None:
    """Inverse of `owned_pieces` under any layout: every rank reads from a sharded checkpoint (shards.ShardIndex)
    only the regions it keeps: its tensor-parallel shard of each module parameter (cast to the parameter's
    dtype), its share of each fp32 master and optimizer state, for Muon under ZeRO the whole momentum of the
    matrices its partition touches, and its experts' masters and states. Optimizer states the checkpoint lacks (a
    converted checkpoint: weights only) start at zero."""
    dense_states = _dense_states(engine, ps)
    dense = _dense(named_params, experts)
    states_of = {}
    for n in index.names():
        if "::" in n:
            owner, key = n.rsplit("::", 1)
            states_of.setdefault(owner, []).append(key)
    dense_states.prepare_load(dense, states_of, scalars)
    for name, p in dense:
        dense_states.read(index, name, p, states_of.get(name, []))
    dense_states.finish_load(dense, index, states_of)
    if experts is not None:
        e_keys = {id(m): sorted(states_of.get(n, [])) for n, m in zip(experts.names, experts.masters)}
        _ensure_states(experts.optimizer, e_keys, scalars, "experts")
        for i, (name, p, mst) in enumerate(zip(experts.names, experts.params, experts.masters)):
            whole = index.read(name, shard_offsets(p), torch.empty(p.shape, dtype=torch.float32, device=p.device))
            start, n = experts.blocks[i]
            mst.copy_(whole[start:start + n])
            for k in states_of.get(name, []):
                index.read(f"{name}::{k}", experts.placement(i)[1], experts.optimizer.state[mst][k])
            p.data.copy_(whole.to(p.dtype))


@torch.no_grad()
def masters_from_module(engine, ps, experts=None, exact: dict | None = None) -> None:
    """The fp32 masters set from the module's parameters (after weights were loaded into the module: pretrained
    weights streamed into each rank's shards): ZeRO's partitions from the parameters' values, the experts' masters
    likewise; a dense parameter named in `exact` ({name: its value at this rank's shard, wider than the module's
    dtype: interop.LoadReport.wider}) from that value instead, so a bf16 module weight does not round it.
    Optimizer states are left as they are (none, before the first step)."""
    _dense_states(engine, ps).masters_from_module()
    for name, p in engine.module.named_parameters():
        if name in (exact or {}) and hasattr(p, "set_full_hp_param"):  # a ZeRO partition of a bf16 parameter
            p.set_full_hp_param(exact[name].to(device=p.device, dtype=torch.float32))
    if experts is not None:
        for p, m, (start, n) in zip(experts.params, experts.masters, experts.blocks):
            m.copy_(p.detach()[start:start + n].float())


def dense_masters(engine, ps, names) -> dict:
    """{name: its fp32 master at this rank's tensor-parallel shard} for the dense parameters `names`: ZeRO's
    partitions gathered over data parallel (a collective: every rank of the stage calls it with the same names),
    else the parameter itself in fp32."""
    dense_states = _dense_states(engine, ps)
    wanted = set(names)
    return {n: dense_states.master(p) for n, p in engine.module.named_parameters() if n in wanted}
