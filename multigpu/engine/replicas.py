"""The trainer's side of --fault-tolerance (docs/fault-tolerance.md): what a healing replica group is sent, the
step that joins each quorum and commits only what every live group computed, and the run's account of the data
a lost group did not train.

torchft's Manager, its process group and the Lighthouse are multigpu/parallel/fault_tolerance.py's. Here:

- `ReplicatedStep`: the run's TrainStep, with the quorum joined at each step's start (the first step's at fit
  start, where a group behind its peers heals), the gradients averaged over the live groups by torchft's Manager
  after the backward, and torchft's optimizer wrapper around the optimizer, so that it steps only when the step
  may commit.
- A heal sends what a checkpoint holds (model, optimizer, schedule, step, data position, callbacks' state), read
  between two steps and copied, in the checkpoint's own format; each group keeps its own random stream (seeded
  by its data rank), so the groups' dropout and augmentation stay independent.
- `Ledger`: which groups each quorum lacked from which step; said once when a group rejoins (or at the end) and
  totalled in the summary. The writer of the run's files is the lowest live group's rank 0 (`Runtime.leads`).
- --semi-sync: the plain TrainStep, and a sync every --sync-every steps (multigpu/engine/sync_windows.py).
- The bytes this group sends the others, counted (multigpu/parallel/semi_sync.py's CountedManager) and said.
"""

from __future__ import annotations

import copy
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any

from multigpu.checkpoints import run_settings
from multigpu.engine import state, sync_windows
from multigpu.errors import TrainingStopped, UsageError
from multigpu.loop.step import TrainStep
from multigpu.parallel import semi_sync
from multigpu.parallel.lighthouse_watch import LOST_SECONDS, LighthouseWatch

# How the groups sync (--semi-sync): settings of the devices' group that groups must still share, or their syncs
# would average weight changes made under different rules.
SYNC_SETTINGS = ("semi_sync", "sync_every", "outer_lr", "outer_momentum", "fragments", "quantize_outer")
# Where the trainer's state travels among torchft's state callbacks.
STATE_KEY = "multigpu"


@dataclass
class Ledger:
    """The groups each quorum lacked, from which step, and what that cost: the same on every live group (each
    sees the same quorums), and sent to a healing group with the rest of the state."""

    groups: int
    missing_since: dict[int, int] = field(default_factory=dict)  # group: the first step trained without it
    skipped_samples: int = 0  # the lost groups' shares of the steps they missed
    skipped_group_steps: int = 0
    uncommitted_steps: int = 0  # steps no group applied (an all-reduce a lost peer broke)
    uncommitted_samples: int = 0
    rejoins: int = 0  # lost groups that came back (each healed from a live peer)

    def observe(self, live: list[int], step: int, group_samples: int) -> list[str]:
        """The quorum of `step`: who is lost since when, who is back; the lines that say so. `group_samples`: one
        group's share of this step."""
        lines = []
        for group in range(self.groups):
            if group not in live and group not in self.missing_since:
                self.missing_since[group] = step
                lines.append(
                    f"replica group {group} is not in the quorum of step {step}: training on with {len(live)} of "
                    f"{self.groups} groups"
                )
            elif group in live and group in self.missing_since:
                lines.append(self._absence(group, step, f"it rejoined at step {step}"))
                self.rejoins += 1
        self.skipped_samples += group_samples * len(self.missing_since)
        self.skipped_group_steps += len(self.missing_since)
        return lines

    def uncommitted(self, step: int, samples: int, why: Exception | None) -> str:
        """A step whose all-reduce failed: no group applied it, and its samples are skipped."""
        self.uncommitted_steps += 1
        self.uncommitted_samples += samples
        reason = str(why).strip().splitlines()[0][:160] if why else "fewer live groups than --ft-min-replicas"
        return f"step {step} not committed ({reason}): the weights stay as they were, its data is skipped"

    def at_end(self, last_step: int) -> list[str]:
        """The absences still open when the run ends, and the totals."""
        lines = [
            self._absence(group, last_step + 1, f"the run's end at step {last_step}")
            for group in list(self.missing_since)
        ]
        if self.skipped_group_steps or self.uncommitted_steps or self.rejoins:
            lines.append(f"fault tolerance: {self.summary_text()}")
        return lines

    def summary_text(self) -> str:
        return (
            f"{self.skipped_group_steps} group-steps of a lost group skipped ({self.skipped_samples} samples not "
            f"trained), {self.uncommitted_steps} steps not committed ({self.uncommitted_samples} samples), "
            f"{self.rejoins} rejoined"
        )

    def _absence(self, group: int, step: int, until: str) -> str:
        since = self.missing_since.pop(group)
        return (
            f"replica group {group} lost at step {since}: its 1/{self.groups} of the data skipped until {until} "
            f"({step - since} steps)"
        )


