"""A stage's tensors read out of a whole model's weights, and nothing else.

A source is a whole model's ``{name: tensor}`` (a state dict), or safetensors: one file, or a folder of
them (transformers' ``model.safetensors.index.json`` names each tensor's file; without one every
``*.safetensors`` of the folder is read for its names). ``TensorSource`` opens safetensors files with
``safe_open``, which reads a file's header only; a tensor is read when it is asked for, row block by row
block (``get_slice``), straight into the stage's parameter, so host memory for a stage is its own bytes
plus one block of ``BLOCK_BYTES``.

``load_stage_weights(stage, source)`` fills every parameter and persistent buffer of ``stage`` by its
global name. A stage may map a name to the whole model's (``stage.weight_ref(name)`` -> ``WeightRef``:
dynmb's head shards are rows of ``lm_head.weight``, pieces of a half-block a cut of the whole weight,
``dynmb.models.pieces``); transformers stages use transformers' names as they are. Values are cast to
the parameter's dtype. A missing tensor or a shape that differs is one ``ValueError`` naming the
tensor and the source.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

__all__ = ["WeightRef", "TensorSource", "load_stage_weights", "BLOCK_BYTES"]

BLOCK_BYTES = 16 * 2**20
"""Bytes of the rows read from a safetensors file at a time."""


@dataclass(frozen=True)
class WeightRef:
    """Where a stage's tensor lives in the whole model: ``name``, optionally its ``rows`` only, or
    ``cut(whole tensor)`` (a piece of a half-block)."""

    name: str
    rows: range | None = None
    cut: Callable[[torch.Tensor], torch.Tensor] | None = None


class TensorSource:
    """A whole model's tensors by name: a mapping, or safetensors file(s) opened lazily (module docstring).
    Use as a context manager (closes the files)."""

    def __init__(self, weights: Mapping[str, torch.Tensor] | str | Path) -> None:
        self._stack = contextlib.ExitStack()
        self.label = "the state dict"
        self._mapping: Mapping[str, torch.Tensor] | None = None
        self._files: dict[str, Any] = {}
        if isinstance(weights, Mapping):
            self._mapping = weights
        else:
            self.label = str(weights)
            self._open(Path(weights))

    def _open(self, path: Path) -> None:
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()}) \
                if index.exists() else sorted(path.glob("*.safetensors"))
        elif path.is_file():
            files = [path]
        else:
            raise ValueError(f"weights {path}: no such file or folder")
        if not files:
            raise ValueError(f"weights {path}: the folder holds no .safetensors file")
        try:
            from safetensors import safe_open
        except ImportError:
            raise ValueError(f"weights {path}: reading .safetensors needs the safetensors package "
                             "(pip install safetensors, or the [hf] extra)") from None
        for file in files:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            self._files.update({name: handle for name in handle.keys()})

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in (self._mapping if self._mapping is not None else self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._mapping is not None:
            return tuple(self._mapping[name].shape)
        return tuple(self._files[name].get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor (read at once)."""
        return self._mapping[name] if self._mapping is not None else self._files[name].get_tensor(name)

    def blocks(self, name: str, rows: range) -> Iterator[tuple[int, torch.Tensor]]:
        """``(offset into rows, tensor of those rows)`` over ``rows`` of tensor ``name``, a block at a time."""
        if self._mapping is not None:
            yield 0, self._mapping[name][rows.start:rows.stop]
            return
        sl = self._files[name].get_slice(name)
        shape = sl.get_shape()
        row_bytes = max(1, int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1) * 4
        step = max(1, BLOCK_BYTES // row_bytes)
        for lo in range(rows.start, rows.stop, step):
            yield lo - rows.start, sl[lo:min(lo + step, rows.stop)]


def _ref(stage: nn.Module, name: str) -> WeightRef:
    ref = getattr(stage, "weight_ref", None)
    return ref(name) if callable(ref) else WeightRef(name)


@torch.no_grad()
def _fill(dst: torch.Tensor, name: str, ref: WeightRef, source: TensorSource) -> None:
    if ref.name not in source:
        raise ValueError(f"weights {source.label}: no tensor {ref.name!r} (for the stage's {name!r})")
    if ref.cut is not None:
        dst.copy_(ref.cut(source.tensor(ref.name)))
        return
    shape = source.shape(ref.name)
    rows = ref.rows if ref.rows is not None else range(shape[0] if shape else 0)
    want = ((len(rows),) + tuple(shape[1:])) if shape else ()
    if tuple(dst.shape) != want:
        raise ValueError(f"weights {source.label}: {ref.name!r} of shape {list(shape)} does not fit the stage's "
                         f"{name!r} of shape {list(dst.shape)}")
    if not shape:
        dst.copy_(source.tensor(ref.name))
        return
    for at, block in source.blocks(ref.name, rows):
        dst[at:at + block.shape[0]].copy_(block)


def load_stage_weights(stage: nn.Module, weights: Mapping[str, torch.Tensor] | str | Path,
                       names: set[str] | None = None) -> None:
    """Fill ``stage``'s parameters and persistent buffers (those of ``names`` only, when given) from
    ``weights`` (module docstring)."""
    with TensorSource(weights) as source:
        for name, t in stage.state_dict(keep_vars=True).items():
            if names is None or name in names:
                _fill(t, name, _ref(stage, name), source)
