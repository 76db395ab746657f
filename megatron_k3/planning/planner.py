"""The planner: for a model, a cluster and a parallel layout, memory per device, communication per step,
pipeline bubble, step time and MFU (training), or memory and decode rate (inference); and the search over
layouts that lists what fits, best first, or says why nothing does and how many accelerators would do.

Time model (training), for the slowest pipeline stage:
  per micro-batch  t_micro = FLOPs / (peak x gemm_efficiency) + TP + CP + EP + PP transfer time
                   (collectives on the critical path, not overlapped with compute)
  pipeline         (m + pp - 1) x t_micro for m micro-batches per step (1F1B; bubble (pp-1)/(m+pp-1))
  data parallel    with parallel.overlap_grad_reduce (ZeRO-1/2) the gradient reduce-scatter overlaps the last
                   micro-batch's backward (ZeRO-2: each micro-batch's reduction its own backward) and what does
                   not fit is exposed, else all of it is; the parameter
                   all-gather (inside DeepSpeed's optimizer step), Muon's TP gather and Newton-Schulz and,
                   under ep > 1, the experts' gradient reduce-scatter and block all-gather are exposed
                   (docs/planning.md, "What the time
                   model assumes")
  MFU              model FLOPs of the step (causal attention, no recomputation) / (time x world x peak)

Vision tower (model.vision.enabled): on the first pipeline stage, for `Workload.image_share` of the tokens being
image features (flops.vision_flop_terms); model FLOPs count it once per token. Its parameters are replicated over
TP, its work is split (model/multimodal.py): each TP rank encodes a contiguous share of the micro-batch's media,
so a first-stage device spends the busiest rank's share of the tower's FLOPs and keeps that share's activations
(flops.vision_tp_share: 1/tp when the images divide evenly, all of it with one image per micro-batch), and the tp
kind carries the features' all-gather per micro-batch and the tower's gradient all-reduce once per step (comm.py).
`TrainPlan.vision` gives its parameters, memory per first-stage device, compute time and TP traffic as a line
item. Context parallelism does not take media (cp = 1).

peft=lora (`Workload.peft`): the frozen base's weights only (bf16, the routed experts as MXFP4 codes), gradients,
masters and optimizer states of the adapters; a weight GEMM's backward computes the input's gradient alone
(flops.frozen_base) and each adapter adds 2 r (in + out) FLOPs per token it sees forward, twice that backward; the
data-parallel traffic is the adapters'. `TrainPlan.peft` gives trainable and frozen parameters per device apart and
the MFU of the trained FLOPs (the step's) and of the forward FLOPs alone.

Balanced MoE dispatch (model.moe_overflow=balanced): its token hops, replica weights out and gradients back are
the ep kind (comm.py), on the critical path like the rest; `TrainPlan.moe_dispatch` gives the replica slots, their
memory and that traffic on its own. Its FLOPs are the drop model's (M pairs per rank: exact with S >= E/ep).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from ..config.schema import RECOMPUTE_MODULES as MODULES
from ..layout import rules
from .candidates import Layout, planner_problems, stage_layers
from .comm import gradient_reductions, training_comm
from .flops import (
    decode_flops_per_token,
    frozen_base,
    layer_flop_terms,
    model_flops,
    vision_flop_terms,
    vision_image_patches,
    vision_media,
    vision_tp_share,
)
from .memory import (
    GB,
    MXFP4_BYTES_PER_PARAM,
    InferenceMemory,
    Workload,
    balanced_moe,
    inference_memory,
    kda_state_bytes_per_sequence,
    mla_cache_bytes_per_token,
    offload_first_load_bytes,
    training_memory,
)
from .params import count_parameters, model_params

__all__ = ["TrainPlan", "InferPlan", "plan_training", "plan_inference", "search_training", "search_inference",
           "long_sequence_plan", "SearchResult", "min_world_for_training", "model_state_bytes"]

CP_MIN_SHARD = 4096  # tokens per context-parallel rank below which the search does not try CP
LONG_SEQUENCE_LAYOUTS = 10  # a search that finds no fit tries tiling and offload on this many least-memory layouts
# forward FLOP terms that selective recomputation runs again, by the module kind that rebuilds them
# (parallel.recompute; the elementwise work of the other kinds is not counted as FLOPs)
_CHEAP_FLOPS = {name: "core_attn" for name in (
    "kda.intra_scores", "kda.block_decay_sums", "kda.chunk_decay_sums", "kda.ut_solve", "kda.wy_products",
    "kda.state_handoff", "kda.output", "kda.diag_span", "mla.attention", "vision.attention")}


@dataclass
class TrainPlan:
    model: str
    cluster: str
    layout: Layout
    workload: Workload
    total_params: int
    active_params: int
    fits: bool
    memory_per_device: float  # bytes, the largest stage
    memory_breakdown: dict  # GB by kind, largest stage
    activation_breakdown: dict  # GB by category, largest stage
    stage_memory_gb: list
    params_per_device: dict
    micro_batches: int
    bubble: float
    model_flops_per_step: float
    device_flops_per_step: float  # on the slowest stage, recomputation and redundancy included
    comm_bytes: dict
    comm_time: dict
    time_breakdown: dict
    step_time: float
    mfu: float
    tokens_per_s: float
    capacity_gb: float
    notes: list = field(default_factory=list)
    stage_params: list = field(default_factory=list)  # parameters one device of each pipeline stage holds
    moe_dispatch: dict = field(default_factory=dict)  # balanced dispatch only (_balanced_summary)
    vision: dict = field(default_factory=dict)  # model.vision.enabled only (_vision_summary)
    peft: dict = field(default_factory=dict)  # peft=lora only (_peft_summary)
    stage_trainable: list = field(default_factory=list)  # parameters with gradients on one device of each stage
    host_per_node_gb: float = 0.0  # activation offload: host memory per node the offloaded layer inputs take
    host_capacity_gb: float = 0.0  # cluster.host_memory_gb: what host_per_node_gb must stay within
    host_share_gb: float = 0.0  # cluster.host_memory_per_device_gb: one device's share of it

    @property
    def host_over(self) -> bool:
        """The offloaded layer inputs take more host memory per node than the node has."""
        return self.host_per_node_gb > self.host_capacity_gb

    def as_dict(self) -> dict:
        workload = {"seq_length": self.workload.seq_length, "micro_batch_size": self.workload.micro_batch_size,
                    "global_batch_size": self.workload.global_batch_size, "precision": self.workload.precision,
                    "optimizer": self.workload.optimizer, "zero_stage": self.workload.zero_stage,
                    "kernels": self.workload.kernels}
        extra = {}
        if self.vision:
            workload["image_share"] = self.workload.image_share
            extra["vision"] = self.vision
        if self.host_per_node_gb:
            extra.update(host_per_node_gb=self.host_per_node_gb, host_memory_gb=self.host_capacity_gb)
        if self.peft:
            extra["peft"] = self.peft
        if self.moe_dispatch:
            workload.update(moe_overflow=self.workload.moe_overflow,
                            redundant_experts=self.workload.redundant_experts,
                            replica_exchange=self.workload.replica_exchange)
            extra["moe_dispatch"] = self.moe_dispatch
        return {
            "mode": "train", "model": self.model, "cluster": self.cluster, "total_params": self.total_params,
            "active_params": self.active_params, "layout": self.layout.as_dict(), "workload": workload,
            "fits": self.fits, "device_memory_gb": self.capacity_gb,
            "memory_per_device_gb": self.memory_per_device / GB, "memory_breakdown_gb": self.memory_breakdown,
            "activation_breakdown_gb": self.activation_breakdown, "stage_memory_gb": self.stage_memory_gb,
            "params_per_device": self.params_per_device, "stage_params": self.stage_params,
            "micro_batches": self.micro_batches,
            "pipeline_bubble": self.bubble, "model_flops_per_step": self.model_flops_per_step,
            "device_flops_per_step": self.device_flops_per_step, "comm_bytes_per_step": self.comm_bytes,
            "comm_time_s": self.comm_time, "time_breakdown_s": self.time_breakdown, "step_time_s": self.step_time,
            "mfu": self.mfu, "tokens_per_s": self.tokens_per_s, "notes": self.notes, **extra,
        }


def _peak_flops(cluster, precision: str) -> float:
    """FLOP/s the GEMMs run at: fp8 tensor cores for the TE fp8 recipes, half the bf16 rate for fp32 (TF32) on
    accelerators, the bf16 peak otherwise (mx_qat fake-quantises and multiplies in bf16)."""
    peak = cluster.peak_tflops_bf16
    if precision in ("te_fp8", "te_mxfp8") and cluster.peak_tflops_fp8 > 0:
        peak = cluster.peak_tflops_fp8
    elif precision == "fp32" and cluster.device_kind == "gpu":
        peak = cluster.peak_tflops_bf16 / 2
    return peak * 1e12


@functools.lru_cache(maxsize=256)
def _model_flops(cfg, seq_length: int, image_share: float, peft: tuple = ()):
    """Model FLOPs per token (flops.model_flops); under peft=lora the frozen base's backward (input gradients only,
    the vision tower none) plus the adapters' FLOPs."""
    mf = model_flops(cfg, seq_length, "causal", image_share, frozen=bool(peft))
    if peft:
        a = sum(_adapter_flops(cfg, peft, i) for i in range(cfg.num_layers)) + _adapter_flops(cfg, peft, None)
        mf = replace(mf, forward_per_token=mf.forward_per_token + a, backward_per_token=mf.backward_per_token + 2 * a)
    return mf


