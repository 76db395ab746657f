"""Kimi Linear in the Hugging Face layout (`transformers` `KimiLinearForCausalLM`) <-> our model.

Two HF namings exist. The checkpoint layout (the published moonshotai/Kimi-Linear files, and what transformers
reads and writes on disk) has per-expert `block_sparse_moe.experts.{e}.w{1,2,3}.weight`, separate
`{q,k,v}_conv1d.weight`, `f_a_proj` / `dt_bias` / `A_log [1, 1, H, 1]` directly under `self_attn`, and the dense
layers' MLP under `mlp.`. transformers' in-memory state dict (`model.state_dict()`) fuses the experts into
`mlp.experts.gate_up_proj`, the convolutions into `conv1d.weight` and moves the decay under `forget_gate.`.

- `hf_config_from(cfg)`: KimiLinearConfig kwargs equal to one of our Kimi-Linear-switched configs;
  `hf_config_dict(cfg)`: the config.json written beside a checkpoint; `hf_config_to(d)`: config.json -> ModelConfig.
- `to_hf_state_dict(sd, cfg)`: ours -> the checkpoint layout; `from_hf_state_dict(sd, cfg)`: the checkpoint
  layout (or transformers' in-memory naming, via `map_hf_state_dict`) -> ours. Every key on either side is
  consumed, or the conversion fails naming what is left.
"""

from __future__ import annotations

import torch

from ..config import ConfigError, ModelConfig


def hf_config_from(cfg) -> dict:
    """KimiLinearConfig kwargs equivalent to our ModelConfig (which must use the Kimi Linear switches)."""
    kimi_linear_switches = {
        "attn_res": False, "hidden_act": "silu", "kda_gate": "softplus", "kda_output_gate": "lowrank",
        "kda_output_gate_bias": False, "mla_output_gate": False, "moe_latent_size": 0, "moe_latent_norm": False,
        "router_num_groups": 1, "router_topk_groups": 1, "router_force_balanced": False,
        "tie_word_embeddings": False,
        "mla_latent_norm_eps": 1e-6,  # HF builds q_a_layernorm / kv_a_layernorm with the default eps 1e-6
    }
    for k, v in kimi_linear_switches.items():
        if getattr(cfg, k) != v:
            raise ValueError(f"model.{k}={getattr(cfg, k)!r}: the Kimi Linear layout needs {v!r}")
    if cfg.decay_rank != cfg.kda_head_dim:  # HF: f_a_proj [head_dim, D]
        raise ValueError(f"model.kda_decay_rank={cfg.kda_decay_rank}: Kimi Linear uses the head dim")
    if cfg.shared_ffn_size != cfg.moe_intermediate_size * cfg.num_shared_experts:
        raise ValueError("model.shared_intermediate_size: Kimi Linear uses moe_intermediate_size * num_shared_experts")
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "initializer_range": cfg.initializer_range,
        "intermediate_size": cfg.dense_intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "n_shared_experts": cfg.num_shared_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "n_group": 1,
        "topk_group": 1,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank or None,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "num_attention_heads": cfg.mla_num_heads,
        "num_key_value_heads": cfg.mla_num_heads,
        "linear_num_heads": cfg.kda_num_heads,
        "linear_head_dim": cfg.kda_head_dim,
        "linear_conv_kernel_dim": cfg.kda_conv_size,
        "hidden_act": "silu",
        "layer_types": [{"mla": "full_attention", "kda": "linear_attention"}[t] for t in cfg.layer_types()],
        "mlp_layer_types": [{"dense": "dense", "moe": "sparse"}[t] for t in cfg.ffn_types()],
        "tie_word_embeddings": False,
        # the default token ids (163xxx) lie outside a tiny vocabulary; padding_idx must not touch the embedding
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def map_hf_state_dict(hf: dict, cfg) -> dict:
    """HF KimiLinearForCausalLM state dict -> K3ForCausalLM state dict. Every HF key must be consumed."""
    hf = dict(hf)
    out = {}

    def take(hf_key, our_key=None, fn=None):
        t = hf.pop(hf_key)
        out[our_key or hf_key] = fn(t) if fn else t

    HK, I = cfg.kda_num_heads * cfg.kda_head_dim, cfg.moe_intermediate_size
    for i, (mixer, ffn) in enumerate(zip(cfg.layer_types(), cfg.ffn_types())):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if mixer == "kda":
            for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
                take(f"{a}{n}.weight")
            conv = hf.pop(a + "conv1d.weight")  # [3*H*K, 1, W]: q, k, v channels in that order
            if conv.shape != (3 * HK, 1, cfg.kda_conv_size):
                raise ValueError(f"{a}conv1d.weight: shape {tuple(conv.shape)}, "
                                 f"expected {(3 * HK, 1, cfg.kda_conv_size)}")
            for j, n in enumerate(("q_conv1d", "k_conv1d", "v_conv1d")):
                out[a + n] = conv[j * HK:(j + 1) * HK].clone()
            for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias"):
                take(a + "forget_gate." + n, a + n)
            take(a + "forget_gate.A_log", a + "A_log", lambda t: t.reshape(-1))  # [1, 1, H, 1] -> [H]
            take(a + "o_norm.weight", a + "o_norm")
        else:
            names = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"]
            for n in names + ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]:
                take(f"{a}{n}.weight")
        m = p + "mlp."
        if ffn == "dense":
            for n in ("gate_proj", "up_proj", "down_proj"):
                take(f"{m}{n}.weight")
        else:
            take(m + "gate.weight")
            take(m + "gate.e_score_correction_bias")
            gate_up = hf.pop(m + "experts.gate_up_proj")  # [E, 2I, D]: gate rows, then up rows
            if gate_up.shape[1] != 2 * I:
                raise ValueError(f"{m}experts.gate_up_proj: shape {tuple(gate_up.shape)}, expected [E, {2 * I}, D]")
            out[m + "experts.w1"] = gate_up[:, :I].clone()
            out[m + "experts.w3"] = gate_up[:, I:].clone()
            take(m + "experts.down_proj", m + "experts.w2")  # [E, D, I]
            for n in ("gate_proj", "up_proj", "down_proj"):
                take(f"{m}shared_experts.{n}.weight")
        take(p + "input_layernorm.weight")
        take(p + "post_attention_layernorm.weight")
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        take(k)
    if hf:
        raise ValueError(f"Hugging Face keys left unmapped: {sorted(hf)[:8]}")
    return out


