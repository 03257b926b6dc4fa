"""Read scalars back from TensorBoard event files, the way TensorBoard does, without TensorFlow.

Event files are TFRecord streams: [u64 length][u32 masked crc32c of length][payload][u32 masked
crc32c of payload], each payload an `Event` proto. This reader checks both checksums, decodes with
tensorboardX's copy of the proto, and applies TensorBoard's purge rule: a `SessionLog.START` event
at step S hides every event at step >= S read before it (a resumed run overwriting the tail of a
crashed one). The tests use it to check what a run logged, independently of the writer.
"""

from __future__ import annotations

import glob
import os
import struct

from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from distillax.errors import UserError


def iter_events(path: str):
  """Yield the Event protos of one file; a torn final record (writer killed) ends the stream."""
  with open(path, "rb") as f:
    data = f.read()
  offset = 0
  while offset + 12 <= len(data):
    header = data[offset:offset + 8]
    (length,) = struct.unpack("<Q", header)
    (header_crc,) = struct.unpack("<I", data[offset + 8:offset + 12])
    if header_crc != masked_crc32c(header):
      raise UserError(f"corrupt TensorBoard event file {path}: bad length checksum at byte {offset}")
    end = offset + 12 + length + 4
    if end > len(data):
      return  # torn last record, as TensorBoard tolerates
    payload = data[offset + 12:offset + 12 + length]
    (payload_crc,) = struct.unpack("<I", data[end - 4:end])
    if payload_crc != masked_crc32c(payload):
      raise UserError(f"corrupt TensorBoard event file {path}: bad record checksum at byte {offset}")
    event = event_pb2.Event()
    event.ParseFromString(payload)
    yield event
    offset = end


def _scalar_value(value) -> float | None:
  if value.HasField("simple_value"):
    return float(value.simple_value)
  if value.HasField("tensor") and value.tensor.float_val:
    return float(value.tensor.float_val[0])
  if value.HasField("tensor") and value.tensor.double_val:
    return float(value.tensor.double_val[0])
  return None


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} from the event files directly in logdir, in file-name order."""
  paths = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
  scalars: dict[str, list[tuple[int, float]]] = {}
  for path in paths:
    for event in iter_events(path):
      if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
        for tag, points in scalars.items():
          scalars[tag] = [(step, value) for step, value in points if step < event.step]
      for value in event.summary.value:
        scalar = _scalar_value(value)
        if scalar is not None:
          scalars.setdefault(value.tag, []).append((int(event.step), scalar))
  return scalars