class Replicas:
    """The run's replica groups as the trainer sees them: the quorum at each step, heals, and the ledger."""

    def __init__(self, trainer: Any):
        self.trainer, self.runtime = trainer, trainer.runtime
        self.groups = trainer.runtime.replicas  # multigpu/parallel/fault_tolerance.py's ReplicaGroups
        self.ledger = Ledger(self.groups.groups)
        self.quorum_joined = False  # the coming step's quorum was joined already (at fit start)
        self.healed_from: int | None = None  # the peer group whose state the last quorum loaded, if any
        self.healed_at: int | None = None  # the step this group joined the run at by healing, if it did
        self.committed = False  # whether the last step committed
        self.committed_before = 0
        # What this group sends the others, counted (`between groups` on the plan and done lines).
        self.groups.manager = semi_sync.CountedManager(self.groups.manager)
        self.semi_sync: sync_windows.SyncWindows | None = None  # --semi-sync's syncs
        self.first_step = 0  # where this group's training started (after a resume or heal)
        self.groups.share_state(STATE_KEY, self._send, self._receive)
        # A Lighthouse that stops answering while a quorum is waited for ends the run in one line. (Imported
        # here: torchft is imported only for a run with replica groups.)
        from multigpu.parallel.fault_tolerance import lighthouse_address

        self.lighthouse = LighthouseWatch(lighthouse_address(trainer.config), self._lost_lighthouse)

    # ------------------------------------------------------------------ heals
    def _things(self) -> dict[str, Any]:
        """What a heal sends and loads: the checkpoint's things less this group's random stream. A sharded
        model's and optimizer's state as this rank's own shards, which its counterpart in the healing group
        holds too: no collective runs while torchft serves it."""
        things = {name: thing for name, thing in self.trainer.stateful().items() if name != "rng"}
        if things["optimizer"].sharded:
            things["model"] = things["model"].as_shards()
            things["optimizer"] = things["optimizer"].as_shards()
        return things

    def _send(self) -> dict[str, Any]:
        """What a healing peer takes, copied (torchft serves it while this group trains on): the trainer's
        state and the ledger."""
        return copy.deepcopy(
            {
                "trainer": self.trainer.checkpointer.state_of(self._things()),
                "ledger": asdict(self.ledger),
                "from_group": self.groups.replica_id,
            }
        )

    def _receive(self, sent: dict[str, Any]) -> None:
        """A live peer's state, loaded into this group's live objects (in the quorum, between two steps)."""
        saved = sent["trainer"]
        peer = sent["from_group"]
        refuse_other_settings(saved.get("config") or {}, self.trainer.config, self.groups.replica_id, peer)
        things = self._things()
        if saved["global_step"] == 0:  # torchft's first sync of a fresh run: the same start for every group
            things["model"].load_state_dict(saved["model"])
            return
        state.load(self.trainer, saved, f"the state of replica group {sent['from_group']}", things)
        self.ledger = Ledger(**sent["ledger"])
        self.healed_from = sent["from_group"]

    def resume(self) -> bool:
        """Fit's start: join the first quorum, taking a live peer's state where the others are ahead (no checkpoint
        read); else resume from the newest checkpoint in --save-dir as --resume auto does. True if state was
        loaded either way."""
        started = time.perf_counter()
        self._join_quorum(self.trainer.progress.global_step + 1)
        self.quorum_joined = True
        if self.semi_sync is not None:
            self.semi_sync.wait_for_min_groups(started)
        self._lead(self.groups.live_groups())
        if self.healed_from is not None:
            progress = self.trainer.progress
            healed = (
                f"replica group {self.groups.replica_id} joined at step {progress.global_step + 1}: healed from "
                f"replica group {self.healed_from} in {time.perf_counter() - started:.2f}s (model, optimizer, LR "
                f"schedule, data position; no checkpoint read)"
            )
            if self.runtime.rank == 0:  # the group's other ranks healed alike
                print(healed, flush=True)
            self.trainer.report.purge_step = self.healed_at = progress.global_step + 1
            if self.semi_sync is not None:
                self.semi_sync.after_heal()
            self._training_starts()
            return True
        resumed = state.resume(self.trainer)
        semi = self.semi_sync
        self.groups.set_committed_steps(
            semi.resumed_manager_step() if semi is not None else self.trainer.progress.global_step
        )
        self._training_starts()
        return resumed

    def _training_starts(self) -> None:
        """Where this group's training starts: the steps from here on are its own."""
        self.first_step = self.trainer.progress.global_step
        if self.semi_sync is not None:
            self.semi_sync.starts()

    # ------------------------------------------------------------------ each step
    def step_starts(self, group_samples: int) -> None:
        """Join the quorum of the coming step (unless fit's start did), say who was lost or is back, and let the
        lowest live group lead (its rank 0 writes the run's files). `group_samples`: one group's share of it."""
        step = self.trainer.progress.global_step + 1
        if not self.quorum_joined:
            self._join_quorum(step)
            if self.healed_from is not None:
                raise TrainingStopped(
                    f"replica group {self.groups.replica_id} fell behind its peers at step {step} (they committed "
                    f"a step it did not) and took a live peer's state mid-epoch: start it again with the same "
                    f"command, and it heals at its start"
                )
        self.quorum_joined = False
        self.committed_before = self.groups.committed_steps
        live = self.groups.live_groups()
        lines = self.ledger.observe(live, step, group_samples)
        self._lead(live)
        for line in lines:
            self.trainer.report.line(line)

    def sent_per_step(self) -> float:
        """The bytes this rank sent to the other groups per step it trained."""
        steps = max(1, self.trainer.progress.global_step - self.first_step)
        return self.groups.manager.sent_bytes / steps

    def log_bytes(self, step: int) -> None:
        """TensorBoard's perf/bytes_between_groups_per_step (at the --log-every steps)."""
        self.trainer.report.scalars({"perf/bytes_between_groups_per_step": self.sent_per_step()}, step)

    def between_groups(self) -> str:
        """The done line's 'between groups: 1.2 MB per step (DDP: 9.6 MB)', as counted."""
        return semi_sync.between_groups_text(
            self.sent_per_step(), semi_sync.parameter_bytes(self.trainer.model)
        )

    def _lead(self, live: list[int]) -> None:
        """The lowest live group leads: its rank 0 prints, logs and writes the run's files."""
        self.runtime.leads = bool(live) and live[0] == self.groups.replica_id
        self.trainer.report.enabled = self.runtime.is_main

    def step_ends(self, group_samples: int) -> None:
        """After the optimizer: a step that did not commit is said, its data counted as skipped."""
        self.committed = self.groups.committed_steps > self.committed_before
        step = self.trainer.progress.global_step + 1
        if step % self.trainer.config.log_every == 0:
            self.log_bytes(step)
        if self.committed:
            return
        live = len(self.groups.live_groups())
        step = self.trainer.progress.global_step + 1
        self.trainer.report.line(self.ledger.uncommitted(step, group_samples * live, self.groups.error()))

    def _join_quorum(self, step: int) -> None:
        """torchft's quorum for `step` (a heal included); a quorum that cannot form ends the run in one line."""
        self.healed_from = None
        try:
            with (
                self.waiting_for(f"the quorum of step {step}"),
                self.lighthouse.waiting(f"the quorum of step {step}"),
            ):
                self.groups.start_quorum()
        except UsageError:  # a peer's settings that differ, met as it healed this group
            raise
        except Exception as error:  # the Lighthouse is gone, or too few groups are alive for too long
            lost = self.lighthouse.unreachable()
            if lost is not None:
                raise TrainingStopped(
                    self._lost_lighthouse_line(f"the quorum of step {step}", lost)
                ) from None
            detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
            raise TrainingStopped(
                f"replica group {self.groups.replica_id}: no quorum of live replica groups for step {step} "
                f"({detail}); the newest checkpoint is {self.trainer.checkpointer.newest()}"
            ) from None

    def _lost_lighthouse_line(self, what: str, why: str) -> str:
        return (
            f"replica group {self.groups.replica_id}: lost the Lighthouse at {self.lighthouse.address}: {why} "
            f"while waiting for {what}; the newest checkpoint is {self.trainer.checkpointer.newest()}: start the "
            f"Lighthouse again, then every group with the same command, and the run continues from it"
        )

    def _lost_lighthouse(self, what: str, why: str) -> None:
        """The Lighthouse watch's word (its thread; the main thread is inside torchft's quorum, which waits on
        for its timeout): rank 0 of the group says it and ends the process, the group's other ranks end quietly
        a moment later. Checkpoints are written between steps, never during a quorum: the newest is whole."""
        why = f"{why} for {LOST_SECONDS:g} s"
        if self.runtime.rank == 0:
            line = f"error: {self._lost_lighthouse_line(what, why)}\n"
            self.trainer.stop.exit_at_once(line, TrainingStopped.exit_code)
        else:
            self.trainer.stop.exit_at_once(None, TrainingStopped.exit_code, after=2 * LOST_SECONDS)

    def waiting_for(self, what: str) -> AbstractContextManager[None]:
        """A block in which this rank waits for `what` from the other processes: a stop request there ends the
        process at once, so that its group leaves the quorum and the live groups train on (torchrun's SIGTERM
        after a process of the group died: the dead one never joins what the others wait for)."""
        rank = f"rank {self.runtime.rank} of " if self.runtime.world_size > 1 else ""
        waiting = f"{rank}replica group {self.groups.replica_id} waits for {what}"
        return self.trainer.stop.exits_while(waiting)

    # ------------------------------------------------------------------ the run's end
    def summary(self) -> dict[str, Any]:
        """The ledger's lines at the end (said by the leading group) and its totals, for fit's result."""
        for line in self.ledger.at_end(self.trainer.progress.global_step):
            self.trainer.report.line(line)
        ended_inside = self.semi_sync.end_line() if self.semi_sync is not None else None
        if ended_inside:
            self.trainer.report.line(ended_inside)
        ledger = self.ledger
        return {
            "ft_skipped_samples": ledger.skipped_samples,
            "ft_skipped_group_steps": ledger.skipped_group_steps,
            "ft_uncommitted_steps": ledger.uncommitted_steps,
            "ft_rejoins": ledger.rejoins,
            "bytes_between_groups_per_step": self.sent_per_step(),
            "ddp_bytes_per_step": semi_sync.parameter_bytes(self.trainer.model),
        }

    def plan_line(self) -> str:
        """The plan's line: the groups, and what a lost group costs (the batch and LR stay set for all)."""
        runtime, groups = self.runtime, self.groups.groups
        config = self.trainer.config
        line = (
            f"fault tolerance (torchft): replica group {runtime.replica_id} of {groups}, each {runtime.world_size} "
            f"process{'es' if runtime.world_size > 1 else ''} on its own 1/{groups} of every step's data; a step "
            f"commits with at least {config.ft_min_replicas} live group{'s' if config.ft_min_replicas > 1 else ''}. "
            f"The effective batch and LR stay set for all {groups} groups: while one is lost its share is "
            f"skipped and a step averages the live groups' samples at the same LR; a group started again heals "
            f"from a live peer"
        )
        between = semi_sync.between_groups_text(
            semi_sync.planned_bytes(config, self.trainer.model, groups),
            semi_sync.parameter_bytes(self.trainer.model),
        )
        if self.semi_sync is None:
            return f"{line}\n{between}: every step's gradients, all-reduced over the live groups"
        return f"{line}\n{semi_sync.plan_text(config)}; {between}"


