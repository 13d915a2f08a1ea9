"""Two worlds x two processes on CPU (gloo inside each world, the bridge between) train with
the same losses as one process on the same devices: `scripts.bench.experiments.worlds`.

    python scripts/bench/check_worlds.py                 # 10 steps, compare with one process
    python scripts/bench/check_worlds.py --die p3:4      # kill process 3 before step 4: all stop
    python scripts/bench/check_worlds.py --config.parallel.dp=4 --config.parallel.tp=1
    python scripts/bench/check_worlds.py --smoke         # 2 steps
"""

import sys

if __package__:  # python -m scripts.bench.check_worlds
    from .experiments.worlds import main
else:  # python scripts/bench/check_worlds.py: Python puts scripts/bench/ first on sys.path
    from experiments.worlds import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv and argv[0] in ("worker", "reference"):
        sys.exit(main(argv))
    sys.exit(main(["check", *argv]))
