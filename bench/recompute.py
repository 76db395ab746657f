"""Benchmark: what activation recomputation, sequence tiling and activation offload cost in step time and save in
memory, as ratios to no recomputation, in one run on this CPU (megatron_k3.parallel.recompute, tiling, offload).

    .venv/bin/python bench/recompute.py [--model k3_tiny --seq 2048 --batch 1 --tile 256 --reps 5]

Each variant builds the same model (same seed), applies its policy from outside as the Trainer does
(tests/helpers.wrapped_model), and runs forward + backward of the same batch: the step time is the median of --reps
timed steps after a warm-up, taken round-robin over the variants so the machine's drift hits them alike; the peak is
the live-tensor peak of one more step under megatron_k3.planning.measure.LiveTensorMemory (every tensor storage an
op creates), with the weights and gradients it holds; the offloaded copies are counted as host memory ("host MB"),
apart from the peak. Every variant's gradients are checked against no recomputation's (bit for bit for the
recomputation and offload variants, to fp32 rounding for tiling).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import torch  # noqa: E402
from helpers import wrapped_model  # noqa: E402  (tests/helpers.py: the model as the Trainer wraps it)

from megatron_k3.parallel.recompute import Policy  # noqa: E402
from megatron_k3.planning.measure import LiveTensorMemory  # noqa: E402

VARIANTS = {
    "none": (Policy("none"), 0),
    "selective": (Policy("selective"), 0),
    "selective core_attn,moe_act": (Policy("selective", ("core_attn", "moe_act")), 0),
    "full": (Policy("full"), 0),
    "full + offload": (Policy("full", offload_bytes=1 << 40), 0),
    "none + tiles": (Policy("none"), -1),
    "full + tiles + offload": (Policy("full", offload_bytes=1 << 40), -1),
}


def step(model, ids):
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="k3_tiny")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tile", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    models = {}
    for name, (policy, tile) in VARIANTS.items():
        models[name] = wrapped_model([f"model={a.model}"], policy, a.tile if tile < 0 else tile)[:2]
    cfg = models["none"][1]
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    grads = {}
    for name, (model, _) in models.items():  # warm-up, and the gradients to compare
        model.zero_grad(set_to_none=True)
        step(model, ids)
        grads[name] = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    times = {name: [] for name in models}
    for _ in range(a.reps):
        for name, (model, _) in models.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step(model, ids)
            times[name].append(time.perf_counter() - t0)
    peaks, host = {}, {}
    for name, (model, _) in models.items():
        model.zero_grad(set_to_none=True)
        tracker = LiveTensorMemory()
        off = getattr(model, "host_offload", None)
        if off is not None:  # the offloaded copies are host memory, apart from the peak: made anew under the tracker
            off.reset()  # (the warm-up's buffers, reused, would be copied into outside it and read as device memory)
            off.release_idle()
            off.host_context = tracker.host_allocations
        with tracker:
            step(model, ids)
        peaks[name], host[name] = tracker.peak, tracker.host_peak
    ref = grads["none"]
    base_t, base_m = statistics.median(times["none"]), peaks["none"]
    print(f"{a.model}, {a.batch} x {a.seq} tokens, tiles of {a.tile}, {torch.get_num_threads()} threads, median of "
          f"{a.reps} steps (forward + backward)")
    print(f"{'variant':32s} {'step s':>8s} {'x none':>7s} {'peak MB':>9s} {'x none':>7s} {'host MB':>8s}  "
          "gradients vs none")
    for name in models:
        worst = max(((grads[name][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in ref.items())
        exact = all(torch.equal(grads[name][n], g) for n, g in ref.items())
        t = statistics.median(times[name])
        print(f"{name:32s} {t:8.3f} {t / base_t:7.2f} {peaks[name] / 1e6:9.1f} {peaks[name] / base_m:7.2f} "
              f"{host[name] / 1e6:8.1f}  {'bit-identical' if exact else f'max rel {worst:.1e}'}")


if __name__ == "__main__":
    main()