def _adapter_flops(cfg, peft: tuple, i: int | None) -> float:
    """Forward FLOPs per token of layer i's adapters (None: the LM head's): 2 r (in + out) per adapted linear, the
    routed experts' for the top_k of E experts a token visits."""
    if not peft:
        return 0.0
    mp = model_params(cfg, 1, 1, peft)
    if i is None:
        return 2.0 * mp.head.total
    lp = mp.layers[i]
    return 2.0 * lp.dense.total + 2.0 * lp.experts.total * cfg.top_k / max(cfg.num_experts, 1)


def _vision_flops(cfg, w: Workload, recompute: str, tp: int = 1, recomputed: frozenset = frozenset(MODULES)) -> tuple:
    """(forward, backward, recompute) FLOPs of the vision tower and projector for one micro-batch on the busiest
    first-stage device of a TP group of `tp` ranks (each encodes its share of the media: flops.vision_tp_share);
    zeros without model.vision."""
    terms = vision_flop_terms(cfg, w.seq_length, w.image_share)
    n = w.micro_batch_size * w.seq_length * vision_tp_share(cfg, w.seq_length, w.micro_batch_size, w.image_share, tp)
    fwd, bwd = sum(t.forward for t in terms) * n, sum(t.backward for t in terms) * n
    if not bwd or recompute == "none":  # frozen: nothing kept, nothing recomputed
        return fwd, bwd, 0.0
    if recompute == "full":  # each block rebuilt from its input (the patch embedding and the projector are kept)
        again = ("vision.qkv_proj", "vision.o_proj", "vision.mlp", "vision.attention")
    else:  # selective: the attention core under core_attn, as the text layers' (_CHEAP_FLOPS)
        again = tuple(n for n, kind in _CHEAP_FLOPS.items() if kind in recomputed)
    return fwd, bwd, sum(t.forward for t in terms if t.name in again) * n


