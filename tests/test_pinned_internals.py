"""The private internals of torch DCP and DeepSpeed that trainer_ext relies on, pinned as test_compat.py pins
transformers': each test names the private thing, checks that it still exists and behaves as we use it, and its
failure message says what to update. The file-name patterns are checked against files a real save wrote.

DeepSpeed's tests need the deepspeed extra (they skip without it); they run one DeepSpeed process on the CPU
(``DS_ACCELERATOR=cpu``, a one-rank gloo group) started as ``python -m tests.test_pinned_internals OUT``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import json
import os
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from tests.helpers.ranks import child_env
from tests.helpers.tiny import tiny_llama
from trainer_ext.checkpointing import deepspeed_files, durable, listing, safe_dcp, verification
from trainer_ext.checkpointing import sharded as sharded_checkpoint

pytestmark = pytest.mark.timeout(300)

SAFE_DCP = "trainer_ext/checkpointing/safe_dcp.py"
DS_STRATEGY = "trainer_ext/distributed/strategies/deepspeed/strategy.py"
DS_WEIGHTS = "trainer_ext/distributed/strategies/deepspeed/weights.py"
NO_DEEPSPEED = "deepspeed is not installed: pip install -e '.[deepspeed]'"
RANK_FILE = (
    "the per-rank file pattern durable._RANK_FILE (trainer_ext/checkpointing/durable.py: flush_tree fsyncs by it)"
)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


# -- torch.distributed.checkpoint ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A model and its AdamW state after one step, written through DCP by one process (a resume on one process)."""
    folder = tmp_path_factory.mktemp("dcp")
    model = tiny_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, optimizer)
    sharded_checkpoint.save_model(model, folder)
    sharded_checkpoint.save_optimizer(model, optimizer, folder)
    return folder, model


class _RecordingUnpickler(pickle.Unpickler):
    def __init__(self, handle: Any) -> None:
        super().__init__(handle)
        self.found: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.found.add((module, name))
        return super().find_class(module, name)


def test_dcp_metadata_pickles_only_what_safe_dcp_allows(dcp_folder) -> None:
    """safe_dcp._ALLOWED: every global DCP's ``.metadata`` pickle names (DCP itself reads it with pickle.load)."""
    folder, _ = dcp_folder
    for sub in (sharded_checkpoint.MODEL_DIR, sharded_checkpoint.OPTIMIZER_DIR):
        path = folder / sub / safe_dcp.METADATA
        with open(path, "rb") as handle:
            unpickler = _RecordingUnpickler(handle)
            unpickler.load()
        allowed = set(safe_dcp._ALLOWED)
        unknown = {
            (module, name)
            for module, name in unpickler.found
            if (module, name) not in allowed and not isinstance(getattr(torch, name, None), torch.dtype)
        }
        assert not unknown, (
            f"torch {torch.__version__} pickles {sorted(unknown)} into DCP metadata: once checked to be plain data "
            f"(nothing in its __reduce__/__setstate__ runs code), add it to _ALLOWED / _DCP_CLASSES in {SAFE_DCP}"
        )
        assert isinstance(safe_dcp.load_metadata(path), dcp_metadata.Metadata)


def test_dcp_private_names_safe_dcp_imports() -> None:
    """``filesystem._StorageInfo`` (its fields), ``torch.serialization._get_layout`` (how a layout pickles) and the
    metadata classes in the allow-list; ``Metadata.storage_meta.load_id`` (SafeReader sets it)."""
    fields = {f.name for f in dataclasses.fields(dcp_filesystem._StorageInfo)}
    assert {"relative_path", "offset", "length"} <= fields, (
        f"torch.distributed.checkpoint.filesystem._StorageInfo has fields {sorted(fields)}: update _check_paths and "
        f"check_values in {SAFE_DCP}, which read relative_path/offset/length"
    )
    assert b"_get_layout" in pickle.dumps(torch.strided) and torch.serialization._get_layout("torch.strided") is (
        torch.strided
    ), f"torch layouts no longer pickle as torch.serialization._get_layout(name): update _ALLOWED in {SAFE_DCP}"
    missing = [n for n in safe_dcp._DCP_CLASSES if n != "_MEM_FORMAT_ENCODING" and not hasattr(dcp_metadata, n)]
    assert not missing, f"torch.distributed.checkpoint.metadata lost {missing}: update _DCP_CLASSES in {SAFE_DCP}"
    assert "storage_meta" in {f.name for f in dataclasses.fields(dcp_metadata.Metadata)}
    assert "load_id" in {f.name for f in dataclasses.fields(dcp_metadata.StorageMeta)}, (
        f"DCP's StorageMeta has no load_id: update SafeReader.read_metadata in {SAFE_DCP}"
    )


