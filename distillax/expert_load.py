"""`distillax expert-load`: each expert's share of the routed tokens, per layer, on your data.

  distillax expert-load --model runs/moe_teacher --keep_top 2
  distillax expert-load --config distillax/configs/distill_moe.py:tiny --json load.json
  distillax expert-load --model out/qwen3_moe_hf --config distillax/configs/lm.py \
      --config.data.tokenizer=hf:out/qwen3_moe_hf/tokenizer.json --config.data.source=docs.jsonl

Which model: --model (a run's workdir, read at its newest checkpoint; or a Hugging Face
directory, which needs a --config for the data), else the --config's teacher (a distillation
config: the model whose experts a derived student keeps), else its student. It runs over
`--batches` batches of the train split of the job's data section (a run's own config.json
unless --config is given) and counts, per layer, the (token, expert) choices of every router
over the real tokens: the router's top k, before any capacity drops. Shares are those counts
over each layer's total (each layer's shares sum to 1).

Prints a table (rows: the model's routed layers, by its own layer numbers; columns: experts,
in %) and with --keep_top N the `--config.student.from_teacher.experts=...` flag that keeps
each layer's N most loaded experts: one tuple per layer of the model, () for a dense one
(DeepSeek V3's and GLM-4.5's first layers), which `train` takes as printed for a student of
any of its blocks. A model that routes within groups of experts (model.router_groups > 1,
DeepSeek's n_group) is refused --keep_top up front: `train` refuses any subset of its experts.
--json FILE writes the same as strict JSON. Pruning by load and then distilling is the recipe
NVIDIA used for Nemotron-3-Nano.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax.data import batch as batch_spec
from distillax.errors import ConfigError, UserError
from distillax.framework import losses
from distillax import jsonio


def _hf_recipe(config, model_dir: str, model_overrides):
  from distillax.trainers import hf_checkpoint_recipe
  recipe = hf_checkpoint_recipe(config, model_dir, model_overrides=model_overrides,
                                purpose="whose data section names the tokens to route")
  return recipe, recipe.sources.student, recipe.model_config


def _model_source(config, model_dir: str | None, model_overrides):
  """(recipe: data, mesh and rules; the source of the model to measure; its config)."""
  from distillax.eval.loss import run_recipe
  from distillax.trainers import recipe_for, sources as src
  if model_dir:
    if src.is_hf_checkpoint(model_dir):
      return _hf_recipe(config, model_dir, model_overrides)
    recipe = run_recipe(model_dir, config)
    source = src.RunSource(model_dir, "--model", base_of=src.student_source)
    return recipe, source, recipe.model_config
  if config is None:
    raise UserError("expert-load needs --model (a run's workdir or a Hugging Face directory) "
                    "or a --config whose teacher or student is a mixture of experts")
  recipe = recipe_for(config, model_overrides=model_overrides)
  teacher = getattr(recipe, "teacher_source", None)
  if teacher is not None:
    return recipe, teacher, recipe.teacher_model_config
  return recipe, recipe.sources.student, recipe.model_config


def _named(source) -> str:
  return source.named() if source.kind != "fresh" or source.field else (
      "--config's model section (fresh weights)")


def _check(source, cfg, keep_top: int | None, batches: int, json_path: str | None) -> None:
  if not cfg.num_experts:
    raise UserError(f"{_named(source)} is a dense model (model.num_experts=0); expert-load "
                    f"measures the experts of a mixture of experts: pass an MoE model")
  if keep_top is not None and not cfg.num_experts_per_tok <= keep_top <= cfg.num_experts:
    raise UserError(f"--keep_top={keep_top} must be from {cfg.num_experts_per_tok} (the experts "
                    f"each token is routed to) to {cfg.num_experts} (all of them)")
  if keep_top is not None and cfg.router_groups > 1:
    raise UserError(f"--keep_top={keep_top}: {_named(source)} routes within "
                    f"model.router_groups={cfg.router_groups} groups of consecutive experts, "
                    f"and train refuses a student that keeps a subset of them "
                    f"(student.from_teacher.experts); derive it keeping every expert, or run "
                    f"expert-load without --keep_top to see the loads")
  if batches < 1:
    raise UserError(f"--batches={batches} must be at least 1")
  if json_path and (os.path.isdir(json_path)
                    or not os.path.isdir(os.path.dirname(json_path) or ".")):
    raise UserError(f"--json {json_path} must be a file in an existing directory")


def count_assignments(model: nnx.Module, batches) -> tuple[np.ndarray, int]:
  """((layers, experts) router choices summed over `batches`' real tokens, real tokens)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def load(state, batch):
    out = nnx.merge(graphdef, state)(batch[batch_spec.INPUTS], **losses.model_inputs(batch),
                                     return_logits=False)
    return out.router_stats.load_E, out.router_stats.tokens

  total, tokens = 0.0, 0
  for batch in batches:
    load_NxE, tokens_N = jax.device_get(load(state, {k: jnp.asarray(v) for k, v in
                                                     batch.items()}))
    total = total + np.asarray(load_NxE, np.float64)
    tokens += int(tokens_N[0])
  return np.asarray(total), tokens


def top_experts(counts_NxE: np.ndarray, n: int) -> list[list[int]]:
  """Each layer's n most chosen experts (ties: the lower index), in ascending index order."""
  return [sorted(int(e) for e in np.argsort(-row, kind="stable")[:n]) for row in counts_NxE]


def routed_layers(cfg) -> list[int]:
  """The model's own numbers of its routed layers (the rows of the counts, in order)."""
  return [i for i in range(cfg.num_layers) if cfg.layer_is_moe(i)]


def keep_flag(cfg, keep: list[list[int]]) -> str:
  """The student.from_teacher.experts flag `train` takes: one tuple per layer of the model, the
  routed layers' kept experts and () for a dense layer, shell-quoted."""
  per_layer = dict(zip(routed_layers(cfg), keep))
  rows = ", ".join("(" + ", ".join(map(str, per_layer.get(i, ()))) +
                   ("," if len(per_layer.get(i, ())) == 1 else "") + ")"
                   for i in range(cfg.num_layers))
  return f"--config.student.from_teacher.experts='({rows},)'"


def _table(shares_NxE: np.ndarray, layers: list[int]) -> list[str]:
  """Rows: the routed layers, by the model's layer numbers; columns: experts (16 per block),
  shares in %."""
  lines = []
  E = shares_NxE.shape[1]
  for start in range(0, E, 16):
    cols = range(start, min(start + 16, E))
    lines.append("layer " + "".join(f"{'e' + str(e):>7}" for e in cols))
    for layer, row in zip(layers, shares_NxE):
      lines.append(f"{layer:>5} " + "".join(f"{100 * row[e]:>6.1f}%" for e in cols))
  return lines


def run_expert_load(config, model_dir: str | None, *, json_path: str | None = None,
                    keep_top: int | None = None, batches: int = 8, model_overrides=None) -> int:
  """Prints the table (and the keep flag); writes --json last, so an error writes nothing."""
  from distillax.trainers import check_recipe_data
  recipe, source, cfg = _model_source(config, model_dir, model_overrides)
  _check(source, cfg, keep_top, int(batches), json_path)
  # The batches run through the measured model (the --config's teacher, say): its positions.
  check_recipe_data(recipe, routed=(cfg, _named(source)))
  model = source.load(cfg, recipe.mesh, recipe.rules, seed=int(recipe.config.seed))
  data = recipe.train_iterator()
  counts_NxE, tokens = count_assignments(model, (next(data) for _ in range(int(batches))))
  if tokens == 0:
    raise ConfigError("the data gave no real token to route; check the data section")
  shares_NxE = counts_NxE / counts_NxE.sum(axis=1, keepdims=True)
  result = {"model": _named(source), "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok, "batches": int(batches),
            "tokens": tokens, "assignments": counts_NxE.astype(int).tolist(),
            "share": shares_NxE.tolist()}
  lines = [f"distillax expert-load: {_named(source)}: {tokens} tokens ({batches} batches of "
           f"{recipe.batch_size}x{recipe.seq_len}), {cfg.num_experts} experts, k="
           f"{cfg.num_experts_per_tok}; share of each layer's routed tokens"] + _table(
               shares_NxE, routed_layers(cfg))
  dense = [i for i in range(cfg.num_layers) if not cfg.layer_is_moe(i)]
  if dense:
    lines.append(f"layers {', '.join(map(str, dense))} are dense (no experts)")
  if keep_top is not None:
    keep = top_experts(counts_NxE, keep_top)
    result.update(keep_top=keep_top, keep=keep, layers=routed_layers(cfg))
    lines.append(f"keep the {keep_top} most loaded experts of each layer (one tuple per layer"
                 f"{', () for a dense one' if dense else ''}): {keep_flag(cfg, keep)}")
  if jax.process_index() == 0:
    print("\n".join(lines), flush=True)
    if json_path:
      with open(json_path, "w") as f:
        jsonio.dump(result, f, indent=1)
  return 0
