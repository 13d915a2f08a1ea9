"""Thin entry point: `python scripts/launch.py --local 4 --config=...` = `hetjax launch`."""

import sys


from hetjax.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["hetjax", "launch", *sys.argv[1:]]))
