"""bench/gpu_check.py has never run on a GPU (none is lent to these machines), so its checks that take a device run
here on the CPU: a check that raises, or reports a failure, on the CPU would do so on the GPU too and waste the one
run a GPU session gets. (Its `_mx_inputs` broke every MX row this way: a [M, K/32, 32] scale times an [M, K]
tensor.) What is CUDA's own (pinned buffers, side streams, fla's fused kernel, TransformerEngine) runs only there."""

import types
from pathlib import Path

import pytest
import torch
from helpers import load_file

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu_check():
    return load_file(ROOT / "bench" / "gpu_check.py")


def _failed(rows):
    return [r for r in rows if any(w in str(r[3]) for w in ("FAILED", "DIFFER", "False"))]


def test_the_device_checks_pass_on_the_cpu(gpu_check):
    """MX emulation (device vs CPU, torchao), QAT on k3_tiny, QAT inside the grouped GEMMs against the per-expert
    reference, and the offload buffers through a budget that drops one for room: all pass, every row reported."""
    cpu, rows = torch.device("cpu"), []
    for fn in (gpu_check._emulation_checks, gpu_check._qat_check, gpu_check._qat_gemm_check):
        fn(rows, cpu)
    gpu_check.offload_check(types.SimpleNamespace(offload_mb=1 << 10), rows, cpu)
    assert len(rows) == 6 + 1 + 1 + 1, rows
    assert not _failed(rows), _failed(rows)
    assert all("bit-identical; torchao(cuda) bit-identical" in r[3] for r in rows[:6]), rows[:6]


@pytest.mark.slow
def test_the_recompute_check_passes_on_the_cpu(gpu_check):
    """The recomputation's random numbers, then every recomputation, offload and tiling variant eager (but the
    stressed ones: their stall is a CUDA kernel), then the first four compiled (recompute_compiled; aot_eager here,
    inductor on the GPU): gradients bit for bit none's, tiled ones within the check's 1e-4, compiled none within 1e-4
    of eager none; each offload row's host buffers in use."""
    args = types.SimpleNamespace(recompute_seq=64, recompute_reps=1)
    from megatron_k3.parallel.offload import CudaCopies

    assert isinstance(gpu_check._slow_copies(), CudaCopies)  # the stressed variants' copies (their stall: CUDA's)
    plain = [v for v in gpu_check.RECOMPUTE_VARIANTS if v[3] is None]
    rows = gpu_check.recompute_check(args, [], torch.device("cpu"), backend="aot_eager")
    assert len(rows) == 1 + len(plain) and len(plain) == len(gpu_check.RECOMPUTE_VARIANTS) - 3, rows
    rows = gpu_check.recompute_compiled_check(args, rows, torch.device("cpu"), backend="aot_eager")
    assert len(rows) == 1 + len(plain) + gpu_check.COMPILED_VARIANTS == 12, rows
    assert not _failed(rows), _failed(rows)
    assert rows[0][3] == "the same draws", rows[0]
    assert sum("equal to the bit" in r[3] for r in rows) == 9 and sum("max rel err" in r[3] for r in rows) == 3
    assert "vs eager: max rel err" in next(r[3] for r in rows if r[0].endswith("none, compiled, 2 x 64 fp32"))
    assert "kept on device 0.0 MiB" not in next(r[3] for r in rows if "half" in r[0])  # the budget ran out


@pytest.mark.slow
def test_the_model_check_runs_on_the_cpu(gpu_check):
    """The MFU rows, eager and compiled (k3_tiny and aot_eager here; k3_small and inductor on the GPU)."""
    args = types.SimpleNamespace(seq=64, reps=2, peak_tflops=989.0)
    rows = gpu_check.model_check(args, [], torch.device("cpu"), "k3_tiny", "aot_eager")
    rows = gpu_check.model_compiled_check(args, rows, torch.device("cpu"), "k3_tiny", "aot_eager")
    assert [r[0].split(", ")[-1] for r in rows] == ["eager", "compiled"] and not _failed(rows), rows
    assert rows[0][3].split("; loss ")[1][:5] == rows[1][3].split("; loss ")[1][:5], rows  # the same model


