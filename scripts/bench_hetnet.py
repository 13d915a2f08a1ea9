"""Heterogeneous NICs (Holmes) on the emulated cluster: where each parallelism's traffic goes.

    sudo python scripts/bench_hetnet.py                   # the tables, docs/img/bench_hetnet.png
    sudo python scripts/bench_hetnet.py --steps 4 --out /tmp/x.png   # a quicker look

The experiment is scripts/experiments/hetnet.py (its docstring says what runs and how it is
predicted); this file is its command line.
"""

import sys
from pathlib import Path

if not __package__:  # run as a file (python scripts/NAME.py): its experiment lives in scripts/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.experiments.hetnet import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
