"""The docs describe the repository as it is: every path they cite exists, every link and section
they point to is there, and the Python examples of the README and docs/api.md run and do what
their comments say."""

import glob
import json
import re

import jax
import jax.numpy as jnp
import pytest

from lowcomm_jax import config as config_lib, testing
from lowcomm_jax.testing import ROOT
from lowcomm_jax.train import algorithms

DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/**/*.md"),
               *ROOT.glob("colabs/*.ipynb")])
_TOP = ("lowcomm_jax", "docs", "tests", "experiments", "benchmarks", "colabs")
_PACKAGES = sorted(p.parent.name for p in ROOT.glob("lowcomm_jax/*/__init__.py"))
# A repository path: from a top-level folder (`docs/api.md`, `benchmarks/results/`), or from a
# lowcomm_jax package with a module's file name (`train/sources.py`, as the docs write them).
_REPO_PATH = re.compile(r"(?<![\w./~-])((?:%s)/[\w./*{},-]*)" % "|".join(_TOP))
_PACKAGE_PATH = re.compile(r"(?<![\w./~-])((?:%s)/[\w/-]+\.(?:py|cc))" % "|".join(_PACKAGES))
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_SECTION = re.compile(r"([\w./]+\.md|README)'s \"([^\"]+)\" section")


def _text(path) -> str:
  """A markdown file's text; a notebook's cells, markdown and code, one after the other."""
  if path.suffix == ".ipynb":
    return "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"])
  return path.read_text()


def _expand(path: str) -> list[str]:
  """`a.{json,png}` -> a.json, a.png (as a shell expands it)."""
  match = re.search(r"\{([^{}]*)\}", path)
  if match is None:
    return [path]
  return [expanded for alternative in match.group(1).split(",")
          for expanded in _expand(path[:match.start()] + alternative + path[match.end():])]


def _written_by_a_benchmark(path: str) -> bool:
  """A results file that a benchmark writes where it runs (an accelerator host) may be absent."""
  name = path.removeprefix("benchmarks/results/")
  return name != path and "/" not in name and any(
      name in script.read_text() for script in ROOT.glob("benchmarks/*.py"))


def _missing_paths(doc) -> list[str]:
  missing = []
  cited = [(p, ROOT) for p in _REPO_PATH.findall(_text(doc))]
  cited += [(p, ROOT / "lowcomm_jax") for p in _PACKAGE_PATH.findall(_text(doc))]
  for path, base in cited:
    for one in _expand(path.rstrip(".,;:")):
      # `colabs/01_diloco` names the notebook without its extension
      if not (glob.glob(str(base / one)) or glob.glob(str(base / one) + ".*")
              or _written_by_a_benchmark(one)):
        missing.append(one)
  return missing