@functools.lru_cache(maxsize=1 << 14)
def _layer_flop_classes(cfg, i: int, T: int, attention: str, recomputed: frozenset = frozenset(),
                        peft: tuple = ()) -> tuple:
    """Layer i's per-token (forward, backward, forward run again by selective recomputation of the module kinds
    `recomputed`, the MoE block's forward: run again by sequence tiling) FLOPs: (TP-split part, routed part); under
    peft=lora the frozen weights' backward is their input gradient only, and the adapters are in the split part."""
    split, routed = [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]
    terms = layer_flop_terms(cfg, i, T, attention)
    if peft:
        a = _adapter_flops(cfg, peft, i)
        terms = frozen_base(terms)
        split[0], split[1] = a, 2 * a
    for t in terms:
        acc = split if (t.category in ("kda", "mla", "dense_ffn") or t.name == "moe.shared_experts") else routed
        acc[0] += t.forward
        acc[1] += t.backward
        if _CHEAP_FLOPS.get(t.name) in recomputed:
            acc[2] += t.forward
        if t.name.startswith("moe."):
            acc[3] += t.forward
    return tuple(split), tuple(routed)


def _stage_flops(cfg, lay: Layout, w: Workload, start: int, end: int, last: bool, first: bool = False) -> tuple:
    """(forward, backward, recompute) FLOPs of one micro-batch on one device of the stage (`first`: with the vision
    tower, where the model has one)."""
    n = w.micro_batch_size * w.seq_length / lay.cp
    n_rank = n / lay.tp if lay.sp else n
    if w.kernels == "eager":  # the packed micro-batch is one row; the math attention spans all of it
        T, attention = w.micro_batch_size * w.seq_length, "dense"
    else:
        T, attention = w.seq_length, "causal"
    fwd = bwd = again = 0.0
    full = lay.full_layers(start, end)
    for i in range(start, end):
        (sf, sb, sc, sm), (rf, rb, rc, rm) = _layer_flop_classes(cfg, i, T, attention, lay.recomputed, w.peft)
        # head- or intermediate-split over TP / the routed branch on this rank's tokens (all, without SP)
        fwd += sf * n / lay.tp + rf * n_rank
        bwd += sb * n / lay.tp + rb * n_rank
        # full: the layers it covers run their whole forward again; selective: the recomputed kinds' terms;
        # sequence tiling: the MoE block's tiles once more (inside a recomputed layer too)
        again += (sf * n / lay.tp + rf * n_rank) if i in full else (sc * n / lay.tp + rc * n_rank)
        if lay.tile_tokens:
            again += sm * n / lay.tp + rm * n_rank
    if last:
        f = 2 * cfg.hidden_size * cfg.vocab_size * n / lay.tp
        a = _adapter_flops(cfg, w.peft, None) * n / lay.tp
        fwd += f + a
        bwd += (f if w.peft else 2 * f) + 2 * a  # frozen (peft=lora): the input's gradient only
        again += f if lay.tile_tokens else 0.0  # the tiles' logits again
    if first:
        vf, vb, vr = _vision_flops(cfg, w, lay.recompute, lay.tp, lay.recomputed)
        if w.peft:  # the frozen tower takes no gradient, nor does anything upstream of it
            vb = vr = 0.0
        fwd, bwd, again = fwd + vf, bwd + vb, again + vr
    return fwd, bwd, again


def model_state_bytes(cfg, w: Workload) -> float:
    """Weights + gradients + master + optimizer states of the whole model, unsharded: the floor on the
    accelerators' combined memory for training (activations come on top)."""
    mp = model_params(cfg, 1, 1, w.peft, w.per_head)
    frozen = mp.vision.total if cfg.freeze_vision else 0  # model.freeze_vision: the tower's weights only
    total = mp.dense_total() + mp.expert_total() - frozen
    groups = [mp.embedding, mp.head, mp.vision] + [g for lp in mp.layers for g in (lp.dense, lp.experts)]
    base = sum(g.frozen for g in groups) * w.weight_bytes + sum(g.frozen_mx for g in groups) * MXFP4_BYTES_PER_PARAM
    muon = sum(lp.dense.muon + lp.experts.muon for lp in mp.layers) + mp.head.muon + mp.embedding.muon
    muon += 0 if frozen else mp.vision.muon
    opt = muon * 4 + (total - muon) * 8 if w.optimizer == "muon" else total * 8
    return total * (w.weight_bytes + w.grad_bytes + w.master_bytes) + opt + frozen * w.weight_bytes + base


def _balanced_summary(cfg, cluster, lay: Layout, w: Workload, worst, comm) -> dict:
    """The balanced dispatch of a plan: slots, rows computed, replica memory on the largest stage, and the replica
    weights out / gradients back per step with their time on the EP links (the slowest stage's)."""
    bal = balanced_moe(cfg, lay, w)
    if bal is None:
        return {}
    a, b = worst.layers
    n_moe = cfg.ffn_types()[a:b].count("moe")
    d = comm.ep_detail
    return {"policy": "balanced", "redundant_experts": bal.S, "own_experts": bal.El, "exact_balance": bal.exact,
            "expert_params": bal.P, "pairs_per_rank": bal.M, "compute_rows": bal.cap,
            "drop_rows": bal.drop_rows(cfg.moe_capacity_factor), "capacity_factor": cfg.moe_capacity_factor,
            "moe_layers_on_largest_stage": n_moe,
            "replica_bytes_per_layer": bal.replica_bytes(w.weight_bytes),
            "replica_memory_gb": worst.moe_replicas / GB, "exchange_buffers_gb": worst.moe_exchange / GB,
            "replica_weights_bytes_per_step": d["replica_weights"][0], "replica_weights_s": d["replica_weights"][1],
            "replica_grads_bytes_per_step": d["replica_grads"][0], "replica_grads_s": d["replica_grads"][1],
            "token_bytes_per_step": d["tokens"][0], "token_s": d["tokens"][1],
            "metadata_bytes_per_step": d["metadata"][0], "link_gbps": cluster.intra_supernode_gbps}


