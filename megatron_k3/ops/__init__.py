"""Pure tensor functions (ops) with their references; import the submodules directly, e.g. `megatron_k3.ops.kda`."""
