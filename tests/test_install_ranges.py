"""pyproject.toml gives ranges (installs keep a user's JAX); constraints.txt pins what `make test`
installs. The two must agree: every range starts at its pin, and no pin is outside its range."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def canonical(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[Requirement]:
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  deps = list(project["dependencies"])
  for extra in project["optional-dependencies"].values():
    deps += extra
  return [Requirement(d) for d in deps]


def pins() -> dict[str, str]:
  out = {}
  for line in (ROOT / "constraints.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      name, version = line.split("==")
      assert canonical(name) not in out, f"{name} pinned twice"
      out[canonical(name)] = version
  return out


def test_every_range_starts_at_its_pin_and_holds_it():
  pinned = pins()
  ranged = {canonical(r.name): r for r in requirements() if r.specifier}
  assert set(ranged) == set(pinned)  # a pin for every range, and no stray pin
  for name, req in ranged.items():
    assert Version(pinned[name]) in req.specifier, (name, str(req.specifier), pinned[name])
    lower = [s.version for s in req.specifier if s.operator == ">="]
    assert lower == [pinned[name]], f"{name}: range {req.specifier} should start at the pin"
    assert any(s.operator == "<" for s in req.specifier), f"{name}: range has no upper bound"


def test_no_exact_pins_and_python_from_3_11():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert project["requires-python"] == ">=3.11"
  assert not [str(r) for r in requirements() if any(s.operator == "==" for s in r.specifier)]
