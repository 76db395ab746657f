"""optim=muon through the real Trainer (gloo workers, fp32, k3_tiny at 4 layers): every layout steps like one
process, with global-norm gradient clipping active, and resume from a checkpoint is bitwise.

Layouts, after 3 steps of a global batch of 2 sequences (clipping at 1.0 acts at every step: the raw
gradient norm is ~3.7), against the one-process run (ZeRO-1 over one partition, 2 micro-batches):
- dp=2 under ZeRO-1 and ZeRO-2 equal it bit for bit (losses, every parameter; the reported gradient norm to
  1e-16). The two ranks' gradients average exactly to the one process's sum of two halves, and the clipping
  norm is summed in float64 (optim/zero.py), so nothing in the ZeRO path may differ by even a rounding error.
- tp=2, ep=2 and one process under ZeRO-0 (plain Muon; DeepSpeed clips p.grad with its fp32 norm) reassociate
  fp32 sums (TP's split matmuls, the expert dispatch, the norm), so they are held to 1e-5: every tensor in norm,
  ||a - b|| / ||b||, and every Muon tensor element-wise, max|a - b| / max|b|. Measured:
                      Muon tensors          AdamW-half tensors    losses
                      norm-rel  max-rel     norm-rel  max-rel
      tp2             3.0e-7    5.1e-7      3.3e-6    1.7e-5      5.3e-8
      ep2             2.2e-7    3.7e-7      7.7e-7    9.4e-6      0
      ZeRO-0          2.5e-7    4.3e-7      3.6e-6    1.2e-5      0
  and with a global batch of 4 (2 x 2 micro-batches under dp=2, 4 x 1 in one process, so the gradient sums
  reassociate too): dp2 ZeRO-1 2.2e-7 / 3.5e-7 / 2.7e-6 / 5.2e-5, ZeRO-2 2.5e-7 / 9.0e-7 / 2.5e-6 / 6.9e-5, tp2
  2.7e-7 / 6.1e-7 / 5.6e-6 / 7.8e-5, ep2 2.3e-7 / 3.0e-7 / 3.5e-6 / 5.2e-5; tp2 x dp2 and tp2 x ep2 (4 ranks)
  2.7e-7 / 3.8e-7 / 3.5e-6 / 2.7e-5 and 2.8e-7 / 5.1e-7 / 4.6e-6 / 3.9e-5. Newton-Schulz damps rounding noise;
  AdamW amplifies it on elements whose gradient sits at the noise floor (the LM head's; tests/test_engine.py
  explains it, optim=adamw alone shows the same), hence the AdamW half's element-wise numbers. Routing is
  discontinuous: once such noise flips a token's top-k choice, layouts part by ~1e-3 (seen with
  optim.per_head=false and optim.qk_clip=0.05 together under ep=2, whose dp2 run at a global batch of 2 with
  clipping off is still bitwise), which 1e-5 would flag.
What the tolerances catch, checked by breaking the code: Muon gradients left unclipped, 8e-4 in parameters
against ZeRO-0; the orthogonalised updates clipped instead of the gradients (what DeepSpeed would do), 9e-4 in
the step-2 loss; the saved momentum not restored, resume no longer bitwise (and 3e-5 in losses across DP
sizes in tests/test_train.py).
"""

import pytest
import torch
from dist_utils import run_distributed
from helpers import STATIC, TINY, full_params, max_abs_rel, norm_rel, one_process

# STATIC: every token finds room in its experts under every layout (as in tests/test_expert_parallel.py)
MUON = TINY + ["train.micro_batch_size=1", "train.global_batch_size=2", "train.eval_interval=0",
               "optim.warmup_steps=2", "logging.wandb.mode=disabled", "optim=muon", "train.grad_clip=1.0"] + STATIC
STEPS = 3
RTOL = 1e-5


def _train(rank, world, overrides, run_dir):
    from megatron_k3.config import compose_run_config
    from megatron_k3.optim.grouping import muon_rule
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    run, _, _ = compose_run_config(MUON + overrides, world_size=world)
    try:
        trainer = Trainer(run, f"{run_dir}/{rank}")
        init = full_params(trainer)
        recs = [trainer.train_step()[0] for _ in range(STEPS)]
        rules = {n: muon_rule(p) for n, p in trainer.model.named_parameters()}
        params = full_params(trainer)
        # the smallest move of a Muon-updated tensor: every one of them (experts included) was really stepped
        moved = min(max_abs_rel(params[n], init[n], floor=1e-12, float64=False) for n in params
                    if rules[n].startswith("muon"))
        base = trainer.engine.optimizer
        return ([r["loss"] for r in recs], [r["grad_norm"] for r in recs], params, rules,
                type(getattr(base, "optimizer", base)).__name__, moved)
    finally:
        shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_process(_train, tmp_path_factory)