# ------------------------------------------------------------------------------------------------ config.json
def hf_config_dict(cfg) -> dict:
    """The config.json of a Kimi Linear checkpoint equal to our config. It carries both the keys transformers
    serialises (layer_types, num_experts, ...) and the original checkpoint's (linear_attn_config,
    first_k_dense_replace), so transformers and the checkpoint's own remote code read the same model."""
    kw = hf_config_from(cfg)
    full = [i + 1 for i, t in enumerate(cfg.layer_types()) if t == "mla"]
    kda = [i + 1 for i, t in enumerate(cfg.layer_types()) if t == "kda"]
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        **{k: v for k, v in kw.items() if k not in (
            "num_local_experts", "num_experts_per_tok", "n_shared_experts", "norm_topk_prob", "n_group")},
        "num_experts": kw["num_local_experts"],
        "num_experts_per_token": kw["num_experts_per_tok"],
        "num_shared_experts": kw["n_shared_experts"],
        "moe_renormalize": kw["norm_topk_prob"],
        "num_expert_group": kw["n_group"],
        "first_k_dense_replace": cfg.first_k_dense,
        "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid",
        "mla_use_nope": True,
        "linear_attn_config": {"head_dim": cfg.kda_head_dim, "num_heads": cfg.kda_num_heads,
                               "short_conv_kernel_size": cfg.kda_conv_size, "kda_layers": kda,
                               "full_attn_layers": full},
    }


def _pick(d: dict, *names, default=KeyError):
    for n in names:
        if n in d:
            return d[n]
    if default is KeyError:
        raise ConfigError(f"config.json:{names[0]}", None, "required key is missing")
    return default


def _require(d: dict, name: str, ok, what: str):
    """Refuse a config.json value our model cannot represent."""
    if name in d and not ok(d[name]):
        raise ConfigError(f"config.json:{name}", d[name], f"megatron-k3 cannot represent this: {what}")


def _layer_schedule(d: dict, n: int, lac: dict):
    """(each layer's attention type, the number of leading dense layers) of a Kimi Linear config.json with `n`
    layers (`lac` its linear_attn_config)."""
    if d.get("layer_types"):
        types = list(d["layer_types"])
    elif "full_attn_layers" in lac:
        full = set(lac["full_attn_layers"])
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    else:  # transformers' default schedule
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or set(types) - {"full_attention", "linear_attention"}:
        raise ConfigError("config.json:layer_types", types,
                          f"{n} entries of 'full_attention' / 'linear_attention'")
    if d.get("mlp_layer_types"):
        mlp = list(d["mlp_layer_types"])
        k = mlp.count("dense")
        if mlp != ["dense"] * k + ["sparse"] * (n - k):
            raise ConfigError("config.json:mlp_layer_types", mlp,
                              "megatron-k3 supports dense layers first, then MoE ('dense'*k + 'sparse'*(n-k))")
    else:
        k = _pick(d, "first_k_dense_replace", default=1)
    return types, k


