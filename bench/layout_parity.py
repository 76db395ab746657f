"""Every parallel layout against the single-process run, with a chosen optimizer: 5 training steps of the k3_tiny of
tests/test_engine.py (fp32, gloo workers), worst per-step loss difference and worst per-tensor parameter
difference ||a - b|| / ||b|| over all ranks. A report, not a timing (the tests assert the same bounds).

    .venv/bin/python bench/layout_parity.py [muon|adamw] [WORD ...] [--save FILE] [--compare FILE]

WORDs keep only the layouts whose overrides contain one of them (e.g. `ep=2` for the expert-parallel ones).
--save FILE keeps every run's per-step losses and full-size parameters (every rank); --compare FILE, given a file
saved by another checkout (the code before a refactor, say), also prints whether each run is bit-identical to it.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench"), str(ROOT)]

import torch  # noqa: E402
from dist_utils import run_distributed  # noqa: E402
from helpers import FAST, STATIC, norm_rel, train_layout  # noqa: E402

# STATIC: capacity for every token, comparable with ep
LAYOUTS = [(2, ["parallel.zero_stage=1"]), (2, ["parallel.zero_stage=2"]),
           (4, ["parallel.tp=2", "parallel.zero_stage=1"]), (4, ["parallel.tp=2", "parallel.zero_stage=2"]),
           (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
           (2, ["parallel.ep=2"]), (4, ["parallel.ep=2"]), (4, ["parallel.tp=2", "parallel.ep=2"]),
           (2, ["parallel.cp=2"]),
           (4, ["parallel.cp=2", "parallel.ep=2"]), (2, ["parallel.pp=2"]), (4, ["parallel.pp=2", "parallel.tp=2"])]


def train(rank, world, optimizer, overrides, run_dir):
    base = [a for a in FAST if not a.startswith("optim=")] + [f"optim={optimizer}"]
    return train_layout(rank, world, STATIC + overrides, run_dir, base=base)


def _option(args, flag):
    if flag not in args:
        return None
    i = args.index(flag)
    value = args[i + 1]
    del args[i:i + 2]
    return value


def _identical(runs, saved) -> str:
    """Whether every rank's losses and parameters equal those of a saved run bit for bit."""
    if saved is None:
        return "not in the saved file"
    for (losses, params), (s_losses, s_params) in zip(runs, saved):
        if losses != s_losses or params.keys() != s_params.keys():
            return "LOSSES DIFFER"
        bad = [n for n in params if not torch.equal(params[n], s_params[n])]
        if bad:
            return f"{len(bad)} PARAMETERS DIFFER (e.g. {bad[0]})"
    return "bit-identical"


def main():
    args = sys.argv[1:]
    save, compare = _option(args, "--save"), _option(args, "--compare")
    optimizer = args[0] if args else "muon"
    words = args[1:]
    layouts = [(w, o) for w, o in LAYOUTS if not words or any(x in " ".join(o) for x in words)]
    tmp = Path("/tmp/k3-layout-parity")
    saved = torch.load(compare, weights_only=True) if compare else {}
    runs = {"one process": [r[:2] for r in run_distributed(train, 1, optimizer, [], str(tmp / "ref"), timeout=900)]}
    ref_losses, ref_params = runs["one process"][0]
    print(f"optim={optimizer}, 5 steps of k3_tiny (fp32), against one process")
    if compare:
        print(f"one process: {_identical(runs['one process'], saved.get('one process'))} to {compare}")
    print("| layout | ranks | worst loss rel. diff | worst parameter ||a-b||/||b|| (tensor) |"
          + (" against --compare |" if compare else ""))
    print("|---|---|---|---|" + ("---|" if compare else ""))
    for world, overrides in layouts:
        res = run_distributed(train, world, optimizer, overrides, str(tmp / "run"), timeout=900)
        loss = max(abs(a - b) / abs(b) for r in res for a, b in zip(r[0], ref_losses))
        worst = max((norm_rel(r[1][n], p), n) for r in res for n, p in ref_params.items() if n in r[1])
        sizes = dict(o.replace("parallel.", "").split("=") for o in overrides)
        dp = world // (int(sizes.get("tp", 1)) * int(sizes.get("cp", 1)) * int(sizes.get("pp", 1)))
        name = " ".join(f"{k}={v}" for k, v in sizes.items()) + f" (dp={dp})"
        runs[name] = [r[:2] for r in res]
        same = f" {_identical(runs[name], saved.get(name))} |" if compare else ""
        print(f"| {name} | {world} | {loss:.1e} | {worst[0]:.1e} ({worst[1]}) |{same}", flush=True)
    if save:
        torch.save(runs, save)
        print(f"saved every run's losses and parameters to {save}")


if __name__ == "__main__":
    main()
