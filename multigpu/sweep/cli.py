"""The sweep's command line: plan, check the sweep dir, run this shard's experiments, summarize.

Exit status: 0 every experiment of this shard succeeded, 1 some failed (listed), 2 bad input (one
line), 128 + N stopped by signal N (rerun the same command to continue).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

from multigpu.errors import UsageError
from multigpu.launch.console import best_effort
from multigpu.sweep import records, slurm, summary
from multigpu.sweep.options import SweepOptions, parse, split_separated
from multigpu.sweep.plan import Experiment, Plan, build_plan
from multigpu.tuning.gc_pauses import skip_the_collection_at_exit

if TYPE_CHECKING:  # imported where a search runs: a grid sweep loads neither
    from multigpu.sweep.scheduler import Slot
    from multigpu.sweep.search import Search, SearchPlan
    from multigpu.sweep.search_summary import TrialRow


def main(argv: Sequence[str] | None = None) -> int:
    """`sweep_multi_gpu.py [sweep flags] -- [training flags]`."""
    sweep_argv, train_argv = split_separated(sys.argv[1:] if argv is None else argv)
    return _one_line_errors(lambda: run(*_parsed(sweep_argv, train_argv, mixed=False)))


def main_mixed(argv: Sequence[str]) -> int:
    """The design notes' form, `main_multi_gpu.py --num-seeds N --max-gpus G [training flags]`."""
    sweep_argv, train_argv = split_separated(argv)
    return _one_line_errors(lambda: run(*_parsed(sweep_argv, train_argv, mixed=True)))


def _parsed(sweep_argv: list[str], train_argv: list[str], mixed: bool) -> tuple[SweepOptions, list[str]]:
    options, rest = parse(sweep_argv, mixed=mixed)
    return options, rest + train_argv


def _one_line_errors(action: Callable[[], int]) -> int:
    skip_the_collection_at_exit()  # the sweep imports torch: a second less at exit
    with best_effort():  # a console nobody reads any more (a dead pipe) never stops the sweep
        try:
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                raise UsageError(
                    "a sweep starts its own processes (torchrun ones too, with --gpus-per-run): "
                    "run it with python, not under torchrun"
                )
            return action()
        except UsageError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            return error.exit_code
        except KeyboardInterrupt:  # while the runs go, the scheduler turns Ctrl-C into a clean stop
            print("interrupted while no run was going", file=sys.stderr, flush=True)
            return 130


def run(options: SweepOptions, train_argv: list[str]) -> int:
    """Run the sweep (or, with --slurm, write its job array); return the exit status."""
    if options.search:
        return _run_search(options, train_argv)
    plan = build_plan(options, train_argv)
    options = dataclasses.replace(options, sweep_dir=plan.sweep_dir)  # the one chosen when none was given
    records.check_fingerprint(plan.sweep_dir, plan.fingerprint)
    if options.slurm:
        return _write_slurm_script(plan.sweep_dir, options, train_argv, len(plan.experiments), "experiments")
    mine = plan.shard(*options.shard)
    with records.exclusive(plan.sweep_dir, options.shard):
        earlier = records.read_results(plan.sweep_dir)
        to_run = [e for e in mine if _runs_again(earlier.get(e.name), options.retry_failed)]
        print(_plan_line(plan, options, len(mine)), flush=True)
        stopped = _run_experiments(plan, options, mine, to_run, earlier) if to_run else None
        if not to_run:
            print("nothing to run: every experiment of this sweep has a result", flush=True)
        return _finish(plan, options, mine, stopped)


def _runs_again(record: dict[str, Any] | None, retry_failed: bool) -> bool:
    return record is None or (record["status"] == "failed" and retry_failed)


def _plan_line(plan: Plan, options: SweepOptions, in_shard: int) -> str:
    grid = " x ".join(f"{len(axis.values)} {axis.field}" for axis in plan.axes)
    seeds = len(plan.experiments) // max(1, len(plan.points))
    shape = f"{grid} x {seeds} seed(s)" if grid else f"{seeds} seed(s)"
    shard = f"; shard {options.shard[0]}/{options.shard[1]}: {in_shard} of them" if options.sharded else ""
    return f"sweep {plan.sweep_dir}: {shape} = {len(plan.experiments)} experiments{shard}"


