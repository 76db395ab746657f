"""Typed configuration schemas and the loader that composes `conf/model/<name>.yaml` onto them.

YAML files only set values; the dataclasses here define every key, its type and its validation.
A mistake fails with `ConfigError`, one line naming the key, the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key, the value and what is valid."""

    def __init__(self, key: str, value, valid: str):
        self.key, self.value, self.valid = key, value, valid
        super().__init__(f"invalid config: {key}={value!r}: {valid}")


@dataclass
class ModelConfig:
    """Every architectural knob of the K3 / Kimi Linear family.

    The same code expresses K3 (AttnRes, SiTU, latent MoE, lower-bound KDA gate, full-rank output gate,
    gated MLA) and Kimi Linear (ordinary residuals, SwiGLU, no latent projection, softplus gate, low-rank
    output gate, ungated MLA) through these switches.
    """

    name: str = "custom"
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_layers: int = 93
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    # ---- layer schedule: which layers are Gated MLA (1-based, as in checkpoints' `full_attn_layers`)
    # If `mla_layers` is empty, MLA sits at every `mla_every`-th layer and, if `mla_at_last`, at the last.
    mla_layers: list = field(default_factory=list)
    mla_every: int = 4
    mla_at_last: bool = True
    first_k_dense: int = 1  # layers [0, first_k_dense) use the dense FFN, the rest MoE

    # ---- Kimi Delta Attention
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_gate: str = "lowerbound"  # "lowerbound" (K3: lb * sigmoid(e^A (z + dt))) or "softplus" (Kimi Linear)
    kda_gate_lower_bound: float = -5.0
    kda_decay_rank: int = 0  # rank of the low-rank decay projection; 0 = kda_head_dim
    kda_output_gate: str = "full"  # "full" (K3) or "lowrank" (Kimi Linear)
    kda_output_gate_bias: bool = False  # bias on the low-rank gate's up projection
    kda_chunk_size: int = 64
    kda_a_log_init: str = "zero"  # "zero" (from-scratch K3 recommendation) or "uniform_1_16" (fla / Kimi Linear)

    # ---- Gated MLA (NoPE)
    mla_num_heads: int = 96
    q_lora_rank: int = 1536  # 0: a direct q projection (Kimi Linear)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # the unrotated, head-shared key part
    v_head_dim: int = 128
    mla_output_gate: bool = True
    mla_latent_norm_eps: float = 1e-5  # eps of q_a / kv_a layernorms (HF Kimi Linear uses 1e-6)

    # ---- FFN activation
    hidden_act: str = "situ"  # "situ" (K3) or "silu" (SwiGLU)
    situ_beta_gate: float = 4.0
    situ_beta_up: float = 25.0
    dense_intermediate_size: int = 33792

    # ---- Stable LatentMoE
    num_experts: int = 896
    top_k: int = 16
    moe_intermediate_size: int = 3072
    moe_latent_size: int = 3584  # 0: experts run at full width (no latent projection)
    moe_latent_norm: bool = True  # RMSNorm on the combined latent before the up projection
    num_shared_experts: int = 2
    shared_intermediate_size: int = 0  # 0: moe_intermediate_size * num_shared_experts
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    router_num_groups: int = 1
    router_topk_groups: int = 1
    router_force_balanced: bool = False  # debug knob: round-robin routing, for throughput ceilings
    moe_overflow: str = "auto"  # drop: static-shape dispatch with fixed capacity; dropless: every assignment
    #                             (split sizes on the host under ep > 1); auto: drop under ep > 1, else dropless
    moe_capacity_factor: float = 1.25  # drop: slots per expert = ceil(factor * tokens * top_k / num_experts)

    # ---- Block Attention Residuals
    attn_res: bool = True
    attn_res_block_size: int = 12  # decoder layers per block

    # ------------------------------------------------------------------ derived
    def mla_layer_set(self) -> set:
        """0-based indices of the Gated MLA layers."""
        if self.mla_layers:
            return {int(i) - 1 for i in self.mla_layers}
        out = {i - 1 for i in range(self.mla_every, self.num_layers + 1, self.mla_every)} if self.mla_every else set()
        if self.mla_at_last:
            out.add(self.num_layers - 1)
        return out

    def layer_types(self) -> list:
        mla = self.mla_layer_set()
        return ["mla" if i in mla else "kda" for i in range(self.num_layers)]

    def ffn_types(self) -> list:
        return ["dense" if i < self.first_k_dense else "moe" for i in range(self.num_layers)]

    @property
    def shared_ffn_size(self) -> int:
        return self.shared_intermediate_size or self.moe_intermediate_size * self.num_shared_experts

    @property
    def decay_rank(self) -> int:
        return self.kda_decay_rank or self.kda_head_dim

    @property
    def expert_width(self) -> int:
        """Width at which routed experts run: the latent size, or the hidden size without latent MoE."""
        return self.moe_latent_size or self.hidden_size

    @property
    def num_attn_res_blocks(self) -> int:
        return -(-self.num_layers // self.attn_res_block_size)

    # ------------------------------------------------------------------ validation
    def validate(self, prefix: str = "model") -> "ModelConfig":
        def key(k):
            return f"{prefix}.{k}" if prefix else k

        positive = [
            "vocab_size", "hidden_size", "num_layers", "kda_num_heads", "kda_head_dim", "kda_conv_size",
            "kda_chunk_size", "mla_num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
            "dense_intermediate_size", "attn_res_block_size", "router_num_groups", "router_topk_groups",
        ]
        for k in positive:
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(key(k), v, "must be a positive integer")
        non_negative = ["q_lora_rank", "qk_rope_head_dim", "kda_decay_rank", "moe_latent_size",
                        "num_shared_experts", "shared_intermediate_size", "first_k_dense", "mla_every"]
        for k in non_negative:
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(key(k), v, "must be an integer >= 0")
        if self.rms_norm_eps <= 0:
            raise ConfigError(key("rms_norm_eps"), self.rms_norm_eps, "must be > 0")
        if self.kda_gate not in ("lowerbound", "softplus"):
            raise ConfigError(key("kda_gate"), self.kda_gate, "valid: 'lowerbound' or 'softplus'")
        if self.kda_gate == "lowerbound" and not (-5.0 <= self.kda_gate_lower_bound < 0):
            raise ConfigError(key("kda_gate_lower_bound"), self.kda_gate_lower_bound, "must lie in [-5, 0)")
        if self.kda_output_gate not in ("full", "lowrank"):
            raise ConfigError(key("kda_output_gate"), self.kda_output_gate, "valid: 'full' or 'lowrank'")
        if self.kda_a_log_init not in ("zero", "uniform_1_16"):
            raise ConfigError(key("kda_a_log_init"), self.kda_a_log_init, "valid: 'zero' or 'uniform_1_16'")
        if self.hidden_act not in ("situ", "silu"):
            raise ConfigError(key("hidden_act"), self.hidden_act, "valid: 'situ' or 'silu'")
        bad = [i for i in self.mla_layers if not (1 <= int(i) <= self.num_layers)]
        if bad:
            raise ConfigError(key("mla_layers"), list(self.mla_layers),
                              f"1-based layer numbers in [1, {self.num_layers}]")
        if self.first_k_dense > self.num_layers:
            raise ConfigError(key("first_k_dense"), self.first_k_dense, f"must be <= num_layers={self.num_layers}")
        if self.first_k_dense < self.num_layers:  # there are MoE layers
            if self.num_experts <= 0:
                raise ConfigError(key("num_experts"), self.num_experts, "must be a positive integer")
            if not (1 <= self.top_k <= self.num_experts):
                raise ConfigError(key("top_k"), self.top_k, f"must be in [1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size <= 0:
                raise ConfigError(key("moe_intermediate_size"), self.moe_intermediate_size, "must be > 0")
            if self.num_experts % self.router_num_groups:
                raise ConfigError(key("router_num_groups"), self.router_num_groups,
                                  f"must divide num_experts={self.num_experts}")
            if self.router_topk_groups > self.router_num_groups:
                raise ConfigError(key("router_topk_groups"), self.router_topk_groups,
                                  f"must be <= router_num_groups={self.router_num_groups}")
            if self.moe_overflow not in ("auto", "drop", "dropless"):
                raise ConfigError(key("moe_overflow"), self.moe_overflow, "valid: auto, drop, dropless")
            if not self.moe_capacity_factor > 0:
                raise ConfigError(key("moe_capacity_factor"), self.moe_capacity_factor, "must be > 0")
            per_group = self.num_experts // self.router_num_groups
            if self.router_num_groups > 1 and self.top_k > self.router_topk_groups * per_group:
                raise ConfigError(key("top_k"), self.top_k,
                                  f"must be <= router_topk_groups * experts per group = "
                                  f"{self.router_topk_groups * per_group}")
        return self


@dataclass
class ClusterConfig:
    """The hardware: sizes, peak rates and link bandwidths (used by the planner and for MFU)."""
    name: str = "cpu"
    num_nodes: int = 1
    devices_per_node: int = 1
    supernode_size: int = 64  # accelerators in one high-bandwidth domain; EP groups never cross it
    device_kind: str = "cpu"  # cpu or gpu: which kernels the planner assumes (eager torch paths or fused ones)
    device_memory_gb: float = 24.0
    peak_tflops_bf16: float = 0.2  # dense peak per accelerator; the MFU denominator
    peak_tflops_fp8: float = 0.0  # 0: no fp8 tensor cores (the planner then uses the bf16 peak)
    gemm_efficiency: float = 0.6  # fraction of the peak that large GEMMs sustain (planner's compute time)
    hbm_gbps: float = 50.0  # device memory bandwidth, GB/s (planner's decode estimate)
    reserved_memory_gb: float = 0.0  # per device, kept free by the planner: runtime context, comm buffers, slack
    intra_supernode_gbps: float = 10.0  # per-device bandwidth inside a supernode, GB/s
    inter_supernode_gbps: float = 10.0  # per-device bandwidth across supernodes, GB/s

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    def validate(self, prefix: str = "cluster") -> "ClusterConfig":
        if self.device_kind not in ("cpu", "gpu"):
            raise ConfigError(f"{prefix}.device_kind", self.device_kind, "valid: cpu, gpu")
        for k in ("num_nodes", "devices_per_node", "supernode_size"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{prefix}.{k}", v, "must be a positive integer")
        for k in ("device_memory_gb", "peak_tflops_bf16", "hbm_gbps", "intra_supernode_gbps", "inter_supernode_gbps"):
            if not getattr(self, k) > 0:
                raise ConfigError(f"{prefix}.{k}", getattr(self, k), "must be > 0")
        if self.reserved_memory_gb < 0 or self.reserved_memory_gb >= self.device_memory_gb:
            raise ConfigError(f"{prefix}.reserved_memory_gb", self.reserved_memory_gb,
                              f"must lie in [0, device_memory_gb={self.device_memory_gb})")
        if self.peak_tflops_fp8 < 0:
            raise ConfigError(f"{prefix}.peak_tflops_fp8", self.peak_tflops_fp8, "must be >= 0 (0 = none)")
        if not 0 < self.gemm_efficiency <= 1:
            raise ConfigError(f"{prefix}.gemm_efficiency", self.gemm_efficiency, "must lie in (0, 1]")
        return self


@dataclass
class ParallelConfig:
    """Model-parallel sizes; data parallelism is whatever of the world is left."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    order: str = "tp-cp-ep-dp-pp"
    sequence_parallel: bool = False
    backend: str = "auto"  # torch.distributed backend: auto (nccl on CUDA, else gloo), nccl, gloo
    zero_stage: int = 1  # DeepSpeed ZeRO over the data-parallel group: 0 (plain all-reduce), 1 (optimizer states
    #                      partitioned), 2 (gradients too)
    deepspeed: Dict[str, Any] = field(default_factory=dict)  # merged over the generated DeepSpeed config
    timeout_minutes: float = 30.0  # how long a collective waits for its peers before failing (naming its group)


@dataclass
class TrainConfig:
    steps: int = 200  # total optimizer steps of the run; a resumed run continues toward the same total
    seed: int = 1234
    micro_batch_size: int = 4
    global_batch_size: int = 8
    seq_length: int = 256
    log_interval: int = 1
    save_interval: int = 0  # 0: only at the end (and on exit_interval / exit_duration_mins)
    eval_interval: int = 50  # 0: never
    eval_iters: int = 4
    exit_interval: int = 0
    exit_duration_mins: float = 0.0
    grad_clip: float = 1.0
    device: str = "auto"  # auto (cuda if available), cpu, cuda
    max_consecutive_skips: int = 3  # steps with a non-finite loss/gradient are skipped; this many in a row stop the run


@dataclass
class DataConfig:
    name: str = "embedded"  # embedded (the Python standard library, no download) or indexed
    paths: list = field(default_factory=list)  # indexed: [weight, prefix, weight, prefix, ...] or [prefix, ...]
    split: str = "98,2,0"  # train,valid,test proportions over contiguous document ranges (Megatron style)
    tokenizer: str = ""  # indexed: the tokenizer.json the data was made with (checks model.vocab_size)
    cache_dir: str = ""  # embedded: where the tokenizer and token cache live ('' = <repo>/.cache)
    tokenizer_vocab_size: int = 8192  # embedded: BPE vocabulary trained on the corpus
    reset_at_document_boundaries: bool = True  # KDA state, conv and MLA attention restart per document


@dataclass
class OptimConfig:
    """optim=adamw, or optim=muon: Per-Head Muon for matrices + AdamW (beta1, beta2, eps) for the rest, one lr
    schedule and one weight decay for both (megatron_k3.optim.muon; MODEL.md section 6)."""
    name: str = "muon"  # muon or adamw
    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 10
    decay: str = "cosine"  # cosine or constant (after warmup)
    # ---- muon
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # quintic Newton-Schulz iterations
    ns_dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU), fp32, bf16
    muon_scale: float = 0.2  # update = muon_scale * sqrt(max(rows, cols)) * NS(momentum): AdamW's RMS
    per_head: bool = True  # orthogonalise each attention head's block of a head-partitioned projection on its own
    qk_clip: float = 0.0  # QK-Clip threshold tau on Gated MLA's per-head max logit (K2 used 100); 0 = off


@dataclass
class MoEConfig:
    """How the routers' selection bias is balanced (megatron_k3.training.balancing)."""
    balancing: str = "quantile"  # quantile (K3's Quantile Balancing), sign (DeepSeek-V3's +-rate), none
    quantile_estimator: str = "auto"  # exact (gather every margin), histogram (pooled counts), auto (by size)
    exact_max_margins: int = 4_000_000  # auto: exact while tokens x experts per layer and step stay below this
    histogram_bins: int = 4096  # histogram: error of the quantile <= one bin width = range / bins
    sign_rate: float = 1e-3  # sign: bias step per optimizer step
    rescore: bool = False  # quantile: estimate from this step's tokens re-scored by the updated router
    rescore_max_tokens: int = 8192  # rescore: router inputs kept per micro-batch and rank (a strided subset)


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32, bf16, mx_qat, te_fp8, te_mxfp8 (megatron_k3.precision)
    dtype: str = "fp32"  # fp32 or bf16 (autocast; master weights stay fp32); mx_qat and te_* need bf16
    param_dtype: str = "fp32"  # bf16: DeepSpeed's bf16 mode (module weights and gradients bf16; fp32 master
    #                            weights, fp32 gradient accumulation and optimizer states in ZeRO's partitions)
    # mx_qat: routed experts' weights and input activations fake-quantised to MX, blocks along the reduction dim
    mx_weight_format: str = "e2m1"  # MXFP4
    mx_act_format: str = "e4m3"  # MXFP8
    mx_block_size: int = 32
    mx_weight_scale_mode: str = "floor"  # floor (OCP spec) or rceil (Blackwell hardware)
    mx_act_scale_mode: str = "floor"


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline, online, disabled
    project: str = "megatron-k3"
    entity: str = ""
    name: str = ""
    media_interval: int = 25  # steps between expert-load heatmaps/histograms
    top_experts: int = 4  # how many most/least loaded experts to log as series


@dataclass
class LoggingConfig:
    level: str = "INFO"
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CheckpointConfig:
    dir: str = ""  # '' = <run dir>/checkpoints
    load: str = ""  # '' = start fresh; auto = newest complete checkpoint in dir; or a checkpoint path
    keep_last: int = 3


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self, world_size: int = 1) -> "RunConfig":
        self.model.validate("model")
        t, p, o = self.train, self.parallel, self.optim
        for k in ("steps", "micro_batch_size", "global_batch_size", "seq_length", "log_interval", "eval_iters"):
            v = getattr(t, k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"train.{k}", v, "must be a positive integer")
        for k in ("save_interval", "eval_interval", "exit_interval"):
            if getattr(t, k) < 0:
                raise ConfigError(f"train.{k}", getattr(t, k), "must be >= 0 (0 = off)")
        if t.exit_duration_mins < 0:
            raise ConfigError("train.exit_duration_mins", t.exit_duration_mins, "must be >= 0 (0 = off)")
        if t.grad_clip < 0:
            raise ConfigError("train.grad_clip", t.grad_clip, "must be >= 0 (0 = off)")
        if not isinstance(t.max_consecutive_skips, int) or t.max_consecutive_skips < 1:
            raise ConfigError("train.max_consecutive_skips", t.max_consecutive_skips, "must be an integer >= 1")
        if not p.timeout_minutes > 0:
            raise ConfigError("parallel.timeout_minutes", p.timeout_minutes, "must be > 0")
        if t.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("train.device", t.device, "valid: auto, cpu, cuda")
        for k in ("tp", "pp", "ep", "cp"):
            v = getattr(p, k)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"parallel.{k}", v, "must be a positive integer")
        axes = p.order.split("-")
        if sorted(axes) != sorted(["tp", "cp", "ep", "dp", "pp"]):
            raise ConfigError("parallel.order", p.order, "a permutation of tp-cp-ep-dp-pp")
        m = self.model
        for heads_key in ("kda_num_heads", "mla_num_heads"):
            if getattr(m, heads_key) % p.tp:
                raise ConfigError("parallel.tp", p.tp, f"must divide model.{heads_key}={getattr(m, heads_key)}")
        if p.tp > 1:  # every tensor split by tensor parallelism must divide evenly
            splits = {"vocab_size": m.vocab_size, "decay_rank (kda_decay_rank or kda_head_dim)": m.decay_rank,
                      "kv_lora_rank + qk_rope_head_dim": m.kv_lora_rank + m.qk_rope_head_dim,
                      "dense_intermediate_size": m.dense_intermediate_size}
            if m.q_lora_rank:
                splits["q_lora_rank"] = m.q_lora_rank
            if m.kda_output_gate == "lowrank":
                splits["kda_head_dim"] = m.kda_head_dim
            if m.num_shared_experts and m.first_k_dense < m.num_layers:
                splits["shared_ffn_size"] = m.shared_ffn_size
            for what, n in splits.items():
                if n % p.tp:
                    raise ConfigError("parallel.tp", p.tp, f"must divide model.{what}={n}")
            if p.sequence_parallel and (t.micro_batch_size * t.seq_length) % p.tp:
                raise ConfigError("parallel.sequence_parallel", True,
                                  f"needs train.micro_batch_size*train.seq_length divisible by parallel.tp={p.tp}")
        if m.first_k_dense < m.num_layers and m.num_experts % p.ep:
            raise ConfigError("parallel.ep", p.ep, f"must divide model.num_experts={m.num_experts}")
        if p.ep > self.cluster.supernode_size:
            raise ConfigError("parallel.ep", p.ep,
                              f"EP groups stay inside one supernode: must be <= cluster.supernode_size="
                              f"{self.cluster.supernode_size}")
        if p.cp > 1:  # zigzag context parallelism: 2*cp equal chunks per sequence (megatron_k3/parallel/context.py)
            if t.seq_length % (2 * p.cp):
                raise ConfigError("parallel.cp", p.cp, f"splits each sequence into 2*cp={2 * p.cp} equal chunks: "
                                  f"train.seq_length={t.seq_length} must be divisible by {2 * p.cp}")
            chunk = t.seq_length // (2 * p.cp)
            if any(ty == "kda" for ty in m.layer_types()) and chunk < m.kda_conv_size - 1:
                raise ConfigError("parallel.cp", p.cp, f"chunks of train.seq_length/(2*cp)={chunk} tokens are shorter "
                                  f"than the short convolution's halo of model.kda_conv_size-1={m.kda_conv_size - 1}")
            local = t.micro_batch_size * t.seq_length // p.cp
            if p.tp > 1 and local % p.tp and (p.sequence_parallel or m.first_k_dense < m.num_layers):
                raise ConfigError("parallel.cp", p.cp, f"each CP rank holds micro_batch_size*seq_length/cp={local} "
                                  f"tokens, which must divide over parallel.tp={p.tp}")
        if p.pp > 1:  # pipeline stages hold whole AttnRes blocks (megatron_k3/parallel/pipeline.py)
            from .planning.layout import stage_layers

            try:
                stage_layers(m, p.pp)
            except ValueError as e:
                raise ConfigError("parallel.pp", p.pp, f"{e} (model.num_layers={m.num_layers}, "
                                  f"model.attn_res_block_size={m.attn_res_block_size})") from None
            if m.tie_word_embeddings:
                raise ConfigError("parallel.pp", p.pp, "model.tie_word_embeddings=true needs the embedding and the "
                                  "LM head on one stage: use parallel.pp=1 or untied embeddings")
            if p.zero_stage == 0:
                raise ConfigError("parallel.zero_stage", 0, f"with parallel.pp={p.pp} use ZeRO 1 or 2: DeepSpeed's "
                                  "ZeRO-0 clipping counts replicated parameters on model-parallel rank 0 only, "
                                  "i.e. on the first stage")
        model_parallel = p.tp * p.pp * p.cp
        if world_size % model_parallel:
            raise ConfigError("parallel.tp", p.tp, f"tp*pp*cp={model_parallel} must divide the world size {world_size}")
        dp = world_size // model_parallel
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise ConfigError("train.global_batch_size", t.global_batch_size,
                              f"must be a multiple of micro_batch_size*dp = {t.micro_batch_size}*{dp}")
        if not (0 <= o.min_lr <= o.lr):
            raise ConfigError("optim.min_lr", o.min_lr, f"must lie in [0, optim.lr={o.lr}]")
        if o.lr <= 0:
            raise ConfigError("optim.lr", o.lr, "must be > 0")
        if o.warmup_steps < 0:
            raise ConfigError("optim.warmup_steps", o.warmup_steps, "must be >= 0")
        if o.name not in ("adamw", "muon"):
            raise ConfigError("optim", o.name, "valid: adamw, muon")
        if o.weight_decay < 0:
            raise ConfigError("optim.weight_decay", o.weight_decay, "must be >= 0")
        for k in ("beta1", "beta2", "momentum"):
            if not (0 <= getattr(o, k) < 1):
                raise ConfigError(f"optim.{k}", getattr(o, k), "must lie in [0, 1)")
        if o.eps <= 0:
            raise ConfigError("optim.eps", o.eps, "must be > 0")
        if not isinstance(o.ns_steps, int) or isinstance(o.ns_steps, bool) or o.ns_steps <= 0:
            raise ConfigError("optim.ns_steps", o.ns_steps, "must be a positive integer")
        if o.ns_dtype not in ("auto", "fp32", "bf16"):
            raise ConfigError("optim.ns_dtype", o.ns_dtype, "valid: auto, fp32, bf16")
        if o.muon_scale <= 0:
            raise ConfigError("optim.muon_scale", o.muon_scale, "must be > 0 (0.2 matches AdamW's update RMS)")
        if o.qk_clip < 0:
            raise ConfigError("optim.qk_clip", o.qk_clip, "must be >= 0 (0 = off; K2 used 100)")
        if o.qk_clip > 0 and o.name != "muon":
            raise ConfigError("optim.qk_clip", o.qk_clip, "QK-Clip is part of optim=muon (MuonClip); use 0 with adamw")
        if o.decay not in ("cosine", "constant"):
            raise ConfigError("optim.decay", o.decay, "valid: cosine, constant")
        pr = self.precision
        if pr.dtype not in ("fp32", "bf16"):
            raise ConfigError("precision.dtype", pr.dtype, "valid: fp32, bf16")
        if pr.param_dtype not in ("fp32", "bf16"):
            raise ConfigError("precision.param_dtype", pr.param_dtype, "valid: fp32, bf16")
        if p.zero_stage not in (0, 1, 2):
            raise ConfigError("parallel.zero_stage", p.zero_stage,
                              "valid: 0, 1, 2 (ZeRO-3 would partition parameters that tensor/expert parallelism "
                              "already shards)")
        if pr.name not in ("fp32", "bf16", "mx_qat", "te_fp8", "te_mxfp8"):
            raise ConfigError("precision", pr.name, "valid: fp32, bf16, mx_qat, te_fp8, te_mxfp8")
        if pr.name in ("mx_qat", "te_fp8", "te_mxfp8") and pr.dtype != "bf16":
            raise ConfigError("precision.dtype", pr.dtype, f"precision={pr.name} runs the rest of the model in bf16")
        if pr.name == "mx_qat":
            for k, ok in (("mx_weight_format", ("e2m1", "e4m3", "e5m2")), ("mx_act_format", ("e2m1", "e4m3", "e5m2")),
                          ("mx_weight_scale_mode", ("floor", "rceil")), ("mx_act_scale_mode", ("floor", "rceil"))):
                if getattr(pr, k) not in ok:
                    raise ConfigError(f"precision.{k}", getattr(pr, k), "valid: " + ", ".join(ok))
            bs = pr.mx_block_size
            if not isinstance(bs, int) or bs <= 0:
                raise ConfigError("precision.mx_block_size", bs, "must be a positive integer")
            if m.first_k_dense < m.num_layers:
                for k, v in (("moe_latent_size" if m.moe_latent_size else "hidden_size", m.expert_width),
                             ("moe_intermediate_size", m.moe_intermediate_size)):
                    if v % bs:
                        raise ConfigError(f"model.{k}", v, f"precision=mx_qat needs a multiple of "
                                          f"precision.mx_block_size={bs}")
        mo = self.moe
        if mo.balancing not in ("quantile", "sign", "none"):
            raise ConfigError("moe.balancing", mo.balancing, "valid: quantile, sign, none")
        if mo.quantile_estimator not in ("auto", "exact", "histogram"):
            raise ConfigError("moe.quantile_estimator", mo.quantile_estimator, "valid: auto, exact, histogram")
        if mo.histogram_bins < 2:
            raise ConfigError("moe.histogram_bins", mo.histogram_bins, "must be >= 2")
        if m.first_k_dense < m.num_layers and p.ep > 1 and p.zero_stage == 0:
            raise ConfigError("parallel.zero_stage", 0, "expert parallelism needs parallel.zero_stage 1 or 2")
        if o.name == "muon" and p.zero_stage == 0 and self.precision.param_dtype == "bf16":
            raise ConfigError("parallel.zero_stage", 0, "optim=muon with precision.param_dtype=bf16 needs ZeRO 1 or 2 "
                              "(DeepSpeed's ZeRO-0 bf16 optimizer steps flattened vectors, not matrices)")
        if m.first_k_dense < m.num_layers and p.tp > 1 and (t.micro_batch_size * t.seq_length) % p.tp:
            raise ConfigError("parallel.tp", p.tp, f"each TP rank routes 1/tp of the tokens: needs "
                              f"train.micro_batch_size*train.seq_length divisible by parallel.tp")
        self.cluster.validate("cluster")
        if self.logging.wandb.mode not in ("offline", "online", "disabled"):
            raise ConfigError("logging.wandb.mode", self.logging.wandb.mode, "valid: offline, online, disabled")
        if self.data.name not in ("embedded", "indexed"):
            raise ConfigError("data", self.data.name, "valid: embedded, indexed")
        if self.data.name == "indexed" and not self.data.paths:
            raise ConfigError("data.paths", list(self.data.paths),
                              "data=indexed needs Megatron .bin/.idx prefixes: [prefix, ...] or [weight, prefix, ...]")
        try:
            parse_split(self.data.split)
        except ValueError as e:
            raise ConfigError("data.split", self.data.split, str(e)) from None
        return self


def parse_split(split) -> list:
    """'98,2,0' -> three non-negative proportions (train, valid, test), normalised to sum to 1."""
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise ValueError("expected comma-separated proportions like '98,2,0'") from None
    parts += [0.0] * (3 - len(parts))
    if len(parts) != 3 or min(parts) < 0 or sum(parts) <= 0:
        raise ValueError("expected three non-negative proportions like '98,2,0'")
    return [p / sum(parts) for p in parts]


def _apply_overrides(cfg, overrides: Iterable[str], prefix: str):
    from omegaconf import OmegaConf

    dotlist = []
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(ov, None, "an override must look like key=value")
        k, v = ov.split("=", 1)
        k = k.lstrip("+")
        if k.startswith(prefix + "."):
            k = k[len(prefix) + 1:]
        dotlist.append(f"{k}={v}")
    if dotlist:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist))
        except Exception as e:  # omegaconf raises several types; give one clear line
            raise ConfigError(_omegaconf_key(e, prefix), _omegaconf_value(e), _first_line(e)) from None
    return cfg


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _omegaconf_key(e, prefix):
    k = getattr(e, "full_key", None) or getattr(e, "key", None) or "?"
    return f"{prefix}.{k}" if prefix and not str(k).startswith(prefix) else str(k)


