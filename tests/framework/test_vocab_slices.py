"""Token losses over vocabulary slices (`train.loss_impl='sliced'`) against whole logits: the
engine's sums and gradients against the whole-logits formulas (float64 numpy, autodiff), and the
lm objective of adapted (LoRA, QLoRA) and fake-quantized (QAT) students against the same model's
own whole logits, loss and every trained gradient. The masked and sharded objectives are in
test_token_rows.py. The engine comparison also runs on a TPU in the chip run
(scripts/chip_tests.sh, tests/support/chip.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.data import batch as batch_spec
from distillax.distill import LogitKD, divergences, make_distill_objective
from distillax.errors import ConfigError
from distillax.framework import losses, token_loss_impl, vocab_slices
from distillax.models.presets import get_preset
from distillax.quant import LoRAParam, QuantConfig, apply_lora, quantize_for_training
from distillax.quant.lora import lora_dropout, lora_weights
from distillax.trainers import lm_objective
from tests.distill.helpers import f64, np_log_softmax
from tests.framework.test_chunked_loss import _batch
from tests.support import chip
from tests.support.models import random_model


def _divergence(kind, lp, lq, beta, xp):
  """D(P || Q) per row from whole log-probabilities (P the teacher), in numpy or jax.numpy."""
  kl = lambda a, b: xp.sum(xp.exp(a) * (a - b), axis=-1)
  if kind == "forward_kl":
    return kl(lp, lq)
  if kind == "reverse_kl":
    return kl(lq, lp)
  log_m = xp.logaddexp(np.log(beta) + lp, np.log1p(-beta) + lq)
  return beta * kl(lp, log_m) + (1.0 - beta) * kl(lq, log_m)


def _numpy_terms(s, t, y, T, kind, beta):
  """Per-token NLL, the divergence at T and the argmax hit, from whole float64 logits."""
  logp = np_log_softmax(s)
  nll = -logp[np.arange(len(y)), y]
  lt, ls = np_log_softmax(f64(t) / T), np_log_softmax(f64(s) / T)
  return nll, _divergence(kind, lt, ls, beta, np), (np.argmax(s, -1) == y).astype(np.float64)


def _buckets(kind, beta, V, t_top_logp, s_buckets):
  """The top-k buckets' divergence as LogitKD(top_k) takes it (distill/divergences.py)."""
  return divergences.divergence(kind, divergences.teacher_buckets(t_top_logp, V), s_buckets,
                                beta)


OPERANDS_N, OPERANDS_V = 37, 300


def random_operands(seed: int, vocab_axis: int):
  """A (V, D) or (D, V) student head of V = 300 columns over N = 37 hidden states of width 16, a
  teacher head 20 columns wider over hidden states of width 24, targets, and a mask of about
  four fifths of the tokens."""
  N, D, Dt, V = OPERANDS_N, 16, 24, OPERANDS_V
  k = jax.random.split(jax.random.key(seed), 6)
  w = jax.random.normal(k[0], (V, D) if vocab_axis == 0 else (D, V)) * 0.3
  h = jax.random.normal(k[1], (N, D))
  w_t = jax.random.normal(k[2], (Dt, V + 20)) * 0.3
  h_t = jax.random.normal(k[3], (N, Dt))
  y = jax.random.randint(k[4], (N,), 0, V)
  mask = (jax.random.uniform(k[5], (N,)) > 0.2).astype(jnp.float32)
  return w, h, w_t, h_t, y, mask


@pytest.mark.parametrize("slice_size,vocab_axis,softcap,divergence,top_k", [
    (128, 0, None, "forward_kl", 0), (96, 1, 5.0, "reverse_kl", 0), (128, 1, None, "jsd", 0),
    (1000, 0, None, "forward_kl", 0), (128, 1, 5.0, "jsd", 150)])
