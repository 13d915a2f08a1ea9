"""Configuration: every field hetjax reads, its default, loading with overrides, and validation.

Each field is defined once, as a `Field` of FIELDS: its default, its description (the `--help`
line) and its own check; `base_config()`, `DESCRIPTIONS` (`--help`), `PATH_FIELDS` and the
first step of `validate` are made from that table. Name sets are imported from their owners
(schedules, executors, ZeRO presets, codecs, RoPE types, compute models). `configs/*.py` files
start from `base_config()` and change what their scenario needs. `load_config(path,
overrides)` reads a `get_config()` file with `--config.a.b=value` overrides exactly as the CLI
does (ml_collections.config_flags). `validate(config)` checks everything that does not need
JAX and raises a `ConfigError` naming the field and the fix: the fields' own checks, then the
rules between fields. Layout rules are not repeated here: they are the Plan's
(`hetjax.core.plan.layout_problems`); the checks that need the topology (degrees against device
counts, placement, ZeRO factors on nodes) run where the Plan is built
(hetjax/planner/config_plan.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import ml_collections

from hetjax.errors import ConfigError, HetjaxError
from hetjax.core import topology as topo
from hetjax.planner import zero_factors as zr
from hetjax.planner.config_plan import resolve_microbatches
from hetjax.planner.cost import COMPUTE_MODELS
from hetjax.interop.hf_config import ROPE_TYPES
from hetjax.core.plan import (INNER_OPTIMIZERS, OUTER_OPTIMIZERS, ZeroFactors, layout_problems,
                         name_problems, raise_first)
from hetjax.core.registry import EXECUTORS, executor_help
from hetjax.core.schedules import SCHEDULES, spmd_schedules
from hetjax.core.wire import BOUNDARY_CODECS, DILOCO_CODECS
from hetjax.core.model_config import ATTENTION_IMPLEMENTATIONS, MOE_DISPATCH, REMAT_POLICIES

DTYPES = ("float32", "bfloat16", "float16")
DATA_SOURCES = ("stdlib", "files", "synthetic")
WANDB_MODES = ("online", "offline", "disabled")
ADD_BOS = ("auto", "true", "false")


# --- one spec per field -------------------------------------------------------------------------
@dataclass(frozen=True)
class Choices:
    """The value is one of a name set; `names` is its owner's tuple (or a function returning
    it, for registries that grow). `notes` describe some names in `--help`."""

    names: tuple[str, ...] | Callable[[], Sequence[str]]
    what: str = "choice"
    notes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    fix: str = ""

    def options(self) -> tuple[str, ...]:
        return tuple(self.names() if callable(self.names) else self.names)

    def __call__(self, field: str, value):
        if value in self.options():
            return None
        return (f"unknown {self.what} {value!r}",
                self.fix or f"choose one of {', '.join(self.options())}")

    def render(self) -> str:
        return " | ".join(f"{n} ({self.notes[n]})" if n in self.notes else n
                          for n in self.options())


@dataclass(frozen=True)
class Bound:
    """A number (an integer when `integer`) in [lo, hi] (`lo_open` / `hi_open`: the bound
    itself is out). `problem` / `fix` may name {field}, {value}, {default}."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    fix: str = "set --config.{field}={default!r}"
    problem: str = ""

    def __call__(self, field: str, value):
        ok = (isinstance(value, int) if self.integer else isinstance(value, (int, float)))
        ok = ok and not isinstance(value, bool)
        if ok and self.lo is not None:
            ok = value > self.lo if self.lo_open else value >= self.lo
        if ok and self.hi is not None:
            ok = value < self.hi if self.hi_open else value <= self.hi
        if ok:
            return None
        kw = dict(field=field, value=value, default=_spec(field).default)
        return (self.problem.format(**kw) or f"must be {self.text()}, got {value!r}",
                self.fix.format(**kw))

    def text(self) -> str:
        if self.integer and self.lo == 1 and not self.lo_open and self.hi is None:
            return "a positive integer"
        if self.lo is not None and self.hi is not None:
            return (f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}"
                    f"{')' if self.hi_open else ']'}")
        kind = "an integer " if self.integer else ""
        if self.lo is not None:
            return f"{kind}{'>' if self.lo_open else '>='} {self.lo}"
        return f"{kind}{'<' if self.hi_open else '<='} {self.hi}"


