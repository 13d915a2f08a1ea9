"""Heterogeneous accelerators (HetHub) on the emulated cluster: an uneven split against T_UB.

    sudo python scripts/bench/hetaccel.py                 # the tables, docs/img/bench_hetaccel.png
    sudo python scripts/bench/hetaccel.py --steps 5 --out /tmp/x.png    # a quicker look

The experiment is scripts/bench/experiments/hetaccel.py (its docstring says what runs and how it is
predicted); this file is its command line.
"""

import sys

from hetjax.errors import HetjaxError
if __package__:  # python -m scripts.bench.hetaccel
    from .experiments.hetaccel import main
else:  # python scripts/bench/hetaccel.py: Python puts scripts/bench/ first on sys.path
    from experiments.hetaccel import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except HetjaxError as e:
        print(f"bench_hetaccel: error: {e}", file=sys.stderr)
        sys.exit(2)
