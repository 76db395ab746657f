"""The checkpoint families we read and write, one object each: what differs between a Kimi K3 directory (the
released layout: the text model under `language_model.`, A_log zero-padded to a multiple of 128 heads, routed
experts in packed MXFP4, a vision tower beside it) and a Kimi Linear one (transformers' naming, A_log as
[1, 1, H, 1], dense experts). `family(layout)` is the one place a layout name becomes its family; the readers and
writers (hf.py, sharded_load.py, sharded_save.py) ask the family instead of comparing names.
"""

from __future__ import annotations

import re

import torch

from . import k3_layout, kimi_linear

__all__ = ["CheckpointFamily", "K3", "KIMI_LINEAR", "FAMILIES", "family"]


class CheckpointFamily:
    """A checkpoint layout. `pairs(cfg)`: (our name, its name in the directory without `prefix`, ours -> theirs,
    theirs -> ours) for every non-expert tensor; `moe_layers(cfg)`: the layers with routed experts."""

    name: str
    prefix: str = ""  # before the text model's tensor names in the directory
    a_log: str = "same"  # how A_log is stored: "padded_heads" (K3) or "heads_4d" (Kimi Linear)
    quantised_experts: bool = False  # routed experts written as packed MXFP4 and E8M0 scales
    default_dtype: torch.dtype | None = None  # the non-expert tensors' dtype when none is asked for

    def pairs(self, cfg) -> list:
        raise NotImplementedError

    def moe_layers(self, cfg) -> list:
        return [i for i, f in enumerate(cfg.ffn_types()) if f == "moe"]

    def config_to(self, config: dict, vision: bool = True):
        """config.json -> our ModelConfig; vision=False: the text model (a vision_config ignored)."""
        raise NotImplementedError

    def config_dict(self, cfg, dtype: torch.dtype) -> dict:
        """Our ModelConfig -> config.json, its tensors stored in `dtype`."""
        raise NotImplementedError

    def check_writable(self, cfg) -> None:
        """Raise ConfigError (or ValueError) for a config this layout cannot express."""

    def tensors_of(self, sd: dict, cfg, dtype: torch.dtype | None, scale_mode: str, loaded: dict) -> dict:
        """Our whole (unsharded) state dict as the directory's tensors, non-expert ones in `dtype` (the fp32 ones
        kept fp32); routed experts quantised with `scale_mode`, blocks still exact at their imported scales
        (`loaded` {MoE layer: {matrix: scales}}) kept as they were, where the family stores them quantised."""
        raise NotImplementedError

    def checkpoint_name(self, key: str) -> str:
        """A key of `pairs` (or a routed expert's) as the directory names it, the prefix included."""
        return key

    def out_dtype(self, key: str, dtype: torch.dtype, asked: torch.dtype | None) -> torch.dtype:
        """The dtype checkpoint tensor `key` (dtype `dtype` after the name mapping) is written in, `asked` given."""
        return dtype if k3_layout.is_fp32_key(key) or asked is None else asked

    def reads_vision(self, cfg) -> bool:
        """Whether the vision tower's tensors (vision_tower., mm_projector.) are read for a model of `cfg` (else a
        reader skips them)."""
        return False

    def declares_vision(self, config: dict) -> bool:
        """Whether config.json describes a vision tower."""
        return False

    def plain_names(self, cfg, actual: dict) -> dict:
        """{our name: (its checkpoint name without the prefix, how it is stored: "same" or `a_log`)}."""
        return {ours: (key, self.a_log if ours.endswith(".A_log") else "same") for ours, key, _, _ in self.pairs(cfg)}

    def naming_problem(self, actual: dict) -> str | None:
        """Why a directory with these names cannot be read in slices, or None."""
        return None

    def expert_form(self, expert_prefix: str, actual: dict) -> str:
        """"mxfp4" (packed weights and scales) or "dense" (one `.weight` per expert matrix)."""
        return "dense"


class _K3(CheckpointFamily):
    name = "k3"
    prefix = k3_layout.PREFIX
    a_log = "padded_heads"
    quantised_experts = True
    default_dtype = torch.bfloat16

    def pairs(self, cfg) -> list:
        return k3_layout.pairs(cfg)

    def config_to(self, config: dict, vision: bool = True):
        return k3_layout.k3_config_to(config, vision)

    def config_dict(self, cfg, dtype: torch.dtype) -> dict:
        return k3_layout.k3_config_dict(cfg, str(dtype).replace("torch.", ""))

    def check_writable(self, cfg) -> None:
        k3_layout.check_representable(cfg)

    def checkpoint_name(self, key: str) -> str:
        return k3_layout.checkpoint_name(key)

    def tensors_of(self, sd: dict, cfg, dtype: torch.dtype | None, scale_mode: str, loaded: dict) -> dict:
        return k3_layout.to_k3_state_dict(sd, cfg, dtype, scale_mode, loaded)

    def out_dtype(self, key: str, dtype: torch.dtype, asked: torch.dtype | None) -> torch.dtype:
        return torch.float32 if k3_layout.is_fp32_key(key) else (asked or dtype)

    def reads_vision(self, cfg) -> bool:
        return cfg.vision.enabled

    def declares_vision(self, config: dict) -> bool:
        return isinstance(config.get("vision_config"), dict)

    def expert_form(self, expert_prefix: str, actual: dict) -> str:
        return "dense" if f"{expert_prefix}.0.w1.weight" in actual else "mxfp4"


class _KimiLinear(CheckpointFamily):
    name = "kimi_linear"
    a_log = "heads_4d"

    def pairs(self, cfg) -> list:
        return kimi_linear.pairs(cfg)

    def config_to(self, config: dict, vision: bool = True):
        return kimi_linear.hf_config_to(config)  # Kimi Linear has no vision tower

    def config_dict(self, cfg, dtype: torch.dtype) -> dict:
        return dict(kimi_linear.hf_config_dict(cfg), dtype=str(dtype).replace("torch.", ""))

    def check_writable(self, cfg) -> None:
        kimi_linear.hf_config_from(cfg)

    def tensors_of(self, sd: dict, cfg, dtype: torch.dtype | None, scale_mode: str, loaded: dict) -> dict:
        tensors = kimi_linear.to_hf_state_dict(sd, cfg)
        if dtype is None:
            return tensors
        return {k: v if k3_layout.is_fp32_key(k) else v.to(dtype) for k, v in tensors.items()}

    def plain_names(self, cfg, actual: dict) -> dict:
        out = super().plain_names(cfg, actual)
        for ours, (key, kind) in out.items():
            quirk = re.sub(r"\.mlp\.(gate_proj|up_proj|down_proj)\.", r".block_sparse_moe.\1.", key)
            if key not in actual and quirk != key and quirk in actual:
                out[ours] = (quirk, kind)  # transformers 5.x writes a dense layer's MLP under block_sparse_moe.
        return out

    def naming_problem(self, actual: dict) -> str | None:
        if kimi_linear.is_runtime_naming(actual):
            return ("transformers' in-memory naming (fused conv1d.weight / experts.gate_up_proj) is not read in "
                    "slices; load_hf reads it whole")
        return None


K3, KIMI_LINEAR = _K3(), _KimiLinear()
FAMILIES = {f.name: f for f in (KIMI_LINEAR, K3)}


def family(layout: str) -> CheckpointFamily:
    """The family of a layout name ("k3", "kimi_linear"); ValueError naming the valid ones otherwise."""
    try:
        return FAMILIES[layout]
    except KeyError:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(FAMILIES)}") from None
