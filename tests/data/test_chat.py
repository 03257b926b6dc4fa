"""Chat records: rendering and token ids equal transformers' apply_chat_template, the assistant
mask equals transformers' (or an independent piecewise encoding), and masked tokens change
neither the loss nor the gradient of any objective term."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.data import chat_testing as ct
from tests.data.data_testing import data_config
from distillax.data import (ChatRecord, PromptCompletion, encode_chat, make_eval_iterator,
                            make_tokenizer, make_train_iterator, template_for)
from distillax.data.chat import encode_prompt_completion
from distillax.errors import ConfigError, UserError

TEMPLATES = {"chatml": ct.CHATML, "chatml_tagged": ct.CHATML_TAGGED,
             "llama3_tagged": ct.LLAMA3_TAGGED, "think": ct.THINK}


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
  return {name: ct.save_tokenizer(tmp_path_factory.mktemp(name), template)
          for name, template in TEMPLATES.items()}


def records():
  """Multi-turn chats with and without a system message, a single user turn, contents with
  surrounding whitespace (the Llama template trims them), a None-valued key (dropped, as
  transformers drops it) and a tojson'd field with HTML and non-ASCII characters."""
  out = ct.conversations(6, seed=3)
  out.append([{"role": "user", "content": "  spaced out \n", "name": None},
              {"role": "assistant", "content": "\tanswer here  "}])
  out.append([{"role": "user", "content": "meta?", "meta": {"tag": "<b>é</b>", "n": 1}},
              {"role": "assistant", "content": "yes"}])
  out.append([{"role": "user", "content": "only a question"}])
  return out


def ids_of(encoding):
  return list(encoding["input_ids"] if not isinstance(encoding, list) else encoding)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_rendering_and_ids_equal_transformers(tokenizer_dirs, name):
  hf = ct.load_hf(tokenizer_dirs[name])
  tokenizer = make_tokenizer(f"hf:{tokenizer_dirs[name]}")
  template = template_for(tokenizer)
  assert template.source == TEMPLATES[name]  # read back from what save_pretrained wrote
  for messages in records():
    for add_generation_prompt in (False, True):
      want = hf.apply_chat_template(messages, tokenize=False,
                                    add_generation_prompt=add_generation_prompt)
      assert template.render(messages, add_generation_prompt) == want
      want_ids = ids_of(hf.apply_chat_template(messages, tokenize=True,
                                               add_generation_prompt=add_generation_prompt))
      assert tokenizer.encode_with_offsets(want)[0].tolist() == want_ids
    ids, _ = encode_chat(ChatRecord(tuple(messages)), tokenizer, template)
    assert ids.tolist() == ids_of(hf.apply_chat_template(messages, tokenize=True))


def test_special_tokens_come_from_tokenizer_config(tokenizer_dirs):
  tokenizer = make_tokenizer(f"hf:{tokenizer_dirs['llama3_tagged']}")
  hf = ct.load_hf(tokenizer_dirs["llama3_tagged"])
  assert tokenizer.bos_id == hf.bos_token_id and tokenizer.eos_id == hf.eos_token_id
  assert tokenizer.pad_id == hf.pad_token_id
  assert tokenizer.special_tokens_map == {"bos_token": ct.BOS, "eos_token": ct.EOS,
                                          "pad_token": ct.PAD}


@pytest.mark.parametrize("form", ["string", "named list"])
def test_template_in_an_older_tokenizer_config(tokenizer_dirs, tmp_path, form):
  """Models saved before transformers 5 keep the template in tokenizer_config.json (a string,
  or a list of named templates) and may write special tokens as AddedToken objects."""
  import json
  import shutil
  shutil.copy(os.path.join(tokenizer_dirs["chatml"], "tokenizer.json"), tmp_path)
  template = (ct.LLAMA3_TAGGED if form == "string"
              else [{"name": "tool_use", "template": "unused"},
                    {"name": "default", "template": ct.LLAMA3_TAGGED}])
  config = {"chat_template": template, "eos_token": ct.EOS,
            "bos_token": {"content": ct.BOS, "special": True, "__type": "AddedToken"}}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  tokenizer = make_tokenizer(f"hf:{tmp_path / 'tokenizer.json'}")
  assert tokenizer.chat_template == ct.LLAMA3_TAGGED
  assert tokenizer.special_tokens_map == {"bos_token": ct.BOS, "eos_token": ct.EOS}
  messages = records()[0]
  want = ct.load_hf(tokenizer_dirs["llama3_tagged"]).apply_chat_template(messages,
                                                                          tokenize=False)
  assert template_for(tokenizer).render(messages) == want


