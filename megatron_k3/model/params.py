"""Parameter accounting: total and active (per-token) counts of a model, from the modules themselves.

The model is built on the meta device, so even the 2.8T configuration costs no memory. `active` counts
the parameters a token touches: routed experts only top_k / num_experts of them, and the input
embedding is excluded (a lookup, not a matmul), as in the published 104B figure.
"""

from __future__ import annotations

import torch

from .k3 import K3ForCausalLM


def _category(name: str, cfg) -> str:
    if name.startswith("model.embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".mlp.experts." in name:
        return "routed_experts"
    if "_res." in name or name.startswith("model.output_attn_res"):
        return "attn_res"
    if name.startswith("model.layers."):
        idx = int(name.split(".")[2])
        sub = name.split(".")[3]
        if sub == "self_attn":
            return f"{cfg.layer_types()[idx]}_attention"
        if sub == "mlp":
            return "dense_ffn" if cfg.ffn_types()[idx] == "dense" else "moe_other"
        return "norms"
    return "norms"


def count_parameters(cfg) -> dict:
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, init=False)
    seen, by_cat = set(), {}
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        cat = _category(name, cfg)
        by_cat[cat] = by_cat.get(cat, 0) + p.numel()
    total = sum(by_cat.values())
    routed = by_cat.get("routed_experts", 0)
    active = total - routed + routed * cfg.top_k // max(cfg.num_experts, 1)
    if not cfg.tie_word_embeddings:
        active -= by_cat.get("embedding", 0)
    return {"model": cfg.name, "total": total, "active": active, "breakdown": dict(sorted(by_cat.items())),
            "layers": {"kda": cfg.layer_types().count("kda"), "mla": cfg.layer_types().count("mla"),
                       "moe": cfg.ffn_types().count("moe"), "dense": cfg.ffn_types().count("dense")}}
