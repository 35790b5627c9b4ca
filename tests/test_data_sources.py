"""The user's own data and tokenizers: every file source reads back the documents written, every
tokenizer round-trips text, pre-tokenized ids equal the tokenizer's stream, bits per byte count the
eval text's bytes, and a run trains and evaluates on them."""

import json
import math
import pathlib
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lowcomm_jax import testing
from lowcomm_jax.data import corpora, files, pipeline, tokenizer as tokenizer_lib
from lowcomm_jax.testing import ROOT, tiny_config
from lowcomm_jax.train import Trainer, evaluation

TEXT = "déjà vu — def f(x):\n    return x ** 2  # a comment\n"


@pytest.fixture(scope="module")
def licenses():
  """Real English text: 120 SPDX licence texts shipped with a dependency."""
  return [(d, t) for d, t in corpora.load_documents("licenses")[:120]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, licenses):
  """A byte-level BPE (tokenizer.json) and a SentencePiece model, both of 600 tokens, trained
  here."""
  root = tmp_path_factory.mktemp("tokenizers")
  texts = [t for _, t in licenses]
  return {"bpe": str(tokenizer_lib.train_bpe(texts, 600, root / "bpe")),
          "sentencepiece": str(tokenizer_lib.train_sentencepiece(texts, 600, root / "sp"))}


@pytest.mark.parametrize("kind", ["bytes", "bpe", "sentencepiece"])
def test_every_tokenizer_round_trips_text_and_separates_documents(kind, trained, licenses):
  tok = tokenizer_lib.load_tokenizer(kind if kind == "bytes" else trained[kind])
  assert tok.decode(tok.encode(TEXT)) == TEXT
  stream = tok.encode_documents(["ab", TEXT])
  assert stream.dtype == tok.stream_dtype
  assert (stream == tok.eos_id).sum() == 2 and stream[-1] == tok.eos_id
  first = np.flatnonzero(stream == tok.eos_id)[0]
  assert tok.decode(stream[first + 1:-1]) == TEXT
  if kind == "bytes":
    assert tok.vocab_size == 256 and tok.files() == [] and tok.count_bytes(stream) == len(stream)
  else:
    mit = dict(licenses)["AFL-1.1"]  # text of the kind it was trained on: merges shorten it
    assert tok.vocab_size == 600 and len(tok.encode(mit)) < len(mit.encode()) / 2
    assert [str(p) for p in tok.files()] == [trained[kind]]
    # Separators count one byte each; the rest is the UTF-8 of the text.
    assert tok.count_bytes(stream) == 2 + len(b"ab") + len(TEXT.encode())
  # A folder holding tokenizer.json is the same tokenizer.
  if kind == "bpe":
    assert tokenizer_lib.load_tokenizer(str(pathlib.Path(trained[kind]).parent)).vocab_size == 600


def test_model_vocabulary_follows_the_tokenizer(trained):
  from lowcomm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  assert tokenizer_lib.model_vocab_size(256) == 256
  assert tokenizer_lib.model_vocab_size(600) == 640 and tokenizer_lib.model_vocab_size(640) == 640
  assert config_lib.model_config_of(tiny_config()).vocab_size == 256
  assert (
    config_lib.model_config_of(tiny_config(**{"data.tokenizer": trained["bpe"]})).vocab_size == 640
  )


def _docs_written(root: pathlib.Path, docs):
  """Writes `docs` as every file source does; returns {corpus spec: the documents it must give}."""
  texts = [t for _, t in docs]
  (root / "txt" / "sub").mkdir(parents=True)
  for i, text in enumerate(texts[:5]):
    (root / "txt" / ("sub" if i % 2 else "") / f"{i}.txt").write_text(text)
  (root / "txt" / ".hidden").write_text("not a document")
  with open(root / "a.jsonl", "w") as f:
    for text in texts[:7]:
      f.write(json.dumps({"text": text, "n": 1}) + "\n")
  pq.write_table(pa.table({"content": texts[:6], "n": list(range(6))}), root / "a.parquet")
  import datasets  # pylint: disable=g-import-not-at-top  (test dependency: the real save_to_disk)
  datasets.Dataset.from_dict({"text": texts[:9]}).save_to_disk(str(root / "hf"))
  datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:3]}),
                        "test": datasets.Dataset.from_dict({"text": texts[3:4]})}).save_to_disk(
                            str(root / "hf_dict"))
  txt_order = sorted(range(5), key=lambda i: (f"{i}.txt" if i % 2 == 0 else f"sub/{i}.txt"))
  return {f"text:{root}/txt": [texts[i] for i in txt_order],
          f"text:{root}/txt/**/*.txt": [texts[i] for i in sorted(range(5),
                                                                 key=lambda i: (i % 2, i))],
          f"jsonl:{root}/*.jsonl:text": texts[:7], f"parquet:{root}/a.parquet:content": texts[:6],
          f"hf:{root}/hf:text": texts[:9], f"hf:{root}/hf_dict:text": texts[:4]}


