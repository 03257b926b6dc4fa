"""benchmarks/ shows its questions at a glance, checked from the source (nothing is run):

- the scripts at benchmarks/*.py are the questions: benchmarks/README.md lists each once, with
  the results file the script writes; what they share is in benchmarks/lib/;
- each script starts with the device prologue and imports JAX and distillax after it, at the
  top of the file: imports inside functions are only the one whose reason is written beside
  it (an optional dependency).
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
QUESTIONS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")
# (file, module imported inside a function): each has its reason in a comment beside it.
LAZY = {("kd_vocab.py", "benchmarks.lib.tunix_kd"), ("grouped_matmul.py", "tokamax")}


def readme_rows() -> dict[str, list[str]]:
  """script name -> the results files its row of benchmarks/README.md names."""
  rows = {}
  for line in (BENCH / "README.md").read_text().splitlines():
    m = re.match(r"\| `python benchmarks/(\w+)\.py` \| .+ \| (.+) \|$", line)
    if m:
      assert m.group(1) not in rows, f"{m.group(1)} listed twice"
      rows[m.group(1)] = re.findall(r"`([\w.]+)`", m.group(2))
  return rows


def test_readme_lists_every_question_script_and_only_those():
  assert sorted(readme_rows()) == QUESTIONS
  assert not set(readme_rows()) & {p.stem for p in (BENCH / "lib").glob("*.py")}


def test_each_script_writes_the_results_files_its_row_names():
  for name, files in readme_rows().items():
    source = (BENCH / f"{name}.py").read_text()
    assert files, name
    for f in files:
      stem = f.rsplit(".", 1)[0]
      assert f'"{f}"' in source or f'"{stem}"' in source, (name, f)


def _module_imports(tree: ast.Module) -> list[tuple[int, str]]:
  """(line, module) of the imports at the top level of a module."""
  out = []
  for node in tree.body:
    if isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      out.append((node.lineno, node.module))
  return out


def _prologue_line(tree: ast.Module) -> int | None:
  for node in tree.body:
    if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
        and ast.unparse(node.value.func) == "prologue.start"
        and ast.unparse(node.value.args[0]) == "__name__"):
      return node.lineno
  return None


def test_each_script_runs_the_prologue_before_jax_and_distillax():
  for name in QUESTIONS:
    tree = ast.parse((BENCH / f"{name}.py").read_text())
    start = _prologue_line(tree)
    assert start is not None, f"{name}.py: no prologue.start(__name__, ...) at the top"
    late = [(line, m) for line, m in _module_imports(tree) if line < start and
            m.split(".")[0] in ("jax", "flax", "numpy", "distillax")]
    assert late == [], f"{name}.py imports {late} before its prologue"
    assert any(m.startswith("benchmarks.lib") for line, m in _module_imports(tree)
               if line > start), name


def test_no_imports_inside_functions_but_the_one_with_a_reason():
  found = set()
  for path in sorted(BENCH.rglob("*.py")):
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
      if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      for node in ast.walk(fn):
        if isinstance(node, ast.Import):
          found |= {(path.relative_to(BENCH).as_posix(), a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
          names = [f"{node.module}.{a.name}" for a in node.names]
          found |= {(path.relative_to(BENCH).as_posix(), n) for n in names}
  assert found == LAZY
