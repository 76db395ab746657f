"""LoRA (`peft=lora`), applied to a built and parallelised K3 model from outside, as parallelism is:
`apply_lora(model, peft, tp, seed)` freezes every parameter, puts the routed experts in their frozen MXFP4 form
(peft.experts.FrozenExperts, adapted or not) and gives each targeted linear a low-rank term y += s * B (A x),
s = alpha / rank, A random (PEFT's kaiming-uniform or gaussian), B zero: the adapted model starts equal to the base.

Targets (`peft.targets`, module kinds; `kind.child` picks one projection of a kind):
  kda             KDA's q/k/v projections, its output gate (g_proj, or g_a_proj/g_b_proj) and o_proj;
                  kda.f_a_proj, kda.f_b_proj (decay bottleneck) and kda.b_proj (beta) only by name
  mla             every projection of gated MLA (q or q_a/q_b, kv_a_proj_with_mqa, kv_b_proj, g_proj, o_proj)
  mlp             the dense layers' gate/up/down projections
  shared_experts  the MoE layers' shared experts' gate/up/down projections
  latent          the MoE latent down/up projections
  experts         the routed experts: per-expert adapters of w1, w3 and w2, run as batched/grouped GEMMs
  lm_head         the output projection (vocabulary-parallel under TP)
The router is never a target; the vision tower stays frozen.

Under tensor parallelism the adapter follows its layer (Megatron's convention): a column-parallel layer's A is
replicated (its gradient is a partial sum per rank, summed by a hook) and B split by output rows; a row-parallel
layer's A is split by input columns and B replicated, and the adapter's term is added before the layer's reduction
(one collective for both). Every layout initialises the same A: full-size values from a generator seeded by
train.seed and the module's global name (and, for experts, the global expert id), sliced to the rank's part.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from ..annotations import annotate, meta, shard_offsets
from ..errors import ConfigError
from ..model.experts import GroupedExperts
from ..model.kda import KimiDeltaAttention
from ..model.layers import Linear
from ..model.mla import GatedMLA
from ..model.mlp import GatedMLP
from ..model.moe import StableLatentMoE
from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear, TensorParallel, mark_partial_grad
from .experts import MATRICES, FrozenExperts, adapter_names
from .tokens import DELTA, apply_tokens, check_tokens

__all__ = ["KINDS", "apply_lora", "resolve_targets", "check_targets", "adapted_parameters", "is_adapter",
           "LoRALinear", "LoRAColumn", "LoRARow"]

# kind -> (projections a plain `kind` target adapts, projections adapted only when named as kind.child)
KINDS = {
    "kda": (("q_proj", "k_proj", "v_proj", "g_proj", "g_a_proj", "g_b_proj", "o_proj"),
            ("f_a_proj", "f_b_proj", "b_proj")),
    "mla": (("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj"), ()),
    "mlp": (("gate_proj", "up_proj", "down_proj"), ()),
    "shared_experts": (("gate_proj", "up_proj", "down_proj"), ()),
    "latent": (("latent_down_proj", "latent_up_proj"), ()),
    "experts": ((), ()),
    "lm_head": ((), ()),
}


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (lora_A / lora_B of a linear, w*_lora_A / w*_lora_B of experts, the
    trainable token rows' token_delta)."""
    leaf = name.rsplit(".", 1)[-1]
    return "lora_A" in leaf or "lora_B" in leaf or leaf == DELTA


def adapted_parameters(model: nn.Module) -> list:
    """(name, parameter) of every adapter of the model."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter(n)]


# ------------------------------------------------------------------------------------------------ adapted linears
def _term(module, x: torch.Tensor) -> torch.Tensor:
    """s * B (A x), in the input's dtype."""
    t = F.linear(x, module.lora_A.to(x.dtype)) * module.lora_scale
    return F.linear(t, module.lora_B.to(x.dtype))


