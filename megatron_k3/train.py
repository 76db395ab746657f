"""The training entry point: compose the Hydra config -> initialise processes -> build -> train (training/launch.py).

    python -m megatron_k3.train [group=option ...] [key=value ...]
    torchrun --nproc_per_node N -m megatron_k3.train ...
    deepspeed --num_gpus N megatron_k3/train.py ...

Extra flags: `--cfg` prints the composed config and exits; `--help` prints this text, the groups and their keys.
A configuration mistake exits with status 2 and one line naming the key, the value and what is valid (under
torchrun also the root cause in its failure summary).
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

if __package__ in (None, ""):  # run as a script by the deepspeed launcher: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omegaconf import OmegaConf  # noqa: E402

from megatron_k3.config import CONF_DIR, ConfigError, compose_run_config, schema_keys  # noqa: E402
from megatron_k3.errors import report_error  # noqa: E402


def _parse_argv(argv):
    overrides, flags = [], set()
    it = iter(argv)
    for a in it:
        if a.startswith("--local_rank") or a.startswith("--local-rank"):
            if "=" not in a:
                next(it, None)
            continue
        if a in ("--cfg", "--help", "-h"):
            flags.add(a)
            continue
        overrides.append(a)
    return overrides, flags


def _help():
    print(__doc__.strip())
    print("\nconfig groups (conf/<group>/<option>.yaml; choose one with group=option):")
    for g in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        print(f"  {g.name}: {', '.join(sorted(f.stem for f in g.glob('*.yaml')))}")
    print("\nkeys (set with group.key=value; each key's meaning is the comment beside it in "
          "megatron_k3/config/schema.py, the composed values: --cfg):")
    by_group = {}
    for key in schema_keys():
        group, _, rest = key.partition(".")
        by_group.setdefault(group, []).append(rest or group)
    for group, keys in by_group.items():
        print(textwrap.fill(", ".join(keys), width=116, initial_indent=f"  {group}: ", subsequent_indent="    "))


def _checkpoint_model(path):
    """model=from_checkpoint: the ModelConfig of Hugging Face directory `path` (interop, which imports torch: only
    when the run asks for it)."""
    from megatron_k3.interop import checkpoint_model_config

    return checkpoint_model_config(path)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    overrides, flags = _parse_argv(argv)
    if flags & {"--help", "-h"}:
        _help()
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        run, cfg, hydra_node = compose_run_config(overrides, world_size=world, model_reader=_checkpoint_model)
    except ConfigError as e:  # every rank composes the same config: rank 0 says it once
        return report_error(e, 2, every_rank=False)
    if "--cfg" in flags:
        print(OmegaConf.to_yaml(cfg))
        return 0
    # the training stack (torch, DeepSpeed: seconds to import) is imported once the config is valid, so that a
    # mistake is reported in half a second
    import torch

    if not torch.cuda.is_available():  # said, DeepSpeed does not warn each process that it found no GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megatron_k3.training.launch import run_training

    return run_training(run, cfg, hydra_node, overrides)


if __name__ == "__main__":
    sys.exit(main())
