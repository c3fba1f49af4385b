"""lm-eval-harness adapter over our Flax NNX decoder LM and a byte-level BPE ``tokenizers.Tokenizer``.

Shape legend: B batch (always ``batch_size``; short batches are padded with dummy rows), L model
input length (one of a few bucket lengths ≤ ``model.max_len``), V vocabulary.

Scoring semantics (the parts adapters in the field get wrong, and what this one does):

* **Context/continuation boundary.** The continuation scored is always exactly the
  continuation's own tokens, conditioned on the context's own tokens, so every choice of a
  multiple-choice question is scored on the same context ids. As in lm-eval's
  ``TemplateLM._encode_pair`` (the HF backend), trailing whitespace of the context is first moved
  to the front of the continuation. Then ``context + continuation`` is encoded as one string; if
  its token boundaries include the context's UTF-8 byte length exactly and the tokens before it
  are the context's own encoding, it is split there. Otherwise a BPE token spans the join
  (context ``"o"``, continuation ``"ut"`` → one token ``"out"``) and the two parts are encoded
  separately. Scoring the spanning token as "the continuation" would score a different string
  (``"out"``, not ``"ut"``) on a shorter context, and differently for each choice; splitting the
  joint encoding at ``len(encode(context))`` tokens (the HF backend's causal rule) would instead
  score the wrong tokens (here none at all: ``encode("out")[1:]`` is empty). Token byte lengths come
  from the byte-level alphabet, so this needs a byte-level BPE tokenizer (checked in ``__init__``).
* **Empty context** (or one that is all whitespace, moved into the continuation): the EOT token is
  the sole context.
* **Longer than the window.** The context is truncated from the left so that context +
  continuation fit in ``max_len + 1`` tokens (the model sees ``max_len`` of them). Such requests
  are counted in ``JaxLM.truncated_requests`` (cumulative over the adapter's life; rolling
  windows never count). A continuation longer than ``max_len`` tokens is scored in consecutive
  chunks of ``max_len`` targets, each with as much left context as fits; ``is_greedy`` is then the
  AND over all chunks.
* **Rolling loglikelihood** (perplexity) uses ``lm_eval.utils.get_rolling_token_windows`` with
  ``context_len=1`` and ``make_disjoint_window``, exactly like lm-eval's HF backend: disjoint windows
  of up to ``max_len`` predicted tokens, the first conditioned on EOT.
* **Generation** is greedy with a KV cache (:mod:`models.text.generate`: one prompt pass, then a
  decode loop inside XLA, a chunk of up to ``DECODE_STEPS`` tokens per call); it stops at EOT, at
  ``max_gen_toks`` new tokens, or when the decoded continuation contains any of ``until`` (the text
  is cut before the earliest stop sequence). A sequence that outgrows ``max_len`` goes on with one
  full forward pass per new token over the last ``max_len`` tokens (the window slides), which is
  also the whole path with ``kv_cache=False``: the reference the cached path reproduces token for
  token.

All forward passes go through one jitted function, :func:`logprobs`, at shapes
``[batch_size, bucket + 1]``; sequences are right-padded (causal attention: padding never affects
the real positions), so jit compiles once per bucket length, not per request length. Each row's
count of real inputs goes with it (``model(ids, mask)``): an MoE model routes the real tokens only,
so padding and dummy rows take no expert capacity and every score is the unpadded sequence's.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from models.text import generate

EOT_TOKEN = "<|endoftext|>"
DEFAULT_MAX_GEN_TOKS = 256
DECODE_STEPS = 32  # the most tokens per row one call of the KV-cached decoder's loop emits


@functools.partial(jax.jit, static_argnums=0)
def logprobs(
    graphdef: nnx.GraphDef, state: nnx.State, ids_BT: jax.Array, n_inputs_B: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Next-token log-probabilities and greedy predictions for a padded batch.

    Args:
      graphdef, state: ``nnx.split(model)``; ``model(ids_BL int32, mask_BL) -> logits_BLV float32``.
      ids_BT: int32 ``[B, L+1]`` token ids; the model reads ``ids_BT[:, :-1]`` (L ≤ ``max_len``).
      n_inputs_B: int32 ``[B]``, how many of each row's L inputs are real (the rest is padding, 0
        for a dummy row): the mask the model's MoE routers read (:class:`models.layers.moe.MoE`).
        None: every input is real.

    Returns:
      ``(logp_BL float32, argmax_BL int32)``: ``logp_BL[b, t] = log p(ids_BT[b, t+1] | ids_BT[b, :t+1])``
      in nats, and ``argmax_BL[b, t]`` the model's most likely token at that position.
    """
    model = nnx.merge(graphdef, state)
    L = ids_BT.shape[1] - 1
    mask_BL = None if n_inputs_B is None else (jnp.arange(L)[None, :] < n_inputs_B[:, None]).astype(jnp.float32)
    logits_BLV = model(ids_BT[:, :-1], mask_BL).astype(jnp.float32)
    targets_BL = ids_BT[:, 1:]
    target_logits_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
    logp_BL = target_logits_BL - jax.nn.logsumexp(logits_BLV, axis=-1)
    return logp_BL, jnp.argmax(logits_BLV, axis=-1).astype(jnp.int32)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character → byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def default_buckets(max_len: int) -> tuple[int, ...]:
    """Input lengths jit compiles for: powers of two from 16 below ``max_len``, then ``max_len``."""
    out, n = [], 16
    while n < max_len:
        out.append(n)
        n *= 2
    return tuple(out) + (max_len,)


