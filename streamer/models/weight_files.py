"""A checkpoint's weight files: safetensors (sharded with an index, or not) and, for checkpoints that only ship them,
PyTorch's `pytorch_model*.bin` (older ones: OPT, Galactica, Dolly v2, many fine-tunes; PEFT's `adapter_model.bin`;
sentence-transformers' Dense modules).

`.bin` files are read with `torch.load(weights_only=True)`: the unpickler builds tensors and plain containers only,
so no code from the file runs (a file that asks for anything else is refused), and with `mmap=True` tensors are paged
in as they are read, not all at once. `open_weights` gives both kinds behind safetensors' `safe_open` interface (keys,
get_tensor, get_slice(...).get_shape()), so the loader reads either the same way.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from safetensors import safe_open

FORMATS = ("auto", "safetensors", "pt", "dummy")  # (EngineConfig.load_format)


def weight_files(folder: Path, load_format: str = "auto") -> list[Path]:
    """The folder's weight files in load order: its safetensors (those its index lists, or all), or with none of
    those (or load_format "pt") its pytorch_model*.bin shards (likewise)."""
    if load_format != "pt":
        files = _listed(folder, "model.safetensors.index.json") or _safetensors(folder)
        if files or load_format == "safetensors":
            return _existing(folder, files, "*.safetensors")
    files = _listed(folder, "pytorch_model.bin.index.json") or sorted(folder.glob("pytorch_model*.bin"))
    return _existing(folder, files, "*.safetensors or pytorch_model*.bin" if load_format == "auto"
                     else "pytorch_model*.bin")


def _safetensors(folder: Path) -> list[Path]:
    """The folder's safetensors files, less Mistral-format `consolidated*` copies of the same weights (repos that ship
    both formats; a Mistral-format folder reads those through streamer/tokenizer/mistral_format.py)."""
    files = sorted(folder.glob("*.safetensors"))
    ours = [f for f in files if not f.name.startswith("consolidated")]
    return ours or files


def _listed(folder: Path, index_name: str) -> list[Path]:
    index = folder / index_name
    if not index.is_file():
        return []
    with open(index) as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    files = [folder / name for name in sorted(set(weight_map.values()))]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
    return files


def _existing(folder: Path, files: list[Path], what: str) -> list[Path]:
    if not files:
        raise FileNotFoundError(f"no {what} weights found in model folder {folder} "
                                f"(use load_format='dummy' for random weights)")
    return files


@functools.lru_cache(maxsize=2)
def _pt_state(path: str, mtime_ns: int) -> dict[str, torch.Tensor]:
    """A .bin file's tensors by name (memory-mapped where the file's format allows: the zip format since torch 1.6;
    an older file is read whole). Cached for the loader's repeated reads of one shard."""
    del mtime_ns  # (part of the cache key only: a rewritten file is read again)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # (pickle.UnpicklingError and friends: a file that is not plain tensors)
        raise ValueError(f"{path}: not a weights-only PyTorch checkpoint, refused ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ValueError(f"{path}: expected a dict of tensors (a state dict)")
    return state


class _Shape:
    def __init__(self, shape: torch.Size) -> None:
        self.shape = list(shape)

    def get_shape(self) -> list[int]:
        return self.shape


class _PtFile:
    """A .bin file behind safe_open's interface."""

    def __init__(self, path: Path) -> None:
        self.state = _pt_state(str(path), path.stat().st_mtime_ns)

    def __enter__(self) -> "_PtFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self.state)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.state[name]

    def get_slice(self, name: str) -> _Shape:
        return _Shape(self.state[name].shape)


def open_weights(path: Path) -> Any:
    """safe_open(path) for a .safetensors file, its stand-in for a .bin one (a context manager either way)."""
    if path.suffix == ".safetensors":
        return safe_open(str(path), framework="pt", device="cpu")
    return _PtFile(path)


def iter_weights(files: list[Path], skip: Optional[Callable[[str], bool]] = None,
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files, by name, read as it is reached; `skip(name)` true: left unread (another
    expert-parallel rank's expert)."""
    try:
        for path in files:
            with open_weights(path) as f:
                for name in f.keys():
                    if skip is None or not skip(name):
                        yield name, f.get_tensor(name)
    finally:
        _pt_state.cache_clear()  # (the last .bin shards' mappings are not kept once the model has its copies)


def tensor_names(path: Path) -> list[str]:
    with open_weights(path) as f:
        return list(f.keys())


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A small file's tensors, all of them (a LoRA adapter's, a Dense module's)."""
    with open_weights(path) as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def first_existing(folder: Path, *names: str) -> Path:
    """The first of these files the folder holds (e.g. adapter_model.safetensors, then adapter_model.bin)."""
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{folder} holds none of {', '.join(names)}")
