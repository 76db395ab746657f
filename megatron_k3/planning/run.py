"""The planner's inputs read from a run config, and the memory check a run makes before it allocates anything.

`compose_for_planning` is the composition tools/plan.py and tools/build_rank.py share (accelerator clusters
default to train=pretrain and precision=bf16 unless given). `workload` and `layout` turn a RunConfig into the
planner's Workload and Layout; `check_fits` refuses, before the model is built, a layout whose largest pipeline
stage the planner puts over the device's memory, naming the layout keys and values, or, under balanced MoE
dispatch when the layout fits without its replica slots, naming moe.redundant_experts and the largest value that
fits.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import CONF_DIR, ConfigError, compose_config
from ..interop import checkpoint_model_config
from .candidates import Layout, stage_layers
from .flops import DEFAULT_IMAGE_SHARE
from .memory import GB, Workload, balanced_slots, training_memory
from .params import peft_spec
from .planner import long_sequence_plan

__all__ = ["compose_for_planning", "workload", "layout", "resolve_recompute", "check_fits", "recompute_fix",
           "search_knobs"]


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
    run, _, _ = compose_config(keep, checkpoint_model_config)  # model=from_checkpoint reads it
    run.cluster.validate("cluster")
    run.model.validate("model")
    given = {o.split("=", 1)[0].lstrip("+") for o in keep}
    if run.cluster.device_kind == "gpu":
        extra = [x for x, k in (("train=pretrain", "train"), ("precision=bf16", "precision")) if k not in given]
        if extra:
            run, _, _ = compose_config(extra + keep, checkpoint_model_config)
    run.precision.validate("precision")
    return run, optimizer or run.optim.name, given


def workload(run, optimizer: str | None = None, zero_stage: int | None = None, grad_dtype: str | None = None,
             kernels: str | None = None, image_share: float = DEFAULT_IMAGE_SHARE) -> Workload:
    """The planner's Workload of a run (kernels: eager on CPU clusters, fused on accelerators, unless given). The MoE
    dispatch: model.moe_overflow, and under balanced dispatch moe.redundant_experts as the run resolves it
    (run.moe.slots: S for its own layout); where balanced dispatch does not run, the value as configured (-1:
    E/ep of whichever layout is planned). `image_share`: the share of tokens that are image features (used only
    with model.vision.enabled; tools/plan.py --image-share)."""
    t = run.train
    slots = run.moe.slots(run.model, run.parallel)
    kernels = kernels or ("eager" if run.cluster.device_kind == "cpu" else "fused")
    return Workload(t.seq_length, t.micro_batch_size, t.global_batch_size, run.precision.name,
                    optimizer or run.optim.name, run.parallel.zero_stage if zero_stage is None else zero_stage,
                    grad_dtype or run.precision.grad_accum_dtype, kernels, run.model.moe_overflow,
                    run.moe.redundant_experts if slots is None else slots, run.moe.replica_exchange, image_share,
                    run.parallel.overlap_grad_reduce, peft_spec(run.peft),
                    reduce_bucket=int(run.parallel.deepspeed_entry("zero_optimization.reduce_bucket_size") or 0),
                    per_head=run.optim.per_head)


def layout(run, world: int, recompute: str | None = None, sequence_parallel: bool | None = None) -> Layout:
    """The planner's Layout of a run on `world` ranks, with the recomputation `recompute` (none, selective, full;
    None: the run's train.recompute, which must not be auto) and the run's train.recompute_modules /
    recompute_num_layers where they apply."""
    p, t = run.parallel, run.train
    rc = t.recompute if recompute is None else recompute
    if rc == "auto":
        raise ValueError("train.recompute=auto is resolved first (planning.run.resolve_recompute)")
    return Layout(world=world, tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp, sequence_parallel=sp_of(p, sequence_parallel),
                  recompute=rc, recompute_modules=tuple(t.recompute_modules) if rc == "selective" else (),
                  recompute_num_layers=t.recompute_num_layers if rc == "full" else 0, tile_tokens=t.tile_tokens,
                  offload_bytes=t.offload_buffer_gb * 1e9 if rc == "full" else 0.0)


def sp_of(p, sequence_parallel: bool | None) -> bool:
    return p.sequence_parallel if sequence_parallel is None else sequence_parallel


def _largest_stage(run, lay: Layout, w: Workload) -> float:
    """Bytes per device of the largest pipeline stage of layout `lay` (training_memory's)."""
    return max(m.total for m in training_memory(run.model, run.cluster, lay, w))


def resolve_recompute(run, world: int, w: Workload | None = None, recompute: str | None = None) -> str:
    """train.recompute (or `recompute`) as it runs: the value itself, or for auto the least recomputation (none,
    selective, full, with the run's train.recompute_modules / recompute_num_layers) whose largest pipeline stage the
    planner puts within cluster.device_memory_gb; full when none does (check_fits then says by how much)."""
    recompute = recompute or run.train.recompute
    if recompute != "auto":
        return recompute
    w = w or workload(run)
    capacity = run.cluster.device_memory_gb * GB
    return next((rc for rc in ("none", "selective") if _largest_stage(run, layout(run, world, rc), w) <= capacity),
                "full")


def search_knobs(run) -> tuple:
    """The run's recomputation, tiling and offload knobs as the search takes them (planner.search_training's
    `knobs`): (train.recompute_modules as a tuple, train.recompute_num_layers, train.tile_tokens,
    train.offload_buffer_gb in bytes)."""
    t = run.train
    return tuple(t.recompute_modules), t.recompute_num_layers, t.tile_tokens, t.offload_buffer_gb * 1e9


def _layout_keys(run) -> str:
    p = run.parallel
    return " ".join(f"{k}={getattr(p, k)}" for k in ("tp", "pp", "ep", "cp"))


def _largest_fitting_slots(run, lay: Layout, w: Workload, S: int, capacity: float) -> int | None:
    """The largest moe.redundant_experts below S whose plan fits `capacity` (None: none does). Memory grows with
    the slots within [1, El) and within [El, E - El], and drops at El (the compute buffer shrinks from its worst
    case to M rows): a bisection on each range, the upper first."""
    El = run.model.num_experts // lay.ep

    def fits(s):
        return _largest_stage(run, lay, replace(w, redundant_experts=s)) <= capacity

    for lo, hi in ((El, min(S - 1, run.model.num_experts - El)), (1, min(S - 1, El - 1))):
        if lo > hi or not fits(lo):
            continue
        while lo < hi:  # fits(lo) holds
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo
    return None


def check_fits(run, world: int, recompute: str | None = None, w: Workload | None = None) -> list:
    """The planner's StageMemory of every pipeline stage of this run's layout under `recompute` (None: the run's
    train.recompute, auto resolved); ConfigError (naming the layout keys and values, the stage, its memory,
    cluster.device_memory_gb and the recomputation that would fit) when the largest does not fit. Under balanced MoE
    dispatch, when the layout fits with the drop dispatcher's buffers instead, the replica slots are what push it
    over: the ConfigError names moe.redundant_experts, its value and the largest that fits."""
    w = w or workload(run)
    recompute = resolve_recompute(run, world, w) if recompute in (None, "auto") else recompute
    lay = layout(run, world, recompute)
    stages = training_memory(run.model, run.cluster, lay, w)
    worst = max(stages, key=lambda s: s.total)
    capacity = run.cluster.device_memory_gb * GB
    host = max(s.host for s in stages) * run.cluster.devices_per_node
    if host > run.cluster.host_memory_gb * GB:
        raise ConfigError("train.offload_buffer_gb", run.train.offload_buffer_gb, (
            f"the offloaded layer inputs take {host / GB:.1f} GB of host memory per node "
            f"({run.cluster.devices_per_node} devices), over cluster.host_memory_gb={run.cluster.host_memory_gb}: "
            "at most "
            f"{run.cluster.host_memory_per_device_gb:.4g} GB per device fits"))
    if worst.total > capacity:
        S = balanced_slots(run.model, lay.ep, w)
        if S is not None:
            base = _largest_stage(run, lay, replace(w, moe_overflow="drop"))
            if base <= capacity:
                El = run.model.num_experts // lay.ep
                best = _largest_fitting_slots(run, lay, w, S, capacity)
                cfg_value = run.moe.redundant_experts
                said = f"{S} replica slots per EP rank" + (f" (-1: E/ep = {El})" if cfg_value < 0 else "")
                if best is None:
                    fix = (f"no value fits this layout: model.moe_overflow=drop fits ({base / GB:.4g} GB), or a "
                           f"layout with more recomputation or more ranks (tools/plan.py model={run.model.name} "
                           f"cluster={run.cluster.name} model.moe_overflow=balanced --search)")
                else:
                    fix = (f"the largest that fits is moe.redundant_experts={best}"
                           + (f" (below E/ep = {El} the balance is not exact)" if best < El else ""))
                raise ConfigError("moe.redundant_experts", cfg_value, (
                    f"{said} of model.moe_overflow=balanced ({worst.moe_replicas / GB:.3g} GB of kept replica "
                    f"weights, {worst.moe_exchange / GB:.3g} GB of exchange buffers) put pipeline stage "
                    f"{worst.stage} at {worst.total / GB:.4g} GB per device (recompute={recompute}; "
                    f"{base / GB:.4g} GB with the drop dispatcher), over cluster.device_memory_gb="
                    f"{run.cluster.device_memory_gb}: {fix}"))
        parts = ", ".join(f"{k} {v:.1f}" for k, v in worst.breakdown_gb().items())
        fits = recompute_fix(run, world, recompute, w, capacity)
        long = None if fits else long_sequence_plan(run.model, run.cluster, [layout(run, world, "full")], w)
        fix = (f"{fits[2]} fits ({fits[3] / GB:.1f} GB)" if fits else
               f"no recomputation alone fits this layout; {long.layout.trainer_keys(search_knobs(run)[1:])} fits "
               f"({long.memory_per_device / GB:.1f} GB)" if long else
               f"no recomputation, tiling or offload fits this layout; tools/plan.py model={run.model.name} "
               f"cluster={run.cluster.name} --search lists layouts that fit")
        raise ConfigError(fits[0] if fits else "parallel", fits[1] if fits else _layout_keys(run), (
            (f"layout {_layout_keys(run)}: " if fits else "")
            + f"pipeline stage {worst.stage} needs {worst.total / GB:.1f} GB per device "
            f"({parts} GB; {_recompute_keys(run, recompute)}), over cluster.device_memory_gb="
            f"{run.cluster.device_memory_gb}: {fix}"))
    return stages


def _recompute_keys(run, recompute: str) -> str:
    """train.recompute=R, with the finer knob R reads where it is set."""
    t = run.train
    if recompute == "selective" and t.recompute_modules:
        return f"train.recompute=selective, train.recompute_modules={list(t.recompute_modules)}"
    if recompute == "full" and t.recompute_num_layers:
        return f"train.recompute=full, train.recompute_num_layers={t.recompute_num_layers}"
    return f"train.recompute={recompute}"


def recompute_fix(run, world: int, recompute: str, w: Workload, capacity: float, sequence_parallel=None):
    """The least recomputation beyond `recompute` (and the run's finer knobs) that fits: (the key to change, its
    value now, the setting that fits, its largest stage's bytes), or None. First the policy itself with its finer
    knob widened (selective: every module; full: the fewest more layers of a stage, up to all), then the policies
    that recompute more, with the run's knobs, then with theirs at the defaults. `sequence_parallel`: as `layout`
    takes it."""
    t, order = run.train, ("none", "selective", "full")
    tried = []

    def layout_of(rc):
        return layout(run, world, rc, sequence_parallel)

    if recompute == "selective" and t.recompute_modules:
        tried.append(("train.recompute_modules", list(t.recompute_modules),
                      "train.recompute_modules=[] (every module)", replace(layout_of(recompute), recompute_modules=())))
    if recompute == "full" and t.recompute_num_layers:  # more layers of each stage, the fewest that fit first
        most = max(b - a for a, b in stage_layers(run.model, run.parallel.pp))
        tried += [("train.recompute_num_layers", t.recompute_num_layers,
                   f"train.recompute_num_layers={n}" if n else "train.recompute_num_layers=0 (every layer of a stage)",
                   replace(layout_of(recompute), recompute_num_layers=n))
                  for n in [*range(t.recompute_num_layers + 1, most), 0]]
    for rc in order[order.index(recompute) + 1:]:
        lay = layout_of(rc)
        tried.append(("train.recompute", recompute, f"train.recompute={rc}", lay))
        default = replace(lay, recompute_modules=(), recompute_num_layers=0)
        if default != lay:
            knob = "train.recompute_modules=[]" if rc == "selective" else "train.recompute_num_layers=0"
            tried.append(("train.recompute", recompute, f"train.recompute={rc} {knob}", default))
    for key, value, setting, lay in tried:
        gb = _largest_stage(run, lay, w)
        if gb <= capacity:
            return key, value, setting, gb
    return None
