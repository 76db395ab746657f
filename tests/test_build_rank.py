"""Every rank builds and initialises only its own shard (megatron_k3.parallel.build_model, megatron_k3.ops.init),
and tools/build_rank.py proves a layout on the CPU with torch's fake process-group backend.

- Initialisation is a function of (seed, parameter name, global element index): the single-process init equals
  the union of the tp2, tp4, ep2, ep4 and pp2 shards, bit for bit, for k3_tiny and kimi_linear_tiny, and any block
  of a tensor drawn on its own equals that block of the whole tensor (random shapes and blocks).
- The distributions are MODEL.md's (normal(0.02), ones for norms, zeros for AttnRes queries and the router bias,
  the KDA gate and conv init).
- A rank of tp2 x pp2 and of tp2 x ep2 allocates nothing larger than its largest local shard while it is built
  and initialised, and nothing beyond its own parameters (plus one tile being drawn).
- The dry run of full-size K3 (2.78T parameters, 512 ranks) covers the model exactly and matches the planner per
  rank; a layout that does not divide or does not fit is refused with the key and the value.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_k3.annotations import full_shape, shard_offsets
from megatron_k3.config import load_model_config
from megatron_k3.model import K3ForCausalLM
from megatron_k3.ops.init import TILE_ELEMENTS, draw, fill_, normal, tile_shape, uniform
from megatron_k3.parallel import ParallelGroups, build_model
from megatron_k3.parallel.mappings import Group
from megatron_k3.parallel.tensor import TensorParallel

ROOT = Path(__file__).resolve().parent.parent
HEADS4 = ["kda_num_heads=4", "mla_num_heads=4"]  # tp4 splits the heads: the tiny configs have 2


def _groups(kind: str, size: int, rank: int) -> ParallelGroups:
    if kind == "tp":
        return ParallelGroups(tp=TensorParallel(None, size, rank))
    return ParallelGroups(**{kind: Group(None, size, rank)})


@pytest.mark.parametrize("name", ["k3_tiny", "kimi_linear_tiny"])
@pytest.mark.parametrize("kind,size", [("tp", 2), ("tp", 4), ("ep", 2), ("ep", 4), ("pp", 2)])
def test_single_process_init_is_the_union_of_the_shards(name, kind, size):
    """Each rank built on the meta device and materialised holds exactly its block of the single-process weights,
    and the blocks of all ranks cover every element."""
    cfg = load_model_config(name, HEADS4 if (kind, size) == ("tp", 4) else [])
    seed = int(torch.randint(0, 2 ** 31, ()).item())
    ref = K3ForCausalLM(cfg, init=False)
    ref.reset_parameters(seed)
    whole = {n: p.detach() for n, p in ref.named_parameters()}
    covered = {n: torch.zeros(p.shape, dtype=torch.int32) for n, p in whole.items()}
    for rank in range(size):
        model = build_model(cfg, _groups(kind, size, rank), "cpu", seed=seed)
        for n, p in model.named_parameters():
            assert full_shape(p) == tuple(whole[n].shape), n
            block = tuple(slice(o, o + s) for o, s in zip(shard_offsets(p), p.shape))
            assert torch.equal(p.detach(), whole[n][block]), (kind, size, rank, n)
            covered[n][block] += 1
        for b in model.buffers():
            assert not b.any()  # routing statistics and the router's selection bias start at zero
    assert all(bool((c > 0).all()) for c in covered.values())


def test_any_block_equals_that_block_of_the_whole_tensor():
    """fill_ of random, unaligned blocks of random shapes (1-4 dimensions) equals the slice of the whole draw."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    for _ in range(30):
        nd = int(torch.randint(1, 5, (), generator=g))
        full = tuple(int(torch.randint(1, 70 if nd > 2 else 300, (), generator=g)) for _ in range(nd))
        start = tuple(int(torch.randint(0, f, (), generator=g)) for f in full)
        shape = tuple(int(torch.randint(1, f - s + 1, (), generator=g)) for f, s in zip(full, start))
        init = normal(0.02) if torch.rand((), generator=g) < 0.5 else uniform(-1, 3, then=torch.exp)
        whole = draw(init, 7, "w", full)
        block = fill_(torch.empty(shape, dtype=torch.bfloat16), init, 7, "w", full, start)
        ref = whole[tuple(slice(s, s + n) for s, n in zip(start, shape))].to(torch.bfloat16)
        assert torch.equal(block, ref), (full, start, shape)
        assert not torch.equal(draw(init, 8, "w", full), whole) and not torch.equal(draw(init, 7, "v", full), whole)


@pytest.mark.parametrize("full", [(163840, 7168), (896, 3072, 3584), (7168,), (8192, 1, 4), (64, 128), (2,)])
def test_tiles_fall_on_shard_boundaries(full):
    """A tile divides the tensor, holds at most TILE_ELEMENTS, and along dimensions 0 and 1 (where TP and EP
    split) spans at most a quarter of the dimension: a 4-way split never draws a tile as large as the tensor."""
    t = tile_shape(full)
    assert math.prod(t) <= TILE_ELEMENTS
    for d, (f, s) in enumerate(zip(full, t)):
        if d < 2 or s < f:
            assert f % s == 0
        if d < 2 and f >= 4:
            assert s <= f // 4