def positive_int(fix: str = "set --config.{field}={default}") -> Bound:
    return Bound(lo=1, integer=True, fix=fix)


def count_or_off(fix: str = "set --config.{field}={example} (0 turns it off)",
                 example: int = 100) -> Bound:
    """An integer >= 0, 0 turning the feature off."""
    return Bound(lo=0, integer=True, fix=fix.replace("{example}", str(example)))


@dataclass(frozen=True)
class Field:
    """One config field: its dotted name, default, description (its `--help` line; a function
    for text that reads a registry) and its own check (a `Choices`, a `Bound`, or any
    function (field, value) -> None | (problem, fix)). Rules between fields are functions
    of `validate`. `path`: a file or directory (`expand_paths`)."""

    name: str
    default: Any
    help: str | Callable[[], str]
    check: Callable[[str, Any], Any] | None = None
    path: bool = False

    def description(self) -> str:
        text = self.help() if callable(self.help) else self.help
        if isinstance(self.check, Choices):
            names = self.check.render()
            text = text.format(choices=names) if "{choices}" in text else f"{text}: {names}"
        return text


def _is_file_or_byte(field, v):
    if v == "byte" or os.path.exists(os.path.expanduser(v)):
        return None
    return (f"{v!r} is neither 'byte' nor a file",
            "use 'byte', a tokenizer.json / tokenizer.model file, or train a SentencePiece "
            "model with 'hetjax tokenizer train --out=tok.model' and set "
            "--config.data.tokenizer=tok.model")


def _is_dir_or_empty(fix: str):
    def check(field, v):
        if not v or os.path.isdir(os.path.expanduser(v)):
            return None
        return f"{v!r} is not a directory", fix
    return check


def _is_file_or_empty(fix: str):
    def check(field, v):
        if not v or os.path.isfile(v):
            return None
        return f"{v!r} is not a file", fix
    return check


def _known_model_preset(field, v):
    if v:
        from hetjax.interop.hf_config import preset_fields

        preset_fields(v)  # an unknown name is one error listing the presets
    return None


def _even_or_zero(field, v):
    if v % 2 == 0:
        return None
    return f"{v} is odd; rotary embeddings rotate pairs of dimensions", "choose an even head_dim"


def _loss_ratio(field, v):
    if v == 0 or v > 1:
        return None
    return (f"must be > 1 (or 0 for off), got {v}",
            "use 4.0: a loss 4x its start is far worse than a uniform guess")


def _writable_dir(field, path):
    """The directory can be created or written (checked before start-up, not when the first
    file is written)."""
    if not path:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} exists and is not a directory", f"choose another --config.{field}"
    parent = path
    while not os.path.exists(parent):  # the deepest existing ancestor must be writable
        parent = os.path.dirname(parent)
    if os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
        return None
    return (f"{path} cannot be written ({parent} is "
            f"{'not writable' if os.path.isdir(parent) else 'a file'})",
            f"choose a --config.{field} under a directory you can write")


def _workdir(field, path):
    if not path.strip():
        return ("is empty",
                "set --config.workdir to a directory, e.g. --config.workdir=runs/default")
    return _writable_dir(field, path)


def _wandb_installed(field, project):
    import importlib.util

    if not project or importlib.util.find_spec("wandb") is not None:
        return None
    return (f"logging to W&B project {project!r} needs the wandb package, which is not "
            "installed", "pip install 'hetjax[wandb]', or leave --config.wandb.project empty")


def _layout_name(kind: str):
    """A pipeline name checked by the Plan's rule (`hetjax.core.plan.name_problems`)."""
    def check(field, v):
        bad = name_problems(allow_auto=True, **{kind: v})
        return (bad[0].problem, bad[0].fix) if bad else None
    return check


