"""Sequence tiling of the per-token parts (train.tile_tokens, megatron_k3.parallel.tiling) and activation offload
(train.offload_buffer_gb, megatron_k3.parallel.offload).

- Tiling, one process: the loss within 1e-6 and every gradient within 1e-5 (max |diff| / max |ref| per tensor) of
  untiled, under none, selective and full recomputation, KDA's delta rule tiled too (16-token chunks; KDA's tiled
  kernel alone is bit for bit the untiled one on rows and seq_idx documents, with and without states). Why not bit for
  bit: the tiles' loss means are added weighted by their token counts, the weight gradients are sums over tokens added
  tile by tile, and the router's and experts' GEMMs take another code path for fewer rows (fp32 rounding; measured:
  the loss equal, the worst gradient 2.1e-6 at 16-token tiles, KDA's A_log, whose gradient sums every token and
  channel of a head, 9e-7 at 32; over 88 fresh fp32 draws of an independent check 1.6e-5 at 1-token tiles, 5.6e-6
  at 2-3, docs/planning.md, which also says why precision=mx_qat's expert gradients move by whole quantisation steps
  at tiny tiles). The routers are observed once per micro-batch and MoE layer over all its rows, and
  the load counts are equal (on these inputs: a token whose k-th and (k+1)-th scores are within the router GEMM's
  rounding can change experts tiled, as under another layout; docs/planning.md). A recomputed tiled block records
  nothing, whether torch's checkpoint stops the recomputation early or not.
- Offload, one process: bit for bit equal to full recomputation (the host round trip copies values; the graph is
  full's), the completed AttnRes blocks held once however many layers read them, all host memory released by the
  backward, a budget too small keeps the inputs on the device and is still exact; in the backward every layer's
  inputs but the first read's are prefetched, and what is loaded back at once, and what the first read waits for, are
  the planner's figures exactly. The asynchronous path (CUDA's streams and events) run here with copies that run as
  late as their events allow: bit for bit, over micro-batches in flight, a forward without backward and a budget
  that keeps some inputs on the device, and a reused host buffer written only after a discarded load has read it;
  leaving out any of the three waits it relies on breaks it. CudaCopies' own code (CUDA's path) under a model of
  CUDA's streams, events and caching allocator: bit for bit, no copy reads freed memory; without its record_stream,
  its read's wait or its load's wait, the model sees it. A layer whose inputs stayed on the device (the budget spent)
  still prefetches the layer before it.
- The Trainer (tests/test_recompute.py, in its layout runs): tiled under tp2 + sequence parallelism, ep2 balanced
  and cp2 follows untiled as the layout tests follow one process; offloaded under pp2 bit for bit equal to none.
- Memory: a tiled block's weight gradients are summed over its tiles by autograd and accumulated once (the sum, one
  copy of the block's weights, is live through its backward), as the planner counts it.
- Under cp2, a rank whose share of the row has no label (a chat's long prompt): the tiled head's loss finite and
  equal to untiled's, the gradients to rounding.
- A tile of at least a device's tokens runs untiled (bit for bit).
- Bad input names the key: a tile that does not divide the tokens (with the nearest sizes that do, from the config's
  layout check, before anything is built), tiling with the drop dispatcher, offload without full recomputation.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_MODEL, ObservationCounter, max_abs_rel, norm_rel, wrapped_model

from megatron_k3.parallel.recompute import Policy

LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5
KDA16 = ["model.kda_chunk_size=16"]  # KDA's tiles are whole chunks: 16-token chunks let 16- and 32-token tiles cut KDA


def _kda_inputs(B, T, N=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    H, HV, K, V = 2, 4, 8, 6
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1) for _ in range(2))
    x = dict(q=q, k=k, v=torch.randn(B, T, HV, V, generator=g), g=-5 * torch.rand(B, T, HV, K, generator=g),
             beta=torch.rand(B, T, HV, generator=g))
    return x, torch.randn(N or B, HV, K, V, generator=g)


def _kda_run(fn, x, **kw):
    """Output, final state (if any) and the gradients of every input, under fixed random cotangents."""
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, S = fn(**leaves, **kw)
    g = torch.Generator().manual_seed(9)
    loss = (o * torch.randn(o.shape, generator=g)).sum()
    if S is not None:
        loss = loss + (S * torch.randn(S.shape, generator=g)).sum()
    loss.backward()
    return [o.detach()] + ([] if S is None else [S.detach()]) + [t.grad for t in leaves.values()]


def _kda_cases():
    x, init = _kda_inputs(2, 200)
    seq_idx = torch.sort(torch.randint(0, 5, (2, 200), generator=torch.Generator().manual_seed(3)), dim=1).values
    x1, init1 = _kda_inputs(1, 200, N=6)
    cu = torch.tensor([0, 5, 5, 70, 71, 150, 200])  # an empty document, one of length 1, pieces cut by tiles
    return [("rows", x, {}), ("rows, states", x, dict(initial_state=init, output_final_state=True)),
            ("seq_idx", x, dict(seq_idx=seq_idx)),
            ("cu_seqlens, states", x1, dict(cu_seqlens=cu, initial_state=init1, output_final_state=True))]


@pytest.mark.parametrize("tile", [16, 64])
def test_tiled_kda_follows_the_untiled_kernel_and_keeps_one_tile_of_chunk_terms(tile):
    """KDA's delta rule over sequence tiles (tiling.tiled_kda; fp32, 16-token chunks, T = 200, so the last tile is
    short and padded): rows with and without states and seq_idx documents are bit for bit the untiled kernel (the
    same chunks, the state handed over between tiles as between chunks); under cu_seqlens a document a tile cuts is
    chunked again from the cut, so it agrees to fp32 rounding (1e-6 of the largest element; measured <= 5e-7).
    The live chunk terms at T = 2048 shrink with the tile (planning.measure's live-tensor peak of a forward and
    backward: tiled below 0.6 of untiled at 256-token tiles)."""
    from megatron_k3.ops.kda import chunk_kda
    from megatron_k3.parallel.tiling import tiled_kda

    for label, x, kw in _kda_cases():
        ref = _kda_run(chunk_kda, x, chunk_size=16, **kw)
        got = _kda_run(tiled_kda(chunk_kda, tile), x, chunk_size=16, **kw)
        exact = "cu_seqlens" not in label
        for a, b in zip(got, ref):
            assert torch.equal(a, b) if exact else max_abs_rel(a, b) < 1e-6, label
    if tile == 64:
        from megatron_k3.planning.measure import LiveTensorMemory

        x, _ = _kda_inputs(1, 2048, seed=1)
        peaks = []
        for fn in (chunk_kda, tiled_kda(chunk_kda, 256)):
            with LiveTensorMemory() as mem:
                mem.track_all(x.values())
                _kda_run(fn, x, chunk_size=64)
            peaks.append(mem.peak)
        assert peaks[1] < 0.6 * peaks[0], peaks


def _step(policy: Policy, tile: int = 0, extra=()):
    from megatron_k3.model.moe import StableLatentMoE

    model, cfg, _ = wrapped_model(TINY_MODEL + list(extra), policy, tile)
    counter = ObservationCounter()
    moes = [m for m in model.modules() if isinstance(m, StableLatentMoE)]
    for m in moes:
        m.balance = counter
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=g)
    labels = torch.where(torch.rand(2, 64, generator=g) < 0.1, -100, ids)  # some ignored tokens
    out = model(ids, labels=labels)
    loads = [m.tokens_per_expert_E.clone() for m in moes]
    off = getattr(model, "host_offload", None)
    during = None if off is None else (off.used, off.kept_on_device)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, (counter.calls, counter.rows), loads, during, off


def test_a_tile_of_at_least_the_tokens_runs_untiled():
    """128 tokens on the device: a 128- or 200-token tile is one tile, which runs as untiled does, bit for bit (as
    the planner counts it: memory.tile_shares caps the share at 1)."""
    loss, grads, *_ = _step(Policy("none"))
    for tile in (128, 200):
        t_loss, t_grads, *_ = _step(Policy("none"), tile)
        assert torch.equal(t_loss, loss) and all(torch.equal(t_grads[n], g) for n, g in grads.items()), tile


@pytest.mark.parametrize("policy", [Policy("none"), Policy("selective"), Policy("full")], ids=lambda p: p.name)
@pytest.mark.parametrize("tile", [16, 32])
def test_tiled_equals_untiled_to_rounding(policy, tile):
    loss, grads, observed, loads, *_ = _step(policy, 0, KDA16)
    t_loss, t_grads, t_observed, t_loads, *_ = _step(policy, tile, KDA16)
    assert abs(t_loss - loss) <= LOSS_RTOL * abs(loss)
    assert t_grads.keys() == grads.keys()
    worst = max(max_abs_rel(t_grads[n], g) for n, g in grads.items())
    assert worst < GRAD_RTOL, worst
    assert t_observed == observed == (3, 3 * 128)  # once per MoE layer, all 128 rows
    assert all(torch.equal(a, b) for a, b in zip(t_loads, loads))


@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "to_the_end"])
def test_a_recomputed_tiled_pass_records_nothing(early_stop):
    """Full recomputation runs a tiled MoE block again in the backward: the load counts and dropped assignments the
    step reads after the backward are the forward's, and the routers are observed once, whether torch's checkpoint
    stops recomputing early (its default) or runs the recomputation to the end (until 2026-12-06 a tiled block
    recomputed to the end added the forward's totals once per tile: 8x the loads at 8 tiles)."""
    from megatron_k3.model.moe import StableLatentMoE

    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        model, cfg, _ = wrapped_model(TINY_MODEL, Policy("full"), 16)
        counter = ObservationCounter()
        moes = [m for m in model.modules() if isinstance(m, StableLatentMoE)]
        for m in moes:
            m.balance = counter
        ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
        out = model(ids, labels=ids)
        recorded = [(m.tokens_per_expert_E.clone(), m.dropped_assignments.clone()) for m in moes]
        out.loss.backward()
    assert all(torch.equal(m.tokens_per_expert_E, loads) and torch.equal(m.dropped_assignments, dropped)
               for m, (loads, dropped) in zip(moes, recorded))
    assert all(int(loads.sum()) == 128 * cfg.top_k for loads, _ in recorded)
    assert (counter.calls, counter.rows) == (3, 3 * 128)


def _bf16_grads(tile: int, dtype=None):
    """Gradients of a 512-token row with the weights in bf16 (DeepSpeed's bf16 mode, precision=bf16 and mx_qat) under
    bf16 autocast, or every tensor in `dtype` (float64: the reference of the same bf16 weights)."""
    model, cfg, _ = wrapped_model(TINY_MODEL + KDA16, Policy("none"), tile)
    model.to(torch.bfloat16).to(dtype or torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, 512), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is None):
        model(ids, labels=ids).loss.backward()
    return {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_tiled_bf16_weight_gradients_lose_little_to_their_sums_over_the_tiles():
    """With bf16 weights the tiles' weight gradients are summed in bf16, the weights' dtype (autograd's input buffer;
    DeepSpeed's TiledMLP too), not fp32: each tiled block's gradient (the MoE blocks', the LM head's) is within 1.1x
    untiled's error against an fp64 run of the same weights. Measured: 1.01x at 8 tiles, 1.03x at 32 and 1.10x at
    128 (2048 tokens); the bf16 forward's own error, 3e-2, dominates. A lost tile (one MoE tile's output detached)
    measured 11x."""
    ref, untiled, tiled = _bf16_grads(0, torch.float64), _bf16_grads(0), _bf16_grads(64)
    blocks = [n for n in ref if (".mlp." in n and not n.startswith("model.layers.0.")) or n.startswith("lm_head")]
    assert len(blocks) > 10 and all(ref[n].norm() > 0 for n in blocks)
    ratios = {n: norm_rel(tiled[n], ref[n]) / norm_rel(untiled[n], ref[n]) for n in blocks}
    assert max(ratios.values()) < 1.1, sorted(ratios.items(), key=lambda kv: -kv[1])[:4]


def test_offload_is_bit_identical_to_full_and_releases_its_host_memory():
    loss, grads, observed, *_ = _step(Policy("full"))
    for budget in (10**9, 20_000):  # room for everything; room for nothing (each input is 32 KB)
        o_loss, o_grads, o_observed, _, (used, on_device), off = _step(Policy("full", offload_bytes=budget))
        assert torch.equal(o_loss, loss) and o_observed == observed
        assert all(torch.equal(o_grads[n], g) for n, g in grads.items()), budget
        # the embedding and 2 completed blocks (read by every later layer) and the 4 layers' running partial sums
        # are 4 distinct [2, 64, 64] fp32 tensors of 32 KB: each held once
        held = 4 * 2 * 64 * 64 * 4
        assert (used, on_device) == ((held, 0) if budget > held else (0, held)), (budget, used, on_device)
        assert off.used == 0 and not off._by_storage  # all read back and released by the backward


class DeferredCopies:
    """Stands in for CUDA's asynchronous copies (parallel.offload.CudaCopies) on the CPU, adversarially: each copy is
    queued on its side stream (down: to the host, up: to the device) and runs only when an event after it is waited
    for, each stream in its order and after the events it was told to wait for; a device copy holds NaN until its copy
    has run. So a read that does not wait for its copy's event finds NaN, and a copy back that does not wait for the
    copy down reads the host buffer's earlier contents. `skip`: the waits this stand-in leaves out (to show that the
    test sees them missing)."""

    pinned = False

    def __init__(self, skip=()):
        self.queues, self.skip = {"down": [], "up": []}, set(skip)
        self.loads_queued = 0  # the most copies to the device queued at a read (the read's own and prefetches)

    @staticmethod
    def serves(device):
        return True

    def _queue(self, stream, after, action):
        event = type("Event", (), {"done": False, "stream": stream})()
        self.queues[stream].append((None if stream in self.skip else after, action, event))
        return event

    def down(self, t, host, after):
        return self._queue("down", after, lambda: host.copy_(t))

    def up(self, host, device, after):
        back = torch.full(host.shape, float("nan"), dtype=host.dtype, device=device)
        return back, self._queue("up", after, lambda: back.copy_(host))

    def use(self, t, event):
        self.loads_queued = max(self.loads_queued, len(self.queues["up"]))
        if "use" not in self.skip:
            self.wait(event)

    def wait(self, event):
        while event is not None and not event.done:
            after, action, done = self.queues[event.stream].pop(0)
            self.wait(after)
            action()
            done.done = True

    def flush(self):
        for queue in self.queues.values():
            while queue:
                self.wait(queue[-1][2])


def _offload_steps(budget, copies=None):
    """Two micro-batches' forwards, then their backwards (as 1F1B holds them), a forward whose backward never runs (the
    trainer's reset at the next step's start gives its buffers back), then another step: (the gradients of the two
    steps, [host buffers, bytes held] after the first, the HostOffload; None without offload)."""
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 8192, (2, 64), generator=g) for _ in range(2)]
    model, _, _ = wrapped_model(TINY_MODEL, Policy("full", offload_bytes=budget))
    off, grads = getattr(model, "host_offload", None), []
    if copies is not None:
        off.copies = copies
    outs = [model(ids, labels=ids) for ids in batches]
    for out in outs:
        out.loss.backward()
    grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    sizes = None if off is None else [off.allocated, off.used]
    model(batches[0], labels=batches[0])  # no backward
    if off is not None:
        off.reset()
    model.zero_grad(set_to_none=True)
    model(batches[1], labels=batches[1]).loss.backward()
    grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return grads, sizes, off


