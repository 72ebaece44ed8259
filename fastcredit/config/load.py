"""Loading the config tree (``fastcredit.config.schema``): YAML + dotted CLI overrides, validated.

    cfg = load_config("configs/cwgrpo.yaml", ["credit.cwgrpo.alpha=inf", "rollout.max_turns=4"])

Overrides apply after the YAML. Unknown keys, keys given twice in one YAML mapping, wrong
types and numbers out of range (declared beside each field, ``fastcredit.config.ranges``) raise
ConfigError naming the key, where it came from (file and line, or the command line) and the
closest valid key. What the chosen estimator needs is the training command's check
(``fastcredit.credit.needs.check_needs``), not the loader's: this package imports nothing else
of fastcredit.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
import typing
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import yaml

from fastcredit.config.checks import check_config
from fastcredit.config.errors import ConfigError
from fastcredit.config.schema import TrainConfig


def load_config(path: Union[str, typing.Sequence[str], None] = None, overrides: typing.Sequence[str] = (),
                root: type = None):
    """Defaults, then the YAML file (if any; several: in order, each overlaying the one before, e.g. a method's
    config then ``configs/searchr1_design.yaml``), then ``key=value`` overrides; validated.

    ``root``: the config tree's class (default :class:`TrainConfig`); another command's root (e.g.
    ``fastcredit.prm.config.PRMTrainConfig``) validates itself with its ``validate(origins)`` method."""
    root = TrainConfig if root is None else root
    cfg, origins = root(), {}
    for one in ([] if path is None else [path] if isinstance(path, str) else list(path)):
        data, lines = _read_yaml(one)
        _apply_mapping(cfg, data, prefix="", origin=lambda k: f"{one} line {lines.get(k, '?')}", root=root)
        origins.update((k, f"{one} line {n}") for k, n in lines.items())
    for item in overrides:
        key, value = _split_override(item)
        origins[key] = f"command line '{item}'"
        _set_dotted(cfg, key, value, origin=origins[key], root=root)
    if root is TrainConfig:
        validate(cfg, origins)
    else:
        cfg.validate(origins)
    return cfg


def _split_override(item: str) -> tuple[str, Any]:
    if "=" not in item or item.startswith("="):
        raise ConfigError(f"override {item!r} must look like key=value (e.g. credit.estimator=cwgrpo)")
    key, raw = item.split("=", 1)
    return key.strip(), _RawValue(raw)


class _RawValue(str):
    """A value typed on the command line: parsed as YAML, but kept verbatim for str fields."""


def _read_yaml(path: str) -> tuple[dict, dict]:
    """Parse a YAML mapping and record the line of every dotted key (for error messages)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    lines: dict[str, int] = {}
    _record_lines(node, "", lines, path)
    return data, lines


