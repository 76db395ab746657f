"""Context parallelism: every sequence split over the ``cp`` ranks, with the exact state of KDA, the short
convolutions' halos and Gated MLA's causal attention carried across the split. `apply_context_parallel(model, cp)`
attaches it to a built model from outside: the model's inputs (and labels) are cut to this rank's tokens by a
forward pre-hook, its KDA and MLA layers get the context-parallel kernels below in place of their single-device
ones, and its loss becomes this rank's share of the whole sequence's mean.

Legend: B batch, T tokens of the whole sequence, t = T / cp tokens on this rank, c = T / (2 cp) tokens per chunk,
H heads, K key dim, V value dim, C channels, W conv width, L + R the MLA latent width.

**Token layout (zigzag, the same for the whole model).** The sequence is cut into 2·cp equal chunks; rank r holds
chunks r and 2cp-1-r, in that order ([B, t] = [chunk r ; chunk 2cp-1-r]). Everything per token (embedding,
norms, AttnRes, MoE, LM head, loss) runs on these tokens unchanged. The layout exists for causal attention: a
query of chunk i sees (i+1)·c keys, so rank r's two chunks see (r+1 + 2cp-r)·c = (2cp+1)·c keys whatever r is,
and every rank does the same attention work. A contiguous split would leave the last rank 2cp-1 times the first
rank's work. Packed rows (``cu_seqlens``) are split the same way: the row is one sequence whose documents may
start anywhere, including inside a chunk or exactly at a chunk boundary.

**KDA: per-chunk affine transitions composed by a scan, not a sequential hand-off.** Over a chunk the state
update is affine in the chunk's initial state: S_end = A S_start + B with A = prod_t (I - b_t k_t k_t^T)
diag(exp g_t) ([K, K] per head, from the chunk's keys, gates and betas alone) and B the end state from a zero
start; every output is affine too, o_t = o_t^0 + S_start^T q~_t with q~_t = A_{<=t}^T (scale q_t). One call of
the ordinary chunked kernel gives all four at once: values [v | 0] (width V + K) from the initial state [0 | I]
return [o^0 | q~] and the final state [B | A]. Each rank computes its two chunks' (A, B) in parallel, the
fragments are all-gathered over the CP group (2 cp x [H, K, K + V] per sequence, the size of two states each),
every rank composes S_in(i+1) = A_i S_in(i) + B_i in chunk order (2 cp small matmuls) and adds S_in^T q~ to its
outputs. Why this and not rank r waiting for r-1's end state: (1) the zigzag layout would need two sequential
passes around the ring (chunks 0..cp-1 up, then cp..2cp-1 down through the same ranks), which serialises all
KDA work; even with contiguous chunks the ranks between two MLA synchronisations (3 KDA layers) idle for
(cp-1)/(cp+2) of the time; (2) the cost of the scan is small: the state part of the chunk kernel runs at width
V + K instead of V, about +2% of a K3 KDA layer's FLOPs (its projections dominate), and one all-gather of
fixed-size fragments per layer; (3) the backward is plain autograd through the kernel, the all-gather
(reduce-scatter of the fragment gradients) and the composition, so gradients are exact with no hand-written
reverse hand-off. Documents: a chunk whose first token starts a document (or global chunk 0) gets the zero
transition (A = 0, q~ = 0), and a document starting inside a chunk starts a segment with a zero state; only the
chunk's first segment depends on S_in, and A is zero unless that segment reaches the chunk's end.

**Short convolution: halo exchange.** Each chunk needs the last W-1 conv inputs of the chunk before it, which
lives on another rank (chunk r-1 on rank r-1, chunk 2cp-r on rank r-1 too). The chunks' tails ([B, 2, W-1, C]
per rank, a few tokens) are all-gathered and each chunk reads its predecessor's; the gradient returns by the
all-gather's reduce-scatter. With documents, the conv runs on [halo ; chunk] as a packed row whose boundaries
are the global document starts, so a halo never reaches into another document.

**Gated MLA: gather the latent, not the keys and values.** Each rank all-gathers the normalised compressed latent
and the head-shared key part (L + R = 576 values per token in K3, vs H (N + R + V) = 30,720 for expanded keys
and values), expands keys and values locally and attends its two query chunks to the keys each can see, in query
blocks with an explicit causal/document mask. The latent's gradient is reduce-scattered back to its owner.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..model.k3 import K3ForCausalLM
from ..model.kda import KDAKernels, KimiDeltaAttention
from ..model.mla import AttentionKernels, GatedMLA, max_logit_per_head
from ..ops.attention import attention
from ..ops.short_conv import causal_conv1d
from . import mappings as M
from .mappings import Group
from .tensor import call_arguments

__all__ = ["SequenceShard", "kda_context_parallel", "conv_context_parallel", "attention_context_parallel",
           "apply_context_parallel", "ContextParallelKDA", "ContextParallelAttention"]

ATTN_QUERY_BLOCK = 2048  # queries per attention call: bounds the [block, keys] mask (and math-path probabilities)


def zigzag_chunks(rank: int, size: int) -> tuple:
    """The two global chunk indices rank `rank` of `size` holds, in its local order."""
    return rank, 2 * size - 1 - rank


class SequenceShard:
    """This rank's tokens of a sequence of T tokens (or a packed row with global ``cu_seqlens``) under zigzag
    context parallelism, and what the mixers need to reassemble it: gather order, chunk carries, document
    boundaries. Built once per forward by the model; host-side bookkeeping only."""

    def __init__(self, cp: Group, T: int, cu_seqlens: torch.Tensor | None = None, device=None):
        n = 2 * cp.size
        if T % n:
            raise ValueError(f"context parallelism over {cp.size} ranks splits the sequence into {n} chunks: "
                             f"{T} tokens are not divisible by {n}")
        self.cp, self.T, self.c = cp, T, T // n
        c = self.c
        self.chunks = zigzag_chunks(cp.rank, cp.size)
        self.index = torch.cat([torch.arange(i * c, (i + 1) * c) for i in self.chunks]).to(device)
        # the all-gather stacks every rank's two chunks rank by rank; slot_of[i] is global chunk i's slot
        gathered = [ch for r in range(cp.size) for ch in zigzag_chunks(r, cp.size)]
        slot_of = [gathered.index(i) for i in range(n)]
        self.chunk_order = torch.tensor(slot_of, device=device)
        self.token_order = torch.cat([torch.arange(s * c, (s + 1) * c) for s in slot_of]).to(device)
        self.starts = None  # global document starts (packed rows), sorted, without T
        if cu_seqlens is not None:
            cu = [int(x) for x in cu_seqlens.tolist()]
            if cu[0] != 0 or cu[-1] != T:
                raise ValueError(f"cu_seqlens must run from 0 to T={T}, got {cu[0]}..{cu[-1]}")
            self.starts = sorted(set(cu[:-1]))
            lengths = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
            self.doc_T = torch.repeat_interleave(torch.arange(len(cu) - 1), lengths).to(device)
        # a chunk continues the state of the chunk before it unless it is the first or starts a document
        self.carry = [i > 0 and (self.starts is None or i * c not in self.starts) for i in self.chunks]
        self.device = device
        self._ext_cu = {}

    # ---------------------------------------------------------------- token movement
    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a full-sequence tensor (ids, labels), in local order."""
        return x.index_select(dim, self.index.to(x.device))

    def gather(self, x_Bt: torch.Tensor) -> torch.Tensor:
        """[B, t, ...] local -> [B, T, ...] in global order, on every rank; the backward sums every rank's
        gradient of this rank's tokens (reduce-scatter)."""
        full = M.gather_seq(x_Bt, self.cp.group)
        return full.index_select(1, self.token_order.to(x_Bt.device))

    def gather_chunks(self, x_B2: torch.Tensor) -> torch.Tensor:
        """[B, 2, ...] one item per local chunk -> [B, 2cp, ...] in global chunk order (same backward)."""
        full = M.gather_seq(x_B2, self.cp.group)
        return full.index_select(1, self.chunk_order.to(x_B2.device))

    def segments(self, j: int) -> list:
        """Offsets inside local chunk j where a segment (a document piece) starts, 0 first."""
        if self.starts is None:
            return [0]
        lo = self.chunks[j] * self.c
        return [0] + [s - lo for s in self.starts if lo < s < lo + self.c]

    def local_cu(self, device=None) -> torch.Tensor:
        """cu_seqlens of the local packed row [chunk a ; chunk b]: document starts and the chunk boundary."""
        cu = [j * self.c + s for j in range(2) for s in self.segments(j)] + [2 * self.c]
        return torch.tensor(cu, dtype=torch.long, device=device)

    def extended_cu(self, h: int, device=None) -> torch.Tensor:
        """cu_seqlens of the packed row [halo a ; chunk a ; halo b ; chunk b] (halos of h tokens): every
        global document start that falls inside it, and the start of each halo."""
        if h not in self._ext_cu:
            cu, span = [], h + self.c
            for j, i in enumerate(self.chunks):
                lo = i * self.c - h  # global position of the halo's first token
                cu.append(j * span)
                cu += [j * span + s - lo for s in self.starts if lo < s < lo + span]
            self._ext_cu[h] = cu + [2 * span]
        return torch.tensor(self._ext_cu[h], dtype=torch.long, device=device)

    def positions(self, j: int, device=None) -> torch.Tensor:
        i = self.chunks[j]
        return torch.arange(i * self.c, (i + 1) * self.c, device=device)

    # ---------------------------------------------------------------- loss
    def global_mean(self, local_mean: torch.Tensor, local_count: torch.Tensor) -> torch.Tensor:
        """The mean over the whole sequence as the value on every rank, with this rank's share as the gradient:
        the share is local sum / global count, so the CP ranks' gradients add up to the gradient of the global
        mean (DeepSpeed sums gradients over dp x cp and divides by dp)."""
        count = local_count.detach().to(torch.float64).clone()
        dist.all_reduce(count, group=self.cp.group)
        share = local_mean * (local_count.to(local_mean.dtype) / count.clamp_min(1).to(local_mean.dtype))
        total = share.detach().clone()
        dist.all_reduce(total, group=self.cp.group)
        return share + (total - share.detach())


