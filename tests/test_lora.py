"""peft=lora (megatron_k3.peft): adapters over a frozen base whose routed experts stay MXFP4 codes.

- With B = 0 the adapted model's logits equal the base model's bit for bit: the base read by load_hf (experts
  dequantised into trained-expert modules) against the adapted one read by load_hf_sharded (codes kept, decoded a
  block at a time), under the dropless and the static dispatch, fp32 and mx_qat.
- Only adapters take gradients, and an adapted linear's gradients equal float64 autograd through W + s B A.
- The Trainer: layouts (tp2 + SP, pp2, ep2, cp2, dp2 ZeRO-1) equal one process, resume bit for bit from a checkpoint
  that holds the adapters only (its size bounded), the base re-read from the directory the checkpoint records.
- Bad input names the key before anything is allocated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import FAST, STATIC, full_params, load_file, make_trainer, norm_rel, run_distributed

from megatron_k3.config import ConfigError, compose_run_config
from megatron_k3.interop import load_hf, load_hf_sharded, save_hf
from megatron_k3.model import K3ForCausalLM
from megatron_k3.parallel import tiling
from megatron_k3.peft import FrozenExperts, adapted_parameters, apply_lora, is_adapter, token_ids
from megatron_k3.precision import forward_context, prepare_model_for_precision

# the token rows: frequent ids of the embedded BPE on both halves of the vocabulary (both TP ranks hold some)
TOKENS = "peft.trainable_tokens=[256-300,4096-4200]"
LORA = ["peft=lora", "peft.rank=4", "peft.targets=[kda,mla,mlp,shared_experts,latent,experts,lm_head]", TOKENS]


def _run(overrides=()):
    return compose_run_config(FAST + LORA + list(overrides))[0]


def _k3_dir(path, run) -> None:
    """A K3 directory (bf16, MXFP4 experts) of the seed-0 model of `run`."""
    torch.manual_seed(0)
    save_hf(K3ForCausalLM(run.model), path, layout="k3")


def _base_and_adapted(path, run):
    base = load_hf(path, config=run.model)
    prepare_model_for_precision(base, run.precision)
    adapted = K3ForCausalLM(run.model, init=False)
    prepare_model_for_precision(adapted, run.precision)
    apply_lora(adapted, run.peft, seed=0)
    load_hf_sharded(adapted, path, group=None)
    return base, adapted


@pytest.mark.parametrize("more", [[], STATIC, ["precision=mx_qat"]], ids=["dropless", "drop", "mx_qat"])
def test_b_zero_equals_the_base_bit_for_bit_and_only_adapters_learn(tmp_path, more):
    run = _run(more)
    _k3_dir(tmp_path / "k3", run)
    base, adapted = _base_and_adapted(tmp_path / "k3", run)
    moe = [m for m in adapted.modules() if isinstance(m, FrozenExperts)]
    assert moe and all(m.w1_packed.dtype == torch.uint8 for m in moe)
    ids = torch.randint(0, run.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with forward_context(run.precision, "cpu"):
        want = base(ids).logits
        out = adapted(ids, labels=ids, return_logits=True)
    assert torch.equal(out.logits, want)
    out.loss.backward()
    learned = {n for n, p in adapted.named_parameters() if p.grad is not None}
    assert learned == {n for n, _ in adapted_parameters(adapted)}
    assert all(not p.requires_grad for n, p in adapted.named_parameters() if n not in learned)
    assert all(float(p.grad.abs().sum()) > 0 for n, p in adapted.named_parameters() if n.endswith("lora_B"))


def test_token_rows_train_as_the_weights_rows_would_and_tile_with_the_head():
    """peft.trainable_tokens: with its delta at zero the adapted model equals the one without token rows bit for bit;
    the delta's gradient is the gradient the embedding's and the LM head's rows of those ids would get were the
    weights trained (the same autograd, to fp32 rounding); only those rows take one. With the delta and the head's B
    moved off zero, the LM head tiled by train.tile_tokens computes the same loss and gradients as untiled (fp32
    summation order), the adapters' terms included."""
    run = _run()
    ids = torch.randint(0, run.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3))
    ids[0, :8] = torch.tensor([256, 257, 300, 4096, 4150, 4200, 260, 256])
    plain = _adapted(_run(["peft.trainable_tokens=[]"]))
    rows = _adapted(run)
    for m in (plain.model.embed_tokens, plain.lm_head):
        m.weight.requires_grad_(True)
    a, b = plain(ids, labels=ids, return_logits=True), rows(ids, labels=ids, return_logits=True)
    assert torch.equal(a.logits, b.logits)
    a.loss.backward()
    b.loss.backward()
    picked = token_ids(run.peft.trainable_tokens)
    for name in ("model.embed_tokens", "lm_head"):
        mod = rows.get_submodule(name)
        want = plain.get_submodule(name).weight.grad[picked]
        assert torch.allclose(mod.token_delta.grad, want, rtol=1e-5, atol=1e-7), name
        assert int((mod.token_delta.grad.abs().sum(1) > 0).sum()) >= 6, name
    with torch.no_grad():
        for p in (rows.model.embed_tokens.token_delta, rows.lm_head.token_delta, rows.lm_head.lora_B):
            p.normal_(0, 0.02)
    grads = {}
    for tile in (0, 32):
        rows.zero_grad()
        if tile:
            tiling.apply(rows, tile, run.model.moe_overflow)
        loss = rows(ids, labels=ids).loss
        loss.backward()
        grads[tile] = (loss.detach(), {n: p.grad.clone() for n, p in rows.named_parameters() if p.grad is not None})
    assert torch.allclose(grads[0][0], grads[32][0], rtol=1e-6)
    assert sorted(grads[0][1]) == sorted(grads[32][1])
    assert all(norm_rel(grads[32][1][n], g) < 1e-5 for n, g in grads[0][1].items())


