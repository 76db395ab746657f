"""Typed configuration schemas, one dataclass per Hydra group, each with its own `validate`.

The dataclasses hold every key, its type, its default and its check; `conf/<group>/<option>.yaml` only sets the
values an option changes (a test fails when a YAML restates a default). A mistake raises `ConfigError`, one
line naming the key, the value and what would be valid. `RunConfig.validate(world_size)` runs every group's
check, then the cross-group rules: the parallel layout (the one check in `megatron_k3.layout`), and the pairings
of ZeRO stage, optimizer and precision.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict

from ..errors import ConfigError
from ..layout import has_moe, layout_problems, replica_slots, stage_layers

# Marks a ModelConfig field that changes no tensor and no tensor's meaning: it may differ between a checkpoint and
# the run that loads it, and between a Hugging Face config.json and the model config it is loaded for.
RUNTIME = {"runtime": True}


def _key(prefix: str, k: str) -> str:
    return f"{prefix}.{k}" if prefix else k


# train.recompute's policies and the module kinds of selective recomputation (megatron_k3.parallel.recompute, whose
# docstring says what each rebuilds; megatron_k3.planning.activations tags its terms with the same names)
RECOMPUTE_POLICIES = ("none", "selective", "full", "auto")
RECOMPUTE_MODULES = ("attn_res", "layernorm", "core_attn", "mlp_act", "moe_act")


def recompute_regions(m) -> tuple:
    """The RECOMPUTE_MODULES a model (ModelConfig) has regions of, in that order (parallel.recompute wraps them):
    norms and the mixers' cores always, the AttnRes depth mixes with model.attn_res, the dense FFN's and the shared
    experts' activation with dense layers or shared experts, the routed experts' with MoE layers."""
    ffn = m.ffn_types()
    kinds = {"layernorm", "core_attn"}
    if m.attn_res:
        kinds.add("attn_res")
    if "dense" in ffn or ("moe" in ffn and m.num_shared_experts):
        kinds.add("mlp_act")
    if "moe" in ffn:
        kinds.add("moe_act")
    return tuple(k for k in RECOMPUTE_MODULES if k in kinds)


def recomputed_kinds(policy: str, modules) -> frozenset:
    """The module kinds a policy rebuilds: under selective the given ones (empty: all of RECOMPUTE_MODULES), else
    none (full recomputes whole layers, not kinds)."""
    return frozenset(modules or RECOMPUTE_MODULES) if policy == "selective" else frozenset()


def kda_tile(tile_tokens: int, chunk_size: int) -> int:
    """KDA's sequence tile under train.tile_tokens: the whole chunks of model.kda_chunk_size that cover that many
    tokens (a tile boundary is a chunk boundary; parallel.tiling runs it, the planner counts it)."""
    return -(-tile_tokens // chunk_size) * chunk_size


def _require_ints(obj, prefix: str, keys, minimum: int) -> None:
    for k in keys:
        v = getattr(obj, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise ConfigError(_key(prefix, k), v, "must be a positive integer" if minimum > 0 else
                              "must be an integer >= 0")


def _require_choice(obj, prefix: str, k: str, choices) -> None:
    v = getattr(obj, k)
    if v not in choices:
        raise ConfigError(_key(prefix, k), v, "valid: " + ", ".join(map(str, choices)))


def _value(x):
    """A config value as hashable plain data: dataclasses as (class name, field values), lists as tuples."""
    if dataclasses.is_dataclass(x):
        return (type(x).__name__,) + tuple(_value(getattr(x, f.name)) for f in dataclasses.fields(x))
    if isinstance(x, (list, tuple)):
        return tuple(_value(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _value(v)) for k, v in x.items()))
    return x


def _value_hash(self) -> int:
    """Configs the planner memoises on (model, vision, cluster) hash by value, as they compare. The hash is kept
    until a field is set again (`_setattr`); a config is read-only once validated (dataclasses.replace makes
    another one), so a nested config is not changed in place."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = self.__dict__["_hash"] = hash(_value(self))
    return h


# what a config derives from its fields and keeps until a field is set again: its hash, ModelConfig's layer kinds
_DERIVED = ("_hash", "_kinds")


def _setattr(self, name, value) -> None:
    for k in _DERIVED:
        self.__dict__.pop(k, None)
    object.__setattr__(self, name, value)


def _getstate(self) -> dict:
    """Pickled and copied without what it derives: string hashes differ between processes (PYTHONHASHSEED)."""
    return {k: v for k, v in self.__dict__.items() if k not in _DERIVED}


@dataclass
class VisionConfig:
    """K3's vision tower (MoonViT-3D) and projector (patchmergerv2), `model.vision.*`; the defaults are the released
    K3's `vision_config` (vt_* keys there). Off (`enabled: false`) in the text-only models. The fixed choices of the
    released tower (divided fixed position embedding, RMSNorm, GELU-tanh MLP without biases, 2D RoPE, sd2_tpool
    merge, patchmergerv2 projector) are not keys: a checkpoint that differs is refused on load."""
    __hash__, __setattr__, __getstate__ = _value_hash, _setattr, _getstate
    enabled: bool = False
    patch_size: int = 14  # pixels per patch side; pixel_values are [patches, 3, patch_size, patch_size]
    hidden_size: int = 1024  # vt_hidden_size
    num_layers: int = 27  # vt_num_hidden_layers
    num_heads: int = 12  # vt_num_attention_heads
    qkv_hidden_size: int = 1536  # width of q, k and v (heads x head dim; head dim 128 in K3)
    intermediate_size: int = 4096  # vt_intermediate_size
    pos_emb_height: int = 64  # init_pos_emb_height: the learned 2D position table, interpolated to each grid
    pos_emb_width: int = 64  # init_pos_emb_width
    pos_emb_time: int = 4  # init_pos_emb_time: frames per video chunk (fixed sin-cos time embedding)
    pos_emb_interpolation: str = "bilinear"  # pos_emb_interpolation_mode (bilinear or bicubic)
    merge_kernel_size: list = field(default_factory=lambda: [2, 2])  # patches merged into one feature (h, w)
    rope_max_grid: int = 512  # largest patch grid side the 2D rotary table covers
    rope_theta: float = 10000.0
    projector_eps: float = 1e-5  # projector_ln_eps: the projector's output RMSNorm
    placeholder_token_id: int = 163605  # media_placeholder_token_id

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads

    @property
    def merge_size(self) -> int:
        return int(self.merge_kernel_size[0]) * int(self.merge_kernel_size[1])

    def validate(self, prefix: str = "model.vision", vocab_size: int | None = None) -> "VisionConfig":
        if not self.enabled:
            return self
        _require_ints(self, prefix, ("patch_size", "hidden_size", "num_layers", "num_heads", "qkv_hidden_size",
                                     "intermediate_size", "pos_emb_height", "pos_emb_width", "pos_emb_time",
                                     "rope_max_grid"), 1)
        if self.qkv_hidden_size % self.num_heads or self.head_dim % 4:
            raise ConfigError(_key(prefix, "qkv_hidden_size"), self.qkv_hidden_size,
                              f"must be num_heads={self.num_heads} x a head dim divisible by 4 (2D rotary)")
        _require_choice(self, prefix, "pos_emb_interpolation", ("bilinear", "bicubic"))
        mk = list(self.merge_kernel_size)
        if len(mk) != 2 or any(not isinstance(v, int) or v < 1 for v in mk):
            raise ConfigError(_key(prefix, "merge_kernel_size"), mk, "two positive integers [height, width]")
        if vocab_size is not None and not 0 <= self.placeholder_token_id < vocab_size:
            raise ConfigError(_key(prefix, "placeholder_token_id"), self.placeholder_token_id,
                              f"must be a token id below model.vocab_size={vocab_size}")
        if self.projector_eps <= 0:
            raise ConfigError(_key(prefix, "projector_eps"), self.projector_eps, "must be > 0")
        return self


