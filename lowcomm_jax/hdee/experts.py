"""HDEE experts: seed models and expert chains trained by chained Trainer runs.

An expert chain (docs/algorithms.md §4.1) starts from a seed model of its size and
trains on its domains in turn; each domain is one `lowcomm_jax.train.Trainer`
run whose ``init_from`` is the previous run's workdir, so an expert continues
from its own previous checkpoint with a fresh optimizer, as in the reference
code. Nothing is communicated between experts: every run is an ordinary
single-model job, and same-size experts could run as separate jobs on separate
machines.

Workdirs under a root folder::

  seeds/<size>/                       seed model of size S, M or L
  experts/<chain>_<size>_<steps>/<k>_<domain>/   iteration k of one chain

A chain's workdir names its size and steps per domain rather than the
setting, so settings that train a chain identically share its runs (the
moderate chain is M at the base steps in all three settings, which is why the
paper reports ties on its domains). Each setting is still charged the full
compute of every run it uses. A run whose workdir holds a ``summary.json`` is
finished and is skipped; an interrupted one resumes from its checkpoint.

Seed text. The paper pretrains its seeds on OpenWebText, broad text that is
none of its domains' test sets. This machine has no corpus outside the 16
domains, so the seed trains on a mix of the domains the chains will visit
(`seed_corpus_name`, a `lowcomm_jax.data.domains` mix: equal-sized samples of
their *training* splits in evenly spaced chunks, so a sorted corpus is not read
from its start only). It never reads a validation or test split, nor any
held-out domain, so every test score is on unseen text and the held-out
domains measure transfer. The price, compared
with the paper, is that the seed has already seen a little of each expert's
domain; the experts then specialize on far more of it.

Example::

  setup = experts.ExpertSetup(model_size="tiny", seed_steps=8)
  plans = experts.make_plans(setup, steps_per_domain=4, chains=domains.REFERENCE_CHAINS)
  workdirs = experts.train_plan(setup, plans["homogeneous"], "runs/hdee")
  expert = scoring.load_expert(workdirs["hard"])   # inference: lowcomm_jax.hdee.scoring
  log_probs_BxT = scoring.token_log_probs(expert, windows_BxT1)
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Mapping, Sequence

import jax
import ml_collections

from lowcomm_jax import config as config_lib
from lowcomm_jax.data import domains as domains_lib
from lowcomm_jax.hdee import plan as plan_lib
from lowcomm_jax.models import config as model_config
from lowcomm_jax.train import trainer as trainer_lib


@dataclasses.dataclass(frozen=True)
class ExpertSetup:
  """Everything about expert training that is not the plan.

  Attributes:
    model_size: the preset the S/M/L experts derive from (M is the preset;
      S and L change only the feed-forward width, `plan.ffn_widths`).
    seq_len: tokens per training and evaluation sequence (bytes).
    batch_size: sequences per optimizer step.
    seed_steps: optimizer steps of each seed model on its seed corpus (`seed_corpus_name`).
    seed_learning_rate: peak learning rate of the seed runs.
    domain_learning_rate: peak learning rate of every expert run; lower than
      the seed's, as the paper's 6e-5 is to its seed's 6e-4 (we use 1/3, since
      our runs are far shorter).
    domain_warmup_steps: linear warm-up of every expert run.
    seed: parameter init and data order.
    seed_domains: training domains sampled into the seed corpus; empty means
      the domains of the chains being trained.
  """

  model_size: str = "small"
  seq_len: int = 128
  batch_size: int = 16
  seed_steps: int = 300
  seed_learning_rate: float = 3e-3
  domain_learning_rate: float = 1e-3
  domain_warmup_steps: int = 10
  seed: int = 0
  seed_domains: tuple[str, ...] = ()

  def __post_init__(self):
    model_config.get_model_config(self.model_size)  # ValueError naming the presets.
    for name in ("seq_len", "batch_size", "seed_steps"):
      if getattr(self, name) < 1:
        raise ValueError(f"ExpertSetup.{name} must be >= 1, got {getattr(self, name)}")
    for name in self.seed_domains:
      domains_lib.get_domain(name)

  @property
  def tokens_per_step(self) -> int:
    return self.seq_len * self.batch_size

  def ffn_widths(self) -> dict[str, int]:
    """Feed-forward width of S, M and L."""
    return plan_lib.ffn_widths(model_config.PRESETS[self.model_size].d_ff)

  def model(self, size: str) -> model_config.ModelConfig:
    """The model config of size S, M or L."""
    if size not in plan_lib.SIZE_NAMES:
      raise ValueError(f"unknown expert size {size!r}; allowed: {', '.join(plan_lib.SIZE_NAMES)}")
    return model_config.get_model_config(self.model_size, d_ff=self.ffn_widths()[size])

  def flops_per_token(self, size: str) -> float:
    """Training FLOPs per token of size S, M or L (the model's FLOPs formula)."""
    return model_config.flops_per_token(self.model(size), self.seq_len)


def make_plans(setup: ExpertSetup, steps_per_domain: int,
               chains: Mapping[str, Sequence[str]]) -> dict[str, plan_lib.Plan]:
  """The three settings' plans at the homogeneous budget of `steps_per_domain`.

  Raises:
    ValueError: `steps_per_domain` below the plan's step multiple (4, so that
      1.25x and 0.75x are whole), or an unknown domain.
  """
  if steps_per_domain < 4 or steps_per_domain % 4:
    raise ValueError(f"steps_per_domain must be a positive multiple of 4 (so that the "
                     f"heterogeneous 1.25x and 0.75x are whole steps), got {steps_per_domain}")
  budget = plan_lib.budget_for_steps(steps_per_domain, setup.flops_per_token,
                                     setup.tokens_per_step, chains)
  return plan_lib.make_plans(budget, setup.flops_per_token, setup.tokens_per_step, chains)


# ---------------------------------------------------------------------------
# Seed corpus
# ---------------------------------------------------------------------------


def seed_corpus_name(domain_names: Sequence[str]) -> str:
  """The `data.corpus` of the seed mix of `domain_names` (a `lowcomm_jax.data.domains` mix).

  The name lists the domains, so seeds of different mixes never share a
  workdir.

  Raises:
    ValueError: no domain, an unknown one, or a held-out one (the seed may
      read training domains only).
  """
  for name in domain_names:
    if domains_lib.get_domain(name).held_out:
      raise ValueError(f"the seed corpus may not read held-out domain {name!r}")
  if not domain_names:
    raise ValueError("the seed corpus needs at least one training domain")
  return domains_lib.mix_corpus_name(domain_names)


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def run_config(setup: ExpertSetup, size: str, corpus: str, num_steps: int, learning_rate: float,
               warmup_steps: int, init_from: str | pathlib.Path = "") -> ml_collections.ConfigDict:
  """The Trainer config of one seed or expert run."""
  c = config_lib.default_config()
  c.seed = setup.seed
  c.num_steps = num_steps
  c.model.size = setup.model_size
  c.model.d_ff = setup.model(size).d_ff
  c.init_from = str(init_from)
  c.data.corpus = corpus
  c.data.seq_len = setup.seq_len
  c.data.batch_size = setup.batch_size
  c.optimizer.learning_rate = learning_rate
  c.optimizer.warmup_steps = warmup_steps
  c.mesh.data = 1  # One device per expert: experts are independent jobs, not a data-parallel one.
  c.eval.every = num_steps
  c.eval.num_batches = 4
  c.checkpoint.every = num_steps
  c.checkpoint.keep = 1
  c.log_every = max(1, num_steps // 4)
  c.progress_bar = False
  return c


def train_run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict:
  """Trains one run, or returns the summary of the finished run already in `workdir`.

  Raises:
    ValueError: `workdir` holds a run of a different config.
  """
  workdir = pathlib.Path(workdir).absolute()
  summary_path = workdir / "summary.json"
  if summary_path.exists():
    _check_finished_run(workdir, config)
    return json.loads(summary_path.read_text())
  return trainer_lib.Trainer(config, workdir).run()


def _check_finished_run(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> None:
  """Raises unless the finished run in `workdir` was trained with `config`.

  Config keys added to the code after the run was trained count as their
  defaults, so a new option that the run never had does not make it look
  like a different run (the Trainer's own resume check is strict about that).
  """
  as_json = lambda d: json.loads(json.dumps(d, default=str))
  saved = config_lib.upgrade_saved(json.loads((workdir / "config.json").read_text())["fingerprint"])
  defaults = as_json(config_lib.fingerprint(config_lib.default_config()))
  current = as_json(config_lib.fingerprint(config))
  differing = sorted(k for k in current if saved.get(k, defaults.get(k)) != current[k])
  if differing:
    details = ", ".join(f"{k}: {saved.get(k)!r} -> {current[k]!r}" for k in differing[:8])
    raise ValueError(f"workdir {workdir} holds a run of another config ({details}); "
                     "use a new --workdir or the same settings to resume")


def seed_workdir(root: str | pathlib.Path, size: str) -> pathlib.Path:
  return pathlib.Path(root).absolute() / "seeds" / size


def train_seed(setup: ExpertSetup, size: str, root: str | pathlib.Path,
               seed_domains: Sequence[str]) -> pathlib.Path:
  """Trains (or finds) the seed model of `size`; returns its workdir."""
  corpus = seed_corpus_name(setup.seed_domains or seed_domains)
  config = run_config(setup, size, corpus, setup.seed_steps, setup.seed_learning_rate,
                      warmup_steps=min(30, setup.seed_steps // 10))
  workdir = seed_workdir(root, size)
  train_run(config, workdir)
  return workdir


def chain_workdirs(root: str | pathlib.Path, chain: plan_lib.ChainPlan) -> list[pathlib.Path]:
  """The workdir of each iteration of `chain`, in training order."""
  steps = "-".join(str(s) for s in sorted(set(chain.steps_per_domain)))
  folder = pathlib.Path(root).absolute() / "experts" / f"{chain.chain}_{chain.size}_{steps}steps"
  return [folder / f"{k}_{name}" for k, name in enumerate(chain.domains, start=1)]


def train_chain(setup: ExpertSetup, chain: plan_lib.ChainPlan, root: str | pathlib.Path,
                seed_domains: Sequence[str]) -> list[pathlib.Path]:
  """Trains one expert over its chain of domains; returns each iteration's workdir.

  Iteration 1 starts from the seed of the chain's size, iteration k from
  iteration k - 1's final parameters (a fresh optimizer each time).
  """
  init_from = train_seed(setup, chain.size, root, seed_domains)
  workdirs = chain_workdirs(root, chain)
  for name, steps, workdir in zip(chain.domains, chain.steps_per_domain, workdirs):
    config = run_config(setup, chain.size, f"domain:{name}", steps, setup.domain_learning_rate,
                        setup.domain_warmup_steps, init_from)
    train_run(config, workdir)
    init_from = workdir
  return workdirs


def plan_domains(plan: plan_lib.Plan) -> list[str]:
  return sorted({name for chain in plan.chains for name in chain.domains})


def train_plan(setup: ExpertSetup, plan: plan_lib.Plan,
               root: str | pathlib.Path) -> dict[str, pathlib.Path]:
  """Trains every chain of a plan; returns ``{chain: workdir of its final expert}``."""
  return {chain.chain: train_chain(setup, chain, root, plan_domains(plan))[-1]
          for chain in plan.chains}


def run_flops(workdir: str | pathlib.Path) -> float:
  """Training FLOPs a finished run spent: the FLOPs formula x the tokens it trained."""
  summary = json.loads((pathlib.Path(workdir) / "summary.json").read_text())
  c = summary["config"]
  cfg = model_config.get_model_config(c["model"]["size"], d_ff=c["model"]["d_ff"] or
                                      model_config.PRESETS[c["model"]["size"]].d_ff)
  return model_config.flops_per_token(cfg, c["data"]["seq_len"]) * summary["tokens"]


def spent_flops(plan: plan_lib.Plan, root: str | pathlib.Path) -> dict[str, float]:
  """``{chain: FLOPs spent by its runs}`` of a trained plan (seeds excluded, as in the paper)."""
  return {chain.chain: sum(run_flops(w) for w in chain_workdirs(root, chain))
          for chain in plan.chains}


# ---------------------------------------------------------------------------
# Compilation cache (expert runs of one size reuse their programs)
# ---------------------------------------------------------------------------


def enable_compilation_cache(path: str | pathlib.Path) -> None:
  """Keeps compiled programs in `path`, so runs of one size and step count compile once.

  Every expert run builds its own Trainer, whose jitted steps are new
  functions; without a persistent cache each run would compile them again.
  Takes effect even after earlier compilations in this process.
  """
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=g-import-not-at-top
  compilation_cache.set_cache_dir(str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  compilation_cache.reset_cache()  # The cache is set up once per process; redo it with `path`.
