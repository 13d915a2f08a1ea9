"""The `hetjax` command: `hetjax <command> [--config=FILE] [--config.a.b=value ...]`.

Each command reads its config with ml_collections' `--config.x.y=v` overrides. Before JAX is
imported, the command builds the topology and, when no device count is forced yet, sets
`--xla_force_host_platform_device_count` to the topology's size, so a CPU machine simulates
exactly the devices the topology names. Errors the user can fix print as one message
(exit code 2), not a traceback; so does any OSError on an input or output path (a full disk,
a read-only directory), naming the path (`hetjax.errors.os_error_message`).
"""

from __future__ import annotations

import os
import sys

from hetjax.argv import CALIBRATE_FLAGS, CALIBRATE_OPTIONS, default_job_path, take_options
from hetjax.errors import HetjaxError, Preempted, os_error_message

USAGE = """usage: hetjax <command> [--config=FILE] [--config.SECTION.FIELD=VALUE ...]

Train language models with JAX on heterogeneous clusters.

commands:
  train      train a model (without --config: configs/default.py, the default job)
  plan       print the layout training would use (the planner's, when parallel.pp or
             parallel.tp is 0; without --config the default job with pp and tp searched)
             with predicted step time, memory, tokens/s, MFU and bubble;
             --json PATH writes the Plan, --plot PATH a PNG of the device map and timeline
  calibrate  measure compute and collectives on this job's devices; write a calibration
             file for planner.calibration (and a measured-vs-modelled plot)
  sample     continue a prompt with a trained checkpoint: --checkpoint WORKDIR --prompt TEXT
  eval       loss and perplexity of a checkpoint on a dataset: --checkpoint WORKDIR
  launch     run training as several processes: --local N, --hostfile FILE or --slurm
  topology   print the topology a config describes; --json PATH writes it as a topology
             file (docs/topology.md) that --config.topology.file reads
  tokenizer  train a SentencePiece tokenizer on the config's corpus
  export     write a checkpoint as a HuggingFace directory: --format=hf --checkpoint=WORKDIR
             --out=DIR (config.json, safetensors, tokenizer files)
  testbed    emulate the topology on this machine (root): up | measure | smoke | run | down
  help       show this message

Examples:
  hetjax train --config=configs/default.py --config.train.steps=100
  hetjax plan --json plan.json --plot plan.png
  hetjax topology --config.topology.preset=holmes_hybrid
  hetjax launch --local 4 --config.train.steps=100
  hetjax sample --checkpoint=runs/default --prompt="def main(" --max_new_tokens=40
  hetjax eval --checkpoint=runs/default --config.eval.batches=8
  hetjax tokenizer train --vocab_size=4096 --out=tok.model --config.data.source=stdlib
  sudo hetjax testbed measure --config.topology.nodes=2

Every command takes --verbose: also show what third-party libraries print (tfds's dataset
preparation banners and progress bars, absl warnings; under launch, gloo's connection lines).

Run 'hetjax <command> --help' for a command's flags.
"""


def ensure_cpu_devices(n: int) -> None:
    """Ask XLA for n simulated host devices (`hardware.simulated_cpu_flags`) before jax
    starts; a flag the user already set (a device count, a collective timeout) keeps its
    value."""
    from hetjax.core.hardware import merge_xla_flags, simulated_cpu_flags

    os.environ["XLA_FLAGS"] = merge_xla_flags(os.environ.get("XLA_FLAGS", ""),
                                              simulated_cpu_flags(n), override=False)


PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")


def check_output_path(flag: str, path: str, formats: tuple[str, ...] = (),
                      example: str = "out.json", kind: str = "a plot") -> None:
    """An output file flag is checked before the work it saves: not a directory, in a
    writable directory, and (for `kind`, a plot or a results file) in a format we write."""
    where = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        name = f"out.{formats[0]}" if formats else example
        raise HetjaxError(f"--{flag}={path}: is a directory; fix: give a file name, e.g. "
                          f"--{flag}={os.path.join(path, name)}")
    if not os.path.isdir(where) or not os.access(where, os.W_OK):
        raise HetjaxError(f"--{flag}={path}: directory {where} does not exist or is not "
                          f"writable; fix: create it, or give a path in an existing one")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if formats and ext not in formats:
        raise HetjaxError(f"--{flag}={path}: cannot write {kind} as "
                          f"{'.' + ext if ext else 'a file without an extension'}; fix: end the"
                          " name with one of "
                          f"{', '.join('.' + f for f in formats)}")


