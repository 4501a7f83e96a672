"""Workloads: real passages, task generators (PR, MSQ, VT, MV, MIX), dataset cards and arrival
traces. See `tasks.generate` and docs/workloads.md. Scoring and the quality gates are re-exported
from `cachesmith.scoring` and `cachesmith.gates`: they sit below, where the serving engine reads them."""
from cachesmith.gates import FidelityGate, QualityGate, TaskGate, make_gate
from cachesmith.instance import WorkloadInstance
from cachesmith.scoring import Score, score
from cachesmith.workloads.tasks import MIX_TASKS, TASKS, WorkloadError, generate, generate_many
from cachesmith.workloads.trace import Trace, TraceConfig, TraceRequest, make_trace, rate_for_utilization

__all__ = ["FidelityGate", "MIX_TASKS", "QualityGate", "Score", "TASKS", "TaskGate", "Trace", "TraceConfig",
           "TraceRequest", "WorkloadError", "WorkloadInstance", "generate", "generate_many", "make_gate",
           "make_trace", "rate_for_utilization", "score"]
