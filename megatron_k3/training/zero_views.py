"""The master weights and optimizer states that DeepSpeed ZeRO-1/2 keeps partitioned over the data-parallel group,
and the routed experts' spread over expert parallelism, seen per parameter: what each rank writes to a sharded
checkpoint (`owned_pieces`: views of its own fragments) and reads back under any layout (`load_pieces`), and the
gathered full-size view (`full_states`, a collective: tests compare layouts with it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..annotations import full_shape, meta, shard_offsets
from ..optim.zero import ZeroMuon, momentum_offsets
from ..parallel import state
from .shards import RankPieces, share


def zero_optimizer(engine):
    opt = engine.optimizer
    return opt if hasattr(opt, "_lazy_init_hp_params_optimizer_state") or hasattr(opt, "fp32_groups_flat_partition") \
        else None


def base_optimizer(engine):
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt) if zero_optimizer(engine) is not None else opt


def _relink(zero) -> None:
    """Point every parameter's fragment mapping at the optimizer's current state tensors (DeepSpeed links them
    once, possibly before the first step has created them)."""
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()


def _state_keys(base_opt) -> tuple:
    """(per-element state keys, scalar state keys) of the wrapped torch optimizer, from the states it holds."""
    elem, scalar = set(), set()
    for st in base_opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                elem.add(k)
            else:
                scalar.add(k)
    return tuple(sorted(elem)), tuple(sorted(scalar))


def _scalar(v):
    return float(v.item()) if torch.is_tensor(v) else v


def _group_key(group: dict, gi: int, prefix: str) -> str:
    """A group's name in the checkpoint: its rule where it has one (the same under every layout, also when the
    experts leave the dense optimizer under ep > 1), else its index."""
    return f"{prefix}.{group['rule']}" if "rule" in group else f"{prefix}.{gi}"


def _group_scalars(opt, scalar_keys, prefix) -> dict:
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for q in group["params"]:
            st = opt.state.get(q)
            if st:
                out[_group_key(group, gi, prefix)] = {k: _scalar(st[k]) for k in scalar_keys if k in st}
                break
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


def _gather_experts(t: torch.Tensor) -> torch.Tensor:
    group = state.get_expert_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, 0)


MOMENTUM = "momentum_buffer"  # Muon's state key, per matrix in one process, per partition in DeepSpeed's ZeRO


class _ZeroLayout:
    """Where ZeRO-1/2 keeps each parameter: its group, the group's flat fp32 partition (the key of the torch
    optimizer's state), and for Muon groups DeepSpeed's flat momentum of whole matrices (optim/zero.py)."""

    def __init__(self, zero, base):
        self.zero, self.base = zero, base
        self.group_of = {id(q): gi for gi, g in enumerate(zero.bit16_groups) for q in g}
        self.flat = [g["params"][0] for g in base.param_groups]
        self.muon = {gi for gi, g in enumerate(base.param_groups)
                     if isinstance(base, ZeroMuon) and g.get("use_muon")}
        self._offsets = {}

    def elem_keys(self, gi: int) -> list:
        """The per-element states of group gi that DeepSpeed's fragments map (Muon's momentum is not one)."""
        st = self.base.state.get(self.flat[gi], {})
        return sorted(k for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0
                      and not (gi in self.muon and k == MOMENTUM))

    def offsets(self, gi: int) -> dict:
        if gi not in self._offsets:
            self._offsets[gi] = momentum_offsets(self.zero, gi)
        return self._offsets[gi]

    def full_momentum(self, gi: int, p) -> torch.Tensor:
        """p's whole Muon momentum, on every rank: the lowest DP rank whose partition touches p sends it
        (every such rank holds the same one); zeros before the first step."""
        group = self.zero.real_dp_process_group[gi]
        src = min(self.zero.param_to_partition_ids[gi][self.zero.get_param_id(p)])
        t = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if dist.get_rank(group) == src:
            buf = self.base.state.get(self.flat[gi], {}).get(MOMENTUM)
            if buf is not None:
                t.copy_(buf.narrow(0, self.offsets(gi)[id(p)], p.numel()).view(p.shape))
        if dist.get_world_size(group) > 1:
            dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
        return t

    def load_momentum(self, gi: int, momentum_of) -> None:
        """This rank's flat momentum of group gi from each matrix's whole one, `momentum_of(q)` (None: zeros)."""
        params = self.zero.params_in_partition[gi]
        if not params:
            return
        flat = self.flat[gi]
        parts = []
        for q in params:
            v = momentum_of(q)
            parts.append(torch.zeros(q.numel()) if v is None else v.float().flatten())
        old = self.base.state[flat].get(MOMENTUM)
        dtype = old.dtype if old is not None else torch.float32
        self.base.state[flat][MOMENTUM] = torch.cat(parts).to(device=flat.device, dtype=dtype)


def _views(engine, experts) -> tuple:
    """(ZeRO optimizer or None, the torch optimizer, its per-element state keys, the expert-parallel parameters'
    names, the _ZeroLayout or None), with DeepSpeed's fragments pointed at the current states."""
    zero, base = zero_optimizer(engine), base_optimizer(engine)
    layout = None
    if zero is not None:
        _relink(zero)
        layout = _ZeroLayout(zero, base) if hasattr(zero, "params_in_partition") else None
    return zero, base, _state_keys(base)[0], set(experts.names) if experts is not None else set(), layout


