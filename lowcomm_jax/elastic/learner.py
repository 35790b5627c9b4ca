"""One learner of an elastic run: the Trainer's loop on one replica, its outer communication carried
by the syncer.

A Ray actor (`ray.remote(Learner)`) owning its devices. Inside it a Trainer of the run's algorithm
on one replica (`options.learner_config`) runs its loop (`Trainer.train`) with the remote carrier
(`train.overlap.Remote`): at a plan's send the learner hands the encoded tree with its token count
to the syncer (`Syncer.exchange`), and the syncer's reply, the mean of the round, goes through the
algorithm's `apply`, as a replica of the SPMD run does with its collective's result. Learner i of N
reads shard i of N of the training data, as replica i of the SPMD run does (a learner added while
the run goes on, i ≥ N, reads shard i of i + 1: `options.data_shard`).

In an asynchronous run (`elastic.asynchronous`) every reply holds φ as the syncer's merge of this
learner's Δ left it: the learner goes on from it at once (θ ← φ, on the carrier's rejoin path),
keeping its inner state; with `elastic.local_steps=by_speed` it syncs every H_i of its own steps
(`options.local_steps`). `elastic.speeds` slows its steps for the whole run (`StepFaults`).

(Re)starting, it joins the syncer: it takes φ and the outer state (the state's shared part,
`comm.plan.shared_part`), the step, and a live peer's inner optimizer state (none alive: a fresh
one), and goes on from that step with the data it would have read there. Nobody else stops. A Δ the
syncer did not take as sent (dropped, or merged from an older φ than the round's) makes it join
again the same way, keeping its own inner state, from the syncer's step where that is ahead.
Removed from the run (`stop`, or a syncer that no longer counts it), it ends after its current
step; at `stop_at_step` every learner ends (the run resumes from the syncer's latest round). Its
files, under <workdir>/learners/<i>/: metrics.jsonl and tensorboard/ (its loss), events.jsonl (the
timeline: start, joined, sync waits, faults) and progress.json (tokens computed and bytes sent and
received, summed over its restarts).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import queue
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lowcomm_jax.comm import plan as plan_lib, remote
from lowcomm_jax.elastic import options
from lowcomm_jax.train import faults as faults_lib, hooks as hooks_lib, overlap


class Removed(Exception):
  """The learner left the run: removed, or every round it sends to is over."""


class Learner:
  """Learner `learner` of the run in `run_dir` (see the module doc)."""

  def __init__(self, config_json: str, run_dir: str, learner: int):
    import ray  # pylint: disable=g-import-not-at-top

    from lowcomm_jax.train.trainer import Trainer  # pylint: disable=g-import-not-at-top
    self.started = time.time()
    self.config = c = ml_collections.ConfigDict(json.loads(config_json))
    self.run_dir = pathlib.Path(run_dir)
    self.index = learner
    self.dir = self.run_dir / "learners" / str(learner)
    self.dir.mkdir(parents=True, exist_ok=True)
    self.event("start", pid=os.getpid())  # the process (a restart is another)
    options.use_compilation_cache(self.run_dir)  # a restarted learner compiles nothing again
    self.syncer = ray.get_actor("syncer", namespace=options.namespace(self.run_dir))
    self.trainer = Trainer(options.learner_config(c, learner), self.dir / "model")
    self.num_steps = options.local_steps(c, learner)[1]  # its own with elastic.local_steps
    self.tx = self.trainer.algorithm.tx
    if getattr(self.tx, "eager", False):  # the proxy's 1/M: M learners, not this one replica
      self.tx.eager_workers = options.num_learners(c)
    self.names = options.plan_names(self.tx)
    self.faults = faults_lib.parse(c.elastic.faults, c.elastic.num_learners)
    progress = self.dir / "progress.json"
    self.progress = (json.loads(progress.read_text()) if progress.is_file() else
                     {"tokens_computed": 0, "steps": 0, "bytes_sent": 0, "bytes_received": 0})
    # a peer's `inner_state` (another thread of the actor) is answered by the loop's thread between
    # two steps or while it waits for a round: the state's buffers are donated to the next program
    self._asks: queue.SimpleQueue = queue.SimpleQueue()
    self._serving = threading.Lock()  # held while the loop runs and answers asks
    self._looping = False
    self.latest = None  # the latest state the loop wrote (valid until its next program)
    self._ended = None  # the inner state (host arrays) once the loop ended
    self.removed = False
    # the data, a fresh state and the step program, made while Ray restarts this actor (before the
    # driver has noticed the death and calls `run`): a rejoin then waits only for φ and a peer
    self._prepared = self._prepare()
    self.event("ready")

  def _prepare(self):
    """(the data iterator of this learner's shard, a fresh state), the step program compiled."""
    from lowcomm_jax.data import pipeline  # pylint: disable=g-import-not-at-top
    c, tr = self.config, self.trainer
    splits = pipeline.splits_of(c)
    shard, num_shards = options.data_shard(c, self.index)
    data = iter(pipeline.train_dataset(splits.train, c.data.seq_len, c.data.batch_size, c.seed,
                                       shard_index=shard, num_shards=num_shards))
    state = tr.init_state()
    tr.program(overlap.Remote.program_phase(self.tx, tr.algorithm.phase_at(1)), state,
               tr.source.route_at(1))
    return data, state

  # -- served to peers (another thread of the actor) ---------------------------------------------

  def inner_state(self):
    """This learner's inner optimizer state (host arrays), taken between two of its steps."""
    with self._serving:
      looping = self._looping
      if looping:
        asked = concurrent.futures.Future()
        self._asks.put(asked)
    return asked.result() if looping else self._ended

  def stop(self) -> None:
    """Removed from the run: ends after the current step (or the round it waits for)."""
    self.removed = True

  def answer_asks(self) -> None:
    """Answers the peers' asks for the inner state from the latest state the loop wrote."""
    while not self._asks.empty():
      self._asks.get().set_result(None if self.latest is None else
                                  jax.device_get(self.latest.opt_state))

  # -- the run -----------------------------------------------------------------------------------

  def run(self) -> dict:
    """Trains until the last step (or until removed); returns this start's counts."""
    import ray  # pylint: disable=g-import-not-at-top
    c = self.config
    self.event("run")
    data, state = self._prepared or self._prepare()  # compiled before joining
    self._prepared = None
    joined = ray.get(self.syncer.join.remote(self.index))
    if not joined["member"]:  # removed from the run while it was down
      self.event("removed", step=joined["step"])
      return {"learner": self.index, "step": joined["step"], "removed": True, **self.progress}
    start = joined["step"]
    if start:  # healing: φ and the outer state, the peer's inner state, the data at that step
      opt_state = None
      if joined["peer"] is not None:
        try:  # a peer that dies meanwhile leaves the fresh inner state
          peer = ray.get_actor(options.learner_name(joined["peer"]),
                               namespace=options.namespace(self.run_dir))
          opt_state = ray.get(peer.inner_state.remote())
        except (ray.exceptions.RayActorError, ValueError):
          opt_state = None
      state = self.adopt(state, joined, start, opt_state)
      data.set_state({"next_index": start})
    self.event("joined", step=start)
    ray.get(self.syncer.started.remote())  # a new run: every learner starts together
    stop = self.num_steps if c.stop_at_step < 0 else min(c.stop_at_step, self.num_steps)
    step, self.latest = start, state
    with self._serving:
      self._looping = True
    progress = LearnerProgress(self)
    slowdown = faults_lib.slowdowns(c.elastic.speeds, options.num_learners(c))
    hooks = [progress, faults_lib.StepFaults(self.run_dir, self.faults, self.index, self.event,
                                             slowdown[self.index] if self.index < len(slowdown)
                                             else 1.0)]
    try:  # one loop: a rejoin happens inside it, on the carrier (`Link.rejoin`)
      self.trainer.train(state, start, stop, [data], overlap.Remote(self.tx, Link(self, joined,
                                                                                   data)), hooks)
      step = stop
    except Removed:
      step = progress.step
    finally:
      hooks_lib.close_quietly(hooks)
      with self._serving:
        self._looping = False
        self.answer_asks()
        self._ended = None if self.latest is None else jax.device_get(self.latest.opt_state)
    self.event("removed" if self.removed else "finished", step=step)
    return {"learner": self.index, "step": step, "removed": self.removed, **self.progress}

  def adopt(self, state, joined: dict, step: int, opt_state=None):
    """`state` with θ ← φ, the shared part of the optimizer state (φ, the outer state) from the
    syncer, at step `step`, with `opt_state`'s per-replica part (a peer's inner state) if given: a
    (re)joining or lagging learner's."""
    from lowcomm_jax.optim.inner import TrainState  # pylint: disable=g-import-not-at-top
    shardings = jax.tree.map(lambda x: x.sharding, state)
    params = jax.tree.map(lambda g, x: np.asarray(g, x.dtype)[None], joined["phi"], state.params)
    own = jax.device_get(state.opt_state) if opt_state is None else opt_state
    if getattr(self.tx, "eager", False):
      opt_state = eager_state(own, joined["shared"])
    else:
      opt_state = plan_lib.with_shared(self.tx.state_axes, own, joined["shared"])
    self.latest = jax.device_put(TrainState(params, opt_state, jnp.asarray(step, jnp.int32)),
                                 shardings)
    return self.latest

  def event(self, event: str, **fields) -> None:
    with (self.dir / "events.jsonl").open("a") as f:
      f.write(json.dumps({"time": time.time(), "event": event, **fields}) + "\n")

  def write_progress(self) -> None:
    path = self.dir / "progress.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(self.progress))
    tmp.replace(path)


def eager_state(own, shared):
  """An eager learner's optimizer state (one replica) going on from the syncer's φ and outer state
  (`options.syncer_algorithm`'s shared part): its φ_m ← φ, nothing of its own in flight (its kept
  Δ and the in-flight means zero, so its next proxy takes no old share out), its inner state."""
  one = lambda tree: jax.tree.map(lambda x: np.asarray(x)[None], tree)
  zeros = lambda tree: jax.tree.map(np.zeros_like, tree)
  return own._replace(count=shared.count, outer_params=one(shared.outer_params),
                      outer_states=one(shared.outer_states), nonfinite=one(shared.nonfinite),
                      own_deltas=zeros(own.own_deltas),
                      comm=own.comm._replace(in_flight=zeros(own.comm.in_flight)))


class Link:
  """The remote carrier's link to the syncer (`overlap.Remote`): sends a plan's payload with the
  tokens and the mean loss since this learner's last send of it; waits for the round's mean,
  answering the peers' asks meanwhile; joins again when the syncer did not take a Δ as sent."""

  def __init__(self, learner: Learner, joined: dict, data):
    self.learner, self.data = learner, data
    self._adopt = None  # asynchronous: the reply whose φ the learner goes on from
    self._start(joined)

  def _start(self, joined: dict) -> None:
    self.rounds = list(joined["rounds"])  # per plan: the round of the φ its next Δ starts from
    self.tokens = [0] * len(self.learner.names)
    self.losses = [[] for _ in self.learner.names]

  def rejoin(self, state, step: int):
    """(the state to go on from, its step) after a Δ the syncer did not take as sent: φ and the
    outer state from the syncer, this learner's own inner state, at the syncer's step where that
    is ahead (the data moved there)."""
    import ray  # pylint: disable=g-import-not-at-top
    ln = self.learner
    if self._adopt is not None:  # asynchronous: on from φ as the merge left it, at this step
      reply, self._adopt = self._adopt, None
      return ln.adopt(state, reply, step), step
    joined = ray.get(ln.syncer.join.remote(ln.index))
    if not joined["member"]:
      raise Removed()
    self._start(joined)
    if joined["step"] > step:  # behind the others: on from their step
      ln.event("caught_up", step=step, to=joined["step"])
      self.data.set_state({"next_index": joined["step"]})
    at = max(step, joined["step"])
    return ln.adopt(state, joined, at), at

  def count(self, tokens: int, loss: float) -> None:
    for p in range(len(self.tokens)):
      self.tokens[p] += tokens
      self.losses[p].append(loss)

  def send(self, step: int, name: str, payload):
    ln, p = self.learner, self.learner.names.index(name)
    ln.progress["bytes_sent"] += remote.payload_bytes(payload)
    ref = ln.syncer.exchange.remote(ln.index, p, self.rounds[p], payload, self.tokens[p], step,
                                    float(np.mean(self.losses[p])) if self.losses[p] else 0.0)
    self.tokens[p], self.losses[p] = 0, []
    return p, step, ref

  def receive(self, handle):
    import ray  # pylint: disable=g-import-not-at-top
    ln, (p, step, ref) = self.learner, handle
    ln.event("sync_begin", step=step, fragment=p)
    while not ray.wait([ref], timeout=0.05)[0]:
      ln.answer_asks()
    reply = ray.get(ref)
    ln.event("sync_end", step=step, fragment=p, accepted=reply["accepted"])
    self.rounds[p] = reply["round"]
    if reply.get("adopt"):  # asynchronous: merged (or dropped); φ of that moment replaces ours
      ln.progress["bytes_received"] += remote.reply_bytes(reply["phi"])
      self._adopt = reply
      raise overlap.Rejoin()
    if not reply["accepted"]:
      raise Removed() if reply["done"] else overlap.Rejoin()
    ln.progress["bytes_received"] += remote.reply_bytes(reply["mean"])
    if reply["behind"]:  # merged, but this learner's φ is older than the round's
      raise overlap.Rejoin()
    return reply["mean"]


class LearnerProgress(hooks_lib.Hook):
  """The learner's own log (its loss every log_every steps), its progress (tokens computed, steps,
  bytes) after every step, the tokens and losses each send counts, the peers' asks answered and a
  removal seen between two steps."""

  def __init__(self, learner: Learner):
    from lowcomm_jax.train import metrics  # pylint: disable=g-import-not-at-top
    self.learner = learner
    self.step = 0
    self._metrics = metrics
    self.writer = None
    self.link = None
    c = learner.config
    self.tokens_per_step = c.data.batch_size * c.data.seq_len

  def begin(self, loop) -> None:
    c = self.learner.config
    self.step, self.link = loop.start, loop.carrier.link
    self.writer = self._metrics.MetricWriter(self.learner.dir, c.num_steps, loop.start,
                                             progress_bar=False)

  def dispatched(self, step, state, metrics) -> None:
    ln = self.learner
    ln.latest = state
    loss = float(np.mean(metrics["loss"]))
    self.step = step
    self.link.count(self.tokens_per_step, loss)
    ln.progress["tokens_computed"] += self.tokens_per_step
    ln.progress["steps"] += 1
    if step % ln.config.log_every == 0:
      self.writer.write(step, {"loss": loss})

  def after_step(self, step, phase, state, metrics):
    ln = self.learner
    ln.latest = state
    ln.answer_asks()
    ln.write_progress()
    if ln.removed:
      raise Removed()
    return state

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()
      self.writer = None
