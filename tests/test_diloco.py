"""DiLoCo (parallel/diloco.py) and its pricing (hetjax/planner/diloco_pricing.py): the exchange equals
synchronous data parallelism in its degenerate case, the codec keeps its error bound,
checkpoints resume mid-round, the planner's bytes and times follow the formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from hetjax.errors import ConfigError


def _config(workdir, **overrides):
    base = {"topology.nodes": 1, "topology.devices_per_node": 2,  # 2 sites of 2 devices
            "diloco.inner_steps": 1, "train.grad_clip": 0.0, "train.batch_size": 8,
            "checkpoint.every": 0, "workdir": str(workdir)}
    base.update(overrides)
    return tiny_config(**base)


def _batches(n, cfg):
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 256, (n, cfg.train.batch_size, cfg.train.seq_len + 1))
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in toks]


@pytest.mark.parametrize("lr,scale", [(0.5, 1.0), pytest.param(1.0, 0.5, marks=pytest.mark.slow)])
def test_one_inner_step_with_outer_sgd_at_lr_1_is_synchronous_data_parallelism(tmp_path, lr,
                                                                              scale):
    """H = 1, no codec, inner SGD, outer SGD lr 1: theta - mean(theta - theta_s) is the SGD
    step on the global batch; compared with a plain single-device SGD loop (at train.lr's
    schedule times diloco.inner_lr_scale)."""
    from hetjax.train import Trainer

    cfg = _config(tmp_path, **{"diloco.inner_optimizer": "sgd", "diloco.outer_optimizer": "sgd",
                               "diloco.outer_lr": 1.0, "train.lr": lr,
                               "diloco.inner_lr_scale": scale})
    tr = Trainer(cfg, quiet=True)
    assert len(tr.executor.site_execs) == 2
    params = jax.device_get(tr.params)
    sched = tr.schedule

    @jax.jit
    def sgd(p, inputs, targets, step):
        g = jax.grad(lambda q: tr.executor.loss_fn(q, inputs, targets))(p)
        return jax.tree.map(lambda a, b: a - scale * sched(step) * b, p, g)

    dev = jax.devices()[0]
    ref = jax.device_put(params, dev)
    for i, b in enumerate(_batches(3, cfg)):
        tr.step(b)
        ref = sgd(ref, jnp.asarray(b["inputs"]), jnp.asarray(b["targets"]), i)
    got, ref = jax.device_get(tr.params), jax.device_get(ref)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), ref, params))
    assert max(moved) > 1e-3  # the steps did change the parameters
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_round_trip_within_half_a_step(bits):
    from hetjax.parallel.codec import dequantize, quantize

    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 33)).astype(np.float32) * rng.uniform(0.01, 10, (6, 1))
    x[2] = 0.0  # an all-zero row
    q, scale = quantize(jnp.asarray(x), bits)
    y = np.asarray(dequantize(q, scale, x.shape, bits))
    bound = np.abs(x).max(axis=1, keepdims=True) / (2 * (2 ** (bits - 1) - 1))
    assert (np.abs(x - y) <= bound * (1 + 1e-6) + 1e-12).all()
    assert np.abs(x - y).max() > 0  # it does quantize
    assert q.nbytes == (x.size if bits == 8 else (x.size + 1) // 2)


@pytest.mark.slow  # ~40 s; the launched sites' mid-round resume and the in-flight one run here too
def test_checkpoint_resumes_mid_round_exactly(tmp_path):
    """H = 2, int8, Nesterov: 5 steps straight, saving at step 3 (mid-round); a fresh trainer
    restores step 3 and trains to 5. The checkpoint holds the sites, theta and the outer
    momentum, so both end equal."""
    from hetjax.train import Trainer

    over = {"diloco.inner_steps": 2, "diloco.codec": "int8", "train.steps": 5,
            "data.source": "synthetic", "checkpoint.async_save": False,
            "checkpoint.dir": str(tmp_path / "ckpt"),
            "topology.devices_per_node": 1}  # 2 sites of 1 device: fewer, smaller compiles
    straight = Trainer(_config(tmp_path / "a", **over, **{"checkpoint.every": 3}), quiet=True)
    straight.train()
    assert straight.executor.exchanges == 2 and 3 in straight.checkpointer.steps()
    resumed = Trainer(_config(tmp_path / "b", **over), quiet=True)
    assert resumed.restore(3) == 3
    assert resumed.executor.exchanges == 0
    resumed.train()
    assert resumed.executor.exchanges == 1  # the round that was open at step 3 closed at 4
    a, b = jax.device_get(straight.state), jax.device_get(resumed.state)
    assert int(b.step) == 5
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    # The outer momentum is in the state and moved.
    assert max(np.abs(m).max() for m in jax.tree.leaves(b.outer_opt[0])) > 0


def test_sites_and_their_errors():
    from hetjax.planner.diloco_pricing import site_clusters, site_topology
    from hetjax.core.topology import preset

    t = preset("dtfm_regional", nodes=2)
    assert [s for s, _ in site_clusters(t)] == ["virginia", "oregon", "california", "ohio"]
    sites = site_clusters(t, ("virginia+ohio", "oregon+california"))
    assert sites == [("virginia+ohio", (0, 3)), ("oregon+california", (1, 2))]
    sub = site_topology(t, (0, 3))
    assert sub.num_devices == 4 and sub.cluster_link(0, 1).bandwidth_gbps == 1.12
    with pytest.raises(ConfigError, match="diloco.sites.*in no site"):
        site_clusters(t, ("virginia", "oregon"))
    with pytest.raises(ConfigError, match="diloco.sites.*'paris' is not a cluster"):
        site_clusters(t, ("paris",))


def test_sites_run_pp_1_whatever_the_jobs_pipeline_and_no_note_says_otherwise():
    """The default job pipelines across its clusters (pp = 2); under DiLoCo each site plans
    pp = 1 inside its own clusters, with no flag to add, and the placement notes do not call
    the sites' exchange across clusters a problem a pipeline would fix."""
    from hetjax.config import build_topology, load_config
    from hetjax.planner import check_placement, plan_from_config
    from hetjax.planner.diloco_pricing import plan_sites
    from hetjax.core.topology import preset

    cfg = load_config("configs/default.py", ["--config.diloco.inner_steps=50"])
    assert cfg.parallel.pp == 2
    topology = build_topology(cfg)
    dplan = plan_sites(cfg, topology)  # what the executor runs (it reads no config)
    assert [name for name, _ in dplan.sites] == [c.name for c in topology.clusters]
    assert dplan.rows_per_site == cfg.train.batch_size // 2 and dplan.inner_steps == 50
    for plan, sub in zip(dplan.site_plans, dplan.site_topologies):
        assert (plan.pp, plan.tp, plan.dp) == (1, 2, 2) and sub.num_devices == 4
    with pytest.raises(ConfigError, match="diloco.sites.*gives one site"):
        plan_sites(cfg, preset("cpu_single"))
    whole = plan_from_config(load_config("configs/default.py", ["--config.parallel.pp=1"]),
                             topology)
    assert any("would keep them inside one cluster" in n
               for n in check_placement(whole, topology))
    assert check_placement(whole, topology, sites=True) == []


