"""Config loading, validation messages (one per user mistake), and the CLI as a subprocess."""

import os
import subprocess
import sys

import pytest

from conftest import REPO, tiny_config
from hetjax import config as hconfig
from hetjax.config import load_config, validate
from hetjax.errors import ConfigError, HetjaxError
from hetjax.planner import plan_from_config

DEFAULT = os.path.join(REPO, "configs", "default.py")


def test_default_config_file_loads_with_overrides():
    c = load_config(DEFAULT, ["--config.train.steps=7", "--config.model.n_layers=6",
                              "--config.pipeline.stage_layers=(4,2)",
                              "--config.parallel.pp=2"])
    assert c.train.steps == 7 and c.model.n_layers == 6
    assert tuple(c.pipeline.stage_layers) == (4, 2)
    validate(c)


def test_the_last_override_of_a_field_wins():
    """absl appends a repeated tuple flag; a later --config flag must replace the earlier."""
    c = load_config(DEFAULT, ["--config.pipeline.stage_layers=(1,3)",
                              "--config.train.steps=3", "--config.train.steps=5",
                              "--config.pipeline.stage_layers=(1,1,1,1)"])
    assert tuple(c.pipeline.stage_layers) == (1, 1, 1, 1) and c.train.steps == 5


def test_unknown_override_field_is_reported():
    with pytest.raises(HetjaxError) as e:
        load_config(DEFAULT, ["--config.train.stepz=7"])
    assert str(e.value) == ("config.train.stepz: is not a hetjax config field\n"
                            "  fix: did you mean train.steps?")


# (overrides, field named in the error, words of the fix)
MISTAKES = [
    ({"topology.preset": "nonesuch"}, "topology.preset", "choose one of"),
    ({"topology.file": "/no/such/topology.json"}, "topology.file", "JSON topology"),
    ({"topology.devices_per_node": -1}, "topology.devices_per_node", "0 keeps the preset"),
    ({"train.lr": -0.1}, "train.lr", "value > 0"),
    ({"train.seq_len": 128}, "train.seq_len", "raise model.max_seq_len"),
    ({"train.steps": 0}, "train.steps", "positive integer"),
    ({"train.warmup_steps": 10}, "train.warmup_steps", "10% of the steps"),
    ({"train.batch_size": 15, "train.microbatches": 2}, "train.batch_size", "multiple of 2"),
    ({"train.grad_clip": -1.0}, "train.grad_clip", "0 to disable"),
    ({"train.b2": 1.0}, "train.b2", "0.95"),
    ({"model.d_model": 66}, "model.d_model", "multiple of n_heads"),
    ({"model.d_model": 36, "model.n_heads": 4, "model.n_kv_heads": 1}, "model.d_model",
     "d_model / n_heads even"),
    ({"model.n_kv_heads": 3}, "model.n_kv_heads", "divisors of 4"),
    ({"model.dtype": "float8"}, "model.dtype", "float32, bfloat16"),
    ({"model.remat": "some"}, "model.remat", "none, full, dots"),
    ({"data.source": "web"}, "data.source", "stdlib, files, synthetic"),
    ({"data.source": "files"}, "data.path", "directory or glob"),
    ({"parallel.tp": 3}, "parallel.tp", "common divisors"),
    ({"parallel.pp": -1}, "parallel.pp", "0 for automatic"),
    ({"pipeline.schedule": "zigzag"}, "pipeline.schedule", "gpipe, 1f1b"),
    ({"pipeline.stage_layers": (1, 2)}, "pipeline.stage_layers", "sum to 2"),
    ({"pipeline.stage_layers": (2, 0)}, "pipeline.stage_layers", ">= 1 layer"),
    ({"pipeline.stage_layers": (1, 1), "parallel.pp": 4}, "pipeline.stage_layers",
     "give 4 numbers"),
    ({"pipeline.microbatches": 4, "train.microbatches": 2}, "pipeline.microbatches",
     "set only one"),
    ({"zero.preset": "zero4"}, "zero.preset", "ddp, zero1"),
    ({"data.tokenizer": "/no/such/tok.model"}, "data.tokenizer", "hetjax tokenizer train"),
    ({"data.eval_fraction": 0.9}, "data.eval_fraction", "use 0.01"),
    ({"data.prefetch": 0}, "data.prefetch", "positive integer"),
    ({"data.threads": 0}, "data.threads", "positive integer"),
    ({"eval.batches": 0}, "eval.batches", "positive integer"),
    ({"eval.every": -1}, "eval.every", "0 turns it off"),
    ({"checkpoint.every": -5}, "checkpoint.every", "0 turns it off"),
    ({"checkpoint.keep": 0}, "checkpoint.keep", "positive integer"),
    ({"checkpoint.keep_best": -1}, "checkpoint.keep_best", "0 turns it off"),
    ({"checkpoint.keep_best": 1, "checkpoint.every": 0}, "checkpoint.keep_best",
     "checkpoint.every > 0"),
    ({"checkpoint.keep_best": 1, "eval.every": 30}, "checkpoint.keep_best",
     "divisor of 100"),
    ({"planner.memory_margin": 1.0}, "planner.memory_margin", "use 0.1"),
    ({"planner.calibration": "/no/such/calibration.json"}, "planner.calibration",
     "hetjax calibrate"),
    ({"planner.compute": "roofline"}, "planner.compute", "'kinds'"),
    ({"parallel.pp": 4, "model.n_layers": 2, "parallel.dp": 0}, "parallel.pp",
     "at most 2 stages"),
    # per-stage degrees and devices left out
    ({"parallel.stage_tp": (2, 0)}, "parallel.stage_tp", "[2,1]"),
    ({"parallel.exclude": (3, 3)}, "parallel.exclude", "give each rank once"),
    ({"parallel.pp": 2, "parallel.stage_dp": (1, 2), "parallel.stage_tp": (2, 1, 1)},
     "parallel.stage_tp", "one number per stage in both"),
    ({"parallel.stage_tp": (2, 1)}, "parallel.pp", "--config.parallel.pp=2"),
    ({"parallel.pp": 2, "parallel.stage_tp": (2, 4), "pipeline.executor": "mpmd"},
     "parallel.stage_tp", "common divisors"),
    ({"parallel.pp": 2, "parallel.stage_tp": (2, 1)}, "pipeline.executor",
     "--config.pipeline.executor=mpmd"),
    ({"parallel.pp": 2, "parallel.stage_tp": (2, 1), "pipeline.executor": "mpmd",
      "zero.preset": "auto"}, "zero.preset", "choose zero.preset yourself"),
    ({"parallel.exclude": (7,), "diloco.inner_steps": 10}, "parallel.exclude",
     "diloco.inner_steps=0"),
]


