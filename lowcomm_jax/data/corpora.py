"""Real text that is on every machine after `pip install lowcomm-jax`: no download at run time.

Corpora (each a deterministic list of `(doc_id, text)`):

- `stdlib`: the Python standard library's own source (`*.py` under
  `sysconfig.get_paths()["stdlib"]`, without test folders and site-packages),
  code with English docstrings, about 12 MB. Licence: Python Software
  Foundation License (PSF-2.0), as shipped with CPython.
- `licenses`: 844 SPDX licence texts shipped by the PyPI package
  `licenseclassifier` (`licenseclassifier/_engine/licenses.json.gz`), about
  4.6 MB, with its `//** ... **//` markup stripped. Each text carries its own
  licence terms; the collection is distributed under the package's licence
  (Apache-2.0).
- `docstrings`: the docstrings of the installed numpy and scipy source (via
  `ast`), English technical prose. Licence: BSD-3-Clause (numpy, scipy).

Debian-packaged corpora (novels, dictionaries, manuals) are fetched by
`experiments/fetch_corpora.py` into a cache folder; see
`lowcomm_jax.data.debian`. The user's own files (`text:`, `jsonl:`, `parquet:`, `hf:`, `tokens:`)
are read by `lowcomm_jax.data.files`.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import sysconfig
import zlib

from lowcomm_jax.data import files

Document = tuple[str, str]

_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}


def _python_files(root: pathlib.Path) -> list[pathlib.Path]:
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
    files.extend(pathlib.Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
  return sorted(files)


def stdlib_documents() -> list[Document]:
  """The Python standard library's source files, sorted by relative path."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  return [(str(p.relative_to(root)), p.read_text(encoding="utf-8", errors="replace"))
          for p in _python_files(root)]


_LICENSE_MARKUP = re.compile(r"//\*\*.*?\*\*//", re.S)


def _licenses_file() -> pathlib.Path:
  spec = importlib.util.find_spec("licenseclassifier")
  if spec is None or spec.origin is None:
    raise RuntimeError("corpus 'licenses' needs the package licenseclassifier (a dependency of "
                       "lowcomm-jax); reinstall with `pip install -e .`")
  return pathlib.Path(spec.origin).parent / "_engine" / "licenses.json.gz"


def license_documents() -> list[Document]:
  """SPDX licence texts from the `licenseclassifier` package, markup stripped."""
  path = _licenses_file()
  entries = json.loads(gzip.decompress(path.read_bytes()))
  docs = []
  for entry in sorted(entries, key=lambda e: e["id"]):
    text = _LICENSE_MARKUP.sub("", entry.get("lre", "")).strip()
    if text:
      docs.append((entry["id"], text))
  return docs


def _package_roots(packages: tuple[str, ...]) -> list[tuple[str, pathlib.Path]]:
  roots = []
  for package in packages:
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
      roots.append((package, pathlib.Path(list(spec.submodule_search_locations)[0])))
  return roots


