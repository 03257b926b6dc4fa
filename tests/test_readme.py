"""The documentation's Python API walkthrough (docs/python-api.md) runs as printed there (a user
copies it into a file)."""

import contextlib
import io
import math
import os
import re
import runpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_api_script() -> str:
  page = open(os.path.join(ROOT, "docs", "python-api.md")).read()
  return re.search(r"```python\n(.*?)```", page, re.S).group(1)


def test_python_api_script_distils_a_few_steps(tmp_path, monkeypatch):
  """The script runs from its own file in this process, whose JAX already has the 8 devices the
  script asks for (its XLA_FLAGS line is a setdefault): it shares this process's imports and
  compile cache instead of starting Python and JAX anew."""
  script = tmp_path / "api.py"
  script.write_text(_python_api_script())
  monkeypatch.chdir(tmp_path)
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    runpy.run_path(str(script), run_name="__main__")
  out = printed.getvalue()
  steps = re.findall(r"step (\d): loss ([\d.]+), KD ([\d.]+)", out)
  assert [int(s) for s, _, _ in steps] == [1, 2, 3], out
  assert all(math.isfinite(float(l)) and float(k) > 0 for _, l, k in steps)
  assert "'eval_logit_kd'" in out and "'eval_feature_pooling'" in out


def test_readme_is_a_landing_page_whose_commands_run(monkeypatch):
  """The README stays short (the rest lives in docs/), its two set-up commands are Makefile
  targets, its examples parse as the CLI parses them (tests/test_docstring_commands.py runs
  them), and its links to docs/ pages resolve."""
  from pathlib import Path

  from distillax.main import _parse
  from tests.test_docs import TESTED, _page_commands

  root = Path(ROOT)
  text = (root / "README.md").read_text()
  assert len(text.splitlines()) <= 200
  makefile = (root / "Makefile").read_text()
  for target in ("demo", "test", "docs"):
    assert f"make {target}" in text and re.search(rf"^{target}:", makefile, re.M), target
  commands = _page_commands(root / "README.md")
  assert len(commands) >= 5 and any(tuple(argv) in TESTED for argv in commands)
  monkeypatch.chdir(ROOT)
  for argv in commands:
    config, _ = _parse(argv[1], argv)
    assert config is not None or argv[1] in ("generate", "eval", "export"), argv
  links = re.findall(r"\]\((docs/[^)#]+)\)", text)
  assert links and all((root / link).exists() for link in links), links


def _python_blocks() -> list[str]:
  page = open(os.path.join(ROOT, "docs", "python-api.md")).read()
  return re.findall(r"```python\n(.*?)```", page, re.S)


def test_python_api_hf_checkpoints_load_and_save_through_the_stable_face(tmp_path, monkeypatch):
  """Issue 55: `from distillax.models import hf; hf.load(path)` moved to
  distillax.models.hf.checkpoint with the rooms change. The page's second script loads and saves
  an HF checkpoint through `distillax.models.hf` as printed: the weights come back equal."""
  blocks = _python_blocks()
  assert len(blocks) == 2 and "from distillax.models import hf" in blocks[1]
  script = tmp_path / "hf_api.py"
  script.write_text(blocks[1])
  monkeypatch.chdir(tmp_path)
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    runpy.run_path(str(script), run_name="__main__")
  assert printed.getvalue().strip().splitlines()[-1] == "same weights: True"
  assert sorted(os.listdir(tmp_path / "out" / "tiny_hf_again")) == ["config.json",
                                                                     "model.safetensors"]


def test_the_python_api_scripts_keep_libtpu_off_a_host_without_a_tpu(monkeypatch):
  """Issue 55: run as printed on a CPU host with libtpu installed, the walkthrough printed
  libtpu's error block (JAX tries the TPU first). Each script asks for the CPU there, before
  anything starts JAX, as the CLI does (cli/host_platforms.py); this host is made such a host."""
  import jax

  from distillax.cli import host_platforms
  asked = []
  monkeypatch.setattr(host_platforms, "_libtpu_installed", lambda: True)
  monkeypatch.setattr(host_platforms, "_tpu_device_nodes", lambda: False)
  monkeypatch.setattr(host_platforms, "_gpu_present", lambda utils: False)
  monkeypatch.setattr(jax.config, "update", lambda name, value: asked.append((name, value)))
  for block in _python_blocks():
    head = block.split("\nfrom distillax import partitioning")[0]  # what runs before any JAX
    asked.clear()
    monkeypatch.setenv("JAX_PLATFORMS", "")  # unset as far as JAX is concerned; restored after
    exec(compile(head, "python-api.md", "exec"), {})
    assert asked == [("jax_platforms", "cpu")] and os.environ["JAX_PLATFORMS"] == "cpu", head
