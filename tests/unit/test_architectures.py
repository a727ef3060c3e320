"""The architecture table (kernels/architectures.py): what it covers, what it refuses by name, and
the checked transformers patches that read it (transformers_adapter/patches.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from true_on_policy import tiny_assets
from true_on_policy.kernels import architectures, ops
from true_on_policy.kernels.architectures import UnsupportedFeatureError
from true_on_policy.transformers_adapter.forwards import patch_transformers, unpatch_transformers
from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION
from true_on_policy.patching import PatchTargetChanged
from true_on_policy.transformers_adapter import patches
from kernel_helpers import patched_transformers  # noqa: F401 (an autouse fixture)

REPO = Path(__file__).resolve().parents[2]


def _config(kind: str, **changes) -> dict:
    config = tiny_assets.tiny_model_config(kind).to_dict()
    config["architectures"] = [a.name for a in architectures.TABLE if a.model_type == config["model_type"]]
    config.update(changes)
    return config


# ----------------------------------------------------------------------------------------------
# covered
# ----------------------------------------------------------------------------------------------


def test_every_entry_has_a_tiny_model():
    """Adding an architecture means a table entry AND a tiny model the bitwise tests run."""
    covered = {architectures.check_config(tiny_assets.tiny_model_config(k)).architecture for k in tiny_assets.MODEL_KINDS}
    assert covered == set(architectures.names())


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("dense", dict(architecture="Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, tied_embeddings=False, num_kv_heads=2)),
        ("moe", dict(architecture="Qwen3MoeForCausalLM", moe=True, qk_norm=True)),
        ("qwen2", dict(architecture="Qwen2ForCausalLM", qkv_bias=True, o_bias=False, qk_norm=False, tied_embeddings=True)),
        ("llama", dict(architecture="LlamaForCausalLM", qkv_bias=False, rope_type="llama3", num_heads=4, num_kv_heads=1)),
        ("qwen35", dict(architecture="Qwen3_5ForCausalLM", qk_norm=True, moe=False, head_dim=32, rotary_dim=8,
                        linear_attention=(2, 4, 16, 16, 4), shared_expert=False,
                        layer_types=("linear_attention",) * 3 + ("full_attention",))),
        ("qwen35_moe", dict(architecture="Qwen3_5MoeForCausalLM", moe=True, shared_expert=True, rotary_dim=8,
                            linear_attention=(2, 4, 16, 16, 4))),
        ("dense", dict(rotary_dim=16, linear_attention=None, shared_expert=False)),
    ],
)
def test_the_tiny_models_features(kind, expected):
    features = architectures.check_config(tiny_assets.tiny_model_config(kind))
    assert {key: getattr(features, key) for key in expected} == expected


def test_llama_config_switches_its_biases():
    features = architectures.check_config(_config("llama", attention_bias=True, mlp_bias=True))
    assert (features.qkv_bias, features.o_bias, features.mlp_bias) == (True, True, True)


def test_old_style_rope_scaling_of_a_llama3_config_json():
    """Llama-3.1's config.json: ``rope_scaling`` + ``rope_theta`` (read as transformers reads them)."""
    config = _config("llama")
    del config["rope_parameters"]
    config.update(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert architectures.check_config(config).rope_type == "llama3"


def test_read_checkpoint_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_config("qwen2")))
    assert architectures.check_config(architectures.read_checkpoint(tmp_path)).architecture == "Qwen2ForCausalLM"
    (tmp_path / "config.json").write_text(json.dumps(_config("qwen2", use_sliding_window=True, sliding_window=32,
                                                                  max_window_layers=0, layer_types=None)))
    with pytest.raises(architectures.UncoveredModelError, match="Qwen2ForCausalLM: sliding window attention"):
        architectures.check_config(architectures.read_checkpoint(tmp_path))
    assert architectures.read_checkpoint("Qwen/Qwen2.5-Math-1.5B") is None  # a hub name: the engines check it


