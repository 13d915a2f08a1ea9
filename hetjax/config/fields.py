"""Every config field, defined once: its dotted name, default, `--help` line and own check.

A field is a `Field` of `FIELDS`; its check is a `Choices` of a name set imported from its owner
(schedules, executors, ZeRO presets, codecs, RoPE types, compute models), a `Bound` on a number,
or a function `(field, value) -> None | (problem, fix)`. `base_config()` (every field at its
default), `DESCRIPTIONS` (the `--help` lines, read from FIELDS at each use) and `PATH_FIELDS`
(the fields naming files, whose `~` and `$VAR` are expanded) are made from the table. Loading is
`hetjax.config.loading`'s, the rules between fields `hetjax.config.validation`'s.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import ml_collections

from hetjax.core import topology as topo
from hetjax.core.model_config import (ATTENTION_IMPLEMENTATIONS, MOE_DISPATCH, QK_NORMS,
                                      REMAT_POLICIES)
from hetjax.core.model_config import LIMITS as MODEL_LIMITS
from hetjax.core.plan import INNER_OPTIMIZERS, OUTER_OPTIMIZERS, name_problems
from hetjax.core.registry import EXECUTORS, executor_help
from hetjax.core.schedules import SCHEDULES, spmd_schedules
from hetjax.core.wire import BOUNDARY_CODECS, DILOCO_CODECS
from hetjax.core.hf_config import ROPE_TYPES
from hetjax.planner import zero_factors as zr
from hetjax.planner.cost import COMPUTE_MODELS


DTYPES = ("float32", "bfloat16", "float16")
DATA_SOURCES = ("stdlib", "files", "synthetic")
WANDB_MODES = ("online", "offline", "disabled")
ADD_BOS = ("auto", "true", "false")


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
        kw = dict(field=field, value=value, default=spec(field).default)
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


def positive_int(fix: str = "set --config.{field}={default}", hi: int | None = None) -> Bound:
    return Bound(lo=1, hi=hi, integer=True, fix=fix)


def _model_size(name: str) -> Bound:
    """A model shape field: an integer from 1 to hetjax's limit (`MODEL_LIMITS`)."""
    return positive_int(hi=MODEL_LIMITS[name])


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
        from hetjax.core.hf_config import preset_fields

        preset_fields(v)  # an unknown name is one error listing the presets
    return None


def _int_tuple(field, v, lo: int, example: str, distinct: bool = False):
    """A list of whole numbers >= `lo` (and no repeats when `distinct`)."""
    v = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= lo for x in v):
        return (f"must be whole numbers >= {lo}, got {list(v)}",
                f"give e.g. --config.{field}={example.split(' ')[0]}, or leave it empty")
    if distinct and len(set(v)) != len(v):
        return f"names a rank twice: {list(v)}", f"give each rank once, e.g. {example}"
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
        # access() says yes to root everywhere, and to pseudo file systems (/proc, /sys) that
        # refuse new entries: create one to be sure (and remove it)
        import tempfile

        try:
            os.rmdir(tempfile.mkdtemp(prefix=".hetjax-probe-", dir=parent))
        except OSError as e:
            return (f"{path} cannot be created ({parent}: {e.strerror})",
                    f"choose a --config.{field} under a directory you can write")
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
            f"{', '.join(spmd_schedules())}; strands: two strands per tick) | auto: the "
            "planner chooses")


