"""Golden outputs of every consistent kernel, on fixed seeded inputs, for before/after bitwise checks.

:func:`compute` runs every op of :mod:`true_on_policy.kernels.ops` (forward, and backward where it
is an autograd Function), a full model training forward + backward (packed and padded) and a
rollout (chunked prefill + decode steps over KV caches, then the rollout engine's sampled tokens
and recorded log-probs) for the tiny dense and MoE models in fp32 and bf16. The inputs and the
weights come from one ``torch.Generator`` (not from transformers' initialisers), so they depend on
nothing but this file. ``tests/support/data/kernel_goldens_<capability>.pt`` holds what the kernels' torch
code (the specification, ``ops.switched(native=False)``) computes (``python tests/support/kernel_goldens.py
--write``) on torch's CPU capability of that name (its GEMM and ``exp`` kernels differ between AVX2 and
AVX512), with the torch build; ``tests/unit/test_kernel_goldens.py`` asserts ``torch.equal`` for every entry.
History: first written from the original kernels (commit 0c2b828); rewritten once, when the linear's
reduction over K became the TP-invariant tree (issue 21: every ``linear/``, ``model/`` and new
``linear/tree/`` entry changed, every other op's entry kept its bits;
``tests/unit/test_tp_invariant_kernels.py`` holds the old order's twin). AVX512 is that file; AVX2 was
added from the torch code of 6fbb93a, the commit after which the AVX512 goldens last held.
"""

from __future__ import annotations

import argparse
import pathlib

import torch

DATA = pathlib.Path(__file__).parent / "data"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# ----------------------------------------------------------------------------------------------
# ops
# ----------------------------------------------------------------------------------------------


