"""Chat and prompt/completion records -> token ids plus a mask of the tokens that are trained.

Rendering: the tokenizer's own chat template (tokenizer.py reads it next to tokenizer.json, as
transformers does), rendered as transformers 5 renders it (`apply_chat_template` ->
`render_jinja_template`): a sandboxed jinja2 environment with trim_blocks and lstrip_blocks, the
loopcontrols extension, the `{% generation %}` tag, a `tojson` that does not escape HTML,
`raise_exception`, `dict` and an underscore-proof `namespace`; the template sees `messages`
(None-valued keys dropped, reasoning aliased to `reasoning_content`/`thinking`), `tools` and
`documents` (None), `add_generation_prompt` and the special-token strings (bos_token, ...).
One deliberate difference: no `strftime_now`, so templates that stamp today's date (Llama 3.1)
fall back to their fixed one and a record renders the same on every day: a resumed run re-reads
the document it stopped in and must get the same tokens.

The tokens are the rendered text encoded without added specials (what `apply_chat_template(...,
tokenize=True)` returns); a chat adds no BOS/EOS of its own: the template writes them.

What is trained (the loss mask; a token is trained when its characters overlap a trained span,
transformers' rule for `return_assistant_tokens_mask`):
  * messages: each assistant message. With `{% generation %}` in the template, the spans it marks
    (exactly transformers' assistant mask). Otherwise what the template writes for the message
    after the generation prompt, through its end-of-turn token: render(messages[:k],
    add_generation_prompt=True) and render(messages[:k+1]) are prefixes of the whole chat, and
    the span lies between them (whitespace after a closing control token left out). A template
    that renders earlier turns differently (e.g. drops their reasoning) breaks that prefix
    property; such a message's span is its content, found in the rendered chat, plus a control
    token right after it (e.g. <|im_end|>).
  * conversational prompt/completion: everything the template writes after the prompt messages
    rendered with the generation prompt (TRL's completion-only loss).
  * plain prompt/completion: [BOS] + prompt + completion + [EOS], the completion and EOS trained.
`data.loss_on='all'` trains every token instead.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import numpy as np

from distillax.data.records import ChatRecord, PromptCompletion
from distillax.errors import ConfigError, UserError

LOSS_ON = ("assistant", "all")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# (rendered blocks so far, spans) of the render in progress on this thread, or None.
_TRACKING = contextvars.ContextVar("distillax_generation_spans", default=None)


class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: records the character span of its output."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

  def _generation(self, caller):
    text = caller()
    tracking = _TRACKING.get()
    if tracking is not None:
      blocks, spans = tracking
      start = len("".join(blocks))
      spans.append((start, start + len(text)))
    return text


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


class _TemplateDict:
  """`dict(...)` in a template, without attribute access to the real type."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
  """`namespace(...)` that refuses underscore-prefixed attributes (no reach into internals)."""

  def __init__(*args, **kwargs):  # jinja's own signature trick: `namespace(self=...)` works
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _TemplateNamespace._check_name(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _TemplateNamespace._check_name(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check_name(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(
          f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})")


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["dict"] = _TemplateDict()
  env.globals["namespace"] = _TemplateNamespace
  try:
    return env.from_string(source)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise UserError(f"the chat template does not parse (line {e.lineno}: {e.message}); fix the "
                    f"template or set data.chat_template to a .jinja file") from e


def prepare_messages(messages) -> list[dict]:
  """Messages as transformers hands them to a template: copies without None-valued keys, with a
  message's reasoning also under `thinking` and `reasoning_content`."""
  out = []
  for message in messages:
    message = {k: v for k, v in dict(message).items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    out.append(message)
  return out


class ChatTemplate:
  """A compiled chat template with the special-token strings it is rendered with.

  control_tokens: the tokenizer's special added tokens; a trained span may end on one."""

  def __init__(self, source: str, special_tokens=None, control_tokens=()):
    self.source = str(source)
    self.special_tokens = dict(special_tokens or {})
    self.control_tokens = tuple(sorted(control_tokens, key=len, reverse=True))
    self._template = _compile(self.source)

  @property
  def has_generation_tags(self) -> bool:
    return bool(_GENERATION_TAG.search(self.source))

  def _kwargs(self, messages, add_generation_prompt: bool) -> dict:
    return dict(messages=prepare_messages(messages), tools=None, documents=None,
                add_generation_prompt=bool(add_generation_prompt), **self.special_tokens)

  def render(self, messages, add_generation_prompt: bool = False) -> str:
    """The text `apply_chat_template(messages, tokenize=False, ...)` gives."""
    return self._template.render(**self._kwargs(messages, add_generation_prompt))

  def render_with_generation_spans(self, messages) -> tuple[str, list[tuple[int, int]]]:
    """(text, character spans of the `{% generation %}` blocks), as transformers tracks them."""
    blocks, spans = [], []
    token = _TRACKING.set((blocks, spans))
    try:
      for block in self._template.generate(**self._kwargs(messages, False)):
        blocks.append(block)
    finally:
      _TRACKING.reset(token)
    return "".join(blocks), spans

  def __getstate__(self):  # grain workers get a copy: the source, recompiled there
    return {"source": self.source, "special_tokens": self.special_tokens,
            "control_tokens": self.control_tokens}

  def __setstate__(self, state):
    self.__init__(state["source"], state["special_tokens"], state["control_tokens"])

  def __repr__(self):
    return f"ChatTemplate({len(self.source)} characters)"


def template_for(tokenizer, path: str = "") -> ChatTemplate | None:
  """The chat template of `tokenizer` (or the .jinja file at `path`); None when it has none."""
  source = getattr(tokenizer, "chat_template", None)
  if path:
    try:
      with open(path, encoding="utf-8") as f:
        source = f.read()
    except OSError as e:
      raise UserError(f"data.chat_template={path!r} is not a readable file ({e}); point it at "
                      f"a Jinja chat template") from e
  if source is None:
    return None
  return ChatTemplate(source, getattr(tokenizer, "special_tokens_map", {}),
                      getattr(tokenizer, "control_tokens", ()))


# ---- trained spans ------------------------------------------------------------------------------

def chat_spans(template: ChatTemplate, record: ChatRecord) -> tuple[str, list[tuple[int, int]]]:
  """(rendered chat, character spans to train) of a chat record (see the module doc)."""
  try:
    if record.prompt_messages is not None:
      return _completion_spans(template, record)
    if template.has_generation_tags:
      return template.render_with_generation_spans(record.messages)
    return _assistant_spans(template, record)
  except UserError:
    raise
  except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
    # raise_exception, an undefined variable, or a template doing arithmetic on a field the
    # record lacks (e.g. "content" None + a string): the record and the template disagree.
    raise UserError(f"{record.source or 'a chat record'}: the chat template failed on it "
                    f"({e}); fix the record or the template") from e


def _assistant_spans(template: ChatTemplate, record: ChatRecord):
  messages = record.messages
  text = template.render(messages)
  spans, cursor = [], 0
  for k, message in enumerate(messages):
    if message.get("role") != "assistant":
      continue
    span = _prefix_span(template, messages, k, text, cursor)
    if span is None:
      span = _content_span(template, message, text, cursor)
    if span is None:
      raise UserError(f"{record.source or 'a chat record'}: assistant message {k} does not "
                      f"appear in the chat its template renders, so it cannot be masked; add "
                      f"{{% generation %}} tags to the template or fix the record")
    if span[1] > span[0]:
      spans.append(span)
    cursor = span[1]
  return text, spans


def _render_or_none(template: ChatTemplate, messages, add_generation_prompt: bool):
  try:
    return template.render(messages, add_generation_prompt)
  except Exception:  # a partial chat a template refuses: the probe just fails  # noqa: BLE001
    return None


def _prefix_span(template, messages, k, text, cursor):
  before = _render_or_none(template, messages[:k], True)
  through = _render_or_none(template, messages[:k + 1], False)
  if before is None or through is None or len(before) < cursor:
    return None
  if not (through.startswith(before) and text.startswith(through)):
    return None
  return len(before), _trim_after_control(template, text, len(before), len(through))


def _content_span(template, message, text, cursor):
  content = message.get("content")
  if not isinstance(content, str):
    return None
  content = content.strip()
  if not content:
    return cursor, cursor
  start = text.find(content, cursor)
  if start < 0:
    return None
  end = start + len(content)
  rest = text[end:]
  for token in template.control_tokens:
    stripped = rest.lstrip()
    if stripped.startswith(token):
      return start, end + (len(rest) - len(stripped)) + len(token)
  return start, end


def _trim_after_control(template, text, start, end) -> int:
  """`end`, less trailing whitespace that follows a closing control token (the newline after
  <|im_end|> is the template's layout, not something the model says before stopping)."""
  kept = text[start:end].rstrip()
  if len(kept) < end - start and template.control_tokens and kept.endswith(
      template.control_tokens):
    return start + len(kept)
  return end


def _completion_spans(template: ChatTemplate, record: ChatRecord):
  prompt = record.messages[:record.prompt_messages]
  text = template.render(record.messages)
  for add_generation_prompt in (True, False):
    before = _render_or_none(template, prompt, add_generation_prompt)
    if before is not None and text.startswith(before):
      if len(before) == len(text):
        return text, []
      return text, [(len(before), _trim_after_control(template, text, len(before), len(text)))]
  raise UserError(f"{record.source or 'a prompt/completion record'}: the chat template does not "
                  f"render the prompt messages as the start of the whole chat, so the completion "
                  f"cannot be told apart; check the template")


# ---- tokens and masks ---------------------------------------------------------------------------

def span_mask(offsets_Nx2: np.ndarray, spans) -> np.ndarray:
  """1.0 for each token whose [start, end) characters overlap a span, else 0.0."""
  mask = np.zeros(len(offsets_Nx2), np.float32)
  for start, end in spans:
    mask[(offsets_Nx2[:, 0] < end) & (offsets_Nx2[:, 1] > start)] = 1.0
  return mask


def encode_chat(record: ChatRecord, tokenizer, template: ChatTemplate | None,
                loss_on: str = "assistant") -> tuple[np.ndarray, np.ndarray]:
  """(int32 ids, float32 per-token train mask) of a chat record."""
  if template is None:
    raise UserError(f"{record.source or 'a chat record'} is a chat, but {tokenizer!r} has no "
                    f"chat template; use a tokenizer whose folder has chat_template.jinja or a "
                    f"tokenizer_config.json with one, or set data.chat_template=<file.jinja>")
  text, spans = chat_spans(template, record)
  ids, offsets = tokenizer.encode_with_offsets(text)
  mask = np.ones(len(ids), np.float32) if loss_on == "all" else span_mask(offsets, spans)
  return ids.astype(np.int32), mask


def encode_prompt_completion(record: PromptCompletion, tokenizer, add_bos: bool,
                             loss_on: str = "assistant") -> tuple[np.ndarray, np.ndarray]:
  """[BOS] + prompt + completion + [EOS]; the completion's tokens and EOS are trained."""
  text = record.prompt + record.completion
  ids, offsets = tokenizer.encode_with_offsets(text)
  mask = span_mask(offsets, [(len(record.prompt), len(text))])
  head = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
  tail = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
  ids = np.concatenate([np.asarray(head, np.int32), ids.astype(np.int32),
                        np.asarray(tail, np.int32)])
  mask = np.concatenate([np.zeros(len(head), np.float32), mask, np.ones(len(tail), np.float32)])
  if loss_on == "all":
    mask[:] = 1.0
  return ids, mask


def check_loss_on(loss_on: str) -> str:
  if loss_on not in LOSS_ON:
    raise ConfigError(f"data.loss_on={loss_on!r} is not one of {', '.join(LOSS_ON)}")
  return loss_on