def _omegaconf_value(e):
    return getattr(e, "value", None)


def available_models() -> list:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def model_config_from_dict(d: dict, prefix: str = "model") -> ModelConfig:
    """Build and validate a ModelConfig from a plain mapping (e.g. a Hydra-composed `cfg.model`)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}", d[unknown[0]], "unknown key for the model config")
    cfg = ModelConfig(**{k: (list(v) if k == "mla_layers" else v) for k, v in d.items()})
    return cfg.validate(prefix)


def load_model_config(name: str, overrides: Iterable[str] = ()) -> ModelConfig:
    """Compose `conf/model/<name>.yaml` onto the ModelConfig schema, apply `key=value` overrides
    (with or without a leading `model.`), validate, and return the dataclass. Starts no run."""
    from omegaconf import OmegaConf

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError("model", name, f"no file {path}; available: {', '.join(available_models())}")
    schema = OmegaConf.structured(ModelConfig)
    try:
        cfg = OmegaConf.merge(schema, OmegaConf.load(path))
    except Exception as e:
        raise ConfigError(_omegaconf_key(e, "model"), _omegaconf_value(e), f"{_first_line(e)} (in {path})") from None
    cfg = _apply_overrides(cfg, overrides, "model")
    return model_config_from_dict(OmegaConf.to_container(cfg, resolve=True))


def _register_schema():
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="run_schema", node=RunConfig)


def compose_run_config(overrides: Iterable[str] = (), world_size: int = 1):
    """Compose conf/config.yaml with Hydra (schema-checked), apply command-line overrides, validate.
    Returns (RunConfig, the composed DictConfig without `hydra`, the hydra node). Raises ConfigError
    with a one-line message on any mistake."""
    run, cfg, hydra_node = compose_config(overrides)
    run.validate(world_size)
    return run, cfg, hydra_node


def compose_config(overrides: Iterable[str] = ()):
    """`compose_run_config` without the run's validation (the layout is not known yet): for tools such as
    the planner that check a layout themselves. Key names and types are still checked by the schema."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf, open_dict

    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="megatron_k3"):
            cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        hydra_node = cfg.hydra
        with open_dict(cfg):
            del cfg["hydra"]
        run = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as e:  # Hydra / OmegaConf errors are multi-line; reduce them to one line
        raise _one_line_error(e, overrides) from None
    finally:
        GlobalHydra.instance().clear()
    return run, cfg, hydra_node


