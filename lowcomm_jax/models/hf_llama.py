"""The decoder's parameters as a Hugging Face Llama model folder, and back.

A folder that `transformers.LlamaForCausalLM.from_pretrained(folder)` (and tools that read that
format: vLLM, llama.cpp's converter, safetensors viewers) loads: `config.json` with the
`LlamaForCausalLM` fields, `model.safetensors` with that format's parameter names, and the
tokenizer's files.

The two models compute the same function:
  - RMSNorm: x · rsqrt(mean(x²) + ε) · w in both.
  - Rotary positions: ours rotates the pairs (x_i, x_{i+K/2}) of each head's K features
    (`llama.apply_rotary`: first half, second half), which is Hugging Face's `rotate_half`
    convention with the same frequencies 1 / base^(2i/K). So q and k are written as they are: the
    permutation of Hugging Face's conversion script maps Meta's interleaved pairs (x_{2i}, x_{2i+1})
    to halves, and ours are halves already.
  - Attention: softmax(q·kᵀ / √K, causal) · v, every head its own keys and values (no grouping).
  - Feed-forward: down(silu(gate(x)) · up(x)).
  - Embedding and output head are separate matrices (`tie_word_embeddings: false`).
Weights of `torch.nn.Linear` are [out, in]: ours ([in, ...]) are transposed, the heads' axes
flattened head-major (row h·K + k of q_proj is head h, feature k).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

import numpy as np

from lowcomm_jax.models.config import ModelConfig

WEIGHTS_FILE = "model.safetensors"
PREFIX = "hf:"  # init_from=hf:<folder>: a run starts from this folder's weights


def hf_config(cfg: ModelConfig) -> dict:
  """config.json of a `LlamaForCausalLM` with this shape (float32 weights)."""
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_heads,
      "head_dim": cfg.head_dim,
      "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_base,
      "rope_scaling": None,
      "hidden_act": "silu",
      "attention_bias": False,
      "attention_dropout": 0.0,
      "mlp_bias": False,
      "tie_word_embeddings": False,
      "torch_dtype": "float32",
      "bos_token_id": None,
      "eos_token_id": None,
      "pad_token_id": None,
  }


def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
  """Our ModelConfig of a Llama config.json (the shape; compute settings from `overrides`)."""
  if hf.get("num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
    raise ValueError("grouped-query attention (num_key_value_heads < num_attention_heads) is not "
                     "supported by this decoder")
  if hf.get("tie_word_embeddings", False):
    raise ValueError("tied embeddings (tie_word_embeddings: true) are not supported by this "
                     "decoder")
  shape = dict(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
               num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
               d_ff=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
               rope_base=float(hf.get("rope_theta", 10_000.0)),
               norm_eps=float(hf.get("rms_norm_eps", 1e-6)))
  cfg = ModelConfig(**{**shape, **overrides})
  if hf.get("head_dim", cfg.head_dim) != cfg.head_dim:
    raise ValueError(f"head_dim {hf['head_dim']} != hidden_size / num_attention_heads")
  return cfg


def folder_model_config(folder, option: str = "model.size", **overrides) -> ModelConfig:
  """Our ModelConfig of the Llama in `folder` (its config.json's shape), for `option`=hf:<folder>;
  one ValueError naming `option` where the folder holds none this decoder runs."""
  path = pathlib.Path(folder) / "config.json"
  try:
    return model_config_from_hf(json.loads(path.read_text()), **overrides)
  except FileNotFoundError:
    raise ValueError(f"{option}='{PREFIX}{folder}': no config.json in it; a Hugging Face Llama "
                     "folder holds config.json and model.safetensors") from None
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
    detail = f"no field {error}" if isinstance(error, KeyError) else str(error)
    raise ValueError(f"{option}='{PREFIX}{folder}': its config.json holds no model this decoder "
                     f"runs ({detail})") from None


def to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Our pure-dict parameters as Hugging Face Llama tensors (name → float32 [out, in] array)."""
  d, hk = cfg.d_model, cfg.num_heads * cfg.head_dim
  p, blocks = params, params["blocks"]
  as_np = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  out = {"model.embed_tokens.weight": as_np(p["embed"]),
         "model.norm.weight": as_np(p["final_norm"]["scale"]),
         "lm_head.weight": as_np(np.asarray(p["head"]).T)}
  for i in range(cfg.num_layers):
    layer = lambda *keys: np.asarray(_at(blocks, keys))[i]
    pre = f"model.layers.{i}."
    out[pre + "input_layernorm.weight"] = as_np(layer("attn_norm", "scale"))
    out[pre + "post_attention_layernorm.weight"] = as_np(layer("mlp_norm", "scale"))
    for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
      out[pre + f"self_attn.{theirs}.weight"] = as_np(layer("attn", ours).reshape(d, hk).T)
    out[pre + "self_attn.o_proj.weight"] = as_np(layer("attn", "wo").reshape(hk, d).T)
    for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
      out[pre + f"mlp.{theirs}.weight"] = as_np(layer("mlp", ours).T)
  return out


def from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
  """The inverse of `to_hf`: Hugging Face Llama tensors as our pure-dict parameters."""
  d, h, k = cfg.d_model, cfg.num_heads, cfg.head_dim
  missing = [n for n in hf_shapes(cfg) if n not in tensors]
  if missing:
    raise ValueError(f"the weights lack {len(missing)} tensors of a Llama of this config, e.g. "
                     f"{missing[:3]}")
  get = lambda name: np.asarray(tensors[name], np.float32)
  stack = lambda f: np.stack([f(f"model.layers.{i}.") for i in range(cfg.num_layers)])
  return {
      "embed": get("model.embed_tokens.weight"),
      "final_norm": {"scale": get("model.norm.weight")},
      "head": get("lm_head.weight").T.copy(),
      "blocks": {
          "attn_norm": {"scale": stack(lambda pre: get(pre + "input_layernorm.weight"))},
          "mlp_norm": {"scale": stack(lambda pre: get(pre + "post_attention_layernorm.weight"))},
          "attn": {
              **{ours: stack(lambda pre,
                             t=theirs: get(pre + f"self_attn.{t}.weight").T.reshape(d, h, k))
                 for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"))},
              "wo": stack(lambda pre: get(pre + "self_attn.o_proj.weight").T.reshape(h, k, d)),
          },
          "mlp": {ours: stack(lambda pre, t=theirs: get(pre + f"mlp.{t}.weight").T.copy())
                  for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"),
                                       ("w_down", "down_proj"))},
      },
  }


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple]:
  """The shape of each Hugging Face Llama tensor of this config ([out, in] for projections)."""
  v, d, hk, f = cfg.vocab_size, cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.d_ff
  per_layer = {"input_layernorm": (d,), "post_attention_layernorm": (d,),
               "self_attn.q_proj": (hk, d), "self_attn.k_proj": (hk, d),
               "self_attn.v_proj": (hk, d), "self_attn.o_proj": (d, hk), "mlp.gate_proj": (f, d),
               "mlp.up_proj": (f, d), "mlp.down_proj": (d, f)}
  return {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d),
          **{f"model.layers.{i}.{n}.weight": shape for i in range(cfg.num_layers)
             for n, shape in per_layer.items()}}


