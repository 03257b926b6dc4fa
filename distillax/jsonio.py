"""Strict JSON for every file distillax writes (metrics.jsonl, reports, exports, provenance).

Python's json module writes a non-finite float as the bare words NaN / Infinity, which no other
JSON reader accepts (JavaScript's JSON.parse, jq, pandas' strict mode). A value that is missing
or not finite is written as null instead, and `allow_nan=False` turns any one that slipped past
into an error at write time rather than a file others cannot read.
"""

from __future__ import annotations

import json
import math
from typing import Any, TextIO


def strict(value: Any) -> Any:
  """`value` with every non-finite float (at any depth of dicts, lists and tuples) as None."""
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, dict):
    return {k: strict(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [strict(v) for v in value]
  return value


def dumps(value: Any, **kwargs) -> str:
  """json.dumps of `strict(value)`, refusing anything that is still not JSON."""
  return json.dumps(strict(value), allow_nan=False, **kwargs)


def dump(value: Any, file: TextIO, **kwargs) -> None:
  """json.dump of `strict(value)` into an open text file."""
  json.dump(strict(value), file, allow_nan=False, **kwargs)
