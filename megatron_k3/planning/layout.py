"""Parallel layouts for the planner: sizes, derived group sizes, the rules a layout must obey on a
cluster, and the pipeline partition (whole AttnRes blocks per stage).

Rank order is megatron_k3.parallel.state's default `tp-cp-ep-dp-pp` (TP fastest, PP outermost); routed
experts use the folded expert grid (etp = 1, ep, edp, pp), so edp = world / (ep * pp).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout", "layout_problems", "stage_layers", "group_span"]


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    sequence_parallel: bool = True  # only meaningful when tp > 1
    recompute: str = "none"  # none, selective, full (training)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.world // (self.ep * self.pp)

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    def as_dict(self) -> dict:
        return {"world": self.world, "tp": self.tp, "pp": self.pp, "ep": self.ep, "cp": self.cp, "dp": self.dp,
                "edp": self.edp, "etp": 1, "sequence_parallel": self.sp, "recompute": self.recompute}

    def short(self) -> str:
        return (f"tp{self.tp} pp{self.pp} ep{self.ep} cp{self.cp} dp{self.dp} edp{self.edp}"
                f"{' sp' if self.sp else ''} rc={self.recompute}")


_STAGES: dict = {}


def stage_layers(cfg, pp: int) -> list:
    """Decoder layer ranges [start, end) of the pp pipeline stages. With AttnRes a stage holds whole blocks
    (MODEL.md 1: a stage must not split a block), blocks balanced by layer count; otherwise layers are split
    evenly. Raises ValueError when pp cannot be honoured."""
    from .params import cfg_key

    key = (cfg_key(cfg), pp)
    if key not in _STAGES:
        _STAGES[key] = _stage_layers(cfg, pp)
    return list(_STAGES[key])


def _stage_layers(cfg, pp: int) -> list:
    L = cfg.num_layers
    if cfg.attn_res:
        bs = cfg.attn_res_block_size
        blocks = [(s, min(s + bs, L)) for s in range(0, L, bs)]
        if pp > len(blocks):
            raise ValueError(f"pp={pp} exceeds the {len(blocks)} AttnRes blocks; stages hold whole blocks")
        # contiguous split of the blocks into pp groups, as even in layers as possible (small: exhaustive DP)
        sizes = [e - s for s, e in blocks]
        best = _balanced_split(sizes, pp)
        out, i = [], 0
        for k in best:
            out.append((blocks[i][0], blocks[i + k - 1][1]))
            i += k
        return out
    if pp > L:
        raise ValueError(f"pp={pp} exceeds num_layers={L}")
    base, extra = divmod(L, pp)
    out, s = [], 0
    for i in range(pp):
        e = s + base + (1 if i < extra else 0)
        out.append((s, e))
        s = e
    return out


def _balanced_split(sizes: list, parts: int) -> list:
    """Counts of consecutive items per part minimising the largest part's sum (ties: earlier parts larger)."""
    n = len(sizes)
    prefix = [0]
    for x in sizes:
        prefix.append(prefix[-1] + x)
    INF = float("inf")
    # cost[p][i]: best max-sum splitting the first i items into p parts
    cost = [[INF] * (n + 1) for _ in range(parts + 1)]
    choice = [[0] * (n + 1) for _ in range(parts + 1)]
    cost[0][0] = 0
    for p in range(1, parts + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                c = max(cost[p - 1][j], prefix[i] - prefix[j])
                if c < cost[p][i]:
                    cost[p][i], choice[p][i] = c, j
    out, i = [], n
    for p in range(parts, 0, -1):
        j = choice[p][i]
        out.append(i - j)
        i = j
    return out[::-1]


def group_span(size: int, stride: int, supernode: int) -> tuple:
    """(members per supernode, supernodes spanned) of a group of `size` ranks spaced `stride` apart."""
    if size <= 1:
        return 1, 1
    extent = size * stride
    if extent <= supernode:
        return size, 1
    per = max(1, supernode // stride)
    return per, -(-size // per)


def layout_problems(cfg, cluster, lay: Layout, micro_batch_size: int, global_batch_size: int,
                    seq_length: int) -> list:
    """Why `lay` is not a valid layout on `cluster` (empty list: valid). Each reason is one line."""
    out = []
    world, sn = lay.world, cluster.supernode_size
    for k in ("tp", "pp", "ep", "cp"):
        if getattr(lay, k) < 1:
            out.append(f"{k}={getattr(lay, k)} must be >= 1")
    if out:
        return out
    if world % (lay.tp * lay.pp * lay.cp):
        out.append(f"tp*pp*cp={lay.tp * lay.pp * lay.cp} does not divide the {world} accelerators")
    if world % (lay.ep * lay.pp):
        out.append(f"ep*pp={lay.ep * lay.pp} does not divide the {world} accelerators")
    if lay.tp > sn or sn % lay.tp:
        out.append(f"TP group of {lay.tp} would cross a supernode of {sn}")
    if lay.tp > cluster.devices_per_node and cluster.devices_per_node > 1:
        out.append(f"TP group of {lay.tp} spans more than one node of {cluster.devices_per_node}")
    if lay.ep > sn or sn % lay.ep:
        out.append(f"EP group of {lay.ep} would cross a supernode of {sn} (EP all-to-all stays inside one)")
    if lay.tp * lay.cp > sn:
        out.append(f"TP x CP = {lay.tp * lay.cp} would cross a supernode of {sn}")
    has_moe = "moe" in cfg.ffn_types()
    if has_moe and cfg.num_experts % lay.ep:
        out.append(f"ep={lay.ep} does not divide num_experts={cfg.num_experts}")
    if not has_moe and lay.ep > 1:
        out.append("ep > 1 without MoE layers")
    try:
        stage_layers(cfg, lay.pp)
    except ValueError as e:
        out.append(str(e))
    if lay.cp > 1 and seq_length % (2 * lay.cp):
        out.append(f"2*cp={2 * lay.cp} zigzag chunks do not divide seq_length={seq_length}")
    if lay.tp > 1:
        try:
            from .params import model_params

            model_params(cfg, lay.tp)
        except ValueError as e:
            out.append(f"tp={lay.tp}: {e}")
    if not out and global_batch_size % (micro_batch_size * lay.dp):
        out.append(f"global batch {global_batch_size} is not a multiple of micro-batch {micro_batch_size} x "
                   f"dp {lay.dp}")
    if lay.recompute not in ("none", "selective", "full"):
        out.append(f"recompute={lay.recompute!r}: valid none, selective, full")
    return out
