"""Issue 53's two batches: one step samples its whole batch at once with the step's weights,
then learns from it in A micro-batches. The loss, gradients and update equal those of the same
samples learned in one micro-batch, and the samples are those the sampler draws from the
pre-step weights with the step's key (decode called directly, outside any step)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from distillax.distill.on_policy.losses import GeneralizedJSD
from distillax.distill.on_policy.objective import (PROMPT_LENGTHS, PROMPT_TOKENS, ROW_IDS,
                                                   OnPolicySettings, make_on_policy_objective,
                                                   row_keys, score_rollout, scoring_batch,
                                                   Rollout)
from distillax.framework.state import build_layout, init_state
from distillax.framework.step import make_train_step
from distillax.models.sampler import decode, weights_in_compute_dtype
from tests.distill import helpers as h

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SETTINGS = OnPolicySettings(max_new_tokens=5, num_samples=2, eos_id=3, pad_id=0,
                            temperature=1.5)
LENGTHS = np.array([4, 2, 5, 3], np.int32)


def _batch():
  rng = np.random.default_rng(3)
  prompts = np.zeros((len(LENGTHS), 5), np.int32)
  for i, n in enumerate(LENGTHS):
    prompts[i, :n] = rng.integers(4, h.VOCAB, n)
  batch = h.to_jnp(h.make_batch(B=len(LENGTHS), L=9, seed=1))
  batch.update({PROMPT_TOKENS: jnp.asarray(prompts), PROMPT_LENGTHS: jnp.asarray(LENGTHS),
                ROW_IDS: jnp.arange(len(LENGTHS), dtype=jnp.int32)})
  return batch


@pytest.fixture(scope="module")
def run():
  """The state before, and (metrics, new state) of one step at 1, 2 and 4 micro-batches."""
  student, teacher = h.make_models(5)
  tx = optax.sgd(0.5)  # the update is the gradient, scaled: compared element by element
  layout = build_layout(student, {"teacher": teacher}, tx, None, None)
  state = init_state(student, {"teacher": teacher}, tx, layout, seed=0)
  objective = make_on_policy_objective(GeneralizedJSD(beta=0.5), SETTINGS)
  out = {}
  for accum in (1, 2, 4):
    step = jax.jit(make_train_step(layout.defs, objective, tx, optax.constant_schedule(1e-2),
                                   accum_steps=accum))
    out[accum] = jax.device_get(step(state, _batch()))
  return layout, tx, state, out


def test_micro_batches_give_the_update_of_one(run):
  _, _, _, out = run
  (state1, one) = out[1]
  for accum in (2, 4):
    state, metrics = out[accum]
    for name in ("loss", "tokens", "grad_norm", "update_norm", "reverse_kl",
                 "completion_length", "eos_rate"):
      np.testing.assert_allclose(metrics[name], one[name], rtol=2e-5, atol=1e-7, err_msg=name)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(state1.params)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_samples_come_from_the_weights_of_the_step_that_learns_from_them(run):
  """The step's figures are those of the sampler's own draws from the pre-step weights: decode
  on them with the step's key (fold_in(state key, step), then 1 for sampling), scored and
  learned from outside any step; a model one step on draws other samples."""
  layout, tx, state, out = run
  student, extras = layout.defs.merge(state.params, state.frozen)
  batch = _batch()
  step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
  S = SETTINGS.num_samples
  prompt_NxP = jnp.repeat(batch[PROMPT_TOKENS], S, axis=0)
  lengths_N = jnp.repeat(batch[PROMPT_LENGTHS], S, axis=0)
  keys_N = row_keys(jax.random.fold_in(step_key, 1), batch[ROW_IDS], S)
  graph, params = nnx.split(student)

  @jax.jit
  def learn(params, keys_N):
    model = nnx.merge(graph, params)
    generated = decode(jax.lax.stop_gradient(model), prompt_NxP, lengths_N, keys_N,
                       SETTINGS.sampling())
    scoring = scoring_batch(Rollout(prompt_NxP, lengths_N, generated), 0)

    def loss(p):
      o = score_rollout(GeneralizedJSD(beta=0.5), nnx.merge(graph, p), extras, scoring)
      return o.loss_sum / o.tokens, o.tokens
    (value, tokens), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, tokens, grads, generated.lengths_B

  value, tokens, grads, lengths = jax.device_get(learn(params, keys_N))
  new_state, metrics = out[2]
  np.testing.assert_allclose(metrics["loss"], value, rtol=2e-5)
  assert float(metrics["tokens"]) == float(tokens)
  np.testing.assert_allclose(metrics["completion_length"], np.mean(lengths), rtol=1e-6)
  updates, _ = tx.update(nnx.to_pure_dict(grads), state.opt_state, state.params)
  want = optax.apply_updates(state.params, updates)
  for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # The stepped weights draw other samples: the match above is with these weights only.
  stepped = nnx.split(layout.defs.merge(new_state.params, state.frozen)[0])[1]
  other = jax.device_get(learn(stepped, keys_N))
  assert float(other[0]) != pytest.approx(float(value), rel=1e-6)


def test_weights_cast_once_to_the_compute_dtype_sample_the_same_tokens():
  """A student of fp32 weights and bf16 compute samples the same tokens from its matmul weights
  cast to bf16 once (before the decode loop) as from its fp32 weights cast at every use;
  vectors (norm scales) stay fp32."""
  student, _ = h.make_models(9, student_config=h.STUDENT_CONFIG.replace(dtype="bfloat16"))
  cast = weights_in_compute_dtype(student)
  dtypes = {x.ndim: x.dtype for x in jax.tree.leaves(nnx.state(cast))}
  assert dtypes[2] == jnp.bfloat16 and dtypes[1] == jnp.float32
  batch = _batch()
  keys = jax.random.split(jax.random.key(4), len(LENGTHS))
  run = jax.jit(lambda g, s: decode(nnx.merge(g, s), batch[PROMPT_TOKENS],
                                    batch[PROMPT_LENGTHS], keys, SETTINGS.sampling()),
                static_argnums=0)
  a = jax.device_get(run(*nnx.split(student)))
  b = jax.device_get(run(*nnx.split(cast)))
  np.testing.assert_array_equal(a.tokens_BxT, b.tokens_BxT)
  np.testing.assert_allclose(a.logprobs_BxT, b.logprobs_BxT, atol=1e-6)


def test_the_decode_loop_reads_weights_cast_once_before_it():
  """The program the step's sampling lowers to (before any compiler pass): with cast_weights,
  every matmul weight of two or more dimensions is converted fp32 -> bf16 exactly once (before
  the prefill and the decode loop); without it, again inside the loop (each decode step)."""
  import dataclasses
  import re
  from distillax.distill.on_policy.objective import sample_rollout
  student, _ = h.make_models(9, student_config=h.STUDENT_CONFIG.replace(dtype="bfloat16"))
  graph, state = nnx.split(student)
  shapes = ["x".join(map(str, x.shape)) for x in jax.tree.leaves(state) if x.ndim >= 2]
  batch = _batch()

  def converts(cast: bool) -> int:
    settings = dataclasses.replace(SETTINGS, cast_weights=cast)
    text = jax.jit(lambda st: sample_rollout(nnx.merge(graph, st), batch, jax.random.key(0),
                                             settings).generated.tokens_BxT).lower(state).as_text()
    found = re.findall(r"stablehlo.convert[^\n]*\(tensor<([\dx]+)xf32>\) -> tensor<[\dx]+xbf16>",
                       text)
    return sum(1 for shape in found if shape in shapes)

  assert converts(True) == len(shapes)
  assert converts(False) >= 2 * len(shapes)
