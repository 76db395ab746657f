"""TransformerEngine backend for precision=te_fp8 (Hopper: Float8BlockScaling) and te_mxfp8 (Blackwell:
MXFP8BlockScaling): capability checks that fail with one line, the nn.Linear -> te.Linear swap, the FP8
autocast context, and a GPU check comparing TE's MXFP8 with our emulated MX path (ops.mx).

TransformerEngine is imported inside functions only: importing this module on a CPU machine touches nothing
of it. The routed experts (grouped GEMM), the router, the LM head and layers whose dims TE cannot take stay
in bf16.
"""

from __future__ import annotations

import importlib.util
import logging
import time

import torch
from torch import nn

from ..config import ConfigError

log = logging.getLogger("megatron_k3.precision")

# precision name -> (recipe class in transformer_engine.common.recipe, TE probe, minimum SM, dim alignment)
RECIPES = {
    "te_fp8": ("Float8BlockScaling", "is_fp8_block_scaling_available", (9, 0), 16),
    "te_mxfp8": ("MXFP8BlockScaling", "is_mxfp8_available", (10, 0), 32),
}
SKIP_MODULES = ("lm_head",)  # kept in bf16: the logits feed the loss directly


def _recipe_info(name: str):
    if name not in RECIPES:
        raise ConfigError("precision", name, f"not a TransformerEngine precision; valid: {', '.join(RECIPES)}")
    return RECIPES[name]


def import_te(name: str):
    """(transformer_engine.pytorch, transformer_engine.common.recipe), or ConfigError naming what is missing."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe
    except (ImportError, OSError) as e:  # OSError: the package is there but its CUDA libraries are not
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise ConfigError("precision", name, f"TransformerEngine is not installed (requirements-gpu.txt): {why}") from None
    return te, recipe


def _probe(te, fn_name: str):
    """(available, reason) from TE's own probe (te.is_*_available, or FP8GlobalStateManager in older TE)."""
    fn = getattr(te, fn_name, None)
    if fn is None:
        try:
            from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
        except ImportError:
            from transformer_engine.pytorch.quantization import FP8GlobalStateManager
        fn = getattr(FP8GlobalStateManager, fn_name)
        res = fn()
    else:
        try:
            res = fn(return_reason=True)
        except TypeError:
            res = fn()
    return (bool(res[0]), str(res[1])) if isinstance(res, tuple) else (bool(res), "")


def check_available(name: str, device) -> None:
    """Raise ConfigError (one line) unless TE is installed and this GPU runs the precision's recipe."""
    _, probe, sm, _ = _recipe_info(name)
    device = torch.device(device)
    need = f"needs an SM >= {sm[0]}.{sm[1]} GPU"
    if device.type != "cuda" or not torch.cuda.is_available():
        installed = importlib.util.find_spec("transformer_engine") is not None  # looked up, not imported
        te_note = "" if installed else "; TransformerEngine is not installed either (requirements-gpu.txt)"
        raise ConfigError("precision", name, f"{need}; this run is on {device.type}{te_note}")
    cap = torch.cuda.get_device_capability(device)
    if cap < sm:
        raise ConfigError("precision", name, f"{need}; {torch.cuda.get_device_name(device)} is SM {cap[0]}.{cap[1]}")
    te, _ = import_te(name)
    ok, reason = _probe(te, probe)
    if not ok:
        raise ConfigError("precision", name, f"TransformerEngine reports the recipe unavailable: {reason}")


_RECIPE_CACHE: dict = {}


def make_recipe(name: str):
    """The precision's TE recipe (E4M3 forward and backward), one object per precision and process."""
    if name not in _RECIPE_CACHE:
        cls, _, _, _ = _recipe_info(name)
        _, recipe = import_te(name)
        _RECIPE_CACHE[name] = getattr(recipe, cls)(fp8_format=recipe.Format.E4M3)
    return _RECIPE_CACHE[name]


def te_autocast(name: str):
    """TE's FP8 autocast with this precision's recipe (te.autocast in TE >= 2.8, fp8_autocast before)."""
    te, _ = import_te(name)
    r = make_recipe(name)
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=r)
    return te.fp8_autocast(enabled=True, fp8_recipe=r)


def _linear_parts(m: nn.Module):
    """(weight, bias) when m computes y = x W^T + b on one rank (nn.Linear, or our parallel linears at tp=1)."""
    from ..parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(m, nn.Linear):
        return m.weight, m.bias
    if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.tp.size == 1:
        return m.weight, m.bias
    return None


