"""``trainer-ext launch --swap_trainer``: unmodified transformers scripts run on our Trainer, on 1 and 2 CPU processes.

The scripts (``run_clm_style.py``, ``run_seq2seq_style.py``) import transformers' classes and know nothing of
trainer_ext; each writes ``run_info.json`` naming the classes it got. accelerate is not installed here, so
transformers' own Trainer could not even start: the script without the flag is the control.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer_ext.cli.launch import prepare
from trainer_ext.cli.launch.swap import parse
from trainer_ext.cli.launch.target import SWAP_MODULE
from trainer_ext.cli.main import main

HERE = Path(__file__).parent
CLM, SEQ2SEQ = HERE / "run_clm_style.py", HERE / "run_seq2seq_style.py"
ACCELERATE_INSTALLED = importlib.util.find_spec("accelerate") is not None


def end_to_end(test):
    """Marks of a run through the launcher (as in test_launch_run.py); each launch also has its own timeout."""
    return pytest.mark.slow(pytest.mark.distributed(pytest.mark.timeout(600)(test)))


def environment(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRAINER_EXT_CONFIG_FILE"}
    env.update(HOME=str(home), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def launch(*argv: str, home: Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "trainer_ext", "launch", "--cpu", *argv]
    return subprocess.run(command, env=environment(home), cwd=cwd, capture_output=True, text=True, timeout=timeout)


def succeeded(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "job.py"
    path.write_text("print('hello')\n")
    return str(path)


# --- the command, without starting processes ---


def test_the_flag_starts_every_process_through_the_swap_module(gpus, script):
    _, one, _ = prepare(["--swap_trainer", script, "--do_train"])
    assert one.command == [sys.executable, "-u", "-m", SWAP_MODULE, script, "--do_train"]
    _, two, _ = prepare(["--num_processes", "2", "--swap-trainer", script, "--do_train"])
    assert two.torchrun_args[-4:] == ["-m", SWAP_MODULE, script, "--do_train"]  # torchrun's own -m (module)
    _, plain, _ = prepare([script, "--do_train"])
    assert plain.command == [sys.executable, "-u", script, "--do_train"]


def test_a_module_is_swapped_too_and_train_needs_no_swap(gpus):
    _, module, _ = prepare(["--swap_trainer", "-m", "json.tool", "--x"])
    assert module.command[2:] == ["-m", SWAP_MODULE, "-m", "json.tool", "--x"]
    _, train, _ = prepare(["--swap_trainer", "train", "--max_steps", "2"])
    assert train.command[2:5] == ["-m", "trainer_ext", "train"]
    assert any("--swap_trainer changes nothing for train" in note for note in train.notes)


def test_a_missing_script_or_one_that_is_not_python_is_refused(gpus, capsys, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not python\n")
    for path, message in ((tmp_path / "missing.py", "not found"), (notes, "is not a .py file")):
        assert main(["launch", "--swap_trainer", str(path), "--do_train"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cannot launch (1 problem):") and message in err and "Traceback" not in err
    assert main(["launch", "--dry_run", str(notes)]) == 0  # without the swap any file python runs is accepted


def test_the_shell_gets_exit_code_2_and_one_message(tmp_path):
    (tmp_path / "train.sh").write_text("echo hi\n")
    command = [sys.executable, "-m", "trainer_ext", "launch", "--swap_trainer", "train.sh"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "script 'train.sh' is not a .py file: --swap_trainer runs a Python script" in proc.stderr


def test_the_swap_module_started_by_hand_refuses_bad_arguments(capsys, tmp_path):
    for argv, message in (([], "usage: python -m trainer_ext.cli.launch.swap"), ([str(tmp_path / "x.py")], "found")):
        with pytest.raises(SystemExit) as stop:
            parse(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err


PROBE = """
import json, os, sys
from dataclasses import dataclass

import transformers
import transformers.trainer
import transformers.training_args
from transformers import HfArgumentParser, Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments
import trainer_ext
import next_to_me  # found beside the script, as with `python SCRIPT.py`


@dataclass
class ModelArguments:
    model_name_or_path: str = "none"


@dataclass
class DataTrainingArguments:
    block_size: int = 8


