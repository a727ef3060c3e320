"""Training forward (packed / padded / micro-batched) vs rollout (ragged prefill + decode over KV
caches) on the SAME transformers modules: bitwise-equal log-probs with the flag on, not with it off.
"""

from __future__ import annotations


import pytest
import torch

from true_on_policy.kernels.architectures import UnsupportedFeatureError
from true_on_policy.kernels.modules import ConsistentLMHead, ConsistentLinear
from true_on_policy.rollout.packed_forward import KVCache, forward_packed
from true_on_policy.transformers_adapter.forwards import patch_transformers, unpatch_transformers
from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION
from true_on_policy.kernels import ops
from true_on_policy.tiny_assets import build_model, tiny_model_config
from kernel_helpers import threads, patched_transformers  # noqa: F401 (patched_transformers: an autouse fixture)

# (prompt length, total length): mixed lengths, a 1-token prompt, and decode steps crossing the
# 64- and 128-token KV block boundaries; request 1's prompt is prefilled in two chunks (25 + 85)
REQUESTS = [(5, 23), (110, 140), (1, 12), (50, 70)]


@pytest.fixture(autouse=True)
def flag_off_after():
    yield
    ops.set_switches(consistent=False)


_MODELS: dict = {}


def _other_shapes(kind: str):
    """Models of other shapes than the shipped tiny ones (their architecture's other variants)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=160, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2, pad_token_id=0)
    if kind == "qwen2-untied-gqa3":  # untied head, 6 query heads over 2 kv heads, 3 layers
        config = Qwen2Config(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=160,
                             num_hidden_layers=3, rope_theta=1e6, **common)
    else:  # "llama-biased-tied-mha": attention and MLP biases, tied head, no GQA, head_dim 32, linear RoPE scaling
        config = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                             num_hidden_layers=2, attention_bias=True, mlp_bias=True,
                             rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                             **{**common, "tie_word_embeddings": True})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


OTHER_SHAPES = ["qwen2-untied-gqa3", "llama-biased-tied-mha"]


def model_for(kind: str, dtype: torch.dtype):
    if (kind, dtype) not in _MODELS:
        model = (_other_shapes(kind) if kind in OTHER_SHAPES else build_model(kind, seed=0)).to(dtype)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        _MODELS[kind, dtype] = model
    return _MODELS[kind, dtype]


def sequences():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (total,), generator=g) for _, total in REQUESTS]


def per_sequence_log_probs(logits_rows, seqs):
    """Split [sum(len), V] logits into each sequence's log-probs of its next tokens."""
    out, start = [], 0
    for s in seqs:
        out.append(ops.token_log_probs(logits_rows[start : start + len(s) - 1], s[1:]))
        start += len(s)
    return out


def train_packed(model, seqs):
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits[0]
    return per_sequence_log_probs(logits, seqs), logits.dtype


def train_padded(model, seqs, left=(3, 0, 6, 1)):
    """verl's use_remove_padding=False layout: left-padded prompts, right padding, cumsum positions."""
    width = max(len(s) + l for s, l in zip(seqs, left)) + 2
    ids = torch.full((len(seqs), width), 0)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, (s, l) in enumerate(zip(seqs, left)):
        ids[b, l : l + len(s)] = s
        mask[b, l : l + len(s)] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    rows = torch.cat([logits[b, l : l + len(s)] for b, (s, l) in enumerate(zip(seqs, left))])
    return per_sequence_log_probs(rows, seqs)


def train_micro_batches(model, seqs):
    """Each sequence in its own micro-batch (another batch composition)."""
    out = []
    for s in seqs:
        lp, _ = train_packed(model, [s])
        out += lp
    return out


