"""The Trainer's checkpoints: `CheckpointManager.resume()` (with the three-way reshard: same layout, another
pipeline split, another tensor-parallel size) and `save()`. The file format is checkpoint.py's; the per-parameter
optimizer views are zero_views.py's.

Every rank takes part in both: ZeRO's partitions are gathered over data parallelism and the experts over expert
parallelism, data-parallel rank 0 of each (tensor-parallel shard, pipeline stage) writes its files, rank 0 adds
every rank's RNG state and commits (meta.json, rename into place, `latest` last).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ..annotations import full_shape, meta
from ..config import RUNTIME_MODEL_KEYS, ConfigError, ModelConfig, RunConfig
from . import checkpoint as ckpt
from .zero_views import full_states, load_full_states

log = logging.getLogger("megatron_k3.train")


@dataclass(frozen=True)
class Ranks:
    """Where this rank sits: world, tensor/pipeline shard, data-parallel replica (with context parallelism)."""
    rank: int
    world: int
    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    dp: int
    cp: int
    dp_cp_rank: int

    @property
    def suffix(self) -> str:
        return ckpt.shard_suffix(self.tp, self.tp_rank, self.pp, self.pp_rank)


@dataclass
class Position:
    """How far the run is: optimizer steps, samples and tokens consumed."""
    step: int = 0
    consumed: int = 0
    tokens: int = 0


def _plain(x):
    """A config as JSON-able plain data."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x if isinstance(x, (int, float, str, bool)) or x is None else str(x)


