"""TransformerEngine backend for precision=te_fp8 (Hopper: Float8BlockScaling) and te_mxfp8 (Blackwell:
MXFP8BlockScaling): capability checks that fail with one line, the nn.Linear -> te.Linear swap and the FP8
autocast context. The GPU self-check against our emulated MX path lives in bench/gpu_check.py.

TransformerEngine is imported inside functions only: importing this module on a CPU machine touches nothing
of it. The routed experts (grouped GEMM), the router, the LM head and layers whose dims TE cannot take stay
in bf16.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from ..annotations import copy_meta
from ..errors import ConfigError

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
        raise ConfigError("precision", name,
                          f"TransformerEngine is not installed (requirements-gpu.txt): {why}") from None
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


def swap_linears(model: nn.Module, name: str, skip=SKIP_MODULES) -> list:
    """Replace every nn.Linear (the single-device model's; tensor-parallel linears are not swapped) whose dims are
    multiples of the recipe's alignment by a te.Linear holding the same values (parameter names and annotations
    unchanged; TE adds its `_extra_state`). Call it before the optimizer is built. Returns the swapped names."""
    te, _ = import_te(name)
    align = _recipe_info(name)[3]
    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if not isinstance(child, nn.Linear) or child_name in skip or full in skip:
                continue
            w, b = child.weight, child.bias
            out_f, in_f = w.shape
            if out_f % align or in_f % align:
                continue
            lin = te.Linear(in_f, out_f, bias=b is not None, params_dtype=w.dtype, device=w.device)
            with torch.no_grad():
                lin.weight.copy_(w)
                if b is not None:
                    lin.bias.copy_(b)
            copy_meta(w, lin.weight)
            if b is not None:
                copy_meta(b, lin.bias)
            setattr(parent, child_name, lin)
            swapped.append(full)
    log.info("precision=%s: %d linear layers run through te.Linear", name, len(swapped))
    return swapped
