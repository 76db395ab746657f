"""Checkpoint size per rank and the time to save and load it, for a training layout (the fully sharded checkpoint
of issue 20: every rank writes only what it owns, each byte once).

What a checkpoint holds, each once: the fp32 master of every parameter (4 B; under precision=fp32 the weights are
the masters), the optimizer states (AdamW: exp_avg + exp_avg_sq, 8 B; Muon: one fp32 momentum for the matrices it
updates, 4 B, and AdamW's 8 B for the parameters routed to AdamW; the same accounting as memory.py's) and the
persistent buffers at their dtype (the router's bias); with model.vision the tower and projector like any dense
parameter on the first stage (frozen, model.freeze_vision: their fp32 weights only, written with the buffers). The
total does not depend on the layout, the precision or the ZeRO stage.

Who writes what (training/checkpoint/deepspeed_state.owned_pieces), from the planner's per-rank counts
(params.model_params, the model's own construction):

* dense parameters (all but the routed experts) of a pipeline stage, under ZeRO-1/2: one TP rank's shard is split
  over the dp x cp ranks that hold it (its ZeRO partitions); tensors every TP rank holds whole (norms, the router,
  the MoE latent projections, ...) are written by TP rank 0's partitions only. Under ZeRO-0 every tensor is split
  evenly over all the ranks holding a copy (dp x cp, times tp for a TP-replicated one);
* routed experts under ep > 1: one EP rank's experts are split over its edp replicas in blocks of whole experts
  (layout.expert_block: ceil(E/edp) each, the last shorter), as training.expert_optimizer shards their states; at
  ep = 1 they are dense parameters every TP rank holds whole (written by TP rank 0's partitions under ZeRO-1/2);
* the persistent buffers of a stage by one rank of it (TP and DP rank 0).

So under ZeRO-1/2 the dp x cp ranks of TP rank 0 of a stage write D/(dp cp) + E/edp and the others
(D - R)/(dp cp) + E/edp (E/edp: its block of experts, equal when edp divides an EP rank's experts), where D is one
TP rank's dense bytes, R the part of it every TP rank holds and E one EP rank's expert bytes; summed over the ranks
(with the buffers) that is the total. R comes from the same
construction: a TP rank holds R + S/tp of a stage whose unique dense bytes are R + S (the tp = 1 build). Not
modelled: under ZeRO with Muon a matrix's whole momentum is written by the rank holding its first partition, which
moves at most one matrix's momentum per partition boundary between data-parallel ranks.

Time model (`Storage`: the filesystem's aggregate bandwidth, each node's storage NIC, each device's copy to host):

  per-rank rate   b = min(node NIC / devices per node, host copy)   (the ranks of a node write at once)
  save            max(largest share / b, total / filesystem)        the slowest writer or the filesystem
  load            the same (each rank reads its share; under resharding the bytes its new share needs: the same
                  total, and the same largest share for the layout it loads into)
  step-loop stall synchronous: the save; asynchronous (checkpoint.async_save=true): the device-to-host snapshot of
                  the largest share at the host-copy rate, the write then overlapping training (the snapshot
                  needs that much pinned host memory per rank), plus the wait for the previous save's write
                  where it outlasts train.save_interval steps
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..layout import RankGrid, expert_block, has_moe
from .candidates import Layout, stage_layers
from .memory import GB, _opt_state_bytes
from .params import ParamGroup, model_params

__all__ = ["Storage", "CheckpointPlan", "checkpoint_plan", "rank_shares", "checkpoint_bytes",
           "DEFAULT_FS_GBPS", "DEFAULT_NODE_GBPS", "DEFAULT_HOST_COPY_GBPS"]

DEFAULT_FS_GBPS = 100.0  # aggregate over the cluster: a parallel filesystem (Lustre, GPFS, WEKA) serving the job
DEFAULT_NODE_GBPS = 50.0  # per node: 400 Gb/s of storage network
DEFAULT_HOST_COPY_GBPS = 25.0  # per device, device-to-host into pinned memory (about half of PCIe 5 x16's peak)


@dataclass(frozen=True)
class Storage:
    """Bandwidths in GB/s (1e9 bytes): the filesystem's aggregate over the cluster, one node's storage NIC, one
    device's copy to host memory."""
    fs_gbps: float = DEFAULT_FS_GBPS
    node_gbps: float = DEFAULT_NODE_GBPS
    host_copy_gbps: float = DEFAULT_HOST_COPY_GBPS


def _bytes(group: ParamGroup, optimizer: str) -> float:
    """Checkpoint bytes of a ParamGroup: fp32 masters + optimizer states."""
    return group.total * 4 + _opt_state_bytes(group, optimizer)


