"""The README's "Common launches" run as written: a README whose commands do not run fails CI.

Every command of that section's code block is read from README.md (continuation lines joined, comments dropped) and
run in a scratch directory that holds what a checkout has (links to megatron_k3/, tools/ and .venv/), with
`train.steps=2` appended (the last value of a key wins in Hydra) and each `--master_port` replaced by a free port.
The commands that read files the README assumes (corpus/*.jsonl, tokenizer.json) find small ones written here; the
`data=indexed` command reads the prefixes that the README's preprocess command writes. A command that cannot run on
a 2-core CPU is named in NOT_ON_CPU with the reason, and is composed and validated (`--cfg`: every key and the
layout checked) where its inputs exist; `train.compile=true` runs in `make test-compile` (inductor's code generation
takes minutes per layer). A README command that is neither run nor named here fails `test_every_command_is_covered`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import launch

pytestmark = pytest.mark.slow  # training runs and torchrun worlds

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
STEPS = 2  # a step past the first: the optimizer's state in use (a third adds only time)

# A substring of a README command -> (what the test does instead of running it, why). "compose": the command with
# --cfg (config and layout validated, nothing built); "skip": its inputs do not exist here.
NOT_ON_CPU = {
    "model=k3_small": ("compose", "one GPU: k3_small is 2.56B parameters, a step is 32 x 4096 tokens"),
    "logging.wandb.mode=online": ("compose", "needs a W&B account and the network"),
    "/ckpt/kimi-k3": ("skip", "needs the released K3 weights (2.8T parameters)"),
    "train.compile=true": ("compile", "inductor on 2 cores takes minutes per layer: make test-compile runs it"),
}


def readme_commands(text: str | None = None) -> list:
    """The commands of the first bash block under "## Common launches", one string each."""
    text = (ROOT / "README.md").read_text() if text is None else text
    section = text.split("## Common launches", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands, current = [], ""
    for line in block.splitlines():
        current += _without_comment(line).rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            commands.append(" ".join(current.split()))  # as bash reads it: globs and quotes left to bash
        current = ""
    return commands


def _without_comment(line: str) -> str:
    """The line up to a '#' that starts a word outside quotes (bash's comment rule)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _kind(command: str) -> tuple:
    for key, (kind, why) in NOT_ON_CPU.items():
        if key in command:
            return kind, why
    if "..." in command:
        return "skip", "a template: ... stands for the user's own keys"
    return "run", ""


def _case_id(command: str) -> str:
    """The launcher and the keys: 'torchrun parallel.tp=2 parallel.sequence_parallel=true'."""
    words = shlex.split(command)
    paths = [w for w in words if "/" in w and "=" not in w and not w.startswith("-")]
    launcher = Path(next((w for w in paths if w.endswith(".py") and "train" not in w), paths[0])).stem
    keys = [w for w in words if "=" in w and not w.startswith("-") and not w.isupper() and "_KEY" not in w]
    return " ".join([launcher] + (keys or [w for w in words if w.startswith("--")][-1:]))


COMMANDS = readme_commands()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A scratch directory laid out as the README's commands expect: megatron_k3/, tools/ and .venv/ of this
    checkout, a small JSONL corpus and the embedded byte-level BPE as tokenizer.json."""
    from megatron_k3.data.corpus import build_embedded_corpus

    d = tmp_path_factory.mktemp("readme")
    for name in ("megatron_k3", "tools"):
        (d / name).symlink_to(ROOT / name)
    (d / ".venv").symlink_to(VENV_BIN.parent)
    (d / "corpus").mkdir()
    # 1,200 documents of 2,000 characters of the standard library's source (~500 tokens each): enough that the
    # README's split '969,30,1' leaves the test split one document of more than a sequence
    text = ""
    for src in sorted(Path(os.__file__).parent.glob("*.py")):
        text += src.read_text(errors="replace")
        if len(text) >= 1200 * 2000:
            break
    docs = [text[i:i + 2000] for i in range(0, 1200 * 2000, 2000)]
    for i in range(2):
        with open(d / "corpus" / f"part{i}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs[i::2])
    tok = build_embedded_corpus(None, 8192, progress=False) / "tokenizer.json"
    (d / "tokenizer.json").write_text(tok.read_text())
    return d


def _run(command: str, cwd: Path, extra: str = "", timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    out = launch(lambda port: ["bash", "-c", re.sub(r"--master_port \d+", f"--master_port {port}", command) + extra],
                 cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{command}\nexit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _trained(out: subprocess.CompletedProcess, steps: int = STEPS) -> None:
    assert f"last step {steps}: loss" in out.stdout, out.stdout[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.fixture(scope="module")
def indexed_data(workspace):
    """The README's preprocess command as written (data/web), and again into data/code, which the data=indexed
    command blends with it."""
    pre = [c for c in COMMANDS if "tools/preprocess_data.py" in c]
    assert len(pre) == 1, pre
    _run(pre[0], workspace)
    _run(pre[0].replace("data/web", "data/code"), workspace)
    return pre[0]


def test_every_command_is_covered():
    """The parser finds the section's commands, and each is run here or named in NOT_ON_CPU with its reason."""
    assert len(COMMANDS) >= 15, COMMANDS
    kinds = [_kind(c) for c in COMMANDS]
    assert sum(k == "run" for k, _ in kinds) >= 12
    unused = [k for k in NOT_ON_CPU if not any(k in c for c in COMMANDS)]
    assert not unused, f"NOT_ON_CPU names commands the README no longer has: {unused}"
    assert readme_commands("## Common launches\n```bash\n# c\na b \\\n  c=1  # d\n```\n## Next\n") == ["a b c=1"]


def _cases(kinds):
    return [pytest.param(c, id=_case_id(c), marks=[pytest.mark.compile] if _kind(c)[0] == "compile" else [])
            for c in COMMANDS if _kind(c)[0] in kinds]


@pytest.mark.parametrize("command", _cases(("run", "compile")))
def test_command_runs(command, workspace, request):
    if command.endswith("--help"):
        out = _run(command, workspace)
        assert "config groups" in out.stdout and "train: steps, seed" in out.stdout
    elif command.endswith("--cfg"):
        out = _run(command, workspace)
        assert "model:" in out.stdout and "train:" in out.stdout
    elif "tools/preprocess_data.py" in command:
        request.getfixturevalue("indexed_data")
        for prefix in ("data/web", "data/code"):
            assert (workspace / f"{prefix}.bin").stat().st_size > 0 and (workspace / f"{prefix}.idx").is_file()
    elif command.endswith("hydra.run.dir=runs/my_run"):  # resume: a step, then the same command resumes toward STEPS
        _trained(_run(command, workspace, f" train.steps={STEPS - 1}"), STEPS - 1)
        out = _run(command, workspace, f" train.steps={STEPS}")
        _trained(out)
        assert re.search(rf"resumed from \S+step_0+{STEPS - 1} at step {STEPS - 1}", out.stdout), out.stdout[-3000:]
    else:
        if "data=indexed" in command:
            request.getfixturevalue("indexed_data")
        _trained(_run(command, workspace, f" train.steps={STEPS}"))


@pytest.mark.parametrize("command", _cases(("compose",)))
def test_gpu_command_composes(command, workspace):
    """Not run here (NOT_ON_CPU says why): its config and layout are validated as a launch would."""
    out = _run(command, workspace, " --cfg")
    assert "model:" in out.stdout