_, _, args = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments)).parse_args_into_dataclasses()
info = {
    "trainer": [Trainer, transformers.Trainer, transformers.trainer.Trainer] == [trainer_ext.Trainer] * 3,
    "arguments": [TrainingArguments, transformers.TrainingArguments, transformers.training_args.TrainingArguments]
    == [trainer_ext.TrainingArguments] * 3,
    "parsed": type(args) is trainer_ext.TrainingArguments,
    "seq2seq": issubclass(Seq2SeqTrainer, trainer_ext.Trainer)
    and issubclass(Seq2SeqTrainingArguments, trainer_ext.TrainingArguments)
    and Seq2SeqTrainer is transformers.trainer_seq2seq.Seq2SeqTrainer,
    "name": __name__,
    "file": __file__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "accelerate_imported": "accelerate" in sys.modules,
}
os.makedirs(args.output_dir, exist_ok=True)
with open(os.path.join(args.output_dir, "probe.json"), "w") as f:
    json.dump(info, f)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_name_a_script_imports_is_ours(tmp_path):
    """``from transformers import …``, the submodules, HfArgumentParser and the seq2seq pair all give our classes."""
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "probe.py").write_text(PROBE)
    (folder / "next_to_me.py").write_text("")
    out = tmp_path / "out"
    argv = ["--output_dir", str(out), "--use_cpu", "--report_to", "none"]
    succeeded(launch("--swap_trainer", "scripts/probe.py", *argv, home=tmp_path, cwd=tmp_path, timeout=180))
    info = json.loads((out / "probe.json").read_text())
    assert info["trainer"] and info["arguments"] and info["parsed"] and info["seq2seq"]
    assert info["name"] == "__main__" and info["file"] == str(folder / "probe.py")
    assert info["argv"][1:] == argv and info["path0"] == str(folder)
    assert info["accelerate_imported"] is False or ACCELERATE_INSTALLED


# --- end to end: a run_clm-style script on 1 and 2 processes ---


