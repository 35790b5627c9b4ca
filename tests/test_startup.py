"""The Trainer's start-up line and warnings (`train.startup`)."""

import jax
import pytest

from lowcomm_jax.models import config as model_config
from lowcomm_jax.testing import tiny_config
from lowcomm_jax.train import Trainer


def test_the_line_names_model_parameters_mesh_tokens_algorithm_and_workdir(tmp_path):
  config = tiny_config(**{"algorithm": "diloco", "num_replicas": 2, "mesh.replica": 2,
                          "outer.sync_every": 4, "optimizer.accumulation_steps": 2,
                          "data.batch_size": 16})
  trainer = Trainer(config, tmp_path / "run")
  line, *warnings = trainer.startup_report()
  params = model_config.param_count(model_config.PRESETS["tiny"])
  assert f"model tiny (2 layers, d_model 32, {params:,} parameters)" in line
  assert "mesh replica=2 data=4 tensor=1 stage=1 on 8 cpu devices" in line
  # 2 replicas × 16 sequences × 64 tokens
  assert "2,048 tokens per step (2 replicas × 16 sequences × 64 tokens, in 2 micro-batches)" in line
  assert "algorithm diloco, gradients replicas" in line
  assert line.endswith(f"workdir {(tmp_path / 'run').absolute()}")
  assert not warnings
  assert not (tmp_path / "run").exists()  # reported before anything is written


def test_the_line_names_what_encodes_the_outer_gradients(tmp_path):
  """With a codec on the wire the algorithm's part names the kernel that encodes it
  (`codecs.kernel_choice`); on CPU `auto` is the jnp reference, `pallas_triton` its body
  interpreted."""
  for mode, kernel in (("auto", "reference"), ("pallas_triton", "pallas_interpret_triton")):
    config = tiny_config(**{"algorithm": "streaming_diloco", "num_replicas": 2, "mesh.replica": 2,
                            "outer.sync_every": 4, "outer.codec": "e3m0",
                            "outer.codec_kernels": mode})
    line = Trainer(config, tmp_path / mode).startup_report()[0]
    assert f"| algorithm streaming_diloco, gradients replicas, codec e3m0 by {kernel} |" in line


@pytest.mark.parametrize("layout,mesh_data,warned", [("fsdp", 1, True), ("fsdp", 8, False),
                                                     ("tensor", 8, True), ("replicated", 1, False)])
def test_a_layout_that_shards_nothing_is_named(tmp_path, layout, mesh_data, warned):
  trainer = Trainer(tiny_config(**{"sharding.layout": layout, "mesh.data": mesh_data}), tmp_path)
  warnings = trainer.startup_report()[1:]
  assert bool(warnings) == warned
  if warned:
    assert f"sharding.layout='{layout}' shards no parameter on this mesh" in warnings[0]


def test_a_mesh_larger_than_the_cpu_devices_says_how_to_get_them(tmp_path):
  with pytest.raises(ValueError) as error:
    Trainer(tiny_config(**{"mesh.data": 4}), tmp_path, devices=jax.devices()[:2])
  assert "needs 4 devices but 2 are available" in str(error.value)
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in str(error.value)
