"""The learner: receipt rules, first-come turns, the microbatched step, scheduled failures, resume
points in a fresh process (plain, picklable inputs; Adam moments restored), and a new model kind
trained through the DiLoCo and DP loops without touching them."""

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Literal

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pydantic import BaseModel

from configs.faults import FailEvent, SlowdownEvent
from configs.load import load_config
from configs.model import DenseLMConfig
from diloco.exchange import InMemoryExchange, Submission
from diloco.faults import LearnerFaults
from diloco.fragments import balanced_fragments
from diloco.learner import InjectedFailure, LearnerSetup, ResumePoint, run_learner, tree_digest
from diloco.pacing import FairTurns, HostTurns
from diloco.receipt import receipt_rule
from diloco.syncer import Syncer, SyncerSettings
from diloco.tensors import tensor_bytes, to_numpy
from models import MODELS, BatchLayout, InputShape, ModelSpec, build_model, count_params, register
from run.layout import RunLayout
from run.metrics import read_jsonl
from training.step import Trainer

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "shakespeare_small.jsonl"
TINY = DenseLMConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, tie_embeddings=False)
B, L, STEPS = 2, 8, 12


def tiny_trainer(tx=None, microbatches=1) -> Trainer:
    spec = build_model(TINY, InputShape(vocab_size=50, seq_len=L))
    return Trainer(spec, tx or optax.adam(1e-2), microbatches, seed=0)


# -- the plan a run's learners and syncer read --------------------------------------------------------
def test_the_plan_holds_the_derived_values_by_hand():
    """tiny.yaml: M 3 learners of batch 4 × seq_len 32 = 128 tokens a step; a budget of 24,576 tokens is
    64 DP steps of 12 × 32 = 384 tokens (24,576 exactly), so 64 inner steps each (24,576 / (3 × 128));
    the plan's fault events are the config's."""
    from training.decoupled.plan import DiLoCoPlan

    cfg = load_config(ROOT / "configs" / "tiny.yaml", {"chaos.events": [{"kind": "fail", "learner": 1, "at_step": 3}]})
    plan = DiLoCoPlan.of(cfg)
    assert (plan.tokens_per_learner_step, plan.learner_steps, plan.token_budget) == (128, 64, 24576)
    assert (plan.learner_microbatches, plan.learner_processes, plan.unit) == (1, False, "tokens")
    assert [(e.kind, e.learner, e.at_step) for e in plan.fault_events] == [("fail", 1, 3)]
    assert plan.diloco is cfg.diloco and plan == DiLoCoPlan.of(cfg)  # one key per config (compiled steps)


# -- receipt rules ---------------------------------------------------------------------------------
def test_receipt_rules_by_hand():
    got = {"w": np.array([4.0, 8.0], np.float32)}  # Θ from the syncer
    local = {"w": np.array([1.5, 3.0], np.float32)}  # θ now
    sent = {"w": np.array([1.0, 2.0], np.float32)}  # θ when sent
    np.testing.assert_allclose(receipt_rule("keep_in_flight").apply(got, local, sent)["w"], [4.5, 9.0])
    np.testing.assert_allclose(receipt_rule("overwrite").apply(got, local, sent)["w"], [4.0, 8.0])
    np.testing.assert_allclose(receipt_rule("mix", 0.5).apply(got, local, sent)["w"], [2.75, 5.5])
    assert local["w"][0] == 1.5 and got["w"][0] == 4.0  # inputs untouched
    assert receipt_rule("keep_in_flight").keeps_progress and not receipt_rule("overwrite").keeps_progress
    with pytest.raises(ValueError, match="unknown receipt rule 'average'.*overwrite, mix, keep_in_flight"):
        receipt_rule("average")
    with pytest.raises(ValueError, match="mix α"):
        receipt_rule("mix", 1.0)


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


def _setup(trainer, exchange, batches, fragments, rule="overwrite", **kw) -> LearnerSetup:
    return LearnerSetup(
        learner=0,
        attempt=kw.pop("attempt", 1),
        step=trainer.step,
        init_params=trainer.init_params,
        init_opt=trainer.init_opt,
        next_batch=lambda e, i: (batches[i % len(batches)], e, i + 1),
        fragments=fragments,
        period=2,
        tokens_per_step=B * L,
        receipt=receipt_rule(rule),
        exchange=exchange,
        log=kw.pop("log", lambda rec: None),
        **kw,
    )


