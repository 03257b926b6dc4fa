"""Helpers for the chat and record tests: a tokenizer trained here and saved as transformers
saves one (with a chat template), chat templates in the styles real models use, records made
from the embedded corpus, and writers for JSONL and Parquet files.

Imported as `tests.data.chat_testing`.
"""

import json
import os
import random

import numpy as np

from distillax.data import stdlib_files

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
VOCAB_SIZE = 384

# ChatML (Qwen), no generation tags: the assistant mask is inferred from the template's output.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# The same output, with transformers' {% generation %} tags around what the assistant writes.
CHATML_TAGGED = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Llama 3 style: BOS from the special-token map, trimmed contents, a default system prompt,
# a tojson'd metadata field (non-ASCII and HTML characters must come out as they are), and
# generation tags.
LLAMA3_TAGGED = """{{ bos_token }}
{%- if messages[0]['role'] != 'system' %}
{{- '<|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant'] %}
{{- raise_exception('unknown role ' + message['role']) }}
{%- endif %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
{%- if message['role'] == 'assistant' %}
{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
{%- else %}
{{- message['content'] | trim }}
{%- if message['meta'] is defined %}{{- ' ' + message['meta'] | tojson }}{%- endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen3 style: only the assistant turn after the last user message carries a (here empty)
# reasoning block, so earlier turns render differently from a chat cut after them: the prefix
# property breaks for them and their spans come from their content.
THINK = """{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last_user %}
{{- '<think>\n' + (message['reasoning_content'] | default('')) + '\n</think>\n\n' }}
{%- endif %}
{{- message['content'] + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def training_lines():
  root, _ = stdlib_files()
  with open(os.path.join(root, "os.py"), encoding="utf-8") as f:
    return [line for line in f.read().splitlines() if line.strip()][:600]


def corpus_sentences(count, seed):
  """Short pieces of the embedded corpus (stdlib source lines, some with non-ASCII added)."""
  rng = random.Random(seed)
  lines = [l.strip() for l in training_lines() if len(l.strip()) > 8]
  extras = ["", " é€", " 中文", " (ok)"]
  return [rng.choice(lines)[:60] + rng.choice(extras) for _ in range(count)]


def save_tokenizer(folder, chat_template):
  """A byte-level BPE trained on the corpus, saved by transformers' save_pretrained with
  `chat_template` (transformers 5 writes tokenizer.json, tokenizer_config.json and
  chat_template.jinja). Returns the folder."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(training_lines(), trainer)
  hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                               pad_token=PAD)
  hf.chat_template = chat_template
  hf.save_pretrained(str(folder))
  return str(folder)


def load_hf(folder):
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(str(folder))


def conversation(seed, turns=2, system=True):
  """system? + (user, assistant) * turns, contents from the corpus."""
  texts = corpus_sentences(2 * turns + 1, seed)
  messages = [{"role": "system", "content": texts[0]}] if system else []
  for t in range(turns):
    messages.append({"role": "user", "content": texts[1 + 2 * t]})
    messages.append({"role": "assistant", "content": texts[2 + 2 * t]})
  return messages


def conversations(count, seed=0):
  return [conversation(seed * 1000 + i, turns=1 + i % 3, system=i % 2 == 0)
          for i in range(count)]


def write_jsonl(path, rows):
  with open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  return str(path)


def write_parquet(path, rows, row_group_size=4):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=row_group_size)
  return str(path)


def reconstruct_by_bos(batches, bos_id):
  """(tokens, per-token train mask) of each document in packed batches read in order. Chats
  under a template that starts with BOS: a piece starting with BOS begins a document, any other
  piece continues the last one. The mask of token i + 1 is the loss mask of pair i; a
  document's first token has none (0)."""
  docs = []
  for batch in batches:
    for b in range(batch["segment_ids_BxL"].shape[0]):
      seg = batch["segment_ids_BxL"][b]
      for s in range(1, int(seg.max(initial=0)) + 1):
        idx = np.flatnonzero(seg == s)
        inputs = batch["inputs_BxL"][b, idx].tolist()
        if inputs[0] == bos_id:
          docs.append(([], [0.0]))
        else:
          docs[-1][0].pop()  # the piece's first input is the last target of the one before
        tokens, mask = docs[-1]
        tokens.extend(inputs)
        tokens.append(int(batch["targets_BxL"][b, idx[-1]]))
        mask.extend(batch["loss_mask_BxL"][b, idx].tolist())
  return [(np.asarray(t), np.asarray(m, np.float32)) for t, m in docs]
