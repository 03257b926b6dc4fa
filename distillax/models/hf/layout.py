"""How one Hugging Face tensor maps onto one of our parameters (`Layout`): transposed, with heads
split out, or one share of a tensor several parameters share (gpt-oss's interleaved columns,
Gemma 4's and Llama 4's expert halves, blocks of rows by `Layout.rows`), which `join_parts`
joins back on export. Which tensor each parameter is: names.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np

INTERLEAVED = ("even", "odd")  # the column parity of each layout
HALVES = ("first_half", "second_half")  # ours (E, in, F) <- rows [h*F, (h+1)*F) of HF (E, 2F, in)
COLUMNS = ("left_columns", "right_columns")  # ours (E, in, F) <- columns h*F.. of (E, in, 2F)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Ours <-> HF for one tensor kind. HF linear weights are (out, in); ours are (in, ...out)."""

  # 'copy' | 'T' | 'out_heads' (D,H,K)<-(H*K,D) | 'in_heads' (H,K,D)<-(D,H*K)
  # | 'flat_heads' (H,K)<-(H*K,) (q/k/v biases) | 'even' / 'odd' (...,F)<-(...,2F): the even or
  # odd columns of a tensor two of ours share (gpt-oss's interleaved gate_up_proj)
  # | 'experts_T' (E,A,B)<-(E,B,A) | 'first_half' / 'second_half' (E,A,F)<-(E,2F,A): the first or
  # second F rows per expert, transposed (Gemma 4's gate_up_proj) | 'left_columns' /
  # 'right_columns' (E,A,F)<-(E,A,2F): the first or second F columns (Llama 4's gate_up_proj)
  kind: str
  # A tensor of HF rows shared with other parameters: (groups, offset, size, period) = ours is,
  # in HF form, rows g * period + offset + [0, size) of every group g (None: the whole tensor).
  rows: tuple[int, int, int, int] | None = None
  # 'out_heads' whose HF rows hold each head's RoPE pairs side by side (Llama 4: (2i, 2i + 1))
  # where ours hold them half a head apart (i, i + head_dim / 2).
  pairs: bool = False

  def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
    shape = self._own_hf_shape(ours)
    if self.rows is None:
      return shape
    groups, _, _, period = self.rows
    return (groups * period,) + shape[1:]

  def parts(self) -> tuple[object, int, int]:
    """(this parameter's key among the tensor's parts, its share, the whole): a shared tensor
    is complete when the shares of the parts that arrived add up to the whole."""
    if self.kind in INTERLEAVED + HALVES + COLUMNS:
      return self.kind, 1, 2
    return self.rows[1], self.rows[2], self.rows[3]

  @property
  def shared(self) -> bool:
    return self.kind in INTERLEAVED + HALVES + COLUMNS or self.rows is not None

  def _own_hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
    if self.kind == "conv":
      return (ours[1], 1, ours[0])
    if self.kind == "copy":
      return ours
    if self.kind == "T":
      return ours[::-1]
    if self.kind == "out_heads":
      return (ours[1] * ours[2], ours[0])
    if self.kind == "flat_heads":
      return (ours[0] * ours[1],)
    if self.kind in INTERLEAVED + COLUMNS:
      return ours[:-1] + (2 * ours[-1],)
    if self.kind == "experts_T":
      return (ours[0], ours[2], ours[1])
    if self.kind in HALVES:
      return (ours[0], 2 * ours[2], ours[1])
    return (ours[2], ours[0] * ours[1])

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    """x in HF's layout (for 'even' / 'odd': x as is; `interleave` joins the two halves)."""
    if self.kind in ("copy",) + INTERLEAVED + COLUMNS:
      return x
    if self.kind == "conv":
      return x.T[:, None, :]
    if self.kind == "T":
      return x.T
    if self.kind in ("experts_T",) + HALVES:  # (for a half: `join_parts` stacks the two)
      return x.transpose(0, 2, 1)
    if self.kind == "out_heads":
      x = x[:, :, _pair_order(x.shape[2], to_hf=True)] if self.pairs else x
      return x.reshape(x.shape[0], -1).T
    if self.kind == "flat_heads":
      return x.reshape(-1)
    return x.reshape(-1, x.shape[2]).T

  def read(self, tensor, index: tuple[slice, ...], ours: tuple[int, ...]) -> np.ndarray:
    """The block `ours[index]` read from the HF tensor slice handle (only what it needs)."""
    if self.rows is not None:
      tensor = _RowBlock(tensor, self.rows)
    r = [range(*s.indices(n)) for s, n in zip(index, ours)]
    sl = lambda rg: slice(rg.start, rg.stop)
    if self.kind == "conv":  # ours (K, C) from hf (C, 1, K)
      return tensor[sl(r[1]), 0:1, sl(r[0])][:, 0, :].T
    if self.kind == "copy":
      return tensor[tuple(sl(x) for x in r)]
    if self.kind == "T":
      return tensor[sl(r[1]), sl(r[0])].T
    if self.kind in ("experts_T",) + HALVES:  # ours (E, A, B) from hf (E, B, A) or (E, 2B, A)
      offset = HALVES.index(self.kind) * ours[2] if self.kind in HALVES else 0
      rows = slice(offset + r[2].start, offset + r[2].stop)
      return tensor[sl(r[0]), rows, sl(r[1])].transpose(0, 2, 1)
    if self.kind == "out_heads":  # ours (D, H, K) from hf (H*K, D)
      D, H, K = ours
      rows = tensor[r[1].start * K:r[1].stop * K, sl(r[0])].reshape(len(r[1]), K, len(r[0]))
      rows = rows[:, _pair_order(K, to_hf=False), :] if self.pairs else rows
      return rows[:, sl(r[2]), :].transpose(2, 0, 1)
    if self.kind in COLUMNS:  # ours (E, A, F) from hf (E, A, 2F)
      offset = COLUMNS.index(self.kind) * ours[2]
      return tensor[sl(r[0]), sl(r[1]), offset + r[2].start:offset + r[2].stop]
    if self.kind in INTERLEAVED:  # ours (..., F) from hf (..., 2F), every other column
      cols = slice(2 * r[-1].start, 2 * r[-1].stop)
      block = tensor[tuple(sl(x) for x in r[:-1]) + (cols,)]
      return block[..., INTERLEAVED.index(self.kind)::2]
    if self.kind == "flat_heads":  # ours (H, K) from hf (H*K,)
      H, K = ours
      return tensor[r[0].start * K:r[0].stop * K].reshape(len(r[0]), K)[:, sl(r[1])]
    H, K, D = ours  # 'in_heads': ours (H, K, D) from hf (D, H*K)
    cols = tensor[sl(r[2]), r[0].start * K:r[0].stop * K]
    return cols.reshape(len(r[2]), len(r[0]), K)[:, :, sl(r[1])].transpose(1, 2, 0)


