#!/usr/bin/env python
"""One full training step (forward, backward, AdamW) of our model configured as Kimi Linear against
Hugging Face's `KimiLinearForCausalLM` (its PyTorch path), same config, same weights, same batch, one
process. Prints tokens/s of each and the ratio ours / HF.

    .venv/bin/python bench/train_step.py [--batch 4] [--seq 512] [--steps 3]

transformers binds Kimi Linear's ops to fla's Triton kernels when fla is importable, and those need a GPU;
so this process blocks `fla` before importing transformers (our model never imports fla on CPU).
"""

from __future__ import annotations

import argparse
import importlib.abc
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in ("fla", "causal_conv1d"):
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked by bench/train_step.py)")
        return None


sys.meta_path.insert(0, _Block())

import torch  # noqa: E402

from megatron_k3.config import load_model_config  # noqa: E402
from megatron_k3.interop.kimi_linear import hf_config_from, map_hf_state_dict  # noqa: E402
from megatron_k3.model import K3ForCausalLM  # noqa: E402

# An 8-layer Kimi Linear (6 KDA + 2 MLA, layer 0 dense, 7 MoE layers of 16 experts, top-4), ~30M parameters.
OVERRIDES = ["vocab_size=16384", "hidden_size=256", "num_layers=8", "mla_layers=[4,8]", "kda_num_heads=4",
             "kda_head_dim=64", "mla_num_heads=4", "kv_lora_rank=64", "qk_nope_head_dim=64", "qk_rope_head_dim=32",
             "v_head_dim=64", "dense_intermediate_size=1024", "num_experts=16", "top_k=4",
             "moe_intermediate_size=256", "num_shared_experts=1"]


def time_steps(step_fn, steps, warmup=True):
    if warmup:
        step_fn()  # warm-up (allocations, first-call overheads)
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        loss = step_fn()
        ts.append(time.perf_counter() - t)
    return min(ts), sorted(ts)[len(ts) // 2], loss


def build_models(cfg):
    """HF's KimiLinearForCausalLM (fp32, sdpa, seed 0) and our K3ForCausalLM with its weights mapped in."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

    torch.manual_seed(0)
    hf_cfg = KimiLinearConfig(**hf_config_from(cfg))
    hf_cfg._attn_implementation = "sdpa"
    hf = KimiLinearForCausalLM(hf_cfg).float().train()
    ours = K3ForCausalLM(cfg).train()
    ours.load_state_dict(map_hf_state_dict(hf.state_dict(), cfg), strict=True)
    return hf, ours


def make_batch(vocab_size, batch, seq):
    """(inputs, labels) [batch, seq] from a seeded draw of batch x (seq + 1) token ids."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (batch, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def make_step(model, x, y, hf=False):
    """One training step (forward, cross-entropy, backward, AdamW lr 1e-4) of `model` on (x, y); returns the loss
    (computed before the update). hf: `model` is a transformers causal LM (logits out, loss computed here)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        if hf:
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        else:
            loss = model(x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    cfg = load_model_config("kimi_linear_tiny", OVERRIDES)
    hf, ours = build_models(cfg)
    n_params = sum(p.numel() for p in ours.parameters())
    x, y = make_batch(cfg.vocab_size, args.batch, args.seq)
    step_hf, step_ours = make_step(hf, x, y, hf=True), make_step(ours, x, y)

    with torch.no_grad():  # same weights, same batch: the same loss before any update
        l_h = torch.nn.functional.cross_entropy(hf(input_ids=x).logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
        l_o = ours(x, labels=y).loss
    t_o, med_o, _ = time_steps(step_ours, args.steps)
    t_h, med_h, _ = time_steps(step_hf, args.steps)
    tok = args.batch * args.seq
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"model: Kimi Linear layout, {cfg.num_layers} layers, {n_params / 1e6:.1f}M params; batch "
          f"{args.batch} x {args.seq}; loss before training: ours {l_o.item():.6f}, HF {l_h.item():.6f}")
    rows = [("impl", "best step s", "median step s", "tokens/s"),
            ("HF KimiLinearForCausalLM (torch path)", f"{t_h:.3f}", f"{med_h:.3f}", f"{tok / t_h:.0f}"),
            ("megatron_k3 K3ForCausalLM", f"{t_o:.3f}", f"{med_o:.3f}", f"{tok / t_o:.0f}")]
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(k) for c, k in zip(r, w)))
    print(f"ratio (ours / HF tokens/s): {t_h / t_o:.2f}x")


if __name__ == "__main__":
    main()
