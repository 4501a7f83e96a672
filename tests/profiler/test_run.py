"""`cachesmith profile` end to end at toy sizes: every part written, the profile loads for this
model only, a second run resumes from the saved parts and cached answers, and a costs-only profile
of a model nothing is packaged for takes the packaged demand mapped onto its depth."""
from __future__ import annotations

import pytest

from cachesmith import cli
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import Planner, PlanRequest, Profile, ProfileError
from cachesmith.calibration import cost_run as run_mod
from cachesmith.calibration.cost_run import ProfileConfig
from cachesmith.profiler.run import run_profile
from tests.engine_helpers import save_tiny_chat_model

pytestmark = pytest.mark.real_model


@pytest.mark.slow  # a profile of the 30-layer model: about a minute and a half
def test_profile_end_to_end_and_resume(tmp_path, monkeypatch):
    pipe = RagPipeline(store=ChunkStore(StoreConfig(tiers=("memory",))))
    config = ProfileConfig(num_requests=2, max_tokens=256, num_shapes=3, plans_per_shape=5, num_pool_chunks=8,
                           tiers=("memory",))
    out = tmp_path / "p.json"
    profile = run_profile(pipe, config, out, show_progress=False)
    loaded = Profile.load(out, pipe.model.fingerprint, "float32", "cpu")
    assert loaded == profile and loaded.num_layers == 30
    assert loaded.kv_bytes_per_token_layer == 2 * 3 * 64 * 4
    assert loaded.tier_gbps["memory"] > 0 and "ttft_rel_err_mean" in loaded.fit_error
    assert {(c.signal, c.rank_depth) for c in loaded.demand} == {
        (s, d) for s in ("kv_dev", "qci") for d in (2, 6, 15)} | {("kv_dev", 1), ("qci_last", 30), ("fused", 30)}
    # + CacheBlend's (1, 0) and the fixed-split families (1, L - 1)
    assert 1 in Planner(loaded).signal_depths("kv_dev")
    # the served mix (seeds cycle the tasks: one PR, one MSQ request) and each task's own curves
    assert all(len(c.demands) == (2 if c.task is None else 1) for c in loaded.demand)
    assert {c.task for c in loaded.demand} == {None, "pr", "msq"}
    for name in ("costs", "bandwidth", "validation"):
        assert (tmp_path / f"p.{name}.json").exists()
    assert (tmp_path / "p.runs.jsonl").exists() and (tmp_path / "p.kv").is_dir()  # timed runs, their store
    plan = Planner(loaded).plan([PlanRequest(200, 20, 0, 0.5)], 10.0)
    assert plan.predicted_ttft_s <= 10.0

    def refuse(*args, **kwargs):
        raise AssertionError("a finished part was measured again")

    monkeypatch.setattr(run_mod, "measure", refuse)
    monkeypatch.setattr(run_mod, "tier_bandwidth", refuse)
    monkeypatch.setattr(run_mod, "validation_error", refuse)
    monkeypatch.setattr(pipe, "answer", refuse)
    assert run_profile(pipe, config, out, show_progress=False) == profile
    with pytest.raises(ProfileError, match="dtype"):
        Profile.load(out, pipe.model.fingerprint, "bfloat16", "cpu")


def test_profile_cli_rejects_bad_sizes(capsys):
    assert cli.main(["profile", "--num-requests", "0"]) == 2
    assert "num_requests=0" in capsys.readouterr().err
    assert cli.main(["profile", "--task", "pr", "--variant", "abstract"]) == 2
    assert "unknown variant 'abstract'" in capsys.readouterr().err


