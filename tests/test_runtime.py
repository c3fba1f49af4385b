"""The learner loop's rules on receipt (keep in-flight steps or overwrite them) and first-come turns."""

import threading
import time

import numpy as np
import optax
import pytest
from flax import nnx

from configs.schema import ModelConfig
from diloco.exchange import InMemoryExchange, Submission
from diloco.fragments import balanced_fragments
from diloco.params import get_params, set_params, tensor_bytes, to_numpy
from diloco.runtime import FairTurns, LearnerSpec, on_receipt, run_learner
from diloco.syncer import Syncer, SyncerSettings
from models import build_model
from models.training import train_step

TINY = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, tie_embeddings=False)
B, L, STEPS = 2, 8, 12


def tiny_model():
    return build_model(TINY, vocab_size=50, max_len=L, rngs=nnx.Rngs(0))


def test_on_receipt_rules_by_hand():
    got = {"w": np.array([4.0, 8.0], np.float32)}  # Θ from the syncer
    local = {"w": np.array([1.5, 3.0], np.float32)}  # θ now
    sent = {"w": np.array([1.0, 2.0], np.float32)}  # θ when sent
    np.testing.assert_allclose(on_receipt(got, local, sent, keep_in_flight=True)["w"], [4.5, 9.0])
    np.testing.assert_allclose(on_receipt(got, local, sent, keep_in_flight=False)["w"], [4.0, 8.0])
    np.testing.assert_allclose(on_receipt(got, local, sent, False, mix_alpha=0.5)["w"], [2.75, 5.5])
    assert local["w"][0] == 1.5 and got["w"][0] == 4.0  # inputs untouched


class OneStepLateExchange(InMemoryExchange):
    """Merges every submission at once with a real Syncer, but shows the merged fragment to the
    learner only after it has taken one more inner step: exactly one step in flight, every time."""

    def __init__(self, syncer: Syncer, budget: int):
        super().__init__(syncer.num_fragments, budget)
        self.syncer, self._beats, self._held, self.sent = syncer, 0, [], []
        for p in range(syncer.num_fragments):
            super().publish(p, 0, syncer.global_params[p])

    def submit(self, sub: Submission) -> None:
        self.sent.append((sub.fragment, sub.local_step))
        self.syncer.receive(sub, 0.0)
        for rec in self.syncer.poll(0.0, live={sub.learner}):
            p = rec["fragment"]
            self._held.append((self._beats + 2, p, self.syncer.versions[p], self.syncer.global_params[p]))

    def heartbeat(self, learner: int, **info) -> None:
        super().heartbeat(learner, **info)
        self._beats += 1
        due = [h for h in self._held if h[0] <= self._beats]
        self._held = [h for h in self._held if h[0] > self._beats]
        for _, p, version, params in due:
            self.publish(p, version, params)


def _run_one_learner(keep_in_flight: bool, batches: list[np.ndarray], theta0: dict, fragments) -> dict:
    syncer = Syncer(theta0, fragments, SyncerSettings(num_learners=1, quorum=1, merge="mean",
                                                      outer_lr=1.0, outer_momentum=0.0))
    exchange = OneStepLateExchange(syncer, budget=STEPS * B * L)

    def factory():
        model = tiny_model()
        set_params(model, theta0)
        return model

    spec = LearnerSpec(
        learner=0, next_batch=lambda e, i: (batches[i], e, i + 1), model_factory=factory,
        tx=optax.adam(1e-2), fragments=fragments, period=2, tokens_per_step=B * L,
        keep_in_flight=keep_in_flight, turns=FairTurns(1),
    )
    out = run_learner(spec, exchange, threading.Event(), attempt=1, log=lambda rec: None, t0=0.0)
    assert out["steps"] == STEPS
    assert len(set(exchange.sent)) == len(exchange.sent)  # the final hand-in never resends a copy
    syncer.flush(0.0)
    assert syncer.num_merges > STEPS // 2  # fragments really went back and forth mid-run
    return syncer.params()


