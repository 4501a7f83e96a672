"""A tier's bandwidth is what the transfer engine gets into a cache on the model's device: on a GPU
the copy from the pinned staging buffer is inside the timed read, as it is inside a served load."""
from __future__ import annotations

import pytest

from cachesmith.model import Decoder
from cachesmith.calibration.bandwidth import tier_bandwidth

pytestmark = pytest.mark.sim_cuda


def test_bandwidth_on_a_device_times_the_copies_to_it(tiny_llama_dir, sim_cuda, tmp_path):
    model = Decoder(tiny_llama_dir[0], "cuda")
    repeats = 2
    with sim_cuda.count() as counts:
        speeds = tier_bandwidth(model, ("memory", "disk"), num_tokens=128, repeats=repeats, root=tmp_path)
    assert set(speeds) == {"memory", "disk"} and all(s > 0 for s in speeds.values())
    # K and V of every layer, each read of each tier (the first read warms caches): copied to the device
    assert counts.h2d >= 2 * model.num_layers * (repeats + 1) * 2 and counts.findings == []
    assert counts.syncs >= (repeats + 1) * 2  # the clock stops once the device has the bytes
