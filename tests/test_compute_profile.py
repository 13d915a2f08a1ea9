"""Compute profiles (hetjax/planner/compute_profile.py): reading measured rows at any size, the
file's errors, and the cost model pricing from a profile (with the flat model's fallback
marked as such)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from hetjax.core.model_config import ModelConfig
from hetjax.core.plan import Plan
from hetjax.core.topology import preset
from hetjax.errors import PlanError
from hetjax.planner import band
from hetjax.planner.compute_profile import ComputeProfile, ProfileRow, load_profile
from hetjax.planner.cost import CostModel, CostOptions
from hetjax.planner.layout import Layout

MODEL = ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128,
                    max_seq_len=64, remat="none")


def _row(tokens, fwd, bwd, tp=1, **kw):
    return ProfileRow(accelerator="cpu", piece="layer", tp=tp, tokens=tokens, seq_len=64,
                      fwd_s=fwd, bwd_s=bwd, **kw)


def _profile(*rows):
    return ComputeProfile(tuple(rows), ComputeProfile.of_model(MODEL), "test")


def test_tokens_are_read_log_log_between_measured_sizes():
    # 128 -> 1 ms, 512 -> 2 ms: halfway in log tokens (256) is the geometric mean
    p = _profile(_row(128, 1e-3, 2e-3), _row(512, 2e-3, 4e-3))
    e = p.lookup("cpu", "layer", 1, 256, 64)
    assert e.fwd_s == pytest.approx(math.sqrt(1e-3 * 2e-3))
    assert e.bwd_s == pytest.approx(math.sqrt(2e-3 * 4e-3))
    assert not e.extrapolated and e.distance == 1.0


def test_beyond_the_measured_sizes_the_slope_is_held_to_one_and_the_distance_said():
    # the last segment's slope is 2 (time x4 for tokens x2): held to 1 beyond it
    p = _profile(_row(128, 1e-3, 2e-3), _row(256, 4e-3, 8e-3))
    e = p.lookup("cpu", "layer", 1, 1024, 64)
    assert e.fwd_s == pytest.approx(4e-3 * 4)
    assert e.extrapolated and e.distance == pytest.approx(4.0)
    assert any("beyond the measured sizes" in n for n in e.notes)
    # below: the first segment's slope (clamped to 1) -- never cheaper than proportional
    low = p.lookup("cpu", "layer", 1, 32, 64)
    assert low.fwd_s == pytest.approx(1e-3 / 4) and low.distance == pytest.approx(4.0)


def test_tp_degrees_are_interpolated_log_log_and_scaled_beyond():
    p = _profile(_row(256, 4e-3, 8e-3, tp=1), _row(256, 1e-3, 2e-3, tp=4))
    e = p.lookup("cpu", "layer", 2, 256, 64)
    assert e.fwd_s == pytest.approx(2e-3) and not e.extrapolated  # sqrt(4 ms x 1 ms)
    far = p.lookup("cpu", "layer", 8, 256, 64)
    assert far.fwd_s == pytest.approx(0.5e-3)  # tp 4's, its work split ideally over 8
    assert far.distance == pytest.approx(2.0) and "tp 8 scaled from tp 4" in far.notes


def test_a_missing_recompute_policy_is_derived_from_the_none_rows():
    p = _profile(_row(256, 1e-3, 2e-3))
    full = p.lookup("cpu", "layer", 1, 256, 64, "full")
    assert (full.fwd_s, full.bwd_s) == pytest.approx((1e-3, 3e-3))  # backward + a forward
    assert "full derived from the 'none' rows" in full.notes
    measured = _profile(_row(256, 1e-3, 2e-3), _row(256, 1e-3, 3.5e-3, recompute="full"))
    assert measured.lookup("cpu", "layer", 1, 256, 64, "full").bwd_s == pytest.approx(3.5e-3)


def test_the_file_round_trips_and_bad_files_say_what_is_wrong(tmp_path):
    p = _profile(_row(128, 1e-3, 2e-3, peak_bytes=1e6, kept_bytes=4e5, spread=0.02))
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(p.to_dict()))
    assert load_profile(str(path)) == p
    bad = p.to_dict()
    bad["rows"][0]["piece"] = "block"
    path.write_text(json.dumps(bad))
    with pytest.raises(PlanError, match="piece 'block'; choose one of layer, embedding, head"):
        load_profile(str(path))
    bad = p.to_dict()
    bad["rows"][0]["fwd_ms"] = 1.0
    path.write_text(json.dumps(bad))
    with pytest.raises(PlanError, match="unknown field.*fwd_ms"):
        load_profile(str(path))
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(PlanError, match="not a hetjax compute profile"):
        load_profile(str(path))


def _layout(**kw):
    return Layout(**{**dict(pp=1, dp=8, tp=1, microbatches=1, global_batch=32, seq_len=64), **kw})


def test_the_cost_model_prices_a_layer_from_the_profile_tp_collectives_included():
    t = preset("cpu_single")
    tok = 32 / 8 * 64  # tokens per device per micro-batch
    p = _profile(_row(int(tok), 3e-3, 7e-3), _row(int(tok), 2e-3, 5e-3, tp=2),
                 ProfileRow("cpu", "head", 1, int(tok), 64, 1e-3, 2e-3),
                 ProfileRow("cpu", "head", 2, int(tok), 64, 0.6e-3, 1.2e-3))
    cm = CostModel(t, MODEL, CostOptions(profile=p))
    (c,) = cm.stage_costs(_layout())
    assert (c.fwd_layer, c.bwd_layer) == pytest.approx((3e-3, 7e-3))
    assert (c.fwd_fixed, c.bwd_fixed) == pytest.approx((1e-3, 2e-3))
    (c2,) = cm.stage_costs(_layout(dp=4, tp=2, global_batch=16))
    assert (c2.fwd_layer, c2.bwd_layer) == pytest.approx((2e-3, 5e-3))  # no all-reduce added
    pred = cm.predict(_layout().with_plan((4,)))
    assert pred.compute_source == "profile" and pred.extrapolation == 1.0
    assert pred.step_time == pytest.approx(4 * (3e-3 + 7e-3) + 3e-3, rel=0.05)


def test_without_a_profile_the_flat_model_prices_and_says_so():
    t = preset("cpu_single")
    flat = CostModel(t, MODEL).predict(_layout().with_plan((4,)))
    assert flat.compute_source == "flat"
    assert flat.as_dict()["compute_source"] == "flat" and flat.step_band > 0
    # a profile of another accelerator kind leaves this one to the flat model
    other = _profile(dataclasses.replace(_row(256, 1e-3, 2e-3), accelerator="h100"))
    assert CostModel(t, MODEL, CostOptions(profile=other)).predict(
        _layout().with_plan((4,))).compute_source == "flat"
    # a profile of another model shape prices nothing
    wide = dataclasses.replace(_profile(_row(256, 1e-3, 2e-3)),
                               model={**ComputeProfile.of_model(MODEL), "d_model": 128})
    assert wide.mismatch(MODEL) == "measured on d_model 128 (the model has 64)"
    assert CostModel(t, MODEL, CostOptions(profile=wide)).predict(
        _layout().with_plan((4,))).compute_source == "flat"


def test_the_band_grows_with_the_spread_and_the_extrapolation():
    t = preset("cpu_single")
    near = _profile(_row(256, 3e-3, 7e-3, spread=0.05))
    plan_ = _layout().with_plan((4,))
    inside = CostModel(t, MODEL, CostOptions(profile=near)).predict(plan_)
    assert inside.step_band / inside.step_time == pytest.approx(
        math.hypot(band.PROFILE_STEP_ERROR, 0.05))
    far = _profile(_row(64, 3e-3 / 4, 7e-3 / 4, spread=0.05))  # tokens 4x beyond
    out = CostModel(t, MODEL, CostOptions(profile=far)).predict(plan_)
    assert out.extrapolation == pytest.approx(4.0)
    assert out.step_band / out.step_time == pytest.approx(
        math.sqrt(band.PROFILE_STEP_ERROR ** 2 + 0.05 ** 2 + (band.PER_DOUBLING * 2) ** 2))
    assert out.compute_notes == ("tokens 256 beyond the measured sizes (x4)",)
    assert out.as_dict()["compute_notes"] == list(out.compute_notes)
    flat = CostModel(t, MODEL).predict(plan_)
    assert flat.step_band / flat.step_time == pytest.approx(band.FLAT_STEP_ERROR)


def test_a_calibration_is_a_profile_at_tp_1(tmp_path):
    from hetjax.planner.calibrate import Calibration, ComputeRow

    t = preset("cpu_single")
    cal = Calibration(t, MODEL, (ComputeRow("cpu", 2, 64, 1e-3, 2e-3, 1.0, "block"),
                                 ComputeRow("cpu", 2, 64, 1e-3, 3e-3, 1.0, "staged:full"),
                                 ComputeRow("cpu", 2, 64, 5e-4, 1e-3, 1.0, "head")), ())
    prof = cal.profile()
    assert prof.lookup("cpu", "layer", 1, 128, 64).fwd_s == pytest.approx(1e-3)
    assert prof.lookup("cpu", "layer", 1, 128, 64, "full", pipelined=True).bwd_s == \
        pytest.approx(3e-3)
    assert prof.lookup("cpu", "head", 1, 128, 64).bwd_s == pytest.approx(1e-3)
    extra = ProfileRow("cpu", "layer", 2, 128, 64, 0.6e-3, 1.2e-3, peak_bytes=1e6)
    cal = dataclasses.replace(cal, profile_rows=(extra,))
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))).profile_rows == (extra,)
    assert cal.options().profile.lookup("cpu", "layer", 2, 128, 64).fwd_s == \
        pytest.approx(0.6e-3)


def test_a_profile_of_another_shape_in_the_config_is_refused(tmp_path):
    from hetjax.config import base_config
    from hetjax.errors import ConfigError
    from hetjax.planner import options_from_config

    c = base_config()
    wide = ComputeProfile((_row(256, 1e-3, 2e-3),), {"d_model": 1, "n_heads": 1,
                                                      "n_kv_heads": 1, "d_ff": 1,
                                                      "vocab_size": 1})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(wide.to_dict()))
    c.planner.profile = str(path)
    with pytest.raises(ConfigError, match="planner.profile.*measured on d_model 1"):
        options_from_config(c)


def test_plan_uses_a_profile_file(tmp_path):
    """A plan priced from a profile says so and the planner still chooses."""
    from hetjax.planner import plan

    t = preset("cpu_single")
    tok = 32 / 8 * 64
    p = _profile(_row(int(tok), 3e-3, 7e-3), _row(int(tok) * 4, 9e-3, 21e-3))
    best = plan(t, MODEL, 32, 64, pp=1, options=CostOptions(profile=p)).plan
    assert best.predicted["compute_source"] in ("profile", "profile + flat cpu")
    assert best.predicted["step_band_s"] > 0
    assert isinstance(Plan.from_json(best.to_json()), Plan)


def test_calibrate_measures_the_layer_at_each_tp_degree_a_node_allows():
    """`hetjax calibrate` splits the layer over 2 devices (Megatron's split, its
    collectives included) and reports forward, backward, spread and XLA's temporary bytes."""
    import jax

    from hetjax import measure

    assert measure.tp_degrees(MODEL, 8, 8) == (2,)  # 2 key/value heads: tp 4 cannot split
    assert measure.tp_degrees(dataclasses.replace(MODEL, n_kv_heads=4), 8, 8) == (2, 4)
    assert measure.tp_degrees(MODEL, 1, 8) == ()
    lines = []
    measure._PROGRESS = measure.Progress(out=lines.append)
    measure._PROGRESS.start(2, repeats=1, min_sample_s=0.0, compile_s=0.5)
    try:
        (row,) = measure.measure_tp_layers(MODEL, jax.devices()[:4], "cpu", (2,), (1,), (16,),
                                           repeats=1, min_sample_s=0.0)
    finally:
        measure._PROGRESS = None
    assert (row.piece, row.tp, row.tokens, row.seq_len) == ("layer", 2, 16, 16)
    assert row.fwd_s > 0 and row.bwd_s > 0 and row.peak_bytes > 0
    assert "cpu layer tp=2 b=1 s=16 forward" in lines[1]


