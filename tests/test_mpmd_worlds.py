"""The MPMD executor across worlds: two worlds (here two threads of one process, each with its
own devices and its own end of a real bridge) train with the same losses and parameters as
the single-world executor on the same devices -- tied embedding, uneven split, dp and tp inside
each world. The multi-process version (two `jax.distributed` jobs of two processes each) is
`scripts/bench/check_worlds.py`."""

import json
import threading

import jax
import numpy as np
import pytest

from hetjax.distributed import free_port
from hetjax.planner.worlds import plan_worlds
from hetjax.train import Trainer
from hetjax.parallel.bridge import Bridge
from hetjax.parallel.mpmd_worlds import WorldsExecutor
from test_mpmd import mpmd_config

STEPS = 3


# (pipeline config, processes): one process per world (each world's stages on its every
# process), or one per node, so each world's two stages sit on different processes and cross
# between them over the bridge too
CASES = [pytest.param(((1, 3), "1f1b", 2, 2, 4), 0, id="process-per-world",
                      marks=pytest.mark.slow),  # all slow; test_bridge.py is the default tier's
         pytest.param(((1, 1, 1, 1), "1f1b", 2, 1, 4), 4, id="stage-per-process",
                      marks=pytest.mark.slow),
         # half of each cluster left out: a world's job holds only its used ranks (one
         # process per world), or its processes' ranks with some idle (one per node; the
         # processes of the nodes left out have no world)
         pytest.param(((1, 1), "1f1b", 1, 2, 4, {"parallel.exclude": (2, 3, 6, 7)}), 0,
                      id="subset-process-per-world", marks=pytest.mark.slow),
         pytest.param(((1, 1), "1f1b", 1, 2, 4, {"parallel.exclude": (2, 3, 6, 7)}), 4,
                      id="subset-process-per-node", marks=pytest.mark.slow)]


@pytest.mark.parametrize("case, processes", CASES)
def test_two_worlds_train_and_evaluate_like_one(case, processes):
    from hetjax.distributed import process_slots
    from hetjax.parallel.mpmd_worlds import stage_groups

    trainer = Trainer(mpmd_config(*case[:5], **(case[5] if len(case) > 5 else {})), quiet=True)
    batches = [next(trainer.data) for _ in range(STEPS)]
    ref = trainer.executor
    state, want = ref.init_state(trainer.config.train.seed), []
    for b in batches:
        state, metrics = ref.step(state, ref.put_batch(b))
        want.append(float(metrics["loss"]))
    want_eval = ref.eval_loss(state, batches[0])

    plan, topo = trainer.plan, trainer.topology
    if processes:
        slots = process_slots(topo, processes)
        worlds = plan_worlds(plan, topo, slots)
        owner = {r: slot.index for slot in slots for r in slot.ranks}
    else:
        worlds = plan_worlds(plan, topo)
        owner = {r: w.index for w in worlds for r in w.ranks}  # one bridge end per world
    assert len(worlds) == 2
    groups = stage_groups(plan, worlds, owner)
    assert [g.stages for g in groups] == [w.stages for w in worlds] if not processes else \
        [(s,) for s in range(plan.pp)]
    ends = sorted({owner[r] for w in worlds for r in w.ranks})  # a process left out has none
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(max(owner.values()) + 1)]
    devices = topo.jax_devices()
    got, states, evals, errors = {}, {}, {}, []

    def run(rank):
        try:
            bridge = Bridge(rank, addresses, "transfer", timeout_s=60)
            w = next(w for w in worlds if any(owner[r] == rank for r in w.ranks))
            ex = WorldsExecutor(plan, topo, trainer.model_cfg, trainer.tx, trainer.schedule,
                                trainer.config.train.grad_clip, worlds, w.index, owner, bridge,
                                devices=[devices[r] for r in w.ranks])
            st, losses = ex.init_state(trainer.config.train.seed), []
            for b in batches:
                st, metrics = ex.step(st, ex.put_batch(b))
                losses.append(float(metrics["loss"]))
            evals[rank] = ex.eval_loss(st, batches[0])
            ex.finish()
            bridge.close()
            got[rank], states[rank] = losses, (ex.local, st)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in ends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for r in ends:
        np.testing.assert_allclose(got[r], want, rtol=1e-6)
        np.testing.assert_allclose(evals[r], want_eval, rtol=1e-6)
    # each stage's parameters equal the single-world executor's
    for local, st in states.values():
        for s, mine in zip(local, st.stages):
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                         jax.device_get(mine.params), jax.device_get(state.stages[s].params))


