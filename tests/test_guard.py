"""train.guard (megatron_k3.training.guard): loss and gradient-norm spikes judged against a rolling window before the
update, withheld (skip) or stopping the run (stop), recorded and carried through checkpoints; expert-load and
router-entropy alarms.

Drills (on gloo, in make test):
- a batch whose loss is scaled by 100x at step k is withheld, and the parameters, the Quantile Balancing bias and
  the optimizer's state after the run equal, bit for bit, a run that saw a normal batch there and had its update
  withheld by force (the batch consumed without an update);
- policy=stop stops before the spiking step's update, naming it;
- a run saved after the spike and resumed judges and ends bit for bit as the uninterrupted one;
- a loss made non-finite on one rank of two is withheld by both, recorded as `nonfinite`.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import run_distributed
from helpers import full_params, make_trainer

from megatron_k3.config.schema import GuardConfig
from megatron_k3.training.guard import Alarms, SpikeGuard

GUARD = ["train.guard.policy=skip", "train.guard.window=8", "train.guard.min_history=4"]
SPIKE_AT = 7


def test_a_spike_is_past_median_plus_z_robust_spreads_and_past_the_relative_floor():
    g = SpikeGuard(GuardConfig(policy="skip", window=8, min_history=4, loss_zscore=6, grad_zscore=6,
                               min_relative=0.1))
    for i in range(3):
        g.accept(4.0 + 0.01 * i, 1.0)
        assert g.judge(i, 100.0, 1.0)[0] is None  # too little history to judge
    g.accept(4.03, 1.0)
    assert g.judge(5, 4.1, 1.0)[0] is None  # within 6 spreads (spread 0.015 x 1.4826 x 6 = 0.13; floor 0.40)
    reason, z = g.judge(5, 40.0, 1.0)
    assert reason == "loss_spike" and z["loss_z"] > 6
    assert g.judge(5, 4.0, 5.0)[0] == "grad_spike"  # a flat norm history: any rise past the floor is one
    assert g.judge(5, 4.0, 1.05)[0] is None  # ... but not one below min_relative
    assert g.judge(5, float("nan"), 1.0)[0] == "nonfinite"
    g.record(5, "loss_spike", 40.0, 1.0, z)
    h = SpikeGuard(g.cfg)
    h.load(g.state())
    assert h.state() == g.state() and h.judge(6, 40.0, 1.0)[0] == "loss_spike"


def test_alarms_name_the_layer_after_k_steps_in_a_row():
    a = Alarms(GuardConfig(alarm_load=3.0, alarm_entropy=0.5, alarm_steps=2))
    rec = {"expert_load_per_layer": {"layers": [1, 3], "max_over_mean": [4.0, 1.2]},
           "router_per_layer": {"layers": [1, 3], "entropy": [0.9, 0.2]}}
    assert a.check(1, rec) == []
    assert sorted(a.check(2, rec)) == [("expert_load_max_over_mean", 1, 4.0), ("router_entropy", 3, 0.2)]
    assert a.check(3, rec) == []  # once per episode
    ok = {"expert_load_per_layer": {"layers": [1, 3], "max_over_mean": [1.0, 1.0]},
          "router_per_layer": {"layers": [1, 3], "entropy": [0.9, 0.9]}}
    a.check(4, ok)
    assert a.check(5, rec) == [] and len(a.check(6, rec)) == 2  # a new episode


def _run(world, overrides, steps, spike=False, force=False, save_at=None, resume=False, run_dir=None):
    """A FAST Trainer of `steps` steps under train.guard: step SPIKE_AT's loss x100 (`spike`), or its update withheld
    by force on a normal batch (`force`); saved after `save_at` steps / resumed first. Returns (records, full-size
    parameters, routers' biases, the AdamW states' sum)."""
    t = make_trainer(world, GUARD + overrides, steps=steps, run_dir=run_dir)
    if resume:
        t.maybe_resume()
    forward, judge = t._forward, t.guard.judge

    def scaled(samples, state_in=None):
        out, n = forward(samples, state_in)
        if spike and t.step + 1 == SPIKE_AT:
            out.loss = out.loss * 100
        return out, n

    def forced(step, loss, norm):
        return ("forced", {"loss_z": 0.0, "grad_z": 0.0}) if force and step == SPIKE_AT else judge(step, loss, norm)

    t._forward, t.guard.judge = scaled, forced
    recs = []
    while t.step < steps:
        recs.append(t.train_step()[0])
        if t.step == save_at:
            t.save()
            break
    opt = t.engine.optimizer.optimizer
    states = sum(float(v.double().sum()) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    return recs, full_params(t), [m.gate.e_score_correction_bias.clone() for m in t.moe], states, t.guard.state()


def _worker(rank, world, variants, run_dir):
    from megatron_k3.training.engine import shutdown

    out = {}
    for name, kw in variants:
        try:
            out[name] = _run(world, [f"checkpoint.dir={run_dir}/{name}"], run_dir=f"{run_dir}/{name}", **kw)
        finally:
            shutdown()
    return out


@pytest.mark.slow
def test_a_100x_loss_is_withheld_and_equals_a_run_that_never_applied_it(tmp_path):
    """Drill: 9 steps, step 7's loss x100: withheld (recorded with its z-scores, the real norm logged), and the end
    state equals, bit for bit, a run whose step 7 (a normal batch) was withheld by force; a run saved after step 7
    and resumed ends the same and carries the same decisions."""
    runs = _worker(0, 1, [("spike", dict(steps=9, spike=True)), ("forced", dict(steps=9, force=True)),
                          ("first", dict(steps=9, spike=True, save_at=SPIKE_AT)),
                          ("plain", dict(steps=9))], str(tmp_path))
    recs, params, bias, states, guard = runs["spike"]
    step = recs[SPIKE_AT - 1]
    assert step["guard"] == "loss_spike" and step["guard_loss_z"] > 6 and step["skipped"] == 1
    assert math.isfinite(step["grad_norm"]) and step["loss"] > 50 * recs[SPIKE_AT - 2]["loss"]
    assert [r.get("guard") for r in recs].count("loss_spike") == 1 and recs[-1]["skipped_total"] == 0
    assert [e["step"] for e in guard["events"]] == [SPIKE_AT]
    f_recs, f_params, f_bias, f_states, _ = runs["forced"]
    assert all(torch.equal(params[n], f_params[n]) for n in params)
    assert all(torch.equal(a, b) for a, b in zip(bias, f_bias)) and states == f_states
    assert any(not torch.equal(params[n], runs["plain"][1][n]) for n in params)  # withholding changed the run
    second = _worker(0, 1, [("first", dict(steps=9, spike=True, resume=True))], str(tmp_path))["first"]
    assert [r["loss"] for r in runs["first"][0] + second[0]] == [r["loss"] for r in recs]
    assert all(torch.equal(params[n], second[1][n]) for n in params) and second[4] == guard


@pytest.mark.slow
def test_policy_stop_stops_before_the_update_naming_the_step(tmp_path):
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.faults import TrainingError

    try:
        with pytest.raises(TrainingError, match=f"train.guard.policy=stop: step {SPIKE_AT}: loss_spike"):
            _run(1, ["train.guard.policy=stop", f"checkpoint.dir={tmp_path}"], 9, spike=True, run_dir=str(tmp_path))
    finally:
        shutdown()


def _nan_on_rank0(rank, world, overrides, run_dir):
    from megatron_k3.training.engine import shutdown

    try:
        t = make_trainer(world, GUARD + overrides, steps=6, run_dir=f"{run_dir}/{rank}")
        forward = t._forward

        def poisoned(samples, state_in=None):
            out, n = forward(samples, state_in)
            if t.step + 1 == 5 and t.rank == 0:
                out.loss = out.loss * float("nan")
            return out, n

        t._forward = poisoned
        recs = [t.train_step()[0] for _ in range(6)]
        return [(r["skipped"], r.get("guard")) for r in recs], full_params(t)
    finally:
        shutdown()


@pytest.mark.slow
def test_a_non_finite_loss_on_one_rank_is_withheld_by_every_rank(tmp_path):
    out = run_distributed(_nan_on_rank0, 2, [], str(tmp_path), timeout=300)
    for decisions, _ in out:
        assert decisions[4] == (1, "nonfinite") and all(d == (0, None) for i, d in enumerate(decisions) if i != 4)
    assert all(torch.equal(out[0][1][n], out[1][1][n]) for n in out[0][1])


def _slow_rank1(rank, world, overrides, run_dir):
    import time

    from megatron_k3.training.engine import shutdown

    try:
        t = make_trainer(world, overrides + ["train.guard.straggler_interval=3"], steps=3, run_dir=f"{run_dir}/{rank}")
        forward = t._forward

        def slow(samples, state_in=None):
            if t.rank == 1:
                time.sleep(0.25)
            return forward(samples, state_in)

        t._forward = slow
        return [t.train_step()[0] for _ in range(3)][-1].get("stragglers")
    finally:
        shutdown()


@pytest.mark.slow
def test_a_rank_slowed_by_a_sleep_is_named_the_straggler(tmp_path):
    """Drill: dp2, rank 1 sleeps 0.25 s in each of its 2 micro-batches' forward (0.5 s a step): after 3 steps both
    ranks report rank 1 first, its compute per step more than half the sleep above rank 0's and rank 0 waiting more
    than that in blocking collectives (measured: 0.35 s apart, 0.37 s waited; a wait inside DeepSpeed's async
    reduction counts as compute)."""
    for slow in run_distributed(_slow_rank1, 2, [], str(tmp_path), timeout=300):
        assert [s["rank"] for s in slow] == [1, 0]
        assert slow[0]["compute_s"] - slow[1]["compute_s"] > 0.25 and slow[1]["wait_s"] > 0.25
        assert slow[0]["node"] and 0 < slow[0]["share"] <= 1


@pytest.mark.slow
def test_a_trainer_alarm_names_the_layer_in_the_log_and_the_record(tmp_path, caplog):
    """alarm_load=1 (every layer's max/mean is above 1) for 2 steps: the second step's record lists every MoE layer,
    and the warning names them; the third step raises none (once per episode)."""
    import logging

    from megatron_k3.training.engine import shutdown

    try:
        t = make_trainer(1, ["train.guard.alarm_load=1.0", "train.guard.alarm_steps=2"], steps=3,
                         run_dir=str(tmp_path))
        with caplog.at_level(logging.WARNING, logger="megatron_k3.train"):
            recs = [t.train_step()[0] for _ in range(3)]
        layers = t.routing.layer_ids
    finally:
        shutdown()
    assert "alarms" not in recs[0] and "alarms" not in recs[2]
    assert [a["layer"] for a in recs[1]["alarms"]] == layers and layers
    assert f"step 2: MoE layer {layers[0]}: expert_load_max_over_mean" in caplog.text


@pytest.mark.parametrize("bad,says", [("train.guard.policy=restart", "valid: none, skip, stop, rerun, rollback"),
                                      ("train.guard.loss_zscore=-1", "a number >= 0"),
                                      ("train.guard.min_history=64", "at most train.guard.window=32"),
                                      ("train.guard.straggler_interval=-2", "integer >= 0")])
def test_bad_guard_keys_name_the_key_and_what_is_valid(bad, says):
    from megatron_k3.config import ConfigError, compose_run_config

    with pytest.raises(ConfigError) as e:
        compose_run_config([bad])
    assert bad.split("=")[0] in str(e.value) and says in str(e.value)


def _faulty(rank, world, overrides, run_dir, fault):
    """7 steps of dp2 under policy=rerun; `fault`: rank 1's loss x100 at step SPIKE_AT, on the first pass only (a
    transient fault), or on both passes of both ranks (a genuine spike)."""
    from megatron_k3.training.engine import shutdown

    try:
        t = make_trainer(world, ["train.guard.policy=rerun", "train.guard.window=8", "train.guard.min_history=4"]
                         + overrides, steps=SPIKE_AT, run_dir=f"{run_dir}/{rank}")
        forward, hits = t._forward, []

        def hooked(samples, state_in=None):
            out, n = forward(samples, state_in)
            if t.step + 1 == SPIKE_AT and (fault == "genuine" or (fault == "rank1" and t.rank == 1 and not hits)):
                out.loss = out.loss * 100
                hits.append(1)
            return out, n

        t._forward = hooked
        recs = [t.train_step()[0] for _ in range(SPIKE_AT)]
        return recs[-1], full_params(t), t.guard.state()["events"]
    finally:
        shutdown()


@pytest.mark.slow
def test_rerun_names_the_faulty_rank_and_goes_on_with_the_recomputed_step(tmp_path):
    """Drill, policy=rerun on dp2: a one-time x100 on rank 1's loss at step 7 is withheld, the step re-run from the
    same inputs, rank 1 named as a suspected hardware fault, and the re-run's update applied: the parameters equal,
    bit for bit, a run without the fault. A spike the re-run reproduces is withheld as a genuine one."""
    clean = run_distributed(_faulty, 2, [], str(tmp_path / "clean"), "none", timeout=300)
    fault = run_distributed(_faulty, 2, [], str(tmp_path / "fault"), "rank1", timeout=300)
    genuine = run_distributed(_faulty, 2, [], str(tmp_path / "genuine"), "genuine", timeout=300)
    for (rec, params, events), (_, ref, _) in zip(fault, clean):
        assert rec["guard"] == "suspected_fault" and rec["guard_fault_ranks"] == [1] and rec["skipped"] == 0
        assert [e["ranks"] for e in events] == [[1]]
        assert all(torch.equal(params[n], ref[n]) for n in ref)
    for rec, _, events in genuine:
        assert rec["guard"] == "loss_spike" and rec["skipped"] == 1 and [e["reason"] for e in events] == ["loss_spike"]


ROLLBACK = ["train.guard.policy=rollback", "train.guard.window=8", "train.guard.min_history=4",
            "train.guard.rollback_skips=2", "train.guard.rollback_window=4", "train.save_interval=3",
            "train.eval_interval=0", "logging.wandb.mode=disabled"]


@pytest.mark.slow
def test_rollback_reloads_the_checkpoint_and_equals_a_run_that_skipped_the_window(tmp_path):
    """Drill: fit() for 10 steps saving every 3; steps 5 and 6 spike (x100, once each): both withheld, and at step 6
    the run rolls back to step 3's checkpoint, keeps its data position (the samples of steps 4-6 are skipped) and
    trains on to step 10. It ends bit for bit like a run resumed from that checkpoint with the data position moved
    past the same window."""
    from megatron_k3.training.engine import shutdown

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    try:
        t = make_trainer(1, ROLLBACK + [f"checkpoint.dir={tmp_path}/a"], steps=10, run_dir=str(tmp_path / "a"))
        forward, hit = t._forward, set()

        def spiking(samples, state_in=None):
            out, n = forward(samples, state_in)
            if t.step + 1 in (5, 6) and t.step + 1 not in hit:
                out.loss = out.loss * 100
                hit.add(t.step + 1)
            return out, n

        t._forward = spiking
        t.fit({})
        rolled, events, gbs = full_params(t), t.guard.events, t.run.train.global_batch_size
    finally:
        shutdown()
    assert [e["reason"] for e in events] == ["loss_spike", "loss_spike", "rollback"]
    assert events[-1]["to_step"] == 3 and events[-1]["skipped_samples"] == 3 * gbs
    try:
        t = make_trainer(1, ROLLBACK + [f"checkpoint.dir={tmp_path}/b"], steps=10, run_dir=str(tmp_path / "b"))
        for _ in range(3):
            t.train_step()
        t.save()
    finally:
        shutdown()
    try:
        t = make_trainer(1, ROLLBACK + [f"checkpoint.dir={tmp_path}/b"], steps=10, run_dir=str(tmp_path / "b"))
        t.maybe_resume()
        t.pos.consumed += 3 * gbs
        t.maybe_resume = lambda: None
        t.fit({})
        ref = full_params(t)
    finally:
        shutdown()
    assert all(torch.equal(rolled[n], ref[n]) for n in ref)


def test_guard_records_reach_the_wandb_series():
    from megatron_k3.training.metrics import wandb_scalars

    rec = {"step": 7, "loss": 400.0, "skipped": 1, "guard": "loss_spike", "guard_loss_z": 35000.0,
           "guard_grad_z": 1900.0, "guard_withheld_total": 1, "alarms": [{"kind": "router_entropy", "layer": 3}],
           "stragglers": [{"rank": 1, "node": "n1", "compute_s": 0.6, "wait_s": 0.0, "share": 0.97},
                          {"rank": 0, "node": "n0", "compute_s": 0.3, "wait_s": 0.37, "share": 0.44}]}
    flat = wandb_scalars(rec, None, [], 4)
    assert flat["guard/loss_spike"] == 1 and flat["guard/loss_z"] == 35000.0 and flat["train/skipped"] == 1
    assert flat["guard/alarms"] == 1 and flat["stragglers/slowest_rank"] == 1
    assert flat["stragglers/fastest_wait_s"] == 0.37


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [[], ["precision=bf16", "optim=muon"], ["parallel.zero_stage=0"]],
                         ids=["zero1_adamw", "bf16_muon", "zero0"])
def test_a_withheld_step_changes_no_weight_and_no_optimizer_state(tmp_path, overrides):
    """The update of step 3 withheld by force: every parameter and every optimizer state (AdamW's moments and step,
    Muon's momentum) as after step 2; step 4 moves them again."""
    from megatron_k3.training.engine import base_optimizer, shutdown

    def states(t):
        opt = base_optimizer(t.engine)
        return [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]

    try:
        t = make_trainer(1, overrides + ["train.guard.policy=skip", "train.guard.min_history=3",
                                         "train.guard.window=4"], steps=4, run_dir=str(tmp_path))
        judge = t.guard.judge
        t.guard.judge = lambda s, loss, n: (("forced", {"loss_z": 0.0, "grad_z": 0.0}) if s == 3 else
                                            judge(s, loss, n))
        snaps = []
        for _ in range(4):
            rec = t.train_step()[0]
            snaps.append((full_params(t), states(t), rec))
    finally:
        shutdown()
    (p2, s2, _), (p3, s3, r3), (p4, _, _) = snaps[1:]
    assert r3["guard"] == "forced" and r3["skipped"] == 1 and math.isfinite(r3["grad_norm"])
    assert all(torch.equal(p3[n], p2[n]) for n in p2) and len(s3) == len(s2) > 0
    assert all(torch.equal(a, b) for a, b in zip(s3, s2))
    assert any(not torch.equal(p4[n], p3[n]) for n in p3)