def _slug(heading: str) -> str:
  """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to dashes."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(doc) -> list[str]:
  """The markdown headings of `doc`, outside code blocks."""
  headings, in_code = [], False
  for line in doc.read_text().splitlines():
    if line.lstrip().startswith("```"):
      in_code = not in_code
    elif not in_code and re.match(r"#{1,6} ", line):
      headings.append(line.lstrip("#").strip())
  return headings


def _broken_links(doc) -> list[str]:
  broken = []
  for target in _LINK.findall(_text(doc)):
    if re.match(r"[a-z]+:", target):  # https:, mailto:
      continue
    file, _, anchor = target.partition("#")
    linked = (doc.parent / file).resolve() if file else doc
    if not linked.exists():
      broken.append(target)
    elif anchor and anchor not in {_slug(h) for h in _headings(linked)}:
      broken.append(target)
  for file, section in _SECTION.findall(_text(doc)):
    linked = ROOT / "README.md" if file == "README" else ROOT / file
    if section.lower() not in {h.lower() for h in _headings(linked)}:
      broken.append(f"{file}'s \"{section}\" section")
  return broken


def test_the_checks_find_what_is_stale(tmp_path):
  """The checks below on a document written wrong on purpose: each mistake is reported."""
  doc = tmp_path / "stale.md"
  doc.write_text("See `lowcomm_jax/train/trainer.py`, `codecs/replica_mean.py`,\n"
                 "`train/sources.py`, `benchmarks/results/skippipe_training.{json,gif}`,\n"
                 "`docs/api.md`, [x](api.md),\n"
                 f"[y]({ROOT / 'README.md'}#the-optax-style-api), [z]({ROOT / 'README.md'}#gone)\n"
                 "and the README's \"Streaming overlap\" section.\n")
  assert sorted(_missing_paths(doc)) == ["benchmarks/results/skippipe_training.gif",
                                         "codecs/replica_mean.py"]
  assert _broken_links(doc) == ["api.md", f"{ROOT / 'README.md'}#gone",
                                "README's \"Streaming overlap\" section"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_cited_path_link_and_section_exists(doc):
  assert _missing_paths(doc) == []
  assert _broken_links(doc) == []


def _moved_keys_named(text: str) -> list[str]:
  keys = "|".join(map(re.escape, config_lib.MOVED_KEYS))
  return re.findall(rf"(?<![\w.])(?:{keys})(?!\w)", text)


def test_the_docs_name_each_key_at_its_place_now():
  """No document or notebook names a key that moved (but the table of moves in command_line.md),
  and the docs' table of the sections each algorithm reads is the registry's rows."""
  assert _moved_keys_named("x diloco.sync_every, sparseloco.top_k, outer.sync_every") == [
      "diloco.sync_every"]
  stale = {str(d.relative_to(ROOT)): _moved_keys_named(_text(d)) for d in DOCS
           if d.name != "command_line.md"}
  assert {name: keys for name, keys in stale.items() if keys} == {}
  doc = (ROOT / "docs/command_line.md").read_text()
  table = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|$", doc, re.M))
  rows = {name: ", ".join(f"`{s}`" for s in row.sections) or "none"
          for name, row in algorithms.ALGORITHMS.items()}
  assert {name: table.get(name) for name in rows} == rows


def _python_blocks(doc) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.S | re.M)


def _run(code: str, name: str) -> dict:
  namespace = {"__name__": name}
  exec(compile(code, name, "exec"), namespace)  # pylint: disable=exec-used
  return namespace


def test_the_readme_api_example_runs_and_its_replicas_learn():
  (example,) = _python_blocks(ROOT / "README.md")
  run = _run(example, "README.md")
  # It prints the replicas' losses after 20 syncs, "far below 140 at the start" (x @ arange(8) on
  # standard normal x: a variance of 0² + ... + 7² = 140).
  start = run["loss_fn"](jax.tree.map(jnp.zeros_like, run["params"]), jax.tree.map(
      lambda a: a[0], run["batch"]))
  assert 100 < float(start) < 200
  final = jax.vmap(run["loss_fn"])(run["params_R"], run["batch"])
  assert float(final.max()) < 0.1 * float(start)


def test_the_api_doc_examples_run_and_every_algorithm_learns():
  example, _ = _python_blocks(ROOT / "docs" / "api.md")
  run = _run(example, "docs/api.md")
  for name in ("streaming", "noloco", "sparse"):
    # from 140 at the start (as the README's problem) to below 5% of it on every replica
    assert float(run["losses"][name].max()) < 0.05 * 140, name


def test_the_api_doc_hooks_example_runs(tmp_path, monkeypatch):
  """docs/api.md's hooks example, its `config` a tiny run of 6 steps (in a temporary folder): the
  hooks see the final state and one timing per step."""
  _, example = _python_blocks(ROOT / "docs" / "api.md")
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "docs/api.md", "config": testing.tiny_config(num_steps=6)}
  exec(compile(example, "docs/api.md", "exec"), namespace)  # pylint: disable=exec-used
  assert namespace["summary"]["steps"] == 6
  assert int(namespace["final"].state.step) == 6
  assert [t[0] for t in namespace["steps"].times] == list(range(1, 7))
