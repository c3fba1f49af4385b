"""KV-cached greedy decoding for the text families (dense and MoE decoder LMs), in XLA.

Two jitted functions, driven by a host loop (:meth:`evals.lm_adapter.JaxLM.generate_until`):

* :func:`prefill`: one forward pass over the right-padded prompts (``[B, P]``, P one of the
  adapter's bucket lengths), the first greedy token of each row, and every block's keys and values
  padded to a cache of S positions (S also a bucket length, ≥ P).
* :func:`decode`: up to ``steps`` greedy tokens per row in one ``lax.while_loop``: each step feeds
  every active row's last token at its own position (rows are ragged) through
  :meth:`models.text.dense.DecoderLM.decode`, writes its key and value into the cache and takes the
  argmax. A row stops being active when it emits EOT, a token its stop table marks (a token whose
  text contains one of its stop strings), its budget of new tokens is spent, or its next position
  would not fit the cache; the loop ends early when no row is active. The host reads the tokens,
  applies the stop strings to the decoded text (the authority: the token table only ends the loop
  early) and calls again for rows that go on.

Against one full forward pass per new token (what the adapter did before), each new token costs one
position's matmuls and attention over the cache, and the loop runs without a host round trip per
token. The outputs are the same tokens (tests/test_evals.py, tests/test_moe.py), up to float
rounding of near-ties, with one exception by design: an MoE layer with a capacity routes each
decoded token as a group of its own (its k choices always find room), where the full forward pass
routes it after the prompt's tokens and may drop a choice when an expert is full; with dropless
routing (``capacity_factor: null``) the two agree.

Shape legend: B batch (rows), P prompt bucket length, S cache length, V vocabulary, T steps, N heads,
C channels per head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


@functools.partial(jax.jit, static_argnums=(0, 4))
def prefill(
    graphdef: nnx.GraphDef, state: nnx.State, ids_BP: jax.Array, n_B: jax.Array, cache_len: int
) -> tuple[jax.Array, list]:
    """The prompt pass.

    Args:
      graphdef, state: ``nnx.split`` of a :class:`models.text.dense.DecoderLM`.
      ids_BP: int32 ``[B, P]``, each row's prompt right-padded (P ≤ the model's ``max_len``).
      n_B: int32 ``[B]``, each row's prompt length (≥ 1; a padding row may say 1).
      cache_len: S ≥ P, the cache's positions (static).

    Returns:
      ``(next_B int32, cache)``: each row's greedy token after its prompt, and per block
      ``(k, v)`` of shape ``[B, N, S, C]`` (positions ≥ ``n_B`` hold nothing a later step reads).
    """
    model = nnx.merge(graphdef, state)
    P = ids_BP.shape[1]
    mask_BP = (jnp.arange(P)[None, :] < n_B[:, None]).astype(jnp.float32)
    x_BPD, cache = model.prefill(ids_BP, mask_BP)
    last_BD = jnp.take_along_axis(x_BPD, jnp.maximum(n_B - 1, 0)[:, None, None], axis=1)[:, 0]
    last_BV = last_BD @ model.head_kernel()  # the head at the last real position only
    pad = ((0, 0), (0, 0), (0, cache_len - P), (0, 0))
    cache = [(jnp.pad(k, pad), jnp.pad(v, pad)) for k, v in cache]
    return jnp.argmax(last_BV.astype(jnp.float32), axis=-1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnums=(0, 8), donate_argnums=(2,))
def decode(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    cache: list,
    tok_B: jax.Array,
    pos_B: jax.Array,
    left_B: jax.Array,
    stop_BV: jax.Array,
    eot: jax.Array,
    steps: int,
) -> tuple[list, jax.Array]:
    """Up to ``steps`` greedy tokens per row from the KV cache.

    Args:
      graphdef, state: as :func:`prefill`.
      cache: per block ``(k, v)`` ``[B, N, S, C]``, positions ``< pos_B`` filled (donated).
      tok_B: int32 ``[B]``, each row's last token, not yet in the cache.
      pos_B: int32 ``[B]``, that token's position.
      left_B: int32 ``[B]``, new tokens each row may still emit; 0 for a row that is done (or
        padding): it emits nothing.
      stop_BV: bool ``[B, V]``, tokens after which a row stops (its stop strings' tokens).
      eot: int32 scalar, the EOT token (a row that emits it stops; EOT is not a new token).
      steps: T, the most steps (static).

    Returns:
      ``(cache, out_BT int32)``: the updated cache and the tokens each row emitted, in order, -1
      after its last (EOT included when emitted).
    """
    B, S = tok_B.shape[0], cache[0][0].shape[2]
    model = nnx.merge(graphdef, state)
    nnx.pop(model, nnx.Intermediate)  # what an earlier call sowed (an MoE layer's statistics): not read here
    graphdef, state = nnx.split(model)
    out_BT = jnp.full((B, steps), -1, jnp.int32)

    def active(pos, left):
        return (left > 0) & (pos < S)

    def cond(carry):
        i, _, _, pos, left, _ = carry
        return (i < steps) & jnp.any(active(pos, left))

    def body(carry):
        i, cache, tok, pos, left, out = carry
        live = active(pos, left)
        model = nnx.merge(graphdef, state)
        logits_BV, cache = model.decode(tok, cache, jnp.minimum(pos, S - 1), live.astype(jnp.float32))
        nxt = jnp.argmax(logits_BV.astype(jnp.float32), axis=-1).astype(jnp.int32)
        out = out.at[:, i].set(jnp.where(live, nxt, -1))
        stopped = (nxt == eot) | jnp.take_along_axis(stop_BV, nxt[:, None], axis=1)[:, 0]
        left = jnp.where(live, jnp.where(stopped, 0, left - 1), left)
        return i + 1, cache, jnp.where(live, nxt, tok), jnp.where(live, pos + 1, pos), left, out

    _, cache, _, _, _, out_BT = jax.lax.while_loop(cond, body, (0, cache, tok_B, pos_B, left_B, out_BT))
    return cache, out_BT