def test_hetjax_plan_prints_the_band_and_what_priced_the_compute(tmp_path, capsys):
    from hetjax.cli import main

    p = _profile(_row(256, 3e-3, 7e-3, spread=0.05))
    p = dataclasses.replace(p, model={"d_model": 128, "n_heads": 4, "n_kv_heads": 2,
                                      "d_ff": 384, "vocab_size": 384})
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(p.to_dict()))
    common = ["hetjax", "plan", "--config.parallel.pp=1", "--config.parallel.tp=1",
              "--config.train.microbatches=1"]
    assert main([*common, f"--config.planner.profile={path}"]) == 0
    out = capsys.readouterr().out
    assert " ± " in out and "(compute: profile)" in out
    assert "compute priced from a measured profile" in out
    assert "beyond the measured sizes" in out  # the profile's 256 tokens; the plan asks more
    assert main(common) == 0
    assert "(compute: flat)" in capsys.readouterr().out


def test_measured_stash_and_peak_replace_the_fitted_activation_terms():
    """A profile whose pipelined layer rows carry what the forward keeps and the backward's
    peak (calibrate's staged rows) prices a pipelined stage's activations from them: the
    kept bytes per micro-batch in flight and the rest of the peak once."""
    t = preset("cpu_single")
    model = dataclasses.replace(MODEL, remat="full")
    p = Plan(pp=2, dp=4, tp=1, stage_layers=(2, 2), microbatches=2, global_batch=16,
             seq_len=64)
    lay = Layout.of(p)
    tok = int(lay.tokens_per_device())
    rows = [_row(tok, 1e-3, 3e-3, recompute="full", pipelined=True, kept_bytes=1e5,
                 peak_bytes=4e5)]
    for executor in ("mpmd", "spmd"):
        plain = CostModel(t, model, CostOptions(executor=executor))
        measured = CostModel(t, model, CostOptions(executor=executor, profile=_profile(*rows)))
        a, b = plain.stage_costs(lay)[0], measured.stage_costs(lay)[0]
        if executor == "mpmd":
            assert b.mem_layer == pytest.approx(1e5 * 2)  # 2 micro-batches in flight, stage 0
        else:
            assert b.mem_slot - a.mem_slot == pytest.approx(
                2 * (1e5 - plain.activation_bytes_per_token(1, 64, "full", True) * tok))
        assert b.mem_measured and not a.mem_measured
    # the memory band is then the profile's spread (0 here), not the fitted terms' 10%
    assert CostModel(t, model, CostOptions(executor="mpmd", profile=_profile(*rows))).predict(
        p).memory_band == 0.0
