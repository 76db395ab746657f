"""Per-Head Muon (megatron_k3.optim.muon): Newton-Schulz against its scalar polynomial and its singular-value
band, per-head and per-expert independence, the grouping rules, QK-Clip, decoupled weight decay, Nesterov
momentum and the AdamW half against plain references, the config keys."""

import logging
import math

import pytest
import torch
from torch import nn

from megatron_k3.annotations import annotate as set_meta
from megatron_k3.annotations import meta
from megatron_k3.config import ConfigError, OptimConfig, RunConfig, compose_run_config, load_model_config
from megatron_k3.model import K3ForCausalLM
from megatron_k3.model.mla import GatedMLA, document_causal_mask
from megatron_k3.optim import build_optimizer
from megatron_k3.optim.grouping import muon_rule
from megatron_k3.optim.muon import NS_COEFFICIENTS, QKClip, newton_schulz, to_blocks

BAND = (0.6, 1.25)
# NS5's scalar map p sends s in [SMALLEST, 1] into BAND, and nothing below SMALLEST (computed below).
SMALLEST = 1.302e-3


def _p5(s):
    a, b, c = NS_COEFFICIENTS
    for _ in range(5):
        s = a * s + b * s ** 3 + c * s ** 5
    return s


def test_scalar_map_band():
    s = torch.logspace(-5, 0, 100001, dtype=torch.float64)
    y = _p5(s)
    inside = (y >= BAND[0]) & (y <= BAND[1])
    assert y.max() < 1.21
    assert s[inside].min() > SMALLEST * 0.999 and s[~inside].max() < SMALLEST * 1.001


@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (64, 64), (3, 48, 64), (2, 64, 48), (1, 96)])
def test_newton_schulz_is_its_scalar_polynomial(shape):
    """NS5(G) = U p(S / ||G||_F) V^T for G = U S V^T, batched, tall, wide and square (fp64 SVD reference;
    fp32 iteration: 1e-4)."""
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    F = G.flatten(-2).norm(dim=-1)[..., None]
    ref = U @ torch.diag_embed(_p5(S / F)) @ Vh
    out = newton_schulz(G.float()).double()
    assert (out - ref).abs().max() < 1e-4


def _muon_block_shapes(model_name, overrides=()):
    """The [A, B] shapes Newton-Schulz runs on for every Muon parameter of the model (per-head on)."""
    model = K3ForCausalLM(load_model_config(model_name, overrides), init=False)
    shapes = set()
    for p in model.parameters():
        rule = muon_rule(p)
        if rule.startswith("muon/"):
            layout = {"muon/expert": "batched", "muon/matrix": "matrix"}.get(rule, "blocks")
            x = to_blocks(torch.empty(p.shape, device="meta"), layout, meta(p).blocks, meta(p).block_axis)
            shapes.add(tuple(x.shape[-2:]))
    return shapes


# K3's attention head blocks (MODEL.md 6.3: KDA [128, 7168] / [7168, 128], MLA q_b [192, 1536], kv_b [256, 512])
K3_HEAD_BLOCKS = [(128, 7168), (7168, 128), (192, 1536), (256, 512)]


def test_newton_schulz_band_on_our_shapes():
    """Random Gaussian matrices of every shape Muon orthogonalises in k3_tiny, and K3's head blocks: every
    singular value of NS5's output lies in [0.6, 1.25]. Square shapes are the exception the band cannot
    cover: a square Gaussian's smallest singular value falls below SMALLEST * ||G||_F with high probability,
    and 5 steps cannot lift it (k3_tiny's experts are 64 x 64; see test_square_shapes_outside_band_only_below)."""
    shapes = sorted(s for s in _muon_block_shapes("k3_tiny") if s[0] != s[1]) + K3_HEAD_BLOCKS
    assert (32, 128) in shapes and (128, 32) in shapes and (48, 64) in shapes  # KDA and MLA head blocks
    g = torch.Generator().manual_seed(2)
    for shape in shapes:
        G = torch.randn(2, *shape, generator=g)
        s = torch.linalg.svdvals(newton_schulz(G).double())
        assert BAND[0] <= s.min() and s.max() <= BAND[1], (shape, s.min().item(), s.max().item())
    G = torch.randn(4, 32, 128, generator=g)  # the bf16 iteration (ns_dtype=auto on CUDA) stays in the band too
    s = torch.linalg.svdvals(newton_schulz(G, dtype=torch.bfloat16).double())
    assert BAND[0] <= s.min() and s.max() <= BAND[1]


