"""One learner of an elastic run: an independent training program that syncs fragments with a
syncer.

A Ray actor (`ray.remote(Learner)`) owning its devices. Inside it the Trainer's machinery builds one
replica (`options.learner_config`: the inner optimizer alone, compiled for its own mesh) and learner
i of N reads shard i of N of the training data, as replica i of the SPMD run does (a learner added
while the run goes on, i ≥ N, reads shard i of i + 1: `options.data_shard`). At the steps the
SPMD run's schedule names (`StreamingDiLoCo.phase_at`) it

  - takes Δ_p = φ_p − θ_p of the fragment due and sends it (`comm.remote.encode`, the fragment's
    plan: float32 or the codec) with its token count to the syncer, without waiting;
  - keeps training for τ steps, then waits for the round's φ_p and merges it,
    θ_p ← α·θ_p + (1 − α)·φ_p (`StreamingDiLoCo.merge`), as an SPMD replica does.

(Re)starting, it joins the syncer: it takes φ, the current rounds and step, and a live peer's inner
optimizer state (none alive: a fresh one), and goes on from that step with the data it would have
read there. Nobody else stops. Removed from the run (`stop`, or a syncer that no longer counts
it), it ends after its current step; at `stop_at_step` every learner ends (the run resumes from the
syncer's latest round). Its files, under <workdir>/learners/<i>/: metrics.jsonl and
tensorboard/ (its loss), events.jsonl (the timeline: start, joined, sync waits, faults) and
progress.json (tokens computed and bytes sent and received, summed over its restarts).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lowcomm_jax import comm
from lowcomm_jax.comm import remote
from lowcomm_jax.elastic import options
from lowcomm_jax.optim import fragments as frag_lib, schedule as schedule_lib
from lowcomm_jax.train import faults as faults_lib


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
    self._event("start", pid=os.getpid())  # the process (a restart is another)
    options.use_compilation_cache(self.run_dir)  # a restarted learner compiles nothing again
    self.syncer = ray.get_actor("syncer", namespace=options.namespace(self.run_dir))
    self.trainer = Trainer(options.learner_config(c), self.dir / "model")
    abstract = self.trainer.abstract_params()
    self.tx = options.outer_transform(c, abstract)
    self.frags = self.tx.fragments(abstract)
    self.plans = [self.tx.plans(schedule_lib.Phase(send=(p,)))[self.tx.plan_name(p)]
                  for p in range(len(self.frags))]
    self.faults = faults_lib.parse(c.elastic.faults, c.elastic.num_learners)
    self._handled = set()  # this start's faults already looked at
    progress = self.dir / "progress.json"
    self.progress = (json.loads(progress.read_text()) if progress.is_file() else
                     {"tokens_computed": 0, "steps": 0, "bytes_sent": 0, "bytes_received": 0})
    # held while a step or a merge replaces the state (a peer's `inner_state` reads it in between,
    # also while this learner waits for a round)
    self._lock = threading.Lock()
    self._state = None
    self._removed = False
    # the data, a fresh state and the step program, made while Ray restarts this actor (before the
    # driver has noticed the death and calls `run`): a rejoin then waits only for φ and a peer
    self._prepared = self._prepare()
    self._event("ready")

  def _prepare(self):
    """(the data iterator of this learner's shard, a fresh state), the step program compiled."""
    from lowcomm_jax.data import pipeline  # pylint: disable=g-import-not-at-top
    c, tr = self.config, self.trainer
    splits = pipeline.splits_of(c)
    shard, num_shards = options.data_shard(c, self.index)
    data = iter(pipeline.train_dataset(splits.train, c.data.seq_len, c.data.batch_size, c.seed,
                                       shard_index=shard, num_shards=num_shards))
    state = tr.init_state()
    tr.program(tr.algorithm.phase_at(1), state, tr.source.route_at(1))
    return data, state

  # -- served to peers (another thread of the actor) ---------------------------------------------

  def inner_state(self):
    """This learner's inner optimizer state (host arrays), taken between two of its steps."""
    with self._lock:
      return None if self._state is None else jax.device_get(self._state.opt_state)

  def stop(self) -> None:
    """Removed from the run: ends after the current step (or the round it waits for)."""
    self._removed = True

  # -- the loop ----------------------------------------------------------------------------------

  def run(self) -> dict:
    """Trains until the last step or the last round; returns this start's counts."""
    import ray  # pylint: disable=g-import-not-at-top

    from lowcomm_jax import distributed  # pylint: disable=g-import-not-at-top
    from lowcomm_jax.train import metrics  # pylint: disable=g-import-not-at-top
    c, tr = self.config, self.trainer
    self._event("run")
    data, state = self._prepared or self._prepare()  # compiled before joining
    self._prepared = None
    joined = ray.get(self.syncer.join.remote(self.index))
    if not joined["member"]:  # removed from the run while it was down
      self._event("removed", step=joined["step"])
      return {"learner": self.index, "step": joined["step"], "removed": True, **self.progress}
    start, phi, base_round = joined["step"], joined["phi"], list(joined["rounds"])
    if start:  # healing: φ, the peer's inner state, the data at that step
      opt_state = state.opt_state
      if joined["peer"] is not None:
        try:  # a peer that dies meanwhile leaves the fresh inner state
          peer = ray.get_actor(options.learner_name(joined["peer"]),
                               namespace=options.namespace(self.run_dir))
          shared = ray.get(peer.inner_state.remote())
        except (ray.exceptions.RayActorError, ValueError):
          shared = None
        opt_state = shared if shared is not None else opt_state
      state = self._adopt(state, phi, start, opt_state)
      data.set_state({"next_index": start})
    self._event("joined", step=start)
    ray.get(self.syncer.started.remote())  # a new run: every learner starts together
    writer = metrics.MetricWriter(self.dir, c.num_steps, start, progress_bar=False)
    tokens_per_step = c.data.batch_size * c.data.seq_len
    residuals = [jax.tree.map(np.zeros_like, frag_lib.extract(f, phi)) if plan.error_feedback
                 else None for f, plan in zip(self.frags, self.plans)]
    tokens_since = [0] * len(self.frags)
    losses_since = [[] for _ in self.frags]
    pending = {}
    done = set()
    delta_fns = [jax.jit(lambda g, params, f=f: self.tx.outer_gradient(f, g, _first(params)))
                 for f in self.frags]
    merge_fns = [self._merge_fn(p, state) for p in range(len(self.frags))]
    slow, step_times = 1.0, []
    step = start
    stop = c.num_steps if c.stop_at_step < 0 else min(c.stop_at_step, c.num_steps)
    while step < stop and not self._removed:
      step += 1
      began = time.perf_counter()
      batch = distributed.global_array(next(data)[None], tr.batch_sharding(),
                                       (1, c.data.batch_size, c.data.seq_len + 1))
      program, _ = tr.program(tr.algorithm.phase_at(step), state, tr.source.route_at(step))
      with self._lock:
        state, step_metrics = program(state, batch)
        self._state = state
      loss = float(np.mean(step_metrics["loss"]))
      for p in range(len(self.frags)):
        tokens_since[p] += tokens_per_step
        losses_since[p].append(loss)
      self.progress["tokens_computed"] += tokens_per_step
      self.progress["steps"] += 1
      if step % c.log_every == 0:
        writer.write(step, {"loss": loss})
      phase = self.tx.phase_at(step)
      for p in phase.send:
        if p in done:
          continue
        delta = jax.device_get(delta_fns[p](phi, state.params))
        ledger = comm.Ledger()
        with ledger.recording():
          payload, residuals[p] = remote.encode(self.plans[p], self.tx.plan_name(p), delta,
                                                residuals[p])
        self.progress["bytes_sent"] += ledger.sent_bytes
        pending[p] = self.syncer.exchange.remote(self.index, p, base_round[p], payload,
                                                 tokens_since[p], step,
                                                 float(np.mean(losses_since[p])))
        tokens_since[p], losses_since[p] = 0, []
      for p in phase.receive:
        if p not in pending:  # sent before this learner (re)joined
          continue
        self._event("sync_begin", step=step, fragment=p)
        reply = ray.get(pending.pop(p))
        self._event("sync_end", step=step, fragment=p, accepted=reply["accepted"])
        phi = frag_lib.insert(self.frags[p], phi, reply["phi"])
        self.progress["bytes_received"] += remote.reply_bytes(reply["phi"])
        base_round[p] = reply["round"]
        with self._lock:
          state = self._state = state._replace(params=merge_fns[p](state.params, reply["phi"]))
        if reply["done"]:
          done.add(p)
        elif not reply["accepted"] and reply["step"] > step:  # behind the others: catch up
          joined = ray.get(self.syncer.join.remote(self.index))
          if joined["step"] > step:
            self._event("caught_up", step=step, to=joined["step"])
            phi, base_round, pending = joined["phi"], list(joined["rounds"]), {}
            state = self._adopt(state, phi, joined["step"])
            step = joined["step"]
            data.set_state({"next_index": step})
            tokens_since, losses_since = [0] * len(self.frags), [[] for _ in self.frags]
            break
      self._write_progress()
      if step > start + 1:  # the first step of a start compiles
        step_times.append(time.perf_counter() - began)
      slow = self._faults_at(step, slow)
      if slow > 1 and step_times:  # F times this learner's usual step time
        time.sleep((slow - 1) * float(np.median(step_times[-20:])))
      if len(done) == len(self.frags):
        break
    writer.close()
    self._event("removed" if self._removed else "finished", step=step)
    return {"learner": self.index, "step": step, "removed": self._removed, **self.progress}

  def _adopt(self, state, phi, step: int, opt_state=None):
    """The state with θ ← φ (all of it) at step `step` (and `opt_state`, a peer's inner state, if
    given): a (re)joining or lagging learner's."""
    from lowcomm_jax.optim.inner import TrainState  # pylint: disable=g-import-not-at-top
    shardings = jax.tree.map(lambda x: x.sharding, state)
    params = jax.tree.map(lambda g, x: np.asarray(g, x.dtype)[None], phi, state.params)
    with self._lock:
      opt_state = state.opt_state if opt_state is None else opt_state
      self._state = jax.device_put(TrainState(params, opt_state,
                                              jnp.asarray(step, jnp.int32)), shardings)
    return self._state

  def _merge_fn(self, p: int, state):
    frag = self.frags[p]

    def merge(params_r, global_p):
      local = _first(params_r)
      merged = self.tx.merge(p, frag_lib.extract(frag, local), global_p)
      return jax.tree.map(lambda x: x[None], frag_lib.insert(frag, local, merged))

    shardings = jax.tree.map(lambda x: x.sharding, state.params)
    return jax.jit(merge, out_shardings=shardings, donate_argnums=0)

  def _faults_at(self, step: int, slow: float) -> float:
    """Fires this learner's faults due after `step`; returns the slow-down factor from now on."""
    for fault in self.faults:  # at step S, or the first step after it (a catch-up skips steps)
      if fault.learner != self.index or step < fault.step or fault in self._handled:
        continue
      self._handled.add(fault)  # looked at once per start: no marker file to test every step
      if fault.kind == "slow":
        slow = max(slow, fault.factor)  # from this step on, for the rest of the run
        faults_lib.fire_once(self.run_dir, fault)
      elif faults_lib.fire_once(self.run_dir, fault):
        self._event(fault.kind, step=step, seconds=fault.seconds)
        if fault.kind == "kill":
          os._exit(1)  # pylint: disable=protected-access
        # SIGSTOP from another process, which wakes this one D seconds later; it looks every
        # 0.1 s and ends at once when something else woke or ended this process first, so it
        # never outlives the stop nor signals a process id that was used again
        pid, ticks = os.getpid(), max(1, math.ceil(fault.seconds * 10))
        subprocess.Popen(["sh", "-c", f"kill -STOP {pid}; i=0; while [ $i -lt {ticks} ]; do "
                          f"sleep 0.1; i=$((i+1)); grep -q '^State:.*stopped' /proc/{pid}/status "
                          f"2>/dev/null || exit 0; done; kill -CONT {pid}"], start_new_session=True)
        time.sleep(0.05)
    return slow

  def _event(self, event: str, **fields) -> None:
    with (self.dir / "events.jsonl").open("a") as f:
      f.write(json.dumps({"time": time.time(), "event": event, **fields}) + "\n")

  def _write_progress(self) -> None:
    path = self.dir / "progress.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(self.progress))
    tmp.replace(path)


def _first(params_r):
  return jax.tree.map(lambda x: x[0], params_r)
