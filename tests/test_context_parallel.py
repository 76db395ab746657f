"""Context parallelism (megatron_k3/parallel/context.py) equals the single-process run.

- The model: loss and every parameter gradient of one forward/backward, cp ranks (gradients summed over the CP
  group) against one process, with document boundaries inside chunks, exactly at a chunk boundary and inside a
  conv halo, composed with tensor + sequence parallelism, and on a 32K-token sequence.
- The Trainer (DeepSpeed, ZeRO-1): losses, gradient norms and parameters after 5 AdamW steps at cp=2 and
  cp=2 x ep=2, and the process groups those layouts build.
- The planner's activation model under CP against the measured peak of real training steps at cp=1 and cp=2.

Tolerances. Losses 1e-5 relative (fp32; measured ~1e-7). Gradients: per tensor ||g_cp - g|| / ||g|| < 1e-4
(measured <= 7e-6 at T=128 and 32K): the CP run sums in another order (each chunk's KDA state comes from the
composed transitions A S + B instead of the step-by-step hand-off, the latent's gradient is reduce-scattered,
attention runs per query block), and the largest differences sit in gradients summed over every token with
cancellation (A_log, b_proj); a missing halo, a wrong carry or a leaked document is off by 1e-2 or more.
Parameters after 5 steps: PARAM_RTOL of tests/helpers.py (AdamW amplifies rounding differences; test_engine's
docstring says how).
"""

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from helpers import PARAM_RTOL, RTOL, STATIC, load_file, norm_rel, train_layout
from trajectory import compare

GRAD_RTOL = 1e-4
ROOT = Path(__file__).resolve().parent.parent

# A 2-layer K3 (KDA then Gated MLA, dense FFN then MoE, AttnRes) small enough for 32K tokens on one core.
# qk_nope + qk_rope == v_head_dim keeps torch's CPU flash attention (O(T) memory) for the single-process run.
LONG = dict(vocab_size=512, hidden_size=32, num_layers=2, kda_num_heads=2, kda_head_dim=16, mla_num_heads=1,
            q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
            dense_intermediate_size=64, num_experts=4, top_k=2, moe_intermediate_size=16, moe_latent_size=16,
            shared_intermediate_size=32, moe_capacity_factor=2.0)  # capacity 2.0 = E/k: no token is dropped
TINY = dict(moe_capacity_factor=4.0)  # k3_tiny (8 layers, two MLA), every token fits its experts


# ---------------------------------------------------------------------------------------------- bookkeeping


def test_zigzag_shard_bookkeeping():
    from megatron_k3.parallel.context import SequenceShard
    from megatron_k3.parallel.mappings import Group

    T, cu = 64, torch.tensor([0, 5, 14, 16, 40, 64])  # cp=2: chunks of 16; 14 inside chunk 1's halo, 16 at its start
    s0 = SequenceShard(Group(None, 2, 0), T, cu)
    s1 = SequenceShard(Group(None, 2, 1), T, cu)
    assert s0.chunks == (0, 3) and s1.chunks == (1, 2)
    assert s0.index.tolist() == list(range(0, 16)) + list(range(48, 64))
    assert s1.take(torch.arange(T)[None])[0].tolist() == list(range(16, 48))
    assert s0.token_order.tolist() == list(range(0, 16)) + list(range(32, 64)) + list(range(16, 32))
    assert s0.carry == [False, True] and s1.carry == [False, True]  # chunk 1 starts a document at 16
    assert s0.local_cu().tolist() == [0, 5, 14, 16, 32] and s1.local_cu().tolist() == [0, 16, 24, 32]
    # [halo ; chunk] rows for a width-4 conv: chunk 1's halo (13..15) holds the start of the document at 14
    assert s1.extended_cu(3).tolist() == [0, 1, 3, 19, 30, 38]
    assert s0.extended_cu(3).tolist() == [0, 3, 8, 17, 19, 38]
    with pytest.raises(ValueError, match="not divisible by 4"):
        SequenceShard(Group(None, 2, 0), 66)


