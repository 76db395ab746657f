"""The public Kimi K3 checkpoint layout (MODEL.md section 0/7.1; NeMo AutoModel's kimi_k3 state-dict adapter) <-> ours.

Legend: E experts, H KDA heads, HK = H * head_dim, Hp = H rounded up to a multiple of 128.
The K3 checkpoint is a vision-language one: text tensors live under `language_model.` (read with or without it),
the vision tower's and projector's beside it, unprefixed (`vision_tower.*`, `mm_projector.*`, stored in bf16). A
model with `model.vision.enabled` (K3ForConditionalGeneration) holds them under the same names; a text-only model
skips them on import. Per text tensor:

    ours                                           K3 checkpoint (after `language_model.`)
    model.layers.i.self_attn.{q,k,v}_conv1d        model.layers.i.self_attn.{q,k,v}_conv1d.weight   fp32 [HK, 1, W]
    model.layers.i.self_attn.A_log [H]             model.layers.i.self_attn.A_log [Hp] fp32, zero-padded
    model.layers.i.self_attn.dt_bias               same name, fp32
    model.layers.i.self_attn.o_norm                model.layers.i.self_attn.o_norm.weight fp32
    model.layers.i.{self_attention,mlp}_res.proj   model.layers.i.{self_attention,mlp}_res_proj.weight [1, D]
    model.layers.i.{self_attention,mlp}_res.norm   model.layers.i.{self_attention,mlp}_res_norm.weight
    model.output_attn_res.{proj,norm}              model.output_attn_res_{proj,norm}.weight
    model.layers.i.mlp.gate.*  (MoE layers)        model.layers.i.block_sparse_moe.gate.weight,
                                                   ....gate.e_score_correction_bias fp32
    model.layers.i.mlp.latent_down_proj / _up_proj model.layers.i.block_sparse_moe.routed_expert_{down,up}_proj.weight
    model.layers.i.mlp.latent_norm                 model.layers.i.block_sparse_moe.routed_expert_norm.weight
    model.layers.i.mlp.shared_experts.*            model.layers.i.block_sparse_moe.shared_experts.*
    model.layers.i.mlp.experts.w{1,2,3} [E, o, i]  ...block_sparse_moe.experts.{e}.w{1,2,3}.weight_packed
                                                   and .weight_scale (k3_experts)
    everything else                                the same name
The fp32 tensors above stay fp32; the rest is written in the requested dtype (bf16 as the released checkpoint).

config.json: {"model_type": "kimi_k3", "text_config": {... KimiK3TextConfig keys ...}, "vision_config": {...
KimiK3VisionConfig keys ...}, "media_placeholder_token_id": ...} with the compressed-tensors `quantization_config`
inside text_config; vision_config only for a vision-language model. The released tower's fixed choices
(VISION_FIXED) are checked on import. Values our config holds that the K3 text config has no key for
(the MLA latent-norm eps, a shared-expert width other than moe_intermediate_size * num_shared_experts, a decay
rank other than the head dim, a bias on the low-rank output gate) go under text_config["megatron_k3"], with a
warning: other K3 implementations ignore that entry.
"""

from __future__ import annotations

import logging

import torch

from ..config import ConfigError, ModelConfig, VisionConfig
from .k3_experts import pack_expert_weights, unpack_expert_weights

log = logging.getLogger(__name__)

PREFIX = "language_model."
FOREIGN_PREFIXES = ("vision_tower.", "mm_projector.")  # the vision tower and projector: unprefixed
# The released vision_config's choices our tower implements (model/vision.py); anything else is refused.
VISION_FIXED = {"pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
                "norm_type": "rmsnorm", "mlp_type": "mlp2", "attn_bias": False, "patch_embed_proj_bias": False,
                "linear_bias": False, "activation_func": "gelu_pytorch_tanh", "projector_hidden_act": "gelu"}
