"""The object `deepspeed.initialize(mpu=...)` expects, answering every question from `parallel.state` at call
time."""

from __future__ import annotations

from typing import List

from .state import (
    get_context_parallel_group,
    get_context_parallel_rank,
    get_context_parallel_world_size,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_expert_data_parallel_group,
    get_expert_data_parallel_rank,
    get_expert_data_parallel_world_size,
    get_expert_model_parallel_group,
    get_expert_model_parallel_rank,
    get_expert_model_parallel_world_size,
    get_expert_tensor_parallel_group,
    get_expert_tensor_parallel_rank,
    get_expert_tensor_parallel_world_size,
    get_group_ranks,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_world_size,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
)


class MPU:
    """What ``deepspeed.initialize(mpu=...)`` (DeepSpeed 0.19.8) calls, answered from the current state.

    Every method reads the current ``ParallelState`` at call time. Who calls what in DeepSpeed 0.19.8:

    - ``get_data_parallel_world_size``: ``runtime/config.py`` (batch-size arithmetic: train_batch =
      micro_batch * grad_accum * this), ``utils/groups._get_data_parallel_world_size`` -> engine
      ``dp_world_size``; ``runtime/engine.py`` (data sampler); ``model_checkpointing/utils.py``.
    - ``get_data_parallel_group``: ``utils/groups._get_data_parallel_group`` -> engine
      ``data_parallel_group``, the norm averaging in ``runtime/utils.clip_grad_norm_``, ZeRO-3
      ``zero.Init``/``parameter_offload``. (ZeRO 1/2 partition and reduce over the sequence-data group.)
    - ``get_data_parallel_rank``, ``get_data_parallel_group_ranks``: engine data sampler,
      ``model_checkpointing/utils.py``, ``utils/groups._get_data_parallel_group_ranks``.
    - ``get_model_parallel_group``: overflow check (``runtime/utils.CheckOverflow``), gradient/weight norms
      (``runtime/utils.py``, ZeRO 1/2/3 ``model_parallel_group``), inference/hybrid engines. Here tp x pp,
      so a global norm sums every model shard.
    - ``get_model_parallel_rank`` / ``get_model_parallel_world_size``: checkpoint file names
      (``mp_rank_XX``, ``zero_pp_rank_D_mp_rank_XX``; engine ``checkpoint_mp_rank`` when the size > 1),
      ``runtime/utils.clip_grad_norm_`` (non-ZeRO path: counts replicated params where the rank is 0),
      ZeRO 1/2 ``model_parallel_world_size``. Rank in tp x pp, so names are unique per shard.
    - ``get_tensor_model_parallel_rank`` / ``_world_size`` / ``_group`` (through ``utils/bwc.py``):
      ZeRO 1/2 and bf16/fp16 optimizers (count TP-replicated params once in norms), activation
      checkpointing (RNG tracker), checkpoint metadata (TP degree), Domino, model_checkpointing.
      ``get_tensor_model_parallel_src_rank``: the AutoTP data-consistency check (there DeepSpeed swaps
      in its own ``groups`` module, so ours is for completeness).
    - ``get_pipeline_model_parallel_world_size`` / ``_rank`` / ``_group`` (``utils/bwc.py``): checkpoint
      metadata (PP degree), MoE gradient norms, ``model_checkpointing/utils.py``.
    - ``get_sequence_parallel_world_size`` / ``_rank`` / ``_group`` and ``get_sequence_data_parallel_*``
      (``utils/groups.py``): DeepSpeed's sequence parallelism. Context parallelism maps onto it: the
      sequence group is the CP group and the sequence-data group is dp x cp, so ZeRO partitions and
      reduces gradients over dp x cp and divides the sum by dp only. The loss of each CP rank must
      therefore be its share of the sequence loss (local token sum / global token count).

    Deliberately absent: ``initialize_sequence_parallel`` (its presence makes DeepSpeed treat the mpu as
    a Ulysses-only one and ignore the data-parallel and model-parallel groups), ``get_slice_parallel_*``
    and ``get_pipe_parallel_*`` (names of DeepSpeed's own ``PipelineParallelGrid``; ``bwc`` prefers the
    tensor/pipeline names above), ``_init_tp_mesh_device`` (called on DeepSpeed's ``groups``).

    The expert getters are not called by DeepSpeed 0.19.8 (its MoE builds its own groups); they are here
    so our engine code can ask one object for everything.
    """

    # model parallel (tp x pp)
    get_model_parallel_group = staticmethod(get_model_parallel_group)
    get_model_parallel_world_size = staticmethod(get_model_parallel_world_size)
    get_model_parallel_rank = staticmethod(get_model_parallel_rank)
    # tensor parallel
    get_tensor_model_parallel_group = staticmethod(get_tensor_model_parallel_group)
    get_tensor_model_parallel_world_size = staticmethod(get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_rank = staticmethod(get_tensor_model_parallel_rank)
    get_tensor_model_parallel_src_rank = staticmethod(get_tensor_model_parallel_src_rank)
    # pipeline parallel
    get_pipeline_model_parallel_group = staticmethod(get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_world_size = staticmethod(get_pipeline_model_parallel_world_size)
    get_pipeline_model_parallel_rank = staticmethod(get_pipeline_model_parallel_rank)
    # data parallel (dense, without cp)
    get_data_parallel_group = staticmethod(get_data_parallel_group)
    get_data_parallel_world_size = staticmethod(get_data_parallel_world_size)
    get_data_parallel_rank = staticmethod(get_data_parallel_rank)

    @staticmethod
    def get_data_parallel_group_ranks() -> List[int]:
        return get_group_ranks("dp")

    # context parallel, in DeepSpeed's sequence-parallel vocabulary
    get_sequence_parallel_group = staticmethod(get_context_parallel_group)
    get_sequence_parallel_world_size = staticmethod(get_context_parallel_world_size)
    get_sequence_parallel_rank = staticmethod(get_context_parallel_rank)

    @staticmethod
    def get_sequence_data_parallel_group():
        return get_data_parallel_group(with_context_parallel=True)

    @staticmethod
    def get_sequence_data_parallel_world_size() -> int:
        return get_data_parallel_world_size(with_context_parallel=True)

    @staticmethod
    def get_sequence_data_parallel_rank() -> int:
        return get_data_parallel_rank(with_context_parallel=True)

    # experts (ours; not called by DeepSpeed 0.19.8)
    get_expert_model_parallel_group = staticmethod(get_expert_model_parallel_group)
    get_expert_model_parallel_world_size = staticmethod(get_expert_model_parallel_world_size)
    get_expert_model_parallel_rank = staticmethod(get_expert_model_parallel_rank)
    get_expert_tensor_parallel_group = staticmethod(get_expert_tensor_parallel_group)
    get_expert_tensor_parallel_world_size = staticmethod(get_expert_tensor_parallel_world_size)
    get_expert_tensor_parallel_rank = staticmethod(get_expert_tensor_parallel_rank)
    get_expert_data_parallel_group = staticmethod(get_expert_data_parallel_group)
    get_expert_data_parallel_world_size = staticmethod(get_expert_data_parallel_world_size)
    get_expert_data_parallel_rank = staticmethod(get_expert_data_parallel_rank)


_MPU = MPU()


def get_mpu() -> MPU:
    """The object to pass as ``deepspeed.initialize(mpu=...)``."""
    return _MPU
