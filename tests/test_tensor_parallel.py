"""TP = 2 and EP = 2 on CPU over 2 real gloo ranks: rollout (prefill + decode over KV caches) and
training (packed forward, two micro-batch groupings) give bitwise-equal log-probs on the SAME
sharded model; TP1 vs TP2 do not (a split reduction is another addition order), which is why the
contract refuses rollout TP 2 against training TP 1.

One ``torch.multiprocessing.spawn`` of 2 ranks (gloo on 127.0.0.1, a free port) computes
everything; each rank saves its results and the tests below assert on them.
"""

from __future__ import annotations

import io
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from true_on_policy.cli import check as check_cli
from true_on_policy.contract import consistency as contract_mod
from true_on_policy.kernels import tensor_parallel as tp

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
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
    from true_on_policy.kernels import model as cm
    from true_on_policy.kernels import ops

    n = len(prompts)
    caches = [cm.KVCache() for _ in range(n)]
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
        logits = cm.forward_packed(model, torch.tensor(ids), torch.tensor(pos), lens, caches=caches_of(caches, active))
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
    from true_on_policy.kernels import model as cm
    from true_on_policy.kernels import ops

    out = [None] * len(sequences)
    for group in groups:
        seqs = [torch.tensor(sequences[i]) for i in group]
        lens = [len(s) for s in seqs]
        logits = cm.forward_packed(model, torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), lens)
        start = 0
        for i, seq in zip(group, seqs):
            rows = logits[start : start + len(seq)]
            start += len(seq)
            out[i] = ops.token_log_probs(rows[:-1], seq[1:])
    return out