_PARAM_ATTRS = ("tp_split_dim", "tensor_model_parallel", "model_parallel", "partition_dim", "tp_partial_grad")


def swap_linears(model: nn.Module, name: str, skip=SKIP_MODULES) -> list:
    """Replace every single-rank linear whose dims are multiples of the recipe's alignment by a te.Linear
    holding the same values (parameter names unchanged; TE adds its `_extra_state`). Call it before the
    optimizer is built. Returns the swapped module names."""
    te, _ = import_te(name)
    align = _recipe_info(name)[3]
    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            parts = _linear_parts(child)
            if parts is None or child_name in skip or full in skip:
                continue
            w, b = parts
            out_f, in_f = w.shape
            if out_f % align or in_f % align:
                continue
            lin = te.Linear(in_f, out_f, bias=b is not None, params_dtype=w.dtype, device=w.device)
            with torch.no_grad():
                lin.weight.copy_(w)
                if b is not None:
                    lin.bias.copy_(b)
            for p_new, p_old in ((lin.weight, w), (getattr(lin, "bias", None), b)):
                for a in _PARAM_ATTRS:
                    if p_old is not None and hasattr(p_old, a):
                        setattr(p_new, a, getattr(p_old, a))
            setattr(parent, child_name, lin)
            swapped.append(full)
    log.info("precision=%s: %d linear layers run through te.Linear", name, len(swapped))
    return swapped


