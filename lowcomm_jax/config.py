"""The run configuration: every key with its default and meaning.

Experiment files in `experiments/configs/` start from `default_config()` and change values; they
cannot add keys (`lock_config=True`), so a misspelt key is an error at the command line, where
`lowcomm_jax.cli` names it in one line with the closest keys.
`lowcomm_jax.train.validation.validate` checks values before any compute and before anything is
written: one ValueError naming the option and its allowed values (each key's comment below gives its
range); it returns them parsed, a frozen `lowcomm_jax.run_config.RunConfig`. A run's fingerprint
(every key but RUNTIME_KEYS) must match to resume it. A key that moved (MOVED_KEYS) is refused
naming its place now; a run saved with it is read with the key at that place (`upgrade_saved`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import ml_collections

from lowcomm_jax.data import tokenizer as tokenizer_lib
from lowcomm_jax.models import config as model_config, hf_llama

# Keys that may change when a run is resumed: they do not change the trajectory (nonfinite
# only decides what happens once a non-finite outer gradient appears: stop, or refuse it and go on).
RUNTIME_KEYS = ("stop_at_step", "log_every", "eval.every", "eval.num_batches", "checkpoint.every",
                "checkpoint.keep", "hardware.peak_flops_per_device", "hardware.step_seconds",
                "network", "progress_bar", "distributed.timeout_seconds",
                "distributed.init_timeout_seconds", "nonfinite", "outer.codec_kernels",
                # an elastic run's membership and faults may change when it resumes
                "elastic.num_learners", "elastic.min_quorum", "elastic.grace_s",
                "elastic.adaptive_grace", "elastic.late",
                "elastic.staleness_weight", "elastic.faults", "elastic.faults_per_hour",
                "elastic.address", "elastic.max_restarts", "elastic.learner_cpus",
                "elastic.learner_gpus", "elastic.timeout_s", "elastic.speeds",
                "elastic.staleness", "elastic.max_staleness", "elastic.heloco_keep",
                "elastic.heloco_shrink", "elastic.heloco_max_shrink", "elastic.heloco_reorient",
                "elastic.heloco_momentum_weight")


# The keys of the `outer` section that were `diloco.<key>`, and those SparseLoCo read from its own
# section (`sparseloco.<key>`) before the DiLoCo family shared one schedule.
_DILOCO_MOVED = ("sync_every", "num_fragments", "fragment_pattern", "non_block_fragment",
                 "fragment_rules", "staggered", "overlap_steps", "overlap_anchor", "merge_alpha",
                 "codec", "codec_block_size", "codec_rounding", "error_feedback",
                 "overlap_executor", "codec_kernels")
_SPARSELOCO_MOVED = ("sync_every", "num_fragments", "overlap_steps", "merge_alpha")
# old key -> its place now; a config that sets an old key is refused naming the new one
MOVED_KEYS = {**{f"diloco.{k}": f"outer.{k}" for k in _DILOCO_MOVED},
              **{f"sparseloco.{k}": f"outer.{k}" for k in _SPARSELOCO_MOVED}}
# sections that are gone (all their keys moved)
MOVED_SECTIONS = {"diloco": "outer"}
# the diloco.<key> values a SparseLoCo run read (the rest of its diloco section was not read)
_READ_BY_SPARSELOCO = ("fragment_pattern", "non_block_fragment", "staggered", "overlap_anchor",
                       "overlap_executor")


def moved_key_error(key: str) -> str | None:
  """"diloco.sync_every moved to outer.sync_every" for a key that moved; None for any other."""
  section = key.partition(".")[0]
  if key in MOVED_KEYS:
    return f"{key} moved to {MOVED_KEYS[key]}"
  if section in MOVED_SECTIONS and key == section:
    return f"the {section} section moved to {MOVED_SECTIONS[section]} ({section}.<key> is now " \
           f"{MOVED_SECTIONS[section]}.<key>)"
  return None


def upgrade_saved(flat: dict) -> dict:
  """A run's saved {"section.key": value} (its config.json's config or fingerprint) in today's keys.

  A run saved before the `outer` section took its schedule from `diloco.*`, and SparseLoCo half of
  it from `sparseloco.*`: each moved key takes the value the run read (for algorithm=sparseloco the
  four `sparseloco.*` schedule keys and the diloco keys it read; the diloco keys it did not read are
  dropped, so they count as their defaults). A dict with none of the old keys comes back unchanged.
  """
  if not any(k in MOVED_KEYS for k in flat):
    return dict(flat)
  sparseloco = flat.get("algorithm") == "sparseloco"
  out = {k: v for k, v in flat.items() if k not in MOVED_KEYS}
  for key, value in flat.items():
    section, _, name = key.partition(".")
    if key not in MOVED_KEYS:
      continue
    if section == "sparseloco" and sparseloco:
      out[MOVED_KEYS[key]] = value
    elif section == "diloco" and (not sparseloco or name in _READ_BY_SPARSELOCO):
      out[MOVED_KEYS[key]] = value
  return out


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # dp: synchronous data parallel (one gradient all-reduce per step); diloco: M replicas
  # (mesh.replica) train alone for H steps, then an outer step; streaming_diloco: fragments, overlap
  # τ, merge α; noloco: outer steps by gossip in random groups of replicas, no all-reduce (the
  # `noloco` section); sparseloco: Streaming DiLoCo's schedule with top-k, 1-2 bit outer gradients
  # and error feedback (the `sparseloco` section).
  c.algorithm = "dp"
  # Where gradients come from (lowcomm_jax.train.sources): replicas (each replica's forward/backward
  # on its own batch) | skippipe (micro-batches along SkipPipe stage paths, the `skippipe` section)
  # | pipeline (the pipeline executor on a (replica, stage) mesh, the `pipeline` section).
  c.gradients = "replicas"
  # NaN/inf in the global model (data parallel: the new parameters; DiLoCo: an averaged outer
  # gradient; NoLoCo: a replica's slow weights): the outer step is always refused and counted in
  # summary.json's refused_outer_steps; raise stops the run naming it, skip logs it and goes on.
  c.nonfinite = "raise"
  # M: model replicas (workers); mesh.replica devices hold them, M/mesh.replica each
  c.num_replicas = 1
  c.seed = 0  # parameter init and data order; in [0, 2**32).
  c.num_steps = 300  # optimizer steps.
  c.model = ml_collections.ConfigDict(dict(
      # a preset of lowcomm_jax.models.PRESETS, or hf:<folder>: the shape of that Hugging Face
      # Llama folder's config.json (with init_from=hf:<folder>, continued training of it)
      size="tiny",
      # activation dtype: "" (the preset's: float32 for tiny/small, bfloat16 for sdl_*) | float32 |
      # bfloat16; parameters stay float32
      dtype="",
      d_ff=0,  # SwiGLU hidden width; 0 keeps the preset's (HDEE varies it for S/M/L experts)
      layer_loop="auto",  # auto | scan | unroll: how the forward runs the layers (ModelConfig)
      # xla | dot_product (cuDNN's flash attention on GPU) | cpu_kernel: how attention is computed
      attention="xla",
      # what each block keeps for the backward: "" (the preset's: none for tiny/small, dots for
      # sdl_*) | none | full | dots (ModelConfig.remat, docs/accelerators.md)
      remat="",
  ))
  # the parameters this run starts from (fresh optimizer): "" (initialised from `seed`) | the
  # workdir of a finished run (its evaluated parameters) | hf:<folder> (a Hugging Face Llama folder
  # of this run's model shape, e.g. written by experiments/export.py; refused naming what differs)
  c.init_from = ""
  c.data = ml_collections.ConfigDict(dict(
      # stdlib | licenses | docstrings | debian:<source> | domain:<d> | domain_mix:<d>+<d>, or the
      # user's files (lowcomm_jax.data.files, docs/data.md): text:<glob> | jsonl:<glob>:<field> |
      # parquet:<glob>:<column> | hf:<save_to_disk folder>:<column> | tokens:<file.bin|file.npy>
      corpus="stdlib",
      # bytes (UTF-8 bytes, vocabulary 256) | a Hugging Face tokenizer.json or a folder holding one
      # | a SentencePiece .model (lowcomm_jax.data.tokenizer); model.vocab_size follows it, padded
      # to a multiple of 128. domain: and domain_mix: corpora are bytes only.
      tokenizer="bytes",
      doc_separator="",  # "" or a string that splits every document further (e.g. "\n\n\n")
      doc_chars=0,  # >= 0; > 0 cuts documents into pieces of at most this many characters
      seq_len=128,  # tokens per training sequence
      batch_size=16,  # global sequences per step (per replica for multi-replica algorithms)
      eval_permille=20,  # held-out documents, per mille (by a hash of the document id), in [1, 500]
  ))
  c.optimizer = ml_collections.ConfigDict(dict(
      # adamw | adam | sgd | muon (lowcomm_jax.optim.inner: Muon on the layer blocks' weight
      # matrices, momentum b1, Nesterov; AdamW on the embeddings, head and norm scales, as MuLoCo)
      name="adamw",
      learning_rate=3e-3,  # peak learning rate, finite and >= 0
      warmup_steps=30,  # linear warm-up, then cosine decay to min_lr_ratio · peak
      min_lr_ratio=0.1,  # in [0, 1]
      weight_decay=0.1,  # >= 0
      b1=0.9,  # Adam's β1 (muon: also Muon's momentum), in [0, 1)
      b2=0.95,  # Adam's β2, in [0, 1)
      momentum=0.0,  # sgd only, in [0, 1)
      grad_clip=1.0,  # global-norm clip, >= 0; 0 disables
      # k: each replica's batch (data.batch_size rows) taken as k micro-batches of batch_size / k
      # rows, one after another inside the step, their gradients averaged (models.loss.accumulate):
      # the same step as one batch, with 1/k of the activation memory. A divisor of data.batch_size;
      # gradients=pipeline splits batches with pipeline.slots_per_step instead (1 there).
      accumulation_steps=1,
  ))
  # The schedule and wire of the DiLoCo family (diloco, streaming_diloco, sparseloco; the registry
  # rows in lowcomm_jax.train.algorithms say which algorithm reads which section). SparseLoCo reads
  # the schedule and the overlap keys; its wire format is its own (the `sparseloco` section), so
  # codec, codec_block_size, codec_rounding, error_feedback and codec_kernels stay at their defaults
  # there.
  c.outer = ml_collections.ConfigDict(dict(
      sync_every=50,  # H: inner steps between two syncs of a fragment, at most num_steps
      num_fragments=1,  # P: block fragments (1 = the whole model, vanilla DiLoCo)
      fragment_pattern="strided",  # strided (blocks p, p+P, ...) | sequential
      # own: embeddings/norm/head form one more fragment | fold: into fragment 0
      non_block_fragment="own",
      # Fragments as data instead of num_fragments/fragment_pattern/non_block_fragment: "" (off) or
      # comma-separated "regex:index" entries over parameter paths, first full match wins, indices
      # 0..F-1 (optim.fragments.rule_fragments), e.g. "blocks/attn/.*:0,blocks/mlp.*:1,.*:2".
      fragment_rules="",
      staggered=True,  # fragment p syncs at offset (p+1)·H/P; False: all at the same step
      overlap_steps=0,  # τ: inner steps a fragment's all-reduce overlaps before it is applied
      # Where the τ steps sit around a fragment's nominal sync step n (docs/overlap.md):
      #   send:  Δ after step n, all-reduce issued with step n+1, merged after step n+τ
      #          (the paper's)
      #   apply: Δ after step n−τ, issued with step n−τ+1, merged after step n
      #          (torchft's convention)
      overlap_anchor="send",
      merge_alpha=0.0,  # α: θ ← α·θ_local + (1−α)·θ_global when a fragment is applied
      # Eager outer updates (docs/algorithms.md §1.7; diloco and streaming_diloco): needs
      # overlap_steps = sync_every (τ = H) or twice it (τ = 2H), so each fragment's mean overlaps
      # one or two whole outer phases (P or 2P means in flight at a time); at every sync step each
      # worker runs the outer step at once on its own φ with its fresh Δ in place of its share of
      # the mean
      eager=False,
      # The naive delay (the eager paper's baseline): τ = H or 2H as eager, but each worker
      # applies the landed mean as it is and restarts from that φ (no proxy)
      naive_delay=False,
      # none (float32 all-reduce) | e3m0 | e2m1 | int4 | int8 | bf16 | fp32 (compressed mean)
      codec="none",
      codec_block_size=1024,  # values per absmax scale in the codec, an integer >= 2
      codec_rounding="nearest",  # nearest | stochastic
      error_feedback=False,  # add each replica's quantization residual to its next outer gradient
      # How an overlapped fragment's (τ >= 1) mean travels (lowcomm_jax.train.overlap,
      # docs/overlap.md):
      #   thread: a communication thread issues it (comm.OuterCommExecutor) while the next inner
      #           steps run; the step programs hold no cross-replica collective, and the
      #           merge runs as its own program after step n+τ (same results as inline within
      #           1e-7 + 1e-6·|x|: the separate merge rounds differently at the ulp scale)
      #   inline: inside the send step's own program (XLA:CPU then holds the next steps back)
      #   auto:   thread where it works (streaming_diloco or sparseloco with τ >= 1,
      #           gradients=replicas or skippipe, each replica inside one process), inline
      #           elsewhere (τ = 0, diloco, noloco, dp, the pipeline)
      overlap_executor="auto",
      codec_kernels="auto",  # the codec's encode/decode on the wire: auto (compiled Pallas kernels,
                             # on GPU Mosaic GPU or Triton per JAX version and GPU, Mosaic on TPU,
                             # for e3m0/e2m1/int4/int8 with blocks of at most 8192; jnp reference
                             # elsewhere) | pallas (also on CPU, interpreted: slow, for tests;
                             # refused where no compiled kernel exists) | pallas_mosaic_gpu |
                             # pallas_triton (pallas with that GPU kernel, refused where it cannot
                             # compile) | reference (jnp); all give bit-identical results, so a
                             # resumed run may change it (docs/accelerators.md)
  ))
  # docs/algorithms.md §2.3; defaults from the paper's code
  c.noloco = ml_collections.ConfigDict(dict(
      sync_every=50,  # H: inner steps between two gossip outer steps, at most num_steps
      group_size=2,  # n: replicas per random group (2: pairs); must divide num_replicas
      outer_learning_rate=0.7,  # β: step along the group-mean outer gradient, > 0
      outer_momentum=0.5,  # α: heavy-ball momentum of δ, in [0, 1)
      gamma=0.7,  # γ: pull of φ_i toward its group's mean slow weights, >= 0
      # >= 1: random partitions drawn from `seed` (one outer program switches among them)
      num_groupings=16,
      codec="none",  # none (float32) | an outer.codec name: the outer gradients' wire format
      codec_block_size=1024,  # values per absmax scale in the codec, an integer >= 2
  ))
  # SparseLoCo (docs/sparseloco.md): fragment p's Δ, plus its error buffer e ← β·e + Δ, travels as
  # the top_k largest entries of every chunk of chunk_size values, each at `bits` bits (all-gather
  # of the sparse payloads, scatter-add mean); the outer step is SGD with no momentum (the error
  # buffer is the momentum); outer_optimizer.* is not read. The schedule (H, fragments, τ, α) and
  # the overlap thread follow the `outer` section.
  c.sparseloco = ml_collections.ConfigDict(dict(
      chunk_size=4096,  # values per top-k chunk, an integer >= 2 (the paper: 4096)
      top_k=64,  # values kept per chunk, in [1, chunk_size] (the paper: 64, 1.56 %)
      bits=2,  # bits per kept value: 1 (scaled sign) or 2 (the paper's)
      feedback_decay=0.95,  # β of the error buffer, in [0, 1]
      outer_learning_rate=1.0,  # η of the outer SGD step, > 0
  ))
  # Elastic learners on Ray (docs/elastic.md, experiments/elastic.py): num_learners independent
  # learners, each one replica of algorithm=diloco, streaming_diloco or sparseloco (the outer
  # section's H, P, τ, α, codec apply) on its own devices (mesh.data × mesh.tensor), and a syncer
  # that holds φ and the outer optimizer state and closes each fragment's round once min_quorum
  # learners sent their Δ_p and a grace window passed. num_replicas is not read: learner i of N
  # reads shard i of N of the data.
  c.elastic = ml_collections.ConfigDict(dict(
      num_learners=2,  # N: learner actors, >= 1 (may change on resume; while the run goes on,
      #                  learners are added and removed by lowcomm_jax.elastic.start's run object)
      # Δ_p a round waits for, in [0, num_learners] (0: all N; fewer while some are down)
      min_quorum=0,
      grace_s=1.0,  # seconds a round with its quorum waits for the other live learners, >= 0
      # True: wait only for the learners whose next Δ_p is predicted within grace_s (from their
      # recent arrivals); a straggler or a stopped learner then costs no wait (elastic/grace.py)
      adaptive_grace=False,
      late="drop",  # drop | weight: a Δ_p sent from an older φ_p than the open round's is dropped,
      #               or merged with weight tokens · staleness_weight ** (rounds behind)
      staleness_weight=0.5,  # in (0, 1], read with late=weight
      # Faults at steps, comma-separated: kill:learner=I:step=S, stop:learner=I:step=S:seconds=D
      # (SIGSTOP for D seconds), slow:learner=I:step=S:factor=F (F times slower from step S on),
      # kill_syncer:round=R (the syncer dies in round R of fragment 0). Each fires once per run.
      faults="",
      faults_per_hour=0.0,  # Poisson kills of random learners from outside (ray.kill), >= 0
      address="",  # "" starts a local Ray on 127.0.0.1; "auto" or host:port joins a running cluster
      max_restarts=100,  # restarts Ray gives each learner and the syncer, >= 0
      learner_cpus=1.0,  # Ray resources of each learner actor, > 0
      learner_gpus=0.0,  # >= 0 (1 on GPU hosts: one learner per GPU)
      timeout_s=600.0,  # the whole run's wall-clock limit, > 0
      # Learners of different speeds: "" (all alike) or one relative speed > 0 per learner,
      # comma-separated ("1,1,0.5,0.25": learner 3 takes 4× the fastest one's time per step)
      speeds="",
      # Asynchronous learners (docs/elastic.md): no rounds; the syncer merges each Δ as it arrives
      # into φ with the outer optimizer (outer_optimizer.momentum_every = N: Delayed Nesterov),
      # scaled by the staleness rule, and the learner goes on from the φ of that moment.
      # algorithm=diloco with outer.overlap_steps = 0 only.
      asynchronous=False,
      # A Δ from φ s merges old is r = ⌊s / learners⌋ rounds behind. inverse: weight 1/(1 + r) |
      # cutoff: 1 up to max_staleness rounds, dropped beyond | none: 1 | heloco: 1/(1 + r), and
      # each Δ first aligned with the outer momentum m per parameter (HeLoCo, arXiv 2606.00271:
      # kept if its cosine c with m is >= heloco_keep, its part along −m shrunk if c < 0, turned
      # toward m if in between; needs outer_optimizer.name=nesterov with momentum > 0)
      staleness="inverse",
      max_staleness=1,  # S of staleness=cutoff (rounds), >= 0
      heloco_keep=0.2,  # c_ok: a block with cosine >= this is kept as it is, in [-1, 1]
      heloco_shrink=1.0,  # k_s: c < 0 shrinks the part along −m by β = min(k_s·(−c)·conf, β_max)
      heloco_max_shrink=0.5,  # β_max, in [0, 1]
      heloco_reorient=0.5,  # k_d: 0 <= c < c_ok turns Δ by λ = min(k_d·(1 − c)·conf, 1), >= 0
      # κ: conf = ‖Δ‖ / (‖Δ‖ + κ·‖m‖): how much Δ weighs against the momentum buffer m, >= 0
      heloco_momentum_weight=0.1,
      # True: a learner's answer waits until the momentum step that closes its buffer of N
      # (everyone then starts from the same φ: with N = num_learners, synchronous DiLoCo)
      buffer_barrier=False,
      # equal: every learner syncs every outer.sync_every steps | by_speed: learner i every
      # max(1, round(H·speed_i / max speed)) steps, for num_steps·H_i/H steps (DyLU with the
      # declared speeds: every learner's phase takes about the same wall time)
      local_steps="equal",
      log_deltas=False,  # True: each merged Δ kept beside the merge log (syncer/merges/): replay
  ))
  c.outer_optimizer = ml_collections.ConfigDict(dict(
      name="nesterov",  # nesterov | sgd | adam, applied to the outer gradient Δ = φ − θ
      learning_rate=0.7,  # > 0
      momentum=0.9,  # in [0, 1)
      # N: nesterov's momentum moves every N outer gradients, plain steps between (Delayed
      # Nesterov, for asynchronous learners; 1: every outer step), >= 1
      momentum_every=1,
  ))
  c.pipeline = ml_collections.ConfigDict(dict(  # gradients=pipeline or skippipe (docs/pipelines.md)
      num_stages=2,  # S: the model's layers cut into S stages (mesh.stage = S for the pipeline)
      layers_per_stage=1,  # the model then has S × this many layers
      routing="random",  # random (NoLoCo's routing between replicas of consecutive stages) | fixed
      order="gpipe",  # tick order: gpipe | 1f1b
      slots_per_step=2,  # K: micro-batches each replica starts per step (data.batch_size / K each)
      num_routings=4,  # random routings compiled; step t uses entry (t − 1) mod this
      routing_seed=0,  # seeds the random routings, in [0, 2**32)
  ))
  c.skippipe = ml_collections.ConfigDict(dict(  # gradients=skippipe (docs/algorithms.md §3.4)
      paths="",  # stage paths, one per micro-batch, e.g. "0-1-2,0-2-1"; "" plans them on `topology`
      # the scheduler's cluster: gcp_12_regions | gcp_42_nodes | homogeneous
      topology="gcp_12_regions",
      path_length=4,  # k: stages per path counting stage 0, in [1, the topology's stages]
      microbatches_per_data_node=2,  # >= 1
      placement_seed=0,  # seeds the placement search, in [0, 2**32)
  ))
  # -1: fill. stage > 1 only with gradients=pipeline (mesh.stage = pipeline.num_stages).
  c.mesh = ml_collections.ConfigDict(dict(replica=1, data=-1, tensor=1, stage=1))
  c.sharding = ml_collections.ConfigDict(dict(
      layout="replicated",  # replicated | fsdp | tensor | fsdp_tensor
  ))
  c.eval = ml_collections.ConfigDict(dict(every=100, batch_size=16, num_batches=8))
  c.checkpoint = ml_collections.ConfigDict(dict(every=100, keep=2))
  c.log_every = 10
  c.stop_at_step = -1  # stop (with a checkpoint) after this step; -1 runs to num_steps
  c.progress_bar = True  # a tqdm bar on a terminal; plain log lines otherwise
  c.hardware = ml_collections.ConfigDict(dict(
      # for MFU (train/mfu.py), >= 0; 0: the chip's bf16 datasheet peak by device_kind
      # (mfu.BF16_PEAKS), else the host's measured float32 matmul (CPU: per CPU-second)
      peak_flops_per_device=0.0,
      step_seconds=0.0,  # compute seconds per step for the virtual clock, >= 0; 0: as measured
  ))
  # Virtual clock: "" (off), a preset (datacenter, cross_region, internet, home) or
  # "<bandwidth>,<latency>" such as "1Gbit,50ms"; summary.json then reports the run's wall time on
  # that network from the ledger's bytes and the algorithm's overlap (lowcomm_jax.sim.clock).
  c.network = ""
  # Multi-process runs (experiments/launch_local.py, SLURM, TPU pod slices;
  # lowcomm_jax.distributed). Who the processes are comes from train.py's flags or the environment,
  # not from here.
  c.distributed = ml_collections.ConfigDict(dict(
      timeout_seconds=60,  # a process silent this long (no heartbeat) stops every other one, named
      init_timeout_seconds=300,  # how long processes wait for each other at start-up
  ))
  return c


# The run sizes the experiment configs share: `small` (their default variants) and `tiny`.
RUN_SIZES = {
    "small": {"model.size": "small", "num_steps": 600, "data.seq_len": 128, "data.batch_size": 16,
              "eval.every": 200, "checkpoint.every": 200},
    "tiny": {"model.size": "tiny", "num_steps": 200, "eval.every": 100},
}


def override(c: ml_collections.ConfigDict, changes: dict) -> ml_collections.ConfigDict:
  """Sets dotted keys ("noloco.sync_every": 10) in place and returns `c`; unknown keys raise."""
  for key, value in changes.items():
    section, _, name = key.rpartition(".")
    if moved_key_error(key):
      raise ValueError(moved_key_error(key))
    target = c[section] if section else c
    if name not in target:
      raise ValueError(f"unknown config key {key!r}; see lowcomm_jax/config.py for the allowed "
                       f"keys")
    target[name] = value
  return c


def flatten(c, prefix="") -> dict:
  """{"section.key": value} of every key of `c` (a ConfigDict or a `run_config.RunConfig`)."""
  out = {}
  for k, v in c.items():
    key = f"{prefix}{k}"
    if isinstance(v, ml_collections.ConfigDict) or dataclasses.is_dataclass(v):
      out.update(flatten(v, key + "."))
    else:
      out[key] = v
  return out


def model_config_of(c):
  """The model's shape: the preset (or with `model.size=hf:<folder>`, the shape of that Hugging Face
  Llama folder's config.json), its width `model.d_ff`, layers = stages × layers per stage for the
  pipeline and SkipPipe sources, the vocabulary of `data.tokenizer` (padded to a multiple of 128;
  256 for bytes; a folder's own vocabulary, which must hold the tokenizer's)."""
  tokens = tokenizer_lib.load_tokenizer(c.data.tokenizer).vocab_size
  changes = {"vocab_size": tokenizer_lib.model_vocab_size(tokens)}
  if c.gradients != "replicas":
    changes["num_layers"] = c.pipeline.num_stages * c.pipeline.layers_per_stage
  if c.model.size.startswith(hf_llama.PREFIX):
    preset = hf_llama.folder_model_config(c.model.size[len(hf_llama.PREFIX):])
    if tokens > preset.vocab_size:
      raise ValueError(f"data.tokenizer={c.data.tokenizer!r} has {tokens:,} tokens, more than the "
                       f"vocabulary of model.size={c.model.size!r} ({preset.vocab_size:,})")
    changes["vocab_size"] = preset.vocab_size
    return dataclasses.replace(
        preset, **model_options(c), max_seq_len=max(preset.max_seq_len, c.data.seq_len),
        d_ff=c.model.d_ff or preset.d_ff, **changes)
  preset = model_config.PRESETS.get(c.model.size)
  return model_config.get_model_config(
      c.model.size, **model_options(c), max_seq_len=max(preset.max_seq_len, c.data.seq_len),
      d_ff=c.model.d_ff or preset.d_ff, **changes)


def model_options(c) -> dict:
  """The `model` keys that replace a preset's fields; an empty dtype or remat keeps the preset's."""
  options = dict(layer_loop=c.model.layer_loop, attention=c.model.attention)
  for key in ("dtype", "remat"):
    if c.model[key]:
      options[key] = c.model[key]
  return options


def load_run_config(workdir) -> ml_collections.ConfigDict:
  """The config a run directory was started with (from its config.json, in today's keys)."""
  saved = json.loads((pathlib.Path(workdir) / "config.json").read_text())["config"]
  c = default_config()
  c.update_from_flattened_dict(upgrade_saved(flatten(ml_collections.ConfigDict(saved))))
  return c


def fingerprint(c: ml_collections.ConfigDict) -> dict:
  """The part of the config that fixes the trajectory (everything but RUNTIME_KEYS)."""
  flat = flatten(c)
  return {k: v for k, v in sorted(flat.items()) if k not in RUNTIME_KEYS}