class LoRALinear(Linear):
    """A single-device linear with its adapter (the class a targeted Linear takes: parameter names unchanged)."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + _term(self, x)

    def local_logits(self, x):  # the tiled LM head's per-tile projection (parallel.tiling)
        return self.forward(x)


class LoRAColumn(ColumnParallelLinear):
    """A column-parallel linear with its adapter: the term joins this rank's output columns before any gather
    (ColumnParallelLinear.forward computes them with local_logits)."""

    def local_logits(self, x):
        return F.linear(x, self.weight, self.bias) + _term(self, x)


class LoRARow(RowParallelLinear):
    """A row-parallel linear with its adapter: A x_local is a partial sum of the rank-r intermediate, and the term
    joins the partial output before the one reduction."""

    def forward(self, x_local):
        y = self.tp.exit(F.linear(x_local, self.weight) + _term(self, x_local))
        return y + self.bias if self.bias is not None else y


_ADAPTED = {Linear: LoRALinear, nn.Linear: LoRALinear, ColumnParallelLinear: LoRAColumn, RowParallelLinear: LoRARow}


# ------------------------------------------------------------------------------------------------ targets
def _owners(model: nn.Module) -> list:
    """(kind, owner name, owner module) of every module that holds targets of a kind."""
    shared = {id(m.shared_experts) for m in model.modules() if isinstance(m, StableLatentMoE)}
    out = []
    for name, m in model.named_modules():
        if isinstance(m, KimiDeltaAttention):
            out.append(("kda", name, m))
        elif isinstance(m, GatedMLA):
            out.append(("mla", name, m))
        elif isinstance(m, GatedMLP) and not name.startswith(("vision_tower", "mm_projector")):
            out.append(("shared_experts" if id(m) in shared else "mlp", name, m))
        elif isinstance(m, StableLatentMoE):
            out.append(("latent", name, m))
            if isinstance(m.experts, (GroupedExperts, FrozenExperts)):
                out.append(("experts", f"{name}.experts", m.experts))
    if getattr(model, "lm_head", None) is not None:
        out.append(("lm_head", "lm_head", model.lm_head))
    return out


def _parse(target: str) -> tuple:
    kind, _, child = target.partition(".")
    if kind not in KINDS:
        raise ConfigError("peft.targets", target, f"no such module kind; valid: {', '.join(KINDS)} (kind.child "
                          "names one projection, e.g. kda.q_proj)")
    plain, named = KINDS[kind]
    if child and child not in plain + named:
        raise ConfigError("peft.targets", target, f"{kind} has no projection {child!r}; valid: "
                          f"{', '.join(plain + named) or '(none: name the kind alone)'}")
    return kind, child


def _members(owners: list, kind: str, child: str) -> dict:
    """{name: module} of the modules `kind` (or `kind.child`) names among the owners."""
    out = {}
    for k, name, owner in owners:
        if k != kind:
            continue
        if kind in ("experts", "lm_head"):
            out[name] = owner
            continue
        for c in (child,) if child else KINDS[kind][0]:
            mod = getattr(owner, c, None)
            if isinstance(mod, tuple(_ADAPTED)):
                out[f"{name}.{c}"] = mod
    return out


def resolve_targets(model: nn.Module, targets, strict: bool = True) -> list:
    """[(name, module)] the targets name in `model` (linears, and experts modules), in module order. A target that
    names no module of the model raises ConfigError naming it (unless not `strict`: a pipeline stage's part may
    hold none of a kind)."""
    owners = _owners(model)
    picked = {}
    for target in targets:
        found = _members(owners, *_parse(target))
        if not found and strict:
            has = sorted(k for k in KINDS if _members(owners, k, ""))
            raise ConfigError("peft.targets", target, f"names no module of this model ({model.cfg.name}); kinds it "
                              f"has: {', '.join(has)}")
        picked.update(found)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(picked.items(), key=lambda kv: order[kv[0]])


def _dims(module) -> tuple:
    """(input width, output width) of a target, unsharded (experts: the smaller matrix dims)."""
    if isinstance(module, (GroupedExperts, FrozenExperts)):
        return module.width, module.inter
    return module.in_features, module.out_features


def check_targets(model: nn.Module, targets, rank: int, strict: bool = True) -> list:
    """`resolve_targets`, and each target's dimensions against the rank: ConfigError on the first target whose
    input or output width is below `rank`. For a model built on the meta device: nothing allocated."""
    picked = resolve_targets(model, targets, strict)
    for name, mod in picked:
        d_in, d_out = _dims(mod)
        if rank > min(d_in, d_out):
            raise ConfigError("peft.rank", rank, f"larger than {name} ({d_in} -> {d_out}), a module of "
                              f"peft.targets={list(targets)}: use a rank <= {min(d_in, d_out)} or drop it from "
                              "the targets")
    return picked


# ------------------------------------------------------------------------------------------------ initialisation
def _generator(seed: int, name: str, extra: int = 0) -> torch.Generator:
    """The generator of one adapter's A: the same for every layout (the module's global name, the expert id)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) * 4099 + extra) % (1 << 62))


def _init_a(shape: tuple, init: str, rank: int, gen: torch.Generator) -> torch.Tensor:
    """PEFT's A: kaiming-uniform (a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))) or gaussian (std 1/rank)."""
    if init == "gaussian":
        return torch.randn(shape, generator=gen) / rank
    bound = 1.0 / math.sqrt(shape[-1])
    return torch.rand(shape, generator=gen).mul_(2 * bound).sub_(bound)


def _param(t: torch.Tensor, like: torch.Tensor, **note) -> nn.Parameter:
    p = nn.Parameter(t.to(device=like.device, dtype=like.dtype))
    return annotate(p, **note) if note else p


