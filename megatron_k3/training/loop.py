"""The training loop: micro-batches and gradient accumulation to the global batch, warmup + cosine LR, gradient
clipping, fp32 or bf16 autocast, periodic evaluation, metrics, checkpoints and exact resume.

The Trainer builds this rank's part of the model (megatron_k3.parallel.build_model) and hands it to the
DeepSpeed engine (engine.py): ZeRO-1/2 over the data-parallel group, gradient accumulation and clipping. Each
data-parallel rank reads its slice of every global batch (`rank_sample_ids`), so the order of samples does not
depend on the layout. Checkpoints: checkpoint/; pipeline stages run the 1F1B order of parallel/pipeline.py.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..config import ConfigError, RunConfig
from ..data.build import build_data
from ..data.dataset import make_batch, rank_sample_ids
from ..errors import DataError
from ..ops.numerics import start_cpu_threads
from ..optim.schedule import lr_at
from ..parallel import ParallelGroups, build_model, pipeline, recompute, state, tiling
from ..parallel import mappings as M
from ..parallel.balanced import balanced_layers
from ..planning.run import check_fits, resolve_recompute
from ..planning.run import layout as plan_layout
from ..precision import forward_context, prepare_model_for_precision
from . import adapters, balancing, faults
from . import compile as compile_regions
from . import engine as ds_engine
from .checkpoint import CheckpointManager, Position
from .checkpoint import directory as ckpt_dir
from .expert_optimizer import install_norm
from .guard import Alarms, SpikeGuard, Stragglers
from .metrics import (
    MetricsLogger,
    ModelStats,
    RoutingStats,
    expert_load_stats,
    media_train_flops,
    memory_stats,
    perplexity,
    throughput,
    train_flops_per_token,
)

log = logging.getLogger("megatron_k3.train")


def _device(run: RunConfig) -> torch.device:
    """The run's device; on the CPU, its thread pool started by a throwaway parallel exp before anything that counts
    (ops.numerics.start_cpu_threads says why)."""
    if run.train.device == "cuda" or (run.train.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda", "no CUDA device is visible; use cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    start_cpu_threads()
    return torch.device("cpu")


@dataclass
class _Step:
    """One step on this rank: its micro-batches' samples, what they add up, and how the optimizer step went."""
    loads: torch.Tensor
    samples: list  # per micro-batch: the samples it reads (all read before any compute)
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    dropped: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    ep_balance: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.float64))  # RoutingStats
    tokens: int = 0
    media_flops: float = 0.0  # the vision tower's model FLOPs on this rank's media
    applied: bool = True  # the optimizer step was taken (a non-finite global norm skips it)
    norm0: float | None = None  # the gradient norm under ZeRO-0 (DeepSpeed reports none)
    nonfinite: list | None = None  # the samples of the last micro-batch whose loss was not finite
    weights: list | None = None  # train.loss_average=token: each micro-batch's loss weight (_loss_weights)
    loss_tokens: int = 0  # the global batch's loss tokens (labels not ignored)
    guard: tuple | None = None  # train.guard's judgement before the update: (reason or None, loss, grad norm, z)
    rerun: bool = False  # train.guard.policy=rerun: this pass was withheld, the step runs again
    first: dict | None = None  # the second pass of a re-run step: the first pass's judgement and local loss
    fault: tuple | None = None  # the re-run found other numbers: (ranks, first global loss, second)
    # this rank's own result (train.guard.policy=rerun compares it between passes): its loss on the last pipeline
    # stage, the sum of the activations it sends on the others
    fingerprint: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))


