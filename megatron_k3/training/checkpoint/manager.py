"""The Trainer's checkpoints: `CheckpointManager.save()` and `resume()`. The file format is shards.py's (format 3:
every rank writes the pieces it owns, rank 0 merges the indexes and commits), the directory protocol
directory.py's; what a rank owns and reads back is deepspeed_state.py's (`owned_pieces`, `load_pieces`).

Every rank takes part in both. A save gathers nothing but the RNG states and the optimizers' scalars (small, to
rank 0); a load reads on each rank only the regions of the saved tensors that rank keeps, whatever layout wrote
them. With `checkpoint.async_save=true` the pieces are snapshot to host memory and written by a thread while the
step loop goes on; rank 0's thread commits when every rank's index is there.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ...annotations import full_shape
from ...config import RUNTIME_MODEL_KEYS, ConfigError, ModelConfig, RunConfig
from ...errors import one_line
from ...interop import copy_tokenizer_files, load_hf_sharded, save_hf_sharded, wider_than_module
from ...parallel.agree import first_failure
from ...peft import is_adapter
from . import directory as ckpt
from .deepspeed_state import dense_masters, load_pieces, masters_from_module, owned_pieces, scalars_of
from .shards import CheckpointError, ShardIndex, merge_index, wait_for_ranks

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

    @classmethod
    def of(cls, ps) -> "Ranks":
        """This rank's place in a parallel.state.ParallelState."""
        return cls(ps.rank, ps.grid.world_size, ps.size("tp"), ps.rank_in("tp"), ps.size("pp"), ps.rank_in("pp"),
                   ps.size("dp"), ps.size("cp"), ps.rank_in("dp-cp"))


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


