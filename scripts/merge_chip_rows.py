"""Several chip calls' accelerator rows as one lever file, for benchmarks/accelerator.py
--from-levers: the README's TPU table from the newest measurement of every row when no single
call has the device time to run them all.

  python scripts/merge_chip_rows.py OUT.jsonl FILE@COMMIT[@stale][@pair=NAME][:ROW,...] ...

Each FILE is an accelerator JSON (its rows' candidates) or a levers .jsonl from
benchmarks/results/tpu/, given oldest first; `:ROW,...` keeps only those accelerator rows'
candidates (a JSON) and `@stale` marks its rows as measured by code that has changed since
(accelerator.py then names their commit in the table and the docs call the file partly stale).
Every row gets the commit it was measured at. FILE@keep (an earlier merge) keeps the commit
and staleness each of its rows already carries, so a merge can extend the last one
(FILE@keep@stale keeps each row's commit and marks every one stale: the code under all of them
changed); OUT may be one of the inputs (every input is read before OUT is written).
`@pair=NAME` appends `:pair=NAME` to the name of every measured row that has no pair option:
the rows of `benchmarks/tpu_levers.py --pair NAME`, which names them without it, under the
names accelerator.py gives the same variants. FILE@COMMIT may also be a levers .jsonl whose rows
already carry their commits (`@keep`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _with_pair(row: dict, pair: str) -> dict:
  name = row["row"]
  if name == "probe" or name.startswith("init/") or ":pair=" in name:
    return row
  return {**row, "row": f"{name}:pair={pair}"}


def rows_of(spec: str) -> list[dict]:
  """The lever rows of one FILE@COMMIT[@stale][@pair=NAME][:ROW,...] argument, tagged."""
  source, _, names = spec.partition(":")
  path, commit, *flags = source.split("@")
  pairs = [f.split("=", 1)[1] for f in flags if f.startswith("pair=")]
  rows = _tagged(path, commit, "stale" in flags, names)
  return [_with_pair(r, pairs[-1]) for r in rows] if pairs else rows


def _tagged(path: str, commit: str, stale: bool, names: str) -> list[dict]:
  """FILE's lever rows (only ROW,...'s candidates of an accelerator JSON when `names`), each
  with `commit` (or its own, for commit 'keep') and, if `stale`, marked so."""
  text = Path(path).read_text()
  if path.endswith(".jsonl"):
    levers = [json.loads(line) for line in text.splitlines() if line.strip()]
  else:
    payload = json.loads(text)
    wanted = set(names.split(",")) if names else None
    levers = [c for r in payload["rows"] if wanted is None or r["name"] in wanted
              for c in r["candidates"]]
    if payload.get("probe"):
      levers.insert(0, payload["probe"])
  if commit == "keep":  # FILE@keep@stale: every row's own commit, all of them now stale
    return [{**r, "stale": True} for r in levers] if stale else levers
  return [{**r, "commit": commit, **({"stale": True} if stale else {})} for r in levers]


def main(argv: list[str]) -> int:
  if len(argv) < 2:
    print(__doc__, file=sys.stderr)
    return 2
  out, specs = Path(argv[0]), argv[1:]
  rows = [r for spec in specs for r in rows_of(spec)]
  out.write_text("".join(json.dumps(r) + "\n" for r in rows))
  print(f"wrote {len(rows)} rows to {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
