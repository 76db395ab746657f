"""Parameters per layer on one tensor- and expert-parallel rank, read off the model's own modules on the meta device.

The rank's model is built on the meta device by the code a run builds it with (megatron_k3.parallel.build_model:
construction, tensor-parallel shards, its block of experts), so the counts are exactly what one TP x EP rank
allocates (a size that does not divide a dimension raises ValueError there, as it would at start-up); a pipeline
stage holds the layers megatron_k3.layout.stage_layers gives it, plus the embedding (first) or the head (last).
Each parameter is classified: routed expert or not, and which optimizer updates it (the optimizer's own rule: Muon
for matrices, AdamW for embeddings, the LM head, norms, vectors and conv filters).

Under peft=lora (`peft`, a `peft_spec`) the rank's model is adapted on the meta device as a run adapts it
(megatron_k3.peft.apply_lora): each group's `total` and `muon` count the adapters (what trains), `frozen` the frozen
base's elements stored in the weights' dtype, `frozen_mx` those stored as MXFP4 codes (the routed experts).

With model.vision.enabled the vision tower (MoonViT-3D) and projector are counted apart (`ModelParams.vision_tower`,
`mm_projector`): they live with the embedding on the first pipeline stage, whole on every tensor-parallel rank
(the model does not shard them), never expert-parallel. `count_parameters` is tools/param_count.py's count: the
text model's (model.params.count_parameters) plus the tower and projector.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from ..annotations import full_shape, meta
from ..config.schema import PeftConfig, token_ids
from ..model.params import count_parameters as _count_text
from ..model.vision import MoonViT3d, PatchMergerV2
from ..optim.grouping import MUON_LAYOUTS, adamw_decays, muon_rule, tp_gathered
from ..parallel.mappings import Group
from ..parallel.plan import ParallelGroups, build_model
from ..parallel.tensor import TensorParallel
from ..peft import FrozenExperts, apply_lora, is_adapter

__all__ = ["ParamGroup", "ParamEntry", "LayerKindParams", "ModelParams", "model_params", "newton_schulz_flops",
           "count_parameters", "peft_spec"]


def peft_spec(peft) -> tuple:
    """A run's PeftConfig as the planner's hashable spec: () without peft, else (rank, alpha, targets, init,
    expert_block, trainable token ids)."""
    if peft is None or not peft.enabled:
        return ()
    return (peft.rank, float(peft.alpha), tuple(peft.targets), peft.init, peft.expert_block,
            tuple(token_ids(peft.trainable_tokens)))


def _peft_config(spec: tuple) -> PeftConfig:
    rank, alpha, targets, init, block, tokens = spec
    return PeftConfig("lora", rank, alpha, list(targets), init, "", block, list(tokens))


@dataclass(frozen=True)
class ParamGroup:
    """Element counts on one TP rank: total, and the part Muon would update (matrices)."""
    total: int = 0
    muon: int = 0
    largest_matrix: int = 0  # elements of the largest Muon update orthogonalised at once (a batch of experts whole)
    ns_flops: float = 0.0  # Newton-Schulz FLOPs of one Muon update of these matrices (per head / per expert)
    frozen: int = 0  # peft=lora: frozen elements in the weights' dtype (not in `total`: no gradient, no state)
    frozen_mx: int = 0  # peft=lora: frozen elements kept as MXFP4 codes (the routed experts)
    tp_gather: int = 0  # of `muon`, the elements whose update Muon all-gathers over TP to orthogonalise it whole
    largest_shard: int = 0  # elements of the largest Muon parameter as this rank holds it (a ZeRO partition cuts it)

    def __add__(self, o: "ParamGroup") -> "ParamGroup":
        return ParamGroup(self.total + o.total, self.muon + o.muon, max(self.largest_matrix, o.largest_matrix),
                          self.ns_flops + o.ns_flops, self.frozen + o.frozen, self.frozen_mx + o.frozen_mx,
                          self.tp_gather + o.tp_gather, max(self.largest_shard, o.largest_shard))

    @property
    def held(self) -> int:
        """Every element this group holds: trained and frozen."""
        return self.total + self.frozen + self.frozen_mx


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> float:
    """FLOPs of `steps` quintic Newton-Schulz iterations on a [rows, cols] matrix: per step X X^T, its
    square, and the product with X, on the short side A: 2 A^2 B + 2 A^3 + 2 A^2 B."""
    a, b = min(rows, cols), max(rows, cols)
    return steps * (4.0 * a * a * b + 2.0 * a ** 3)


@dataclass(frozen=True)
class LayerKindParams:
    dense: ParamGroup  # everything but the routed experts, on one TP rank
    experts: ParamGroup  # the routed experts of the layer on one EP rank
    buffer_bytes: int = 0  # persistent buffers (state-dict entries that are not parameters: the router's bias)
    moe_dense: int = 0  # of `dense`, the MoE block's (router, shared experts, latent projections): tiling runs them
    entries: tuple = ()  # ParamEntry of each trained parameter, dense (TP rank) and routed experts (EP rank)


@dataclass(frozen=True)
class ParamEntry:
    """One trained parameter as an optimizer groups it: its place in the model's parameter order (the same on every
    rank and layout), Muon's rule for it (optim.grouping.muon_rule, per-head blocks), whether optim=adamw decays it,
    its elements on this rank, and whether it is a routed expert's. ZeRO flattens each param group in this order
    (planning.memory.zero2_partition)."""
    index: int
    rule: str
    decay: bool
    numel: int
    expert: bool


@dataclass(frozen=True)
class ModelParams:
    tp: int
    ep: int
    layers: tuple  # LayerKindParams per decoder layer
    embedding: ParamGroup  # on one TP rank (vocab-parallel)
    head: ParamGroup  # LM head + final norm + output depth mix, on one TP rank
    embedding_buffer_bytes: int = 0  # persistent buffers of the embedding (first stage) and of the head (last)
    head_buffer_bytes: int = 0
    # model.vision.enabled: the tower and the projector, on the first stage, whole on every TP rank (else empty)
    vision_tower: ParamGroup = ParamGroup()
    mm_projector: ParamGroup = ParamGroup()
    # ParamEntry tuples of the embedding (first stage), the head (last) and the vision tower with its projector
    embedding_entries: tuple = ()
    head_entries: tuple = ()
    vision_entries: tuple = ()

    @property
    def vision(self) -> ParamGroup:
        """The tower and the projector together (what model.freeze_vision freezes)."""
        return self.vision_tower + self.mm_projector

    def dense_total(self) -> int:
        return (sum(lp.dense.total for lp in self.layers) + self.embedding.total + self.head.total
                + self.vision.total)

    def expert_total(self) -> int:
        return sum(lp.experts.total for lp in self.layers)


def _muon_matrices(p, rule: str, tp: int) -> tuple:
    """(Newton-Schulz FLOPs of one update of parameter p on its TP rank, elements of the largest matrix it
    orthogonalises, whether its update is all-gathered over TP first): per block where the annotation says so
    (attention heads, fused shared experts), per expert for routed experts, and the whole matrix (or all its blocks)
    where the rank holds a TP shard of what must be orthogonalised whole (optim.grouping.tp_gathered)."""
    m = meta(p)
    gather, _ = tp_gathered(m, MUON_LAYOUTS[rule], tp)
    shape = full_shape(p) if gather else tuple(p.shape)
    rows, cols = shape[-2], shape[-1]
    count = p.shape[0] if m.batched else 1  # one matrix per expert
    if rule in ("muon/per_head", "muon/shared_expert"):
        block = full_shape(p)[m.block_axis] // m.blocks
        count = shape[m.block_axis] // block  # the blocks this rank orthogonalises
        rows, cols = (block, cols) if m.block_axis == 0 else (rows, block)
    largest = math.prod(shape)  # what one call orthogonalises at once: every expert of a batch, every block
    return count * newton_schulz_flops(rows, cols), largest, gather


def _routed_expert(name: str) -> bool:
    return ".experts." in name or name.startswith("experts.")


def _group(module, prefix: str = "", frozen_base: bool = False, tp: int = 1, per_head: bool = True) -> tuple:
    """(dense, routed experts) ParamGroups of a module on one of `tp` TP ranks: which parameters Muon updates is the
    optimizer's rule (optim.grouping.muon_rule, with optim.per_head), and how (`_muon_matrices`), as the optimizer
    does. `frozen_base` (peft=lora): only the adapters train; the rest counts as frozen, the MXFP4 experts apart."""
    dense, experts = ParamGroup(), ParamGroup()
    if frozen_base:
        mx = sum(2 * m.w1_packed.numel() + 2 * m.w3_packed.numel() + 2 * m.w2_packed.numel()
                 for m in module.modules() if isinstance(m, FrozenExperts))
        experts = ParamGroup(frozen_mx=mx)
    for name, p in module.named_parameters(prefix=prefix):
        if frozen_base and not is_adapter(name):
            dense = dense + ParamGroup(frozen=p.numel())
            continue
        rule = muon_rule(p, per_head)
        muon = rule.startswith("muon/")
        ns, largest, gather = _muon_matrices(p, rule, tp) if muon else (0.0, 0, False)
        g = ParamGroup(p.numel(), p.numel() if muon else 0, largest, ns, tp_gather=p.numel() if gather else 0,
                       largest_shard=p.numel() if muon else 0)
        if _routed_expert(name):
            experts = experts + g
        else:
            dense = dense + g
    return dense, experts


def _entries(module, prefix: str, frozen_base: bool, order: dict, per_head: bool = True) -> tuple:
    """ParamEntry of each trained parameter of a module (peft=lora, `frozen_base`: the adapters), `order`: the
    model's parameter names by their place in it, `per_head`: optim.per_head (which Muon group a head projection
    joins)."""
    out = []
    for name, p in module.named_parameters(prefix=prefix):
        if (frozen_base and not is_adapter(name)) or name not in order:  # a tied weight's second name
            continue
        out.append(ParamEntry(order[name], muon_rule(p, per_head), adamw_decays(name, p), p.numel(),
                              _routed_expert(name)))
    return tuple(out)


def _buffer_bytes(module) -> int:
    """Bytes of a module's persistent buffers at their dtype: what its state dict holds beside the parameters."""
    n = 0
    for mod in module.modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                n += b.numel() * b.element_size()
    return n


