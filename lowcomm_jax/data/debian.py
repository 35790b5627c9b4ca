"""Real-text corpora shipped as Debian packages, fetched into a cache folder.

Each source is one or more Debian packages that hold English text: novels,
scripture, dictionaries, glossaries, manuals and man pages. `fetch` runs
``apt-get download NAME`` and ``dpkg-deb -x`` into
``<cache_dir>/<source>/root``, so extraction needs no root; only
``apt-get update`` (run when apt has no package lists yet) needs root. A source
whose text needs decoding (the KJV Bible's compressed data file, read by the
package's own ``bible`` program; Austen's R data; roff man pages, stripped of
markup in Python) is decoded once at fetch time into ``<cache_dir>/<source>/text``.
A marker file ``fetched.json`` is written last, so a half-finished fetch is never
taken for a finished one.

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

import dataclasses
import gzip
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import warnings
import zlib
from typing import Callable, Mapping, Sequence

Documents = list[tuple[str, str]]

# Packages larger than this are refused: the corpora are meant to stay modest.
MAX_PACKAGE_BYTES = 60 * 1024 * 1024
_MARKER = "fetched.json"
# Bumped when a reader's decoded text changes, so older caches are fetched again.
_CACHE_FORMAT = 2
FETCH_COMMAND = "python experiments/fetch_corpora.py --sources={names}"


class FetchError(RuntimeError):
  """A Debian package could not be downloaded or extracted."""


class NotFetchedError(FileNotFoundError):
  """A source is read before it was fetched into the cache folder."""


def default_cache_dir() -> pathlib.Path:
  """Returns ``$LOWCOMM_CACHE`` or ``~/.cache/lowcomm_jax/corpora``."""
  env = os.environ.get("LOWCOMM_CACHE")
  if env:
    return pathlib.Path(env).expanduser()
  return pathlib.Path("~/.cache/lowcomm_jax/corpora").expanduser()


def _resolve(cache_dir: str | os.PathLike | None) -> pathlib.Path:
  return default_cache_dir() if cache_dir is None else pathlib.Path(cache_dir)


# ---------------------------------------------------------------------------
# apt plumbing
# ---------------------------------------------------------------------------


def _run(cmd: list[str], cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


def _apt_update_if_possible(packages: Sequence[str], reason: str) -> None:
  """Runs ``apt-get update`` as root, or raises a FetchError saying why not."""
  if os.geteuid() != 0:
    raise FetchError(
        f"cannot fetch {', '.join(packages)}: {reason.strip()}; apt's package lists "
        "may be missing and 'apt-get update' needs root. Run 'sudo apt-get update' "
        "once, then fetch again.")
  result = _run(["apt-get", "update"])
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
    result = _run(["apt-cache", "show", "--no-all-versions", *packages])
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
  result = _run(cmd, cwd=work)
  if result.returncode != 0:
    _apt_update_if_possible(packages, result.stderr)
    result = _run(cmd, cwd=work)
    if result.returncode != 0:
      raise FetchError(f"'{' '.join(cmd)}' failed:\n{result.stderr.strip()}")
  debs = {}
  for package in packages:
    found = sorted(work.glob(f"{package}_*.deb"))
    if not found:
      raise FetchError(f"'apt-get download {package}' left no .deb in {work}")
    debs[package] = found[-1]
  return debs


def _extract(deb: pathlib.Path, root: pathlib.Path) -> None:
  result = _run(["dpkg-deb", "-x", str(deb), str(root)])
  if result.returncode != 0:
    raise FetchError(f"'dpkg-deb -x {deb.name}' failed:\n{result.stderr.strip()}")


# ---------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------


def _natural_key(path: pathlib.Path) -> tuple:
  """Sorts ``x.info``, ``x.info-2``, ``x.info-10`` in reading order."""
  return tuple(int(part) if part.isdigit() else part
               for part in re.split(r"(\d+)", path.name))


def _read_text(path: pathlib.Path) -> str:
  data = path.read_bytes()
  if path.suffix == ".gz":
    data = gzip.decompress(data)
  return data.decode("utf-8", errors="replace")


def _decode_austen(src: pathlib.Path) -> dict[str, list[str]]:
  """Reads the novels' lines out of the R package's lazy-load database."""
  import rdata  # Imported here: only this source needs it.

  data_dir = src / "root/usr/lib/R/site-library/janeaustenr/data"
  # R lazy-load data: the .rdx index (gzip, R serialization) maps each object
  # to (offset, length) in the .rdb, where it is a 4-byte length + zlib stream.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # rdata warns that it assumes RDS format.
    index = rdata.conversion.convert(rdata.parser.parse_data(
        gzip.decompress((data_dir / "Rdata.rdx").read_bytes())))
    blob = (data_dir / "Rdata.rdb").read_bytes()
    novels = {}
    for book in sorted(str(name) for name in index["variables"]):
      offset, length = (int(v) for v in index["variables"][book])
      lines = rdata.conversion.convert(rdata.parser.parse_data(
          zlib.decompress(blob[offset + 4:offset + length])))
      novels[book] = [str(line) for line in lines]
  return novels


def _render_austen(src: pathlib.Path) -> None:
  """Decodes the R data once (rdata takes about a second), keeping plain JSON."""
  (src / "text").mkdir(exist_ok=True)
  (src / "text/novels.json").write_text(json.dumps(_decode_austen(src)), encoding="utf-8")


def _read_austen(src: pathlib.Path) -> Documents:
  """One document per chapter (front matter is chapter 0) of six novels."""
  rendered = src / "text/novels.json"
  novels = (json.loads(rendered.read_text(encoding="utf-8")) if rendered.is_file()
            else _decode_austen(src))
  docs = []
  for book in sorted(novels):
    chapters: list[list[str]] = [[]]
    for line in novels[book]:
      if re.match(r"^\s*chapter\s+[\divxlc]+\b", line, re.IGNORECASE):
        chapters.append([])
      chapters[-1].append(line)
    docs += [(f"{book}/{i:03d}", "\n".join(c).strip() + "\n")
             for i, c in enumerate(chapters) if "".join(c).strip()]
  return docs


def _render_bible(src: pathlib.Path) -> None:
  """Decompresses the BRS data file with the `bible` program, unwrapped."""
  program = src / "root/usr/bin/bible"
  result = _run([str(program), "-p", str(src / "root/usr/lib"), "-l0",
                 "Gen1:1-Rev22:21"])
  if result.returncode != 0 or len(result.stdout) < 1_000_000:
    raise FetchError(f"the bible program failed to render the KJV text:\n{result.stderr}")
  (src / "text").mkdir(exist_ok=True)
  (src / "text/kjv.txt").write_text(result.stdout, encoding="utf-8")


def _read_bible(src: pathlib.Path) -> Documents:
  """One document per chapter (1189), e.g. ``Genesis 1``."""
  text = (src / "text/kjv.txt").read_text(encoding="utf-8")
  # Chapter headings are the only unindented non-empty lines.
  parts = re.split(r"^(\S.*)$", text, flags=re.MULTILINE)
  return [(f"{i:04d} {parts[j]}", parts[j] + "\n" + parts[j + 1].strip("\n") + "\n")
          for i, j in enumerate(range(1, len(parts) - 1, 2))]


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _dictd_number(code: str) -> int:
  value = 0
  for char in code:
    value = value * 64 + _B64.index(char)
  return value


def _read_dictd(src: pathlib.Path, name: str) -> Documents:
  """One document per dictionary entry of a dictd database (gzip-compatible .dz)."""
  text = gzip.decompress((src / f"root/usr/share/dictd/{name}.dict.dz").read_bytes())
  spans = {}
  for line in (src / f"root/usr/share/dictd/{name}.index").read_text(
      encoding="utf-8", errors="replace").splitlines():
    fields = line.split("\t")
    # 00-database-* entries are metadata about the database, not text.
    if len(fields) != 3 or fields[0].startswith(("00-", "00database")):
      continue
    span = (_dictd_number(fields[1]), _dictd_number(fields[2]))
    spans.setdefault(span, fields[0])  # Several headwords may share one entry.
  return [(f"{start:09d} {head}", text[start:start + length].decode("utf-8", "replace"))
          for (start, length), head in sorted(spans.items())]


def _read_wordnet(src: pathlib.Path) -> Documents:
  """Synset glosses ("lemma, lemma (pos): gloss"), 100 synsets per document."""
  docs = []
  for pos in ("noun", "verb", "adj", "adv"):
    glosses = []
    path = src / f"root/usr/share/wordnet/data.{pos}"
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
      if line.startswith("  ") or "|" not in line:
        continue  # The licence header lines start with two spaces.
      fields, gloss = line.split("|", 1)
      parts = fields.split()
      word_count = int(parts[3], 16)
      lemmas = [w.replace("_", " ") for w in parts[4:4 + 2 * word_count:2]]
      glosses.append(f"{', '.join(lemmas)} ({pos}): {gloss.strip()}")
    docs += [(f"{pos}/{i // 100:04d}", "\n".join(glosses[i:i + 100]) + "\n")
             for i in range(0, len(glosses), 100)]
  return docs


def _read_jargon(src: pathlib.Path) -> Documents:
  """One document per Jargon File entry (``:term: pronunciation, pos.``)."""
  text = _read_text(src / "root/usr/share/doc/jargon-text/jargon.txt.gz")
  parts = re.split(r"^   (:[^:\n]+:.*)$", text, flags=re.MULTILINE)
  # parts[0] is the front matter and table of contents: headwords only.
  return [(f"{i:05d} {parts[j].split(':')[1]}", parts[j].strip() + "\n" + parts[j + 1])
          for i, j in enumerate(range(1, len(parts) - 1, 2))]


def _read_fortunes(src: pathlib.Path) -> Documents:
  """One document per fortune cookie; files are lists separated by ``%`` lines."""
  folder = src / "root/usr/share/games/fortunes"
  docs = []
  for path in sorted(folder.iterdir()):
    if path.suffix or path.is_symlink() or not path.is_file():
      continue  # .dat are binary indexes, .u8 are links to the text files.
    cookies = re.split(r"^%$", _read_text(path), flags=re.MULTILINE)
    docs += [(f"{path.name}/{i:05d}", cookie.strip("\n") + "\n")
             for i, cookie in enumerate(cookies) if cookie.strip()]
  return docs


def _read_python_docs(src: pathlib.Path) -> Documents:
  """One document per reStructuredText source page of the Python 3.11 docs."""
  folder = src / "root/usr/share/doc/python3.11/html/_sources"
  return [(str(p.relative_to(folder)), _read_text(p))
          for p in sorted(folder.rglob("*.txt"))]


def _read_info(src: pathlib.Path, patterns: tuple[str, ...]) -> Documents:
  """One document per node of GNU info manuals matching the glob patterns."""
  folder = src / "root/usr/share/info"
  paths = sorted({p for pattern in patterns for p in folder.glob(pattern)},
                 key=lambda p: (str(p.parent), _natural_key(p)))
  docs = []
  for path in paths:
    for chunk in _read_text(path).split("\x1f"):
      header, _, body = chunk.lstrip("\n").partition("\n")
      match = re.search(r"Node:\s*([^,\t]+)", header)
      if not header.startswith("File:") or not match or not body.strip():
        continue  # Tag tables, indirect tables and the preamble.
      docs.append((f"{path.name.split('.info')[0]}/{len(docs):05d} {match.group(1)}",
                   body.strip("\n") + "\n"))
  return docs


_ROFF_ESCAPES = [
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),   # font changes
    (re.compile(r"\\s[+-]?\d+"), ""),                # size changes
    (re.compile(r"\\\(em|\\\[em\]"), "--"),
    (re.compile(r"\\\(en|\\\[en\]"), "-"),
    (re.compile(r"\\\((lq|rq)|\\\[(lq|rq)\]"), '"'),
    (re.compile(r"\\\(..|\\\[[^\]]*\]"), ""),        # other named glyphs
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\[&|^%:]"), ""),
    (re.compile(r"\\e"), "\\\\"),
    (re.compile(r"\\ "), " "),
]
# Font macros: B and I set their words in one font; the alternating ones
# (BR, IR, ...) glue their arguments together without spaces, as in "kill(2)".
_ROFF_FONT_MACROS = {"B", "I", "SM", "SB"}
_ROFF_ALTERNATING_MACROS = {"BR", "IR", "RB", "BI", "IB", "RI"}


def strip_roff(source: str) -> str:
  """Turns man-page roff source into plain text.

  Keeps the words and the paragraph structure: section headings on their own
  lines, filled text joined into one line per paragraph, no-fill blocks
  (``.nf``/``.EX``, code examples) line by line. Comments, requests, font and
  size changes are dropped. It is fast (a thousand pages in under a second)
  and the same on every machine, unlike groff's layout.

  Args:
    source: the roff text of one man page.

  Returns:
    The page as plain text, ending with a newline.
  """
  paragraphs: list[list[str]] = [[]]
  fill = True

  def emit(text: str) -> None:
    if fill and paragraphs[-1]:
      paragraphs[-1][-1] += " " + text
    else:
      paragraphs[-1].append(text)

  def new_paragraph() -> None:
    if paragraphs[-1]:
      paragraphs.append([])

  for line in source.splitlines():
    if line.startswith((".\\\"", "'\\\"", '\\"')):
      continue  # Comments.
    if not line.startswith((".", "'")):
      if line.strip() or not fill:
        emit(line if not fill else line.strip())
      else:
        new_paragraph()
      continue
    request, _, rest = line[1:].strip().partition(" ")
    args = [a.replace('"', "") for a in re.findall(r'"[^"]*"|\S+', rest)]
    if request in ("SH", "SS"):
      new_paragraph()
      paragraphs[-1].append(" ".join(args).upper() if request == "SH" else " ".join(args))
      new_paragraph()
    elif request in ("PP", "P", "LP", "sp", "TP", "IP", "HP", "TQ"):
      new_paragraph()
      if request == "IP" and args:
        paragraphs[-1].append(args[0])
        new_paragraph()
    elif request in ("nf", "EX"):
      new_paragraph()
      fill = False
    elif request in ("fi", "EE"):
      new_paragraph()
      fill = True
    elif request == "br":
      new_paragraph()
    elif request in _ROFF_FONT_MACROS and args:
      emit(" ".join(args))
    elif request in _ROFF_ALTERNATING_MACROS and args:
      emit("".join(args))
  text = "\n\n".join("\n".join(p) for p in paragraphs if p)
  for pattern, replacement in _ROFF_ESCAPES:
    text = pattern.sub(replacement, text)
  return text.strip() + "\n"


def _render_man_pages(src: pathlib.Path) -> None:
  """Strips every man page (not links, not ``.so`` stubs) into one JSON file."""
  rendered = {}
  for path in sorted((src / "root/usr/share/man").rglob("*.gz")):
    if path.is_symlink() or not path.parent.name.startswith("man"):
      continue
    source = _read_text(path)
    if source.lstrip().startswith(".so "):
      continue  # A redirect to another page, which is rendered in its own right.
    rendered[f"{path.parent.name}/{path.name[:-3]}"] = strip_roff(source)
  (src / "text").mkdir(exist_ok=True)
  (src / "text/pages.json").write_text(json.dumps(rendered), encoding="utf-8")


def _read_man_pages(src: pathlib.Path) -> Documents:
  """One document per man page, e.g. ``man7/signal-safety.7``."""
  rendered = json.loads((src / "text/pages.json").read_text(encoding="utf-8"))
  return sorted(rendered.items())


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
    return _resolve(cache_dir) / self.name

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
    if folder.exists():
      shutil.rmtree(folder)  # A half-finished or outdated earlier fetch.
    folder.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
      if debs is None or not set(self.packages) <= set(debs):
        debs = download_packages(self.packages, pathlib.Path(work))
      for package in self.packages:
        _extract(debs[package], folder / "root")
      deb_sizes = {package: debs[package].stat().st_size for package in self.packages}
    if self.render is not None:
      self.render(folder)
    record = {"source": self.name, "format": _CACHE_FORMAT, "deb_bytes": deb_sizes,
              "disk_bytes": sum(p.stat().st_size for p in folder.rglob("*")
                                if p.is_file() and not p.is_symlink())}
    (folder / _MARKER).write_text(json.dumps(record, indent=1))
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
          f"{_resolve(cache_dir)}; fetch it with: "
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
            _read_austen, _render_austen),
    _source("bible_kjv", ["bible-kjv-text", "bible-kjv"],
            "King James Version of the Bible (1611), one document per chapter",
            "public domain text; Bible Retrieval System: unrestricted use",
            "Bible Retrieval System by Chip Chapin", _read_bible, _render_bible),
    _source("gcide", ["dict-gcide"],
            "GNU Collaborative International Dictionary of English, one entry per document",
            "GPL-2+", "GNU GCIDE 0.48 (from Webster's 1913 and WordNet)",
            lambda src: _read_dictd(src, "gcide")),
    _source("wordnet", ["wordnet-base"],
            "WordNet 3.0 synset glosses, 100 synsets per document",
            "WordNet 3.0 licence (Princeton University)", "Princeton WordNet 3.0",
            _read_wordnet),
    _source("foldoc", ["dict-foldoc"],
            "Free On-line Dictionary of Computing, one entry per document",
            "GFDL-1.1+", "foldoc.org, editor Denis Howe",
            lambda src: _read_dictd(src, "foldoc")),
    _source("jargon", ["jargon-text"],
            "The Jargon File 4.4.7, one entry per document",
            "public domain", "Eric S. Raymond's Jargon File", _read_jargon),
    _source("fortunes", ["fortunes"],
            "BSD fortune cookies (quotations, jokes), one cookie per document",
            "BSD (fortune-mod); see the package's copyright file",
            "fortune-mod 1.99.1", _read_fortunes),
    _source("python_docs", ["python3.11-doc"],
            "Python 3.11 documentation in reStructuredText, one page per document",
            "PSF-2.0", "docs.python.org sources shipped by Debian", _read_python_docs),
    _source("octave_manual", ["octave-doc"],
            "GNU Octave 7.3 manual (info), one node per document",
            "GPL-3+", "GNU Octave",
            lambda src: _read_info(src, ("octave.info*", "liboctave.info*"))),
    _source("r_manuals", ["r-doc-info"],
            "R 4.2 manuals (intro, language, extensions, admin, data, FAQ), one info node per document",
            "GPL-2", "R Core Team",
            lambda src: _read_info(src, ("R-*.info*",))),
    _source("maxima_manual", ["maxima-doc"],
            "Maxima 5.46 reference manual and share-package manuals (info), one node per document",
            "GPL-2", "Maxima project",
            lambda src: _read_info(src, ("maxima.info*", "maxima/*.info*"))),
    _source("man_pages", ["manpages"],
            "Linux man pages, sections 1, 4, 5, 7, 8, one page (roff stripped) per document",
            "Linux man-pages copyleft, GPL-2+, BSD (per page)",
            "Linux man-pages project 6.03", _read_man_pages, _render_man_pages),
    _source("man_pages_dev", ["manpages-dev"],
            "Linux system-call and C library man pages (sections 2, 3), one page (roff stripped) per document",
            "Linux man-pages copyleft, GPL-2+, BSD (per page)",
            "Linux man-pages project 6.03", _read_man_pages, _render_man_pages),
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
    return _resolve(cache_dir)
  _resolve(cache_dir).mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=_resolve(cache_dir)) as work:
    packages = list(dict.fromkeys(p for source in pending for p in source.packages))
    debs = download_packages(packages, pathlib.Path(work))
    for source in pending:
      source.fetch(cache_dir, debs=debs)
  return _resolve(cache_dir)


# The name `lowcomm_jax.data.corpora` reads `debian:<source>` corpora through.
load_documents = documents
