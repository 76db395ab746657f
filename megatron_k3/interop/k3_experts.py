"""Routed experts <-> the Kimi K3 checkpoint layout (compressed-tensors `mxfp4-pack-quantized`).

Per expert e and matrix w in w1 (gate), w3 (up) [I, L] and w2 (down) [L, I], the K3 checkpoint stores
    {prefix}.{e}.{w}.weight_packed   U8 [out, in/2]   two E2M1 codes per byte, the even column in the low nibble,
                                                     bit 3 of a nibble the sign
    {prefix}.{e}.{w}.weight_scale    U8 [out, in/32]  E8M0, w = LUT[code] * 2^(scale - 127)
with prefix `model.layers.{i}.block_sparse_moe.experts` for our `model.layers.{i}.mlp.experts`.

Export quantises the fp32 master weights exactly as the QAT forward does (ops.mx, E2M1, blocks of 32 along
the input dim, the same scale mode), so the stored values are the ones the forward used. Import writes the
dequantised values into our batched weights [E, out, in]. MX fake-quantisation is idempotent in value for both
scale modes, so a model that imports and runs with QAT computes bit for bit what the exporting model computed.

The stored bytes are canonical: a function of the values alone. Floor-mode encoding is idempotent in bytes,
but rceil is not (a block whose top element rounds down to 3 gets half the scale when re-quantised, codes
doubled, same values), so values quantised in another mode are re-encoded in floor mode, which holds every
MXFP4 value exactly. Export -> import -> export then gives identical bytes whatever the scale mode.

Except where the values came from a checkpoint: import keeps each block's E8M0 scale on the experts module
(`GroupedExperts.loaded_scales`, {matrix: uint8 [E, out, in/32]}, not part of the state dict), and export
encodes a block at that scale whenever it still represents the block's values exactly, i.e. the block did not
change. So a checkpoint written by another quantiser (e.g. the released one, whose ceil rule leaves some blocks
with top code 3 or 4) is written back byte for byte; changed blocks get the canonical encoding.
"""

from __future__ import annotations

import torch

from ..model.experts import GroupedExperts
from ..ops.mx import dequantize_mx, encode_at_scales, pack_e2m1, quantize_mx, unpack_e2m1

MATRICES = ("w1", "w2", "w3")
BLOCK = 32


def _canonical_codes(w: torch.Tensor, scale_mode: str):
    """E2M1 codes and E8M0 scales of w quantised in scale_mode, encoded canonically (see the module docstring)."""
    codes, scales = quantize_mx(w, "e2m1", BLOCK, scale_mode)
    if scale_mode != "floor":
        codes, scales = quantize_mx(dequantize_mx(codes, scales, "e2m1", BLOCK), "e2m1", BLOCK, "floor")
    return codes, scales


def _keep_loaded(w: torch.Tensor, codes, scales, loaded):
    """Blocks that the loaded scales [..., N] still encode exactly take those scales (and their codes)."""
    if loaded is None:
        return codes, scales
    kept, exact = encode_at_scales(w, "e2m1", loaded, BLOCK)
    codes = torch.where(exact.repeat_interleave(BLOCK, -1), kept, codes)
    return codes, torch.where(exact, loaded, scales)


def quantize_k3_weight(w_OI: torch.Tensor, scale_mode: str = "floor", loaded: torch.Tensor | None = None):
    """One expert matrix [out, in] -> (weight_packed U8 [out, in/2], weight_scale U8 [out, in/32]); `loaded`: the
    scales it was imported with (blocks still exact at them keep them; module docstring)."""
    codes, scales = _keep_loaded(w_OI.detach(), *_canonical_codes(w_OI.detach(), scale_mode), loaded)
    return pack_e2m1(codes).contiguous(), scales.contiguous()


def pack_expert_weights(weights: dict, prefix: str, expert_offset: int = 0, scale_mode: str = "floor",
                        loaded: dict | None = None) -> dict:
    """{"w1", "w2", "w3": batched [E, out, in]} -> {K3 key: U8 tensor} for experts numbered from expert_offset;
    `loaded`: {matrix: the scales imported with, [E, out, in/32]} (module docstring)."""
    out = {}
    for name in MATRICES:
        w = weights[name].detach()
        codes, scales = _keep_loaded(w, *_canonical_codes(w, scale_mode), (loaded or {}).get(name))
        packed = pack_e2m1(codes)
        for e in range(packed.shape[0]):
            key = f"{prefix}.{e + expert_offset}.{name}"
            out[f"{key}.weight_packed"] = packed[e].contiguous()
            out[f"{key}.weight_scale"] = scales[e].contiguous()
    return out