@pytest.mark.parametrize("world,overrides,optimizer,bitwise", [
    (2, ["parallel.zero_stage=1"], "ZeroMuon", True),
    (2, ["parallel.zero_stage=2"], "ZeroMuon", True),
    (2, ["parallel.tp=2"], "ZeroMuon", False),
    (2, ["parallel.ep=2"], "ZeroMuon", False),  # routed experts on their EP rank, dense ZeRO-1 over dp=2
    (1, ["parallel.zero_stage=0"], "Muon", False),  # plain Muon, DeepSpeed clipping p.grad
], ids=["dp2-zero1", "dp2-zero2", "tp2", "ep2", "one-process-zero0"])
@pytest.mark.slow
def test_muon_layout_equals_single_process(reference, tmp_path, world, overrides, optimizer, bitwise):
    ref_losses, ref_norms, ref_params, rules, ref_opt, ref_moved = reference
    assert ref_opt == "ZeroMuon"  # one process runs ZeRO-1 too (the default stage), over one partition
    assert min(ref_norms) > 1.5  # clipping at 1.0 acted at every step
    assert ref_moved > 1e-3
    for rank, (losses, norms, params, _, opt, moved) in enumerate(
            run_distributed(_train, world, overrides, str(tmp_path), timeout=300)):
        assert opt == optimizer and moved > 1e-3
        for a, b in zip(norms, ref_norms):  # the reported norm is the raw gradients', not the updates'
            assert abs(a - b) <= (1e-12 if bitwise else RTOL) * b, (rank, norms, ref_norms)
        if bitwise:
            assert losses == ref_losses, (rank, losses, ref_losses)
            diff = [n for n, p in ref_params.items() if not torch.equal(params[n], p)]
            assert not diff, (rank, diff[:5],
                              max(max_abs_rel(params[n], ref_params[n], floor=1e-12, float64=False) for n in diff))
            continue
        for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
            assert abs(a - b) <= RTOL * abs(b), (rank, step, losses, ref_losses)
        worst = max((norm_rel(params[n], p), n) for n, p in ref_params.items())
        assert worst[0] < RTOL, (rank, worst)
        worst_muon = max((max_abs_rel(params[n], p, floor=1e-12, float64=False), n) for n, p in ref_params.items()
                         if rules[n].startswith("muon"))
        assert worst_muon[0] < RTOL, (rank, worst_muon)


def _resume(rank, world, overrides, run_dir):
    """4 steps straight, saving after step 2; then a new Trainer resumes from that checkpoint and runs steps 3
    and 4. Returns both runs' losses and parameters, and whether the saved Muon momentum was non-zero."""
    from megatron_k3.config import compose_run_config
    from megatron_k3.training.checkpoint import read_full, resolve_load_path
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    out = []
    for load in ("", "auto"):
        run, _, _ = compose_run_config(MUON + overrides + [f"checkpoint.load={load}", f"checkpoint.dir={run_dir}/ckpt"],
                                       world_size=world)
        try:
            trainer = Trainer(run, f"{run_dir}/{rank}")
            zero, split = trainer.engine.optimizer, False
            for gi, g in enumerate(zero.optimizer.param_groups):  # a Muon matrix lies across both partitions
                split |= g["use_muon"] and any(len(r) > 1 for r in zero.param_to_partition_ids[gi].values())
            trainer.maybe_resume()
            losses = []
            while trainer.step < 4:
                losses.append(trainer.train_step()[0]["loss"])
                if trainer.step == 2 and not load:
                    trainer.save()
            out.append((losses, full_params(trainer), trainer.step, split))
        finally:
            shutdown()
    _, optim, _ = read_full(resolve_load_path("auto", f"{run_dir}/ckpt"))
    momenta = {n: st["momentum_buffer"] for n, st in optim.items() if "momentum_buffer" in st}
    return out, {n: float(m.abs().max()) for n, m in momenta.items()}