def full_states(engine, named_params, experts=None) -> tuple:
    """({name: fp32 master weight}, {name: {state key: full tensor}}, {'dense.<rule>'|'experts.<rule>': {scalar
    key: value}}), at full size for this tensor-parallel shard: ZeRO's partitions gathered over data parallel
    (Muon's momentum, which DeepSpeed keeps per whole matrix, sent by a rank that holds it), expert-parallel
    weights gathered over the EP group (global expert order).

    Every rank must call this, in the same order everywhere (it is made of collectives)."""
    zero, base, elem, expert_names, layout = _views(engine, experts)
    scalar_keys = _state_keys(base)[1]
    weights, states = {}, {}
    for name, p in named_params:
        if name in expert_names:
            continue
        if zero is not None:
            weights[name] = p.get_full_hp_param().detach().cpu()
            if layout is None:
                states[name] = {k: p.get_full_hp_param(k).detach().cpu() for k in elem}
                continue
            gi = layout.group_of[id(p)]
            states[name] = {k: p.get_full_hp_param(k).detach().cpu() for k in layout.elem_keys(gi)}
            if gi in layout.muon:
                states[name][MOMENTUM] = layout.full_momentum(gi, p).cpu()
        else:
            weights[name] = p.detach().float().cpu()
            st = base.state.get(p, {})
            states[name] = {k: st[k].detach().cpu() for k in elem if k in st}
    scalars = _group_scalars(base, scalar_keys, "dense")
    if experts is not None:
        e_elem, e_scalar = _state_keys(experts.optimizer)
        for name, m in zip(experts.names, experts.masters):
            weights[name] = _gather_experts(m.detach()).cpu()
            st = experts.optimizer.state.get(m, {})
            states[name] = {k: _gather_experts(st[k].detach()).cpu() for k in e_elem if k in st}
        scalars.update(_group_scalars(experts.optimizer, e_scalar, "experts"))
    return weights, states, scalars


# ------------------------------------------------------------------------------------------------ sharded format
def _replicas(tp_replicated: bool) -> tuple:
    """(count, index) of this rank among the ranks holding the same copy of a dense tensor outside ZeRO: the dp x cp
    group, times the tensor-parallel group for a tensor every TP rank holds whole."""
    dpcp, dpcp_rank = state.get_data_parallel_world_size(True), state.get_data_parallel_rank(True)
    if not tp_replicated:
        return dpcp, dpcp_rank
    return dpcp * state.get_tensor_model_parallel_world_size(), \
        state.get_tensor_model_parallel_rank() * dpcp + dpcp_rank


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("a checkpointed tensor must be contiguous")
    return t.detach().reshape(-1)


