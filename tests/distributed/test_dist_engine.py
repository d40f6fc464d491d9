"""Tier 1: the engine and its optimizer wrapper in one process (no process group)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader

from trainer_ext.distributed import DistributedType, DistState, Engine, EngineOptimizer, ShardedDataLoader, Topology
from trainer_ext.distributed.strategies import DDPStrategy, SingleDeviceStrategy


@pytest.fixture
def engine() -> Engine:
    return Engine(DistState(init=False))


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def test_single_process_engine(engine: Engine) -> None:
    assert engine.distributed_type is DistributedType.NO
    assert engine.distributed_type == "NO" and "NO" == engine.distributed_type
    assert engine.distributed_type != "MULTI_CPU"
    assert isinstance(engine.strategy, SingleDeviceStrategy)
    assert (engine.num_processes, engine.process_index, engine.local_process_index) == (1, 0, 0)
    assert engine.is_main_process and engine.is_local_main_process
    assert engine.device == torch.device("cpu")
    assert engine.mixed_precision == "no" and engine.scaler is None
    assert engine.sync_gradients is True and engine.optimizer_step_was_skipped is False
    ran = []
    with engine.main_process_first():
        ran.append(1)
    with engine.local_main_process_first():
        ran.append(2)
    engine.wait_for_everyone()
    assert ran == [1, 2]


def test_prepare_arity_and_order(engine: Engine) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(list(range(6)), batch_size=2)
    marker = object()

    assert engine.prepare(model) is model  # one object comes back bare
    prepared = engine.prepare(optimizer, marker, loader, model)
    assert isinstance(prepared, tuple) and len(prepared) == 4
    opt, other, dl, mdl = prepared
    assert isinstance(opt, EngineOptimizer) and opt.optimizer is optimizer
    assert other is marker  # unknown objects pass through
    assert isinstance(dl, ShardedDataLoader) and dl.dataset is loader.dataset
    assert mdl is model
    assert engine.prepare() == ()
    assert engine.prepare_optimizer(opt) is opt  # never wrapped twice
    assert engine._models == [model, model] and engine._optimizers == [opt] and engine._dataloaders == [dl]


def test_prepared_optimizer_drives_lambda_lr(engine: Engine) -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.2)
    opt = engine.prepare(inner)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.defaults is inner.defaults
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    assert inner.param_groups[0]["lr"] == pytest.approx(0.2)
    lrs = []
    for _ in range(3):
        opt.step()
        scheduler.step()
        lrs.append(inner.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.1, 0.2 / 3, 0.05])
    assert scheduler.get_last_lr() == pytest.approx([0.05])


def test_optimizer_steps_only_at_sync_boundaries(engine: Engine) -> None:
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = engine.prepare(torch.optim.SGD([param], lr=0.5))
    param.grad = torch.tensor([1.0, 1.0])

    engine.gradient_state._set_sync_gradients(False)
    assert engine.sync_gradients is False
    opt.step()
    assert param.tolist() == [1.0, 2.0]  # not a boundary: no step

    engine.gradient_state._set_sync_gradients(True)
    opt.step()
    assert param.tolist() == [0.5, 1.5]
    assert opt.step_was_skipped is False and engine.step_was_skipped is False

    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        return torch.tensor(0.0)

    opt.step(closure)
    assert calls == [1] and param.tolist() == [0.0, 1.0]
    engine.gradient_state._set_sync_gradients(False)
    opt.step(closure)
    assert calls == [1] and param.tolist() == [0.0, 1.0]

    engine.gradient_state._set_sync_gradients(True)
    opt.zero_grad()
    assert param.grad is None


def test_zero_grad_waits_for_the_sync_boundary(engine: Engine) -> None:
    param = torch.nn.Parameter(torch.tensor([1.0]))
    opt = engine.prepare(torch.optim.SGD([param], lr=1.0))
    for sync, weight in [(False, 1.0), (True, 2.0)]:
        engine.gradient_state._set_sync_gradients(sync)
        (param * weight).sum().backward()
        opt.step()
        opt.zero_grad()
    assert param.item() == -2.0  # 1 - lr·(1 + 2): both micro-batches count
    assert param.grad is None  # and the boundary's zero_grad did clear


def test_optimizer_state_dict_round_trip(engine: Engine) -> None:
    model = _model()
    opt = engine.prepare(torch.optim.Adam(model.parameters(), lr=0.01))
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    assert len(opt.state) == 4 and opt.state is opt.optimizer.state
    saved = copy.deepcopy(opt.state_dict())

    clone_model = copy.deepcopy(model)
    clone = engine.prepare(torch.optim.Adam(clone_model.parameters(), lr=0.5))
    clone.load_state_dict(saved)
    loaded = clone.state_dict()
    assert loaded["param_groups"][0]["lr"] == 0.01
    for key, value in saved["state"].items():
        assert loaded["state"][key]["step"] == value["step"] == 1
        torch.testing.assert_close(loaded["state"][key]["exp_avg"], value["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(loaded["state"][key]["exp_avg_sq"], value["exp_avg_sq"], rtol=0, atol=0)


def test_add_param_group_and_repr(engine: Engine) -> None:
    inner = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    opt = engine.prepare(inner)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.3})
    assert [g["lr"] for g in inner.param_groups] == [0.1, 0.3]
    assert repr(opt).startswith("EngineOptimizer(SGD")


def test_backward_does_not_divide_the_loss(engine: Engine) -> None:
    engine.gradient_state.num_steps = 4  # accumulation is the caller's business
    model = _model()
    twin = copy.deepcopy(model)
    x = torch.randn(6, 4)
    engine.backward(model(x).pow(2).sum() * 3, learning_rate=0.1, scale_wrt_gas=True)
    (twin(x).pow(2).sum() * 3).backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_clip_grad_norm_returns_the_norm_before_clipping(engine: Engine) -> None:
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1))
    a.grad = torch.tensor([3.0, 0.0])
    b.grad = torch.tensor([4.0])
    norm = engine.clip_grad_norm_([a, b], max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    assert a.grad.tolist() == pytest.approx([0.6, 0.0], abs=1e-5)
    assert b.grad.tolist() == pytest.approx([0.8], abs=1e-5)
    assert engine.clip_grad_norm_([a, b], max_norm=10.0).item() == pytest.approx(1.0, abs=1e-5)
    assert a.grad.tolist() == pytest.approx([0.6, 0.0], abs=1e-5)  # under the limit: unchanged


class _FakeCompiled(torch.nn.Module):
    """Stands in for torch.compile's OptimizedModule (the engine only looks at ``_orig_mod``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self._orig_mod = module


