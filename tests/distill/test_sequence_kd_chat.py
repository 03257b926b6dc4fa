"""Sequence-level KD on chat records: the teacher answers the turns before each chat's last
answer, the samples are prompt/completion chats, and the student trains on the answers alone.

The chats are read with `data.layout='messages'`; the sample file is read in its own layout
whatever the original data's is. The greedy answers are checked against a second code path:
the prompt rendered by transformers' apply_chat_template and a plain argmax loop over full
forward passes of the teacher (no KV cache, no sampler).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax import main as cli
from distillax.configs import sequence_kd as seqkd_config
from distillax.data import default_data_config, make_tokenizer, make_train_iterator
from distillax.distill.sequence_kd import sample_record, take_prompt_records
from distillax.models.presets import get_preset
from distillax.models.init import create_model
from distillax.trainers import SequenceKDRecipe
from tests.data import chat_testing as ct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "distillax/configs/sequence_kd.py") + ":tiny"
PROMPT_LEN, NEW_TOKENS, PROMPTS = 96, 24, 12


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp("seqkd_chat")
  folder = ct.save_tokenizer(root / "tokenizer", ct.CHATML)
  chats = ct.conversations(40, seed=3)
  source = ct.write_jsonl(root / "chats.jsonl", [{"messages": m} for m in chats])
  overrides = [f"--config.data.source={source}", f"--config.data.tokenizer=hf:{folder}",
               "--config.data.layout=messages", "--config.sequence_kd.temperature=0",
               f"--config.sequence_kd.prompt_len={PROMPT_LEN}",
               f"--config.sequence_kd.max_new_tokens={NEW_TOKENS}",
               f"--config.sequence_kd.num_prompts={PROMPTS}"]
  workdir = str(root / "run")
  assert cli.main(["distillax", "train", "--config", CONFIG, "--workdir", workdir]
                  + overrides) == 0
  config = seqkd_config.get_config("tiny")
  config.data.source, config.data.tokenizer = source, f"hf:{folder}"
  config.data.layout = "messages"
  config.sequence_kd.temperature = 0.0
  config.sequence_kd.prompt_len, config.sequence_kd.max_new_tokens = PROMPT_LEN, NEW_TOKENS
  config.sequence_kd.num_prompts = PROMPTS
  samples = [json.loads(line) for line in
             open(os.path.join(workdir, "teacher_samples.jsonl"), encoding="utf-8")]
  return workdir, config, chats, samples, ct.load_hf(folder)


def test_samples_answer_the_turns_before_each_last_answer(run):
  _, config, chats, samples, hf_tok = run
  assert len(samples) == config.sequence_kd.num_prompts
  prompts = {json.dumps(m[:max(i for i, t in enumerate(m) if t["role"] == "assistant")])
             for m in chats}
  for sample in samples:
    assert set(sample) == {"prompt", "completion"}
    assert json.dumps(sample["prompt"]) in prompts
    assert [t["role"] for t in sample["completion"]] == ["assistant"]
    assert len(hf_tok(sample["prompt"][-1]["content"]).input_ids) > 0


def test_answers_are_the_teachers_greedy_text_up_to_a_special_token(run):
  _, config, _, samples, hf_tok = run
  # The teacher the distillation recipe builds from teacher.preset: fresh weights, seed + 1000.
  teacher = create_model(get_preset("tiny").replace(vocab_size=ct.VOCAB_SIZE), seed=1000)
  logits_fn = jax.jit(lambda tokens: teacher(tokens).logits_BxLxV)
  specials = set(hf_tok.all_special_ids) | {hf_tok.convert_tokens_to_ids(t)
                                            for t in ct.SPECIAL_TOKENS}
  for sample in samples:
    ids = hf_tok.apply_chat_template(sample["prompt"], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    assert len(ids) <= PROMPT_LEN
    tokens = np.zeros((1, PROMPT_LEN + NEW_TOKENS), np.int32)  # one shape: one compilation
    tokens[0, :len(ids)] = ids
    for n in range(len(ids), len(ids) + NEW_TOKENS):  # causal: what follows n - 1 cannot matter
      tokens[0, n] = int(jnp.argmax(logits_fn(jnp.asarray(tokens))[0, n - 1]))
    answer = tokens[0, len(ids):len(ids) + NEW_TOKENS].tolist()
    cut = next((i for i, t in enumerate(answer) if t in specials), len(answer))
    assert sample["completion"][0]["content"] == hf_tok.decode(answer[:cut])


def test_the_student_trains_on_the_answers_alone(run):
  workdir, config, _, samples, hf_tok = run
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert summary["finished"] and np.isfinite(summary["loss"])
  data = SequenceKDRecipe(config, workdir=workdir).samples.data_config()
  data.num_epochs, data.shuffle_buffer = 1, 0
  trained = 0
  for batch in make_train_iterator(data, global_batch_size=8, seq_len=32, seed=0):
    trained += int(batch["loss_mask_BxL"].sum())
  # What the answer adds to the chat as transformers renders it: the answer and its
  # <|im_end|>, not the newline the template writes after it.
  want = 0
  for sample in samples:
    whole = hf_tok.apply_chat_template(sample["prompt"] + sample["completion"], tokenize=True,
                                       return_dict=True)["input_ids"]
    prompt = hf_tok.apply_chat_template(sample["prompt"], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    assert whole[:len(prompt)] == prompt
    want += len(whole) - len(prompt) - 1
  assert trained == want


def test_prompt_completion_records_give_their_whole_prompt_and_an_answer_cut_at_a_special(
    tmp_path):
  folder = ct.save_tokenizer(tmp_path / "tokenizer", ct.CHATML)
  hf_tok, tokenizer = ct.load_hf(folder), make_tokenizer(f"hf:{folder}")
  source = ct.write_jsonl(tmp_path / "pc.jsonl", [
      {"prompt": "def join(a, *p):", "completion": " return a"},
      {"prompt": "import os\n" * 20, "completion": " too long a prompt to cut"}])
  data = default_data_config()
  data.source, data.tokenizer, data.validation_fraction = source, f"hf:{folder}", 0.0
  prompts = take_prompt_records(data, tokenizer, count=4, prompt_len=16, seed=0)
  words = hf_tok("def join(a, *p):", add_special_tokens=False).input_ids
  assert [p.tokens.tolist() for p in prompts] == [[hf_tok.bos_token_id] + words]
  end_of_turn = hf_tok.convert_tokens_to_ids("<|im_end|>")
  answer = hf_tok("    return os.sep", add_special_tokens=False).input_ids
  continuation = answer + [end_of_turn] + hf_tok("junk", add_special_tokens=False).input_ids
  assert sample_record(prompts[0], continuation, tokenizer, include_prompt=True) == {
      "prompt": "def join(a, *p):", "completion": "    return os.sep"}
