"""The total gradient norm of parameters that mix plain tensors and DTensors on any meshes (tensor parallelism
leaves norms and embeddings plain), the same number one process computes, and clipping by it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def total_grad_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type`` norm of all gradients together, as a plain tensor: torch's norm per group of one kind
    (plain tensors; DTensors of one mesh), each DTensor group's made whole over its mesh, then combined."""
    import torch
    from torch.distributed.tensor import DTensor

    grads = _grads(parameters)
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    stacked = torch.stack([n.to(device) for n in norms])
    return stacked.max() if norm_type == float("inf") else torch.linalg.vector_norm(stacked, norm_type)


def clip_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale the gradients in place so that their total norm is at most ``max_norm``; returns the total norm before
    clipping (``torch.nn.utils.clip_grad_norm_``'s contract, for any mix of tensors and DTensors)."""
    import torch
    from torch.distributed.tensor import DTensor

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = total_grad_norm(params, norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in _grads(params):
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(coefficient.to(local.device, local.dtype))
    return total


def _grads(parameters: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    import torch

    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    return [p.grad for p in params if p.grad is not None]
