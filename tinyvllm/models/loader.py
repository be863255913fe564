"""Build the decoder and fill it from a Hugging Face checkpoint (safetensors), or with random weights.

The name map is explicit: every Hugging Face tensor name maps to one of our parameters and, for the
fused projections, the rows it fills. Anything missing, unexpected or mis-shaped is an error that names
the tensor.

Under tensor parallelism a rank's name map also says which slice of each checkpoint tensor it holds
(distributed/shard.py), and the loader reads only that slice from the file (safetensors' `get_slice`).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from tinyvllm.config import ModelConfig
from tinyvllm.distributed.group import TPGroup
from tinyvllm.distributed.shard import ModelShard
from tinyvllm.kernels import Ops
from tinyvllm.models.decoder import CausalLM
from tinyvllm.models.safetensors_reader import byte_view, read_header, read_into
from tinyvllm.quantization.config import QuantizationConfig
from tinyvllm.quantization.fp8 import FP8_DTYPE, quantize_rows
from tinyvllm.quantization.linear import Fp8Linear

LOAD_FORMATS = ("auto", "safetensors", "dummy")
# Tensors that some checkpoints carry and that hold nothing we need.
_PROGRESS_MIN_BYTES = 512 << 20  # a progress bar only for checkpoints that take a while
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# Threads reading checkpoint tensors (read_tensors): enough to keep page-cache reads and host-to-device
# copies of several tensors going at once.
LOAD_THREADS = min(8, os.cpu_count() or 1)
# Bytes one thread reads and copies at a time (read_tensors, direct): the size of its pinned staging.
CHUNK_BYTES = 16 << 20
# Tensors read ahead of the loader's consumer, in bytes (device memory held by the reads in flight); a
# larger tensor is read alone.
_READ_AHEAD_BYTES = 1 << 30


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: rows [start, start + rows) of parameter `param`, and how.

    kind: "copy" (convert dtype; an FP8 layer's weight from an unquantized checkpoint is quantized per
    row, filling its `weight_scale` too), "scale" (an FP8 weight's scale: one per row, or one for all
    the rows), "input_scale" (a static activation scale; a fused layer takes its sources' maximum), or
    "k_scale" / "v_scale" (an attention module's KV cache scale, a float attribute).
    """

    param: str
    start: int | None = None  # None: the whole parameter
    rows: int | None = None
    kind: str = "copy"
    src: tuple[int, int, int] | None = None  # (dim, start, length): the slice of the tensor read; None: all


def weight_name_map(config: ModelConfig, shard: ModelShard | None = None) -> dict[str, Target]:
    """Hugging Face tensor name → our parameter (and row range, for the fused QKV and gate/up), and the
    slice of the tensor that `shard` holds (None: the whole model)."""
    if shard is None or shard.is_whole:
        slices = {}
        q, kv, f = config.q_size, config.kv_size, config.intermediate_size
    else:
        d = config.head_dim
        q, kv, f = shard.q_size(d), shard.kv_size(d), shard.intermediate_size
        slices = {  # which slice of the checkpoint tensor: rows (dim 0) or columns (dim 1)
            "q": (0, shard.head_start * d, q),
            "kv": (0, shard.kv_head_start * d, kv),
            "o": (1, shard.head_start * d, q),
            "gate_up": (0, shard.intermediate_start, f),
            "down": (1, shard.intermediate_start, f),
            "vocab": (0, shard.vocab_start, shard.vocab_size),
        }
    s = slices.get
    names = {
        "model.embed_tokens.weight": Target("embed_tokens.weight", src=s("vocab")),
        "model.norm.weight": Target("norm.weight"),
    }
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = Target("lm_head.weight", src=s("vocab"))
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        qkv, gate_up = f"{ours}.self_attn.qkv_proj", f"{ours}.mlp.gate_up_proj"
        names.update(
            {
                f"{hf}.self_attn.q_proj.weight": Target(f"{qkv}.weight", 0, q, src=s("q")),
                f"{hf}.self_attn.k_proj.weight": Target(f"{qkv}.weight", q, kv, src=s("kv")),
                f"{hf}.self_attn.v_proj.weight": Target(f"{qkv}.weight", q + kv, kv, src=s("kv")),
                f"{hf}.self_attn.o_proj.weight": Target(f"{ours}.self_attn.o_proj.weight", src=s("o")),
                f"{hf}.mlp.gate_proj.weight": Target(f"{gate_up}.weight", 0, f, src=s("gate_up")),
                f"{hf}.mlp.up_proj.weight": Target(f"{gate_up}.weight", f, f, src=s("gate_up")),
                f"{hf}.mlp.down_proj.weight": Target(f"{ours}.mlp.down_proj.weight", src=s("down")),
                f"{hf}.input_layernorm.weight": Target(f"{ours}.input_layernorm.weight"),
                f"{hf}.post_attention_layernorm.weight": Target(f"{ours}.post_attention_layernorm.weight"),
            }
        )
        if config.qkv_bias:
            names.update(
                {
                    f"{hf}.self_attn.q_proj.bias": Target(f"{qkv}.bias", 0, q, src=s("q")),
                    f"{hf}.self_attn.k_proj.bias": Target(f"{qkv}.bias", q, kv, src=s("kv")),
                    f"{hf}.self_attn.v_proj.bias": Target(f"{qkv}.bias", q + kv, kv, src=s("kv")),
                }
            )
        if config.qk_norm:
            names[f"{hf}.self_attn.q_norm.weight"] = Target(f"{ours}.self_attn.q_norm.weight")
            names[f"{hf}.self_attn.k_norm.weight"] = Target(f"{ours}.self_attn.k_norm.weight")
    return names