def _run_one_learner(rule: str, batches, theta0, fragments) -> dict:
    syncer = Syncer(
        theta0, fragments, SyncerSettings(num_learners=1, quorum=1, merge="mean", outer_lr=1.0, outer_momentum=0.0)
    )
    exchange = OneStepLateExchange(syncer, budget=STEPS * B * L)
    out = run_learner(_setup(tiny_trainer(), exchange, batches, fragments, rule, turns=FairTurns(1)))
    assert out["steps"] == STEPS
    assert len(set(exchange.sent)) == len(exchange.sent)  # the final hand-in never resends a copy
    syncer.flush(0.0)
    assert syncer.num_merges > STEPS // 2  # fragments really went back and forth mid-run
    return syncer.params()


@pytest.mark.slow
def test_keep_in_flight_loses_no_inner_step():
    """One learner, outer lr 1, no momentum: Θ after a merge is the learner's sent copy. Keeping
    the in-flight step makes the run identical to plain training on the same batches; overwriting
    drops that step's update every time a fragment comes back."""
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 50, size=(B, L + 1)).astype(np.int32) for _ in range(STEPS)]
    trainer = tiny_trainer()
    theta0 = to_numpy(trainer.init_params())
    fragments = balanced_fragments(tensor_bytes(theta0), 2)

    params, opt = trainer.init_params(), None
    opt = trainer.init_opt(params)
    for b in batches:
        params, opt, _ = trainer.step(params, opt, jnp.asarray(b))
    expected = to_numpy(params)

    kept = _run_one_learner("keep_in_flight", batches, theta0, fragments)
    for k in expected:
        np.testing.assert_allclose(kept[k], expected[k], atol=1e-5, err_msg=k)
    overwritten = _run_one_learner("overwrite", batches, theta0, fragments)
    worst = max(float(np.abs(overwritten[k] - expected[k]).max()) for k in expected)
    assert worst > 1e-3


@pytest.mark.slow
def test_microbatched_step_is_the_whole_batch_step():
    """Averaging the gradients of 4 slices of 2 sequences gives the update of one pass over 8."""
    batch = jnp.asarray(np.random.default_rng(1).integers(0, 50, size=(8, L + 1)).astype(np.int32))
    results = []
    for g in (1, 4):
        trainer = tiny_trainer(optax.adamw(1e-2), microbatches=g)
        params = trainer.init_params()
        opt = trainer.init_opt(params)
        losses = []
        for _ in range(3):
            params, opt, metrics = trainer.step(params, opt, batch)
            losses.append(float(metrics["loss"]))
        results.append((losses, to_numpy(params)))
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


def _turn_takers(path, procs: list[dict], timeout_s: float = 60.0) -> list[tuple]:
    """Start one spawned process per entry of ``procs`` (take_turns kwargs), all starting together;
    return the turns they took as (pid, start, end), sorted by start."""
    import multiprocessing

    from tests.turns_taker import take_turns

    ctx = multiprocessing.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    ps = [ctx.Process(target=take_turns, args=(str(path),), kwargs={"out": out, "go": go, **kw}) for kw in procs]
    for p in ps:
        p.start()
    expected = sum(0 if kw.get("die_holding") else kw["turns"] for kw in procs)
    got, ready, deadline = [], 0, time.time() + timeout_s
    while len(got) < expected and time.time() < deadline:
        item = out.get(timeout=max(0.1, deadline - time.time()))
        if item[0] == "ready":
            ready += 1
            if ready == len(ps):
                go.set()
        else:
            got.append(item)
    for p in ps:
        p.join(10)
    assert len(got) == expected, f"only {len(got)} of {expected} turns taken within {timeout_s} s"
    return sorted(got, key=lambda t: t[1])


def test_host_turns_pace_processes_first_come_and_survive_a_killed_holder(tmp_path):
    """The process engines' turns: three processes never overlap in one slot and take turns in
    arrival order (none gets more than one turn ahead of another while all are queueing), and a
    process SIGKILLed while it holds the turn does not block the others."""
    with pytest.raises(ValueError, match="slots"):
        HostTurns(tmp_path / "bad", 0)
    turns = _turn_takers(tmp_path / "fair", [dict(slots=1, turns=20, hold_s=0.01) for _ in range(3)])
    for (_, _, end), (_, start, _) in zip(turns, turns[1:]):
        assert start >= end  # one slot: never two at once
    pids, taken, lead = sorted({t[0] for t in turns}), {}, 0
    for pid, *_ in turns[: 3 * 18]:  # while all three still queue
        taken[pid] = taken.get(pid, 0) + 1
        lead = max(lead, max(taken.values()) - min(taken.get(p, 0) for p in pids))
    assert lead <= 2, f"a process got {lead} turns ahead of another"
    assert not list((tmp_path / "fair").glob("wait-*"))  # every waiter's pipe removed

    turns = _turn_takers(
        tmp_path / "dead",
        [
            dict(slots=1, turns=1, hold_s=0.01, die_holding=True),
            dict(slots=1, turns=10, hold_s=0.01),
            dict(slots=1, turns=10, hold_s=0.01),
        ],
        timeout_s=30,
    )
    assert len({t[0] for t in turns}) == 2


