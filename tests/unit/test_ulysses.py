"""Ulysses sequence parallelism under the flag: a packed batch's token log-probs at SP 2 are SP 1's bits.

Two gloo ranks run verl's own Ulysses steps around the project's model code: ``ulysses_pad_and_slice_inputs``
(tokens, rolled labels and position ids padded to a multiple of SP and sliced), verl's SP group set as its FSDP
engine sets it (read through the adapter's ``use_ulysses_group``), the forward on the rank's slice, the log-probs
gathered and unpadded by ``gather_outputs_and_unpad``. Every tiny architecture (dense, MoE, Qwen2, Llama with
one KV head, so repeated; Qwen3.5 dense and MoE, whose Gated DeltaNet all-to-alls by heads), fp32 and bf16,
``torch.equal`` against the unsplit forward. Twin: the same slices without the all-to-all (each rank attends
and recurs within its slice) differ. The backward through the all-to-alls gives SP 1's gradients (allclose:
the ranks' partial sums are added by the all-reduce, as in verl's FSDP).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kernel_helpers import spawn_ranks
from true_on_policy.tiny_assets import MODEL_KINDS

WORLD = 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LENGTHS = (5, 13, 30, 67)  # 115 tokens: one pad token for SP 2; sequences cross the slice boundary
GRAD_KINDS = ("dense", "qwen35_moe")


def _model(kind, dtype):
    from true_on_policy.tiny_assets import build_model
    from true_on_policy.transformers_adapter.training_attention import ATTN_IMPLEMENTATION

    model = build_model(kind, seed=0).to(dtype)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def _batch():
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 128, (n,), generator=g) for n in LENGTHS]
    ids = torch.cat(seqs)[None]
    return ids, torch.cat([torch.arange(n) for n in LENGTHS])[None], torch.roll(ids, -1, dims=1)


def _log_probs(model, sequence_parallel: bool):
    """Token log-probs of the packed batch (label: the next token), as verl's FSDP engine computes them."""
    from verl.utils import ulysses

    from true_on_policy.kernels import ops

    ids, pos, labels = _batch()
    if not sequence_parallel:
        return ops.token_log_probs(model(input_ids=ids, position_ids=pos, use_cache=False).logits[0], labels[0])
    ulysses.set_ulysses_sequence_parallel_group(dist.group.WORLD)
    try:
        ids, pos, pad = ulysses.ulysses_pad_and_slice_inputs(ids, pos, sp_size=WORLD)
        labels, _, _ = ulysses.ulysses_pad_and_slice_inputs(labels, None, sp_size=WORLD)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        local = ops.token_log_probs(logits, labels[0])
        return ulysses.gather_outputs_and_unpad(local, gather_dim=0, unpad_dim=0, padding_size=pad), local, pad
    finally:
        ulysses.set_ulysses_sequence_parallel_group(None)


def _grad_gap(kind) -> float:
    """fp32: the largest gradient difference (relative to the tensor's largest entry), SP 2 vs SP 1."""
    full, split = _model(kind, torch.float32), _model(kind, torch.float32)
    (-_log_probs(full, False).sum()).backward()
    _, local, pad = _log_probs(split, True)
    if dist.get_rank() == WORLD - 1 and pad:
        local = local[:-pad]
    (-local.sum()).backward()
    gap = 0.0
    for (name, a), b in zip(full.named_parameters(), split.parameters()):
        dist.all_reduce(b.grad)
        gap = max(gap, ((a.grad - b.grad).abs().max() / a.grad.abs().max().clamp_min(1e-30)).item())
    return gap


def _worker(rank: int) -> dict:
    from true_on_policy.kernels import ops, sequence_parallel
    from true_on_policy.transformers_adapter.forwards import patch_transformers
    from true_on_policy.verl_adapter import consistent_training

    patch_transformers()
    consistent_training.use_ulysses_group()
    out = {}
    with ops.consistent(True), torch.no_grad():
        for kind in MODEL_KINDS:
            for dname, dtype in DTYPES.items():
                model = _model(kind, dtype)
                out[kind, dname] = dict(sp1=_log_probs(model, False), sp2=_log_probs(model, True)[0])
        source = sequence_parallel._SOURCE[0]
        sequence_parallel.set_group_source(lambda: None)  # the twin: verl slices, nothing all-to-alls
        try:
            out["alone"] = {kind: _log_probs(_model(kind, torch.float32), True)[0] for kind in ("dense", "qwen35")}
        finally:
            sequence_parallel.set_group_source(source)
    with ops.consistent(True):
        out["grads"] = {kind: _grad_gap(kind) for kind in GRAD_KINDS}
    with ops.consistent(False), torch.no_grad():
        try:
            _log_probs(_model("qwen35", torch.float32), True)
        except Exception as error:  # noqa: BLE001 - the message is the assertion
            out["flag_off_gdn"] = str(error)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("ulysses"))


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_sequence_parallel_2_gives_the_unsplit_bits(ranks, kind, dname):
    for rank in ranks:
        res = rank[kind, dname]
        assert res["sp1"].shape == res["sp2"].shape == (sum(LENGTHS),)
        assert torch.equal(res["sp1"], res["sp2"]), (kind, dname, (res["sp1"] - res["sp2"]).abs().max().item())
    assert torch.equal(ranks[0][kind, dname]["sp2"], ranks[1][kind, dname]["sp2"])


@pytest.mark.parametrize("kind", ["dense", "qwen35"])
def test_twin_slices_without_the_all_to_all_differ(ranks, kind):
    sp1, alone = ranks[0][kind, "fp32"]["sp1"], ranks[0]["alone"][kind]
    boundary = -(-sum(LENGTHS) // WORLD)  # 58: the last sequence (48..114) crosses it
    assert torch.equal(sp1[:boundary], alone[:boundary])  # causal: rank 0's tokens see only their own slice
    assert (sp1[boundary:] - alone[boundary:]).abs().max().item() > 1e-3


@pytest.mark.parametrize("kind", GRAD_KINDS)
def test_the_backward_through_the_all_to_alls_gives_sp_1s_gradients(ranks, kind):
    assert ranks[0]["grads"][kind] < 1e-5


def test_flag_off_gated_delta_net_under_sequence_parallel_is_refused_by_name(ranks):
    assert "Ulysses sequence parallelism runs on the consistent kernels only" in ranks[0]["flag_off_gdn"]
