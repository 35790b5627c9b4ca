"""The lowering battery: the step programs lower for GPU (`cuda`) and TPU (`tpu`).

The cross product is every algorithm × gradient source × codec × executor × layout
(`cross_product`); the Trainer's constructor decides which combinations are allowed. On this CPU
host, with what a GPU or TPU host would pick (`outer.codec_kernels=auto`: the compiled Pallas
kernels, on cuda the GPU kernel the codecs pick for an H100 with this jax version, Mosaic on tpu;
`model.layer_loop=scan`), each allowed combination's Trainer gives its step programs (one per
distinct phase and routing), and with `outer.overlap_executor=thread` also the programs the thread
runs (the algorithm's plan through `comm.dispatch.over_replicas`). A program is traced and
lowered once per key (`programs_of`). The tests lower an all-pairs subset (`covering`); `--lower`
lowers every one. A program that sends a codec-encoded fragment holds the compiled kernels (their
custom calls, by target name, and no other GPU kernel's; not the jnp reference) and one that sends
nothing holds none. The codec kernels alone are lowered for an abstract H100 and A100 in each
`outer.codec_kernels` mode (`codec_kernel_rows`). `python tests/test_lowering.py --write-table`
rewrites the table in docs/accelerators.md from the enumeration
(`test_table_in_docs_is_the_enumeration` keeps the two equal), `--write-kernel-table` this jax
version's rows of the GPU kernel table; `--lower` lowers outside pytest. `jax.export` exports the
dp and Streaming DiLoCo steps for each platform.

Lowering for cuda on a CPU host needs an abstract GPU device from jax 0.11 on (Triton reads the
target from the abstract mesh), and the codecs pick their GPU kernel by it: the programs are
traced under an abstract mesh with the Trainer's axes and an H100 device (`mesh.tracing` keeps it).
"""
import argparse
import collections
import contextlib
import functools
import itertools
import os
import pathlib
import re
import sys
import tempfile
import time
from typing import NamedTuple

if __name__ == "__main__":  # as the tests run it (tests/conftest.py)
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest
from jaxlib.mlir import ir

from lowcomm_jax import codecs, comm, config as config_lib, mesh as mesh_lib
from lowcomm_jax.codecs import kernels
from lowcomm_jax.comm import dispatch
from lowcomm_jax.train import Trainer, overlap

PLATFORMS = ("cuda", "tpu")
# The custom call each compiled Pallas kernel lowers to (its target name in the module).
KERNEL_TARGETS = {"mosaic_gpu": "mosaic_gpu_v2", "triton": "__gpu$xla.gpu.triton",
                  "tpu": "tpu_custom_call"}
# The abstract GPUs programs are lowered for: a Hopper and an Ampere (Mosaic GPU compiles for
# Hopper and newer, and for Ampere from jax 0.11).
GPUS = {"H100": "NVIDIA H100 80GB HBM3", "A100": "NVIDIA A100-SXM4-80GB"}
GPU = GPUS["H100"]


def abstract_gpu(kind: str = GPU):
  return jax.sharding.AbstractDevice(kind, platform="gpu", num_cores=None)


# What the battery's programs hold, per platform: on cuda the kernel the codecs pick for an H100
# with this jax version (`kernels.gpu_kernel`).
KERNEL_MARK = {"cuda": KERNEL_TARGETS[kernels.gpu_kernel(abstract_gpu())],
               "tpu": KERNEL_TARGETS["tpu"]}
_GPU_TARGETS = (KERNEL_TARGETS["mosaic_gpu"], KERNEL_TARGETS["triton"])


def custom_calls(module_text: str) -> collections.Counter:
  """The custom calls of a lowered module (StableHLO text), by target name."""
  return collections.Counter(re.findall(r"stablehlo\.custom_call @([\w$.]+)\(", module_text))


def module_custom_calls(lowered) -> collections.Counter:
  """`custom_calls` of a `jax.stages.Lowered`, read from its MLIR module's operations (nested
  regions included) rather than from its text: printing a module with compiled kernels (their
  serialized code in attributes) costs several times the walk."""
  calls = collections.Counter()

  def visit(op):
    if op.name == "stablehlo.custom_call":
      calls[ir.StringAttr(op.attributes["call_target_name"]).value] += 1
    return ir.WalkResult.ADVANCE

  lowered.compiler_ir().operation.walk(visit)
  return calls


def kernel_calls(calls: collections.Counter, platform: str):
  """The compiled kernels' calls among a module's custom calls (`custom_calls`) lowered for
  `platform`, or a failure line where it holds another GPU kernel's (a Triton call beside Mosaic
  GPU's, say)."""
  foreign = {t: calls[t] for t in _GPU_TARGETS if t != KERNEL_MARK[platform] and calls[t]}
  if foreign:
    return f"holds other GPU kernels: {foreign}"
  return calls[KERNEL_MARK[platform]]
LAYOUTS = ("replicated", "fsdp", "tensor", "fsdp_tensor")
CODECS = ("e3m0", "e2m1", "int4", "int8")


def _config(algorithm, gradients="replicas", layout="replicated", codec="none", executor="inline",
            **extra):
  replicas = 1 if algorithm == "dp" else 2
  c = config_lib.default_config()
  changes = {
      "algorithm": algorithm, "gradients": gradients, "num_replicas": replicas,
      "model.size": "tiny", "model.layer_loop": "scan", "num_steps": 8, "data.seq_len": 16,
      "data.batch_size": 4, "eval.batch_size": 4, "sharding.layout": layout,
      "outer.sync_every": 2, "outer.codec": codec, "outer.codec_block_size": 256,
      "outer.codec_kernels": "auto", "outer.overlap_executor": executor,
      "noloco.sync_every": 2, "noloco.num_groupings": 1,
      "mesh.replica": replicas, "mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 1,
  }
  if algorithm == "streaming_diloco":  # one fragment (embeddings folded in), τ = 1, α = 0.5
    changes.update({"outer.non_block_fragment": "fold", "outer.overlap_steps": 1,
                    "outer.merge_alpha": 0.5})
  if algorithm == "sparseloco":  # its own wire format (top-k, 2 bits); τ = 1, α = 0.5
    changes.update({"outer.codec": "none", "outer.overlap_steps": 1, "outer.merge_alpha": 0.5,
                    "outer.non_block_fragment": "fold", "sparseloco.chunk_size": 64,
                    "sparseloco.top_k": 4})
  if algorithm == "noloco":  # NoLoCo's own codec (its gossip), the outer section's stays none
    changes.update({"outer.codec": "none", "noloco.codec": codec, "noloco.codec_block_size": 256})
  if gradients == "skippipe":
    changes.update({"skippipe.paths": "0-1,0-1", "pipeline.num_stages": 2})
  if gradients == "pipeline":
    changes.update({"pipeline.num_stages": 2, "pipeline.num_routings": 1, "mesh.data": 1,
                    "mesh.tensor": 1, "mesh.stage": 2})
  changes.update(extra)
  return config_lib.override(c, changes)


ALGORITHMS = ("dp", "diloco", "streaming_diloco", "noloco", "sparseloco")
SOURCES = ("replicas", "skippipe", "pipeline")
EXECUTORS = ("inline", "thread")


class Combination(NamedTuple):
  """One point of the battery's cross product (`extra`: further config changes, as `key=value`)."""
  algorithm: str
  gradients: str
  codec: str
  executor: str
  layout: str
  extra: tuple = ()

  @property
  def name(self) -> str:
    return "/".join(self[:5]) + "".join(f", {k}={v}" for k, v in self.extra)

  def config(self):
    return _config(self.algorithm, self.gradients, self.layout, self.codec, self.executor,
                   **dict(self.extra))


# Settings beyond the cross product: stochastic rounding with error feedback (a residual in the
# state, random bits into the kernels), the model's dot_product attention and dots remat.
EXTRAS = (
    Combination("streaming_diloco", "replicas", "e3m0", "inline", "fsdp_tensor",
                (("outer.codec_rounding", "stochastic"), ("outer.error_feedback", True))),
    Combination("streaming_diloco", "replicas", "e3m0", "thread", "fsdp_tensor",
                (("outer.codec_rounding", "stochastic"), ("outer.error_feedback", True))),
    Combination("dp", "replicas", "none", "inline", "fsdp_tensor",
                (("model.attention", "dot_product"),)),
    # A sequence of 128: TPU's flash attention kernel (Mosaic, under a shard_map over data and
    # tensor).
    Combination("dp", "replicas", "none", "inline", "fsdp_tensor",
                (("model.attention", "dot_product"), ("data.seq_len", 128))),
    # The same with replicas on their own mesh axis (a shard_map over `replica`, the flash kernel's
    # nested in it): the kernel's results typed as varying over `replica`, as XLA's attention's.
    Combination("diloco", "replicas", "none", "inline", "fsdp_tensor",
                (("model.attention", "dot_product"), ("data.seq_len", 128))),
    Combination("dp", "replicas", "none", "inline", "fsdp_tensor", (("model.remat", "dots"),)),
)


def cross_product() -> list[Combination]:
  """Every algorithm × gradient source × codec × executor × layout, then EXTRAS."""
  # SparseLoCo reads no codec (its payload is its own top-k format): codec none only.
  return [Combination(*c) for c in itertools.product(
      ALGORITHMS, SOURCES, ("none",) + CODECS, EXECUTORS, LAYOUTS)
          if c[0] != "sparseloco" or c[2] == "none"] + list(EXTRAS)


@functools.lru_cache(maxsize=None)
def trainer_of(combination: Combination):
  """(Trainer, None) for a combination the config allows, (None, the refusal's line) otherwise:
  the Trainer's constructor (the config's validation and its own checks) decides."""
  with tempfile.TemporaryDirectory() as workdir:
    try:
      return Trainer(combination.config(), workdir), None
    except ValueError as error:
      return None, str(error)


def _sends(phase) -> bool:
  """Whether a phase's program sends outer gradients (a fragment's mean, NoLoCo's gossip)."""
  return bool(getattr(phase, "send", ())) or bool(getattr(phase, "outer", False))


def _shardings(trainer) -> str:
  """The parameters' partition specs without the mesh axes of size 1 (which shard nothing)."""
  size = trainer.mesh.shape
  drop = lambda axes: tuple(
    a for a in (axes if isinstance(axes, tuple) else (axes,)) if size[a] > 1
  )
  return str(jax.tree.map(lambda spec: tuple(drop(axes) if axes else () for axes in spec),
                          trainer.param_specs,
                          is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))


def programs_of(combination: Combination, trainer) -> list:
  """(key, label, sends) of every distinct program of a run, with `key` the program's identity
  across combinations: a step's phase and routing, and of the combination what its program
  reads. The layout is read through the parameters' shardings on the mesh (on the pipeline's mesh,
  `data` = `tensor` = 1, every layout gives the same). A program that sends nothing does not read
  the codec (nor does dp's, which sends nothing ever); a step's program does not read the executor
  (the thread only takes the overlapped sends out of the phase); the thread's fragment program
  reads the codec, the parameters' shapes and shardings, and the mesh, not the gradient source.
  `test_programs_sharing_a_key_are_one` checks these on traced programs."""
  c = combination
  tx = getattr(trainer.algorithm, "tx", None)
  thread = trainer.overlap_executor == "thread"
  shardings = (_shardings(trainer), tuple(trainer.mesh.shape.items()))
  out = []
  for step in range(1, trainer.config.num_steps + 1):
    phase = trainer.algorithm.phase_at(step)
    if thread:
      phase = overlap.program_phase(tx.schedule.delay, phase)
    route = trainer.source.route_at(step)
    sends = _sends(phase)
    key = ("step", c.algorithm, c.gradients, c.codec if sends else "-", shardings, c.extra,
           phase, route)
    if key not in [k for k, *_ in out]:
      out.append((key, f"step {phase}" + (f" route {route}" if route is not None else ""), sends))
  if thread:
    for p in range(len(tx.schedule.delay)):
      out.append((("fragment", c.algorithm, trainer.model_cfg, c.codec, shardings, c.extra, p),
                  f"thread fragment {p}", True))
  return out


def _trace(key, trainer, state):
  """The jax Traced of the program `key` names (under the context the caller set)."""
  if key[0] == "step":
    phase, route = key[-2:]
    return trainer._jit_step((phase, route), state).trace(state, trainer._abstract_batch())
  # As the thread submits it: the algorithm's plan with its `local` tree (and the residual with
  # error feedback, a key with stochastic rounding), carried by `dispatch.over_replicas`.
  tx, p = trainer.algorithm.tx, key[-1]
  name = tx.plan_name(p)
  phase = next(ph for ph in tx.phases if name in tx.plans(ph))
  plan = tx.plans(phase)[name]
  trees, residuals = jax.jit(overlap.local_trees(tx, phase, (name,))).eval_shape(
    state.params, state.opt_state)
  rng = None if dispatch.plan_key(plan, 0) is None else jax.eval_shape(
    lambda: dispatch.plan_key(plan, 0))
  return jax.jit(dispatch.over_replicas(plan, name, tx.axis_name)).trace(
    trees[name], residuals.get(name), rng)


