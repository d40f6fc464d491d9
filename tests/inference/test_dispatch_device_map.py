"""Device-map inference with made-up budgets: the maps are computed, never executed (no GPU needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.inference.dispatch_models import EMBED, LAYER, make_gpt2, make_llama
from trainer_ext.errors import ConfigError
from trainer_ext.inference import infer_auto_device_map, normalize_device, parse_size
from trainer_ext.inference.devices import device_order, resolve_max_memory
from trainer_ext.inference.inventory import Inventory
from trainer_ext.inference.plan import make_plan


def _bytes_per_device(model: nn.Module, device_map: dict) -> dict:
    """Weights each device holds under ``device_map`` (tied tensors once), from the plan."""
    inventory = Inventory(model)
    plan = make_plan(inventory, device_map)
    totals: dict = {}
    for group in inventory.groups:
        totals[plan.storage[group.name]] = totals.get(plan.storage[group.name], 0) + group.nbytes
    return totals


@pytest.mark.parametrize(
    ("given", "expected"),
    [(0, 0), ("cuda:1", 1), ("cuda", 0), ("3", 3), (torch.device("cuda", 2), 2), ("CPU", "cpu"), ("disk", "disk")],
)
def test_device_names_accepted(given, expected) -> None:
    assert normalize_device(given) == expected


@pytest.mark.parametrize("bad", ["gpu0", "cuda:x", -1, True, "mps:0", 1.5])
def test_unknown_device_names_are_config_errors(bad) -> None:
    with pytest.raises(ConfigError, match="unknown device .*GPU index.*'cpu' or 'disk'"):
        normalize_device(bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2MB", 2_000_000), ("2MiB", 2**21), ("1.5GB", 1_500_000_000), ("10 kb", 10_000), (512, 512)],
)
def test_sizes(text, expected) -> None:
    assert parse_size(text) == expected


def test_bad_size_is_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot read the memory size '2 bananas'"):
        parse_size("2 bananas")


def test_three_gpus_filled_in_order_within_budgets() -> None:
    model = make_llama()
    max_memory = {2: "350KB", 0: "200KB", "cuda:1": "200KB", "cpu": "1MB"}
    device_map = infer_auto_device_map(model, max_memory=max_memory)
    assert device_map == {
        "model.embed_tokens": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.layers.2": 2,
        "model.layers.3": 2,
        "model.norm": 2,
        "model.rotary_emb": 2,
        "lm_head": 0,  # tied to embed_tokens
    }
    used = _bytes_per_device(model, device_map)
    assert used == {0: EMBED + LAYER, 1: LAYER, 2: 2 * LAYER + 256 + 64}
    budgets = resolve_max_memory(max_memory)
    assert all(nbytes <= budgets[device] for device, nbytes in used.items())


def test_devices_follow_module_order() -> None:
    model = make_llama(layers=6)
    device_map = infer_auto_device_map(model, max_memory={0: "250KB", 1: "250KB", "cpu": "400KB", "disk": "1GB"})
    layers = [device_order(device_map[f"model.layers.{i}"]) for i in range(6)]
    assert layers == sorted(layers)
    assert {device_map[f"model.layers.{i}"] for i in range(6)} == {0, 1, "cpu", "disk"}


def test_whole_model_on_one_device_when_it_fits() -> None:
    assert infer_auto_device_map(make_llama(), max_memory={0: "1MB", "cpu": "1MB"}) == {"": 0}


def test_no_split_modules_stay_whole() -> None:
    model = make_llama()
    assert model._no_split_modules == {"LlamaDecoderLayer"}
    budgets = {0: "100KB", 1: "1MB"}
    whole = infer_auto_device_map(model, max_memory=budgets)
    assert whole == {"model.embed_tokens": 0, "model.layers": 1, "model.norm": 1, "model.rotary_emb": 1, "lm_head": 0}
    split = infer_auto_device_map(model, max_memory=budgets, no_split_module_classes=[])
    assert split["model.layers.0.self_attn"] == 0  # 48 KiB fits next to the embedding
    assert split["model.layers.0.mlp"] == 1
    explicit = infer_auto_device_map(model, max_memory=budgets, no_split_module_classes=["LlamaDecoderLayer"])
    assert explicit == whole


def test_tied_weights_land_together() -> None:
    tied = infer_auto_device_map(make_llama(), max_memory={0: "200KB", 1: "200KB", 2: "350KB"})
    untied = infer_auto_device_map(make_llama(tied=False), max_memory={0: "200KB", 1: "200KB", 2: "350KB"})
    assert tied["lm_head"] == tied["model.embed_tokens"] == 0
    assert untied["lm_head"] == 2  # untied, the head simply comes last
    gpt2 = make_gpt2()
    device_map = infer_auto_device_map(gpt2, max_memory={0: "30KB", 1: "60KB", "cpu": "1MB"})
    assert device_map["lm_head"] == device_map["transformer.wte"]


class _HeadWithBias(nn.Module):
    """Linear -> embedding -> 2 linear blocks -> head tied to the embedding but with its own 4 KB bias."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16)  # 1,088 B
        self.embed = nn.Embedding(1000, 16)  # 64 KB
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 1000)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.pre(self.embed(ids))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_tied_module_moves_with_its_partner() -> None:
    # the embedding alone fits on GPU 0, the embedding plus the head's bias does not: both go to GPU 1
    device_map = infer_auto_device_map(_HeadWithBias(), max_memory={0: "66KB", 1: "100KB"})
    assert device_map == {"pre": 0, "embed": 1, "blocks": 1, "head": 1}
    device_map = infer_auto_device_map(_HeadWithBias(), max_memory={0: "70KB", 1: "100KB"})
    assert device_map == {"pre": 0, "embed": 0, "blocks": 1, "head": 0}