@dataclass
class ModelConfig:
    """Every architectural knob of the K3 / Kimi Linear family; the defaults are K3's (conf/model/k3.yaml).

    The same code expresses K3 (AttnRes, SiTU, latent MoE, lower-bound KDA gate, full-rank output gate,
    gated MLA) and Kimi Linear (ordinary residuals, SwiGLU, no latent projection, softplus gate, low-rank
    output gate, ungated MLA) through these switches.
    """
    __hash__, __setattr__, __getstate__ = _value_hash, _setattr, _getstate

    name: str = field(default="custom", metadata=RUNTIME)
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_layers: int = 93
    rms_norm_eps: float = 1e-5
    initializer_range: float = field(default=0.02, metadata=RUNTIME)
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
    kda_chunk_size: int = field(default=64, metadata=RUNTIME)
    # "zero" (from-scratch K3 recommendation) or "uniform_1_16" (fla / Kimi Linear)
    kda_a_log_init: str = field(default="zero", metadata=RUNTIME)

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
    # debug knob: round-robin routing, for throughput ceilings
    router_force_balanced: bool = field(default=False, metadata=RUNTIME)
    # drop: static-shape dispatch with fixed capacity; dropless: every assignment (split sizes on the host under
    # ep > 1); auto: drop under ep > 1, else dropless
    moe_overflow: str = field(default="auto", metadata=RUNTIME)
    # drop: slots per expert = ceil(factor * tokens * top_k / num_experts)
    moe_capacity_factor: float = field(default=1.25, metadata=RUNTIME)

    # ---- Block Attention Residuals
    attn_res: bool = True
    attn_res_block_size: int = 12  # decoder layers per block

    # ---- vision (K3ForConditionalGeneration): the tower and projector, off in text-only models
    vision: VisionConfig = field(default_factory=VisionConfig)
    freeze_vision: bool = field(default=False, metadata=RUNTIME)  # the tower and projector take no updates

    def __post_init__(self):
        if isinstance(self.vision, dict):  # a config read back from JSON (a checkpoint's, a tool's)
            self.vision = VisionConfig(**self.vision)

    # ------------------------------------------------------------------ derived
    def mla_layer_set(self) -> set:
        """0-based indices of the Gated MLA layers."""
        if self.mla_layers:
            return {int(i) - 1 for i in self.mla_layers}
        out = {i - 1 for i in range(self.mla_every, self.num_layers + 1, self.mla_every)} if self.mla_every else set()
        if self.mla_at_last:
            out.add(self.num_layers - 1)
        return out

    def _layer_kinds(self) -> tuple:
        """(mixer kind per layer, FFN kind per layer), kept until a field is set again, as the hash is (the planner
        asks for them per layer, hundreds of thousands of times in a search), and made again if the fields they
        follow differ (model.mla_layers is a list: an edit in place sets no field)."""
        inputs = (self.num_layers, self.first_k_dense, self.mla_every, self.mla_at_last, tuple(self.mla_layers or ()))
        kinds = self.__dict__.get("_kinds")
        if kinds is None or kinds[0] != inputs:
            mla = self.mla_layer_set()
            kinds = self.__dict__["_kinds"] = (inputs, (
                tuple("mla" if i in mla else "kda" for i in range(self.num_layers)),
                tuple("dense" if i < self.first_k_dense else "moe" for i in range(self.num_layers))))
        return kinds[1]

    def layer_types(self) -> list:
        return list(self._layer_kinds()[0])

    def ffn_types(self) -> list:
        return list(self._layer_kinds()[1])

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
        _require_ints(self, prefix, ("vocab_size", "hidden_size", "num_layers", "kda_num_heads", "kda_head_dim",
                                     "kda_conv_size", "kda_chunk_size", "mla_num_heads", "kv_lora_rank",
                                     "qk_nope_head_dim", "v_head_dim", "dense_intermediate_size",
                                     "attn_res_block_size", "router_num_groups", "router_topk_groups"), 1)
        _require_ints(self, prefix, ("q_lora_rank", "qk_rope_head_dim", "kda_decay_rank", "moe_latent_size",
                                     "num_shared_experts", "shared_intermediate_size", "first_k_dense",
                                     "mla_every"), 0)
        if self.rms_norm_eps <= 0:
            raise ConfigError(_key(prefix, "rms_norm_eps"), self.rms_norm_eps, "must be > 0")
        _require_choice(self, prefix, "kda_gate", ("lowerbound", "softplus"))
        if self.kda_gate == "lowerbound" and not (-5.0 <= self.kda_gate_lower_bound < 0):
            raise ConfigError(_key(prefix, "kda_gate_lower_bound"), self.kda_gate_lower_bound, "must lie in [-5, 0)")
        _require_choice(self, prefix, "kda_output_gate", ("full", "lowrank"))
        _require_choice(self, prefix, "kda_a_log_init", ("zero", "uniform_1_16"))
        _require_choice(self, prefix, "hidden_act", ("situ", "silu"))
        bad = [i for i in self.mla_layers if not (1 <= int(i) <= self.num_layers)]
        if bad:
            raise ConfigError(_key(prefix, "mla_layers"), list(self.mla_layers),
                              f"1-based layer numbers in [1, {self.num_layers}]")
        if self.first_k_dense > self.num_layers:
            raise ConfigError(_key(prefix, "first_k_dense"), self.first_k_dense,
                              f"must be <= num_layers={self.num_layers}")
        if has_moe(self):
            self._validate_moe(prefix)
        self.vision.validate(_key(prefix, "vision"), self.vocab_size)
        if self.freeze_vision and not self.vision.enabled:
            raise ConfigError(_key(prefix, "freeze_vision"), True, "the model has no vision tower "
                              "(model.vision.enabled=false)")
        return self

    def _validate_moe(self, prefix: str) -> None:
        if self.num_experts <= 0:
            raise ConfigError(_key(prefix, "num_experts"), self.num_experts, "must be a positive integer")
        if not (1 <= self.top_k <= self.num_experts):
            raise ConfigError(_key(prefix, "top_k"), self.top_k, f"must be in [1, num_experts={self.num_experts}]")
        if self.moe_intermediate_size <= 0:
            raise ConfigError(_key(prefix, "moe_intermediate_size"), self.moe_intermediate_size, "must be > 0")
        if self.num_experts % self.router_num_groups:
            raise ConfigError(_key(prefix, "router_num_groups"), self.router_num_groups,
                              f"must divide num_experts={self.num_experts}")
        if self.router_topk_groups > self.router_num_groups:
            raise ConfigError(_key(prefix, "router_topk_groups"), self.router_topk_groups,
                              f"must be <= router_num_groups={self.router_num_groups}")
        _require_choice(self, prefix, "moe_overflow", ("auto", "drop", "dropless", "balanced"))
        if not self.moe_capacity_factor > 0:
            raise ConfigError(_key(prefix, "moe_capacity_factor"), self.moe_capacity_factor, "must be > 0")
        per_group = self.num_experts // self.router_num_groups
        if self.router_num_groups > 1 and self.top_k > self.router_topk_groups * per_group:
            raise ConfigError(_key(prefix, "top_k"), self.top_k, f"must be <= router_topk_groups * experts per "
                              f"group = {self.router_topk_groups * per_group}")


