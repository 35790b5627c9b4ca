"""Gantt charts and topology maps of SkipPipe iterations (matplotlib, imported when one is drawn:
it takes most of a second to import, and every config check imports this package).

One row per node (grouped by stage), one bar per task: forward, loss and
backward in different shades, the micro-batch id written on wide bars, and
the data-parallel all-reduce of each stage as a hatched bar after its last
backward. Gaps are idle time.
"""

from __future__ import annotations

import numpy as np

_COLORS = {"F": "#4c72b0", "L": "#dd8452", "B": "#55a868"}
_LABELS = {"F": "forward", "L": "loss", "B": "backward"}


def plot_gantt(topology, placement, result, *, title: str = "", ax=None,
               show_allreduce: bool = True, label_microbatches: bool = True):
  """Draws the timeline of an `IterationResult` (or any task list).

  Args:
    topology: the cluster (for node names).
    placement: node ids per stage (row order and stage labels).
    result: an `IterationResult`, or a sequence of `Task`s.
    title: axes title.
    ax: matplotlib axes to draw on; a new figure if None.
    show_allreduce: draw each stage's all-reduce after its last backward.
    label_microbatches: write micro-batch ids on bars wide enough.

  Returns:
    The matplotlib Figure.
  """
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  tasks = getattr(result, "tasks", result)
  rows = [int(n) for nodes in placement for n in nodes]
  row_of = {node: i for i, node in enumerate(rows)}
  if ax is None:
    _, ax = plt.subplots(figsize=(12, 0.32 * len(rows) + 1.5))
  end = max((t.end for t in tasks), default=1.0)
  for task in tasks:
    y = row_of[task.node]
    ax.broken_barh([(task.start, task.end - task.start)], (y - 0.4, 0.8),
                   facecolors=_COLORS[task.kind], edgecolor="white",
                   linewidth=0.3)
    if label_microbatches and task.end - task.start > end / 120:
      ax.text((task.start + task.end) / 2, y, str(task.microbatch),
              ha="center", va="center", fontsize=5, color="white")
  allreduce = getattr(result, "allreduce_s", None)
  if show_allreduce and allreduce is not None:
    last = {}
    for task in tasks:
      last[task.node] = max(last.get(task.node, 0.0), task.end)
    for s, nodes in enumerate(placement):
      if allreduce[s] <= 0:
        continue
      start = max(last.get(int(n), 0.0) for n in nodes)
      for n in nodes:
        ax.broken_barh([(start, allreduce[s])], (row_of[int(n)] - 0.4, 0.8),
                       facecolors="none", edgecolor="#8172b3", hatch="///",
                       linewidth=0.5)
  ax.set_yticks(range(len(rows)))
  stage_of = {int(n): s for s, nodes in enumerate(placement) for n in nodes}
  ax.set_yticklabels([f"s{stage_of[n]} {topology.node_names[n]}"
                      for n in rows], fontsize=7)
  boundaries = np.cumsum([len(nodes) for nodes in placement])[:-1] - 0.5
  for b in boundaries:
    ax.axhline(b, color="grey", linewidth=0.5)
  ax.invert_yaxis()
  ax.set_xlabel("time (s)")
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
  names = list(_LABELS.values())
  if show_allreduce and allreduce is not None and np.any(allreduce > 0):
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="none",
                                 edgecolor="#8172b3", hatch="///"))
    names.append("all-reduce")
  ax.legend(handles, names, loc="upper right", fontsize=7)
  if title:
    ax.set_title(title)
  return ax.figure


def save_gantt(path, topology, placement, result, **kwargs) -> str:
  """Writes `plot_gantt(...)` to a PNG file and returns its path."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  figure = plot_gantt(topology, placement, result, **kwargs)
  figure.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(figure)
  return str(path)


def plot_link_costs(topology, *, ax=None, title: str = "link cost (s)"):
  """Heat map of the per-hop link cost between every pair of nodes."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.colors import LogNorm  # pylint: disable=g-import-not-at-top
  if ax is None:
    _, ax = plt.subplots(figsize=(7, 6))
  image = ax.imshow(topology.link_cost_s, cmap="viridis",
                    norm=LogNorm(
                        vmin=max(topology.link_cost_s[topology.link_cost_s > 0]
                                 .min(), 1e-3),
                        vmax=topology.link_cost_s.max()))
  ticks = range(topology.num_nodes)
  ax.set_xticks(ticks)
  ax.set_yticks(ticks)
  ax.set_xticklabels(topology.node_names, rotation=90, fontsize=6)
  ax.set_yticklabels(topology.node_names, fontsize=6)
  ax.figure.colorbar(image, ax=ax, shrink=0.8)
  ax.set_title(title)
  return ax.figure


def plot_placement(topology, placement, schedule=None, *, ax=None,
                   title: str = "stages and paths"):
  """Nodes as dots in stage columns; optional schedule paths as lines."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  if ax is None:
    _, ax = plt.subplots(figsize=(8, 4))
  position = {}
  for s, nodes in enumerate(placement):
    for j, n in enumerate(nodes):
      position[int(n)] = (s, j)
      ax.scatter([s], [j], s=120, color="#4c72b0", zorder=3)
      ax.annotate(topology.node_names[int(n)], (s, j), fontsize=6,
                  xytext=(4, 6), textcoords="offset points")
  if schedule is not None:
    seen = {}
    for path in schedule.paths:
      key = (path.stages, path.nodes)
      seen[key] = seen.get(key, 0) + 1
    colors = plt.cm.tab10(np.linspace(0, 1, max(len(seen), 1)))
    for color, ((_, nodes), count) in zip(colors, seen.items()):
      xy = np.array([position[n] for n in nodes + nodes[:1]], np.float64)
      ax.plot(xy[:, 0], xy[:, 1], color=color, alpha=0.7,
              linewidth=0.8 + 0.4 * count)
  ax.set_xticks(range(len(placement)))
  ax.set_xticklabels([f"stage {s}" for s in range(len(placement))])
  ax.set_yticks([])
  ax.set_title(title)
  return ax.figure