def _split_config_args(command: str, argv: list[str]) -> tuple[str | None, list[str]]:
    path, overrides = None, []
    for a in argv:
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
        elif a.startswith("--config."):
            overrides.append(a)
        elif a not in ("-h", "--help"):
            raise HetjaxError(f"unknown argument {a!r}; flags look like --config=FILE or "
                              f"--config.train.steps=100 (see 'hetjax {command} --help')")
    return path or default_job_path(), overrides


# `hetjax plan` without --config: the default job's model, data and batch on whatever topology
# the flags name, with the layout searched (the job's own pp = 2, tp = 2 fit only its topology).
PLAN_SEARCH_OVERRIDES = ("--config.parallel.pp=0", "--config.parallel.tp=0")


def _parse(command: str, argv: list[str], extra: str = "", search_without_config: bool = False):
    """Split --config / --config.* flags from the rest; load and validate the config. Without
    --config, the default job (configs/default.py); with `search_without_config`, that job with
    its layout left to the planner (overrides given still win)."""
    from hetjax import config as hconfig

    path, overrides = _split_config_args(command, argv)
    default_job = not any(a.startswith("--config=") for a in argv)
    if search_without_config and default_job:
        overrides = [*PLAN_SEARCH_OVERRIDES, *overrides]
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(command, path, overrides, extra))
        raise SystemExit(0)
    cfg = hconfig.load_config(path, overrides, default_job=default_job)
    hconfig.validate(cfg)
    return cfg


def _flat(c, prefix: str = ""):
    for k, v in c.items():
        if hasattr(v, "items"):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def help_text(command: str, path: str | None, overrides: list[str], extra: str = "") -> str:
    """Usage, then every config field: its value in the config given (--config and overrides;
    default the default job), its description, and the base default where it differs."""
    import textwrap

    from hetjax import config as hconfig

    cfg = hconfig.load_config(path, overrides)
    base = dict(_flat(hconfig.base_config()))
    order = {k: i for i, k in enumerate(hconfig.DESCRIPTIONS)}  # base_config()'s order
    fields = sorted(_flat(cfg), key=lambda kv: order.get(kv[0], len(order)))
    width = max(len(f"{k} = {v!r}") for k, v in fields) + 2
    width = min(width, 44)
    given = os.path.relpath(path) if path else "the base defaults (hetjax.config.base_config)"
    header = (f"Config fields, with the values of {given}"
              f"{' and ' + ' '.join(overrides) if overrides else ''}; '*' marks a value that "
              "differs from the base default (given after the description).")
    lines = [f"usage: hetjax {command} [--config=FILE] [--config.SECTION.FIELD=VALUE ...]{extra}",
             "", *textwrap.wrap(header, 100)]
    section = None
    for key, value in fields:
        top = key.split(".")[0] if "." in key else ""
        if top != section:
            section = top
            lines.append(f"\n  [{top}]" if top else "")
        shown = f"{key} = {_show(value)}"
        desc = hconfig.DESCRIPTIONS.get(key, "")
        if key in base and base[key] != value:
            shown = "*" + shown
            desc += f" (base default: {_show(base[key])})"
        else:
            shown = " " + shown
        wrapped = textwrap.wrap(desc, 100 - width - 4) or [""]
        if len(shown) > width:
            lines.append(f"   {shown}")
            lines += [f"   {'':<{width}} {w}" for w in wrapped]
        else:
            lines.append(f"   {shown:<{width}} {wrapped[0]}")
            lines += [f"   {'':<{width}} {w}" for w in wrapped[1:]]
    return "\n".join(lines)


