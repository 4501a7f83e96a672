"""Bad plans and bad requests are rejected with errors that name the field."""
from __future__ import annotations

import dataclasses

import pytest

from cachesmith.errors import ConfigError, InputError
from cachesmith.model import Decoder, prefill_chunk
from cachesmith.recompute import BatchRunner, RecomputeConfig, RecomputeRequest, Signal, parse_label, preset
from tests.recompute.helpers import make_request


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return Decoder(tiny_llama_dir[0])


@pytest.mark.parametrize("kwargs, field", [
    (dict(signal="qci", warmup=0, probe=1, coverage=1.5), "coverage"),
    (dict(signal="qci", warmup=0, probe=1, coverage=-0.1), "coverage"),
    (dict(signal="qci", warmup=0, probe=1, coverage=float("nan")), "coverage"),
    (dict(signal="bogus", warmup=0, probe=1, coverage=0.1), "signal"),
    (dict(signal="qci", warmup=-1, probe=1, coverage=0.1), "warmup"),
    (dict(signal="qci", warmup=0, probe=1.5, coverage=0.1), "probe"),
    (dict(signal="position", warmup=0, probe=2, coverage=0.1), "probe"),
    (dict(signal="kv_dev", warmup=1, probe=0, coverage=0.1, kv_dev_target="q"), "kv_dev_target"),
])
def test_bad_configs_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        RecomputeConfig(**kwargs)


def test_depth_beyond_model_is_rejected(model):
    req, _ = make_request(model, seed=1)
    with pytest.raises(ConfigError, match="warmup \\+ probe = 5 exceeds the model's 3 layers"):
        BatchRunner(model).run([req], RecomputeConfig(Signal.QCI, 2, 3, 0.1))
    with pytest.raises(ConfigError, match="preset"):
        preset("nope", 0.1, 3)


def test_bad_requests_name_the_field(model):
    runner, plan = BatchRunner(model), RecomputeConfig(Signal.KV_DEV, 1, 0, 0.1)
    req, _ = make_request(model, seed=2)
    assert runner.run([dataclasses.replace(req, chunks=[])], plan)[0].num_context == 0  # a plain chat
    with pytest.raises(InputError, match=r"requests\[0\].suffix_ids is empty"):
        runner.run([dataclasses.replace(req, suffix_ids=[])], plan)
    with pytest.raises(ConfigError, match=r"requests\[1\].coverage"):
        runner.run([req, dataclasses.replace(req, coverage=2.0)], plan)
    alien = dataclasses.replace(req.chunks[1], model_fingerprint="f" * 32)
    with pytest.raises(InputError, match=r"requests\[0\].chunks\[1\] was computed by model"):
        runner.run([dataclasses.replace(req, chunks=[req.chunks[0], alien])], plan)
    low = prefill_chunk(Decoder(model.model_dir, dtype="bfloat16"), [5, 6, 7])
    with pytest.raises(InputError, match=r"requests\[0\].chunks\[0\] has dtype"):
        runner.run([dataclasses.replace(req, chunks=[low])], plan)
    long_chunk = prefill_chunk(model, list(range(3, 120)) * 2)  # 234 tokens; the model holds 256
    too_long = RecomputeRequest(chunks=[long_chunk, long_chunk], suffix_ids=[5, 6])
    with pytest.raises(InputError, match=r"requests\[0\].suffix_ids: 470 positions exceed"):
        runner.run([too_long], plan)


@pytest.mark.parametrize("plan", [RecomputeConfig("kv_dev", 1, 11, 0.22), RecomputeConfig("position", 30, 0, 1.0),
                                  RecomputeConfig("qci_last", 0, 1, 0.05), RecomputeConfig("position", 0, 0, 0.0)])
def test_a_plan_label_reads_back_as_its_plan(plan):
    signal, w, p, coverage = parse_label(plan.label())
    assert RecomputeConfig(signal, w, p, coverage) == plan
