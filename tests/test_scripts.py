"""scripts/: benchmarks and entry points stay runnable. Each file imports hetjax's public names
only and leaves `sys.path` alone (read with `ast`); the benchmarks with a smoke mode run it here,
in this process on its 8 simulated devices, so a change that breaks one fails the suite."""

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


def _tree(path: str) -> ast.AST:
    with open(os.path.join(REPO, path)) as f:
        return ast.parse(f.read())


def test_every_script_is_found():
    assert {"scripts/bench_pipeline.py", "scripts/bench_zero.py",
            "scripts/experiments/harness.py"} <= set(FILES)


@pytest.mark.parametrize("path", FILES)
def test_a_script_leaves_sys_path_alone(path):
    edits = [n.lineno for n in ast.walk(_tree(path)) if isinstance(n, ast.Attribute)
             and n.attr == "path" and isinstance(n.value, ast.Name) and n.value.id == "sys"]
    assert not edits, f"{path}:{edits} touches sys.path; run it as python -m scripts.NAME"


@pytest.mark.parametrize("path", FILES)
def test_a_script_imports_no_private_name(path):
    private = [f"{n.module}.{a.name}" for n in ast.walk(_tree(path))
               if isinstance(n, ast.ImportFrom) and n.module
               and n.module.split(".")[0] in ("hetjax", "layers", "parallel")
               for a in n.names if a.name.startswith("_")]
    assert not private, f"{path} imports private names {private}"


def test_bench_pipeline_smoke(capsys):
    from scripts import bench_pipeline

    assert bench_pipeline.main(["smoke"]) == 0
    out = capsys.readouterr().out
    assert "## Modelled step time, stages of [2, 1] layers" in out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or
            line.startswith("| 2 |")]
    assert len(rows) == 2, out  # the compute table: 1 and 2 active layers
    assert out.count("wrote ") == len(bench_pipeline.sch.SCHEDULES)


def test_bench_zero_smoke(capsys):
    from scripts import bench_zero

    assert bench_zero.main(["--smoke", "--skip-7b"]) == 0
    out = capsys.readouterr().out
    assert "| zero3 | 8/8/8 |" in out  # pp = 1: the factors of dp = 8
    assert out.count("| zero3 |") == 2  # and a row in the pp = 2 table


def test_bench_planner_smoke(capsys):
    from scripts import bench_planner

    bench_planner.main(["smoke"])
    out = capsys.readouterr().out
    assert "All-reduce over 1,024" in out and "Holmes" in out, out[-2000:]


@pytest.mark.slow
def test_the_gpu_check_runs_end_to_end_on_a_tiny_shape(tmp_path):
    """scripts/gpu_check.sh, the one command a GPU session runs, on CPU with a tiny shape:
    calibrate, plan (flat and by kind) and bench_gpu.py all finish and leave their files."""
    env = {**os.environ, "GPU_CHECK_SMOKE": "1", "PYTHON": sys.executable}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for name in ("calibration.json", "plan_flat.json", "plan_kinds.json", "bench_gpu.json"):
        assert (tmp_path / name).is_file(), (name, r.stdout[-3000:])
    assert r.stdout.count("exit 0") == 4, r.stdout[-3000:]


@pytest.mark.parametrize("name", ["bench_hetaccel", "bench_hetnet", "check_worlds", "repredict"])
@pytest.mark.parametrize("how", ["file", "module"])
def test_an_entry_point_of_an_experiment_starts_as_a_file_and_as_a_module(name, how, tmp_path):
    """An installed hetjax does not include scripts/: run as a file, from another directory, the
    entry point still finds its experiment; run with -m from the repository root, too."""
    argv = ([sys.executable, os.path.join(SCRIPTS, f"{name}.py"), "--help"] if how == "file"
            else [sys.executable, "-m", f"scripts.{name}", "--help"])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(argv, cwd=tmp_path if how == "file" else REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout
