"""A model out of a run and back in: sampling with the key/value cache (`models.decode`) against
the full forward, experiments/generate.py, the Hugging Face Llama export (`models.hf_llama`,
experiments/export.py) against a numpy Llama written from that format's definition, and a run
started from an exported folder (`init_from=hf:<folder>`)."""

import contextlib
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowcomm_jax.data import tokenizer as tokenizer_lib
from lowcomm_jax.models import config as model_config, decode, hf_llama, llama
from lowcomm_jax.testing import ROOT, tiny_config, tree_hash
from lowcomm_jax.train import Trainer, checkpoint

CFG = dataclasses.replace(model_config.PRESETS["tiny"], max_seq_len=32)
PROMPT = np.array([[72, 101, 108, 108, 111], [10, 100, 101, 102, 32]], np.int32)
NEW = 12


@pytest.fixture(scope="module")
def params():
  # A larger embedding/head than init gives makes the logits far from ties, so that float32
  # rounding between the two paths cannot flip an argmax.
  p = llama.init_params(CFG, 3)
  return {**p, "head": p["head"] * 50.0}


def _greedy_full_forward(params, prompt, new):
  """Greedy decoding without a cache: the whole sequence's forward for every new token, on a
  fixed-length buffer (causal: positions after the last written one do not change its logits)."""
  model = nnx.merge(decode.graphdef_of(CFG), params)
  forward = jax.jit(lambda tokens: model(tokens))
  b, p = prompt.shape
  tokens = np.zeros((b, p + new), np.int32)
  tokens[:, :p] = prompt
  logits_steps = []
  for i in range(new):
    logits = np.asarray(forward(jnp.asarray(tokens)))[:, p + i - 1]
    logits_steps.append(logits)
    tokens[:, p + i] = logits.argmax(-1)
  return tokens, np.stack(logits_steps, 1)


def test_greedy_with_the_cache_equals_greedy_with_the_full_forward(params):
  expected, full_logits = _greedy_full_forward(params, PROMPT, NEW)
  got = decode.generate(CFG, params, PROMPT, NEW, decode.GREEDY)
  np.testing.assert_array_equal(got, expected)
  # The cached forward's logits at each step, against the full forward's: the same products, the
  # attention sums taken over the cache's zero-padded slots (exact zeros after the mask). The
  # logits are O(|head|·√D); float32 rounding of sums over D = 32 and d_ff = 64 terms through 2
  # layers stays within a few hundred ulps of that magnitude.
  graphdef = decode.graphdef_of(CFG)
  forward = jax.jit(lambda p, tokens, cache, start: decode.forward_cached(
      nnx.merge(graphdef, p), tokens, cache, start))
  cache = decode.empty_cache(CFG, 2, PROMPT.shape[1] + NEW)
  logits, cache = forward(params, jnp.asarray(got[:, :PROMPT.shape[1]]), cache, 0)
  cached = [np.asarray(logits[:, -1])]
  for pos in range(PROMPT.shape[1], PROMPT.shape[1] + NEW - 1):
    logits, cache = forward(params, jnp.asarray(got[:, pos:pos + 1]), cache, pos)
    cached.append(np.asarray(logits[:, 0]))
  scale = np.abs(full_logits).max()
  np.testing.assert_allclose(np.stack(cached, 1), full_logits, rtol=0, atol=512 * 2**-23 * scale)


def test_top_k_one_is_greedy_and_a_seed_reproduces(params):
  greedy = decode.generate(CFG, params, PROMPT, NEW, decode.GREEDY)
  top1 = decode.generate(CFG, params, PROMPT, NEW, decode.Sampling(temperature=1.0, top_k=1),
                         seed=5)
  np.testing.assert_array_equal(top1, greedy)
  hot = decode.Sampling(temperature=2.0, top_k=50, top_p=0.95)
  a = decode.generate(CFG, params, PROMPT, NEW, hot, seed=1)
  np.testing.assert_array_equal(decode.generate(CFG, params, PROMPT, NEW, hot, seed=1), a)
  assert (decode.generate(CFG, params, PROMPT, NEW, hot, seed=2) != a).any()
  np.testing.assert_array_equal(a[:, :PROMPT.shape[1]], PROMPT)