def rollout(model, seqs):
    """Continuous batching: staggered admission, a chunked prefill, decode one token at a time.

    The rollout scores the given tokens (teacher forcing), so the log-probs are comparable.
    """
    caches = [KVCache() for _ in seqs]
    done = [0] * len(seqs)  # tokens already in the cache
    log_probs = [[] for _ in seqs]
    pending = {}  # request -> logits row predicting its next token
    admit = {0: 0, 1: 0, 2: 3, 3: 5}  # request -> step at which its prompt arrives
    step = 0
    while any(d < len(s) for d, s in zip(done, seqs)):
        segments = []
        for i, s in enumerate(seqs):
            if done[i] >= len(s) or admit[i] > step:
                continue
            if done[i] == 0:
                prompt = REQUESTS[i][0]
                n = prompt if i != 1 or step > 0 else 25  # request 1: prefill in two chunks (25 + 15)
            elif done[i] < REQUESTS[i][0]:
                n = REQUESTS[i][0] - done[i]
            else:
                n = 1
            segments.append((i, n))
        ids = torch.cat([seqs[i][done[i] : done[i] + n] for i, n in segments])
        pos = torch.cat([torch.arange(done[i], done[i] + n) for i, n in segments])
        logits = forward_packed(model, ids, pos, [n for _, n in segments], [caches[i] for i, _ in segments])
        start = 0
        for i, n in segments:
            if i in pending:  # the previous step's last row predicted this segment's first token
                log_probs[i].append(ops.token_log_probs(pending.pop(i)[None], seqs[i][done[i] : done[i] + 1]))
            inner = logits[start : start + n]
            if n > 1:
                log_probs[i].append(ops.token_log_probs(inner[:-1], seqs[i][done[i] + 1 : done[i] + n]))
            done[i] += n
            if done[i] < len(seqs[i]):
                pending[i] = inner[-1]
            start += n
        step += 1
    for c, s in zip(caches, seqs):
        assert c.length == len(s)
    return [torch.cat(lp) if lp else torch.zeros(0) for lp in log_probs]


def max_abs_diff(a, b):
    return max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))


KINDS = ["dense", "moe", "qwen2", "llama"]  # Qwen3, Qwen3-MoE, Qwen2 (QKV bias, tied), Llama (Llama-3 RoPE, GQA 4:1)
# Qwen3.5 dense and MoE (Gated DeltaNet): transformers' own forward ignores packing (flag-off comparisons of packed
# rows: tests/unit/test_qwen35_model.py)
GDN_KINDS = ["qwen35", "qwen35_moe"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS + GDN_KINDS + OTHER_SHAPES)
def test_rollout_equals_training_bitwise_with_flag_on(kind, dtype):
    model = model_for(kind, dtype)
    seqs = sequences()
    with ops.consistent(True):
        packed, logits_dtype = train_packed(model, seqs)
        padded = train_padded(model, seqs)
        micro = train_micro_batches(model, seqs)
        with threads(1):  # the engines need not agree on a thread count
            one_thread, _ = train_packed(model, seqs)
        rolled = rollout(model, seqs)
    assert logits_dtype == torch.float32
    assert [len(lp) for lp in packed] == [total - 1 for _, total in REQUESTS]
    for name, other in (("padded", padded), ("micro-batches", micro), ("1 thread", one_thread), ("rollout", rolled)):
        for i, (a, b) in enumerate(zip(packed, other)):
            message = f"{kind} {dtype} packed vs {name}, request {i}: {max_abs_diff([a], [b])}"
            assert a.shape == b.shape and torch.equal(a, b), message


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_twin_flag_off_rollout_differs_from_training(kind):
    """The problem without the fix: the engines' default kernels disagree (bf16)."""
    model = model_for(kind, torch.bfloat16)
    seqs = sequences()
    with ops.consistent(False):
        packed, logits_dtype = train_packed(model, seqs)
        rolled = rollout(model, seqs)
    assert logits_dtype == torch.bfloat16
    diff = max_abs_diff(packed, rolled)
    assert diff > 0, "flag off: rollout matched training bitwise, the twin lost its point"
    assert diff < 0.1  # same model, just other summation orders


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["qwen2", "llama", *OTHER_SHAPES])
def test_twin_flag_off_layouts_differ(kind, dtype):
    """The problem without the fix, for the architectures added to the table: with the default
    kernels the layouts the flag-on test holds bitwise equal (padded, micro-batches, rollout) do
    not all agree with the packed training forward."""
    model = model_for(kind, dtype)
    seqs = sequences()
    with ops.consistent(False):
        packed, logits_dtype = train_packed(model, seqs)
        others = {"padded": train_padded(model, seqs), "micro-batches": train_micro_batches(model, seqs),
                  "rollout": rollout(model, seqs)}
    assert logits_dtype == dtype
    diffs = {name: max_abs_diff(packed, other) for name, other in others.items()}
    assert max(diffs.values()) > 0, f"flag off: every layout matched bitwise, the twin lost its point: {diffs}"
    assert max(diffs.values()) < 0.1, diffs  # same model, just other summation orders