def test_pricing_follows_the_ring_formulas():
    from hetjax.core.hardware import Link
    from hetjax.planner.network import ring_time
    from hetjax.planner.diloco_pricing import payload_bytes, price, site_clusters
    from hetjax.core.topology import preset

    t = preset("dtfm_multi_university", nodes=2)  # 2 sites of 2 nodes, 1.12 Gb/s between
    sites = site_clusters(t)
    P, H = 10_000_000, 50
    pr = price(t, sites, [0.2, 0.3], P, 1000, 4096, H, "int8")
    rows = {r.name: r for r in pr.rows}
    link = Link("ethernet", 1.12, 11e3)
    sync = ring_time("all_reduce", 4 * P / 2, 2, link)  # 2 nodes a site split the exchange
    assert rows["synchronous DP across sites"].step_time_s == pytest.approx(0.3 + sync)
    assert rows["synchronous DP across sites"].bytes_per_step == pytest.approx(4 * P)
    assert rows[f"DiLoCo H={H}"].step_time_s == pytest.approx(0.3 + sync / H)
    assert rows[f"DiLoCo H={H}"].bytes_per_step == pytest.approx(4 * P / H)
    q = payload_bytes(P, "int8", 1000)
    assert q == pytest.approx(P + 4 * P / 1000)
    assert rows[f"DiLoCo H={H} int8"].bytes_per_step == pytest.approx(q / H)
    assert rows[f"DiLoCo H={H} int8 streamed"].step_time_s == pytest.approx(
        max(0.3, ring_time("all_reduce", q / 2, 2, link) / H))
    assert "DiLoCo H=50 int8" in pr.table()


