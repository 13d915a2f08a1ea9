"""Validating a config: everything that can be checked without JAX, each problem one
`ConfigError` naming the field and the fix.

`validate` runs, in order: the fields' names and types (`hetjax.config.loading.check_fields`),
the path fields' expansion, finite floats, each field's own check (`field_problems`, from
`hetjax.config.fields.FIELDS`), then the rules between fields (`_validate_*`), then the layout
rules a config fixes before the topology is known (the Plan's, `hetjax.core.plan.layout_problems`,
not repeated here). `build_topology` turns the `topology.*` fields into a Topology, checking
them; `compute_dtype` resolves `model.dtype = 'auto'` on it.
"""

from __future__ import annotations

import math
import os

import ml_collections

from hetjax.config.fields import base_config, field_problems, field_value, positive_int, spec
from hetjax.config.loading import check_fields, check_one_model_source, expand_paths
from hetjax.core import topology as topo
from hetjax.corpus_size import SOURCE_TEXT
from hetjax.core.plan import (ZeroFactors, layout_problems, raise_first, stage_shape_problem,
                              tp_problems)
from hetjax.errors import ConfigError, TopologyValueError
from hetjax.planner.config_plan import resolve_microbatches


def _require(cond: bool, field: str, problem: str, fix: str) -> None:
    if not cond:
        raise ConfigError(field, problem, fix)


def _check(c, field: str, check=None) -> None:
    """Raise ConfigError unless `check` (a field check, e.g. `positive_int()`; default the
    field's own) passes."""
    verdict = (check or spec(field).check)(field, field_value(c, field))
    if verdict:
        raise ConfigError(field, *verdict)


def compute_dtype(c, topology: topo.Topology | None = None) -> str:
    """model.dtype with 'auto' resolved on the config's topology (Topology.
    default_compute_dtype: bfloat16 compute on accelerators, float32 on CPU)."""
    if c.model.dtype != "auto":
        return c.model.dtype
    return (topology or build_topology(c)).default_compute_dtype


def build_topology(c) -> topo.Topology:
    """The topology a config names (file or preset, with node/device overrides)."""
    t = c.topology
    if t.file:
        _require(t.preset == base_config().topology.preset, "topology.preset",
                 f"is {t.preset!r} but topology.file = {t.file!r} is set too; the file would "
                 "silently win", "set only one of topology.file and topology.preset")
        try:
            return topo.read_topology(t.file)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            what = "is a directory" if isinstance(e, IsADirectoryError) else "does not exist"
            raise ConfigError("topology.file", f"{t.file!r} {what}",
                              "give the path of a JSON topology (docs/topology.md)") from None
        except TopologyValueError as e:  # names the value (its JSON path) and the fix
            raise ConfigError("topology.file", f"{t.file!r}" + (
                f": {e.where}: " if e.where else " ") + e.problem, e.fix) from None
    _check(c, "topology.preset")
    kwargs = {}
    import inspect

    params = inspect.signature(topo.PRESETS[t.preset]).parameters
    for key in ("nodes", "devices_per_node"):
        _check(c, f"topology.{key}")
        v = t[key]
        if v:
            if key not in params:
                raise ConfigError(f"topology.{key}", f"preset {t.preset!r} has no {key}",
                                  f"leave it 0; {t.preset} takes ({', '.join(params)})")
            kwargs[key] = v
    for key in ("peak_tflops", "memory_gib"):
        _check(c, f"topology.{key}")
        v = t[key]
        if v:
            if key not in params:
                raise ConfigError(f"topology.{key}", f"preset {t.preset!r} takes its devices' "
                                  "figures from the catalogue",
                                  "leave it 0, or use --config.topology.preset=local")
            kwargs[key] = float(v)
    return topo.preset(t.preset, **kwargs)


