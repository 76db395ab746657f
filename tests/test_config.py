"""Model configs compose, validate with one-line errors naming the key, and set the K3 schedule."""

import pytest

from megatron_k3.config import ConfigError, available_models, compose_run_config, load_model_config


def test_all_model_configs_load():
    names = available_models()
    for required in ["k3", "k3_small", "k3_tiny", "kimi_linear_48b", "kimi_linear_tiny"]:
        assert required in names
    for n in names:
        assert load_model_config(n).name == n


def test_k3_layer_schedule():
    cfg = load_model_config("k3")
    types = cfg.layer_types()
    mla_1based = [i + 1 for i, t in enumerate(types) if t == "mla"]
    assert mla_1based == list(range(4, 93, 4)) + [93]
    assert types.count("kda") == 69 and types.count("mla") == 24
    assert cfg.ffn_types()[0] == "dense" and set(cfg.ffn_types()[1:]) == {"moe"}
    assert cfg.num_attn_res_blocks == 8


def test_overrides_apply_with_or_without_prefix():
    cfg = load_model_config("k3_tiny", ["model.hidden_size=96", "top_k=2"])
    assert cfg.hidden_size == 96 and cfg.top_k == 2


@pytest.mark.parametrize("override,key", [
    ("model.top_k=99", "model.top_k"),
    ("model.hidden_size=-4", "model.hidden_size"),
    ("model.kda_gate=tanh", "model.kda_gate"),
    ("model.kda_gate_lower_bound=-7", "model.kda_gate_lower_bound"),
    ("model.no_such_key=1", "no_such_key"),
    ("model.num_layers=abc", "num_layers"),
])
def test_bad_overrides_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_model_config("k3_tiny", [override])
    msg = str(e.value)
    assert key in msg and "\n" not in msg


@pytest.mark.parametrize("overrides,match", [
    (["precision.grad_accum_dtype=fp16"], r"precision\.grad_accum_dtype='fp16'.*valid: fp32, bf16"),
    (["precision.grad_accum_dtype=bf16"], r"precision\.grad_accum_dtype='bf16'.*needs precision\.param_dtype=bf16"),
])
def test_bad_gradient_accumulation_dtype_names_the_key(overrides, match):
    """precision.grad_accum_dtype: fp32 or bf16, and bf16 only with bf16 weights (precision=fp32 here)."""
    with pytest.raises(ConfigError, match=match):
        compose_run_config(["model=k3_tiny"] + overrides)
    run, _, _ = compose_run_config(["model=k3_tiny", "precision=bf16", "precision.grad_accum_dtype=bf16"])
    assert run.precision.grad_accum_dtype == "bf16"


def test_unknown_model_lists_available():
    with pytest.raises(ConfigError, match="available"):
        load_model_config("k9")


@pytest.mark.parametrize("slots,limit", [(13, "[1, 12]"), (0, "[1, 12]")])
def test_bad_redundant_experts_name_the_key_and_the_limit(slots, limit):
    from megatron_k3.config import compose_run_config
    with pytest.raises(ConfigError) as e:
        compose_run_config(["model=k3_tiny", "parallel.ep=4", "train.micro_batch_size=1", "model.moe_overflow=balanced",
                            f"moe.redundant_experts={slots}"], world_size=4)
    assert "moe.redundant_experts" in str(e.value) and limit in str(e.value), str(e.value)
    run, _, _ = compose_run_config(["model=k3_tiny", "parallel.ep=4", "train.micro_batch_size=1",
                                    "model.moe_overflow=balanced"], world_size=4)
    assert run.moe.slots(run.model, run.parallel) == 4  # default: E/ep


def test_configs_hash_by_value_and_drop_the_cached_hash_when_copied():
    """The planner's caches key on ModelConfig / ClusterConfig by value: equal configs hash equal, a set field
    changes the hash, and a pickled or copied config recomputes it (string hashes differ between processes)."""
    import copy
    import dataclasses
    import pickle

    a, b = load_model_config("k3_tiny"), load_model_config("k3_tiny")
    assert a == b and hash(a) == hash(b)
    wider = dataclasses.replace(a, hidden_size=2 * a.hidden_size)
    assert hash(wider) != hash(a)
    b.hidden_size = wider.hidden_size  # set in place: the cached hash is dropped
    assert hash(b) == hash(wider)
    for c in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a)):
        assert "_hash" not in vars(c) and c == a and hash(c) == hash(a)


def test_train_steps_beside_epochs_is_refused_not_ignored():
    """train.epochs > 0 decides the step count: a train.steps given with it (train=sft sets epochs=2) is refused,
    naming the key and the way out; with train.epochs=0 the steps stand."""
    with pytest.raises(ConfigError, match=r"train\.steps=7: ignored while train\.epochs=2 .*train\.epochs=0"):
        compose_run_config(["train=sft", "data=chat", "train.steps=7"])
    run, _, _ = compose_run_config(["train=sft", "data=chat", "train.epochs=0", "train.steps=7"])
    assert run.train.steps == 7 and run.train.epochs == 0
    assert compose_run_config(["train=sft", "data=chat"])[0].train.epochs == 2  # the default steps: no complaint
