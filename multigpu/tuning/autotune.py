"""--autotune: the run's first optimizer steps measure the settings that change how fast a step runs but not
what it computes, and the rest of the run keeps the fastest (docs/speed.md, "--autotune").

Every trial step is a real training step: nothing is lost or repeated, and the run ends with the weights a
run given the chosen settings directly ends with, within floating-point rounding. What is tried:

- the memory format: channels-last for a model with convolution weights (4-D), unless --channels-last or
  --no-channels-last was given;
- intra-op threads per process, on the CPU: the current count and, when it differs, this machine's cores
  shared out over the local processes;
- under --data-on-device auto, where the training set can be on the device: the batches gathered there (each
  setting above) against the loader's (the fastest of them again, with the loader), the same batches either
  way; the loader's is not tried where a step's batches cost less on the device than the BETTER_BY it would
  have to save. Without --autotune this is the only trial (docs/speed.md, "Data on the device");
- torch.compile of the fastest of those, only when the planned steps left could repay a compile: at that
  speed, compiled steps EXPECTED_GAIN faster would save at least the EXPECTED_COMPILE_SECONDS a compile takes
  (compile_worth_trying; on the CPU, that much longer for a process that got less of its cores in the trials);
  and only where a compiler is there and --compile/--no-compile was not given. It is
  kept only if the steps it saves over the rest of the run pay back the compile time it measured.
The line that ends the trials says whether compile was tried and why, and whether it was kept.

Never tried: anything that changes the numbers (precision, the batch, the data order), so fp32 stays fp32.
The choice is saved in the checkpoint ("autotune") and a resumed --autotune run reuses it without measuring.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from multigpu.config import TrainConfig
from multigpu.parallel.distributed import Runtime, gather_objects

STEPS_EACH = 5  # steps per setting: the first pays for the switch, the median of the other 4 is its step time
COMPILE_WARMUP = 3  # compiled steps not timed: the first compiles, the next may recompile (a new shape)
# What a compile is expected to cost before it is tried, and to gain: a round guess, not a measurement (resnet18
# at 32 px on 2 busy CPU cores compiled in 218 s cold and about 10 s with inductor's cache warm, while its eager
# steps took 15-40 s instead of 0.8; compiled, it was x1.21 eager: docs/speed.md "--autotune").
EXPECTED_COMPILE_SECONDS = {"cpu": 60.0, "cuda": 60.0}
EXPECTED_GAIN = (
    0.10  # compiled steps this much faster: the saving a compile is weighed against before it is tried
)
BETTER_BY = 0.03  # a setting replaces the one as given only when it is this much faster (not on noise)
# A process that got less of its cores than this in the trials (other jobs on them) expects a compile that much
# slower too: the measured steps are. On 2 cores other jobs kept busy, resnet18's steps took 15 s instead of 0.8,
# and its compile, tried on the strength of those steps, 280 s (docs/speed.md, "--autotune").
FULL_CPU_SHARE = 0.9
MIN_CPU_SHARE = 0.05


@dataclass(frozen=True)
class Setting:
    """One combination of the settings --autotune tries."""

    channels_last: bool
    threads: int
    compiled: bool = False
    data_on_device: bool | None = (
        None  # --data-on-device auto: gathered on the device, or the loader's; None: as is
    )

    def words(self, only_data: bool = False) -> str:
        data = (
            []
            if self.data_on_device is None
            else ["data on the device" if self.data_on_device else "data through the loader"]
        )
        if only_data:
            return ", ".join(data)
        return ", ".join(
            [
                "channels-last" if self.channels_last else "channels-first",
                f"{self.threads} thread{'' if self.threads == 1 else 's'}",
                *(["compiled"] if self.compiled else []),
                *data,
            ]
        )


def can_compile(device: torch.device) -> bool:
    """Whether torch.compile can build kernels here: a C++ compiler on the CPU, Triton on CUDA."""
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return shutil.which(os.environ.get("CXX", "g++")) is not None or shutil.which("c++") is not None


def compile_worth_trying(
    steps_left: int, step_seconds: float, device: torch.device, cpu_share: float = 1.0
) -> tuple[bool, str]:
    """Whether the planned steps left, at `step_seconds` each, could repay a compile, and why, in words: the
    time compiled steps EXPECTED_GAIN faster would save against EXPECTED_COMPILE_SECONDS, for a process that
    has its cores. `cpu_share`: the share of its threads' time the process got in the trials on the CPU (other
    jobs on the cores): the measured steps are that much slower, and so would a compile be."""
    share = 1.0 if cpu_share >= FULL_CPU_SHARE else max(MIN_CPU_SHARE, cpu_share)
    saving, cost = steps_left * step_seconds * EXPECTED_GAIN, EXPECTED_COMPILE_SECONDS[device.type] / share
    enough = saving >= cost
    busy = f" on cores this process had {share:.0%} of" if share < FULL_CPU_SHARE else ""
    return enough, (
        f"compile {'tried' if enough else 'not tried'}: the {steps_left:,} steps left at "
        f"{step_seconds * 1000:.1f} ms would save {saving:,.0f} s if compiled steps were "
        f"{EXPECTED_GAIN:.0%} faster, {'at least' if enough else 'less than'} the {cost:.0f} s a "
        f"compile is expected to take{busy}"
    )


def cpu_share(cpu_seconds: float, wall_seconds: float, threads: int) -> float:
    """The share of `threads` cores' time a process got: its CPU seconds over the wall seconds they spanned."""
    return cpu_seconds / max(1e-9, wall_seconds * max(1, min(threads, os.cpu_count() or 1)))


