"""TP = 2 and EP = 2 on CPU over real gloo ranks give the unsharded model's bits.

Rollout (prefill + decode over KV caches) and training (packed forward, two micro-batch groupings)
on the sharded model equal each other AND the unsharded model (TP1) bitwise: the row-parallel
reductions are subtrees of one fixed tree whose top levels are folded after an all-gather, the EP
combine selects each slot's row from its expert's rank. Twins: the previous order (K chunks added
left to right per rank, the ranks' partials added) gives TP2 != TP1; the flag off differs.

One ``torch.multiprocessing.spawn`` of 2 ranks (gloo on 127.0.0.1, a free port) computes the model
cases; one of 4 ranks the row-parallel linear at TP 1, 2 (two subgroups) and 4. Each rank saves
its results and the tests below assert on them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kernel_helpers import spawn_ranks
from check_runs import run_check
from true_on_policy.cli import check
from true_on_policy.kernels import tensor_parallel
from true_on_policy.transformers_adapter import sharding

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WORLD = 2
KINDS = ("dense", "moe")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# (prompt length, tokens to generate): mixed lengths, one prompt crossing the 64-token KV block
REQUESTS = [(3, 6), (11, 4), (29, 8), (66, 5)]
GROUPINGS = {"one_batch": [[0, 1, 2, 3]], "regrouped": [[3, 1], [0], [2]]}


# ----------------------------------------------------------------------------------------------
# what each rank runs
# ----------------------------------------------------------------------------------------------


def _rollout(model, prompts, generate, seed):
    """Continuous batching: request i is admitted (prefilled) at step i while the earlier ones
    decode; tokens are sampled per request from the fp32 distribution. Returns per request the
    tokens and the log-probs of tokens 1..L-1 (prompt tokens from the prefill rows)."""
    from true_on_policy.rollout.packed_forward import KVCache, forward_packed
    from true_on_policy.kernels import ops

    n = len(prompts)
    caches = [KVCache() for _ in range(n)]
    gens = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    tokens = [list(p) for p in prompts]
    log_probs = [[] for _ in range(n)]
    done = [False] * n
    step = 0
    while not all(done):
        active = [i for i in range(min(step + 1, n)) if not done[i]]
        ids, pos, lens = [], [], []
        for i in active:
            new = tokens[i] if caches[i].length == 0 else tokens[i][-1:]
            ids += new
            pos += range(caches[i].length, caches[i].length + len(new))
            lens.append(len(new))
        logits = forward_packed(model, torch.tensor(ids), torch.tensor(pos), lens, caches=caches_of(caches, active))
        start = 0
        for i, count in zip(active, lens):
            rows = logits[start : start + count]
            start += count
            if count > 1:  # prefill: the prompt's own next-token log-probs
                log_probs[i] += ops.token_log_probs(rows[:-1], torch.tensor(tokens[i][1:])).tolist()
            probs = torch.exp(ops.log_softmax(rows[-1:]))
            token = int(torch.multinomial(probs, 1, generator=gens[i]))
            log_probs[i].append(float(ops.token_log_probs(rows[-1:], torch.tensor([token]))[0]))
            tokens[i].append(token)
            done[i] = len(tokens[i]) == len(prompts[i]) + generate[i]
        step += 1
    return tokens, [torch.tensor(lp, dtype=torch.float32) for lp in log_probs]


def caches_of(caches, active):
    return [caches[i] for i in active]


def _train(model, sequences, groups):
    """Packed training forwards, one per micro-batch; log-probs of tokens 1..L-1 per sequence."""
    from true_on_policy.rollout.packed_forward import forward_packed
    from true_on_policy.kernels import ops

    out = [None] * len(sequences)
    for group in groups:
        seqs = [torch.tensor(sequences[i]) for i in group]
        lens = [len(s) for s in seqs]
        logits = forward_packed(model, torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), lens)
        start = 0
        for i, seq in zip(group, seqs):
            rows = logits[start : start + len(seq)]
            start += len(seq)
            out[i] = ops.token_log_probs(rows[:-1], seq[1:])
    return out


def _model(kind, dtype, tp_size=1, ep_size=1):
    from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION
    from true_on_policy.tiny_assets import build_model

    model = build_model(kind, seed=0).to(dtype)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if tp_size > 1 or ep_size > 1:
        sharding.shard_model(model, tp_size=tp_size, ep_size=ep_size)
    return model


def _grad_check(kind, sequences):
    """fp32 training backward, TP2(/EP2) vs TP1: the sharded gradients are correct (allclose)."""
    from true_on_policy.kernels import ops

    full, sharded = _model(kind, torch.float32), _model(kind, torch.float32, 2, 2 if kind == "moe" else 1)
    seqs = [torch.tensor(s) for s in sequences[:2]]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    labels = torch.cat([torch.cat([s[1:], s[:1]]) for s in seqs])  # the wrap-around label is harmless here
    for model in (full, sharded):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        (-ops.token_log_probs(logits, labels).mean()).backward()
    rank = dist.get_rank()
    worst = {}

    def compare(name, g_full, g_shard):
        scale = g_full.abs().max().item() or 1.0
        worst[name] = (g_full - g_shard).abs().max().item() / scale

    attn_f, attn_s = full.model.layers[0].self_attn, sharded.model.layers[0].self_attn
    compare("embed_tokens (replicated)", full.model.embed_tokens.weight.grad, sharded.model.embed_tokens.weight.grad)
    rows = attn_s.q_proj.weight.shape[0]
    compare("q_proj (column)", attn_f.q_proj.weight.grad[rank * rows : (rank + 1) * rows], attn_s.q_proj.weight.grad)
    cols = attn_s.o_proj.weight.shape[1]
    compare("o_proj (row)", attn_f.o_proj.weight.grad[:, rank * cols : (rank + 1) * cols], attn_s.o_proj.weight.grad)
    vocab = sharded.lm_head.weight.shape[0]
    compare("lm_head (vocab)", full.lm_head.weight.grad[rank * vocab : (rank + 1) * vocab], sharded.lm_head.weight.grad)
    if kind == "moe":
        moe_f, moe_s = full.model.layers[0].mlp, sharded.model.layers[0].mlp
        compare("router (replicated)", moe_f.gate.weight.grad, moe_s.gate.weight.grad)
        n = moe_s.experts.num_local_experts
        compare(
            "experts.down_proj (EP)",
            moe_f.experts.down_proj.grad[rank * n : (rank + 1) * n],
            moe_s.experts.down_proj.grad,
        )
    return worst


def _collective_check():
    """The tree's top over 2 ranks vs a plain gloo all_reduce (SUM) of the same fp32 partials."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    partial = torch.randn(1 << 16, generator=g) * torch.exp(torch.randn(1 << 16, generator=g) * 4)
    parts = [torch.empty_like(partial) for _ in range(WORLD)]
    dist.all_gather(parts, partial)
    folded = tensor_parallel.tree_all_reduce(partial)
    plain = partial.clone()
    dist.all_reduce(plain)
    return dict(
        folded=folded,
        fold_is_p0_plus_p1=torch.equal(folded, parts[0] + parts[1]),
        plain_equals_fold=torch.equal(plain, folded),
        plain_max_abs_diff=(plain - folded).abs().max().item(),
    )