def _attempt(fn, *args) -> str | None:
    """fn(*args); the one-line error it raised, or None."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 -- exchanged with the other ranks by _agree
        return f"{type(e).__name__}: {one_line(e)}"
    return None


def _agree(err: str | None, step: int) -> None:
    """A step of a synchronous save: raised on every rank if it failed on any, naming the rank."""
    bad = first_failure(err)
    if bad is not None:
        raise CheckpointError(f"rank {bad[0]}: checkpoint of step {step} failed: {bad[1]} (the previous "
                                   f"checkpoint stays the newest)")


class CheckpointManager:
    def __init__(self, run: RunConfig, engine, experts, ps, ckpt_dir: Path):
        """`ps`: the rank's parallel.state.ParallelState."""
        self.run, self.engine, self.experts, self.ps, self.dir = run, engine, experts, ps, ckpt_dir
        self.ranks = Ranks.of(ps)
        # recorded in every checkpoint's meta.json (rank 0 writes it): a save replaces only a checkpoint of its own
        # run, and keep_last prunes only its own. A resumed run takes over the id of the checkpoint it resumed.
        self.run_id, self.resumed = uuid.uuid4().hex[:16], False
        self._thread, self._error = None, None
        self.peft_base = ""  # peft=lora: the directory the frozen base was read from ('' = the initialised model)
        self.saved: dict = {}  # meta.json of the checkpoint resumed from (resume)
        self.extra_meta = dict  # () -> run state beside the tensors for meta.json (the Trainer's train.guard window)

    @property
    def model(self):
        return self.engine.module

    def _params(self) -> list:
        """(name, parameter) a checkpoint holds: every parameter, or under peft=lora the adapters only (the frozen
        base is re-read from its directory on every start)."""
        named = self.model.named_parameters()
        return [(n, p) for n, p in named if is_adapter(n)] if self.run.peft.enabled else list(named)

    # ------------------------------------------------------------------ resume
    def resume(self, path: Path | None = None) -> Position | None:
        """Load `checkpoint.load` (or the checkpoint `path`: train.guard's rollback; None: nothing to load) into the
        model, the optimizers and the RNG; returns the position it was saved at. Any layout loads any checkpoint:
        each rank reads only the regions of the saved tensors that its parameters, ZeRO fragments and experts hold
        (deepspeed_state.load_pieces)."""
        self.wait()
        path = path or self._what_to_load()
        if self.run.peft.enabled:
            self._load_base(path)
        if path is None:
            return None
        saved, rng, nbytes = self._read_own_or_name_intact(path)
        self.saved = saved
        self.run_id, self.resumed = saved.get("run_id") or self.run_id, True
        log.info("rank %d read %.1f MB of the checkpoint's %.1f MB", self.ranks.rank, nbytes[0] / 1e6, nbytes[1] / 1e6)
        self._restore_rng(rng, saved)
        self._log_changes(path, saved)
        log.info("resumed from %s at step %d (%d samples consumed)", path, saved["step"], saved["consumed_samples"])
        return Position(saved["step"], saved["consumed_samples"], saved["tokens"])

    def _what_to_load(self) -> Path | None:
        """The checkpoint to resume from, or None: nothing to load, or pretrained weights loaded here already."""
        try:
            path = ckpt.resolve_load_path(self.run.checkpoint.load, self.dir)
        except FileNotFoundError as e:
            raise ConfigError("checkpoint.load", self.run.checkpoint.load, str(e)) from None
        if path is None:
            if self.run.checkpoint.load == "auto":
                log.info("checkpoint.load=auto: no checkpoint in %s, starting fresh", self.dir)
            elif self.ranks.rank == 0 and (found := ckpt.list_checkpoints(self.dir)):
                log.warning("checkpoint.load=%s: starting fresh in %s, which holds %d checkpoint(s) of another run "
                            "(%s ... %s): they are kept; a save onto one of their steps stops this run",
                            self.run.checkpoint.load or "''", self.dir, len(found), found[0].name, found[-1].name)
            return None
        if not ckpt.is_hf_directory(path):
            return path
        own = ckpt.list_checkpoints(self.dir)
        if not own:
            if not self.run.peft.enabled:  # peft=lora reads the base in _load_base
                self._load_pretrained(path)
            return None
        # a restart of a run that began from pretrained weights: its own newest checkpoint, not step 0 again
        log.info("checkpoint.load=%s holds pretrained weights and %s the run's own checkpoints: resuming from "
                 "the newest, %s", path, self.dir, own[-1])
        return own[-1]

    def _read_own_or_name_intact(self, path: Path) -> tuple:
        """`_read_own`; a checkpoint that cannot be read (a corrupted or truncated file, named) is raised with the
        newest intact checkpoint beside it (directory.newest_intact), which checkpoint.load can name."""
        try:
            return self._read_own(path)
        except ConfigError as e:
            older = ckpt.newest_intact(path.parent, path) if path.name.startswith("step_") else None
            hint = (f"; the newest intact checkpoint is {older}: checkpoint.load={older} resumes from it" if older
                    else f"; {path.parent} holds no older intact checkpoint")
            raise ConfigError(e.key, e.value, f"{e.valid}{hint}") from None

    def _read_own(self, path: Path) -> tuple:
        """(meta.json, the saved RNG states or None, (bytes read, checkpoint bytes)) after reading this rank's
        pieces of `path` into the model and the optimizers. A failure on any rank (a file only some ranks read:
        a missing or truncated shard) stops every rank, naming it."""
        index, failure, saved, rng = None, None, None, None
        try:
            saved = ckpt.read_meta(path)
            self._check_model_config(path, saved)
            index = ShardIndex(path)
            named = self._params()
            self._check_tensors(path, named, index)
            for name, b in self._buffers().items():
                if name in index:
                    index.read(name, (0,) * b.dim(), b)
            load_pieces(self.engine, named, index, saved.get("optimizer_scalars", {}), self.ps, self.experts)
            rng = ckpt.load_pickle_safely(path / "rng.pt") if (path / "rng.pt").is_file() else None
        except ConfigError as e:
            failure = e
        except Exception as e:  # noqa: BLE001 -- a file, DeepSpeed's fragments: exchanged, raised on every rank
            failure = ConfigError("checkpoint.load", str(path), one_line(e))
        finally:
            if index is not None:
                index.close()
        bad = first_failure(None if failure is None else (failure.key, str(failure.value), failure.valid))
        if failure is not None:
            raise failure
        if bad is not None:
            raise ConfigError(bad[1][0], bad[1][1], f"on rank {bad[0]}: {bad[1][2]}")
        return saved, rng, (index.bytes_read, index.total_bytes)

    def _log_changes(self, path: Path, saved: dict) -> None:
        """What differs from the run that saved: the layout (resharded on load), the global batch."""
        r = self.ranks
        layout = {k: saved.get(k) for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel",
                                           "data_parallel", "zero_stage")}
        now = {"tensor_parallel": r.tp, "pipeline_parallel": r.pp, "expert_parallel": self.run.parallel.ep,
               "data_parallel": r.dp, "zero_stage": self.run.parallel.zero_stage}
        if layout != now and r.rank == 0:
            log.info("resharding %s: saved with %s, loading with %s", path,
                     " ".join(f"{k}={v}" for k, v in layout.items()), " ".join(f"{k}={v}" for k, v in now.items()))
        if saved.get("global_batch_size") != self.run.train.global_batch_size:
            log.warning("resuming with global_batch_size %s (checkpoint had %s)",
                        self.run.train.global_batch_size, saved.get("global_batch_size"))

    def _load_base(self, own: Path | None) -> None:
        """peft=lora: the frozen base read into this rank's shards (training.adapters.base_directory: peft.base,
        checkpoint.load's Hugging Face directory, or the base the resumed checkpoint `own` records), before the
        adapters are read from `own`; with none, the initialised model stays the base (logged)."""
        saved = ckpt.read_meta(own) if own is not None else None
        key, base = ckpt.peft_base_directory(self.run, saved)
        recorded = ((saved or {}).get("peft") or {}).get("base")
        if recorded and base is not None and Path(recorded).resolve() != base.resolve() and self.ranks.rank == 0:
            log.warning("%s=%s: the checkpoint %s trained its adapters over %s", key, base, own, recorded)
        if base is None:
            if self.ranks.rank == 0:
                log.warning("peft=lora without a base directory (peft.base, or checkpoint.load=DIR): the adapters "
                            "train over the initialised model (train.seed), its routed experts encoded to MXFP4")
            return
        self._load_pretrained(base, key)
        self.peft_base = str(base.resolve())

    def _load_pretrained(self, path: Path, key: str = "checkpoint.load") -> None:
        """Weights of a Hugging Face directory (the released K3 checkpoint, or Kimi Linear), streamed into every
        rank's shards (interop.load_hf_sharded: each rank reads only its slices and dequantises only its
        experts), then the fp32 masters from them (from the values as stored where the checkpoint holds a tensor
        wider than the module: K3's fp32 tensors under bf16 module weights); the run starts at step 0 with fresh
        optimizer states."""
        try:
            report = load_hf_sharded(self.model, path)
        except (ValueError, OSError) as e:
            raise ConfigError(key, str(path), one_line(e)) from None
        if not self.run.peft.enabled:  # the frozen base has no masters; the adapters keep theirs
            masters_from_module(self.engine, self.ps, self.experts, exact=report.wider)
        log.info("rank %d: initialised from %s (%s layout): %d tensors, %.1f MB read from %d files",
                 self.ranks.rank, path, report.layout, report.tensors, report.bytes_read / 1e6, len(report.files))

    def export_hf(self) -> Path:
        """`checkpoint.export_hf`: the model as a Hugging Face directory (interop.save_hf_sharded: each tensor
        written once, by the lowest rank holding it whole, tensor-parallel pieces gathered within their group
        only, each block of experts quantised by its owner, blocks still exact at their imported MXFP4 scales
        written as imported; one index, written by rank 0 last), with the tokenizer and chat files of the Hugging
        Face directory the run started from (checkpoint.load), copied by rank 0. What the layout stores wider than
        the module holds it (K3's fp32 tensors under bf16 module weights) is written from the fp32 masters
        (`export_masters`). A failure is raised on every rank."""
        c = self.run.checkpoint
        out = Path(c.export_hf)
        save_hf_sharded(self.model, out, c.export_layout, tp_group=self.ps.group("tp"),
                        dtype=getattr(torch, c.export_dtype), values=self.export_masters())
        copied = self._copy_tokenizer(out)
        if self.ranks.rank == 0:
            log.info("exported %s (%s layout, %s)%s", out, c.export_layout, c.export_dtype,
                     f"; copied {', '.join(copied)}" if copied else "; no tokenizer files copied (neither "
                     "checkpoint.load nor data.tokenizer is a directory holding them)")
        return out

    def export_masters(self) -> dict:
        """{name: fp32 master at this rank's tensor-parallel shard} of the parameters `checkpoint.export_hf` writes
        wider than the module holds them (interop.wider_than_module), gathered over data parallel: call on every
        rank."""
        c = self.run.checkpoint
        names = wider_than_module(self.model, c.export_layout, getattr(torch, c.export_dtype))
        return dense_masters(self.engine, self.ps, names)

    def _copy_tokenizer(self, out: Path) -> list:
        """Rank 0 copies the tokenizer and chat files of `checkpoint.load`, where that is a Hugging Face directory,
        else of `data.tokenizer` where that is a directory (the released tokenizer), into the export `out`
        (interop.copy_tokenizer_files); returns their names. A failure is raised on every rank."""
        load = self.run.checkpoint.load
        if load in ("", "auto") or not ckpt.is_hf_directory(Path(load)):
            load = self.run.data.tokenizer if Path(self.run.data.tokenizer or "/nonexistent").is_dir() else ""
        copied, err = [], None
        if self.ranks.rank == 0 and load:
            try:
                copied = copy_tokenizer_files(load, out)
            except OSError as e:
                err = one_line(e)
        bad = first_failure(err)
        if bad is not None:
            raise CheckpointError(f"rank {bad[0]}: checkpoint.export_hf={out}: copying the tokenizer files of "
                                  f"{load} failed: {bad[1]}")
        return copied

    def _buffers(self) -> dict:
        """The module's persistent buffers (the router's bias and counts), which a checkpoint holds besides the
        parameters (under peft=lora none: they belong to the frozen base)."""
        if self.run.peft.enabled:  # peft=lora: the routers' bias is the frozen base's (no balancing runs)
            return {}
        keys = set(self.model.state_dict())
        return {n: b for n, b in self.model.named_buffers() if n in keys}

    def _check_tensors(self, path, named, index):
        missing = [n for n, _ in named if n not in index]
        if missing:
            raise ConfigError("checkpoint.load", str(path), f"parameters missing from the checkpoint: {missing[:5]}")
        for n, p in named:
            if index.shape(n) != full_shape(p):
                raise ConfigError("checkpoint.load", str(path / "index.json"),
                                  f"{n}: saved shape {index.shape(n)}, this model needs {full_shape(p)}")

    def _restore_rng(self, rng, saved_meta):
        ranks = (rng or {}).get("ranks", [])
        if len(ranks) == self.ranks.world:
            ckpt.set_rng_state(ranks[self.ranks.rank])
            return
        if rng is not None and self.ranks.rank == 0:
            log.warning("the checkpoint holds the RNG states of %d ranks and this run has %d: every rank takes "
                        "the saved rank-0 state", len(ranks), self.ranks.world)
        if ranks:  # a converted checkpoint (tools/convert_checkpoint.py --from-hf) has none
            ckpt.set_rng_state(ranks[0])

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
    def save(self, pos: Position, blocking: bool | None = None) -> None:
        """Every rank writes its own pieces (deepspeed_state.owned_pieces) into the temporary directory, rank 0 merges
        the ranks' indexes and commits (meta.json, rename into place, `latest` last). With checkpoint.async_save
        (and blocking not True) each rank snapshots its pieces to host memory and returns; a thread writes them
        and rank 0's commits once every rank's index is there. A save waits for the previous one first."""
        r = self.ranks
        self.wait(collective=True)
        async_ = self.run.checkpoint.async_save if blocking is None else not blocking
        named = self._params()
        pieces = owned_pieces(self.engine, named, self.ps, self.experts, self._buffers())
        meta_json = {"step": pos.step, "consumed_samples": pos.consumed, "tokens": pos.tokens,
                     "global_batch_size": self.run.train.global_batch_size, "seed": self.run.train.seed,
                     "tensor_parallel": r.tp, "expert_parallel": self.run.parallel.ep, "context_parallel": r.cp,
                     "pipeline_parallel": r.pp, "world_size": r.world, "data_parallel": r.dp,
                     "zero_stage": self.run.parallel.zero_stage, "optimizer": self.run.optim.name,
                     "lr_schedule": "derived from step (optim.*)",
                     "model": dataclasses.asdict(self.run.model), "config": _plain(dataclasses.asdict(self.run))}
        if self.run.peft.enabled:  # the adapters' shapes, and the frozen base a resumed run reads again
            meta_json["peft"] = dict(_plain(dataclasses.asdict(self.run.peft)), base=self.peft_base)
        gathered = [None] * r.world if r.rank == 0 else None
        dist.gather_object((ckpt.rng_state(), scalars_of(self.engine, self.experts)), gathered, dst=0)
        rngs = None
        if r.rank == 0:
            meta_json["optimizer_scalars"] = {k: v for _, sc in gathered for k, v in sc.items()}
            rngs = [g[0] for g in gathered]
        meta_json["run_id"] = self.run_id
        meta_json.update(self.extra_meta())
        _agree(self._foreign(pos.step) if r.rank == 0 else None, pos.step)  # before anything is written
        final = ckpt.begin(self.dir, pos.step, unique=False)[1] if r.rank == 0 else None
        dist.barrier()
        tmp = self.dir / f".tmp-step_{pos.step:08d}"
        if not async_:
            err = _attempt(self._write, pieces, tmp, rngs)
            _agree(err, pos.step)  # every rank's files are in place before rank 0 commits ...
            if r.rank == 0:
                err = _attempt(self._commit, tmp, final, meta_json)
            _agree(err, pos.step)  # ... and it committed (or failed, on every rank) before anyone goes on
            return
        t0 = time.perf_counter()
        snap = pieces.snapshot()
        log.info("rank %d: async checkpoint of step %d: %.1f MB snapshot in %.2f s, writing in the background",
                 r.rank, pos.step, snap.nbytes / 1e6, time.perf_counter() - t0)
        self._thread = threading.Thread(target=self._write_async, args=([snap], tmp, final, meta_json, rngs),
                                        name=f"k3-checkpoint-{pos.step}", daemon=True)
        self._thread.start()

    def _foreign(self, step: int) -> str | None:
        """Why this run may not write checkpoint `step`, or None: a complete checkpoint of that step written by
        another run (its meta.json's run id) is never replaced; one without a run id (written before them) only by
        a run that resumed in this directory, not by one that started fresh (checkpoint.load=none)."""
        final = self.dir / f"step_{step:08d}"
        if final not in ckpt.list_checkpoints(self.dir):
            return None
        owner = ckpt.run_of(final)
        if owner == self.run_id or (owner is None and self.resumed):
            return None
        return (f"{final} was written by another run ({f'run id {owner}' if owner else 'no run id'}); this run "
                f"({self.run_id}, checkpoint.load={self.run.checkpoint.load or repr('')}) does not replace it: "
                "resume that run (checkpoint.load=auto) or give this one another checkpoint.dir")

    def _write(self, pieces, tmp: Path, rngs) -> None:
        r = self.ranks
        pieces.write(tmp, r.rank)
        if r.rank == 0:
            ckpt.write_rng(tmp, rngs)

    def _commit(self, tmp: Path, final: Path, meta_json: dict, wait_s: float = 0) -> None:
        if wait_s:
            wait_for_ranks(tmp, self.ranks.world, wait_s)
        merge_index(tmp, self.ranks.world)
        log.info("saved checkpoint %s", ckpt.commit(tmp, final, meta_json, self.run.checkpoint.keep_last))

    def _write_async(self, box: list, tmp, final, meta_json, rngs) -> None:
        """The background half of an async save; `box` holds the snapshot, emptied once written (rank 0 then
        waits for the other ranks without holding it)."""
        r = self.ranks
        try:
            self._write(box.pop(), tmp, rngs)
            if r.rank == 0:
                self._commit(tmp, final, meta_json, wait_s=60 * self.run.parallel.timeout_minutes)
        except BaseException as e:  # noqa: BLE001 -- reported to every rank by wait(collective=True)
            self._error = f"rank {r.rank}: checkpoint of step {meta_json['step']} failed: {one_line(e)}"
            try:
                (tmp / f"rank_{r.rank:05d}.error").write_text(self._error + "\n")
            except OSError:
                pass
            log.error("%s (the previous checkpoint stays the newest)", self._error)

    def join(self) -> None:
        """Until this rank's async save (if one is running) is done; a failure in it stays logged. No collective:
        for a run leaving on an exception."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def wait(self, collective: bool = False) -> None:
        """Until this rank's async save (if one is running) has written its files and, on rank 0, committed; a
        failure in it is raised here (the previous checkpoint is still the newest complete one). collective=True
        (every rank calls it: before a save, at the end of the run): the ranks exchange their outcomes, and a
        failure on any rank is raised on all of them."""
        self.join()
        err, self._error = self._error, None
        if collective:
            bad = first_failure(err)
            err = bad[1] if bad is not None else None
        if err:
            raise CheckpointError(err)