def _op_cases(out: dict) -> None:
    from true_on_policy.kernels import moe, ops
    from true_on_policy.tiny_assets import tiny_model_config

    g = _gen(1234)
    for n in (1, 7, 128, 1000):
        out[f"fixed_sum/n{n}"] = ops.fixed_sum(_randn(g, 5, n))
    out["matmul_tiles/k300"] = ops.matmul_tiles(_randn(g, 3, 64, 300), _randn(g, 3, 300, 40))
    out["matmul_tiles/k100"] = ops.matmul_tiles(_randn(g, 2, 32, 100), _randn(g, 2, 100, 24))

    for dname, dtype in DTYPES.items():
        for m in (1, 5, 64, 65, 130):
            for k in (64, 128, 200):
                x = _randn(g, m, k, dtype=dtype)
                w = _randn(g, 24, k, dtype=dtype, scale=0.1)
                b = _randn(g, 24, dtype=dtype, scale=0.1)
                out[f"linear/{dname}/m{m}_k{k}"] = ops.linear(x, w)
                out[f"linear/{dname}/m{m}_k{k}_bias"] = ops.linear(x, w, b)[::2]
                out[f"linear/{dname}/m{m}_k{k}_fp32out"] = ops.linear(x, w, out_dtype=torch.float32)[1::2]
        # leading dims, a transposed (non-contiguous) weight, and backward
        x = _randn(g, 3, 37, 64, dtype=dtype).requires_grad_()
        wt = _randn(g, 64, 96, dtype=dtype, scale=0.1)
        w = wt.t().requires_grad_()
        b = _randn(g, 96, dtype=dtype, scale=0.1).requires_grad_()
        y = ops.linear(x, w, b)
        y.backward(_randn(g, *y.shape, dtype=dtype))
        out[f"linear/{dname}/3d_noncontig"] = y.detach()
        out[f"linear/{dname}/grad_x"] = x.grad
        out[f"linear/{dname}/grad_w"] = w.grad
        out[f"linear/{dname}/grad_b"] = b.grad

        x = _randn(g, 37, 64, dtype=dtype, scale=3.0)
        out[f"rms_norm/{dname}"] = ops.rms_norm(x, 1 + _randn(g, 64, dtype=dtype, scale=0.1), 1e-6)
        out[f"rms_norm/{dname}/3d"] = ops.rms_norm(x.view(1, 37, 64), _randn(g, 64, dtype=dtype), 1e-5)
        out[f"silu/{dname}"] = ops.silu(_randn(g, 37, 128, dtype=dtype, scale=4.0))

    config = tiny_model_config("dense")
    cos, sin = ops.rope_table(config)
    out["rope_table/cos"], out["rope_table/sin"] = cos[::16], sin[::16]
    positions = torch.randint(0, config.max_position_embeddings, (2, 37), generator=g)
    for dname, dtype in DTYPES.items():
        q = _randn(g, 2, 4, 37, 16, dtype=dtype)
        out[f"apply_rope/{dname}"] = ops.apply_rope(q, cos[positions], sin[positions], 1)
        out[f"apply_rope/{dname}/dim2"] = ops.apply_rope(q.transpose(1, 2), cos[positions], sin[positions], 2)

    _attention_cases(out, g)

    for experts, top_k in ((4, 2), (8, 3), (128, 8)):
        logits = _randn(g, 50, experts, scale=2.0)
        logits[::5] = torch.round(logits[::5])  # ties
        logits[3] = 0.0
        for norm in (True, False):
            w, e = moe.moe_route(logits, top_k, norm)
            out[f"moe_route/e{experts}_k{top_k}_norm{int(norm)}/weights"] = w
            out[f"moe_route/e{experts}_k{top_k}_norm{int(norm)}/experts"] = e
    for dname, dtype in DTYPES.items():
        out[f"moe_combine/{dname}"] = moe.moe_combine(_randn(g, 50, 2, 64, dtype=dtype), torch.rand(50, 2, generator=g))
        out[f"moe_combine/{dname}/k3"] = moe.moe_combine(_randn(g, 9, 3, 64, dtype=dtype), torch.rand(9, 3, generator=g))

    for dname, dtype in DTYPES.items():
        logits = _randn(g, 37, 128, dtype=dtype, scale=5.0)
        labels = torch.randint(0, 128, (37,), generator=g)
        for t in (1.0, 0.7):
            out[f"log_softmax/{dname}/t{t}"] = ops.log_softmax(logits, t)
            out[f"token_log_probs/{dname}/t{t}"] = ops.token_log_probs(logits, labels, t)
        out[f"log_softmax/{dname}/vocab1000"] = ops.log_softmax(_randn(g, 3, 1000, dtype=dtype, scale=5.0))

    # the linear's reduction tree: leaves with a chunked tail (K = 1048: 8 leaves of 131), 32 leaves of
    # one chunk (K = 4096), a row-parallel shard's subtree (TP 4, rank 1) and a narrow product (N = 4)
    for k in (1048, 4096):
        x = _randn(g, 70, k)
        w = _randn(g, 40, k, scale=0.05)
        out[f"linear/tree/k{k}"] = ops.linear(x, w)
        out[f"linear/tree/k{k}_tp4_rank1"] = ops.linear(
            x[:, k // 4 : k // 2], w[:, k // 4 : k // 2], None, torch.float32, k_parts=4
        )
    out["linear/tree/n4"] = ops.linear(_randn(g, 9, 64), _randn(g, 4, 64, scale=0.1))


def _attention_cases(out: dict, g: torch.Generator) -> None:
    from true_on_policy.kernels import ops

    hq, hkv, d = 4, 2, 16
    scaling = d**-0.5
    for dname, dtype in DTYPES.items():
        # training layout: 3 sequences of 130, 40, 5 tokens in a [3, 130] grid, with backward
        lens = torch.tensor([130, 40, 5])
        t = 130
        q_pos = torch.where(torch.arange(t)[None] < lens[:, None], torch.arange(t)[None], -1)
        kv_valid = q_pos >= 0
        q = _randn(g, 3, hq, t, 8, dtype=dtype).requires_grad_()  # head dim 8: a smaller file
        k = _randn(g, 3, hkv, t, 8, dtype=dtype).requires_grad_()
        v = _randn(g, 3, hkv, t, 8, dtype=dtype).requires_grad_()
        o = ops.attention(q, k, v, q_pos, kv_valid, scaling)
        o.backward(_randn(g, *o.shape, dtype=dtype))
        out[f"attention/{dname}/train"] = o.detach()
        out[f"attention/{dname}/train/grad_q"] = q.grad
        out[f"attention/{dname}/train/grad_k"] = k.grad
        out[f"attention/{dname}/train/grad_v"] = v.grad
        with torch.no_grad():
            out[f"attention/{dname}/train_nograd_seq1"] = ops.attention(q, k, v, q_pos, kv_valid, scaling)[1]

        # decode: one query per sequence over caches of various lengths, garbage in invalid slots
        for batch, max_len in ((5, 200), (32, 1024)):
            total = torch.randint(1, max_len + 1, (batch,), generator=g)
            total[0] = max_len
            if batch >= 5:
                total[1:5] = torch.tensor([64, 65, 1, 128])
            span = -(-max_len // 64) * 64
            kv_valid = torch.arange(span)[None] < total[:, None]
            k = _randn(g, batch, hkv, span, d, dtype=dtype)
            v = _randn(g, batch, hkv, span, d, dtype=dtype)
            k[~kv_valid[:, None].expand_as(k[..., 0])] = float("nan")
            v[~kv_valid[:, None].expand_as(v[..., 0])] = float("inf")
            q = _randn(g, batch, hq, 1, d, dtype=dtype)
            out[f"attention/{dname}/decode_b{batch}_c{max_len}"] = ops.attention(
                q, k, v, (total - 1)[:, None], kv_valid, scaling
            )

        # chunked prefill: 20 queries at positions 100..119 of a 128-slot cache
        k = _randn(g, 2, hkv, 128, d, dtype=dtype)
        v = _randn(g, 2, hkv, 128, d, dtype=dtype)
        q = _randn(g, 2, hq, 20, d, dtype=dtype)
        q_pos = torch.arange(100, 120)[None].repeat(2, 1)
        q_pos[1, 15:] = -1
        kv_valid = torch.arange(128)[None] < torch.tensor([[120], [115]])
        out[f"attention/{dname}/chunk"] = ops.attention(q, k, v, q_pos, kv_valid, scaling)


# ----------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------

SEQ_LENS = (23, 140, 12, 70)  # crosses the 64- and 128-token KV blocks
PROMPTS = (5, 110, 1, 50)  # rollout: prompt part of each sequence; request 1 prefilled as 25 + 85


def build(kind: str, dtype: torch.dtype):
    """The tiny model with weights drawn from this file's generator (independent of HF's init)."""
    from transformers import AutoModelForCausalLM

    from true_on_policy.transformers_adapter.forwards import convert_model
    from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION
    from true_on_policy.tiny_assets import tiny_model_config

    model = AutoModelForCausalLM.from_config(tiny_model_config(kind), attn_implementation=ATTN_IMPLEMENTATION)
    g = _gen(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + _randn(g, *p.shape, scale=0.1))
            else:
                p.copy_(_randn(g, *p.shape, scale=0.15))
    convert_model(model)
    return model.to(dtype).eval()


def _sequences():
    g = _gen(99)
    return [torch.randint(3, 128, (n,), generator=g) for n in SEQ_LENS]


def _model_cases(out: dict, kind: str, dname: str) -> None:
    from true_on_policy.rollout.packed_forward import KVCache, forward_packed
    from true_on_policy.kernels import ops
    from true_on_policy.rollout.engine import RolloutEngine, SamplingParams

    model = build(kind, DTYPES[dname])
    key = f"model/{kind}/{dname}"
    seqs = _sequences()
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    labels = torch.roll(ids[0], -1)

    # packed training forward + backward (verl's use_remove_padding layout)
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    lp = ops.token_log_probs(logits, labels)
    (-lp.mean()).backward()
    out[f"{key}/packed/logits_every4"] = logits.detach()[::4]  # every 4th row: keeps the file small
    out[f"{key}/packed/token_log_probs"] = lp.detach()
    for name, p in model.named_parameters():  # layer 0 and the embedding: downstream of all backward
        if ".layers.1." not in name and "mlp.up_proj" not in name:
            out[f"{key}/packed/grad/{name}"] = p.grad

    # padded training forward + backward: left padding, right padding, cumsum positions
    left = (3, 0, 6, 1)
    width = max(len(s) + l for s, l in zip(seqs, left)) + 2
    pids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, (s, l) in enumerate(zip(seqs, left)):
        pids[b, l : l + len(s)] = s
        mask[b, l : l + len(s)] = 1
    ppos = (mask.cumsum(-1) - 1).clamp(min=0)
    model.zero_grad(set_to_none=True)
    plogits = model(input_ids=pids, attention_mask=mask, position_ids=ppos, use_cache=False).logits
    plabels = torch.roll(pids, -1, dims=1)
    lp = ops.token_log_probs(plogits, plabels)
    (-(lp * mask).sum() / mask.sum()).backward()
    out[f"{key}/padded/logits_valid_every4"] = plogits.detach()[mask.bool()][::4]
    out[f"{key}/padded/token_log_probs"] = lp.detach()[mask.bool()]
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.layers.1.mlp.experts.down_proj", "model.embed_tokens.weight"):
        p = dict(model.named_parameters()).get(name)
        if p is not None:
            out[f"{key}/padded/grad/{name}"] = p.grad
    model.zero_grad(set_to_none=True)
    model.eval()

    # rollout: staggered admission, a chunked prefill, then decode steps over the KV caches
    with torch.no_grad():
        caches = [KVCache() for _ in seqs]
        done = [0] * len(seqs)
        step = 0
        while any(dn < len(s) for dn, s in zip(done, seqs)) and step < 12:
            segments = []
            for i, s in enumerate(seqs):
                if done[i] >= len(s) or (i == 3 and step < 2):
                    continue
                if done[i] == 0:
                    n = 25 if i == 1 else PROMPTS[i]
                elif done[i] < PROMPTS[i]:
                    n = PROMPTS[i] - done[i]
                else:
                    n = 1
                segments.append((i, n))
            step_ids = torch.cat([seqs[i][done[i] : done[i] + n] for i, n in segments])
            step_pos = torch.cat([torch.arange(done[i], done[i] + n) for i, n in segments])
            lens = [n for _, n in segments]
            rows = torch.tensor(lens).cumsum(0) - 1 if step else None
            logits = forward_packed(model, step_ids, step_pos, lens, [caches[i] for i, _ in segments], rows)
            out[f"{key}/rollout/step{step}"] = logits
            for i, n in segments:
                done[i] += n
            step += 1
        out[f"{key}/rollout/cache2"] = caches[2].filled().clone()

        # the rollout engine: continuous batching, sampling, recorded log-probs
        engine = RolloutEngine(model, eos_token_id=-1, max_num_seqs=3)
        for i, s in enumerate(seqs):
            engine.add_request(
                f"r{i}", s[: PROMPTS[i]].tolist(), SamplingParams(max_new_tokens=6 + 3 * i, temperature=(1.0, 0.7, 0.0, 1.3)[i], seed=i)
            )
        done_requests = engine.run_until_done()
        for rid, c in sorted(done_requests.items()):
            out[f"{key}/engine/{rid}/tokens"] = torch.tensor(c.token_ids)
            out[f"{key}/engine/{rid}/log_probs"] = torch.tensor(c.log_probs, dtype=torch.float64)


def compute(groups: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """Every golden entry (or those of ``groups``: "ops", "model/dense/fp32", ...) with the flag on."""
    from true_on_policy.transformers_adapter.forwards import patch_transformers
    from true_on_policy.kernels import ops

    patch_transformers()
    out: dict[str, torch.Tensor] = {}
    with ops.consistent(True), torch.random.fork_rng():
        if groups is None or "ops" in groups:
            _op_cases(out)
        for kind in ("dense", "moe"):
            for dname in DTYPES:
                if groups is None or f"model/{kind}/{dname}" in groups:
                    _model_cases(out, kind, dname)
    return {k: v.detach().clone() for k, v in out.items()}


GROUPS = ("ops",) + tuple(f"model/{k}/{d}" for k in ("dense", "moe") for d in DTYPES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="(re)write tests/support/data/kernel_goldens_<this CPU capability>.pt")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from true_on_policy.kernels import ops

    with ops.switched(native=False):  # the specification's bits; the C++ fast path is held equal to them
        goldens = compute()
    size = sum(v.numel() * v.element_size() for v in goldens.values())
    print(f"{len(goldens)} entries, {size / 1e6:.2f} MB")
    if args.write:
        DATA.mkdir(exist_ok=True)
        torch.save({"environment": environment(), "tensors": goldens}, golden_path())
        print(f"wrote {golden_path()}")


def environment() -> dict[str, str]:
    """What the bits depend on besides the code: the torch build and the CPU kernels it dispatches to."""
    return {"torch": str(torch.__version__), "cpu_capability": str(torch.backends.cpu.get_cpu_capability())}


def golden_path() -> pathlib.Path:
    """This CPU capability's goldens file."""
    return DATA / f"kernel_goldens_{environment()['cpu_capability']}.pt"


def load() -> dict[str, torch.Tensor]:
    """The stored goldens of this CPU capability; an error naming the difference if there are none or
    they were made with another torch build."""
    path, here = golden_path(), environment()
    recipe = (
        "GEMM and exp bits depend on both. Write it from the kernels' torch code of a commit whose goldens held "
        "(git archive <commit> true_on_policy tests | tar -x -C /tmp/ref; cd /tmp/ref && PYTHONPATH=/tmp/ref "
        f"python tests/support/kernel_goldens.py --write (tests/kernel_goldens.py before issue 53); copy the file it "
        f"wrote to tests/support/data/{path.name}), then run the test "
        "on the current kernels."
    )
    if not path.exists():
        held = sorted(p.name for p in DATA.glob("kernel_goldens_*.pt"))
        raise RuntimeError(f"no {path.name} (there are {held}) for this environment, {here}: {recipe}")
    stored = torch.load(path)
    if stored["environment"] != here:
        raise RuntimeError(f"{path.name} was written with {stored['environment']}, this is {here}: {recipe}")
    return stored["tensors"]


if __name__ == "__main__":
    main()