def write_clm_inputs(folder: Path) -> list[str]:
    """A word-level tokenizer and a tiny Llama config saved as a script expects them, text files; the script's data
    and model flags."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(40)]
    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", "<eos>", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>", model_max_length=64
    )
    tokenizer.save_pretrained(folder / "tokenizer")
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
    )
    config.save_pretrained(folder / "config")
    rng = random.Random(0)

    def lines(n: int, length: int) -> list[str]:
        return [" ".join(words[s : s + length]) for s in (rng.randrange(0, len(words) - length) for _ in range(n))]

    # JSON lines, as run_clm reads them: 128 lines of 6 words make 48 blocks of 16 tokens, 32 of 7 make 14
    for name, n, length in (("train.json", 128, 6), ("validation.json", 32, 7)):
        (folder / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in lines(n, length)))
    return [
        *("--config_name", str(folder / "config"), "--tokenizer_name", str(folder / "tokenizer")),
        *("--train_file", str(folder / "train.json"), "--validation_file", str(folder / "validation.json")),
        *("--block_size", "16"),
    ]


# the same global batch of 4 on 1 and 2 processes: 48 blocks of 16 tokens, 12 optimizer steps, 14 evaluation blocks
GLOBAL_BATCH, STEPS, EVAL_BLOCKS = 4, 12, 14
TRAINING = ["--do_train", "--do_eval", "--num_train_epochs", "1", "--learning_rate", "1e-2", "--seed", "0"]
TRAINING += ["--logging_steps", "4", "--report_to", "none", "--disable_tqdm", "true"]
# what transformers' Trainer writes for this script (save_model, save_state, save_metrics, the final checkpoint)
OUTPUT_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "training_args.bin",
    "trainer_state.json",
    "train_results.json",
    "eval_results.json",
    "all_results.json",
}
CHECKPOINT_FILES = OUTPUT_FILES - {"train_results.json", "eval_results.json", "all_results.json"}
CHECKPOINT_FILES |= {"optimizer.pt", "scheduler.pt"}


@pytest.fixture(scope="module")
def clm_runs(tmp_path_factory) -> dict:
    """The script launched with the flag on 1 and on 2 processes: {processes: (output folder, seconds)}, and
    ``"inputs"``: the script's data and model flags."""
    folder = tmp_path_factory.mktemp("clm")
    home = tmp_path_factory.mktemp("home")
    inputs = write_clm_inputs(folder)
    runs: dict = {"inputs": inputs}
    for processes in (1, 2):
        out = folder / f"out{processes}"
        batch = str(GLOBAL_BATCH // processes)
        sizes = ["--per_device_train_batch_size", batch, "--per_device_eval_batch_size", batch]
        argv = ["--num_processes", str(processes), "--swap_trainer", str(CLM), *inputs, *TRAINING, *sizes]
        start = time.perf_counter()
        succeeded(launch(*argv, "--output_dir", str(out), home=home, cwd=folder))
        runs[processes] = out, time.perf_counter() - start
    return runs


@pytest.mark.parametrize("processes", [1, 2])
@end_to_end
def test_the_script_trains_and_evaluates_on_our_trainer(clm_runs, processes):
    out, seconds = clm_runs[processes]
    info = json.loads((out / "run_info.json").read_text())
    assert info["trainer"] == "trainer_ext.trainer.trainer.Trainer"
    assert info["training_args"] == "trainer_ext.trainer.training_args.TrainingArguments"
    assert info["accelerate_imported"] is False or ACCELERATE_INSTALLED
    assert info["world_size"] == processes and info["main"] == "__main__"
    assert {p.name for p in out.iterdir()} == OUTPUT_FILES | {f"checkpoint-{STEPS}", "run_info.json"}
    rng = {"rng_state.pth"} if processes == 1 else {f"rng_state_{r}.pth" for r in range(processes)}
    # COMPLETE: our commit marker, the one documented extra file of a checkpoint (docs/trainer.md)
    assert {p.name for p in (out / f"checkpoint-{STEPS}").iterdir()} == CHECKPOINT_FILES | rng | {"COMPLETE"}
    results = json.loads((out / "all_results.json").read_text())
    assert results["train_samples"] == GLOBAL_BATCH * STEPS and results["eval_samples"] == EVAL_BLOCKS
    assert results["eval_loss"] < results["train_loss"] + 1 and 0 < results["eval_accuracy"] <= 1
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == STEPS
    print(f"\nrun_clm-style script, {processes} process(es): {seconds:.1f} s")


@end_to_end
def test_two_processes_give_the_results_of_one(clm_runs):
    """Same global batch and sampler order: the weights, losses and metrics of 2 processes are those of 1.

    Tolerances: 1e-5 relative on losses, 1e-5 absolute on weights (float32 sums in another order, over 12 steps).
    Evaluation: 14 blocks, 4 a round: the last round is rank 0's 2 blocks and rank 1's padding, which is dropped. (With
    a last batch split over the ranks, eval_loss would differ: transformers repeats each batch's mean loss, so a
    padding sample in a half-real batch weighs in, under accelerate too; accuracy, per sample, would still match.)
    """
    (one, _), (two, _) = clm_runs[1], clm_runs[2]
    a, b = (json.loads((out / "all_results.json").read_text()) for out in (one, two))
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
    assert b["eval_accuracy"] == a["eval_accuracy"]
    logged = [
        [e["loss"] for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
        for out in (one, two)
    ]
    assert len(logged[0]) == STEPS // 4 and logged[1] == pytest.approx(logged[0], rel=1e-5)
    w1, w2 = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert w1.keys() == w2.keys() and all(torch.allclose(w1[k], w2[k], atol=1e-5) for k in w1)


@end_to_end
@pytest.mark.skipif(ACCELERATE_INSTALLED, reason="the control needs transformers' Trainer to fail without accelerate")
def test_without_the_flag_the_same_script_stops_for_accelerate(clm_runs, tmp_path):
    """The control: it is the swap that makes the script run here."""
    argv = [str(CLM), *clm_runs["inputs"], *TRAINING, "--output_dir", str(tmp_path / "out")]
    proc = launch(*argv, home=tmp_path, cwd=tmp_path)
    assert proc.returncode != 0 and "requires `accelerate" in proc.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


@end_to_end
def test_a_seq2seq_script_runs_on_our_trainer_on_two_processes(tmp_path):
    """Seq2SeqTrainer and Seq2SeqTrainingArguments, imported after the swap, are built on ours; eval generates."""
    out = tmp_path / "out"
    argv = ["--output_dir", str(out), "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2"]
    argv += ["--max_steps", "3", "--predict_with_generate", "--report_to", "none", "--save_strategy", "no"]
    argv += ["--disable_tqdm", "true"]
    start = time.perf_counter()
    succeeded(launch("--num_processes", "2", "--swap_trainer", str(SEQ2SEQ), *argv, home=tmp_path, cwd=tmp_path))
    info = json.loads((out / "run_info.json").read_text())
    assert info["trainer_mro"][:2] == [
        "transformers.trainer_seq2seq.Seq2SeqTrainer",
        "trainer_ext.trainer.trainer.Trainer",
    ]
    assert "trainer_ext.trainer.training_args.TrainingArguments" in info["args_mro"] and info["world_size"] == 2
    assert info["accelerate_imported"] is False or ACCELERATE_INSTALLED
    metrics = json.loads((out / "eval_results.json").read_text())
    assert metrics["eval_token_ids"] is True  # predict_with_generate: the predictions are generated token ids
    # transformers' Seq2SeqTrainer gathers with plain `gather` ("we don't want to drop samples"): 10 rows on 2 ranks
    # of 2 come back as 12, the padding of the last round included, as with accelerate
    assert metrics["eval_rows"] == 12
    print(f"\nseq2seq script, 2 processes: {time.perf_counter() - start:.1f} s")
