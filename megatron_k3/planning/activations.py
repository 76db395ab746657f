"""Activation memory of one micro-batch, layer by layer: the tensors autograd keeps for the backward pass.

Each layer is a list of `ActTerm`s, elements per token with a dtype class and the token count they scale
with. Two kernel profiles:

* "eager" is what this repository runs on CPU (and on GPU without fused kernels), read off the code: the
  torch chunked KDA keeps its chunk matrices, the attention (torch's CPU flash kernel behind
  F.scaled_dot_product_attention, the values padded to the key dim by ops.attention) keeps the additive [T, T]
  document mask of the packed row and the log-sum-exp, not the probabilities, the depth mix keeps a stacked fp32
  copy of its sources, SiTU keeps its fp32 intermediates.
* "fused" is the accelerator path a 2.8T run uses: fla's chunk_kda (keeps q, k, v, g, beta, the
  intra-chunk matrices and chunk states), flash attention (keeps q, k, v, o and the log-sum-exp), fused
  norms, SiTU and depth mix (keep their inputs and per-row statistics).

Token counts: `n` tokens of a micro-batch on this context-parallel rank go through the mixers (gathered
over TP under sequence parallelism); `n / tp` through the sequence-sharded parts (norms, depth mixes, the
routed MoE branch) when sequence parallelism is on. Under context parallelism (cp > 1, parallel/context.py)
two more classes appear: "gathered", the whole micro-batch sequence (n * cp tokens: MLA's all-gathered latent
and the keys and values expanded from it on every CP rank), and "span", local query x visible key pairs of
the eager attention (each query block attends to the keys up to its last position; with the zigzag layout a
rank's queries see (2cp+1)/(4cp) of the sequence on average). KDA under CP runs its chunk kernel at width
V + K (outputs [o0 | q~], states [B | A]): the terms that carry the value width grow by K.
A term's `cheap` names the selective-recomputation module (megatron_k3.parallel.recompute) that rebuilds it in the
backward (elementwise work, the attention/KDA core), the matmul inputs stay; a `region` term is what that module's
checkpointed region holds instead (its inputs), kept only when the module is recomputed.

The vision tower (`vision_terms`, model.vision.enabled) keeps its terms per patch (per feature for the projector),
unsharded: its parameters are replicated over TP and its work is split by whole media, so each TP rank keeps the
terms of the patches it encodes (memory.vision_activations counts the busiest rank's share, flops.vision_tp_share:
1/tp when the images divide evenly, all of them with one image per micro-batch); sequence parallelism does not
split them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

__all__ = ["ActTerm", "kept", "layer_terms", "head_terms", "attn_res_sources", "term_bytes", "vision_terms"]

# dtype classes: "a" = activation dtype (4 B fp32, 2 B under bf16 autocast), "f" = always fp32, "i" = int64
_BYTES = {"f": 4, "i": 8}


@dataclass(frozen=True)
class ActTerm:
    name: str
    category: str  # attn_res, norm, kda, kda_states, mla, mla_latent, moe, dense_ffn, head
    per_token: float  # elements per token
    dtype: str = "a"
    tokens: str = "seq"  # "seq": n / tp under sequence parallelism (else n); "full": n; "row": n, with
    # per_token scaled by the packed row length (the eager attention square); "gathered": n * cp; "span": n, with
    # per_token scaled by the keys a local query sees under context parallelism
    cheap: str = ""  # the selective-recomputation module (parallel.recompute.MODULES) that rebuilds it; "": kept
    region: str = ""  # kept only when that module is recomputed: the input its checkpointed region holds


def kept(t: ActTerm, recomputed: frozenset) -> bool:
    """Whether term `t` is kept for the backward when the module kinds `recomputed` are (selective recomputation;
    empty: none)."""
    return (not t.cheap or t.cheap not in recomputed) and (not t.region or t.region in recomputed)


def term_bytes(t: ActTerm, n: float, tp: int, sp: bool, act_bytes: int, row: float, cp: int = 1) -> float:
    tokens = n / tp if (t.tokens == "seq" and sp and tp > 1) else n * cp if t.tokens == "gathered" else n
    per_token = t.per_token * (row if t.tokens == "row" else cp_key_span(n * cp, cp) if t.tokens == "span" else 1.0)
    return tokens * per_token * (act_bytes if t.dtype == "a" else _BYTES[t.dtype])


def cp_key_span(T: float, cp: int) -> float:
    """Average keys per query of a rank under zigzag context parallelism (chunk i of c = T / 2cp tokens
    attends to (i + 1) c keys; rank r holds chunks r and 2cp-1-r): (2cp + 1) T / (4cp)."""
    return (2 * cp + 1) * T / (4 * cp)


def attn_res_sources(cfg) -> tuple:
    """(sources of the pre-mixer mix, sources of the pre-FFN mix) per layer, and of the output mix; 0 = no mix.
    Follows megatron_k3.model.decoder: b_0 is the embedding, a block is frozen at every block_size-th layer."""
    if not cfg.attn_res:
        return [(0, 0)] * cfg.num_layers, 0
    blocks, out = 0, []
    for i in range(cfg.num_layers):
        pre = blocks + 1 if blocks else 0
        if i % cfg.attn_res_block_size == 0:
            blocks += 1
        out.append((pre, blocks + 1))
    return out, blocks + 1


def _mix(ns: int, D: int, kernels: str, what: str) -> list:
    if not ns:
        return []
    if kernels == "eager":  # stacked fp32 sources, their normalised copy, rms and softmax weights; recomputed, the
        # region holds its sources, of which the running partial sum is the one nothing else keeps
        return [ActTerm(f"{what}_depth_mix", "attn_res", ns * (2 * D + 2), "f", "seq", "attn_res"),
                ActTerm(f"{what}_depth_mix_partial", "attn_res", D, "a", "seq", region="attn_res")]
    return [ActTerm(f"{what}_depth_mix", "attn_res", D, "a", "seq"),  # the new partial sum, by reference
            ActTerm(f"{what}_depth_mix_stats", "attn_res", ns, "f", "seq")]


def _norm(D: int, kernels: str, what: str) -> list:
    """RMSNorm feeding a linear: eager keeps x (fp32), rms, the normalised x; the linear keeps the output.
    Recomputed (`layernorm`), its region holds its input."""
    if kernels == "eager":
        return [ActTerm(what, "norm", D, "f", "seq", "layernorm"),
                ActTerm(what + "_rms", "norm", 1, "f", "seq", "layernorm"),
                ActTerm(what + "_normed", "norm", D, "a", "seq", "layernorm"),
                ActTerm(what + "_input", "norm", D, "a", "seq", region="layernorm")]
    return [ActTerm(what, "norm", D, "a", "seq"), ActTerm(what + "_rms", "norm", 1, "f", "seq")]


def _kda(cfg, tp: int, kernels: str, cp: int = 1) -> list:
    D, K, R, C = cfg.hidden_size, cfg.kda_head_dim, cfg.decay_rank, cfg.kda_chunk_size
    H = cfg.kda_num_heads / tp
    HK = H * K
    t = [ActTerm("kda_input", "kda", D, "a", "full")]
    if cp > 1:  # the chunk kernel at width V + K: [V | K Gamma] and [U | W] one K wider, the [o0 | q~] output
        # kept for the correction, and K more columns in every chunk state
        t += [ActTerm("kda_cp_transition", "kda", H * (2 * K if kernels == "eager" else 0) + 2 * HK, "f", "full",
                      "core_attn"),
              ActTerm("kda_cp_states", "kda_states", H * K * K / C * (3 if kernels == "eager" else 1), "f", "full",
                      "core_attn")]
    if cfg.kda_output_gate == "lowrank":
        t.append(ActTerm("kda_gate_lowrank", "kda", K, "a", "full"))
    if kernels == "eager":
        S = C
        while S > 1 and S % 2 == 0:
            S //= 2
        levels = int(round(math.log2(C // S))) if C // S > 1 else 0
        t += [
            ActTerm("kda_conv", "kda", 9 * HK, "a", "full", "core_attn"),  # q/k/v: projection, padded, pre-SiLU
            ActTerm("kda_qk_l2norm", "kda", 2 * (HK + H), "f", "full", "core_attn"),
            ActTerm("kda_decay_lowrank", "kda", R, "a", "full"),
            ActTerm("kda_gate_decay", "kda", 2 * HK + H, "f", "full", "core_attn"),  # sigmoid in/out, beta
            # the chunked op: chunk copies of k and (q, k); 3 K per sibling-block level; the C x C matrices;
            # gamma, [V | K Gamma], [U | W], the tail decays and their transposed copy, scaled q, P
            ActTerm("kda_chunk_vectors", "kda", H * (3 * K + 3 * K * levels + 9 * K), "f", "full", "core_attn"),
            ActTerm("kda_chunk_matrices", "kda", H * (4 * C + 1), "f", "full", "core_attn"),
            ActTerm("kda_states", "kda_states", H * (K * K + 2 * K * K) / C, "f", "full", "core_attn"),
            ActTerm("kda_out_norm_gate", "kda", 4 * HK + H, "f", "full", "core_attn"),
            ActTerm("kda_o_proj_input", "kda", HK, "a", "full"),
            # recomputed (core_attn), the region holds the projections' outputs: q, k, v, decay, gate, beta
            ActTerm("kda_core_inputs", "kda", 5 * HK + H, "a", "full", region="core_attn"),
        ]
    else:
        t += [
            ActTerm("kda_conv", "kda", 3 * HK, "a", "full", "core_attn"),  # conv inputs
            ActTerm("kda_qkv", "kda", 3 * HK, "a", "full"),
            ActTerm("kda_decay_lowrank", "kda", R, "a", "full"),
            ActTerm("kda_g_beta", "kda", HK + H, "f", "full"),
            ActTerm("kda_chunk_matrices", "kda", 2 * H * C, "f", "full", "core_attn"),
            ActTerm("kda_states", "kda_states", H * K * K / C, "f", "full", "core_attn"),
            ActTerm("kda_out_norm_gate", "kda", 2 * HK, "a", "full"),
            ActTerm("kda_out_rms", "kda", H, "f", "full"),
            ActTerm("kda_o_proj_input", "kda", HK, "a", "full"),
        ]
    return t


def _mla(cfg, tp: int, kernels: str, cp: int = 1) -> list:
    D, L, Rr, N, Vd, ql = (cfg.hidden_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                           cfg.v_head_dim, cfg.q_lora_rank)
    H = cfg.mla_num_heads / tp
    qk = N + Rr
    t = [ActTerm("mla_input", "mla", D, "a", "full")]
    eager = kernels == "eager"
    if ql:
        t.append(ActTerm("mla_q_latent", "mla", (3 * ql + 1) if eager else (2 * ql + 1), "a", "full"))
    t.append(ActTerm("mla_latent", "mla_latent", (L + Rr) + 1 + (2 * L if eager else L), "a", "full"))
    gate = 2 * H * Vd if cfg.mla_output_gate else 0
    vw = max(qk, Vd)  # eager: the values zero-padded to the key dim, so torch's CPU flash kernel runs (ops.attention)
    if cp > 1:  # the whole sequence's latent, and the keys and values expanded from it, on every CP rank
        t.append(ActTerm("mla_latent_gathered", "mla_latent", L + Rr, "a", "gathered"))
        if eager:  # torch's CPU flash attention per query block: q; each block's copy of the keys and the padded
            # values it sees ((2cp+1)/2cp of the sequence per rank); the block's additive mask over the keys it
            # sees (in the activation dtype, shared by the heads), the log-sum-exp and the padded output
            t += [ActTerm("mla_q", "mla", H * qk, "a", "full"),
                  ActTerm("mla_kv_gathered", "mla", H * (qk + vw) * (2 * cp + 1) / (2 * cp), "a", "gathered"),
                  ActTerm("mla_mask", "mla", 1, "a", "span", "core_attn"),
                  ActTerm("mla_lse", "mla", H, "f", "full", "core_attn"),
                  ActTerm("mla_attn_out", "mla", H * vw, "a", "full", "core_attn"),
                  ActTerm("mla_out_gate", "mla", gate + H * Vd, "a", "full")]
        else:  # flash attention keeps q, o, lse locally and the gathered keys and values
            t += [ActTerm("mla_qo", "mla", H * qk + H * Vd, "a", "full"),
                  ActTerm("mla_kv_gathered", "mla", H * (qk + Vd), "a", "gathered"),
                  ActTerm("mla_lse", "mla", H, "f", "full"),
                  ActTerm("mla_out_gate", "mla", gate + H * Vd, "a", "full")]
        return t
    if eager:  # torch's CPU flash attention over the packed row (what F.scaled_dot_product_attention runs on the
        # CPU with a document mask, fp32 or bf16, once the values are padded to the key dim): q, k, the padded v,
        # the padded output, the log-sum-exp and the additive [row, row] mask in the activation dtype, shared by the
        # heads; no probabilities; the output cut back (the gate's input below)
        t += [ActTerm("mla_qkv", "mla", 2 * H * qk + H * vw, "a", "full"),
              ActTerm("mla_mask", "mla", 1, "a", "row", "core_attn"),
              ActTerm("mla_lse", "mla", H, "f", "full", "core_attn"),
              ActTerm("mla_attn_out", "mla", H * vw, "a", "full", "core_attn"),
              ActTerm("mla_out_gate", "mla", gate + H * Vd, "a", "full")]
    else:
        t += [ActTerm("mla_qkvo", "mla", 2 * H * qk + 2 * H * Vd, "a", "full"),
              ActTerm("mla_lse", "mla", H, "f", "full"),
              ActTerm("mla_out_gate", "mla", gate + H * Vd, "a", "full")]
    return t


def _moe(cfg, tp: int, kernels: str) -> list:
    D, W, I, E, k = cfg.hidden_size, cfg.expert_width, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    eager = kernels == "eager"
    t = [ActTerm("moe_input", "moe", D, "a", "seq"),
         ActTerm("router_scores", "moe", E + k + 1, "f", "seq"),
         ActTerm("router_indices", "moe", 2 * k, "i", "seq")]
    t.append(ActTerm("expert_inputs", "moe", k * W, "a", "seq"))
    if eager:  # the GLU Function keeps three fp32 tensors per row (situ: tanh(g/b1), sigmoid(g), tanh(u/b2)), the
        # down projection fused with the combine its input, the routing weights and token indices (int64 = 2 x 4 B)
        t += [ActTerm("expert_situ", "moe", 3 * k * I, "f", "seq", "moe_act"),
              ActTerm("expert_gate_up", "moe", 2 * k * I, "a", "seq", region="moe_act"),  # kept instead
              ActTerm("expert_hidden", "moe", k * I, "a", "seq"),
              ActTerm("expert_combine", "moe", 3 * k, "f", "seq")]
    else:
        t += [ActTerm("expert_gate_up", "moe", 2 * k * I, "a", "seq"),
              ActTerm("expert_hidden", "moe", k * I, "a", "seq", "moe_act"),
              ActTerm("expert_outputs", "moe", k * W + k, "a", "seq")]
    if cfg.moe_latent_norm:
        t.append(ActTerm("latent_norm", "moe", (2 * W + 1) if eager else (W + 1), "f", "seq",
                         "layernorm" if eager else ""))
        if eager:
            t.append(ActTerm("latent_norm_input", "moe", W, "a", "seq", region="layernorm"))
    if cfg.moe_latent_size:
        t.append(ActTerm("latent_up_input", "moe", W, "a", "seq"))
    if cfg.num_shared_experts:
        Is = cfg.shared_ffn_size / tp
        t += _glu("shared", Is, D, eager, "moe")
    return t


def _glu(what: str, I: float, D: int, eager: bool, cat: str) -> list:
    if eager:
        return [ActTerm(f"{what}_input", cat, D, "a", "full"),
                ActTerm(f"{what}_situ", cat, 3 * I, "f", "full", "mlp_act"),  # the GLU Function's three fp32
                ActTerm(f"{what}_gate_up", cat, 2 * I, "a", "full", region="mlp_act"),  # tensors; or its inputs
                ActTerm(f"{what}_hidden", cat, I, "a", "full")]
    return [ActTerm(f"{what}_input", cat, D, "a", "full"),
            ActTerm(f"{what}_gate_up", cat, 2 * I, "a", "full"),
            ActTerm(f"{what}_hidden", cat, I, "a", "full", "mlp_act")]


@functools.lru_cache(maxsize=1 << 14)
def layer_terms(cfg, layer_idx: int, tp: int, kernels: str, sources: tuple, cp: int = 1) -> tuple:
    """Activation terms of decoder layer `layer_idx` (depth mixes, norms, mixer, FFN) on one TP rank of a
    context-parallel group of `cp` (memoised per config value and arguments: a search asks for each hundreds of
    times; read-only)."""
    if kernels not in ("eager", "fused"):
        raise ValueError(f"kernels must be 'eager' or 'fused', got {kernels!r}")
    D = cfg.hidden_size
    pre, post = sources
    t = _mix(pre, D, kernels, "pre_mixer") + _norm(D, kernels, "input_norm")
    t += _kda(cfg, tp, kernels, cp) if cfg.layer_types()[layer_idx] == "kda" else _mla(cfg, tp, kernels, cp)
    t += _mix(post, D, kernels, "pre_ffn") + _norm(D, kernels, "post_attention_norm")
    if cfg.ffn_types()[layer_idx] == "moe":
        t += _moe(cfg, tp, kernels)
    else:
        t += _glu("dense_ffn", cfg.dense_intermediate_size / tp, D, kernels == "eager", "dense_ffn")
    return tuple(t)


def head_terms(cfg, tp: int, kernels: str, out_sources: int) -> tuple:
    """(kept terms, transient terms) of the output mix, final norm, LM head and loss on the last stage.
    Transient: the loss gradient over the vocabulary shard, alive at the start of the backward."""
    D, V = cfg.hidden_size, cfg.vocab_size / tp
    kept = _mix(out_sources, D, kernels, "output") + _norm(D, kernels, "final_norm")
    # the cross-entropy keeps its fp32 log-probabilities; the logits are not kept: the Trainer (and planning.dry_run's
    # step) keeps only the loss of the model's output for the backward (until 2026-12-06 the eager profile counted
    # them, which the CPU runs never held)
    kept += [ActTerm("lm_head_input", "head", D, "a", "full"),
             ActTerm("log_probs", "head", V, "f", "full")]
    transient = [ActTerm("loss_grad", "head", 2 * V, "f", "full")]
    return kept, transient


def vision_terms(cfg, kernels: str, image_patches: int) -> tuple:
    """(per encoder block, per patch; the rest of the tower, per patch; the projector, per feature) ActTerms the
    vision tower keeps (model/vision.py): RMSNorms, the q/k/v/o of its attention (flash: q, k, v, o and the
    log-sum-exp; eager: q and k rotated in fp32, and the [L, L] probabilities of each head over the image's
    `image_patches` patches), the GELU MLP; the patch embedding's input pixels (for its weight's gradient), the final
    norm; the projector's two linears, its GELU and output norm. `cheap`: recomputed under selective recomputation."""
    v = cfg.vision
    D, Q, I, H, K = v.hidden_size, v.qkv_hidden_size, v.intermediate_size, v.num_heads, cfg.hidden_size
    eager = kernels == "eager"
    block = _norm(D, kernels, "vision_norm0") + [ActTerm("vision_qkv_input", "vision", D, "a", "full")]
    if eager:
        block += [ActTerm("vision_rope", "vision", 2 * Q, "f", "full", "core_attn"),
                  ActTerm("vision_qkv", "vision", 3 * Q, "a", "full"),
                  ActTerm("vision_probs", "vision", H * image_patches, "f", "full", "core_attn"),
                  ActTerm("vision_o", "vision", Q, "a", "full")]
    else:
        block += [ActTerm("vision_qkvo", "vision", 4 * Q, "a", "full"),
                  ActTerm("vision_lse", "vision", H, "f", "full")]
    block += _norm(D, kernels, "vision_norm1") + [
        ActTerm("vision_fc0_input", "vision", D, "a", "full"),
        ActTerm("vision_gelu_input", "vision", I, "a", "full"),
        ActTerm("vision_fc1_input", "vision", I, "a", "full")]
    tower = [ActTerm("vision_pixels", "vision", 3 * v.patch_size ** 2, "a", "full")]
    tower += _norm(D, kernels, "vision_final_norm")
    W = v.merge_size * D
    projector = [ActTerm("mm_projector_input", "vision", W, "a", "full"),
                 ActTerm("mm_projector_gelu_input", "vision", W, "a", "full"),
                 ActTerm("mm_projector_fc1_input", "vision", W, "a", "full")]
    projector += _norm(K, kernels, "mm_projector_norm")
    return block, tower, projector
