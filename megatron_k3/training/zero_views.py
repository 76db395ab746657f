"""Per-parameter (layout-independent) views of the master weights and optimizer states that DeepSpeed ZeRO-1/2
keeps partitioned over the data-parallel group, and of the routed experts' states spread over expert parallelism:
what our checkpoints store (`full_states`) and restore (`load_full_states`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..optim.zero import ZeroMuon, momentum_offsets
from ..parallel import state


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
    holds states of, which also get their group's scalars (a step count)."""
    for gi, group in enumerate(opt.param_groups):
        sc = scalars.get(_group_key(group, gi, prefix), scalars.get(f"{prefix}.{gi}", {}))
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


def _local_experts(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(state.get_expert_model_parallel_world_size(), 0)[state.get_expert_model_parallel_rank()]


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

    def load_momentum(self, gi: int, states: dict, name_of: dict) -> None:
        """This rank's flat momentum of group gi from the per-parameter ones (absent ones: zeros)."""
        params = self.zero.params_in_partition[gi]
        if not params:
            return
        flat = self.flat[gi]
        parts = []
        for q in params:
            v = states.get(name_of[id(q)], {}).get(MOMENTUM)
            parts.append(torch.zeros(q.numel()) if v is None else v.float().flatten())
        old = self.base.state[flat].get(MOMENTUM)
        dtype = old.dtype if old is not None else torch.float32
        self.base.state[flat][MOMENTUM] = torch.cat(parts).to(device=flat.device, dtype=dtype)


def full_states(engine, named_params, experts=None) -> tuple:
    """({name: fp32 master weight}, {name: {state key: full tensor}}, {'dense.<rule>'|'experts.<rule>': {scalar
    key: value}}), at full size for this tensor-parallel shard: ZeRO's partitions gathered over data parallel
    (Muon's momentum, which DeepSpeed keeps per whole matrix, sent by a rank that holds it), expert-parallel
    weights gathered over the EP group (global expert order).

    Every rank must call this, in the same order everywhere (it is made of collectives)."""
    zero = zero_optimizer(engine)
    base = base_optimizer(engine)
    elem, scalar_keys = _state_keys(base)
    expert_names = set(experts.names) if experts is not None else set()
    weights, states = {}, {}
    if zero is not None:
        _relink(zero)
        layout = _ZeroLayout(zero, base) if hasattr(zero, "params_in_partition") else None
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


@torch.no_grad()
def load_full_states(engine, named_params, weights: dict, states: dict, scalars: dict,
                     experts=None) -> None:
    """Inverse of `full_states`: every rank keeps its own partition of each master weight and optimizer state
    (and its own experts), and the module's (possibly bf16) parameters are refreshed from the fp32 masters."""
    zero = zero_optimizer(engine)
    base = base_optimizer(engine)
    expert_names = set(experts.names) if experts is not None else set()
    named_params = [(n, p) for n, p in named_params if n not in expert_names]
    layout = _ZeroLayout(zero, base) if zero is not None and hasattr(zero, "params_in_partition") else None
    keys_of = {}
    if zero is None:
        for name, p in named_params:
            keys_of[id(p)] = sorted(states.get(name, {}))
    elif layout is None:  # a ZeRO optimizer without per-group bookkeeping (DeepSpeed's bf16 one): one set of keys
        keys = sorted({k for name, _ in named_params for k in states.get(name, {})})
        keys_of = {id(q): keys for g in base.param_groups for q in g["params"]}
    else:
        for name, p in named_params:
            gi = layout.group_of[id(p)]
            keys = [k for k in states.get(name, {}) if not (gi in layout.muon and k == MOMENTUM)]
            flat = id(layout.flat[gi])
            keys_of[flat] = sorted(set(keys_of.get(flat, [])) | set(keys))
    _ensure_states(base, keys_of, scalars, "dense")
    if zero is not None:
        _relink(zero)
    for name, p in named_params:
        w = weights[name].to(p.device)
        if zero is not None:
            p.set_full_hp_param(w)
            gi = layout.group_of[id(p)] if layout is not None else None
            for k, v in states.get(name, {}).items():
                if not (layout is not None and gi in layout.muon and k == MOMENTUM):
                    p.set_full_hp_param(v.to(p.device), k)
        else:
            for k, v in states.get(name, {}).items():
                base.state[p][k].copy_(v.to(p.device))
        p.data.copy_(w.to(p.dtype))
    if layout is not None:
        name_of = {id(p): n for n, p in named_params}
        for gi in sorted(layout.muon):
            layout.load_momentum(gi, states, name_of)
    if experts is not None:
        e_keys = {id(m): sorted(states.get(n, {})) for n, m in zip(experts.names, experts.masters)}
        _ensure_states(experts.optimizer, e_keys, scalars, "experts")
        for name, p, m in zip(experts.names, experts.params, experts.masters):
            m.copy_(_local_experts(weights[name]).to(m.device))
            for k, v in states.get(name, {}).items():
                experts.optimizer.state[m][k].copy_(_local_experts(v).to(m.device))
            p.data.copy_(m.to(p.dtype))