def test_square_shapes_outside_band_only_below():
    """On square Gaussians (k3_tiny's 64 x 64 experts, 128 x 128 shared MLP) every singular value at least
    SMALLEST * ||G||_F lands in the band and none exceeds it; only the smaller ones stay below 0.6."""
    g = torch.Generator().manual_seed(3)
    for n in (64, 128):
        G = torch.randn(8, n, n, generator=g, dtype=torch.float64)
        s_in = torch.linalg.svdvals(G) / G.flatten(1).norm(dim=1)[:, None]
        s_out = torch.linalg.svdvals(newton_schulz(G.float()).double())  # both sorted descending
        assert s_out.max() <= BAND[1]
        big = s_in >= SMALLEST * 1.01
        assert (s_out[big] >= BAND[0]).all()


def _rms_per_block(u, n, axis):
    return to_blocks(u, "blocks", n, axis).pow(2).mean(dim=(1, 2)).sqrt()


def _one_step_update(weight_shape, grad, per_head, annotate):
    """The update Muon applies in one step (lr 1, no decay) to a parameter annotated by `annotate`."""
    p = nn.Parameter(torch.zeros(weight_shape))
    annotate(p)
    opt = build_optimizer(_Holder(p), OptimConfig(name="muon", lr=1.0, weight_decay=0.0, per_head=per_head,
                                                  ns_dtype="fp32"))
    p.grad = grad.clone()
    opt.step()
    return -p.detach()


class _Holder(nn.Module):
    def __init__(self, *params):
        super().__init__()
        self.ps = nn.ParameterList(params)


@pytest.mark.parametrize("H,K,D,axis,shrinks_below", [
    (2, 32, 128, 0, 0.9),  # k3_tiny KDA q/k/v/gate: 2 heads of [32, 128]
    (2, 32, 128, 1, 0.9),  # k3_tiny KDA o_proj: 2 heads of [128, 32], head axis 1
    (8, 128, 1024, 0, 0.6),  # closer to K3's [128, 7168] blocks
])
def test_per_head_independence(H, K, D, axis, shrinks_below):
    """One head's gradient x100: under Per-Head Muon the other heads' update RMS is unchanged; under
    whole-matrix Muon it shrinks (the big head takes the spectral budget)."""
    shape = (H * K, D) if axis == 0 else (D, H * K)
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    G100 = G.clone()
    to_blocks(G100, "blocks", H, axis)[0] *= 100
    annotate = lambda p: set_meta(p, blocks=H, block_axis=axis, block_kind="heads")  # noqa: E731
    for per_head in (True, False):
        before = _rms_per_block(_one_step_update(shape, G, per_head, annotate), H, axis)[1:]
        after = _rms_per_block(_one_step_update(shape, G100, per_head, annotate), H, axis)[1:]
        ratio = after / before
        if per_head:
            assert (ratio - 1).abs().max() < 1e-6, ratio
            # the scale 0.2 sqrt(max(block dims)) gives each head's update an RMS of 0.2 times the mean
            # singular value of NS5's output (which lies in the band)
            assert (before >= 0.2 * BAND[0]).all() and (before <= 0.2 * BAND[1]).all(), before
        else:
            assert ratio.max() < shrinks_below, ratio


def test_experts_are_independent():
    """Routed experts [E, A, B] and fused shared-expert blocks: one expert's gradient x100 leaves the others'
    updates unchanged (never orthogonalised across the expert axis)."""
    g = torch.Generator().manual_seed(5)

    def experts(axis):
        return lambda p: set_meta(p, blocks=2, block_axis=axis, block_kind="experts")

    cases = [((4, 64, 32), lambda p: set_meta(p, batched=True), lambda t: t),
             ((2 * 48, 64), experts(0), lambda t: t.view(2, 48, 64)),
             ((64, 2 * 48), experts(1), lambda t: t.view(64, 2, 48).transpose(0, 1))]
    for shape, annotate, blocks in cases:
        G = torch.randn(*shape, generator=g)
        G100 = G.clone()
        blocks(G100)[0] *= 100
        a = blocks(_one_step_update(shape, G, True, annotate))
        b = blocks(_one_step_update(shape, G100, True, annotate))
        assert torch.allclose(a[1:], b[1:], rtol=0, atol=1e-6), shape