def test_inspect_checkpoint_judges_a_config_json_once(tmp_path):
    """The launch reader's one look at a checkpoint: its layer types as the table derives them (a Qwen3.5
    config.json without ``layer_types`` still has its Gated DeltaNet layers), and check_config's answer."""
    config = _config("qwen35")
    derived = architectures.check_config(config).layer_types
    del config["layer_types"]  # written by older exports: transformers derives the types from the interval
    (tmp_path / "config.json").write_text(json.dumps(config))
    checkpoint = architectures.inspect_checkpoint(tmp_path)
    assert checkpoint.layer_types == derived and "linear_attention" in checkpoint.layer_types
    assert checkpoint.features.linear_attention is not None and checkpoint.uncovered == ""
    assert "layer_types" not in checkpoint.config  # the twin: a reader of the raw keys finds no linear layers

    (tmp_path / "config.json").write_text(json.dumps(_config("qwen2", use_sliding_window=True, sliding_window=32,
                                                                  max_window_layers=0, layer_types=None)))
    refused = architectures.inspect_checkpoint(tmp_path)
    assert refused.features is None and "Qwen2ForCausalLM: sliding window attention" in refused.uncovered
    assert architectures.inspect_checkpoint("Qwen/Qwen2.5-Math-1.5B") is None


@pytest.mark.parametrize("kind", ["qwen2", "llama", "moe", "qwen35", "qwen35_moe"])
def test_transformers_reports_every_built_feature_vllm_reports(kind):
    """Both engines compare the same features with the table (rotary_dim included: Qwen3.5 rotates a part
    of each head); the twin: the transformers report without rotary_dim is refused."""
    from transformers import AutoModelForCausalLM

    from true_on_policy.transformers_adapter.forwards import built_features

    config = tiny_assets.tiny_model_config(kind)
    built = built_features(AutoModelForCausalLM.from_config(config))
    assert set(built) | {"mlp_bias"} == set(architectures.BUILT_FEATURES)
    architectures.check_built(architectures.check_config(config), built, "transformers")
    with pytest.raises(AssertionError, match="built features"):
        architectures.check_built(architectures.check_config(config),
                                  {k: v for k, v in built.items() if k != "rotary_dim"}, "transformers")


# ----------------------------------------------------------------------------------------------
# refused by name: architecture and feature (the twin of each: the unchanged config above passes)
# ----------------------------------------------------------------------------------------------

