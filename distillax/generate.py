"""`distillax generate`: text from a trained run, a Hugging Face checkpoint or an export.

  distillax generate --model runs/kd --prompt "def fibonacci(n):" --max_new_tokens 64
  distillax generate --model out/kd_hf --messages '[{"role": "user", "content": "Hello"}]'

The model runs in distillax's own sampler (models/sampler.py: a KV cache; greedy at temperature
0, else temperature / top-k / top-p sampling) with the tokenizer it was trained with: a run's
data.tokenizer (and data.chat_template), a checkpoint directory's tokenizer.json (with --config,
that config's data.tokenizer when the directory has none). A prompt starts like a training
document (BOS first when the tokenizer has one and the run added it); chat turns are rendered
with the chat template as transformers renders them (data/chat.py), with the generation prompt.
Generation stops at EOS or at an end id of the directory's generation_config.json; what is
printed is the generated text alone. `--config` (optional) places the model: its mesh and
partitioning sections.

A run decodes with the forward it trained, the one `distillax eval` judges and its GGUF export
reproduces in llama.cpp: a QAT run's fake-quantized weights and activations (from
qat.start_step on), LoRA merged. `--full_precision` decodes a QAT run's plain weights instead.
One line on stderr names the form loaded. Only ids the tokenizer has are drawn (a padded
vocabulary's extra rows never are: models/sampler.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

import jax
import numpy as np

from distillax import partitioning as pt
from distillax.errors import UserError


@dataclasses.dataclass
class LoadedModel:
  """A model ready to prompt: its tokenizer, chat template and the ids ending a text; the
  weights are read when first used (so a wrong prompt fails before they load)."""

  model_dir: str
  config: object  # the --config (placement), or None
  tokenizer: object
  template: object  # data.chat.ChatTemplate or None
  stop_ids: tuple[int, ...]
  add_bos: bool = True
  full_precision: bool = False  # a QAT run's plain weights instead of its fake-quant forward
  command: str = "generate"  # the command named in the line saying what was loaded

  @functools.cached_property
  def placement(self):
    """(mesh, rules) the weights are placed on: --config's mesh and partitioning, else fsdp
    over every device."""
    return _placement(self.config)

  @functools.cached_property
  def model(self):
    from distillax.models.hf import checkpoint as hf
    from distillax.trainers import is_hf_checkpoint, load_as_trained
    mesh, rules = self.placement
    if is_hf_checkpoint(self.model_dir):
      model = hf.load(self.model_dir, mesh=mesh, rules=rules)
      form = "full precision (a Hugging Face checkpoint)"
    else:
      model, form = load_as_trained(self.model_dir, mesh, rules,
                                    full_precision=self.full_precision)
    print(f"distillax {self.command}: {self.model_dir} loaded as {form}", file=sys.stderr,
          flush=True)
    return model


def _placement(config):
  mesh = pt.create_mesh(config.mesh if config is not None else None)
  rules = pt.rules_from_config(config.partitioning if config is not None
                               else {"strategy": "fsdp"})
  return mesh, rules


def _generation_stop_ids(folder: str) -> list[int]:
  """eos_token_id of a generation_config.json in `folder` (an int or a list), if any."""
  file = os.path.join(folder, "generation_config.json")
  if not os.path.isfile(file):
    return []
  try:
    with open(file, encoding="utf-8") as f:
      ids = json.load(f).get("eos_token_id")
  except (OSError, ValueError, AttributeError) as e:
    raise UserError(f"{file} is not readable JSON ({e}); fix or remove it") from None
  return [int(i) for i in (ids if isinstance(ids, list) else [ids]) if i is not None]


def load_model_dir(model_dir: str, config=None, *, full_precision: bool = False) -> LoadedModel:
  """A run's newest checkpoint, or a Hugging Face directory, with what prompting it needs;
  `full_precision`: a QAT run's plain weights rather than the fake-quant forward it trained."""
  from distillax.data import make_tokenizer
  from distillax.data.chat import template_for
  from distillax.trainers import is_hf_checkpoint, load_run_config
  if not model_dir:
    raise UserError("--model is required: a run's --workdir, a Hugging Face checkpoint "
                    "directory or an export, e.g. --model runs/kd")
  if is_hf_checkpoint(model_dir):
    has_own = os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
    if not has_own and config is None:
      raise UserError(f"--model {model_dir} has no tokenizer.json; pass the --config whose "
                      f"data.tokenizer the model was trained with")
    tokenizer = make_tokenizer(f"hf:{model_dir}" if has_own else config.data.tokenizer)
    template, add_bos = template_for(tokenizer), True
  else:
    data = load_run_config(model_dir, "--model").data
    tokenizer = make_tokenizer(data.tokenizer)
    template = template_for(tokenizer, str(data.get("chat_template") or ""))
    add_bos = bool(data.get("add_bos", True))
  folder = os.path.dirname(getattr(tokenizer, "path", "")) or model_dir
  stops = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
  stops += [i for i in _generation_stop_ids(folder) if i not in stops]
  return LoadedModel(model_dir, config, tokenizer, template, tuple(stops), add_bos,
                     full_precision)


