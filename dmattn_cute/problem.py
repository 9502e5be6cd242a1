"""Validate the inputs of one attention call once, before anything runs, and describe them.

`check_problem` checks everything SPEC.md's "Errors" lists and returns a frozen `Problem`
(sizes and flags; `Problem.from_tensors` is the one place one is made); `make_problem` adds
the mask and bias as 4-D broadcast views read in place by the kernels. Every error names the
argument, what was expected and what was given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import torch
from torch import Tensor

from dmattn_cute.jit.arch import device_arch
from dmattn_cute.memo import remember

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8


@dataclass(frozen=True)
class Problem:
    """Sizes and flags of one call: query [B, Sq, H, D], key/value [B, Sk, Hkv, D]."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    num_heads: int
    num_heads_kv: int
    head_dim: int
    dtype: torch.dtype  # q/k/v dtype (fp16 or bf16)
    softmax_scale: float
    is_causal: bool
    softcap: float  # 0.0 = off
    window_left: int  # -1 = unbounded
    window_right: int  # -1 = unbounded
    deterministic: bool

    @classmethod
    def from_tensors(
        cls,
        query: Tensor,
        key: Tensor,
        *,
        softmax_scale: float,
        is_causal: bool,
        softcap: float,
        window_left: int,
        window_right: int,
        deterministic: bool,
    ) -> Problem:
        """The description of a call with query [B, Sq, H, D] and key [B, Sk, Hkv, D]; the one
        place a Problem is made. Checks nothing: check_problem validates a call's arguments
        before it describes them, the ops describe arguments validated by their caller."""
        batch, seqlen_q, num_heads, head_dim = query.shape
        return cls(
            batch=batch,
            seqlen_q=seqlen_q,
            seqlen_k=key.shape[1],
            num_heads=num_heads,
            num_heads_kv=key.shape[2],
            head_dim=head_dim,
            dtype=query.dtype,
            softmax_scale=softmax_scale,
            is_causal=is_causal,
            softcap=softcap,
            window_left=window_left,
            window_right=window_right,
            deterministic=deterministic,
        )

    @property
    def has_window(self) -> bool:
        """Keys are limited per query: causal or a sliding window on either side."""
        return self.is_causal or self.window_left >= 0 or self.window_right >= 0


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _is_int(value: object) -> bool:
    # bool is an Integral, but True as a window side is almost surely a mistake.
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def check_bool(name: str, value: object) -> bool:
    """`value` if it is a bool; TypeError naming `name` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r} ({type(value).__name__})")
    return value


def check_compact_mask(
    name: str, t: object, dtype: torch.dtype, device, allowed: tuple, layout
) -> None:
    """A compact mask argument (block mask, key expiry rows): a tensor of `dtype` on `device`
    whose every dim's size is in its tuple of `allowed`; TypeError / ValueError naming `name`
    otherwise, the expected shape said by `layout()` (built only then)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t)}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} like query, got {t.device}")
    if t.dim() != len(allowed) or any(
        size not in sizes for size, sizes in zip(t.shape, allowed, strict=True)
    ):
        raise ValueError(f"{name}: expected {layout()}, got shape {tuple(t.shape)}")


def check_window_size(window_size: object) -> tuple[int, int]:
    """(left, right) from a pair of ints, each -1 (unbounded) or >= 0."""
    if not (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(_is_int(side) for side in window_size)
    ):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    left, right = (int(side) for side in window_size)
    for side, value in (("left", left), ("right", right)):
        if value < -1:
            raise ValueError(
                f"window_size: expected {side} to be -1 (unbounded) or >= 0, got {value}"
            )
    return left, right


def check_device(device: torch.device) -> None:
    """Raise ValueError for a CUDA device the kernels have no target for (e.g. capability < 8.0).

    Other device types run the PyTorch reference and are always accepted.
    """
    if device.type != "cuda":
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    try:
        device_arch(index)  # cached per device: this runs on every call
    except ValueError as err:
        raise ValueError(
            f"query: expected a CUDA device the kernels support, got {device}: {err}"
        ) from err


