#!/usr/bin/env python
"""Convert megatron-k3 checkpoints: a format-2 training checkpoint (full size per tensor-parallel shard, written
before the sharded format) into the current format, or to / from the Hugging Face layouts (offline, no processes).
The one converter of the project.

    python tools/convert_checkpoint.py SRC DST
    python tools/convert_checkpoint.py SRC OUT_DIR --to-hf [--layout k3|kimi_linear] [--dtype bfloat16|float32]
                                       [--max-shard-size BYTES] [model=NAME model.KEY=VALUE ...]
    python tools/convert_checkpoint.py HF_DIR DST --from-hf [--layout auto|k3|kimi_linear]
    python tools/convert_checkpoint.py SRC OUT_DIR --to-peft
    python tools/convert_checkpoint.py K3_DIR OUT_DIR --merge-lora ADAPTER_DIR

Without --to-hf/--from-hf: SRC is a format-2 checkpoint; DST gets it in the sharded format (one writer), with its
weights, optimizer states, scalars and RNG states, which any layout then loads (`checkpoint.load=DST`). A checkpoint
in the current format needs no conversion: the Trainer reshards it on load, to any tensor, pipeline, expert, data
parallel size and ZeRO stage.

--to-hf: SRC is a training checkpoint (its fp32 master weights, any layout, merged; the model config comes from its
meta.json), or our unsharded weights as one safetensors file (or a directory holding `model.safetensors`) with the
model named by `model=NAME` and overrides; OUT_DIR gets config.json and the tensors, sharded with an index above
--max-shard-size (megatron_k3.interop.hf). --from-hf: DST gets a checkpoint at step 0 holding the Hugging Face
model's weights (fp32) and its model config, and no optimizer states, which `checkpoint.load=DST` starts a run
from (fine-tuning).

--to-peft: SRC is a peft=lora training checkpoint (adapters only, any layout); OUT_DIR gets them in the PEFT layout
(adapter_config.json, adapter_model.safetensors), named as the K3 checkpoint names the modules they adapt.
--merge-lora ADAPTER_DIR: SRC is the K3 directory the adapters were trained over; OUT_DIR gets it with the adapters
merged (routed experts decoded, merged and encoded to MXFP4 again; megatron_k3.interop.peft_layout).

SRC: a checkpoint (`.../checkpoints/step_00000100`) or a checkpoint directory (its newest complete checkpoint).
DST: the checkpoint directory to write into; the result is DST/step_<same step>, committed atomically with
`latest` updated.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dataclasses  # noqa: E402

import torch  # noqa: E402

from megatron_k3.config import ConfigError, ModelConfig, PeftConfig, load_model_config  # noqa: E402
from megatron_k3.config.schema import token_ids  # noqa: E402
from megatron_k3.interop import (  # noqa: E402
    load_hf,
    peft_layout,  # noqa: E402
    save_hf,
)
from megatron_k3.model import causal_lm_class  # noqa: E402
from megatron_k3.training import checkpoint as ckpt  # noqa: E402
from megatron_k3.training.checkpoint import legacy  # noqa: E402


def convert(src: str | Path, dst: str | Path) -> Path:
    """SRC (a format-2 checkpoint) in the current format under DST; returns the new checkpoint's path."""
    path = ckpt.resolve_load_path(str(src), Path(src))
    meta = ckpt.read_meta(path, legacy=True)
    if meta.get("format_version") == ckpt.FORMAT_VERSION:
        raise ValueError(f"{path} is already in format {ckpt.FORMAT_VERSION}: any layout loads it as it is")
    model, optim, extra = legacy.read_legacy(path, meta)
    rngs = ckpt.load_pickle_safely(path / "rng.pt")["ranks"] if (path / "rng.pt").is_file() else None
    out = {k: v for k, v in meta.items() if k not in ("format_version", "saved_at", "complete", "tp_split_dims")}
    out.update(converted_from=str(path))
    return ckpt.save_checkpoint(dst, int(meta["step"]), model, optim, extra.get("optimizer_scalars", {}), out, rngs)


