#!/usr/bin/env python
"""torch.compile against eager, side by side in one process, CPU, fp32; markdown tables of medians and ratios.

    nice -n 5 .venv/bin/python bench/compile.py [--batch 4 --seq 512 --steps 3] [--reps 20 --warmup 3 --threads 2]
                                                [--backend inductor] [--only train,moe,glu] [--warm-cache DIR]
                                                [--latent 128] [--glu-rows 8192 --glu-inter 256]

1. train: one training step (forward, backward, AdamW; bench/train_step.py's step) of (a) bench/train_step.py's
   Kimi-Linear-shaped model: ours eager, ours with every decoder layer compiled (megatron_k3.training.compile.
   compile_layers, as train.compile=true does: split at the recomputation regions, and as one graph per layer,
   train.compile_split=layer) and Hugging Face's KimiLinearForCausalLM on its torch path (eager), and (b) k3_tiny,
   eager against compiled both ways and compiled with train.recompute=selective (HF has no K3). Same weights and
   batch for every row of a table; the first step is timed on its own (for a compiled model it includes the
   compile) and its loss, computed before any update, is compared between the rows; then --steps steady steps
   (best, median).
2. moe: one forward+backward of the MoE layer at bench/moe.py's default shapes with batch x seq tokens (the defaults
   give its 2048): ours as K3 runs it (SiTU, Stable LatentMoE of width --latent, the default dispatch) eager (its
   fused autograd Functions) and under torch.compile(dynamic=False), HF's KimiLinearMoE with grouped_mm experts
   eager and compiled (or why it does not compile), and the bare GEMMs each layer must do (bench/moe.py's
   gemm_kernels: the floor), round-robin over --reps repetitions after --warmup rounds.
3. glu: SiTU-GLU and SwiGLU forward+backward on [--glu-rows, --glu-inter] fp32: megatron_k3.ops.glu.glu_act (the
   hand-written autograd Function) against glu_reference (the plain formula, autograd through every op), each eager
   and compiled (torch.compile of a function calling it); same inputs and output gradient for all, round-robin.

The inductor cache (TORCHINDUCTOR_CACHE_DIR) is a fresh temporary directory unless --warm-cache DIR names one to
reuse, so by default a first compiled step is a cold compile (on 2 cores ~20-80 s per distinct layer with inductor;
the whole default run takes tens of minutes). `--backend aot_eager` traces and runs the same graphs op by op without
generating code: a quick check that everything compiles, not a measure of compiled speed (under aot_eager the
Kimi-Linear layout's compiled backward fails, pytorch/pytorch#120035, and its row is left out with the reason; inductor
is not affected). A row that fails to compile is reported and left out; the other rows still run.

bench/train_step.py and bench/moe.py, imported here, block `fla` before transformers is imported (HF's torch path
on CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe as moe_bench  # noqa: E402  (bench/moe.py; it and bench/train_step.py block fla before transformers)
import torch  # noqa: E402
import train_step  # noqa: E402  (bench/train_step.py)
from machine import machine  # noqa: E402  (bench/machine.py)

from megatron_k3.config import ConfigError, load_model_config  # noqa: E402
from megatron_k3.model import K3ForCausalLM  # noqa: E402
from megatron_k3.model.dispatcher import capacity  # noqa: E402
from megatron_k3.ops.glu import glu_act, glu_reference  # noqa: E402
from megatron_k3.parallel.recompute import Policy  # noqa: E402
from megatron_k3.parallel.recompute import apply as apply_recompute  # noqa: E402
from megatron_k3.training.compile import BACKENDS, check_backend, compile_layers  # noqa: E402

SECTIONS = ("train", "moe", "glu")


# ---------------------------------------------------------------- helpers

def dynamo_stats():
    """(graphs compiled, graph breaks) so far in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def compiled_note(before):
    graphs, breaks = (a - b for a, b in zip(dynamo_stats(), before))
    return f"{graphs} graphs, {breaks} graph breaks"


