"""Run one CI step and print the peak resident memory of its largest process.

In: the step's command line. Out: the step's exit status, and one line on stderr naming the step,
its wall time and the largest resident set of any process it ran (the kernel's `ru_maxrss` over
the waited-for descendants, what `/usr/bin/time -v` reports), so a step near the machine's memory
shows in the log before it dies of it.
"""
import resource
import subprocess
import sys
import time

start = time.monotonic()
status = subprocess.call(sys.argv[1:])
peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux
print(f"[ci] {' '.join(sys.argv[1:])}: exit {status}, {time.monotonic() - start:.0f} s, "
      f"largest process {peak_gb:.1f} GB resident", file=sys.stderr, flush=True)
sys.exit(status)
