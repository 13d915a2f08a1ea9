"""The MPMD executor across worlds: two worlds (here two threads of one process, each with its
own devices and its own end of a real bridge) train with the same losses and parameters as
the single-world executor on the same devices -- tied embedding, uneven split, dp and tp inside
each world. The multi-process version (two `jax.distributed` jobs of two processes each) is
`scripts/check_worlds.py`."""

import threading

import jax
import numpy as np
import pytest

from hetjax.launch import free_port
from hetjax.planner.worlds import plan_worlds
from hetjax.train import Trainer
from parallel.bridge import Bridge
from parallel.mpmd_worlds import WorldsExecutor
from test_mpmd import mpmd_config

STEPS = 3


@pytest.mark.parametrize("transport", ["transfer"])
def test_two_worlds_train_like_one(transport):
    trainer = Trainer(mpmd_config((1, 3), "1f1b", dp=2, tp=2, microbatches=4), quiet=True)
    batches = [next(trainer.data) for _ in range(STEPS)]
    ref = trainer.executor
    state, want = ref.init_state(trainer.config.train.seed), []
    for b in batches:
        state, metrics = ref.step(state, ref.put_batch(b))
        want.append(float(metrics["loss"]))

    plan, topo = trainer.plan, trainer.topology
    worlds = plan_worlds(plan, topo)
    assert [w.stages for w in worlds] == [(0,), (1,)]
    owner = {r: w.index for w in worlds for r in w.ranks}  # one bridge end per world
    addresses = [f"127.0.0.1:{free_port()}" for _ in worlds]
    devices = topo.jax_devices()
    got, states, errors = {}, {}, []

    def run(w):
        try:
            bridge = Bridge(w.index, addresses, transport, timeout_s=60)
            ex = WorldsExecutor(plan, topo, trainer.model_cfg, trainer.tx, trainer.schedule,
                                trainer.config.train.grad_clip, worlds, w.index, owner, bridge,
                                devices=[devices[r] for r in w.ranks])
            st, losses = ex.init_state(trainer.config.train.seed), []
            for b in batches:
                st, metrics = ex.step(st, ex.put_batch(b))
                losses.append(float(metrics["loss"]))
            ex.finish()
            bridge.close()
            got[w.index], states[w.index] = losses, st
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in worlds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for w in worlds:
        np.testing.assert_allclose(got[w.index], want, rtol=1e-6)
    # each world's stage parameters equal the single-world executor's
    for w in worlds:
        (s,) = w.stages
        mine = jax.device_get(states[w.index].stages[0].params)
        theirs = jax.device_get(state.stages[s].params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     mine, theirs)
