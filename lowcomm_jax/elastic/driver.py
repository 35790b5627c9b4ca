"""The driver of an elastic run: Ray, the syncer and N learners, faults from outside, the summary.

  summary = lowcomm_jax.elastic.run(config, workdir)

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

import json
import os
import pathlib
import time
import warnings

import ml_collections

from lowcomm_jax import config as config_lib
from lowcomm_jax.data import corpora
from lowcomm_jax.elastic import faults as faults_lib
from lowcomm_jax.elastic import options
from lowcomm_jax.train import workdir as workdir_lib


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
  options.check(config)
  work = workdir_lib.check_path(workdir)
  identity = corpora.corpus_identity(config.data.corpus, config.data.tokenizer)
  state = workdir_lib.check_workdir(work, config_lib.fingerprint(config),
                                    config_lib.fingerprint(config_lib.default_config()), identity)
  if state == workdir_lib.COMPLETE:
    return workdir_lib.report_complete(work)
  lock = workdir_lib.lock_run(work)
  try:
    if state == workdir_lib.NEW:
      workdir_lib.write_config(work, json.loads(config.to_json_best_effort()),
                               config_lib.fingerprint(config), identity)
    return _run(config, work)
  finally:
    if lock is not None:
      lock.release()


def _run(config, work: pathlib.Path) -> dict:
  e, n = config.elastic, options.num_learners(config)
  ray, started = start_ray(e.address, max(os.cpu_count() or 1, n * e.learner_cpus + 1))
  from lowcomm_jax.elastic.learner import Learner  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.elastic.syncer import Syncer  # pylint: disable=g-import-not-at-top
  namespace = options.namespace(work)
  config_json = config.to_json_best_effort()
  began = time.time()
  try:
    syncer = ray.remote(Syncer).options(
        name="syncer", namespace=namespace, max_restarts=e.max_restarts, max_task_retries=-1,
        num_cpus=0, max_concurrency=1000).remote(config_json, str(work))
    learners = [ray.remote(Learner).options(
        name=options.learner_name(i), namespace=namespace, max_restarts=e.max_restarts,
        max_task_retries=0, max_concurrency=2, num_cpus=e.learner_cpus,
        num_gpus=e.learner_gpus).remote(config_json, str(work), i) for i in range(n)]
    runs = {i: learners[i].run.remote() for i in range(n)}
    kills = faults_lib.poisson_kills(e.faults_per_hour, e.timeout_s, n, config.seed)
    finished, deaths = {}, []
    print(f"elastic run: {n} learners, quorum {options.quorum(config)}, grace {e.grace_s} s, "
          f"workdir {work}", flush=True)
    while runs:
      if time.time() - began > e.timeout_s:
        raise TimeoutError(f"the elastic run did not finish within elastic.timeout_s={e.timeout_s} "
                           f"seconds; it resumes from {work} when started again")
      ready, _ = ray.wait(list(runs.values()), num_returns=1, timeout=0.2)
      for ref in ready:
        i = next(k for k, v in runs.items() if v == ref)
        try:
          finished[i] = ray.get(ref)
          del runs[i]
        except ray.exceptions.RayActorError as error:  # died, or still restarting after a death
          last = [d["time"] for d in deaths if d["learner"] == i]
          # a call sent while Ray restarts it fails too: a new death only once it had rejoined
          if not last or _joined_after(work, i, last[-1]):
            deaths.append({"learner": i, "time": time.time()})
            ray.get(syncer.leave.remote(i))
          if isinstance(error, ray.exceptions.ActorDiedError) and "exhausted" in str(error):
            del runs[i]  # Ray gave up on it (elastic.max_restarts): the run goes on without it
          else:
            runs[i] = learners[i].run.remote()  # waits for Ray's restart, then rejoins
      while kills and time.time() - began >= kills[0][0]:
        _, victim = kills.pop(0)
        if victim in runs:
          faults_lib.fire_once(work, faults_lib.Fault("kill", learner=victim, step=-len(deaths) - 1))
          ray.kill(learners[victim], no_restart=False)
    result = ray.get(syncer.finish.remote())
  finally:
    if started:
      ray.shutdown()
  summary = _summary(config, work, result, finished, deaths, time.time() - began)
  return workdir_lib.write_summary(work, summary)


def _summary(config, work: pathlib.Path, result: dict, finished: dict, deaths: list,
             wall: float) -> dict:
  n = options.num_learners(config)
  progress = [_read_json(work / "learners" / str(i) / "progress.json") for i in range(n)]
  computed = sum(p.get("tokens_computed", 0) for p in progress)
  num_fragments = max(len(result["rounds"]), 1)
  stats = result["stats"]
  participation = [len(r["accepted"]) / max(r["live"], 1) for r in stats["rounds"]]
  return {
      "algorithm": config.algorithm,
      "elastic": True,
      "config": json.loads(config.to_json_best_effort()),
      "steps": result["step"],
      "final_eval_loss": result["eval_loss"],
      "final_eval_bits_per_byte": result["eval_bits_per_byte"],
      "learners": n,
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