def _run_experiments(
    plan: Plan,
    options: SweepOptions,
    mine: list[Experiment],
    to_run: list[Experiment],
    earlier: dict[str, dict[str, Any]],
) -> str | None:
    done = sum(earlier.get(e.name, {}).get("status") == "ok" for e in mine)
    failed = sum(earlier.get(e.name, {}).get("status") == "failed" for e in mine) - sum(
        e.name in earlier for e in to_run
    )
    parts = [f"{done} done"] if done else []
    if failed:
        parts.append(f"{failed} failed before (not run again; --retry-failed runs them)")
    parts.append(f"{len(to_run)} to run" + _continuing(to_run))
    return _schedule(
        plan.sweep_dir,
        options,
        to_run,
        ", ".join(parts),
        plan.base.progress,
        {"experiments": len(mine), "done_before": done},
    )


def _continuing(to_run: list[Experiment]) -> str:
    resuming = sum(bool(glob.glob(os.path.join(glob.escape(e.save_dir), "*.pt"))) for e in to_run)
    return f" ({resuming} continue from their checkpoints)" if resuming else ""


def _schedule(
    sweep_dir: str,
    options: SweepOptions,
    to_run: list[Experiment],
    said: str,
    show_bar: bool,
    shown: dict[str, Any],
    found: tuple[list[Slot], str] | None = None,
    **more: Any,
) -> str | None:
    """Run `to_run` (and what the scheduler's `more` gives) on this machine's slots (`found`, else found here),
    after a line that says `said` and names the slots; `shown`: what progress.json holds beside the scheduler's
    own state."""
    from multigpu.sweep.scheduler import Scheduler

    slots, slot_line = found or _slots(options)
    print(f"{said}; {slot_line}", flush=True)
    progress_file = records.progress_path(sweep_dir, options.shard)
    static = {"sweep_dir": sweep_dir, "shard": f"{options.shard[0]}/{options.shard[1]}", **shown}

    def write_progress(state: dict[str, Any]) -> None:
        records.write_json_atomic(progress_file, {**static, **state})

    scheduler = Scheduler(
        slots,
        to_run,
        options,
        records.results_path(sweep_dir, options.shard),
        write_progress,
        show_bar=show_bar,
        **more,
    )
    return scheduler.run()


def _slots(options: SweepOptions) -> tuple[list[Slot], str]:
    """This machine's device slots and the line that names them."""
    from multigpu.sweep.scheduler import find_slots

    return find_slots(options, _visible_gpus())


