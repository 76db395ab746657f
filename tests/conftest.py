import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import OBS_FAST, STATIC, one_process, train_layout

from megatron_k3.ops.numerics import start_cpu_threads

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
start_cpu_threads()  # the process's first parallel region computes nothing a test compares (ops/numerics.py says why)


# make test runs two pytest-xdist workers, each taking one test module at a time in collection order (Makefile:
# --dist loadscope --no-loadscope-reorder). The modules that take longest go first, so the workers finish together
# rather than one running a long module alone at the end (xdist's own order is by test count, which put the
# torchrun fault drills last). Order from the slowest-test list of a 2-core run (2026-12-02), about 100 s down to 25 s
# a module, after test_readme (the README's commands, ~5 minutes); test_recompute (2026-12-03: eight layouts, 3-4 runs
# each, ~3 minutes) joins them; every other module follows in its usual order.
LONGEST_FIRST = ("test_readme", "test_fault_drills", "test_recompute", "test_vision_train", "test_compile",
                 "test_checkpoint", "test_engine", "test_train", "test_expert_parallel", "test_build_rank",
                 "test_context_parallel", "test_faults", "test_sharded_checkpoint", "test_pipeline",
                 "test_k3_streaming")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.stem, len(first)))  # stable: a module's tests keep their order


@pytest.fixture(scope="session")
def short_run_dir(tmp_path_factory):
    """A 3-step training run shared by every test that reads what a run writes (run once per session)."""
    from megatron_k3.train import main

    d = tmp_path_factory.mktemp("short_run")
    assert main(OBS_FAST + ["train.steps=3", f"hydra.run.dir={d}"]) == 0
    return d


@pytest.fixture(scope="session")
def reference_static(tmp_path_factory):
    """One process, FAST + STATIC (helpers.train_layout): the run that the layouts of test_expert_parallel and
    test_context_parallel compare with (once per pytest worker)."""
    return one_process(train_layout, tmp_path_factory, STATIC)