# ---------------------------------------------------------------------------------------------- GPU check
def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _mx_inputs(M: int, K: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x *= torch.exp2(torch.randint(-30, 30, (M, K // 32, 1), generator=g).float()).repeat_interleave(32, -1)
    x[0, :32] = 0.0
    x[1, :32] = 2.0 ** -130  # a block whose scale underflows to E8M0's minimum
    return x.to(device)


def _emulation_checks(rows, device):
    """Our MX ops on CUDA against the same ops on CPU (must be bit-identical), and against torchao on CUDA."""
    from ..ops.mx import pack_e2m1, quantize_mx

    x = _mx_inputs(256, 1024, device)
    for fmt in ("e2m1", "e4m3", "e5m2"):
        for mode in ("floor", "rceil"):
            c_gpu, s_gpu = quantize_mx(x, fmt, scale_mode=mode)
            c_cpu, s_cpu = quantize_mx(x.cpu(), fmt, scale_mode=mode)
            same = torch.equal(c_gpu.cpu(), c_cpu) and torch.equal(s_gpu.cpu(), s_cpu)
            note = "bit-identical" if same else f"DIFFER in {(c_gpu.cpu() != c_cpu).sum().item()} codes"
            try:
                from torchao.prototype.mx_formats.config import ScaleCalculationMode
                from torchao.prototype.mx_formats.mx_tensor import MXTensor

                dt = {"e2m1": torch.float4_e2m1fn_x2, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
                t = MXTensor.to_mx(x, dt, block_size=32, scaling_mode=getattr(ScaleCalculationMode, mode.upper()))
                ours = pack_e2m1(c_gpu) if fmt == "e2m1" else c_gpu
                keep = s_gpu != 0  # torchao deviates from the spec where the scale underflows (see tests/test_mx.py)
                kc = keep.repeat_interleave(ours.shape[-1] // keep.shape[-1], -1)
                ao_same = (torch.equal(t.qdata.view(torch.uint8)[kc], ours[kc])
                           and torch.equal(t.scale.view(torch.uint8)[keep], s_gpu[keep]))
                note += "; torchao(cuda) " + ("bit-identical" if ao_same else "DIFFERS")
            except Exception as e:  # noqa: BLE001 - torchao is an optional peer here
                note += f"; torchao unavailable ({type(e).__name__})"
            rows.append((f"mx {fmt} {mode}: cuda vs cpu", "-", "-", note))


def _qat_check(rows, device):
    """k3_tiny with mx_qat on CUDA: forward+backward, and export -> import -> forward bit-exact."""
    from ..config import load_model_config
    from ..interop.k3_experts import export_model_experts, import_model_experts
    from ..model import K3ForCausalLM
    from .qat import ExpertQAT, enable_expert_qat

    cfg = load_model_config("k3_tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(device)
    enable_expert_qat(model, ExpertQAT())
    ids = torch.randint(0, cfg.vocab_size, (2, 128), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(ids, labels=ids.roll(-1, 1), return_logits=True)
    out.loss.backward()
    grads_ok = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    fresh = K3ForCausalLM(cfg).to(device)
    fresh.load_state_dict(model.state_dict())
    import_model_experts(fresh, export_model_experts(model))
    enable_expert_qat(fresh, ExpertQAT(weights=False))
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(ids).logits
        logits2 = fresh(ids).logits
    rows.append(("mx_qat k3_tiny fwd+bwd (bf16 autocast)", f"loss {out.loss.item():.4f}", "-",
                 f"grads finite: {grads_ok}; export->import logits bit-exact: {torch.equal(logits, logits2)}"))


def _te_checks(rows, device):
    try:
        te, _ = import_te("te_mxfp8")
    except ConfigError as e:
        rows.append(("te recipes", "-", "-", f"skipped: {e}"))
        return
    from ..ops.mx import fake_quant_mx, quantize_mx

    torch.manual_seed(0)
    M, K, N = 512, 1024, 768
    x = torch.randn(M, K, device=device)
    w = torch.randn(N, K, device=device) * 0.02
    ref_bf16 = (x.bfloat16() @ w.bfloat16().T).float()
    for name in RECIPES:
        try:
            check_available(name, device)
        except ConfigError as e:
            rows.append((f"{name} te.Linear", "-", "-", f"skipped: {e}"))
            continue
        lin = te.Linear(K, N, bias=False, params_dtype=torch.float32, device=device)
        with torch.no_grad():
            lin.weight.copy_(w)
        xin = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16), te_autocast(name):
            y = lin(xin)
        y.float().sum().backward()
        note = f"vs bf16 GEMM rel err {_rel(y.float(), ref_bf16):.2e}"
        if name == "te_mxfp8":  # our emulation: MXFP8 (E4M3, rceil as the hardware) operands, fp32 GEMM
            emu = fake_quant_mx(x, "e4m3", scale_mode="rceil") @ fake_quant_mx(w, "e4m3", scale_mode="rceil").T
            note += f"; vs emulated MXFP8 GEMM rel err {_rel(y.float(), emu):.2e}"
        t0 = time.perf_counter()
        for _ in range(10):
            with torch.autocast("cuda", dtype=torch.bfloat16), te_autocast(name):
                lin(xin)
        torch.cuda.synchronize()
        rows.append((f"{name} te.Linear {M}x{K}x{N}", f"{(time.perf_counter() - t0) * 100:.3f} ms/fwd", "-",
                     note + f"; grad finite {bool(torch.isfinite(xin.grad).all())}"))
    try:  # TE's own MXFP8 cast against ours, bit for bit (TE's scale tensor may be padded; compare its top-left)
        check_available("te_mxfp8", device)
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

        xq = _mx_inputs(256, 1024, device).bfloat16()
        q = MXFP8Quantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False).quantize(xq)
        codes, scales = quantize_mx(xq, "e4m3", scale_mode="rceil")
        te_codes = q._rowwise_data.view(torch.uint8)
        te_scales = q._rowwise_scale_inv.view(torch.uint8)[: scales.shape[0], : scales.shape[1]]
        rows.append(("te MXFP8Quantizer vs quantize_mx(e4m3, rceil)", "-", "-",
                     f"codes equal {(te_codes == codes).float().mean().item():.6f}, "
                     f"scales equal {(te_scales == scales).float().mean().item():.6f}"))
    except ConfigError as e:
        rows.append(("te MXFP8Quantizer vs quantize_mx", "-", "-", f"skipped: {e}"))


def gpu_check(args=None, rows=None) -> list:
    """Rows (check, ours, peer, result) for bench/gpu_check.py: our MX emulation on CUDA (vs CPU and torchao),
    mx_qat on k3_tiny, and, where TE and the GPU allow, te.Linear under both recipes against the emulation."""
    rows = [] if rows is None else rows
    if not torch.cuda.is_available():
        rows.append(("precision checks", "-", "-", "skipped: no CUDA device"))
        return rows
    device = torch.device("cuda")
    for fn in (_emulation_checks, _qat_check, _te_checks):
        try:
            fn(rows, device)
        except Exception as e:  # noqa: BLE001 - report every check, keep going
            rows.append((fn.__name__, "-", "-", f"FAILED: {type(e).__name__}: {e}"))
    return rows


if __name__ == "__main__":  # python -m megatron_k3.precision.te  (on a GPU machine)
    out = gpu_check()
    widths = [max(len(str(r[i])) for r in out) for i in range(4)]
    for r in out:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
