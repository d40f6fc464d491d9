"""Step ``tests``: the tests marked ``gpu``, then a CUDA pass of the fast suite's device-sensitive tests.

On the GPU: ``pytest -m gpu tests`` (CUDA precision, dispatch over a GPU budget, the GPU scripts), then ``CUDA_PASS``
under ``TRAINER_EXT_TEST_DEVICE=cuda`` (tests/helpers/device.py: the Trainer, its arguments and the Accelerator built
on the GPU). Each run writes a JUnit file; the counts and each failure (node id and a one-line reason) are recorded, and
every failure or error is a problem of the step. Dry run: ``-m gpu`` runs (all skip on the CPU) and the CUDA pass is
only collected.
"""

from __future__ import annotations

import re
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from benchmarks.gpu_kit.kit import ROOT, ChildFailed, Context, Skip, has_module

# Single-process tests whose device comes from TRAINER_EXT_TEST_DEVICE (make_args, Accelerator(cpu=use_cpu())); the
# dispatch tests that run on a device are marked gpu (tests/inference/test_dispatch_gpu.py), so the -m gpu run has them.
CUDA_PASS = (
    # micro-batch 2 x accumulation 4 == batch 8 on ragged, padded batches: gradients to 1e-6 (loss normalisation)
    "tests/test_precision.py::test_accumulation_equals_one_big_batch_on_ragged_batches",
    # the last, shorter accumulation window against a direct forward/backward on the same device
    "tests/test_precision.py::test_shorter_last_window_is_normalised_by_its_own_tokens",
    # a head whose loss ignores num_items_in_batch is averaged over the window, not summed
    "tests/test_precision.py::test_classifier_whose_loss_ignores_num_items_is_averaged",
    # the Accelerator's bf16 autocast on its device, fp32 outputs, unwrap without the fp32 wrapper
    "tests/test_accelerator.py::test_bf16_autocast_and_unwrap_without_the_fp32_wrapper",
    # Trainer save + resume mid-epoch (accumulation 1 and 2), bitwise: optimizer, scheduler and CUDA RNG state
    "tests/test_trainer.py::test_mid_epoch_resume_is_bitwise_equal",
    # auto-resume skips a checkpoint without its marker and ends equal to the uninterrupted run
    "tests/checkpointing/test_trainer_checkpoints.py::test_auto_resume_skips_a_partial_checkpoint_and_matches_the_full_run",
    # a damaged rng_state.pth (it holds the CUDA generator's state on a GPU) falls back to the previous checkpoint
    "tests/checkpointing/test_trainer_checkpoints.py::test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one[truncate_rng]",
    # the loss scaler (a CUDA GradScaler) survives Accelerator.save_state/load_state and the Trainer's scaler.pt
    "tests/checkpointing/test_scaler_resume.py",
    # a hand-written Accelerator loop on the device reaches the Trainer's weights
    "tests/test_accelerator.py::test_hand_written_loop_reaches_the_trainers_weights",
    # Accelerator save_state -> load_state mid-epoch, bitwise
    "tests/test_accelerator.py::test_one_rank_save_state_resume_mid_epoch_is_bitwise",
    # accelerate's resume pattern (load_state + skip_first_batches) and ours: same batches, LRs and weights
    "tests/test_accelerator_resume.py::test_one_process_resume_continues_the_uninterrupted_run",
    # out of memory mid-training: the micro-batch shrinks, the global batch and the weights stay (bitwise)
    "tests/test_auto_batch.py::test_oom_in_forward_keeps_the_global_batch",
    # an OOM in backward after part of the window's gradients accumulated: exact weights still
    "tests/test_auto_batch.py::test_oom_in_backward_mid_window_gives_exact_weights",
    # the token-count loss of a causal LM adds up over the shrunk chunks
    "tests/test_auto_batch.py::test_token_count_loss_of_a_causal_lm",
    # a resume after the shrink starts at the saved chunk size and ends equal to the uninterrupted run
    "tests/test_auto_batch.py::test_resume_after_the_shrink_keeps_the_global_batch",
)
SWITCH = "TRAINER_EXT_TEST_DEVICE"
STEP_S = {True: 140, False: 170}  # the step's own deadline (inside its box: 150 s on the GPU, 180 s dry), by ctx.cuda
GPU_RUN_S = {True: 75, False: 110}  # at most this for the -m gpu run; the CUDA pass gets what is left
REASON_CHARS = 200
OUTCOMES = {"failure": "failed", "error": "errors", "skipped": "skipped"}  # JUnit element -> count


