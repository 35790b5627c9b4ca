"""A run owns its inputs: it copies its tokenizer and records its data's identity, the tools that
read it use the copy from any current directory and change nothing, and every input changed under
it (a tokenizer retrained in place, a tokens file rewritten or made by another tokenizer, binary
text, a workdir of the other binary, a locked one) is refused in one line naming both, with nothing
changed. One table of faults, tried by one process.

The test prints the figure: faults tried / refused cleanly / run directories changed
(`python -m pytest tests/test_run_inputs.py -q -s -k table`).
"""

import contextlib
import gzip
import hashlib
import io
import json
import os
import pathlib
import shutil

import numpy as np
import pytest

from lowcomm_jax import elastic
from lowcomm_jax.data import corpora, files, prepare, tokenizer as tokenizer_lib
from lowcomm_jax.testing import make_config, tiny_config, tree_state
from lowcomm_jax.train import Trainer, checkpoint, evaluation, workdir as workdir_lib

SAMPLE = "Permission is hereby granted, free of charge, to any person obtaining a copy"


@contextlib.contextmanager
def _replaced(path: pathlib.Path, data: bytes):
  """`path` holds `data` for the block (written in place, as an editor or a retrain would), then
  its old bytes again."""
  old = path.read_bytes()
  path.write_bytes(data)
  try:
    yield
  finally:
    path.write_bytes(old)


def _config(corpus: str, tokenizer: str, **changes):
  return tiny_config(**{"num_steps": 2, "checkpoint.every": 2, "eval.every": 2, "data.seq_len": 32,
                        "eval.num_batches": 1, "data.corpus": corpus, "data.tokenizer": tokenizer,
                        **changes})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """In one folder: licence texts, tokenizers A (400 tokens), B (400 tokens, other merges) and C
  (700 tokens), A's tokens file, and two finished 2-step runs tokenized by A (given as a path
  relative to the folder): one on the text files, one on the tokens file."""
  root = tmp_path_factory.mktemp("inputs")
  docs = corpora.load_documents("licenses")
  (root / "texts").mkdir()
  for i, (_, text) in enumerate(docs[:60]):
    (root / "texts" / f"{i:02d}.txt").write_text(text)
  texts = [t for _, t in docs[:60]]
  tokenizer_lib.train_bpe(texts, 400, root / "tok")
  other = {"B": tokenizer_lib.train_bpe(texts[30:], 400, root / "tokB").read_bytes(),
           "C": tokenizer_lib.train_bpe(texts, 700, root / "tokC").read_bytes()}
  with contextlib.chdir(root):
    prepare.prepare("text:texts/*.txt", "tok/tokenizer.json", "ids/docs.bin", workers=1,
                    progress=False)
    text_config = _config("text:texts/*.txt", "tok/tokenizer.json")
    tokens_config = _config("tokens:ids/docs.bin", "tok/tokenizer.json")
    Trainer(text_config, root / "run_text").run()
    Trainer(tokens_config, root / "run_tokens").run()
  return {"root": root, "other": other, "text": text_config, "tokens": tokens_config}


def test_a_run_copies_its_tokenizer_and_readers_use_the_copy_from_anywhere(runs, tmp_path, capfd):
  root, run = runs["root"], runs["root"] / "run_text"
  original = (root / "tok" / "tokenizer.json").read_bytes()
  assert (run / "tokenizer" / "tokenizer.json").read_bytes() == original
  inputs = json.loads((run / "config.json").read_text())["inputs"]
  assert inputs["tokenizer"]["sha256"] == {
      "tokenizer.json": files.sha256_file(root / "tok" / "tokenizer.json")}
  tokens = json.loads((root / "run_tokens" / "config.json").read_text())["inputs"]["tokens"]
  assert tokens == {"path": str(root / "ids" / "docs.bin"),
                    "size": (root / "ids" / "docs.bin").stat().st_size,
                    "sha256": files.sha256_file(root / "ids" / "docs.bin")}
  expected = tokenizer_lib.load_tokenizer(str(root / "tok")).encode(SAMPLE)
  retrained = tokenizer_lib.load_tokenizer(str(root / "tokB")).encode(SAMPLE)
  assert not np.array_equal(expected, retrained)  # the same size of vocabulary, other ids
  before = tree_state(run)
  # Retrained in place since, and read from another directory (the run gave a relative path).
  with _replaced(root / "tok" / "tokenizer.json", runs["other"]["B"]), contextlib.chdir(tmp_path):
    _, params, tok = checkpoint.read_model(run)
  np.testing.assert_array_equal(tok.encode(SAMPLE), expected)
  note = [l for l in capfd.readouterr().err.splitlines() if l.startswith("note: ")]
  assert len(note) == 1 and "data.tokenizer='tok/tokenizer.json'" in note[0]
  assert f"the run's copy {run / 'tokenizer' / 'tokenizer.json'} is used" in note[0]
  assert params["embed"].shape[0] == 512
  assert tree_state(run) == before


