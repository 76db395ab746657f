"""K3's vision tower (MoonViT-3D) and projector (patchmergerv2), and how their features enter the language model.

Legend: L patches (all media), D tower width, Q q/k/v width (heads x head dim), N features, K text hidden.

Inputs, as the released K3 processor makes them (NeMo AutoModel's kimi_k3, Kimi K2.5's media processor):
`pixel_values [L, 3, p, p]` (p = model.vision.patch_size, 14): the media concatenated in placeholder order, each
medium's patches in (frame, patch row, patch column) order, each patch channel-first, pixels normalised as
(x / 255 - 0.5) / 0.5. `grid_thws [M, 3]` int64: each medium's (frames t, patch rows h, patch columns w), h and w
multiples of the merge kernel (2 x 2); a video is cut into chunks of at most `pos_emb_time` (4) frames, each
chunk one medium.

The tower, per medium:
1. patch embedding: each patch flattened and projected (a Conv2d of kernel = stride = p, no bias: one matrix);
2. position: a learned [H0, W0, D] table, bilinearly interpolated to (h, w) unless the grid is exactly (H0, W0),
   plus, for t > 1 only, a fixed sin-cos embedding of the frame index (`pos_emb_type: divided_fixed`); the
   interpolation is F.interpolate's as two one-axis matrices (`interpolate_table`: deterministic on CUDA);
3. encoder blocks: x + wo(attention(norm0(x))), then x + fc1(gelu_tanh(fc0(norm1(x)))); attention is
   bidirectional over all t*h*w patches of one medium (never across media), with 2D rotary embedding on q and k
   (column and row angles interleaved over adjacent pairs, the same for every frame); RMSNorms whose eps is the
   input dtype's machine epsilon (the released `nn.RMSNorm(eps=None)`); no biases anywhere;
4. final RMSNorm, then the sd2_tpool merge: each 2 x 2 block of patches concatenated, frames averaged:
   (h/2)(w/2) features of 4D per medium, whatever t is.
The projector (patchmergerv2): Linear(4D, 4D) -> GELU (erf) -> Linear(4D, K) -> RMSNorm(projector_eps).

Parameter names are the checkpoint's (`vision_tower.*`, `mm_projector.*`), so the Hugging Face mapping of these
tensors is the identity (interop.k3_layout).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..annotations import annotate
from ..ops.numerics import without_autocast
from .layers import Linear
from .norm import RMSNorm

__all__ = ["VisionRMSNorm", "MoonViT3d", "PatchMergerV2", "check_media", "sincos_time_table",
           "num_features", "media_shares"]


def media_shares(grids: list, parts: int) -> list:
    """Split the media into `parts` contiguous ranges of about equal patch counts: [(first, end)] per part (a part
    may be empty). Deterministic: every rank computes the same split from the same grids."""
    sizes = [t * h * w for t, h, w in grids]
    total, bounds, acc, i = sum(sizes), [0], 0, 0
    for r in range(1, parts):
        while i < len(sizes) and acc + sizes[i] / 2 <= total * r / parts:  # a medium goes where most of it lies
            acc += sizes[i]
            i += 1
        bounds.append(i)
    bounds.append(len(sizes))
    return [(bounds[r], bounds[r + 1]) for r in range(parts)]


class VisionRMSNorm(RMSNorm):
    """RMSNorm with the released tower's eps: the machine epsilon of the input's dtype (fp32: 1.19e-7)."""

    def __init__(self, dim: int, eps: float | None = None):
        super().__init__(dim, 0.0)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return self.weight * y.to(x.dtype)


def sincos_time_table(frames: int, dim: int) -> torch.Tensor:
    """[frames, dim] fixed 1D sin-cos embedding of the frame index: sin(f * w_i) then cos(f * w_i), w_i =
    10000^(-i / (dim/2)), computed in fp32 as the released code does."""
    omega = torch.arange(dim // 2, dtype=torch.float32) / (dim / 2.0)
    omega = 1.0 / (10000.0 ** omega)
    out = torch.arange(frames, dtype=torch.float32)[:, None] * omega[None]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def check_media(pixel_values: torch.Tensor, grid_thws: torch.Tensor, vcfg) -> list:
    """The media's (t, h, w) as Python ints after checking them against the pixels and the tower; raises
    ValueError naming the medium and the problem."""
    p = vcfg.patch_size
    if grid_thws.dim() != 2 or grid_thws.shape[1] != 3 or grid_thws.is_floating_point():
        raise ValueError(f"grid_thws must be an integer tensor [media, 3] of (t, h, w) in patches, got "
                         f"{tuple(grid_thws.shape)} {grid_thws.dtype}")
    if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
        raise ValueError(f"pixel_values must be [patches, 3, {p}, {p}] (model.vision.patch_size={p}), got "
                         f"{tuple(pixel_values.shape)}")
    grids = [tuple(int(v) for v in g) for g in grid_thws.tolist()]
    mh, mw = (int(v) for v in vcfg.merge_kernel_size)
    for i, (t, h, w) in enumerate(grids):
        if min(t, h, w) < 1:
            raise ValueError(f"medium {i}: grid (t={t}, h={h}, w={w}) has an empty side")
        if h % mh or w % mw:
            raise ValueError(f"medium {i}: grid (t={t}, h={h}, w={w}) does not fit the {mh}x{mw} merge kernel "
                             f"(h and w must be multiples of it; pad the image to a multiple of {mh * p}x{mw * p} "
                             f"pixels)")
        if t > vcfg.pos_emb_time:
            raise ValueError(f"medium {i}: {t} frames, more than model.vision.pos_emb_time={vcfg.pos_emb_time} "
                             f"(cut videos into chunks of at most that many frames)")
        if max(h, w) > vcfg.rope_max_grid:
            raise ValueError(f"medium {i}: grid (t={t}, h={h}, w={w}) exceeds model.vision.rope_max_grid="
                             f"{vcfg.rope_max_grid} patches per side")
    total = sum(t * h * w for t, h, w in grids)
    if total != pixel_values.shape[0]:
        raise ValueError(f"grid_thws add up to {total} patches but pixel_values has {pixel_values.shape[0]} rows")
    return grids


@functools.lru_cache(maxsize=64)
def interpolation_matrix(n_in: int, n_out: int, mode: str, device=None, dtype=torch.float32) -> torch.Tensor:
    """[n_out, n_in]: F.interpolate(mode, align_corners=False) along one axis of a 2D grid, as a matrix (read off by
    interpolating the identity: column k is what input row k contributes). Cached: a grid's matrices are the same at
    every step (read, never written)."""
    with torch.inference_mode(False):  # a plain tensor even when first made under inference_mode (generation)
        eye = torch.eye(n_in, dtype=dtype, device=device).view(1, n_in, n_in, 1)
        m = F.interpolate(eye, size=(n_out, 1), mode=mode, align_corners=False)  # [1, k, n_out, 1]
        return m[0, :, :, 0].t()


def interpolate_table(table: torch.Tensor, h: int, w: int, mode: str) -> torch.Tensor:
    """[h, w, D]: F.interpolate of the [H0, W0, D] table to (h, w) (channels D, align_corners=False), as the rows'
    interpolation matrix and then the columns' (bilinear and bicubic are separable: the same terms, summed in
    another order), in fp32 (fp64 for an fp64 table), rounded to the table's dtype once as F.interpolate does. Two
    GEMMs: their backward is deterministic on CUDA, where F.interpolate's (atomic adds) stops a run under
    train.deterministic."""
    dt = torch.promote_types(table.dtype, torch.float32)
    rows = interpolation_matrix(table.shape[0], h, mode, table.device, dt)
    cols = interpolation_matrix(table.shape[1], w, mode, table.device, dt)
    with without_autocast(table.device.type):
        out = torch.einsum("ia,abd->ibd", rows, table.to(dt))
        out = torch.einsum("jb,ibd->ijd", cols, out)
    return out.to(table.dtype)


class PatchEmbed3d(nn.Module):
    def __init__(self, vcfg):
        super().__init__()
        D, p = vcfg.hidden_size, vcfg.patch_size
        self.proj = nn.Conv2d(3, D, kernel_size=p, stride=p, bias=False)
        annotate(self.proj.weight, adamw_reason="patch_embedding")
        self.pos_emb = nn.Module()
        self.pos_emb.weight = nn.Parameter(torch.empty(vcfg.pos_emb_height, vcfg.pos_emb_width, D))
        annotate(self.pos_emb.weight, adamw_reason="position_embedding")
        self.mode = vcfg.pos_emb_interpolation

    def position(self, grids: list) -> torch.Tensor:
        """[L, D]: each medium's interpolated 2D table, plus the frame embedding where t > 1."""
        w = self.pos_emb.weight
        out = [w.reshape(-1, w.shape[-1])[:0]]  # (no media: an empty table that still reads the parameter)
        for t, h, wd in grids:
            if (h, wd) == tuple(w.shape[:2]):
                pos = w.reshape(h * wd, -1)
            else:
                pos = interpolate_table(w, h, wd, self.mode).reshape(h * wd, -1)
            if t > 1:  # a fixed table, not a parameter: computed here (frames x D values)
                time = sincos_time_table(t, w.shape[-1]).to(device=pos.device, dtype=pos.dtype)
                pos = (pos.unsqueeze(0) + time[:, None]).reshape(t * h * wd, -1)
            out.append(pos)
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, grids: list) -> torch.Tensor:
        w = self.proj.weight
        x = F.linear(pixel_values.to(w.dtype).flatten(1), w.flatten(1))  # the stride-p conv of each patch
        return x + self.position(grids).to(x.dtype)