def _show(value) -> str:
    """A value as the --config.x=VALUE flag takes it (tuples as (3, 1), strings quoted)."""
    if isinstance(value, tuple):
        return "(" + ", ".join(map(str, value)) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def cmd_topology(argv: list[str]) -> int:
    """Print the config's topology; --json PATH writes it as a topology file (`-`: only the
    file, to stdout), which --config.topology.file reads back."""
    from hetjax import config as hconfig
    from hetjax.core.topology_file import topology_to_json, write_topology

    opts, rest = take_options(argv, ("json",))
    if opts.get("json", "-") != "-":
        check_output_path("json", opts["json"], example="topology.json")
    cfg = _parse("topology", rest, " [--json PATH]")
    topology = hconfig.build_topology(cfg)
    if opts.get("json") == "-":
        print(topology_to_json(topology), end="")
        return 0
    print(topology.describe())
    if "json" in opts:
        print(f"wrote {write_topology(topology, opts['json'])}; use it: "
              f"--config.topology.file={opts['json']}")
    return 0


def _start_devices(cfg):
    """The config's topology and this process's place in a multi-process job (None: not a
    worker), with this process's JAX devices ready for it: a worker of a
    multi-process job (`hetjax launch` sets HETJAX_* variables; a SLURM task of a multi-world
    job first derives its world's, `hetjax.worker.join_slurm_worlds`) joins the job; a lone process
    asks for the topology's number of simulated CPU devices (used where JAX finds no
    accelerator)."""
    from hetjax import config as hconfig
    from hetjax.distributed import ENV_CLUSTER, WorkerSpec

    topology = hconfig.build_topology(cfg)
    if os.environ.get(ENV_CLUSTER) == "slurm":
        from hetjax.worker import join_slurm_worlds

        join_slurm_worlds(cfg, topology)
    spec = WorkerSpec.from_environ()
    if spec is None:
        ensure_cpu_devices(topology.num_devices)
    else:
        from hetjax.worker import prepare_worker

        prepare_worker(cfg, topology, spec)
    return topology, spec


def cmd_train(argv: list[str]) -> int:
    cfg = _parse("train", argv)
    topology, spec = _start_devices(cfg)
    from hetjax.train import Trainer

    trainer = Trainer.from_config(cfg, topology=topology)
    if spec is None or spec.process_id == 0:
        print(trainer.describe(), flush=True)
    trainer.train()
    return 0


TESTBED_USAGE = """usage: hetjax testbed up|measure|smoke|run|down [--scale=S]
         [--cpus=N|CLUSTER:N,...] [--seconds=S] [--order=HOST,...] [--timeout=S] [--force]
         [--config=FILE] [--config.SECTION.FIELD=VALUE ...]

Emulate the config's topology on this machine (needs root): one network namespace per node,
links shaped with tc per link class, optional CPU quotas per host (see docs/testbed.md).
  up       build it, print its hosts and how to enter one, hold until Ctrl-C, tear down
  measure  build it, time a socket transfer per link class: measured vs configured rate
  smoke    build it, run a 2-process jax.distributed psum across the shaped inter-cluster link
  run      build it, run `hetjax launch` with one `hetjax train` worker per emulated host
           (the --config flags go to the workers), then print the bytes each link class carried
  down     remove what crashed runs left (a run whose owner process lives stays unless --force)
flags:
  --scale=S    every link rate times S (default 0.002: InfiniBand 200 Gb/s -> 400 Mbit/s)
  --cpus=N     CPU quota per host: N CPUs for the fastest accelerator kind, the others fewer
               by peak TFLOPS; or per cluster, e.g. --cpus=ib:1,roce:0.5 (default: no quota)
  --seconds=S  measure: how long each transfer lasts at the configured rate (default 0.5)
  --order=H,.. run: hosts in process order (default: topology node order, process i on host i)
  --timeout=S  run: stop the job after S seconds (default 1800)
  --force      down: also remove runs whose owner process is alive
"""


