"""Device facts (tritonblas_ops/device.py): XCDs from the AMD arch, the default shard count.
No AMD GPU runs here: the ROCm paths are checked with the arch names and CU counts they read."""

import pytest
import torch

from tritonblas_ops import device as devices


def test_num_xcds_from_arch():
    assert devices.num_xcds_for_arch("gfx942:sramecc+:xnack-", 304) == 8  # MI300X
    assert devices.num_xcds_for_arch("gfx942", 228) == 6  # MI300A
    assert devices.num_xcds_for_arch("gfx950", 256) == 8  # MI350
    assert devices.num_xcds_for_arch("gfx90a", 110) == 1  # MI250X GCD: no XCD sharding


def test_default_shards_follow_the_xcds_on_hip(monkeypatch):
    class MI300A:
        gcnArchName = "gfx942:sramecc+:xnack-"
        multi_processor_count = 228

    monkeypatch.delenv(devices.SHARDS_ENV, raising=False)
    monkeypatch.setattr(devices, "is_hip", lambda: True)
    monkeypatch.setattr(devices, "_properties", lambda index: MI300A)
    assert devices.default_num_shards(torch.device("cuda", 0)) == 6
    monkeypatch.setattr(devices, "is_hip", lambda: False)
    assert devices.default_num_shards(torch.device("cuda", 0)) == 1
    monkeypatch.setenv(devices.SHARDS_ENV, "4")
    assert devices.default_num_shards(torch.device("cuda", 0)) == 4
    monkeypatch.setenv(devices.SHARDS_ENV, "0")
    with pytest.raises(ValueError, match="TRITONBLAS_OPS_NUM_SHARDS must be a positive integer"):
        devices.default_num_shards(torch.device("cuda", 0))
