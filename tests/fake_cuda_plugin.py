"""A pytest plugin (`-p tests.fake_cuda_plugin`) for collecting only: torch is told a CUDA device
is there before tests/conftest.py builds its DEVICES, so collection makes the "cuda" cases a GPU
machine would (tests/test_cuda_collection.py). Running them would need the GPU itself."""
from __future__ import annotations

from cachesmith.model import device as accel

accel._backend.is_available = lambda: True  # the real backend's instance: `is_cuda_available()`