def docstring_documents(packages: tuple[str, ...] = ("numpy", "scipy")) -> list[Document]:
  """Docstrings of modules, classes and functions of installed packages, one document per module."""
  docs = []
  for package, root in _package_roots(packages):
    for path in _python_files(root):
      try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
      except (SyntaxError, ValueError):
        continue
      nodes = [tree] + [n for n in ast.walk(tree)
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
      strings = [s for s in (ast.get_docstring(n) for n in nodes) if s and len(s) > 40]
      if strings:
        docs.append((f"{package}/{path.relative_to(root)}", "\n\n".join(strings)))
  return docs


CORPORA = {
    "stdlib": stdlib_documents,
    "licenses": license_documents,
    "docstrings": docstring_documents,
}
# Corpus names beyond CORPORA: a fetched Debian source, a domain (`lowcomm_jax.data.domains`, read
# with its own splits by `pipeline.load_splits`), a mix of domains' training text, the user's files.
CORPUS_PREFIXES = ("debian:", "domain:", "domain_mix:") + files.PREFIXES


def is_corpus_name(name: str) -> bool:
  """Whether `name` has the form of a corpus: a key of CORPORA or one of CORPUS_PREFIXES + a name."""
  return name in CORPORA or str(name).startswith(CORPUS_PREFIXES)


def load_documents(name: str) -> tuple[Document, ...]:
  """Documents of a named corpus: one of CORPORA, `debian:<source>` once fetched, `domain_mix:<a>+<b>`,
  or the user's files (read each time: they may change)."""
  if files.is_file_corpus(name):
    return tuple(files.documents(name))
  return _named_documents(name)


@functools.lru_cache(maxsize=8)
def _named_documents(name: str) -> tuple[Document, ...]:
  if name in CORPORA:
    return tuple(CORPORA[name]())
  if name.startswith("debian:"):
    from lowcomm_jax.data import debian  # pylint: disable=g-import-not-at-top
    return tuple(debian.load_documents(name.split(":", 1)[1]))
  if name.startswith("domain_mix:"):
    from lowcomm_jax.data import domains  # pylint: disable=g-import-not-at-top  (domains imports us)
    return tuple(domains.mix_documents(domains.mix_domains(name)))
  raise ValueError(f"data.corpus must be one of {sorted(CORPORA)}, 'debian:<source>', "
                   f"'domain_mix:<domain>+...' or {files.FORMS}, got {name!r}")


def check_available(name: str) -> None:
  """Raises a ValueError naming `data.corpus`, the allowed values and the fetch command when the
  corpus is unknown or not fetched; reads nothing but names and marker files."""
  if name in CORPORA:
    return
  if files.is_file_corpus(name):
    files.check(name)
    return
  kind, _, rest = str(name).partition(":")
  if kind == "debian":
    from lowcomm_jax.data import debian  # pylint: disable=g-import-not-at-top
    if rest not in debian.SOURCES:
      raise ValueError(f"data.corpus={name!r}: unknown Debian source {rest!r}; allowed: "
                       f"{', '.join('debian:' + s for s in debian.SOURCES)}")
    if not debian.is_fetched(rest):
      raise ValueError(f"data.corpus={name!r} is not fetched into {debian.default_cache_dir()}; "
                       f"fetch it first with: {debian.FETCH_COMMAND.format(names=rest)}")
    return
  if kind in ("domain", "domain_mix"):
    from lowcomm_jax.data import domains  # pylint: disable=g-import-not-at-top  (domains imports us)
    names = rest.split("+") if kind == "domain_mix" else [rest]
    for domain in names:
      if domain not in domains.DOMAINS:
        raise ValueError(f"data.corpus={name!r}: unknown domain {domain!r}; allowed: "
                         f"{', '.join(kind + ':' + d for d in domains.DOMAINS)}")
      check_available(domains.DOMAINS[domain].corpus)
    return
  raise ValueError(f"data.corpus must be one of {sorted(CORPORA)}, 'debian:<source>', "
                   f"'domain:<domain>', 'domain_mix:<domain>+<domain>...' or one of the file forms "
                   f"{files.FORMS}, got {name!r}")


def _files_of(name: str) -> list[tuple[str, int]]:
  """(path, size) of every file corpus `name` is read from."""
  if name == "stdlib":
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return [(str(p.relative_to(root)), p.stat().st_size) for p in _python_files(root)]
  if name == "licenses":
    path = _licenses_file()
    return [(path.name, path.stat().st_size)]
  if name == "docstrings":
    return [(f"{package}/{p.relative_to(root)}", p.stat().st_size)
            for package, root in _package_roots(("numpy", "scipy")) for p in _python_files(root)]
  if name in CORPORA:  # registered by a user at run time: its documents' ids and sizes
    return [(doc_id, len(text)) for doc_id, text in load_documents(name)]
  if files.is_file_corpus(name):
    return files.identity_files(name)
  kind, _, rest = name.partition(":")
  if kind in ("domain", "domain_mix"):
    from lowcomm_jax.data import domains  # pylint: disable=g-import-not-at-top
    return [(f"{domain}/{path}", size) for domain in rest.split("+")
            for path, size in _files_of(domains.DOMAINS[domain].corpus)]
  from lowcomm_jax.data import debian  # pylint: disable=g-import-not-at-top
  folder = debian.SOURCES[rest].folder()
  return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*")
                if p.is_file() and not p.is_symlink())


def corpus_identity(name: str, tokenizer: str = "bytes") -> str:
  """A hash of the list of files corpus `name` is read from and their sizes (of its documents, for a
  corpus a user registered in CORPORA), and of the tokenizer's files (none for bytes).

  It changes when the text may have changed (another Python's stdlib, another numpy, another Debian
  release of a package), so a run records it and a resume on other text is refused. Stat calls
  only: about 0.1 s for `stdlib`.
  """
  check_available(name)
  from lowcomm_jax.data import debian, tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  if files.is_file_corpus(name):  # the user's files may change between two starts: never cached
    text = json.dumps(_files_of(name))
  else:
    text = _identity(name, str(debian.default_cache_dir()))
  tokens = tokenizer_lib.identity(tokenizer)
  if not tokens and not files.is_file_corpus(name):
    return text  # as before tokenizers existed, so that those runs resume
  return hashlib.sha256((text + "|" + tokens).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=16)
def _identity(name: str, cache_dir: str) -> str:
  del cache_dir  # part of the cache key only: the Debian corpora are read from there
  return hashlib.sha256(json.dumps(_files_of(name)).encode()).hexdigest()[:16]


def is_eval_document(doc_id: str, eval_permille: int) -> bool:
  """Held-out split by a hash of the document id: stable across machines and runs."""
  return zlib.crc32(doc_id.encode("utf-8")) % 1000 < eval_permille
