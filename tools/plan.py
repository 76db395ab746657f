#!/usr/bin/env python
"""Plan a run: memory, communication and time per device for a model, a cluster and a parallel layout.

    python tools/plan.py model=k3 cluster=supernodes_8x64 --search
    python tools/plan.py model=k3 cluster=supernodes_8x64 parallel.tp=8 parallel.pp=8 parallel.ep=64 optim=muon
    python tools/plan.py model=k3 cluster=supernode_64 --search                 # why training does not fit
    python tools/plan.py model=k3 cluster=supernode_64 --mode infer --batch 64 --context 131072
    python tools/plan.py model=k3_tiny cluster=cpu --json                         # the CPU run, checked in tests
    python tools/plan.py model=k3 cluster=supernodes_8x64 model.moe_overflow=balanced --search  # replica slots

Overrides are the training entry point's (Hydra): model=, cluster=, train=, precision=, optim=adamw|muon,
parallel.tp/pp/ep/cp=, train.seq_length=, train.micro_batch_size=, train.global_batch_size=,
model.KEY=, cluster.KEY= (e.g. cluster.inter_supernode_gbps=100). On accelerator clusters the defaults are
train=pretrain (4096 x 4K tokens) and precision=bf16 unless given; on cluster=cpu they are the run's defaults.
model.moe_overflow=balanced (with moe.redundant_experts=S, default -1: E/ep) plans the balanced MoE dispatch: the
report adds the replica slots' memory per device and the replica weights out / gradients back per step with their
time on the EP links (docs/planning.md, "Balanced MoE dispatch"). model.vision.enabled=true adds K3's vision tower
and projector (model.freeze_vision=true: frozen) on the first pipeline stage: a line item with its parameters, memory
per device, FLOPs, time and TP traffic (its work split over TP by whole media).

Flags:
  --search                 list the layouts that fit, best first (or why none does, and how many accelerators would)
  --mode train|infer       training (default) or serving: routed experts MXFP4, the rest bf16
  --batch N --context N    inference: sequences and context length (default 64 x 131072)
  --optimizer adamw|muon   same as optim=... (Muon: one fp32 momentum per matrix)
  --recompute none|selective|full|auto   activation recomputation, as train.recompute (auto: the least that
                           fits; the default unless train.recompute is given); the finer knobs are the trainer's
                           train.recompute_modules=[...] (selective) and train.recompute_num_layers=N (full)
  --zero 0|1|2             same as parallel.zero_stage=... (default 1: optimizer states sharded over data parallelism)
  --kernels eager|fused    activation model (default: eager on cpu clusters, fused on accelerators)
  --grad-dtype fp32|bf16   same as precision.grad_accum_dtype=...: gradient accumulation under bf16 weights
                           (default fp32)
  --image-share F          with model.vision.enabled: the share of each sequence's tokens that are image features
                           (default 0.25; 4 patches each, images of the position table's grid); the vision tower's
                           activations and FLOPs scale with it (docs/planning.md, "Vision tower")
  --top N                  rows in the search table (default 10)
  --fs-bandwidth GB/s      checkpoint save/load: the filesystem's aggregate bandwidth over the cluster (default 100,
                           a parallel filesystem); --node-fs-bandwidth GB/s: one node's storage NIC (default 50);
                           --host-copy-bandwidth GB/s: one device's copy to host memory (default 25), the stall of
                           an asynchronous save (docs/planning.md, "Checkpoint size and save time")
  --json                   one JSON object instead of text

Exit status: 0 for a report; 1 when the one training layout given (no --search) does not fit, after the report and
the least change that would fit it (scripts can run `tools/plan.py ... && torchrun ...`); 2 for bad input (a key,
value or flag named in the error).
"""

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_k3.config import ConfigError, split_tool_args  # noqa: E402
from megatron_k3.planning import report  # noqa: E402
from megatron_k3.planning.checkpoint import (  # noqa: E402
    DEFAULT_FS_GBPS,
    DEFAULT_HOST_COPY_GBPS,
    DEFAULT_NODE_GBPS,
    Storage,
    checkpoint_plan,
)
from megatron_k3.planning.flops import DEFAULT_IMAGE_SHARE  # noqa: E402
from megatron_k3.planning.memory import GB  # noqa: E402
from megatron_k3.planning.params import count_parameters  # noqa: E402
from megatron_k3.planning.planner import plan_inference, plan_training, search_inference, search_training  # noqa: E402
from megatron_k3.planning.run import compose_for_planning, layout, recompute_fix, search_knobs, workload  # noqa: E402