def test_flag_on_matches_default_numerics_closely():
    model = model_for("moe", torch.float32)
    seqs = sequences()
    with ops.consistent(True):
        on, _ = train_packed(model, seqs)
    with ops.consistent(False):
        off, _ = train_packed(model, seqs)
    assert max_abs_diff(on, off) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_backward_flows_and_matches_default_gradients(kind):
    model = build_model(kind, seed=0)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    model.train()
    seqs = sequences()
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    labels = torch.roll(ids[0], -1)
    grads = {}
    for flag in (True, False):
        model.zero_grad(set_to_none=True)
        with ops.consistent(flag):
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
            (-ops.token_log_probs(logits, labels).mean()).backward()
        grads[flag] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads[True]) == names, sorted(names - set(grads[True]))
    for n in names:
        torch.testing.assert_close(grads[True][n], grads[False][n], rtol=1e-3, atol=1e-5, msg=n)


def test_training_features_keep_the_bits_checkpointing_autocast_router_logits():
    """verl trains with gradient checkpointing and autocast(bf16) around bf16 params; MoE may ask
    for router logits (aux loss). None of it changes a bit of the consistent forward."""
    model = build_model("moe", seed=0).to(torch.bfloat16)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    seqs = sequences()
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    labels = torch.roll(ids[0], -1)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, position_ids=pos, use_cache=False, output_router_logits=True)
        lp = ops.token_log_probs(out.logits[0], labels)
        (-lp.mean() + out.aux_loss).backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    with ops.consistent(True):
        model.train()
        plain, plain_grads = step()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpointed, checkpointed_grads = step()
        model.gradient_checkpointing_disable()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast, _ = step()
        model.eval()
    assert torch.equal(plain, checkpointed) and torch.equal(plain, autocast)
    for name, grad in plain_grads.items():
        assert torch.equal(grad, checkpointed_grads[name]), name


def test_rollout_without_caches_and_logits_rows():
    model = model_for("dense", torch.float32)
    seqs = sequences()
    lens = [len(s) for s in seqs]
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(n) for n in lens])
    last = torch.tensor(lens).cumsum(0) - 1
    with ops.consistent(True):
        full = forward_packed(model, ids, pos, lens)
        rows = forward_packed(model, ids, pos, lens, logits_rows=last)
        with torch.no_grad():
            train = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
    assert full.dtype == torch.float32 and torch.equal(full, train) and torch.equal(rows, train[last])


def test_forward_hooks_see_the_same_modules_on_both_engines():
    model = model_for("dense", torch.float32)
    seen = []
    handle = model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape[-2]))
    try:
        seqs = sequences()[:2]
        with ops.consistent(True):
            train_packed(model, seqs)
            forward_packed(model, seqs[0][:4], torch.arange(4), [4], [KVCache()])
    finally:
        handle.remove()
    assert seen == [sum(len(s) for s in seqs), 4]


