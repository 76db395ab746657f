"""Memory per device: model states (weights, gradients, ZeRO-sharded optimizer states for AdamW or Muon),
activations of the micro-batches in flight (with or without recomputation), and for inference the MXFP4
experts, bf16 rest, KDA recurrent states and the MLA latent cache.

peft=lora (`Workload.peft`): only the adapters have gradients, fp32 masters and optimizer states; the frozen base
is its weights alone, bf16 (the weights' dtype) and the routed experts as MXFP4 codes (MXFP4_BYTES_PER_PARAM); one
block of `expert_block` experts decoded (and w1;w3 concatenated) is transient inside the expert GEMMs; with
peft.trainable_tokens the embedding's and the LM head's vocabulary block, copied with the trained rows in.

Precision recipes (bytes per parameter):

* fp32: weights 4, gradients 4; under ZeRO-1/2 DeepSpeed also keeps an fp32 copy of each partition (4,
  sharded), under ZeRO-0 none.
* bf16, mx_qat, te_fp8, te_mxfp8 (mixed precision, as Megatron/DeepSpeed run it): bf16 weights 2,
  gradients accumulated in fp32 4 (precision.grad_accum_dtype=bf16: 2), fp32 master weights 4 held by the optimizer.
* AdamW keeps two fp32 moments (8); Muon one fp32 momentum (4) for matrices and AdamW's two for the rest.
* ZeRO-1 shards master weights and optimizer states over the data-parallel group (DP x CP: the dense parameters,
  and the routed experts at ep = 1); ZeRO-2 shards their gradients too; ZeRO-0 shards nothing. Under ep > 1 the
  routed experts are stepped outside DeepSpeed (training.expert_optimizer): their masters and optimizer states
  sharded over expert-DP in blocks of whole experts, their gradients accumulated like the dense ones (fp32 4, or
  2 under precision.grad_accum_dtype=bf16) until the step reduces them to fp32 blocks (in the step's phase).
* DeepSpeed's ZeRO-1/2 gradient reduction (`zero_gradient_buffers`) also holds its bucket (layout.zero_bucket_elements
  in the gradients' dtype, two under overlap_comm) and under ZeRO-2 remakes its partition buffer at every backward.

MoE dispatch (`Workload.moe_overflow`): auto, drop and dropless share one model (an all-to-all send and receive
buffer of the rank's top-k rows per layer). `balanced` (megatron_k3.parallel.balanced, `BalancedMoE` below) adds
the replica weights each MoE layer receives, kept for its backward (S x P per layer and micro-batch in flight; one
layer's worth, transient, under full recomputation), the weight-exchange buffers and the two-hop token buffers,
and below S = E/ep the rows the worst-case compute buffer pads beyond M.

Vision tower and projector (model.vision.enabled; `StageMemory.vision`): on the first pipeline stage, whole on
every TP rank; weights, gradients and (ZeRO-sharded over data parallelism like the other dense parameters) master
weights and optimizer states as any dense parameter, by the optimizer's rule (Muon for its matrices, AdamW for the
patch embedding, the position table and the vectors); with model.freeze_vision the weights only. Activations per
micro-batch from `Workload.image_share`: image features = that share of the micro-batch's tokens, 4 patches each
(2 x 2 merge, images: one frame), images of the position table's grid (flops.vision_image_patches). Under tensor
parallelism each TP rank encodes its own share of the media and keeps the activations of that share only; the
device counted is the busiest rank's (flops.vision_tp_share: 1/tp when the images divide evenly over the ranks,
all of them with one image per micro-batch). Frozen, the tower keeps nothing for a backward (one block's forward
working set is transient).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass, field

from ..config.schema import kda_tile, recomputed_kinds
from ..layout import ZERO0_ALLREDUCE_BUCKET, replica_slots, zero_bucket_elements
from ..ops.mx import ROUND_TRIP_BYTES_PER_ELEMENT, ROUND_TRIP_CHUNK
from ..ops.numerics import SQ_NORM_CHUNK
from ..parallel.balanced import compute_capacity, relay_block
from .activations import attn_res_sources, cp_key_span, head_terms, kept, layer_terms, term_bytes, vision_terms
from .candidates import Layout, stage_layers
from .flops import DEFAULT_IMAGE_SHARE, vision_image_patches, vision_tp_share
from .params import model_params

__all__ = ["Workload", "StageMemory", "training_memory", "InferenceMemory", "inference_memory", "tile_shares",
           "kda_tile_share",
           "MXFP4_BYTES_PER_PARAM", "BalancedMoE", "balanced_moe", "balanced_slots", "vision_activations",
           "frozen_expert_decode_bytes", "token_rows_copy_bytes", "replica_bytes_per_param"]

GB = 1e9
MXFP4_BYTES_PER_PARAM = 4.25 / 8  # E2M1 codes (4 bits) + one E8M0 scale per 32 values
MIXED = ("bf16", "mx_qat", "te_fp8", "te_mxfp8")


@dataclass(frozen=True)
class Workload:
    """What one training step computes, and with which numerics and kernels."""
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    precision: str = "bf16"  # fp32, bf16, mx_qat, te_fp8, te_mxfp8
    optimizer: str = "adamw"  # adamw or muon
    zero_stage: int = 1
    grad_dtype: str = "fp32"  # precision.grad_accum_dtype: gradient accumulation under mixed precision, fp32 or bf16
    kernels: str = "fused"  # eager (the torch paths) or fused (flash attention, fla KDA, fused norms)
    moe_overflow: str = "auto"  # model.moe_overflow: auto, drop, dropless (one model: M rows each way) or balanced
    redundant_experts: int = -1  # moe.redundant_experts (balanced): replica slots per EP rank; -1: E/ep of the layout
    replica_exchange: str = "micro_batch"  # moe.replica_exchange (balanced): owners' experts out per micro-batch|step
    image_share: float = DEFAULT_IMAGE_SHARE  # model.vision: share of the tokens that are image features
    overlap_grad_reduce: bool = False  # parallel.overlap_grad_reduce: the DP gradient reduction hides behind the last
    # backward (ZeRO-1/2 only); without it the reduction is exposed
    peft: tuple = ()  # peft=lora: params.peft_spec (rank, alpha, targets, init, expert_block, tokens); () = all train
    reduced: bool = True  # the step reduces the gradients (False: planning.dry_run's step, which takes none)
    reduce_bucket: int = 0  # parallel.deepspeed.zero_optimization.reduce_bucket_size; 0: the engine's own
    # (layout.zero_bucket_elements of the stage's parameters)
    per_head: bool = True  # optim.per_head (optim=muon): each attention head's block orthogonalised on its own; off,
    # the head projections are whole matrices (Newton-Schulz of the whole, all-gathered over TP, another ZeRO group)

    @property
    def weight_bytes(self) -> int:
        return 2 if self.precision in MIXED else 4

    @property
    def grad_bytes(self) -> int:
        return 4 if self.precision not in MIXED or self.grad_dtype == "fp32" else 2

    @property
    def act_bytes(self) -> int:
        return 2 if self.precision in MIXED else 4

    @property
    def master_bytes(self) -> int:
        return 4 if self.precision in MIXED or self.zero_stage >= 1 else 0


def replica_bytes_per_param(cfg, w: Workload, grads: bool = False) -> float:
    """Bytes per expert parameter balanced dispatch sends and holds for a replica: the weights' dtype; under peft=lora
    the MXFP4 codes and scales plus the experts' adapters in the weights' dtype (`grads`: what goes back, the
    adapters' gradients only)."""
    if not w.peft:
        return w.weight_bytes
    rank, targets = w.peft[0], w.peft[2]
    W, I = cfg.expert_width, cfg.moe_intermediate_size
    adapters = 3 * rank * (W + I) / (3 * W * I) * w.weight_bytes if "experts" in targets else 0.0
    return adapters if grads else MXFP4_BYTES_PER_PARAM + adapters


def balanced_slots(cfg, ep: int, w: Workload) -> int | None:
    """S, the replica slots per EP rank balanced dispatch runs with on a layout of `ep` (layout.replica_slots, as
    the run resolves them), or None."""
    return replica_slots(cfg, ep, w.redundant_experts, w.moe_overflow)


@dataclass(frozen=True)
class BalancedMoE:
    """One MoE layer's balanced dispatch on one device, per micro-batch (megatron_k3.parallel.balanced, whose
    legend this is): R EP ranks, E experts, El = E/R owned, S replica slots, N tokens this rank routes (1/tp of the
    micro-batch's), k experts per token, M = N k pairs, L expert width, P parameters of
    one expert (w1, w3, w2: 3 x moe_intermediate_size x L; exchanged as R slices, so padded to Pp, a multiple
    of R). Byte counts are what one device sends or holds; `frac` = (R-1)/R is the share bound for other ranks."""
    R: int
    E: int
    S: int
    N: int
    k: int
    L: int
    P: int

    @property
    def El(self) -> int:
        return self.E // self.R

    @property
    def M(self) -> int:
        return self.N * self.k

    @property
    def Mp(self) -> int:  # the sorted pairs, padded to a multiple of R and dealt round-robin to the relays
        return -(-self.M // self.R) * self.R

    @property
    def Pp(self) -> int:
        return -(-self.P // self.R) * self.R

    @property
    def exact(self) -> bool:  # S >= El: every rank computes exactly M pairs, whatever the routing
        return self.S >= self.El

    @property
    def cap(self) -> int:  # rows of the compute buffer: M, or below E/ep slots the worst case R N min(El, k)
        return compute_capacity(self.N, self.k, self.R, self.El, self.S)

    @property
    def block(self) -> int:  # rows per (relay, destination) block of the second token hop
        return relay_block(self.cap, self.R)

    @property
    def frac(self) -> float:
        return (self.R - 1) / self.R

    def owner_exchange_bytes(self, weight_bytes: int) -> float:
        """The first weight exchange (the own El experts' slices to the relays): the trainer runs it once per step
        (BalancedDispatch.cache_weights) and returns its gradient once, at the step's boundary (`flush`)."""
        return self.El * self.Pp * self.frac * weight_bytes

    def host_exchange_bytes(self, weight_bytes: int) -> float:
        """The second (S replicas from the relays to their hosts), per forward; the backward returns the replicas'
        gradients (in the weights' dtype) the same way, same bytes."""
        return self.S * self.Pp * self.frac * weight_bytes

    def weight_exchange_bytes(self, weight_bytes: int) -> float:
        """Both exchanges of one forward (El + S experts' worth): a step with one micro-batch."""
        return self.owner_exchange_bytes(weight_bytes) + self.host_exchange_bytes(weight_bytes)

    def token_bytes(self, act_bytes: int) -> float:
        """Sent per pass (forward or backward): dispatch and combine, each two hops (Mp rows to the relays, then
        R blocks of `block` rows to the destinations) of L values."""
        return 2 * (self.Mp + self.R * self.block) * self.frac * self.L * act_bytes

    def metadata_bytes(self) -> float:
        """Sent per forward: the counts all-gather ([E] int64 from every rank) and the int64 destination codes of
        both dispatch hops."""
        return (self.R - 1) * self.E * 8 + (self.Mp + self.R * self.block) * self.frac * 8

    def replica_bytes(self, weight_bytes: int) -> float:
        """The S received replicas ([S, Pp] in the weights' dtype), kept for the layer's backward."""
        return self.S * self.Pp * weight_bytes

    def step_store_bytes(self) -> float:
        """moe.replica_exchange=step: the relay's fp32 store (slices of E experts, El x Pp values) and its fp32
        gradient, kept for the whole step per MoE layer."""
        return 2 * self.El * self.Pp * 4

    def exchange_buffer_bytes(self, weight_bytes: int) -> float:
        """Weight-exchange buffers of one layer beside its kept replicas: the relay store (El x Pp), which the
        forward holds until the layer returns, and one replica-sized buffer more (S x Pp: the outgoing rows while the
        replicas are received; in the backward the replicas' gradient on its way back, then the store's, two at a
        time). Not the send buffer, the rows and the backward's gradients all at once, 2 (El + S) x Pp: at K3's width
        that overcounted the measured peak by 1.9 GB (docs/scale.md)."""
        return (self.El + self.S) * self.Pp * weight_bytes

    def token_buffer_bytes(self, act_bytes: int) -> float:
        """Token buffers of one layer's dispatch, alive until it returns: both hops' send and receive rows (Mp at
        the source and the relay, R x block at the relay and the destination) with their int64 codes."""
        return 2 * (self.Mp + self.R * self.block) * (self.L * act_bytes + 8)

    def drop_rows(self, capacity_factor: float) -> int:
        """For comparison: the rows the drop dispatcher computes per rank (E x its capacity, padding included)."""
        return self.E * max(1, math.ceil(capacity_factor * self.M / self.E))


def balanced_moe(cfg, lay: Layout, w: Workload) -> BalancedMoE | None:
    """The balanced dispatch of a layout's MoE layers (None when it does not run: another policy, ep = 1)."""
    S = balanced_slots(cfg, lay.ep, w)
    if S is None:
        return None
    # every TP rank routes its own 1/tp of the tokens, with or without sequence parallelism (parallel.experts)
    n_rank = w.micro_batch_size * w.seq_length / lay.cp / lay.tp
    W = cfg.expert_width
    return BalancedMoE(lay.ep, cfg.num_experts, S, math.ceil(n_rank), cfg.top_k, W, 3 * cfg.moe_intermediate_size * W)


def _expert_row_bytes(cfg, lay: Layout, w: Workload, i: int, sources) -> float:
    """Bytes the routed experts keep per computed row of MoE layer i (their per-token terms over top_k) under the
    layout's recomputation."""
    nbytes = {"a": w.act_bytes, "f": 4, "i": 8}
    return sum(t.per_token / cfg.top_k * nbytes[t.dtype]
               for t in layer_terms(cfg, i, lay.tp, w.kernels, sources[i], lay.cp)
               if t.name.startswith("expert_") and kept(t, lay.recomputed))


@dataclass
class StageMemory:
    """Bytes per device on one pipeline stage, by kind, with the activation detail beside it."""
    stage: int
    layers: tuple  # [start, end)
    params_dense: int  # parameters on this device (per TP rank)
    params_experts: int  # routed-expert parameters on this device (per EP rank)
    in_flight: int  # micro-batches whose activations are held at once (1F1B)
    weights: float
    gradients: float
    optimizer: float  # master weights + optimizer states (after ZeRO sharding)
    activations: float  # all micro-batches in flight
    transient: float  # loss gradient, all-to-all buffers, recompute workspace, Newton-Schulz workspace
    reserved: float
    activation_detail: dict = field(default_factory=dict)  # category -> bytes (all micro-batches in flight)
    moe_replicas: float = 0.0  # balanced dispatch: replica weights kept (in activations, or transient under full)
    moe_exchange: float = 0.0  # balanced dispatch: weight-exchange + token-hop buffers of one layer (in transient)
    vision: dict = field(default_factory=dict)  # first stage, model.vision: params and bytes by kind (in the above)
    host: float = 0.0  # activation offload: layer inputs in host memory (not in `total`), per device
    params_frozen: int = 0  # peft=lora: the frozen base's elements on this device (not in params_dense/experts)
    optimizer_experts: float = 0.0  # the routed experts' masters and optimizer states (in `optimizer`): under ep > 1
    # training.expert_optimizer's, of this rank's block of whole experts

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.transient
                + self.reserved)

    def breakdown_gb(self) -> dict:
        return {"weights": self.weights / GB, "gradients": self.gradients / GB, "optimizer": self.optimizer / GB,
                "activations": self.activations / GB, "transient": self.transient / GB,
                "reserved": self.reserved / GB}


def _opt_state_bytes(group, optimizer: str) -> float:
    """fp32 optimizer states of a ParamGroup: Muon's single momentum for matrices, AdamW's two moments else."""
    if optimizer == "muon":
        return group.muon * 4 + (group.total - group.muon) * 8
    return group.total * 8


@functools.lru_cache(maxsize=1 << 14)
def _layer_coefficients(cfg, i: int, tp: int, kernels: str, source: tuple, recomputed: frozenset, cp: int = 1,
                        rebuilt: bool = False) -> dict:
    """Layer i's terms kept for the backward when the module kinds `recomputed` are recomputed (`rebuilt`: instead
    the terms their regions make again in the backward), summed per (category, token class, dtype class): elements
    per token (memoised; `source`: the layer's AttnRes sources, attn_res_sources(cfg)[0][i]). Read-only: shared
    between calls."""
    out = {}
    for t in layer_terms(cfg, i, tp, kernels, source, cp):
        if (t.cheap in recomputed) if rebuilt else kept(t, recomputed):
            k = (t.category, t.tokens, t.dtype)
            out[k] = out.get(k, 0.0) + t.per_token
    return out


def tile_shares(lay: Layout, w: Workload) -> tuple:
    """(share of a MoE layer's rows, share of the LM head's tokens) one tile of train.tile_tokens holds on a device
    (1.0: untiled). The MoE block gets the sequence-parallel shard (n / tp under SP), the head the whole n."""
    if not lay.tile_tokens:
        return 1.0, 1.0
    n = w.micro_batch_size * w.seq_length / lay.cp
    return min(1.0, lay.tile_tokens / (n / lay.tp if lay.sp else n)), min(1.0, lay.tile_tokens / n)


def _tiled_bytes(cfg, lay: Layout, w: Workload, i: int, source, recomputed: frozenset) -> float:
    """Bytes of layer i's MoE block (routed branch and shared experts) beyond its input, which a tiled layer makes per
    tile inside a checkpoint instead of keeping."""
    n = w.micro_batch_size * w.seq_length / lay.cp
    return _moe_block_bytes(cfg, i, lay.tp, lay.sp, lay.cp, w.kernels, w.act_bytes, n, source, recomputed)


@functools.lru_cache(maxsize=1 << 14)
def _moe_block_bytes(cfg, i: int, tp: int, sp: bool, cp: int, kernels: str, act_bytes: int, n: float, source,
                     recomputed: frozenset) -> float:
    """_tiled_bytes on the values it reads (memoised: a search asks per layer, stage and layout)."""
    if cfg.ffn_types()[i] != "moe":
        return 0.0
    return sum(term_bytes(t, n, tp, sp, act_bytes, n, cp) for t in layer_terms(cfg, i, tp, kernels, source, cp)
               if t.category == "moe" and t.name != "moe_input" and kept(t, recomputed))


# the eager chunk kernel's terms: under train.tile_tokens each KDA tile makes them inside a checkpoint (parallel.tiling)
_KDA_CHUNK_TERMS = frozenset({"kda_chunk_vectors", "kda_chunk_matrices", "kda_states", "kda_cp_transition",
                              "kda_cp_states"})


def kda_tile_share(cfg, lay: Layout, w: Workload) -> float:
    """The share of a KDA layer's chunk terms one sequence tile holds (1.0: untiled, or fla's fused kernel, which
    tiling leaves alone: it keeps no chunk terms at once). A tile cuts every row the kernel runs on: a micro-batch
    row, or under CP each of the rank's two chunks (rows without documents; a packed row is one row of twice that,
    which this overcounts)."""
    if not lay.tile_tokens or w.kernels != "eager":
        return 1.0
    row = w.seq_length / lay.cp / (2 if lay.cp > 1 else 1)
    return min(1.0, kda_tile(lay.tile_tokens, cfg.kda_chunk_size) / row)


def _kda_tiled_bytes(cfg, lay: Layout, w: Workload, i: int, source, recomputed: frozenset,
                     rebuilt: bool = False) -> tuple:
    """(bytes of layer i's KDA chunk-kernel terms kept when the module kinds `recomputed` are recomputed (`rebuilt`:
    those their regions make again instead), bytes its tiles keep instead: their inputs q, k, v ([v | 0] under CP)
    in the activation dtype and g in fp32, and the state each tile hands on)."""
    if cfg.layer_types()[i] != "kda":
        return 0.0, 0.0
    n = w.micro_batch_size * w.seq_length / lay.cp
    chunk = _kda_chunk_bytes(cfg, i, lay.tp, lay.sp, lay.cp, w.kernels, w.act_bytes, n, source, recomputed, rebuilt)
    if not chunk:
        return 0.0, 0.0
    HK, K, wide = cfg.kda_num_heads / lay.tp * cfg.kda_head_dim, cfg.kda_head_dim, 2 if lay.cp > 1 else 1
    states = HK * K * wide * 4 / kda_tile(lay.tile_tokens, cfg.kda_chunk_size)  # per token: one per tile and row
    return chunk, n * (HK * (2 + wide) * w.act_bytes + HK * 4 + states)


@functools.lru_cache(maxsize=1 << 14)
def _kda_chunk_bytes(cfg, i: int, tp: int, sp: bool, cp: int, kernels: str, act_bytes: int, n: float, source,
                     recomputed: frozenset, rebuilt: bool) -> float:
    """The chunk-kernel part of _kda_tiled_bytes on the values it reads (memoised, as _moe_block_bytes)."""
    return sum(term_bytes(t, n, tp, sp, act_bytes, n, cp) for t in layer_terms(cfg, i, tp, kernels, source, cp)
               if t.name in _KDA_CHUNK_TERMS and ((t.cheap in recomputed) if rebuilt else kept(t, recomputed)))


def _head_tiled_bytes(cfg, lay: Layout, w: Workload, out_src: int) -> float:
    """Bytes of the LM head and loss beyond the head's input (logits, log-probabilities), made per tile if tiled."""
    n = w.micro_batch_size * w.seq_length / lay.cp
    terms, _ = head_terms(cfg, lay.tp, w.kernels, out_src)
    return sum(term_bytes(t, n, lay.tp, lay.sp, w.act_bytes, n) for t in terms
               if t.category == "head" and t.name != "lm_head_input")


@functools.lru_cache(maxsize=64)
def _sources(cfg) -> tuple:
    """attn_res_sources(cfg), read-only, per config value."""
    per_layer, out = attn_res_sources(cfg)
    return tuple(per_layer), out


_MICRO_MEMO: dict = {}  # _micro_activation's results by the values they depend on; cleared when it grows large


def _micro_activation(cfg, lay: Layout, w: Workload, start: int, end: int, last: bool, recomputed: frozenset,
                      rebuilt: bool = False, moe_scale: float = 1.0, head_scale: float = 1.0,
                      kda_scale: float = 1.0) -> tuple:
    """(bytes kept, bytes by category, largest single layer's bytes) for one micro-batch on layers
    [start, end) when the module kinds `recomputed` are recomputed (`rebuilt`: the bytes their regions make again
    instead); `last` adds the output mix, final norm, LM head and loss. `moe_scale` / `head_scale` / `kda_scale`: the
    share of the MoE blocks' and the head's bytes beyond their inputs, and of KDA's chunk terms, that count (sequence
    tiling: 0 kept, a tile's share live; KDA's tiles keep their inputs instead). Memoised on the layout's and
    workload's fields it reads (a search asks again for every pipeline, expert and data-parallel size)."""
    key = (cfg, lay.tp, lay.sp, lay.cp, lay.tile_tokens, w.kernels, w.act_bytes, w.micro_batch_size, w.seq_length,
           start, end, last, recomputed, rebuilt, moe_scale, head_scale, kda_scale)
    hit = _MICRO_MEMO.get(key)
    if hit is None:
        if len(_MICRO_MEMO) > 1 << 17:
            _MICRO_MEMO.clear()
        hit = _MICRO_MEMO[key] = _micro_activation_of(cfg, lay, w, start, end, last, recomputed, rebuilt, moe_scale,
                                                      head_scale, kda_scale)
    total, by_cat, largest = hit
    return total, dict(by_cat), largest


def _micro_activation_of(cfg, lay: Layout, w: Workload, start: int, end: int, last: bool, recomputed: frozenset,
                         rebuilt: bool, moe_scale: float, head_scale: float, kda_scale: float) -> tuple:
    sources, out_src = _sources(cfg)
    n = w.micro_batch_size * w.seq_length / lay.cp
    row = n if w.kernels == "eager" else w.seq_length  # eager attention spans the packed micro-batch row
    tokens = {"seq": n / lay.tp if lay.sp else n, "full": n, "row": n * row, "gathered": n * lay.cp,
              "span": n * cp_key_span(n * lay.cp, lay.cp)}
    nbytes = {"a": w.act_bytes, "f": 4, "i": 8}
    by_cat, total, largest = {}, 0.0, 0.0
    for i in range(start, end):
        layer_total = 0.0
        for (cat, tok, dt), per_token in _layer_coefficients(cfg, i, lay.tp, w.kernels, sources[i],
                                                             recomputed, lay.cp, rebuilt).items():
            b = per_token * tokens[tok] * nbytes[dt]
            by_cat[cat] = by_cat.get(cat, 0.0) + b
            layer_total += b
        if moe_scale != 1.0 and not rebuilt:
            cut = (1.0 - moe_scale) * _tiled_bytes(cfg, lay, w, i, sources[i], recomputed)
            by_cat["moe"] = by_cat.get("moe", 0.0) - cut
            layer_total -= cut
        if kda_scale != 1.0:
            chunk, inputs = _kda_tiled_bytes(cfg, lay, w, i, sources[i], recomputed, rebuilt)
            change = inputs - (1.0 - kda_scale) * chunk
            by_cat["kda"] = by_cat.get("kda", 0.0) + change
            layer_total += change
        total += layer_total
        largest = max(largest, layer_total)
    if last:
        terms, _ = head_terms(cfg, lay.tp, w.kernels, out_src)
        for t in terms:
            if not ((t.cheap in recomputed) if rebuilt else kept(t, recomputed)):
                continue
            b = term_bytes(t, n, lay.tp, lay.sp, w.act_bytes, row)
            if t.category == "head" and t.name != "lm_head_input":
                b *= head_scale
            by_cat[t.category] = by_cat.get(t.category, 0.0) + b
            total += b
    return total, by_cat, largest


def _layer_input_bytes(cfg, lay: Layout, w: Workload) -> float:
    """Bytes of one layer input per micro-batch: a running partial sum, the residual stream or a completed AttnRes
    block."""
    n = w.micro_batch_size * w.seq_length / lay.cp
    tokens = n / lay.tp if lay.sp else n
    return cfg.hidden_size * w.act_bytes * tokens


def _full_recompute_checkpoints(cfg, lay: Layout, w: Workload, start: int, end: int) -> float:
    """Per micro-batch under full recomputation: each layer keeps its input (the running partial sum, or the
    residual stream), and the completed AttnRes blocks the stage reads are kept once."""
    blocks = -(-end // cfg.attn_res_block_size) + 1 if cfg.attn_res else 0  # embedding + the blocks up to `end`
    return _layer_input_bytes(cfg, lay, w) * (end - start + blocks)


def _offload_reload_bytes(cfg, lay: Layout, w: Workload, start: int, end: int, host: float) -> float:
    """What activation offload has loaded back onto the device at once in a micro-batch's backward (parallel.offload),
    at most, over the offloaded layers start..end-1: when layer k's inputs are first read, the completed blocks it
    reads (b_0 and one per block before k's; each stays until its last reader, and a block-start layer's partial sum
    is its block), its partial sum and the prefetched one of layer k - 1; without AttnRes the two layers' residual
    streams. At most what is on the host."""
    per_layer = _layer_input_bytes(cfg, lay, w)
    most = max(_layer_reads(cfg, k) + _layer_reads(cfg, k - 1, partial_only=True) * (k > start)
               for k in range(start, end))
    return min(host, per_layer * most)


def _layer_reads(cfg, k: int, partial_only: bool = False) -> int:
    """How many distinct layer-input tensors layer k reads: with AttnRes the completed blocks (b_0 and one per block
    before k's) and its running partial sum, which at a block's first layer is that block; else the residual
    stream. `partial_only`: the partial sum alone, 0 where it is a block."""
    if not cfg.attn_res:
        return 1
    bs = cfg.attn_res_block_size
    partial = int(k % bs != 0)
    return partial if partial_only else 1 + k // bs + partial


def offload_first_load_bytes(cfg, lay: Layout, w: Workload, a: int, b: int, host: float) -> float:
    """Per micro-batch, what a stage of layers a..b-1 waits for at the start of its backward under activation
    offload: the inputs of its last offloaded layer, which the backward reads first and nothing has prefetched (each
    later layer's are loaded while the one after it recomputes); at most the micro-batch's share on the host. A bound
    where the budget keeps the last layers' inputs on the device (reading those prefetches the layer before: only the
    offloaded AttnRes blocks they read wait)."""
    full = lay.full_layers(a, b)
    if not host or not len(full):
        return 0.0
    return min(host, _layer_input_bytes(cfg, lay, w) * _layer_reads(cfg, full.stop - 1))


def vision_activations(cfg, w: Workload, recompute: str, tp: int = 1, recomputed: frozenset | None = None) -> tuple:
    """(bytes kept per micro-batch, transient bytes) of the vision tower and projector on the busiest first-stage
    device of a TP group of `tp` ranks, each encoding its share of the media (module docstring). Full
    recomputation keeps each block's input and rebuilds one block at a time; selective drops the terms of the
    recomputed module kinds (`recomputed`; default all) and rebuilds one block's; frozen keeps nothing."""
    v = cfg.vision
    if not v.enabled or w.image_share <= 0:
        return 0.0, 0.0
    share = vision_tp_share(cfg, w.seq_length, w.micro_batch_size, w.image_share, tp)
    features = share * w.image_share * w.micro_batch_size * w.seq_length
    patches = v.merge_size * features
    block, tower, proj = vision_terms(cfg, w.kernels, vision_image_patches(cfg, w.seq_length, w.image_share))
    nbytes = {"a": w.act_bytes, "f": 4, "i": 8}
    rec = recomputed_kinds(recompute, ()) if recomputed is None else recomputed

    def per(terms, mods=frozenset()):
        return sum(t.per_token * nbytes[t.dtype] for t in terms if kept(t, mods))

    one_block = patches * per(block)
    if cfg.freeze_vision:
        return 0.0, one_block
    if recompute == "full":
        return patches * (v.num_layers * v.hidden_size * w.act_bytes + per(tower)) + features * per(proj), one_block
    kept_bytes = v.num_layers * patches * per(block, rec) + patches * per(tower, rec) + features * per(proj, rec)
    rebuilt = patches * sum(t.per_token * nbytes[t.dtype] for t in block if t.cheap in rec)
    return kept_bytes, rebuilt


@dataclass
class _Sharding:
    """How a layout divides a rank's model states: ZeRO's partitions of the dense and the expert states, and of their
    gradients (ZeRO-2); the bytes per expert parameter of their gradients; n tokens of a micro-batch on a CP rank,
    n_rank of them on a TP rank. Under ep > 1 the routed experts are stepped outside DeepSpeed
    (training.expert_optimizer.ExpertOptimizer): each expert-data-parallel rank keeps the fp32 masters and optimizer
    states of its block of whole experts (Layout.expert_share of them at most); their gradients accumulate over the
    step's micro-batches as the dense ones do (w.grad_bytes: fp32, or bf16 under precision.grad_accum_dtype=bf16),
    whole on every rank, until the step reduce-scatters each into the fp32 block that replaces it (per local expert
    parameter: w.grad_bytes in the backward, `expert_block_bytes` from the reduction on, which step_workspace_bytes
    counts where it is larger: bf16 accumulation, edp < 2)."""
    dense: int
    experts: float
    grad_dense: int
    grad_experts: int
    expert_block_bytes: float
    n: float
    n_rank: float

    @classmethod
    def of(cls, cfg, lay: Layout, w: Workload) -> "_Sharding":
        dense = lay.dp * lay.cp if w.zero_stage >= 1 else 1
        in_zero = lay.experts_in_zero
        experts = dense if in_zero else 1 / lay.expert_share(cfg.num_experts)
        n = w.micro_batch_size * w.seq_length / lay.cp
        blocks = 4 / experts if w.reduced and not in_zero else 0.0
        return cls(dense, experts, dense if w.zero_stage >= 2 else 1, experts if w.zero_stage >= 2 and in_zero else 1,
                   blocks, n, n / lay.tp if lay.sp else n)


def zero2_partition(mp, a: int, b: int, first: bool, last: bool, cfg, lay: Layout, w: Workload,
                    sh: _Sharding) -> tuple:
    """(elements of whole parameters, elements of flat partitions) of the ZeRO-2 gradients the fullest data-parallel
    rank of the stage holding layers [a, b) keeps (ZeRO-1: what its reduction copies the reduced gradients into for
    the step), as DeepSpeed 0.19.8 does (stage_1_and_2.py): each param group
    (optim.grouping's, in the model's parameter order) is flattened, padded to a multiple of 2 x the data-parallel
    size and cut into equal partitions; a rank keeps the reduced gradients of every parameter its partition touches,
    whole (grads_in_partition), except in the groups DeepSpeed gives a compact fp32 partition instead (bf16 weights
    with fp32 accumulation: all but the Muon groups), which keep exactly their partition. So a parameter the boundary
    cuts, or a group of one parameter (the embedding, the LM head), is held whole by each rank it touches. Memoised."""
    fp32_accum = w.precision in MIXED and w.grad_dtype == "fp32"

    def make():
        D = sh.dense
        whole, compact = [0] * D, 0
        for key, sizes in _zero_groups(mp, a, b, first, last, cfg, lay, w.optimizer):
            if _compact_group(w, key):
                compact += partition_size(sum(sizes), D)
            else:
                whole = [x + y for x, y in zip(whole, whole_in_partitions(sizes, D))]
        return max(whole), compact
    return _memo(mp, ("partition", a, b, first, last, cfg.freeze_vision, lay.experts_in_zero, sh.dense, w.optimizer,
                      fp32_accum), make)


def _zero_groups(mp, a: int, b: int, first: bool, last: bool, cfg, lay: Layout, optimizer: str) -> tuple:
    """((group key, (elements of each parameter, in the model's order)), ...) of the param groups DeepSpeed's ZeRO
    optimizer steps on the stage holding layers [a, b), in the order it steps them (the optimizer's,
    optim.grouping's): optim=muon's rules, the Muon ones first, then AdamW's, each sorted by name; optim=adamw's
    decay, then no_decay. Memoised."""
    def make():
        groups = {}
        for e, _ in _zero_entries(mp, a, b, first, last, cfg, lay):
            key = e.rule if optimizer == "muon" else ("adamw/decay" if e.decay else "adamw/no_decay")
            groups.setdefault(key, []).append(e.numel)
        return tuple((k, tuple(groups[k])) for k in sorted(groups, key=lambda r: (not r.startswith("muon"), r)))
    return _memo(mp, ("groups", a, b, first, last, cfg.freeze_vision, lay.experts_in_zero, optimizer), make)


def _compact_group(w: Workload, key: str) -> bool:
    """Whether DeepSpeed gives the param group `key` a compact fp32 gradient partition (bf16 weights with fp32
    accumulation: all but the Muon groups) rather than the whole parameters its partition touches."""
    return w.precision in MIXED and w.grad_dtype == "fp32" and not (w.optimizer == "muon" and key.startswith("muon/"))


_STAGE_MEMO: dict = {}  # figures of a stage of a ModelParams, by its id and the values they depend on (_memo)


def _memo(mp, key: tuple, make):
    """make(), memoised per ModelParams object and `key` (a search evaluates the stages of many layouts, most of them
    alike); the memo holds mp, so no other object takes its id while the entry lives. Read-only results."""
    k = (id(mp),) + key
    hit = _STAGE_MEMO.get(k)
    if hit is None:
        if len(_STAGE_MEMO) >= 1 << 15:
            _STAGE_MEMO.clear()
        hit = _STAGE_MEMO[k] = (mp, make())
    return hit[1]


def _zero_entries(mp, a: int, b: int, first: bool, last: bool, cfg, lay: Layout) -> tuple:
    """(ParamEntry, place) of each parameter DeepSpeed's optimizer steps on the stage holding layers [a, b), in the
    model's order (the routed experts at ep = 1 only; the vision tower unless frozen); place: the layer's position in
    the stage, -1 for the embedding and the vision tower, b - a for the head. Memoised."""
    def make():
        n = b - a
        placed = [(e, pos) for pos, lp in enumerate(mp.layers[a:b]) for e in lp.entries
                  if lay.experts_in_zero or not e.expert]
        if first:
            placed += [(e, -1) for e in mp.embedding_entries + (() if cfg.freeze_vision else mp.vision_entries)]
        if last:
            placed += [(e, n) for e in mp.head_entries]
        return tuple(sorted(placed, key=lambda x: x[0].index))
    return _memo(mp, ("entries", a, b, first, last, cfg.freeze_vision, lay.experts_in_zero), make)


def zero2_reductions(mp, a: int, b: int, first: bool, last: bool, cfg, lay: Layout, w: Workload,
                     elements: int) -> tuple:
    """((elements reduced, share of the stage's layers whose backward is done by then), ...) of each of ZeRO-2's
    gradient bucket reductions in one backward of the stage holding layers [a, b), in order, as DeepSpeed 0.19.8
    fills its buckets: in the backward's order (the model's, reversed: the head first, the embedding last), a bucket
    of `elements` reduced when the next gradient would overflow it and, under optim=muon, when a Muon matrix's
    gradient follows another group's (optim.zero's flush at that boundary); the last at the backward's end (share 1).
    A gradient larger than the bucket is reduced on its own, whole (DeepSpeed's extra_large_param_to_reduce: the
    embedding and the LM head at K3's sizes). A layer's activations are taken as freed once the backward has moved on
    to an earlier layer's gradients."""
    entries = _zero_entries(mp, a, b, first, last, cfg, lay)  # memoised
    n = b - a
    out, current, last_muon = [], 0, True
    # the backward's order: the layers last to first, the head before them, the embedding and the vision tower (which
    # a multimodal model registers after the head) after them
    for e, pos in sorted(entries, key=lambda x: (x[1], x[0].index), reverse=True):
        muon = w.optimizer == "muon" and e.rule.startswith("muon/")
        if current and (current + e.numel > elements or (muon and not last_muon)):
            out.append((current, min(1.0, max(0.0, (n - 1 - pos) / max(n, 1)))))
            current = 0
        current, last_muon = current + e.numel, muon
    return tuple(out) + ((current, 1.0),)


def zero_step_bytes(mp, a: int, b: int, first: bool, last: bool, cfg, lay: Layout, w: Workload, sh: _Sharding,
                    partition: tuple, ns: float) -> float:
    """Bytes of the rank's gradient partition (`partition`: zero2_partition's figures) and what DeepSpeed's ZeRO-1/2
    step (stage_1_and_2.step) makes beside it, at their most. Before the update the whole partition is live, with the
    global norm's float64 squares of the largest slice of a gradient in it (optim.zero.raw_grad_sq_norm) or, under
    optim=muon, the Newton-Schulz workspace `ns` (optim.zero's ZeroMuon orthogonalises every update before
    DeepSpeed's step). Then DeepSpeed steps the param groups one after another, in _zero_groups' order: a group's flat
    fp32 gradient partition (a copy where the group keeps whole parameters, flattened in the gradients' dtype and
    cast to fp32 beside its source, while their buffer is live; a compact fp32 partition is used as it is) and the
    optimizer's temporaries over it, torch's single-tensor AdamW's `exp_avg_sq.sqrt() / c`: two fp32 tensors of the
    partition (a Muon group's update makes none), beside the partitions of the groups not stepped yet. A compact
    partition is freed after its group, the buffer of whole parameters (one for all such groups) once the last of
    them is flattened."""
    whole_bytes = partition[0] * w.grad_bytes
    groups = [(key, partition_size(sum(sizes), sh.dense), _compact_group(w, key), max(sizes))
              for key, sizes in _zero_groups(mp, a, b, first, last, cfg, lay, w.optimizer)]
    compact_left = sum(4 * n for _, n, compact, _ in groups if compact)
    whole_left = sum(not compact for _, _, compact, _ in groups)
    norm = _sq_norm_bytes(max((min(n, big) for _, n, _, big in groups), default=0))
    out = whole_bytes + compact_left + max(norm, ns)
    for key, n, compact, _ in groups:
        if compact:
            compact_left -= 4 * n  # its partition becomes the flat one
        else:  # flattened (and cast) beside the buffer of whole parameters, which the last such group frees
            out = max(out, compact_left + whole_bytes + n * (w.grad_bytes + 4 if w.grad_bytes < 4 else 4))
            whole_left -= 1
        temps = 0 if key.startswith("muon/") else 8 * n
        out = max(out, compact_left + (whole_bytes if whole_left else 0) + 4 * n + temps)
    return out


def zero0_allreduce_copy(sizes, limit: int = ZERO0_ALLREDUCE_BUCKET) -> int:
    """Elements of the largest flat copy ZeRO-0's all-reduce at the step's boundary makes of gradients of `sizes`
    elements in the module's parameter order, as DeepSpeed's engine does (allreduce_no_retain): a copy takes
    gradients until one takes it past `limit` (the engine's MEMORY_OPT_ALLREDUCE_SIZE), then the next begins."""
    largest = current = 0
    for n in sizes:
        current += n
        if current > limit:
            largest, current = max(largest, current), 0
    return max(largest, current)


def zero_bucket(lay: Layout, w: Workload, dense, experts) -> tuple:
    """(elements DeepSpeed's ZeRO optimizer steps on a stage, elements of its reduction bucket): `dense`, and
    `experts` at ep = 1; the bucket is parallel.deepspeed's reduce_bucket_size or the engine's own."""
    stage = int(dense.total + (experts.total if lay.experts_in_zero else 0))
    return stage, w.reduce_bucket or zero_bucket_elements(stage)


def partition_size(n: int, dp: int) -> int:
    """Elements of each of the `dp` partitions DeepSpeed's ZeRO-1/2 cuts a param group of `n` elements into (padded to
    a multiple of 2 x dp)."""
    return -(-n // (2 * dp)) * 2


def whole_in_partitions(sizes, dp: int) -> list:
    """Per partition of a param group whose parameters have `sizes` elements, in order: the elements of the
    parameters it touches, whole (DeepSpeed's get_partition_info: those starting inside it, and the one across its
    start)."""
    part = partition_size(sum(sizes), dp)
    starts = list(itertools.accumulate(sizes, initial=0))  # parameter i spans [starts[i], starts[i + 1])
    out = []
    for r in range(dp):
        i = bisect.bisect_right(starts, r * part, lo=1) - 1  # the first that ends after the partition's start
        j = bisect.bisect_left(starts, (r + 1) * part, hi=len(sizes))  # the first that starts at its end or later
        out.append(starts[j] - starts[i] if j > i else 0)
    return out


def _stage_states(mp, a: int, b: int, first: bool, last: bool, cfg, w: Workload, sh: _Sharding,
                  partition: tuple | None = None, experts_in_zero: bool = True) -> tuple:
    """(dense ParamGroup trained, frozen vision parameters, experts ParamGroup, weights, gradients, optimizer
    bytes, the routed experts' share of them) of the stage holding layers [a, b); under peft=lora the groups' frozen
    base (ParamGroup.frozen, frozen_mx) adds weights only. `partition`: under ZeRO-2 zero2_partition's figures, the
    gradients of what DeepSpeed steps (the routed experts too when `experts_in_zero`)."""
    dense = sum((lp.dense for lp in mp.layers[a:b]), type(mp.embedding)())
    if first:
        dense = dense + mp.embedding
    if last:
        dense = dense + mp.head
    vis = mp.vision if first else type(mp.embedding)()
    frozen = vis.total if cfg.freeze_vision else 0  # weights only: no gradient, master or optimizer state
    if not frozen:
        dense = dense + vis
    experts = sum((lp.experts for lp in mp.layers[a:b]), type(mp.embedding)())
    e_total, e_muon = experts.total, experts.muon  # this EP rank's experts
    base = ((dense.frozen + experts.frozen) * w.weight_bytes
            + (dense.frozen_mx + experts.frozen_mx) * MXFP4_BYTES_PER_PARAM)
    weights = (dense.total + frozen + e_total) * w.weight_bytes + base
    if partition is None:
        grads = dense.total * w.grad_bytes / sh.grad_dense + e_total * w.grad_bytes / sh.grad_experts
    else:  # ZeRO-2: whole parameters and compact partitions, the experts with them at ep = 1
        grads = (sum(partition) + (0 if experts_in_zero else e_total / sh.grad_experts)) * w.grad_bytes
    opt_dense = dense.total * w.master_bytes + _opt_state_bytes(dense, w.optimizer)
    e_group = type(dense)(int(e_total), int(e_muon), experts.largest_matrix)
    opt_exp = (e_group.total * w.master_bytes + _opt_state_bytes(e_group, w.optimizer)) / sh.experts
    return dense, frozen, experts, weights, grads, opt_dense / sh.dense + opt_exp, opt_exp


def _zero1_reduction_bytes(lay: Layout, w: Workload, stage: int, elements: int, partition: tuple | None,
                           largest: int) -> float:
    """Bytes ZeRO-1's reduction after the step's last backward makes beyond the accumulated gradients and its bucket
    (zero_gradient_buffers): the partition buffer (whole parameters in the gradients' dtype, as ZeRO-2's: fp32 under
    Muon's optim.zero.attach with bf16 weights and fp32 accumulation, the weights' dtype otherwise; compact
    partitions in fp32) and the larger of a bucket's flat copy (in the bucket's dtype, fp32 at cp > 1, less the
    accumulators of the gradients it took) and the largest gradient (`largest` elements) copied whole where it
    overflows the bucket."""
    whole, compact = partition if partition is not None else (0, 0)
    comm = 4 if lay.cp > 1 else w.grad_bytes
    per = w.grad_bytes + (comm if comm != w.grad_bytes else 0)
    n = min(elements, stage)
    copy = max(n * (per - w.grad_bytes), largest * per if largest > elements else 0)
    return whole * w.grad_bytes + compact * 4 + copy


def zero_gradient_buffers(lay: Layout, w: Workload, sh: _Sharding, dense, experts, micro_batches: int,
                          partition: tuple | None = None, reductions: tuple = (), largest: int = 0) -> tuple:
    """(bytes held with the gradients, ((bytes made during a backward, share of its layers' activations freed by
    then, None after the step's last backward), ...)) of DeepSpeed's ZeRO-1/2 gradient reduction beyond the
    gradients themselves, on a stage whose DeepSpeed optimizer steps `dense` (and `experts` at ep = 1), as DeepSpeed
    0.19.8 runs it (stage_1_and_2.py); `largest`: elements of the stage's largest gradient DeepSpeed reduces:

    - its reduction bucket, made whole at a backward's first gradient (the engine's reduce_bucket_size elements in
      the gradients' dtype; two under overlap_comm). ZeRO-1 reduces at the step's last backward and frees it only
      then: held from the first micro-batch's backward on, beside the gradients (with one micro-batch, in that
      backward only). ZeRO-2 reduces every backward and frees it at each one's end. ZeRO-2's bucket is in the
      weights' dtype (`zero2_bucket_bytes`: under bf16 weights with fp32 accumulation only optim.zero.attach, Muon's,
      makes it fp32);
    - ZeRO-2 from a step's second backward on: the buffer the reduced gradients of the rank's partition are copied
      into (grads_in_partition) is made anew at the backward's first reduction while the parameters' gradients still
      point into the last one, so the groups that use it are held twice: under bf16 weights with fp32 accumulation
      the Muon groups (the others keep one fixed fp32 partition), every group otherwise; the whole parameters the
      rank's partition touches (`partition`: zero2_partition's figures);
    - each ZeRO-2 bucket reduction (allreduce_bucket; `reductions`: zero2_reductions' figures): a flat copy of its
      gradients in the bucket's dtype and, where the communication dtype differs (fp32 under fp32 accumulation, and
      at cp > 1), that copy cast to it, made where the backward has freed some of the activations already (at the
      backward's end all of the last micro-batch's; training_memory keeps the other micro-batches' in flight). The
      copies can outlive their reduction, held by no Python object (most likely by the collective's record of its
      tensors, released on the process group's own thread; seen in one of five dp=2 gloo runs at the peak, after
      the partition buffer is made), so each reduction counts them beside that buffer.

    - ZeRO-1's reduction, after the step's last backward (every activation freed: share None), through the same
      allreduce_bucket: the bucket's gradients move into it (their accumulators freed), its flat copy (and the cast
      to the communication dtype at cp > 1) or a gradient larger than the bucket copied whole, and the buffer the
      rank's partition of the reduced gradients is copied into, made whole at the first (`partition`:
      zero2_partition's figures, the same rule). With parallel.overlap_grad_reduce the reductions run inside the
      last backward instead, from its first full bucket on: counted beside all of its activations.

    The bytes made during a backward come after its first parameter gradient, when the loss gradient over the
    vocabulary is gone (training_memory sets them beside the layers' transients, not the head's). A step that
    reduces nothing (planning.dry_run's) and ZeRO-0 (no ZeRO optimizer) have none."""
    if w.zero_stage < 1 or not w.reduced:
        return 0.0, ()
    stage, elements = zero_bucket(lay, w, dense, experts)
    if w.zero_stage == 1:
        bucket = elements * w.grad_bytes * (2 if w.overlap_grad_reduce else 1)
        reduce = _zero1_reduction_bytes(lay, w, stage, elements, partition, largest)
        when = 0.0 if w.overlap_grad_reduce else None  # overlap_comm: from the last backward's first full bucket
        return (bucket, ((reduce, when),)) if micro_batches > 1 else (0.0, ((bucket, 0.0), (bucket + reduce, when)))
    bucket_bytes = zero2_bucket_bytes(w)
    bucket = elements * bucket_bytes * (2 if w.overlap_grad_reduce else 1)
    comm = 4 if lay.cp > 1 else w.grad_bytes  # DeepSpeed reduces in fp32 at cp > 1 whatever the key
    part = 0.0
    if micro_batches > 1:
        part = (partition[0] if partition is not None else stage / sh.grad_dense) * w.grad_bytes
    per = bucket_bytes + (comm if comm != bucket_bytes else 0)
    # a gradient larger than the bucket is reduced where it lies; under Muon's fp32 buckets (optim.zero.attach) a
    # narrower one is first made fp32 whole, then flattened by slices like a bucket
    cast = 4 if w.optimizer == "muon" and bucket_bytes == 4 and w.weight_bytes < 4 else 0
    return 0.0, ((bucket, 0.0),) + tuple((bucket + part + n * (per + (cast if n > elements else 0)), freed)
                                         for n, freed in reductions or ((min(elements, stage), 0.0),))


def gradient_landing_bytes(mp, a: int, b: int, first: bool, last: bool, cfg, lay: Layout, w: Workload,
                           micro_batches: int) -> tuple:
    """(LM head, layers and vision tower, embedding): bytes the largest parameter gradient of each part of the stage
    makes as it lands in a backward, beyond the accumulated gradients counted in `gradients`: autograd's fresh
    gradient in the weights' dtype, added into the step's accumulator, and, where DeepSpeed's ZeRO-1 accumulates a
    narrower gradient in fp32 (its grad_accum attribute, stage_1_and_2._fill_param_grad_accum_attribute), the fp32
    cast of it that it adds, live beside it. The fresh gradient is extra from a step's second micro-batch on (the
    first becomes the gradient itself), always where it is narrower than its accumulator or ZeRO-2 copies it into
    its bucket, and in a step that reduces nothing (planning.dry_run's holds every gradient already). The head's
    lands after its backward (its kept activations freed), the layers' and the tower's inside theirs (every
    activation counted: a bound), the embedding's at the backward's end (this micro-batch's activations freed). At
    K3's sizes the embedding and the head lead: 146.8M elements per tp8 rank, 0.88 GB under bf16 weights, fp32
    accumulation and ZeRO-1. A weight the head and the embedding share adds its gradient to the layers' landing and
    two to the embedding's, before DeepSpeed's cast (tied_weight_elements)."""
    narrow = w.weight_bytes < w.grad_bytes

    def largest(entries) -> tuple:  # (elements of the largest gradient DeepSpeed accumulates, of the others')
        ds = [e.numel for e in entries if not e.expert or lay.experts_in_zero]
        return max(ds, default=0), max((e.numel for e in entries if e.expert and not lay.experts_in_zero), default=0)

    def make():
        inside = [e for lp in mp.layers[a:b] for e in lp.entries]
        if first and not cfg.freeze_vision:
            inside += list(mp.vision_entries)
        return (largest(mp.head_entries if last else ()), largest(inside),
                largest(mp.embedding_entries if first else ()))

    def landing(sizes, tied: float = 0.0) -> float:
        out = 0.0
        for n, ds in zip(sizes, (True, False)):  # the expert optimizer does not cast
            fresh = micro_batches > 1 or narrow or not w.reduced or (ds and w.zero_stage == 2)
            cast = ds and w.reduced and w.zero_stage == 1 and narrow and micro_batches > 1
            # a tied weight's two gradients autograd sums live before the sum lands, DeepSpeed's cast after it
            out = max(out, n * (w.weight_bytes * fresh + max(4 * cast, tied if ds else 0.0)))
        return out

    parts = _memo(mp, ("landing", a, b, first, last, cfg.freeze_vision, lay.experts_in_zero), make)
    held = tied_weight_elements(cfg, mp, first, last) * w.weight_bytes
    # the sum of a tiled head's tiles is a tensor of autograd's own, which it adds the embedding's gradient into
    ends = (1 if tile_shares(lay, w)[1] < 1 else 2) * w.weight_bytes if held else 0.0
    return landing(parts[0]), landing(parts[1]) + held, landing(parts[2], ends)


def tied_weight_elements(cfg, mp, first: bool, last: bool) -> int:
    """Elements of the weight the LM head shares with the embedding on a stage holding both
    (model.tie_word_embeddings), trained, else 0. Autograd keeps the head's gradient of it (a view of the matmul's
    output) from the head's backward until the embedding's backward adds its own, out of place, so a tied stage's
    layers' backward holds one more gradient of it, and its end two more (the embedding's and the sum; one more
    under a tiled head, whose tiles' sum autograd adds the embedding's into in place) beside the accumulated one."""
    if not (cfg.tie_word_embeddings and first and last):
        return 0
    return max((e.numel for e in mp.embedding_entries), default=0)


def zero2_bucket_bytes(w: Workload) -> int:
    """Bytes per element of ZeRO-2's reduction bucket: the weights' dtype (DeepSpeed's self.dtype), except that
    optim.zero.attach (optim=muon) makes it fp32 under bf16 weights with fp32 accumulation."""
    return w.grad_bytes if w.optimizer == "muon" else w.weight_bytes


def step_workspace_bytes(cfg, lay: Layout, w: Workload, sh: _Sharding, dense, experts,
                         zero0_copy: int | None = None, adamw_largest: int = 0, norm_largest: int = 0) -> float:
    """Bytes the optimizer step of a stage needs at once (`dense`, `experts`: its ParamGroups): Muon's Newton-Schulz
    on the largest update orthogonalised at once (momentum, X, X X^T in fp32; under ep > 1 a block of experts,
    training.expert_optimizer's) or, under ep > 1, the experts' gradient reduction, one tensor at a time, of their
    largest: its fp32 copy where the gradients accumulate narrower (precision.grad_accum_dtype=bf16; the gradient
    itself is counted in `gradients`) and at edp > 1 that fp32 gradient padded to edp equal blocks where edp does
    not divide the experts, and the block received; under ep > 1 either comes on top of the fp32 blocks' excess over
    the accumulated gradients they replace (bf16 accumulation at edp < 2: the whole fp32 gradient). Under ZeRO-0,
    before the update, DeepSpeed's all-reduce of the gradients at the step's boundary (with one data-parallel rank
    too): flat copies of consecutive gradients made one at a time, each closed at the first gradient that takes it
    past ZERO0_ALLREDUCE_BUCKET elements, the largest `zero0_copy` elements (`zero0_allreduce_copy`; without it,
    every gradient up to the bucket's size); then single-tensor AdamW's temporaries (torch.optim.AdamW with
    foreach=False, optim.muon's AdamW groups): `exp_avg_sq.sqrt() / c`, two fp32 tensors the size of the parameter
    stepped, of the largest AdamW parameter (`adamw_largest` elements) under ZeRO-0 and, under ep > 1 with
    optim=adamw, of the largest block of experts training.expert_optimizer steps (ZeRO-1/2's step: zero_step_bytes).
    Before the update, the global gradient norm's float64 squares (ops.numerics.sq_norm64: two temporaries of the
    gradient, at most of SQ_NORM_CHUNK elements each) of the largest gradient under ZeRO-0 (`norm_largest`
    elements), of an expert block under ep > 1 (ZeRO-1/2's own: zero_step_bytes). A step that reduces nothing
    (`Workload.reduced`: planning.dry_run's) has none of it."""
    share = 1.0 if lay.experts_in_zero else lay.expert_share(cfg.num_experts)
    ns = newton_schulz_bytes(w, max(dense.largest_matrix, experts.largest_matrix * share))
    if w.zero_stage == 0 and w.reduced:  # ZeRO-0 runs one stage without EP (layout rule 9): every gradient
        largest = min(dense.total + experts.total, ZERO0_ALLREDUCE_BUCKET) if zero0_copy is None else zero0_copy
        ns = max(ns, largest * w.grad_bytes, 8 * adamw_largest, _sq_norm_bytes(norm_largest))
    if lay.experts_in_zero or not experts.total or not w.reduced:
        return ns
    local = cfg.num_experts // lay.ep
    inner = w.peft[0] if w.peft else cfg.moe_intermediate_size  # peft=lora: the adapters [E, rank, in] are trained
    largest = local * inner * max(cfg.moe_intermediate_size, cfg.expert_width)
    copy = 4 if w.grad_bytes < 4 else 0
    blocks = max(0.0, sh.expert_block_bytes - w.grad_bytes) * experts.total
    # AdamW's temporaries on its master block; the norm's float64 squares of its gradient
    ns = max(ns, 0 if w.optimizer == "muon" else 8 * largest * share, _sq_norm_bytes(largest * share))
    if lay.edp == 1:
        return blocks + max(ns, largest * copy)
    padded = share * lay.edp if local % lay.edp else 0.0
    return blocks + max(ns, largest * (copy + 4 * padded + 4 * share))


def newton_schulz_bytes(w: Workload, elements: float) -> float:
    """optim=muon: Newton-Schulz's fp32 workspace orthogonalising a matrix of `elements` (momentum, X, X X^T); 0
    under AdamW."""
    return 3 * elements * 4 if w.optimizer == "muon" else 0.0


def _sq_norm_bytes(elements: float) -> float:
    """Bytes of ops.numerics.sq_norm64's float64 temporaries over a gradient of `elements` (a chunk and its square)."""
    return 2 * 8 * min(elements, SQ_NORM_CHUNK)


def token_rows_copy_bytes(cfg, lay: Layout, w: Workload) -> float:
    """peft.trainable_tokens: the embedding's (first stage) or the LM head's (last stage) vocabulary block with the
    trained rows in, built out of place in each forward (peft.tokens; the head's kept for its backward)."""
    if not w.peft or not w.peft[5]:
        return 0.0
    return -(-cfg.vocab_size // lay.tp) * cfg.hidden_size * w.weight_bytes


def frozen_expert_decode_bytes(cfg, w: Workload) -> float:
    """peft=lora: one block of frozen experts decoded inside the expert GEMMs (w1, w3 and w2 in the activations'
    dtype, and the [w1; w3] concatenation the gate/up GEMM runs against)."""
    if not w.peft:
        return 0.0
    block = min(w.peft[4], cfg.num_experts)
    return block * 5 * cfg.moe_intermediate_size * cfg.expert_width * w.act_bytes


def _head_transient(cfg, lay: Layout, w: Workload, out_src, head_weights: float) -> float:
    """The last stage's transient at the start of the backward: the loss gradient over the vocabulary shard (of one
    tile under train.tile_tokens, with the tiled head's working set) and the head's weight gradient (`head_weights`
    bytes), made while that loss gradient is live (untiled: both products of one matmul's backward; tiled: the sum
    of the tiles' weight gradients)."""
    fh = tile_shares(lay, w)[1]
    n = w.micro_batch_size * w.seq_length / lay.cp
    _, trans = head_terms(cfg, lay.tp, w.kernels, out_src)
    loss = fh * sum(term_bytes(t, n, lay.tp, lay.sp, w.act_bytes, n) for t in trans)
    if fh < 1:
        return loss + fh * _head_tiled_bytes(cfg, lay, w, out_src) + head_weights
    # untiled: the matmul's backward makes the weight gradient beside the logits' gradient, one of the loss
    # gradient's two V-wide fp32 terms (activations.head_terms), once the other and the log-probabilities (kept, as
    # large) are freed
    return max(loss, head_weights)


def _stage_activations(cfg, lay: Layout, w: Workload, a: int, b: int, last: bool, in_flight: int,
                       head_weights: float = 0.0, held: float = 0.0) -> tuple:
    """(activation bytes kept on the device for the backward, by category, (transient bytes, the same without the
    head's, which the backward's later part has), bytes offloaded to host) of the stage's micro-batches in flight
    under the layout's recomputation, tiling and offload, the LM head's transients included on the last stage:

    - none: everything kept; the loss gradient over the vocabulary shard is transient at the start of the backward;
    - selective: the recomputed module kinds' terms dropped and their regions' inputs kept; each region is rebuilt on
      its own during its layer's backward, when the later layers' (and the head's) kept activations of that
      micro-batch are already freed: the transient is the largest region's rebuilt terms beyond what was freed, or
      the loss gradient if larger;
    - full: the layers it covers keep their inputs and one of them is rebuilt, whole, at a time; with offload up to
      lay.offload_bytes of the kept inputs live in host memory, the backward's loaded back ones transient;
    - tiling (lay.tile_tokens): the MoE blocks and the head keep their inputs only, KDA's chunk kernel its tiles'
      inputs; one tile's working set is transient (parallel.tiling), and inside a layer full recomputation (or a
      selective region) rebuilds, its MoE block and KDA chunk terms are a tile's;
    - the head's backward makes its weight gradient beside the loss gradient (`head_weights` bytes; tiled: the sum
      of its tiles' weight gradients, as expert_workspace_bytes explains); `held` bytes of it stay through the
      layers' backward (a weight tied to the embedding's: tied_weight_elements)."""
    sources, out_src = _sources(cfg)
    rec, full = lay.recomputed, lay.full_layers(a, b)
    fm, fh = tile_shares(lay, w)
    fk = kda_tile_share(cfg, lay, w)
    tiled = {"moe_scale": 0.0 if fm < 1 else 1.0, "kda_scale": 0.0 if fk < 1 else 1.0}  # what tiled parts keep
    per_micro, cat, _ = _micro_activation(cfg, lay, w, full.stop, b, last, rec,
                                          head_scale=0.0 if fh < 1 else 1.0, **tiled)
    detail = {k: v * in_flight for k, v in cat.items()}
    head_t = _head_transient(cfg, lay, w, out_src, head_weights) if last else 0.0
    transient, layers_t = head_t, 0.0  # layers_t: the same without the head's transients (the backward's later part)
    if fm < 1:  # one MoE tile's working set at a time (forward, and its recomputation in the backward)
        tile = fm * max(_tiled_bytes(cfg, lay, w, i, sources[i], rec) for i in range(a, b))
        transient, layers_t = max(transient, tile), tile
    if fk < 1:  # one KDA tile's chunk terms
        tile = fk * max(_kda_tiled_bytes(cfg, lay, w, i, sources[i], rec)[0] for i in range(a, b))
        transient, layers_t = max(transient, tile), max(layers_t, tile)
    host = 0.0
    if len(full):
        ckpt = _full_recompute_checkpoints(cfg, lay, w, full.start, full.stop)
        _, _, largest = _micro_activation(cfg, lay, w, full.start, full.stop, False, frozenset(),
                                          moe_scale=fm, kda_scale=fk)
        per_micro += ckpt
        host = min(lay.offload_bytes, in_flight * ckpt)
        detail["layer_inputs"] = in_flight * ckpt - host
        if host:
            detail["layer_inputs_on_host"] = host
        # one layer recomputed at a time during the backward, beside the inputs offload has loaded back for it
        layer = largest + _offload_reload_bytes(cfg, lay, w, full.start, full.stop, host)
        transient, layers_t = transient + layer, layers_t + layer
    if rec and b > a:
        freed = _micro_activation(cfg, lay, w, b, b, last, rec)[0]  # the head's kept terms
        worst = 0.0
        for i in reversed(range(a, b)):
            rebuilt = max(_micro_activation(cfg, lay, w, i, i + 1, False, frozenset({k}), True,
                                            kda_scale=fk)[0] for k in rec)
            worst = max(worst, rebuilt - freed)
            freed += _micro_activation(cfg, lay, w, i, i + 1, False, rec, **tiled)[0]
        transient, layers_t = max(transient, worst), max(layers_t, worst)
    return in_flight * per_micro - host, detail, (max(transient, layers_t + held), layers_t + held), host


def expert_workspace_bytes(cfg, lay: Layout, w: Workload, mp, moe_layers, bal: BalancedMoE | None) -> float:
    """Bytes one MoE layer's routed experts make beside their rows (ops.grouped_gemm), at most, of the stage's MoE
    layers: the [w1; w3] concatenation of the own experts and the balanced dispatch's replicas, made in the weights'
    dtype and cast to the GEMMs' (in the forward, and again in the backward, which then makes the two weight
    gradients, as large). Under train.tile_tokens also the gradients of the tiled block's weights (routed experts,
    replicas, router, shared experts, latent projections): every tile runs the same weights, so autograd sums the
    tiles' gradients in its input buffer, in the weights' dtype, through the block's backward and accumulates once.
    Under peft=lora the frozen experts' decoded block stands for the concatenation (frozen_expert_decode_bytes).
    Under precision=mx_qat the concatenation (and the down GEMM's copy of w2, smaller) is fake-quantised in place,
    ROUND_TRIP_CHUNK elements at a time, beside it: one chunk's temporaries (ops.mx)."""
    if not moe_layers or w.peft:
        return 0.0
    own = max(mp.layers[i].experts.total for i in moe_layers)  # w1, w3, w2 of the own experts
    slots = bal.S * bal.P if bal is not None else 0
    cast = w.act_bytes if w.act_bytes != w.weight_bytes else 0
    w13 = 2 / 3 * (own + slots)  # elements of [w1; w3]
    ws = w13 * (w.weight_bytes + cast)
    if w.precision == "mx_qat":
        ws += min(ROUND_TRIP_CHUNK, w13) * ROUND_TRIP_BYTES_PER_ELEMENT
    if tile_shares(lay, w)[0] < 1:
        ws += (max(mp.layers[i].experts.total + mp.layers[i].moe_dense for i in moe_layers) + slots) * w.weight_bytes
    return ws


def _stage_moe(cfg, lay: Layout, w: Workload, a: int, b: int, in_flight: int, sh: _Sharding, mp) -> tuple:
    """(activation bytes, their categories, transient bytes, replica bytes, exchange buffer bytes) of the stage's
    MoE layers beyond their activation terms: balanced dispatch's replicas, padding, exchange buffers and relay
    stores (BalancedMoE), or dispatch's all-to-all buffers under EP; the experts' weight workspace
    (expert_workspace_bytes)."""
    moe_layers = [i for i in range(a, b) if cfg.ffn_types()[i] == "moe"]
    bal = balanced_moe(cfg, lay, w)
    acts, detail, replicas, exchange = 0.0, {}, 0.0, 0.0
    transient = expert_workspace_bytes(cfg, lay, w, mp, moe_layers, bal)
    if moe_layers and bal is not None:  # balanced dispatch (BalancedMoE)
        pad = 0.0
        if bal.cap > bal.M:  # below E/ep slots: the compute buffer's worst-case rows beyond M
            pad = (bal.cap - bal.M) * _expert_row_bytes(cfg, lay, w, moe_layers[0], attn_res_sources(cfg)[0])
        per_layer = bal.replica_bytes(replica_bytes_per_param(cfg, w))
        full = lay.full_layers(a, b)
        kept_layers = [i for i in moe_layers if i not in full]
        if len(kept_layers) < len(moe_layers):  # one recomputed layer's replicas (and padding) live at a time
            replicas = per_layer
            transient += per_layer + pad
        if kept_layers:
            held = in_flight * len(kept_layers)
            replicas = held * per_layer
            acts += replicas + held * pad
            detail["moe_replicas"] = replicas
            if pad:
                detail["moe_capacity_padding"] = held * pad
        exchange = bal.exchange_buffer_bytes(replica_bytes_per_param(cfg, w)) + bal.token_buffer_bytes(w.act_bytes)
        transient += exchange
        if w.replica_exchange == "step":  # the relay stores of every MoE layer, for the whole step
            acts += len(moe_layers) * bal.step_store_bytes()
            detail["moe_relay_stores"] = len(moe_layers) * bal.step_store_bytes()
    elif moe_layers and lay.ep > 1:  # all-to-all send + receive buffers of one layer (of one tile, if tiled)
        transient += 2 * sh.n_rank * cfg.top_k * cfg.expert_width * w.act_bytes * tile_shares(lay, w)[0]
    return acts, detail, transient, replicas, exchange


def _stage_vision(cfg, lay: Layout, w: Workload, vis, frozen: int, in_flight: int, sh: _Sharding) -> tuple:
    """(activation bytes, transient bytes, the vision summary) of the tower on the first stage ({} elsewhere)."""
    if not vis.total:
        return 0.0, 0.0, {}
    kept_bytes, v_trans = vision_activations(cfg, w, lay.recompute, lay.tp, lay.recomputed)
    trained = 0 if frozen else vis.total
    return in_flight * kept_bytes, v_trans, {
        "params": vis.total, "frozen": bool(frozen), "weights": vis.total * w.weight_bytes,
        "gradients": trained * w.grad_bytes / sh.grad_dense,
        "optimizer": (trained * w.master_bytes + (_opt_state_bytes(vis, w.optimizer) if trained else 0)) / sh.dense,
        "activations": in_flight * kept_bytes, "transient": v_trans}


def _step_phase_bytes(mp, stage: tuple, cfg, lay: Layout, w: Workload, sh: _Sharding, groups: tuple, entries,
                      partition: tuple | None, grads: float, largest: int) -> float:
    """Gradient bytes and step workspace of the optimizer-step phase of the stage `stage` (a, b, first, last) whose
    ParamGroups are `groups` (dense, experts): the backward's gradients (`grads`, DeepSpeed's held buffers included)
    with step_workspace_bytes; under ZeRO-1/2, whose reduction has left the rank's gradient partition in place of
    the dense gradients, the larger of that partition with step_workspace_bytes (the experts' reduction and step
    under ep > 1, beside their gradients) and of DeepSpeed's step (zero_step_bytes) beside the experts' fp32 blocks.
    Under ZeRO-1 with bf16 weights and fp32 accumulation at dp > 1 DeepSpeed's fp32 bucket (both, under
    parallel.overlap_grad_reduce, where the gradients fill more than one) stays live throughout: the accumulators of
    the parameters outside the rank's partition point into it until their group is stepped."""
    a, b, first, last = stage
    dense, experts = groups
    zero0 = w.zero_stage == 0 and w.reduced
    copy = zero0_allreduce_copy(e.numel for e, _ in entries) if zero0 else None
    adamw = _memo(mp, ("adamw", a, b, first, last, cfg.freeze_vision, lay.experts_in_zero, w.optimizer),
                  lambda: max((e.numel for e, _ in entries if w.optimizer != "muon"
                               or not e.rule.startswith("muon/")), default=0)) if zero0 else 0
    workspace = step_workspace_bytes(cfg, lay, w, sh, dense, experts, copy, adamw, largest)
    if partition is None:
        return grads + workspace
    stale = 0.0
    if w.zero_stage == 1 and w.weight_bytes < w.grad_bytes and sh.dense > 1:
        stage, elements = zero_bucket(lay, w, dense, experts)  # overlap_comm's two buckets, where both are filled
        stale = elements * 4 * (2 if w.overlap_grad_reduce and stage > elements else 1)
    own = 0.0 if lay.experts_in_zero else experts.total
    out = stale + partition[0] * w.grad_bytes + partition[1] * 4 + own * w.grad_bytes + workspace
    # ZeroMuon's Newton-Schulz, of what DeepSpeed steps (the experts' under ep > 1 run in their own step)
    ns = newton_schulz_bytes(w, max(dense.largest_matrix, experts.largest_matrix if lay.experts_in_zero else 0))
    return max(out, stale + own * sh.expert_block_bytes + zero_step_bytes(mp, a, b, first, last, cfg, lay, w, sh,
                                                                          partition, ns))


def training_memory(cfg, cluster, lay: Layout, w: Workload) -> list:
    """StageMemory for every pipeline stage of `lay` (the planner reports the largest)."""
    mp = model_params(cfg, lay.tp, lay.ep, w.peft, w.per_head)
    stages = stage_layers(cfg, lay.pp)
    m = w.global_batch_size // (w.micro_batch_size * lay.dp) if lay.dp else 1
    sh = _Sharding.of(cfg, lay, w)
    out = []
    for s, (a, b) in enumerate(stages):
        first, last = s == 0, s == len(stages) - 1
        # the parameters DeepSpeed steps, once per stage: ZeRO-1/2's partition, ZeRO-2's buckets, ZeRO-0's flat copies
        entries = _zero_entries(mp, a, b, first, last, cfg, lay) if w.reduced else ()
        partition = (zero2_partition(mp, a, b, first, last, cfg, lay, w, sh)
                     if w.zero_stage >= 1 and w.reduced else None)
        dense, frozen, experts, weights, grads, optimizer, opt_exp = _stage_states(
            mp, a, b, first, last, cfg, w, sh, partition if w.zero_stage >= 2 else None, lay.experts_in_zero)
        in_flight = min(lay.pp - s, m) if lay.pp > 1 else 1
        tied = tied_weight_elements(cfg, mp, first, last) * w.weight_bytes
        acts, detail, (transient, layers_t), host = _stage_activations(
            cfg, lay, w, a, b, last, in_flight, 0.0 if w.peft else mp.head.total * w.weight_bytes + tied, tied)
        moe_acts, moe_detail, moe_trans, replicas, exchange = _stage_moe(cfg, lay, w, a, b, in_flight, sh, mp)
        acts = acts + moe_acts
        detail.update(moe_detail)
        rest = moe_trans + token_rows_copy_bytes(cfg, lay, w) * (first + last)
        if any(t == "moe" for t in cfg.ffn_types()[a:b]):
            rest += frozen_expert_decode_bytes(cfg, w)
        vis = mp.vision if first else type(mp.embedding)()
        v_acts, v_trans, vision = _stage_vision(cfg, lay, w, vis, frozen, in_flight, sh)
        acts, rest = acts + v_acts, rest + v_trans
        if v_acts:
            detail["vision"] = v_acts
        reductions = (zero2_reductions(mp, a, b, first, last, cfg, lay, w, zero_bucket(lay, w, dense, experts)[1])
                      if w.zero_stage >= 2 and w.reduced else ())
        largest = _memo(mp, ("largest", a, b, first, last, cfg.freeze_vision, lay.experts_in_zero),
                        lambda got=entries: max((e.numel for e, _ in got), default=0)) if entries else 0
        held, phases = zero_gradient_buffers(lay, w, sh, dense, experts, m, partition, reductions, largest)
        grads += held
        # DeepSpeed's backward buffers come after the head's loss gradient is gone, beside the layers' transients
        # and the activations the backward has not freed yet (at its end, only the other micro-batches' in flight);
        # with one micro-batch a step no gradient exists yet at the loss gradient (the step before freed them all)
        unmade = grads if m == 1 and w.reduced else 0.0
        own = acts / max(in_flight, 1)
        # after the step's backwards (share None) every activation is freed but balanced dispatch's relay stores
        # (moe.replica_exchange=step), which its flush at the step's boundary frees
        freeable = acts - detail.get("moe_relay_stores", 0.0)
        transient = max([transient + rest - unmade] + [made - freeable if freed is None else
                                                        (layers_t + rest if freed < 1 else 0.0) + made - own * freed
                                                        for made, freed in phases])
        # a gradient lands beside the bucket where the gradients do not hold it (the first phase: ZeRO-2, or one
        # micro-batch a step)
        live = phases[0][0] if phases and not held else 0.0
        head, inside, embedding = gradient_landing_bytes(mp, a, b, first, last, cfg, lay, w, m)
        transient = max(transient, live + max(head - detail.get("head", 0.0) / max(in_flight, 1), inside,
                                              embedding - freeable / max(in_flight, 1)))
        # the optimizer step runs after the backward has freed the activations: the larger phase counts
        transient = max(transient, _step_phase_bytes(mp, (a, b, first, last), cfg, lay, w, sh, (dense, experts),
                                                     entries, partition, grads, largest) - grads - acts)
        out.append(StageMemory(s, (a, b), dense.total + frozen, int(experts.total), in_flight, weights, grads,
                               optimizer, acts, transient, cluster.reserved_memory_gb * GB, detail, replicas,
                               exchange, vision, host, dense.frozen + experts.frozen + experts.frozen_mx, opt_exp))
    return out


@dataclass
class InferenceMemory:
    """Bytes per device when serving: weights, KDA states, MLA latent cache, workspace."""
    weights_dense: float
    weights_experts: float
    kda_states: float
    mla_cache: float
    workspace: float
    reserved: float
    sequences_per_device: int

    @property
    def total(self) -> float:
        return (self.weights_dense + self.weights_experts + self.kda_states + self.mla_cache + self.workspace
                + self.reserved)

    def breakdown_gb(self) -> dict:
        return {"weights_bf16": self.weights_dense / GB, "experts_mxfp4": self.weights_experts / GB,
                "kda_states": self.kda_states / GB, "mla_latent_cache": self.mla_cache / GB,
                "workspace": self.workspace / GB, "reserved": self.reserved / GB}


def kda_state_bytes_per_sequence(cfg, tp: int = 1, layers=None) -> float:
    """Recurrent state (fp32 [H, K, V]) and short-conv state (bf16, last W-1 inputs of q, k, v) of the KDA
    layers (all, or those in `layers`) for one sequence, on one TP rank."""
    kinds = cfg.layer_types() if layers is None else [cfg.layer_types()[i] for i in layers]
    n = kinds.count("kda")
    H = cfg.kda_num_heads / tp
    K = cfg.kda_head_dim
    return n * (H * K * K * 4 + 3 * H * K * (cfg.kda_conv_size - 1) * 2)


def mla_cache_bytes_per_token(cfg, layers=None) -> float:
    """bf16 latent cache [c_kv ; k_rope] of the MLA layers (all, or those in `layers`), per token. The
    latent is shared by all heads, so every TP rank of a group holds all of it."""
    kinds = cfg.layer_types() if layers is None else [cfg.layer_types()[i] for i in layers]
    return kinds.count("mla") * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2


def inference_memory(cfg, cluster, tp: int, ep: int, pp: int, batch: int, context: int,
                     prefill_chunk: int = 8192) -> InferenceMemory:
    """Serving memory per device on the first (largest) pipeline stage: routed experts in MXFP4 over the EP
    group, everything else bf16 over TP, `batch` sequences of `context` tokens spread over the attention
    data-parallel groups (world / (tp * pp))."""
    mp = model_params(cfg, tp, ep)
    world = cluster.world_size
    dp_attn = max(1, world // (tp * pp))
    seqs = -(-batch // dp_attn)
    worst = None
    for s, (a, b) in enumerate(stage_layers(cfg, pp)):
        dense = sum(lp.dense.total for lp in mp.layers[a:b])
        dense += (mp.embedding.total + mp.vision.total if s == 0 else 0) + (mp.head.total if s == pp - 1 else 0)
        experts = sum(lp.experts.total for lp in mp.layers[a:b])
        layers = range(a, b)
        kda = seqs * kda_state_bytes_per_sequence(cfg, tp, layers)
        mla = seqs * context * mla_cache_bytes_per_token(cfg, layers)
        chunk = min(prefill_chunk, context)
        w = Workload(chunk, 1, 1, "bf16", kernels="fused")
        lay = Layout(world=tp, tp=tp, sequence_parallel=True)
        per_layer = max(_micro_activation(cfg, lay, w, i, i + 1, False, frozenset())[0]
                        for i in layers)
        blocks = (cfg.num_attn_res_blocks + 1) * chunk * cfg.hidden_size * 2 if cfg.attn_res else 0
        logits = (chunk * cfg.vocab_size / tp * 4) if s == pp - 1 else 0
        workspace = per_layer + blocks + logits
        m = InferenceMemory(dense * 2, experts * MXFP4_BYTES_PER_PARAM, kda, mla, workspace,
                            cluster.reserved_memory_gb * GB, seqs)
        if worst is None or m.total > worst.total:
            worst = m
    return worst