RUNTIME_MODEL_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.metadata.get("runtime"))


@dataclass
class ClusterConfig:
    """The hardware: sizes, peak rates and link bandwidths (used by the planner and for MFU); the defaults describe
    this CPU machine (conf/cluster/cpu.yaml)."""
    __hash__, __setattr__, __getstate__ = _value_hash, _setattr, _getstate
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
    host_memory_gb: float = 24.0  # host memory per node (activation offload: train.offload_buffer_gb x devices)
    host_copy_gbps: float = 10.0  # per-device copy bandwidth to / from host memory, GB/s (activation offload)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def host_memory_per_device_gb(self) -> float:
        """A device's share of its node's host memory: what its offloaded layer inputs may take."""
        return self.host_memory_gb / max(self.devices_per_node, 1)

    def validate(self, prefix: str = "cluster") -> "ClusterConfig":
        _require_choice(self, prefix, "device_kind", ("cpu", "gpu"))
        _require_ints(self, prefix, ("num_nodes", "devices_per_node", "supernode_size"), 1)
        for k in ("device_memory_gb", "peak_tflops_bf16", "hbm_gbps", "intra_supernode_gbps", "inter_supernode_gbps",
                  "host_memory_gb", "host_copy_gbps"):
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
    # ZeRO-1/2: reduce the data-parallel gradients bucket by bucket while the last micro-batch's backward runs
    # (DeepSpeed's overlap_comm; Megatron's --overlap-grad-reduce); the planner counts the reduction exposed without it
    overlap_grad_reduce: bool = False

    def validate(self, prefix: str = "parallel") -> "ParallelConfig":
        _require_ints(self, prefix, ("tp", "pp", "ep", "cp"), 1)
        if sorted(self.order.split("-")) != sorted(["tp", "cp", "ep", "dp", "pp"]):
            raise ConfigError(f"{prefix}.order", self.order, "a permutation of tp-cp-ep-dp-pp")
        if not self.timeout_minutes > 0:
            raise ConfigError(f"{prefix}.timeout_minutes", self.timeout_minutes, "must be > 0")
        if self.zero_stage not in (0, 1, 2):
            raise ConfigError(f"{prefix}.zero_stage", self.zero_stage, "valid: 0, 1, 2 (ZeRO-3 would partition "
                              "parameters that tensor/expert parallelism already shards)")
        _require_choice(self, prefix, "backend", ("auto", "nccl", "gloo"))
        if not isinstance(self.overlap_grad_reduce, bool):
            raise ConfigError(f"{prefix}.overlap_grad_reduce", self.overlap_grad_reduce, "must be true or false")
        return self

    def deepspeed_entry(self, path: str):
        """The `parallel.deepspeed` entry at a dotted path ("zero_optimization.stage"), or None where not given."""
        node = self.deepspeed or {}
        for part in path.split("."):
            node = node.get(part) if hasattr(node, "get") else None
        return node


GUARD_POLICIES = ("none", "skip", "stop", "rerun", "rollback")  # megatron_k3.training.guard