@pytest.mark.parametrize("name", ["chatml_tagged", "llama3_tagged"])
def test_mask_equals_transformers_generation_mask(tokenizer_dirs, name):
  hf = ct.load_hf(tokenizer_dirs[name])
  tokenizer = make_tokenizer(f"hf:{tokenizer_dirs[name]}")
  template = template_for(tokenizer)
  assert template.has_generation_tags
  for messages in records():
    want = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    ids, mask = encode_chat(ChatRecord(tuple(messages)), tokenizer, template)
    assert ids.tolist() == list(want["input_ids"])
    assert mask.tolist() == list(want["assistant_masks"])


def test_untagged_template_mask_equals_the_tagged_one(tokenizer_dirs):
  """ChatML without tags renders what the tagged ChatML renders; the mask inferred from the
  template's output equals the one transformers reads from the tags."""
  tagged = ct.load_hf(tokenizer_dirs["chatml_tagged"])
  tokenizer = make_tokenizer(f"hf:{tokenizer_dirs['chatml']}")
  template = template_for(tokenizer)
  assert not template.has_generation_tags
  for messages in records():
    want = tagged.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    ids, mask = encode_chat(ChatRecord(tuple(messages)), tokenizer, template)
    assert ids.tolist() == list(want["input_ids"])
    assert mask.tolist() == list(want["assistant_masks"])
    assert mask.sum() > 0 or all(m["role"] != "assistant" for m in messages)


