"""Selective recomputation: the (S, w, p, r) plan, signals and the layer-by-layer batch runner."""
from cachesmith.recompute.config import (FIXED_FAMILIES, PRESET_NAMES, RecomputeConfig, Signal, cacheblend, epic,
                                         fixed_splits, full_prefill, full_reuse, fused_family, fusionrag,
                                         last_layer, parse_label, preset, prophetkv)
from cachesmith.recompute.hooks import HookChain, LayerInfo, LayerStat, LayerStatsRecorder, RunnerHooks
from cachesmith.recompute.fork import PatchFork
from cachesmith.recompute.run_state import RecomputeOutput
from cachesmith.recompute.runner import BatchRunner
from cachesmith.recompute.sequence import RecomputeRequest

__all__ = ["FIXED_FAMILIES", "PRESET_NAMES", "BatchRunner", "PatchFork", "HookChain", "LayerInfo", "LayerStat",
           "LayerStatsRecorder", "RecomputeConfig", "RecomputeOutput", "RecomputeRequest", "RunnerHooks", "Signal",
           "cacheblend", "epic", "fixed_splits", "full_prefill", "full_reuse", "fused_family", "fusionrag",
           "last_layer", "parse_label", "preset", "prophetkv"]