@functools.cache
def _full_steps():
    """_offload_steps' gradients under full recomputation without offload: the reference of the offload tests (made
    once per process; read only)."""
    return _offload_steps(0)[0]


def test_offload_reuses_its_host_buffers_within_the_budget():
    """The host copies live in buffers of exactly a tensor's size, made as first needed and reused (_offload_steps):
    the buffers come to the most held at once, not the sum over the steps; a budget of 3.5 tensors keeps the fourth on
    the device. Every gradient bit for bit full recomputation's."""
    one = 2 * 64 * 64 * 4  # a [2, 64, 64] fp32 layer input; 4 distinct per micro-batch (b0, 2 blocks, partials)
    ref = _full_steps()
    # 3.5 tensors: the first micro-batch's fourth input and all the second's stay on the device, then one input of
    # each later forward: 7 in all
    for budget, allocated, on_device in ((10**9, 8 * one, 0), (3.5 * one, 3 * one, 7 * one)):
        grads, sizes, off = _offload_steps(int(budget))
        assert all(torch.equal(a[n], b[n]) for a, b in zip(grads, ref) for n in b), budget
        assert sizes == [allocated, 0] and off.allocated == allocated <= budget, (budget, sizes, off.allocated)
        assert off.kept_on_device == on_device, (budget, off.kept_on_device)


