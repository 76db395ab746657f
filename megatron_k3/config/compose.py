"""Composition: `conf/` (Hydra groups) onto the typed schema, command-line overrides, one-line errors.

`load_model_config(name, overrides)` composes one model YAML (no run); `compose_run_config(overrides, world)`
composes the whole run and validates it for a world of `world` ranks; `compose_config(overrides)` composes without
the run's validation (for tools such as the planner that check a layout themselves). Every mistake Hydra or
OmegaConf reports is reduced to one `ConfigError` line naming the key the user typed.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Iterable

from omegaconf import OmegaConf

from ..errors import ConfigError, one_line
from .schema import ModelConfig, RunConfig, VisionConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # megatron_k3/conf (the repository's conf/ links to it)


def _apply_overrides(cfg, overrides: Iterable[str], prefix: str):
    dotlist = []
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(ov, None, "an override must look like key=value")
        k, v = ov.split("=", 1)
        k = k.lstrip("+")
        if k.startswith(prefix + "."):
            k = k[len(prefix) + 1:]
        dotlist.append(f"{k}={v}")
    if dotlist:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist))
        except Exception as e:  # omegaconf raises several types; give one clear line
            raise ConfigError(_omegaconf_key(e, prefix), _omegaconf_value(e), _first_line(e)) from None
    return cfg


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _omegaconf_key(e, prefix):
    k = getattr(e, "full_key", None) or getattr(e, "key", None) or "?"
    return f"{prefix}.{k}" if prefix and not str(k).startswith(prefix) else str(k)


def _omegaconf_value(e):
    return getattr(e, "value", None)


def available_models() -> list:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def model_config_from_dict(d: dict, prefix: str = "model") -> ModelConfig:
    """Build and validate a ModelConfig from a plain mapping (e.g. a Hydra-composed `cfg.model`)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}", d[unknown[0]], "unknown key for the model config")
    d = {k: (list(v) if k == "mla_layers" else v) for k, v in d.items()}
    if isinstance(d.get("vision"), dict):
        vnames = {f.name for f in dataclasses.fields(VisionConfig)}
        bad = sorted(set(d["vision"]) - vnames)
        if bad:
            raise ConfigError(f"{prefix}.vision.{bad[0]}", d["vision"][bad[0]], "unknown key for the vision config")
        d["vision"] = VisionConfig(**{k: (list(v) if k == "merge_kernel_size" else v) for k, v in d["vision"].items()})
    cfg = ModelConfig(**d)
    return cfg.validate(prefix)


def load_model_config(name: str, overrides: Iterable[str] = ()) -> ModelConfig:
    """Compose `conf/model/<name>.yaml` onto the ModelConfig schema, apply `key=value` overrides
    (with or without a leading `model.`), validate, and return the dataclass. Starts no run."""
    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError("model", name, f"no file {path}; available: {', '.join(available_models())}")
    schema = OmegaConf.structured(ModelConfig)
    try:
        cfg = OmegaConf.merge(schema, OmegaConf.load(path))
    except Exception as e:
        raise ConfigError(_omegaconf_key(e, "model"), _omegaconf_value(e), f"{_first_line(e)} (in {path})") from None
    cfg = _apply_overrides(cfg, overrides, "model")
    return model_config_from_dict(OmegaConf.to_container(cfg, resolve=True))


def _register_schema():
    from hydra.core.config_store import ConfigStore  # hydra is imported by the composing tools only

    ConfigStore.instance().store(name="run_schema", node=RunConfig)


def compose_run_config(overrides: Iterable[str] = (), world_size: int = 1):
    """Compose conf/config.yaml with Hydra (schema-checked), apply command-line overrides, validate.
    Returns (RunConfig, the composed DictConfig without `hydra`, the hydra node). Raises ConfigError
    with a one-line message on any mistake."""
    run, cfg, hydra_node = compose_config(overrides)
    run.validate(world_size)
    return run, cfg, hydra_node


def compose_config(overrides: Iterable[str] = ()):
    """`compose_run_config` without the run's validation (the layout is not known yet): for tools such as
    the planner that check a layout themselves. Key names and types are still checked by the schema."""
    from hydra import compose, initialize_config_dir  # hydra is imported by the composing tools only
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="megatron_k3"):
            cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        hydra_node = cfg.hydra
        with open_dict(cfg):
            del cfg["hydra"]
        run = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as e:  # Hydra / OmegaConf errors are multi-line; reduce them to one line
        raise _one_line_error(e, overrides) from None
    finally:
        GlobalHydra.instance().clear()
    return run, cfg, hydra_node


