"""K3ForConditionalGeneration as a model: multimodal prefill + decode against the full forward, the tower under
pipeline cuts and Per-Head Muon, freezing, the 2D rotary embedding against its complex-number definition, and the
refusals (context parallelism with media, a pipeline stage without the tower given pixels).

Decode: 1e-4 relative in fp32 (measured ~1e-6): the chunked KDA form of the prefill and the recurrent form of
decode sum in different orders. (The checkpoint-level equality against an independent implementation is
tests/test_vision.py; training layouts tests/test_vision_train.py.)"""

import pytest
import torch

from megatron_k3.config import load_model_config
from megatron_k3.model import K3ForCausalLM, K3ForConditionalGeneration, causal_lm_class
from megatron_k3.model.multimodal import expand_placeholders
from megatron_k3.model.vision import apply_rope_2d, rope_2d
from megatron_k3.optim import muon_rule
from megatron_k3.parallel.pipeline import cut_stage

PID = 8192


@pytest.fixture(scope="module")
def cfg():
    return load_model_config("k3_vl_tiny", ["num_layers=4", "moe_overflow=dropless"])


@pytest.fixture(scope="module")
def model(cfg):
    torch.manual_seed(0)
    return K3ForConditionalGeneration(cfg).eval()


def _media(grids, seed=1):
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor(grids)
    return torch.randn(int(grid.prod(1).sum()), 3, 14, 14, generator=g), grid


def test_config_picks_the_class(cfg):
    assert causal_lm_class(cfg) is K3ForConditionalGeneration
    assert causal_lm_class(load_model_config("k3_tiny")) is K3ForCausalLM
    with pytest.raises(ValueError, match="model.vision.enabled"):
        K3ForConditionalGeneration(load_model_config("k3_tiny"))


