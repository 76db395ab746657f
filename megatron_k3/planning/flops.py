"""Analytic model FLOPs of the K3 family per token: every matmul-like operation of the forward and backward
pass, layer by layer, from the model config alone.

Counted: linear projections, the MLA attention products, the matmuls inside the chunked KDA op
(megatron_k3.ops.kda: intra-chunk scores, the 0/1-triangle running sums, the unit-triangular solve, the
WY products, the chunk-state hand-off and the output), routed and shared experts, router, latent
projections, LM head. Not counted (the usual convention, as in Megatron-LM's and PaLM's MFU): elementwise
work (norms, activations, the AttnRes depth softmax, the short convolution's four taps, softmax,
cross-entropy). A multiply-add is 2 FLOPs.

Backward factors: a matmul whose two operands both carry gradients costs 2x its forward (input and weight
gradients); a matmul against a constant 0/1 triangle (the running sums) costs 1x (only the input's
gradient); the triangular solve costs its own size again plus one full matmul for the matrix gradient.

`attention`: "causal" counts each query against the keys at or before it, (T + 1) / 2 on average, which is
what a causal flash kernel computes and the number used for MFU; "dense" counts the full T x T square,
which is what the eager (math) scaled-dot-product path computes on CPU.

Vision (model.vision.enabled; `vision_flop_terms`), per text token: a share `image_share` of the sequence's tokens
are image features (default DEFAULT_IMAGE_SHARE), each feature the 2 x 2 merge of 4 patches of one frame
(images, t = 1), every image the position table's own grid (pos_emb_height x pos_emb_width patches: 64 x 64 =
4096 patches, 896 x 896 pixels, 1024 features in K3), or the whole sequence's patches when fewer. A medium of L
patches costs per block 2 L (3QD + QD + 2DI) in the projections and 4 L^2 Q in its bidirectional attention, the
patch embedding 2 L (3 p^2) D and the projector 2 N (16 D^2 + 4 D K) for its N = L / 4 features. Backward: twice
the forward (the patch embedding once: the pixels take no gradient); with model.freeze_vision none at all (the
tower and projector take no gradient and nothing upstream of them does either, so autograd skips them: training
costs the forward only). These are the model's FLOPs, counted once per token. Under tensor parallelism the work is
split (model/multimodal.py): each TP rank encodes a contiguous share of the micro-batch's media by patch count
(model.vision.media_shares), whole media each, so the busiest rank encodes `vision_tp_share` of the micro-batch's
patches: 1/tp when the images divide evenly over the TP ranks, all of them when the micro-batch holds one image.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model.vision import media_shares

__all__ = ["FlopTerm", "ModelFlops", "layer_flop_terms", "frozen_base", "WEIGHT_GEMMS",
           "model_flops", "kda_chunk_flops", "decode_flops_per_token",
           "vision_flop_terms", "vision_image_patches", "vision_media", "vision_tp_share", "media_flops",
           "DEFAULT_IMAGE_SHARE"]

DEFAULT_IMAGE_SHARE = 0.25  # share of a vision-language sequence's tokens that are image features (a planner input)


@dataclass(frozen=True)
class FlopTerm:
    """FLOPs per token of one operation (summed over heads and experts), forward and backward."""
    name: str
    category: str  # kda, mla, dense_ffn, moe_routed, moe_other, lm_head, vision_tower, mm_projector
    forward: float
    backward: float


@dataclass
class ModelFlops:
    """Per-token FLOPs of one forward and one backward pass through the whole model."""
    seq_length: int
    attention: str
    forward_per_token: float
    backward_per_token: float
    by_category: dict = field(default_factory=dict)  # category -> [forward, backward] per token
    per_layer_forward: list = field(default_factory=list)  # per decoder layer, per token

    @property
    def train_per_token(self) -> float:
        """Model FLOPs of one training token: forward + backward (no recomputation)."""
        return self.forward_per_token + self.backward_per_token

    def train_per_step(self, tokens: int) -> float:
        return self.train_per_token * tokens


def _mm(name, cat, flops, both_grads=True) -> FlopTerm:
    return FlopTerm(name, cat, float(flops), float(flops) * (2 if both_grads else 1))


def kda_chunk_flops(T: int, C: int, H: int, K: int, V: int) -> list:
    """Matmul FLOPs of `chunk_kda`'s torch form for one sequence of T tokens, as FlopTerms totalled over the
    sequence (divide by T for per token). Mirrors `megatron_k3.ops.kda._chunk_kda_torch`: padded to whole
    chunks of C, per head; training's call (a zero initial state, no final state). P, R, M, N are batched over the
    chunks, so their backward runs for every chunk, the first's incoming state and the last's outgoing one included,
    except with a single chunk: then nothing reaches the state and autograd skips what only feeds it (the hand-off
    product K_tail^T [U | W], the tail decays of K_tail, the incoming state's gradient P^T dO)."""
    NC = -(-T // C)
    per_chunk = []  # (name, fwd flops per chunk and head, backward factor kind)
    S = C
    while S > 1 and S % 2 == 0:  # the diagonal block size `_intra_chunk_scores` uses (odd part of C)
        S //= 2
    if S > 1:  # diagonal blocks: pairwise decays from a 0/1 span matrix times g
        per_chunk.append(("kda.diag_span", 2 * C * S * S * K, "const"))
    scores, sums = 0, 0
    b = S
    while b < C:  # sibling blocks at block size b: (q, k) rows x k columns, one matmul per pair of blocks
        scores += 2 * C * b * K
        if b > 1:  # the row and column decays: a running sum and a tail sum over b positions
            sums += 2 * C * b * K
        b *= 2
    per_chunk.append(("kda.intra_scores", scores, "both"))
    if sums:
        per_chunk.append(("kda.block_decay_sums", sums, "const"))
    if C > 1:
        per_chunk.append(("kda.chunk_decay_sums", 2 * (2 * C * C * K), "const"))  # gamma and the tail decays
    solve = C * (C - 1) * (V + K)  # unit lower-triangular solve, right-hand side [C, V + K]
    per_chunk.append(("kda.ut_solve", solve, "solve"))
    per_chunk.append(("kda.wy_products", 2 * C * C * (V + K) + 2 * K * C * (V + K), "both"))  # A_qk UW, K_tail^T UW
    per_chunk.append(("kda.state_handoff", 2 * K * K * V, "handoff"))  # S <- M S + N
    per_chunk.append(("kda.output", 2 * C * K * V, "both"))  # O = P S + R
    out = []
    for name, f, kind in per_chunk:
        fwd = f * NC * H
        if kind == "both":
            bwd = 2 * fwd
        elif kind == "const":
            bwd = fwd
        elif kind == "handoff":  # the last chunk's result is unused (no final state in training) and the
            # first chunk starts from a constant zero state: M's gradient for NC - 1 chunks, S's for NC - 2
            bwd = f * H * (max(NC - 1, 0) + max(NC - 2, 0))
        else:  # the solve again for the right-hand side's gradient, and grad_A = -grad_rhs X^T as a full matmul
            bwd = fwd + 2 * C * C * (V + K) * NC * H
        if NC == 1:
            bwd -= _single_chunk_skipped(name, C, K, V) * H
        out.append(FlopTerm(name, "kda", fwd, bwd))
    return out


def _single_chunk_skipped(name: str, C: int, K: int, V: int) -> int:
    """Backward FLOPs per head of a chunk_kda term that a single chunk does not run (kda_chunk_flops): both gradient
    products of N, KW = K_tail^T [U | W], the tail sum's 0/1-triangle matmul (K_tail's decays), and P^T dO."""
    return {"kda.wy_products": 2 * (2 * K * C * (V + K)), "kda.chunk_decay_sums": 2 * C * C * K,
            "kda.output": 2 * C * K * V}.get(name, 0)


def _mixer_terms(cfg, layer_type: str, T: int, attention: str) -> list:
    D = cfg.hidden_size
    if layer_type == "kda":
        H, K = cfg.kda_num_heads, cfg.kda_head_dim
        HK, R = H * K, cfg.decay_rank
        terms = [_mm("kda.qkv_proj", "kda", 3 * 2 * D * HK), _mm("kda.decay_proj", "kda", 2 * D * R + 2 * R * HK),
                 _mm("kda.beta_proj", "kda", 2 * D * H), _mm("kda.o_proj", "kda", 2 * HK * D)]
        if cfg.kda_output_gate == "lowrank":
            terms.append(_mm("kda.gate_proj", "kda", 2 * D * K + 2 * K * HK))
        else:
            terms.append(_mm("kda.gate_proj", "kda", 2 * D * HK))
        terms += [FlopTerm(t.name, t.category, t.forward / T, t.backward / T)
                  for t in kda_chunk_flops(T, cfg.kda_chunk_size, H, K, K)]
        return terms
    H = cfg.mla_num_heads
    N, Rr, Vd, L, ql = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    qk = N + Rr
    terms = [_mm("mla.q_proj", "mla", (2 * D * ql + 2 * ql * H * qk) if ql else 2 * D * H * qk),
             _mm("mla.kv_proj", "mla", 2 * D * (L + Rr) + 2 * L * H * (N + Vd)),
             _mm("mla.o_proj", "mla", 2 * H * Vd * D)]
    if cfg.mla_output_gate:
        terms.append(_mm("mla.gate_proj", "mla", 2 * D * H * Vd))
    keys = (T + 1) / 2 if attention == "causal" else T  # keys per query
    terms.append(_mm("mla.attention", "mla", 2 * H * qk * keys + 2 * H * Vd * keys))
    return terms


def _ffn_terms(cfg, ffn_type: str) -> list:
    D = cfg.hidden_size
    if ffn_type == "dense":
        return [_mm("dense_ffn", "dense_ffn", 3 * 2 * D * cfg.dense_intermediate_size)]
    W, I, E, k = cfg.expert_width, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    terms = [_mm("moe.router", "moe_other", 2 * D * E),
             _mm("moe.routed_experts", "moe_routed", k * 3 * 2 * W * I)]
    if cfg.moe_latent_size:
        terms.append(_mm("moe.latent_proj", "moe_other", 2 * 2 * D * W))
    if cfg.num_shared_experts:
        terms.append(_mm("moe.shared_experts", "moe_other", 3 * 2 * D * cfg.shared_ffn_size))
    return terms


# the terms that multiply by a weight (the others are the attention / KDA cores): with the weight frozen (peft=lora)
# their backward is the input's gradient alone, one forward's worth
WEIGHT_GEMMS = frozenset({"kda.qkv_proj", "kda.decay_proj", "kda.beta_proj", "kda.o_proj", "kda.gate_proj",
                          "mla.q_proj", "mla.kv_proj", "mla.o_proj", "mla.gate_proj", "dense_ffn", "moe.router",
                          "moe.routed_experts", "moe.latent_proj", "moe.shared_experts", "lm_head"})


def frozen_base(terms: list) -> list:
    """`terms` with every weight frozen (peft=lora): a weight GEMM's backward computes the input's gradient only."""
    return [FlopTerm(t.name, t.category, t.forward, t.forward) if t.name in WEIGHT_GEMMS else t for t in terms]


def layer_flop_terms(cfg, layer_idx: int, seq_length: int, attention: str = "causal") -> list:
    """FlopTerms (per token) of decoder layer `layer_idx` for sequences of `seq_length` tokens."""
    if attention not in ("causal", "dense"):
        raise ValueError(f"attention must be 'causal' or 'dense', got {attention!r}")
    return (_mixer_terms(cfg, cfg.layer_types()[layer_idx], seq_length, attention)
            + _ffn_terms(cfg, cfg.ffn_types()[layer_idx]))


def vision_image_patches(cfg, seq_length: int, image_share: float = DEFAULT_IMAGE_SHARE) -> int:
    """Patches of one image (the position table's grid, or all of a sequence's image patches when fewer)."""
    v = cfg.vision
    per_sequence = v.merge_size * image_share * seq_length
    return int(max(1, min(v.pos_emb_height * v.pos_emb_width, round(per_sequence))))


def vision_media(cfg, seq_length: int, micro_batch_size: int, image_share: float = DEFAULT_IMAGE_SHARE) -> list:
    """Patches of each medium of one micro-batch under the planner's image load, in order: per sequence as many
    images of vision_image_patches as its image patches fill, and the rest as one smaller image; empty without
    image tokens."""
    per_sequence = int(round(cfg.vision.merge_size * image_share * seq_length))
    if image_share <= 0 or per_sequence <= 0:
        return []
    L = vision_image_patches(cfg, seq_length, image_share)
    one = [L] * (per_sequence // L) + ([per_sequence % L] if per_sequence % L else [])
    return one * micro_batch_size


def vision_tp_share(cfg, seq_length: int, micro_batch_size: int, image_share: float = DEFAULT_IMAGE_SHARE,
                    tp: int = 1) -> float:
    """The share of a micro-batch's patches that the busiest of `tp` tensor-parallel ranks encodes: the model's own
    split (model.vision.media_shares: contiguous whole media, about equal patch counts), applied to vision_media.
    1/tp when the images divide evenly over the ranks; 1 with one image per micro-batch (one rank encodes it while
    the others wait at the features' all-gather). 1 without tensor parallelism or without media."""
    media = vision_media(cfg, seq_length, micro_batch_size, image_share)
    if tp <= 1 or not media:
        return 1.0
    busiest = max(sum(media[a:b]) for a, b in media_shares([(1, 1, p) for p in media], tp))
    return busiest / sum(media)


def vision_flop_terms(cfg, seq_length: int, image_share: float = DEFAULT_IMAGE_SHARE) -> list:
    """FlopTerms per text token of the vision tower and projector (module docstring): empty without
    model.vision.enabled or with no image tokens."""
    v = cfg.vision
    if not v.enabled or image_share <= 0:
        return []
    D, Q, I, K = v.hidden_size, v.qkv_hidden_size, v.intermediate_size, cfg.hidden_size
    features = image_share  # per text token
    patches = v.merge_size * features
    L = vision_image_patches(cfg, seq_length, image_share)
    n, embed = v.num_layers, 2 * patches * 3 * v.patch_size ** 2 * D
    terms = [FlopTerm("vision.patch_embed", "vision_tower", embed, embed),  # backward: the weight's gradient only
             _mm("vision.qkv_proj", "vision_tower", n * patches * 2 * 3 * Q * D),
             _mm("vision.o_proj", "vision_tower", n * patches * 2 * Q * D),
             _mm("vision.mlp", "vision_tower", n * patches * 2 * 2 * D * I),
             _mm("vision.attention", "vision_tower", n * patches * 4 * L * Q),
             _mm("mm_projector", "mm_projector", features * 2 * (v.merge_size ** 2 * D * D + v.merge_size * D * K))]
    if cfg.freeze_vision:  # no gradient anywhere in or below the tower: autograd skips its backward
        terms = [FlopTerm(t.name, t.category, t.forward, 0.0) for t in terms]
    return terms


def media_flops(cfg, grids) -> tuple:
    """(forward, backward) FLOPs of the vision tower and projector on actual media, `grids` = [(t, h, w), ...] in
    patches (a batch's grid_thws): what a training step with those media spends on them, by the same rules as
    vision_flop_terms (each medium's attention over its own t h w patches; (h/2)(w/2) features whatever t is), plus
    the position table's interpolation to a grid other than its own (model.vision.interpolate_table: one GEMM per
    axis, once per medium; its backward the table's gradient only, as many FLOPs)."""
    v = cfg.vision
    if not v.enabled:
        return 0.0, 0.0
    D, Q, I, K = v.hidden_size, v.qkv_hidden_size, v.intermediate_size, cfg.hidden_size
    H0, W0 = v.pos_emb_height, v.pos_emb_width
    mh, mw = (int(m) for m in v.merge_kernel_size)
    embed = mm = 0.0
    for t, h, w in grids:
        L, N = t * h * w, (h // mh) * (w // mw)
        embed += 2 * L * 3 * v.patch_size ** 2 * D
        if (h, w) != (H0, W0):
            embed += 2 * D * (h * H0 * W0 + h * w * W0)
        mm += v.num_layers * (2 * L * (3 * Q * D + Q * D + 2 * D * I) + 4 * L * L * Q)
        mm += 2 * N * (v.merge_size ** 2 * D * D + v.merge_size * D * K)
    fwd = embed + mm
    return fwd, (0.0 if cfg.freeze_vision else embed + 2 * mm)


def model_flops(cfg, seq_length: int, attention: str = "causal",
                image_share: float = DEFAULT_IMAGE_SHARE, frozen: bool = False) -> ModelFlops:
    """Per-token forward and backward FLOPs of the whole model (LM head included) at `seq_length`; with
    model.vision.enabled the tower and projector too, for `image_share` of the tokens being image features.
    `frozen` (peft=lora's base): the weight GEMMs' backward is their input gradient (`frozen_base`), the vision
    tower's nothing."""
    cats, per_layer = {}, []
    fwd = bwd = 0.0
    terms_all = []
    for i in range(cfg.num_layers):
        terms = layer_flop_terms(cfg, i, seq_length, attention)
        per_layer.append(sum(t.forward for t in terms))
        terms_all += terms
    terms_all.append(_mm("lm_head", "lm_head", 2 * cfg.hidden_size * cfg.vocab_size))
    vision = vision_flop_terms(cfg, seq_length, image_share)
    if frozen:
        terms_all = frozen_base(terms_all)
        vision = [FlopTerm(t.name, t.category, t.forward, 0.0) for t in vision]
    terms_all += vision
    for t in terms_all:
        c = cats.setdefault(t.category, [0.0, 0.0])
        c[0] += t.forward
        c[1] += t.backward
        fwd += t.forward
        bwd += t.backward
    return ModelFlops(seq_length, attention, fwd, bwd, cats, per_layer)


def decode_flops_per_token(cfg, context: int) -> float:
    """Forward FLOPs of one generated token at `context` tokens of history: the projections, experts and LM
    head as in training; KDA as the recurrence (predict, correct and read the [K, V] state per head:
    3 x 2 K V); MLA in the absorbed form over the cached latents (q folded into the latent space, scores
    over [c_kv ; k_rope] and the context over c_kv for every cached token, the value lift)."""
    total = 2 * cfg.hidden_size * cfg.vocab_size
    for i in range(cfg.num_layers):
        for t in layer_flop_terms(cfg, i, 1, "causal"):
            if t.name.startswith("kda.") and not t.name.endswith("_proj"):
                continue
            if t.name == "mla.attention":
                continue
            total += t.forward
        if cfg.layer_types()[i] == "kda":
            total += cfg.kda_num_heads * 3 * 2 * cfg.kda_head_dim * cfg.kda_head_dim
        else:
            H, N, L, R, V = (cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                             cfg.v_head_dim)
            total += H * (2 * N * L + 2 * (L + R) * context + 2 * L * context + 2 * V * L)
    return float(total)