def test_fla_autotuning_is_trimmed_once_to_configs_of_four_warps_or_more(gpu_check):
    """The device run's --fla-tuning=trimmed: every Triton autotuner of fla.ops (reached through its decorators) keeps
    its configs of >= 4 warps (all of them where none has that many), once."""
    import fla.ops.kda  # noqa: F401 - loads fla.ops' kernels (their autotuners exist on the CPU too)

    before, after = gpu_check.trim_fla_autotuning()
    assert before > after > 0 and gpu_check.trim_fla_autotuning() == (0, 0), (before, after)
    tuners = list(gpu_check.fla_autotuners())
    assert tuners and all(t._k3_trimmed for t in tuners)
    assert all(all(c.num_warps >= 4 for c in t.configs) or all(c.num_warps < 4 for c in t.configs) for t in tuners)


def test_without_cuda_it_says_so(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["gpu_check.py"])
    assert gpu_check.main() == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_each_row_is_printed_as_it_is_made(gpu_check, monkeypatch, capsys):
    """A check's rows reach the log one by one, before the check ends (a device run cut short by its time limit keeps
    them); a check that raises gets a FAILED row and the next check still runs."""
    def check(args, rows):
        rows.append(("first variant", "-", "-", "done"))
        print("the check goes on", flush=True)
        raise RuntimeError("a compile that never ends")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in")
    monkeypatch.setattr(gpu_check, "CHECKS", {"one": check, "two": lambda args, rows: rows})
    monkeypatch.setattr("sys.argv", ["gpu_check.py"])
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # main sets it when unset: not past this test
    assert gpu_check.main() == 0
    out = capsys.readouterr().out
    assert out.index("+ first variant | - | - | done") < out.index("the check goes on") < out.index("== one"), out
    assert "FAILED: RuntimeError: a compile that never ends" in out and "== two" in out, out


def test_only_names_the_checks(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["gpu_check.py", "--only", "kda,recompte"])
    with pytest.raises(SystemExit):
        gpu_check.main()
    valid = "kda, model, recompute, offload, precision, model_compiled, recompute_compiled"
    assert f"--only: unknown check(s) ['recompte']; valid: {valid}" in capsys.readouterr().err


# A lent GPU machine's image (the device tool's KINDS.md, its package list of 2026-11-17), as import names: the
# standard library, CUDA torch and these; bench/device_run.sh adds the wheels of requirements-device.txt; no registry
# is reachable there. An import of anything else fails there, so the test below blocks it here.
ON_THE_DEVICE = {
    "torch", "torchgen", "functorch", "triton", "numpy", "safetensors", "tokenizers", "tiktoken", "yaml", "PIL", "tqdm",
    "transformers", "einops", "matplotlib", "mpl_toolkits", "psutil", "packaging", "sympy", "mpmath", "networkx",
    "jinja2", "markupsafe", "filelock", "fsspec", "typing_extensions", "huggingface_hub", "hf_xet", "regex",
    "requests", "urllib3", "idna", "certifi", "charset_normalizer", "opt_einsum", "pandas", "scipy", "sklearn",
    "colorama", "hypothesis", "attr", "attrs", "tabulate", "xarray", "onnx", "onnxruntime", "onnxscript", "pynvml",
    "cuda", "dateutil", "six", "pyparsing", "cycler", "kiwisolver", "contourpy", "fontTools", "sentencepiece",
    "google", "msgpack", "cpuinfo", "pytest", "pluggy", "iniconfig", "pygments", "rich", "markdown_it", "mdurl",
    "click", "lightning_utilities", "torchvision", "torchaudio", "jax", "jaxlib", "ml_dtypes", "cupy", "numba",
    "llvmlite", "h5py", "tensorboard", "accelerate", "peft", "timm", "wrapt", "zipp", "threadpoolctl", "joblib",
}
CARRIED = {"omegaconf", "antlr4", "fla", "torchao"}  # requirements-device.txt
_BLOCKED_IMPORTS = """
import importlib.metadata, re, sys
allowed = set(sys.stdlib_module_names) | {allowed!r}
# what is installed here but not there reads as missing, to an import and to importlib.util.find_spec alike
for top in importlib.metadata.packages_distributions():
    if top not in allowed and not top.startswith("_") and top not in sys.modules:
        sys.modules[top] = None
src = open({check!r}).read()
for mod in sorted(set(re.findall(r"^\\s*from (megatron_k3[.\\w]*) import", src, re.M))):
    __import__(mod)  # every module of ours that a check imports
print("imported", mod)
"""


