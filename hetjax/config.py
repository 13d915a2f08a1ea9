"""Configuration: every field hetjax reads, its default, loading with overrides, and validation.

`base_config()` is the single place defaults live; `configs/*.py` files start from it and change
what their scenario needs. `load_config(path, overrides)` reads a `get_config()` file with
`--config.a.b=value` overrides exactly as the CLI does (ml_collections.config_flags).
`validate(config)` checks everything that does not need JAX and raises a `ConfigError` naming
the field and the fix. Layout rules are not repeated here: the ZeRO presets and factor rules
are hetjax/planner/zero.py's, and the checks that need the topology (degrees against device
counts, placement) run where the Plan is built (hetjax/planner/config_plan.py).
"""

from __future__ import annotations

import json
import math
import os
import re

import ml_collections

from hetjax.errors import ConfigError, HetjaxError
from hetjax import topology as topo
from hetjax.planner import zero as zr
from hetjax.planner.config_plan import resolve_microbatches
from hetjax.plan import PLACEMENTS, ZeroFactors, layout_problems, raise_first
from parallel.registry import EXECUTORS, executor_help
from parallel.schedules import SCHEDULES, spmd_schedules
from parallel.wire import BOUNDARY_CODECS, DILOCO_CODECS

DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("auto", "none", "full", "dots")
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas")  # layers/attention_kernels.py
DATA_SOURCES = ("stdlib", "files", "synthetic")


def pipeline_executors() -> tuple[str, ...]:
    """What pipeline.executor may say: a registered executor, or 'auto' (the planner chooses)."""
    return (*EXECUTORS, "auto")


ROPE_TYPES = ("default", "linear", "llama3")  # hetjax.interop.hf_config's, layers/embeddings'


def base_config() -> ml_collections.ConfigDict:
    """All fields with their defaults: a tiny LLaMA-style model on the default CPU topology.
    What each field means is in DESCRIPTIONS, below (shown by `hetjax <command> --help`)."""
    c = ml_collections.ConfigDict()

    c.topology = ml_collections.ConfigDict()
    c.topology.preset = "cpu_hybrid"
    c.topology.file = ""
    c.topology.nodes = 0
    c.topology.devices_per_node = 0
    c.topology.peak_tflops = 0.0
    c.topology.memory_gib = 0.0

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 0
    c.model.d_model = 128
    c.model.n_layers = 4
    c.model.n_heads = 4
    c.model.n_kv_heads = 2
    c.model.d_ff = 384
    c.model.max_seq_len = 512
    c.model.rope_theta = 10000.0
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = True
    c.model.dtype = "auto"
    c.model.param_dtype = "float32"
    c.model.remat = "auto"
    c.model.attention = "auto"
    c.model.loss_chunk_tokens = 0
    c.model.head_dim = 0
    c.model.rope_type = "default"
    c.model.rope_factor = 1.0
    c.model.rope_low_freq_factor = 1.0
    c.model.rope_high_freq_factor = 4.0
    c.model.rope_original_max_len = 8192
    c.model.qkv_bias = False
    c.model.preset = ""
    c.model.init_from = ""

    c.parallel = ml_collections.ConfigDict()
    c.parallel.pp = 1
    c.parallel.dp = 0
    c.parallel.tp = 1
    c.parallel.allow_straddle = False

    c.pipeline = ml_collections.ConfigDict()
    c.pipeline.stage_layers = ()
    c.pipeline.schedule = "1f1b"
    c.pipeline.executor = "spmd"
    c.pipeline.placement = "looped"
    c.pipeline.microbatches = 0
    # activations / their gradients between worlds (MPMD across clusters), parallel/bridge.py
    c.pipeline.boundary_codec = "none"

    c.zero = ml_collections.ConfigDict()
    c.zero.preset = "ddp"
    c.zero.s_p = 1
    c.zero.s_g = 1
    c.zero.s_os = 1

    c.planner = ml_collections.ConfigDict()
    c.planner.memory_margin = 0.1
    c.planner.calibration = ""
    c.planner.compute = "flat"

    c.train = ml_collections.ConfigDict()
    c.train.steps = 300
    c.train.batch_size = 32
    c.train.seq_len = 128
    c.train.microbatches = 1
    c.train.lr = 3e-3
    c.train.min_lr_ratio = 0.1
    c.train.warmup_steps = -1
    c.train.weight_decay = 0.1
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    c.train.eps = 1e-8
    c.train.grad_clip = 1.0
    c.train.seed = 0
    c.train.log_every = 10
    c.train.max_bad_steps = 3
    c.train.max_loss_ratio = 4.0
    c.train.progress = True
    c.train.profile_steps = 0
    c.train.profile_from = 3

    c.data = ml_collections.ConfigDict()
    c.data.source = "stdlib"
    c.data.path = ""
    c.data.field = "text"
    c.data.weights = ""
    c.data.tokenizer = "byte"
    c.data.add_bos = "auto"
    c.data.dir = ""
    c.data.eval_fraction = 0.01
    c.data.prefetch = 4
    c.data.threads = 2
    c.data.document_mask = False

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 0
    c.eval.batches = 4

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 100
    c.checkpoint.keep = 3
    c.checkpoint.keep_best = 0
    c.checkpoint.async_save = True
    c.checkpoint.dir = ""
    c.checkpoint.allow_other_data = False

    # DiLoCo between sites (docs/diloco.md): sites train alone for inner_steps steps, then
    # exchange pseudo-gradients and take an outer optimizer step. 0: synchronous training.
    c.diloco = ml_collections.ConfigDict()
    c.diloco.inner_steps = 0
    c.diloco.sites = ()
    c.diloco.codec = "none"
    c.diloco.outer_optimizer = "nesterov"
    c.diloco.outer_lr = 0.7
    c.diloco.outer_momentum = 0.9
    c.diloco.inner_optimizer = "adamw"
    c.diloco.inner_lr_scale = 1.0
    c.diloco.fragments = 1
    c.diloco.overlap_steps = 0
    c.diloco.mix = 0.0

    c.workdir = "runs/default"
    c.tensorboard = True

    # Weights & Biases, beside metrics.jsonl and TensorBoard (hetjax/metrics.py); the optional
    # dependency `pip install 'hetjax[wandb]'`
    c.wandb = ml_collections.ConfigDict()
    c.wandb.project = ""
    c.wandb.mode = "online"
    c.wandb.name = ""
    return c



