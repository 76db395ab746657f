"""LoRA adapters (peft=lora) in the PEFT layout, and merged into a K3 directory.

A PEFT directory holds `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors`, whose tensors are named `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r], <module> the adapted module's name in the K3 checkpoint layout (its weight's name without
`.weight`: `language_model.model.layers.3.self_attn.q_proj`, a routed expert's matrix
`language_model.model.layers.1.block_sparse_moe.experts.5.w1`). The delta is lora_alpha / r * B @ A, as PEFT has it.
Trainable token rows (peft.trainable_tokens) are PEFT's trainable tokens: `trainable_token_indices` in the config
({"embed_tokens": ids, "lm_head": ids}) and `base_model.model.<module>.token_adapter.trainable_tokens_delta` [n, hidden]
holding the rows' new values (PEFT's convention: the base row plus what training added), so writing them needs the
base's rows (`base_rows`).

`merge_lora(base, adapters, out)` writes a K3 directory with the adapters merged: a dense weight W becomes
W + s B A computed in fp32 and stored in W's dtype; a routed expert's matrix is decoded from MXFP4, merged in fp32 and
encoded to MXFP4 again (floor scales, the release's), the step that adds error against a bf16 merge (docs/peft.md
gives the measured figure); trained token rows replace their rows (before a LoRA term of the same weight is added,
the order the adapted model computes in). Tensors without an adapter keep their bytes; the shard files keep their
names and the index, and config.json and the tokenizer files are copied.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config.schema import token_ids
from . import k3_layout
from .directory import CONFIG, read_index
from .k3_experts import dequantize_k3_weight, quantize_k3_weight

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "to_peft", "save_peft", "read_peft", "merge_lora", "base_rows"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_EXPERT_ADAPTER = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(w[123])_lora_([AB])")
_TOKENS = ".token_adapter.trainable_tokens_delta"
_DELTA = ".token_delta"  # megatron_k3.peft.tokens.DELTA


def _k3_modules(cfg) -> dict:
    """{our module name: its K3 checkpoint name (prefixed)} of every module whose weight the K3 layout names."""
    out = {}
    for ours, key, _, _ in k3_layout.pairs(cfg):
        if ours.endswith(".weight") and key.endswith(".weight"):
            out[ours[:-len(".weight")]] = k3_layout.checkpoint_name(key)[:-len(".weight")]
    return out


def base_rows(base, cfg, modules: list, ids: list) -> dict:
    """{our module name: its rows `ids` in the K3 directory `base`} of the given modules' weights (the embedding, the
    LM head), in fp32."""
    k3, out = _k3_modules(cfg), {}
    weight_map, _ = read_index(Path(base))
    for module in modules:
        key = k3[module] + ".weight"
        if key not in weight_map:
            raise ValueError(f"{base}: has no {key} (the base of the trained token rows of {module})")
        with safe_open(str(Path(base) / weight_map[key]), framework="pt") as f:
            out[module] = f.get_tensor(key)[torch.tensor(ids)].float()
    return out


def _token_rows(name: str, t, modules: dict, rows: dict, ids: list, out: dict, indices: dict) -> None:
    module = name[:-len(_DELTA)]
    if module not in rows:
        raise ValueError(f"{name}: trained token rows need their base rows (base_rows), none given for {module}")
    if not ids or len(ids) != t.shape[0]:
        raise ValueError(f"{name}: {t.shape[0]} rows, but peft.trainable_tokens names {len(ids)} ids")
    out[f"{_PEFT_PREFIX}{modules[module]}{_TOKENS}"] = (rows[module] + t.float()).contiguous()
    indices[modules[module].rsplit(".", 1)[-1]] = list(ids)


def to_peft(adapters: dict, cfg, peft, rows: dict | None = None) -> tuple:
    """(adapter_config.json's dict, {PEFT name: tensor}) of our full-size adapters {our parameter name: tensor}
    (a training checkpoint's fp32 masters), for model config `cfg` and PeftConfig `peft`; `rows`: `base_rows` of
    the modules with trained token rows (their values are written as the base's plus the trained delta)."""
    modules, out, leaves, indices = _k3_modules(cfg), {}, set(), {}
    ids = token_ids(getattr(peft, "trainable_tokens", ()))
    for name, t in sorted(adapters.items()):
        if name.endswith(_DELTA):
            _token_rows(name, t, modules, rows or {}, ids, out, indices)
            continue
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
              "trainable_token_indices": indices or None,
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
    """(adapter_config.json's dict, {module name without the PEFT prefix: (A, B)}, {module: (ids, rows' values)} of
    its trainable tokens) of a PEFT directory."""
    path = Path(path)
    for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / f).is_file():
            raise FileNotFoundError(f"{path / f}: missing (a PEFT directory holds {ADAPTER_CONFIG} and "
                                    f"{ADAPTER_WEIGHTS})")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path / ADAPTER_CONFIG}: peft_type={config.get('peft_type')!r}, only LORA merges")
    pairs, tokens = {}, {}
    with safe_open(str(path / ADAPTER_WEIGHTS), framework="pt") as f:
        for k in f.keys():
            if k.startswith(_PEFT_PREFIX) and k.endswith(_TOKENS):
                module = k[len(_PEFT_PREFIX):-len(_TOKENS)]
                tokens[module] = (_indices(config, module, path), f.get_tensor(k))
                continue
            m = re.fullmatch(rf"{re.escape(_PEFT_PREFIX)}(.+)\.lora_([AB])\.weight", k)
            if m is None:
                raise ValueError(f"{path / ADAPTER_WEIGHTS}: {k}: not a LoRA tensor name")
            pairs.setdefault(m.group(1), {})[m.group(2)] = f.get_tensor(k)
    bad = sorted(k for k, v in pairs.items() if set(v) != {"A", "B"})
    if bad:
        raise ValueError(f"{path / ADAPTER_WEIGHTS}: {bad[0]}: lora_A or lora_B missing")
    return config, {k: (v["A"], v["B"]) for k, v in pairs.items()}, tokens


def _indices(config: dict, module: str, path: Path) -> torch.Tensor:
    """The token ids of a module's trainable tokens in adapter_config.json (a dict by module name, or PEFT's list
    form: the embedding's)."""
    spec = config.get("trainable_token_indices")
    leaf = module.rsplit(".", 1)[-1]
    ids = spec.get(leaf, spec.get(module)) if isinstance(spec, dict) else spec if leaf == "embed_tokens" else None
    if not ids:
        raise ValueError(f"{path / ADAPTER_CONFIG}: trainable_token_indices names no ids for {module}")
    return torch.tensor(ids, dtype=torch.long)


def _delta(ab: tuple, scale: float) -> torch.Tensor:
    a, b = ab
    return scale * (b.double() @ a.double())


def _merge_file(src: Path, dst: Path, adapters: dict, tokens: dict, scale: float, used: set) -> None:
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
            if module in tokens and k.endswith(".weight"):
                used.add(module)
                ids, values = tokens[module]
                t = t.clone()
                t[ids] = values.to(t.dtype)
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
    config, adapters, tokens = read_peft(adapters_dir)
    scale = float(config["lora_alpha"]) / int(config["r"])
    weight_map, index_file = read_index(base)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    used = set()
    for file in sorted(set(weight_map.values())):
        _merge_file(base / file, tmp / file, adapters, tokens, scale, used)
    unused = sorted((set(adapters) | set(tokens)) - used)
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
