"""Loading a config: a `get_config()` file (or the defaults) with `--config.a.b=value` overrides,
read exactly as the CLI reads them (ml_collections.config_flags).

Every way the file or an override can be wrong -- a missing file, not Python, a syntax error,
`get_config` failing or returning something else, an unknown field (with the nearest name), a
value of the wrong type -- is one HetjaxError naming the file line or the field and the fix
(`check_fields`). A model preset or an HF directory sets the architecture fields
(`apply_model_source`); a field the file or an override names explicitly still wins.
`expand_paths` expands `~` and `$VAR` in the path fields, the one place this happens.
"""

from __future__ import annotations

import os
import re

import ml_collections

from hetjax.config.fields import FIELDS, PATH_FIELDS, base_config, field_value
from hetjax.planner.config_plan import free_unset
from hetjax.errors import ConfigError, HetjaxError


def load_config(path: str | None = None, overrides=(),
                base: ml_collections.ConfigDict | None = None,
                default_job: bool = False) -> ml_collections.ConfigDict:
    """Load a `get_config()` file (or `base`, default the defaults) and apply `--config.x.y=v`
    overrides.

    When the layout is left to the planner (parallel.pp or parallel.tp 0), the layout fields
    the planner searches (`hetjax.planner.config_plan.SEARCHED`: executor, schedule,
    placement, micro-batches, recompute, ZeRO) that neither an override nor the file set are
    left to it too (`free_unset`). `default_job`: `path` is the default job standing in for a
    --config the user did not give, so its values do not count as the user's.

    Every way the file or an override can be wrong (missing file, not Python, a syntax error,
    get_config failing or returning something else, an unknown field, a value of the wrong
    type) raises one HetjaxError naming the file line or the field and the fix."""
    from absl import flags
    from ml_collections import config_flags

    cfg = _load_file(path) if path is not None else base if base is not None else base_config()
    check_fields(cfg)  # before the overrides, so a partial file is named as the culprit
    latest = {}
    for o in overrides:
        field = o[len("--config."):].split("=", 1)[0]
        _known_field(cfg, field)
        latest.pop(field, None)
        latest[field] = o
    # The last value given for a field wins (absl appends repeated tuple flags instead).
    overrides = list(latest.values())
    fv = flags.FlagValues()
    # config_flags finds the --config.* override flags by scanning the argv it is given
    # (sys.argv by default), so hand it ours.
    argv = ["hetjax", *overrides]
    config_flags.DEFINE_config_dict("config", cfg, flag_values=fv, sys_argv=argv)
    try:
        fv(argv)
    except (flags.Error, AttributeError, KeyError, ValueError, TypeError) as e:
        detail = " ".join(str(e).replace("\\n", " ").replace("\\'", "").replace("'", "").strip('"').split())
        bad = re.match(r"flag --config\.([\w.]+)=(.*?): (.*)", detail)
        if bad:  # a value that does not parse as the field's type
            field = bad.group(1)
            raise ConfigError(field, f"cannot take the value {bad.group(2)!r} ({bad.group(3)})",
                              f"give it a value like its default, e.g. "
                              f"--config.{field}={field_value(base_config(), field)!r}") from None
        raise HetjaxError(f"could not read the config {path or '(defaults)'}: {detail}") from None
    check_fields(fv.config)
    # A preset or an HF directory gives the architecture; a model field the file changed from
    # its default or an override names explicitly still wins.
    base = base_config().model
    keep = set(latest) | {f"model.{k}" for k in base.keys() if cfg.model[k] != base[k]}
    apply_model_source(fv.config, keep)
    defaults = base_config()
    changed = () if default_job else [f.name for f in FIELDS if field_value(
        cfg, f.name) != field_value(defaults, f.name)]
    free_unset(fv.config, {*latest, *changed})
    return fv.config


def apply_model_source(c, keep=()) -> None:
    """Set the architecture fields (hetjax.core.hf_config.ARCH_FIELDS) from model.preset or
    the config.json of model.init_from, except the dotted fields in `keep`. `load_config` calls
    it; call it on a config built in Python after setting either field."""
    m = c.model
    if not m.preset and not m.init_from:
        return
    from hetjax.core import hf_config

    check_one_model_source(m)
    fields = (hf_config.preset_fields(m.preset) if m.preset else
              hf_config.model_fields(hf_config.read_config_json(m.init_from),
                                     "model.init_from"))
    for k, v in fields.items():
        if f"model.{k}" not in keep:
            m[k] = v


def check_one_model_source(m) -> None:
    """model.preset and model.init_from both give the architecture: at most one may be set."""
    if m.preset and m.init_from:
        raise ConfigError("model.preset", f"{m.preset!r} is set and so is model.init_from = "
                          f"{m.init_from!r}", "set only model.init_from: the checkpoint's "
                          "config.json gives the architecture")


# From Python (hetjax.load_config) a run left at the command line's workdir goes here instead,
# so a notebook or snippet never resumes, or writes over, the run `hetjax train` made.
PYTHON_WORKDIR = "runs/python"


