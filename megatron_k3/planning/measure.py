"""Measurements that check the planner against a real model on CPU: FLOPs counted by torch's
FlopCounterMode, and the peak of live tensor memory during a training step.

FLOPs: `torch.utils.flop_counter.FlopCounterMode` counts mm/bmm/baddbmm/convolutions and the fused
attention kernels, but has no formula for three ops the model runs on CPU; `count_flops` registers one
for each, written from the op's shapes alone: `_grouped_mm` (routed experts), `linalg_solve_triangular`
(the KDA UT transform) and the CPU flash-attention kernel and its backward.

Memory: torch has no allocator statistics on CPU, and tracemalloc does not see its allocations.
`LiveTensorMemory` is a dispatch mode that sees every tensor an op returns and tracks the bytes of each
distinct storage from its creation until the storage is freed (a weakref finalizer on the storage), on
top of the storages that already existed (parameters, buffers, optimizer states) registered at entry.
Its peak is the high-water mark of live tensor bytes: what a caching allocator with no fragmentation
would need, i.e. the number the planner estimates. Storages made under `host_allocations()` (activation offload's
host copies, parallel/offload.py) are host memory on an accelerator: they are counted apart (`host_current`,
`host_peak`), not in the device peak, so a CPU run measures what the device would hold.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_flops", "LiveTensorMemory", "StepMemory"]

aten = torch.ops.aten


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """Grouped GEMM: every row of the 2-D operand meets one group's matrix."""
    if len(a_shape) == 2 and len(b_shape) == 3:  # [M, K] x [G, K, N] -> [M, N]
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:  # [K, M] x [M, N], M split into groups -> [G, K, N]
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 3:  # batched [G, M, K] x [G, K, N]
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    return 2 * a_shape[-2] * a_shape[-1] * b_shape[-1]  # [G, M, K] x [K, N]


def _solve_triangular_flop(a_shape, b_shape, *args, out_shape=None, unitriangular=False, left=True, **kwargs) -> int:
    """Forward/back substitution: row i of the solution takes i (unit diagonal) or i + 1 earlier rows."""
    n = a_shape[-1]
    width = b_shape[-1] if left else b_shape[-2]
    batch = 1
    for s in b_shape[:-2]:
        batch *= s
    pairs = n * (n - 1) // 2 if unitriangular else n * (n + 1) // 2
    return 2 * pairs * width * batch


def _sdpa_flop(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    b, h, s_q, d_q = q_shape
    s_k, d_v = k_shape[-2], v_shape[-1]
    return 2 * b * h * s_q * s_k * (d_q + d_v)


def _sdpa_backward_flop(grad_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * _sdpa_flop(q_shape, k_shape, v_shape)


def _custom_mapping() -> dict:
    m = {aten._grouped_mm: _grouped_mm_flop, aten.linalg_solve_triangular: _solve_triangular_flop}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        m[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_flop
        m[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_backward_flop
    return m


def count_flops(fn) -> int:
    """FLOPs of everything `fn()` runs, as torch's FlopCounterMode counts them (plus the formulas above)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_custom_mapping()) as counter:
        fn()
    return counter.get_total_flops()


class LiveTensorMemory(TorchDispatchMode):
    """Bytes of live tensor storage: current and peak, with the phase (a label the caller sets) at the peak."""

    def __init__(self):
        super().__init__()
        self.live: dict = {}
        self.current = 0
        self.peak = 0
        self.phase = ""
        self.peak_phase = ""
        self.host: dict = {}  # storages counted as host memory
        self.host_current = self.host_peak = 0
        self._on_host = False

    @contextlib.contextmanager
    def host_allocations(self):
        """Storages first seen inside count as host memory (offloaded copies), apart from the device peak."""
        before, self._on_host = self._on_host, True
        try:
            yield
        finally:
            self._on_host = before

    def track(self, t: torch.Tensor):
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live or key in self.host:
            return
        n = st.nbytes()
        weakref.finalize(st, self._release, key)
        if self._on_host:
            self.host[key] = n
            self.host_current += n
            self.host_peak = max(self.host_peak, self.host_current)
            return
        self.live[key] = n
        self.current += n
        if self.current > self.peak:
            self.peak, self.peak_phase = self.current, self.phase

    def _release(self, key):
        if key in self.host:
            self.host_current -= self.host.pop(key)
            return
        self.current -= self.live.pop(key, 0)

    def track_all(self, tensors):
        for t in tensors:
            self.track(t)

    def reset_peak(self):
        self.peak, self.peak_phase = self.current, self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            self.track(t)
        # in-place ops and out= variants may grow an existing storage: re-read the sizes they touched
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                key = t.untyped_storage()._cdata
                n = t.untyped_storage().nbytes()
                old = self.live.get(key)
                if old is not None and n != old:
                    self.live[key] = n
                    self.current += n - old
                    if self.current > self.peak:
                        self.peak, self.peak_phase = self.current, self.phase
        return out


@dataclass
class StepMemory:
    """Peak live tensor bytes over a training step and what was resident around it."""
    peak_bytes: int
    peak_phase: str
    params_bytes: int
    grads_bytes: int  # gradients alive at the end of backward
    optimizer_bytes: int  # optimizer states after the step

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / 1e9
