"""Rank grid and process groups: tables equal megatron-core's, bad layouts refused with the key, groups on
gloo hold the right members, and DeepSpeed gets every answer it asks the mpu for."""

import itertools
import logging
import re
import time
import warnings
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import DistributedError, run_distributed

from megatron_k3.config import ConfigError, ModelConfig, RunConfig
from megatron_k3.errors import ParallelConfigError
from megatron_k3.layout import GROUPS, RankGrid, check_divisibility
from megatron_k3.parallel import state as ps
from megatron_k3.parallel.mpu import MPU, get_mpu
from megatron_k3.training.engine import shutdown

DENSE = ["tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-pp", "tp-dp-cp"]
# our expert group name -> megatron-core's token on its expert RankGenerator
EXPERT = {"ep": "ep", "etp": "tp", "edp": "dp", "etp-ep": "tp-ep", "etp-ep-pp": "tp-ep-pp"}


@pytest.fixture(scope="module")
def RankGenerator():
    with warnings.catch_warnings():  # megatron-core warns about missing TE/apex on CPU
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.parallel_state").RankGenerator


def megatron_tables(RankGenerator, world, tp, cp, ep, pp, etp, order):
    """megatron-core's groups for our names, built as its initialize_model_parallel builds them."""
    dp, edp = world // (tp * cp * pp), world // (etp * ep * pp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    tables = {name: dense.get_ranks(name) for name in DENSE}
    tables.update({name: expert.get_ranks(token) for name, token in EXPERT.items()})
    return tables, expert.get_ranks("pp")


# (world, tp, cp, ep, pp, etp, order)
CASES = [
    (8, 2, 1, 2, 2, 1, "tp-cp-ep-dp-pp"),
    (8, 1, 2, 1, 2, 1, "tp-cp-ep-dp-pp"),
    (16, 2, 2, 4, 2, 1, "tp-cp-ep-dp-pp"),
    (16, 2, 1, 2, 2, 1, "tp-cp-ep-pp-dp"),
    (16, 2, 2, 2, 1, 2, "ep-tp-dp-cp"),
    (64, 2, 2, 8, 2, 2, "tp-dp-cp-ep-pp"),
    (64, 2, 1, 1, 4, 2, "tp-pp-dp"),
    (64, 4, 1, 16, 1, 1, "tp-ep-dp"),
    (512, 4, 2, 16, 4, 2, "tp-cp-ep-dp-pp"),
    (512, 8, 1, 64, 8, 1, "tp-cp-ep-dp-pp"),
    (4096, 8, 2, 64, 8, 1, "tp-cp-ep-dp-pp"),
    (4096, 4, 4, 128, 16, 2, "tp-cp-ep-dp-pp"),
    (4096, 8, 1, 32, 16, 4, "tp-dp-cp-ep-pp"),
]


