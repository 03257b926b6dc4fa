"""The package's shape, checked from the source (nothing is imported or run):

- floors (DESIGN.md, "Layout"): a module imports only from its own floor or the floors below,
  and no set of modules imports itself round in a cycle. Imports inside functions count: a lazy
  import still ties two rooms together.
- size: no function over 60 lines in the package, no class in trainers/ over 12 methods.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "distillax")
# Lowest first; a module's floor is that of its longest listed prefix.
FLOORS = (("errors", "jsonio", "interrupts"), ("partitioning", "data"), ("framework", "models"),
          ("distill", "quant"), ("edge",), ("trainers",),
          ("configs", "demo", "plan", "eval", "export", "cache_teacher", "launch_local", "main",
           "__main__", "cli", "generate", "expert_load"))


def _modules() -> dict[str, str]:
  """Dotted module name -> file path (a package's __init__.py is the package)."""
  out = {}
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        out[dotted.removesuffix(".__init__")] = path
  return out


def _imported(module: str, path: str, modules: dict[str, str]) -> set[str]:
  """The package modules `module` imports anywhere in its file."""
  found = set()
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = module.split(".")[:len(module.split(".")) - node.level +
                                    (1 if path.endswith("__init__.py") else 0)]
        base = ".".join(parts + ([node.module] if node.module else []))
      names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    else:
      continue
    for name in names:
      while name and name not in modules:
        name = name.rpartition(".")[0]
      if name and name != module:
        found.add(name)
  return found


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {m: _imported(m, p, modules) for m, p in modules.items()}


def _floor(module: str) -> int | None:
  rest = module.split(".")[1:]
  for i, names in enumerate(FLOORS):
    if rest and rest[0] in names:
      return i
  return None


def test_every_module_has_a_floor():
  assert [m for m in _graph() if m != "distillax" and _floor(m) is None] == []


def test_no_module_imports_from_a_higher_floor():
  graph = _graph()
  upward = [f"{a} (floor {_floor(a)}) -> {b} (floor {_floor(b)})" for a in sorted(graph)
            for b in sorted(graph[a]) if b != "distillax" and _floor(b) > (_floor(a) or 0)]
  assert upward == []


def test_no_import_cycles():
  graph = _graph()
  done, cycles = set(), []

  def visit(node, path):
    if node in path:
      cycles.append(path[path.index(node):] + [node])
      return
    if node in done:
      return
    for nxt in sorted(graph[node]):
      visit(nxt, path + [node])
    done.add(node)

  for node in sorted(graph):
    visit(node, [])
  assert [" -> ".join(c) for c in cycles] == []


def _definitions():
  for path in _modules().values():
    for node in ast.walk(ast.parse(open(path).read(), path)):
      yield os.path.relpath(path, ROOT), node


def test_no_function_is_over_60_lines():
  long = [f"{path}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
          for path, n in _definitions() if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
          and n.end_lineno - n.lineno + 1 > 60]
  assert long == []


def test_no_trainers_class_has_over_12_methods():
  big = [f"{path}:{n.lineno} {n.name}" for path, n in _definitions()
         if path.startswith(os.path.join("distillax", "trainers")) and isinstance(n, ast.ClassDef)
         and sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in n.body) > 12]
  assert big == []


@pytest.mark.parametrize("source, expected", [
    ("from distillax.framework import losses", {"distillax.framework.losses"}),
    ("def f():\n  from distillax.trainers import Trainer", {"distillax.trainers"}),
    ("from . import losses", {"distillax.framework.losses"}),
    ("import distillax.models.hf as hf", {"distillax.models.hf"}),
])
def test_the_import_reader_sees_every_form(tmp_path, source, expected):
  """The checks above are only as good as this reader: lazy, relative and aliased imports."""
  path = tmp_path / "mod.py"
  path.write_text(source)
  assert _imported("distillax.framework.mod", str(path), _modules()) == expected
