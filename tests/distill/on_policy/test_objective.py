"""The on-policy objective: what it scores (completion tokens only, against each sequence run
alone), that padding changes nothing, that no gradient flows through sampling, stop tokens,
lmbda mixing, and that a QAT student samples from its fake-quantized forward."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.distill import LogitKD, make_distill_objective
from distillax.distill.on_policy.objective import (PROMPT_LENGTHS, PROMPT_TOKENS, ROW_IDS,
                                         OnPolicySettings, make_on_policy_objective,
                                         sample_rollout, score_rollout, scoring_batch)
from distillax.distill.on_policy.losses import GeneralizedJSD, SampledTokenKL
from distillax.models.config import TransformerConfig
from distillax.quant import quantize_for_training
from tests.distill import helpers as h
from tests.support.models import NORMS_NEAR_ONE, random_model
from tests.support.xla import DEFAULT_CPU_EMITTERS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LENGTHS = np.array([5, 2, 3], np.int32)
SETTINGS = OnPolicySettings(max_new_tokens=6, num_samples=2, eos_id=3, pad_id=0)


def _prompt_batch(width=5, garbage=False, seed=0):
  rng = np.random.default_rng(seed)
  prompts = rng.integers(4, h.VOCAB, (len(LENGTHS), 5)).astype(np.int32)
  out = np.zeros((len(LENGTHS), width), np.int32)
  if garbage:  # whatever sits past a prompt's length must not matter
    out[:] = rng.integers(0, h.VOCAB, out.shape)
  for i, n in enumerate(LENGTHS):
    out[i, :n] = prompts[i, :n]
  batch = h.to_jnp(h.make_batch(B=len(LENGTHS), L=9, seed=1))
  batch.update({PROMPT_TOKENS: jnp.asarray(out), PROMPT_LENGTHS: jnp.asarray(LENGTHS),
                ROW_IDS: jnp.arange(len(LENGTHS), dtype=jnp.int32)})
  return batch


@pytest.fixture(scope="module")
def models():
  return h.make_models(2)


_COMPILED = {}


def _value_and_grad(objective, student, teacher, batch, key, compiler_options=None):
  """(loss, output), gradient; one compile per objective, model and compiler options (batch and
  key are arguments)."""
  graph, state = nnx.split(student)
  options = tuple(sorted((compiler_options or {}).items()))
  if (objective, graph, options) not in _COMPILED:
    def loss(state, batch, key):
      out = objective(nnx.merge(graph, state), {"teacher": teacher}, batch, key)
      return out.loss_sum, out
    _COMPILED[objective, graph, options] = jax.jit(jax.value_and_grad(loss, has_aux=True),
                                                   compiler_options=compiler_options)
  return _COMPILED[objective, graph, options](state, batch, key)


def _value(objective, student, teacher, batch, key):
  """The objective's output alone (no gradient), compiled once per objective and model: the
  references that only read a loss skip tracing and compiling a backward pass."""
  graph, state = nnx.split(student)
  if (objective, graph, "value") not in _COMPILED:
    _COMPILED[objective, graph, "value"] = jax.jit(
        lambda state, batch, key: objective(nnx.merge(graph, state), {"teacher": teacher}, batch,
                                            key))
  return _COMPILED[objective, graph, "value"](state, batch, key)


_ALONE_WIDTH = int(LENGTHS.max()) + SETTINGS.max_new_tokens


@jax.jit
def _forward_logits(graph_and_state, seq_1xW):
  return nnx.merge(*graph_and_state)(seq_1xW).logits_BxLxV


@functools.partial(jax.jit, static_argnums=3)
def _jitted_rollout(graph_and_state, batch, key, settings):
  return sample_rollout(nnx.merge(*graph_and_state), batch, key, settings)


def _rollout(model, batch, key, settings):
  """`sample_rollout` compiled once per settings (eagerly, its decode loop ran op by op)."""
  return _jitted_rollout(nnx.split(model), batch, key, settings)


def _logits_alone(model, seq):
  """The logits of one sequence run alone (batch of one, no other row), as float64. It is
  right-padded to one width so a single compile serves every length: under causal attention
  the pad after the sequence changes none of its positions' logits."""
  padded = np.zeros((1, _ALONE_WIDTH), np.int32)
  padded[0, :len(seq)] = seq
  logits = _forward_logits(nnx.split(model), jnp.asarray(padded))
  return np.asarray(logits[0, :len(seq)], np.float64)