def owned_pieces(engine, named_params, experts=None, buffers=None):
    """What this rank writes to a sharded checkpoint (shards.RankPieces): views, no copies, of
    - its ZeRO-1/2 fragment of every dense fp32 master weight and per-element optimizer state (a TP-replicated
      tensor's fragments from tensor-parallel rank 0 only), and for Muon the whole-matrix momentum of each matrix
      whose lowest partition is this rank's;
    - without ZeRO, its 1/replicas share of every dense weight and state (replicas: dp x cp, times tp for a
      TP-replicated one);
    - under expert parallelism, its 1/edp share of its experts' fp32 masters and states;
    - the buffers (router bias), from the rank that is tensor- and data-parallel rank 0 of its stage.
    Every element of every global tensor is written by exactly one rank (shards.merge_index checks it).
    Tensor names: the parameter's, and `name::state key` for its optimizer states."""
    out = RankPieces()
    zero, base, elem, expert_names, layout = _views(engine, experts)
    tp, tp_rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    for name, p in named_params:
        if name in expert_names:
            continue
        m, G, O = meta(p), full_shape(p), shard_offsets(p)
        tp_replicated = m.tp_dim is None and tp > 1
        if zero is None:
            count, idx = _replicas(tp_replicated)
            start, n = share(p.numel(), count, idx)
            out.add_range(name, p.shape, G, O, start, _flat(p).narrow(0, start, n))
            st = base.state.get(p, {})
            for k in elem:
                if k in st:
                    out.add_range(f"{name}::{k}", p.shape, G, O, start, _flat(st[k]).narrow(0, start, n))
            continue
        if tp_replicated and tp_rank != 0:
            continue
        gi = layout.group_of[id(p)] if layout is not None else None
        hpm = getattr(p, "_hp_mapping", None)
        if hpm is not None:
            start = hpm.lp_fragment_address.start
            out.add_range(name, p.shape, G, O, start, hpm.hp_fragment)
            for k in (layout.elem_keys(gi) if layout is not None else elem):
                out.add_range(f"{name}::{k}", p.shape, G, O, start, hpm.get_optim_state_fragment(k))
        if layout is not None and gi in layout.muon:
            group = zero.real_dp_process_group[gi]
            src = min(zero.param_to_partition_ids[gi][zero.get_param_id(p)])
            buf = base.state.get(layout.flat[gi], {}).get(MOMENTUM)
            if dist.get_rank(group) == src and buf is not None:
                out.add_range(f"{name}::{MOMENTUM}", p.shape, G, O, 0,
                              buf.narrow(0, layout.offsets(gi)[id(p)], p.numel()))
    if experts is not None:
        count, idx = state.get_expert_data_parallel_world_size(), state.get_expert_data_parallel_rank()
        e_elem, _ = _state_keys(experts.optimizer)
        for name, mst in zip(experts.names, experts.masters):
            G, O = full_shape(mst), shard_offsets(mst)
            start, n = share(mst.numel(), count, idx)
            out.add_range(name, mst.shape, G, O, start, _flat(mst).narrow(0, start, n))
            st = experts.optimizer.state.get(mst, {})
            for k in e_elem:
                if k in st:
                    out.add_range(f"{name}::{k}", mst.shape, G, O, start, _flat(st[k]).narrow(0, start, n))
    if buffers and tp_rank == 0 and state.get_data_parallel_rank(True) == 0:
        for name, b in buffers.items():
            out.add(name, b.shape, (0,) * b.dim(), b.shape, b.detach())
    return out


def scalars_of(engine, experts=None) -> dict:
    """The optimizers' scalar states (step counts) by group: {'dense.<rule>'|'experts.<rule>': {key: value}}."""
    base = base_optimizer(engine)
    out = _group_scalars(base, _state_keys(base)[1], "dense")
    if experts is not None:
        out.update(_group_scalars(experts.optimizer, _state_keys(experts.optimizer)[1], "experts"))
    return out