def test_config_rejects_a_bad_codec_and_inner_lr_scale():
    from hetjax.config import validate

    with pytest.raises(ConfigError, match="diloco.codec"):
        validate(tiny_config(**{"diloco.codec": "fp8"}))
    with pytest.raises(ConfigError, match="diloco.inner_lr_scale"):
        validate(tiny_config(**{"diloco.inner_lr_scale": 0.0}))


def test_inner_lr_scale_scales_adamw_like_its_learning_rate():
    """diloco.inner_lr_scale k on the AdamW inner optimizer: the same updates as AdamW built
    at k train.lr (weight decay included), and the logged schedule is k times train.lr's."""
    from hetjax.parallel.diloco import inner_optimizer
    from hetjax.train import make_optimizer

    cfg = tiny_config(**{"diloco.inner_lr_scale": 0.25, "train.weight_decay": 0.1})
    tx, sched = make_optimizer(cfg.train)
    scaled, scaled_sched = inner_optimizer(cfg.diloco.inner_optimizer,
                                           cfg.diloco.inner_lr_scale, tx, sched)
    ref_cfg = tiny_config(**{"train.lr": 0.25 * cfg.train.lr, "train.weight_decay": 0.1})
    ref, ref_sched = make_optimizer(ref_cfg.train)
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)}
    sa, sb = scaled.init(p), ref.init(p)
    for step in range(3):
        g = {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)}
        ua, sa = scaled.update(g, sa, p)
        ub, sb = ref.update(g, sb, p)
        np.testing.assert_allclose(ua["w"], ub["w"], rtol=1e-6, atol=1e-9)
        assert float(scaled_sched(step + 1)) == pytest.approx(float(ref_sched(step + 1)))
    assert np.abs(np.asarray(ua["w"])).max() > 0


def test_hetjax_plan_prints_the_diloco_comparison_on_slow_sites(capsys):
    from hetjax.cli import main

    assert main(["hetjax", "plan", "--config.topology.preset=dtfm_multi_university",
                 "--config.topology.nodes=2", "--config.train.batch_size=16",
                 "--config.diloco.inner_steps=10", "--config.diloco.codec=int4",
                 "--config.parallel.pp=0", "--config.parallel.tp=0"]) == 0
    out = capsys.readouterr().out
    assert "DiLoCo across sites (diloco.* on" in out
    for row in ("synchronous, planner's layout", "synchronous DP across sites",
                "DiLoCo H=10 int4 streamed"):
        assert row in out