@pytest.mark.parametrize("leaf", [GeneralizedJSD(beta=0.3, temperature=1.5), SampledTokenKL()])
def test_loss_is_over_completion_tokens_of_each_sequence_run_alone(models, leaf):
  """The reference runs every prompt + completion alone, unpadded, and sums the divergence
  over the positions that predict completion tokens (up to the stop token) only."""
  student, teacher = models
  batch = _prompt_batch()
  key = jax.random.key(4)
  objective = make_on_policy_objective(leaf, SETTINGS, chunk_size=5)
  # Only the loss is compared: the objective's forward alone, no backward compiled.
  out = _value(objective, student, teacher, batch, key)
  loss = out.loss_sum
  rollout = _rollout(student, batch, jax.random.fold_in(key, 1), SETTINGS)
  gen = jax.device_get(rollout.generated)
  want, count = 0.0, 0
  for n in range(len(LENGTHS) * SETTINGS.num_samples):
    prompt = np.asarray(batch[PROMPT_TOKENS])[n // 2, :LENGTHS[n // 2]]
    completion = gen.tokens_BxT[n, :gen.lengths_B[n]]
    seq = np.concatenate([prompt, completion])
    s, t = _logits_alone(student, seq), _logits_alone(teacher, seq)
    rows = slice(len(prompt) - 1, len(prompt) - 1 + len(completion))
    if isinstance(leaf, GeneralizedJSD):
      p = np.exp(h.np_log_softmax(t[rows] / leaf.temperature))
      q = np.exp(h.np_log_softmax(s[rows] / leaf.temperature))
      want += (leaf.beta * h.np_kl(p, leaf.beta * p + (1 - leaf.beta) * q)
               + (1 - leaf.beta) * h.np_kl(q, leaf.beta * p + (1 - leaf.beta) * q)).sum()
    else:  # value at ratio 1: log q - log p of the sampled tokens
      pick = lambda x: np.take_along_axis(h.np_log_softmax(x[rows]), completion[:, None], 1)
      want += (pick(s) - pick(t)).sum()
    count += len(completion)
  assert float(out.tokens) == count
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)


def test_padding_and_prompt_width_change_neither_loss_nor_gradient(models):
  student, teacher = models
  objective = make_on_policy_objective(GeneralizedJSD(), SETTINGS)
  key = jax.random.key(9)
  # XLA:CPU's default emitters: the gradients agree to 1e-6 in the program a user compiles; the
  # suite's cheaper emitters order one sum otherwise (tests/support/xla.py).
  (loss_a, out_a), grad_a = _value_and_grad(objective, student, teacher, _prompt_batch(), key,
                                            DEFAULT_CPU_EMITTERS)
  (loss_b, out_b), grad_b = _value_and_grad(objective, student, teacher,
                                            _prompt_batch(width=8, garbage=True), key,
                                            DEFAULT_CPU_EMITTERS)
  assert float(out_a.tokens) == float(out_b.tokens)
  np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grad_a), jax.tree.leaves(grad_b)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_no_gradient_flows_through_sampling(models):
  student, teacher = models
  batch, key = _prompt_batch(), jax.random.key(2)
  graph, state = nnx.split(student)
  # The sampler's log-probabilities depend on the weights, but carry no gradient to them.
  logprob_grad = jax.jit(jax.grad(lambda st: jnp.sum(sample_rollout(
      nnx.merge(graph, st), batch, key, SETTINGS).generated.logprobs_BxT)))(state)
  assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(logprob_grad))
  # The objective's gradient is that of scoring the same samples given as constants.
  leaf = SampledTokenKL()
  objective = make_on_policy_objective(leaf, SETTINGS)
  (_, _), grad = _value_and_grad(objective, student, teacher, batch, key)
  rollout = jax.device_get(_rollout(student, batch, jax.random.fold_in(key, 1), SETTINGS))
  fixed = scoring_batch(jax.tree.map(jnp.asarray, rollout), SETTINGS.pad_id)
  want = jax.jit(jax.grad(lambda st: score_rollout(leaf, nnx.merge(graph, st),
                                                   {"teacher": teacher}, fixed).loss_sum))(state)
  # Eager and jitted decodes round differently (~1e-6 in the importance weights); a gradient
  # through the sampler's log-probabilities would cancel the whole ratio term instead.
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(grad)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-3, atol=5e-5)


