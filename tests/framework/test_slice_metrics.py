"""The metrics that ride the vocabulary slices (framework/slice_metrics.py, `Spec.metrics`) against
float64 numpy over whole logits: the teacher's NLL, the student's and the teacher's argmax
agreement, the logit cosine and KL(student || teacher) at T = 1, over the token columns of a
padded vocabulary; and that asking for them changes neither the loss nor its gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.framework import vocab_slices
from tests.distill.helpers import f64, np_log_softmax
from tests.support import chip


def _case(vocab_axis, seed=0):
  """N = 37 positions, V = 300 student columns, fp32; the teacher's logits are the student's
  plus noise (so their argmaxes agree on some positions, not all), from a head 20 columns wider
  (a padded table) over hidden states of their own."""
  N, D, Dt, V = 37, 16, 24, 300
  k = jax.random.split(jax.random.key(seed), 6)
  w = jax.random.normal(k[0], (V, D) if vocab_axis == 0 else (D, V)) * 0.3
  h = jax.random.normal(k[1], (N, D))
  w_DxV = jnp.pad(w.T if vocab_axis == 0 else w, ((0, 0), (0, 20)))
  w_t = jnp.concatenate([w_DxV, jax.random.normal(k[2], (Dt - D, V + 20)) * 0.3])
  h_t = jnp.concatenate([h, jax.random.normal(k[3], (N, Dt - D))], axis=1)
  y = jax.random.randint(k[4], (N,), 0, V)
  mask = (jax.random.uniform(k[5], (N,)) > 0.2).astype(jnp.float32)
  return w, h, w_t, h_t, y, mask


def _numpy_metrics(s, t, y, m):
  """The four metrics' masked sums from whole float64 logits (N, V) of the counted columns."""
  ls, lt = np_log_softmax(s), np_log_softmax(t)
  rows = np.arange(len(y))
  teacher_nll = -lt[rows, y]
  agreement = (np.argmax(s, -1) == np.argmax(t, -1)).astype(np.float64)
  cosine = np.sum(s * t, -1) / (np.linalg.norm(s, axis=-1) * np.linalg.norm(t, axis=-1))
  reverse_kl = np.sum(np.exp(ls) * (ls - lt), -1)
  return {k: np.sum(v * m) for k, v in (("teacher_nll", teacher_nll), ("agreement", agreement),
                                        ("cosine", cosine), ("reverse_kl", reverse_kl))}


@pytest.mark.parametrize("slice_size,vocab_axis,softcap,token_rows", [
    (128, 0, None, None),  # 3 slices, the last shifted back over 84 columns already seen
    (96, 1, 5.0, None),  # an untied head, soft-capped logits
    (128, 1, None, 250),  # a padded vocabulary: 250 token columns of 300
    (1000, 0, None, None),  # one slice
])
def test_metrics_equal_numpy_over_whole_logits(slice_size, vocab_axis, softcap, token_rows):
  """Each metric's sum within 1e-5 (relative) of float64 numpy over the counted columns; the
  agreement count exactly."""
  w, h, w_t, h_t, y, mask = _case(vocab_axis)
  if token_rows is not None:
    y = jnp.minimum(y, token_rows - 1)
  V = w.shape[vocab_axis]
  spec = vocab_slices.Spec(kd_weight=0.5, ce_weight=0.5, temperature=2.0, accuracy=True,
                           metrics=True, slice_size=slice_size)
  with jax.default_matmul_precision("highest"):
    _, sums = vocab_slices.token_sums(
        spec, vocab_slices.Head(w, vocab_axis, "float32", softcap, token_rows), h, y, mask,
        vocab_slices.Head(w_t, 1, "float32", softcap), h_t)
    s = f64(h @ (w.T if vocab_axis == 0 else w))
    t = f64(h_t @ w_t)[:, :V]
  if softcap is not None:
    s, t = softcap * np.tanh(s / softcap), softcap * np.tanh(t / softcap)
  cols = V if token_rows is None else token_rows
  want = _numpy_metrics(s[:, :cols], t[:, :cols], np.asarray(y), f64(mask))
  for k in ("teacher_nll", "cosine", "reverse_kl"):
    chip.assert_close(sums[k], want[k], rtol=1e-5, err_msg=k)
  assert float(sums["agreement"]) == want["agreement"]
  assert 0 < want["agreement"] < np.sum(f64(mask))  # neither all nor none agree: it can fail


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_metrics_leave_the_loss_and_its_gradients_unchanged(divergence):
  """The same loss, nll, divergence and weight / hidden-state gradients (within 1e-6 relative)
  with the metrics' carries as without them."""
  w, h, w_t, h_t, y, mask = _case(1, seed=1)
  runs = []
  for metrics in (False, True):
    spec = vocab_slices.Spec(kd_weight=0.7, ce_weight=0.3, temperature=2.0, accuracy=True,
                             metrics=metrics, divergence=divergence, beta=0.3, slice_size=128)

    def loss(w, h):
      return vocab_slices.token_sums(spec, vocab_slices.Head(w, 1, "float32"), h, y, mask,
                                     vocab_slices.Head(w_t, 1, "float32"), h_t)

    runs.append(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w, h))
  ((loss_a, sums_a), grads_a), ((loss_b, sums_b), grads_b) = runs
  np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)
  for k in ("nll", "divergence", "correct"):
    np.testing.assert_allclose(sums_b[k], sums_a[k], rtol=1e-6, err_msg=k)
  for a, b in zip(grads_a, grads_b):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_metrics_need_the_teachers_head():
  w, h, _, _, y, mask = _case(1)
  spec = vocab_slices.Spec(accuracy=True, metrics=True)
  with pytest.raises(ValueError, match="spec.metrics needs the teacher's head"):
    vocab_slices.token_sums(spec, vocab_slices.Head(w, 1, "float32"), h, y, mask)