def cmd_testbed(argv: list[str]) -> int:
    import argparse
    import shlex
    import time

    from hetjax import linkcheck, testbed

    if not argv or argv[0] in ("-h", "--help", "help"):
        print(TESTBED_USAGE)
        return 0
    parser = argparse.ArgumentParser(prog="hetjax testbed", usage=TESTBED_USAGE[len("usage: "):],
                                     allow_abbrev=False)
    parser.add_argument("action", choices=("up", "measure", "smoke", "run", "down"))
    parser.add_argument("--scale", type=float, default=testbed.DEFAULT_SCALE)
    parser.add_argument("--cpus", type=testbed.parse_cpus, default=None)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--order", type=lambda v: [h for h in v.split(",") if h], default=None)
    parser.add_argument("--timeout", type=float, default=1800)
    args, config_argv = parser.parse_known_args(argv)
    if args.action == "down":
        removed, kept = testbed.cleanup(force=args.force)
        print(f"removed testbed runs: {', '.join(removed) or 'none'}")
        for message in kept:
            print(f"kept: {message}")
        return 0
    from hetjax import config as hconfig

    topology = hconfig.build_topology(_parse("testbed", config_argv))
    with testbed.Testbed(topology, scale=args.scale, cpus=args.cpus) as tb:
        print(f"{topology.describe()}\n{tb.describe()}", flush=True)
        if args.action == "run":
            before = {h.name: tb.class_bytes(h) for h in tb.hosts}
            rc = tb.launch(config_argv, args.order, timeout=args.timeout).wait()
            traffic = {h.name: {c: n - before[h.name][c] for c, n in tb.class_bytes(h).items()}
                       for h in tb.hosts}
            print(f"traffic per link class during the run:\n"
                  f"{linkcheck.format_traffic(tb, traffic)}")
            return rc
        if args.action == "measure":
            print(linkcheck.format_table(tb.measure_links(seconds=args.seconds), tb.scale))
        elif args.action == "smoke":
            result = linkcheck.psum_smoke(tb)
            print(result.describe())
            return 0 if result.ok and result.crossed_shaped_link else 1
        else:
            print("enter a host with:\n  " + shlex.join(tb.command(tb.hosts[0], ["bash"])))
            print("the testbed is up; Ctrl-C (or SIGTERM) tears it down", flush=True)
            while True:
                time.sleep(3600)
    return 0


def cmd_launch(argv: list[str]) -> int:
    from hetjax.launch import main as launch_main

    return launch_main(argv)


TOKENIZER_USAGE = """usage: hetjax tokenizer train --vocab_size=N --out=PATH
                              [--config=FILE] [--config.data.*=...]

Trains a SentencePiece (BPE, byte fallback) tokenizer on the training documents of the
config's corpus (data.source stdlib or files) and writes the model to PATH. Train with it:
  hetjax train --config.data.tokenizer=PATH
"""


def cmd_tokenizer(argv: list[str]) -> int:
    if not argv or argv[0] != "train" or any(a in ("-h", "--help") for a in argv):
        print(TOKENIZER_USAGE)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    opts, rest = {"--vocab_size": "4096", "--out": ""}, []
    for a in argv[1:]:
        key = a.split("=", 1)[0]
        if key in opts and "=" in a:
            opts[key] = a.split("=", 1)[1]
        else:
            rest.append(a)
    if not opts["--out"]:
        raise HetjaxError("hetjax tokenizer train needs --out=PATH, the model file to write")
    if not opts["--vocab_size"].isdigit() or int(opts["--vocab_size"]) < 260:
        raise HetjaxError(f"--vocab_size={opts['--vocab_size']} is not a whole number >= 260 "
                          "(the 256 byte pieces and a few specials); use e.g. 4096")
    check_output_path("out", opts["--out"], example="tok.model")  # before training, not after
    cfg = _parse("tokenizer train", rest)
    from hetjax.data import train_tokenizer

    tok, n_docs, where = train_tokenizer(cfg.data, int(opts["--vocab_size"]), opts["--out"])
    print(f"wrote {opts['--out']}: SentencePiece BPE, {tok.vocab_size} tokens, trained on "
          f"{n_docs} documents of {where}\nuse it: hetjax train "
          f"--config.data.tokenizer={opts['--out']}")
    return 0