def _target(platform: str, mesh, kind: str = GPU):
  """What lowering for `platform` on this host needs: for cuda an abstract mesh with the Trainer's
  axes and a GPU device (from jax 0.11 Triton reads its target there, and the codecs pick their
  GPU kernel by it)."""
  if platform != "cuda":
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
      tuple(mesh.axis_sizes), tuple(mesh.axis_names), axis_types=tuple(mesh.axis_types),
      abstract_device=abstract_gpu(kind)))


def kernels_expected(combination: Combination, sends: bool, platform: str | None = None) -> bool:
  """Whether a program holds compiled kernels: the codec's where it sends a codec-encoded fragment
  (NoLoCo's gossip encodes with the jnp reference on every platform); for tpu (or any platform,
  `None`) also TPU flash attention, with `model.attention=dot_product` on a multiple of 128
  tokens."""
  extra = dict(combination.extra)
  flash = (platform in ("tpu", None) and extra.get("model.attention") == "dot_product"
           and extra.get("data.seq_len", 16) % 128 == 0)
  return flash or (sends and combination.codec != "none" and combination.algorithm != "noloco")


def allowed(algorithms=None) -> list[Combination]:
  """The allowed combinations (of `algorithms` only, when given)."""
  return [c for c in cross_product()
          if (algorithms is None or c.algorithm in algorithms) and trainer_of(c)[0] is not None]


# The battery in two halves of about equal cost, this file's and tests/test_lowering_outer.py's, so
# that two test workers lower them side by side.
FIRST_HALF = ("dp", "diloco", "noloco")
SECOND_HALF = ("streaming_diloco", "sparseloco")
# Lowered by every battery, whatever the covering picks: the sends other tests name.
ALWAYS = (Combination("streaming_diloco", "replicas", "e3m0", "inline", "fsdp"),
          Combination("streaming_diloco", "replicas", "e3m0", "inline", "fsdp_tensor"))


def value_pairs(combination: Combination) -> set:
  """Every pair of the combination's values of two factors (algorithm, gradient source, codec,
  executor, layout), with the values its programs read: dp sends nothing, so reads no codec."""
  values = list(combination[:5])
  if combination.algorithm == "dp":
    values[2] = "-"
  return {(i, values[i], j, values[j]) for i, j in itertools.combinations(range(5), 2)}


def covering(combinations) -> list[Combination]:
  """All pairs: a subset of `combinations` in which every pair of values of two factors that one of
  them holds is held by one chosen (greedy: the combination holding most pairs not held yet, the
  first in order among equals), with EXTRAS and ALWAYS. A program that fails to lower does so for
  a factor's value or for two values together; the whole cross product (`--lower`) lowers the
  rest."""
  chosen = [c for c in combinations if c.extra or c in ALWAYS]
  todo = set().union(*map(value_pairs, combinations)) - set().union(*map(value_pairs, chosen))
  rest = [c for c in combinations if c not in chosen]
  while todo:
    best = max(rest, key=lambda c: len(value_pairs(c) & todo))
    chosen.append(best)
    rest.remove(best)
    todo -= value_pairs(best)
  return chosen


def lower_programs(combinations) -> dict:
  """{program key: {platform: kernels in its module, or the error}} of the combinations' distinct
  programs. Each is traced once, by the first combination that has it, under the GPU abstract mesh
  (which lowering for tpu ignores); a program with kernels is lowered for each platform on its own,
  one without for both at once."""
  lowered = {}
  for combination in combinations:
    trainer, _ = trainer_of(combination)
    todo = [(key, sends) for key, _,
            sends in programs_of(combination, trainer) if key not in lowered]
    if not todo:
      continue
    state = trainer.abstract_state()
    with _target("cuda", trainer.mesh), mesh_lib.tracing(trainer.mesh), comm.Ledger().recording():
      for key, sends in todo:
        try:
          traced = _trace(key, trainer, state)
        except Exception as error:  # pylint: disable=broad-except
          lowered[key] = {p: f"trace: {type(error).__name__}: {error}"[:400] for p in PLATFORMS}
          continue
        together = () if kernels_expected(combination, sends) else (PLATFORMS,)
        lowered[key] = {}
        for platforms in together or [(p,) for p in PLATFORMS]:
          try:
            calls = module_custom_calls(traced.lower(lowering_platforms=platforms))
            lowered[key].update({p: kernel_calls(calls, p) for p in platforms})
          except Exception as error:  # pylint: disable=broad-except
            lowered[key].update({p: f"{type(error).__name__}: {error}"[:400] for p in platforms})
  return lowered