@dataclass
class GuardConfig:
    """train.guard (megatron_k3.training.guard, docs/checkpoints_and_faults.md): loss and gradient-norm spikes against
    a rolling window of the accepted steps, and expert-load / router-entropy alarms. Off by default."""
    # none: no spike test (non-finite steps are skipped as always); skip: a spiking step's update is withheld on
    # every rank (Megatron's --check-for-spiky-loss / --check-for-large-grads, MaxText's skip_step_on_spikes);
    # stop: the run stops before applying it; rerun: the step is computed again from the same inputs first (Megatron's
    # --rerun-mode validate_results): the same numbers, a genuine spike, withheld; other numbers on some rank, a
    # suspected hardware fault naming it, then on_fault
    policy: str = "none"
    window: int = 32  # accepted steps the median and spread are taken over
    min_history: int = 8  # steps in the window before a spike can be called
    loss_zscore: float = 6.0  # a loss above median + loss_zscore x robust spread is a spike (0: not tested)
    grad_zscore: float = 6.0  # the same for the global gradient norm (0: not tested)
    min_relative: float = 0.1  # and at least this share above the median (a flat window's spread is tiny)
    alarm_load: float = 0.0  # expert-load max/mean of a MoE layer above this ... (0: off)
    alarm_entropy: float = 0.0  # ... or its router entropy below this (0: off) ...
    alarm_steps: int = 10  # ... for this many steps in a row: a warning naming the layer
    # every this many steps the ranks' compute and collective-wait times are gathered and the slowest named
    # (Megatron's --log-straggler); 0: off
    straggler_interval: int = 0
    rerun_rtol: float = 0.0  # policy=rerun: a rank's loss may differ this much between the passes (0: bit for bit)
    on_fault: str = "continue"  # policy=rerun, numbers that differ: continue (with the re-run's result) or stop
    # policy=rollback: spikes are withheld as under skip, and after rollback_skips of them within rollback_window
    # steps the newest checkpoint is loaded and the samples since it are skipped
    rollback_skips: int = 2
    rollback_window: int = 10

    def validate(self, prefix: str = "train.guard") -> "GuardConfig":
        _require_choice(self, prefix, "policy", GUARD_POLICIES)
        _require_ints(self, prefix, ("window", "min_history", "alarm_steps", "rollback_skips", "rollback_window"), 1)
        _require_ints(self, prefix, ("straggler_interval",), 0)
        _require_choice(self, prefix, "on_fault", ("continue", "stop"))
        if self.min_history > self.window:
            raise ConfigError(f"{prefix}.min_history", self.min_history, f"at most train.guard.window={self.window}")
        if self.min_history < 3:
            raise ConfigError(f"{prefix}.min_history", self.min_history, "at least 3 steps (a median and a spread)")
        for k in ("loss_zscore", "grad_zscore", "min_relative", "alarm_load", "alarm_entropy", "rerun_rtol"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < float("inf"):
                raise ConfigError(f"{prefix}.{k}", v, "a number >= 0 (0: off)")
        return self


@dataclass
class TrainConfig:
    steps: int = 200  # total optimizer steps of the run; a resumed run continues toward the same total
    seed: int = 1234
    micro_batch_size: int = 4
    global_batch_size: int = 8
    seq_length: int = 256
    log_interval: int = 1
    save_interval: int = 100  # 0: only at the end (and on exit_interval / exit_duration_mins)
    eval_interval: int = 50  # 0: never
    eval_iters: int = 4
    exit_interval: int = 0
    exit_duration_mins: float = 0.0
    grad_clip: float = 1.0
    device: str = "auto"  # auto (cuda if available), cpu, cuda
    max_consecutive_skips: int = 3  # steps with a non-finite loss/gradient are skipped; this many in a row stop the run
    # torch.compile each decoder layer (megatron_k3.training.compile, docs/compile.md); the backend
    # (inductor: C++/OpenMP kernels on CPU, Triton on CUDA; aot_eager / eager: tracing only, for debugging) and
    # the compiler's cache directory (relative: to the launch directory)
    compile: bool = False
    compile_backend: str = "inductor"
    compile_cache: str = ".cache/torchinductor"
    # regions: a layer's recomputation regions (parallel.recompute.regions) are graphs of their own, so recomputing
    # one calls the forward's compiled code again and every policy gives the same numbers bit for bit; layer: one
    # graph per layer (the compiler fuses across the regions; selective then agrees with none to rounding only)
    compile_split: str = "regions"
    # deterministic kernels (torch.use_deterministic_algorithms, inductor's deterministic mode, cuBLAS's fixed
    # workspace): the same numbers run after run, at some cost in speed (docs/compile.md)
    deterministic: bool = False
    # activation recomputation (megatron_k3.parallel.recompute, docs/planning.md): none, selective (the regions of
    # recompute_modules keep only their inputs), full (a decoder layer keeps only its input; recompute_num_layers > 0:
    # that many layers per pipeline stage), auto (the least the planner says fits cluster.device_memory_gb)
    recompute: str = "none"
    recompute_modules: list = field(default_factory=list)  # selective: attn_res, layernorm, core_attn, mlp_act,
    # moe_act (empty: all)
    recompute_num_layers: int = 0
    # host memory per rank for the layer inputs full recomputation keeps (megatron_k3.parallel.offload; 0: off): they
    # go to host in the forward, come back for the layer's backward; what does not fit stays on the device
    offload_buffer_gb: float = 0.0
    # tokens per tile of the per-token parts (MoE dispatch and experts, shared experts, LM head and loss;
    # megatron_k3.parallel.tiling) and of KDA's delta rule (the whole chunks covering that many); 0: untiled. Must
    # divide the tokens a device holds per micro-batch
    tile_tokens: int = 0
    # how a step's loss averages its tokens: token (the mean over every loss token of the global batch, Megatron's
    # --calculate-per-token-loss: a conversation's gradient does not depend on the micro-batch or rank it falls in),
    # micro_batch (each micro-batch's mean, then their mean), auto (token for data=chat, else micro_batch)
    loss_average: str = "auto"
    # > 0: passes over the training split (train.steps is then derived from the dataset's samples per epoch and
    # train.global_batch_size; docs/sft.md); 0: train.steps as given
    epochs: float = 0.0
    guard: GuardConfig = field(default_factory=GuardConfig)  # spike guards and alarms (train.guard.*)

    def validate(self, prefix: str = "train") -> "TrainConfig":
        _require_ints(self, prefix, ("steps", "micro_batch_size", "global_batch_size", "seq_length",
                                     "log_interval", "eval_iters"), 1)
        for k in ("save_interval", "eval_interval", "exit_interval"):
            if getattr(self, k) < 0:
                raise ConfigError(f"{prefix}.{k}", getattr(self, k), "must be >= 0 (0 = off)")
        for k in ("exit_duration_mins", "grad_clip"):
            if getattr(self, k) < 0:
                raise ConfigError(f"{prefix}.{k}", getattr(self, k), "must be >= 0 (0 = off)")
        if not isinstance(self.max_consecutive_skips, int) or self.max_consecutive_skips < 1:
            raise ConfigError(f"{prefix}.max_consecutive_skips", self.max_consecutive_skips,
                              "must be an integer >= 1")
        _require_choice(self, prefix, "device", ("auto", "cpu", "cuda"))
        _require_choice(self, prefix, "loss_average", ("auto", "token", "micro_batch"))
        if not isinstance(self.epochs, (int, float)) or not 0 <= self.epochs < float("inf"):
            raise ConfigError(f"{prefix}.epochs", self.epochs, "passes over the training split, >= 0 (0: train.steps)")
        _require_choice(self, prefix, "compile_backend", ("inductor", "aot_eager", "eager"))
        _require_choice(self, prefix, "compile_split", ("regions", "layer"))
        for key in ("compile", "deterministic"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), "must be true or false")
        self._validate_recompute(prefix)
        self.guard.validate(f"{prefix}.guard")
        return self

    def _validate_recompute(self, prefix: str) -> None:
        MODULES = RECOMPUTE_MODULES
        _require_choice(self, prefix, "recompute", RECOMPUTE_POLICIES)
        mods = self.recompute_modules
        if not isinstance(mods, (list, tuple)) or any(m not in MODULES for m in mods):
            raise ConfigError(f"{prefix}.recompute_modules", mods, f"a list of {', '.join(MODULES)} (empty: all)")
        if mods and self.recompute not in ("selective", "auto"):
            raise ConfigError(f"{prefix}.recompute_modules", list(mods), f"applies to train.recompute=selective, "
                              f"not {self.recompute}")
        if not isinstance(self.recompute_num_layers, int) or self.recompute_num_layers < 0:
            raise ConfigError(f"{prefix}.recompute_num_layers", self.recompute_num_layers,
                              "must be an integer >= 0 (0: every layer of a stage)")
        if self.recompute_num_layers and self.recompute not in ("full", "auto"):
            raise ConfigError(f"{prefix}.recompute_num_layers", self.recompute_num_layers,
                              f"applies to train.recompute=full, not {self.recompute}")
        if not isinstance(self.offload_buffer_gb, (int, float)) or not 0 <= self.offload_buffer_gb < float("inf"):
            raise ConfigError(f"{prefix}.offload_buffer_gb", self.offload_buffer_gb, "host GB per rank, >= 0 (0: off)")
        if self.offload_buffer_gb and self.recompute not in ("full", "auto"):
            raise ConfigError(f"{prefix}.offload_buffer_gb", self.offload_buffer_gb, "offloads the layer inputs "
                              f"train.recompute=full keeps, not with train.recompute={self.recompute}")
        if not isinstance(self.tile_tokens, int) or self.tile_tokens < 0:
            raise ConfigError(f"{prefix}.tile_tokens", self.tile_tokens, "tokens per tile, an integer >= 0 (0: off)")