def _schedule_help() -> str:
    grid = [k.name for k in EXECUTORS.values() if k.tick_grid_only]
    return (f"{' | '.join(SCHEDULES)} (executor {' and '.join(grid)} runs "
            f"{', '.join(spmd_schedules())}; strands: two strands per tick)")


def _model_presets() -> str:
    from hetjax.interop.hf_config import PRESETS

    return (f"a published architecture (hetjax.interop.hf_config.PRESETS: "
            f"{', '.join(PRESETS)}); sets the architecture fields, explicit --config.model.* "
            "overrides win")


_DEGREE = Bound(lo=0, integer=True, problem="must be >= 1 (or 0 for automatic), got {value!r}",
                fix="set --config.{field}=1")
_TOPOLOGY_COUNT = Bound(lo=0, integer=True, fix="set --config.{field}=2 (0 keeps the preset)")
_TOPOLOGY_FIGURE = Bound(lo=0, fix="set --config.{field}=<a positive number>")

FIELDS: tuple[Field, ...] = (
    Field("topology.preset", "cpu_hybrid", "a name from hetjax.core.topology.PRESETS",
          Choices(lambda: sorted(topo.PRESETS), "preset",
                  fix="choose one of: " + ", ".join(sorted(topo.PRESETS)))),
    Field("topology.file", "", "a JSON topology (Topology.to_json()); overrides preset",
          path=True),
    Field("topology.nodes", 0, "> 0 overrides the preset's nodes per cluster", _TOPOLOGY_COUNT),
    Field("topology.devices_per_node", 0, "> 0 overrides the preset's devices per node",
          _TOPOLOGY_COUNT),
    Field("topology.peak_tflops", 0.0, "> 0 states the devices' peak dense bf16 TFLOP/s (preset "
          "local; required for a device kind the catalogue lacks)", _TOPOLOGY_FIGURE),
    Field("topology.memory_gib", 0.0, "> 0 states the devices' memory in GiB (preset local; "
          "default: what the runtime reports, else the catalogue)", _TOPOLOGY_FIGURE),

    Field("model.vocab_size", 0, "0: the tokenizer's vocabulary rounded up to a multiple of 128",
          Bound(lo=0, fix="set 0 to size it from the tokenizer")),
    Field("model.d_model", 128, "width of the residual stream", positive_int()),
    Field("model.n_layers", 4, "decoder blocks", positive_int()),
    Field("model.n_heads", 4, "attention (query) heads", positive_int()),
    Field("model.n_kv_heads", 2, "key/value heads: grouped-query attention; = n_heads for plain "
          "multi-head", positive_int()),
    Field("model.d_ff", 384, "hidden width of the SwiGLU feed-forward", positive_int()),
    Field("model.max_seq_len", 512, "longest sequence the model takes (HF "
          "max_position_embeddings)", positive_int()),
    Field("model.rope_theta", 10000.0, "rotary embedding base",
          Bound(lo=0, lo_open=True, fix="use 10000.0")),
    Field("model.norm_eps", 1e-5, "RMSNorm epsilon", Bound(lo=0, lo_open=True, fix="use 1e-5")),
    Field("model.tie_embeddings", True, "share the input embedding with the output projection"),
    Field("model.dtype", "auto", "compute dtype: {choices}",
          Choices(("auto", *DTYPES), "dtype", {
              "auto": "bfloat16 on accelerators with float32 master weights in "
                      "model.param_dtype, float32 on CPU"})),
    Field("model.param_dtype", "float32", "dtype parameters are stored (and optimized) in",
          Choices(DTYPES, "dtype")),
    Field("model.remat", "auto", "what a layer keeps for its backward: {choices}",
          Choices(REMAT_POLICIES, "policy", {
              "none": "every intermediate; 3 forwards per layer",
              "dots": "matmul outputs", "full": "its input; 4 forwards",
              "auto": "when the planner searches, the fastest of the three that fits memory; "
                      "otherwise none, but full in the SPMD pipeline"})),
    Field("model.attention", "auto", "attention kernel: {choices}",
          Choices(ATTENTION_IMPLEMENTATIONS, "implementation", {
              "auto": "cuDNN fused flash attention on NVIDIA GPUs where it supports the dtype "
                      "and head size, else the Pallas flash kernel, else XLA; XLA on CPU/TPU"})),
    Field("model.loss_chunk_tokens", 0, "cross-entropy over the vocabulary in chunks of this "
          "many tokens per device, each recomputed in the backward, so the float32 logits "
          "[tokens, vocab] are never whole; 0: in one piece (the single-program step, pp = 1)",
          Bound(lo=0, integer=True, fix="use 0 (one piece) or e.g. 4096")),
    Field("model.head_dim", 0, "width of one attention head; 0: d_model / n_heads",
          lambda f, v: Bound(lo=0, fix="set 0 for d_model / n_heads, or the checkpoint's "
                             "head_dim")(f, v) or _even_or_zero(f, v)),
    Field("model.rope_type", "default", "RoPE frequency scaling as transformers",
          Choices(ROPE_TYPES, "type")),
    Field("model.rope_factor", 1.0, "RoPE scaling factor (linear, llama3)"),
    Field("model.rope_low_freq_factor", 1.0, "llama3 RoPE scaling: low_freq_factor"),
    Field("model.rope_high_freq_factor", 4.0, "llama3 RoPE scaling: high_freq_factor"),
    Field("model.rope_original_max_len", 8192, "llama3 RoPE scaling: "
          "original_max_position_embeddings"),
    Field("model.qkv_bias", False, "biases on the query/key/value projections (Qwen2)"),
    Field("model.n_experts", 0, "Mixture-of-Experts: routed experts per MoE layer; 0: a dense "
          "model", count_or_off("set --config.{field}=8 (0: a dense model)", 8)),
    Field("model.experts_per_token", 2, "MoE: experts each token is routed to (top-k)",
          positive_int()),
    Field("model.moe_d_ff", 0, "MoE: hidden width of one expert; 0: model.d_ff",
          count_or_off("set --config.{field}=0 (model.d_ff) or a positive width", 256)),
    Field("model.shared_expert_d_ff", 0, "MoE: hidden width of a shared expert every token "
          "passes (Qwen2-MoE); 0: none", count_or_off("set --config.{field}=0 (none)", 256)),
    Field("model.moe_shared_expert_gate", True, "MoE: scale the shared expert's output by a "
          "learned sigmoid gate (Qwen2-MoE)"),
    Field("model.decoder_sparse_step", 1, "MoE: layer i is an MoE layer when (i + 1) is a "
          "multiple of this (and i >= first_dense_layers)", positive_int()),
    Field("model.first_dense_layers", 0, "MoE: the first layers keep a dense feed-forward",
          count_or_off("set --config.{field}=0", 1)),
    Field("model.moe_norm_topk_prob", True, "MoE: renormalise the k routing weights to sum to "
          "1 (Mixtral, Qwen3-MoE); false keeps the softmax values (OLMoE, Qwen2-MoE)"),
    Field("model.moe_aux_loss_coef", 0.01, "MoE: load-balance loss coefficient (Switch / "
          "Megatron convention: a uniform router's loss is this coefficient)",
          Bound(lo=0, fix="use 0.01, or 0 to disable")),
    Field("model.moe_z_loss_coef", 0.0, "MoE: router z-loss coefficient",
          Bound(lo=0, fix="use 0.001, or 0 to disable")),
    Field("model.moe_dispatch", "auto", "MoE: how tokens reach their experts: {choices}",
          Choices(MOE_DISPATCH, "dispatch", {
              "auto": "dropless", "dense": "every expert on every token; the reference",
              "dropless": "sorted grouped matmuls, no token dropped",
              "capacity": "model.moe_capacity_factor slots per expert, overflow dropped"})),
    Field("model.moe_capacity_factor", 1.25, "MoE capacity dispatch: slots per expert = factor "
          "* tokens * k / n_experts", Bound(lo=0, lo_open=True, fix="use 1.25")),
    Field("model.preset", "", _model_presets, _known_model_preset),
    Field("model.init_from", "", "a HuggingFace model directory (config.json + *.safetensors): "
          "its architecture, and its weights as the starting parameters",
          _is_dir_or_empty("give a HuggingFace model directory (config.json + "
                           "*.safetensors)")),

    Field("parallel.pp", 1, "pipeline stages; pp * dp * tp = topology devices; 0: the planner "
          "chooses", _DEGREE),
    Field("parallel.dp", 0, "data-parallel replicas; 0: all remaining devices", _DEGREE),
    Field("parallel.tp", 1, "tensor-parallel shards (inside a node); 0: the planner chooses",
          _DEGREE),
    Field("parallel.ep", 1, "expert parallelism (MoE models): the experts split over groups of "
          "ep data-parallel devices; divides dp and model.n_experts", positive_int()),
    Field("parallel.allow_straddle", False, "allow a TP group across nodes / a stage across "
          "clusters"),

    Field("pipeline.stage_layers", (), "layers per stage, e.g. (3, 1); empty: even split"),
    Field("pipeline.schedule", "1f1b", _schedule_help, _layout_name("schedule")),
    Field("pipeline.executor", "spmd", executor_help, _layout_name("executor")),
    Field("pipeline.placement", "looped", "looped: one model chunk per stage in order | folded: "
          "two chunks per device in a V (down, then back up; device 0 holds embedding and "
          "head), each device's stage_layers split ceil/floor down/up | auto: the planner "
          "prices both", _layout_name("placement")),
    Field("pipeline.microbatches", 0, "alias of train.microbatches for pipeline users; 0: unset"),
    Field("pipeline.boundary_codec", "none", "activations and their gradients crossing worlds "
          "(MPMD stages on different clusters): {choices}",
          Choices(BOUNDARY_CODECS, "codec", {
              "int8": "int8 with per-row scales, gradients with error feedback"})),

    Field("zero.preset", "ddp", "sharding of optimizer state / gradients / parameters",
          Choices(zr.CONFIG_PRESETS, "preset")),
    Field("zero.s_p", 1, "parameter shard factor (zero.preset=custom only)", positive_int()),
    Field("zero.s_g", 1, "gradient shard factor (zero.preset=custom only)", positive_int()),
    Field("zero.s_os", 1, "optimizer-state shard factor (zero.preset=custom only)",
          positive_int()),

    Field("planner.memory_margin", 0.1, "share of device memory a plan leaves free "
          "(fragmentation)", Bound(lo=0, hi=1, hi_open=True,
                                   fix="use 0.1 (plans use at most 90% of device memory)")),
    Field("planner.calibration", "", "a `hetjax calibrate` JSON file: measured compute and links",
          _is_file_or_empty("write one with 'hetjax calibrate --out=calibration.json', or "
                            "leave it empty"), path=True),
    Field("planner.compute", "flat", "{choices}: compute priced at one efficiency per FLOP "
          "(flat), or by operation kind (kinds: matmuls by size, attention per implementation, "
          "memory-bound work by bandwidth; a calibration file's measured rates when it has "
          "them)",
          Choices(COMPUTE_MODELS, "compute model", fix="use 'flat' (one efficiency per FLOP) "
                  "or 'kinds' (priced by operation kind)")),

    Field("train.steps", 300, "optimizer steps of the run", positive_int()),
    Field("train.batch_size", 32, "global batch, in sequences", positive_int()),
    Field("train.seq_len", 128, "tokens per sequence", positive_int()),
    Field("train.microbatches", 1, "the batch is split into this many micro-batches per step",
          positive_int()),
    Field("train.lr", 3e-3, "peak learning rate (AdamW)", Bound(
        lo=0, lo_open=True, problem="the learning rate must be positive, got {value}",
        fix="set --config.train.lr to a value > 0, e.g. 3e-4")),
    Field("train.min_lr_ratio", 0.1, "cosine decay ends at lr * min_lr_ratio",
          Bound(lo=0, hi=1, fix="use 0.1")),
    Field("train.warmup_steps", -1, "linear warmup steps; -1: 10% of train.steps"),
    Field("train.weight_decay", 0.1, "AdamW weight decay (matrices only, not norm scales)",
          Bound(lo=0, fix="use 0.1, or 0 to disable")),
    Field("train.b1", 0.9, "AdamW beta1",
          Bound(lo=0, hi=1, hi_open=True, fix="use 0.9 for b1 and 0.95 for b2")),
    Field("train.b2", 0.95, "AdamW beta2",
          Bound(lo=0, hi=1, hi_open=True, fix="use 0.9 for b1 and 0.95 for b2")),
    Field("train.eps", 1e-8, "AdamW epsilon", Bound(lo=0, lo_open=True, fix="use 1e-8")),
    Field("train.grad_clip", 1.0, "global-norm clipping; 0 disables",
          Bound(lo=0, fix="use 1.0, or 0 to disable clipping")),
    Field("train.seed", 0, "seed of the parameters and the data order",
          Bound(lo=0, fix="use 0, or any other non-negative integer (the parameters and the "
                          "data order follow it)")),
    Field("train.log_every", 10, "a metrics row and log line every N steps", positive_int()),
    Field("train.max_bad_steps", 3, "a step whose loss or gradient norm is NaN/Inf is skipped "
          "(no update); this many in a row stop the run with an error", positive_int()),
    Field("train.max_loss_ratio", 4.0, "a loss above this many times the run's first loss is "
          "divergence: the run stops with an error and saves nothing of it; 0: off",
          _loss_ratio),
    Field("train.progress", True, "progress bar on the terminal / notebook"),
    Field("train.profile_steps", 0, "trace this many steps with jax.profiler "
          "(<workdir>/profile/, summarised at the end); 0: off",
          Bound(lo=0, fix="use 2, or 0 to disable profiling")),
    Field("train.profile_from", 3, "the first traced step (after compilation and warm-up)",
          Bound(lo=1, fix="use 3: steps 1-2 compile and warm up")),

    Field("data.source", "stdlib", "where the text comes from", Choices(
        DATA_SOURCES, "source", {"stdlib": "Python's own sources"})),
    Field("data.path", "", "source=files: a directory, glob or file of text, .jsonl or .parquet; "
          "several joined by commas", path=True),
    Field("data.field", "text", "the text field of .jsonl and .parquet records"),
    Field("data.weights", "", "mix the comma-separated data.path sources by these weights (one "
          "per source, e.g. 0.7,0.3); empty: all files form one corpus"),
    Field("data.tokenizer", "byte", "byte, a SentencePiece .model, a HuggingFace tokenizer.json "
          "(or its directory), a tiktoken rank file, or a checkpoint's tokenizer directory",
          _is_file_or_byte, path=True),
    Field("data.add_bos", "auto", "begin each document with BOS: {choices}",
          Choices(ADD_BOS, "value", {"auto": "as the tokenizer's config says"},
                  fix="use auto (as the tokenizer's own config says), true or false")),
    Field("data.dir", "", "where text corpora are prepared (tfds); empty: ~/.cache/hetjax/tfds",
          path=True),
    Field("data.eval_fraction", 0.01, "share of the documents held out for evaluation",
          Bound(lo=0, hi=0.5, fix="use 0.01")),
    Field("data.prefetch", 4, "batches the loader prepares ahead of the step", positive_int()),
    Field("data.threads", 2, "loader threads", positive_int()),
    Field("data.document_mask", False, "packed rows carry segment ids and tokens attend only "
          "within their own document (not across an EOS); the single-program step and the "
          "SPMD pipeline"),

    Field("eval.every", 0, "evaluate on held-out data every N steps (and at the end); 0: never",
          count_or_off()),
    Field("eval.batches", 4, "global batches per evaluation", positive_int()),

    Field("checkpoint.every", 100, "save every N steps and at the end; 0: no checkpoints",
          count_or_off()),
    Field("checkpoint.keep", 3, "keep the latest K checkpoints", positive_int()),
    Field("checkpoint.keep_best", 0, "also keep the N with the lowest eval loss (needs "
          "eval.every)", count_or_off(example=1)),
    Field("checkpoint.async_save", True, "write in the background while training goes on"),
    Field("checkpoint.dir", "", "empty: <workdir>/checkpoints", _writable_dir, path=True),
    Field("checkpoint.allow_other_data", False, "resume a checkpoint written for other data "
          "(another corpus, tokenizer, seq_len, ...): the run goes on with the new data from its "
          "start, with a warning"),

    # DiLoCo between sites (docs/diloco.md): sites train alone for inner_steps steps, then
    # exchange pseudo-gradients and take an outer optimizer step. 0: synchronous training.
    Field("diloco.inner_steps", 0, "DiLoCo: sites train alone for H steps between exchanges; "
          "0: off", count_or_off("set --config.diloco.inner_steps={example} (0 turns DiLoCo "
                                 "off)", 50)),
    Field("diloco.sites", (), "empty: every topology cluster a site; or ('a+b', 'c') groups "
          "clusters"),
    Field("diloco.codec", "none", "pseudo-gradients on the wire (none: fp32)",
          Choices(DILOCO_CODECS)),
    Field("diloco.outer_optimizer", "nesterov", "the outer optimizer",
          Choices(OUTER_OPTIMIZERS)),
    Field("diloco.outer_lr", 0.7, "outer optimizer learning rate",
          Bound(lo=0, lo_open=True, fix="use 0.7")),
    Field("diloco.outer_momentum", 0.9, "outer Nesterov momentum",
          Bound(lo=0, hi=1, hi_open=True, fix="use 0.9")),
    Field("diloco.inner_optimizer", "adamw", "the sites' optimizer: {choices}",
          Choices(INNER_OPTIMIZERS, notes={"adamw": "the train.* optimizer",
                                           "sgd": "train.lr"})),
    Field("diloco.inner_lr_scale", 1.0, "the sites' learning rate is train.lr's schedule times "
          "this (each site sees 1/n of the global batch)",
          Bound(lo=0, lo_open=True, fix="use 1.0 (the sites train at train.lr's schedule)")),
    Field("diloco.fragments", 1, "streaming: the parameters in F fragments, fragment f exchanged "
          "at step f H / F of each round (1: all at the round's end)",
          Bound(lo=1, integer=True, problem="must be an integer >= 1, got {value!r}",
                fix="use 1 (no streaming)")),
    Field("diloco.overlap_steps", 0, "streaming: a fragment's exchange travels while the sites "
          "train this many more steps (tau < inner_steps / fragments; 0: none)",
          Bound(lo=0, integer=True, fix="use 0 (no overlap)")),
    Field("diloco.mix", 0.0, "with overlap_steps: a site keeps mix x its fragment + (1 - mix) x "
          "the new outer fragment (0: replace; the paper's alpha)",
          Bound(lo=0, hi=1, hi_open=True, fix="use 0 (replace) or 0.5")),

    Field("workdir", "runs/default", "where metrics.jsonl, loss.png, plan.json, checkpoints and "
          "TensorBoard go (hetjax.load_config from Python: runs/python unless set)", _workdir,
          path=True),
    Field("tensorboard", True, "also write TensorBoard event files"),

    # Weights & Biases, beside metrics.jsonl and TensorBoard (hetjax/metrics.py); the optional
    # dependency `pip install 'hetjax[wandb]'`
    Field("wandb.project", "", "log metrics to this Weights & Biases project (empty: off; needs "
          "the wandb extra)", _wandb_installed),
    Field("wandb.mode", "online", "{choices}", Choices(WANDB_MODES, "mode", {
        "offline": "files under <workdir>/wandb, `wandb sync` later"})),
    Field("wandb.name", "", "the W&B run's name (empty: the workdir's last directory)"),
)


