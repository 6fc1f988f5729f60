"""Losses over tokens (multigpu/loop/tokens.py): a step's loss is the mean over every counted target token of
the step, so one process at batch 2B, one at B with 2 accumulation steps, DDP 2 x B and fsdp 2 x B train the
same weights, and the validation loss is the per-token mean for any world size and evaluation batch.

The data: samples of 12 positions whose targets count between 1 and 12 tokens (the rest -100, as Hugging
Face's collators pad them). The three ways a model meets them: a dict batch whose model returns its own loss
(and takes `num_items_in_batch`), a transformers GPT-2 from a tiny config, and (inputs, targets) pairs with the
trainer's default loss on (B, T, V) logits.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from conftest import config_for, full_weights, run_ranks, tiny_gpt2, tiny_model
from multigpu.loop.forward import fitted_forward
from multigpu.loop.tokens import IGNORE_INDEX, SequenceCrossEntropy, are_tokens, targets_in
from train_multi_gpu import MultiGPUTrainer

VOCAB, LENGTH, SAMPLES = 11, 12, 64
TOLERANCE = 1e-6
KINDS = ("own_loss", "gpt2", "default_loss")


class UnevenTokens(Dataset):
    """Token windows whose targets count 1 to 12 tokens: the rest of each sample's labels are -100."""

    def __init__(self, samples: int, seed: int, as_pairs: bool = False):
        draw = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (samples, LENGTH), generator=draw)
        counted = torch.randint(1, LENGTH + 1, (samples,), generator=draw)
        self.labels = torch.where(torch.arange(LENGTH) < counted[:, None], self.ids.roll(-1, 1), IGNORE_INDEX)
        self.as_pairs = as_pairs
        self.fixed_samples = True

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> Any:
        if self.as_pairs:
            return self.ids[index], self.labels[index]
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


class OwnLossLM(torch.nn.Module):
    """A dict-batch LM that returns its own loss, a mean over its counted tokens, or their sum over
    `num_items_in_batch` when given it (transformers' convention); it notes the counts it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)
        self.given: list[int] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        if labels is None:
            return {"logits": logits}
        flat = logits.flatten(0, 1), labels.flatten()
        if num_items_in_batch is None:
            return {"loss": F.cross_entropy(*flat), "logits": logits}
        self.given.append(int(num_items_in_batch))
        return {"loss": F.cross_entropy(*flat, reduction="sum") / num_items_in_batch, "logits": logits}


class PairLM(torch.nn.Module):
    """(B, T) ids in, (B, T, V) logits out: the trainer's default loss compares them with (B, T) targets."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def model_of(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return {"own_loss": OwnLossLM, "gpt2": gpt2, "default_loss": PairLM}[kind]()


def train(
    tmp_path: Path,
    kind: str,
    world: int,
    batch: int,
    accumulate: int,
    weighting: str = "auto",
    multi_gpu: str | None = None,
) -> dict[str, torch.Tensor]:
    """The weights after 2 epochs of 4 steps, SGD without momentum: every step's gradient shows."""
    model = model_of(kind)
    data = UnevenTokens(SAMPLES, 0, as_pairs=kind == "default_loss")
    config = config_for(
        tmp_path,
        world,
        batch_size=batch,
        grad_accum_steps=accumulate,
        optimizer="sgd",
        lr=0.5,
        momentum=0.0,
        weight_decay=0.0,
        lr_schedule="constant",
        max_steps=6,
        epochs=2,
        loss_weighting=weighting,
        checkpoint_format="file",
        **({"multi_gpu": multi_gpu} if multi_gpu else {}),
    )
    with MultiGPUTrainer(model, data, None, config) as trainer:
        trainer.fit()
        return full_weights(trainer)


def max_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    return max((first[name] - second[name]).abs().max().item() for name in first)


