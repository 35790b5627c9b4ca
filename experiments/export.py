"""Writes a run's model as a Hugging Face Llama folder.

  python experiments/export.py --workdir=runs/tiny --out=exported/tiny
  python experiments/export.py --workdir=runs/noloco --out=exported/noloco_r1 --replica=1

The folder holds config.json (`LlamaForCausalLM`), generation_config.json, model.safetensors
(float32, Hugging Face's parameter names and rotary layout), the tokenizer (tokenizer.json, or a
SentencePiece tokenizer.model; the byte tokenizer as a tokenizer.json of the same ids) and
tokenizer_config.json, whose eos token is the document separator the run trained with, so that
generation stops at a document's end. `transformers` loads it with
`LlamaForCausalLM.from_pretrained(out)` and `AutoTokenizer.from_pretrained(out)`;
`init_from=hf:<out>` starts a run from it. The model is the latest checkpoint's evaluated
parameters (the global φ for the DiLoCo family, the replicas' mean for NoLoCo) or `--replica=i`'s
own. `--out` must be a new path outside the run directory: the folder is written beside it and
renamed into place.
"""

import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory with checkpoints.", required=True)
_OUT = flags.DEFINE_string("out", None, "New path for the model folder (outside the run "
                           "directory).", required=True)
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
    written = hf_llama.write_folder(_OUT.value, model_cfg, params, tokenizer)
  except ValueError as error:
    sys.exit(f"ValueError: {error}")
  print(f"wrote {', '.join(written)} to {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
