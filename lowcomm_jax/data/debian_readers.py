"""Readers that turn the extracted Debian packages into documents (used by
`lowcomm_jax.data.debian`).

Each reader takes the folder a package was extracted into and returns `(doc_id, text)` pairs in a
deterministic order; a `render_*` step, where a source has one, turns the package's own format
(R lazy-load data, the `bible` program's data, roff) into text once, at fetch time.
"""

from __future__ import annotations

import gzip
import json
import pathlib
import re
import subprocess
import warnings
import zlib

Documents = list[tuple[str, str]]


class FetchError(RuntimeError):
  """A Debian package could not be downloaded or extracted."""


def run_command(cmd: list[str], cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
  """Runs `cmd` (apt, dpkg-deb, a package's own program) and captures its text; never raises."""
  return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)

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


def render_austen(src: pathlib.Path) -> None:
  """Decodes the R data once (rdata takes about a second), keeping plain JSON."""
  (src / "text").mkdir(exist_ok=True)
  (src / "text/novels.json").write_text(json.dumps(_decode_austen(src)), encoding="utf-8")


def read_austen(src: pathlib.Path) -> Documents:
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


def render_bible(src: pathlib.Path) -> None:
  """Decompresses the BRS data file with the `bible` program, unwrapped."""
  program = src / "root/usr/bin/bible"
  result = run_command([str(program), "-p", str(src / "root/usr/lib"), "-l0",
                 "Gen1:1-Rev22:21"])
  if result.returncode != 0 or len(result.stdout) < 1_000_000:
    raise FetchError(f"the bible program failed to render the KJV text:\n{result.stderr}")
  (src / "text").mkdir(exist_ok=True)
  (src / "text/kjv.txt").write_text(result.stdout, encoding="utf-8")


def read_bible(src: pathlib.Path) -> Documents:
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


def read_dictd(src: pathlib.Path, name: str) -> Documents:
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


def read_wordnet(src: pathlib.Path) -> Documents:
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


def read_jargon(src: pathlib.Path) -> Documents:
  """One document per Jargon File entry (``:term: pronunciation, pos.``)."""
  text = _read_text(src / "root/usr/share/doc/jargon-text/jargon.txt.gz")
  parts = re.split(r"^   (:[^:\n]+:.*)$", text, flags=re.MULTILINE)
  # parts[0] is the front matter and table of contents: headwords only.
  return [(f"{i:05d} {parts[j].split(':')[1]}", parts[j].strip() + "\n" + parts[j + 1])
          for i, j in enumerate(range(1, len(parts) - 1, 2))]


def read_fortunes(src: pathlib.Path) -> Documents:
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


def read_python_docs(src: pathlib.Path) -> Documents:
  """One document per reStructuredText source page of the Python 3.11 docs."""
  folder = src / "root/usr/share/doc/python3.11/html/_sources"
  return [(str(p.relative_to(folder)), _read_text(p))
          for p in sorted(folder.rglob("*.txt"))]


def read_info(src: pathlib.Path, patterns: tuple[str, ...]) -> Documents:
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


def render_man_pages(src: pathlib.Path) -> None:
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


def read_man_pages(src: pathlib.Path) -> Documents:
  """One document per man page, e.g. ``man7/signal-safety.7``."""
  rendered = json.loads((src / "text/pages.json").read_text(encoding="utf-8"))
  return sorted(rendered.items())
