"""The training entry point: compose the Hydra config -> initialise processes -> build -> train.

    python -m megatron_k3.train [group=option ...] [key=value ...]
    torchrun --nproc_per_node N -m megatron_k3.train ...
    deepspeed --num_gpus N megatron_k3/train.py ...

Extra flags: `--cfg` prints the composed config and exits; `--help` prints this text and the groups.
A configuration mistake exits with status 2 and one line naming the key, the value and what is valid.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by the deepspeed launcher: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_k3.config import CONF_DIR, ConfigError, compose_run_config  # noqa: E402

log = logging.getLogger("megatron_k3.train")


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


def _init_distributed(backend: str, timeout_minutes: float = 30.0):
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = datetime.timedelta(minutes=timeout_minutes)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun --max-restarts with its static rendezvous keeps one agent store across restarts, so a restarted
        # worker would read the dead attempt's gloo/NCCL addresses from it and fail to connect. Keys of each
        # attempt go under their own prefix.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=timeout)
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"megatron_k3/attempt_{attempt}", store),
                                rank=rank, world_size=world, timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout)


def _shared_run_dir(run_dir: str) -> Path:
    """All ranks use rank 0's run directory (its timestamp may differ from theirs)."""
    import torch.distributed as dist

    if dist.is_initialized():
        obj = [run_dir]
        dist.broadcast_object_list(obj, src=0)
        run_dir = obj[0]
    return Path(run_dir)


def _help():
    print(__doc__.strip())
    print("\nconfig groups (conf/):")
    for g in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        print(f"  {g.name}: {', '.join(sorted(f.stem for f in g.glob('*.yaml')))}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    overrides, flags = _parse_argv(argv)
    if flags & {"--help", "-h"}:
        _help()
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        run, cfg, hydra_node = compose_run_config(overrides, world_size=world)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from omegaconf import OmegaConf

    if "--cfg" in flags:
        print(OmegaConf.to_yaml(cfg))
        return 0
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=getattr(logging, run.logging.level.upper(), logging.INFO) if rank == 0 else "WARNING",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    _init_distributed(run.parallel.backend, run.parallel.timeout_minutes)
    run_dir = _shared_run_dir(OmegaConf.to_container(hydra_node.run, resolve=True)["dir"])
    if rank == 0:
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        (run_dir / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(list(overrides)))
        log.info("run directory: %s", run_dir.resolve())
    from megatron_k3.training.faults import TrainingError
    from megatron_k3.training.loop import Trainer

    try:
        trainer = Trainer(run, run_dir)
        last = trainer.fit(OmegaConf.to_container(cfg, resolve=True))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:  # non-finite values, a failed collective: one line naming where
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        import torch.distributed as dist

        from megatron_k3.training.engine import shutdown

        shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print(f"run directory: {run_dir.resolve()}")
        if last:
            print(f"last step {last['step']}: loss {last['loss']:.4f}")
        if run.logging.wandb.mode == "offline":
            print(f"W&B (offline): {run_dir.resolve()}/wandb  -- view: wandb sync {run_dir.resolve()}/wandb/offline-run-*"
                  f"  (or: wandb server / tools read the files directly)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
