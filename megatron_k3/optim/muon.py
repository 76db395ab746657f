"""Per-Head Muon for the model's matrices and AdamW for the rest, as one torch optimizer (MODEL.md section 6).

Legend: N independent matrices of a batch (heads or experts), A rows, B columns.

For a matrix W with gradient G (one step, MODEL.md 6.1):
    M <- mu M + G;   U = G + mu M (Nesterov) or M;   O = NS5(U)
    W <- W - lr (scale * sqrt(max(A, B)) * O + wd W)          scale = 0.2: AdamW's lr and decay carry over
Per-head (MODEL.md 6.3): a projection partitioned by attention heads runs NS5 and the scale on each head's
block separately; so does each expert: routed experts ([E, A, B], annotated `batched`) and the fused shared
experts (blocks of the shared MLP), never orthogonalised across the expert axis; any other matrix whole.
Blocks are declared on the parameters (their `ParamMeta`: blocks, block_axis, block_kind; megatron_k3.annotations).
The embedding, LM head, AttnRes pseudo-queries, conv filters and 1-D parameters (norms, biases, gate scalars) use
AdamW. optim/grouping.py states the rules (`muon_rule`) and groups the parameters by them.

Tensor parallelism: a rank holds whole heads (and whole shared experts when tp divides their number), so
block work is local. Otherwise (a whole-matrix update of a TP-sharded matrix) the momentum is gathered over
the TP group, the full matrix orthogonalised and this rank's slice kept, so any TP layout steps exactly like
one process. ZeRO lives in optim/zero.py.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from ..annotations import meta
from ..parallel.mappings import Group
from .grouping import tp_gathered

log = logging.getLogger("megatron_k3.optim")

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz (a, b, c), MODEL.md 6.1
_EPS = 1e-7


def newton_schulz(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximate orthogonal factor U V^T of each matrix G = U S V^T of a batch [..., A, B], in `dtype`.

    The quintic iteration X <- a X + (b X X^T + c (X X^T)^2) X maps every singular value through the same
    odd polynomial, so the result is U p(S) V^T with p(s) in about [0.68, 1.13] once s has grown out of
    the small-value regime, where each step multiplies it by a = 3.4445.
    """
    a, b, c = NS_COEFFICIENTS
    tall = G.shape[-2] > G.shape[-1]
    X = (G.mT if tall else G).float()  # rows <= cols, so X X^T is the smaller Gram matrix
    # Frobenius normalisation, in fp32 (any input dtype's range lands in [-1, 1] before the cast): the
    # singular values start in [0, 1], where the iteration converges.
    X = (X / (X.norm(dim=(-2, -1), keepdim=True) + _EPS)).to(dtype)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.mT if tall else X