EXPECTED_RULES = {  # k3_tiny parameter-name fragment -> rule
    "embed_tokens.weight": "adamw/embedding", "lm_head.weight": "adamw/lm_head",
    "_res.proj.weight": "adamw/attn_res_query", "output_attn_res.proj.weight": "adamw/attn_res_query",
    "layernorm.weight": "adamw/vector", "norm.weight": "adamw/vector", "A_log": "adamw/vector",
    "dt_bias": "adamw/vector", "o_norm": "adamw/vector", "conv1d": "adamw/not_matrix",
    "experts.w1": "muon/expert", "experts.w2": "muon/expert", "experts.w3": "muon/expert",
    "shared_experts.gate_proj.weight": "muon/shared_expert", "shared_experts.down_proj.weight": "muon/shared_expert",
    "self_attn.q_proj.weight": "muon/per_head", "self_attn.k_proj.weight": "muon/per_head",
    "self_attn.v_proj.weight": "muon/per_head", "self_attn.g_proj.weight": "muon/per_head",
    "self_attn.o_proj.weight": "muon/per_head", "q_b_proj.weight": "muon/per_head",
    "kv_b_proj.weight": "muon/per_head", "q_a_proj.weight": "muon/matrix", "kv_a_proj_with_mqa.weight": "muon/matrix",
    "f_a_proj.weight": "muon/matrix", "f_b_proj.weight": "muon/matrix", "b_proj.weight": "muon/matrix",
    "shared_experts.up_proj.weight": "muon/shared_expert", "mlp.gate.weight": "muon/matrix",
    "latent_down_proj.weight": "muon/matrix", "latent_up_proj.weight": "muon/matrix",
    "layers.0.mlp.gate_proj.weight": "muon/matrix", "layers.0.mlp.up_proj.weight": "muon/matrix",
    "layers.0.mlp.down_proj.weight": "muon/matrix",
}


def test_grouping_rules_and_log(caplog):
    cfg = load_model_config("k3_tiny", ["num_shared_experts=2"])
    model = K3ForCausalLM(cfg, init=False)
    for name, p in model.named_parameters():
        frags = [frag for frag in EXPECTED_RULES if frag in name]
        assert frags, f"no expectation for {name}"
        expected = EXPECTED_RULES[max(frags, key=len)]  # the most specific fragment
        assert muon_rule(p) == expected, (name, muon_rule(p), expected)
    heads = {n: (meta(p).blocks, meta(p).block_axis) for n, p in model.named_parameters()
             if meta(p).block_kind == "heads"}
    assert heads["model.layers.0.self_attn.q_proj.weight"] == (cfg.kda_num_heads, 0)
    assert heads["model.layers.0.self_attn.o_proj.weight"] == (cfg.kda_num_heads, 1)
    assert heads["model.layers.3.self_attn.kv_b_proj.weight"] == (cfg.mla_num_heads, 0)
    with caplog.at_level(logging.INFO, logger="megatron_k3.optim"):
        opt = build_optimizer(model, OptimConfig(name="muon"))
    text = "\n".join(r.getMessage() for r in caplog.records)
    total = sum(p.numel() for p in model.parameters())
    rows = {g["rule"]: sum(p.numel() for p in g["params"]) for g in opt.param_groups}
    assert sum(rows.values()) == total
    for rule, n in rows.items():
        assert rule in text and f"{n:,}" in text
    assert {g["rule"]: g["weight_decay"] for g in opt.param_groups}["adamw/embedding"] == 0.0
    whole = build_optimizer(model, OptimConfig(name="muon", per_head=False))
    assert "muon/per_head" not in {g["rule"] for g in whole.param_groups}


