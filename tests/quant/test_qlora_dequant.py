"""QLoRA's nf4 base dequantized by selects (fakequant.nf4_values) instead of qwix's table
gather: the same weights bit for bit (on a TPU, within one bf16 ulp: its compiler folds casts),
the same forward bit for bit and adapter gradients up to float rounding, and no gather left
inside the scanned layer."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.quant import LoRAParam, apply_lora
from distillax.quant import fakequant
from distillax.quant.fakequant import nf4_dequantize_by_selects, qwix_dequantize
from tests.quant.helpers import tokens
from tests.support import chip
from tests.support.models import FAN_IN, TINY, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16])
def test_nf4_select_dequantize_is_qwix_table_bit_for_bit(scale_dtype):
  rng = np.random.default_rng(0)
  codes = jnp.asarray(rng.integers(0, 16, (3, 32, 24)), jnp.uint8)  # every code, tiles of 8
  scale = jnp.asarray(rng.uniform(0.01, 2.0, (3, 4, 24)), scale_dtype)
  got = jax.jit(nf4_dequantize_by_selects)(codes, scale)
  want = jax.jit(qwix_dequantize, static_argnums=2)(codes, scale, "nf4")
  assert got.dtype == want.dtype == scale_dtype
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  if chip.on_tpu() and scale_dtype == jnp.bfloat16:
    # Measured on a v5e (benchmarks/results/tpu/chip_tests_call6.json): 401 of 2,304 bf16
    # weights one bf16 ulp apart (2^-7 relative at most), the rest equal. The TPU compiler folds
    # the casts around the scale's multiply that the CPU keeps (DESIGN: on a real accelerator),
    # so one path rounds once where the other rounds twice. Within one ulp, never more.
    np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=0)
  else:
    np.testing.assert_array_equal(got, want)


def _forward_and_adapter_grads(model, tok):
  graphdef, adapters, rest = nnx.split(model, LoRAParam, ...)
  b = jax.tree.map(lambda x: x + 0.05, adapters)  # B off zero: the adapters reach the output

  def loss(a):
    logits = nnx.merge(graphdef, a, rest)(tok).logits_BxLxV.astype(jnp.float32)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 1]), logits
  (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(b)
  return np.asarray(logits), grads, jax.make_jaxpr(jax.grad(lambda a: loss(a)[0]))(b).jaxpr


def _gathers_in_scans(jaxpr, inside=False) -> int:
  count = 0
  for eqn in jaxpr.eqns:
    count += inside and eqn.primitive.name == "gather"
    for value in eqn.params.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        sub = item.jaxpr if isinstance(item, jax.extend.core.ClosedJaxpr) else item
        if isinstance(sub, jax.extend.core.Jaxpr):
          count += _gathers_in_scans(sub, inside or eqn.primitive.name == "scan")
  return count


def test_qlora_forward_and_adapter_grads_equal_the_gather_path(monkeypatch):
  model = random_model(TINY.replace(scan_layers=True, remat="full"), seed=0, init=FAN_IN)
  qlora = apply_lora(model, module_regex=r"layers/.*", rank=4, dropout=0.0, base_qtype="nf4",
                     base_tile_size=8)
  tok = tokens(2, 16, TINY.vocab_size)
  logits_gather, grads_gather, jaxpr_gather = _forward_and_adapter_grads(qlora, tok)  # CPU's
  monkeypatch.setattr(fakequant, "_nf4_dequantize_on_cpu", nf4_dequantize_by_selects)
  logits, grads, jaxpr = _forward_and_adapter_grads(qlora, tok)  # an accelerator's
  np.testing.assert_array_equal(logits, logits_gather)
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(grads),
                               jax.tree_util.tree_leaves_with_path(grads_gather)):
    a, b = np.asarray(a), np.asarray(b)  # the same weights; sums fused in another order
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max(),
                               err_msg=jax.tree_util.keystr(path))
  assert _gathers_in_scans(jaxpr_gather) >= 7  # the table lookups of q k v o gate up down
  assert _gathers_in_scans(jaxpr) == 0
