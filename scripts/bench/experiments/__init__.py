"""The testbed experiments: `harness` (what both share: workload, runs,
calibrated predictions, CPU watch, reports), `hetnet` (Holmes: heterogeneous NICs) and
`hetaccel` (HetHub: heterogeneous accelerators). scripts/bench/hetnet.py and
scripts/bench/hetaccel.py are their entry points; tests/test_experiments.py tests them here.
"""
