"""Pipeline parallelism: the stage's model part (`stage_part`: its layers, at AttnRes block boundaries from
megatron_k3.layout.stage_layers; `cut_stage` cuts a built model to it), the 1F1B order and its executor
(`run_1f1b`), and the point-to-point link that carries a stage's ResidualState forward and its gradient back
(docs/parallelism.md, "Pipeline parallelism").

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

from ..layout import stage_layers
from ..model.decoder import LayerStack, ResidualState
from ..model.k3 import K3ForCausalLM

__all__ = ["stage_part", "cut_stage", "schedule_1f1b", "run_1f1b", "pack", "unpack", "StageLink"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_META_LEN = 8  # [dtype code, ndim, dims...]


def stage_part(cfg, pp: int, stage: int) -> dict:
    """The model part that pipeline stage `stage` of `pp` holds, as K3ForCausalLM's keyword arguments: its layers
    (whole AttnRes blocks, megatron_k3.layout.stage_layers), the embedding on the first stage, the output end on
    the last."""
    if not 0 <= stage < pp:
        raise ValueError(f"pipeline stage {stage} of pp={pp}")
    if pp > 1 and cfg.tie_word_embeddings:
        raise ValueError("tied embeddings need the embedding and the LM head on one stage")
    start, end = stage_layers(cfg, pp)[stage]
    return {"layers": range(start, end), "embedding": stage == 0, "head": stage == pp - 1}


def cut_stage(model: K3ForCausalLM, pp: int, stage: int) -> K3ForCausalLM:
    """Keep stage `stage` of `pp` of a built model, in place (`stage_part`): its layers under their global names,
    the embedding (and the vision tower) only on the first stage, the output mix, final norm and LM head only on
    the last. A model built as that part already is left as it is. Cut an initialised model, or build the part on
    the meta device and materialise it: either way every stage holds exactly the single-process weights."""
    part = stage_part(model.cfg, pp, stage)
    core = model.model
    held = core.layers.indices()
    if not set(part["layers"]) <= set(held):
        raise ValueError(f"stage {stage} of pp={pp} holds layers [{part['layers'].start}, {part['layers'].stop}) "
                         f"but the model was built with {held[:1] + held[-1:]}")
    core.layers = LayerStack(core.layers[i] for i in part["layers"])
    if not part["embedding"]:
        core.embed_tokens = None
        if hasattr(model, "vision_tower"):  # the vision tower and projector live with the embedding
            model.vision_tower = model.mm_projector = None
    if not part["head"]:
        core.norm = None
        if model.cfg.attn_res:
            core.output_attn_res = None
        model.lm_head = None
    return model


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


def run_1f1b(link: "StageLink", num_micro: int, device, forward, backward, after_backward) -> None:
    """One training step's micro-batches through this stage in the 1F1B order (`schedule_1f1b`).

    forward(micro, x) -> y: x is the activation received from the previous stage (requiring grad; None on the
    first stage), y the loss on the last stage, else the packed activation sent on. backward(micro, y, g):
    back-propagate y, g being the gradient received for it (None on the last stage). The gradient of x then goes
    back to the previous stage, before after_backward(micro) (the caller's optimizer boundary, whose collectives
    the previous stage joins only after receiving it).

    In the steady state the messages with a neighbour go in pairs, each pair one batched exchange (Megatron's
    send_forward_recv_backward and send_backward_recv_forward): this stage's output forward with the gradient of
    its oldest micro-batch back from the next stage; its input gradient back with the next input from the previous
    stage. Under NCCL a send and a receive between two ranks run in order on one stream and a large send waits for
    its receive, so one at a time they would wait for each other (stage s sending F(i+1) while s+1 sends B(i))."""
    first, last = link.prev is None, link.next is None
    warmup = min(link.size - link.stage - 1, num_micro)
    held = []  # (micro, x, y) in order, the oldest first
    for micro in range(warmup):  # (a stage with warm-up forwards is not the last)
        x = None if first else link.recv_forward(device).requires_grad_()
        y = forward(micro, x)
        link.send_forward(y)
        held.append((micro, x, y))
    steady = num_micro - warmup
    x = None if first or steady == 0 else link.recv_forward(device).requires_grad_()
    for i in range(steady):
        y = forward(warmup + i, x)
        held.append((warmup + i, x, y))
        micro, x_old, y_old = held.pop(0)
        g = None if last else link.send_forward_recv_backward(y, y_old)
        backward(micro, y_old, g)
        x = None
        if not first and i < steady - 1:
            x = link.send_backward_recv_forward(_input_grad(x_old), device).requires_grad_()
        elif not first:
            link.send_backward(_input_grad(x_old))
        after_backward(micro)
    for micro, x_old, y_old in held:  # cool-down
        backward(micro, y_old, link.recv_backward(y_old))
        if not first:
            link.send_backward(_input_grad(x_old))
        after_backward(micro)
    link.wait()


def _input_grad(x: torch.Tensor) -> torch.Tensor:
    return x.grad if x.grad is not None else torch.zeros_like(x)


def pack(st: ResidualState) -> torch.Tensor:
    """A ResidualState as the one tensor that travels: [N, B, T, D] (N = blocks + partial, or 1 hidden)."""
    return torch.stack(st.blocks + [st.partial]) if st.hidden is None else st.hidden.unsqueeze(0)


def unpack(x_NBTD: torch.Tensor, attn_res: bool) -> ResidualState:
    if not attn_res:
        return ResidualState(hidden=x_NBTD[0])
    parts = list(x_NBTD.unbind(0))
    return ResidualState(blocks=parts[:-1], partial=parts[-1])


class StageLink:
    """Point-to-point with the neighbouring stages over the pipeline group, every message a dist.batch_isend_irecv
    (`_batch`). Single sends are asynchronous (kept until `wait`), single receives are waited for (on gloo by the
    host; on NCCL by the current stream), and the steady state's pairs (`send_forward_recv_backward`,
    `send_backward_recv_forward`) go as one batch each. The shape and dtype of the activations are exchanged once
    (the first message on a link, always a single send: a stage before the last has a warm-up forward); a gradient
    has the shape of what was sent. Every later activation and gradient must keep that shape and dtype (the receiver
    allocates by it; NCCL would not notice a mismatch): the sender checks its own tensor, on the host, and names
    the rank and both shapes."""

    def __init__(self, group):
        self.group = group
        ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank()
        self.stage, self.size = ranks.index(self.rank), len(ranks)
        self.prev = ranks[self.stage - 1] if self.stage > 0 else None
        self.next = ranks[self.stage + 1] if self.stage < self.size - 1 else None
        self._pending = []
        # gloo moves host tensors; NCCL device tensors
        self.wire = None if dist.get_backend(group) == "nccl" else torch.device("cpu")
        if self.wire is None:  # NCCL: a batched exchange may not be the group's first operation unless every rank
            dist.barrier(group=group)  # of it takes part (dist.batch_isend_irecv): this one is, on every rank
        self._meta_out = None  # (shape, dtype) of the activations sent on, from the first
        self._meta_in = None  # (shape, dtype) of the activations received, from the header

    def _batch(self, *ops) -> list:
        """(dist.isend | dist.irecv, tensor, peer) as one dist.batch_isend_irecv, even a single one: under NCCL a
        batch runs on the group's communicator and a lone isend/recv on a two-rank one of its own (another stream),
        so every message goes as a batch and all of a link's messages run in one order on one stream."""
        return dist.batch_isend_irecv([dist.P2POp(op, t, peer, self.group) for op, t, peer in ops])

    def _on_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.wire or t.device).contiguous()

    def _recv(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        return self._exchange(None, src, buf)

    def _isend(self, t: torch.Tensor, dst: int):
        t = self._on_wire(t)
        self._pending += [(work, t) for work in self._batch((dist.isend, t, dst))]

    def _keeps(self, t: torch.Tensor, meta, what: str) -> torch.Tensor:
        """`t` unless its shape or dtype differs from the link's header `meta` (host metadata: no device read)."""
        if (tuple(t.shape), t.dtype) != meta:
            why = ("every micro-batch must have train.micro_batch_size x train.seq_length tokens"
                   if tuple(t.shape) != meta[0] else "the stages' outputs must keep one dtype (precision, autocast)")
            raise RuntimeError(
                f"pipeline: rank {self.rank} (stage {self.stage}) sends {what} of shape {tuple(t.shape)} "
                f"{t.dtype}, but this link carries {meta[0]} {meta[1]} (the first activation's header): {why}")
        return t

    def send_forward(self, x: torch.Tensor):
        if self._meta_out is None:
            meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.wire or x.device)
            meta[0], meta[1] = _DTYPES.index(x.dtype), x.dim()
            meta[2:2 + x.dim()] = torch.tensor(x.shape)
            self._isend(meta, self.next)
            self._meta_out = (tuple(x.shape), x.dtype)
        self._isend(self._keeps(x, self._meta_out, "an activation"), self.next)

    def recv_forward(self, device) -> torch.Tensor:
        if self._meta_in is None:
            meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.wire or device)
            self._recv(meta, self.prev)
            ndim = int(meta[1])
            self._meta_in = (tuple(int(v) for v in meta[2:2 + ndim]), _DTYPES[int(meta[0])])
        return self._recv(self._input_buffer(device), self.prev).to(device)

    def send_backward(self, g: torch.Tensor):
        self._isend(self._keeps(g, self._meta_in, "an input gradient"), self.prev)

    def recv_backward(self, like: torch.Tensor) -> torch.Tensor:
        return self._recv(self._grad_buffer(like), self.next).to(like.device)

    def _input_buffer(self, device) -> torch.Tensor:
        """An activation to receive into, as the link's header describes it."""
        shape, dtype = self._meta_in
        return torch.empty(shape, dtype=dtype, device=self.wire or device)

    def _grad_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A gradient to receive into: the shape and dtype of the output `like` it belongs to."""
        return torch.empty(like.shape, dtype=like.dtype, device=self.wire or like.device)

    def _exchange(self, t: torch.Tensor | None, peer: int, buf: torch.Tensor) -> torch.Tensor:
        """Send `t` to `peer` (none: only receive) and receive `buf` from it, as one batch (neither waits for the
        other), and wait for it."""
        sends = [] if t is None else [(dist.isend, self._on_wire(t), peer)]
        for work in self._batch(*sends, (dist.irecv, buf, peer)):
            work.wait()
        return buf

    def send_forward_recv_backward(self, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Send this micro-batch's output on and receive the gradient of `like` (an earlier output) back."""
        if self._meta_out is None:
            raise RuntimeError("pipeline: the first activation on a link goes alone (its shape header first)")
        g = self._grad_buffer(like)
        return self._exchange(self._keeps(y, self._meta_out, "an activation"), self.next, g).to(like.device)

    def send_backward_recv_forward(self, g: torch.Tensor, device) -> torch.Tensor:
        """Send an input gradient back and receive the next micro-batch's input."""
        if self._meta_in is None:
            raise RuntimeError("pipeline: the first activation on a link comes alone (its shape header first)")
        x = self._input_buffer(device)
        return self._exchange(self._keeps(g, self._meta_in, "an input gradient"), self.prev, x).to(device)

    def wait(self):
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