def _one_line_error(e: Exception, overrides) -> ConfigError:
    from omegaconf.errors import OmegaConfBaseException

    chain, x = [], e
    while x is not None and len(chain) < 8:
        chain.append(x)
        x = x.__cause__ or x.__context__
    for x in chain:
        if isinstance(x, OmegaConfBaseException) and getattr(x, "full_key", None):
            msg = str(x).strip().splitlines()[0]
            key = x.full_key
            for o in overrides:  # report the override the user typed when it names this key or a child
                k = o.lstrip("+").split("=", 1)[0]
                if k == key or k.startswith(key + "."):
                    key = k
            given = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").split("=", 1)[0] == key), None)
            if "not in" in msg or "Key '" in msg:
                return ConfigError(key, given, f"unknown key ({msg})")
            return ConfigError(key, given if given is not None else getattr(x, "value", None), msg)
    text = " ".join(str(e).split())
    options = getattr(e, "options", None)
    missing = getattr(e, "missing_cfg_file", None)
    if missing and "/" in str(missing):
        group, name = str(missing).split("/", 1)
        avail = ", ".join(options) if options else "see conf/" + group
        return ConfigError(group, name, f"no such option; available: {avail}")
    for o in overrides:
        k = o.lstrip("+").split("=", 1)[0]
        if k and f"'{k}'" in text or f"'{o}'" in text:
            return ConfigError(k, o.split("=", 1)[1] if "=" in o else None, text[:300])
    return ConfigError("config", None, text[:300])


def replace(cfg: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(cfg, **changes).validate()


__all__ = ["RunConfig", "ClusterConfig", "ParallelConfig", "TrainConfig", "DataConfig", "OptimConfig",
           "PrecisionConfig", "LoggingConfig", "WandbConfig", "CheckpointConfig", "ModelConfig", "ConfigError", "load_model_config", "model_config_from_dict", "available_models",
           "CONF_DIR", "replace", "compose_run_config", "compose_config"]
