"""Golden outputs of every consistent kernel, on fixed seeded inputs, for before/after bitwise checks.

:func:`compute` runs every op of :mod:`true_on_policy.kernels.ops` (forward, and backward where it
is an autograd Function), a full model training forward + backward (packed and padded) and a
rollout (chunked prefill + decode steps over KV caches, then the rollout engine's sampled tokens
and recorded log-probs) for the tiny dense and MoE models in fp32 and bf16. The inputs and the
weights come from one ``torch.Generator`` (not from transformers' initialisers), so they depend on
nothing but this file. A goldens file (``tests/support/data/kernel_goldens_*.pt``) holds what the kernels'
torch code (the specification, ``ops.switched(native=False)``) computes, with the torch build;
``tests/unit/test_kernel_goldens.py`` asserts ``torch.equal`` for every entry.

What the bits rest on: most entries on the vendor kernels the torch code calls (MKL's sgemm and VML:
``true_on_policy.kernels.premises``), so a file serves the CPUs whose :func:`premises.key` the index
``tests/support/data/kernel_goldens.json`` maps to it (key -> file, and where that was measured or how it was
inferred); a key the index lacks is a named skip (:func:`load_or_skip`), and ``--adopt`` adds this CPU's key
where its torch code computes a held file's bits, ``--write`` a file of its own. The :data:`OWN_ORDER` entries
rest on the project's order alone (correctly rounded arithmetic, the fixed tree, the library's fma chain):
the same in every file, checked on any CPU (:func:`load_own_order`).
History: first written from the original kernels (commit 0c2b828); rewritten once, when the linear's
reduction over K became the TP-invariant tree (issue 21: every ``linear/``, ``model/`` and new
``linear/tree/`` entry changed, every other op's entry kept its bits;
``tests/unit/test_tp_invariant_kernels.py`` holds the old order's twin). ``kernel_goldens_AVX512.pt`` is that
file; ``kernel_goldens_AVX2.pt`` was added from the torch code of 6fbb93a (the commit after which the AVX512
goldens last held), and holds the same bits; keyed by the fingerprint since issue 54.
"""

from __future__ import annotations

import argparse
import datetime
import json
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
    model = build(kind, DTYPES[dname])
    key = f"model/{kind}/{dname}"
    seqs = _sequences()
    model.train()
    _packed_training(out, key, model, seqs)
    _padded_training(out, key, model, seqs)
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        _rollout_steps(out, key, model, seqs)
        _engine_samples(out, key, model, seqs)


def _packed_training(out: dict, key: str, model, seqs) -> None:
    """Packed training forward + backward (verl's use_remove_padding layout)."""
    from true_on_policy.kernels import ops

    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    labels = torch.roll(ids[0], -1)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    lp = ops.token_log_probs(logits, labels)
    (-lp.mean()).backward()
    out[f"{key}/packed/logits_every4"] = logits.detach()[::4]  # every 4th row: keeps the file small
    out[f"{key}/packed/token_log_probs"] = lp.detach()
    for name, p in model.named_parameters():  # layer 0 and the embedding: downstream of all backward
        if ".layers.1." not in name and "mlp.up_proj" not in name:
            out[f"{key}/packed/grad/{name}"] = p.grad


def _padded_training(out: dict, key: str, model, seqs) -> None:
    """Padded training forward + backward: left padding, right padding, cumsum positions."""
    from true_on_policy.kernels import ops

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


def _rollout_steps(out: dict, key: str, model, seqs) -> None:
    """Rollout: staggered admission, a chunked prefill, then decode steps over the KV caches."""
    from true_on_policy.rollout.packed_forward import KVCache, forward_packed

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


def _engine_samples(out: dict, key: str, model, seqs) -> None:
    """The rollout engine: continuous batching, sampling, recorded log-probs."""
    from true_on_policy.rollout.engine import RolloutEngine, SamplingParams

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
INDEX = DATA / "kernel_goldens.json"  # premises.key() -> {"file": a goldens file, "measured_on": how it was found}
# the entries whose bits rest on the project's order alone (the fixed tree, correctly rounded elementwise
# arithmetic, the library's fma chain in the linear's tiles): every CPU's file holds the same; the linear's
# gradients ("/grad_") are plain matmuls, MKL's
OWN_ORDER = ("fixed_sum/", "apply_rope/", "moe_combine/", "linear/")


class NoGoldens(LookupError):
    """The index holds no goldens file for this CPU's key."""


def environment() -> dict[str, str]:
    """What the bits depend on besides the code and the vendor kernels' key: the torch build (and, as
    recorded, the CPU capability the file was written on)."""
    return {"torch": str(torch.__version__), "cpu_capability": str(torch.backends.cpu.get_cpu_capability())}


def index() -> dict[str, dict[str, str]]:
    """The index: key -> {"file", "measured_on"}."""
    return json.loads(INDEX.read_text())


