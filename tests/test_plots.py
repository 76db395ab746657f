"""tools/plot_training.py: PNG plots from the metrics.jsonl of a short real run (loss curves, expert-load
heatmaps, AttnRes depth weights, router statistics), and the heatmaps at K3's full size."""

import json
from pathlib import Path

import pytest
import torch
from helpers import load_file

from megatron_k3.config import load_model_config
from megatron_k3.planning.activations import attn_res_sources

ROOT = Path(__file__).resolve().parent.parent
@pytest.fixture(scope="module")
def run_dir(short_run_dir):
    return short_run_dir


@pytest.fixture(scope="module")
def tool():
    return load_file(ROOT / "tools" / "plot_training.py")


def _png_ok(path: Path):
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        w, h = im.size
        assert w >= 400 and h >= 300
        gray = im.convert("L")
        lo, hi = gray.getextrema()
        assert hi - lo > 100  # not a blank canvas: axes, text and data drawn
        colors = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is None or len(colors) > 50  # heatmaps and curves, not a flat figure


@pytest.mark.slow
def test_plot_training_writes_the_pngs(run_dir, tool, capsys):
    out = run_dir / "pngs"
    assert tool.main([str(run_dir / "metrics.jsonl"), "--out", str(out)]) == 0
    written = capsys.readouterr().out.split()
    names = sorted(Path(p).name for p in written)
    assert names == ["attn_res.png", "expert_load.png", "loss.png", "router.png"]
    for p in written:
        _png_ok(Path(p))
    assert tool.main([str(run_dir)]) == 0  # a run directory works too (plots/ inside it)
    assert (run_dir / "plots" / "loss.png").is_file()
    assert tool.main([str(run_dir / "missing.jsonl")]) == 2


def test_plot_training_at_full_size(tmp_path, tool, capsys):
    """The expert-load and depth-weight heatmaps at K3's size (92 layers x 896 experts, 187 mixes) render."""
    cfg = load_model_config("k3")
    moe = [i for i, t in enumerate(cfg.ffn_types()) if t == "moe"]
    src, out_src = attn_res_sources(cfg)
    g = torch.Generator().manual_seed(0)
    rows = []
    for step in (1, 2):
        loads = (torch.rand(len(moe), 896, generator=g) * 200).round().long()
        rows.append({"step": step, "loss": 3.0 / step, "lr": 1e-4, "grad_norm": 1.0, "tokens_per_s": 1.0,
                     "expert_load_per_layer": {"max_over_mean": [1.2] * len(moe), "layers": moe},
                     "expert_load_per_expert": {"layers": moe, "tokens": loads.tolist()},
                     "attn_res_weights": {"layers": list(range(93)),
                                          "pre_mixer": [[1 / p] * p if p else None for p, _ in src],
                                          "pre_ffn": [[1 / q] * q for _, q in src], "output": [1 / out_src] * out_src}})
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert tool.main([str(f)]) == 0
    for name in ("loss.png", "expert_load.png", "attn_res.png"):
        _png_ok(tmp_path / "plots" / name)
