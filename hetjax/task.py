"""What hetjax needs from a model: an init and a per-example loss.

Per-example losses (not a mean) are the whole trick: the step masks them and
sums, so hosts with different batch sizes are reconciled exactly by
`sum(grad sums) / sum(counts)`. A batch is one *block* of the global batch
(DESIGN invariant 2) plus the float32 padding mask under the reserved key
`MASK` (a `from_linen` / `from_nnx` module gets it only through `mask_arg`);
padding rows repeat a real row, so a loss is finite on them. `rng` is the
block's key, `fold_in(fold_in(key(seed), step), block)`: dropout belongs to
the block's examples, never to the host or device that runs it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import threading
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from hetjax import fast_variance
from hetjax.types import Batch, PyTree
MASK = "hetjax.mask"  # Reserved batch key of the padding mask; no dataset may use it.
RESERVED_METRICS = ("loss", "count")
NNX_MODELS = threading.local()  # .edit: a step's edit of each model a from_nnx loss merges.


class Weighted(NamedTuple):
  """Per-example losses with per-example weights (return it instead of `losses`).

  The update (and the metrics) then divide by `sum(weights)` over the global
  batch: a language model averages over tokens exactly across uneven hosts.

  Args:
    values: `[b]` summed losses per example.
    weights: `[b]` weight of each example (e.g. its token count).

  Example:
    >>> def per_example_loss(params, batch, rng):   # tokens [b, t], mask [b, t]
    ...   losses = (params["w"] * batch["tokens"]) ** 2 * batch["mask"]
    ...   return hetjax.Weighted(losses.sum(1), batch["mask"].sum(1)), {}
    >>> task = hetjax.from_functions(lambda rng, b: {"w": jnp.ones(())}, per_example_loss)
  """

  values: jax.Array
  weights: jax.Array


# (losses [b] or Weighted([b], [b]), metrics {name: [b]}, new model state)
LossOutput = tuple[Any, dict[str, jax.Array], PyTree]
LossFn = Callable[[PyTree, PyTree, Batch, jax.Array], LossOutput]


@dataclasses.dataclass(frozen=True)
class Task:
  """A model as hetjax trains it (usually made by `from_functions`, `from_linen` or `from_nnx`).

  Args:
    init: `init(rng, example_batch) -> (params, model_state)`; `model_state`
      (e.g. BatchNorm statistics, `{}` if none) is averaged over a step's
      blocks, weighted by their real examples.
    loss: `loss(params, model_state, batch, rng) -> (losses, metrics,
      new_model_state)`, `losses` and every metric of shape `[b]` (or a `Weighted`).
    eval_loss: the same in inference mode; `None`: `loss`.
    unmasked_loss: `loss` without the mask's work, for blocks all real (plain
      BatchNorm: 118 fewer kernels in resnet18); `None`: `loss` serves every block.
    fast_variance_layers: the NNX norm layers (by path) with Flax's fast variance.
    sees_mask: whether the model sees the padding mask; one that does not and
      keeps state is refused where a block can be partial.

  Example:
    >>> def init(rng, batch):
    ...   return {"w": jnp.zeros(batch["x"].shape[1:])}, {}   # (params, model state)
    >>> def loss(params, model_state, batch, rng):
    ...   losses = (batch["x"] @ params["w"] - batch["y"]) ** 2  # one per example
    ...   return losses, {"abs_error": jnp.sqrt(losses)}, model_state
    >>> task = hetjax.Task(init, loss)
  """

  init: Callable[[jax.Array, Batch], tuple[PyTree, PyTree]]
  loss: LossFn
  eval_loss: LossFn | None = None
  unmasked_loss: LossFn | None = None
  fast_variance_layers: tuple[str, ...] = ()
  sees_mask: bool = True

  def evaluation_loss(self) -> LossFn:
    """The loss to evaluate with: `eval_loss` when given, else `loss`."""
    return self.eval_loss or self.loss

  def training_loss(self, blocks_full: bool) -> LossFn:
    """The loss for training blocks; `blocks_full`: no block that counts holds padding."""
    return self.unmasked_loss if (blocks_full and self.unmasked_loss) else self.loss


def split_losses(losses: Any) -> tuple[jax.Array, jax.Array | None]:
  """`(values, weights)` of a loss output; `weights` is None for plain losses."""
  return tuple(losses) if isinstance(losses, Weighted) else (losses, None)


def check_contract(loss: LossFn, params: PyTree, model_state: PyTree, batch: Batch,
                   rng: jax.Array, *, what: str = "the task's loss") -> None:
  """Checks a loss against the contract with `jax.eval_shape` (nothing runs): raises
  ValueError for a loss or metric not of shape `[b]`, a metric named like hetjax's own, or
  a new model state of another structure."""
  b = len(batch[MASK])
  losses, metrics, new_state = jax.eval_shape(loss, params, model_state, batch, rng)
  values, weights = split_losses(losses)
  fix = ("return per-example values of shape [b] (one per example, e.g. `-log p(y|x)` per "
         "row), not a mean over the batch: hetjax sums them over the real examples of every "
         "host and divides by the global count itself")
  for name, value in (("losses", values), ("weights", weights)):
    if value is not None and tuple(value.shape) != (b,):
      raise ValueError(f"{what} returned {name} of shape {tuple(value.shape)} for a block of "
                       f"{b} examples; {fix}.")
  if not isinstance(metrics, dict):
    raise ValueError(f"{what} returned metrics of type {type(metrics).__name__}; return a dict "
                     "of per-example arrays (may be empty).")
  for name, value in metrics.items():
    if name in RESERVED_METRICS:
      raise ValueError(f"{what} returns a metric named {name!r}, which hetjax reports itself "
                       f"(the mean loss and the example count); rename it, e.g. "
                       f"'{name}_{'model' if name == 'loss' else 'user'}'.")
    if tuple(value.shape) != (b,):
      raise ValueError(f"{what} returned metric {name!r} of shape {tuple(value.shape)} for a "
                       f"block of {b} examples; {fix}.")
  if jax.tree.structure(new_state) != jax.tree.structure(model_state):
    raise ValueError(f"{what} returned a model state whose structure differs from the one "
                     f"init made: {jax.tree.structure(new_state)} vs "
                     f"{jax.tree.structure(model_state)}; return the same collections.")


def check_partial_blocks(task: Task, model_state: PyTree, batch: int, block: int) -> None:
  """Refuses, before compiling, batch statistics (of a model never shown the mask) that
  would count a partial block's padding rows."""
  if task.sees_mask or batch % block == 0 or not jax.tree.leaves(model_state):
    return
  real = batch % block
  raise ValueError(
      f"the batch of {batch} examples is not a whole number of blocks of {block} (the microbatch): "
      f"its last block holds {real} real examples and {block - real} padding rows, and the model "
      f"keeps batch statistics ({', '.join(map(str, model_state))}) but is never shown hetjax's "
      f"padding mask, so they would count the padding. Pass mask_arg='mask' to from_linen / "
      f"from_nnx, with a `mask=None` argument of __call__ handed to BatchNorm (`nn.BatchNorm(...)"
      f"(x, mask=mask[:, None] > 0)`), or make the batch a multiple of {block}.")