def _spec(name: str) -> Field:
    return next(f for f in FIELDS if f.name == name)


def base_config() -> ml_collections.ConfigDict:
    """All fields with their defaults (FIELDS): a tiny LLaMA-style model on the default CPU
    topology."""
    c = ml_collections.ConfigDict()
    for f in FIELDS:
        *sections, name = f.name.split(".")
        node = c
        for s in sections:
            if s not in node:
                node[s] = ml_collections.ConfigDict()
            node = node[s]
        node[name] = f.default
    return c


class _Descriptions(Mapping):
    """Field name -> its `--help` line, read from FIELDS at each use (a registry may grow)."""

    def __getitem__(self, name: str) -> str:
        for f in FIELDS:
            if f.name == name:
                return f.description()
        raise KeyError(name)

    def __iter__(self):
        return iter([f.name for f in FIELDS])

    def __len__(self) -> int:
        return len(FIELDS)


# What each field means, shown by `hetjax <command> --help`, in base_config()'s order.
DESCRIPTIONS: Mapping[str, str] = _Descriptions()


def field_problems(c) -> list[tuple[str, str, str]]:
    """(field, problem, fix) for every field whose own check refuses its value."""
    out = []
    for f in FIELDS:
        if f.check is not None:
            verdict = f.check(f.name, _get(c, f.name))
            if verdict:
                out.append((f.name, *verdict))
    return out


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


