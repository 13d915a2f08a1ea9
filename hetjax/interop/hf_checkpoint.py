"""HuggingFace checkpoints in and out: safetensors weights <-> hetjax's natural parameter tree.

The natural tree (`hetjax.checkpoint`: block leaves stacked [n_layers, ...] in global layer
order) is the one both directions use, so a load works under every plan (the executor's
`checkpoint_layout(...).from_natural` turns it into the plan's own layout) and an export reads
any checkpoint. Each hetjax leaf is the HF tensor reshaped and transposed (`_Leaf`); loading
builds every leaf with `jax.make_array_from_callback` in the natural target's sharding, so a
process reads, for each of its devices' shards, only the rows and columns that shard holds
(repeated shards once). `init_from_hf` counts the bytes it read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

import jax
import numpy as np

from hetjax.errors import HetjaxError
from hetjax.files import copy_file, replace_file
from hetjax.core import hf_config
from hetjax.noise import quiet_absl
from hetjax.interop.safetensors_files import SafetensorsDir, write_file

# Tokenizer files an HF directory may carry; copied into exports as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "special_tokens_map.json", "generation_config.json")


@dataclass(frozen=True)
class _Leaf:
    """hetjax leaf (per layer) = transpose(reshape(HF tensor, split), perm); with `experts` > 0
    the leaf (per layer) is [experts, ...] and expert e is that of the HF tensor named with e
    (checkpoints store each expert's matrices apart)."""

    hf: str           # HF name; '{i}' is the layer index for block leaves, '{e}' the expert's
    split: tuple      # the HF tensor's shape viewed as these dims (symbolic: see _dims)
    perm: tuple       # hetjax dim k is split dim perm[k]
    groups: tuple     # HF dim j covers split dims groups[j] (consecutive)
    experts: int = 0  # > 0: a stacked-experts leaf of this many HF tensors per layer


# Where each mixture-of-experts family keeps its feed-forward: the MoE block's prefix, and the
# names of an expert's gate, up and down projections (transformers' on-disk names).
_MOE_NAMES = {"mixtral": ("block_sparse_moe.", "w1", "w3", "w2")}
_MOE_DEFAULT_NAMES = ("mlp.", "gate_proj", "up_proj", "down_proj")


def _leaves(m, has_head: bool, mtype: str | None = None) -> dict[tuple, _Leaf]:
    """hetjax path (tuple of keys) -> _Leaf, for ModelConfig `m` stored as transformers'
    `mtype` (default: the one hetjax exports it as)."""
    H, K, hd, D, F = m.n_heads, m.n_kv_heads, m.head_dim, m.d_model, m.d_ff
    a, blk = "model.layers.{i}.self_attn.", ("layers", "block")
    out = {
        ("embedder", "embedding"): _Leaf("model.embed_tokens.weight", (m.vocab_size, D), (0, 1),
                                         ((0,), (1,))),
        ("final_norm", "scale"): _Leaf("model.norm.weight", (D,), (0,), ((0,),)),
        blk + ("attn", "query"): _Leaf(a + "q_proj.weight", (H, hd, D), (2, 0, 1),
                                       ((0, 1), (2,))),
        blk + ("attn", "key"): _Leaf(a + "k_proj.weight", (K, hd, D), (2, 0, 1), ((0, 1), (2,))),
        blk + ("attn", "value"): _Leaf(a + "v_proj.weight", (K, hd, D), (2, 0, 1),
                                       ((0, 1), (2,))),
        blk + ("attn", "out"): _Leaf(a + "o_proj.weight", (D, H, hd), (1, 2, 0), ((0,), (1, 2))),
        blk + ("attn_norm", "scale"): _Leaf("model.layers.{i}.input_layernorm.weight", (D,),
                                            (0,), ((0,),)),
        blk + ("mlp_norm", "scale"): _Leaf("model.layers.{i}.post_attention_layernorm.weight",
                                           (D,), (0,), ((0,),)),
    }
    if m.n_experts:
        out.update(_moe_leaves(m, mtype or hf_config.export_type(m)))
    else:
        out.update(_mlp_leaves(blk + ("mlp",), "model.layers.{i}.mlp.", F, D))
    if m.qkv_bias:
        for name, heads in (("query", H), ("key", K), ("value", K)):
            out[blk + ("attn", f"{name}_bias")] = _Leaf(
                a + f"{name[0]}_proj.bias", (heads, hd), (0, 1), ((0, 1),))
    for name, heads in (("query", H), ("key", K)):
        if m.qk_norm == "head":  # Qwen3: one scale per head_dim entry, shared by the heads
            out[blk + ("attn", f"{name}_norm", "scale")] = _Leaf(
                a + f"{name[0]}_norm.weight", (hd,), (0,), ((0,),))
        elif m.qk_norm == "all_heads":  # OLMoE: the projection's whole width
            out[blk + ("attn", f"{name}_norm", "scale")] = _Leaf(
                a + f"{name[0]}_norm.weight", (heads, hd), (0, 1), ((0, 1),))
    if has_head:
        out[("lm_head", "kernel")] = _Leaf("lm_head.weight", (m.vocab_size, D), (1, 0),
                                           ((0,), (1,)))
    return out


# The leaves with a row per token (HF dim 0 is the vocabulary).
VOCAB_LEAVES = (("embedder", "embedding"), ("lm_head", "kernel"))


def _mlp_leaves(path: tuple, prefix: str, F: int, D: int) -> dict[tuple, _Leaf]:
    """A dense SwiGLU (`MLP`) of width F stored as HF's gate_proj / up_proj / down_proj."""
    return {
        path + ("gate", "kernel"): _Leaf(prefix + "gate_proj.weight", (F, D), (1, 0),
                                         ((0,), (1,))),
        path + ("up", "kernel"): _Leaf(prefix + "up_proj.weight", (F, D), (1, 0), ((0,), (1,))),
        path + ("down", "kernel"): _Leaf(prefix + "down_proj.weight", (D, F), (1, 0),
                                         ((0,), (1,))),
    }


def _moe_leaves(m, mtype: str) -> dict[tuple, _Leaf]:
    """The MoE feed-forward (hetjax.layers.moe's tree) as `mtype` stores it: the router
    `gate` [E, d], each expert's projections apart ([f, d], [f, d], [d, f]), Qwen2-MoE's shared
    expert and its gate [1, d]."""
    E, D, F = m.n_experts, m.d_model, m.expert_d_ff
    moe, blk = ("layers", "block", "moe"), "model.layers.{i}."
    prefix, gate, up, down = _MOE_NAMES.get(mtype, _MOE_DEFAULT_NAMES)
    p = blk + prefix
    out = {
        moe + ("router", "kernel"): _Leaf(p + "gate.weight", (E, D), (1, 0), ((0,), (1,))),
        moe + ("experts", "gate"): _Leaf(p + f"experts.{{e}}.{gate}.weight", (F, D), (1, 0),
                                         ((0,), (1,)), E),
        moe + ("experts", "up"): _Leaf(p + f"experts.{{e}}.{up}.weight", (F, D), (1, 0),
                                       ((0,), (1,)), E),
        moe + ("experts", "down"): _Leaf(p + f"experts.{{e}}.{down}.weight", (D, F), (1, 0),
                                         ((0,), (1,)), E),
    }
    if m.shared_expert_d_ff:
        out.update(_mlp_leaves(moe + ("shared",), p + "shared_expert.", m.shared_expert_d_ff, D))
        if m.moe_shared_expert_gate:
            out[moe + ("shared_gate", "kernel")] = _Leaf(p + "shared_expert_gate.weight",
                                                         (1, D), (1, 0), ((0,), (1,)))
    return out


def _path(keypath) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", k)) for k in keypath)


def _read_leaf(st: SafetensorsDir, leaf: _Leaf, layer: int | None, index: tuple) -> np.ndarray:
    """The hetjax per-layer slice `index` of `leaf`, reading only the HF rows/columns it needs
    (of a stacked-experts leaf, only the experts the slice covers)."""
    if leaf.experts:
        experts = range(*index[0].indices(leaf.experts))
        return np.stack([_read_tensor(st, leaf, leaf.hf.format(i=layer, e=e), index[1:])
                         for e in experts])
    return _read_tensor(st, leaf, leaf.hf.format(i=layer), index)


def _read_tensor(st: SafetensorsDir, leaf: _Leaf, name: str, index: tuple) -> np.ndarray:
    """`_read_leaf` of one HF tensor."""
    ranges = [slice(*s.indices(leaf.split[leaf.perm[k]])[:2]) for k, s in enumerate(index)]
    want = [None] * len(leaf.split)  # the range wanted on each split dim
    for k, r in enumerate(ranges):
        want[leaf.perm[k]] = r
    hf_slices, post = [], []
    for group in leaf.groups:
        first, rest = group[0], group[1:]
        inner = math.prod(leaf.split[d] for d in rest)
        if all(want[d] == slice(0, leaf.split[d]) for d in rest):
            hf_slices.append(slice(want[first].start * inner, want[first].stop * inner))
            post += [slice(None)] * len(group)
        else:  # a cut inside the inner dims: read whole inner rows, cut after
            hf_slices.append(slice(want[first].start * inner, want[first].stop * inner))
            post += [slice(None)] + [want[d] for d in rest]
    expected = tuple(math.prod(leaf.split[d] for d in g) for g in leaf.groups)
    if st.shape(name) != expected:
        raise HetjaxError(f"{st.directory}: tensor {name} has shape {list(st.shape(name))}, "
                          f"but config.json describes {list(expected)}; fix: give the "
                          "config.json written with these weights")
    a = st.read(name, tuple(hf_slices))
    dims = [want[g[0]].stop - want[g[0]].start if j == 0 else leaf.split[d]
            for g in leaf.groups for j, d in enumerate(g)]
    a = a.reshape(dims)[tuple(post)]
    return a.transpose(leaf.perm)


def load_params(directory: str, m, target, stages=None) -> tuple[dict, SafetensorsDir]:
    """The parameter tree for ModelConfig `m` from the HF directory, each leaf placed as
    `target`'s (a tree of ShapeDtypeStructs with shardings); also the reader (bytes_read).

    `target` is the natural tree, or with `stages` = (layer_ids, shared_on_first) the SPMD
    pipeline's stage-stacked one: block leaves [pp, slots, ...] where layer_ids[s, j] is the
    global layer + 1 in stage s's slot j (0: a padded slot, zeros), and, when shared_on_first,
    embedding / final norm / head leaves [pp, ...] real on stage 0 and zero elsewhere."""
    st = SafetensorsDir(directory)
    has_head = "lm_head" in target
    if has_head and "lm_head.weight" not in st.entries:
        raise HetjaxError(f"{directory} has no lm_head.weight, but hetjax's model has an untied "
                          "head; fix: set tie_word_embeddings in its config.json as it was saved")
    mtype = None
    if os.path.isfile(os.path.join(directory, "config.json")):  # the names it was saved under
        mtype = hf_config.read_config_json(directory).get("model_type")
    spec = _leaves(m, has_head, mtype if mtype in hf_config.MODEL_TYPES else None)
    paths = {_path(p): p for p, _ in jax.tree_util.tree_leaves_with_path(target)}
    missing = sorted(set(paths) - set(spec))
    if missing:
        raise HetjaxError(f"hetjax parameters {['/'.join(p) for p in missing]} have no HF "
                          "counterpart in hetjax.interop.hf_checkpoint")
    used = {leaf.hf.format(i=i, e=e) for leaf in spec.values()
            for i in (range(m.n_layers) if "{i}" in leaf.hf else [None])
            for e in range(max(1, leaf.experts))}
    st.unused = sorted(set(st.entries) - used)  # named by the caller, never dropped silently

    def build(keypath, t):
        leaf, cache = spec[_path(keypath)], {}
        block = _path(keypath)[:2] == ("layers", "block")

        def staged(index):
            """A shard of a stage-stacked leaf: only the real layers (stages) it covers."""
            if block:
                ids = stages[0][index[0], index[1]]
                out = np.zeros(ids.shape + _shape(t.shape[2:], index[2:]), t.dtype)
                for pos in zip(*np.nonzero(ids)):
                    out[pos] = _read_leaf(st, leaf, int(ids[pos]) - 1, index[2:])
                return out
            out = np.zeros(_shape(t.shape, index), t.dtype)
            if 0 in range(*index[0].indices(t.shape[0])):
                out[0] = _padded(_read_leaf(st, leaf, None, index[1:]), out.shape[1:])
            return out

        def shard(index):
            key = tuple((s.start, s.stop, s.step) for s in index)
            if key not in cache:  # replicas of one shard on this process are read once
                if stages is not None and (block or stages[1]):
                    cache[key] = staged(index)
                elif block:
                    layers = range(*index[0].indices(t.shape[0]))
                    cache[key] = np.stack([_read_leaf(st, leaf, i, index[1:]) for i in layers])
                else:  # the vocabulary's padding rows (ModelConfig.vocab_rows) read as zeros
                    cache[key] = _padded(_read_leaf(st, leaf, None, index),
                                         _shape(t.shape, index))
            return cache[key].astype(t.dtype)

        return jax.make_array_from_callback(t.shape, t.sharding, shard)

    return jax.tree_util.tree_map_with_path(build, target), st


def unused_message(st: SafetensorsDir) -> str | None:
    """One line naming the tensors of `st` that the model did not load (None if none)."""
    if not st.unused:
        return None
    shown = ", ".join(st.unused[:10]) + (f" and {len(st.unused) - 10} more"
                                          if len(st.unused) > 10 else "")
    return (f"hetjax: warning: model.init_from: {len(st.unused)} tensor(s) of {st.directory} "
            f"are not part of this model and were not loaded: {shown}")


def _padded(a: np.ndarray, shape) -> np.ndarray:
    """`a` with zeros after its end up to `shape` (a shard reaching into padding rows)."""
    if a.shape == tuple(shape):
        return a
    return np.pad(a, [(0, n - m) for m, n in zip(a.shape, shape)])


def _shape(shape, index) -> tuple:
    return tuple(len(range(*s.indices(n))) for n, s in zip(shape, index))


def init_from_hf(executor, state, directory: str, m):
    """`state` (fresh, the executor's layout) with its parameters replaced by the HF
    checkpoint's; optimizer moments and step stay as initialised. Returns (state, reader).

    The SPMD pipeline's stage-stacked parameters are read in place, so a process reads only
    its own stages' layers; other executors' parameters through the natural layout."""
    from hetjax.parallel.pipeline import StageLayout, _stacks_shared, stack_layers

    layout = executor.checkpoint_layout(state)
    if isinstance(layout, StageLayout):
        plan = layout.plan
        # Stage s's slot j holds global layer ids[s, j] - 1 (0: padding), as to_stages lays out.
        ids = stack_layers(np.arange(1, m.n_layers + 1), plan)
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                             sharding=x.sharding), state.params)
        params, st = load_params(directory, m, target, (ids, _stacks_shared(plan)))
        return dataclasses.replace(state, params=params), st
    natural = layout.to_natural(state)
    target = layout.natural_target().params
    params, st = load_params(directory, m, target)
    return layout.from_natural(dataclasses.replace(natural, params=params)), st