def load_config_for_python(path: str | None = None, overrides=()) -> ml_collections.ConfigDict:
    """`load_config` as `hetjax.load_config` offers it to Python and notebooks: the same config,
    except that a workdir neither the file nor an override changes is PYTHON_WORKDIR rather
    than the `hetjax` command's runs/default."""
    cfg = load_config(path, overrides)
    if cfg.workdir == base_config().workdir and not any(
            o.startswith("--config.workdir=") for o in overrides):
        cfg.workdir = PYTHON_WORKDIR
    return cfg


def _load_file(path: str) -> ml_collections.ConfigDict:
    """Run a config file's `get_config(*args)` (`path` may end in `:arg`, as config_flags)."""
    import importlib.util
    import traceback

    file, *args = path.split(":")
    fix = ("give a Python file with get_config() returning a ConfigDict, e.g. "
           "--config=configs/default.py")
    if not os.path.isfile(file):
        raise HetjaxError(f"--config={path}: no such file; fix: {fix}")
    if not file.endswith(".py"):
        raise HetjaxError(f"--config={path}: a config is a Python file, not "
                          f"{os.path.splitext(file)[1] or 'a file without .py'}; fix: {fix}")

    def failure(e: BaseException) -> HetjaxError:
        # The deepest frame inside the config file says which line went wrong.
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if os.path.abspath(f.filename) == os.path.abspath(file)]
        where = f" line {frames[-1].lineno} ({frames[-1].line.strip()})" if frames else ""
        detail = " ".join(str(e).replace("<class ", "").replace(">", "").split())
        return HetjaxError(f"--config={path}:{where}: {type(e).__name__}: {detail}; fix: "
                           "correct that line (field types are those of base_config())")

    spec = importlib.util.spec_from_file_location("hetjax_user_config", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise HetjaxError(f"--config={path}: syntax error at line {e.lineno}: {e.msg}; fix: "
                          f"correct line {e.lineno}") from None
    except Exception as e:
        raise failure(e) from None
    if not callable(getattr(module, "get_config", None)):
        raise HetjaxError(f"--config={path}: defines no get_config(); fix: {fix}")
    try:
        cfg = module.get_config(*args)
    except Exception as e:
        raise failure(e) from None
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise HetjaxError(f"--config={path}: get_config() returned a {type(cfg).__name__}, not "
                          "a ConfigDict; fix: start from hetjax.config.base_config() and return "
                          "it with your changes")
    return cfg


def _kind(default) -> tuple[tuple[type, ...], str]:
    """The types a field with this default accepts, and their name for messages."""
    if isinstance(default, bool):
        return (bool,), "true or false"
    if isinstance(default, int):
        return (int,), "an integer"
    if isinstance(default, float):
        return (int, float), "a number"
    if isinstance(default, (tuple, list)):
        return (tuple, list), "a tuple, e.g. (3, 1)"
    return (type(default),), f"a {type(default).__name__}"


def _known_field(c, dotted: str) -> None:
    """Raise ConfigError unless `dotted` names a field of `c`, suggesting the nearest name."""
    import difflib

    node, done = c, []
    for part in dotted.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            known = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            near = difflib.get_close_matches(part, known, n=1)
            where = ".".join(done)
            fix = (f"did you mean {'.'.join([*done, near[0]])}?" if near else
                   f"the fields of {where or 'the config'} are: {', '.join(known)}")
            raise ConfigError(".".join([*done, part]), "is not a hetjax config field", fix)
        node, done = node[part], [*done, part]


def check_fields(c, ref=None, prefix: str = "") -> None:
    """Every field of `c` is one of base_config()'s, none is missing, and each has its type."""
    import difflib

    ref = base_config() if ref is None else ref
    if not isinstance(c, ml_collections.ConfigDict):
        raise ConfigError(prefix.rstrip(".") or "(config)",
                          f"must be a ConfigDict section, got {c!r}",
                          "start from hetjax.config.base_config() and change fields in it")
    for k in c.keys():
        if k not in ref:
            near = difflib.get_close_matches(k, list(ref.keys()), n=1)
            raise ConfigError(prefix + k, "is not a hetjax config field",
                              f"did you mean {prefix + near[0]}?" if near else
                              f"the fields of {prefix.rstrip('.') or 'the config'} are: "
                              f"{', '.join(ref.keys())}")
    for k in ref.keys():
        field = prefix + k
        if k not in c:
            raise ConfigError(field, "is missing", "start the config from "
                              "hetjax.config.base_config() (it has every field) and change "
                              "what you need")
        default, value = ref[k], c[k]
        if isinstance(default, ml_collections.ConfigDict):
            check_fields(value, default, field + ".")
            continue
        types, name = _kind(default)
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise ConfigError(field, f"must be {name}, got {value!r} ({type(value).__name__})",
                              f"set it like its default, e.g. --config.{field}={default!r}")


def expand_paths(c) -> None:
    """Expand `~` and environment variables in every path field, in place: the one place this
    happens, so validation, the trainer and the data see the same path (a `~` left for the
    trainer wrote to `./~/...`)."""
    for field in PATH_FIELDS:
        section, _, name = field.rpartition(".")
        node = c[section] if section else c
        value = node.get(name)
        if isinstance(value, str) and value:
            expanded = os.path.expanduser(os.path.expandvars(value))
            if expanded != value:
                node[name] = expanded