@pytest.mark.parametrize("grids", [[[1, 4, 6]], [[4, 4, 4]], [[1, 2, 2], [3, 4, 2]]], ids=["image", "video", "mixed"])
def test_multimodal_prefill_then_decode_equals_the_full_forward(model, grids):
    pv, grid = _media(grids)
    counts = [(h // 2) * (w // 2) for _, h, w in grids]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 8000, (1, 6 + 4 * len(grids)), generator=g)
    ids[0, [2 + 3 * i for i in range(len(grids))]] = PID
    expanded, _ = expand_placeholders(ids, None, counts, PID)
    with torch.no_grad():
        full = model(expanded, pixel_values=pv, grid_thws=grid, return_logits=True).logits
        compact = model(ids, pixel_values=pv, grid_thws=grid, return_logits=True).logits
    assert torch.equal(full, compact)
    prefill = int((expanded[0] == PID).nonzero().max()) + 1  # every medium inside the prefill
    steps = model.generate_logits(expanded, prefill, pixel_values=pv, grid_thws=grid)
    err = ((steps - full).abs().max() / full.abs().max()).item()
    assert err < 1e-4, err
    with pytest.raises(ValueError, match="after the prefill"):
        model.generate_logits(expanded, 1, pixel_values=pv, grid_thws=grid)


def test_features_reach_the_logits_and_media_change_them(model):
    pv, grid = _media([[1, 4, 4]])
    ids = torch.full((1, 8), 5)
    ids[0, 2:6] = PID
    with torch.no_grad():
        a = model(ids, pixel_values=pv, grid_thws=grid, return_logits=True).logits
        b = model(ids, pixel_values=pv.flip(0), grid_thws=grid, return_logits=True).logits
    assert torch.allclose(a[:, :2], b[:, :2], atol=1e-5)  # causal: before the image nothing moves (but rounding)
    assert (a[:, 2:] - b[:, 2:]).abs().max() > 1e-3


def test_rope_2d_is_the_complex_rotation_of_column_and_row():
    grids, hd = [(2, 3, 4)], 8
    cos, sin = rope_2d(grids, hd, 10000.0, "cpu")
    x = torch.randn(24, 2, hd)
    got = apply_rope_2d(x, cos, sin)
    f = 1.0 / (10000.0 ** (torch.arange(0, hd, 4).float() / hd))
    for n in range(24):
        r, c = (n % 12) // 4, n % 4  # frame-major, then row, then column; frames share the rotation
        ang = torch.stack([c * f, r * f], -1).flatten()
        z = torch.view_as_complex(x[n].reshape(2, hd // 2, 2).contiguous()) * torch.polar(torch.ones(hd // 2), ang)
        assert torch.allclose(torch.view_as_real(z).flatten(1), got[n], atol=1e-6)


def test_pipeline_cut_keeps_the_tower_on_the_first_stage(cfg, model):
    import copy
    first, last = cut_stage(copy.deepcopy(model), 2, 0), cut_stage(copy.deepcopy(model), 2, 1)
    assert first.vision_tower is not None and last.vision_tower is None and last.mm_projector is None
    pv, grid = _media([[1, 2, 2]])
    with pytest.raises(ValueError, match="without the vision tower"):
        last(torch.zeros(1, 4, dtype=torch.long), pixel_values=pv, grid_thws=grid)


def test_per_head_muon_covers_the_tower_heads_and_freezing_leaves_it_out(cfg, model):
    blk = model.vision_tower.encoder.blocks[0]
    assert muon_rule(blk.wqkv.weight) == muon_rule(blk.wo.weight) == "muon/per_head"
    assert muon_rule(blk.mlp.fc0.weight) == "muon/matrix"
    assert muon_rule(model.vision_tower.patch_embed.proj.weight).startswith("adamw/")
    from dataclasses import replace

    from megatron_k3.config import OptimConfig
    from megatron_k3.optim import build_optimizer
    frozen = K3ForConditionalGeneration(replace(cfg, freeze_vision=True))
    tower = {id(p) for p in frozen.vision_parameters()}
    assert tower and not any(p.requires_grad for p in frozen.vision_parameters())
    for name in ("muon", "adamw"):
        opt = build_optimizer(frozen, OptimConfig(name=name))
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        assert not held & tower and held  # the text model is still optimised


def test_bad_media_input_is_named(model):
    pv, grid = _media([[1, 4, 4]])
    ids = torch.full((1, 8), 5)
    ids[0, 1:4] = PID  # 3 placeholders: neither 1 medium nor 4 features
    with pytest.raises(ValueError, match="3 placeholder tokens.*1 media.*4 feature rows"):
        model(ids, pixel_values=pv, grid_thws=grid)
    with pytest.raises(ValueError, match=r"medium 0: grid \(t=1, h=3, w=4\) does not fit the 2x2 merge kernel"):
        model.vision_features(torch.randn(12, 3, 14, 14), torch.tensor([[1, 3, 4]]))
    with pytest.raises(ValueError, match="5 frames"):
        model.vision_features(torch.randn(80, 3, 14, 14), torch.tensor([[5, 4, 4]]))
    with pytest.raises(ValueError, match="add up to 16 patches but pixel_values has 15"):
        model.vision_features(pv[:15], grid)


def _tp_media(rank, world, grids, sp):
    """One forward + backward of k3_vl_tiny under tp=`world` (the media split over the ranks): loss, features and
    the tower's and projector's gradients."""
    from megatron_k3.parallel import ParallelGroups, parallelize, state

    ps = state.initialize_model_parallel(tp=world)
    try:
        cfg = load_model_config("k3_vl_tiny", ["num_layers=2", "moe_overflow=dropless"])
        model = K3ForConditionalGeneration(cfg, init=False)
        model = parallelize(model, ParallelGroups.from_state(ps, sequence_parallel=sp))
        model.reset_parameters(0)
        pv, grid = _media(grids)
        counts = [(h // 2) * (w // 2) for _, h, w in grids]
        ids = torch.arange(1, 1 + 2 * len(grids)).reshape(1, -1) * 7
        ids[0, ::2] = PID
        ids, _ = expand_placeholders(ids, None, counts, PID)
        ids = torch.cat([ids, torch.full((1, (-ids.shape[1]) % 4), 3)], 1)  # SP: a multiple of tp (same in every world)
        out = model(ids, labels=ids.roll(-1, 1), pixel_values=pv, grid_thws=grid)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith(("vision", "mm_"))}
        with torch.no_grad():
            feats = model.vision_features(pv, grid)
        return float(out.loss), feats, grads
    finally:
        state.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("grids,sp", [([[1, 2, 4]], False), ([[4, 2, 2], [1, 4, 4], [1, 2, 2]], False),
                                      ([[1, 4, 2], [2, 2, 2]], True)], ids=["one-medium", "three-media", "sp"])
def test_media_split_over_tensor_parallel_ranks_equals_one_process(grids, sp):
    """Under tp=2 each rank encodes its share of the media (one medium: rank 1 encodes none) and the features are
    gathered; the tower's gradients (summed over the ranks) equal one process's to 1e-5 (fp32 reordering)."""
    from dist_utils import run_distributed

    ref = run_distributed(_tp_media, 1, grids, False)[0]
    for loss, feats, grads in run_distributed(_tp_media, 2, grids, sp):
        assert abs(loss - ref[0]) <= 1e-5 * abs(ref[0])
        assert torch.allclose(feats, ref[1], rtol=1e-5, atol=1e-6)
        for n, g in ref[2].items():
            assert ((grads[n] - g).norm() / g.norm()).item() < 1e-5, n