def test_unwrap_model(engine: Engine) -> None:
    model = _model()
    assert engine.unwrap_model(model) is model
    wrapped = torch.nn.DataParallel(model)  # no GPU: DataParallel just holds the module
    assert wrapped.module is model
    assert engine.unwrap_model(wrapped) is model
    assert engine.unwrap_model(torch.nn.DataParallel(torch.nn.DataParallel(model))) is model
    compiled = _FakeCompiled(torch.nn.DataParallel(model))
    assert engine.unwrap_model(compiled, keep_torch_compile=False) is model
    # a compile wrapper around a parallel wrapper cannot be kept without rewiring it: the module comes back,
    # and nothing is mutated
    assert engine.unwrap_model(compiled) is model
    assert isinstance(compiled._orig_mod, torch.nn.DataParallel)
    direct = _FakeCompiled(model)
    assert engine.unwrap_model(direct) is direct
    assert engine.unwrap_model(direct, keep_torch_compile=False) is model
    assert list(engine.get_state_dict(wrapped)) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert list(engine.get_state_dict(wrapped, unwrap=False))[0] == "module.0.weight"


@pytest.mark.parametrize("n, b, sizes", [(10, 4, [4, 4, 2]), (8, 4, [4, 4]), (3, 4, [3])])
def test_gather_for_metrics_truncates_only_at_the_end(engine: Engine, n: int, b: int, sizes: list[int]) -> None:
    loader = engine.prepare(DataLoader(list(range(n)), batch_size=b))
    outside = engine.gather_for_metrics(torch.arange(b))
    assert outside.tolist() == list(range(b))  # no active loader: nothing dropped
    real = []
    fixed = []
    objects = []
    for batch in loader:
        real.append(engine.gather_for_metrics(batch).tolist())
        # a full-size tensor: only the final step is cut, to the remainder of the dataset
        fixed.append(len(engine.gather_for_metrics({"x": torch.zeros(b, 2)})["x"]))
        objects.append(engine.gather_for_metrics([f"s{i}" for i in range(b)]))
    assert [i for r in real for i in r] == list(range(n))
    assert fixed == [b] * (len(sizes) - 1) + [n % b or b]
    assert [len(o) for o in objects] == fixed
    assert engine.gather_for_metrics(torch.tensor(1.5)).tolist() == [1.5]