@pytest.mark.slow
def test_the_checks_import_on_a_lent_gpu_machine():
    """bench/device_run.sh runs gpu_check with the device image's python3 and the wheels of requirements-device.txt:
    every module of ours that a check imports loads with nothing beyond the standard library, the image's packages
    and the carried wheels (no DeepSpeed, Hydra, W&B, megatron-core or TransformerEngine: a module that imported one
    at its top would stop the one GPU run; packages that torch and the others only probe for are refused, as they
    are missing there), and requirements-device.txt names the versions this checkout installs (the ones the CPU
    tests ran with). A package the image does have and a module newly needs: add it to ON_THE_DEVICE (KINDS.md)."""
    import subprocess
    import sys
    from importlib.metadata import version

    code = _BLOCKED_IMPORTS.format(allowed=ON_THE_DEVICE | CARRIED | {"megatron_k3"},
                                   check=str(ROOT / "bench" / "gpu_check.py"))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "imported megatron_k3" in done.stdout, done.stderr[-3000:]
    pins = [line.split("#")[0].strip() for line in (ROOT / "requirements-device.txt").read_text().splitlines()]
    pins = dict(p.split("==") for p in pins if p)
    assert {"omegaconf", "flash-linear-attention", "fla-core", "torchao"} <= set(pins), pins
    assert {name: version(name) for name in pins} == pins


@pytest.mark.slow
def test_device_run_installs_the_carried_wheels_and_runs_the_checks(tmp_path):
    """bench/device_run.sh in a checkout without .whl/ says what to do; with wheels there (a stand-in wheel here:
    none can be downloaded in a test), it installs them under /tmp/site's stand-in and runs gpu_check, which on this
    machine reports that it has no CUDA device."""
    import shutil
    import subprocess
    import sys
    import zipfile

    (tmp_path / "bench").mkdir()
    shutil.copy(ROOT / "bench" / "device_run.sh", tmp_path / "bench")
    (tmp_path / "bench" / "gpu_check.py").write_text(
        "import sys, standin\nprint('gpu_check', sys.argv[1:], standin.VALUE)\n")
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "bench/device_run.sh"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 2 and "make device-wheels" in run.stderr, run
    (tmp_path / ".whl").mkdir()
    with zipfile.ZipFile(tmp_path / ".whl" / "standin-1.0-py3-none-any.whl", "w") as z:
        z.writestr("standin.py", "VALUE = 42\n")
        z.writestr("standin-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: standin\nVersion: 1.0\n")
        z.writestr("standin-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("standin-1.0.dist-info/RECORD", "")
    env["SITE"] = str(tmp_path / "site")
    run = subprocess.run(["bash", "bench/device_run.sh"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run
    order = "offload,recompute,precision,kda,model,model_compiled,recompute_compiled"
    assert f"gpu_check ['--only', '{order}'] 42" in run.stdout, run.stdout
    assert "torch " in run.stdout and "gpu_check ['--only'" in (tmp_path / "gpu_check.log").read_text()
