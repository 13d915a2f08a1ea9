"""scripts/: benchmarks and entry points stay runnable. Each file imports hetjax's public names
only and leaves `sys.path` alone (read with `ast`); each benchmark's smoke mode runs here, in
this process on its 8 simulated devices where the script allows, so a change that breaks one
fails the suite. `EXERCISED_BY` names the test that runs each file: a new script without one
fails `test_every_script_is_exercised_by_a_named_test`."""

import ast
import os
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPTS = os.path.join(REPO, "scripts")
FILES = sorted(os.path.relpath(os.path.join(folder, name), REPO)
               for folder, _, names in os.walk(SCRIPTS) for name in names
               if name.endswith(".py"))


# Every file under scripts/ and the test (tests/FILE.py::NAME) that runs it: its smoke mode, a
# cheap real run, or (thin entry points) its start. Tests without a file are this file's.
EXERCISED_BY = {
    "scripts/__init__.py": "test_bench_pipeline_smoke",  # imported by every in-process smoke
    "scripts/bench/__init__.py": "test_bench_pipeline_smoke",
    "scripts/tools/__init__.py": "test_docs.py::test_a_failing_python_block_fails",
    "scripts/bench/boundary_codec.py": "test_bench_boundary_codec_smoke",
    "scripts/bench/data.py": "test_bench_data_smoke",
    "scripts/bench/diloco.py": "test_bench_diloco_smoke",
    "scripts/bench/gpu.py": "test_bench_gpu.py::test_smoke_run_prints_the_table_and_writes_json",
    "scripts/bench/hetaccel.py":
        "test_an_entry_point_of_an_experiment_starts_as_a_module",
    "scripts/bench/hetnet.py":
        "test_an_entry_point_of_an_experiment_starts_as_a_module",
    "scripts/bench/moe.py": "test_bench_moe_smoke",
    "scripts/bench/pipeline.py": "test_bench_pipeline_smoke",
    "scripts/bench/planner.py": "test_bench_planner_smoke",
    "scripts/bench/predict.py": "test_bench_predict_smoke",
    "scripts/bench/quota.py": "test_bench_quota_smoke",
    "scripts/bench/reliability.py": "test_bench_reliability_smoke",
    "scripts/bench/zero.py": "test_bench_zero_smoke",
    "scripts/bench/check_worlds.py":
        "test_an_entry_point_of_an_experiment_starts_as_a_module",
    "scripts/tools/doc_blocks.py": "test_docs.py::test_a_failing_python_block_fails",
    "scripts/tools/structure.py":
        "test_structure.py::test_the_module_table_in_docs_structure_is_generated_from_the_docstrings",
    "scripts/tools/make_hf_fixture.py":  # needs torch; the tests read what it wrote
        "test_interop.py::test_an_hf_checkpoint_gives_transformers_logits",
    "scripts/bench/repredict.py":
        "test_an_entry_point_of_an_experiment_starts_as_a_module",
    "scripts/bench/experiments/__init__.py": "test_experiments.py::test_report_helpers",
    "scripts/bench/experiments/harness.py": "test_experiments.py::test_report_helpers",
    "scripts/bench/experiments/hetaccel.py":
        "test_experiments.py::test_hetaccel_speeds_and_planned_split_come_from_the_calibration",
    "scripts/bench/experiments/hetnet.py":
        "test_experiments.py::test_nic_layouts_put_each_parallelism_on_the_intended_links",
    "scripts/bench/experiments/repredict.py":
        "test_experiments.py::test_saved_runs_are_priced_again_and_compared_run_to_run",
    "scripts/bench/experiments/worlds.py":
        "test_an_entry_point_of_an_experiment_starts_as_a_module",
}


def _tree(path: str) -> ast.AST:
    with open(os.path.join(REPO, path)) as f:
        return ast.parse(f.read())


def test_every_script_is_found():
    assert {"scripts/bench/pipeline.py", "scripts/bench/zero.py",
            "scripts/bench/experiments/harness.py", "scripts/tools/doc_blocks.py"} <= set(FILES)


def test_every_script_is_exercised_by_a_named_test():
    """A script without an entry in EXERCISED_BY (or one naming a test that does not exist)
    fails here: give it a smoke mode and a test that runs it, then add the entry."""
    missing = sorted(set(FILES) - set(EXERCISED_BY))
    assert not missing, f"no test runs {missing}: add a smoke mode, a test, an EXERCISED_BY entry"
    assert not set(EXERCISED_BY) - set(FILES), "EXERCISED_BY names scripts that are gone"
    for script, test in EXERCISED_BY.items():
        file, _, name = test.rpartition("::")
        tree = _tree(os.path.join("tests", file or "test_scripts.py"))
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{script}: {test} is not a test"