@functools.lru_cache(maxsize=None)
def _battery(algorithms: tuple):
  return lower_programs(covering(allowed(algorithms)))


def check_lowered(combinations, lowered) -> list[str]:
  """The failures: a program that did not lower, a program with kernels where none belong or
  without them where they do."""
  failures = []
  for combination in combinations:
    trainer, _ = trainer_of(combination)
    for key, label, sends in programs_of(combination, trainer):
      for platform, kernels in lowered[key].items():
        if isinstance(kernels, str):
          failures.append(f"{combination.name}: {label} ({platform}): {kernels}")
        elif (kernels > 0) != kernels_expected(combination, sends, platform):
          failures.append(f"{combination.name}: {label} ({platform}): {kernels} kernel calls")
  return failures


def check_battery(platform: str, algorithms: tuple) -> None:
  """The allowed combinations of `algorithms` that hold every pair of two factors' values
  (`covering`) lower for `platform`, each program with the compiled kernels where it sends a
  codec-encoded fragment (or runs TPU flash attention) and in no other."""
  lowered = {key: {platform: result[platform]} for key, result in _battery(algorithms).items()}
  failures = check_lowered(covering(allowed(algorithms)), lowered)
  assert not failures, "\n".join(failures)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_every_step_program_lowers(platform):
  """The battery's first half (`FIRST_HALF`; the second: tests/test_lowering_outer.py)."""
  check_battery(platform, FIRST_HALF)


@pytest.mark.parametrize("first, second", [
    # A program that sends nothing does not read the codec.
    (Combination("streaming_diloco", "replicas", "none", "inline", "fsdp"),
     Combination("streaming_diloco", "replicas", "int4", "inline", "fsdp")),
    # dp sends nothing ever.
    (Combination("dp", "skippipe", "none", "inline", "tensor"),
     Combination("dp", "skippipe", "e2m1", "inline", "tensor")),
    # A step's program does not read the executor: the thread takes the overlapped sends out.
    (Combination("streaming_diloco", "replicas", "e3m0", "thread", "fsdp_tensor"),
     Combination("streaming_diloco", "replicas", "e3m0", "inline", "fsdp_tensor")),
    # The layouts on the pipeline's mesh.
    (Combination("diloco", "pipeline", "int8", "inline", "replicated"),
     Combination("diloco", "pipeline", "int8", "inline", "fsdp_tensor")),
    # The thread's fragment program, whichever source computed the gradients.
    (Combination("streaming_diloco", "replicas", "int4", "thread", "fsdp"),
     Combination("streaming_diloco", "skippipe", "int4", "thread", "fsdp")),
], ids=["codec", "dp codec", "executor", "pipeline layout", "fragment source"])
def test_programs_sharing_a_key_are_one(first, second):
  """Two combinations' programs with the same key (`programs_of`) lower to the same module (the
  jaxpr, its shardings, its kernels), so lowering one of them lowers the other."""
  trainers = [trainer_of(c)[0] for c in (first, second)]
  keys = [{key for key, _, _ in programs_of(c, t)} for c, t in zip((first, second), trainers)]
  shared = keys[0] & keys[1]
  assert shared
  for key in shared:
    texts = []
    for trainer in trainers:
      state = trainer.abstract_state()
      with mesh_lib.tracing(trainer.mesh):
        texts.append(_trace(key, trainer, state).lower(lowering_platforms=("tpu",)).as_text())
    assert texts[0] == texts[1], key


DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "accelerators.md"
TABLE_BEGIN, TABLE_END = "<!-- lowering-table: python tests/test_lowering.py --write-table -->", \
    "<!-- /lowering-table -->"


def _values(values, every) -> str:
  values = [v for v in every if v in values]
  return "every one" if len(values) == len(every) > 1 else ", ".join(values)