def _one_line_error(e: Exception, overrides) -> ConfigError:
    from omegaconf.errors import OmegaConfBaseException

    chain, x = [], e
    while x is not None and len(chain) < 8:
        chain.append(x)
        x = x.__cause__ or x.__context__
    for x in chain:
        if isinstance(x, OmegaConfBaseException) and getattr(x, "full_key", None):
            msg = str(x).strip().splitlines()[0]
            key = x.full_key
            for o in overrides:  # report the override the user typed when it names this key or a child
                k = o.lstrip("+").split("=", 1)[0]
                if k == key or k.startswith(key + "."):
                    key = k
            given = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").split("=", 1)[0] == key), None)
            if "not in" in msg or "Key '" in msg:
                return ConfigError(key, given, f"unknown key{_did_you_mean(key, x.full_key)} ({msg}; every key: "
                                   f"megatron_k3/config/schema.py, or --help)")
            return ConfigError(key, given if given is not None else getattr(x, "value", None), msg)
    text = one_line(e)
    options = getattr(e, "options", None)
    missing = getattr(e, "missing_cfg_file", None)
    if missing and "/" in str(missing):
        group, name = str(missing).split("/", 1)
        avail = ", ".join(options) if options else "see conf/" + group
        near = difflib.get_close_matches(name, list(options or ()), n=1)
        hint = f"did you mean {group}={near[0]}? " if near else ""
        return ConfigError(group, name, f"no such option; {hint}available: {avail}")
    for o in overrides:
        k = o.lstrip("+").split("=", 1)[0]
        if k and f"'{k}'" in text or f"'{o}'" in text:
            return ConfigError(k, o.split("=", 1)[1] if "=" in o else None, text[:300])
    return ConfigError("config", None, text[:300])


def schema_keys(cls=RunConfig, prefix: str = "") -> dict:
    """{dotted key: its dataclass field} of every leaf key of the run schema (nested groups walked)."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out.update(schema_keys(t, key + "."))
        else:
            out[key] = f
    return out


def _did_you_mean(typed: str, unknown: str) -> str:
    """' (did you mean train.steps?)' for a typed key whose segment `unknown` (OmegaConf's full key of the first
    unknown segment) is near a schema key at that level, else ''."""
    parent = unknown.rpartition(".")[0]
    level = {k[len(parent) + 1 if parent else 0:].split(".")[0] for k in schema_keys()
             if not parent or k.startswith(parent + ".")}
    near = difflib.get_close_matches(unknown.rpartition(".")[2], sorted(level), n=1)
    if not near:
        return ""
    fixed = (f"{parent}.{near[0]}" if parent else near[0]) + typed[len(unknown):]
    return f"; did you mean {fixed}?"


def split_tool_args(argv: Iterable[str], switches=(), with_value=(), defaults=None, choices=None, repeated=()):
    """(overrides, flags) of a tool's command line: Hydra KEY=VALUE overrides; `switches` (True when given);
    flags `with_value` as `--flag V` or `--flag=V` (those in `repeated` collect a list); -h/--help as
    flags["help"]. ConfigError naming the flag for a missing value, a value outside its `choices`, or an argument
    that is none of these."""
    overrides, flags = [], {**(defaults or {}), **{k: [] for k in repeated}}
    it = iter(argv)
    for a in it:
        if a in ("-h", "--help"):
            flags["help"] = True
        elif a in switches:
            flags[a] = True
        elif a.split("=", 1)[0] in with_value:
            k, v = a.split("=", 1) if "=" in a else (a, next(it, None))
            if v is None:
                raise ConfigError(k, None, "needs a value")
            if k in repeated:
                flags[k].append(v)
            else:
                flags[k] = v
        elif "=" in a:
            overrides.append(a)
        else:
            raise ConfigError(a, None, "unexpected argument; use KEY=VALUE overrides and the flags in --help")
    for k, ok in (choices or {}).items():
        if k in flags and flags[k] not in ok:
            raise ConfigError(k, flags[k], "valid: " + ", ".join(ok))
    return overrides, flags


def replace(cfg: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(cfg, **changes).validate()


__all__ = ["CONF_DIR", "available_models", "model_config_from_dict", "load_model_config", "compose_config",
           "compose_run_config", "replace", "schema_keys", "split_tool_args"]
