"""Routed experts stored as batched weights [E, ...], run as grouped GEMMs over expert-sorted rows or batched GEMMs
over static [E, C, L] buffers (the autograd Functions of ops.grouped_gemm).

Legend: M routed rows, L expert width (latent), I expert intermediate size, E experts, C rows per expert.
Under expert parallelism the module holds a block of the experts (`expert_offset` is the global id of its first
one); megatron_k3.parallel.experts slices it from outside, keeping the weights' global names and order.
"""

from __future__ import annotations

import torch
from torch import nn

from ..annotations import annotate
from ..ops.grouped_gemm import DownCombine, GateUpGLU, GroupedDown, experts_reference, grouped_mm
from ..ops.numerics import autocast_input


class GroupedExperts(nn.Module):
    """E gated MLPs: y = w2 act(w1 z, w3 z), weights w1/w3 [E, I, L] and w2 [E, L, I] ([out, in] per expert)."""

    def __init__(self, num_experts: int, width: int, inter: int, act: str, beta_gate: float = 4.0,
                 beta_up: float = 25.0):
        super().__init__()
        self.num_experts, self.width, self.inter = num_experts, width, inter  # num_experts: of the whole layer
        self.expert_offset = 0  # global id of this module's expert 0
        self.w1 = nn.Parameter(torch.empty(num_experts, inter, width))
        self.w3 = nn.Parameter(torch.empty(num_experts, inter, width))
        self.w2 = nn.Parameter(torch.empty(num_experts, width, inter))
        for w in (self.w1, self.w3, self.w2):  # Muon orthogonalises each expert's matrix on its own
            annotate(w, batched=True)
        self.act, self.beta_gate, self.beta_up = act, beta_gate, beta_up
        # Quantisation-aware training hook (precision=mx_qat, set by megatron_k3.precision.qat): an object with
        # weight(w) and act(x) that fake-quantise along the last (reduction) dimension; None = off.
        self.qat = None
        # Selective recomputation's moe_act (megatron_k3.parallel.recompute sets it): the gate/up GEMM's output is
        # kept and the activation's fp32 intermediates are made again in the backward
        self.recompute_act = False

    @property
    def num_local(self) -> int:
        """The experts this module holds."""
        return self.w1.shape[0]

    def _run(self, x: torch.Tensor, offs_E: torch.Tensor | None, combine=None, replicas=None) -> torch.Tensor:
        # QAT: the weights are fake-quantised inside the GEMMs' Functions, on the transient copies they run against,
        # in the forward and again in the backward: no quantised copy of the weights is kept per micro-batch
        w1, w3, w2, q = self.w1, self.w3, self.w2, self.qat
        wq = None if q is None else q.weight_fn
        x = autocast_input(x)  # under a bf16 autocast the grouped GEMMs run in bf16, as a linear would
        if q is not None:
            x = q.act(x)
        if replicas is not None:  # row groups of the own experts, then of the replicas (balanced dispatch)
            r1, r3, r2 = replicas
            h = GateUpGLU.apply(x, w1, w3, offs_E, self.act, self.beta_gate, self.beta_up, r1, r3, self.recompute_act,
                                wq)
            return GroupedDown.apply(h if q is None else q.act(h), w2, r2, offs_E, wq)
        h = GateUpGLU.apply(x, w1, w3, offs_E, self.act, self.beta_gate, self.beta_up, None, None, self.recompute_act,
                            wq)
        if q is not None:
            h = q.act(h)
        if combine is not None:
            return DownCombine.apply(h, w2, offs_E, *combine, wq)
        if wq is not None:
            return GroupedDown.apply(h, w2, None, offs_E, wq)
        w2t = w2.to(h.dtype).transpose(1, 2)
        return torch.bmm(h, w2t) if offs_E is None else grouped_mm(h, w2t, offs_E)

    def forward(self, z_ML: torch.Tensor, offs_E: torch.Tensor, combine=None) -> torch.Tensor:
        """Expert-sorted rows [M, L], offs_E the cumulative row count per local expert -> [M, L] (grouped GEMMs).
        combine = (w_M, tok_M, num_rows): return instead the fp32 [num_rows, L] sum of w_M[m] * y_m into row
        tok_M[m] (the down projection fused with the dispatcher's combine)."""
        return self._run(z_ML, offs_E, combine)

    def forward_with(self, z_ML: torch.Tensor, offs_E: torch.Tensor, replicas) -> torch.Tensor:
        """`forward` over row groups of this module's experts followed by replicas of other experts, given as their
        (w1, w3, w2) [S, ...] (the balanced dispatch, megatron_k3.parallel.balanced): offs_E has num_local + S
        entries. Neither the parameters nor the replicas are copied into a tensor kept for the backward."""
        return self._run(z_ML, offs_E, None, replicas)

    def forward_batched(self, x_ECL: torch.Tensor, combine=None) -> torch.Tensor:
        """Static shapes: C rows for each local expert, [E, C, L] -> [E, C, L], as batched GEMMs; `combine` as in
        `forward`, over the E * C rows."""
        return self._run(x_ECL, None, combine)

    def forward_reference(self, z_ML: torch.Tensor, expert_M: torch.Tensor) -> torch.Tensor:
        """Plain per-row reference (any dtype, any order): row m goes through local expert expert_M[m]."""
        return experts_reference(z_ML, expert_M, self.w1, self.w3, self.w2, self.act, self.beta_gate, self.beta_up)