# ==================================================================== KDA: per-chunk transitions and a scan


def kda_context_parallel(kda_fn, q, k, v, g, beta, shard: SequenceShard, **kw):
    """Exact KDA over the whole sequence from this rank's two chunks (see the module docstring).

    q, k, g: [B, t, H, K]; v: [B, t, H, V]; beta: [B, t, H]; kda_fn: ``ops.kda.chunk_kda`` (or any kernel with its
    signature and per-sequence initial states). Returns o [B, t, H, V]."""
    B, t, H, K = q.shape
    V, c = v.shape[-1], shard.c
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    v_aug = torch.cat([v, v.new_zeros(B, t, H, K)], dim=-1)  # [v | 0]: the second block carries the identity
    eye = torch.eye(K, dtype=wide, device=q.device).expand(H, K, K)
    if shard.starts is None:  # each chunk is its own batch row: [2B, c, ...], chunk-major
        def rows(x):
            return x.reshape(B, 2, c, *x.shape[2:]).transpose(0, 1).reshape(2 * B, c, *x.shape[2:])

        init = torch.zeros(2, B, H, K, V + K, dtype=wide, device=q.device)
        for j in range(2):
            if shard.carry[j]:
                init[j, ..., V:] = eye
        o_aug, final = kda_fn(rows(q), rows(k), rows(v_aug), rows(g), rows(beta),
                              initial_state=init.reshape(2 * B, H, K, V + K), output_final_state=True, **kw)
        o_aug = o_aug.reshape(2, B, c, H, V + K).transpose(0, 1).reshape(B, t, H, V + K)
        frag = final.reshape(2, B, H, K, V + K).transpose(0, 1)  # [B, 2, H, K, V + K]
    else:  # one packed row: segments at document starts and at the chunk boundary
        cu = shard.local_cu(q.device)
        nseg = cu.numel() - 1
        first = [0, len(shard.segments(0))]  # segment index of each chunk's first segment
        init = torch.zeros(nseg, H, K, V + K, dtype=wide, device=q.device)
        for j in range(2):
            if shard.carry[j]:
                init[first[j], ..., V:] = eye
        o_aug, final = kda_fn(q, k, v_aug, g, beta, initial_state=init, output_final_state=True, cu_seqlens=cu,
                              **kw)
        last = [first[1] - 1, nseg - 1]  # the segment that ends each chunk
        frag = final[last].unsqueeze(0)  # [1, 2, H, K, V + K]
    # [B, 2cp, H, K, V + K]: every chunk's (B | A), in global order
    frags = shard.gather_chunks(frag.contiguous())
    S = torch.zeros(frags.shape[0], H, K, V, dtype=frags.dtype, device=q.device)
    S_in = {}
    for i in range(max(shard.chunks) + 1):  # S_in(i+1) = A_i S_in(i) + B_i
        S_in[i] = S
        S = frags[:, i, ..., V:] @ S + frags[:, i, ..., :V]
    o0, q_tilde = o_aug[..., :V], o_aug[..., V:]
    corr = torch.cat([torch.einsum("bthk,bhkv->bthv", q_tilde[:, j * c:(j + 1) * c].to(S.dtype), S_in[i])
                      for j, i in enumerate(shard.chunks)], dim=1)
    return (o0.to(corr.dtype) + corr).to(v.dtype)