@pytest.mark.slow
def test_launched_sites_match_one_process_and_resume_mid_round(tmp_path):
    """`hetjax launch --local 2`, H = 2, int8, outer Nesterov: each site its own process, the
    int8 exchange a reduce-scatter (all-to-all) + all-gather across processes. 5 steps
    straight, checkpointing at step 3 (mid-round) and 5: the logged losses (the sites' mean)
    equal the one-process DilocoExecutor's. Then a second launch resumes from a copy of the
    checkpoints holding only step 3. Each site wrote its own inner state, site 0 theta and the
    outer momentum; the resumed job logs the same losses for steps 4 and 5 (step 5 starts
    from the exchange at 4: theta, momentum and each site's inner state) as the uninterrupted
    one. (One test: each launch costs two process start-ups and compiles.)"""
    import json
    import shutil

    from test_launch import TINY, config_args, hetjax, losses

    from hetjax.train import Trainer

    over = {**TINY, "train.batch_size": 8, "train.steps": 5, "checkpoint.every": 3,
            "checkpoint.async_save": False, "topology.preset": "cpu_hybrid",
            "topology.nodes": 1, "topology.devices_per_node": 2, "diloco.inner_steps": 2,
            "diloco.codec": "int8", "diloco.outer_lr": 0.7, "diloco.outer_momentum": 0.9}

    def launch(name, ckpt):
        run = hetjax("launch", "--local", "2", "--timeout", "200",
                     *config_args({**over, "workdir": str(tmp_path / name),
                                   "checkpoint.dir": str(ckpt)}))
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        with open(tmp_path / name / "metrics.jsonl") as f:
            return run.stdout, {r["step"]: r["loss"] for r in map(json.loads, f)}

    out, straight = launch("straight", tmp_path / "ckpt")
    assert "DiLoCo: 2 sites" in out and sorted(straight) == [1, 2, 3, 4, 5]
    ref = losses(Trainer(tiny_config(**over, workdir=str(tmp_path / "one"),
                                     **{"checkpoint.dir": str(tmp_path / "ckpt_one")}),
                         quiet=True).train()["metrics"])
    np.testing.assert_allclose([straight[k] for k in range(1, 6)], ref, rtol=1e-5)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt3")
    shutil.rmtree(tmp_path / "ckpt3" / "5")  # as if the job had stopped after step 3
    out, resumed = launch("resumed", tmp_path / "ckpt3")
    assert "resumed from checkpoint 3" in out
    assert sorted(resumed) == [4, 5]
    np.testing.assert_allclose([resumed[4], resumed[5]], [straight[4], straight[5]], rtol=1e-6)
    assert straight[4] != straight[5]


@pytest.mark.slow  # the overlapped-exchange test below is the default tier's
def test_streamed_fragments_follow_a_plain_reference_and_the_planners_bytes(tmp_path):
    """Streaming DiLoCo: H = 2, 2 sites, inner SGD, outer Nesterov, no codec; with F = 2
    fragment 1 is exchanged at steps 1, 3 and fragment 0 at 2, 4, each with its own outer
    momentum (F = 1: today's DiLoCo, all at 2, 4). The theta and the sites' parameters equal
    a plain single-device loop of the same algorithm (with F = 1 the same loop is today's
    DiLoCo, which the other tests cover); the bytes a site sends per step equal
    the planner's streamed row (2 sites: the ring sends the payload once)."""
    import optax

    from hetjax.planner.diloco_pricing import price, site_clusters
    from hetjax.train import Trainer

    H, steps, fragments = 2, 4, 2
    cfg = _config(tmp_path, **{"diloco.inner_optimizer": "sgd", "diloco.outer_optimizer":
                               "nesterov", "diloco.outer_lr": 0.8, "diloco.outer_momentum": 0.5,
                               "diloco.inner_steps": H, "diloco.fragments": fragments,
                               "train.lr": 0.5, "topology.devices_per_node": 1})
    tr = Trainer(cfg, quiet=True)
    ex = tr.executor
    params = jax.device_get(tr.params)
    leaves, treedef = jax.tree.flatten(params)
    frags = ex.fragments or [list(range(len(leaves)))]
    assert sorted(j for f in frags for j in f) == list(range(len(leaves)))
    assert len(frags) == fragments and all(frags)
    sched, n, b = tr.schedule, 2, cfg.train.batch_size // 2
    grad = jax.jit(jax.grad(ex.loss_fn))
    outer = optax.sgd(0.8, momentum=0.5, nesterov=True)
    dev = jax.devices()[0]
    theta = [jax.device_put(x, dev) for x in leaves]
    sites = [list(theta) for _ in range(n)]
    opts = [outer.init([theta[j] for j in f]) for f in frags]
    for t, batch in enumerate(_batches(steps, cfg), 1):
        tr.step(batch)
        for s in range(n):
            g = grad(treedef.unflatten(sites[s]), jnp.asarray(batch["inputs"][s * b:(s + 1) * b]),
                     jnp.asarray(batch["targets"][s * b:(s + 1) * b]))
            sites[s] = [p - sched(t - 1) * q for p, q in zip(sites[s], jax.tree.leaves(g))]
        for f, idx in enumerate(frags):
            if t % H == f * H // fragments:
                th = [theta[j] for j in idx]
                delta = [a - sum(sites[s][j] for s in range(n)) / n for a, j in zip(th, idx)]
                upd, opts[f] = outer.update(delta, opts[f], th)
                for j, x in zip(idx, optax.apply_updates(th, upd)):
                    theta[j] = x
                    for s in range(n):
                        sites[s][j] = x
    assert ex.exchanges == 2 * fragments
    got = jax.device_get(tr.state)
    np.testing.assert_array_less(1e-3, max(np.abs(a - np.asarray(c)).max()
                                           for a, c in zip(leaves, theta)))  # theta moved
    for s in range(n):
        for a, c in zip(jax.tree.leaves(got.outer[s]), theta):
            np.testing.assert_allclose(a, c, rtol=2e-5, atol=2e-6)
        for d, c in zip(jax.tree.leaves(got.sites[s].params), sites[s]):
            np.testing.assert_allclose(d, c, rtol=2e-5, atol=2e-6)
    P_ = sum(x.size for x in leaves)
    pr = price(tr.topology, site_clusters(tr.topology), [0.1, 0.1], P_, 1,
               tr.tokens_per_step, H, "none")
    row = {r.name: r for r in pr.rows}[f"DiLoCo H={H} streamed"]
    assert ex.bytes_sent / n / steps == pytest.approx(row.bytes_per_step)