def _attention_lines(model, topology, seq_len: int) -> list[str]:
    """The attention kernel model.attention takes on each accelerator kind of the topology."""
    from hetjax.layers.attention_kernels import choose_for_accelerator

    kinds = {c.accelerator.name: c.accelerator for c in topology.clusters}
    lines = []
    for name, acc in kinds.items():
        choice = choose_for_accelerator(model.attention, acc.vendor, name, model.dtype,
                                        model.head_dim, seq_len, model.sliding_window)
        lines.append(f"attention: {choice}" + (f" on {name}" if len(kinds) > 1 else ""))
    return lines


def cmd_plan(argv: list[str]) -> int:
    """Print (and optionally save and draw) the Plan `hetjax train` would use, and the
    runners-up when the planner chose it."""
    from hetjax import config as hconfig
    from hetjax.core.plan import comparison_table
    from hetjax.planner.config_plan import plan_job

    opts, rest = take_options(argv, ("json", "plot"))
    for name, path in opts.items():  # checked before the plan is computed
        check_output_path(name, path, PLOT_FORMATS if name == "plot" else ())
    cfg = _parse("plan", rest, " [--json PATH] [--plot PATH]", search_without_config=True)
    topology = hconfig.build_topology(cfg)
    job = plan_job(cfg, topology, explain=True)
    plan, runners_up, model = job.plan, job.runners_up, job.model
    print(topology.describe())
    print(plan.describe(topology))
    if "step_time_s" not in plan.predicted:
        print("  predicted: not priced (the cost model prices stages that share one (dp, tp) "
              "shape)")
    from hetjax.planner.breakdown import breakdown_lines

    for line in breakdown_lines(job.breakdown) if job.breakdown else ():  # (priced plans)
        print(line)
    if job.what_if_lines:
        print("what if (the planner on the changed cluster):")
        for line in job.what_if_lines:
            print("  " + line)
    from hetjax.planner.config_plan import plausibility_lines

    for line in plausibility_lines(cfg, plan, topology):  # MFU beside the fitted range
        print(line)
    for line in _attention_lines(model, topology, plan.seq_len):
        print(line)
    from hetjax.planner.memory import fit_problem

    problem = fit_problem(plan.predicted, plan.remat or cfg.model.remat, plan.microbatches,
                          plan.zero.name)
    if problem:  # the words `hetjax train` refuses this plan with
        print(problem)
    if plan.executor == "mpmd" and plan.pp > 1:
        from hetjax.planner.worlds import world_lines
        from hetjax.parallel import nic

        for line in world_lines(plan, topology, lambda w, slot: nic.world_environment(
                topology, plan, w, slot)):
            print("  " + line)
    from hetjax.planner.search import bound_lines

    for line in bound_lines(plan):
        print(line)
    for line in job.fixed_lines:  # what leaving each field the user fixed to the planner gives
        print(line)
    from hetjax.planner.diloco_pricing import plan_lines

    for line in plan_lines(cfg, topology, plan):  # sites on slow links: DiLoCo vs synchronous
        print(line)
    from hetjax.planner.config_plan import boundary_codec_lines

    for line in boundary_codec_lines(cfg, plan, topology):  # MPMD stages on slow links
        print(line)
    if runners_up:
        print("the chosen plan (#0) and the runners-up:")
        print("\n".join("  " + line for line in
                        comparison_table([plan, *runners_up]).splitlines()))
    if "json" in opts:
        with open(opts["json"], "w") as f:
            f.write(plan.to_json(indent=1))
        print(f"wrote {opts['json']}")
    if "plot" in opts:
        from hetjax.planner.plot import plot_plan

        print(f"wrote {plot_plan(plan, topology, model, opts['plot'])}")
    return 0


