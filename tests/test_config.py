import sys
import types
from dataclasses import dataclass, field

import pytest
import torch

from codraft.config import Config, ConfigError, config_to_dict, load_config, require, save_config, with_overrides


@pytest.fixture
def presets(monkeypatch):
    """The preset names from codraft.models.presets; a stand-in module until that file lands."""
    try:
        from codraft.models.presets import PRESETS
    except ImportError:
        PRESETS = {"smollm2-135m": None, "tiny-llama": None, "tiny-qwen3": None}
        monkeypatch.setitem(sys.modules, "codraft.models.presets", types.SimpleNamespace(PRESETS=PRESETS))
    return list(PRESETS)


def error(yaml_path=None, overrides=(), cls=Config) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(yaml_path, list(overrides), cls=cls)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_defaults_load_and_validate(presets):
    cfg = load_config(None, [])
    assert cfg == Config()
    assert cfg.model.path in presets
    assert cfg.run.dir is None and cfg.generate.drafter == "none"


def test_overrides_of_nested_values_are_coerced(presets):
    cfg = load_config(
        None,
        [
            "generate.temperature=0.5",
            "generate.top_k=20",
            "run.tensorboard=false",
            "generate.adaptive=no",
            "parallel.dp=2",
            "model.dtype=bfloat16",
            "model.device=cuda:1",
            "run.dir=/tmp/x",
        ],
    )
    assert cfg.generate.temperature == 0.5 and isinstance(cfg.generate.temperature, float)
    assert cfg.generate.top_k == 20 and cfg.parallel.dp == 2
    assert cfg.run.tensorboard is False and cfg.generate.adaptive is False
    assert (cfg.model.dtype, cfg.model.device, cfg.run.dir) == ("bfloat16", "cuda:1", "/tmp/x")


def test_override_int_for_float_and_later_override_wins(presets):
    cfg = load_config(None, ["generate.temperature=2", "generate.temperature=0"])
    assert cfg.generate.temperature == 0.0 and isinstance(cfg.generate.temperature, float)


@dataclass
class TapsConfig:
    layers: list[int] = field(default_factory=lambda: [1, 2])
    names: list[str] = field(default_factory=list)
    limit: int | None = 3

    def validate(self) -> None:
        require(all(i >= 0 for i in self.layers), "taps.layers", "non-negative layer ids", self.layers)


@dataclass
class ExtendedConfig(Config):
    """Adding a section is adding a field."""

    taps: TapsConfig = field(default_factory=TapsConfig)


def test_overrides_of_lists_and_null(presets):
    cfg = load_config(None, ["taps.layers=[3, 7, 11]", "taps.names=[a, b]", "taps.limit=null"], cls=ExtendedConfig)
    assert cfg.taps == TapsConfig(layers=[3, 7, 11], names=["a", "b"], limit=None)
    assert load_config(None, ["taps.limit=5", "taps.layers=[]"], cls=ExtendedConfig).taps.limit == 5
    run_dir = load_config(None, ["run.dir=null"]).run.dir
    assert run_dir is None


def test_bad_list_names_key_and_element(presets):
    assert error(overrides=["taps.layers=3"], cls=ExtendedConfig) == (
        "config key 'taps.layers' expects list[int] (e.g. [1, 2]), got 3"
    )
    assert error(overrides=["taps.layers=[1, x]"], cls=ExtendedConfig) == (
        "config key 'taps.layers[1]' expects int, got 'x'"
    )
    assert "taps.layers" in error(overrides=["taps.layers=[-1]"], cls=ExtendedConfig)


def test_unknown_override_key_names_key_and_valid_keys(presets):
    message = error(overrides=["generate.temprature=0.5"])
    assert message.startswith("unknown config key 'generate.temprature'; valid keys in 'generate': ")
    assert "max_new_tokens, temperature, top_p" in message
    assert message.endswith("(did you mean 'temperature'?)")


def test_unknown_section_names_valid_sections(presets):
    message = error(overrides=["genrate.temperature=0.5"])
    assert message == (
        "unknown config key 'genrate.temperature'; valid keys at top level: "
        "run, model, generate, parallel, bench, draft, task, rl, optim, checkpoint, draft_train, export "
        "(did you mean 'generate'?)"
    )


