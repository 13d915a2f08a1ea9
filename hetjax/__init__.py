"""hetjax: train language models with JAX on heterogeneous clusters.

The public API is small: `Topology` and `preset` describe hardware, `Plan` is a training
layout, `load_config` reads a config file (its workdir defaulting to runs/python, apart from
the `hetjax` command's runs/default), and `Trainer` trains (built from `TrainerParts`). Names
that need JAX are imported lazily, so `import hetjax` does not start JAX (the CLI sizes the
simulated CPU device count from the topology first).
"""

from hetjax.config import base_config, validate
from hetjax.config import load_config_for_python as load_config
from hetjax.errors import ConfigError, HetjaxError, PlanError, TopologyError
from hetjax.core.plan import Plan, ZeroFactors
from hetjax.core.topology import Topology, preset

__version__ = "0.1.0"

_LAZY = {"Trainer": ("hetjax.train", "Trainer"),
         "TrainerParts": ("hetjax.train", "TrainerParts")}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'hetjax' has no attribute {name!r}")


__all__ = ["Topology", "preset", "Plan", "ZeroFactors", "Trainer", "TrainerParts", "base_config",
           "load_config", "validate", "HetjaxError", "ConfigError", "PlanError", "TopologyError"]
