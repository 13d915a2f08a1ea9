"""Text generation from a `Transformer`: prefill the prompts into a KV cache, then one token
per step, in one jitted program (`generate`).

Sampling is greedy (temperature 0) or from the softmax of logits / temperature, optionally cut
to the `top_k` most likely tokens and to the smallest set whose probability reaches `top_p`.
A row ends at a stop token (not returned) or after `max_new_tokens`; the loop ends when every
row has. Prompts of different lengths are right-padded; each row decodes from its own end.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.layers.kv_cache import init_cache
from hetjax.layers.model import Transformer

END = -1  # in the output: positions after a row's end


def filter_logits(logits, temperature: float, top_k: int, top_p: float):
    """logits [batch, vocab] / temperature, with the tokens outside top-k / top-p at -inf."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        desc = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(desc, axis=-1)
        # keep a token while the mass of the more likely ones is below top_p (the first always)
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p
        cut = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cut, -jnp.inf, logits)
    return logits


def next_token(logits, key, temperature: float, top_k: int, top_p: float):
    """One token per row from logits [batch, vocab]."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, temperature, top_k, top_p),
                                  axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "temperature", "top_k",
                                             "top_p", "stop_tokens", "vocab_limit"))
def _generate(params, prompts, lengths, key, *, model, max_new_tokens, temperature, top_k,
              top_p, stop_tokens, vocab_limit):
    b, p = prompts.shape
    cache = init_cache(model.cfg, b, p + max_new_tokens)
    stops = jnp.asarray(stop_tokens or (-2,), jnp.int32)
    rows = jnp.arange(b)

    def pick(logits, key):
        if vocab_limit:  # the embedding is padded past the tokenizer's vocabulary
            logits = logits.at[:, vocab_limit:].set(-jnp.inf)
        return next_token(logits, key, temperature, top_k, top_p)

    logits, cache = model.apply({"params": params}, prompts, cache, method=Transformer.decode)
    cache["pos"] = jnp.broadcast_to(lengths, cache["pos"].shape)  # each row goes on at its end
    key, sub = jax.random.split(key)
    tok = pick(logits[rows, lengths - 1], sub)
    out = jnp.full((b, max_new_tokens), END, jnp.int32)

    def body(s):
        t, cache, tok, out, done, key = s
        done = done | jnp.isin(tok, stops)
        out = out.at[:, t].set(jnp.where(done, END, tok))
        logits, cache = model.apply({"params": params}, tok[:, None], cache,
                                    method=Transformer.decode)
        key, sub = jax.random.split(key)
        return t + 1, cache, pick(logits[:, 0], sub), out, done, key

    def more(s):
        t, done, tok = s[0], s[4], s[2]
        return (t < max_new_tokens) & ~jnp.all(done | jnp.isin(tok, stops))

    s = (jnp.int32(0), cache, tok, out, jnp.zeros(b, bool), key)
    return jax.lax.while_loop(more, body, s)[3]


def generate(model: Transformer, params, prompts: list[list[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             stop_tokens: tuple[int, ...] = (), seed: int = 0,
             vocab_limit: int | None = None) -> list[list[int]]:
    """The tokens generated after each prompt (a list of token ids, none empty), without the
    stop token that ended a row. `vocab_limit`: only tokens below it are sampled."""
    lengths = np.array([len(t) for t in prompts], np.int32)
    padded = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for i, t in enumerate(prompts):
        padded[i, :len(t)] = t
    out = _generate(params, jnp.asarray(padded), jnp.asarray(lengths), jax.random.key(seed),
                    model=model, max_new_tokens=int(max_new_tokens),
                    temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                    stop_tokens=tuple(int(s) for s in stop_tokens),
                    vocab_limit=int(vocab_limit) if vocab_limit else None)
    return [[int(t) for t in row if t != END] for row in np.asarray(out)]