BANDWIDTHS = {"--fs-bandwidth": DEFAULT_FS_GBPS, "--node-fs-bandwidth": DEFAULT_NODE_GBPS,
              "--host-copy-bandwidth": DEFAULT_HOST_COPY_GBPS}
FLAGS_WITH_VALUE = {"--mode", "--batch", "--context", "--optimizer", "--recompute", "--zero", "--kernels",
                    "--grad-dtype", "--top", "--image-share", *BANDWIDTHS}
CHOICES = {"--mode": ("train", "infer"), "--optimizer": ("adamw", "muon"),
           "--recompute": ("none", "selective", "full", "auto"), "--zero": ("0", "1", "2"),
           "--kernels": ("eager", "fused"), "--grad-dtype": ("fp32", "bf16")}


def parse(argv):
    overrides, flags = split_tool_args(
        argv, ("--search", "--json"), FLAGS_WITH_VALUE, choices=CHOICES,
        defaults={"--mode": "train", "--batch": "64", "--context": "131072",
                  "--top": "10", "--image-share": str(DEFAULT_IMAGE_SHARE),
                  **{k: str(v) for k, v in BANDWIDTHS.items()}})
    for k in ("--batch", "--context", "--top"):
        if not flags[k].isdigit() or int(flags[k]) <= 0:
            raise ConfigError(k, flags[k], "must be a positive integer")
    for k in BANDWIDTHS:
        try:
            v = float(flags[k])
        except ValueError:
            v = float("nan")
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(k, flags[k], "must be a positive number of GB/s")
        flags[k] = v
    try:
        share = float(flags["--image-share"])
    except ValueError:
        share = float("nan")
    if not 0 <= share < 1:
        raise ConfigError("--image-share", flags["--image-share"], "must be a share of the tokens in [0, 1)")
    flags["--image-share"] = share
    return overrides, flags


def storage(flags) -> Storage:
    return Storage(flags["--fs-bandwidth"], flags["--node-fs-bandwidth"], flags["--host-copy-bandwidth"])


def checkpoint(run, plan, flags):
    """The checkpoint of a training plan's layout: size per rank, save / load time, sync vs async stall."""
    return checkpoint_plan(run.model, run.cluster, plan.layout, plan.workload.optimizer, storage(flags),
                           plan.step_time, run.train.save_interval, getattr(run.checkpoint, "async_save", None),
                           plan.workload.zero_stage, plan.workload.peft)


KEY_FLAGS = {"--zero": "parallel.zero_stage", "--grad-dtype": "precision.grad_accum_dtype"}  # flag: the key it sets


def compose(overrides, flags):
    """(run, optimizer, keys the overrides give) to plan (megatron_k3.planning.run.compose_for_planning); a flag of
    KEY_FLAGS sets its key, which it must not contradict (the Trainer's check reads the key); the keys given are the
    overrides' own."""
    run, optimizer, given = compose_for_planning(overrides, flags.get("--optimizer"))
    extra = []
    for flag, key in KEY_FLAGS.items():
        if flag not in flags:
            continue
        section, name = key.split(".")
        value = getattr(getattr(run, section), name)
        if key in given and str(value) != flags[flag]:
            raise ConfigError(flag, flags[flag], f"contradicts {key}={value} (the flag sets that key)")
        extra.append(f"{key}={flags[flag]}")
    if extra:
        run, optimizer, _ = compose_for_planning(list(overrides) + extra, flags.get("--optimizer"))
    return run, optimizer, given


def _nothing_valid(res, t) -> str:
    """The error of a search whose every candidate breaks a layout rule: more accelerators would not help."""
    why = report.rejected(res)
    tile = (f"; train.tile_tokens={t.tile_tokens}: a tile divides a device's tokens (micro_batch_size x seq_length / "
            "cp, and / tp in the MoE layers under sequence parallelism) in no candidate (try a power of two)"
            if t.tile_tokens and any(k.startswith("train.tile_tokens") for k in res.invalid) else "")
    return (f"--search: every candidate layout breaks a layout rule ({why}), so nothing was planned, on any number "
            f"of accelerators{tile}")


