"""One device, one table: hetjax's Trainer step beside a hand-written `jax.jit` step on the same
Flax model (XLA attention, and the fused kernel `model.attention=auto` takes), and, where torch
and transformers import, HuggingFace's `LlamaForCausalLM` of the same shape (eager and
`torch.compile`, bf16 autocast, fused AdamW); with the device name, tokens/s, MFU, peak memory
and `hetjax plan`'s predicted step time and memory for the same job. The `trainer-moe` row
trains the Mixture-of-Experts model of the same active parameters (each SwiGLU replaced by 8
experts of width d_ff / 2, top-2, dropless dispatch: grouped matmuls), so its MFU counts the
same FLOPs per token; it holds 4x the feed-forward parameters.

    python scripts/bench/gpu.py --out runs/bench_gpu.json          # TinyLlama-1.1B, 8 x 2048
    python scripts/bench/gpu.py --smoke                            # a tiny shape, seconds
    python scripts/bench/gpu.py --rows jit-fused,hf-compile --steps 5

Default shape: TinyLlama-1.1B (d_model 2048, 22 layers, 32 heads, 4 kv heads, d_ff 5632, vocab
32000, untied head), batch 8 x 2048 tokens, bf16 compute, fp32 parameters, AdamW with global-norm
clipping at 1.0, no recompute. On CPU (or with --smoke) a tiny shape runs instead.

MFU = (6 x matmul parameters + 6 x layers x length x d_model, the causal attention's QK^T and AV
forward and backward) FLOPs per token x tokens/s / the device's dense bf16 peak. On a GPU every
row runs in its own process, so its peak memory (`memory_stats()['peak_bytes_in_use']`,
`torch.cuda.max_memory_allocated`) is its own and an out-of-memory row does not end the others;
on CPU the rows run in this process and report XLA's program bytes (`memory_analysis()`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

if __package__:  # python -m scripts.bench.gpu, or imported by the suite
    from .experiments import harness
else:  # python scripts/bench/gpu.py: Python puts scripts/bench/ first on sys.path
    from experiments import harness

ROWS = ("trainer", "trainer-moe", "jit-xla", "jit-fused", "hf-eager", "hf-compile")
LABELS = {"trainer": "hetjax Trainer",
          "trainer-moe": "hetjax Trainer, MoE: 8 experts of d_ff / 2, top-2 (same active)",
          "jit-xla": "jax.jit step, XLA attention",
          "jit-fused": "jax.jit step, fused attention",
          "hf-eager": "HF LlamaForCausalLM, torch eager (SDPA)",
          "hf-compile": "HF LlamaForCausalLM, torch.compile"}
@dataclasses.dataclass(frozen=True)
class Shape:
    d_model: int = 2048
    n_layers: int = 22
    n_heads: int = 32
    n_kv_heads: int = 4
    d_ff: int = 5632
    vocab: int = 32000
    batch: int = 8
    seq: int = 2048

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in matmuls: the blocks' projections and the untied head."""
        h = self.d_model // self.n_heads
        attn = self.d_model * h * (2 * self.n_heads + 2 * self.n_kv_heads)
        return self.n_layers * (attn + 3 * self.d_model * self.d_ff) + self.vocab * self.d_model

    @property
    def flops_per_token(self) -> float:
        # causal attention: QK^T and AV over half the square, forward + backward (x3)
        return 6 * self.matmul_params + 6 * self.n_layers * self.seq * self.d_model


SMOKE = Shape(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab=512, batch=2,
              seq=64)


def hetjax_config(shape: Shape, steps: int, workdir: str, attention: str = "auto",
                  loss_chunk_tokens: int = 0, moe: bool = False):
    """The hetjax config of the benchmarked job (one device, synthetic data); `moe`: its
    Mixture-of-Experts twin of equal active parameters (8 experts of d_ff / 2, top-2)."""
    from hetjax.config import base_config

    c = base_config()
    m = c.model
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads = (shape.d_model, shape.n_layers,
                                                      shape.n_heads, shape.n_kv_heads)
    m.d_ff, m.vocab_size, m.max_seq_len = shape.d_ff, shape.vocab, shape.seq
    m.tie_embeddings, m.dtype, m.param_dtype, m.remat = False, "bfloat16", "float32", "none"
    m.attention, m.loss_chunk_tokens = attention, loss_chunk_tokens
    if moe:
        m.n_experts, m.experts_per_token, m.moe_d_ff = 8, 2, shape.d_ff // 2
        m.moe_dispatch = "dropless"
    c.topology.preset, c.topology.nodes, c.topology.devices_per_node = "cpu_single", 1, 1
    c.parallel.pp, c.parallel.dp, c.parallel.tp = 1, 1, 1
    t = c.train
    t.batch_size, t.seq_len, t.steps, t.microbatches = shape.batch, shape.seq, steps, 1
    t.grad_clip, t.progress, t.log_every, t.warmup_steps = 1.0, False, steps, 1
    c.data.source = "synthetic"
    c.eval.every = c.checkpoint.every = 0
    c.tensorboard = False
    c.workdir = workdir
    return c