@pytest.mark.parametrize("budget", [10**9, 3.5 * 2 * 64 * 64 * 4], ids=["room_for_all", "room_for_3.5"])
def test_asynchronous_offload_waits_for_each_copy(budget):
    """The asynchronous path (CUDA's, parallel.offload.CudaCopies) with copies that run as late as their events allow
    (DeferredCopies): bit for bit full recomputation's over _offload_steps, with loads still queued while the
    backward ran on (the prefetch). Without the wait before a loaded tensor is read, or without the copy back waiting
    for the copy down, the same steps come out wrong (so the stand-in would see either missing)."""
    ref = _full_steps()
    copies = DeferredCopies()
    grads, _, off = _offload_steps(int(budget), copies)
    assert all(torch.equal(a[n], b[n]) for a, b in zip(grads, ref) for n in b), budget
    assert copies.loads_queued > 1 and off.used == 0, copies.loads_queued  # others than the read's own queued
    copies.flush()
    for skip in ("use", "up"):
        grads, _, _ = _offload_steps(int(budget), DeferredCopies(skip=[skip]))
        assert not all(torch.equal(a[n], b[n]) for a, b in zip(grads, ref) for n in b), skip


class _ModelStream:
    """A CUDA stream in a model of CUDA's semantics, for CudaCopies' own code on the CPU (_CudaModel): a side stream
    queues its work and runs it only when something waits for an event after it (as late as CUDA allows); the
    compute stream (eager) runs at once. `keep`: tensors record_stream holds until the stream has run past them."""

    def __init__(self, device=None, eager=False):
        self.eager, self.ops, self.done, self.keep = eager, [], 0, []

    def enqueue(self, op):
        op() if self.eager else self.ops.append(op)

    def run_until(self, pos):
        while self.done < pos:
            self.done += 1
            self.ops[self.done - 1]()
        self.keep = [(p, t) for p, t in self.keep if p > self.done]

    def wait_event(self, event):
        if event.stream is not None:  # an event never recorded: nothing to wait for, as on CUDA
            stream, pos = event.stream, event.pos
            self.enqueue(lambda: stream.run_until(pos))

    def wait_stream(self, other):
        event = _ModelEvent()
        event.record(other)
        self.wait_event(event)


