"""Distillation from a mixture-of-experts teacher resumes exactly after SIGKILL: the teacher (a
Qwen3-MoE Hugging Face checkpoint: softmax-top-k routing with norm_topk_prob, qk-norm) is never
written to the run's checkpoints; the rerun reloads it from its files, checks its fingerprint,
and ends with the metrics rows and parameters of an uninterrupted run (distill_moe.py:tiny: its
experts over data, ep_tp)."""

import json
import os
import re
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import transformers

from distillax.framework.throughput import Throughput
from tests.trainers.test_base import (ROOT, _checkpoint_steps, _rows, _saved_params, _train,
                                      _train_rows, _wait_until)

STEPS = 24  # a few seconds of steps after the first checkpoint: the kill lands mid-run
ARGS = ["--config", os.path.join(ROOT, "distillax/configs/distill_moe.py") + ":tiny",
        f"--config.train.steps={STEPS}", "--config.train.log_every=2",
        "--config.train.eval_every=0", "--config.checkpoint.every_steps=3",
        "--config.checkpoint.keep=2"]
TIMING_KEYS = set(Throughput(1, 1.0, 1, 1.0).rates(1, 1.0))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
  """A random-init Qwen3-MoE (4 experts, top-2) over the byte tokenizer's 384-row vocabulary."""
  config = transformers.Qwen3MoeConfig(
      vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
      intermediate_size=128, moe_intermediate_size=32, norm_topk_prob=True,
      tie_word_embeddings=False, max_position_embeddings=128)
  torch.manual_seed(0)
  path = tmp_path_factory.mktemp("qwen3_moe_teacher")
  transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
  return path


def _untimed_rows(workdir):
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in _rows(workdir)]


def test_sigkill_then_resume_reloads_the_moe_teacher_and_equals_an_uninterrupted_run(
    teacher_dir, tmp_path):
  args = ARGS + [f"--config.teacher.hf_path={teacher_dir}"]
  reference = tmp_path / "uninterrupted"
  _train(reference, args=args)
  workdir = tmp_path / "killed"
  proc = _train(workdir, wait=False, args=args)
  _wait_until(proc, lambda: 3 in _checkpoint_steps(workdir) and (workdir / "metrics.jsonl")
              .exists() and max(_train_rows(workdir), default=0) >= 4, "step 4")
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  assert max(_train_rows(workdir)) < STEPS, "the run finished before the kill"
  rerun = _train(workdir, args=args)
  resumed = int(re.search(r"resuming from step (\d+)", rerun.output).group(1))
  assert 3 <= resumed < STEPS and resumed % 3 == 0
  assert _untimed_rows(workdir) == _untimed_rows(reference)
  got, want = _saved_params(workdir, STEPS), _saved_params(reference, STEPS)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The teacher came back from its files, not from the checkpoint: the saved state holds the
  # student and its optimizer alone (no frozen arrays, no router or stacked experts), and each
  # save names the teacher's source with the fingerprint the rerun checked.
  state = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(STEPS) / "state")
  assert jax.tree.leaves(state["frozen"]) == []
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  assert any("mlp" in p for p in paths) and not any("router" in p for p in paths)
  meta = json.loads((workdir / "checkpoints" / str(STEPS) / "meta" / "meta.json").read_text())
  teacher = meta["extra"]["sources"]["teacher"]
  assert str(teacher_dir) in teacher["source"]
  assert (teacher["config"]["num_experts"], teacher["config"]["router"],
          teacher["config"]["norm_topk_prob"]) == (4, "softmax_topk", True)