_LINEARS = {  # Hugging Face module → (our layer, which rows: 0 whole, else a row-range key)
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "self_attn.o_proj": ("self_attn.o_proj", None),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
    "mlp.down_proj": ("mlp.down_proj", None),
}


def quantized_name_map(config: ModelConfig, quant: QuantizationConfig) -> tuple[dict[str, Target], dict[str, Target]]:
    """The scale tensors of a checkpoint stored in FP8: (required, optional) name → Target.

    Required: `<module>.weight_scale` of every quantized linear module and, with static activation
    scales, its `<module>.input_scale`; for a quantized (not ignored) LM head its weight and scale, which
    load dequantized into the model's dtype (kinds "head_weight", "head_scale"). Optional: the KV cache
    scales, under compressed-tensors' names (`self_attn.k_proj.output_scale`) or vLLM's
    (`self_attn.k_scale`), and a quantized LM head's input scale (unused: the head runs in the model's
    dtype)."""
    q, kv, f = config.q_size, config.kv_size, config.intermediate_size
    rows = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), "gate": (0, f), "up": (f, f), None: (None, None)}
    required: dict[str, Target] = {}
    optional: dict[str, Target] = {}
    for i in range(config.num_hidden_layers):
        for hf_module, (ours, part) in _LINEARS.items():
            hf = f"model.layers.{i}.{hf_module}"
            if quant.is_ignored(hf):
                continue
            start, n = rows[part]
            required[f"{hf}.weight_scale"] = Target(f"layers.{i}.{ours}.weight_scale", start, n, "scale")
            if not quant.activation_dynamic:
                required[f"{hf}.input_scale"] = Target(f"layers.{i}.{ours}.input_scale", kind="input_scale")
        attn = f"model.layers.{i}.self_attn"
        for which in ("k", "v"):
            target = Target(f"layers.{i}.self_attn", kind=f"{which}_scale")
            optional[f"{attn}.{which}_proj.output_scale"] = target
            optional[f"{attn}.{which}_scale"] = target
    if not config.tie_word_embeddings and not quant.is_ignored("lm_head"):
        required["lm_head.weight"] = Target("lm_head.weight", kind="head_weight")
        required["lm_head.weight_scale"] = Target("lm_head.weight", kind="head_scale")
        optional["lm_head.input_scale"] = Target("lm_head.weight", kind="unused")
    return required, optional


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: from the shard index if there is one, else *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise ValueError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir} (only the safetensors format is supported)")
    return files


