"""Scripts outside the installed package: `bench/` holds the benchmarks and the testbed
experiments they run (`bench/experiments/`), `tools/` the repository's tools (the documentation
runner, the HF test fixture, the GPU session's check). Each imports hetjax's public modules and
writes results where its flags say. Run one from the repository root as `python -m
scripts.bench.NAME` (or `scripts.tools.NAME`), or as `python scripts/bench/NAME.py` with hetjax
installed (`pip install -e .`). Every script answers `--help`, and every benchmark has a
`--smoke` run (tiny shapes, on CPU) that tests/test_scripts.py runs, so none can rot unnoticed.
The commands themselves are the `hetjax` CLI (`hetjax plan`, `hetjax train`, ...), not scripts.
"""