def test_sample_filters():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  keys = jax.random.split(jax.random.key(0), 2000)
  draw = lambda s: np.asarray(jax.vmap(lambda k: decode.sample(logits, s, k))(keys))[:, 0]
  # top_p = 0.7: 0.5 alone is below 0.7, 0.5 + 0.3 reaches it, so tokens 0 and 1 are kept.
  assert set(draw(decode.Sampling(top_p=0.7))) == {0, 1}
  assert set(draw(decode.Sampling(top_k=3))) == {0, 1, 2}
  # Unfiltered at T = 1, token 3 (p = 0.05) is drawn ~100 times in 2000 draws (σ ≈ 10).
  assert 50 < (draw(decode.Sampling()) == 3).sum() < 150
  assert set(draw(decode.Sampling(top_p=0.1))) == {0}  # the most likely token is always kept


@pytest.mark.parametrize("prompt_len,new,message", [
    (0, 4, "--prompt must hold at least one token"),
    (30, 4, "exceeds the model's context of 32 tokens (model.max_seq_len)"),
    (3, 0, "--max_new_tokens must be an integer >= 1"),
])
def test_lengths_are_refused_naming_the_flag(prompt_len, new, message):
  with pytest.raises(ValueError, match=None) as error:
    decode.check_length(CFG, prompt_len, new)
  assert message in str(error.value)


# --- a run to take the model out of ---------------------------------------------------------------

# Steps 1 and 3 inner steps, step 2 an outer step in the one grouping of 2 replicas: the replicas'
# own weights then differ from their mean.
NOLOCO = {"algorithm": "noloco", "num_replicas": 2, "noloco.sync_every": 2,
          "noloco.num_groupings": 1,
          "mesh.replica": 2, "mesh.data": 1, "num_steps": 3, "data.seq_len": 32,
          "eval.num_batches": 1}


@pytest.fixture(scope="module")
def started(tmp_path_factory):
  """(workdir, what the run printed)."""
  workdir = tmp_path_factory.mktemp("noloco") / "run"
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    Trainer(tiny_config(**NOLOCO), workdir).run()
  return workdir, printed.getvalue()


@pytest.fixture(scope="module")
def run(started):
  return started[0]


def test_the_run_starts_with_its_startup_line(started):
  workdir, printed = started
  first = printed.splitlines()[0]
  assert first.startswith("model tiny (2 layers, d_model 32, ")
  assert "| mesh replica=2 data=1 tensor=1 stage=1 on 2 cpu devices |" in first
  assert "| 512 tokens per step (2 replicas × 8 sequences × 32 tokens) |" in first
  assert first.endswith(f"| algorithm noloco, gradients replicas | workdir {workdir.absolute()}")


def _binary(name, *args, cwd, env=None):
  return subprocess.run([sys.executable, str(ROOT / "experiments" / name), *args], cwd=cwd,
                        capture_output=True, text=True, timeout=300, env=env)