def _adapted(run):
    torch.manual_seed(0)
    model = K3ForCausalLM(run.model)
    apply_lora(model, run.peft, seed=0)
    return model


def _steps(rank, world, variants, run_dir):
    """2 Trainer steps per variant (name, overrides): the losses and the full-size adapters after."""
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    out = {}
    for name, more in variants:
        run, _, _ = compose_run_config(FAST + LORA + more + ["train.steps=2", "checkpoint.load=none"],
                                       world_size=world)
        try:
            t = Trainer(run, f"{run_dir}/{name}/{rank}")
            losses = [t.train_step()[0]["loss"] for _ in range(2)]
            out[name] = (losses, {n: p for n, p in full_params(t).items() if is_adapter(n)})
        finally:
            shutdown()
    return out


@pytest.mark.slow
def test_layouts_equal_one_process(tmp_path):
    """tp2 + SP, pp2, ep2 (drop at a capacity that drops nothing; balanced, its replicas' codes and adapters
    exchanged per micro-batch and per step), cp2 and dp2 (ZeRO-1) against one process, one after another in one
    2-process world: losses to fp32 summation order and every adapter after 2 AdamW steps
    (helpers' layout tolerances); B moved off zero in every layout."""
    from helpers import PARAM_RTOL, RTOL

    ref_loss, ref = _steps(0, 1, [("one", [])], str(tmp_path / "one"))["one"]
    layouts = [("tp2", ["parallel.tp=2", "parallel.sequence_parallel=true"]), ("pp2", ["parallel.pp=2"]),
               ("ep2", ["parallel.ep=2"] + STATIC), ("ep2_balanced", ["parallel.ep=2", "model.moe_overflow=balanced"]),
               ("ep2_balanced_step", ["parallel.ep=2", "model.moe_overflow=balanced", "moe.replica_exchange=step"]),
               ("cp2", ["parallel.cp=2"]), ("dp2", [])]
    ranks = run_distributed(_steps, 2, layouts, str(tmp_path / "layouts"), timeout=600)
    assert all(float(p.abs().max()) > 0 for n, p in ref.items() if n.endswith("lora_B"))
    moved = ref["model.embed_tokens.token_delta"].abs().sum(1) > 0  # rows of both vocabulary halves trained
    assert moved[:45].any() and moved[45:].any()
    for name, _ in layouts:
        loss = ranks[-1][name][0]  # pp: the loss on the last stage
        params = {}
        for r in ranks:
            params.update(r[name][1])
        assert sorted(params) == sorted(ref), name
        assert loss == pytest.approx(ref_loss, rel=RTOL), name
        worst = max((norm_rel(p, ref[n]), n) for n, p in params.items())
        assert worst[0] < PARAM_RTOL, (name, worst)