def check_batch_keys(keys: Sequence[str]) -> None:
  """A dataset feature may not use hetjax's reserved mask key."""
  if MASK in keys:
    raise ValueError(f"the dataset has a feature named {MASK!r}, the key hetjax reserves for "
                     "its padding mask; rename the feature.")


_LOSS_FORMS = {2: "per_example_loss(outputs, batch)", 3: "per_example_loss(params, batch, rng)"}


def _binds(signature: inspect.Signature, n: int) -> bool:
  try:
    signature.bind(*([None] * n))
    return True
  except TypeError:
    return False


def _check_loss_form(per_example_loss: Callable, adapter: str) -> None:
  """Refuses, when the task is built, a loss written for the other adapter (else: a bare
  TypeError at the first trace)."""
  n = 3 if adapter == "from_functions" else 2
  try:
    signature = inspect.signature(per_example_loss)
  except (TypeError, ValueError):
    return  # A builtin or C function: nothing to read, trust the caller.
  if not _binds(signature, n):
    other = "from_linen or from_nnx" if n == 3 else "from_functions"
    hint = (f"; it looks written for {other}, which calls {_LOSS_FORMS[5 - n]}"
            if _binds(signature, 5 - n) else "")
    raise ValueError(f"{adapter} calls {_LOSS_FORMS[n]}, but the loss given takes {signature}"
                     f"{hint}. Change its arguments to ({_LOSS_FORMS[n].split('(')[1]}, or use "
                     f"{other}.")


