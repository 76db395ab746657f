"""The one layout check: whether a parallel layout can run a model on a world of ranks with a given batch.

Config validation (`RunConfig.validate`), the parallel state (`parallel.state.initialize_model_parallel`, through
the rank grid and `check_divisibility`) and the planner (`planning.candidates.planner_problems`, which adds its own
search preferences on top) all ask this module, so a layout is refused for the same reason everywhere. Each
problem names the config key to change, its value and what would be valid.

Rules, in the order they are reported:
0. TP and EP groups no larger than a supernode;
1. the rank grid: sizes divide the world, the order string, equal pipeline groups in both grids, TP/EP groups
   inside one supernode (`grid.RankGrid`);
2. sharding: every dimension TP splits divides by tp, experts by ep (`sharding`);
3. pipeline: stages hold whole AttnRes blocks (`stages`), tied embeddings need one stage;
4. context parallelism: 2 cp equal zigzag chunks per sequence, each at least the short convolution's halo;
5. tokens: under tensor parallelism each rank routes (or, with sequence parallelism, holds) 1/tp of them;
6. batch: the global batch is whole micro-batches on every data-parallel rank;
7. balanced expert dispatch: the replica slots per EP rank lie in [1, E - E/ep] (`replica_slots`);
8. token tiles (train.tile_tokens, checked when the layout is otherwise valid): a part whose tokens on a device fit
   one tile runs untiled; a tiled part's tokens divide into whole tiles (the MoE layers' 1/tp share under sequence
   parallelism, the LM head's micro_batch_size*seq_length/cp); without sequence parallelism a MoE tile's rows divide
   over tp; never with the drop dispatcher (its capacity would be per tile);
9. ZeRO-0 (parallel.zero_stage=0, DeepSpeed's plain all-reduce; checked when the stage is given): one pipeline stage,
   no expert parallelism over MoE layers, fp32 weights (bf16 weights keep their fp32 masters in ZeRO's partitions).

Each Problem carries its `rule` in words without the numbers, by which the planner counts the layouts it rejects.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..errors import ParallelConfigError
from .grid import DEFAULT_ORDER, RankGrid
from .sharding import has_moe, sharding_problems
from .stages import stage_layers

__all__ = ["Problem", "layout_problems", "check_layout", "replica_slots"]


class Problem(NamedTuple):
    key: str
    value: object
    reason: str
    rule: str = ""  # the rule broken, without the numbers: what rejected layouts are counted by

    def error(self) -> ParallelConfigError:
        return ParallelConfigError(self.key, self.value, self.reason, self.rule)

    @property
    def kind(self) -> str:
        """'parallel.ep: divides the world size': the key and the rule, the same for every layout it rejects."""
        return f"{self.key}: {self.rule or self.reason}"

    def __str__(self) -> str:
        return self.reason


def layout_problems(model, world: int, *, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, etp: int = 1,
                    order: str = DEFAULT_ORDER, supernode_size: int | None = None, sequence_parallel: bool = False,
                    micro_batch_size: int | None = None, global_batch_size: int | None = None,
                    seq_length: int | None = None, redundant_experts: int | None = None,
                    moe_overflow: str | None = None, tile_tokens: int = 0, zero_stage: int | None = None,
                    bf16_weights: str = "") -> list:
    """Every Problem of this layout (empty: it runs). Batch rules apply when the batch sizes are given, the replica
    slots of balanced dispatch when moe.redundant_experts is (`moe_overflow`: in place of the model's), the token
    tiles when train.tile_tokens is (> 0, with the micro-batch and sequence length), ZeRO-0's limits when
    `zero_stage` is (`bf16_weights`: the precision whose weights are bf16, empty for fp32 weights)."""
    out = []
    for key, size, what in (("parallel.tp", tp, "TP"), ("parallel.ep", ep, "EP")):
        if supernode_size and isinstance(size, int) and size > supernode_size:
            out.append(Problem(key, size, f"{what} groups stay inside one supernode: must be <= "
                                          f"cluster.supernode_size={supernode_size}", f"{what} <= supernode size"))
    try:
        grid = RankGrid(world, tp=tp, cp=cp, ep=ep, pp=pp, etp=etp, order=order, supernode_size=supernode_size)
    except ParallelConfigError as e:  # the sizes do not form a grid: nothing below is defined
        return out + [Problem(e.key, e.value, e.valid, e.rule)]
    out += [Problem(*p) for p in sharding_problems(model, tp, ep, etp)]
    if pp > 1:
        try:
            stage_layers(model, pp)
        except ValueError as e:
            out.append(Problem("parallel.pp", pp, f"{e} (model.num_layers={model.num_layers}, "
                                                  f"model.attn_res_block_size={model.attn_res_block_size})",
                               "stages hold whole AttnRes blocks"))
        if model.tie_word_embeddings:
            out.append(Problem("parallel.pp", pp, "model.tie_word_embeddings=true needs the embedding and the LM "
                                                  "head on one stage: use parallel.pp=1 or untied embeddings",
                               "tied embeddings on one stage"))
    if seq_length is not None:
        out += _token_problems(model, tp, cp, sequence_parallel, micro_batch_size, seq_length)
    if micro_batch_size is not None and global_batch_size is not None \
            and global_batch_size % (micro_batch_size * grid.dp):
        out.append(Problem("train.global_batch_size", global_batch_size,
                           f"must be a multiple of micro_batch_size*dp = {micro_batch_size}*{grid.dp}",
                           "a multiple of micro_batch_size*dp"))
    if redundant_experts is not None:
        out += _replica_problems(model, ep, redundant_experts, moe_overflow)
    if tile_tokens and micro_batch_size is not None and seq_length is not None and not out:
        out += _tile_problems(model, tp, cp, sequence_parallel, micro_batch_size * seq_length // cp, tile_tokens,
                              moe_overflow or model.moe_overflow)
    if zero_stage == 0:
        out += _zero0_problems(model, pp, ep, bf16_weights)
    return out


def _zero0_problems(model, pp: int, ep: int, bf16_weights: str) -> list:
    """Rule 9: what parallel.zero_stage=0 cannot run (the Trainer's engine would fail or clip wrongly)."""
    out, why = [], "ZeRO 1 or 2 with "
    if pp > 1:
        out.append(Problem("parallel.zero_stage", 0, f"with parallel.pp={pp} use ZeRO 1 or 2: DeepSpeed's ZeRO-0 "
                           "clipping counts replicated parameters on model-parallel rank 0 only, i.e. on the first "
                           "stage", why + "pipeline parallelism"))
    if has_moe(model) and ep > 1:
        out.append(Problem("parallel.zero_stage", 0, "expert parallelism needs parallel.zero_stage 1 or 2",
                           why + "expert parallelism"))
    if bf16_weights:
        out.append(Problem("parallel.zero_stage", 0, f"precision.param_dtype=bf16 (precision={bf16_weights}) needs "
                           "ZeRO 1 or 2, whose partitions hold the fp32 masters (DeepSpeed 0.19 has no ZeRO-0 path "
                           "for bf16 weights with fp32 gradient accumulation)", why + "bf16 weights"))
    return out


def default_replica_slots(num_experts: int, ep: int) -> int:
    """moe.redundant_experts when not set (-1): E/ep, the slots that balance exactly for any routing."""
    return num_experts // ep


def replica_slots(model, ep: int, redundant_experts: int, moe_overflow: str | None = None) -> int | None:
    """The replica slots per EP rank balanced dispatch runs with (moe.redundant_experts; -1: E/ep, which balances
    exactly for any routing), or None where it does not run (model.moe_overflow, or `moe_overflow` in its place,
    not balanced; ep = 1; no MoE layers)."""
    if (moe_overflow or model.moe_overflow) != "balanced" or ep <= 1 or not has_moe(model):
        return None
    return default_replica_slots(model.num_experts, ep) if redundant_experts < 0 else redundant_experts


def _replica_problems(model, ep: int, redundant_experts: int, moe_overflow: str | None) -> list:
    slots = replica_slots(model, ep, redundant_experts, moe_overflow)
    E, own = model.num_experts, model.num_experts // max(ep, 1)
    if slots is None or 1 <= slots <= E - own:
        return []
    return [Problem("moe.redundant_experts", redundant_experts, (
        f"{slots} replica slots per EP rank must lie in [1, {E - own}] (model.num_experts={E} minus the {own} each "
        f"of parallel.ep={ep} ranks owns; -1 = {own}, exact balance for any routing)"),
        "replica slots in [1, experts - experts/ep]")]


def _token_problems(model, tp, cp, sequence_parallel, micro_batch_size, seq_length) -> list:
    out = []
    moe = has_moe(model)
    if cp > 1:  # zigzag context parallelism: 2*cp equal chunks per sequence (parallel/context.py)
        if seq_length % (2 * cp):
            out.append(Problem("parallel.cp", cp, f"splits each sequence into 2*cp={2 * cp} equal chunks: "
                                                  f"train.seq_length={seq_length} must be divisible by {2 * cp}",
                               "2*cp divides the sequence"))
            return out
        chunk = seq_length // (2 * cp)
        if "kda" in model.layer_types() and chunk < model.kda_conv_size - 1:
            out.append(Problem("parallel.cp", cp, f"chunks of train.seq_length/(2*cp)={chunk} tokens are shorter "
                                                  f"than the short convolution's halo of model.kda_conv_size-1="
                                                  f"{model.kda_conv_size - 1}", "chunks cover the convolution's halo"))
        if micro_batch_size is not None:
            local = micro_batch_size * seq_length // cp
            if tp > 1 and local % tp and (sequence_parallel or moe):
                out.append(Problem("parallel.cp", cp, f"each CP rank holds micro_batch_size*seq_length/cp={local} "
                                                      f"tokens, which must divide over parallel.tp={tp}",
                                   "a CP rank's tokens divide over tp"))
    if micro_batch_size is not None and tp > 1 and (micro_batch_size * seq_length) % tp:
        if sequence_parallel:
            out.append(Problem("parallel.sequence_parallel", True, f"needs train.micro_batch_size*train.seq_length "
                                                                   f"divisible by parallel.tp={tp}",
                               "tokens divide over tp"))
        elif moe:
            out.append(Problem("parallel.tp", tp, "each TP rank routes 1/tp of the tokens: needs "
                                                  "train.micro_batch_size*train.seq_length divisible by parallel.tp",
                               "tokens divide over tp"))
    return out


def _tile_breaks(model, tp: int, sequence_parallel: bool, tokens: int, tile: int) -> str:
    """Why `tile` tokens per tile cannot cut the `tokens` of a micro-batch on one device ('': it can). A part whose
    tokens fit one tile runs untiled."""
    split = tp > 1 and not sequence_parallel  # each TP rank routes 1/tp of every tile's rows
    moe_tokens = tokens // tp if tp > 1 and sequence_parallel else tokens
    if has_moe(model) and tile < moe_tokens:
        if moe_tokens % tile:
            return f"does not divide the {moe_tokens} tokens a MoE layer gets per micro-batch on this device"
        if split and tile % tp:
            return f"a MoE tile's rows are routed 1/tp per TP rank: must be a multiple of parallel.tp={tp}"
    if tile < tokens and tokens % tile:
        return f"does not divide the {tokens} tokens the LM head gets per micro-batch on this device"
    return ""


def _tile_problems(model, tp, cp, sequence_parallel, tokens, tile, moe_overflow) -> list:
    if has_moe(model) and moe_overflow == "drop":
        return [Problem("train.tile_tokens", tile, "does not run with model.moe_overflow=drop: its per-expert "
                        "capacity would be per tile and drop other assignments (use dropless, auto or balanced)",
                        "no tiles with the drop dispatcher")]
    why = _tile_breaks(model, tp, sequence_parallel, tokens, tile)
    if not why:
        return []
    small = [d for d in range(1, math.isqrt(tokens) + 1) if tokens % d == 0]
    ok = sorted(d for d in {*small, *(tokens // d for d in small)}
                if not _tile_breaks(model, tp, sequence_parallel, tokens, d))
    near = [d for d in ok if d < tile][-1:] + [d for d in ok if d > tile][:1]
    where = (f"micro_batch_size*seq_length/cp = {tokens} tokens per device"
             + (f", {tokens // tp} per TP rank in the MoE layers" if has_moe(model) and tp > 1 and sequence_parallel
                else ""))
    return [Problem("train.tile_tokens", tile, f"{why} ({where}): the nearest that work are "
                    f"{' and '.join(map(str, near))}; 0 or >= {tokens} leaves it untiled",
                    "tiles divide a device's tokens")]


def check_layout(model, world: int, **sizes) -> RankGrid:
    """The rank grid of a layout that runs `model`; ParallelConfigError for the first problem otherwise."""
    problems = layout_problems(model, world, **sizes)
    if problems:
        raise problems[0].error()
    return RankGrid(world, **{k: sizes[k] for k in ("tp", "cp", "ep", "pp", "etp", "order", "supernode_size")
                             if k in sizes})