def read_messages(text: str) -> list[dict]:
  """Chat turns from --messages: JSON text or a .json file of a list of {role, content} (or
  an object with a "messages" list, a chat data set's record)."""
  source = "--messages"
  if os.path.isfile(text):
    source = text
    with open(text, encoding="utf-8") as f:
      text = f.read()
  try:
    value = json.loads(text)
  except ValueError as e:
    raise UserError(f"{source} is not JSON ({e}); give a list of turns, e.g. "
                    f"'[{{\"role\": \"user\", \"content\": \"Hi\"}}]'") from None
  if isinstance(value, dict):
    value = value.get("messages")
  if not (isinstance(value, list) and value and
          all(isinstance(m, dict) and "role" in m and "content" in m for m in value)):
    raise UserError(f"{source} must be a non-empty list of {{\"role\", \"content\"}} turns, "
                    f"e.g. '[{{\"role\": \"user\", \"content\": \"Hi\"}}]'")
  return value


def prompt_tokens(loaded: LoadedModel, prompt: str | None,
                  messages: list[dict] | None) -> list[int]:
  """The token ids generation continues: chat turns rendered with the generation prompt, or
  text."""
  if (prompt is None) == (messages is None):
    raise UserError("give exactly one of --prompt TEXT or --messages JSON")
  if messages is not None:
    if loaded.template is None:
      raise UserError(f"--messages needs a chat template, but {loaded.tokenizer!r} has none; "
                      f"use --prompt, or a tokenizer folder with chat_template.jinja")
    import jinja2
    try:
      text = loaded.template.render(messages, add_generation_prompt=True)
    except jinja2.TemplateError as e:
      raise UserError(f"the chat template refuses these --messages ({e}); check the roles and "
                      f"their order") from None
    return list(loaded.tokenizer.encode(text))
  bos = loaded.tokenizer.bos_id
  return ([bos] if bos is not None and loaded.add_bos else []) + list(
      loaded.tokenizer.encode(prompt))


def generate_tokens(loaded: LoadedModel, tokens: list[int], *, max_new_tokens: int,
                    temperature: float = 0.0, top_k: int | None = None,
                    top_p: float | None = None, seed: int = 0) -> list[int]:
  """The generated ids, cut before the first stop id."""
  from distillax.models.sampler import Sampler
  if not tokens:
    raise UserError("the prompt encodes to no tokens; give some text")
  room = loaded.model.config.max_seq_len - len(tokens)
  if room < 1:
    raise UserError(f"the prompt is {len(tokens)} tokens, the model's max_seq_len "
                    f"{loaded.model.config.max_seq_len}: nothing is left to generate; shorten it")
  if max_new_tokens > room:
    print(f"distillax generate: max_new_tokens lowered to {room} (the model's max_seq_len is "
          f"{loaded.model.config.max_seq_len})", file=sys.stderr)
  steps = min(max_new_tokens, room)
  out = Sampler(loaded.model)(np.asarray([tokens], np.int32), max_new_tokens=steps,
                              temperature=temperature, top_k=top_k, top_p=top_p,
                              eos_id=loaded.stop_ids[0] if loaded.stop_ids else None,
                              pad_id=loaded.tokenizer.pad_id, seed=seed,
                              vocab_limit=loaded.tokenizer.vocab_size)
  ids = np.asarray(jax.device_get(out.tokens_BxT))[0].tolist()
  cut = next((i for i, t in enumerate(ids) if t in loaded.stop_ids), len(ids))
  return ids[:cut]


def check_not_gguf(model_dir: str | None) -> None:
  """Refuses a GGUF file as --model: generate decodes with distillax's own sampler, which reads
  a run or a Hugging Face directory; a GGUF runs in llama.cpp (and `eval --generate` scores its
  completions there)."""
  from distillax.edge.completions import is_gguf
  if is_gguf(model_dir):
    raise UserError(f"--model {model_dir} is a GGUF file, which runs in llama.cpp (llama-cli -m "
                    f"{model_dir} -p TEXT), not in generate; distillax eval --model {model_dir} "
                    f"--generate FILE scores its completions, and generate takes the run or "
                    f"Hugging Face directory it was exported from")


def run_generate(config, model_dir: str | None, *, prompt: str | None, messages: str | None,
                 max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None,
                 seed: int, full_precision: bool = False) -> int:
  """Prints the text the model generates; 0."""
  if jax.process_count() > 1:
    raise UserError("generate runs in one process; launch it without --num_processes")
  if max_new_tokens is None or max_new_tokens < 1:
    raise UserError(f"--max_new_tokens={max_new_tokens} must be at least 1")
  if (prompt is None) == (messages is None):
    raise UserError("give exactly one of --prompt TEXT or --messages JSON")
  turns = read_messages(messages) if messages is not None else None
  check_not_gguf(model_dir)
  loaded = load_model_dir(model_dir, config, full_precision=full_precision)
  tokens = prompt_tokens(loaded, prompt, turns)
  ids = generate_tokens(loaded, tokens, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed)
  print(loaded.tokenizer.decode(ids), flush=True)
  return 0
