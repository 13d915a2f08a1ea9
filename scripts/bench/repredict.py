"""Saved bench runs priced again with other calibration files, and the same layout measured
run to run (scripts/bench/experiments/repredict.py says what and why).

    python scripts/bench/repredict.py runs/a.json runs/b.json                # each run's own file
    python scripts/bench/repredict.py runs/a.json --calibration other.json   # another calibration
"""

import sys

from hetjax.errors import HetjaxError
if __package__:  # python -m scripts.bench.repredict
    from .experiments.repredict import main
else:  # python scripts/bench/repredict.py: Python puts scripts/bench/ first on sys.path
    from experiments.repredict import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except HetjaxError as e:
        print(f"repredict: error: {e}", file=sys.stderr)
        sys.exit(2)