@pytest.mark.parametrize("world,tp,cp,ep,pp,etp,order", CASES)
def test_groups_equal_megatron_core(RankGenerator, world, tp, cp, ep, pp, etp, order):
    grid = RankGrid(world, tp=tp, cp=cp, ep=ep, pp=pp, etp=etp, order=order)
    assert (grid.dp, grid.edp) == (world // (tp * cp * pp), world // (etp * ep * pp))
    tables, expert_pp = megatron_tables(RankGenerator, world, tp, cp, ep, pp, etp, order)
    for name in GROUPS:
        assert grid.groups(name) == tables[name], name  # order of groups and of ranks within each
        assert grid.size(name) == len(tables[name][0]), name
    assert grid.groups("pp") == expert_pp  # dense and expert grids share the pipeline groups
    # group_of and coords agree with the tables on a spread of ranks
    for rank in sorted({0, 1, world // 3, world // 2 + 1, world - 1}):
        c = grid.coords(rank)
        for name in GROUPS:
            g = grid.group_of(name, rank)
            assert g in tables[name] and rank in g, name
        assert grid.group_of("tp", rank).index(rank) == c["tp"]
        assert grid.group_of("ep", rank).index(rank) == c["ep"]
        assert grid.group_of("edp", rank).index(rank) == c["edp"]
        assert grid.group_of("pp", rank).index(rank) == c["pp"]


def test_every_order_at_world_16_matches_megatron_core(RankGenerator):
    """All 120 orders x a few size sets: either the same tables, or refused where megatron-core refuses."""
    sizes = [(2, 2, 2, 2, 1), (2, 1, 4, 2, 2), (1, 2, 2, 1, 1), (4, 1, 2, 2, 2)]  # tp, cp, ep, pp, etp
    compared = 0
    for perm in itertools.permutations(["tp", "cp", "ep", "dp", "pp"]):
        order = "-".join(perm)
        for tp, cp, ep, pp, etp in sizes:
            dp, edp = 16 // (tp * cp * pp), 16 // (etp * ep * pp)
            tables, expert_pp = megatron_tables(RankGenerator, 16, tp, cp, ep, pp, etp, order)
            mcore_accepts = (order.endswith("pp") or pp == 1 or edp == dp) and tables["pp"] == expert_pp
            if not mcore_accepts:
                with pytest.raises(ParallelConfigError, match="parallel.order"):
                    RankGrid(16, tp=tp, cp=cp, ep=ep, pp=pp, etp=etp, order=order)
                continue
            grid = RankGrid(16, tp=tp, cp=cp, ep=ep, pp=pp, etp=etp, order=order)
            assert {n: grid.groups(n) for n in GROUPS} == tables, order
            compared += 1
    assert compared >= 240


def test_coords_follow_the_order_formula():
    grid = RankGrid(64, tp=2, cp=2, ep=4, pp=2, etp=1)  # tp-cp-ep-dp-pp: dp=8, edp=8
    for rank in range(64):
        c = grid.coords(rank)
        assert rank == c["tp"] + 2 * (c["cp"] + 2 * (c["dp"] + 8 * c["pp"]))
        assert rank == c["etp"] + 1 * (c["ep"] + 4 * (c["edp"] + 8 * c["pp"]))


def test_describe_and_summary():
    grid = RankGrid(16, tp=2, ep=4, pp=2, supernode_size=8)
    assert grid.describe() == {"world_size": 16, "tp": 2, "cp": 1, "pp": 2, "dp": 4, "ep": 4, "etp": 1, "edp": 2,
                               "order": "tp-cp-ep-dp-pp", "supernode_size": 8}
    assert "tp=2" in grid.summary() and "ep=4" in grid.summary() and "supernode=8" in grid.summary()


# ---------------------------------------------------------------------------------------------- errors
BAD = [
    (dict(world_size=12, tp=8), "parallel.tp", ["world size 12", "valid tp: [1, 2, 3, 4, 6, 12]"]),
    (dict(world_size=8, tp=2, pp=3), "parallel.pp", ["world size 8", "valid: [1, 2, 4, 8]"]),
    (dict(world_size=8, tp=2, cp=8), "parallel.tp", ["tp*cp*pp = 2*8*1 = 16", "valid tp: [1]"]),
    (dict(world_size=8, ep=3), "parallel.ep", ["world size 8"]),
    (dict(world_size=8, ep=2, etp=8), "parallel.ep", ["ep*etp*pp = 2*8*1 = 16", "valid ep: [1]"]),
    (dict(world_size=8, tp=0), "parallel.tp", ["positive integer"]),
    (dict(world_size=8, ep=2, etp=-1), "parallel.etp", ["positive integer"]),
    (dict(world_size=8, order="tp-xp-dp"), "parallel.order", ["unknown axis 'xp'"]),
    (dict(world_size=8, order="tp-dp-tp"), "parallel.order", ["'tp' appears twice"]),
    (dict(world_size=8, order=""), "parallel.order", ["permutation"]),
    (dict(world_size=8, ep=2, order="tp-cp-dp-pp"), "parallel.order", ["'ep' is missing but ep=2"]),
    (dict(world_size=8, tp=2, order="tp-cp-ep-pp"), "parallel.order", ["'dp' is missing but dp=4, edp=8"]),
    (dict(world_size=16, tp=2, ep=4, pp=2, order="tp-pp-ep-dp"), "parallel.order", ["dp=4, edp=2", "pp last"]),
    (dict(world_size=8, tp=2, ep=2, pp=2, order="tp-pp-cp-ep-dp"), "parallel.order", ["pipeline groups"]),
    # EP groups crossing a supernode: too large, or strided across supernodes by the order
    (dict(world_size=128, ep=128, supernode_size=64), "parallel.ep",
     ["supernode_size=64", "spans supernodes 0..1", "valid parallel.ep: [1, 2, 4, 8, 16, 32, 64]"]),
    (dict(world_size=128, ep=2, order="tp-cp-dp-ep-pp", supernode_size=64), "parallel.ep",
     ["EP group [0, 64]", "supernode_size=64", "valid parallel.ep: [1]"]),
    (dict(world_size=128, etp=2, ep=64, supernode_size=64), "parallel.ep", ["supernode_size=64"]),  # etp x ep = 128
    (dict(world_size=128, tp=128, supernode_size=64), "parallel.tp", ["TP group", "supernode_size=64"]),
    (dict(world_size=8, supernode_size=0), "cluster.supernode_size", ["positive integer"]),
]


@pytest.mark.parametrize("kwargs,key,fragments", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_layouts_name_the_key(kwargs, key, fragments):
    with pytest.raises(ParallelConfigError) as info:
        RankGrid(**kwargs)
    e = info.value
    assert isinstance(e, ConfigError) and isinstance(e, ValueError)
    assert e.key == key
    assert f"{key}=" in str(e)
    for fragment in fragments:
        assert fragment in str(e)


def test_supernode_layouts_that_fit_are_accepted():
    RankGrid(128, tp=2, ep=32, supernode_size=64)  # etp-ep groups of 32 consecutive ranks
    RankGrid(128, tp=8, ep=64, pp=2, supernode_size=64)
    RankGrid(512, tp=8, ep=64, pp=8, supernode_size=64)
    RankGrid(32, ep=32, supernode_size=64)  # the whole world fits one supernode


def test_check_divisibility():
    m = ModelConfig(kda_num_heads=8, mla_num_heads=12, num_experts=16, moe_intermediate_size=96)
    check_divisibility(m, tp=4, ep=8, etp=2)
    RankGrid(16, tp=4, ep=8, etp=2).check_divisibility(m)
    with pytest.raises(ParallelConfigError, match=r"parallel.tp=8: must divide model.mla_num_heads=12"):
        check_divisibility(m, tp=8)
    with pytest.raises(ParallelConfigError, match=r"parallel.tp=3: must divide model.kda_num_heads=8"):
        check_divisibility(m, tp=3)
    with pytest.raises(ParallelConfigError, match=r"parallel.ep=3: must divide model.num_experts=16"):
        check_divisibility(m, ep=3)
    with pytest.raises(ParallelConfigError, match=r"parallel.etp=5: must divide model.moe_intermediate_size=96"):
        check_divisibility(m, etp=5)
    check_divisibility(ModelConfig(first_k_dense=2, num_layers=2, num_experts=16), ep=3)  # no MoE layer


# ---------------------------------------------------------------------------------------------- one process
def test_single_process_without_torch_distributed(caplog):
    # An earlier in-process Trainer in this xdist worker may have left its one-rank group (ensure_distributed):
    # checked here, at run time, not at collection (a skipif condition is read once, at import).
    if dist.is_initialized():
        assert dist.get_world_size() == 1, "a multi-rank group leaked into the test process"
        shutdown()
        dist.destroy_process_group()
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    for fn in (ps.get_tensor_model_parallel_world_size, ps.get_pipeline_model_parallel_world_size,
               ps.get_data_parallel_world_size, ps.get_context_parallel_world_size,
               ps.get_expert_model_parallel_world_size, ps.get_expert_data_parallel_world_size,
               ps.get_expert_tensor_parallel_world_size, ps.get_model_parallel_world_size):
        assert fn() == 1, fn.__name__
    for fn in (ps.get_tensor_model_parallel_rank, ps.get_pipeline_model_parallel_rank, ps.get_data_parallel_rank,
               ps.get_context_parallel_rank, ps.get_expert_model_parallel_rank, ps.get_expert_data_parallel_rank):
        assert fn() == 0, fn.__name__
    assert ps.get_data_parallel_world_size(with_context_parallel=True) == 1
    assert ps.get_tensor_model_parallel_group() is None and ps.get_expert_model_parallel_group() is None
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.describe()["world_size"] == 1
    mpu = get_mpu()
    assert mpu.get_data_parallel_world_size() == 1 and mpu.get_model_parallel_rank() == 0
    assert mpu.get_data_parallel_group_ranks() == [0]

    with caplog.at_level(logging.INFO, logger="megatron_k3.parallel.state"):
        state = ps.initialize_model_parallel(model_cfg=ModelConfig())
    try:
        assert ps.model_parallel_is_initialized() and state.group("tp") is None and state.size("dp") == 1
        assert "parallel layout: world=1" in caplog.text
        with pytest.raises(RuntimeError, match="already initialized"):
            ps.initialize_model_parallel()
    finally:
        ps.destroy_model_parallel()
    with pytest.raises(RuntimeError, match="need torch.distributed"):
        ps.initialize_model_parallel(tp=2)
    assert not ps.model_parallel_is_initialized()

    cfg = RunConfig()
    try:
        state = ps.initialize_from_config(cfg)
        assert state.grid.describe()["supernode_size"] == cfg.cluster.supernode_size
    finally:
        ps.destroy_model_parallel()


# ---------------------------------------------------------------------------------------------- gloo
def _layout_worker(rank, world, sizes):
    """Initialize ``sizes``; report every group's members as torch sees them and two all-reduces."""
    state = ps.initialize_model_parallel(**sizes)
    seen = {}
    for name in GROUPS:
        g = state.group(name)
        seen[name] = (dist.get_process_group_ranks(g), dist.get_rank(g), state.ranks(name), state.rank_in(name))
    sums = {}
    for name, group in (("tp", ps.get_tensor_model_parallel_group()), ("dp", ps.get_data_parallel_group()),
                        ("ep", ps.get_expert_model_parallel_group()), ("edp", ps.get_expert_data_parallel_group())):
        x = torch.tensor([float(2 ** rank)])
        dist.all_reduce(x, group=group)
        sums[name] = int(x.item())
    getters = dict(
        tp=(ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()),
        dp=(ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()),
        pp=(ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()),
        cp=(ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()),
        ep=(ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()),
        edp=(ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_rank()),
        etp=(ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()),
    )
    shared = ps.get_data_parallel_group() is ps.get_data_parallel_group(with_context_parallel=True)
    ps.destroy_model_parallel()
    return seen, sums, getters, shared


def _check_layout(results, world, sizes):
    grid = RankGrid(world, **sizes)
    for rank, (seen, sums, getters, shared) in enumerate(results):
        for name, (torch_ranks, torch_rank, ours, our_rank) in seen.items():
            assert torch_ranks == ours == grid.group_of(name, rank), (rank, name)
            assert torch_rank == our_rank == ours.index(rank), (rank, name)
        for name, total in sums.items():  # each all-reduce summed exactly its group's members
            assert total == sum(2 ** r for r in grid.group_of(name, rank)), (rank, name)
        c = grid.coords(rank)
        for name, (size, r) in getters.items():
            assert (size, r) == (grid.size(name), c[name]), (rank, name)
        assert shared == (grid.cp == 1)  # identical member lists share one communicator


@pytest.mark.slow
def test_world4_tp2_groups_and_collectives():
    results = run_distributed(_layout_worker, 4, dict(tp=2))
    _check_layout(results, 4, dict(tp=2))
    tp_groups = [r[0]["tp"][0] for r in results]
    dp_groups = [r[0]["dp"][0] for r in results]
    assert tp_groups == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert dp_groups == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r[1]["tp"] for r in results] == [3, 3, 12, 12] and [r[1]["dp"] for r in results] == [5, 10, 5, 10]


@pytest.mark.slow
def test_world4_ep2_expert_groups():
    results = run_distributed(_layout_worker, 4, dict(ep=2))
    _check_layout(results, 4, dict(ep=2))
    assert [r[0]["ep"][0] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[0]["edp"][0] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r[0]["dp"][0] == [0, 1, 2, 3] for r in results)  # dense DP folds over EP


@pytest.mark.slow
def test_world8_all_axes():
    sizes = dict(tp=2, ep=2, pp=2, cp=1, etp=1)
    _check_layout(run_distributed(_layout_worker, 8, sizes), 8, sizes)
    sizes = dict(tp=2, cp=2, ep=4, pp=1, etp=1, order="tp-cp-ep-dp-pp")
    _check_layout(run_distributed(_layout_worker, 8, sizes), 8, sizes)


def _bad_layout_worker(rank, world):
    ps.initialize_model_parallel(tp=4)  # world 2: tp*cp*pp = 4 does not divide it


@pytest.mark.slow
def test_bad_layout_fails_on_every_rank_without_hanging():
    with pytest.raises(DistributedError) as info:
        run_distributed(_bad_layout_worker, 2, timeout=60)
    errors = info.value.errors
    assert sorted(errors) == [0, 1]
    for kind, message, _ in errors.values():
        assert kind == "ParallelConfigError" and "parallel.tp=4" in message and "world size 2" in message


def _one_rank_raises_worker(rank, world):
    if rank == 1:
        raise KeyError("boom on rank 1")
    dist.barrier()  # rank 1 never arrives
    return "unreachable"


@pytest.mark.slow
def test_helper_reports_a_failed_rank_and_stops_the_rest():
    with pytest.raises(DistributedError) as info:
        run_distributed(_one_rank_raises_worker, 2, timeout=60)
    assert "boom on rank 1" in info.value.errors[1][1] and "rank 1 raised KeyError" in str(info.value)


def _sleepy_worker(rank, world):
    if rank == 0:
        time.sleep(300)  # a hang, as a wrong group would cause
    return rank


@pytest.mark.slow
def test_helper_kills_workers_at_the_timeout():
    with pytest.raises(DistributedError, match=r"timed out after 3 s; ranks \[0\]"):
        run_distributed(_sleepy_worker, 2, timeout=3)


# ---------------------------------------------------------------------------------------------- DeepSpeed
# Calls on an mpu that DeepSpeed 0.19.8 makes and we leave unanswered on purpose (see MPU's docstring).
NOT_OURS = {"initialize_sequence_parallel", "get_slice_parallel_rank", "get_slice_parallel_world_size",
            "get_slice_parallel_group", "get_pipe_parallel_group", "get_pipe_parallel_world_size",
            "_init_tp_mesh_device"}


def test_mpu_has_every_method_deepspeed_calls():
    spec = find_spec("deepspeed")
    if spec is None:
        pytest.skip("deepspeed not installed")
    root = Path(spec.origin).parent
    called = set()
    for sub in ("runtime", "utils", "moe", "inference", "checkpoint", "module_inject"):
        for path in (root / sub).rglob("*.py"):
            called |= set(re.findall(r"\bmpu_?\.(\w+)\(", path.read_text(errors="ignore")))
            called |= set(re.findall(r"hasattr\(\s*[\w.]*mpu_?,\s*['\"](\w+)['\"]", path.read_text(errors="ignore")))
    assert "get_data_parallel_group" in called  # the scan found DeepSpeed's calls
    missing = sorted(name for name in called - NOT_OURS if not callable(getattr(MPU, name, None)))
    assert not missing, f"DeepSpeed calls mpu methods MPU lacks: {missing}"
    assert not hasattr(MPU, "initialize_sequence_parallel")  # would switch DeepSpeed to its Ulysses-only path


def _deepspeed_worker(rank, world):
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import bwc, groups

    # The shared-memory comm op is a C++ JIT build (half a minute on a cold cache) unrelated to the mpu.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    ps.initialize_model_parallel(tp=2, cp=2)  # world 4: dp = 1, dp x cp = 2
    mpu = get_mpu()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    before = model.weight.detach().clone()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    out = dict(
        dp=engine.dp_world_size, seq_dp=engine.seq_dp_world_size, sp=engine.sequence_parallel_size,
        mp=engine.mp_world_size, ckpt_mp_rank=engine.checkpoint_mp_rank, batch=engine.train_batch_size(),
        seq_dp_ranks=dist.get_process_group_ranks(groups._get_sequence_data_parallel_group()),
        dp_ranks=dist.get_process_group_ranks(groups._get_data_parallel_group()),
        bwc=(bwc.bwc_tensor_model_parallel_rank(mpu), bwc.bwc_tensor_model_parallel_world_size(mpu),
             bwc.bwc_pipeline_parallel_world_size(mpu),
             dist.get_process_group_ranks(bwc.bwc_tensor_model_parallel_group(mpu))),
        model_parallel_ranks=dist.get_process_group_ranks(mpu.get_model_parallel_group()),
    )
    for _ in range(3):  # one optimizer step; data differs across the dp x cp ranks
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(x).square().sum())
        engine.step()
    out["weight"] = model.weight.detach().clone()
    out["changed"] = not torch.equal(before, out["weight"])
    ps.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_deepspeed_initialize_with_our_mpu():
    pytest.importorskip("deepspeed")
    results = run_distributed(_deepspeed_worker, 4, timeout=120)
    grid = RankGrid(4, tp=2, cp=2)
    for rank, r in enumerate(results):
        assert (r["dp"], r["seq_dp"], r["sp"], r["mp"]) == (1, 2, 2, 2)
        assert r["batch"] == 2 * 3 * 1  # micro batch x accumulation x dp: CP ranks share samples
        assert r["ckpt_mp_rank"] == grid.coords(rank)["tp"]  # mp_rank_XX file names: one per model shard
        assert r["seq_dp_ranks"] == grid.group_of("dp-cp", rank)  # ZeRO shards and reduces over dp x cp
        assert r["dp_ranks"] == grid.group_of("dp", rank) == [rank]
        assert r["bwc"] == (grid.coords(rank)["tp"], 2, 1, grid.group_of("tp", rank))
        assert r["model_parallel_ranks"] == grid.group_of("tp-pp", rank)
        assert r["changed"]
    # Gradients were reduced over dp x cp and nothing wider: the ranks of one dp x cp group hold the same
    # weights, the two TP positions (different data, no TP sharding of this toy model) do not.
    for rank, r in enumerate(results):
        for other in grid.group_of("dp-cp", rank):
            assert torch.equal(r["weight"], results[other]["weight"])
    assert not torch.equal(results[0]["weight"], results[1]["weight"])


@pytest.mark.parametrize("n", [1, 2, 3, 6, 14, 28])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_expert_blocks_cover_every_expert_once(n, parts):
    """layout.expert_block (the experts whose optimizer states an edp rank keeps, training.expert_optimizer): in rank
    order, contiguous, each expert in exactly one block, none larger than ceil(n / parts)."""
    from megatron_k3.layout import expert_block

    blocks = [expert_block(n, parts, i) for i in range(parts)]
    assert [s for s, _ in blocks] == sorted(s for s, _ in blocks) and sum(c for _, c in blocks) == n
    covered = [e for s, c in blocks for e in range(s, s + c)]
    assert covered == list(range(n)) and max(c for _, c in blocks) == -(-n // parts)
