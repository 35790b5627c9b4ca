r"""Fetches the Debian-packaged corpora into the cache folder.

Downloads each source's packages with ``apt-get download`` and extracts them
with ``dpkg-deb -x`` (no root needed for that; ``apt-get update`` runs first
only when apt has no package lists, and that needs root). Sources already in
the cache are skipped. About 62 MB of packages in all, downloaded by one
apt-get call: about 10 s here on a fresh machine.

  python experiments/fetch_corpora.py --sources=all
  python experiments/fetch_corpora.py --sources=austen,bible_kjv --cache_dir=/tmp/corpora
  python experiments/fetch_corpora.py --sources=all --domains_table   # + HDEE domains

With ``--domains_table`` it then prints the domains (`lowcomm_jax.data.domains`)
with their HDEE chains (`lowcomm_jax.hdee.domains`): split sizes, measured
difficulty (byte-bigram held-out bits/byte, zlib bits/byte) and the chain each
training domain joins; about 10 s more.

The cache folder defaults to ``$LOWCOMM_CACHE`` or ``~/.cache/lowcomm_jax/corpora``.
"""

import json
import time

from absl import app, flags

from lowcomm_jax import cli
from lowcomm_jax.data import debian
from lowcomm_jax.hdee import domains

_SOURCES = flags.DEFINE_string(
    "sources", "all",
    f"'all' or a comma-separated list of: {', '.join(debian.SOURCES)}.")
_CACHE_DIR = flags.DEFINE_string(
    "cache_dir", None, "Cache folder; default $LOWCOMM_CACHE or "
    "~/.cache/lowcomm_jax/corpora.")
_DOMAINS_TABLE = flags.DEFINE_bool(
    "domains_table", False, "After fetching, print the HDEE domains table (needs all sources).")
_TABLE_JSON = flags.DEFINE_string(
    "table_json", None, "With --domains_table, also write the rows as JSON to this path.")


def _selected_sources(spec: str) -> list[str]:
  if spec.strip() == "all":
    return list(debian.SOURCES)
  names = [name.strip() for name in spec.split(",") if name.strip()]
  unknown = [name for name in names if name not in debian.SOURCES]
  if unknown or not names:
    raise app.UsageError(
        f"--sources={spec!r}: unknown {unknown}; allowed: 'all' or a comma "
        f"list of {', '.join(debian.SOURCES)}")
  return names


def main(argv):
  del argv
  names = _selected_sources(_SOURCES.value)
  cache_dir = _CACHE_DIR.value or debian.default_cache_dir()
  print(f"cache folder: {cache_dir}")
  already_there = {name for name in names if debian.is_fetched(name, cache_dir)}
  start = time.perf_counter()
  debian.ensure_fetched(names, cache_dir)
  print(f"fetched {len(names) - len(already_there)} sources in "
        f"{time.perf_counter() - start:.1f} s; {len(already_there)} were cached")
  total_deb = total_text = 0
  for name in names:
    source = debian.SOURCES[name]
    record = source.fetch(cache_dir)  # Reads the marker: already fetched above.
    docs = source.documents(cache_dir)
    text_bytes = sum(len(text.encode("utf-8")) for _, text in docs)
    deb_bytes = sum(record["deb_bytes"].values())
    total_deb += deb_bytes
    total_text += text_bytes
    status = "cached " if name in already_there else "fetched"
    print(f"{status} {name:14s} {deb_bytes / 2**20:6.1f} MiB .deb  "
          f"{len(docs):7d} documents  {text_bytes / 2**20:6.1f} MiB text  "
          f"licence: {source.licence}")
  print(f"total: {total_deb / 2**20:.1f} MiB of packages, "
        f"{total_text / 2**20:.1f} MiB of text in {len(names)} sources")
  if _DOMAINS_TABLE.value:
    rows = domains.domains_table(cache_dir)
    print()
    print(domains.format_domains_table(rows))
    if _TABLE_JSON.value:
      with open(_TABLE_JSON.value, "w", encoding="utf-8") as file:
        json.dump(rows, file, indent=1)


if __name__ == "__main__":
  cli.run(main)
