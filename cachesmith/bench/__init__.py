"""Benchmarks of the serving loop on the replay clock: settings, runs, metrics, tables and plots."""
from cachesmith.bench.metrics import KEYS, best_static, summarize
from cachesmith.bench.report import markdown, plot
from cachesmith.bench.run import BenchResult, run_bench
from cachesmith.bench.setting import BenchConfig

__all__ = ["BenchConfig", "BenchResult", "KEYS", "best_static", "markdown", "plot", "run_bench", "summarize"]
