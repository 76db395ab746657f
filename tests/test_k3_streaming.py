"""Streaming, sharded import and export of Hugging Face directories (megatron_k3.interop.sharded_load and
sharded_save).

- A K3-layout checkpoint of 1.12 GB (over 1 GiB: 6 layers at hidden size 2048, 32 experts per MoE layer in MXFP4,
  a 49152-token vocabulary; random bit patterns, written with safetensors directly into 8 shards of at most 128 MiB
  with an index and two vision-tower tensors) loads on 4 gloo ranks at tp2 x ep2 and on 2 ranks at pp2:
  every rank's parameters equal, bit for bit (SHA-256 of the bytes), the slices of the unsharded load
  (read_checkpoint + from_k3_state_dict, the whole-file path), each rank opens exactly the shard files that hold
  its tensors, and its peak resident memory grows by less than 40% of the checkpoint during the load (VmHWM after
  resetting it through /proc/self/clear_refs, minus VmRSS before; the model is allocated and touched first).
- save_hf_sharded at tp2 x ep2 and at pp2 x ep2 writes what save_hf writes for the whole model, tensor for tensor,
  and config.json; load_hf reads it.
- Bad input (a missing or truncated shard file, an index naming a file that is not there, a tensor of the wrong
  shape), placed where only the second pipeline stage reads: one line naming the file and the tensor, the same on
  both ranks, and no parameter changed.
- Without processes: the slices of tp2, ep2, tp2 x ep2 and each pp2 stage for K3 and Kimi Linear directories (also
  with memory maps re-opened every 64 KiB), the vision tensors skipped with one log line, the single-process export,
  missing and unknown tensors, the K3 configs' MLA latent-norm eps.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_k3.annotations import full_shape, shard_offsets
from megatron_k3.config import load_model_config
from megatron_k3.interop import (
    CheckpointReadError,
    CheckpointWriteError,
    MissingShardError,
    k3_layout,
    kimi_linear,
    load_hf,
    load_hf_sharded,
    save_hf,
    save_hf_sharded,
)
from megatron_k3.interop.hf import read_checkpoint
from megatron_k3.layout.grid import RankGrid
from megatron_k3.model import K3ForCausalLM
from megatron_k3.parallel import ParallelGroups, build_model
from megatron_k3.parallel.mappings import Group
from megatron_k3.parallel.tensor import TensorParallel

ROOT = Path(__file__).resolve().parent.parent
BIG = ["vocab_size=49152", "hidden_size=2048", "num_layers=6", "attn_res_block_size=2", "mla_layers=[4,6]",
       "kda_num_heads=16", "kda_head_dim=128", "mla_num_heads=16", "q_lora_rank=512", "kv_lora_rank=256",
       "qk_nope_head_dim=64", "qk_rope_head_dim=32", "v_head_dim=64", "dense_intermediate_size=14336",
       "num_experts=32", "top_k=4", "moe_intermediate_size=512", "moe_latent_size=512",
       "shared_intermediate_size=4096"]
BIG_SHARD = 128 << 20
SMALL = ["num_layers=4"]  # k3_tiny, pp2 stages [0, 2) and [2, 4)
RSS_FRACTION = 0.4
WORLDS = {"tp2xep2": (4, dict(tp=2, ep=2)), "pp2": (2, dict(pp=2)), "pp2xep2": (4, dict(pp=2, ep=2))}
VISION = {"vision_tower.patch_embed.proj.weight": (64, 3, 2, 2), "mm_projector.linear_1.weight": (96, 64)}


# ------------------------------------------------------------------------------------------------ helpers
def _groups(tp=(0, 1), ep=(0, 1), pp=(0, 1)) -> ParallelGroups:
    """A rank's groups without processes: (rank, size) per kind."""
    return ParallelGroups(tp=TensorParallel(None, tp[1], tp[0]), ep=Group(None, ep[1], ep[0]),
                          pp=Group(None, pp[1], pp[0]))


