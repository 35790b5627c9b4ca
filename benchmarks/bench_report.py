"""The bench's report: per entry and link the time to target with the significance rule, the
papers' claims beside our figures, the Markdown table and the plot.

It reads scored runs (`bench.record` + `bench.score`: each run's final eval loss, bytes per worker
and, per link, the simulated seconds to the target) and computes nothing about training; `links`
is the bench's {name: link spec} in the order the table shows them.
"""

import dataclasses
import math
import pathlib
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Claim:
  """A paper's claim about an entry's final eval loss against a baseline's, at equal tokens.

  Attributes:
    what: the claim in words.
    entry, baseline: entry names.
    paper: what the paper reports.
    max_diff_percent: the entry's loss may exceed the baseline's by at most this (%).
    two_sided: also at most this much below (a claim of "about equal").
    fewer_bytes: (entry whose bytes per worker are divided by the entry's, minimum ratio), or None.
  """

  what: str
  entry: str
  baseline: str
  paper: str
  max_diff_percent: float
  two_sided: bool = False
  fewer_bytes: tuple[str, float] | None = None


# The papers' claims (PAPERS.md), each for the tuned entry and, where it differs, the one with the
# paper's settings.
CLAIMS = (
    Claim("DiLoCo M=1 vs data-parallel", "diloco_m1", "dp",
          "≤ 0 (−0.1%, 35M, H = 30; arXiv 2503.09799 Table 4)", 0.0),
    Claim("DiLoCo M=2 vs data-parallel", "diloco_m2", "dp",
          "≤ +3% (+0.7%, 35M; arXiv 2503.09799 Table 4)", 3.0),
    Claim("DiLoCo M=2, the papers' momentum 0.9, vs data-parallel", "diloco_m2_paper", "dp",
          "≤ +3% (+0.7%, 35M; arXiv 2503.09799 Table 4)", 3.0),
    Claim("Streaming DiLoCo fp4 vs DiLoCo M=2", "streaming_fp4", "diloco_m2",
          "≈ 0 (within 1%) at ≥ 400× fewer bits than dp (3.53 vs 3.54; arXiv 2501.18512 "
          "Table 5)", 1.0, two_sided=True, fewer_bytes=("dp", 400.0)),
    Claim("SparseLoCo vs DiLoCo M=2", "sparseloco", "diloco_m2",
          "≤ +2% at ≥ 100× fewer bytes (arXiv 2508.15706)", 2.0,
          fewer_bytes=("diloco_m2", 100.0)),
    Claim("SparseLoCo, the paper's η = 1, vs DiLoCo M=2", "sparseloco_paper", "diloco_m2",
          "≤ +2% at ≥ 100× fewer bytes (arXiv 2508.15706)", 2.0,
          fewer_bytes=("diloco_m2", 100.0)),
    Claim("NoLoCo vs DiLoCo M=4", "noloco", "diloco_m4",
          "≤ 0 (up to 4% faster convergence; arXiv 2506.10911)", 0.0),
    Claim("DiLoCo M=2, eager, one outer step of overlap, vs DiLoCo M=2", "diloco_m2_eager",
          "diloco_m2", "≤ +1% (2.69 vs 2.67, +0.7%, 500M, H = 30; arXiv 2502.12996 Table 2)", 1.0),
)


def mean_se(values: list[float]) -> tuple[float, float | None]:
  """Mean and standard error of the mean (None for one value)."""
  n = len(values)
  mean = sum(values) / n
  if n < 2:
    return mean, None
  var = sum((v - mean) ** 2 for v in values) / (n - 1)
  return mean, math.sqrt(var / n)


def compare(a: list[float], b: list[float]) -> str:
  """"beats" when a's mean is lower than b's by more than 2 standard errors of the difference,
  "loses" when higher by as much, else "tie" (always with fewer than 2 values on a side)."""
  (ma, sa), (mb, sb) = mean_se(a), mean_se(b)
  if sa is None or sb is None:
    return "tie"
  margin = 2 * math.sqrt(sa**2 + sb**2)
  if ma < mb - margin:
    return "beats"
  if ma > mb + margin:
    return "loses"
  return "tie"


def summarize(runs: list[dict], links) -> dict:
  """Per entry: seeds, mean ± se of the final loss, bytes, and per link the time to target and
  whether it beats, ties or loses to the fastest entry on that link."""
  by_entry = {}
  for r in runs:
    by_entry.setdefault(r["entry"], []).append(r)
  table = {}
  for name, rs in sorted(by_entry.items()):
    loss, loss_se = mean_se([r["final_eval_loss"] for r in rs])
    row = {"seeds": len(rs), "final_eval_loss": loss, "final_eval_loss_se": loss_se,
           "bytes_per_worker": mean_se([r["bytes_per_worker"] for r in rs])[0],
           "reached": sum(r["links"] is not None for r in rs), "links": {}}
    for link in links:
      times = [r["links"][link]["seconds"] for r in rs if r["links"]]
      util = [r["links"][link]["utilization"] for r in rs if r["links"]]
      row["links"][link] = ({"times": times, "mean": mean_se(times)[0], "se": mean_se(times)[1],
                             "utilization": mean_se(util)[0]}
                            if len(times) == len(rs) else None)  # every seed must reach it
    table[name] = row
  for link in links:
    timed = {n: row["links"][link] for n, row in table.items() if row["links"][link]}
    if not timed:
      continue
    best = min(timed, key=lambda n: timed[n]["mean"])
    for n, cell in timed.items():
      cell["vs_fastest"] = ("fastest" if n == best
                            else compare(cell["times"], timed[best]["times"]))
      cell["vs"] = {other: compare(cell["times"], timed[other]["times"])
                    for other in timed if other != n}
  return table


