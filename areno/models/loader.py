"""Hugging Face checkpoint -> areno model: resolve the folder, read the config, build on the meta device, shard,
and copy each weight slice from safetensors straight into its parameter on the target device.

Peak memory is the model shard plus one tensor slice in host memory; no full second copy of the model exists. With
``quantize_base="nf4"`` (QLoRA) the projections ``qlora.quantizable`` names are quantised as they load: each weight is
made on the device just before its slices are copied and NF4-quantised (its full-precision tensor freed) right after,
so the device holds the NF4 model, the parts kept in ``dtype`` and one projection's weight (and its
quantisation's scratch) at a time.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from areno.models.registry import get_adapter
from areno.models.tp import apply_tp_plan, layout, pieces, register_grad_hooks

HUB_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "merges.txt", "vocab*"]
IGNORED_KEYS = ("rotary_emb.inv_freq",)


def resolve_model_path(path_or_repo_id: str | os.PathLike) -> Path:
    """A local folder as is; otherwise a Hugging Face repo id resolved through huggingface_hub (cache when offline)."""
    text = str(path_or_repo_id)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.exists() or text.startswith(("/", ".", "~")) or text.count("/") > 1:
        raise FileNotFoundError(f"model path {text!r} is not a folder (expected config.json and *.safetensors in it)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=text, allow_patterns=HUB_PATTERNS))
    except Exception as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        raise FileNotFoundError(
            f"could not resolve model {text!r}: it is not a local folder, and the Hugging Face Hub repo id could not "
            f"be resolved{' (HF_HUB_OFFLINE is set: only ids already in the local cache resolve)' if offline else ''}"
            f" [{type(e).__name__}: {' '.join(str(e).split())}]. Pass a local folder holding config.json and "
            f"*.safetensors instead."
        ) from e


def check_model_source(flag: str, value) -> Path:
    """``resolve_model_path`` for a CLI flag: the folder, or a ``ConfigError`` naming ``flag`` in one line."""
    from areno.config import ConfigError

    try:
        path = resolve_model_path(value)
    except FileNotFoundError as e:
        message = str(e).replace(f"model path {str(value)!r}", f"{str(value)!r}")
        if message.endswith(" instead."):  # the example names the flag at fault (--ckpt, --ref-ckpt, --model-path)
            message = f"{message[:-1]}, e.g. {flag} /path/to/model"
        raise ConfigError(flag, message) from None
    if not (path / "config.json").is_file():
        raise ConfigError(flag, f"{value!r} is a folder without config.json: not a Hugging Face model folder")
    check_model_config(flag, path)
    return path


def check_engine_support(flag: str, value) -> None:
    """A ``ConfigError`` naming ``flag`` when the local checkpoint's adapter says the rollout engine cannot run it
    (``model_class.engine_support``: the reason). Hub ids are checked when the engine loads them."""
    from areno.config import ConfigError

    folder = Path(str(value)).expanduser()
    if not (folder / "config.json").is_file():
        return
    model_type = check_model_config(flag, folder).get("model_type")
    reason = get_adapter(model_type).model_class.engine_support
    if reason:
        raise ConfigError(flag, f"{str(value)!r} is a {model_type} checkpoint: {reason}")


MTP_COUNT_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")


def check_mtp_support(flag: str, value) -> None:
    """A ``ConfigError`` naming ``flag`` (``--speculative-tokens``) when the local checkpoint has no MTP layers the
    engine can draft with (its config.json counts none, or its family runs none). Hub ids are checked at load."""
    from areno.config import ConfigError

    folder = Path(str(value)).expanduser()
    if not (folder / "config.json").is_file():
        return
    raw = check_model_config(flag, folder)
    model_type = raw.get("model_type")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    count = max(int(c.get(k) or 0) for c in (raw, text) for k in MTP_COUNT_KEYS)
    if not count or not hasattr(get_adapter(model_type).model_class, "mtp_draft_parts"):
        raise ConfigError(flag, f"needs a model with MTP (multi-token-prediction) layers: {str(value)!r} is a "
                          f"{model_type} checkpoint without them")


def check_model_config(flag: str, folder) -> dict:
    """The checkpoint's config.json, or a ``ConfigError`` naming ``flag`` and the file in one line: not JSON, not
    an object, no ``model_type``, or an architecture no adapter knows. Cheap: nothing but the file is read."""
    from areno.config import ConfigError

    try:
        raw = read_config(Path(folder))
        if "model_type" not in raw:
            raise CheckpointError(f"{Path(folder) / 'config.json'} has no model_type")
        get_adapter(raw["model_type"])
    except (OSError, ValueError) as e:
        raise ConfigError(flag, f"{str(folder)!r} cannot be loaded: {e}") from None
    return raw


class CheckpointError(ValueError):
    """A model folder that cannot be loaded as it is (config.json unreadable, weights cut short or corrupt, weights
    that do not match the config); the message names the file and says what is wrong, in one line."""


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; is it a Hugging Face model folder?")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} holds a JSON {type(raw).__name__}, not an object")
    return raw


def resolve_dtype(dtype, raw_config: dict, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or raw_config.get("dtype") or raw_config.get("torch_dtype")
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    result = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(result, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (use float32, bfloat16 or float16)")
    return result


class SafetensorsFiles:
    """The tensors of a folder's safetensors files (sharded with an index, or not), opened lazily."""

    def __init__(self, path: Path, stack: ExitStack):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"{path} holds no *.safetensors files")
        self.handles = {}
        for f in files:
            try:
                self.handles[f] = stack.enter_context(safe_open(str(path / f), framework="pt", device="cpu"))
            except FileNotFoundError:
                raise FileNotFoundError(f"{path / f} is missing (named by {index.name})") from None
            except Exception as e:  # noqa: BLE001 - safetensors' own error type: a cut or corrupt file
                raise CheckpointError(f"{path / f} is not a readable safetensors file (cut short or corrupt?): "
                                      f"{' '.join(str(e).split())}") from None
        self.path = path
        if weight_map is None:
            weight_map = {k: f for f, h in self.handles.items() for k in h.keys()}
        self.weight_map = weight_map

    def keys(self):
        return self.weight_map.keys()

    def read(self, name: str, index: tuple) -> torch.Tensor:
        return self.handles[self.weight_map[name]].get_slice(name)[index]

    def shape(self, name: str) -> tuple:
        return tuple(self.handles[self.weight_map[name]].get_slice(name).get_shape())