def test_keep_in_flight_loses_no_inner_step():
    """One learner, outer lr 1, no momentum: Θ after a merge is the learner's sent copy. Keeping
    the in-flight step makes the run identical to plain training on the same batches; overwriting
    drops that step's update every time a fragment comes back."""
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 50, size=(B, L + 1)).astype(np.int32) for _ in range(STEPS)]
    theta0 = to_numpy(get_params(tiny_model()))
    fragments = balanced_fragments(tensor_bytes(theta0), 2)

    plain = tiny_model()
    opt = nnx.Optimizer(plain, optax.adam(1e-2), wrt=nnx.Param)
    for b in batches:
        train_step(plain, opt, b)
    expected = to_numpy(get_params(plain))

    kept = _run_one_learner(True, batches, theta0, fragments)
    for k in expected:
        np.testing.assert_allclose(kept[k], expected[k], atol=1e-5, err_msg=k)
    overwritten = _run_one_learner(False, batches, theta0, fragments)
    worst = max(float(np.abs(overwritten[k] - expected[k]).max()) for k in expected)
    assert worst > 1e-3


def test_microbatched_step_is_the_whole_batch_step():
    """Averaging the gradients of 4 slices of 2 sequences gives the update of one pass over 8."""
    batch = np.random.default_rng(1).integers(0, 50, size=(8, L + 1)).astype(np.int32)
    results = []
    for k in (1, 4):
        model = tiny_model()
        opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
        losses = [float(train_step(model, opt, batch, k)) for _ in range(3)]
        results.append((losses, to_numpy(get_params(model))))
    (l1, p1), (l4, p4) = results
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    for k in p1:
        np.testing.assert_allclose(p4[k], p1[k], atol=1e-5, err_msg=k)
    assert l1[2] < l1[0]


def test_fair_turns_serve_in_arrival_order_and_bound_concurrency():
    with pytest.raises(ValueError, match="slots"):
        FairTurns(0)
    turns, order = FairTurns(1), []
    turns.__enter__()  # hold the only slot so the three threads must queue
    threads = []
    for name in "abc":
        t = threading.Thread(target=lambda n=name: (turns.__enter__(), order.append(n), turns.__exit__()))
        t.start()
        deadline = time.monotonic() + 10
        while len(turns._queue) < len(threads) + 1:  # wait until this thread is queued
            assert time.monotonic() < deadline, f"thread {name} never queued"
            time.sleep(0.001)
        threads.append(t)
    turns.__exit__()
    for t in threads:
        t.join(5)
    assert order == ["a", "b", "c"]

    turns, lock, running, peak = FairTurns(2), threading.Lock(), [0], [0]

    def work():
        for _ in range(50):
            with turns:
                with lock:
                    running[0] += 1
                    peak[0] = max(peak[0], running[0])
                time.sleep(0.001)  # long enough for the other threads to pile in if they could
                with lock:
                    running[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert peak[0] == 2  # both slots used, never a third


def test_scheduled_failures_fire_in_order_one_per_attempt():
    """Two failures of one learner at steps 3 and 7: attempt 1 fails at 3, the retry resumes there and
    fails at 7, attempt 3 runs to the end of the budget."""
    from diloco.runtime import InjectedFailure

    model = tiny_model()
    theta0 = to_numpy(get_params(model))
    fragments = balanced_fragments(tensor_bytes(theta0), 2)
    syncer = Syncer(theta0, fragments, SyncerSettings(num_learners=1, quorum=1))
    exchange = InMemoryExchange(len(fragments), token_budget=10 * B * L)
    for p in range(len(fragments)):
        exchange.publish(p, 0, syncer.global_params[p])
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 50, (B, L + 1), dtype=np.int32) for _ in range(10)]
    spec = LearnerSpec(learner=0, next_batch=lambda e, i: (batches[i], e, i + 1), model_factory=tiny_model,
                       tx=optax.adam(1e-2), fragments=fragments, period=2, tokens_per_step=B * L,
                       fail_at_steps=(3, 7))
    failed_at = []
    for attempt in (1, 2):
        with pytest.raises(InjectedFailure, match=f"at local step {(3, 7)[attempt - 1]}"):
            run_learner(spec, exchange, threading.Event(), attempt=attempt, log=lambda rec: None, t0=0.0)
        failed_at.append(exchange.learners()[0]["step"])
    out = run_learner(spec, exchange, threading.Event(), attempt=3, log=lambda rec: None, t0=0.0)
    assert failed_at == [2, 6] and out["steps"] == 10