# ==================================================================== short convolution: halo exchange


def conv_context_parallel(conv_fn, x_BtC: torch.Tensor, weight_CW: torch.Tensor, shard: SequenceShard,
                          activation: str | None = "silu") -> torch.Tensor:
    """``conv_fn`` (ops.short_conv.causal_conv1d) on this rank's two chunks, each continued by the last W-1 inputs
    of the chunk before it in the sequence (zeros before the start, masked across document boundaries)."""
    B, t, C = x_BtC.shape
    c, h = shard.c, weight_CW.shape[-1] - 1
    if h == 0:
        return conv_fn(x_BtC, weight_CW, activation=activation)[0]
    if c < h:
        raise ValueError(f"context-parallel chunks of {c} tokens are shorter than the conv halo of {h}")
    x4 = x_BtC.reshape(B, 2, c, C)
    tails = shard.gather_chunks(x4[:, :, c - h:].contiguous())  # [B, 2cp, h, C], global chunk order
    tails = torch.cat([tails.new_zeros(B, 1, h, C), tails], dim=1)  # slot i holds the tail of chunk i - 1
    halo = tails[:, list(shard.chunks)]  # [B, 2, h, C]
    if shard.starts is None:
        xc = x4.transpose(0, 1).reshape(2 * B, c, C)
        y, _ = conv_fn(xc, weight_CW, halo.transpose(0, 1).reshape(2 * B, h, C), activation=activation)
        return y.reshape(2, B, c, C).transpose(0, 1).reshape(B, t, C)
    ext = torch.cat([halo, x4], dim=2).reshape(1, 2 * (h + c), C)  # [halo a ; chunk a ; halo b ; chunk b]
    y, _ = conv_fn(ext, weight_CW, cu_seqlens=shard.extended_cu(h, x_BtC.device), activation=activation)
    return y.reshape(2, h + c, C)[:, h:].reshape(1, t, C)


