"""Whether a model config can be sharded by a parallel layout: every dimension tensor parallelism splits must
divide by tp, the routed experts by ep, the expert FFN width by expert-TP. Pure arithmetic on the config; the
split dimensions listed here are the ones `megatron_k3.parallel.tensor` shards."""

from __future__ import annotations

from ..errors import ParallelConfigError

__all__ = ["sharding_problems", "check_divisibility", "has_moe", "divisors", "expert_block", "ZERO_BUCKET",
           "ZERO0_ALLREDUCE_BUCKET", "zero_bucket_elements"]

ZERO_BUCKET = 50_000_000  # elements per ZeRO reduce / all-gather bucket the engine configures at most
# ZeRO-0: DeepSpeed 0.19.8's engine all-reduces the gradients at a step's boundary through flat copies of consecutive
# gradients, each closed at the first gradient that takes it past this many elements (engine.py's
# MEMORY_OPT_ALLREDUCE_SIZE, buffered_allreduce_fallback), also with one data-parallel rank
ZERO0_ALLREDUCE_BUCKET = 500_000_000


def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_block(n: int, parts: int, index: int) -> tuple:
    """(start, count) of the whole routed experts, out of an EP rank's `n`, whose optimizer states
    expert-data-parallel rank `index` of `parts` owns (training.expert_optimizer): blocks of ceil(n / parts) in rank
    order, so the last blocks are shorter, or empty when parts > n. Whole experts, so Per-Head Muon orthogonalises
    each one whole wherever it is stepped."""
    per = -(-n // parts)
    start = min(index * per, n)
    return start, min(per, n - start)


def zero_bucket_elements(num_params: int) -> int:
    """Elements of the ZeRO-1/2 gradient-reduction bucket (DeepSpeed's reduce_bucket_size, also its
    allgather_bucket_size) the engine configures for a rank whose DeepSpeed optimizer steps `num_params` parameters:
    ZERO_BUCKET, or the parameters rounded up to DeepSpeed's 256-element alignment where fewer. DeepSpeed allocates
    the bucket whole (two under overlap_comm), so a small model gets one no larger than itself."""
    return min(ZERO_BUCKET, -(-max(num_params, 1) // 256) * 256)


def has_moe(cfg) -> bool:
    return cfg.first_k_dense < cfg.num_layers


def _tp_split_dims(cfg) -> list:
    """(what, size) of every dimension tensor parallelism splits, the head counts first."""
    dims = [("kda_num_heads", cfg.kda_num_heads), ("mla_num_heads", cfg.mla_num_heads),
            ("vocab_size", cfg.vocab_size),
            ("decay_rank (kda_decay_rank or kda_head_dim)", cfg.kda_decay_rank or cfg.kda_head_dim),
            ("kv_lora_rank + qk_rope_head_dim", cfg.kv_lora_rank + cfg.qk_rope_head_dim),
            ("dense_intermediate_size", cfg.dense_intermediate_size)]
    if cfg.q_lora_rank:
        dims.append(("q_lora_rank", cfg.q_lora_rank))
    if cfg.kda_output_gate == "lowrank":
        dims.append(("kda_head_dim", cfg.kda_head_dim))
    if cfg.num_shared_experts and has_moe(cfg):
        dims.append(("shared_ffn_size", cfg.shared_intermediate_size
                     or cfg.moe_intermediate_size * cfg.num_shared_experts))
    return dims


def sharding_problems(cfg, tp: int = 1, ep: int = 1, etp: int = 1) -> list:
    """[(key, value, reason, rule)] for every split of `cfg` that the sizes do not divide (empty: shardable)."""
    out = []
    for what, n in _tp_split_dims(cfg):
        if n % tp:
            out.append(("parallel.tp", tp, f"must divide model.{what}={n}; valid: {divisors(n)}",
                        f"divides model.{what}"))
    if has_moe(cfg):
        if cfg.num_experts % ep:
            n = cfg.num_experts
            out.append(("parallel.ep", ep, f"must divide model.num_experts={n}; valid: {divisors(n)}",
                        "divides model.num_experts"))
        if cfg.moe_intermediate_size % etp:
            n = cfg.moe_intermediate_size
            out.append(("parallel.etp", etp, f"must divide model.moe_intermediate_size={n}; valid: {divisors(n)}",
                        "divides model.moe_intermediate_size"))
    return out


def check_divisibility(cfg, tp: int = 1, ep: int = 1, etp: int = 1) -> None:
    """Raise ParallelConfigError for the first split of `cfg` the sizes do not divide."""
    problems = sharding_problems(cfg, tp, ep, etp)
    if problems:
        raise ParallelConfigError(*problems[0])