@contextlib.contextmanager
def _previous_reduction_order():
    """The linears' reduction as it was: K chunks added left to right over whatever K a rank holds
    (no leaves), so a rank's partial is not a subtree of the unsharded sum."""
    from true_on_policy.kernels.ops import linear_tree  # where the linear reads its leaf counts

    saved = linear_tree.k_leaves, linear_tree.local_leaves
    linear_tree.k_leaves, linear_tree.local_leaves = (lambda k: 1), (lambda k, parts: 1)
    try:
        yield
    finally:
        linear_tree.k_leaves, linear_tree.local_leaves = saved


def _worker(rank: int) -> dict:
    from true_on_policy.transformers_adapter.forwards import patch_transformers
    from true_on_policy.kernels import ops

    patch_transformers()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n, _ in REQUESTS]
    generate = [k for _, k in REQUESTS]
    results = {"collective": _collective_check()}
    with ops.consistent(True):
        for kind in KINDS:
            ep = 2 if kind == "moe" else 1
            for dname, dtype in DTYPES.items():
                sharded = _model(kind, dtype, 2, ep)
                kv_heads = sharded.config.num_key_value_heads
                tokens, rollout = _rollout(sharded, prompts, generate, seed=11)
                train = {name: _train(sharded, tokens, groups) for name, groups in GROUPINGS.items()}
                full = _model(kind, dtype)
                res = dict(tokens=tokens, rollout=rollout, train=train, kv_heads=kv_heads)
                res["tp1_tokens"], res["tp1_rollout"] = _rollout(full, prompts, generate, seed=11)
                res["tp1_train"] = _train(full, tokens, GROUPINGS["regrouped"])
                if kind == "moe":  # EP alone (TP 1): each slot's row from its expert's rank
                    res["ep2_only_train"] = _train(_model(kind, dtype, 1, 2), tokens, GROUPINGS["one_batch"])
                results[kind, dname] = res
        with _previous_reduction_order():  # the twin: TP-split chunk boundaries
            tokens = results["dense", "fp32"]["tokens"]
            results["previous_order"] = dict(
                tp2=_train(_model("dense", torch.float32, 2), tokens, GROUPINGS["one_batch"]),
                tp1=_train(_model("dense", torch.float32), tokens, GROUPINGS["one_batch"]),
            )
        results["grads"] = {kind: _grad_check(kind, results[kind, "fp32"]["tokens"]) for kind in KINDS}
    with ops.consistent(False):  # the twin: same sharding, default kernels + plain all_reduce
        for kind in KINDS:
            sharded = _model(kind, torch.bfloat16, 2, 2 if kind == "moe" else 1)
            tokens, rollout = _rollout(sharded, prompts, generate, seed=11)
            results["flag_off", kind] = dict(rollout=rollout, train=_train(sharded, tokens, GROUPINGS["regrouped"]))
    return results


