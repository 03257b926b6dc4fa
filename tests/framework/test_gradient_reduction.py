"""With parameters replicated over the data axis (dp, tp) the jit step can reduce gradients once
per step (`partitioning.gradient_reduction`; auto does so under accumulation, tied embeddings,
and always on XLA:CPU, which moves no reduction out of a loop): micro-batches, both uses of a
tied table and the output layer's gradient of every vocabulary chunk sum locally first. Bytes
are read from the compiled HLO (loops weighted by trip count) and compared with the fp32
gradient and with the shard_map backend; the numbers are compared with the GSPMD path (fsdp),
which reduces where gradients are produced."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.data import batch as batch_spec
from distillax.errors import ConfigError
from distillax.framework import hlo, losses
from distillax.framework.engine import reduces_once
from distillax.framework.step import ObjectiveOutput
from distillax.models.init import abstract_model, create_model
from tests.support.engines import mesh_and_rules, packed_batches, run_training, tiny_engine
from tests.support.models import TINY

# Tied table of 1024 x 64: most of the gradient bytes, so a second reduction of it cannot hide.
TIED = dataclasses.replace(TINY, tie_embeddings=True, vocab_size=1024)


def _engine(strategy, mesh_shape, backend="jit", accum_steps=1, cfg=None, batch=32, seq=16,
            reduction="auto", compile_now="background"):
  """`compile_now=False` where a test reads only the mode the runner chose: nothing compiles."""
  mesh, rules = mesh_and_rules(strategy, *mesh_shape)
  return tiny_engine(abstract_model(cfg or TIED), packed_batches(1, batch=batch, seq_len=seq)[0],
                     mesh, rules, backend, accum_steps=accum_steps, gradient_reduction=reduction,
                     compile_now=compile_now)


def _all_reduce_bytes(engine):
  stats = hlo.collective_stats(engine.runner.compiled_text())
  assert not stats["trip_count_unknown"]
  return stats["all-reduce"]["bytes"]


def _grad_bytes(engine):
  return sum(a.size * 4 for a in jax.tree.leaves(engine.layout.abstract.params))


@pytest.mark.parametrize("accum_steps", [1, 4])
def test_dp_all_reduces_one_gradient_per_step(accum_steps):
  jit = _engine("dp", (8, 1), accum_steps=accum_steps)
  manual = _engine("dp", (8, 1), backend="shard_map", accum_steps=accum_steps)
  assert jit.runner.gradient_reduction == "per_step"  # auto: tied, or accumulating
  grad = _grad_bytes(jit)
  # fp32 gradients plus a few scalars (loss, token count, metric sums).
  assert grad <= _all_reduce_bytes(jit) <= grad * 1.001
  assert _all_reduce_bytes(jit) == pytest.approx(_all_reduce_bytes(manual), rel=1e-3)


def test_per_use_reduction_moves_a_gradient_per_micro_batch():
  """What per_step saves, measured on the same step: GSPMD reduces inside the micro-batch loop."""
  per_use = _engine("dp", (8, 1), accum_steps=4, cfg=TINY, reduction="per_use")
  assert per_use.runner.gradient_reduction == "per_use"
  assert _all_reduce_bytes(per_use) == pytest.approx(4 * _grad_bytes(per_use), rel=1e-2)


def test_auto_keeps_per_use_reductions_where_nothing_is_saved():
  """Untied and not accumulating, on a compiler that moves reductions out of loops (TPU, GPU):
  per-layer reductions stay, so the compiler may overlap them with the backward pass; XLA:CPU
  moves none, so there auto reduces once. Parameters split over data always reduce per use."""
  untied = abstract_model(TINY)
  assert not reduces_once("auto", 1, untied, None, "jit", platform="tpu")
  assert not reduces_once("auto", 1, untied, None, "jit", platform="gpu")
  assert reduces_once("auto", 1, untied, None, "jit", platform="cpu")
  assert reduces_once("auto", 4, untied, None, "jit", platform="tpu")
  mode = lambda *a, **k: _engine(*a, compile_now=False, **k).runner.gradient_reduction
  assert mode("dp", (8, 1), cfg=TINY) == "per_step"
  assert mode("fsdp", (8, 1), accum_steps=4) == "per_use"
  assert mode("dp", (8, 1), cfg=TINY, reduction="per_use") == "per_use"
  with pytest.raises(ConfigError, match="gradient_reduction=per_step needs parameters"):
    mode("fsdp", (8, 1), reduction="per_step")
  with pytest.raises(ConfigError, match="gradient_reduction='sometimes' is unknown"):
    mode("dp", (8, 1), reduction="sometimes")


# Untied, its output layer 1024 x 64 (256 KiB of fp32 gradient).
UNTIED = dataclasses.replace(TINY, vocab_size=1024)


def _chunked_lm(student, extras, batch, rng):
  """Next-token CE through the vocabulary-chunk engine in chunks of 32 tokens: 16 chunks of one
  position over the 32 rows GSPMD sees (2 of 8 positions over a worker's 4 rows)."""
  del extras, rng
  out = student(batch[batch_spec.INPUTS], **losses.model_inputs(batch), return_logits=False)
  loss, _, tokens = losses.model_cross_entropy_sums(
      student, out.final_hidden_BxLxD, batch[batch_spec.TARGETS], batch[batch_spec.LOSS_MASK],
      chunk_size=32)
  return ObjectiveOutput(loss_sum=loss, tokens=tokens, sums={})


def test_dp_on_cpu_reduces_the_output_layer_once_not_per_vocabulary_chunk():
  """What made Llama 3.1 8B's dp step all-reduce 1.46x its gradients on XLA:CPU: per use, the
  output layer's gradient of each of the 16 chunks is all-reduced inside the chunk loop; auto
  (per step on XLA:CPU) sums the chunks on each worker and all-reduces the gradient once."""
  mesh, rules = mesh_and_rules("dp", 8, 1)
  batch = packed_batches(1, batch=32, seq_len=16)[0]
  engines = {mode: tiny_engine(abstract_model(UNTIED), batch, mesh, rules, objective=_chunked_lm,
                               gradient_reduction=mode) for mode in ("auto", "per_use")}
  grad, head = _grad_bytes(engines["auto"]), 1024 * 64 * 4
  assert engines["auto"].runner.gradient_reduction == "per_step"
  assert grad <= _all_reduce_bytes(engines["auto"]) <= grad * 1.001
  assert _all_reduce_bytes(engines["per_use"]) == pytest.approx(grad + 15 * head, rel=1e-3)


def test_tp_communication_does_not_grow_with_accumulation():
  """Tensor-parallel activations are reduced over `model` per token (same tokens either way);
  the gradient over `data` once per step, not once per micro-batch."""
  one = _all_reduce_bytes(_engine("tp", (4, 2)))
  four = _all_reduce_bytes(_engine("tp", (4, 2), accum_steps=4))
  assert four == pytest.approx(one, rel=1e-3)


def test_fsdp_still_shards_through_gspmd():
  """Parameters split over data take the GSPMD path: no per-worker body, gathers present."""
  stats = hlo.collective_stats(_engine("fsdp", (8, 1)).runner.compiled_text())
  assert stats["all-gather"]["count"] > 0


def test_tied_model_with_accumulation_matches_the_gspmd_path():
  """Per-worker tp against GSPMD fsdp, tied and accumulating: same losses and parameters over 3
  steps. (Untied per-worker dp is the reference of test_backends.)"""
  batches = packed_batches(3)
  ref = run_training("jit", "fsdp", (4, 2), batches, accum_steps=2, model_cfg=TIED)
  losses, params, _ = run_training("jit", "tp", (2, 4), batches, accum_steps=2, model_cfg=TIED)
  np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref[1])):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["jit", "shard_map", "vmap"])
def test_each_data_worker_draws_its_own_randomness(backend):
  """Every worker must not draw the same dropout mask: the per-worker key folds in its index."""

  def objective(student, extras, batch, rng):
    u = jax.random.uniform(rng, ())
    one = jnp.ones((), jnp.float32)
    return ObjectiveOutput(loss_sum=0.0 * student.final_norm.scale[...].sum(), tokens=one,
                           sums={"u": u, "u2": u * u})

  mesh, rules = mesh_and_rules("dp", 8)
  batch = {"inputs_BxL": np.zeros((8, 4), np.int32)}
  model = create_model(TINY, mesh=mesh, rules=rules, seed=0)
  engine = tiny_engine(model, batch, mesh, rules, backend, objective=objective,
                       gradient_reduction="per_step")
  state = engine.init_state(model, {}, seed=0)
  _, metrics = engine.runner(state, engine.runner.place_batch(batch))
  variance = float(metrics["u2"]) - float(metrics["u"]) ** 2  # over the 8 workers' draws
  assert variance > 1e-3