def _check_qkv(query: object, key: object, value: object) -> None:
    tensors = {"query": query, "key": key, "value": value}
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, t in tensors.items():
        if t.dim() != 4:
            layout = "[B, Sq, H, D]" if name == "query" else "[B, Sk, Hkv, D]"
            raise ValueError(
                f"{name}: expected a 4-D tensor {layout}, got {t.dim()}-D of shape {_shape(t)}"
            )
    if query.dtype not in SUPPORTED_DTYPES:
        cast = (
            "; cast with query.to(torch.bfloat16) or .half() (key and value alike)"
            if query.dtype.is_floating_point
            else ""
        )
        raise TypeError(
            f"query: expected dtype torch.float16 or torch.bfloat16, got {query.dtype}{cast}"
        )
    for name in ("key", "value"):
        t = tensors[name]
        if t.dtype != query.dtype:
            raise TypeError(f"{name}: expected dtype {query.dtype} like query, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name}: expected device {query.device} like query, got {t.device}")

    batch, seqlen_q, num_heads, head_dim = _shape(query)
    seqlen_k, num_heads_kv = key.shape[1], key.shape[2]
    if key.shape[0] != batch:
        raise ValueError(
            f"key: expected dim 0 (batch) to be B={batch} like query, got {key.shape[0]}"
        )
    if key.shape[3] != head_dim:
        raise ValueError(
            f"key: expected dim 3 (head_dim) to be D={head_dim} like query, got {key.shape[3]}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value: expected the shape of key {_shape(key)}, got {_shape(value)}")
    for name, dim, label, size in (
        ("query", 0, "batch", batch),
        ("query", 1, "Sq", seqlen_q),
        ("query", 2, "H", num_heads),
        ("key", 1, "Sk", seqlen_k),
        ("key", 2, "Hkv", num_heads_kv),
    ):
        if size < 1:
            raise ValueError(f"{name}: expected dim {dim} ({label}) to be >= 1, got {size}")
    if num_heads % num_heads_kv != 0:
        raise ValueError(
            f"query: expected the number of heads H={num_heads} to be a multiple of key's "
            f"Hkv={num_heads_kv}, got H % Hkv = {num_heads % num_heads_kv}"
        )
    if not (0 < head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0):
        raise ValueError(
            f"query: expected head_dim D to be a multiple of {HEAD_DIM_MULTIPLE} in "
            f"[{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}], got {head_dim}"
        )
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name}: expected the last dim (head_dim) to be contiguous (stride 1), "
                f"got strides {t.stride()}"
            )


def check_broadcast(
    t: Tensor,
    name: str,
    batch: int,
    heads: int,
    heads_kv: int,
    seqlen_q: int,
    seqlen_k: int,
) -> None:
    """Raises ValueError naming `name` unless t is [Bm, Hm, Km] (Qm = 1) or [Bm, Hm, Qm, Km]
    with Bm in {1, B}, Hm in {1, Hkv, H}, Qm in {1, Sq}, Km in {1, Sk}."""
    if t.dim() not in (3, 4):
        raise ValueError(
            f"{name}: expected a 3-D [Bm, Hm, Km] or 4-D [Bm, Hm, Qm, Km] tensor, "
            f"got {t.dim()}-D of shape {_shape(t)}"
        )
    dims = (0, 1, 2, 3) if t.dim() == 4 else (0, 1, 3)  # of (batch, heads, queries, keys)
    allowed = ((1, batch), (1, heads_kv, heads), (1, seqlen_q), (1, seqlen_k))
    for index, (dim, size) in enumerate(zip(dims, t.shape, strict=True)):
        if size not in allowed[dim]:
            # the message is built only here: this check runs on every call
            heads_text = (
                f"1, Hkv={heads_kv} or H={heads}" if heads_kv != heads else f"1 or H={heads}"
            )
            label, allowed_text = (
                ("batch", f"1 or B={batch}"),
                ("heads", heads_text),
                ("queries", f"1 or Sq={seqlen_q}"),
                ("keys", f"1 or Sk={seqlen_k}"),
            )[dim]
            raise ValueError(
                f"{name}: expected dim {index} ({label}) to be {allowed_text}, got {size}"
            )


def broadcast_view(t: Tensor | None) -> Tensor | None:
    """t (3-D [Bm, Hm, Km] or 4-D) as a 4-D view of the same storage with stride 0 on its
    size-1 dims, so a kernel indexes every dim alike; nothing is copied. None for None."""
    layout = broadcast_layout(t)
    return t if layout is None else t.as_strided(*layout, t.storage_offset())


def broadcast_layout(t: Tensor | None) -> tuple[tuple, tuple] | None:
    """(shape, strides) of broadcast_view(t) where that is a new view of t's storage at t's
    offset; None where it is t itself (a 4-D tensor already so: no view op per call) or t
    is None."""
    if t is None:
        return None
    shape, stride = list(t.shape), list(t.stride())
    if len(shape) == 3:
        shape.insert(2, 1)
        stride.insert(2, 0)
    elif all(st == 0 for size, st in zip(shape, stride, strict=True) if size == 1):
        return None
    strides = tuple(0 if size == 1 else st for size, st in zip(shape, stride, strict=True))
    return tuple(shape), strides


def _check_mask_bias(attn_mask: object, attn_bias: object, query: Tensor) -> None:
    for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise TypeError(f"attn_mask: expected dtype torch.bool, got {attn_mask.dtype}")
    if attn_bias is not None and attn_bias.dtype not in (query.dtype, torch.float32):
        raise TypeError(
            f"attn_bias: expected dtype {query.dtype} (the query's) or torch.float32, "
            f"got {attn_bias.dtype}"
        )
    for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)):
        if t is not None and t.device != query.device:
            raise ValueError(f"{name}: expected device {query.device} like query, got {t.device}")