CALIBRATE_USAGE = """usage: hetjax calibrate [--out=PATH] [--plot=PATH] [--profile=PATH] [--quick]
                        [--batches=1,4] [--seq_lens=64,128] [--sizes=65536,1048576,4194304]
                        [--repeats=3] [--min_sample=0.5]
                        [--config=FILE] [--config.SECTION.FIELD=VALUE ...]

Measure the cost model's inputs on the devices of this job: the model's decoder block,
forward and backward, per accelerator kind at several micro-batch sizes (--batches) and
sequence lengths (--seq_lens, default train.seq_len / 2 and train.seq_len); all-reduce,
reduce-scatter, all-gather and point-to-point per link class at several message sizes
(--sizes, bytes) and group sizes; and each operation kind the cost model prices separately:
matmuls of several sizes, attention per implementation, a memory-bound stream; and, in one
process, the layer split over each TP degree a node allows (compute profile rows). Each time comes
from --repeats samples (compute: their mean; collectives: their median), a sample being as
many back-to-back calls as last --min_sample seconds (averages out CPU quotas and clock
changes; 0: one call). It states the number of measurements and an estimate first, prints each
as it ends, and warns when a measurement's samples spread beyond 10%. --quick: one micro-batch
size and sequence length, 2 short samples, two message sizes, no pipeline-staged block and no
TP degrees: about a minute. Writes a calibration file (default
<workdir>/calibration.json) and a plot of measured vs modelled times (default next to it,
.png), and prints both tables; --profile=PATH also writes the measurements as a compute profile
(docs/planner.md). Use it: hetjax plan --config.planner.calibration=PATH (or
--config.planner.profile=PATH).
Under several processes: hetjax launch --local N --command=calibrate [--config...].
"""


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise HetjaxError(f"--{flag}={text!r}: give positive integers separated by commas, "
                          f"e.g. --{flag}=1,4")
    return values