# --- export --------------------------------------------------------------------------------------
def hf_tensors(params, m) -> dict[str, np.ndarray]:
    """HF name -> array for a natural parameter tree (host arrays) of ModelConfig `m`."""
    flat = {_path(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    out = {}
    for path, leaf in _leaves(m, ("lm_head", "kernel") in flat).items():
        a = flat[path]
        if path in VOCAB_LEAVES:  # leave out the padding rows (ModelConfig.vocab_rows)
            a = np.take(a, np.arange(m.vocab_size), axis=leaf.perm.index(0))
        inverse = np.argsort(leaf.perm)
        shape = tuple(math.prod(leaf.split[d] for d in g) for g in leaf.groups)
        for i, x in enumerate(a if path[:2] == ("layers", "block") else [a]):
            for e, y in enumerate(x if leaf.experts else [x]):
                out[leaf.hf.format(i=i, e=e)] = np.ascontiguousarray(
                    y.transpose(inverse).reshape(shape))
    return out


def write_hf(out: str, params, m, *, tokenizer_files: dict | None = None,
             max_shard_bytes: int = 2 << 30) -> list:
    """Write an HF directory (config.json, model.safetensors or shards + index, and the
    `tokenizer_files` {name in the export: source path}) for a natural parameter tree; returns
    the files written."""
    os.makedirs(out, exist_ok=True)
    tensors = hf_tensors(params, m)
    dtypes = {str(a.dtype) for a in tensors.values()}
    torch_dtype = "bfloat16" if dtypes == {"bfloat16"} else "float32"
    shards, size = [[]], 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensors[name].nbytes
    written = []
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        write_file(os.path.join(out, file), {n: tensors[n] for n in shard})
        weight_map.update({n: file for n in shard})
        written.append(file)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                 "weight_map": weight_map}
        replace_file(os.path.join(out, "model.safetensors.index.json"),
                     lambda f: json.dump(index, f, indent=2), "w")
        written.append("model.safetensors.index.json")
    replace_file(os.path.join(out, "config.json"),
                 lambda f: json.dump(hf_config.hf_config(m, torch_dtype=torch_dtype), f,
                                     indent=2), "w")
    written.append("config.json")
    for name, src in (tokenizer_files or {}).items():
        copy_file(src, os.path.join(out, name))
        written.append(name)
    return written


def checkpoint_step_dir(path: str) -> str:
    """The step directory a `--checkpoint` names: a step directory itself, or the newest step
    of a workdir or of its checkpoints/ directory."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(os.path.join(path, "state")):
        return path
    root = os.path.join(path, "checkpoints") if os.path.isdir(
        os.path.join(path, "checkpoints")) else path
    steps = sorted(int(d) for d in (os.listdir(root) if os.path.isdir(root) else [])
                   if d.isdigit() and os.path.isdir(os.path.join(root, d, "state")))
    if not steps:
        raise HetjaxError(f"--checkpoint={path}: no checkpoint there; fix: give a run's workdir, "
                          "its checkpoints/ directory or one step directory in it")
    return os.path.join(root, str(steps[-1]))


def export_checkpoint(checkpoint: str, out: str, model_defaults: dict, *,
                      max_shard_bytes: int = 2 << 30) -> list:
    """Export a hetjax checkpoint (any plan: checkpoints hold the natural layout) as an HF
    directory `transformers` loads; returns the files written. `model_defaults`: every
    `model.*` field at its default (the caller's `base_config().model`), for the fields a
    checkpoint saved before they existed does not name."""
    import ml_collections
    import orbax.checkpoint as ocp

    from hetjax.layers import ModelConfig

    step_dir = checkpoint_step_dir(checkpoint)
    with open(os.path.join(step_dir, "meta", "metadata")) as f:
        meta = json.load(f)
    model = dict(model_defaults)
    model.update({k: v for k, v in meta["config"]["model"].items() if k in model})
    # Every array onto this process's first device: the export writes from one host.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    ckptr = ocp.StandardCheckpointer()
    with quiet_absl():  # orbax: "Metadata file does not exist" (the step's, one level up)
        tree = ckptr.metadata(os.path.join(step_dir, "state"))
    # orbax >= 0.11 wraps the tree in StepMetadata.item_metadata(.tree); older returns it bare.
    tree = getattr(tree, "item_metadata", tree)
    tree = getattr(tree, "tree", tree)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          tree)
    with quiet_absl():
        params = ckptr.restore(os.path.join(step_dir, "state"), target)["params"]
    rows = params["embedder"]["embedding"].shape[0]
    m = dataclasses.replace(ModelConfig.from_config(ml_collections.ConfigDict(model), rows),
                            vocab_rows=rows)
    tokenizer_files = {}
    if model.get("init_from"):
        for name in TOKENIZER_FILES:
            src = os.path.join(model["init_from"], name)
            if os.path.isfile(src):
                tokenizer_files[name] = src
    tok = meta["config"].get("data", {}).get("tokenizer", "byte")
    if tok.endswith(".model") and os.path.isfile(tok):  # SentencePiece, as HF names it
        tokenizer_files["tokenizer.model"] = tok
    elif os.path.basename(tok) == "tokenizer.json" and os.path.isfile(tok):
        tokenizer_files["tokenizer.json"] = tok
    return write_hf(out, params, m, tokenizer_files=tokenizer_files,
                    max_shard_bytes=max_shard_bytes)