@torch.no_grad()
def load_pieces(engine, named_params, index, scalars: dict, experts=None) -> None:
    """Inverse of `owned_pieces` under any layout: every rank reads from a sharded checkpoint (shards.ShardIndex)
    only the regions it keeps: its tensor-parallel shard of each module parameter (cast to the parameter's
    dtype), its ZeRO fragment of each fp32 master and optimizer state (or, without ZeRO, the whole shard's),
    for Muon under ZeRO the whole momentum of the matrices its partition touches, and its experts' masters and
    states. Optimizer states the checkpoint lacks (a converted checkpoint: weights only) start at zero."""
    zero, base = zero_optimizer(engine), base_optimizer(engine)
    expert_names = set(experts.names) if experts is not None else set()
    dense = [(n, p) for n, p in named_params if n not in expert_names]
    states_of = {}
    for n in index.names():
        if "::" in n:
            owner, key = n.rsplit("::", 1)
            states_of.setdefault(owner, []).append(key)
    layout = _ZeroLayout(zero, base) if zero is not None and hasattr(zero, "params_in_partition") else None
    keys_of = {}
    if zero is None:
        for name, p in dense:
            keys_of[id(p)] = sorted(states_of.get(name, []))
    elif layout is None:
        keys = sorted({k for name, _ in dense for k in states_of.get(name, [])})
        keys_of = {id(q): keys for g in base.param_groups for q in g["params"]}
    else:
        for name, p in dense:
            gi = layout.group_of[id(p)]
            keys = [k for k in states_of.get(name, []) if not (gi in layout.muon and k == MOMENTUM)]
            flat = id(layout.flat[gi])
            keys_of[flat] = sorted(set(keys_of.get(flat, [])) | set(keys))
    _ensure_states(base, keys_of, scalars, "dense")
    if zero is not None:
        _relink(zero)
    for name, p in dense:
        O = shard_offsets(p)
        index.read(name, O, p.data)
        if zero is None:
            for k in states_of.get(name, []):
                index.read(f"{name}::{k}", O, base.state[p][k])
            continue
        gi = layout.group_of[id(p)] if layout is not None else None
        hpm = getattr(p, "_hp_mapping", None)
        if hpm is None:
            continue
        start = hpm.lp_fragment_address.start
        index.read_range(name, p.shape, O, start, hpm.hp_fragment)
        for k in states_of.get(name, []):
            if not (layout is not None and gi in layout.muon and k == MOMENTUM):
                index.read_range(f"{name}::{k}", p.shape, O, start, hpm.get_optim_state_fragment(k))
    if layout is not None:
        name_of = {id(p): n for n, p in dense}

        def momentum_of(q):
            name = name_of[id(q)]
            if MOMENTUM not in states_of.get(name, []):
                return None
            return index.read(f"{name}::{MOMENTUM}", shard_offsets(q), torch.empty(q.shape, dtype=torch.float32))

        for gi in sorted(layout.muon):
            layout.load_momentum(gi, momentum_of)
    if experts is not None:
        e_keys = {id(m): sorted(states_of.get(n, [])) for n, m in zip(experts.names, experts.masters)}
        _ensure_states(experts.optimizer, e_keys, scalars, "experts")
        for name, p, mst in zip(experts.names, experts.params, experts.masters):
            O = shard_offsets(mst)
            index.read(name, O, mst)
            for k in states_of.get(name, []):
                index.read(f"{name}::{k}", O, experts.optimizer.state[mst][k])
            p.data.copy_(mst.to(p.dtype))


@torch.no_grad()
def masters_from_module(engine, experts=None) -> None:
    """The fp32 masters set from the module's parameters (after weights were loaded into the module: pretrained
    weights streamed into each rank's shards): ZeRO's partitions from the parameters' values, the experts' masters
    likewise. Optimizer states are left as they are (none, before the first step)."""
    zero = zero_optimizer(engine)
    if zero is not None:
        zero.refresh_fp32_params()
    if experts is not None:
        for p, m in zip(experts.params, experts.masters):
            m.copy_(p.detach().float())