def validate(c, reading: bool = False) -> None:
    """Check every field that can be checked without JAX (after expanding `~` and `$VAR` in
    the path fields, `expand_paths`): each field's own check (FIELDS), then the rules between
    fields, then the layout rules of the Plan (`hetjax.core.plan.layout_problems`). Raises
    ConfigError. `reading`: for a run that only reads a checkpoint (WRITTEN_FIELDS may be
    read-only)."""
    check_fields(c)
    expand_paths(c)
    _validate_finite(c)
    for field, problem, fix in field_problems(c, reading)[:1]:
        raise ConfigError(field, problem, fix)
    _validate_model(c)
    tr = c.train
    _require(-1 <= tr.warmup_steps <= tr.steps, "train.warmup_steps",
             f"must be in [0, train.steps = {tr.steps}] (or -1 for 10% of the steps), "
             f"got {tr.warmup_steps}", f"use about 10% of the steps, e.g. {max(1, tr.steps // 10)}")
    _require(c.data.source != "files" or bool(c.data.path), "data.path",
             "data.source = 'files' needs a directory or glob of text files",
             "set --config.data.path=/path/to/texts (or a glob like '/data/*.txt')")
    _require(c.data.source == "files" or not c.data.path, "data.path",
             f"is {c.data.path!r}, but data.source = {c.data.source!r} reads "
             f"{SOURCE_TEXT[c.data.source]}, not data.path",
             "add --config.data.source=files to train on data.path (or drop data.path)")
    if c.data.source == "files":  # found now, not after the model is compiled
        _validate_sources(c.data)
    _validate_data_and_checkpoints(c)
    _validate_diloco(c)
    _validate_layout(c)


def _validate_model(c) -> None:
    m = c.model
    if m.head_dim == 0:
        _require(m.d_model % m.n_heads == 0, "model.d_model",
                 f"{m.d_model} is not divisible by model.n_heads = {m.n_heads}",
                 f"make d_model a multiple of n_heads, e.g. "
                 f"{m.n_heads * max(1, m.d_model // m.n_heads)}, or set model.head_dim")
        _require((m.d_model // m.n_heads) % 2 == 0, "model.d_model",
                 f"head dimension d_model / n_heads = {m.d_model // m.n_heads} is odd; rotary "
                 "embeddings rotate pairs of dimensions", "choose d_model / n_heads even")
    if m.rope_type != "default":
        _require(m.rope_factor > 0, "model.rope_factor", f"must be > 0, got {m.rope_factor}",
                 "use the checkpoint's rope_scaling.factor, e.g. 8.0")
    if m.rope_type == "llama3":
        _require(m.rope_high_freq_factor > m.rope_low_freq_factor > 0,
                 "model.rope_high_freq_factor",
                 f"must exceed model.rope_low_freq_factor = {m.rope_low_freq_factor} (> 0), "
                 f"got {m.rope_high_freq_factor}", "use Llama 3.1's 4.0 and 1.0")
        _check(c, "model.rope_original_max_len", positive_int())
    check_one_model_source(m)
    if m.init_from:
        from hetjax.core import hf_config

        # The fields that shape the weights must be the checkpoint's (the rest, e.g. RoPE
        # scaling or max_seq_len, a run may change on purpose).
        hf = hf_config.model_fields(hf_config.read_config_json(m.init_from), "model.init_from")
        for k in (k for k in hf_config.SHAPE_FIELDS if k in hf):
            _require(m[k] == hf[k], f"model.{k}",
                     f"is {m[k]!r}, but the weights of model.init_from = {m.init_from!r} have "
                     f"{hf[k]!r}", "drop the override (load_config sets it from config.json; "
                     "in Python call hetjax.config.apply_model_source(config))")
    if m.n_experts:
        _require(m.experts_per_token <= m.n_experts, "model.experts_per_token",
                 f"{m.experts_per_token} is more than model.n_experts = {m.n_experts}",
                 f"choose experts_per_token <= {m.n_experts}, e.g. 2")
        _require(m.first_dense_layers == 0 and m.decoder_sparse_step == 1,
                 "model.first_dense_layers",
                 f"first_dense_layers = {m.first_dense_layers} and decoder_sparse_step = "
                 f"{m.decoder_sparse_step} make some layers dense, but the layer stack holds "
                 "one kind of block", "set first_dense_layers=0 and decoder_sparse_step=1 "
                 "(every layer MoE)")
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
             f"n_heads = {m.n_heads} is not a multiple of n_kv_heads = {m.n_kv_heads}",
             f"pick n_kv_heads from the divisors of {m.n_heads}: "
             f"{[d for d in range(1, m.n_heads + 1) if m.n_heads % d == 0]}")
    layers = tuple(m.full_attention_layers)
    _require(all(isinstance(i, int) and 0 <= i < m.n_layers for i in layers),
             "model.full_attention_layers", f"{list(layers)} names layers outside 0 .. "
             f"{m.n_layers - 1}", f"name layers below model.n_layers = {m.n_layers}")
    if m.sliding_window and 0 < len(set(layers)) < m.n_layers:
        # each layer's window is data of the scanned layer stack, which a pipeline cuts apart
        _require(c.parallel.pp == 1, "model.full_attention_layers",
                 f"{list(layers)} attend fully and the other layers through "
                 f"model.sliding_window = {m.sliding_window}; such mixed layers run only with "
                 f"the whole layer stack in one program, but parallel.pp = {c.parallel.pp}",
                 "set --config.parallel.pp=1")
    _require(c.train.seq_len <= m.max_seq_len, "train.seq_len",
             f"{c.train.seq_len} is longer than the model takes (model.max_seq_len = "
             f"{m.max_seq_len})", f"lower train.seq_len or raise model.max_seq_len to >= "
             f"{c.train.seq_len}")


