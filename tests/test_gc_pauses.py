"""The collector's view while training: objects alive at the start are frozen during fit() and given back after."""

from __future__ import annotations

import gc

from conftest import blobs, config_for, tiny_model
from multigpu.gc_pauses import long_lived_objects_frozen
from multigpu.batches import default_forward
from train_multi_gpu import MultiGPUTrainer


def test_the_block_freezes_what_is_alive_and_unfreezes_it_after():
    assert gc.get_freeze_count() == 0
    alive = [[] for _ in range(10)]  # tracked objects made before the block
    with long_lived_objects_frozen():
        assert gc.get_freeze_count() >= len(alive)
        assert gc.is_tracked(alive[0]) and not any(item is alive[0] for item in gc.get_objects())  # out of sight
    assert gc.get_freeze_count() == 0
    assert any(item is alive[0] for item in gc.get_objects())  # collectable again


def test_a_freeze_the_program_made_itself_is_left_alone():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with long_lived_objects_frozen():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen  # not undone by the block's end
    finally:
        gc.unfreeze()


def test_fit_trains_with_the_objects_of_its_start_frozen(tmp_path):
    seen: list[int] = []

    def forward(model, batch):  # called by every training step
        seen.append(gc.get_freeze_count())
        return default_forward(model, batch)

    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(32, 1), config_for(tmp_path, 1, epochs=1),
                              forward_fn=forward)
    seen.clear()  # the start-up FLOP count's forward
    assert gc.get_freeze_count() == 0
    trainer.fit()
    assert seen and min(seen) > 1000  # the model, the optimizer and the libraries, at every step
    assert gc.get_freeze_count() == 0  # given back when fit returns
