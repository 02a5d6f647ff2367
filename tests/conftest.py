import os
import pathlib
import subprocess
import sys

import pytest
import torch

from subprocess_helpers import REPO

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU; skipped on CPU-only machines")
    config.addinivalue_line("markers", "quickstart: builds a fresh venv from a clean clone (minutes)")


def pytest_collection_modifyitems(items):
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(requires_gpu)


@pytest.fixture(autouse=True, scope="session")
def checked_launches():
    """Every launch of the test session is checked (launch.set_checked): its counters are
    read back before and after it, so a counter bug fails the test that caused it. Set
    TRITONBLAS_OPS_CHECKED to choose otherwise."""
    import tritonblas_ops

    if "TRITONBLAS_OPS_CHECKED" not in os.environ:
        tritonblas_ops.set_checked(True)
    yield


def _launches_checked(enabled: bool):
    import tritonblas_ops

    before = tritonblas_ops.is_checked()
    tritonblas_ops.set_checked(enabled)
    yield
    tritonblas_ops.set_checked(before)


@pytest.fixture
def unchecked():
    """Launches not checked, for tests of what unchecked calls take (the fast launch)."""
    yield from _launches_checked(False)


@pytest.fixture
def checked():
    """Launches checked, whatever the session chose."""
    yield from _launches_checked(True)


@pytest.fixture
def poison_empty():
    """Every torch.empty (the kernel's output buffers included) starts as NaN, so an output
    element the kernel never wrote fails the comparison instead of passing on stale data."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


@pytest.fixture(scope="session")
def stubs(tmp_path_factory) -> str:
    """The C++ stubs, built for this torch into the test session's temporary folder: g++
    runs once a session (about 10 s on two cores)."""
    env = {**os.environ, "TRITONBLAS_OPS_STUBS_DIR": str(tmp_path_factory.getbasetemp() / "stubs"),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tritonblas_ops.stubs", "build"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"building the stubs failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    path = proc.stdout.strip().splitlines()[-1]
    assert pathlib.Path(path).is_file(), path
    return path
