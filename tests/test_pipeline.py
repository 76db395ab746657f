"""Pipeline parallelism (parallel/pipeline.py): the 1F1B order, the stage split at AttnRes block boundaries, and
pp=2 / pp=2 x tp=2 training through the real Trainer equal to the single-process run (test_engine's reference:
5 AdamW steps of the 4-layer k3_tiny, fp32, 4 micro-batches so the steady 1F1B phase runs, gradient clipping
active: grad_clip=1.0 against norms of about 2.6, so a norm that missed a stage would change every update).

Tolerances are test_engine's and for the same reason: losses 1e-5 relative (fp32); parameters per tensor
||a - b|| / ||b|| <= PARAM_RTOL (the gradient of a block that several stages use is summed in another order).
"""

import pytest
import torch
from dist_utils import run_distributed
from helpers import FAST, PARAM_RTOL, RTOL, STATIC, STEPS, M, N, full_params, make_trainer, norm_rel, one_process
from trajectory import compare, record


def test_schedule_1f1b_order():
    from megatron_k3.parallel.pipeline import schedule_1f1b

    # pp=4, 6 micro-batches: stage 0 warms up with 3 forwards, the last stage alternates from the start
    assert schedule_1f1b(6, 4, 0) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                      ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert schedule_1f1b(6, 4, 3) == [x for i in range(6) for x in (("F", i), ("B", i))]
    assert schedule_1f1b(2, 4, 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # fewer micro-batches than stages
    for pp in (1, 2, 3, 5):
        for m in (1, 2, 4, 7):
            for s in range(pp):
                ops = schedule_1f1b(m, pp, s)
                assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
                done, live, peak = set(), 0, 0
                for kind, i in ops:  # every backward after its forward, micro-batches in order
                    assert kind == "F" or ("F", i) in done
                    assert [j for k, j in ops if k == kind] == list(range(m))
                    done.add((kind, i))
                    live += 1 if kind == "F" else -1
                    peak = max(peak, live)
                assert peak == min(pp - s, m)  # the 1F1B memory bound: at most pp - stage micro-batches held


class _Recorder:
    """A StageLink stand-in that records one stage's point-to-point operations per neighbour, in order: each entry
    the operations that go together (one for a single send or receive, two for a batched exchange)."""

    def __init__(self, stage, size):
        self.stage, self.size = stage, size
        self.prev = stage - 1 if stage > 0 else None
        self.next = stage + 1 if stage < size - 1 else None
        self.ops = {self.prev: [], self.next: []}

    def _op(self, peer, *ops):
        self.ops[peer].append(list(ops))
        return torch.zeros(1)

    def recv_forward(self, device):
        return self._op(self.prev, ("recv", "F"))

    def send_forward(self, y):
        self._op(self.next, ("send", "F"))

    def recv_backward(self, like):
        return self._op(self.next, ("recv", "B"))

    def send_backward(self, g):
        self._op(self.prev, ("send", "B"))

    def send_forward_recv_backward(self, y, like):
        return self._op(self.next, ("send", "F"), ("recv", "B"))

    def send_backward_recv_forward(self, g, device):
        return self._op(self.prev, ("send", "B"), ("recv", "F"))

    def wait(self):
        pass


def _drains(a: list, b: list) -> bool:
    """Whether two neighbours' operations toward each other all complete under NCCL's rule for messages larger
    than its buffers: each rank runs its entries in order on one stream, an entry's operations all at once; a send
    completes only with the peer's matching receive running, and an entry ends when all of its operations have."""
    a, b = [list(e) for e in a], [list(e) for e in b]
    while a or b:
        if not a or not b:
            return False
        moved = False
        for mine, theirs in ((a[0], b[0]), (b[0], a[0])):
            for op in [o for o in mine if o[0] == "send"]:
                if ("recv", op[1]) in theirs:
                    mine.remove(op)
                    theirs.remove(("recv", op[1]))
                    moved = True
        for q in (a, b):
            if q and not q[0]:
                q.pop(0)
                moved = True
        if not moved:
            return False
    return True


@pytest.mark.parametrize("pp", [2, 3, 4, 5])
def test_1f1b_messages_cannot_deadlock_on_nccl(pp):
    """Every adjacent pair of stages drains under NCCL's ordering (a stand-in: this machine has no NCCL; gloo
    buffers sends, so the distributed tests cannot show it), for 1 to 9 micro-batches, and each stage still computes
    in schedule_1f1b's order. One message at a time, the steady state deadlocked: stage s sent F(i+1) while stage
    s+1 sent B(i), each waiting for the other's receive."""
    from megatron_k3.parallel.pipeline import run_1f1b, schedule_1f1b

    for m in range(1, 10):
        links = [_Recorder(s, pp) for s in range(pp)]
        for s, link in enumerate(links):
            order = []
            run_1f1b(link, m, "cpu", lambda i, x, order=order: order.append(("F", i)) or torch.zeros(1),
                     lambda i, y, g, order=order: order.append(("B", i)), lambda i: None)
            assert order == schedule_1f1b(m, pp, s), (pp, m, s)
        for s in range(pp - 1):
            assert _drains(links[s].ops[s + 1], links[s + 1].ops[s]), (pp, m, s, links[s].ops[s + 1],
                                                                        links[s + 1].ops[s])


def test_a_message_that_changes_the_links_shape_is_refused_by_its_sender():
    """The receiver allocates every activation by the link's header (the first one sent) and every gradient by
    what it sent; NCCL would fill a buffer of the wrong size without a word. The sender refuses an activation or
    input gradient whose shape or dtype differs, naming the rank, the stage and both shapes, before it reaches the
    wire; one that keeps them goes out."""
    from megatron_k3.parallel.pipeline import StageLink

    link = StageLink.__new__(StageLink)  # no process group: the transport is stood in for
    link.rank, link.stage, link.size, link.prev, link.next, link.wire = 5, 1, 3, 4, 6, torch.device("cpu")
    link._meta_out, link._meta_in, link._pending = None, ((2, 8, 16), torch.float32), []
    sent = []
    link._isend = lambda t, dst: sent.append((tuple(t.shape), dst))
    link._exchange = lambda t, peer, buf: sent.append((tuple(t.shape), peer)) or buf
    y = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    link.send_forward(y)
    link.send_forward_recv_backward(y, y)
    link.send_backward(torch.zeros(2, 8, 16))
    link.send_backward_recv_forward(torch.zeros(2, 8, 16), "cpu")
    assert sent == [((8,), 6), ((1, 2, 8, 16), 6), ((1, 2, 8, 16), 6), ((2, 8, 16), 4), ((2, 8, 16), 4)]
    bad = [(link.send_forward, (torch.zeros(1, 2, 4, 16, dtype=torch.bfloat16),), "(1, 2, 4, 16)"),
           (link.send_forward_recv_backward, (y.float(), y), "torch.float32"),
           (link.send_backward, (torch.zeros(2, 4, 16),), "(2, 4, 16)"),
           (link.send_backward_recv_forward, (torch.zeros(2, 8, 16, dtype=torch.bfloat16), "cpu"), "bfloat16")]
    for fn, args, named in bad:
        with pytest.raises(RuntimeError, match=r"rank 5 \(stage 1\)") as e:
            fn(*args)
        assert named in str(e.value) and ("train.seq_length" in str(e.value)) == named.startswith("("), e.value
    assert len(sent) == 5  # nothing refused reached the wire


def test_stage_split_and_config_errors():
    from megatron_k3.config import ConfigError, compose_run_config
    from megatron_k3.layout import stage_layers as stage_ranges

    run, _, _ = compose_run_config(["model.num_layers=10", "model.attn_res_block_size=3"], world_size=1)
    # blocks [0,3) [3,6) [6,9) [9,10): cuts only at block boundaries, balanced by layer count
    assert stage_ranges(run.model, 2) == [(0, 6), (6, 10)]
    assert stage_ranges(run.model, 3) == [(0, 3), (3, 6), (6, 10)]
    assert all(s % 3 == 0 for s, _ in stage_ranges(run.model, 4))
    with pytest.raises(ConfigError, match="parallel.pp"):
        compose_run_config(["model.num_layers=4", "model.attn_res_block_size=2", "parallel.pp=4"], world_size=4)
    with pytest.raises(ConfigError, match="parallel.pp"):
        compose_run_config(FAST + ["parallel.pp=2", "model.tie_word_embeddings=true"], world_size=2)
    with pytest.raises(ConfigError, match="parallel.zero_stage"):
        compose_run_config(FAST + ["parallel.pp=2", "parallel.zero_stage=0"], world_size=2)


def test_stage_holds_only_its_layers():
    from megatron_k3.config import compose_run_config
    from megatron_k3.model import K3ForCausalLM
    from megatron_k3.parallel.pipeline import cut_stage

    run, _, _ = compose_run_config(FAST, world_size=1)
    names = [{n for n, _ in cut_stage(K3ForCausalLM(run.model), 2, stage).named_parameters()} for stage in (0, 1)]
    full = {n for n, _ in K3ForCausalLM(run.model).named_parameters()}
    assert names[0] | names[1] == full and not names[0] & names[1]  # global names, each parameter once
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" in names[1]
    assert {n.split(".")[2] for n in names[1] if n.startswith("model.layers.")} == {"2", "3"}


def _train(rank, world, overrides, run_dir):
    """test_engine's 5 steps, also returning what every rank logs: per-step grad norm, the last step's expert-load
    summary (routing counts and router biases of every stage's MoE layers), and an evaluation."""
    from megatron_k3.config import compose_run_config
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    run, _, _ = compose_run_config(FAST + ["train.eval_iters=2"] + overrides, world_size=world)
    try:
        trainer = Trainer(run, f"{run_dir}/{rank}")
        steps = record(trainer, STEPS, full_params)  # per step: loss, routing, parameters (tests/trajectory.py)
        recs = [s.record for s in steps]
        logged = {"grad_norm": [r["grad_norm"] for r in recs], "eval_loss": trainer.evaluate(),
                  **{f"expert_load.{k}": v for k, v in recs[-1]["expert_load"].items()}}
        return steps, logged
    finally:
        shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_process(_train, tmp_path_factory)


@pytest.mark.parametrize("world,overrides", [
    (2, ["parallel.pp=2"]),
    (4, ["parallel.pp=2", "parallel.tp=2"]),
], ids=["pp2", "pp2xtp2"])
@pytest.mark.slow
def test_pipeline_equals_single_process(reference, tmp_path, world, overrides):
    ref_steps, ref_logged = reference
    results = run_distributed(_train, world, overrides, str(tmp_path), timeout=300)
    held = set()
    for rank, (steps, logged) in enumerate(results):
        # every rank logs the last stage's loss; losses and this stage's parameters step by step, up to a routing
        # decision a near-tie let go the other way (tests/trajectory.py)
        compared = compare(ref_steps, steps, RTOL, PARAM_RTOL, f"rank {rank}")
        held |= set(steps[-1].params)
        # the global clipping norm, evaluation and routing statistics, gathered from both stages, on every rank
        assert logged.keys() == ref_logged.keys()
        if compared < len(steps):
            continue  # what the last step logs follows that step's routing
        for k, ref in ref_logged.items():
            # the selection bias is a difference of two sigmoid scores (a margin): its rounding error is relative
            # to the scores' scale (~1), not to the bias's own small spread
            floor = 1.0 if "bias" in k else 1e-3
            # the evaluation runs on the parameters after the step, which may differ by PARAM_RTOL (measured with
            # all 5 steps compared: eval_loss 1.4e-5 apart under pp2 x tp2)
            tol = PARAM_RTOL if k.startswith("eval") else RTOL
            for a, b in zip(*((v if isinstance(v, list) else [v]) for v in (logged[k], ref))):
                assert abs(a - b) <= tol * max(abs(b), floor), (rank, k, logged[k], ref)
    assert held == set(ref_steps[-1].params)  # the stages together hold every parameter


@pytest.mark.slow
def test_a_stage_without_moe_layers_joins_the_experts_norm(tmp_path_factory):
    """pp2 x ep2 with the first two layers dense: stage 0 holds no routed experts, yet the experts' squared gradient
    norm is summed over the pipeline group (training.expert_optimizer), so that stage joins the sum with nothing of
    its own (until 2026-12-05 it built no expert optimizer and the other stage waited for it). The run equals one
    process, the logged global gradient norm (which clips, experts included) on every rank too. (STATIC: every
    expert has room for every token, as one process gives it.)"""
    model = ["model.first_k_dense=2"] + STATIC
    ref_steps, ref_logged = one_process(_train, tmp_path_factory, model, name="ref_dense_stage")
    results = run_distributed(_train, 4, model + ["parallel.pp=2", "parallel.ep=2"],
                              str(tmp_path_factory.mktemp("pp2xep2")), timeout=300)
    for rank, (steps, logged) in enumerate(results):
        assert compare(ref_steps, steps, RTOL, PARAM_RTOL, f"rank {rank}") == len(steps)
        assert logged["grad_norm"] == pytest.approx(ref_logged["grad_norm"], rel=RTOL), rank


def _restage(rank, world, save_overrides, load_overrides, ckpt_dir):
    """Train 4 steps straight under the loading layout; then train 2 under the saving layout, save, resume under the
    loading layout and train 2 more. Returns both runs' losses and this rank's parameters."""
    from megatron_k3.training.engine import shutdown

    try:
        t = make_trainer(world, load_overrides + [f"checkpoint.dir={ckpt_dir}/straight"])
        straight = [t.train_step()[0]["loss"] for _ in range(N + M)]
        p_straight = full_params(t)
    finally:
        shutdown()
    try:
        t = make_trainer(world, save_overrides + [f"checkpoint.dir={ckpt_dir}/run"])
        first = [t.train_step()[0]["loss"] for _ in range(N)]
        t.save()
    finally:
        shutdown()
    try:
        t = make_trainer(world, load_overrides + [f"checkpoint.dir={ckpt_dir}/run", "checkpoint.load=auto"])
        t.maybe_resume()
        assert t.step == N
        second = [t.train_step()[0]["loss"] for _ in range(M)]
        p_resumed = full_params(t)
    finally:
        shutdown()
    return straight, first + second, p_straight, p_resumed


@pytest.mark.parametrize("save,load", [
    (["parallel.pp=2"], ["parallel.pp=2"]),
    (["parallel.pp=2"], []),
], ids=["pp2-pp2", "pp2-to-dp2"])
@pytest.mark.slow
def test_checkpoint_across_pipeline_layouts(tmp_path, save, load):
    """Each stage writes its own parameters under their global names (files `_ppXX`); a checkpoint loads under
    any pipeline split. Same layout: bit for bit; across layouts (pp=2 vs dp=2, both 2 processes): the
    single-process tolerances, as the two layouts sum gradients in different orders."""
    for rank, (straight, resumed, p_straight, p_resumed) in enumerate(
            run_distributed(_restage, 2, save, load, str(tmp_path), timeout=300)):
        if save == load:
            assert straight == resumed, (rank, straight, resumed)
            assert all(torch.equal(p_straight[n], p_resumed[n]) for n in p_straight)
        for a, b in zip(resumed, straight):
            assert abs(a - b) <= RTOL * abs(b), (rank, straight, resumed)
        worst = max((norm_rel(p_resumed[n], p), n) for n, p in p_straight.items())
        assert worst[0] < PARAM_RTOL, (rank, worst)