def test_config_rejects_bad_context_parallel_sizes():
    from megatron_k3.config import ConfigError, compose_run_config

    with pytest.raises(ConfigError, match=r"parallel\.cp.*2\*cp=4.*train\.seq_length=66"):
        compose_run_config(["parallel.cp=2", "train.seq_length=66"], world_size=2)
    with pytest.raises(ConfigError, match=r"parallel\.cp.*shorter than the short convolution"):
        compose_run_config(["parallel.cp=2", "train.seq_length=8", "train.micro_batch_size=1",
                            "train.global_batch_size=1"], world_size=2)


# ---------------------------------------------------------------------------------------------- the ops, fp64


def _ops_cp(rank, world, T, cu, batch):
    """KDA (composed chunk transitions) and the short conv (halos) on this rank's chunks in fp64, against the
    whole-sequence ops on every rank: outputs and the gradients of every input."""
    import torch.distributed as dist

    from megatron_k3.ops.kda import chunk_kda
    from megatron_k3.ops.short_conv import causal_conv1d
    from megatron_k3.parallel import state
    from megatron_k3.parallel.context import SequenceShard, conv_context_parallel, kda_context_parallel
    from megatron_k3.parallel.mappings import Group

    state.initialize_model_parallel(cp=world)
    try:
        g = torch.Generator().manual_seed(0)
        B, H, K, V, C, W = batch, 2, 8, 6, 5, 4
        f64 = dict(dtype=torch.float64)
        q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, **f64), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, **f64), dim=-1)
        v = torch.randn(B, T, H, V, generator=g, **f64)
        gate = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=g, **f64))
        beta = torch.sigmoid(torch.randn(B, T, H, generator=g, **f64))
        x, w = torch.randn(B, T, C, generator=g, **f64), torch.randn(C, W, generator=g, **f64)
        probe_o, probe_y = torch.randn(B, T, H, V, generator=g, **f64), torch.randn(B, T, C, generator=g, **f64)
        inputs = [t.requires_grad_() for t in (q, k, v, gate, beta, x, w)]
        cu_t = None if cu is None else torch.tensor(cu)
        # the whole sequence (chunk size 16 does not divide the 24-token CP chunks: kernel chunks straddle them)
        o_ref, _ = chunk_kda(q, k, v, gate, beta, chunk_size=16, cu_seqlens=cu_t)
        y_ref, _ = causal_conv1d(x, w, cu_seqlens=cu_t)
        ref_grads = torch.autograd.grad((o_ref * probe_o).sum() + (y_ref * probe_y).sum(), inputs)
        shard = SequenceShard(Group.of(state.get_context_parallel_group()), T, cu_t)
        loc = [shard.take(t) for t in (q, k, v, gate, beta, x)]
        o = kda_context_parallel(chunk_kda, *loc[:5], shard, chunk_size=16)
        y = conv_context_parallel(causal_conv1d, loc[5], w, shard)
        loss = (o * shard.take(probe_o)).sum() + (y * shard.take(probe_y)).sum()
        grads = list(torch.autograd.grad(loss, inputs))
        for gr in grads:  # every rank holds the gradient of its share
            dist.all_reduce(gr, group=state.get_context_parallel_group())
        out_err = max((o - shard.take(o_ref)).abs().max().item(), (y - shard.take(y_ref)).abs().max().item())
        grad_err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, ref_grads))
        return out_err, grad_err
    finally:
        state.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("cu,batch", [(None, 2), ([0, 7, 30, 46, 48, 70, 96], 1)], ids=["rows", "documents"])
def test_ops_equal_whole_sequence_in_fp64(cu, batch):
    """In fp64 the composed per-chunk transitions and the halo exchange reproduce the whole-sequence KDA and conv
    to rounding (measured <= 6e-16): the method is exact; the model tests' fp32 differences are summation
    order. T=96 at cp=2: chunks of 24; documents start inside chunks, inside chunk 2's halo (46, 2 tokens before
    its start at 48) and exactly at chunk boundaries (48 is also where rank 1's second chunk begins)."""
    for out_err, grad_err in run_distributed(_ops_cp, 2, 96, cu, batch, timeout=120):
        assert out_err < 1e-13 and grad_err < 1e-12, (out_err, grad_err)