@pytest.mark.parametrize("path", FILES)
def test_a_script_leaves_sys_path_alone(path):
    edits = [n.lineno for n in ast.walk(_tree(path)) if isinstance(n, ast.Attribute)
             and n.attr == "path" and isinstance(n.value, ast.Name) and n.value.id == "sys"]
    assert not edits, f"{path}:{edits} touches sys.path; run it as python -m scripts.bench.NAME"


@pytest.mark.parametrize("path", FILES)
def test_a_script_imports_no_private_name(path):
    private = [f"{n.module}.{a.name}" for n in ast.walk(_tree(path))
               if isinstance(n, ast.ImportFrom) and n.module
               and n.module.split(".")[0] in ("hetjax", "layers", "parallel")
               for a in n.names if a.name.startswith("_")]
    assert not private, f"{path} imports private names {private}"


@pytest.mark.slow  # every schedule's plot
def test_bench_pipeline_smoke(capsys):
    from scripts.bench import pipeline as bench_pipeline

    assert bench_pipeline.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "## Modelled step time, stages of [2, 1] layers" in out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or
            line.startswith("| 2 |")]
    assert len(rows) == 2, out  # the compute table: 1 and 2 active layers
    assert out.count("wrote ") == len(bench_pipeline.sch.SCHEDULES)


@pytest.mark.slow  # every ZeRO point compiled; test_zero.py is the default's
def test_bench_zero_smoke(capsys):
    from scripts.bench import zero as bench_zero

    assert bench_zero.main(["--smoke", "--skip-7b"]) == 0
    out = capsys.readouterr().out
    assert "| zero3 | 8/8/8 |" in out  # pp = 1: the factors of dp = 8
    assert "| custom, dp=4 tp=1 | 2/2/4 |" in out  # the pp = 2 table
    assert " in the loop)" in out and out.count("| zero3 |") == 1, out


@pytest.mark.slow  # six compiled steps
def test_bench_moe_smoke(capsys):
    from scripts.bench import moe as bench_moe

    assert bench_moe.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    for row in ("| dense |", "| MoE, dropless |", "| MoE, capacity 1.0 |",
                "| MoE, dropless, EP 4 |"):
        assert row in out, out