def _check(c, field: str, check=None) -> None:
    """Raise ConfigError unless `check` (a field check, e.g. `positive_int()`; default the
    field's own) passes."""
    verdict = (check or _spec(field).check)(field, _get(c, field))
    if verdict:
        raise ConfigError(field, *verdict)


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


def warmup_steps(t) -> int:
    """train.warmup_steps, with -1 meaning 10% of train.steps."""
    return t.steps // 10 if t.warmup_steps == -1 else t.warmup_steps


# Every field that names a file or directory: `expand_paths` expands `~` and `$VAR` in them.
PATH_FIELDS = tuple(f.name for f in FIELDS if f.path)


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
    the path fields, `expand_paths`): each field's own check (FIELDS), then the rules between
    fields, then the layout rules of the Plan (`hetjax.core.plan.layout_problems`). Raises
    ConfigError."""
    check_fields(c)
    expand_paths(c)
    _validate_finite(c)
    for field, problem, fix in field_problems(c)[:1]:
        raise ConfigError(field, problem, fix)
    _validate_model(c)
    tr = c.train
    _require(-1 <= tr.warmup_steps <= tr.steps, "train.warmup_steps",
             f"must be in [0, train.steps = {tr.steps}] (or -1 for 10% of the steps), "
             f"got {tr.warmup_steps}", f"use about 10% of the steps, e.g. {max(1, tr.steps // 10)}")
    _require(c.data.source != "files" or bool(c.data.path), "data.path",
             "data.source = 'files' needs a directory or glob of text files",
             "set --config.data.path=/path/to/texts (or a glob like '/data/*.txt')")
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
    _require(not (m.preset and m.init_from), "model.preset",
             f"{m.preset!r} is set and so is model.init_from = {m.init_from!r}",
             "set only model.init_from: the checkpoint's config.json gives the architecture")
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
    if p.ep > 1:
        _require(m.n_experts > 0, "parallel.ep", f"= {p.ep}, but the model has no experts "
                 "(model.n_experts = 0)", "set --config.parallel.ep=1, or give the model "
                 "experts (model.n_experts)")
        _require(m.n_experts % p.ep == 0, "parallel.ep",
                 f"{p.ep} does not divide model.n_experts = {m.n_experts}",
                 f"choose ep from the divisors of {m.n_experts}: "
                 f"{_common_divisors(m.n_experts)}")
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


def _common_divisors(*xs: int) -> list[int]:
    g = math.gcd(*xs)
    return [d for d in range(1, g + 1) if g % d == 0]
