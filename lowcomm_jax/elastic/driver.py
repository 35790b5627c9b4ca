"""The driver of an elastic run: Ray, the syncer and N learners, faults from outside, the summary.

  summary = lowcomm_jax.elastic.run(config, workdir)
  run = lowcomm_jax.elastic.start(config, workdir)   # or: add and remove learners as it goes on
  run.add_learner(); run.remove_learner(0); summary = run.wait()

1. Every check (`options.check`, the workdir as the Trainer checks it: another config's run, a
   finished one, a second start) before Ray starts; then config.json and the run lock.
2. Ray: `elastic.address` "" starts a local one bound to 127.0.0.1 (token authentication is Ray's
   default, `RAY_AUTH_MODE=token`); "auto" or host:port joins a running cluster (`ray start`).
3. The syncer (`syncer.Syncer`) and learners (`learner.Learner`) as actors that Ray restarts
   (`elastic.max_restarts`). A learner whose run ends in an error has died: the syncer is told
   (`leave`, its rounds stop waiting for it) and its `run` is called again, which waits for Ray's
   restart and rejoins. `elastic.faults_per_hour` kills random learners from here (`ray.kill`).
4. When every learner has finished: φ's evaluation and summary.json: goodput (tokens merged into φ
   ÷ tokens computed), participation per round (accepted Δ ÷ live learners), rejoin times (death
   to joined), faults, bytes each learner sent and received.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import queue
import threading
import time
import warnings

import ml_collections

from lowcomm_jax import checks, config as config_lib
from lowcomm_jax.data import corpora
from lowcomm_jax.elastic import options
from lowcomm_jax.train import faults as faults_lib, run_inputs, workdir as workdir_lib


def start_ray(address: str, num_cpus: float, temp_dir: str | None = None):
  """`ray.init` for an elastic run: local on 127.0.0.1 (address "") or a running cluster; a Ray
  already initialized in this process is used as it is (returned with False: not ours to stop)."""
  if not address:
    # Ray binds its servers to the node's address; this makes a local node's address 127.0.0.1,
    # so nothing listens beyond this machine (read when ray is first imported)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
  import ray  # pylint: disable=g-import-not-at-top
  if ray.is_initialized():
    return ray, False
  with warnings.catch_warnings():
    # Ray starts its services with fork + exec, which jax's at-fork hook warns of needlessly
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
    if address:
      ray.init(address=address, logging_level="warning", log_to_driver=False)
    else:
      ray.init(_node_ip_address="127.0.0.1", num_cpus=num_cpus, include_dashboard=False,
               logging_level="warning", log_to_driver=False, _temp_dir=temp_dir)
  return ray, True


def run(config: ml_collections.ConfigDict, workdir) -> dict:
  """Trains as `config` says with elastic learners; returns the summary (also summary.json)."""
  return start(config, workdir).wait()


def start(config: ml_collections.ConfigDict, workdir) -> "ElasticRun":
  """Starts the run as `config` says and returns at once: learners can be added and removed while
  it goes on (`ElasticRun.add_learner`, `remove_learner`); `wait()` returns the summary."""
  config = options.check(config)  # checked once, parsed: a RunConfig from here on
  work = workdir_lib.check_path(workdir)
  identity = corpora.corpus_identity(config.data.corpus, config.data.tokenizer)
  inputs = run_inputs.describe(config)
  state = workdir_lib.check_workdir(work, config_lib.fingerprint(config),
                                    config_lib.fingerprint(config_lib.default_config()), identity,
                                    inputs, kind="elastic")
  if state == workdir_lib.COMPLETE:
    return ElasticRun(config, work, None, complete=True)
  lock = workdir_lib.lock_run(work)
  try:
    if state == workdir_lib.NEW:
      workdir_lib.write_config(work, config.to_dict(),
                               config_lib.fingerprint(config), identity, inputs, kind="elastic")
    return ElasticRun(config, work, lock)
  except BaseException:
    if lock is not None:
      lock.release()
    raise


class ElasticRun:
  """A started elastic run (`start`). Its driver loop runs on a thread of this process: it restarts
  learners that died, kills learners for `elastic.faults_per_hour` and serves membership changes.

    run = lowcomm_jax.elastic.start(config, workdir)
    new = run.add_learner()      # one more learner, index `new`, trains from the next round on
    run.remove_learner(0)        # learner 0 leaves after its current step
    summary = run.wait()         # when every learner has finished: summary.json's content

  Membership changes are saved with φ: a resume with the same config has the same learners (a
  resume with another `elastic.num_learners` has learners 0 … N − 1)."""

  def __init__(self, config, work: pathlib.Path, lock, complete: bool = False):
    self.config, self.work, self._lock = config, work, lock
    self._result = workdir_lib.report_complete(work) if complete else None
    self._error = None
    self._requests: queue.Queue = queue.Queue()
    self._thread = None
    if complete:
      return
    e = config.elastic
    self._ray, self._ray_started = start_ray(
        e.address, max(os.cpu_count() or 1, options.num_learners(config) * e.learner_cpus + 1))
    self.learners, self._runs, self.syncer = {}, {}, None
    try:
      from lowcomm_jax.elastic.syncer import Syncer  # pylint: disable=g-import-not-at-top
      self._namespace = options.namespace(work)
      self._config_json = json.dumps(config.to_dict())
      self.began = time.time()
      self.syncer = (
        self._ray.remote(Syncer)
        .options(
          name="syncer",
          namespace=self._namespace,
          max_restarts=e.max_restarts,
          max_task_retries=-1,
          num_cpus=0,
          max_concurrency=1000,
        )
        .remote(self._config_json, str(work))
      )
      self._ray.get(self.syncer.begin.remote())
      for i in self._ray.get(self.syncer.status.remote())["members"]:  # resumed: as saved
        self._start_learner(i)
    except BaseException:
      self._end_actors()
      self._stop_ray()
      raise
    print(f"elastic run: {len(self.learners)} learners, quorum {options.quorum(config)}, grace "
          f"{e.grace_s} s{' (adaptive)' if e.adaptive_grace else ''}, workdir {work}", flush=True)
    self._thread = threading.Thread(target=self._loop, name="elastic-driver", daemon=True)
    self._thread.start()

  # -- the API ---------------------------------------------------------------------------------

  def add_learner(self) -> int:
    """Adds a learner to the run going on; returns its index. It joins like a restarted learner
    (φ, the step of the latest round, a peer's inner state) and reads `options.data_shard`."""
    return self._ask("add", None)

  def remove_learner(self, learner: int) -> None:
    """Removes learner `learner` from the run going on: the rounds stop waiting for it at once, it
    ends after its current step (a Δ it already sent is merged), Ray does not restart it."""
    return self._ask("remove", learner)

  def status(self) -> dict:
    """The syncer's view while the run goes on: rounds, step, live learners, members, done."""
    self._going_on()
    return self._ray.get(self.syncer.status.remote())

  def wait(self, timeout: float | None = None) -> dict:
    """Waits for the end of the run (every learner finished): summary.json's content; at
    `stop_at_step`, the step and rounds reached (no summary: the run resumes)."""
    if self._thread is not None:
      self._thread.join(timeout)
      if self._thread.is_alive():
        raise TimeoutError(f"the elastic run in {self.work} goes on after {timeout} s")
      self._thread = None
      self._stop_ray()
    if self._error is not None:
      raise self._error
    return self._result

  # -- the loop --------------------------------------------------------------------------------

  def _going_on(self) -> None:
    if self._thread is None or not self._thread.is_alive():
      raise RuntimeError(f"the elastic run in {self.work} is not going on")

  def _ask(self, kind: str, arg):
    self._going_on()
    thread, answer = self._thread, concurrent.futures.Future()
    self._requests.put((kind, arg, answer))
    while True:
      try:
        return answer.result(timeout=0.5)
      except concurrent.futures.TimeoutError:
        if not thread.is_alive() and not answer.done():  # the run ended before serving it
          raise RuntimeError(f"the elastic run in {self.work} is not going on") from None

  def _start_learner(self, i: int) -> None:
    from lowcomm_jax.elastic.learner import Learner  # pylint: disable=g-import-not-at-top
    e = self.config.elastic
    self.learners[i] = self._ray.remote(Learner).options(
        name=options.learner_name(i), namespace=self._namespace, max_restarts=e.max_restarts,
        max_task_retries=0, max_concurrency=3, num_cpus=e.learner_cpus,
        num_gpus=e.learner_gpus).remote(self._config_json, str(self.work), i)
    self._runs[i] = self.learners[i].run.remote()

  def _serve(self, kind: str, arg, removed: set) -> object:
    ray = self._ray
    if kind == "add":
      i = ray.get(self.syncer.add.remote())
      self._start_learner(i)
      return i
    members = ray.get(self.syncer.status.remote())["members"]
    checks.require(isinstance(arg, int) and arg in members, "remove_learner's learner",
                   f"one of the run's learners {members}", arg)
    checks.require(len(members) > 1, "remove_learner's learner",
                   "a learner other than the run's last one", arg)
    ray.get(self.syncer.remove.remote(arg))
    removed.add(arg)
    try:
      ray.get(self.learners[arg].stop.remote(), timeout=30)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # down: not restarted
      ray.kill(self.learners[arg], no_restart=True)
    return None

  def _loop(self) -> None:
    try:
      self._result = self._drive()
    except BaseException as error:  # pylint: disable=broad-except
      self._error = error
    finally:
      self._end_actors()
      while not self._requests.empty():  # asked as the run ended
        self._requests.get()[2].set_exception(
            RuntimeError(f"the elastic run in {self.work} is not going on"))
      if self._lock is not None:
        self._lock.release()

  def _drive(self) -> dict:
    ray, work, e = self._ray, self.work, self.config.elastic
    runs, finished, deaths, removed = self._runs, {}, [], set()
    kills = faults_lib.PoissonKills(work, e.faults_per_hour, e.timeout_s, list(self.learners),
                                    self.config.seed)
    while runs:
      if time.time() - self.began > e.timeout_s:
        raise TimeoutError(f"the elastic run did not finish within elastic.timeout_s={e.timeout_s} "
                           f"seconds; it resumes from {work} when started again")
      while not self._requests.empty():
        kind, arg, answer = self._requests.get()
        try:
          answer.set_result(self._serve(kind, arg, removed))
        except Exception as error:  # pylint: disable=broad-except
          answer.set_exception(error)
      ready, _ = ray.wait(list(runs.values()), num_returns=1, timeout=0.2)
      for ref in ready:
        i = next(k for k, v in runs.items() if v == ref)
        try:
          finished[i] = ray.get(ref)
          del runs[i]
        except ray.exceptions.RayActorError as error:  # died, or still restarting after a death
          if i in removed:
            del runs[i]
            continue
          last = [d["time"] for d in deaths if d["learner"] == i]
          # a call sent while Ray restarts it fails too: a new death only once it had rejoined
          if not last or _joined_after(work, i, last[-1]):
            deaths.append({"learner": i, "time": time.time()})
            ray.get(self.syncer.leave.remote(i))
          if isinstance(error, ray.exceptions.ActorDiedError) and "exhausted" in str(error):
            del runs[i]  # Ray gave up on it (elastic.max_restarts): the run goes on without it
          else:
            runs[i] = self.learners[i].run.remote()  # waits for Ray's restart, then rejoins
      for victim in kills.due(time.time() - self.began, set(runs) - removed):
        ray.kill(self.learners[victim], no_restart=False)
    status = ray.get(self.syncer.status.remote())
    if not status["done"]:  # stop_at_step: the learners ended before the last round
      return {"complete": False, "step": status["step"], "rounds": status["rounds"],
              "members": status["members"], "workdir": str(work.absolute())}
    result = ray.get(self.syncer.finish.remote())
    summary = _summary(self.config, work, result, finished, deaths, time.time() - self.began,
                       max(self.learners) + 1)  # indices 0 … n − 1: every learner it had
    return workdir_lib.write_summary(work, summary)

  def _end_actors(self) -> None:
    """The run's actors end with it (also on a cluster that outlives the run; a resume starts its
    own under the same names)."""
    for actor in [*self.learners.values(), *([self.syncer] if self.syncer else [])]:
      try:
        self._ray.kill(actor, no_restart=True)
      except Exception:  # pylint: disable=broad-except
        pass  # already gone

  def _stop_ray(self) -> None:
    if self._ray_started:
      self._ray.shutdown()
      self._ray_started = False


def _summary(config, work: pathlib.Path, result: dict, finished: dict, deaths: list,
             wall: float, n: int) -> dict:
  """`n`: learners the run had (indices 0 … n − 1, those added included)."""
  progress = [_read_json(work / "learners" / str(i) / "progress.json") for i in range(n)]
  computed = sum(p.get("tokens_computed", 0) for p in progress)
  num_fragments = max(len(result["rounds"]), 1)
  stats = result["stats"]
  participation = [len(r["accepted"]) / max(r["live"], 1) for r in stats["rounds"]]
  return {
      "algorithm": config.algorithm,
      "elastic": True,
      "config": config.to_dict(),
      "steps": result["step"],
      "final_eval_loss": result["eval_loss"],
      "final_eval_bits_per_byte": result["eval_bits_per_byte"],
      "learners": n,
      "members": result["members"],  # at the end (added and removed ones counted)
      "added": [i for _, i in stats["added"]],
      "removed": [i for _, i in stats["removed"]],
      # each token reaches every fragment once: merged tokens per fragment ÷ tokens computed
      "goodput": stats["tokens_merged"] / num_fragments / computed if computed else None,
      "tokens_computed": computed,
      "tokens_merged": stats["tokens_merged"] / num_fragments,
      "tokens_dropped": stats["tokens_dropped"] / num_fragments,
      "participation": sum(participation) / len(participation) if participation else None,
      "participation_per_round": participation,
      # rounds whose merge took each learner's Δ, ÷ rounds closed
      "participation_per_learner": [sum(i in r["accepted"] for r in stats["rounds"])
                                    / max(len(stats["rounds"]), 1) for i in range(n)],
      "rounds": result["rounds"],
      # per closed round: fragment, round, time, live learners, contributors, accepted, rounds
      # behind, the grace window's wait
      "round_log": stats["rounds"],
      "rejoin_s": rejoin_times(work, deaths),
      "deaths": deaths,
      "faults": faults_lib.fired(work),
      "refused_outer_steps": stats["refused"],
      "bytes_sent_per_learner": [p.get("bytes_sent", 0) for p in progress],
      "bytes_received_per_learner": [p.get("bytes_received", 0) for p in progress],
      "learner_steps": [finished.get(i, {}).get("step") for i in range(n)],
      "wall_time_s": wall,
      "workdir": str(work.absolute()),
  }


def events(work: pathlib.Path, learner: int) -> list[dict]:
  path = pathlib.Path(work) / "learners" / str(learner) / "events.jsonl"
  if not path.is_file():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _joined_after(work: pathlib.Path, learner: int, t: float) -> bool:
  return any(ev["event"] == "joined" and ev["time"] > t for ev in events(work, learner))


def rejoin_times(work: pathlib.Path, deaths: list) -> list[float]:
  """Seconds from each death (as the driver saw it) to the restarted learner's next `joined`."""
  times = []
  for death in deaths:
    joined = [ev["time"] for ev in events(work, death["learner"])
              if ev["event"] == "joined" and ev["time"] > death["time"]]
    if joined:
      times.append(min(joined) - death["time"])
  return times


def _read_json(path: pathlib.Path) -> dict:
  return json.loads(path.read_text()) if path.is_file() else {}
