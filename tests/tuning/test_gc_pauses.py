"""The collector's view while training: objects alive at the start are frozen during fit() and given back after."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from conftest import REPO, blobs, cli_env, config_for, tiny_model
from multigpu.loop.forward import default_forward
from multigpu.tuning.gc_pauses import long_lived_objects_frozen
from train_multi_gpu import MultiGPUTrainer


def test_the_block_freezes_what_is_alive_and_unfreezes_it_after():
    assert gc.get_freeze_count() == 0
    alive = [[] for _ in range(10)]  # tracked objects made before the block
    with long_lived_objects_frozen():
        assert gc.get_freeze_count() >= len(alive)
        assert gc.is_tracked(alive[0]) and not any(
            item is alive[0] for item in gc.get_objects()
        )  # out of sight
    assert gc.get_freeze_count() == 0
    assert any(item is alive[0] for item in gc.get_objects())  # collectable again


def test_a_freeze_the_program_made_itself_is_left_alone():
    """Seen by where an object of the program's freeze is, not by the frozen count: a frozen object that another
    thread frees (a queue's feeder thread ending) lowers the count, and that failed the quick tier once."""
    alive = [[]]
    gc.freeze()
    try:
        with long_lived_objects_frozen():
            assert not any(item is alive[0] for item in gc.get_objects())  # still in the program's freeze
        assert gc.get_freeze_count() > 0
        assert not any(item is alive[0] for item in gc.get_objects())  # not undone by the block's end
    finally:
        gc.unfreeze()
    assert any(item is alive[0] for item in gc.get_objects())  # the check sees an unfreeze


def test_fit_trains_with_the_objects_of_its_start_frozen(tmp_path):
    seen: list[int] = []

    def forward(model, batch):  # called by every training step
        seen.append(gc.get_freeze_count())
        return default_forward(model, batch)

    trainer = MultiGPUTrainer(
        tiny_model(), blobs(64, 0), blobs(32, 1), config_for(tmp_path, 1, epochs=1), forward_fn=forward
    )
    seen.clear()  # the start-up FLOP count's forward
    assert gc.get_freeze_count() == 0
    trainer.fit()
    assert seen and min(seen) > 1000  # the model, the optimizer and the libraries, at every step
    assert gc.get_freeze_count() == 0  # given back when fit returns


# A handler registered before the skip runs after it (atexit is last-in, first-out): it sees what the
# interpreter's final collection will see.
REPORT_AT_EXIT = """
import atexit, gc, sys
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
{body}
print("frozen before exit:", gc.get_freeze_count() > 0, flush=True)
"""


def run_and_report(body: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", REPORT_AT_EXIT.format(body=body), *args],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_collection_at_exit_is_skipped_once_asked_and_registered_once():
    registered = run_and_report("""
from multigpu.tuning.gc_pauses import skip_the_collection_at_exit
before = atexit._ncallbacks()
skip_the_collection_at_exit(); skip_the_collection_at_exit()
print("handlers added:", atexit._ncallbacks() - before)""")
    assert registered.splitlines() == [
        "handlers added: 1",
        "frozen before exit: False",
        "frozen at exit: True",
    ]
    assert run_and_report("pass").splitlines() == ["frozen before exit: False", "frozen at exit: False"]


@pytest.mark.slow
def test_every_command_skips_it():
    for module in ("main_multi_gpu", "predict_multi_gpu", "sweep_multi_gpu"):
        output = run_and_report(f"""
import {module}
try:
    {module}.main(["--help"])
except SystemExit:
    pass""")
        assert output.splitlines()[-2:] == ["frozen before exit: False", "frozen at exit: True"], module
    launcher_wrapper = run_and_report("""
sys.argv = ["torchrun.py"]
from multigpu.launch import torchrun
try:
    torchrun.main()
except SystemExit:
    pass""")
    assert launcher_wrapper.splitlines()[-2:] == ["frozen before exit: False", "frozen at exit: True"]
