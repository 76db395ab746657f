"""Parameters per layer and per tensor-parallel rank, read off the model's own modules on the meta device.

One decoder layer of each (mixer, FFN) kind is built under `use_tp(TPContext(size=tp))`, so the sharding is
exactly what the model would allocate on one TP rank (a TP size that does not divide a dimension raises
ValueError there, as it would at start-up). Each parameter is classified: routed expert or not, and which
optimizer updates it (Muon for matrices, AdamW for embeddings, the LM head, norms, vectors and conv filters).
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

__all__ = ["ParamGroup", "LayerKindParams", "ModelParams", "model_params", "newton_schulz_flops"]


@dataclass(frozen=True)
class ParamGroup:
    """Element counts on one TP rank: total, and the part Muon would update (matrices)."""
    total: int = 0
    muon: int = 0
    largest_matrix: int = 0  # elements of the largest Muon matrix (per expert for routed experts)
    ns_flops: float = 0.0  # Newton-Schulz FLOPs of one Muon update of these matrices (per head / per expert)

    def __add__(self, o: "ParamGroup") -> "ParamGroup":
        return ParamGroup(self.total + o.total, self.muon + o.muon, max(self.largest_matrix, o.largest_matrix),
                          self.ns_flops + o.ns_flops)


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> float:
    """FLOPs of `steps` quintic Newton-Schulz iterations on a [rows, cols] matrix: per step X X^T, its
    square, and the product with X, on the short side A: 2 A^2 B + 2 A^3 + 2 A^2 B."""
    a, b = min(rows, cols), max(rows, cols)
    return steps * (4.0 * a * a * b + 2.0 * a ** 3)


def _head_blocks(cfg, mixer: str) -> dict:
    """Per-Head Muon (MODEL.md 6.3): projections whose rows (dim 0) or columns (dim 1) are head-partitioned are
    orthogonalised per head block. Parameter name suffix -> (dim, block size)."""
    if mixer == "kda":
        K = cfg.kda_head_dim
        out = {f"self_attn.{n}.weight": (0, K) for n in ("q_proj", "k_proj", "v_proj", "g_proj", "g_b_proj")}
        out["self_attn.o_proj.weight"] = (1, K)
        return out
    qk, V = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return {"self_attn.q_b_proj.weight": (0, qk), "self_attn.q_proj.weight": (0, qk),
            "self_attn.kv_b_proj.weight": (0, cfg.qk_nope_head_dim + V), "self_attn.g_proj.weight": (0, V),
            "self_attn.o_proj.weight": (1, V)}


@dataclass(frozen=True)
class LayerKindParams:
    dense: ParamGroup  # everything but the routed experts, on one TP rank
    experts: ParamGroup  # routed experts of the layer, all of them (EP divides them later)


@dataclass(frozen=True)
class ModelParams:
    tp: int
    layers: tuple  # LayerKindParams per decoder layer
    embedding: ParamGroup  # on one TP rank (vocab-parallel)
    head: ParamGroup  # LM head + final norm + output depth mix, on one TP rank

    def dense_total(self) -> int:
        return sum(lp.dense.total for lp in self.layers) + self.embedding.total + self.head.total

    def expert_total(self) -> int:
        return sum(lp.experts.total for lp in self.layers)


def _muon_eligible(name: str, p: torch.Tensor) -> bool:
    """Per-Head Muon updates matrices; embeddings, the LM head, norms, vectors, conv filters and the AttnRes
    pseudo-queries ([1, D] weights, vectors in effect) use AdamW."""
    if p.ndim < 2 or "embed_tokens" in name or name.startswith("lm_head") or name.endswith("conv1d"):
        return False
    return not ("_res.proj" in name or "output_attn_res" in name)


def _group(module, prefix: str = "", head_blocks: dict | None = None) -> tuple:
    dense, experts = ParamGroup(), ParamGroup()
    for name, p in module.named_parameters(prefix=prefix):
        muon = _muon_eligible(name, p)
        per_matrix = p[0].numel() if (".experts." in name and p.ndim == 3) else p.numel()
        ns = 0.0
        if muon:
            rows, cols = p.shape[-2], p.shape[-1]
            count = p.shape[0] if p.ndim == 3 else 1  # one matrix per expert
            block = next((v for k, v in (head_blocks or {}).items() if name.endswith(k)), None)
            if block is not None and p.shape[block[0]] % block[1] == 0:
                count = p.shape[block[0]] // block[1]
                rows, cols = (block[1], cols) if block[0] == 0 else (rows, block[1])
            ns = count * newton_schulz_flops(rows, cols)
        g = ParamGroup(p.numel(), p.numel() if muon else 0, per_matrix if muon else 0, ns)
        if ".experts." in name or name.startswith("experts."):
            experts = experts + g
        else:
            dense = dense + g
    return dense, experts


def _kind_params(cfg, mixer: str, ffn: str, tp: int) -> LayerKindParams:
    from ..model.decoder import DecoderLayer
    from ..parallel.layers import TPContext, use_tp

    idx = next(i for i, (m, f) in enumerate(zip(cfg.layer_types(), cfg.ffn_types())) if m == mixer and f == ffn)
    with torch.device("meta"), use_tp(TPContext(size=tp)):
        layer = DecoderLayer(cfg, idx)
    dense, experts = _group(layer, f"model.layers.{idx}", _head_blocks(cfg, mixer))
    return LayerKindParams(dense, experts)


_KEYS: dict = {}


def cfg_key(cfg) -> tuple:
    """A hashable identity of a model config's values (memoised per live config object)."""
    import dataclasses
    import weakref

    hit = _KEYS.get(id(cfg))
    if hit is not None and hit[0]() is cfg:
        return hit[1]
    key = tuple((f.name, repr(getattr(cfg, f.name))) for f in dataclasses.fields(cfg))
    _KEYS[id(cfg)] = (weakref.ref(cfg), key)
    return key


def _model_params(cfg, tp: int) -> ModelParams:
    from ..model.decoder import DepthMix
    from ..model.norm import RMSNorm
    from ..parallel.layers import ColumnParallelLinear, TPContext, VocabParallelEmbedding, use_tp

    kinds = {}
    layers = []
    for m, f in zip(cfg.layer_types(), cfg.ffn_types()):
        if (m, f) not in kinds:
            kinds[(m, f)] = _kind_params(cfg, m, f, tp)
        layers.append(kinds[(m, f)])
    with torch.device("meta"), use_tp(TPContext(size=tp)):
        emb = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=TPContext(size=tp))
        head = torch.nn.ModuleDict({"lm_head": ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size,
                                                                     tp=TPContext(size=tp)),
                                    "norm": RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)})
        if cfg.attn_res:
            head["output_attn_res"] = DepthMix(cfg.hidden_size, cfg.rms_norm_eps)
    emb_g, _ = _group(emb, "model.embed_tokens")
    head_g = ParamGroup()
    for name, mod in head.items():
        g, _ = _group(mod, name if name == "lm_head" else f"model.{name}")
        head_g = head_g + g
    if cfg.tie_word_embeddings:
        head_g = ParamGroup(head_g.total - emb_g.total, head_g.muon, head_g.largest_matrix, head_g.ns_flops)
    return ModelParams(tp, tuple(layers), emb_g, head_g)


_CACHE: dict = {}


def model_params(cfg, tp: int = 1) -> ModelParams:
    """Per-layer parameter counts on one TP rank of size `tp` (ValueError if tp does not divide the model)."""
    key = (cfg_key(cfg), tp)
    if key not in _CACHE:
        _CACHE[key] = _model_params(cfg, tp)
    return _CACHE[key]