FP32_SUFFIXES = (".A_log", ".dt_bias", "_conv1d.weight", ".o_norm.weight", ".e_score_correction_bias")
MLA_LATENT_NORM_EPS = 1e-6  # NeMo builds q_a_layernorm / kv_a_layernorm with the RMSNorm default, not rms_norm_eps
EXTRA = "megatron_k3"
QUANT_TARGET = r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"


def padded_heads(h: int) -> int:
    """A_log's checkpoint length: the head count rounded up to a multiple of 128."""
    return -(-h // 128) * 128


def is_fp32_key(key: str) -> bool:
    return key.endswith(FP32_SUFFIXES)


# ------------------------------------------------------------------------------------------------ config.json
def check_representable(cfg):
    """Raise ConfigError for what the K3 layout cannot hold at all (SwiGLU, MoE without the latent projection)."""
    if cfg.hidden_act != "situ":
        raise ConfigError("model.hidden_act", cfg.hidden_act,
                          "the Kimi K3 layout is SiTU only; use layout='kimi_linear'")
    if not cfg.moe_latent_size and cfg.first_k_dense < cfg.num_layers:
        raise ConfigError("model.moe_latent_size", 0, "the Kimi K3 layout has latent MoE (routed_expert_hidden_size)")


def _linear_attn_config(cfg) -> dict:
    """config.json's linear_attn_config: the KDA settings and which layers are KDA and which MLA (1-based)."""
    types = cfg.layer_types()
    return {
        "head_dim": cfg.kda_head_dim,
        "num_heads": cfg.kda_num_heads,
        "short_conv_kernel_size": cfg.kda_conv_size,
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "kda"],
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "mla"],
        "use_full_rank_gate": cfg.kda_output_gate == "full",
        "gate_lower_bound": cfg.kda_gate_lower_bound if cfg.kda_gate == "lowerbound" else None,
    }


def _mxfp4_quantization_config() -> dict:
    """config.json's quantization_config of a K3 checkpoint: routed experts in MXFP4 (compressed-tensors'
    mxfp4-pack-quantized, groups of 32, E8M0 scales)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": [QUANT_TARGET],
            "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                        "group_size": 32, "dynamic": False, "scale_dtype": "torch.uint8"},
            "input_activations": None,
            "output_activations": None,
        }},
        "ignore": [],
    }


def _extension_keys(cfg) -> dict:
    """Our settings that no K3 config.json key names (written under text_config[EXTRA]); empty at K3's values."""
    extra = {}
    if cfg.mla_latent_norm_eps != MLA_LATENT_NORM_EPS:
        extra["mla_latent_norm_eps"] = cfg.mla_latent_norm_eps
    if cfg.num_shared_experts and cfg.shared_ffn_size != cfg.moe_intermediate_size * cfg.num_shared_experts:
        extra["shared_intermediate_size"] = cfg.shared_ffn_size
    if cfg.decay_rank != cfg.kda_head_dim:
        extra["kda_decay_rank"] = cfg.decay_rank
    if cfg.kda_output_gate == "lowrank" and cfg.kda_output_gate_bias:
        extra["kda_output_gate_bias"] = True
    return extra


def k3_config_dict(cfg, dtype: str = "bfloat16") -> dict:
    """The config.json of a K3-layout checkpoint equal to our config (see check_representable for refusals)."""
    check_representable(cfg)
    text = {
        "architectures": ["KimiK3ForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.dense_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.mla_num_heads,
        "num_key_value_heads": cfg.mla_num_heads,
        "hidden_act": "situ",
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": 1048576,
        "torch_dtype": dtype,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "moe_renormalize": cfg.norm_topk_prob,
        "moe_router_activation_func": "sigmoid",
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.top_k,
        "num_shared_experts": cfg.num_shared_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "first_k_dense_replace": cfg.first_k_dense,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": cfg.router_num_groups,
        "topk_group": cfg.router_topk_groups,
        "topk_method": "noaux_tc",
        "routed_expert_hidden_size": cfg.moe_latent_size,
        "latent_moe_use_norm": cfg.moe_latent_norm,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": cfg.mla_output_gate,
        "linear_attn_config": _linear_attn_config(cfg),
        "attn_res_block_size": cfg.attn_res_block_size if cfg.attn_res else None,
        "activation_situ_beta": cfg.situ_beta_gate,
        "activation_situ_linear_beta": cfg.situ_beta_up,
        "num_nextn_predict_layers": 0,
        "quantization_config": _mxfp4_quantization_config(),
    }
    extra = _extension_keys(cfg)
    if extra:
        log.warning("Kimi K3 config.json: %s have no K3 key; written under text_config[%r], which other K3 "
                    "implementations ignore", sorted(extra), EXTRA)
        text[EXTRA] = extra
    out = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
           "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": dtype, "text_config": text}
    if cfg.vision.enabled:
        out["vision_config"] = vision_config_dict(cfg)
        out["media_placeholder_token_id"] = cfg.vision.placeholder_token_id
        out["ignore_index"], out["pad_token_id"] = -100, 0
    return out


