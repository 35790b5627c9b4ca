"""Compiling a C++ kernel into a per-user cache and loading it safely.

A kernel source is compiled on first use with the host's C++ compiler (`$CXX`, else
`c++`/`g++`/`clang++`) against the FFI headers of the installed jaxlib, with `-O3 -march=native`
and without `-ffast-math`, which lets the compiler assume that no NaN or inf exists: a NaN must
reach the step's checks, not vanish in a max or a comparison. What the kernels gained from it is
asked for explicitly instead: `-fno-math-errno` and glibc's vector `expf` (libmvec) so that exp
loops vectorize, and `-fopenmp-simd` for the `omp simd reduction` loops (reordered sums, the
rounding of which the tests bound). The library lands in a cache folder
(`$LOWCOMM_JAX_CACHE`, else `~/.cache/lowcomm_jax`) under a name keyed by the source, the flags,
the jaxlib version and the host CPU's model and feature flags (`-march=native` code is valid only
where every feature it was built for exists), so later processes load it in milliseconds.

Loading a shared library runs its code, so the cache is trusted only as far as its owner:
the folder and the library must belong to the current user and be writable by nobody else, and
the library's SHA-256, recorded beside it when it was built, must match before it is loaded.
Anything else is refused with one line naming the path (`KernelCacheError`).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import shutil
import stat
import subprocess
import tempfile

import jax

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-std=c++17", "-shared",
         "-fPIC", "-w")
LIBRARIES = ("-lmvec",)  # glibc's vector math (the kernels' vector expf)


class KernelCacheError(RuntimeError):
  """A cached kernel library or its folder that cannot be trusted."""


def cache_dir() -> pathlib.Path:
  root = os.environ.get("LOWCOMM_JAX_CACHE") or pathlib.Path.home() / ".cache" / "lowcomm_jax"
  return pathlib.Path(root)


def cpu_identity() -> str:
  """The host CPU's model and feature flags (from /proc/cpuinfo; the platform's name elsewhere)."""
  try:
    lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
  except OSError:
    lines = []
  wanted = ("model name", "flags")
  found = {}
  for line in lines:
    key = line.split(":", 1)[0].strip()
    if key in wanted and key not in found:
      found[key] = " ".join(line.split(":", 1)[-1].split())
  if found:
    return "\n".join(f"{k}: {found[k]}" for k in wanted if k in found)
  return f"{platform.processor()} {platform.machine()}"


def compiler(option: str) -> str:
  for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
    if name and shutil.which(name):
      return name
  raise RuntimeError(f"{option} needs a C++ compiler to build its kernel: none of $CXX, c++, g++, "
                     "clang++ is on PATH (install one, e.g. `apt install g++`)")


def _check_private(path: pathlib.Path, st: os.stat_result, what: str) -> None:
  """Refuses `path` unless the current user owns it and neither group nor others may write it."""
  if st.st_uid != os.geteuid():
    raise KernelCacheError(f"kernel cache: {what} {path} belongs to uid {st.st_uid}, not to this "
                           f"user (uid {os.geteuid()}); set LOWCOMM_JAX_CACHE to a folder of your "
                           f"own")
  if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    raise KernelCacheError(f"kernel cache: {what} {path} is writable by group or others (mode "
                           f"{stat.S_IMODE(st.st_mode):o}); make it private (chmod go-w) or set "
                           "LOWCOMM_JAX_CACHE to a folder of your own")


def _private_folder() -> pathlib.Path:
  folder = cache_dir()
  folder.mkdir(mode=0o700, parents=True, exist_ok=True)
  _check_private(folder, folder.stat(), "folder")
  return folder


def _digest_file(path: pathlib.Path) -> pathlib.Path:
  return path.with_name(path.name + ".sha256")


def _verified(library: pathlib.Path) -> None:
  """Checks owner, mode and the recorded SHA-256 of a cached library, read through one
  descriptor."""
  with open(library, "rb") as f:
    _check_private(library, os.fstat(f.fileno()), "library")
    digest = hashlib.sha256(f.read()).hexdigest()
  record = _digest_file(library)
  try:
    _check_private(record, record.stat(), "hash record")
    expected = record.read_text().strip()
  except FileNotFoundError:
    raise KernelCacheError(f"kernel cache: {library} has no hash record {record.name}; delete the "
                           "library to rebuild it") from None
  if digest != expected:
    raise KernelCacheError(f"kernel cache: {library} has SHA-256 {digest[:16]}…, its record says "
                           f"{expected[:16]}…; refusing to load it (delete it to rebuild)")


def library_path(source: pathlib.Path) -> pathlib.Path:
  """Where `source`'s library is cached: keyed by the source, the flags, jaxlib and the host CPU."""
  key = hashlib.sha256(
    b"\0".join(
      [
        source.read_bytes(),
        jax.lib.__version__.encode(),
        cpu_identity().encode(),
        " ".join(FLAGS + LIBRARIES).encode(),
      ]
    )
  ).hexdigest()[:16]
  return cache_dir() / f"{source.stem}-{key}.so"


def build(source: pathlib.Path, option: str) -> pathlib.Path:
  """The shared library of `source` in the cache, compiled there unless already present.

  `option` names the config option that asked for the kernel, for error messages.
  """
  folder = _private_folder()
  library = library_path(source)
  if library.exists():
    _verified(library)
    return library
  command_compiler = compiler(option)
  # Compiled under a temporary name and renamed, the hash record first: concurrent processes
  # (pytest-xdist, the replicas of a multi-process run) each build their own copy of the same bytes
  # (the same compiler, source and flags), and each rename is atomic.
  with tempfile.TemporaryDirectory(dir=folder) as tmp:
    built = pathlib.Path(tmp) / library.name
    command = [command_compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), *LIBRARIES,
               "-o",
               str(built)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
      raise RuntimeError(f"{option}: building the kernel failed ({' '.join(command)}):\n"
                         f"{result.stderr[-4000:]}")
    os.chmod(built, 0o700)
    record = pathlib.Path(tmp) / "record"
    record.write_text(hashlib.sha256(built.read_bytes()).hexdigest() + "\n")
    os.chmod(record, 0o600)
    os.replace(record, _digest_file(library))
    os.replace(built, library)
  _verified(library)
  return library

