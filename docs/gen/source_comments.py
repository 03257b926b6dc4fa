"""The one-line comments written beside config fields, read from the source.

Config fields carry their documentation as comments (a trailing `# ...` or a comment block
right above the assignment), which Python drops at runtime, so the reference reads them back
from the source with `ast` and `tokenize`. Keys are dotted paths below the function's own
variable (`c.logit.weight` -> "logit.weight"); an assignment to another local (a sub-section
built in a loop, `s.weight`) is keyed by its path below that local ("weight").
"""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize


def _comment_lines(source: str) -> tuple[dict[int, str], set[int]]:
  """line -> comment text, and the lines that hold nothing but a comment."""
  comments, alone = {}, set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      line = tok.start[0]
      comments[line] = tok.string.lstrip("#").strip()
      if not tok.line[:tok.start[1]].strip():
        alone.add(line)
  return comments, alone


def _dotted(target: ast.expr) -> list[str] | None:
  """['c', 'logit', 'weight'] for `c.logit.weight`; None for anything else."""
  parts = []
  while isinstance(target, ast.Attribute):
    parts.append(target.attr)
    target = target.value
  if isinstance(target, ast.Name):
    return [target.id] + parts[::-1]
  return None


def _describe(node: ast.stmt, comments: dict[int, str], alone: set[int]) -> str:
  """The comment block right above `node`, then any comment on its own lines."""
  above, line = [], node.lineno - 1
  while line in alone:
    above.insert(0, comments[line])
    line -= 1
  beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1)
            if n in comments and n not in alone]
  return " ".join(above + beside).strip()


def field_comments(obj) -> dict[str, str]:
  """Dotted field path -> its comment, for a function that builds a ConfigDict or a dataclass."""
  source = textwrap.dedent(inspect.getsource(obj))
  comments, alone = _comment_lines(source)
  out = {}
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
      path = _dotted(node.targets[0])
      if path and len(path) > 1:
        out.setdefault(".".join(path[1:]), _describe(node, comments, alone))
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      out.setdefault(node.target.id, _describe(node, comments, alone))
  return out


def lookup(comments: dict[str, str], dotted: str) -> str:
  """The comment of `dotted`, or of its longest tail (fields of a loop-built sub-section)."""
  parts = dotted.split(".")
  for start in range(len(parts)):
    found = comments.get(".".join(parts[start:]))
    if found:
      return found
  return ""
