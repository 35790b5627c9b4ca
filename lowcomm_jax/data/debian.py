"""Real-text corpora shipped as Debian packages, fetched into a cache folder.

Each source is one or more Debian packages that hold English text: novels,
scripture, dictionaries, glossaries, manuals and man pages. `fetch` runs
``apt-get download NAME`` and ``dpkg-deb -x`` into
``<cache_dir>/<source>/root``, so extraction needs no root; only
``apt-get update`` (run when apt has no package lists yet) needs root. A source
whose text needs decoding (the KJV Bible's compressed data file, read by the
package's own ``bible`` program; Austen's R data; roff man pages, stripped of
markup in Python) is decoded once at fetch time into ``<cache_dir>/<source>/text``.
A source is built in a temporary folder beside its own, with the marker file
``fetched.json`` written last, then renamed into place: readers see a complete source or none,
and two processes fetching at once (two runs, two test sessions) take turns on a lock file
instead of extracting over each other.

Readers turn a fetched source into documents, ``(doc_id, text)`` pairs in a
deterministic order (sorted paths, file order within a file).

The cache folder is ``$LOWCOMM_CACHE`` when set, else
``~/.cache/lowcomm_jax/corpora``. The project's fetch command is
``python experiments/fetch_corpora.py --sources=all``.

Sources and their licences (from each package's ``copyright`` file):

| source | packages | licence of the text |
|---|---|---|
| austen | r-cran-janeaustenr | novels public domain; R packaging MIT |
| bible_kjv | bible-kjv-text, bible-kjv | KJV text public domain; BRS software "unrestricted use" |
| gcide | dict-gcide | GPL-2+ (from Webster's 1913, public domain, and WordNet) |
| wordnet | wordnet-base | WordNet 3.0 licence (BSD-like, Princeton) |
| foldoc | dict-foldoc | GFDL-1.1+ |
| jargon | jargon-text | public domain |
| fortunes | fortunes | BSD fortune-mod collection; see the package's copyright |
| python_docs | python3.11-doc | PSF-2.0 |
| octave_manual | octave-doc | GPL-3+ |
| r_manuals | r-doc-info | GPL-2 |
| maxima_manual | maxima-doc | GPL-2 |
| man_pages | manpages | Linux man-pages copyleft, GPL-2+, BSD (per page) |
| man_pages_dev | manpages-dev | Linux man-pages copyleft, GPL-2+, BSD (per page) |
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import re
import shutil
import tempfile
from typing import Callable, Mapping, Sequence

from lowcomm_jax.data.debian_readers import (
  FetchError,
  read_austen,
  read_bible,
  read_dictd,
  read_fortunes,
  read_info,
  read_jargon,
  read_man_pages,
  read_python_docs,
  read_wordnet,
  render_austen,
  render_bible,
  render_man_pages,
  run_command,
)

Documents = list[tuple[str, str]]

# Packages larger than this are refused: the corpora are meant to stay modest.
MAX_PACKAGE_BYTES = 60 * 1024 * 1024
_MARKER = "fetched.json"
# Bumped when a reader's decoded text changes, so older caches are fetched again.
_CACHE_FORMAT = 2
FETCH_COMMAND = "python experiments/fetch_corpora.py --sources={names}"


class NotFetchedError(FileNotFoundError):
  """A source is read before it was fetched into the cache folder."""


def default_cache_dir() -> pathlib.Path:
  """Returns ``$LOWCOMM_CACHE`` or ``~/.cache/lowcomm_jax/corpora``."""
  env = os.environ.get("LOWCOMM_CACHE")
  if env:
    return pathlib.Path(env).expanduser()
  return pathlib.Path("~/.cache/lowcomm_jax/corpora").expanduser()


def resolve_cache_dir(cache_dir: str | os.PathLike | None) -> pathlib.Path:
  """The cache folder: `cache_dir`, or `default_cache_dir()` when it is None."""
  return default_cache_dir() if cache_dir is None else pathlib.Path(cache_dir)


# ---------------------------------------------------------------------------
# apt plumbing
# ---------------------------------------------------------------------------



def _apt_update_if_possible(packages: Sequence[str], reason: str) -> None:
  """Runs ``apt-get update`` as root, or raises a FetchError saying why not."""
  if os.geteuid() != 0:
    raise FetchError(
        f"cannot fetch {', '.join(packages)}: {reason.strip()}; apt's package lists "
        "may be missing and 'apt-get update' needs root. Run 'sudo apt-get update' "
        "once, then fetch again.")
  result = run_command(["apt-get", "update"])
  if result.returncode != 0:
    raise FetchError(f"'apt-get update' failed:\n{result.stderr.strip()}")


def package_sizes(packages: Sequence[str]) -> dict[str, int]:
  """Download sizes in bytes of the candidate versions of `packages`.

  Runs ``apt-get update`` first (as root) when apt does not know them yet.

  Raises:
    FetchError: apt is missing, or does not know a package even after an update.
  """
  missing = [tool for tool in ("apt-get", "apt-cache", "dpkg-deb") if shutil.which(tool) is None]
  if missing:
    raise FetchError(f"cannot fetch {', '.join(packages)}: {', '.join(missing)} not "
                     "installed (Debian/Ubuntu only); the portable domains need no fetch")
  sizes: dict[str, int] = {}
  for attempt in range(2):
    result = run_command(["apt-cache", "show", "--no-all-versions", *packages])
    for block in result.stdout.split("\n\n"):
      name = re.search(r"^Package:\s*(\S+)", block, re.MULTILINE)
      size = re.search(r"^Size:\s*(\d+)", block, re.MULTILINE)
      if name and size:
        sizes[name.group(1)] = int(size.group(1))
    unknown = [p for p in packages if p not in sizes]
    if not unknown:
      return sizes
    if attempt == 0:
      _apt_update_if_possible(packages, f"apt-cache knows no package {', '.join(unknown)}")
  raise FetchError(f"apt knows no package {', '.join(unknown)}, even after apt-get update")


def download_packages(packages: Sequence[str], work: pathlib.Path) -> dict[str, pathlib.Path]:
  """Downloads the .deb files of `packages` into `work` with one apt-get call.

  Raises:
    FetchError: a package over `MAX_PACKAGE_BYTES`, or apt fails.
  """
  for package, size in package_sizes(packages).items():
    if size > MAX_PACKAGE_BYTES:
      raise FetchError(
          f"package {package!r} is {size / 2**20:.1f} MiB, over the "
          f"{MAX_PACKAGE_BYTES / 2**20:.0f} MiB limit for corpora")
  # As root, apt drops to the _apt user, which cannot write a private temp
  # folder; letting the download stay root avoids a warning and a failure.
  cmd = ["apt-get", "download", "-o", "APT::Sandbox::User=root", *packages]
  result = run_command(cmd, cwd=work)
  if result.returncode != 0:
    _apt_update_if_possible(packages, result.stderr)
    result = run_command(cmd, cwd=work)
    if result.returncode != 0:
      raise FetchError(f"'{' '.join(cmd)}' failed:\n{result.stderr.strip()}")
  debs = {}
  for package in packages:
    found = sorted(work.glob(f"{package}_*.deb"))
    if not found:
      raise FetchError(f"'apt-get download {package}' left no .deb in {work}")
    debs[package] = found[-1]
  return debs


@contextlib.contextmanager
def _exclusive(lock_path: pathlib.Path):
  """Holds an exclusive lock on `lock_path` (released by the kernel if the process dies)."""
  with open(lock_path, "a+b") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def _extract(deb: pathlib.Path, root: pathlib.Path) -> None:
  result = run_command(["dpkg-deb", "-x", str(deb), str(root)])
  if result.returncode != 0:
    raise FetchError(f"'dpkg-deb -x {deb.name}' failed:\n{result.stderr.strip()}")



# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
  """A corpus made of Debian packages.

  Attributes:
    name: registry key, also the folder name under the cache folder.
    packages: Debian package names downloaded and extracted together.
    description: what the text is.
    licence: the licence of the text, from the package's copyright file.
    origin: where the text comes from upstream.
    reader: turns ``<cache_dir>/<name>`` into documents.
    render: optional step run once after extraction (e.g. a program that
      decompresses the text), writing into ``<cache_dir>/<name>/text``.
  """

  name: str
  packages: tuple[str, ...]
  description: str
  licence: str
  origin: str
  reader: Callable[[pathlib.Path], Documents]
  render: Callable[[pathlib.Path], None] | None = None

  def folder(self, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    return resolve_cache_dir(cache_dir) / self.name

  def is_fetched(self, cache_dir: str | os.PathLike | None = None) -> bool:
    marker = self.folder(cache_dir) / _MARKER
    try:
      return json.loads(marker.read_text()).get("format") == _CACHE_FORMAT
    except (OSError, ValueError):
      return False

  def fetch(self, cache_dir: str | os.PathLike | None = None, *,
            force: bool = False, debs: Mapping[str, pathlib.Path] | None = None) -> dict:
    """Downloads, extracts and decodes the source; a no-op when already fetched.

    Args:
      cache_dir: the cache folder; None means `default_cache_dir()`.
      force: fetch again even if the marker file says it is there.
      debs: already downloaded .deb files by package name (see
        `ensure_fetched`, which downloads many sources in one apt call).

    Returns:
      The marker record: packages with their .deb sizes, and the bytes on disk.

    Raises:
      FetchError: apt cannot find, download or extract a package.
    """
    folder = self.folder(cache_dir)
    if self.is_fetched(cache_dir) and not force:
      return json.loads((folder / _MARKER).read_text())
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One fetcher of this source at a time (two runs started together wait for the first), and
    # the folder appears complete or not at all: built under a temporary name, then renamed, so
    # a reader never sees a half-extracted source, even from a process killed mid-fetch.
    with _exclusive(folder.parent / f".{self.name}.lock"):
      if self.is_fetched(cache_dir) and not force:  # fetched while this process waited
        return json.loads((folder / _MARKER).read_text())
      partial = pathlib.Path(tempfile.mkdtemp(prefix=f".{self.name}.partial-", dir=folder.parent))
      try:
        with tempfile.TemporaryDirectory(dir=partial) as work:
          if debs is None or not set(self.packages) <= set(debs):
            debs = download_packages(self.packages, pathlib.Path(work))
          for package in self.packages:
            _extract(debs[package], partial / "root")
          deb_sizes = {package: debs[package].stat().st_size for package in self.packages}
        if self.render is not None:
          self.render(partial)
        record = {"source": self.name, "format": _CACHE_FORMAT, "deb_bytes": deb_sizes,
                  "disk_bytes": sum(p.stat().st_size for p in partial.rglob("*")
                                    if p.is_file() and not p.is_symlink())}
        (partial / _MARKER).write_text(json.dumps(record, indent=1))
        if folder.exists():  # a half-finished or outdated earlier fetch: set aside, then removed
          stale = pathlib.Path(tempfile.mkdtemp(prefix=f".{self.name}.stale-", dir=folder.parent))
          os.replace(folder, stale / self.name)
          shutil.rmtree(stale, ignore_errors=True)
        os.replace(partial, folder)
      finally:
        shutil.rmtree(partial, ignore_errors=True)
    return record

  def documents(self, cache_dir: str | os.PathLike | None = None) -> Documents:
    """Returns ``[(doc_id, text), ...]`` in a deterministic order.

    Raises:
      NotFetchedError: the source is not in the cache folder; the message
        names the fetch command.
    """
    if not self.is_fetched(cache_dir):
      raise NotFetchedError(
          f"Debian corpus {self.name!r} is not in the cache folder "
          f"{resolve_cache_dir(cache_dir)}; fetch it with: "
          + FETCH_COMMAND.format(names=self.name)
          + (f" --cache_dir={cache_dir}" if cache_dir is not None else ""))
    return self.reader(self.folder(cache_dir))


def _source(name, packages, description, licence, origin, reader, render=None):
  return Source(name, tuple(packages), description, licence, origin, reader, render)


SOURCES: dict[str, Source] = {s.name: s for s in [
    _source("austen", ["r-cran-janeaustenr"],
            "Jane Austen's six completed novels, one document per chapter",
            "novels public domain; R package MIT",
            "Project Gutenberg via the CRAN package janeaustenr (Julia Silge)",
            read_austen, render_austen),
    _source("bible_kjv", ["bible-kjv-text", "bible-kjv"],
            "King James Version of the Bible (1611), one document per chapter",
            "public domain text; Bible Retrieval System: unrestricted use",
            "Bible Retrieval System by Chip Chapin", read_bible, render_bible),
    _source("gcide", ["dict-gcide"],
            "GNU Collaborative International Dictionary of English, one entry per document",
            "GPL-2+", "GNU GCIDE 0.48 (from Webster's 1913 and WordNet)",
            lambda src: read_dictd(src, "gcide")),
    _source("wordnet", ["wordnet-base"],
            "WordNet 3.0 synset glosses, 100 synsets per document",
            "WordNet 3.0 licence (Princeton University)", "Princeton WordNet 3.0",
            read_wordnet),
    _source("foldoc", ["dict-foldoc"],
            "Free On-line Dictionary of Computing, one entry per document",
            "GFDL-1.1+", "foldoc.org, editor Denis Howe",
            lambda src: read_dictd(src, "foldoc")),
    _source("jargon", ["jargon-text"],
            "The Jargon File 4.4.7, one entry per document",
            "public domain", "Eric S. Raymond's Jargon File", read_jargon),
    _source("fortunes", ["fortunes"],
            "BSD fortune cookies (quotations, jokes), one cookie per document",
            "BSD (fortune-mod); see the package's copyright file",
            "fortune-mod 1.99.1", read_fortunes),
    _source("python_docs", ["python3.11-doc"],
            "Python 3.11 documentation in reStructuredText, one page per document",
            "PSF-2.0", "docs.python.org sources shipped by Debian", read_python_docs),
    _source("octave_manual", ["octave-doc"],
            "GNU Octave 7.3 manual (info), one node per document",
            "GPL-3+", "GNU Octave",
            lambda src: read_info(src, ("octave.info*", "liboctave.info*"))),
    _source("r_manuals", ["r-doc-info"],
            "R 4.2 manuals (intro, language, extensions, admin, data, FAQ), one info node per "
            "document",
            "GPL-2", "R Core Team",
            lambda src: read_info(src, ("R-*.info*",))),
    _source("maxima_manual", ["maxima-doc"],
            "Maxima 5.46 reference manual and share-package manuals (info), one node per document",
            "GPL-2", "Maxima project",
            lambda src: read_info(src, ("maxima.info*", "maxima/*.info*"))),
    _source("man_pages", ["manpages"],
            "Linux man pages, sections 1, 4, 5, 7, 8, one page (roff stripped) per document",
            "Linux man-pages copyleft, GPL-2+, BSD (per page)",
            "Linux man-pages project 6.03", read_man_pages, render_man_pages),
    _source("man_pages_dev", ["manpages-dev"],
            "Linux system-call and C library man pages (sections 2, 3), one page (roff stripped) "
            "per document",
            "Linux man-pages copyleft, GPL-2+, BSD (per page)",
            "Linux man-pages project 6.03", read_man_pages, render_man_pages),
]}


def _source_named(name: str) -> Source:
  if name not in SOURCES:
    raise ValueError(f"unknown Debian corpus {name!r}; allowed: {', '.join(SOURCES)}")
  return SOURCES[name]


def is_fetched(name: str, cache_dir: str | os.PathLike | None = None) -> bool:
  """Whether source `name` is complete in the cache folder."""
  return _source_named(name).is_fetched(cache_dir)


def fetch(name: str, cache_dir: str | os.PathLike | None = None, *,
          force: bool = False) -> dict:
  """Fetches source `name` (see `Source.fetch`)."""
  return _source_named(name).fetch(cache_dir, force=force)


def documents(name: str, cache_dir: str | os.PathLike | None = None) -> Documents:
  """Documents of source `name` (see `Source.documents`)."""
  return _source_named(name).documents(cache_dir)


def ensure_fetched(names: Sequence[str],
                   cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """Fetches those of `names` not yet in the cache folder; returns the folder.

  All missing packages are downloaded by one ``apt-get download`` call, which
  is several times faster than one call per source.

  Raises:
    ValueError: an unknown source name.
    FetchError: apt is missing or a package cannot be fetched.
  """
  pending = [_source_named(name) for name in names if not is_fetched(name, cache_dir)]
  if not pending:
    return resolve_cache_dir(cache_dir)
  resolve_cache_dir(cache_dir).mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=resolve_cache_dir(cache_dir)) as work:
    packages = list(dict.fromkeys(p for source in pending for p in source.packages))
    debs = download_packages(packages, pathlib.Path(work))
    for source in pending:
      source.fetch(cache_dir, debs=debs)
  return resolve_cache_dir(cache_dir)


# The name `lowcomm_jax.data.corpora` reads `debian:<source>` corpora through.
load_documents = documents
