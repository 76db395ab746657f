"""Two layouts' training runs compared step by step, with top-k routing's discrete choices accounted for.

Every layout computes the single-process function, but not bit for bit: another summation order moves values by
rounding (~1e-7 relative), and AdamW's per-element normalisation amplifies it (test_engine's docstring). Top-k
routing is discontinuous on top of that: a token whose k-th and (k+1)-th biased router scores are closer than
that perturbation can pick another expert in one layout than in the other, and from then on the runs diverge by
far more than rounding. This is no bug and its occurrence is luck of the draw: in a tiny model at init the 16
sigmoid scores of a token lie within a few 1e-2 of 0.5, so among the ~3000 routing decisions of a 5-step test a
gap of a few fp32 ulps turns up in roughly one draw of ten (measured on k3_tiny: a 1.2e-7 gap at step 3 moved
router weights by 1e-2 after step 5, with every earlier step equal to 1e-7).

So a run is recorded per step (`record`): its loss, the global per-expert token counts (the step's routing
decisions, summed over every rank), the parameters at full size, and (from the reference run) how many routing
decisions of each MoE layer were near-ties, gap below NEAR_TIE. `compare` finds the first step whose routing
differs between the runs. There, in the first MoE layer that differs, the assignments that moved must be no more
than that layer's near-ties (a wrong reduction or a misrouted token moves many decisions with large gaps); the
losses and parameters are compared strictly on every step before it, and the step count compared is returned.
NEAR_TIE = 1e-4 is ~1000x the perturbation of a few steps and ~30x below the typical gap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from helpers import norm_rel

NEAR_TIE = 1e-4


@dataclass
class Step:
    loss: float
    loads: torch.Tensor  # [MoE layers, experts] token counts of the whole step, every rank's (float64)
    params: dict  # full-size parameters after the step
    near_ties: list = field(default_factory=list)  # per MoE layer: decisions with a gap below NEAR_TIE (this rank)
    record: dict = field(default_factory=dict)  # the trainer's logged record of the step


def _gap_hook(counts: list, row: int, k: int):
    def hook(router, args, out):
        if not router.training or not torch.is_grad_enabled():
            return
        biased = out.scores_NE.detach().float() + router.e_score_correction_bias.float()
        if biased.shape[-1] <= k:
            return
        top = biased.topk(k + 1, dim=-1).values
        counts[row] += int(((top[:, k - 1] - top[:, k]) < NEAR_TIE).sum())
    return hook


def record(trainer, steps: int, full_params, near_ties: bool = True) -> list:
    """`steps` training steps of `trainer`, each as a Step (`full_params(trainer)` gathers the parameters).
    near_ties=False leaves the routers unobserved (`compare` reads only the reference run's near-ties; a compiled run
    must not have a hook reading values on the host inside its compiled layers)."""
    rows = trainer.routing.rows
    counts = [0] * len(trainer.routing.layer_ids)
    handles = [m.gate.register_forward_hook(_gap_hook(counts, row, m.top_k))
               for row, m in zip(rows, trainer.moe)] if near_ties else []
    out = []
    try:
        for _ in range(steps):
            counts[:] = [0] * len(counts)
            rec, loads = trainer.train_step()
            out.append(Step(rec["loss"], loads.clone().double(), full_params(trainer), list(counts), rec))
    finally:
        for h in handles:
            h.remove()
    return out


def compare(ref: list, got: list, loss_rtol: float, param_rtol: float, what: str = "") -> int:
    """Assert that run `got` follows the reference `ref` (both from `record`): equal routing and, up to the first
    step whose routing differs, losses within loss_rtol and parameters within param_rtol (per tensor, in norm);
    a routing difference is allowed only where the reference had as many near-ties. Returns the steps compared."""
    assert len(ref) == len(got), (what, len(ref), len(got))
    compared = len(ref)
    for s, (r, g) in enumerate(zip(ref, got)):
        if torch.equal(r.loads, g.loads):
            continue
        moved = (r.loads - g.loads).abs().sum(-1) / 2  # assignments that went to another expert, per layer
        first = int(torch.nonzero(moved)[0])
        assert moved[first] <= r.near_ties[first], (
            f"{what}: step {s + 1}, MoE layer row {first}: {int(moved[first])} routing assignments differ from the "
            f"single-process run, which had {r.near_ties[first]} decisions within {NEAR_TIE} of a tie there")
        compared = s
        break
    for s in range(compared):
        a, b = got[s].loss, ref[s].loss
        assert abs(a - b) <= loss_rtol * abs(b), (what, s + 1, [x.loss for x in got], [x.loss for x in ref])
    if compared:
        params, ref_params = got[compared - 1].params, ref[compared - 1].params
        worst = max((norm_rel(params[n], p), n) for n, p in ref_params.items() if n in params)
        if worst[0] >= param_rtol:
            d = (params[worst[1]] - ref_params[worst[1]]).abs()
            raise AssertionError(f"{what}: after step {compared}, {worst[1]} differs by {worst[0]:.3g} relative "
                                 f"(in norm), over {param_rtol}; largest "
                                 f"element differences {d.flatten().topk(min(5, d.numel())).values.tolist()}; "
                                 f"losses {[x.loss for x in got]} vs {[x.loss for x in ref]}")
    return compared
