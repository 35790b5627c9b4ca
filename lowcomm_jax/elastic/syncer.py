"""The syncer of an elastic run: φ and the outer optimizer state, and the rounds of each plan.

One Ray actor (`ray.remote(Syncer)`, async: every learner's `exchange` waits on it at once). The
plans are the algorithm's (`options.plan_names`: fragment p of DiLoCo, Streaming DiLoCo or
SparseLoCo); round r of plan p collects the learners' trees, Δ_p (`comm.remote` payloads, decoded
here). It closes

  - at once when every live learner has sent, or
  - when the grace window ends (`grace.window_end`: `elastic.grace_s` seconds after
    `min(quorum, live learners)` Δ_p were accepted, or earlier with `elastic.adaptive_grace`, once
    the learners still expected in time have sent),

merges what it accepted weighted by tokens (`remote.mean`; equal weights: Σ Δ / n, the collective's
mean; else Σ w_i Δ_i / Σ w_i, in learner order), runs the algorithm's `apply` of that mean on its
copy of the state's shared part (φ, the outer optimizer state: `comm.plan.shared_part`), the outer
step every learner runs on the same mean, saves φ, the shared state and the counters (orbax,
through the Trainer's `Checkpointer`, before anyone is answered) and answers every waiting learner
with the mean. The syncer's φ is what a (re)joining learner starts from and what is evaluated.
With eager outer updates every learner steps its own φ_m, and the syncer's φ is DiLoCo's outer
step on each closed round's mean in turn (`options.syncer_algorithm`).

A Δ_p computed from an older φ_p than the open round's (its learner missed rounds) is late:
`elastic.late=drop` drops it, `weight` merges it with weight tokens · staleness_weight^(rounds
behind). A restarted syncer continues from its latest checkpoint; the exchanges in flight when it
died are sent again by Ray (`max_task_retries=-1`), so the open round is filled again.

Asynchronous learners (`elastic.asynchronous`, DiLoCo): no rounds. Each Δ is merged when it
arrives (`_merge`): weighted by the staleness rule (`optim.staleness`: s = merges into φ since the
learner took its φ, ⌊s / L⌋ rounds behind with L members) and by its tokens against the learners'
mean phase (H_i steps each), it goes through the outer optimizer at once (with
`outer_optimizer.momentum_every` = N, Delayed Nesterov: momentum every N merges; with
`elastic.staleness=heloco` aligned first with its momentum, `options.merge_correction`), and the
learner goes on from φ as it is then (with `elastic.buffer_barrier`, once the momentum step closing
its buffer of N ran). Every merge (or drop) is a line of the merge log, syncer/merges.jsonl:
learner, fragment, base version, version, staleness, rounds behind, weight, tokens, bytes; with
`elastic.log_deltas` the merged Δ beside it (syncer/merges/<n>.npz), from which
`merge_log.replay` rebuilds φ on one process.

Membership: the run's learners are `elastic.num_learners` at its start (or its resume with another
count), plus those the driver adds (`add`: the next unused index) less those it removes (`remove`),
saved with φ. Only members are live; a removed learner's last Δ already sent is merged.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import time

import jax
import ml_collections
import numpy as np

from lowcomm_jax.comm import plan as plan_lib, remote
from lowcomm_jax.elastic import grace as grace_lib, options
from lowcomm_jax.optim import staleness as staleness_lib
from lowcomm_jax.train import faults as faults_lib

MERGE_LOG = "merges.jsonl"  # under <workdir>/syncer/; read back by `merge_log.replay`


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


class Syncer:
  """Holds φ and closes fragment rounds (see the module doc). `run_dir` is the run's workdir."""

  def __init__(self, config_json: str, run_dir: str):
    from lowcomm_jax.train import checkpoint, metrics  # pylint: disable=g-import-not-at-top
    from lowcomm_jax.train.trainer import Trainer  # pylint: disable=g-import-not-at-top
    self.config = c = ml_collections.ConfigDict(json.loads(config_json))
    self.run_dir = pathlib.Path(run_dir)
    self.dir = self.run_dir / "syncer"
    options.use_compilation_cache(self.run_dir)
    # one device is enough: φ's evaluation and the outer steps (the syncer holds no accelerator)
    self.trainer = Trainer(options.evaluation_config(c), self.dir / "model", jax.devices()[:1])
    self.params = host(self.trainer.init_params())
    # the learners' algorithm (its plans are the rounds), and φ's (the same but with eager
    # updates: DiLoCo's outer step, `options.syncer_algorithm`)
    eager = bool(c.outer.eager or c.outer.naive_delay)
    self.algorithm = options.syncer_algorithm(c, self.params)
    self.tx = tx = self.algorithm.tx
    run = options.outer_algorithm(c, self.params) if eager else self.algorithm
    self.names = options.plan_names(run.tx)
    self.num_fragments = len(self.names)
    self.plans = [run.tx.plans(ph)[n] for n in self.names
                  for ph in [next(ph for ph in run.tx.phases if n in run.tx.plans(ph))]]
    self.final_rounds = [
        sum(n in run.tx.plans(run.phase_at(s)) for s in range(1, c.num_steps + 1))
        for n in self.names]
    # plan p's outer step on φ: its fragment's (an eager plan is one lane of a fragment)
    own = [tx.plan_name(run.tx.fragment_of(n)) for n in self.names] if eager else self.names
    sends = {n: ph for ph in tx.phases for n in tx.plans(ph)}
    self.quorum = options.quorum(c)
    # φ and the outer optimizer state: what every learner's state holds the same
    self.shared = host(plan_lib.shared_part(tx.state_axes, tx.init(self.params)))
    self._treedef = jax.tree.structure(self.shared)
    # each plan's tree, as `local` takes it (its shapes)
    self.shapes = [jax.eval_shape(lambda n=n: tx.local(self.shared, self.params, sends[n])[n])
                   for n in own]
    self.rounds = [0] * self.num_fragments  # asynchronous: per plan, Δ merged into φ (version)
    self.step = 0  # the latest step a closed round merged
    self.live: set[int] = set()
    self.members = set(range(c.elastic.num_learners))
    self._next_index = c.elastic.num_learners  # an added learner's index: never one used before
    self.stats = {"rounds": [], "tokens_merged": 0, "tokens_dropped": 0, "refused": 0,
                  "joins": [], "leaves": [], "dropped": [], "added": [], "removed": [],
                  "learner_steps": {}}
    self.asynchronous = bool(c.elastic.asynchronous)
    if self.asynchronous:  # each learner's Δ_p count towards the end: its own sends
      self.final_rounds = [0] * self.num_fragments
      # the tokens of the learners' phases, mean over the run's learners (H_i may differ): a Δ's
      # weight is its tokens over this, so that a round of L merges weighs L, as a round's mean
      self._phase_tokens = c.data.batch_size * c.data.seq_len * float(np.mean(
          [options.local_steps(c, i)[0] for i in range(c.elastic.num_learners)]))
    self.ckpt = checkpoint.Checkpointer(self.dir, c.checkpoint.keep)
    self.saves = 0
    restored = self.ckpt.restore_latest(self._template())
    if restored:
      self.saves, state, data = restored
      self.shared = jax.tree.unflatten(self._treedef, list(host(state["shared"])))
      self.rounds, self.step, self.stats = data["rounds"], data["step"], data["stats"]
      for key, empty in (("added", []), ("removed", []), ("learner_steps", {})):
        # a run saved before these were counted
        self.stats.setdefault(key, empty)
      if data.get("num_learners", c.elastic.num_learners) == c.elastic.num_learners:
        self.members = set(data.get("members", self.members))  # as added and removed
      # else a resume with another elastic.num_learners: its learners, and none of the others
      self._next_index = max(data.get("next_index", 0), c.elastic.num_learners, *self.members)
      self.live = set(data["live"]) & self.members
    else:  # φ_0 saved now: orbax's first save, the slow one, is not paid inside a round
      self._save()
    self._open = [dict() for _ in range(self.num_fragments)]  # learner -> its contribution
    self._closed = {}  # (p, r) -> asyncio.Event, set when round r of fragment p closed
    self._gathering = False
    self._timers = {}  # (p, r) -> (the grace window's end, its asyncio timer)
    self._quorum_at = {}  # (p, r) -> when the round's quorum was in
    self.arrivals = grace_lib.Arrivals()
    self._based_on = {}  # (p, learner) -> the round of the φ_p its next Δ_p starts from
    self._results = {}  # (p, r) -> the mean round r of plan p merged
    # compiled now, not in the first round that needs it (a round's time is the learners' wait)
    consumed = {n: ph for ph in tx.phases for n in tx.consumes(ph)}

    self._outer_steps = [outer_step_program(tx, n, consumed[n], self.shared, self.params,
                                            self.zeros(p))
                         for p, n in enumerate(own)]
    self._buffer_closed = {}  # asynchronous, barrier: (p, version) -> Event set when φ_p got there
    self.faults = faults_lib.SyncerFaults(
        self.run_dir, faults_lib.parse(c.elastic.faults, c.elastic.num_learners))
    self.writer = metrics.MetricWriter(self.run_dir, c.num_steps, self.step, progress_bar=False)
    self.started = time.time()

  @property
  def phi(self):
    """φ: the global parameters (float32), as the algorithm evaluates them."""
    return self.algorithm.eval_params(None, self.shared)

  def zeros(self, p: int):
    """Zeros shaped as plan p's tree."""
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), self.shapes[p])

  def _saved(self) -> dict:
    return {"phi": self.phi, "shared": tuple(jax.tree.leaves(self.shared))}

  def _template(self):
    cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=cpu)
    return jax.tree.map(spec, self._saved())

  # -- membership ------------------------------------------------------------------------------

  def join(self, learner: int) -> dict:
    """A learner (re)starts: φ and the state's shared part, the rounds, the step to start from and
    a live peer (or None); `member` False for a learner removed from the run (it stops)."""
    if learner not in self.members:
      return {"member": False, "step": self.step}
    peers = sorted(self.live - {learner})
    self.live.add(learner)
    self.stats["joins"].append((time.time(), learner))
    for p, r in enumerate(self.rounds):
      self._based_on[(p, learner)] = r
    # asynchronous: each learner's own steps (its H may differ), from its last merged Δ
    step = self.stats["learner_steps"].get(str(learner), 0) if self.asynchronous else self.step
    return {"member": True, "phi": self.phi, "shared": self.shared, "rounds": list(self.rounds),
            "step": step, "peer": peers[0] if peers else None}

  def add(self) -> int:
    """A learner added while the run goes on: its index (a member from now on, live once it
    joins; it starts from φ and the step of the latest closed round, as a rejoining learner
    does)."""
    learner = self._next_index
    self._next_index += 1
    self.members.add(learner)
    self.stats["added"].append((time.time(), learner))
    self._save()
    return learner

  def remove(self, learner: int) -> None:
    """A learner removed while the run goes on: no more a member, its rounds stop waiting for it."""
    self.members.discard(learner)
    self.stats["removed"].append((time.time(), learner))
    self.leave(learner)
    self._save()

  def begin(self) -> None:
    """The driver starts (or resumes) the whole run: its members start together (`started`)."""
    self._gathering = True

  async def started(self) -> None:
    """Returns once every member has joined when the run starts or resumes (so that its first
    round is everyone's), at once for a learner that rejoins or is added while it goes on; after
    elastic.timeout_s / 10 seconds the run starts with who is there."""
    deadline = time.time() + self.config.elastic.timeout_s / 10
    while self._gathering and not self.members <= self.live and time.time() < deadline:
      await asyncio.sleep(0.05)
    self._gathering = False

  def leave(self, learner: int) -> None:
    """A learner died (noticed by Ray): its rounds stop waiting for it."""
    self.live.discard(learner)
    self.arrivals.forget(learner)
    self.stats["leaves"].append((time.time(), learner))
    for p in range(self.num_fragments):  # what it sent before dying is kept
      self._check_close(p)

  def status(self) -> dict:
    return {"rounds": list(self.rounds), "final_rounds": self.final_rounds, "step": self.step,
            "live": sorted(self.live), "members": sorted(self.members), "done": self.done}

  @property
  def done(self) -> bool:
    if self.asynchronous:  # every member sent the Δ of its last step
      sent = self.stats["learner_steps"]
      return all(sent.get(str(i), 0) >= options.local_steps(self.config, i)[1]
                 for i in self.members)
    return all(r >= f for r, f in zip(self.rounds, self.final_rounds))

  # -- rounds ----------------------------------------------------------------------------------

  async def exchange(self, learner: int, p: int, base_round: int, payload, tokens: int, step: int,
                     loss: float) -> dict:
    """Learner `learner`'s Δ_p, computed from φ_p of round `base_round` over `tokens` tokens up to
    its step `step`: returns the mean the open round merged once it closes, with the next round's
    number (`accepted` False: dropped or the end, no mean; `behind`: computed from an older φ_p).
    Asynchronous: `_merge`."""
    if self.asynchronous:
      return await self._merge(learner, p, base_round, payload, tokens, step, loss)
    r = self.rounds[p]
    if r >= self.final_rounds[p] or learner not in self.members:  # the end, or removed: it stops
      return {"mean": None, "round": r, "done": True, "accepted": False, "behind": False,
              "step": self.step}
    self.arrivals.arrived(p, learner, time.time())
    behind = max(r - base_round, 0)
    if behind == 0:
      weight = float(tokens)
    else:
      weight = float(tokens) * self.config.elastic.staleness_weight ** behind \
          if self.config.elastic.late == "weight" else 0.0
    self.live.add(learner)
    if weight == 0:  # dropped: answered at once (the learner catches up), the round goes on
      self.stats["tokens_dropped"] += int(tokens)
      self.stats["dropped"].append((time.time(), learner, p, r, behind))
      self._based_on[(p, learner)] = r
      return {"mean": None, "round": r, "done": False, "accepted": False, "behind": True,
              "step": self.step}
    self._open[p][learner] = dict(delta=remote.decode(self.plans[p], payload), weight=weight,
                                  tokens=int(tokens), step=int(step), loss=float(loss),
                                  behind=behind)
    event = self._closed.setdefault((p, r), asyncio.Event())
    self._check_close(p)
    await event.wait()
    self._based_on[(p, learner)] = r + 1
    return {"mean": self._results[(p, r)], "round": r + 1,
            "done": r + 1 >= self.final_rounds[p], "accepted": True, "behind": behind > 0,
            "step": self.step}

  async def _merge(self, learner: int, p: int, base: int, payload, tokens: int, step: int,
                   loss: float) -> dict:
    """Asynchronous: learner `learner`'s Δ_p from φ_p at version `base`, merged at once (or
    dropped) as the module doc says; the answer holds φ and the shared state to go on from."""
    e = self.config.elastic
    if learner not in self.members:
      return {"mean": None, "round": self.rounds[p], "done": True, "accepted": False,
              "behind": False, "step": step}
    self.live.add(learner)
    version = self.rounds[p]
    stale = max(version - base, 0)
    behind = staleness_lib.rounds_behind(stale, max(len(self.members), 1))
    weight = staleness_lib.weight(e.staleness, behind, e.max_staleness) * tokens / \
        self._phase_tokens
    delta = remote.decode(self.plans[p], payload)
    # the merge's index: every Δ (merged or dropped) is one record of the round log
    record = {"merge": len(self.stats["rounds"]), "learner": learner, "fragment": p,
              "base_version": base, "staleness": stale, "rounds_behind": behind,
              "weight": weight, "tokens": int(tokens),
              "bytes": remote.payload_bytes(payload), "step": int(step), "time": time.time()}
    if weight > 0:
      if e.log_deltas:
        folder = self.dir / "merges"
        folder.mkdir(exist_ok=True)
        np.savez(folder / f"{record['merge']}.npz", *jax.tree.leaves(delta))
      refused = int(np.sum(self.algorithm.refused(self.shared)))
      self.shared = host(self._outer_steps[p](self.shared, self.params, weighted(delta, weight)))
      self.stats["refused"] += int(np.sum(self.algorithm.refused(self.shared))) - refused
      self.rounds[p] = version + 1
      self.stats["tokens_merged"] += int(tokens)
    else:
      self.stats["tokens_dropped"] += int(tokens)
      self.stats["dropped"].append((time.time(), learner, p, version, stale))
    record["version"] = self.rounds[p]
    self.stats["rounds"].append({"fragment": p, "round": record["merge"], "time": time.time(),
                                 "live": 1, "contributors": [learner],
                                 "accepted": [learner] if weight > 0 else [], "behind": [stale],
                                 "grace_waited_s": 0.0})
    self.stats["learner_steps"][str(learner)] = int(step)
    self.step = max(self.step, int(step))
    with (self.dir / MERGE_LOG).open("a") as f:
      f.write(json.dumps(record) + "\n")
    self._save()
    self.writer.write(self.step, {"loss": float(loss), "staleness": stale, "weight": weight,
                                  "fragment": p, "round": record["merge"]})
    for key in [k for k in self._buffer_closed if k[0] == p and k[1] <= self.rounds[p]]:
      self._buffer_closed.pop(key).set()
    every = self.config.outer_optimizer.momentum_every
    if e.buffer_barrier and weight > 0 and self.rounds[p] % every:
      target = (self.rounds[p] // every + 1) * every  # the merge whose momentum step closes it
      await self._buffer_closed.setdefault((p, target), asyncio.Event()).wait()
    return {"mean": None, "phi": self.phi, "shared": self.shared, "round": self.rounds[p],
            "done": False, "accepted": True, "behind": False, "adopt": True, "step": step}

  def _check_close(self, p: int) -> None:
    r, contributions = self.rounds[p], self._open[p]
    if not contributions:
      return
    accepted = sum(1 for x in contributions.values() if x["weight"] > 0)
    need = max(min(self.quorum, len(self.live)), 1)
    if accepted >= need:
      self.faults.quorum(p, r)  # a fault may end this process here, the quorum in hand
    if self.live <= set(contributions):
      self._close(p)
    elif accepted >= need:
      now, e = time.time(), self.config.elastic
      missing = self.live - set(contributions)
      predicted = None
      if e.adaptive_grace:
        predicted = lambda i: self.arrivals.predicted(p, i)
        if e.late == "drop":  # a Δ_p from an older φ_p than round r's would be dropped anyway
          missing = {i for i in missing if self._based_on.get((p, i), r) >= r}
      end = grace_lib.window_end(self._quorum_at.setdefault((p, r), now), e.grace_s, now,
                                 missing, predicted)
      if end <= now:
        self._close(p)
      elif self._timers.get((p, r), (None,))[0] != end:  # (re)set: an arrival may move the end
        if (p, r) in self._timers:
          self._timers[(p, r)][1].cancel()
        timer = asyncio.get_event_loop().call_later(end - now, self._close_if_open, p, r)
        self._timers[(p, r)] = (end, timer)

  def _close_if_open(self, p: int, r: int) -> None:
    if self.rounds[p] == r:
      self._close(p)

  def _close(self, p: int) -> None:
    r = self.rounds[p]
    contributions = sorted(self._open[p].items())
    taken = [(i, x) for i, x in contributions if x["weight"] > 0]
    mean = None
    if taken:
      mean = remote.mean([x["delta"] for _, x in taken], [x["weight"] for _, x in taken])
      refused = int(np.sum(self.algorithm.refused(self.shared)))
      self.shared = host(self._outer_steps[p](self.shared, self.params, mean))
      self.stats["refused"] += int(np.sum(self.algorithm.refused(self.shared))) - refused
      self.step = max(self.step, max(x["step"] for _, x in taken))
    merged = sum(x["tokens"] for _, x in taken)
    self.stats["tokens_merged"] += merged
    self.stats["tokens_dropped"] += sum(x["tokens"] for _, x in contributions) - merged
    now = time.time()
    quorum_at = self._quorum_at.pop((p, r), None)
    record = {"fragment": p, "round": r, "time": now, "live": len(self.live),
              "contributors": [i for i, _ in contributions], "accepted": [i for i, _ in taken],
              "behind": [x["behind"] for _, x in contributions],
              # the grace window's wait: quorum in to closed (0: every live learner had sent)
              "grace_waited_s": 0.0 if quorum_at is None else now - quorum_at}
    self.stats["rounds"].append(record)
    self.rounds[p] = r + 1
    self._results[(p, r)] = mean
    self._results.pop((p, r - 3), None)
    self._open[p] = {}
    _, timer = self._timers.pop((p, r), (None, None))
    if timer is not None:
      timer.cancel()
    self._save()
    losses = [(x["loss"], x["tokens"]) for _, x in taken]
    values = {"participation": len(taken) / max(len(self.live), 1), "fragment": p, "round": r}
    if losses:
      values["loss"] = sum(l * t for l, t in losses) / max(sum(t for _, t in losses), 1)
    self.writer.write(self.step, values)
    self._closed.setdefault((p, r), asyncio.Event()).set()

  def _save(self) -> None:
    self.saves += 1
    self.ckpt.save(self.saves, self._saved(),
                   {"rounds": self.rounds, "step": self.step, "stats": self.stats,
                    "live": sorted(self.live), "members": sorted(self.members),
                    "num_learners": self.config.elastic.num_learners,
                    "next_index": self._next_index})
    self.ckpt.wait()  # saved before anyone is answered: a restart never loses an answered round

  # -- the end ---------------------------------------------------------------------------------

  def finish(self) -> dict:
    """Evaluates φ on the eval batches; the counters for summary.json."""
    eval_loss, splits = evaluate(self.config, self.trainer, self.phi, self.params)
    self.writer.write(max(self.step, 1), {"eval_loss": eval_loss})
    self.writer.close()
    self.ckpt.close()
    return {"eval_loss": eval_loss, "eval_bits_per_byte": splits.bits_per_byte(eval_loss),
            "stats": self.stats, "rounds": self.rounds, "final_rounds": self.final_rounds,
            "step": self.step, "members": sorted(self.members)}


def evaluate(config, trainer, phi, like) -> tuple:
  """(the mean loss of φ over the run's eval batches, the data splits): φ cast to the dtypes of
  `like` (the model's parameters), through `trainer`'s model (the syncer's evaluation Trainer)."""
  from lowcomm_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.models import loss as loss_lib  # pylint: disable=g-import-not-at-top
  c = config
  splits = pipeline.splits_of(c)
  batches = pipeline.eval_batches(splits.eval, c.data.seq_len, c.eval.batch_size,
                                  c.eval.num_batches)
  params = jax.tree.map(lambda x, p: np.asarray(x).astype(p.dtype), phi, like)
  loss = loss_lib.jitted_loss(trainer.graphdef)
  return float(np.mean([float(loss(params, b)) for b in batches])), splits


def weighted(delta, weight: float):
  """`delta` × `weight` (float32, numpy): what an asynchronous merge hands the outer optimizer."""
  return jax.tree.map(lambda d: (np.float32(weight) * np.asarray(d, np.float32)), delta)


def outer_step_program(tx, name: str, phase, shared, params, mean):
  """The compiled outer step of plan `name` on `mean`: (shared, params, mean) -> the new shared
  part (φ, the outer optimizer state), as the syncer runs it after a round or a merge."""
  def outer_step(shared, params, mean):
    return tx.apply(shared, params, {name: mean}, phase)[1]
  return jax.jit(outer_step).lower(shared, params, mean).compile()
