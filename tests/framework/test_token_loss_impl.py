"""`train.loss_impl='tokamax'`: tokamax's fused projection-and-loss against the vocabulary-chunk
engine (the loss and every gradient, on CPU: tokamax's XLA path), both as the whole batch and
the way a TPU runs it (each device's rows in a shard_map, padded to the Mosaic kernel's block);
and the config's refusals. On a TPU (the chip run, scripts/chip_tests.sh) the whole-batch case
runs tokamax's Mosaic kernel."""

import functools
import sys

import jax
import pytest
from flax import nnx

from distillax import partitioning as pt
from distillax.errors import ConfigError
from distillax.framework import token_loss_impl
from distillax.models.presets import get_preset
from distillax.trainers import lm_objective
from tests.framework.test_chunked_loss import _batch
from tests.support import chip
from tests.support.models import random_model


def _loss_and_grads(model, batch, **options):
  graphdef, state = nnx.split(model)

  def f(state):
    out = lm_objective(nnx.merge(graphdef, state), {}, batch, jax.random.key(0), **options)
    return out.loss_sum / out.tokens, out

  with chip.precision(model.config.dtype):
    (_, out), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(state)
  return out, nnx.to_pure_dict(grads)


@pytest.fixture(scope="module")
def chunked():
  """One layer of the tiny model (untied output layer) and of tiny_gemma (tied embeddings, its
  soft-cap off), each with the chunked engine's loss and gradients on a batch with masked
  positions, made when a test first asks. On a TPU (the chip run, scripts/chip_tests.sh) the
  tiny model computes in bfloat16 (as the benchmarks train; in float32 the kernel's v5e tiles
  overflow the 16 MiB of scoped VMEM: 16.5 MiB in a deviceless compile), 1024 wide with 1000
  columns, so tokamax's Mosaic kernel meets whole 512-wide blocks of the hidden size and a
  partial block of the vocabulary, as at 151,936."""
  on_chip = dict(embed_dim=1024, vocab_size=1000, dtype="bfloat16")
  configs = {"tiny": get_preset("tiny").replace(num_layers=1, **chip.pick({}, on_chip)),
             "tied": get_preset("tiny_gemma").replace(num_layers=1, final_logit_softcap=None)}
  batch = _batch(B=4, L=13)

  @functools.cache
  def case(name):
    model = random_model(configs[name], seed={"tiny": 1, "tied": 2}[name])
    return model, batch, _loss_and_grads(model, batch)
  return case


@pytest.mark.parametrize("model_name,per_device", [("tiny", False), ("tied", True)])
def test_tokamax_loss_equals_the_chunked_engine(chunked, model_name, per_device, monkeypatch):
  """Loss sum within 1e-6, token count, and every parameter's gradient (the tied embedding's
  through `output_weight_DxV`'s transpose). per_device: under fsdp
  on 4 x 2 devices, the rows (4 x 13, over 4 data devices) go through a shard_map and are
  padded to a 16-row block per device, as on a TPU to 1024; the padding's log(V) per row is
  taken off again."""
  model, batch, (want, want_grads) = chunked(model_name)
  if per_device:
    real = token_loss_impl.cross_entropy_sum
    monkeypatch.setattr(token_loss_impl, "cross_entropy_sum", lambda *a: real(
        *a, implementation="xla", per_device=True, row_block=16))
    mesh = pt.create_mesh({"data": 4, "model": 2})
    with pt.use_rules(mesh, pt.rules_from_config({"strategy": "fsdp"})):
      got, grads = _loss_and_grads(model, batch, loss_impl="tokamax")
  else:
    got, grads = _loss_and_grads(model, batch, loss_impl="tokamax")
  assert float(got.tokens) == float(want.tokens) == float(batch["loss_mask_BxL"].sum())
  assert float(want.tokens) < 4 * 13  # some positions are masked
  # On a TPU both ways run in bfloat16: the loss sums float32 logits of bf16 operands
  # (measured on CPU: 1.4e-4 apart); every gradient passes a bf16 backward of the whole model
  # (1.3e-2 apart in norm, 1.5e-2 at most); a lost block, row or padding term is off by more.
  chip.assert_close(got.loss_sum, want.loss_sum, tpu=2e-3, rtol=1e-6)
  assert "accuracy" in want.sums and "accuracy" not in got.sums
  flat_want = jax.tree_util.tree_leaves_with_path(want_grads)
  flat_got = jax.tree_util.tree_leaves(grads)
  assert len(flat_got) == len(flat_want)
  for (path, w), g in zip(flat_want, flat_got):
    # Measured: at most 1.5e-6 apart (the tied embedding, whose entries reach 0.33, by the
    # per-device path: its two uses sum in another order); the tiny model's whole path 1e-6.
    if chip.on_tpu():
      chip.assert_bf16(g, w, jax.tree_util.keystr(path), norm=5e-2, largest=1e-1)
    else:
      chip.assert_close(g, w, atol=5e-6, rtol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("value,job,supported,why_not,message", [
    ("fused", "lm", True, None, "train.loss_impl='fused'; choose one of auto, chunked, sliced, tokamax"),
    ("tokamax", "distill", False, None,
     "train.loss_impl='tokamax': the distill job's token losses run the chunked engine"),
    ("tokamax", "lm", True, "model.final_logit_softcap=30.0 soft-caps the logits",
     "train.loss_impl='tokamax' cannot take this output layer: model.final_logit_softcap=30.0"),
])
def test_loss_impl_refusals(value, job, supported, why_not, message):
  with pytest.raises(ConfigError) as e:
    token_loss_impl.check_loss_impl(value, job, supported, why_not)
  assert message in str(e.value) and "\n" not in str(e.value)
  token_loss_impl.check_loss_impl("chunked", job, supported, why_not)


def test_tokamax_missing_is_one_line(monkeypatch):
  monkeypatch.setitem(sys.modules, "tokamax", None)  # import tokamax -> ImportError
  with pytest.raises(ConfigError) as e:
    token_loss_impl.check_loss_impl("tokamax", "lm", True)
  assert str(e.value) == token_loss_impl.TOKAMAX_MISSING
  assert "pip install 'distillax[tokamax]'" in str(e.value)
