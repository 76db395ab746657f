"""Composition: `conf/` (Hydra groups) onto the typed schema, command-line overrides, one-line errors.

`load_model_config(name, overrides)` composes one model YAML (no run); `compose_run_config(overrides, world)`
composes the whole run and validates it for a world of `world` ranks; `compose_config(overrides)` composes without
the run's validation (for tools such as the planner that check a layout themselves). Every mistake Hydra or
OmegaConf reports is reduced to one `ConfigError` line naming the key the user typed.

`model=from_checkpoint` has no shapes of its own: the composed run's model is read from `checkpoint.load`'s
config.json (a Kimi K3 or Kimi Linear Hugging Face directory) by the `model_reader` the caller passes (the entry
point passes megatron_k3.interop's, which this layer may not import), before anything reads `run.model`. Only the
runtime model keys (RUNTIME_MODEL_KEYS but the name) may be set beside it.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Iterable

from omegaconf import OmegaConf

from ..errors import ConfigError, one_line
from .schema import LOAD_FRESH, RUNTIME_MODEL_KEYS, ModelConfig, RunConfig, VisionConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # megatron_k3/conf (the repository's conf/ links to it)
FROM_CHECKPOINT = "from_checkpoint"  # model=from_checkpoint: the shapes of checkpoint.load's config.json
# the model keys model=from_checkpoint accepts beside it: those that change no tensor (config.schema's `runtime`)
CHECKPOINT_MODEL_KEYS = tuple(k for k in RUNTIME_MODEL_KEYS if k != "name")


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
    """The model configs with shapes of their own (conf/model/*.yaml but from_checkpoint)."""
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if p.stem != FROM_CHECKPOINT)


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
    if name == FROM_CHECKPOINT:
        raise ConfigError("model", name, "its shapes come from checkpoint.load's config.json: compose a run "
                          f"(model={name} checkpoint.load=DIR); available here: {', '.join(available_models())}")
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


def compose_run_config(overrides: Iterable[str] = (), world_size: int = 1, model_reader=None):
    """Compose conf/config.yaml with Hydra (schema-checked), apply command-line overrides, validate.
    Returns (RunConfig, the composed DictConfig without `hydra`, the hydra node). Raises ConfigError
    with a one-line message on any mistake. `model_reader(path) -> ModelConfig`: reads a Hugging Face
    directory's config.json, for model=from_checkpoint (module docstring)."""
    overrides = list(overrides)
    run, cfg, hydra_node = compose_config(overrides, model_reader)
    _check_steps_with_epochs(run, overrides)
    run.validate(world_size)
    return run, cfg, hydra_node


def _check_steps_with_epochs(run: RunConfig, overrides: list) -> None:
    """train.epochs > 0 sets the step count (training.loop), so a train.steps given on the command line beside it
    would be ignored: refuse it (train=sft sets epochs, a short run of it needs train.epochs=0)."""
    given = [o for o in overrides if o.lstrip("+").startswith("train.steps=")]
    if given and run.train.epochs:
        raise ConfigError("train.steps", run.train.steps, f"ignored while train.epochs={run.train.epochs:g} (train=sft "
                          f"sets it): the passes over the data decide the step count; add train.epochs=0 to run "
                          f"{run.train.steps} steps, or drop train.steps")


def compose_config(overrides: Iterable[str] = (), model_reader=None):
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
        _refuse_added_keys(cfg, overrides)
        run = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as e:  # Hydra / OmegaConf errors are multi-line; reduce them to one line
        raise _one_line_error(e, overrides) from None
    finally:
        GlobalHydra.instance().clear()
    if hydra_node.runtime.choices.get("model") == FROM_CHECKPOINT:
        run.model = model_from_checkpoint(run, overrides, model_reader)
        with open_dict(cfg):
            cfg.model = OmegaConf.structured(run.model)  # what --cfg prints and the run directory records
    return run, cfg, hydra_node


def model_from_checkpoint(run: RunConfig, overrides: Iterable[str], model_reader) -> ModelConfig:
    """model=from_checkpoint: the ModelConfig of `checkpoint.load`'s config.json, read by `model_reader`, with the
    runtime keys as composed (CHECKPOINT_MODEL_KEYS, the only model keys that may be given). One ConfigError line
    for an empty checkpoint.load, a path without config.json, a config.json our model cannot hold (its key and
    file), or a model key given beside it."""
    load = run.checkpoint.load
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if key.startswith("model.") and key[len("model."):] not in CHECKPOINT_MODEL_KEYS:
            raise ConfigError(key, o.split("=", 1)[1] if "=" in o else None,
                              f"model={FROM_CHECKPOINT} takes the model's shapes from checkpoint.load's config.json; "
                              f"beside it only these model keys may be set: {', '.join(CHECKPOINT_MODEL_KEYS)}")
    if load in ("auto",) + LOAD_FRESH:
        raise ConfigError("checkpoint.load", load, f"model={FROM_CHECKPOINT} needs checkpoint.load=DIR, a Kimi K3 or "
                          "Kimi Linear Hugging Face directory (config.json and safetensors weights)")
    config_json = Path(load) / "config.json"
    if not config_json.is_file():
        where = "no such directory" if not Path(load).exists() else f"no {config_json}"
        raise ConfigError("checkpoint.load", load, f"model={FROM_CHECKPOINT} needs a Kimi K3 or Kimi Linear Hugging "
                          f"Face directory: {where}")
    if model_reader is None:
        raise ConfigError("model", FROM_CHECKPOINT, "this tool composes without a checkpoint reader; use "
                          "megatron_k3.train or pass model_reader=megatron_k3.interop.checkpoint_model_config")
    try:
        cfg = model_reader(load)
    except ConfigError as e:  # a config.json key: named with the file
        key = e.key.replace("config.json", str(config_json), 1) if e.key.startswith("config.json") else e.key
        raise ConfigError(key, e.value, e.valid) from None
    except (ValueError, OSError) as e:
        raise ConfigError("checkpoint.load", load, one_line(e)) from None
    runtime = {k: getattr(run.model, k) for k in CHECKPOINT_MODEL_KEYS}
    return dataclasses.replace(cfg, name=FROM_CHECKPOINT, **runtime).validate("model")


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


def _refuse_added_keys(node, overrides, cls=RunConfig, prefix: str = "") -> None:
    """ConfigError for a key the schema does not have that a `+key=` or `++key=` override added (Hydra adds keys
    that way even to a schema-checked config, where `key=` is refused; OmegaConf then hands the unknown key on as an
    attribute nothing reads, so a misspelt or invented key would be silently ignored). Free-form dict fields
    (`parallel.deepspeed`) take any key."""
    hints = typing.get_type_hints(cls)
    for key in node:
        full = f"{prefix}{key}"
        if key not in hints:
            typed = next((o for o in overrides if o.lstrip("+~").split("=", 1)[0].startswith(full)), full)
            name, _, value = typed.lstrip("+~").partition("=")
            raise ConfigError(name, value or None, f"unknown key{_did_you_mean(name, full)} (an override with + adds "
                              "no key the schema lacks; every key: megatron_k3/config/schema.py, or --help)")
        if dataclasses.is_dataclass(hints[key]) and OmegaConf.is_dict(node[key]):
            _refuse_added_keys(node[key], overrides, hints[key], full + ".")


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


__all__ = ["CONF_DIR", "FROM_CHECKPOINT", "CHECKPOINT_MODEL_KEYS", "available_models", "model_config_from_dict",
           "load_model_config", "compose_config", "compose_run_config", "model_from_checkpoint", "replace",
           "schema_keys", "split_tool_args"]