@pytest.mark.parametrize("overrides, field, fix", MISTAKES,
                         ids=[m[1] + ":" + ",".join(map(str, m[0].values())) for m in MISTAKES])
def test_each_mistake_names_its_field_and_fix(overrides, field, fix):
    c = tiny_config(**overrides)
    with pytest.raises(ConfigError) as e:
        validate(c)
        hconfig.build_topology(c)
    assert e.value.field == field
    assert f"config.{field}" in str(e.value) and fix in str(e.value)


# Mistakes that need the topology (8 devices on the default cpu_hybrid preset).
LAYOUT_MISTAKES = [
    ({"parallel.dp": 3}, "parallel.dp", "from [1, 2, 4, 8]"),
    ({"parallel.pp": 2, "parallel.dp": 2, "parallel.tp": 1}, "parallel", "product is 8"),
    ({"parallel.tp": 2, "train.batch_size": 4, "train.microbatches": 2}, "train.batch_size",
     "multiple of microbatches x dp = 8"),
    ({"parallel.exclude": (8,)}, "parallel.exclude", "list ranks of this topology"),
    ({"parallel.pp": 2, "parallel.dp": 2, "parallel.tp": 1, "parallel.exclude": (6, 7)},
     "parallel", "product is 6"),  # 4 devices on the 6 left
    ({"parallel.pp": 2, "parallel.stage_dp": (1, 2), "parallel.stage_tp": (2, 1),
      "pipeline.executor": "mpmd"}, "parallel", "leave the others out with parallel.exclude"),
    ({"parallel.pp": 2, "parallel.stage_dp": (2, 4), "parallel.stage_tp": (2, 1),
      "pipeline.executor": "mpmd", "train.batch_size": 12, "train.microbatches": 2},
     "train.batch_size", "least common multiple 4"),
    ({"parallel.pp": 0, "parallel.exclude": (6, 7)}, "parallel.exclude", "fix the layout too"),
]


@pytest.mark.parametrize("overrides, field, fix", LAYOUT_MISTAKES,
                         ids=[m[1] for m in LAYOUT_MISTAKES])
def test_layout_mistakes_name_field_and_fix(overrides, field, fix):
    c = tiny_config(**overrides)
    validate(c)
    with pytest.raises(ConfigError) as e:
        plan_from_config(c, hconfig.build_topology(c))
    assert e.value.field == field and fix in str(e.value)


def test_preset_overrides_reach_the_topology():
    c = tiny_config(**{"topology.nodes": 1, "topology.devices_per_node": 4})
    t = hconfig.build_topology(c)
    assert t.num_devices == 8 and t.clusters[0].devices_per_node == 4


