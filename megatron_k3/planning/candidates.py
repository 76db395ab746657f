"""The planner's candidate layouts (`Layout`): sizes, derived group sizes, and which layouts it considers on a
cluster (the rules of megatron_k3.layout, which config validation and the parallel state apply too, plus its own
preferences: `planner_problems`).

Rank order is megatron_k3.parallel.state's default `tp-cp-ep-dp-pp` (TP fastest, PP outermost); routed
experts use the folded expert grid (etp = 1, ep, edp, pp), so edp = world / (ep * pp).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.schema import recomputed_kinds
from ..layout import Problem, expert_block, has_moe, rules, stage_layers

__all__ = ["Layout", "planner_problems", "stage_layers", "group_span"]


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    sequence_parallel: bool = True  # only meaningful when tp > 1
    recompute: str = "none"  # none, selective, full (training)
    recompute_modules: tuple = ()  # selective: the module kinds recomputed (empty: all; train.recompute_modules)
    recompute_num_layers: int = 0  # full: layers per stage recomputed, from its first (0: all)
    tile_tokens: int = 0  # train.tile_tokens: MoE, shared experts, LM head + loss over tiles of this many tokens
    offload_bytes: float = 0.0  # train.offload_buffer_gb (bytes): host memory per device for full's layer inputs

    @property
    def recomputed(self) -> frozenset:
        """The module kinds selective recomputation rebuilds (empty unless recompute == "selective")."""
        return recomputed_kinds(self.recompute, self.recompute_modules)

    def full_layers(self, a: int, b: int) -> range:
        """The layers of stage [a, b) that full recomputation checkpoints whole (none unless recompute == "full")."""
        if self.recompute != "full":
            return range(a, a)
        return range(a, min(b, a + self.recompute_num_layers) if self.recompute_num_layers else b)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.world // (self.ep * self.pp)

    @property
    def experts_in_zero(self) -> bool:
        """Whether DeepSpeed holds the routed experts: at ep = 1, with the dense parameters, ZeRO-partitioned over
        dp x cp (whole on every TP rank); under ep > 1 training.expert_optimizer steps them, their states sharded
        over the edp ranks that hold an expert in blocks of whole experts (`expert_share`)."""
        return self.ep == 1

    def expert_share(self, num_experts: int) -> float:
        """Under ep > 1: the share of an EP rank's routed experts whose fp32 masters, optimizer states, fp32 gradients
        and Newton-Schulz work the fullest edp rank has (training.expert_optimizer's first block,
        layout.expert_block: ceil(E/edp) of E); 1 at ep = 1 (the experts are then in ZeRO's partitions)."""
        local = num_experts // self.ep
        return expert_block(local, self.edp, 0)[1] / local if self.ep > 1 and local else 1.0

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    def as_dict(self) -> dict:
        return {"world": self.world, "tp": self.tp, "pp": self.pp, "ep": self.ep, "cp": self.cp, "dp": self.dp,
                "edp": self.edp, "etp": 1, "sequence_parallel": self.sp, "recompute": self.recompute,
                "recompute_modules": sorted(self.recomputed), "recompute_num_layers": self.recompute_num_layers,
                "tile_tokens": self.tile_tokens, "offload_gb": self.offload_bytes / 1e9}

    def trainer_keys(self, given: tuple = (0, 0, 0.0)) -> str:
        """The train.* overrides that run this layout's recomputation, tiling and offload over a run whose
        (train.recompute_num_layers, train.tile_tokens, train.offload_buffer_gb in bytes) are `given`: each key whose
        value differs from the run's, and train.recompute."""
        full = self.recompute == "full"
        keys = [f"train.recompute={self.recompute}"]
        for name, mine, theirs in (("recompute_num_layers", self.recompute_num_layers if full else 0, given[0]),
                                   ("tile_tokens", self.tile_tokens, given[1]),
                                   ("offload_buffer_gb", (self.offload_bytes if full else 0.0) / 1e9, given[2] / 1e9)):
            if mine != theirs:
                keys.append(f"train.{name}={format(mine, 'g') if isinstance(mine, float) else mine}")
        return " ".join(keys)

    def short(self) -> str:
        rc = self.recompute
        if self.recompute == "selective" and self.recompute_modules:
            rc += "[" + ",".join(self.recompute_modules) + "]"
        elif self.recompute == "full" and self.recompute_num_layers:
            rc += f"[{self.recompute_num_layers}/stage]"
        extra = (f" tile={self.tile_tokens}" if self.tile_tokens else "") + (
            f" offload={self.offload_bytes / 1e9:g}GB" if self.offload_bytes and self.recompute == "full" else "")
        return (f"tp{self.tp} pp{self.pp} ep{self.ep} cp{self.cp} dp{self.dp} edp{self.edp}"
                f"{' sp' if self.sp else ''} rc={rc}{extra}")


def group_span(size: int, stride: int, supernode: int) -> tuple:
    """(members per supernode, supernodes spanned) of a group of `size` ranks spaced `stride` apart."""
    if size <= 1:
        return 1, 1
    extent = size * stride
    if extent <= supernode:
        return size, 1
    per = max(1, supernode // stride)
    return per, -(-size // per)


def planner_problems(cfg, cluster, lay: Layout, w) -> list:
    """Why `lay` is not a layout the planner considers on `cluster` for workload `w` (a memory.Workload; empty
    list: it is), as layout.Problem: first the rules every layout must obey (megatron_k3.layout: the rank grid in
    the default order, sharding, pipeline stages, context-parallel chunks, tokens per rank, the batch, balanced
    dispatch's replica slots, the token tiles), then the planner's own preferences (tensor parallelism inside a node
    and TP x CP inside a supernode, no EP without experts), and that a vision-language model runs without context
    parallelism (parallel.context refuses media)."""
    if lay.recompute not in ("none", "selective", "full"):
        return [Problem("train.recompute", lay.recompute, "valid: none, selective, full", "a known policy")]
    out = rules.layout_problems(
        cfg, lay.world, tp=lay.tp, pp=lay.pp, ep=lay.ep, cp=lay.cp, supernode_size=cluster.supernode_size,
        sequence_parallel=lay.sp, micro_batch_size=w.micro_batch_size, global_batch_size=w.global_batch_size,
        seq_length=w.seq_length, redundant_experts=w.redundant_experts, moe_overflow=w.moe_overflow,
        tile_tokens=lay.tile_tokens, zero_stage=w.zero_stage,
        bf16_weights=w.precision if w.weight_bytes == 2 else "")
    sn, node = cluster.supernode_size, cluster.devices_per_node
    if lay.tp > node and node > 1:
        out.append(Problem("parallel.tp", lay.tp, f"a TP group of {lay.tp} spans more than one node of {node}",
                           "TP inside one node"))
    if lay.tp * lay.cp > sn:
        out.append(Problem("parallel.cp", lay.cp, f"TP x CP = {lay.tp * lay.cp} would cross a supernode of {sn}",
                           "TP x CP inside one supernode"))
    if not has_moe(cfg) and lay.ep > 1:
        out.append(Problem("parallel.ep", lay.ep, "ep > 1 without MoE layers", "EP only with MoE layers"))
    if cfg.vision.enabled and lay.cp > 1:
        out.append(Problem("parallel.cp", lay.cp, "context parallelism does not take media (model.vision.enabled)",
                           "no context parallelism with media"))
    return out