def _model_presets() -> str:
    from hetjax.core.hf_config import PRESETS

    return (f"a published architecture (hetjax.core.hf_config.PRESETS: "
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
    Field("topology.file", "", "a JSON topology file (docs/topology.md; 'hetjax topology --json "
          "FILE' writes one); overrides preset",
          path=True),
    Field("topology.nodes", 0, "> 0 overrides the preset's nodes per cluster", _TOPOLOGY_COUNT),
    Field("topology.devices_per_node", 0, "> 0 overrides the preset's devices per node",
          _TOPOLOGY_COUNT),
    Field("topology.peak_tflops", 0.0, "> 0 states the devices' peak dense bf16 TFLOP/s (preset "
          "local; required for a device kind the catalogue lacks)", _TOPOLOGY_FIGURE),
    Field("topology.memory_gib", 0.0, "> 0 states the devices' memory in GiB (preset local; "
          "default: what the runtime reports, else the catalogue)", _TOPOLOGY_FIGURE),

    Field("model.vocab_size", 0, "0: the tokenizer's vocabulary rounded up to a multiple of 128",
          Bound(lo=0, hi=MODEL_LIMITS["vocab_size"], integer=True,
                fix="set 0 to size it from the tokenizer")),
    Field("model.d_model", 128, "width of the residual stream", _model_size("d_model")),
    Field("model.n_layers", 4, "decoder blocks", _model_size("n_layers")),
    Field("model.n_heads", 4, "attention (query) heads", _model_size("n_heads")),
    Field("model.n_kv_heads", 2, "key/value heads: grouped-query attention; = n_heads for plain "
          "multi-head", _model_size("n_kv_heads")),
    Field("model.d_ff", 384, "hidden width of the SwiGLU feed-forward", _model_size("d_ff")),
    Field("model.max_seq_len", 512, "longest sequence the model takes (HF "
          "max_position_embeddings)", _model_size("max_seq_len")),
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
          lambda f, v: Bound(lo=0, hi=MODEL_LIMITS["head_dim"], fix="set 0 for d_model / "
                             "n_heads, or the checkpoint's head_dim")(f, v)
          or _even_or_zero(f, v)),
    Field("model.rope_type", "default", "RoPE frequency scaling as transformers",
          Choices(ROPE_TYPES, "type")),
    Field("model.rope_factor", 1.0, "RoPE scaling factor (linear, llama3)"),
    Field("model.rope_low_freq_factor", 1.0, "llama3 RoPE scaling: low_freq_factor"),
    Field("model.rope_high_freq_factor", 4.0, "llama3 RoPE scaling: high_freq_factor"),
    Field("model.rope_original_max_len", 8192, "llama3 RoPE scaling: "
          "original_max_position_embeddings"),
    Field("model.qkv_bias", False, "biases on the query/key/value projections (Qwen2)"),
    Field("model.sliding_window", 0, "a query attends to at most this many latest positions, "
          "itself included (HF sliding_window: Mistral, Qwen2/3 use_sliding_window); 0: full "
          "causal attention", count_or_off(example=4096)),
    Field("model.full_attention_layers", (), "layers that attend fully although "
          "model.sliding_window is set (HF layer_types 'full_attention'); empty: every layer "
          "uses the window"),
    Field("model.qk_norm", "none", "RMSNorm of queries and keys before RoPE: {choices}",
          Choices(QK_NORMS, "QK-norm", {"head": "each head (Qwen3)",
                                        "all_heads": "the whole projection (OLMoE)"})),
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

    Field("parallel.pp", 1, "pipeline stages; pp * dp * tp = topology devices (less "
          "parallel.exclude); 0: the planner chooses", _DEGREE),
    Field("parallel.dp", 0, "data-parallel replicas; 0: all remaining devices", _DEGREE),
    Field("parallel.tp", 1, "tensor-parallel shards (inside a node); 0: the planner chooses",
          _DEGREE),
    Field("parallel.ep", 1, "expert parallelism (MoE models): the experts split over groups of "
          "ep data-parallel devices; divides dp and model.n_experts; 0: the planner chooses",
          count_or_off("set --config.{field}=1 (no expert parallelism) or 0 (the planner "
                       "chooses)", 2)),
    Field("parallel.allow_straddle", False, "allow a TP group across nodes / a stage across "
          "clusters"),
    Field("parallel.stage_dp", (), "data-parallel replicas of each stage, e.g. [2,1] (each "
          "stage its own sub-mesh: pipeline.executor=mpmd); empty: parallel.dp for every stage",
          lambda f, v: _int_tuple(f, v, 1, "[2,1] (one number >= 1 per stage)")),
    Field("parallel.stage_tp", (), "tensor-parallel shards of each stage, e.g. [2,1] (each "
          "stage its own sub-mesh: pipeline.executor=mpmd); empty: parallel.tp for every stage",
          lambda f, v: _int_tuple(f, v, 1, "[2,1] (one number >= 1 per stage)")),
    Field("parallel.exclude", (), "topology ranks the layout leaves out (idle), e.g. "
          "[12,13,14,15]; the stages take the others in rank order",
          lambda f, v: _int_tuple(f, v, 0, "[12,13,14,15] (distinct ranks >= 0)", True)),

    Field("pipeline.stage_layers", (), "layers per stage, e.g. (3, 1); empty: even split"),
    Field("pipeline.schedule", "1f1b", _schedule_help, _layout_name("schedule")),
    Field("pipeline.executor", "spmd", executor_help, _layout_name("executor")),
    Field("pipeline.placement", "looped", "looped: one model chunk per stage in order | folded: "
          "two chunks per device in a V (down, then back up; device 0 holds embedding and "
          "head), each device's stage_layers split ceil/floor down/up | auto: the planner "
          "prices both", _layout_name("placement")),
    Field("pipeline.microbatches", 0, "fixes M, the micro-batches per step, for pipeline users: "
          "the number train.microbatches also sets (give one of the two); 0: unset"),
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

    Field("planner.memory_margin", 0.1, "share of device memory a plan leaves free (what "
          "the model does not count; the runtime's reserve is counted)", Bound(lo=0, hi=1, hi_open=True,
                                   fix="use 0.1 (plans use at most 90% of device memory)")),
    Field("planner.calibration", "", "a `hetjax calibrate` JSON file: measured compute and links",
          _is_file_or_empty("write one with 'hetjax calibrate --out=calibration.json', or "
                            "leave it empty"), path=True),
    Field("planner.profile", "", "a compute profile JSON file: measured seconds and bytes of "
          "the model's layer, embedding and head per accelerator kind, TP degree and "
          "micro-batch tokens (docs/planner.md; 'hetjax calibrate' writes one)",
          _is_file_or_empty("write one with 'hetjax calibrate --profile=profile.json' or by "
                            "hand, or leave it empty"), path=True),
    Field("planner.compute", "flat", "{choices}: compute priced at one efficiency per FLOP "
          "(flat), or by operation kind (kinds: matmuls by size, attention per implementation, "
          "memory-bound work by bandwidth; a calibration file's measured rates when it has "
          "them)",
          Choices(COMPUTE_MODELS, "compute model", fix="use 'flat' (one efficiency per FLOP) "
                  "or 'kinds' (priced by operation kind)")),

    Field("train.steps", 300, "optimizer steps of the run", positive_int()),
    Field("train.batch_size", 32, "global batch, in sequences", positive_int()),
    Field("train.seq_len", 128, "tokens per sequence", positive_int()),
    Field("train.microbatches", 1, "the batch is split into this many micro-batches per step; "
          "0: the planner chooses", Bound(lo=0, integer=True, fix="set --config.{field}=1, or 0 "
                                          "to let the planner choose")),
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


