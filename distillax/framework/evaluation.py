"""Validation loss and perplexity from (sum of token losses, token count) pairs.

Each eval batch contributes the sum of its per-token losses and the number of real (unmasked)
tokens; the mean is taken once at the end. Averaging per-batch means instead would weight a
half-padded batch like a full one.
"""

from __future__ import annotations

import math

from distillax.errors import UserError

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