def device_topology(peak_tflops: float = 0.0):
    """One device of the kind the bench runs on, as hetjax's `local` preset builds it: the
    catalogue's peak and the runtime's memory (`peak_tflops` > 0 states the peak of a kind the
    catalogue lacks)."""
    import jax

    from hetjax.core.local_preset import describe_jax_devices, topology_from_devices

    devices = describe_jax_devices(jax.devices()[:1])
    memory_gib = devices[0].memory_bytes / 2**30 if peak_tflops else 0.0
    return topology_from_devices(devices, peak_tflops, memory_gib or (2.0 if peak_tflops else 0))


# --- the JAX rows --------------------------------------------------------------------------------
def _jax_device():
    import jax

    d = jax.devices()[0]
    stats = d.memory_stats() or {}
    return d, stats


def _peak_bytes() -> int | None:
    _, stats = _jax_device()
    return stats.get("peak_bytes_in_use")


def _program_bytes(compiled) -> int | None:
    """XLA's own account of the step program: arguments + outputs + temporaries - aliased."""
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - a backend without the analysis: leave it blank
        return None


def run_trainer(shape: Shape, warmup: int, steps: int, peak: float,
                loss_chunk_tokens: int = 0, moe: bool = False) -> dict:
    """hetjax's Trainer over warmup + steps steps; tokens/s of the timed steps."""
    import jax

    from hetjax.train import Trainer

    with tempfile.TemporaryDirectory() as workdir:
        cfg = hetjax_config(shape, warmup + steps, workdir,
                            loss_chunk_tokens=loss_chunk_tokens, moe=moe)
        topo = device_topology(peak)
        trainer = Trainer(cfg, topology=topo, quiet=True)
        for _ in range(warmup):
            jax.block_until_ready(trainer.step()["loss"])
        t = time.perf_counter()
        for _ in range(steps):
            metrics = trainer.step()
        loss = float(metrics["loss"])  # waits for the last step
        dt = (time.perf_counter() - t) / steps
        program = _program_bytes(trainer.compiled_step())
        return {"step_s": dt, "loss": loss, "attention": str(trainer.attention),
                "program_bytes": program, "peak_bytes": _peak_bytes()}


def run_jit(shape: Shape, warmup: int, steps: int, attention: str) -> dict:
    """A hand-written jitted AdamW step on hetjax's Flax model with `attention`."""
    import jax
    import jax.numpy as jnp
    import optax

    from hetjax.layers import ModelConfig, Transformer, cross_entropy
    from hetjax.layers.attention_kernels import choose_local

    cfg = ModelConfig(vocab_size=shape.vocab, d_model=shape.d_model, n_layers=shape.n_layers,
                      n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, d_ff=shape.d_ff,
                      max_seq_len=shape.seq, tie_embeddings=False, dtype="bfloat16",
                      param_dtype="float32", remat="none", attention=attention)
    choice = choose_local(attention, cfg.dtype, cfg.head_dim, shape.seq)
    if attention == "auto" and choice.name == "xla":
        return {"skipped": f"no fused kernel here: {choice}"}
    model = Transformer(cfg)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1))
    rows = jax.random.randint(jax.random.key(1), (shape.batch, shape.seq + 1), 0, shape.vocab)
    tokens, targets = rows[:, :-1], rows[:, 1:]

    @jax.jit
    def init(key):
        params = model.init(key, tokens[:1])["params"]
        return params, tx.init(params)

    def step(params, opt_state, tokens, targets):
        def loss_fn(p):
            return cross_entropy(model.apply({"params": p}, tokens), targets)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state = init(jax.random.key(0))
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, tokens,
                                                          targets).compile()
    for _ in range(warmup):
        params, opt_state, loss = compiled(params, opt_state, tokens, targets)
    jax.block_until_ready(loss)
    t = time.perf_counter()
    for _ in range(steps):
        params, opt_state, loss = compiled(params, opt_state, tokens, targets)
    loss = float(loss)
    dt = (time.perf_counter() - t) / steps
    return {"step_s": dt, "loss": loss, "attention": str(choice),
            "program_bytes": _program_bytes(compiled), "peak_bytes": _peak_bytes(),
            "dtype": str(jnp.dtype(cfg.dtype))}


