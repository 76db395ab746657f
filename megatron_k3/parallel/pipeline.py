"""Pipeline parallelism: the stage split at AttnRes block boundaries, the 1F1B order, and the point-to-point link
that carries a stage's ResidualState forward and its gradient back (docs/parallelism.md, "Pipeline parallelism").

Legend: N sources (completed blocks + the partial sum), B batch, T tokens, D hidden.

What travels from stage s to s+1, once per micro-batch, as one tensor `x_NBTD`: every completed block
representation the next stage attends over -- b_0 (the embedding) .. b_{k-1} -- and the partial sum, which at a
block boundary is block b_k, completed (the next stage's first layer freezes it). Blocks are relayed: stage s
forwards the blocks it received together with the one(s) it completed, so each block crosses each cut once per
micro-batch and no stage receives anything twice. Backward, the gradient of `x_NBTD` goes back: the later
stages' contributions summed, to which the receiving stage adds its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..model.decoder import ResidualState

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_META_LEN = 8  # [dtype code, ndim, dims...]


def stage_ranges(cfg, pp: int) -> list:
    """[(start, end)] decoder layers of each of the pp stages: whole AttnRes blocks, balanced by layer count
    (planning.layout.stage_layers). ValueError when the model has fewer blocks (or layers) than stages."""
    from ..planning.layout import stage_layers

    return stage_layers(cfg, pp)


def stage_spec(cfg, pp: int, stage: int) -> tuple:
    """(start, end, first, last) of one stage, as K3ForCausalLM(stage=...) takes it."""
    start, end = stage_ranges(cfg, pp)[stage]
    return start, end, stage == 0, stage == pp - 1


def schedule_1f1b(num_micro: int, pp: int, stage: int) -> list:
    """The order of one stage's work in a training step: ("F", i) forward and ("B", i) backward of micro-batch i.
    Warm-up: pp - stage - 1 forwards (the stages after it are still filling); steady state: one forward, one
    backward; cool-down: the remaining backwards. A stage holds at most pp - stage micro-batches' activations."""
    warmup = min(pp - stage - 1, num_micro)
    ops = [("F", i) for i in range(warmup)]
    for i in range(num_micro - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", i) for i in range(num_micro - warmup, num_micro)]
    return ops


def pack(st: ResidualState) -> torch.Tensor:
    """A ResidualState as the one tensor that travels: [N, B, T, D] (N = blocks + partial, or 1 hidden)."""
    return torch.stack(st.blocks + [st.partial]) if st.hidden is None else st.hidden.unsqueeze(0)


def unpack(x_NBTD: torch.Tensor, attn_res: bool) -> ResidualState:
    if not attn_res:
        return ResidualState(hidden=x_NBTD[0])
    parts = list(x_NBTD.unbind(0))
    return ResidualState(blocks=parts[:-1], partial=parts[-1])


class StageLink:
    """Point-to-point with the neighbouring stages over the pipeline group. Sends are asynchronous (kept until
    `wait`); receives block. With the 1F1B order on every stage this cannot deadlock: every receive waits for
    a send its peer posts without waiting on anything, and a send never waits. The shape and dtype of the
    activations are exchanged once (the first message on a link); a gradient has the shape of what was sent."""

    def __init__(self, group):
        self.group = group
        ranks = dist.get_process_group_ranks(group)
        self.stage, self.size = ranks.index(dist.get_rank()), len(ranks)
        self.prev = ranks[self.stage - 1] if self.stage > 0 else None
        self.next = ranks[self.stage + 1] if self.stage < self.size - 1 else None
        self._pending = []
        # gloo moves host tensors; NCCL device tensors
        self.wire = None if dist.get_backend(group) == "nccl" else torch.device("cpu")
        self._sent_meta = False
        self._meta_in = None

    def _isend(self, t: torch.Tensor, dst: int):
        t = t.detach().to(self.wire or t.device).contiguous()
        self._pending.append((dist.isend(t, dst, group=self.group), t))

    def send_forward(self, x: torch.Tensor):
        if not self._sent_meta:
            meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.wire or x.device)
            meta[0], meta[1] = _DTYPES.index(x.dtype), x.dim()
            meta[2:2 + x.dim()] = torch.tensor(x.shape)
            self._isend(meta, self.next)
            self._sent_meta = True
        self._isend(x, self.next)

    def recv_forward(self, device) -> torch.Tensor:
        if self._meta_in is None:
            meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.wire or device)
            dist.recv(meta, self.prev, group=self.group)
            ndim = int(meta[1])
            self._meta_in = (tuple(int(v) for v in meta[2:2 + ndim]), _DTYPES[int(meta[0])])
        shape, dtype = self._meta_in
        x = torch.empty(shape, dtype=dtype, device=self.wire or device)
        dist.recv(x, self.prev, group=self.group)
        return x.to(device)

    def send_backward(self, g: torch.Tensor):
        self._isend(g, self.prev)

    def recv_backward(self, like: torch.Tensor) -> torch.Tensor:
        g = torch.empty(like.shape, dtype=like.dtype, device=self.wire or like.device)
        dist.recv(g, self.next, group=self.group)
        return g.to(like.device)

    def wait(self):
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