REFUSED = [
    ("qwen2", {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}, "architecture Gemma2ForCausalLM"),
    ("moe", {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}, "architecture Qwen2MoeForCausalLM"),
    ("dense", {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, "architecture DeepseekV3ForCausalLM"),
    ("qwen2", {"final_logit_softcapping": 30.0}, "Qwen2ForCausalLM: soft-capped logits"),
    ("llama", {"attn_logit_softcapping": 50.0}, "LlamaForCausalLM: soft-capped attention logits"),
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 1, "layer_types": None, "sliding_window": 32},
     "Qwen2ForCausalLM: sliding window attention (window 32, layers [1])"),
    ("llama", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16},
     "LlamaForCausalLM: sliding window attention"),
    ("llama", {"kv_lora_rank": 512}, "LlamaForCausalLM: multi-head latent attention"),
    ("moe", {"shared_expert_intermediate_size": 64}, "Qwen3MoeForCausalLM: shared experts"),
    ("qwen35", {"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
                "sliding_window": 8}, "Qwen3_5ForCausalLM: sliding window attention"),
    ("qwen35", {"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]},
     "Qwen3_5ForCausalLM: layer types ['mamba']"),
    ("dense", {"layer_types": ["linear_attention", "full_attention"]}, "Qwen3ForCausalLM: layer types ['linear_attention']"),
    ("qwen35", {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"},
     "Qwen3_5ForConditionalGeneration (a vision-language checkpoint, model_type 'qwen3_5') is not covered; pass its "
     "text model"),
    ("qwen35_moe", {"architectures": [], "model_type": "qwen3_5_moe"}, "Qwen3_5MoeForConditionalGeneration"),
    ("qwen35", {"attn_output_gate": False}, "Qwen3_5ForCausalLM: attn_output_gate=false"),
    ("qwen35_moe", {"norm_topk_prob": False}, "Qwen3_5MoeForCausalLM: norm_topk_prob=false"),
    ("qwen35", {"attention_bias": True}, "Qwen3_5ForCausalLM: attention_bias=true"),
    ("qwen35", {"linear_num_value_heads": 3}, "Qwen3_5ForCausalLM: 3 Gated DeltaNet value heads over 2 key heads"),
    ("qwen35", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1},
                "partial_rotary_factor": 0.1}, "Qwen3_5ForCausalLM: partial_rotary_factor=0.1 gives 3 rotated features"),
    # Qwen3_5*TextConfig writes a top-level 0.25 beside rope_parameters' factor; the engines read different ones
    ("qwen35", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "Qwen3_5ForCausalLM: partial_rotary_factor=0.25 differs from rope_parameters.partial_rotary_factor=0.5"),
    ("qwen35", {"num_experts": 8}, "Qwen3_5ForCausalLM: num_experts=8 on a dense architecture"),
    ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "Qwen2ForCausalLM: RoPE scaling 'yarn'"),
    # vLLM builds MRotaryEmbedding for these text models and refuses it at load (twin: Qwen3.5's text models, covered)
    ("dense", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}},
     "Qwen3ForCausalLM: multimodal RoPE (MRotaryEmbedding, rope_parameters.mrope_section=[4, 2, 2]"),
    ("llama", {"rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2]}, "rope_parameters": None},
     "LlamaForCausalLM: multimodal RoPE (MRotaryEmbedding"),
    ("qwen2", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     "Qwen2ForCausalLM: RoPE scaling 'llama3'"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0}},
     "LlamaForCausalLM: RoPE scaling 'llama3' without"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}}, "RoPE scaling 'dynamic'"),
    ("llama", {"partial_rotary_factor": 0.5}, "LlamaForCausalLM: partial rotary factor 0.5"),
    ("dense", {"hidden_act": "gelu"}, "Qwen3ForCausalLM: activation 'gelu'"),
    ("qwen2", {"head_dim": 32}, "Qwen2ForCausalLM: head_dim=32 other than hidden_size/num_attention_heads=16"),
    ("qwen2", {"qk_norm": True}, "Qwen2ForCausalLM: q/k norm"),
    ("dense", {"attention_bias": True}, "Qwen3ForCausalLM: attention_bias=true"),
    ("llama", {"qkv_bias": True}, "LlamaForCausalLM: qkv_bias"),
    ("llama", {"logit_scale": 0.5}, "LlamaForCausalLM: logit scale 0.5"),
    ("qwen2", {"attention_dropout": 0.1}, "Qwen2ForCausalLM: attention dropout 0.1"),
    ("qwen2", {"is_causal": False}, "Qwen2ForCausalLM: non-causal attention"),
    ("llama", {"quantization_config": {"quant_method": "fp8"}}, "LlamaForCausalLM: quantized weights"),
    ("dense", {"num_experts": 8}, "Qwen3ForCausalLM: num_experts=8 on a dense architecture"),
    # transformers 5's key for the expert count (Qwen3-MoE's config.json as it writes it)
    ("qwen2", {"num_local_experts": 8}, "Qwen2ForCausalLM: num_local_experts=8 on a dense architecture"),
]


@pytest.mark.parametrize(("kind", "changes", "named"), REFUSED, ids=[r[2].split(": ")[-1][:40] for r in REFUSED])
def test_uncovered_is_refused_naming_architecture_and_feature(kind, changes, named):
    with pytest.raises(architectures.UncoveredModelError) as raised:
        architectures.check_config(_config(kind, **changes))
    assert named in str(raised.value)
    assert isinstance(raised.value, ValueError)  # a bad config: the launch exits 2 on it
    assert isinstance(raised.value, UnsupportedFeatureError)  # the engines' error type


MROPE = {"mrope_section": [2, 1, 1]}  # the tiny Qwen3.5's 4 rotated frequencies, as a real checkpoint's [11, 11, 10]


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("kind", ["qwen35", "qwen35_moe"])
def test_qwen35_text_config_with_mrope_keys_is_covered_as_without(kind, interleaved):
    """A real Qwen3.5 checkpoint's text config carries ``rope_parameters.mrope_section`` and
    ``mrope_interleaved``: covered, with the features of the config without them (vLLM drops the keys
    for the text model and runs 1-D RoPE; the launch vLLM accepts, ``check`` accepts). The twins: the
    same keys on another architecture are refused as vLLM refuses them (REFUSED, ``MRotaryEmbedding``)."""
    plain = _config(kind)
    rope = {**plain["rope_parameters"], **MROPE, "mrope_interleaved": interleaved}
    assert architectures.check_config(_config(kind, rope_parameters=rope)) == architectures.check_config(plain)