def hf_config_to(d: dict) -> ModelConfig:
    """A Kimi Linear config.json (transformers' or the original checkpoint's spelling) -> our ModelConfig.
    Raises ConfigError naming the key for anything our model cannot represent."""
    if d.get("model_type", "kimi_linear") != "kimi_linear":
        raise ConfigError("config.json:model_type", d.get("model_type"), "expected 'kimi_linear'")
    _require(d, "hidden_act", lambda v: v == "silu", "Kimi Linear's MLPs are SwiGLU ('silu')")
    _require(d, "moe_router_activation_func", lambda v: v == "sigmoid", "the router is sigmoid + correction bias")
    _require(d, "moe_layer_freq", lambda v: v == 1, "every layer from first_k_dense_replace on is MoE")
    _require(d, "mla_use_nope", lambda v: v is True, "MLA without positional encoding (NoPE) only")
    _require(d, "attention_bias", lambda v: not v, "projections have no bias")
    _require(d, "num_nextn_predict_layers", lambda v: not v, "no multi-token-prediction layers")
    _require(d, "rope_scaling", lambda v: v is None, "NoPE: there is no RoPE to scale")
    heads = _pick(d, "num_attention_heads")
    _require(d, "num_key_value_heads", lambda v: v in (None, heads), "MLA has as many key/value heads as heads")
    n = _pick(d, "num_hidden_layers")
    lac = d.get("linear_attn_config") or {}
    types, k = _layer_schedule(d, n, lac)
    experts = _pick(d, "num_experts", "num_local_experts", "n_routed_experts", default=None)
    if experts is None and k < n:
        raise ConfigError("config.json:num_experts", None, "MoE layers need num_experts")
    cfg = ModelConfig(
        name="kimi_linear_hf",
        vocab_size=_pick(d, "vocab_size"),
        hidden_size=_pick(d, "hidden_size"),
        num_layers=n,
        rms_norm_eps=_pick(d, "rms_norm_eps", default=1e-5),
        initializer_range=_pick(d, "initializer_range", default=0.02),
        tie_word_embeddings=bool(_pick(d, "tie_word_embeddings", default=False)),
        mla_layers=[i + 1 for i, t in enumerate(types) if t == "full_attention"],
        mla_every=0, mla_at_last=False,
        first_k_dense=k,
        kda_num_heads=_pick(lac, "num_heads", default=None) or _pick(d, "linear_num_heads", default=32),
        kda_head_dim=_pick(lac, "head_dim", default=None) or _pick(d, "linear_head_dim", default=128),
        kda_conv_size=_pick(lac, "short_conv_kernel_size", default=None) or _pick(d, "linear_conv_kernel_dim",
                                                                                  default=4),
        kda_gate="softplus", kda_output_gate="lowrank", kda_output_gate_bias=False, kda_a_log_init="uniform_1_16",
        mla_num_heads=heads,
        q_lora_rank=_pick(d, "q_lora_rank", default=None) or 0,
        kv_lora_rank=_pick(d, "kv_lora_rank"),
        qk_nope_head_dim=_pick(d, "qk_nope_head_dim"),
        qk_rope_head_dim=_pick(d, "qk_rope_head_dim"),
        v_head_dim=_pick(d, "v_head_dim"),
        mla_output_gate=False,
        mla_latent_norm_eps=1e-6,  # transformers' q_a / kv_a layernorms use the RMSNorm default
        hidden_act="silu",
        dense_intermediate_size=_pick(d, "intermediate_size"),
        num_experts=experts or 0,
        top_k=_pick(d, "num_experts_per_token", "num_experts_per_tok", default=0),
        moe_intermediate_size=_pick(d, "moe_intermediate_size", default=0),
        moe_latent_size=0, moe_latent_norm=False,
        num_shared_experts=_pick(d, "num_shared_experts", "n_shared_experts", default=0) or 0,
        routed_scaling_factor=float(_pick(d, "routed_scaling_factor", default=1.0)),
        norm_topk_prob=bool(_pick(d, "moe_renormalize", "norm_topk_prob", default=True)),
        router_num_groups=_pick(d, "num_expert_group", "n_group", default=1) or 1,
        router_topk_groups=_pick(d, "topk_group", default=1) or 1,
        attn_res=False,
    )
    return cfg.validate("config.json")


# ------------------------------------------------------------------------------------------------ tensors
_KDA_SAME = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "g_a_proj.weight",
             "g_b_proj.weight", "o_proj.weight", "f_a_proj.weight", "f_b_proj.weight", "dt_bias")


