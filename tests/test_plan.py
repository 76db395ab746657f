"""The planner (megatron_k3.planning, tools/plan.py): parameter totals equal tools/param_count.py's, the
full model's layouts on eight supernodes and why one supernode cannot train it but serves it in MXFP4,
and the memory / communication model's arithmetic. The CPU checks against a real run live in
tests/test_plan_cpu_check.py."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import load_file

from megatron_k3.config import compose_config, load_model_config
from megatron_k3.model.params import count_parameters
from megatron_k3.planning.activations import attn_res_sources
from megatron_k3.planning.candidates import Layout, planner_problems, stage_layers
from megatron_k3.planning.comm import training_comm
from megatron_k3.planning.memory import GB, Workload, training_memory
from megatron_k3.planning.params import model_params
from megatron_k3.planning.planner import plan_inference, plan_training, search_training

ROOT = Path(__file__).resolve().parent.parent


def _tool(name):
    return load_file(ROOT / "tools" / f"{name}.py")


@pytest.fixture(scope="module")
def plan_tool():
    return _tool("plan")


def run_plan(plan_tool, capsys, *args):
    """tools/plan.py's output; its exit status 0, or 1 where the one training layout given does not fit."""
    rc = plan_tool.main(list(args))
    out = capsys.readouterr()
    single = "--search" not in args and "infer" not in args
    assert rc == (1 if single and "-> DOES NOT FIT" in out.out else 0), out.err
    return out.out


def plan_json(plan_tool, capsys, *args):
    rc = plan_tool.main([*args, "--json"])
    out = capsys.readouterr()
    got = json.loads(out.out)
    single = "--search" not in args and "infer" not in args
    assert rc == (1 if single and got.get("fits") is False else 0), out.err
    return got


@pytest.fixture(scope="module")
def k3():
    return compose_config(["model=k3", "cluster=supernodes_8x64", "train=pretrain", "precision=bf16"])[0]


@pytest.mark.parametrize("name", ["k3", "k3_tiny", "k3_small", "kimi_linear_48b"])
def test_per_layer_parameters_sum_to_the_models_own_count(name):
    cfg = load_model_config(name)
    mp = model_params(cfg, 1)
    assert mp.dense_total() + mp.expert_total() == count_parameters(cfg)["total"]


def test_tensor_parallel_shards_what_the_model_shards():
    """Per-rank counts come from modules built under the TP context: attention shrinks ~1/tp, the routed
    experts, router and latent projections do not (they are split by EP / replicated)."""
    cfg = load_model_config("k3")
    one, eight = model_params(cfg, 1), model_params(cfg, 8)
    assert eight.expert_total() == one.expert_total()
    kda = next(i for i, t in enumerate(cfg.layer_types()) if t == "kda" and cfg.ffn_types()[i] == "moe")
    moe_replicated = 896 * 7168 + 2 * 7168 * 3584  # router + latent down/up stay whole on every TP rank
    assert eight.layers[kda].dense.total < one.layers[kda].dense.total / 4
    assert eight.layers[kda].dense.total > moe_replicated
    with pytest.raises(ValueError, match="divisible"):
        model_params(cfg, 5)


def test_parameter_totals_equal_param_count(plan_tool, capsys):
    ref = count_parameters(load_model_config("k3"))
    got = plan_json(plan_tool, capsys, "model=k3", "cluster=supernodes_8x64", "parallel.tp=8", "parallel.pp=8",
                    "parallel.ep=64")
    assert got["total_params"] == ref["total"] == 2779484393568
    assert got["active_params"] == ref["active"]
    for k in ("layout", "memory_per_device_gb", "memory_breakdown_gb", "comm_bytes_per_step", "step_time_s", "mfu"):
        assert k in got
    assert got["layout"]["dp"] == 512 // 64 and got["layout"]["edp"] == 1


def test_eight_supernodes_search_lists_layouts_that_fit(plan_tool, capsys):
    text = run_plan(plan_tool, capsys, "model=k3", "cluster=supernodes_8x64", "--search")
    assert "rules:" in text and "model states alone" in text and "fastest first" in text and "why:" in text
    got = plan_json(plan_tool, capsys, "model=k3", "cluster=supernodes_8x64", "--search")
    assert got["total_params"] == count_parameters(load_model_config("k3"))["total"]
    fits = got["fits"]
    assert fits, "some training layout must fit 512 x 141 GB"
    times = [p["step_time_s"] for p in fits]
    assert times == sorted(times)
    for p in fits:
        lay = p["layout"]
        assert p["fits"] and p["memory_per_device_gb"] <= 141
        assert lay["ep"] <= 64 and 64 % lay["ep"] == 0 and lay["tp"] <= 8
        assert lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"] == 512
        assert max(p["stage_memory_gb"]) == pytest.approx(p["memory_per_device_gb"], abs=1e-3)
        assert 0 < p["mfu"] < 1 and 0 <= p["pipeline_bubble"] < 1


def test_one_supernode_cannot_train_but_serves_mxfp4(plan_tool, capsys):
    text = run_plan(plan_tool, capsys, "model=k3", "cluster=supernode_64", "--search")
    assert "NO training layout fits 64 x 141 GB" in text
    assert "model states alone need" in text and "training needs at least 512 accelerators" in text
    assert "inference" in text and "FITS on 64 accelerators" in text
    got = plan_json(plan_tool, capsys, "model=k3", "cluster=supernode_64", "--search")
    assert got["fits"] == [] and got["min_accelerators"] == 512
    assert got["model_state_bytes"] > 64 * 141e9  # the reason: states alone exceed the supernode
    assert all(p["memory_per_device_gb"] > 141 for p in got["over_memory"])
    inf = plan_json(plan_tool, capsys, "model=k3", "cluster=supernode_64", "--mode", "infer", "--batch", "64",
                    "--context", "131072")
    assert inf["fits"] and inf["memory_per_device_gb"] <= 141
    mb = inf["model_bytes_gb"]
    # MXFP4 = 4.25 bits per routed-expert weight; the rest bf16: 2.72T experts -> ~1.45 TB, ~57B rest -> ~113 GB
    assert mb["mxfp4_experts"] == pytest.approx(2722740830208 * 4.25 / 8 / 1e9)
    assert mb["bf16_part"] == pytest.approx((2779484393568 - 2722740830208) * 2 / 1e9)
    assert mb["mxfp4_experts"] + mb["bf16_part"] < 64 * 141  # the whole model fits the supernode's memory
    # MODEL.md 0.1: KDA state 69 x 96 x 128 x 128 x 4 B = 434 MB per sequence (+ conv state), MLA 27.6 KB/token
    assert inf["kda_state_per_sequence_gb"] == pytest.approx(0.434, abs=0.02)
    assert inf["mla_cache_per_token_kb"] == pytest.approx(27.6, abs=0.05)


def test_optimizer_states_muon_vs_adamw_and_zero_sharding(k3):
    cfg, cl = k3.model, k3.cluster
    lay = Layout(world=512, tp=8, pp=8, ep=64, recompute="full")
    base = dict(seq_length=4096, micro_batch_size=1, global_batch_size=4096, precision="bf16")
    adam = training_memory(cfg, cl, lay, Workload(**base, optimizer="adamw"))[1]
    muon = training_memory(cfg, cl, lay, Workload(**base, optimizer="muon"))[1]
    mp = model_params(cfg, 8)
    a, b = stage_layers(cfg, 8)[1]
    dense_muon = sum(lp.dense.muon for lp in mp.layers[a:b])
    exp_muon = sum(lp.experts.muon for lp in mp.layers[a:b]) / 64
    # Muon drops AdamW's second moment (4 B) for matrices; sharded over DP x CP (dense) and expert-DP (experts)
    assert adam.optimizer - muon.optimizer == pytest.approx(4 * dense_muon / lay.dp + 4 * exp_muon / lay.edp, rel=1e-9)
    # ZeRO-0 keeps master + moments (12 B) of every dense parameter; ZeRO-1 shards them over dp (cp = 1);
    # the experts' expert-DP group has one member here, so they are unsharded either way
    z0 = training_memory(cfg, cl, lay, Workload(**base, zero_stage=0))[1]
    dense = sum(lp.dense.total for lp in mp.layers[a:b])
    assert z0.optimizer - adam.optimizer == pytest.approx(12 * dense * (1 - 1 / lay.dp), rel=1e-9)


def test_recomputation_trades_memory_for_flops(k3):
    cfg, cl = k3.model, k3.cluster
    w = Workload(4096, 1, 4096, "bf16", "muon")
    plans = {rc: plan_training(cfg, cl, Layout(world=512, tp=8, pp=8, ep=64, recompute=rc), w)
             for rc in ("none", "selective", "full")}
    acts = [plans[rc].memory_breakdown["activations"] for rc in ("none", "selective", "full")]
    flops = [plans[rc].device_flops_per_step for rc in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]
    assert flops[0] < flops[1] < flops[2]
    assert flops[2] == pytest.approx(flops[0] * 4 / 3, rel=0.02)  # full: one more forward (fwd:bwd ~ 1:2)
    assert len({plans[rc].model_flops_per_step for rc in plans}) == 1  # MFU counts model FLOPs only
    p = plans["full"]
    assert p.activation_breakdown  # the reasoning shows what the activations are
    assert set(p.comm_bytes) >= {"tp", "ep", "pp", "dp_grad_reduce", "dp_param_gather"}


