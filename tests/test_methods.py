"""Method names: parsing, the bad ones named, and the scheduler each gets."""
from __future__ import annotations

import pytest

from cachesmith.errors import ConfigError
from cachesmith.methods import default_methods, make_scheduler, parse_method
from cachesmith.planner import Planner
from cachesmith.recompute import preset
from cachesmith.scheduler import FcfsQueueAware, FcfsStatic, SchedulerConfig, SloAwareScheduler
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
