"""Heterogeneous NICs (Holmes) on the emulated cluster: where each parallelism's traffic goes.

    sudo python scripts/bench/hetnet.py                   # the tables, docs/img/bench_hetnet.png
    sudo python scripts/bench/hetnet.py --steps 4 --out /tmp/x.png   # a quicker look

The experiment is scripts/bench/experiments/hetnet.py (its docstring says what runs and how it is
predicted); this file is its command line.
"""

import sys

if __package__:  # python -m scripts.bench.hetnet
    from .experiments.hetnet import main
else:  # python scripts/bench/hetnet.py: Python puts scripts/bench/ first on sys.path
    from experiments.hetnet import main

if __name__ == "__main__":
    sys.exit(main())
