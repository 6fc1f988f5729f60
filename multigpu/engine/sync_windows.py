"""The trainer's side of --semi-sync (docs/fault-tolerance.md, "Training across slow links"): each replica
group trains a window of --sync-every steps on its own, and a sync ends it.

torchft's DiLoCo or LocalSGD (multigpu/parallel/semi_sync.py) run on the trainer's plain TrainStep: no quorum
and no all-reduce per step. At each step's end (the first on_step_end, so callbacks see the synced weights) a
sync is run when one is due, in a quorum joined there (multigpu/engine/replicas.py's `Replicas`): who was lost
or is back is said then, the lowest live group leads from then on, and a lost group's share of the whole
window counts as skipped. A group that starts while the others train heals at their next sync and joins it
(`after_heal`).
"""

from __future__ import annotations

import time
from typing import Any

from multigpu.errors import TrainingStopped
from multigpu.parallel import semi_sync


class SyncWindows:
    """--semi-sync over the run's replica groups (`replicas`: multigpu/engine/replicas.py's Replicas)."""

    def __init__(self, replicas: Any):
        self.replicas = replicas
        trainer = replicas.trainer
        self.trainer = trainer
        semi_sync.check_device(trainer.config, trainer.device, trainer.model)
        self.algorithm = semi_sync.SemiSync(
            trainer.config, replicas.groups.manager, trainer.model, trainer.optimizer
        )
        self.position = (0, 0)  # (epoch, samples into it) at the last step's end, for each step's samples
        trainer._on_step_end = [self.after_step, *trainer._on_step_end]

    # ------------------------------------------------------------------ the start
    def wait_for_min_groups(self, started: float) -> None:
        """At the start, before any state is taken: a quorum of at least --ft-min-replicas groups (a sync of
        fewer would not commit, and a group that starts later heals only at the others' next sync)."""
        replicas = self.replicas
        config = self.trainer.config
        step = self.trainer.progress.global_step + 1
        while replicas.healed_from is None and len(replicas.groups.live_groups()) < config.ft_min_replicas:
            if time.perf_counter() - started > config.dist_timeout:
                live = replicas.groups.live_groups()
                raise TrainingStopped(
                    f"replica group {replicas.groups.replica_id}: only groups {live} joined within "
                    f"--dist-timeout {config.dist_timeout:g} s, and --ft-min-replicas is "
                    f"{config.ft_min_replicas}: start the others, or lower --ft-min-replicas"
                )
            replicas._join_quorum(step)

    def after_heal(self) -> None:
        """Healed at the start from a group in a sync: join that sync (with its state, the same outer
        gradients)."""
        if self.algorithm.peer_was_syncing:
            self._sync(self.trainer.progress.global_step, self.algorithm.finish_peer_sync)

    def resumed_manager_step(self) -> int:
        """The Manager's step of a run resumed from a checkpoint (or fresh): its committed syncs'."""
        return self.algorithm.resumed_manager_step()

    def starts(self) -> None:
        """Training starts here (after a resume or a heal)."""
        progress = self.trainer.progress
        self.position = (progress.epoch, progress.samples_in_epoch)

    # ------------------------------------------------------------------ each step
    def after_step(self, trainer: Any) -> None:
        """A step's end: a sync when one is due; TensorBoard's count of the bytes sent."""
        step = trainer.progress.global_step
        if self.algorithm.after_step(self._step_group_samples()):
            self._sync(step, self._quorum_and_sync)
        if step % trainer.config.log_every == 0:
            self.replicas.log_bytes(step)

    def _quorum_and_sync(self) -> bool:
        """The quorum of a due sync (a healing group takes this group's state in it), then the sync."""
        replicas = self.replicas
        step = self.trainer.progress.global_step
        self.algorithm.syncing = True
        replicas._join_quorum(step)
        if replicas.healed_from is not None:  # a sync the others committed and this group did not
            raise TrainingStopped(
                f"replica group {replicas.groups.replica_id} fell behind its peers at the sync of step "
                f"{step} (they committed one it did not) and took a live peer's state mid-epoch: start it "
                f"again with the same command, and it heals at its start"
            )
        with replicas.waiting_for(f"the sync of step {step}"):
            return self.algorithm.sync()

    def _sync(self, step: int, sync: Any) -> None:
        """Run `sync` (the sync of `step`, in this group's quorum), then say who was lost or is back and what
        did not commit, as each step's quorum does without --semi-sync: a lost group's share of the whole
        window."""
        replicas = self.replicas
        samples = self.algorithm.window_group_samples
        committed = sync()
        live = replicas.groups.live_groups()
        lines = replicas.ledger.observe(live, step, samples)
        replicas._lead(live)
        if not committed:
            lines.append(replicas.ledger.uncommitted(step, samples * len(live), replicas.groups.error()))
        for line in lines:
            self.trainer.report.line(line)

    def _step_group_samples(self) -> int:
        """This group's samples in the step just ended: the data position's move, a group's share of it."""
        progress = self.trainer.progress
        before = self.position
        self.position = (progress.epoch, progress.samples_in_epoch)
        moved = progress.samples_in_epoch - (before[1] if before[0] == progress.epoch else 0)
        return moved // self.replicas.groups.groups

    # ------------------------------------------------------------------ the end, and the checkpoint
    def end_line(self) -> str | None:
        """The run's end inside a window: the groups' weights differ by its steps."""
        steps = self.algorithm.local_step
        if not steps:
            return None
        return (
            f"the run ended {steps} step{'s' if steps > 1 else ''} after its last sync: the groups' weights "
            f"differ by them, and the checkpoint holds the leading group's (end on a multiple of "
            f"--sync-every {self.algorithm.sync_every} for weights every group shares)"
        )

    def state_dict(self) -> dict[str, Any]:
        return self.algorithm.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.algorithm.load_state_dict(state)