def _trainer_steps(overrides, steps, save=False):
    """A Trainer of FAST + LORA + overrides, resumed (or started) as a run starts, after `steps` steps: (losses, its
    full-size adapters, its router biases, the adapter parameters on this rank)."""
    from megatron_k3.training.engine import shutdown

    try:
        t = make_trainer(1, LORA + overrides)
        t.maybe_resume()
        losses = [t.train_step()[0]["loss"] for _ in range(steps)]
        if save:
            t.save()
        adapters = {n: p for n, p in full_params(t).items() if is_adapter(n)}
        return losses, adapters, [m.gate.e_score_correction_bias.clone() for m in t.moe], t.peft["trainable"]
    finally:
        shutdown()


def _bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.slow
def test_resume_is_bit_identical_and_the_checkpoint_holds_adapters_only(tmp_path):
    """4 steps straight from a K3 directory, against 2 steps, a save, and a restart with checkpoint.load=auto that
    reads the base again from the directory the checkpoint records and the adapters from the checkpoint: losses,
    adapters and router biases bit for bit. The checkpoint holds the adapters, their AdamW states and the run state:
    no base tensor, and at most 12 bytes per adapter parameter (fp32 master, two moments) plus 256 KB (the
    indexes, ~0.4 KB per tensor, the RNG states, meta.json); a full checkpoint of the same model is ~15x larger."""
    from megatron_k3.training.checkpoint.shards import ShardIndex

    _k3_dir(tmp_path / "k3", _run())
    base = [f"checkpoint.load={tmp_path / 'k3'}"]
    straight, want, bias, _ = _trainer_steps(base + [f"checkpoint.dir={tmp_path / 'a'}"], 4)
    first, _, _, trainable = _trainer_steps(base + [f"checkpoint.dir={tmp_path / 'b'}"], 2, save=True)
    second, got, got_bias, _ = _trainer_steps([f"checkpoint.dir={tmp_path / 'b'}"], 2)
    assert straight == first + second
    assert all(torch.equal(want[n], got[n]) for n in want) and sorted(want) == sorted(got)
    assert all(torch.equal(a, b) for a, b in zip(bias, got_bias))
    saved = tmp_path / "b" / "step_00000002"
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["peft"]["base"] == str((tmp_path / "k3").resolve()) and meta["peft"]["rank"] == 4
    index = ShardIndex(saved)
    try:
        weights = {n for n in index.names() if "::" not in n}
    finally:
        index.close()
    assert weights == set(want)  # the routers' selection bias is the frozen base's: no balancing under peft=lora
    assert _bytes(saved) <= 12 * trainable + 256 * 1024, (_bytes(saved), trainable)


def _refusal(overrides) -> str:
    """The one-line ConfigError a LoRA Trainer of `overrides` raises (composing, or starting: before its model is
    built, so nothing was allocated)."""
    from megatron_k3.training import loop
    from megatron_k3.training.engine import shutdown

    built = []
    real = loop.build_model
    loop.build_model = lambda *a, **k: built.append(1) or real(*a, **k)
    try:
        with pytest.raises(ConfigError) as e:
            make_trainer(1, LORA + overrides)
    finally:
        loop.build_model = real
        shutdown()
    assert not built, "refused after the model was built"
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.slow
def test_bad_input_names_the_key_before_anything_is_built(tmp_path):
    assert "peft.targets='router'" in _refusal(["peft.targets=[router]"])
    assert "valid: kda, mla" in _refusal(["peft.targets=[router]"])
    assert "kda has no projection 'nope'" in _refusal(["peft.targets=[kda.nope]"])
    msg = _refusal(["peft.targets=[shared_experts]", "model.num_shared_experts=0"])
    assert "peft.targets='shared_experts': names no module" in msg
    msg = _refusal(["peft.rank=40", "peft.targets=[kda.b_proj]"])
    assert "peft.rank=40" in msg and "b_proj (64 -> 2)" in msg and "rank <= 2" in msg
    assert "peft='qlora': valid: none, lora" in _refusal(["peft.name=qlora"])
    assert "train.compile=True" in _refusal(["train.compile=true"])
    assert "peft.trainable_tokens='8190-x'" in _refusal(["peft.trainable_tokens=[8190-x]"])
    msg = _refusal(["peft.trainable_tokens=[8190-8200]"])
    assert "peft.trainable_tokens=8200: not a token of this model: model.vocab_size is 8192" in msg
    for bad in ("peft.alpha=0", "peft.init=orthogonal", "peft.rank=0"):
        assert bad.split("=")[0] in _refusal([bad])
    torch.manual_seed(0)
    save_hf(K3ForCausalLM(_run(["model=kimi_linear_tiny"]).model), tmp_path / "dense", layout="kimi_linear")
    msg = _refusal(["model=kimi_linear_tiny", "peft.targets=[latent]"])
    assert "peft.targets='latent': names no module of this model (kimi_linear_tiny); kinds it has: experts, kda, " \
        "lm_head, mla, mlp, shared_experts" in msg
    msg = _refusal(["model=kimi_linear_tiny", "peft.targets=[kda]", f"checkpoint.load={tmp_path / 'dense'}"])
    assert f"checkpoint.load='{tmp_path / 'dense'}'" in msg and "stores them dense" in msg


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