def test_generate_binary_samples_the_replica_asked_for(run, tmp_path):
  model_cfg, params = checkpoint.read_eval_params(run, replica=1)
  prompt = np.frombuffer(b"def ", np.uint8).astype(np.int32)
  expected = decode.generate(model_cfg, params, prompt, 16, decode.GREEDY)[0]
  proc = _binary("generate.py", f"--workdir={run}", "--prompt=def ", "--max_new_tokens=16",
                 "--temperature=0", "--replica=1", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout == bytes(expected.astype(np.uint8).tolist()).decode("utf-8", "replace") + "\n"
  # NoLoCo's evaluated model (the replicas' mean slow weights) is another model than replica 1's.
  _, mean_params = checkpoint.read_eval_params(run)
  assert not np.array_equal(mean_params["head"], params["head"])


def _rms_norm(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate_half(x):
  half = x.shape[-1] // 2
  return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _hf_llama_logits(folder, tokens_T):
  """LlamaForCausalLM's forward in numpy (float64), from config.json's fields and the tensor
  names of model.safetensors, following transformers' modeling_llama: rotary by `rotate_half` with
  cos/sin of the frequencies repeated over both halves, attention scaled by head_dim^-0.5."""
  from safetensors.numpy import load_file
  hf = json.loads((folder / "config.json").read_text())
  w = {k: v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}
  h, k, eps = hf["num_attention_heads"], hf["head_dim"], hf["rms_norm_eps"]
  t = len(tokens_T)
  inv_freq = 1.0 / hf["rope_theta"] ** (np.arange(0, k, 2) / k)
  freqs = np.arange(t)[:, None] * inv_freq[None]
  emb = np.concatenate([freqs, freqs], axis=-1)
  cos, sin = np.cos(emb)[:, None], np.sin(emb)[:, None]  # [T, 1, K]
  x = w["model.embed_tokens.weight"][tokens_T]
  for i in range(hf["num_hidden_layers"]):
    pre = f"model.layers.{i}."
    y = _rms_norm(x, w[pre + "input_layernorm.weight"], eps)
    q, kk, v = ((y @ w[pre + f"self_attn.{n}_proj.weight"].T).reshape(t, h, k) for n in "qkv")
    q, kk = q * cos + _rotate_half(q) * sin, kk * cos + _rotate_half(kk) * sin
    scores = np.einsum("thd,shd->hts", q, kk) * k ** -0.5
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x = (
      x
      + np.einsum("hts,shd->thd", probs, v).reshape(t, h * k) @ w[pre + "self_attn.o_proj.weight"].T
    )
    y = _rms_norm(x, w[pre + "post_attention_layernorm.weight"], eps)
    gate, up = y @ w[pre + "mlp.gate_proj.weight"].T, y @ w[pre + "mlp.up_proj.weight"].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ w[pre + "mlp.down_proj.weight"].T
  return _rms_norm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


TOKENS = np.frombuffer(b"import numpy as np\nx = np.zeros(3)\n", np.uint8).astype(np.int32)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
  out = tmp_path_factory.mktemp("export") / "llama"
  # Without XLA_FLAGS: the binary provides the 2 CPU devices of the run's mesh itself.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = _binary("export.py", f"--workdir={run}", f"--out={out}", cwd=out.parent, env=env)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return out


def test_export_gives_the_same_logits_in_a_numpy_llama(run, exported):
  model_cfg, params = checkpoint.read_eval_params(run)
  ours = np.asarray(nnx.merge(decode.graphdef_of(model_cfg), params)(jnp.asarray(TOKENS[None])))[0]
  theirs = _hf_llama_logits(exported, TOKENS)
  # float32 against float64: sums of D = 32 and d_ff = 64 products through 2 layers and a softmax
  # over T = 36 keep the relative error within ~100 ulps of the logits' magnitude.
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=128 * 2**-23 * np.abs(theirs).max())
  assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))
  hf = json.loads((exported / "config.json").read_text())
  assert hf["architectures"] == ["LlamaForCausalLM"] and hf["tie_word_embeddings"] is False
  assert (hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"]) == (256, 32, 2)


def test_export_reads_back_to_the_same_parameters(run, exported):
  model_cfg, params = checkpoint.read_eval_params(run)
  read_cfg, read_params = hf_llama.read_folder(exported)
  assert read_cfg == model_cfg
  jax.tree.map(np.testing.assert_array_equal, read_params, jax.tree.map(np.asarray, params))


def test_transformers_llama_gives_the_same_logits(run, exported):
  transformers = pytest.importorskip("transformers", reason="transformers is not installed")
  torch = pytest.importorskip("torch", reason="torch is not installed")
  model = transformers.LlamaForCausalLM.from_pretrained(exported, torch_dtype=torch.float32)
  with torch.no_grad():
    theirs = model(torch.tensor(TOKENS[None], dtype=torch.long)).logits[0].numpy()
  model_cfg, params = checkpoint.read_eval_params(run)
  ours = np.asarray(nnx.merge(decode.graphdef_of(model_cfg), params)(jnp.asarray(TOKENS[None])))[0]
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=128 * 2**-23 * np.abs(theirs).max())


