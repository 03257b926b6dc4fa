"""Tunix's side of benchmarks/kd_vocab.py: its DistillationTrainer + LogitStrategy on llama3
models of the shapes distillax trains, timed and sized the way kd_vocab.py does its own.

Tunix 0.1.7 is never a distillax dependency: this module imports it at the top, and kd_vocab.py
imports this module only where Tunix is installed (a scratch venv, see kd_vocab.py's docstring).
Tunix's llama3 model ignores `rope_theta` and initialises MLP kernels at zero: step cost depends
on the shapes only, so the comparison holds.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.distillation import distillation_trainer as dt
from tunix.distillation import strategies
from tunix.models.llama3 import model as llama

from benchmarks.lib import common
from distillax.framework import optim
from distillax.framework.backends import compiled_stats


def tunix_config(cfg):
  """Tunix llama3 ModelConfig with the shapes of a distillax TransformerConfig."""
  return llama.ModelConfig(num_layers=cfg.num_layers, vocab_size=cfg.vocab_size,
                           embed_dim=cfg.embed_dim, hidden_dim=cfg.mlp_dim,
                           num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                           num_kv_heads=cfg.num_kv_heads, rope_theta=int(cfg.rope_theta),
                           norm_eps=cfg.norm_eps, weight_tying=cfg.tie_embeddings)


def _model_inputs(x):
  B, L = x.input_tokens.shape
  causal = jnp.tril(jnp.ones((L, L), bool))[None]
  return {"input_tokens": x.input_tokens, "input_mask": x.input_mask,
          "positions": jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
          "attention_mask": causal & x.input_mask.astype(bool)[:, None, :]}


def _forward(model, input_tokens, input_mask, positions, attention_mask):
  del input_mask
  logits, _ = model(input_tokens, positions, None, attention_mask)
  return logits


def _labels(vocab: int):
  """One-hot next tokens, as Tunix's LogitStrategy takes its labels."""
  def labels(input_tokens, **_):
    return jax.nn.one_hot(jnp.roll(input_tokens, -1, axis=1), vocab)
  return labels


class TunixSystem:
  """Callable like `common.Stepper` (`system(n)` runs n steps); `stats` and `peak_at` give the
  compiled figures. A step is what Tunix's train loop does per step: the teacher's jitted
  forward (`_prepare_inputs`), then the jitted train step."""

  name = "tunix"

  def __init__(self, student_cfg, teacher_cfg, batch: dict, *, temperature: float,
               alpha: float):
    self.vocab, self.seq_len = student_cfg.vocab_size, batch["inputs_BxL"].shape[1]
    student = llama.Llama3(tunix_config(student_cfg), rngs=nnx.Rngs(0))
    teacher = llama.Llama3(tunix_config(teacher_cfg), rngs=nnx.Rngs(1))
    strategy = strategies.LogitStrategy(
        student_forward_fn=_forward, teacher_forward_fn=_forward,
        labels_fn=_labels(self.vocab), temperature=temperature, alpha=alpha)
    tx, _ = optim.make_optimizer(common.benchmark_optimizer(), 1000)
    trainer = dt.DistillationTrainer(student, teacher, strategy, tx,
                                     dt.TrainingConfig(eval_every_n_steps=10**9))
    self.trainer = trainer.with_gen_model_input_fn(_model_inputs)
    self.train_step, _ = self.trainer.jit_train_and_eval_step(cache_nnx_graph=False)
    self.example = dt.TrainingInput(input_tokens=jnp.asarray(batch["inputs_BxL"]),
                                    input_mask=jnp.asarray(batch["loss_mask_BxL"], jnp.int32))
    self.losses: list[float] = []
    start = time.perf_counter()
    self.stats = self._stats(batch["inputs_BxL"].shape[0])
    self.compile_s = time.perf_counter() - start

  def __call__(self, steps: int) -> None:
    loss = None
    for _ in range(steps):
      prepared = self.trainer._prepare_inputs(self.example)  # the teacher's jitted forward
      loss, _, _ = self.train_step(prepared)
    jax.block_until_ready(loss)
    self.losses.append(float(loss))

  def _stats(self, batch: int) -> dict:
    """Both programs compiled for `batch` rows; the peak adds what stays resident meanwhile
    (the teacher's weights during the train step, the student's state during the teacher's
    forward)."""
    L = self.seq_len
    example = dt.TrainingInput(input_tokens=jax.ShapeDtypeStruct((batch, L), jnp.int32),
                               input_mask=jax.ShapeDtypeStruct((batch, L), jnp.int32))
    inputs = jax.eval_shape(_model_inputs, example)
    strategy, teacher = self.trainer.strategy, self.trainer.teacher_model
    t_stats = compiled_stats(strategy._teacher_forward_fn.lower(teacher, **inputs).compile())
    train_in = dt.TrainingInput(input_tokens=example.input_tokens, input_mask=example.input_mask,
                                teacher_output=jax.ShapeDtypeStruct((batch, L, self.vocab),
                                                                    jnp.float32))
    step = self.train_step
    s_stats = compiled_stats(step.func.lower(*step.args, train_in).compile())
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
    teacher_bytes = nbytes(nnx.state(teacher))
    student_bytes = nbytes(nnx.state(self.trainer.model)) + nbytes(
        nnx.state(self.trainer.optimizer))
    peak = max(common.peak_bytes(t_stats) + student_bytes,
               common.peak_bytes(s_stats) + teacher_bytes)
    return {"teacher_program": t_stats, "train_program": s_stats, "peak": peak,
            "temp_size_in_bytes": t_stats["temp_size_in_bytes"] + s_stats["temp_size_in_bytes"],
            "flops": t_stats.get("flops", 0.0) + s_stats.get("flops", 0.0)}

  def peak_at(self, batch: int) -> int:
    return self._stats(batch)["peak"]
