"""Samples text from a run's model.

  python experiments/generate.py --workdir=runs/tiny --prompt="def main(" --max_new_tokens=200
  python experiments/generate.py --workdir=runs/noloco --prompt="The " --replica=1 \
      --temperature=0.8 --top_k=40 --top_p=0.95 --seed=3

The model is the latest checkpoint's evaluated parameters: the global model φ for the DiLoCo family,
the replicas' mean slow weights for NoLoCo (or `--replica=i`: replica i's own weights), the trained
parameters for data parallel. The prompt is encoded with the run's tokenizer (`data.tokenizer`);
decoding is one jitted program with a key/value cache (`lowcomm_jax.models.decode`).
"""

import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory with checkpoints.", required=True)
_PROMPT = flags.DEFINE_string("prompt", "", "Text the samples continue.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 100, "Tokens to sample after the prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Divides the logits; 0 is greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0: all.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus: the most likely tokens of probability >= p.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the draws; the same seed gives the same text.")
_NUM = flags.DEFINE_integer("num_samples", 1, "Samples of the same prompt (one batch).")
_REPLICA = flags.DEFINE_integer("replica", None, "Sample from this replica's own weights instead "
                                "of the evaluated model (NoLoCo: the replicas' mean).")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  import numpy as np  # pylint: disable=g-import-not-at-top

  from lowcomm_jax.models import decode  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
  try:
    sampling = decode.Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
    decode.check_sampling(sampling)
    if _NUM.value < 1:
      raise ValueError(f"--num_samples must be an integer >= 1, got {_NUM.value}")
    model_cfg, params, tokenizer = checkpoint.read_model(_WORKDIR.value, _REPLICA.value)
    prompt = np.asarray(tokenizer.encode(_PROMPT.value), np.int32)
    decode.check_length(model_cfg, len(prompt), _MAX_NEW.value)
  except ValueError as error:
    sys.exit(f"ValueError: {error}")
  tokens = decode.generate(model_cfg, params, np.tile(prompt, (_NUM.value, 1)), _MAX_NEW.value,
                           sampling, _SEED.value)
  for i, row in enumerate(tokens):
    if _NUM.value > 1:
      print(f"--- sample {i}")
    print(tokenizer.decode(row), flush=True)


if __name__ == "__main__":
  app.run(main)
