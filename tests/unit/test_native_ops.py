"""The C++ fast path (``kernels/native.py``) computes the torch code's bits, and the shorter decode tiles keep them.

Each native op is held ``torch.equal`` to the ops' torch code (``ops.switched(native=False)``) on shapes
that cover its branches; the goldens are reproduced by the torch code alone too. The linear is held to two
references (:class:`Reference`): the project's order, on any CPU, and the torch code, whose products are MKL's
sgemm and equal it where MKL computes that order (premise ``mkl_sgemm_chain``). Twins show what each guard is
for: an IEEE square root (instead of torch's) changes RMSNorm bits, tiles of 1-2 rows or below torch's BLAS
threshold change a row's matmul bits, and a build without OpenMP runs the library's loops on one thread; a
twin resting on a fact about MKL looks for a case on the CPU it runs on and skips naming the premise if none is.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import threading

import numpy as np
import pytest
import torch

import kernel_goldens
from kernel_helpers import gen, own_order, premise_skip, threads
from true_on_policy.kernels import moe, native, ops


def both_paths(fn):
    """(native result, torch-code result) of ``fn()``."""
    with torch.no_grad():
        fast = fn()
        with ops.switched(native=False):
            reference = fn()
    return fast, reference


class Reference:
    """The bits a test holds the native linear to, by name.

    "project_order": on any CPU, the own-order reference (``kernel_helpers.own_order``) where the route rule puts
    the linear on the fma chain (the chain and dot routes, taken where :func:`native.fma_chain_lib` holds), else
    the torch code (the tiles route calls it). "torch_code": the specification, equal where MKL's sgemm computes
    the project's chain; a case where the native path is the project's order and only the torch code differs is
    recorded, and :meth:`done` then skips naming premise ``mkl_sgemm_chain``; any other difference fails.
    """

    def __init__(self, name: str):
        self.name, self.misses, self.cases = name, [], 0

    def check(self, fn, label):
        """The native path's result of ``fn()``, held to this reference (``label`` names the case)."""
        self.cases += 1
        with torch.no_grad():
            fast = fn()
            if self.name == "project_order":
                on_chain = native.fma_chain_lib(native.FMA_CHAIN_MIN_N) is not None
                with own_order() if on_chain else ops.switched(native=False):
                    expected = fn()
                assert fast.dtype == expected.dtype and torch.equal(fast, expected), label
                return fast
            with ops.switched(native=False):
                expected = fn()
            if fast.dtype == expected.dtype and torch.equal(fast, expected):
                return fast
            with own_order():
                own = fn()
        assert torch.equal(fast, own), (label, "the native path is neither the torch code's nor the project's order")
        self.misses.append(label)
        return fast

    def done(self) -> None:
        if self.misses:
            premise_skip("mkl_sgemm_chain", f"the torch code differs in {len(self.misses)} of {self.cases} cases, "
                                            f"first {self.misses[:3]}")


@pytest.fixture(params=["project_order", "torch_code"])
def reference(request) -> Reference:
    return Reference(request.param)


def test_the_native_library_is_built_and_used():
    """`make install` builds it: a missing library would leave every test on the slow path unnoticed."""
    lib = native.lib()
    assert lib is not None, "the native kernels did not build (see the RuntimeWarning)"
    x = torch.ones(3)
    with ops.switched(native=False):
        assert ops._route("fixed_sum", x.device, x) is ops.SPECIFICATION
    assert ops._route("fixed_sum", x.device, x).run is lib.fixed_sum


def test_the_native_loops_run_on_torchs_threads():
    """The library is built with OpenMP: its at::parallel_for loops use torch's intra-op threads."""
    lib = native.lib()
    for n_threads in (1, 2):
        with threads(n_threads):
            assert lib.parallel_threads(8) == n_threads


def test_twin_without_openmp_the_native_loops_run_serially(tmp_path):
    """Why CFLAGS has -fopenmp: ATen's at::parallel_for is header-only, and compiled without OpenMP it
    is a serial loop whatever torch's thread count (the C++ path then ran on one core). The library's
    own parallel_threads, compiled alone (not the whole library: minutes) with its flags but -fopenmp."""
    from torch.utils.cpp_extension import load_inline

    source = (native.CSRC / "fixed_order.cpp").read_text()
    function = re.search(r"^int64_t parallel_threads\(.*?^}$", source, re.S | re.M).group(0)
    serial = load_inline(
        "true_on_policy_serial_parallel_threads", "#include <atomic>\n" + function, functions=["parallel_threads"],
        extra_cflags=[f for f in native.CFLAGS if f != "-fopenmp"], build_directory=str(tmp_path),
    )
    with threads(2):
        assert serial.parallel_threads(8) == 1


def _started(fn) -> tuple[threading.Thread, list]:
    """fn() on a daemon thread (a load that hangs must not hang the test), and the list its outcome lands in."""
    outcome: list = []

    def run():
        try:
            outcome.append(fn())
        except Exception as error:  # noqa: BLE001 -- the outcome is what the test reads
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_build_lock_left_by_a_killed_builder_does_not_hang_the_next_load():
    """A builder killed mid-build (a job stopped, a machine preempted) leaves torch's build lock file in the build
    directory, and torch's load waits on it forever: every later process that needs the kernels hangs without a
    word (a vLLM worker stuck there surfaces as an RPC timeout). The build holds the directory by an OS lock
    that dies with its holder, and under it clears such a leftover."""
    directory = native.build_directory()
    leftover = directory / native.TORCH_BUILD_LOCK
    # planted while holding the directory, as a builder killed inside torch's build leaves it: never between
    # another process's clearing and its own build (which would then wait on this file)
    with native.one_builder(directory):
        leftover.touch()
    try:
        thread, outcome = _started(native.build)
        thread.join(timeout=300)
        assert outcome and hasattr(outcome[0], "exp_fp32") and not leftover.exists(), outcome
    finally:
        leftover.unlink(missing_ok=True)


