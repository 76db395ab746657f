"""Who talks to whom, and how the model is cut: the process groups of this rank (`state`, from the rank grid in
megatron_k3.layout), DeepSpeed's view of them (`mpu`), autograd-aware collectives (`mappings`), and the plans that
apply tensor/sequence (`tensor`), expert (`experts`), context (`context`) and pipeline (`pipeline`) parallelism to a
built single-device model from outside (`plan.parallelize`; `plan.build_model` builds a rank's part on the meta
device and materialises only what it holds)."""

from .plan import ParallelGroups, build_model, parallelize

__all__ = ["ParallelGroups", "parallelize", "build_model"]
