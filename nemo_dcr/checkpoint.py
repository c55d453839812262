"""The canonical checkpoint: a folder of Hugging Face safetensors files."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from nemo_dcr.dtypes import from_name


def local_checkpoint(model: str | os.PathLike, *, revision: str | None = None,
                     cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of safetensors files that `model` names: a folder itself, or a Hugging
    Face hub id already downloaded into the local cache (`cache_dir`: a cache other than
    the default one, e.g. vLLM's `download_dir`), as a serving runtime or NeMo RL that
    loaded it left it; nothing is downloaded."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), revision=revision, cache_dir=cache_dir,
                                      allow_patterns=["*.json", "*.safetensors"], local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any miss is the same problem for the user
        raise FileNotFoundError(f"NeMo-DCR: {str(model)!r} is neither a checkpoint folder nor in the local Hugging "
                                f"Face cache ({type(e).__name__}: {e})") from None


def safetensors_files(directory: str | os.PathLike) -> list[Path]:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    return files


def read_specs(directory: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Canonical tensor name -> (dtype name, shape), from the safetensors headers only."""
    specs = {}
    for path in safetensors_files(directory):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            from_name(entry["dtype"])  # rejects dtypes we do not know
            if name in specs:
                raise ValueError(f"tensor {name!r} appears in more than one file of {directory}")
            specs[name] = (entry["dtype"], tuple(int(s) for s in entry["shape"]))
    return specs


class CheckpointReader:
    """Reads canonical tensors by name (memory-mapped by safetensors)."""

    def __init__(self, directory: str | os.PathLike):
        self._where: dict[str, Path] = {}
        for path in safetensors_files(directory):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    self._where[name] = path

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(self, name: str) -> torch.Tensor:
        try:
            path = self._where[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the checkpoint") from None
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: self.get(n) for n in self.names()}