def test_twin_torch_alone_waits_on_a_leftover_build_lock(tmp_path):
    """The same leftover in a directory loaded by torch alone: still waiting seconds later (no compile is
    needed to see it: the wait comes before any build), and it goes on once the file is gone. Under
    :func:`native.one_builder` the leftover is cleared before torch looks."""
    from torch.utils.cpp_extension import load

    (tmp_path / "leftover.cpp").write_text("int leftover() { return 1; }\n")
    leftover = tmp_path / native.TORCH_BUILD_LOCK
    leftover.touch()
    thread, _ = _started(lambda: load("true_on_policy_leftover_lock_twin", [str(tmp_path / "leftover.cpp")],
                                      build_directory=str(tmp_path)))
    thread.join(timeout=5)
    assert thread.is_alive()
    leftover.unlink()
    thread.join(timeout=60)
    assert not thread.is_alive()
    leftover.touch()
    with native.one_builder(tmp_path):
        assert not leftover.exists()


def test_the_build_compiles_copies_named_by_the_build_directory_not_the_package(tmp_path):
    """torch's ninja rules name each source by its path: compiled from the package's own files, two
    copies of the package on one environment (a checkout and a wheel, two worktrees) would each
    rewrite the shared build's rules and recompile the library the other had just built. The build
    compiles copies inside its directory (whose name holds the sources' hash), the same paths for
    every copy of the package; staging again leaves them untouched. What it compiles is the one unit that
    includes every source."""
    staged = native.staged_sources(tmp_path)
    assert staged == [tmp_path / "src" / native.ONE_UNIT]
    assert staged[0].read_text().splitlines() == [f'#include "{path.name}"' for path in native.SOURCES]
    for path in native.SOURCES + native.HEADERS:
        assert (tmp_path / "src" / path.name).read_bytes() == path.read_bytes()
    stamps = [path.stat().st_mtime_ns for path in staged]
    assert native.staged_sources(tmp_path) == staged and [path.stat().st_mtime_ns for path in staged] == stamps
    # the twin: the package's own paths, which differ from copy to copy
    assert all(tmp_path not in path.parents for path in native.SOURCES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fixed_sum_are_the_torch_codes_bits(dtype):
    g = gen(0)
    for shape in [(1, 64), (7, 64), (3, 5, 100), (2, 1000), (33, 17), (4, 512, 64), (2, 0, 8)]:
        x = (torch.randn(shape, generator=g) * 3).to(dtype)
        w = torch.randn(shape[-1], generator=g).to(dtype)
        fast, reference = both_paths(lambda: ops.rms_norm(x, w, 1e-6))
        assert fast.dtype == reference.dtype and torch.equal(fast, reference), shape
        fast, reference = both_paths(lambda: ops.fixed_sum(x.float()))
        assert torch.equal(fast, reference), shape
    x = torch.randn(6, 40, generator=g)[:, ::2]  # non-contiguous rows
    assert torch.equal(*both_paths(lambda: ops.fixed_sum(x)))


def test_twin_an_ieee_square_root_changes_rms_norm_bits():
    """Why the native RMSNorm calls torch's sqrt: torch's (MKL VML) is not the correctly rounded one."""
    g = gen(1)
    h = torch.randn(4096, 64, generator=g) * 3
    variance = (ops.fixed_sum(h * h) / 64 + 1e-6).numpy()
    ieee = torch.from_numpy(np.sqrt(variance))  # numpy's float32 sqrt: correctly rounded
    assert not torch.equal(ieee, torch.from_numpy(variance).sqrt())
    assert not torch.equal(h / ieee, ops.rms_norm(h, torch.ones(64), 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_is_the_references_bits(dtype, reference):
    g = gen(2)
    for m in (1, 3, 4, 5, 8, 9, 16, 17, 31, 33, 64, 65, 130):
        for n, k, bias in [(24, 64, True), (192, 64, False), (4, 200, True), (2, 16, False), (3, 300, False),
                           (20, 1100, True)]:  # leaves of 275: three K chunks each
            x = torch.randn(m, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
            b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
            for out_dtype in (dtype, torch.float32):
                reference.check(lambda: ops.linear(x, w, b, out_dtype=out_dtype), (m, n, k, out_dtype))
    x = torch.randn(2, 3, 64, generator=g)
    wt = torch.randn(64, 24, generator=g).t()  # a transposed (non-contiguous) weight
    reference.check(lambda: ops.linear(x, wt), "transposed weight")
    reference.done()


def test_twin_the_project_order_reference_sees_another_order(monkeypatch):
    """The project-order comparison has teeth: a reference whose K chunks are added last to first is not the
    native linear's bits."""
    import kernel_helpers

    chain_tiles = kernel_helpers._chain_tiles

    def reversed_chunks(a, b):
        chunks = [chain_tiles(a[..., s : s + ops.K_CHUNK], b[:, s : s + ops.K_CHUNK])
                  for s in range(0, a.shape[-1], ops.K_CHUNK)]
        return functools.reduce(lambda total, part: total + part, chunks[::-1])

    g = gen(12)
    x, w = torch.randn(9, 1100, generator=g), torch.randn(24, 1100, generator=g) * 0.1  # leaves of 3 chunks
    Reference("project_order").check(lambda: ops.linear(x, w), "leaves of 128 + 128 + 19")
    monkeypatch.setattr(kernel_helpers, "_chain_tiles", reversed_chunks)
    with pytest.raises(AssertionError):
        Reference("project_order").check(lambda: ops.linear(x, w), "leaves of 19 + 128 + 128")


def _bits_line_misses(op: str, doc: str) -> list[str]:
    """What the ``Bits:`` line of ``op``'s docstring fails to name of what its torch code rests on."""
    if "Bits:" not in doc:
        return ["a Bits: line"]
    line = doc[doc.index("Bits:"):]
    wanted = ops.SPEC_RESTS_ON[op] or ("the project's order",)
    return [name for name in wanted if name not in line]


def test_every_op_says_what_its_bits_rest_on():
    """ops.SPEC_RESTS_ON (the torch code) and each route of ops.ROUTES name the vendor kernels the bits rest on
    (premises.VENDOR_KERNELS); a C++ route rests on none its torch code does not, and reads only PROBES' checks;
    each op's docstring says it in its Bits: line (the twin: a line without it is seen)."""
    from true_on_policy.kernels import gated_delta, premises

    assert set(ops.ROUTES) <= set(ops.SPEC_RESTS_ON)
    for op, spec in ops.SPEC_RESTS_ON.items():
        assert set(spec) <= set(premises.VENDOR_KERNELS), op
        assert ops.bits_rest_on(op) == spec
        for route in ops.ROUTES.get(op, ()):
            assert set(route.rests_on) <= set(spec) and set(route.probes) <= set(ops.PROBES), (op, route.path)
            assert ops.bits_rest_on(op, route.path) == route.rests_on
    functions = {op: getattr(ops, op, None) or getattr(moe, op, None) or getattr(gated_delta, op, None)
                 for op in ops.SPEC_RESTS_ON}
    # no function of their own: attention's docstring says its backward's, CheckpointedDeltaRule's its backward's
    assert {op for op, function in functions.items() if function is None} == {"attention_backward",
                                                                             "delta_rule_backward"}
    misses = {op: _bits_line_misses(op, function.__doc__) for op, function in functions.items() if function}
    assert not any(misses.values()), misses
    assert _bits_line_misses("rms_norm", "Bits: the project's order.") == ["vml_sqrt"]
    with pytest.raises(KeyError, match="op='matmul' is not one of"):
        ops.bits_rest_on("matmul")
    with pytest.raises(KeyError, match=r"path='dot' is not a route of rms_norm \(\['native'\]\)"):
        ops.bits_rest_on("rms_norm", "dot")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_the_torch_codes_bits(dtype):
    """The fused activation (gate and up as halves of one tensor, as vLLM hands them, or separate)."""
    g = gen(5)
    for rows, width in [(1, 64), (7, 100), (33, 3072), (2, 17), (3, 2500)]:
        fused = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
        gate, up = fused[:, :width], fused[:, width:]
        assert torch.equal(*both_paths(lambda: ops.silu_mul(gate, up))), (rows, width)
        gate, up = gate.contiguous(), up.contiguous()
        fast, reference = both_paths(lambda: ops.silu_mul(gate, up))
        assert fast.dtype == dtype and torch.equal(fast, reference), (rows, width)
        assert torch.equal(reference, ops.silu(gate) * up)
    gate, up = (torch.randn(2, 2, 2, 2100, generator=g) * 4).to(dtype).unbind(0)  # [batch, positions, width]
    assert torch.equal(*both_paths(lambda: ops.silu_mul(gate, up)))
    assert torch.equal(*both_paths(lambda: ops.silu_mul(gate.transpose(0, 1), up.transpose(0, 1))))


def test_the_librarys_exp_is_torchs_bits():
    """The fused kernels call MKL VML's exp directly, one short run at a time, where native.lib() found it
    computing torch.exp's bits; otherwise (a torch without MKL) at::exp. Both give torch.exp's bits on
    every run: specials, denormal results, vector tails, NaN payloads."""
    lib = native.lib()
    assert native.exp_is_torchs(lib)
    x = torch.cat([torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -87.5, -103.0, 88.7]),
                   torch.randn(3000, generator=gen(11)) * 30])
    reference = torch.exp(x).view(torch.int32)
    try:
        for vml in (True, False):
            lib.use_vml_exp(vml)
            for start, n in ((0, x.numel()), (1, 15), (8, 17), (100, 1)):
                assert torch.equal(lib.exp_fp32(x[start : start + n]).view(torch.int32), reference[start : start + n])
    finally:
        lib.use_vml_exp(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_reads_the_cache_in_place_with_the_torch_codes_bits(dtype):
    """vLLM's paged cache read in place (shuffled blocks, garbage in unused slots and blocks, chunked
    prefill and decode rows) gives the bits of attention over the gathered keys and values."""
    g = gen(6)
    hkv, bs, d, blocks = 2, 16, 32, 40
    key_cache = (torch.randn(blocks, hkv, 2 * bs, d, generator=g) * 3).to(dtype)  # keys, then values: vLLM's layout
    kv = ops.PagedKV(key_cache[:, :, :bs], key_cache[:, :, bs:], torch.randperm(blocks, generator=g)[:15].view(3, 5))
    seq_lens = torch.tensor([70, 33, 1])
    q_lens = torch.tensor([20, 1, 1])  # a prefill chunk, two decode rows
    Tq, Tk = int(q_lens.max()), 5 * bs
    q_positions = torch.full((3, Tq), -1)
    for s_, (n, q) in enumerate(zip(seq_lens.tolist(), q_lens.tolist())):
        q_positions[s_, :q] = torch.arange(n - q, n)
    kv_valid = torch.arange(Tk)[None] < seq_lens[:, None]
    plan = ops.attention_plan(q_positions, kv_valid, 4, hkv)
    q = torch.randn(3, 4, Tq, d, generator=g).to(dtype)
    fast, reference = both_paths(lambda: ops.paged_attention(q, kv, plan, 0.2))
    assert torch.equal(fast, reference)
    keys, values = kv.gather()
    assert torch.equal(fast, ops.attention(q, keys, values, None, None, 0.2, plan))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal where not NaN, and NaN in the same places."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_skips_the_pairs_a_sequence_does_not_see_with_the_torch_codes_bits(dtype):
    """The plan's (tile, block) pairs are the whole batch's: beside a sequence whose chunk starts at
    position 100, a fresh 100-token prefill has pairs none of its rows sees. The native kernel skips
    them per sequence (in inference), and the bits stay the torch code's, NaN included: an infinite
    value in a skipped block still turns the rows whose zero probabilities multiply it into NaN."""
    g = gen(8)
    S, Hq, Hkv, D, Tq, Tk = 2, 4, 2, 16, 100, 200
    q_pos = torch.stack([torch.arange(100, 200), torch.arange(0, 100)])
    kv_valid = torch.arange(Tk)[None] < torch.tensor([[200], [100]])
    plan = ops.attention_plan(q_pos, kv_valid, Hq, Hkv)
    sees = plan.visible.flatten(2).any(-1)  # [S, pairs]
    assert sees[0].all() and not sees[1].all(), "the short sequence has no idle pair: the case tests nothing"
    q = torch.randn(S, Hq, Tq, D, generator=g).to(dtype)
    k = torch.randn(S, Hkv, Tk, D, generator=g).to(dtype)
    for poisoned in (False, True):
        v = torch.randn(S, Hkv, Tk, D, generator=g).to(dtype)
        if poisoned:
            v[1, 0, 80, 3] = math.inf  # position 80: a value after the short sequence's first tile, in a block that tile skips
        for n_threads in (1, 2):
            with threads(n_threads):
                fast, reference = both_paths(lambda: ops.attention(q, k, v, q_pos, kv_valid, 0.25))
            assert same_values(fast, reference), (poisoned, n_threads)
            assert torch.isnan(reference[1, :2, :16]).any() == poisoned  # rows 0..15 never see position 80


def cpu_has_avx512_bf16() -> bool:
    with open("/proc/cpuinfo") as cpuinfo:
        return any(line.startswith("flags") and "avx512_bf16" in line.split() for line in cpuinfo)


def test_bf16_linears_run_on_the_dot_product_where_the_cpu_has_it():
    """`-march=native` compiles the dot path exactly where the CPU has AVX512-BF16, and there its check
    passes: a bf16 linear is never widened to fp32 unnoticed on such a machine."""
    assert native.lib().bf16_dot_built() == cpu_has_avx512_bf16()
    assert (native.bf16_dot_lib() is not None) == cpu_has_avx512_bf16()


def test_bf16_linear_on_the_dot_product_is_the_references_bits(reference):
    """Decode and prefill heights, 1-2 panels of 16 columns, trees of 8 and 32 leaves, a row-parallel
    shard, signed zeros: the dot path (on a CPU without AVX512-BF16, the fp32 path) computes the project's
    fma chains bitwise, and so the torch code's where MKL does."""
    g = gen(3)
    for m in (1, 2, 12, 13, 25, 64, 65, 130):
        for n, k in [(24, 64), (40, 1024), (33, 768), (12, 3072)]:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            x[0, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0])
            w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
            w[:, 5::9] = -0.0
            b = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)
            for out_dtype, k_parts in ((torch.bfloat16, 1), (torch.float32, 1), (torch.float32, 2)):
                reference.check(lambda: ops.linear(x, w, b, out_dtype=out_dtype, k_parts=k_parts),
                                (m, n, k, out_dtype, k_parts))
    reference.done()


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the dot path is compiled only for CPUs with AVX512-BF16")
@pytest.mark.parametrize("case", ["tiny products", "denormal input"])
def test_twin_the_dot_product_flushes_denormals_and_the_guard_keeps_the_bits(case):
    """Why the dot path has a guard: vdpbf16ps flushes denormal inputs and partial sums to zero, the
    fp32 fma chain does not. Without the guard those inputs change bits; with it (ops.linear) the
    columns it cannot vouch for are computed as fma chains, and the bits are the torch code's."""
    g = gen(4)
    x = torch.randn(5, 64, generator=g)
    w = torch.randn(16, 64, generator=g)
    if case == "tiny products":  # products near 2**-140: below fp32's normal range
        x, w = x * 2.0**-70, w * 2.0**-70
    else:  # bf16 denormals (exponent field 0) times large weights: normal products
        x, w = x * 2.0**-130, w * 2.0**20
    x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
    widened = native.lib().chain_matmul(x.float(), w.float().t())  # one leaf, one chunk: the fma chain
    lib = native.lib()
    assert not torch.equal(lib.dot_matmul(x, w, 128, 1, False), widened)
    assert torch.equal(lib.dot_matmul(x, w, 128, 1, True), widened)
    assert torch.equal(*both_paths(lambda: ops.linear(x, w, out_dtype=torch.float32)))


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="weights are packed only for the dot path (AVX512-BF16)")
def test_a_packed_weight_gives_the_linears_bits(reference):
    """A weight laid out once (ops.pack_weight, what vLLM's experts keep between weight loads) gives the
    bits of the weight read as it is, and the reference's: decode and prefill heights, a partial group
    of columns, leaves, a row-parallel shard, and a weight whose denormals the guard must see."""
    g = gen(5)
    for n, k in [(40, 256), (1024, 512), (16, 3072)]:
        w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
        scale = 1.0
        if n == 40:  # a row of denormals times large inputs: the dot product would flush it (premise below);
            w[3] = (torch.randn(k, generator=g) * 2.0**-130).to(torch.bfloat16)  # the pack's exponents say so
            scale = 2.0**20
        pack = ops.pack_weight(w)
        assert pack is not None and pack.shape == (n, k)
        for m in (1, 4, 13, 70):
            x = (torch.randn(m, k, generator=g) * scale).to(torch.bfloat16)
            if n == 40:
                lib = native.lib()
                assert not torch.equal(lib.dot_matmul(x, w, ops.K_CHUNK, 1, False), lib.dot_matmul(x, w, ops.K_CHUNK, 1, True))
                hidden = pack.tensors[1].clone()
                hidden[:, 0] = 127  # exponents that hide the denormals: the group runs on the dot product
                blind = ops.WeightPack(pack.shape, pack.path, (pack.tensors[0], hidden))
                assert not torch.equal(ops.linear(x, w, pack=blind), ops.linear(x, w))
            for out_dtype, k_parts in ((torch.bfloat16, 1), (torch.float32, 2)):
                packed = ops.linear(x, w, out_dtype=out_dtype, k_parts=k_parts, pack=pack)
                fast = reference.check(lambda: ops.linear(x, w, out_dtype=out_dtype, k_parts=k_parts),
                                       (n, k, m, out_dtype))
                assert torch.equal(packed, fast), (n, k, m, out_dtype)
    assert ops.pack_weight(w.float()).path == "chain" and ops.pack_weight(w[:8]) is None  # narrow: padded first
    with pytest.raises(ValueError, match=r"a pack of a weight \[16, 3072\] for a weight \[40, 256\]"):
        ops.linear(x[:, :256], w[:0].new_zeros(40, 256), pack=pack)
    reference.done()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chain_packed_weight_gives_the_linears_bits(dtype, reference):
    """A weight laid out once for the chain path (ops.pack_weight: what vLLM's linears keep between weight
    loads) gives the bits of the weight read as it is, and the reference's: the rows that read it (fp32 up to
    8, bf16 up to 64) and those around them, partial 64-row groups, leaves, and a row-parallel shard. bf16 is
    on the chain path where the dot path is not built or checked; the kernel runs directly on every CPU."""
    g, lib = gen(10), native.lib()
    for n, k in [(12, 64), (100, 256), (1024, 512), (16, 3072)]:
        w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
        pack = ops.WeightPack((n, k), "chain", (lib.pack_chain_weight(w, 1),))
        for m in (1, 4, 5, 8, 9, 64, 65):
            x = torch.randn(m, k, generator=g).to(dtype)
            for out_dtype, k_parts in ((dtype, 1), (torch.float32, 2)):
                leaves = ops.local_leaves(k, k_parts)
                packed = lib.linear_chain(x, w, None, out_dtype, ops.K_CHUNK, leaves, [*pack.tensors])
                fast = reference.check(lambda: ops.linear(x, w, out_dtype=out_dtype, k_parts=k_parts),
                                       (n, k, m, out_dtype))
                assert torch.equal(packed, fast), (n, k, m, out_dtype)
                if ops.pack_weight(w).path == "chain":  # dispatched: ops.linear reads it
                    assert torch.equal(ops.linear(x, w, out_dtype=out_dtype, k_parts=k_parts, pack=pack), fast)
    with pytest.raises(RuntimeError, match=r"a chain pack must be pack_chain_weight\(weight, 1\) of the weight \[16, 3072\]"):
        lib.linear_chain(x[:1], w, None, dtype, ops.K_CHUNK, 1, [lib.pack_chain_weight(w.t().contiguous(), 1)])
    reference.done()


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="weights are packed only for the dot path (AVX512-BF16)")
def test_twin_a_pack_is_a_copy_that_a_weight_load_leaves_stale():
    """Why vLLM's weight loader drops the experts' packs (vllm_adapter.patches, moe.load): a pack is a copy,
    so after the weight is written a kept pack computes the old weight's product."""
    g = gen(6)
    w = (torch.randn(64, 256, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    pack = ops.pack_weight(w)
    before = ops.linear(x, w)
    w.data.add_(0.01)  # as a weight loader writes: into .data, no version bump a cache could see
    assert not torch.equal(ops.linear(x, w, pack=pack), ops.linear(x, w))
    assert torch.equal(ops.linear(x, w, pack=pack), before)
    assert torch.equal(ops.linear(x, w, pack=ops.pack_weight(w)), ops.linear(x, w))


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the experts run as one native call on the dot path only")
def test_packed_experts_in_one_native_call_are_the_torch_codes_bits():
    """vLLM's experts (bf16, unsharded, packed) run as one native call: gather, gate and up with the
    activation, down and the scatter to the slots. The same bits as the torch code's per-expert linears:
    decode and prefill heights, an expert no token chose, leaves on both products, and an expert whose
    denormal weights the guard must take off the dot product."""
    g = gen(7)
    E, H, inter, top_k = 6, 96, 64, 3
    gate_up = [(torch.randn(2 * inter, H, generator=g) * 0.05).to(torch.bfloat16) for _ in range(E)]
    down = [(torch.randn(H, inter, generator=g) * 0.05).to(torch.bfloat16) for _ in range(E)]
    gate_up[2][5] = (torch.randn(H, generator=g) * 2.0**-130).to(torch.bfloat16)  # a row the dot product flushes
    packs = ([ops.pack_weight(w) for w in gate_up], [ops.pack_weight(w) for w in down])
    assert ops._route("moe_experts", torch.device("cpu"), torch.zeros(1, H, dtype=torch.bfloat16), gate_up, down, 1, None, packs).path == "dot"
    for tokens in (1, 4, 70):
        hidden = (torch.randn(tokens, H, generator=g) * 2.0**20).to(torch.bfloat16)
        chosen = torch.stack([torch.randperm(E - 1, generator=g)[:top_k] for _ in range(tokens)])  # expert 5: none
        chosen[0] = torch.tensor([2, 0, 1])
        lib, x = native.lib(), hidden[:1]  # the premise: unguarded, the dot product flushes that row's products
        assert not torch.equal(lib.dot_matmul(x, gate_up[2], ops.K_CHUNK, 8, False),
                               lib.dot_matmul(x, gate_up[2], ops.K_CHUNK, 8, True))
        fast = moe.moe_experts(hidden, chosen, gate_up, down, packs=packs)
        with ops.switched(native=False):
            reference = moe.moe_experts(hidden, chosen, gate_up, down)
        assert fast.dtype == torch.bfloat16 and torch.equal(fast, reference), tokens
    with pytest.raises(RuntimeError, match="expert id 6 of 6 experts"):
        moe.moe_experts(hidden, torch.full_like(chosen, 6), gate_up, down, packs=packs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_on_the_chain_path_in_one_native_call_are_the_torch_codes_bits(dtype):
    """Experts on the chain path (unsharded) run as one native call, each linear's fma chains computed for an
    expert of few rows against its weight's panels (laid out in the call, or the experts' chain packs), for
    one of more with its rows as vector lanes: the torch code's bits at decode and prefill heights (experts of
    1-4, 5-8, 9-64 and more than 64 rows), a hidden and an intermediate size that are not multiples of 16 (nor the
    gate's rows of a 64-row group), leaves on both products, and an expert no token chose. bf16 (weights
    widened; gate, up, the activation and the output rounded as the torch code's linears and silu_mul round
    them) is dispatched there where the dot path is not built or checked; the kernel runs directly on every CPU."""
    g = gen(8)
    E, H, inter, top_k = 6, 100, 56, 3
    gate_up = [(torch.randn(2 * inter, H, generator=g) * 0.1).to(dtype) for _ in range(E)]
    down = [(torch.randn(H, inter, generator=g) * 0.1).to(dtype) for _ in range(E)]
    leaves = (ops.local_leaves(H, 1), ops.local_leaves(inter, 1))
    assert min(leaves) > 1
    lib = native.lib()
    chain_packs = [[lib.pack_chain_weight(w, 2) for w in gate_up], [lib.pack_chain_weight(w, 1) for w in down]]
    dispatched = dtype == torch.float32 or native.bf16_dot_lib() is None
    assert (ops._route("moe_experts", torch.device("cpu"), torch.zeros(1, H, dtype=dtype), gate_up, down, 1, None, None).path == "chain") == dispatched
    heights = set()  # the experts' row counts
    for tokens in (1, 4, 12, 20, 150):
        hidden = torch.randn(tokens, H, generator=g).to(dtype)
        chosen = torch.stack([torch.randperm(E - 1, generator=g)[:top_k] for _ in range(tokens)])  # expert 5: none
        heights |= set(torch.bincount(chosen.flatten(), minlength=E).tolist())
        with ops.switched(native=False):
            reference = moe.moe_experts(hidden, chosen, gate_up, down)
        for packs in ([[], []], chain_packs):
            fast = lib.moe_experts_chain(hidden, chosen, gate_up, down, *packs, ops.K_CHUNK, *leaves)
            assert fast.dtype == dtype and torch.equal(fast.view(reference.shape), reference), tokens
        if dispatched:
            assert torch.equal(moe.moe_experts(hidden, chosen, gate_up, down), reference), tokens
            packs = ops.pack_experts(gate_up, down)
            assert torch.equal(moe.moe_experts(hidden, chosen, gate_up, down, packs=packs), reference), tokens
    assert 0 in heights and all(any(lo <= h <= hi for h in heights) for lo, hi in ((1, 4), (5, 8), (9, 64), (65, 450)))
    with pytest.raises(RuntimeError, match="expert id 6 of 6 experts"):
        lib.moe_experts_chain(hidden, torch.full_like(chosen, 6), gate_up, down, [], [], ops.K_CHUNK, *leaves)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    with pytest.raises(RuntimeError, match="expert 1's weights are not contiguous"):  # one dtype for all
        lib.moe_experts_chain(hidden, chosen, [gate_up[0], gate_up[1].to(other), *gate_up[2:]], down, [], [],
                              ops.K_CHUNK, *leaves)
    one_part = [lib.pack_chain_weight(w, 1) for w in gate_up]  # gate and up not each from a group's start
    with pytest.raises(RuntimeError, match=r"expert 0's packs \[1, 2, 4, 100, 16\] and .* are not pack_chain_weight's"):
        lib.moe_experts_chain(hidden, chosen, gate_up, down, one_part, chain_packs[1], ops.K_CHUNK, *leaves)


def test_twin_a_chain_pack_is_a_copy_that_a_weight_load_leaves_stale():
    """Why vLLM's weight loaders drop the linears' and the experts' packs on the chain path too
    (vllm_adapter.patches: linear.weights, embedding.weights, moe.load): a chain pack is a copy, so after the
    weights are written a kept pack computes the old linear and the old experts at decode height, and a pack
    built again computes the new ones."""
    g = gen(9)
    w, x = torch.randn(64, 256, generator=g) * 0.05, torch.randn(1, 256, generator=g)
    pack = ops.pack_weight(w)
    assert pack is not None and pack.path == "chain"
    before = ops.linear(x, w)
    w.data.add_(0.01)  # as a weight loader writes: into .data, no version bump a cache could see
    assert not torch.equal(ops.linear(x, w), before)
    assert torch.equal(ops.linear(x, w, pack=pack), before)
    assert torch.equal(ops.linear(x, w, pack=ops.pack_weight(w)), ops.linear(x, w))
    E, H, inter = 4, 64, 32
    gate_up = [torch.randn(2 * inter, H, generator=g) * 0.1 for _ in range(E)]
    down = [torch.randn(H, inter, generator=g) * 0.1 for _ in range(E)]
    hidden, chosen = torch.randn(1, H, generator=g), torch.tensor([[2, 0]])
    packs = ops.pack_experts(gate_up, down)
    assert packs is not None and len(packs[0][0].tensors) == 1
    before = moe.moe_experts(hidden, chosen, gate_up, down)
    for w in gate_up + down:
        w.add_(0.01)  # as a weight loader writes: in place
    after = moe.moe_experts(hidden, chosen, gate_up, down)
    assert not torch.equal(after, before)
    assert torch.equal(moe.moe_experts(hidden, chosen, gate_up, down, packs=packs), before)
    assert torch.equal(moe.moe_experts(hidden, chosen, gate_up, down, packs=ops.pack_experts(gate_up, down)), after)


def _attention_case(g, S, Hq, Hkv, Tq, Tk, D, dtype, garbage=False):
    q = torch.randn(S, Hq, Tq, D, generator=g).to(dtype)
    k = torch.randn(S, Hkv, Tk, D, generator=g).to(dtype)
    v = torch.randn(S, Hkv, Tk, D, generator=g).to(dtype)
    lens = torch.randint(1, Tk + 1, (S,), generator=g)
    if Tq == Tk:  # prefill / training rows: positions 0.., padding rows -1
        q_pos = torch.arange(Tq)[None].repeat(S, 1)
        q_pos = torch.where(q_pos < lens[:, None], q_pos, -1)
    else:  # the last Tq positions of each sequence (decode: Tq = 1)
        q_pos = (lens[:, None] - Tq + torch.arange(Tq)[None]).clamp(min=-1)
    kv_valid = torch.arange(Tk)[None] < lens[:, None]
    if garbage:  # unwritten cache slots: must never reach a row
        k = torch.where(kv_valid[:, None, :, None], k, math.nan)
        v = torch.where(kv_valid[:, None, :, None], v, math.inf)
    return q, k, v, q_pos, kv_valid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_the_torch_codes_bits(dtype):
    g = gen(3)
    shapes = [
        (1, 4, 2, 1, 64, 16),  # decode, one block
        (3, 4, 2, 1, 300, 16),  # decode, ragged caches, a partial last block
        (4, 32, 4, 1, 70, 128),  # decode, 8 query heads per KV head (Qwen3-30B's grouping)
        (2, 8, 2, 37, 37, 16),  # prefill, one tile of rows
        (2, 4, 4, 130, 130, 32),  # prefill, many tiles: (tile, block) pairs skipped
        (1, 4, 2, 5, 140, 200),  # a head dim above K_CHUNK: chunked scores
    ]
    for n_threads in (1, 2):
        with threads(n_threads):
            for shape in shapes:
                for garbage in (False, True):
                    q, k, v, q_pos, kv_valid = _attention_case(g, *shape, dtype, garbage)
                    fast, reference = both_paths(lambda: ops.attention(q, k, v, q_pos, kv_valid, 0.25))
                    assert torch.isfinite(fast).all(), (shape, garbage)
                    assert torch.equal(fast, reference), (shape, garbage, n_threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_gradients_are_the_torch_codes_bits(dtype):
    """Training: the fused forward (with the backward's probabilities) and the fused backward."""
    g = gen(7)
    # (the last two: 2 live rows, fewer than the fused backward takes; a head dim above K_CHUNK, which
    # the torch backward reduces unsplit: the native forward, then the torch backward)
    shapes = [(2, 4, 2, 130, 130, 16), (3, 8, 2, 70, 70, 32), (1, 4, 2, 20, 20, 16), (2, 4, 2, 1, 1, 16)]
    for shape in shapes + [(1, 4, 2, 40, 40, 200)]:
        q, k, v, q_pos, kv_valid = _attention_case(g, *shape, dtype)
        grad_out = torch.randn(q.shape, generator=g).to(dtype)
        results = []
        for path in (contextlib.nullcontext, functools.partial(ops.switched, native=False)):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with path():
                out = ops.attention(*leaves, q_pos, kv_valid, 0.25)
                out.backward(grad_out)
            results.append([out.detach()] + [t.grad for t in leaves])
        for name, fast, reference in zip(("out", "grad_q", "grad_k", "grad_v"), *results):
            assert torch.equal(fast, reference), (shape, name)


def test_attention_with_strided_caches_and_a_small_call_after_a_large_one():
    """Keys/values read through their strides; the reused scratch buffers never leak a previous call."""
    g = gen(4)
    grid = torch.randn(3, 256, 2, 2, 2, 16, generator=g)  # [S, span, layers, k/v, Hkv, D], like the rollout's
    k, v = grid[:, :, 1, 0].transpose(1, 2), grid[:, :, 1, 1].transpose(1, 2)
    q = torch.randn(3, 4, 1, 16, generator=g)
    q_pos = torch.tensor([[255], [100], [7]])
    kv_valid = torch.arange(256)[None] <= q_pos
    big = _attention_case(g, 8, 4, 2, 1, 1000, 16, torch.float32)
    for args in (big, (q, k, v, q_pos, kv_valid), big, (q, k, v, q_pos, kv_valid)):
        assert torch.equal(*both_paths(lambda: ops.attention(*args[:5], 0.25)))


def test_the_torch_code_alone_reproduces_the_goldens():
    """The reference the native path is held to is still the original kernels' bits (those of this CPU's key)."""
    goldens = kernel_goldens.load_or_skip()
    with ops.switched(native=False), threads(2):
        actual = kernel_goldens.compute(("ops", "model/dense/fp32", "model/moe/bf16"))
    for name, value in actual.items():
        assert torch.equal(value, goldens[name]), name


def test_the_fused_attentions_fma_chain_is_mkls_gemm_for_n_from_12():
    """The route rule on any CPU: the fma-chain routes are taken exactly where the load-time check found MKL's
    gemm computing the chain; and the premise of the fused attention, where it holds: torch.bmm's entries
    (K <= K_CHUNK) are fma chains over k."""
    lib = native.lib()
    chain = native.gemm_is_fma_chain(lib)
    assert (native.fma_chain_lib(17) is lib) == chain and (native.fma_chain_lib(native.FMA_CHAIN_MIN_N) is lib) == chain
    g = gen(5)
    misses = []
    for rows, k, n in [(4, 16, 64), (8, 8, 12), (32, 64, 17), (8, 128, 65), (16, 100, 33)]:
        a, b = torch.randn(2, rows, k, generator=g), torch.randn(2, k, n, generator=g)
        reference = torch.bmm(a, b)
        misses += [(rows, k, n)] * sum(not torch.equal(lib.chain_matmul(a[i], b[i]), reference[i]) for i in range(2))
    if not chain or misses:
        check = "passed" if chain else "failed"
        premise_skip("mkl_sgemm_chain", f"the load-time check {check}; shapes that differ: {misses}")


def test_the_chain_routes_refuse_narrow_products_and_the_chain_is_fused():
    """The rules, on any CPU: no fma-chain route below FMA_CHAIN_MIN_N columns (the linear pads to it), and the
    library's chain rounds once per step (a plain multiply-then-add chain differs)."""
    lib = native.lib()
    assert native.fma_chain_lib(native.FMA_CHAIN_MIN_N - 1) is None
    g = gen(6)
    a, b = torch.randn(8, 64, generator=g), torch.randn(64, 64, generator=g)
    unfused = torch.zeros(8, 64)
    for k in range(64):  # products rounded before each add
        unfused = unfused + a[:, k : k + 1] * b[k]
    assert not torch.equal(unfused, lib.chain_matmul(a, b))


def _first_differing(shapes, seed: int, differs):
    """The first (rows, k, n) of ``shapes`` whose fp32 operands (drawn from ``gen(seed)`` in turn) ``differs``."""
    g = gen(seed)
    for rows, k, n in shapes:
        if differs(torch.randn(rows, k, generator=g), torch.randn(k, n, generator=g)):
            return rows, k, n
    return None


def _is_not_the_chain(a, b) -> bool:
    return not torch.equal(native.lib().chain_matmul(a, b), torch.bmm(a[None], b[None])[0])


def test_twin_below_12_columns_mkl_is_not_the_fma_chain():
    """Why FMA_CHAIN_MIN_N: for narrow products MKL runs another kernel, so a head dim of 8 (PV width
    9) keeps the torch code. Which narrow shapes it runs it for depends on the CPU: searched, the shapes first
    found on AMD first."""
    narrow = [(8, 64, 9), (16, 100, 11), (8, 128, 10), (32, 64, 9)]
    narrow += [(rows, k, n) for n in range(1, native.FMA_CHAIN_MIN_N) for rows in (4, 8, 16, 32, 64)
               for k in (8, 16, 64, 100, 128) if rows * k * n >= ops.BLAS_MIN_WORK]
    if _first_differing(narrow, 6, _is_not_the_chain) is None:
        premise_skip("mkl_narrow_kernel", f"all {len(narrow)} narrow shapes tried were fma chains")


def test_twin_above_k_chunk_mkl_is_not_one_fma_chain():
    """Why the fused backward takes reduced dims <= K_CHUNK only (the torch backward does not split
    them): over a longer K one chain differs from MKL's GEMM. Which split MKL makes depends on the CPU: searched."""
    wide = [(32, 200, 64), (16, 384, 48), (8, 1000, 32)]
    wide += [(rows, k, n) for k in (136, 256, 512, 2048) for rows in (4, 16, 64) for n in (12, 33, 64, 128)]
    if _first_differing(wide, 8, _is_not_the_chain) is None:
        premise_skip("mkl_long_k", f"all {len(wide)} shapes tried with K > K_CHUNK were one fma chain")


# ----------------------------------------------------------------------------------------------
# the shorter tiles of a call with few rows
# ----------------------------------------------------------------------------------------------


def _row_bits_equal(r: int, k: int, n: int, seed: int) -> bool:
    """Do rows multiplied in a tile of ``r`` rows get the bits they get in a full 64-row tile?"""
    g = gen(seed)
    a, b = torch.randn(3, 64, k, generator=g), torch.randn(3, k, n, generator=g)
    return torch.equal(torch.bmm(a[:, :r].contiguous(), b), torch.bmm(a, b)[:, :r])


def test_short_tiles_on_the_blas_path_keep_a_rows_bits():
    for n_threads in (1, 2):
        with threads(n_threads):
            for r in ops.SHORT_TILE_ROWS:
                for k, n in [(16, 64), (64, 17), (64, 65), (128, 192), (72, 24), (100, 4), (5, 129)]:
                    assert r * k * n >= ops.BLAS_MIN_WORK
                    assert _row_bits_equal(r, k, n, seed=r * 1000 + k + n), (r, k, n, n_threads)


def test_tile_rows_takes_the_shortest_blas_tile():
    """The rule: the shortest of SHORT_TILE_ROWS (from 4 rows) on torch's BLAS path for every chunk, on CPU only."""
    assert ops.SHORT_TILE_ROWS[0] == 4
    assert ops.tile_rows(1, 16, 3, ops.TILE_ROWS, torch.device("cpu")) == 16  # 4 and 8 rows: the naive loop
    assert ops.tile_rows(1, 64, 64, ops.TILE_ROWS, torch.device("cpu")) == 4
    assert ops.tile_rows(5, 200, 24, ops.TILE_ROWS, torch.device("cpu")) == 8
    assert ops.tile_rows(40, 64, 64, ops.TILE_ROWS, torch.device("cpu")) == ops.TILE_ROWS
    assert ops.tile_rows(1, 64, 64, ops.TILE_ROWS, torch.device("meta")) == ops.TILE_ROWS


@pytest.mark.parametrize("r", [1, 2])
def test_twin_tiles_of_one_or_two_rows_change_bits(r):
    """Why SHORT_TILE_ROWS starts at 4: MKL gives a row in a tile of 1 or 2 rows other bits than in a 64-row
    tile, for some shapes of the CPU it runs on (searched: the shapes first found on AMD first)."""
    tried = [(k, n, seed) for n in (64, 24, 17) for k in (16, 64, 128) for seed in (k, k + 1000)]
    if all(_row_bits_equal(r, k, n, seed) for k, n, seed in tried):
        premise_skip("mkl_short_tiles", f"r={r}: every row kept its bits in {len(tried)} (k, n, seed) tried")


def test_twin_below_the_blas_threshold_a_rows_bits_change():
    """Why tile_rows checks BLAS_MIN_WORK: below it torch's bmm runs its own loop at 4 rows and MKL at 64."""
    tried = [(k, n, seed) for k, n in ((5, 17), (4, 24), (8, 12), (3, 33)) for seed in range(8)]
    assert all(4 * k * n < ops.BLAS_MIN_WORK for k, n, _ in tried)
    if all(_row_bits_equal(4, k, n, seed) for k, n, seed in tried):
        premise_skip("blas_threshold", f"every row kept its bits in {len(tried)} (k, n, seed) tried")
