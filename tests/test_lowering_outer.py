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