def table() -> str:
  """The cross product as a markdown table: a row per algorithm, gradient source, executor and
  verdict (the refusal's reason, or the distinct programs)."""
  every_key, groups = set(), {}
  for c in cross_product():
    trainer, refusal = trainer_of(c)
    verdict = refusal.split(";")[0] if refusal else ""
    group = groups.setdefault((c.algorithm, c.gradients, c.executor, c.extra, verdict),
                              {"codecs": set(), "layouts": set(), "keys": set(), "kernels": False,
                               "count": 0})
    group["codecs"].add(c.codec)
    group["layouts"].add(c.layout)
    group["count"] += 1
    if trainer is not None:
      for key, _, sends in programs_of(c, trainer):
        group["keys"].add(key)
        group["kernels"] |= kernels_expected(c, sends, "cuda")
        group["flash"] = kernels_expected(c, sends, "tpu") and not kernels_expected(
          c, sends, "cuda"
        )
  lines = ["| algorithm | gradients | executor | codecs | layouts | combinations | distinct "
           "programs | cuda and tpu |", "|---" * 8 + "|"]
  for (algorithm, gradients, executor, extra, verdict), g in groups.items():
    every_key |= g["keys"]
    setting = "".join(f", `{k}={v}`" for k, v in extra)
    if verdict:
      result, programs = f"refused: {verdict}", "–"
    else:
      result = ("lowers, kernels in the send programs" if g["kernels"] else
                "lowers, TPU flash attention kernels (tpu)" if g.get("flash") else "lowers")
      programs = str(len(g["keys"]))
    lines.append(f"| {algorithm}{setting} | {gradients} | {executor} | "
                 f"{_values(g['codecs'], ('none',) + CODECS)} | {_values(g['layouts'], LAYOUTS)} | "
                 f"{g['count']} | {programs} | {result} |")
  combinations = cross_product()
  refused = sum(trainer_of(c)[0] is None for c in combinations)
  lines.append("")
  lines.append(f"{len(combinations)} combinations: {len(combinations) - refused} "
               f"allowed, {refused} refused; {len(every_key)} distinct programs.")
  return "\n".join(lines)


def _docs_table() -> str:
  text = DOCS.read_text()
  return text[text.index(TABLE_BEGIN) + len(TABLE_BEGIN):text.index(TABLE_END)].strip()


def test_table_in_docs_is_the_enumeration():
  """docs/accelerators.md's table is `table()` (rewrite it with `--write-table`)."""
  assert _docs_table() == table()


# The codec kernels on each abstract GPU, lowered for cuda: every codec, a tensor whose size is a
# multiple of the block (256) and one that is not (the last block padded), rounding to nearest, and
# e3m0 rounding stochastically; each case one encode and one decode kernel.
KERNEL_CASES = tuple((codec, "nearest", size) for codec in CODECS for size in (768, 805)) + (
    ("e3m0", "stochastic", 805),)
GPU_MODES = ("pallas", "pallas_mosaic_gpu", "pallas_triton")  # `auto` picks as `pallas` on cuda
_KERNEL_NAMES = {"mosaic_gpu": "Mosaic GPU", "triton": "Triton"}


def _codec_kernels_module(kind: str, gpu: str) -> str:
  """The module of every KERNEL_CASES encode and decode with the `gpu` kernel, lowered for cuda
  on the abstract GPU `kind`."""
  def every_case(key):
    out = []
    for i, (name, rounding, size) in enumerate(KERNEL_CASES):
      codec = codecs.get_codec(name, block_size=256, rounding=rounding)
      options = dict(use_pallas=True, interpret=False, gpu=gpu)
      encoded = codec.encode(jax.numpy.ones((size,)), jax.random.fold_in(key, i), **options)
      out.append(codec.decode(encoded, **options))
    return out

  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=abstract_gpu(kind))
  with jax.sharding.use_abstract_mesh(mesh):
    key = jax.eval_shape(lambda: jax.random.key(0))
    return jax.jit(every_case).trace(key).lower(lowering_platforms=("cuda",)).as_text()


@functools.lru_cache(maxsize=None)
def codec_kernel_rows() -> dict:
  """{(GPU, mode): (the GPU kernel, its custom calls by target) or the refusal's line} for each
  abstract GPU of GPUS and each of GPU_MODES, on this jax version. A kernel's module is lowered
  once, `pallas` reading the forced mode's of the kernel it picks."""
  rows, modules = {}, {}
  for name, kind in GPUS.items():
    for mode in GPU_MODES:
      try:
        options = codecs.kernel_options(mode, codecs.get_codec("e3m0", block_size=256), "cuda",
                                        abstract_gpu(kind))
      except ValueError as error:
        rows[name, mode] = str(error)
        continue
      gpu = options["gpu"] or kernels.gpu_kernel(abstract_gpu(kind))
      if (kind, gpu) not in modules:
        calls = custom_calls(_codec_kernels_module(kind, gpu))
        modules[kind, gpu] = {t: calls[t] for t in _GPU_TARGETS}
      rows[name, mode] = (gpu, modules[kind, gpu])
  return rows


