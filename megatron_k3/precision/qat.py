"""MX quantisation-aware training of the routed experts (precision=mx_qat), as K3 is described: MXFP4 (E2M1)
weights and MXFP8 (E4M3) input activations, one E8M0 scale per 32 values along each GEMM's reduction
dimension, straight-through gradients, fp32 master weights.

What is fake-quantised, per GroupedExperts (weights [out, in] per expert, so the reduction dim is the last):
  w1, w3 [E, I, L] along L and w2 [E, L, I] along I to `weight_format`;
  the experts' input z [M, L] and the SiTU-GLU output h [M, I] (the down GEMM's input) to `act_format`.
Attention, the latent projections, the shared experts and the router are untouched (they run under the
run's bf16 autocast). The exported checkpoint (megatron_k3.interop.k3_experts) holds exactly the codes
the forward used.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.experts import GroupedExperts
from ..ops.mx import fake_quant_mx, mx_round_trip


@dataclass(frozen=True)
class ExpertQAT:
    """The hook GroupedExperts consults (its `qat` attribute). `weights=False` leaves the weights as they
    are: for weights that already hold MX values (imported from a K3 checkpoint), where re-quantising them
    is the identity anyway."""

    weight_format: str = "e2m1"
    act_format: str = "e4m3"
    block_size: int = 32
    weight_scale_mode: str = "floor"
    act_scale_mode: str = "floor"
    weights: bool = True
    activations: bool = True

    def weight(self, w):
        return fake_quant_mx(w, self.weight_format, self.block_size, self.weight_scale_mode) if self.weights else w

    def weight_(self, w):
        """`weight` in place, without autograd, on a tensor no one else holds (the transient copy a GEMM runs
        against, ops.grouped_gemm): the experts' Functions quantise it in the forward and again in the backward,
        and pass the gradient straight through, so no quantised copy is kept for the backward."""
        return mx_round_trip(w, self.weight_format, self.block_size, self.weight_scale_mode, out=w)

    @property
    def weight_fn(self):
        """What the experts' GEMM Functions take as `wq`: weight_, or None when the weights are left as they are."""
        return self.weight_ if self.weights else None

    def act(self, x):
        return fake_quant_mx(x, self.act_format, self.block_size, self.act_scale_mode) if self.activations else x


def expert_qat_from_config(precision_cfg) -> ExpertQAT:
    p = precision_cfg
    return ExpertQAT(p.mx_weight_format, p.mx_act_format, p.mx_block_size, p.mx_weight_scale_mode,
                     p.mx_act_scale_mode)


def grouped_experts(model):
    """(name, GroupedExperts) for every routed-expert module of the model."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)]


def enable_expert_qat(model, qat: ExpertQAT | None) -> int:
    """Set (or, with None, clear) the QAT hook on every routed-expert module; returns how many were set.
    Raises ValueError when an expert dimension is not a multiple of the block size."""
    experts = grouped_experts(model)
    for name, m in experts:
        if qat is not None:
            for dim, what in ((m.width, "expert width (moe_latent_size, or hidden_size without a latent)"),
                              (m.inter, "moe_intermediate_size")):
                if dim % qat.block_size:
                    raise ValueError(f"{name}: {what}={dim} is not a multiple of the MX block size {qat.block_size}")
        m.qat = qat
    return len(experts)