def claims(table: dict) -> list[dict]:
  """The papers' claims, each with our figure (final eval loss at the budget, mean over seeds)."""
  out = []
  for c in CLAIMS:
    row = {"claim": c.what, "entry": c.entry, "baseline": c.baseline, "paper": c.paper}
    needed = [c.entry, c.baseline] + ([c.fewer_bytes[0]] if c.fewer_bytes else [])
    if all(n in table for n in needed):
      e, b = table[c.entry], table[c.baseline]
      diff = 100 * (e["final_eval_loss"] / b["final_eval_loss"] - 1)
      holds = diff <= c.max_diff_percent and (not c.two_sided or diff >= -c.max_diff_percent)
      row["loss_diff_percent"] = diff
      if c.fewer_bytes:
        other, minimum = c.fewer_bytes
        ratio = table[other]["bytes_per_worker"] / e["bytes_per_worker"]
        row["fewer_bytes_than"], row["bytes_ratio"] = other, ratio
        holds = holds and ratio >= minimum
      row["holds"] = holds
    out.append(row)
  return out


def _fmt_seconds(s: float, scale: float | None = None) -> str:
  """3 significant digits; below 1e-9 of `scale` (a standard error of a mean that large) is 0."""
  if scale is not None and abs(s) < 1e-9 * scale:
    return "0"
  return f"{s:.3g}" if s < 1000 else f"{s:,.0f}"


def markdown(scale: str, task, table: dict, claim_rows: list[dict], command: str, links) -> str:
  lines = [f"`{command}` (bench_{scale}.json, bench_{scale}.png): model `{task.model}`, corpus "
           f"`{task.corpus}`, {task.batch} × {task.seq_len} tokens per step, {task.steps} steps, "
           f"target eval loss {task.target_loss}, H = {task.sync_every}; a step declared "
           f"{task.step_seconds:.3g} s ({task.accelerator}, MFU {task.mfu}). Cells: simulated "
           "seconds to the target, mean ± standard error over the seeds; **bold**: the fastest "
           "on the link and every entry that ties with it (difference within 2 standard errors); "
           f"– : a seed did not reach the target. The target is read at evaluations (every "
           f"{task.eval_every} steps): seeds crossing at the same one give equal times "
           "(standard error 0).", "",
           "| entry | seeds | final eval loss | MB per worker | "
           + " | ".join(links) + " |", "|---|---|---|---|" + "---|" * len(links)]
  for name, row in table.items():
    loss = f"{row['final_eval_loss']:.4f}" + (f" ± {row['final_eval_loss_se']:.4f}"
                                              if row["final_eval_loss_se"] is not None else "")
    cells = []
    for link in links:
      cell = row["links"][link]
      if cell is None:
        cells.append("–")
        continue
      text = _fmt_seconds(cell["mean"]) + (f" ± {_fmt_seconds(cell['se'], cell['mean'])}"
                                           if cell["se"] is not None else "")
      cells.append(f"**{text}**" if cell.get("vs_fastest") in ("fastest", "tie") else text)
    lines.append(f"| {name} | {row['seeds']} | {loss} | {row['bytes_per_worker'] / 1e6:.3f} | "
                 + " | ".join(cells) + " |")
  lines += ["", "| the papers' claim | paper | ours (final eval loss, bytes ratio) | holds here |",
            "|---|---|---|---|"]
  for c in claim_rows:
    if "loss_diff_percent" not in c:
      lines.append(f"| {c['claim']} | {c['paper']} | not run | – |")
      continue
    ratio = (f", {c['bytes_ratio']:.0f}× fewer bytes than {c['fewer_bytes_than']}"
             if "bytes_ratio" in c else "")
    lines.append(f"| {c['claim']} | {c['paper']} | {c['loss_diff_percent']:+.2f}%{ratio} | "
                 f"{'yes' if c['holds'] else '**no**'} |")
  lines += ["", "Tried where a claim fails: the tuned entries beside the papers' settings (DiLoCo "
            "outer momentum 0.5 against 0.9; SparseLoCo η = 2 against 1); no other sweep at this "
            "scale."]
  return "\n".join(lines) + "\n"


def write_readme_section(readme: pathlib.Path, scale: str, text: str) -> bool:
  """Replaces what lies between the scale's markers in `readme`; False when it has none."""
  if not readme.exists():
    return False
  start, end = f"<!-- bench:{scale} -->", f"<!-- /bench:{scale} -->"
  old = readme.read_text()
  pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
  if not pattern.search(old):
    return False
  new = pattern.sub(lambda _: f"{start}\n{text}{end}", old)
  tmp = readme.with_suffix(".tmp")
  tmp.write_text(new)
  tmp.replace(readme)  # whole: a reader never sees half a README
  return True


def plot(path: pathlib.Path, runs: list[dict], target_loss: float, links) -> None:
  fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4), sharey=True)
  colors = {}
  for ax, link in zip(axes, links):
    for r in runs:
      if r["seed"] != 0:
        continue
      color = colors.setdefault(r["entry"], f"C{len(colors) % 10}")
      ax.plot([cell["seconds"] for cell in r["curve_links"][link]],
              [loss for _, loss in r["eval_curve"]], ".-", lw=1, color=color, label=r["entry"])
    ax.axhline(target_loss, color="gray", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_title(link, fontsize=10)
    ax.set_xlabel("simulated seconds")
  axes[0].set_ylabel("eval loss (nats per token), seed 0")
  axes[-1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