def test_initial_distributions_are_model_md():
    torch.manual_seed(0)
    for name in ("k3_tiny", "kimi_linear_tiny"):
        cfg = load_model_config(name)
        model = K3ForCausalLM(cfg)
        params = dict(model.named_parameters())
        for n, p in params.items():
            p = p.detach()
            if n.endswith(("norm.weight", "layernorm.weight", ".o_norm")):
                assert torch.equal(p, torch.ones_like(p)), n
            elif n.endswith("_res.proj.weight") or n == "model.output_attn_res.proj.weight":
                assert not p.any(), n  # AttnRes pseudo-queries: uniform depth weights at init
            elif n.endswith(".A_log"):
                if cfg.kda_a_log_init == "zero":
                    assert not p.any(), n
                else:
                    assert (p >= 0).all() and (p <= math.log(16)).all(), n
            elif n.endswith(".dt_bias"):
                dt = torch.nn.functional.softplus(p)
                assert (dt >= 1e-4 * 0.999).all() and (dt <= 0.1 * 1.001).all(), n
            elif n.endswith("conv1d"):
                bound = 1 / math.sqrt(cfg.kda_conv_size)
                assert p.abs().max() <= bound and p.abs().max() > bound / 2, n
            elif p.numel() >= 4096:
                assert abs(p.std().item() - cfg.initializer_range) < 0.05 * cfg.initializer_range, n
                assert abs(p.mean().item()) < 0.05 * cfg.initializer_range, n
        for b in model.buffers():
            assert not b.any()


def test_a_seed_gives_the_same_weights_and_another_seed_others():
    cfg = load_model_config("k3_tiny")
    a, b, c = (K3ForCausalLM(cfg, init=False) for _ in range(3))
    a.reset_parameters(3)
    b.reset_parameters(3)
    c.reset_parameters(4)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        if p.numel() > 16 and p.std() > 0:
            assert not torch.equal(p, r), n


def _tool(*args, timeout=900):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "build_rank.py"), *args], capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT)
    return out


WORLD4 = ["model=k3_tiny", "cluster.num_nodes=1", "cluster.devices_per_node=4"]


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.pp=2"], ["parallel.tp=2", "parallel.ep=2"]],
                         ids=["tp2xpp2", "tp2xep2"])
