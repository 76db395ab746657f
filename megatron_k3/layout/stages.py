"""The pipeline partition: which decoder layers each of the pp stages holds.

With Block Attention Residuals a stage holds whole AttnRes blocks (MODEL.md section 1: a stage must not split a
block), blocks balanced by layer count; without them the layers are split evenly.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["stage_layers"]


def stage_layers(cfg, pp: int) -> list:
    """Decoder layer ranges [start, end) of the pp pipeline stages of model config `cfg`. Raises ValueError when pp
    cannot be honoured (more stages than AttnRes blocks, or than layers)."""
    block = cfg.attn_res_block_size if cfg.attn_res else 0
    return list(_stage_layers(cfg.num_layers, block, pp))


@lru_cache(maxsize=None)
def _stage_layers(num_layers: int, block: int, pp: int) -> tuple:
    L = num_layers
    if block:
        blocks = [(s, min(s + block, L)) for s in range(0, L, block)]
        if pp > len(blocks):
            raise ValueError(f"pp={pp} exceeds the {len(blocks)} AttnRes blocks; stages hold whole blocks")
        # contiguous split of the blocks into pp groups, as even in layers as possible (small: exhaustive DP)
        best = _balanced_split([e - s for s, e in blocks], pp)
        out, i = [], 0
        for k in best:
            out.append((blocks[i][0], blocks[i + k - 1][1]))
            i += k
        return tuple(out)
    if pp > L:
        raise ValueError(f"pp={pp} exceeds num_layers={L}")
    base, extra = divmod(L, pp)
    out, s = [], 0
    for i in range(pp):
        e = s + base + (1 if i < extra else 0)
        out.append((s, e))
        s = e
    return tuple(out)


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
