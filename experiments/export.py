"""Writes a run's model as a Hugging Face Llama folder.

  python experiments/export.py --workdir=runs/tiny --out=exported/tiny
  python experiments/export.py --workdir=runs/noloco --out=exported/noloco_r1 --replica=1

The folder holds config.json (`LlamaForCausalLM`), model.safetensors (float32, Hugging Face's
parameter names and rotary layout) and the tokenizer's files (for the byte tokenizer, a note
`lowcomm_tokenizer.json`: byte-level, vocabulary 256). `transformers` loads it with
`LlamaForCausalLM.from_pretrained(out)`; `lowcomm_jax.models.hf_llama.read_folder(out)` reads it
back into this package's parameters. The model is the latest checkpoint's evaluated parameters
(the global φ for the DiLoCo family, the replicas' mean for NoLoCo) or `--replica=i`'s own.
"""

import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory with checkpoints.", required=True)
_OUT = flags.DEFINE_string("out", None, "New (or empty) directory for the model folder.",
                           required=True)
_REPLICA = flags.DEFINE_integer("replica", None, "Export this replica's own weights instead "
                                "of the evaluated model (NoLoCo: the replicas' mean).")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  from lowcomm_jax.models import hf_llama  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
  try:
    hf_llama.check_out_dir(_OUT.value, _WORKDIR.value)
    model_cfg, params, tokenizer = checkpoint.read_model(_WORKDIR.value, _REPLICA.value)
  except ValueError as error:
    sys.exit(f"ValueError: {error}")
  written = hf_llama.write_folder(_OUT.value, model_cfg, params, tokenizer)
  print(f"wrote {', '.join(written)} to {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