def test_room_is_held_back_on_the_main_gpu_when_offloading() -> None:
    model = make_llama()
    # embed + layer 0 = 180.7 KB fit in 200 KB, but the other layers go to the CPU and run on GPU 0,
    # so the largest module's own weights (32 KiB) are held back there: layer 0 no longer fits
    offloading = infer_auto_device_map(model, max_memory={0: "200KB", "cpu": "1MB"})
    assert offloading["model.embed_tokens"] == 0 and offloading["model.layers"] == "cpu"
    no_offload = infer_auto_device_map(model, max_memory={0: "200KB", 1: "1MB"})
    assert no_offload["model.layers.0"] == 0


def test_dtype_sizes_the_weights() -> None:
    model = make_llama()
    as_fp32 = infer_auto_device_map(model, max_memory={0: "200KB", "cpu": "1MB"})
    as_bf16 = infer_auto_device_map(model, max_memory={0: "200KB", "cpu": "1MB"}, dtype=torch.bfloat16)
    assert as_fp32["model.layers"] == "cpu"
    assert as_bf16["model.layers.0"] == as_bf16["model.layers.1"] == 0 and as_bf16["model.layers.2"] == "cpu"


def test_default_budgets_are_free_memory_minus_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer_ext.inference.devices as devices

    monkeypatch.setattr(devices, "available_cpu_memory", lambda: 10_000)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_max_memory(None) == {"cpu": 9_000}


def test_each_rank_budgets_its_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Research B19: with a process group, device_map='auto' is fine per rank, on that rank's GPUs."""
    import trainer_ext.inference.devices as devices

    monkeypatch.setattr(devices, "available_cpu_memory", lambda: 10_000)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (1000 * (i + 1), 10**6))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert resolve_max_memory(None) == {2: 2700, 3: 3600, "cpu": 4500}
    assert devices.rank_gpus(1, local_rank=1, local_world_size=2) == ([0], 2)  # two ranks share one GPU


def test_max_memory_order_and_duplicates() -> None:
    assert list(resolve_max_memory({"disk": 1, "cpu": 2, 1: 3, "cuda:0": 4})) == [0, 1, "cpu", "disk"]
    with pytest.raises(ConfigError, match="names cuda:0 twice"):
        resolve_max_memory({0: "1GB", "cuda:0": "2GB"})


def test_plan_for_gpus_cpu_and_disk() -> None:
    """CPU and disk modules run on the first GPU; their weights are fetched there per forward."""
    model = make_llama(tied=False)
    device_map = {"model.embed_tokens": 0, "model.layers.0": 1, "model.layers.1": "cpu", "": "disk"}
    inventory = Inventory(model)
    plan = make_plan(inventory, device_map)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert plan.main == 0
    assert plan.slot_device["model.layers.0.mlp.up_proj.weight"] == cuda1
    assert plan.slot_device["model.layers.1.mlp.up_proj.weight"] == cuda0
    assert plan.slot_device["model.layers.3.mlp.up_proj.weight"] == cuda0
    fetched = {g.name for g in inventory.groups for s in g.slots if plan.fetched(s, g)}
    assert "model.layers.1.mlp.up_proj.weight" in fetched and "lm_head.weight" in fetched
    assert "model.layers.0.mlp.up_proj.weight" not in fetched and "model.embed_tokens.weight" not in fetched
    assert plan.storage["model.rotary_emb.inv_freq"] == 0  # buffers stay where their module runs
    assert plan.input_devices == {
        "model.embed_tokens": cuda0,
        "model.layers.0": cuda1,
        "model.layers.1": cuda0,
        "": cuda0,
    }
    on_cpu = make_plan(inventory, device_map, main_device="cpu")
    assert on_cpu.slot_device["model.layers.1.mlp.up_proj.weight"] == torch.device("cpu")


def test_tied_weights_split_by_hand_are_read_across() -> None:
    model = make_llama()
    inventory = Inventory(model)
    plan = make_plan(inventory, {"model": 0, "lm_head": 1})
    group = inventory.by_name["lm_head.weight"]
    assert plan.storage[group.name] == 0
    assert [plan.fetched(s, group) for s in group.slots] == [False, True]


def test_no_room_held_back_when_offloaded_modules_run_on_the_cpu() -> None:
    from trainer_ext.inference.device_map import infer_map

    inventory, budgets = Inventory(make_llama()), resolve_max_memory({0: "200KB", "cpu": "1MB"})
    assert infer_map(inventory, budgets, frozenset({"LlamaDecoderLayer"}))["model.layers"] == "cpu"
    on_cpu = infer_map(inventory, budgets, frozenset({"LlamaDecoderLayer"}), main="cpu")
    assert on_cpu["model.layers.0"] == 0 and on_cpu["model.layers.1"] == "cpu"


def test_disk_only() -> None:
    assert infer_auto_device_map(make_llama(), max_memory={"disk": "1GB"}) == {"": "disk"}
