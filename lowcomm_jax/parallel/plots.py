"""A tick table drawn as a grid: a row per device, a column per tick, each op a coloured cell."""

from __future__ import annotations

import numpy as np

from lowcomm_jax.parallel import ticks

_COLOURS = {ticks.IDLE: "#f2f2f2", ticks.FORWARD: "#7fb3d5", ticks.LOSS: "#f5b041",
            ticks.BACKWARD: "#82c99a"}


def plot_tick_table(table: ticks.TickTable, ax=None, title: str | None = None):
  """Draws `table`: F blue, L orange, B green, idle grey, the micro-batch id in each busy cell."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.patches import Patch  # pylint: disable=g-import-not-at-top
  if ax is None:
    _, ax = plt.subplots(figsize=(max(6, 0.42 * table.num_ticks), 0.45 * table.num_devices + 1))
  for d in range(table.num_devices):
    for t in range(table.num_ticks):
      op = int(table.op[t, d])
      ax.add_patch(plt.Rectangle((t, d), 1, 1, facecolor=_COLOURS[op], edgecolor="white"))
      if op != ticks.IDLE:
        ax.text(t + 0.5, d + 0.5, f"{ticks.OP_NAMES[op]}{int(table.microbatch[t, d])}",
                ha="center", va="center", fontsize=7)
  ax.set_xlim(0, table.num_ticks)
  ax.set_ylim(table.num_devices, 0)
  ax.set_yticks(np.arange(table.num_devices) + 0.5)
  ax.set_yticklabels([f"stage {d % table.num_stages}, replica {d // table.num_stages}"
                      for d in range(table.num_devices)])
  ax.set_xlabel("tick")
  idle = table.idle_ticks().sum()
  ax.set_title(title or f"{table.order}: {table.num_ticks} ticks, {idle} idle device-ticks "
                        f"(bubble {table.bubble_fraction():.2f})")
  ax.legend(handles=[Patch(color=_COLOURS[k], label=v) for k, v in
                     ((ticks.FORWARD, "forward"), (ticks.LOSS, "loss"),
                      (ticks.BACKWARD, "backward"),
                      (ticks.IDLE, "idle"))], loc="upper left", bbox_to_anchor=(1.0, 1.0),
            fontsize=8)
  return ax