def _adapt_linear(name: str, mod, peft, seed: int, tp: TensorParallel) -> None:
    """Give a targeted linear its adapter (class swapped in place, so its weight keeps its name)."""
    cls = _ADAPTED.get(type(mod))
    if cls is None:
        raise TypeError(f"{name}: a {type(mod).__name__} cannot take a LoRA adapter (applied twice?)")
    w, r = mod.weight, peft.rank
    row, col = isinstance(mod, RowParallelLinear), isinstance(mod, ColumnParallelLinear)
    a = (torch.empty(r, mod.in_features, device="meta") if w.is_meta else
         _init_a((r, mod.in_features), peft.init, r, _generator(seed, name)))
    if row and tp.size > 1:
        a = a.chunk(tp.size, 1)[tp.rank]
    mod.lora_A = _param(a, w, **({"tp_dim": 1, "tp_size": tp.size, "tp_rank": tp.rank} if row and tp.size > 1 else {}))
    b = torch.zeros(w.shape[0], r, device="meta" if w.is_meta else "cpu")
    mod.lora_B = _param(b, w, **({"tp_dim": 0, "tp_size": tp.size, "tp_rank": tp.rank} if col and tp.size > 1 else {}))
    mod.lora_scale = peft.alpha / r
    mod.__class__ = cls
    if tp.size > 1:  # a replicated factor whose gradient is a per-rank partial sum is summed over TP, as its weight
        partial = meta(w).partial_grad
        for p, replicated in ((mod.lora_A, col or partial), (mod.lora_B, row or partial)):
            if replicated:
                mark_partial_grad(p, tp)


def _freeze_experts(moe: StableLatentMoE, name: str, rank: int, peft, seed: int, tp: TensorParallel) -> int:
    """The layer's routed experts as FrozenExperts (adapted when rank > 0); returns the experts' adapter count."""
    old = moe.experts
    moe.experts = fe = FrozenExperts(old, rank, peft.alpha / peft.rank, peft.expert_block)
    if not rank:
        return 0
    start = shard_offsets(old.w1)[0]
    for n in MATRICES:
        a = getattr(fe, adapter_names(n)[0])
        if not a.is_meta:
            with torch.no_grad():
                for el in range(a.shape[0]):
                    gen = _generator(seed, f"{name}.{n}", start + el + 1)
                    a[el].copy_(_init_a(tuple(a.shape[1:]), peft.init, rank, gen))
        if tp.size > 1 and meta(getattr(old, n)).partial_grad:  # experts replicated over TP: rows split
            for p in (a, getattr(fe, adapter_names(n)[1])):
                mark_partial_grad(p, tp)
    return 1


def apply_lora(model: nn.Module, peft, tp: TensorParallel | None = None, seed: int = 0, whole: bool = True) -> dict:
    """`peft=lora` on `model` (built, parallelised over `tp`; on a device or on meta), in place: every parameter
    frozen, every MoE layer's routed experts frozen as MXFP4 (peft.experts.FrozenExperts), adapters on the targets
    (`check_targets` first), the rows of peft.trainable_tokens trainable in the embedding and LM head (peft.tokens).
    Returns {"targets": adapted modules, "trainable": adapter parameters on this rank, "frozen": frozen parameters
    on this rank, "frozen_bytes": the frozen base's bytes here}. `whole`: `model` is a
    whole model, which each target must name a module of (a pipeline stage's part need not; check the whole model
    with `check_targets`)."""
    tp = tp or TensorParallel()
    picked = check_targets(model, peft.targets, peft.rank, strict=whole)
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = {id(m) for _, m in picked}
    for name, moe in [(n, m) for n, m in model.named_modules() if isinstance(m, StableLatentMoE)]:
        if isinstance(moe.experts, GroupedExperts):
            _freeze_experts(moe, f"{name}.experts", peft.rank if id(moe.experts) in adapted else 0, peft, seed, tp)
    for name, mod in picked:
        if not isinstance(mod, (GroupedExperts, FrozenExperts)):
            _adapt_linear(name, mod, peft, seed, tp)
    apply_tokens(model, check_tokens(getattr(peft, "trainable_tokens", ()), model.cfg.vocab_size), tp)
    trainable = adapted_parameters(model)
    frozen = [p for n, p in model.named_parameters() if not is_adapter(n)]
    packed = [b for n, b in model.named_buffers() if n.endswith(("_packed", "_scale"))]
    return {"targets": len(picked), "trainable": sum(p.numel() for _, p in trainable),
            "frozen": sum(p.numel() for p in frozen) + sum(2 * b.numel() for n, b in model.named_buffers()
                                                           if n.endswith("_packed")),
            "frozen_bytes": sum(p.numel() * p.element_size() for p in frozen) + sum(b.numel() for b in packed)}
