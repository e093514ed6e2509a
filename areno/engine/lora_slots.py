"""The engine's LoRA adapter slots (serving many adapters at once): ``max_loras`` slots of rank ``max_rank`` stacked per
adapted projection, PEFT adapters loaded into them by name, and forward hooks that add each token row's adapter delta
(``areno.kernels.lora``) to the projections' outputs.

Every linear projection PEFT's ``all-linear`` names (``areno.models.lora.linear_sites``) gets stacked weights ``A [L, R,
in]`` and ``B [L, rows, R]`` in the model's dtype (zeros: an adapter that leaves a module out adds nothing there; a
lower rank is zero-padded). A step sets ``index`` (int32, one slot per token row, -1: the base model) before the
forward; under CUDA graphs it is one of the graph's static inputs. Each load gets a fresh ``key`` (never reused), the
salt of its sequences' prefix-cache hashes, so K/V computed with one adapter never serve another (nor a reloaded
one). Not built: tensor parallelism (adapters sharded with their layers), MoE experts, MLA's absorbed ``kv_b_proj``.
"""

from __future__ import annotations

import itertools
import weakref
from pathlib import Path

import torch

from areno.kernels.lora import lora_add
from areno.models.lora import PREFIX, WEIGHTS_FILE, LoraError, linear_sites, read_peft_config

_load_keys = itertools.count(1)