def test_rows_stop_at_eos_or_end_of_turn(models):
  """Two stop ids (EOS and an end-of-turn id): every row ends at its first stop token, pads
  after it, and the statistics count exactly those tokens."""
  student, teacher = models
  settings = OnPolicySettings(max_new_tokens=12, num_samples=4, eos_id=3, stop_ids=(7, 11, 20),
                              pad_id=0, temperature=2.0)
  batch = _prompt_batch()
  objective = make_on_policy_objective(GeneralizedJSD(), settings)
  # Only the statistics are read: the objective's forward alone, no backward compiled.
  out = _value(objective, student, teacher, batch, jax.random.key(0))
  gen = jax.device_get(_rollout(student, batch, jax.random.fold_in(jax.random.key(0), 1),
                                      settings).generated)
  stops = {3, 7, 11, 20}
  ended = 0
  for tokens, length in zip(gen.tokens_BxT, gen.lengths_B):
    hits = [i for i, t in enumerate(tokens) if t in stops]
    want = hits[0] + 1 if hits else len(tokens)
    assert length == want
    assert np.all(tokens[want:] == 0)
    ended += bool(hits)
  assert 0 < ended < len(gen.lengths_B)  # both kinds of rows are in the test
  np.testing.assert_allclose([float(x) for x in out.ratios["completion_length"]],
                             [gen.lengths_B.sum(), len(gen.lengths_B)])
  np.testing.assert_allclose([float(x) for x in out.ratios["eos_rate"]],
                             [ended, len(gen.lengths_B)])


def test_lmbda_mixes_whole_batches_of_either_objective(models):
  student, teacher = models
  batch = _prompt_batch()
  off = make_distill_objective(LogitKD(), metrics=False)
  mixed = make_on_policy_objective(GeneralizedJSD(), SETTINGS.__class__(
      **{**SETTINGS.__dict__, "lmbda": 0.5}), off_policy=off)
  on = make_on_policy_objective(GeneralizedJSD(), SETTINGS)
  assert make_on_policy_objective(GeneralizedJSD(), SETTINGS.__class__(
      **{**SETTINGS.__dict__, "lmbda": 0.0}), off_policy=off) is off
  seen = set()
  for k in range(8):
    key = jax.random.key(k)
    (loss, out), _ = _value_and_grad(mixed, student, teacher, batch, key)
    branch = on if float(out.ratios["on_policy"][0]) == 1.0 else off
    seen.add(branch is on)
    # The reference's loss alone: its gradient is not compared, so no backward is compiled.
    want = _value(branch, student, teacher, batch, key).loss_sum
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
  assert seen == {True, False}


QCONFIG = TransformerConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=2,
                            num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=32)
Q4_0_RULES = {"rules": [("", None, None, None), (".*", "q4_0", "q8_0", None)]}


def test_qat_student_samples_from_its_fake_quantized_forward():
  """The decode's log-probabilities of its own tokens equal the QAT model's full forward over
  prompt + completion (q4_0 weights, q8_0 activations), not the full-precision model's."""
  model = random_model(QCONFIG, 3, NORMS_NEAR_ONE)
  qat = quantize_for_training(model, Q4_0_RULES)
  batch = _prompt_batch()
  settings = OnPolicySettings(max_new_tokens=6, num_samples=1, pad_id=0)
  rollout = jax.jit(lambda b: sample_rollout(qat, b, jax.random.key(1), settings))(batch)
  sb = scoring_batch(rollout, 0)
  mask = np.asarray(sb["loss_mask_BxL"]) > 0
  targets = np.asarray(sb["targets_BxL"])
  kwargs = dict(positions_BxL=sb["positions_BxL"], segment_ids_BxL=sb["segment_ids_BxL"])

  def logprobs(m):
    logits = np.asarray(jax.jit(lambda t: m(t, **kwargs).logits_BxLxV)(sb["inputs_BxL"]))
    return np.take_along_axis(h.np_log_softmax(logits), targets[..., None], -1)[..., 0][mask]

  sampled = np.concatenate([np.asarray(rollout.generated.logprobs_BxT)[i, :n] for i, n in
                            enumerate(np.asarray(rollout.generated.lengths_B))])
  np.testing.assert_allclose(sampled, logprobs(qat), atol=2e-4)
  assert np.max(np.abs(sampled - logprobs(model))) > 1e-2


