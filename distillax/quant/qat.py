"""Quantization-aware training, its delayed start, and the post-training (PTQ) baseline.

`quantize_for_training` returns the model with a fake-quantized forward: each weight whose
matmul runs in a module matched by a rule is rounded to its grid where it is read (and, where
the rule says so, the activation entering that matmul is rounded too); gradients pass straight
through the rounding to the full-precision weights. Only the variables' type changes (a
`QuantSiteParam` is an `nnx.Param`): same paths, arrays, `logical_axes` and shardings, so
`build_engine(..., trainable=nnx.Param)`, every backend and every partitioning preset work
unchanged. Without activation quantization the model class is untouched; with it, the forward
runs under qwix's interception.

Delayed start (`QuantConfig.start_step`): the full-precision and the fake-quant model have the
same state tree (`check_swappable`), so the trainer swaps models at a step, not the state:

    qat_model = quantize_for_training(model, qcfg)
    check_swappable(model, qat_model)
    fp_engine = build_engine(model, extras, objective, ...)      # steps < qcfg.start_step
    qat_engine = build_engine(qat_model, extras, objective, ...)  # steps >= qcfg.start_step
    state = fp_engine.init_state(model, extras, seed)
    for step ...: state, m = (fp_engine if step < qcfg.start_step else qat_engine).runner(
        state, batch)

Both engines lay out and shard the state identically, so either accepts the other's state and
checkpoints are interchangeable; evaluate with the engine of the current phase. (Compile the
QAT engine lazily, `compile_now=False`, if the switch is far away.)

PTQ: `quantize_post_training` rounds the weights once (no training) and rounds activations
where configured: the forward of a fake-quant model that took no steps, and exactly what
`export.load_quantized` rebuilds from the integers on disk.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
from flax import nnx

from distillax.errors import ConfigError
from distillax.quant import intercept
from distillax.quant import round_once as round_once_module
from distillax.quant.config import QuantConfig
from distillax.quant.fakequant import QuantSiteParam, WeightQuant, fake_quantize_weight
from distillax.quant.graph import get_path, set_path
from distillax.quant.sites import MatmulSite, find_matmul_sites, has_wrapped_weights


def compute_dtype_of(model: nnx.Module) -> str:
  config = getattr(model, "config", None)
  return str(config.jnp_dtype) if config is not None else "float32"


def weight_quants(qcfg: QuantConfig, sites: list[MatmulSite], compute_dtype: str
                  ) -> dict[str, tuple[MatmulSite, WeightQuant]]:
  """{weight name: (site, how)} for every weight whose matmul module matches a rule with a
  weight type (first match wins; a rule with weight_qtype None exempts). An MoE's router stays
  in full precision whatever the rules (`MatmulSite.is_router`); its experts are quantized like
  any weight, per expert. With `qcfg.int8_matmul`, int8 x int8 per-channel weights multiply
  as int8 codes (`WeightQuant.int8_matmul`)."""
  plans = {}
  for site in sites:
    rule = qcfg.rule_for(site.module_path)
    if rule is None or rule.weight_qtype is None or site.is_router:
      continue
    wq = site.quant(rule.weight_qtype, rule.tile_size, compute_dtype, rule.act_qtype)
    if qcfg.int8_matmul and rule.int8_matmul_eligible:
      wq = dataclasses.replace(wq, int8_matmul=True, int8_backward=qcfg.int8_backward)
    plans[site.name] = (site, wq)
  return plans


def _check_rules_used(qcfg: QuantConfig, sites: list[MatmulSite]) -> None:
  paths = sorted({s.module_path for s in sites})
  for i, rule in enumerate(qcfg.rules):
    if not any(rule.matches(p) for p in paths):
      raise ConfigError(f"qat.rules[{i}] module_path={rule.module_path!r} matches no module with "
                        f"a weight matmul; module paths are {paths} ('' is the top module)")


def _prepare(model: nnx.Module, qcfg: Any, sample_tokens):
  qcfg = QuantConfig.from_config(qcfg)
  if not qcfg.rules:
    raise ConfigError("qat.rules is empty; give at least one (module_path, weight_qtype, "
                      "act_qtype, tile_size) rule")
  if has_wrapped_weights(model):
    raise ConfigError("fake quantization of a LoRA model is not supported; train adapters "
                      "over a quantized base with apply_lora(..., base_qtype='nf4'|'int4') "
                      "(QLoRA), or merge_lora(model) first")
  if any(isinstance(v, QuantSiteParam) for _, v in nnx.iter_graph(model)):
    raise ConfigError("the model is already quantized; start from the full-precision model "
                      "(distillax.quant.full_precision(model) for a QAT model)")
  sites = find_matmul_sites(model, sample_tokens)
  _check_rules_used(qcfg, sites)
  return qcfg, weight_quants(qcfg, sites, compute_dtype_of(model))


def _user_metadata(var: nnx.Variable) -> dict:
  """Metadata to carry over when a variable changes type (logical_axes and the like)."""
  return {k: v for k, v in var.get_metadata().items()
          if k not in ("hijax", "ref", "eager_sharding", "quant", "round_on_read")}


def _mark(model: nnx.Module, plans, *, round_on_read: bool, values=None,
          round_once: bool = False) -> nnx.Module:
  """A copy whose planned weights are QuantSiteParams (optionally with new values); with
  `round_once`, rounded once per forward before the layer loop (`round_once.install`)."""
  marked = intercept.strip(model)
  for name, (site, wq) in plans.items():
    var = get_path(marked, site.weight_path)
    value = var.get_raw_value() if values is None else values[name]
    if not (round_on_read or wq.act_qtype):
      var.set_value(value)  # PTQ without activation rounding: a plain Param on the grid
      continue
    set_path(marked, site.weight_path,
             QuantSiteParam(value, quant=wq, round_on_read=round_on_read, **_user_metadata(var)))
  if any(wq.act_qtype for _, wq in plans.values()):
    marked = intercept.install(marked, intercept.Interceptor())
  return round_once_module.install(marked) if round_once and round_on_read else marked


def quantize_for_training(model: nnx.Module, qcfg: QuantConfig | Mapping[str, Any],
                          sample_tokens: jax.Array | None = None, *,
                          round_once: bool = True) -> nnx.Module:
  """The model with a fake-quantized forward (straight-through backward); same state.

  `sample_tokens` (int32 [B, L]) only shapes an abstract trace that finds the matmuls; a dummy
  is used when omitted. Nothing is computed. `round_once` (the default) rounds every weight
  once per forward, before the layer loop and outside its remat (quant/round_once.py); False
  rounds each where it is read, inside the loop: the same numbers, for comparison.
  """
  _, plans = _prepare(model, qcfg, sample_tokens)
  return _mark(model, plans, round_on_read=True, round_once=round_once)


def full_precision(model: nnx.Module) -> nnx.Module:
  """The plain model of a fake-quant one: same arrays, plain Params, no interception."""
  plain = intercept.strip(model)
  for path, var in list(nnx.iter_graph(plain)):
    if isinstance(var, QuantSiteParam):
      set_path(plain, path, nnx.Param(var.get_raw_value(), **_user_metadata(var)))
  return plain


def check_swappable(a: nnx.Module, b: nnx.Module) -> None:
  """Raises unless `a` and `b` have the same state tree (paths, shapes, dtypes, logical axes),
  i.e. one TrainState serves both and the trainer may swap their GraphDefs."""
  def describe(m):
    def one(v):
      x = v.get_raw_value()
      return tuple(x.shape), str(x.dtype), v.get_metadata().get("logical_axes")
    return jax.tree.map(one, nnx.state(m), is_leaf=lambda x: isinstance(x, nnx.Variable))
  da, db = describe(a), describe(b)
  if jax.tree.structure(da) != jax.tree.structure(db) or jax.tree.leaves(da) != jax.tree.leaves(db):
    raise ConfigError("the two models have different state trees; a fake-quant model must come "
                      "from quantize_for_training(model) of the same model")


def rounded_weights(model: nnx.Module, plans) -> dict[str, jax.Array]:
  """{weight name: the stored weight rounded to its grid} (placement kept)."""
  out = {}
  for name, (site, wq) in plans.items():
    value = get_path(model, site.weight_path).get_raw_value()
    sharding = getattr(value, "sharding", None)
    out[name] = jax.jit(fake_quantize_weight, static_argnums=1, out_shardings=sharding)(value, wq)
  return out


def quantize_post_training(model: nnx.Module, qcfg: QuantConfig | Mapping[str, Any],
                           sample_tokens: jax.Array | None = None) -> nnx.Module:
  """PTQ: weights rounded once to their grid, activations rounded where configured."""
  _, plans = _prepare(model, qcfg, sample_tokens)
  # PTQ's weights are stored rounded: their matmuls multiply the rounded values (rounding them
  # to int8 codes again would move some).
  plans = {name: (site, dataclasses.replace(wq, int8_matmul=False, int8_backward=False))
           for name, (site, wq) in plans.items()}
  return _mark(model, plans, round_on_read=False, values=rounded_weights(model, plans))