def spec(name: str) -> Field:
    """The `Field` named `name` (a dotted name of FIELDS)."""
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
# Directories only a run that writes needs writable: reading a checkpoint (`hetjax eval`,
# `hetjax sample`) works on a read-only copy.
WRITTEN_FIELDS = ("workdir", "checkpoint.dir")


def field_problems(c, reading: bool = False) -> list[tuple[str, str, str]]:
    """(field, problem, fix) for every field whose own check refuses its value (`reading`:
    except the writability of WRITTEN_FIELDS)."""
    out = []
    for f in FIELDS:
        if f.check is not None and not (reading and f.name in WRITTEN_FIELDS):
            verdict = f.check(f.name, field_value(c, f.name))
            if verdict:
                out.append((f.name, *verdict))
    return out


def field_value(c, dotted: str):
    """The value of the dotted field `dotted` in config `c`."""
    for part in dotted.split("."):
        c = c[part]
    return c


def warmup_steps(t) -> int:
    """train.warmup_steps, with -1 meaning 10% of train.steps."""
    return t.steps // 10 if t.warmup_steps == -1 else t.warmup_steps


# Every field that names a file or directory: `expand_paths` expands `~` and `$VAR` in them.
PATH_FIELDS = tuple(f.name for f in FIELDS if f.path)