def test_set_element_places_a_value_at_a_flattened_path() -> None:
    """``torch.distributed.checkpoint._traverse.set_element(root, path, value)``: SafeLoadPlanner.load_bytes uses it."""
    from torch.distributed.checkpoint._traverse import set_element

    assert list(inspect.signature(set_element).parameters) == ["root_dict", "path", "value"], (
        f"DCP's _traverse.set_element changed its signature: update SafeLoadPlanner.load_bytes in {SAFE_DCP}"
    )
    root: dict[str, Any] = {}
    set_element(root, ("state", "w", "step"), 5)
    set_element(root, ("param_groups", 0, "lr"), 0.1)
    assert root == {"state": {"w": {"step": 5}}, "param_groups": [{"lr": 0.1}]}


def test_default_load_planner_load_bytes_is_what_safe_load_planner_copies(dcp_folder) -> None:
    """SafeLoadPlanner.load_bytes re-implements DefaultLoadPlanner.load_bytes with ``weights_only=True``: DCP's must
    still read only the attributes ours reads, and both must load the same values from a real checkpoint."""
    names = set(DefaultLoadPlanner.load_bytes.__code__.co_names)
    copied = {"flatten_state_dict", "set_element", "original_state_dict", "mappings", "dest_index", "fqn"}
    assert names <= copied | {"torch", "load", "state_dict"}, (
        f"DefaultLoadPlanner.load_bytes now uses {sorted(names - copied - {'torch', 'load', 'state_dict'})}: "
        f"copy its new logic into SafeLoadPlanner.load_bytes in {SAFE_DCP}"
    )
    assert list(inspect.signature(DefaultLoadPlanner.load_bytes).parameters) == ["self", "read_item", "value"]
    folder, model = dcp_folder
    path = folder / sharded_checkpoint.OPTIMIZER_DIR
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loaded = []
    for reader, planner in (
        (FileSystemReader(path), DefaultLoadPlanner()),
        (safe_dcp.SafeReader(path), safe_dcp.SafeLoadPlanner()),
    ):
        state = get_optimizer_state_dict(model, fresh)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
        loaded.append(state)
    default, safe = loaded
    assert default["param_groups"] == safe["param_groups"] and default["param_groups"][0]["lr"] == 1e-3
    assert default["state"].keys() == safe["state"].keys()
    for name, values in default["state"].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(safe["state"][name][key])), (name, key)


def test_safe_reader_finds_the_metadata_where_dcp_keeps_it(dcp_folder) -> None:
    """``FileSystemReader._get_metadata_path(rank)`` and ``.load_id``: SafeReader.read_metadata overrides DCP's."""
    folder, _ = dcp_folder
    path = folder / sharded_checkpoint.MODEL_DIR
    assert "rank" in inspect.signature(FileSystemReader._get_metadata_path).parameters, (
        f"FileSystemReader._get_metadata_path changed: update SafeReader.read_metadata in {SAFE_DCP}"
    )
    reader = safe_dcp.SafeReader(path)
    assert Path(reader._get_metadata_path(None)) == path / safe_dcp.METADATA
    assert Path(reader._get_metadata_path(rank=None)) == path / safe_dcp.METADATA
    metadata = reader.read_metadata(rank=None)
    assert metadata.storage_meta.load_id == reader.load_id