def _weights(src: Path, overrides: list):
    """(model config, tensors) of SRC: a training checkpoint (config from meta.json), or an unsharded weights file
    (config from model=NAME and model.KEY=VALUE overrides)."""
    if src.is_file() or (src / "model.safetensors").is_file() and not (src / "meta.json").is_file():
        name = next((a.split("=", 1)[1] for a in overrides if a.startswith("model=")), None)
        if name is None:
            raise ValueError(f"{src} is a weights file, not a training checkpoint: name its model with model=NAME")
        cfg = load_model_config(name, [a for a in overrides if not a.startswith("model=")])
        return cfg, ckpt.load_tensors(src if src.is_file() else src / "model.safetensors")
    if overrides:
        raise ValueError(f"{src} is a training checkpoint, whose meta.json names its model: drop {overrides}")
    path = ckpt.resolve_load_path(str(src), src)
    model, _, meta = ckpt.read_full(path, states=False)
    if "peft" in meta:
        raise ValueError(f"{path} is a peft=lora checkpoint (adapters only): write them with --to-peft, then merge "
                         "them into their base with --merge-lora")
    return ModelConfig(**meta["model"]), model


def to_peft(src: str | Path, out: str | Path) -> Path:
    """A peft=lora training checkpoint's adapters (any layout, merged to full size) as a PEFT directory."""
    path = ckpt.resolve_load_path(str(src), Path(src))
    tensors, _, meta = ckpt.read_full(path, states=False)
    if "peft" not in meta:
        raise ValueError(f"{path}: not a peft=lora checkpoint (its meta.json has no peft entry)")
    cfg, peft = ModelConfig(**meta["model"]), PeftConfig(**meta["peft"])
    rows = [n[:-len(".token_delta")] for n in tensors if n.endswith(".token_delta")]
    if rows and not peft.base:
        raise ValueError(f"{path}: its trained token rows (peft.trainable_tokens) are written as the base's rows plus "
                         "the delta, and its meta.json records no base directory (the run used the initialised model)")
    rows = peft_layout.base_rows(peft.base, cfg, rows, token_ids(peft.trainable_tokens)) if rows else {}
    config, adapters = peft_layout.to_peft(tensors, cfg, peft, rows)
    return peft_layout.save_peft(out, config, adapters)


def to_hf(src: str | Path, out: str | Path, layout: str = "k3", dtype: str | None = None,
          max_shard_size: int | None = None, overrides: list = ()) -> Path:
    """SRC's weights (a training checkpoint in any layout, or an unsharded weights file) as a Hugging Face
    directory (a vision-language model with its tower and projector)."""
    cfg, tensors = _weights(Path(src), list(overrides))
    model = causal_lm_class(cfg)(cfg, init=False)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if k in dict(model.named_parameters())]
    if missing or unexpected:
        raise ckpt.CheckpointError(f"{src}: does not match its model config (missing {missing[:5]}, "
                                   f"unexpected {unexpected[:5]})")
    kwargs = {"dtype": getattr(torch, dtype)} if dtype else {}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    return Path(save_hf(model, out, layout=layout, **kwargs))


def from_hf(hf_dir: str | Path, dst: str | Path, layout: str = "auto") -> Path:
    """A Hugging Face directory as a step-0 training checkpoint (weights, no optimizer states)."""
    model = load_hf(hf_dir, layout=layout)
    named = dict(model.named_parameters())
    tensors = {k: v.detach().to(torch.float32 if k in named else v.dtype).contiguous()
               for k, v in model.state_dict().items()}
    meta = {"step": 0, "consumed_samples": 0, "tokens": 0, "tensor_parallel": 1, "pipeline_parallel": 1,
            "model": dataclasses.asdict(model.cfg), "converted_from": str(hf_dir)}
    return ckpt.save_checkpoint(dst, 0, tensors, {}, {}, meta)