@pytest.mark.parametrize("name", GPUS)
def test_codec_kernels_lower_for_cuda_with_each_gpu_kernel(name):
  """On each abstract GPU, every mode that is not refused lowers every codec and size to its GPU
  kernel's custom calls, an encode and a decode per case, and no other GPU kernel's; Triton is
  never refused while jax has it, and Mosaic GPU is refused only on an Ampere before jax 0.11."""
  rows = {mode: verdict for (gpu_name, mode), verdict in codec_kernel_rows().items()
          if gpu_name == name}
  for mode, verdict in rows.items():
    if isinstance(verdict, str):
      assert verdict.startswith(f"outer.codec_kernels={mode}: "), verdict
      continue
    gpu, calls = verdict
    assert calls == {t: (2 * len(KERNEL_CASES) if t == KERNEL_TARGETS[gpu] else 0)
                     for t in _GPU_TARGETS}, (mode, calls)
  assert not isinstance(rows["pallas_triton"], str)
  old_jax = tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 11)
  assert isinstance(rows["pallas_mosaic_gpu"], str) == (name == "A100" and old_jax)
  # `pallas` (and `auto`) picks Mosaic GPU wherever it is not refused.
  assert rows["pallas"][0] == ("triton" if isinstance(rows["pallas_mosaic_gpu"], str) else
                               "mosaic_gpu")


KERNEL_TABLE_BEGIN = "<!-- kernel-table: python tests/test_lowering.py --write-kernel-table -->"
KERNEL_TABLE_END = "<!-- /kernel-table -->"
KERNEL_TABLE_HEAD = ("| jax | GPU | `auto`, `pallas` | `pallas_mosaic_gpu` | `pallas_triton` |\n"
                     "|---|---|---|---|---|")


def kernel_table_rows() -> list[str]:
  """This jax version's rows of the table of GPU kernels in docs/accelerators.md."""
  def cell(verdict):
    if isinstance(verdict, str):
      return "refused: " + verdict.split(": ", 1)[1].split("; use ")[0]
    gpu, calls = verdict
    return f"{_KERNEL_NAMES[gpu]} ({calls[KERNEL_TARGETS[gpu]]} `{KERNEL_TARGETS[gpu]}` calls)"
  rows = codec_kernel_rows()
  return [f"| {jax.__version__} | {name} | "
          + " | ".join(cell(rows[name, mode]) for mode in GPU_MODES) + " |" for name in GPUS]


def _docs_kernel_table() -> list[str]:
  text = DOCS.read_text()
  start = text.index(KERNEL_TABLE_BEGIN) + len(KERNEL_TABLE_BEGIN)
  table = text[start:text.index(KERNEL_TABLE_END)]
  return [line for line in table.strip().splitlines()[2:] if line.startswith("|")]


def test_kernel_table_in_docs_holds_this_jax_versions_rows():
  """docs/accelerators.md's table of GPU kernels holds this jax version's rows as the battery
  lowers them (rewrite them with `--write-kernel-table`, on each jax version)."""
  assert set(kernel_table_rows()) <= set(_docs_kernel_table()), "\n".join(kernel_table_rows())


def _send_phase(trainer):
  """The phase of the first step that sends a fragment, else the first step's."""
  phases = [trainer.algorithm.phase_at(step) for step in range(1, trainer.config.num_steps + 1)]
  return next((p for p in phases if getattr(p, "send", ())), phases[0])


@pytest.mark.parametrize("algorithm", ["dp", "streaming_diloco"])
def test_export_for_gpu_and_tpu(algorithm):
  """`jax.export` of a step, once per platform (a module for several platforms would lower each
  platform's kernel for every platform, which Triton and Mosaic refuse)."""
  codec = "e3m0" if algorithm == "streaming_diloco" else "none"
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer(_config(algorithm, layout="fsdp_tensor", codec=codec), workdir)
  state = trainer.abstract_state()
  phase = _send_phase(trainer)
  for platform in PLATFORMS:
    with _target(platform, trainer.mesh), mesh_lib.tracing(trainer.mesh):
      # The kernels' custom calls carry no cross-version guarantee: the export says it accepts that.
      exported = jax.export.export(
          trainer._jit_step((phase, None), state), platforms=(platform,),
          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(KERNEL_MARK[platform])])(
              state, trainer._abstract_batch())
    assert exported.platforms == (platform,)
    assert len(exported.mlir_module_serialized) > 0
    assert (KERNEL_MARK[platform] in exported.mlir_module()) == (codec != "none")