def hetjax_cmd():
    exe = os.path.join(os.path.dirname(sys.executable), "hetjax")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "hetjax"]


def run_cli(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)  # the CLI sizes the device count itself
    return subprocess.run([*hetjax_cmd(), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)


def test_cli_help():
    r = run_cli("--help")
    assert r.returncode == 0
    assert "train" in r.stdout and "usage: hetjax" in r.stdout


def test_cli_bad_config_exits_2_with_message_not_traceback():
    r = run_cli("train", f"--config={DEFAULT}", "--config.train.lr=-1")
    assert r.returncode == 2
    assert "config.train.lr" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow  # README's Python snippet trains the default config in the default tier
def test_cli_trains_default_config_for_five_steps(tmp_path):
    r = run_cli("train", f"--config={DEFAULT}", "--config.train.steps=5",
                f"--config.workdir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "topology 'cpu_hybrid'" in r.stdout and "summary" in r.stdout
    assert os.path.exists(tmp_path / "metrics.jsonl") and os.path.exists(tmp_path / "plan.json")


def test_python_load_config_never_shares_the_commands_workdir():
    """hetjax.load_config (Python, notebooks) puts a run left at the default workdir in
    runs/python, never the `hetjax` command's runs/default; a workdir set anywhere is kept."""
    import hetjax

    assert load_config(DEFAULT).workdir == "runs/default"  # what the CLI reads
    assert hetjax.load_config(DEFAULT).workdir == "runs/python"
    assert hetjax.load_config(DEFAULT, ["--config.workdir=runs/mine"]).workdir == "runs/mine"
    assert hetjax.load_config(DEFAULT, ["--config.workdir=runs/default"]).workdir == \
        "runs/default"


# --- each field is one spec: default, description (--help) and check --------------------------
def test_every_field_is_one_spec_shown_in_help_with_the_owners_names():
    from hetjax.cli import help_text
    from hetjax.planner.zero_factors import CONFIG_PRESETS
    from hetjax.core.registry import EXECUTORS
    from hetjax.core.schedules import SCHEDULES
    from hetjax.core.wire import BOUNDARY_CODECS

    out = help_text("train", None, [])
    flat = " ".join(out.split())  # --help wraps descriptions
    for f in hconfig.fields.FIELDS:
        assert len(f.description()) > 5, f.name
        assert f"{f.name} = " in out, f.name
        assert " ".join(f.description().split()[:4]) in flat, f.name
    d = hconfig.DESCRIPTIONS
    assert " | ".join(SCHEDULES) in d["pipeline.schedule"]
    assert all(name in d["pipeline.executor"] for name in EXECUTORS)
    assert " | ".join(CONFIG_PRESETS) in d["zero.preset"]
    assert all(name in d["pipeline.boundary_codec"] for name in BOUNDARY_CODECS)
    # the notes of a name set describe names of that set, never others
    for f in hconfig.fields.FIELDS:
        if isinstance(f.check, hconfig.Choices):
            assert set(f.check.notes) <= set(f.check.options()), f.name
    assert hconfig.PATH_FIELDS == tuple(f.name for f in hconfig.fields.FIELDS if f.path)


def test_a_field_added_as_one_spec_gets_its_default_help_line_and_check(monkeypatch):
    from hetjax.cli import help_text

    spec = hconfig.Field("train.patience", 5, "evaluations without improvement before the run "
                         "stops", hconfig.positive_int())
    monkeypatch.setattr(hconfig.fields, "FIELDS", hconfig.fields.FIELDS + (spec,))
    assert hconfig.base_config().train.patience == 5
    assert load_config(None, ["--config.train.patience=7"]).train.patience == 7
    out = help_text("train", None, [])
    assert "train.patience = 5" in out and "evaluations without improvement" in out
    validate(tiny_config())
    with pytest.raises(ConfigError) as e:
        validate(tiny_config(**{"train.patience": 0}))
    assert str(e.value) == ("config.train.patience: must be a positive integer, got 0\n"
                            "  fix: set --config.train.patience=5")


def test_a_bound_says_its_range_and_a_choice_its_names():
    lr = hconfig.Bound(lo=0, hi=1, hi_open=True, fix="use 0.1")
    assert lr("planner.memory_margin", 0.5) is None
    assert lr("planner.memory_margin", 1.0) == ("must be in [0, 1), got 1.0", "use 0.1")
    assert hconfig.Bound(lo=0, integer=True)("eval.every", 2.5) == (
        "must be an integer >= 0, got 2.5", "set --config.eval.every=0")
    pick = hconfig.Choices(("a", "b"), "letter", {"a": "the first"})
    assert pick("x", "b") is None and pick("x", "c") == ("unknown letter 'c'", "choose one of a, b")
    assert pick.render() == "a (the first) | b"