# What each field means: the one place, shown by `hetjax <command> --help` (tests check every
# field of base_config() has an entry).
DESCRIPTIONS: dict[str, str] = {
    "topology.preset": "a name from hetjax.topology.PRESETS",
    "topology.file": "a JSON topology (Topology.to_json()); overrides preset",
    "topology.nodes": "> 0 overrides the preset's nodes per cluster",
    "topology.devices_per_node": "> 0 overrides the preset's devices per node",
    "topology.peak_tflops": "> 0 states the devices' peak dense bf16 TFLOP/s (preset local; "
                            "required for a device kind the catalogue lacks)",
    "topology.memory_gib": "> 0 states the devices' memory in GiB (preset local; default: what "
                           "the runtime reports, else the catalogue)",
    "model.vocab_size": "0: the tokenizer's vocabulary rounded up to a multiple of 128",
    "model.d_model": "width of the residual stream",
    "model.n_layers": "decoder blocks",
    "model.n_heads": "attention (query) heads",
    "model.n_kv_heads": "key/value heads: grouped-query attention; = n_heads for plain "
                        "multi-head",
    "model.d_ff": "hidden width of the SwiGLU feed-forward",
    "model.max_seq_len": "longest sequence the model takes (HF max_position_embeddings)",
    "model.rope_theta": "rotary embedding base",
    "model.norm_eps": "RMSNorm epsilon",
    "model.tie_embeddings": "share the input embedding with the output projection",
    "model.dtype": "compute dtype: auto (bfloat16 on accelerators with float32 master "
                   "weights in model.param_dtype, float32 on CPU) | float32 | bfloat16 | "
                   "float16",
    "model.param_dtype": "dtype parameters are stored (and optimized) in",
    "model.remat": "what a layer keeps for its backward: none (every intermediate; 3 forwards "
                   "per layer) | dots (matmul outputs) | full (its input; 4 forwards) | auto "
                   "(when the planner searches, the fastest of the three that fits memory; "
                   "otherwise none, but full in the SPMD pipeline)",
    "model.attention": "attention kernel: auto (cuDNN fused flash attention on NVIDIA GPUs where "
                       "it supports the dtype and head size, else the Pallas flash kernel, else "
                       "XLA; XLA on CPU/TPU) | xla | cudnn | pallas",
    "model.loss_chunk_tokens": "cross-entropy over the vocabulary in chunks of this many tokens "
                               "per device, each recomputed in the backward, so the float32 "
                               "logits [tokens, vocab] are never whole; 0: in one piece (the "
                               "single-program step, pp = 1)",
    "model.head_dim": "width of one attention head; 0: d_model / n_heads",
    "model.rope_type": "RoPE frequency scaling as transformers: default | linear | llama3",
    "model.rope_factor": "RoPE scaling factor (linear, llama3)",
    "model.rope_low_freq_factor": "llama3 RoPE scaling: low_freq_factor",
    "model.rope_high_freq_factor": "llama3 RoPE scaling: high_freq_factor",
    "model.rope_original_max_len": "llama3 RoPE scaling: original_max_position_embeddings",
    "model.qkv_bias": "biases on the query/key/value projections (Qwen2)",
    "model.preset": "a published architecture (hetjax.interop.hf_config.PRESETS: tinyllama_1b, "
                    "llama2_7b, llama3_8b, llama3_1_8b, llama3_2_1b, mistral_7b, qwen2_0_5b); "
                    "sets the architecture fields, explicit --config.model.* overrides win",
    "model.init_from": "a HuggingFace model directory (config.json + *.safetensors): its "
                       "architecture, and its weights as the starting parameters",
    "parallel.pp": "pipeline stages; pp * dp * tp = topology devices; 0: the planner chooses",
    "parallel.dp": "data-parallel replicas; 0: all remaining devices",
    "parallel.tp": "tensor-parallel shards (inside a node); 0: the planner chooses",
    "parallel.allow_straddle": "allow a TP group across nodes / a stage across clusters",
    "pipeline.stage_layers": "layers per stage, e.g. (3, 1); empty: even split",
    "pipeline.schedule": f"{' | '.join(SCHEDULES)} (executor spmd runs "
                         f"{', '.join(spmd_schedules())}; strands: two strands per tick)",
    "pipeline.executor": executor_help(),
    "pipeline.placement": "looped: one model chunk per stage in order | folded: two chunks per "
                          "device in a V (down, then back up; device 0 holds embedding and "
                          "head), each device's stage_layers split ceil/floor down/up | auto: "
                          "the planner prices both",
    "pipeline.boundary_codec": f"{' | '.join(BOUNDARY_CODECS)}: activations and their "
                               "gradients crossing worlds (MPMD stages on different "
                               "clusters) as int8 with per-row scales, gradients with error "
                               "feedback",
    "pipeline.microbatches": "alias of train.microbatches for pipeline users; 0: unset",
    "zero.preset": "sharding of optimizer state / gradients / parameters: "
                   + " | ".join(zr.CONFIG_PRESETS),
    "zero.s_p": "parameter shard factor (zero.preset=custom only)",
    "zero.s_g": "gradient shard factor (zero.preset=custom only)",
    "zero.s_os": "optimizer-state shard factor (zero.preset=custom only)",
    "planner.memory_margin": "share of device memory a plan leaves free (fragmentation)",
    "planner.calibration": "a `hetjax calibrate` JSON file: measured compute and links",
    "planner.compute": "flat | kinds: compute priced at one efficiency per FLOP, or by "
                       "operation kind (matmuls by size, attention per implementation, "
                       "memory-bound work by bandwidth; a calibration file's measured "
                       "rates when it has them)",
    "train.steps": "optimizer steps of the run",
    "train.batch_size": "global batch, in sequences",
    "train.seq_len": "tokens per sequence",
    "train.microbatches": "the batch is split into this many micro-batches per step",
    "train.lr": "peak learning rate (AdamW)",
    "train.min_lr_ratio": "cosine decay ends at lr * min_lr_ratio",
    "train.warmup_steps": "linear warmup steps; -1: 10% of train.steps",
    "train.weight_decay": "AdamW weight decay (matrices only, not norm scales)",
    "train.b1": "AdamW beta1",
    "train.b2": "AdamW beta2",
    "train.eps": "AdamW epsilon",
    "train.grad_clip": "global-norm clipping; 0 disables",
    "train.seed": "seed of the parameters and the data order",
    "train.log_every": "a metrics row and log line every N steps",
    "train.max_bad_steps": "a step whose loss or gradient norm is NaN/Inf is skipped (no "
                           "update); this many in a row stop the run with an error",
    "train.max_loss_ratio": "a loss above this many times the run's first loss is divergence: "
                            "the run stops with an error and saves nothing of it; 0: off",
    "train.progress": "progress bar on the terminal / notebook",
    "train.profile_steps": "trace this many steps with jax.profiler (<workdir>/profile/, "
                           "summarised at the end); 0: off",
    "train.profile_from": "the first traced step (after compilation and warm-up)",
    "data.source": "stdlib (Python's own sources) | files | synthetic",
    "data.path": "source=files: a directory, glob or file of text, .jsonl or .parquet; "
                 "several joined by commas",
    "data.field": "the text field of .jsonl and .parquet records",
    "data.weights": "mix the comma-separated data.path sources by these weights (one per "
                    "source, e.g. 0.7,0.3); empty: all files form one corpus",
    "data.tokenizer": "byte, a SentencePiece .model, a HuggingFace tokenizer.json (or its "
                      "directory), a tiktoken rank file, or a checkpoint's tokenizer directory",
    "data.add_bos": "begin each document with BOS: auto (as the tokenizer's config says) | "
                    "true | false",
    "data.dir": "where text corpora are prepared (tfds); empty: ~/.cache/hetjax/tfds",
    "data.eval_fraction": "share of the documents held out for evaluation",
    "data.prefetch": "batches the loader prepares ahead of the step",
    "data.threads": "loader threads",
    "data.document_mask": "packed rows carry segment ids and tokens attend only within their "
                          "own document (not across an EOS); the single-program step and the "
                          "SPMD pipeline",
    "eval.every": "evaluate on held-out data every N steps (and at the end); 0: never",
    "eval.batches": "global batches per evaluation",
    "checkpoint.every": "save every N steps and at the end; 0: no checkpoints",
    "checkpoint.keep": "keep the latest K checkpoints",
    "checkpoint.keep_best": "also keep the N with the lowest eval loss (needs eval.every)",
    "checkpoint.async_save": "write in the background while training goes on",
    "checkpoint.dir": "empty: <workdir>/checkpoints",
    "checkpoint.allow_other_data": "resume a checkpoint written for other data (another corpus, "
                                   "tokenizer, seq_len, ...): the run goes on with the new data "
                                   "from its start, with a warning",
    "diloco.inner_steps": "DiLoCo: sites train alone for H steps between exchanges; 0: off",
    "diloco.sites": "empty: every topology cluster a site; or ('a+b', 'c') groups clusters",
    "diloco.codec": f"pseudo-gradients on the wire: {' | '.join(DILOCO_CODECS)} (none: fp32)",
    "diloco.outer_optimizer": "nesterov | sgd",
    "diloco.outer_lr": "outer optimizer learning rate",
    "diloco.outer_momentum": "outer Nesterov momentum",
    "diloco.inner_optimizer": "adamw (the train.* optimizer) | sgd (train.lr)",
    "diloco.fragments": "streaming: the parameters in F fragments, fragment f exchanged at "
                         "step f H / F of each round (1: all at the round's end)",
    "diloco.overlap_steps": "streaming: a fragment's exchange travels while the sites train "
                            "this many more steps (tau < inner_steps / fragments; 0: none)",
    "diloco.mix": "with overlap_steps: a site keeps mix x its fragment + (1 - mix) x the "
                  "new outer fragment (0: replace; the paper's alpha)",
    "diloco.inner_lr_scale": "the sites' learning rate is train.lr's schedule times this "
                             "(each site sees 1/n of the global batch)",
    "workdir": "where metrics.jsonl, loss.png, plan.json, checkpoints and TensorBoard go "
               "(hetjax.load_config from Python: runs/python unless set)",
    "tensorboard": "also write TensorBoard event files",
    "wandb.project": "log metrics to this Weights & Biases project (empty: off; needs the "
                     "wandb extra)",
    "wandb.mode": "online, offline (files under <workdir>/wandb, `wandb sync` later) or "
                  "disabled",
    "wandb.name": "the W&B run's name (empty: the workdir's last directory)",
}


