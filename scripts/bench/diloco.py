"""DiLoCo (H inner steps a round) against synchronous data parallelism across 3 sites joined by
a slow link: loss after the same tokens, tokens/s, bytes per step crossing the sites.

    python scripts/bench/diloco.py                       # 300 steps, H = 50, 5 Mbit/s, 20 ms
    python scripts/bench/diloco.py --steps 600 --mbps 5 --codec int8 --codec none

--testbed (root): the emulated testbed, 3 hosts (one per site) joined at --mbps; `hetjax
launch` runs the real trainer there, one `hetjax train` process a host: synchronous DP (the
plan's dp=3 gradient all-reduce every step) and DiLoCo (parallel/diloco.py's exchange across
processes). Measured: step time (the trainer's metrics), the bytes each host sent to the other
sites (htb counters) beside the planner's prediction, the held-out loss, the CPUs other
processes used during each run (timings are only clean when that is near 0).

    python scripts/bench/diloco.py --testbed --steps 300 --sync-steps 8 --H 50 --mbps 3 \
        --codec int8 --outer-lr 1 --outer-momentum 0 --json out.json
    # streamed in 2 fragments, exchanges blocking (tau 0) vs overlapped with 4 inner steps
    python scripts/bench/diloco.py --testbed --steps 100 --sync-steps 8 --H 10 --fragments 2 \
        --overlap-steps 0 --overlap-steps 4 --mix 0.5 --mbps 3 --codec int8
    # link-bound: each site capped at 0.4 CPUs (cgroup), 1 Mbit/s; no synchronous row, a run
    # without exchanges first (its step is t_inner, which the planner's predictions use)
    python scripts/bench/diloco.py --testbed --no-sync --inner-only --cpus 0.4 --steps 100 \
        --H 20 --fragments 2 --overlap-steps 0 --overlap-steps 9 --mbps 1 --codec int8

With --cpus each site's process runs in a cgroup capped at that many CPUs; the table then also
shows each site's CPU by thread (main, XLA's, the bridge's) and how often its quota ran out.

Without --testbed (one process, 3 sites of 2 simulated CPU devices): loss measured, compute
measured (the sites run one after another here, so DiLoCo's compute is over-counted against
three machines), communication modelled with hetjax/planner/diloco_pricing.py's alpha-beta ring for
the bytes each run really produces.

    python scripts/bench/diloco.py --smoke [--workdir DIR]   # seconds (the suite runs it)

--smoke: the one-process path (`run`, the same table) on a tiny model and synthetic data, 7
steps, synchronous DP and one DiLoCo row (H = 3, int8), workdirs under --workdir (default: a
temporary directory). It leaves out --testbed (root: network namespaces, tc, cgroups).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

from hetjax.cli import ensure_cpu_devices

if __package__:  # python -m scripts.bench.diloco, or imported by the suite
    from .experiments import harness
else:  # python scripts/bench/diloco.py: Python puts scripts/bench/ first on sys.path
    from experiments import harness

if "--testbed" not in sys.argv:  # in one process: 3 sites of 2 simulated devices (unless the
    ensure_cpu_devices(6)        # caller, e.g. the suite, chose a count: the sites take 6)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def three_sites(mbps: float, ms: float, devices: int = 2):
    from hetjax.core.topology import Link, Topology, make_cluster

    wan = Link("ethernet", mbps / 1000, ms * 1e3)
    return Topology(name=f"three_sites_{mbps:g}mbps",
                    clusters=tuple(make_cluster(s, 1, devices, "cpu", "infiniband")
                                   for s in ("ohio", "tokyo", "london")),
                    inter_cluster=wan)


# --smoke: a model and data that compile and step in seconds (after the run's own overrides)
SMOKE_CONFIG = ["--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.n_layers=2",
                "--config.model.n_heads=4", "--config.model.n_kv_heads=2",
                "--config.model.max_seq_len=64", "--config.data.source=synthetic",
                "--config.eval.batches=1"]
SMOKE_ARGS = {"steps": 7, "H": 3, "batch": 6, "seq_len": 16, "codec": ["int8"]}


def run(label, overrides, args, topology):
    from hetjax.config import load_config
    from hetjax.train import Trainer

    base = [f"--config.train.steps={args.steps}", f"--config.train.batch_size={args.batch}",
            f"--config.train.seq_len={args.seq_len}", "--config.checkpoint.every=0",
            f"--config.eval.every={args.steps}", "--config.eval.batches=8",
            "--config.tensorboard=False", "--config.train.progress=False",
            f"--config.workdir={args.workdir}/{label.replace(' ', '_')}"]
    cfg = load_config(None, base + [f"--config.{k}={v}" for k, v in overrides.items()] +
                      (SMOKE_CONFIG if args.smoke else []))
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


# --- the emulated testbed: the real trainer, one process per site ------------------------------
def testbed(args):
    """Build the 3-site testbed (one host per site, the inter-site rate unscaled) and run
    `hetjax launch` there (one `hetjax train` process a host): synchronous DP (the plan's dp=3
    all-reduce every step) and DiLoCo (parallel/diloco.py, the exchange across processes).
    Step time from the trainer's metrics, bytes from the hosts' htb counters, the machine's
    load recorded per run (scripts.bench.experiments.harness)."""
    CpuWatch, load_line, wait_for_quiet = (harness.CpuWatch, harness.load_line,
                                           harness.wait_for_quiet)
    from hetjax.testbed import Testbed, parse_cpus
    from hetjax.core.topology import Link, Topology, make_cluster

    t0 = time.monotonic()

    def log(msg):
        print(f"[{time.monotonic() - t0:6.0f} s] {msg}", flush=True)

    log(f"bench_diloco --testbed: {load_line()}")
    wan = Link("ethernet", args.mbps / 1000, args.ms * 1e3)
    lan = Link("ethernet", 1.0, 0.0)
    topo = Topology(name="three_sites_testbed",
                    clusters=tuple(make_cluster(s, 1, 1, "cpu", lan, intra=lan)
                                   for s in ("ohio", "tokyo", "london")), inter_cluster=wan)
    os.makedirs(args.workdir, exist_ok=True)
    topo_file = os.path.abspath(os.path.join(args.workdir, "three_sites.json"))
    with open(topo_file, "w") as f:
        f.write(topo.to_json(indent=1))
    outer = _outer(args)
    modes = [("synchronous DP", {}, args.sync_steps or args.steps)] + [
        (_label(args, tau, c), {"diloco.inner_steps": args.H, "diloco.codec": c,
                                **outer, **_overlap(args, tau)}, args.steps)
        for tau in args.overlap_steps or [0] for c in (args.codec or ["int8"])]
    if args.inner_only:  # H beyond the run: no exchange, the step is the sites' inner step
        modes.insert(1, (INNER_ONLY, {"diloco.inner_steps": args.steps + 1, **outer,
                                      "diloco.fragments": 1}, args.steps))
    results = []
    if args.no_sync:
        modes = modes[1:]
    elif args.baseline:  # the synchronous row of an earlier --json run with the same settings
        with open(args.baseline) as f:
            results.append(json.load(f)["testbed"][0])
        modes = modes[1:]
    cpus = parse_cpus(args.cpus) if args.cpus else None
    with Testbed(topo, scale=1.0, cpus=cpus) as tb:
        for label, over, steps in modes:
            cfg = [f"--config.topology.file={topo_file}", f"--config.train.steps={steps}",
                   f"--config.train.batch_size={args.batch}",
                   f"--config.train.seq_len={args.seq_len}", "--config.parallel.pp=1",
                   "--config.parallel.dp=0", "--config.parallel.tp=1",
                   "--config.train.microbatches=1",
                   # at least 4 logged intervals, the first two dropped as warm-up
                   f"--config.train.log_every={min(args.log_every, max(1, steps // 5))}",
                   f"--config.eval.every={steps}", "--config.eval.batches=8",
                   "--config.checkpoint.every=0", "--config.train.progress=False",
                   "--config.tensorboard=False", *(f"--config.{k}={v}" for k, v in over.items())]
            if args.quiet_wait:
                wait_for_quiet(log, max_wait=args.quiet_wait)
            log(f"{label}: {steps} steps ({load_line()})")
            watch = CpuWatch()
            threads = ThreadCpu(tb) if cpus is not None else None
            run = tb.train(cfg, os.path.join(args.workdir, label.replace(" ", "_")),
                           timeout=args.timeout)
            ours, others = watch.stop()
            per_thread = threads.stop() if threads else None
            if not run.ok:
                raise SystemExit(f"{label} failed:\n{run.error()}")
            rows = [m for m in run.metrics if "step_s" in m]
            # steady steps: the intervals after the first two logged ones (compilation, warm-up)
            pairs = list(zip([m["step"] for m in run.metrics], run.metrics))[1:]
            spans = [(m["step"] - prev, m["step_s"])
                     for (prev, _), (_, m) in zip(pairs, pairs[1:]) if "step_s" in m]
            step_s = sum(n * t for n, t in spans) / sum(n for n, _ in spans)
            cross = [sum(v for c, v in run.traffic[h.name].items() if c != h.cluster)
                     for h in tb.hosts]
            last = run.metrics[-1]
            # the overlapped runs' workers say how long their main thread waited for exchanges
            waits = [(float(a), float(b)) for a, b in re.findall(
                r"took ([\d.]+) s on the exchange thread, the main thread waited ([\d.]+) s",
                run.output)]
            results.append({"label": label, "steps": steps, "wall_s": run.seconds,
                            "step_s": step_s, "final_loss": last["loss"],
                            "eval_loss": last.get("eval_loss"),
                            "cross_bytes_per_step_site": sum(cross) / len(cross) / steps,
                            "cpus_ours": ours, "cpus_others": others,
                            "num_params": _num_params(args), "rows": len(rows),
                            "threads": per_thread, "exchange_waits": waits})
            log(f"{label}: {step_s * 1e3:.0f} ms a step, eval loss {last.get('eval_loss')}, "
                f"CPUs: ours {ours:.2f}, others {others:.2f}")
            if per_thread:
                log(f"{label}: {_thread_line(per_thread, steps)}")
            for i, (took, waited) in enumerate(waits):
                log(f"{label}: a site's exchanges took {took:.1f} s on the exchange thread, "
                    f"its main thread waited {waited:.1f} s for them "
                    f"({waited / steps * 1e3:.0f} ms a step)")
    print(f"testbed: 3 hosts (one per site), {args.mbps:g} Mbit/s between sites (htb; latency "
          f"not emulated), {results[0]['num_params'] / 1e6:.2f}M parameters, "
          f"{args.batch * args.seq_len} tokens a step"
          + (f", each site capped at {args.cpus} CPUs" if args.cpus else ""))
    inner = next((r["step_s"] for r in results if r["label"] == INNER_ONLY), None)
    if inner:
        print(f"predicted step: the planner's pricing (hetjax/planner/diloco_pricing.py) with t_inner = "
              f"the measured step without exchanges, {inner * 1e3:.0f} ms")
    print("run | steps | eval loss | vs first | step (measured) | predicted step | tokens/s | "
          "speed-up | bytes/step/site (counters) | predicted (planner) | CPUs others | wall")
    for r in results:
        print(_testbed_row(r, results[0], args, inner), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "testbed": results}, f, indent=1)


def _outer(args) -> dict:
    """The DiLoCo settings of the command line as config overrides."""
    return {"diloco.outer_optimizer": "sgd" if args.outer_momentum == 0 else "nesterov",
            "diloco.outer_lr": args.outer_lr, "diloco.outer_momentum": args.outer_momentum,
            "diloco.inner_lr_scale": args.inner_lr_scale, "diloco.fragments": args.fragments}


def _overlap(args, tau: int) -> dict:
    """diloco.overlap_steps tau (and diloco.mix, which only applies with tau > 0)."""
    return {"diloco.overlap_steps": tau, "diloco.mix": args.mix if tau else 0.0}


def _label(args, tau: int, codec: str) -> str:
    """A row's name; the codec last (`_testbed_row` reads it)."""
    return (f"DiLoCo H={args.H}{f' F={args.fragments}' if args.fragments > 1 else ''}"
            f"{f' tau={tau}' if tau else ''} {codec}")