class CheckpointManager:
    def __init__(self, run: RunConfig, engine, experts, ranks: Ranks, ckpt_dir: Path):
        self.run, self.engine, self.experts, self.ranks, self.dir = run, engine, experts, ranks, ckpt_dir

    @property
    def model(self):
        return self.engine.module

    # ------------------------------------------------------------------ resume
    def resume(self) -> Position | None:
        """Load `checkpoint.load` (None: nothing to load) into the model, the optimizers and the RNG; returns the
        position it was saved at. Any data-parallel size, ZeRO stage, tensor, expert or pipeline split loads."""
        r = self.ranks
        try:
            path = ckpt.resolve_load_path(self.run.checkpoint.load, self.dir)
        except FileNotFoundError as e:
            raise ConfigError("checkpoint.load", self.run.checkpoint.load, str(e)) from None
        if path is None:
            if self.run.checkpoint.load == "auto":
                log.info("checkpoint.load=auto: no checkpoint in %s, starting fresh", self.dir)
            return None
        try:
            saved = ckpt.read_meta(path)
            self._check_model_config(path, saved)
            saved_tp = int(saved.get("tensor_parallel", 1))
            saved_pp = int(saved.get("pipeline_parallel", 1))
            if saved_tp == r.tp and saved_pp == r.pp:
                model_t, optim_t, extra = ckpt.read_shard(path, r.suffix)
            elif saved_tp == r.tp:  # another pipeline split: the stage files merged, this stage's tensors kept
                model_t, optim_t, extra = ckpt.read_stages(path, saved, r.tp_rank)
                model_t, optim_t = self._own(model_t), self._own(optim_t)
                log.info("re-staging %s: saved with pipeline_parallel=%d, loading with %d", path, saved_pp, r.pp)
            else:  # resharding: merge the saved shards, keep this rank's slice
                dims = {n: meta(p).tp_dim for n, p in self.model.named_parameters()}
                model_t, optim_t, extra = ckpt.read_full(path, saved)
                model_t, optim_t = self._own(model_t), self._own(optim_t)
                model_t, optim_t = ckpt.split_shard(model_t, optim_t, dims, r.tp, r.tp_rank)
                log.info("resharding %s: saved with tensor_parallel=%d, loading with %d", path, saved_tp, r.tp)
            rng = ckpt.load_pickle_safely(path / "rng.pt") if (path / "rng.pt").is_file() else None
        except (ckpt.CheckpointError, FileNotFoundError, OSError) as e:
            raise ConfigError("checkpoint.load", str(path), str(e)) from None
        named = list(self.model.named_parameters())
        self._check_tensors(path, named, model_t)
        buffers = {k: v for k, v in model_t.items() if k not in dict(named)}
        _, unexpected = self.model.load_state_dict(buffers, strict=False)
        if unexpected:
            raise ConfigError("checkpoint.load", str(path), f"tensors the model does not have: {unexpected[:5]}")
        load_full_states(self.engine, named, model_t, optim_t, extra["optimizer_scalars"], self.experts)
        self._restore_rng(rng, extra)
        if saved.get("global_batch_size") != self.run.train.global_batch_size:
            log.warning("resuming with global_batch_size %s (checkpoint had %s)",
                        self.run.train.global_batch_size, saved.get("global_batch_size"))
        log.info("resumed from %s at step %d (%d samples consumed)", path, saved["step"], saved["consumed_samples"])
        return Position(saved["step"], saved["consumed_samples"], saved["tokens"])

    def _check_tensors(self, path, named, model_t):
        missing = [n for n, _ in named if n not in model_t]
        if missing:
            raise ConfigError("checkpoint.load", str(path), f"parameters missing from the checkpoint: {missing[:5]}")
        for n, p in named:
            m = meta(p)  # the saved tensor is this rank's tensor-parallel shard with every expert (global order)
            want = tuple(p.shape) if not m.expert_parallel else full_shape(p)
            if tuple(model_t[n].shape) != want:
                raise ConfigError("checkpoint.load", str(path), f"{n}: saved shape {tuple(model_t[n].shape)}, this "
                                  f"model (tp={self.ranks.tp}) needs {want}")

    def _restore_rng(self, rng, extra):
        ranks = (rng or {}).get("ranks", [])
        if len(ranks) == self.ranks.world:
            ckpt.set_rng_state(ranks[self.ranks.rank])
            return
        if rng is not None and self.ranks.rank == 0:
            log.warning("the checkpoint holds the RNG states of %d ranks and this run has %d: every rank takes "
                        "the saved rank-0 state", len(ranks), self.ranks.world)
        if ranks or "rng" in extra:  # a converted checkpoint (tools/convert_checkpoint.py --from-hf) has none
            ckpt.set_rng_state(ranks[0] if ranks else extra["rng"])

    def _own(self, tensors: dict) -> dict:
        """The entries of a whole-model dict that this rank's pipeline stage holds."""
        own = self.model.state_dict()
        return {k: v for k, v in tensors.items() if k in own}

    def _check_model_config(self, path, saved_meta: dict):
        """Refuse a checkpoint whose model differs in anything but the runtime keys (config.RUNTIME_MODEL_KEYS)."""
        saved = saved_meta.get("model")
        if saved is None:
            return
        current = dataclasses.asdict(self.run.model)
        # the layer pattern may be spelled as a list or as a period: compare what it resolves to
        pattern = ("mla_layers", "mla_every", "mla_at_last")
        diff = ckpt.config_diff({k: v for k, v in saved.items() if k not in pattern},
                                {k: v for k, v in current.items() if k not in pattern})
        try:
            saved_types = ModelConfig(**saved).layer_types()
        except (TypeError, ValueError):
            saved_types = None
        if saved_types is not None and saved_types != self.run.model.layer_types():
            diff.append(("layer_types()", saved_types, self.run.model.layer_types()))
        hard = [d for d in diff if d[0] not in RUNTIME_MODEL_KEYS]
        if hard:
            listed = "; ".join(f"model.{k}: checkpoint {a!r}, this run {b!r}" for k, a, b in hard)
            raise ConfigError("model", self.run.model.name, f"does not match the checkpoint {path}: {listed}")
        if diff and self.ranks.rank == 0:
            log.info("resuming with changed runtime model settings: %s",
                     ", ".join(f"model.{k} {a!r} -> {b!r}" for k, a, b in diff))

    # ------------------------------------------------------------------ save
    def save(self, pos: Position) -> None:
        r = self.ranks
        named = list(self.model.named_parameters())
        meta_json = {"step": pos.step, "consumed_samples": pos.consumed, "tokens": pos.tokens,
                     "global_batch_size": self.run.train.global_batch_size, "seed": self.run.train.seed,
                     "tensor_parallel": r.tp, "expert_parallel": self.run.parallel.ep, "context_parallel": r.cp,
                     "pipeline_parallel": r.pp, "world_size": r.world, "data_parallel": r.dp,
                     "zero_stage": self.run.parallel.zero_stage, "optimizer": self.run.optim.name,
                     "tp_split_dims": {n: meta(p).tp_dim for n, p in named},
                     "lr_schedule": "derived from step (optim.*)",
                     "model": dataclasses.asdict(self.run.model), "config": _plain(dataclasses.asdict(self.run))}
        weights, states, scalars = full_states(self.engine, named, self.experts)
        rngs = [None] * r.world
        dist.all_gather_object(rngs, ckpt.rng_state())
        if r.pp > 1:  # every stage's parameters' split dimensions (meta.json is written by rank 0)
            dims = [None] * r.world
            dist.all_gather_object(dims, meta_json["tp_split_dims"])
            meta_json["tp_split_dims"] = {k: v for d in dims for k, v in d.items()}
        final = ckpt.begin(self.dir, pos.step, unique=False)[1] if r.rank == 0 else None
        dist.barrier()
        tmp = self.dir / f".tmp-step_{pos.step:08d}"
        if r.dp_cp_rank == 0:  # one writer per (tensor-parallel shard, pipeline stage)
            model_t = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            model_t.update(weights)  # fp32 masters over the module's (possibly bf16) parameters
            buffers = dict(self.model.named_buffers())
            for k in [k for k in model_t if k not in weights and k not in buffers]:
                del model_t[k]  # aliases of tied parameters: stored once
            ckpt.write_shard(tmp, r.suffix, model_t, states, {"rng": ckpt.rng_state(), "optimizer_scalars": scalars})
        if r.rank == 0:
            ckpt.write_rng(tmp, rngs)
        dist.barrier()
        if r.rank == 0:
            log.info("saved checkpoint %s", ckpt.commit(tmp, final, meta_json, self.run.checkpoint.keep_last))
        dist.barrier()
