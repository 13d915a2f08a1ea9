"""Input pipeline throughput against the train step's consumption, as a table.

    python scripts/bench_data.py [--batches=200] [--steps=30] [--config.x.y=v ...]

Measures, on the config (default: configs/default.py, i.e. the stdlib corpus, byte tokenizer,
32 x 128 tokens per step): tokens/s of the grain loader alone (with its prefetch threads, and
reading batches one by one without them), tokens/s the train step consumes, and the mean time
the training loop waited for input per step.
"""

import os
import sys
import time


from hetjax.cli import ensure_cpu_devices  # noqa: E402
from hetjax.config import build_topology, load_config  # noqa: E402


def main(argv):
    opts = {"--batches": 200, "--steps": 30}
    overrides = []
    for a in argv:
        key, _, value = a.partition("=")
        if key in opts:
            opts[key] = int(value)
        else:
            overrides.append(a)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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

    import tempfile

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


if __name__ == "__main__":
    main(sys.argv[1:])
