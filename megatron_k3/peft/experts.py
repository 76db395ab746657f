"""A MoE layer's routed experts frozen in the release's MXFP4 encoding, with optional per-expert LoRA adapters
(`peft=lora`): `FrozenExperts` takes a GroupedExperts' place and its calls (`forward` over expert-sorted rows,
`forward_batched` over static [E, C, L] buffers, the dispatcher's combine), running ops.frozen_experts, which decodes
`block` experts at a time inside the GEMM path.

The base lives in non-persistent uint8 buffers (`w1_packed`, `w1_scale`, ...: 0.53 bytes per parameter), so it is
neither in the state dict nor in a training checkpoint; it is read from the release (interop.load_hf_sharded reads
the packed codes straight into them) or, for a run without a base directory, encoded from the initialised weights
it replaces. The adapters (`w1_lora_A` [E, r, L], `w1_lora_B` [E, I, r], likewise w3, and w2 with L and I swapped)
are parameters annotated like the experts they adapt (batched; their expert-parallel block), so the optimizer,
ZeRO and the checkpoints treat them as experts.

Legend as in model.experts: E experts (of this module), L expert width, I intermediate size, r the LoRA rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ..annotations import annotate, meta
from ..model.experts import GroupedExperts
from ..ops.frozen_experts import ExpertAdapters, PackedExperts, frozen_experts_batched, frozen_experts_grouped
from ..ops.grouped_gemm import experts_reference, weighted_combine

__all__ = ["FrozenExperts", "MATRICES", "adapter_names"]

MATRICES = ("w1", "w3", "w2")


def adapter_names(n: str) -> tuple:
    """The (A, B) parameter names of matrix n's adapters."""
    return f"{n}_lora_A", f"{n}_lora_B"