def _vision(cfg, mp) -> tuple:
    """(ParamGroup, extra bytes) of the vision tower and projector (model.vision): trainable, a dense group like any;
    frozen (model.freeze_vision), no optimizer owns them: their fp32 weights (4 B), written once per stage like the
    buffers."""
    if cfg.freeze_vision:
        return ParamGroup(), mp.vision.total * 4
    return mp.vision, 0


def checkpoint_bytes(cfg, optimizer: str, peft: tuple = ()) -> float:
    """The whole checkpoint, each byte once: fp32 masters + optimizer states of every parameter + buffers (peft=lora:
    of the adapters, no buffer: the frozen base is not in it)."""
    mp = model_params(cfg, 1, 1, peft)
    vision, frozen = _vision(cfg, mp)
    groups = [mp.embedding, mp.head, vision] + [g for lp in mp.layers for g in (lp.dense, lp.experts)]
    buffers = mp.embedding_buffer_bytes + mp.head_buffer_bytes + sum(lp.buffer_bytes for lp in mp.layers) + frozen
    buffers = 0 if peft else buffers
    return sum(_bytes(g, optimizer) for g in groups) + buffers


def _stage_dense(cfg, mp, a: int, b: int, first: bool, last: bool, peft: tuple = ()) -> tuple:
    """(dense ParamGroup, persistent buffer bytes) of layers [a, b) on one TP rank, with the embedding (and the vision
    tower) / head."""
    dense = sum((lp.dense for lp in mp.layers[a:b]), ParamGroup())
    buffers = sum(lp.buffer_bytes for lp in mp.layers[a:b])
    if first:
        dense, buffers = dense + mp.embedding, buffers + mp.embedding_buffer_bytes
        vision, frozen = _vision(cfg, mp)
        dense, buffers = dense + vision, buffers + frozen
    if last:
        dense, buffers = dense + mp.head, buffers + mp.head_buffer_bytes
    return dense, 0 if peft else buffers


