"""`train.compile=true`: every decoder layer (mixer, AttnRes mixes, norms, router, dispatcher, experts, SiTU) is
compiled by torch.compile, as torchtitan compiles each transformer block.

- `train.compile_split=regions` (default): the layer's activation-recomputation regions (parallel.recompute.regions:
  the norms, the depth mixes, KDA's core, MLA's attention, the GLU activations) are compiled as graphs of their own,
  which the layer's graphs call across a break. Selective recomputation checkpoints a region there, outside the
  compiled graphs, so its backward runs the region's compiled forward again: the rebuilt tensors are the forward's
  bit for bit and every policy gives the same numbers. `layer`: one graph per layer (the compiler fuses across the
  regions; selective's regions are traced inside as torch's checkpoint operator and round differently).

- Static shapes (`dynamic=False`): a layer sees the same shapes every micro-batch (the drop and balanced dispatchers
  fix their buffers; packed documents reach the layers as a per-token document index, not as offsets whose length
  varies), so a run compiles each distinct layer once and never again.
- Inside a layer nothing breaks the graph: the grouped GEMMs are opaque operators with their shapes declared
  (ops.grouped_gemm), expert counting has a static shape (model.dispatcher.counts), the collectives of tensor, sequence,
  expert and context parallelism are traced as functional collectives (parallel.mappings) and the router's statistics
  for Quantile Balancing are handed out of the region (StableLatentMoE.flush_observation). tests/test_compile.py
  asserts zero graph breaks with torch._dynamo.explain in one process and under tp2, ep2 and cp2 (a whole layer, and
  each region alone).
- The compiler's cache lives under `train.compile_cache` (default .cache/torchinductor in the launch directory),
  so a resumed run reuses the compiled code of the run before it.

Start-up checks (`check_backend`): a backend that cannot work here (inductor on CPU without a C++ compiler, on CUDA
without Triton) stops the run with one line naming what is missing, before the model is built.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..config import ConfigError
from ..model.decoder import DecoderLayer
from ..model.moe import StableLatentMoE
from ..parallel.recompute import regions as recompute_regions

__all__ = ["BACKENDS", "check_backend", "compile_layers", "cache_dir", "set_deterministic", "restore_determinism"]

BACKENDS = ("inductor", "aot_eager", "eager")


def cache_dir(path: str) -> Path:
    """The compile cache directory of `train.compile_cache` (relative paths from the launch directory)."""
    return Path(path or ".cache/torchinductor").resolve()


def _cxx() -> tuple:
    """(the C++ compiler inductor would call on CPU or None, the names looked for): $CXX, then
    torch._inductor.config.cpp.cxx."""
    from torch._inductor import config as inductor_config

    names = list(dict.fromkeys(n for n in [os.environ.get("CXX")] + list(inductor_config.cpp.cxx) if n))
    found = next((shutil.which(n) for n in names if shutil.which(n)), None)
    return found, names


def check_backend(backend: str, device: torch.device) -> None:
    """Raise ConfigError (one line) if `backend` cannot compile for `device` on this machine."""
    if backend not in BACKENDS:
        raise ConfigError("train.compile_backend", backend, f"valid: {', '.join(BACKENDS)}")
    if backend != "inductor":
        return
    if device.type == "cuda":
        try:
            import triton  # noqa: F401 - optional GPU dependency
        except ImportError as e:
            raise ConfigError("train.compile", True, f"inductor on CUDA needs Triton, which does not import ({e}); "
                              "install triton or set train.compile_backend=aot_eager") from None
        return
    cxx, names = _cxx()
    if cxx is None:
        raise ConfigError("train.compile", True, f"inductor on CPU needs a C++ compiler and none was found (looked "
                          f"for {', '.join(names)} on PATH); install one, set CXX, or set train.compile=false")
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.cpp"
        src.write_text("#include <cmath>\nint main() { return (int)std::sqrt(1.0) - 1; }\n")
        r = subprocess.run([cxx, "-fsyntax-only", str(src)], capture_output=True, text=True)
        if r.returncode != 0:
            err = (r.stderr.strip().splitlines() or ["no output"])[0]
            raise ConfigError("train.compile", True, f"the C++ compiler {cxx} does not compile a test file: {err}")


# the process's determinism settings that set_deterministic(True) replaced, until restore_determinism puts them back
_REPLACED = []


def set_deterministic(on: bool, device: torch.device) -> None:
    """train.deterministic (on) or torch's defaults (off): every kernel, eager and generated, in a fixed order of
    summation, so that a step gives the same numbers run after run (and every train.recompute policy the same numbers
    under inductor, whose CPU kernels otherwise add scattered gradients with atomics across threads): torch's
    deterministic algorithms (ops without one raise, naming the op), no autotuning by benchmark in inductor, and on
    CUDA cuBLAS's fixed workspace (read when the first handle is made: set before any GEMM). Process-wide: the
    settings it replaces are kept for `restore_determinism` (engine.shutdown, at the run's end)."""
    import torch._inductor.config as inductor_config

    if on and not _REPLACED:
        _REPLACED.append((torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled(), inductor_config.deterministic,
                          torch.backends.cudnn.benchmark))
    if on and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(on)
    inductor_config.deterministic = on


def restore_determinism() -> None:
    """Put back the settings set_deterministic(True) replaced (none: nothing to do), so that a later run in the same
    process (tests, notebooks) starts from the process's own, not from an earlier run's train.deterministic."""
    import torch._inductor.config as inductor_config

    if _REPLACED:
        algorithms, warn_only, inductor, benchmark = _REPLACED.pop()
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        inductor_config.deterministic = inductor
        torch.backends.cudnn.benchmark = benchmark


def _region(layer: DecoderLayer, compiled):
    """The layer's forward: the compiled region, then what the region handed out (the routers' scores for
    Quantile Balancing)."""
    moes = [m for m in layer.modules() if isinstance(m, StableLatentMoE)]

    def forward(*args, **kwargs):
        out = compiled(*args, **kwargs)
        for m in moes:
            m.flush_observation()
        return out
    forward.compiled = compiled
    return forward


def compile_layers(model: torch.nn.Module, backend: str = "inductor", cache: str = "", split: str = "regions") -> int:
    """Compile every decoder layer of `model` in place (the parameters, their names and the state dict are
    untouched), split at its recomputation regions (`split`: train.compile_split, regions or layer); returns how
    many layers. The compile cache goes to `cache_dir(cache)` (inductor reads
    TORCHINDUCTOR_CACHE_DIR whenever it opens its cache, and writes its own default there once it has, so the key
    sets it rather than deferring to it)."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    if not layers:
        return 0
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir(cache))
    # every layer shares DecoderLayer.forward's code and specialises on its own constants (its index, its AttnRes
    # block count, its mixer and FFN): one cache entry per layer, so the limits must hold them all
    import torch._dynamo.config as dynamo_config

    need = 2 * len(layers) + 8
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, need)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4 * need)
    # split=layer: selective recomputation's regions (parallel/recompute.py) are traced inside a layer as torch's
    # checkpoint operator; what a region records besides its output (depth weights, router statistics) is recorded
    # by the forward only, as in eager (model.layers.recomputing), not replayed by the recomputation
    dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in layers:
        for _, owner, attr in recompute_regions(layer) if split == "regions" else ():
            setattr(owner, attr, _boundary(getattr(owner, attr), backend))
        compiled = torch.compile(layer.forward, backend=backend, dynamic=False, fullgraph=False)
        layer.forward = _region(layer, compiled)
    return len(layers)


def _boundary(fn, backend: str):
    """A recomputation region of a layer (parallel.recompute.regions) compiled as its own graph, which the layer's
    graph calls across a break: selective recomputation checkpoints it from outside and its backward calls the
    same compiled code again, so the rebuilt tensors are the forward's bit for bit whatever the policy."""
    compiled = torch.compile(fn, backend=backend, dynamic=False, fullgraph=False)

    def region(*args, **kwargs):
        return compiled(*args, **kwargs)
    region = torch.compiler.disable(region)
    region.compiled = compiled
    return region