@pytest.mark.parametrize("interleaved", [True, False])
@torch.no_grad()
def test_qwen35_mrope_keys_change_no_training_bit(interleaved):
    """The training forward (flag on) of a Qwen3.5 text model whose config carries the mRoPE keys has the
    bits of the same weights without them: transformers feeds its rotary embedding three equal position
    rows for text, one row of the one RoPE table. Twin: rows that differ (image tokens) are refused by name."""
    from transformers import AutoModelForCausalLM

    from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION

    plain = tiny_assets.tiny_model_config("qwen35")
    config = tiny_assets.tiny_model_config("qwen35")
    config.rope_parameters = {**config.rope_parameters, **MROPE, "mrope_interleaved": interleaved}
    models = []
    for each in (plain, config):
        model = AutoModelForCausalLM.from_config(each, dtype=torch.float32).eval()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        models.append(model)
    models[1].load_state_dict(models[0].state_dict())
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    rows = torch.arange(40)[None, None].expand(3, 1, -1).clone()
    with ops.consistent(True):
        logits = [model(input_ids=ids, position_ids=rows[0], use_cache=False).logits for model in models]
        assert torch.equal(logits[0], logits[1])
        assert torch.equal(models[1](input_ids=ids, position_ids=rows, use_cache=False).logits, logits[1])
        rows[1, 0, 5:] = 0  # an image's height rows
        with pytest.raises(NotImplementedError, match="multimodal RoPE with position rows that differ"):
            models[1](input_ids=ids, position_ids=rows, use_cache=False)


def test_training_engine_refuses_before_building_the_model():
    """Flag on: the patched causal LM's __init__ refuses the config; flag off the same config builds."""
    from transformers import AutoModelForCausalLM

    config = tiny_assets.tiny_model_config("qwen2")
    config.final_logit_softcapping = 30.0
    with ops.consistent(True), pytest.raises(architectures.UncoveredModelError, match="soft-capped logits"):
        AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION)
    with ops.consistent(False):
        AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION)


def test_a_built_model_unlike_its_entry_is_refused():
    """The entry has teeth: a Qwen2 whose q/k/v projections lost their bias is not what the table
    describes. Twin: the same model as built runs."""
    model = tiny_assets.build_model("qwen2")
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids = torch.tensor([[5, 6, 7, 8]])
    with ops.consistent(True):
        model(input_ids=ids, use_cache=False)
    model.model.layers[0].self_attn.q_proj.bias = None
    model.__dict__.pop("_true_on_policy_checked")
    with ops.consistent(True), pytest.raises(UnsupportedFeatureError, match="qkv_bias: built False, described True"):
        model(input_ids=ids, use_cache=False)


