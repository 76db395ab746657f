"""Router selection-bias balancing after each optimizer step: K3's Quantile Balancing, DeepSeek-V3's sign update,
or none (`moe.balancing`). ../shared/design/MODEL.md section 5.

Legend: N tokens, E experts, k experts per token, B histogram bins.

Quantile Balancing, from the step's router scores s (fp32) and the bias b they were routed with:
  c_n   = the (k+1)-th largest of s_n + b        (the first expert token n did not choose)
  mu_ne = s_ne - c_n                             (how far expert e's raw score is above that cutoff)
  q     = floor(M k / E) for the M tokens of the step, over every rank that routes distinct tokens
  b^_e  = -(the (q+1)-th largest of mu_.e)       (then exactly q tokens have s_ne + b^_e > c_n)
  b     = b^ - mean(b^)                          (centring changes no routing decision)
The quantile is exact (every margin gathered, `torch.kthvalue`) or read from per-expert histograms pooled with
one all-reduce, interpolated inside the bin (error at most one bin width). The histogram range
[-1 - max b, 1 - min b] holds every margin by construction (scores lie in (0, 1)), so nothing falls outside it.
Only real forward passes in training are observed (not evaluation, not activation recomputation).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

log = logging.getLogger("megatron_k3.balancing")


class BiasBalancer:
    """Observes one MoE layer's router scores during a step (installed as `moe.balance`) and sets its
    selection bias after the optimizer step."""

    def __init__(self, moe, cfg, group=None, tokens_per_step: int = 0):
        self.moe, self.cfg, self.group = moe, cfg, group
        self.tokens_per_step = tokens_per_step  # over every rank: decides the estimator under auto
        self.E, self.k = moe.num_experts, moe.top_k
        self.bias = moe.gate.e_score_correction_bias
        self._reset()

    def _reset(self):
        self.margins, self.tokens = [], 0
        self.inputs = []  # rescore: the router inputs of this step (a strided subset when large)
        self.hist = None
        self.loads = torch.zeros(self.E, dtype=torch.float64, device=self.bias.device)
        self.range = None

    # ------------------------------------------------------------------ during the step
    @torch.no_grad()
    def observe(self, scores_NE: torch.Tensor, bias_E: torch.Tensor, x_ND: torch.Tensor | None = None) -> None:
        """One real training forward's router scores (and, with moe.rescore, its router inputs)."""
        if self._rescoring() and x_ND is not None:
            self.loads += self._loads(scores_NE.float() + bias_E.float())
            stride = max(1, -(-x_ND.shape[0] // self.cfg.rescore_max_tokens))
            self.inputs.append(x_ND[::stride].detach().clone())
            self.tokens += x_ND.shape[0]
            return
        self._observe_scores(scores_NE, bias_E)

    def _rescoring(self) -> bool:
        return self.cfg.rescore and self.cfg.balancing == "quantile" and self.k < self.E

    def _loads(self, biased_NE):
        chosen = biased_NE.topk(self.k, dim=-1).indices
        return torch.bincount(chosen.reshape(-1), minlength=self.E).to(self.loads.dtype)

    def _observe_scores(self, scores_NE: torch.Tensor, bias_E: torch.Tensor, count: bool = True) -> None:
        s = scores_NE.float()
        biased = s + bias_E.float()
        if count:
            self.tokens += s.shape[0]
            self.loads += self._loads(biased)
        if self.cfg.balancing != "quantile" or self.k >= self.E:
            return
        cutoff_N1 = biased.topk(self.k + 1, dim=-1).values[:, -1:]
        mu_NE = s - cutoff_N1
        if self._exact():
            self.margins.append(mu_NE)
            return
        B = self.cfg.histogram_bins
        if self.range is None:  # device tensors: observing never waits for the host
            b = bias_E.detach().double()
            self.range = (-1.0 - b.max(), 1.0 - b.min())
            self.hist = torch.zeros(self.E * B, dtype=torch.float64, device=s.device)
        lo, hi = self.range
        width = (hi - lo) / B
        bins = ((mu_NE.double() - lo) / width).floor().clamp_(0, B - 1).long()
        flat = bins + torch.arange(self.E, device=s.device) * B
        self.hist += torch.bincount(flat.reshape(-1), minlength=self.E * B).to(self.hist.dtype)

    def _exact(self) -> bool:
        est = self.cfg.quantile_estimator
        if est != "auto":
            return est == "exact"
        return self.tokens_per_step * self.E <= self.cfg.exact_max_margins

    # ------------------------------------------------------------------ after the optimizer step
    @torch.no_grad()
    def step(self) -> None:
        if self.tokens == 0:
            return
        mode = self.cfg.balancing
        if self._rescoring() and self.inputs:
            # Score this step's tokens again with the router as the optimizer step just left it: the bias then
            # answers the weights the next step routes with, not the ones before the update (the drift between
            # estimating and applying that MODEL.md section 5 lists as QB's weakness).
            w = self.moe.gate.weight.detach().float()
            for x in self.inputs:
                self._observe_scores(torch.sigmoid(F.linear(x.float(), w)), self.bias, count=False)
        if mode == "sign":
            loads = self._all_reduce(self.loads)
            self.bias += self.cfg.sign_rate * torch.sign(loads.mean() - loads).to(self.bias.dtype)
        elif mode == "quantile" and self.k < self.E:
            b_hat = self._quantile_exact() if self.margins else self._quantile_histogram()
            self.bias.copy_((b_hat - b_hat.mean()).to(self.bias.dtype))
        self._reset()

    def discard(self) -> None:
        """A skipped step (non-finite values): its scores must not move the bias."""
        self._reset()

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            t = t.clone()
            dist.all_reduce(t, group=self.group)
        return t

    def _quantile_exact(self) -> torch.Tensor:
        mu = torch.cat(self.margins)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            parts = [torch.empty_like(mu) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, mu.contiguous(), group=self.group)
            mu = torch.cat(parts)
        M = mu.shape[0]
        q = (M * self.k) // self.E
        # the (q+1)-th largest is the (M - q)-th smallest
        return -torch.kthvalue(mu.double(), M - q, dim=0).values

    def _quantile_histogram(self) -> torch.Tensor:
        B = self.cfg.histogram_bins
        counts = self._all_reduce(self.hist).view(self.E, B)
        M = int(round(float(counts[0].sum())))
        q = (M * self.k) // self.E
        lo, hi = (float(x) for x in self.range)
        width = (hi - lo) / B
        # above[e, i]: margins in bins i, i+1, ... (whole counts: summed as int64, exact, and deterministic on CUDA,
        # where a floating-point cumsum stops a run under train.deterministic)
        above = counts.long().flip(-1).cumsum(-1).flip(-1).to(counts.dtype)
        target = q + 1
        # the bin holding the (q+1)-th largest: the highest i with above[e, i] >= q + 1
        idx = (above >= target).sum(-1) - 1
        idx = idx.clamp(0, B - 1)
        n_in = counts.gather(1, idx[:, None]).squeeze(1).clamp_min(1)
        n_over = above.gather(1, idx[:, None]).squeeze(1) - n_in  # strictly above the bin
        r = (target - n_over).clamp(1, None)  # its rank inside the bin, from the top
        upper = lo + (idx.double() + 1) * width
        value = upper - (r - 0.5) / n_in * width
        return -value


def install(model, cfg, group, tokens_per_step: int) -> list:
    """One balancer per MoE layer of `model` (none when `moe.balancing=none`); returns them. tokens_per_step:
    tokens routed per step over the whole group (the global batch), for `quantile_estimator=auto`."""
    if cfg.balancing == "none":
        return []
    out = []
    for moe in model.moe_layers():
        moe.balance = BiasBalancer(moe, cfg, group, tokens_per_step)
        out.append(moe.balance)
    if out:
        log.info("moe.balancing=%s over %d MoE layers (%s quantile)", cfg.balancing, len(out),
                 "exact" if out[0]._exact() else f"histogram, {cfg.histogram_bins} bins")
    return out