@pytest.mark.parametrize("H,fragments,tau,mix,steps",
                         [pytest.param(4, 2, 1, 0.5, 8, marks=pytest.mark.slow),
                          pytest.param(3, 1, 2, 0.0, 9, marks=pytest.mark.slow)])
def test_overlapped_exchanges_land_tau_steps_later_as_a_plain_reference(tmp_path, H, fragments,
                                                                         tau, mix, steps):
    """Streaming DiLoCo with overlap (diloco.overlap_steps tau): the pseudo-gradients of a
    fragment are taken at its step t, the outer step lands at t + tau, and each site then
    keeps mix x its fragment (trained tau more steps) + (1 - mix) x the new theta. 2 sites,
    inner SGD, outer Nesterov, no codec; the last exchange is still in flight at the end.
    Theta and both sites' parameters equal a plain single-device loop of that arithmetic."""
    import optax

    from hetjax.train import Trainer

    cfg = _config(tmp_path, **{"diloco.inner_optimizer": "sgd", "diloco.outer_optimizer":
                               "nesterov", "diloco.outer_lr": 0.8, "diloco.outer_momentum": 0.5,
                               "diloco.inner_steps": H, "diloco.fragments": fragments,
                               "diloco.overlap_steps": tau, "diloco.mix": mix,
                               "train.lr": 0.5, "topology.devices_per_node": 1})
    tr = Trainer(cfg, quiet=True)
    ex = tr.executor
    params = jax.device_get(tr.params)
    leaves, treedef = jax.tree.flatten(params)
    frags = ex.fragments
    assert len(frags) == fragments and sorted(j for f in frags for j in f) == \
        list(range(len(leaves)))
    sched, n, b = tr.schedule, 2, cfg.train.batch_size // 2
    grad = jax.jit(jax.grad(ex.loss_fn))
    outer = optax.sgd(0.8, momentum=0.5, nesterov=True)
    dev = jax.devices()[0]
    theta = [jax.device_put(x, dev) for x in leaves]
    sites = [list(theta) for _ in range(n)]
    opts = [outer.init([theta[j] for j in f]) for f in frags]
    sent, landed = {}, 0
    for t, batch in enumerate(_batches(steps, cfg), 1):
        tr.step(batch)
        for s in range(n):
            g = grad(treedef.unflatten(sites[s]), jnp.asarray(batch["inputs"][s * b:(s + 1) * b]),
                     jnp.asarray(batch["targets"][s * b:(s + 1) * b]))
            sites[s] = [p - sched(t - 1) * q for p, q in zip(sites[s], jax.tree.leaves(g))]
        for f, idx in enumerate(frags):
            if t - tau >= 1 and (t - tau) % H == f * H // fragments:  # lands
                th = [theta[j] for j in idx]
                upd, opts[f] = outer.update(sent.pop(f), opts[f], th)
                for j, x in zip(idx, optax.apply_updates(th, upd)):
                    theta[j] = x
                    for s in range(n):
                        sites[s][j] = mix * sites[s][j] + (1 - mix) * x
                landed += 1
            if t % H == f * H // fragments:  # sent
                sent[f] = [theta[j] - sum(sites[s][j] for s in range(n)) / n for j in idx]
    assert sent and ex.exchanges == landed >= 2  # one still in flight at the end
    got = jax.device_get(tr.state)
    np.testing.assert_array_less(1e-3, max(np.abs(a - np.asarray(c)).max()
                                           for a, c in zip(leaves, theta)))  # theta moved
    for s in range(n):
        for a, c in zip(jax.tree.leaves(got.outer[s]), theta):
            np.testing.assert_allclose(a, c, rtol=2e-5, atol=2e-6)
        for d, c in zip(jax.tree.leaves(got.sites[s].params), sites[s]):
            np.testing.assert_allclose(d, c, rtol=2e-5, atol=2e-6)