def _check_scalars(softmax_scale: object, softcap: object, head_dim: int) -> tuple[float, float]:
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if not _is_real(softmax_scale):
        raise TypeError(
            f"softmax_scale: expected a float or None, got {type(softmax_scale).__name__}"
        )
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale: expected a finite value > 0, got {softmax_scale}")
    if not _is_real(softcap):
        raise TypeError(f"softcap: expected a float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: expected a finite value >= 0 (0 = off), got {softcap}")
    return float(softmax_scale), float(softcap)


def check_problem(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    attn_bias: Tensor | None,
    softmax_scale: float | None,
    is_causal: bool,
    softcap: float,
    window_size: tuple[int, int],
    deterministic: bool,
) -> Problem:
    """Validate one call of flash_dmattn_func (arguments as in SPEC.md) and describe it.

    Raises TypeError for a wrong type or dtype and ValueError for a wrong shape, value or
    device; nothing is launched or written.

    Every check reads only the arguments' metadata (types, shapes, strides, dtypes, devices)
    and the scalars' types and values: a call whose `call_signature` was validated before
    returns that Problem again without re-checking (about 30 us of Python per call).
    """
    signature = None
    if not torch.compiler.is_compiling():
        signature = call_signature(
            query, key, value, attn_mask, attn_bias, softmax_scale, is_causal, softcap,
            window_size, deterministic,
        )  # fmt: skip

    def validate() -> Problem:
        return _validate(
            query, key, value, attn_mask, attn_bias, softmax_scale, is_causal, softcap,
            window_size, deterministic,
        )  # fmt: skip

    if signature is None:
        return validate()
    return remember(_VALIDATED, signature, validate, _VALIDATED_MAX)


# Problems of validated call signatures (check_problem); cleared when full.
_VALIDATED: dict[tuple, Problem] = {}
_VALIDATED_MAX = 1024


def _tensor_signature(t: object) -> tuple | None:
    # Exactly torch.Tensor: a subclass (e.g. a FakeTensor) may answer metadata differently.
    if type(t) is not Tensor:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


def call_signature(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    attn_bias: object,
    softmax_scale: object,
    is_causal: object,
    softcap: object,
    window_size: object,
    deterministic: object,
) -> tuple | None:
    """What check_problem's verdict depends on, as a hashable key; None when an argument is
    of a kind the key does not describe (the call is then validated in full). Scalars are
    keyed with their types, so that True and 1, or 1 and 1.0, stay apart."""
    tensors = [_tensor_signature(t) for t in (query, key, value)]
    for t in (attn_mask, attn_bias):
        tensors.append(None if t is None else _tensor_signature(t))
        if t is not None and tensors[-1] is None:
            return None
    if None in tensors[:3] or type(window_size) not in (tuple, list):
        return None
    scalars = (softmax_scale, is_causal, softcap, deterministic, *window_size)
    if not all(type(x) in (int, float, bool, type(None)) for x in scalars):
        return None
    return (*tensors, type(window_size), *((type(x), x) for x in scalars))


def _validate(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    attn_bias: Tensor | None,
    softmax_scale: float | None,
    is_causal: bool,
    softcap: float,
    window_size: tuple[int, int],
    deterministic: bool,
) -> Problem:
    _check_qkv(query, key, value)
    batch, seqlen_q, num_heads, head_dim = _shape(query)
    seqlen_k, num_heads_kv = key.shape[1], key.shape[2]
    _check_mask_bias(attn_mask, attn_bias, query)
    sizes = (batch, num_heads, num_heads_kv, seqlen_q, seqlen_k)
    for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)):
        if t is not None:
            check_broadcast(t, name, *sizes)
    softmax_scale, softcap = _check_scalars(softmax_scale, softcap, head_dim)
    window_left, window_right = check_window_size(window_size)
    problem = Problem.from_tensors(
        query,
        key,
        softmax_scale=softmax_scale,
        is_causal=check_bool("is_causal", is_causal),
        softcap=softcap,
        window_left=window_left,
        window_right=window_right,
        deterministic=check_bool("deterministic", deterministic),
    )
    # While torch.compile traces, the device is only described; the op checks it again
    # before it launches anything.
    if not torch.compiler.is_compiling():
        check_device(query.device)
    return problem


def make_problem(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    attn_bias: Tensor | None,
    softmax_scale: float | None,
    is_causal: bool,
    softcap: float,
    window_size: tuple[int, int],
    deterministic: bool,
) -> tuple[Problem, Tensor | None, Tensor | None]:
    """check_problem, plus the mask and bias as 4-D [Bm, Hm, Qm, Km] views (see
    broadcast_view), each None when not given."""
    problem = check_problem(
        query, key, value, attn_mask, attn_bias, softmax_scale, is_causal, softcap,
        window_size, deterministic,
    )  # fmt: skip
    return problem, broadcast_view(attn_mask), broadcast_view(attn_bias)
