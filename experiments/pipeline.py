"""Former entry point of pipeline runs: now `experiments/train.py` with a pipeline config.

  python experiments/pipeline.py --config=experiments/configs/noloco_pipeline.py --workdir=runs/nlp

does exactly `python experiments/train.py` with the same flags, after setting 8 fake CPU devices
(XLA_FLAGS) when none are set, so the (replica, stage) grid fits on a CPU machine. Pipeline runs
checkpoint and resume like every run: rerunning the command continues the run.
"""

import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import train  # pylint: disable=g-import-not-at-top
  train.flags.mark_flag_as_required("config")
  train.cli.run(train.main)