def test_bad_positions_raise_and_leave_caches_untouched():
    model = model_for("dense", torch.float32)
    cache = KVCache()
    with ops.consistent(True):
        forward_packed(model, torch.tensor([5, 6, 7]), torch.arange(3), [3], [cache])
        with pytest.raises(ValueError, match="positions"):
            forward_packed(model, torch.tensor([8]), torch.tensor([4]), [1], [cache])
    assert cache.length == 3 and cache.keys(0).shape == (2, 3, 16)


# ----------------------------------------------------------------------------------------------
# with the flag on, what is not covered raises and names it
# ----------------------------------------------------------------------------------------------


def _tiny_forward(model):
    ids = torch.tensor([[5, 6, 7, 8]])
    return model(input_ids=ids, position_ids=torch.arange(4)[None], use_cache=False)


def _built(config, attn=ATTN_IMPLEMENTATION):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def test_unsupported_attention_implementation_raises():
    model = build_model("dense")  # transformers' default (sdpa)
    with ops.consistent(True), pytest.raises(UnsupportedFeatureError, match="sdpa"):
        _tiny_forward(model)
    with ops.consistent(False):
        _tiny_forward(model)  # the default path is untouched


def test_sliding_window_raises():
    config = tiny_model_config("dense")
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 8, 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    with ops.consistent(True), pytest.raises(UnsupportedFeatureError, match="sliding window"):
        _tiny_forward(_built(config))


def test_attention_dropout_raises_in_training():
    config = tiny_model_config("dense")
    config.attention_dropout = 0.1
    model = _built(config).train()
    with ops.consistent(True), pytest.raises(UnsupportedFeatureError, match="dropout"):
        _tiny_forward(model)


def test_unknown_rope_type_raises():
    config = tiny_model_config("dense")
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with ops.consistent(True), pytest.raises(NotImplementedError, match="dynamic"):
        _tiny_forward(_built(config))


def test_other_activation_raises():
    config = tiny_model_config("dense")
    config.hidden_act = "gelu"
    with ops.consistent(True), pytest.raises(UnsupportedFeatureError, match="gelu"):
        _tiny_forward(_built(config))


def test_uncovered_architecture_raises_naming_it():
    """A model of an architecture outside the table (built with the flag off, so no patched class
    saw it) is refused at its first attention call, naming the architecture."""
    from transformers import MistralConfig

    config = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None)
    model = _built(config)
    with ops.consistent(True), pytest.raises(UnsupportedFeatureError, match="model_type 'mistral' is not covered"):
        _tiny_forward(model)


def test_hf_cache_raises():
    model = model_for("dense", torch.float32)
    with ops.consistent(True):
        first = model(input_ids=torch.tensor([[5, 6]]), use_cache=True)  # a fresh cache is just a forward
        with pytest.raises(UnsupportedFeatureError, match="past_key_values"):
            model(input_ids=torch.tensor([[7]]), past_key_values=first.past_key_values, use_cache=True)


def test_model_built_before_patching_is_converted_and_wrapped_linears_raise():
    unpatch_transformers()
    try:
        early = build_model("dense")
        assert type(early.lm_head) is torch.nn.Linear
    finally:
        patch_transformers()
        patch_transformers()  # idempotent
    early.set_attn_implementation(ATTN_IMPLEMENTATION)
    with ops.consistent(True):
        reference = _tiny_forward(model_for("dense", torch.float32)).logits
        assert torch.equal(_tiny_forward(early).logits, reference)  # converted on its first forward
    assert isinstance(early.lm_head, ConsistentLMHead)
    assert isinstance(early.model.layers[0].mlp.up_proj, ConsistentLinear)

    class Adapter(torch.nn.Module):  # what a LoRA wrapper looks like to the model
        def __init__(self, base):
            super().__init__()
            self.base = base

        def forward(self, x):
            return self.base(x)

    early.model.layers[0].self_attn.q_proj = Adapter(early.model.layers[0].self_attn.q_proj)
    with ops.consistent(True), pytest.raises(UnsupportedFeatureError, match="q_proj is a Adapter"):
        _tiny_forward(early)
