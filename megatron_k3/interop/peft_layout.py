"""LoRA adapters (peft=lora) in the PEFT layout, and merged into a K3 directory.

A PEFT directory holds `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors`, whose tensors are named `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r], <module> the adapted module's name in the K3 checkpoint layout (its weight's name without
`.weight`: `language_model.model.layers.3.self_attn.q_proj`, a routed expert's matrix
`language_model.model.layers.1.block_sparse_moe.experts.5.w1`). The delta is lora_alpha / r * B @ A, as PEFT has it.

`merge_lora(base, adapters, out)` writes a K3 directory with the adapters merged: a dense weight W becomes
W + s B A computed in fp32 and stored in W's dtype; a routed expert's matrix is decoded from MXFP4, merged in fp32 and
encoded to MXFP4 again (floor scales, the release's), the step that adds error against a bf16 merge (docs/peft.md
gives the measured figure). Tensors without an adapter keep their bytes; the shard files keep their names and the
index, and config.json and the tokenizer files are copied.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import k3_layout
from .directory import CONFIG, read_index
from .k3_experts import dequantize_k3_weight, quantize_k3_weight

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "to_peft", "save_peft", "read_peft", "merge_lora"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_EXPERT_ADAPTER = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(w[123])_lora_([AB])")


def _k3_modules(cfg) -> dict:
    """{our module name: its K3 checkpoint name (prefixed)} of every module whose weight the K3 layout names."""
    out = {}
    for ours, key, _, _ in k3_layout.pairs(cfg):
        if ours.endswith(".weight") and key.endswith(".weight"):
            out[ours[:-len(".weight")]] = k3_layout.checkpoint_name(key)[:-len(".weight")]
    return out


def to_peft(adapters: dict, cfg, peft) -> tuple:
    """(adapter_config.json's dict, {PEFT name: tensor}) of our full-size adapters {our parameter name: tensor}
    (a training checkpoint's fp32 masters), for model config `cfg` and PeftConfig `peft`."""
    modules, out, leaves = _k3_modules(cfg), {}, set()
    for name, t in sorted(adapters.items()):
        m = _EXPERT_ADAPTER.fullmatch(name)
        if m:
            layer, n, ab = int(m.group(1)), m.group(2), m.group(3)
            prefix = k3_layout.checkpoint_name(f"model.layers.{layer}.block_sparse_moe.experts")
            for e in range(t.shape[0]):
                out[f"{_PEFT_PREFIX}{prefix}.{e}.{n}.lora_{ab}.weight"] = t[e].contiguous()
            leaves.add(n)
            continue
        module, _, leaf = name.rpartition(".")
        if leaf not in ("lora_A", "lora_B") or module not in modules:
            raise ValueError(f"{name}: not an adapter of a module the K3 layout names")
        out[f"{_PEFT_PREFIX}{modules[module]}.{leaf}.weight"] = t.contiguous()
        leaves.add(modules[module].rsplit(".", 1)[-1])
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": peft.rank, "lora_alpha": peft.alpha,
              "target_modules": sorted(leaves), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "init_lora_weights": True, "use_rslora": False, "modules_to_save": None,
              "base_model_name_or_path": peft.base or None,
              "megatron_k3": {"targets": list(peft.targets), "init": peft.init}}
    return config, out


def save_peft(path, config: dict, tensors: dict) -> Path:
    """Write a PEFT directory atomically (a temporary directory renamed into place)."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().cpu() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def read_peft(path) -> tuple:
    """(adapter_config.json's dict, {module name without the PEFT prefix: (A, B)}) of a PEFT directory."""
    path = Path(path)
    for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / f).is_file():
            raise FileNotFoundError(f"{path / f}: missing (a PEFT directory holds {ADAPTER_CONFIG} and "
                                    f"{ADAPTER_WEIGHTS})")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path / ADAPTER_CONFIG}: peft_type={config.get('peft_type')!r}, only LORA merges")
    pairs = {}
    with safe_open(str(path / ADAPTER_WEIGHTS), framework="pt") as f:
        for k in f.keys():
            m = re.fullmatch(rf"{re.escape(_PEFT_PREFIX)}(.+)\.lora_([AB])\.weight", k)
            if m is None:
                raise ValueError(f"{path / ADAPTER_WEIGHTS}: {k}: not a LoRA tensor name")
            pairs.setdefault(m.group(1), {})[m.group(2)] = f.get_tensor(k)
    bad = sorted(k for k, v in pairs.items() if set(v) != {"A", "B"})
    if bad:
        raise ValueError(f"{path / ADAPTER_WEIGHTS}: {bad[0]}: lora_A or lora_B missing")
    return config, {k: (v["A"], v["B"]) for k, v in pairs.items()}


def _delta(ab: tuple, scale: float) -> torch.Tensor:
    a, b = ab
    return scale * (b.double() @ a.double())


def _merge_file(src: Path, dst: Path, adapters: dict, scale: float, used: set) -> None:
    """One shard file with the adapters of its tensors merged (module docstring)."""
    out = {}
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
        keys = set(f.keys())
        for k in sorted(keys):
            if k.endswith(".weight_scale"):
                continue
            t = f.get_tensor(k)
            module = k[:-len(".weight_packed")] if k.endswith(".weight_packed") else k[:-len(".weight")]
            if module not in adapters:
                out[k] = t
                if k.endswith(".weight_packed"):
                    out[module + ".weight_scale"] = f.get_tensor(module + ".weight_scale")
                continue
            used.add(module)
            if k.endswith(".weight_packed"):
                w = dequantize_k3_weight(t, f.get_tensor(module + ".weight_scale"), torch.float64)
                merged = (w + _delta(adapters[module], scale)).float()
                out[k], out[module + ".weight_scale"] = quantize_k3_weight(merged)
            else:
                out[k] = (t.double() + _delta(adapters[module], scale)).to(t.dtype)
    save_file(out, str(dst), metadata=meta)


def merge_lora(base, adapters_dir, out) -> Path:
    """A K3 directory `out`: `base` (a K3 directory, MXFP4 experts) with the PEFT adapters of `adapters_dir`
    merged (module docstring). Every adapter must name a tensor of the base."""
    base, out = Path(base), Path(out)
    config, adapters = read_peft(adapters_dir)
    scale = float(config["lora_alpha"]) / int(config["r"])
    weight_map, index_file = read_index(base)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    used = set()
    for file in sorted(set(weight_map.values())):
        _merge_file(base / file, tmp / file, adapters, scale, used)
    unused = sorted(set(adapters) - used)
    if unused:
        shutil.rmtree(tmp)
        raise ValueError(f"{adapters_dir}: {unused[0]}: names no tensor of {base} ({len(unused)} such adapters)")
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, tmp / f.name)  # config.json, the index, the tokenizer and chat files
    if not (tmp / CONFIG).is_file() or not (tmp / index_file.name).is_file():
        raise FileNotFoundError(f"{base}: {CONFIG} or {index_file.name} missing")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
