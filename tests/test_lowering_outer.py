"""The lowering battery's second half: Streaming DiLoCo and SparseLoCo, whose outer gradients travel
overlapped (inline or on the communication thread) and encoded. The battery, its cross product and
its checks are in tests/test_lowering.py; two files, so that two test workers lower the halves side
by side."""

import pytest
import test_lowering as battery  # tests/ is on sys.path (pytest's rootdir-relative import)


def test_the_halves_cover_every_algorithm():
  assert sorted(battery.FIRST_HALF + battery.SECOND_HALF) == sorted(battery.ALGORITHMS)


@pytest.mark.parametrize("platform", battery.PLATFORMS)
def test_every_step_program_lowers(platform):
  battery.check_battery(platform, battery.SECOND_HALF)


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tensor"])
def test_streaming_send_step_holds_mosaic_gpu_kernels(layout):
  """The Trainer's Streaming DiLoCo send step (e3m0, `auto`) lowered for cuda on an H100 holds
  Mosaic GPU's custom calls and no Triton call, on every jax version the battery runs (the battery's
  own lowering of the step, shared)."""
  assert battery.KERNEL_MARK["cuda"] == battery.KERNEL_TARGETS["mosaic_gpu"]
  combination = battery.Combination("streaming_diloco", "replicas", "e3m0", "inline", layout)
  trainer, _ = battery.trainer_of(combination)
  lowered = battery._battery(battery.SECOND_HALF)  # pylint: disable=protected-access
  sends = [key for key, _, send in battery.programs_of(combination, trainer) if send]
  assert sends
  for key in sends:
    # An int: the Mosaic GPU calls counted, no other GPU kernel's call in the module (kernel_calls).
    assert isinstance(lowered[key]["cuda"], int) and lowered[key]["cuda"] > 0, lowered[key]
