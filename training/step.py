"""One pure train step for every model kind and method, built from an objective and an Optax optimizer.

``step(params, opt_state, batch) -> (params, opt_state, metrics)``: flat parameters in, flat
parameters out (``training.functional``), jitted once per (model, optimizer, microbatch count), the
input parameter and optimizer buffers donated to the output. ``metrics`` holds ``loss`` plus whatever
the objective reports (an MoE auxiliary loss, an accuracy), as device scalars: reading them
(``float``) waits for the step, so loops read them only when they log.

A batch is one array ``[B, ...]`` or a pytree of them sharing the leading B (e.g. images and labels).

Devices (``training.mesh``): by default the step runs on the process's default device, as plain
``jax.jit``. Given one other device, its inputs are placed there first. Given D > 1 devices, it is
data-parallel over a one-axis mesh: parameters, optimizer state and metrics replicated on every
device, the batch's rows split into D blocks (one per device), the gradient averaged by XLA (the
jitted step declares those input and output shardings); host numpy, uncommitted arrays and arrays
committed elsewhere are placed (copied) onto the mesh before the call.

Shape legend: B rows per step, G microbatches (gradient accumulation), B/G rows per microbatch,
D devices (B/D rows of each batch per device, in G microbatches of B/(G·D) rows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from configs.runtime import PrecisionConfig
from models.spec import ModelSpec
from training.functional import Functional
from training.mesh import (
    BATCH,
    batch_mesh,
    batch_sharding,
    device_sharding,
    place,
    replicated,
    single_default,
)
from training.precision import cast_floating, dtypes, set_compute_dtype, wrap_optimizer
from training.xla import configure_host

Params = dict[str, jax.Array]
TARGETS = "targets"  # the eval step's count of a batch's targets (make_eval_step), not a metric
StepFn = Callable[[Params, optax.OptState, Any], tuple[Params, optax.OptState, dict[str, jax.Array]]]


def _loss_and_grad(fn: Functional, objective, compute_dtype=None):
    def loss_of(params, frozen, batch):
        # the cast is inside the differentiated function: the gradient comes back in the params' dtype
        module = fn.module(cast_floating({**frozen, **params}, compute_dtype))
        loss, metrics = objective(module, batch)
        return loss.astype(jnp.float32), dict(metrics)

    return jax.value_and_grad(loss_of, has_aux=True)


def _microbatches(a: jax.Array, G: int) -> jax.Array:
    """One batch leaf ``[B, ...]`` (or a device's rows of it) → ``[G, B/G, ...]``: microbatch g is
    rows ``[g·B/G, (g+1)·B/G)`` (traced; B divisible by G)."""
    return a.reshape(G, a.shape[0] // G, *a.shape[1:])


def _leading_rows(tree) -> int:
    return int(np.shape(jax.tree.leaves(tree)[0])[0])


def make_train_step(
    fn: Functional,
    objective,
    tx: optax.GradientTransformation,
    microbatches: int = 1,
    devices: Sequence[jax.Device] | None = None,
    compute_dtype=None,
    targets: Callable[[Any], jax.Array] | None = None,
) -> StepFn:
    """The jitted inner step: forward and backward over the batch, one optimizer update.

    ``microbatches`` (G) > 1 runs forward and backward on B / G rows at a time (a ``lax.scan``) and
    combines them before the single update as the whole batch would: with ``targets``
    (``ModelSpec.count_targets``: the number n_g of targets in microbatch g, e.g. its response
    tokens), the float32 sums ``Σ_g n_g·loss_g`` and ``Σ_g n_g·∇loss_g`` (each microbatch's loss is
    the mean over its own targets, so ``n_g·loss_g`` is its summed loss) are divided once by
    ``N = Σ_g n_g``: the loss, gradient and metrics are the means over every target of the batch,
    not means of per-microbatch means, however the targets spread over the rows (masked or padded
    batches). Without ``targets`` every microbatch weighs 1/G (right when every row holds the same
    number of targets). Either way the same update as one pass over the whole batch, up to float32
    summation order, with smaller activations (an MoE model's auxiliary losses, which are not means
    over targets, are weighted by their microbatch's share of the targets). A batch with N = 0 gets
    a zero gradient (the loops refuse or skip such batches before the step: ``training.finetune``).
    B must be divisible by G (``ValueError`` at trace).
    Returns ``(params, opt_state, metrics)``: ``metrics`` holds ``loss`` (float32), the objective's
    metrics and ``grad_norm`` (the global L2 norm of the batch's gradient before clipping, float32).
    The parameter and optimizer-state arguments are donated: do not use them after the call.
    ``frozen`` (optional, flat): parameters the module needs that are not trained (LoRA's base
    weights, ``training.finetune``): read, never differentiated, updated or donated; ``params`` and
    ``frozen`` together name every parameter.

    ``devices``: where the step runs. None, or only the default device: plain ``jax.jit`` (inputs
    stay where they are). One other device: the inputs are placed on it first. D > 1 devices: data
    parallel over ``training.mesh.batch_mesh(devices)``, jitted with input and output shardings
    (params, opt state, frozen and metrics replicated, the batch split by rows); every output is
    replicated on the D devices. B must then be divisible by D (``ValueError`` before the call), and
    with microbatches by G·D (``ValueError`` at trace): each device takes its B/D rows in G
    microbatches of B/(G·D) rows (``jax.shard_map``) and sums their gradients, losses and metrics,
    and the sums are all-reduced once a step (an all-reduce per microbatch would move G times the
    gradient's bytes: across hosts, ``training.dp_job``, that is what the links carry). The result
    equals the one-device step's up to float32 summation order; the compiled step's only collective
    is that all-reduce (the attribute ``jitted`` of the returned function is the jitted step, to inspect).

    ``compute_dtype`` (``training.precision``; None: the parameters' own): the parameters are cast
    to it inside the differentiated function, so the forward and backward passes run in it and the
    gradients come back in the parameters' dtype. The loss is float32, and gradients accumulated
    over microbatches are summed in float32.

    Building a step applies :func:`training.xla.configure_host` (process-wide malloc settings that
    keep each call's temporary buffers mapped for the next).
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be ≥ 1, got {microbatches}")
    configure_host()  # malloc keeps the step's buffers between calls (training/xla.py)
    grad_fn = _loss_and_grad(fn, objective, compute_dtype)
    mesh = batch_mesh(devices) if devices is not None and len(devices) > 1 else None
    D = mesh.size if mesh is not None else 1

    def device_sums(params, frozen, rows):
        """This device's rows in G microbatches, summed over every device: one all-reduce a step."""
        local = jax.tree.map(lambda a: _microbatches(a, microbatches), rows)
        return jax.lax.psum(_microbatch_sums(grad_fn, targets, params, frozen, local), BATCH)

    def step(params: Params, opt_state, batch, frozen: Params | None = None):
        frozen = frozen or {}
        if microbatches == 1:
            (loss, metrics), grads = grad_fn(params, frozen, batch)
        else:
            _check_microbatch_rows(jax.tree.leaves(batch)[0].shape[0], microbatches, D)
            if mesh is None:
                local = jax.tree.map(lambda a: _microbatches(a, microbatches), batch)
                out = _microbatch_sums(grad_fn, targets, params, frozen, local)
            else:  # each device accumulates its own rows' microbatches; the sums are all-reduced once
                spec = (PartitionSpec(), PartitionSpec(), PartitionSpec(BATCH))
                # (check_vma off: the model's custom VJPs do not carry varying-axis types)
                out = jax.shard_map(device_sums, mesh=mesh, in_specs=spec, out_specs=PartitionSpec(), check_vma=False)(
                    params, frozen, batch
                )
            loss, metrics, grads = _target_means(*out)
        grad_norm = optax.global_norm(grads)  # the whole batch's gradient, before any clipping
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, **metrics, "grad_norm": grad_norm}

    return _jit_step(step, mesh, devices)


def _microbatch_sums(grad_fn, targets, params, frozen, slices_GB):
    """Over microbatches ``[G, b, ...]``: Σ n·∇loss (float32), Σ n·loss, Σ n·metric and Σ n."""

    def body(acc, mb):
        (loss, metrics), grads = grad_fn(params, frozen, mb)
        n = jnp.float32(1.0) if targets is None else jnp.asarray(targets(mb), jnp.float32)
        # the microbatch's summed gradient n·∇loss (loss is its mean over its n targets)
        return jax.tree.map(lambda a, g: a + n * g.astype(a.dtype), acc, grads), (loss, metrics, n)

    # float32 sums (bfloat16 parameters would otherwise accumulate in bfloat16)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params)
    total, (losses_G, metrics_G, n_G) = jax.lax.scan(body, zeros, slices_GB)
    return total, jnp.sum(n_G * losses_G), jax.tree.map(lambda m: jnp.sum(n_G * m), metrics_G), n_G.sum()


def _check_microbatch_rows(B: int, microbatches: int, D: int) -> None:
    """``ValueError`` (at trace) unless B rows split into G microbatches of equal rows on each of D devices."""
    if B % microbatches:
        raise ValueError(f"batch of {B} rows is not divisible into {microbatches} microbatches")
    if B % (microbatches * D):
        raise ValueError(
            f"batch of {B} rows is not divisible into {microbatches} microbatches of "
            f"equal rows on each of {D} devices (B must be a multiple of {microbatches * D})"
        )


def _target_means(total, loss_sum, metric_sums, N):
    """The summed loss, metrics and gradient divided once by every target N (zero where N = 0)."""
    inv = jnp.where(N > 0, 1.0 / jnp.maximum(N, 1e-30), 0.0)  # divided once by every target
    loss = loss_sum * inv
    metrics = jax.tree.map(lambda m: m * inv, metric_sums)
    grads = jax.tree.map(lambda g: g * inv, total)
    return loss, metrics, grads


def _jit_step(step, mesh, devices) -> StepFn:
    """``step`` jitted (params and opt state donated): on one device, or data parallel over ``mesh``."""
    if mesh is None:  # one device: commit the inputs to it, the step follows (a mix of committed and
        # uncommitted inputs would compile the step again: after a resume, after each pull)
        jitted = jax.jit(step, donate_argnums=(0, 1))
        on = device_sharding(jax.devices()[0] if single_default(devices) else devices[0])

        def on_device(params, opt_state, batch, frozen=None):
            return jitted(place(params, on), place(opt_state, on), place(batch, on), place(frozen, on))

        return on_device

    D = mesh.size
    rep, rows = replicated(mesh), batch_sharding(mesh)
    jitted = jax.jit(step, in_shardings=(rep, rep, rows, rep), out_shardings=(rep, rep, rep), donate_argnums=(0, 1))

    def data_parallel(params, opt_state, batch, frozen=None):
        B = _leading_rows(batch)
        if B % D:
            raise ValueError(f"batch of {B} rows cannot be split evenly over {D} devices; use a multiple of {D} rows")
        return jitted(place(params, rep), place(opt_state, rep), place(batch, rows), place(frozen or {}, rep))

    data_parallel.jitted = jitted  # the jitted step itself, to inspect (``.lower(...).compile()``)
    return data_parallel


def make_eval_step(
    fn: Functional,
    objective,
    heldout: str = "loss",
    devices: Sequence[jax.Device] | None = None,
    compute_dtype=None,
    targets: Callable[[Any], jax.Array] | None = None,
) -> Callable[[Params, Any], dict[str, jax.Array]]:
    """Jitted ``(params, batch, frozen=None) -> {"loss": …, "objective": …, **metrics}`` without an update
    (nothing donated). ``loss`` is the metric named ``heldout`` (the objective's value by default;
    an MoE model's cross entropy without its auxiliary losses); ``objective`` the value minimised.
    A ``heldout`` the objective does not report raises ``KeyError`` at trace time. With ``targets``
    (as in :func:`make_train_step`) the output also holds ``TARGETS`` (the batch's number of
    targets, float32), by which ``training.evaluation.heldout_metrics`` weighs the batch.

    ``devices`` as in :func:`make_train_step`; with D > 1 the batch's rows are split over the
    devices when B is divisible by D, else every device evaluates the whole batch (a second
    compiled variant; the same numbers); the metrics are replicated. ``compute_dtype`` as in
    :func:`make_train_step` (the parameters are cast to it first)."""
    configure_host()

    def evaluate(params, batch, frozen=None):
        loss, metrics = objective(fn.module(cast_floating({**(frozen or {}), **params}, compute_dtype)), batch)
        out = {**metrics, "objective": loss}
        out["loss"] = loss if heldout == "loss" else metrics[heldout]
        if targets is not None:
            out[TARGETS] = jnp.asarray(targets(batch), jnp.float32)
        return out

    if single_default(devices):
        return jax.jit(evaluate)
    if len(devices) == 1:
        jitted = jax.jit(evaluate)
        on = device_sharding(devices[0])
        return lambda params, batch, frozen=None: jitted(place(params, on), place(batch, on), place(frozen, on))

    mesh = batch_mesh(devices)
    rep, rows = replicated(mesh), batch_sharding(mesh)
    split = jax.jit(evaluate, in_shardings=(rep, rows, rep), out_shardings=rep)
    whole = jax.jit(evaluate, in_shardings=(rep, rep, rep), out_shardings=rep)

    def data_parallel(params, batch, frozen=None):
        if _leading_rows(batch) % mesh.size == 0:
            return split(place(params, rep), place(batch, rows), place(frozen or {}, rep))
        return whole(place(params, rep), place(batch, rep), place(frozen or {}, rep))

    return data_parallel


class Trainer:
    """A model spec bound to one optimizer: the compiled step, the eval step and fresh states.

    ``spec``: the model (``models.build_model``). ``tx``: the inner optimizer. ``microbatches``: G.
    ``devices``: where the steps run (:func:`make_train_step`); None = the default device, as always.
    ``init_params()`` returns fresh flat parameters (the model's initialisation for ``seed``), and
    ``init_opt(params)`` a fresh optimizer state, both placed where the step runs (replicated over
    the devices when there are several).

    ``precision`` (``configs.runtime.PrecisionConfig``; None: all float32): the parameters are kept in
    its ``params`` dtype (initialised in float32, then cast), both steps compute in ``compute``, and
    ``tx``'s state is kept in ``opt_state`` (``self.tx`` is the wrapped optimizer).
    """

    def __init__(
        self,
        spec: ModelSpec,
        tx: optax.GradientTransformation,
        microbatches: int = 1,
        seed: int = 0,
        devices: Sequence[jax.Device] | None = None,
        precision: PrecisionConfig | None = None,
    ):
        self.precision = precision or PrecisionConfig()
        self.dtypes = dtypes(self.precision)  # None: all float32, nothing cast
        compute = None if self.dtypes is None else self.dtypes.compute
        self.spec, self.tx, self.microbatches = spec, wrap_optimizer(tx, self.precision), microbatches
        model = spec.init(seed)
        set_compute_dtype(model, compute)
        self.fn, params0 = Functional.of(model)
        self._params0 = params0 if self.dtypes is None else cast_floating(params0, self.dtypes.params)
        self.seed = seed
        self.devices: tuple[jax.Device, ...] | None = None if single_default(devices) else tuple(devices)
        self.step = make_train_step(
            self.fn, spec.objective, self.tx, microbatches, self.devices, compute, spec.count_targets
        )
        self.evaluate = make_eval_step(self.fn, spec.objective, spec.heldout, self.devices, compute, spec.count_targets)
        if self.devices is None:
            self._placement = None
        elif len(self.devices) == 1:
            self._placement = device_sharding(self.devices[0])
        else:
            self._placement = replicated(batch_mesh(self.devices))

    @property
    def param_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Name → shape and dtype of every parameter (no copy)."""
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self._params0.items()}

    def init_params(self) -> Params:
        """Fresh copies of the initial parameters (the step donates its inputs)."""
        fresh = {k: jnp.array(v, copy=True) for k, v in self._params0.items()}
        # Copied before placing: jax.device_put(v, replicated, may_alias=False) still shares v's
        # buffer as the replica on v's own device (jax 0.10.2), and the step would delete it.
        return fresh if self._placement is None else place(fresh, self._placement)

    def init_opt(self, params: Mapping[str, jax.Array]):
        """A fresh optimizer state for ``params``, placed like the parameters."""
        state = self.tx.init(dict(params))
        return state if self._placement is None else place(state, self._placement)
