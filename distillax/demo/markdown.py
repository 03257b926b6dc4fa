"""The markdown table every report section writes (stages, llama.cpp rows, on-policy rows)."""

from __future__ import annotations

from typing import Iterable, Sequence


def table_lines(head: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
  """A header, its rule and one line per row of already formatted cells."""
  lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
  return lines + ["| " + " | ".join(row) + " |" for row in rows]
