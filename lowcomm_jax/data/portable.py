"""The corpora every machine has after `pip install lowcomm-jax`: no download at run time.

Each is a deterministic list of `(doc_id, text)`:

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

`lowcomm_jax.data.corpora` reads every `data.corpus` name, these among them; the HDEE domains
(`lowcomm_jax.data.domains`) draw on these too.
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


@functools.lru_cache(maxsize=8)
def documents(name: str) -> tuple[Document, ...]:
  """The documents of CORPORA[name], read once per process."""
  return tuple(CORPORA[name]())


def files_of(name: str) -> list[tuple[str, int]]:
  """(path, size) of every file CORPORA[name] is read from (of its documents, for a corpus a user
  registered in CORPORA)."""
  if name == "stdlib":
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return [(str(p.relative_to(root)), p.stat().st_size) for p in _python_files(root)]
  if name == "licenses":
    path = _licenses_file()
    return [(path.name, path.stat().st_size)]
  if name == "docstrings":
    return [(f"{package}/{p.relative_to(root)}", p.stat().st_size)
            for package, root in _package_roots(("numpy", "scipy")) for p in _python_files(root)]
  return [(doc_id, len(text)) for doc_id, text in documents(name)]