def pytest_command(*args: str) -> list[str]:
    """``python -m pytest -q -p no:cacheprovider args`` for this interpreter."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


def node_id(case: ET.Element) -> str:
    """A JUnit test case's pytest node id (``file::[Class::]name``), from the xunit1 ``file`` attribute."""
    name, classname, file = case.get("name", ""), case.get("classname", ""), case.get("file")
    if not file:  # a collection error: the classname is empty, the name is the module
        return "::".join(part for part in (classname, name) if part)
    module = file.removesuffix(".py").replace("/", ".")
    inner = classname.removeprefix(module).lstrip(".")
    return "::".join(part for part in (file, inner, name) if part)


def one_line(text: str | None) -> str:
    """The first non-empty line of ``text``, cut to REASON_CHARS."""
    line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")
    return line[:REASON_CHARS]


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts (tests, passed, failed, errors, skipped), each failure as ``node id (kind): reason`` and what the tests
    printed (captured stdout, one entry a line)."""
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, printed = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        counts["tests"] += 1
        outcomes = [child for child in case if child.tag in OUTCOMES]
        counts["passed"] += not outcomes
        for child in outcomes:
            counts[OUTCOMES[child.tag]] += 1
            if child.tag != "skipped":
                reason = one_line(child.get("message")) or one_line(child.text)
                failures.append(f"{node_id(case)} ({child.tag}): {reason}")
        out = case.find("system-out")
        lines = [ln.strip() for ln in (out.text or "").splitlines()] if out is not None else []
        # what the test itself printed (the gpu tests print their figures), not the Trainer's log dicts or banners
        printed += [f"{node_id(case)}: {ln}"[:REASON_CHARS] for ln in lines if ln and not ln.startswith(("{", "-"))]
    return {**counts, "failures": failures, "printed": printed}


def collected_ids(output: str) -> list[str]:
    """The node ids ``pytest --collect-only -q`` listed."""
    return [line.strip() for line in output.splitlines() if "::" in line and not line.startswith(("ERROR", " "))]


def unmatched(entries: tuple[str, ...] | list[str], ids: list[str]) -> list[str]:
    """The entries (paths or node ids) that none of the collected ``ids`` belongs to."""
    return [e for e in entries if not any(i == e or i.startswith((f"{e}::", f"{e}[")) for i in ids)]


def exit_code(error: ChildFailed) -> int | None:
    """The exit status in ChildFailed's message, None when the child was stopped at its timeout."""
    found = re.search(r": exit (-?\d+)\n", str(error) + "\n")
    return int(found.group(1)) if found else None


def run_pytest(ctx: Context, label: str, args: list[str], timeout: float, device: str) -> dict[str, Any] | None:
    """One pytest run with a JUnit file in ctx.work: its parsed counts, or None (a problem recorded) without one."""
    junit = ctx.work / f"{label}.xml"
    junit.unlink(missing_ok=True)
    command = pytest_command(f"--junitxml={junit}", "-o", "junit_family=xunit1", "-o", "junit_logging=system-out")
    started, code, timeout = time.perf_counter(), 0, max(timeout, 10.0)
    try:
        ctx.run(command + args, timeout=timeout, label=label, **{SWITCH: device})
    except ChildFailed as failed:  # failing tests are findings, not a crash of the step
        code = exit_code(failed)
        if code is None or not junit.exists():
            why = f"stopped at its {timeout:.0f} s timeout" if code is None else f"exit {code}, no JUnit file"
            ctx.problem(f"{label}: pytest {why}: {one_line(str(failed).splitlines()[-1])}")
            return None
    result = parse_junit(junit) | {"exit": code, "seconds": round(time.perf_counter() - started, 1)}
    if code not in (0, 1):  # 2 interrupted, 3 internal error, 4 usage error, 5 nothing collected
        ctx.problem(f"{label}: pytest exit {code}")
    for failure in result["failures"]:
        ctx.problem(f"{label}: {failure}")
    return result


