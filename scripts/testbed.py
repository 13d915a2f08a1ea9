"""`python scripts/testbed.py up|measure|smoke|down ...`: `hetjax testbed ...` from this tree."""

import sys


from hetjax.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["hetjax", "testbed", *sys.argv[1:]]))