def test_a_workdir_without_a_checkpoint_is_refused_in_one_line(tmp_path):
  workdir = tmp_path / "empty"
  workdir.mkdir()
  (tmp_path / "config_only").mkdir()
  (tmp_path / "config_only" / "config.json").write_text("{}")
  before = tree_hash(tmp_path)
  # generate.py and export.py both read the run through checkpoint.read_model
  for where in (workdir, tmp_path / "config_only", tmp_path / "missing"):
    with pytest.raises(ValueError, match="holds no config.json and checkpoints/ of a run"):
      checkpoint.read_model(where)
  proc = _binary("export.py", f"--workdir={workdir}", f"--out={tmp_path / 'out'}", cwd=tmp_path)
  assert proc.returncode == 1 and proc.stderr.startswith(f"ValueError: --workdir='{workdir}' "
                                                         f"holds no")
  assert "Traceback" not in proc.stderr
  assert tree_hash(tmp_path) == before


TEXT = "héllo wörld €\n\tdef f(x): return x  # 🙂 Ā <0x00>"


def test_export_carries_a_byte_tokenizer_whose_eos_is_the_document_separator(exported):
  """The byte tokenizer as a `tokenizers` file of the same ids (what AutoTokenizer loads), the
  document separator (id 0) its eos in tokenizer_config.json, config.json and
  generation_config.json, so that generation stops at a document's end."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  theirs = tokenizers.Tokenizer.from_file(str(exported / "tokenizer.json"))
  ours = tokenizer_lib.ByteTokenizer()
  assert theirs.encode(TEXT).ids == ours.encode(TEXT).tolist()
  assert theirs.decode(ours.encode(TEXT).tolist()) == TEXT
  settings = json.loads((exported / "tokenizer_config.json").read_text())
  assert settings["tokenizer_class"] == "PreTrainedTokenizerFast"
  assert theirs.token_to_id(settings["eos_token"]) == ours.eos_id == 0
  for name in ("config.json", "generation_config.json"):
    assert json.loads((exported / name).read_text())["eos_token_id"] == 0, name
  # The exported folder read back as data.tokenizer: the same ids and separator.
  loaded = tokenizer_lib.load_tokenizer(str(exported))
  assert loaded.eos_id == 0 and loaded.vocab_size == 256
  assert loaded.encode(TEXT).tolist() == ours.encode(TEXT).tolist()
  assert not any(p.name.endswith(".partial") for p in exported.parent.iterdir())


def test_export_of_a_bpe_tokenizer_names_its_separator_as_eos(tmp_path):
  """A tokenizer.json run: the file copied, its end-of-text token (the separator) the eos."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  path = tokenizer_lib.train_bpe([TEXT * 3, "print('hi')\n" * 5], 300, tmp_path / "bpe")
  tok = tokenizer_lib.load_tokenizer(str(path))
  params = llama.init_params(dataclasses.replace(CFG, vocab_size=384), 0)
  hf_llama.write_folder(tmp_path / "out", dataclasses.replace(CFG, vocab_size=384), params, tok)
  settings = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
  assert settings["eos_token"] == "<|endoftext|>"
  copied = tokenizers.Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
  assert copied.token_to_id("<|endoftext|>") == tok.eos_id
  generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
  assert generation["eos_token_id"] == tok.eos_id


