"""The HLO reader on module text the TPU compiler produced (tests/framework/tpu_hlo/, written by
its generate.py from deviceless libtpu compiles, trimmed to what the reader reads): collective
matmuls, whose loops step their counter by 2; async collectives, written as start, continuation
and done fusions sharing one channel_id; a scanned layer stack. Every expected figure below is
worked out by hand from the program and the module's structure, per device, bf16 (2 bytes)."""

from pathlib import Path

import pytest

from distillax.framework import hlo, hlo_flops

FIXTURES = Path(__file__).parent / "tpu_hlo"
MIB = 2**20


def _read(name: str) -> str:
  return (FIXTURES / f"{name}.hlo").read_text()


def _loops(text: str) -> dict[str, int | None]:
  """{while body: trip count} of every loop of a module."""
  module = hlo.parse_module(text)
  by_name = {ins.name: ins for comp in module.computations.values() for ins in comp}
  return {hlo._BODY_RE.search(ins.attrs).group(1): hlo.inferred_trip_count(module, ins, by_name)
          for comp in module.computations.values() for ins in comp if ins.opcode == "while"}


def _counts(stats: dict) -> dict[str, tuple[int, float, float]]:
  return {k: (v["count"], v["operand_bytes"], v["result_bytes"]) for k, v in stats.items()
          if isinstance(v, dict) and k != "total" and v["count"]}


# collective_matmul: x[16,2048,2048] @ w[2048,8192] on 8 devices; per device x is [2,2048,2048]
# and w [256,8192] (4 MiB). The gather of w is a bidirectional collective matmul: one
# collective-permute of a [1,256,8192] block (4 MiB) before the loop, then a loop whose counter
# starts at 0, is tested `< 4` and steps by 2 (the body is unrolled twice): 2 trips, each with
# 4 permutes (two each way) and 2 convolutions [2,2048,8192] over 256 features x 2 positions.
#   permutes: 1 + 2 x 4 = 9, 9 x 4 MiB
#   FLOPs: 2 trips x 2 convolutions x 2 x (2 x 2048 x 8192) x 512 = 2^37, the program's own
#          2 x 2 x 2048 x 2048 x 8192 per device (with a step of 1: 4 trips, 17 permutes, 2^38).
def test_collective_matmul_loop_steps_by_two():
  text = _read("collective_matmul")
  assert _loops(text) == {"wide.windowed_dot_general_body_ag.clone.sunk": 2}
  stats = hlo.collective_stats(text)
  assert _counts(stats) == {"collective-permute": (9, 9 * 4 * MIB, 9 * 4 * MIB)}
  assert not stats["trip_count_unknown"]
  assert hlo_flops.matmul_flops(text)["flops"] == 2 * 2 * 2048 * 2048 * 8192


# scanned_fsdp: one SGD step of 3 scanned layers h = tanh(h @ w_l) on 4 devices; per device
# x is [16,512], a layer's weight shard [1,128,512] (128 KiB) and its gather [1,512,512]
# (512 KiB). Two loops of 3 trips (counter 0, `< 3`, +1): the forward gathers each layer's
# weights with a plain all-gather; the backward with an async one, written three times
# (start fusion, continuation fusion, done fusion: channel 8), and reduce-scatters each
# layer's gradient with an all-reduce-scatter fusion, [512,512] (512 KiB) -> [128,512] (128
# KiB).
#   all-gathers: 3 + 3 = 6, operands 6 x 128 KiB, results 6 x 512 KiB (the three pieces
#                counted apart: 3 + 9 = 12)
#   reduce-scatters: 3, operands 3 x 512 KiB, results 3 x 128 KiB
#   FLOPs: 3 layers x (forward, input gradient, weight gradient) x 2 x 16 x 512 x 512
def test_scanned_fsdp_async_all_gather_counts_once_per_channel():
  text = _read("scanned_fsdp")
  assert sorted(_loops(text).values()) == [3, 3]
  stats = hlo.collective_stats(text)
  assert _counts(stats) == {"all-gather": (6, 6 * 128 * 1024, 6 * 512 * 1024),
                            "reduce-scatter": (3, 3 * 512 * 1024, 3 * 128 * 1024)}
  assert hlo_flops.matmul_flops(text)["flops"] == 3 * 3 * 2 * 16 * 512 * 512


# scanned_mlp: one SGD step of 2 scanned layers h = tanh(h @ a_l) @ b_l on 8 devices; per
# device h is [2,2048,2048] and each of its 2 matmuls 2 x 2 x 2048 x 2048 x 8192 = 2^37 FLOPs.
# The layer loops run 2 trips; every collective matmul loop inside runs 2 (counter 0, `< 4`,
# +2), with 4 permutes a trip and 1 before it:
#   forward, per layer: gathers of a and b, 9 permutes of 4 MiB blocks each ([1,256,8192],
#     [1,1024,2048]): 18; backward, per layer: 9 permutes of [16,2048,1,256] (16 MiB)
#     -> 2 x 18 + 2 x 9 = 54 permutes, 2 x 18 x 4 MiB + 2 x 9 x 16 MiB
#   all-gathers, per backward layer: one of [16,2048,256] -> [16,2048,2048] (16 -> 128 MiB)
#     whose continuation fusions run inside a collective matmul's loop (twice per layer: the
#     start and done run once), one of [16,2048,1024] -> [16,2048,8192] (64 -> 512 MiB)
#     -> 4: operands 2 x (16 + 64) MiB, results 2 x (128 + 512) MiB
#   all-to-alls, per backward layer: 2 of [2,2048,8,1024] (64 MiB), 1 of [2,2048,8,256] (16 MiB)
#   FLOPs: 2 layers x 2 matmuls x (forward, input gradient, weight gradient) x 2^37
def test_scanned_collective_matmuls_and_overlapping_all_gathers():
  text = _read("scanned_mlp")
  assert sorted(_loops(text).values()) == [2] * 5
  stats = hlo.collective_stats(text)
  assert _counts(stats) == {
      "all-gather": (4, 2 * (16 + 64) * MIB, 2 * (128 + 512) * MIB),
      "all-to-all": (6, 2 * (64 + 64 + 16) * MIB, 2 * (64 + 64 + 16) * MIB),
      "collective-permute": (54, (2 * 18 * 4 + 2 * 9 * 16) * MIB, (2 * 18 * 4 + 2 * 9 * 16) * MIB)}
  assert hlo_flops.matmul_flops(text)["flops"] == 2 * 2 * 3 * 2**37


# A counter that starts at 10, is tested `> 1` and steps by -3 (subtract): 10, 7, 4 -> 3 trips;
# `>= 1` adds the trip at 1; a step of 0 never ends (unknown).
@pytest.mark.parametrize("direction,step,trips",
                         [("GT", "3", 3), ("GE", "3", 4), ("GT", "0", None)])
def test_counting_down_by_a_step(direction, step, trips):
  text = f"""
%body (p: (s32[])) -> (s32[]) {{
  %p = (s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %step = s32[] constant({step})
  %next = s32[] subtract(%i, %step)
  ROOT %t = (s32[]) tuple(%next)
}}

%cond (q: (s32[])) -> pred[] {{
  %q = (s32[]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %one = s32[] constant(1)
  ROOT %c = pred[] compare(%j, %one), direction={direction}
}}

ENTRY %main () -> (s32[]) {{
  %ten = s32[] constant(10)
  %init = (s32[]) tuple(%ten)
  ROOT %w = (s32[]) while(%init), condition=%cond, body=%body
}}
"""
  assert _loops(text) == {"body": trips}
