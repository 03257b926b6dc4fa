"""The commands the config docstrings print, run as a user copies them: from a directory holding
`distillax/` (the repository root), with every path relative to it (runs/teacher, runs/kd, ...).

Every docstring command is parsed and its paths resolved here; the chain of commands that start
from one another's runs (a teacher run, distillation from it, a teacher cache, training from the
cache, QAT starting from the distilled run, an export) is run for real, shrunk to `:tiny` and a
few steps. These paths used to reach orbax relative, which it refuses.
"""

import ast
import glob
import json
import os
import shlex

from distillax.configs.paths import PATH_FIELDS, resolve_paths
from distillax.main import _parse, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Modules whose docstrings carry commands: every config, and the export and cache jobs.
DOCUMENTED = sorted(glob.glob(os.path.join(ROOT, "distillax", "configs", "*.py"))) + [
    os.path.join(ROOT, "distillax", "export.py"),
    os.path.join(ROOT, "distillax", "cache_teacher.py")]
SHORT = ["--config.train.steps=3", "--config.train.eval_every=3",
         "--config.checkpoint.every_steps=3"]


def docstring_commands(path: str) -> list[list[str]]:
  """argv of each `distillax ...` command in the module docstring (continuation lines joined,
  a trailing `(make demo)`-style remark dropped)."""
  doc = (ast.get_docstring(ast.parse(open(path).read())) or "").replace("\\\n", " ")
  out = []
  for line in doc.splitlines():
    line = line.strip()
    if line.startswith("distillax "):
      argv = shlex.split(line.split("(`")[0])
      out.append(argv)
  return out


ALL = [(os.path.relpath(p, ROOT), argv) for p in DOCUMENTED for argv in docstring_commands(p)]


def test_every_documented_path_is_resolved_from_the_current_directory(tmp_path, monkeypatch):
  """Each command's config parses from a directory that mirrors the repository, and every
  path it sets (runs/teacher, runs/kd_cache, ...) becomes that directory's."""
  monkeypatch.chdir(tmp_path)
  os.symlink(os.path.join(ROOT, "distillax"), tmp_path / "distillax")
  assert len(ALL) >= 20 and any("=runs/" in " ".join(argv) for _, argv in ALL)
  checked = 0
  for where, argv in ALL:
    config, _ = _parse(argv[1], argv)
    if config is None:  # generate / eval / export of a run: the flags are their only paths
      assert (argv[1] in ("generate", "eval") and ("--model" in argv or "--draft" in argv)) or (
          argv[1] == "export" and "--workdir" in argv), (where, argv)
      continue
    resolved = resolve_paths(config)
    for arg in argv:
      name, _, value = arg.partition("=")
      dotted = tuple(name.removeprefix("--config.").split("."))
      if name.startswith("--config.") and dotted in PATH_FIELDS:
        section, field = dotted
        assert resolved[section][field] == str(tmp_path / value), (where, arg)
        checked += 1
  assert checked >= 10


def _tiny(argv: list[str]) -> list[str]:
  """The command with `:tiny` on its config (when it has no argument) and a few steps."""
  out = list(argv)
  i = out.index("--config") + 1
  if ":" not in out[i]:
    out[i] += ":tiny"
  return out + (SHORT if out[1] == "train" else [])


def _command(config: str, workdir: str) -> list[str]:
  """The docstring command of distillax/configs/<config> (or another module) that writes
  `workdir`."""
  found = [argv for where, argv in ALL if where.endswith(config) and workdir in argv]
  assert found, (config, workdir)
  return found[0]


def test_the_documented_chain_runs_from_relative_paths(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  os.symlink(os.path.join(ROOT, "distillax"), tmp_path / "distillax")
  lm = _command("configs/lm.py", "runs/lm")
  # "teacher from an earlier run of distillax/configs/lm.py": that command, into runs/teacher.
  teacher = [a if a != "runs/lm" else "runs/teacher" for a in lm]
  chain = [lm, teacher, _command("configs/distill.py", "runs/kd"),
           _command("configs/distill_cached.py", "runs/kd_cache"),
           _command("configs/distill_cached.py", "runs/kd_cached"),
           _command("configs/qat_distill.py", "runs/qat_kd"),
           _command("export.py", "out/lm_hf")]
  for argv in chain:
    assert main(_tiny(argv)) == 0, " ".join(argv) + "\n" + capsys.readouterr().err[-3000:]
  for run in ("lm", "teacher", "kd", "kd_cached", "qat_kd"):
    assert (tmp_path / "runs" / run / "summary.json").exists(), run
  assert (tmp_path / "runs" / "kd_cache" / "cache_job.json").exists()
  assert (tmp_path / "out" / "lm_hf" / "model.safetensors").exists()
  # What config.json records is where the paths pointed, not where they were typed from.
  recorded = json.loads((tmp_path / "runs" / "qat_kd" / "config.json").read_text())
  assert recorded["teacher"]["workdir"] == str(tmp_path / "runs" / "teacher")
  assert recorded["train"]["init_from"] == str(tmp_path / "runs" / "kd")
  # So a later command from anywhere else finds them: exporting the QAT run loads its recipe,
  # which reads the teacher run that config.json names.
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  monkeypatch.chdir(elsewhere)
  assert main(["distillax", "export", "--config",
               f"{ROOT}/distillax/configs/qat_distill.py:tiny", "--workdir",
               str(tmp_path / "runs" / "qat_kd"), "--output", "qat_hf"]) == 0
  assert (elsewhere / "qat_hf" / "tokenizer.json").exists()

