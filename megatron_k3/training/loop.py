"""The training loop: micro-batches and gradient accumulation to the global batch, warmup + cosine LR,
gradient clipping, fp32 or bf16 autocast, periodic evaluation, metrics, checkpoints and exact resume.

The optimizer runs inside the DeepSpeed engine (engine.py): ZeRO-1/2 over the data-parallel group, gradient
accumulation and clipping; the model's tensor-parallel collectives are its own. Each data-parallel rank reads
its slice of every global batch (`rank_sample_ids`), so the order of samples does not depend on the layout.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import ConfigError, RunConfig
from ..data.corpus import EmbeddedCorpus
from ..data.dataset import (BlendedDataset, IndexedDocuments, PackedDataset, make_batch, rank_sample_ids,
                            split_documents)
from ..data.tokenizer import load_tokenizer
from ..model import K3ForCausalLM
from ..optim.schedule import lr_at
from ..parallel import pipeline, state
from ..precision import forward_context, prepare_model_for_precision
from ..parallel.layers import set_sequence_parallel
from . import checkpoint as ckpt
from . import balancing
from . import engine as ds_engine
from . import faults
from .checkpoint import read_meta, read_shard, resolve_load_path
from .metrics import (MetricsLogger, ModelStats, expert_load_stats, memory_stats, perplexity, throughput,
                      train_flops_per_token)

log = logging.getLogger("megatron_k3.train")


class Stop(Exception):
    pass


class _no_optimizer_step:
    """Within: `optimizer.step()` does nothing (DeepSpeed still counts the step and zeroes the gradients)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __enter__(self):
        self.optimizer.step = lambda *a, **k: None

    def __exit__(self, *exc):
        del self.optimizer.step


