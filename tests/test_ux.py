"""The terminal and notebook experience: run history and loss plot, the re-run message, help
text, plan output in human units, launch output lines, HTML displays."""

import os

import numpy as np
import pytest

from conftest import tiny_config
from hetjax.history import History
from hetjax.train import Trainer


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 12-step run with evaluation and checkpoints, and its summary."""
    workdir = str(tmp_path_factory.mktemp("run"))
    config = tiny_config(**{"train.steps": 12, "train.log_every": 3, "eval.every": 6,
                            "checkpoint.every": 6, "workdir": workdir})
    return config, Trainer(config, quiet=True).train()


def test_train_returns_the_history_as_columns_and_reads_it_back(finished_run):
    config, summary = finished_run
    cols = summary.history.columns()
    assert list(cols["step"]) == [1, 3, 6, 9, 12]
    assert cols["loss"].dtype == np.float64 and np.isfinite(cols["loss"]).all()
    assert cols["loss"][-1] == summary["final_loss"]
    # eval_loss exists on evaluation rows only; the others hold NaN so columns line up.
    assert list(np.isfinite(cols["eval_loss"])) == [False, False, True, False, True]
    assert np.isnan(cols["tokens_per_s"][0]) and (cols["tokens_per_s"][1:] > 0).all()
    again = History.load(config.workdir).columns()
    assert set(again) == set(cols)
    np.testing.assert_array_equal(again["loss"], cols["loss"])


def test_the_end_of_a_run_writes_the_loss_plot_and_the_summary_names_it(finished_run):
    config, summary = finished_run
    png = os.path.join(config.workdir, "loss.png")
    assert summary["plot"] == os.path.abspath(png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"loss curve            {summary['plot']}" in str(summary)
    assert "<table>" in summary._repr_html_() and "data:image/png;base64," in \
        summary._repr_html_()


def test_rerunning_a_finished_run_says_it_is_complete_and_at_which_step(finished_run, capsys):
    config, summary = finished_run
    again = Trainer(config).train()
    out = capsys.readouterr().out
    assert "run complete at step 12 of 12 (checkpoint 12); nothing to train" in out
    assert "tokens/s" not in out  # no empty timing summary
    assert again["complete"] and again["steps"] == 12
    assert again["final_loss"] == summary["final_loss"]
    assert len(again.history) == len(summary.history)


# --- hetjax <command> --help -------------------------------------------------------------------
def cli_out(capsys, *argv) -> str:
    from hetjax import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["hetjax", *argv])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_every_config_field_has_a_description():
    from hetjax.cli import _flat
    from hetjax.config import DESCRIPTIONS, base_config

    fields = [k for k, _ in _flat(base_config())]
    assert sorted(fields) == sorted(DESCRIPTIONS)
    assert all(len(d) > 5 for d in DESCRIPTIONS.values())


def test_help_describes_each_field_with_the_values_of_the_config_given(capsys):
    out = cli_out(capsys, "train", "--help")  # no --config: the default job
    assert "values of configs/default.py" in out
    assert " *parallel.pp = 2 " in out and "(base default: 1)" in out
    assert "   parallel.dp = 0 " in out  # as the base default: not marked
    assert "train.steps = 300" in out and "optimizer steps of the run" in out
    assert "pipeline.stage_layers = ()" in out and "!!python" not in out
    assert max(map(len, out.splitlines())) <= 100
    out = cli_out(capsys, "plan", "--config=configs/holmes_mini.py",
                  "--config.pipeline.stage_layers=(3,1)", "--help")
    assert "values of configs/holmes_mini.py and --config.pipeline.stage_layers=(3,1)" in out
    assert "*pipeline.stage_layers = (3, 1)" in out


def test_train_without_config_runs_the_default_job():
    from hetjax import cli

    assert cli._parse("train", []).to_dict() == \
        cli._parse("train", ["--config=configs/default.py"]).to_dict()
    assert cli._parse("train", []).parallel.pp == 2


def test_plan_without_config_searches_the_layout():
    """`hetjax plan` without --config: the default job with pp and tp left to the planner (on
    a preset whose nodes hold one device the job's tp = 2 cannot fit); with --config the
    file's fixed layout is priced as written, and overrides still win."""
    from hetjax import cli

    searched = cli._parse("plan", [], search_without_config=True)
    assert (searched.parallel.pp, searched.parallel.tp) == (0, 0)
    fixed = cli._parse("plan", ["--config=configs/default.py"], search_without_config=True)
    assert (fixed.parallel.pp, fixed.parallel.tp) == (2, 2)
    assert cli._parse("plan", ["--config.parallel.tp=2"],
                      search_without_config=True).parallel.tp == 2
    # The documented commands on the dtfm_* presets run in tests/test_docs.py.


# --- hetjax plan: runners-up, units, large topologies, the plot -------------------------------
def test_units_read_like_a_person_writes_them():
    from hetjax import units

    assert units.seconds(49e-3) == "49 ms" and units.seconds(4.9e-5) == "49 \u00b5s"
    assert units.seconds(0.3536) == "354 ms" and units.seconds(2.5) == "2.5 s"
    assert units.bits_per_s(2e11) == "200 Gb/s" and units.bytes_per_s(1.97e10) == "19.7 GB/s"
    assert units.gib(2**31) == "2 GiB" and units.gib(2**24) == "16 MiB"
    # Tiny shares keep their digits instead of rounding to 0.0%.
    assert units.percent(3.4e-6) == "0.00034%" and units.percent(0.385, 3) == "38.5%"
    assert units.count(1, "layer") == "1 layer" and units.count(3, "layer") == "3 layers"


def test_plan_prints_runners_up_in_human_units_and_plots(capsys, tmp_path):
    from hetjax import cli

    png = tmp_path / "plan.png"
    assert cli.main(["hetjax", "plan", "--config.parallel.pp=0", "--config.parallel.tp=0",
                     "--config.parallel.dp=0", f"--plot={png}"]) == 0
    out = capsys.readouterr().out
    assert "the chosen plan (#0) and the runners-up:" in out
    table = out.split("runners-up:\n")[1].splitlines()
    assert table[0].split()[:3] == ["#", "pp", "x"] and table[1].split()[0] == "0"
    assert len([line for line in table if line.strip()[:1].isdigit()]) >= 2
    assert "50 \u00b5s" in out and "us " not in out and "Gb/s" in out  # link latency, rate
    assert " ms" in out and "MFU" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


MIXED_CLUSTER = {  # four A100 on NVLink and two L40S on PCIe, 25 Gb/s between
    "name": "mixed",
    "clusters": [{"name": "a100ib", "nodes": 1, "devices_per_node": 4, "accelerator": "a100_80gb",
                  "intra_node": "nvlink3"},
                 {"name": "l40s", "nodes": 1, "devices_per_node": 2, "accelerator": "l40s",
                  "intra_node": "pcie4"}],
    "inter_cluster": "eth_25g"}


@pytest.mark.slow  # (four searches: the plan and three what-ifs)
def test_plan_says_what_the_step_is_made_of_and_what_if(capsys, tmp_path):
    """On a user's mixed cluster `hetjax plan` splits the step into its parts (naming the
    largest), prices a faster slow link and better devices with the planner, lists the devices
    it leaves out and why, and its runners-up are distinct layouts."""
    import json

    from hetjax import cli

    topo = tmp_path / "mixed.json"
    topo.write_text(json.dumps(MIXED_CLUSTER))
    assert cli.main(["hetjax", "plan", f"--config.topology.file={topo}",
                     "--config.model.vocab_size=32000",
                     "--config.model.d_model=2048", "--config.model.n_heads=16",
                     "--config.model.n_kv_heads=8", "--config.model.d_ff=5632",
                     "--config.model.max_seq_len=1024", "--config.train.batch_size=8",
                     "--config.train.seq_len=1024"]) == 0
    out = capsys.readouterr().out
    step = " ".join(out.split("predicted (rank order): step ")[1].split()[:2])  # "16.1 ms"
    assert f"the predicted step ({step}) is made of:" in out
    parts = out.split("is made of:\n")[1].split("\nwhat if")[0].splitlines()
    for name in ("compute", "bubble", "stage imbalance", "exposed DP/ZeRO sync",
                 "boundary transfers", "recompute"):
        assert any(line.strip().startswith(name) for line in parts), name
    assert sum("<- largest" in line for line in parts) == 1
    assert "  the 25 Gb/s ethernet link between a100ib and l40s at 100 Gb/s: step " in out
    assert "  the 4 a100_80gb devices at 362 TFLOP/s: step " in out
    assert "unused: ranks 4-5 (l40s): behind a 25 Gb/s ethernet link" in out
    table = out.split("runners-up:\n")[1].splitlines()[1:]
    layouts = [" ".join(row.split()[1:6]) for row in table if row.strip()[:1].isdigit()]
    assert len(layouts) >= 2 and len(set(layouts)) == len(layouts)


def test_a_64_device_topology_prints_compactly():
    from hetjax.core.topology import preset

    text = preset("dtfm_worldwide").describe()
    assert len(text.splitlines()) < 16 and max(map(len, text.splitlines())) <= 100
    assert "28 ethernet links: 335 Mb/s to 1.16 Gb/s, latency 11 ms to 238 ms" in text
    assert "slowest seoul <-> ireland" in text
    spot = preset("dtfm_datacenter_spot").describe()
    assert "gpu0 .. gpu31 (32 clusters)" in spot and len(spot.splitlines()) < 8
    assert len(preset("dtfm_datacenter_spot").describe(full=True).splitlines()) > 40
    one = preset("cpu_single").describe()
    assert one.startswith("topology 'cpu_single': 1 cluster, 1 node, 8 devices")
    assert "between clusters" not in one


def test_hetjax_topology_json_writes_a_file_a_person_can_edit_and_read_back(tmp_path, capsys):
    """`hetjax topology --json PATH` writes the config's topology as a topology file (catalogue
    names), checks PATH before the work, `--json -` prints only the file; a hand edit with a
    typo is refused by the CLI in one error naming the JSON path."""
    import json

    from hetjax import cli

    assert cli.main(["hetjax", "topology", "--json", "-",
                     "--config.topology.preset=holmes_hybrid"]) == 0
    d = json.loads(capsys.readouterr().out)  # nothing but the file
    assert d["clusters"][0]["accelerator"] == "a100" and d["inter_cluster"] == "eth_25g"
    assert cli.main(["hetjax", "topology", f"--json={tmp_path}"]) == 2
    assert "is a directory; fix: give a file name, e.g. --json=" in capsys.readouterr().err
    d["clusters"][1]["accelerator"] = "a100-80"
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(d))
    assert cli.main(["hetjax", "topology", f"--config.topology.file={path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hetjax: error: config.topology.file: '{path}': clusters[1]."
                          "accelerator: unknown accelerator 'a100-80' (did you mean "
                          "'a100_80gb'?)\n  fix: use a catalogue name (a10, a100, a100_40gb")
    assert len(err.splitlines()) == 2  # the config error's line and its fix
    d["clusters"][1]["accelerator"] = "a100_80gb"
    path.write_text(json.dumps(d))
    out = tmp_path / "again.json"
    assert cli.main(["hetjax", "topology", f"--config.topology.file={path}", "--json",
                     str(out)]) == 0
    assert "a100_80gb 312TF 80GiB" in capsys.readouterr().out
    assert json.loads(out.read_text())["clusters"][1]["accelerator"] == "a100_80gb"


def test_plan_plot_labels_only_what_fits_and_ends_at_the_step_time():
    from hetjax.planner import model_from_config, plan_from_config
    from hetjax.planner.cost import CostModel
    from hetjax.planner.plot import plan_figure
    from hetjax.core.topology import preset

    config = tiny_config(**{"topology.preset": "hethub_mixed", "parallel.pp": 2,
                            "parallel.dp": 4, "parallel.tp": 2, "model.n_layers": 8,
                            "pipeline.stage_layers": (7, 1), "train.microbatches": 4})
    topology = preset("hethub_mixed")
    plan = plan_from_config(config, topology)
    model = model_from_config(config)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = plan_figure(plan, topology, model)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    device_map, timeline = fig.axes[:2]
    step = CostModel(topology, model).predict(plan).step_time
    assert timeline.get_xlim()[1] == pytest.approx(step * 1e3)  # in ms, to the step time
    assert timeline.get_xlabel() == "time (ms)"
    # No two drawn labels overlap, in either panel.
    renderer = canvas.get_renderer()
    for ax in (device_map, timeline):
        boxes = [t.get_window_extent(renderer) for t in ax.texts]
        assert boxes
        for i, a in enumerate(boxes):
            assert not any(a.overlaps(b) for b in boxes[i + 1:])
    labelled = [t for t in timeline.texts if t.get_text()[:1] in "FB"]
    assert 0 < len(labelled) < 2 * plan.pp * plan.microbatches  # the narrow ones were dropped
    # TP groups are outlined: one box per (stage, replica) = pp * dp.
    assert len(device_map.patches) == plan.pp * plan.dp


def test_the_device_map_of_per_stage_shapes_says_which_devices_are_left_out():
    """A plan the cost model does not price (per-stage shapes) is drawn as its device map
    alone: each stage's own replicas, its TP pair outlined, the idle devices marked."""
    from hetjax.core.plan import Plan
    from hetjax.core.topology import preset
    from hetjax.planner import model_from_config
    from hetjax.planner.plot import plan_figure

    plan = Plan(pp=2, dp=0, tp=0, stage_layers=(1, 1), microbatches=2, global_batch=8,
                seq_len=16, executor="mpmd", stage_shapes=((1, 2), (2, 1)),
                device_order=(0, 1, 4, 5))
    (ax,) = plan_figure(plan, preset("cpu_hybrid"), model_from_config(tiny_config())).axes[:1]
    texts = sorted(t.get_text() for t in ax.texts)
    assert texts == ["s0", "s0", "s1 r0", "s1 r1"] + ["unused"] * 4
    assert len(ax.patches) == 1  # stage 0's TP pair
    assert "pp=2 dp,tp per stage: 1x2 2x1" in ax.get_title()


# --- launch output ----------------------------------------------------------------------------
def test_launch_prefixes_every_worker_line_and_hides_gloo_noise():
    import io
    import sys

    from hetjax import supervise

    script = ("import sys\n"
              "print('step 1 loss 5.0', flush=True)\n"
              "sys.stderr.write('[Gloo] Rank 0 is connected to 1 peer ranks. Expected number "
              "of connected peer ranks is : 1\\n'); sys.stderr.flush()\n"
              "sys.stderr.write('train: 10%\\rtrain: 50%\\rtrain: 100%\\n'); sys.stderr.flush()\n"
              "print('summary', flush=True)\n")
    children = [(f"p{i}", (sys.executable, "-c", script), None) for i in range(2)]
    for verbose in (False, True):
        out = io.StringIO()
        assert supervise.run(children, grace=5, out=out, verbose=verbose) == 0
        lines = out.getvalue().splitlines()
        worker = [line for line in lines if not line.startswith("hetjax launch:")]
        assert all(line.startswith(("[p0] ", "[p1] ")) for line in worker)
        for p in ("p0", "p1"):
            assert f"[{p}] step 1 loss 5.0" in lines and f"[{p}] summary" in lines
            assert f"[{p}] train: 100%" in lines  # a redrawn bar: its last state
            assert (f"[{p}] [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of "
                    "connected peer ranks is : 1" in lines) == verbose
        assert ("hetjax launch: hid 2 gloo connection lines (--verbose shows them)"
                in lines) == (not verbose)


# --- notebook display -------------------------------------------------------------------------
# What tfds prints while preparing files that are already on disk, and absl's warning about it.
TFDS_NOISE = ("Downloading and preparing dataset", "Generating splits", "has no dataset_info.json",
              "downloaded and prepared to")


@pytest.mark.slow  # two trainings, each compiling its step (the noise itself: test_data.py)
def test_a_training_on_files_hides_tfds_noise_unless_verbose(tmp_path, capfd, caplog,
                                                             monkeypatch):
    from hetjax import cli
    from hetjax.noise import ENV_VERBOSE

    monkeypatch.setenv(ENV_VERBOSE, "0")  # restored after the test (--verbose sets it)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text(f"document {i}: " + "some words to train on " * 20)
    tiny = ["--config.topology.preset=cpu_single", "--config.topology.nodes=1",
            "--config.topology.devices_per_node=1", "--config.model.d_model=32", "--config.model.n_layers=1", "--config.model.d_ff=64",
            "--config.model.n_heads=2", "--config.model.n_kv_heads=1", "--config.parallel.pp=1",
            "--config.parallel.tp=1", "--config.train.microbatches=1", "--config.train.steps=1",
            "--config.train.seq_len=16", "--config.train.batch_size=8", "--config.eval.every=0",
            "--config.checkpoint.every=0", "--config.tensorboard=false",
            "--config.model.dtype=float32", "--config.data.source=files",
            f"--config.data.path={corpus}"]
    outputs = {}
    for verbose in (False, True):  # a fresh data.dir each: the corpus is prepared each time
        flags = [f"--config.data.dir={tmp_path / f'tfds{verbose}'}",
                 f"--config.workdir={tmp_path / f'run{verbose}'}"] + ["--verbose"] * verbose
        assert cli.main(["hetjax", "train", *tiny, *flags]) == 0
        out, err = capfd.readouterr()
        outputs[verbose] = out + err + caplog.text  # absl's records reach pytest's handler
        caplog.clear()
    quiet, loud = outputs[False], outputs[True]
    assert not [n for n in TFDS_NOISE if n in quiet], quiet
    assert all(n in loud for n in TFDS_NOISE), loud
    for out in (quiet, loud):  # hetjax's own lines say what happens, either way
        assert "hetjax: preparing the corpus (4 files) once into" in out
        assert "step      1/1" in out and "summary" in out


def test_launch_verbose_makes_its_workers_verbose_too(capsys):
    from hetjax import launch

    for verbose in (False, True):
        assert launch.main(["--local", "2", "--dry-run", "--config.parallel.pp=1",
                            "--config.parallel.tp=1"] + ["--verbose"] * verbose) == 0
        commands = [line for line in capsys.readouterr().out.splitlines() if " -m hetjax " in line]
        assert len(commands) == 2
        assert all((" -m hetjax train --verbose " in c) == verbose for c in commands), commands


def test_launch_refuses_a_corpus_too_small_before_starting_a_worker(tmp_path, capsys):
    from hetjax import launch
    from hetjax.errors import ConfigError

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(13):
        (corpus / f"{i}.txt").write_text("text " * 100)
    with pytest.raises(ConfigError, match="data.eval_fraction=0.077"):
        launch.main(["--local", "2", "--config.data.source=files", f"--config.data.path={corpus}",
                     "--config.eval.every=10"])
    assert "started p0" not in capsys.readouterr().out


def test_eval_of_a_checkpoint_checks_the_held_out_split_before_opening_it(tmp_path, capsys):
    import json

    from hetjax import cli

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(13):
        (corpus / f"{i}.txt").write_text("text " * 100)
    meta = tmp_path / "run" / "checkpoints" / "5" / "meta"
    meta.mkdir(parents=True)  # what saved_config reads: the run's config (eval.every = 0)
    config = tiny_config(**{"data.source": "files", "data.path": str(corpus)})
    (meta / "metadata").write_text(json.dumps({"config": config.to_dict()}))
    assert cli.main(["hetjax", "eval", f"--checkpoint={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "config.data.eval_fraction: 0.01 of the 13 documents" in err
    assert "--config.data.eval_fraction=0.077" in err


def test_topology_plan_and_history_render_as_html_tables(finished_run):
    from hetjax.planner import plan_from_config
    from hetjax.core.topology import preset

    topology = preset("dtfm_worldwide")
    html = topology._repr_html_()
    assert "<table>" in html and "<td style='text-align:left'>oregon</td>" in html
    assert "28 ethernet links" in html
    config, summary = finished_run
    plan = plan_from_config(config, preset("cpu_hybrid"))
    assert "<table>" in plan._repr_html_()
    h = summary.history._repr_html_()
    assert h.count("<tr>") == len(summary.history) + 1 and "eval_loss" in h


def test_progress_bar_without_ipywidgets_is_the_text_bar(monkeypatch):
    import builtins

    import tqdm

    from hetjax import metrics

    monkeypatch.setattr(metrics, "_in_notebook", lambda: True)
    real_import = builtins.__import__

    def no_widgets(name, *a, **kw):
        if name == "ipywidgets":
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_widgets)
    assert metrics._bar_class() is tqdm.tqdm


def test_a_fresh_process_gets_the_topologys_devices_without_xla_flags():
    import subprocess
    import sys

    from conftest import REPO

    code = ("import jax, hetjax\n"
            "devices = hetjax.preset('cpu_hybrid').jax_devices()\n"
            "print(len(devices), len(jax.devices()))\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["8", "8"]
    # JAX already started with 1 device: one message saying what to do.
    code = "import jax, hetjax\njax.devices()\nhetjax.preset('cpu_hybrid').jax_devices()\n"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "restart the Python process (or notebook kernel)" in r.stderr


def test_a_trainer_renders_its_tables_and_the_device_map_inline():
    trainer = Trainer(tiny_config(**{"parallel.pp": 2, "parallel.dp": 2, "parallel.tp": 2,
                                     "train.microbatches": 2}), quiet=True)
    html = trainer._repr_html_()
    assert html.count("<table>") == 2 and "data:image/png;base64," in html
    assert "parameters" in html


def test_runners_up_show_every_column_they_differ_in():
    """Two plans alike but for recompute (or placement, or device order) never print as
    identical rows; columns in which no plan differs stay out of the table."""
    import dataclasses

    from hetjax.core.plan import Plan, comparison_table

    a = Plan(pp=2, dp=2, tp=2, stage_layers=(2, 2), microbatches=4, global_batch=32,
             seq_len=128, remat="full", predicted={"layout": "rank order"})
    b = dataclasses.replace(a, remat="none")
    header, row_a, row_b = comparison_table([a, b]).splitlines()
    assert "remat" in header and row_a.split()[-1] == "full" and row_b.split()[-1] == "none"
    assert "placement" not in header and "devices" not in header
    c = dataclasses.replace(a, placement="folded",
                            device_order=(4, 5, 6, 7, 0, 1, 2, 3),
                            predicted={"layout": "DT-FM assignment"})
    header, _, row_c = comparison_table([a, c]).splitlines()
    assert "remat" not in header and "placement" in header and "devices" in header
    assert row_c.rstrip().endswith("folded     DT-FM assignment")


def test_a_long_schedule_is_drawn_as_phases_not_a_barcode():
    """128 micro-batches on 2 stages: warm-up forwards, the alternating steady state and the
    cool-down backwards are a few bars a stage, each labelled with its task counts."""
    import re

    from matplotlib.collections import PolyCollection

    from hetjax.planner import model_from_config, plan_from_config
    from hetjax.planner.cost import CostModel
    from hetjax.planner.plot import BWD, FWD, MIXED, phases, plan_figure
    from hetjax.core.topology import preset

    config = tiny_config(**{"parallel.pp": 2, "parallel.dp": 4, "parallel.tp": 1,
                            "train.batch_size": 512, "train.microbatches": 128})
    topology = preset("cpu_hybrid")
    plan = plan_from_config(config, topology)
    model = model_from_config(config)
    timeline = plan_figure(plan, topology, model).axes[1]
    bars = [c for c in timeline.collections if isinstance(c, PolyCollection)]
    assert len(bars) <= 4 * plan.pp  # 3 phases and the exposed sync, not 2 x 128 a stage
    assert "purple: both (shade: busy share)" in timeline.get_title()
    _, sim = CostModel(topology, model).predict(plan, with_events=True)
    runs = phases(list(sim.events))
    counted = sum(int(n) for r in runs for n in re.findall(r"(\d+) [FB]", r[4]))
    assert counted == len(list(sim.events)) == 2 * 128 * plan.pp  # every task in one phase
    assert [r[3] for r in runs if r[0] == 0] == [FWD, MIXED, BWD]  # warm-up, steady, cool-down