def _validate_layout(c) -> None:
    m, p, z = c.model, c.parallel, c.zero
    factors = (z.s_p, z.s_g, z.s_os)
    _require(z.preset == "custom" or factors == (1, 1, 1), "zero.preset",
             f"zero.s_p / s_g / s_os = {factors} are only read when zero.preset = 'custom', "
             f"but it is {z.preset!r}",
             "set --config.zero.preset=custom to use them, or leave them at 1")
    # The layout rules a config fixes before the topology is known: the Plan's, one definition.
    raise_first(layout_problems(
        pp=p.pp, stage_layers=tuple(c.pipeline.stage_layers), n_layers=m.n_layers,
        microbatches=resolve_microbatches(c), global_batch=c.train.batch_size,
        schedule=c.pipeline.schedule, executor=c.pipeline.executor,
        placement=c.pipeline.placement,
        zero=ZeroFactors(*factors) if z.preset == "custom" else None), ConfigError)
    if p.tp:
        raise_first(tp_problems(p.tp, m), ConfigError)
    if p.ep > 1:
        _require(m.n_experts > 0, "parallel.ep", f"= {p.ep}, but the model has no experts "
                 "(model.n_experts = 0)", "set --config.parallel.ep=1, or give the model "
                 "experts (model.n_experts)")
        _require(m.n_experts % p.ep == 0, "parallel.ep",
                 f"{p.ep} does not divide model.n_experts = {m.n_experts}",
                 f"choose ep from the divisors of {m.n_experts}: "
                 f"{[d for d in range(1, m.n_experts + 1) if m.n_experts % d == 0]}")
    _validate_stage_degrees(c)


def _validate_stage_degrees(c) -> None:
    """parallel.stage_dp / stage_tp: one number per stage, each tp splitting the model, and an
    executor that gives each stage its own sub-mesh when the stages' shapes differ."""
    m, p = c.model, c.parallel
    sd, st = tuple(p.stage_dp), tuple(p.stage_tp)
    for field in ("parallel.stage_dp", "parallel.stage_tp", "parallel.exclude"):
        _require(not c.diloco.inner_steps or not field_value(c, field), field,
                 "fixes the synchronous layout, but DiLoCo (diloco.inner_steps > 0) plans "
                 "each site's own", f"leave {field} empty, or set diloco.inner_steps=0")
    if not (sd or st):
        return
    _require(not (sd and st) or len(sd) == len(st), "parallel.stage_tp",
             f"gives {len(st)} stages but parallel.stage_dp gives {len(sd)}",
             "give one number per stage in both")
    n = len(sd or st)
    _require(p.pp in (0, n), "parallel.pp", f"is {p.pp}, but parallel.stage_dp / stage_tp "
             f"give {n} stages", f"set --config.parallel.pp={n}")
    for field in ("zero.preset", "pipeline.placement"):
        _require(field_value(c, field) != "auto", field,
                 "is 'auto' (the planner's search), but parallel.stage_dp / stage_tp fix the "
                 "layout", f"choose {field} yourself, or leave the per-stage degrees empty")
    for t in sorted(set(st)):
        raise_first(tp_problems(t, m, "parallel.stage_tp"), ConfigError)
    if len(set(sd)) > 1 or len(set(st)) > 1:
        problem = stage_shape_problem(c.pipeline.executor, 0, n)
        if problem is not None:
            raise ConfigError(problem.field, problem.problem, problem.fix)


