"""The one evaluation route: exact means over every real token of a list of batches.

    metrics = evaluate(engine, state, batches)                       # the trainer, `distillax eval`
    metrics, tokens = evaluate(engine, state, batches, per_token=True)  # the demo report

The trainer's evals, `distillax eval` and the demo report all call `evaluate`, so a run's
summary.json, the CLI and report.json give the same numbers for the same batches, to the last
digit. Each eval batch contributes the sums of its objective's per-token values and the number
of real (unmasked) tokens; the sums are added on the device in float32, batch by batch, and
divided once at the end. Averaging per-batch means instead would weight a half-padded batch like
a full one.

`per_token=True` also returns the student's own per-token values (-log p(target) and its top-1
token) from a second compiled function, so asking for them leaves the compiled sums, and the
means, exactly as the trainer's. A run compiles its first eval's programs while it starts
(eval_programs.compile_ahead), so that eval compiles nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from distillax.data import batch as batch_spec
from distillax.errors import UserError
from distillax.framework import backends, eval_programs, losses, token_rows
from distillax.framework.step import EVAL_RATIOS

# exp() of anything above this overflows a float64.
MAX_LOG_PERPLEXITY = math.log(1.7976931348623157e308)


def loss_and_perplexity(loss_sum: float, token_count: float) -> dict[str, float]:
  """{'loss': mean token loss, 'perplexity': exp(mean), 'tokens': count}; inf if exp overflows."""
  token_count = float(token_count)
  if not token_count > 0:
    raise UserError("evaluation saw no tokens: the validation split is empty or fully masked "
                    "(check data.source / data.eval_source and train.eval_batches)")
  loss = float(loss_sum) / token_count
  perplexity = math.exp(loss) if loss <= MAX_LOG_PERPLEXITY else math.inf
  return {"loss": loss, "perplexity": perplexity, "tokens": token_count}


@dataclasses.dataclass(frozen=True)
class PerToken:
  """The student's per-token values, one (B, L) host array per eval batch, at every position
  (padding included: mask them with the batch's loss mask)."""

  nll_BxL: list[np.ndarray]  # -log p(target), float32 (log-softmax of the float32 logits)
  top1_BxL: list[np.ndarray]  # the student's most likely next token (argmax of the logits)


def _token_values(defs, rows: int | None = None):
  """The student's per-token NLL and top-1, over the `rows` token ids its objective counts."""
  def values(state, batch):
    student, _ = defs.merge(state.params, state.frozen)
    logits_BxLxV = token_rows.masked(
        student(batch[batch_spec.INPUTS], **losses.model_inputs(batch)).logits_BxLxV, rows)
    return (losses.token_nll(logits_BxLxV, batch[batch_spec.TARGETS]),
            jnp.argmax(logits_BxLxV, axis=-1).astype(jnp.int32))
  return values


def _to_host(x: jax.Array) -> np.ndarray:
  """A global array's whole value on this host (gathered from every process when there are
  several)."""
  if jax.process_count() > 1:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def _means(totals: Mapping[str, Any], prefix: str) -> dict[str, float]:
  """The sums divided once by the real token count: `objective` is the objective's own loss,
  `loss` and `perplexity` are always of the next-token cross-entropy (for an objective whose
  loss mixes in other terms, distillation, that is its reported hard-label CE), so the two
  names never hold one figure in one job and another in the next."""
  host = dict(jax.device_get(totals))
  ratios = host.pop(EVAL_RATIOS, {})  # the objective's ratios (expert loads): sums over sums
  host = {k: float(v) for k, v in host.items()}
  tokens, loss_sum = host.pop("tokens"), host.pop("loss_sum")
  ce = loss_and_perplexity(host.get("hard_ce", loss_sum), tokens)
  out = {f"{prefix}objective": loss_sum / tokens}
  out.update({f"{prefix}{k}": v for k, v in ce.items()})
  out.update({f"{prefix}{k}": v / tokens for k, v in host.items()})
  out.update({f"{prefix}{k}": float(n) / float(d) if float(d) > 0 else 0.0
              for k, (n, d) in ratios.items()})
  return out


def evaluate(engine, state, batches: Iterable[Mapping[str, np.ndarray]], *,
             per_token: bool = False, prefix: str = "eval_"):
  """Exact means over every real token of `batches` (host numpy batches, as a recipe's
  eval_iterator yields them) of `engine`'s eval objective at `state`: {prefix + objective (the
  objective's loss), loss and perplexity (next-token CE), tokens, every metric of the
  objective}. With per_token, (those means, PerToken).
  `engine` is a framework.engine.Engine."""
  sums = eval_programs.sums_program(engine)  # compiled ahead of a run's first eval, if asked
  rows = getattr(engine.objective, "token_rows", None)  # as the eval objective counts them
  values = (eval_programs.program(engine, "per_token", _token_values(engine.layout.defs, rows))
            if per_token else None)
  gstate = engine.global_state(state)
  place = backends.global_batch_placer(engine.mesh, engine.rules)
  totals, nll, top1 = None, [], []
  for batch in batches:
    placed = place(batch)
    batch_sums = sums(gstate, placed)
    totals = batch_sums if totals is None else jax.tree.map(jnp.add, totals, batch_sums)
    if values is not None:
      nll_BxL, top1_BxL = values(gstate, placed)
      nll.append(_to_host(nll_BxL))
      top1.append(_to_host(top1_BxL))
  if totals is None:
    raise UserError("evaluation got no batches: the validation split is empty; check "
                    "data.source / data.eval_source")
  means = _means(totals, prefix)
  if engine.extra_eval is not None:
    means.update({f"{prefix}{k}": v for k, v in engine.extra_eval(engine, state).items()})
  return (means, PerToken(nll, top1)) if per_token else means