def _visible_gpus() -> list[str]:
    """The ids of the GPUs this process may use, as CUDA_VISIBLE_DEVICES names them."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and not listed.strip():
        return []  # no GPU wanted: no need to load torch to count them
    import torch

    count = torch.cuda.device_count()
    ids = [part.strip() for part in listed.split(",") if part.strip()] if listed is not None else []
    return (ids or [str(index) for index in range(count)])[:count]


def _finish(plan: Plan, options: SweepOptions, mine: list[Experiment], stopped: str | None) -> int:
    with records.summary_lock(plan.sweep_dir):  # shards ending together: the last one sees every result
        results = records.read_results(plan.sweep_dir)
        table = summary.write(
            plan.sweep_dir, summary.summarize(plan, results), [axis.field for axis in plan.axes]
        )
    print(table, end="", flush=True)
    ok = [e for e in mine if results.get(e.name, {}).get("status") == "ok"]
    failed = [results[e.name] for e in mine if results.get(e.name, {}).get("status") == "failed"]
    whose = _whose(options)
    if stopped:
        return _stopped_status(stopped, f"{whose}{len(ok)} of {len(mine)} experiments done")
    merged = sum(e.name in results for e in plan.experiments)
    if options.sharded and merged < len(plan.experiments):
        print(
            f"the summary covers {merged} of {len(plan.experiments)} experiments so far (other shards have not "
            f"finished)",
            flush=True,
        )
    where = os.path.join(plan.sweep_dir, "summary.md")
    if failed:
        print(
            f"error: {whose}{len(failed)} of {len(mine)} experiments failed (summary: {where}):",
            file=sys.stderr,
            flush=True,
        )
        for record in failed:
            print(
                f"  {record['experiment']}: {record['error']} (log {record['log']})",
                file=sys.stderr,
                flush=True,
            )
        print("  rerun with --retry-failed to run them again", file=sys.stderr, flush=True)
        return 1
    not_learned = [e.name for e in mine if summary.did_not_learn(results.get(e.name, {})) is not None]
    learning = f" ({len(not_learned)} did not learn: {', '.join(not_learned)})" if not_learned else ""
    print(
        f"sweep done: {whose}{len(ok)} of {len(mine)} experiments ok{learning}; summary {where} (and summary.csv); "
        f"compare the runs with: tensorboard --logdir {plan.sweep_dir}",
        flush=True,
    )
    return 0


def _whose(options: SweepOptions) -> str:
    return f"shard {options.shard[0]}/{options.shard[1]}: " if options.sharded else ""


def _stopped_status(stopped: str, done: str) -> int:
    """The line and exit status (128 + N) of a sweep stopped by signal `stopped`, `done` saying how far it got."""
    print(f"stopped by {stopped}: {done}; rerun the same command to continue", file=sys.stderr, flush=True)
    return 128 + {"SIGINT": 2, "SIGTERM": 15}.get(stopped, 15)


def _run_search(options: SweepOptions, train_argv: list[str]) -> int:
    """--search optuna: trials drawn by the study, run on the slots, told as they end (multigpu/sweep/search.py)."""
    from multigpu.sweep.search import Search, build_search_plan
    from multigpu.sweep.study import require_optuna

    require_optuna()
    from multigpu.sweep import journal  # it needs Optuna

    plan = build_search_plan(options, train_argv)
    options = dataclasses.replace(options, sweep_dir=plan.sweep_dir)  # the one chosen when none was given
    records.check_fingerprint(plan.sweep_dir, plan.fingerprint)
    if options.slurm:
        return _write_slurm_script(plan.sweep_dir, options, train_argv, options.trials, "trials")
    with records.exclusive(plan.sweep_dir, options.shard):
        # Before the study is opened: damage refused, a cut-short record set aside; alone (one shard, whose lock
        # this holds), the journal's locks a killed driver left are its own.
        repaired = journal.check(plan.sweep_dir, alone=not options.sharded)
        if repaired:
            print(repaired, file=sys.stderr, flush=True)
        found = _slots(options)
        search = Search(plan, options, records.read_results(plan.sweep_dir), len(found[0]))
        resumed = search.resume()
        print(_search_line(plan, options), flush=True)
        trials = search.study.get_trials(deepcopy=False)
        new = max(0, options.trials - len(trials))
        ended = sum(trial.state.name != "RUNNING" for trial in trials)
        said = (
            f"{ended} trial(s) ended before, {len(resumed)} run(s) to resume{_continuing(resumed)}, "
            f"{new} trial(s) to draw"
        )
        stopped = _schedule(
            plan.sweep_dir,
            options,
            resumed,
            said,
            plan.base.progress,
            {"trials": options.trials, "ended_before": ended},
            found,
            more=search.more,
            recorded=search.recorded,
            total=len(resumed) + new * len(plan.seeds),
        )
        return _finish_search(plan, options, search, stopped)


def _search_line(plan: SearchPlan, options: SweepOptions) -> str:
    space = " ".join(dimension.text for dimension in plan.space)
    way = "lower" if plan.lower_is_better else "higher"
    return (
        f"search {plan.sweep_dir}: {options.trials} trials of {space} x {len(plan.seeds)} seed(s); sampler "
        f"{options.sampler}, pruner {options.prune}; objective {plan.objective} ({way} is better)"
    )


def _finish_search(plan: SearchPlan, options: SweepOptions, search: Search, stopped: str | None) -> int:
    """The trial table, the best trial and its command, TensorBoard's HParams and the plots; the exit status."""
    from multigpu.sweep import search_summary, study_views

    with records.summary_lock(plan.sweep_dir):  # drivers ending together: the last one sees every trial
        rows = search_summary.trial_rows(
            search.study.get_trials(deepcopy=False), records.read_results(plan.sweep_dir), plan.seeds
        )
        table = search_summary.write(plan.sweep_dir, rows, plan.objective, plan.space)
        hparams = study_views.write_hparams(plan.sweep_dir, plan.space, plan.objective, rows)
        plots = study_views.write_plots(plan.sweep_dir, search.study)
    print(table, end="", flush=True)
    print(_best_line(plan, rows), flush=True)
    trained = sum(row.epochs or 0 for row in rows)
    print(
        f"epochs trained: {trained} of the {len(rows) * len(plan.seeds) * plan.max_epochs} that {len(rows)} "
        f"trial(s) x {len(plan.seeds)} seed(s) x {plan.max_epochs} epochs would train unpruned",
        flush=True,
    )
    print(plots, flush=True)
    mine = {trial.number for trial in search.mine()}
    return _search_status(
        options,
        [row for row in rows if row.number in mine and row.state != "running"],
        stopped,
        os.path.join(plan.sweep_dir, "summary.md"),
        hparams,
    )


