"""On GPUs the collectives run on NCCL, which takes device tensors only: a host tensor handed to one raises ("No
backend type associated with device type cpu"). The test suite runs on gloo, where every tensor is a host tensor,
so nothing here would notice. A stand-in does: a function mode tags what our code makes on the host on purpose or
by omission (a factory without a device: torch.zeros(()), torch.tensor([...]); a .cpu() copy), untags what is sent
to a device (.to(device)), and every collective our package calls fails on a tagged tensor. It found three: the
routed experts' gradient norm under expert parallelism, DeepSpeed ZeRO-0's norm under tensor parallelism (both
summed over the group on the host), and the straggler report's all-gather. Tensors made from others (a sum, a
stack) are not tagged: the stand-in finds what a collective receives straight from such a factory or copy.

The same runs record every collective (ours and DeepSpeed's) with its group: each group's ranks must call them in
one order, with one shape and dtype where NCCL needs them equal (gloo may check what NCCL leaves undefined)."""

import inspect
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from dist_utils import run_distributed
from helpers import STATIC, make_trainer
from torch.overrides import TorchFunctionMode

PACKAGE = str(Path(__file__).resolve().parent.parent / "megatron_k3")
FAULTS = str(Path(PACKAGE) / "training" / "faults.py")
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor, torch.arange,
             torch.randn, torch.rand, torch.randint, torch.linspace, torch.eye}
SAME_PLACE = {torch.Tensor.to, torch.Tensor.double, torch.Tensor.float, torch.Tensor.clone, torch.Tensor.contiguous,
              torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten}
P2P = ("isend", "irecv")  # also what the pipeline's batched exchanges (dist.batch_isend_irecv) call
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
               "all_to_all_single", "all_to_all", "broadcast", "reduce", "gather", "scatter", "send", "recv", "isend",
               "irecv")


class HostTensors(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            if (func in FACTORIES and kwargs.get("device") is None) or func is torch.Tensor.cpu:
                out._host_made = True
            elif func is torch.Tensor.to and _names_a_device(args[1:], kwargs):
                out.__dict__.pop("_host_made", None)  # sent to the run's device (on the CPU: the same tensor)
            elif func in SAME_PLACE and getattr(args[0], "_host_made", False):
                out._host_made = True  # a copy or view where its input is
        return out


def _names_a_device(args, kwargs) -> bool:
    """Tensor.to(...)'s arguments name a device (not only a dtype)."""
    return kwargs.get("device") is not None or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _caller():
    """The frame that called the collective, past training.faults' wrapper (the Trainer wraps every collective)."""
    frame = sys._getframe(2)
    while frame.f_code.co_filename == FAULTS:
        frame = frame.f_back
    return frame


# the collectives whose tensors must have one shape and dtype on every rank of the group (the others: one dtype)
SAME_SHAPE = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "reduce")


def _group_ranks(fn, args, kwargs) -> tuple:
    group = kwargs.get("group", inspect.signature(fn).bind_partial(*args, **kwargs).arguments.get("group"))
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def _guarded(name, fn, found, calls):
    """`fn` that records a host tensor our package hands it (in `found`) and, for the collectives (not the
    point-to-point operations), what each call was: its group and its tensors' shapes and dtypes (in `calls`)."""
    def call(*args, **kwargs):
        frame = _caller()
        tensors = _tensors(list(args) + list(kwargs.values()))
        if frame.f_code.co_filename.startswith(PACKAGE) and any(getattr(t, "_host_made", False) for t in tensors):
            found.add(f"{name} at {Path(frame.f_code.co_filename).relative_to(PACKAGE)}:{frame.f_lineno}")
        if name not in P2P + ("send", "recv"):
            where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
            what = [(tuple(t.shape), t.dtype) if name in SAME_SHAPE else t.dtype for t in tensors]
            calls.append((_group_ranks(fn, args, kwargs), name, str(what), where))
        return fn(*args, **kwargs)
    return call


def test_the_stand_in_tags_host_tensors_and_untags_device_ones():
    with HostTensors():
        a, b = torch.zeros(()), torch.zeros((), device="cpu")
        c, d = torch.ones(3).cpu(), torch.tensor([1.0]).to(torch.device("cpu"))
        e = torch.zeros(2)
        e += 1  # in place: the same host tensor
        f = torch.zeros(2).to(torch.float64)  # a dtype only: still on the host
    assert [getattr(t, "_host_made", False) for t in (a, b, c, d, e, f)] == [True, False, True, False, True, True]


def _steps_with_guarded_collectives(rank, world, overrides, run_dir):
    from megatron_k3.training.engine import shutdown

    found, calls, saved = set(), [], {name: getattr(dist, name) for name in COLLECTIVES}
    for name, fn in saved.items():
        setattr(dist, name, _guarded(name, fn, found, calls))
        if name in P2P:  # dist.P2POp takes only c10d's own isend / irecv: the same wrapper there
            setattr(c10d, name, getattr(dist, name))
    common = overrides + [f"checkpoint.dir={run_dir}/ckpt"]
    try:
        with HostTensors():
            t = make_trainer(world, common, steps=3)
            for _ in range(2):
                t.train_step()
            t.evaluate()
            t.save(blocking=True)
        shutdown()
        with HostTensors():
            t = make_trainer(world, common + ["checkpoint.load=auto"], steps=3)
            t.maybe_resume()
            t.train_step()
        return sorted(found), t.step, calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
            if name in P2P:
                setattr(c10d, name, fn)
        shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("world,overrides", [
    (2, ["parallel.ep=2"] + STATIC),  # the routed experts' own optimizer and its gradient norm
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=0"]),  # ZeRO-0's norm
    (2, ["parallel.pp=2", "train.guard.straggler_interval=1"]),  # the straggler report
    (2, ["parallel.cp=2", "parallel.zero_stage=1", "optim=muon"]),
    (2, ["parallel.ep=2", "model.moe_overflow=balanced", "moe.quantile_estimator=histogram"]),
], ids=["ep2", "tp2_zero0", "pp2_stragglers", "cp2_muon", "ep2_balanced_histogram"])
def test_no_collective_gets_a_host_tensor(tmp_path, world, overrides):
    """Construction, two steps, an evaluation, a checkpoint, a resumed run's construction from it and its step:
    every collective our code calls gets device tensors; and every rank of a group calls the group's collectives
    in one order, with one shape and dtype where NCCL needs them equal (a mismatch it does not detect: it hangs or
    mixes buffers)."""
    results = run_distributed(_steps_with_guarded_collectives, world, overrides, str(tmp_path), timeout=300)
    for found, step, _ in results:
        assert step == 3 and found == [], (step, found)
    groups = {g for _, _, calls in results for g, *_ in calls if len(g) > 1}
    for g in groups:
        seqs = [[c[1:3] for c in results[r][2] if c[0] == g] for r in g]
        for r, seq in zip(g[1:], seqs[1:]):
            first = next((i for i, (a, b) in enumerate(zip(seqs[0], seq)) if a != b), min(len(seq), len(seqs[0])))
            assert seq == seqs[0], (g, r, first, seqs[0][first:first + 2], seq[first:first + 2],
                                    [c[3] for c in results[g[0]][2] if c[0] == g][first:first + 2])
