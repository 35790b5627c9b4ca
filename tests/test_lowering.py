"""The lowering battery: every distinct step program lowers for GPU (`cuda`) and TPU (`tpu`).

On this CPU host, with what a GPU or TPU host would pick (`diloco.codec_kernels=auto`: the compiled
Pallas kernels, Triton on cuda and Mosaic on tpu; `model.layer_loop=scan`), each setup's Trainer
gives its step programs (`Trainer.lower`, one per distinct phase and routing), and with
`diloco.overlap_executor=thread` also the programs the thread runs (`comm.fragment_mean`). Programs
with the same jaxpr are lowered once. A program that sends a codec-encoded fragment holds the
compiled kernels (Triton or Mosaic custom calls, not the jnp reference) and one that sends nothing
holds none. `jax.export` exports the dp and Streaming DiLoCo steps for each platform.

Lowering for cuda on a CPU host needs an abstract GPU device from jax 0.11 on (Triton reads the
target from the abstract mesh): the setups run under an abstract mesh with the Trainer's axes and
an H100 device (`mesh.tracing` keeps it). docs/accelerators.md has the table of setups.
"""

import contextlib
import functools
import tempfile

import jax
import numpy as np
import pytest

from lowcomm_jax import comm
from lowcomm_jax import config as config_lib
from lowcomm_jax import mesh as mesh_lib
from lowcomm_jax.optim import fragments as frag_lib
from lowcomm_jax.train import Trainer, overlap

PLATFORMS = ("cuda", "tpu")
# What a compiled Pallas kernel lowers to, per platform.
KERNEL_MARK = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
GPU = "NVIDIA H100 80GB HBM3"
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
      "diloco.sync_every": 2, "diloco.codec": codec, "diloco.codec_block_size": 256,
      "diloco.codec_kernels": "auto", "diloco.overlap_executor": executor,
      "noloco.sync_every": 2, "noloco.num_groupings": 1,
      "mesh.replica": replicas, "mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 1,
  }
  if algorithm == "streaming_diloco":  # one fragment (embeddings folded in), τ = 1, α = 0.5
    changes.update({"diloco.non_block_fragment": "fold", "diloco.overlap_steps": 1,
                    "diloco.merge_alpha": 0.5})
  if algorithm == "noloco":  # NoLoCo's own codec (its gossip), diloco's stays none
    changes.update({"diloco.codec": "none", "noloco.codec": codec, "noloco.codec_block_size": 256})
  if gradients == "skippipe":
    changes.update({"skippipe.paths": "0-1,0-1", "pipeline.num_stages": 2})
  if gradients == "pipeline":
    changes.update({"pipeline.num_stages": 2, "pipeline.num_routings": 1, "mesh.data": 1,
                    "mesh.tensor": 1, "mesh.stage": 2})
  changes.update(extra)
  return config_lib.override(c, changes)


def _setups():
  """(name, config) of every setup the battery lowers: every algorithm × gradient source, each
  layout; every codec on every layout for Streaming DiLoCo inline, with the thread every codec on
  fsdp_tensor and e3m0 on every layout; every codec for DiLoCo (fsdp_tensor), e3m0 and int8 for
  NoLoCo's gossip; e3m0 on the pipelines; stochastic rounding with error feedback; the model's
  dot_product attention and dots rematerialisation."""
  out = []
  for algorithm in ("dp", "diloco", "streaming_diloco", "noloco"):
    for layout in LAYOUTS:
      out.append((f"{algorithm}/replicas/{layout}/none/inline", _config(algorithm, layout=layout)))
    for gradients in ("skippipe", "pipeline"):
      out.append((f"{algorithm}/{gradients}/replicated/none/inline",
                  _config(algorithm, gradients)))
  for algorithm, codecs in (("diloco", CODECS), ("noloco", ("e3m0", "int8"))):
    for codec in codecs:
      out.append((f"{algorithm}/replicas/fsdp_tensor/{codec}/inline",
                  _config(algorithm, layout="fsdp_tensor", codec=codec)))
  for codec in CODECS:
    for layout in LAYOUTS:
      # The thread's programs hold the kernels in the fragment program: once per codec and per layout.
      for executor in ("inline", "thread") if "fsdp_tensor" in (layout,) or codec == "e3m0" else (
          "inline",):
        out.append((f"streaming_diloco/replicas/{layout}/{codec}/{executor}",
                    _config("streaming_diloco", layout=layout, codec=codec, executor=executor)))
  for gradients in ("skippipe", "pipeline"):
    for executor in ("inline", "thread") if gradients == "skippipe" else ("inline",):
      out.append((f"streaming_diloco/{gradients}/replicated/e3m0/{executor}",
                  _config("streaming_diloco", gradients, codec="e3m0", executor=executor)))
  for executor in ("inline", "thread"):
    out.append((f"streaming_diloco/replicas/fsdp_tensor/e3m0/{executor}, stochastic rounding and "
                "error feedback", _config("streaming_diloco", layout="fsdp_tensor", codec="e3m0",
                                          executor=executor,
                                          **{"diloco.codec_rounding": "stochastic",
                                             "diloco.error_feedback": True})))
  out.append(("dp/replicas/fsdp_tensor/none/inline, model.attention=dot_product",
              _config("dp", layout="fsdp_tensor", **{"model.attention": "dot_product"})))
  out.append(("dp/replicas/fsdp_tensor/none/inline, model.remat=dots",
              _config("dp", layout="fsdp_tensor", **{"model.remat": "dots"})))
  return out


