# megatron-k3: the commands users and CI rely on (see ../shared/design/INTERFACES.md and docs/architecture.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-runtime
TEST_STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
THREADS := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2}
# make test and make test-fast: TEST_WORKERS pytest processes (pytest-xdist; 0 runs in this process), each test module
# on one of them, longest modules first (tests/conftest.py), one intra-op thread each: the 2 cores stay busy while a
# test waits on its gloo workers, a subprocess or the disk (one process: ~20 minutes on 2 cores, a third of it idle;
# two: ~16, tests/test_readme.py included)
TEST_WORKERS ?= 2
XDIST := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

.PHONY: install install-test train sft test test-fast test-compile lint bench device-wheels test-device-torch clean

# what training needs (requirements.txt = pyproject's dependencies), the package in editable mode: make train
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	DS_BUILD_OPS=0 $(PY) -m pip install -q --upgrade pip
	DS_BUILD_OPS=0 $(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# + the references the tests compare against, pytest and ruff: make test, lint, bench
$(TEST_STAMP): $(STAMP) requirements-test.txt
	DS_BUILD_OPS=0 $(PY) -m pip install -q -r requirements-test.txt
	touch $(TEST_STAMP)

install: $(STAMP)

install-test: $(TEST_STAMP)

# the whole suite: unit tests, multi-process gloo worlds, training runs, the README's commands (~16 minutes on 2 cores; --durations lists the slowest)
test: install-test
	$(XDIST) -m "not compile" --durations=40 $(PYTEST_ARGS)

# the inner loop: everything not marked slow (no multi-process worlds, no training runs; under 3 minutes)
test-fast: install-test
	$(XDIST) -m "not slow and not compile" $(PYTEST_ARGS)

# train.compile with inductor: one compiled step's gradients against eager and fp64, compiled training equals eager in
# one process, tp2, ep2 and pp2, a resumed run reuses the compile cache, and the README's train.compile=true command
# (tests/test_readme.py; 2.3 minutes). Inductor's C++ code generation dominates: ~16 minutes on 2 cores from an empty
# cache (TORCHINDUCTOR_CACHE_DIR), ~13 with a warm one
test-compile: install-test
	$(THREADS) $(PY) -m pytest -m compile $(PYTEST_ARGS)

lint: install-test
	$(PY) -m ruff check .

train: install
	$(PY) -m megatron_k3.train $(ARGS)

# supervised fine-tuning of the tiny K3 on the embedded chat set (docs/sft.md): the newest `make train` checkpoint
# (or FROM=...) in the released K3 layout (MXFP4 experts), its exact-match on held-out conversations, SFT with MX QAT
# from those weights (train=sft data=chat precision=mx_qat), the exported K3 directory's exact-match. ARGS: overrides.
# PEFT=lora: LoRA adapters over the frozen base instead (docs/peft.md, LORA_ARGS), scored from the run's checkpoint
# (the base with the adapters unmerged)
SFT_DIR ?= runs/sft
EVAL_N ?= 60
PEFT ?= none
# the tiny model's SFT: three passes, a learning rate half pre-training's (train=sft's 3e-4 is for large models)
SFT_ARGS ?= train.epochs=3 train.global_batch_size=8 optim.lr=1.5e-3 optim.min_lr=1.5e-4
# ... and its LoRA: AdamW on the adapters at a higher rate, rank 16, the LM head adapted too, and the embedding and
# head rows of the ids the chat set uses trained (tools/token_ids.py): the tiny base saw fewer pre-training tokens than
# the chat set holds, so those rows are barely trained, the control tokens' not at all (docs/peft.md, "Trainable token
# rows"; docs/sft.md measures each choice)
LORA_ARGS ?= optim=adamw optim.lr=3e-3 optim.min_lr=3e-4 optim.weight_decay=0 peft.rank=16 peft.alpha=32 \
  'peft.targets=[kda,mla,mlp,shared_experts,latent,experts,lm_head]' "peft.trainable_tokens=[$$LORA_TOKENS]"
ifeq ($(PEFT),lora)
SFT_RUN = peft=lora $(LORA_ARGS)
SFT_OUT = $(SFT_DIR)/checkpoints
else
SFT_RUN = checkpoint.export_hf=$(SFT_DIR)/final
SFT_OUT = $(SFT_DIR)/final
endif
sft: install
	@FROM=$${FROM:-$$(ls -td runs/*/checkpoints 2>/dev/null | grep -v '^$(SFT_DIR)/' | head -1)}; \
	test -n "$$FROM" || { echo "make sft: no checkpoint to start from: run make train first, or give FROM=DIR"; exit 2; }; \
	case "$(PEFT)" in none|lora) ;; *) echo "make sft: PEFT=$(PEFT): valid: none, lora"; exit 2;; esac; \
	set -ex -o pipefail; rm -rf $(SFT_DIR); \
	if [ "$(PEFT)" = lora ]; then LORA_TOKENS=$$($(PY) tools/token_ids.py train=sft data=chat $(ARGS)); fi; \
	$(PY) tools/convert_checkpoint.py $$FROM $(SFT_DIR)/base --to-hf; \
	$(PY) tools/chat.py $(SFT_DIR)/base --eval $(EVAL_N) --out $(SFT_DIR)/exact_match_before.json; \
	$(PY) -m megatron_k3.train train=sft data=chat precision=mx_qat model=from_checkpoint checkpoint.load=$(SFT_DIR)/base \
	  checkpoint.dir=$(SFT_DIR)/checkpoints hydra.run.dir=$(SFT_DIR)/run $(SFT_ARGS) $(SFT_RUN) $(ARGS); \
	$(PY) tools/chat.py $(SFT_OUT) --eval $(EVAL_N) --out $(SFT_DIR)/exact_match_after.json

bench: install-test
	$(PY) bench/kda.py
	$(PY) bench/train_step.py
	$(PY) bench/indexed.py
	$(PY) bench/plan_check.py
	$(PY) bench/moe.py

# the wheels bench/device_run.sh installs on a lent GPU machine (requirements-device.txt says why these serve its
# Python 3.12), built into .whl/ (git-ignored) for a device call to carry
device-wheels: install
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip wheel -q --no-deps -r requirements-device.txt -w .whl
	@ls -l .whl

# the suite under the lent GPU machine's torch, here on the CPU: a Python 3.12 venv (DEVICE_VENV, git-ignored) with that
# image's packages (requirements-device-image.txt: torch 2.11, a CUDA build that runs on the CPU, about 5 GB), the
# rest of requirements-test.txt constrained to them, and the carried wheels (.whl/) on PYTHONPATH as bench/device_run.sh
# puts them there; PYTEST_ARGS as for make test (for example -m compile). ~15 minutes of tests on 2 cores
# DEVICE_PYTHON: a Python 3.12 (the image's minor version): python3.12 where it runs, else pyenv's newest 3.12
DEVICE_PYTHON ?= $(or $(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null),\
	$(lastword $(sort $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python))))
DEVICE_VENV ?= .venv-device
DEVICE_PINNED := ^(-r|torch|triton|transformers|flash-linear-attention|fla-core|torchao|ruff)([=<> ]|$$)
test-device-torch: device-wheels
	@test -x $(DEVICE_VENV)/bin/python || $(DEVICE_PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
		|| { echo "make test-device-torch: no Python 3.12 found (the device image's); set DEVICE_PYTHON" >&2; exit 2; }
	test -x $(DEVICE_VENV)/bin/python || $(DEVICE_PYTHON) -m venv $(DEVICE_VENV)
	$(DEVICE_VENV)/bin/pip install -q -r requirements-device-image.txt
	grep -hvE '$(DEVICE_PINNED)' requirements.txt requirements-test.txt | grep -v '^#' > $(DEVICE_VENV)/rest.txt
	DS_BUILD_OPS=0 $(DEVICE_VENV)/bin/pip install -q -c requirements-device-image.txt -r $(DEVICE_VENV)/rest.txt
	rm -rf $(DEVICE_VENV)/carried
	SITE=$(abspath $(DEVICE_VENV))/carried PYTHON=$(abspath $(DEVICE_VENV))/bin/python bash bench/device_run.sh --install-only
	PYTHONPATH=$(abspath $(DEVICE_VENV))/carried:$(CURDIR) OMP_NUM_THREADS=1 $(DEVICE_VENV)/bin/python -m pytest \
		-p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not compile" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(DEVICE_VENV) .pytest_cache
