"""``ckpt_while_writing: replace``: each save's state copied within the device's own memory, so that a save never
waits for the previous one's write (issue 34, item 5).

A save's model and optimizer state (what AutoModel hands torch.distributed.checkpoint) is first copied into one
set of buffers on the same device: on an H200 a 1.1B model's 13.2 GB of fp32 weights and AdamW moments is a
device-to-device copy of milliseconds (about 4.8 TB/s of HBM), against 11 s for a copy into /dev/shm files
(``ckpt_snapshots``) and a wait for the previous save's write of 10-17 s (``wait``). DCP's stager then copies
the buffers to host memory in the background while training goes on (the optimizer may change the weights at
once: the buffers are not the weights), and its writer process writes them.

A save due while the previous one is still being written is taken the same way but not handed to DCP: it waits
in the buffers (its small files, the data loader's position, the RNG and the schedule, are written at once into
its reserved, unpublished step directory) and its write starts as soon as the previous write ends. A newer save
taken meanwhile replaces it (its directory, never published, is removed; ``checkpoint_replaced_by`` in
metrics.jsonl). So the newest save is at most one write behind, and the loop waits for neither the copy to host
memory nor a write.

One set of buffers: a save taken while the stager is still copying the previous one out of them (under a second
on an H200, against saves at least several steps apart) waits for that copy, on record. The memory (one more
copy of a rank's state on its device) is checked before the run (``launch.replace_fits``). The buffers are
made before the first save (:meth:`DeviceSnapshot.prepare`: the weights' while the model compiles, the optimizer
state's after the first optimizer step) so that the stager's pinned host copies of them are made in the
background then too (``automodel_shim.Prestage``), not at the first save.

Why our own code: neither AutoModel nor torch.distributed.checkpoint has a save that replaces a waiting one, and
DCP's stager copies straight from the live weights, so the loop must wait for that copy before the next
optimizer step. torchtitan and Megatron's checkpointing stage to host memory the same way.
"""

from __future__ import annotations

import copy

import torch
from torch.utils import _pytree as pytree


class DeviceSnapshot:
    """One copy of a save's state (model and optimizer) in buffers on the tensors' own devices, reused every save."""

    def __init__(self) -> None:
        self.buffers: dict[str, list] = {}
        self.prepared: dict[tuple, torch.Tensor] = {}  # source tensor's key -> its buffer, made ahead of the first save
        self.prepared_used = 0  # bytes of the buffers in use that were made ahead (all of them, when keys match)

    def prepare(self, tensors) -> list[torch.Tensor]:
        """Make the buffers of ``tensors`` (live weights or optimizer state) now; the first save's copy of a state
        dict whose tensors are these (the same storage and layout) uses them. Returns the buffers."""
        made = []
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or _local(tensor).data_ptr() == 0:
                continue
            key = _key(tensor)
            if key not in self.prepared:
                with torch.no_grad():
                    self.prepared[key] = torch.empty_like(tensor.detach())
            made.append(self.prepared[key])
        return made

    @property
    def bytes(self) -> int:
        return sum(_nbytes(b) for buffers in self.buffers.values() for b in buffers if b is not None)

    def copy(self, kind: str, state_dict: dict) -> dict:
        """``state_dict`` with every tensor replaced by its copy in this snapshot's buffers for ``kind`` ("model",
        "optim"); other values are copied (an optimizer's hyperparameters change while the save waits)."""
        leaves, spec = pytree.tree_flatten(state_dict)
        buffers = self.buffers.get(kind)
        if buffers is None or len(buffers) != len(leaves) or not all(map(_fits, buffers, leaves)):
            buffers = self.buffers[kind] = [self._buffer(leaf) for leaf in leaves]
        copied = []
        devices = set()
        with torch.no_grad():
            for leaf, buffer in zip(leaves, buffers):
                if isinstance(leaf, torch.Tensor):
                    buffer.copy_(leaf, non_blocking=True)
                    copied.append(buffer)
                    devices.add(_local(leaf).device)
                else:
                    copied.append(copy.deepcopy(leaf))
        for device in devices:
            if device.type == "cuda":
                # DCP's stager copies to host memory on a stream of its own, from another thread: the copies queued
                # here on the training stream are finished first (milliseconds)
                torch.cuda.current_stream(device).synchronize()
        return pytree.tree_unflatten(copied, spec)

    def _buffer(self, leaf):
        if not isinstance(leaf, torch.Tensor):
            return None
        prepared = self.prepared.pop(_key(leaf), None) if _local(leaf).data_ptr() else None
        if prepared is not None and _fits(prepared, leaf):
            self.prepared_used += _nbytes(prepared)
            return prepared
        with torch.no_grad():
            return torch.empty_like(leaf.detach())


def _key(tensor: torch.Tensor) -> tuple:
    """A tensor's identity as the state dicts hand it over: where its data is, and its layout."""
    local = _local(tensor)
    return (local.device, local.data_ptr(), tuple(local.shape), local.stride(), local.dtype)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank


def _nbytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def _fits(buffer, leaf) -> bool:
    """Whether ``buffer`` can hold ``leaf`` (the same shape, dtype, device and, for a DTensor, placement)."""
    if not isinstance(leaf, torch.Tensor):
        return buffer is None
    if not isinstance(buffer, torch.Tensor):
        return False
    same = buffer.shape == leaf.shape and buffer.dtype == leaf.dtype and _local(buffer).device == _local(leaf).device
    placements = getattr(leaf, "placements", None)
    return same and placements == getattr(buffer, "placements", None)