def _layer_pairs(cfg, i: int, mixer: str, ffn: str):
    """(our key, checkpoint key, ours->hf, hf->ours) for layer i's non-expert tensors."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    ident = None
    out = []
    if mixer == "kda":
        out += [(a + n, a + n, ident, ident) for n in _KDA_SAME]
        if cfg.kda_output_gate_bias:
            out.append((a + "g_b_proj.bias", a + "g_b_proj.bias", ident, ident))
        out += [(a + f"{c}_conv1d", a + f"{c}_conv1d.weight", ident, ident) for c in "qkv"]
        out.append((a + "A_log", a + "A_log", lambda t: t.reshape(1, 1, -1, 1), lambda t: t.reshape(-1)))
        out.append((a + "o_norm", a + "o_norm.weight", ident, ident))
    else:
        names = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"]
        out += [(f"{a}{n}.weight",) * 2 + (ident, ident)
                for n in names + ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]]
    if ffn == "dense":
        out += [(f"{p}mlp.{n}.weight",) * 2 + (ident, ident) for n in ("gate_proj", "up_proj", "down_proj")]
    else:
        m, b = p + "mlp.", p + "block_sparse_moe."
        out += [(m + n, b + n, ident, ident) for n in ("gate.weight", "gate.e_score_correction_bias")]
        out += [(f"{m}shared_experts.{n}.weight", f"{b}shared_experts.{n}.weight", ident, ident)
                for n in ("gate_proj", "up_proj", "down_proj")]
    out += [(p + n, p + n, ident, ident) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")]
    return out


def pairs(cfg):
    out = [(k, k, None, None) for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")]
    for i, (mixer, ffn) in enumerate(zip(cfg.layer_types(), cfg.ffn_types())):
        out += _layer_pairs(cfg, i, mixer, ffn)
    return out


def moe_layers(cfg):
    return [i for i, f in enumerate(cfg.ffn_types()) if f == "moe"]


def to_hf_state_dict(sd: dict, cfg) -> dict:
    """Our (unsharded) state dict -> the Kimi Linear checkpoint layout. Every key of ours is consumed."""
    hf_config_from(cfg)  # refuses configs the Kimi Linear layout cannot express
    sd = dict(sd)
    out = {}
    for ours, hf, fwd, _ in pairs(cfg):
        t = sd.pop(ours)
        out[hf] = (fwd(t) if fwd else t).contiguous()
    for i in moe_layers(cfg):
        for w in ("w1", "w2", "w3"):
            batched = sd.pop(f"model.layers.{i}.mlp.experts.{w}")
            for e in range(batched.shape[0]):
                out[f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"] = batched[e].contiguous()
    if sd:
        raise ValueError(f"our keys without a Kimi Linear name: {sorted(sd)[:8]}")
    return out


def is_runtime_naming(keys) -> bool:
    return any(k.endswith((".self_attn.conv1d.weight", ".experts.gate_up_proj")) for k in keys)


def from_hf_state_dict(hf: dict, cfg) -> dict:
    """A Kimi Linear checkpoint (or transformers' in-memory state dict) -> our state dict. Every key is consumed.

    transformers (5.x) writes a dense layer's MLP as `block_sparse_moe.{gate,up,down}_proj` (its renaming of
    `block_sparse_moe.` to `mlp.` is reversed on save for every layer); that spelling is read as `mlp.` too."""
    if is_runtime_naming(hf):
        return map_hf_state_dict(hf, cfg)
    hf = dict(hf)
    for i, f in enumerate(cfg.ffn_types()):
        for n in ("gate_proj", "up_proj", "down_proj"):
            quirk = f"model.layers.{i}.block_sparse_moe.{n}.weight"
            if f == "dense" and quirk in hf:
                hf.setdefault(f"model.layers.{i}.mlp.{n}.weight", hf.pop(quirk))
    out = {}
    for ours, key, _, back in pairs(cfg):
        if key not in hf:
            raise KeyError(f"Kimi Linear checkpoint has no {key}")
        t = hf.pop(key)
        out[ours] = back(t) if back else t
    for i in moe_layers(cfg):
        for w in ("w1", "w2", "w3"):
            keys = [f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight" for e in range(cfg.num_experts)]
            missing = [k for k in keys if k not in hf]
            if missing:
                raise KeyError(f"Kimi Linear checkpoint has no {missing[0]}")
            out[f"model.layers.{i}.mlp.experts.{w}"] = torch.stack([hf.pop(k) for k in keys])
    if hf:
        raise ValueError(f"Kimi Linear checkpoint keys left unmapped: {sorted(hf)[:8]}")
    return out