# --- loading -----------------------------------------------------------------------------------
def load_config(path: str | None = None, overrides=(),
                base: ml_collections.ConfigDict | None = None) -> ml_collections.ConfigDict:
    """Load a `get_config()` file (or `base`, default the defaults) and apply `--config.x.y=v`
    overrides.

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
                              f"--config.{field}={_get(base_config(), field)!r}") from None
        raise HetjaxError(f"could not read the config {path or '(defaults)'}: {detail}") from None
    check_fields(fv.config)
    # A preset or an HF directory gives the architecture; a model field the file changed from
    # its default or an override names explicitly still wins.
    base = base_config().model
    keep = set(latest) | {f"model.{k}" for k in base.keys() if cfg.model[k] != base[k]}
    apply_model_source(fv.config, keep)
    return fv.config


def apply_model_source(c, keep=()) -> None:
    """Set the architecture fields (hetjax.interop.hf_config.ARCH_FIELDS) from model.preset or
    the config.json of model.init_from, except the dotted fields in `keep`. `load_config` calls
    it; call it on a config built in Python after setting either field."""
    m = c.model
    if not m.preset and not m.init_from:
        return
    from hetjax.interop import hf_config

    _require(not (m.preset and m.init_from), "model.preset",
             f"{m.preset!r} is set and so is model.init_from = {m.init_from!r}",
             "set only model.init_from: the checkpoint's config.json gives the architecture")
    fields = (hf_config.preset_fields(m.preset) if m.preset else
              hf_config.model_fields(hf_config.read_config_json(m.init_from),
                                     "model.init_from"))
    for k, v in fields.items():
        if f"model.{k}" not in keep:
            m[k] = v


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


# --- validation --------------------------------------------------------------------------------
def _require(cond: bool, field: str, problem: str, fix: str) -> None:
    if not cond:
        raise ConfigError(field, problem, fix)


def _positive_int(c, field: str, example: int) -> None:
    v = _get(c, field)
    _require(isinstance(v, int) and v > 0, field, f"must be a positive integer, got {v!r}",
             f"set --config.{field}={example}")


def _get(c, dotted: str):
    for part in dotted.split("."):
        c = c[part]
    return c


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
            with open(t.file) as f:
                return topo.Topology.from_json(f.read())
        except (FileNotFoundError, IsADirectoryError):
            raise ConfigError("topology.file", f"{t.file!r} does not exist",
                              "give the path of a JSON topology (Topology.to_json())") from None
        except json.JSONDecodeError as e:
            raise ConfigError("topology.file", f"{t.file!r} is not valid JSON (line {e.lineno}, "
                              f"column {e.colno}: {e.msg})",
                              "fix the JSON; Topology.to_json() shows the format") from None
        except HetjaxError as e:
            raise ConfigError("topology.file", f"{t.file!r}: {e}",
                              "correct that entry of the file") from None
    _require(t.preset in topo.PRESETS, "topology.preset", f"unknown preset {t.preset!r}",
             f"choose one of: {', '.join(sorted(topo.PRESETS))}")
    kwargs = {}
    import inspect

    params = inspect.signature(topo.PRESETS[t.preset]).parameters
    for key in ("nodes", "devices_per_node"):
        v = t[key]
        _require(isinstance(v, int) and v >= 0, f"topology.{key}",
                 f"must be >= 0, got {v!r}", f"set --config.topology.{key}=2 (0 keeps the preset)")
        if v:
            if key not in params:
                raise ConfigError(f"topology.{key}", f"preset {t.preset!r} has no {key}",
                                  f"leave it 0; {t.preset} takes ({', '.join(params)})")
            kwargs[key] = v
    for key in ("peak_tflops", "memory_gib"):
        v = t[key]
        _require(isinstance(v, (int, float)) and v >= 0, f"topology.{key}",
                 f"must be >= 0, got {v!r}", f"set --config.topology.{key}=<a positive number>")
        if v:
            if key not in params:
                raise ConfigError(f"topology.{key}", f"preset {t.preset!r} takes its devices' "
                                  "figures from the catalogue",
                                  "leave it 0, or use --config.topology.preset=local")
            kwargs[key] = float(v)
    return topo.preset(t.preset, **kwargs)


def warmup_steps(t) -> int:
    """train.warmup_steps, with -1 meaning 10% of train.steps."""
    return t.steps // 10 if t.warmup_steps == -1 else t.warmup_steps


# Every field that names a file or directory: `expand_paths` expands `~` and `$VAR` in them.
PATH_FIELDS = ("workdir", "checkpoint.dir", "data.path", "data.dir", "data.tokenizer",
               "topology.file", "planner.calibration")


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


def validate(c) -> None:
    """Check every field that can be checked without JAX (after expanding `~` and `$VAR` in
    the path fields, `expand_paths`). Raises ConfigError."""
    check_fields(c)
    expand_paths(c)
    _validate_finite(c)
    m, tr = c.model, c.train
    for f, ex in (("model.d_model", 128), ("model.n_layers", 4), ("model.n_heads", 4),
                  ("model.n_kv_heads", 2), ("model.d_ff", 384), ("model.max_seq_len", 512),
                  ("train.steps", 100), ("train.batch_size", 32), ("train.seq_len", 128),
                  ("train.microbatches", 1), ("train.log_every", 10),
                  ("train.max_bad_steps", 3)):
        _positive_int(c, f, ex)
    _require(m.vocab_size >= 0, "model.vocab_size", f"must be >= 0, got {m.vocab_size}",
             "set 0 to size it from the tokenizer")
    _require(m.head_dim >= 0, "model.head_dim", f"must be >= 0, got {m.head_dim}",
             "set 0 for d_model / n_heads, or the checkpoint's head_dim")
    if m.head_dim == 0:
        _require(m.d_model % m.n_heads == 0, "model.d_model",
                 f"{m.d_model} is not divisible by model.n_heads = {m.n_heads}",
                 f"make d_model a multiple of n_heads, e.g. "
                 f"{m.n_heads * max(1, m.d_model // m.n_heads)}, or set model.head_dim")
        _require((m.d_model // m.n_heads) % 2 == 0, "model.d_model",
                 f"head dimension d_model / n_heads = {m.d_model // m.n_heads} is odd; rotary "
                 "embeddings rotate pairs of dimensions", "choose d_model / n_heads even")
    else:
        _require(m.head_dim % 2 == 0, "model.head_dim", f"{m.head_dim} is odd; rotary "
                 "embeddings rotate pairs of dimensions", "choose an even head_dim")
    _require(m.rope_type in ROPE_TYPES, "model.rope_type", f"unknown type {m.rope_type!r}",
             f"choose one of {', '.join(ROPE_TYPES)}")
    if m.rope_type != "default":
        _require(m.rope_factor > 0, "model.rope_factor", f"must be > 0, got {m.rope_factor}",
                 "use the checkpoint's rope_scaling.factor, e.g. 8.0")
    if m.rope_type == "llama3":
        _require(m.rope_high_freq_factor > m.rope_low_freq_factor > 0,
                 "model.rope_high_freq_factor",
                 f"must exceed model.rope_low_freq_factor = {m.rope_low_freq_factor} (> 0), "
                 f"got {m.rope_high_freq_factor}", "use Llama 3.1's 4.0 and 1.0")
        _positive_int(c, "model.rope_original_max_len", 8192)
    _require(not (m.preset and m.init_from), "model.preset",
             f"{m.preset!r} is set and so is model.init_from = {m.init_from!r}",
             "set only model.init_from: the checkpoint's config.json gives the architecture")
    if m.preset:
        from hetjax.interop.hf_config import preset_fields

        preset_fields(m.preset)  # an unknown name is one error listing the presets
    _require(not m.init_from or os.path.isdir(os.path.expanduser(m.init_from)),
             "model.init_from", f"{m.init_from!r} is not a directory",
             "give a HuggingFace model directory (config.json + *.safetensors)")
    if m.init_from:
        from hetjax.interop import hf_config

        # The fields that shape the weights must be the checkpoint's (the rest, e.g. RoPE
        # scaling or max_seq_len, a run may change on purpose).
        hf = hf_config.model_fields(hf_config.read_config_json(m.init_from), "model.init_from")
        for k in hf_config.SHAPE_FIELDS:
            _require(m[k] == hf[k], f"model.{k}",
                     f"is {m[k]!r}, but the weights of model.init_from = {m.init_from!r} have "
                     f"{hf[k]!r}", "drop the override (load_config sets it from config.json; "
                     "in Python call hetjax.config.apply_model_source(config))")
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
             f"n_heads = {m.n_heads} is not a multiple of n_kv_heads = {m.n_kv_heads}",
             f"pick n_kv_heads from the divisors of {m.n_heads}: "
             f"{[d for d in range(1, m.n_heads + 1) if m.n_heads % d == 0]}")
    _require(tr.seq_len <= m.max_seq_len, "train.seq_len",
             f"{tr.seq_len} is longer than the model takes (model.max_seq_len = {m.max_seq_len})",
             f"lower train.seq_len or raise model.max_seq_len to >= {tr.seq_len}")
    _require(m.rope_theta > 0, "model.rope_theta", f"must be > 0, got {m.rope_theta}",
             "use 10000.0")
    _require(m.norm_eps > 0, "model.norm_eps", f"must be > 0, got {m.norm_eps}", "use 1e-5")
    _require(m.dtype == "auto" or m.dtype in DTYPES, "model.dtype",
             f"unknown dtype {m.dtype!r}", f"choose one of auto, {', '.join(DTYPES)}")
    _require(m.param_dtype in DTYPES, "model.param_dtype",
             f"unknown dtype {m.param_dtype!r}", f"choose one of {', '.join(DTYPES)}")
    _require(m.attention in ATTENTION_IMPLEMENTATIONS, "model.attention",
             f"unknown implementation {m.attention!r}",
             f"choose one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    _require(m.remat in REMAT_POLICIES, "model.remat", f"unknown policy {m.remat!r}",
             f"choose one of {', '.join(REMAT_POLICIES)}")
    _require(isinstance(m.loss_chunk_tokens, int) and m.loss_chunk_tokens >= 0,
             "model.loss_chunk_tokens", f"must be an integer >= 0, got {m.loss_chunk_tokens!r}",
             "use 0 (one piece) or e.g. 4096")

    _require(tr.lr > 0, "train.lr", f"the learning rate must be positive, got {tr.lr}",
             "set --config.train.lr to a value > 0, e.g. 3e-4")
    _require(0 <= tr.min_lr_ratio <= 1, "train.min_lr_ratio",
             f"must be in [0, 1], got {tr.min_lr_ratio}", "use 0.1")
    _require(-1 <= tr.warmup_steps <= tr.steps, "train.warmup_steps",
             f"must be in [0, train.steps = {tr.steps}] (or -1 for 10% of the steps), "
             f"got {tr.warmup_steps}", f"use about 10% of the steps, e.g. {max(1, tr.steps // 10)}")
    _require(tr.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {tr.weight_decay}",
             "use 0.1, or 0 to disable")
    for f in ("train.b1", "train.b2"):
        _require(0 <= _get(c, f) < 1, f, f"must be in [0, 1), got {_get(c, f)}",
                 "use 0.9 for b1 and 0.95 for b2")
    _require(tr.eps > 0, "train.eps", f"must be > 0, got {tr.eps}", "use 1e-8")
    _require(tr.seed >= 0, "train.seed", f"must be >= 0, got {tr.seed}",
             "use 0, or any other non-negative integer (the parameters and the data order "
             "follow it)")
    _require(tr.profile_steps >= 0, "train.profile_steps",
             f"must be >= 0, got {tr.profile_steps}", "use 2, or 0 to disable profiling")
    _require(tr.profile_from >= 1, "train.profile_from", f"must be >= 1, got {tr.profile_from}",
             "use 3: steps 1-2 compile and warm up")
    _require(tr.max_loss_ratio == 0 or tr.max_loss_ratio > 1, "train.max_loss_ratio",
             f"must be > 1 (or 0 for off), got {tr.max_loss_ratio}",
             "use 4.0: a loss 4x its start is far worse than a uniform guess")
    _require(tr.grad_clip >= 0, "train.grad_clip", f"must be >= 0, got {tr.grad_clip}",
             "use 1.0, or 0 to disable clipping")

    _require(c.data.source in DATA_SOURCES, "data.source", f"unknown source {c.data.source!r}",
             f"choose one of {', '.join(DATA_SOURCES)}")
    _require(c.data.source != "files" or bool(c.data.path), "data.path",
             "data.source = 'files' needs a directory or glob of text files",
             "set --config.data.path=/path/to/texts (or a glob like '/data/*.txt')")
    if c.data.source == "files":  # found now, not after the model is compiled
        _validate_sources(c.data)
    _validate_paths(c)
    _validate_data_and_checkpoints(c)
    _validate_diloco(c)
    _validate_wandb(c)
    _require(0 <= c.planner.memory_margin < 1, "planner.memory_margin",
             f"must be in [0, 1), got {c.planner.memory_margin}",
             "use 0.1 (plans use at most 90% of device memory)")
    _require(c.planner.get("compute", "flat") in ("flat", "kinds"), "planner.compute",
             f"{c.planner.get('compute')!r} is not a compute model",
             "use 'flat' (one efficiency per FLOP) or 'kinds' (priced by operation kind)")
    _require(not c.planner.calibration or os.path.isfile(c.planner.calibration),
             "planner.calibration", f"{c.planner.calibration!r} is not a file",
             "write one with 'hetjax calibrate --out=calibration.json', or leave it empty")

    p = c.parallel
    for f in ("parallel.pp", "parallel.dp", "parallel.tp"):
        v = _get(c, f)
        _require(isinstance(v, int) and v >= 0, f, f"must be >= 1 (or 0 for automatic), got {v!r}",
                 f"set --config.{f}=1")
    _require(c.pipeline.boundary_codec in BOUNDARY_CODECS, "pipeline.boundary_codec",
             f"unknown codec {c.pipeline.boundary_codec!r}",
             f"choose one of {', '.join(BOUNDARY_CODECS)}")
    _require(c.zero.preset in zr.CONFIG_PRESETS, "zero.preset",
             f"unknown preset {c.zero.preset!r}",
             f"choose one of {', '.join(zr.CONFIG_PRESETS)}")
    for f in ("zero.s_p", "zero.s_g", "zero.s_os"):
        _positive_int(c, f, 1)
    factors = (c.zero.s_p, c.zero.s_g, c.zero.s_os)
    _require(c.zero.preset == "custom" or factors == (1, 1, 1), "zero.preset",
             f"zero.s_p / s_g / s_os = {factors} are only read when zero.preset = 'custom', "
             f"but it is {c.zero.preset!r}",
             "set --config.zero.preset=custom to use them, or leave them at 1")
    # The layout rules a config fixes before the topology is known: the Plan's, one definition.
    raise_first(layout_problems(
        pp=p.pp, stage_layers=tuple(c.pipeline.stage_layers), n_layers=m.n_layers,
        microbatches=resolve_microbatches(c), global_batch=tr.batch_size,
        schedule=c.pipeline.schedule, executor=c.pipeline.executor,
        placement=c.pipeline.placement,
        zero=ZeroFactors(*factors) if c.zero.preset == "custom" else None), ConfigError)
    if p.tp:
        for f, v in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads),
                     ("model.d_ff", m.d_ff)):
            _require(v % p.tp == 0, "parallel.tp",
                     f"tp = {p.tp} does not divide {f} = {v}; tensor parallelism splits it",
                     f"choose tp from the common divisors of n_heads, n_kv_heads and d_ff: "
                     f"{_common_divisors(m.n_heads, m.n_kv_heads, m.d_ff)}")


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


def _validate_paths(c) -> None:
    """The workdir and checkpoint directory can be created or written (checked before start-up,
    not when the first file is written)."""
    _require(bool(c.workdir.strip()), "workdir", "is empty",
             "set --config.workdir to a directory, e.g. --config.workdir=runs/default")
    for field in ("workdir", "checkpoint.dir"):
        path = _get(c, field)
        if not path:
            continue
        path = os.path.abspath(os.path.expanduser(path))
        _require(not os.path.exists(path) or os.path.isdir(path), field,
                 f"{path} exists and is not a directory", f"choose another --config.{field}")
        parent = path
        while not os.path.exists(parent):  # the deepest existing ancestor must be writable
            parent = os.path.dirname(parent)
        _require(os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK), field,
                 f"{path} cannot be written ({parent} is "
                 f"{'not writable' if os.path.isdir(parent) else 'a file'})",
                 f"choose a --config.{field} under a directory you can write")


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
    _require(d.tokenizer == "byte" or os.path.exists(os.path.expanduser(d.tokenizer)),
             "data.tokenizer", f"{d.tokenizer!r} is neither 'byte' nor a file",
             "use 'byte', a tokenizer.json / tokenizer.model file, or train a SentencePiece "
             "model with 'hetjax tokenizer train --out=tok.model' and set "
             "--config.data.tokenizer=tok.model")
    _require(d.add_bos in ("auto", "true", "false"), "data.add_bos",
             f"unknown value {d.add_bos!r}",
             "use auto (as the tokenizer's own config says), true or false")
    if c.model.vocab_size:
        # Token ids past the embedding table give NaN losses, silently: refuse them here.
        from hetjax.tokenizer import load_tokenizer

        n = load_tokenizer(d.tokenizer).vocab_size
        _require(c.model.vocab_size >= n, "model.vocab_size",
                 f"{c.model.vocab_size} is smaller than the tokenizer's {n} tokens "
                 f"(data.tokenizer = {d.tokenizer!r})",
                 f"set --config.model.vocab_size=0 (sized from the tokenizer) or >= {n}")
    _require(0 <= d.eval_fraction <= 0.5, "data.eval_fraction",
             f"must be in [0, 0.5], got {d.eval_fraction}", "use 0.01")
    for f, ex in (("data.prefetch", 4), ("data.threads", 2), ("eval.batches", 4),
                  ("checkpoint.keep", 3)):
        _positive_int(c, f, ex)
    for f, ex in (("eval.every", 100), ("checkpoint.every", 100), ("checkpoint.keep_best", 1)):
        v = _get(c, f)
        _require(isinstance(v, int) and v >= 0, f, f"must be an integer >= 0, got {v!r}",
                 f"set --config.{f}={ex} (0 turns it off)")
    if k.keep_best:
        _require(k.every > 0, "checkpoint.keep_best", "keeps checkpoints, but checkpoint.every "
                 "= 0 saves none", "set checkpoint.every > 0, or keep_best = 0")
        _require(e.every > 0 and k.every % e.every == 0, "checkpoint.keep_best",
                 f"ranks checkpoints by eval loss, but eval.every = {e.every} does not evaluate "
                 f"at every save (checkpoint.every = {k.every})",
                 f"set eval.every to a divisor of {k.every}, e.g. --config.eval.every={k.every}")


def _validate_diloco(c) -> None:
    d = c.diloco
    _require(isinstance(d.inner_steps, int) and d.inner_steps >= 0, "diloco.inner_steps",
             f"must be an integer >= 0, got {d.inner_steps!r}",
             "set --config.diloco.inner_steps=50 (0 turns DiLoCo off)")
    for f, options in (("diloco.codec", DILOCO_CODECS),
                       ("diloco.outer_optimizer", ("nesterov", "sgd")),
                       ("diloco.inner_optimizer", ("adamw", "sgd"))):
        _require(_get(c, f) in options, f, f"unknown choice {_get(c, f)!r}",
                 f"choose one of {', '.join(options)}")
    _require(d.outer_lr > 0, "diloco.outer_lr", f"must be > 0, got {d.outer_lr}", "use 0.7")
    _require(0 <= d.outer_momentum < 1, "diloco.outer_momentum",
             f"must be in [0, 1), got {d.outer_momentum}", "use 0.9")
    _require(isinstance(d.fragments, int) and d.fragments >= 1, "diloco.fragments",
             f"must be an integer >= 1, got {d.fragments!r}", "use 1 (no streaming)")
    _require(not d.inner_steps or d.inner_steps % d.fragments == 0, "diloco.fragments",
             f"{d.fragments} fragments do not divide diloco.inner_steps = {d.inner_steps}",
             "choose fragments dividing inner_steps, e.g. --config.diloco.fragments=1")
    every = d.inner_steps // d.fragments if d.inner_steps else 0
    _require(isinstance(d.overlap_steps, int) and d.overlap_steps >= 0, "diloco.overlap_steps",
             f"must be an integer >= 0, got {d.overlap_steps!r}", "use 0 (no overlap)")
    # one fragment in flight at a time: it lands before the next fragment's exchange starts
    _require(not d.inner_steps or d.overlap_steps < every, "diloco.overlap_steps",
             f"{d.overlap_steps} overlap steps do not fit between two fragment exchanges "
             f"(every inner_steps / fragments = {every} steps)",
             f"use overlap_steps < {every}, e.g. --config.diloco.overlap_steps={every - 1}")
    _require(isinstance(d.mix, (int, float)) and 0 <= d.mix < 1, "diloco.mix",
             f"must be in [0, 1), got {d.mix!r}", "use 0 (replace) or 0.5")
    _require(not d.mix or d.overlap_steps > 0, "diloco.mix",
             f"mixes a fragment that trained on while its exchange travelled; with "
             f"overlap_steps = 0 there is none (mix = {d.mix})",
             "set --config.diloco.overlap_steps too, or leave diloco.mix=0")
    _require(isinstance(d.inner_lr_scale, (int, float)) and d.inner_lr_scale > 0,
             "diloco.inner_lr_scale", f"must be a number > 0, got {d.inner_lr_scale!r}",
             "use 1.0 (the sites train at train.lr's schedule)")


WANDB_MODES = ("online", "offline", "disabled")


def _validate_wandb(c) -> None:
    """The W&B mode, and wandb importable when a project is set (before anything is built)."""
    import importlib.util

    w = c.wandb
    _require(w.mode in WANDB_MODES, "wandb.mode", f"unknown mode {w.mode!r}",
             f"choose one of {', '.join(WANDB_MODES)}")
    _require(not w.project or importlib.util.find_spec("wandb") is not None, "wandb.project",
             f"logging to W&B project {w.project!r} needs the wandb package, which is not "
             "installed", "pip install 'hetjax[wandb]', or leave --config.wandb.project empty")


def _common_divisors(*xs: int) -> list[int]:
    g = math.gcd(*xs)
    return [d for d in range(1, g + 1) if g % d == 0]
