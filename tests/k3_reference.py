"""An independent Kimi K3 reference for tests/test_interop.py: a checkpoint writer in the public K3 layout and a
plain-torch forward, both written from ../shared/design/MODEL.md (sections 0-4 and 7.1) and the K3 config.json
keys. It imports nothing from megatron_k3: its MXFP4 quantiser (NeMo's rule, scale 2^ceil(log2(amax / 6)),
round half to even) and packing, its layer schedule, AttnRes, KDA recurrence, MLA, router and LatentMoE are its own.

Legend: T tokens, D hidden, H heads, K head dim, E experts, L latent.
What it covers: every tensor kind the K3 text layout carries (embedding, LM head, final norm, output AttnRes;
per layer: input/post-attention norms and both AttnRes query/norm pairs; KDA q/k/v/f_a/f_b/b/g(full rank)/o
projections, fp32 q/k/v conv weights, the 128-padded fp32 A_log, fp32 dt_bias and o_norm; Gated MLA with q
compression (q_a, q_a_layernorm, q_b, kv_a_proj_with_mqa, kv_a_layernorm, kv_b, g, o); the dense SiTU MLP; per
MoE layer the router weight and fp32 correction bias, routed_expert_down/up_proj, routed_expert_norm, the fused
shared experts and the routed experts as weight_packed / weight_scale). Not covered: the low-rank output gate and
softplus decay (K3 uses neither), the vision tower, the MTP layer. Non-fp32 tensors are stored in bf16 as the
released checkpoint; the forward uses exactly the stored values, in float64.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

PREFIX = "language_model."
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
FP32 = (".A_log", ".dt_bias", "_conv1d.weight", ".o_norm.weight", ".e_score_correction_bias")

# A tiny K3: MLA at layers 4 and 6 (1-based), the rest KDA; layer 0 dense; AttnRes blocks of 2 layers.
TEXT_CONFIG = {
    "model_type": "kimi_linear", "architectures": ["KimiK3ForCausalLM"],
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 6,
    "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_act": "situ", "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "moe_intermediate_size": 64, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2, "routed_scaling_factor": 1.5,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_expert_group": 1, "topk_group": 1,
    "topk_method": "noaux_tc", "routed_expert_hidden_size": 64, "latent_moe_use_norm": True,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "mla_use_nope": True, "mla_use_output_gate": True,
    "linear_attn_config": {"head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 4,
                           "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6],
                           "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    "attn_res_block_size": 2, "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "num_nextn_predict_layers": 0,
    "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized",
                                                          "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                                                          "weights": {"num_bits": 4, "type": "float",
                                                                      "group_size": 32}}}},
}


# ------------------------------------------------------------------------------------------------ MXFP4
def mxfp4_pack(w: torch.Tensor):
    """[out, in] -> (packed uint8 [out, in/2], scales uint8 [out, in/32]): per block of 32 along `in`,
    X = 2^ceil(log2(amax / 6)) (0 for an all-zero block), codes = nearest E2M1 magnitude of |w| / X (ties to the
    even code), bit 3 = sign, even column in the low nibble."""
    w = w.double()
    out_f, in_f = w.shape
    blocks = w.reshape(out_f, in_f // 32, 32)
    amax = blocks.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = blocks.abs() / torch.exp2(exp)[..., None]
    dist = (scaled[..., None] - E2M1).abs()  # [out, n, 32, 8]
    best = dist.min(-1, keepdim=True).values
    tie_rank = torch.arange(8) % 2  # among equally near codes prefer an even one (round half to even)
    code = torch.where(dist == best, tie_rank.double(), 9.0).argmin(-1)
    code = code | (torch.signbit(blocks).long() << 3)
    code = code.reshape(out_f, in_f)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def mxfp4_unpack(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    p = packed.long()
    codes = torch.stack([p & 0xF, p >> 4], -1).reshape(p.shape[0], -1)
    vals = E2M1[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
    scale = torch.exp2(scales.double() - 127).repeat_interleave(32, dim=1)
    return vals * scale


# ------------------------------------------------------------------------------------------------ writer
def _layer_types(c):
    full = set(c["linear_attn_config"]["full_attn_layers"])
    return ["mla" if i + 1 in full else "kda" for i in range(c["num_hidden_layers"])]


def draws(seed: int) -> tuple:
    """(rnd, lin, norm) drawing from one generator seeded `seed`: N(0, std^2) of a shape, a projection [o, i] ~
    N(0, 1/i), a norm weight 1 + 0.1 N."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    def lin(o, i):
        return rnd(o, i, std=i ** -0.5)

    def norm(n):
        return 1 + rnd(n, std=0.1)

    return rnd, lin, norm