@dataclass
class DataConfig:
    """data=embedded, indexed, multimodal or chat (docs/data.md, docs/sft.md)."""
    # embedded (the Python standard library, no download), indexed (Megatron .bin/.idx), multimodal (image-text) or
    # chat (conversations in K3's chat format, the loss on the assistant's tokens; docs/sft.md)
    name: str = "embedded"
    # indexed: [weight, prefix, weight, prefix, ...] or [prefix, ...]; multimodal, chat: JSONL files in the same forms
    # (empty: the embedded procedurally drawn image-text set; the embedded chat set)
    paths: list = field(default_factory=list)
    split: str = "98,2,0"  # train,valid,test proportions over contiguous document ranges (Megatron style)
    # indexed: the tokenizer.json the data was made with (checks model.vocab_size); multimodal, chat: one to use
    # instead of the embedded BPE: a tokenizer.json, or a K3 directory (tiktoken.model + tokenizer_config.json)
    tokenizer: str = ""
    cache_dir: str = ""  # embedded, multimodal: where the tokenizer and token cache live ('' = <repo>/.cache)
    tokenizer_vocab_size: int = 8192  # embedded, multimodal: BPE vocabulary trained on the corpus
    reset_at_document_boundaries: bool = True  # KDA state, conv and MLA attention restart per document
    # multimodal: a document with a missing/unreadable image, markers that do not match its media, video frames of
    # different sizes or media longer than a sample; chat: a conversation the format rejects or longer than a sample
    # (docs/sft.md): skip (logged, left out) or stop (an error naming file:line)
    on_bad_sample: str = "skip"
    # multimodal: an image or video frame of more patches (model.vision.patch_size squares) is scaled down to about
    # this many (the released processor's in_patch_limit), and to at most image_max_side_patches per side
    image_max_patches: int = 256
    image_max_side_patches: int = 512

    def validate(self, prefix: str = "data") -> "DataConfig":
        if self.name not in ("embedded", "indexed", "multimodal", "chat"):
            raise ConfigError(prefix, self.name, "valid: embedded, indexed, multimodal, chat")
        if self.name == "indexed" and not self.paths:
            raise ConfigError(f"{prefix}.paths", list(self.paths),
                              "data=indexed needs Megatron .bin/.idx prefixes: [prefix, ...] or [weight, prefix, ...]")
        _require_choice(self, prefix, "on_bad_sample", ("skip", "stop"))
        _require_ints(self, prefix, ("image_max_patches", "image_max_side_patches"), 1)
        try:
            parse_split(self.split)
        except ValueError as e:
            raise ConfigError(f"{prefix}.split", self.split, str(e)) from None
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

    def validate(self, prefix: str = "optim") -> "OptimConfig":
        if self.lr <= 0:
            raise ConfigError(f"{prefix}.lr", self.lr, "must be > 0")
        if not (0 <= self.min_lr <= self.lr):
            raise ConfigError(f"{prefix}.min_lr", self.min_lr, f"must lie in [0, optim.lr={self.lr}]")
        if self.warmup_steps < 0:
            raise ConfigError(f"{prefix}.warmup_steps", self.warmup_steps, "must be >= 0")
        if self.name not in ("adamw", "muon"):
            raise ConfigError(prefix, self.name, "valid: adamw, muon")
        if self.weight_decay < 0:
            raise ConfigError(f"{prefix}.weight_decay", self.weight_decay, "must be >= 0")
        for k in ("beta1", "beta2", "momentum"):
            if not (0 <= getattr(self, k) < 1):
                raise ConfigError(f"{prefix}.{k}", getattr(self, k), "must lie in [0, 1)")
        if self.eps <= 0:
            raise ConfigError(f"{prefix}.eps", self.eps, "must be > 0")
        _require_ints(self, prefix, ("ns_steps",), 1)
        _require_choice(self, prefix, "ns_dtype", ("auto", "fp32", "bf16"))
        if self.muon_scale <= 0:
            raise ConfigError(f"{prefix}.muon_scale", self.muon_scale, "must be > 0 (0.2 matches AdamW's update RMS)")
        if self.qk_clip < 0:
            raise ConfigError(f"{prefix}.qk_clip", self.qk_clip, "must be >= 0 (0 = off; K2 used 100)")
        if self.qk_clip > 0 and self.name != "muon":
            raise ConfigError(f"{prefix}.qk_clip", self.qk_clip, "QK-Clip is part of optim=muon (MuonClip); use 0 "
                              "with adamw")
        _require_choice(self, prefix, "decay", ("cosine", "constant"))
        return self