def _links(tmp_path, run):
  """Bad --out paths (name → (path, the refusal's words)), made in `tmp_path`."""
  (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
  (tmp_path / "to_run").symlink_to(run)
  (tmp_path / "empty").mkdir()
  (tmp_path / "file").write_text("x")
  return {
      "dangling symlink": (tmp_path / "dangling", "is a symbolic link to"),
      "symlink to the run": (tmp_path / "to_run", "exists; give a new path"),
      "under a symlink into the run": (tmp_path / "to_run" / "model",
                                       "is inside the run directory"),
      "inside the run": (run / "model", "is inside the run directory"),
      "an empty directory": (tmp_path / "empty", "exists; give a new path"),
      "a file": (tmp_path / "file", "exists; give a new path"),
      "under a file": (tmp_path / "file" / "model", "which is not a directory"),
      "empty": ("", "--out must name a new directory"),
  }


def test_export_out_refusals_are_one_line_and_change_nothing(run, tmp_path):
  bad = _links(tmp_path, run)
  before = tree_hash(run), sorted(os.listdir(tmp_path))
  for name, (out, words) in bad.items():
    with pytest.raises(ValueError, match=None) as error:
      hf_llama.check_out_dir(out, run)
    assert words in str(error.value) and "\n" not in str(error.value), name
  # The binary: one line for the dangling link (which a directory creation would trip over).
  proc = _binary("export.py", f"--workdir={run}", f"--out={tmp_path / 'dangling'}", cwd=tmp_path)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert proc.stderr.startswith(f"ValueError: --out='{tmp_path / 'dangling'}' is a symbolic link")
  assert proc.stderr.count("\n") == 1
  assert (tree_hash(run), sorted(os.listdir(tmp_path))) == before


def test_an_export_that_fails_leaves_no_folder(tmp_path):
  params = llama.init_params(CFG, 0)
  del params["head"]  # a write that fails half-way
  with pytest.raises(KeyError):
    hf_llama.write_folder(tmp_path / "out", CFG, params, tokenizer_lib.ByteTokenizer())
  assert os.listdir(tmp_path) == []


# --- a run started from a Hugging Face folder --------------------------------------------------

HF_RUN = {"num_steps": 2, "data.seq_len": 32, "eval.num_batches": 1, "algorithm": "diloco",
          "num_replicas": 2, "outer.sync_every": 2, "mesh.data": 1}


def test_init_from_hf_starts_from_the_folders_weights(run, exported, tmp_path):
  """export → import is the identity: the run starts from the exported run's evaluated parameters,
  bit for bit, so its logits are those; continued training (DiLoCo here) runs from them."""
  _, params = checkpoint.read_eval_params(run)
  trainer = Trainer(tiny_config(**HF_RUN, init_from=f"hf:{exported}"), tmp_path / "continued")
  started = jax.device_get(trainer.init_params())
  jax.tree.map(np.testing.assert_array_equal, started, jax.tree.map(np.asarray, params))
  model_cfg = trainer.model_cfg
  forward = lambda p: nnx.merge(decode.graphdef_of(model_cfg), p)(jnp.asarray(TOKENS[None]))
  logits = lambda p: np.asarray(forward(p))
  np.testing.assert_array_equal(logits(started), logits(params))
  summary = trainer.run()
  assert np.isfinite(summary["final_eval_loss"])


def _variant(exported, tmp_path, name, change):
  folder = tmp_path / name
  shutil.copytree(exported, folder)
  change(folder)
  return folder


def _edit_config(**fields):
  def change(folder):
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, **fields}))
  return change


def _drop_tensor(folder):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  tensors = load_file(str(folder / "model.safetensors"))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, str(folder / "model.safetensors"))


def _reshape_tensor(folder):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  tensors = load_file(str(folder / "model.safetensors"))
  tensors["model.norm.weight"] = np.ones(16, np.float32)
  save_file(tensors, str(folder / "model.safetensors"))


INIT_FROM_HF_REFUSALS = {
    "another width": ({"model.d_ff": 96}, None, "intermediate_size 64 (this run: 96, model.d_ff)"),
    "grouped-query attention": ({}, _edit_config(num_key_value_heads=1), "num_key_value_heads 1"),
    "tied embeddings": ({}, _edit_config(tie_word_embeddings=True), "tie_word_embeddings True"),
    "another architecture": ({}, _edit_config(architectures=["MistralForCausalLM"]),
                             "architectures ['MistralForCausalLM']"),
    "another vocabulary": ({}, _edit_config(vocab_size=512), "vocab_size 512 (this run: 256"),
    "a tensor missing": ({}, _drop_tensor, "1 tensors missing, e.g. ['model.layers.1.mlp.up_proj"),
    "a tensor of another shape": ({}, _reshape_tensor, "model.norm.weight [16] (this run: [32])"),
    "no weights": ({}, lambda f: (f / "model.safetensors").unlink(), "no model.safetensors in it"),
    "no folder": ({}, lambda f: shutil.rmtree(f), "no config.json in it"),
    "another tokenizer": ({}, lambda f: tokenizer_lib.train_bpe([TEXT * 4], 200, f, overwrite=True),
                          "holds another tokenizer than data.tokenizer='bytes'"),
}