def _pair_order(K: int, to_hf: bool) -> np.ndarray:
  """Feature order between RoPE pairs half a head apart (ours) and side by side (Llama 4's
  checkpoints): ours[f] = hf[order[f]] (to_hf=False), hf[j] = ours[order[j]] (to_hf=True)."""
  half, f = K // 2, np.arange(K)
  return (f % 2) * half + f // 2 if to_hf else 2 * (f % half) + f // half


class _RowBlock:
  """A slice handle that sees only one parameter's rows of a shared HF tensor (Layout.rows)."""

  def __init__(self, tensor, rows: tuple[int, int, int, int]):
    self.tensor, self.rows = tensor, rows

  def __getitem__(self, index):
    index = index if isinstance(index, tuple) else (index,)
    groups, offset, size, period = self.rows
    ours = np.arange(groups * size)[index[0]]
    hf_rows = ours // size * period + offset + ours % size
    low = int(hf_rows.min()) if len(hf_rows) else 0
    block = self.tensor[(slice(low, int(hf_rows.max()) + 1 if len(hf_rows) else 0),) + index[1:]]
    return block[hf_rows - low]


def join_parts(layout: Layout, parts: dict) -> np.ndarray:
  """The HF tensor several parameters share, from their parts in HF form keyed by
  `Layout.parts()[0]`: gpt-oss's interleaved columns, or Qwen3.5's blocks of rows."""
  if layout.kind in INTERLEAVED:
    return interleave(parts["even"], parts["odd"])
  if layout.kind in HALVES:
    return np.concatenate([parts[h] for h in HALVES], axis=1)
  if layout.kind in COLUMNS:
    return np.concatenate([parts[h] for h in COLUMNS], axis=-1)
  groups = layout.rows[0]
  blocks = [parts[k].reshape((groups, -1) + parts[k].shape[1:]) for k in sorted(parts)]
  joined = np.concatenate(blocks, axis=1)
  return joined.reshape((-1,) + joined.shape[2:])




def interleave(even: np.ndarray, odd: np.ndarray) -> np.ndarray:
  """(..., 2F) with even[..., f] at column 2f and odd[..., f] at 2f + 1."""
  return np.stack([even, odd], axis=-1).reshape(even.shape[:-1] + (2 * even.shape[-1],))