def _num_params(args) -> int:
    from hetjax.config import base_config
    from hetjax.planner import model_from_config

    return model_from_config(base_config()).num_params


INNER_ONLY = "no exchange (inner steps only)"


def _testbed_row(r, first, args, inner=None) -> str:
    """One table row; "predicted" is hetjax/planner/diloco_pricing.py's bytes per step and site, and
    its step time with t_inner = `inner` (the measured step of the run without exchanges)."""
    from hetjax.config import base_config
    from hetjax.planner.diloco_pricing import payload_bytes

    n, P_, row = 3, r["num_params"], base_config().model.d_model
    tau = int(r["label"].split(" tau=")[1].split()[0]) if " tau=" in r["label"] else 0
    if r["label"] == INNER_ONLY:
        pred = 0.0
    elif r["label"].startswith("synchronous"):
        pred = 2 * (n - 1) / n * 4 * P_  # ring all-reduce of the fp32 gradient
    elif tau:  # overlapped: the bridge's all-gather, n - 1 wires a site
        pred = (n - 1) * payload_bytes(P_, r["label"].split()[-1], row) / args.H
    else:
        pred = 2 * (n - 1) / n * payload_bytes(P_, r["label"].split()[-1], row) / args.H
    step = "-"
    if inner and r["label"] == INNER_ONLY:
        step = f"{inner * 1e3:.0f} ms"
    elif inner and r["label"].startswith("DiLoCo"):
        step = f"{_predicted_step(args, r, inner, tau) * 1e3:.0f} ms"
    tokens = args.batch * args.seq_len
    tps = tokens / r["step_s"]
    vs = (f"{(r['eval_loss'] / first['eval_loss'] - 1) * 100:+.1f}%"
          if r["eval_loss"] and first["eval_loss"] and r["steps"] == first["steps"] else "-")
    return " | ".join([r["label"], str(r["steps"]),
                       f"{r['eval_loss']:.4f}" if r["eval_loss"] else "-", vs,
                       f"{r['step_s'] * 1e3:.0f} ms", step, f"{tps:,.0f}",
                       f"{tps / (tokens / first['step_s']):.2f}x",
                       f"{r['cross_bytes_per_step_site'] / 1e3:,.1f} kB",
                       f"{pred / 1e3:,.1f} kB", f"{r['cpus_others']:.2f}",
                       f"{r['wall_s']:.0f} s"])