class _ModelEvent:
    def __init__(self, *args, **kwargs):
        self.stream, self.pos = None, 0

    def record(self, stream):
        self.stream, self.pos = stream, len(stream.ops)

    def synchronize(self):
        if self.stream is not None:
            self.stream.run_until(self.pos)


class _CudaModel(torch.overrides.TorchFunctionMode):
    """torch.cuda's streams, events, driver and Tensor.record_stream as _ModelStream models them (installed with
    monkeypatch). Under a side stream, a copy is queued: a device copy holds NaN until it has run (a read that did not
    wait finds NaN), and a queued copy holds its source weakly, as the caching allocator does without record_stream
    (a source freed first is a read after free, noted in `faults`). What it cannot see: a missing wait of a side
    stream for the compute stream (the compute stream has always run)."""

    def __init__(self, monkeypatch):
        super().__init__()
        from megatron_k3.parallel.offload import CudaCopies

        self.compute, self.current, self.faults, self.streams = _ModelStream(eager=True), [], [], []
        driver = type("cudart", (), {"cudaHostRegister": lambda *a: 0, "cudaHostUnregister": lambda *a: 0})()

        def stream(*args, **kwargs):
            self.streams.append(_ModelStream())
            return self.streams[-1]
        for name, value in (("Stream", stream), ("Event", _ModelEvent), ("cudart", lambda: driver),
                            ("current_stream", lambda device=None: self.current[-1] if self.current else self.compute),
                            ("stream", self.side)):
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: s.keep.append((len(s.ops), t)))
        monkeypatch.setattr(CudaCopies, "serves", staticmethod(lambda device: True))

    @contextlib.contextmanager
    def side(self, stream):
        self.current.append(stream)
        try:
            with self:
                yield
        finally:
            self.current.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            dst, src = args[0], weakref.ref(args[1])  # the host buffers' lifetimes are HostOffload's (_drop waits)
            self.current[-1].enqueue(lambda: self._copy(dst, src()))
            return args[0]
        if func is torch.Tensor.to:
            out = torch.full(args[0].shape, float("nan"), dtype=args[0].dtype)
            self.current[-1].enqueue(lambda src=args[0]: self._copy(out, src))
            return out
        return func(*args, **(kwargs or {}))

    def _copy(self, dst, src):
        if src is None:
            self.faults.append("a queued copy ran after its source was freed")
        else:
            with torch.no_grad():
                dst.copy_(src)

    def flush(self):
        for s in self.streams:
            s.run_until(len(s.ops))