@dataclass
class MoEConfig:
    """How the routers' selection bias is balanced (megatron_k3.training.balancing), and the replica slots of balanced
    dispatch (megatron_k3.parallel.balanced)."""
    balancing: str = "quantile"  # quantile (K3's Quantile Balancing), sign (DeepSeek-V3's +-rate), none
    quantile_estimator: str = "auto"  # exact (gather every margin), histogram (pooled counts), auto (by size)
    exact_max_margins: int = 4_000_000  # auto: exact while tokens x experts per layer and step stay below this
    histogram_bins: int = 4096  # histogram: error of the quantile <= one bin width = range / bins
    sign_rate: float = 1e-3  # sign: bias step per optimizer step
    rescore: bool = False  # quantile: estimate from this step's tokens re-scored by the updated router
    rescore_max_tokens: int = 8192  # rescore: router inputs kept per micro-batch and rank (a strided subset)
    # model.moe_overflow=balanced: replica slots per EP rank (-1: E/ep, which balances exactly for any routing)
    redundant_experts: int = -1
    # balanced: the owners' experts go to the relays once per micro-batch (micro_batch) or once per step (step: less
    # traffic; each rank keeps an fp32 relay store of E/ep experts and its gradient per MoE layer for the step)
    replica_exchange: str = "micro_batch"

    def slots(self, model, parallel) -> int | None:
        """The replica slots balanced dispatch runs with (None where it does not run): layout.replica_slots."""
        return replica_slots(model, parallel.ep, self.redundant_experts)

    def validate(self, prefix: str = "moe") -> "MoEConfig":
        _require_choice(self, prefix, "balancing", ("quantile", "sign", "none"))
        _require_choice(self, prefix, "quantile_estimator", ("auto", "exact", "histogram"))
        _require_choice(self, prefix, "replica_exchange", ("micro_batch", "step"))
        if self.histogram_bins < 2:
            raise ConfigError(f"{prefix}.histogram_bins", self.histogram_bins, "must be >= 2")
        return self


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32, bf16, mx_qat, te_fp8, te_mxfp8 (megatron_k3.precision)
    dtype: str = "fp32"  # fp32 or bf16 (autocast; master weights stay fp32); mx_qat and te_* need bf16
    param_dtype: str = "fp32"  # bf16: DeepSpeed's bf16 mode (module weights and gradients bf16; fp32 master
    #                            weights, fp32 gradient accumulation and optimizer states in ZeRO's partitions)
    grad_accum_dtype: str = "fp32"  # micro-batch gradient accumulation under param_dtype=bf16: fp32 (as Megatron;
    #   the routed experts under ep > 1 too) or bf16 (half the gradient buffers in the backward; the experts' step
    #   still reduces to fp32 blocks; DeepSpeed's data_types.grad_accum_dtype, which it warns is unsafe over many
    #   micro-batches). tools/plan.py --grad-dtype
    # mx_qat: routed experts' weights and input activations fake-quantised to MX, blocks along the reduction dim
    mx_weight_format: str = "e2m1"  # MXFP4
    mx_act_format: str = "e4m3"  # MXFP8
    mx_block_size: int = 32
    mx_weight_scale_mode: str = "floor"  # floor (OCP spec) or rceil (Blackwell hardware)
    mx_act_scale_mode: str = "floor"

    def validate(self, prefix: str = "precision") -> "PrecisionConfig":
        _require_choice(self, prefix, "dtype", ("fp32", "bf16"))
        _require_choice(self, prefix, "param_dtype", ("fp32", "bf16"))
        _require_choice(self, prefix, "grad_accum_dtype", ("fp32", "bf16"))
        if self.grad_accum_dtype == "bf16" and self.param_dtype != "bf16":
            raise ConfigError(f"{prefix}.grad_accum_dtype", self.grad_accum_dtype,
                              f"needs {prefix}.param_dtype=bf16 (fp32 weights have fp32 gradients; precision=bf16 "
                              "sets both)")
        if self.name not in ("fp32", "bf16", "mx_qat", "te_fp8", "te_mxfp8"):
            raise ConfigError(prefix, self.name, "valid: fp32, bf16, mx_qat, te_fp8, te_mxfp8")
        if self.name in ("mx_qat", "te_fp8", "te_mxfp8") and self.dtype != "bf16":
            raise ConfigError(f"{prefix}.dtype", self.dtype, f"precision={self.name} runs the rest of the model in "
                              "bf16")
        if self.name == "mx_qat":
            for k in ("mx_weight_format", "mx_act_format"):
                _require_choice(self, prefix, k, ("e2m1", "e4m3", "e5m2"))
            for k in ("mx_weight_scale_mode", "mx_act_scale_mode"):
                _require_choice(self, prefix, k, ("floor", "rceil"))
            _require_ints(self, prefix, ("mx_block_size",), 1)
        return self


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

    def validate(self, prefix: str = "logging") -> "LoggingConfig":
        _require_choice(self.wandb, f"{prefix}.wandb", "mode", ("offline", "online", "disabled"))
        return self