def test_init_from_hf_refuses_another_model_in_one_line(exported, tmp_path):
  for name, (changes, change, words) in INIT_FROM_HF_REFUSALS.items():
    folder = _variant(exported, tmp_path, name.replace(" ", "_"), change or (lambda f: None))
    before = tree_hash(folder)
    config = tiny_config(**HF_RUN, **changes, init_from=f"hf:{folder}")
    with pytest.raises(ValueError, match=None) as error:
      Trainer(config, tmp_path / "run")
    message = str(error.value)
    assert message.startswith(f"init_from='hf:{folder}'") and words in message, (name, message)
    assert "\n" not in message and not (tmp_path / "run").exists(), name
    assert tree_hash(folder) == before, name


# A Llama of a shape no preset has (head_dim 12, 3 layers), written by the test itself: the folder a
# user downloads, as far as this decoder reads one.
OPEN_SHAPE = dict(vocab_size=256, d_model=48, num_layers=3, num_heads=4, d_ff=80, max_seq_len=64,
                  rope_base=500_000.0, norm_eps=1e-6)


@pytest.fixture(scope="module")
def open_model(tmp_path_factory):
  cfg = model_config.ModelConfig(**OPEN_SHAPE)
  params = jax.tree.map(np.asarray, llama.init_params(cfg, 11))
  folder = tmp_path_factory.mktemp("open") / "llama"
  hf_llama.write_folder(folder, cfg, params, tokenizer_lib.ByteTokenizer())
  return folder, params


def test_a_run_of_the_folders_shape_continues_training_it(open_model, tmp_path):
  """model.size=hf:<folder> takes the shape from config.json, init_from=hf:<folder> the weights:
  the run starts from the folder's parameters bit for bit, its logits those of the numpy Llama
  written from Hugging Face's definition, and continues training them."""
  folder, params = open_model
  config = tiny_config(**{**HF_RUN, "model.size": f"hf:{folder}", "init_from": f"hf:{folder}"})
  trainer = Trainer(config, tmp_path / "continued")
  assert trainer.model_cfg == model_config.ModelConfig(**{**OPEN_SHAPE, "max_seq_len": 64})
  started = jax.device_get(trainer.init_params())
  jax.tree.map(np.testing.assert_array_equal, started, params)
  ours = np.asarray(nnx.merge(decode.graphdef_of(trainer.model_cfg), started)(
      jnp.asarray(TOKENS[None])))[0]
  theirs = _hf_llama_logits(folder, TOKENS)
  # float32 against float64, sums of D = 48 and d_ff = 80 products through 3 layers
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=128 * 2**-23 * np.abs(theirs).max())
  summary = trainer.run()
  assert np.isfinite(summary["final_eval_loss"])
  # and the run exports back to the same kind of folder
  _, trained = checkpoint.read_eval_params(tmp_path / "continued")
  hf_llama.write_folder(tmp_path / "again", trainer.model_cfg, trained,
                        tokenizer_lib.ByteTokenizer())
  assert hf_llama.read_folder(tmp_path / "again")[0] == trainer.model_cfg


def test_model_size_hf_refuses_a_folder_it_cannot_run_in_one_line(open_model, tmp_path):
  folder, _ = open_model
  gqa = _variant(folder, tmp_path, "gqa", _edit_config(num_key_value_heads=2))
  cases = {
      tmp_path / "missing": "no config.json in it",
      gqa: "grouped-query attention",
  }
  for where, words in cases.items():
    with pytest.raises(ValueError, match=None) as error:
      Trainer(tiny_config(**HF_RUN, **{"model.size": f"hf:{where}"}), tmp_path / "run")
    message = str(error.value)
    assert message.startswith(f"model.size='hf:{where}'") and words in message, message
    assert "\n" not in message and not (tmp_path / "run").exists()