def _predicted_step(args, r, inner: float, tau: int) -> float:
    """The planner's step time for a testbed DiLoCo row, given the measured inner step: the
    testbed's topology with its latency left out (the testbed does not emulate it)."""
    from hetjax.config import base_config
    from hetjax.planner.diloco_pricing import price, site_clusters
    from hetjax.core.topology import Link, Topology, make_cluster

    lan = Link("ethernet", 1.0, 0.0)
    topo = Topology(name="three_sites_testbed",
                    clusters=tuple(make_cluster(s, 1, 1, "cpu", lan, intra=lan)
                                   for s in ("ohio", "tokyo", "london")),
                    inter_cluster=Link("ethernet", args.mbps / 1000, 0.0))
    sites, codec = site_clusters(topo), r["label"].split()[-1]
    rows = price(topo, sites, [inner] * len(sites), r["num_params"], base_config().model.d_model,
                 args.batch * args.seq_len, args.H, codec, fragments=args.fragments,
                 overlap_steps=tau).rows
    name = f"DiLoCo H={args.H}" + ("" if codec == "none" else f" {codec}")
    if args.fragments > 1 or tau:
        name += f" F={args.fragments} overlap {tau}"
    return next(x.step_time_s for x in rows if x.name == name)


class ThreadCpu:
    """CPU seconds of every thread in the testbed's capped hosts, by kind (the process's main
    thread, XLA's `tf_*` pools, the bridge's and DiLoCo's named threads, other Python
    threads), sampled every second from /proc (a thread's last sample is kept, so a thread
    that exits loses at most a second), and each host's CFS throttling counters."""

    def __init__(self, tb):
        import threading

        self.tb, self.seen, self._stop = tb, {}, threading.Event()
        self.throttled0 = {h.name: tb.throttled(h) for h in tb.hosts}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self):
        tick = os.sysconf("SC_CLK_TCK")
        for h in self.tb.hosts:
            try:
                tids = self.tb.threads(h)
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{tid}/status") as f:
                        tgid = int(next(x for x in f if x.startswith("Tgid:")).split()[1])
                    # /proc/<tid>/stat is the whole process's; the thread's own is under task/
                    with open(f"/proc/{tgid}/task/{tid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    with open(f"/proc/{tgid}/task/{tid}/comm") as f:
                        comm = f.read().strip()
                except (OSError, StopIteration):
                    continue
                kind = ("main" if tid == tgid and comm.startswith("python") else
                        "python (other)" if comm.startswith("python") else
                        "XLA (tf_*)" if comm.startswith("tf_") else comm)
                # utime, stime: fields 14 and 15 of stat (11, 12 after the comm)
                self.seen[(h.name, tid)] = (kind, (int(fields[11]) + int(fields[12])) / tick)

    def _run(self):
        while not self._stop.wait(1.0):
            self._sample()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        out = {"threads": {}, "throttled": {}}
        for (host, _), (kind, cpu) in self.seen.items():
            d = out["threads"].setdefault(host, {})
            d[kind] = d.get(kind, 0.0) + cpu
        for h in self.tb.hosts:
            a, b = self.throttled0[h.name], self.tb.throttled(h)
            out["throttled"][h.name] = {k: b.get(k, 0) - a.get(k, 0) for k in b}
        return out


def _thread_line(t: dict, steps: int) -> str:
    """CPU ms a step by thread kind, the mean over the sites, and the share of CFS periods
    in which the sites' quota ran out."""
    hosts = list(t["threads"])
    kinds = sorted({k for d in t["threads"].values() for k in d},
                   key=lambda k: -sum(d.get(k, 0) for d in t["threads"].values()))
    parts = [f"{k} {sum(t['threads'][h].get(k, 0) for h in hosts) / len(hosts) / steps * 1e3:.0f}"
             for k in kinds]
    periods = sum(v.get("nr_periods", 0) for v in t["throttled"].values())
    thr = sum(v.get("nr_throttled", 0) for v in t["throttled"].values())
    return (f"CPU ms a step and site by thread: {', '.join(parts)}; quota ran out in "
            f"{thr / max(periods, 1) * 100:.0f}% of the CFS periods")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--H", type=int, default=50)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--mbps", type=float, default=5.0)
    ap.add_argument("--ms", type=float, default=20.0)
    ap.add_argument("--codec", action="append", default=None)
    ap.add_argument("--workdir", default="",
                    help="where the runs write (default: runs/bench_diloco; with --smoke a "
                         "temporary directory)")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: a tiny model, 7 steps, synchronous DP and DiLoCo int8, in "
                         "one process (--workdir default: a temporary directory)")
    ap.add_argument("--json", default="")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="0: plain outer SGD")
    ap.add_argument("--inner-lr-scale", type=float, default=1.0,
                    help="diloco.inner_lr_scale: the sites' learning rate is train.lr's times this")
    ap.add_argument("--fragments", type=int, default=1,
                    help="diloco.fragments: streamed, fragment f exchanged at step f H / F")
    ap.add_argument("--overlap-steps", type=int, action="append", default=None,
                    help="diloco.overlap_steps tau (repeat for several runs; default 0)")
    ap.add_argument("--mix", type=float, default=0.5,
                    help="diloco.mix for the runs with --overlap-steps > 0")
    ap.add_argument("--sync-eval-loss", type=float, default=0.0,
                    help="without --testbed: skip the synchronous run and compare the held-out "
                         "loss with this one (an earlier run's, same --steps; no speed columns)")
    ap.add_argument("--baseline", default="",
                    help="--testbed: reuse the synchronous row of this earlier --json output")
    ap.add_argument("--devices-per-site", type=int, default=2,
                    help="without --testbed: simulated CPU devices a site (at most 2)")
    ap.add_argument("--testbed", action="store_true",
                    help="run on the emulated testbed (root): one process per site")
    ap.add_argument("--sync-steps", type=int, default=0,
                    help="--testbed: time the synchronous run over this many steps (default "
                         "--steps; it is link-bound, so its step time is steady early)")
    ap.add_argument("--quiet-wait", type=float, default=900,
                    help="--testbed: wait up to this many seconds for a quiet machine before "
                         "each run (0: do not wait)")
    ap.add_argument("--log-every", type=int, default=10, help="--testbed: train.log_every")
    ap.add_argument("--cpus", default="",
                    help="--testbed: cap each site's process at this many CPUs (a cgroup "
                         "quota, hetjax.testbed's cpus=), e.g. 0.4")
    ap.add_argument("--no-sync", action="store_true",
                    help="--testbed: skip the synchronous run (speed-ups then compare with the "
                         "first row)")
    ap.add_argument("--inner-only", action="store_true",
                    help="--testbed: first a DiLoCo run without exchanges (H beyond --steps): "
                         "its step is t_inner, with which the planner's step times are shown")
    ap.add_argument("--timeout", type=float, default=3600, help="--testbed: seconds per run")
    args = ap.parse_args(argv)
    harness.check_outputs("bench_diloco", results={"json": args.json})
    if args.smoke:
        if args.testbed:
            raise SystemExit("bench_diloco: --smoke runs the one-process path; drop --testbed")
        vars(args).update(SMOKE_ARGS)
        with tempfile.TemporaryDirectory() as tmp:
            args.workdir = args.workdir or tmp
            return one_process(args)
    args.workdir = args.workdir or "runs/bench_diloco"
    if args.testbed:
        return testbed(args)
    return one_process(args)