def test_a_rank_allocates_only_its_own_shards(layout):
    """Every rank of a 4-rank layout, built and initialised under an allocation tracker (every tensor an op
    creates): no allocation larger than the rank's largest local shard, and at no moment more live bytes than its
    own parameters and buffers plus one tile being drawn."""
    out = _tool(*WORLD4, *layout, "--rank", "0", "--rank", "1", "--rank", "2", "--rank", "3", "--materialize",
                "--dtype", "fp32", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["params_match_planner"]
    for m in rep["materialized"]:
        assert m["largest_allocation_bytes"] <= m["largest_param_bytes"], m
        assert m["build_live_peak_bytes"] <= m["weights_bytes"] + 2 * TILE_ELEMENTS * 4, m
        assert m["params"] == m["planner_step"]["params"]
        assert m["measured"]["live_peak_bytes"] == m["build_live_peak_bytes"] and m["measured"]["rss_peak_bytes"] > 0
    if "parallel.pp=2" in layout:
        assert [m["layers"] for m in rep["materialized"]] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2


def test_dry_run_covers_the_model_and_matches_the_planner():
    out = _tool("model=k3_tiny", "cluster.num_nodes=1", "cluster.devices_per_node=8", "parallel.tp=2",
                "parallel.pp=2", "parallel.ep=2", "--all", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["world"] == 8 and len(rep["ranks"]) == 8
    assert rep["covered_params"] == rep["total_params"] == 4488780 and rep["covered_equals_total"]
    for e in rep["ranks"]:
        assert e["params"] == e["planned_params"]
        assert e["experts"] == 8  # 16 experts over ep=2
        assert e["layers"] == ([0, 1, 2, 3] if e["pp_rank"] == 0 else [4, 5, 6, 7])
    for axis in ("tp_rank", "ep_rank", "dp_rank"):  # every shard of every stage is held
        assert {(e[axis], e["pp_rank"]) for e in rep["ranks"]} == {(a, p) for a in (0, 1) for p in (0, 1)}


@pytest.mark.parametrize("args,key", [
    (["parallel.tp=3"], "parallel.tp"),  # does not divide the heads (and the world)
    (["parallel.ep=3"], "parallel.ep"),
    (["parallel.tp=2", "parallel.pp=2", "cluster.device_memory_gb=0.01"], "parallel"),  # does not fit
])
def test_bad_layouts_name_the_key_and_value(args, key):
    out = _tool(*WORLD4, *args, "--rank", "0")
    assert out.returncode == 2, (out.stdout, out.stderr)
    line = out.stderr.strip().splitlines()[-1]
    assert f"{key}=" in line and "build_rank:" in line, line


@pytest.mark.slow
def test_full_size_k3_on_512_ranks():
    """tools/build_rank.py model=k3 cluster=supernodes_8x64 parallel.tp=8 parallel.pp=8 parallel.ep=64 --all: every
    rank's parameters equal the planner's count for its stage, the union covers all 2,779,484,393,568 parameters
    once, in under 10 minutes (measured 40-50 s) and 4 GB."""
    out = _tool("model=k3", "cluster=supernodes_8x64", "parallel.tp=8", "parallel.pp=8", "parallel.ep=64", "--all",
                "--json", timeout=600)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["world"] == 512 and len(rep["ranks"]) == 512
    assert rep["covered_params"] == 2_779_484_393_568 == rep["total_params"]
    assert all(e["params"] == e["planned_params"] for e in rep["ranks"])
    assert {e["experts"] for e in rep["ranks"]} == {14}
    assert sorted({e["pp_rank"] for e in rep["ranks"]}) == list(range(8))


@pytest.mark.slow
def test_the_step_runs_the_trainers_recomputation_and_the_planner_bounds_it():
    """--step runs the trainer's policy (--recompute R): one rank of k3_tiny at tp2 + SP over 2048 tokens, the
    measured live-tensor peak of the step ordered none > selective > full, each at most the planner's figure for the
    same phase (at this width the eager terms overcount; at full width the three are within 15% of it,
    docs/scale.md)."""
    peaks = {}
    for rc in ("none", "selective", "full"):
        out = _tool("model=k3_tiny", "cluster.num_nodes=1", "cluster.devices_per_node=2", "parallel.tp=2",
                    "parallel.sequence_parallel=true", "train.seq_length=2048", "train.micro_batch_size=1",
                    "train.global_batch_size=2", "--rank", "0", "--step", "--recompute", rc, "--json")
        assert out.returncode == 0, out.stderr
        m = json.loads(out.stdout)["materialized"][0]
        assert json.loads(out.stdout)["planner"]["recompute"] == rc
        peaks[rc] = m["step"]["live_peak_bytes"]
        assert 0.4 < m["measured_over_planned"] <= 1.0, (rc, m["measured_over_planned"])
    assert peaks["none"] > peaks["selective"] > peaks["full"], peaks


def test_the_step_figure_plans_the_runs_moe_dispatch():
    """The planner's figure --step compares against plans the run's model.moe_overflow: under balanced dispatch its
    replica slots and weight-exchange buffers too (it planned the default dispatch whatever the run's: measured at
    full width, balanced selective was 1.40 of that figure and 0.885 of this one, docs/scale.md)."""
    from megatron_k3.config import compose_config
    from megatron_k3.planning.dry_run import planner_step_memory
    from megatron_k3.planning.memory import training_memory
    from megatron_k3.planning.run import layout, workload

    base = ["model=k3_tiny", "cluster.num_nodes=1", "cluster.devices_per_node=2", "parallel.ep=2",
            "train.seq_length=256", "train.micro_batch_size=1", "train.global_batch_size=2"]
    figs, runs = {}, {}
    for overflow in ("dropless", "balanced"):
        runs[overflow] = compose_config(base + [f"model.moe_overflow={overflow}"])[0]
        figs[overflow] = planner_step_memory(runs[overflow], 2, 0, "selective")
    run = runs["balanced"]
    stage = training_memory(run.model, run.cluster, layout(run, 2, "selective"), workload(run))[0]
    assert stage.moe_exchange > 0 and stage.moe_replicas > 0
    # the replicas kept for the backward, and the exchange buffers in place of dropless' all-to-all buffers
    assert figs["balanced"]["activations_one_micro_bytes"] - figs["dropless"]["activations_one_micro_bytes"] == \
        stage.moe_replicas
    assert figs["balanced"]["transient_bytes"] > figs["dropless"]["transient_bytes"]



def test_the_step_runs_the_runs_precision(monkeypatch):
    """--step runs the experts as the Trainer does under precision=mx_qat: fake-quantised (it ran them in bf16
    whatever the precision, and a K3 rank's mx_qat step then measured 1.65x the planner's figure unnoticed)."""
    from megatron_k3.config import compose_config
    from megatron_k3.planning.dry_run import materialize_rank
    from megatron_k3.precision.qat import ExpertQAT

    calls = []
    weight_ = ExpertQAT.weight_
    monkeypatch.setattr(ExpertQAT, "weight_", lambda self, w: calls.append(w.shape) or weight_(self, w))
    base = ["model=k3_tiny", "cluster.num_nodes=1", "cluster.devices_per_node=1", "train.seq_length=64",
            "train.micro_batch_size=1", "train.global_batch_size=1"]
    for precision, quantised in (("bf16", False), ("mx_qat", True)):
        calls.clear()
        m = materialize_rank(compose_config(base + [f"precision={precision}"])[0], 1, 0, step=True)
        assert m.step["live_peak_bytes"] > 0 and bool(calls) == quantised, (precision, len(calls))