def from_functions(init: Callable[[jax.Array, Batch], PyTree],
                   per_example_loss: Callable[[PyTree, Batch, jax.Array],
                                              tuple[Any, dict[str, jax.Array]]]) -> Task:
  """Builds a stateless `Task` from plain functions.

  Args:
    init: `init(rng, example_batch) -> params`.
    per_example_loss: `per_example_loss(params, batch, rng) -> (losses[b] or a
      Weighted, metrics {name: [b]})`.

  Returns:
    The `Task` (its model state an empty dict).

  Example:
    >>> task = hetjax.from_functions(lambda rng, b: {"w": jnp.zeros(3)},
    ...     lambda p, b, rng: (((b["x"] @ p["w"]) - b["y"]) ** 2, {}))
  """
  _check_loss_form(per_example_loss, "from_functions")

  def _init(rng, batch):
    return init(rng, batch), {}

  def _loss(params, state, batch, rng):
    losses, metrics = per_example_loss(params, batch, rng)
    return losses, dict(metrics), state

  return Task(_init, _loss)


_MODE_ARGS = {"train": True, "training": True, "deterministic": False}  # name -> value in training


def _check_arguments(fn: Callable, mask_arg: str | None, call_args: dict[str, str],
                     what: str) -> tuple[list[str], bool]:
  """Checks that `fn` takes `mask_arg` and `call_args`: (the mode arguments it names,
  whether `mask_arg` may be left out)."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return [], False  # Nothing to read: pass the mask always.
  takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
  for name, kind in [(mask_arg, "mask_arg"), *((a, "call_args") for a in call_args)]:
    if name is not None and name not in params and not takes_any:
      raise ValueError(f"{kind} names {name!r}, but {what}.__call__ takes "
                       f"{inspect.signature(fn)}; name one of its arguments, or add "
                       f"`{name}=None` to it.")
  param = params.get(mask_arg) if mask_arg else None
  return ([n for n in _MODE_ARGS if n in params],
          param is not None and param.default is not inspect.Parameter.empty)


_MISSING_RNG = re.compile(r'needs PRNG for "([^"]+)"')


# per_example_loss(outputs, batch) -> (losses[b] or Weighted, metrics) of from_linen / from_nnx.
OutputsLoss = Callable[[jax.Array, Batch], tuple[Any, dict[str, jax.Array]]]


def from_linen(module: Any, per_example_loss: OutputsLoss, *, input_key: str = "x",
               call_args: dict[str, str] | None = None, mask_arg: str | None = None,
               state_collections: Sequence[str] = ("batch_stats",),
               rng_streams: Sequence[str] | None = None) -> Task:
  """Wraps a Flax linen module as people write them.

  Called as `module(batch[input_key], <mode>=..., **call_args)`, the mode
  whichever of `train`, `training`, `deterministic` `__call__` names. The
  padding mask arrives only through `mask_arg`, so a module's own `mask=`
  keeps its meaning. Every rng stream the module asks for gets a key from the
  block's key. Collections other than `state_collections` are dropped.

  Args:
    module: a `flax.linen.Module`.
    per_example_loss: `per_example_loss(outputs, batch) -> (losses[b], metrics)`;
      `losses` may be a `Weighted`.
    input_key: which batch entry feeds the module.
    call_args: `{argument of __call__: batch key}` passed on every call, e.g.
      `{"mask": "x_mask"}` hands a token padding mask `[b, T]` to `mask=`.
    mask_arg: the `__call__` argument that gets the padding mask (float `[b]`)
      in training, for BatchNorm statistics that ignore padding; None: never.
    state_collections: the collections that are model state (averaged over blocks).
    rng_streams: the module's rng streams in training; None: found when first traced.

  Returns:
    The `Task`.

  Example:
    >>> import flax.linen as nn
    >>> task = hetjax.from_linen(nn.Dense(10), lambda logits, b: (
    ...     optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]), {}))
  """
  _check_loss_form(per_example_loss, "from_linen")
  call_args = dict(call_args or {})
  modes, optional_mask = _check_arguments(module.__call__, mask_arg, call_args,
                                          type(module).__name__)
  streams = None if rng_streams is None else tuple(rng_streams)

  def kwargs(batch, train, masked=True):
    kw = {n: (_MODE_ARGS[n] if train else not _MODE_ARGS[n]) for n in modes}
    kw.update({arg: batch[key] for arg, key in call_args.items()})
    if mask_arg and train and masked:
      kw[mask_arg] = batch[MASK] if MASK in batch else None
    return kw

  def init(rng, batch):
    params_rng, dropout_rng = jax.random.split(rng)
    variables = dict(module.init({"params": params_rng, "dropout": dropout_rng},
                                 batch[input_key], **kwargs(batch, False)))
    params = variables.pop("params")
    return params, {c: variables[c] for c in state_collections if c in variables}

  def apply(params, state, batch, rng, train, rngs, masked=True):
    mutable = list(state) if (train and state) else False
    keys = {name: jax.random.fold_in(rng, i) for i, name in enumerate(rngs)}
    return module.apply({"params": params, **state}, batch[input_key], rngs=keys,
                        mutable=mutable, **kwargs(batch, train, masked))

  def find_streams(params, state, batch, rng):
    """Asks the module itself which rng streams it draws from in training."""
    found: list[str] = []
    while True:
      try:
        jax.eval_shape(lambda p, s, b, r: apply(p, s, b, r, True, found), params, state, batch, rng)
        return tuple(found)
      except Exception as e:  # flax.errors.InvalidRngError, possibly wrapped by tracing.
        match = _MISSING_RNG.search(str(e))
        if match is None or match.group(1) in found:
          raise
        found.append(match.group(1))

  def make_loss(train, masked=True):
    def loss(params, state, batch, rng):
      nonlocal streams
      if train and streams is None:
        streams = find_streams(params, state, batch, rng)
      outputs = apply(params, state, batch, rng, train, streams if train else (), masked)
      if train and state:
        outputs, new_state = outputs
        new_state = {**state, **{c: new_state[c] for c in state if c in new_state}}
      else:
        new_state = state
      losses, metrics = per_example_loss(outputs, batch)
      return losses, dict(metrics), new_state
    return loss

  return Task(init, make_loss(True), make_loss(False),
              make_loss(True, masked=False) if optional_mask else None,
              sees_mask=mask_arg is not None)


def from_nnx(model: Any, per_example_loss: OutputsLoss, *, input_key: str = "x",
             call_args: dict[str, str] | None = None, mask_arg: str | None = None) -> Task:
  """Wraps a Flax NNX module that the caller has already built.

  `init` returns the module's current parameters. `nnx.Param`s are trained;
  RNG variables are reseeded from the block's key at every call; every other
  variable (BatchNorm statistics) is model state. Training calls
  `model.train()`, evaluation `model.eval()`.

  Args:
    model: a built `flax.nnx.Module`.
    per_example_loss: `per_example_loss(outputs, batch) -> (losses[b], metrics)`.
    input_key: which batch entry feeds the module.
    call_args, mask_arg: as for `from_linen`.

  Returns:
    The `Task`.

  Example:
    >>> from flax import nnx
    >>> task = hetjax.from_nnx(nnx.Linear(64, 10, rngs=nnx.Rngs(0)), lambda logits, b: (
    ...     optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]), {}))
  """
  from flax import nnx  # Only NNX users pay for the import.

  _check_loss_form(per_example_loss, "from_nnx")
  graphdef, params, rng_state, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
  streams = sorted({v.tag for _, v in nnx.to_flat_state(rng_state) if isinstance(v, nnx.RngKey)})
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  call_args = dict(call_args or {})
  _, optional_mask = _check_arguments(model.__call__, mask_arg, call_args, type(model).__name__)

  def init(rng, batch):
    del rng, batch
    return jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, rest)

  def make_loss(train, masked=True):
    def loss(p, state, batch, rng):
      # Fresh variables of this trace (tree.map rebuilds them): NNX refuses to
      # mutate, from inside a trace, variables that were made outside it.
      _, *fresh = nnx.split(model, nnx.Param, nnx.RngState, ...)
      fresh_params, fresh_rng, fresh_rest = (jax.tree.map(jnp.asarray, x) for x in fresh)
      nnx.replace_by_pure_dict(fresh_params, p)
      nnx.replace_by_pure_dict(fresh_rest, state)
      m = nnx.merge(graphdef, fresh_params, fresh_rng, fresh_rest)
      if streams:
        nnx.reseed(m, **{s: jax.random.fold_in(rng, i) for i, s in enumerate(streams)})
      m.train() if train else m.eval()
      m = (getattr(NNX_MODELS, "edit", None) or (lambda m: m))(m)
      kw = {arg: batch[key] for arg, key in call_args.items()}
      if mask_arg and train and masked and MASK in batch:
        kw[mask_arg] = batch[MASK]
      outputs = m(batch[input_key], **kw)
      new_state = nnx.to_pure_dict(nnx.state(m, nnx.Not(nnx.Any(nnx.Param, nnx.RngState))))
      losses, metrics = per_example_loss(outputs, batch)
      return losses, dict(metrics), (new_state if train else state)
    return loss

  return Task(init, make_loss(True), make_loss(False),
              make_loss(True, masked=False) if optional_mask else None,
              fast_variance_layers=fast_variance.nnx_layers(model), sees_mask=mask_arg is not None)
