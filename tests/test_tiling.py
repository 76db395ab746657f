"""Sequence tiling of the per-token parts (train.tile_tokens, megatron_k3.parallel.tiling) and activation offload
(train.offload_buffer_gb, megatron_k3.parallel.offload).

- Tiling, one process: the loss within 1e-6 and every gradient within 1e-5 (max |diff| / max |ref| per tensor) of
  untiled, under none, selective and full recomputation. Why not bit for bit: the tiles' loss means are added
  weighted by their token counts, the weight gradients are sums over tokens added tile by tile, and the router's and
  experts' GEMMs take another code path for fewer rows (fp32 rounding; measured: the loss equal, the worst gradient
  2.1e-6 at 16-token tiles, KDA's A_log, whose gradient sums every token and channel of a head, 9e-7 at 32). The
  routers are observed once per micro-batch and MoE layer over all its rows, and the load counts are equal.
- Offload, one process: bit for bit equal to full recomputation (the host round trip copies values; the graph is
  full's), the completed AttnRes blocks held once however many layers read them, all host memory released by the
  backward, a budget too small keeps the inputs on the device and is still exact.
- The Trainer (tests/test_recompute.py, in its layout runs): tiled under tp2 + sequence parallelism, ep2 balanced
  and cp2 follows untiled as the layout tests follow one process; offloaded under pp2 bit for bit equal to none.
- Bad input names the key: a tile that does not divide the tokens, tiling with the drop dispatcher, offload without
  full recomputation.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_MODEL, ObservationCounter, max_abs_rel, wrapped_model

from megatron_k3.parallel.recompute import Policy

LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5


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


@pytest.mark.parametrize("policy", [Policy("none"), Policy("selective"), Policy("full")], ids=lambda p: p.name)
@pytest.mark.parametrize("tile", [16, 32])
def test_tiled_equals_untiled_to_rounding(policy, tile):
    loss, grads, observed, loads, *_ = _step(policy)
    t_loss, t_grads, t_observed, t_loads, *_ = _step(policy, tile)
    assert abs(t_loss - loss) <= LOSS_RTOL * abs(loss)
    assert t_grads.keys() == grads.keys()
    worst = max(max_abs_rel(t_grads[n], g) for n, g in grads.items())
    assert worst < GRAD_RTOL, worst
    assert t_observed == observed == (3, 3 * 128)  # once per MoE layer, all 128 rows
    assert all(torch.equal(a, b) for a, b in zip(t_loads, loads))


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


def test_bad_tiling_and_offload_name_the_key():
    from megatron_k3.config import ConfigError, compose_config

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