def _stage_times(cfg, cluster, lay: Layout, w: Workload, stages, mem, rate: float) -> list:
    """Per pipeline stage (seconds per micro-batch, forward, backward and recomputed FLOPs, its StepComm, the
    stage): compute, communication on the critical path and, with activation offload, the layer inputs' copies to
    host and back (side streams while the stage computes) beyond the compute, and the first load of the backward,
    which nothing prefetches."""
    out = []
    for s, (a, b) in enumerate(stages):
        fwd, bwd, rec = _stage_flops(cfg, lay, w, a, b, s == len(stages) - 1, s == 0)
        comm = training_comm(cfg, cluster, lay, w, s)
        t = (fwd + bwd + rec) / rate + sum(comm.per_micro_time.values())
        per_micro = mem[s].host / mem[s].in_flight
        copies = 2 * per_micro / (cluster.host_copy_gbps * GB)
        first = offload_first_load_bytes(cfg, lay, w, a, b, per_micro) / (cluster.host_copy_gbps * GB)
        out.append((t + max(0.0, copies - (fwd + bwd + rec) / rate) + first, fwd, bwd, rec, comm, s))
    return out


# the optimizer's collectives the step waits for (planning.comm's kinds)
EXPOSED_IN_STEP = ("dp_param_gather", "tp_muon_gather", "edp_grad_reduce", "edp_param_gather")


def _dp_exposed(lay: Layout, w: Workload, comm, t_bwd: float) -> float:
    """Seconds of the data-parallel and optimizer collectives a step exposes: the gradient reduction, hidden behind
    the last backward (`t_bwd` seconds) with parallel.overlap_grad_reduce under ZeRO-1/2 (ZeRO-2 reduces after every
    micro-batch, comm.gradient_reductions: each behind its own backward), else exposed; DeepSpeed's parameter
    gather, Muon's traffic and the experts' reduce-scatter and all-gather under ep > 1 (EXPOSED_IN_STEP)."""
    t_grad = comm.time_by_kind["dp_grad_reduce"]
    n = gradient_reductions(lay, w)
    hidden = w.overlap_grad_reduce and w.zero_stage >= 1
    exposed = n * max(0.0, t_grad / n - t_bwd) if hidden else t_grad
    return exposed + sum(comm.time_by_kind[k] for k in EXPOSED_IN_STEP)


def plan_training(cfg, cluster, lay: Layout, w: Workload, counts: dict | None = None) -> TrainPlan:
    """Plan one layout. `counts` is tools/param_count's dict (total/active), computed if not given."""
    problems = planner_problems(cfg, cluster, lay, w)
    if problems:
        raise ValueError("; ".join(f"{p.key}={p.value}: {p.reason}" for p in problems))
    if counts is None:
        counts = count_parameters(cfg)
    stages = stage_layers(cfg, lay.pp)
    mem = training_memory(cfg, cluster, lay, w)
    worst = max(mem, key=lambda s: s.total)
    m = w.global_batch_size // (w.micro_batch_size * lay.dp)
    rate = _peak_flops(cluster, w.precision) * cluster.gemm_efficiency
    per_stage = _stage_times(cfg, cluster, lay, w, stages, mem, rate)
    t_micro, fwd, bwd, rec, comm, slow = max(per_stage, key=lambda x: x[0])
    pipeline = (m + lay.pp - 1) * t_micro
    bubble = (lay.pp - 1) / (m + lay.pp - 1)
    dp_exposed = _dp_exposed(lay, w, comm, (bwd + rec) / rate)  # and Muon's Newton-Schulz, exposed in the step:
    t_opt = _muon_time(cfg, lay, stages[slow], slow == 0, w) / rate if w.optimizer == "muon" else 0.0
    # collectives run once per step (the vision gradients on stage 0, the balanced step exchange): the stage that
    # spends the most on them sets the step
    once = max(sum(c.per_step_time.values()) for *_, c, _ in per_stage)
    step = pipeline + once + dp_exposed + t_opt
    mf = _model_flops(cfg, w.seq_length, w.image_share, w.peft)
    tokens = w.global_batch_size * w.seq_length
    model_step = mf.train_per_step(tokens)
    mfu = model_step / (step * lay.world * cluster.peak_tflops_bf16 * 1e12)
    capacity = cluster.device_memory_gb * GB
    host_node = max(st.host for st in mem) * cluster.devices_per_node
    per_dev = {"dense": worst.params_dense, "routed_experts": worst.params_experts,
               "total": worst.params_dense + worst.params_experts}
    if w.peft:  # the adapters above; the frozen base apart
        per_dev.update(frozen=worst.params_frozen, total=per_dev["total"] + worst.params_frozen)
    compute = m * (fwd + bwd + rec) / rate
    times = {"compute": compute, "tp": m * comm.per_micro_time["tp"], "cp": m * comm.per_micro_time["cp"],
             "ep": m * comm.per_micro_time["ep"], "pp": m * comm.per_micro_time["pp"],
             "pipeline_bubble": pipeline - m * t_micro, "per_step": once, "dp_exposed": dp_exposed,
             "optimizer": t_opt}
    moe_dispatch = _balanced_summary(cfg, cluster, lay, w, worst, comm)
    vision = _vision_summary(cfg, lay, w, mem[0], m, rate, model_step, tokens, slow, per_stage[0][4])
    notes = _plan_notes(lay, moe_dispatch, vision, m, per_stage[0][0], slow, t_micro)
    return TrainPlan(
        model=cfg.name, cluster=cluster.name, layout=lay, workload=w, total_params=counts["total"],
        active_params=counts["active"], fits=worst.total <= capacity and host_node <= cluster.host_memory_gb * GB,
        memory_per_device=worst.total, host_per_node_gb=host_node / GB, host_capacity_gb=cluster.host_memory_gb,
        host_share_gb=cluster.host_memory_per_device_gb,
        memory_breakdown=worst.breakdown_gb(),
        activation_breakdown={k: v / GB for k, v in sorted(worst.activation_detail.items())},
        stage_memory_gb=[round(s.total / GB, 3) for s in mem], params_per_device=per_dev, micro_batches=m,
        bubble=bubble, model_flops_per_step=model_step, device_flops_per_step=m * (fwd + bwd + rec),
        comm_bytes=comm.bytes_by_kind, comm_time=comm.time_by_kind, time_breakdown=times, step_time=step,
        mfu=mfu, tokens_per_s=tokens / step, capacity_gb=cluster.device_memory_gb, notes=notes,
        stage_params=[s.params_dense + s.params_experts + s.params_frozen for s in mem], moe_dispatch=moe_dispatch,
        stage_trainable=[s.params_dense + s.params_experts for s in mem],
        vision=vision, peft=_peft_summary(cfg, lay, w, worst, mf, tokens, step, cluster))


