"""Benchmarks, each measuring one thing hetjax claims and writing its tables and plots: pipeline
schedules, ZeRO, the planner's predictions, the data loader, DiLoCo, codecs, reliability, one
GPU. `experiments/` holds the testbed experiments the `hetaccel`, `hetnet`, `quota`,
`check_worlds` and `repredict` entry points run. Every benchmark has a `--smoke` run.
"""
