"""Multi-process launches: same losses as one process, a dead process stops the job, a missing
one is named; plus the launcher's pieces (worker spec, SLURM detection, rendezvous, per-process
data rows) without starting JAX workers. The supervisor's own tests: test_supervise.py."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import REPO, tiny_config
from hetjax import launch, worker
from hetjax.distributed import DistributedError, WorkerSpec, rendezvous
from hetjax.errors import HetjaxError

# A tiny model so 4 workers compile and run on 2 busy cores in seconds. Every field
# tiny_config sets is spelled out, and every field the default job (configs/default.py, what
# `hetjax` runs without --config) changes is set back, so the launched job and the in-process
# reference agree.
TINY = {"model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
        "model.d_ff": 64, "model.max_seq_len": 64, "train.seq_len": 16, "train.batch_size": 16,
        "train.steps": 3, "train.warmup_steps": 1, "train.log_every": 1,
        "train.progress": False, "data.source": "synthetic", "tensorboard": False,
        "parallel.pp": 1, "parallel.dp": 0, "parallel.tp": 1, "train.microbatches": 1,
        "eval.every": 0}


def config_args(overrides: dict) -> list[str]:
    return [f"--config.{k}={v}" for k, v in overrides.items()]


def worker_env(**extra) -> dict:
    """Our environment for a child process: this worktree on the path, no forced device count
    (the launcher sets each worker's own)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return {**env, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def hetjax(*args, timeout=240, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetjax", *args], env=worker_env(**env),
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def losses(path) -> list[float]:
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


# --- the same training as one process ------------------------------------------------------------
@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """losses(pp): the same job in this process, on its 8 simulated devices (computed once)."""
    from hetjax.train import Trainer

    cache = {}

    def get(pp: int) -> list[float]:
        if pp not in cache:
            workdir = tmp_path_factory.mktemp(f"single_pp{pp}")
            cfg = tiny_config(**{**TINY, "parallel.pp": pp, "workdir": str(workdir)})
            cache[pp] = losses(Trainer(cfg, quiet=True).train()["metrics"])
        return cache[pp]

    return get


def launched_losses(tmp_path, launch_args, overrides) -> tuple[list[float], str]:
    workdir = tmp_path / "multi"
    cfg = {**TINY, **overrides, "workdir": str(workdir)}
    run = hetjax("launch", *launch_args, "--timeout", "200", *config_args(cfg))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return losses(workdir / "metrics.jsonl"), run.stdout


# All slow (about 50 s each on two cores): the default tier launches processes in
# test_launch_recovery.py and test_reliability_launch.py.
@pytest.mark.parametrize("processes, pp", [
    pytest.param(2, 1, marks=pytest.mark.slow), pytest.param(4, 1, marks=pytest.mark.slow),
    pytest.param(2, 2, marks=pytest.mark.slow), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_local_launch_matches_single_process(tmp_path, single_process, processes, pp):
    if pp > 1:
        pytest.importorskip("hetjax.parallel.pipeline",
                            reason="pp = 2 needs parallel/pipeline.py (the pipeline branch)")
    multi, out = launched_losses(tmp_path, ["--local", str(processes)], {"parallel.pp": pp})
    np.testing.assert_allclose(multi, single_process(pp), rtol=1e-5)
    # One copy of the run files and one final checkpoint; each process announced, output
    # prefixed.
    assert sorted(os.listdir(tmp_path / "multi")) == ["checkpoints", "config.json",
                                                      "loss.png", "metrics.jsonl", "plan.json",
                                                      "topology.json"]
    assert sorted(os.listdir(tmp_path / "multi" / "checkpoints")) == ["3", "tokenizer"]
    assert len(re.findall(r"^\[p0\] summary$", out, re.M)) == 1
    assert not re.search(rf"^\[p[1-9]\] (summary|topology)", out, re.M)
    assert all(f"started p{i} (pid" in out for i in range(processes))


@pytest.mark.slow
def test_hostfile_launch_runs_each_host_through_rsh(tmp_path, single_process):
    """The hostfile path end to end, with 'sh -c' standing in for ssh to two hosts."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts, in topology node order\n127.0.0.1\nlocalhost\n")
    args = ["--hostfile", str(hostfile), "--rsh", "sh -c", "--port", str(free_port())]
    multi, out = launched_losses(tmp_path, args, {})
    np.testing.assert_allclose(multi, single_process(1), rtol=1e-5)
    assert "  1        localhost" in out


# --- failures: a dead process, a missing process --------------------------------------------------
@pytest.mark.slow
def test_killing_one_of_four_processes_stops_the_job(tmp_path):
    workdir = tmp_path / "run"
    cfg = {**TINY, "train.steps": 100000, "workdir": str(workdir)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetjax", "launch", "--local", "4", "--grace", "5",
         "--timeout", "200", *config_args(cfg)],
        env=worker_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 150
        while not (workdir / "metrics.jsonl").exists() or not (workdir / "metrics.jsonl"
                                                                ).read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.5)
        pids = {int(m[1]): int(m[2]) for m in re.finditer(r"started p(\d) \(pid (\d+)\)",
                                                          "".join(lines))}
        assert sorted(pids) == [0, 1, 2, 3]
        os.kill(pids[2], 9)
        killed = time.monotonic()
        rc = proc.wait(timeout=60)
        assert time.monotonic() - killed < 60
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    out = "".join(lines)
    assert rc == 128 + 9, out[-3000:]
    assert re.search(r"hetjax launch: p2 \(pid \d+\) was killed by SIGKILL; stopping p0, p1, p3",
                     out), out[-3000:]
    assert "failed: p2 was killed by SIGKILL first" in out
    for pid in pids.values():  # nothing left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow  # waits out a launch timeout
def test_a_process_that_never_starts_is_named_within_the_timeout():
    spec = {"HETJAX_COORDINATOR": f"127.0.0.1:{free_port()}", "HETJAX_NUM_PROCESSES": "4",
            "HETJAX_INIT_TIMEOUT": "10"}
    start = time.monotonic()
    # Process 0 and process 2 of 4 start; 1 and 3 never do.
    p2 = subprocess.Popen([sys.executable, "-m", "hetjax", "train"], cwd=REPO,
                          env=worker_env(**spec, HETJAX_PROCESS_ID="2"),
                          stderr=subprocess.PIPE, text=True)
    p0 = hetjax("train", timeout=60, **spec, HETJAX_PROCESS_ID="0")
    err2 = p2.communicate(timeout=60)[1]
    assert time.monotonic() - start < 40
    assert p0.returncode == p2.returncode == 2
    assert ("processes 1, 3 of 4 never arrived at the coordinator" in p0.stderr
            and "within 10 s" in p0.stderr), p0.stderr
    assert "process 2: processes 1, 3 of 4 never arrived" in err2, err2
    # A worker whose coordinator never starts names it.
    alone = hetjax("train", timeout=60, **{**spec, "HETJAX_INIT_TIMEOUT": "3"},
                   HETJAX_PROCESS_ID="1")
    assert alone.returncode == 2
    assert "process 1: the coordinator (process 0 at 127.0.0.1:" in alone.stderr
    assert "never answered within 3 s" in alone.stderr


# --- the pieces, without JAX workers ---------------------------------------------------------------
def test_worker_spec_round_trips_through_the_environment():
    spec = WorkerSpec("10.0.0.1:8476", 4, 2, init_timeout_s=30, heartbeat_timeout_s=20)
    assert WorkerSpec.from_environ(spec.environ()) == spec
    assert WorkerSpec.from_environ({}) is None
    with pytest.raises(DistributedError, match="process id 4 is outside 0..3"):
        WorkerSpec("h:1", 4, 4)
    with pytest.raises(DistributedError, match="is not HOST:PORT"):
        WorkerSpec("h", 4, 0)
    with pytest.raises(DistributedError, match="HETJAX_NUM_PROCESSES is not set"):
        WorkerSpec.from_environ({"HETJAX_COORDINATOR": "h:1", "HETJAX_PROCESS_ID": "0"})


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[007-010]", "SLURM_NTASKS": "4",
         "SLURM_PROCID": "3", "SLURM_LOCALID": "0", "SLURM_JOB_NUM_NODES": "4"}


def test_slurm_allocation_is_read_with_jax_cluster_detection(monkeypatch):
    for k, v in SLURM.items():
        monkeypatch.setenv(k, v)
    spec = WorkerSpec.from_environ({"HETJAX_CLUSTER": "slurm", "HETJAX_INIT_TIMEOUT": "30"})
    # JAX's port for job 4242: 4242 % 4096 + 61440.
    assert spec == WorkerSpec("gpu007:61586", 4, 3, init_timeout_s=30)
    monkeypatch.delenv("SLURM_PROCID")
    with pytest.raises(DistributedError, match="not a SLURM task"):
        WorkerSpec.from_environ({"HETJAX_CLUSTER": "slurm"})


def test_slurm_dry_run_prints_srun_and_each_tasks_environment(monkeypatch, capsys):
    for k, v in SLURM.items():
        monkeypatch.setenv(k, v)
    assert launch.main(["--slurm", "--dry-run", "--init-timeout", "120",
                        "--config.topology.preset=holmes_hybrid", "--config.parallel.pp=2",
                        "--config.parallel.tp=2", "--config.train.batch_size=32"]) == 0
    out = capsys.readouterr().out
    assert ("HETJAX_CLUSTER=slurm HETJAX_INIT_TIMEOUT=120 HETJAX_HEARTBEAT_TIMEOUT=60 "
            "HETJAX_NIC_POLICY=cluster srun --nodes=4 --ntasks=4 --ntasks-per-node=1 "
            "--kill-on-bad-exit=1 --label") in out
    rows = [line for line in out.splitlines() if re.match(r"  [0-3]        task", line)]
    assert len(rows) == 4
    assert all("NCCL_IB_HCA=mlx5_0:1" in r and "GID" not in r for r in rows[:2])
    assert all("NCCL_IB_HCA=mlx5_bond_0:1" in r and "NCCL_IB_GID_INDEX=3" in r for r in rows[2:])
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(HetjaxError, match="needs a SLURM allocation"):
        launch.main(["--slurm", "--dry-run"])


def test_hostfile_dry_run_prints_one_ssh_command_per_host(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("ib-node-0\nib-node-1\nroce-node-0  # RoCE cluster\nroce-node-1\n\n")
    assert launch.main(["--hostfile", str(hostfile), "--dry-run", "--chdir", "/srv/hetjax",
                        "--python", "/opt/venv/bin/python",
                        "--config.topology.preset=holmes_hybrid", "--config.parallel.pp=2",
                        "--config.parallel.tp=2", "--config.train.batch_size=32"]) == 0
    out = capsys.readouterr().out
    commands = [line for line in out.splitlines() if line.startswith("ssh ")]
    assert len(commands) == 4
    assert commands[2].startswith("ssh -o BatchMode=yes roce-node-0 'cd /srv/hetjax && env ")
    assert "NCCL_IB_GID_INDEX=3" in commands[2] and "HETJAX_PROCESS_ID=2" in commands[2]
    assert "HETJAX_COORDINATOR=ib-node-0:8476" in commands[2]
    assert "/opt/venv/bin/python -u -m hetjax train --config.topology.preset=holmes_hybrid" \
        in commands[2]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in commands[0]


def test_bad_launches_fail_before_starting_anything(tmp_path):
    with pytest.raises(DistributedError, match="3 processes cannot share the 4 nodes"):
        launch.main(["--local", "3", "--dry-run"])
    with pytest.raises(HetjaxError, match="config.parallel.tp"):
        launch.main(["--local", "2", "--dry-run", "--config.parallel.tp=3"])
    with pytest.raises(HetjaxError, match="does not know"):
        launch.main(["--local", "2", "--steps=3"])
    (tmp_path / "empty").write_text("# nobody\n")
    with pytest.raises(HetjaxError, match="lists no hosts"):
        launch.main(["--hostfile", str(tmp_path / "empty")])


def _rendezvous_all(n, ids, timeout, fingerprints=None):
    """Run the rendezvous of processes `ids` of an n-process job in threads; their errors."""
    port = free_port()
    errors = {}

    def one(i):
        try:
            rendezvous(WorkerSpec(f"127.0.0.1:{port}", n, i, init_timeout_s=timeout),
                       (fingerprints or {}).get(i, "job"))
        except DistributedError as e:
            errors[i] = str(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout + 40)
    assert not any(t.is_alive() for t in threads)
    return errors


def test_rendezvous_names_the_processes_that_never_arrive():
    assert _rendezvous_all(3, [2, 0, 1], timeout=20) == {}  # everyone: no error, any order
    errors = _rendezvous_all(4, [0, 2], timeout=2)
    assert errors[0].startswith("process 0: processes 1, 3 of 4 never arrived")
    assert errors[2].startswith("process 2: processes 1, 3 of 4 never arrived")
    errors = _rendezvous_all(2, [0, 1], timeout=20, fingerprints={1: "other"})
    assert "process 1 on" in errors[0] and "runs a different job" in errors[1]


class _FakeSharding:
    """The batch sharding as a process of a 2-process dp=8 job sees it: 4 local devices."""

    def __init__(self, local_dp):
        self.local_dp = local_dp

    def addressable_devices_indices_map(self, shape):
        m, b, s = shape
        per = b // 8
        return {d: (slice(None), slice(d * per, (d + 1) * per), slice(None))
                for d in self.local_dp}


def test_each_process_reads_only_its_rows_of_the_batch():
    from hetjax.data import Loader
    from hetjax.core.plan import Plan
    from hetjax.parallel.train_state import batch_rows

    plan = Plan(pp=1, dp=8, tp=1, stage_layers=(2,), microbatches=2, global_batch=32,
                seq_len=4)
    rows = batch_rows(plan, _FakeSharding(range(4, 8)))
    # Micro-batches of 16 rows; dp positions 4-7 hold rows 8-15 of each.
    assert rows.tolist() == list(range(8, 16)) + list(range(24, 32))
    data = np.arange(100 * 5).reshape(100, 5)
    full = Loader(data, 32, seed=0).batch(3)
    part = Loader(data, 32, seed=0, rows=rows).batch(3)
    np.testing.assert_array_equal(part["inputs"], full["inputs"][rows])
    np.testing.assert_array_equal(part["targets"], full["targets"][rows])


def test_put_batch_places_rows_by_their_global_index():
    from hetjax.train import Trainer

    trainer = Trainer(tiny_config(**{"train.microbatches": 2}), quiet=True)
    batch = next(trainer.data)  # one process: all 16 rows
    placed = trainer.put_batch(batch, rows=trainer.data_rows)
    # [M, B / M, S] holds row r at (r // 8, r % 8).
    np.testing.assert_array_equal(np.asarray(placed["inputs"]).reshape(16, -1), batch["inputs"])
    with pytest.raises(ValueError, match="its devices hold rows"):
        trainer.put_batch({k: v[8:] for k, v in batch.items()}, rows=np.arange(8, 16))


def test_an_mpmd_plan_on_two_fabrics_launches_one_world_per_cluster(tmp_path, capsys):
    """Each world has its own coordinator and process ids, its cluster's NCCL settings, and
    every process gets the bridge's addresses (its global index, every host)."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("ib-node-0\nib-node-1\nroce-node-0\nroce-node-1\n")
    assert launch.main(["--hostfile", str(hostfile), "--dry-run", "--chdir", "/srv/hetjax",
                        "--config.topology.preset=holmes_hybrid", "--config.parallel.pp=2",
                        "--config.parallel.tp=2", "--config.train.batch_size=32",
                        "--config.pipeline.executor=mpmd"]) == 0
    out = capsys.readouterr().out
    assert "world 1: stages 1 on roce (a100), 2 process(es)" in out
    commands = [line for line in out.splitlines() if line.startswith("ssh ")]
    assert len(commands) == 4
    for i, cmd in enumerate(commands):
        world = i // 2
        assert f"HETJAX_COORDINATOR={['ib-node-0', 'roce-node-0'][world]}:{8476 + world}" in cmd
        assert f"HETJAX_PROCESS_ID={i % 2} " in cmd and "HETJAX_NUM_PROCESSES=2 " in cmd
        assert f"HETJAX_WORLD={world} " in cmd and "HETJAX_WORLDS=2 " in cmd
        assert f"HETJAX_BRIDGE_RANK={i} " in cmd
        assert "HETJAX_BRIDGE_HOSTS=ib-node-0,ib-node-1,roce-node-0,roce-node-1 " in cmd
        assert "NCCL_NET=IB " in cmd  # no socket fallback: only the bridge leaves a cluster
    assert "NCCL_IB_GID_INDEX=3" in commands[2] and "NCCL_IB_GID_INDEX" not in commands[0]


def test_slurm_tasks_of_a_two_world_job_derive_what_a_hostfile_launch_gives(tmp_path,
                                                                              monkeypatch):
    """srun gives every task the same environment: each task derives its world, coordinator,
    process id, NCCL settings and bridge addresses from SLURM_PROCID and SLURM_STEP_NODELIST,
    equal to what --hostfile gives the same process on the same hosts."""
    from types import SimpleNamespace

    from hetjax import config as hconfig
    from hetjax.distributed import ENV_CLUSTER
    from hetjax.planner import plan_from_config

    args = ["--config.topology.preset=holmes_hybrid", "--config.parallel.pp=2",
            "--config.parallel.tp=2", "--config.train.batch_size=32",
            "--config.pipeline.executor=mpmd"]
    cfg = hconfig.load_config(None, args)
    topology = hconfig.build_topology(cfg)
    plan = plan_from_config(cfg, topology)
    hosts = ["ib-node-0", "ib-node-1", "roce-node-0", "roce-node-1"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("\n".join(hosts) + "\n")
    launch_args = SimpleNamespace(local=None, hostfile=str(hostfile), port=9000,
                                  coordinator=None, init_timeout=120, heartbeat_timeout=60,
                                  nic_policy="cluster", python="python", chdir="/srv",
                                  rsh=launch.DEFAULT_RSH, command="train")
    want = [w.env for w in launch.plan_workers(cfg, topology, plan, launch_args, args)]
    # what `hetjax launch --slurm --port 9000` sets for all tasks, and what SLURM sets
    common = {ENV_CLUSTER: "slurm", "HETJAX_INIT_TIMEOUT": "120",
              "HETJAX_HEARTBEAT_TIMEOUT": "60", "HETJAX_NIC_POLICY": "cluster",
              "JAX_COORDINATOR_PORT": "9000", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4",
              "SLURM_STEP_NODELIST": "ib-node-[0-1],roce-node-[0-1]", "SLURM_LOCALID": "0"}
    for task in range(4):
        env = {**common, "SLURM_PROCID": str(task)}
        got = worker.slurm_worlds_environ(cfg, topology, env)
        assert got == want[task], task
        assert got["HETJAX_COORDINATOR"] == ["ib-node-0:9000", "roce-node-0:9001"][task // 2]
        assert got["HETJAX_PROCESS_ID"] == str(task % 2) and got["HETJAX_WORLD"] == str(task // 2)
        assert got["HETJAX_BRIDGE_HOSTS"] == ",".join(hosts) and got["HETJAX_BRIDGE_PORT"] == "9100"
    # inside the task: the derived variables replace JAX's whole-job SLURM detection
    for k, v in {**common, "SLURM_PROCID": "3"}.items():
        monkeypatch.setenv(k, v)
    for k in set(want[3]) - set(common):  # set, then removed: undone at teardown, so what
        monkeypatch.setenv(k, "")        # join_slurm_worlds sets cannot leak into later tests
        monkeypatch.delenv(k)
    monkeypatch.setenv(ENV_CLUSTER, "slurm")
    worker.join_slurm_worlds(cfg, topology)
    assert ENV_CLUSTER not in os.environ
    assert WorkerSpec.from_environ() == WorkerSpec("roce-node-0:9001", 2, 1, 120, 60)
    # a single-world job keeps JAX's detection; a list with more nodes than tasks is refused
    one = hconfig.load_config(None, args[:-1])
    assert worker.slurm_worlds_environ(one, topology, {**common, "SLURM_PROCID": "0"}) == {}
    with pytest.raises(HetjaxError, match="one task per node"):
        worker.slurm_worlds_environ(cfg, topology, {**common, "SLURM_PROCID": "0",
                                                    "SLURM_STEP_NODELIST": "n[1-8]"})
    assert worker.expand_nodelist("gpu[007-008,012],login1") == [
        "gpu007", "gpu008", "gpu012", "login1"]


# --- a plan that leaves a node's devices out ------------------------------------------------------
def slow_node_job(tmp_path, **extra) -> dict:
    """TINY on a fast node of four devices and a node of two behind a 1 Gb/s link (ranks
    4-5), which the plan leaves out: two stages on the fast node, stage 0 two replicas,
    stage 1 a TP pair."""
    from hetjax.core.catalogue import LINKS, make_cluster
    from hetjax.core.hardware import Link, Topology

    path = tmp_path / "topology.json"
    path.write_text(Topology(
        name="fast_and_slow", clusters=(make_cluster("fast", 1, 4, "cpu", "infiniband"),
                                        make_cluster("slow", 1, 2, "cpu", "ethernet")),
        inter_cluster=Link("ethernet", 1.0, LINKS["ethernet"].latency_us)).to_json())
    return {**TINY, "topology.file": str(path), "parallel.pp": 2, "parallel.dp": 0,
            "pipeline.executor": "mpmd", "train.microbatches": 2,
            "parallel.stage_dp": "[2,1]", "parallel.stage_tp": "[1,2]",
            "parallel.exclude": "[4,5]", **extra}


def test_a_process_whose_devices_the_plan_leaves_out_is_not_started(tmp_path, capsys):
    """--local 2, one process per node: process 1 holds only left-out devices and is not
    started; process 0 runs as one bridged world (a jax.distributed job holding some of the
    topology's ranks, whose devices the worlds executor places by rank)."""
    assert launch.main(["--local", "2", "--dry-run",
                        *config_args(slow_node_job(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "process 1 (topology nodes [1]) is not started: the plan uses none of its " \
        "devices" in out
    assert re.findall(r"^# process (\d)", out, re.M) == ["0"]
    (cmd,) = [line for line in out.splitlines() if "HETJAX_PROCESS_ID" in line]
    assert "HETJAX_PROCESS_ID=0 " in cmd and "HETJAX_NUM_PROCESSES=1 " in cmd
    assert "HETJAX_BRIDGE_RANK=0 " in cmd and "HETJAX_WORLDS=1 " in cmd
    assert "HETJAX_BRIDGE_HOSTS=127.0.0.1,127.0.0.1 " in cmd
    # only the MPMD executor's worlds run without some of the topology's processes
    with pytest.raises(HetjaxError,
                       match=r"process\(es\) \[1\] .*--config.pipeline.executor=mpmd"):
        launch.main(["--local", "2", "--dry-run", *config_args(slow_node_job(tmp_path, **{
            "pipeline.executor": "spmd", "parallel.stage_dp": "[]",
            "parallel.stage_tp": "[]", "parallel.dp": 2}))])


@pytest.mark.slow  # a launched process compiles a two-stage pipeline
def test_a_launch_that_leaves_a_node_out_trains_like_one_process(tmp_path):
    from hetjax.train import Trainer

    job = slow_node_job(tmp_path)
    multi, out = launched_losses(tmp_path, ["--local", "2"], job)
    assert "started p0 (pid" in out and "started p1" not in out
    cfg = tiny_config(**{**job, "parallel.stage_dp": (2, 1), "parallel.stage_tp": (1, 2),
                         "parallel.exclude": (4, 5), "workdir": str(tmp_path / "one")})
    one = losses(Trainer(cfg, quiet=True).train()["metrics"])
    np.testing.assert_allclose(multi, one, rtol=1e-5)


def test_per_stage_shapes_on_processes_the_bridge_joins_are_refused_before_starting(tmp_path):
    """cpu_hybrid, one process per cluster: the stages are two worlds, and the bridge between
    them carries one shape on both sides."""
    with pytest.raises(HetjaxError, match=r"different \(dp, tp\) shapes .* same processes"):
        launch.main(["--local", "2", "--dry-run", *config_args({
            **TINY, "parallel.pp": 2, "pipeline.executor": "mpmd", "train.microbatches": 2,
            "parallel.stage_dp": "[2,4]", "parallel.stage_tp": "[2,1]"})])