def _peft_summary(cfg, lay: Layout, w: Workload, worst, mf, tokens: int, step: float, cluster) -> dict:
    """peft=lora's line item: adapters and frozen base per device (the largest stage), the model's adapter
    parameters, and the MFU of the step's trained FLOPs and of the forward FLOPs alone (empty without peft)."""
    if not w.peft:
        return {}
    mp = model_params(cfg, 1, 1, w.peft)
    groups = [mp.embedding, mp.head, mp.vision] + [g for lp in mp.layers for g in (lp.dense, lp.experts)]
    peak = step * lay.world * cluster.peak_tflops_bf16 * 1e12
    return {"rank": w.peft[0], "alpha": w.peft[1], "targets": list(w.peft[2]),
            "trainable_params": sum(g.total for g in groups), "frozen_params": sum(g.frozen + g.frozen_mx
                                                                                   for g in groups),
            "trainable_per_device": worst.params_dense + worst.params_experts,
            "frozen_per_device": worst.params_frozen,
            "forward_flops_per_step": mf.forward_per_token * tokens,
            "mfu_trained": mf.train_per_step(tokens) / peak, "mfu_forward": mf.forward_per_token * tokens / peak}


def _muon_time(cfg, lay: Layout, layers: tuple, first: bool, w: Workload) -> float:
    """Newton-Schulz FLOPs of Per-Head Muon on one device of the stage holding `layers` (start, end): its dense
    matrices and its experts (peft=lora: the adapters), the vision tower's on the first stage unless frozen. Under
    ZeRO-1/2 DeepSpeed orthogonalises on each DP rank the matrices of its partition, a 1/(dp x cp) share (the experts
    too at ep = 1); under ep > 1 training.expert_optimizer orthogonalises on each edp rank its block of whole
    experts (Layout.expert_share of them at most)."""
    mp = model_params(cfg, lay.tp, lay.ep, w.peft, w.per_head)
    a, b = layers
    dense = sum(lp.dense.ns_flops for lp in mp.layers[a:b])
    experts = sum(lp.experts.ns_flops for lp in mp.layers[a:b])
    if first and not cfg.freeze_vision:
        dense += mp.vision.ns_flops
    share = lay.dp * lay.cp if w.zero_stage >= 1 else 1
    return dense / share + (experts / share if lay.experts_in_zero else experts * lay.expert_share(cfg.num_experts))


def _plan_notes(lay: Layout, moe_dispatch: dict, vision: dict, m: int, t0: float, slow: int,
                t_micro: float) -> list:
    """What a plan's reader should know about its numbers (t0: stage 0's time per micro-batch, t_micro the slowest
    stage's, `slow` its index)."""
    notes = []
    if lay.tp > 1 and not lay.sp:
        notes.append("sequence parallelism off: the routed MoE branch runs redundantly on every TP rank")
    if vision and slow != 0:
        added = (vision["compute_time_s"] + vision["tp_comm_time_s"]) / m
        notes.append(f"the vision tower adds {added * 1e3:.3g} ms per micro-batch to pipeline stage 0 (compute and "
                     f"its TP traffic; {t0 * 1e3:.3g} ms with it), which stays below the slowest stage {slow} "
                     f"({t_micro * 1e3:.3g} ms): the step does not grow with it")
    if vision and vision["tp_work_share"] * lay.tp > 1 + 1e-9:
        notes.append(f"the vision tower's work splits over TP by whole media (model.vision.media_shares): with "
                     f"{vision['images_per_micro_batch']} image(s) per micro-batch the busiest of the {lay.tp} TP "
                     f"ranks encodes {vision['tp_work_share']:.0%} of the patches, not 1/{lay.tp} (the others wait "
                     f"at the features' all-gather); more images per micro-batch (a larger micro-batch, smaller "
                     f"images) split it further")
    if moe_dispatch:
        notes.append("balanced dispatch: the replica weight exchanges and the two-hop token all-to-alls are counted "
                     "on the critical path (the first weight exchange overlaps the shared experts in the code; "
                     "not modelled)")
    if moe_dispatch and not moe_dispatch["exact_balance"]:
        notes.append(f"moe.redundant_experts={moe_dispatch['redundant_experts']} < E/ep = "
                     f"{moe_dispatch['own_experts']}: balance is not exact (a donor computes what its receiver "
                     f"cannot take; FLOPs assume balanced routing), and the compute buffer is sized for the worst "
                     f"case, {moe_dispatch['compute_rows']} rows instead of {moe_dispatch['pairs_per_rank']}")
    return notes