def _moe_dense(layer, frozen_base: bool) -> int:
    """Elements of a decoder layer's MoE block on one TP rank beside its routed experts (0 for a dense MLP)."""
    if getattr(layer, "ffn_type", "") != "moe":
        return 0
    return _group(layer.mlp, f"model.layers.{layer.layer_idx}.mlp", frozen_base)[0].total


def _model_params(cfg, tp: int, ep: int, peft: tuple = (), per_head: bool = True) -> ModelParams:
    """One TP x EP rank's model built on the meta device exactly as a run builds it (parallel.build_model; under
    peft=lora adapted as the run adapts it), then counted per layer, embedding and head, its matrices grouped as
    Muon groups them with optim.per_head = `per_head`."""
    groups = ParallelGroups(tp=TensorParallel(size=tp), ep=Group(size=ep))
    model = build_model(cfg, groups, device="meta")
    if peft:
        apply_lora(model, _peft_config(peft), groups.tp)
    f = bool(peft)
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}

    def group(mod, name):
        return _group(mod, name, f, tp, per_head)

    def entries(mod, name):
        return _entries(mod, name, f, order, per_head)

    layers = tuple(LayerKindParams(*group(layer, f"model.layers.{layer.layer_idx}"), _buffer_bytes(layer),
                                   _moe_dense(layer, f), entries(layer, f"model.layers.{layer.layer_idx}"))
                   for layer in model.model.layers)
    emb, _ = group(model.model.embed_tokens, "model.embed_tokens")
    head, head_buffers, head_entries = ParamGroup(), 0, ()
    for name, mod in (("lm_head", model.lm_head), ("model.norm", model.model.norm),
                      ("model.output_attn_res", getattr(model.model, "output_attn_res", None))):
        if mod is not None:
            head = head + group(mod, name)[0]
            head_buffers += _buffer_bytes(mod)
            head_entries += entries(mod, name)
    if cfg.tie_word_embeddings:
        head = replace(head, total=head.total - emb.total, frozen=head.frozen - emb.frozen, frozen_mx=0)
    tower = getattr(model, "vision_tower", None)
    proj = getattr(model, "mm_projector", None)
    vision = tuple(e for mod, name in ((tower, "vision_tower"), (proj, "mm_projector")) if mod is not None
                   for e in entries(mod, name))
    tower = group(tower, "vision_tower")[0] if tower is not None else ParamGroup()
    proj = group(proj, "mm_projector")[0] if proj is not None else ParamGroup()
    return ModelParams(tp, ep, layers, emb, head, _buffer_bytes(model.model.embed_tokens), head_buffers, tower, proj,
                       entries(model.model.embed_tokens, "model.embed_tokens"), head_entries, vision)