def test_a_learner_holds_its_turn_until_its_step_has_run():
    """JAX returns from a jitted step before it has run; a learner that released its turn then
    would compute beside the others and the turns would pace nothing (co-located learners drift,
    their fragments get superseded). Every turn must end with the step's result ready."""
    trainer = tiny_trainer()
    theta0 = to_numpy(trainer.init_params())
    fragments = balanced_fragments(tensor_bytes(theta0), 2)
    exchange = InMemoryExchange(len(fragments), token_budget=8 * B * L)
    for p, names in enumerate(fragments):
        exchange.publish(p, 0, {k: theta0[k] for k in names})
    last = {}

    def step(params, opt_state, batch):
        out = trainer.step(params, opt_state, batch)
        last["loss"] = out[2]["loss"]
        return out

    ready_at_release = []

    class CheckedTurns(FairTurns):
        def __exit__(self, *exc):
            ready_at_release.append(last["loss"].is_ready())
            super().__exit__(*exc)

    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 50, (B, L + 1), dtype=np.int32) for _ in range(8)]
    setup = _setup(trainer, exchange, batches, fragments, turns=CheckedTurns(1))
    setup.step = step
    run_learner(setup)
    assert ready_at_release == [True] * 8


class DictResumeStore:
    """Resume points kept in memory (the Orbax store is tested in a fresh process below)."""

    def __init__(self):
        self.points: list[ResumePoint] = []

    def save(self, point):
        self.points.append(point)

    def flush(self):
        """Saves are synchronous here: nothing is ever in flight."""

    def load(self, opt_template):
        return self.points[-1] if self.points else None