def vision_config_dict(cfg) -> dict:
    """The released `vision_config` keys for our model.vision (what it cannot name goes under EXTRA)."""
    v = cfg.vision
    d = {"model_type": "kimi_k3_vision", "patch_size": v.patch_size, "init_pos_emb_height": v.pos_emb_height,
         "init_pos_emb_width": v.pos_emb_width, "init_pos_emb_time": v.pos_emb_time,
         "vt_num_attention_heads": v.num_heads, "vt_num_hidden_layers": v.num_layers, "vt_hidden_size": v.hidden_size,
         "vt_intermediate_size": v.intermediate_size, "merge_kernel_size": [int(m) for m in v.merge_kernel_size],
         "mm_hidden_size": v.hidden_size, "projector_ln_eps": v.projector_eps, "qkv_hidden_size": v.qkv_hidden_size,
         "pos_emb_interpolation_mode": v.pos_emb_interpolation, "media_placeholder_token_id": v.placeholder_token_id,
         "text_hidden_size": cfg.hidden_size, **VISION_FIXED}
    default = VisionConfig()
    extra = {k: getattr(v, k) for k in ("rope_max_grid", "rope_theta") if getattr(v, k) != getattr(default, k)}
    if extra:
        d[EXTRA] = extra
    return d


def vision_config_to(d: dict, text_hidden: int) -> VisionConfig:
    """A released `vision_config` -> our VisionConfig (enabled); refuses what the tower does not implement."""
    for key, want in VISION_FIXED.items():
        if key in d and d[key] != want:
            _refuse(f"vision_config.{key}", d[key], f"the K3 vision tower has {key}={want!r}")
    hidden = _get(d, "vt_hidden_size")
    if d.get("mm_hidden_size") not in (None, hidden):
        _refuse("vision_config.mm_hidden_size", d["mm_hidden_size"], "the projector takes the tower's width")
    if d.get("text_hidden_size") not in (None, text_hidden):
        _refuse("vision_config.text_hidden_size", d["text_hidden_size"], f"the text model's width is {text_hidden}")
    extra = d.get(EXTRA) or {}
    return VisionConfig(
        enabled=True, patch_size=d.get("patch_size", 14), hidden_size=hidden,
        num_layers=_get(d, "vt_num_hidden_layers"), num_heads=_get(d, "vt_num_attention_heads"),
        qkv_hidden_size=d.get("qkv_hidden_size") or hidden, intermediate_size=_get(d, "vt_intermediate_size"),
        pos_emb_height=d.get("init_pos_emb_height", 64), pos_emb_width=d.get("init_pos_emb_width", 64),
        pos_emb_time=d.get("init_pos_emb_time", 4),
        pos_emb_interpolation=d.get("pos_emb_interpolation_mode", "bicubic"),
        merge_kernel_size=[int(m) for m in d.get("merge_kernel_size", [2, 2])],
        rope_max_grid=extra.get("rope_max_grid", 512), rope_theta=extra.get("rope_theta", 10000.0),
        projector_eps=d.get("projector_ln_eps", 1e-5),
        placeholder_token_id=d.get("media_placeholder_token_id", 163605))


