"""Quantization-aware training, its delayed start, and the post-training (PTQ) baseline.

`quantize_for_training` returns the same model with a fake-quantized forward: weights (and,
where a rule says so, the activations entering those matmuls) are rounded to the quantization
grid in the forward pass, and gradients pass straight through the rounding (qwix's STE: the
backward uses the unrounded operands). The state is untouched: same paths, same arrays, same
`logical_axes` metadata and shardings, so `build_engine`, every backend and every partitioning
preset work unchanged; only the GraphDef differs.

Delayed start (`QuantConfig.start_step`): because the full-precision and the fake-quant model
have identical state trees, the trainer can swap models at a step without touching the state:

    qat_model = quantize_for_training(model, qcfg)
    check_swappable(model, qat_model)
    fp_engine = build_engine(model, extras, objective, ...)      # steps < start_step
    qat_engine = build_engine(qat_model, extras, objective, ...)  # steps >= start_step
    state = fp_engine.init_state(model, extras, seed)
    ... state, m = (fp_engine if step < qcfg.start_step else qat_engine).runner(state, batch)

Both engines place the state identically (same layout and shardings), so the state produced by
one is a valid input of the other; checkpoints are interchangeable. Evaluate with the engine
that matches the current phase.

PTQ: `quantize_post_training` rounds the weights once (no training) and keeps activation fake
quantization where configured: exactly the forward of a fake-quant model that took no steps,
and exactly what `export.load_quantized` reconstructs from the integers on disk.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
from flax import nnx

from distillax.errors import ConfigError
from distillax.quant import intercept
from distillax.quant.config import QuantConfig
from distillax.quant.graph import get_path
from distillax.quant.sites import MatmulSite, find_matmul_sites, has_wrapped_weights
from distillax.quant.weights import WeightPlan, fake_quantize, weight_plans


def _check_rules_used(qcfg: QuantConfig, sites: list[MatmulSite]) -> None:
  paths = sorted({s.module_path for s in sites if s.owned})
  for i, rule in enumerate(qcfg.rules):
    if not any(rule.matches(p) for p in paths):
      raise ConfigError(f"qat.rules[{i}] module_path={rule.module_path!r} matches no module with "
                        f"a weight matmul; module paths are {paths} ('' is the top module)")


def _prepare(model: nnx.Module, qcfg: Any, sample_tokens) -> tuple[QuantConfig, list]:
  qcfg = QuantConfig.from_config(qcfg)
  if not qcfg.rules:
    raise ConfigError("qat.rules is empty; give at least one (module_path, weight_qtype, "
                      "act_qtype, tile_size) rule")
  if has_wrapped_weights(model):
    raise ConfigError("fake quantization of a LoRA model is not supported; train adapters "
                      "over a quantized base with apply_lora(..., base_qtype='nf4'|'int4') "
                      "(QLoRA), or merge_lora(model) first")
  sites = find_matmul_sites(model, sample_tokens)
  _check_rules_used(qcfg, sites)
  weight_plans(qcfg, sites)  # raises on tile sizes that do not divide
  return qcfg, sites


def quantize_for_training(model: nnx.Module, qcfg: QuantConfig | Mapping[str, Any],
                          sample_tokens: jax.Array | None = None) -> nnx.Module:
  """The model with a fake-quantized forward (straight-through backward); same state.

  `sample_tokens` (int32 [B, L]) only shapes an abstract trace that checks the rules; a dummy
  is used when omitted. Nothing is computed.
  """
  qcfg, _ = _prepare(model, qcfg, sample_tokens)
  return intercept.install(model, intercept.DistillaxProvider(qcfg.rules), sample_tokens)


def full_precision(model: nnx.Module) -> nnx.Module:
  """The plain model of a fake-quant one (same state, original GraphDef)."""
  return intercept.strip(model)


def check_swappable(a: nnx.Module, b: nnx.Module) -> None:
  """Raises unless `a` and `b` have the same state tree (paths, shapes, dtypes, logical axes),
  i.e. one TrainState serves both and the trainer may swap their GraphDefs."""
  def describe(m):
    def one(v):
      x = v.get_raw_value()
      return (tuple(x.shape), str(x.dtype), type(v).__name__,
              v.get_metadata().get("logical_axes"))
    return jax.tree.map(one, nnx.state(m), is_leaf=lambda x: isinstance(x, nnx.Variable))
  da, db = describe(a), describe(b)
  if jax.tree.structure(da) != jax.tree.structure(db) or jax.tree.leaves(da) != jax.tree.leaves(db):
    raise ConfigError("the two models have different state trees; a fake-quant model must come "
                      "from quantize_for_training(model) of the same model")


def quantize_weights_in_place(model: nnx.Module, plans: Mapping[str, WeightPlan]) -> None:
  """Rounds each planned weight to its quantization grid (placement kept)."""
  compute_dtype = model.config.jnp_dtype if hasattr(model, "config") else None
  for plan in plans.values():
    var = get_path(model, plan.path)
    value = var.get_value()
    dt = compute_dtype or value.dtype

    def snap(w, plan=plan, dt=dt):
      return fake_quantize(w.astype(dt), plan).astype(w.dtype)

    sharding = getattr(value, "sharding", None)
    snapped = jax.jit(snap, out_shardings=sharding)(value) if sharding is not None else snap(value)
    var.set_value(snapped)


def quantize_post_training(model: nnx.Module, qcfg: QuantConfig | Mapping[str, Any],
                           sample_tokens: jax.Array | None = None) -> nnx.Module:
  """PTQ: weights rounded once to their grid, activations fake-quantized where configured."""
  qcfg, sites = _prepare(model, qcfg, sample_tokens)
  ptq = intercept.strip(model)
  quantize_weights_in_place(ptq, weight_plans(qcfg, sites))
  if qcfg.quantizes_activations:
    ptq = intercept.install(ptq, intercept.DistillaxProvider(qcfg.rules, quantize_weights=False),
                            sample_tokens)
  return ptq
