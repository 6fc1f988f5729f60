"""docs/language-models.md, run: the command line fine-tunes a transformers model folder on JSONL text (one CPU
process, and 2 under torchrun), its per-token validation loss falls, and --export-on-end hf writes a folder that
AutoModelForCausalLM and AutoTokenizer load and generate from; bad input is one line and exit 2."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import main_multi_gpu
import predict_multi_gpu
from conftest import assert_ok, assert_one_line, contents, run_cli

EPOCHS = 3


def _fine_tune(tiny_lm: Path, save_dir: Path, nproc: int | None = None) -> list[float]:
    """The CLI's run on the tiny model folder (packed windows of 32 tokens); its validation losses, epoch by
    epoch."""
    args = [
        "--dataset",
        "hf",
        "--data-files",
        str(tiny_lm / "train.jsonl"),
        "--val-files",
        str(tiny_lm / "val.jsonl"),
        "--text-column",
        "text",
        "--model",
        "hf",
        "--model-path",
        str(tiny_lm / "model"),
        "--block-size",
        "32",
        "--packing",
        "stream",
        "--batch-size",
        "16",
        "--epochs",
        str(EPOCHS),
        "--lr",
        "3e-3",
        "--export-on-end",
        "hf",
        "--no-progress",
        "--save-dir",
        str(save_dir),
        *(["--multi-gpu", "ddp"] if nproc else []),
    ]
    result = run_cli(args, nproc=nproc)
    assert_ok(result)
    assert f"exported the trained weights of {save_dir / 'best.pt'}" in result.stdout, result.stdout
    assert (
        "its tokenizer pads with its end-of-text token <|endoftext|> (it had no padding token)"
        in result.stdout
    )
    return [float(loss) for loss in re.findall(r"^epoch \d+/\d+: val loss ([\d.]+)", result.stdout, re.M)]


def _loads_and_generates(folder: Path) -> list[int]:
    """The exported folder, loaded as a user does with no further step: 8 new tokens after a prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("the quick fox", return_tensors="pt")
    generated = model.generate(
        **prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    decoded = tokenizer.decode(generated[0])
    assert isinstance(decoded, str)  # one sequence's text
    assert generated.shape[1] > prompt["input_ids"].shape[1] and decoded.startswith("the quick")
    return generated[0].tolist()


def _loss_per_token(folder: Path, tiny_lm: Path) -> float:
    """The exported model's mean loss over every predicted token of the validation windows, computed here."""
    from transformers import AutoModelForCausalLM

    from multigpu.config import parse_config
    from multigpu.data import build_datasets

    config = parse_config(
        [
            "--dataset",
            "hf",
            "--data-files",
            str(tiny_lm / "val.jsonl"),
            "--text-column",
            "text",
            "--model-path",
            str(tiny_lm / "model"),
            "--block-size",
            "32",
            "--packing",
            "stream",
            "--val-files",
            str(tiny_lm / "val.jsonl"),
        ]
    )
    val = build_datasets(config).val  # as the run cut it: the last window padded, its padding -100
    windows = {name: torch.stack([val[i][name] for i in range(len(val))]) for name in val[0]}
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(folder)(
            input_ids=windows["input_ids"], attention_mask=windows["attention_mask"]
        ).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), windows["labels"][:, 1:].reshape(-1)
    ).item()


def test_a_model_folder_fine_tunes_on_jsonl_and_its_export_generates(tiny_lm, tmp_path):
    losses = _fine_tune(tiny_lm, tmp_path / "run")
    assert (
        len(losses) == EPOCHS and losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.5
    ), losses
    exported = tmp_path / "run" / "best-hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        path.name for path in exported.iterdir()
    }
    _loads_and_generates(exported)
    from transformers import AutoTokenizer

    padded = AutoTokenizer.from_pretrained(exported)(["the fox", "the quick brown fox"], padding=True)
    assert padded["attention_mask"][0][-1] == 0  # the shorter text padded: the export has a padding token
    # The loss the run printed is the mean over tokens: the exported (best) weights give it again here.
    assert _loss_per_token(exported, tiny_lm) == pytest.approx(min(losses), abs=2e-4)