def test_every_file_source_gives_the_documents_written(tmp_path, licenses):
  for spec, expected in _docs_written(tmp_path, licenses).items():
    corpora.check_available(spec)
    got = [t for _, t in corpora.load_documents(spec)]
    assert got == expected, spec
    ids = [d for d, _ in corpora.load_documents(spec)]
    assert len(set(ids)) == len(ids), spec
    # The identity follows the files: a changed file is another corpus.
  # Pre-tokenized ids: a .npy of uint32 and a raw .bin of uint16, each with its metadata.
  ids = np.arange(70_000, 70_100, dtype=np.uint32)
  np.save(tmp_path / "ids.npy", ids)
  (tmp_path / "ids.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 70_100,
                                                 "num_tokens": 100, "tokenizer": "t.json"}))
  (ids - 69_950).astype(np.uint16).tofile(tmp_path / "small.bin")
  (tmp_path / "small.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 200,
                                                   "num_tokens": 100}))
  for name, expected in [("ids.npy", ids), ("small.bin", ids - 69_950)]:
    corpora.check_available(f"tokens:{tmp_path}/{name}")
    got, _ = files.read_tokens(f"tokens:{tmp_path}/{name}")
    np.testing.assert_array_equal(got, expected)
  spec = f"jsonl:{tmp_path}/*.jsonl:text"
  before = corpora.corpus_identity(spec)
  with open(tmp_path / "a.jsonl", "a") as f:
    f.write(json.dumps({"text": "one more"}) + "\n")
  assert corpora.corpus_identity(spec) != before


def test_documents_are_cut_at_a_separator_and_a_length():
  docs = [("a", "one\n\n\ntwo three\n\n\n"), ("b", "four")]
  assert list(files.cut(docs, "\n\n\n")) == [("a#0", "one"), ("a#1", "two three"), ("b#0", "four")]
  assert list(files.cut(docs, "", 4)) == [("a#0", "one\n"), ("a#1", "\n\ntw"), ("a#2", "o th"),
                                     ("a#3", "ree\n"), ("b#0", "four")]
  assert list(files.cut(docs)) == docs


def test_a_single_document_file_holds_out_the_tail_of_its_stream(tmp_path, licenses):
  text = "\n".join(t for _, t in licenses[:20])
  (tmp_path / "one.txt").write_text(text)
  splits = pipeline.load_splits(f"text:{tmp_path}/one.txt", 20)
  stream = tokenizer_lib.ByteTokenizer().encode_documents([text])
  held = len(stream) * 20 // 1000
  np.testing.assert_array_equal(splits.eval, stream[-held:])
  np.testing.assert_array_equal(splits.train, stream[:-held])
  # Cut into pieces, the same file is split by documents again.
  cut = pipeline.load_splits(f"text:{tmp_path}/one.txt", 20, doc_chars=500)
  assert len(cut.train) + len(cut.eval) > len(stream) and cut.eval[-1] == 0


def test_bits_per_byte_count_the_utf8_bytes_of_the_eval_text(tmp_path, licenses, trained):
  for i, (_, text) in enumerate(licenses):
    (tmp_path / f"{i:03d}.txt").write_text(text + " — ünïcode")
  spec = f"text:{tmp_path}"
  held = [t for d, t in corpora.load_documents(spec) if corpora.is_eval_document(d, 100)]
  assert held
  for kind in ("bytes", "bpe", "sentencepiece"):
    name = kind if kind == "bytes" else trained[kind]
    splits = pipeline.load_splits(spec, 100, name)
    text_bytes = sum(len(t.encode()) + 1 for t in held)  # + its separator
    assert splits.bytes_per_token == pytest.approx(text_bytes / len(splits.eval), rel=1e-12)
    assert splits.bits_per_byte(2.0) == pytest.approx(
      2.0 * len(splits.eval) / math.log(2) / text_bytes
    )
  assert pipeline.load_splits(spec, 100).bytes_per_token == 1.0