def unpack_expert_weights(tensors: dict, prefix: str, num_experts: int, dtype=torch.float32) -> dict:
    """K3 tensors of experts 0..num_experts-1 under prefix -> {"w1", "w2", "w3": [E, out, in]} (dequantised)."""
    out = {}
    for name in MATRICES:
        mats = []
        for e in range(num_experts):
            key = f"{prefix}.{e}.{name}"
            try:
                packed, scale = tensors[f"{key}.weight_packed"], tensors[f"{key}.weight_scale"]
            except KeyError as err:
                raise KeyError(f"K3 checkpoint has no {err.args[0]}") from None
            mats.append(dequantize_k3_weight(packed, scale, dtype))
        out[name] = torch.stack(mats)
    return out


def dequantize_k3_weight(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(weight_packed [out, in/2], weight_scale [out, in/32]) -> the matrix [out, in]."""
    packed, scale = packed.view(torch.uint8), scale.view(torch.uint8)
    if packed.dim() != 2 or scale.shape != (packed.shape[0], packed.shape[1] * 2 // BLOCK):
        raise ValueError(f"K3 MXFP4 weight: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} "
                         f"do not fit [out, in/2] and [out, in/{BLOCK}]")
    return dequantize_mx(unpack_e2m1(packed), scale, "e2m1", BLOCK, dtype)


def k3_prefix(module_name: str) -> str:
    """Our GroupedExperts module name -> the K3 checkpoint prefix of its experts."""
    return module_name.replace(".mlp.experts", ".block_sparse_moe.experts")


def export_scale_mode(experts, scale_mode=None) -> str:
    """The scale mode an export of these experts uses: the given one, else the QAT weight mode, else floor."""
    if scale_mode is not None:
        return scale_mode
    q = getattr(experts, "qat", None)
    if q is not None and getattr(q, "weights", False):
        if q.weight_format != "e2m1" or q.block_size != BLOCK:
            raise ValueError(f"the K3 layout is E2M1 in blocks of {BLOCK}; this model's QAT uses "
                             f"{q.weight_format} in blocks of {q.block_size}")
        return q.weight_scale_mode
    return "floor"


@torch.no_grad()
def export_experts(experts, prefix: str, expert_offset: int = 0, scale_mode: str | None = None) -> dict:
    """A GroupedExperts -> {K3 key: U8 tensor} for its E experts, numbered from expert_offset (the first global
    expert id of this rank under expert parallelism). scale_mode defaults to the module's QAT weight mode."""
    weights = {name: getattr(experts, name) for name in MATRICES}  # [E, out, in]
    return pack_expert_weights(weights, prefix, expert_offset, export_scale_mode(experts, scale_mode),
                               getattr(experts, "loaded_scales", None))


def remember_scales(experts, name: str, e: int, scale: torch.Tensor) -> None:
    """Keep the E8M0 scales local expert e's matrix `name` was imported with (module docstring): uint8
    [E, out, in/32] per matrix on `experts.loaded_scales`, 255 (no scale) where nothing was imported."""
    store = experts.__dict__.setdefault("loaded_scales", {})
    p = getattr(experts, name)
    if name not in store:
        store[name] = torch.full((p.shape[0], p.shape[1], p.shape[2] // BLOCK), 255, dtype=torch.uint8)
    store[name][e].copy_(scale.view(torch.uint8).reshape(store[name].shape[1:]))


@torch.no_grad()
def import_experts(experts, tensors: dict, prefix: str, expert_offset: int = 0) -> list:
    """Write the dequantised K3 tensors into a GroupedExperts' batched weights; returns the keys used.
    Raises KeyError naming the first missing key and ValueError on a shape mismatch."""
    used = []
    for name in MATRICES:
        p = getattr(experts, name)
        for e in range(p.shape[0]):
            key = f"{prefix}.{e + expert_offset}.{name}"
            try:
                packed, scale = tensors[f"{key}.weight_packed"], tensors[f"{key}.weight_scale"]
            except KeyError as err:
                raise KeyError(f"K3 checkpoint has no {err.args[0]}") from None
            w = dequantize_k3_weight(packed.to(p.device), scale.to(p.device), p.dtype)
            if w.shape != p.shape[1:]:
                raise ValueError(f"{key}: the checkpoint holds [{w.shape[0]}, {w.shape[1]}], "
                                 f"the model expects {list(p.shape[1:])}")
            p[e].copy_(w)
            remember_scales(experts, name, e, scale)
            used += [f"{key}.weight_packed", f"{key}.weight_scale"]
    return used


def _expert_modules(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)]


def export_model_experts(model, scale_mode: str | None = None, expert_offset: int = 0) -> dict:
    """Every MoE layer's routed experts in the K3 layout, keyed by K3 names."""
    out = {}
    for name, m in _expert_modules(model):
        out.update(export_experts(m, k3_prefix(name), expert_offset, scale_mode))
    return out


def import_model_experts(model, tensors: dict, expert_offset: int = 0) -> list:
    """Load every MoE layer's routed experts from K3-layout tensors; returns the keys used."""
    used = []
    for name, m in _expert_modules(model):
        used += import_experts(m, tensors, k3_prefix(name), expert_offset)
    return used
