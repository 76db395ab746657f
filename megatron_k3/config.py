"""Typed configuration schemas and the loader that composes `conf/model/<name>.yaml` onto them.

YAML files only set values; the dataclasses here define every key, its type and its validation.
A mistake fails with `ConfigError`, one line naming the key, the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key, the value and what is valid."""

    def __init__(self, key: str, value, valid: str):
        self.key, self.value, self.valid = key, value, valid
        super().__init__(f"invalid config: {key}={value!r}: {valid}")


@dataclass
class ModelConfig:
    """Every architectural knob of the K3 / Kimi Linear family.

    The same code expresses K3 (AttnRes, SiTU, latent MoE, lower-bound KDA gate, full-rank output gate,
    gated MLA) and Kimi Linear (ordinary residuals, SwiGLU, no latent projection, softplus gate, low-rank
    output gate, ungated MLA) through these switches.
    """

    name: str = "custom"
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_layers: int = 93
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    # ---- layer schedule: which layers are Gated MLA (1-based, as in checkpoints' `full_attn_layers`)
    # If `mla_layers` is empty, MLA sits at every `mla_every`-th layer and, if `mla_at_last`, at the last.
    mla_layers: list = field(default_factory=list)
    mla_every: int = 4
    mla_at_last: bool = True
    first_k_dense: int = 1  # layers [0, first_k_dense) use the dense FFN, the rest MoE

    # ---- Kimi Delta Attention
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_gate: str = "lowerbound"  # "lowerbound" (K3: lb * sigmoid(e^A (z + dt))) or "softplus" (Kimi Linear)
    kda_gate_lower_bound: float = -5.0
    kda_decay_rank: int = 0  # rank of the low-rank decay projection; 0 = kda_head_dim
    kda_output_gate: str = "full"  # "full" (K3) or "lowrank" (Kimi Linear)
    kda_output_gate_bias: bool = False  # bias on the low-rank gate's up projection
    kda_chunk_size: int = 64
    kda_a_log_init: str = "zero"  # "zero" (from-scratch K3 recommendation) or "uniform_1_16" (fla / Kimi Linear)

    # ---- Gated MLA (NoPE)
    mla_num_heads: int = 96
    q_lora_rank: int = 1536  # 0: a direct q projection (Kimi Linear)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # the unrotated, head-shared key part
    v_head_dim: int = 128
    mla_output_gate: bool = True
    mla_latent_norm_eps: float = 1e-5  # eps of q_a / kv_a layernorms (HF Kimi Linear uses 1e-6)

    # ---- FFN activation
    hidden_act: str = "situ"  # "situ" (K3) or "silu" (SwiGLU)
    situ_beta_gate: float = 4.0
    situ_beta_up: float = 25.0
    dense_intermediate_size: int = 33792

    # ---- Stable LatentMoE
    num_experts: int = 896
    top_k: int = 16
    moe_intermediate_size: int = 3072
    moe_latent_size: int = 3584  # 0: experts run at full width (no latent projection)
    moe_latent_norm: bool = True  # RMSNorm on the combined latent before the up projection
    num_shared_experts: int = 2
    shared_intermediate_size: int = 0  # 0: moe_intermediate_size * num_shared_experts
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    router_num_groups: int = 1
    router_topk_groups: int = 1
    router_force_balanced: bool = False  # debug knob: round-robin routing, for throughput ceilings

    # ---- Block Attention Residuals
    attn_res: bool = True
    attn_res_block_size: int = 12  # decoder layers per block

    # ------------------------------------------------------------------ derived
    def mla_layer_set(self) -> set:
        """0-based indices of the Gated MLA layers."""
        if self.mla_layers:
            return {int(i) - 1 for i in self.mla_layers}
        out = {i - 1 for i in range(self.mla_every, self.num_layers + 1, self.mla_every)} if self.mla_every else set()
        if self.mla_at_last:
            out.add(self.num_layers - 1)
        return out

    def layer_types(self) -> list:
        mla = self.mla_layer_set()
        return ["mla" if i in mla else "kda" for i in range(self.num_layers)]

    def ffn_types(self) -> list:
        return ["dense" if i < self.first_k_dense else "moe" for i in range(self.num_layers)]

    @property
    def shared_ffn_size(self) -> int:
        return self.shared_intermediate_size or self.moe_intermediate_size * self.num_shared_experts

    @property
    def decay_rank(self) -> int:
        return self.kda_decay_rank or self.kda_head_dim

    @property
    def expert_width(self) -> int:
        """Width at which routed experts run: the latent size, or the hidden size without latent MoE."""
        return self.moe_latent_size or self.hidden_size

    @property
    def num_attn_res_blocks(self) -> int:
        return -(-self.num_layers // self.attn_res_block_size)

    # ------------------------------------------------------------------ validation
    def validate(self, prefix: str = "model") -> "ModelConfig":
        def key(k):
            return f"{prefix}.{k}" if prefix else k

        positive = [
            "vocab_size", "hidden_size", "num_layers", "kda_num_heads", "kda_head_dim", "kda_conv_size",
            "kda_chunk_size", "mla_num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
            "dense_intermediate_size", "attn_res_block_size", "router_num_groups", "router_topk_groups",
        ]
        for k in positive:
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(key(k), v, "must be a positive integer")
        non_negative = ["q_lora_rank", "qk_rope_head_dim", "kda_decay_rank", "moe_latent_size",
                        "num_shared_experts", "shared_intermediate_size", "first_k_dense", "mla_every"]
        for k in non_negative:
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(key(k), v, "must be an integer >= 0")
        if self.rms_norm_eps <= 0:
            raise ConfigError(key("rms_norm_eps"), self.rms_norm_eps, "must be > 0")
        if self.kda_gate not in ("lowerbound", "softplus"):
            raise ConfigError(key("kda_gate"), self.kda_gate, "valid: 'lowerbound' or 'softplus'")
        if self.kda_gate == "lowerbound" and not (-5.0 <= self.kda_gate_lower_bound < 0):
            raise ConfigError(key("kda_gate_lower_bound"), self.kda_gate_lower_bound, "must lie in [-5, 0)")
        if self.kda_output_gate not in ("full", "lowrank"):
            raise ConfigError(key("kda_output_gate"), self.kda_output_gate, "valid: 'full' or 'lowrank'")
        if self.kda_a_log_init not in ("zero", "uniform_1_16"):
            raise ConfigError(key("kda_a_log_init"), self.kda_a_log_init, "valid: 'zero' or 'uniform_1_16'")
        if self.hidden_act not in ("situ", "silu"):
            raise ConfigError(key("hidden_act"), self.hidden_act, "valid: 'situ' or 'silu'")
        bad = [i for i in self.mla_layers if not (1 <= int(i) <= self.num_layers)]
        if bad:
            raise ConfigError(key("mla_layers"), list(self.mla_layers),
                              f"1-based layer numbers in [1, {self.num_layers}]")
        if self.first_k_dense > self.num_layers:
            raise ConfigError(key("first_k_dense"), self.first_k_dense, f"must be <= num_layers={self.num_layers}")
        if self.first_k_dense < self.num_layers:  # there are MoE layers
            if self.num_experts <= 0:
                raise ConfigError(key("num_experts"), self.num_experts, "must be a positive integer")
            if not (1 <= self.top_k <= self.num_experts):
                raise ConfigError(key("top_k"), self.top_k, f"must be in [1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size <= 0:
                raise ConfigError(key("moe_intermediate_size"), self.moe_intermediate_size, "must be > 0")
            if self.num_experts % self.router_num_groups:
                raise ConfigError(key("router_num_groups"), self.router_num_groups,
                                  f"must divide num_experts={self.num_experts}")
            if self.router_topk_groups > self.router_num_groups:
                raise ConfigError(key("router_topk_groups"), self.router_topk_groups,
                                  f"must be <= router_num_groups={self.router_num_groups}")
            per_group = self.num_experts // self.router_num_groups
            if self.router_num_groups > 1 and self.top_k > self.router_topk_groups * per_group:
                raise ConfigError(key("top_k"), self.top_k,
                                  f"must be <= router_topk_groups * experts per group = "
                                  f"{self.router_topk_groups * per_group}")
        return self


def _apply_overrides(cfg, overrides: Iterable[str], prefix: str):
    from omegaconf import OmegaConf

    dotlist = []
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(ov, None, "an override must look like key=value")
        k, v = ov.split("=", 1)
        k = k.lstrip("+")
        if k.startswith(prefix + "."):
            k = k[len(prefix) + 1:]
        dotlist.append(f"{k}={v}")
    if dotlist:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist))
        except Exception as e:  # omegaconf raises several types; give one clear line
            raise ConfigError(_omegaconf_key(e, prefix), _omegaconf_value(e), _first_line(e)) from None
    return cfg


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _omegaconf_key(e, prefix):
    k = getattr(e, "full_key", None) or getattr(e, "key", None) or "?"
    return f"{prefix}.{k}" if prefix and not str(k).startswith(prefix) else str(k)


