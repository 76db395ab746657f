"""An independent Kimi K3 vision-language reference for tests/test_vision.py: a checkpoint writer in the released
K3 layout (text model under `language_model.`, the vision tower under `vision_tower.`, the projector under
`mm_projector.`, config.json with text_config and vision_config) and a plain-torch forward from pixels and token
ids to logits. Written from the released architecture as NeMo AutoModel's kimi_k3 `vision.py` (MoonViT-3D tower,
patchmergerv2 projector), `multimodal.py` (placeholder merge) and `config.py` (KimiK3VisionConfig keys and
defaults) implement it, and from the Kimi K2.5 media processor's input convention (pixel_values, grid_thws). It
imports nothing from megatron_k3; the text model is tests/k3_reference.py's (independent as well), entered
through its `embeds=` hook.

Legend: L patches, D tower width, Q q/k/v width (heads x head dim), I MLP width, M media, N merged features.
Inputs: pixel_values [sum_m t_m*h_m*w_m, 3, P, P], the media concatenated in order, each medium's patches in
(frame, patch row, patch column) order, each patch channel-first; grid_thws [M, 3] (t, h, w) in patches.
What it covers: the patch embedding (a bias-free Conv2d with kernel = stride = P, i.e. a linear map of each
flattened patch); the learned 2D position table, used as is at its own size and bilinearly interpolated
(align_corners=False) otherwise, plus the fixed sin-cos time embedding per frame of a video; the encoder blocks
(RMSNorm with the dtype's machine eps, fused bias-free wqkv, 2D RoPE on q and k over adjacent-element pairs with
the column rotation before the row rotation, bidirectional attention within each medium across its frames, wo,
the GELU-tanh MLP2) and the final RMSNorm; the sd2_tpool merge (2x2 spatial groups, mean over frames); the
patchmergerv2 projector (linear, exact GELU, linear, RMSNorm with projector_ln_eps); the merge into the text
sequence in the compact form (one media_placeholder_token_id per medium, replaced by that medium's feature rows,
in placeholder order over the batch row-major). Not covered: padding rows of unequal merged length (the reference
refuses them), NeMo's zeroing of pad-token embeddings, bicubic interpolation, the non-released tower options
(LayerNorm, biases, other projectors). Vision and projector tensors are stored in bf16 as the released checkpoint;
the forward uses exactly the stored values, in float64 (RMSNorm eps then float32's, to match an fp32 model).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import k3_reference as ref
import numpy as np
import torch
import torch.nn.functional as F

PREFIX = ref.PREFIX  # "language_model."
TEXT_CONFIG = ref.TEXT_CONFIG
EPS_FP32 = float(torch.finfo(torch.float32).eps)  # nn.RMSNorm(eps=None) of an fp32 model: 1.1920929e-07
ROPE_THETA = 10000.0

# The released vision_config keys at toy width: 2 blocks of 2 heads of 32, an 8x8 position table, 4 frames.
VISION_CONFIG = {
    "model_type": "kimi_k3_vision",
    "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2,
    "vt_hidden_size": 64, "vt_intermediate_size": 128, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2", "mm_hidden_size": 64, "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5, "qkv_hidden_size": 64, "norm_type": "rmsnorm", "attn_bias": False,
    "patch_embed_proj_bias": False, "mlp_type": "mlp2", "linear_bias": False,
    "activation_func": "gelu_pytorch_tanh", "pos_emb_interpolation_mode": "bilinear",
    "media_placeholder_token_id": TEXT_CONFIG["vocab_size"] - 1, "text_hidden_size": TEXT_CONFIG["hidden_size"],
}


# ------------------------------------------------------------------------------------------------ writer
def random_vl_checkpoint(seed: int = 0, c: dict = VISION_CONFIG, text: dict = TEXT_CONFIG) -> dict:
    """Every tensor of a K3 vision-language checkpoint under its file name: the text tensors of
    k3_reference.random_checkpoint under `language_model.`, the tower and projector unprefixed, random, bf16
    (projections ~ N(0, 1/fan_in), norm weights 1 + 0.1 N, position table ~ N(0, 0.5^2))."""
    tensors = {PREFIX + k: v for k, v in ref.random_checkpoint(text, seed).items()}
    rnd, lin, norm = ref.draws(10_000 + seed)

    D, Q, I, P = c["vt_hidden_size"], c["qkv_hidden_size"], c["vt_intermediate_size"], c["patch_size"]
    kh, kw = c["merge_kernel_size"]
    Dm, Dt = c["mm_hidden_size"] * kh * kw, c["text_hidden_size"]
    v = {"vision_tower.patch_embed.proj.weight": lin(D, 3 * P * P).view(D, 3, P, P),
         "vision_tower.patch_embed.pos_emb.weight": rnd(c["init_pos_emb_height"], c["init_pos_emb_width"], D,
                                                        std=0.5),
         "vision_tower.encoder.final_layernorm.weight": norm(D),
         "mm_projector.proj.0.weight": lin(Dm, Dm), "mm_projector.proj.2.weight": lin(Dt, Dm),
         "mm_projector.post_norm.weight": norm(Dt)}
    for i in range(c["vt_num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}."
        v[b + "norm0.weight"], v[b + "norm1.weight"] = norm(D), norm(D)
        v[b + "wqkv.weight"], v[b + "wo.weight"] = lin(3 * Q, D), lin(D, Q)
        v[b + "mlp.fc0.weight"], v[b + "mlp.fc1.weight"] = lin(I, D), lin(D, I)
    tensors.update({k: x.to(torch.bfloat16) for k, x in v.items()})
    return tensors


def vl_config(c: dict = VISION_CONFIG, text: dict = TEXT_CONFIG) -> dict:
    """The top-level config.json of the vision-language checkpoint."""
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
            "vision_config": c, "media_placeholder_token_id": c["media_placeholder_token_id"],
            "ignore_index": -100, "pad_token_id": 0}


def write_vl_checkpoint(path, tensors: dict, shards: int = 2, c: dict = VISION_CONFIG, text: dict = TEXT_CONFIG):
    """config.json, `shards` safetensors files (keys in sorted order, so a shard holds text and vision tensors)
    and model.safetensors.index.json. `tensors` are named as in the files (random_vl_checkpoint's)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(vl_config(c, text), indent=1))
    keys = sorted(tensors)
    per = math.ceil(len(keys) / shards)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[s * per:(s + 1) * per]}
        save_file(part, str(path / name))
        weight_map.update(dict.fromkeys(part, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ------------------------------------------------------------------------------------------------ tower
def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def time_embedding(dim: int, frames: int) -> torch.Tensor:
    """[frames, dim] fixed 1D sin-cos embedding of positions 0..frames-1, in float32 with numpy as the released
    code: omega_i = 1 / 10000^(i / (dim/2)), i < dim/2; [sin(pos * omega), cos(pos * omega)]."""
    omega = np.arange(dim // 2, dtype=np.float32) / np.float32(dim / 2.0)
    omega = np.float32(1.0) / np.float32(10000) ** omega
    out = np.arange(frames, dtype=np.float32)[:, None] * omega[None, :]
    return torch.from_numpy(np.concatenate([np.sin(out), np.cos(out)], axis=1).astype(np.float32))


def position_embedding(table: torch.Tensor, t: int, h: int, w: int, c: dict = VISION_CONFIG) -> torch.Tensor:
    """[t*h*w, D]: the learned [H0, W0, D] table at the grid (as is at its own size, interpolated otherwise),
    row-major, plus the time embedding of its frame when t > 1."""
    H0, W0, D = table.shape
    if t > c["init_pos_emb_time"]:
        raise ValueError(f"{t} frames > init_pos_emb_time={c['init_pos_emb_time']}")
    if (h, w) == (H0, W0):
        p = table.reshape(h * w, D)
    else:
        p = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode=c["pos_emb_interpolation_mode"])
        p = p[0].permute(1, 2, 0).reshape(h * w, D)
    if t == 1:
        return p
    return (p[None] + time_embedding(D, t).to(p.dtype)[:, None]).reshape(t * h * w, D)


def rope_angles(h: int, w: int, head_dim: int, theta: float = ROPE_THETA, dtype=torch.float64) -> torch.Tensor:
    """[h*w, head_dim/2] rotation angles of the 2D RoPE, grid row-major: pair 2i turns by x * f_i (x the column),
    pair 2i+1 by y * f_i (y the row), f_i = theta^(-4i/head_dim), i < head_dim/4."""
    f = 1.0 / theta ** (torch.arange(head_dim // 4, dtype=dtype) * 4 / head_dim)
    y, x = torch.meshgrid(torch.arange(h, dtype=dtype), torch.arange(w, dtype=dtype), indexing="ij")
    return torch.stack([x.reshape(-1, 1) * f, y.reshape(-1, 1) * f], -1).reshape(h * w, head_dim // 2)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x [L, heads, hd] as hd/2 pairs of adjacent elements (x[2j], x[2j+1]), pair j turned by angles[:, j]."""
    a, b = x[..., 0::2], x[..., 1::2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape)


def _check_grid(grid_thws, n_rows: int, c: dict):
    kh, kw = c["merge_kernel_size"]
    grid = [tuple(int(v) for v in g) for g in torch.as_tensor(grid_thws).reshape(-1, 3).tolist()]
    for m, (t, h, w) in enumerate(grid):
        if min(t, h, w) < 1 or h % kh or w % kw:
            raise ValueError(f"medium {m}: grid (t, h, w) = {(t, h, w)} is not a multiple of the merge kernel "
                             f"{[kh, kw]}")
    if sum(t * h * w for t, h, w in grid) != n_rows:
        raise ValueError(f"grid_thws add up to {sum(t * h * w for t, h, w in grid)} patches, pixel_values has "
                         f"{n_rows} rows")
    return grid


def _vision_tensors(tensors: dict) -> dict:
    return {k: v.to(torch.float64) for k, v in tensors.items() if k.startswith(("vision_tower.", "mm_projector."))}


@torch.no_grad()
def tower(tensors: dict, pixel_values: torch.Tensor, grid_thws, c: dict = VISION_CONFIG) -> torch.Tensor:
    """[L, D]: the encoder output (after the final RMSNorm) of every patch, in float64."""
    grid = _check_grid(grid_thws, pixel_values.shape[0], c)
    t = _vision_tensors(tensors)
    pre = "vision_tower."
    heads, Q = c["vt_num_attention_heads"], c["qkv_hidden_size"]
    hd = Q // heads
    w_patch = t[pre + "patch_embed.proj.weight"]
    x = pixel_values.to(torch.float64).reshape(pixel_values.shape[0], -1) @ w_patch.reshape(w_patch.shape[0], -1).T
    x = x + torch.cat([position_embedding(t[pre + "patch_embed.pos_emb.weight"], *g, c) for g in grid])
    angles = torch.cat([rope_angles(h, w, hd).repeat(tt, 1) for tt, h, w in grid])  # every frame alike
    lengths = [tt * h * w for tt, h, w in grid]
    for i in range(c["vt_num_hidden_layers"]):
        b = f"{pre}encoder.blocks.{i}."
        qkv = (_rms(x, t[b + "norm0.weight"], EPS_FP32) @ t[b + "wqkv.weight"].T).view(-1, 3, heads, hd)
        q, k, v = apply_rope(qkv[:, 0], angles), apply_rope(qkv[:, 1], angles), qkv[:, 2]
        outs = []
        for qm, km, vm in zip(q.split(lengths), k.split(lengths), v.split(lengths)):  # within each medium
            s = torch.einsum("lhd,mhd->hlm", qm, km) / math.sqrt(hd)
            outs.append(torch.einsum("hlm,mhd->lhd", torch.softmax(s, -1), vm).reshape(-1, Q))
        x = x + torch.cat(outs) @ t[b + "wo.weight"].T
        h1 = _rms(x, t[b + "norm1.weight"], EPS_FP32) @ t[b + "mlp.fc0.weight"].T
        x = x + F.gelu(h1, approximate="tanh") @ t[b + "mlp.fc1.weight"].T
    return _rms(x, t[pre + "encoder.final_layernorm.weight"], EPS_FP32)


def merge(x: torch.Tensor, grid_thws, c: dict = VISION_CONFIG) -> list:
    """sd2_tpool: per medium [(h/kh)*(w/kw), kh*kw, D], kh x kw spatial groups (row-major within the group),
    averaged over the frames."""
    kh, kw = c["merge_kernel_size"]
    grid = _check_grid(grid_thws, x.shape[0], c)
    out = []
    for xm, (t, h, w) in zip(x.split([t * h * w for t, h, w in grid]), grid):
        g = xm.view(t, h // kh, kh, w // kw, kw, -1).permute(0, 1, 3, 2, 4, 5).mean(0)
        out.append(g.reshape((h // kh) * (w // kw), kh * kw, -1))
    return out


@torch.no_grad()
def vision_features_per_medium(tensors: dict, pixel_values: torch.Tensor, grid_thws,
                               c: dict = VISION_CONFIG) -> list:
    """Per medium [(h/kh)*(w/kw), text_hidden]: tower, merge, then the patchmergerv2 projector."""
    t = _vision_tensors(tensors)
    out = []
    for g in merge(tower(tensors, pixel_values, grid_thws, c), grid_thws, c):
        h = F.gelu(g.reshape(g.shape[0], -1) @ t["mm_projector.proj.0.weight"].T)  # exact (erf) GELU
        out.append(_rms(h @ t["mm_projector.proj.2.weight"].T, t["mm_projector.post_norm.weight"],
                        c["projector_ln_eps"]))
    return out


def vision_features(tensors: dict, pixel_values: torch.Tensor, grid_thws, c: dict = VISION_CONFIG) -> torch.Tensor:
    """[sum_m (h_m/kh)*(w_m/kw), text_hidden] in float64: the projected features of every medium, in order."""
    return torch.cat(vision_features_per_medium(tensors, pixel_values, grid_thws, c))


# ------------------------------------------------------------------------------------------------ model
def merge_embeddings(tensors: dict, input_ids: torch.Tensor, media: list, c: dict = VISION_CONFIG) -> torch.Tensor:
    """[B, S', text_hidden]: each placeholder of input_ids (one per medium, row-major over the batch) replaced by
    that medium's feature rows, the other tokens embedded. Rows must come out equally long (no padding here)."""
    emb = tensors[PREFIX + "model.embed_tokens.weight"].to(torch.float64)
    ph = c["media_placeholder_token_id"]
    n = int((input_ids == ph).sum())
    if n != len(media):
        raise ValueError(f"{n} placeholders for {len(media)} media")
    it = iter(media)
    rows = [torch.cat([next(it) if tok == ph else emb[tok][None] for tok in ids.tolist()]) for ids in input_ids]
    if len({r.shape[0] for r in rows}) > 1:
        raise ValueError(f"rows merge to different lengths {[r.shape[0] for r in rows]}; the reference pads none")
    return torch.stack(rows)


@torch.no_grad()
def forward(tensors: dict, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None, grid_thws=None,
            c: dict = VISION_CONFIG, text: dict = TEXT_CONFIG) -> torch.Tensor:
    """Logits [B, S', V] in float64 of the vision-language model in `tensors` (file names): input_ids [B, S] in the
    compact form (one placeholder per medium); without pixel_values, the text model on input_ids alone (a
    placeholder then embeds as any token, as in the released code)."""
    text_tensors = {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}
    if pixel_values is None:
        return ref.forward(text_tensors, input_ids, text)
    media = vision_features_per_medium(tensors, pixel_values, grid_thws, c)
    return ref.forward(text_tensors, None, text, embeds=merge_embeddings(tensors, input_ids, media, c))
