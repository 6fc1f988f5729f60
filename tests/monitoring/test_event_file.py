"""TensorBoard's event file as the training loop writes it: readable by TensorBoard at once, purge on resume."""

from __future__ import annotations

from pathlib import Path

from conftest import event_files, read_scalars
from multigpu.monitoring.event_file import EventFile


def test_with_no_delay_each_write_is_on_disk_before_the_file_is_closed(tmp_path: Path):
    events = EventFile(str(tmp_path), max_delay=0)
    events.scalars({"train/loss": 2.5, "train/lr": 0.5}, step=50)
    assert read_scalars(tmp_path) == {"train/loss": [(50, 2.5)], "train/lr": [(50, 0.5)]}  # still open
    events.scalars({"train/loss": 1.25}, step=100)
    assert read_scalars(tmp_path)["train/loss"] == [(50, 2.5), (100, 1.25)]
    events.close()
    events.close()  # a second close is harmless
    assert len(event_files(tmp_path)) == 1


def test_events_are_held_up_to_the_delay_then_written_together_in_order(tmp_path: Path):
    events = EventFile(str(tmp_path), max_delay=3600)
    for step in (1, 2, 3):
        events.scalars({"train/loss": float(step)}, step)
    assert read_scalars(tmp_path) == {}  # held: within the delay nothing is written
    events.flush()  # a sync point that must be on disk (an epoch's end) flushes
    assert read_scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    events.scalars({"train/loss": 4.0}, 4)
    events.close()  # closing writes what is held
    assert read_scalars(tmp_path)["train/loss"][-1] == (4, 4.0)


def test_two_files_of_one_process_in_one_second_get_their_own_names(tmp_path: Path):
    first, second = EventFile(str(tmp_path)), EventFile(str(tmp_path))
    assert first.path != second.path
    first.close()
    second.close()


def test_a_process_s_files_sort_in_the_order_it_made_them_past_the_tenth(tmp_path: Path):
    # TensorBoard reads a folder's files in name order: a resumed run's purge only works after the file it purges.
    made = [EventFile(str(tmp_path / "tb")) for _ in range(12)]
    for events in made:
        events.close()
    assert sorted(Path(events.path).name for events in made) == [Path(events.path).name for events in made]


def test_a_purge_step_drops_what_an_earlier_file_logged_from_that_step_on(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    crashed = EventFile(str(tmp_path))
    for step in (10, 20, 30, 40):  # the crashed run logged 30 and 40 after its last checkpoint at 20
        crashed.scalars({"train/loss": float(step)}, step)
    crashed.close()
    resumed = EventFile(str(tmp_path), purge_step=30)
    for step in (30, 40, 50):
        resumed.scalars({"train/loss": -float(step)}, step)
    resumed.close()
    accumulator = EventAccumulator(
        str(tmp_path), size_guidance={"scalars": 0}
    )  # the directory, as TensorBoard
    accumulator.Reload()
    assert [(event.step, event.value) for event in accumulator.Scalars("train/loss")] == [
        (10, 10.0),
        (20, 20.0),
        (30, -30.0),
        (40, -40.0),
        (50, -50.0),
    ]


def test_records_carry_the_checksums_tensorboard_computes(tmp_path: Path):
    import os

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import (
        masked_crc32c as tensorboard_masked_crc32c,
    )

    from multigpu.monitoring.event_file import crc32c, frame, masked_crc32c

    assert crc32c(b"123456789") == 0xE3069283  # CRC-32C's published check value
    for length in range(0, 41):  # every remainder of the four-byte steps, and the empty record
        data = os.urandom(length)
        assert masked_crc32c(data) == tensorboard_masked_crc32c(data), length
        record = frame(data)
        assert len(record) == 8 + 4 + length + 4 and record[12 : 12 + length] == data
