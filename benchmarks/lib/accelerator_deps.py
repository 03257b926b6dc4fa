"""Carried wheels onto a bare accelerator image, without a network and without touching its JAX.

  python benchmarks/lib/accelerator_deps.py --wheels .whl --target /tmp/site \\
      [--pyproject pyproject.toml]

A lent GPU or TPU machine brings its own Python, JAX and most of the scientific stack, but not
every library distillax imports (grain, ml-collections, clu, qwix, ...), and it cannot reach a
package index. `make accelerator-wheels` downloads those wheels here (the list is
scripts/accelerator_wheels.txt); scripts/accelerator_run.sh carries them and calls this.

For each carried wheel: if the image already has that distribution at a version inside
pyproject.toml's range, the image's copy is kept; if the image lacks it, or has a version outside
the range, the wheel is installed into --target (which the run script puts first on PYTHONPATH).
Installing is `pip install --no-index --no-deps --target` where the image has pip, else the
wheel is unpacked (a wheel is a zip of its import tree). Nothing here imports JAX, and nothing
is ever installed over the image's own site-packages.

Prints one line per distribution (image version, range, what was done) and a warning for each
pyproject dependency that is missing or out of range with no wheel carried.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

try:  # `packaging` ships with pip and setuptools; without it every carried wheel is installed
  from packaging.requirements import Requirement
  from packaging.version import Version
except ImportError:  # pragma: no cover - images without packaging
  Requirement = Version = None


def canonical(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(path: Path) -> tuple[str, str]:
  """('grain', '0.2.18') from 'grain-0.2.18-cp312-cp312-manylinux_2_28_x86_64.whl'."""
  name, version = path.name.split("-")[:2]
  return canonical(name), version


def pyproject_ranges(pyproject: Path) -> dict[str, str]:
  """{distribution: specifier} of the core dependencies."""
  deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
  out = {}
  for dep in deps:
    match = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(\[[^\]]*\])?\s*([^;]*)", dep)
    out[canonical(match.group(1))] = match.group(3).strip()
  return out


def installed_version(name: str) -> str | None:
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return None


def in_range(version: str, spec: str) -> bool:
  if not spec:
    return True
  if Requirement is None:  # cannot compare versions here: prefer the carried wheel
    return False
  return Version(version) in Requirement(f"x {spec}").specifier


def decide(wheels: dict[str, str], ranges: dict[str, str],
           installed: dict[str, str | None]) -> list[tuple[str, str, str]]:
  """(distribution, action, why) for every carried wheel and every pyproject dependency.

  action: 'install' (the wheel goes to --target), 'keep' (the image's copy is used), 'warn'
  (missing or out of range, and no wheel for it).
  """
  plan = []
  for name in sorted(set(wheels) | set(ranges)):
    have, spec = installed.get(name), ranges.get(name, "")
    ok = have is not None and (in_range(have, spec) if name in ranges else True)
    where = f"image {have or 'missing'}, wants {spec or 'any'}"
    if ok:
      plan.append((name, "keep", where))
    elif name in wheels:
      plan.append((name, "install", f"{where}: carried {wheels[name]}"))
    else:
      plan.append((name, "warn", f"{where}: no wheel carried"))
  return plan


PIP = (sys.executable, "-m", "pip")


def install(paths: list[Path], target: Path, pip=PIP) -> str:
  """Installs the wheels into `target` with pip (no index, no deps), or unpacks them."""
  target.mkdir(parents=True, exist_ok=True)
  if not paths:
    return "nothing to install"
  try:
    has_pip = subprocess.run([*pip, "--version"], capture_output=True).returncode == 0
  except OSError:
    has_pip = False
  if has_pip:
    subprocess.run([*pip, "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, paths)],
                   check=True)
    return f"pip installed {len(paths)} wheel(s) into {target}"
  for path in paths:
    with zipfile.ZipFile(path) as wheel:
      wheel.extractall(target)
  return f"unpacked {len(paths)} wheel(s) into {target} (no pip here)"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--wheels", type=Path, required=True, help="folder of carried wheels")
  parser.add_argument("--target", type=Path, required=True, help="where to install them")
  parser.add_argument("--pyproject", type=Path,
                      default=Path(__file__).resolve().parents[2] / "pyproject.toml")
  args = parser.parse_args(argv)
  found = sorted(args.wheels.glob("*.whl")) if args.wheels.is_dir() else []
  wheels = dict(wheel_name_version(p) for p in found)
  paths = {wheel_name_version(p)[0]: p for p in found}
  ranges = pyproject_ranges(args.pyproject)
  plan = decide(wheels, ranges, {n: installed_version(n) for n in set(wheels) | set(ranges)})
  for name, action, why in plan:
    print(f"{action:8s}{name}: {why}")
  print(install([paths[n] for n, action, _ in plan if action == "install"], args.target))
  return 0


if __name__ == "__main__":
  sys.exit(main())
