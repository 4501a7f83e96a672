"""The budget-aware recomputation planner: profile file, transfer-aware cost model, demand
distributions, coverage allocation, the planner and the runtime monitor (paper §5.1)."""
from cachesmith.planner.cost_model import BatchShape, CostModel
from cachesmith.planner.demand import DemandModel
from cachesmith.planner.planner import BatchPlan, Planner, PlannerConfig, PlanRequest
from cachesmith.planner.profile import DemandCurve, PhaseCost, Profile, ProfileError

__all__ = ["BatchPlan", "BatchShape", "CostModel", "DemandCurve", "DemandModel", "PhaseCost", "PlanRequest",
           "Planner", "PlannerConfig", "Profile", "ProfileError"]