def test_build_adamw_is_the_previous_adamw():
    model = K3ForCausalLM(load_model_config("k3_tiny"), init=False)
    opt = build_optimizer(model, OptimConfig(name="adamw"))
    assert type(opt) is torch.optim.AdamW
    decay = {id(p) for p in opt.param_groups[0]["params"]}
    for n, p in model.named_parameters():
        assert (id(p) in decay) == (p.ndim >= 2 and "embed_tokens" not in n), n
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def _mla(seed=0):
    cfg = load_model_config("k3_tiny", ["mla_num_heads=4"])
    torch.manual_seed(seed)
    m = GatedMLA(cfg, 3)
    for p in m.parameters():
        nn.init.normal_(p, 0.0, 0.3) if p.ndim >= 2 else None
    return m


def _reference_max_logits(m, x, cu):
    """Plain recomputation: q, k as the module forms them, every allowed score, max per head."""
    B, T, _ = x.shape
    q = m._queries(x)
    c, k_r = m._latents(x)
    k_nope = m.kv_b_proj(c).view(B, T, m.H, m.N + m.V)[..., : m.N]
    k = torch.cat([k_nope, k_r[:, :, None, :].expand(B, T, m.H, m.R)], dim=-1)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * m.scale
    allowed = document_causal_mask(cu, T) if cu is not None else torch.ones(T, T).tril().bool()
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("cu", [None, torch.tensor([0, 7, 40, 300])])
def test_qk_clip_tracks_and_rescales(cu):
    """The forward's per-head max logit equals a plain recomputation (1e-5); QK-Clip brings every head over
    the threshold to exactly the threshold and leaves the others alone (1e-5)."""
    m = _mla().train()
    x = torch.randn(1, 300, 128, generator=torch.Generator().manual_seed(6))
    clip = QKClip(m, threshold=1.0)
    assert m.track_max_logit
    with torch.no_grad():
        ref = _reference_max_logits(m, x, cu)
        m(x, cu_seqlens=cu)
        m(x[:, :7], cu_seqlens=None)  # a second micro-batch, whose logits are a subset: the max stands
    assert torch.allclose(m.max_logit_H, ref, rtol=1e-5)
    tau = float(ref.sort().values[1])  # two heads over, two under
    clip.threshold = tau
    changed = clip.apply()
    assert {id(p) for p in changed} == {id(m.q_b_proj.weight), id(m.kv_b_proj.weight)}
    assert m.max_logit_H is None and clip.last_clipped_heads == 2
    with torch.no_grad():
        after = _reference_max_logits(m, x, cu)
    expected = torch.minimum(ref, torch.full_like(ref, tau))
    assert torch.allclose(after, expected, rtol=1e-5), (after, expected)
    m.eval()
    with torch.no_grad():
        m(x, cu_seqlens=cu)
    assert m.max_logit_H is None  # evaluation forwards are not tracked


def test_weight_decay_is_decoupled():
    """W <- W - lr (update + wd W): the decay never enters the momentum or the orthogonalisation."""
    g = torch.Generator().manual_seed(7)
    W0, G = torch.randn(48, 64, generator=g), torch.randn(48, 64, generator=g)
    results = {}
    for wd in (0.0, 0.1):
        p = nn.Parameter(W0.clone())
        opt = build_optimizer(_Holder(p), OptimConfig(name="muon", lr=0.05, weight_decay=wd, ns_dtype="fp32"))
        for _ in range(3):
            p.grad = G.clone()
            opt.step()
        results[wd] = p.detach()
    # three steps: W3 = W0 (1 - lr wd)^3 - lr sum_i (1 - lr wd)^(2 - i) U_i, with U_i independent of wd
    p = nn.Parameter(torch.zeros(48, 64))
    opt = build_optimizer(_Holder(p), OptimConfig(name="muon", lr=1.0, weight_decay=0.0, ns_dtype="fp32"))
    updates = []
    for _ in range(3):
        before = p.detach().clone()
        p.grad = G.clone()
        opt.step()
        updates.append(before - p.detach())
    k = 1 - 0.05 * 0.1
    expected = W0 * k ** 3 - 0.05 * (updates[0] * k ** 2 + updates[1] * k + updates[2])
    assert torch.allclose(results[0.1], expected, atol=1e-6)
    p = nn.Parameter(W0.clone())  # a zero gradient: only the decay acts
    opt = build_optimizer(_Holder(p), OptimConfig(name="muon", lr=0.05, weight_decay=0.1))
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(p.detach(), W0 * (1 - 0.05 * 0.1))