def _refuse(key, value, what):
    raise ConfigError(f"config.json:{key}", value, f"megatron-k3 cannot represent this: {what}")


def _get(d: dict, key: str, default=KeyError):
    if key in d:
        return d[key]
    if default is KeyError:
        raise ConfigError(f"config.json:{key}", None, "required key is missing")
    return default


def text_config_of(d: dict) -> dict:
    """The text-model part of a K3 config.json (nested under text_config in the vision-language checkpoint)."""
    return d["text_config"] if isinstance(d.get("text_config"), dict) else d


def _check_k3_config(d: dict, t: dict):
    """Refuse (ConfigError naming the key) what our model cannot represent in K3 config.json `d` (`t` its text
    part): (heads, layers, linear_attn_config, the full-attention layers, the megatron-k3 extension keys)."""
    checks = [
        ("moe_router_activation_func", lambda v: v == "sigmoid", "the router is sigmoid + correction bias"),
        ("topk_method", lambda v: v == "noaux_tc", "routing is noaux_tc (bias for selection only)"),
        ("moe_layer_freq", lambda v: v == 1, "every layer from first_k_dense_replace on is MoE"),
        ("mla_use_nope", lambda v: v is True, "MLA without positional encoding (NoPE) only"),
        ("num_nextn_predict_layers", lambda v: not v, "no multi-token-prediction layers"),
        ("hidden_act", lambda v: v == "situ", "K3's MLPs are SiTU-GLU"),
        ("activation_situ_linear_beta", lambda v: v is not None, "the up branch is always soft-capped"),
        ("routed_expert_hidden_size", lambda v: bool(v), "K3's MoE is latent (routed_expert_hidden_size > 0)"),
    ]
    for key, ok, what in checks:
        if key in t and not ok(t[key]):
            _refuse(key, t[key], what)
    heads = _get(t, "num_attention_heads")
    if t.get("num_key_value_heads") not in (None, heads):
        _refuse("num_key_value_heads", t["num_key_value_heads"], "MLA has as many key/value heads as heads")
    q = t.get("quantization_config") or d.get("quantization_config")
    if q is not None:
        fmt = q.get("format")
        groups = q.get("config_groups") or {}
        sizes = {g.get("weights", {}).get("group_size") for g in groups.values()}
        if fmt not in (None, "mxfp4-pack-quantized") or sizes - {32}:
            _refuse("quantization_config", {"format": fmt, "group_size": sorted(map(str, sizes))},
                    "routed experts in MXFP4 (mxfp4-pack-quantized, groups of 32) only")
    n = _get(t, "num_hidden_layers")
    lac = _get(t, "linear_attn_config")
    full, kda = set(lac.get("full_attn_layers") or []), set(lac.get("kda_layers") or [])
    if full | kda != set(range(1, n + 1)) or full & kda:
        _refuse("linear_attn_config", {"full_attn_layers": sorted(full), "kda_layers": sorted(kda)},
                f"full_attn_layers and kda_layers must split layers 1..{n}")
    extra = t.get(EXTRA) or {}
    unknown = set(extra) - {"mla_latent_norm_eps", "shared_intermediate_size", "kda_decay_rank",
                            "kda_output_gate_bias"}
    if unknown:
        _refuse(f"{EXTRA}.{sorted(unknown)[0]}", extra[sorted(unknown)[0]], "unknown megatron-k3 extension key")
    return heads, n, lac, full, extra