def test_non_tensor_values_are_torch_save_bytes_at_their_offsets(dcp_folder) -> None:
    """safe_dcp.check_values reads each BYTE_IO value from ``relative_path`` at ``offset``/``length`` (uncompressed
    by default) and loads it ``weights_only``; every file DCP names is a bare name inside the folder."""
    folder, _ = dcp_folder
    path = folder / sharded_checkpoint.OPTIMIZER_DIR
    metadata = safe_dcp.load_metadata(path / safe_dcp.METADATA)
    values = {}
    for index, info in metadata.storage_data.items():
        assert Path(info.relative_path).name == info.relative_path
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), dcp_metadata.BytesStorageMetadata):
            continue
        assert not getattr(info, "transform_descriptors", None), (
            f"DCP now transforms (compresses) values by default: check_values in {SAFE_DCP} skips those"
        )
        with open(path / info.relative_path, "rb") as handle:
            handle.seek(info.offset)
            values[index.fqn] = torch.load(io.BytesIO(handle.read(info.length)), weights_only=True)
    assert values, f"DCP wrote no non-tensor value of an optimizer state: check_values in {SAFE_DCP} checks nothing"
    assert 1e-3 in values.values()  # the learning rate of the one parameter group
    safe_dcp.check_values(path, metadata)


def test_checkpoint_exception_carries_each_ranks_failure() -> None:
    """``CheckpointException.failures``: {rank: (exception, traceback)}; sharded_checkpoint._dcp unwraps our refusal."""
    from torch.distributed.checkpoint.api import CheckpointException

    refusal = safe_dcp.UnsafeCheckpointError("refused")
    error = CheckpointException("failed", {0: (refusal, None)})
    assert [exc for exc, _ in error.failures.values()] == [refusal], (
        "DCP's CheckpointException no longer maps ranks to (exception, traceback): update sharded_checkpoint._dcp"
    )