def _target(platform: str, mesh):
  """What lowering for `platform` on this host needs: for cuda from jax 0.11 on, an abstract mesh
  with the Trainer's axes and a GPU device."""
  device_type = getattr(jax.sharding, "AbstractDevice", None)
  if platform != "cuda" or device_type is None:
    return contextlib.nullcontext()
  device = device_type(GPU, platform="gpu", num_cores=None)
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
      tuple(mesh.axis_sizes), tuple(mesh.axis_names), axis_types=tuple(mesh.axis_types),
      abstract_device=device))


def _programs(trainer, state):
  """(label, sends, trace) of every distinct program of a run: `trace()` gives a jax Traced."""
  tx = getattr(trainer.algorithm, "tx", None)
  thread = trainer.overlap_executor == "thread"
  keys = []
  for step in range(1, trainer.config.num_steps + 1):
    phase = trainer.algorithm.phase_at(step)
    if thread:
      phase = overlap.program_phase(tx.schedule.delay, phase)
    key = (phase, trainer.source.route_at(step))
    if key not in keys:
      keys.append(key)
  out = []
  for phase, route in keys:
    sends = bool(getattr(phase, "send", ()))
    out.append((f"step {phase}", sends, functools.partial(
        lambda p, r: trainer._jit_step((p, r), state).trace(state, trainer._abstract_batch()),
        phase, route)))
  if thread:
    one = jax.eval_shape(lambda t: jax.tree.map(lambda x: x[0], t), state.params)
    for p, frag in enumerate(tx.fragments(one)):
      delta = frag_lib.extract(frag, state.params)
      delta = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32, sharding=x.sharding),
                           delta)
      # As the loop submits it: the residual with error feedback, a key with stochastic rounding.
      residual = delta if tx.error_feedback else None
      key = None
      if tx.codec is not None and tx.codec.rounding == "stochastic":
        key = jax.eval_shape(lambda: jax.random.fold_in(jax.random.key(p), 0))
      mean = comm.fragment_mean(p, tx.codec, tx.codec_kernels, tx.axis_name)
      out.append((f"thread fragment {p}", True, functools.partial(
          lambda m, *args: jax.jit(m).trace(*args), mean, delta, residual, key)))
  return out


@functools.lru_cache(maxsize=None)
def _battery():
  """{platform: {setup: [(program, sends, kernels in it) or an error string]}}, and the number of
  distinct programs. Each program is traced once (under the GPU abstract mesh, which lowering for
  tpu ignores) and lowered for both platforms."""
  results = {platform: {} for platform in PLATFORMS}
  seen = {}
  for name, config in _setups():
    with tempfile.TemporaryDirectory() as workdir:
      trainer = Trainer(config, workdir)
    state = trainer.abstract_state()
    rows = {platform: [] for platform in PLATFORMS}
    with _target("cuda", trainer.mesh), mesh_lib.tracing(trainer.mesh), comm.Ledger().recording():
      for label, sends, trace in _programs(trainer, state):
        try:
          traced = trace()
        except Exception as error:  # pylint: disable=broad-except
          for platform in PLATFORMS:
            rows[platform].append(f"{label}: trace: {type(error).__name__}: {error}"[:400])
          continue
        key = str(traced.jaxpr)
        for platform in PLATFORMS:
          if (key, platform) not in seen:
            try:
              text = traced.lower(lowering_platforms=(platform,)).as_text()
              seen[(key, platform)] = text.count(KERNEL_MARK[platform])
            except Exception as error:  # pylint: disable=broad-except
              seen[(key, platform)] = f"{label}: {type(error).__name__}: {error}"[:400]
          kernels = seen[(key, platform)]
          rows[platform].append(kernels if isinstance(kernels, str) else (label, sends, kernels))
    for platform in PLATFORMS:
      results[platform][name] = rows[platform]
  return results, len(seen) // len(PLATFORMS)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_every_step_program_lowers(platform):
  all_results, distinct = _battery()
  results = all_results[platform]
  failures = [f"{name}: {row}" for name, rows in results.items() for row in rows
              if isinstance(row, str)]
  assert not failures, "\n".join(failures)
  for name, rows in results.items():
    algorithm, codec = name.split("/")[0], name.split("/")[3].split(",")[0]
    for label, sends, kernels in rows:
      # The compiled kernels are in every program that sends an encoded fragment, in no other
      # (NoLoCo's gossip encodes with the jnp reference on every platform).
      expected = codec != "none" and sends and algorithm != "noloco"
      assert (kernels > 0) == expected, (name, label, kernels)
  # Identical programs were lowered once (a non-sync step does not depend on the codec).
  assert 1 < distinct < sum(len(rows) for rows in results.values())


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
      "num_replicas": 4, "mesh.replica": 2, "diloco.codec_kernels": "pallas"})
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
