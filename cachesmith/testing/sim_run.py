"""Run a program on the simulated CUDA device: `python -m cachesmith.testing.sim_run cachesmith.cli
serve --device cuda ...` serves with every `cuda` tensor simulated (CPU data, CUDA's errors, counted
syncs and copies). In: a module name (or a script's path, ending in `.py`) and its arguments. Out: that program's own
output; at exit, one line on stderr with what the simulated device counted.
"""
from __future__ import annotations

import runpy
import sys

from cachesmith.testing.sim_cuda import SimCuda


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m cachesmith.testing.sim_run MODULE|SCRIPT.py [ARGS...]")
    module, sys.argv = argv[0], argv
    with SimCuda() as sim:
        try:
            if module.endswith(".py"):
                runpy.run_path(module, run_name="__main__")
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        finally:
            t = sim.total
            print(f"simulated cuda: {t.ops} ops, {t.syncs} host syncs, {t.h2d} host->device and {t.d2h} "
                  f"device->host copies, {len(t.findings)} findings ({len(t.stream_findings)} of stream "
                  f"order), attention {dict(t.attention)}, {t.captures} graph captures, {t.replays} replays, "
                  f"peak memory {sim.memory.peak_bytes / (1 << 30):.2f} GiB of {sim.memory.capacity_bytes / (1 << 30):.0f}",
                  file=sys.stderr)
            for finding in dict.fromkeys(t.findings):  # each once, in the order found
                print(f"simulated cuda finding: {finding}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