# ----------------------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("tp"))


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


CASES = [(kind, dname) for kind in KINDS for dname in DTYPES]


@pytest.mark.parametrize(("kind", "dname"), CASES)
def test_rollout_equals_training_bitwise_under_tp2_ep2(ranks, kind, dname):
    res = ranks[0][kind, dname]
    assert res["kv_heads"] == 1  # the rollout's KV caches hold the rank's local KV head (2 -> 1 per rank)
    for name, train in res["train"].items():
        diff = _max_diff(res["rollout"], train)
        print(f"{kind} {dname} TP2{'/EP2' if kind == 'moe' else ''}: rollout vs training ({name}) max|d| = {diff}")
        assert diff == 0.0 and _equal(res["rollout"], train), name


@pytest.mark.parametrize(("kind", "dname"), CASES)
def test_ranks_hold_identical_results(ranks, kind, dname):
    a, b = ranks[0][kind, dname], ranks[1][kind, dname]
    assert a["tokens"] == b["tokens"]  # both ranks sampled the same tokens from the same (gathered) logits
    assert _equal(a["rollout"], b["rollout"]) and _equal(a["train"]["regrouped"], b["train"]["regrouped"])


@pytest.mark.parametrize("kind", KINDS)
def test_flag_off_twin_differs(ranks, kind):
    res = ranks[0]["flag_off", kind]
    diff = _max_diff(res["rollout"], res["train"])
    print(f"{kind} bf16 TP2 flag off (default kernels, plain all_reduce): rollout vs training max|d| = {diff}")
    assert diff > 0, "flag off: rollout matched training bitwise, the twin lost its point"


@pytest.mark.parametrize(("kind", "dname"), CASES)
def test_tp2_equals_tp1_bitwise(ranks, kind, dname):
    """The sharded model is the unsharded one, bit for bit: the same sampled tokens, the same
    recorded log-probs, the same training log-probs (another micro-batch grouping)."""
    res = ranks[0][kind, dname]
    assert res["tp1_tokens"] == res["tokens"]
    assert _equal(res["tp1_rollout"], res["rollout"]), _max_diff(res["tp1_rollout"], res["rollout"])
    assert _equal(res["tp1_train"], res["train"]["one_batch"]), _max_diff(res["tp1_train"], res["train"]["one_batch"])