def to_blocks(t: torch.Tensor, layout: str, n: int = 1, axis: int = 0) -> torch.Tensor:
    """t as [N, A, B], the independent matrices Muon orthogonalises: the matrix itself ('matrix'), a batch
    ('batched', t is already [E, A, B]) or `n` equal blocks along `axis` ('blocks')."""
    if layout == "batched":
        return t
    if layout == "matrix":
        return t.unsqueeze(0)
    if axis == 0:  # [n*K, B] -> [n, K, B]
        return t.reshape(n, t.shape[0] // n, t.shape[1])
    return t.reshape(t.shape[0], n, t.shape[1] // n).transpose(0, 1)  # [A, n*K] -> [n, A, K]


def from_blocks(x_NAB: torch.Tensor, shape, layout: str, n: int = 1, axis: int = 0) -> torch.Tensor:
    """Inverse of `to_blocks`."""
    if layout == "batched":
        return x_NAB
    if layout == "matrix":
        return x_NAB[0]
    if axis == 0:
        return x_NAB.reshape(shape)
    return x_NAB.transpose(0, 1).reshape(shape)


def orthogonalized_update(u: torch.Tensor, layout: str = "matrix", n: int = 1, axis: int = 0,
                          steps: int = 5, scale: float = 0.2, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """scale * sqrt(max(A, B)) * NS5(block) for each block [A, B] of u, in u's shape and dtype."""
    x = to_blocks(u, layout, n, axis)
    rms_match = scale * math.sqrt(max(x.shape[-2], x.shape[-1]))
    o = newton_schulz(x, steps, dtype) * rms_match
    return from_blocks(o.to(u.dtype), u.shape, layout, n, axis)


def ns_dtype(name: str, device: torch.device) -> torch.dtype:
    """'fp32', 'bf16', or 'auto': bf16 on CUDA (as Moonshot runs it), fp32 elsewhere (CPU bf16 matmuls are slow)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


# ---------------------------------------------------------------------------------------------- QK-Clip
class QKClip:
    """QK-Clip for Gated MLA (MODEL.md 6.2): modules with `rescale_qk_` track their per-head max logit in
    the training forward; after each step the max is reduced over data parallelism and every head whose max
    exceeds the threshold tau has its query/key weights rescaled so that its logits shrink by
    gamma = tau / max."""

    def __init__(self, model: torch.nn.Module, threshold: float, dp_group=None):
        self.threshold, self.dp_group = float(threshold), dp_group
        self.modules = [m for m in model.modules() if hasattr(m, "rescale_qk_")]
        for m in self.modules:
            m.track_max_logit = True
        self.last_max_logit = None  # largest per-head max logit of the last step (before clipping)
        self.last_clipped_heads = 0

    @torch.no_grad()
    def apply(self) -> list:
        """Rescale the heads over the threshold; returns the parameters it changed."""
        changed, top, clipped = [], None, 0
        for m in self.modules:
            s_H = m.max_logit_H
            m.max_logit_H = None
            if s_H is None:  # no training forward since the last step
                continue
            if dist.is_initialized() and dist.get_world_size(self.dp_group) > 1:
                dist.all_reduce(s_H, op=dist.ReduceOp.MAX, group=self.dp_group)
            top = s_H.max() if top is None else torch.maximum(top, s_H.max())
            over = s_H > self.threshold
            if bool(over.any()):
                gamma_H = torch.where(over, self.threshold / s_H, torch.ones_like(s_H))
                changed += m.rescale_qk_(gamma_H)
                clipped += int(over.sum())
        self.last_max_logit = None if top is None else float(top)
        self.last_clipped_heads = clipped
        return changed


# ---------------------------------------------------------------------------------------------- optimizer
def _gather_tp(t: torch.Tensor, dim: int, tp) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(tp.size)]
    dist.all_gather(parts, t.contiguous(), group=tp.group)
    return torch.cat(parts, dim)


class Muon(torch.optim.Optimizer):
    """Per-Head Muon for param groups with `use_muon`, AdamW (torch's formula) for the others.

    Build it with `megatron_k3.optim.build_optimizer`; `tp` is the tensor-parallel group the model was
    parallelised over, `qk_clip` an optional QKClip run after every step."""

    def __init__(self, param_groups: list, tp: Group | None = None, qk_clip: QKClip | None = None):
        # Called explicitly: ZeroMuon also derives from DeepSpeed's Muon class, whose __init__ is not wanted.
        torch.optim.Optimizer.__init__(self, param_groups, {})
        self.tp = tp or Group()
        self.qk_clip = qk_clip

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon_step(p, group)
                else:
                    self._adamw_step(p, group)
        self._after_step()
        return loss

    def _after_step(self):
        if self.qk_clip is not None:
            self.qk_clip.apply()

    def _muon_step(self, p, group):
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        update = self.muon_update(p, p.grad, state["momentum_buffer"], group)
        p.mul_(1 - group["lr"] * group["weight_decay"])  # decoupled weight decay
        p.add_(update, alpha=-group["lr"])

    def muon_update(self, p, grad: torch.Tensor, momentum: torch.Tensor, group: dict) -> torch.Tensor:
        """The scaled, orthogonalised update of parameter p (p's local shape); updates `momentum` in place."""
        mu = group["momentum"]
        momentum.mul_(mu).add_(grad)
        u = grad.add(momentum, alpha=mu) if group["nesterov"] else momentum
        m = meta(p)
        layout, axis, dim = group["layout"], m.block_axis, m.tp_dim
        gather, n = tp_gathered(m, layout, self.tp.size)
        if gather:  # the update needs the whole matrix: assemble it, keep this rank's slice
            u = _gather_tp(u, dim, self.tp)
        o = orthogonalized_update(u, layout, n, axis, group["ns_steps"], group["scale"],
                                  ns_dtype(group["ns_dtype"], u.device))
        return o.chunk(self.tp.size, dim)[self.tp.rank] if gather else o

    def _adamw_step(self, p, group):
        """torch.optim.AdamW's single-tensor update, operation for operation."""
        grad, state = p.grad, self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        lr, (beta1, beta2), step = group["lr"], group["betas"], state["step"]
        p.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / (1 - beta2 ** step) ** 0.5).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-(lr / (1 - beta1 ** step)))