EXAMPLES = """examples:
  # an old (format 2) training checkpoint in the sharded format; any layout then loads it
  python tools/convert_checkpoint.py runs/old/checkpoints runs/new/checkpoints
  # a training checkpoint (any TP/PP/EP/DP layout) as the released K3 layout (MXFP4 experts, bf16 elsewhere)
  python tools/convert_checkpoint.py runs/my_run/checkpoints /out/k3-ft --to-hf
  # ... or as a Kimi Linear directory that transformers loads, in fp32
  python tools/convert_checkpoint.py runs/kl/checkpoints /out/kl --to-hf --layout kimi_linear --dtype float32
  # our unsharded weights file, its model named
  python tools/convert_checkpoint.py weights.safetensors /out/hf --to-hf model=k3_tiny model.num_layers=2
  # a Hugging Face directory as a step-0 checkpoint (weights only), then a run from it
  python tools/convert_checkpoint.py /ckpt/kimi-linear runs/ft/checkpoints --from-hf
  python -m megatron_k3.train model=kimi_linear_48b checkpoint.load=runs/ft/checkpoints
  # a peft=lora run's adapters as a PEFT directory, and merged into the K3 directory they were trained over
  python tools/convert_checkpoint.py runs/lora/checkpoints /out/k3-lora-adapters --to-peft
  python tools/convert_checkpoint.py /ckpt/k3 /out/k3-merged --merge-lora /out/k3-lora-adapters

exit status: 0 done (the path written is printed), 2 a bad argument or input (one line naming it)."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="a checkpoint, a checkpoint directory (its newest), a weights file, or (--from-hf) a "
                                "Hugging Face directory")
    ap.add_argument("dst", help="the checkpoint directory to write into (the result: DST/step_<step>), or (--to-hf) "
                                "the Hugging Face directory to write")
    ap.add_argument("--to-hf", action="store_true", help="write DST as a Hugging Face directory (the fp32 master "
                    "weights of any layout, merged; no optimizer states)")
    ap.add_argument("--from-hf", action="store_true", help="read SRC as a Hugging Face directory: DST is a checkpoint "
                    "at step 0 with the weights only; the step resets to 0 and there are no optimizer states, so a "
                    "run loading it starts the LR schedule and the optimizer afresh (checkpoint.load=HF_DIR streams "
                    "the same weights into a run without converting)")
    ap.add_argument("--to-peft", action="store_true", help="SRC is a peft=lora checkpoint: DST gets its adapters as "
                    "a PEFT directory")
    ap.add_argument("--merge-lora", default=None, metavar="ADAPTER_DIR", help="SRC is a K3 directory: DST gets it "
                    "with the PEFT adapters of ADAPTER_DIR merged (experts encoded to MXFP4 again)")
    ap.add_argument("--layout", default=None, help="k3 | kimi_linear (--to-hf, default k3); auto (--from-hf)")
    ap.add_argument("--dtype", default=None, help="--to-hf: bfloat16 | float32 for the non-expert tensors")
    ap.add_argument("--max-shard-size", type=int, default=None, help="--to-hf: bytes per safetensors shard")
    a, overrides = ap.parse_known_args(argv)
    try:
        if sum(map(bool, (a.to_hf, a.from_hf, a.to_peft, a.merge_lora))) > 1:
            raise ValueError("--to-hf, --from-hf, --to-peft and --merge-lora exclude each other")
        bad = [o for o in overrides if "=" not in o or not o.startswith("model")]
        if bad or (overrides and not a.to_hf):
            raise ValueError(f"unexpected arguments {bad or overrides}; model=NAME and model.KEY=VALUE go with --to-hf")
        if a.to_hf:
            out = to_hf(a.src, a.dst, a.layout or "k3", a.dtype, a.max_shard_size, overrides)
        elif a.from_hf:
            out = from_hf(a.src, a.dst, a.layout or "auto")
        elif a.to_peft:
            out = to_peft(a.src, a.dst)
        elif a.merge_lora:
            out = peft_layout.merge_lora(a.src, a.merge_lora, a.dst)
        else:
            out = convert(a.src, a.dst)
    except (ckpt.CheckpointError, ConfigError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
