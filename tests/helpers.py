"""What several test modules share: the two error measures, the override lists of the 4-layer test model, the Trainer
runs that layout tests compare with one process, and the reference runs of checkpoints, fault drills and Hugging Face.

Test modules import it as `helpers` (tests/ is on sys.path under pytest; bench/ scripts put it there). A function
that gloo workers run (tests/dist_utils.py) must live at module level, as these do; they import megatron_k3 inside,
so importing this module stays cheap.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from dist_utils import free_port, run_distributed

ROOT = Path(__file__).resolve().parent.parent


def load_file(path, name: str | None = None):
    """The module a Python file defines, loaded afresh (a tool or bench script, or a package's file that is not
    importable by name); `name` defaults to the file's stem."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------- error measures


def max_abs_rel(a: torch.Tensor, b: torch.Tensor, *, floor: float = 1e-30, float64: bool = True) -> float:
    """max|a - b| / max|b|, the denominator at least `floor`; in float64, or in the inputs' dtype (float64=False)."""
    a, b = a.detach(), b.detach()
    if float64:
        a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (all elements, the denominator at least 1e-12), in the inputs' dtype."""
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


# ---------------------------------------------------------------------------------------------- override lists

# The 4-layer K3 of the tests (KDA x3 + MLA, MoE, AttnRes in blocks of 2) on 64-token sequences; each list below adds
# its batch, schedule and logging keys.
TINY_MODEL = ["model.num_layers=4", "model.hidden_size=64", "model.dense_intermediate_size=128",
              "model.attn_res_block_size=2"]
TINY = TINY_MODEL + ["train.seq_length=64"]

# Trainer runs compared across layouts (tests/test_engine.py and the other layout tests). AdamW: test_engine's
# measurements are its (optim=muon: tests/test_muon_train.py). eps=1e-6, not the default 1e-8: an element whose
# gradient cancels to ~1e-8 has an update g / (|g| + eps) that rounding decides (measured with 1e-8: one embedding
# element's step-1 update 16% apart between dp=2 and one process, 1e-3 apart after 5 steps), which no summation order
# avoids; with 1e-6 such an element moves by lr * g / eps, a hundredth of it, and nothing else about what these tests
# check changes.
# model.vocab_size=8192: the embedded BPE's ids, all that text data uses (k3_tiny reserves 64 more for the media and
# chat tokens; data=chat and vision runs set 8256 back); the layout tolerances below were measured at it.
FAST = TINY + ["train.micro_batch_size=1", "train.global_batch_size=4", "train.eval_interval=0", "optim=adamw",
               "optim.warmup_steps=2", "optim.eps=1e-6", "logging.wandb.mode=disabled", "model.vocab_size=8192"]
FULL_VOCAB = "model.vocab_size=8256"  # k3_tiny's and k3_vl_tiny's: the BPE and the 64 reserved ids
STEPS = 5
RTOL = 1e-5  # losses, fp32 (tests/test_engine.py's docstring: measured <= 8e-8)
PARAM_RTOL = 2e-4  # parameters per tensor in norm after STEPS AdamW steps (tests/test_engine.py's docstring says why)
# 16 experts, top-4: capacity factor 4 gives every expert room for every token (C = N), so expert-parallel layouts
# drop nothing and compare with one process
STATIC = ["model.moe_overflow=drop", "model.moe_capacity_factor=4.0"]

# Command-line runs (megatron_k3.train.main: tests/test_train.py, tests/test_compile.py)
CLI_FAST = TINY + ["train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_interval=5",
                   "train.eval_iters=1", "optim.warmup_steps=3"]

# The short real run whose metrics.jsonl the observability and plot tests read (conftest.short_run_dir), logging
# every W&B media step
OBS_FAST = TINY + ["train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_interval=2",
                   "train.eval_iters=1", "optim.warmup_steps=3", "logging.wandb.mode=disabled",
                   "logging.wandb.media_interval=2", "train.save_interval=0"]

# The fault drills' runs (tests/test_fault_drills.py, bench/fault_drill.py): 6 steps, a checkpoint every 2, resuming
DRILL = TINY + ["train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_interval=0",
                "optim.warmup_steps=2", "logging.wandb.mode=disabled", "train.steps=6", "train.save_interval=2",
                "checkpoint.load=auto"]

# Vectors that start at zero and take AdamW steps (KDA's A_log with kda_a_log_init=zero, the AttnRes pseudo-queries):
# their norm after 5 steps is the steps themselves (A_log: ~3e-3, about one step of lr), so they are held to 1e-4 of
# that, i.e. ~3e-7 absolute: a wrong reduction moves them by whole steps (tests/test_vision_train.py, test_compile.py).
ZERO_INIT = ("self_attn.A_log", "_res.proj.weight")
ZERO_INIT_RTOL = 1e-4


# ---------------------------------------------------------------------------------------------- Trainer runs


