"""Input pipeline throughput against the train step's consumption, as a table.

    python scripts/bench/data.py [--batches=200] [--steps=30] [--config.x.y=v ...]
    python scripts/bench/data.py --smoke [--workdir=DIR]   # seconds (the suite runs it)

Measures, on the config (default: configs/default.py, i.e. the stdlib corpus, byte tokenizer,
32 x 128 tokens per step): tokens/s of the grain loader alone (with its prefetch threads, and
reading batches one by one without them), tokens/s the train step consumes, and the mean time
the training loop waited for input per step.

--smoke: the same measurements on a tiny model (pp = tp = 1), 2 batches and 2 steps, over a
small text file (data.source=files) prepared under --workdir (default: a temporary directory),
so nothing is written outside it; the stdlib corpus's preparation is what it leaves out.
"""

import argparse
import os
import sys
import tempfile
import time


from hetjax.cli import ensure_cpu_devices  # noqa: E402
from hetjax.config import build_topology, load_config  # noqa: E402


# --smoke: a model small enough that the train step compiles in seconds; pp = tp = 1, since the
# loader and the loop's input wait do not depend on the layout (a quarter off the smoke)
SMOKE_MODEL = ["--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.n_heads=4",
               "--config.model.n_kv_heads=2", "--config.model.max_seq_len=64",
               "--config.model.n_layers=2", "--config.parallel.pp=1", "--config.parallel.tp=1",
               "--config.train.seq_len=16", "--config.train.batch_size=16",
               "--config.train.microbatches=2", "--config.data.threads=1",
               "--config.data.prefetch=2", "--config.eval.every=0"]


def smoke_corpus(workdir: str) -> list[str]:
    """A small text file under `workdir` and the overrides that prepare and read it there."""
    path = os.path.join(workdir, "corpus.txt")
    with open(os.path.abspath(__file__)) as src, open(path, "w") as f:
        f.write(src.read() * 4)
    return ["--config.data.source=files", f"--config.data.path={path}",
            f"--config.data.dir={os.path.join(workdir, 'tfds')}", *SMOKE_MODEL]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s [options] [--config.SECTION.FIELD=VALUE ...]")
    ap.add_argument("--batches", type=int, default=200, help="batches the loader is timed on")
    ap.add_argument("--steps", type=int, default=30, help="train steps timed")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, 2 batches and 2 steps over a small text file (seconds)")
    ap.add_argument("--workdir", default="", help="--smoke: where its corpus is prepared "
                    "(default: a temporary directory)")
    args, overrides = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    stray = [a for a in overrides if not a.startswith("--config.")]
    if stray:
        ap.error(f"unrecognized arguments: {' '.join(stray)}")
    if not args.smoke:
        return run({"--batches": args.batches, "--steps": args.steps}, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        return run({"--batches": 2, "--steps": 2}, [*smoke_corpus(workdir), *overrides])


def run(opts: dict, overrides: list[str]) -> int:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = load_config(os.path.join(repo, "configs", "default.py"),
                         ["--config.train.progress=False", "--config.tensorboard=False",
                          "--config.checkpoint.every=0", *overrides])
    config.train.steps = opts["--steps"]
    ensure_cpu_devices(build_topology(config).num_devices)

    from hetjax.data import make_loader
    from hetjax.tokenizer import tokenizer_from_config
    from hetjax.train import Trainer

    tokenizer = tokenizer_from_config(config.data)  # with data.add_bos, as training
    tokens = config.train.batch_size * config.train.seq_len
    n = opts["--batches"]
    rows = []

    loader, spec = make_loader(config, tokenizer)
    next(loader)  # start the threads; the first batch is not prefetched
    t = time.perf_counter()
    for _ in range(n):
        next(loader)
    rows.append(("loader, prefetching", n * tokens / (time.perf_counter() - t)))

    t = time.perf_counter()
    for k in range(n):
        loader.batch(10_000 + k)
    rows.append(("loader, one batch at a time", n * tokens / (time.perf_counter() - t)))

    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir=workdir, quiet=True)
        summary = trainer.train()
    rows.append(("train step consumes", summary["tokens_per_s"]))

    print(f"corpus {spec.corpus}, tokenizer {spec.tokenizer}, {config.train.batch_size} x "
          f"{config.train.seq_len} tokens per step, {config.data.threads} loader threads, "
          f"prefetch {config.data.prefetch}")
    print(f"| {'what':<30} | {'tokens/s':>12} | {'x train step':>12} |")
    print(f"|{'-' * 32}|{'-' * 14}|{'-' * 14}|")
    for what, tps in rows:
        print(f"| {what:<30} | {tps:>12,.0f} | {tps / summary['tokens_per_s']:>12.1f} |")
    print(f"input wait in training: {summary['input_wait_s'] * 1e3:.3f} ms per step "
          f"(step time {tokens / summary['tokens_per_s'] * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
