"""One training run from a validated config: the processes (torch.distributed, torchrun's restarts), the run
directory, the Trainer, and the exit status: 0 done, 2 a config mistake, 1 a run that cannot go on."""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ..config import ConfigError, RunConfig
from ..errors import report_error
from .engine import shutdown
from .faults import TrainingError
from .loop import Trainer

log = logging.getLogger("megatron_k3.train")


def _init_distributed(backend: str, timeout_minutes: float = 30.0):
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
    if dist.is_initialized():
        obj = [run_dir]
        dist.broadcast_object_list(obj, src=0)
        run_dir = obj[0]
    return Path(run_dir)


def _quiet_logs(level: str) -> None:
    """Our loggers at `logging.level` (rank 0; the others WARNING), everyone else's at WARNING: the INFO lines of
    libraries (DeepSpeed's op builder probing gcc for libaio, ...) say nothing a user acts on. torch's FutureWarning
    for the all_gather_into_tensor that DeepSpeed's ZeRO calls every step is not the user's to act on either."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout)
    logging.getLogger("megatron_k3").setLevel(getattr(logging, level.upper(), logging.INFO))
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated", category=FutureWarning)


def _remove_if_unused(run_dir: Path) -> None:
    """A run directory this run created and that holds nothing but the composed config (a mistake found while
    building, before the first step): removed, so that a failed start leaves no empty run behind."""
    if {p.name for p in run_dir.iterdir()} <= {".hydra"}:
        shutil.rmtree(run_dir, ignore_errors=True)


def run_training(run: RunConfig, cfg, hydra_node, overrides) -> int:
    """Train `run` (`cfg`: the composed DictConfig, written to the run directory; `hydra_node`: Hydra's, which names
    the run directory)."""
    rank = int(os.environ.get("RANK", "0"))
    _quiet_logs(run.logging.level if rank == 0 else "WARNING")
    _init_distributed(run.parallel.backend, run.parallel.timeout_minutes)
    run_dir = _shared_run_dir(OmegaConf.to_container(hydra_node.run, resolve=True)["dir"])
    created = not run_dir.exists()
    if rank == 0:
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        (run_dir / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(list(overrides)))
        log.info("run directory: %s", run_dir.resolve())
    try:
        trainer = Trainer(run, run_dir)
        last = trainer.fit(OmegaConf.to_container(cfg, resolve=True))
    except ConfigError as e:
        if rank == 0 and created:
            _remove_if_unused(run_dir)
        return report_error(e, 2)
    except TrainingError as e:  # non-finite values, a failed collective: one line naming where
        return report_error(e, 1)
    finally:
        shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print(f"run directory: {run_dir.resolve()}")
        if last:
            print(f"last step {last['step']}: loss {last['loss']:.4f}")
        if run.logging.wandb.mode == "offline":
            print(f"W&B (offline): {run_dir.resolve()}/wandb  -- view: wandb sync "
                  f"{run_dir.resolve()}/wandb/offline-run-*"
                  f"  (or: wandb server / tools read the files directly)")
    return 0