def test_communication_follows_the_layout(k3):
    cfg, cl = k3.model, k3.cluster
    w = Workload(4096, 1, 4096, "bf16", "adamw")
    single_lay = Layout(world=512, tp=8, pp=8, ep=64, recompute="full")
    single = plan_training(cfg, cl, single_lay, w)
    assert single.comm_bytes["ep"] > 0 and single.comm_bytes["tp"] > 0 and single.comm_bytes["pp"] > 0
    no_tp = plan_training(cfg, cl, Layout(world=512, tp=1, pp=8, ep=64, recompute="full"), w)
    assert no_tp.comm_bytes["tp"] == 0
    # EP all-to-all per device on the slowest stage: its MoE layers x dispatch+combine x fwd+bwd+recompute
    n_moe = max(cfg.ffn_types()[slice(*s)].count("moe") for s in stage_layers(cfg, 8))  # slowest stage
    m = 4096 // 8
    rows = 4096 / 8 * 16 * 3584 * 2 * 63 / 64  # SP: this rank's 512 tokens, top-16 latent rows, bf16
    assert single.comm_bytes["ep"] == pytest.approx(m * n_moe * 2 * 3 * rows, rel=1e-9)
    # ep=32 on 512: two expert-data-parallel replicas. ExpertOptimizer reduce-scatters each expert's fp32 gradient
    # over them to the owner of its block of whole experts after the last backward (4 B x (edp-1)/edp per expert
    # parameter) and all-gathers the updated blocks in bf16 after the step (2 B x (edp-1)/edp), both exposed, outside
    # DeepSpeed's reduction and parameter all-gather, which carry the dense parameters only
    from megatron_k3.planning.comm import training_comm

    lay2 = Layout(world=512, tp=8, pp=8, ep=32, recompute="full")
    a, b = stage_layers(cfg, 8)[1]
    experts = sum(lp.experts.total for lp in model_params(cfg, 8, 32).layers[a:b])
    two, one = training_comm(cfg, cl, lay2, w, 1).bytes_by_kind, training_comm(cfg, cl, single_lay, w, 1).bytes_by_kind
    assert two["edp_grad_reduce"] == pytest.approx(experts * 4 / 2, rel=1e-12) and one["edp_grad_reduce"] == 0
    assert two["edp_param_gather"] == pytest.approx(experts * 2 / 2, rel=1e-12) and one["edp_param_gather"] == 0
    # 14 experts per EP rank over edp 4 (ep=64 on 2048): blocks of 4, 4, 4 and 2, so both run over 16 experts' rows
    four = training_comm(cfg, cl, Layout(world=2048, tp=8, pp=8, ep=64, recompute="full"), w, 1).bytes_by_kind
    e64 = sum(lp.experts.total for lp in model_params(cfg, 8, 64).layers[a:b])
    assert four["edp_grad_reduce"] == pytest.approx(e64 * 16 / 14 * 4 * 3 / 4, rel=1e-12)
    assert four["edp_param_gather"] == pytest.approx(e64 * 16 / 14 * 2 * 3 / 4, rel=1e-12)
    assert two["dp_grad_reduce"] == pytest.approx(one["dp_grad_reduce"], rel=1e-12)  # the dense parameters only


def test_layout_rules():
    cfg = load_model_config("k3")
    cl = compose_config(["cluster=supernodes_8x64"])[0].cluster
    ok = Layout(world=512, tp=8, pp=8, ep=64)
    w = Workload(4096, 1, 4096, "bf16", "muon")

    def reasons(lay):
        return " | ".join(p.reason for p in planner_problems(cfg, cl, lay, w))

    assert planner_problems(cfg, cl, ok, w) == []
    assert "EP group" in reasons(Layout(world=512, tp=8, pp=4, ep=128))
    assert "blocks" in reasons(Layout(world=512, tp=4, pp=16, ep=8))
    assert "node" in reasons(Layout(world=512, tp=16, pp=4, ep=8))
    # a rejected layout is counted by its key and rule, which hold no numbers: layouts that break one rule with
    # other sizes count together
    kinds = {planner_problems(cfg, cl, lay, w)[0].kind
             for lay in (Layout(world=512, tp=8, pp=4, ep=128), Layout(world=512, tp=4, pp=2, ep=256))}
    assert kinds == {"parallel.ep: EP <= supernode size"}, kinds
    # train.tile_tokens: 4096 tokens at tp8 + SP are 512 per TP rank in the MoE layers: a 384-token tile cuts neither
    # them nor the head's 4096; 1024 leaves the MoE layers untiled and cuts the head in four
    assert "nearest that work are 256 and 512" in reasons(replace(ok, tile_tokens=384))
    assert planner_problems(cfg, cl, replace(ok, tile_tokens=1024), w) == []
    res = search_training(load_model_config("k3_tiny"), cl, w, top=1, find_min_world=False)
    assert res.invalid == {"parallel.tp: divides model.kda_num_heads": 90}, res.invalid
    assert stage_layers(cfg, 8)[0] == (0, 12) and stage_layers(cfg, 8)[-1] == (84, 93)  # whole 12-layer blocks


def test_attn_res_sources_follow_the_decoder():
    cfg = load_model_config("k3")
    src, out = attn_res_sources(cfg)
    assert src[0] == (0, 2) and src[1] == (2, 2) and src[12] == (2, 3) and out == 9  # 8 blocks + embedding


def test_inference_layout_checks(k3):
    cl = compose_config(["cluster=supernode_64"])[0].cluster
    with pytest.raises(ValueError, match="supernode"):
        plan_inference(k3.model, cl, 8, 128, 1, 8, 1024)
    small = plan_inference(k3.model, cl, 8, 64, 1, 1, 1024)
    big = plan_inference(k3.model, cl, 8, 64, 1, 256, 131072)
    assert big.memory.mla_cache > small.memory.mla_cache and big.memory.kda_states > small.memory.kda_states
    assert big.memory.weights_experts == small.memory.weights_experts == pytest.approx(
        2722740830208 / 64 * 4.25 / 8)