@pytest.mark.parametrize("budget,fault", [(10**9, None), (3.5 * 2 * 64 * 64 * 4, None), (10**9, "record_stream"),
                                          (10**9, "use"), (10**9, "up")],
                         ids=["room_for_all", "room_for_3.5", "no_record_stream", "no_use_wait", "no_up_wait"])
def test_cuda_copies_under_a_model_of_cuda_streams(monkeypatch, budget, fault):
    """CudaCopies' own code (the CUDA path: side streams, events, record_stream, registered buffers), run on the CPU
    under _CudaModel: bit for bit full recomputation's over _offload_steps, no copy reads freed memory. With one of its
    protections taken out (`fault`: the source's record_stream, the read's wait for its load, the load's wait for the
    copy down) the same steps read freed memory or come out wrong: the model sees each missing."""
    from megatron_k3.parallel.offload import CudaCopies

    ref = _full_steps()
    cuda = _CudaModel(monkeypatch)
    if fault == "record_stream":
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: None)
    if fault == "use":
        monkeypatch.setattr(CudaCopies, "use", staticmethod(lambda t, event: None))
    if fault == "up":
        up = CudaCopies.up
        monkeypatch.setattr(CudaCopies, "up", lambda self, host, device, after: up(self, host, device, _ModelEvent()))
    grads, _, off = _offload_steps(int(budget), CudaCopies())
    cuda.flush()
    right = all(torch.equal(a[n], b[n]) for a, b in zip(grads, ref) for n in b)
    assert (right and not cuda.faults) == (fault is None), (fault, right, cuda.faults[:1])
    assert fault is not None or (off.used == 0 and len(cuda.streams) == 2), (off.used, len(cuda.streams))
    off._free.clear()
    del off, grads
    gc.collect()  # the registered buffers unregistered while the model's driver is in place


def test_offload_prefetches_past_layers_whose_inputs_stayed_on_the_device():
    """With room for half the layer inputs (without AttnRes: each layer's residual stream), the last three layers'
    stay on the device; reading the first of them starts loading the inputs of the layer before (offloaded): every
    offloaded input is loaded before the read that needs it. Bit for bit full recomputation's."""
    shape = ["model.num_layers=6", "model.hidden_size=64", "model.dense_intermediate_size=128", "model.attn_res=false"]
    ids = torch.randint(0, 8192, (2, 64), generator=torch.Generator().manual_seed(4))
    grads, misses = [], []
    for budget in (0, 3 * 2 * 64 * 64 * 4):
        model, _, _ = wrapped_model(shape, Policy("full", offload_bytes=budget))
        off = getattr(model, "host_offload", None)
        if off is not None:
            def unpack(packed, _unpack=off.unpack):
                misses.append(not packed[1].on_device and packed[1].back is None)
                return _unpack(packed)
            off.unpack = unpack
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert all(torch.equal(grads[1][n], g) for n, g in grads[0].items())
    assert off.kept_on_device == 3 * 2 * 64 * 64 * 4 and len(misses) == 6 and not any(misses), misses


def test_offload_drops_idle_buffers_of_another_size_for_room():
    """A tensor of a new size takes a new buffer; if the budget has no room, idle buffers of other sizes go first;
    the values come back exact; a reused buffer holds the new tensor's values."""
    from megatron_k3.parallel.offload import HostOffload

    off = HostOffload(400)
    for n in (50, 60, 60, 30):  # fp32: 200, 240, 240 (the 240 buffer again), 120 bytes
        t = torch.randn(n)
        (packed,) = off.pack_layer([t])
        assert torch.equal(off.unpack(packed), t)
    assert off.allocated == 360 and sorted(off._free) == [120, 200, 240] and not off._free[200], off._free
    off.release_idle()  # every idle buffer freed: the next tensor takes a new one
    assert off.allocated == 0 and not any(off._free.values())
    t = torch.randn(60)
    (packed,) = off.pack_layer([t])
    assert off.allocated == 240 and torch.equal(off.unpack(packed), t)