def test_its_checkpoint_is_loaded_as_a_transformers_model_not_predicted(tiny_lm, tmp_path, capsys):
    assert (
        main_multi_gpu.main(
            [
                "--dataset",
                "hf",
                "--data-files",
                str(tiny_lm / "val.jsonl"),
                "--text-column",
                "text",
                "--model-path",
                str(tiny_lm / "model"),
                "--epochs",
                "1",
                "--no-progress",
                "--save-dir",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    code = predict_multi_gpu.main(
        ["--checkpoint", str(tmp_path / "run" / "last.pt"), "--output", str(tmp_path / "p.pt")]
    )
    assert_one_line(
        code,
        capsys.readouterr().err,
        "--model hf's checkpoints are not predicted here: load the model as a transformers model",
    )


@pytest.mark.slow
def test_the_same_under_torchrun_on_two_processes(tiny_lm, tmp_path):
    losses = _fine_tune(tiny_lm, tmp_path / "run", nproc=2)
    assert len(losses) == EPOCHS and losses == sorted(losses, reverse=True), losses
    _loads_and_generates(tmp_path / "run" / "best-hf")


def _not_a_model(tiny_lm: Path, tmp: Path) -> list[str]:
    (tmp / "notes").mkdir()
    (tmp / "notes" / "README.md").write_text("a folder of notes\n")
    return ["--model-path", str(tmp / "notes"), "--tokenizer", str(tiny_lm / "model")]


def _smaller_vocabulary(tiny_lm: Path, tmp: Path) -> list[str]:
    shutil.copytree(tiny_lm / "model", tmp / "model")
    config = json.loads((tmp / "model" / "config.json").read_text())
    (tmp / "model" / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    return ["--model-path", str(tmp / "model")]


BAD = {
    "not a transformers model": (_not_a_model, "is not a transformers model: it holds no config.json"),
    "no such text column": (
        lambda tiny_lm, tmp: ["--model-path", str(tiny_lm / "model"), "--text-column", "body"],
        "--text-column body: the files' columns are text, label; name the column that holds "
        "each sample's text",
    ),
    "a tokenizer larger than the vocabulary": (
        _smaller_vocabulary,
        "the tokenizer has 150 tokens, more than the model's vocabulary of 100",
    ),
    "a block size above the context": (
        lambda tiny_lm, tmp: ["--model-path", str(tiny_lm / "model"), "--block-size", "128"],
        "--block-size 128 is above the model's context of 64 positions",
    ),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_line_and_exit_2(tiny_lm, tmp_path, capsys, name):
    flags, expected = BAD[name]
    code = main_multi_gpu.main(
        [
            "--dataset",
            "hf",
            "--data-files",
            str(tiny_lm / "train.jsonl"),
            "--text-column",
            "text",
            "--model",
            "hf",
            "--no-progress",
            "--save-dir",
            str(tmp_path / "run"),
            *flags(tiny_lm, tmp_path),
        ]
    )
    assert_one_line(code, capsys.readouterr().err, expected)


# ---------------------------------------------------------------- folders that would train the wrong thing
@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The save-dir of an earlier (tiny, synthetic) run: its last.pt and best.pt must come through every refusal
    byte for byte."""
    save_dir = tmp_path_factory.mktemp("earlier") / "run"
    tiny = ["--train-size", "64", "--val-size", "32", "--batch-size", "16", "--epochs", "1", "--no-progress"]
    assert main_multi_gpu.main([*tiny, "--save-dir", str(save_dir)]) == 0
    return save_dir


def _model_copy(tiny_lm: Path, tmp: Path) -> Path:
    shutil.copytree(tiny_lm / "model", tmp / "model")
    return tmp / "model"


def _an_encoder(tiny_lm: Path, tmp: Path) -> list[str]:
    """A BertModel.save_pretrained folder (with the tiny model's tokenizer): AutoModelForCausalLM makes it a
    BertLMHeadModel that sees every token, under a head the folder lacks."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    config = BertConfig(
        vocab_size=150,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(tmp / "bert")
    AutoTokenizer.from_pretrained(tiny_lm / "model").save_pretrained(tmp / "bert")
    return ["--model-path", str(tmp / "bert")]


def _no_tokenizer(tiny_lm: Path, tmp: Path) -> list[str]:
    """The model folder without its tokenizer's files: transformers builds a placeholder of 1 token."""
    folder = _model_copy(tiny_lm, tmp)
    for path in folder.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            path.unlink()
    return ["--model-path", str(folder)]


def _truncated_weights(tiny_lm: Path, tmp: Path) -> list[str]:
    weights = _model_copy(tiny_lm, tmp) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return ["--model-path", str(tmp / "model")]


def _larger_vocabulary(tiny_lm: Path, tmp: Path) -> list[str]:
    """config.json says 200 tokens, the weights hold 150 (the tokenizer's 150 fit either)."""
    folder = _model_copy(tiny_lm, tmp)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    return ["--model-path", str(folder)]


def _most_rows_unread(tiny_lm: Path, tmp: Path) -> list[str]:
    """The first 32 rows in English, 100 more in Greek, and a tokenizer of English letters without an unknown
    token (the tokenizers library then drops what it does not know): the Greek rows become no token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rows = (tiny_lm / "train.jsonl").read_text().splitlines()[:32]
    rows += [json.dumps({"text": "η γρήγορη αλεπού πηδά πάνω από τον σκύλο", "label": 0})] * 100
    (tmp / "mixed.jsonl").write_text("\n".join(rows) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [json.loads(row)["text"] for row in rows[:32]]
    tokenizer.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=100, special_tokens=["<|endoftext|>"])
    )
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(
        tmp / "tok"
    )
    return [
        *("--model-path", str(tiny_lm / "model"), "--tokenizer", str(tmp / "tok")),
        *("--data-files", str(tmp / "mixed.jsonl")),
    ]


WRONG_FOLDERS = {
    "an encoder under the causal-LM objective": (
        _an_encoder,
        "BertLMHeadModel is not a causal language model (position 0's logits change when token 7 changes: "
        "it sees the tokens it is to predict), and --model hf trains a causal LM",
    ),
    "a folder without its tokenizer": (
        _no_tokenizer,
        "its tokenizer encodes the first 32 rows of --data-files (3,449 characters) to 0 tokens, 32 of 32 rows "
        "to none: it does not read this text",
    ),
    "a tokenizer that makes nothing of most rows": (
        _most_rows_unread,
        "its tokenizer encodes 100 of the 132 rows with text in --data-files to no token, and training would "
        "drop them",
    ),
    "a truncated model.safetensors": (
        _truncated_weights,
        "its weights do not load (Error while deserializing header: incomplete metadata, file not fully "
        "covered); a truncated or damaged file?",
    ),
    "a config.json whose vocabulary the weights contradict": (
        _larger_vocabulary,
        "its weights do not fit its config.json: transformer.wte.weight is 150x32 in the weights, 200x32 as "
        "the config builds it",
    ),
}


@pytest.mark.parametrize("name", WRONG_FOLDERS)
def test_a_folder_that_would_train_the_wrong_thing_is_one_line_and_exit_2_with_nothing_saved_changed(
    tiny_lm, earlier_run, tmp_path, capsys, name
):
    """Refused before anything is read into a model or trained: even --overwrite moved nothing aside."""
    make, expected = WRONG_FOLDERS[name]
    save_dir = tmp_path / "run"
    shutil.copytree(earlier_run, save_dir)
    flags = make(tiny_lm, tmp_path)
    before = {path: hashlib.sha256(data).hexdigest() for path, data in contents(save_dir).items()}
    code = main_multi_gpu.main(
        [
            *("--dataset", "hf", "--data-files", str(tiny_lm / "train.jsonl"), "--text-column", "text"),
            *("--model", "hf", "--no-progress", "--save-dir", str(save_dir), "--overwrite", *flags),
        ]
    )
    assert_one_line(code, capsys.readouterr().err, expected)
    assert {path: hashlib.sha256(data).hexdigest() for path, data in contents(save_dir).items()} == before


def test_the_plan_line_names_the_weights_a_folder_lacks(tiny_lm, tmp_path, capsys):
    """A causal LM's folder as a classifier: its new head, which transformers initialises fresh, is named."""
    code = main_multi_gpu.main(
        [
            *("--dataset", "hf", "--data-files", str(tiny_lm / "val.jsonl"), "--text-column", "text"),
            *("--label-column", "label", "--model-path", str(tiny_lm / "model"), "--max-steps", "1"),
            *("--no-progress", "--save-dir", str(tmp_path / "run")),
        ]
    )
    assert code == 0
    assert re.search(
        r"^model hf \([\d,]+ parameters; initialised fresh, not in --model-path: score\.weight\); data hf: ",
        capsys.readouterr().out,
        re.M,
    )
