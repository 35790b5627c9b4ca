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
import pathlib
import shutil

import numpy as np

from lowcomm_jax.models.config import ModelConfig

WEIGHTS_FILE = "model.safetensors"


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
               norm_eps=float(hf.get("rms_norm_eps", 1e-5)))
  cfg = ModelConfig(**{**shape, **overrides})
  if hf.get("head_dim", cfg.head_dim) != cfg.head_dim:
    raise ValueError(f"head_dim {hf['head_dim']} != hidden_size / num_attention_heads")
  return cfg


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
  missing = [n for n in to_hf_names(cfg) if n not in tensors]
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


def to_hf_names(cfg: ModelConfig) -> list[str]:
  per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
               "self_attn.k_proj",
               "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj"]
  return (["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
          + [f"model.layers.{i}.{n}.weight" for i in range(cfg.num_layers) for n in per_layer])


def _at(tree, keys):
  for key in keys:
    tree = tree[key]
  return tree


def check_out_dir(out, workdir=None) -> pathlib.Path:
  """The export folder: new or empty, and not inside the run directory it is exported from."""
  out = pathlib.Path(out)
  if not str(out):
    raise ValueError("--out must name a directory, got an empty path")
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise ValueError(f"--out={str(out)!r} exists and is not an empty directory; give a new one")
  if workdir is not None and out.absolute().is_relative_to(pathlib.Path(workdir).absolute()):
    raise ValueError(f"--out={str(out)!r} is inside the run directory; give a directory outside it")
  return out


def write_folder(out, cfg: ModelConfig, params: dict, tokenizer) -> list[str]:
  """Writes the model folder (config.json, model.safetensors, the tokenizer's files) into `out`
  (new or empty); returns the names written."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  out = check_out_dir(out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
  save_file(to_hf(params, cfg), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
  written = ["config.json", WEIGHTS_FILE]
  files = list(tokenizer.files())
  for path in files:
    shutil.copy(path, out / pathlib.Path(path).name)
    written.append(pathlib.Path(path).name)
  if not files:  # a tokenizer defined by rule, not by files: say which rule
    note = {"tokenizer": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size,
            "encoding": "byte-level: token id = UTF-8 byte value (0..255), no special tokens; "
                        "training streams separate documents with id 0"}
    (out / "lowcomm_tokenizer.json").write_text(json.dumps(note, indent=2) + "\n")
    written.append("lowcomm_tokenizer.json")
  return written


def read_folder(folder, **overrides) -> tuple[ModelConfig, dict]:
  """(our ModelConfig, our parameters) of a Llama folder (config.json + model.safetensors)."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  folder = pathlib.Path(folder)
  cfg = model_config_from_hf(json.loads((folder / "config.json").read_text()), **overrides)
  return cfg, from_hf(load_file(str(folder / WEIGHTS_FILE)), cfg)
