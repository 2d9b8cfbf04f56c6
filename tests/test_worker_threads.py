"""Each xdist worker's torch threads (conftest.py at the root): the cores shared out among the
workers, and the pytest subprocesses a test starts inherit the same count."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cores, workers, threads", [(2, "2", 1), (8, "2", 4), (2, "3", 1), (16, None, None)])
def test_each_worker_takes_its_share_of_the_cores(cores, workers, threads):
    assert _root_conftest().worker_threads(cores, workers) == threads


def test_a_bad_worker_count_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match="PYTEST_XDIST_WORKER_COUNT must be a whole number >= 1, got 'two'"):
        _root_conftest().worker_threads(2, "two")


@pytest.mark.skipif("PYTEST_XDIST_WORKER_COUNT" not in os.environ, reason="under pytest-xdist workers only")
def test_this_worker_and_a_process_it_starts_run_on_its_share():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = _root_conftest().worker_threads(cores, os.environ["PYTEST_XDIST_WORKER_COUNT"])
    if os.environ["OMP_NUM_THREADS"] != str(share):
        pytest.skip(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} was set outside the run")
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, timeout=120)
    assert (torch.get_num_threads(), child.stdout.strip()) == (share, str(share)), child.stderr[-2000:]