@pytest.mark.slow  # ~2 min
def test_checkpoint_resumes_with_an_exchange_in_flight_exactly(tmp_path):
    """H = 4, F = 2, tau = 1, int8: saved at step 4, when fragment 0's exchange (started at 4)
    is in flight; a fresh trainer restores step 4, sends the saved pseudo-gradients again at
    its landing (step 5) and ends equal to the uninterrupted run."""
    from hetjax.train import Trainer

    over = {"diloco.inner_steps": 4, "diloco.fragments": 2, "diloco.overlap_steps": 1,
            "diloco.mix": 0.5, "diloco.codec": "int8", "train.steps": 6,
            "data.source": "synthetic", "checkpoint.async_save": False,
            "checkpoint.dir": str(tmp_path / "ckpt"), "topology.devices_per_node": 1}
    straight = Trainer(_config(tmp_path / "a", **over, **{"checkpoint.every": 4}), quiet=True)
    straight.train()
    assert 4 in straight.checkpointer.steps()
    resumed = Trainer(_config(tmp_path / "b", **over), quiet=True)
    assert resumed.restore(4) == 4
    resumed.train()
    assert resumed.executor.exchanges == 1  # fragment 0's, landing at 5 from the checkpoint
    a, b = jax.device_get(straight.state), jax.device_get(resumed.state)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_config_rejects_bad_overlap_and_mix():
    from hetjax.config import validate

    with pytest.raises(ConfigError, match="diloco.overlap_steps.*do not fit.*every inner_steps"
                                          " / fragments = 5"):
        validate(tiny_config(**{"diloco.inner_steps": 10, "diloco.fragments": 2,
                                "diloco.overlap_steps": 5}))
    with pytest.raises(ConfigError, match="diloco.overlap_steps.*integer >= 0"):
        validate(tiny_config(**{"diloco.inner_steps": 10, "diloco.overlap_steps": -1}))
    with pytest.raises(ConfigError, match="diloco.mix.*\\[0, 1\\)"):
        validate(tiny_config(**{"diloco.inner_steps": 10, "diloco.overlap_steps": 2,
                                "diloco.mix": 1.0}))
    with pytest.raises(ConfigError, match="diloco.mix.*overlap_steps = 0"):
        validate(tiny_config(**{"diloco.inner_steps": 10, "diloco.mix": 0.5}))
    validate(tiny_config(**{"diloco.inner_steps": 10, "diloco.fragments": 2,
                            "diloco.overlap_steps": 4, "diloco.mix": 0.5}))


