#!/usr/bin/env python
"""Re-shard a megatron-k3 training checkpoint for another tensor-parallel size (offline, no processes).

    python tools/convert_checkpoint.py SRC DST [--tp N]

SRC: a checkpoint (`.../checkpoints/step_00000100`) or a checkpoint directory (its newest complete checkpoint).
DST: the checkpoint directory to write into; the result is DST/step_<same step>, committed atomically with
`latest` updated, and loads with `checkpoint.load=DST` (or `auto` with `checkpoint.dir=DST`) under parallel.tp=N.

Every tensor is stored under its global name. Tensor-parallel shards are concatenated along the dimension
recorded in meta.json (`tp_split_dims`) and split again for N ranks; routed experts are stored in global expert
order whatever the expert-parallel size was, so any `parallel.ep` loads them; ZeRO partitions were gathered at
save time, so any data-parallel size and ZeRO stage loads them. Optimizer states are resharded with their
parameters. The Trainer reshards on load by itself; this tool is for doing it once, ahead of many starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_k3.training import checkpoint as ckpt  # noqa: E402


def convert(src: str | Path, dst: str | Path, tp: int = 1) -> Path:
    """Write SRC's newest (or given) checkpoint into DST with `tp` tensor-parallel shards; returns the new path."""
    if tp < 1:
        raise ValueError(f"--tp {tp}: must be >= 1")
    path = ckpt.resolve_load_path(str(src), Path(src))
    meta = ckpt.read_meta(path)
    dims = meta.get("tp_split_dims") or {}
    if tp > 1 and not dims:
        raise ckpt.CheckpointError(f"{path}: meta.json has no tp_split_dims (an older checkpoint); cannot split it")
    model, optim, extra = ckpt.read_full(path, meta)
    for name, d in dims.items():
        if d is not None and name in model and model[name].shape[d] % tp:
            raise ValueError(f"--tp {tp}: {name} has {model[name].shape[d]} rows along dim {d}, not divisible by {tp}")
    tmp, final = ckpt.begin(dst, int(meta["step"]))
    for r in range(tp):
        m = ckpt.split_full(model, dims, tp, r)
        o = {n: ckpt.split_full(st, {k: dims.get(n) for k in st}, tp, r) for n, st in optim.items()}
        ckpt.write_shard(tmp, ckpt.shard_suffix(tp, r), m, o, extra)
    if (path / "rng.pt").is_file():
        ckpt.write_rng(tmp, ckpt.load_pickle_safely(path / "rng.pt")["ranks"])
    out = {k: v for k, v in meta.items() if k not in ("format_version", "saved_at", "complete")}
    out.update(tensor_parallel=tp, converted_from=str(path))
    return ckpt.commit(tmp, final, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size to write (default 1: unsharded)")
    a = ap.parse_args(argv)
    try:
        out = convert(a.src, a.dst, a.tp)
    except (ckpt.CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
