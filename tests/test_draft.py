"""The EAGLE-3 draft job end to end, on one tiny run: what training keeps frozen, `eval --draft`,
`export --format speculators` loaded by speculators' own eagle3 model with the same draft logits,
and the one-line refusals.

The run regenerates its data (`draft.regenerate`: the target answers the train prompts first,
greedily here, and the head trains on the answers), so the same seconds of training also check
that path: the answers against an argmax loop over full forward passes (no KV cache, no
sampler), one load of the target for both, and a resume that trains on the same file. The data
as it is is trained end to end by tests/test_configs.py (draft_eagle3.py:tiny) and the demo's
draft stage.
"""

import json
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.data import PromptCompletion, batch as batch_spec
from distillax.data.chat import encode_prompt_completion
from distillax.distill.draft import shifted
from distillax.distill.sequence_kd import stop_ids, take_prompt_records
from distillax.main import main
from distillax.trainers import teacher_samples
from distillax.trainers.distill.recipe import DistillRecipe
from distillax.trainers.draft import DraftRecipe, frequent_ids, load_draft_run
from distillax.trainers.sources import load_run_config
from tests.support.models import greedy_tokens
from tests.support.speculators import import_speculators_eagle3

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRAFT = f"{ROOT}/distillax/configs/draft_eagle3.py:tiny"
PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 8, 12
REGENERATE = ["--config.draft.regenerate=True", "--config.sequence_kd.temperature=0",
              f"--config.sequence_kd.num_prompts={PROMPTS}",
              f"--config.sequence_kd.prompt_len={PROMPT_LEN}",
              f"--config.sequence_kd.max_new_tokens={NEW_TOKENS}"]


def _train(workdir, steps: int) -> int:
  return main(["distillax", "train", "--config", DRAFT, "--workdir", str(workdir),
               f"--config.train.steps={steps}", "--config.train.eval_every=2",
               "--config.checkpoint.every_steps=2", "--config.optimizer.warmup_steps=1",
               *REGENERATE])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A two-step run on the target's answers, and how many times it loaded the target."""
  workdir = tmp_path_factory.mktemp("draft") / "run"
  with mock.patch.object(DistillRecipe, "load_teacher", autospec=True,
                         side_effect=DistillRecipe.load_teacher) as load:
    assert _train(workdir, 2) == 0
  return str(workdir), load.call_count


@pytest.fixture(scope="module")
def run(trained):
  return trained[0]


@pytest.fixture(scope="module")
def loaded(run):
  return load_draft_run(run)


def test_the_draft_vocabulary_is_the_most_frequent_kept_targets():
  batches = [{"targets_BxL": np.array([[5, 5, 7, 9, 9, 9]]),
              "loss_mask_BxL": np.array([[1, 1, 1, 1, 1, 0]])},
             {"targets_BxL": np.array([[7, 3, 300, 300, 300, 2]]),
              "loss_mask_BxL": np.array([[1, 1, 1, 1, 1, 1]])}]
  # 9: 2 kept, 5: 2, 7: 2, then 2 and 3 once (300 is past the tokenizer's ids).
  np.testing.assert_array_equal(frequent_ids(batches, 4, 259), [2, 5, 7, 9])


def test_training_keeps_the_targets_parts_frozen_and_moves_the_rest(loaded):
  head, target, recipe = loaded
  d2t = np.asarray(head.d2t[...])
  assert len(d2t) == recipe.head_config.draft_vocab_size == 96 and np.all(np.diff(d2t) > 0)
  np.testing.assert_array_equal(head.embedding[...], target.embedder.embedding[...])
  np.testing.assert_array_equal(head.lm_head[...],
                                np.asarray(target.output_weight_DxV())[:, d2t])
  recipe.vocab_from_checkpoint = False  # the head as the run's first step built it: from data
  try:
    fresh = recipe.build(abstract=False)[0]
  finally:
    recipe.vocab_from_checkpoint = True
  np.testing.assert_array_equal(fresh.d2t[...], d2t)
  assert not np.allclose(fresh.fc[...], head.fc[...])
  assert not np.allclose(fresh.q[...], head.q[...])


def test_a_restored_head_reads_its_vocabulary_from_the_checkpoint_not_the_data(run, loaded,
                                                                              monkeypatch):
  """eval --draft and export restore the head: they neither read the train data to count the
  vocabulary again nor regenerate samples that are gone."""
  def no_data(self):
    raise AssertionError("a restored head read the train data")

  monkeypatch.setattr(DraftRecipe, "train_iterator", no_data)
  head = load_draft_run(run)[0]
  np.testing.assert_array_equal(head.d2t[...], loaded[0].d2t[...])