def _vision_summary(cfg, lay: Layout, w: Workload, first, m: int, rate: float, model_step: float,
                    tokens: int, slow: int, comm0) -> dict:
    """The vision tower and projector of a plan (empty without model.vision.enabled): parameters, what it takes
    per first-stage device (bytes by kind, from training_memory), the image load assumed and how it splits over
    TP, its FLOPs: per step in the model count (and their share of it) and on the busiest first-stage device with
    its compute time, and its TP traffic per step on a first-stage device (`comm0`, stage 0's StepComm)."""
    if not cfg.vision.enabled:
        return {}
    v = cfg.vision
    mp = model_params(cfg, 1, 1, w.peft)
    terms = vision_flop_terms(cfg, w.seq_length, w.image_share)
    model_vision = sum(t.forward + t.backward for t in terms) * tokens
    fwd, bwd, rec = _vision_flops(cfg, w, lay.recompute, lay.tp, lay.recomputed)
    device = m * (fwd + bwd + rec)
    features = w.image_share * w.micro_batch_size * w.seq_length
    bytes_ = {k: first.vision.get(k, 0.0) for k in ("weights", "gradients", "optimizer", "activations", "transient")}
    tp_comm = {k: b for k, (b, _) in comm0.vision_tp.items()}
    return {
        "params": mp.vision.total, "vision_tower_params": mp.vision_tower.total,
        "mm_projector_params": mp.mm_projector.total, "frozen": bool(cfg.freeze_vision), "stage": 0,
        "params_replicated_over_tp": True, "work_split_over_tp": lay.tp > 1,
        "tp_work_share": vision_tp_share(cfg, w.seq_length, w.micro_batch_size, w.image_share, lay.tp),
        "image_share": w.image_share,
        "images_per_micro_batch": len(vision_media(cfg, w.seq_length, w.micro_batch_size, w.image_share)),
        "features_per_micro_batch": features, "patches_per_micro_batch": v.merge_size * features,
        "patches_per_image": vision_image_patches(cfg, w.seq_length, w.image_share),
        "bytes_per_device": bytes_, "gb_per_device": sum(bytes_.values()) / GB,
        "model_flops_per_step": model_vision, "model_flops_share": model_vision / model_step if model_step else 0.0,
        "device_flops_per_step": device, "compute_time_s": device / rate,
        "tp_comm_bytes_per_step": tp_comm, "tp_comm_time_s": sum(t for _, t in comm0.vision_tp.values()),
        "on_slowest_stage": slow == 0,
    }


# ------------------------------------------------------------------------------------------------ search