class Trainer:
    def __init__(self, run: RunConfig, run_dir: Path):
        self.run, self.run_dir = run, Path(run_dir)
        ds_engine.ensure_distributed()
        faults.install_collective_diagnostics()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        ps = state.initialize_from_config(run, timeout=datetime.timedelta(minutes=run.parallel.timeout_minutes))
        self.ps = ps  # this rank's process groups, handed to what needs them
        faults.install_collective_diagnostics(ps)  # a failed collective now names its group
        self.dp, self.dp_rank, self.dp_group = ps.size("dp"), ps.rank_in("dp"), ps.group("dp")
        # context parallelism: the CP ranks of a data-parallel replica read the same samples and the model keeps
        # each rank's share of every sequence; statistics of distinct tokens are summed over dp x cp
        self.cp, self.dp_cp_group, self.tp = ps.size("cp"), ps.group("dp-cp"), ps.size("tp")
        # pipeline parallelism: this rank's stage holds whole AttnRes blocks; the embedding on the first stage, the
        # final norm, LM head and loss on the last; 1F1B over point-to-point (parallel/pipeline.py)
        self.pp, self.pp_rank, self.pp_group = ps.size("pp"), ps.rank_in("pp"), ps.group("pp")
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == self.pp - 1
        self.link = pipeline.StageLink(self.pp_group) if self.pp > 1 else None
        self.device = _device(run)
        t = run.train
        if t.compile:  # a compiler that cannot work here stops the run now, in one line, before anything is built
            compile_regions.check_backend(t.compile_backend, self.device)
        if t.deterministic:
            compile_regions.set_deterministic(True, self.device)
        self.num_micro = t.global_batch_size // (t.micro_batch_size * self.dp)
        self.train_ds, self.valid_ds = build_data(run, self.rank)
        self._steps_from_epochs()
        self.token_loss = t.loss_average == "token" or (t.loss_average == "auto" and run.data.name == "chat")
        # a layout the planner puts over the device's memory is refused here, on every rank, before any allocation;
        # train.recompute=auto becomes the least recomputation the planner says fits
        self.recompute = resolve_recompute(run, self.world)
        check_fits(run, self.world, self.recompute)
        model = self._build_model(ps)
        # optim=adamw or muon over the dense parameters (ZeRO-1/2 Muon: optim/zero.py, attached by initialize);
        # routed experts under expert parallelism: their own optimizer, reduced over expert data parallel
        optimizer, self.experts = ds_engine.build_optimizers(model, run, ps)
        self.engine = ds_engine.initialize(model, optimizer, run, ps)
        if self.experts is not None:
            install_norm(ds_engine.zero_optimizer(self.engine), self.experts)
        self.model = self.engine.module
        self._wrap_layers()
        self.moe = self.model.moe_layers()
        # peft=lora: the routers' selection bias is part of the frozen base (adapters only change): no balancing
        self.balancers = [] if run.peft.enabled else balancing.install(self.model, run.moe, ps.group("tp-dp-cp"),
                                                                         t.global_batch_size * t.seq_length)
        self.routing = RoutingStats(self.model)  # expert load, in the rows of every stage's MoE layers
        self.balanced_ep = bool(self.routing.layer_ids) and run.model.moe_overflow == "balanced" and run.parallel.ep > 1
        for b, _ in balanced_layers(self.model):  # moe.replica_exchange=step: once per step (engine.boundary_step)
            b.cache_weights = run.moe.replica_exchange == "step"
        self.stats = ModelStats(self.model)  # router entropy / bias, AttnRes depth weights
        self.flops_per_token = train_flops_per_token(run.model, run.train.seq_length)
        self.pos = Position()
        self.skips = faults.SkipCounter()  # steps skipped for non-finite values: in total, in a row
        self.guard, self.alarms = SpikeGuard(t.guard), Alarms(t.guard)  # train.guard (training/guard.py)
        self.stragglers = Stragglers(t.guard, self.rank, self.world, self._nodes())
        self.diagnose_samples = None  # the batch a non-finite diagnosis re-runs: the last skipped step's
        self.ckpt_dir = Path(run.checkpoint.dir) if run.checkpoint.dir else self.run_dir / "checkpoints"
        self.checkpoints = CheckpointManager(run, self.engine, self.experts, ps, self.ckpt_dir)
        self.checkpoints.extra_meta = lambda: {"guard": self.guard.state()}  # a resumed run judges alike
        self.start_time = time.time()

    def _build_model(self, ps):
        """This rank's part of the model (its stage, shards and experts), built on the meta device and initialised in
        place from train.seed: the same weights in every layout (parallel.plan.build_model); its precision set up;
        under peft=lora the base frozen (routed experts as MXFP4 codes) and adapters on the targets, the targets and
        the base directory checked before anything is allocated (training/adapters.py)."""
        run, t = self.run, self.run.train
        if run.peft.enabled:
            adapters.check(run)
        torch.manual_seed(t.seed)
        groups = ParallelGroups.from_state(ps, run.parallel.sequence_parallel)
        model = build_model(run.model, groups, self.device, seed=t.seed,
                            redundant_experts=run.moe.slots(run.model, run.parallel))
        prepare_model_for_precision(model, run.precision, self.device)
        self.peft = adapters.apply(model, run, groups, self.rank) if run.peft.enabled else None
        return model

    def _nodes(self) -> list:
        """Every rank's host name (train.guard.straggler_interval names a slow rank's node); one gather at start."""
        names = [socket.gethostname()] * self.world
        if self.run.train.guard.straggler_interval and self.world > 1:
            dist.all_gather_object(names, socket.gethostname())
        return names

    def _wrap_layers(self) -> None:
        """train.compile: each decoder layer one compiled region (training/compile.py); then activation
        recomputation, offload and sequence tiling wrap this rank's regions from outside (parallel/recompute.py,
        offload.py, tiling.py), around the compiled layers."""
        run, t = self.run, self.run.train
        if t.compile:
            n = compile_regions.compile_layers(self.model, t.compile_backend, t.compile_cache, t.compile_split)
            log.info("train.compile: %d decoder layers compiled (%s, split at %s), cache %s", n, t.compile_backend,
                     t.compile_split, os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
        lay = plan_layout(run, self.world, self.recompute)
        wrapped = recompute.apply(self.model, recompute.Policy(self.recompute, lay.recompute_modules,
                                                               lay.recompute_num_layers, int(lay.offload_bytes)))
        wrapped.update(tiling.apply(self.model, t.tile_tokens, run.model.moe_overflow))
        if self.rank == 0 and (wrapped or t.recompute == "auto"):
            log.info("train.recompute=%s%s, train.tile_tokens=%d: %s", self.recompute,
                     " (auto: the least the planner says fits)" if t.recompute == "auto" else "", t.tile_tokens,
                     ", ".join(f"{k} {v}" for k, v in wrapped.items()) or "nothing wrapped")
        if self.rank == 0 and t.offload_buffer_gb and self.recompute != "full":
            log.warning("train.offload_buffer_gb=%g unused: it offloads the layer inputs full recomputation keeps, and "
                        "train.recompute=auto resolved to %s", t.offload_buffer_gb, self.recompute)

    def _steps_from_epochs(self) -> None:
        """train.epochs > 0: train.steps becomes the steps of that many passes over the training split (the same
        number on every rank and on resume: the split and the packing are fixed by the data and train.seed)."""
        t = self.run.train
        if t.epochs:
            t.steps = max(1, math.ceil(t.epochs * len(self.train_ds) / t.global_batch_size))
            if self.rank == 0:
                log.info("train.epochs=%g: %d samples per epoch, global batch %d: train.steps=%d", t.epochs,
                         len(self.train_ds), t.global_batch_size, t.steps)

    @property
    def step(self) -> int:
        return self.pos.step

    def maybe_resume(self):
        self.pos = self.checkpoints.resume() or self.pos
        self.guard.load(self.checkpoints.saved.get("guard"))

    def save(self, blocking: bool | None = None):
        """A checkpoint of the current position (async when checkpoint.async_save, unless blocking)."""
        self.checkpoints.save(self.pos, blocking)

    # ------------------------------------------------------------------ one step
    def _samples(self, dataset, consumed: int, micro: int) -> list:
        ids = rank_sample_ids(consumed, micro, self.dp_rank, self.dp, self.run.train.micro_batch_size)
        return [dataset.sample(c) for c in ids]

    def _forward(self, samples, state_in=None):
        """(output, tokens). Under pipeline parallelism a stage after the first starts from `state_in`, the packed
        ResidualState it received, and a stage before the last returns its packed ResidualState as the output."""
        b = make_batch(samples, self.run.data.reset_at_document_boundaries)
        st = None if state_in is None else pipeline.unpack(state_in, self.run.model.attn_res)
        media = {}
        if self.first_stage and b.pixel_values is not None:  # the vision tower sits with the embedding
            media = {"pixel_values": b.pixel_values.to(self.device), "grid_thws": b.grid_thws}
        with forward_context(self.run.precision, self.device):
            out = self.model(b.input_ids.to(self.device), labels=b.labels.to(self.device),
                             cu_seqlens=None if b.cu_seqlens is None else b.cu_seqlens.to(self.device), state_in=st,
                             **media)
        if not self.last_stage:
            out = pipeline.pack(out)
        return out, b.num_tokens

    def _step_samples(self) -> list:
        """Every micro-batch's samples of this step, read before any compute. A sample that cannot be read (data=
        multimodal: a file changed or vanished after the start-up scan) stops the run on every rank, after a
        checkpoint of the last completed step, so nothing already trained is lost."""
        err, out = None, None
        try:
            out = [self._samples(self.train_ds, self.pos.consumed, m) for m in range(self.num_micro)]
        except DataError as e:
            err = e
        if not self.train_ds.reads_files:  # token datasets are read whole at start-up: nothing to agree on
            if err is not None:
                raise err
            return out
        bad = torch.tensor([0.0 if err is None else 1.0], device=self.device)
        if self.world > 1:
            dist.all_reduce(bad)
        if float(bad) > 0:
            self.save(blocking=True)
            if self.rank == 0:
                log.error("a training sample of step %d could not be read; checkpoint of step %d saved in %s",
                          self.pos.step + 1, self.pos.step, self.ckpt_dir)
            raise err or DataError("(another rank)", f"a training sample of step {self.pos.step + 1} could not be "
                                   "read there")
        return out

    def _forward_micro(self, acc: _Step, micro: int, x):
        """Micro-batch `micro` forward on this stage: the loss on the last stage, else the activation to send."""
        samples = acc.samples[micro]
        out, n = self._forward(samples) if x is None else self._forward(samples, x)
        acc.tokens += n
        acc.media_flops += sum(media_train_flops(self.run.model, s.grid_thws) for s in samples)
        acc.dropped += self.routing.add(acc.loads)
        acc.ep_balance = torch.maximum(acc.ep_balance, self.routing.ep_balance())
        self.stats.accumulate()
        if not self.last_stage:
            if self.guard.cfg.policy == "rerun":  # this rank's own numbers, for a re-run to compare
                acc.fingerprint += out.detach().double().sum().cpu()
            return out
        if not bool(torch.isfinite(out.loss.detach())):
            acc.nonfinite = samples
        loss = out.loss if acc.weights is None else out.loss * acc.weights[micro]
        acc.loss_sum += loss.detach().double().cpu()
        acc.fingerprint += loss.detach().double().cpu()
        return loss

    def _loss_weights(self, acc: _Step) -> None:
        """train.loss_average=token: the step's loss is the sum of every loss token's cross-entropy over the N loss
        tokens of the global batch. A micro-batch's loss is its own tokens' mean, which DeepSpeed divides by the
        micro-batches and data-parallel reduction by the ranks; so micro-batch m of n_m loss tokens is weighted
        n_m * num_micro * dp / N (exactly 1 when every micro-batch holds as many). One all-reduce of N per step."""
        T = self.run.train.seq_length
        counts = [sum(T if s.loss_mask is None else int(np.count_nonzero(s.loss_mask)) for s in m)
                  for m in acc.samples]
        total = torch.tensor([float(sum(counts))], dtype=torch.float64, device=self.device)
        if self.dp > 1:
            dist.all_reduce(total, group=self.dp_group)
        acc.loss_tokens = int(total.item())
        scale = self.num_micro * self.dp / max(acc.loss_tokens, 1)
        acc.weights = [c * scale for c in counts]

    def _backward_micro(self, micro: int, y, g):
        """The last stage back-propagates its loss, which DeepSpeed scales by 1/num_micro. An earlier stage
        back-propagates the surrogate sum(y * g) of its output y and the gradient g it received: its gradient with
        respect to y is exactly g, which already carries the 1/num_micro, so it is not scaled again
        (scale_wrt_gas=False). Going through engine.backward keeps DeepSpeed's accumulation and boundary
        bookkeeping."""
        M.ACCUMULATION.last = micro == self.num_micro - 1  # once-per-step gradient sums (parallel/mappings.py)
        if g is None:
            self.engine.backward(y)
        else:
            self.engine.backward((y * g).sum(), scale_wrt_gas=False)

    def train_step(self) -> tuple:
        t0 = time.time()
        self.model.train()
        o = self.run.optim
        lr = lr_at(self.pos.step + 1, self.run.train.steps, o.lr, o.min_lr, o.warmup_steps, o.decay)
        for g in self.engine.optimizer.param_groups + (self.experts.param_groups if self.experts else []):
            g["lr"] = lr
        acc = _Step(torch.zeros(len(self.routing.layer_ids), self.run.model.num_experts, dtype=torch.float64),
                    self._step_samples())
        if self.token_loss:
            self._loss_weights(acc)
        if getattr(self.model, "host_offload", None) is not None:  # every backward of the step before has run
            self.model.host_offload.reset()
        rng = ckpt_dir.rng_state() if self.guard.cfg.policy == "rerun" else None
        self._micro_batches(acc)
        if acc.rerun:  # train.guard.policy=rerun: a spike's update withheld; the same inputs once more
            acc = self._rerun(acc, rng)
        return self._finish_step(acc, lr, t0)

    def _micro_batches(self, acc: _Step) -> None:
        """Every micro-batch's forward and backward of the step (1F1B across pipeline stages), and the step."""
        def forward(micro, x):
            return self._forward_micro(acc, micro, x)

        def after_backward(micro):
            self._after_backward(acc, micro)

        if self.pp > 1:
            pipeline.run_1f1b(self.link, self.num_micro, self.device, forward, self._backward_micro, after_backward)
        else:
            for micro in range(self.num_micro):
                self._backward_micro(micro, forward(micro, None), None)
                after_backward(micro)

    def _finish_step(self, acc: _Step, lr: float, t0: float) -> tuple:
        applied, norm0, loads, dropped = acc.applied, acc.norm0, acc.loads, acc.dropped
        loss, tokens = acc.loss_sum / self.num_micro, acc.tokens
        if self.world > 1:  # statistics of the global batch; each TP rank routes its own 1/tp of the tokens
            # (every CP rank's loss is already its sequences' whole mean; its routing counts are its own tokens')
            stats = torch.cat([loss.view(1), dropped.view(1), loads.flatten()]).to(self.device)
            if self.pp > 1:  # the loss from the last stage, each stage's MoE layers' counts in their own rows
                dist.all_reduce(stats, group=self.pp_group)
            dist.all_reduce(stats, group=self.dp_cp_group)
            if self.tp > 1:
                dist.all_reduce(stats[1:], group=self.ps.group("tp"))
            loss, dropped, loads = stats[0].cpu() / (self.dp * self.cp), stats[1].cpu(), stats[2:].cpu().view_as(loads)
            tokens *= self.dp
            if acc.media_flops:  # every data-parallel rank's media (the CP and TP ranks of one read the same)
                media = torch.tensor([acc.media_flops], dtype=torch.float64, device=self.device)
                dist.all_reduce(media, group=self.dp_group)
                acc.media_flops = float(media)
        grad_norm = norm0 if self.run.parallel.zero_stage == 0 else self.engine.get_global_grad_norm()
        for b in self.balancers:  # the next step routes with the bias this step's scores call for
            b.step() if applied else b.discard()
        guarded, grad_norm = self._guard_record(acc, applied, grad_norm)
        withheld = guarded.get("guard") not in (None, "nonfinite")  # by train.guard, not for non-finite values
        if self.skips.count(applied or withheld, self.pos.step + 1, loss, grad_norm, self.rank == 0):
            self.diagnose_samples = None
        elif acc.nonfinite is not None or self.diagnose_samples is None:  # a non-finite loss, else the last batch
            self.diagnose_samples = acc.nonfinite if acc.nonfinite is not None else acc.samples[-1]
        self.pos.step += 1
        self.pos.consumed += self.run.train.global_batch_size
        self.pos.tokens += tokens
        dt = time.time() - t0
        rec = {"step": self.pos.step, "loss": float(loss), "lr": lr, "skipped": int(not applied),
               "skipped_total": self.skips.total,
               "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
               "tokens": self.pos.tokens, "tokens_per_s": tokens / dt, "step_time_s": dt,
               **({"loss_tokens": acc.loss_tokens} if self.token_loss else {}), **guarded,
               **throughput(self.flops_per_token, tokens, dt, self.run.cluster.peak_tflops_bf16, self.world,
                            acc.media_flops),
               "memory": memory_stats(self.device), **self.stats.collect()}
        if self.routing.layer_ids:
            st = expert_load_stats(loads, assignments_total=tokens * self.run.model.top_k, dropped=float(dropped),
                                   bias_LE=self.routing.bias(self.pp_group, self.device))
            rec["expert_load"] = st["summary"]
            rec["expert_load_per_layer"] = dict(st["per_layer"], layers=self.routing.layer_ids)
        if self.balanced_ep:  # the plan's outcome: max over micro-batches, MoE layers and EP groups
            ep = acc.ep_balance.to(self.device)
            dist.all_reduce(ep, op=dist.ReduceOp.MAX)
            rec["expert_load"].update(rank_max_over_mean=float(ep[0]), replicas=int(ep[1]))
        self._alarm(rec)
        self._stragglers(rec, dt)
        return rec, loads

    def _stragglers(self, rec: dict, seconds: float) -> None:
        """train.guard.straggler_interval: the slowest ranks of the interval, in the record and the log."""
        self.stragglers.add(seconds, faults.COLLECTIVE_SECONDS[0])
        if not self.stragglers.due(self.pos.step):
            return

        def gather(mine):  # on the device: NCCL gathers device tensors only
            mine = mine.to(self.device)
            rows = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(rows, mine)
            return torch.stack(rows).cpu()

        rec["stragglers"] = slow = self.stragglers.report(gather)
        if self.rank == 0:
            log.warning("steps %d-%d: slowest ranks (compute per step, its share of the slowest step, collective "
                        "wait): %s", self.pos.step - self.run.train.guard.straggler_interval + 1, self.pos.step,
                        "; ".join(f"rank {s['rank']} on {s['node']}: {s['compute_s']:.3g} s ({s['share']:.0%}), "
                                  f"waits {s['wait_s']:.3g} s" for s in slow))

    def _guard_record(self, acc: _Step, applied: bool, grad_norm) -> tuple:
        """({"guard": reason, ...} for a step train.guard withheld for a spike, else {}; the step's gradient norm, the
        one the guard judged where it did: DeepSpeed reports inf for a step it did not apply). An applied step's
        loss and norm join the guard's window."""
        if acc.guard is None:
            return {}, grad_norm
        reason, loss, norm, z = acc.guard
        if applied:
            self.guard.accept(loss, norm)
        if acc.fault is not None:  # policy=rerun found other numbers: recorded whatever this pass decided
            ranks, before, after = acc.fault
            ev = self.guard.record(self.pos.step + 1, "suspected_fault", before, norm, z)
            ev.update(ranks=ranks, rerun_loss=after, action="rerun")
            if self.rank == 0:
                log.warning("step %d: train.guard re-ran the step from the same inputs: rank(s) %s gave other numbers "
                            "(global loss %.6g, then %.6g): suspected hardware fault; going on with the re-run's "
                            "result (%s)", ev["step"], ranks, before, after, "withheld" if reason else "applied")
            return {"guard": "suspected_fault", "guard_fault_ranks": ranks,
                    "guard_withheld_total": len(self.guard.events)}, norm
        if reason in (None, "nonfinite"):  # non-finite: counted and logged as always (faults.SkipCounter)
            return ({"guard": reason} if reason else {}), norm
        ev = self.guard.record(self.pos.step + 1, reason, loss, norm, z)
        if self.rank == 0:
            log.warning("step %d: train.guard withheld the update: %s (loss %.6g, z %.3g; grad_norm %.6g, z %.3g; "
                        "%d withheld so far)", ev["step"], reason, loss, ev["loss_z"], norm, ev["grad_z"],
                        len(self.guard.events))
        return {"guard": reason, "guard_loss_z": ev["loss_z"], "guard_grad_z": ev["grad_z"],
                "guard_withheld_total": len(self.guard.events)}, norm

    def _alarm(self, rec: dict) -> None:
        """train.guard's expert-load and router-entropy alarms, logged by one rank per pipeline stage."""
        raised = self.alarms.check(self.pos.step, rec)
        if raised:
            rec["alarms"] = [{"kind": k, "layer": layer, "value": v} for k, layer, v in raised]
            if self.ps.rank_in("tp") == 0 and self.ps.rank_in("dp-cp") == 0:
                for k, layer, v in raised:
                    log.warning("step %d: MoE layer %d: %s %.4g past train.guard's threshold for %d steps in a row",
                                self.pos.step, layer, k, v, self.run.train.guard.alarm_steps)

    def _after_backward(self, acc: _Step, micro: int):
        """After a micro-batch's backward: the engine's step (engine.boundary_step), and at the boundary whether
        the step was applied."""
        last = micro == self.num_micro - 1
        judge = self._judge(acc) if last and self.guard.active else None
        applied, norm0 = ds_engine.boundary_step(self.engine, self.experts, self.run, self.ps, last=last, judge=judge)
        if last:
            acc.applied, acc.norm0 = applied, norm0

    def _judge(self, acc: _Step):
        """train.guard's decision on this step, before its update: the global batch's loss (one small all-reduce over
        the pipeline and data-parallel groups) and the global gradient norm, against the window of accepted steps.
        Returns judge(norm) -> withhold? for engine.boundary_step; policy=stop raises on a spike instead;
        policy=rerun withholds a spike's first pass and asks for the step again (`_rerun`), whose pass compares."""
        def judge(norm: float) -> bool:
            loss = (acc.loss_sum / self.num_micro).to(self.device).view(1)
            if self.pp > 1:
                dist.all_reduce(loss, group=self.pp_group)
            if self.dp * self.cp > 1:
                dist.all_reduce(loss, group=self.dp_cp_group)
            loss = float(loss) / (self.dp * self.cp)
            if acc.first is not None:
                return self._validate(acc, loss, norm)
            reason, z = self.guard.judge(self.pos.step + 1, loss, norm)
            acc.guard = (reason, loss, norm, z)
            if reason not in (None, "nonfinite") and self.guard.cfg.policy == "stop":
                self._stop_on_spike(reason, loss, norm, z)
            acc.rerun = reason not in (None, "nonfinite") and self.guard.cfg.policy == "rerun"
            return reason is not None
        return judge

    def _validate(self, acc: _Step, loss: float, norm: float) -> bool:
        """The second pass of a step policy=rerun re-ran: every rank compares its own result (`_Step.fingerprint`:
        its loss, or on a pipeline stage before the last the activations it sent) with its first pass's
        (the first pass's numbers beyond train.guard.rerun_rtol: a suspected hardware fault on that rank, named on
        every rank); a fault goes on with this pass's result judged afresh, or stops (train.guard.on_fault); the
        same numbers again: a genuine spike, withheld."""
        first, mine = acc.first, float(acc.fingerprint)
        tol = self.guard.cfg.rerun_rtol * max(abs(first["local"]), 1e-30)
        bad = torch.tensor([0.0 if abs(mine - first["local"]) <= tol else 1.0], device=self.device)
        flags = [torch.zeros_like(bad) for _ in range(self.world)] if self.world > 1 else [bad]
        if self.world > 1:
            dist.all_gather(flags, bad)
        ranks = [r for r, f in enumerate(flags) if float(f) > 0]
        if not ranks:  # reproducible: a genuine spike
            acc.guard = first["guard"]
            return True
        reason, z = self.guard.judge(self.pos.step + 1, loss, norm)
        acc.guard = (reason, loss, norm, z)
        acc.fault = (ranks, first["guard"][1], loss)
        if self.guard.cfg.on_fault == "stop":
            raise faults.TrainingError(
                f"train.guard.policy=rerun: step {self.pos.step + 1} re-run from the same inputs gave other numbers on "
                f"rank(s) {ranks} (global loss {first['guard'][1]:.6g}, then {loss:.6g}): suspected hardware fault; "
                "stopped (train.guard.on_fault=stop). The newest checkpoint holds the last good state")
        return reason is not None

    def _rerun(self, acc: _Step, rng: dict) -> _Step:
        """policy=rerun: the step again from the same samples, RNG state and balancer state (the first pass's update
        was withheld and its routing observations are discarded)."""
        for b in self.balancers:
            b.discard()
        ckpt_dir.set_rng_state(rng)
        again = _Step(torch.zeros_like(acc.loads), acc.samples, weights=acc.weights, loss_tokens=acc.loss_tokens)
        again.first = {"guard": acc.guard, "local": float(acc.fingerprint)}
        if getattr(self.model, "host_offload", None) is not None:
            self.model.host_offload.reset()
        self._micro_batches(again)
        return again

    def _stop_on_spike(self, reason: str, loss: float, norm: float, z: dict):
        ev = self.guard.record(self.pos.step + 1, reason, loss, norm, z)
        raise faults.TrainingError(
            f"train.guard.policy=stop: step {ev['step']}: {reason} (loss {loss:.6g}, z {ev['loss_z']}; grad_norm "
            f"{norm:.6g}, z {ev['grad_z']}) against the last {len(self.guard.loss)} accepted steps; stopped before "
            f"its update. The newest checkpoint in {self.ckpt_dir} holds the last good state; "
            "train.guard.policy=skip would withhold the step and go on")

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
            dist.all_reduce(val, group=self.pp_group)
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
        logger = MetricsLogger(self.run_dir, self.run.logging.wandb, config_dict, self.routing.layer_ids,
                               enabled=self.rank == 0)
        last = {}
        preemption = faults.Preemption()
        try:
            if self.rank == 0:
                log.info("training %s: %s parameters on rank 0, %d steps of %d sequences x %d tokens (%d "
                         "micro-batch%s of %d per rank, dp=%d, ZeRO-%d) on %s", self.run.model.name,
                         f"{sum(p.numel() for p in self.model.parameters()):,}", t.steps, t.global_batch_size,
                         t.seq_length, self.num_micro, "" if self.num_micro == 1 else "es", t.micro_batch_size,
                         self.dp, self.run.parallel.zero_stage, self.device)
            while self.pos.step < t.steps:
                rec, loads = self.train_step()
                step = self.pos.step
                if t.eval_interval and (step % t.eval_interval == 0 or step == t.steps):
                    rec["eval_loss"] = self.evaluate()
                    rec["eval_ppl"] = perplexity(rec["eval_loss"])
                if step % t.log_interval == 0 or step == t.steps or "eval_loss" in rec:
                    logger.log(rec, loads)
                    if self.rank == 0:
                        log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f %.0f tok/s%s", step, t.steps,
                                 rec["loss"], rec["lr"], rec["grad_norm"], rec["tokens_per_s"],
                                 f" eval_loss {rec['eval_loss']:.4f}" if "eval_loss" in rec else "")
                last = rec
                if self._maybe_rollback():
                    last = dict(rec, guard="rollback")
                    continue
                if self.skips.in_a_row >= t.max_consecutive_skips:
                    self._stop_nonfinite()
                preempted = preemption.requested(self.device)
                exit_now = (t.exit_interval and step % t.exit_interval == 0) or (
                    t.exit_duration_mins and (time.time() - self.start_time) / 60 >= t.exit_duration_mins)
                if step == t.steps or exit_now or preempted or (t.save_interval and step % t.save_interval == 0):
                    self.save(blocking=True if preempted else None)  # preempted: committed before the exit line
                if preempted:
                    if self.rank == 0:
                        log.warning("preempted (%s) at step %d: checkpoint saved, exiting",
                                    preemption.received or "signal on another rank", step)
                    last = dict(last, preempted=True)
                    break
                if exit_now and step < t.steps:
                    log.info("exit requested at step %d (exit_interval / exit_duration_mins); checkpoint saved", step)
                    break
            # an async save still writing: done and committed before the run returns; every rank learns if it failed
            self.checkpoints.wait(collective=True)
        finally:
            preemption.restore()
            logger.close()
            self.checkpoints.join()  # leaving on an exception: let the writer finish, without a collective
        if self.run.checkpoint.export_hf and self.pos.step >= t.steps:  # the finished model
            self.checkpoints.export_hf()
        return last

    def _maybe_rollback(self) -> bool:
        """train.guard.policy=rollback: after rollback_skips steps withheld for spikes within the last
        rollback_window steps, the newest checkpoint is loaded (weights, optimizer, RNG, balancer, the guard's
        window) and the data position stays where it is: the window of samples that caused the spikes is skipped.
        Returns whether it rolled back. Every rank decides alike (the guard's records are the same everywhere)."""
        g = self.run.train.guard
        if g.policy != "rollback":
            return False
        recent = [e for e in self.guard.events[self.guard.spent:] if e["reason"] in ("loss_spike", "grad_spike")
                  and e["step"] > self.pos.step - g.rollback_window]
        if len(recent) < g.rollback_skips:
            return False
        newest = ckpt_dir.list_checkpoints(self.ckpt_dir)
        if not newest:
            raise faults.TrainingError(
                f"train.guard.policy=rollback: {len(recent)} steps withheld in the last {g.rollback_window} (steps "
                f"{[e['step'] for e in recent]}) and no checkpoint in {self.ckpt_dir} to roll back to")
        consumed, tokens, at, events = self.pos.consumed, self.pos.tokens, self.pos.step, list(self.guard.events)
        self.pos = self.checkpoints.resume(newest[-1])
        self.guard.load(self.checkpoints.saved.get("guard"))
        self.guard.events = events + [{"step": at, "reason": "rollback", "action": "rollback",
                                       "to_step": self.pos.step, "skipped_samples": consumed - self.pos.consumed}]
        self.guard.spent = len(self.guard.events)  # the spikes that caused it are spent
        self.pos.consumed, self.pos.tokens = consumed, tokens  # the samples since the checkpoint are skipped
        if self.rank == 0:
            log.warning("step %d: train.guard rolled back to %s (step %d) after %d withheld steps %s; the %d samples "
                        "since are skipped", at, newest[-1], self.pos.step, len(recent), [e["step"] for e in recent],
                        self.guard.events[-1]["skipped_samples"])
        return True

    def _stop_nonfinite(self):
        """Too many skipped steps in a row: find where the non-finite values start, then stop (nothing is saved:
        the newest checkpoint is the last good state)."""
        rerun = None
        if self.pp == 1 and self.diagnose_samples is not None:
            self.model.train()
            rerun = lambda: self._forward(self.diagnose_samples)[0].loss  # noqa: E731
        faults.stop_nonfinite(self.model, rerun, self.pp > 1, self.pos.step, self.skips.in_a_row, self.ckpt_dir)