class PhaseTimer(Protocol):
    """What `build_model` times its phases with (engine/startup_timing.py's StartupTimer)."""

    def phase(self, name: str) -> AbstractContextManager[None]: ...

    def move(self, seconds: float, source: str, target: str) -> None: ...


@dataclass
class ReadStats:
    """What `read_tensors` read, and how long its caller waited for it."""

    tensors: int = 0
    bytes: int = 0  # of the tensors read directly (`direct`)
    wait_s: float = 0.0  # the caller blocked on reads and copies not yet done


def read_tensors(
    files: list[Path],
    device: torch.device,
    slices: dict[str, tuple[int, int, int] | None] | None = None,
    num_threads: int = LOAD_THREADS,
    *,
    direct: bool | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    stats: ReadStats | None = None,
) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """Every tensor of the safetensors `files` as (name, file, tensor on `device`), in file and key order;
    a name with a slice in `slices`, (dim, start, length), comes as that slice only, read from the file
    without the rest (a tensor-parallel rank's part).

    How the bytes move, and nothing else. `direct` (default: on CUDA): each tensor's bytes are read in
    pieces of `chunk_bytes` by `num_threads` threads with positional reads (safetensors_reader.py), one
    copy out of the page cache: on CUDA into the thread's pinned staging, then by DMA into the tensor
    on the thread's own stream, waited for by that thread alone; on the CPU straight into the tensor. A
    large tensor is thus read by every thread at once. Up to `_READ_AHEAD_BYTES` of tensors are in
    flight ahead of the caller, who consumes them in order. Sliced tensors and dtypes outside
    safetensors_reader.TORCH_DTYPES go through safetensors (`_read`, then `_to_device`).

    Not `direct` (the CPU default): the file's tensors as safetensors maps them, without a copy (the
    caller's copy reads them). `stats`, if given, is filled in.
    """
    slices = slices or {}
    direct = device.type == "cuda" if direct is None else direct
    stats = stats if stats is not None else ReadStats()
    handles = [safe_open(str(path), framework="pt", device="cpu") for path in files]
    jobs = [(f, name, path) for f, path in zip(handles, files) for name in list(f.keys())]  # keys(): no iteration
    if not direct:
        yield from _read_mapped(jobs, device, slices, num_threads, stats)
        return
    headers = {path: read_header(path) for path in files}
    fds = {path: os.open(path, os.O_RDONLY) for path in files}
    local = threading.local()

    def read_chunk(fd: int, offset: int, out: torch.Tensor, allocated: torch.cuda.Event | None) -> None:
        if device.type != "cuda":
            read_into(fd, byte_view(out), offset)
            return
        if not hasattr(local, "staging"):
            local.staging = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
            local.stream = torch.cuda.Stream(device)
        staging = local.staging[: out.numel()]
        read_into(fd, byte_view(staging), offset)
        # `out` may reuse memory that work queued earlier on the caller's stream still reads (a freed
        # tensor's placement): the copy waits for that work.
        local.stream.wait_event(allocated)
        with torch.cuda.stream(local.stream):
            out.copy_(staging, non_blocking=True)
        local.stream.synchronize()  # the staging is free again, and `out` complete for any stream

    def read_whole(f: Any, name: str, path: Path) -> torch.Tensor:
        tensor = _read(f, name, path, slices.get(name))
        return _to_device(tensor, device) if device.type == "cuda" else tensor

    def submit(f: Any, name: str, path: Path) -> tuple[list[Future], Any]:
        entry = headers[path].get(name)
        if name in slices or entry is None or entry.dtype is None:
            future = pool.submit(read_whole, f, name, path)
            return [future], future.result
        # Allocated here, on the caller's thread and stream: the caller uses and frees it on that stream.
        out = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
        allocated = None
        if device.type == "cuda":
            allocated = torch.cuda.Event()
            allocated.record(torch.cuda.current_stream(device))
        fd = fds[path]
        futures = [
            pool.submit(read_chunk, fd, entry.offset + s, out[s : s + chunk_bytes], allocated)
            for s in range(0, entry.nbytes, chunk_bytes)
        ]
        stats.bytes += entry.nbytes
        return futures, lambda: out.view(entry.dtype).view(entry.shape)

    def size(path: Path, name: str) -> int:
        entry = headers[path].get(name)
        return entry.nbytes if entry is not None else 0

    pool = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="tinyvllm-load")
    pending: deque[tuple[str, Path, list[Future], Any, int]] = deque()
    in_flight = 0

    def take() -> tuple[str, Path, torch.Tensor]:
        nonlocal in_flight
        name, path, futures, result, nbytes = pending.popleft()
        start = time.perf_counter()
        for future in futures:
            future.result()
        tensor = result()
        stats.wait_s += time.perf_counter() - start
        stats.tensors += 1
        in_flight -= nbytes
        return name, path, tensor

    try:
        for f, name, path in jobs:
            nbytes = size(path, name)
            while pending and in_flight + nbytes > _READ_AHEAD_BYTES:
                yield take()
            pending.append((name, path, *submit(f, name, path), nbytes))
            in_flight += nbytes
        while pending:
            yield take()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # before the files close under the threads
        for fd in fds.values():
            os.close(fd)