@functools.lru_cache(maxsize=256)
def _built(cfg, tp: int, ep: int, peft: tuple = (), per_head: bool = True) -> ModelParams:
    """_model_params, memoised per (config value, tp, ep, peft spec, per_head): building a rank on the meta device
    takes a while."""
    return _model_params(cfg, tp, ep, peft, per_head)


@functools.lru_cache(maxsize=1024)
def model_params(cfg, tp: int = 1, ep: int = 1, peft: tuple = (), per_head: bool = True) -> ModelParams:
    """Per-layer parameter counts on one rank of tensor-parallel size `tp` and expert-parallel size `ep`
    (ValueError if either does not divide the model). Tensor parallelism does not split the routed experts and
    expert parallelism nothing else, so the dense part comes from a (tp, 1) build and the experts from a (1, ep)
    one (memoised: a planner search builds each size once, not each pair, and combines each pair once);
    tools/build_rank.py checks the sum against ranks built with both. `peft`: a `peft_spec` (() = no peft);
    `per_head`: optim.per_head (Workload.per_head), which decides how Muon groups and orthogonalises the attention
    heads' projections (a whole matrix, TP-gathered, when off)."""
    if tp == 1 or ep == 1:
        return _built(cfg, tp, ep, peft, per_head)
    dense, experts = _built(cfg, tp, 1, peft, per_head), _built(cfg, 1, ep, peft, per_head)
    layers = tuple(LayerKindParams(d.dense, e.experts, d.buffer_bytes, d.moe_dense,
                                   tuple(x for x in d.entries if not x.expert) + tuple(x for x in e.entries
                                                                                     if x.expert))
                   for d, e in zip(dense.layers, experts.layers))
    return replace(dense, ep=ep, layers=layers)