def test_unknown_yaml_key_gets_the_same_error(presets, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("generate:\n  temprature: 0.5\n")
    assert error(path) == error(overrides=["generate.temprature=0.5"])


def test_yaml_then_overrides(presets, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("generate:\n  temperature: 0.7\n  top_p: 0.9\n  drafter: ngram\nrun:\nparallel: {cp: 2}\n")
    cfg = load_config(path, ["generate.top_p=0.8"])
    assert (cfg.generate.temperature, cfg.generate.top_p, cfg.generate.drafter) == (0.7, 0.8, "ngram")
    assert cfg.parallel.cp == 2 and cfg.run == Config().run


def test_bad_type_names_key_and_expected_type(presets, tmp_path):
    assert error(overrides=["generate.top_k=abc"]) == "config key 'generate.top_k' expects int, got 'abc'"
    assert error(overrides=["generate.top_k=1.5"]) == "config key 'generate.top_k' expects int, got '1.5'"
    assert error(overrides=["run.tensorboard=maybe"]) == "config key 'run.tensorboard' expects bool, got 'maybe'"
    assert error(overrides=["generate.top_p=high"]) == "config key 'generate.top_p' expects float, got 'high'"
    assert load_config(None, ["run.dir=007"]).run.dir == "007"  # a str keeps the raw text
    path = tmp_path / "c.yaml"
    path.write_text("generate:\n  batch_size: true\n")
    assert error(path) == "config key 'generate.batch_size' expects int, got True"


def test_bad_literal_lists_the_choices(presets):
    assert error(overrides=["generate.drafter=foo"]) == (
        "config key 'generate.drafter' must be one of: none, ngram, eagle3, dflash, dspark (got 'foo')"
    )
    assert "float32, bfloat16, float16" in error(overrides=["model.dtype=fp8"])
    assert error(overrides=["rl.verification=joint"]) == (
        "config key 'rl.verification' must be one of: block, token (got 'joint')"
    )


def test_missing_model_path_names_path_and_presets(presets):
    message = error(overrides=["model.path=xyz"])
    assert message == (
        f"model.path: 'xyz' is neither a preset ({', '.join(presets)}) nor an existing file or directory"
    )
    assert "tiny-llama" in message and "smollm2-135m" in message


def test_existing_model_path_is_accepted(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    (tmp_path / "config.json").write_text("{}")
    assert load_config(None, [f"model.path={gguf}"]).model.path == str(gguf)
    assert load_config(None, [f"model.path={tmp_path}"]).model.path == str(tmp_path)


def test_a_model_path_that_is_no_model_is_a_one_line_error(tmp_path):
    assert error(overrides=[f"model.path={tmp_path}"]) == (
        f"model.path: '{tmp_path}' is a directory without config.json, not a Hugging Face checkpoint directory"
    )
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    assert error(overrides=[f"model.path={notes}"]) == f"model.path: '{notes}' is a file but not a .gguf model"


@pytest.mark.parametrize(
    "override, key",
    [
        ("generate.temperature=-0.1", "generate.temperature"),
        ("generate.top_p=0", "generate.top_p"),
        ("generate.top_p=1.5", "generate.top_p"),
        ("generate.top_p=nan", "generate.top_p"),
        ("generate.num_speculative_tokens=-1", "generate.num_speculative_tokens"),
        ("generate.max_new_tokens=0", "generate.max_new_tokens"),
        ("parallel.cp=0", "parallel.cp"),
        ("rl.max_dropped_share=1.5", "rl.max_dropped_share"),
        ("rl.max_dropped_steps=-1", "rl.max_dropped_steps"),
    ],
)
def test_range_checks_name_the_key(presets, override, key):
    assert error(overrides=[override]).startswith(f"config key '{key}' must be ")


def test_range_check_message(presets):
    assert error(overrides=["generate.top_p=0"]) == "config key 'generate.top_p' must be in (0, 1] (got 0.0)"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("generate", "override 'generate' must look like key=value (e.g. generate.temperature=0.7)"),
        ("=3", "override '=3' must look like key=value (e.g. generate.temperature=0.7)"),
        (
            "generate=3",
            "config key 'generate' is a section; set one of its keys: max_new_tokens, temperature, top_p, "
            "top_k, num_speculative_tokens, drafter, adaptive, verification, batch_size, chat_template, prompt, "
            "prompts_file, draft_path",
        ),
        ("generate.top_k.x=3", "config key 'generate.top_k' is a value, not a section; cannot set 'generate.top_k.x'"),
    ],
)
def test_malformed_overrides(presets, override, expected):
    assert error(overrides=[override]) == expected


def test_bad_yaml_files(presets, tmp_path):
    assert error(tmp_path / "missing.yaml").startswith(f"cannot read config file '{tmp_path / 'missing.yaml'}'")
    path = tmp_path / "c.yaml"
    path.write_text("generate: 3\n")
    assert error(path) == "config section 'generate' must be a mapping of keys, got 3"
    path.write_text("- 1\n")
    assert error(path) == "config file must be a mapping of keys, got [1]"
    path.write_text("generate: {top_k: [\n")
    assert error(path).startswith(f"config file '{path}' is not valid YAML: ")


def test_save_config_round_trip(presets, tmp_path):
    cfg = load_config(None, ["generate.temperature=0", "run.dir=runs/x", "taps.limit=null"], cls=ExtendedConfig)
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml", [], cls=ExtendedConfig) == cfg
    assert config_to_dict(cfg)["taps"] == {"layers": [1, 2], "names": [], "limit": None}


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["task.operators=+*"], "task.operators"),
        (["task.chain_min_terms=1"], "task.chain_min_terms"),
        (["task.chain_min_terms=6", "task.chain_max_terms=5"], "task.chain_max_terms"),
    ],
)
def test_chain_task_keys_are_checked_only_for_the_chain_task(presets, overrides, key):
    assert error(overrides=["task.kind=chain", *overrides]).startswith(f"config key '{key}' must be ")
    load_config(None, overrides)  # other kinds ignore the chain keys (arithmetic accepts '*')


