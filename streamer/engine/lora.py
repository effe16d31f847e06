"""LoRA adapters on the host: reading PEFT checkpoints, and lending the model's adapter slots to requests.

An adapter is a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`, or older PEFT's .bin),
registered under a name (`LLMEngine.add_lora`, `--lora-modules name=path`). The model holds `max_loras` adapters at once, in
slots (streamer/models/lora.py); `LoRASlots` lends them to running requests: a request is admitted only
once its adapter has a slot (it waits otherwise, while requests behind it go ahead), and a slot no running
request uses may be given to another adapter, least recently used first. Loading an adapter into its slot
is queued with the step that first needs it (`StepInputs.lora_loads`), so the copy lands on the device in
order with the steps before it.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

_uids = itertools.count(1)

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # (older PEFT versions write .bin)


@dataclass(frozen=True, init=False)
class LoRARequest:
    """An adapter a request runs with: `name` (as clients will call it) and the PEFT folder `path`.
    `LoRARequest(name, path)`, or vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)` (its integer id is not
    needed here: adapters are told apart by name) and its keyword names."""

    name: str
    path: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = {"lora_name": "name", "lora_path": "path"}
        kwargs = {names.get(k, k): v for k, v in kwargs.items() if k != "lora_int_id"}
        if len(args) == 3 and isinstance(args[1], int) and not isinstance(args[1], bool):
            args = (args[0], args[2])  # (vLLM's order: name, id, path)
        fields_ = dict(zip(("name", "path"), args))
        if len(args) > 2 or set(fields_) & set(kwargs) or set(kwargs) - {"name", "path"}:
            raise TypeError("LoRARequest(name, path) or LoRARequest(lora_name, lora_int_id, lora_path)")
        fields_.update(kwargs)
        if set(fields_) != {"name", "path"}:
            raise TypeError("LoRARequest needs a name and a path")
        object.__setattr__(self, "name", fields_["name"])
        object.__setattr__(self, "path", str(fields_["path"]))


@dataclass(eq=False)
class LoRAAdapter:
    """A registered adapter: its PEFT config and, once read, its matrices {module: (A [r, in], B [out, r] * scale)}
    on the host. `uid` is unique to this registration (a re-registered name is another adapter: cached prefixes
    computed with the old weights never match the new)."""

    name: str
    path: Path
    rank: int
    config: dict[str, Any]
    uid: int = field(default_factory=lambda: next(_uids))
    _modules: Optional[dict] = None

    def modules(self, dtype: Any = None) -> dict:
        """The matrices, read from disk on first use (tensor-parallel workers get the adapter without them)."""
        if self._modules is None:
            self._modules = read_matrices(self.path, self.config)
        if dtype is not None:
            return {m: (a.to(dtype), b.to(dtype)) for m, (a, b) in self._modules.items()}
        return self._modules

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_modules"] = None  # workers read the folder themselves
        return state


# (fan_in_fan_out, which PEFT sets for GPT-2's Conv1D layers, is fine: it only transposes merged weights, A and B
# are stored [r, in] and [out, r] either way)
_UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "lora_bias"}


def read_config(path: Path) -> dict[str, Any]:
    cfg_file = path / "adapter_config.json"
    if not path.is_dir():
        raise ValueError(f"LoRA adapter folder not found: {path}")
    if not cfg_file.is_file():
        raise ValueError(f"{path} holds no adapter_config.json (a PEFT LoRA adapter folder is expected)")
    cfg = json.loads(cfg_file.read_text())
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise ValueError(f"{path}: {what} adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{path}: adapters with trained biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{path}: modules_to_save ({cfg['modules_to_save']}) is not supported: an adapter may "
                         "only add low-rank matrices")
    if not any((path / f).is_file() for f in ADAPTER_FILES):
        raise ValueError(f"{path} holds no adapter weights ({' or '.join(ADAPTER_FILES)})")
    return cfg


_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


def read_matrices(path: Path, cfg: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{checkpoint module name (`model.layers.0.self_attn.q_proj`): (A, B scaled by alpha / r)}."""
    from streamer.models.weight_files import first_existing, load_tensors
    tensors = load_tensors(first_existing(path, *ADAPTER_FILES))
    pairs: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{path}: unexpected tensor {key!r} in a LoRA adapter")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: {module!r} has lora_{next(iter(ab))} without its pair")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", r))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        out[module] = (a.float(), b.float() * scale)
    if not out:
        raise ValueError(f"{path}: the adapter holds no LoRA matrices")
    return out


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module overrides (`alpha_pattern`): the first key that matches the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_adapter(name: str, path: str | Path, max_rank: int) -> LoRAAdapter:
    """Read and check an adapter folder (the matrices too: errors surface at registration, not mid-serving)."""
    if not isinstance(name, str) or not name:
        raise ValueError("a LoRA adapter needs a non-empty name")
    folder = Path(path).expanduser()
    cfg = read_config(folder)
    adapter = LoRAAdapter(name, folder, 0, cfg)
    modules = adapter.modules()
    adapter.rank = max(a.shape[0] for a, _ in modules.values())
    if adapter.rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {adapter.rank}, above max_lora_rank {max_rank}")
    return adapter


class LoRASlots:
    """The model's `n` adapter slots (1..n; 0 means none), lent to running requests."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.slot_of: dict[int, int] = {}  # adapter uid -> slot holding it
        self.adapter_in: list[Optional[LoRAAdapter]] = [None] * (n + 1)
        self.users = [0] * (n + 1)  # running requests per slot
        self.idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, n + 1))  # users == 0, LRU first
        self.loads: list[tuple[int, LoRAAdapter]] = []  # (slot, adapter) to copy in before the next step

    def acquire(self, adapter: LoRAAdapter) -> Optional[int]:
        """A slot holding `adapter` for one more running request, or None if every slot is busy."""
        slot = self.slot_of.get(adapter.uid)
        if slot is None:
            if not self.idle:
                return None
            slot = next(iter(self.idle))  # never-used slots first, then the least recently released
            old = self.adapter_in[slot]
            if old is not None:
                del self.slot_of[old.uid]
            self.adapter_in[slot] = adapter
            self.slot_of[adapter.uid] = slot
            self.loads.append((slot, adapter))
        self.idle.pop(slot, None)
        self.users[slot] += 1
        return slot

    def available(self, adapter: LoRAAdapter) -> bool:
        return adapter.uid in self.slot_of or bool(self.idle)

    def release(self, slot: int) -> None:
        if slot <= 0:
            return
        self.users[slot] -= 1
        assert self.users[slot] >= 0, "LoRA slot released more often than acquired"
        if self.users[slot] == 0:
            self.idle[slot] = None  # most recently used: evicted last

    def forget(self, adapter: LoRAAdapter) -> None:
        """An unregistered adapter: its slot (once idle) no longer counts as holding it."""
        slot = self.slot_of.get(adapter.uid)
        if slot is not None and self.users[slot] == 0:
            del self.slot_of[adapter.uid]
            self.adapter_in[slot] = None
            self.idle.move_to_end(slot, last=False)

    def take_loads(self) -> list[tuple[int, LoRAAdapter]]:
        loads, self.loads = self.loads, []
        return loads

    @property
    def active(self) -> list[LoRAAdapter]:
        return [a for s, a in enumerate(self.adapter_in) if a is not None and self.users[s]]


class LoRARegistry(dict):
    """The engine's registered adapters, by name. `check(slot, adapter)` is the model's placement with slot None
    (ValueError if the adapter does not fit the model); `slots` is the scheduler's LoRASlots."""

    def __init__(self, enabled: bool, max_rank: int, check: Callable[[Optional[int], LoRAAdapter], None],
                 slots: Optional[LoRASlots]) -> None:
        super().__init__()
        self.enabled, self.max_rank, self.check, self.slots = enabled, max_rank, check, slots

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise ValueError("LoRA adapters are not enabled: start the engine with enable_lora=True (--enable-lora)")

    def load(self, name: str, path: Union[str, Path]) -> LoRAAdapter:
        """Read an adapter folder and check it against the model; does not register it (the async engine reads
        on a worker thread, then registers on its loop)."""
        self._require_enabled()
        adapter = load_adapter(name, path, self.max_rank)
        self.check(None, adapter)
        return adapter

    def register(self, adapter: LoRAAdapter) -> None:
        if adapter.name in self:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded")
        self[adapter.name] = adapter

    def add(self, name: str, path: Union[str, Path]) -> LoRAAdapter:
        if name in self:  # (before reading the folder for nothing)
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        adapter = self.load(name, path)
        self.register(adapter)
        return adapter

    def remove(self, name: str) -> None:
        """Unregister: new requests can no longer name it; requests already using it finish with it."""
        adapter = self.pop(name, None)
        if adapter is None:
            raise KeyError(f"no LoRA adapter named {name!r}")
        if self.slots is not None:
            self.slots.forget(adapter)

    def resolve(self, lora: Union[str, LoRARequest, LoRAAdapter, None]) -> Optional[LoRAAdapter]:
        """The adapter a request names (a LoRARequest not yet registered is loaded and registered now)."""
        if lora is None or isinstance(lora, LoRAAdapter):
            return lora
        self._require_enabled()
        name = lora if isinstance(lora, str) else lora.name
        adapter = self.get(name)
        if isinstance(lora, str):
            if adapter is None:
                raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {sorted(self) or 'none'})")
            return adapter
        if adapter is None:
            return self.add(lora.name, lora.path)
        if Path(lora.path).expanduser() != adapter.path:
            raise ValueError(f"LoRA adapter {name!r} is already loaded from {adapter.path}, not {lora.path}")
        return adapter