def piecewise_think(tokenizer, messages):
  """THINK's tokens and mask written out piece by piece: headers and user/system turns 0, each
  assistant turn's body (the reasoning block on the turn after the last user message, content,
  <|im_end|>) 1, the newline after it 0."""
  last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
  ids, mask = [], []

  def add(text, trained):
    piece = tokenizer.encode(text)
    ids.extend(piece)
    mask.extend([float(trained)] * len(piece))

  for i, m in enumerate(messages):
    if m["role"] == "assistant":
      add("<|im_start|>assistant\n", False)
      body = "<think>\n\n</think>\n\n" if i > last_user else ""
      add(body + m["content"] + "<|im_end|>", True)
      add("\n", False)
    else:
      add(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", False)
  return ids, mask


def test_mask_of_a_template_that_rewrites_earlier_turns(tokenizer_dirs):
  tokenizer = make_tokenizer(f"hf:{tokenizer_dirs['think']}")
  hf = ct.load_hf(tokenizer_dirs["think"])
  template = template_for(tokenizer)
  multi_turn = 0
  for messages in records()[:-1]:
    want_ids, want_mask = piecewise_think(tokenizer, messages)
    assert want_ids == ids_of(hf.apply_chat_template(messages, tokenize=True))
    ids, mask = encode_chat(ChatRecord(tuple(messages)), tokenizer, template)
    assert ids.tolist() == want_ids
    assert mask.tolist() == want_mask
    multi_turn += sum(m["role"] == "assistant" for m in messages) > 1
  assert multi_turn >= 2  # earlier turns (the content fallback) were exercised


def test_prompt_completion_masks(tokenizer_dirs):
  tokenizer = make_tokenizer(f"hf:{tokenizer_dirs['chatml']}")
  hf = ct.load_hf(tokenizer_dirs["chatml"])
  # Plain strings: [BOS] prompt completion [EOS], the completion and EOS trained. The prompt
  # ends in a newline, where the byte-level pre-tokenizer always splits.
  prompt, completion = "def f(x):\n", "    return x + 1  # é"
  assert tokenizer.encode(prompt + completion) == (tokenizer.encode(prompt)
                                                   + tokenizer.encode(completion))
  ids, mask = encode_prompt_completion(PromptCompletion(prompt, completion), tokenizer, True)
  head, tail = tokenizer.encode(prompt), tokenizer.encode(completion)
  assert ids.tolist() == [tokenizer.bos_id] + head + tail + [tokenizer.eos_id]
  assert mask.tolist() == [0.0] * (1 + len(head)) + [1.0] * (len(tail) + 1)
  # Conversational: everything after the prompt rendered with its generation prompt is
  # trained, except the newline the template writes after the final <|im_end|>.
  chat = ct.conversation(5, turns=2)
  prompt_messages, completion_messages = chat[:-1], chat[-1:]
  full = ids_of(hf.apply_chat_template(chat, tokenize=True))
  before = ids_of(hf.apply_chat_template(prompt_messages, tokenize=True,
                                         add_generation_prompt=True))
  assert full[:len(before)] == before and hf.decode(full[-1:]) == "\n"
  record = ChatRecord(tuple(chat), prompt_messages=len(prompt_messages))
  ids, mask = encode_chat(record, tokenizer, template_for(tokenizer))
  assert ids.tolist() == full
  assert mask.tolist() == [0.0] * len(before) + [1.0] * (len(full) - len(before) - 1) + [0.0]
  _, all_mask = encode_chat(record, tokenizer, template_for(tokenizer), loss_on="all")
  assert all_mask.tolist() == [1.0] * len(full)
  del completion_messages


def test_byte_tokenizer_with_a_template_file(tmp_path):
  """data.chat_template renders chats for a tokenizer without one; byte offsets map the
  trained characters onto exactly their bytes."""
  path = tmp_path / "chatml.jinja"
  path.write_text(ct.CHATML)
  tokenizer = make_tokenizer("byte")
  template = template_for(tokenizer, str(path))
  messages = ct.conversation(8, turns=2)
  ids, mask = encode_chat(ChatRecord(tuple(messages)), tokenizer, template)
  trained = tokenizer.decode(ids[mask > 0])
  # The byte tokenizer has no control tokens, so the newline after <|im_end|> stays trained:
  # the span is all the template writes for the turn after the generation prompt.
  assert trained == "".join(m["content"] + "<|im_end|>\n" for m in messages
                            if m["role"] == "assistant")
  with pytest.raises(UserError, match="has no chat template.*data.chat_template"):
    encode_chat(ChatRecord(tuple(messages)), tokenizer, template_for(tokenizer))
  with pytest.raises(UserError, match="not a readable file"):
    template_for(tokenizer, str(tmp_path / "missing.jinja"))


def test_config_errors(tmp_path):
  source = ct.write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in ct.conversations(4)])
  kwargs = dict(global_batch_size=2, seq_len=16, process_index=0, process_count=1)
  with pytest.raises(UserError, match="layout='messages'.*has none.*data.chat_template"):
    make_eval_iterator(data_config(source=source, eval_source=source, layout="messages"),
                       **kwargs)
  with pytest.raises(ConfigError, match="data.loss_on='prompt' is not one of assistant, all"):
    make_eval_iterator(data_config(source=source, eval_source=source, loss_on="prompt"), **kwargs)
  with pytest.raises(ConfigError, match="data.layout='chat' is not one of"):
    make_eval_iterator(data_config(source=source, eval_source=source, layout="chat"), **kwargs)
  bad = tmp_path / "bad.jinja"
  bad.write_text("{% for m in messages %}")
  with pytest.raises(UserError, match="chat template does not parse"):
    make_eval_iterator(data_config(source=source, eval_source=source, chat_template=str(bad)),
                       **kwargs)
  # A template that refuses a record names the record.
  strict = tmp_path / "strict.jinja"
  strict.write_text("{{ raise_exception('no system messages') }}")
  it = make_eval_iterator(data_config(source=source, eval_source=source,
                                      chat_template=str(strict)), **kwargs)
  with pytest.raises(UserError, match=r"c\.jsonl: line 1: the chat template failed on it "
                                      r"\(no system messages\)"):
    next(it)


# ---- masked tokens change neither loss nor gradient ---------------------------------------------

def chat_batch(tmp_path, tokenizer_dir, seq_len):
  chats = ct.conversations(12, seed=9)
  source = ct.write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in chats])
  cfg = data_config(source=source, tokenizer=f"hf:{tokenizer_dir}", validation_fraction=0.0,
                    shuffle_buffer=0)
  it = make_train_iterator(cfg, global_batch_size=4, seq_len=seq_len, seed=0, process_index=0,
                           process_count=1)
  return next(it)


