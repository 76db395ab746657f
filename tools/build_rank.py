#!/usr/bin/env python
"""Build the ranks of a parallel layout in one CPU process, with torch's fake process-group backend standing in for
the world: what each rank constructs, checked against the planner and the model's total (docs/scale.md).

    python tools/build_rank.py model=k3 cluster=supernodes_8x64 parallel.tp=8 parallel.pp=8 parallel.ep=64 --all --json
    python tools/build_rank.py model=k3 cluster=supernodes_8x64 --search --all        # the planner's best layout
    python tools/build_rank.py model=k3 cluster=supernodes_8x64 parallel.tp=8 parallel.pp=8 parallel.ep=32 \\
        parallel.cp=2 train.seq_length=16384 --all                                     # context parallelism
    python tools/build_rank.py model=k3 model.num_layers=4 cluster=supernodes_8x64 parallel.tp=2 parallel.ep=64 \\
        train.seq_length=256 train.global_batch_size=256 --rank 0 --materialize --step  # one real rank, bf16

Overrides are the training entry point's (Hydra) with tools/plan.py's defaults: on accelerator clusters
train=pretrain and precision=bf16 unless given, and sequence parallelism on with TP unless
parallel.sequence_parallel is given. The world is the cluster's (cluster.num_nodes x cluster.devices_per_node).

Flags:
  --all               build every rank on the meta device; with it the report has covered_params (the elements
                      of the full model the ranks' shards cover, each counted once) against the model's total
  --rank R            build rank R (repeatable)
  --search            use the planner's best layout for this model, cluster and workload (parallel.* replaced)
  --materialize       allocate the --rank ranks (one after the other) on the CPU and initialise them shard-locally
  --step              also run one forward and backward of train.micro_batch_size x train.seq_length tokens as the
                      Trainer runs it (the run's precision: precision=mx_qat fake-quantises the experts, under its
                      autocast); `measured` (live-tensor peak, process RSS peak) is reported beside the planner's
                      figures
  --dtype bf16|fp32   parameters of --materialize (default bf16)
  --seed N            initialisation seed (default 0)
  --recompute none|selective|full|auto   activation recomputation, as train.recompute: the planner's figures, the
                      fit check and the trainer's policy the --step runs (default: train.recompute when given,
                      else auto, the least that fits); the finer knobs are train.recompute_modules=[...] and
                      train.recompute_num_layers=N
  --json              one JSON object instead of text
Exit status: 0 when every check holds, 1 when one does not (params != planned_params, covered != total), 2 for a
bad layout or config (one line naming the key and the value).
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_k3.config import ConfigError, split_tool_args  # noqa: E402

FLAGS_WITH_VALUE = {"--rank", "--dtype", "--seed", "--recompute"}
CHOICES = {"--dtype": ("bf16", "fp32"), "--recompute": ("none", "selective", "full", "auto")}


def parse(argv):
    overrides, flags = split_tool_args(argv, ("--all", "--search", "--materialize", "--step", "--json"),
                                       FLAGS_WITH_VALUE, {"--dtype": "bf16", "--seed": "0"},
                                       CHOICES, repeated=("--rank",))
    for v in flags["--rank"]:
        if not v.isdigit():
            raise ConfigError("--rank", v, "must be a rank number")
    ranks = [int(v) for v in flags["--rank"]]
    if not flags["--seed"].isdigit():
        raise ConfigError("--seed", flags["--seed"], "must be a non-negative integer")
    if flags.get("--step"):
        flags["--materialize"] = True
    if flags.get("--materialize") and (not ranks or flags.get("--all")):
        raise ConfigError("--materialize", True, "materialises the ranks given with --rank (one after the other), "
                          "not --all")
    if not flags.get("help") and not ranks and not flags.get("--all"):
        raise ConfigError("--all/--rank", None, "say which ranks to build")
    return overrides, flags, ranks


def compose(overrides, flags):
    from megatron_k3.planning.planner import search_training
    from megatron_k3.planning.run import compose_for_planning, search_knobs, workload

    run, optimizer, given = compose_for_planning(overrides)
    run.optim.name = optimizer
    run.train.recompute = flags.get("--recompute") or (run.train.recompute if "train.recompute" in given else "auto")
    if "parallel.sequence_parallel" not in given:
        run.parallel.sequence_parallel = True  # with TP, as tools/plan.py plans it (no effect at tp = 1)
    world = run.cluster.world_size
    if flags.get("--search"):
        res = search_training(run.model, run.cluster, workload(run), top=1, find_min_world=False,
                              knobs=search_knobs(run))
        if not res.fits:
            long = res.long_sequence
            hint = f"; with {res.long_sequence_keys} {long.layout.short()} fits" if long else ""
            raise ConfigError("--search", True, f"no layout of model={run.model.name} fits on "
                              f"cluster={run.cluster.name}{hint} (tools/plan.py --search says why)")
        best = res.fits[0].layout
        for k in ("tp", "pp", "ep", "cp"):
            setattr(run.parallel, k, getattr(best, k))
        run.parallel.sequence_parallel = best.sp or run.parallel.sequence_parallel
        run.train.recompute = best.recompute
    run.parallel.sequence_parallel = run.parallel.sequence_parallel and run.parallel.tp > 1
    run.validate(world)
    return run, world


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def text_report(rep: dict) -> list:
    lay, pl = rep["layout"], rep["planner"]
    lines = [f"model {rep['model']} on cluster {rep['cluster']}: world {rep['world']}, layout tp{lay['tp']} "
             f"pp{lay['pp']} ep{lay['ep']} cp{lay['cp']} dp{lay['dp']} edp{lay['edp']}"
             f"{' sp' if lay['sequence_parallel'] else ''}; planner: {pl['memory_per_device_gb']:.1f} GB per "
             f"device (recompute={pl['recompute']}, {'fits' if pl['fits'] else 'DOES NOT FIT'} in "
             f"{pl['device_memory_gb']} GB)",
             f"built {len(rep['ranks'])} rank(s) on the meta device in {rep['build_seconds']:.1f} s"]
    by_stage = {}
    for e in rep["ranks"]:
        by_stage.setdefault(e["pp_rank"], []).append(e)
    for s, es in sorted(by_stage.items()):
        e = es[0]
        params = sorted({x["params"] for x in es})
        ok = all(x["params"] == x["planned_params"] and x["trainable_params"] == x["planned_trainable_params"]
                 for x in es)
        span = f"layers {e['layers'][0]}-{e['layers'][-1]}" if e["layers"] else "no layers"
        trained = sorted({x["trainable_params"] for x in es})
        lines.append(f"  stage {s}: {len(es)} rank(s), {span}, {e['experts']} experts per MoE layer, params "
                     f"{'/'.join(f'{p:,}' for p in params)} vs planned {e['planned_params']:,}"
                     + (f" (trainable {'/'.join(f'{p:,}' for p in trained)} vs planned "
                        f"{e['planned_trainable_params']:,}, frozen apart)" if "adapter_params" in rep else "")
                     + f" -> {'equal' if ok else 'DIFFERENT'}")
    if "covered_params" in rep:
        what = ("(tools/param_count.py, + the LoRA adapters' {:,})".format(rep["adapter_params"])
                if "adapter_params" in rep else "(tools/param_count.py)")
        lines.append(f"covered by the union of the ranks' shards: {rep['covered_params']:,} elements; model total "
                     f"{what} {rep['total_params']:,} -> "
                     f"{'equal' if rep['covered_equals_total'] else 'DIFFERENT'}")
        lines += [f"  {p}" for p in rep["coverage_problems"]]
    return lines


def materialize_report(m: dict, planned: dict) -> list:
    lines = [f"rank {m['coords']['rank']} (pp {m['coords']['pp_rank']}, tp {m['coords']['tp_rank']}, ep "
             f"{m['coords']['ep_rank']}, dp {m['coords']['dp_rank']}): layers {m['layers']}, {m['experts']} experts "
             f"per MoE layer, {m['params']:,} parameters in {m['dtype']}",
             f"  build + initialise: {m['init_seconds']:.1f} s; live tensors {_gb(m['weights_bytes'])} after, peak "
             f"{_gb(m['build_live_peak_bytes'])}; largest allocation {m['largest_allocation_bytes']:,} B (largest "
             f"parameter {m['largest_param_bytes']:,} B)"]
    if m["step"]:
        st = m["step"]
        ratio = st["live_peak_bytes"] / planned["step_bytes"]
        lines.append(f"  forward + backward of {st['tokens']} tokens: {st['seconds']:.1f} s; live-tensor peak "
                     f"{_gb(st['live_peak_bytes'])} ({st['peak_phase']}), gradients {_gb(st['grads_bytes'])}")
        if "host_peak_bytes" in st:
            lines.append(f"  offloaded to host memory (not in the device peak): peak {_gb(st['host_peak_bytes'])}")
        lines.append(f"  measured: live-tensor peak {_gb(m['measured']['live_peak_bytes'])}, process RSS peak "
                     f"{_gb(m['measured']['rss_peak_bytes'])}")
        lines.append(f"  planner for the same phase: {_gb(planned['step_bytes'])} (weights "
                     f"{_gb(planned['weights_bytes'])}, gradients {_gb(planned['gradients_bytes'])}, activations "
                     f"{_gb(planned['activations_one_micro_bytes'])}, transient {_gb(planned['transient_bytes'])}) "
                     f"-> measured / planned = {ratio:.3f}")
    lines.append(f"  process RSS: {_gb(m['rss_start_bytes'])} at start, peak {_gb(m['rss_peak_bytes'])}")
    lines.append(f"  planner, the whole training step per device (optimizer states, all micro-batches in flight, "
                 f"reserved): {_gb(planned['per_device_total_bytes'])}")
    return lines


def main(argv) -> int:
    try:
        overrides, flags, ranks = parse(argv)
        if flags.get("help"):
            print(__doc__.strip())
            return 0
        run, world = compose(overrides, flags)
        from megatron_k3.planning.run import check_fits, resolve_recompute

        recompute = resolve_recompute(run, world)  # auto resolved once: the report, the fit check and the step
        check_fits(run, world, recompute)  # a layout that does not fit is refused before anything is built
    except (ConfigError, ValueError) as e:
        print(f"build_rank: {e}", file=sys.stderr)
        return 2
    import torch

    from megatron_k3.planning import dry_run as D

    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.perf_counter()
    try:
        rep = D.dry_run(run, world, None if flags.get("--all") else ranks, recompute)
        if flags.get("--materialize"):
            rep["materialized"] = []
            for r in ranks:
                m = D.materialize_rank(run, world, r, torch.bfloat16 if flags["--dtype"] == "bf16" else
                                       torch.float32, int(flags["--seed"]), step=bool(flags.get("--step")),
                                       recompute=recompute)
                planned = D.planner_step_memory(run, world, m.coords["pp_rank"], recompute)
                entry = {**m.as_dict(), "planner_step": planned, "measured": {
                    "live_peak_bytes": max(m.build_live_peak_bytes, m.step["live_peak_bytes"] if m.step else 0),
                    "build_live_peak_bytes": m.build_live_peak_bytes,
                    "step_live_peak_bytes": m.step["live_peak_bytes"] if m.step else None,
                    "rss_peak_bytes": m.rss_peak_bytes}}
                if m.step:
                    entry["measured_over_planned"] = m.step["live_peak_bytes"] / planned["step_bytes"]
                rep["materialized"].append(entry)
    except (ConfigError, ValueError) as e:
        print(f"build_rank: {e}", file=sys.stderr)
        return 2
    rep["seconds"] = round(time.perf_counter() - t0, 2)
    ok = rep["params_match_planner"] and rep.get("covered_equals_total", True)
    if flags.get("--json"):
        print(json.dumps(rep))
    else:
        lines = text_report(rep)
        for m in rep.get("materialized", []):
            lines += materialize_report(m, m["planner_step"])
        lines.append(f"total {rep['seconds']:.1f} s")
        print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