def _read_mapped(
    jobs: list[tuple[Any, str, Path]],
    device: torch.device,
    slices: dict[str, tuple[int, int, int] | None],
    num_threads: int,
    stats: ReadStats,
) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """`read_tensors` without `direct`: safetensors' own reads (memory-mapped), on `num_threads` threads,
    at most 2 × `num_threads` tensors in flight."""

    def read(f, name: str, path: Path) -> torch.Tensor:
        tensor = _read(f, name, path, slices.get(name))
        return _to_device(tensor, device) if device.type == "cuda" else tensor

    def timed(future_or_tensor: Future) -> torch.Tensor:
        start = time.perf_counter()
        tensor = future_or_tensor.result()
        stats.wait_s += time.perf_counter() - start
        stats.tensors += 1
        return tensor

    if num_threads <= 1:
        for f, name, path in jobs:
            start = time.perf_counter()
            tensor = read(f, name, path)
            stats.wait_s += time.perf_counter() - start
            stats.tensors += 1
            yield name, path, tensor
        return
    with ThreadPoolExecutor(num_threads, thread_name_prefix="tinyvllm-load") as pool:
        pending: deque[tuple[str, Path, Future]] = deque()
        for f, name, path in jobs:
            pending.append((name, path, pool.submit(read, f, name, path)))
            if len(pending) >= 2 * num_threads:
                name, path, future = pending.popleft()
                yield name, path, timed(future)
        while pending:
            name, path, future = pending.popleft()
            yield name, path, timed(future)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (host memory, e.g. a memory-mapped file's) on the CUDA `device`: first copied into pinned
    staging on the calling thread, then by DMA at the link's full rate, waited for (the staging is then
    free, and the result complete for any stream)."""
    return tensor.pin_memory().to(device)


def _read(f: Any, name: str, path: Path, src: tuple[int, int, int] | None) -> torch.Tensor:
    """Tensor `name` of the open file `f`, or only its slice `src` = (dim, start, length), read from the
    file without the rest (a tensor-parallel rank's part)."""
    if src is None:
        return f.get_tensor(name)
    dim, start, length = src
    part = f.get_slice(name)
    shape = part.get_shape()
    if dim >= len(shape) or start + length > shape[dim]:
        raise ValueError(
            f"tensor {name!r} in {path.name} has shape {tuple(shape)}; the config implies at least "
            f"{start + length} along dim {dim}"
        )
    return part[start : start + length] if dim == 0 else part[:, start : start + length]


@torch.no_grad()
def load_weights(
    model: CausalLM, model_dir: str | Path, show_progress: bool = False, stats: ReadStats | None = None
) -> None:
    """Copy every checkpoint tensor into its place (converting dtype, moving to the model's device;
    quantizing to FP8 where the model's layer is FP8 and the checkpoint is not); a tensor-parallel
    rank's model (`model.shard`) reads only its slices. `stats` gets the reads' (`read_tensors`)."""
    model_dir = Path(model_dir)
    config: ModelConfig = model.config
    if model.quant is not None and not model.shard.is_whole:
        raise ValueError("FP8 weights are not sharded yet: tensor parallelism runs bf16/fp16/float32 weights only")
    targets = weight_name_map(config, model.shard)
    optional: dict[str, Target] = {}
    quant = model.quant
    if quant is not None and quant.checkpoint_quantized:
        required, optional = quantized_name_map(config, quant)
        targets.update(required)
    _reset_scales(model)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    head: dict[str, torch.Tensor] = {}  # a quantized LM head's weight and scale, dequantized at the end
    seen: set[str] = set()
    files = safetensors_files(model_dir)
    big = sum(f.stat().st_size for f in files) > _PROGRESS_MIN_BYTES
    bar = tqdm(total=len(targets), desc="Loading weights", unit="tensor", disable=not (show_progress and big))
    device = next(model.parameters()).device
    slices = {name: t.src for name, t in (targets | optional).items() if t.src is not None}
    for name, path, tensor in read_tensors(files, device, slices, stats=stats):
        target = targets.get(name) or optional.get(name)
        if target is None:
            if _IGNORED.fullmatch(name) or (name == "lm_head.weight" and config.tie_word_embeddings):
                continue
            raise ValueError(
                f"unexpected tensor {name!r} in {path.name}: it has no place in a "
                f"{config.architecture} with this config"
            )
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint (again in {path.name})")
        if target.kind in ("k_scale", "v_scale"):
            _check_scalar(name, path, tensor)
            setattr(modules[target.param], target.kind, float(tensor.float().reshape(())))
        elif target.kind in ("head_weight", "head_scale"):
            head[target.kind] = tensor
        elif target.kind != "unused":
            _store(params, target, name, path, tensor, quant)
        seen.add(name)
        bar.update(1)
    bar.close()
    missing = sorted(set(targets) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {model_dir} is missing {len(missing)} tensor(s): {shown}")
    if head:
        _store_dequantized_head(params["lm_head.weight"], head["head_weight"], head["head_scale"])


def _store_dequantized_head(dest: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """A quantized LM head into the model's dtype: W = q · s (s per row [V, 1], or one value)."""
    if q.dtype != FP8_DTYPE or tuple(q.shape) != tuple(dest.shape):
        raise ValueError(
            f"lm_head.weight is {q.dtype} {tuple(q.shape)}; a quantized LM head must be float8_e4m3fn "
            f"{tuple(dest.shape)}"
        )
    scale = scale.float()
    if scale.numel() not in (1, q.shape[0]):
        raise ValueError(f"lm_head.weight_scale has {scale.numel()} values for {q.shape[0]} rows")
    dest.copy_(q.float() * scale.reshape(-1, 1))


def _reset_scales(model: CausalLM) -> None:
    """Static input scales start at 0 (a fused layer takes the maximum of its sources'), KV scales at 1."""
    for module in model.modules():
        if isinstance(module, Fp8Linear) and module.input_scale is not None:
            module.input_scale.zero_()
        if hasattr(module, "k_scale"):
            module.k_scale = module.v_scale = 1.0


def _check_scalar(name: str, path: Path, tensor: torch.Tensor) -> None:
    if tensor.numel() != 1:
        raise ValueError(
            f"tensor {name!r} in {path.name} has shape {tuple(tensor.shape)}; a per-tensor scale has one value"
        )


def _store(
    params: dict[str, torch.nn.Parameter],
    target: Target,
    name: str,
    path: Path,
    tensor: torch.Tensor,
    quant: QuantizationConfig | None,
) -> None:
    """Write one checkpoint tensor into its target (Target's docstring says how, by kind)."""
    param = params[target.param]
    dest = param if target.start is None else param[target.start : target.start + target.rows]
    if target.kind == "input_scale":
        _check_scalar(name, path, tensor)
        dest.copy_(torch.maximum(dest, tensor.float().reshape(()).to(dest.device)))
        return
    if target.kind == "scale":
        if tensor.numel() == 1:  # per tensor: the same scale on every row
            dest.fill_(float(tensor.float().reshape(())))
            return
        tensor = tensor.reshape(-1) if tensor.dim() == 2 and tensor.shape[1] == 1 else tensor
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ValueError(
            f"tensor {name!r} in {path.name} has shape {tuple(tensor.shape)}, "
            f"but the config implies {tuple(dest.shape)}"
        )
    if param.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
        if quant is not None and quant.checkpoint_quantized:
            raise ValueError(
                f"tensor {name!r} in {path.name} is {tensor.dtype}, but the checkpoint's quantization_config says "
                "its weights are stored in FP8 (float8_e4m3fn)"
            )
        q, scale = quantize_rows(tensor.to(dest.device))
        dest.copy_(q)
        scales = params[target.param.removesuffix("weight") + "weight_scale"]
        (scales if target.start is None else scales[target.start : target.start + target.rows]).copy_(scale)
        return
    if tensor.dtype == FP8_DTYPE and param.dtype != FP8_DTYPE:
        raise ValueError(
            f"tensor {name!r} in {path.name} is FP8, but its module is not quantized here (listed in "
            "quantization_config.ignore, or a module tinyvllm keeps unquantized: embeddings, LM head)"
        )
    dest.copy_(tensor)


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int, std: float = 0.02) -> None:
    """Random weights without files: matrices ~ N(0, std²), norm weights 1 (load_format="dummy"); an FP8
    layer's matrix is drawn the same way and quantized per row, its static input scale (if any) is 1."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name.endswith("norm.weight") or name.endswith("input_scale"):
            param.fill_(1.0)
        elif name.endswith("weight_scale"):
            continue  # filled with its weight
        else:
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            if param.dtype == FP8_DTYPE:
                q, scale = quantize_rows(values)
                param.copy_(q)
                params[name.removesuffix("weight") + "weight_scale"].copy_(scale)
            else:
                param.copy_(values)


def materialize(model: torch.nn.Module, device: torch.device | str) -> None:
    """Give every meta-device parameter and buffer of `model` uninitialised storage on `device`, in place
    (`Module.to_empty`'s work; a tensor shared by two modules stays shared, a parameter keeps its class,
    `requires_grad` and attributes). Each tensor is `torch.empty` of its shape: `to_empty` calls
    `empty_like` on the meta tensors, whose first call imports torch's symbolic-shapes module and sympy,
    ~2 s of start-up on the device machine."""
    new: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in new:
                data = torch.empty(p.shape, dtype=p.dtype, device=device)
                q = type(p)(data, requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)
                new[id(p)] = q
            if p is not None:
                module._parameters[name] = new[id(p)]
        for name, b in module._buffers.items():
            if b is not None and id(b) not in new:
                new[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
            if b is not None:
                module._buffers[name] = new[id(b)]


def build_model(
    config: ModelConfig,
    ops: Ops,
    *,
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
    show_progress: bool = False,
    quant: QuantizationConfig | None = None,
    shard: ModelShard | None = None,
    group: TPGroup | None = None,
    timer: PhaseTimer | None = None,
) -> CausalLM:
    """Construct on the meta device, materialise on `device`, then load (or randomise) the weights; with
    `quant`, the linear layers it covers are FP8 (quantization/); with `shard` and `group`, the
    tensor-parallel rank's slice of the model (random dummy weights are then the rank's own draw, not a
    slice of the one-rank model's).

    `timer` (a PhaseTimer), if given, times the phases: "model_init" (construction,
    materialisation, the RoPE table), "weights" (loading), of which the time spent waiting for the reads
    goes to "weights_read"."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {list(LOAD_FORMATS)}")

    def phase(name: str) -> AbstractContextManager[None]:
        return timer.phase(name) if timer is not None else nullcontext()

    with phase("model_init"):
        with torch.device("meta"):
            model = CausalLM(config, ops, max_positions, dtype, quant, shard, group)
        materialize(model, device)
        model.init_rope_table()
    stats = ReadStats()
    with phase("weights"):
        if load_format == "dummy":
            init_dummy_weights(model, seed)
        else:
            load_weights(model, model_dir, show_progress=show_progress, stats=stats)
    if timer is not None:
        timer.move(stats.wait_s, "weights", "weights_read")
    return model.eval().requires_grad_(False)
