"""Python objects as JSON that restores their types, without pickle: loading can never run code.

Plain JSON values stay as they are; everything else is a one-key tagged object:

    tuple -> {"__tuple__": [...]}         Counter -> {"__counter__": [[k, n], ...]}
    dict with non-string keys, or a reserved key -> {"__dict__": [[k, v], ...]}
    OrderedDict -> {"__odict__": [...]}   float nan/inf -> {"__float__": "nan"}
    torch.Size -> {"__size__": [...]}     numpy scalar -> {"__npscalar__": [dtype, value]}
    numpy array -> {"__ndarray__": tensor}  a Hugging Face config -> {"__hf_config__": [class name, to_dict()]}
    tensor -> what `put_tensor` returns (inline values, or a reference into a safetensors file)

A value of another type is a TypeError naming its path (`user_content["sched"][2]`) and the types
that are stored. Hugging Face config classes are looked up by name in `transformers` only.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import torch

TAGS = (
    "__tuple__",
    "__dict__",
    "__odict__",
    "__counter__",
    "__float__",
    "__size__",
    "__npscalar__",
    "__ndarray__",
    "__hf_config__",
)
RESERVED = frozenset((*TAGS, "__tensor__"))  # a user dict holding one of these keys is stored as pairs
STORED = (
    "None, bool, int, float, str, list, tuple, dict (any JSON-able keys), OrderedDict, Counter, torch.Size, tensors, "
    "numpy scalars and arrays, and Hugging Face PretrainedConfig objects"
)

PutTensor = Callable[[torch.Tensor, str], Any]
GetTensor = Callable[[Any], torch.Tensor]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy ships with torch's wheels
        return None
    return numpy


def _is_hf_config(value: Any) -> bool:
    # transformers 5 spells the base PreTrainedConfig (PretrainedConfig stays as an alias)
    return any(
        c.__name__.lower() == "pretrainedconfig" and c.__module__.startswith("transformers")
        for c in type(value).__mro__
    )


def encode(value: Any, where: str, put_tensor: PutTensor) -> Any:
    """A JSON-able form of `value`; `put_tensor(tensor, where)` decides how a tensor is kept."""
    if value is None or isinstance(value, (bool, str)) or (isinstance(value, int) and type(value) is int):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.Size):
        return {"__size__": list(value)}
    if isinstance(value, torch.Tensor):
        return put_tensor(value, where)
    np = _numpy()
    if np is not None and isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError(f"{where}: a numpy array of Python objects cannot be stored; {STORED} can")
        return {"__ndarray__": put_tensor(torch.from_numpy(value.copy()), where)}
    if np is not None and isinstance(value, np.generic):
        return {"__npscalar__": [value.dtype.str, encode(value.item(), where, put_tensor)]}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"__tuple__": [encode(v, f"{where}[{i}]", put_tensor) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]", put_tensor) for i, v in enumerate(value)]
    if isinstance(value, OrderedDict):
        return {"__odict__": _pairs(value, where, put_tensor)}
    if isinstance(value, Counter):  # MultiStepLR's milestones
        return {"__counter__": _pairs(value, where, put_tensor)}
    if type(value) is dict:
        if all(isinstance(k, str) for k in value) and not set(value) & RESERVED:
            return {k: encode(v, f"{where}[{k!r}]", put_tensor) for k, v in value.items()}
        return {"__dict__": _pairs(value, where, put_tensor)}
    if _is_hf_config(value):
        return {"__hf_config__": [type(value).__name__, encode(value.to_dict(), f"{where}.to_dict()", put_tensor)]}
    if isinstance(value, numbers.Integral):  # an int subclass (IntEnum), stored as its value
        return int(value)
    if isinstance(value, numbers.Real):  # a float subclass, a Fraction
        return encode(float(value), where, put_tensor)
    raise TypeError(
        f"{where}: a {type(value).__name__} cannot be stored (no pickle, so loading runs no code); {STORED} can"
    )


def _pairs(value: dict[Any, Any], where: str, put_tensor: PutTensor) -> list[list[Any]]:
    return [[encode(k, f"{where} key", put_tensor), encode(v, f"{where}[{k!r}]", put_tensor)] for k, v in value.items()]


def decode(obj: Any, get_tensor: GetTensor) -> Any:
    """The object `encode` described; `get_tensor` turns what `put_tensor` returned back into a tensor."""
    if isinstance(obj, list):
        return [decode(v, get_tensor) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        ((tag, body),) = obj.items()
        if tag in _DECODERS:
            return _DECODERS[tag](body, get_tensor)
    if "__tensor__" in obj:
        return get_tensor(obj)
    return {k: decode(v, get_tensor) for k, v in obj.items()}


def _hashable(v: Any) -> Any:
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


def _decode_pairs(body: Any, get_tensor: GetTensor) -> list[tuple[Any, Any]]:
    return [(_hashable(decode(k, get_tensor)), decode(v, get_tensor)) for k, v in body]


def _numpy_scalar(body: Any, get_tensor: GetTensor) -> Any:
    np = _numpy()
    dtype, value = body
    return np.dtype(dtype).type(decode(value, get_tensor)) if np is not None else value


def _hf_config(body: Any, get_tensor: GetTensor) -> Any:
    import transformers

    name, values = body
    cls = getattr(transformers, name, None)
    base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"the stored Hugging Face config class {name!r} is not a transformers PretrainedConfig")
    return cls.from_dict(decode(values, get_tensor))


def _ndarray(body: Any, get_tensor: GetTensor) -> Any:
    tensor = get_tensor(body) if isinstance(body, dict) and "__tensor__" in body else decode(body, get_tensor)
    return tensor.cpu().numpy()


_DECODERS: dict[str, Callable[[Any, GetTensor], Any]] = {
    "__tuple__": lambda b, g: tuple(decode(v, g) for v in b),
    "__dict__": lambda b, g: dict(_decode_pairs(b, g)),
    "__odict__": lambda b, g: OrderedDict(_decode_pairs(b, g)),
    "__counter__": lambda b, g: Counter(dict(_decode_pairs(b, g))),
    "__float__": lambda b, g: float(b),
    "__size__": lambda b, g: torch.Size(b),
    "__npscalar__": _numpy_scalar,
    "__ndarray__": _ndarray,
    "__hf_config__": _hf_config,
}