# ---------------------------------------------------------------------------------------------- the model


def _model_grads(rank, world, cfg_over, T, batch, cu, tp, sp):
    import torch.distributed as dist

    from megatron_k3.annotations import meta
    from megatron_k3.config import load_model_config
    from megatron_k3.model import K3ForCausalLM
    from megatron_k3.parallel import ParallelGroups, parallelize, state

    ps = state.initialize_model_parallel(tp=tp, cp=world // tp)
    try:
        cfg = load_model_config("k3_tiny")
        for k, v in cfg_over.items():
            setattr(cfg, k, v)
        torch.manual_seed(0)
        model = parallelize(K3ForCausalLM(cfg), ParallelGroups.from_state(ps, sp))
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (batch, T), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (batch, T), generator=g)
        out = model(ids, labels=labels, cu_seqlens=None if cu is None else torch.tensor(cu))
        out.loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            gr = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            if world // tp > 1:  # each CP rank holds the gradient of its share of the tokens
                dist.all_reduce(gr, group=state.get_context_parallel_group())
            d = meta(p).tp_dim
            if d is not None and tp > 1:
                parts = [torch.empty_like(gr) for _ in range(tp)]
                dist.all_gather(parts, gr.contiguous(), group=state.get_tensor_model_parallel_group())
                gr = torch.cat(parts, d)
            grads[n] = gr
        return out.loss.item(), grads
    finally:
        state.destroy_model_parallel()


def _compare(results, ref):
    ref_loss, ref_grads = ref
    for rank, (loss, grads) in enumerate(results):
        assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (rank, loss, ref_loss)
        worst = max((norm_rel(grads[n], g), n) for n, g in ref_grads.items() if g.norm() > 0)
        assert worst[0] < GRAD_RTOL, (rank, worst)


# T=128 packed row: documents start inside chunks, at 62 (two tokens before chunk 2 at cp=2: inside its conv
# halo), at 96 (exactly chunk 3's start at cp=2; chunk 6's at cp=4) and one token before the end
DOCS = [0, 5, 62, 96, 100, 127, 128]


@pytest.fixture(scope="module")
def tiny_reference():
    return run_distributed(_model_grads, 1, TINY, 128, 1, DOCS, 1, False, timeout=120)[0]


@pytest.mark.parametrize("world,tp,sp", [(2, 1, False), (4, 1, False), (4, 2, True)],
                         ids=["cp2", "cp4", "tp2-sp-x-cp2"])
@pytest.mark.slow
def test_model_with_documents_equals_single_process(tiny_reference, world, tp, sp):
    _compare(run_distributed(_model_grads, world, TINY, 128, 1, DOCS, tp, sp, timeout=120), tiny_reference)


@pytest.mark.slow
def test_long_sequence_32k_equals_single_process():
    """32,768 tokens, two sequences' worth of work for MLA's attention square, cp=2 against one process."""
    T = 32768
    ref = run_distributed(_model_grads, 1, LONG, T, 1, None, 1, False, timeout=300)[0]
    _compare(run_distributed(_model_grads, 2, LONG, T, 1, None, 1, False, timeout=300), ref)


# ---------------------------------------------------------------------------------------------- the Trainer

# helpers.train_layout with STATIC (no token dropped, as in test_expert_parallel), against conftest's reference_static:
# the one-process run test_expert_parallel compares with too


def _grad_norms(steps):
    return [s.record["grad_norm"] for s in steps]