def _plain(x):
    """A config as JSON-able plain data."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x if isinstance(x, (int, float, str, bool)) or x is None else str(x)


def _device(run: RunConfig) -> torch.device:
    if run.train.device == "cuda" or (run.train.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda", "no CUDA device is visible; use cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _parse_paths(paths) -> list:
    """[prefix, ...] (equal weights) or [weight, prefix, weight, prefix, ...] -> [(weight, prefix)]."""
    items = [str(p) for p in paths]
    try:
        float(items[0])
        weighted = True
    except ValueError:
        weighted = False
    if not weighted:
        return [(1.0, p) for p in items]
    if len(items) % 2:
        raise ConfigError("data.paths", items, "weighted form needs pairs: [weight, prefix, weight, prefix, ...]")
    try:
        return [(float(items[i]), items[i + 1]) for i in range(0, len(items), 2)]
    except ValueError:
        raise ConfigError("data.paths", items, "weighted form needs pairs: [weight, prefix, ...]") from None


def build_data(run: RunConfig, rank: int):
    """(train dataset, valid dataset, eod id or None) for data=embedded or data=indexed."""
    d, T, seed = run.data, run.train.seq_length, run.train.seed
    if d.name == "embedded":
        if rank == 0:
            corpus = EmbeddedCorpus(d.cache_dir, d.tokenizer_vocab_size)
        if dist.is_initialized():
            dist.barrier()
        if rank != 0:
            corpus = EmbeddedCorpus(d.cache_dir, d.tokenizer_vocab_size, progress=False)
        vocab, sources = corpus.vocab_size, [(1.0, corpus.documents)]
    else:
        from ..data.indexed import IndexedDataset, IndexedDatasetError

        sources = []
        for w, prefix in _parse_paths(d.paths):
            try:
                sources.append((w, IndexedDocuments(IndexedDataset(prefix), name=prefix)))
            except (IndexedDatasetError, FileNotFoundError, OSError) as e:
                raise ConfigError("data.paths", prefix, str(e)) from None
        vocab = 0
        if d.tokenizer:
            try:
                vocab = load_tokenizer(d.tokenizer).get_vocab_size()
            except (FileNotFoundError, OSError, Exception) as e:  # tokenizers raises its own exception type
                raise ConfigError("data.tokenizer", d.tokenizer, str(e).splitlines()[0]) from None
    if vocab > run.model.vocab_size:
        raise ConfigError("model.vocab_size", run.model.vocab_size, f"must be >= the tokenizer's vocabulary ({vocab})")
    splits = {"train": [], "valid": []}
    for w, docs in sources:
        ids = split_documents(len(docs), d.split)
        for name in splits:
            try:
                splits[name].append((w, PackedDataset(docs, ids[name], T, seed, f"{docs.name} ({name} split)")))
            except ValueError as e:
                raise ConfigError("train.seq_length", T, str(e)) from None
    out = []
    for name in ("train", "valid"):
        parts = splits[name]
        out.append(parts[0][1] if len(parts) == 1 else
                   BlendedDataset([p for _, p in parts], [w for w, _ in parts], name=f"{name} blend"))
    return out[0], out[1]


class Trainer:
    def __init__(self, run: RunConfig, run_dir: Path):
        self.run, self.run_dir = run, Path(run_dir)
        ds_engine.ensure_distributed()
        faults.install_collective_diagnostics()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        state.initialize_from_config(run, timeout=datetime.timedelta(minutes=run.parallel.timeout_minutes))
        set_sequence_parallel(run.parallel.sequence_parallel and run.parallel.tp > 1)
        self.dp, self.dp_rank = state.get_data_parallel_world_size(), state.get_data_parallel_rank()
        self.dp_group = state.get_data_parallel_group()
        # context parallelism: the CP ranks of a data-parallel replica read the same samples and the model keeps
        # each rank's share of every sequence; statistics of distinct tokens are summed over dp x cp
        self.cp = state.get_context_parallel_world_size()
        self.dp_cp_group, self.dp_cp_rank = state.get_data_parallel_group(True), state.get_data_parallel_rank(True)
        self.tp, self.tp_rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
        # pipeline parallelism: this rank's stage holds whole AttnRes blocks; the embedding on the first stage, the
        # final norm, LM head and loss on the last; 1F1B over point-to-point (parallel/pipeline.py)
        self.pp, self.pp_rank = state.get_pipeline_model_parallel_world_size(), state.get_pipeline_model_parallel_rank()
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == self.pp - 1
        self.link = pipeline.StageLink(state.get_pipeline_model_parallel_group()) if self.pp > 1 else None
        self.device = _device(run)
        t = run.train
        self.num_micro = t.global_batch_size // (t.micro_batch_size * self.dp)
        self.train_ds, self.valid_ds = build_data(run, self.rank)
        torch.manual_seed(t.seed)
        stage = pipeline.stage_spec(run.model, self.pp, self.pp_rank) if self.pp > 1 else None
        model = K3ForCausalLM(run.model, stage=stage).to(self.device)
        prepare_model_for_precision(model, run.precision, self.device)
        # optim=adamw or muon over the dense parameters (ZeRO-1/2 Muon: optim/zero.py, attached by initialize);
        # routed experts under expert parallelism: their own optimizer, reduced over expert data parallel
        optimizer, self.experts = ds_engine.build_optimizers(model, run)
        self.engine = ds_engine.initialize(model, optimizer, run)
        if self.experts is not None:
            ds_engine.install_norm(self.engine, self.experts)
        self.model = self.engine.module
        self.moe = self.model.moe_layers()
        self.balancers = balancing.install(self.model, run.moe, state.get_group("tp-dp-cp"),
                                           t.global_batch_size * t.seq_length)
        self.moe_layer_ids = [i for i, ty in enumerate(run.model.ffn_types()) if ty == "moe"]
        # the rows of the (global) per-layer routing statistics that this stage's MoE layers fill
        self.moe_rows = [self.moe_layer_ids.index(i) for i, layer in self.model.model.numbered_layers()
                         if layer.ffn_type == "moe"]
        self.stats = ModelStats(self.model)  # router entropy / bias, AttnRes depth weights
        self.flops_per_token = train_flops_per_token(run.model, run.train.seq_length)
        self.step, self.consumed, self.tokens = 0, 0, 0
        self.skipped, self.consecutive_skips = 0, 0  # steps skipped for non-finite values: in total, in a row
        self._last_samples = None
        self.ckpt_dir = Path(run.checkpoint.dir) if run.checkpoint.dir else self.run_dir / "checkpoints"
        self.start_time = time.time()

    # ------------------------------------------------------------------ resume / save
    def maybe_resume(self):
        try:
            path = resolve_load_path(self.run.checkpoint.load, self.ckpt_dir)
        except FileNotFoundError as e:
            raise ConfigError("checkpoint.load", self.run.checkpoint.load, str(e)) from None
        if path is None:
            if self.run.checkpoint.load == "auto":
                log.info("checkpoint.load=auto: no checkpoint in %s, starting fresh", self.ckpt_dir)
            return
        try:
            meta = read_meta(path)
            self._check_model_config(path, meta)
            saved_tp = int(meta.get("tensor_parallel", 1))
            saved_pp = int(meta.get("pipeline_parallel", 1))
            dims = {n: getattr(p, "tp_split_dim", None) for n, p in self.model.named_parameters()}
            if saved_tp == self.tp and saved_pp == self.pp:
                model_t, optim_t, extra = read_shard(path, self._shard_suffix())
            elif saved_tp == self.tp:  # another pipeline split: the stage files merged, this stage's tensors kept
                model_t, optim_t, extra = ckpt.read_stages(path, meta, self.tp_rank)
                model_t, optim_t = self._own(model_t), self._own(optim_t)
                log.info("re-staging %s: saved with pipeline_parallel=%d, loading with %d", path, saved_pp, self.pp)
            else:  # resharding: merge the saved shards, keep this rank's slice
                model_t, optim_t, extra = ckpt.read_full(path, meta)
                model_t, optim_t = self._own(model_t), self._own(optim_t)
                model_t, optim_t = ckpt.split_shard(model_t, optim_t, dims, self.tp, self.tp_rank)
                log.info("resharding %s: saved with tensor_parallel=%d, loading with %d", path, saved_tp, self.tp)
            rng = ckpt.load_pickle_safely(path / "rng.pt") if (path / "rng.pt").is_file() else None
        except (ckpt.CheckpointError, FileNotFoundError, OSError) as e:
            raise ConfigError("checkpoint.load", str(path), str(e)) from None
        named = list(self.model.named_parameters())
        missing = [n for n, _ in named if n not in model_t]
        if missing:
            raise ConfigError("checkpoint.load", str(path), f"parameters missing from the checkpoint: {missing[:5]}")
        for n, p in named:
            want = tuple(p.shape) if not ds_engine.is_expert_parallel(p) else (p.shape[0] * p.ep_size, *p.shape[1:])
            if tuple(model_t[n].shape) != want:
                raise ConfigError("checkpoint.load", str(path), f"{n}: saved shape {tuple(model_t[n].shape)}, this "
                                  f"model (tp={self.tp}) needs {want}")
        buffers = {k: v for k, v in model_t.items() if k not in dict(named)}
        _, unexpected = self.model.load_state_dict(buffers, strict=False)
        if unexpected:
            raise ConfigError("checkpoint.load", str(path), f"tensors the model does not have: {unexpected[:5]}")
        ds_engine.load_full_states(self.engine, named, model_t, optim_t, extra["optimizer_scalars"], self.experts)
        ranks = (rng or {}).get("ranks", [])
        if len(ranks) == self.world:
            ckpt.set_rng_state(ranks[self.rank])
        else:
            if rng is not None and self.rank == 0:
                log.warning("the checkpoint holds the RNG states of %d ranks and this run has %d: every rank takes "
                            "the saved rank-0 state", len(ranks), self.world)
            if ranks or "rng" in extra:  # a converted checkpoint (tools/convert_checkpoint.py --from-hf) has none
                ckpt.set_rng_state(ranks[0] if ranks else extra["rng"])
        self.step, self.consumed, self.tokens = meta["step"], meta["consumed_samples"], meta["tokens"]
        if meta.get("global_batch_size") != self.run.train.global_batch_size:
            log.warning("resuming with global_batch_size %s (checkpoint had %s)",
                        self.run.train.global_batch_size, meta.get("global_batch_size"))
        log.info("resumed from %s at step %d (%d samples consumed)", path, self.step, self.consumed)

    def _own(self, tensors: dict) -> dict:
        """The entries of a whole-model dict that this rank's pipeline stage holds."""
        own = self.model.state_dict()
        return {k: v for k, v in tensors.items() if k in own}

    # Model keys that may change between a save and a resume: they do not change any tensor or what it means.
    RESUMABLE_MODEL_KEYS = ("name", "kda_chunk_size", "moe_overflow", "moe_capacity_factor", "initializer_range",
                            "kda_a_log_init")

    def _check_model_config(self, path, meta: dict):
        saved = meta.get("model")
        if saved is None:
            return
        current = dataclasses.asdict(self.run.model)
        # the layer pattern may be spelled as a list or as a period: compare what it resolves to
        pattern = ("mla_layers", "mla_every", "mla_at_last")
        diff = ckpt.config_diff({k: v for k, v in saved.items() if k not in pattern},
                                {k: v for k, v in current.items() if k not in pattern})
        try:
            from ..config import ModelConfig

            saved_types = ModelConfig(**saved).layer_types()
        except (TypeError, ValueError):
            saved_types = None
        if saved_types is not None and saved_types != self.run.model.layer_types():
            diff.append(("layer_types()", saved_types, self.run.model.layer_types()))
        hard = [d for d in diff if d[0] not in self.RESUMABLE_MODEL_KEYS]
        if hard:
            listed = "; ".join(f"model.{k}: checkpoint {a!r}, this run {b!r}" for k, a, b in hard)
            raise ConfigError("model", self.run.model.name, f"does not match the checkpoint {path}: {listed}")
        if diff and self.rank == 0:
            log.info("resuming with changed runtime model settings: %s",
                     ", ".join(f"model.{k} {a!r} -> {b!r}" for k, a, b in diff))

    def _shard_suffix(self) -> str:
        return ckpt.shard_suffix(self.tp, self.tp_rank, self.pp, self.pp_rank)

    def save(self):
        """Every rank takes part (ZeRO gathers each parameter's partitions over DP, experts are gathered over EP);
        data-parallel rank 0 of each tensor-parallel shard writes its files into one temporary directory, rank 0
        adds every rank's RNG state and commits (meta.json, rename into place, `latest` last)."""
        named = list(self.model.named_parameters())
        meta = {"step": self.step, "consumed_samples": self.consumed, "tokens": self.tokens,
                "global_batch_size": self.run.train.global_batch_size, "seed": self.run.train.seed,
                "tensor_parallel": self.tp, "expert_parallel": self.run.parallel.ep, "context_parallel": self.cp,
                "pipeline_parallel": self.pp,
                "world_size": self.world,
                "data_parallel": self.dp, "zero_stage": self.run.parallel.zero_stage, "optimizer": self.run.optim.name,
                "tp_split_dims": {n: getattr(p, "tp_split_dim", None) for n, p in named},
                "lr_schedule": "derived from step (optim.*)",
                "model": dataclasses.asdict(self.run.model), "config": _plain(dataclasses.asdict(self.run))}
        weights, states, scalars = ds_engine.full_states(self.engine, named, self.experts)
        rngs = [None] * self.world
        dist.all_gather_object(rngs, ckpt.rng_state())
        if self.pp > 1:  # every stage's parameters' split dimensions (meta.json is written by rank 0)
            dims = [None] * self.world
            dist.all_gather_object(dims, meta["tp_split_dims"])
            meta["tp_split_dims"] = {k: v for d in dims for k, v in d.items()}
        tmp, final = ckpt.begin(self.ckpt_dir, self.step, unique=False) if self.rank == 0 else (None, None)
        dist.barrier()
        tmp = self.ckpt_dir / f".tmp-step_{self.step:08d}"
        if self.dp_cp_rank == 0:  # one writer per (tensor-parallel shard, pipeline stage)
            model_t = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            model_t.update(weights)  # fp32 masters over the module's (possibly bf16) parameters
            for k in [k for k in model_t if k not in weights and k not in dict(self.model.named_buffers())]:
                del model_t[k]  # aliases of tied parameters: stored once
            ckpt.write_shard(tmp, self._shard_suffix(), model_t, states,
                             {"rng": ckpt.rng_state(), "optimizer_scalars": scalars})
        if self.rank == 0:
            ckpt.write_rng(tmp, rngs)
        dist.barrier()
        if self.rank == 0:
            log.info("saved checkpoint %s", ckpt.commit(tmp, final, meta, self.run.checkpoint.keep_last))
        dist.barrier()

    # ------------------------------------------------------------------ one step
    def _samples(self, dataset, consumed: int, micro: int) -> list:
        ids = rank_sample_ids(consumed, micro, self.dp_rank, self.dp, self.run.train.micro_batch_size)
        return [dataset.sample(c) for c in ids]

    def _forward(self, samples, state_in=None):
        """(output, tokens). Under pipeline parallelism a stage after the first starts from `state_in`, the packed
        ResidualState it received, and a stage before the last returns its packed ResidualState as the output."""
        b = make_batch(samples, self.run.data.reset_at_document_boundaries)
        st = None if state_in is None else pipeline.unpack(state_in, self.run.model.attn_res)
        with forward_context(self.run.precision, self.device):
            out = self.model(b.input_ids.to(self.device), labels=b.labels.to(self.device),
                             cu_seqlens=None if b.cu_seqlens is None else b.cu_seqlens.to(self.device), state_in=st)
        if not self.last_stage:
            out = pipeline.pack(out)
        return out, b.num_tokens

    def train_step(self) -> dict:
        t0 = time.time()
        self.model.train()
        o = self.run.optim
        lr = lr_at(self.step + 1, self.run.train.steps, o.lr, o.min_lr, o.warmup_steps, o.decay)
        for g in self.engine.optimizer.param_groups + (self.experts.param_groups if self.experts else []):
            g["lr"] = lr
        loss_sum = torch.zeros((), dtype=torch.float64)
        loads = torch.zeros(len(self.moe_layer_ids), self.run.model.num_experts, dtype=torch.float64)
        dropped = torch.zeros((), dtype=torch.float64)
        tokens = 0
        self._norm0, self._applied = None, True
        if self.pp > 1:
            loss_sum, tokens, dropped = self._pipeline_step(loads, dropped)
        for micro in range(self.num_micro if self.pp == 1 else 0):
            samples = self._samples(self.train_ds, self.consumed, micro)
            out, n = self._forward(samples)
            if not bool(torch.isfinite(out.loss.detach())):
                self._last_samples = samples  # the batch a diagnosis re-runs
            self.engine.backward(out.loss)  # DeepSpeed scales by 1/num_micro and reduces at the boundary
            self._after_backward(micro, samples)
            loss_sum += out.loss.detach().double().cpu()
            tokens += n
            dropped += self._routing(loads)
            self.stats.accumulate()
        applied, norm0 = self._applied, self._norm0
        loss = loss_sum / self.num_micro
        if self.world > 1:  # statistics of the global batch; each TP rank routes its own 1/tp of the tokens
            # (every CP rank's loss is already its sequences' whole mean; its routing counts are its own tokens')
            stats = torch.cat([loss.view(1), dropped.view(1), loads.flatten()]).to(self.device)
            if self.pp > 1:  # the loss from the last stage, each stage's MoE layers' counts in their own rows
                dist.all_reduce(stats, group=state.get_pipeline_model_parallel_group())
            dist.all_reduce(stats, group=self.dp_cp_group)
            if self.tp > 1:
                stats[1:] = ds_engine.tp_sum(stats[1:])
            loss, dropped, loads = stats[0].cpu() / (self.dp * self.cp), stats[1].cpu(), stats[2:].cpu().view_as(loads)
            tokens *= self.dp
        grad_norm = norm0 if self.run.parallel.zero_stage == 0 else self.engine.get_global_grad_norm()
        for b in self.balancers:  # the next step routes with the bias this step's scores call for
            b.step() if applied else b.discard()
        if applied:
            self.consecutive_skips, self._last_samples = 0, None
        else:
            self.skipped += 1
            self.consecutive_skips += 1
            if self.rank == 0:
                log.warning("step %d: non-finite loss or gradient (loss %s, grad_norm %s): step skipped (%d in a row, "
                            "%d in total)", self.step + 1, float(loss), float(grad_norm) if grad_norm is not None
                            else None, self.consecutive_skips, self.skipped)
        self.step += 1
        self.consumed += self.run.train.global_batch_size
        self.tokens += tokens
        dt = time.time() - t0
        rec = {"step": self.step, "loss": float(loss), "lr": lr, "skipped": int(not applied),
               "skipped_total": self.skipped,
               "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
               "tokens": self.tokens, "tokens_per_s": tokens / dt, "step_time_s": dt,
               **throughput(self.flops_per_token, tokens, dt, self.run.cluster.peak_tflops_bf16, self.world),
               "memory": memory_stats(self.device), **self.stats.collect()}
        if self.moe_layer_ids:
            bias_LE = torch.zeros(len(self.moe_layer_ids), self.run.model.num_experts)
            for row, m in zip(self.moe_rows, self.moe):
                bias_LE[row] = m.gate.e_score_correction_bias.detach().float().cpu()
            if self.pp > 1:  # every stage's routers
                bias_LE = bias_LE.to(self.device)
                dist.all_reduce(bias_LE, group=state.get_pipeline_model_parallel_group())
                bias_LE = bias_LE.cpu()
            st = expert_load_stats(loads, assignments_total=tokens * self.run.model.top_k, dropped=float(dropped),
                                   bias_LE=bias_LE)
            rec["expert_load"] = st["summary"]
            rec["expert_load_per_layer"] = dict(st["per_layer"], layers=self.moe_layer_ids)
        return rec, loads

    def _routing(self, loads: torch.Tensor) -> torch.Tensor:
        """Add this stage's MoE layers' token counts of the last forward to their rows; returns the dropped count."""
        dropped = torch.zeros((), dtype=torch.float64)
        for row, m in zip(self.moe_rows, self.moe):
            loads[row] += m.tokens_per_expert_E.double().cpu()
            dropped += m.dropped_assignments.double().cpu()
        return dropped

    def _after_backward(self, micro: int, samples):
        """After a micro-batch's backward: DeepSpeed's step (a no-op except after the last micro-batch), and at the
        boundary the experts' reduction and step and whether the step was applied (self._applied)."""
        last = micro == self.num_micro - 1
        if last and self.experts is not None:
            self.experts.reduce_gradients()
        if last and self.run.parallel.zero_stage == 0:
            self._norm0 = ds_engine.grad_norm_without_zero(self.model)
        if last and self.run.parallel.zero_stage == 0 and not math.isfinite(self._norm0):
            # without ZeRO DeepSpeed would apply it: let it finish its step bookkeeping without the update
            with _no_optimizer_step(self.engine.optimizer):
                self.engine.step()
        else:
            self.engine.step()  # a no-op except after the last micro-batch
        if last:
            # ZeRO skips a step whose global norm (experts included) is not finite; ZeRO-0: dropped above
            self._applied = (math.isfinite(self._norm0) if self.run.parallel.zero_stage == 0
                             else bool(self.engine.was_step_applied()))
            if self.experts is not None:  # (ep > 1 implies ZeRO >= 1)
                if self._applied:
                    self.experts.step(float(self.engine.get_global_grad_norm()), self.run.train.grad_clip)
                else:
                    self.experts.skip()
        if last and self._last_samples is None and not self._applied:
            self._last_samples = samples

    def _pipeline_step(self, loads: torch.Tensor, dropped: torch.Tensor) -> tuple:
        """One step's micro-batches through this stage in the 1F1B order (parallel/pipeline.py); returns (loss sum
        over the micro-batches -- zero except on the last stage --, tokens, dropped assignments).

        The last stage back-propagates its loss, which DeepSpeed scales by 1/num_micro. An earlier stage
        back-propagates the surrogate sum(y * g) of its output y and the gradient g it received: its gradient with
        respect to y is exactly g, which already carries the 1/num_micro, so it is not scaled again
        (scale_wrt_gas=False). Going through engine.backward keeps DeepSpeed's accumulation and boundary
        bookkeeping. The gradient of the received input is sent back before the boundary step, whose collectives
        (the global norm over tp x pp) the previous stage joins only after receiving it."""
        loss_sum = torch.zeros((), dtype=torch.float64)
        tokens, held = 0, {}
        for kind, micro in pipeline.schedule_1f1b(self.num_micro, self.pp, self.pp_rank):
            if kind == "F":
                samples = self._samples(self.train_ds, self.consumed, micro)
                x = None if self.first_stage else self.link.recv_forward(self.device).requires_grad_()
                out, n = self._forward(samples, x)
                tokens += n
                dropped += self._routing(loads)
                self.stats.accumulate()
                if self.last_stage:
                    y = out.loss
                    if not bool(torch.isfinite(y.detach())):
                        self._last_samples = samples
                    loss_sum += y.detach().double().cpu()
                else:
                    y = out
                    self.link.send_forward(y)
                held[micro] = (samples, x, y)
            else:
                samples, x, y = held.pop(micro)
                if self.last_stage:
                    self.engine.backward(y)
                else:
                    g = self.link.recv_backward(y)
                    self.engine.backward((y * g).sum(), scale_wrt_gas=False)
                if not self.first_stage:
                    self.link.send_backward(x.grad if x.grad is not None else torch.zeros_like(x))
                self._after_backward(micro, samples)
        self.link.wait()
        return loss_sum, tokens, dropped

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total, n = 0.0, 0
        for it in range(self.run.train.eval_iters):  # the same held-out samples at every evaluation
            x = None if self.first_stage else self.link.recv_forward(self.device)
            out, _ = self._forward(self._samples(self.valid_ds, 0, it), x)
            if self.last_stage:
                total += out.loss.double().item()
            else:
                self.link.send_forward(out)
            n += 1
        val = torch.tensor([total / n], dtype=torch.float64)
        if self.pp > 1:  # the last stage's value on every stage
            self.link.wait()
            val = val.to(self.device)
            dist.all_reduce(val, group=state.get_pipeline_model_parallel_group())
            val = val.cpu()
        if self.dp > 1:
            val = val.to(self.device)
            dist.all_reduce(val, group=self.dp_group)
            val = val.cpu() / self.dp
        return float(val)

    # ------------------------------------------------------------------ the loop
    def fit(self, config_dict: dict) -> dict:
        t = self.run.train
        self.maybe_resume()
        logger = MetricsLogger(self.run_dir, self.run.logging.wandb, config_dict, self.moe_layer_ids,
                               enabled=self.rank == 0)
        last = {}
        preemption = faults.Preemption()
        try:
            if self.rank == 0:
                log.info("training %s: %d params, %d steps of %d sequences x %d tokens (%d micro-batches of %d "
                         "per rank, dp=%d) on %s", self.run.model.name,
                         sum(p.numel() for p in self.model.parameters()), t.steps, t.global_batch_size,
                         t.seq_length, self.num_micro, t.micro_batch_size, self.dp, self.device)
            while self.step < t.steps:
                rec, loads = self.train_step()
                if t.eval_interval and (self.step % t.eval_interval == 0 or self.step == t.steps):
                    rec["eval_loss"] = self.evaluate()
                    rec["eval_ppl"] = perplexity(rec["eval_loss"])
                if self.step % t.log_interval == 0 or self.step == t.steps or "eval_loss" in rec:
                    logger.log(rec, loads)
                    if self.rank == 0:
                        log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f %.0f tok/s%s", self.step, t.steps,
                                 rec["loss"], rec["lr"], rec["grad_norm"], rec["tokens_per_s"],
                                 f" eval_loss {rec['eval_loss']:.4f}" if "eval_loss" in rec else "")
                last = rec
                if self.consecutive_skips >= t.max_consecutive_skips:
                    self._stop_nonfinite()
                preempted = preemption.requested(self.device)
                exit_now = (t.exit_interval and self.step % t.exit_interval == 0) or (
                    t.exit_duration_mins and (time.time() - self.start_time) / 60 >= t.exit_duration_mins)
                if (self.step == t.steps or exit_now or preempted
                        or (t.save_interval and self.step % t.save_interval == 0)):
                    self.save()
                if preempted:
                    if self.rank == 0:
                        log.warning("preempted (%s) at step %d: checkpoint saved, exiting",
                                    preemption.received or "signal on another rank", self.step)
                    last = dict(last, preempted=True)
                    break
                if exit_now and self.step < t.steps:
                    log.info("exit requested at step %d (exit_interval / exit_duration_mins); checkpoint saved",
                             self.step)
                    break
        finally:
            preemption.restore()
            logger.close()
        return last

    def _stop_nonfinite(self):
        """Too many skipped steps in a row: find where the non-finite values start, then stop (nothing is saved:
        the newest checkpoint is the last good state)."""
        where = "no batch to re-run"
        if self.pp > 1:
            where = "not diagnosed under pipeline parallelism (a stage cannot re-run the forward alone)"
        elif self._last_samples is not None:
            self.model.train()
            where = faults.diagnose_nonfinite(self.model, lambda: self._forward(self._last_samples)[0].loss)
        places = [None] * self.world
        dist.all_gather_object(places, where)
        first = next(((r, w) for r, w in enumerate(places) if not w.startswith("nothing")), (0, places[0]))
        raise faults.NonFiniteError(
            f"steps {self.step - self.consecutive_skips + 1}..{self.step} had non-finite loss or gradients "
            f"({self.consecutive_skips} in a row = train.max_consecutive_skips): {first[1]} (rank {first[0]}); "
            f"stopping. The newest checkpoint in {self.ckpt_dir} holds the last good state.")

