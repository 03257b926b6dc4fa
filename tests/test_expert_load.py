"""`distillax expert-load` on a tiny mixture-of-experts run (trained with a capacity, whose
dropped-assignment metric its metrics.jsonl holds): per-layer shares that sum to 1 and equal a
numpy count of the routers' top k on the same tokens, the keep flag, and one-line refusals that
write nothing."""

import ast
import json
import os
import shlex

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.data import batch as batch_spec
from distillax.errors import ConfigError
from distillax.eval.loss import run_recipe
from distillax.framework import losses
from distillax.main import main
from distillax.models.moe.layer import expert_capacity
from distillax.trainers.sources import RunSource, student_source
from tests.test_main import LM

DISTILL_MOE = os.path.join(os.path.dirname(LM), "distill_moe.py")
TINY_MOE = ["--config.model.num_experts=4", "--config.model.moe_mlp_dim=32"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
  """A 3-step tiny MoE run whose experts take at most half of the assignments (capacity 0.5)."""
  workdir = tmp_path_factory.mktemp("moe") / "run"
  assert main(["distillax", "train", "--config", f"{LM}:tiny", "--workdir", str(workdir),
               *TINY_MOE, "--config.model.moe_capacity_factor=0.5", "--config.train.steps=3",
               "--config.train.log_every=1", "--config.train.eval_every=0"]) == 0
  return workdir


def test_a_run_with_capacity_logs_the_share_of_assignments_it_dropped(moe_run):
  rows = [json.loads(line) for line in (moe_run / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in rows if "loss" in r]
  assert len(train) == 3
  # 8 x 32 tokens per call, k = 2 of E = 4: capacity ceil(0.5 * 256 * 2 / 4) = 64 per expert,
  # 256 slots for 2 * (real tokens) assignments: at least the rest is dropped.
  assert expert_capacity(256, 2, 4, 0.5) == 64
  for row in train:
    floor = 1 - 4 * 64 / (2 * row["tokens"])
    for layer in (0, 1):
      assert floor - 1e-6 <= row[f"expert_tokens_dropped_l{layer}"] < 1, row


def _numpy_counts(workdir, batches: int) -> np.ndarray:
  """The routers' top-2 choices over the real tokens of the run's first train batches, counted
  in numpy from the model's router logits."""
  recipe = run_recipe(str(workdir))
  model = RunSource(str(workdir), "--model", base_of=student_source).load(
      recipe.model_config, recipe.mesh, recipe.rules, seed=0)
  data = recipe.train_iterator()
  router_logits = nnx.jit(lambda m, batch: m(batch[batch_spec.INPUTS], **losses.model_inputs(
      batch), return_logits=False, return_router_logits=True).router_logits_NxBxLxE)
  counts = np.zeros((2, 4), np.int64)
  for _ in range(batches):
    batch = {k: jnp.asarray(v) for k, v in next(data).items()}
    logits = np.asarray(router_logits(model, batch))
    real = np.asarray(batch[batch_spec.SEGMENT_IDS]) > 0
    top2 = np.argsort(-logits, axis=-1, kind="stable")[..., :2]  # (N, B, L, 2)
    for layer in range(2):
      counts[layer] += np.bincount(top2[layer][real].reshape(-1), minlength=4)
  return counts


def test_expert_load_shares_match_a_numpy_count_and_print_the_keep_flag(moe_run, tmp_path,
                                                                        capsys):
  out = tmp_path / "load.json"
  assert main(["distillax", "expert-load", "--model", str(moe_run), "--batches", "2",
               "--keep_top", "3", "--json", str(out)]) == 0
  printed = capsys.readouterr().out
  result = json.loads(out.read_text())
  counts = _numpy_counts(moe_run, 2)
  assert result["assignments"] == counts.tolist()
  assert result["tokens"] * 2 == int(counts[0].sum())  # k choices per real token
  shares = np.asarray(result["share"])
  np.testing.assert_allclose(shares.sum(axis=1), [1.0, 1.0], rtol=1e-12)
  np.testing.assert_allclose(shares, counts / counts.sum(axis=1, keepdims=True), rtol=1e-12)
  keep = [sorted(np.argsort(-row, kind="stable")[:3].tolist()) for row in counts]
  assert result["keep"] == keep
  flag = "--config.student.from_teacher.experts='(" + "".join(
      "(" + ", ".join(map(str, row)) + "), " for row in keep)[:-2] + ",)'"
  assert flag in printed, printed


@pytest.mark.parametrize("args,says", [
    ([f"--config={LM}:tiny"], "--config's model section (fresh weights) is a dense model "
                              "(model.num_experts=0)"),
    (["--model", "{run}", f"--config={LM}:tiny", *TINY_MOE,
      "--config.data.source=/nonexistent/docs.jsonl"],
     "data source '/nonexistent/docs.jsonl': no such file or directory"),
    (["--model", "{run}", "--keep_top", "5"], "--keep_top=5 must be from 2 (the experts each "
                                              "token is routed to) to 4 (all of them)"),
])
def test_expert_load_refusals_are_one_line_and_write_nothing(moe_run, tmp_path, capsys, args,
                                                             says):
  out = tmp_path / "load.json"
  args = [a.replace("{run}", str(moe_run)) for a in args]
  code = main(["distillax", "expert-load", *args, "--json", str(out)])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and says in err[0], err
  assert not out.exists()


def test_the_documented_pruning_recipe_gives_a_run_that_eval_and_expert_load_read(tmp_path,
                                                                                  capsys):
  """docs/guides/moe.md's recipe as a user runs it: expert-load on the config's teacher prints a
  keep flag, a distillation with those kept experts and router distillation trains, and then
  `eval --model` and
  `expert-load --model` read the pruned run (they used to refuse it: its config.json still named
  the kept experts). eval's loss is the run's own final eval row (same batches, same weights)."""
  assert main(["distillax", "expert-load", "--config", f"{DISTILL_MOE}:tiny", "--batches", "1",
               "--keep_top", "3"]) == 0
  line = next(line for line in capsys.readouterr().out.splitlines() if "experts=" in line)
  flag = next(word for word in shlex.split(line.split(": ", 1)[1])  # as a shell passes it
              if word.startswith("--config.student.from_teacher.experts="))
  run = tmp_path / "moe_kd"
  assert main(["distillax", "train", "--config", f"{DISTILL_MOE}:tiny", "--workdir", str(run),
               "--config.partitioning.strategy=fsdp", "--config.mesh.data=-1",
               "--config.mesh.model=1", "--config.student.from_teacher.layers=(0, 1)", flag,
               "--config.distill.router.weight=1", "--config.train.steps=1",
               "--config.optimizer.warmup_steps=0", "--config.train.eval_batches=1"]) == 0
  capsys.readouterr()
  trained = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  final_eval = [row for row in trained if "eval_loss" in row][-1]

  assert main(["distillax", "eval", "--model", str(run)]) == 0
  evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert evaluated["eval_tokens"] == final_eval["eval_tokens"]
  np.testing.assert_allclose(evaluated["eval_loss"], final_eval["eval_loss"], rtol=1e-5)
  # Router distillation (moe.md's --config.distill.router.weight=1) reads the kept-expert map
  # from the run, as training did (it used to refuse: no kept-expert map).
  np.testing.assert_allclose(evaluated["eval_router_kd"], final_eval["eval_router_kd"],
                             rtol=1e-5)

  out = tmp_path / "load.json"
  assert main(["distillax", "expert-load", "--model", str(run), "--batches", "1",
               "--json", str(out)]) == 0
  shares = np.asarray(json.loads(out.read_text())["share"])
  assert shares.shape == (2, 3)  # the student's two layers, three kept experts each
  np.testing.assert_allclose(shares.sum(axis=1), [1.0, 1.0], rtol=1e-12)


def test_keep_top_of_a_teacher_with_dense_layers_prints_a_flag_train_takes(tmp_path, capsys):
  """A Qwen3-MoE teacher whose layers 0 and 2 are dense (issue 55): the table's rows are its
  layers 1 and 3, and the flag holds one tuple per teacher layer, () for the dense ones, which
  the derived student's source takes as printed, for all four blocks or for two of them."""
  from distillax.models.presets import get_preset
  from distillax.trainers.sources import experts as kept
  out = tmp_path / "load.json"
  assert main(["distillax", "expert-load", "--config", f"{DISTILL_MOE}:tiny",
               "--config.teacher.preset=tiny_qwen3_moe", "--batches", "1", "--keep_top", "3",
               "--json", str(out)]) == 0
  printed = capsys.readouterr().out.splitlines()
  assert [line.split()[0] for line in printed[2:4]] == ["1", "3"], printed
  assert "layers 0, 2 are dense (no experts)" in printed
  line = next(line for line in printed if "experts=" in line)
  flag = next(word for word in shlex.split(line.split(": ", 1)[1])
              if word.startswith("--config.student.from_teacher.experts="))
  value = ast.literal_eval(flag.split("=", 1)[1])
  keep = json.loads(out.read_text())["keep"]
  assert value == ((), tuple(keep[0]), (), tuple(keep[1]))
  teacher = get_preset("tiny_qwen3_moe")
  for layers in ((0, 1, 2, 3), (1, 2)):
    per_layer = kept.kept_experts(value, layers, teacher)
    assert per_layer == tuple(value[t] for t in layers)
    assert kept.with_kept_experts(teacher.select_layers(layers), per_layer).num_experts == 3
  # Before: one tuple per routed layer, which train refused.
  with pytest.raises(ConfigError, match="one such tuple per student layer"):
    kept.kept_experts(tuple(map(tuple, keep)), (0, 1, 2, 3), teacher)


def test_keep_top_of_a_teacher_routing_in_groups_is_refused_up_front(tmp_path, capsys):
  """DeepSeek V3 routes within groups of experts, whose subsets train refuses: --keep_top says
  so in one line before routing anything, and writes nothing."""
  out = tmp_path / "load.json"
  code = main(["distillax", "expert-load", "--config",
               f"{os.path.dirname(LM)}/distill_deepseek.py:tiny", "--keep_top", "4",
               "--json", str(out)])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1, err
  assert ("routes within model.router_groups=4 groups of consecutive experts, and train refuses "
          "a student that keeps a subset of them") in err[0]
  assert not out.exists()


@pytest.mark.parametrize("student", [[], ["--config.model.max_seq_len=256"]])
def test_expert_load_refuses_batches_longer_than_the_routed_models_positions(tmp_path, capsys,
                                                                             student):
  """The --config's teacher (tiny_moe, 128 positions) is the model routed: 256-token batches
  are refused naming it, whatever the unused student allows (it blamed model.max_seq_len, and
  once that was raised routed the batches past the teacher's positions without a word)."""
  out = tmp_path / "load.json"
  code = main(["distillax", "expert-load", "--config", f"{DISTILL_MOE}:tiny",
               "--config.train.seq_len=256", *student, "--json", str(out)])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1, err
  assert ("train.seq_len=256 exceeds the max_seq_len=128 of teacher.preset=tiny_moe, the model "
          "the batches are routed through; lower it (e.g. --config.train.seq_len=128)") in err[0]
  assert "model.max_seq_len" not in err[0] and not out.exists()
