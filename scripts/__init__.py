"""Benchmarks and thin entry points; not part of the installed package. Each imports hetjax's
public modules, never edits `sys.path`, and writes results where its flags say. Run one from the
repository root as `python -m scripts.NAME` (or `python scripts/NAME.py` with hetjax installed
from this checkout, `pip install -e .`). `experiments/` holds the testbed experiments the
`bench_het*` and `repredict` entry points run. tests/test_scripts.py runs every script's smoke
mode, so none can rot unnoticed.
"""