def test_co_located_learners_saving_resume_points_stay_in_step():
    """Resume points of co-located learners are written one at a time (Orbax is behind one lock per
    process). Saved outside the compute turn, the first learner to finish its write took the turns
    of the others while they queued on the lock, and ended a sync period ahead for good (its
    submissions then joined its peers' previous round: stale). Saved inside the turn, no learner
    gets more than one step ahead of another."""
    trainer = tiny_trainer()
    theta0 = to_numpy(trainer.init_params())
    fragments = balanced_fragments(tensor_bytes(theta0), 2)
    per_learner = 12
    exchange = InMemoryExchange(len(fragments), token_budget=2 * per_learner * B * L)
    for p, names in enumerate(fragments):
        exchange.publish(p, 0, {k: theta0[k] for k in names})
    write_lock, counts, spread = threading.Lock(), [0, 0], []

    class SlowLockedStore(DictResumeStore):
        def save(self, point):
            with write_lock:  # one write at a time, as with Orbax in one process
                time.sleep(0.15)
                super().save(point)

    def counted(m):
        def step(params, opt_state, batch):
            out = trainer.step(params, opt_state, batch)
            time.sleep(0.03)  # a step as long as the default model's on this CPU
            counts[m] += 1
            spread.append(abs(counts[0] - counts[1]))
            return out

        return step

    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 50, (B, L + 1), dtype=np.int32) for _ in range(per_learner)]
    trainer.step(trainer.init_params(), trainer.init_opt(trainer.init_params()), jnp.asarray(batches[0]))
    turns = FairTurns(1)
    setups = [
        _setup(trainer, exchange, batches, fragments, turns=turns, resume=SlowLockedStore(), resume_every=4)
        for _ in range(2)
    ]
    start = threading.Barrier(2)

    def init_together():
        start.wait()
        return trainer.init_params()

    for m, s in enumerate(setups):
        s.learner, s.step, s.init_params = m, counted(m), init_together
    threads = [threading.Thread(target=run_learner, args=(s,)) for s in setups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == [per_learner, per_learner] and max(spread) <= 1, (counts, spread)


def test_scheduled_failures_fire_in_order_one_per_attempt():
    """Two failures of one learner at steps 3 and 7, a resume point every 2 steps: attempt 1 fails
    at 3 and its retry resumes at step 2 (the last save); that fails at 7 and the third attempt resumes
    at step 6 and runs to the end of the budget, whose tokens the lost steps also spent."""
    trainer = tiny_trainer()
    theta0 = to_numpy(trainer.init_params())
    fragments = balanced_fragments(tensor_bytes(theta0), 2)
    syncer = Syncer(theta0, fragments, SyncerSettings(num_learners=1, quorum=1))
    exchange = InMemoryExchange(len(fragments), token_budget=10 * B * L)
    for p in range(len(fragments)):
        exchange.publish(p, 0, syncer.global_params[p])
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 50, (B, L + 1), dtype=np.int32) for _ in range(10)]
    store, events = DictResumeStore(), []
    failed_at = []
    for attempt in (1, 2):
        with pytest.raises(InjectedFailure, match=f"at local step {(3, 7)[attempt - 1]}"):
            run_learner(
                _setup(
                    trainer,
                    exchange,
                    batches,
                    fragments,
                    attempt=attempt,
                    resume=store,
                    resume_every=2,
                    faults=LearnerFaults((FailEvent(learner=0, at_step=3), FailEvent(learner=0, at_step=7))),
                    log=events.append,
                )
            )
        failed_at.append(exchange.learners()[0]["step"])
    out = run_learner(
        _setup(
            trainer,
            exchange,
            batches,
            fragments,
            attempt=3,
            resume=store,
            resume_every=2,
            faults=LearnerFaults((FailEvent(learner=0, at_step=3), FailEvent(learner=0, at_step=7))),
            log=events.append,
        )
    )
    starts = [e["step"] for e in events if e["event"] == "start"]
    assert failed_at == [2, 6] and starts == [0, 2, 6]
    states = [(e["state"], e["attempt"]) for e in events if e["event"] == "state"]
    assert states == [("up", 1), ("down", 1), ("restarting", 2), ("up", 2), ("down", 2)] + [
        ("restarting", 3),
        ("up", 3),
        ("done", 3),
    ]
    # Both failures come right after a save (steps 2 and 6), so nothing is redone: 2 + 4 + 4 steps
    # claim the budget of 10.
    assert out["tokens"] == exchange.claimed_tokens == 10 * B * L
    assert out["steps"] == 10 and out["steps_this_attempt"] == 4


# -- a learner from plain inputs in a fresh process ------------------------------------------------
@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    from data.prepare import prepare_data

    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        {
            "data.source": "local",
            "data.paths": [str(CORPUS)],
            "train.token_budget": 400_000,
            "diloco.resume_every_steps": 5,
        },
    )
    run_dir = tmp_path_factory.mktemp("learner-run")
    prepare_data(cfg, run_dir)
    return cfg, run_dir