def _pow2_upto(n: int) -> list:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def candidate_layouts(cfg, cluster, w: Workload, recomputes=("none", "selective", "full"),
                      knobs=((), 0, 0, 0.0)) -> list:
    """Every layout the search plans; `knobs`: (train.recompute_modules, train.recompute_num_layers,
    train.tile_tokens, train.offload_buffer_gb in bytes) of the selective, full and every layout."""
    world, sn = cluster.world_size, cluster.supernode_size
    tps = [t for t in _pow2_upto(min(sn, max(cluster.devices_per_node, 1)))]
    max_pp = cfg.num_attn_res_blocks if cfg.attn_res else cfg.num_layers
    pps = [p for p in range(1, max_pp + 1) if world % p == 0]
    if "moe" in cfg.ffn_types():
        eps = [e for e in range(1, sn + 1) if cfg.num_experts % e == 0 and sn % e == 0]
    else:
        eps = [1]
    # context parallelism only where each shard keeps >= 4096 tokens: CP's latency costs (the KDA state scan
    # across ranks, causal load imbalance in MLA) are not modelled, so short shards would look too good
    cps = [c for c in _pow2_upto(8) if c == 1 or (w.seq_length % (2 * c) == 0 and w.seq_length // c >= CP_MIN_SHARD)]
    out = []
    for tp in tps:
        for pp in pps:
            for ep in eps:
                for cp in cps:
                    for rc in recomputes:
                        out.append(Layout(world=world, tp=tp, pp=pp, ep=ep, cp=cp, recompute=rc,
                                          recompute_modules=knobs[0] if rc == "selective" else (),
                                          recompute_num_layers=knobs[1] if rc == "full" else 0,
                                          tile_tokens=knobs[2], offload_bytes=knobs[3] if rc == "full" else 0.0))
    return out


@dataclass
class SearchResult:
    fits: list  # TrainPlan or InferPlan, best first
    over_memory: list  # valid layouts that do not fit, least memory first
    invalid: dict  # reason -> count
    evaluated: int
    min_world: int | None = None  # training: smallest accelerator count (whole supernodes) that fits
    min_world_plan: object = None
    state_floor_bytes: float = 0.0
    # training, nothing fits with the run's knobs: the fastest of the LONG_SEQUENCE_LAYOUTS least-memory layouts with
    # full recomputation, sequence tiling and activation offload (long_sequence_plan), or None
    long_sequence: object = None
    long_sequence_keys: str = ""  # the train.* overrides that run it, over the search's knobs


@functools.lru_cache(maxsize=32)
def search_training(cfg, cluster, w: Workload, top: int = 10, find_min_world: bool = True,
                    knobs: tuple = ((), 0, 0, 0.0)) -> SearchResult:
    """Every candidate layout planned; the `top` fastest that fit (or the least-memory ones that do not, the
    model-state floor, and the smallest accelerator count that would fit). `knobs`: the trainer's knobs
    (train.recompute_modules as a tuple, train.recompute_num_layers, train.tile_tokens, train.offload_buffer_gb in
    bytes). Memoised per input (pure; the result is shared: read it, do not change it)."""
    counts = count_parameters(cfg)
    fits, over, invalid, n = [], [], {}, 0
    for lay in candidate_layouts(cfg, cluster, w, knobs=knobs):
        probs = planner_problems(cfg, cluster, lay, w)
        if probs:
            invalid[probs[0].kind] = invalid.get(probs[0].kind, 0) + 1
            continue
        n += 1
        p = plan_training(cfg, cluster, lay, w, counts)
        (fits if p.fits else over).append(p)
    fits.sort(key=lambda p: (p.step_time, p.memory_per_device))
    over.sort(key=lambda p: p.memory_per_device)
    res = SearchResult(fits[:top], over[:top], invalid, n, state_floor_bytes=model_state_bytes(cfg, w))
    if not fits and n:  # n = 0: every candidate broke a rule, which no knob or accelerator count changes
        res.long_sequence = long_sequence_plan(cfg, cluster, [p.layout for p in over[:LONG_SEQUENCE_LAYOUTS]], w,
                                               counts)
        res.long_sequence_keys = res.long_sequence.layout.trainer_keys(knobs[1:]) if res.long_sequence else ""
        if find_min_world:
            res.min_world, res.min_world_plan = min_world_for_training(cfg, cluster, w, counts, knobs=knobs)
    return res


def long_sequence_plan(cfg, cluster, layouts, w: Workload, counts=None):
    """The fastest plan that fits among `layouts` (their parallel sizes) with the trainer's long-sequence knobs:
    full recomputation with train.tile_tokens (every power of two from 128 below a device's tokens that the config's
    layout check accepts; the largest on a tie: fewest tiles), train.offload_buffer_gb (the whole GB the kept layer
    inputs take, capped at the whole GB of cluster.host_memory_gb's share per device: the rest stays on the device),
    or both; None when none fits."""
    counts = counts or count_parameters(cfg)
    host = cluster.host_memory_per_device_gb * GB
    seen, plans = set(), []
    for lay in layouts:
        sizes = (lay.tp, lay.pp, lay.ep, lay.cp, lay.sp)
        if sizes in seen:
            continue
        seen.add(sizes)
        tokens = w.micro_batch_size * w.seq_length // lay.cp
        for tile in [0] + [t for t in _pow2_upto(tokens - 1) if t >= 128]:
            for offload in (0.0, host):
                cand = replace(lay, recompute="full", recompute_modules=(), recompute_num_layers=0,
                               tile_tokens=tile, offload_bytes=offload)
                if not (tile or offload) or planner_problems(cfg, cluster, cand, w):
                    continue
                if offload:  # as much as the kept inputs take, in whole GB, within the host's share
                    used = max(s.host for s in training_memory(cfg, cluster, cand, w))
                    cand = replace(cand, offload_bytes=min(math.ceil(used / GB), math.floor(host / GB)) * GB)
                    if not cand.offload_bytes:
                        continue
                p = plan_training(cfg, cluster, cand, w, counts)
                if p.fits:
                    plans.append(p)
    return min(plans, key=lambda p: (p.step_time, -p.layout.tile_tokens, p.layout.offload_bytes), default=None)


def min_world_for_training(cfg, cluster, w: Workload, counts=None, max_supernodes: int = 256,
                           knobs: tuple = ((), 0, 0, 0.0)):
    """Smallest number of whole supernodes (same accelerators and links) on which some layout fits: a scan
    upward from the model-state floor (fitting is not monotone in the count: divisibility matters), checking
    the memory-lightest recomputation first; returns (accelerators, the best plan there) or (None, None)."""
    counts = counts or count_parameters(cfg)
    sn = cluster.supernode_size
    usable = (cluster.device_memory_gb - cluster.reserved_memory_gb) * GB
    first = max(1, math.ceil(model_state_bytes(cfg, w) / usable / sn))
    for k in range(first, max_supernodes + 1):
        world = k * sn
        dpn = cluster.devices_per_node if world % max(cluster.devices_per_node, 1) == 0 else 1
        c = replace(cluster, num_nodes=world // dpn, devices_per_node=dpn)
        capacity = c.device_memory_gb * GB
        fits = False
        for lay in candidate_layouts(cfg, c, w, recomputes=("full",), knobs=knobs):
            if planner_problems(cfg, c, lay, w):
                continue
            mem = training_memory(cfg, c, lay, w)
            if (max(s.total for s in mem) <= capacity  # memory alone decides
                    and max(s.host for s in mem) * c.devices_per_node <= c.host_memory_gb * GB):
                fits = True
                break
        if fits:
            res = search_training(cfg, c, w, top=1, find_min_world=False, knobs=knobs)
            return world, res.fits[0]
    return None, None


# ------------------------------------------------------------------------------------------------ inference

@dataclass
class InferPlan:
    model: str
    cluster: str
    world: int
    tp: int
    ep: int
    pp: int
    batch: int
    context: int
    total_params: int
    active_params: int
    fits: bool
    memory: InferenceMemory
    capacity_gb: float
    model_bytes: dict  # whole model: bf16 part, MXFP4 experts
    kda_state_per_sequence: float  # bytes
    mla_cache_per_token: float  # bytes
    decode_step_s: float
    decode_tokens_per_s: float
    decode_bound: str
    comm_bytes: dict
    mfu: float
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"mode": "infer", "model": self.model, "cluster": self.cluster, "total_params": self.total_params,
                "active_params": self.active_params,
                "layout": {"world": self.world, "tp": self.tp, "ep": self.ep, "pp": self.pp,
                           "dp_attention": self.world // (self.tp * self.pp)},
                "batch": self.batch, "context": self.context, "fits": self.fits,
                "device_memory_gb": self.capacity_gb, "memory_per_device_gb": self.memory.total / GB,
                "memory_breakdown_gb": self.memory.breakdown_gb(),
                "sequences_per_device": self.memory.sequences_per_device,
                "model_bytes_gb": {k: v / GB for k, v in self.model_bytes.items()},
                "kda_state_per_sequence_gb": self.kda_state_per_sequence / GB,
                "mla_cache_per_token_kb": self.mla_cache_per_token / 1e3,
                "comm_bytes_per_step": self.comm_bytes, "step_time_s": self.decode_step_s,
                "decode_tokens_per_s": self.decode_tokens_per_s, "decode_bound": self.decode_bound,
                "mfu": self.mfu, "notes": self.notes}


def plan_inference(cfg, cluster, tp: int, ep: int, pp: int, batch: int, context: int, counts=None) -> InferPlan:
    """Serving plan: routed experts MXFP4, the rest bf16, `batch` sequences at `context` tokens."""
    world = cluster.world_size
    problems = rules.layout_problems(cfg, world, tp=tp, ep=ep, pp=pp, supernode_size=cluster.supernode_size)
    if problems:
        raise ValueError("; ".join(f"{p.key}={p.value}: {p.reason}" for p in problems))
    counts = counts or count_parameters(cfg)
    mem = inference_memory(cfg, cluster, tp, ep, pp, batch, context)
    mp = model_params(cfg, 1)
    experts = mp.expert_total()
    model_bytes = {"bf16_part": (counts["total"] - experts) * 2, "mxfp4_experts": experts * MXFP4_BYTES_PER_PARAM}
    # decode step for the batch: each pipeline stage in turn reads its weights and its sequences' states
    # (KDA state read and written) from HBM, or computes, whichever is slower; plus the all-to-all
    dp_attn = world // (tp * pp)
    seqs = mem.sequences_per_device
    read = (mem.weights_dense + mem.weights_experts + 2 * mem.kda_states + mem.mla_cache) * pp
    t_mem = read / (cluster.hbm_gbps * GB)
    flops_tok = decode_flops_per_token(cfg, context)
    t_flops = flops_tok * batch / (world * cluster.peak_tflops_bf16 * 1e12 * cluster.gemm_efficiency)
    n_moe = cfg.ffn_types().count("moe")
    a2a = 0.0
    if ep > 1 and n_moe:  # dispatch + combine of this rank's tokens' latent rows (bf16) per MoE layer
        tok = seqs / tp if tp > 1 else seqs
        a2a = n_moe * 2 * tok * cfg.top_k * cfg.expert_width * 2 * (ep - 1) / ep
    t_comm = a2a / (cluster.intra_supernode_gbps * GB)
    step = max(t_mem, t_flops) + t_comm
    notes = []
    if seqs * dp_attn > batch:
        notes.append(f"{batch} sequences do not divide over {dp_attn} attention data-parallel groups; "
                     "the fullest group is counted")
    return InferPlan(cfg.name, cluster.name, world, tp, ep, pp, batch, context, counts["total"], counts["active"],
                     mem.total <= cluster.device_memory_gb * GB, mem, cluster.device_memory_gb, model_bytes,
                     kda_state_bytes_per_sequence(cfg), mla_cache_bytes_per_token(cfg), step, batch / step,
                     "memory bandwidth" if t_mem >= t_flops else "compute", {"ep": a2a},
                     flops_tok * batch / (step * world * cluster.peak_tflops_bf16 * 1e12), notes)


def search_inference(cfg, cluster, batch: int, context: int, top: int = 10) -> SearchResult:
    counts = count_parameters(cfg)
    sn = cluster.supernode_size
    tps = _pow2_upto(min(sn, max(cluster.devices_per_node, 1)))
    eps = [e for e in range(1, sn + 1) if sn % e == 0 and ("moe" not in cfg.ffn_types() or cfg.num_experts % e == 0)]
    max_pp = cfg.num_attn_res_blocks if cfg.attn_res else cfg.num_layers
    pps = [p for p in range(1, max_pp + 1) if cluster.world_size % p == 0]
    fits, over, invalid, n = [], [], {}, 0
    for tp in tps:
        for ep in eps:
            for pp in pps:
                probs = rules.layout_problems(cfg, cluster.world_size, tp=tp, ep=ep, pp=pp,
                                              supernode_size=cluster.supernode_size)
                if probs:
                    invalid[probs[0].kind] = invalid.get(probs[0].kind, 0) + 1
                    continue
                p = plan_inference(cfg, cluster, tp, ep, pp, batch, context, counts)
                n += 1
                (fits if p.fits else over).append(p)
    fits.sort(key=lambda p: (-p.decode_tokens_per_s, p.memory.total))
    over.sort(key=lambda p: p.memory.total)
    return SearchResult(fits[:top], over[:top], invalid, n)
