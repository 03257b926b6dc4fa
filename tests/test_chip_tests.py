"""scripts/chip_tests.sh runs the tests whose claims depend on the hardware on a lent TPU, from a
list of test ids (scripts/chip_tests.py, SELECTION), where a run is scarce: every entry must
still name tests (a renamed test or parameter would quietly drop out of the chip's run), and
what they import must be on the chip (only jax, numpy, scipy, pytest, hypothesis and the wheels
scripts/tpu_call.sh carries: no gguf, torch, transformers, ...)."""

import ast
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _runner():
  spec = importlib.util.spec_from_file_location(
      "chip_tests", os.path.join(ROOT, "scripts", "chip_tests.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _module_imports(path: str) -> set[str]:
  """The modules a file imports when it is imported (module level, not inside functions)."""
  found = set()
  for node in ast.parse(open(path, encoding="utf-8").read()).body:
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      found.add(node.module)
      found.update(f"{node.module}.{alias.name}" for alias in node.names)
  return found


def _closure(paths: list[str]) -> set[str]:
  """Every module name imported at module level by these files and, transitively, by the
  distillax and tests modules they reach."""
  seen, todo, names = set(), list(paths), set()
  while todo:
    path = todo.pop()
    if path in seen:
      continue
    seen.add(path)
    for name in _module_imports(path):
      names.add(name)
      parts = name.split(".")
      if parts[0] not in ("distillax", "tests"):
        continue
      for n in range(1, len(parts) + 1):  # a module imports its packages first
        base = os.path.join(ROOT, *parts[:n])
        todo += [p for p in (base + ".py", os.path.join(base, "__init__.py"))
                 if os.path.exists(p)]
  return names


def test_every_entry_of_the_chip_selection_names_tests():
  runner = _runner()
  found = runner.collect()
  assert [entry for entry, _ in runner.SELECTION] == list(found)
  assert not [entry for entry, ids in found.items() if not ids], "stale entries"
  ids = [i for entry_ids in found.values() for i in entry_ids]
  assert len(ids) == len(set(ids)) >= len(found)  # no test selected twice


def test_the_chip_selection_imports_nothing_the_chip_lacks():
  runner = _runner()
  imported = {name.split(".")[0] for name in _closure(
      [os.path.join(ROOT, f) for f in runner.files()] + [os.path.join(ROOT, "tests",
                                                                       "conftest.py")])}
  assert {"jax", "flax", "distillax", "tests"} <= imported  # the reader sees the imports
  assert not imported & set(runner.CHIP_LACKS), sorted(imported & set(runner.CHIP_LACKS))