@pytest.mark.slow
def test_peft_export_and_merge_match_the_adapted_model(tmp_path, capsys):
    """A trained run's adapters -> tools/convert_checkpoint.py --to-peft -> --merge-lora into the K3 directory they
    were trained over.
    - tools/chat.py's reader (chat_eval.load_for_inference) rebuilds the adapted model from the checkpoint and the
      base it records; its logits equal W + s B A merged in memory (fp32, to 1e-5: summation order).
    - The PEFT directory names K3 modules (every adapter's module is a tensor of the base), shapes [r, in] and
      [out, r], as many elements as the checkpoint's adapters.
    - The merged directory's weights against the exact merge: dense tensors within bf16 rounding (2^-8 relative);
      the routed experts re-encoded to MXFP4 add MXFP4's own quantisation noise (printed, bounded at 0.2), where a
      bf16 merge of the same matrices would add 2^-8."""

    from megatron_k3.interop.directory import read_index
    from megatron_k3.interop.peft_layout import read_peft
    from megatron_k3.training.chat_eval import load_for_inference
    from megatron_k3.training.checkpoint import directory as ckpt

    cc = load_file(Path(__file__).parent.parent / "tools" / "convert_checkpoint.py")
    run = _run()
    _k3_dir(tmp_path / "k3", run)
    _trainer_steps([f"checkpoint.load={tmp_path / 'k3'}", f"checkpoint.dir={tmp_path / 'c'}", "optim.lr=3e-2"], 2,
                   save=True)
    assert cc.main([str(tmp_path / "c"), str(tmp_path / "peft"), "--to-peft"]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16.0
    base_names, _ = read_index(tmp_path / "k3")
    _, adapters, tokens = read_peft(tmp_path / "peft")
    ids = token_ids(run.peft.trainable_tokens)
    assert config["trainable_token_indices"] == {"embed_tokens": ids, "lm_head": ids}
    assert len(tokens) == 2
    for module, (rows, values) in tokens.items():  # PEFT's values: the base's rows plus what training added
        assert f"{module}.weight" in base_names and rows.tolist() == ids
        assert values.shape == (len(ids), run.model.hidden_size) and values.dtype == torch.float32
    for module, (a, b) in adapters.items():
        assert f"{module}.weight" in base_names or f"{module}.weight_packed" in base_names, module
        assert a.shape[0] == b.shape[1] == 4
    saved, _, _ = ckpt.read_full(ckpt.resolve_load_path(str(tmp_path / "c"), tmp_path / "c"), states=False)
    n_peft = sum(a.numel() + b.numel() for a, b in adapters.values()) + sum(v.numel() for _, v in tokens.values())
    assert n_peft == sum(t.numel() for t in saved.values())
    assert cc.main([str(tmp_path / "k3"), str(tmp_path / "merged"), "--merge-lora", str(tmp_path / "peft")]) == 0
    ids = torch.randint(0, run.model.vocab_size, (1, 64), generator=torch.Generator().manual_seed(2))
    adapted = load_for_inference(tmp_path / "c")  # tools/chat.py's reader: the recorded base, the adapters unmerged
    assert any(isinstance(m, FrozenExperts) for m in adapted.modules())
    assert all(torch.equal(p, saved[n]) for n, p in adapted.named_parameters() if n in saved)
    want = _logits(adapted, ids)
    exact = _merged_in_memory(adapted, load_hf(tmp_path / "k3", config=run.model))
    assert _rel(_logits(exact, ids), want) < 1e-5  # the adapters' maths: W + s B A, in fp32
    merged = dict(load_hf(tmp_path / "merged", config=run.model).named_parameters())
    dense, mx, bf16 = 0.0, [], []
    for n, w in exact.named_parameters():
        if ".experts.w" in n:
            mx.append(_rel(merged[n], w))
            bf16.append(_rel(w.bfloat16().float(), w))
        elif w.dtype == torch.float32 and merged[n].dtype == torch.float32:
            dense = max(dense, _rel(merged[n], w))
    print(f"LoRA merge, merged weights against the exact fp32 merge W + s B A (relative, per matrix kind, worst): "
          f"dense tensors {dense:.1e} (bf16 storage); routed experts re-encoded to MXFP4 {max(mx):.3f} (mean "
          f"{sum(mx) / len(mx):.3f}), where a bf16 merge would add {max(bf16):.1e}")
    assert dense <= 2 ** -8 and max(mx) < 0.2 and max(bf16) < 2 ** -8


def _rel(a, b) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@torch.no_grad()
def _merged_in_memory(adapted, plain):
    """`plain` (the base with trained experts' modules, fp32) with the adapters of `adapted` added: W + s B A."""
    mods = dict(plain.named_modules())
    for name, m in adapted.named_modules():
        if isinstance(m, FrozenExperts) and m.rank:
            for n, w in zip(("w1", "w3", "w2"), m.merged(torch.float32)):
                getattr(mods[name], n).copy_(w)
            continue
        if hasattr(m, "token_delta"):  # trained token rows first, as the adapted model computes
            mods[name].weight[m.token_local] += m.token_delta.float()[m.token_pick]
        if hasattr(m, "lora_A"):
            mods[name].weight += m.lora_scale * m.lora_B.float() @ m.lora_A.float()
    return plain


def _build_rank(*args, timeout=900):
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, str(root / "tools" / "build_rank.py"), "peft=lora", "optim=adamw", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=root)