def ranks_train(rank: int, world: int, tmp_path: Path) -> dict[tuple[str, str], Any]:
    """Each kind under ddp and fsdp at 2 x 8, on every rank (rank 0's weights are the result)."""
    return {
        (kind, mode): train(tmp_path / f"{kind}-{mode}", kind, world, 8, 1, multi_gpu=mode)
        for kind in KINDS
        for mode in ("ddp", "fsdp")
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("one")
    return {
        (kind, shape): train(root / f"{kind}-{shape}", kind, 1, batch, accumulate)
        for kind in KINDS
        for shape, batch, accumulate in (("16", 16, 1), ("8x2", 8, 2))
    }


@pytest.mark.parametrize("kind", KINDS)
def test_accumulating_two_micro_batches_trains_the_weights_of_one_batch_twice_as_large(one_process, kind):
    assert max_difference(one_process[(kind, "16")], one_process[(kind, "8x2")]) <= TOLERANCE


def test_weighting_by_samples_is_what_differs_on_uneven_tokens(one_process, tmp_path):
    # The switch is real: by samples, two micro-batches of 8 are not one of 16 when their token counts differ.
    by_samples = train(tmp_path, "own_loss", 1, 8, 2, weighting="samples")
    assert max_difference(one_process[("own_loss", "16")], by_samples) > 1e-3


def test_ddp_and_fsdp_over_two_ranks_train_the_weights_of_one_process_with_their_whole_batch(
    one_process, tmp_path
):
    ranks = run_ranks(ranks_train, 2, tmp_path, tmp_path)
    for (kind, mode), weights in ranks[0].items():
        assert max_difference(one_process[(kind, "16")], weights) <= TOLERANCE, (kind, mode)


def test_a_model_that_takes_num_items_in_batch_gets_the_whole_steps_count(tmp_path):
    model = model_of("own_loss")
    counted: list[int] = []  # each micro-batch's own count, as the model's forward sees its labels

    def count_labels(module: torch.nn.Module, args: tuple, kwargs: dict, outputs: Any) -> None:
        counted.append(int((kwargs["labels"] != IGNORE_INDEX).sum()))

    model.register_forward_hook(count_labels, with_kwargs=True)
    config = config_for(tmp_path, 1, batch_size=8, grad_accum_steps=2, max_steps=2, optimizer="sgd")
    with MultiGPUTrainer(model, UnevenTokens(SAMPLES, 0), None, config) as trainer:
        trainer.fit()
    training = counted[-4:]  # the start's probes (the FLOP count) come first
    assert model.given[-4:] == [training[0] + training[1]] * 2 + [training[2] + training[3]] * 2


def test_a_loss_fn_that_takes_num_items_gets_the_steps_count(tmp_path):
    seen: list[int] = []

    def summed_over_items(
        logits: torch.Tensor, targets: torch.Tensor, num_items: torch.Tensor
    ) -> torch.Tensor:
        seen.append(int(num_items))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / num_items

    config = config_for(tmp_path, 1, batch_size=8, grad_accum_steps=2, max_steps=1, epochs=1)
    with MultiGPUTrainer(
        model_of("default_loss"),
        UnevenTokens(SAMPLES, 0, as_pairs=True),
        None,
        config,
        loss_fn=summed_over_items,
    ) as trainer:
        trainer.fit()
    assert len(seen) == 2 and seen[0] == seen[1] > 0


def per_token_loss(kind: str, data: UnevenTokens) -> tuple[float, float]:
    """The validation loss and token accuracy by hand: every counted token of the set, one mean."""
    model = model_of(kind).eval()
    with torch.no_grad():
        if kind == "gpt2":
            logits = model(input_ids=data.ids).logits[:, :-1]
            labels = torch.nn.functional.pad(data.labels, (0, 1), value=IGNORE_INDEX)[:, 1:-1]
        else:
            logits = model.head(torch.tanh(model.embed(data.ids)))  # type: ignore[operator]  # submodules
            labels = data.labels
    losses = F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), reduction="sum")
    counted = labels != IGNORE_INDEX
    right = ((logits.argmax(-1) == labels) & counted).sum()
    return losses.item() / counted.sum().item(), right.item() / counted.sum().item()


def ranks_evaluate(rank: int, world: int, tmp_path: Path) -> dict[tuple[str, int], dict[str, float]]:
    results = {}
    for kind in KINDS:
        data = UnevenTokens(45, 1, as_pairs=kind == "default_loss")
        for batch in (1, 7, 16):
            config = config_for(tmp_path / f"{kind}-{batch}", world, eval_batch_size=batch)
            with MultiGPUTrainer(
                model_of(kind), UnevenTokens(SAMPLES, 0, as_pairs=kind == "default_loss"), data, config
            ) as trainer:
                results[(kind, batch)] = trainer.evaluate()
    return results


