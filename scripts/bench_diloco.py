"""DiLoCo (H inner steps a round) against synchronous data parallelism across 3 sites joined by
a slow link: loss after the same tokens, tokens/s, bytes per step crossing the sites.

    python scripts/bench_diloco.py                       # 300 steps, H = 50, 5 Mbit/s, 20 ms
    python scripts/bench_diloco.py --steps 600 --mbps 5 --codec int8 --codec none

What is measured and what is modelled (one process, 3 sites of 2 simulated CPU devices):
- loss: measured. Both runs train the same model on the same token stream of the default
  corpus (data.source=stdlib) for the same number of steps (so the same tokens); "eval" is the
  held-out loss of the final parameters (DiLoCo: the outer parameters after the last round).
- compute: measured, the steady wall time per step of each run in this process (DiLoCo's three
  sites run one after another here, so its compute is over-counted against three machines).
- communication: modelled, not measured. The inter-site time per step comes from
  hetjax/planner/diloco.py (ring all-reduce over the slowest inter-site link, alpha-beta) for
  the bytes each run really produces (sync: the fp32 gradient every step; DiLoCo: the encoded
  pseudo-gradients the executor exchanged, counted as they were sent). The emulated testbed
  (hetjax/testbed.py) is not used: the DiLoCo executor runs in one process for now.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

if "--worker" not in sys.argv:  # a testbed worker is one device of a multi-process world
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=6").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def three_sites(mbps: float, ms: float):
    from hetjax.topology import Link, Topology, make_cluster

    wan = Link("ethernet", mbps / 1000, ms * 1e3)
    return Topology(name=f"three_sites_{mbps:g}mbps",
                    clusters=tuple(make_cluster(s, 1, 2, "cpu", "infiniband")
                                   for s in ("ohio", "tokyo", "london")),
                    inter_cluster=wan)


def run(label, overrides, args, topology):
    from hetjax.config import load_config
    from hetjax.train import Trainer

    base = [f"--config.train.steps={args.steps}", f"--config.train.batch_size={args.batch}",
            f"--config.train.seq_len={args.seq_len}", "--config.checkpoint.every=0",
            f"--config.eval.every={args.steps}", "--config.eval.batches=8",
            "--config.tensorboard=False", "--config.train.progress=False",
            f"--config.workdir={args.workdir}/{label.replace(' ', '_')}"]
    cfg = load_config(None, base + [f"--config.{k}={v}" for k, v in overrides.items()])
    tr = Trainer(cfg, topology=topology, quiet=True)
    losses, times = [], []
    t = [time.perf_counter()]

    def record(info):
        losses.append(info.metrics["loss"])
        now = time.perf_counter()
        times.append(now - t[0])
        t[0] = now

    tr.add_hook(record, every=1)
    t0 = time.perf_counter()
    summary = tr.train()
    wall = time.perf_counter() - t0
    steady = statistics.median(times[5:])  # after compilation; exchanges included on average
    mean_steady = sum(times[5:]) / len(times[5:])
    ex = tr.executor
    return {"label": label, "final_loss": statistics.mean(losses[-10:]),
            "eval_loss": summary["eval_loss"], "step_s_median": steady,
            "step_s_mean": mean_steady, "wall_s": wall,
            "tokens_per_step": tr.tokens_per_step, "num_params": tr.model_cfg.num_params,
            "exchanges": getattr(ex, "exchanges", None),
            "wire_bytes": getattr(ex, "bytes_sent", None)}


# --- the emulated testbed: one process per site, real collectives over shaped links -----------
def _base_overrides(args) -> list[str]:
    return [f"--config.train.steps={args.steps}", f"--config.train.batch_size={args.batch}",
            f"--config.train.seq_len={args.seq_len}"]


def worker(args):
    """One site: a 1-device process of a 3-process jax.distributed world (gloo). 'sync'
    all-reduces the gradient every step; 'diloco' runs AdamW alone and every H steps exchanges
    the pseudo-gradient (codec none: an fp32 all-reduce; int8: an all-gather of codes and
    scales, each site averaging the decoded ones) and takes the outer Nesterov step."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.nproc, args.rank)
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.flatten_util import ravel_pytree
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from hetjax.config import load_config
    from hetjax.data import make_loader, padded_vocab
    from hetjax.diloco import dequantize, quantize
    from hetjax.tokenizer import load_tokenizer
    from hetjax.train import make_optimizer
    from layers import ModelConfig, Transformer, cross_entropy

    cfg = load_config(None, _base_overrides(args))
    tok = load_tokenizer(cfg.data.tokenizer)
    model = Transformer(ModelConfig.from_config(cfg.model, padded_vocab(tok.vocab_size)))
    n, rank = args.nproc, args.rank
    b = args.batch // n
    data, _ = make_loader(cfg, tok, np.arange(rank * b, (rank + 1) * b))
    dev = jax.local_devices()[0]
    params = jax.device_put(nn.unbox(model.init(jax.random.key(cfg.train.seed), jnp.zeros(
        (1, args.seq_len), jnp.int32))["params"]), dev)
    tx, _ = make_optimizer(cfg.train)
    opt = tx.init(params)
    flat0, unravel = ravel_pytree(params)
    mesh = Mesh(np.array(jax.devices()), ("site",))
    spread = NamedSharding(mesh, P("site"))

    def collective(fn):  # fn over the sites' stacked values, compiled once
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("site"), out_specs=P("site")))

    mean_fn = collective(lambda v: jax.lax.pmean(v, "site"))
    gather_fn = collective(lambda v: jax.lax.all_gather(v[0], "site")[None])

    def across(fn, x):  # this site's result of fn over every site's x
        glob = jax.make_array_from_single_device_arrays((n, *x.shape), spread, [x[None]])
        return fn(glob).addressable_data(0)[0]

    def pmean(x):
        return across(mean_fn, x)

    row = cfg.model.d_model
    pad = (-flat0.size) % row

    def gathered_mean_int8(x):
        q, scale = quantize(jnp.pad(x, (0, pad)).reshape(-1, row), 8)
        qs, ss = across(gather_fn, q), across(gather_fn, scale)
        deq = sum(dequantize(qs[i], ss[i], (qs.shape[1], row), 8) for i in range(n)) / n
        return deq.reshape(-1)[:x.size]

    @jax.jit
    def grads_of(p, inputs, targets):
        return jax.value_and_grad(lambda q: cross_entropy(model.apply({"params": q}, inputs),
                                                          targets))(p)

    @jax.jit
    def update(p, o, g):
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    outer_tx = optax.sgd(args.outer_lr, momentum=args.outer_momentum or None,
                         nesterov=bool(args.outer_momentum))
    theta = flat0
    outer_opt = outer_tx.init(theta)
    losses, times, exchange_s = [], [], []
    jax.block_until_ready(pmean(jnp.zeros(4)))  # connect before timing
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        batch = next(data)
        loss, g = grads_of(params, jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"]))
        if args.worker == "sync":
            g = unravel(pmean(ravel_pytree(g)[0]))
        params, opt = update(params, opt, g)
        if args.worker == "diloco" and step % args.H == 0:
            te = time.perf_counter()
            delta = theta - ravel_pytree(params)[0]
            mean = pmean(delta) if args.wire == "none" else gathered_mean_int8(delta)
            upd, outer_opt = outer_tx.update(mean, outer_opt, theta)
            theta = optax.apply_updates(theta, upd)
            params = unravel(theta)
            jax.block_until_ready(params)
            exchange_s.append(time.perf_counter() - te)
        losses.append(float(loss))
        times.append(time.perf_counter() - t0)
    with open(args.out, "w") as f:
        json.dump({"rank": rank, "losses": losses, "times": times, "exchange_s": exchange_s,
                   "num_params": int(flat0.size)}, f)
    jax.distributed.shutdown()


def testbed(args):
    """Build the 3-site testbed (one host per site, the inter-site rate unscaled) and run the
    sync and DiLoCo workers on it; bytes from the hosts' htb counters."""
    from hetjax.testbed import Testbed
    from hetjax.topology import Link, Topology, make_cluster

    wan = Link("ethernet", args.mbps / 1000, args.ms * 1e3)
    lan = Link("ethernet", 1.0, 0.0)
    topo = Topology(name="three_sites_testbed",
                    clusters=tuple(make_cluster(s, 1, 1, "cpu", lan, intra=lan)
                                   for s in ("ohio", "tokyo", "london")), inter_cluster=wan)
    os.makedirs(args.workdir, exist_ok=True)
    modes = [("synchronous DP", "sync", "none")] + [
        (f"DiLoCo H={args.H} {c}", "diloco", c) for c in (args.codec or ["none", "int8"])]
    results = []
    if args.baseline:  # the synchronous row of an earlier --json run with the same settings
        with open(args.baseline) as f:
            results.append(json.load(f)["testbed"][0])
        modes = modes[1:]
    with Testbed(topo, scale=1.0) as tb:
        for i, (label, mode, wire) in enumerate(modes):
            port = 9400 + i
            before = {h.name: tb.class_bytes(h) for h in tb.hosts}
            t0 = time.perf_counter()
            procs, outs = [], []
            for rank, h in enumerate(tb.hosts):
                out = os.path.join(args.workdir, f"{mode}_{wire}_{rank}.json")
                outs.append(out)
                log = open(out + ".log", "w")
                procs.append(tb.run(h, [sys.executable, "-u", os.path.abspath(__file__),
                                        "--worker", mode, "--wire", wire, "--rank", str(rank),
                                        "--nproc", "3", "--out", out, "--coordinator",
                                        f"{tb.address(tb.hosts[0])}:{port}",
                                        *sys.argv[1:]],
                                    env={"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"},
                                    stdout=log, stderr=subprocess.STDOUT))
            for p in procs:
                p.wait(timeout=3600)
            wall = time.perf_counter() - t0
            after = {h.name: tb.class_bytes(h) for h in tb.hosts}
            cross = [sum(v for c, v in after[h.name].items() if c != h.cluster)
                     - sum(v for c, v in before[h.name].items() if c != h.cluster)
                     for h in tb.hosts]
            ranks = [json.load(open(o)) for o in outs]
            steady = [sum(r["times"][5:]) / len(r["times"][5:]) for r in ranks]
            results.append({"label": label, "wall_s": wall, "step_s": max(steady),
                            "final_loss": float(sum(sum(r["losses"][-10:]) / 10 for r in ranks)
                                                / len(ranks)),
                            "cross_bytes_per_step_site": sum(cross) / len(cross) / args.steps,
                            "exchange_s": ranks[0]["exchange_s"],
                            "num_params": ranks[0]["num_params"]})
            if len(results) == 1 or (args.baseline and len(results) == 2):
                print(f"testbed: 3 hosts (one per site), {args.mbps:g} Mbit/s between sites "
                      f"(htb; latency not emulated), {results[0]['num_params'] / 1e6:.2f}M "
                      f"parameters, {args.steps} steps x {args.batch * args.seq_len} tokens")
                print("run | loss (last 10) | vs sync | step (measured) | tokens/s | speed-up"
                      " | bytes/step/site (counters) | predicted | wall", flush=True)
            print(_testbed_row(results[-1], results[0], args), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "testbed": results}, f, indent=1)