@pytest.mark.parametrize("world,overrides,groups", [
    (2, ["parallel.cp=2"], {"cp": [0, 1], "dp": [0], "dp-cp": [0, 1], "ep": [0], "edp": [0, 1]}),
    # ep folds onto the CP ranks: each EP group is one sequence's two CP shards; experts reduce over edp
    (4, ["parallel.cp=2", "parallel.ep=2"], {"cp": [0, 1], "dp": [0, 2], "dp-cp": [0, 1, 2, 3], "ep": [0, 1],
                                              "edp": [0, 2]}),
], ids=["cp2", "cp2xep2"])
@pytest.mark.slow
def test_trainer_equals_single_process(reference_static, tmp_path, world, overrides, groups):
    ref_steps = reference_static[3]["steps"]
    ref_norms = _grad_norms(ref_steps)
    results = run_distributed(train_layout, world, STATIC + overrides, str(tmp_path), timeout=300)
    for rank, (_, _, _, extra) in enumerate(results):
        steps, norms, dropped = extra["steps"], _grad_norms(extra["steps"]), extra["dropped"]
        if rank == 0:
            assert extra["groups"] == groups
            assert extra["seq_dp"] == len(groups["dp-cp"])  # DeepSpeed reduces dense gradients over dp x cp
        # losses and parameters step by step, up to a routing decision a near-tie let go the other way
        compared = compare(ref_steps, steps, RTOL, PARAM_RTOL, f"rank {rank}")
        for a, b in zip(norms[:compared], ref_norms):  # a gradient averaged over the wrong group shows here
            assert abs(a - b) <= 1e-4 * abs(b), (rank, norms, ref_norms)
        assert dropped == [0.0] * len(dropped)


# ---------------------------------------------------------------------------------------------- memory


def _peak_memory(rank, world, overrides, run_dir):
    from megatron_k3.config import compose_run_config
    from megatron_k3.planning.measure import LiveTensorMemory
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    run, _, _ = compose_run_config(["logging.wandb.mode=disabled", *overrides], world_size=world)
    try:
        trainer = Trainer(run, f"{run_dir}/{rank}")
        tracker = LiveTensorMemory()
        tracker.track_all(list(trainer.model.parameters()) + list(trainer.model.buffers()) +
                          list(getattr(trainer.engine.optimizer, "single_partition_of_fp32_groups", [])))
        with tracker:
            for _ in range(2):  # the second step has optimizer states
                trainer.train_step()
        return tracker.peak
    finally:
        shutdown()


def _plan(overrides) -> dict:
    mod = load_file(ROOT / "tools" / "plan.py")
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert mod.main(["model=k3_tiny", "cluster=cpu", *overrides, "--json"]) == 0
    return json.loads(buf.getvalue())


@pytest.mark.slow
def test_memory_estimate_under_context_parallelism(tmp_path):
    """The peak of live tensor bytes of two real k3_tiny steps (one micro-batch of 2 x 512 tokens, packed) at cp=1 and
    cp=2 against tools/plan.py for the same runs. Measured on 2 CPU cores (2026-12-06): cp=1 435 MB vs 426 MB planned,
    cp=2 230 MB vs 229 MB (the estimate is 2.2% and 0.6% low; the saving 0.53 measured, 0.54 planned); 10% is the
    bound. Earlier that day the plan was 444 / 244 MB: with one micro-batch a step it counted the gradients at the
    loss gradient's peak, where none exists yet; before, 478 / 261 MB, 10-14% high: it counted the logits as kept for
    the backward, which the Trainer never holds (it keeps the loss alone). The cp=2 plan includes the gathered latent
    and the keys and values expanded from it on every rank, the attention spans of the zigzag query blocks and KDA's
    wider chunk kernel (planning/activations.py)."""
    base = ["train.micro_batch_size=2", "train.global_batch_size=2", "train.seq_length=512"]
    peaks, plans = {}, {}
    for cp in (1, 2):
        over = base + [f"parallel.cp={cp}"]
        peaks[cp] = max(run_distributed(_peak_memory, cp, over, str(tmp_path / f"cp{cp}"), timeout=300))
        plans[cp] = _plan(over + [f"cluster.devices_per_node={cp}"])
        estimate = plans[cp]["memory_per_device_gb"] * 1e9
        assert estimate == pytest.approx(peaks[cp], rel=0.10), (cp, estimate, peaks[cp])
    # the saving CP buys, as measured and as planned
    planned = plans[2]["memory_per_device_gb"] / plans[1]["memory_per_device_gb"]
    assert planned == pytest.approx(peaks[2] / peaks[1], rel=0.08), (planned, peaks)
