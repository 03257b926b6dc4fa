"""QAT's weights rounded once per forward, before the layer loop (quant/round_once.py): the same
forward bit for bit and the same gradients as rounding where each weight is read, and no weight
rounding left inside the scanned layer or its remat."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.models.transformer import Transformer
from distillax.quant import full_precision, quantize_for_training
from tests.quant.helpers import tokens
from tests.support.models import FAN_IN, TINY, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# llama.cpp's q4_0 weights with q8_0 activations (the qat_kd row), and weights only.
Q4_0 = {"rules": [("", None, None, None), (".*", "q4_0", "q8_0", None)]}
Q4_0_WEIGHTS = {"rules": [("", None, None, None), (".*", "q4_0", None, None)]}
SCANNED = TINY.replace(scan_layers=True, remat="full")


@pytest.fixture(scope="module")
def scanned():
  return random_model(SCANNED, seed=0, init=FAN_IN)


def _loss_and_grads(model, tok):
  graphdef, state = nnx.split(model)

  def loss(s):
    logits = nnx.merge(graphdef, s)(tok).logits_BxLxV.astype(jnp.float32)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits
  (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  return value, np.asarray(logits), grads


@pytest.mark.parametrize("rules,layout", [(Q4_0, "scanned"), (Q4_0_WEIGHTS, "unrolled")],
                         ids=["q4_0+q8_0-scanned", "q4_0_weights-unrolled"])
def test_rounding_once_gives_the_same_forward_and_gradients(scanned, rules, layout):
  model = scanned if layout == "scanned" else random_model(TINY, seed=0, init=FAN_IN)
  tok = tokens(2, 16, TINY.vocab_size)
  once = quantize_for_training(model, rules)
  on_read = quantize_for_training(model, rules, round_once=False)
  _, logits_once, grads_once = _loss_and_grads(once, tok)
  _, logits_on_read, grads_on_read = _loss_and_grads(on_read, tok)
  np.testing.assert_array_equal(logits_once, logits_on_read)
  plain = _loss_and_grads(model, tok)[1]
  assert np.abs(logits_once - plain).max() > 1e-3  # the rounding is really there
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(grads_once),
                               jax.tree_util.tree_leaves_with_path(grads_on_read)):
    a, b = np.asarray(a), np.asarray(b)  # float32 sums taken in another order: rounding
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max(),
                               err_msg=jax.tree_util.keystr(path))


def _sub_jaxprs(params):
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax.extend.core.Jaxpr):
        yield item


def _primitives_inside_scans(jaxpr, inside=False, found=None):
  """{primitive name: count} of the equations inside any `scan` body (nested jaxprs walked)."""
  found = {} if found is None else found
  for eqn in jaxpr.eqns:
    if inside:
      found[eqn.primitive.name] = found.get(eqn.primitive.name, 0) + 1
    for sub in _sub_jaxprs(eqn.params):
      _primitives_inside_scans(sub, inside or eqn.primitive.name == "scan", found)
  return found


def test_no_weight_rounding_inside_the_layer_loop(scanned):
  """q4_0 finds each block's first largest element by a min-reduction over the indices of the
  block's largest magnitude (q8_0 activations take a max only): rounding once leaves none
  inside the scanned layer (forward, backward, remat recompute), rounding on read one per
  weight there."""
  tok = tokens(2, 16, TINY.vocab_size)

  def scan_primitives(model):
    graphdef, state = nnx.split(model)
    loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(tok).logits_BxLxV.astype(jnp.float32))
    return _primitives_inside_scans(jax.make_jaxpr(jax.grad(loss))(state).jaxpr)

  on_read = scan_primitives(quantize_for_training(scanned, Q4_0, round_once=False))
  once = scan_primitives(quantize_for_training(scanned, Q4_0))
  assert on_read.get("reduce_min", 0) >= 7  # q k v o gate up down
  assert once.get("reduce_min", 0) == 0
  assert once.get("round", 0) > 0  # the q8_0 activations are still rounded in the loop


def test_the_plain_model_comes_back(scanned):
  once = quantize_for_training(scanned, Q4_0_WEIGHTS)
  assert type(once) is not Transformer and isinstance(once, Transformer)
  assert type(full_precision(once)) is Transformer
