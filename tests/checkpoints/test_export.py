"""python -m multigpu.export and --init-from (multigpu/checkpoints/export.py, multigpu/checkpoints/weights.py): a
checkpoint's weights as safetensors (one file, or shards and an index; bf16), read back by safetensors alone with
the tied weight restored; a 2-process fsdp run's sharded folder exported, then loaded with --init-from's code into
a model sharded over 2 processes (each reading its part only) and into one process: the source model's logits
exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import main_multi_gpu
from conftest import assert_untouched, config_for, contents, run_ranks
from multigpu.checkpoints import checkpoint, export, sharded, weights
from multigpu.errors import CheckpointError, UsageError
from multigpu.models import GPT
from train_multi_gpu import MultiGPUTrainer

safetensors = pytest.importorskip("safetensors.torch", reason="the [hf] extra (safetensors) is not installed")

VOCAB, BLOCK = 24, 8


def gpt(seed: int) -> GPT:
    """A tiny GPT (tied embedding and output layer), its weights drawn from `seed`."""
    torch.manual_seed(seed)
    return GPT(VOCAB, BLOCK, n_layer=2, n_head=2, n_embd=16)


def tokens(size: int, seed: int) -> TensorDataset:
    """Windows of random tokens and their next tokens."""
    stream = torch.randint(VOCAB, (size, BLOCK + 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(stream[:, :-1], stream[:, 1:])


def logits(model: torch.nn.Module, dataset: TensorDataset) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(dataset.tensors[0])[0]


class _Reads:
    """Records the shapes --init-from's code reads from a weights file (wrapping Source.read)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[str, tuple[int, ...]]] = []
        self.original = weights.Source.__init__

    def install(self) -> None:
        reads, original = self, self.original

        def init(source: Any, path: str, shapes: Any, read: Any, describe: str) -> None:
            def recorded(name: str, index: Any = None) -> torch.Tensor:
                tensor = read(name, index)
                reads.shapes.append((name, tuple(tensor.shape)))
                return tensor

            original(source, path, shapes, recorded, describe)

        weights.Source.__init__ = init  # type: ignore[method-assign,assignment]  # a recording stand-in


