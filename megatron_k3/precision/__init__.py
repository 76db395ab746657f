"""What a run's `precision=` does to the model and around its forward.

    fp32       nothing
    bf16       bf16 autocast (master weights, optimizer states fp32)
    mx_qat     bf16 autocast + MX fake-quantisation of the routed experts (qat.py)
    te_fp8     bf16 autocast + TransformerEngine Float8BlockScaling linears (Hopper; te.py)
    te_mxfp8   bf16 autocast + TransformerEngine MXFP8BlockScaling linears (Blackwell; te.py)

The training loop calls `prepare_model_for_precision(model, run.precision)` once, after the model is built and
moved to its device and before the optimizer is built, and runs each forward inside
`forward_context(run.precision, device)` (or a torch.autocast with `autocast_dtype(run.precision)`, which is
equivalent for every precision but te_*). Nothing here imports TransformerEngine unless precision is te_*.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from ..errors import ConfigError
from ..parallel.recompute import FORWARD_CONTEXTS
from .qat import ExpertQAT, enable_expert_qat, expert_qat_from_config
from .te import check_available, swap_linears, te_autocast

log = logging.getLogger("megatron_k3.precision")

PRECISIONS = ("fp32", "bf16", "mx_qat", "te_fp8", "te_mxfp8")
TE_PRECISIONS = ("te_fp8", "te_mxfp8")


def autocast_dtype(precision_cfg):
    """The torch.autocast dtype of the forward (torch.bfloat16), or None for full fp32."""
    return torch.bfloat16 if precision_cfg.dtype == "bf16" else None


def prepare_model_for_precision(model, precision_cfg, device=None):
    """Set the model up for the precision (in place) and return it. Raises ConfigError (one line) when the
    precision cannot run here: expert dims not multiples of the MX block, TransformerEngine missing, no GPU
    with the recipe's SM."""
    name = precision_cfg.name
    if name not in PRECISIONS:
        raise ConfigError("precision", name, "valid: " + ", ".join(PRECISIONS))
    if name == "mx_qat":
        qat = expert_qat_from_config(precision_cfg)
        try:
            n = enable_expert_qat(model, qat)
        except ValueError as e:
            raise ConfigError("precision", name, str(e)) from None
        log.info("precision=mx_qat: %d routed-expert modules: weights %s, activations %s, blocks of %d (%s / %s "
                 "scales)", n, qat.weight_format, qat.act_format, qat.block_size, qat.weight_scale_mode,
                 qat.act_scale_mode)
    elif name in TE_PRECISIONS:
        if device is None:
            device = next(model.parameters()).device
        check_available(name, device)
        swap_linears(model, name)
    return model


class forward_context:
    """Reusable context manager for the forward pass: torch.autocast at autocast_dtype, plus TE's FP8 autocast
    for te_*. (Backward runs outside it, as both torch and TE expect; a recomputation in the backward re-enters TE's,
    through parallel.recompute.FORWARD_CONTEXTS, and torch's checkpoint restores torch's autocast itself.)"""

    def __init__(self, precision_cfg, device):
        self.name, self.dtype = precision_cfg.name, autocast_dtype(precision_cfg)
        self.device_type = torch.device(device).type
        self._stack = None

    def __enter__(self):
        stack = contextlib.ExitStack()
        if self.dtype is not None:
            stack.enter_context(torch.autocast(self.device_type, dtype=self.dtype))
        if self.name in TE_PRECISIONS:
            stack.enter_context(te_autocast(self.name))
            make = functools.partial(te_autocast, self.name)  # one factory per entry, popped at its exit
            FORWARD_CONTEXTS.append(make)
            stack.callback(FORWARD_CONTEXTS.remove, make)
        self._stack = stack
        return self

    def __exit__(self, *exc):
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc)


__all__ = ["PRECISIONS", "prepare_model_for_precision", "autocast_dtype", "forward_context", "ExpertQAT",
           "enable_expert_qat"]