# ----------------------------------------------------------------------------------------------
# RoPE scalings: one fp32 table, as transformers computes the frequencies
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
], ids=["llama3", "linear"])
def test_rope_table_matches_transformers_scalings(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=1024,
                         rope_parameters=rope)
    cos, sin = ops.rope_table(config)
    unpatch_transformers()  # transformers' own rotary module
    try:
        hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(1024)[None])
    finally:
        patch_transformers()
    torch.testing.assert_close(cos, hf_cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, hf_sin[0], rtol=1e-5, atol=1e-5)
    default = ops.rope_table(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=1024,
                                         rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"]}))
    assert not torch.equal(cos, default[0])  # the scaling changes the table


# ----------------------------------------------------------------------------------------------
# the transformers patches: one checked module
# ----------------------------------------------------------------------------------------------


def test_every_transformers_target_matches_the_installed_release():
    import transformers

    assert transformers.__version__ in patches.TRANSFORMERS_VERSIONS
    names = patches.check_targets()
    for arch in architectures.TABLE:
        prefix = f"{arch.transformers_module}.{arch.transformers_prefix}"
        assert {f"{prefix}RMSNorm.forward", f"{prefix}ForCausalLM.__init__", f"{prefix}Attention.forward",
                f"{arch.transformers_module}.apply_rotary_pos_emb"} <= set(names)
    # 8 roles each; + router and experts of an MoE, + its shared-expert block, + 3 for Gated DeltaNet layers
    assert len(names) == len(set(names)) == sum(len(patches.classes(arch)) for arch in architectures.TABLE)
    assert len(names) == 8 * len(architectures.TABLE) + 2 * 2 + 1 + 3 * 2


def test_a_changed_target_is_refused_by_name_before_anything_is_patched(monkeypatch):
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    unpatch_transformers()
    original_norm = modeling_qwen3.Qwen3RMSNorm.forward
    try:
        monkeypatch.setattr(modeling_qwen2.Qwen2MLP, "forward", lambda self, x, scale: x)  # transformers changed it
        with pytest.raises(PatchTargetChanged, match=r"modeling_qwen2\.Qwen2MLP\.forward: its parameters"):
            patch_transformers()
        assert not patches.applied() and modeling_qwen3.Qwen3RMSNorm.forward is original_norm
        monkeypatch.undo()
        patch_transformers()  # twin: the unchanged target patches
        assert patches.applied() and modeling_qwen3.Qwen3RMSNorm.forward is not original_norm
    finally:
        patch_transformers()


def test_a_registry_without_its_mapping_is_refused(monkeypatch):
    from transformers import AttentionInterface

    monkeypatch.setattr(AttentionInterface, "_global_mapping", None)
    with pytest.raises(PatchTargetChanged, match="AttentionInterface._global_mapping"):
        patches.check_targets()


def test_the_kernels_patch_nothing_and_only_the_patches_module_reads_private_registries():
    """The module code (kernels/) sets no attribute of another module; transformers' private
    ``_global_mapping`` is touched by the patches module alone."""
    offenders = []
    for path in sorted((REPO / "true_on_policy").rglob("*.py")):
        if path.match("transformers_adapter/patches.py"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if "_global_mapping" in code or ("kernels" in path.relative_to(REPO).parts and "setattr(" in code):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []


# ----------------------------------------------------------------------------------------------
# before any engine starts: verl's launch (before Ray) and the logdiff CLI
# ----------------------------------------------------------------------------------------------


def test_the_launch_refuses_an_uncovered_checkpoint_before_ray(tmp_path, capsys, monkeypatch):
    """Twin: the shipped Qwen2 config passes the same launch."""
    import os

    from true_on_policy.cli.check import compose_config
    from true_on_policy.verl_adapter import launch

    for key in list(os.environ):
        monkeypatch.setenv(key, os.environ[key])  # apply_verdict exports into os.environ: restore it after
    (tmp_path / "config.json").write_text(json.dumps(_config("qwen2", final_logit_softcapping=30.0)))
    uncovered = compose_config(str(REPO / "configs"), "cpu_tiny_qwen2_vllm", [f"actor_rollout_ref.model.path={tmp_path}"])
    with pytest.raises(SystemExit) as exited:
        launch.launch_hook(uncovered)
    assert exited.value.code == 2
    assert "Qwen2ForCausalLM: soft-capped logits" in capsys.readouterr().err
    covered = compose_config(str(REPO / "configs"), "cpu_tiny_qwen2_vllm")
    verdict = launch.launch_verdict(covered)
    assert verdict.code == 0, verdict.text
    env = launch.apply_verdict(covered, verdict)
    assert env["VLLM_TARGET_DEVICE"] == "cpu"


def test_logdiff_refuses_an_uncovered_checkpoint_before_starting_an_engine(tmp_path, capsys):
    from true_on_policy.cli import logdiff

    (tmp_path / "config.json").write_text(json.dumps(_config("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                                       "rope_theta": 1e6})))
    with pytest.raises(SystemExit) as exited:
        logdiff.main(["--engine", "vllm", "--model", str(tmp_path)])
    assert exited.value.code == 2
    assert "LlamaForCausalLM: RoPE scaling 'yarn'" in capsys.readouterr().err


def test_the_tiny_qwen2_tokenizer_survives_transformers_qwen2_tokenizer(tmp_path):
    """transformers loads a ``model_type: qwen2`` checkpoint's tokenizer as Qwen2Tokenizer (byte-level
    BPE): the tiny Qwen2's byte-level form gives the shared character ids. Twin: the plain form loses
    every space and newline (verl's agent loop then refuses the tokenizer)."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Reverse: hello world\n"}]
    expected = tiny_assets.build_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    tiny_assets.tiny_model_config("qwen2").save_pretrained(tmp_path)
    loaded = {}
    for byte_level in (True, False):
        tiny_assets.build_tokenizer(byte_level=byte_level).save_pretrained(tmp_path)
        tokenizer = AutoTokenizer.from_pretrained(tmp_path)
        assert type(tokenizer).__name__ == "Qwen2Tokenizer"
        loaded[byte_level] = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert list(loaded[True]["input_ids"]) == list(expected["input_ids"])
    assert len(loaded[False]["input_ids"]) < len(expected["input_ids"])