class JaxLM(TemplateLM):
    """lm-eval ``LM`` over a Flax NNX causal LM and a byte-level BPE tokenizer.

    Args:
      model: NNX module, ``model(ids_BL int32, mask_BL float32 | None) -> logits_BLV float32``
        (``mask_BL`` 1 on real inputs, 0 on padding: :class:`models.text.dense.DecoderLM`), with attribute ``max_len``
        (the longest input it accepts). Its parameters are read (``nnx.split``) at every call of a
        public method, so the adapter sees later updates of the same module.
      tokenizer: ``tokenizers.Tokenizer`` with a ByteLevel pre-tokenizer/decoder and an
        ``<|endoftext|>`` token (the EOT / empty-context prefix and default stop token).
      batch_size: rows per forward pass (every call runs at exactly this batch size).
      max_gen_toks: default cap on generated tokens when a request does not set ``max_gen_toks``.
      buckets: padded input lengths; default :func:`default_buckets`. Must end at ``max_len``.
      eot_token: the EOT token's text.
      progress: tqdm bars for lm-eval's requests.
      kv_cache: greedy generation with a KV cache (default); False: one full forward pass per new
        token (the reference path, for tests and benchmarks).

    Attributes:
      truncated_requests: number of loglikelihood requests scored so far whose context +
        continuation exceeded ``max_len + 1`` tokens, so that their context was cut from the left
        (or their continuation scored in chunks). Cumulative; set it to 0 to restart the count.

    Raises:
      ValueError: if the tokenizer has no EOT token, is not byte-level (a vocabulary entry outside
        the byte-level alphabet), or ``buckets`` do not end at ``max_len``.
    """

    def __init__(
        self,
        model: nnx.Module,
        tokenizer,
        batch_size: int = 32,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        buckets: Sequence[int] | None = None,
        eot_token: str = EOT_TOKEN,
        progress: bool = False,
        kv_cache: bool = True,
    ):
        super().__init__()
        self.model = model
        self.progress = bool(progress)  # tqdm bars (lm-eval asks for them; a run's log shows them only if asked)
        self.text_tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self._max_len = int(model.max_len)
        self.buckets = tuple(sorted(buckets)) if buckets else default_buckets(self._max_len)
        if self.buckets[-1] != self._max_len:
            raise ValueError(f"buckets {self.buckets} must end at the model's max_len {self._max_len}")
        eot = tokenizer.token_to_id(eot_token)
        if eot is None:
            raise ValueError(f"tokenizer has no {eot_token!r} token (needed as EOT and empty-context prefix)")
        self._eot = int(eot)
        self.eot_text = eot_token
        self._token_bytes = self._build_token_bytes(tokenizer)
        self.truncated_requests = 0
        self.kv_cache = bool(kv_cache)
        self._token_texts: list[str] | None = None
        self._stop_tables: dict[tuple[str, ...], np.ndarray] = {}

    # ---- tokenization -------------------------------------------------------------------------

    @staticmethod
    def _build_token_bytes(tokenizer) -> np.ndarray:
        """Bytes of text each token id stands for (int64 ``[V]``), from the byte-level alphabet."""
        decoder = _byte_decoder()
        added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        out = np.zeros(n, np.int64)
        for i in range(n):
            if i in added:
                out[i] = len(added[i].encode("utf-8"))
                continue
            tok = tokenizer.id_to_token(i)
            if tok is None:
                continue
            if any(c not in decoder for c in tok):
                raise ValueError(
                    f"token {i} ({tok!r}) is outside the byte-level alphabet: JaxLM needs a byte-level BPE tokenizer"
                )
            out[i] = len(tok)
        return out

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of ``string`` (no BOS/EOS is ever added)."""
        return list(self.text_tokenizer.encode(string, add_special_tokens=False).ids)

    def tok_decode(self, ids: Iterable[int]) -> str:
        return self.text_tokenizer.decode(list(ids))

    def split_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """``(context_ids, continuation_ids)`` for scoring ``continuation`` after ``context``.

        Trailing whitespace of ``context`` moves to the front of ``continuation`` (lm-eval's
        ``_encode_pair``). The joint encoding is split at the context's byte length when a token
        boundary falls exactly there and the tokens before it are ``tok_encode(context)``;
        otherwise (a token spans the join) both parts are encoded separately. Either way
        ``context_ids == tok_encode(context)`` and ``continuation_ids`` decode to exactly the
        (moved-whitespace) continuation. The context ids are never empty: EOT stands in for an
        empty or all-whitespace context.

        Raises:
          ValueError: if the tokens' byte lengths do not add up to the text's (not byte-level).
        """
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        if not context:
            return [self._eot], self.tok_encode(continuation)
        ctx_ids = self.tok_encode(context)
        if not continuation:
            return ctx_ids, []
        whole = self.tok_encode(context + continuation)
        ends = np.cumsum(self._token_bytes[whole]) if whole else np.zeros(0, np.int64)
        n_bytes = len((context + continuation).encode("utf-8"))
        if whole and int(ends[-1]) != n_bytes:
            raise ValueError(
                f"token byte lengths ({int(ends[-1])}) != text bytes ({n_bytes}): tokenizer is not byte-level "
                "or normalises text"
            )
        n_ctx_bytes = len(context.encode("utf-8"))
        k = int(np.searchsorted(ends, n_ctx_bytes, side="left"))
        if k < len(whole) and int(ends[k]) == n_ctx_bytes and whole[: k + 1] == ctx_ids:
            return ctx_ids, whole[k + 1 :]
        return ctx_ids, self.tok_encode(continuation)

    # ---- batched scoring ----------------------------------------------------------------------

    def _bucket(self, n_inputs: int) -> int:
        for b in self.buckets:
            if n_inputs <= b:
                return b
        raise ValueError(f"input of {n_inputs} tokens exceeds max_len {self._max_len}")

    def _windows(self, ctx: list[int], cont: list[int]) -> list[tuple[list[int], int]]:
        """Scoring windows ``(ids, n_pred)`` with ``len(ids) ≤ max_len + 1``: score the last ``n_pred``."""
        full = ctx + cont
        out = []
        for a in range(len(ctx), len(full), self._max_len):
            b = min(a + self._max_len, len(full))
            s = max(0, b - 1 - self._max_len)
            out.append((full[s:b], b - a))
        return out

    def _run_windows(
        self, windows: list[tuple[list[int], int]], disable_tqdm: bool = True, desc: str = "scoring"
    ) -> list[tuple[float, bool]]:
        """``(sum of logp over the last n_pred targets, all of them greedy)`` for each window.

        Windows are grouped by bucket length (longest first), then run ``batch_size`` at a time.
        """
        results: list[tuple[float, bool]] = [(0.0, True)] * len(windows)
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        graphdef, state = nnx.split(self.model)
        pbar = tqdm(total=len(windows), disable=disable_tqdm or not self.progress, desc=desc)
        i = 0
        while i < len(order):
            bucket = self._bucket(len(windows[order[i]][0]) - 1)
            chunk = [j for j in order[i : i + self.batch_size] if self._bucket(len(windows[j][0]) - 1) == bucket]
            ids_BT = np.full((self.batch_size, bucket + 1), self._eot, np.int32)
            n_inputs_B = np.zeros(self.batch_size, np.int32)
            for r, j in enumerate(chunk):
                ids = windows[j][0]
                ids_BT[r, : len(ids)] = ids
                n_inputs_B[r] = len(ids) - 1  # the last token is only a target
            logp_BL, argmax_BL = jax.device_get(logprobs(graphdef, state, jnp.asarray(ids_BT), jnp.asarray(n_inputs_B)))
            for r, j in enumerate(chunk):
                ids, n_pred = windows[j]
                n = len(ids)
                sl = slice(n - 1 - n_pred, n - 1)
                greedy = bool(np.all(argmax_BL[r, sl] == ids_BT[r, sl.start + 1 : sl.stop + 1]))
                results[j] = (float(np.sum(logp_BL[r, sl], dtype=np.float64)), greedy)
            i += len(chunk)
            pbar.update(len(chunk))
        pbar.close()
        return results

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]], disable_tqdm: bool = False, **kw
    ) -> list[tuple[float, bool]]:
        """lm-eval's token-level entry point: ``(key, context_ids, continuation_ids)`` → ``(logp, is_greedy)``.

        ``context_ids`` must be non-empty (prepend EOT otherwise). Log-probabilities are in nats.
        Requests longer than ``max_len + 1`` tokens add to :attr:`truncated_requests`.
        """
        windows, owner = [], []
        for r, (_, ctx, cont) in enumerate(requests):
            if not ctx:
                raise ValueError("context_ids must not be empty (use [eot_token_id])")
            if cont and len(ctx) + len(cont) > self._max_len + 1:
                self.truncated_requests += 1
            for w in self._windows(list(ctx), list(cont)):
                windows.append(w)
                owner.append(r)
        scored = self._run_windows(windows, disable_tqdm=disable_tqdm, desc="loglikelihood")
        total = [0.0] * len(requests)
        greedy = [True] * len(requests)
        for r, (lp, g) in zip(owner, scored):
            total[r] += lp
            greedy[r] = greedy[r] and g
        return [(float(t), bool(g)) for t, g in zip(total, greedy)]

    # ---- the three lm-eval request types --------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``req.args = (context, continuation)`` → ``[(log p(continuation | context) in nats, is_greedy)]``.

        ``is_greedy`` is True iff every continuation token is the model's argmax at its position.
        An empty continuation scores ``(0.0, True)``.
        """
        reqs = [((c, x), *self.split_pair(c, x)) for c, x in (r.args for r in requests)]
        return self._loglikelihood_tokens(reqs, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """``req.args = (text,)`` → total log-probability of ``text`` in nats (0.0 for empty text).

        Disjoint windows of up to ``max_len`` predicted tokens (first conditioned on EOT), as in
        lm-eval's HF backend; independent of ``batch_size``.
        """
        reqs, owner = [], []
        for r, (text,) in enumerate(req.args for req in requests):
            wins = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self._eot, max_seq_len=self._max_len, context_len=1
            )
            for ctx, cont in map(lm_utils.make_disjoint_window, wins):
                reqs.append((None, ctx, cont))
                owner.append(r)
        scored = self._loglikelihood_tokens(reqs, disable_tqdm=disable_tqdm)
        total = [0.0] * len(requests)
        for r, (lp, _) in zip(owner, scored):
            total[r] += lp
        return [float(t) for t in total]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each ``req.args = (context, gen_kwargs)``.

        ``gen_kwargs``: ``until`` (str or list of str; EOT text always added), ``max_gen_toks``
        (default ``self.max_gen_toks``), ``do_sample`` (must be false), ``temperature`` (must be 0 if
        sampling were asked for); other keys are ignored. Returns the generated text, cut before the
        earliest stop sequence.

        Raises:
          ValueError: for ``do_sample=True`` (only greedy decoding is implemented).
        """
        jobs = []
        for context, gen_kwargs in (r.args for r in requests):
            kw = dict(gen_kwargs or {})
            if kw.get("do_sample", False) and float(kw.get("temperature", 1.0)) > 0:
                raise ValueError("JaxLM.generate_until implements greedy decoding only (do_sample=True given)")
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            until = [u for u in until if u] + [self.eot_text]
            max_new = int(kw.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context) if context else []
            jobs.append((ids or [self._eot], until, max_new))
        out: list[str] = [""] * len(jobs)
        graphdef, state = nnx.split(self.model)
        order = sorted(range(len(jobs)), key=lambda j: -len(jobs[j][0]))
        bars_off = disable_tqdm or not self.progress
        for start in tqdm(range(0, len(order), self.batch_size), disable=bars_off, desc="generate_until"):
            rows = order[start : start + self.batch_size]
            out_rows = self._generate_batch(graphdef, state, [jobs[j] for j in rows])
            for j, text in zip(rows, out_rows):
                out[j] = text
        return out

    def _generate_batch(self, graphdef, state, jobs) -> list[str]:
        """Greedy texts of up to ``batch_size`` jobs ``(prompt ids, until, max_new)``: KV-cached
        (:mod:`models.text.generate`) unless ``kv_cache`` is off; a row whose sequence outgrows
        ``max_len`` finishes on the full-forward path (:meth:`_generate_full`), which slides the
        window."""
        if not self.kv_cache:
            return self._generate_full(graphdef, state, jobs)
        n, B = len(jobs), self.batch_size
        prompts = [list(ids)[-self._max_len :] for ids, _, _ in jobs]  # the first window, as the full path's
        gen: list[list[int]] = [[] for _ in jobs]
        texts = [""] * n
        done = [max_new <= 0 for _, _, max_new in jobs]
        if all(done):
            return texts

        def take(r: int, tok: int) -> None:
            texts[r], done[r] = self._take(jobs[r], gen[r], tok, texts[r])

        P = self._bucket(max(len(p) for p in prompts))
        S = self._bucket(min(self._max_len, P + max(m for _, _, m in jobs) - 1))  # the positions a row can need
        ids_BP = np.full((B, P), self._eot, np.int32)
        n_B = np.zeros(B, np.int32)  # padding rows: no real token
        for r, p in enumerate(prompts):
            ids_BP[r, : len(p)] = p
            n_B[r] = len(p)
        first_B, cache = generate.prefill(graphdef, state, jnp.asarray(ids_BP), jnp.asarray(n_B), S)
        for r, tok in enumerate(np.asarray(first_B)[:n]):
            if not done[r]:
                take(r, int(tok))
        stop_BV = np.zeros((B, len(self._token_bytes)), bool)
        for r, (_, until, _) in enumerate(jobs):
            stop_BV[r] = self._stop_table(tuple(until))
        stop_BV = jnp.asarray(stop_BV)
        while True:
            pos = [len(prompts[r]) + len(gen[r]) - 1 for r in range(n)]  # each row's last token, not yet cached
            live = [r for r in range(n) if not done[r] and pos[r] < S]
            if not live:
                break
            tok_B, pos_B, left_B = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
            for r in live:
                tok_B[r], pos_B[r], left_B[r] = gen[r][-1], pos[r], jobs[r][2] - len(gen[r])
            cache, out_BT = generate.decode(
                graphdef, state, cache, *map(jnp.asarray, (tok_B, pos_B, left_B)), stop_BV, self._eot, DECODE_STEPS
            )
            out_BT = np.asarray(out_BT)
            for r in live:
                for tok in out_BT[r]:
                    if tok < 0 or done[r]:
                        break
                    take(r, int(tok))
        rest = [r for r in range(n) if not done[r]]  # outgrew the window: slide it, a full pass per token
        if rest:
            for r, text in zip(
                rest, self._generate_full(graphdef, state, [jobs[r] for r in rest], [gen[r] for r in rest])
            ):
                texts[r] = text
        return texts

    def _stop_table(self, until: tuple[str, ...]) -> np.ndarray:
        """bool ``[V]``: the tokens whose own text contains one of ``until`` (the EOT token aside):
        the decoder ends a row's loop there; the decoded text decides (:meth:`_generate_batch`)."""
        if until not in self._stop_tables:
            if self._token_texts is None:
                self._token_texts = [self.tok_decode([i]) for i in range(len(self._token_bytes))]
            stops = [u for u in until if u and u != self.eot_text]
            self._stop_tables[until] = np.array([any(u in t for u in stops) for t in self._token_texts], bool)
        return self._stop_tables[until]

    def _generate_full(self, graphdef, state, jobs, gen: list[list[int]] | None = None) -> list[str]:
        """Greedy texts by one full forward pass per new token over the last ``max_len`` tokens
        (the reference the KV-cached path reproduces). ``gen``: tokens each row has already
        generated (the cached path hands over rows that outgrew the window)."""
        seqs = [list(ids) for ids, _, _ in jobs]
        gen = [list(g) for g in gen] if gen is not None else [[] for _ in jobs]
        texts = [self.tok_decode(g) if g else "" for g in gen]
        done = [len(g) >= max_new for g, (_, _, max_new) in zip(gen, jobs)]
        while not all(done):
            live = [r for r in range(len(jobs)) if not done[r]]
            inputs = {r: (seqs[r] + gen[r])[-self._max_len :] for r in live}
            bucket = self._bucket(max(len(v) for v in inputs.values()))
            ids_BT = np.full((self.batch_size, bucket + 1), self._eot, np.int32)
            n_inputs_B = np.zeros(self.batch_size, np.int32)
            for k, r in enumerate(live):
                ids_BT[k, : len(inputs[r])] = inputs[r]
                n_inputs_B[k] = len(inputs[r])
            _, argmax_BL = jax.device_get(logprobs(graphdef, state, jnp.asarray(ids_BT), jnp.asarray(n_inputs_B)))
            for k, r in enumerate(live):
                texts[r], done[r] = self._take(jobs[r], gen[r], int(argmax_BL[k, len(inputs[r]) - 1]), texts[r])
        return texts

    def _take(self, job, gen: list[int], tok: int, text: str) -> tuple[str, bool]:
        """One greedy token for a row: ``(its text so far, done)``. EOT ends the row unappended;
        otherwise ``tok`` joins ``gen`` (in place), and the decoded text is cut before the earliest
        stop string (done) or kept whole (done at ``max_new`` tokens). Both decoding paths use it."""
        _, until, max_new = job
        if tok == self._eot:
            return text, True
        gen.append(tok)
        text = self.tok_decode(gen)
        cuts = [text.find(u) for u in until if u in text]
        if cuts:
            return text[: min(cuts)], True
        return text, len(gen) >= max_new

    def get_model_info(self) -> dict:
        return {"model": type(self.model).__name__, "max_len": self._max_len, "batch_size": self.batch_size}