def collect_pass(ctx: Context, timeout: float) -> None:
    """Dry run: the CUDA pass collected under TRAINER_EXT_TEST_DEVICE=cpu; a missing entry is a problem."""
    missing = [e for e in CUDA_PASS if not (ROOT / e.split("::")[0]).exists()]
    for entry in missing:
        ctx.problem(f"CUDA pass: {entry} does not exist")
    present = [e for e in CUDA_PASS if e not in missing]
    started = time.perf_counter()
    try:
        output = ctx.run(
            pytest_command("--collect-only", *present), timeout=timeout, label="pass_collect", **{SWITCH: "cpu"}
        )
    except ChildFailed as failed:
        output = str(failed)
        lost = [m.strip() for m in re.findall(r"not found: (\S+)", output)]  # pytest names them by absolute path
        not_found = [e for e in present if any(path.endswith(e) for path in lost)]
        for entry in not_found:
            ctx.problem(f"CUDA pass: {entry} is not a test pytest can find")
        if not not_found:
            ctx.problem(f"CUDA pass: collection failed: {one_line(output.splitlines()[-1])}")
        ctx.record(pass_collected=0, pass_entries=len(CUDA_PASS))
        return
    ids = collected_ids(output)
    ctx.record(
        pass_collected=len(ids), pass_entries=len(CUDA_PASS), pass_collect_s=round(time.perf_counter() - started, 1)
    )
    for entry in unmatched(present, ids):
        ctx.problem(f"CUDA pass: {entry} collects no test")


def record_run(ctx: Context, prefix: str, result: dict[str, Any]) -> None:
    """A run's counts, failures and (at most 20 lines of) what its tests printed, under ``prefix_``."""
    ctx.record(
        **{f"{prefix}_{k}": v for k, v in result.items() if k != "printed"},
        **{f"{prefix}_printed": result["printed"][:20]},
    )


def run(ctx: Context) -> None:
    """``-m gpu`` then the CUDA pass on the GPU; in the dry run ``-m gpu`` (all skip) and the pass only collected."""
    if not has_module("pytest"):
        raise Skip("pytest is not installed here (pip install -e '.[dev]')")
    deadline = time.perf_counter() + STEP_S[ctx.cuda]
    ctx.record(pass_entries=len(CUDA_PASS))
    gpu = run_pytest(
        ctx, "gpu", ["-m", "gpu", "tests"], min(GPU_RUN_S[ctx.cuda], deadline - time.perf_counter()), "cpu"
    )
    if gpu is not None:
        record_run(ctx, "gpu", gpu)
        if ctx.cuda:
            ctx.check(gpu["tests"] - gpu["skipped"] >= 1, "-m gpu: no gpu test ran on the GPU")
        else:  # every gpu test skips on the CPU: collection must still have found them, without errors
            found = f"{gpu['skipped']} skipped, {gpu['errors']} errors"
            ctx.check(
                gpu["skipped"] >= 1 and gpu["errors"] == 0, f"-m gpu on the CPU: {found} (want >= 1 skipped, 0 errors)"
            )
    left = deadline - time.perf_counter()
    if not ctx.cuda:
        collect_pass(ctx, left)
        return
    result = run_pytest(ctx, "pass", list(CUDA_PASS), left, "cuda")
    if result is not None:
        record_run(ctx, "pass", result)


def _counts(f: dict[str, Any], prefix: str) -> str:
    keys = ("passed", "failed", "errors", "skipped")
    text = ", ".join(f"{f.get(f'{prefix}_{k}', '?')} {k}" for k in keys)
    return f"{text} in {f.get(f'{prefix}_seconds', '?')} s"


def summarize(f: dict[str, Any]) -> list[str]:
    lines = []
    if "gpu_tests" in f:
        lines.append(f"`pytest -m gpu tests`: {_counts(f, 'gpu')}")
    if "pass_tests" in f:
        lines.append(f"CUDA pass ({f.get('pass_entries')} entries, {SWITCH}=cuda): {_counts(f, 'pass')}")
    elif "pass_collected" in f:
        lines.append(
            f"CUDA pass (dry run): {f['pass_collected']} tests collected from {f.get('pass_entries')} entries"
        )
    failed = [x.split(" (")[0] for p in ("gpu", "pass") for x in f.get(f"{p}_failures", [])]
    if failed:
        lines.append(f"failed: {', '.join(failed[:6])}" + (f" and {len(failed) - 6} more" if len(failed) > 6 else ""))
    return lines