PEFT_TARGETS = ("kda", "mla", "mlp", "shared_experts", "latent", "experts", "lm_head")  # megatron_k3.peft.KINDS


def token_ids(spec) -> list:
    """The sorted, distinct ids of `peft.trainable_tokens`: ints, or "first-last" ranges (inclusive) as strings
    ("8192-8255"). ConfigError naming the entry that is neither."""
    out = set()
    for entry in spec or ():
        text = str(entry).strip()
        first, sep, last = text.partition("-")
        try:
            lo, hi = (int(first), int(last)) if sep else (int(text), int(text))
        except ValueError:
            lo, hi = -1, -1
        if isinstance(entry, bool) or lo < 0 or hi < lo:
            raise ConfigError("peft.trainable_tokens", entry, "each entry is a token id >= 0 or a range 'first-last' "
                              "of ids (inclusive, first <= last), e.g. [8192-8255]")
        out.update(range(lo, hi + 1))
    return sorted(out)


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning (megatron_k3.peft, docs/peft.md): `peft=lora` freezes the base (routed experts
    kept as MXFP4 codes) and trains low-rank adapters on `targets`."""
    name: str = "none"  # none | lora
    rank: int = 8
    alpha: float = 16.0  # the adapter's term is scaled by alpha / rank
    # module kinds (PEFT_TARGETS), or kind.child for one projection (kda.q_proj); the router is never a target
    targets: list = field(default_factory=lambda: ["kda", "mla", "mlp", "shared_experts", "experts"])
    init: str = "kaiming"  # A: kaiming (PEFT's default, U(+-1/sqrt(in))) | gaussian (std 1/rank); B starts at zero
    # the frozen base: a K3 Hugging Face directory; '' = checkpoint.load where that is one (recorded in every
    # checkpoint, so a resumed run re-reads the same base), else the initialised model with its experts in MXFP4
    base: str = ""
    expert_block: int = 8  # routed experts decoded at a time inside the expert GEMMs
    # token ids whose embedding and LM-head rows train beside the adapters (PEFT's trainable_token_indices): ints or
    # 'first-last' ranges, e.g. [8192-8255] (new chat control tokens the base never saw); [] = none
    trainable_tokens: list = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.name == "lora"

    def validate(self, prefix: str = "peft") -> "PeftConfig":
        if self.name not in ("none", "lora"):
            raise ConfigError(prefix, self.name, "valid: none, lora")
        _require_choice(self, prefix, "init", ("kaiming", "gaussian"))
        _require_ints(self, prefix, ("rank", "expert_block"), 1)
        if not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ConfigError(f"{prefix}.alpha", self.alpha, "must be a number > 0")
        if self.enabled and not self.targets:
            raise ConfigError(f"{prefix}.targets", self.targets, f"name at least one of {', '.join(PEFT_TARGETS)}")
        for t in self.targets:
            if str(t).partition(".")[0] not in PEFT_TARGETS:
                raise ConfigError(f"{prefix}.targets", t, f"no such module kind; valid: {', '.join(PEFT_TARGETS)} "
                                  "(kind.child names one projection, e.g. kda.q_proj)")
        token_ids(self.trainable_tokens)
        if self.base and not (Path(self.base) / "config.json").is_file():
            raise ConfigError(f"{prefix}.base", self.base, "not a Hugging Face directory (no config.json)")
        return self


# what `checkpoint.load` may name: checked for existence with the config, resolved by training/checkpoint/directory.py
LOAD_FORMS = ("expected auto (the newest complete checkpoint in checkpoint.dir, fresh when there is none), none (start "
              "fresh), a checkpoint (a directory with meta.json), a directory of checkpoints (its newest complete "
              "step_*), or a Hugging Face directory (config.json and safetensors weights)")
LOAD_FRESH = ("none", "")  # checkpoint.load values that start fresh ('' as written before `none`)


def _check_load_path(key: str, p: Path) -> None:
    """What can be told of a `checkpoint.load` path before anything is built: it is a directory holding a checkpoint
    (meta.json), checkpoints (step_*) or a Hugging Face config.json. Which one, and whether it is complete, is
    training/checkpoint/directory.py's `resolve_load_path`."""
    if not p.is_dir():
        raise ConfigError(key, str(p), f"{'not a directory' if p.exists() else 'no such directory'}; {LOAD_FORMS}")
    if not ((p / "meta.json").is_file() or (p / "config.json").is_file() or any(p.glob("step_*"))):
        raise ConfigError(key, str(p), f"holds no checkpoint (no meta.json, no step_* directory, no config.json); "
                          f"{LOAD_FORMS}")


