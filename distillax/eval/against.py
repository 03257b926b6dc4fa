"""`distillax eval --against`: how far a (quantized) model moved from its full-precision twin.

  distillax eval --model runs/qat --against runs/fp
  distillax eval --model out/q_hf --against out/fp_hf --config distillax/configs/lm.py
  distillax eval --model out/q4/model-q4_0.gguf --against runs/fp

Both models read the same eval tokens (the --model run's eval batches, as `distillax eval`
takes them: its own config.json, or --config's data section; a Hugging Face directory needs
--config) and every real token's next-token distribution is compared (framework/fidelity.py):
KL(P_against || P_model) mean, p99 and max, same-top-1, top-p agreement (the model's top token
inside the twin's 0.9 nucleus), the perplexity ratio and each side's mean NLL. --model runs in
the form it trained (a QAT run's fake-quant forward, LoRA merged); --against in its plain
weights (a QAT run's full-precision weights). The two must have the same model shape.
A .gguf --model is run by llama.cpp itself on --against's eval tokens (each packed document from
position 0; reference kernels, f32 KV cache): the deployed file's distance from its twin.
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import numpy as np
from flax import nnx

from distillax.data.batch import INPUTS, LOSS_MASK, POSITIONS, SEGMENT_IDS, TARGETS
from distillax.errors import UserError
from distillax.framework import fidelity

TOP_P = 0.9


def _check_same_shape(model, twin, model_dir: str, against: str) -> None:
  from distillax.models.config import SHAPE, fields_of_kind
  for name in fields_of_kind(SHAPE):
    mine, theirs = getattr(model.config, name), getattr(twin.config, name)
    if mine != theirs:
      raise UserError(f"--against {against} has model.{name}={theirs!r}, --model {model_dir} "
                      f"{mine!r}: compare a model with its own full-precision twin (the same "
                      f"shape)")


@functools.partial(jax.jit, static_argnums=(0, 2))
def _per_token(graph_model, state_model, graph_twin, state_twin, batch):
  """Per-token figures of one batch, flattened to [B*L]."""
  outputs = []
  for graph, state in ((graph_model, state_model), (graph_twin, state_twin)):
    out = nnx.merge(graph, state)(batch[INPUTS], positions_BxL=batch[POSITIONS],
                                  segment_ids_BxL=batch[SEGMENT_IDS])
    outputs.append(out.logits_BxLxV.reshape(-1, out.logits_BxLxV.shape[-1]))
  quant_NxV, fp_NxV = outputs
  targets_N = batch[TARGETS].reshape(-1)
  nll_model_N, nll_against_N = fidelity.target_nll_pair(quant_NxV, fp_NxV, targets_N)
  return {"kl": fidelity.per_token_kl(fp_NxV, quant_NxV),
          "top1": fidelity.same_top1(fp_NxV, quant_NxV),
          "top_p": fidelity.in_top_p(fp_NxV, quant_NxV, TOP_P),
          "nll_model": nll_model_N, "nll_against": nll_against_N}


def _eval_batches(config, model_dir: str):
  from distillax.eval.loss import run_recipe
  from distillax.trainers import hf_checkpoint_recipe, is_hf_checkpoint
  if is_hf_checkpoint(model_dir):
    return hf_checkpoint_recipe(config, model_dir, purpose="naming the eval data").eval_iterator()
  return run_recipe(model_dir, config).eval_iterator()


def fidelity_against(config, model_dir: str, against: str) -> dict[str, float]:
  """The fidelity figures of `model_dir` against `against` over the eval tokens."""
  from distillax.generate import load_model_dir
  if not model_dir:
    raise UserError("--model is required with --against: the (quantized) run to compare, e.g. "
                    "--model runs/qat --against runs/fp")
  batches = _eval_batches(config, model_dir)
  model = load_model_dir(model_dir, config)
  twin = load_model_dir(against, config, full_precision=True)
  model.command = twin.command = "eval"
  _check_same_shape(model.model, twin.model, model_dir, against)
  return fidelity_over(model.model, twin.model, batches)


def fidelity_over(model, twin, batches) -> dict[str, float]:
  """The fidelity figures of `model` against its full-precision `twin` over `batches`' real
  tokens (the demo's report batches, or a run's eval batches)."""
  graph_model, state_model = nnx.split(model)
  graph_twin, state_twin = nnx.split(twin)
  values, masks = {}, []
  for batch in batches:
    got = jax.device_get(_per_token(graph_model, state_model, graph_twin, state_twin,
                                    {k: jax.numpy.asarray(v) for k, v in batch.items()}))
    for key, value in got.items():
      values.setdefault(key, []).append(np.asarray(value))
    masks.append(np.asarray(batch[LOSS_MASK]).reshape(-1) > 0)
  mask = np.concatenate(masks)
  return _summary({k: np.concatenate(v) for k, v in values.items()}, mask)


def _summary(joined: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, float]:
  out = fidelity.kl_summary(joined["kl"], mask)
  out["same_top1"] = fidelity.share(joined["top1"], mask)
  out[f"in_top_p{TOP_P:g}"] = fidelity.share(joined["top_p"], mask)
  out["perplexity_ratio"] = fidelity.perplexity_ratio(joined["nll_model"], joined["nll_against"],
                                                      mask)
  out["nll_model"] = float(joined["nll_model"][mask].mean())
  out["nll_against"] = float(joined["nll_against"][mask].mean())
  out["tokens"] = int(mask.sum())
  return out


@functools.partial(jax.jit, static_argnums=0)
def _logits(graph, state, batch):
  return nnx.merge(graph, state)(batch[INPUTS], positions_BxL=batch[POSITIONS],
                                 segment_ids_BxL=batch[SEGMENT_IDS]).logits_BxLxV


def gguf_fidelity_against(config, gguf: str, against: str) -> dict[str, float]:
  """The fidelity figures of a GGUF file run by llama.cpp against the run (or Hugging Face
  directory) `against`, over `against`'s eval tokens: each packed document is evaluated by
  llama.cpp alone from position 0, as distillax's segment-masked forward sees it."""
  from distillax.edge import measurements
  from distillax.edge import completions as gguf_completions
  from distillax.generate import load_model_dir
  batches = list(_eval_batches(config, against))
  twin = load_model_dir(against, config, full_precision=True)
  twin.command = "eval"

  def check(dims):
    for name, theirs in dims.items():
      mine = getattr(twin.model.config, name)
      if mine != theirs:
        raise UserError(f"--against {against} has model.{name}={mine!r}, --model {gguf} "
                        f"{theirs!r}: compare a GGUF file with the full-precision run it was "
                        f"exported from (the same shape)")
  segs = measurements.segments(batches)
  if jax.process_index() == 0:
    print(f"distillax eval: {gguf} run by {gguf_completions.describe().rsplit(', ', 1)[0]}",
          file=sys.stderr, flush=True)
  quant = gguf_completions.segment_logits(gguf, [s[3] for s in segs], check)
  graph, state = nnx.split(twin.model)
  full = [np.asarray(jax.device_get(_logits(graph, state, {k: jax.numpy.asarray(v)
                                                            for k, v in b.items()})))
          for b in batches]
  fp_NxV = np.concatenate([full[b][row, first:first + len(ids)]
                           for b, row, first, ids, _, _ in segs])
  quant_NxV = np.concatenate(quant)
  targets_N = np.concatenate([s[4] for s in segs]).astype(np.int32)
  mask = np.concatenate([s[5] for s in segs]) > 0
  joined = {"kl": fidelity.per_token_kl(fp_NxV, quant_NxV),
            "top1": fidelity.same_top1(fp_NxV, quant_NxV),
            "top_p": fidelity.in_top_p(fp_NxV, quant_NxV, TOP_P),
            "nll_model": fidelity.target_nll(quant_NxV, targets_N),
            "nll_against": fidelity.target_nll(fp_NxV, targets_N)}
  return _summary({k: np.asarray(jax.device_get(v)) for k, v in joined.items()}, mask)


def run_eval_against(config, model_dir: str | None, against: str) -> int:
  """Prints the figures as one JSON object; 0."""
  from distillax.edge.completions import is_gguf
  if is_gguf(against):
    raise UserError(f"--against {against} is a GGUF file; compare against the full-precision "
                    f"run or Hugging Face directory, and pass the GGUF as --model")
  if is_gguf(model_dir):
    figures = gguf_fidelity_against(config, model_dir, against)
  else:
    figures = fidelity_against(config, model_dir, against)
  if jax.process_index() == 0:
    print(json.dumps(figures, sort_keys=True, allow_nan=False), flush=True)
  return 0
