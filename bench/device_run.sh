#!/usr/bin/env bash
# bench/gpu_check.py on a lent GPU machine (the device tool), where python3 holds CUDA torch and no package registry
# is reachable: installs the wheels carried in .whl/ (`make device-wheels` here, then `carry: [".whl"]`), prints
# what it runs with, and runs the checks, each one's rows printed as it finishes, the log also in $OUT. Arguments go
# to gpu_check.py (--only recompute,offload reruns some); without any, the checks that have never run anywhere come
# first (the offload's CUDA path, then recomputation on the device; issue 33 waits on them) and inductor's minutes of
# compiling (model_compiled, recompute_compiled) last, so a time limit cuts the ones with CPU stand-ins; a second
# call with `--only model_compiled,recompute_compiled` runs those if the first did not reach them. One call, for example:
#   run(command="bash bench/device_run.sh", carry=[".whl"], timeout_s=540)
# `--install-only` installs the wheels into SITE and stops (make test-device-torch uses it here).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}  # where the carried wheels are installed
if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "device_run: no wheels in .whl/: run make device-wheels here and carry .whl" >&2
    exit 2
fi
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 3
rm -rf "$SITE/test"  # torchao's wheel has a top-level test/ package, which would shadow the standard library's
[ "${1:-}" = --install-only ] && exit 0  # make test-device-torch: the wheels where SITE says, no checks
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
LOG=${OUT:-/tmp}/gpu_check.log
$PY - <<'PYEOF' 2>&1 | tee "$LOG"
import importlib, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
for name in ("triton", "fla", "torchao", "omegaconf", "transformer_engine"):
    try:
        print(f"  {name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as e:  # noqa: BLE001 - report and go on: each check says what it misses
        print(f"  {name} unavailable: {type(e).__name__}: {e}")
PYEOF
[ $# -gt 0 ] || set -- --only offload,recompute,precision,kda,model,model_compiled,recompute_compiled
$PY bench/gpu_check.py "$@" 2>&1 | tee -a "$LOG"