def test_prepared_ids_are_the_tokenizers_stream_and_train_and_evaluate(tmp_path, licenses, trained):
  """prepare_data's .bin (two worker processes) holds exactly the tokenizer's stream of the
  documents; a run trains on it, reports bits per byte, and evaluation gives the run's own final
  eval loss from its checkpoint."""
  tok = tokenizer_lib.load_tokenizer(trained["bpe"])

  def held_out(path):  # the documents an evaluation of `path` holds out
    return [t for i, (_, t) in enumerate(licenses)
            if corpora.is_eval_document(f"{path}:{i + 1}", 20)]

  # which documents are held out hashes their ids, the file's path in them: a file name whose
  # held-out documents fill at least one batch of 8 windows of 32 tokens, whatever the folder
  docs = next(path for path in (tmp_path / f"docs{k}.jsonl" for k in range(200))
              if (len(tok.encode_documents(held_out(path))) - 1) // 32 >= 8)
  with open(docs, "w") as f:
    for _, text in licenses:
      f.write(json.dumps({"body": text}) + "\n")
  corpus = f"jsonl:{docs}:body"
  out = tmp_path / "ids" / "docs.bin"
  proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "prepare_data.py"),
                         f"--corpus={corpus}", f"--tokenizer={trained['bpe']}", f"--out={out}",
                         "--workers=2"], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  meta = json.loads((tmp_path / "ids" / "docs.json").read_text())
  expected = tok.encode_documents(t for _, t in licenses)
  ids, read_meta = files.read_tokens(f"tokens:{out}")
  np.testing.assert_array_equal(ids, expected)
  assert meta == read_meta and meta["dtype"] == "uint16" and meta["vocab_size"] == 600
  assert meta["num_tokens"] == len(expected) and meta["eos_id"] == tok.eos_id

  changes = {"num_steps": 4, "eval.every": 4, "checkpoint.every": 4, "data.corpus": f"tokens:{out}",
             "data.tokenizer": trained["bpe"], "data.seq_len": 32, "data.batch_size": 8,
             "eval.batch_size": 8, "eval.num_batches": 2}
  trainer = Trainer(tiny_config(**changes), tmp_path / "run")
  assert trainer.model_cfg.vocab_size == 640
  summary = trainer.run()
  splits = pipeline.load_splits(f"tokens:{out}", 20, trained["bpe"])
  held = len(expected) * 20 // 1000
  np.testing.assert_array_equal(splits.eval, expected[-held:])
  assert summary["eval_bytes_per_token"] == pytest.approx(
      tok.count_bytes(expected[-held:]) / held, rel=1e-12)
  assert summary["final_eval_bits_per_byte"] == pytest.approx(
      summary["final_eval_loss"] / math.log(2) / summary["eval_bytes_per_token"], rel=1e-12)
  # Near log(640) nats at the start: a model over the padded vocabulary.
  assert 4.0 < summary["final_eval_loss"] < math.log(640) + 0.5
  # Float32 means of 2 batches of 8·32 token losses, each at the end of the decoder's chain of sums,
  # computed by two programs.
  own, other = evaluation.evaluate_corpora(tmp_path / "run", [f"tokens:{out}", corpus])
  testing.assert_within(own["eval_loss"], summary["final_eval_loss"], testing.sum_error_bound(
      summary["final_eval_loss"], testing.chain_of_sums(trainer.model_cfg, 32, 2 * 8 * 32)),
                        "eval loss")
  # The same documents tokenized afresh, held out by document instead of the stream's tail: up to
  # 2 batches of 8 windows of 32 tokens, as many as the held-out stream fills
  held = held_out(docs)
  windows = (len(tok.encode_documents(held)) - 1) // 32
  assert other["corpus"] == corpus
  assert other["eval_tokens"] == min(windows // 8, 2) * 8 * 32
  assert other["eval_bytes_per_token"] == pytest.approx(
      sum(len(t.encode()) + 1 for t in held) / len(tok.encode_documents(held)), rel=1e-12)
  # Other ids under the same name: the run is not resumed on them.
  with open(out, "ab") as f:
    expected[:5].tofile(f)
  (tmp_path / "ids" / "docs.json").write_text(json.dumps({**meta, "num_tokens": len(expected) + 5}))
  with pytest.raises(ValueError, match=re.escape(
      f"data.corpus='tokens:{out}' is not the file the run in {tmp_path / 'run'} trained on: the "
      f"run's was {out} of {len(expected) * 2} bytes")):
    Trainer(tiny_config(**changes), tmp_path / "run")
  other = evaluation.run_config(tmp_path / "run", {"data.corpus": corpus, "data.seq_len": "16"})
  assert other.data.corpus == corpus and other.data.seq_len == 16
  for changes, message in [({"data.tokenizer": "bytes"}, "--config.data.tokenizer cannot change"),
                           ({"data.seq_len": "4096"}, "data.seq_len must be <= 128"),
                           ({"eval.num_batches": "many"},
                            "--config.eval.num_batches='many' must be of type int"),
                           ({"data.corpus": "text:nowhere/*.txt"}, "matches no file")]:
    with pytest.raises(ValueError, match=re.escape(message)):
      evaluation.run_config(tmp_path / "run", changes)


def test_evaluate_refuses_in_one_line_and_reads_only(tmp_path):
  (tmp_path / "run").mkdir()
  proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "evaluate.py"),
                         f"--workdir={tmp_path / 'run'}", "--config.data.corpus=stdlib"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1 and proc.stderr.startswith("ValueError: ")
  assert "holds no config.json" in proc.stderr and "Traceback" not in proc.stderr
  assert list((tmp_path / "run").iterdir()) == []