# ==================================================================== MLA: attention over the gathered sequence


def attention_context_parallel(q_BHtK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor,
                               shard: SequenceShard, scale: float, block: int = ATTN_QUERY_BLOCK) -> torch.Tensor:
    """Causal (and document-local) attention of this rank's queries [B, H, t, K] over the whole sequence's keys
    and values [B, H, T, .]: each query block attends only to the keys up to its last position."""
    outs = []
    dev = q_BHtK.device
    for j in range(2):
        pos_c = shard.positions(j, dev)
        for a in range(0, shard.c, block):
            qpos = pos_c[a:a + block]
            S = shard.chunks[j] * shard.c + min(a + block, shard.c)  # = qpos[-1] + 1, known on the host
            kpos = torch.arange(S, device=dev)
            mask = kpos[None, :] <= qpos[:, None]
            if shard.starts is not None:
                doc = shard.doc_T.to(dev)
                mask = mask & (doc[:S][None, :] == doc[qpos][:, None])
            qb = q_BHtK[:, :, j * shard.c + a: j * shard.c + a + qpos.numel()]
            outs.append(attention(qb, k_BHTK[:, :, :S], v_BHTV[:, :, :S], attn_mask=mask, scale=scale))
    return torch.cat(outs, dim=2)


def local_key_mask(shard: SequenceShard, device=None) -> torch.Tensor:
    """[t, T] bool: which keys each of this rank's queries may see (for QK-Clip's max-logit statistics)."""
    qpos = shard.index.to(device)
    mask = torch.arange(shard.T, device=device)[None, :] <= qpos[:, None]
    if shard.starts is not None:
        doc = shard.doc_T.to(device)
        mask = mask & (doc[None, :] == doc[qpos][:, None])
    return mask


# ==================================================================== the plan


class SequenceContext:
    """The current forward's SequenceShard, shared by one model's context-parallel kernels and loss."""

    def __init__(self, cp: Group):
        self.cp, self.shard = cp, None


def _no_seq_idx(seq_idx):
    """The model passes no documents to the CP kernels (cu_seqlens None, hence seq_idx None): the shard holds them."""
    if seq_idx is not None:
        raise ValueError("context-parallel kernels take the documents from the sequence shard, not seq_idx")


