"""Benchmarks and thin entry points; not part of the installed package. Each imports hetjax's
public modules and writes results where its flags say. Run one from the repository root as
`python -m scripts.NAME` or `python scripts/NAME.py` with hetjax installed (`pip install -e .`);
the entry points whose experiment lives in `experiments/` put the repository root on `sys.path`
when run as a file, since the installed package does not include `scripts`. `experiments/` holds the testbed experiments the
`bench_het*` and `repredict` entry points run. tests/test_scripts.py runs every script's smoke
mode, so none can rot unnoticed.
"""
