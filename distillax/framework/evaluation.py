"""Validation loss and perplexity from (sum of token losses, token count) pairs.

Each eval batch contributes the sum of its per-token losses and the number of real (unmasked)
tokens; the mean is taken once at the end. Averaging per-batch means instead would weight a
half-padded batch like a full one.
"""

from __future__ import annotations

import math

import flax
import jax
import jax.numpy as jnp
from clu import metrics as clu_metrics

from distillax.errors import UserError
from distillax.framework.metrics import to_host_scalar

# exp() of anything above this overflows a float64.
MAX_LOG_PERPLEXITY = math.log(1.7976931348623157e308)


def loss_and_perplexity(loss_sum: float, token_count: float) -> dict[str, float]:
  """{'loss': mean token loss, 'perplexity': exp(mean), 'tokens': count}; inf if exp overflows."""
  token_count = float(token_count)
  if not token_count > 0:
    raise UserError("evaluation saw no tokens: the validation split is empty or fully masked "
                    "(check the data path and train.eval_steps)")
  loss = float(loss_sum) / token_count
  perplexity = math.exp(loss) if loss <= MAX_LOG_PERPLEXITY else math.inf
  return {"loss": loss, "perplexity": perplexity, "tokens": token_count}


@flax.struct.dataclass
class TokenLoss(clu_metrics.Metric):
  """clu metric: summed token loss and token count, merged across batches on device.

  float32 sums: the count is exact to 2**24 tokens and the mean stays within ~1e-6 beyond.
  """
  loss_sum: jax.Array
  token_count: jax.Array

  @classmethod
  def empty(cls) -> "TokenLoss":
    return cls(loss_sum=jnp.zeros((), jnp.float32), token_count=jnp.zeros((), jnp.float32))

  @classmethod
  def from_model_output(cls, loss_sum, token_count, **_) -> "TokenLoss":
    return cls(loss_sum=jnp.asarray(loss_sum, jnp.float32),
               token_count=jnp.asarray(token_count, jnp.float32))

  def merge(self, other: "TokenLoss") -> "TokenLoss":
    return type(self)(loss_sum=self.loss_sum + other.loss_sum,
                      token_count=self.token_count + other.token_count)

  def compute(self) -> jax.Array:
    return self.loss_sum / self.token_count


_merge_token_loss = jax.jit(
    lambda acc, loss_sum, count: acc.merge(TokenLoss.from_model_output(loss_sum, count)))


class EvalAccumulator:
  """Sums eval batches on device (no host sync per batch); `result()` fetches once at the end."""

  def __init__(self):
    self._total: TokenLoss | None = None
    self.num_batches = 0

  def add(self, loss_sum: jax.Array, token_count: jax.Array):
    if self._total is None:
      self._total = TokenLoss.from_model_output(loss_sum, token_count)
    else:
      self._total = _merge_token_loss(self._total, loss_sum, token_count)
    self.num_batches += 1

  def result(self, prefix: str = "eval_") -> dict[str, float]:
    """{prefix+'loss', prefix+'perplexity', prefix+'tokens'} as host floats."""
    loss_sum = count = 0.0
    if self._total is not None:
      loss_sum = to_host_scalar(self._total.loss_sum)
      count = to_host_scalar(self._total.token_count)
    values = loss_and_perplexity(loss_sum, count)
    return {f"{prefix}{name}": value for name, value in values.items()}
