"""Heterogeneous accelerators (HetHub) on the emulated cluster: an uneven split against T_UB.

    sudo python scripts/bench_hetaccel.py                 # the tables, docs/img/bench_hetaccel.png
    sudo python scripts/bench_hetaccel.py --steps 5 --out /tmp/x.png    # a quicker look

The experiment is scripts/experiments/hetaccel.py (its docstring says what runs and how it is
predicted); this file is its command line.
"""

import sys
from pathlib import Path

if not __package__:  # run as a file (python scripts/NAME.py): its experiment lives in scripts/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetjax.errors import HetjaxError  # noqa: E402
from scripts.experiments.hetaccel import main  # noqa: E402

if __name__ == "__main__":
    try:
        sys.exit(main())
    except HetjaxError as e:
        print(f"bench_hetaccel: error: {e}", file=sys.stderr)
        sys.exit(2)
