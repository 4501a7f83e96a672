"""Offline profiling for the planner: compute costs, tier bandwidths, demand distributions."""