def test_single_process_dcp_warning_is_the_one_we_silence(tmp_path: Path) -> None:
    """dcp.save/load(no_dist=True) warn ``torch.distributed is disabled ...``: sharded_checkpoint._dcp filters it."""
    for func in (dcp.save, dcp.load):
        assert "no_dist" in inspect.signature(func).parameters, f"dcp.{func.__name__} lost no_dist"
    state = {"w": torch.ones(2)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save(state, checkpoint_id=str(tmp_path / "raw"), no_dist=True)
    assert any(str(w.message).startswith("torch.distributed is disabled") for w in caught), (
        f"DCP's single-process warning changed to {[str(w.message) for w in caught]}: update the filter in "
        "sharded_checkpoint._dcp"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded_checkpoint.save_model(torch.nn.Linear(2, 2), tmp_path / "ours")
        sharded_checkpoint.load_model(torch.nn.Linear(2, 2), tmp_path / "ours")
    assert not [w for w in caught if "single process" in str(w.message)]


def test_dcp_shard_file_names_carry_the_writing_rank(dcp_folder) -> None:
    """DCP names each rank's data ``__{rank}_{n}.distcp``; ``.metadata`` is the coordinator's (no rank)."""
    folder, _ = dcp_folder
    for sub in (sharded_checkpoint.MODEL_DIR, sharded_checkpoint.OPTIMIZER_DIR):
        names = sorted(p.name for p in (folder / sub).iterdir())
        data = [n for n in names if n != safe_dcp.METADATA]
        assert data and all(n.startswith("__0_") for n in data), f"DCP wrote {names}: update {RANK_FILE}"
        assert durable.writer_rank(f"{sub}/{safe_dcp.METADATA}") is None
        for name in data:
            assert durable.writer_rank(f"{sub}/{name}") == 0, f"DCP wrote {name}: update {RANK_FILE}"
            assert durable.writer_rank(f"{sub}/{name.replace('__0_', '__13_', 1)}") == 13, f"update {RANK_FILE}"
    verification.verify(folder, require_marker=False)  # every file of a real DCP save passes verification


def test_transformers_checkpoint_and_rng_file_names() -> None:
    """``checkpoint-N`` folders (listing._CHECKPOINT) and the Trainer's per-rank ``rng_state_{rank}.pth``."""
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    assert listing._CHECKPOINT.match(f"{PREFIX_CHECKPOINT_DIR}-12").group(1) == "12", "update listing._CHECKPOINT"
    source = inspect.getsource(transformers.Trainer._save_rng_state)
    assert 'f"rng_state_{self.args.process_index}.pth"' in source, (
        f"transformers names its per-rank RNG files differently now: update {RANK_FILE}"
    )
    assert durable.writer_rank("checkpoint-4/rng_state_3.pth") == 3 and durable.writer_rank("rng_state.pth") is None


def test_torchrun_subprocess_context_keeps_its_processes_where_launch_reads_them() -> None:
    """``trainer-ext launch`` wraps ``SubprocessContext.close`` and reads ``subprocess_handlers[rank].proc`` to learn
    the ranks' exit codes after a signal (cli/launch/run.py ``_exit_codes_kept``)."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext, SubprocessHandler

    where = "update trainer_ext/cli/launch/run.py _exit_codes_kept"
    assert callable(getattr(SubprocessContext, "close", None)), f"SubprocessContext.close is gone: {where}"
    assert "subprocess_handlers" in inspect.getsource(SubprocessContext), f"subprocess_handlers renamed: {where}"
    proc = re.search(r"self\.proc\s*(:[^=]*)?=", inspect.getsource(SubprocessHandler))
    assert proc, f"SubprocessHandler.proc (the Popen) is gone: {where}"


# -- DeepSpeed -------------------------------------------------------------------------------------------
# name, ZeRO stage, bf16: the checkpoints the DeepSpeed process writes
DS_SAVES = (("zero2", 2, False), ("zero2_bf16", 2, True), ("zero3", 3, False), ("zero3_bf16", 3, True))


def _ds_config(stage: int, bf16: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
    }


def _deepspeed_job(out: Path) -> None:
    """One DeepSpeed process on the CPU: a checkpoint per entry of DS_SAVES, then ZeRO-3 facts into results.json."""
    import deepspeed
    from deepspeed.comm.torch import build_shm_op
    from transformers import LlamaForCausalLM

    from trainer_ext.distributed import DistState
    from trainer_ext.distributed.strategies.deepspeed.strategy import DeepSpeedStrategy

    state = DistState(cpu=True)
    results: dict[str, Any] = {}
    for name, stage, bf16 in DS_SAVES:
        strategy = DeepSpeedStrategy(state, _ds_config(stage, bf16))
        model = tiny_llama(0)
        engine, _, _ = strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        strategy.backward(engine(input_ids=ids, labels=ids).loss)
        strategy.step()
        strategy.save_checkpoint(engine, out / name)
        results[name] = {"skipped_steps": engine.skipped_steps}
        strategy.forget()
    results["shm_comm_compatible"] = deepspeed.ops.__compatible_ops__.get("deepspeed_shm_comm")
    results["shm_op_built"] = build_shm_op() is not None

    config = tiny_llama(0).config
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    tied = LlamaForCausalLM(config)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    reference = {k: v.clone() for k, v in tied.state_dict().items()}
    strategy = DeepSpeedStrategy(state, _ds_config(3))
    engine, _, _ = strategy.initialize(tied, torch.optim.AdamW(tied.parameters(), lr=1e-3))
    params = dict(engine.module.named_parameters(remove_duplicate=False))
    results["ds_shape"] = {n: list(getattr(p, "ds_shape", [])) for n, p in params.items()}
    results["local_numel"] = {n: p.numel() for n, p in params.items()}
    results["full_shape"] = {n: list(reference[n].shape) for n in params}
    gathered = engine._zero3_consolidated_16bit_state_dict()
    results["consolidated"] = {
        "keys": sorted(gathered),
        "expected_keys": sorted(reference),
        "equal": sorted(k for k in reference if k in gathered and torch.equal(gathered[k], reference[k])),
        "devices": sorted({t.device.type for t in gathered.values()}),
        "tied_share_storage": gathered["lm_head.weight"].data_ptr()
        == gathered["model.embed_tokens.weight"].data_ptr(),
    }
    strategy.consolidated_state_dict(engine)  # check_complete accepts it (raises otherwise)
    strategy.forget()
    strategy.destroy()
    (out / "results.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    pytest.importorskip("deepspeed", reason=NO_DEEPSPEED)
    out = tmp_path_factory.mktemp("deepspeed")
    env = child_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "tests.test_pinned_internals", str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"the DeepSpeed process failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.deepspeed
def test_zero3_consolidated_16bit_state_dict(ds_run) -> None:
    """``DeepSpeedEngine._zero3_consolidated_16bit_state_dict()``: DeepSpeedStrategy.consolidated_state_dict gathers
    ZeRO-3 weights with it: every state-dict name, full values on the CPU, tied weights sharing one tensor (which
    check_complete counts once)."""
    deepspeed = pytest.importorskip("deepspeed", reason=NO_DEEPSPEED)

    method = getattr(deepspeed.DeepSpeedEngine, "_zero3_consolidated_16bit_state_dict", None)
    assert method is not None, (
        f"DeepSpeed {deepspeed.__version__} has no _zero3_consolidated_16bit_state_dict: {DS_STRATEGY}"
    )
    required = [
        p.name
        for p in list(inspect.signature(method).parameters.values())[1:]
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    assert not required, f"_zero3_consolidated_16bit_state_dict now requires {required}: update {DS_STRATEGY}"
    _, results = ds_run
    gathered = results["consolidated"]
    fix = f"update DeepSpeedStrategy.consolidated_state_dict ({DS_STRATEGY}) and check_complete ({DS_WEIGHTS})"
    assert gathered["keys"] == gathered["expected_keys"], fix
    assert gathered["equal"] == gathered["expected_keys"], fix
    assert gathered["devices"] == ["cpu"], fix
    assert gathered["tied_share_storage"], f"tied weights are gathered as separate tensors now: {fix}"


@pytest.mark.deepspeed
def test_zero3_parameters_carry_their_full_shape_as_ds_shape(ds_run) -> None:
    """``param.ds_shape``: the full shape of a partitioned parameter (strategies.deepspeed_weights.full_shape, the
    unwrap-and-save check); the local ``param`` is empty."""
    _, results = ds_run
    assert results["ds_shape"] == results["full_shape"], (
        f"ZeRO-3 parameters no longer carry ds_shape: update full_shape in {DS_WEIGHTS} and "
        "trainer_ext/checkpointing/saving.py (_tie_key), trainer_ext/callbacks/unwrap_and_save.py"
    )
    assert set(results["local_numel"].values()) == {0}


@pytest.mark.deepspeed
def test_shm_comm_probe_switch(ds_run) -> None:
    """``deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False`` (DeepSpeedStrategy.deepspeed_module) keeps
    DeepSpeed from compiling its CPU shared-memory all-reduce: ``build_shm_op`` reads that flag by the builder's NAME."""
    pytest.importorskip("deepspeed", reason=NO_DEEPSPEED)
    from deepspeed.comm.torch import build_shm_op
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    assert ShareMemCommBuilder.NAME == "deepspeed_shm_comm", f"rename the key in deepspeed_module ({DS_STRATEGY})"
    assert "__compatible_ops__" in inspect.getsource(build_shm_op), (
        f"DeepSpeed decides otherwise whether to build its shm op: update deepspeed_module in {DS_STRATEGY}"
    )
    _, results = ds_run
    assert results["shm_comm_compatible"] is False and results["shm_op_built"] is False


def _undecorated(func: Any) -> Any:
    """The function a decorator without ``functools.wraps`` closes over (DeepSpeed's NVTX ranges)."""
    for cell in getattr(func, "__closure__", None) or ():
        if inspect.isfunction(cell.cell_contents):
            return _undecorated(cell.cell_contents)
    return func


@pytest.mark.deepspeed
def test_engine_methods_and_arguments_we_call() -> None:
    """The engine's methods DeepSpeedStrategy calls, ``backward(scale_wrt_gas=)`` (we pass False: accumulation
    normalisation is the caller's) and ``comm.init_distributed(dist_backend=, dist_init_required=)``."""
    deepspeed = pytest.importorskip("deepspeed", reason=NO_DEEPSPEED)

    engine = deepspeed.DeepSpeedEngine
    used = (
        "set_gradient_accumulation_boundary",
        "is_gradient_accumulation_boundary",
        "get_global_grad_norm",
        "zero_optimization",
        "zero_optimization_partition_weights",
        "fp16_enabled",
        "bfloat16_enabled",
        "save_checkpoint",
        "load_checkpoint",
    )
    missing = [name for name in used if not callable(getattr(engine, name, None))]
    assert not missing, f"DeepSpeedEngine lost {missing}: update {DS_STRATEGY}"
    assert "scale_wrt_gas" in inspect.signature(_undecorated(engine.backward)).parameters, (
        f"update backward in {DS_STRATEGY}"
    )
    init = inspect.signature(deepspeed.comm.init_distributed).parameters
    assert {"dist_backend", "dist_init_required"} <= set(init), f"update deepspeed_module in {DS_STRATEGY}"


@pytest.mark.deepspeed
def test_engine_counts_skipped_steps(ds_run) -> None:
    """``engine.skipped_steps``: DeepSpeedStrategy.backward reports an fp16 overflow by its growth."""
    _, results = ds_run
    assert all(isinstance(results[name]["skipped_steps"], int) for name, _, _ in DS_SAVES), (
        f"DeepSpeedEngine.skipped_steps is gone: update DeepSpeedStrategy.backward in {DS_STRATEGY}"
    )


@pytest.mark.deepspeed
def test_deepspeed_file_names_carry_the_data_parallel_rank(ds_run) -> None:
    """DeepSpeed names each rank's partition ``(bf16_)zero_pp_rank_{rank}_mp_rank_00_...``; ``mp_rank_00_...``
    (the model under ZeRO 0-2), ``latest`` and its scripts are the main process's (durable.writer_rank)."""
    out, _ = ds_run
    for name, stage, bf16 in DS_SAVES:
        folder = out / name
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        tag = (folder / "latest").read_text().strip()
        per_rank = [f for f in files if "zero_pp_rank_0_" in f]
        optim = f"{tag}/{'bf16_' if bf16 else ''}zero_pp_rank_0_mp_rank_00_optim_states.pt"
        model = (
            f"{tag}/zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else f"{tag}/mp_rank_00_model_states.pt"
        )
        assert optim in files and model in files, f"DeepSpeed wrote {files}: update {RANK_FILE}"
        for file in files:
            expected = 0 if file in per_rank else None
            assert durable.writer_rank(file) == expected, f"DeepSpeed wrote {file}: update {RANK_FILE}"
        for file in per_rank:
            assert durable.writer_rank(file.replace("zero_pp_rank_0_", "zero_pp_rank_11_")) == 11, (
                f"update {RANK_FILE}"
            )


@pytest.mark.deepspeed
def test_deepspeed_files_hold_only_the_classes_verify_allows(ds_run) -> None:
    """deepspeed_files.CLASSES: the classes DeepSpeed pickles besides tensors (its files are loaded in full by
    DeepSpeed, so verify loads them ``weights_only`` with these stood in for); a real save verifies."""
    for dotted in deepspeed_files.CLASSES:
        module, _, name = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), name), (
            f"DeepSpeed moved {dotted}: update CLASSES in trainer_ext/checkpointing/deepspeed_files.py"
        )
    out, _ = ds_run
    for name, _, _ in DS_SAVES:
        for path in sorted((out / name).rglob("*.pt")):
            try:
                deepspeed_files.load_file(path)
            except Exception as error:
                pytest.fail(f"{name}/{path.name} holds a class outside deepspeed_files.CLASSES: add it ({error})")
        verification.verify(out / name, require_marker=False)


@pytest.mark.deepspeed
def test_model_states_hold_every_parameter_shape(ds_run) -> None:
    """``param_shapes`` (and ``frozen_param_shapes``) of DeepSpeed's ``*model_states.pt``: the shape check before
    a resume (strategies.deepspeed_weights.saved_shapes) reads them instead of loading the model."""
    from trainer_ext.distributed.strategies.deepspeed.strategy import saved_shapes

    out, _ = ds_run
    expected = {name: list(p.shape) for name, p in tiny_llama(0).named_parameters()}
    for name, _, _ in DS_SAVES:
        found = saved_shapes(out / name)
        assert found is not None and found[0] == expected, (
            f"DeepSpeed's model-states file of {name} no longer lists param_shapes: update saved_shapes in {DS_WEIGHTS}"
        )


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _deepspeed_job(Path(sys.argv[1]))
