"""The Qwen3.5-35B-A3B example on CUDA (``configs/qwen35_35b_a3b_cuda.yaml``, ``examples/qwen35_35b_a3b/``), in process:
``check`` on the shipped config (its shapes: ``shapes/qwen35_35b_a3b/config.json``) names the rows no device run has
established; the layouts it refuses, each by key; the shapes are transformers' Qwen3.5-MoE defaults; the text model
of a vision-language checkpoint loads the same weights. The dry run of the run script: tests/engine/test_examples.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from check_runs import run_check, unverified_fields
from true_on_policy.cli.check import EXIT_OK, EXIT_REFUSED, EXIT_UNVERIFIED
from true_on_policy.kernels import architectures

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
CONFIG = "qwen35_35b_a3b_cuda"
SHAPES = CONFIGS / "shapes" / "qwen35_35b_a3b" / "config.json"
EXAMPLE = REPO / "examples" / "qwen35_35b_a3b"
# the rows a device run must establish: the project's kernels on CUDA, and the Gated DeltaNet's forward_cuda
UNVERIFIED_ROWS = {"attention", "gemm", "norm", "log_softmax", "gdn_forward"}
A, R, T = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "true_on_policy"


def _check(*overrides):
    return run_check(["--config-path", str(CONFIGS), "--config-name", CONFIG, *overrides])


def test_check_exits_3_naming_the_rows_no_device_run_has_established():
    code, out, err = _check()
    assert code == EXIT_UNVERIFIED, err
    assert unverified_fields(err) == UNVERIFIED_ROWS
    assert "MISMATCH" not in out
    assert "the adapter's forward_cuda runs the torch code of the Gated DeltaNet op" in err
    # the shapes were read: the hybrid model's rows are in the table, decided
    for title in ("Gated DeltaNet recurrent state dtype", "vLLM prefix caching (hybrid model)", "Ulysses SP"):
        assert title in out
    flags = [part for row in sorted(UNVERIFIED_ROWS) for part in ("--accept-unverified", row)]
    assert _check(*flags)[0] == EXIT_OK


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        # the GDN heads (16 key / 32 value) and the query heads split by SP 2 / 4 / 8; 32 is more than the 16 query heads
        ([f"{A}.fsdp_config.ulysses_sequence_parallel_size=32", "trainer.nnodes=4"],
         "the model's num_attention_heads=16 does not divide by ulysses_sequence_parallel_size=32"),
        # on a device stack TP must match (FSDP has none)
        ([f"{R}.tensor_model_parallel_size=2"], "TP (tensor parallel) [tp]"),
        # the recurrent state kept in bf16 would be rounded between steps
        ([f"{R}.engine_kwargs.vllm.mamba_ssm_cache_dtype=bfloat16"], "[ssm_state_dtype]"),
        ([f"{R}.enable_prefix_caching=true"], "[prefix_caching]"),
        # twins of the unverified verdict: flag off (the GDN all-to-all is the consistent kernels'), vLLM's own
        # kernels against the HF model's (kernels: engine), Ascend (vllm-ascend's own model runner and GDN)
        ([f"{T}.deterministic=false"], "the Gated DeltaNet layers all-to-all on the consistent kernels only"),
        ([f"{T}.kernels=engine"], "attention backend [attention]: training=consistent"),
        ([f"{T}.platform=ascend"], "true_on_policy.kernels='project': on platform ascend"),
    ],
)
def test_check_refuses_a_layout_the_kernels_or_the_heads_do_not_keep_naming_the_key(overrides, named):
    code, _, err = _check(*overrides)
    assert code == EXIT_REFUSED, err
    assert named in err
    assert "UNVERIFIED vLLM Gated DeltaNet forward" not in err


def test_gated_deltanet_heads_that_do_not_split_by_sp_are_refused_naming_the_gdn_key(tmp_path):
    """The example's shapes with 6 GDN key / 12 value heads (the query heads still 16): SP 4 splits the query heads
    and not the GDN's; check names the GDN key. Twin: the shipped shapes at SP 4 (the first test)."""
    shapes = json.loads(SHAPES.read_text()) | {"linear_num_key_heads": 6, "linear_num_value_heads": 12}
    (tmp_path / "config.json").write_text(json.dumps(shapes))
    code, _, err = _check(f"actor_rollout_ref.model.path={tmp_path}")
    assert code == EXIT_REFUSED, err
    assert "the model's linear_num_key_heads=6 does not divide by ulysses_sequence_parallel_size=4" in err


def test_the_shipped_shapes_are_transformers_qwen35_moe_defaults():
    """shapes/qwen35_35b_a3b/config.json: every value is Qwen3_5MoeTextConfig's default (transformers' "Qwen3.5-35B-A3B
    style" configuration), the text model the architecture table covers; 30 Gated DeltaNet + 10 full-attention layers."""
    from transformers import Qwen3_5MoeTextConfig

    shapes = json.loads(SHAPES.read_text())
    defaults = Qwen3_5MoeTextConfig().to_dict()
    assert {key: value for key, value in shapes.items() if key != "architectures"} == {
        key: defaults[key] for key in shapes if key != "architectures"}
    features = architectures.check_config(shapes)
    assert features.architecture == "Qwen3_5MoeForCausalLM" and features.shared_expert
    assert (features.num_heads, features.num_kv_heads, features.head_dim, features.rotary_dim) == (16, 2, 256, 64)
    assert features.linear_attention == (16, 32, 128, 128, 4)
    assert features.layer_types.count("linear_attention") == 30 and features.layer_types.count("full_attention") == 10
    assert (shapes["num_experts"], shapes["num_experts_per_tok"], shapes["moe_intermediate_size"],
            shapes["shared_expert_intermediate_size"]) == (256, 8, 512, 512)


def _text_model_module():
    spec = importlib.util.spec_from_file_location("text_model", EXAMPLE / "text_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_text_model_of_a_vision_language_checkpoint_loads_its_weights(tmp_path):
    """A tiny Qwen3.5-MoE vision-language checkpoint saved by transformers, refused by name by the architecture table;
    text_model.py's directory (the text_config as config.json, the weights linked) is covered and loads the language
    model's weights and head, torch.equal. Twin: a text config is not a vision-language one, refused by name."""
    import torch
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

    from true_on_policy import tiny_assets

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    config = Qwen3_5MoeConfig(text_config=tiny_assets.tiny_model_config("qwen35_moe").to_dict(), vision_config=vision,
                              architectures=["Qwen3_5MoeForConditionalGeneration"])
    torch.manual_seed(0)
    vision_language = Qwen3_5MoeForConditionalGeneration(config)
    vision_language.save_pretrained(tmp_path / "vl")
    assert "vision-language checkpoint" in architectures.inspect_checkpoint(tmp_path / "vl").uncovered
    text_model = _text_model_module()
    target = text_model.make_text_model(tmp_path / "vl", tmp_path / "text")
    assert architectures.inspect_checkpoint(target).uncovered == ""
    model = Qwen3_5MoeForCausalLM.from_pretrained(target)
    source = dict(vision_language.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, source[name if name == "lm_head.weight" else name.replace("model.", "model.language_model.", 1)]), name
    with pytest.raises(ValueError, match="architectures=\\['Qwen3_5MoeForCausalLM'\\]"):
        text_model.text_config(json.loads((target / "config.json").read_text()))
