"""K3 vision-language interop: `load_hf` of a K3 checkpoint with a vision tower builds
K3ForConditionalGeneration, whose logits from pixels and placeholder tokens match tests/k3_vl_reference.py (an
independent plain-torch MoonViT-3D + patchmergerv2 + the K3 text reference of tests/k3_reference.py, importing
nothing from megatron_k3); `save_hf` writes the released layout back; `load_hf(vision=False)` gives the text model;
bad media inputs are refused with messages that name the culprit. First the reference's own building blocks are
checked against their textbook forms (rotation, reshape, identity), so a shared misreading cannot hide there."""

from __future__ import annotations

import json
import logging
import math
import re
from types import SimpleNamespace

import k3_reference as ref
import k3_vl_reference as vref
import pytest
import torch
import torch.nn.functional as F
from helpers import max_abs_rel
from safetensors import safe_open

from megatron_k3.interop import load_hf, save_hf
from megatron_k3.model import K3ForCausalLM, K3ForConditionalGeneration

RTOL = 1e-4  # fp32 model against the float64 reference (the text part alone measures ~1e-5)
VC = vref.VISION_CONFIG
PH = VC["media_placeholder_token_id"]
P = VC["patch_size"]

# media and where their placeholders sit (row, position) in input_ids [B, S]; rows of one batch merge to equal
# lengths: row 0 16 + 6 feature rows, row 1 6 + 16
CASES = {
    "image": dict(grids=[(1, 4, 6)], B=1, S=14, at=[(0, 5)]),
    "video": dict(grids=[(4, 4, 4)], B=1, S=12, at=[(0, 3)]),
    "batch": dict(grids=[(1, 8, 8), (1, 4, 6), (3, 6, 4), (1, 4, 16)], B=2, S=12, at=[(0, 2), (0, 7), (1, 0),
                                                                                      (1, 9)]),
}


def _pixels(grids, seed=0):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3, P, P, generator=torch.Generator().manual_seed(seed))


def _ids(B, S, at=(), seed=0):
    ids = torch.randint(1, PH, (B, S), generator=torch.Generator().manual_seed(seed))  # no pad (0), no placeholder
    for b, s in at:
        ids[b, s] = PH
    return ids


