"""A Hugging Face checkpoint directory: its files, its config.json <-> our ModelConfig, whole-file read and write.

A directory holds `config.json` and the tensors in safetensors only: `model.safetensors`, or, above
`max_shard_size` bytes, `model-0000i-of-0000n.safetensors` shards listed by `model.safetensors.index.json`
({"metadata": {"total_size": bytes}, "weight_map": {tensor name: file}}), as transformers writes them.
Layouts: "kimi_linear" (interop.kimi_linear) and "k3" (interop.k3_layout, routed experts in packed MXFP4), each a
checkpoint family (interop.family).
A model config given to a loader must agree with the checkpoint's config.json on every architectural key;
otherwise ConfigMismatchError lists each differing key with both values.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import RUNTIME_MODEL_KEYS
from ..errors import one_line
from . import k3_layout
from .family import FAMILIES, family

log = logging.getLogger(__name__)

LAYOUTS = tuple(FAMILIES)  # ("kimi_linear", "k3")
CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5_000_000_000  # bytes, transformers' historical default ("5GB")
# What a directory holds besides the model: the tokenizer and chat files an export takes along from the directory the
# run started from (checkpoint.export_hf). generation_config.json is the release's default sampling and stop ids.
TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.json",
                   "generation_config.json")
TOKENIZER_GLOBS = ("tokenization_*.py", "*.jinja")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class CheckpointReadError(ValueError):
    """A Hugging Face directory that does not hold what its config says, or cannot be read: one line,
    `<file>: <tensor>: <what>`."""


class MissingShardError(CheckpointReadError, FileNotFoundError):
    """A file the directory needs (config.json, the index, a shard file the index names) is not there."""


class ConfigMismatchError(ValueError):
    """A checkpoint's config.json disagrees with the model config it was loaded for. `differences` maps each
    differing key to (the given config's value, the checkpoint's value)."""

    def __init__(self, path, differences: dict):
        self.differences = differences
        lines = "; ".join(f"{k}: model {a!r} vs checkpoint {b!r}" for k, (a, b) in differences.items())
        super().__init__(f"{path}/{CONFIG} does not match the model config in {len(differences)} key(s): {lines}")


# ------------------------------------------------------------------------------------------------ configs
def _architecture(cfg) -> dict:
    """The keys of a ModelConfig that define the tensors and the math, in one canonical spelling each."""
    d = dataclasses.asdict(cfg)
    for k in RUNTIME_MODEL_KEYS + ("mla_layers", "mla_every", "mla_at_last", "shared_intermediate_size",
                                  "kda_decay_rank"):
        d.pop(k)
    d["mla_layers"] = [i + 1 for i, t in enumerate(cfg.layer_types()) if t == "mla"]
    d["kda_decay_rank"] = cfg.decay_rank
    d["shared_intermediate_size"] = cfg.shared_ffn_size if cfg.num_shared_experts else 0
    unused = []
    if not cfg.attn_res:
        unused.append("attn_res_block_size")
    if cfg.kda_gate != "lowerbound":
        unused.append("kda_gate_lower_bound")
    if cfg.kda_output_gate != "lowrank":
        unused.append("kda_output_gate_bias")
    if cfg.hidden_act != "situ":
        unused += ["situ_beta_gate", "situ_beta_up"]
    if cfg.first_k_dense >= cfg.num_layers:  # no MoE layer
        unused += ["num_experts", "top_k", "moe_intermediate_size", "moe_latent_size", "moe_latent_norm",
                   "num_shared_experts", "shared_intermediate_size", "routed_scaling_factor", "norm_topk_prob",
                   "router_num_groups", "router_topk_groups"]
    if "mla" not in cfg.layer_types():
        unused += ["mla_num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                   "v_head_dim", "mla_output_gate", "mla_latent_norm_eps"]
    for k in unused:
        d.pop(k, None)
    if not cfg.vision.enabled:
        d["vision"] = {"enabled": False}
    return d


def config_differences(model_cfg, checkpoint_cfg) -> dict:
    """{key: (model value, checkpoint value)} over the architectural keys that differ. A text-only model agrees with
    a vision-language checkpoint's text part: the vision tower is compared only when the model has one."""
    a, b = _architecture(model_cfg), _architecture(checkpoint_cfg)
    if not model_cfg.vision.enabled:
        b["vision"] = a["vision"]
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def detect_layout(config: dict, where=CONFIG) -> str:
    """'k3' or 'kimi_linear' from a config.json (`where`: its path, for the error). K3's text config also says
    model_type 'kimi_linear', so K3 is recognised by its nested text_config, model_type 'kimi_k3', or the K3-only
    keys."""
    if config.get("model_type") == "kimi_k3" or isinstance(config.get("text_config"), dict):
        return "k3"
    if config.get("model_type") == "kimi_linear":
        k3_only = ("routed_expert_hidden_size", "attn_res_block_size", "activation_situ_beta", "latent_moe_use_norm")
        return "k3" if any(config.get(k) is not None for k in k3_only) else "kimi_linear"
    raise ValueError(f"{where}: model_type {config.get('model_type')!r} is neither a Kimi Linear ('kimi_linear') nor "
                     f"a Kimi K3 ('kimi_k3') checkpoint; pass layout= one of {LAYOUTS}")


def config_from_hf(config: dict, layout: str, vision: bool = True):
    """config.json -> our ModelConfig for the given layout; vision=False: the text model (a vision_config ignored)."""
    return family(layout).config_to(config, vision)