def test_eval_draft_prints_acceptance_lengths_for_each_proposal_count(run, capsys):
  capsys.readouterr()
  assert main(["distillax", "eval", "--draft", run, "--max_new_tokens", "8"]) == 0
  lines = capsys.readouterr().out.splitlines()
  rows = [line for line in lines if "proposed | acceptance length" in line]
  assert [int(r.split()[0]) for r in rows] == [1, 2, 3]
  for r in rows:
    length = float(r.split("acceptance length ")[1].split()[0])
    assert 1.0 <= length <= int(r.split()[0]) + 1


@pytest.mark.parametrize("argv,says", [
    (["--draft", "{tmp}/nothing"], "is not a directory"),
    (["--draft", "{run}", "--proposals", "0"], "--proposals=0 must be >= 1"),
    (["--draft", "{run}", "--model", "{run}"], "drop --model"),
    (["--model", "{run}", "--proposals", "2"], "add --draft DIR"),
])
def test_eval_draft_refuses_bad_input_in_one_line(run, tmp_path, capsys, argv, says):
  argv = [a.format(run=run, tmp=tmp_path) for a in argv]
  before = sorted(os.listdir(run))
  capsys.readouterr()
  assert main(["distillax", "eval", *argv]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and says in err[0], err
  assert sorted(os.listdir(run)) == before


def test_export_speculators_loads_in_speculators_with_the_same_draft_logits(run, loaded,
                                                                          tmp_path):
  import torch
  Eagle3DraftModel, Eagle3SpeculatorConfig = import_speculators_eagle3()
  out = tmp_path / "spec"
  assert main(["distillax", "export", "--workdir", run, "--output", str(out),
               "--format", "speculators"]) == 0
  config = json.loads((out / "config.json").read_text())
  assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 96
  assert config["transformer_layer_config"]["model_type"] == "llama"
  cfg = Eagle3SpeculatorConfig.from_pretrained(str(out))
  cfg.transformer_layer_config._attn_implementation = "eager"  # no flex attention on CPU
  theirs = Eagle3DraftModel.from_pretrained(str(out), config=cfg).float().eval()
  head = loaded[0]
  # The vocabulary maps as speculators reads them: target id = draft id + d2t[draft id].
  np.testing.assert_array_equal(theirs.d2t.numpy() + np.arange(96), head.d2t[...])
  assert theirs.t2d.numpy().sum() == 96 and theirs.t2d.numpy()[np.asarray(head.d2t[...])].all()
  # Three TTT steps on the same target hidden states and tokens (their forward returns draft
  # tokens: its LM head's outputs are caught on the way).
  L, T, D = 12, 3, head.config.layer.embed_dim
  rng = np.random.default_rng(0)
  aux = rng.normal(size=(1, L, len(head.config.aux_layers) * D)).astype(np.float32)
  ids = rng.integers(0, 259, size=(1, L)).astype(np.int32)
  caught = []
  theirs.lm_head.register_forward_hook(lambda m, i, o: caught.append(o.detach().numpy()))
  with torch.no_grad():
    theirs(torch.tensor(aux), torch.tensor(ids, dtype=torch.long),
           torch.ones(1, L, dtype=torch.long), position_ids=1 + torch.arange(L)[None],
           ttt_steps=T)

  @jax.jit
  def ours(aux, ids):
    steps = jnp.stack([shifted(ids, j) for j in range(T)])
    hidden = head.ttt_hidden(aux, steps, jnp.arange(L)[None], jnp.ones((1, L), jnp.int32))
    return jnp.stack([head.logits(hidden[j]) for j in range(T)])

  mine = np.asarray(ours(jnp.asarray(aux), jnp.asarray(ids)))
  assert len(caught) == T
  for j in range(T):
    np.testing.assert_allclose(mine[j], caught[j], atol=1e-4)
  assert min(np.abs(mine[j] - mine[j - 1]).max() for j in (1, 2)) > 1e-3  # the steps differ


@pytest.mark.parametrize("override,says", [
    ("--config.train.init_from={run}", "clear train.init_from"),
    ("--config.draft.aux_layers=(1,1,2)", "must be distinct hidden-state indices"),
    ("--config.draft.vocab_size=300", "more than the tokenizer's 259 ids"),
    ("--config.draft.ttt_steps=0", "draft.ttt_steps=0 must be >= 1"),
    ("--config.draft.regenerate=True --config.sequence_kd.max_new_tokens=0",
     "draft.regenerate=True: sequence_kd.max_new_tokens=0 must be >= 1"),
    ("--config.draft.regenerate=True --config.sequence_kd.prompt_len=120",
     "exceeds the target's max_seq_len=128"),
    (" ".join(REGENERATE[:-1]) + " --config.sequence_kd.max_new_tokens=13"
     " --config.sequence_kd.output={run}/teacher_samples.jsonl",  # samples of other settings
     f"written with sequence_kd.max_new_tokens={NEW_TOKENS}, and this run asks 13"),
])
def test_a_bad_draft_job_is_refused_in_one_line_before_anything_is_written(run, tmp_path, capsys,
                                                                           override, says):
  capsys.readouterr()
  assert main(["distillax", "train", "--config", DRAFT, "--workdir", str(tmp_path / "run"),
               *override.format(run=run).split()]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and says in err[0], err
  assert not (tmp_path / "run").exists()


def test_export_speculators_refuses_a_run_that_is_not_a_draft(tmp_path, capsys, run):
  config = json.loads(open(os.path.join(run, "config.json")).read())
  config["trainer"] = "lm"
  other = tmp_path / "lm_run"
  other.mkdir()
  (other / "config.json").write_text(json.dumps(config))
  capsys.readouterr()
  assert main(["distillax", "export", "--workdir", str(other), "--output",
               str(tmp_path / "out"), "--format", "speculators"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "not a draft run" in err[0]
  assert not (tmp_path / "out").exists()


def _expected_documents(recipe):
  """(ids, loss mask) of each prompt and the target's greedy answer, as training encodes them
  (text samples: what the head reads is the decoded answer encoded again)."""
  tokenizer = recipe.tokenizer
  prompts = take_prompt_records(recipe.config.data, tokenizer, count=PROMPTS,
                                prompt_len=PROMPT_LEN, seed=0)
  prompt_ids = np.stack([p.tokens for p in prompts])
  answers = greedy_tokens(recipe.load_teacher(), prompt_ids, NEW_TOKENS, tokenizer.vocab_size)
  stops, documents = stop_ids(tokenizer), []
  for ids, answer in zip(prompt_ids, answers.tolist()):
    answer = answer[:next((i for i, t in enumerate(answer) if t in stops), len(answer))]
    record = PromptCompletion(tokenizer.decode(ids[1:].tolist()), tokenizer.decode(answer))
    documents.append((record, encode_prompt_completion(record, tokenizer, add_bos=True)))
  return documents


def _places(ids, documents):
  """(loss mask, offset) of every place `ids` stand in one of the (ids, loss mask) documents."""
  return [(mask, o) for doc, mask in documents for o in range(len(doc) - len(ids) + 1)
          if np.array_equal(doc[o:o + len(ids)], ids)]


def test_the_head_trains_on_the_targets_greedy_answers_to_the_prompts(run):
  recipe = DraftRecipe(load_run_config(run), workdir=run)
  documents = _expected_documents(recipe)
  with open(os.path.join(run, teacher_samples.SAMPLES_FILE), encoding="utf-8") as f:
    samples = [json.loads(line) for line in f]
  assert samples == [{"prompt": r.prompt, "completion": r.completion} for r, _ in documents]
  # What the step reads: every packed piece is a span of a prompt and the target's answer
  # (pieces continue across rows), and its kept targets are the answer's (and its EOS) alone.
  batch = {k: np.asarray(v) for k, v in next(recipe.train_iterator()).items()}
  pieces = 0
  for row, segments in enumerate(batch[batch_spec.SEGMENT_IDS]):
    for segment in set(segments[segments > 0].tolist()):
      at = segments == segment
      ids = np.append(batch[batch_spec.INPUTS][row][at], batch[batch_spec.TARGETS][row][at][-1])
      kept = batch[batch_spec.LOSS_MASK][row][at]
      assert any(np.array_equal(mask[o + 1:o + len(ids)], kept)
                 for mask, o in _places(ids, [d for _, d in documents])), ids
      pieces += 1
  assert pieces >= batch[batch_spec.INPUTS].shape[0] and batch[batch_spec.LOSS_MASK].sum() > 0


def test_the_target_that_writes_the_answers_is_the_one_the_step_runs(trained):
  assert trained[1] == 1  # loaded once: to write the samples, then handed to the step


def test_a_resumed_run_trains_on_the_same_answers_without_regenerating(run, monkeypatch):
  """Last in the module: it trains the module's run one step further."""
  path = os.path.join(run, teacher_samples.SAMPLES_FILE)
  before = open(path, "rb").read()

  def regenerate(*args, **kwargs):
    raise AssertionError("a resumed run regenerated its samples")

  monkeypatch.setattr(teacher_samples, "generate_samples", regenerate)
  assert _train(run, 3) == 0
  assert open(path, "rb").read() == before
  assert json.load(open(os.path.join(run, "summary.json")))["step"] == 3