@dataclass
class CheckpointConfig:
    dir: str = ""  # '' = <run dir>/checkpoints
    # auto = the newest complete checkpoint in dir, fresh only when there is none (a restarted command resumes);
    # none = start fresh (a save never replaces a checkpoint another run wrote); or a path (LOAD_FORMS)
    load: str = "auto"
    keep_last: int = 3
    async_save: bool = False  # snapshot to host memory, write in a background thread while training goes on
    export_hf: str = ""  # at the end of the run, every rank writes its part of a Hugging Face directory here
    export_layout: str = "k3"  # k3 (packed MXFP4 experts, bf16) | kimi_linear
    export_dtype: str = "bfloat16"  # the non-expert tensors' dtype (the fp32 ones, conv / A_log / ..., stay fp32)

    def validate(self, prefix: str = "checkpoint") -> "CheckpointConfig":
        if self.load not in ("auto",) + LOAD_FRESH:
            _check_load_path(_key(prefix, "load"), Path(self.load))
        _require_choice(self, prefix, "export_layout", ("k3", "kimi_linear"))
        _require_choice(self, prefix, "export_dtype", ("bfloat16", "float32"))
        if self.keep_last < 0:
            raise ConfigError(_key(prefix, "keep_last"), self.keep_last, "must be >= 0 (0 keeps every checkpoint)")
        return self


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
    peft: PeftConfig = field(default_factory=PeftConfig)

    def validate(self, world_size: int = 1) -> "RunConfig":
        """Every group's own check, then the layout on `world_size` ranks, then the cross-group pairings."""
        self.model.validate("model")
        self.train.validate("train")
        self.parallel.validate("parallel")
        self.optim.validate("optim")
        self.precision.validate("precision")
        self.moe.validate("moe")
        self.cluster.validate("cluster")
        self.logging.validate("logging")
        self.data.validate("data")
        self.checkpoint.validate("checkpoint")
        self.peft.validate("peft")
        m, t, p = self.model, self.train, self.parallel
        problems = layout_problems(m, world_size, tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp, order=p.order,
                                   supernode_size=self.cluster.supernode_size,
                                   sequence_parallel=p.sequence_parallel, micro_batch_size=t.micro_batch_size,
                                   global_batch_size=t.global_batch_size, seq_length=t.seq_length,
                                   redundant_experts=self.moe.redundant_experts, tile_tokens=t.tile_tokens,
                                   zero_stage=p.zero_stage,
                                   bf16_weights=self.precision.name if self.precision.param_dtype == "bf16" else "")
        if problems:
            raise problems[0].error()
        self._validate_pairings()
        if self.peft.enabled:
            self._validate_peft()
        return self

    def _validate_peft(self) -> None:
        """What peft=lora cannot run with (the targets against the model: megatron_k3.peft.check_targets)."""
        pr = self.precision
        if pr.name.startswith("te_"):
            raise ConfigError("precision", pr.name, "peft=lora runs under fp32, bf16 or mx_qat (TransformerEngine's "
                              "linears take no adapters)")
        if self.train.compile:
            raise ConfigError("train.compile", self.train.compile, "peft=lora's frozen MXFP4 experts (a Python loop "
                              "over blocks of experts) are not compiled yet: set train.compile=false")
        if self.optim.name == "muon" and self.optim.qk_clip > 0:
            raise ConfigError("optim.qk_clip", self.optim.qk_clip, "peft=lora freezes the attention weights QK-Clip "
                              "rescales: set optim.qk_clip=0 (or optim=adamw)")
        if self.checkpoint.export_hf:
            raise ConfigError("checkpoint.export_hf", self.checkpoint.export_hf, "peft=lora trains adapters only: "
                              "export them with tools/convert_checkpoint.py --to-peft (a PEFT directory), or merge "
                              "them into the base with --merge-lora")

    def _validate_deepspeed_overrides(self) -> None:
        """parallel.deepspeed entries may tune what the generated DeepSpeed config leaves to DeepSpeed (bucket
        sizes, ...), not contradict a key of ours that the experts outside DeepSpeed, the planner's memory and time
        checks or the Trainer read: each such entry must equal what the key generates."""
        p, pr = self.parallel, self.precision
        accum = pr.grad_accum_dtype if pr.param_dtype == "bf16" else "fp32"
        owned = (("data_types.grad_accum_dtype", accum, "precision.grad_accum_dtype", "the routed experts under "
                  "expert parallelism (outside DeepSpeed) and the planner's memory check read it"),
                 ("communication_data_type", accum, "precision.grad_accum_dtype", "the dense gradients are reduced "
                  "in the accumulation dtype, whose bytes the planner counts"),
                 ("zero_optimization.stage", p.zero_stage, "parallel.zero_stage", "the layout rules, the planner "
                  "and the checkpoint layout read it"),
                 ("zero_optimization.overlap_comm", bool(p.overlap_grad_reduce), "parallel.overlap_grad_reduce",
                  "the planner's time and memory models read it"))
        for path, want, key, why in owned:
            given = p.deepspeed_entry(path)
            if given is not None and given != want:
                raise ConfigError(f"parallel.deepspeed.{path}", given, f"set {key} instead ({key} gives {want!r} "
                                  f"here): {why}")

    def validate_offload_share(self) -> None:
        """train.offload_buffer_gb bounds the host memory one rank pins for its offloaded layer inputs: at most its
        device's share of the node's host memory (cluster.host_memory_per_device_gb)."""
        share, c = self.cluster.host_memory_per_device_gb, self.cluster
        if self.train.offload_buffer_gb > share:
            raise ConfigError("train.offload_buffer_gb", self.train.offload_buffer_gb, (
                f"more host memory than a device's share: cluster.host_memory_gb={c.host_memory_gb:g} over "
                f"cluster.devices_per_node={c.devices_per_node} is {share:.4g} GB per device, at most that"))

    def _validate_recompute_knobs(self) -> None:
        """train.recompute_modules names regions the model has; train.recompute_num_layers at most a stage's layers."""
        m, t = self.model, self.train
        present = recompute_regions(m)
        missing = [k for k in t.recompute_modules if k not in present]
        if missing:
            raise ConfigError("train.recompute_modules", list(t.recompute_modules), (
                f"model {m.name} has no {', '.join(missing)} region (model.attn_res, dense or MoE layers, shared "
                f"experts); its modules: {', '.join(present)}"))
        most = max(b - a for a, b in stage_layers(m, self.parallel.pp))
        if t.recompute_num_layers > most:
            raise ConfigError("train.recompute_num_layers", t.recompute_num_layers, (
                f"more than the {most} layers of the largest pipeline stage (model.num_layers={m.num_layers}, "
                f"parallel.pp={self.parallel.pp}): at most {most}, or 0 for every layer"))

    def _validate_pairings(self) -> None:
        m, pr = self.model, self.precision
        self._validate_deepspeed_overrides()
        self.validate_offload_share()
        self._validate_recompute_knobs()
        if pr.name == "mx_qat" and has_moe(m):
            for k, v in (("moe_latent_size" if m.moe_latent_size else "hidden_size", m.expert_width),
                         ("moe_intermediate_size", m.moe_intermediate_size)):
                if v % pr.mx_block_size:
                    raise ConfigError(f"model.{k}", v, f"precision=mx_qat needs a multiple of "
                                      f"precision.mx_block_size={pr.mx_block_size}")


__all__ = ["RunConfig", "ClusterConfig", "ParallelConfig", "TrainConfig", "DataConfig", "OptimConfig", "MoEConfig",
           "PrecisionConfig", "LoggingConfig", "WandbConfig", "CheckpointConfig", "ModelConfig", "VisionConfig",
           "PeftConfig", "PEFT_TARGETS", "GuardConfig", "GUARD_POLICIES", "RUNTIME_MODEL_KEYS", "LOAD_FORMS",
           "LOAD_FRESH",
           "parse_split"]
