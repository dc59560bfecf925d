"""Where knob values come from, before any is checked (config.py's `Config.from_any`): a flat or
SageMaker-form dict, v1's names of knobs, a JSON / TOML file, and the environment (SM_HP_MP_PARAMETERS,
SHARDPAR_CONFIG, SHARDPAR_<KNOB>, SMDDP_AG_*_BUFFER_SIZE_BYTES). Errors name the source, the value and
the fix."""

from __future__ import annotations

import difflib
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardpar.config_v1 import ALIASES, NO_EFFECT

SMDDP_BUFFER_ALIGN = 8192

# Keys a SageMaker smp_options dict carries that mean nothing here but must not be rejected:
# "ddp" must be True under sharded data parallelism (there is no other mode); v1's other names of
# knobs (partitions, fp16_params) and its keys that change nothing here are in config_v1.py.
ACCEPTED_ONLY = {"ddp": True}

ENV_PREFIX = "SHARDPAR_"


def unwrap_sagemaker(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """Accept {"enabled": True, "parameters": {...}} as well as a flat dict."""
    if "parameters" in raw and set(raw) <= {"enabled", "parameters"}:
        if raw.get("enabled", True) is not True:
            raise ValueError(f"enabled={raw['enabled']!r}: shardpar needs 'enabled': True (or a flat dict)")
        params = raw["parameters"]
        if not isinstance(params, Mapping):
            raise TypeError(f"'parameters' must be a dict of knobs, got {type(params).__name__}")
        return params
    return raw


def real_names(params: Mapping[str, Any]) -> dict[str, Any]:
    """v1's names of knobs (partitions, fp16_params) replaced by the knobs' own; both given must agree."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        real = ALIASES.get(key)
        if real is not None and real in params and params[real] != value:
            raise ValueError(
                f"{key}={value!r} and {real}={params[real]!r} disagree ({key} is the SageMaker v1 name of "
                f"{real}); give one of them"
            )
        out[real or key] = value
    return out


# SHARDPAR_* variables that are not knobs: the config file, the shm transport's kernel choice, and the
# test suite's own (SHARDPAR_TEST_*). Any other SHARDPAR_<NAME> must name a knob (a typo is an error).
_NOT_KNOBS = ("SHARDPAR_CONFIG", "SHARDPAR_SHM_ISA")
_NOT_KNOB_PREFIX = "SHARDPAR_TEST_"


def env_layers(env: Mapping[str, str], names: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """The environment's sources of knobs named `names`, lowest first ([Note: config precedence], config.py)."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if "SM_HP_MP_PARAMETERS" in env:
        where = "the environment variable SM_HP_MP_PARAMETERS"
        layers.append(("SM_HP_MP_PARAMETERS", _parse_json(env["SM_HP_MP_PARAMETERS"], where)))
    if "SHARDPAR_CONFIG" in env:
        text = env["SHARDPAR_CONFIG"].strip()
        where = "the environment variable SHARDPAR_CONFIG"
        layers.append(("SHARDPAR_CONFIG", _parse_json(text, where) if text.startswith("{") else read_file(Path(text))))
    for key, value in sorted(env.items()):
        if not key.startswith(ENV_PREFIX) or key in _NOT_KNOBS or key.startswith(_NOT_KNOB_PREFIX):
            continue
        knob = key[len(ENV_PREFIX) :].lower()
        if knob not in names:
            raise ValueError(f"environment variable {key}: " + unknown_key_message(knob, names))
        layers.append((key, {knob: _parse_env_value(value)}))
    return layers


def unknown_key_message(key: str, names: set[str]) -> str:
    known = sorted(names | set(ALIASES) | set(ACCEPTED_ONLY) | set(NO_EFFECT) | {"placement_strategy", "horovod"})
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known knobs: {', '.join(known)}"
    return f"unknown config key {key!r}{hint}"


def _parse_json(text: str, where: str) -> dict[str, Any]:
    example = "'{\"sharded_data_parallel_degree\": 2}'"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc}); e.g. {example}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where} must hold a JSON object of knobs, not {type(data).__name__}; e.g. {example}")
    return data


def read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist; pass a dict or an existing .json/.toml path")
    text = path.read_text()
    if path.suffix == ".toml":
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    elif path.suffix == ".json":
        data = _parse_json(text, f"config file {str(path)!r}")
    else:
        raise ValueError(f"config file {str(path)!r}: unknown extension {path.suffix!r}; use .json or .toml")
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a table/object of knobs")
    return data


def _parse_env_value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def smddp_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("smddp_ag_scratch_buffer_size_bytes", "smddp_ag_sort_buffer_size_bytes"):
        text = env.get(name.upper())
        if text is not None:
            try:
                out[name] = int(text)
            except ValueError:
                raise ValueError(
                    f"{name.upper()}={text!r} is not an integer; give a byte count that is a multiple of "
                    f"{SMDDP_BUFFER_ALIGN}, e.g. {16 * 1024 * 1024}"
                ) from None
    return out