def one_process(args):
    """Without --testbed: the runs one after another in this process, the table printed."""
    codecs = args.codec or ["none", "int8"]

    from hetjax.planner.network import ring_time
    from hetjax.planner.diloco_pricing import site_clusters, slowest_site_link

    topology = three_sites(args.mbps, args.ms, args.devices_per_site)
    sites = site_clusters(topology)
    n, link = len(sites), slowest_site_link(topology, sites)
    results = [] if args.sync_eval_loss else [run("synchronous DP", {}, args, topology)]
    for tau in args.overlap_steps or [0]:
        for codec in codecs:
            results.append(run(_label(args, tau, codec),
                               {"diloco.inner_steps": args.H, "diloco.codec": codec,
                                **_outer(args), **_overlap(args, tau)}, args, topology))
    if args.sync_eval_loss:  # losses only: the synchronous run was an earlier one
        print(f"{args.steps} steps, vs the synchronous held-out loss {args.sync_eval_loss:.4f}")
        for r in results:
            print(f"{r['label']} | loss (last 10) {r['final_loss']:.4f} | eval loss "
                  f"{r['eval_loss']:.4f} | vs sync "
                  f"{(r['eval_loss'] / args.sync_eval_loss - 1) * 100:+.1f}%", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": results}, f, indent=1)
        return
    ring = 2 * (n - 1) / n  # what a ring all-reduce sends from each site, per byte reduced
    rows = []
    for r in results:
        if r["exchanges"] is None:  # synchronous: the fp32 gradient every step
            per_exchange, every = 4.0 * r["num_params"], 1
        else:
            # an exchange moves one fragment; F of them a round
            per_exchange = r["wire_bytes"] / (n * r["exchanges"])
            every = args.H / args.fragments
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
    sys.exit(main())