def test_an_evaluation_says_in_one_line_when_the_runs_data_changed(runs, capfd):
  root = runs["root"]
  saved = json.loads((root / "run_text" / "config.json").read_text())["corpus_identity"]
  text = root / "texts" / "00.txt"
  with contextlib.chdir(root), _replaced(text, text.read_bytes() + b"One more line.\n"):
    capfd.readouterr()
    result = evaluation.evaluate(root / "run_text")
    now = corpora.corpus_identity("text:texts/*.txt", "tok/tokenizer.json")
  note = [l for l in capfd.readouterr().err.splitlines() if l.startswith("note: ")]
  assert note == [f"note: data.corpus='text:texts/*.txt' is not the text the run in "
                  f"{root / 'run_text'} trained on (corpus identity {saved} then, {now} now: its "
                  "files or their sizes changed); scored on it as it is now"]
  assert saved != now and np.isfinite(result["eval_loss"])


def test_gzip_text_is_read_decompressed(tmp_path):
  text = "Some text, compressed.\nA second line: naïve café.\n"
  (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text.encode()))
  assert files.documents(f"text:{tmp_path}/*") == [(str(tmp_path / "a.txt.gz"), text)]


def test_overwrite_renames_into_place_and_a_reader_keeps_the_old_file(runs, tmp_path):
  root = runs["root"]
  out = tmp_path / "docs.bin"
  with contextlib.chdir(root):
    prepare.prepare("text:texts/0*.txt", "tok/tokenizer.json", out, workers=1, progress=False)
    mapped = np.memmap(out, dtype=np.uint16, mode="r")  # as a run reads it
    old = np.array(mapped)
    inode = out.stat().st_ino
    meta = prepare.prepare("text:texts/1*.txt", "tok/tokenizer.json", out, workers=1,
                           progress=False, overwrite=True)
  np.testing.assert_array_equal(mapped, old)  # the reader's file is the old one, whole
  assert out.stat().st_ino != inode and meta["sha256"] == files.sha256_file(out)
  assert meta["num_tokens"] * 2 == out.stat().st_size != old.nbytes
  assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.bin", "docs.json"]  # no temporary


def _wordpiece(path: pathlib.Path) -> str:
  import tokenizers  # pylint: disable=g-import-not-at-top  # as a user builds a BERT-style one
  letters = "abcdefghijklmnopqrstuvwxyz"
  pieces = ["[UNK]", "[SEP]", *letters, *",.!'", *(f"##{c}" for c in letters)]
  tok = tokenizers.Tokenizer(tokenizers.models.WordPiece(
      {t: i for i, t in enumerate(pieces)}, unk_token="[UNK]"))
  tok.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)
  tok.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
  tok.decoder = tokenizers.decoders.WordPiece()
  path.mkdir()
  tok.save(str(path / "tokenizer.json"))
  return str(path / "tokenizer.json")


def _attempt(action) -> tuple[str | None, str]:
  """(the ValueError's message or None, what was printed, and any other error) of one try."""
  printed = io.StringIO()
  try:
    with contextlib.redirect_stdout(printed):
      action()
  except ValueError as error:
    return str(error), printed.getvalue()
  except Exception as error:  # pylint: disable=broad-except  # a crash is a row that failed
    return None, f"{printed.getvalue()}{type(error).__name__}: {error}"
  return None, printed.getvalue()


