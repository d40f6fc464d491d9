"""trainer_ext.Accelerator in a hand-written loop with a real peft LoRA model: train, unwrap, save, reload."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import default_data_collator  # noqa: E402

from tests.helpers.tiny import lm_dataset, tiny_llama  # noqa: E402
from tests.with_peft.lora_models import PeftModel, adapter_state, base_state, logits, lora_llama, max_diff  # noqa: E402
from trainer_ext import Accelerator  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_a_lora_loop_saves_an_adapter_that_reloads_to_the_same_logits(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, seed=0)
    model = lora_llama(0)
    initial_adapter, initial_base = adapter_state(model), base_state(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loader = torch.utils.data.DataLoader(
        lm_dataset(16).with_format("torch"), batch_size=4, shuffle=True, collate_fn=default_data_collator
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    for batch in loader:
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()

    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert isinstance(unwrapped, PeftModel)
    assert max_diff(base_state(unwrapped), initial_base) == 0.0, "a frozen base weight changed"
    trained = adapter_state(unwrapped)
    assert max_diff(trained, initial_adapter) > 1e-3

    accelerator.save_model(model, tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "model.safetensors" not in files
    assert max_diff(load_file(str(tmp_path / "adapter_model.safetensors")), trained) == 0.0
    reloaded = PeftModel.from_pretrained(tiny_llama(0), str(tmp_path))
    torch.testing.assert_close(logits(reloaded), logits(unwrapped), rtol=0, atol=0)