def _testbed_row(r, sync, args) -> str:
    """One table row; the prediction is what the algorithm the worker ran sends a site."""
    from hetjax.config import base_config

    n, P_, row = 3, r["num_params"], base_config().model.d_model
    if r["label"].startswith("synchronous"):
        pred = 2 * (n - 1) / n * 4 * P_  # ring all-reduce of the fp32 gradient
    elif r["label"].endswith("none"):
        pred = 2 * (n - 1) / n * 4 * P_ / args.H
    else:  # the testbed worker all-gathers int8 codes + scales: (n - 1) payloads a site
        rows = -(-P_ // row)
        pred = (n - 1) * (rows * row + 4 * rows) / args.H
    tokens = args.batch * args.seq_len
    tps = tokens / r["step_s"]
    return " | ".join([r["label"], f"{r['final_loss']:.4f}",
                       f"{(r['final_loss'] / sync['final_loss'] - 1) * 100:+.1f}%",
                       f"{r['step_s'] * 1e3:.0f} ms", f"{tps:,.0f}",
                       f"{tps / (tokens / sync['step_s']):.1f}x",
                       f"{r['cross_bytes_per_step_site'] / 1e3:,.1f} kB",
                       f"{pred / 1e3:,.1f} kB", f"{r['wall_s']:.0f} s"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--H", type=int, default=50)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--mbps", type=float, default=5.0)
    ap.add_argument("--ms", type=float, default=20.0)
    ap.add_argument("--codec", action="append", default=None)
    ap.add_argument("--workdir", default="runs/bench_diloco")
    ap.add_argument("--json", default="")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="0: plain outer SGD")
    ap.add_argument("--baseline", default="",
                    help="--testbed: reuse the synchronous row of this earlier --json output")
    ap.add_argument("--testbed", action="store_true",
                    help="run on the emulated testbed (root): one process per site")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--wire", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--nproc", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.testbed:
        return testbed(args)
    codecs = args.codec or ["none", "int8"]

    from hetjax.planner.cost import ring_time
    from hetjax.planner.diloco import site_clusters, slowest_site_link

    topology = three_sites(args.mbps, args.ms)
    sites = site_clusters(topology)
    n, link = len(sites), slowest_site_link(topology, sites)
    results = [run("synchronous DP", {}, args, topology)]
    for codec in codecs:
        results.append(run(f"DiLoCo H={args.H} {codec}",
                           {"diloco.inner_steps": args.H, "diloco.codec": codec}, args, topology))
    ring = 2 * (n - 1) / n  # what a ring all-reduce sends from each site, per byte reduced
    rows = []
    for r in results:
        if r["exchanges"] is None:  # synchronous: the fp32 gradient every step
            per_exchange, every = 4.0 * r["num_params"], 1
        else:
            per_exchange, every = r["wire_bytes"] / (n * r["exchanges"]), args.H
        comm = ring_time("all_reduce", per_exchange, n, link) / every
        compute = r["step_s_mean"]
        r.update(bytes_per_step_site=ring * per_exchange / every, comm_s=comm,
                 modelled_step_s=compute + comm,
                 tokens_per_s=r["tokens_per_step"] / (compute + comm))
        rows.append(r)
    sync = rows[0]
    print(f"3 sites x 2 CPU devices, link {args.mbps:g} Mbit/s {args.ms:g} ms between sites, "
          f"{sync['num_params'] / 1e6:.2f}M parameters, {args.steps} steps x "
          f"{sync['tokens_per_step']} tokens")
    head = ("run", "loss (last 10)", "eval loss", "vs sync", "compute/step", "comm/step",
            "tokens/s", "speed-up", "bytes/step/site")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join([
            r["label"], f"{r['final_loss']:.4f}", f"{r['eval_loss']:.4f}",
            f"{(r['eval_loss'] / sync['eval_loss'] - 1) * 100:+.1f}%",
            f"{r['step_s_mean'] * 1e3:.1f} ms (measured)", f"{r['comm_s'] * 1e3:.1f} ms (model)",
            f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / sync['tokens_per_s']:.1f}x",
            f"{r['bytes_per_step_site'] / 1e3:,.1f} kB"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