# --- checkpoints and evaluation of a job launched as two worlds -----------------------------------
# cpu_hybrid, one process per cluster: stage 0 (1 layer) in world 0, stage 1 (2 layers) in
# world 1, dp = 4 inside each world, tied embedding.
WORLDS_JOB = {"topology.preset": "cpu_hybrid", "model.d_model": 32, "model.d_ff": 64,
              "model.n_layers": 3, "model.n_heads": 4, "model.n_kv_heads": 2,
              "model.max_seq_len": 64, "train.seq_len": 16, "train.batch_size": 16,
              "parallel.pp": 2, "parallel.dp": 4, "parallel.tp": 1,
              "pipeline.executor": "mpmd", "pipeline.stage_layers": (1, 2),
              "pipeline.microbatches": 4, "data.source": "synthetic", "train.warmup_steps": 1,
              "train.log_every": 1, "train.progress": False, "tensorboard": False,
              "eval.batches": 2, "eval.every": 2, "checkpoint.every": 2, "train.steps": 6}


def _natural_state(trainer, directory, step):
    """Checkpoint `step` of `directory` read into `trainer`'s layout, in the natural layout on
    the host."""
    from hetjax import checkpoint as hckpt

    ck = hckpt.Checkpointer(str(directory), every=0)
    layout = trainer.layout()
    r = ck.restore(layout, step)
    ck.close()
    return r, jax.device_get(layout.to_natural(r.state))