def why_not_compile(runtime: Runtime, given: frozenset) -> str | None:
    """Why --autotune may not try compile on this run (`given`: the flags the user set; None: it may, if the
    run is long enough)."""
    if "compile" in given:
        return "compile not tried: --compile or --no-compile was given"
    if runtime.mode not in ("none", "ddp"):
        return f"compile not tried: not under {runtime.mode}"
    if not can_compile(runtime.device):
        return (
            f"compile not tried: no {'Triton' if runtime.device.type == 'cuda' else 'C++ compiler (g++)'} "
            f"here"
        )
    return None


def candidates(
    given: Setting, convolutions: bool, tune_layout: bool, device: torch.device, data: bool = False
) -> list[Setting]:
    """The eager settings to try, the one as given first; `data`: each with the data on the device (the
    loader's way is tried after them, on the fastest)."""
    layouts = [given.channels_last] + ([not given.channels_last] if convolutions and tune_layout else [])
    threads = [given.threads]
    if (
        device.type == "cpu"
    ):  # oversubscribed cores (processes x threads > cores) slow every step several-fold
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        cores = len(os.sched_getaffinity(0)) // max(1, local_processes)
        threads += [max(1, cores)] if max(1, cores) != given.threads else []
    return [
        Setting(layout, count, data_on_device=True if data else None)
        for count in threads
        for layout in layouts
    ]


def make_autotuner(
    config: TrainConfig,
    runtime: Runtime,
    model: torch.nn.Module,
    given: frozenset,
    apply: Callable[[Setting], None],
    say: Callable[[str], None],
    data: bool = False,
    data_cost: Callable[[Callable[[], float]], float] | None = None,
) -> Autotuner:
    """The run's autotuner: its settings as given first, then what may be tried for its model and mode
    (`given`: the flags the user set, which are not tried otherwise); `apply` switches the live run to a
    setting. `data`: --data-on-device auto measures the data on the device against the loader, alone without
    --autotune; `data_cost(clock)`: what a step's batches cost on the device. Rank 0's list is every rank's, so
    all ranks switch at the same steps."""
    as_given = Setting(config.channels_last, torch.get_num_threads(), config.compile and runtime.mode != "dp")
    if not config.autotune:
        return Autotuner(
            [dataclasses.replace(as_given, data_on_device=True)],
            apply,
            runtime,
            say,
            only_data=True,
            data_cost=data_cost,
        )
    convolutions = any(parameter.dim() == 4 for parameter in model.parameters())
    tune_layout = "channels_last" not in given and runtime.mode != "fsdp"  # fsdp: the shards keep theirs
    trials, no_compile = gather_objects(
        (
            candidates(as_given, convolutions, tune_layout, runtime.device, data),
            why_not_compile(runtime, given),
        )
    )[0]
    return Autotuner(trials, apply, runtime, say, no_compile, data_cost=data_cost)


