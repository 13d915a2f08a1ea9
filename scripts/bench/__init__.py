"""Benchmarks: each measures one thing hetjax claims (pipeline schedules, ZeRO, the planner's
predictions, the data loader, DiLoCo, codecs, reliability, one GPU) and writes its tables and
plots; `experiments/` holds the testbed experiments the `hetaccel`, `hetnet`, `quota`,
`check_worlds` and `repredict` entry points run. Every benchmark has a `--smoke` run.
"""
