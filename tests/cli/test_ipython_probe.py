"""distillax's command line imports flax without flax (and treescope, which it imports) importing
IPython (cli/ipython_probe.py), and leaves IPython importable afterwards. A stand-in IPython
package on the path records each attempt to import it, then fails as an absent one would; the
import checks run in a fresh interpreter, where flax is not imported yet."""

import subprocess
import sys
import textwrap
import types

from distillax.cli.ipython_probe import import_flax_without_ipython_probe


def _run(tmp_path, body: str) -> str:
  package = tmp_path / "IPython"
  package.mkdir(exist_ok=True)
  (package / "__init__.py").write_text(
      "import os\nos.environ['IPYTHON_TRIES'] = os.environ.get('IPYTHON_TRIES', '') + 'x'\n"
      "raise ImportError('the stand-in IPython')\n")
  code = textwrap.dedent(f"""
      import os, sys
      sys.path.insert(0, {str(tmp_path)!r})
      from distillax.cli.ipython_probe import import_flax_without_ipython_probe
      """) + textwrap.dedent(body)
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  return done.stdout.strip()


def test_flax_imports_without_trying_ipython_and_ipython_is_tried_after(tmp_path):
  out = _run(tmp_path, """
      import_flax_without_ipython_probe()
      print('flax.nnx' in sys.modules, os.environ.get('IPYTHON_TRIES'), 'IPython' in sys.modules)
      try:
        import IPython
      except ImportError as e:
        print(os.environ.get('IPYTHON_TRIES'), e)
      """)
  assert out.splitlines() == ["True None False", "x the stand-in IPython"]


def test_a_plain_flax_import_tries_ipython(tmp_path):
  """What the function avoids: importing flax tries the installed IPython (1.3 s on the lent
  TPU VM, where it is installed)."""
  out = _run(tmp_path, """
      import flax.nnx
      print(os.environ.get('IPYTHON_TRIES'))
      """)
  assert out and set(out) == {"x"}


def test_a_process_that_has_imported_ipython_keeps_it(monkeypatch):
  import flax.nnx  # noqa: F401 (here: the function's own import is then a lookup)
  ipython = types.ModuleType("IPython")
  monkeypatch.setitem(sys.modules, "IPython", ipython)
  import_flax_without_ipython_probe()
  assert sys.modules["IPython"] is ipython