def _seconds(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise HetjaxError(f"--{flag}={text!r}: give a number of seconds >= 0, e.g. --{flag}=0.5")
    return value


def cmd_calibrate(argv: list[str]) -> int:
    """Measure this job's devices and write a calibration file (see CALIBRATE_USAGE)."""
    if any(a in ("-h", "--help") for a in argv):
        print(CALIBRATE_USAGE)
        return 0
    quick = "--quick" in argv
    opts, rest = take_options([a for a in argv if a not in CALIBRATE_FLAGS],
                              CALIBRATE_OPTIONS)
    cfg = _parse("calibrate", rest)
    for name in ("out", "plot", "profile"):  # checked before the measurements, not after
        if opts.get(name):
            if name in ("out", "profile"):  # its directory is created when missing
                os.makedirs(os.path.dirname(os.path.abspath(opts[name])), exist_ok=True)
            check_output_path(name, opts[name], PLOT_FORMATS if name == "plot" else ())
    topology, spec = _start_devices(cfg)
    from hetjax import measure
    from hetjax.planner import model_from_config
    from hetjax.planner.calibrate import plot_calibration, save_calibration
    from hetjax.train import make_optimizer

    seq = cfg.train.seq_len
    q = measure.QUICK if quick else {}
    lead = spec is None or spec.process_id == 0
    progress = measure.Progress() if lead else None
    cal = measure.calibrate(
        topology, model_from_config(cfg, topology=topology),
        seq_lens=_ints(opts["seq_lens"], "seq_lens") if "seq_lens" in opts
        else (seq,) if quick else tuple(sorted({max(seq // 2, 8), seq})),
        batches=_ints(opts["batches"], "batches") if "batches" in opts
        else q.get("batches", measure.DEFAULT_BATCHES),
        message_bytes=_ints(opts["sizes"], "sizes") if "sizes" in opts
        else q.get("message_bytes", measure.DEFAULT_MESSAGE_BYTES),
        repeats=_ints(opts.get("repeats", str(q.get("repeats", 3))), "repeats")[0],
        min_sample_s=_seconds(opts.get("min_sample", str(q.get("min_sample_s",
                                                               measure.MIN_SAMPLE_S))),
                              "min_sample"),
        optimizer=make_optimizer(cfg.train)[0], staged=not quick, tp=not quick,
        progress=progress)
    if not lead:
        return 0
    print(progress.summary())
    out = opts.get("out") or os.path.join(cfg.workdir, "calibration.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    print(cal.describe())
    print(f"wrote {save_calibration(cal, out)}")
    print(f"wrote {plot_calibration(cal, opts.get('plot') or os.path.splitext(out)[0] + '.png')}")
    if opts.get("profile"):
        from hetjax.planner.compute_profile import save_profile

        print(f"wrote {save_profile(cal.profile(), opts['profile'])} (a compute profile)")
    print(f"use it: hetjax plan --config.planner.calibration={out}")
    return 0


EXPORT_USAGE = """usage: hetjax export --format=hf --checkpoint=PATH --out=DIR [--max_shard_mb=N]

Write a hetjax checkpoint (from any plan) as a directory transformers loads as it is:
config.json, model.safetensors (sharded with an index above --max_shard_mb, default 2048) and
the tokenizer files of the run (its model.init_from directory, or data.tokenizer).
--checkpoint is a run's workdir (its newest checkpoint), its checkpoints/ directory, or one
step directory in it.
"""


def cmd_export(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(EXPORT_USAGE)
        return 0
    opts, rest = take_options(argv, ("format", "checkpoint", "out", "max_shard_mb"))
    if rest or not opts.get("checkpoint") or not opts.get("out"):
        raise HetjaxError(f"hetjax export needs --checkpoint=PATH and --out=DIR"
                          f"{' (not ' + ' '.join(rest) + ')' if rest else ''}\n{EXPORT_USAGE}")
    if opts.get("format", "hf") != "hf":
        raise HetjaxError(f"--format={opts['format']}: the one export format is hf")
    mb = opts.get("max_shard_mb", "2048")
    if not mb.isdigit() or int(mb) < 1:
        raise HetjaxError(f"--max_shard_mb={mb} is not a whole number >= 1; use e.g. 2048")
    from hetjax import config as hconfig
    from hetjax.interop.hf_checkpoint import export_checkpoint

    files = export_checkpoint(opts["checkpoint"], opts["out"],
                              hconfig.base_config().model.to_dict(),
                              max_shard_bytes=int(mb) << 20)
    print(f"wrote {opts['out']}: {', '.join(files)}\nload it: "
          f"transformers.AutoModelForCausalLM.from_pretrained({opts['out']!r})")
    return 0


SAMPLE_USAGE = """usage: hetjax sample --checkpoint=WORKDIR --prompt=TEXT [--max_new_tokens=64]
         [--temperature=0] [--top_k=0] [--top_p=1] [--seed=0] [--step=N] [--config.x.y=v ...]

Print the prompt and its continuation by a trained checkpoint (the latest, or --step), decoded
with the run's tokenizer. The checkpoint loads under a pp = 1 plan on the run's topology,
whatever plan trained it.
  --max_new_tokens  tokens to generate at most (it stops earlier at the end-of-document token)
  --temperature     0: greedy (the most likely token each step); > 0: sample, seeded by --seed
  --top_k           sample among the k most likely tokens only (0: all)
  --top_p           sample among the most likely tokens whose probability reaches p (1: all)
"""

EVAL_USAGE = """usage: hetjax eval --checkpoint=WORKDIR [--step=N] [--config.data.x=v ...]
         [--config.eval.batches=N]

Print the loss and perplexity of a trained checkpoint (the latest, or --step) on the held-out
split of the run's data, or of the data the --config.data.* overrides name: the same batches
and numbers as the eval_loss training reports.
"""


def _checkpoint_args(command: str, argv: list[str], names: tuple[str, ...], usage: str):
    """(options, config overrides) of `hetjax sample|eval`; --help prints `usage`."""
    if any(a in ("-h", "--help") for a in argv):
        print(usage)
        raise SystemExit(0)
    opts, rest = take_options(argv, ("checkpoint", "step") + names)
    bad = [a for a in rest if not a.startswith("--config.")]
    if bad:
        raise HetjaxError(f"unknown argument {bad[0]!r} for hetjax {command}; see "
                          f"'hetjax {command} --help'")
    if "checkpoint" not in opts:
        raise HetjaxError(f"hetjax {command} needs --checkpoint=WORKDIR, the workdir of a "
                          "trained run (its config.workdir)")
    return opts, rest


def _number(opts: dict[str, str], name: str, kind, default):
    if name not in opts:
        return default
    try:
        return kind(opts[name])
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise HetjaxError(f"--{name}={opts[name]} is not {what}; e.g. "
                          f"--{name}={default if default is not None else 1}") from None


def _open_checkpoint(opts: dict[str, str], overrides: list[str], eval_data: bool = False):
    """A Trainer holding the checkpoint; with `eval_data`, the held-out split's size rules are
    checked first (`hetjax eval` reads it whatever eval.every says)."""
    from hetjax import config as hconfig
    from hetjax.corpus_size import check_corpus_size
    from hetjax.sampling import saved_config

    cfg, step = saved_config(opts["checkpoint"], overrides, _number(opts, "step", int, None))
    if eval_data:
        check_corpus_size(cfg, eval_needed=True)
    ensure_cpu_devices(hconfig.build_topology(cfg).num_devices)
    from hetjax.sampling import open_checkpoint

    return open_checkpoint(opts["checkpoint"], config=(cfg, step)), step


def cmd_sample(argv: list[str]) -> int:
    opts, overrides = _checkpoint_args(
        "sample", argv, ("prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed"),
        SAMPLE_USAGE)
    if "prompt" not in opts:
        raise HetjaxError("hetjax sample needs --prompt=TEXT, the text to continue")
    kw = dict(max_new_tokens=_number(opts, "max_new_tokens", int, 64),
              temperature=_number(opts, "temperature", float, 0.0),
              top_k=_number(opts, "top_k", int, 0), top_p=_number(opts, "top_p", float, 1.0),
              seed=_number(opts, "seed", int, 0))
    trainer, _ = _open_checkpoint(opts, overrides)
    print(opts["prompt"] + trainer.generate(opts["prompt"], **kw), flush=True)
    return 0


def cmd_eval(argv: list[str]) -> int:
    opts, overrides = _checkpoint_args("eval", argv, (), EVAL_USAGE)
    trainer, step = _open_checkpoint(opts, overrides, eval_data=True)
    from hetjax.sampling import evaluate

    r = evaluate(trainer)
    c = trainer.config
    print(f"checkpoint {step}: eval loss {r['loss']:.6f}, perplexity {r['perplexity']:.4f} "
          f"({trainer.eval_batches} batches of {c.train.batch_size} x {c.train.seq_len} "
          "tokens, "
          f"data.source={c.data.source})", flush=True)
    return 0


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "calibrate": cmd_calibrate, "launch": cmd_launch,
            "sample": cmd_sample, "eval": cmd_eval, "export": cmd_export,
            "topology": cmd_topology, "tokenizer": cmd_tokenizer, "testbed": cmd_testbed}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[1], argv[2:]
    if command != "launch" and "--verbose" in rest:  # launch has its own, passed to its workers
        from hetjax import noise

        noise.set_verbose(True)
        rest = [a for a in rest if a != "--verbose"]
    if command not in COMMANDS:
        print(f"hetjax: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](rest)
    except Preempted as e:  # SIGTERM (75) or Ctrl-C (Interrupted, 130): saved, rerun resumes
        print(f"hetjax: {e}", file=sys.stderr)
        return e.EXIT_CODE
    except HetjaxError as e:
        print(f"hetjax: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an input or output path: one line naming it, not a traceback
        print(f"hetjax: error: {os_error_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hetjax: interrupted", file=sys.stderr)
        return 130