@pytest.mark.slow  # the loader (prefetching) is the default tier's in test_data.py and every training test
def test_bench_data_smoke(tmp_path, capsys):
    from scripts.bench import data as bench_data

    assert bench_data.main(["--smoke", f"--workdir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    for row in ("loader, prefetching", "loader, one batch at a time", "train step consumes"):
        assert f"| {row}" in out, out
    assert "input wait in training:" in out
    assert (tmp_path / "tfds").is_dir()  # the corpus was prepared where the caller said


def test_bench_quota_smoke(capsys):
    from scripts.bench import quota as bench_quota

    assert bench_quota.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 0 | this process |")]
    assert len(rows) == 1 and len(rows[0].split("|")) == len(bench_quota.HEADER) + 2, out


@pytest.mark.slow
def test_bench_diloco_smoke(tmp_path, capsys):
    """The one-process path (about 25 s: two trainings); --testbed needs root."""
    from scripts.bench import diloco as bench_diloco

    bench_diloco.main(["--smoke", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    lines = out.splitlines()
    for label in ("synchronous DP | ", "DiLoCo H=3 int8 | "):
        assert sum(line.startswith(label) for line in lines) == 1, out
    assert (tmp_path / "synchronous_DP").is_dir()


@pytest.mark.slow
def test_bench_boundary_codec_smoke(tmp_path, capsys):
    """Two worlds (threads, real bridges), both codecs, 2 steps: about 25 s."""
    from scripts.bench import boundary_codec as bench_boundary_codec

    assert bench_boundary_codec.main(["--smoke", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("\nnone | ") == 1 and out.count("\nint8 | ") == 1, out
    assert "int8 vs none: max relative difference" in out


@pytest.mark.slow
def test_bench_reliability_smoke(capsys):
    """Two launched jobs of 4 processes, one killed and restarted: a minute or two."""
    from scripts.bench import reliability as bench_reliability

    assert bench_reliability.main(["--smoke"]) == 0, capsys.readouterr().out[-3000:]
    out = capsys.readouterr().out
    assert "resumed from checkpoint 5" in out and "up to step 7: True" in out, out[-3000:]


def test_bench_planner_smoke(capsys):
    from scripts.bench import planner as bench_planner

    bench_planner.main(["--smoke"])
    out = capsys.readouterr().out
    assert "All-reduce over 1,024" in out and "Holmes" in out, out[-2000:]


def test_bench_predict_smoke(capsys, tmp_path):
    """Every source but the compiled steps' memory (a compile: the slow tier's smoke below)."""
    import json

    from scripts.bench import predict as bench_predict

    out_json = tmp_path / "rows.json"
    bench_predict.main(["--smoke", "--sources",
                        "emulated,profile,megatron,megatron_flat,amsp,holmes,h200",
                        "--json", str(out_json)])
    out = capsys.readouterr().out
    for source in ("emulated cluster", "Megatron-LM Table 1", "AMSP, 1,024 A800",
                   "Holmes Table 1", "one H200 (recorded)"):
        assert f"| {source} |" in out, out[-2000:]
    rows = json.loads(out_json.read_text())
    assert all(r["predicted"] > 0 and r["measured"] > 0 for r in rows)
    assert any(r["fitted"] for r in rows) and any(not r["fitted"] for r in rows)


@pytest.mark.slow
def test_bench_predict_smoke_compiles_a_step_for_its_memory(capsys):
    from scripts.bench import predict as bench_predict

    bench_predict.main(["--smoke", "--sources", "memory"])
    assert "| XLA memory_analysis() |" in capsys.readouterr().out


@pytest.mark.slow
def test_the_gpu_check_runs_end_to_end_on_a_tiny_shape(tmp_path):
    """scripts/tools/gpu_check.sh, the one command a GPU session runs, on CPU with a tiny shape:
    calibrate, plan (flat and by kind) and bench/gpu.py all finish and leave their files."""
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "tools", "gpu_check.sh"), "--smoke",
                        str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for name in ("calibration.json", "profile.json", "plan_flat.json", "plan_kinds.json",
                 "plan_profile.json", "bench_gpu.json"):
        assert (tmp_path / name).is_file(), (name, r.stdout[-3000:])
    assert r.stdout.count("exit 0") == 5, r.stdout[-3000:]
    # the profile has the layer at one sequence and at the job's micro-batch (2 sequences)
    from hetjax.planner.compute_profile import load_profile

    prof = load_profile(str(tmp_path / "profile.json"))
    assert {r.tokens for r in prof.rows if r.piece == "layer"} == {64, 128}
    assert "(compute: profile)" in (tmp_path / "plan_profile.log").read_text()


def _runnable(path: str) -> bool:
    with open(os.path.join(REPO, path)) as f:
        text = f.read()
    return path.endswith(".sh") or 'if __name__ == "__main__":' in text


RUNNABLE = sorted(p for p in (FILES + [os.path.relpath(os.path.join(folder, n), REPO)
                                       for folder, _, names in os.walk(SCRIPTS) for n in names
                                       if n.endswith(".sh")]) if _runnable(p))
# The runnable scripts without a --smoke run, and why. Every other one takes --smoke (tiny
# shapes, on CPU, seconds to a minute), the one spelling the suite and the docs use.
NO_SMOKE = {
    "scripts/bench/hetaccel.py": "runs on the testbed's emulated cluster: needs root",
    "scripts/bench/hetnet.py": "runs on the testbed's emulated cluster: needs root",
    "scripts/bench/repredict.py": "reprices the results files a testbed run wrote",
    "scripts/tools/doc_blocks.py": "a tool: runs documentation blocks",
    "scripts/tools/structure.py": "a tool: writes docs/structure.md's module table",
    "scripts/tools/make_hf_fixture.py": "a tool: writes the HF test fixture (needs torch)",
    "scripts/tools/gpu_wheels.sh": "a tool: downloads wheels",
}


def test_every_script_is_runnable_or_imported():
    assert {"scripts/bench/pipeline.py", "scripts/tools/gpu_check.sh",
            "scripts/bench/experiments/worlds.py"} <= set(RUNNABLE)
    assert set(NO_SMOKE) <= set(RUNNABLE)


@pytest.mark.parametrize("path", RUNNABLE)
def test_every_script_answers_help_and_takes_smoke(path, tmp_path):
    """Run as a file from another directory (an installed hetjax does not include scripts/;
    an entry point still finds its experiment), `--help` prints the usage and exits 0, and
    lists `--smoke` unless NO_SMOKE says why not."""
    cmd = ["bash"] if path.endswith(".sh") else [sys.executable]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([*cmd, os.path.join(REPO, path), "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout, res.stdout[-2000:]
    assert ("--smoke" in res.stdout) == (path not in NO_SMOKE), res.stdout[-2000:]
    assert not list(tmp_path.iterdir())  # nothing written where it ran


@pytest.mark.parametrize("name", ["hetaccel", "hetnet", "check_worlds", "repredict", "diloco",
                                  "quota"])
def test_an_entry_point_of_an_experiment_starts_as_a_module(name):
    """Run with -m from the repository root, an entry point imports its experiment as a
    subpackage (as a file, it finds it on its own folder: the test above)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-m", f"scripts.bench.{name}", "--help"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout


@pytest.mark.slow  # (test_bench_quota_smoke runs the same smoke in the default tier)
def test_a_benchmark_that_reads_an_experiment_runs_as_a_file_from_another_directory(tmp_path):
    """`--help` stops before a benchmark reaches its experiment's code: bench_quota's smoke
    uses it (the experiment's workload and the load line), run as a file from elsewhere."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench/quota.py"), "--smoke"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| 0 | this process | cpu |" in res.stdout