def test_with_overrides_builds_a_checked_copy_and_leaves_the_original(presets):
    base = load_config(None, ["rl.steps=7"])
    cfg = with_overrides(base, ["draft.family=none", "rl.draft_weight=0"])
    assert (cfg.draft.family, cfg.rl.draft_weight, cfg.rl.steps) == ("none", 0.0, 7)
    assert isinstance(cfg.rl.draft_weight, float) and base == load_config(None, ["rl.steps=7"])
    with pytest.raises(ConfigError, match=r"^config key 'rl.draft_weight' must be >= 0 \(got -1.0\)$"):
        with_overrides(base, ["rl.draft_weight=-1"])
    with pytest.raises(ConfigError, match="unknown config key 'rl.draft_wieght'"):
        with_overrides(base, ["rl.draft_wieght=0"])


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["bench.e2e_families=[eagle3, medusa]"], "bench.e2e_families"),
        (["bench.e2e_families=[dflash, dflash]"], "bench.e2e_families"),
        (["bench.e2e_frozen=medusa"], "bench.e2e_frozen"),
        (["bench.e2e_families=[dflash]", "bench.e2e_frozen=eagle3"], "bench.e2e_frozen"),
    ],
)
def test_bench_e2e_variant_keys_name_the_key(presets, overrides, key):
    assert error(overrides=overrides).startswith(f"config key '{key}' must be ")


# --- rules that span sections, checked at load (one case per rule, asserting its message) ---

CROSS_SECTION_RULES = {
    "dp-filter": (["parallel.dp=2", "rl.filter_zero_variance=true"],
                  "rl.filter_zero_variance=true needs parallel.dp=1 (got parallel.dp=2)"),
    "pp-microbatches-too-few": (["parallel.pp=4", "parallel.pp_microbatches=3"],
                                "parallel.pp_microbatches=3 cannot fill parallel.pp=4 pipeline stages"),
    "pp-microbatches-without-pp": (["parallel.pp_microbatches=2"],
                                   "parallel.pp_microbatches=2 applies to parallel.pp > 1 only"),
    "ref-path-without-beta": (["model.ref_path=tiny-llama"],
                              "model.ref_path=tiny-llama is the reference of the KL term, which rl.beta=0 turns off"),
    "ref-path-missing": (["rl.beta=0.1", "model.ref_path=nowhere"],
                         "model.ref_path: 'nowhere' is neither a preset"),
    "dspark-tv": (["draft.family=dspark", "draft.loss=tv"],
                  "draft.loss=tv with draft.family=dspark: DSpark adds its TV term itself"),
    "tap-layers-unsorted": (["draft.tap_layers=[2,0,1]"],
                            "'draft.tap_layers' must be strictly ascending: SGLang and vLLM concatenate"),
    "tap-layers-duplicated": (["draft.tap_layers=[0,1,1]"], "'draft.tap_layers' must be strictly ascending"),
}


@pytest.mark.parametrize("overrides,message", CROSS_SECTION_RULES.values(), ids=CROSS_SECTION_RULES.keys())
def test_a_rule_that_spans_sections_is_a_config_error_at_load_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=tiny-llama", *overrides])
    assert message in str(err.value)


def test_a_draft_dir_to_start_from_needs_a_draft_family_and_auto_does_not(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=f"checkpoint.draft_init={tmp_path} with draft.family=none: name"):
        load_config(None, ["draft.family=none", f"checkpoint.draft_init={tmp_path}"])
    assert load_config(None, ["draft.family=none"]).checkpoint.draft_init == "auto"  # the default: no draft, no-op