@pytest.mark.parametrize("world", [1, 2, 3])
def test_validation_is_the_per_token_mean_for_any_world_size_and_evaluation_batch(world, tmp_path):
    results = (
        run_ranks(ranks_evaluate, world, tmp_path, tmp_path)[0]
        if world > 1
        else ranks_evaluate(0, 1, tmp_path)
    )
    for kind in KINDS:
        loss, accuracy = per_token_loss(kind, UnevenTokens(45, 1))
        for batch in (1, 7, 16):
            result = results[(kind, batch)]
            assert result["loss"] == pytest.approx(loss, rel=1e-5), (kind, batch)
            assert result["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
            assert result["acc"] == pytest.approx(accuracy, abs=1e-12)
            assert result["count"] == 45 and result["tokens"] > 45


def test_token_targets_are_told_from_sample_targets():
    assert are_tokens(torch.zeros(4, 12, dtype=torch.long))  # a sequence dimension
    assert are_tokens(torch.tensor([3, IGNORE_INDEX, 1]))  # the ignore index
    assert not are_tokens(torch.tensor([3, 0, 1]))  # one class per sample
    assert not are_tokens(torch.zeros(4, 12))  # real-valued targets
    assert targets_in({"input_ids": torch.ones(2), "labels": torch.zeros(2)}) is not None


def test_the_default_loss_reads_class_scores_in_the_last_dimension_of_a_sequence():
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    targets[0, 3] = IGNORE_INDEX
    expected = F.cross_entropy(logits.reshape(10, 7), targets.reshape(10))
    assert torch.allclose(SequenceCrossEntropy()(logits, targets), expected)
    images = torch.randn(2, 7, 5)  # (N, C, L): classes in dimension 1, as torch reads them
    assert torch.allclose(SequenceCrossEntropy()(images, targets), F.cross_entropy(images, targets))


class TokenStream(torch.utils.data.IterableDataset):
    """UnevenTokens as a stream: no sample can be read before training, so auto decides at the first batch."""

    def __init__(self) -> None:
        self.data = UnevenTokens(SAMPLES, 0)

    def __iter__(self):
        return (self.data[index] for index in range(len(self.data)))


def test_a_stream_is_weighted_by_tokens_from_its_first_batch(tmp_path):
    weights = {}
    for batch, accumulate in ((16, 1), (8, 2)):
        config = config_for(
            tmp_path / str(batch),
            1,
            batch_size=batch,
            grad_accum_steps=accumulate,
            optimizer="sgd",
            lr=0.5,
            momentum=0.0,
            weight_decay=0.0,
            lr_schedule="constant",
            epochs=1,
        )
        with MultiGPUTrainer(model_of("own_loss"), TokenStream(), None, config) as trainer:
            assert trainer.weighting.mode is None  # undecided until the first window
            trainer.fit()
            assert trainer.weighting.mode == "tokens"
            weights[batch] = full_weights(trainer)
    assert max_difference(weights[16], weights[8]) <= TOLERANCE


class ClassesFirstLM(PairLM):
    """PairLM's scores in torch's own layout for a sequence, (B, V, T): what nn.CrossEntropyLoss takes with
    (B, T) targets."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).transpose(1, 2)


def test_scores_with_the_classes_in_dimension_1_are_read_as_torch_reads_them_by_the_loss_and_the_accuracy(
    tmp_path,
):
    data = UnevenTokens(45, 1, as_pairs=True)
    results = []
    for model in (PairLM(), ClassesFirstLM()):
        torch.manual_seed(0)
        model.load_state_dict(model_of("default_loss").state_dict())  # the same weights, either layout
        config = config_for(tmp_path / type(model).__name__, 1, eval_batch_size=7)
        with MultiGPUTrainer(model, UnevenTokens(SAMPLES, 0, as_pairs=True), data, config) as trainer:
            results.append(trainer.evaluate())
    loss, accuracy = per_token_loss("default_loss", UnevenTokens(45, 1))
    for result in results:
        assert result["loss"] == pytest.approx(loss, rel=1e-5) and result["acc"] == pytest.approx(accuracy)
    assert results[0]["count"] == results[1]["count"] == 45 and results[0]["tokens"] == results[1]["tokens"]


def test_a_transformers_model_builds_no_key_value_cache_in_training_and_its_config_stays():
    """(Here, where transformers is imported anyway; multigpu/loop/forward.py's ModelForward.) A transformers causal
    LM's config asks for a key/value cache at every forward (use_cache, for generation):
    a training or evaluation forward has no use for it (Hugging Face's Trainer turns it off too; it cost this
    project's GPT-2 steps about 15% of their CPU time). It is turned off per call, and the config, saved with
    the model, is left as it was."""
    model = tiny_gpt2()
    assert model.config.use_cache
    ids = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(0))
    forward = fitted_forward(model)
    for batch in ({"input_ids": ids, "labels": ids}, (ids, ids)):
        outputs, targets = forward(model, batch)
        assert outputs.past_key_values is None and targets is ids
    assert model.config.use_cache  # untouched
    assert model(ids).past_key_values is not None  # what the model's own call builds
    assert fitted_forward(tiny_model()).no_cache == {}  # a model of no such config: nothing added