def why(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def table(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def set_cache(warm: str | None):
    """Point TORCHINDUCTOR_CACHE_DIR at --warm-cache DIR or at a fresh temporary directory; (the temporary directory
    object to keep alive or None, the line that says which)."""
    if warm:
        d = Path(warm).resolve()
        d.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d)
        n = sum(1 for p in d.rglob("*") if p.is_file())
        return None, f"compile cache: {d} (--warm-cache, {n} files in it at the start: first steps may hit it)"
    tmp = tempfile.TemporaryDirectory(prefix="torchinductor-bench-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp.name
    return tmp, f"compile cache: fresh temporary directory {tmp.name} (cold: first compiled steps include the compile)"


# ---------------------------------------------------------------- 1. training step

def profile_step(name, step, top):
    """The `top` ops of one more step of `step` by self CPU time (inductor's kernels by name)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ev = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ev)
    print(f"profile of one '{name}' step (self CPU time, total {total / 1e3:.0f} ms):")
    table(("op", "self ms", "share", "calls"),
          [(e.key[:100], f"{e.self_cpu_time_total / 1e3:.1f}", f"{e.self_cpu_time_total / total:.0%}", str(e.count))
           for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:top]])
    print()


def train_compare(title, models, x, y, steps, checks, ratios, profile_top=0):
    """First step (timed alone, its loss before any update), loss checks, then `steps` steady steps of each model.
    models: {name: (module, is_hf)}; checks: [(name, reference name)] whose first-step losses must agree;
    ratios: [(name, reference name)] printed as tokens/s ratios; profile_top > 0: that many ops of a profiled step
    of each of our models after the timing."""
    tok = x.numel()
    step_fns, first, loss, notes, failed = {}, {}, {}, {}, {}
    for name, (model, hf) in models.items():
        before = dynamo_stats()
        step = train_step.make_step(model, x, y, hf=hf)
        t0 = time.perf_counter()
        try:
            loss[name] = step()
        except Exception as e:  # noqa: BLE001 - a model that does not compile is reported, not fatal
            failed[name] = why(e)
            continue
        first[name] = time.perf_counter() - t0
        step_fns[name] = step
        if "compiled" in name:
            notes[name] = compiled_note(before)
    print(f"### {title}")
    print()
    for name, reason in failed.items():
        print(f"{name}: the first step fails, row left out: {reason}")
    for name, note in notes.items():
        print(f"{name}: first step compiled {note}")
    checks = [(a, b) for a, b in checks if a in step_fns and b in step_fns]
    ratios = [(a, b) for a, b in ratios if a in step_fns and b in step_fns]
    for a, b in checks:
        print(f"check: first-step loss (same weights, same batch, before any update) {a} {loss[a]:.6f}, {b} "
              f"{loss[b]:.6f}; relative difference {relative(loss[a], loss[b]):.1e}")
    steady = {}
    for name in step_fns:
        best, med, _ = train_step.time_steps(step_fns[name], steps, warmup=False)
        steady[name] = (best, med)
    print()
    table(("impl", "first step s", "best step s", "median step s", "tokens/s (median)"),
          [(n, f"{first[n]:.3f}", f"{b:.3f}", f"{m:.3f}", f"{tok / m:,.0f}") for n, (b, m) in steady.items()])
    print()
    table(("ratio (tokens/s)", "median steps", "best steps"),
          [(f"{a} / {b}", f"{steady[b][1] / steady[a][1]:.2f}x", f"{steady[b][0] / steady[a][0]:.2f}x")
           for a, b in ratios])
    for name in notes:
        print(f"{name}: compile cost in the first step ~ {first[name] - steady[name][1]:.1f} s "
              "(first step - median step)")
    print()
    for name in step_fns:
        if profile_top and not models[name][1]:
            profile_step(name, step_fns[name], profile_top)


def compiled_copy(model, cfg, backend, split="regions", policy="none"):
    """A second K3ForCausalLM with `model`'s weights and every decoder layer compiled (train.compile_split `split`),
    then recomputed under `policy` (train.recompute), as the Trainer applies them."""
    twin = K3ForCausalLM(cfg).train()
    twin.load_state_dict(model.state_dict(), strict=True)
    compile_layers(twin, backend=backend, cache=os.environ["TORCHINDUCTOR_CACHE_DIR"], split=split)  # set_cache's
    apply_recompute(twin, Policy(policy))
    return twin


def section_train(args):
    print(f"## 1. Training step: forward, backward, AdamW; batch {args.batch} x {args.seq}, {args.steps} steady "
          f"steps after the first")
    print()
    cfg = load_model_config("kimi_linear_tiny", train_step.OVERRIDES)
    hf, ours = train_step.build_models(cfg)
    n = sum(p.numel() for p in ours.parameters())
    x, y = train_step.make_batch(cfg.vocab_size, args.batch, args.seq)
    whole = "ours compiled, one graph per layer"
    hf_name = "HF KimiLinearForCausalLM (torch path, eager)"
    models = {"ours eager": (ours, False), whole: (compiled_copy(ours, cfg, args.backend, "layer"), False),
              "ours compiled": (compiled_copy(ours, cfg, args.backend), False), hf_name: (hf, True)}
    train_compare(f"(a) Kimi Linear layout (bench/train_step.py), {cfg.num_layers} layers, {n / 1e6:.1f}M params; "
                  "compiled split at the recomputation regions (the default) and as one graph per layer",
                  models, x, y, args.steps,
                  checks=[("ours compiled", "ours eager"), (whole, "ours eager"), ("ours eager", hf_name)],
                  ratios=[("ours eager", hf_name), ("ours compiled", hf_name), (whole, hf_name),
                          ("ours compiled", "ours eager"), (whole, "ours eager"), ("ours compiled", whole)],
                  profile_top=args.profile_top)
    del models, hf, ours

    cfg = load_model_config("k3_tiny")
    torch.manual_seed(0)
    ours = K3ForCausalLM(cfg).train()
    n = sum(p.numel() for p in ours.parameters())
    x, y = train_step.make_batch(cfg.vocab_size, args.batch, args.seq)
    whole, split, sel = "ours compiled, one graph per layer", "ours compiled", "ours compiled, selective"
    models = {"ours eager": (ours, False), whole: (compiled_copy(ours, cfg, args.backend, "layer"), False),
              split: (compiled_copy(ours, cfg, args.backend), False),
              sel: (compiled_copy(ours, cfg, args.backend, policy="selective"), False)}
    train_compare(f"(b) k3_tiny, {cfg.num_layers} layers, {n / 1e6:.1f}M params; compiled split at the "
                  "recomputation regions (train.compile_split=regions, the default) and as one graph per layer "
                  "(layer), and split with train.recompute=selective", models, x, y, args.steps,
                  checks=[(split, "ours eager"), (whole, "ours eager"), (sel, split)],
                  ratios=[(split, "ours eager"), (whole, "ours eager"), (split, whole), (sel, split)],
                  profile_top=args.profile_top)


# ---------------------------------------------------------------- 2. MoE layer

def latent_gemms(N, D, L):
    """The latent down (D -> L) and up (L -> D) projections' 6 GEMMs: forward, input and weight gradient of each."""
    g = torch.Generator().manual_seed(4)
    x, z, dz, dy = (torch.randn(N, w, generator=g) for w in (D, L, L, D))
    wd, wu = torch.randn(L, D, generator=g), torch.randn(D, L, generator=g)

    def run():
        x @ wd.t(), dz @ wd, dz.t() @ x
        z @ wu.t(), dy @ wu, dy.t() @ z
    return run


def section_moe(args):
    d = moe_bench.parser().parse_args([])  # bench/moe.py's default shapes
    d.batch, d.seq = 1, args.batch * args.seq
    if args.latent is not None:
        d.latent = args.latent
    N, D, E, k, I, L = d.seq, d.hidden, d.experts, d.top_k, d.inter, d.latent
    C = capacity(N, k, E, d.capacity_factor)
    W = moe_bench.make_weights(D, E, I)
    x = torch.randn(1, N, D, generator=torch.Generator().manual_seed(7))
    ours = moe_bench.build_ours(d, W, "situ", "auto", L)
    hf = moe_bench.build_hf(d, W, "grouped_mm")
    lat = f"Stable LatentMoE L={L}" if L else "full width"
    o, h = f"ours K3 ({lat}, situ, auto = dropless)", "HF KimiLinearMoE grouped_mm (silu)"
    print(f"## 2. MoE layer: forward+backward, {N} tokens, hidden {D}, {E} experts, top-{k}, expert width {I}, "
          f"one shared expert; ours: {lat}; loss = out.square().mean()")
    print()
    impls = {f"{o}, eager": ours, f"{o}, compiled": torch.compile(ours, backend=args.backend, dynamic=False),
             f"{h}, eager": hf, f"{h}, compiled": torch.compile(hf, backend=args.backend, dynamic=False)}
    first, failed = {}, {}
    for name, m in impls.items():
        before = dynamo_stats()
        t0 = time.perf_counter()
        try:
            out = moe_bench.out_and_grad(m, x)
        except Exception as e:  # noqa: BLE001 - a model that does not compile is reported, not fatal
            failed[name] = why(e)
            continue
        first[name] = time.perf_counter() - t0
        if name.endswith("compiled"):
            y_e, g_e = moe_bench.out_and_grad(impls[name.replace("compiled", "eager")], x)
            print(f"check: {name}: {compiled_note(before)}; max rel diff vs eager: output "
                  f"{moe_bench.rel(out[0], y_e):.1e}, input grad {moe_bench.rel(out[1], g_e):.1e}")
    for name, reason in failed.items():
        print(f"{name}: does not compile with backend {args.backend}, row left out: {reason}")
        del impls[name]

    # the floors: the routed experts' GEMMs (the fastest of bench/moe.py's bmm, _grouped_mm and fused forms) at the
    # experts' width, + the shared expert and router at D, + (ours, latent) the latent projections
    full = list(moe_bench.gemm_kernels(N, k, E, D, I, C).items())
    routed_ours = list(moe_bench.gemm_kernels(N, k, E, L, I, C).items()) if L else full
    parts = {"routed, HF width": [full[i] for i in (0, 1, 3)], "routed, ours": [routed_ours[i] for i in (0, 1, 3)],
             "shared + router": [full[5]]}
    if L:
        parts["latent projections"] = [(f"latent projections {D}<->{L}", (latent_gemms(N, D, L), 0))]
    kernels = {name: f for rows in parts.values() for name, (f, _) in rows}
    kernels = {f"floor: {n}": f for n, f in kernels.items()}
    runs = {**{n: (lambda m=m: moe_bench.fwd_bwd(m, x)) for n, m in impls.items()},
            **{n: (lambda f=f: moe_bench._timed(f)) for n, f in kernels.items()}}
    times = moe_bench.round_robin(runs, args.warmup, args.reps)
    med = {n: statistics.median(ts) for n, ts in times.items()}

    def floor(part):
        return min(med[f"floor: {n}"] for n, _ in parts[part])
    f_hf = floor("routed, HF width") + floor("shared + router")
    f_ours = floor("routed, ours") + floor("shared + router") + (floor("latent projections") if L else 0.0)
    floors = {o: f_ours, h: f_hf}
    print(f"load average (1 min) after timing: {os.getloadavg()[0]:.2f}; {args.reps} round-robin repetitions after "
          f"{args.warmup} warm-up rounds")
    print()
    rows = []
    for name in impls:
        base = o if name.startswith(o) else h
        eager = f"{base}, eager"
        speed = f"{med[eager] / med[name]:.2f}x" if name.endswith("compiled") and eager in med else "-"
        rows.append((name, f"{first[name]:.2f}", f"{med[name] * 1e3:.1f}", f"{min(times[name]) * 1e3:.1f}",
                     f"{N / med[name]:,.0f}", f"{med[name] / floors[base]:.2f}", speed))
    for base, fl in ((o, f_ours), (h, f_hf)):
        rows.append((f"GEMM floor of {base.split(' (')[0]}", "-", f"{fl * 1e3:.1f}", "-", f"{N / fl:,.0f}", "1.00",
                     "-"))
    table(("implementation", "first call s", "median ms", "best ms", "tokens/s (median)", "x its GEMM floor",
           "compiled / eager (tokens/s)"), rows)
    print(f"GEMM floor = bare GEMMs, no autograd (bench/moe.py's gemm_kernels; routed = fastest of bmm, _grouped_mm "
          f"and fused gate/up _grouped_mm, {N * k} rows split evenly over {E} experts): "
          + "; ".join(f"{p} {floor(p) * 1e3:.1f} ms" for p in parts))
    print()


# ---------------------------------------------------------------- 3. GLU

def _bind(fn, act):
    def glu(gate, up):
        return fn(gate, up, act)
    return glu


def section_glu(args):
    R, I = args.glu_rows, args.glu_inter
    g = torch.Generator().manual_seed(5)
    gate = (2 * torch.randn(R, I, generator=g)).requires_grad_()
    up = (2 * torch.randn(R, I, generator=g)).requires_grad_()
    dh = torch.randn(R, I, generator=g)
    print(f"## 3. GLU: forward+backward on [{R}, {I}] fp32 (gate, up ~ N(0, 4); one fixed output gradient; "
          "torch.autograd.grad to gate and up)")
    print()
    fa, fr = "glu_act (autograd Function)", "glu_reference (autograd per op)"
    fns = {}
    for act in ("situ", "silu"):
        for label, fn in ((fa, glu_act), (fr, glu_reference)):
            f = _bind(fn, act)
            fns[(act, label, "eager")] = f
            fns[(act, label, "compiled")] = torch.compile(_bind(fn, act), backend=args.backend, dynamic=False)

    def call(f):
        t0 = time.perf_counter()
        h = f(gate, up)
        grads = torch.autograd.grad(h, (gate, up), dh)
        return time.perf_counter() - t0, h.detach(), grads

    first, results = {}, {}
    for key, f in fns.items():  # the first call of a compiled one compiles its forward and backward
        before = dynamo_stats()
        first[key], h, grads = call(f)
        results[key] = (h, *grads, compiled_note(before) if key[2] == "compiled" else "")
    for (act, label, mode), (h, dg, du, note) in results.items():
        rh, rdg, rdu, _ = results[(act, fr, "eager")]
        print(f"check: {act}, {label}, {mode}{' (' + note + ')' if note else ''}: max rel diff vs glu_reference "
              f"eager: h {moe_bench.rel(h, rh):.1e}, d gate {moe_bench.rel(dg, rdg):.1e}, "
              f"d up {moe_bench.rel(du, rdu):.1e}")
    runs = {key: (lambda f=f: call(f)[0]) for key, f in fns.items()}
    times = moe_bench.round_robin(runs, args.warmup, args.reps)
    med = {key: statistics.median(ts) for key, ts in times.items()}
    print(f"load average (1 min) after timing: {os.getloadavg()[0]:.2f}; {args.reps} round-robin repetitions after "
          f"{args.warmup} warm-up rounds (first calls, which compile, excluded)")
    print()
    rows = []
    for (act, label, mode), m in med.items():
        rows.append((act, label, mode, f"{first[(act, label, mode)]:.2f}", f"{m * 1e3:.2f}",
                     f"{min(times[(act, label, mode)]) * 1e3:.2f}", f"{med[(act, fa, 'eager')] / m:.2f}",
                     f"{med[(act, fa, 'compiled')] / m:.2f}"))
    table(("act", "implementation", "mode", "first call s", "median ms", "best ms", "speed vs glu_act eager",
           "speed vs glu_act compiled"), rows)
    print("(speed = the column's median time / the row's: > 1, the row is faster)")
    for act in ("situ", "silu"):
        a, r = med[(act, fa, "compiled")], med[(act, fr, "compiled")]
        print(f"{act}: compiled with {args.backend}, the plain formula runs at {a / r:.2f}x the speed of the "
              f"hand-written Function ({'the formula' if r < a else 'the Function'} is faster under compile)")
    print()


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4, help="train: batch; moe: batch x seq tokens")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="train: steady steps after the first")
    ap.add_argument("--reps", type=int, default=20, help="moe, glu: round-robin repetitions")
    ap.add_argument("--warmup", type=int, default=3, help="moe, glu: untimed rounds before the repetitions")
    ap.add_argument("--backend", default="inductor", choices=BACKENDS)
    ap.add_argument("--only", action="append", help=f"sections to run, repeatable or comma list: {SECTIONS}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm-cache", metavar="DIR", help="reuse this compile cache (default: a fresh temporary one)")
    ap.add_argument("--latent", type=int, default=None, help="moe: ours' latent width (default bench/moe.py's)")
    ap.add_argument("--profile-top", type=int, default=0,
                    help="train: profile one more step of ours and list this many ops (inductor's kernels named: "
                         "their code records itself, a little slower)")
    ap.add_argument("--glu-rows", type=int, default=8192)
    ap.add_argument("--glu-inter", type=int, default=256)
    args = ap.parse_args()
    only = [s.strip() for o in (args.only or [",".join(SECTIONS)]) for s in o.split(",") if s.strip()]
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        ap.error(f"--only: unknown section(s) {bad}; valid: {', '.join(SECTIONS)}")
    try:
        check_backend(args.backend, torch.device("cpu"))
    except ConfigError as e:
        sys.exit(str(e))
    torch.set_num_threads(args.threads)
    if args.profile_top:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # generated CPU kernels appear by name in the profile
    tmp, cache_line = set_cache(args.warm_cache)
    print(f"machine: {machine()}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; load average "
          f"(1 min) {os.getloadavg()[0]:.2f}")
    print(f"backend: {args.backend}, torch.compile(dynamic=False); {cache_line}; fp32")
    print()
    try:
        for s in SECTIONS:
            if s in only:
                {"train": section_train, "moe": section_moe, "glu": section_glu}[s](args)
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