@pytest.mark.process
@pytest.mark.slow
def test_learner_resumes_in_a_fresh_process_with_its_adam_moments(small_run, tmp_path):
    """The learner task's inputs pickle; a learner run from them in a fresh process is killed
    (SIGKILL) part-way; the retry, in another fresh process, resumes at the last saved step with
    exactly the saved optimizer state (moments and counts), not a fresh one."""
    from training.checkpoint import OrbaxResumeStore, latest_step
    from training.decoupled.plan import DiLoCoPlan
    from training.decoupled.setup import learner_trainer

    cfg, run_dir = small_run
    inputs = {"config": cfg, "run_dir": str(run_dir), "learner": 0}
    blob = pickle.dumps(inputs)
    assert pickle.loads(blob) == inputs
    (tmp_path / "inputs.pkl").write_bytes(blob)
    layout = RunLayout(run_dir)
    resume_dir = layout.resume_point("pretrain", "diloco", 0)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    first = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "learner_process.py"), str(tmp_path / "inputs.pkl"), "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 240
    try:
        while True:  # wait for a few resume points, then kill it mid-run
            assert first.poll() is None, first.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the learner saved no resume point in time"
            steps = [int(p.name) for p in resume_dir.iterdir() if p.name.isdigit()] if resume_dir.is_dir() else []
            if steps and max(steps) >= 15:
                break
            time.sleep(0.2)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)

    saved_step = latest_step(resume_dir)
    trainer = learner_trainer(DiLoCoPlan.of(cfg), run_dir)
    template = trainer.init_opt(trainer.init_params())
    saved = OrbaxResumeStore(resume_dir).load(template)
    assert saved.step == saved_step >= 15 and saved.step % 5 == 0
    assert tree_digest(saved.opt_state) != tree_digest(template)  # moments are not zeros

    # the retry, in another fresh process: once it has resumed and saved a later resume point it has
    # shown what this test is about (the rest of its budget would take a minute), so it is killed too
    second = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "learner_process.py"), str(tmp_path / "inputs.pkl"), "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 240
    try:
        while max((int(p.name) for p in resume_dir.iterdir() if p.name.isdigit()), default=0) < saved.step + 10:
            assert second.poll() is None, second.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the retry saved no later resume point in time"
            time.sleep(0.2)
    finally:
        second.send_signal(signal.SIGKILL)
        second.wait(30)
    starts = [e for e in read_jsonl(layout.metrics("pretrain", "diloco", "learners")) if e["event"] == "start"]
    assert [e["attempt"] for e in starts] == [1, 2]
    for e in starts:  # the start-up timeline (run clock): process, task, built, first step; no gate on threads
        assert e["process_t"] < e["task_t"] < e["ready_t"] <= e["t"] and e["gate_s"] == 0.0, e
    assert starts[0]["step"] == 0 and not starts[0]["resumed"]
    assert starts[1]["resumed"] and starts[1]["step"] == saved.step
    assert starts[1]["opt_state_digest"] == tree_digest(saved.opt_state)
    # and the restored moments are the saved ones leaf by leaf (not only a matching digest)
    mu = saved.opt_state[1][0].mu  # chain(clip, adamw): adamw's ScaleByAdamState
    assert set(mu) == set(trainer.fn.names) and any(float(np.abs(v).max()) > 0 for v in mu.values())


# -- a new model kind, registered here alone, through both loops -----------------------------------
class MLPLMConfig(BaseModel):
    kind: Literal["mlp_lm"] = "mlp_lm"
    d_model: int = 16


class MLPLM(nnx.Module):
    """A two-layer MLP LM: each token's embedding through an MLP to next-token logits (no context)."""

    def __init__(self, d: int, vocab: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.hidden = nnx.Linear(d, 2 * d, rngs=rngs)
        self.out = nnx.Linear(2 * d, vocab, rngs=rngs)

    def __call__(self, ids):
        return self.out(nnx.relu(self.hidden(self.embed(ids))))


def _mlp_objective(model, batch):
    logits = model(batch[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch[:, 1:]).mean()}


@pytest.mark.slow
def test_a_new_model_kind_trains_through_diloco_and_dp(small_run, tmp_path):
    """Registering a kind (its module, objective and builder) is all it takes: the DiLoCo learner,
    the syncer and the DP loop train it unchanged, and its extra metric reaches the learner log."""
    from data.prepare import prepare_data
    from run.atomic import write_json
    from training.decoupled.setup import learner_attempt, setup_diloco
    from training.decoupled.syncer import run_syncer_to_end
    from training.dp import train_dp

    @register("mlp_lm")
    def build(cfg, shape: InputShape) -> ModelSpec:
        def init(seed):
            return MLPLM(cfg.d_model, shape.vocab_size, nnx.Rngs(seed))

        return ModelSpec(
            kind="mlp_lm",
            config=cfg,
            init=init,
            objective=_mlp_objective,
            batch=BatchLayout("int32", (shape.seq_len + 1,), "tokens", shape.seq_len),
            params=count_params(nnx.eval_shape(lambda: init(0))),
            flops_per_unit=6.0 * 3 * cfg.d_model * shape.vocab_size,
        )

    try:
        base, _ = small_run
        cfg = base.model_copy(
            update={
                "model": MLPLMConfig(),
                "diloco": base.diloco.model_copy(
                    update={"learners": 2, "quorum": 1, "fragments": 2, "resume_every_steps": 0}
                ),
            }
        )
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"token_budget": 8192})})
        run_dir = tmp_path / "run"
        prepare_data(cfg, run_dir)

        run = setup_diloco(cfg, run_dir)
        outs = {}
        learners = [
            threading.Thread(target=lambda m=m: outs.setdefault(m, learner_attempt(cfg, run_dir, m, 1)))
            for m in range(2)
        ]
        for t in learners:
            t.start()
        syncer = threading.Thread(target=lambda: outs.setdefault("syncer", run_syncer_to_end(run)))
        syncer.start()
        for t in learners:
            t.join(300)
        run.exchange.mark_learners_done()
        syncer.join(300)
        run.close_logs()
        summary = outs["syncer"]
        assert summary["merges"] > 0 and summary["tokens"] == cfg.budget_tokens
        evals = read_jsonl(RunLayout(run_dir).metrics("pretrain", "diloco", "eval"))
        assert evals[-1]["val/loss"] < evals[0]["val/loss"]  # it learned (unigram statistics at least)
        steps = [
            e for e in read_jsonl(RunLayout(run_dir).metrics("pretrain", "diloco", "learners")) if e["event"] == "step"
        ]
        assert steps and all("train/accuracy" in e for e in steps)

        dp = train_dp(cfg, run_dir)
        write_json(RunLayout(run_dir).summary("pretrain", "dp"), dp)
        assert dp["final_val_loss"] < read_jsonl(RunLayout(run_dir).metrics("pretrain", "dp", "eval"))[0]["val/loss"]
        assert dp["params"] == summary["params"] == build(MLPLMConfig(), InputShape(512, 32)).params
        assert RunLayout(run_dir).methods("pretrain") == ["diloco", "dp"]
    finally:
        MODELS.pop("mlp_lm", None)