def _at(tree, keys):
  for key in keys:
    tree = tree[key]
  return tree


def check_out_dir(out, workdir=None) -> pathlib.Path:
  """The export folder: a new path (an export never replaces or fills an existing one), whose
  nearest existing ancestor is a directory, outside the run directory it is exported from once
  symbolic links are followed."""
  if not str(out or "").strip():
    raise ValueError("--out must name a new directory, got an empty path")
  out = pathlib.Path(out)
  if out.is_symlink() and not out.exists():
    raise ValueError(f"--out={str(out)!r} is a symbolic link to {os.readlink(out)!r}, which does "
                     "not exist; give a new path")
  if os.path.lexists(out):
    raise ValueError(f"--out={str(out)!r} exists; give a new path (an export never replaces one)")
  ancestor = next(a for a in out.absolute().parents if os.path.lexists(a))
  if not ancestor.is_dir():
    raise ValueError(f"--out={str(out)!r} lies under {str(ancestor)!r}, which is not a directory")
  if workdir is not None and out.resolve().is_relative_to(pathlib.Path(workdir).resolve()):
    raise ValueError(f"--out={str(out)!r} is inside the run directory {str(workdir)!r} (symbolic "
                     "links followed); give a directory outside it")
  return out


def write_folder(out, cfg: ModelConfig, params: dict, tokenizer) -> list[str]:
  """Writes the model folder (config.json, generation_config.json, model.safetensors, the
  tokenizer's files) at the new path `out`; returns the names written.

  The files are written into a new folder beside `out`, which is then renamed to `out`: a reader
  never sees a partial folder, and an interrupted export leaves no `out`.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  out = check_out_dir(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial",
                                          dir=out.parent))
  try:
    eos = tokenizer.eos_id
    (staging / "config.json").write_text(_json({**hf_config(cfg), "eos_token_id": eos}))
    # Hugging Face's generate() stops at the document separator, as this run's documents end.
    (staging / "generation_config.json").write_text(_json({"eos_token_id": eos}))
    save_file(to_hf(params, cfg), str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
    written = ["config.json", "generation_config.json", WEIGHTS_FILE]
    written += write_tokenizer(staging, tokenizer, cfg.max_seq_len)
    staging.chmod(0o755)
    check_out_dir(out)  # nothing took the path meanwhile
    staging.rename(out)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return written


def write_tokenizer(folder, tokenizer, max_seq_len: int) -> list[str]:
  """The tokenizer's files in a Hugging Face folder, with `tokenizer_config.json` naming the
  document separator as its eos token; returns the names written.

  A `tokenizers` file is copied as it is. A SentencePiece model is read by `LlamaTokenizer`
  (`legacy: true`: the model's own pieces, no prefix space added). The byte tokenizer is written
  as a `tokenizers` file of the same ids (`byte_tokenizer`).
  """
  folder = pathlib.Path(folder)
  settings = {"model_max_length": max_seq_len, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False}
  files = [pathlib.Path(f) for f in tokenizer.files()]
  if not files:  # the byte tokenizer: ids are UTF-8 byte values
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    settings.update(tokenizer_class="PreTrainedTokenizerFast", eos_token=chr(tokenizer.eos_id))
    written = ["tokenizer.json"]
  elif files[0].suffix == ".model":
    shutil.copy(files[0], folder / "tokenizer.model")
    settings.update(tokenizer_class="LlamaTokenizer", legacy=True, add_prefix_space=False,
                    eos_token=tokenizer.id_to_piece(tokenizer.eos_id))
    written = ["tokenizer.model"]
  else:
    shutil.copy(files[0], folder / "tokenizer.json")
    written = ["tokenizer.json"]
    own = files[0].parent / "tokenizer_config.json"
    if own.is_file():  # the tokenizer's own settings, its eos replaced by the separator
      settings = {**json.loads(own.read_text()), **settings}
    settings.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    settings["eos_token"] = tokenizer.id_to_piece(tokenizer.eos_id)
  (folder / "tokenizer_config.json").write_text(_json(settings))
  return written + ["tokenizer_config.json"]


def byte_tokenizer():
  """A `tokenizers.Tokenizer` whose ids are the text's UTF-8 bytes, as this package's byte
  tokenizer's: the ASCII characters are pieces of their own byte (NUL, id 0, the document
  separator and eos), every other character falls back to its bytes' pieces `<0x80>` … `<0xFF>`."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models  # pylint: disable=g-import-not-at-top
  vocab = {chr(b) if b < 128 else f"<0x{b:02X}>": b for b in range(256)}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
  tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
  tok.add_special_tokens([tokenizers.AddedToken(chr(0), special=True, normalized=False)])
  return tok