@pytest.mark.slow
def test_muon_resume_is_bitwise(tmp_path):
    """dp=2, ZeRO-1: N + M steps equal N steps, save, load, M steps, bit for bit: the fp32 masters, AdamW's
    moments and DeepSpeed's flat Muon momentum (stored per parameter at full size, as one process stores it)
    round-trip. (One process: tests/test_train.py::test_resume_is_bitwise_identical runs optim=muon; resuming
    a dp=2 checkpoint in one process and the reverse: its test_data_parallel_and_resume_across_...)"""
    world = 2
    for rank, ((straight, p_straight, s1, split), (resumed, p_resumed, s2, _)), momenta in [
            (r, *res) for r, res in enumerate(run_distributed(_resume, world, ["parallel.zero_stage=1"], str(tmp_path),
                                                              timeout=300))]:
        assert split and s1 == s2 == 4 and len(straight) == 4 and len(resumed) == 2
        assert straight[2:] == resumed, (rank, straight, resumed)
        assert p_straight.keys() == p_resumed.keys()
        for n, p in p_straight.items():
            assert torch.equal(p, p_resumed[n]), (rank, n, (p - p_resumed[n]).abs().max())
        assert momenta and min(momenta.values()) > 0  # every Muon matrix's momentum was saved, non-zero


def _bf16_steps(rank, world, overrides, run_dir):
    """2 steps without weight decay: (losses, the parameters whose fp32 master moved, DeepSpeed's optimizer)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from megatron_k3.config import compose_run_config
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    run, _, _ = compose_run_config(MUON + ["optim.weight_decay=0"] + overrides, world_size=world)
    try:
        trainer = Trainer(run, f"{run_dir}/{rank}")
        named = list(trainer.model.named_parameters())
        init = {n: safe_get_full_fp32_param(p).clone() for n, p in named}
        losses = [trainer.train_step()[0]["loss"] for _ in range(2)]
        moved = {n for n, p in named if not torch.equal(safe_get_full_fp32_param(p), init[n])}
        return losses, moved, type(trainer.engine.optimizer).__name__
    finally:
        shutdown()


@pytest.mark.parametrize("optim,layouts", [
    ("muon", [(1, ["parallel.zero_stage=1"]), (1, ["parallel.zero_stage=2"]), (2, ["parallel.zero_stage=2"])]),
    ("adamw", [(1, ["parallel.zero_stage=1"]), (2, ["parallel.zero_stage=2"])]),
])
@pytest.mark.slow
def test_bf16_parameters_train_every_parameter_under_zero_1_and_2(tmp_path, optim, layouts):
    """precision=bf16 under the default ZeRO-1 and under ZeRO-2, with Muon (the default) and AdamW: DeepSpeed's
    ZeRO-1/2 optimizer for both stages (DeepSpeed 0.19.8 sends ZeRO-1 + bf16 to its BF16_Optimizer, which refuses
    Muon), and every parameter whose fp32 master moves in fp32 moves in bf16. Under ZeRO-2 + bf16 + Muon,
    DeepSpeed dropped the gradient of an AdamW-half parameter reduced just before a Muon matrix in one bucket (the
    AttnRes queries, short conv filters and most norm weights never moved: optim/zero.py flushes the bucket there).
    Losses agree with fp32 to bf16's resolution (2^-8 relative on the logits; measured ~4e-5 on 9.0)."""
    ref_losses, ref_moved, _ = run_distributed(_bf16_steps, 1, [f"optim={optim}"], str(tmp_path / "fp32"),
                                               timeout=300)[0]
    assert len(ref_moved) > 100
    for world, overrides in layouts:
        for losses, moved, zero in run_distributed(_bf16_steps, world, [f"optim={optim}", "precision=bf16"] + overrides,
                                                   str(tmp_path / f"{world}{overrides}"), timeout=300):
            assert zero == "DeepSpeedZeroOptimizer", (overrides, zero)
            assert moved == ref_moved, (world, overrides, sorted(ref_moved - moved)[:8], sorted(moved - ref_moved)[:8])
            for a, b in zip(losses, ref_losses):
                assert abs(a - b) <= 1e-3 * b, (world, overrides, losses, ref_losses)


def test_bf16_parameters_need_zero():
    """bf16 module weights keep their fp32 masters in ZeRO's partitions: ZeRO-0 is refused at start-up, naming the
    key (DeepSpeed 0.19 would raise NotImplementedError inside deepspeed.initialize; its ZeRO-0 bf16 optimizer
    would hand Muon flattened vectors anyway); ZeRO-1/2 (tests/test_train.py runs bf16 with ZeRO-2) and fp32 run."""
    from megatron_k3.config import ConfigError, compose_run_config

    for overrides in (["optim=muon", "precision=bf16"], ["optim=adamw", "precision=mx_qat"]):
        with pytest.raises(ConfigError) as e:
            compose_run_config(overrides + ["parallel.zero_stage=0"])
        assert e.value.key == "parallel.zero_stage" and "param_dtype=bf16" in str(e.value)
        compose_run_config(overrides + ["parallel.zero_stage=1"])
    compose_run_config(["optim=adamw", "precision=fp32", "parallel.zero_stage=0"])