@pytest.mark.slow
def test_a_two_world_job_checkpoints_evaluates_and_resumes_like_one_process(tmp_path):
    """One launch of two worlds checks, against the same job in this process:
    - it resumes from the one-process job's checkpoint 2 (that layout restores in the worlds)
      and trains steps 3-6 with the same losses, and its eval loss (combined over the bridge)
      at steps 4 and 6 equals the one-process job's;
    - its checkpoint 4 (world 0 writes every stage's state) holds exactly what the
      one-process job wrote at step 4 and restores in one process;
    - killed while its save of step 6 is held open (written, not committed), it leaves no
      step 6 that loads: the newest checkpoint a restore finds is 4."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    from conftest import REPO, tiny_config
    from hetjax import checkpoint as hckpt
    from test_launch import config_args, worker_env

    ref_dir = tmp_path / "one"
    ref = Trainer(tiny_config(**{**WORLDS_JOB, "workdir": str(ref_dir)}), quiet=True)
    want = {r["step"]: r for r in ref.train().history.rows}
    assert sorted(os.listdir(ref_dir / "checkpoints")) == ["2", "4", "6", "tokenizer"]

    run_dir = tmp_path / "worlds"
    os.makedirs(run_dir / "checkpoints")
    shutil.copytree(ref_dir / "checkpoints" / "2", run_dir / "checkpoints" / "2")
    cmd = [sys.executable, "-m", "hetjax", "launch", "--local", "2", "--timeout", "200",
           *config_args({**WORLDS_JOB, "workdir": str(run_dir)})]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, start_new_session=True,
                            env=worker_env(**{hckpt.HOLD_ENV: "3"}))
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if "holding the save of step 6" in line:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both worlds
                break
        else:
            pytest.fail(f"no save of step 6 was held; exit code {proc.wait()}:\n"
                        + "".join(out[-60:]))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    text = "".join(out)
    assert "resumed from checkpoint 2" in text, text[-4000:]
    with open(run_dir / "metrics.jsonl") as f:
        got = {r["step"]: r for r in map(json.loads, f)}
    assert sorted(got) == [3, 4, 5, 6]
    for step in got:
        np.testing.assert_allclose(got[step]["loss"], want[step]["loss"], rtol=1e-6)
    for step in (4, 6):
        np.testing.assert_allclose(got[step]["eval_loss"], want[step]["eval_loss"], rtol=1e-6)

    # the killed save of step 6 left nothing a restore takes; step 4 is the worlds' own
    assert not (run_dir / "checkpoints" / "6").exists()
    ck = hckpt.Checkpointer(str(run_dir / "checkpoints"), every=0)
    assert ck.latest_step() == 4
    ck.close()
    r, mine = _natural_state(ref, run_dir / "checkpoints", 4)
    assert r.data_state == {"next_index": 4}
    _, theirs = _natural_state(ref, ref_dir / "checkpoints", 4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 mine, theirs)


@pytest.mark.slow
def test_a_world_that_never_comes_up_is_named_after_the_init_timeout(tmp_path):
    """Only world 0 of a two-world launch starts: its process stops after the init timeout
    with one error naming world 1's process and its bridge address."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from conftest import REPO, tiny_config
    from hetjax import config as hconfig
    from hetjax.launch import plan_workers
    from hetjax.planner import plan_from_config
    from test_launch import config_args, worker_env

    job = {**WORLDS_JOB, "checkpoint.every": 0, "eval.every": 0, "workdir": str(tmp_path)}
    cfg = tiny_config(**job)
    topology = hconfig.build_topology(cfg)
    args = SimpleNamespace(local=2, hostfile=None, port=0, coordinator=None, init_timeout=3,
                           heartbeat_timeout=20, nic_policy="cluster", python=sys.executable,
                           chdir=REPO, command="train")
    first, second = plan_workers(cfg, topology, plan_from_config(cfg, topology), args,
                                 config_args(job))
    run = subprocess.run(list(first.argv), env=worker_env(**first.env), capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    address = f"127.0.0.1:{int(second.env['HETJAX_BRIDGE_PORT']) + 1}"  # rank 1: port + 1
    assert (f"bridge peer 1 (world 1, its process 0) at {address} did not come up within 3 s"
            in run.stderr), run.stderr[-3000:]


def test_prefetch_reads_the_remote_receives_of_the_next_tasks_from_the_program():
    """The worlds executor's receive prefetches what the program's next LOOKAHEAD tasks
    receive from other groups (no devices needed: the bridge pulls are recorded)."""
    from types import SimpleNamespace

    from hetjax.core import program as pg
    from hetjax.core import schedules as sch
    from hetjax.parallel.mpmd import StepRun
    from hetjax.parallel.mpmd_worlds import LOOKAHEAD

    assert LOOKAHEAD == 4
    ex = WorldsExecutor.__new__(WorldsExecutor)  # world of stage 1 of a 1f1b pp = 2 pipeline
    ex.local, ex.activation = [1], None
    ex.stages = [None, SimpleNamespace(activation=None)]
    ex._pulls = lambda s_to, s_from, abstract, sharding, kind, field, mb: [(s_from, kind, mb)]
    pulled = []
    ex._prefetch = pulled.extend
    ops = pg.lower(sch.make_schedule("1f1b", 2, 8)).of_stage(1)
    step = StepRun(list(ops), None, None, None, {}, {}, {})
    step.position = ops.index(pg.Recv(1, pg.Buffer("activation", 1, 0), 0))
    ex._prefetch_ahead(step)
    # stage 1 runs F0 B0 F1 B1 F2 B2 ...: the four tasks after F0 receive for F1 and F2
    assert pulled == [(0, "activation", 1), (0, "activation", 2)]
    pulled.clear()
    ex.local = [0, 1]  # both stages here: nothing crosses the bridge
    ex._prefetch_ahead(step)
    assert pulled == []
