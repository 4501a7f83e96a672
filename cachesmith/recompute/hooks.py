"""Per-layer hooks around the runner's layer loop, and a statistics recorder built on them.

`before_layer(layer, phase)` runs before a layer pass reads cached KV: the transfer engine blocks
there until that layer's KV has arrived. `after_selection(selected)` tells which context rows each
request recomputes (the rest are reused, so their KV must be loaded), again whenever a monitor lowers
coverage. `after_layer(info)` runs after each pass and may return lowered coverages
{request index: coverage} for the remaining Patch layers (runtime monitor).
Timing lives here, outside the hot path, on device timing events (no sync per layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cachesmith.model import device as accel

PHASES = ("warmup", "probe", "patch")


@dataclass(frozen=True)
class LayerInfo:
    layer: int
    phase: str
    num_computed_tokens: int  # rows that ran the layer's linear parts
    kv_bytes_read: int  # bytes of cached K/V rows this pass uses (what a transfer must deliver)


class RunnerHooks:
    """No-op base; subclasses override what they need."""

    def before_layer(self, layer: int, phase: str) -> None:
        return None

    def after_selection(self, selected: list[torch.Tensor]) -> None:
        return None

    def after_layer(self, info: LayerInfo) -> dict[int, float] | None:
        return None


class HookChain(RunnerHooks):
    """Several hooks in order; the lowest coverage any of them asks for wins. `hooks` may grow
    during a run (a monitor joins once the plan is decided after layer 0)."""

    def __init__(self, *hooks: RunnerHooks) -> None:
        self.hooks = [h for h in hooks if h is not None]

    def before_layer(self, layer: int, phase: str) -> None:
        for h in self.hooks:
            h.before_layer(layer, phase)

    def after_selection(self, selected: list[torch.Tensor]) -> None:
        for h in self.hooks:
            h.after_selection(selected)

    def after_layer(self, info: LayerInfo) -> dict[int, float] | None:
        merged: dict[int, float] = {}
        for h in self.hooks:
            for idx, cov in (h.after_layer(info) or {}).items():
                merged[idx] = min(cov, merged.get(idx, cov))
        return merged or None


@dataclass(frozen=True)
class LayerStat:
    layer: int
    phase: str
    seconds: float
    num_computed_tokens: int
    kv_bytes_read: int


class LayerStatsRecorder(RunnerHooks):
    """Time, tokens computed and KV bytes read of every layer pass. Each pass is timed between two
    device timing events, read once the run is over: a sync per layer would drain the stream, and
    the layers would be priced with the host's launch gaps that a serving run hides."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = device
        self._passes: list[tuple[LayerInfo, accel.TimingEvent, accel.TimingEvent]] = []
        self._start: accel.TimingEvent | None = None

    def before_layer(self, layer: int, phase: str) -> None:
        self._start = accel.new_timing_event(self.device)
        self._start.record()

    def after_layer(self, info: LayerInfo) -> None:
        end = accel.new_timing_event(self.device)
        end.record()
        self._passes.append((info, self._start, end))

    @property
    def stats(self) -> list[LayerStat]:
        """Every pass so far (reading them waits for the device to finish them)."""
        return [LayerStat(i.layer, i.phase, end.seconds_since(start), i.num_computed_tokens, i.kv_bytes_read)
                for i, start, end in self._passes]

    def total_seconds(self, phase: str | None = None) -> float:
        return sum(s.seconds for s in self.stats if phase is None or s.phase == phase)