class FrozenExperts(nn.Module):
    """The routed experts of one MoE layer (this rank's block of them), frozen as MXFP4 codes and E8M0 scales,
    plus, when `rank` > 0, per-expert adapters w_eff[e] = w[e] + scale * B[e] A[e] of each matrix (B = 0 at the
    start: the layer computes exactly what the frozen experts compute)."""

    def __init__(self, experts: GroupedExperts, rank: int = 0, scale: float = 1.0, block: int = 8):
        super().__init__()
        self.num_experts, self.width, self.inter = experts.num_experts, experts.width, experts.inter
        self.act, self.beta_gate, self.beta_up = experts.act, experts.beta_gate, experts.beta_up
        self.expert_offset, self.qat, self.recompute_act = experts.expert_offset, experts.qat, experts.recompute_act
        self.block, self.rank, self.scale = block, rank, scale
        for n in MATRICES:
            w = getattr(experts, n)
            E, O, K = w.shape
            if w.is_meta:
                packed, sc = (torch.empty(E, O, k, dtype=torch.uint8, device="meta") for k in (K // 2, K // 32))
            else:
                enc = PackedExperts.encode(w.detach().float())
                packed, sc = enc.packed, enc.scale
            self.register_buffer(f"{n}_packed", packed, persistent=False)
            self.register_buffer(f"{n}_scale", sc, persistent=False)
            if rank:
                a, b = adapter_names(n)
                like = dict(device=w.device, dtype=w.dtype)
                setattr(self, a, self._adapter(torch.empty(E, rank, K, **like), w))
                setattr(self, b, self._adapter(torch.zeros(E, O, rank, **like), w))

    @staticmethod
    def _adapter(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
        """A parameter annotated as a batch of independent matrices, in `like`'s expert-parallel block."""
        m = meta(like)
        return annotate(nn.Parameter(t), batched=True, ep_size=m.ep_size, ep_rank=m.ep_rank)

    @property
    def num_local(self) -> int:
        return self.w1_packed.shape[0]

    def packed(self, n: str) -> PackedExperts:
        """Matrix n (w1, w3, w2) of this module's experts as stored."""
        return PackedExperts(getattr(self, f"{n}_packed"), getattr(self, f"{n}_scale"))

    def _adapter_tensors(self) -> tuple:
        """(A1, B1, A3, B3, A2, B2): the adapters' parameters in ExpertAdapters' order."""
        return tuple(getattr(self, a) for n in MATRICES for a in adapter_names(n))

    def adapters(self) -> ExpertAdapters | None:
        return ExpertAdapters(*self._adapter_tensors(), self.scale) if self.rank else None

    def _run(self, x: torch.Tensor, offs_E: torch.Tensor | None, packed=None, ab=None) -> torch.Tensor:
        """The frozen experts (`packed`: default this module's codes) with the adapters (`ab`: default this module's)
        in the activations' dtype, as the frozen GEMMs compute."""
        q = self.qat
        packed = packed or [self.packed(n) for n in MATRICES]
        ab = ab if ab is not None or not self.rank else self._adapter_tensors()
        ad = ExpertAdapters(*(t.to(x.dtype) for t in ab), self.scale) if self.rank else None
        if q is not None:
            x = q.act(x)
        args = (*packed, self.act, self.beta_gate, self.beta_up, self.block, ad, None if q is None else q.act)
        return frozen_experts_batched(x, *args) if offs_E is None else frozen_experts_grouped(x, offs_E, *args)

    def forward(self, z_ML: torch.Tensor, offs_E: torch.Tensor, combine=None) -> torch.Tensor:
        """Expert-sorted rows [M, L] -> [M, L]; `combine` = (w_M, tok_M, num_rows) returns the fp32 weighted sum
        into [num_rows, L] instead (GroupedExperts.forward's contract)."""
        y = self._run(z_ML, offs_E)
        return y if combine is None else weighted_combine(y, *combine)

    def forward_batched(self, x_ECL: torch.Tensor, combine=None) -> torch.Tensor:
        """Static [E, C, L] -> [E, C, L]; `combine` as in `forward`, over the E * C rows."""
        y = self._run(x_ECL, None)
        return y if combine is None else weighted_combine(y.reshape(-1, y.shape[-1]), *combine)

    def exchanged(self) -> list:
        """[(tensors, trained)] balanced dispatch sends to the ranks that host replicas of these experts
        (parallel.balanced.exchanged): the MXFP4 codes and scales (uint8, no gradient), then the adapters."""
        codes = tuple(getattr(self, f"{n}_{k}") for n in MATRICES for k in ("packed", "scale"))
        return [(codes, False)] + ([(self._adapter_tensors(), True)] if self.rank else [])

    def forward_with(self, z_ML: torch.Tensor, offs_E: torch.Tensor, replicas) -> torch.Tensor:
        """`forward` over row groups of this module's experts followed by replicas of other experts (balanced
        dispatch): `replicas` in the order of `exchanged()`, [S, ...] each; offs_E has num_local + S entries. The
        replicas' adapters are autograd tensors whose gradients go back to their owners."""
        codes, ab = replicas[:6], replicas[6:]
        packed = [PackedExperts(torch.cat([getattr(self, f"{n}_packed"), codes[2 * i]]),
                                torch.cat([getattr(self, f"{n}_scale"), codes[2 * i + 1]]))
                  for i, n in enumerate(MATRICES)]
        own = [torch.cat([o, r.to(o.dtype)]) for o, r in zip(self._adapter_tensors(), ab)] if self.rank else None
        return self._run(z_ML, offs_E, packed, own)

    def merged(self, dtype=torch.float32) -> tuple:
        """(w1, w3, w2) [E, ...] decoded in `dtype` with the adapters merged in (tests, merge tools)."""
        out = []
        for n in MATRICES:
            w = self.packed(n).decode(dtype=dtype)
            if self.rank:
                a, b = (getattr(self, name).detach().to(dtype) for name in adapter_names(n))
                w = w + self.scale * torch.bmm(b, a)
            out.append(w)
        return tuple(out)

    def forward_reference(self, z_ML: torch.Tensor, expert_M: torch.Tensor) -> torch.Tensor:
        """Plain per-row reference through the merged weights (tests)."""
        w1, w3, w2 = self.merged(z_ML.dtype)
        return experts_reference(z_ML, expert_M, w1, w3, w2, self.act, self.beta_gate, self.beta_up)

    def extra_repr(self) -> str:
        return (f"experts={self.num_local}/{self.num_experts}, width={self.width}, inter={self.inter}, mxfp4, "
                f"lora_rank={self.rank}, block={self.block}")
