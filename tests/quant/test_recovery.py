"""QAT recovers the loss PTQ loses: a tiny student learns a sparse bigram (Markov) distribution;
from step N the run either continues in full precision (then PTQ) or continues as a fake-quant
student (the delayed-start swap, same optimizer state and schedule) for the same K steps.

recovery = (PTQ loss - QAT loss) / (PTQ loss - full-precision loss), on held-out sequences.

One run's recovery is a ratio of two small loss gaps (~0.01 nats), and the last K steps' SGD
noise moves it: on one CPU, five seeds gave 0.53-0.92, and the same seed gave 0.73 on one CPU
and 0.60 on another (XLA:CPU's vector code differs by ISA). So int4 pools three runs (model and
data seeds), summing the gaps before dividing, and asks for "most": more than half.

Sized for the suite's budget: 200 + 100 steps of 16 sequences, a third of the compute of the
earlier 300 + 150 steps of 32 (pooled recovery 0.80 there). Measured on one machine at this
size: pooled recovery 0.66, int4 PTQ gaps 0.012-0.015 (> 2e-3), int8 PTQ 0.3% of int4's gap;
with XLA's full compile (below), what a user's JAX runs: 0.615, gaps 0.011-0.015, int8 0.2%.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from distillax.framework import optim
from distillax.quant import QuantConfig, quantize_for_training, quantize_post_training
from tests.quant.helpers import markov_batches, markov_table
from tests.support.engines import lm_loss, mesh_and_rules, run_steps, tiny_engine
from tests.support.models import FAN_IN, TINY1, random_model
from tests.support.xla import compile_steps_fully_optimized

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

N_STEPS, K_STEPS, BATCH, LENGTH = 200, 100, 16, 32


def _val_loss(model, batches):
  return float(np.mean([lm_loss(model, b) for b in batches]))


def _with_params(model, params):
  graphdef, state = nnx.split(model)
  nnx.replace_by_pure_dict(state, jax.device_get(params))
  return nnx.merge(graphdef, state)


def _recovery_run(seed, qtypes):
  """One run from seed: full-precision, PTQ and QAT val losses per qtype."""
  config = TINY1.replace(max_seq_len=64)
  table = markov_table(config.vocab_size, successors=2, seed=0)
  train = markov_batches(table, N_STEPS + K_STEPS, BATCH, LENGTH, seed=100 + seed)
  val = markov_batches(table, 4, 128, LENGTH, seed=2)
  mesh, rules = mesh_and_rules("dp", 1, devices=jax.devices()[:1])
  opt = optim.default_optimizer_config()
  opt.learning_rate, opt.warmup_steps, opt.weight_decay, opt.end_lr_fraction = 3e-3, 20, 0.0, 0.0
  build = lambda m: tiny_engine(m, train[0], mesh, rules, steps=N_STEPS + K_STEPS, opt=opt)

  model = random_model(config, seed=seed, init=FAN_IN)
  fp_engine = build(model)
  state, _ = run_steps(fp_engine, fp_engine.init_state(model, {}, seed=0), train[:N_STEPS])
  at_start = jax.device_get(state)  # the engine donates its input state
  fp_state, _ = run_steps(fp_engine, jax.device_put(at_start), train[N_STEPS:])
  fp = _with_params(model, fp_state.params)
  fp_loss = _val_loss(fp, val)

  results = {}
  for qtype in qtypes:
    qcfg = QuantConfig.simple(qtype)  # per-channel weights, activations in full precision
    ptq_loss = _val_loss(quantize_post_training(fp, qcfg), val)
    qat_model = quantize_for_training(model, qcfg)
    qat_state, _ = run_steps(build(qat_model), jax.device_put(at_start), train[N_STEPS:])
    qat_loss = _val_loss(_with_params(qat_model, qat_state.params), val)
    results[qtype] = dict(fp=fp_loss, ptq=ptq_loss, qat=qat_loss)
  print(f"\nQAT run seed {seed} (val loss):",
        {q: {k: round(v, 5) for k, v in r.items()} for q, r in results.items()})
  return results


@pytest.mark.slow
def test_qat_recovers_most_of_the_ptq_degradation(monkeypatch):
  # 1,300 steps of three step programs: XLA's full compile runs them twice as fast as the
  # suite's cheap one (tests/support/xla.py).
  compile_steps_fully_optimized(monkeypatch)
  runs = [_recovery_run(0, ("int4", "int8"))] + [_recovery_run(s, ("int4",)) for s in (1, 2)]
  int4 = [r["int4"] for r in runs]
  for r in int4:
    assert r["ptq"] - r["fp"] > 2e-3, r  # int4 PTQ costs something measurable in every run
  recovered = sum(r["ptq"] - r["qat"] for r in int4)
  lost = sum(r["ptq"] - r["fp"] for r in int4)
  print(f"int4 pooled recovery: {recovered / lost:.3f}")
  assert recovered / lost > 0.5, int4
  # int8 PTQ is nearly lossless, so its ratio is a ratio of noise; QAT must not hurt though.
  int8 = runs[0]["int8"]
  assert abs(int8["ptq"] - int8["fp"]) < 0.1 * (int4[0]["ptq"] - int4[0]["fp"]), int8
  assert int8["qat"] < int8["ptq"] + 1e-3, int8