def vision_counts(cfg) -> dict:
    """{"vision_tower": elements, "mm_projector": elements} of model.vision (empty when it is off), read off the
    modules K3ForConditionalGeneration builds, on the meta device."""
    if not cfg.vision.enabled:
        return {}
    with torch.device("meta"):
        tower, proj = MoonViT3d(cfg.vision), PatchMergerV2(cfg.vision, cfg.hidden_size)
    return {"vision_tower": sum(p.numel() for p in tower.parameters()),
            "mm_projector": sum(p.numel() for p in proj.parameters())}


def count_parameters(cfg) -> dict:
    """tools/param_count.py's counts: the text model's (model.params.count_parameters: total, active, breakdown by
    part) with, where model.vision.enabled, the vision tower and projector as their own breakdown entries
    (`vision_tower`, `mm_projector`), in `total` and in `active` (every image token goes through all of the tower;
    the input embedding stays out of `active`). Equal to sum(p.numel()) of a built K3ForConditionalGeneration."""
    out = _count_text(cfg)
    vis = {k: v for k, v in vision_counts(cfg).items() if k not in out["breakdown"]}  # once, if the text count has it
    if vis:
        out["breakdown"] = dict(sorted({**out["breakdown"], **vis}.items()))
        out["total"] += sum(vis.values())
        out["active"] += sum(vis.values())
    return out
