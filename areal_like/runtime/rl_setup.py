"""Everything around an RL recipe's loop: engines, fleet client, data, evaluation, checkpoints.

A recipe keeps only the algorithm in view: it builds its actor and workflow and hands
`rl.train` the step that turns a batch into an update. `rl.train` is the loop every recipe
shares:

    for step in rl.steps():                              # resumes after a checkpoint
        batch = rl.next_batch(workflow, should_accept)   # rank 0 rolls out, every rank trains
        stats = train_step(batch)                        # the algorithm: logp, advantages, update
        stats |= rl.push_weights(step)                   # pause -> load v+1 -> resume
        rl.end_step(step, stats)                         # evaluate, checkpoint, log
    rl.finish()

A loop of another shape (e.g. the synchronous reference in the tests) uses the same pieces.

Rollouts run in a separate process, the rollout controller (`areal_like/rollout/process.py`):
rank 0 holds its handle (`rl.rollout`). Held-out evaluations run there beside training
rollouts; each is logged against the version it evaluated when it is done.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

from tensordict import TensorDict

from areal_like.algorithms import uses_group_statistics
from areal_like.api import RolloutWorkflow, SaveLoadMeta, ShouldAccept
from areal_like.api.config import BaseExperimentConfig, TrainEngineConfig
from areal_like.data.loader import ItemLoader
from areal_like.data.prompt_limits import load_tokenizer
from areal_like.rewards.failures import RewardFunctionError
from areal_like.rewards.reward_executor import RewardExecutor
from areal_like.rollout.evaluation import Evaluator
from areal_like.rollout.process import RolloutProcess, RolloutSetup
from areal_like.runtime.checkpoint import Checkpointer
from areal_like.runtime.context import RunContext
from areal_like.runtime.held_out import eval_items, load_task, remote_reward
from areal_like.runtime.preflight_models import read_model_config
from areal_like.runtime.preflight_models import vocab_size as model_vocab_size
from areal_like.runtime.recover import maybe_recover, save_checkpoint
from areal_like.runtime.weight_broadcast import WeightBroadcaster
from areal_like.runtime.weight_delta import WeightDeltaPusher
from areal_like.runtime.weight_sync import FleetLoadBesideTraining, WeightPusher, push_weights
from areal_like.utils.imports import load_object
from areal_like.utils.launch_clock import Phases
from areal_like.utils.plotting import plot_run
from areal_like.utils.progress import progress
from engines import FSDPEngine
from engines.fleet.updater import FleetUpdater
from workflows.rlvr import RLVRWorkflow

PLOT_TIMEOUT_S = 120.0  # the curves of a long run: seconds of drawing
CONSOLE = ["actor/task_reward/avg", "eval/accuracy", "rollout/staleness_max", "timeperf/step",
           "timeperf/startup"]


def start_engine(config: TrainEngineConfig, section: str = "") -> FSDPEngine:
    engine = FSDPEngine(config, section)
    engine.initialize()
    return engine


class RLSetup:
    """Per-process set-up of an RL run; rank 0 also owns the fleet client."""

    def __init__(self, config: BaseExperimentConfig,
                 eval_workflow: Optional[Callable[[RLSetup], RolloutWorkflow]] = None) -> None:
        """`eval_workflow(rl)` builds the workflow of held-out evaluation (default: greedy
        RLVR on the valid dataset's reward)."""
        self.config = config
        # start-up phases on the launcher's clock, said at step 0 (where the seconds go)
        self.phases = Phases("trainer process")
        self.phases.mark("imports and config")
        self.run = RunContext(config, console_keys=CONSOLE)
        self.phases.mark("process group")
        cpus = sorted(os.sched_getaffinity(0))
        if self.run.is_main and len(cpus) < (os.cpu_count() or 0):  # pinned: say where
            print(f"trainer rank 0 runs on CPUs {cpus} (launcher.trainer_cpus)", flush=True)
        self.rollout: Optional[RolloutProcess] = None
        if self.run.is_main:  # its imports (seconds) overlap the data and engine set-up below
            # its calls are generated from RolloutAPI's declaration (areal_like/rollout/process.py)
            self.rollout = RolloutProcess()  # type: ignore[abstract]
            self.rollout.spawn(config.rollout.controller.nice, config.rollout.controller.cpus)
        self.tokenizer = load_tokenizer(config.model)
        remote = remote_reward(config)  # a remote reward model replaces both verifiers
        self.task, n_train_long = load_task(config, "train_dataset", self.tokenizer, remote)
        self.valid, n_valid_long = load_task(config, "valid_dataset", self.tokenizer, remote)
        self.data_stats = {"data/train_long_prompts_dropped": float(n_train_long),
                           "data/valid_long_prompts_dropped": float(n_valid_long)}
        # the trainer only checks rewards (fast, alike on every rank); they run, and are
        # loaded in worker processes, inside the rollout controller
        self.rewards = RewardExecutor(dataclasses.replace(config.reward, use_processes=False))
        self.check_rewards()  # before anything slow starts: a broken reward fails the run now
        self.phases.mark("data")
        self.actor_engine = start_engine(config.actor)
        self.phases.mark("actor engine")
        group_statistics = uses_group_statistics(config.algorithm)
        # ranks get whole groups; without group statistics a group may be short of its
        # failed samples, so any split is right
        self.shard_group_size = config.algorithm.group_size if group_statistics else 1
        self.eval_items = eval_items(config, self.valid.dataset)
        if self.rollout is not None:
            workflow = eval_workflow(self) if eval_workflow is not None else None
            self.rollout.start(self.rollout_setup(workflow, group_statistics))
        # the other ranks wait (with heartbeats) and fail alike if it cannot start
        self.run.on_main(self._wait_rollout_ready, "starting the rollout controller")
        self.phases.mark("rollout controller and servers ready")
        self.loader = ItemLoader(self.task.dataset, config.train_dataset.batch_size, config.seed,
                                 shuffle=config.train_dataset.shuffle)
        self.ckpt = Checkpointer(config.checkpoint, self.run.dir, self.run.rank)
        # a LoRA run sends its adapter in memory instead (no process group: push_weights)
        # rank 0 loads weights on the servers itself; the rollout controller is told twice
        self.fleet = (FleetUpdater(config.rollout, self.rollout) if self.rollout is not None
                      else None)
        self.broadcaster = self._weight_pusher()
        # rollout.weights.overlap_load: the fleet loads version k while step k trains
        self.load_beside = (FleetLoadBesideTraining(config.actor.collective_timeout)
                            if self._overlaps_load() else None)
        self._batch_episode_ids: list[str] = []  # of the batch being trained (rank 0)
        self.stateful: dict[str, Any] = {}  # name -> object with state_dict/load_state_dict

    def _weight_pusher(self) -> Optional[WeightPusher]:
        """The transport every rank takes part in (distributed, delta); None: a folder, or a
        LoRA adapter in memory (push_weights)."""
        config = self.config
        transport = config.rollout.weights.transport
        if transport == "distributed" and not config.actor.lora.enabled:
            return WeightBroadcaster(config.rollout, config.actor.collective_timeout)
        if transport == "delta":
            return WeightDeltaPusher(config.rollout, self.run.weights_dir / "delta",
                                     config.actor.collective_timeout)
        return None

    def _overlaps_load(self) -> bool:
        """`rollout.weights.overlap_load` where it applies (see its comment); says so."""
        rollout = self.config.rollout
        if not rollout.weights.overlap_load:
            return False
        eta = rollout.staleness.max_head_offpolicyness
        why = ("a broadcast needs every trainer rank" if self.adapter_in_memory
               else "the delta transport compares every rank's gathered weights"
               if rollout.weights.transport == "delta"
               else "at max_head_offpolicyness=0 the next batch needs the new version"
               if eta == 0 else "")
        if self.run.is_main:
            print("weight loads: " + (f"in the step (rollout.weights.overlap_load: {why})"
                                      if why else "beside the next training step "
                                      "(rollout.weights.overlap_load)"), flush=True)
        return not why

    def track_state(self, name: str, obj: Any) -> None:
        """Save `obj.state_dict()` with every checkpoint and restore it on recover (e.g. the
        actor's adaptive KL coefficient). Call before `train`."""
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise TypeError(f"track_state({name!r}): {type(obj).__name__} has no {method}()")
        self.stateful[name] = obj

    def _wait_rollout_ready(self) -> None:
        if self.rollout is not None:
            self.rollout.wait_ready()

    def rollout_setup(self, eval_workflow: Optional[RolloutWorkflow],
                      group_statistics: bool) -> RolloutSetup:
        """What the rollout controller process is built from."""
        config, ev = self.config, self.config.evaluation
        seed = config.seed if config.rollout.seed is None else config.rollout.seed
        evaluator = None
        if self.eval_items:
            # an RLVR workflow of rollout.workflow (e.g. with images) evaluates too; one whose
            # rewards need more (a PRM) names the RLVR class that evaluates for it
            trained = self.workflow_class(RLVRWorkflow)
            trained = getattr(trained, "evaluation_class", trained)
            evaluator = Evaluator(self.eval_items, self.valid.reward_fn, self.tokenizer,
                                  config.gconfig, ev.pass_k, ev.temperature,
                                  workflow=eval_workflow, pass_n=ev.pass_n,
                                  rlvr_class=trained if issubclass(trained, RLVRWorkflow)
                                  else RLVRWorkflow)
        checks = [(f"{name} (type={getattr(config, name).type})", task.reward_fn,
                   task.dataset[0] if len(task.dataset) else None)
                  for name, task in (("train_dataset", self.task), ("valid_dataset", self.valid))]
        model = read_model_config(config.actor.model.path)
        vocab_size = config.rollout.vocab_size or ((model and model_vocab_size(model)) or 0)
        return RolloutSetup(
            rollout=dataclasses.replace(config.rollout, seed=seed, vocab_size=vocab_size),
            reward=config.reward,
            # a group missing a failed sample gives a wrong baseline to group statistics
            keep_partial_groups=not group_statistics, reward_checks=checks,
            evaluator=evaluator)

    def check_rewards(self) -> None:
        """Fail fast on a reward function that cannot work: wrong signature for the data,
        cannot be sent to or loaded by reward workers (see `RewardExecutor.check`). Every
        rank checks the same things, so every rank fails alike; only rank 0, which runs the
        rewards, starts workers."""
        for name, task in (("train_dataset", self.task), ("valid_dataset", self.valid)):
            example = task.dataset[0] if len(task.dataset) else None
            try:
                self.rewards.check(task.reward_fn, example, load_in_worker=False)
            except RewardFunctionError as e:
                kind = getattr(self.config, name).type
                raise RewardFunctionError(f"{name} (type={kind}): {e}") from None

    # ---- the loop ---------------------------------------------------------------------------
    def train(self, workflow: RolloutWorkflow,
              train_step: Callable[[TensorDict], dict[str, Any]],
              should_accept: Optional[ShouldAccept] = None,
              extra_engines: tuple[Any, ...] = ()) -> None:
        """Run the RL loop to `total_train_steps`, then `finish`. `train_step(batch)` trains on
        one batch and returns its stats; `extra_engines` (e.g. a critic's) step their LR
        schedules with the actor's."""
        for step in self.steps():
            with self.timing("rollout"):  # waits only if rollout fell behind (<= eta ahead)
                batch = self.next_batch(workflow, should_accept)
            with self.timing("train"):
                stats = train_step(batch)
            with self.timing("weight_sync"):  # pause fleet -> load version step+1 -> resume
                stats |= self.push_weights(step)
            self.end_step(step, stats, extra_engines)  # lr, evaluation, checkpoint, metrics
        self.finish()

    def steps(self) -> Iterator[int]:
        """Training steps, resuming after the last checkpoint when `checkpoint.recover=auto`."""
        start = maybe_recover(self.ckpt, self.run, self.actor_engine, self.rollout,
                              self.fleet, self.broadcaster, self.stateful,
                              self.adapter_in_memory)
        if start == 0:
            stats = dict(self.data_stats)
            if self.actor_engine.lora_enabled:  # the servers hold the base only so far
                stats |= push_weights(self.actor_engine, self.fleet, 0, self.run.weights_dir,
                                      collective_timeout_s=self.config.actor.collective_timeout,
                                      in_memory=self.adapter_in_memory)
            self.run.log_step(0, stats)
            self.start_evaluation(0)
            self.phases.mark("step 0")
            if self.run.is_main:
                print(f"start-up, seconds after launch: {self.phases.summary()}", flush=True)
        elif self.rollout is not None:
            self.run.log_episodes(start, restored=self.rollout.buffered_episode_ids())
        total = self.config.total_train_steps
        yield from progress(range(start, total), "train steps", enabled=self.run.is_main)

    def make_workflow(self, default: type) -> RolloutWorkflow:
        """The recipe's workflow, or the class `rollout.workflow` names, built as
        cls(reward_fn, gconfig, tokenizer)."""
        return self.workflow_class(default)(self.task.reward_fn, self.config.gconfig,
                                            self.tokenizer)

    def workflow_class(self, default: type) -> type:
        """`default`, or the class `rollout.workflow` names."""
        path = self.config.rollout.workflow
        return load_object(path, "rollout.workflow") if path else default

    def timing(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.run.timing(name)

    def next_batch(self, workflow: RolloutWorkflow,
                   should_accept: Optional[ShouldAccept] = None) -> TensorDict:
        """The next consumer batch (waits only when rollout fell behind), this rank's share."""
        def wait_for_batch() -> Optional[TensorDict]:
            if self.rollout is None:
                return None
            batch = self.rollout.prepare_batch(self.loader, workflow, should_accept)
            self._batch_episode_ids = list(self.rollout.last_episode_ids)
            return batch

        batch = self.run.on_main(wait_for_batch, "waiting for a rollout batch")
        return self.run.scatter_batch(batch, self.shard_group_size)

    def push_weights(self, step: int) -> dict[str, float]:
        """Export the trainer's weights as version step + 1 and load them on the fleet (with
        `rollout.weights.overlap_load`: the load goes on beside the next step, see
        `wait_for_fleet`)."""
        if self.load_beside is not None:
            stats = self.load_beside.wait()  # version step's, loaded while step trained
            return stats | self.load_beside.start(self.actor_engine, self.fleet, step + 1,
                                                  self.run.weights_dir)
        return push_weights(self.actor_engine, self.fleet, step + 1, self.run.weights_dir,
                            collective_timeout_s=self.config.actor.collective_timeout,
                            broadcaster=self.broadcaster, in_memory=self.adapter_in_memory)

    def wait_for_fleet(self) -> dict[str, float]:
        """Wait for a load beside training (`rollout.weights.overlap_load`) to end: the fleet
        then serves the trainer's version (before an evaluation of it, a checkpoint, the end)."""
        return self.load_beside.wait() if self.load_beside is not None else {}

    @property
    def adapter_in_memory(self) -> bool:
        """The distributed transport: a LoRA adapter travels in memory (no folder)."""
        return self.config.rollout.weights.transport == "distributed"

    def reference_engine(self) -> Any:
        """The frozen KL reference (`use_ref_model`): the actor's own base with its adapters
        off when it trains LoRA (no second copy), else a separate engine from `ref`."""
        if self.config.actor.lora.enabled:
            return self.actor_engine.base_model_view()
        return start_engine(self.config.ref, "ref")  # type: ignore[attr-defined]

    def save_final(self) -> None:
        """The trained policy as a Hugging Face folder (weights, config, tokenizer, chat
        template): loadable with `from_pretrained`, servable by `areal-like serve`, the same
        weights as the fleet's last version. Every rank takes part (rank 0 writes)."""
        final = self.run.dir / "final"
        self.actor_engine.save(SaveLoadMeta(str(final), weight_format="hf",
                                            tokenizer=self.tokenizer))
        if self.run.is_main:
            print(f"final model: {final}", flush=True)

    def start_evaluation(self, version: int) -> None:
        """Evaluate the fleet's weights `version` beside training rollouts (rank 0); the
        result is logged against `version` when it is done."""
        if self.rollout is not None and self.eval_items:
            self.rollout.start_evaluation(version)

    def log_evaluations(self, wait: bool = False) -> None:
        """Log the evaluations that finished; with `wait`, every one started (the other
        ranks wait for rank 0 with heartbeats, so a long one outlasts no collective)."""
        def finished() -> list[tuple[int, dict[str, float]]]:
            return [] if self.rollout is None else self.rollout.finished_evaluations(wait)

        done = self.run.on_main(finished, "waiting for held-out evaluations") if wait \
            else finished()
        for version, metrics in done or []:
            self.run.log_late(version, metrics)

    def end_step(self, step: int, stats: dict[str, Any],
                 extra_engines: tuple[Any, ...] = ()) -> None:
        """Step the LR schedules (actor and `extra_engines`), evaluate every
        `evaluation.freq_steps`, checkpoint every `checkpoint.freq_steps`, log the metrics."""
        self.actor_engine.step_lr_scheduler()
        for engine in extra_engines:
            engine.step_lr_scheduler()
        self.ckpt.commit_if_written(self.actor_engine)  # an asynchronous save written since
        last = step + 1 == self.config.total_train_steps
        freq = self.config.evaluation.freq_steps
        evaluate = bool(freq) and ((step + 1) % freq == 0 or last)
        save = self.ckpt.should_save(step, last)
        if evaluate or save:
            stats |= self.wait_for_fleet()
        if evaluate:
            self.start_evaluation(step + 1)  # the fleet holds version step + 1 now
        if self.rollout is not None:
            stats |= self.rollout.export_stats()
            self.run.log_episodes(step + 1, trained=self._batch_episode_ids)
        # log first: a checkpoint then always has its step's metrics on record
        self.run.log_step(step + 1, stats)
        self.log_evaluations(wait=save)  # ... and every evaluation started before it
        if save:
            save_checkpoint(self.ckpt, step, self.actor_engine, self.rollout, self.stateful)

    def finish(self) -> None:
        """Write the final policy to `<run dir>/final`, print accuracy before -> after, write
        the curves PNG, release everything."""
        ending = Phases("last step", from_process_start=False)
        self.wait_for_fleet()
        self.ckpt.commit(self.actor_engine)  # a checkpoint still being written
        self.save_final()
        ending.mark("final model")
        self.log_evaluations(wait=True)
        ending.mark("evaluations")
        self.run.summarize("eval/accuracy")
        plot: Optional[concurrent.futures.Future[Path]] = None
        if self.run.metrics is not None and self.config.logging.plot:
            # drawn while the rollout process and the reward workers shut down (~1-2 s each)
            plotter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="curves")
            plot = plotter.submit(plot_run, self.run.metrics.jsonl_path,
                                  self.run.dir / "curves.png", self.run.dir.name)
            plotter.shutdown(wait=False)
        if self.fleet is not None:
            self.fleet.close()
        if self.rollout is not None:
            self.rollout.destroy()
        if self.broadcaster is not None:
            self.broadcaster.close()
        self.rewards.shutdown()
        ending.mark("rollout controller and reward workers stopped")
        if plot is not None:
            print(f"curves: {plot.result(timeout=PLOT_TIMEOUT_S)}", flush=True)
            ending.mark("curves")
        self.run.close()
        ending.mark("metric sinks closed")
        if self.run.is_main:
            print(f"shut-down, seconds after launch: {ending.summary()}", flush=True)
