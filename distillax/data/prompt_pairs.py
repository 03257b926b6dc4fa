"""A held-out file of prompt/completion records, read for generation scoring.

`distillax eval --generate FILE` and the trainer's generation eval (`eval.generate`) read the
same layout training reads for prompt/completion data: one JSON object per line with string
"prompt" and "completion" fields. `what` names the flag or field the file came from, so each
error says what the user typed and how to fix it.
"""

from __future__ import annotations

import json
import os

from distillax.errors import UserError


def read_prompt_pairs(path: str, what: str = "--generate") -> tuple[list[str], list[str]]:
  """(prompts, reference completions) of a prompt/completion JSONL file."""
  if not path or not os.path.isfile(path):
    raise UserError(f"{what}={path}: no such file; give a JSONL of {{\"prompt\", "
                    f"\"completion\"}} records")
  prompts, references = [], []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except ValueError as e:
        raise UserError(f"{what}: {path} line {number} is not JSON ({e})") from None
      if not (isinstance(record, dict) and isinstance(record.get("prompt"), str)
              and isinstance(record.get("completion"), str)):
        raise UserError(f"{what}: {path} line {number} needs string \"prompt\" and "
                        f"\"completion\" fields")
      prompts.append(record["prompt"])
      references.append(record["completion"])
  if not prompts:
    raise UserError(f"{what}: {path} holds no records")
  return prompts, references
