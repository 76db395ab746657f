#!/usr/bin/env python
"""GPU check: our torch KDA path against fla's fused Triton kernel (equality and speed), and a
forward/backward of k3_small. Prints one table; run on a CUDA machine:

    .venv/bin/python bench/gpu_check.py [--T 8192] [--H 16] [--reps 10] [--seq 4096]

Equality is max|ours - fla| / max|fla| in fp32 (outputs, final state, gradients of every input);
speed is the ratio fla_time / ours_time of forward+backward, same inputs, same process.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def kda_inputs(B, T, H, K, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev, generator=g), dim=-1)
    v = torch.randn(B, T, H, K, device=dev, generator=g)
    # K3's lower-bound gate range: per-step log decay in (-5, 0)
    gate = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, device=dev, generator=g) - 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H, device=dev, generator=g))
    h0 = torch.randn(B, H, K, K, device=dev, generator=g) * 0.1
    return [t.to(dtype).requires_grad_() for t in (q, k, v)] + [gate.requires_grad_(), beta.to(dtype).requires_grad_(),
                                                                h0.requires_grad_()]


def kda_check(args, rows):
    from megatron_k3.ops.kda import chunk_kda

    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception as e:  # noqa: BLE001
        rows.append(("kda fla import", "-", "-", f"unavailable: {e}"))
        return
    for dtype in (torch.float32, torch.bfloat16):
        ins = kda_inputs(1, args.T, args.H, 128, dtype)
        go = torch.randn(1, args.T, args.H, 128, device="cuda", dtype=dtype)
        gs = torch.randn(1, args.H, 128, 128, device="cuda")

        def run(fn):
            for t in ins:
                t.grad = None
            o, s = fn(*ins[:5], initial_state=ins[5], output_final_state=True)
            torch.autograd.backward([o, s], [go, gs])
            return o.detach().clone(), s.detach().clone(), [t.grad.clone() for t in ins]

        ours = run(lambda *a, **kw: chunk_kda(*a, **kw, backend="torch"))
        ref = run(lambda *a, **kw: fla_chunk_kda(*a, **kw, safe_gate=True, lower_bound=-5.0))
        errs = [rel(ours[0], ref[0]), rel(ours[1], ref[1])] + [rel(a, b) for a, b in zip(ours[2], ref[2])]
        t_ours = timed(lambda: run(lambda *a, **kw: chunk_kda(*a, **kw, backend="torch")), args.reps)
        t_fla = timed(lambda: run(lambda *a, **kw: fla_chunk_kda(*a, **kw, safe_gate=True, lower_bound=-5.0)), args.reps)
        name = f"kda fwd+bwd T={args.T} H={args.H} {str(dtype).split('.')[-1]}"
        rows.append((name, f"{t_ours * 1e3:.2f} ms", f"{t_fla * 1e3:.2f} ms",
                     f"max rel err {max(errs):.2e}; fla/ours time {t_fla / t_ours:.3f}"))


def model_check(args, rows):
    from megatron_k3.config import load_model_config
    from megatron_k3.model import K3ForCausalLM

    cfg = load_model_config("k3_small")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids, labels=ids.roll(-1, 1))
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        return out.loss

    loss = step()
    t = timed(step, max(1, args.reps // 2))
    mem = torch.cuda.max_memory_allocated() / 2**30
    rows.append((f"k3_small fwd+bwd bf16 autocast seq={args.seq}", f"{t * 1e3:.1f} ms", "-",
                 f"{args.seq / t:.0f} tok/s; loss {loss.item():.3f}; peak {mem:.1f} GiB"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    rows = [("check", "ours", "fla", "result")]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    from megatron_k3.precision.te import gpu_check as precision_check  # MX ops on CUDA, mx_qat, TE recipes

    for fn in (kda_check, model_check, precision_check):
        try:
            fn(args, rows)
        except Exception as e:  # noqa: BLE001 - report every check, keep going
            rows.append((fn.__name__, "-", "-", f"FAILED: {type(e).__name__}: {e}"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