class ContextParallelKDA(KDAKernels):
    """KDA's sequence-mixing steps on this rank's two chunks: conv halos and the scan of chunk transitions."""

    def __init__(self, seq: SequenceContext):
        self.seq = seq

    def conv(self, x_BTC, weight_CW, cache, cu_seqlens, keep, seq_idx=None):
        _no_seq_idx(seq_idx)
        if keep:
            raise ValueError("context parallelism is for training and prefill without a decode cache")
        return conv_context_parallel(causal_conv1d, x_BTC, weight_CW, self.seq.shard, activation="silu"), None

    def delta_rule(self, q, k, v, g, beta, initial_state, keep, cu_seqlens, chunk_size, lower_bound, seq_idx=None):
        _no_seq_idx(seq_idx)
        o = kda_context_parallel(self.chunk_fn, q, k, v, g, beta, self.seq.shard, chunk_size=chunk_size,
                                 lower_bound=lower_bound)
        return o, None


class ContextParallelAttention(AttentionKernels):
    """Gated MLA's sequence-wide steps on this rank's queries: the latent of every position is all-gathered (not the
    expanded keys and values), the local queries attend to the keys their positions allow."""

    def __init__(self, seq: SequenceContext):
        self.seq = seq

    def key_positions(self, c_BTL, k_r_BTR):
        L = c_BTL.shape[-1]
        return self.seq.shard.gather(torch.cat([c_BTL, k_r_BTR], dim=-1)).split([L, k_r_BTR.shape[-1]], dim=-1)

    def attend(self, q_BHTK, k_BHSK, v_BHSV, cu_seqlens, scale, seq_idx=None):
        _no_seq_idx(seq_idx)
        return attention_context_parallel(q_BHTK, k_BHSK, v_BHSV, self.seq.shard, scale)

    def max_logit(self, q_BHTK, k_BHSK, cu_seqlens, scale, seq_idx=None):
        _no_seq_idx(seq_idx)
        shard = self.seq.shard
        m = max_logit_per_head(q_BHTK.detach(), k_BHSK.detach(), scale, local_key_mask(shard, q_BHTK.device))
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=shard.cp.group)
        return m


class ContextParallelLoss(nn.Module):
    """The loss of this rank's tokens as the whole sequence's mean (value) and this rank's share of it (gradient)."""

    def __init__(self, inner: nn.Module, seq: SequenceContext):
        super().__init__()
        self.inner, self.seq = inner, seq
        self.ignore_index = inner.ignore_index

    def forward(self, logits_NV, labels_N):
        count = (labels_N != self.ignore_index).sum()
        # a rank whose share of the sequence has no label to learn (a chat's long prompt) contributes nothing: its
        # mean over no tokens is 0/0, whose NaN would reach every rank through the sum
        loss = self.inner(logits_NV, labels_N)
        loss = torch.where(count > 0, loss, torch.zeros_like(loss))
        return self.seq.shard.global_mean(loss, count)


def apply_context_parallel(model: K3ForCausalLM, cp: Group) -> K3ForCausalLM:
    """Split every sequence of `model`'s inputs over the CP group (zigzag), in place; returns the model. Callers keep
    passing the whole sequence (and its global cu_seqlens) on every CP rank; the logits returned are those of this
    rank's tokens, in its local order."""
    if cp.size == 1:
        return model
    seq = SequenceContext(cp)
    for mod in model.modules():
        if isinstance(mod, KimiDeltaAttention):
            mod.kernels = ContextParallelKDA(seq)
        elif isinstance(mod, GatedMLA):
            mod.kernels = ContextParallelAttention(seq)
    model.loss_fn = ContextParallelLoss(model.loss_fn, seq)

    def shard_inputs(module, args, kwargs):
        call = call_arguments(module, args, kwargs)
        a = call.arguments
        if a["cache"] is not None:
            raise ValueError("context parallelism is for training and prefill; decode with parallel.cp=1")
        if a.get("pixel_values") is not None:
            raise ValueError("context parallelism does not take media (pixel_values); use parallel.cp=1 with a "
                             "vision-language model")
        ids = a["input_ids"]
        seq.shard = SequenceShard(cp, ids.shape[1], a["cu_seqlens"], ids.device)
        a["input_ids"], a["cu_seqlens"] = seq.shard.take(ids), None
        if a["labels"] is not None:
            a["labels"] = seq.shard.take(a["labels"])
        return call.args[1:], call.kwargs

    model.register_forward_pre_hook(shard_inputs, with_kwargs=True)
    return model