def rope_2d(grids: list, head_dim: int, theta: float, device) -> tuple:
    """(cos, sin) [L, head_dim / 2] of every patch: pair 2i turns by column * f_i, pair 2i + 1 by row * f_i,
    f_i = theta^(-4i / head_dim); the same for every frame. In fp32."""
    f = 1.0 / (theta ** (torch.arange(0, head_dim, 4, device=device, dtype=torch.float32)[: head_dim // 4] /
                         head_dim))
    out = []
    for t, h, w in grids:
        rows = torch.arange(h, device=device, dtype=torch.float32).repeat_interleave(w)
        cols = torch.arange(w, device=device, dtype=torch.float32).repeat(h)
        ang = torch.stack([torch.outer(cols, f), torch.outer(rows, f)], dim=-1).reshape(h * w, head_dim // 2)
        out.append(ang.repeat(t, 1))
    ang = torch.cat(out) if out else torch.zeros(0, head_dim // 2, device=device)
    return torch.cos(ang), torch.sin(ang)


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [L, H, hd]: adjacent pairs (2j, 2j + 1) rotated as complex numbers by cos/sin [L, hd/2], in fp32."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, None], sin[:, None]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc0 = Linear(dim, hidden, bias=False)
        self.fc1 = Linear(hidden, dim, bias=False)

    def forward(self, x):
        return F.linear(F.gelu(F.linear(x, self.fc0.weight), approximate="tanh"), self.fc1.weight)


class VisionBlock(nn.Module):
    def __init__(self, vcfg):
        super().__init__()
        D, Q, H = vcfg.hidden_size, vcfg.qkv_hidden_size, vcfg.num_heads
        self.num_heads, self.head_dim = H, vcfg.head_dim
        self.norm0 = VisionRMSNorm(D)
        self.norm1 = VisionRMSNorm(D)
        self.wqkv = Linear(D, 3 * Q, bias=False)
        self.wo = Linear(Q, D, bias=False)
        self.mlp = VisionMLP(D, vcfg.intermediate_size)
        # Per-Head Muon: q, k and v of each head are blocks of wqkv's rows (3H blocks), wo's columns per head
        annotate(self.wqkv.weight, blocks=3 * H, block_axis=0, block_kind="heads")
        annotate(self.wo.weight, blocks=H, block_axis=1, block_kind="heads")

    def attention(self, x: torch.Tensor, lengths: list, cos, sin) -> torch.Tensor:
        return F.linear(self.core(F.linear(x, self.wqkv.weight), lengths, cos, sin), self.wo.weight)

    def core(self, qkv: torch.Tensor, lengths: list, cos, sin) -> torch.Tensor:
        """Between wqkv and wo: the 2D rotary embedding and attention within each medium (what selective
        recomputation's `core_attn` rebuilds in the backward)."""
        q, k, v = qkv.unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(1)  # [L, H, hd] each
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        out, start = [v.flatten(1)[:0]], 0  # (no media: an empty output that still reads wqkv)
        for n in lengths:  # one medium at a time: no attention across media
            sl = slice(start, start + n)
            o = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1))
            out.append(o.transpose(0, 1).flatten(1))
            start += n
        return torch.cat(out)

    def forward(self, x, lengths, cos, sin):
        x = x + self.attention(self.norm0(x), lengths, cos, sin)
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, vcfg):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(vcfg) for _ in range(vcfg.num_layers))
        self.final_layernorm = VisionRMSNorm(vcfg.hidden_size)