def _fsdp_train_export_and_init(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    """fsdp at 2 processes: 2 steps saved as a sharded folder; rank 0 exports it to safetensors; then a model of
    other weights, sharded the same way, loads the export and then the folder itself with --init-from's code."""
    config = config_for(
        tmp_path,
        world_size,
        multi_gpu="fsdp",
        checkpoint_format="sharded",
        epochs=1,
        max_steps=2,
        batch_size=4,
    )
    with MultiGPUTrainer(gpt(0), tokens(16, 0), tokens(8, 1), config) as trainer:
        trainer.fit()
    out = tmp_path / "model.safetensors"
    if rank == 0:
        export.export(str(tmp_path / "ckpt" / "last"), str(out))
    dist.barrier()
    reads = _Reads()
    reads.install()
    fresh = config_for(tmp_path / "fresh", world_size, multi_gpu="fsdp", epochs=1)
    results: dict[str, Any] = {}
    with MultiGPUTrainer(gpt(1), tokens(16, 0), tokens(8, 1), fresh) as trainer:
        results["before"] = trainer.predict()
        for name, path in (("export", out), ("folder", tmp_path / "ckpt" / "last")):
            weights.load_initial(trainer.model, str(path), strict=True, say=lambda line: None)
            results[name] = trainer.predict()
    results["reads"] = reads.shapes
    return results


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp_path = tmp_path_factory.mktemp("fsdp-export")
    rank0, _ = run_ranks(_fsdp_train_export_and_init, 2, tmp_path, tmp_path)
    return tmp_path, rank0


@pytest.mark.slow
def test_a_sharded_fsdp_folder_exports_to_safetensors_that_safetensors_alone_reads(fsdp_run):
    tmp_path, _ = fsdp_run
    whole = sharded.load_whole(str(tmp_path / "ckpt" / "last"))
    stored = safetensors.load_file(str(tmp_path / "model.safetensors"))  # no pickle: safetensors' own reader
    # The tied output layer is stored once, under the embedding's name, and named in the header.
    assert set(stored) == set(whole["model"]) - {"lm_head.weight"}
    header = weights.tensor_files.header(str(tmp_path / "model.safetensors"))
    assert json.loads(header[weights.tensor_files.TIED_KEY]) == {"lm_head.weight": "token_embedding.weight"}
    restored, _ = weights.tensor_files.load(str(tmp_path / "model.safetensors"))
    assert restored.keys() == whole["model"].keys()
    for name, tensor in whole["model"].items():
        assert torch.equal(restored[name], tensor), name
    assert restored["lm_head.weight"] is restored["token_embedding.weight"]


@pytest.mark.slow
def test_init_from_under_2_process_fsdp_reads_only_each_ranks_shards_and_gives_the_source_logits(fsdp_run):
    tmp_path, rank0 = fsdp_run
    source = gpt(2)
    source.load_state_dict(sharded.load_whole(str(tmp_path / "ckpt" / "last"))["model"])
    expected = logits(source, tokens(8, 1))
    assert not torch.equal(rank0["before"], expected)  # other weights before loading
    torch.testing.assert_close(rank0["export"], expected, rtol=0, atol=0)
    torch.testing.assert_close(rank0["folder"], expected, rtol=0, atol=0)
    # Rank 0 read its half of each weight's rows (FSDP2 shards dim 0), never a whole tensor of the model.
    full = {name: tuple(t.shape) for name, t in source.state_dict().items()}
    assert len(rank0["reads"]) == len(full)
    for name, shape in rank0["reads"]:
        assert shape == ((full[name][0] + 1) // 2, *full[name][1:]), name


@pytest.mark.slow
def test_init_from_in_one_process_loads_the_export_strictly_with_the_tied_weight(fsdp_run, capsys):
    tmp_path, _ = fsdp_run
    source = gpt(2)
    source.load_state_dict(sharded.load_whole(str(tmp_path / "ckpt" / "last"))["model"])
    model = gpt(3)
    lines: list[str] = []
    weights.load_initial(model, str(tmp_path / "model.safetensors"), strict=True, say=lines.append)
    assert model.lm_head.weight is model.token_embedding.weight  # still tied, not two copies
    torch.testing.assert_close(logits(model, tokens(8, 1)), logits(source, tokens(8, 1)), rtol=0, atol=0)
    assert lines == [
        f"--init-from {tmp_path / 'model.safetensors'}: {len(source.state_dict())} tensors loaded "
        f"from safetensors (weights only: the optimizer, schedule and progress start afresh)"
    ]


@pytest.mark.slow
def test_shards_and_their_index_above_max_shard_size_and_bf16(fsdp_run, tmp_path, capsys):
    folder, _ = fsdp_run
    out = tmp_path / "small" / "model.safetensors"
    out.parent.mkdir()
    assert (
        export.main([str(folder / "ckpt" / "last"), str(out), "--max-shard-size", "2KB", "--dtype", "bf16"])
        == 0
    )
    line = capsys.readouterr().out
    index = json.loads((out.parent / "model.safetensors.index.json").read_text())
    files = sorted(path.name for path in out.parent.iterdir() if path.name != "model.safetensors.index.json")
    assert len(files) > 1 and files == sorted(set(index["weight_map"].values())) and not out.exists()
    assert f"to {out} ({len(files) + 1} files)" in line
    shards = {name: safetensors.load_file(str(out.parent / name)) for name in files}
    assert all(
        sum(t.numel() * t.element_size() for t in shard.values()) <= 2000 or len(shard) == 1
        for shard in shards.values()
    )
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for s in shards.values() for t in s.values()
    )
    whole = sharded.load_whole(str(folder / "ckpt" / "last"))["model"]
    for name, file in index["weight_map"].items():
        assert shards[file][name].dtype == torch.bfloat16
        assert torch.equal(shards[file][name], whole[name].to(torch.bfloat16)), name
    # The index loads as the single file does, the tied weight restored.
    model = gpt(4)
    weights.load_initial(model, str(out.parent / "model.safetensors.index.json"), strict=True, say=print)
    assert torch.equal(model.lm_head.weight, whole["lm_head.weight"].to(torch.bfloat16).float())


@pytest.fixture(scope="module")
def one_file_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The save-dir of a 2-step run in one process, with one-file checkpoints."""
    tmp_path = tmp_path_factory.mktemp("one-file")
    with MultiGPUTrainer(
        gpt(0), tokens(16, 0), tokens(8, 1), config_for(tmp_path, 1, epochs=1, max_steps=2, batch_size=4)
    ) as trainer:
        trainer.fit()
    return tmp_path / "ckpt"


def test_a_one_file_checkpoint_exports_its_plain_state_dict(one_file_run, tmp_path, capsys):
    trained = checkpoint.load(str(one_file_run / "best.pt"))["model"]  # the trainer's plain state_dict
    out = tmp_path / "weights.safetensors"
    assert export.main([str(one_file_run / "best.pt"), str(out)]) == 0  # the format from the name
    assert capsys.readouterr().out.startswith(
        f"exported the trained weights of {one_file_run / 'best.pt'} "
        f"(step 2, {len(trained)} tensors) to {out}: "
    )
    stored = safetensors.load_file(str(out))
    assert set(stored) == set(trained) - {"lm_head.weight"}
    assert all(torch.equal(stored[name], trained[name]) for name in stored)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["{ckpt}/best.pt", "{tmp}/out.bin"],
            "cannot tell the format from OUT {tmp}/out.bin: name it .pt, "
            ".safetensors or a folder (hf), or give --format pt|safetensors|hf|adapter",
        ),
        (
            ["{ckpt}/best.pt", "{tmp}/hf"],
            "--format hf writes a transformers model's own folder, and checkpoint "
            "{ckpt}/best.pt holds another model (or was saved before it recorded its "
            "class): use --format safetensors",
        ),
        (
            ["{ckpt}/best.pt", "{tmp}/w.safetensors", "--max-shard-size", "lots"],
            "--max-shard-size must be a size such as 5GB, 500MB or 2GiB, got 'lots'",
        ),
        (["{tmp}/nothing.pt", "{tmp}/w.safetensors"], "checkpoint {tmp}/nothing.pt does not exist"),
        (
            ["{ckpt}/best.pt", "{tmp}/w.safetensors", "--tokenizer", "{tmp}"],
            "--tokenizer is saved beside the weights of --format hf, and this export writes safetensors",
        ),
    ],
)
def test_export_refuses_bad_input_in_one_line(one_file_run, tmp_path, capsys, args, message):
    names = {"ckpt": one_file_run, "tmp": tmp_path}
    assert export.main([arg.format(**names) for arg in args]) == 2
    assert capsys.readouterr().err == f"error: {message.format(**names)}\n"


def test_a_transformers_model_exports_as_its_own_folder_that_from_pretrained_loads_with_the_same_logits(
    tmp_path, capsys
):
    from conftest import TokenDicts, tiny_gpt2

    transformers = pytest.importorskip("transformers")

    config = config_for(tmp_path, 1, epochs=1, batch_size=4, export_on_end="hf")
    with MultiGPUTrainer(tiny_gpt2(), TokenDicts(16, 0), TokenDicts(8, 1), config) as trainer:
        trainer.fit()
        expected = trainer.predict()["logits"]
    assert f"to {tmp_path / 'ckpt' / 'best-hf'} (" in capsys.readouterr().out  # --export-on-end hf
    assert export.main([str(tmp_path / "ckpt" / "best.pt"), str(tmp_path / "gpt2"), "--format", "hf"]) == 0
    inputs = torch.stack([sample["input_ids"] for sample in TokenDicts(8, 1)])
    for folder in (tmp_path / "ckpt" / "best-hf", tmp_path / "gpt2"):
        assert {"config.json", "model.safetensors"} <= {path.name for path in folder.iterdir()}
        model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert (
            not info["missing_keys"]
            and not info["unexpected_keys"]
            and not info["mismatched_keys"]
            and not info["error_msgs"]
        ), info
        assert (
            type(model).__name__ == "GPT2LMHeadModel" and model.lm_head.weight is model.transformer.wte.weight
        )
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(inputs).logits, expected, rtol=0, atol=0)
    # And back: --init-from the folder (its file lacks the tied lm_head.weight, found under the embedding's name).
    fresh = tiny_gpt2(seed=5)
    weights.load_initial(fresh, str(tmp_path / "gpt2"), strict=True, say=lambda line: None)
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(inputs).logits, expected, rtol=0, atol=0)


def test_export_on_end_hf_of_another_model_is_refused_before_training(tmp_path, capsys):
    args = [
        "--train-size",
        "16",
        "--val-size",
        "8",
        "--mode",
        "flatten",
        "--epochs",
        "1",
        "--no-progress",
        "--save-dir",
        str(tmp_path / "run"),
        "--export-on-end",
        "hf",
    ]
    assert main_multi_gpu.main(args) == 2
    captured = capsys.readouterr()
    assert "step 1" not in captured.out and captured.err == (
        "error: --export-on-end hf writes a transformers model's own folder, and this model is not a transformers "
        "PreTrainedModel: use --export-on-end safetensors\n"
    )


@pytest.mark.parametrize("out, kind", [("w.safetensors", "safetensors"), ("w.pt", "pt"), ("folder", "hf")])
def test_an_existing_out_is_refused_in_one_line_without_overwrite_and_kept(
    one_file_run, tmp_path, capsys, out, kind
):
    path = tmp_path / out
    if kind == "hf":
        path.mkdir()
        (path / "config.json").write_text("someone's model\n")
    else:
        path.write_text("other data\n")
    before = contents(tmp_path)
    assert export.main([str(one_file_run / "best.pt"), str(path), "--format", kind]) == 2
    assert capsys.readouterr().err == (
        f"error: OUT {path} exists; add --overwrite to replace it (only once the "
        f"export is complete), or choose another name\n"
    )
    assert_untouched(tmp_path, before)


def test_overwrite_replaces_an_export_whole_and_never_the_checkpoint_being_read(
    one_file_run, tmp_path, capsys
):
    out = tmp_path / "w.safetensors"
    out.write_text("other data\n")
    stale = [
        tmp_path / "w-00001-of-00002.safetensors",
        tmp_path / "w.safetensors.index.json",
    ]  # a sharded one
    for path in stale:
        path.write_text("an earlier sharded export\n")
    assert export.main([str(one_file_run / "best.pt"), str(out), "--overwrite"]) == 0
    assert capsys.readouterr().out.endswith(f" (replaced the earlier {out})\n")
    assert set(safetensors.load_file(str(out))) == set(
        checkpoint.load(str(one_file_run / "best.pt"))["model"]
    ) - {"lm_head.weight"}
    assert not any(
        path.exists() for path in stale
    )  # they would shadow the new file for a loader of the index
    assert [path.name for path in tmp_path.iterdir()] == ["w.safetensors"]  # no temporary file left
    best = one_file_run / "best.pt"
    before = best.read_bytes()
    assert export.main([str(best), str(best), "--overwrite"]) == 2
    assert capsys.readouterr().err == (
        f"error: OUT {best} is the checkpoint being read; refused even with "
        f"--overwrite: choose another name\n"
    )
    assert best.read_bytes() == before


def test_export_on_end_over_an_earlier_export_is_refused_unless_overwrite_or_the_run_continues(
    tmp_path, capfd
):
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    earlier = save_dir / "best-weights.safetensors"
    earlier.write_text("an earlier run's export\n")
    args = [
        "--train-size",
        "16",
        "--val-size",
        "8",
        "--mode",
        "flatten",
        "--model",
        "mlp",
        "--image-shape",
        "1,4,4",
        "--batch-size",
        "8",
        "--no-progress",
        "--save-dir",
        str(save_dir),
        "--export-on-end",
        "safetensors",
    ]
    assert main_multi_gpu.main([*args, "--max-steps", "1"]) == 2
    err = capfd.readouterr().err
    assert err == (
        f"error: --export-on-end safetensors would replace {earlier}, an earlier export, when this run ends: "
        f"add --overwrite to replace it then, move it away, or choose another --save-dir\n"
    )
    assert earlier.read_text() == "an earlier run's export\n" and not (save_dir / "last.pt").exists()
    assert main_multi_gpu.main([*args, "--max-steps", "1", "--overwrite"]) == 0
    assert f"to {earlier}: " in capfd.readouterr().out
    first = safetensors.load_file(str(earlier))
    # The run continued: its own export follows its best, replaced without a word of refusal.
    assert main_multi_gpu.main([*args, "--max-steps", "2", "--resume", "auto"]) == 0
    assert f"(replaced the earlier {earlier})" in capfd.readouterr().out
    assert set(safetensors.load_file(str(earlier))) == set(first)


def test_a_pt_checkpoint_given_for_a_pt_export_is_refused_for_what_it_is_and_nothing_changes(
    one_file_run, tmp_path, capsys
):
    """`python -m multigpu.export base/best.pt base/last.pt --overwrite`: the source is a .pt checkpoint already (not
    "not a sharded checkpoint folder"), and the run's last.pt is left as it was."""
    base = tmp_path / "base"
    base.mkdir()
    for name in ("best.pt", "last.pt"):
        (base / name).write_bytes((one_file_run / name).read_bytes())
    before = contents(base)
    assert export.main([str(base / "best.pt"), str(base / "last.pt"), "--overwrite"]) == 2
    assert capsys.readouterr().err == (
        f"error: {base / 'best.pt'} is a .pt checkpoint already, and --format pt (OUT {base / 'last.pt'}) makes one "
        f"of a sharded checkpoint folder or a safetensors checkpoint; for its weights name OUT .safetensors or a "
        f"folder (hf)\n"
    )
    assert_untouched(base, before)
    (base / "notes.pt").write_text("my notes\n")  # a file that is no checkpoint: refused for what it is
    assert export.main([str(base / "notes.pt"), str(tmp_path / "out.pt")]) == 2
    assert "refused: not a checkpoint (it holds text" in capsys.readouterr().err


def test_a_safetensors_file_cut_within_its_header_is_called_truncated_wherever_it_is_read(tmp_path, capsys):
    """A .safetensors file cut short before its header's end (a checkpoint's header is long) was read as a torch.save
    file and called "not a file written by torch.save"; safetensors' own reader now says what is wrong."""
    whole = tmp_path / "whole.safetensors"
    safetensors.save_file(
        {f"layer{i}.weight": torch.zeros(2) for i in range(100)}, str(whole), metadata={"note": "x" * 500}
    )
    data = whole.read_bytes()
    for size in (1, 9, 100, 2000):
        cut = tmp_path / f"cut{size}.safetensors"
        cut.write_bytes(data[:size])
        for out in ("out.safetensors", "out.pt"):
            assert export.main([str(cut), str(tmp_path / out)]) == 2
            said = capsys.readouterr().err
            assert (
                said.startswith(f"error: checkpoint {cut} refused: truncated or corrupt (")
                and "\n" == said[-1]
            )
        with pytest.raises(CheckpointError, match="refused: truncated or corrupt"):
            checkpoint.load(str(cut))
        with pytest.raises(UsageError, match=f"--init-from {cut} cannot be read as safetensors"):
            weights.open_source(str(cut))
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "out.pt").exists()
