"""Debian-packaged corpora: fetch once per session into the cache folder, then read.

The fetch uses the cache folder (`$LOWCOMM_CACHE` or ~/.cache/lowcomm_jax/corpora),
so only the first run on a machine downloads (about 6 MB here, a few seconds).
"""

import os
import shutil
import subprocess
import sys
import threading

import pytest

# Small sources only, to keep the suite fast; the fetch command covers the rest.
from conftest import DEBIAN_TEST_SOURCES as _TEST_SOURCES  # pylint: disable=g-bad-import-order

from lowcomm_jax.data import debian, debian_readers


def test_fetched_sources_read_known_text(cache_dir):
  bible = dict(debian.documents("bible_kjv", cache_dir))
  assert len(bible) == 1189  # Chapters of the KJV Bible.
  assert "In the beginning God created the heaven and the earth." in bible["0000 Genesis 1"]
  assert bible["1188 Revelation 22"].rstrip().endswith("Amen.")

  austen = debian.documents("austen", cache_dir)
  books = {doc_id.split("/")[0] for doc_id, _ in austen}
  assert books == {"emma", "mansfieldpark", "northangerabbey", "persuasion",
                   "prideprejudice", "sensesensibility"}
  pride = dict(austen)["prideprejudice/001"]
  assert "It is a truth universally acknowledged" in pride

  jargon = debian.documents("jargon", cache_dir)
  assert len(jargon) > 2000
  assert any(doc_id.endswith(" cruft") for doc_id, _ in jargon)

  r_nodes = debian.documents("r_manuals", cache_dir)
  assert any("R-intro" in doc_id for doc_id, _ in r_nodes)
  assert all(text.strip() for _, text in r_nodes)


@pytest.mark.parametrize("name", _TEST_SOURCES)
def test_documents_are_deterministic_with_unique_ids(cache_dir, name):
  first = debian.documents(name, cache_dir)
  assert first == debian.documents(name, cache_dir)
  assert len({doc_id for doc_id, _ in first}) == len(first)
  assert debian.is_fetched(name, cache_dir)


def test_unfetched_source_names_the_fetch_command(tmp_path):
  assert not debian.is_fetched("gcide", tmp_path)
  with pytest.raises(debian.NotFetchedError, match=r"fetch_corpora\.py --sources=gcide"):
    debian.documents("gcide", tmp_path)


def test_unknown_source_lists_the_allowed_ones():
  with pytest.raises(ValueError, match=r"unknown Debian corpus 'shakespeare'.*austen"):
    debian.fetch("shakespeare")


def test_dictd_base64_numbers_and_roff_stripping():
  assert debian_readers._dictd_number("BC") == 1 * 64 + 2
  assert debian_readers._dictd_number("5I") == 57 * 64 + 8
  source = (".TH X 1\n.SH name\nx \\- do \\fBthings\\fR\n.PP\nmore\\(emtext\nand\n"
            ".BR kill (2)\n.\\\" a comment\n.nf\na\n  b\n.fi\n")
  assert debian_readers.strip_roff(source) == (
      "NAME\n\nx - do things\n\nmore--text and kill(2)\n\na\n  b\n")


def test_package_over_the_size_limit_is_refused(monkeypatch, tmp_path):
  monkeypatch.setattr(debian, "package_sizes", lambda packages: {"some-package": 61 * 2**20})
  with pytest.raises(debian.FetchError, match="over the 60 MiB limit"):
    debian.download_packages(["some-package"], tmp_path)


def test_fetch_command_rejects_an_unknown_source():
  result = subprocess.run(
      [sys.executable, "experiments/fetch_corpora.py", "--sources=austen,nope"],
      capture_output=True, text=True, check=False,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert result.returncode != 0
  assert "unknown ['nope']" in result.stderr + result.stdout


def test_missing_package_lists_without_root_is_a_clear_error(monkeypatch):
  monkeypatch.setattr(debian.os, "geteuid", lambda: 1000)
  with pytest.raises(debian.FetchError, match=r"needs root\. Run 'sudo apt-get update'"):
    debian._apt_update_if_possible(["dict-gcide"], "E: Unable to locate package dict-gcide")


def _built_deb(tmp_path, text: str):
  """A real .deb (dpkg-deb -b) holding usr/share/doc/fake/text.txt."""
  root = tmp_path / f"pkg_{text}"
  (root / "DEBIAN").mkdir(parents=True)
  (root / "DEBIAN" / "control").write_text(
      "Package: fake\nVersion: 1.0\nArchitecture: all\nMaintainer: tests <t@example.org>\n"
      "Description: a corpus of one file\n")
  (root / "usr/share/doc/fake").mkdir(parents=True)
  (root / "usr/share/doc/fake/text.txt").write_text(text)
  deb = tmp_path / f"fake_{text}.deb"
  subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(root), str(deb)], check=True,
                 capture_output=True)
  return deb


def test_a_fetch_replaces_the_source_whole_or_not_at_all_one_fetcher_at_a_time(tmp_path):
  """Two runs (or test sessions) fetching at once, and a fetch that dies half-way, never leave a
  half-extracted source where readers look (they used to: `FileNotFoundError ... reboot.2.gz`)."""
  if not shutil.which("dpkg-deb"):
    pytest.skip("dpkg-deb is not installed")
  read = lambda src: [("text", (src / "root/usr/share/doc/fake/text.txt").read_text())]
  cache = tmp_path / "cache"
  seen = {}

  def render(src):  # runs after extraction, before the source is in place
    seen["visible"] = (cache / "fake").exists()
    if seen.get("fail"):
      raise debian.FetchError("render failed")

  source = debian.Source("fake", ("fake",), "one file", "none", "tests", read, render)
  first = _built_deb(tmp_path, "first")
  source.fetch(cache, debs={"fake": first})
  assert seen["visible"] is False and source.documents(cache) == [("text", "first")]

  # A forced fetch that fails half-way keeps the complete copy and leaves nothing behind.
  seen["fail"] = True
  with pytest.raises(debian.FetchError, match="render failed"):
    source.fetch(cache, force=True, debs={"fake": _built_deb(tmp_path, "second")})
  assert source.documents(cache) == [("text", "first")]
  assert sorted(p.name for p in cache.iterdir()) == [".fake.lock", "fake"]

  # While one fetch runs, a second waits for it and then finds the source fetched (it used to
  # remove the first one's half-built folder and extract its own over it).
  seen["fail"], second_done = False, []

  def slow_render(src):
    render(src)
    second = threading.Thread(target=lambda: second_done.append(source.fetch(cache)))
    second.start()
    second.join(timeout=0.5)
    seen["second_waited"] = second.is_alive()  # blocked on the lock this fetch holds
    seen["second"] = second

  slow = debian.Source("fake", ("fake",), "one file", "none", "tests", read, slow_render)
  shutil.rmtree(cache / "fake")
  record = slow.fetch(cache, debs={"fake": _built_deb(tmp_path, "third")})
  seen["second"].join(timeout=30)
  assert seen["second_waited"] and second_done == [record]
  assert source.documents(cache) == [("text", "third")]
  assert sorted(p.name for p in cache.iterdir()) == [".fake.lock", "fake"]

