"""experiments/prepare_data.py and train_tokenizer.py never overwrite what a run may be reading: an
existing --out is refused in one line with nothing changed; --overwrite writes a new file and
renames it into place, so a reader of the old one keeps it (its inode)."""

import subprocess
import sys

from lowcomm_jax.data import corpora
from lowcomm_jax.testing import ROOT, tree_state


def _run(script, *flags) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(ROOT / "experiments" / script), *flags],
                        capture_output=True, text=True, timeout=300)


def test_an_existing_out_is_refused_in_one_line_and_overwrite_renames_into_place(tmp_path):
  (tmp_path / "texts").mkdir()
  for i, (_, text) in enumerate(corpora.load_documents("licenses")[:20]):
    (tmp_path / "texts" / f"{i}.txt").write_text(text)
  corpus = f"--corpus=text:{tmp_path / 'texts'}"
  tokenizer, ids = tmp_path / "tok", tmp_path / "ids.bin"
  writers = [("train_tokenizer.py", [corpus, "--vocab_size=300", f"--out={tokenizer}"],
              tokenizer / "tokenizer.json"),
             ("prepare_data.py",
              [corpus, f"--tokenizer={tokenizer}", f"--out={ids}", "--workers=1"], ids)]
  for script, flags, out in writers:
    assert _run(script, *flags).returncode == 0
    before, inode = tree_state(tmp_path), out.stat().st_ino
    refused = _run(script, *flags)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == (
        f"ValueError: --out={out} exists, and a run may be reading it; give a new path, or "
        "--overwrite to replace it (written beside it, then renamed into place: a reader keeps "
        "the old file)\n")
    assert tree_state(tmp_path) == before
    assert _run(script, *flags, "--overwrite").returncode == 0
    assert out.stat().st_ino != inode  # a new file: a reader of the old one keeps reading it
    assert not list(out.parent.glob(".*.tmp"))