def read_config_json(path) -> dict:
    """The config.json of directory `path` as a dict; MissingShardError (a FileNotFoundError) without one,
    CheckpointReadError when it is not a JSON object."""
    f = Path(path) / CONFIG
    if not f.is_file():
        raise MissingShardError(f"{path}: no {CONFIG} (not a Hugging Face directory)")
    try:
        config = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointReadError(f"{f}: not readable as JSON ({one_line(e)})") from None
    if not isinstance(config, dict):
        raise CheckpointReadError(f"{f}: not a JSON object")
    return config


def read_model_config(path, layout: str = "auto", vision: bool | None = None) -> tuple:
    """(our ModelConfig, layout) of the Hugging Face directory `path`, from its config.json. `vision`: True = the
    vision-language model (ValueError without a `vision_config`), False = the text model, None = as the directory
    holds: vision-language where config.json has a `vision_config` and the directory the tower's tensors; a
    `vision_config` without them (NeMo writes one around a text-only K3) gives the text model, with one log line."""
    config = read_config_json(path)
    if layout == "auto":
        layout = detect_layout(config, Path(path) / CONFIG)
    declared = family(layout).declares_vision(config)
    if vision is None and declared:
        vision = any(k.startswith(k3_layout.FOREIGN_PREFIXES) for k in checkpoint_keys(path))
        if not vision:
            log.info("%s: %s has a vision_config but the directory holds no vision-tower tensors: the text model",
                     path, CONFIG)
    if vision and not declared:
        raise ValueError(f"{path}: vision=True but {CONFIG} has no vision_config")
    return config_from_hf(config, layout, bool(vision)), layout


# ------------------------------------------------------------------------------------------------ files
def own_storage(t: torch.Tensor, seen: set) -> torch.Tensor:
    """t, copied if it is a view or shares storage with a tensor already written (safetensors refuses both)."""
    t = t.detach().cpu().contiguous()
    ptr = t.untyped_storage().data_ptr()
    if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    seen.add(t.untyped_storage().data_ptr())
    return t


def write_checkpoint(path, tensors: dict, config: dict, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE):
    """config.json plus the tensors in one file or in shards with an index. Any model*.safetensors and index left in
    the directory by an earlier save are removed first, so the index never names stale files."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in list(path.glob("model*.safetensors")) + [path / INDEX]:
        if old.is_file():
            old.unlink()
    seen = set()
    tensors = {k: own_storage(tensors[k], seen) for k in sorted(tensors)}
    nbytes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    total = sum(nbytes.values())
    shards, size = [[]], 0
    for k in tensors:
        if shards[-1] and size + nbytes[k] > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nbytes[k]
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(tensors, str(path / SINGLE), metadata=meta)
    else:
        weight_map = {}
        for i, keys in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: tensors[k] for k in keys}, str(path / name), metadata=meta)
            weight_map.update(dict.fromkeys(keys, name))
        (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2) + "\n")
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read_checkpoint(path):
    """(config.json as a dict, {name: tensor}) of a Hugging Face directory. Only safetensors are read."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / CONFIG).is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG}")
    config = json.loads((path / CONFIG).read_text())
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        tensors = {}
        for name in sorted(set(weight_map.values())):
            part = load_file(str(path / name))
            missing = [k for k, f in weight_map.items() if f == name and k not in part]
            if missing:
                raise KeyError(f"{path / name} lacks {missing[:4]} that {INDEX} places there")
            tensors.update(part)
    elif (path / SINGLE).is_file():
        tensors = load_file(str(path / SINGLE))
    else:
        raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX} (only safetensors checkpoints are read)")
    return config, tensors


def read_index(path: Path) -> tuple:
    """({tensor name: file name}, the file that lists them) of a directory."""
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointReadError(f"{path / INDEX}: weight_map: not a safetensors index ({e})") from None
        return weight_map, path / INDEX
    if (path / SINGLE).is_file():
        try:
            with safe_open(str(path / SINGLE), framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE), path / SINGLE
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
            raise CheckpointReadError(f"{path / SINGLE}: (header): cannot be read ({one_line(e)})") from None
    raise MissingShardError(f"{path}: neither {SINGLE} nor {INDEX} (only safetensors checkpoints are read)")


def checkpoint_keys(path) -> dict:
    """{tensor name: shard file} of a Hugging Face directory (from its index, or its single file's header)."""
    return read_index(Path(path))[0]


def copy_tokenizer_files(src, dst) -> list:
    """Copy the tokenizer and chat files of Hugging Face directory `src` (TOKENIZER_FILES, TOKENIZER_GLOBS: the
    K3 release's tiktoken.model, tokenizer_config.json, tokenization_kimi.py, chat template, ...) into `dst`, byte
    for byte; returns the names copied (none where `src` has none)."""
    src, dst = Path(src), Path(dst)
    names = sorted({p.name for g in TOKENIZER_GLOBS for p in src.glob(g)} | set(TOKENIZER_FILES))
    names = [n for n in names if (src / n).is_file()]
    for name in names:
        shutil.copyfile(src / name, dst / name)
    return names


def dtype_of(d):
    """A dtype from its name ("bfloat16", "bf16", ...) or as given; None stays None."""
    if d is None or isinstance(d, torch.dtype):
        return d
    try:
        return _DTYPES[str(d)]
    except KeyError:
        raise ValueError(f"dtype {d!r}; valid: {', '.join(_DTYPES)}") from None


def dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


__all__ = ["LAYOUTS", "CONFIG", "SINGLE", "INDEX", "DEFAULT_MAX_SHARD_SIZE", "TOKENIZER_FILES", "TOKENIZER_GLOBS",
           "ConfigMismatchError", "CheckpointReadError", "MissingShardError", "config_differences", "detect_layout",
           "config_from_hf", "read_config_json", "read_model_config", "copy_tokenizer_files",
           "write_checkpoint", "read_checkpoint", "read_index", "checkpoint_keys", "dtype_of", "dtype_name",
           "own_storage"]