@pytest.mark.slow
def test_build_rank_counts_frozen_and_trainable_apart_as_the_planner_does():
    """tools/build_rank.py peft=lora: every rank of k3_tiny at tp2 x pp2 x ep2 built on the meta device as the
    Trainer builds it (adapters applied, experts frozen as MXFP4 codes) holds the planner's parameters for its stage,
    frozen and trainable alike (trained token rows on both TP ranks' vocabulary blocks included), and the union
    covers the model and its adapters once; one rank materialised runs a
    step whose gradients are the adapters' only, its live-tensor peak at most the planner's figure."""
    out = _build_rank("model=k3_tiny", "cluster.num_nodes=1", "cluster.devices_per_node=8", "parallel.tp=2",
                      "parallel.pp=2", "parallel.ep=2", "peft.trainable_tokens=[4000-4200]", "--all", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["params_match_planner"] and rep["covered_equals_total"], rep["coverage_problems"]
    assert rep["total_params"] == 4488780 + rep["adapter_params"]
    for e in rep["ranks"]:
        assert e["trainable_params"] == e["planned_trainable_params"] > 0
        assert e["frozen_params"] > 4 * e["trainable_params"]
    out = _build_rank("model=k3_tiny", "cluster.num_nodes=1", "cluster.devices_per_node=2", "parallel.ep=2",
                      "train.seq_length=1024", "train.micro_batch_size=1", "train.global_batch_size=2",
                      "--rank", "0", "--step", "--recompute", "none", "--json")
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)["materialized"][0]
    assert m["step"]["grads_bytes"] == 2 * m["planner_step"]["params"]  # bf16 gradients of the adapters alone
    assert 0.3 < m["measured_over_planned"] <= 1.0, m["measured_over_planned"]


@pytest.mark.slow
def test_k3_lora_fits_one_supernode_at_4096_tokens():
    """Issue 35's plan: tools/build_rank.py model=k3 cluster=supernode_64 peft=lora --search --all: the planner's
    best layout fits 141 GB with 4096-token sequences, and its 64 ranks built on the meta device hold the planned
    parameters, frozen and trainable apart, covering K3 (2.78T) and its adapters once."""
    out = _build_rank("model=k3", "cluster=supernode_64", "--search", "--all", "--json", timeout=600)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["world"] == 64 and rep["planner"]["fits"] and rep["planner"]["memory_per_device_gb"] <= 141
    assert rep["params_match_planner"] and rep["covered_equals_total"]
    assert rep["total_params"] == 2_779_484_393_568 + rep["adapter_params"]
