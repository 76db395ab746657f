"""Benchmark: MoE dispatch policies under expert parallelism (ep=4 over gloo, one process per rank) on skewed
routing: `balanced` (model.moe_overflow=balanced, megatron_k3.parallel.balanced, replica slots E/ep unless
--slots), `drop` (static [E, C, L] buffers, moe_capacity_factor=1.25) and `dropless` (split sizes exchanged on the
host), in one run, on the same layer weights and the same inputs.

    .venv/bin/python bench/moe_balanced.py [--tokens 4096 --reps 20 --warmup 3 --zipf 1.0 --threads 1 --ep 4
                                            --slots E/ep --port 0 --timeout 600 --model key=value ... --json PATH]

Exits 1 when a rank fails (its traceback printed), 2 when balanced and dropless outputs differ by 1e-5 or more.

The layer: StableLatentMoE of k3_tiny (hidden 128, 16 experts top-4, width 64 in a latent of 64 with its norm,
one shared expert of width 128), fp32, every parameter N(0, 0.05^2) from seed 0 (the same weights for the three
policies and every rank before sharding), parallelised with parallelize(layer, ParallelGroups.from_state(ps),
slots) under initialize_model_parallel(ep=4). Input per rank: [1, tokens, 128] ~ N(0, 1), seed 1 + rank.

Skewed routing, no balancer installed (Quantile Balancing off): the router's selection-only bias
e_score_correction_bias gets a fixed Zipf-like profile, the same on every rank,
    bias_e = -zipf * 0.125 * ln(r_e),   r = a random permutation of 1..E (torch.Generator seed 1234),
so expert e has popularity rank r_e (0.125 is about the spread of the sigmoid router scores under this init:
their standard deviation is 0.13). The hot experts are spread over the owners by the permutation. The run prints
the resulting per-expert load max/mean (over the E experts, all ranks' tokens; at most E/k = 4) and the per-owner
load max/mean (the pairs routed to each EP rank's E/ep experts over their mean, N*k). With this benchmark's
weights and inputs at --tokens 4096 (expert / owner max/mean): zipf 0 -> 1.09 / 1.03, 0.5 -> 2.23 / 1.25,
1 (the default) -> 3.20 / 1.49, 1.5 -> 3.78 / 1.66, 2 -> 3.97 / 1.76, 3 -> 4.00 / 1.89.

Timing: forward+backward of the layer, loss = out.square().mean(); every repetition runs each policy once
(round-robin, the starting policy rotating with the repetition), after --warmup such rounds. Each rank times its
own step (a barrier before it); a repetition's time is the max over the ranks; the table gives the median of those.

Columns of the table (one row per policy):
- ms: median over repetitions of the max over ranks of the forward+backward time.
- tokens/s: ep * tokens / ms (all ranks' tokens through the layer per second).
- dropped: the layers' `dropped_assignments` buffers summed over ranks / (ep * tokens * k).
- pairs max/mean: the (token, expert) pairs each rank really computes, max over ranks / mean. balanced: from
  dispatcher.balanced.stats[0] (rank_load_R); drop: the kept pairs sent to each rank's experts, sum over sources
  of min(count, C) over its experts; dropless: the pairs routed to each rank's experts (the per-expert counts
  `tokens_per_expert_E` summed over ranks, grouped by owner).
- rows/rank (xM): rows each rank's expert GEMMs run over, in units of M = tokens * k. balanced: its compute buffer
  (compute_capacity: M when slots >= E/ep); drop: the static buffer E/ep experts x ep sources x C; dropless: the
  real pairs of the most loaded rank.
- token rows KiB: bytes of the float all_to_all send buffers (token rows out and back, forward and backward),
  without the block a rank sends to itself, per step and rank, mean over ranks (max in parentheses).
- weights out / grads back KiB (balanced only): the all_to_alls of the weight exchange, forward (the two static
  exchanges of BalancedDispatch._replica_weights and its inner `replicas`) and backward (the replicas' gradients
  returning to their owners), counted the same way.
- index KiB: integer tensors sent (balanced: the pairs' destination codes and buffer positions, all_to_all, and
  the all-gather of the per-expert counts, counted as (ep - 1) copies of the rank's block; dropless: the counts).
- out rel diff: max |y - y_dropless| / max |y_dropless|, max over ranks, on the same input and weights (balanced
  must be below 1e-5; drop differs by the dropped pairs). grad rel diff: the same over the input's gradient and
  every parameter gradient (router, latent projections, experts, shared expert).

Byte counting: torch.distributed.all_to_all_single (which megatron_k3.parallel.mappings calls through
`torch.distributed`, forward and backward, synchronous or async) and balanced's `_all_gather_single` are wrapped
during one untimed checking step per policy. Sent bytes = the input's bytes without this rank's own block (equal
splits: (ep-1)/ep of the input; split sizes: the rows to other ranks). A call is a weight exchange when it is made
inside BalancedDispatch._replica_weights or the `replicas` function it returns (both wrapped to set a tag; the
shared experts, which run inside the first exchange, make no collective call); its (shape, dtype) is recorded,
and an all_to_all in the backward with a recorded weight (shape, dtype) is a gradient return (no token or index
buffer has the weight exchange's row width P/ep). The wrappers are removed before the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from machine import timed_fwd_bwd  # noqa: E402  (bench/machine.py)

POLICIES = ("balanced", "drop", "dropless")
CAPACITY_FACTOR = 1.25
BIAS_SCALE = 0.125
PERM_SEED = 1234
MODEL = ["moe_capacity_factor=1.25"]  # k3_tiny as it is otherwise


def zipf_bias(num_experts: int, zipf: float) -> torch.Tensor:
    """bias_e = -zipf * BIAS_SCALE * ln(r_e), r a seeded random permutation of 1..E (the same on every rank)."""
    r = torch.randperm(num_experts, generator=torch.Generator().manual_seed(PERM_SEED)).double() + 1
    return (-zipf * BIAS_SCALE * torch.log(r)).float()


class Meter:
    """Bytes sent to other ranks by the wrapped collectives, by category (module docstring)."""

    def __init__(self):
        self.on, self.tag, self.weight_keys = False, None, set()
        self.bytes = {}

    def add(self, cat: str, n: int):
        self.bytes[cat] = self.bytes.get(cat, 0) + int(n)

    @contextmanager
    def tagged(self, tag):
        old, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = old

    def all_to_all(self, x: torch.Tensor, in_splits, group):
        R, me = dist.get_world_size(group), dist.get_rank(group)
        if in_splits is None:
            sent = x.numel() * x.element_size() * (R - 1) // R
        else:
            row = x[0].numel() * x.element_size() if x.shape[0] else 0
            sent = row * (sum(in_splits) - in_splits[me])
        key = (tuple(x.shape), x.dtype)
        if self.tag == "weights":
            self.weight_keys.add(key)
            cat = "weights out"
        elif torch._C._current_graph_task_id() != -1 and key in self.weight_keys:
            cat = "grads back"
        else:
            cat = "token rows" if x.is_floating_point() else "index"
        self.add(cat, sent)


def install_meter(meter: Meter):
    """Wrap the collectives (they count while meter.on) and tag balanced's weight exchange; returns the undo."""
    from megatron_k3.parallel import balanced

    a2a = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if meter.on:
            meter.all_to_all(input, input_split_sizes, group)
        return a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = all_to_all_single
    gather = balanced._all_gather_single

    def all_gather_single(out, x, group=None, **kw):
        if meter.on:
            meter.add("index", x.numel() * x.element_size() * (dist.get_world_size(group) - 1))
        return gather(out, x, group=group, **kw)

    balanced._all_gather_single = all_gather_single
    replica_weights = balanced.BalancedDispatch._replica_weights

    def tagged_replica_weights(self, experts, side):
        with meter.tagged("weights"):
            replicas, out = replica_weights(self, experts, side)

        def tagged_replicas(rep_RS):
            with meter.tagged("weights"):
                return replicas(rep_RS)
        return tagged_replicas, out

    balanced.BalancedDispatch._replica_weights = tagged_replica_weights

    def undo():
        dist.all_to_all_single, balanced._all_gather_single = a2a, gather
        balanced.BalancedDispatch._replica_weights = replica_weights
    return undo


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def worker(rank, a, q):
    try:
        q.put(("ok", rank, run_rank(rank, a)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the other ranks
        q.put(("error", rank, traceback.format_exc()))


def run_rank(rank, a):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=a.ep, timeout=timedelta(seconds=a.timeout))
    import logging

    from megatron_k3.config import load_model_config
    from megatron_k3.model.dispatcher import capacity
    from megatron_k3.model.moe import StableLatentMoE
    from megatron_k3.parallel import ParallelGroups, parallelize, state
    from megatron_k3.parallel.balanced import compute_capacity

    logging.getLogger("megatron_k3.moe").setLevel(logging.ERROR)  # dropless under ep > 1 warns: asked for here
    meter = Meter()
    uninstall_meter = install_meter(meter)
    R = a.ep
    ps = state.initialize_model_parallel(ep=R)
    groups = ParallelGroups.from_state(ps)
    layers, cfg = {}, None
    for pol in POLICIES:
        cfg = load_model_config("k3_tiny", [*MODEL, *a.model, f"moe_overflow={pol}"])
        torch.manual_seed(0)
        m = StableLatentMoE(cfg)
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.05)
        with torch.no_grad():
            m.gate.e_score_correction_bias.copy_(zipf_bias(cfg.num_experts, a.zipf))
        layers[pol] = parallelize(m, groups, a.slots if pol == "balanced" else None)
    ref = layers["dropless"].state_dict()
    for pol in POLICIES:
        sd = layers[pol].state_dict()
        assert all(torch.equal(sd[n], ref[n]) for n in ref), f"{pol}: weights differ from dropless's"
    E, k, N = cfg.num_experts, cfg.top_k, a.tokens
    El = E // R
    torch.manual_seed(1 + rank)
    x = torch.randn(1, N, cfg.hidden_size)

    def step(pol):
        return timed_fwd_bwd(layers[pol], x)

    # one untimed checking step per policy: bytes, loads, drops, equality
    check = {}
    for pol in POLICIES:
        meter.on, meter.bytes = True, {}
        _, y, gx = step(pol)
        meter.on = False
        moe = layers[pol]
        grads = [gx] + [p.grad for p in moe.parameters()]
        cnt = moe.tokens_per_expert_E.detach().to(torch.long).contiguous()
        parts = [torch.empty_like(cnt) for _ in range(R)]
        dist.all_gather(parts, cnt)
        cnt_RE = torch.stack(parts)
        dropped = moe.dropped_assignments.detach().clone().double()
        dist.all_reduce(dropped)
        if pol == "balanced":
            load_R = moe.dispatcher.balanced.stats[0].to(torch.long)
            replicas = int(moe.dispatcher.balanced.stats[1])
            rows = compute_capacity(N, k, R, El, moe.dispatcher.balanced.S)
        elif pol == "drop":
            C = capacity(N, k, E, CAPACITY_FACTOR)
            load_R, replicas, rows = cnt_RE.clamp(max=C).sum(0).view(R, El).sum(1), 0, El * R * C
        else:
            load_R, replicas = cnt_RE.sum(0).view(R, El).sum(1), 0
            rows = int(load_R.max())
        check[pol] = dict(y=y, grads=grads, bytes=dict(meter.bytes), load_R=load_R.tolist(), replicas=replicas,
                          rows=rows, dropped=float(dropped), counts_E=cnt_RE.sum(0).tolist())
    res = {"check": {}}
    for pol in POLICIES:
        c = check[pol]
        res["check"][pol] = {key: c[key] for key in ("bytes", "load_R", "replicas", "rows", "dropped", "counts_E")}
        res["check"][pol]["out_rel"] = rel(c["y"], check["dropless"]["y"])
        res["check"][pol]["grad_rel"] = max(rel(g, r) for g, r in zip(c["grads"], check["dropless"]["grads"]))
    del check
    uninstall_meter()

    times = {pol: [] for pol in POLICIES}
    for r in range(a.warmup + a.reps):
        for i in range(len(POLICIES)):
            pol = POLICIES[(r + i) % len(POLICIES)]
            dt, _, _ = step(pol)
            if r >= a.warmup:
                times[pol].append(dt)
    res["times"] = times
    res["cfg"] = dict(E=E, k=k, hidden=cfg.hidden_size, latent=cfg.expert_width, inter=cfg.moe_intermediate_size,
                      shared=cfg.shared_ffn_size, slots=layers["balanced"].dispatcher.balanced.S)
    state.destroy_model_parallel()
    dist.destroy_process_group()
    return res


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarise(a, results):
    R, N = a.ep, a.tokens
    cfg = results[0]["cfg"]
    E, k = cfg["E"], cfg["k"]
    M = N * k
    counts_E = torch.tensor(results[0]["check"]["dropless"]["counts_E"], dtype=torch.double)
    owners = counts_E.view(R, -1).sum(1)
    routing = dict(expert_load_max_over_mean=float(counts_E.max() / counts_E.mean()),
                   owner_load_max_over_mean=float(owners.max() / owners.mean()), counts_E=counts_E.long().tolist(),
                   bias_E=zipf_bias(E, a.zipf).tolist())
    rows = {}
    for pol in POLICIES:
        per_rep = [max(r["times"][pol][i] for r in results) for i in range(a.reps)]
        med = statistics.median(per_rep)
        c0 = results[0]["check"][pol]
        load = torch.tensor(c0["load_R"], dtype=torch.double)
        by = {cat: [r["check"][pol]["bytes"].get(cat, 0) for r in results]
              for cat in ("token rows", "weights out", "grads back", "index")}
        rows[pol] = dict(ms=med * 1e3, tokens_per_s=R * N / med, ms_reps=[t * 1e3 for t in per_rep],
                         dropped_frac=c0["dropped"] / (R * M), pairs_R=c0["load_R"],
                         pairs_max_over_mean=float(load.max() / load.mean()), rows_per_rank=c0["rows"],
                         rows_over_M=c0["rows"] / M, replicas_in_use=c0["replicas"], bytes_per_rank=by,
                         out_rel_diff_vs_dropless=max(r["check"][pol]["out_rel"] for r in results),
                         grad_rel_diff_vs_dropless=max(r["check"][pol]["grad_rel"] for r in results))
    return routing, rows