def _validate_finite(c, ref=None, prefix: str = "") -> None:
    """Every float field is a finite number: `train.lr=inf` skipped every update and ended
    with exit 0, a NaN passes every `x > 0` check."""
    ref = base_config() if ref is None else ref
    for k, default in ref.items():
        field, value = prefix + k, c[k]
        if isinstance(default, ml_collections.ConfigDict):
            _validate_finite(value, default, field + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(field, f"must be a finite number, got {value}",
                              f"set it like its default, e.g. --config.{field}={default!r}")


def _validate_sources(d) -> None:
    """Every source of data.path names files, and data.weights gives one weight per source."""
    import glob

    paths = [p.strip() for p in d.path.split(",")]
    for p in paths:
        _require(bool(p) and bool(glob.glob(os.path.expanduser(p))), "data.path",
                 f"{p!r} matches no file or directory",
                 "give an existing directory of text files or a glob like '/data/*.txt'")
    _require(bool(d.field), "data.field", "is empty",
             "name the text field of your .jsonl/.parquet records, e.g. --config.data.field=text")
    if not d.weights:
        return
    try:
        weights = [float(w) for w in d.weights.split(",")]
    except ValueError:
        weights = []
    _require(bool(weights) and all(math.isfinite(w) and w > 0 for w in weights), "data.weights",
             f"{d.weights!r} is not a list of positive numbers",
             "give one weight per data.path source, e.g. --config.data.weights=0.7,0.3")
    _require(len(weights) == len(paths), "data.weights",
             f"gives {len(weights)} weights for the {len(paths)} sources of data.path",
             "give one weight per comma-separated data.path source")


def _validate_data_and_checkpoints(c) -> None:
    d, e, k = c.data, c.eval, c.checkpoint
    if c.model.vocab_size:
        # Token ids past the embedding table give NaN losses, silently: refuse them here.
        from hetjax.tokenizer import load_tokenizer

        n = load_tokenizer(d.tokenizer).vocab_size
        _require(c.model.vocab_size >= n, "model.vocab_size",
                 f"{c.model.vocab_size} is smaller than the tokenizer's {n} tokens "
                 f"(data.tokenizer = {d.tokenizer!r})",
                 f"set --config.model.vocab_size=0 (sized from the tokenizer) or >= {n}")
    if k.keep_best:
        _require(k.every > 0, "checkpoint.keep_best", "keeps checkpoints, but checkpoint.every "
                 "= 0 saves none", "set checkpoint.every > 0, or keep_best = 0")
        _require(e.every > 0 and k.every % e.every == 0, "checkpoint.keep_best",
                 f"ranks checkpoints by eval loss, but eval.every = {e.every} does not evaluate "
                 f"at every save (checkpoint.every = {k.every})",
                 f"set eval.every to a divisor of {k.every}, e.g. --config.eval.every={k.every}")


def _validate_diloco(c) -> None:
    d = c.diloco
    _require(not d.inner_steps or d.inner_steps % d.fragments == 0, "diloco.fragments",
             f"{d.fragments} fragments do not divide diloco.inner_steps = {d.inner_steps}",
             "choose fragments dividing inner_steps, e.g. --config.diloco.fragments=1")
    every = d.inner_steps // d.fragments if d.inner_steps else 0
    # one fragment in flight at a time: it lands before the next fragment's exchange starts
    _require(not d.inner_steps or d.overlap_steps < every, "diloco.overlap_steps",
             f"{d.overlap_steps} overlap steps do not fit between two fragment exchanges "
             f"(every inner_steps / fragments = {every} steps)",
             f"use overlap_steps < {every}, e.g. --config.diloco.overlap_steps={every - 1}")
    _require(not d.mix or d.overlap_steps > 0, "diloco.mix",
             f"mixes a fragment that trained on while its exchange travelled; with "
             f"overlap_steps = 0 there is none (mix = {d.mix})",
             "set --config.diloco.overlap_steps too, or leave diloco.mix=0")