def test_sums_and_gradients_equal_the_whole_logits_formulas(slice_size, vocab_axis, softcap,
                                                             divergence, top_k):
  """V = 300 in slices of 128 (the last one shifted back over 44 columns already seen), 96
  (an untied head, soft-capped logits) or one slice; forward KL, reverse KL and a jsd of beta
  0.3, over the whole vocabulary or the teacher's top 150 (wider than a slice) plus a rest
  bucket; a teacher head 20 columns wider than the student's (a padded table: only the
  student's columns count). Sums within 1e-5 of float64 numpy (the top-k divergence: of the
  whole-logits one, distill/divergences.py; a top-k read from a cache: test_token_rows.py); the
  weight and hidden-state gradients within 1e-5 of jax.grad through whole logits
  (jax.nn.log_softmax)."""
  N, V, T, beta = OPERANDS_N, OPERANDS_V, 2.0, 0.3
  w, h, w_t, h_t, y, mask = random_operands(0, vocab_axis)
  bucket_fn = functools.partial(_buckets, divergence, beta, V) if top_k else None
  spec = vocab_slices.Spec(kd_weight=0.7 * T * T, ce_weight=0.3, temperature=T, accuracy=True,
                           slice_size=slice_size, divergence=divergence, beta=beta, top_k=top_k,
                           bucket_divergence=bucket_fn)
  cap = (lambda z: z) if softcap is None else (lambda z: softcap * jnp.tanh(z / softcap))

  def whole(w, h):
    s = cap(h @ (w.T if vocab_axis == 0 else w))
    t = (h_t @ w_t)[:, :V]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(s, -1), y[:, None], -1)[:, 0]
    lt, ls = jax.nn.log_softmax(t / T, -1), jax.nn.log_softmax(s / T, -1)
    if top_k:
      top, ids = jax.lax.top_k(lt, top_k)
      div = bucket_fn(top, divergences.student_buckets(ls, ids))
    else:
      div = _divergence(divergence, lt, ls, beta, jnp)
    return jnp.sum((spec.kd_weight * div + spec.ce_weight * nll) * mask), (s, div)

  def sliced(w, h):
    return vocab_slices.token_sums(spec, vocab_slices.Head(w, vocab_axis, "float32", softcap), h,
                                   y, mask, vocab_slices.Head(w_t, 1, "float32"), h_t)

  with jax.default_matmul_precision("highest"):
    (loss, sums), grads = jax.value_and_grad(sliced, argnums=(0, 1), has_aux=True)(w, h)
    (want_loss, (s, whole_div)), want_grads = jax.value_and_grad(whole, argnums=(0, 1),
                                                                has_aux=True)(w, h)
    t = (h_t @ w_t)[:, :V]
  nll, div, hit = _numpy_terms(s, t, np.asarray(y), T, divergence, beta)
  m = f64(mask)
  if top_k:
    div = f64(whole_div)
  chip.assert_close(sums["nll"], np.sum(nll * m), rtol=1e-5)
  chip.assert_close(sums["divergence"], np.sum(div * m), rtol=1e-5)
  assert float(sums["correct"]) == np.sum(hit * m)
  if top_k:  # the student's argmax against the teacher's top-1
    assert float(sums["agreement"]) == np.sum((np.argmax(s, -1) == np.argmax(t, -1)) * m)
  chip.assert_close(loss, want_loss, rtol=1e-5)
  for g, want in zip(grads, want_grads):
    chip.assert_close(g, want, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_sliced_refuses_what_it_does_not_compute():
  """Two logit terms run over slices (tests/distill/test_sliced_terms.py), but not when one of
  them asks for the teacher's top-k: each would take its own bucket pass."""
  both = LogitKD(name="a") + LogitKD(name="b", temperature=1.0, top_k=5)
  with pytest.raises(ConfigError, match="computes several logit terms as LogitKDs over the whole "
                                        r"vocabulary \(no top_k, no cache\); this job has "
                                        r"LogitKD\(a\), LogitKD\(b\)"):
    make_distill_objective(both, metrics=False, sliced=True)


def _dense_and_sliced(model, batch, trained):
  """(loss sum, gradients of the `trained` parameters) of the next-token CE two ways: the
  model's own whole logits (its forward, intercepted head included) through jax.nn.log_softmax
  and autodiff, and lm_objective over vocabulary slices; both under the same adapter dropout
  key, so an adapted head drops the same inputs."""
  graphdef, diff, rest = nnx.split(model, trained, ...)
  targets, mask = batch[batch_spec.TARGETS], batch[batch_spec.LOSS_MASK]

  def dense(diff):
    out = nnx.merge(graphdef, diff, rest)(batch[batch_spec.INPUTS], **losses.model_inputs(batch))
    logp = jax.nn.log_softmax(out.logits_BxLxV.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], -1)[..., 0] * mask)

  def sliced(diff):
    return lm_objective(nnx.merge(graphdef, diff, rest), {}, batch, jax.random.key(0),
                        loss_impl="sliced").loss_sum

  runs = []
  for fn in (dense, sliced):
    with lora_dropout(jax.random.key(7)):
      loss, grads = jax.jit(jax.value_and_grad(fn))(diff)
    runs.append((loss, jax.tree.leaves(nnx.to_pure_dict(grads))))
  return runs