class Autotuner:
    """Measures the trials from the trainer's step ends and applies settings through `apply` (the trainer's,
    which knows how to switch its model, loader and wrapper). `state_dict` is the checkpoint's "autotune"."""

    def __init__(
        self,
        trials: list[Setting],
        apply: Callable[[Setting], None],
        runtime: Runtime,
        say: Callable[[str], None],
        no_compile: str | None = None,
        only_data: bool = False,
        data_cost: Callable[[Callable[[], float]], float] | None = None,
    ):
        self.trials, self.apply, self.runtime, self.say = trials, apply, runtime, say
        self.data_cost = (
            data_cost  # what a step's batches cost on the device, by a clock (the loader saves <= it)
        )
        self.data_note = ""  # why the loader's way was not tried, for the line
        self.only_data = only_data  # --data-on-device auto without --autotune: the data's two ways alone
        self.tries_data = trials[0].data_on_device is not None  # the loader's way, after the settings above
        self.flag = "--data-on-device auto" if only_data else "--autotune"
        self.compile_allowed = no_compile is None and not only_data
        self.compile_note = no_compile or ""  # whether compile was tried and why, for the line
        self.chosen: Setting | None = None
        self.summary: dict[str, Any] = {}  # what the line said, for the checkpoint
        self.medians: list[float] = []  # of the trials done, in order
        self._times: list[float] = []
        self._last = 0.0
        self._trials_began: tuple[float, float] | None = (
            None  # wall and CPU clocks at the first trial's start
        )
        self._compile_seconds = 0.0
        self._first_step = 1
        self.finished: Callable[[], None] = lambda: None  # set by start: stop calling on_step_end

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {} if self.chosen is None else {"setting": dataclasses.asdict(self.chosen), **self.summary}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The choice saved: of what this run tries (the data's way only where it is tried, only that without
        --autotune), the rest as given."""
        if not state.get("setting"):
            return
        saved, as_given = Setting(**state["setting"]), self.trials[0]
        data = saved.data_on_device if as_given.data_on_device is not None else None
        self.chosen = dataclasses.replace(as_given if self.only_data else saved, data_on_device=data)
        self.summary = {key: value for key, value in state.items() if key != "setting"}

    def words(self, setting: Setting) -> str:
        """A setting in words: what this autotuner tries."""
        return setting.words(only_data=self.only_data)

    # ------------------------------------------------------------------ the trials
    def start(self, done_steps: int, total_steps: float, step_hooks: list[Callable[[Any], None]]) -> bool:
        """Before the first step of this start: True when trials follow. Then `on_step_end` runs last among
        the run's `step_hooks` (its on_step_end list) until the choice is made, and leaves it then: no per-step
        cost after. Last, because it leaves the list while the trainer goes through it: a hook after it would be
        skipped at that step (an EMA update missed)."""
        if self.on_step_end in step_hooks:  # a fit() that ended mid-trial: this one starts afresh
            step_hooks.remove(self.on_step_end)
        if self._start(done_steps, total_steps):
            step_hooks.append(self.on_step_end)
            self.finished = lambda: step_hooks.remove(self.on_step_end)
            return True
        return False

    def _start(self, done_steps: int, total_steps: float) -> bool:
        steps_left, self._first_step = total_steps - done_steps, done_steps + 1
        if self.chosen is not None:
            self.apply(self.chosen)
            self.say(
                f"{self.flag}: {self.words(self.chosen)}, as chosen at step {self.summary.get('at_step', '?')} "
                f"and saved in the checkpoint (not measured again)"
            )
            return False
        needed = STEPS_EACH * (len(self.trials) + self.tries_data)
        if len(self.trials) == 1 and not self.compile_allowed and not self.tries_data:
            self.chosen = self.trials[0]
            self.say(
                f"--autotune: nothing to try for this model and device; training with {self.chosen.words()} "
                f"({self.compile_note})"
            )
            return False
        if steps_left < 2 * needed:
            if not self.only_data:  # the data alone stays on the device, as the plan said, without a word
                self.say(
                    f"--autotune: {steps_left} steps are too few to measure {needed // STEPS_EACH} settings of "
                    f"{STEPS_EACH} steps each and still gain; training with the settings as given (compile not "
                    f"tried)"
                )
            self.chosen = self.trials[0]
            return False
        self._begin(self.trials[0])
        return True

    def _begin(self, setting: Setting) -> None:
        self.apply(setting)
        self._times = []
        self._last = self._now()
        if self._trials_began is None:
            self._trials_began = (time.perf_counter(), time.process_time())

    def _cpu_share(self, threads: int) -> float:
        """The share of `threads` cores this process got since the trials began (1 on CUDA: its steps are the
        GPU's)."""
        if self.runtime.device.type != "cpu" or self._trials_began is None:
            return 1.0
        wall, cpu = self._trials_began
        return cpu_share(time.process_time() - cpu, time.perf_counter() - wall, threads)

    def _now(self) -> float:
        if self.runtime.device.type == "cuda":  # only during the trials: the step's kernels must be done
            torch.cuda.synchronize(self.runtime.device)
        return time.perf_counter()

    def on_step_end(self, trainer: Any) -> None:
        now = self._now()
        self._times.append(now - self._last)
        self._last = now
        trial = len(self.medians)
        compiling = trial == len(self.trials) - 1 and self.trials[-1].compiled
        untimed = COMPILE_WARMUP if compiling else 1
        if len(self._times) < untimed + STEPS_EACH - 1:
            return
        self.medians.append(statistics.median(self._times[untimed:]))
        if compiling:
            self._compile_seconds = sum(self._times[:untimed]) - untimed * self.medians[-1]
        if trial + 1 < len(self.trials):
            self._begin(self.trials[trial + 1])
            return
        steps_left = trainer.total_steps - trainer.progress.global_step
        times = self._slowest_rank()  # one gather per decision: every rank calls it at the same step
        fastest = self._fastest(times)
        if self._loader_may_win(fastest[1]):
            self.trials.append(dataclasses.replace(fastest[0], data_on_device=False))  # the loader's way
            self._begin(self.trials[-1])
            return
        if not self.trials[-1].compiled and self.compile_allowed:
            share = min(gather_objects(self._cpu_share(fastest[0].threads)))  # the rank with the least
            worth, self.compile_note = compile_worth_trying(
                steps_left, fastest[1], self.runtime.device, share
            )
            if worth:
                self.trials.append(dataclasses.replace(fastest[0], compiled=True))
                self._begin(self.trials[-1])
                return
        self._choose(trainer, times, fastest, steps_left)

    def _loader_may_win(self, step_seconds: float) -> bool:
        """Whether the loader's way is still to be tried, on the fastest setting: not once tried, nor where a
        step's batches cost less on the device (the slowest rank's, by the trials' clock) than the BETTER_BY of
        the fastest step the loader would have to save, since the step's compute is the same either way."""
        if (
            not self.tries_data
            or self.data_note
            or not all(setting.data_on_device for setting in self.trials)
        ):
            return False
        if self.data_cost is None:
            return True
        cost = max(gather_objects(self.data_cost(self._now)))
        if cost >= BETTER_BY * step_seconds:
            return True
        self.data_note = (
            f"the loader's way not tried: a step's batches take {cost * 1000:.2f} ms on the device, less than "
            f"the {BETTER_BY:.0%} of a {step_seconds * 1000:.1f} ms step that it would have to save"
        )
        return False

    def _slowest_rank(self) -> list[float]:
        """Each trial's step time on the slowest rank: a DDP step waits for all of them."""
        per_rank = gather_objects(self.medians)
        return [max(times[trial] for times in per_rank) for trial in range(len(self.medians))]

    def _fastest(self, times: list[float]) -> tuple[Setting, float]:
        """The fastest eager trial at `times` (the slowest rank's); the setting as given unless another is
        BETTER_BY faster."""
        eager = [(setting, time_) for setting, time_ in zip(self.trials, times) if not setting.compiled]
        best = min(eager, key=lambda pair: pair[1])
        return best if best[1] < eager[0][1] * (1 - BETTER_BY) else eager[0]

    def _choose(
        self, trainer: Any, times: list[float], fastest: tuple[Setting, float], steps_left: int
    ) -> None:
        chosen, chosen_time = fastest
        if self.trials[-1].compiled:
            compile_seconds = max(gather_objects(self._compile_seconds))
            saved = (chosen_time - times[-1]) * steps_left
            if saved > compile_seconds:
                chosen, chosen_time = self.trials[-1], times[-1]
            self.compile_note += (
                f"; {'kept' if saved > compile_seconds else 'not kept'}: it "
                f"{'saves' if saved > 0 else 'would save'} {max(saved, 0.0):,.0f} s over the "
                f"{steps_left:,} steps left, its compile took {compile_seconds:,.0f} s"
            )
        self.chosen = chosen
        if chosen != self.trials[-1]:
            self.apply(chosen)
        self.finished()
        step = trainer.progress.global_step
        tried = "; ".join(
            f"{self.words(setting)} {time_ * 1000:.1f}" for setting, time_ in zip(self.trials, times)
        )
        self.summary = {
            "at_step": step,
            "gain": times[0] / chosen_time,
            "compile": self.compile_note,
            "tried": {self.words(setting): time_ for setting, time_ in zip(self.trials, times)},
        }
        as_given = "the data on the device" if self.only_data else "the settings as given"
        notes = "".join(f"; {note}" for note in (self.data_note, self.compile_note) if note)
        self.say(
            f"{self.flag}: {self.words(chosen)}, x{times[0] / chosen_time:.2f} {as_given} (median step "
            f"{chosen_time * 1000:.1f} ms vs {times[0] * 1000:.1f} ms; steps {self._first_step}-{step} "
            f"measured, ms per step: {tried}){notes}"
        )