def k3_config_to(d: dict, vision: bool = True) -> ModelConfig:
    """A Kimi K3 config.json (nested or text-only) -> our ModelConfig. Raises ConfigError naming the key for
    anything our model cannot represent. vision=False: the text model, its `vision_config` ignored (not checked:
    NeMo writes the released one, placeholder id 163605, around a tiny text-only K3 of a smaller vocabulary)."""
    t = text_config_of(d)
    heads, n, lac, full, extra = _check_k3_config(d, t)
    lb = lac.get("gate_lower_bound")
    block = t.get("attn_res_block_size")
    cfg = ModelConfig(
        name="k3_hf",
        vocab_size=_get(t, "vocab_size"),
        hidden_size=_get(t, "hidden_size"),
        num_layers=n,
        rms_norm_eps=_get(t, "rms_norm_eps", 1e-5),
        initializer_range=_get(t, "initializer_range", 0.02),
        tie_word_embeddings=bool(_get(t, "tie_word_embeddings", False)),
        mla_layers=sorted(full), mla_every=0, mla_at_last=False,
        first_k_dense=_get(t, "first_k_dense_replace", 1),
        kda_num_heads=_get(lac, "num_heads"),
        kda_head_dim=_get(lac, "head_dim"),
        kda_conv_size=_get(lac, "short_conv_kernel_size", 4),
        kda_gate="lowerbound" if lb is not None else "softplus",
        kda_gate_lower_bound=lb if lb is not None else -5.0,
        kda_decay_rank=extra.get("kda_decay_rank", 0),
        kda_output_gate="full" if lac.get("use_full_rank_gate", False) else "lowrank",
        kda_output_gate_bias=bool(extra.get("kda_output_gate_bias", False)),
        mla_num_heads=heads,
        q_lora_rank=t.get("q_lora_rank") or 0,
        kv_lora_rank=_get(t, "kv_lora_rank"),
        qk_nope_head_dim=_get(t, "qk_nope_head_dim"),
        qk_rope_head_dim=_get(t, "qk_rope_head_dim"),
        v_head_dim=_get(t, "v_head_dim"),
        mla_output_gate=bool(t.get("mla_use_output_gate", False)),
        mla_latent_norm_eps=extra.get("mla_latent_norm_eps", MLA_LATENT_NORM_EPS),
        hidden_act="situ",
        situ_beta_gate=t.get("activation_situ_beta") or 1.0,  # NeMo: `beta or 1.0`
        situ_beta_up=_get(t, "activation_situ_linear_beta"),
        dense_intermediate_size=_get(t, "intermediate_size"),
        num_experts=t.get("num_experts") or 0,
        top_k=t.get("num_experts_per_token") or 0,
        moe_intermediate_size=t.get("moe_intermediate_size") or 0,
        moe_latent_size=_get(t, "routed_expert_hidden_size"),
        moe_latent_norm=bool(t.get("latent_moe_use_norm", False)),
        num_shared_experts=t.get("num_shared_experts") or 0,
        shared_intermediate_size=extra.get("shared_intermediate_size", 0),
        routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(t.get("moe_renormalize", True)),
        router_num_groups=t.get("num_expert_group") or 1,
        router_topk_groups=t.get("topk_group") or 1,
        attn_res=block is not None,
        attn_res_block_size=block or 12,
    )
    if vision and isinstance(d.get("vision_config"), dict):
        cfg.vision = vision_config_to(dict(d["vision_config"], **(
            {"media_placeholder_token_id": d["media_placeholder_token_id"]}
            if "media_placeholder_token_id" in d else {})), cfg.hidden_size)
    return cfg.validate("config.json")


def vision_keys(cfg) -> list:
    """The checkpoint names of the vision tower's and projector's tensors (= ours), for model.vision.enabled."""
    if not cfg.vision.enabled:
        return []
    t, keys = "vision_tower.", []
    keys += [t + "patch_embed.proj.weight", t + "patch_embed.pos_emb.weight"]
    for i in range(cfg.vision.num_layers):
        b = f"{t}encoder.blocks.{i}."
        keys += [b + n + ".weight" for n in ("norm0", "norm1", "wqkv", "wo", "mlp.fc0", "mlp.fc1")]
    keys.append(t + "encoder.final_layernorm.weight")
    return keys + [f"mm_projector.{n}.weight" for n in ("proj.0", "proj.2", "post_norm")]


