"""Print the Plan a config trains with: `python scripts/plan.py --config=FILE [--config.x=v]
[--json PATH] [--plot PATH]` (the same as `hetjax plan ...`)."""

import sys


from hetjax.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["hetjax", "plan", *sys.argv[1:]]))