def random_checkpoint(c: dict = TEXT_CONFIG, seed: int = 0) -> dict:
    """K3-layout tensors (without the prefix) with random values: projections ~ N(0, 1/fan_in), norm weights
    1 + 0.1 N, non-zero AttnRes queries, router biases, decays and convolutions."""
    rnd, lin, norm = draws(seed)

    D, V = c["hidden_size"], c["vocab_size"]
    lac = c["linear_attn_config"]
    H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    HK = H * K
    Hm, N, R, Vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    E, I, L = c["num_experts"], c["moe_intermediate_size"], c["routed_expert_hidden_size"]
    S = I * c["num_shared_experts"]
    t = {"model.embed_tokens.weight": rnd(V, D), "model.norm.weight": norm(D), "lm_head.weight": lin(V, D),
         "model.output_attn_res_proj.weight": rnd(1, D, std=0.1), "model.output_attn_res_norm.weight": norm(D)}
    for i, mixer in enumerate(_layer_types(c)):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        if mixer == "kda":
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                t[a + n + ".weight"] = lin(HK, D)
            for n in "qkv":
                t[a + n + "_conv1d.weight"] = rnd(HK, 1, W, std=0.5)
            t[a + "f_a_proj.weight"] = lin(K, D)
            t[a + "f_b_proj.weight"] = lin(HK, K)
            t[a + "b_proj.weight"] = lin(H, D)
            pad = -(-H // 128) * 128
            t[a + "A_log"] = torch.cat([rnd(H, std=0.5), torch.zeros(pad - H)])
            t[a + "dt_bias"] = rnd(HK, std=0.5)
            t[a + "o_norm.weight"] = norm(K)
            t[a + "o_proj.weight"] = lin(D, HK)
        else:
            q = c["q_lora_rank"]
            t[a + "q_a_proj.weight"] = lin(q, D)
            t[a + "q_a_layernorm.weight"] = norm(q)
            t[a + "q_b_proj.weight"] = lin(Hm * (N + R), q)
            t[a + "kv_a_proj_with_mqa.weight"] = lin(c["kv_lora_rank"] + R, D)
            t[a + "kv_a_layernorm.weight"] = norm(c["kv_lora_rank"])
            t[a + "kv_b_proj.weight"] = lin(Hm * (N + Vd), c["kv_lora_rank"])
            t[a + "g_proj.weight"] = lin(Hm * Vd, D)
            t[a + "o_proj.weight"] = lin(D, Hm * Vd)
        if i < c["first_k_dense_replace"]:
            Id = c["intermediate_size"]
            t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = lin(Id, D), lin(Id, D)
            t[p + "mlp.down_proj.weight"] = lin(D, Id)
        else:
            b = p + "block_sparse_moe."
            t[b + "gate.weight"] = lin(E, D)
            t[b + "gate.e_score_correction_bias"] = rnd(E, std=0.05)
            t[b + "routed_expert_down_proj.weight"] = lin(L, D)
            t[b + "routed_expert_up_proj.weight"] = lin(D, L)
            t[b + "routed_expert_norm.weight"] = norm(L)
            t[b + "shared_experts.gate_proj.weight"] = lin(S, D)
            t[b + "shared_experts.up_proj.weight"] = lin(S, D)
            t[b + "shared_experts.down_proj.weight"] = lin(D, S)
            for e in range(E):
                for n, (o, k) in (("w1", (I, L)), ("w3", (I, L)), ("w2", (L, I))):
                    packed, scale = mxfp4_pack(lin(o, k))
                    t[f"{b}experts.{e}.{n}.weight_packed"] = packed
                    t[f"{b}experts.{e}.{n}.weight_scale"] = scale
        t[p + "input_layernorm.weight"] = norm(D)
        t[p + "post_attention_layernorm.weight"] = norm(D)
        for s in ("self_attention_res", "mlp_res"):
            t[f"{p}{s}_proj.weight"] = rnd(1, D, std=0.1)
            t[f"{p}{s}_norm.weight"] = norm(D)
    return {k: v if v.dtype == torch.uint8 else v.to(torch.float32 if k.endswith(FP32) else torch.bfloat16)
            for k, v in t.items()}


def write_checkpoint(path, tensors: dict, c: dict = TEXT_CONFIG, shards: int = 2):
    """config.json (the vision-language form: text under text_config) and `shards` safetensors files with an
    index, the text tensors under `language_model.`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "kimi_k3",
                                                  "architectures": ["KimiK3ForConditionalGeneration"],
                                                  "text_config": c}, indent=1))
    keys = sorted(tensors)
    per = math.ceil(len(keys) / shards)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {PREFIX + k: tensors[k].contiguous() for k in keys[s * per:(s + 1) * per]}
        save_file(part, str(path / name))
        weight_map.update(dict.fromkeys(part, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ------------------------------------------------------------------------------------------------ forward
def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _situ_glu(gate, up, b1, b2):
    return b1 * torch.tanh(gate / b1) * torch.sigmoid(gate) * (b2 * torch.tanh(up / b2))


def _attn_res(sources, w_query, w_norm, eps):
    """MODEL.md 1.1: softmax over depth of <RMS(v_i) * gamma, w>; the raw sources mixed with those weights."""
    v = torch.stack(sources)  # [N, T, D]
    logits = ((v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)) * w_norm * w_query).sum(-1)
    return (torch.softmax(logits, 0)[..., None] * v).sum(0)


def _short_conv(x_TC, w_CW):
    """y_t[c] = sum_j w[c, j] x_{t-W+1+j}[c] (zero before the start), then SiLU."""
    T, W = x_TC.shape[0], w_CW.shape[1]
    xp = torch.cat([x_TC.new_zeros(W - 1, x_TC.shape[1]), x_TC])
    y = sum(w_CW[:, j] * xp[j:j + T] for j in range(W))
    return F.silu(y)


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _kda(x, t, a, c):
    lac = c["linear_attn_config"]
    H, K = lac["num_heads"], lac["head_dim"]
    T = x.shape[0]
    q = _l2(_short_conv(x @ t[a + "q_proj.weight"].T, t[a + "q_conv1d.weight"][:, 0]).view(T, H, K))
    k = _l2(_short_conv(x @ t[a + "k_proj.weight"].T, t[a + "k_conv1d.weight"][:, 0]).view(T, H, K))
    v = _short_conv(x @ t[a + "v_proj.weight"].T, t[a + "v_conv1d.weight"][:, 0]).view(T, H, K)
    z = (x @ t[a + "f_a_proj.weight"].T @ t[a + "f_b_proj.weight"].T + t[a + "dt_bias"]).view(T, H, K)
    A = t[a + "A_log"][:H].exp()[:, None]
    g = lac["gate_lower_bound"] * torch.sigmoid(A * z)  # log-decay per channel, in (lb, 0)
    beta = torch.sigmoid(x @ t[a + "b_proj.weight"].T)  # [T, H]
    S = x.new_zeros(H, K, K)
    outs = []
    for s in range(T):  # decay, predict, correct, read (MODEL.md 2.1)
        S = g[s].exp()[..., None] * S
        pred = torch.einsum("hkv,hk->hv", S, k[s])
        S = S + beta[s][:, None, None] * torch.einsum("hk,hv->hkv", k[s], v[s] - pred)
        outs.append(torch.einsum("hkv,hk->hv", S, q[s] * K ** -0.5))
    o = torch.stack(outs)  # [T, H, K]
    o = _rms(o, t[a + "o_norm.weight"], c["rms_norm_eps"]) * torch.sigmoid((x @ t[a + "g_proj.weight"].T).view(T, H, K))
    return o.reshape(T, H * K) @ t[a + "o_proj.weight"].T


def _mla(x, t, a, c):
    T = x.shape[0]
    H, N, R, Vd, Lkv = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                        c["kv_lora_rank"])
    eps = 1e-6  # the latent norms use the RMSNorm default in NeMo's and transformers' Kimi MLA
    q = (_rms(x @ t[a + "q_a_proj.weight"].T, t[a + "q_a_layernorm.weight"], eps) @ t[a + "q_b_proj.weight"].T)
    q = q.view(T, H, N + R)
    ckv = x @ t[a + "kv_a_proj_with_mqa.weight"].T
    c_lat, k_r = ckv[:, :Lkv], ckv[:, Lkv:]
    kv = (_rms(c_lat, t[a + "kv_a_layernorm.weight"], eps) @ t[a + "kv_b_proj.weight"].T).view(T, H, N + Vd)
    k = torch.cat([kv[..., :N], k_r[:, None, :].expand(T, H, R)], -1)
    v = kv[..., N:]
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(N + R)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shv->thv", torch.softmax(scores, -1), v).reshape(T, H * Vd)
    return (o * torch.sigmoid(x @ t[a + "g_proj.weight"].T)) @ t[a + "o_proj.weight"].T


def _moe(x, t, b, c):
    k = c["num_experts_per_token"]
    b1, b2 = c["activation_situ_beta"], c["activation_situ_linear_beta"]
    s = torch.sigmoid(x @ t[b + "gate.weight"].T)  # [T, E]
    idx = (s + t[b + "gate.e_score_correction_bias"]).topk(k, -1).indices
    w = s.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * c["routed_scaling_factor"]
    z = x @ t[b + "routed_expert_down_proj.weight"].T
    r = torch.zeros_like(z)
    for n in range(x.shape[0]):
        for j in range(k):
            e = f"{b}experts.{int(idx[n, j])}."
            h = _situ_glu(t[e + "w1"] @ z[n], t[e + "w3"] @ z[n], b1, b2)
            r[n] += w[n, j] * (t[e + "w2"] @ h)
    y = _rms(r, t[b + "routed_expert_norm.weight"], c["rms_norm_eps"]) @ t[b + "routed_expert_up_proj.weight"].T
    sh = b + "shared_experts."
    h = _situ_glu(x @ t[sh + "gate_proj.weight"].T, x @ t[sh + "up_proj.weight"].T, b1, b2)
    return y + h @ t[sh + "down_proj.weight"].T


def decode(tensors: dict, dtype=torch.float64) -> dict:
    """Checkpoint tensors (prefix stripped) -> values in dtype, experts as `...experts.{e}.w{n}` matrices."""
    t = {}
    for key, v in tensors.items():
        if key.endswith(".weight_packed"):
            base = key[: -len(".weight_packed")]
            t[base] = mxfp4_unpack(v, tensors[base + ".weight_scale"]).to(dtype)
        elif not key.endswith(".weight_scale"):
            t[key] = v.to(dtype)
    return t


@torch.no_grad()
def forward(tensors: dict, ids_BT: torch.Tensor | None, c: dict = TEXT_CONFIG, dtype=torch.float64,
            embeds: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, T, V] of the K3 text model in `tensors` (checkpoint names, prefix stripped), computed in dtype.
    `embeds` [B, T, D] (optional, in place of ids_BT): start from these input embeddings instead of the token
    lookup (the vision-language reference, tests/k3_vl_reference.py, passes text and media rows merged)."""
    t = decode(tensors, dtype)
    eps, bs = c["rms_norm_eps"], c["attn_res_block_size"]
    b1, b2 = c["activation_situ_beta"], c["activation_situ_linear_beta"]
    rows = [t["model.embed_tokens.weight"][ids] for ids in ids_BT] if embeds is None else embeds.to(dtype)
    out = []
    for x in rows:
        blocks, p = [], x
        for i, mixer in enumerate(_layer_types(c)):  # MODEL.md section 1, line by line
            pre = f"model.layers.{i}."
            x_attn = p if not blocks else _attn_res(blocks + [p], t[pre + "self_attention_res_proj.weight"][0],
                                                    t[pre + "self_attention_res_norm.weight"], eps)
            if i % bs == 0:
                blocks.append(p)
                p = None
            h = _rms(x_attn, t[pre + "input_layernorm.weight"], eps)
            a = (_kda if mixer == "kda" else _mla)(h, t, pre + "self_attn.", c)
            p = a if p is None else p + a
            x_mlp = _attn_res(blocks + [p], t[pre + "mlp_res_proj.weight"][0], t[pre + "mlp_res_norm.weight"], eps)
            h = _rms(x_mlp, t[pre + "post_attention_layernorm.weight"], eps)
            if i < c["first_k_dense_replace"]:
                f = _situ_glu(h @ t[pre + "mlp.gate_proj.weight"].T, h @ t[pre + "mlp.up_proj.weight"].T, b1, b2)
                f = f @ t[pre + "mlp.down_proj.weight"].T
            else:
                f = _moe(h, t, pre + "block_sparse_moe.", c)
            p = p + f
        h = _attn_res(blocks + [p], t["model.output_attn_res_proj.weight"][0],
                      t["model.output_attn_res_norm.weight"], eps)
        out.append(_rms(h, t["model.norm.weight"], eps) @ t["lm_head.weight"].T)
    return torch.stack(out)