def _copy_run(runs, name: str, into: pathlib.Path) -> pathlib.Path:
  return pathlib.Path(shutil.copytree(runs["root"] / name, into / name, symlinks=True))


def test_the_table_of_changed_inputs_is_refused_in_one_line_with_nothing_changed(runs, tmp_path):
  root, other = runs["root"], runs["other"]
  tok_a = root / "tok" / "tokenizer.json"
  sha = lambda data: hashlib.sha256(data).hexdigest()[:12]
  rows = []

  def case(name, watched, action, expected, setup=contextlib.nullcontext):
    with setup():
      before = tree_state(watched)
      message, printed = _attempt(action)
      changed = tree_state(watched) != before
    rows.append((name, message, expected, changed, printed))

  with contextlib.chdir(root):
    # item 2: the tokenizer retrained in place with the same vocabulary size
    case("resume: tokenizer retrained in place", root / "run_text",
         lambda: Trainer(runs["text"], root / "run_text").run(),
         ["is not the tokenizer the run in", f"tokenizer.json sha256 {sha(tok_a.read_bytes())}",
          f"sha256 {sha(other['B'])}", "400 tokens"],
         lambda: _replaced(tok_a, other["B"]))
    # item 2: the tokens file rewritten by prepare_data.py --overwrite from other text
    bin_path, meta_path = root / "ids" / "docs.bin", root / "ids" / "docs.json"

    @contextlib.contextmanager
    def rewritten_tokens():
      saved = bin_path.read_bytes(), meta_path.read_bytes()
      prepare.prepare("text:texts/1*.txt", "tok/tokenizer.json", bin_path, workers=1,
                      progress=False, overwrite=True)
      try:
        yield
      finally:
        bin_path.write_bytes(saved[0])
        meta_path.write_bytes(saved[1])

    case("resume: tokens file rewritten", root / "run_tokens",
         lambda: Trainer(runs["tokens"], root / "run_tokens").run(),
         ["data.corpus='tokens:", "is not the file the run in", "rewritten since"],
         rewritten_tokens)
    # item 3: ids of tokenizer A trained with tokenizer C (a larger vocabulary)
    case("tokens file of another tokenizer", tmp_path,
         lambda: Trainer(_config("tokens:ids/docs.bin", str(root / "tokC")), tmp_path / "new"),
         ["was tokenized by 'tok/tokenizer.json'", f"(sha256 {sha(tok_a.read_bytes())})",
          f"data.tokenizer='{root / 'tokC' / 'tokenizer.json'}' is another tokenizer",
          f"sha256 {sha(other['C'])}"])
    # item 7: each binary's workdir given to the other
    elastic_config = make_config("elastic.py", {"data.corpus": "text:texts/*.txt",
                                                "data.tokenizer": "tok/tokenizer.json"})
    case("elastic.py given a train.py workdir", root / "run_text",
         lambda: elastic.start(elastic_config, root / "run_text"),
         ["holds a run of experiments/train.py", "experiments/elastic.py cannot resume"])
    elastic_run = _copy_run(runs, "run_text", tmp_path / "elastic")
    saved = json.loads((elastic_run / "config.json").read_text())
    (elastic_run / "config.json").write_text(json.dumps({**saved, "kind": "elastic"}))
    shutil.move(elastic_run / "checkpoints", elastic_run / "syncer")
    case("train.py given an elastic.py workdir", elastic_run,
         lambda: Trainer(runs["text"], elastic_run).run(),
         ["holds a run of experiments/elastic.py", "experiments/train.py cannot resume"])
    # item 8: a second start of a locked workdir, refused before its start-up line
    locked = _copy_run(runs, "run_text", tmp_path / "locked")
    (locked / "summary.json").unlink()
    lock = workdir_lib.RunLock(locked)
    case("a second start of a locked workdir", locked,
         lambda: Trainer(runs["text"], locked).run(),
         ["is in use by another run", f"pid {os.getpid()}"])
    lock.release()
    # item 8: a symbolic link to a folder of other files: refused, the folder's mtime kept
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine\n")
    (tmp_path / "link").symlink_to(tmp_path / "notes")
    case("a symlink to a folder of other files", tmp_path / "link",
         lambda: Trainer(runs["text"], tmp_path / "link").run(),
         ["holds files that are not a run (notes.txt)"])
    # item 5: binary files in a text glob; a WordPiece tokenizer
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("text " * 200)
    (tmp_path / "mixed" / "b.txt").write_bytes(gzip.compress(b"x" * 5000) + b"\x00" * 8)
    (tmp_path / "mixed" / "c.txt").write_bytes(b"\x00\x01" * 100)
    (tmp_path / "mixed" / "d.txt").write_bytes(bytes(range(128, 256)) * 20)
    case("NUL bytes in a text glob", tmp_path,
         lambda: Trainer(_config(f"text:{tmp_path}/mixed/*.txt", "bytes"), tmp_path / "new").run(),
         [f"{tmp_path / 'mixed' / 'b.txt'} holds NUL bytes",
          "3 of the 4 files matched are no text"])
    case("undecodable bytes in a text glob", tmp_path,
         lambda: Trainer(_config(f"text:{tmp_path}/mixed/[ad].txt", "bytes"),
                         tmp_path / "new").run(),
         [f"{tmp_path / 'mixed' / 'd.txt'} is not UTF-8 text (", "undecodable bytes",
          "1 of the 2 files matched"])
    wordpiece = _wordpiece(tmp_path / "wordpiece")
    case("a WordPiece tokenizer", tmp_path,
         lambda: Trainer(_config("text:texts/*.txt", wordpiece), tmp_path / "new"),
         ["(a WordPiece tokenizer) does not give back the text it encodes",
          "decodes as 'hello, world! it'"])
    # item 4: the writers refuse an existing output
    case("prepare_data onto an existing --out", root / "ids",
         lambda: prepare.prepare("text:texts/*.txt", "tok/tokenizer.json", "ids/docs.bin"),
         ["--out=ids/docs.bin exists, and a run may be reading it", "--overwrite"])
    case("train_tokenizer onto an existing tokenizer", root / "tok",
         lambda: tokenizer_lib.train_bpe(["some text"], 300, root / "tok"),
         [f"--out={tok_a} exists", "--overwrite"])
    # item 1: readers refuse in one line, naming the cause, with every file kept
    edited = _copy_run(runs, "run_text", tmp_path / "edited")
    with open(edited / "tokenizer" / "tokenizer.json", "a") as f:
      f.write(" ")
    case("a reader: the run's tokenizer copy edited", edited,
         lambda: checkpoint.read_model(edited),
         [f"the run's copy of its tokenizer {edited / 'tokenizer' / 'tokenizer.json'} differs "
          "from its SHA-256 at the run's start"])
    old = _copy_run(runs, "run_text", tmp_path / "old")
    saved = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({k: v for k, v in saved.items()
                                                 if k not in ("inputs", "kind")}))
    shutil.rmtree(old / "tokenizer")
    case("a reader: a run without a copy, its tokenizer retrained larger", old,
         lambda: checkpoint.read_model(old),
         ["no checkpoint restores (1 sealed, newest step 2)", "an embedding of 512 rows",
          "data.tokenizer='tok/tokenizer.json' now has 700 tokens (768 rows)",
          "nothing was changed"],
         lambda: _replaced(tok_a, other["C"]))
    unsealed = _copy_run(runs, "run_text", tmp_path / "unsealed")
    (unsealed / "checkpoints" / "2").rename(unsealed / "checkpoints" / "2.orbax-checkpoint-tmp-1")
    case("a reader: only a save's temporary folder", unsealed,
         lambda: checkpoint.read_eval_params(unsealed, option="init_from"),
         ["init_from=", "has no sealed checkpoint in"])

  failures = []
  for name, message, expected, changed, printed in rows:
    clean = (message is not None and "\n" not in message and all(e in message for e in expected)
             and not changed and not printed)
    if not clean:
      failures.append(f"{name}: message {message!r}, expected {expected}, files changed: "
                      f"{changed}, printed {printed!r}")
  print(f"\nfaults tried: {len(rows)}, refused cleanly: {len(rows) - len(failures)}, "
        f"run directories changed: {sum(changed for *_, changed, _ in rows)}")
  assert not failures, "\n".join(failures)