def _record_lines(node, prefix: str, lines: dict, path: str) -> None:
    """The line of every dotted key; a key given twice in one mapping (YAML keeps the last) is an error."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _record_lines(item, f"{prefix}{i}.", lines, path)
    elif isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"{path}: '{key}' is given twice, at lines {seen[key]} and {line}")
            seen[key] = lines[key] = line
            _record_lines(value_node, key + ".", lines, path)


def _apply_mapping(obj, data: dict, prefix: str, origin, root: type = None) -> None:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        spec = _field_spec(obj, str(key), dotted, origin(dotted), full=_first_leaf(dotted, value), root=root)
        if dataclasses.is_dataclass(spec.type_):
            if not isinstance(value, dict):
                raise ConfigError(f"{origin(dotted)}: '{dotted}' is a section; give it a mapping of keys, "
                                  f"got {value!r}")
            _apply_mapping(getattr(obj, key), value, dotted + ".", origin, root)
        else:
            setattr(obj, key, _coerce(value, spec.type_, dotted, origin(dotted)))


def _first_leaf(dotted: str, value) -> str:
    """The first leaf key of a YAML value under ``dotted`` (``a.b`` with ``{b: {c: 1}}`` gives ``a.b.c``)."""
    while isinstance(value, dict) and value:
        key, value = next(iter(value.items()))
        dotted = f"{dotted}.{key}"
    return dotted


def _set_dotted(cfg, key: str, value, origin: str, root: type = None) -> None:
    obj, parts = cfg, key.split(".")
    for i, part in enumerate(parts):
        dotted = ".".join(parts[: i + 1])
        spec = _field_spec(obj, part, dotted, origin, full=key, root=root)
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(spec.type_):
                example = next(iter(field_types(spec.type_)))
                raise ConfigError(f"{origin}: '{dotted}' is a section; set one of its keys, "
                                  f"e.g. {dotted}.{example}=…")
            setattr(obj, part, _coerce(value, spec.type_, dotted, origin))
        elif not dataclasses.is_dataclass(spec.type_):
            raise ConfigError(f"{origin}: '{dotted}' is a value, not a section, so '{key}' does not exist")
        else:
            obj = getattr(obj, part)


@dataclass
class _Spec:
    type_: Any


def field_types(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _field_spec(obj, name: str, dotted: str, origin: str, full: Optional[str] = None, root: type = None) -> _Spec:
    """The type of ``name`` in section ``obj``; an unknown key is an error naming the closest valid key, or the
    fastcredit key of a veRL / Search-R1 key (``full``: the whole key being set, of which ``dotted`` is a part;
    ``root``: the tree's class, default TrainConfig)."""
    root = TrainConfig if root is None else root
    types = field_types(type(obj))
    if name not in types:
        from fastcredit.config.aliases import explain_unknown

        alias = explain_unknown(dotted, full) if root is TrainConfig else None  # veRL keys map onto TrainConfig's
        if alias is not None:
            raise ConfigError(f"{origin}: {alias}")
        prefix = dotted[: -len(name)]
        valid = [prefix + k for k in types]
        close = difflib.get_close_matches(dotted, valid + all_keys(root), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys here: {', '.join(valid)}"
        raise ConfigError(f"{origin}: unknown key '{dotted}'{hint}")
    return _Spec(types[name])


def all_keys(cls=TrainConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the config tree, dotted."""
    out = []
    for name, tp in field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            out += all_keys(tp, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def _coerce(value, tp, key: str, origin: str):
    raw = value if isinstance(value, _RawValue) else None
    if raw is not None:
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = str(raw)
    origin_tp, args = typing.get_origin(tp), typing.get_args(tp)
    if origin_tp is typing.Union:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(raw if raw is not None else value, inner[0], key, origin)
    if origin_tp is Literal:
        strings = [a for a in args if isinstance(a, str)]
        # a command-line word is one of the names verbatim; in a Literal that also holds other values (auto, true,
        # false) any other word keeps its YAML reading, so "true" is the bool
        if raw is not None and strings and (str(raw) in strings or len(strings) == len(args)):
            value = str(raw)
        if value in args and type(value) is type(next(a for a in args if a == value)):
            return value
        spelled = [_yaml_word(a) for a in args]
        close = difflib.get_close_matches(_yaml_word(value), spelled, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"{origin}: '{key}' must be one of [{', '.join(spelled)}], got {value!r}{hint}")
    if origin_tp in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{origin}: '{key}' must be a list, got {value!r}")
        return [_coerce(v, args[0], key, origin) for v in value] if args else list(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{origin}: '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{origin}: '{key}' must be an integer, got {value!r}")
    if tp is float:
        return _to_float(value, key, origin)
    if tp is str:
        if raw is not None:
            return str(raw)
        if isinstance(value, str):
            return value
        raise ConfigError(f"{origin}: '{key}' must be a string, got {value!r}")
    raise ConfigError(f"{origin}: '{key}' has an unsupported type {tp!r}")


def _yaml_word(value) -> str:
    """How a Literal's value is written in YAML or on the command line: ``'auto'``, ``true``, ``2``."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _to_float(value, key: str, origin: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{origin}: '{key}' must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        # NOTE: YAML 1.1 reads "1e-6" and "inf" as strings; accept what float() accepts.
        try:
            return float(value.strip().replace("∞", "inf"))
        except ValueError:
            pass
    raise ConfigError(f"{origin}: '{key}' must be a number (inf allowed), got {value!r}")


def validate(cfg: TrainConfig, origins: Optional[dict] = None) -> None:
    """Every number in its range and the rules between keys (``fastcredit.config.checks``); ``origins``: key →
    where it was set (file and line, or the command line), named in the error."""
    check_config(cfg, origins or {})


def to_dict(cfg) -> dict:
    """Plain nested dict (``inf`` kept as a float)."""
    return dataclasses.asdict(cfg)


def flat_dict(d: dict, prefix: str = "") -> dict:
    """``{"optim": {"lr": 1}}`` → ``{"optim.lr": 1}``."""
    out = {}
    for k, v in d.items():
        out.update(flat_dict(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_drift(before, now, ignore: typing.Sequence[str] = ()) -> list[str]:
    """``key: before → now`` for every key where two configs differ, sorted; ``ignore`` holds keys, and prefixes
    ending in ``.`` (a whole section), left out of the comparison."""
    a, b = flat_dict(to_dict(before)), flat_dict(to_dict(now))

    def ignored(key: str) -> bool:
        return any(key == i or (i.endswith(".") and key.startswith(i)) for i in ignore)

    return [f"{k}: {a.get(k)!r} → {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if not ignored(k) and a.get(k) != b.get(k)]


def dump_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)


def save_config(cfg, path: str) -> None:
    """Write the merged config atomically (it is saved with every run)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(dump_yaml(cfg))
    os.replace(tmp, path)
