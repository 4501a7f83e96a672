"""Method names: parsing, the bad ones named, and the scheduler each gets."""
from __future__ import annotations

import pytest

from cachesmith.errors import ConfigError
from cachesmith.methods import default_methods, make_scheduler, parse_method
from cachesmith.planner import Planner
from cachesmith.recompute import preset
from cachesmith.scheduler import (FcfsPlanned, FcfsQueueAware, FcfsSloBudget, FcfsStatic, SchedulerConfig,
                                  SloAwareScheduler)
from tests.planner.synthetic_profile import make_profile


def test_names_parse_to_presets_and_coverages():
    m = parse_method("prophetkv@0.3+qa")
    assert (m.preset, m.coverage, m.is_queue_aware, m.is_static) == ("prophetkv", 0.3, True, True)
    assert m.plan(30) == preset("prophetkv", 0.3, 30)
    assert not parse_method("cachesmith").is_static
    assert parse_method("full_prefill").plan(30).warmup == 30
    names = default_methods((0.1, 0.2))
    assert names[:3] == ["cachesmith", "full_prefill", "full_reuse"] and "fusionrag@0.2" in names
    assert len(names) == 3 + 4 * 2


@pytest.mark.parametrize("name, match", [("cacheblend", "<preset>@<coverage>"), ("epic@x", "'x' is not a number"),
                                         ("epic@0", r"coverage 0.0 must be in \(0, 1\]"), ("magic@0.1", "magic"),
                                         ("cachesmith+qa", "queue-aware already")])
def test_bad_names_are_named(name, match):
    with pytest.raises(ConfigError, match=match):
        parse_method(name)


def test_each_method_gets_its_scheduler():
    planner, cfg = Planner(make_profile()), SchedulerConfig()
    assert isinstance(make_scheduler(parse_method("cachesmith"), planner, cfg, 30), SloAwareScheduler)
    assert type(make_scheduler(parse_method("epic@0.15"), planner, cfg, 30)) is FcfsStatic
    assert isinstance(make_scheduler(parse_method("epic@0.15+qa"), planner, cfg, 30), FcfsQueueAware)


def test_ablation_names_parse_to_their_schedulers_and_signals():
    planner, cfg = Planner(make_profile()), SchedulerConfig()
    alone = parse_method("planner:prophetkv@0.15")
    assert (alone.preset, alone.coverage, alone.signal, alone.is_static) == ("prophetkv", 0.15, "qci", False)
    assert isinstance(make_scheduler(alone, planner, cfg, 30), FcfsPlanned)
    slo = parse_method("planner+slo:kv_dev")
    assert (slo.signal, slo.scheduling) == ("kv_dev", "fcfs_slo")
    assert isinstance(make_scheduler(slo, planner, cfg, 30), FcfsSloBudget)
    fixed = parse_method("cachesmith:qci")
    assert (fixed.signal, fixed.is_static) == ("qci", False)
    assert isinstance(make_scheduler(fixed, planner, cfg, 30), SloAwareScheduler)


@pytest.mark.parametrize("name, match", [("cachesmith:position", "signal 'position' must be one of kv_dev, qci"),
                                         ("planner", "needs ':<preset>@<coverage>'"),
                                         ("planner:full_prefill", "needs a selective preset"),
                                         ("planner+slo:kv_dev+qa", "queue-aware already")])
def test_bad_ablation_names_are_named(name, match):
    with pytest.raises(ConfigError, match=match):
        parse_method(name)


def test_task_hint_and_entropy_rule_names():
    hinted = parse_method("cachesmith+task")
    assert (hinted.use_task_hint, hinted.signal, hinted.signal_rule) == (True, None, "robust")
    assert parse_method("cachesmith:passes").signal_rule == "passes"  # the rule without its margin
    assert parse_method("cachesmith").use_task_hint is False  # hint-free is the paper's setting
    entropy = parse_method("cachesmith:entropy")
    assert (entropy.signal_rule, entropy.signal, entropy.use_task_hint) == ("entropy", None, False)
    assert parse_method("cachesmith+task:kv_dev").signal == "kv_dev"
    learn, both = parse_method("cachesmith+learn"), parse_method("cachesmith+task+learn")
    assert (both.is_mix_learned, both.use_task_hint) == (True, True)
    assert (learn.is_mix_learned, learn.use_task_hint, learn.signal) == (True, False, None)
    assert parse_method("cachesmith").is_mix_learned is False and parse_method("cachesmith+learn:qci").signal == "qci"
    with pytest.raises(ConfigError, match="queue-aware already"):
        parse_method("cachesmith+task+qa")
