"""Greedy generation speed: the KV-cached decoder against the full-forward path it replaced and a
KV-cached PyTorch decode of the same model, side by side in one run.

    python benchmarks/generation.py [--config default] [--repeats 5] [--batch 32]
    make bench-torch ARGS=...   # not needed: install benchmarks/requirements-torch.txt for the PyTorch arm

Two measurements, on the config's model (random initialisation: speed does not depend on the
weights; the tokens are compared, not judged):

1. **Decode.** ``--batch`` prompts of P tokens (windows of the config's own training data), G new
   tokens each, no stop: *ours* (:func:`models.text.generate.prefill` + :func:`~models.text.generate.decode`
   loops, as :class:`evals.lm_adapter.JaxLM` runs them), *full* (one :func:`evals.lm_adapter.logprobs`
   forward pass over the bucketed window per new token: the adapter before the KV cache, still its
   ``kv_cache=False`` path) and *torch* (``benchmarks/torch_reference.greedy_generate``: the same
   weights, eager PyTorch with preallocated KV buffers, ``torch.set_num_threads`` = the cores this
   process may use). Generated tokens per second = B·G / seconds; ``×`` columns are ratios to the
   full path. Ours and full must emit the same tokens (asserted); PyTorch's agreement is printed.
2. **The evaluation's requests.** The config's fine-tuning task (``ft_generate``: the speaker
   task's test prompts, ``until "\\n"``, ``max_gen_toks`` as the pipeline sets it) through
   ``JaxLM.generate_until`` with ``kv_cache`` on and off: seconds for all requests, the outputs
   asserted identical.

Arms take turns within each repetition (a load that comes and goes falls on all of them); figures
are medians over ``--repeats`` turns after one untimed turn (compilation). Without PyTorch the torch
arm is left out with one line. Prints the figures; asserts only that the outputs agree.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.specs import load_spec
from evals.lm_adapter import JaxLM, default_buckets, logprobs
from models import build_model
from models.spec import InputShape
from models.text import generate
from training.xla import configure_host

try:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from torch_reference import DecoderLM as TorchLM, cores, greedy_generate, load_flax_params
except ImportError:  # the optional reference: pip install -r benchmarks/requirements-torch.txt
    torch = None


def ours(model, ids_BP: np.ndarray, new: int) -> Callable[[], np.ndarray]:
    graphdef, state = nnx.split(model)
    B, P = ids_BP.shape
    S = next(b for b in default_buckets(model.max_len) if b >= min(model.max_len, P + new - 1))  # as JaxLM sizes it
    ids, n_B = jnp.asarray(ids_BP), jnp.full((B,), P, jnp.int32)
    never = jnp.zeros((B, model.vocab_size), bool)

    def run() -> np.ndarray:
        first_B, cache = generate.prefill(graphdef, state, ids, n_B, S)
        _, out_BT = generate.decode(
            graphdef, state, cache, first_B, n_B, jnp.full((B,), new - 1, jnp.int32), never, -1, new - 1
        )
        return np.concatenate([np.asarray(first_B)[:, None], np.asarray(out_BT)], axis=1)

    return run


def full(model, ids_BP: np.ndarray, new: int, buckets: tuple[int, ...]) -> Callable[[], np.ndarray]:
    graphdef, state = nnx.split(model)
    B, P = ids_BP.shape

    def run() -> np.ndarray:
        seq = ids_BP.copy()
        out = np.zeros((B, new), np.int32)
        for t in range(new):
            n = P + t
            bucket = next(b for b in buckets if b >= n)
            ids_BT = np.zeros((B, bucket + 1), np.int32)
            ids_BT[:, :n] = seq
            _, argmax_BL = jax.device_get(logprobs(graphdef, state, jnp.asarray(ids_BT), jnp.full((B,), n, jnp.int32)))
            out[:, t] = argmax_BL[:, n - 1]
            seq = np.concatenate([seq, out[:, t : t + 1]], axis=1)
        return out

    return run


def theirs(model, cfg, vocab: int, ids_BP: np.ndarray, new: int) -> Callable[[], np.ndarray]:
    torch.set_num_threads(cores())
    ref = TorchLM(cfg.model, vocab, cfg.data.seq_len)
    load_flax_params(ref, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    ref.eval()
    ids = torch.from_numpy(ids_BP.astype(np.int64))
    return lambda: greedy_generate(ref, ids, new).numpy()


def turns(arms: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each arm over ``repeats`` rounds in which the arms take turns (one untimed round first)."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(repeats + 1):
        for name, run in arms.items():
            t = time.perf_counter()
            run()
            if r:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def eval_requests(cfg, run_dir: Path) -> tuple[object, list]:
    """The config's tokenizer and its fine-tuning task's ``generate_until`` requests, built as the
    pipeline builds them (data preparation, the task's test pairs, lm-eval's Instance arguments)."""
    from lm_eval.api.instance import Instance

    from data.finetune import text_task_pairs
    from data.prepare import prepare_data
    from data.store import load_tokenizer
    from evals.pair_tasks import STOP
    from training.finetune import max_gen_tokens

    prepare_data(cfg, run_dir)
    train, test, _ = text_task_pairs(cfg.finetune, cfg.finetune_task, cfg.data.seed, run_dir)
    tok = load_tokenizer(run_dir)
    longest = max(len(tok.encode(p["response"]).ids) for p in train + test)
    kw = {
        "until": [STOP],
        "max_gen_toks": max_gen_tokens(cfg.finetune, {"longest_response_tokens": longest}),
        "do_sample": False,
    }
    reqs = [Instance("generate_until", {}, (p["prompt"], dict(kw)), i) for i, p in enumerate(test)]
    return tok, reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="default")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32, help="prompts per batch (the evaluation's eval.batch_size)")
    ap.add_argument("--prompt", type=int, default=64, help="P, prompt tokens in the decode measurement")
    ap.add_argument("--new", type=int, nargs="+", default=[16, 64], help="G, new tokens (each value a row)")
    args = ap.parse_args()
    if args.batch < 1 or args.prompt < 1 or min(args.new) < 2:
        ap.error(
            "--batch and --prompt must be ≥ 1 and every --new ≥ 2 (one token from the prompt pass, the rest decoded)"
        )
    try:
        cfg = load_spec("config", args.config if args.config.endswith(".yaml") else f"configs/{args.config}.yaml")
    except (ValueError, FileNotFoundError) as exc:
        ap.error(f"--config: {exc}")
    if cfg.data.modality != "text":
        ap.error(
            f"--config {args.config} is a {cfg.data.modality} config; generation needs a text one (e.g. default, moe)"
        )
    if args.prompt + max(args.new) - 1 > cfg.data.seq_len:
        ap.error(f"--prompt + --new - 1 must fit the model's window, data.seq_len = {cfg.data.seq_len}")
    configure_host()
    with_torch = torch is not None and cfg.model.kind == "dense_lm"  # the PyTorch reference is the dense LM
    # the same tokens by construction, except an MoE with a capacity (models/text/generate.py)
    exact = getattr(cfg.model, "capacity_factor", None) is None
    with tempfile.TemporaryDirectory() as tmp:
        tok, reqs = eval_requests(cfg, Path(tmp))
        vocab = tok.get_vocab_size(with_added_tokens=True)
        model = build_model(cfg.model, InputShape(vocab_size=vocab, seq_len=cfg.data.seq_len)).init(cfg.seed)
        from data.store import load_sequences

        rows = load_sequences(tmp, "val")
    torch_note = f"torch {torch.__version__} ({cores()} threads)" if torch else "torch: not installed (arm left out)"
    print(
        f"# generation  {time.strftime('%Y-%m-%d %H:%M')}  {platform.machine()}  {os.cpu_count()} cores  "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}  jax {jax.__version__}  {torch_note}"
    )
    print(f"model: {cfg.name} ({cfg.model.kind}), max_len {cfg.data.seq_len}, vocab {vocab}; batch {args.batch}")
    lm = JaxLM(model, tok, batch_size=args.batch)
    print(f"\n1. decode: {args.batch} prompts of {args.prompt} tokens, G new tokens, no stop; median of {args.repeats}")
    print(
        f"{'G':>4} {'full tok/s':>11} {'ours tok/s':>11} {'x full':>7} {'torch tok/s':>12} {'x full':>7}"
        f" {'torch = ours':>13}"
    )
    ids_BP = rows[: args.batch, : args.prompt].astype(np.int32)
    for new in args.new:
        arms = {"full": full(model, ids_BP, new, lm.buckets), "ours": ours(model, ids_BP, new)}
        if with_torch:
            arms["torch"] = theirs(model, cfg, vocab, ids_BP, new)
        outs = {name: run() for name, run in arms.items()}
        assert not exact or np.array_equal(outs["ours"], outs["full"]), (
            "the KV-cached decoder and the full path disagree"
        )
        secs = turns(arms, args.repeats)
        rate = {name: args.batch * new / s for name, s in secs.items()}
        line = f"{new:>4} {rate['full']:>11,.0f} {rate['ours']:>11,.0f} {rate['ours'] / rate['full']:>7.1f}"
        if with_torch:
            agree = float(np.mean(outs["torch"] == outs["ours"]))
            line += f" {rate['torch']:>12,.0f} {rate['torch'] / rate['full']:>7.1f} {agree:>12.1%}"
        print(line)
    print(
        f"\n2. the fine-tuning task's requests ({len(reqs)} generate_until, "
        f"max_gen_toks {reqs[0].args[1]['max_gen_toks']}, "
        f"until '\\n') through JaxLM.generate_until; median of {args.repeats}"
    )
    on, off = JaxLM(model, tok, batch_size=args.batch), JaxLM(model, tok, batch_size=args.batch, kv_cache=False)
    texts = {"full": off.generate_until(reqs, disable_tqdm=True), "ours": on.generate_until(reqs, disable_tqdm=True)}
    assert not exact or texts["ours"] == texts["full"], "generate_until's texts differ with and without the KV cache"
    generated = sum(len(tok.encode(t).ids) for t in texts["ours"])
    secs = turns(
        {
            "full": lambda: off.generate_until(reqs, disable_tqdm=True),
            "ours": lambda: on.generate_until(reqs, disable_tqdm=True),
        },
        args.repeats,
    )
    print(f"{'path':>5} {'seconds':>8} {'tok/s':>8}  (about {generated} generated tokens, re-encoded from the texts)")
    for name in ("full", "ours"):
        print(f"{name:>5} {secs[name]:>8.2f} {generated / secs[name]:>8,.0f}")
    print(f"ours / full: {secs['full'] / secs['ours']:.1f}x faster; outputs identical ({len(reqs)} texts)")


if __name__ == "__main__":
    main()
