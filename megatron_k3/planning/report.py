"""Human-readable planner output: one plan in detail, a search as a ranked table with the reasoning
(rules applied, why layouts were rejected, what the memory goes to), and the no-fit explanation."""

from __future__ import annotations

from .checkpoint import CheckpointPlan
from .memory import GB, MXFP4_BYTES_PER_PARAM, Workload
from .planner import InferPlan, SearchResult, TrainPlan

__all__ = ["header", "render_train", "render_infer", "render_train_search", "render_infer_search", "rejected",
           "render_checkpoint", "render_balanced", "render_vision"]


def _h(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if abs(n) >= div:
            return f"{n / div:.4g}{unit}"
    return f"{n:.4g}"


def _bytes(n: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.3g} B"


def _t(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def header(cfg, cluster, counts: dict) -> list:
    c = cluster
    sn = c.world_size // c.supernode_size if c.world_size >= c.supernode_size else 1
    return [
        f"model {cfg.name}: {_h(counts['total'])} parameters, {_h(counts['active'])} active per token "
        f"(tools/param_count.py: total={counts['total']}, active={counts['active']}); {cfg.num_layers} layers "
        f"({cfg.layer_types().count('kda')} KDA, {cfg.layer_types().count('mla')} MLA), "
        f"{cfg.ffn_types().count('moe')} MoE x {cfg.num_experts} experts, top-{cfg.top_k}"
        + _vision_header(cfg, counts),
        f"cluster {c.name}: {c.world_size} accelerator{'s' if c.world_size > 1 else ''} x {c.device_memory_gb:g} GB "
        f"({sn} supernode{'s' if sn > 1 else ''} of {min(c.supernode_size, c.world_size)}), "
        f"{c.peak_tflops_bf16:g} TFLOP/s bf16 peak ({c.gemm_efficiency:.0%} sustained in GEMMs), links "
        f"{c.intra_supernode_gbps:g} GB/s inside / {c.inter_supernode_gbps:g} GB/s across supernodes, "
        f"{c.reserved_memory_gb:g} GB reserved per device",
    ]


def _vision_header(cfg, counts: dict) -> str:
    b = counts.get("breakdown", {})
    if not cfg.vision.enabled or "vision_tower" not in b:
        return ""
    v = cfg.vision
    return (f"; vision tower {_h(b['vision_tower'])} ({v.num_layers} layers, width {v.hidden_size}, {v.num_heads} "
            f"heads) + projector {_h(b['mm_projector'])}" + (" (frozen: model.freeze_vision)" if cfg.freeze_vision
                                                              else ""))


def render_vision(p: TrainPlan) -> list:
    """The vision tower and projector of a plan as a line item: parameters, the image load assumed and how it
    splits over TP, bytes per first-stage device by kind, FLOPs (share of the step's model FLOPs) and compute time
    on the busiest first-stage device, and its TP traffic (empty without vision)."""
    d = p.vision
    if not d:
        return []
    b = d["bytes_per_device"]
    kinds = ", ".join(f"{k} {_bytes(v)}" for k, v in b.items() if v > 0)
    frozen = ("frozen (model.freeze_vision): weights only, forward only" if d["frozen"] else
              "trained: gradients and ZeRO-sharded optimizer states like the other dense parameters")
    tp = p.layout.tp
    split = (f"its work split over the {tp} TP ranks by whole media: the busiest encodes {d['tp_work_share']:.1%} "
             f"of each micro-batch's patches" if tp > 1 else "no tensor parallelism: one rank encodes all")
    out = [
        f"vision tower + projector: {_h(d['params'])} parameters ({d['vision_tower_params']:,} tower + "
        f"{d['mm_projector_params']:,} projector) on pipeline stage 0, parameters whole on every TP rank; {frozen}",
        f"  image load (--image-share {d['image_share']:g}): {d['features_per_micro_batch']:,.0f} image features = "
        f"{d['patches_per_micro_batch']:,.0f} patches per micro-batch (4 per feature, one frame) in "
        f"{d['images_per_micro_batch']} image(s) of up to {d['patches_per_image']:,} patches; {split}",
        f"  per stage-0 device: {_bytes(sum(b.values()))} ({kinds}; in the memory above)",
        f"  FLOPs: {d['model_flops_per_step']:.3e} per step = {d['model_flops_share']:.2%} of the model FLOPs; "
        f"{d['device_flops_per_step']:.3e} on the busiest stage-0 device = {_t(d['compute_time_s'])} of compute "
        f"per step",
    ]
    c = d["tp_comm_bytes_per_step"]
    if c:
        parts = ", ".join(f"{k} {_bytes(v)}" for k, v in c.items())
        out.append(f"  TP traffic per stage-0 device (in tp above): {_bytes(sum(c.values()))} per step ({parts}) = "
                   f"{_t(d['tp_comm_time_s'])}")
    return out


def _workload(w: Workload) -> str:
    mixed = w.master_bytes > 0
    recipe = (f"{w.precision}: {w.weight_bytes}-byte weights, {w.grad_bytes}-byte gradients"
              + (", fp32 master" if mixed else ""))
    opt = ("Muon (one fp32 momentum per matrix, AdamW for the rest)" if w.optimizer == "muon"
           else "AdamW (two fp32 moments)")
    moe = ""
    if w.moe_overflow == "balanced":
        slots = "E/ep in each layout" if w.redundant_experts < 0 else f"{w.redundant_experts}"
        moe = (f"; balanced MoE dispatch, moe.redundant_experts={w.redundant_experts} (replica slots per EP rank: "
               f"{slots}), moe.replica_exchange={w.replica_exchange}")
    return (f"workload: {w.global_batch_size} sequences x {w.seq_length} tokens per step "
            f"({_h(w.global_batch_size * w.seq_length)} tokens), micro-batch {w.micro_batch_size}; {recipe}; "
            f"{opt}, ZeRO-{w.zero_stage}; {w.kernels} kernels{moe}")


def render_balanced(p: TrainPlan) -> list:
    """Balanced MoE dispatch of a plan: replica slots, their memory per device, and the replica weights out /
    gradients back per step with their time on the EP links (empty under the other policies)."""
    d = p.moe_dispatch
    if not d:
        return []
    S, El = d["redundant_experts"], d["own_experts"]
    bal = (f"exact balance: every EP rank computes M = {d['pairs_per_rank']:,} pairs per MoE layer and micro-batch"
           if d["exact_balance"] else
           f"balance not exact (S < E/ep); compute buffer {d['compute_rows']:,} rows (worst case) for M = "
           f"{d['pairs_per_rank']:,} pairs")
    gbps = d["link_gbps"]
    held = ("one layer's, transient under full recomputation" if p.layout.recompute == "full" else
            "x the micro-batches in flight, in activations")
    return [
        f"MoE dispatch balanced: moe.redundant_experts={S} replica slots per EP rank beside its {El} own experts "
        f"({d['expert_params']:,} parameters each); {bal} (drop: {d['drop_rows']:,} rows at "
        f"model.moe_capacity_factor={d['capacity_factor']:g}, padding included)",
        f"  replica slot memory per device: {_bytes(d['replica_bytes_per_layer'])} per MoE layer and micro-batch "
        f"(S x P weights), {_bytes(d['replica_memory_gb'] * GB)} held on the largest stage "
        f"({d['moe_layers_on_largest_stage']} MoE layers; {held}) + {_bytes(d['exchange_buffers_gb'] * GB)} exchange "
        f"buffers (transient)",
        f"  replica weights out {_bytes(d['replica_weights_bytes_per_step'])} per step "
        f"({_t(d['replica_weights_s'])} at {gbps:g} GB/s), gradients back {_bytes(d['replica_grads_bytes_per_step'])}"
        f" ({_t(d['replica_grads_s'])}); tokens, two hops each way, {_bytes(d['token_bytes_per_step'])} "
        f"({_t(d['token_s'])}); all in ep",
    ]


def _row(i, p: TrainPlan) -> str:
    b = p.memory_breakdown
    return (f"{i:>3}  {p.layout.short():<44} {p.memory_per_device / GB:8.1f} {b['weights']:7.1f} "
            f"{b['gradients']:6.1f} {b['optimizer']:6.1f} {b['activations']:6.1f} {b['transient']:6.1f}  "
            f"{p.step_time:8.2f} {p.mfu:6.1%} {p.bubble:6.1%}")


_TABLE = (f"{'#':>3}  {'layout':<44} {'GB/dev':>8} {'weights':>7} {'grads':>6} {'optim':>6} {'acts':>6} "
          f"{'trans':>6}  {'step s':>8} {'MFU':>6} {'bubble':>6}")


def _params_line(p: TrainPlan) -> str:
    d = p.params_per_device
    if p.peft:
        return (f"parameters per device: {_h(d['total'])}: frozen base {_h(d['frozen'])} (bf16, routed experts as "
                f"MXFP4), LoRA adapters {_h(d['dense'] + d['routed_experts'])} ({_h(d['dense'])} dense on the TP rank, "
                f"{_h(d['routed_experts'])} on the EP rank's experts); largest pipeline stage")
    return (f"parameters per device: {_h(d['total'])} ({_h(d['dense'])} dense on the TP rank, "
            f"{_h(d['routed_experts'])} routed-expert on the EP rank; largest pipeline stage)")


def render_peft(p: TrainPlan) -> list:
    """peft=lora's line item (nothing without it)."""
    if not p.peft:
        return []
    f = p.peft
    return [f"peft=lora rank {f['rank']} alpha {f['alpha']:g} on {','.join(f['targets'])}: {_h(f['trainable_params'])} "
            f"adapter parameters train over {_h(f['frozen_params'])} frozen; MFU of the trained FLOPs (forward, "
            f"input gradients, adapters) {f['mfu_trained']:.1%}, of the forward FLOPs alone {f['mfu_forward']:.1%}"]


def render_train(p: TrainPlan) -> list:
    lay, w = p.layout, p.workload
    b = p.memory_breakdown
    out = [_workload(w),
           f"layout: {lay.short()}  (dp = world / (tp*pp*cp) = {lay.dp}; routed experts over ep x edp = "
           f"{lay.ep} x {lay.edp}; {p.micro_batches} micro-batches per step per pipeline)",
           _params_line(p),
           f"memory per device: {p.memory_per_device / GB:.2f} GB of {p.capacity_gb:g} GB -> "
           f"{'FITS' if p.fits else 'DOES NOT FIT'}" + (" (host memory: see below)" if p.host_over else ""),
           "  " + ", ".join(f"{k} {v:.2f}" for k, v in b.items()) + " (GB)",
           "  activations by part: " + ", ".join(f"{k} {v:.3g}" for k, v in p.activation_breakdown.items()
                                                  if v > 0) + " (GB)",
           f"  stages (GB): {p.stage_memory_gb}"]
    if p.host_per_node_gb:
        over = f" -> OVER: at most {p.host_share_gb:.4g} GB per device fits"
        out.append(f"  host memory per node for offloaded layer inputs: {p.host_per_node_gb:.3g} GB (every device's "
                   f"share up to train.offload_buffer_gb) of cluster.host_memory_gb={p.host_capacity_gb:g}"
                   + (over if p.host_over else ""))
    out += ["communication per step and device: " + (", ".join(
               f"{k} {_bytes(v)} ({_t(p.comm_time[k])})" for k, v in p.comm_bytes.items() if v > 0) or "none"),
           "time per step: " + ", ".join(f"{k} {_t(v)}" for k, v in p.time_breakdown.items() if v > 0)
           + f" -> {p.step_time:.3g} s",
           f"pipeline bubble {p.bubble:.1%}; model FLOPs per step {p.model_flops_per_step:.3e}; "
           f"MFU {p.mfu:.1%}; {p.tokens_per_s:,.0f} tokens/s"]
    out += render_balanced(p)
    out += render_peft(p)
    out += render_vision(p)
    out += [f"note: {n}" for n in p.notes]
    return out


def _dur(s: float) -> str:
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 100:
        return f"{s:.3g} s"
    return f"{s / 60:.3g} min" if s < 6000 else f"{s / 3600:.3g} h"


def render_checkpoint(ck: CheckpointPlan) -> list:
    """The checkpoint of a layout: size per rank, save and load time, the step-loop stall of a synchronous and of an
    asynchronous save (megatron_k3.planning.checkpoint)."""
    st = ck.storage
    states = "Muon momentum + AdamW moments" if ck.optimizer == "muon" else "AdamW moments"
    per_node = f"{ck.devices_per_node} rank{'s' if ck.devices_per_node > 1 else ''} per node"

    def cost(stall):
        parts = [f"{stall / ck.step_time:.3g} steps"] if ck.step_time else []
        o = ck.overhead(stall)
        if o is not None:
            parts.append(f"{o * 100:.2g}% of the run at train.save_interval={ck.save_interval}" if o < 1
                         else f"{o:.3g}x the training time at train.save_interval={ck.save_interval}")
        return f" ({'; '.join(parts)})" if parts else ""

    out = [
        f"checkpoint (sharded, each byte once: fp32 masters + {states} + buffers): {_bytes(ck.total)}; per rank "
        f"max {_bytes(ck.max_share)} (stage {ck.largest_stage}), mean {_bytes(ck.mean_share)}, min "
        f"{_bytes(ck.min_share)}",
        f"  save {_dur(ck.save_time)}, load the same, {ck.bound} bound: {_bytes(ck.total)} / --fs-bandwidth "
        f"{st.fs_gbps:g} GB/s aggregate = {_dur(ck.fs_time)}; largest share / {ck.per_rank_gbps:.3g} GB/s per rank "
        f"= {_dur(ck.rank_time)} (min(--node-fs-bandwidth {st.node_gbps:g} / {per_node}, --host-copy-bandwidth "
        f"{st.host_copy_gbps:g}))",
        f"  step-loop stall per save: synchronous{' (the run' + chr(39) + 's)' if ck.async_save is False else ''} "
        f"{_dur(ck.save_time)}{cost(ck.save_time)}; asynchronous (checkpoint.async_save=true"
        f"{'; the run' + chr(39) + 's' if ck.async_save else ''}) {_dur(ck.async_stall)}{cost(ck.async_stall)}: "
        f"the largest share copied to host at --host-copy-bandwidth {st.host_copy_gbps:g} GB/s "
        f"({_bytes(ck.host_snapshot_per_node)} of pinned host memory per node), the write overlapping training",
    ]
    if ck.async_wait > 0:
        out.append(f"  note: the write ({_dur(ck.save_time)}) outlasts train.save_interval={ck.save_interval} steps "
                   f"({_dur(ck.save_interval * ck.step_time)}): an asynchronous save first waits "
                   f"{_dur(ck.async_wait)} for the previous one (counted in its stall)")
    return out


def rejected(res: SearchResult) -> str:
    """The search's rejected candidates by rule, the most frequent first ("" when none was)."""
    return "; ".join(f"{v} x {k}" for k, v in sorted(res.invalid.items(), key=lambda kv: -kv[1]))


def render_train_search(cfg, cluster, w: Workload, res: SearchResult, infer: SearchResult | None = None,
                        infer_args: tuple = (), checkpoint: CheckpointPlan | None = None) -> list:
    world = cluster.world_size
    floor = res.state_floor_bytes
    pool = world * cluster.device_memory_gb * GB
    blocks = cfg.num_attn_res_blocks if cfg.attn_res else cfg.num_layers
    out = [_workload(w),
           f"rules: TP groups inside a node of {cluster.devices_per_node}, TP and EP groups inside a supernode of "
           f"{cluster.supernode_size}; ep divides {cfg.num_experts} experts; pipeline stages hold whole AttnRes "
           f"blocks (pp <= {blocks}); global batch divisible by micro-batch x dp; recompute none/selective/full",
           f"model states alone (weights + gradients + master + optimizer, unsharded): {_bytes(floor)} = "
           f"{floor / pool:.0%} of the {_bytes(pool)} on {world} accelerators (activations come on top)",
           f"searched {res.evaluated} valid layouts; rejected: {rejected(res) or 'none'}"]
    if res.fits:
        out += [f"{len(res.fits)} best of the layouts that fit in {cluster.device_memory_gb:g} GB, fastest first "
                f"(GB per device on the fullest pipeline stage; step time and MFU estimated):", _TABLE]
        out += [_row(i + 1, p) for i, p in enumerate(res.fits)]
        best = res.fits[0]
        out += ["", f"best: {best.layout.short()}"] + ["  " + line for line in render_train(best)[1:]]
        if checkpoint is not None:
            out += ["  " + line for line in render_checkpoint(checkpoint)]
        out += _why_best(res)
        return out
    out += _no_fit(cluster, res, pool)
    if infer is not None:
        batch, context = infer_args
        if infer.fits:
            q = infer.fits[0]
            out.append(f"inference (--mode infer; routed experts MXFP4, the rest bf16; {batch} sequences x "
                       f"{context} tokens): FITS on {world} accelerators: {q.memory.total / GB:.1f} GB per device "
                       f"with tp{q.tp} ep{q.ep} pp{q.pp} ({_infer_parts(q)})")
        else:
            out.append(f"inference (--mode infer, {batch} x {context}): does not fit either")
    return out


def _no_fit(cluster, res: SearchResult, pool: float) -> list:
    """Why no layout fits: the model-state floor, the least-memory layouts, the long-sequence keys that fit, the
    accelerator count that would."""
    world, floor = cluster.world_size, res.state_floor_bytes
    out = [f"NO training layout fits {world} x {cluster.device_memory_gb:g} GB."]
    if floor > pool:
        out.append(f"  why: the model states alone need {_bytes(floor)}, {floor / pool:.1f}x the {_bytes(pool)} "
                   f"these {world} accelerators hold; even perfectly sharded that is "
                   f"{floor / world / GB:.0f} GB per device before any activation.")
    if res.over_memory:
        least = res.over_memory[0]
        out += [f"  least memory of the {res.evaluated} valid layouts (GB per device):", _TABLE]
        out += [_row(i + 1, p) for i, p in enumerate(res.over_memory[:5])]
        b = least.memory_breakdown
        host = [p for p in res.over_memory if p.memory_per_device <= p.capacity_gb * GB]  # over the host's alone
        if host:
            out.append(f"  {len(host)} of them fit the {cluster.device_memory_gb:g} GB but not the host memory: "
                       f"{host[0].layout.short()}'s offloaded layer inputs take {host[0].host_per_node_gb:.3g} GB "
                       f"per node, over cluster.host_memory_gb={cluster.host_memory_gb:g} (at most "
                       f"{cluster.host_memory_per_device_gb:.4g} GB per device; "
                       "train.offload_buffer_gb caps it, what does not fit stays on the device)")
        else:
            out.append(f"  even {least.layout.short()} needs {least.memory_per_device / GB:.0f} GB per device: "
                       f"weights {b['weights']:.0f}, gradients {b['gradients']:.0f}, optimizer {b['optimizer']:.0f} "
                       f"({_h(least.params_per_device['routed_experts'])} routed-expert parameters on each device: "
                       f"the experts split at most ep x pp = {least.layout.ep * least.layout.pp} ways here)")
    if res.long_sequence is not None:
        p = res.long_sequence
        out.append(f"  with the trainer's long-sequence knobs {res.long_sequence_keys}: {p.layout.short()} fits these "
                   f"{world}, {p.memory_per_device / GB:.1f} GB per device, step {p.step_time:.3g} s, MFU {p.mfu:.1%} "
                   "(add the keys to the command to rank every layout with them)")
    if res.min_world:
        p = res.min_world_plan
        out.append(f"  {'without them, ' if res.long_sequence is not None else ''}training needs at least "
                   f"{res.min_world} accelerators ({res.min_world // cluster.supernode_size}"
                   f" supernodes of {cluster.supernode_size}) of this kind: best layout there "
                   f"{p.layout.short()}, {p.memory_per_device / GB:.0f} GB per device, step {p.step_time:.3g} s, "
                   f"MFU {p.mfu:.1%}")
    else:
        out.append("  no whole number of supernodes up to the search limit fits either")
    return out


def _why_best(res: SearchResult) -> list:
    best = res.fits[0]
    t = best.time_breakdown
    parts = sorted(((k, v) for k, v in t.items() if v > 0), key=lambda kv: -kv[1])
    out = ["why: fastest estimated step among the fits; its time goes to "
           + ", ".join(f"{k} {v / best.step_time:.0%}" for k, v in parts[:4])]
    if len(res.fits) > 1:
        nxt = res.fits[1]
        out.append(f"  runner-up {nxt.layout.short()} is {nxt.step_time / best.step_time - 1:.1%} slower "
                   f"({nxt.memory_per_device / GB:.0f} GB per device)")
    return out


def _infer_parts(q: InferPlan) -> str:
    b = q.memory.breakdown_gb()
    return ", ".join(f"{k} {v:.3g}" for k, v in b.items() if v > 0) + " GB"


def render_infer(q: InferPlan) -> list:
    mb = q.model_bytes
    world = q.world
    return [
        f"inference: routed experts in MXFP4 ({MXFP4_BYTES_PER_PARAM * 8:.2f} bits per weight), the rest bf16: "
        f"model {_bytes(mb['mxfp4_experts'] + mb['bf16_part'])} ({_bytes(mb['mxfp4_experts'])} experts + "
        f"{_bytes(mb['bf16_part'])} bf16)",
        f"requests: {q.batch} sequences x {q.context} tokens of context; KDA state "
        f"{_bytes(q.kda_state_per_sequence)} per sequence (fp32 [H, K, V] per KDA layer + conv state), MLA latent "
        f"cache {q.mla_cache_per_token / 1e3:.3g} KB per token",
        f"layout: tp{q.tp} ep{q.ep} pp{q.pp}, attention data-parallel {world // (q.tp * q.pp)}; "
        f"{q.memory.sequences_per_device} sequences per device",
        f"memory per device: {q.memory.total / GB:.2f} GB of {q.capacity_gb:g} GB -> "
        f"{'FITS' if q.fits else 'DOES NOT FIT'}",
        "  " + _infer_parts(q),
        f"decode: {_t(q.decode_step_s)} per step for the batch ({q.decode_bound} bound), "
        f"{q.decode_tokens_per_s:,.0f} tokens/s; all-to-all {_bytes(q.comm_bytes.get('ep', 0))} per step",
    ] + [f"note: {n}" for n in q.notes]


def render_infer_search(res: SearchResult, batch: int, context: int) -> list:
    out = [f"searched {res.evaluated} serving layouts for {batch} sequences x {context} tokens; rejected: "
           + ("; ".join(f"{v} x {k}" for k, v in res.invalid.items()) or "none")]
    if not res.fits:
        out.append("NO serving layout fits; least memory:")
        for q in res.over_memory[:5]:
            out.append(f"  tp{q.tp} ep{q.ep} pp{q.pp}: {q.memory.total / GB:.1f} GB ({_infer_parts(q)})")
        return out
    out.append(f"{'#':>3}  {'layout':<16} {'GB/dev':>8} {'decode tok/s':>13}  breakdown")
    for i, q in enumerate(res.fits):
        out.append(f"{i + 1:>3}  {f'tp{q.tp} ep{q.ep} pp{q.pp}':<16} {q.memory.total / GB:8.1f} "
                   f"{q.decode_tokens_per_s:13,.0f}  {_infer_parts(q)}")
    out += ["", "best:"] + ["  " + line for line in render_infer(res.fits[0])]
    return out
