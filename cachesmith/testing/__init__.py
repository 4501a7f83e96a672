"""Test aids that ship with the package: a simulated CUDA device (`sim_cuda`) and a runner that
starts any of our entry points on it (`python -m cachesmith.testing.sim_run MODULE ARGS...`)."""