def kib(v):
    return f"{statistics.mean(v) / 1024:.1f} ({max(v) / 1024:.1f})" if any(v) else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--zipf", type=float, default=1.0, help="skew of the router bias profile (0: none)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--slots", type=int, default=None, help="balanced replica slots per rank (default E/ep)")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--timeout", type=int, default=600, help="gloo timeout, s")
    ap.add_argument("--model", nargs="*", default=[], help="extra k3_tiny overrides, key=value")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    if a.reps < 1 or a.warmup < 0:
        ap.error("--reps must be >= 1 and --warmup >= 0")
    if a.port == 0:
        a.port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, a, q)) for r in range(a.ep)]
    for p in procs:
        p.start()
    results, errors, done = {}, [], False
    try:
        while len(results) + len(errors) < a.ep and not errors:
            status, rank, payload = q.get(timeout=a.timeout + 600)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append((rank, payload))
        done = not errors
    finally:
        if not done:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join()
    if errors:
        for rank, tb in errors:
            print(f"rank {rank} failed:\n{tb}", file=sys.stderr)
        sys.exit(1)
    results = [results[r] for r in range(a.ep)]
    routing, rows = summarise(a, results)
    cfg = results[0]["cfg"]
    print(f"ep={a.ep} (gloo, {a.threads} thread(s) per rank), {a.tokens} tokens per rank, k3_tiny MoE layer: hidden "
          f"{cfg['hidden']}, {cfg['E']} experts top-{cfg['k']} width {cfg['inter']} in latent {cfg['latent']}, "
          f"shared width {cfg['shared']}; balanced slots {cfg['slots']}, drop cf {CAPACITY_FACTOR}; fp32, "
          f"{a.reps} reps after {a.warmup} warm-up rounds, M = tokens*k = {a.tokens * cfg['k']}")
    print(f"routing: zipf {a.zipf} (bias = -{a.zipf} * {BIAS_SCALE} * ln(rank), permutation seed {PERM_SEED}): "
          f"expert load max/mean {routing['expert_load_max_over_mean']:.2f}, owner load max/mean "
          f"{routing['owner_load_max_over_mean']:.2f}; per-expert pairs {routing['counts_E']}")
    print("| policy | ms | tokens/s | dropped | pairs max/mean | pairs per rank | rows/rank (xM) | token rows KiB | "
          "weights out KiB | grads back KiB | index KiB | out rel diff | grad rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for pol, r in rows.items():
        by = r["bytes_per_rank"]
        print(f"| {pol} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {100 * r['dropped_frac']:.2f}% | "
              f"{r['pairs_max_over_mean']:.3f} | {r['pairs_R']} | {r['rows_over_M']:.3f} | {kib(by['token rows'])} | "
              f"{kib(by['weights out'])} | {kib(by['grads back'])} | {kib(by['index'])} | "
              f"{r['out_rel_diff_vs_dropless']:.1e} | {r['grad_rel_diff_vs_dropless']:.1e} |")
    ok = rows["balanced"]["out_rel_diff_vs_dropless"] < 1e-5
    print(f"balanced vs dropless output: max rel diff {rows['balanced']['out_rel_diff_vs_dropless']:.2e} "
          f"({'OK' if ok else 'FAIL'}, tolerance 1e-5); gradients {rows['balanced']['grad_rel_diff_vs_dropless']:.2e}; "
          f"drop vs dropless output {rows['drop']['out_rel_diff_vs_dropless']:.2e}; balanced replica slots in use "
          f"(all ranks) {rows['balanced']['replicas_in_use']}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(args=vars(a), cfg=cfg, routing=routing, policies=rows), indent=1))
    if not ok:
        sys.exit(2)


if __name__ == "__main__":
    main()
