"""Hugging Face Kimi Linear reference forward, run in its own process by tests/test_hf_kimi_linear.py.

    python tests/hf_reference.py SPEC.json

SPEC.json: {"config": {...KimiLinearConfig kwargs...}, "seed": int, "input_ids": [[...], ...], "out_dir": str}
Optional: "save_pretrained": DIR (also write the model with `save_pretrained`, i.e. the checkpoint layout transformers
writes), "load_from": DIR (instead of building and perturbing a model, load DIR with `from_pretrained`; "config"
and "seed" are then unused).

When `fla` (flash-linear-attention) is importable, transformers binds Kimi Linear's KDA and short-conv ops to
fla's Triton kernels, which need a GPU. This process therefore blocks `fla` (and the CUDA-only
`causal_conv1d`) with a meta-path finder *before* transformers is imported, so the model runs on transformers'
own PyTorch path on the CPU; it checks that it really does and records the evidence.

The model is built from the config, seeded, initialised by transformers, then every RMSNorm-like weight
(`*norm*.weight`) is set to 1 + 0.1 * randn and every `e_score_correction_bias` buffer to 0.05 * randn, so that
a wrong mapping of the norms or of the selection-only router bias cannot hide. The forward runs in fp32, eval
mode, without cache. Written to out_dir:
    state.safetensors   the full state dict (parameters and buffers)
    logits.safetensors  {"logits": [B, T, V] fp32}
    info.json           the effective config and which op implementations were used
"""

from __future__ import annotations

import importlib.abc
import json
import sys

BLOCKED = ("fla", "causal_conv1d")


class _BlockPackages(importlib.abc.MetaPathFinder):
    """Make `import fla` / `import fla.x` (and causal_conv1d) fail as if the package were not installed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked by tests/hf_reference.py)",
                                      name=fullname)
        return None


def _install_blocker():
    leaked = sorted(m for m in sys.modules if m.split(".", 1)[0] in BLOCKED)
    if leaked:
        raise RuntimeError(f"blocked packages already imported: {leaked}")
    sys.meta_path.insert(0, _BlockPackages())


def _implementation(fn):
    """The callable a transformers `use_kernel_func_from_hub_with_fallback` wrapper dispatches to."""
    import inspect

    nonlocals = inspect.getclosurevars(fn).nonlocals
    impl = nonlocals.get("implementation", fn)
    return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', repr(impl))}"


def _build(spec, torch, mkl, KimiLinearConfig):
    """The seeded model of spec["config"], with perturbed norm weights and router biases."""
    torch.manual_seed(int(spec["seed"]))
    config = KimiLinearConfig(**spec["config"])
    config._attn_implementation = "sdpa"
    model = mkl.KimiLinearForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(int(spec["seed"]) + 1)
    n_norm = n_bias = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                n_norm += 1
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
                n_bias += 1
    return model, config, n_norm, n_bias


def main(spec_path: str) -> None:
    _install_blocker()

    import torch
    from safetensors.torch import save_file
    from transformers.models.kimi_linear import modeling_kimi_linear as mkl
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    with open(spec_path) as f:
        spec = json.load(f)

    # ---- verify the torch path: nothing from fla is loaded and every kernel hook resolved to transformers' code
    ops = {name: _implementation(getattr(mkl, name)) for name in
           ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
            "causal_conv1d_update")}
    bad = {k: v for k, v in ops.items() if not v.startswith("transformers.models.kimi_linear.modeling_kimi_linear.")}
    if bad:
        raise RuntimeError(f"Kimi Linear ops are not bound to transformers' torch path: {bad}")

    n_norm = n_bias = 0
    if spec.get("load_from"):
        model, loading = mkl.KimiLinearForCausalLM.from_pretrained(
            spec["load_from"], dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True)
        problems = {k: sorted(v) for k, v in loading.items() if v}
        if problems:  # transformers only warns about these; a converter test must not pass over them
            raise RuntimeError(f"from_pretrained({spec['load_from']}): {problems}")
        model = model.eval()
        config = model.config
    else:
        model, config, n_norm, n_bias = _build(spec, torch, mkl, KimiLinearConfig)
        if spec.get("save_pretrained"):
            model.save_pretrained(spec["save_pretrained"])
    input_ids = torch.tensor(spec["input_ids"], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits.float()
    if not torch.isfinite(logits).all():
        raise RuntimeError("non-finite reference logits")

    leaked = sorted(m for m in sys.modules if m.split(".", 1)[0] in BLOCKED)
    if leaked:
        raise RuntimeError(f"blocked packages were imported anyway: {leaked}")

    out_dir = spec["out_dir"]
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(state, f"{out_dir}/state.safetensors")
    save_file({"logits": logits.contiguous()}, f"{out_dir}/logits.safetensors")
    effective = {k: getattr(config, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "intermediate_size",
        "moe_intermediate_size", "num_local_experts", "num_experts_per_tok", "n_shared_experts",
        "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group", "kv_lora_rank", "q_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_attention_heads", "num_key_value_heads",
        "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "hidden_act", "layer_types",
        "mlp_layer_types", "tie_word_embeddings")}
    info = {
        "config": effective,
        "ops": ops,
        "attn_implementation": config._attn_implementation,
        "fla_modules_loaded": [m for m in sys.modules if m.split(".", 1)[0] == "fla"],
        "perturbed_norm_weights": n_norm,
        "perturbed_correction_biases": n_bias,
        "device": str(logits.device),
        "torch": torch.__version__,
    }
    with open(f"{out_dir}/info.json", "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
