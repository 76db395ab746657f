#!/usr/bin/env python
"""Convert between our weights and Hugging Face checkpoint directories (Kimi Linear or Kimi K3 layout).

    python tools/convert_hf.py --to-hf SRC OUT_DIR model=NAME [model.KEY=VALUE ...] [--layout k3|kimi_linear]
                               [--dtype bfloat16|float32] [--max-shard-size BYTES]
    python tools/convert_hf.py --from-hf HF_DIR OUT_DIR [--layout auto|k3|kimi_linear]

--to-hf: SRC is one of our unsharded weight files (`model.safetensors` of a training checkpoint saved with
tensor parallel size 1, or a directory holding one); OUT_DIR gets config.json and model*.safetensors.
--from-hf: OUT_DIR gets `model.safetensors` (our state-dict names, fp32) and `model_config.json` (the
ModelConfig read from the checkpoint's config.json).
"""

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_k3.config import ConfigError, load_model_config  # noqa: E402


def _options(args, names):
    opts, rest = {}, []
    it = iter(args)
    for a in it:
        if a in names:
            opts[a] = next(it, None)
            if opts[a] is None:
                raise ValueError(f"{a} needs a value")
        else:
            rest.append(a)
    return opts, rest


def to_hf(args) -> int:
    from safetensors.torch import load_file

    from megatron_k3.model import K3ForCausalLM

    opts, rest = _options(args, ("--layout", "--dtype", "--max-shard-size"))
    paths = [a for a in rest if "=" not in a]
    name = next((a.split("=", 1)[1] for a in rest if a.startswith("model=")), None)
    overrides = [a for a in rest if "=" in a and not a.startswith("model=")]
    if len(paths) != 2 or name is None:
        raise ValueError("--to-hf needs SRC OUT_DIR model=NAME")
    src, out = Path(paths[0]), Path(paths[1])
    if src.is_dir():
        src = src / "model.safetensors"
    cfg = load_model_config(name, overrides)
    model = K3ForCausalLM(cfg, init=False)
    model.load_full_state_dict(load_file(str(src)), strict=True)
    kw = {"dtype": opts.get("--dtype")}
    if "--max-shard-size" in opts:
        kw["max_shard_size"] = int(opts["--max-shard-size"])
    model.save_hf(out, layout=opts.get("--layout", "k3"), **kw)
    print(json.dumps({"wrote": str(out), "layout": opts.get("--layout", "k3"), "model": cfg.name}))
    return 0


def from_hf(args) -> int:
    from safetensors.torch import save_file

    from megatron_k3.model import K3ForCausalLM

    opts, paths = _options(args, ("--layout",))
    if len(paths) != 2:
        raise ValueError("--from-hf needs HF_DIR OUT_DIR")
    model = K3ForCausalLM.from_hf(paths[0], layout=opts.get("--layout", "auto"))
    out = Path(paths[1])
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "model_config.json").write_text(json.dumps(dataclasses.asdict(model.cfg), indent=2) + "\n")
    print(json.dumps({"wrote": str(out), "tensors": len(model.state_dict())}))
    return 0


def main(argv) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    try:
        if argv[0] == "--to-hf":
            return to_hf(argv[1:])
        if argv[0] == "--from-hf":
            return from_hf(argv[1:])
        raise ValueError(f"unexpected {argv[0]!r}: start with --to-hf or --from-hf")
    except (ConfigError, ValueError, KeyError, FileNotFoundError) as e:
        print(f"convert_hf: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