def _coords(world: str) -> list:
    """(tp, ep, pp) rank of each global rank of a layout (megatron_k3.layout.grid; at tp2 x ep2 on 4 ranks the
    expert grid gives ep rank = tp rank: each block of experts lives on two data-parallel replicas)."""
    n, sizes = WORLDS[world]
    grid = RankGrid(n, **sizes)
    return [(c["tp"], c["ep"], c["pp"]) for c in map(grid.coords, range(n))]


def _coord_groups(world: str, coords) -> ParallelGroups:
    s = WORLDS[world][1]
    return _groups((coords[0], s.get("tp", 1)), (coords[1], s.get("ep", 1)), (coords[2], s.get("pp", 1)))


def _model(cfg, seed: int) -> K3ForCausalLM:
    model = K3ForCausalLM(cfg, init=False)
    model.reset_parameters(seed)
    return model


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()


def _blocks(model) -> dict:
    """{name: (offsets, shape, sha256)} of every parameter and persistent buffer this rank holds."""
    return {n: (shard_offsets(t), tuple(t.shape), _sha(t)) for n, t in model.state_dict(keep_vars=True).items()}


def _slice(whole: torch.Tensor, offsets, shape) -> torch.Tensor:
    return whole[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]


def _reference(path, cfg) -> dict:
    """The unsharded load, the whole-file way: {our name: fp32 tensor}."""
    _, tensors = read_checkpoint(path)
    return k3_layout.from_k3_state_dict(tensors, cfg)


