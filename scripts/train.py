"""Thin entry point: `python scripts/train.py --config=configs/default.py ...` = `hetjax train`."""

import sys


from hetjax.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["hetjax", "train", *sys.argv[1:]]))
