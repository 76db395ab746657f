"""Every parallel layout against the single-process run, with a chosen optimizer: 5 training steps of the k3_tiny of
tests/test_engine.py (fp32, gloo workers), worst per-step loss difference and worst per-tensor parameter
difference ||a - b|| / ||b|| over all ranks. A report, not a timing (the tests assert the same bounds).

    .venv/bin/python bench/layout_parity.py [muon|adamw] [WORD ...]

WORDs keep only the layouts whose overrides contain one of them (e.g. `ep=2` for the expert-parallel ones).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench"), str(ROOT)]

from dist_utils import run_distributed  # noqa: E402
from test_engine import _rel  # noqa: E402

STATIC = ["model.moe_overflow=drop", "model.moe_capacity_factor=4.0"]  # capacity for every token: comparable with ep
LAYOUTS = [(2, ["parallel.zero_stage=1"]), (2, ["parallel.zero_stage=2"]), (4, ["parallel.tp=2", "parallel.zero_stage=1"]),
           (4, ["parallel.tp=2", "parallel.zero_stage=2"]), (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
           (2, ["parallel.ep=2"]), (4, ["parallel.ep=2"]), (4, ["parallel.tp=2", "parallel.ep=2"]), (2, ["parallel.cp=2"]),
           (4, ["parallel.cp=2", "parallel.ep=2"]), (2, ["parallel.pp=2"]), (4, ["parallel.pp=2", "parallel.tp=2"])]


def train(rank, world, optimizer, overrides, run_dir):
    import test_engine

    test_engine.FAST = [a for a in test_engine.FAST if not a.startswith("optim=")] + [f"optim={optimizer}"]
    return test_engine._train(rank, world, STATIC + overrides, run_dir)


def main():
    optimizer = sys.argv[1] if len(sys.argv) > 1 else "muon"
    words = sys.argv[2:]
    layouts = [(w, o) for w, o in LAYOUTS if not words or any(x in " ".join(o) for x in words)]
    tmp = Path("/tmp/k3-layout-parity")
    ref_losses, ref_params, _, _ = run_distributed(train, 1, optimizer, [], str(tmp / "ref"), timeout=900)[0]
    print(f"optim={optimizer}, 5 steps of k3_tiny (fp32), against one process")
    print("| layout | ranks | worst loss rel. diff | worst parameter ||a-b||/||b|| (tensor) |")
    print("|---|---|---|---|")
    for world, overrides in layouts:
        res = run_distributed(train, world, optimizer, overrides, str(tmp / "run"), timeout=900)
        loss = max(abs(a - b) / abs(b) for r in res for a, b in zip(r[0], ref_losses))
        worst = max((_rel(r[1][n], p), n) for r in res for n, p in ref_params.items() if n in r[1])
        sizes = dict(o.replace("parallel.", "").split("=") for o in overrides)
        dp = world // (int(sizes.get("tp", 1)) * int(sizes.get("cp", 1)) * int(sizes.get("pp", 1)))
        name = " ".join(f"{k}={v}" for k, v in sizes.items()) + f" (dp={dp})"
        print(f"| {name} | {world} | {loss:.1e} | "
              f"{worst[0]:.1e} ({worst[1]}) |", flush=True)


if __name__ == "__main__":
    main()