def _describe_cpu() -> str:
    """This CPU as a line of the index and of a skip: model, the kernels' flags, torch, MKL."""
    from true_on_policy.kernels import premises

    info = premises.cpu_info()
    flags = " ".join(flag for flag, present in info["flags"].items() if present) or "none of " + " ".join(info["flags"])
    return f"{info['model']} ({flags}), torch {torch.__version__}, {premises.mkl_version()}"


def index_entry(key: str | None = None) -> dict[str, str]:
    """``key``'s (default: this CPU's) index entry; :class:`NoGoldens` naming the key and what is held."""
    from true_on_policy.kernels import premises

    key = premises.key() if key is None else key
    held = index()
    if key not in held:
        raise NoGoldens(
            f"no kernel goldens for the key {key} (this CPU: {_describe_cpu()}); held: {sorted(held)}. Premise "
            f"held_key: {premises.PREMISES['held_key']}. Adopt a held file where this CPU's torch code computes "
            "its bits, or write one: python tests/support/kernel_goldens.py --adopt | --write"
        )
    return held[key]


def _read(name: str) -> dict[str, torch.Tensor]:
    """A goldens file's tensors; an error naming both builds where it was written with another torch."""
    stored = torch.load(DATA / name)
    if stored["environment"]["torch"] != environment()["torch"]:
        raise RuntimeError(
            f"{name} was written with {stored['environment']}, this is {environment()}: the vendor kernels' bits "
            "depend on the build. Write goldens from the kernels' torch code of a commit whose goldens held "
            "(git archive <commit> true_on_policy tests | tar -x -C /tmp/ref; cd /tmp/ref && PYTHONPATH=/tmp/ref "
            "python tests/support/kernel_goldens.py --write (tests/kernel_goldens.py before issue 53); copy the file "
            "it wrote to tests/support/data/ and map this CPU's key to it in kernel_goldens.json), then run the test "
            "on the current kernels."
        )
    return stored["tensors"]


def load() -> dict[str, torch.Tensor]:
    """The goldens of this CPU's key (:class:`NoGoldens` where the index has none)."""
    return _read(index_entry()["file"])


def load_or_skip() -> dict[str, torch.Tensor]:
    """:func:`load`, where the index lacks this CPU's key a pytest skip naming the key and the premise."""
    import pytest

    try:
        return load()
    except NoGoldens as error:
        pytest.skip(str(error))


def own_order_entries(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The :data:`OWN_ORDER` entries of ``tensors``."""
    return {name: value for name, value in tensors.items() if name.startswith(OWN_ORDER) and "/grad_" not in name}


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names of entries not in both or not ``torch.equal``, sorted."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def load_own_order() -> dict[str, torch.Tensor]:
    """The :data:`OWN_ORDER` entries, which every held file must hold alike (an error naming the first that
    differs otherwise): stored bits for any CPU."""
    files = sorted({entry["file"] for entry in index().values()})
    first = own_order_entries(_read(files[0]))
    for name in files[1:]:
        if differ := _differing(first, own_order_entries(_read(name))):
            raise RuntimeError(f"own-order entries differ between {files[0]} and {name}: {differ[:10]}")
    return first


def _add_to_index(key: str, name: str, how: str) -> None:
    held = index()
    held[key] = {"file": name, "measured_on": f"{datetime.date.today().isoformat()}, {_describe_cpu()}: {how}"}
    INDEX.write_text(json.dumps(dict(sorted(held.items())), indent=2) + "\n")


def _adopt(key: str, goldens: dict[str, torch.Tensor]) -> int:
    """Map ``key`` to a held file whose every entry this CPU's torch code reproduces; else say how far each is."""
    for name in sorted({entry["file"] for entry in index().values()}):
        stored = _read(name)
        differ = _differing(stored, goldens)
        if not differ:
            _add_to_index(key, name, f"adopted: the torch code reproduces all {len(stored)} entries")
            print(f"{key} -> {name}, added to {INDEX}")
            return 0
        print(f"{name}: {len(differ)} of {len(stored)} entries differ ({differ[:5]} ...)")
    print(f"no held file fits {key}: write its own with --write")
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true",
                        help="write tests/support/data/kernel_goldens_<this CPU's key>.pt and its index entry")
    action.add_argument("--adopt", action="store_true",
                        help="map this CPU's key to a held file whose every entry its torch code reproduces")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from true_on_policy.kernels import ops, premises

    key = premises.key()
    if args.adopt and key in index():
        print(f"{key} is held already: {index()[key]}")
        return 0
    with ops.switched(native=False):  # the specification's bits; the C++ fast path is held equal to them
        goldens = compute()
    size = sum(v.numel() * v.element_size() for v in goldens.values())
    held = "held" if key in index() else "not held"
    print(f"{len(goldens)} entries, {size / 1e6:.2f} MB; this CPU's key {key} is {held}")
    if args.adopt:
        return _adopt(key, goldens)
    if args.write:
        name = f"kernel_goldens_{key}.pt"
        torch.save({"environment": environment(), "tensors": goldens}, DATA / name)
        _add_to_index(key, name, "written by --write from the torch code")
        print(f"wrote {DATA / name} and its entry in {INDEX}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
