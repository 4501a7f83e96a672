"""Workloads: real passages, word lists and task instances (prefix + chunks + question + gold)."""