def test_cli_errors_are_one_line(plan_tool, capsys):
    assert plan_tool.main(["model=k3", "--mode", "fly"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--mode" in err[0]
    assert plan_tool.main(["model=k3", "cluster=supernodes_8x64", "parallel.tp=5"]) == 2
    assert "tp" in capsys.readouterr().err
    # a search whose every candidate breaks a rule is bad input, not a memory limit: it names the key and value,
    # instead of "no layout fits" and a scan over more accelerators that could not help
    bad_tile = ["model=k3_tiny", "cluster=cpu", "train.seq_length=64", "train.tile_tokens=7", "--search"]
    assert plan_tool.main(bad_tile) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.tile_tokens=7" in err[0] and "nothing was planned" in err[0]


def test_zero0_layouts_the_trainer_refuses_are_not_planned(plan_tool, capsys):
    """parallel.zero_stage=0 runs one pipeline stage, no expert parallelism and fp32 weights (layout rule 9): the
    planner's rules refuse a layout exactly when the Trainer's config check does, naming the key, and a search under
    ZeRO-0 plans no other (until 2026-12-06 `tools/plan.py model=k3 --zero 0 --search` chose tp4 pp8 ep64 with bf16
    weights, which the Trainer refuses)."""
    from megatron_k3.config import ConfigError, compose_run_config

    cfg = load_model_config("k3")
    cl = compose_config(["cluster=supernodes_8x64"])[0].cluster
    for precision in ("fp32", "bf16"):
        w = Workload(4096, 1, 4096, precision, "muon", zero_stage=0)
        for tp, pp, ep in ((8, 1, 1), (8, 8, 1), (8, 1, 64), (4, 8, 64)):
            planned = planner_problems(cfg, cl, Layout(world=512, tp=tp, pp=pp, ep=ep, sequence_parallel=True), w)
            refused = None
            try:
                compose_run_config(["model=k3", "cluster=supernodes_8x64", "train=pretrain", f"precision={precision}",
                                    "parallel.zero_stage=0", f"parallel.tp={tp}", f"parallel.pp={pp}",
                                    f"parallel.ep={ep}", "parallel.sequence_parallel=true"], world_size=512)
            except ConfigError as e:
                refused = e
            assert (refused is None) == (planned == []) == (precision == "fp32" and pp == ep == 1), (precision, tp, pp,
                                                                                                    ep, planned)
            if refused is not None:
                assert refused.key == planned[0].key == "parallel.zero_stage" and str(planned[0]) in str(refused)
    assert plan_tool.main(["model=k3", "cluster=supernodes_8x64", "--zero", "0", "--search"]) != 0
    assert "ZeRO 1 or 2 with bf16 weights" in capsys.readouterr().err


def test_the_plans_flags_are_the_trainers_keys(plan_tool, capsys):
    """--zero and --grad-dtype set parallel.zero_stage and precision.grad_accum_dtype: the key alone plans what the
    flag does, and what the Trainer's start-up check (check_fits) computes for the same overrides (until 2026-12-06
    the flags' defaults won: `parallel.zero_stage=2` planned ZeRO-1 and no key set --grad-dtype). A flag
    contradicting its key is refused, naming both."""
    from megatron_k3.planning.run import check_fits, compose_for_planning

    base = ["model=k3", "cluster=supernodes_8x64", "parallel.tp=8", "parallel.pp=8", "parallel.ep=64",
            "parallel.sequence_parallel=true", "train.recompute=selective"]
    plain = plan_json(plan_tool, capsys, *base)["memory_per_device_gb"]
    for flag, key in ((["--zero", "2"], "parallel.zero_stage=2"),
                      (["--grad-dtype", "bf16"], "precision.grad_accum_dtype=bf16")):
        by_flag = plan_json(plan_tool, capsys, *base, *flag)["memory_per_device_gb"]
        by_key = plan_json(plan_tool, capsys, *base, key)["memory_per_device_gb"]
        checked = max(s.total for s in check_fits(compose_for_planning(base + [key])[0], 512)) / GB
        assert by_flag == by_key == pytest.approx(checked, rel=1e-9) and by_key < plain - 2, (flag, by_key, plain)
    for contradiction in (["parallel.zero_stage=1", "--zero", "2"], ["++parallel.zero_stage=1", "--zero", "2"]):
        assert plan_tool.main(base + contradiction) == 2
        err = capsys.readouterr().err
        assert "--zero='2'" in err and "parallel.zero_stage=1" in err
    agree = plan_json(plan_tool, capsys, *base, "precision.grad_accum_dtype='bf16'", "--grad-dtype", "bf16")
    assert agree["memory_per_device_gb"] == by_key  # the key and the flag saying the same: no contradiction
    # the flag's key is not the user's: --mode infer still searches the serving layout (parallel.* not given)
    assert plan_json(plan_tool, capsys, "model=k3", "cluster=supernodes_8x64", "--mode", "infer", "--zero", "1")[
        "search"]


def test_the_cpu_plan_reports_what_a_tiny_run_needs(plan_tool, capsys):
    got = plan_json(plan_tool, capsys, "model=k3_tiny", "cluster=cpu")
    assert got["fits"] and got["workload"]["kernels"] == "eager" and got["workload"]["precision"] == "fp32"
    b = got["memory_breakdown_gb"]
    n = 4488780
    # the gradients, and beside them ZeRO-1's reduction bucket (2 micro-batches: held from the first backward to the
    # step's last), fp32, as large as the engine configures it for this model: n rounded up to 256 elements
    from megatron_k3.config import compose_run_config
    from megatron_k3.training.engine import deepspeed_config

    bucket = deepspeed_config(compose_run_config([])[0], 1, n)["zero_optimization"]["reduce_bucket_size"]
    assert bucket == -(-n // 256) * 256
    assert b["weights"] * GB == n * 4 and b["gradients"] * GB == pytest.approx(n * 4 + bucket * 4, abs=1)
    # the default optim=muon: ZeRO-1's fp32 partition (4 B), Muon's momentum for the matrices it updates (4 B),
    # AdamW's two moments for the rest (8 B); the real run's states: tests/test_plan_cpu_check.py
    from megatron_k3.model import K3ForCausalLM
    from megatron_k3.optim.grouping import muon_rule

    model = K3ForCausalLM(load_model_config("k3_tiny"), init=False)
    m = sum(p.numel() for p in model.parameters() if muon_rule(p).startswith("muon/"))
    assert got["workload"]["optimizer"] == "muon" and 0 < m < n
    assert b["optimizer"] * GB == n * 4 + m * 4 + (n - m) * 8


# ------------------------------------------------------------------------------------------------ checkpoint size

def _checkpoint_bytes_of_a_built_model(name, optimizer):
    """fp32 master (4 B) + optimizer states of every parameter of the real model (AdamW: 8 B; Muon: 4 B for the
    parameters its rule updates, 8 B for the rest) + its persistent buffers, counted on the module itself."""
    from megatron_k3.model import causal_lm_class
    from megatron_k3.optim.grouping import muon_rule

    cfg = load_model_config(name)
    model = causal_lm_class(cfg)(cfg, init=False)  # with the vision tower and projector where the model has them
    params = dict(model.named_parameters())  # a tied tensor once
    total = 0
    for p in params.values():
        state = 4 if optimizer == "muon" and muon_rule(p).startswith("muon/") else 8
        total += p.numel() * (4 + state)
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {k: v for k, v in model.state_dict().items() if k not in aliases}
    assert buffers, "the router's bias is a persistent buffer"
    return total + sum(v.numel() * v.element_size() for v in buffers.values())


@pytest.mark.parametrize("name", ["k3_tiny", "kimi_linear_tiny", "k3_vl_tiny"])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_checkpoint_shares_sum_to_the_models_masters_and_states(name, optimizer):
    from megatron_k3.planning.checkpoint import checkpoint_bytes, checkpoint_plan, rank_shares

    cfg = load_model_config(name)
    expected = _checkpoint_bytes_of_a_built_model(name, optimizer)
    assert checkpoint_bytes(cfg, optimizer) == expected
    cl = compose_config(["cluster=cpu"])[0].cluster
    for lay in (Layout(world=1), Layout(world=8, tp=2, pp=2, ep=2), Layout(world=16, tp=2, pp=2, ep=4, cp=2)):
        for zero in (0, 1):
            shares = rank_shares(cfg, lay, optimizer, zero)
            assert sum(n for _, _, n in shares) == lay.world  # every rank once
            assert sum(b * n for _, b, n in shares) == pytest.approx(expected, rel=1e-12)  # every byte once
            ck = checkpoint_plan(cfg, cl, lay, optimizer, zero_stage=zero)
            assert ck.total == expected and ck.mean_share == pytest.approx(expected / lay.world)
            assert ck.min_share <= ck.mean_share <= ck.max_share
    # under ZeRO-1 the TP-replicated tensors (norms, router, ...) are TP rank 0's to write: its share is larger
    shares = rank_shares(cfg, Layout(world=8, tp=2, pp=2, ep=2), optimizer, 1)
    assert {s for s, _, _ in shares} == {0, 1}
    for s in (0, 1):
        rank0, other = [b for t, b, n in shares if t == s][1:]
        assert rank0 > other


@pytest.mark.parametrize("ep", [64, 32])
def test_checkpoint_share_is_what_the_planner_puts_in_optimizer_memory(k3, ep):
    """Under bf16 + ZeRO-1 a rank's optimizer memory is its fp32 master + states partition: what it writes. TP
    rank 0's share (without the stage's buffers) equals the planner's optimizer memory of each stage, the routed
    experts under edp > 1 included (ep=32 on 512: edp 2): their optimizer (training.expert_optimizer) keeps each
    edp rank's block of whole experts, which that rank writes."""
    from megatron_k3.planning.checkpoint import rank_shares

    cfg, cl = k3.model, k3.cluster
    lay = Layout(world=512, tp=8, pp=8, ep=ep, recompute="full")
    for opt in ("adamw", "muon"):
        mem = training_memory(cfg, cl, lay, Workload(4096, 1, 4096, "bf16", opt))
        shares = rank_shares(cfg, lay, opt, 1)
        for sm in mem:
            writer, rank0, other = [(b, n) for s, b, n in shares if s == sm.stage]
            assert (writer[1], rank0[1], other[1]) == (1, lay.dp - 1, (lay.tp - 1) * lay.dp)
            assert rank0[0] == pytest.approx(sm.optimizer, rel=1e-12)
            assert 0 < writer[0] - rank0[0] < 1e6  # the router's bias: 4 B x 896 experts per MoE layer


def test_checkpoint_time_model(k3):
    from megatron_k3.planning.checkpoint import Storage, checkpoint_plan

    cfg, cl = k3.model, k3.cluster
    lay = Layout(world=512, tp=8, pp=8, ep=64)
    base = checkpoint_plan(cfg, cl, lay, "adamw", step_time=50.0, save_interval=1000)
    # full K3 with AdamW: 12 B per parameter (fp32 master + two moments) + the router's bias
    assert base.total == pytest.approx(2779484393568 * 12, rel=1e-6)
    assert base.mean_share == pytest.approx(base.total / 512)
    st = base.storage
    assert st == Storage(100.0, 50.0, 25.0)
    per_rank = min(st.node_gbps / 8, st.host_copy_gbps)
    assert base.per_rank_gbps == per_rank
    assert base.save_time == max(base.max_share / (per_rank * GB), base.total / (100 * GB))
    assert base.bound == "filesystem" and base.load_time == base.save_time
    assert base.async_stall == pytest.approx(base.max_share / (25 * GB)) and base.async_wait == 0
    assert base.host_snapshot_per_node == pytest.approx(8 * base.max_share)
    assert base.overhead(base.save_time) == pytest.approx(base.save_time / (1000 * 50.0))
    # half the filesystem bandwidth: twice the (filesystem-bound) save and load; the async stall is unchanged
    half = checkpoint_plan(cfg, cl, lay, "adamw", Storage(fs_gbps=50.0))
    assert half.save_time == pytest.approx(2 * base.save_time) and half.load_time == pytest.approx(2 * base.load_time)
    assert half.async_stall == pytest.approx(base.async_stall)
    # every bandwidth halved: every time doubles, whichever bound
    for world_lay, c in ((lay, cl), (Layout(world=1), compose_config(["cluster=cpu"])[0].cluster)):
        one = checkpoint_plan(cfg if c is cl else load_model_config("k3_tiny"), c, world_lay, "muon")
        two = checkpoint_plan(cfg if c is cl else load_model_config("k3_tiny"), c, world_lay, "muon",
                              Storage(50.0, 25.0, 12.5))
        for attr in ("save_time", "load_time", "async_stall"):
            assert getattr(two, attr) == pytest.approx(2 * getattr(one, attr))
    # a slow filesystem: the per-rank path stops binding, and an async save waits for the previous write
    slow = checkpoint_plan(cfg, cl, lay, "adamw", Storage(fs_gbps=1.0), step_time=50.0, save_interval=10)
    assert slow.async_wait == pytest.approx(slow.save_time - 500.0)
    assert slow.async_stall == pytest.approx(slow.snapshot_time + slow.async_wait)
    with pytest.raises(ValueError, match="fs_gbps"):
        checkpoint_plan(cfg, cl, lay, "adamw", Storage(fs_gbps=0.0))


def test_plan_reports_the_checkpoint(plan_tool, capsys):
    got = plan_json(plan_tool, capsys, "model=k3_tiny", "cluster=cpu")
    ck = got["checkpoint"]
    for k in ("total_gb", "max_rank_gb", "mean_rank_gb", "save_s", "load_s", "sync_stall_s", "async_stall_s",
              "fs_bandwidth_gbps", "rank_shares_gb"):
        assert k in ck
    assert ck["total_gb"] * GB == pytest.approx(_checkpoint_bytes_of_a_built_model("k3_tiny", "muon"))
    assert sum(r["gb"] * r["ranks"] for r in ck["rank_shares_gb"]) == pytest.approx(ck["total_gb"])
    assert ck["fs_bandwidth_gbps"] == 100 and ck["sync_stall_s"] == ck["save_s"]
    assert ck["async_save"] is False and ck["save_interval"] == 100
    half = plan_json(plan_tool, capsys, "model=k3_tiny", "cluster=cpu", "--fs-bandwidth", "50",
                     "--node-fs-bandwidth=25", "--host-copy-bandwidth", "12.5", "checkpoint.async_save=true")
    hc = half["checkpoint"]
    assert hc["async_save"] is True and hc["fs_bandwidth_gbps"] == 50
    for k in ("save_s", "load_s", "async_stall_s"):
        assert hc[k] == pytest.approx(2 * ck[k])
    text = run_plan(plan_tool, capsys, "model=k3_tiny", "cluster=cpu")
    assert "checkpoint (sharded" in text and "step-loop stall per save: synchronous" in text


@pytest.mark.parametrize("flag", ["--fs-bandwidth", "--node-fs-bandwidth", "--host-copy-bandwidth"])
@pytest.mark.parametrize("value", ["0", "-1", "fast", "nan", "inf"])
def test_bad_bandwidth_is_one_line_naming_the_option(plan_tool, capsys, flag, value):
    assert plan_tool.main(["model=k3_tiny", "cluster=cpu", flag, value]) == 2
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and "positive number" in err[0] and out.out == ""


# ------------------------------------------------------------------------------------------------ balanced dispatch

def _tiny_balanced(S=6, recompute="none", **kw):
    """k3_tiny on tp2 (sequence parallel) x ep4, 8 ranks: N = 2 x 256 / 2 = 256 tokens routed per rank, k = 4,
    M = 1024 pairs, E = 16, El = 4, L = 64, P = 3 x 64 x 64 = 12288 (a multiple of R = 4: Pp = P), bf16."""
    cfg = load_model_config("k3_tiny")
    lay = Layout(world=8, tp=2, ep=4, recompute=recompute)
    w = Workload(256, 2, 16, "bf16", "adamw", **{"moe_overflow": "balanced", "redundant_experts": S, **kw})
    return cfg, lay, w


def test_balanced_dispatch_shapes_by_hand():
    from megatron_k3.planning.memory import BalancedMoE

    b = BalancedMoE(R=3, E=6, S=2, N=5, k=2, L=7, P=10)
    assert (b.El, b.M, b.Mp, b.Pp, b.exact, b.cap, b.block) == (2, 10, 12, 12, True, 10, 10 // 3 + 2)
    assert b.weight_exchange_bytes(2) == pytest.approx((2 + 2) * 12 * 2 / 3 * 2)  # El + S experts, padded P
    assert b.token_bytes(2) == pytest.approx(2 * (12 + 3 * 5) * 2 / 3 * 7 * 2)  # dispatch + combine, two hops
    assert b.metadata_bytes() == pytest.approx(2 * 6 * 8 + 27 * 2 / 3 * 8)  # counts all-gather + int64 codes
    assert b.replica_bytes(2) == 2 * 12 * 2 and b.exchange_buffer_bytes(2) == (2 + 2) * 12 * 2
    assert b.token_buffer_bytes(2) == 2 * 27 * (7 * 2 + 8)
    assert b.drop_rows(1.25) == 6 * 3  # E x ceil(1.25 x 10 / 6)
    short = BalancedMoE(R=3, E=6, S=1, N=5, k=2, L=7, P=10)  # S < El: worst case R N min(El, k) rows
    assert not short.exact and short.cap == 3 * 5 * 2 and short.block == 30 // 3 + 2


def test_balanced_dispatch_memory_and_traffic_by_hand():
    from megatron_k3.planning.comm import training_comm
    from megatron_k3.planning.memory import balanced_moe

    cfg, lay, w = _tiny_balanced()
    cl = compose_config(["cluster=cpu"])[0].cluster
    b = balanced_moe(cfg, lay, w)
    assert (b.R, b.E, b.El, b.S, b.N, b.k, b.L, b.P) == (4, 16, 4, 6, 256, 4, 64, 12288)
    assert (b.M, b.Mp, b.Pp, b.cap, b.block) == (1024, 1024, 12288, 1024, 1024 // 4 + 3)
    n_moe = cfg.ffn_types().count("moe")
    assert n_moe == 7
    # memory (pp = 1: one micro-batch in flight): the kept replicas S x P x 2 B per MoE layer in the activations;
    # the exchange buffers (El + S) P x 2 B and both hops' token buffers replace drop's 2 M L x 2 B; the [w1; w3]
    # concatenation the experts' GEMMs run against also holds the replicas' (2/3 of S x P x 2 B)
    drop = training_memory(cfg, cl, lay, replace(w, moe_overflow="drop"))[0]
    bal = training_memory(cfg, cl, lay, w)[0]
    kept = 6 * 12288 * 2
    assert bal.activations - drop.activations == pytest.approx(n_moe * kept)
    assert bal.activation_detail["moe_replicas"] == bal.moe_replicas == n_moe * kept
    exchange = (4 + 6) * 12288 * 2 + 2 * (1024 + 1036) * (64 * 2 + 8)
    assert bal.moe_exchange == exchange
    concat = 2 * 6 * 12288 // 3 * 2
    assert bal.transient - drop.transient == pytest.approx(exchange - 2 * 1024 * 64 * 2 + concat)
    assert (bal.weights, bal.gradients, bal.optimizer) == (drop.weights, drop.gradients, drop.optimizer)
    # full recomputation: one layer's replicas, as a transient
    full = training_memory(cfg, cl, replace(lay, recompute="full"), w)[0]
    full_drop = training_memory(cfg, cl, replace(lay, recompute="full"), replace(w, moe_overflow="drop"))[0]
    assert full.activations == full_drop.activations and full.moe_replicas == kept
    assert full.transient - full_drop.transient == pytest.approx(kept + exchange - 2 * 1024 * 64 * 2 + concat)
    # S = 3 < El: the compute buffer's worst case, R N min(El, k) = 4096 rows, pads 3072 rows of the experts'
    # kept terms (fused, bf16: inputs 64 x 2, gate/up 128 x 2, hidden 64 x 2, outputs 65 x 2 = 642 B per row)
    short = training_memory(cfg, cl, lay, replace(w, redundant_experts=3))[0]
    assert short.activation_detail["moe_capacity_padding"] == pytest.approx(n_moe * 3072 * 642)
    # traffic per step, m = 16 / (2 x dp 4) = 2 micro-batches: per MoE layer and micro-batch the weights out
    # (El + S) P (R-1)/R x 2 B in the forward (the owners' El experts' slices to the relays, the S replicas to
    # their hosts), the gradients back the same in the backward, the tokens two hops each way per pass, the int64
    # counts and codes in the forward
    own, host = 4 * 12288 * 3 / 4 * 2, 6 * 12288 * 3 / 4 * 2
    wout = 2 * 7 * (own + host)
    tokens = 2 * (1024 + 1036) * 3 / 4 * 64 * 2
    meta = 3 * 16 * 8 + (1024 + 1036) * 3 / 4 * 8
    c = training_comm(cfg, cl, lay, w)
    d = {k: v[0] for k, v in c.ep_detail.items()}
    assert d == pytest.approx({"replica_weights": wout, "replica_grads": wout,
                               "tokens": 2 * 7 * 2 * tokens, "metadata": 2 * 7 * meta})
    assert c.bytes_by_kind["ep"] == pytest.approx(sum(d.values()))
    assert c.ep_detail["replica_weights"][1] == pytest.approx(wout / (cl.intra_supernode_gbps * GB))
    assert c.time_by_kind["ep"] == pytest.approx(sum(v[1] for v in c.ep_detail.values()))
    # full recomputation runs the forward (the replica exchange included) twice, the backward once
    cf = training_comm(cfg, cl, replace(lay, recompute="full"), w).ep_detail
    assert cf["replica_weights"][0] == pytest.approx(2 * d["replica_weights"])
    assert cf["replica_grads"][0] == pytest.approx(d["replica_grads"])
    assert cf["tokens"][0] == pytest.approx(1.5 * d["tokens"])
    # moe.replica_exchange=step: the owners' part once per step, in fp32 (the relay's store), the replicas' per
    # micro-batch; each relay keeps its fp32 store and gradient (El x P x 4 B each) per MoE layer for the step
    ws = replace(w, replica_exchange="step")
    cs = {k: v[0] for k, v in training_comm(cfg, cl, lay, ws).ep_detail.items()}
    assert cs["replica_weights"] == pytest.approx(2 * 7 * host + 7 * own * 2) == cs["replica_grads"]
    step = training_memory(cfg, cl, lay, ws)[0]
    assert step.activation_detail["moe_relay_stores"] == pytest.approx(n_moe * 2 * 4 * 12288 * 4)
    assert step.activations - bal.activations == pytest.approx(n_moe * 2 * 4 * 12288 * 4)
    # the plan carries them, and refuses slots outside [1, E - El]
    p = plan_training(cfg, replace(cl, devices_per_node=8), lay, w)
    assert p.moe_dispatch["replica_weights_bytes_per_step"] == pytest.approx(wout)
    assert p.moe_dispatch["exact_balance"] and p.moe_dispatch["drop_rows"] == 16 * 80  # ceil(1.25 x 1024 / 16)
    assert p.as_dict()["moe_dispatch"] == p.moe_dispatch
    with pytest.raises(ValueError, match="moe.redundant_experts"):
        plan_training(cfg, replace(cl, devices_per_node=8), lay, replace(w, redundant_experts=13))


def test_drop_and_default_plans_are_unchanged_by_the_dispatch_fields():
    from megatron_k3.planning.comm import training_comm
    from megatron_k3.planning.run import workload

    cfg, lay, w = _tiny_balanced()
    cl = compose_config(["cluster=cpu"])[0].cluster
    base = Workload(256, 2, 16, "bf16", "adamw")
    assert (base.moe_overflow, base.redundant_experts) == ("auto", -1)
    ref_mem, ref_comm = training_memory(cfg, cl, lay, base), training_comm(cfg, cl, lay, base)
    assert ref_comm.ep_detail == {} and all(s.moe_replicas == s.moe_exchange == 0 for s in ref_mem)
    rows = 256 * 4 * 64 * 2 * 3 / 4  # this rank's top-4 latent rows, bf16, the share bound for other ranks
    assert ref_comm.bytes_by_kind["ep"] == pytest.approx(2 * 7 * 2 * 2 * rows)
    others = [replace(base, moe_overflow=o) for o in ("drop", "dropless")]
    others.append(replace(w, redundant_experts=-1))  # balanced on ep = 1: not run
    for other, ep in zip(others, (4, 4, 1)):
        lay_o = replace(lay, ep=ep)
        assert training_memory(cfg, cl, lay_o, other) == training_memory(cfg, cl, lay_o, replace(base))
        assert training_comm(cfg, cl, lay_o, other) == training_comm(cfg, cl, lay_o, base)
    # the run's own resolution: moe.slots(model, parallel) is the planner's S
    from megatron_k3.planning.memory import balanced_slots

    for extra, slots in (([], None), (["model.moe_overflow=balanced"], 4),
                         (["model.moe_overflow=balanced", "moe.redundant_experts=9"], 9)):
        run = compose_config(["model=k3_tiny", "cluster=cpu", "parallel.ep=4", *extra])[0]
        wr = workload(run)
        assert run.moe.slots(run.model, run.parallel) == balanced_slots(run.model, 4, wr) == slots
        assert wr.moe_overflow == run.model.moe_overflow


def test_check_fits_names_redundant_experts_when_the_replicas_push_it_over():
    from megatron_k3.config import ConfigError
    from megatron_k3.planning.run import check_fits, layout, workload

    over = ["model=k3_tiny", "cluster=cpu", "parallel.ep=4", "model.moe_overflow=balanced", "moe.redundant_experts=12",
            "train.micro_batch_size=2", "train.global_batch_size=8"]
    run = compose_config(over)[0]
    w, lay = workload(run), layout(run, 4)

    def gb(**kw):
        return max(s.total for s in training_memory(run.model, run.cluster, lay, replace(w, **kw))) / GB

    mem = {S: gb(redundant_experts=S) for S in range(1, 13)}
    assert mem[4] < mem[3]  # at S = E/ep the compute buffer drops from its worst case to M rows
    assert all(mem[S] < mem[S + 1] for S in range(4, 12)) and gb(moe_overflow="drop") < mem[4]
    # each slot: the replica kept by every MoE layer (one micro-batch in flight) + 1 exchange buffer, fp32, and its
    # gate and up matrices (2/3 of it) in the [w1; w3] concatenation the experts' GEMMs run against
    assert (mem[9] - mem[8]) * GB == pytest.approx((7 + 1 + 2 / 3) * 12288 * 4)
    for capacity, fix in (((mem[8] + mem[9]) / 2, "the largest that fits is moe.redundant_experts=8"),
                          ((mem[4] + gb(moe_overflow="drop")) / 2, "no value fits this layout")):
        small = compose_config(over + [f"cluster.device_memory_gb={capacity}"])[0]
        with pytest.raises(ConfigError, match="moe.redundant_experts=12") as e:
            check_fits(small, 4)
        assert fix in str(e.value) and "model.moe_overflow=balanced" in str(e.value)
    tight = compose_config(over + [f"cluster.device_memory_gb={gb(moe_overflow='drop') / 2}"])[0]
    with pytest.raises(ConfigError, match="parallel") as e:  # over even without the replicas: the layout's error
        check_fits(tight, 4)
    assert "redundant_experts" not in str(e.value)
    assert check_fits(run, 4)  # 24 GB: fits


def test_plan_reports_balanced_dispatch(plan_tool, capsys):
    args = ["model=k3_tiny", "cluster=cpu", "cluster.devices_per_node=8", "parallel.tp=2", "parallel.ep=4",
            "model.moe_overflow=balanced", "moe.redundant_experts=6", "train.micro_batch_size=2",
            "train.global_batch_size=16", "precision=bf16", "optim=adamw", "--kernels", "fused", "--recompute", "none"]
    text = run_plan(plan_tool, capsys, *args)
    assert "MoE dispatch balanced: moe.redundant_experts=6" in text and "replica slot memory per device" in text
    assert "replica weights out" in text and "gradients back" in text
    got = plan_json(plan_tool, capsys, *args)
    d = got["moe_dispatch"]
    wout = 2 * 7 * (4 + 6) * 12288 * 3 / 4 * 2
    assert d["replica_weights_bytes_per_step"] == pytest.approx(wout) == d["replica_grads_bytes_per_step"]
    assert d["replica_memory_gb"] * GB == pytest.approx(7 * 6 * 12288 * 2)
    assert got["workload"]["moe_overflow"] == "balanced" and "moe_dispatch" not in plan_json(
        plan_tool, capsys, "model=k3_tiny", "cluster=cpu")


# ------------------------------------------------------------------------------------------------ vision tower

def _vl(*overrides):
    return load_model_config("k3_vl_tiny", list(overrides))


def test_vision_tower_sits_on_the_first_stage_whole_on_every_tp_rank():
    """pp2: stage 0 holds the tower and projector (exactly their bytes more than without vision: weights, fp32
    gradients, master + Adam moments sharded over dp), stage 1 exactly what it held before; TP does not split it."""
    on, off = _vl(), _vl("model.vision.enabled=false")
    vis = model_params(on, 1).vision
    assert vis.total == 107584 + 98432  # the tower and projector of k3_vl_tiny (test_param_count)
    assert model_params(on, 2).vision == vis and model_params(off, 1).vision.total == 0
    cl = compose_config(["cluster=cpu"])[0].cluster
    lay = Layout(world=4, tp=2, pp=2)  # dp 1
    # a fixed ZeRO bucket (parallel.deepspeed.zero_optimization.reduce_bucket_size; the engine's own grows with the
    # parameters up to 50M elements)
    w = Workload(64, 1, 2, "bf16", "adamw", image_share=0.25, reduce_bucket=1 << 20)
    m_on, m_off = training_memory(on, cl, lay, w), training_memory(off, cl, lay, w)
    assert m_on[1] == m_off[1]
    s0, t0 = m_on[0], m_off[0]
    assert s0.params_dense - t0.params_dense == vis.total
    assert s0.weights - t0.weights == vis.total * 2
    assert s0.gradients - t0.gradients == vis.total * 4
    assert s0.optimizer - t0.optimizer == pytest.approx(vis.total * (4 + 8))
    assert (s0.weights - m_on[1].weights) - (t0.weights - m_off[1].weights) == vis.total * 2
    assert s0.vision["weights"] == vis.total * 2 and s0.vision["activations"] > 0
    assert s0.activations - t0.activations == s0.vision["activations"] == s0.activation_detail["vision"]
    assert m_on[1].vision == {} and t0.vision == {}
    # ZeRO-1 over dp shards the tower's master and states like the other dense parameters'
    wide = Layout(world=16, tp=2, pp=2)  # dp 4
    d_on, d_off = training_memory(on, cl, wide, w)[0], training_memory(off, cl, wide, w)[0]
    assert d_on.optimizer - d_off.optimizer == pytest.approx(vis.total * 12 / 4)
    # Muon: one momentum for the tower's matrices (wqkv and wo per head, the MLP, the projector), AdamW the rest
    mu_on, mu_off = (training_memory(c, cl, lay, replace(w, optimizer="muon"))[0] for c in (on, off))
    states = vis.muon * 4 + (vis.total - vis.muon) * 8
    assert mu_on.optimizer - mu_off.optimizer == pytest.approx(vis.total * 4 + states)
    assert 0 < vis.muon < vis.total


def test_frozen_vision_keeps_weights_only():
    on, frozen, off = _vl(), _vl("model.freeze_vision=true"), _vl("model.vision.enabled=false")
    cl = compose_config(["cluster=cpu"])[0].cluster
    lay = Layout(world=4, tp=2, pp=2)
    w = Workload(64, 1, 2, "bf16", "muon")
    s_on, s_fr, s_off = (training_memory(c, cl, lay, w)[0] for c in (on, frozen, off))
    assert s_fr.weights == s_on.weights and s_fr.params_dense == s_on.params_dense
    assert s_fr.gradients == s_off.gradients and s_fr.optimizer == s_off.optimizer
    assert s_fr.vision["gradients"] == s_fr.vision["optimizer"] == s_fr.vision["activations"] == 0
    assert "vision" not in s_fr.activation_detail and s_fr.activations == s_off.activations
    # FLOPs: the forward only (autograd skips a tower nothing upstream of which needs a gradient)
    from megatron_k3.planning.flops import model_flops

    f_on, f_fr, f_off = (model_flops(c, 64) for c in (on, frozen, off))
    assert f_fr.forward_per_token == f_on.forward_per_token > f_off.forward_per_token
    assert f_fr.backward_per_token == f_off.backward_per_token < f_on.backward_per_token
    assert set(f_on.by_category) - set(f_off.by_category) == {"vision_tower", "mm_projector"}
    from megatron_k3.planning.checkpoint import checkpoint_bytes

    mp = model_params(on, 1)
    assert checkpoint_bytes(frozen, "adamw") == checkpoint_bytes(off, "adamw") + mp.vision.total * 4


def test_vision_flops_match_torch_flop_counter():
    """The tower's analytic FLOPs (patch embedding, per block q/k/v/o, MLP and 4 L^2 Q attention, projector) are
    exactly what torch's counter sees for one image of the position table's grid, forward and backward."""
    import torch

    from megatron_k3.model import K3ForConditionalGeneration
    from megatron_k3.planning.flops import vision_flop_terms, vision_image_patches
    from megatron_k3.planning.measure import count_flops

    torch.manual_seed(0)
    cfg = _vl()
    model = K3ForConditionalGeneration(cfg)
    T, share = 64, 0.25  # 16 image features per 64-token sequence: 64 patches, the 8 x 8 table
    assert vision_image_patches(cfg, T, share) == 64
    px, grid = torch.randn(64, 3, 14, 14), torch.tensor([[1, 8, 8]])
    fwd = count_flops(lambda: model.vision_features(px, grid))
    both = count_flops(lambda: model.vision_features(px, grid).sum().backward())
    terms = vision_flop_terms(cfg, T, share)
    assert sum(t.forward for t in terms) * T == pytest.approx(fwd, rel=1e-9)
    assert sum(t.forward + t.backward for t in terms) * T == pytest.approx(both, rel=1e-9)
    # actual media (what a step's grid_thws would give the metrics): an image and a two-frame video chunk
    from megatron_k3.planning.flops import media_flops

    grids = [(1, 8, 8), (2, 4, 6)]
    px = torch.randn(64 + 48, 3, 14, 14)
    g = torch.tensor(grids)
    f, b = media_flops(cfg, grids)
    assert f == pytest.approx(count_flops(lambda: model.vision_features(px, g)), rel=1e-9)
    assert f + b == pytest.approx(count_flops(lambda: model.vision_features(px, g).sum().backward()), rel=1e-9)


def test_vision_work_splits_over_tp_by_whole_media():
    """The tower's parameters are replicated over TP, its work is not (model/multimodal.py): each TP rank encodes a
    contiguous share of the micro-batch's media, whole media each (model.vision.media_shares). Two images per
    micro-batch at tp2: the tower's FLOPs and activations on a stage-0 device are half of tp1's; one image per
    micro-batch: one rank encodes all of it (the busiest rank is what the planner counts)."""
    from megatron_k3.planning.flops import vision_media, vision_tp_share
    from megatron_k3.planning.planner import _stage_flops

    cfg = _vl()
    cl = compose_config(["cluster=cpu"])[0].cluster
    two = Workload(64, 2, 4, "bf16", "adamw", image_share=0.25)  # 64 patches per sequence: one 8 x 8 image each
    one = replace(two, micro_batch_size=1, global_batch_size=2)
    assert vision_media(cfg, 64, 2) == [64, 64] and vision_media(cfg, 64, 1) == [64]
    assert vision_tp_share(cfg, 64, 2, 0.25, 2) == 0.5 and vision_tp_share(cfg, 64, 1, 0.25, 2) == 1.0
    assert vision_tp_share(cfg, 64, 2, 0.25, 1) == 1.0 and vision_tp_share(cfg, 64, 2, 0.0, 2) == 1.0

    def tower(w, tp):
        """(tower FLOPs per micro-batch, tower activations per micro-batch) on a stage-0 device at `tp`."""
        lay = Layout(world=2 * tp, tp=tp, pp=2)  # dp 1
        a, b = stage_layers(cfg, 2)[0]
        with_, without = (_stage_flops(cfg, lay, w, a, b, False, first) for first in (True, False))
        s0 = training_memory(cfg, cl, lay, w)[0]
        return sum(with_) - sum(without), s0.vision["activations"] / s0.in_flight

    f1, a1 = tower(two, 1)
    f2, a2 = tower(two, 2)
    assert f1 > 0 and a1 > 0
    assert f2 == pytest.approx(f1 / 2) and a2 == pytest.approx(a1 / 2)
    assert tower(one, 2) == pytest.approx(tower(one, 1))  # one image: the busiest rank encodes it whole
    # the parameters stay whole on every TP rank: weights, gradients and optimizer states as at tp1
    s1, s2 = (training_memory(cfg, cl, Layout(world=2 * tp, tp=tp, pp=2), two)[0].vision for tp in (1, 2))
    assert all(s1[k] == s2[k] for k in ("params", "weights", "gradients", "optimizer"))


def test_vision_tp_traffic_gathers_features_and_all_reduces_the_towers_gradients():
    """On stage 0 under TP, per micro-batch: the features' all-gather (forward; each rank's part padded to the
    largest share) and under SP the features' gradient all-gather; once per step the all-reduce of every tower and
    projector gradient (fp32: the micro-batches' sum); frozen, the all-gather only; none on other stages or without
    TP."""
    from megatron_k3.planning.comm import training_comm, vision_tp_bytes

    cl = compose_config(["cluster=cpu"])[0].cluster
    on, frozen, off = _vl(), _vl("model.freeze_vision=true"), _vl("model.vision.enabled=false")
    lay = Layout(world=4, tp=2, pp=2)  # dp 1, sequence parallelism on
    assert lay.sp
    w = Workload(64, 2, 4, "bf16", "adamw", image_share=0.25)  # 2 micro-batches, 2 images each
    m, K, P = 2, on.hidden_size, model_params(on, 2).vision.total
    parts = vision_tp_bytes(on, lay, w)
    assert parts["grad_all_reduce"] == pytest.approx(2 * P * 4 * 0.5)  # ring all-reduce of fp32 gradients
    assert parts["feature_gather"] == pytest.approx(2 * 16 * K * 2 * 0.5)  # 32 features [N, K], bf16
    assert parts["feature_grad_gather"] == pytest.approx(2 * 64 * K * 2 * 0.5)  # the [B, T, K] gradient
    c_on, c_fr, c_off = (training_comm(c, cl, lay, w, 0) for c in (on, frozen, off))
    once = {"grad_all_reduce"}  # per step, the rest per micro-batch
    per_step = {k: v if k in once else m * v for k, v in parts.items()}
    assert c_on.bytes_by_kind["tp"] - c_off.bytes_by_kind["tp"] == pytest.approx(sum(per_step.values()))
    assert {k: b for k, (b, _) in c_on.vision_tp.items()} == pytest.approx(per_step)
    assert c_on.per_step_time["tp"] == pytest.approx(c_on.vision_tp["grad_all_reduce"][1])
    assert c_on.per_step_time["tp"] > 0
    assert c_on.time_by_kind["tp"] > c_off.time_by_kind["tp"]
    assert set(c_fr.vision_tp) == {"feature_gather"}  # frozen: no gradient to reduce or gather
    assert c_fr.vision_tp["feature_gather"][0] == pytest.approx(m * parts["feature_gather"])
    assert training_comm(on, cl, lay, w, 1).vision_tp == {} == c_off.vision_tp
    assert vision_tp_bytes(on, Layout(world=2, tp=1, pp=2), w) == {}
    # one image per micro-batch: one rank's part is all N = 16 rows and the other's is padded to it, so half the
    # rows cost what the two images' 32 rows did
    one = replace(w, micro_batch_size=1, global_batch_size=2)
    assert vision_tp_bytes(on, lay, one)["feature_gather"] == pytest.approx(16 * K * 2)
    assert vision_tp_bytes(on, lay, one)["feature_gather"] == pytest.approx(parts["feature_gather"])


def test_vision_activations_follow_the_image_share():
    from megatron_k3.planning.memory import vision_activations

    cfg = load_model_config("k3", ["model.vision.enabled=true"])
    w = Workload(4096, 1, 4096, "bf16", "muon")
    assert w.image_share == 0.25
    quarter, half = vision_activations(cfg, w, "none"), vision_activations(cfg, replace(w, image_share=0.5), "none")
    assert half[0] == pytest.approx(2 * quarter[0])  # images of the 64 x 64 table either way: linear in patches
    assert vision_activations(cfg, replace(w, image_share=0.0), "none") == (0.0, 0.0)
    sel, full = vision_activations(cfg, w, "selective"), vision_activations(cfg, w, "full")
    # fused kernels keep nothing selective recomputation rebuilds in the tower (flash attention keeps q, k, v, o and
    # the log-sum-exp; the GELU MLP's inputs are matmul inputs); the eager paths keep the rotated q/k, the
    # probabilities and the norms' fp32 copies, which it does
    assert quarter[0] == sel[0] > full[0] > 0 and full[1] > 0
    e = replace(w, kernels="eager")
    none_e, sel_e, full_e = (vision_activations(cfg, e, rc) for rc in ("none", "selective", "full"))
    assert none_e[0] > sel_e[0] > full_e[0] > 0 and sel_e[1] > 0


def test_plan_reports_the_vision_tower(plan_tool, capsys):
    args = ["model=k3", "cluster=supernodes_8x64", "model.vision.enabled=true", "parallel.tp=8", "parallel.pp=8",
            "parallel.ep=64"]
    text = run_plan(plan_tool, capsys, *args)
    assert "vision tower + projector: 447.4M parameters (401,214,464 tower + 46,144,512 projector)" in text
    assert "per stage-0 device" in text and "of the model FLOPs" in text
    got = plan_json(plan_tool, capsys, *args)
    v = got["vision"]
    assert v["params"] == 447358976 and v["stage"] == 0 and not v["frozen"]
    # parameters whole on every TP rank, work split by whole media: one 64 x 64 image per micro-batch at micro-batch
    # 1, so one of the 8 TP ranks encodes all of it; the TP traffic includes the per-micro-batch gradient all-reduce
    assert v["params_replicated_over_tp"] and v["work_split_over_tp"] and "replicated_over_tp" not in v
    assert v["images_per_micro_batch"] == 1 and v["tp_work_share"] == 1.0
    tp_comm = v["tp_comm_bytes_per_step"]
    assert set(tp_comm) == {"feature_gather", "feature_grad_gather", "grad_all_reduce"}
    assert tp_comm["grad_all_reduce"] == pytest.approx(2 * 447358976 * 4 * 7 / 8)  # once per step, fp32
    assert sum(tp_comm.values()) < got["comm_bytes_per_step"]["tp"] and v["tp_comm_time_s"] > 0
    assert "TP traffic per stage-0 device" in text and "the busiest encodes 100.0%" in text
    eight = plan_json(plan_tool, capsys, *args, "train.micro_batch_size=8")["vision"]  # 8 images: 1/8 each
    assert eight["images_per_micro_batch"] == 8 and eight["tp_work_share"] == 1 / 8
    assert eight["device_flops_per_step"] == pytest.approx(v["device_flops_per_step"] / 8)
    assert got["total_params"] == 2779484393568 + 447358976
    assert got["stage_params"][0] - v["params"] == plan_json(plan_tool, capsys, *args[:2], *args[3:])["stage_params"][0]
    assert 0 < v["model_flops_share"] < 0.02 and v["compute_time_s"] > 0
    assert sum(v["bytes_per_device"].values()) / GB == pytest.approx(v["gb_per_device"])
    assert got["workload"]["image_share"] == 0.25
    shared = plan_json(plan_tool, capsys, *args, "--image-share", "0.5")["vision"]
    assert shared["model_flops_per_step"] == pytest.approx(2 * v["model_flops_per_step"])  # 64 x 64 images still
    assert "vision" not in plan_json(plan_tool, capsys, "model=k3_tiny", "cluster=cpu")
    rc = plan_tool.main([*args, "--image-share", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "--image-share" in err and len(err.strip().splitlines()) == 1
    probs = planner_problems(load_model_config("k3", ["model.vision.enabled=true"]), compose_config(
        ["cluster=supernodes_8x64"])[0].cluster, Layout(world=512, tp=8, pp=8, ep=64, cp=2),
        Workload(8192, 1, 4096, "bf16", "muon"))
    assert any("context parallelism does not take media" in p.reason for p in probs)


def test_k3_at_1m_tokens_fits_512_accelerators_with_full_recompute_tiling_and_offload():
    """K3 at 1M tokens on supernodes_8x64: tp8 pp8 ep64 cp8 with full recomputation alone needs 150.4 GB per device;
    the layer inputs it keeps go to host memory (train.offload_buffer_gb: up to that many bytes per device, the rest
    stays), the MoE blocks and the LM head run over token tiles (train.tile_tokens), and it fits, with the host
    memory per node within cluster.host_memory_gb; a host too small is refused naming train.offload_buffer_gb."""
    from megatron_k3.config import ConfigError
    from megatron_k3.planning.run import check_fits, compose_for_planning

    run = compose_config(["model=k3", "cluster=supernodes_8x64", "train=pretrain", "precision=bf16"])[0]
    cfg, cl = run.model, run.cluster
    w = Workload(1 << 20, 1, 64, "bf16", "muon")
    lay = Layout(world=512, tp=8, pp=8, ep=64, cp=8, recompute="full")
    base = plan_training(cfg, cl, lay, w)
    assert not base.fits and round(base.memory_per_device / GB, 1) == 150.4
    first = training_memory(cfg, cl, lay, w)[0]
    kept = first.activation_detail["layer_inputs"]
    half = replace(lay, offload_bytes=kept / 2)
    s0 = training_memory(cfg, cl, half, w)[0]
    assert s0.host == pytest.approx(kept / 2) and s0.activations == pytest.approx(first.activations - kept / 2)
    both = plan_training(cfg, cl, replace(lay, tile_tokens=4096, offload_bytes=40e9), w)
    assert both.fits and round(both.memory_per_device / GB, 1) == 120.4
    assert 0 < both.host_per_node_gb < cl.host_memory_gb
    tiled = training_memory(cfg, cl, replace(lay, tile_tokens=4096), w)[-1]
    assert tiled.activation_detail.get("head", 0.0) < training_memory(cfg, cl, lay, w)[-1].activation_detail["head"]
    args = ["model=k3", "cluster=supernodes_8x64", "parallel.tp=8", "parallel.pp=8", "parallel.ep=64", "parallel.cp=8",
            "parallel.sequence_parallel=true", "train.seq_length=1048576", "train.global_batch_size=64",
            "train.recompute=full", "train.tile_tokens=4096", "train.offload_buffer_gb=40"]
    assert check_fits(compose_for_planning(args)[0], 512)
    with pytest.raises(ConfigError, match=r"train\.offload_buffer_gb=40.*cluster\.host_memory_gb=64"):
        check_fits(compose_for_planning(args + ["cluster.host_memory_gb=64"])[0], 512)


def test_a_plan_over_the_hosts_memory_says_so():
    """The offloaded layer inputs of K3 at 1M tokens take 210 GB per node: with cluster.host_memory_gb=100 the plan
    does not fit though its 120.4 GB per device do, and the report says why (the host line reads OVER, with the
    share per device that fits), as does a search's no-fit explanation; --json carries both host figures."""
    from megatron_k3.planning.planner import SearchResult
    from megatron_k3.planning.report import _no_fit, render_train

    run = compose_config(["model=k3", "cluster=supernodes_8x64", "precision=bf16", "cluster.host_memory_gb=100"])[0]
    lay = Layout(world=512, tp=8, pp=8, ep=64, cp=8, recompute="full", tile_tokens=4096, offload_bytes=40e9)
    p = plan_training(run.model, run.cluster, lay, Workload(1 << 20, 1, 64, "bf16", "muon"))
    assert not p.fits and p.host_over and p.memory_per_device <= 141 * GB
    text = "\n".join(render_train(p))
    assert "DOES NOT FIT (host memory: see below)" in text and "within" not in text
    assert "210 GB (every device's share up to train.offload_buffer_gb) of cluster.host_memory_gb=100 -> OVER: at " \
           "most 12.5 GB per device fits" in text
    assert p.as_dict()["host_memory_gb"] == 100 and round(p.as_dict()["host_per_node_gb"]) == 210
    why = "\n".join(_no_fit(run.cluster, SearchResult([], [p], {}, 1), 512 * 141 * GB))
    assert "1 of them fit the 141 GB but not the host memory" in why and "even " not in why


M1 = ["model=k3", "cluster=supernodes_8x64", "precision=bf16", "parallel.tp=8", "parallel.pp=8", "parallel.ep=64",
      "parallel.cp=8", "parallel.sequence_parallel=true", "train.seq_length=1048576", "train.global_batch_size=64",
      "train.recompute=full"]


@pytest.mark.parametrize("memory,given,keys,gb", [
    (141, [], "train.recompute=full train.tile_tokens=2048", 139.6),  # tiling alone; 4096-token tiles need offload
    # less device memory: offload too, the whole GB the kept layer inputs take (26.3 GB on the first stage)
    (125, [], "train.recompute=full train.tile_tokens=4096 train.offload_buffer_gb=27", 120.4),
    # the run's own tiles kept (the keys name what differs from the run)
    (125, ["train.tile_tokens=4096"], "train.recompute=full train.offload_buffer_gb=27", 120.4),
    (141, ["train.tile_tokens=4096", "train.recompute_num_layers=4"],
     "train.recompute=full train.recompute_num_layers=0 train.tile_tokens=2048", 139.6),
    # a host of 100 GB per node takes 12.5 GB per device: the offload is capped there, the rest of the kept layer
    # inputs stays on the device (the whole GB above the host's share was refused: "nothing fits")
    (136, ["cluster.host_memory_gb=100"], "train.recompute=full train.tile_tokens=4096 train.offload_buffer_gb=12",
     131.8)])
def test_a_layout_that_fits_only_tiled_or_offloaded_is_refused_naming_the_keys_that_fit(memory, given, keys, gb):
    """K3 at 1M tokens, tp8 pp8 ep64 cp8 with full recomputation alone does not fit: the refusal names the
    train.tile_tokens / train.offload_buffer_gb that make it fit (the fastest by the planner's step time, the largest
    tile on a tie), and with them the same check passes."""
    from megatron_k3.config import ConfigError
    from megatron_k3.planning.run import check_fits, compose_for_planning

    args = M1 + [f"cluster.device_memory_gb={memory}"] + given
    with pytest.raises(ConfigError, match=r"no recomputation alone fits this layout; " + keys + f" fits \\({gb} GB\\)"):
        check_fits(compose_for_planning(args)[0], 512)
    assert max(s.total for s in check_fits(compose_for_planning(args + keys.split())[0], 512)) <= memory * GB


@pytest.mark.slow
def test_a_search_that_finds_nothing_names_the_long_sequence_keys_that_fit(plan_tool, capsys):
    """tools/plan.py --search at 1M tokens without tiling or offload finds no layout on 512 accelerators: it names
    the keys (and the layout) that fit these 512, and then the 1024 that fit without them (two expert-data-parallel
    replicas, each keeping the optimizer states of half of its EP rank's experts); so does tools/build_rank.py
    --search's refusal."""
    base = M1[:3] + ["train.seq_length=1048576", "train.global_batch_size=64"]
    got = plan_json(plan_tool, capsys, *base, "--search")
    assert got["fits"] == [] and got["min_accelerators"] == 1024
    ls = got["long_sequence"]
    keys = "train.recompute=full train.tile_tokens=2048"
    assert ls["overrides"] == keys and ls["fits"]
    assert (ls["layout"]["tp"], ls["layout"]["pp"], ls["layout"]["ep"], ls["layout"]["cp"]) == (8, 8, 64, 8)
    text = run_plan(plan_tool, capsys, *base, "--search")
    assert f"with the trainer's long-sequence knobs {keys}: tp8 pp8 ep64 cp8" in text
    assert "without them, training needs at least 1024 accelerators (16 supernodes of 64)" in text
    again = plan_json(plan_tool, capsys, *base, *ls["overrides"].split()[1:], "--search")
    assert again["fits"] and again["memory_per_device_gb"] <= 141
    from megatron_k3.config import ConfigError  # tools/build_rank.py --search: the same keys in its refusal

    with pytest.raises(ConfigError, match=f"with {keys} tp8 pp8 ep64 cp8 .* fits"):
        _tool("build_rank").compose(base, {"--search": True})


def test_the_trainer_takes_the_planners_best_layout_and_names_the_recomputation_that_fits(plan_tool, capsys):
    """tp8 pp8 ep64 at 4096 tokens (the search's best on supernodes_8x64): train.recompute=auto (train=pretrain)
    resolves to selective and fits; none is refused before anything is built, naming train.recompute and what fits."""
    from megatron_k3.config import ConfigError
    from megatron_k3.planning.run import check_fits, compose_for_planning, resolve_recompute, workload

    args = ["model=k3", "cluster=supernodes_8x64", "parallel.tp=8", "parallel.pp=8", "parallel.ep=64",
            "parallel.sequence_parallel=true"]
    run = compose_for_planning(args)[0]
    assert run.train.recompute == "auto" and resolve_recompute(run, 512) == "selective"
    assert max(s.total for s in check_fits(run, 512)) / GB < 141
    best = search_training(run.model, run.cluster, workload(run), 1).fits[0]
    assert (best.layout.tp, best.layout.pp, best.layout.ep, best.layout.recompute) == (8, 8, 64, "selective")
    with pytest.raises(ConfigError, match=r"train\.recompute='none'.*train\.recompute=selective fits"):
        check_fits(compose_for_planning(args + ["train.recompute=none"])[0], 512)
    # a finer knob that recomputes too little is named, with the least widening of it that fits, before any other
    # policy: selective over one module (146.0 GB) fits with every module; full over 1 layer of a stage (147.4 GB)
    # with 3 (full over all 8 fits too, with more recomputation)
    for knob, fix in ((["train.recompute=selective", "train.recompute_modules=[moe_act]"],
                       r"train\.recompute_modules=\['moe_act'\]: .*train\.recompute_modules=\['moe_act'\]\), over .*"
                       r"train\.recompute_modules=\[\] \(every module\) fits \(137\.7 GB\)"),
                      (["train.recompute=full", "train.recompute_num_layers=1"],
                       r"train\.recompute_num_layers=1: .*: train\.recompute_num_layers=3 fits \(137\.0 GB\)")):
        with pytest.raises(ConfigError, match=fix):
            check_fits(compose_for_planning(args + knob)[0], 512)
    # tools/plan.py's report of the layout that does not fit names the same
    capsys.readouterr()
    assert plan_tool.main(args + ["--recompute", "none"]) == 1  # the exit status says it does not fit
    out = capsys.readouterr().out
    hint = out.find("train.recompute=selective fits this layout (137.7 GB per device)")
    assert 0 < out.find("DOES NOT FIT") < hint, out


@pytest.mark.parametrize("args,key", [
    (["train.tile_tokens=-4"], "train.tile_tokens=-4"),  # was a ZeroDivisionError traceback
    (["train.offload_buffer_gb=-1"], "train.offload_buffer_gb=-1"),
    (["train.recompute_modules=[bogus]"], "train.recompute_modules=['bogus']"),
    (["train.recompute_num_layers=-1"], "train.recompute_num_layers=-1"),
    (["--recompute", "full", "train.recompute_modules=[core_attn]"], "applies to train.recompute=selective, not full"),
    (["--recompute", "selective", "train.offload_buffer_gb=3"], "not with train.recompute=selective")])
def test_plan_refuses_the_recompute_keys_the_trainer_refuses(plan_tool, capsys, args, key):
    """tools/plan.py checks the train.* keys as the Trainer does, with --recompute as train.recompute: a value the
    Trainer refuses is not planned in silence (each of these was, or raised a traceback)."""
    rc = plan_tool.main(["model=k3_tiny", "cluster=cpu", *args])
    err = capsys.readouterr().err
    assert rc == 2 and key in err and len(err.strip().splitlines()) == 1, err


def test_the_memoised_activation_terms_equal_a_fresh_count_in_any_order():
    """A search memoises each stage's activation bytes on the layout and workload fields they read (not pp, ep or
    dp, which it varies most): across configs, layouts, workloads, layer ranges and tile shares that each differ in
    one thing from another, asked for in a random order so that each may find another's entry, every memoised
    answer equals a count made afresh (the term caches emptied first). A field the count reads but the memo's key
    left out would hand one case another's bytes."""
    import itertools
    import random

    from megatron_k3.planning import activations, memory

    base = replace(load_model_config("k3"), num_layers=8)
    configs = (base, replace(base, first_k_dense=3), replace(base, attn_res=False))
    layouts = [(1, False, 1, 0, 1, 1), (8, True, 1, 0, 2, 8), (8, False, 1, 0, 4, 64), (8, True, 4, 2048, 2, 8),
               (8, True, 4, 4096, 8, 64), (4, True, 2, 0, 2, 8), (8, True, 2, 2048, 4, 8)]
    loads = [("fused", 4096, 1, "bf16"), ("eager", 4096, 1, "bf16"), ("fused", 65536, 2, "bf16"),
             ("fused", 4096, 1, "fp32"), ("fused", 65536, 1, "bf16"), ("eager", 2048, 2, "bf16")]
    cases = []
    for cfg, (tp, sp, cp, tile, pp, ep), (kernels, seq, mbs, prec) in itertools.product(configs, layouts, loads):
        for rec in ("none", "selective", "full"):
            lay = Layout(world=tp * pp * cp * ep, tp=tp, pp=pp, ep=ep, cp=cp, sequence_parallel=sp, recompute=rec,
                         tile_tokens=tile)
            cases.append((cfg, lay, Workload(seq, mbs, 64, prec, kernels=kernels)))
    random.Random(0).shuffle(cases)
    ranges = ((0, 4, False), (0, 3, False), (4, 8, False), (4, 8, True), (8, 8, True))
    memory._MICRO_MEMO.clear()
    total = 0
    for cfg, lay, w in cases[::3]:
        # the tile shares are below 1 only with tiles; each one on its own
        scales = ((1.0, 1.0, 1.0), (0.0, 1.0, 1.0), (1.0, 0.0, 1.0), (1.0, 1.0, 0.5)) if lay.tile_tokens else (
            (1.0, 1.0, 1.0), (1.0, 0.0, 1.0))
        asked = [(a, b, last, rebuilt, ms, hs, ks) for a, b, last in ranges for rebuilt in (False, True)
                 for ms, hs, ks in scales]
        got = [memory._micro_activation(cfg, lay, w, a, b, last, lay.recomputed, *rest) for a, b, last, *rest in asked]
        for cache in (activations.layer_terms, memory._moe_block_bytes, memory._kda_chunk_bytes, memory._sources):
            cache.cache_clear()
        fresh = [memory._micro_activation_of(cfg, lay, w, a, b, last, lay.recomputed, *rest)
                 for a, b, last, *rest in asked]
        assert got == fresh, (cfg.first_k_dense, cfg.attn_res, lay, w)
        total += len(asked)
    assert len(memory._MICRO_MEMO) < total  # cases that differ only in pp or ep shared entries


def test_a_configs_layer_kinds_follow_its_fields():
    """ModelConfig keeps its layer kinds as it keeps its hash: until a field is set; a copy or a pickle derives them
    again, and a caller may change the list it gets."""
    import copy
    import pickle

    cfg = load_model_config("k3")
    assert cfg.ffn_types()[:2] == ["dense", "moe"] and cfg.layer_types()[3] == "mla"
    cfg.first_k_dense, cfg.mla_every = 3, 2
    assert cfg.ffn_types()[:4] == ["dense"] * 3 + ["moe"] and cfg.layer_types()[:4] == ["kda", "mla"] * 2
    cfg.ffn_types().append("x")
    assert len(cfg.ffn_types()) == cfg.num_layers
    cfg.mla_layers = [2]
    cfg.mla_layers.append(4)  # in place: no field is set
    assert [i for i, t in enumerate(cfg.layer_types()) if t == "mla"] == [1, 3]
    for other in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert "_kinds" not in other.__dict__ and other.layer_types() == cfg.layer_types() and other == cfg


def test_zero2_reduces_the_gradients_after_every_micro_batch():
    """ZeRO-2 (DeepSpeed's partition_gradients) reduces the gradients after every micro-batch's backward, ZeRO-1 once
    at the step's last: the planner's dp_grad_reduce bytes and seconds are m times ZeRO-1's (until 2026-12-06 it
    counted one reduction for both). Exposed without parallel.overlap_grad_reduce; with it, each reduction hides
    behind its own micro-batch's backward, and ZeRO-1's one behind the last."""
    run = compose_config(["model=k3", "cluster=supernodes_8x64", "train=pretrain", "precision=bf16"])[0]
    cfg, cl = run.model, run.cluster
    lay = Layout(world=512, tp=8, pp=8, ep=64, recompute="selective")
    w1 = Workload(4096, 1, 4096, "bf16", "muon", zero_stage=1)
    m = 4096 // lay.dp
    one, two = (training_comm(cfg, cl, lay, replace(w1, zero_stage=z)) for z in (1, 2))
    for d in ("bytes_by_kind", "time_by_kind"):
        assert getattr(two, d)["dp_grad_reduce"] == pytest.approx(m * getattr(one, d)["dp_grad_reduce"], rel=1e-12)
        assert getattr(two, d)["dp_param_gather"] == getattr(one, d)["dp_param_gather"]  # once, after the step
    plan = plan_training(cfg, cl, lay, replace(w1, zero_stage=2))  # the slowest stage's collectives
    gather = sum(plan.comm_time[k] for k in ("dp_param_gather", "tp_muon_gather", "edp_grad_reduce",
                                             "edp_param_gather"))
    assert plan.time_breakdown["dp_exposed"] == pytest.approx(plan.comm_time["dp_grad_reduce"] + gather, rel=1e-9)
    assert plan.comm_time["dp_grad_reduce"] > 100 * plan_training(cfg, cl, lay, w1).comm_time["dp_grad_reduce"]
    # each micro-batch's reduction (milliseconds) hides behind its backward: only the step's gathers remain
    hidden = plan_training(cfg, cl, lay, replace(w1, zero_stage=2, overlap_grad_reduce=True))
    assert hidden.time_breakdown["dp_exposed"] == pytest.approx(gather, rel=1e-9)