class MoonViT3d(nn.Module):
    """The tower: pixel_values [L, 3, p, p] -> merged patch groups [N, 4D] (see the module docstring)."""

    def __init__(self, vcfg):
        super().__init__()
        self.vcfg = vcfg
        self.patch_embed = PatchEmbed3d(vcfg)
        self.encoder = VisionEncoder(vcfg)

    def forward(self, pixel_values: torch.Tensor, grids: list) -> torch.Tensor:
        v = self.vcfg
        x = self.patch_embed(pixel_values, grids)
        cos, sin = rope_2d(grids, v.head_dim, v.rope_theta, x.device)
        lengths = [t * h * w for t, h, w in grids]
        for blk in self.encoder.blocks:
            x = blk(x, lengths, cos, sin)
        x = self.encoder.final_layernorm(x)
        mh, mw = (int(m) for m in v.merge_kernel_size)
        out, start = [x[:0].reshape(0, mh * mw * x.shape[-1])], 0
        for (t, h, w), n in zip(grids, lengths):  # sd2_tpool: 2x2 blocks concatenated, frames averaged
            blk = x[start:start + n].reshape(t, h // mh, mh, w // mw, mw, -1).permute(0, 1, 3, 2, 4, 5)
            out.append(blk.mean(0).reshape((h // mh) * (w // mw), -1))
            start += n
        return torch.cat(out)


class PatchMergerV2(nn.Module):
    """[N, 4D] merged patch groups -> [N, K] features in the text model's width."""

    def __init__(self, vcfg, text_hidden: int):
        super().__init__()
        width = vcfg.hidden_size * vcfg.merge_size
        self.proj = nn.Sequential(Linear(width, width, bias=False), nn.GELU(), Linear(width, text_hidden, bias=False))
        self.post_norm = VisionRMSNorm(text_hidden, vcfg.projector_eps)

    def forward(self, x):
        return self.post_norm(F.linear(F.gelu(F.linear(x, self.proj[0].weight)), self.proj[2].weight))


def num_features(grids: list, vcfg) -> list:
    """Features per medium: (h / mh) * (w / mw) whatever t is."""
    mh, mw = (int(m) for m in vcfg.merge_kernel_size)
    return [(h // mh) * (w // mw) for _, h, w in grids]