def _search_status(
    options: SweepOptions, ended: list[TrialRow], stopped: str | None, where: str, hparams: str
) -> int:
    """The closing line and exit status of this driver's trials that `ended`."""
    whose = _whose(options)
    if stopped:
        return _stopped_status(stopped, f"{whose}{len(ended)} of {options.trials} trials ended")
    failed = [row for row in ended if row.state == "failed"]
    if failed:
        print(
            f"error: {whose}{len(failed)} of {len(ended)} trials failed (summary: {where}):",
            file=sys.stderr,
            flush=True,
        )
        for row in failed:
            print(f"  trial {row.number}: {row.error}", file=sys.stderr, flush=True)
        return 1
    pruned = sum(row.state == "pruned" for row in ended)
    print(
        f"search done: {whose}{len(ended)} trials ended ({pruned} pruned); summary {where} (and summary.csv); "
        f"compare the trials with: tensorboard --logdir {hparams}",
        flush=True,
    )
    return 0


def _best_line(plan: SearchPlan, rows: list[TrialRow]) -> str:
    from multigpu.sweep import search_summary

    best = search_summary.best(rows, plan.lower_is_better)
    if best is None:
        return "best: no trial has completed yet"
    over = f" (mean over {len(plan.seeds)} seeds)" if len(plan.seeds) > 1 else ""
    command = search_summary.command(plan.train_argv, plan.flags(best.params), plan.seeds)
    return f"best: trial {best.number}, {plan.objective} {best.value:.4f}{over}; train it with: {command}"


def _write_slurm_script(
    sweep_dir: str, options: SweepOptions, train_argv: list[str], count: int, what: str
) -> int:
    """--slurm: write the job array of a sweep of `count` `what` (experiments of a grid, trials of a search)."""
    path = slurm.write_script(sweep_dir, count, what, options, train_argv)
    tasks, parallel = slurm.array_size(count, options)
    at_once = f", at most {parallel} at a time" if parallel else ""
    print(f"wrote {path}: {count} {what} in {tasks} array tasks{at_once}", flush=True)
    if not options.submit:
        print(f"submit it with: sbatch {path}", flush=True)
        return 0
    job = slurm.submit(path)
    print(
        f"submitted job array {job}; task output in {os.path.join(sweep_dir, 'slurm')}; the merged summary "
        f"is {os.path.join(sweep_dir, 'summary.md')} once the tasks end",
        flush=True,
    )
    return 0