@pytest.mark.parametrize("skip", [(), ("down",)], ids=["waits", "down_skips_its_wait"])
def test_a_reused_host_buffer_is_written_after_its_pending_copy_back_has_read_it(skip):
    """Asynchronous offload (DeferredCopies): layer 1's read loads its input and starts loading layer 0's (the
    prefetch), which reset() then discards unread; its host buffer goes back with that load still queued, and the
    next tensor packed takes it. Its copy down must wait for the queued load: the discarded load still reads layer
    0's values, and the new tensor comes back exact. Without that wait the load reads the new tensor's values."""
    from megatron_k3.parallel.offload import HostOffload

    copies = DeferredCopies(skip=skip)
    off = HostOffload(10**6, copies=copies)
    a, b, c = (torch.randn(64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    (pa,), (pb,) = off.pack_layer([a]), off.pack_layer([b])
    assert torch.equal(off.unpack(pb), b) and pa[1].back is not None and copies.queues["up"]  # a's load queued
    a_host, a_back = pa[1].host.data_ptr(), pa[1].back
    off.reset()
    with pytest.raises(RuntimeError, match="after HostOffload.reset"):  # a handle kept past the reset reads nothing
        off.unpack(pa)
    (pc,) = off.pack_layer([c])
    assert pc[1].buffer is not None and pc[1].host.data_ptr() == a_host  # a's buffer, reused
    copies.flush()
    assert torch.equal(a_back, a) != bool(skip), skip
    assert torch.equal(off.unpack(pc), c)

def test_pinned_offload_buffers_are_whole_registered_pages(monkeypatch):
    """CUDA's host buffers (here with the driver's registration stood in for: no GPU on this machine): each is
    registered once, page-aligned and whole pages, no two sharing a page, within the budget counted in those pages;
    unregistered when dropped; the tensor's view starts at the registered address."""
    import gc

    from megatron_k3.parallel import offload

    calls = []
    fake = type("cudart", (), {"cudaHostRegister": lambda self, p, n, f: calls.append(("reg", p, n)) or 0,
                               "cudaHostUnregister": lambda self, p: calls.append(("unreg", p)) or 0})()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    off = offload.HostOffload(3 * 8192)
    bufs = [off._take(n, pinned=True) for n in (5000, 5000, 8192, 100)]
    assert bufs[-1] is None and off.allocated == 3 * 8192 == sum(b.size for b in bufs[:3])
    regs = [(p, n) for kind, p, n in calls]
    assert all(p % 4096 == 0 and n % 4096 == 0 for p, n in regs) and [n for _, n in regs] == [8192, 8192, 8192]
    spans = sorted(regs)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert [b.data.data_ptr() for b in bufs[:3]] == [p for p, _ in regs]
    assert bufs[0].view((1250,), torch.float32).shape == (1250,)
    del bufs
    gc.collect()
    assert sorted(p for kind, p, *_ in calls if kind == "unreg") == sorted(p for p, _ in regs)


def test_a_pinned_buffer_dropped_for_room_waits_for_its_last_copy(monkeypatch):
    """CUDA (the driver and the copy's event stood in for): an idle buffer dropped to make room for another size is
    unregistered and freed only after the event of its last copy (back to the device, or into it) has passed; a
    reused one is not waited for here (the next copy into it waits on its stream)."""
    import gc

    from megatron_k3.parallel import offload

    calls = []
    fake = type("cudart", (), {"cudaHostRegister": lambda self, p, n, f: calls.append("reg") or 0,
                               "cudaHostUnregister": lambda self, p: calls.append("unreg") or 0})()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    event = type("Event", (), {"synchronize": lambda self: calls.append("sync")})
    off = offload.HostOffload(8192)

    def take_and_give_back(n):
        buf = off._take(n, pinned=True)
        buf.ready = event()
        off._free.setdefault(n, []).append(buf)

    for n in (5000, 5000, 100):  # a new buffer, the same one reused, then one of another size: no room
        take_and_give_back(n)
    assert calls == ["reg", "sync", "unreg", "reg"], calls
    assert off.allocated == 4096 and not off._free[5000]
    off._free.clear()
    gc.collect()  # unregistered while the stand-in driver is in place


@pytest.mark.parametrize("layers,block,num_layers", [(4, 2, 0), (8, 2, 0), (6, 1, 0), (6, 6, 0), (7, 3, 5), (5, 0, 0)],
                         ids=["4x2", "8x2", "6x1", "6x6", "7x3_first5", "5_no_attn_res"])
def test_offload_loads_back_what_the_planner_counts(layers, block, num_layers):
    """The backward's first read of a layer's offloaded inputs loads them all and starts loading the next layer's
    (the one packed before): every read but the first finds its tensor loaded already; what is loaded back at once
    (the completed blocks a layer reads, its partial sum and the next layer's) and what the first read waits for (the
    last offloaded layer's inputs) are the planner's figures (planning.memory), exactly; bit for bit equal to full
    recomputation."""
    from megatron_k3.planning.memory import Layout, Workload, _offload_reload_bytes, offload_first_load_bytes

    shape = [f"model.num_layers={layers}", "model.hidden_size=64", "model.dense_intermediate_size=128"]
    shape += [f"model.attn_res_block_size={block}"] if block else ["model.attn_res=false"]
    results = []
    for budget in (0, 10**9):
        model, cfg, _ = wrapped_model(shape, Policy("full", num_layers=num_layers, offload_bytes=budget))
        ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
        off, misses, first = getattr(model, "host_offload", None), [], []
        if off is not None:
            def unpack(packed, _unpack=off.unpack, _off=off, _misses=misses, _first=first):
                _misses.append(packed[1].back is None)
                _first.extend([] if _first else [{id(h): h.nbytes for _, h in _off._layers[packed[2]]}])
                return _unpack(packed)
            off.unpack = unpack
        model(ids, labels=ids).loss.backward()
        results.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert all(torch.equal(results[1][n], g) for n, g in results[0].items())
    assert sum(misses) == 1 and misses[0] and len(misses) >= (num_layers or layers), misses
    lay = Layout(world=1, recompute="full", recompute_num_layers=num_layers, offload_bytes=10**9)
    w = Workload(64, 2, 2, "fp32")
    planned = _offload_reload_bytes(cfg, lay, w, 0, num_layers or layers, float("inf"))
    assert off.reload_peak == planned > 0 and off.reloaded == 0, (off.reload_peak, planned)
    assert sum(first[0].values()) == offload_first_load_bytes(cfg, lay, w, 0, layers, float("inf")) > 0


def test_a_memory_measurement_counts_the_offloaded_copies_as_host_memory():
    """planning.measure.LiveTensorMemory with the offload's host_context (as tools/build_rank.py --step and
    bench/recompute.py set it): the host copies are counted apart (host_peak = the offload's own peak, the 4 held
    inputs), so the device peak falls below full recomputation's; full alone has no host memory."""
    from megatron_k3.planning.measure import LiveTensorMemory

    peaks = {}
    for budget in (0, 10**9):
        model, cfg, _ = wrapped_model(TINY_MODEL, Policy("full", offload_bytes=budget))
        ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
        tracker = LiveTensorMemory()
        off = getattr(model, "host_offload", None)
        if off is not None:
            off.host_context = tracker.host_allocations
        with tracker:
            model(ids, labels=ids).loss.backward()
        peaks[budget] = (tracker.peak, tracker.host_peak, None if off is None else off.peak)
    assert peaks[0][1:] == (0, None)
    assert peaks[10**9][1] == peaks[10**9][2] == 4 * 2 * 64 * 64 * 4
    assert peaks[10**9][0] < peaks[0][0], peaks


def test_bad_tiling_and_offload_name_the_key():
    """The config's layout check (every rank, before anything is built) names train.tile_tokens, the tokens it must
    divide and the nearest tile sizes that work; the tiled forward refuses the same as a backstop."""
    from megatron_k3.config import ConfigError, compose_config

    seq = ["train.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=2"]
    for overrides, world, message in (
            (["train.tile_tokens=48"], 1, r"=48: does not divide the 128 tokens a MoE layer .* are 32 and 64;"),
            (["train.tile_tokens=48", "parallel.cp=2"], 2, r"=48: does not divide the 64 tokens a MoE .* are 32 and "
                                                           r"64;"),
            (["train.tile_tokens=24", "parallel.tp=2", "parallel.sequence_parallel=true"], 2,
             r"=24: does not divide the 64 tokens a MoE layer .* 64 per TP rank .* are 16 and 32;"),
            (["train.tile_tokens=96", "parallel.tp=2", "parallel.sequence_parallel=true"], 2,
             r"=96: does not divide the 128 tokens the LM head .* are 64 and 128;"),
            (["train.tile_tokens=1", "parallel.tp=2", "parallel.sequence_parallel=false"], 2,
             r"=1: a MoE tile's rows are routed 1/tp per TP rank.* are 2;"),
            (["train.tile_tokens=32", "model.moe_overflow=drop"], 1,
             r"=32: does not run with model\.moe_overflow=drop")):
        run, _, _ = compose_config(seq + overrides)
        with pytest.raises(ConfigError, match=r"train\.tile_tokens" + message):
            run.validate(world)
    for ok in ("train.tile_tokens=64", "train.tile_tokens=128", "train.tile_tokens=4096"):
        compose_config(seq + [ok])[0].validate()
    with pytest.raises(ConfigError, match=r"train\.tile_tokens=48.*does not divide the 128 tokens"):
        _step(Policy("none"), 48)
    with pytest.raises(ConfigError, match=r"train\.tile_tokens=32.*moe_overflow=drop"):
        _step(Policy("none"), 32, ["model.moe_overflow=drop"])
    for overrides, key in ((["train.offload_buffer_gb=4"], "train.offload_buffer_gb"),
                           (["train.recompute=full", "train.offload_buffer_gb=-1"], "train.offload_buffer_gb"),
                           (["train.tile_tokens=-8"], "train.tile_tokens")):
        run, _, _ = compose_config(overrides)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            run.validate()
    # more than the device's share of the node's host memory (cluster=cpu: 24 GB, 1 device)
    with pytest.raises(ConfigError, match=r"train\.offload_buffer_gb=25\.0: .*cluster\.host_memory_gb=24 .* 24 GB per "
                                          r"device, at most"):
        compose_config(["train.recompute=full", "train.offload_buffer_gb=25"])[0].validate()
    compose_config(["train.recompute=full", "train.offload_buffer_gb=24"])[0].validate()



def _accumulations(tile: int) -> tuple:
    """One forward and backward of TINY_MODEL at `tile`: (how many times each parameter of the MoE blocks and the LM
    head had its gradient accumulated, as a set; the expert weight-gradient GEMMs run; the model; the MoE layers)."""
    from megatron_k3.model.moe import StableLatentMoE
    from megatron_k3.ops import grouped_gemm

    model, cfg, _ = wrapped_model(TINY_MODEL, Policy("none"), tile)
    moes = [m for m in model.modules() if isinstance(m, StableLatentMoE)]
    watched = [p for m in moes for p in m.parameters()] + list(model.lm_head.parameters())
    fired = {id(p): 0 for p in watched}

    def accumulated(p):
        fired[id(p)] += 1

    def counted(*args):
        fired["wgrad"] += 1
        return real(*args)

    hooks = [p.register_post_accumulate_grad_hook(accumulated) for p in watched]
    fired["wgrad"], real = 0, grouped_gemm.wgrad_mm
    grouped_gemm.wgrad_mm = counted
    try:
        ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
        model(ids, labels=ids).loss.backward()
    finally:
        grouped_gemm.wgrad_mm = real
        for h in hooks:
            h.remove()
    wgrads = fired.pop("wgrad")
    return set(fired.values()), wgrads, model, moes


def test_a_tiled_block_sums_its_weight_gradients_over_the_tiles_as_the_planner_counts():
    """Every tile of a MoE block (and of the LM head) runs the same weights, so autograd adds the tiles' weight
    gradients in its input buffer and accumulates each parameter's once, after the block's last tile: 4 tiles
    compute 4 expert weight gradients per MoE layer and weight, one accumulation follows. That buffered sum, one copy
    of the block's weights in their dtype, is live through the block's backward; planning.memory's
    expert_workspace_bytes counts it beside the experts' [w1; w3] concatenation (checked by hand here; measured at full
    width in docs/scale.md)."""
    from megatron_k3.config import compose_config
    from megatron_k3.planning.candidates import Layout
    from megatron_k3.planning.memory import expert_workspace_bytes
    from megatron_k3.planning.params import model_params
    from megatron_k3.planning.run import workload

    once, untiled_wgrads, _, _ = _accumulations(0)
    tiled_once, tiled_wgrads, model, moes = _accumulations(32)
    assert once == tiled_once == {1}  # one accumulation per parameter and backward, tiled or not
    assert tiled_wgrads == 4 * untiled_wgrads == 4 * 3 * len(moes)  # w1, w3, w2 of each MoE layer, per tile
    # the planner: the [w1; w3] concatenation (2/3 of the rank's experts), and tiled the block's weights once more
    run = compose_config(TINY_MODEL + ["train.seq_length=128", "train.micro_batch_size=1"])[0]
    cfg, w = run.model, workload(run)
    mp = model_params(cfg)
    moe_layers = [i for i, f in enumerate(cfg.ffn_types()) if f == "moe"]
    block = {i: sum(p.numel() for n, p in model.model.layers[i].mlp.named_parameters() if not n.startswith("experts."))
             for i in moe_layers}
    assert all(mp.layers[i].moe_dense == block[i] for i in moe_layers)
    experts = mp.layers[moe_layers[0]].experts.total
    untiled = expert_workspace_bytes(cfg, Layout(world=1), w, mp, moe_layers, None)
    tiled = expert_workspace_bytes(cfg, Layout(world=1, tile_tokens=32), w, mp, moe_layers, None)
    assert untiled == pytest.approx(2 / 3 * experts * w.weight_bytes)
    assert tiled - untiled == pytest.approx((experts + block[moe_layers[0]]) * w.weight_bytes)


def _cp_masked_share(rank, world, tile):
    """cp2, tiled as train.tile_tokens does: the loss and gradients of a 64-token row whose middle half, rank 1's
    zigzag share, carries no label (a chat's long prompt)."""
    from megatron_k3.config import compose_config
    from megatron_k3.model import K3ForCausalLM
    from megatron_k3.parallel import ParallelGroups, parallelize, state, tiling

    ps = state.initialize_model_parallel(cp=world)
    try:
        run = compose_config(TINY_MODEL)[0]
        torch.manual_seed(0)
        model = parallelize(K3ForCausalLM(run.model), ParallelGroups.from_state(ps, False))
        tiling.apply(model, tile, run.model.moe_overflow)
        ids = torch.randint(0, run.model.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
        labels = ids.clone()
        labels[:, 16:48] = -100
        out = model(ids, labels=labels)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        state.destroy_model_parallel()


@pytest.mark.slow
def test_tiled_head_under_context_parallelism_with_a_share_without_labels():
    """A CP rank whose share has no label adds nothing to the loss, tiled as untiled (the tiled head once divided its
    tiles' sum by the share's count, 0: a NaN loss on every rank, which a train.guard policy withholds as
    non-finite)."""
    from dist_utils import run_distributed

    untiled = run_distributed(_cp_masked_share, 2, 0, timeout=300)
    tiled = run_distributed(_cp_masked_share, 2, 16, timeout=300)
    for (loss, grads), (t_loss, t_grads) in zip(untiled, tiled):
        assert torch.isfinite(loss) and abs(t_loss - loss) <= LOSS_RTOL * abs(loss), (t_loss, loss)
        assert t_grads.keys() == grads.keys()
        assert max(max_abs_rel(t_grads[n], g) for n, g in grads.items()) < GRAD_RTOL