def test_pricing_hides_a_fragments_exchange_behind_tau_inner_steps():
    """The planner's overlapped row against a hand computation: 2 sites of 1 node, 10 Mbit/s,
    no latency, P = 1e6 in int8 with rows of 1000 (q = 1.004 MB), F = 2: one fragment's
    all-gather sends q / 2 = 0.502 MB a site, 0.4016 s; t_inner 0.1 s."""
    from hetjax.planner.diloco_pricing import price, site_clusters
    from hetjax.core.topology import Link, Topology, make_cluster

    wan = Link("ethernet", 0.01, 0.0)
    t = Topology(name="two", clusters=tuple(make_cluster(s, 1, 1, "cpu", "infiniband")
                                            for s in ("a", "b")), inter_cluster=wan)
    sites, P, H = site_clusters(t), 1_000_000, 10
    one = 0.502e6 * 8 / 1e7  # seconds of wire for one fragment
    for tau, exposed in ((0, one), (2, one - 0.2), (5, 0.0)):
        rows = {r.name: r for r in price(t, sites, [0.1, 0.08], P, 1000, 4096, H, "int8",
                                         fragments=2, overlap_steps=tau).rows}
        r = rows[f"DiLoCo H={H} int8 F=2 overlap {tau}"]
        assert r.step_time_s == pytest.approx(0.1 + 2 * exposed / H)
        assert r.sync_time_s == pytest.approx(one)
        assert r.bytes_per_step == pytest.approx(1.004e6 / H)  # (n - 1) q / H = q / H
    plain = {r.name for r in price(t, sites, [0.1, 0.08], P, 1000, 4096, H, "int8").rows}
    assert not any("overlap" in name for name in plain)
    # 3 sites, 5 ms a hop: the overlapped all-gather sends a site's wire to both others at
    # once (one flow each), 0.005 + 0.4016 s; the blocking ring all-reduce of the fragment
    # takes 2 (n - 1) = 4 hops of 0.005 + 0.502e6 / 3 bytes, 0.02 + 4 x 0.13387 s
    t3 = Topology(name="three", clusters=tuple(make_cluster(s, 1, 1, "cpu", "infiniband")
                                               for s in ("a", "b", "c")),
                  inter_cluster=Link("ethernet", 0.01, 5000.0))
    for tau, step in ((0, 0.1 + 2 * (0.02 + 4 * 0.502e6 / 3 * 8 / 1e7) / H),
                      (3, 0.1 + 2 * (0.005 + one - 0.3) / H)):
        rows = {r.name: r for r in price(t3, site_clusters(t3), [0.1] * 3, P, 1000, 4096, H,
                                         "int8", fragments=2, overlap_steps=tau).rows}
        assert rows[f"DiLoCo H={H} int8 F=2 overlap {tau}"].step_time_s == pytest.approx(step)


@pytest.mark.slow
def test_launched_sites_with_overlap_match_the_one_process_executor(tmp_path):
    """`hetjax launch --local 2` with diloco.overlap_steps 1 (H = 4, F = 2, int8, mix 0.5):
    each fragment's wires cross between the processes over the bridge on a background thread
    while the next step runs; the logged losses equal the one-process executor's (the same
    mean, formed on each site by the same function)."""
    from test_launch import TINY, config_args, hetjax, losses

    from hetjax.train import Trainer

    over = {**TINY, "train.batch_size": 8, "train.steps": 7, "checkpoint.every": 0,
            "train.log_every": 1, "topology.preset": "cpu_hybrid", "topology.nodes": 1,
            "topology.devices_per_node": 2, "diloco.inner_steps": 4, "diloco.fragments": 2,
            "diloco.overlap_steps": 1, "diloco.mix": 0.5, "diloco.codec": "int8"}
    one = Trainer(tiny_config(**over, workdir=str(tmp_path / "one")), quiet=True)
    ref = losses(one.train()["metrics"])
    assert one.executor.exchanges == 3  # landed at 3, 5, 7 (fragment 1, 0, 1)
    run = hetjax("launch", "--local", "2", "--timeout", "200",
                 *config_args({**over, "workdir": str(tmp_path / "multi")}))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "overlapped with 1 inner steps" in run.stdout
    got = losses(tmp_path / "multi" / "metrics.jsonl")
    assert len(got) == 7 and got[0] != got[6]
    np.testing.assert_allclose(got, ref, rtol=1e-6)
