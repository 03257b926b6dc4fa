"""On-policy distillation from a mixture-of-experts teacher resumes exactly after SIGKILL.

One run holds both properties (it was two tests, each with its own uninterrupted run):
- on-policy: the sampling key is a function of the checkpointed RNG and step, the prompt
  position is part of the data state, so the resumed run's metrics rows (sampled completion
  lengths included) and final parameters equal an uninterrupted run's;
- the teacher (a Qwen3-MoE Hugging Face checkpoint: softmax-top-k routing with
  norm_topk_prob, qk-norm; its experts over data, ep_tp as distill_moe.py:tiny) is never
  written to the run's checkpoints; the rerun reloads it from its files and checks its
  fingerprint.
With lmbda < 1 the run also takes teacher-forced logit-KD steps from that teacher (the
`distill` loss on the data), so off-policy distillation from the MoE teacher resumes too."""

import json
import os

import jax
import orbax.checkpoint as ocp
import pytest
import torch
import transformers

from tests.trainers.kill_and_resume import TIMING_KEYS, assert_same_run, killed_run, resume_step
from tests.trainers.test_base import ROOT, _checkpoint_steps

STEPS = 8
ARGS = ["--config", os.path.join(ROOT, "distillax/configs/on_policy.py") + ":tiny",
        f"--config.train.steps={STEPS}", "--config.train.log_every=3",
        "--config.train.eval_every=4", "--config.checkpoint.every_steps=3",
        "--config.checkpoint.keep=3", "--config.on_policy.divergence=sampled_kl",
        "--config.on_policy.lmbda=0.75",
        # distill_moe.py:tiny's mesh: the teacher's 4 experts over a data axis of 4, the rest
        # tensor parallel over a model axis of 2
        "--config.partitioning.strategy=ep_tp", "--config.mesh.data=4", "--config.mesh.model=2"]
TIMING = TIMING_KEYS | {"sampled_tokens_per_s", "sampling_share"}


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


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_sigkill_then_resume_reloads_the_moe_teacher_and_equals_an_uninterrupted_run(
    teacher_dir, tmp_path):
  args = ARGS + [f"--config.teacher.hf_path={teacher_dir}"]
  # Killed inside the step-4 eval or just after it.
  reference, workdir = killed_run(tmp_path, args, lambda w: 3 in _checkpoint_steps(w),
                                  "the step-3 checkpoint")
  assert STEPS not in _checkpoint_steps(workdir), "the run finished before the kill"
  assert resume_step(workdir, args) in (3, 6)
  want = assert_same_run(workdir, reference, STEPS, TIMING)
  assert any(0 < r.get("on_policy", 0) < 1 for r in want)  # both branches ran in a window
  samples = sorted(p.name for p in (workdir / "on_policy_samples").iterdir())
  assert samples == ["step_000004.jsonl", "step_000008.jsonl"]
  for name in samples:
    assert (workdir / "on_policy_samples" / name).read_text() == (
        reference / "on_policy_samples" / name).read_text()
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