def _omegaconf_value(e):
    return getattr(e, "value", None)


def available_models() -> list:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def model_config_from_dict(d: dict, prefix: str = "model") -> ModelConfig:
    """Build and validate a ModelConfig from a plain mapping (e.g. a Hydra-composed `cfg.model`)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}", d[unknown[0]], "unknown key for the model config")
    cfg = ModelConfig(**{k: (list(v) if k == "mla_layers" else v) for k, v in d.items()})
    return cfg.validate(prefix)


def load_model_config(name: str, overrides: Iterable[str] = ()) -> ModelConfig:
    """Compose `conf/model/<name>.yaml` onto the ModelConfig schema, apply `key=value` overrides
    (with or without a leading `model.`), validate, and return the dataclass. Starts no run."""
    from omegaconf import OmegaConf

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError("model", name, f"no file {path}; available: {', '.join(available_models())}")
    schema = OmegaConf.structured(ModelConfig)
    try:
        cfg = OmegaConf.merge(schema, OmegaConf.load(path))
    except Exception as e:
        raise ConfigError(_omegaconf_key(e, "model"), _omegaconf_value(e), f"{_first_line(e)} (in {path})") from None
    cfg = _apply_overrides(cfg, overrides, "model")
    return model_config_from_dict(OmegaConf.to_container(cfg, resolve=True))


def replace(cfg: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(cfg, **changes).validate()


__all__ = ["ModelConfig", "ConfigError", "load_model_config", "model_config_from_dict", "available_models",
           "CONF_DIR", "replace"]
