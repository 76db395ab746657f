"""Communication per training step and device, by kind, and the time each kind takes on the cluster's links.

Volumes are bytes one device sends (ring collectives: a fraction (g - 1) / g of the buffer; all-to-all:
the share of tokens bound for other ranks). A group inside one supernode runs at `intra_supernode_gbps`;
a group that spans supernodes runs hierarchically (inside each supernode first, then 1/m of the buffer
across supernodes at `inter_supernode_gbps`, m members per supernode).

Kinds:
* tp: sequence-parallel all-gather / reduce-scatter around every mixer and dense/shared FFN (all-reduce
  without sequence parallelism), the gathered low-rank projections, the LM head; forward + backward
  (+ the forward again under full recomputation); on the first stage with the vision tower (model.vision), whose
  parameters are replicated over TP but whose work is split (each rank encodes its share of the media): the
  all-gather of the projected features [N, K] (forward, activation dtype; each rank's part padded to the
  largest share's rows, as parallel.mappings.gather_var_rows does; its backward takes the rank's own rows, no
  traffic), and, unless model.freeze_vision, the all-reduce of the tower's and projector's parameter gradients
  once per step (parallel.mappings.all_reduce_grad_once_per_step_hook: the micro-batches' partial gradients summed
  locally, then one fp32 all-reduce in the last backward) and under sequence parallelism the all-gather of the
  features' gradient (backward, per micro-batch); `StepComm.vision_tp` gives the three parts and their times.
* cp: the MLA latent all-gather (and its gradient reduce-scatter) and the KDA state hand-off.
* ep: the dispatcher's all-to-all of the top-k latent rows to the expert ranks and back (combine), forward
  and backward; inside the supernode by construction. Under balanced dispatch (model.moe_overflow=balanced,
  memory.BalancedMoE) every layer and micro-batch: the tokens in two hops each way through relays, the int64
  counts and codes (forward), the replica weights out ((El + S) x P x (R-1)/R per forward) and their gradients
  back (the same bytes, in the backward); `StepComm.ep_detail` gives the four parts and their times.
* dp: gradient reduce-scatter and parameter all-gather (ZeRO-1/2; all-reduce with ZeRO-0) over the
  data-parallel group (dp x cp: dense, with the vision tower on the first stage unless model.freeze_vision, and
  the routed experts at ep = 1), with Muon's all-reduce of the matrices a partition boundary cuts; under ep > 1
  the routed experts' fp32 gradient reduce-scatter and parameter all-gather over expert-DP (edp_grad_reduce,
  edp_param_gather: training.expert_optimizer shards their states in blocks of whole experts);
  across supernodes when the group spans them.
* tp_muon_gather: Muon's all-gather over TP of the update of each TP-sharded matrix it orthogonalises whole.
* pp: activations forward and their gradients backward between neighbouring stages; with AttnRes the
  completed blocks travel with the partial sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .candidates import Layout, group_span, stage_layers
from .flops import vision_tp_share
from .memory import Workload, balanced_moe, replica_bytes_per_param
from .params import ParamGroup, model_params

__all__ = ["StepComm", "training_comm", "collective_time", "vision_tp_bytes", "gradient_reductions"]

GB = 1e9


@dataclass
class StepComm:
    bytes_by_kind: dict = field(default_factory=dict)  # per device per step
    time_by_kind: dict = field(default_factory=dict)  # seconds per step if not overlapped
    per_micro_time: dict = field(default_factory=dict)  # tp/cp/ep/pp seconds per micro-batch (critical path)
    per_step_time: dict = field(default_factory=dict)  # tp/ep seconds of the collectives run once per step (on the
    # critical path once: the vision gradient all-reduce, the balanced dispatch's step exchange)
    # balanced dispatch only: the ep kind's parts per step, {part: (bytes, seconds)} for tokens, metadata,
    # replica_weights (out, forward) and replica_grads (back, backward); under moe.replica_exchange=step the owners'
    # part once per step
    ep_detail: dict = field(default_factory=dict)
    # model.vision on the first stage under TP: the tp kind's vision parts per step, {part: (bytes, seconds)} for
    # feature_gather (forward), feature_grad_gather (backward, sequence parallelism) and grad_all_reduce (backward)
    vision_tp: dict = field(default_factory=dict)


def collective_time(nbytes: float, size: int, stride: int, cluster) -> float:
    """Seconds for one device to move `nbytes` (already scaled by (g - 1) / g) in a group of `size` ranks
    spaced `stride` apart: hierarchical over supernodes."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    per, spans = group_span(size, stride, cluster.supernode_size)
    intra = cluster.intra_supernode_gbps * GB
    inter = cluster.inter_supernode_gbps * GB
    if spans == 1:
        return nbytes / intra
    # the ring's (g-1)/g share splits into (m-1)/m inside and (s-1)/(s m) across
    full = nbytes * size / (size - 1)
    t = 0.0
    if per > 1:
        t += full * (per - 1) / per / intra
    t += full * (spans - 1) / (spans * per) / inter
    return t