class LoraSlots:
    def __init__(self, model, max_loras: int, max_rank: int, *, device=None, dtype=None):
        if getattr(model, "tp_size", 1) > 1 or getattr(model, "tp_group", None) is not None:
            raise LoraError("--max-loras", "serving LoRA adapters with --tp-size > 1 is not built yet")
        if max_loras < 1 or max_rank < 1:
            raise LoraError("--max-loras", f"needs --max-loras >= 1 and --max-lora-rank >= 1, got {max_loras} and "
                                           f"{max_rank}")
        w = next(model.parameters())
        device, dtype = device or w.device, dtype or w.dtype
        self.model_type = model.config.model_type
        self.max_loras, self.max_rank = max_loras, max_rank
        self.sites = [s for s in linear_sites(model) if not s.hf_module.endswith("kv_b_proj")]
        self.site_of = {s.hf_module: i for i, s in enumerate(self.sites)}
        self.a = [torch.zeros(max_loras, max_rank, s.in_features, dtype=dtype, device=device) for s in self.sites]
        self.b = [torch.zeros(max_loras, s.rows, max_rank, dtype=dtype, device=device) for s in self.sites]
        self.scale = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.names: dict[str, int] = {}  # loaded adapter -> its slot
        self.keys = [0] * max_loras  # the slot's current load key (prefix-cache salt)
        self.index: torch.Tensor | None = None  # this step's slot per token row; None: no row has an adapter
        # the sequences that use a slot: a load never takes the slot of one still running with an unloaded adapter
        self._seqs: weakref.WeakSet = weakref.WeakSet()
        self._handles = []
        self._hook(model)

    # ---- the forward ---------------------------------------------------------------------------------------
    def _hook(self, model) -> None:
        by_module: dict[str, list[int]] = {}
        for i, s in enumerate(self.sites):
            by_module.setdefault(s.module, []).append(i)
        modules = dict(model.named_modules())
        for name, sites in by_module.items():
            self._handles.append(modules[name].register_forward_hook(self._add_deltas(sites)))

    def _add_deltas(self, sites: list[int]):
        def hook(module, args, out):
            idx = self.index
            if idx is None:
                return out
            x = args[0].reshape(-1, args[0].shape[-1])
            x = x if x.stride(-1) == 1 else x.contiguous()  # the kernel's layout (never the host-syncing fallback)
            y = out.view(-1, out.shape[-1])
            for i in sites:
                s = self.sites[i]
                lora_add(y[:, s.offset : s.offset + s.rows], x, self.a[i], self.b[i], self.scale, idx)
            return out

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- adapters ------------------------------------------------------------------------------------------
    def slot_of(self, name: str) -> int:
        if name not in self.names:
            raise ValueError(f"the LoRA adapter {name!r} is not loaded")
        return self.names[name]

    def attach(self, seqs, name: str) -> None:
        """A request's samples generate with adapter ``name``: its slot, and its load's prefix-cache key."""
        slot = self.slot_of(name)
        for seq in seqs:
            seq.lora_slot, seq.lora_key = slot, self.keys[slot]
            self._seqs.add(seq)

    def load(self, name: str, path) -> int:
        """Load the PEFT adapter folder ``path`` as ``name`` into a free slot (none that a live sequence uses);
        requests then pick it by name (``SamplingParams.lora``). A ``LoraError`` (a ValueError) naming the adapter
        when it cannot be served."""
        if name in self.names:
            raise LoraError(name, "an adapter of this name is already loaded")
        spec = read_peft_config(path, field=name)
        if spec.rank > self.max_rank:
            raise LoraError(name, f"rank {spec.rank} is over --max-lora-rank {self.max_rank}")
        pairs = self._read_pairs(name, Path(path).expanduser(), spec.rank)
        taken = set(self.names.values()) | {s.lora_slot for s in self._seqs if not s.is_finished}
        free = [s for s in range(self.max_loras) if s not in taken]
        if not free:
            raise LoraError(name, f"all {self.max_loras} --max-loras slots hold adapters (or requests still use "
                                  "them); unload one first")
        slot = free[0]
        with torch.no_grad():
            for i in range(len(self.sites)):
                self.a[i][slot].zero_()
                self.b[i][slot].zero_()
            for i, (a, b) in pairs.items():
                self.a[i][slot, : spec.rank].copy_(a)
                self.b[i][slot, :, : spec.rank].copy_(b)
            self.scale[slot] = spec.scaling
        self.names[name] = slot
        self.keys[slot] = next(_load_keys)
        return slot

    def _read_pairs(self, name: str, folder: Path, rank: int) -> dict[int, tuple]:
        """{site: (A [r, in], B [rows, r])} of the adapter's tensors, every shape checked against the served model."""
        from safetensors.torch import load_file

        path = folder / WEIGHTS_FILE
        if not path.is_file():
            raise LoraError(name, f"{path} does not exist")
        found: dict[str, dict] = {}
        for key, t in load_file(str(path)).items():
            key = key.replace(".default.weight", ".weight")
            for part in ("lora_A", "lora_B"):
                tail = f".{part}.weight"
                if key.startswith(PREFIX) and key.endswith(tail):
                    found.setdefault(key[len(PREFIX) : -len(tail)], {})[part] = t
                    break
            else:
                raise LoraError(name, f"{path}: tensor {key} is not a LoRA A/B weight")
        pairs = {}
        for module, ab in found.items():
            if module not in self.site_of and (".experts." in module + "." or module.endswith("kv_b_proj")):
                raise LoraError(name, f"{module}: serving LoRA on MoE experts or MLA's kv_b_proj (absorbed into the "
                                      "decode kernel) is not built yet")
            if module not in self.site_of:
                raise LoraError(name, f"{module} is no linear module of the served {self.model_type} model that "
                                      "adapters can target (an adapter of another base model?)")
            if set(ab) != {"lora_A", "lora_B"}:
                raise LoraError(name, f"{path}: {module} lacks its lora_A or lora_B weight")
            s = self.sites[self.site_of[module]]
            a, b = ab["lora_A"], ab["lora_B"]
            if tuple(a.shape) != (rank, s.in_features) or tuple(b.shape) != (s.rows, rank):
                raise LoraError(name, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                                      f"served model's ({rank}, {s.in_features}) and ({s.rows}, {rank}): an adapter "
                                      "of another base model")
            pairs[self.site_of[module]] = (a, b)
        if not pairs:
            raise LoraError(name, f"{path} holds no LoRA weights")
        return pairs

    def unload(self, name: str) -> None:
        """Free ``name``'s slot for a later load (sequences already running with it keep it until they end: a load
        never takes a slot in use)."""
        self.slot_of(name)
        del self.names[name]


def slots_of(engine, adapter: str) -> LoraSlots:
    """The engine's LoRA slots; a ValueError naming ``adapter`` when it has none (max_loras 0)."""
    if engine.lora is None:
        raise ValueError(f"the LoRA adapter {adapter!r} is not loaded (this engine has no LoRA slots)")
    return engine.lora
