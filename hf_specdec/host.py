"""Host values onto the device without waiting for it.

`torch.tensor(values, device="cuda")` builds the tensor in pageable host memory and copies it with a
blocking copy, which waits for every kernel queued before it: one synchronisation per call, as CUDA's
own count shows (`torch.cuda.set_sync_debug_mode`, `evals/cuda_checks.py`). The decode loop uploads
small host lists every round (a row's generated tokens for the stopping criteria, retrieved chains, a
tree's nodes, depths and walk), so on an accelerator each would stall the queue. `to_device` stages
them in pinned memory and copies asynchronously: the caching host allocator keeps the staging buffer
until the copy has run, so the values are what was passed whatever the host does next.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on `device`; on CUDA an asynchronous copy from pinned memory."""
    tensor = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype, device="cpu")
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    staged = tensor.clone().pin_memory() if tensor.is_pinned() else tensor.pin_memory()  # never the caller's buffer
    return staged.to(device, non_blocking=True)
