"""Kimi Linear in the Hugging Face layout (`transformers` `KimiLinearForCausalLM`) <-> our model.

`hf_config_from(cfg)` gives the KimiLinearConfig kwargs equal to one of our Kimi-Linear-switched configs;
`map_hf_state_dict(sd, cfg)` renames and reshapes an HF state dict into ours (every HF key consumed).
The full converter (both directions, K3 layouts, packed MXFP4 experts) builds on this.
"""

from __future__ import annotations


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
                raise ValueError(f"{a}conv1d.weight: shape {tuple(conv.shape)}, expected {(3 * HK, 1, cfg.kda_conv_size)}")
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
