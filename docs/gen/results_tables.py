"""JSON results as markdown tables a person can read: no cell holds JSON.

A results file mixes settings (scalars, small records such as `machine`), lists of records
(`rows`, `checks`), mappings of records (`rows: {same_tokenizer: {...}, ...}`) and records that
nest further (a row's `memory`, its `collectives` by kind, a plan target's `on_target.compiled`).
The rules:

  - scalars and small records of scalars: one key/value table (`machine.platform`, ...);
  - a list of records, or a mapping of records (its keys become a column named after it): one
    table of the records' scalar fields;
  - a record's nested record (a dict in a row): a table of its own under the heading
    `rows.memory`, one line per row, led by the columns that name the row (the fewest of its
    leading text and whole-number fields that tell the rows apart, e.g. model, strategy,
    devices), so each line can be matched to its row; a list of records in a row adds its
    index (`checks #`); a nested mapping of records (`collectives: {all-gather: {count,
    bytes}, ...}`) adds a column of its keys (one line per row and kind), and nesting goes on
    the same way;
  - lists of numbers or strings are written out, comma-separated (past 16 items: their count,
    minimum, median and maximum); nothing is cut short.

Host load readings (`load_*`) are measurement context, not results, and are left out; so is
`provenance` (the page's freshness line says what it means).
"""

from __future__ import annotations

import re
import statistics

SKIPPED = re.compile(r"load|^provenance$")
_LIST_ITEMS = 16  # a longer list of numbers is summarised


def _scalar_text(value) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  if value is None:
    return "null"
  return str(value)


def _is_records(value) -> bool:
  return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _is_nested(value) -> bool:
  """A value that becomes a table of its own rather than a cell."""
  return isinstance(value, dict) or _is_records(value)


def _list_text(values: list) -> str:
  if not values:
    return "none"
  if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and (
      len(values) > _LIST_ITEMS):
    return (f"{len(values)} values: min {_scalar_text(min(values))}, median "
            f"{_scalar_text(float(statistics.median(values)))}, max "
            f"{_scalar_text(max(values))}")
  return ", ".join(f"({_list_text(v)})" if isinstance(v, list) else _scalar_text(v)
                   for v in values)


def cell(value) -> str:
  """One table cell: a scalar, or a list written out (never JSON, never cut)."""
  text = _list_text(value) if isinstance(value, list) else _scalar_text(value)
  return text.replace("|", "\\|").replace("\n", " ")


def _markdown(columns: list[str], rows: list[dict]) -> list[str]:
  lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
  return lines + [""]


def _heading(title: str, depth: int) -> list[str]:
  return ["#" * min(depth, 6) + f" {title}", ""]


def _naming_keys(rows: list[dict]) -> list[dict]:
  """Each row's naming columns: the fewest of the rows' leading text and whole-number fields
  that tell the rows apart, else all of them after the row's number (`#`)."""
  names = []
  for key, value in rows[0].items():
    if SKIPPED.search(key) or isinstance(value, (float, dict, list)) or value is None:
      break
    names.append(key)
  for n in range(1, len(names) + 1):
    keys = [{k: r.get(k) for k in names[:n]} for r in rows]
    if len({tuple(k.values()) for k in keys}) == len(rows):
      return keys
  return [{"#": i, **{k: r.get(k) for k in names}} for i, r in enumerate(rows)]


def _records_of_mapping(mapping: dict, column: str) -> list[dict] | None:
  """{key: record} as records with the key in `column`; None if not every value is a dict."""
  if not mapping or not all(isinstance(v, dict) for v in mapping.values()):
    return None
  return [{column: k, **v} for k, v in mapping.items()]


def record_tables(rows: list[dict], title: str, depth: int,
                  keys: list[dict] | None = None) -> list[str]:
  """The rows' scalar fields as one table (led by `keys`, each row's naming columns), then a
  table per nested field (see the module doc)."""
  own_keys = keys is None  # the rows' own naming fields: the table shows even with no others
  keys = _naming_keys(rows) if own_keys else keys
  key_columns = list(dict.fromkeys(c for k in keys for c in k))
  # A field nested in any row is a table of its own (rows where it is empty add no line).
  nested = list(dict.fromkeys(c for row in rows for c, v in row.items()
                              if _is_nested(v) and not SKIPPED.search(c)))
  columns = []
  for row in rows:
    columns += [c for c in row if c not in columns and c not in key_columns
                and c not in nested and not SKIPPED.search(c)]
  lines = _markdown(key_columns + columns, [{**k, **r} for k, r in zip(keys, rows)]) \
      if columns or own_keys else []
  for field in nested:
    sub_rows, sub_keys = [], []
    for key, row in zip(keys, rows):
      value = row.get(field)
      if _is_records(value):
        for i, record in enumerate(value):
          sub_rows.append(record)
          sub_keys.append({**key, f"{field} #": i})
      elif isinstance(value, dict):
        as_records = _records_of_mapping(value, field)
        if as_records is not None:
          for record in as_records:
            sub_rows.append({k: v for k, v in record.items() if k != field})
            sub_keys.append({**key, field: record[field]})
        else:
          sub_rows.append(value)
          sub_keys.append(key)
    if sub_rows:
      body = record_tables(sub_rows, f"{title}.{field}", depth + 1, sub_keys)
      lines += (_heading(f"{title}.{field}", depth + 1) + body) if body else []
  return lines


def sections(data: dict, title: str, depth: int) -> list[str]:
  """A key/value table of the scalars (records of scalars inlined), then each list or mapping
  of records, and each nested section, under its own heading."""
  def inline(value):
    return not _is_nested(value) or (isinstance(value, dict) and not any(
        _is_nested(v) for v in value.values()))
  scalars = {k: v for k, v in data.items() if inline(v) and not SKIPPED.search(k)}
  lines = []
  if scalars:
    lines += ["| setting | value |", "|---|---|"]
    for key, value in scalars.items():
      if isinstance(value, dict):  # a small record (machine, settings): one row per field
        lines += [f"| {cell(f'{key}.{k}')} | {cell(v)} |" for k, v in value.items()
                  if not SKIPPED.search(str(k))]
      else:
        lines.append(f"| {cell(key)} | {cell(value)} |")
    lines.append("")
  for key, value in data.items():
    if SKIPPED.search(key) or key in scalars:
      continue
    name = f"{title}{key}"
    records = value if _is_records(value) else _records_of_mapping(value, key)
    if records is not None:
      lines += _heading(name, depth) + record_tables(records, name, depth)
    elif isinstance(value, dict):
      lines += _heading(name, depth) + sections(value, f"{name}.", depth + 1)
  return lines
