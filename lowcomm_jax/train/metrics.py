"""Run outputs: metrics.jsonl (one object per logged step), TensorBoard events, progress on a terminal."""

from __future__ import annotations

import json
import pathlib
import sys
import time

from tensorboardX import SummaryWriter


class MetricWriter:
  """Writes each logged step to metrics.jsonl and TensorBoard; shows a bar or plain lines.

  Disabled (`enabled=False`: every process of a multi-process run but the first), it writes and
  prints nothing, so a run directory holds one copy of each.
  """

  def __init__(self, workdir: pathlib.Path, num_steps: int, start_step: int, progress_bar: bool,
               enabled: bool = True):
    self.enabled = enabled
    if not enabled:
      return
    self.path = pathlib.Path(workdir) / "metrics.jsonl"
    self._truncate_after(start_step)
    self._file = self.path.open("a")
    self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tensorboard"), purge_step=start_step or None)
    self._bar = None
    if progress_bar and sys.stderr.isatty():
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      self._bar = tqdm(total=num_steps, initial=start_step, unit="step", dynamic_ncols=True)
    self._last_step = start_step

  def _truncate_after(self, step: int) -> None:
    # A resumed run replays the steps after its checkpoint; keep each step logged once.
    if self.path.exists():
      kept = [l for l in self.path.read_text().splitlines() if l and json.loads(l)["step"] <= step]
      self.path.write_text("".join(l + "\n" for l in kept))

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    record = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for k, v in metrics.items():
      self._tb.add_scalar(k, float(v), step)
    text = " ".join(f"{k}={float(v):.4g}" for k, v in metrics.items())
    if self._bar is not None:
      self._bar.update(step - self._last_step)
      self._bar.set_postfix_str(text)
    else:
      print(f"step {step}: {text}", flush=True)
    self._last_step = step

  def close(self) -> None:
    if not self.enabled:
      return
    self._file.close()
    self._tb.close()
    if self._bar is not None:
      self._bar.close()
