"""Saved bench runs priced again with other calibration files, and the same layout measured
run to run (scripts/experiments/repredict.py says what and why).

    python scripts/repredict.py runs/a.json runs/b.json                # each run's own file
    python scripts/repredict.py runs/a.json --calibration other.json   # another calibration
"""

import sys
from pathlib import Path

if not __package__:  # run as a file (python scripts/NAME.py): its experiment lives in scripts/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetjax.errors import HetjaxError  # noqa: E402
from scripts.experiments.repredict import main  # noqa: E402

if __name__ == "__main__":
    try:
        sys.exit(main())
    except HetjaxError as e:
        print(f"repredict: error: {e}", file=sys.stderr)
        sys.exit(2)