@pytest.mark.parametrize("preset,transform", [
    ("tiny", "lora"),  # the untied head adapted, dropout 0.5 active
    ("tiny_gemma", "qlora"),  # the tied embedding adapted over an nf4 base; soft-capped logits
    ("tiny_gemma", "q4_0/q8_0"),  # QAT: llama.cpp's blocks, the tied embedding as the head
])
def test_adapted_and_fake_quantized_heads_over_slices_equal_their_whole_logits(
    preset, transform, monkeypatch):
  """What `Transformer.output_operands` hands the slices is the head the model multiplies: in
  3 slices of 96 of the 256 columns, the loss within 1e-5 and every trained gradient (the
  adapters; QAT's full-precision weights through the straight-through rounding) within 1e-5
  of its scale of the same model's whole logits."""
  cfg = get_preset(preset).replace(num_layers=1)
  model = random_model(cfg, seed=1)
  if transform in ("lora", "qlora"):
    site = "lm_head" if preset == "tiny" else "embedder/embedding"
    model = apply_lora(model, module_regex=f"{site}|layers/0/attn/q", rank=4, alpha=8.0,
                       dropout=0.5, base_qtype="nf4" if transform == "qlora" else None,
                       base_tile_size=16 if transform == "qlora" else None)
    # the adapters start as B = 0: give B values so the adapted head differs from its base
    for _, w in lora_weights(model):
      w.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(3), w.lora_b[...].shape)
    trained = LoRAParam
  else:
    weight, act = transform.split("/")
    model = quantize_for_training(model, QuantConfig.simple(weight, act))
    trained = nnx.Param
  monkeypatch.setattr(vocab_slices, "slice_size_for", lambda tokens, vocab, requested=0: 96)
  (want_loss, want), (loss, got) = _dense_and_sliced(model, _batch(B=4, L=13), trained)
  chip.assert_close(loss, want_loss, rtol=1e-5)
  assert len(got) == len(want) and len(got) > 0
  for g, w in zip(got, want):
    chip.assert_close(g, w, atol=1e-5 * max(float(jnp.max(jnp.abs(w))), 1e-6))


def _scan_carries(jaxpr):
  """Shapes of every scan carry in a jaxpr, nested ones included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      start, count = eqn.params["num_consts"], eqn.params["num_carry"]
      yield from (v.aval.shape for v in eqn.invars[start:start + count])
    for value in eqn.params.values():
      for sub in value if isinstance(value, tuple) else (value,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's own jaxpr
        if hasattr(sub, "eqns"):
          yield from _scan_carries(sub)


def test_a_frozen_head_carries_no_gradient_accumulator():
  """A head the caller does not differentiate (a LoRA base, a frozen tied embedding) gets no
  (D, V) fp32 accumulator in the slices' backward scan; differentiating it does (the check can
  fail)."""
  model = random_model(get_preset("tiny").replace(num_layers=1), seed=1)
  graphdef, state = nnx.split(model)
  rest = nnx.to_pure_dict(state)
  head = rest.pop("lm_head")

  def loss(rest, head):
    student = nnx.merge(graphdef, nnx.State(dict(rest, lm_head=head)))
    return lm_objective(student, {}, _batch(), jax.random.key(0), loss_impl="sliced").loss_sum

  frozen = jax.make_jaxpr(jax.grad(loss))(rest, head).jaxpr
  trained = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(rest, head).jaxpr
  assert head.shape not in list(_scan_carries(frozen))
  assert head.shape in list(_scan_carries(trained))


def test_the_config_refuses_sliced_in_one_line_for_a_job_it_does_not_compute():
  """Refused by job only: every student output layer (plain, QAT, LoRA) is the slices' to read."""
  with pytest.raises(ConfigError) as e:
    token_loss_impl.check_loss_impl("sliced", "on_policy", sliced=False)
  assert ("the on_policy job's train losses are not ones vocabulary slices compute" in str(e.value)
          and "\n" not in str(e.value))
  token_loss_impl.check_loss_impl("sliced", "lm", sliced=True)
  assert token_loss_impl.resolve_loss_impl("auto", True) == "sliced"
  assert token_loss_impl.resolve_loss_impl("auto", False) == "chunked"