def _plain_ns(X, steps=5):
    a, b, c = NS_COEFFICIENTS
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def _plain_muon(W, grads, lr, wd, mu, nesterov, heads, axis):
    """Muon written out for one matrix split into `heads` blocks along `axis`, one block at a time."""
    W, M = W.clone(), torch.zeros_like(W)
    for G in grads:
        M = mu * M + G
        U = G + mu * M if nesterov else M
        O = torch.empty_like(U)
        for h in range(heads):
            sl = [slice(None), slice(None)]
            size = U.shape[axis] // heads
            sl[axis] = slice(h * size, (h + 1) * size)
            block = U[tuple(sl)]
            O[tuple(sl)] = _plain_ns(block) * 0.2 * math.sqrt(max(block.shape))
        W = W * (1 - lr * wd) - lr * O
    return W


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("heads,axis", [(1, 0), (4, 0), (4, 1)])
def test_momentum_and_update_match_plain_reference(nesterov, heads, axis):
    g = torch.Generator().manual_seed(8)
    W0 = torch.randn(64, 96, generator=g) * 0.02
    grads = [torch.randn(64, 96, generator=g) for _ in range(4)]
    p = nn.Parameter(W0.clone())
    if heads > 1:
        set_meta(p, blocks=heads, block_axis=axis, block_kind="heads")
    opt = build_optimizer(_Holder(p), OptimConfig(name="muon", lr=0.01, weight_decay=0.1, momentum=0.9,
                                                  nesterov=nesterov, ns_dtype="fp32"))
    for G in grads:
        p.grad = G.clone()
        opt.step()
    ref = _plain_muon(W0, grads, 0.01, 0.1, 0.9, nesterov, heads, axis)
    assert torch.allclose(p.detach(), ref, rtol=0, atol=1e-6)


def test_adamw_half_is_torch_adamw():
    """The AdamW groups step exactly like torch.optim.AdamW (same formula, operation for operation)."""
    model = K3ForCausalLM(load_model_config("k3_tiny", ["num_layers=2", "hidden_size=32"]))
    ids = torch.randint(0, 8192, (1, 32), generator=torch.Generator().manual_seed(9))
    muon = build_optimizer(model, OptimConfig(name="muon", lr=0.01))
    aux = [g for g in muon.param_groups if not g["use_muon"]]
    start = {id(p): p.detach().clone() for g in aux for p in g["params"]}
    ref_params = [nn.Parameter(start[id(p)].clone()) for g in aux for p in g["params"]]
    it = iter(ref_params)
    ref = torch.optim.AdamW([{"params": [next(it) for _ in g["params"]], "weight_decay": g["weight_decay"]}
                             for g in aux], lr=0.01, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        for q, p in zip(ref_params, (p for g in aux for p in g["params"])):
            q.grad = None if p.grad is None else p.grad.clone()
        muon.step()
        ref.step()
        muon.zero_grad()
    for q, p in zip(ref_params, (p for g in aux for p in g["params"])):
        assert torch.equal(q.detach(), p.detach())


@pytest.mark.parametrize("override,key", [
    ("optim.momentum=1.5", "optim.momentum"), ("optim.ns_steps=0", "optim.ns_steps"),
    ("optim.ns_dtype=fp8", "optim.ns_dtype"), ("optim.muon_scale=0", "optim.muon_scale"),
    ("optim.qk_clip=-1", "optim.qk_clip"), ("optim.beta2=1.0", "optim.beta2"),
])
def test_bad_muon_config_is_one_line(override, key):
    with pytest.raises(ConfigError) as e:
        compose_run_config(["optim=muon", override])
    assert e.value.key == key and "\n" not in str(e.value)


def test_muon_config_composes():
    run, _, _ = compose_run_config(["optim=muon"])
    o = run.optim
    assert (o.name, o.momentum, o.nesterov, o.ns_steps, o.muon_scale, o.per_head, o.qk_clip) == \
        ("muon", 0.95, True, 5, 0.2, True, 0.0)
    bad = RunConfig()
    bad.optim.name, bad.optim.qk_clip = "adamw", 100.0  # QK-Clip belongs to optim=muon
    with pytest.raises(ConfigError, match="optim.qk_clip"):
        bad.validate()