def gather_dim(t: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """This rank's shard `t` and its `size` - 1 peers' in `group`, concatenated along `dim` in rank order."""
    parts = [torch.empty_like(t) for _ in range(size)]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def full_params(trainer) -> dict:
    """Every parameter at full (unsharded) size: tensor-parallel shards gathered over the TP group, this rank's
    experts over the EP group (all experts in global order)."""
    from megatron_k3.annotations import meta

    ps = trainer.ps
    out = {}
    for n, p in trainer.model.named_parameters():
        t = p.detach().float()
        m = meta(p)
        if m.tp_dim is not None and ps.size("tp") > 1:
            t = gather_dim(t, m.tp_dim, ps.group("tp"), ps.size("tp"))
        if m.ep_size > 1:
            t = gather_dim(t, 0, ps.group("ep"), m.ep_size)
        out[n] = t.clone()
    return out


def gather_states(trainer, states: dict) -> dict:
    """Optimizer states {name: {key: tensor}} as {"name::key": tensor} at full size (TP shards gathered; experts are
    already global in deepspeed_state.full_states)."""
    from megatron_k3.annotations import meta

    size, group = trainer.ps.size("tp"), trainer.ps.group("tp")
    params = dict(trainer.model.named_parameters())
    out = {}
    for n, st in states.items():
        d = meta(params[n]).tp_dim
        for k, v in st.items():
            if d is not None and size > 1:
                v = gather_dim(v, d, group, size)
            out[f"{n}::{k}"] = v
    return out


# the process groups a layout's run reports (tests/test_context_parallel.py checks them)
GROUPS = ("cp", "dp", "dp-cp", "ep", "edp")


def train_layout(rank, world, overrides, run_dir, base=FAST):
    """`base` + `overrides`, STEPS steps through the real Trainer on this rank: (losses, the last step's full-size
    parameters, DeepSpeed's optimizer class name, extra), extra holding per MoE layer the dropped assignments and
    the selection bias, the recorded steps (tests/trajectory.py), this rank's GROUPS and DeepSpeed's dp x cp size."""
    from trajectory import record

    from megatron_k3.config import compose_run_config
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    run, _, _ = compose_run_config(base + overrides, world_size=world)
    try:
        trainer = Trainer(run, f"{run_dir}/{rank}")
        steps = record(trainer, STEPS, full_params)  # per step: loss, routing, parameters (tests/trajectory.py)
        extra = {"dropped": [float(m.dropped_assignments) for m in trainer.moe],
                 "bias": [m.gate.e_score_correction_bias.clone() for m in trainer.moe], "steps": steps,
                 "groups": {name: trainer.ps.ranks(name) for name in GROUPS},
                 "seq_dp": trainer.engine.seq_dp_world_size}
        return [s.loss for s in steps], steps[-1].params, type(trainer.engine.optimizer).__name__, extra
    finally:
        shutdown()


def wrapped_model(overrides, policy, tile: int = 0):
    """One process's model of `overrides` (seed 0, train mode, its precision prepared) with the recomputation
    `policy` (parallel.recompute.Policy) and `tile`-token tiling (parallel.tiling, 0: off) applied from outside, as
    the Trainer applies them: (model, model config, what was wrapped)."""
    from megatron_k3.config import compose_config
    from megatron_k3.model import causal_lm_class
    from megatron_k3.parallel import tiling
    from megatron_k3.parallel.recompute import apply
    from megatron_k3.precision import prepare_model_for_precision

    run, _, _ = compose_config(list(overrides))
    cfg = run.model
    torch.manual_seed(0)
    model = causal_lm_class(cfg)(cfg)
    prepare_model_for_precision(model, run.precision, torch.device("cpu"))
    model.train()
    wrapped = apply(model, policy)
    wrapped.update(tiling.apply(model, tile, cfg.moe_overflow))
    return model, cfg, wrapped


class ObservationCounter:
    """Stands in for the MoE layers' balancers: counts Quantile Balancing's observations and the rows they bring."""

    def __init__(self):
        self.calls = self.rows = 0

    def observe(self, scores_NE, bias_E, x_ND=None):
        self.calls += 1
        self.rows += scores_NE.shape[0]


def train_layout_default_optimizer(rank, world, overrides, run_dir):
    """`train_layout` with the default optimizer (Per-Head Muon for matrices, AdamW for the rest)."""
    return train_layout(rank, world, overrides, run_dir, base=[a for a in FAST if not a.startswith("optim=")])


def one_process(fn, tmp_path_factory, overrides=(), name="ref"):
    """What a layout test compares with: fn(0, 1, overrides, run_dir) on one gloo process, in a fresh directory of
    the session's temporary tree."""
    return run_distributed(fn, 1, list(overrides), str(tmp_path_factory.mktemp(name)), timeout=300)[0]


# ---------------------------------------------------------------------------------------------- checkpoints

N, M = 2, 2  # a checkpoint test trains N steps, saves, and resumes for M more (against N + M straight)


def make_trainer(world, overrides, steps=N + M, run_dir=None):
    """A Trainer of FAST + train.steps=`steps` + `overrides` on this rank, its run directory the run's checkpoint.dir
    unless given."""
    from megatron_k3.config import compose_run_config
    from megatron_k3.training.loop import Trainer

    run, _, _ = compose_run_config(FAST + [f"train.steps={steps}"] + overrides, world_size=world)
    return Trainer(run, run.checkpoint.dir if run_dir is None else run_dir)


def same(a: dict, b: dict, what: str):
    """Assert two {name: tensor} dicts hold the same names and every tensor bit for bit."""
    assert sorted(a) == sorted(b), what
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert not bad, (what, bad[:5])


def resume_with(rank, world, path, overrides):
    """The ConfigError message that resuming `path` under FAST + `overrides` raises on this rank, or None."""
    from megatron_k3.config import ConfigError
    from megatron_k3.training.engine import shutdown

    try:
        t = make_trainer(world, overrides + [f"checkpoint.load={path}"])
        try:
            t.maybe_resume()
        except ConfigError as e:
            return str(e)
        return None
    finally:
        shutdown()


def straight_and_resumed(rank, world, overrides, ckpt_dir):
    """N + M steps straight, and N steps, a save, a resume (checkpoint.load=auto) and M more: (straight losses,
    resumed losses, both runs' full-size parameters, both runs' router selection biases)."""
    from megatron_k3.training.engine import shutdown

    common = overrides + [f"checkpoint.dir={ckpt_dir}"]
    try:
        t = make_trainer(world, common)
        straight = [t.train_step()[0]["loss"] for _ in range(N + M)]
        straight_params = full_params(t)
        bias = [m.gate.e_score_correction_bias.clone() for m in t.moe]
    finally:
        shutdown()
    try:
        t = make_trainer(world, common)
        first = [t.train_step()[0]["loss"] for _ in range(N)]
        t.save()
    finally:
        shutdown()
    try:
        t = make_trainer(world, common + ["checkpoint.load=auto"])
        t.maybe_resume()
        assert t.step == N
        second = [t.train_step()[0]["loss"] for _ in range(M)]
        resumed_params = full_params(t)
        resumed_bias = [m.gate.e_score_correction_bias.clone() for m in t.moe]
    finally:
        shutdown()
    return straight, first + second, straight_params, resumed_params, bias, resumed_bias


# ---------------------------------------------------------------------------------------------- command-line runs


def logged_losses(run_dir) -> dict:
    """step -> loss from a run's metrics.jsonl; a step logged twice (before a crash and again after the restart)
    keeps the later value."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


FAULT_ENTRY = str(Path(__file__).with_name("fault_entry.py"))


PORT_TAKEN = ("EADDRINUSE", "Address already in use", "address already in use")


def launch(make_cmd, attempts: int = 3, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(make_cmd(port), **kwargs) for a launcher (torchrun, deepspeed) given a free port. The port is
    free when free_port() returns and may be taken by another process before the launcher's rendezvous binds it; a
    run that failed for that reason alone (the launcher's bind error in its output) is started again on a new port,
    up to `attempts` times. Any other outcome is returned as it is."""
    for _ in range(attempts):
        p = subprocess.run(make_cmd(free_port()), **kwargs)
        if p.returncode == 0 or not any(m in (p.stdout or "") + (p.stderr or "") for m in PORT_TAKEN):
            return p
    return p


def run_drill(args, run_dir, fault=None, nproc=1, restarts=0, timeout=300) -> subprocess.CompletedProcess:
    """A training run through tests/fault_entry.py, which injects `fault` (K3_FAULT, e.g. "kill:3:1"): one process,
    or `nproc` under torchrun with `restarts` restarts (started again on another port if the first was taken)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("K3_FAULT", None)
    if fault:
        env["K3_FAULT"] = fault
    tail = [FAULT_ENTRY] + args + [f"hydra.run.dir={run_dir}"]
    kw = dict(cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if nproc == 1 and not restarts:
        return subprocess.run([sys.executable] + tail, **kw)
    return launch(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                "--max-restarts", str(restarts), "--master_port", str(port)] + tail, **kw)


# ---------------------------------------------------------------------------------------------- Hugging Face

HF_REFERENCE = Path(__file__).with_name("hf_reference.py")


def run_hf_reference(tmp_path: Path, hf_config: dict, seed: int, input_ids: torch.Tensor, **extra):
    """Run tests/hf_reference.py (transformers' Kimi Linear, fla blocked) in a subprocess: (its state dict, its
    logits, info.json); `extra` adds optional spec keys (save_pretrained, load_from)."""
    from safetensors.torch import load_file

    spec = {"config": hf_config, "seed": seed, "input_ids": input_ids.tolist(), "out_dir": str(tmp_path), **extra}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(HF_REFERENCE), str(spec_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"hf_reference.py failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    info = json.loads((tmp_path / "info.json").read_text())
    return load_file(tmp_path / "state.safetensors"), load_file(tmp_path / "logits.safetensors")["logits"], info