def _model(kind, dtype, tp_size=1, ep_size=1):
    from true_on_policy.kernels import model as cm
    from true_on_policy.tiny_assets import build_model

    model = build_model(kind, seed=0).to(dtype)
    model.set_attn_implementation(cm.ATTN_IMPLEMENTATION)
    if tp_size > 1 or ep_size > 1:
        tp.shard_model(model, tp_size=tp_size, ep_size=ep_size)
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
    """The ordered fold vs a plain gloo all_reduce (SUM) of the same fp32 partials."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    partial = torch.randn(1 << 16, generator=g) * torch.exp(torch.randn(1 << 16, generator=g) * 4)
    parts = [torch.empty_like(partial) for _ in range(WORLD)]
    dist.all_gather(parts, partial)
    folded = tp.ordered_all_reduce(partial)
    plain = partial.clone()
    dist.all_reduce(plain)
    reversed_fold = parts[1] + parts[0]
    return dict(
        folded=folded,
        fold_is_p0_plus_p1=torch.equal(folded, parts[0] + parts[1]),
        plain_equals_fold=torch.equal(plain, folded),
        plain_max_abs_diff=(plain - folded).abs().max().item(),
        reversed_equals_fold=torch.equal(reversed_fold, folded),
    )


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        from true_on_policy.kernels import model as cm
        from true_on_policy.kernels import ops

        cm.patch_transformers()
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
                    res["tp1_train"] = _train(full, tokens, GROUPINGS["one_batch"])
                    res["tp1_rollout_replay"] = _train(full, tokens, GROUPINGS["regrouped"])
                    if kind == "moe":  # EP alone (TP 1): the top-2 combine split over 2 ranks
                        res["ep2_only_train"] = _train(_model(kind, dtype, 1, 2), tokens, GROUPINGS["one_batch"])
                    results[kind, dname] = res
            results["grads"] = {kind: _grad_check(kind, results[kind, "fp32"]["tokens"]) for kind in KINDS}
        with ops.consistent(False):  # the twin: same sharding, default kernels + plain all_reduce
            for kind in KINDS:
                sharded = _model(kind, torch.bfloat16, 2, 2 if kind == "moe" else 1)
                tokens, rollout = _rollout(sharded, prompts, generate, seed=11)
                results["flag_off", kind] = dict(rollout=rollout, train=_train(sharded, tokens, GROUPINGS["regrouped"]))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


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


def test_tp1_and_tp2_differ_so_both_sides_must_pin_the_same_tp(ranks):
    diffs = {}
    for kind, dname in CASES:
        res = ranks[0][kind, dname]
        assert _equal(res["tp1_train"], res["tp1_rollout_replay"])  # TP1 is self-consistent too
        diffs[kind, dname] = _max_diff(res["tp1_train"], res["train"]["one_batch"])
        print(f"{kind} {dname}: TP1 vs TP2 training log-probs max|d| = {diffs[kind, dname]}")
    assert diffs["dense", "fp32"] > 0.0 and diffs["moe", "fp32"] > 0.0
    assert any(d > 0.0 for d in diffs.values())


def test_ep_alone_with_top2_over_2_ranks_equals_unsharded(ranks):
    # The EP combine selects non-local slots to exact zeros and folds the partials in rank order, so
    # with top-2 over 2 ranks each token's sum is c_a + c_b, c_b + c_a (IEEE addition commutes) or
    # (c_a + c_b) + 0 -- the unsharded bits. A property of top-2 on 2 ranks, not of EP in general.
    for dname in DTYPES:
        res = ranks[0]["moe", dname]
        assert _equal(res["ep2_only_train"], res["tp1_train"]), (dname, _max_diff(res["ep2_only_train"], res["tp1_train"]))


def test_sharded_gradients_match_tp1(ranks):
    for rank in ranks:
        for kind, worst in rank["grads"].items():
            for name, rel in worst.items():
                print(f"{kind} grad {name}: max|d|/max|g| = {rel:.2e}")
                assert rel < 1e-4, (kind, name, rel)


def test_ordered_fold_is_rank_order_and_identical_on_every_rank(ranks):
    c0, c1 = ranks[0]["collective"], ranks[1]["collective"]
    assert c0["fold_is_p0_plus_p1"] and c1["fold_is_p0_plus_p1"]
    assert torch.equal(c0["folded"], c1["folded"])
    # Measured, not asserted: a 2-rank gloo all_reduce adds the same two numbers (commutative).
    print(
        f"gloo all_reduce(SUM) vs ordered fold, 2 ranks: equal={c0['plain_equals_fold']} "
        f"max|d|={c0['plain_max_abs_diff']}; p1+p0 == p0+p1: {c0['reversed_equals_fold']}"
    )


def _check(*overrides: str, config: str = "cpu_tiny") -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    code = check_cli.main(["--config-path", str(CONFIGS), "--config-name", config, *overrides], stdout=out, stderr=err)
    return code, err.getvalue()


def test_contract_refuses_rollout_tp2_against_training_tp1():
    assert tp.ROW_PARALLEL_REDUCTION == contract_mod.CPU_ROW_PARALLEL
    assert tp.MOE_DISPATCH == contract_mod.CPU_MOE_DISPATCH
    code, err = _check("actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert code == check_cli.EXIT_MISMATCH
    assert "[tp]: training=1" in err and "rollout=2" in err and contract_mod.CPU_TP_KEY in err
    assert "[row_parallel]" in err
    code, err = _check(
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        f"{contract_mod.CPU_TP_KEY}=2",
        "trainer.n_gpus_per_node=2",
    )
    assert code == check_cli.EXIT_OK, err


def test_contract_refuses_mismatched_ep_on_cpu():
    code, err = _check("actor_rollout_ref.rollout.expert_parallel_size=2", config="cpu_tiny_moe")
    assert code == check_cli.EXIT_MISMATCH and "[ep]" in err and "[moe_dispatcher]" in err
    code, err = _check(
        "actor_rollout_ref.rollout.expert_parallel_size=2", f"{contract_mod.CPU_EP_KEY}=2", config="cpu_tiny_moe"
    )
    assert code == check_cli.EXIT_OK, err
