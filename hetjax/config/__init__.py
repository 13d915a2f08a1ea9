"""Configuration: every field hetjax reads, its default, loading with overrides, and validation.

Three modules, one job each, all re-exported here (`from hetjax import config; config.validate`):

- `hetjax.config.fields` -- what a config is. Each field is defined once, as a `Field` of
  `fields.FIELDS`: its default, its description (the `--help` line) and its own check;
  `base_config()`, `DESCRIPTIONS` (`--help`) and `PATH_FIELDS` are made from that table. Name
  sets are imported from their owners (schedules, executors, ZeRO presets, codecs, RoPE types,
  compute models). `configs/*.py` files start from `base_config()` and change what their
  scenario needs.
- `hetjax.config.loading` -- `load_config(path, overrides)` reads a `get_config()` file with
  `--config.a.b=value` overrides exactly as the CLI does (ml_collections.config_flags), checks
  every field's name and type, and applies a model preset or an HF directory's architecture.
- `hetjax.config.validation` -- `validate(config)` checks everything that does not need JAX and
  raises a `ConfigError` naming the field and the fix: the fields' own checks, then the rules
  between fields. Layout rules are not repeated there: they are the Plan's
  (`hetjax.core.plan.layout_problems`); the checks that need the topology (degrees against
  device counts, placement, ZeRO factors on nodes) run where the Plan is built
  (hetjax/planner/config_plan.py). `build_topology(config)` turns the `topology.*` fields into
  a Topology.

The field table is `hetjax.config.fields.FIELDS` (not re-exported: a new field extends that
tuple, where `base_config()` and `--help` read it).
"""

from hetjax.config import fields
from hetjax.config.fields import (ADD_BOS, DATA_SOURCES, DESCRIPTIONS, DTYPES, PATH_FIELDS,
                                  WANDB_MODES, WRITTEN_FIELDS, Bound, Choices, Field,
                                  base_config, count_or_off, field_problems, field_value,
                                  positive_int, spec, warmup_steps)
from hetjax.config.loading import (PYTHON_WORKDIR, apply_model_source, check_fields,
                                   check_one_model_source, expand_paths, load_config,
                                   load_config_for_python)
from hetjax.config.validation import build_topology, compute_dtype, validate
from hetjax.errors import ConfigError

__all__ = ["ADD_BOS", "DATA_SOURCES", "DESCRIPTIONS", "DTYPES", "fields", "PATH_FIELDS",
           "WANDB_MODES", "WRITTEN_FIELDS", "Bound", "Choices", "Field",
           "base_config", "count_or_off", "field_value", "positive_int", "spec", "warmup_steps",
           "PYTHON_WORKDIR", "apply_model_source", "check_fields", "check_one_model_source",
           "expand_paths", "load_config", "load_config_for_python", "build_topology",
           "compute_dtype", "field_problems", "validate", "ConfigError"]
