# megatron-k3: the commands users and CI rely on (see ../shared/design/INTERFACES.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install train test bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	DS_BUILD_OPS=0 $(PY) -m pip install -q --upgrade pip
	DS_BUILD_OPS=0 $(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

test: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m pytest $(PYTEST_ARGS)

train: install
	$(PY) -m megatron_k3.train $(ARGS)

bench: install
	$(PY) bench/kda.py
	$(PY) bench/train_step.py
	$(PY) bench/indexed.py
	$(PY) bench/plan_check.py
	$(PY) bench/moe.py

clean:
	rm -rf $(VENV) .pytest_cache
