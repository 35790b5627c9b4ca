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
`lowcomm_jax.data.debian`.
"""

from __future__ import annotations

import ast
import functools
import gzip
import importlib.util
import json
import os
import pathlib
import re
import sysconfig
import zlib

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


def license_documents() -> list[Document]:
  """SPDX licence texts from the `licenseclassifier` package, markup stripped."""
  spec = importlib.util.find_spec("licenseclassifier")
  if spec is None or spec.origin is None:
    raise RuntimeError("corpus 'licenses' needs the package licenseclassifier (a dependency of "
                       "lowcomm-jax); reinstall with `pip install -e .`")
  path = pathlib.Path(spec.origin).parent / "_engine" / "licenses.json.gz"
  entries = json.loads(gzip.decompress(path.read_bytes()))
  docs = []
  for entry in sorted(entries, key=lambda e: e["id"]):
    text = _LICENSE_MARKUP.sub("", entry.get("lre", "")).strip()
    if text:
      docs.append((entry["id"], text))
  return docs


def docstring_documents(packages: tuple[str, ...] = ("numpy", "scipy")) -> list[Document]:
  """Docstrings of modules, classes and functions of installed packages, one document per module."""
  docs = []
  for package in packages:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
      continue
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
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
# with its own splits by `pipeline.load_splits`) and a mix of domains' training text.
CORPUS_PREFIXES = ("debian:", "domain:", "domain_mix:")


def is_corpus_name(name: str) -> bool:
  """Whether `name` has the form of a corpus: a key of CORPORA or one of CORPUS_PREFIXES + a name."""
  return name in CORPORA or str(name).startswith(CORPUS_PREFIXES)


@functools.lru_cache(maxsize=8)
def load_documents(name: str) -> tuple[Document, ...]:
  """Documents of a named corpus: one of CORPORA, `debian:<source>` once fetched, or `domain_mix:<a>+<b>`."""
  if name in CORPORA:
    return tuple(CORPORA[name]())
  if name.startswith("debian:"):
    from lowcomm_jax.data import debian  # pylint: disable=g-import-not-at-top
    return tuple(debian.load_documents(name.split(":", 1)[1]))
  if name.startswith("domain_mix:"):
    from lowcomm_jax.data import domains  # pylint: disable=g-import-not-at-top  (domains imports us)
    return tuple(domains.mix_documents(domains.mix_domains(name)))
  raise ValueError(f"data.corpus must be one of {sorted(CORPORA)}, 'debian:<source>' or "
                   f"'domain_mix:<domain>+...', got {name!r}")


def is_eval_document(doc_id: str, eval_permille: int) -> bool:
  """Held-out split by a hash of the document id: stable across machines and runs."""
  return zlib.crc32(doc_id.encode("utf-8")) % 1000 < eval_permille
