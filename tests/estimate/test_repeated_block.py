"""The estimator's repeated block is the class that occurs once per layer inside a ModuleList, not any class of
``_no_split_modules`` (BERT names its embeddings there): checked on BERT, Llama and GPT-2 built on the meta device
from their configs, and a 0-layer model has 0 layers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from trainer_ext.cli.main import main
from trainer_ext.estimate import ModelShape, Setup, estimate
from trainer_ext.estimate.shape import repeated_blocks

LAYERS = 3


def _meta(model_class: type, config: transformers.PretrainedConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return model_class(config)


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


ARCHITECTURES = {
    "bert": (
        transformers.BertForSequenceClassification,
        transformers.BertConfig(
            hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=128
        ),
        lambda model: model.bert.encoder.layer,
    ),
    "llama": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig(
            vocab_size=96, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=128
        ),
        lambda model: model.model.layers,
    ),
    "gpt2": (
        transformers.GPT2LMHeadModel,
        transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=LAYERS, n_head=2, bos_token_id=0, eos_token_id=0),
        lambda model: model.transformer.h,
    ),
}


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_the_repeated_block_is_the_layer_of_each_architecture(architecture: str) -> None:
    model_class, config, layers_of = ARCHITECTURES[architecture]
    model = _meta(model_class, config)
    layers = layers_of(model)
    assert repeated_blocks(model, LAYERS) == list(layers)
    shape = ModelShape.from_model(model)
    assert shape.num_layers == LAYERS
    assert shape.layer_params == _numel(layers[0])
    assert shape.outer_params == _numel(model) - LAYERS * _numel(layers[0]) > 0


def test_bert_base_layer_is_7m_and_the_embeddings_are_outside() -> None:
    """bert-base: 7,087,872 parameters per BertLayer; embeddings + pooler + classifier (24.4M) are the root unit."""
    model = _meta(transformers.BertForSequenceClassification, transformers.BertConfig())
    shape = ModelShape.from_model(model)
    assert shape.layer_params == 7_087_872
    assert shape.outer_params == _numel(model) - 12 * 7_087_872 == 24_429_314
    assert _numel(model.bert.embeddings) < shape.outer_params


def test_bert_base_fsdp_transient_counts_one_layer_not_the_embeddings() -> None:
    """FSDP2 gathers the root unit and two layers in bf16 and holds one unit's fp32 gradient: 175 MB for bert-base
    (a classifier without checkpointing adds no activation transient); the embeddings taken for the layer gave 191 MB
    with nothing outside the layers."""
    shape = ModelShape.from_model(_meta(transformers.BertForSequenceClassification, transformers.BertConfig()))
    setup = Setup(strategy="fsdp", world_size=8, precision="bf16", micro_batch=1, seq_len=128)
    outer, layer = 24_429_314, 7_087_872
    assert estimate(shape, setup).transient == 2 * (outer + 2 * layer) + 4 * max(outer, layer) == 174_927_372


def test_a_block_list_nested_inside_the_layers_is_not_the_layer() -> None:
    """Only outermost lists count: a layer's own list of as many sub-blocks as there are layers is not chosen."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(LAYERS))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))

    model = Model()
    assert repeated_blocks(model, LAYERS) == list(model.layers)


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_zero_layers_have_no_repeated_block(architecture: str) -> None:
    model_class, config, _ = ARCHITECTURES[architecture]
    config = type(config).from_dict({**config.to_dict(), "num_hidden_layers": 0})
    model = _meta(model_class, config)
    shape = ModelShape.from_model(model)
    assert (shape.num_layers, shape.layer_params, shape.outer_params) == (0, 0, _numel(model))


def test_a_zero_layer_bert_config_prints_0_layers(tmp_path, capsys) -> None:
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=0, num_attention_heads=2, intermediate_size=128)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    (tmp_path / "data.csv").write_text("text,label\ngood film,1\nbad film,0\n")
    argv = ["estimate", "--model_config", str(tmp_path / "config.json"), "--train_file", str(tmp_path / "data.csv")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ", 0 layers," in out, out