# --- the torch rows ------------------------------------------------------------------------------
def run_hf(shape: Shape, warmup: int, steps: int, compile_: bool) -> dict:
    """HF LlamaForCausalLM of the same shape: fp32 weights, bf16 autocast, fused AdamW,
    global-norm clipping at 1.0."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    hf = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.d_model,
                     intermediate_size=shape.d_ff, num_hidden_layers=shape.n_layers,
                     num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_kv_heads,
                     max_position_embeddings=shape.seq, rms_norm_eps=1e-5, rope_theta=10000.0,
                     tie_word_embeddings=False)
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=cuda)
    fwd = torch.compile(model) if compile_ else model
    rows = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), device=device)
    tokens, targets = rows[:, :-1], rows[:, 1:]
    dtype = torch.bfloat16

    def step():
        with torch.autocast(device, dtype=dtype):
            logits = fwd(input_ids=tokens).logits
        loss = F.cross_entropy(logits.float().reshape(-1, shape.vocab), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss = float(loss.detach())  # waits for the last step
    sync()
    dt = (time.perf_counter() - t) / steps
    return {"step_s": dt, "loss": loss, "attention": "torch SDPA",
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu"}


def run_row(row: str, shape: Shape, warmup: int, steps: int, peak: float,
            loss_chunk_tokens: int = 0) -> dict:
    """One row's measurement; an error (out of memory, a missing package) is the row's note."""
    try:
        if row in ("trainer", "trainer-moe"):
            out = run_trainer(shape, warmup, steps, peak, loss_chunk_tokens,
                              moe=row == "trainer-moe")
        elif row == "jit-xla":
            out = run_jit(shape, warmup, steps, "xla")
        elif row == "jit-fused":
            out = run_jit(shape, warmup, steps, "auto")
        else:
            out = run_hf(shape, warmup, steps, row == "hf-compile")
    except ImportError as e:
        return {"skipped": f"{type(e).__name__}: {e}"}
    except Exception as e:  # noqa: BLE001 - out of memory and friends end only this row
        text = str(e).strip().splitlines()
        oom = "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()
        return {"error": ("out of memory: " if oom else "") + (text[0] if text else repr(e))[:300]}
    finally:
        gc.collect()
    return out


# --- orchestration -------------------------------------------------------------------------------
def _device() -> tuple[str, str, float]:
    """(device kind, platform, memory GiB) of the first JAX device."""
    dev, stats = _jax_device()
    return dev.device_kind, dev.platform, stats.get("bytes_limit", 0) / 2**30


def _row_in_subprocess(row: str, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--one-row", row, "--row-out", path,
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch), "--seq", str(args.seq),
           "--loss-chunk-tokens", str(args.loss_chunk_tokens)]
    if args.smoke:
        cmd.append("--smoke")
    started = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # JAX's default takes 75%
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.row_timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in --row-timeout {args.row_timeout} s"}
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, json.JSONDecodeError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        out = {"error": f"exit {proc.returncode}: " + " | ".join(tail)[:300]}
    finally:
        if os.path.exists(path):
            os.remove(path)
    out["wall_s"] = time.perf_counter() - started
    return out


def prediction(shape: Shape, peak: float, loss_chunk_tokens: int = 0,
               calibration: str = "") -> dict:
    """`hetjax plan`'s prediction for the Trainer row's job on one such device (with a
    `hetjax calibrate` file of this device when given)."""
    try:
        from hetjax.planner import plan_from_config
        from hetjax.planner.config_plan import predict_for_config

        cfg = hetjax_config(shape, 1, "runs/bench_gpu", loss_chunk_tokens=loss_chunk_tokens)
        cfg.planner.calibration = calibration
        topo = device_topology(peak)
        plan = plan_from_config(cfg, topo)
        pred = predict_for_config(cfg, plan, topo).as_dict()
    except Exception as e:  # noqa: BLE001 - the table still prints without it
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    mem = pred.get("stage_memory_gib") or pred.get("memory_gib")
    if isinstance(mem, (list, tuple)):
        mem = max(mem)
    return {"step_s": pred.get("step_time_s"), "memory_gib": mem, "fits": pred.get("fits"),
            "raw": pred}


def table(result: dict) -> str:
    tokens = result["shape"]["batch"] * result["shape"]["seq"]
    lines = [f"device: {result['device']} ({result['platform']}), peak "
             f"{result['peak_tflops']:g} TFLOP/s bf16; {result['shape_text']}",
             "| what ran | attention | tokens/s | MFU | step | peak memory | XLA program |",
             "|---|---|---|---|---|---|---|"]

    def gib(b):
        if not b:
            return "-"
        return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"

    for row in result["rows"]:
        r = row["result"]
        if "step_s" not in r:
            note = r.get("error") or r.get("skipped", "")
            lines.append(f"| {LABELS[row['row']]} | - | {note} | | | | |")
            continue
        tps = tokens / r["step_s"]
        mfu = result["flops_per_token"] * tps / (result["peak_tflops"] * 1e12)
        lines.append(f"| {LABELS[row['row']]} | {r.get('attention', '-')} | {tps:,.0f} | "
                     f"{mfu:.1%} | {r['step_s'] * 1e3:.1f} ms | {gib(r.get('peak_bytes'))} | "
                     f"{gib(r.get('program_bytes'))} |")
    p = result["prediction"]
    if "error" in p:
        lines.append(f"hetjax plan prediction: {p['error']}")
    else:
        step = f"{p['step_s'] * 1e3:.1f} ms" if p.get("step_s") else "-"
        mem = f"{p['memory_gib']:.1f} GiB" if p.get("memory_gib") else "-"
        fits = " (does not fit, by its count)" if p.get("fits") is False else ""
        lines.append(f"hetjax plan predicts for the Trainer row: step {step}, memory {mem} "
                     f"per device{fits}")
    return "\n".join(lines)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shape (automatic on CPU)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per row (compile)")
    ap.add_argument("--batch", type=int, default=0, help="sequences per step (0: the shape's)")
    ap.add_argument("--seq", type=int, default=0, help="tokens per sequence (0: the shape's)")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="the device's dense bf16 peak, when its kind is not in hetjax's "
                         "hardware catalogue")
    ap.add_argument("--calibration", default="",
                    help="a `hetjax calibrate` file of this device for the planner's prediction")
    ap.add_argument("--loss-chunk-tokens", type=int, default=0,
                    help="the Trainer row's model.loss_chunk_tokens (0: the plain loss)")
    ap.add_argument("--row-timeout", type=int, default=240, help="seconds per row (GPU)")
    ap.add_argument("--one-row", default="", help=argparse.SUPPRESS)
    ap.add_argument("--row-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.one_row:  # a row's own process writes what its parent names
        harness.check_outputs("bench_gpu", results={"out": args.out})
    return args


def main(argv=None) -> dict:
    args = parse(sys.argv[1:] if argv is None else argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"bench_gpu: unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if not args.one_row:  # the rows' processes need the device's memory, not this one
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    kind, platform, memory_gib = _device()
    smoke = args.smoke or platform == "cpu"
    shape = SMOKE if smoke else Shape()
    shape = dataclasses.replace(shape, batch=args.batch or shape.batch, seq=args.seq or shape.seq)
    args.smoke = smoke
    peak = args.peak_tflops or device_topology().clusters[0].accelerator.peak_tflops
    if args.one_row:  # a child process: one row, its JSON to --row-out
        out = run_row(args.one_row, shape, args.warmup, args.steps, peak,
                      args.loss_chunk_tokens)
        with open(args.row_out, "w") as f:
            json.dump(out, f)
        return out
    results = []
    for row in rows:
        # On an accelerator each row gets its own process: its own peak memory, and JAX's
        # preallocation does not starve torch. On CPU the rows share this process.
        r = (run_row(row, shape, args.warmup, args.steps, peak, args.loss_chunk_tokens)
             if platform == "cpu"
             else _row_in_subprocess(row, args))
        results.append({"row": row, "label": LABELS[row], "result": r})
        print(f"  {LABELS[row]}: {r.get('step_s', r.get('error', r.get('skipped')))}",
              flush=True)
    h = shape.d_model // shape.n_heads
    result = {
        "device": kind, "platform": platform, "memory_gib": memory_gib, "peak_tflops": peak,
        "shape": dataclasses.asdict(shape), "flops_per_token": shape.flops_per_token,
        "shape_text": f"d_model {shape.d_model}, {shape.n_layers} layers, {shape.n_heads} heads "
                      f"({shape.n_kv_heads} kv, head size {h}), d_ff {shape.d_ff}, vocab "
                      f"{shape.vocab}, batch {shape.batch} x {shape.seq}, bf16 compute, fp32 "
                      "params, AdamW + clipping, remat none"
                      + (" (smoke shape)" if smoke else ""),
        "steps": args.steps, "warmup": args.warmup, "rows": results,
        "loss_chunk_tokens": args.loss_chunk_tokens,
        "prediction": prediction(shape, peak, args.loss_chunk_tokens, args.calibration),
    }
    print(table(result), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
