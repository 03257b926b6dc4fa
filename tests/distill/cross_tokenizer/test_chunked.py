"""The cross-tokenizer objective through the vocabulary-chunk engine equals the whole-logit one:
loss, each term and the student's gradients, on rows of two different BPEs (512 and 1024 ids:
exact, span and ULD groups all present)."""

import jax
import numpy as np
import pytest
from flax import nnx

from distillax.configs import distill_cross_tokenizer
from distillax.data.cross_tokenizer.alignment import EXACT, SPAN
from distillax.distill.cross_tokenizer.objective import make_cross_tokenizer_objective
from distillax.partitioning import create_mesh
from distillax.trainers import recipe_for


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_chunked_equals_whole_in_loss_and_gradients():
  c = distill_cross_tokenizer.get_config("tiny")
  c.train.batch_size, c.train.seq_len = 2, 32
  recipe = recipe_for(c, mesh=create_mesh(c.mesh, devices=jax.devices()[:1]))
  student, extras = recipe.build(abstract=False)
  batch = {k: jax.device_put(v) for k, v in next(recipe.train_iterator()).items()}
  kinds = np.asarray(batch["group_kind_BxG"])
  assert (kinds == EXACT).sum() > 5 and (kinds == SPAN).sum() > 2, kinds
  settings = dict(temperature=1.5, alpha=0.6, exact_weight=1.0, span_weight=0.7, uld_weight=0.5)

  def run(chunk_size):
    objective = make_cross_tokenizer_objective(*recipe.shared_ids, chunk_size=chunk_size,
                                               **settings)

    def loss(student, extras, batch):  # per token, as the step divides it
      out = objective(student, extras, batch, None)
      return out.loss_sum / out.tokens, out.sums
    return nnx.jit(nnx.value_and_grad(loss, has_aux=True))(student, extras, batch)

  (whole, whole_sums), whole_grads = run(None)
  (chunked, chunked_sums), chunked_grads = run(7)  # 7 tokens: chunks of 3 positions x 2 rows
  assert abs(float(chunked) - float(whole)) < 1e-6, (float(chunked), float(whole))
  for name in ("exact_kl", "span_kl", "uld", "hard_ce"):  # sums of ~60 terms: float32 rounding
    got, want = float(chunked_sums[name]), float(whole_sums[name])
    assert abs(got - want) < 1e-6 * max(1.0, abs(want)), (name, got, want)
  assert float(whole_sums["span_kl"]) > 0 and float(whole_sums["uld"]) > 0
  grads = zip(jax.tree.leaves(nnx.state(chunked_grads)), jax.tree.leaves(nnx.state(whole_grads)))
  for a, b in grads:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