def rank_shares(cfg, lay: Layout, optimizer: str, zero_stage: int = 1, peft: tuple = ()) -> list:
    """Bytes each rank writes, as (stage, bytes per rank, number of such ranks), the ranks of each stage grouped by
    what they write: the one that writes the buffers; under ZeRO-1/2 the other ranks of TP rank 0 (they write the
    TP-replicated tensors) and the other TP ranks'; under ZeRO-0 the rest, all alike. Under ep > 1 each group is
    split further by the size of its ranks' blocks of experts (layout.expert_block) where those differ."""
    mp, one = model_params(cfg, lay.tp, lay.ep, peft), model_params(cfg, 1, 1, peft)
    stages = stage_layers(cfg, lay.pp)
    n_dense = lay.dp * lay.cp
    grid = RankGrid(lay.world, tp=lay.tp, cp=lay.cp, ep=lay.ep, pp=lay.pp)  # the planner's rank order
    local = cfg.num_experts // lay.ep if has_moe(cfg) else 0
    out = []
    for s, (a, b) in enumerate(stages):
        first, last = s == 0, s == len(stages) - 1
        dense_t, buffers = _stage_dense(cfg, mp, a, b, first, last, peft)
        dense_1, _ = _stage_dense(cfg, one, a, b, first, last, peft)
        d_t, d_1 = _bytes(dense_t, optimizer), _bytes(dense_1, optimizer)
        replicated = (lay.tp * d_t - d_1) / (lay.tp - 1) if lay.tp > 1 else 0.0  # R: held whole by every TP rank
        sharded = d_t - replicated  # this TP rank's slice of the TP-split tensors
        experts = _bytes(sum((lp.experts for lp in mp.layers[a:b]), ParamGroup()), optimizer)
        if zero_stage >= 1:
            groups = [(sharded + replicated) / n_dense, (sharded + replicated) / n_dense, sharded / n_dense]
        else:
            groups = [sharded / n_dense + replicated / (lay.tp * n_dense)] * 3
        groups[0] += buffers
        tally = {}
        for r in range(s * lay.world // lay.pp, (s + 1) * lay.world // lay.pp):
            c = grid.coords(r)
            kind = 0 if c["tp"] == 0 and c["cp"] == 0 and c["dp"] == 0 else 1 if c["tp"] == 0 or not zero_stage else 2
            if lay.ep > 1:  # training.expert_optimizer: this rank's block of whole experts
                mine = experts * expert_block(local, lay.edp, c["edp"])[1] / local
            elif zero_stage:  # in DeepSpeed's partitions, whole on every TP rank: TP rank 0's to write, as above
                mine = experts / n_dense if c["tp"] == 0 else 0.0
            else:
                mine = experts / (lay.tp * n_dense)
            tally[(kind, -mine)] = tally.get((kind, -mine), 0) + 1
        out += [(s, groups[kind] - neg, n) for (kind, neg), n in sorted(tally.items())]
    return out


@dataclass
class CheckpointPlan:
    """A layout's checkpoint: its size, who writes how much, and the time to save and load it."""
    optimizer: str
    storage: Storage
    total: float  # bytes
    shares: list  # (stage, bytes per rank, ranks)
    world: int
    devices_per_node: int  # ranks that share a node's storage NIC
    step_time: float | None = None  # seconds per training step (the plan's estimate)
    save_interval: int = 0  # steps between saves (train.save_interval; 0: only at the end)
    async_save: bool | None = None  # the run's checkpoint.async_save where the config has it

    @property
    def max_share(self) -> float:
        return max(b for _, b, _ in self.shares)

    @property
    def min_share(self) -> float:
        return min(b for _, b, _ in self.shares)

    @property
    def mean_share(self) -> float:
        return self.total / self.world

    @property
    def largest_stage(self) -> int:
        return max(self.shares, key=lambda x: x[1])[0]

    @property
    def per_rank_gbps(self) -> float:
        st = self.storage
        return min(st.node_gbps / self.devices_per_node, st.host_copy_gbps)

    @property
    def rank_time(self) -> float:
        return self.max_share / (self.per_rank_gbps * GB)

    @property
    def fs_time(self) -> float:
        return self.total / (self.storage.fs_gbps * GB)

    @property
    def save_time(self) -> float:
        return max(self.rank_time, self.fs_time)

    @property
    def load_time(self) -> float:
        return self.save_time

    @property
    def bound(self) -> str:
        if self.fs_time >= self.rank_time:
            return "filesystem"
        st = self.storage
        return "node NIC" if st.node_gbps / self.devices_per_node <= st.host_copy_gbps else "host copy"

    @property
    def snapshot_time(self) -> float:
        """The device-to-host copy of the largest share."""
        return self.max_share / (self.storage.host_copy_gbps * GB)

    @property
    def async_wait(self) -> float:
        """How long an asynchronous save waits for the previous one's write (when the write outlasts the
        interval between saves)."""
        if not self.step_time or self.save_interval <= 0:
            return 0.0
        return max(0.0, self.save_time - self.save_interval * self.step_time)

    @property
    def async_stall(self) -> float:
        return self.snapshot_time + self.async_wait

    @property
    def host_snapshot_per_node(self) -> float:
        return self.max_share * self.devices_per_node

    def overhead(self, stall: float) -> float | None:
        """Share of the run's time a stall of `stall` seconds per save adds (None without a step time or
        interval)."""
        if not self.step_time or self.save_interval <= 0:
            return None
        return stall / (self.save_interval * self.step_time)

    def as_dict(self) -> dict:
        st = self.storage
        return {
            "total_gb": self.total / GB, "max_rank_gb": self.max_share / GB, "mean_rank_gb": self.mean_share / GB,
            "min_rank_gb": self.min_share / GB, "largest_stage": self.largest_stage,
            "rank_shares_gb": [{"stage": s, "gb": b / GB, "ranks": n} for s, b, n in self.shares],
            "optimizer": self.optimizer,
            "fs_bandwidth_gbps": st.fs_gbps, "node_fs_bandwidth_gbps": st.node_gbps,
            "host_copy_bandwidth_gbps": st.host_copy_gbps, "per_rank_gbps": self.per_rank_gbps,
            "devices_per_node": self.devices_per_node,
            "save_s": self.save_time, "load_s": self.load_time, "bound": self.bound,
            "sync_stall_s": self.save_time, "async_stall_s": self.async_stall,
            "async_snapshot_s": self.snapshot_time, "async_wait_s": self.async_wait,
            "async_host_snapshot_gb_per_node": self.host_snapshot_per_node / GB,
            "save_interval": self.save_interval, "async_save": self.async_save,
            "sync_overhead": self.overhead(self.save_time), "async_overhead": self.overhead(self.async_stall),
        }


def checkpoint_plan(cfg, cluster, lay: Layout, optimizer: str, storage: Storage | None = None,
                    step_time: float | None = None, save_interval: int = 0, async_save: bool | None = None,
                    zero_stage: int = 1, peft: tuple = ()) -> CheckpointPlan:
    """The checkpoint of `cfg` trained with `optimizer` and ZeRO `zero_stage` under `lay` on `cluster` (ValueError
    for a bandwidth that is not a positive number); `peft` (params.peft_spec): the adapters' checkpoint."""
    storage = storage or Storage()
    for k in ("fs_gbps", "node_gbps", "host_copy_gbps"):
        v = getattr(storage, k)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"Storage.{k}={v!r}: must be a positive number of GB/s")
    shares = rank_shares(cfg, lay, optimizer, zero_stage, peft)
    total = checkpoint_bytes(cfg, optimizer, peft)
    return CheckpointPlan(optimizer, storage, total, shares, lay.world,
                          max(1, min(cluster.devices_per_node, lay.world)), step_time, save_interval, async_save)