def test_twin_the_previous_reduction_order_makes_tp2_differ_from_tp1(ranks):
    """Without the leaves -- K chunks added left to right over a rank's shard, the two partials
    added -- a TP2 row-parallel product is another addition order than TP1's."""
    res = ranks[0]["previous_order"]
    diff = _max_diff(res["tp1"], res["tp2"])
    print(f"dense fp32, previous reduction order: TP1 vs TP2 training log-probs max|d| = {diff}")
    assert diff > 0.0


@pytest.mark.parametrize("dname", DTYPES)
def test_ep2_alone_equals_the_unsharded_experts(ranks, dname):
    res = ranks[0]["moe", dname]
    assert _equal(res["ep2_only_train"], res["tp1_train"]), _max_diff(res["ep2_only_train"], res["tp1_train"])


def test_sharded_gradients_match_tp1(ranks):
    for rank in ranks:
        for kind, worst in rank["grads"].items():
            for name, rel in worst.items():
                print(f"{kind} grad {name}: max|d|/max|g| = {rel:.2e}")
                assert rel < 1e-4, (kind, name, rel)


def test_tree_top_is_rank_order_and_identical_on_every_rank(ranks):
    c0, c1 = ranks[0]["collective"], ranks[1]["collective"]
    assert c0["fold_is_p0_plus_p1"] and c1["fold_is_p0_plus_p1"]
    assert torch.equal(c0["folded"], c1["folded"])
    # Measured, not asserted: a 2-rank gloo all_reduce adds the same two numbers (commutative).
    print(f"gloo all_reduce(SUM) vs tree top, 2 ranks: equal={c0['plain_equals_fold']} max|d|={c0['plain_max_abs_diff']}")


def _check(*overrides: str, config: str = "cpu_tiny") -> tuple[int, str]:
    code, out, err = run_check(["--config-path", str(CONFIGS), "--config-name", config, *overrides])
    return code, out + err


def test_contract_accepts_another_tp_or_ep_with_the_invariant_kernels_and_says_why():
    for config, overrides in [
        ("cpu_tiny_vllm_tp2", ()),  # training TP 1 on 2 FSDP ranks, vLLM rollout TP 2
        ("cpu_tiny_moe_vllm_ep2", ()),  # ... rollout TP 2 with expert parallelism
    ]:
        code, err = _check(*overrides, config=config)
        assert code == check.EXIT_OK, (config, err)
        assert "TP-invariant kernels (CPU, flag on): training and rollout TP / EP may differ" in err, err


def test_twin_with_the_flag_off_another_tp_or_ep_is_a_mismatch():
    """Where the kernels cannot absorb a difference (flag off: stock kernels, an all-reduce) TP must match."""
    code, err = _check("true_on_policy.deterministic=false", config="cpu_tiny_vllm_tp2")
    assert code == check.EXIT_REFUSED
    assert "[tp]: training=1" in err and "rollout=2" in err and "[row_parallel]" in err
    code, err = _check("true_on_policy.deterministic=false", "actor_rollout_ref.rollout.expert_parallel_size=2",
                       config="cpu_tiny_moe")
    assert code == check.EXIT_REFUSED and "[ep]" in err and "[moe_dispatcher]" in err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("actor_rollout_ref.rollout.tensor_model_parallel_size=16",), "tensor_parallel_size=16 is not supported"),
        (("actor_rollout_ref.rollout.tensor_model_parallel_size=4",), "num_key_value_heads=2 does not divide by "
                                                                       "tensor_parallel_size=4"),
    ],
)
def test_contract_refuses_a_tp_the_kernels_or_the_model_cannot_take(overrides, message):
    code, err = _check(*overrides, config="cpu_tiny_vllm_tp2")
    assert code == check.EXIT_REFUSED and message in err, err


def test_the_cpu_engine_does_not_shard_so_its_tp_or_ep_must_match():
    """The Ray-served cpu rollout engine runs the unsharded model: a rollout TP / EP there is a mismatch."""
    code, err = _check("actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert code == check.EXIT_REFUSED and "[tp]: training=1" in err and "rollout=2" in err
    code, err = _check("actor_rollout_ref.rollout.expert_parallel_size=2", config="cpu_tiny_moe")
    assert code == check.EXIT_REFUSED and "[ep]" in err and "[moe_dispatcher]" in err