def refuse_other_settings(peers: dict[str, Any], config: Any, group: int, peer: int) -> None:
    """UsageError where this group (`config`) trains with other settings than the peer it heals from (`peers`,
    its config as a checkpoint keeps it): the settings that decide what is learned, by the rule a resume's
    --resume auto picks a run by (multigpu/checkpoints/run_settings.py). Groups that differ would average
    gradients of different runs, and step them with different rules."""
    differing = run_settings.differences(peers, config, also=SYNC_SETTINGS)
    if differing:
        raise UsageError(
            f"replica group {group} was started with other settings than replica group {peer}, which it would "
            f"heal from ({'; '.join(differing)}: group {peer}'s -> this group's): start every group with the "
            f"same command"
        )


class ReplicatedStep(TrainStep):
    """The run's training step under --fault-tolerance: the quorum joined first, the gradients averaged over the
    live groups after the backward (before clipping, as DDP's are), and torchft's optimizer wrapper stepping only a
    committed step (the schedule and the step count move on either way, in every group alike)."""

    def __init__(self, step: TrainStep, replicas: Replicas):
        self.__dict__.update(vars(step))  # the same step, as the trainer built it
        self.optimizer = replicas.groups.gated(self.optimizer)
        self.replicas = replicas

    def __call__(self, batches: Any, window_samples: int, sizes: list[int]) -> None:
        group_samples = window_samples * self.replicas.runtime.world_size
        self.replicas.step_starts(group_samples)
        super().__call__(batches, window_samples, sizes)
        self.replicas.step_ends(group_samples)

    def _optimizer_step(self) -> None:
        step = self.replicas.trainer.progress.global_step + 1
        with self.replicas.waiting_for(f"the commit of step {step}"):
            self.replicas.groups.average_gradients(self.model.parameters())
            super()._optimizer_step()


def join(trainer: Any) -> Replicas | None:
    """--fault-tolerance: the trainer's step made a ReplicatedStep and its state shared with healing peers; None
    without it."""
    if trainer.runtime.replicas is None:
        return None
    replicas = Replicas(trainer)
    if trainer.config.semi_sync is None:
        trainer.step = ReplicatedStep(trainer.step, replicas)
    else:
        replicas.semi_sync = sync_windows.SyncWindows(replicas)
    return replicas
