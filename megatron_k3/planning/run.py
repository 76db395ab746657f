"""The planner's inputs read from a run config, and the memory check a run makes before it allocates anything.

`compose_for_planning` is the composition tools/plan.py and tools/build_rank.py share (accelerator clusters
default to train=pretrain and precision=bf16 unless given). `workload` and `layout` turn a RunConfig into the
planner's Workload and Layout; `check_fits` refuses, before the model is built, a layout whose largest pipeline
stage the planner puts over the device's memory, naming the layout keys and values.
"""

from __future__ import annotations

from ..config import CONF_DIR, ConfigError, compose_config
from .layout import Layout
from .memory import GB, Workload, training_memory

__all__ = ["compose_for_planning", "workload", "layout", "check_fits"]


def compose_for_planning(overrides, optimizer: str | None = None):
    """(run, optimizer, keys given) for a planning tool: the run composed from Hydra `overrides`; Muon accepted
    whether or not conf/optim/muon.yaml exists; accelerator clusters default to train=pretrain and
    precision=bf16."""
    keep = []
    for o in overrides:
        if (o.split("=", 1)[0] == "optim" and o.split("=", 1)[1] == "muon"
                and not (CONF_DIR / "optim" / "muon.yaml").is_file()):
            optimizer = optimizer or "muon"
            continue
        keep.append(o)
    run, _, _ = compose_config(keep)
    run.cluster.validate("cluster")
    run.model.validate("model")
    given = {o.split("=", 1)[0] for o in keep}
    if run.cluster.device_kind == "gpu":
        extra = [x for x, k in (("train=pretrain", "train"), ("precision=bf16", "precision")) if k not in given]
        if extra:
            run, _, _ = compose_config(extra + keep)
    return run, optimizer or run.optim.name, given


def workload(run, optimizer: str | None = None, zero_stage: int | None = None, grad_dtype: str = "fp32",
             kernels: str | None = None) -> Workload:
    """The planner's Workload of a run (kernels: eager on CPU clusters, fused on accelerators, unless given)."""
    t = run.train
    return Workload(t.seq_length, t.micro_batch_size, t.global_batch_size, run.precision.name,
                    optimizer or run.optim.name, run.parallel.zero_stage if zero_stage is None else zero_stage,
                    grad_dtype, kernels or ("eager" if run.cluster.device_kind == "cpu" else "fused"))


def layout(run, world: int, recompute: str = "none", sequence_parallel: bool | None = None) -> Layout:
    """The planner's Layout of a run on `world` ranks."""
    p = run.parallel
    sp = p.sequence_parallel if sequence_parallel is None else sequence_parallel
    return Layout(world=world, tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp, sequence_parallel=sp, recompute=recompute)


def _layout_keys(run) -> str:
    p = run.parallel
    return " ".join(f"{k}={getattr(p, k)}" for k in ("tp", "pp", "ep", "cp"))


def check_fits(run, world: int, recompute: str = "none", w: Workload | None = None) -> list:
    """The planner's StageMemory of every pipeline stage of this run's layout; ConfigError (naming the layout keys
    and values, the stage, its memory and cluster.device_memory_gb) when the largest does not fit. The trainer runs
    without activation recomputation (`recompute="none"`)."""
    stages = training_memory(run.model, run.cluster, layout(run, world, recompute), w or workload(run))
    worst = max(stages, key=lambda s: s.total)
    capacity = run.cluster.device_memory_gb * GB
    if worst.total > capacity:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in worst.breakdown_gb().items())
        raise ConfigError("parallel", _layout_keys(run), (
            f"pipeline stage {worst.stage} needs {worst.total / GB:.1f} GB per device ({parts} GB; recompute="
            f"{recompute}), over cluster.device_memory_gb={run.cluster.device_memory_gb}: "
            f"tools/plan.py model={run.model.name} cluster={run.cluster.name} --search lists layouts that fit"))
    return stages