MOE_STUDENT = dataclasses.replace(h.STUDENT_CONFIG, num_experts=4, num_experts_per_tok=2,
                                  moe_mlp_dim=16, router="topk_softmax")


def _np_router_terms(logits_TxE: np.ndarray, k: int) -> tuple[float, float, np.ndarray]:
  """Switch loss, z-loss and per-expert load of one layer's router logits, in float64."""
  E = logits_TxE.shape[1]
  chosen_TxK = np.argsort(-logits_TxE, axis=1)[:, :k]
  load_E = np.bincount(chosen_TxK.reshape(-1), minlength=E).astype(np.float64)
  probs_TxE = np.exp(h.np_log_softmax(logits_TxE))
  lse_T = np.log(np.sum(np.exp(logits_TxE), axis=1))
  aux = E * np.sum(load_E / load_E.sum() * probs_TxE.mean(axis=0))
  return aux, float(np.mean(lse_T ** 2)), load_E


def test_an_moe_students_router_losses_come_from_its_forward_over_its_own_samples(models):
  """The on-policy objective with router-loss weights (0.5, 0.25) is the objective without them
  plus 0.5 x the Switch loss + 0.25 x the z-loss per completion token, each as numpy computes
  it from the router logits of every prompt + completion run alone, over its real tokens only
  (the prompt and the completion before its last token; not the padding after a stop token)."""
  _, teacher = models
  student = random_model(MOE_STUDENT, 7, NORMS_NEAR_ONE)
  graph, state = nnx.split(student)
  batch, key = _prompt_batch(), jax.random.key(3)
  plain = make_on_policy_objective(GeneralizedJSD(), SETTINGS)
  weighted = make_on_policy_objective(GeneralizedJSD(), SETTINGS, router_loss_weights=(0.5, 0.25))

  @jax.jit
  def run(state):
    s = nnx.merge(graph, state)
    outs = [o(s, {"teacher": teacher}, batch, key) for o in (plain, weighted)]
    return outs, sample_rollout(s, batch, jax.random.fold_in(key, 1), SETTINGS).generated

  (p, w), gen = jax.device_get(run(state))
  seqs = [np.concatenate([np.asarray(batch[PROMPT_TOKENS])[n // 2, :LENGTHS[n // 2]],
                           gen.tokens_BxT[n, :gen.lengths_B[n] - 1]])
          for n in range(len(LENGTHS) * SETTINGS.num_samples)]
  # Each sequence alone, left-aligned: causal attention keeps what follows from its tokens.
  padded = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
  for n, seq in enumerate(seqs):
    padded[n, :len(seq)] = seq
  logits_NxBxLxE = np.asarray(jax.jit(lambda t: student(
      t, return_logits=False, return_router_logits=True).router_logits_NxBxLxE)(padded),
                              np.float64)
  per_layer = [np.concatenate([x[n, :len(seq)] for n, seq in enumerate(seqs)])
               for x in logits_NxBxLxE]
  count = int(np.sum(gen.lengths_B))
  terms = [_np_router_terms(logits, 2) for logits in per_layer]
  aux, z = np.mean([t[0] for t in terms]), np.mean([t[1] for t in terms])
  assert float(p.tokens) == float(w.tokens) == count
  for out in (p, w):
    np.testing.assert_allclose(float(out.sums["moe_aux_loss"]), count * aux, rtol=1e-5)
    np.testing.assert_allclose(float(out.sums["router_z_loss"]), count * z, rtol=1e-5)
    for layer, (_, _, load_E) in enumerate(terms):
      np.testing.assert_allclose([float(x) for x in out.ratios[f"expert_load_max_over_mean_l"
                                                               f"{layer}"]],
                                 [load_E.max(), load_E.mean()], rtol=1e-6)
      assert [float(x) for x in out.ratios[f"expert_tokens_dropped_l{layer}"]] == [
          0.0, load_E.sum()]
  np.testing.assert_allclose(float(w.loss_sum), float(p.loss_sum) + count * (0.5 * aux + 0.25 * z),
                             rtol=1e-5)
