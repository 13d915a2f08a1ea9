"""Test setup: 8 simulated CPU devices (set before jax is imported) and shared helpers."""

import os
import sys

from hetjax.cli import ensure_cpu_devices

# The suite's programs are tiny, so its time is XLA's compile time, much of it LLVM optimising
# CPU code the tests never time. Level 0 leaves XLA's own passes (sharding, collectives,
# fusion, buffer assignment: what the tests read from compiled programs) as they are and cut
# the default tier by about a fifth on two cores. Subprocesses (launched jobs, the CLI) inherit
# it. Users' runs never see it.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
# ... and the CLI's patience for collectives whose peers start late on a busy machine.
ensure_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Many tests build the same tiny programs again (a new Trainer jits anew; orbax slices every
# array it saves), and compiling is most of the suite's time: one compilation cache for the whole
# run -- its processes, xdist's workers and the jobs they start inherit this variable -- cuts
# that CPU time by about 40% (docs/testing.md). It lives and dies with the run (created by the first process that loads
# this file, removed when that process exits), so every run starts cold, like a fresh clone.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="hetjax-tests-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
# Cache every program, however small or quick to compile (jax's defaults skip those).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import pytest  # noqa: E402


def tiny_config(**overrides):
    """A small fp32 config on the default topology; overrides as {'train.steps': 3, ...}."""
    from hetjax.config import base_config

    c = base_config()
    c.model.d_model = 64
    c.model.n_layers = 2
    c.model.n_heads = 4
    c.model.n_kv_heads = 2
    c.model.d_ff = 128
    c.model.max_seq_len = 64
    c.model.dtype = "float32"  # 'auto' would compute in bf16 on the paper presets' GPUs
    c.train.seq_len = 16
    c.train.batch_size = 16
    c.train.steps = 3
    c.train.warmup_steps = 1
    c.train.progress = False
    c.data.source = "synthetic"
    c.tensorboard = False
    for key, value in overrides.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


# --- Holmes' group formulas (1-indexed ranks, as in the paper): the oracle the mesh and NIC
# tests check a Plan's groups against ---------------------------------------------------------
def holmes_tp_group(i: int, t: int, d: int, p: int) -> list[int]:
    """TP group i (1..p*d): ranks (i-1)*t + j, j = 1..t."""
    return [(i - 1) * t + j for j in range(1, t + 1)]


def holmes_pp_group(i: int, t: int, d: int, p: int) -> list[int]:
    """PP group i (1..t*d): ranks i + (j-1)*t*d, j = 1..p."""
    return [i + (j - 1) * t * d for j in range(1, p + 1)]


def holmes_dp_group(i: int, t: int, d: int, p: int) -> list[int]:
    """DP group i (1..p*t): ranks ((i-1) mod t) + (floor((i-1)/t)*d + j - 1)*t + 1, j = 1..d."""
    return [((i - 1) % t) + ((i - 1) // t * d + j - 1) * t + 1 for j in range(1, d + 1)]


@pytest.fixture
def make_config():
    return tiny_config
