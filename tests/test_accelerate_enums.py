"""The enums scripts compare against carry accelerate 1.15's names and values (literal lists: no accelerate here)."""

from __future__ import annotations

import trainer_ext
from trainer_ext import DDPCommunicationHookType, DistributedDataParallelKwargs, DistributedType

# list(accelerate.DistributedType) and list(accelerate.utils.DDPCommunicationHookType), accelerate 1.15.0
ACCELERATE_DISTRIBUTED_TYPES = [
    "NO",
    "MULTI_CPU",
    "MULTI_GPU",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "DEEPSPEED",
    "FSDP",
    "XLA",
    "MEGATRON_LM",
    "MULTI_HPU",
    "MULTI_NEURON",
]
ACCELERATE_HOOKS = {
    "NO": "no",
    "FP16": "fp16",
    "BF16": "bf16",
    "POWER_SGD": "power_sgd",
    "BATCHED_POWER_SGD": "batched_power_sgd",
}


def test_distributed_type_has_accelerates_members_and_values() -> None:
    assert [member.name for member in DistributedType] == ACCELERATE_DISTRIBUTED_TYPES
    assert all(member.value == member.name for member in DistributedType)
    assert DistributedType.MULTI_XPU == "MULTI_XPU"  # a str enum, as accelerate's


def test_comm_hook_type_is_exported_with_accelerates_members() -> None:
    assert "DDPCommunicationHookType" in trainer_ext.__all__
    assert {member.name: member.value for member in DDPCommunicationHookType} == ACCELERATE_HOOKS
    kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    assert kwargs.comm_hook is DDPCommunicationHookType.FP16
    assert DistributedDataParallelKwargs(comm_hook="power_sgd").comm_hook is DDPCommunicationHookType.POWER_SGD
