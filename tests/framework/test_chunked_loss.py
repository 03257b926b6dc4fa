"""The next-token loss through the vocabulary-chunk engine against the unchunked one: values,
accuracy and gradients (also on a TPU in the chip run, scripts/chip_tests.sh, at the tolerances of
tests/support/chip.py); and how the engine sizes its chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax import partitioning as pt
from distillax.data import batch as batch_spec
from distillax.framework import losses, vocab_chunks
from distillax.models.presets import get_preset
from distillax.trainers import lm_objective
from tests.support import chip
from tests.support.models import random_model


def _batch(B=3, L=13, vocab=256, seed=0):
  rng = np.random.default_rng(seed)
  mask = (rng.random((B, L)) > 0.2).astype(np.float32)
  return {batch_spec.INPUTS: jnp.asarray(rng.integers(0, vocab, (B, L)), jnp.int32),
          batch_spec.TARGETS: jnp.asarray(rng.integers(0, vocab, (B, L)), jnp.int32),
          batch_spec.LOSS_MASK: jnp.asarray(mask),
          batch_spec.SEGMENT_IDS: jnp.ones((B, L), jnp.int32),
          batch_spec.POSITIONS: jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))}


def _unchunked(student, batch):
  out = student(batch[batch_spec.INPUTS], **losses.model_inputs(batch))
  return losses.cross_entropy_sums(out.logits_BxLxV, batch[batch_spec.TARGETS],
                                   batch[batch_spec.LOSS_MASK])


def _chunked(chunk_size):
  def run(student, batch):
    out = student(batch[batch_spec.INPUTS], **losses.model_inputs(batch), return_logits=False)
    return losses.model_cross_entropy_sums(
        student, out.final_hidden_BxLxD, batch[batch_spec.TARGETS], batch[batch_spec.LOSS_MASK],
        chunk_size=chunk_size)
  return run


def _value_and_grads(loss_fn, model, batch):
  graphdef, state = nnx.split(model)

  def f(state):  # the loss per token, as the step divides it: its gradient is what trains
    loss, correct, tokens = loss_fn(nnx.merge(graphdef, state), batch)
    return loss / tokens, (loss, correct, tokens)

  (_, (loss, correct, tokens)), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(state)
  return loss, correct, tokens, nnx.to_pure_dict(grads)


@pytest.mark.parametrize("preset,chunk_size", [
    # 3 rows x 13 positions: 13 chunks of 1 position, 3 of 5 (padded), auto (1 chunk)
    ("tiny", 3), ("tiny", 15), ("tiny", vocab_chunks.AUTO),
    ("tiny_gemma", 12),  # tied embeddings and a final logit soft-cap
])
def test_chunked_lm_loss_equals_unchunked_values_and_gradients(preset, chunk_size):
  model = random_model(get_preset(preset), seed=1)
  batch = _batch()
  want = _value_and_grads(_unchunked, model, batch)
  got = _value_and_grads(_chunked(chunk_size), model, batch)
  chip.assert_close(got[0], want[0], rtol=1e-6)
  assert float(got[1]) == float(want[1]) and float(got[2]) == float(want[2])
  flat_want = jax.tree_util.tree_leaves_with_path(want[3])
  flat_got = jax.tree_util.tree_leaves(got[3])
  assert len(flat_got) == len(flat_want)
  for (path, w), g in zip(flat_want, flat_got):
    chip.assert_close(g, w, atol=1e-6, rtol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_lm_objective_is_the_chunked_loss():
  """The objective next-token training runs equals cross-entropy on the full logits."""
  model = random_model(get_preset("tiny"), seed=2)
  batch = _batch(seed=3)
  out = lm_objective(model, {}, batch, jax.random.key(0))
  loss, correct, tokens = _unchunked(model, batch)
  chip.assert_close(out.loss_sum, loss, rtol=1e-6)
  assert float(out.sums["accuracy"]) == float(correct) and float(out.tokens) == float(tokens)


def test_auto_chunk_len_budgets_one_devices_share_of_the_logits():
  # No rules: 16 rows x 128,256 fp32 logits per position = 8 MB, 16 positions fit 128 MiB.
  assert vocab_chunks.auto_chunk_len(16, 32768, 128_256) == 16
  # fsdp_tp on 4 x 2: each device holds 4 rows and half the vocabulary: 130 positions.
  mesh = pt.create_mesh({"data": 4, "model": 2})
  with pt.use_rules(mesh, pt.rules_from_config({"strategy": "fsdp_tp"})):
    assert vocab_chunks.auto_chunk_len(16, 32768, 128_256) == 128 * 2**20 // (4 * 4 * 64_128)
  # dp on 8: one row per device, so a chunk holds 8x the positions it would on one device
  # (the distillation chunks once filled only 1/dp of the budget here).
  with pt.use_rules(pt.create_mesh({"data": 8, "model": 1}), pt.rules_from_config(
      {"strategy": "dp"})):
    assert vocab_chunks.auto_chunk_len(16, 32768, 128_256) == 128 * 2**20 // (4 * 2 * 128_256)
  assert vocab_chunks.auto_chunk_len(2, 10, 256) == 10  # capped at the sequence
  # An explicit size is tokens per chunk: 3 rows of 40 tokens take 13 positions per chunk.
  assert vocab_chunks.chunk_len(40, 3, 100, 256) == 13 and vocab_chunks.chunk_len(2, 3, 9, 8) == 1


def test_a_frozen_output_layer_carries_no_gradient_accumulator():
  """Only the leaves the caller differentiates get a gradient: with the LM head frozen (as under
  LoRA), the engine's scan carries no head-sized accumulator, and the other parameters' gradients
  equal the unchunked loss's."""
  model = random_model(get_preset("tiny"), seed=1)
  batch = _batch()
  graphdef, state = nnx.split(model)
  pure = nnx.to_pure_dict(state)
  head = pure.pop("lm_head")

  def per_token(loss_fn):
    def f(rest, head):
      s = nnx.State(dict(rest, lm_head=head))
      loss, _, tokens = loss_fn(nnx.merge(graphdef, s), batch)
      return loss / tokens
    return f

  chunked = jax.grad(per_token(_chunked(3)))
  got, want = jax.jit(chunked)(pure, head), jax.jit(jax.grad(per_token(_unchunked)))(pure, head)
  for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got)):
    np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-6, err_msg=jax.tree_util.keystr(path))

  def scan_carries(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "scan":
        carry = eqn.params["num_consts"], eqn.params["num_carry"]
        yield from (v.aval.shape for v in eqn.invars[carry[0]:carry[0] + carry[1]])
      for value in eqn.params.values():
        for sub in value if isinstance(value, tuple) else (value,):
          sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's own jaxpr
          if hasattr(sub, "eqns"):
            yield from scan_carries(sub)

  carried = list(scan_carries(jax.make_jaxpr(chunked)(pure, head).jaxpr))
  assert carried, "the engine's scan was not found"
  assert head.shape not in carried
  # The same program differentiating the head does carry its accumulator (the check can fail).
  both = jax.grad(per_token(_chunked(3)), argnums=(0, 1))
  assert head.shape in list(scan_carries(jax.make_jaxpr(both)(pure, head).jaxpr))