@dataclass(frozen=True)
class _Stage:
    """What one pipeline stage's communication depends on: its layers' kinds, its tokens per micro-batch, how many
    passes run over them."""
    kinds: list  # mixer of each layer (kda / mla)
    ffns: list  # FFN of each layer (dense / moe)
    stages: list  # every stage's (start, end) layers
    stage: int
    n: float  # tokens of a micro-batch on this CP rank
    n_rank: float  # tokens this rank routes through the MoE
    passes: int  # forward, backward (+ forward again under full recomputation)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == len(self.stages) - 1


def _tp_bytes(cfg, lay: Layout, w: Workload, st: _Stage) -> float:
    """Tensor parallelism, bytes per micro-batch (the vision tower's parts apart)."""
    if lay.tp <= 1:
        return 0.0
    a, n = w.act_bytes, st.n
    frac = (lay.tp - 1) / lay.tp
    act = n * cfg.hidden_size * a * frac
    exits = len(st.kinds) + sum(1 for f in st.ffns if f == "dense" or cfg.num_shared_experts)
    per_exit = 2 * act  # enter + exit (all-gather + reduce-scatter, or all-reduce pair)
    small = 0.0
    for k in st.kinds:
        if k == "kda":
            small += cfg.decay_rank + (cfg.kda_head_dim if cfg.kda_output_gate == "lowrank" else 0)
        else:
            small += (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim
    tp_bytes = st.passes * (exits * per_exit + n * small * a * frac)
    if st.last:
        tp_bytes += 2 * act + st.passes * 3 * n * 4  # LM head input gather (+ grad), cross-entropy reductions
    if st.first:
        tp_bytes += 2 * act  # vocab-parallel embedding reduction (+ grad)
    return tp_bytes


def _cp_bytes(cfg, lay: Layout, w: Workload, st: _Stage) -> float:
    """Context parallelism, bytes per micro-batch."""
    if lay.cp <= 1:
        return 0.0
    frac = lay.cp - 1  # all-gather: receive every other rank's shard
    lat = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * w.act_bytes
    cp_bytes = st.kinds.count("mla") * st.passes * st.n * lat * frac
    # KDA: the transition [K, K] and end state from zero [K, V] per head (fp32) of each of the rank's two zigzag
    # chunks, all-gathered for the scan that hands every chunk its initial state (parallel/context.py)
    K = cfg.kda_head_dim
    state = 2 * cfg.kda_num_heads / lay.tp * (K * K + K * K) * 4
    return cp_bytes + st.kinds.count("kda") * st.passes * state * frac


def _ep_bytes(cfg, lay: Layout, w: Workload, st: _Stage):
    """Expert parallelism: (bytes per micro-batch (dispatch + combine, forward and backward), balanced dispatch's
    parts per micro-batch, its parts exchanged once per step (moe.replica_exchange=step))."""
    n_moe = st.ffns.count("moe")
    if lay.ep <= 1 or not n_moe:
        return 0.0, {}, {}
    bal = balanced_moe(cfg, lay, w)
    if bal is None:
        rows = st.n_rank * cfg.top_k * cfg.expert_width * w.act_bytes * (lay.ep - 1) / lay.ep
        return n_moe * 2 * st.passes * rows, {}, {}
    forwards = st.passes - 1  # the forward, again under full recomputation (the replicas are exchanged again)
    wb, gb = replica_bytes_per_param(cfg, w), replica_bytes_per_param(cfg, w, grads=True)  # peft=lora: codes
    own = n_moe * bal.owner_exchange_bytes(wb)
    per_micro = w.replica_exchange != "step"  # the owners' slices to the relays, out and their gradient back
    parts = {"tokens": n_moe * st.passes * bal.token_bytes(w.act_bytes),
             "metadata": n_moe * forwards * bal.metadata_bytes(),
             "replica_weights": n_moe * forwards * bal.host_exchange_bytes(wb)
             + (forwards * own if per_micro else 0.0),
             "replica_grads": n_moe * bal.host_exchange_bytes(gb) + (own * gb / wb if per_micro else 0.0)}
    step = {}
    if not per_micro:  # moe.replica_exchange=step: once per step (in fp32, the relay's store; peft=lora: the codes
        # as they are, the adapters in fp32)
        g32 = n_moe * bal.owner_exchange_bytes(gb * 4 / w.weight_bytes)
        step = {"replica_weights": own * 4 / w.weight_bytes if not w.peft else own * (wb - gb) / wb + g32,
                "replica_grads": own * 4 / w.weight_bytes if not w.peft else g32}
    return sum(parts.values()), parts, step


def _pp_comm(cfg, cluster, lay: Layout, w: Workload, st: _Stage):
    """Pipeline, per micro-batch: (bytes, seconds) of the activations forward and gradients backward at each stage
    boundary (per device: its own boundary, the worst one)."""
    if lay.pp <= 1:
        return 0.0, 0.0
    worst = 0.0
    for _, b in st.stages[:-1]:
        blocks = (-(-b // cfg.attn_res_block_size) + 1) if cfg.attn_res else 0
        payload = (blocks + 1) * st.n_rank * cfg.hidden_size * w.act_bytes
        worst = max(worst, payload)
    pp_bytes = 2 * worst  # send forward, receive the gradient
    return pp_bytes, collective_time(pp_bytes, 2, lay.world // lay.pp, cluster)


def gradient_reductions(lay: Layout, w: Workload) -> int:
    """How many times a step reduces the gradients DeepSpeed holds: under ZeRO-2 after every micro-batch's backward
    (DeepSpeed's partition_gradients), else once at the step's last."""
    return max(1, w.global_batch_size // (w.micro_batch_size * lay.dp)) if w.zero_stage >= 2 and lay.dp else 1


def _dp_comm(cfg, cluster, lay: Layout, w: Workload, st: _Stage):
    """Data parallelism and the optimizer's collectives per step: ({kind: bytes}, {kind: seconds}) for
    dp_grad_reduce and dp_param_gather over the data-parallel group (dp x cp: the dense parameters, and the routed
    experts at ep = 1; under ZeRO-2 once per micro-batch, `gradient_reductions`), the routed experts'
    edp_grad_reduce and edp_param_gather under ep > 1, and Muon's tp_muon_gather."""
    start, end = st.stages[st.stage]
    mp = model_params(cfg, lay.tp, lay.ep, w.peft, w.per_head)  # peft=lora: the adapters' gradients only
    groups = [lp.dense for lp in mp.layers[start:end]]
    if st.first:
        groups.append(mp.embedding)
        if not cfg.freeze_vision:  # the vision tower and projector (model.vision), like any dense parameter
            groups.append(mp.vision)
    if st.last:
        groups.append(mp.head)
    d = sum(groups, ParamGroup())
    dense, dense_muon, gathered, largest = d.total, d.muon, d.tp_gather, d.largest_shard
    e = sum((lp.experts for lp in mp.layers[start:end]), ParamGroup())  # this EP rank's
    experts = e.total
    in_zero = lay.experts_in_zero  # at ep = 1 DeepSpeed reduces the experts with the dense parameters
    g_dense = lay.dp * lay.cp
    g_exp, exp_stride = (g_dense, lay.tp) if in_zero else (lay.edp, lay.ep)
    rs = 2 if w.zero_stage == 0 else 1  # ZeRO-0 all-reduces (= reduce-scatter + all-gather of gradients)
    # ZeRO-2 reduces after every micro-batch's backward (into the partition it accumulates), ZeRO-0/1 once per step
    reductions = gradient_reductions(lay, w)
    rs *= reductions
    dp_bytes_dense = dense * w.grad_bytes * rs * (g_dense - 1) / g_dense if g_dense > 1 else 0.0
    dp_bytes_exp = experts * w.grad_bytes * rs * (g_exp - 1) / g_exp if g_exp > 1 and in_zero else 0.0
    ag_dense = dense * w.weight_bytes * (g_dense - 1) / g_dense if (g_dense > 1 and w.zero_stage >= 1) else 0.0
    ag_exp = experts * w.weight_bytes * (g_exp - 1) / g_exp if (g_exp > 1 and w.zero_stage >= 1 and in_zero) else 0.0
    # training.expert_optimizer under ep > 1: after the last backward each expert's fp32 gradient reduce-scattered
    # over edp to the owner of its block of whole experts, after the step the blocks all-gathered in the weights'
    # dtype; both over the experts padded to edp equal blocks (layout.expert_block)
    padded = experts * lay.expert_share(cfg.num_experts) * g_exp
    edp_rs = padded * 4 * (g_exp - 1) / g_exp if g_exp > 1 and not in_zero else 0.0
    edp_ag = padded * w.weight_bytes * (g_exp - 1) / g_exp if g_exp > 1 and not in_zero else 0.0
    t_grad = (collective_time(dp_bytes_dense, g_dense, lay.tp, cluster)
              + collective_time(dp_bytes_exp, g_exp, exp_stride, cluster))
    t_param = (collective_time(ag_dense, g_dense, lay.tp, cluster)
               + collective_time(ag_exp, g_exp, exp_stride, cluster))
    tp_muon = 0.0
    if w.optimizer == "muon":
        # optim.muon: the fp32 update of each TP-sharded matrix it orthogonalises whole, all-gathered over TP in the
        # step (optim.grouping.tp_gathered), under ZeRO by the DP rank whose partition holds the matrix (a 1/(dp x cp)
        # share each). DeepSpeed (ZeRO-1/2): a Muon matrix a partition boundary cuts is all-reduced instead of
        # reduced to its owner, inside the gradient reduction: at most one per boundary and Muon group (3 dense
        # rules, and the experts' at ep = 1), counted as one more reduction of the largest such parameter
        zero = w.zero_stage >= 1 and g_dense > 1
        tp_muon = gathered * 4 * (lay.tp - 1) / (g_dense if zero else 1)
        if zero:
            ex = e if in_zero else ParamGroup()
            cut = (3 + (ex.muon > 0)) * (g_dense - 1) * max(largest, ex.largest_shard)
            split = min(dense_muon + ex.muon, cut) * w.grad_bytes * (g_dense - 1) / g_dense * reductions
            dp_bytes_dense += split
            t_grad += collective_time(split, g_dense, lay.tp, cluster)
    return ({"dp_grad_reduce": dp_bytes_dense + dp_bytes_exp, "dp_param_gather": ag_dense + ag_exp,
             "tp_muon_gather": tp_muon, "edp_grad_reduce": edp_rs, "edp_param_gather": edp_ag},
            {"dp_grad_reduce": t_grad, "dp_param_gather": t_param,
             "tp_muon_gather": collective_time(tp_muon, lay.tp, 1, cluster),
             "edp_grad_reduce": collective_time(edp_rs, g_exp, lay.ep, cluster),
             "edp_param_gather": collective_time(edp_ag, g_exp, lay.ep, cluster)})


def training_comm(cfg, cluster, lay: Layout, w: Workload, stage: int = 0) -> StepComm:
    """Bytes and seconds per step for the device on pipeline stage `stage`."""
    stages = stage_layers(cfg, lay.pp)
    start, end = stages[stage]
    n = w.micro_batch_size * w.seq_length / lay.cp
    st = _Stage(kinds=cfg.layer_types()[start:end], ffns=cfg.ffn_types()[start:end], stages=stages, stage=stage,
                n=n, n_rank=n / lay.tp if lay.sp else n, passes=3 if lay.recompute == "full" else 2)
    m = max(1, w.global_batch_size // (w.micro_batch_size * lay.dp))  # micro-batches per step
    gbps = cluster.intra_supernode_gbps * GB

    vision_parts = vision_tp_bytes(cfg, lay, w) if stage == 0 else {}
    vision_step = vision_parts.pop("grad_all_reduce", 0.0)  # once per step
    tp_bytes = _tp_bytes(cfg, lay, w, st) + sum(vision_parts.values())
    tp_time = collective_time(tp_bytes, lay.tp, 1, cluster)
    tp_step_time = collective_time(vision_step, lay.tp, 1, cluster) if vision_step else 0.0
    cp_bytes = _cp_bytes(cfg, lay, w, st)
    cp_time = collective_time(cp_bytes, lay.cp, lay.tp, cluster)
    ep_bytes, ep_parts, ep_step = _ep_bytes(cfg, lay, w, st)
    ep_time = ep_bytes / gbps if ep_bytes else 0.0
    pp_bytes, pp_time = _pp_comm(cfg, cluster, lay, w, st)
    dp_bytes, dp_time = _dp_comm(cfg, cluster, lay, w, st)

    out = StepComm()
    ep_once = sum(ep_step.values())
    out.bytes_by_kind = {"tp": m * tp_bytes + vision_step, "cp": m * cp_bytes, "ep": m * ep_bytes + ep_once,
                         "pp": m * pp_bytes, **dp_bytes}
    out.time_by_kind = {"tp": m * tp_time + tp_step_time, "cp": m * cp_time, "ep": m * ep_time + ep_once / gbps,
                        "pp": m * pp_time, **dp_time}
    out.per_micro_time = {"tp": tp_time, "cp": cp_time, "ep": ep_time, "pp": pp_time}
    out.per_step_time = {"tp": tp_step_time, "ep": ep_once / gbps}
    step_bytes = {k: m * v + ep_step.get(k, 0.0) for k, v in ep_parts.items()}
    out.ep_detail = {k: (v, v / gbps) for k, v in step_bytes.items()}
    out.vision_tp = {k: (m * v, m * collective_time(v, lay.tp, 1, cluster)) for k, v in vision_parts.items()}
    if vision_step:
        out.vision_tp["grad_all_reduce"] = (vision_step, tp_step_time)
    return out


def vision_tp_bytes(cfg, lay: Layout, w: Workload) -> dict:
    """Bytes one first-stage device sends over TP for the vision tower (module docstring), by part: per micro-batch
    feature_gather and feature_grad_gather (sequence parallelism, trainable), per step grad_all_reduce (trainable,
    fp32); empty without model.vision, media or tensor parallelism."""
    if not cfg.vision.enabled or lay.tp <= 1 or w.image_share <= 0:
        return {}
    K, a, frac = cfg.hidden_size, w.act_bytes, (lay.tp - 1) / lay.tp
    features = w.image_share * w.micro_batch_size * w.seq_length  # N rows of the micro-batch
    share = vision_tp_share(cfg, w.seq_length, w.micro_batch_size, w.image_share, lay.tp)
    out = {"feature_gather": lay.tp * share * features * K * a * frac}  # tp parts of the busiest share's rows
    if not cfg.freeze_vision:
        if lay.sp:  # the [B, T, K] features' gradient, gathered before each rank takes its rows
            out["feature_grad_gather"] = w.micro_batch_size * w.seq_length * K * a * frac
        out["grad_all_reduce"] = 2 * model_params(cfg, lay.tp, lay.ep, w.peft).vision.total * 4 * frac
    return out