def test_gather_for_metrics_inner_loader_wins(engine: Engine) -> None:
    outer = engine.prepare(DataLoader(list(range(4)), batch_size=2))  # remainder 0
    inner = engine.prepare(DataLoader(list(range(3)), batch_size=2))  # remainder 1
    lengths = []
    for _ in outer:
        for _ in inner:
            lengths.append(len(engine.gather_for_metrics(torch.zeros(2))))
        lengths.append(len(engine.gather_for_metrics(torch.zeros(2))))
    assert lengths == [2, 1, 2, 2, 1, 2]


def test_free_memory(engine: Engine) -> None:
    model = _model()
    engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(list(range(4)), batch_size=2))
    assert (len(engine._models), len(engine._optimizers), len(engine._dataloaders)) == (1, 1, 1)
    assert engine.free_memory(model, "x") == (None, None)
    assert engine._models == [] and engine._optimizers == [] and engine._dataloaders == []
    assert engine.free_memory() == ()


def test_prepare_model_bf16_patches_forward() -> None:
    engine = Engine(DistState(init=False), mixed_precision="bf16")
    assert engine.mixed_precision == "bf16" and engine.scaler is None
    model = engine.prepare(torch.nn.Sequential(torch.nn.Linear(4, 2)))
    seen = []
    model[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    assert model(torch.ones(1, 4)).dtype == torch.float32
    assert seen == [torch.bfloat16]
    assert hasattr(model, "_original_forward")
    with engine.autocast():
        assert torch.is_autocast_enabled("cpu")


def test_prepare_model_evaluation_mode_and_no_placement() -> None:
    engine = Engine(DistState(init=False), device_placement=False)
    model = _model()
    assert engine.prepare_model(model, evaluation_mode=True) is model
    loader = engine.prepare(DataLoader(list(range(4)), batch_size=2))
    assert loader.device is None


def test_rank1_of_2_engine_without_process_group() -> None:
    """A rank-1 engine built from a topology: DDP chosen, its loader yields every other batch."""
    state = DistState(Topology(rank=1, local_rank=1, world_size=2, local_world_size=2), cpu=True, init=False)
    engine = Engine(state, seed=0)
    assert isinstance(engine.strategy, DDPStrategy)
    assert engine.distributed_type is DistributedType.MULTI_CPU and engine.distributed_type == "MULTI_CPU"
    assert (engine.num_processes, engine.process_index, engine.is_main_process) == (2, 1, False)
    loader = engine.prepare(DataLoader(list(range(10)), batch_size=2))
    assert [b.tolist() for b in loader] == [[2, 3], [6, 7], [0, 1]]  # batches 1, 3 and padding from the start
    assert loader.remainder == 2


def test_fp16_scaler_flow_skips_an_overflowing_step_and_counts_it(engine: Engine) -> None:
    """scale in backward -> one unscale in clip -> step + update; an inf gradient skips the step."""
    engine.precision.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # the CUDA flow, on CPU
    model = _model()
    optimizer = engine.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = model(torch.ones(2, 4)).sum()
    engine.backward(loss)
    grad = model[0].weight.grad.clone()
    engine.clip_grad_norm_(model.parameters(), 1e9)  # unscales
    assert torch.allclose(model[0].weight.grad * 1024.0, grad)
    optimizer.step()
    assert not engine.optimizer_step_was_skipped and engine.skipped_steps == 0
    assert not torch.equal(model[0].weight, before["0.weight"])

    optimizer.zero_grad()
    engine.backward(model(torch.full((2, 4), float("inf"))).sum())
    engine.clip_grad_norm_(model.parameters(), 1.0)
    after_good_step = model[0].weight.clone()
    optimizer.step()
    assert engine.optimizer_step_was_skipped and engine.skipped_steps == 1
    assert torch.equal(model[0].weight, after_good_step), "a skipped step must not touch the weights"
    assert engine.scaler.get_scale() < 1024.0


def test_gather_for_metrics_with_gather_object(engine: Engine) -> None:
    assert engine.gather_for_metrics(["a", "b"], use_gather_object=True) == ["a", "b"]
    tensor = torch.arange(3)
    assert engine.gather_for_metrics(tensor, use_gather_object=True) is tensor


def test_unsharded_eval_inside_a_training_epoch_is_not_truncated(engine: Engine) -> None:
    """An iterable eval loader run while the train loader sits on its last batch keeps all its rows."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    train = engine.prepare(DataLoader(list(range(10)), batch_size=4))  # remainder 10 % 4 = 2
    evaluation = engine.prepare(DataLoader(Stream(), batch_size=4))
    rows = []
    for _batch in train:
        if engine.gradient_state.end_of_dataloader:
            for eval_batch in evaluation:
                rows.append(engine.gather_for_metrics(eval_batch))
    assert [r.tolist() for r in rows] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert engine.gradient_state.active_dataloader is None