def perturbed(batch, rng, vocab):
  """Random targets wherever the loss mask is 0, and random inputs where a segment's last
  position is masked (only that position can see its own input)."""
  out = {k: v.copy() for k, v in batch.items()}
  masked = batch["loss_mask_BxL"] == 0
  out["targets_BxL"][masked] = rng.integers(0, vocab, int(masked.sum()))
  seg = batch["segment_ids_BxL"]
  last = (seg > 0) & (np.concatenate([seg[:, 1:], np.zeros_like(seg[:, :1])], 1) != seg)
  changed = last & masked
  out["inputs_BxL"][changed] = (batch["inputs_BxL"][changed] + 1 +
                                rng.integers(0, vocab - 1, int(changed.sum()))) % vocab
  return out, int(masked.sum()), int(changed.sum())


def loss_and_grad(objective, student, teacher):
  sg, ss = nnx.split(student)
  tg, ts = nnx.split(teacher)

  @jax.jit
  def run(ss, ts, batch):
    def loss(ss):
      out = objective(nnx.merge(sg, ss), {"teacher": nnx.merge(tg, ts)}, batch, None)
      return out.loss_sum, out
    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(ss)
    return out.loss_sum, out.sums, grads

  return lambda batch: jax.device_get(run(ss, ts, {k: jnp.asarray(v) for k, v in batch.items()}))


def objectives():
  from distillax.distill import (AttentionTransfer, FeaturePooling, FeatureProjection, LogitKD,
                                 make_distill_objective)
  from distillax.trainers import lm_objective
  composite = (LogitKD(temperature=1.5, alpha=0.6, top_k=5) + 0.5 * AttentionTransfer({0: 1})
               + FeaturePooling({2: 3}, loss="mse", weight=0.2)
               + FeatureProjection({1: 2}, weight=0.3))
  return {"lm": (lm_objective, None),
          "logit_kd_full_logits": (make_distill_objective(LogitKD(alpha=0.5), chunk_size=None),
                                   None),
          "composite_chunked": (make_distill_objective(composite, chunk_size=40), composite)}


def test_masked_tokens_change_neither_loss_nor_gradient(tmp_path, tokenizer_dirs):
  from distillax.distill import DistillStudent
  from tests.distill import helpers
  from tests.support.models import NORMS_NEAR_ONE, random_model
  seq_len = 32
  batch = chat_batch(tmp_path, tokenizer_dirs["chatml"], seq_len)
  mask = batch["loss_mask_BxL"]
  assert 0 < mask.sum() < (batch["segment_ids_BxL"] > 0).sum()  # prompts really are masked
  vocab = ct.VOCAB_SIZE
  student_config = helpers.STUDENT_CONFIG.replace(vocab_size=vocab, max_seq_len=seq_len)
  teacher_config = helpers.TEACHER_CONFIG.replace(vocab_size=vocab, max_seq_len=seq_len)
  other, count, inputs_changed = perturbed(batch, np.random.default_rng(0), vocab)
  assert count > 0 and inputs_changed > 0
  trained = np.argwhere(mask > 0)[0]
  control = {k: v.copy() for k, v in batch.items()}
  control["targets_BxL"][tuple(trained)] = (control["targets_BxL"][tuple(trained)] + 1) % vocab
  for name, (objective, strategy) in objectives().items():
    model = random_model(student_config, 3, NORMS_NEAR_ONE)
    student = model if strategy is None else DistillStudent(
        model, strategy, teacher_embed_dim=teacher_config.embed_dim, rngs=nnx.Rngs(1))
    run = loss_and_grad(objective, student, random_model(teacher_config, 4, NORMS_NEAR_ONE))
    loss, sums, grads = run(batch)
    loss_other, sums_other, grads_other = run(other)
    np.testing.assert_array_equal(loss_other, loss, err_msg=name)
    for key in sums:
      np.testing.assert_array_equal(sums_other[key], sums[key], err_msg=f"{name}: {key}")
    for g, g_other in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_other)):
      np.testing.assert_array_equal(g_other, g, err_msg=name)
    # The check can fail: one changed trained target changes the loss.
    assert run(control)[0] != loss, name