def checkpoint_name(key: str) -> str:
    """A K3 key as the directory names it: the text model's under `language_model.`, the vision tower's as is."""
    return key if key.startswith(FOREIGN_PREFIXES) else PREFIX + key


# ------------------------------------------------------------------------------------------------ tensors
def pairs(cfg):
    """(our key, K3 key without the prefix, ours->K3, K3->ours) for every non-expert tensor."""
    H = cfg.kda_num_heads
    Hp = padded_heads(H)

    def pad(t):
        return torch.cat([t.reshape(-1), t.new_zeros(Hp - H)])

    def unpad(key):
        def f(t):
            t = t.reshape(-1)
            if t.numel() != Hp or torch.count_nonzero(t[H:]):
                raise ValueError(f"{key}: expected {H} per-head values zero-padded to {Hp}, got {t.numel()} "
                                 f"values with {int(torch.count_nonzero(t[H:]))} non-zero in the padding")
            return t[:H]
        return f

    same = None
    out = [(k, k, same, same) for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")]
    out += [(k, k, same, same) for k in vision_keys(cfg)]
    if cfg.attn_res:
        out += [(f"model.output_attn_res.{n}.weight", f"model.output_attn_res_{n}.weight", same, same)
                for n in ("proj", "norm")]
    for i, (mixer, ffn) in enumerate(zip(cfg.layer_types(), cfg.ffn_types())):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if mixer == "kda":
            names = ["q_proj", "k_proj", "v_proj", "b_proj", "o_proj", "f_a_proj", "f_b_proj"]
            names += ["g_proj"] if cfg.kda_output_gate == "full" else ["g_a_proj", "g_b_proj"]
            out += [(f"{a}{n}.weight",) * 2 + (same, same) for n in names]
            if cfg.kda_output_gate == "lowrank" and cfg.kda_output_gate_bias:
                out.append((a + "g_b_proj.bias",) * 2 + (same, same))
            out += [(a + f"{c}_conv1d", a + f"{c}_conv1d.weight", same, same) for c in "qkv"]
            out.append((a + "A_log", a + "A_log", pad, unpad(a + "A_log")))
            out.append((a + "dt_bias", a + "dt_bias", same, same))
            out.append((a + "o_norm", a + "o_norm.weight", same, same))
        else:
            names = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"]
            names += ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
            names += ["g_proj"] if cfg.mla_output_gate else []
            out += [(f"{a}{n}.weight",) * 2 + (same, same) for n in names]
        if ffn == "dense":
            out += [(f"{p}mlp.{n}.weight",) * 2 + (same, same) for n in ("gate_proj", "up_proj", "down_proj")]
        else:
            m, b = p + "mlp.", p + "block_sparse_moe."
            out += [(m + n, b + n, same, same) for n in ("gate.weight", "gate.e_score_correction_bias")]
            if cfg.moe_latent_size:
                out += [(m + "latent_down_proj.weight", b + "routed_expert_down_proj.weight", same, same),
                        (m + "latent_up_proj.weight", b + "routed_expert_up_proj.weight", same, same)]
            if cfg.moe_latent_norm:
                out.append((m + "latent_norm.weight", b + "routed_expert_norm.weight", same, same))
            if cfg.num_shared_experts:
                out += [(f"{m}shared_experts.{n}.weight", f"{b}shared_experts.{n}.weight", same, same)
                        for n in ("gate_proj", "up_proj", "down_proj")]
        out += [(p + n, p + n, same, same) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")]
        if cfg.attn_res:
            out += [(f"{p}{s}_res.{n}.weight", f"{p}{s}_res_{n}.weight", same, same)
                    for s in ("self_attention", "mlp") for n in ("proj", "norm")]
    return out


def moe_layers(cfg):
    return [i for i, f in enumerate(cfg.ffn_types()) if f == "moe"]


def _expert_prefix(i: int) -> str:
    return f"model.layers.{i}.block_sparse_moe.experts"


def to_k3_state_dict(sd: dict, cfg, dtype=torch.bfloat16, scale_mode: str = "floor",
                     loaded: dict | None = None) -> dict:
    """Our (unsharded) state dict -> K3 checkpoint tensors, prefixed: every non-expert tensor in `dtype` except the
    fp32 ones, routed experts as packed MXFP4 + E8M0 scales quantised with `scale_mode` (canonical bytes, except the
    blocks still exact at the scales they were imported with: `loaded` {MoE layer: {matrix: scales}},
    k3_experts)."""
    check_representable(cfg)
    sd = dict(sd)
    out = {}
    for ours, key, fwd, _ in pairs(cfg):
        t = sd.pop(ours).detach()
        t = fwd(t) if fwd else t
        out[checkpoint_name(key)] = t.to(torch.float32 if is_fp32_key(key) else (dtype or t.dtype)).contiguous()
    for i in moe_layers(cfg):
        w = {n: sd.pop(f"model.layers.{i}.mlp.experts.{n}") for n in ("w1", "w2", "w3")}
        packed = pack_expert_weights(w, _expert_prefix(i), 0, scale_mode, (loaded or {}).get(i))
        out.update({PREFIX + k: v for k, v in packed.items()})
    if sd:
        raise ValueError(f"our keys without a Kimi K3 name: {sorted(sd)[:8]}")
    return out


def from_k3_state_dict(tensors: dict, cfg) -> dict:
    """K3 checkpoint tensors (with or without the `language_model.` prefix; vision tensors skipped for a text-only
    config) -> our
    state dict in fp32. Routed experts may be packed MXFP4 or plain `.weight` matrices. Every text key is
    consumed, or this fails naming what is missing or left over."""
    hf, skipped = {}, 0
    for k, v in tensors.items():
        if k.startswith(PREFIX):
            hf[k[len(PREFIX):]] = v
        elif k.startswith(FOREIGN_PREFIXES) and not cfg.vision.enabled:
            skipped += 1
        else:
            hf[k] = v
    if skipped:
        log.info("Kimi K3 checkpoint: skipped %d vision-tower tensors", skipped)
    out = {}
    for ours, key, _, back in pairs(cfg):
        if key not in hf:
            raise KeyError(f"Kimi K3 checkpoint has no {PREFIX}{key}")
        t = hf.pop(key).to(torch.float32)
        out[ours] = back(t) if back else t
    for i in moe_layers(cfg):
        prefix = _expert_prefix(i)
        if f"{prefix}.0.w1.weight" in hf:  # an unquantised export
            w = {n: torch.stack([hf.pop(f"{prefix}.{e}.{n}.weight").float() for e in range(cfg.num_experts)])
                 for n in ("w1", "w2", "w3")}
        else:
            w = unpack_expert_weights(hf, prefix, cfg.num_experts)
            for n in ("w1", "w2", "w3"):
                for e in range(cfg.num_experts):
                    hf.pop(f"{prefix}.{e}.{n}.weight_packed")
                    hf.pop(f"{prefix}.{e}.{n}.weight_scale")
        expected = {"w1": (cfg.moe_intermediate_size, cfg.expert_width), "w3": (cfg.moe_intermediate_size,
                    cfg.expert_width), "w2": (cfg.expert_width, cfg.moe_intermediate_size)}
        for n, shape in expected.items():
            if tuple(w[n].shape[1:]) != shape:
                raise ValueError(f"{PREFIX}{prefix}.*.{n}: the checkpoint holds {list(w[n].shape[1:])}, the "
                                 f"config says {list(shape)}")
            out[f"model.layers.{i}.mlp.experts.{n}"] = w[n]
    if hf:
        raise ValueError(f"Kimi K3 checkpoint keys left unmapped: {sorted(hf)[:8]}")
    return out


__all__ = ["k3_config_dict", "k3_config_to", "to_k3_state_dict", "from_k3_state_dict", "text_config_of",
           "padded_heads", "is_fp32_key", "PREFIX", "vision_keys", "vision_config_dict", "vision_config_to",
           "checkpoint_name"]