def test_a_cut_off_or_damaged_resume_point_lets_the_learner_start_again(tmp_path, caplog):
    """A process killed while saving leaves only ``<step>.orbax-checkpoint-tmp``; a damaged step
    fails its integrity check. Either way the retry must run (from step 0), not fail forever."""
    from training.checkpoint import OrbaxResumeStore

    trainer = tiny_trainer()
    template = trainer.init_opt(trainer.init_params())
    store = OrbaxResumeStore(tmp_path / "resume")
    assert store.load(template) is None  # nothing saved yet
    (tmp_path / "resume" / "25.orbax-checkpoint-tmp" / "opt_state").mkdir(parents=True)
    with caplog.at_level("WARNING", logger="training.checkpoint"):
        assert store.load(template) is None
    assert "starts again at step 0" in caplog.text
    store.save(ResumePoint(step=30, cursor=(0, 3), tokens=90, opt_state=template))
    assert store.load(template).step == 30
    victim = max(
        (p for p in (tmp_path / "resume" / "30").rglob("*") if p.is_file() and p.stat().st_size > 64),
        key=lambda p: p.stat().st_size,
    )
    victim.write_bytes(b"\0" * victim.stat().st_size)  # same size, other bytes: damaged
    caplog.clear()
    with caplog.at_level("WARNING", logger="training.checkpoint"):
        assert store.load(template) is None
    assert "DAMAGED" in caplog.text or "damaged" in caplog.text


def test_a_slowed_learner_idles_its_factor_outside_its_turn():
    """A slowdown event: inside the window a learner alone on its host (its turns served at once) owes
    (factor − 1) = 0.5 of a turn per inner step and, for each whole turn owed, idles one step's
    compute time (here recorded instead of slept; not after an attempt's first step, which includes
    compiling): every second step. It logs the change of pace once, and a window that has not begun
    slows nothing. (Among peers it sits those turns out instead: test_chaos.)"""
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 50, size=(B, L + 1)).astype(np.int32) for _ in range(STEPS)]
    trainer = tiny_trainer()
    theta0 = to_numpy(trainer.init_params())
    fragments = balanced_fragments(tensor_bytes(theta0), 2)
    for window, expect in (
        (SlowdownEvent(learner=0, factor=1.5), True),
        (SlowdownEvent(learner=0, factor=1.5, from_s=1e9), False),
    ):
        syncer = Syncer(
            theta0, fragments, SyncerSettings(num_learners=1, quorum=1, merge="mean", outer_lr=1.0, outer_momentum=0.0)
        )
        exchange = OneStepLateExchange(syncer, budget=STEPS * B * L)
        idled, logged = [], []
        out = run_learner(
            _setup(
                trainer,
                exchange,
                batches,
                fragments,
                turns=FairTurns(1),
                faults=LearnerFaults((window,)),
                sleep=idled.append,
                log=logged.append,
            )
        )
        assert out["steps"] == STEPS
        paces = [r for r in logged if r["event"] == "slowdown"]
        if expect:
            assert len(idled) == (STEPS - 1) // 2 and all(x > 0 for x in idled)
            assert [(r["factor"], r["step"]) for r in paces] == [(1.5, 1)]
        else:
            assert idled == [] and paces == []