def _needed_files(model, cfg, weight_map: dict) -> list:
    """The shard files holding the K3 tensors of this rank's part."""
    rules = {ours: key for ours, key, _, _ in k3_layout.pairs(cfg)}
    keys = []
    for name, t in model.state_dict(keep_vars=True).items():
        if ".mlp.experts.w" in name:
            i, n = int(name.split(".")[2]), name[-2:]
            first = shard_offsets(t)[0]
            keys += [f"model.layers.{i}.block_sparse_moe.experts.{first + e}.{n}.weight_{s}"
                     for e in range(t.shape[0]) for s in ("packed", "scale")]
        else:
            keys.append(rules[name])
    return sorted({weight_map[k3_layout.PREFIX + k] for k in keys})


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int | None:
    """Reset this process's peak resident memory (VmHWM) to its current value; returns VmRSS (None where the
    kernel refuses)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status("VmRSS")


class _Streams:
    """Cheap random tensors: per kind, a random sequence of prime period PERIOD (bf16 / fp32 bit patterns with the
    top exponent bit clear: finite, |x| < 2; MXFP4 codes any byte; E8M0 scales around 2^0), each tensor the next
    window of its kind's sequence. Tensor sizes and slice offsets are products of small primes, so no two expert
    matrices and no two blocks of one tensor that a wrong slice could confuse hold the same values."""

    PERIOD = 16_777_259  # prime

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        n = self.PERIOD
        self.pools = {
            "bf16": torch.empty(n, dtype=torch.int16).random_(generator=g).bitwise_and_(-16385).view(torch.bfloat16),
            "fp32": torch.empty(n, dtype=torch.int32).random_(generator=g).bitwise_and_(~(1 << 30)).view(
                torch.float32),
            "packed": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g),
            "scale": torch.randint(112, 142, (n,), dtype=torch.uint8, generator=g),
        }
        self.pos = dict.fromkeys(self.pools, 0)

    def take(self, shape, kind: str) -> torch.Tensor:
        pool, n = self.pools[kind], torch.Size(shape).numel()
        out = torch.empty(n, dtype=pool.dtype)
        done, at = 0, self.pos[kind] % self.PERIOD
        while done < n:
            m = min(n - done, self.PERIOD - at)
            out[done:done + m] = pool[at:at + m]
            done, at = done + m, 0
        self.pos[kind] += n
        return out.reshape(shape)


def _k3_specs(cfg) -> list:
    """(K3 name with the prefix, shape, kind) of every tensor of a K3 checkpoint of cfg."""
    with torch.device("meta"):
        sd = K3ForCausalLM(cfg, init=False).state_dict()
    out = []
    for ours, key, _, _ in k3_layout.pairs(cfg):
        shape = tuple(sd[ours].shape)
        kind = "fp32" if k3_layout.is_fp32_key(key) else "bf16"
        if ours.endswith(".A_log"):
            shape, kind = (k3_layout.padded_heads(shape[0]),), "a_log"
        out.append((k3_layout.PREFIX + key, shape, kind))
    for i, f in enumerate(cfg.ffn_types()):
        if f != "moe":
            continue
        for n in ("w1", "w2", "w3"):
            o, k = sd[f"model.layers.{i}.mlp.experts.{n}"].shape[1:]
            for e in range(cfg.num_experts):
                key = f"{k3_layout.PREFIX}model.layers.{i}.block_sparse_moe.experts.{e}.{n}"
                out += [(key + ".weight_packed", (o, k // 2), "packed"), (key + ".weight_scale", (o, k // 32), "scale")]
    return out


def write_k3_dir(path: Path, cfg, max_shard_size: int, seed: int = 0) -> int:
    """A K3-layout directory of random tensors (plus two vision-tower ones), sharded with an index, written with
    safetensors directly, one shard in memory at a time; returns its size in bytes."""
    path.mkdir(parents=True)
    specs = sorted(_k3_specs(cfg) + [(k, s, "bf16") for k, s in VISION.items()])
    sizes = {k: torch.Size(s).numel() * (4 if kind in ("fp32", "a_log") else 1 if kind in ("packed", "scale") else 2)
             for k, s, kind in specs}
    shards, size = [[]], 0
    for spec in specs:
        if shards[-1] and size + sizes[spec[0]] > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += sizes[spec[0]]
    streams = _Streams(seed)
    weight_map = {}
    for j, shard in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key, shape, kind in shard:
            if kind == "a_log":
                h = cfg.kda_num_heads
                tensors[key] = torch.cat([streams.take((h,), "fp32"), torch.zeros(shape[0] - h)])
            else:
                tensors[key] = streams.take(shape, kind)
            weight_map[key] = name
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(k3_layout.k3_config_dict(cfg), indent=2))
    return sum(f.stat().st_size for f in path.glob("model-*.safetensors"))


def _add_vision(path: Path):
    """Two vision-tower tensors in a file of their own, listed in the index."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    save_file({k: torch.ones(s, dtype=torch.bfloat16) for k, s in VISION.items()}, str(path / "vision.safetensors"))
    index["weight_map"].update(dict.fromkeys(VISION, "vision.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


# ------------------------------------------------------------------------------------------------ 1 GB, gloo ranks
def _load_worker(rank, world, layout, path):
    from megatron_k3.parallel import state

    ps = state.initialize_model_parallel(**WORLDS[layout][1])
    try:
        groups = ParallelGroups.from_state(ps)
        cfg = load_model_config("k3_tiny", BIG)
        model = build_model(cfg, groups, "meta").materialize("cpu", init=False)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # resident before the load, as a built model is
        gc.collect()
        base = _reset_peak()
        t0 = time.perf_counter()
        report = load_hf_sharded(model, path)
        seconds = time.perf_counter() - t0
        growth = None if base is None else _status("VmHWM") - base
        return {"coords": (groups.tp.rank, groups.ep.rank, groups.pp.rank), "blocks": _blocks(model),
                "files": report.files, "growth": growth, "seconds": seconds, "bytes_read": report.bytes_read}
    finally:
        state.destroy_model_parallel()


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """The 1.12 GB checkpoint and, per layout and rank coordinates, the expected blocks of the unsharded load and
    the files the rank needs (computed before any worker starts; the unsharded model is freed again)."""
    d = tmp_path_factory.mktemp("k3_big") / "ckpt"
    cfg = load_model_config("k3_tiny", BIG)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 4x faster than 2 threads on 2 cores shared with other processes (measured)
    try:
        t0 = time.perf_counter()
        size = write_k3_dir(d, cfg, BIG_SHARD)
        t1 = time.perf_counter()
        whole = _reference(d, cfg)
        t2 = time.perf_counter()
        expected, text_files = _expected_blocks(d, cfg, whole)
    finally:
        torch.set_num_threads(threads)
    del whole
    gc.collect()
    print(f"\n1 GB fixture: wrote {size / 1e9:.3f} GB in {t1 - t0:.1f} s, unsharded reference load "
          f"{t2 - t1:.1f} s, hashes {time.perf_counter() - t2:.1f} s")
    return d, size, expected, text_files


def _expected_blocks(d: Path, cfg, whole: dict):
    """Per layout and rank coordinates: ({name: (offsets, shape, sha256)} of the unsharded load's blocks, the shard
    files holding the rank's tensors); and the files holding text tensors."""
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    expected, cache = {}, {}
    for layout in ("tp2xep2", "pp2"):
        for c in sorted(set(_coords(layout))):
            model = build_model(cfg, _coord_groups(layout, c), "meta")
            blocks = {}
            for n, t in model.state_dict(keep_vars=True).items():
                assert full_shape(t) == tuple(whole[n].shape), n
                k = (n, shard_offsets(t), tuple(t.shape))
                if k not in cache:
                    cache[k] = _sha(_slice(whole[n], k[1], k[2]))
                blocks[n] = (k[1], k[2], cache[k])
            expected[layout, c] = (blocks, _needed_files(model, cfg, weight_map))
    return expected, sorted({f for k, f in weight_map.items() if k not in VISION})


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2xep2", "pp2"])
def test_1gb_checkpoint_loads_rank_slices_bit_for_bit(big, layout):
    path, size, expected, text_files = big
    assert size >= 1 << 30 and len(text_files) >= 8
    world = len(_coords(layout))
    t0 = time.perf_counter()
    results = run_distributed(_load_worker, world, layout, str(path), timeout=300)
    wall = time.perf_counter() - t0
    assert [r["coords"] for r in results] == _coords(layout)
    for r in results:
        blocks, needed = expected[layout, r["coords"]]
        assert sorted(r["blocks"]) == sorted(blocks)
        wrong = [n for n in blocks if r["blocks"][n] != blocks[n]]
        assert not wrong, (r["coords"], wrong[:5])
        assert r["files"] == needed, r["coords"]  # only the files holding its tensors
        if r["growth"] is None:
            pytest.skip("/proc/self/clear_refs is not writable here: peak RSS not measured")
        print(f"{layout} rank (tp, ep, pp)={r['coords']}: peak RSS growth {r['growth'] / 2 ** 20:.0f} MiB "
              f"({r['growth'] / size:.1%} of the {size / 1e9:.3f} GB checkpoint), read "
              f"{r['bytes_read'] / 2 ** 20:.0f} MiB from {len(r['files'])} of {len(text_files)} files in "
              f"{r['seconds']:.1f} s")
        assert r["growth"] < RSS_FRACTION * size, r["coords"]
    assert sorted(set().union(*(r["files"] for r in results))) == text_files
    print(f"{layout}: {world} ranks in {wall:.1f} s")


# ------------------------------------------------------------------------------------------------ export, gloo ranks
def _export_worker(rank, world, layout, path, seed):
    from megatron_k3.parallel import state

    ps = state.initialize_model_parallel(**WORLDS[layout][1])
    try:
        groups = ParallelGroups.from_state(ps)
        model = build_model(load_model_config("k3_tiny", SMALL), groups, "cpu", seed=seed)
        save_hf_sharded(model, path, tp_group=groups.tp.group, max_shard_size=400_000)
        return sorted(p.name for p in Path(path).iterdir())
    finally:
        state.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2xep2", "pp2xep2"])
def test_sharded_export_equals_unsharded_save_hf(tmp_path, layout):
    listings = run_distributed(_export_worker, WORLDS[layout][0], layout, str(tmp_path / "sharded"), 7, timeout=180)
    cfg = load_model_config("k3_tiny", SMALL)
    whole = K3ForCausalLM(cfg, init=False)
    whole.reset_parameters(7)
    save_hf(whole, tmp_path / "whole", max_shard_size=400_000)
    a, b = tmp_path / "sharded", tmp_path / "whole"
    index = json.loads((a / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert listings[0] == sorted(files + ["config.json", "model.safetensors.index.json"])  # nothing else
    assert all(f"-of-{len(files):05d}.safetensors" in f for f in files) and len(files) > 4
    ta, tb = read_checkpoint(a)[1], read_checkpoint(b)[1]
    assert sorted(ta) == sorted(tb)
    for k in tb:  # bf16 / fp32 tensors, packed MXFP4 bytes and E8M0 scales
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tb.values())
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    back = load_hf(a)
    for k, v in load_hf(b).state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


# ------------------------------------------------------------------------------------------------ bad input
def _bad_worker(rank, world, cases):
    from megatron_k3.parallel import state

    ps = state.initialize_model_parallel(pp=2)
    try:
        model = build_model(load_model_config("k3_tiny", SMALL), ParallelGroups.from_state(ps), "cpu", seed=3)
        before = {n: t.detach().clone() for n, t in model.state_dict().items()}
        out = {}
        for name, path in cases.items():
            try:
                load_hf_sharded(model, path)
                err = None
            except Exception as e:  # noqa: BLE001
                err = (type(e).__name__, str(e), isinstance(e, FileNotFoundError), isinstance(e, ValueError))
            out[name] = (err, all(torch.equal(t, before[n]) for n, t in model.state_dict().items()))
        return out
    finally:
        state.destroy_model_parallel()


def _stage1_file(d: Path):
    """The last shard file and its first tensor: only pipeline stage 1 of k3_tiny's 4 layers reads it."""
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    last = wm[max(wm)]
    keys = sorted(k for k, f in wm.items() if f == last)
    assert not any(s in k for k in keys for s in ("layers.0.", "layers.1.", "embed_tokens")), keys
    return last, keys


@pytest.mark.slow
def test_bad_input_is_one_line_on_every_rank_and_changes_nothing(tmp_path):
    cfg = load_model_config("k3_tiny", SMALL)
    good = tmp_path / "good"
    save_hf(_model(cfg, 5), good, max_shard_size=300_000)
    file, keys = _stage1_file(good)
    cases, expect = {}, {}
    for name in ("missing", "truncated", "index", "shape"):
        d = tmp_path / name
        shutil.copytree(good, d)
        cases[name] = str(d)
    (tmp_path / "missing" / file).unlink()
    expect["missing"] = (file, keys[0], True, "missing")
    data = (tmp_path / "truncated" / file).read_bytes()
    (tmp_path / "truncated" / file).write_bytes(data[: len(data) // 2])
    expect["truncated"] = (file, keys[0], False, "cannot be read")
    index = json.loads((tmp_path / "index" / "model.safetensors.index.json").read_text())
    index["weight_map"][keys[-1]] = "model-00099-of-00099.safetensors"
    (tmp_path / "index" / "model.safetensors.index.json").write_text(json.dumps(index))
    expect["index"] = ("model-00099-of-00099.safetensors", keys[-1], True, "missing")
    with safe_open(str(good / file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    norm = k3_layout.PREFIX + "model.norm.weight"
    assert norm in tensors
    tensors[norm] = torch.ones(cfg.hidden_size + 1, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "shape" / file), metadata={"format": "pt"})
    expect["shape"] = (file, norm, False, f"the file holds [{cfg.hidden_size + 1}], the config implies "
                                          f"[{cfg.hidden_size}]")
    results = run_distributed(_bad_worker, 2, cases, timeout=180)
    for name, (fname, key, missing, what) in expect.items():
        errs = [r[name][0] for r in results]
        assert all(e is not None for e in errs), name
        assert errs[0][1] == errs[1][1], (name, errs)  # the same line on both ranks
        line = errs[0][1]
        assert "\n" not in line and fname in line and key in line and what in line, (name, line)
        assert all(e[2] == missing and e[3] for e in errs), (name, errs)  # ValueError, FileNotFoundError if missing
        assert all(r[name][1] for r in results), name  # no parameter changed
        print(f"{name}: {line}")
    assert all((good / f).stat().st_size > 0 for f in json.loads(
        (good / "model.safetensors.index.json").read_text())["weight_map"].values())


# ------------------------------------------------------------------------------------------------ single process
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3_tiny") / "ckpt"
    cfg = load_model_config("k3_tiny", SMALL)
    save_hf(_model(cfg, 11), d, max_shard_size=300_000)
    _add_vision(d)
    return d, cfg, _reference(d, cfg)


@pytest.mark.parametrize("world,coords", [("tp2", (1, 0, 0)), ("ep2", (0, 1, 0)), ("tp2xep2", (0, 1, 0)),
                                          ("pp2", (0, 0, 0)), ("pp2", (0, 0, 1))])
def test_rank_slices_equal_the_unsharded_load(tiny, world, coords):
    path, cfg, whole = tiny
    sizes = {"tp2": dict(tp=2), "ep2": dict(ep=2)}.get(world) or WORLDS[world][1]
    groups = _groups((coords[0], sizes.get("tp", 1)), (coords[1], sizes.get("ep", 1)), (coords[2], sizes.get("pp", 1)))
    model = build_model(cfg, groups, "meta")
    report = load_hf_sharded(model, path)  # allocated first (built on meta)
    for n, t in model.state_dict(keep_vars=True).items():
        assert torch.equal(t.detach(), _slice(whole[n], shard_offsets(t), t.shape)), n
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert report.files == _needed_files(model, cfg, weight_map) and report.skipped == len(VISION)


def test_reopening_the_memory_maps_changes_nothing(tiny, monkeypatch):
    """A map re-opened after every 64 KiB read (sharded_load.READ_BUDGET): expert halves read from an earlier map
    stay valid, every slice arrives."""
    from megatron_k3.interop import sharded_load

    path, cfg, whole = tiny
    monkeypatch.setattr(sharded_load, "READ_BUDGET", 1 << 16)
    model = build_model(cfg, _groups(tp=(0, 2), ep=(1, 2)), "meta")
    load_hf_sharded(model, path)
    for n, t in model.state_dict(keep_vars=True).items():
        assert torch.equal(t.detach(), _slice(whole[n], shard_offsets(t), t.shape)), n


def test_load_hf_streams_the_same_values(tiny):
    path, cfg, whole = tiny
    model = load_hf(path, config=cfg)
    assert sorted(model.state_dict()) == sorted(whole)
    assert all(torch.equal(v, whole[k]) for k, v in model.state_dict().items())


def test_vision_tensors_are_skipped_with_one_log_line(tiny, caplog):
    path, cfg, _ = tiny
    with caplog.at_level(logging.DEBUG, logger="megatron_k3"):
        load_hf_sharded(K3ForCausalLM(cfg, init=False), path)
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(lines) == 1 and f"skipped {len(VISION)} vision-tower tensors" in lines[0], lines


def test_kimi_linear_layout_streams_too(tmp_path):
    """A Kimi Linear directory (per-expert .weight, A_log [1, 1, H, 1]; one dense MLP under block_sparse_moe. as
    transformers writes it) in slices at tp2 x ep2 and pp2."""
    cfg = load_model_config("kimi_linear_tiny")
    save_hf(_model(cfg, 2), tmp_path / "kl", layout="kimi_linear",
            max_shard_size=300_000)
    index_path = tmp_path / "kl" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    old, new = "model.layers.0.mlp.up_proj.weight", "model.layers.0.block_sparse_moe.up_proj.weight"
    file = index["weight_map"].pop(old)
    with safe_open(str(tmp_path / "kl" / file), framework="pt") as f:
        tensors = {(new if k == old else k): f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(tmp_path / "kl" / file), metadata={"format": "pt"})
    index["weight_map"][new] = file
    index_path.write_text(json.dumps(index))
    whole = kimi_linear.from_hf_state_dict(read_checkpoint(tmp_path / "kl")[1], cfg)
    for groups in (_groups(tp=(1, 2), ep=(0, 2)), _groups(pp=(1, 2)), _groups(ep=(1, 2))):
        model = build_model(cfg, groups, "meta")
        assert load_hf_sharded(model, tmp_path / "kl").layout == "kimi_linear"
        for n, t in model.state_dict(keep_vars=True).items():
            assert torch.equal(t.detach(), _slice(whole[n], shard_offsets(t), t.shape)), n


@pytest.mark.parametrize("layout,name", [("k3", "k3_tiny"), ("kimi_linear", "kimi_linear_tiny")])
def test_single_process_export_equals_save_hf(tmp_path, layout, name):
    """One process holding the whole model: the same files (same shard split), index and config.json."""
    cfg = load_model_config(name, SMALL)
    model = _model(cfg, 4)
    save_hf(model, tmp_path / "a", layout=layout, max_shard_size=300_000)
    save_hf_sharded(model, tmp_path / "b", layout=layout, max_shard_size=300_000)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(p.name for p in (tmp_path / "b").iterdir())
    ta, tb = read_checkpoint(tmp_path / "a")[1], read_checkpoint(tmp_path / "b")[1]
    assert sorted(ta) == sorted(tb) and all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)
    assert (tmp_path / "a" / "config.json").read_text() == (tmp_path / "b" / "config.json").read_text()
    assert (tmp_path / "a" / "model.safetensors.index.json").read_text() == \
        (tmp_path / "b" / "model.safetensors.index.json").read_text()


def test_an_unwritable_directory_is_one_line(tmp_path):
    (tmp_path / "taken").write_text("a file where the directory should go")
    with pytest.raises(CheckpointWriteError) as e:
        save_hf_sharded(_model(load_model_config("k3_tiny", SMALL), 0), tmp_path / "taken")
    assert str(tmp_path / "taken") in str(e.value) and "\n" not in str(e.value)


def test_missing_and_unknown_tensors_name_the_index_and_the_tensor(tiny, tmp_path):
    path, cfg, _ = tiny
    for change in ("drop", "add"):
        d = tmp_path / change
        shutil.copytree(path, d)
        index = json.loads((d / "model.safetensors.index.json").read_text())
        key = k3_layout.PREFIX + "model.layers.2.self_attn.q_proj.weight"
        if change == "drop":
            index["weight_map"].pop(key)
        else:
            index["weight_map"][key + "_extra"] = index["weight_map"][key]
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        model = K3ForCausalLM(cfg, init=False)
        with pytest.raises(CheckpointReadError) as e:
            load_hf_sharded(model, d)
        line = str(e.value)
        assert "model.safetensors.index.json" in line and key in line and "\n" not in line, line
        assert ("missing" if change == "drop" else "not a tensor of this config") in line
    (tmp_path / "empty").mkdir()
    shutil.copy(path / "config.json", tmp_path / "empty")
    with pytest.raises(MissingShardError, match="neither model.safetensors"):
        load_hf_sharded(K3ForCausalLM(cfg, init=False), tmp_path / "empty")


def test_k3_configs_use_the_released_mla_latent_norm_eps():
    """Every conf/model/k3*.yaml: the q_a / kv_a layernorm eps of the released implementation (1e-6), so a K3
    export needs no megatron_k3 extension entry for it."""
    names = sorted(p.stem for p in (ROOT / "megatron_k3" / "conf" / "model").glob("k3*.yaml"))
    assert names == ["k3", "k3_small", "k3_tiny", "k3_vl_tiny"]
    for name in names:
        cfg = load_model_config(name)
        assert cfg.mla_latent_norm_eps == k3_layout.MLA_LATENT_NORM_EPS == 1e-6, name
        assert "mla_latent_norm_eps" not in k3_layout.k3_config_dict(cfg)["text_config"].get("megatron_k3", {})