def _kernel_maps(jaxpr):
  """The `shard_map`s of a closed jaxpr (nested ones included) that run a Pallas kernel."""
  out = []
  for eqn in jaxpr.eqns:
    subs = [v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
    subs += [b for v in eqn.params.values() if isinstance(v, tuple) for b in v
             if hasattr(b, "eqns") or hasattr(b, "jaxpr")]
    for sub in subs:
      sub = getattr(sub, "jaxpr", sub)
      if eqn.primitive.name == "shard_map" and "pallas_call" in str(sub):
        out.append(eqn)
      out += _kernel_maps(sub)
  return out


def test_vmapped_replicas_encode_where_they_live():
  """With 1 < mesh.replica < M the step vmaps the M stacked replicas, sharded over `replica`: the
  codec kernels' `shard_map` takes each replica's Δ over `replica` (its leading axis mapped), not
  Δ replicated, which would all-gather every replica's Δ onto every device before encoding."""
  config = config_lib.override(_config("streaming_diloco", layout="fsdp_tensor", codec="e3m0"), {
      "num_replicas": 4, "mesh.replica": 2, "outer.codec_kernels": "pallas"})
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer(config, workdir)
  state = trainer.abstract_state()
  phase = _send_phase(trainer)
  with mesh_lib.tracing(trainer.mesh):
    traced = trainer._jit_step((phase, None), state).trace(state, trainer._abstract_batch())
  maps = {id(eqn): eqn for eqn in _kernel_maps(traced.jaxpr.jaxpr)}.values()
  # The blocks stacked over the M replicas, [M, blocks, values]: Δ into the encoder, codes into the
  # decoder (the mean's codes, gathered from every replica, are one [blocks, values] for all).
  stacked = [(spec, var.aval.shape) for eqn in maps
             for spec, var in zip(eqn.params["in_specs"], eqn.invars)
             if var.aval.ndim == 3 and var.aval.shape[0] == trainer.config.num_replicas]
  assert len(stacked) >= 2, stacked
  for spec, shape in stacked:
    assert len(spec) and spec[0] == mesh_lib.REPLICA, (spec, shape)


def main(argv) -> int:
  parser = argparse.ArgumentParser(description="The lowering battery outside pytest.")
  parser.add_argument("--write-table", action="store_true",
                      help=f"rewrite the cross product's table in {DOCS}")
  parser.add_argument("--write-kernel-table", action="store_true",
                      help=f"rewrite this jax version's rows of the GPU kernel table in {DOCS}")
  parser.add_argument("--lower", action="store_true",
                      help="lower every distinct program and print the failures and the time")
  args = parser.parse_args(argv)
  if args.write_table:
    text = DOCS.read_text()
    head, tail = text.split(TABLE_BEGIN)
    DOCS.write_text(f"{head}{TABLE_BEGIN}\n{table()}\n{TABLE_END}{tail.split(TABLE_END, 1)[1]}")
    print(f"wrote {DOCS}")
  if args.write_kernel_table:
    mine = kernel_table_rows()
    others = [row for row in _docs_kernel_table() if not row.startswith(f"| {jax.__version__} |")]
    version = lambda row: tuple(int(v) for v in row.split("|")[1].strip().split("."))
    rows = "\n".join([KERNEL_TABLE_HEAD] + sorted(others + mine, key=version))
    text = DOCS.read_text()
    head, tail = text.split(KERNEL_TABLE_BEGIN)
    DOCS.write_text(f"{head}{KERNEL_TABLE_BEGIN}\n{rows}\n{KERNEL_TABLE_END}"
                    f"{tail.split(KERNEL_TABLE_END, 1)[1]}")
    print(f"wrote jax {jax.__version__}'s rows in {DOCS}")
  if args.lower:
    start = time.perf_counter()
    combinations = allowed()
    lowered = lower_programs(combinations)
    failures = check_lowered(combinations, lowered)
    print(f"jax {jax.__version__}: {len(combinations)} combinations, {len(lowered)} distinct "
          f"programs, {len({id(v) for v in lowered.values()})} distinct jaxprs, lowered for "
          f"{', '.join(PLATFORMS)} in {time.perf_counter() - start:.0f} s; {len(failures)} "
          f"failures")
    print("\n".join(failures))
    return 1 if failures else 0
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