def _features_per_medium(grids):
    kh, kw = VC["merge_kernel_size"]
    return [(h // kh) * (w // kw) for _, h, w in grids]


def _expanded(ids, grids):
    """The same input with one placeholder per feature row."""
    n = iter(_features_per_medium(grids))
    rows = [torch.cat([torch.full((next(n),), PH) if tok == PH else torch.tensor([tok]) for tok in row.tolist()])
            for row in ids]
    return torch.stack(rows)


def emb_of(tensors, ids):
    return tensors[vref.PREFIX + "model.embed_tokens.weight"].double()[ids]


# ------------------------------------------------------------------------------------------------ the reference
def test_reference_rope_is_a_rotation_of_adjacent_pairs():
    hd, h, w = 8, 3, 5
    ang = vref.rope_angles(h, w, hd)
    f = [10000.0 ** (-4 * i / hd) for i in range(hd // 4)]
    for y in range(h):
        for x in range(w):  # column angle first, then row angle, per frequency
            expect = [a for i in range(hd // 4) for a in (x * f[i], y * f[i])]
            assert torch.allclose(ang[y * w + x], torch.tensor(expect, dtype=torch.float64), rtol=0, atol=1e-15)
    q = torch.randn(h * w, 2, hd, dtype=torch.float64)
    out = vref.apply_rope(q, ang)
    for j in range(hd // 2):  # pair j: the 2x2 rotation matrix of its angle on (q[2j], q[2j+1])
        c, s = ang[:, j].cos()[:, None], ang[:, j].sin()[:, None]
        assert torch.allclose(out[..., 2 * j], c * q[..., 2 * j] - s * q[..., 2 * j + 1], atol=1e-14)
        assert torch.allclose(out[..., 2 * j + 1], s * q[..., 2 * j] + c * q[..., 2 * j + 1], atol=1e-14)
    as_complex = torch.view_as_complex(q.view(h * w, 2, hd // 2, 2)) * torch.polar(torch.ones_like(ang), ang)[:, None]
    assert torch.allclose(out, torch.view_as_real(as_complex).flatten(-2), atol=1e-14)
    # a score depends on the offset between the two patches only: (0,0)-(1,2) alike (1,1)-(2,3) (row, column)
    qv, kv = torch.randn(1, 1, hd, dtype=torch.float64).expand(h * w, 1, hd), torch.randn(1, 1, hd).double()
    s = torch.einsum("ahd,bhd->ab", vref.apply_rope(qv, ang), vref.apply_rope(kv.expand(h * w, 1, hd), ang))
    assert torch.allclose(s[0 * w + 0, 1 * w + 2], s[1 * w + 1, 2 * w + 3])
    assert not torch.allclose(s[0 * w + 0, 1 * w + 2], s[0 * w + 0, 2 * w + 1])  # rows and columns differ


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_the_position_table_is_interpolated_as_f_interpolate_does(mode):
    """model.vision.interpolate_table (one matrix per axis: deterministic on CUDA) against F.interpolate, forward and
    the table's gradient, on random tables and grids (shrunk, grown, one side, 1 x 1): fp64 to 1e-12 (the same terms
    in another order), fp32 to 4e-6 (sums of up to H0 terms reordered), bf16 to 1e-2 (one rounding of each)."""
    from megatron_k3.model.vision import interpolate_table

    g = torch.Generator().manual_seed(7)
    for _ in range(6):
        H0, W0 = (int(v) for v in torch.randint(2, 40, (2,), generator=g))
        h, w = (int(v) for v in torch.randint(1, 80, (2,), generator=g))
        for dt, tol in ((torch.float64, 1e-12), (torch.float32, 4e-6), (torch.bfloat16, 1e-2)):
            t = torch.randn(H0, W0, 5, generator=g, dtype=torch.float64).to(dt).requires_grad_()
            want = F.interpolate(t.permute(2, 0, 1)[None], size=(h, w), mode=mode, align_corners=False)[0]
            want = want.permute(1, 2, 0)
            got = interpolate_table(t, h, w, mode)
            go = torch.randn(h, w, 5, generator=g, dtype=torch.float64).to(dt)
            (g_want,), (g_got,) = torch.autograd.grad(want, t, go), torch.autograd.grad(got, t, go)
            assert got.dtype == dt and got.shape == (h, w, 5)
            assert max_abs_rel(got, want) < tol and max_abs_rel(g_got, g_want) < tol, (H0, W0, h, w, dt)


def test_reference_position_embedding_and_merge():
    g = torch.Generator().manual_seed(1)
    H0, W0, D = VC["init_pos_emb_height"], VC["init_pos_emb_width"], VC["vt_hidden_size"]
    table = torch.randn(H0, W0, D, generator=g, dtype=torch.float64)
    assert torch.equal(vref.position_embedding(table, 1, H0, W0), table.reshape(H0 * W0, D))  # identity
    const = torch.ones(H0, W0, D, dtype=torch.float64) * 0.25
    assert torch.allclose(vref.position_embedding(const, 1, 4, 6), torch.full((24, D), 0.25, dtype=torch.float64))
    half = vref.position_embedding(table, 1, H0 // 2, W0 // 2).view(H0 // 2, W0 // 2, D)  # bilinear, no corners
    assert torch.allclose(half, table.view(H0 // 2, 2, W0 // 2, 2, D).mean((1, 3)))
    video = vref.position_embedding(table, 3, 4, 6).view(3, 24, D)
    te = vref.time_embedding(D, 3).double()
    assert torch.allclose(te[0], torch.cat([torch.zeros(D // 2), torch.ones(D // 2)]).double())
    omega = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) / (D / 2))
    assert torch.allclose(te[2], torch.cat([(2 * omega).sin(), (2 * omega).cos()]), atol=1e-6)
    for f in range(3):
        assert torch.allclose(video[f], vref.position_embedding(table, 1, 4, 6) + te[f])
    with pytest.raises(ValueError):
        vref.position_embedding(table, VC["init_pos_emb_time"] + 1, 4, 6)
    # the merge of a single frame: group (r, c) holds patches (2r, 2c), (2r, 2c+1), (2r+1, 2c), (2r+1, 2c+1)
    x = torch.arange(4 * 6, dtype=torch.float64)[:, None].expand(24, 3)
    m = vref.merge(x, torch.tensor([[1, 4, 6]]))[0]
    assert m.shape == (6, 4, 3)
    assert m[:, :, 0].tolist() == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11], [12, 13, 18, 19],
                                   [14, 15, 20, 21], [16, 17, 22, 23]]
    x2 = torch.randn(2 * 24, 5, generator=g, dtype=torch.float64)  # two frames: the mean of the frames' groups
    m2 = vref.merge(x2, torch.tensor([[2, 4, 6]]))[0]
    one = [vref.merge(x2[i * 24:(i + 1) * 24], torch.tensor([[1, 4, 6]]))[0] for i in range(2)]
    assert torch.allclose(m2, (one[0] + one[1]) / 2)


def test_reference_tower_properties():
    tensors = vref.random_vl_checkpoint(seed=3)
    w = tensors["vision_tower.patch_embed.proj.weight"].double()
    px = _pixels([(1, 4, 6)], seed=3).double()
    conv = F.conv2d(px, w, stride=P).flatten(1)  # the Conv2d of the released patch embedding
    assert torch.allclose(conv, px.flatten(1) @ w.flatten(1).T, atol=1e-12)
    # attention stays within a medium: a medium's features do not change when another one joins it
    grids = [(1, 4, 6), (2, 4, 4)]
    px2 = _pixels(grids, seed=4)
    both = vref.vision_features_per_medium(tensors, px2, torch.tensor(grids))
    alone = vref.vision_features_per_medium(tensors, px2[24:], torch.tensor(grids[1:]))
    assert torch.allclose(both[1], alone[0], atol=1e-12)
    assert [f.shape for f in both] == [(6, VC["text_hidden_size"]), (4, VC["text_hidden_size"])]
    # ... but frames of one medium see each other: changing frame 1 changes the features of frame 0's pooling
    px3 = px2.clone()
    px3[24 + 16:] += 1
    changed = vref.vision_features_per_medium(tensors, px3, torch.tensor(grids))
    assert torch.allclose(changed[0], both[0], atol=1e-12) and not torch.allclose(changed[1], both[1])
    with pytest.raises(ValueError, match="medium 1"):
        vref.vision_features(tensors, px2, torch.tensor([[1, 4, 6], [2, 4, 5]]))


def test_reference_merge_and_text_only():
    tensors = vref.random_vl_checkpoint(seed=2)
    text = {k[len(vref.PREFIX):]: v for k, v in tensors.items() if k.startswith(vref.PREFIX)}
    ids = _ids(1, 6, seed=2)
    emb = text["model.embed_tokens.weight"].double()[ids]
    assert torch.equal(vref.forward(tensors, ids), ref.forward(text, None, embeds=emb))
    media = [torch.full((2, 128), 1.0, dtype=torch.float64), torch.full((3, 128), 2.0, dtype=torch.float64)]
    ids = _ids(2, 4, at=[(0, 1), (1, 3)], seed=2)
    ids[1, 0] = PH
    with pytest.raises(ValueError, match="3 placeholders for 2 media"):
        vref.merge_embeddings(tensors, ids, media)
    ids = _ids(2, 5, at=[(0, 1), (1, 4)], seed=2)
    merged = vref.merge_embeddings(tensors, ids, [media[0], torch.ones(2, 128)])
    assert merged.shape == (2, 6, 128)
    assert torch.equal(merged[0, 1:3], media[0]) and torch.equal(merged[0, 3:], emb_of(tensors, ids[0, 2:]))


# ------------------------------------------------------------------------------------------------ ours vs it
@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3vl")
    tensors = vref.random_vl_checkpoint(seed=0)
    vref.write_vl_checkpoint(d / "ref", tensors)
    model = load_hf(d / "ref").eval()
    cases = {}
    for seed, (name, c) in enumerate(CASES.items()):
        px, grid = _pixels(c["grids"], seed), torch.tensor(c["grids"])
        ids = _ids(c["B"], c["S"], c["at"], seed)
        cases[name] = SimpleNamespace(px=px, grid=grid, ids=ids, logits=vref.forward(tensors, ids, px, grid),
                                      grids=c["grids"])
    ids = _ids(2, 16, seed=7)
    cases["text"] = SimpleNamespace(px=None, grid=None, ids=ids, logits=vref.forward(tensors, ids), grids=[])
    return SimpleNamespace(d=d, tensors=tensors, model=model, cases=cases)


def _ours(model, ids, px=None, grid=None):
    with torch.no_grad():
        return model(ids, pixel_values=px, grid_thws=grid, return_logits=True).logits


def test_load_builds_the_vision_language_model(vl):
    assert isinstance(vl.model, K3ForConditionalGeneration)
    assert all(p.dtype == torch.float32 for p in vl.model.parameters())


@pytest.mark.parametrize("case", ["image", "video", "text", "batch"])
def test_logits_match_the_reference(vl, case):
    c = vl.cases[case]
    out = _ours(vl.model, c.ids, c.px, c.grid)
    S = _expanded(c.ids, c.grids).shape[1]  # S - placeholders + feature rows, per row
    assert out.shape == c.logits.shape == (c.ids.shape[0], S, ref.TEXT_CONFIG["vocab_size"])
    err = max_abs_rel(out, c.logits)
    print(f"K3 VL {case}: logits vs independent reference {err:.2e}")
    assert err < RTOL


@pytest.mark.parametrize("case", ["image", "video", "batch"])
def test_expanded_placeholders_equal_compact(vl, case):
    c = vl.cases[case]
    expanded = _expanded(c.ids, c.grids)
    assert int((expanded == PH).sum()) == sum(_features_per_medium(c.grids))
    out_e, out_c = _ours(vl.model, expanded, c.px, c.grid), _ours(vl.model, c.ids, c.px, c.grid)
    err_c, err_r = max_abs_rel(out_e, out_c), max_abs_rel(out_e, c.logits)
    print(f"K3 VL {case}: expanded vs compact {err_c:.2e}, vs reference {err_r:.2e}")
    assert err_c < 1e-6 and err_r < RTOL


def test_rows_of_unequal_length(vl):
    """Rows whose merged lengths differ (15 and 13 here) come back right-padded to the longest; a causal model's
    real positions are those of each row alone."""
    grids = [(1, 4, 6), (2, 4, 4)]
    px, ids = _pixels(grids, seed=12), _ids(2, 10, at=[(0, 3), (1, 8)], seed=12)
    out = _ours(vl.model, ids, px, torch.tensor(grids))
    assert out.shape == (2, 15, ref.TEXT_CONFIG["vocab_size"])
    row0 = vref.forward(vl.tensors, ids[:1], px[:24], torch.tensor(grids[:1]))
    row1 = vref.forward(vl.tensors, ids[1:], px[24:], torch.tensor(grids[1:]))
    err = max(max_abs_rel(out[0], row0[0]), max_abs_rel(out[1, :13], row1[0]))
    print(f"K3 VL rows of unequal length vs the reference of each row {err:.2e}")
    assert err < RTOL


def test_vision_features_match_the_reference(vl):
    grids = CASES["batch"]["grids"] + CASES["video"]["grids"]
    px, grid = _pixels(grids, seed=11), torch.tensor(grids)
    with torch.no_grad():
        ours = vl.model.vision_features(px, grid)
    theirs = vref.vision_features(vl.tensors, px, grid)
    assert ours.shape == theirs.shape == (sum(_features_per_medium(grids)), VC["text_hidden_size"])
    err = max_abs_rel(ours, theirs)
    # negative control: the position table transposed (rows for columns) must be seen
    swapped = dict(vl.tensors)
    key = "vision_tower.patch_embed.pos_emb.weight"
    swapped[key] = swapped[key].transpose(0, 1).contiguous()
    control = max_abs_rel(ours, vref.vision_features(swapped, px, grid))
    print(f"K3 VL vision features vs independent reference {err:.2e} (control {control:.2e})")
    assert err < RTOL and control > 100 * RTOL


def _read_dir(path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                assert k not in out, k
                out[k] = s.get_tensor(k)
    return out


def test_save_writes_the_released_layout_back(vl):
    out = vl.d / "export"
    save_hf(vl.model, out)
    theirs, ours = _read_dir(vl.d / "ref"), _read_dir(out)
    assert sorted(ours) == sorted(theirs)
    for k, v in theirs.items():  # every tensor, the MXFP4 experts' packed codes and E8M0 scales included: the blocks
        # the reference encoded at another scale than ours (its ceil rule) keep its encoding (interop.k3_experts)
        assert ours[k].dtype == v.dtype and ours[k].shape == v.shape and torch.equal(ours[k], v), k
    vision = [k for k in theirs if k.startswith(("vision_tower.", "mm_projector."))]
    assert len(vision) == 6 + 6 * VC["vt_num_hidden_layers"] and all(ours[k].dtype == torch.bfloat16 for k in vision)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert cfg["media_placeholder_token_id"] == PH
    assert {k: cfg["vision_config"].get(k) for k in VC} == VC
    again = load_hf(out)
    assert isinstance(again, K3ForConditionalGeneration)
    sd = vl.model.state_dict()
    assert sorted(again.state_dict()) == sorted(sd)
    assert all(torch.equal(v, sd[k]) for k, v in again.state_dict().items())
    print(f"K3 VL export: {len(ours)} tensors, {len(vision)} vision, byte for byte")


def test_text_only_load(vl, caplog):
    with caplog.at_level(logging.DEBUG, logger="megatron_k3"):
        text = load_hf(vl.d / "ref", vision=False).eval()
    assert isinstance(text, K3ForCausalLM) and not isinstance(text, K3ForConditionalGeneration)
    n_vision = sum(k.startswith(("vision_tower.", "mm_projector.")) for k in vl.tensors)
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(lines) == 1 and str(n_vision) in lines[0], lines
    c = vl.cases["text"]
    with torch.no_grad():
        out = text(c.ids, return_logits=True).logits
    err = max_abs_rel(out, _ours(vl.model, c.ids))
    assert err < 1e-6, err
    assert max_abs_rel(out, c.logits) < RTOL


def test_bad_media_inputs_are_refused(vl):
    model = vl.model
    px = _pixels([(1, 4, 6), (1, 4, 5)])
    with pytest.raises(ValueError, match=r"medium 1") as e:  # w = 5: not a multiple of the 2x2 merge kernel
        model.vision_features(px, torch.tensor([[1, 4, 6], [1, 4, 5]]))
    assert re.search(r"1\D+4\D+5", str(e.value)), str(e.value)  # the grid, in whatever brackets
    px = _pixels([(1, 4, 6), (1, 3, 4)])
    with pytest.raises(ValueError, match=r"medium 1") as e:  # h = 3
        model.vision_features(px, torch.tensor([[1, 4, 6], [1, 3, 4]]))
    assert re.search(r"1\D+3\D+4", str(e.value)), str(e.value)
    with pytest.raises(ValueError):  # 24 + 16 patches in the grid, 24 + 17 rows of pixels
        model.vision_features(_pixels([(1, 4, 6), (1, 4, 4)])[:-1], torch.tensor([[1, 4, 6], [1, 4, 4]]))
    c = vl.cases["image"]  # one medium, 6 feature rows: 3 placeholders match neither count
    ids = c.ids.clone()
    ids[0, :3] = PH
    ids[0, 5] = 7
    with pytest.raises(ValueError) as e:
        _ours(model, ids, c.px, c.grid)
    msg = str(e.value)
    assert all(re.search(rf"\b{n}\b", msg) for n in (3, 1, 6)), msg  # placeholders, media, feature rows


def test_cases_are_well_formed():
    """Sanity of the cases themselves: every grid is a multiple of the merge kernel, frames within the time table."""
    for c in CASES.values():
        for t, h, w in c["grids"]:
            assert h % 2 == 0 and w % 2 == 0 and 1 <= t <= VC["init_pos_emb_time"]
        S = [c["S"] - sum(b == r for b, _ in c["at"]) for r in range(c["B"])]
        n = iter(_features_per_medium(c["grids"]))
        extra = [0] * c["B"]
        for b, _ in c["at"]:
            extra[b] += next(n)
        assert len({s + e for s, e in zip(S, extra)}) == 1
    assert math.isclose(vref.EPS_FP32, 1.1920929e-07, rel_tol=1e-7)


def _load_part(rank, world, path, layout):
    """This rank's part of the VL directory (built on the meta device, streamed in by load_hf_sharded): every tensor
    it holds, with its offsets in the full tensor."""
    from megatron_k3.annotations import full_shape, shard_offsets
    from megatron_k3.interop import load_hf_sharded
    from megatron_k3.interop.directory import config_from_hf
    from megatron_k3.parallel import ParallelGroups, build_model, state

    ps = state.initialize_model_parallel(**layout)
    try:
        cfg = config_from_hf(json.loads((path / "config.json").read_text()), "k3")
        model = build_model(cfg, ParallelGroups.from_state(ps), device="meta")
        load_hf_sharded(model, path)
        return {n: (t.detach().clone(), shard_offsets(t), full_shape(t))
                for n, t in model.state_dict(keep_vars=True).items()}
    finally:
        state.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("world,layout", [(2, {"tp": 2}), (2, {"pp": 2})], ids=["tp2", "pp2"])
def test_vision_directory_streams_into_parallel_parts(vl, world, layout):
    """Every rank of tp2 / pp2 reads its part of the VL directory: the tower whole on every TP rank and on the first
    pipeline stage only, every tensor equal to the single-process load's slice."""
    from dist_utils import run_distributed

    full = vl.model.state_dict()
    parts = run_distributed(_load_part, world, vl.d / "ref", layout)
    for rank, part in enumerate(parts):
        has_tower = any(n.startswith("vision_tower.") for n in part)
        assert has_tower == (layout.get("pp", 1) == 1 or rank == 0), rank
        for n, (t, offsets, shape) in part.items():
            assert tuple(full[n].shape) == tuple(shape), n
            sl = tuple(slice(o, o + s) for o, s in zip(offsets, t.shape))
            assert torch.equal(full[n][sl], t), (rank, n)