class TensorDict:
    """In-memory full Hugging Face tensors (e.g. weight sync from a trainer) with the same interface."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def keys(self):
        return self.tensors.keys()

    def read(self, name: str, index: tuple) -> torch.Tensor:
        return self.tensors[name][index]

    def shape(self, name: str) -> tuple:
        return tuple(self.tensors[name].shape)


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device, skip=()) -> None:
    """Replace every (meta) parameter but those named in ``skip`` by an uninitialised one on ``device``; buffers are
    made by ``init_buffers``."""
    for mname, module in model.named_modules():
        for name, _ in list(module.named_parameters(recurse=False)):
            if (f"{mname}.{name}" if mname else name) not in skip:
                make_parameter(module, name, dtype, device)


def make_parameter(module: nn.Module, name: str, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """``module.<name>`` replaced by an uninitialised parameter of its shape on ``device`` (in ``dtype``, or fp32 if
    the module keeps it so: routers, decay parameters); returns it."""
    p = module._parameters[name]
    fp32 = getattr(module, "fp32_params", ())
    new = nn.Parameter(torch.empty(p.shape, dtype=torch.float32 if name in fp32 else dtype, device=device),
                       requires_grad=p.requires_grad)
    setattr(module, name, new)
    return new


@contextmanager
def _made_then(module: nn.Module, name: str, dtype, device, then):
    """``module.<name>`` made on ``device`` for the block (``make_parameter``), ``then()`` run on leaving it."""
    yield make_parameter(module, name, dtype, device)
    then()


def nf4_on_load(model: nn.Module, dtype: torch.dtype, device: torch.device) -> dict:
    """``load_hf_weights``' ``deferred`` for QLoRA: the weight of every projection ``qlora.quantizable`` names (what
    is not built is refused there, before any weight is read), made when its slices are about to be copied and
    NF4-quantised once they are (``Linear.quantize_nf4_``, which frees it)."""
    from areno.models.qlora import quantizable

    modules = dict(model.named_modules())
    return {f"{n}.weight": _made_then(modules[n], "weight", dtype, device, modules[n].quantize_nf4_)
            for n in quantizable(model)}


@torch.no_grad()
def load_hf_weights(model: nn.Module, source, deferred: dict | None = None) -> None:
    """Copy this rank's slice of every Hugging Face tensor in ``source`` into the model's parameters.

    ``source`` is a ``SafetensorsFiles``, a ``TensorDict`` or a plain ``{hf_name: full tensor}`` dict.
    Every parameter must be covered; unknown tensors are an error (except ignorable buffers and a tied LM head).
    ``deferred``: ``{parameter name: context manager}`` for parameters ``materialize`` skipped (``nf4_on_load``'s);
    each is entered just before that parameter's slices are copied (it gives the tensor to fill) and left right
    after, one at a time.
    """
    if isinstance(source, dict):
        source = TensorDict(source)
    params = dict(model.named_parameters())
    available = set(source.keys())
    expected, missing = set(), []
    for pname, lays in model._tp_layouts.items():
        with (deferred or {}).get(pname) or nullcontext(params[pname]) as param:
            for pc in pieces(lays, model.tp_rank, model.tp_size):
                expected.add(pc.hf_name)
                if pc.hf_name not in available:
                    missing.append(pc.hf_name)
                    continue
                _copy_piece(param[pc.dst], source, pc)
        del param  # a deferred tensor (quantised on leaving) is not kept alive past its block
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:5]} (does "
                       "config.json match the weights?)")
    for name in sorted(available - expected):  # tensors an adapter holds untouched (e.g. MTP layers)
        if model.keep_hf_tensor(name):
            tensor = source.read(name, (...,)).to(model.embed_tokens.weight.device)
            pname = model.add_hf_tensor(name, tensor)
            rows = tensor.shape[0] if tensor.dim() else 1  # a 0-d tensor: one part of shape ()
            model._tp_layouts[pname] = [layout(tuple(tensor.shape), 0, [(name, rows)])]
            expected.add(name)
    extra = [
        k
        for k in available - expected
        if not k.endswith(IGNORED_KEYS) and not (k == "lm_head.weight" and model.config.tie_word_embeddings)
    ]
    if extra:
        raise KeyError(f"checkpoint has {len(extra)} tensors the {model.config.model_type} adapter does not use, e.g. "
                       f"{sorted(extra)[:5]}")  # fmt: skip


def _copy_piece(dst: torch.Tensor, source, pc) -> None:
    """One slice of a checkpoint tensor into its parameter; a slice of the wrong shape (weights made for another
    config) or an unreadable one is a ``CheckpointError`` naming the tensor."""
    where = getattr(source, "path", None) or "the checkpoint"
    try:
        full = tuple(source.shape(pc.hf_name)) if hasattr(source, "shape") else None
        src = source.read(pc.hf_name, pc.src)
    except Exception as e:  # noqa: BLE001 - safetensors' own error type: a truncated file reads short here
        raise CheckpointError(f"tensor {pc.hf_name} of {where} cannot be read (cut short or corrupt?): "
                              f"{' '.join(str(e).split())}") from None
    have, need = (full, tuple(pc.hf_shape)) if full is not None else (tuple(src.shape), tuple(dst.shape))
    if have != need:  # the whole tensor: a slice of a larger one would fit and load silently wrong
        raise CheckpointError(f"tensor {pc.hf_name} of {where} has shape {list(have)} where the model built from "
                              f"config.json needs {list(need)}: config.json does not match the weights")
    dst.copy_(src)


def meta_model(path_or_repo_id, *, attn_backend: str = "flash", tp_group=None):
    """``(model on the meta device, TP plan applied; config.json's dict, its folder)``: the structure without the
    weights (cheap at any size)."""
    path = resolve_model_path(path_or_repo_id)
    raw = read_config(path)
    if "model_type" not in raw:
        raise CheckpointError(f"{path / 'config.json'} has no model_type")
    adapter = get_adapter(raw["model_type"])
    if adapter.check_config is not None:
        adapter.check_config(raw)
    from transformers import AutoConfig

    try:
        cfg = adapter.config_from_hf(AutoConfig.from_pretrained(str(path)))
    except Exception as e:  # noqa: BLE001 - transformers/huggingface_hub validation: a field missing or mistyped
        raise CheckpointError(f"{path / 'config.json'} cannot be read as a {raw['model_type']} config: "
                              f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    with torch.device("meta"):
        model = adapter.model_class(cfg, attn_backend=attn_backend)
    apply_tp_plan(model, tp_group)
    return model, raw, path


def load_model(path_or_repo_id, *, dtype=None, device=None, tp_group=None, attn_backend=None, quantize_base=None):
    """Build an areno model from a Hugging Face folder or repo id (see the module docstring); returned in eval mode.
    ``quantize_base="nf4"``: QLoRA's projections quantised as they load (``nf4_on_load``), the same bytes as
    ``qlora.quantize_base`` after a plain load; ``None``/``"none"``: every weight in ``dtype``."""
    if quantize_base not in (None, "none", "nf4"):
        raise ValueError(f"quantize_base must be None, 'none' or 'nf4', got {quantize_base!r}")
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if attn_backend is None:  # --attn-backend not given: on a GPU, what scripts/install.sh recorded (else detected)
        from areno.platform import default_attn_backend

        attn_backend = default_attn_backend() if device.type == "cuda" else "flash"  # CPU: kernel dispatch decides
    model, raw, path = meta_model(path_or_repo_id, attn_backend=attn_backend, tp_group=tp_group)
    dtype = resolve_dtype(dtype, raw, device)
    deferred = nf4_on_load(model, dtype, device) if quantize_base == "nf4" else {}
    materialize(model, dtype, device, skip=deferred)
    with ExitStack() as stack:
        load_hf_weights(model, model.checkpoint_source(SafetensorsFiles(path, stack)), deferred=deferred)
    model.init_buffers(device)
    register_grad_hooks(model)
    model.hf_config, model.source_dir, model.name_or_path = raw, path, str(path_or_repo_id)
    return model.eval()


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_tokenizer(path_or_repo_id):
    """The checkpoint's tokenizer (``AutoTokenizer``, local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model_path(path_or_repo_id)), local_files_only=True)
