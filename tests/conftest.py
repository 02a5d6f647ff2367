import pytest
import torch

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU; skipped on CPU-only machines")


def pytest_collection_modifyitems(items):
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(requires_gpu)


@pytest.fixture
def poison_empty():
    """Every torch.empty (the kernel's output buffers included) starts as NaN, so an output
    element the kernel never wrote fails the comparison instead of passing on stale data."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