def test_costs_only_profile_of_a_model_nothing_is_packaged_for_maps_the_packaged_demand(tmp_path, capsys):
    model_dir = save_tiny_chat_model(tmp_path / "tiny-costs-only")  # 4 layers
    out = tmp_path / "p.json"
    assert cli.main(["profile", "--costs-only", "--model", str(model_dir), "--max-tokens", "512",
                     "--num-shapes", "3", "--plans-per-shape", "2", "--tiers", "memory", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "smollm2-135m profile's" in printed and "mapped from its 30 layers onto this model's 4" in printed
    rows = [line.split() for line in printed.splitlines()[printed.splitlines().index(
        f"{'task':<6} {'signal':<8} {'depth':>5} {'median':>7} {'p90':>6}") + 1:]]
    assert len(rows) == len(Profile.load(out).demand) > 0
    assert {int(r[2]) for r in rows} == {1, 2, 4}  # never a depth the model does not have


def test_saved_parts_resume_only_the_model_they_were_measured_for(tmp_path, caplog):
    pipe = RagPipeline(str(save_tiny_chat_model(tmp_path / "tiny")), store=ChunkStore(StoreConfig(tiers=("memory",))))
    out = tmp_path / "p.json"
    (tmp_path / "p.costs.json").write_text('{"layer_costs": "of an older model"}')
    (tmp_path / "p.kv").mkdir()
    run_mod._own_parts(out, pipe)  # parts without a marker: of unknown origin, removed
    assert not (tmp_path / "p.costs.json").exists() and not (tmp_path / "p.kv").exists()
    assert "removed 2" in caplog.text
    (tmp_path / "p.costs.json").write_text("{}")
    run_mod._own_parts(out, pipe)  # its own: kept, a stopped profile resumes
    assert (tmp_path / "p.costs.json").exists()
    retrained = RagPipeline(str(save_tiny_chat_model(tmp_path / "tiny2", seed=1)),
                            store=ChunkStore(StoreConfig(tiers=("memory",))))
    assert retrained.model.fingerprint != pipe.model.fingerprint
    run_mod._own_parts(out, retrained)  # new weights under the same profile name: measured afresh
    assert not (tmp_path / "p.costs.json").exists()


def test_demand_only_profile_measures_demand_with_the_codec_and_times_nothing(tmp_path, capsys, monkeypatch):
    model_dir = save_tiny_chat_model(tmp_path / "tiny-demand-only", max_positions=8192)  # MIX prompts run to ~3K tokens
    costs = tmp_path / "costs.json"
    assert cli.main(["profile", "--costs-only", "--model", str(model_dir), "--max-tokens", "512",
                     "--num-shapes", "3", "--plans-per-shape", "2", "--tiers", "memory", "--out", str(costs)]) == 0
    capsys.readouterr()

    def refuse(*args, **kwargs):
        raise AssertionError("a demand-only profile timed a run")

    monkeypatch.setattr(run_mod, "measure", refuse)
    monkeypatch.setattr(run_mod, "tier_bandwidth", refuse)
    out = tmp_path / "p-int8.json"
    assert cli.main(["profile", "--demand-only", "--costs-from", str(costs), "--kv-codec", "int8",
                     "--model", str(model_dir), "--num-requests", "2", "--out", str(out)]) == 0
    assert "demand measured with --kv-codec int8" in capsys.readouterr().out
    source, measured = Profile.load(costs), Profile.load(out)
    assert measured.layer_costs == source.layer_costs and measured.overhead == source.overhead
    assert measured.tier_gbps == source.tier_gbps and measured.fit_error == source.fit_error
    assert measured.demand and {c.task for c in measured.demand} == {None, "pr", "msq"}
    assert all(len(c.demands) == (2 if c.task is None else 1) for c in measured.demand)
    assert (tmp_path / "p-int8.demand.jsonl").exists()  # answers cached: a stopped run resumes


def test_demand_only_profile_refuses_costs_of_another_model(tmp_path, capsys):
    model_dir = save_tiny_chat_model(tmp_path / "tiny-other")
    assert cli.main(["profile", "--demand-only", "--model", str(model_dir), "--num-requests", "1",
                     "--out", str(tmp_path / "p.json")]) == 2  # the default source: the packaged model's
    assert "was measured for model" in capsys.readouterr().err
    assert cli.main(["profile", "--demand-only", "--costs-only"]) == 2
    assert "exclude each other" in capsys.readouterr().err