def test_the_rules_accept_their_valid_neighbours():
    for overrides in (["parallel.dp=2"], ["parallel.pp=2", "parallel.pp_microbatches=2"],
                      ["rl.beta=0.1", "model.ref_path=tiny-llama"], ["draft.family=dspark", "draft.loss=hard_ce"],
                      ["draft.family=none"], ["draft.tap_layers=[0,2,3]"]):
        load_config(None, ["model.path=tiny-llama", *overrides])


def test_every_key_that_names_a_draft_family_reads_the_one_list():
    import typing

    from codraft.config import DRAFT_FAMILIES, DraftConfig, ExportConfig, GenerateConfig
    from codraft.drafts.export import FAMILIES

    def values(section, key):
        return typing.get_args(typing.get_type_hints(section)[key])

    assert values(DraftConfig, "family") == (*DRAFT_FAMILIES, "none")
    assert values(GenerateConfig, "drafter") == ("none", "ngram", *DRAFT_FAMILIES)
    assert values(ExportConfig, "family") == ("any", *DRAFT_FAMILIES)
    assert sorted(FAMILIES) == sorted(DRAFT_FAMILIES)  # every family registers itself for export under its name


# --- rules that need the policy (tiny-llama: 4 layers, vocab 320), checked where it loads, before any run dir ---

POLICY_RULES = {
    "pp-over-layers": (["parallel.pp=5"], "config key 'parallel.pp' must be at most the policy's 4 layers"),
    "tap-outside-policy": (["draft.tap_layers=[1,2,7]"],
                           "config key 'draft.tap_layers' must be layers of the policy, in [0, 3] (got [7])"),
    "eagle3-two-taps": (["draft.family=eagle3", "draft.tap_layers=[1,2]"],
                        "config key 'draft.tap_layers' must be 3 layers for draft.family=eagle3 (SpecForge"),
    "mask-outside-vocab": (["draft.family=dflash", "draft.mask_token_id=320"],
                           "config key 'draft.mask_token_id' must be an id of the policy's vocabulary, in [0, 319]"),
    "ref-architecture": (["rl.beta=0.1", "model.ref_path=tiny-qwen3"],
                         "model.ref_path: tiny-qwen3 is not the architecture of model.path tiny-llama"),
}


@pytest.mark.parametrize("overrides,message", POLICY_RULES.values(), ids=POLICY_RULES.keys())
def test_a_rule_that_needs_the_policy_is_a_config_error_where_it_loads(overrides, message):
    from codraft.models import load_policy, policy_args

    cfg = load_config(None, ["model.path=tiny-llama", *overrides])  # the config alone passes
    for load in (load_policy, policy_args):  # the loaded policy, and its args read before a launch
        with pytest.raises(ConfigError) as err:
            load(cfg)
        assert message in str(err.value) and "\n" not in str(err.value), load.__name__


def test_the_policy_rules_accept_their_valid_neighbours():
    from codraft.models import load_policy, policy_args

    for overrides in (["parallel.pp=4"], ["draft.tap_layers=[0,2,3]"], ["draft.family=dflash", "draft.tap_layers=[1]"],
                      ["draft.family=dflash", "draft.mask_token_id=319"], ["rl.beta=0.1", "model.ref_path=tiny-llama"],
                      ["draft.family=none", "draft.tap_layers=[1,2]"]):
        cfg = load_config(None, ["model.path=tiny-llama", *overrides])
        assert load_policy(cfg)[0].args.num_layers == policy_args(cfg).num_layers == 4


@pytest.mark.parametrize("setting,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_the_policy_carries_the_rollout_matmul_dtype_of_model_inference_dtype(setting, dtype):
    from codraft.models import load_policy
    from codraft.models.linear import bf16_packing_available

    if not bf16_packing_available():
        dtype = torch.float32  # asked for, but oneDNN has no bf16 linear on this CPU (tests/models/test_linear.py)
    cfg = load_config(None, ["model.path=tiny-llama", f"model.inference_dtype={setting}"])
    assert load_policy(cfg)[0].inference_dtype == dtype


@pytest.mark.parametrize("layout", [[], ["parallel.pp=2"]], ids=["pp1", "pp2-before-relaunch"])
def test_codraft_train_refuses_a_policy_rule_before_writing_the_run_dir(tmp_path, capsys, layout):
    from codraft.cli import main

    run = tmp_path / "run"
    assert main(["train", "model.path=tiny-llama", "draft.tap_layers=[1,2,7]", *layout, f"run.dir={run}"]) == 2
    assert "'draft.tap_layers' must be layers of the policy" in capsys.readouterr().err
    assert not run.exists()