def main(argv):
    try:
        overrides, flags = parse(argv)
        if flags.get("help"):
            print(__doc__.strip())
            return 0
        run, optimizer, given = compose(overrides, flags)
        # --recompute, else train.recompute when given, else auto; the train.* keys checked as the Trainer checks
        # them (train.recompute_modules, _num_layers, offload_buffer_gb and tile_tokens with that policy)
        run.train.recompute = flags.get("--recompute") or (run.train.recompute if "train.recompute" in given
                                                           else "auto")
        run.train.validate("train")
        run.validate_offload_share()
    except ConfigError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    cfg, cluster, t, par = run.model, run.cluster, run.train, run.parallel
    counts = count_parameters(cfg)
    # the Trainer's check's Workload (planning.run.workload), but moe.redundant_experts as given: -1 is E/ep of each
    # layout planned, not of the run's own
    w = replace(workload(run, optimizer, kernels=flags.get("--kernels"), image_share=flags["--image-share"]),
                redundant_experts=run.moe.redundant_experts)
    as_json = flags.get("--json", False)
    recompute = t.recompute  # the knobs: train.recompute_modules / _num_layers, tile_tokens, offload_buffer_gb
    knobs = search_knobs(run)
    lines = report.header(cfg, cluster, counts)
    fits = True  # the exit status: 1 for the one training layout given when it does not fit
    batch, context, top = int(flags["--batch"]), int(flags["--context"]), int(flags["--top"])
    try:
        if flags["--mode"] == "infer":
            explicit = any(k.startswith("parallel.") for k in given)
            if flags.get("--search") or not explicit:
                res = search_inference(cfg, cluster, batch, context, top)
                if as_json:
                    return _dump({"mode": "infer", "search": True, "fits": [q.as_dict() for q in res.fits],
                                  "over_memory": [q.as_dict() for q in res.over_memory[:3]],
                                  "invalid": res.invalid, "evaluated": res.evaluated,
                                  **(res.fits[0].as_dict() if res.fits else {})})
                if not explicit and not flags.get("--search"):
                    lines.append("no parallel.* given: the best serving layout of a search")
                lines += report.render_infer_search(res, batch, context)
            else:
                q = plan_inference(cfg, cluster, par.tp, par.ep, par.pp, batch, context, counts)
                if as_json:
                    return _dump(q.as_dict())
                lines += report.render_infer(q)
        elif flags.get("--search"):
            res = search_training(cfg, cluster, w, top, knobs=knobs)
            if not res.evaluated:  # bad input, not a memory limit: say which key, and stop
                raise ValueError(_nothing_valid(res, t))
            inf = search_inference(cfg, cluster, batch, context, 3) if not res.fits else None
            if as_json:
                out = {"mode": "train", "search": True, "total_params": counts["total"],
                       "active_params": counts["active"], "evaluated": res.evaluated, "invalid": res.invalid,
                       "fits": [p.as_dict() for p in res.fits],
                       "over_memory": [p.as_dict() for p in res.over_memory[:3]],
                       "model_state_bytes": res.state_floor_bytes, "min_accelerators": res.min_world,
                       "long_sequence": None if res.long_sequence is None else {
                           "overrides": res.long_sequence_keys, **res.long_sequence.as_dict()}}
                if res.fits:
                    out.update({k: v for k, v in res.fits[0].as_dict().items() if k not in out})
                    out["checkpoint"] = checkpoint(run, res.fits[0], flags).as_dict()
                if inf is not None:
                    out["inference"] = inf.fits[0].as_dict() if inf.fits else None
                return _dump(out)
            ck = checkpoint(run, res.fits[0], flags) if res.fits else None
            lines += report.render_train_search(cfg, cluster, w, res, inf, (batch, context), ck)
        else:
            rcs = ("none", "selective", "full") if recompute == "auto" else (recompute,)
            # sequence parallelism with TP unless the command line turns it off explicitly
            sp = par.sequence_parallel if "parallel.sequence_parallel" in given else True
            plan = None
            for rc in rcs:
                plan = plan_training(cfg, cluster, layout(run, cluster.world_size, rc, sp), w, counts)
                if plan.fits:
                    break
            if len(rcs) > 1:
                plan.notes.append(f"recompute={plan.layout.recompute} chosen by --recompute auto "
                                  "(the least recomputation that fits)")
            ck = checkpoint(run, plan, flags)
            if as_json:
                return _dump({**plan.as_dict(), "checkpoint": ck.as_dict()}, 0 if plan.fits else 1)
            lines += report.render_train(plan) + report.render_checkpoint(ck)
            fits = plan.fits
            if not fits:
                fix = None if plan.host_over else recompute_fix(run, cluster.world_size, plan.layout.recompute, w,
                                                                cluster.device_memory_gb * GB, sp)
                if fix:
                    lines.append(f"{fix[2]} fits this layout ({fix[3] / GB:.1f} GB per device)")
                lines.append("try --search for layouts that fit")
    except ValueError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if fits else 1


def _dump(obj, status: int = 0) -> int:
    print(json.dumps(obj))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
