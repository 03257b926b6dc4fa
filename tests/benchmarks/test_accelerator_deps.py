"""benchmarks/lib/accelerator_deps.py: which carried wheels go onto an accelerator image, and that
both ways of installing them (pip without an index, plain unpacking) give an importable
distribution with its metadata."""

import subprocess
import sys
import zipfile

import pytest

from benchmarks.lib import accelerator_deps as deps


def test_only_missing_or_out_of_range_distributions_are_installed():
  wheels = {"grain": "0.2.18", "flax": "0.12.12", "qwix": "0.1.8"}
  ranges = {"flax": ">=0.12.8,<0.13", "jax": ">=0.10.2,<0.13", "qwix": ">=0.1.8,<0.2",
            "tokenizers": ">=0.23.3,<0.24", "numpy": ""}
  installed = {"grain": None, "flax": "0.12.1", "qwix": "0.1.8", "jax": "0.11.2",
               "tokenizers": "0.23.2", "numpy": "2.5.2"}
  plan = {name: action for name, action, _ in deps.decide(wheels, ranges, installed)}
  assert plan == {"grain": "install",  # the image lacks it
                  "flax": "install",  # the image's is older than the range
                  "qwix": "keep", "jax": "keep", "numpy": "keep",  # in range: the image's
                  "tokenizers": "warn"}  # out of range, and no wheel carried


def test_pyproject_ranges_are_read_with_their_specifiers(tmp_path):
  (tmp_path / "pyproject.toml").write_text(
      '[project]\nname = "x"\ndependencies = ["jax>=0.10.2,<0.13", "ml_collections>=1.1.0",'
      ' "numpy", "Foo.Bar[extra] ==1.0; python_version >= \'3.11\'"]\n')
  assert deps.pyproject_ranges(tmp_path / "pyproject.toml") == {
      "jax": ">=0.10.2,<0.13", "ml-collections": ">=1.1.0", "numpy": "", "foo-bar": "==1.0"}


def make_wheel(folder, name="demo_carried", version="1.2.3"):
  path = folder / f"{name}-{version}-py3-none-any.whl"
  info = f"{name}-{version}.dist-info"
  files = {f"{name}/__init__.py": "VALUE = 42\n",
           f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
           f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                            "Tag: py3-none-any\n"}
  files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
  with zipfile.ZipFile(path, "w") as z:
    for f, text in files.items():
      z.writestr(f, text)
  return path


@pytest.mark.parametrize("pip", [deps.PIP, ("/nonexistent/pip",)], ids=["pip", "unpack"])
def test_installed_wheel_imports_with_its_version(tmp_path, pip):
  wheel = make_wheel(tmp_path)
  assert deps.wheel_name_version(wheel) == ("demo-carried", "1.2.3")
  message = deps.install([wheel], tmp_path / "site", pip=pip)
  assert ("pip installed" if pip == deps.PIP else "unpacked") in message
  out = subprocess.run(
      [sys.executable, "-c", "import demo_carried, importlib.metadata as m; "
       "print(demo_carried.VALUE, m.version('demo-carried'))"],
      env={"PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["42", "1.2.3"]