def _json(value) -> str:
  return json.dumps(value, indent=2) + "\n"


def read_folder(folder, **overrides) -> tuple[ModelConfig, dict]:
  """(our ModelConfig, our float32 parameters) of a Llama folder: config.json and its weights
  (model.safetensors, or the files a model.safetensors.index.json names; any float dtype)."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  folder = pathlib.Path(folder)
  cfg = model_config_from_hf(json.loads((folder / "config.json").read_text()), **overrides)
  tensors = {}
  for name in _weight_files(folder):
    tensors.update(load_file(str(folder / name)))
  return cfg, from_hf(tensors, cfg)


# config.json's fields that decide the function, each with the one value this decoder computes
_ARCHITECTURE = {"model_type": "llama", "hidden_act": "silu", "attention_bias": False,
                 "mlp_bias": False, "tie_word_embeddings": False, "rope_scaling": None}
_SHAPE = (("vocab_size", "vocab_size"), ("hidden_size", "d_model"),
          ("intermediate_size", "d_ff"), ("num_hidden_layers", "num_layers"),
          ("num_attention_heads", "num_heads"), ("rope_theta", "rope_base"),
          ("rms_norm_eps", "norm_eps"))


def check_folder(folder, cfg: ModelConfig, option: str = "init_from") -> pathlib.Path:
  """The Llama folder `folder`, checked to hold a model of exactly this config's architecture and
  shapes (config.json's fields and every weight's shape); one ValueError naming `option` and each
  difference otherwise."""
  folder = pathlib.Path(folder)
  where = f"{option}='{PREFIX}{folder}'"
  try:
    hf = json.loads((folder / "config.json").read_text())
    files = _weight_files(folder)
  except FileNotFoundError as error:
    raise ValueError(f"{where}: no {pathlib.Path(error.filename).name} in it; a Hugging Face Llama "
                     "folder holds config.json and model.safetensors") from None
  except (OSError, ValueError, KeyError) as error:
    raise ValueError(f"{where}: its config.json or weight index cannot be read ({error})") from None
  if not isinstance(hf, dict):
    raise ValueError(f"{where}: its config.json is not an object")
  diffs = []
  if hf.get("architectures", ["LlamaForCausalLM"]) != ["LlamaForCausalLM"]:
    diffs.append(f"architectures {hf['architectures']} (this decoder: LlamaForCausalLM)")
  diffs += [f"{k} {hf[k]!r} (this decoder: {v!r})" for k, v in _ARCHITECTURE.items()
            if k in hf and hf[k] != v]
  heads = hf.get("num_attention_heads")
  if hf.get("num_key_value_heads", heads) != heads:
    diffs.append(f"num_key_value_heads {hf['num_key_value_heads']} (this decoder: one per head)")
  defaults = {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6}
  diffs += [f"{theirs} {hf.get(theirs, defaults.get(theirs))} (this run: {getattr(cfg, ours)}, "
            f"model.{ours})" for theirs, ours in _SHAPE
            if hf.get(theirs, defaults.get(theirs)) != getattr(cfg, ours)]
  if not diffs:
    diffs = _weight_shape_diffs(folder, files, cfg)
  if diffs:
    raise ValueError(f"{where} holds another model than this run's: {'; '.join(diffs)}")
  return folder


def check_tokenizer(folder, tokenizer, option: str = "init_from") -> None:
  """Refuses, in one ValueError naming `option`, a folder whose tokenizer is not `tokenizer` (the
  run's `data.tokenizer`): a tokenizer.json of another vocabulary, a tokenizer.model of other bytes,
  or one kind where the run has the other. A folder without a tokenizer is not checked."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  folder = pathlib.Path(folder)
  theirs_json, theirs_model = folder / "tokenizer.json", folder / "tokenizer.model"
  files = [pathlib.Path(f) for f in tokenizer.files()]
  ours_model = files[0] if files and files[0].suffix == ".model" else None
  if theirs_json.is_file() and ours_model is None:
    ours = (byte_tokenizer() if not files else tokenizers.Tokenizer.from_file(str(files[0])))
    same = (tokenizers.Tokenizer.from_file(str(theirs_json)).get_vocab(with_added_tokens=True)
            == ours.get_vocab(with_added_tokens=True))
  elif theirs_model.is_file():
    same = ours_model is not None and theirs_model.read_bytes() == ours_model.read_bytes()
  else:
    return
  if not same:
    spec = getattr(tokenizer, "spec", "?")
    raise ValueError(f"{option}='{PREFIX}{folder}' holds another tokenizer than data.tokenizer="
                     f"{spec!r} (another vocabulary); give the folder as data.tokenizer")


def _weight_files(folder: pathlib.Path) -> list[str]:
  index = folder / (WEIGHTS_FILE + ".index.json")
  if index.is_file():
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))
  if not (folder / WEIGHTS_FILE).is_file():
    raise FileNotFoundError(2, "no weights", str(folder / WEIGHTS_FILE))
  return [WEIGHTS_FILE]


def _weight_shape_diffs(folder: pathlib.Path, files: list[str], cfg: ModelConfig) -> list[str]:
  """Each tensor this config needs that the weight files lack or hold in another shape."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  shapes = {}
  for name in files:
    with safe_open(str(folder / name), "numpy") as f:
      shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()})
  expected = hf_shapes(cfg)
  missing = [k for k in expected if k not in shapes]
  wrong = [f"{k} {list(shapes[k])} (this run: {list(v)})" for k, v in expected.items()
           if k in shapes and shapes[k] != v]
  return ([f"{len(missing)} tensors missing, e.g. {missing[:2]}"] if missing else []) + wrong[:3]
