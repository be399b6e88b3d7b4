"""thd_cp2hp / thd_hp2cp and the collective shims on real gloo process groups.

Every rank builds the same global tensors from a seed, runs the conversion on
its own shard and compares with the single-process reference computed from
the global tensor. Spawning ranks costs seconds, so hypothesis draws a whole
list of cases in the parent and one spawn of 4 ranks covers CP sizes 1-4 through
subgroups of ranks ``[0, W)`` (which also exercises groups other than WORLD).
Layout ops move bits, so every comparison is exact.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_ops import COMPILE_OPTIONS, pad_cu_seqlens, shard_thd, thd_cp2hp_blocks, thd_cp2hp_overlap, thd_hp2cp_blocks
from cp_ops import scheduling
from custom_ops import (
    all_gather_rows,
    group_size,
    kernels_visible_to_compiler,
    rank_blocks_to_sections,
    reduce_scatter_rows,
    resolve_group,
    sections_to_rank_blocks,
    thd_cp2hp,
    thd_cp2hp_reference,
    thd_hp2cp,
    thd_hp2cp_reference,
    validate_thd,
)
from custom_ops.testing import check_fake, random_tensor
from custom_ops.thd.index import rank_to_seq_index
from tests._dist import exchange_windows, run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)


@st.composite
def _case(draw):
    """(seqlens, section multiples, middle shape, dtype, seed); sections are ``multiple * W``."""
    seqlens = draw(st.lists(st.one_of(st.just(0), st.just(1), st.integers(0, 30)), min_size=1, max_size=5))
    multiples = draw(st.lists(st.integers(0, 3), min_size=1, max_size=5))
    multiples[0] = max(multiples[0], 1)  # at least one feature; zero-width sections elsewhere
    mid = draw(st.sampled_from([(), (2,)]))
    return seqlens, multiples, mid, draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**31 - 1))


def _global_data(case, world):
    seqlens, multiples, mid, dtype, seed = case
    sections = [m * world for m in multiples]
    _, cup = pad_cu_seqlens(seqlens, world)
    rows, features = int(cup[-1]), sum(sections)
    gen = torch.Generator().manual_seed(seed)
    x = random_tensor((rows,) + mid + (features,), dtype, generator=gen)
    y_all = [random_tensor((rows,) + mid + (features // world,), dtype, generator=gen) for _ in range(world)]
    return sections, cup, x, y_all, gen


def _check_cases(rank, world, cases, group):
    for case in cases:
        sections, cup, x, y_all, gen = _global_data(case, world)
        local = [s // world for s in sections]
        x_cp = shard_thd(x, cup, world, rank)

        x_hp = thd_cp2hp(x_cp, cup, sections, group)
        assert torch.equal(x_hp, thd_cp2hp_reference(x, sections, world, rank)), case
        assert torch.equal(thd_hp2cp(x_hp, cup, local, group), x_cp), case
        # the ops' fakes give what they return (dtype, shape, strides), at every dtype drawn
        name, _ = resolve_group(group)
        check_fake(torch.ops.cp_ops.thd_cp2hp.default, (x_cp, cup, sections, name, world))
        check_fake(torch.ops.cp_ops.thd_hp2cp.default, (x_hp, cup, local, name, world))
        check_fake(torch.ops.cp_ops.group_rank_tensor.default, (x_cp, name))

        y_cp = thd_hp2cp(y_all[rank], cup, local, group)
        assert torch.equal(y_cp, thd_hp2cp_reference(y_all, cup, local, world, rank)), case
        assert torch.equal(thd_cp2hp(y_cp, cup, sections, group), y_all[rank]), case

        # gradients: backward of one conversion is the other applied to the gradient
        grads_hp = [random_tensor(y.shape, torch.float64, generator=gen) for y in y_all]
        grad_x = random_tensor(x.shape, torch.float64, generator=gen)
        x_in = x_cp.double().requires_grad_()
        thd_cp2hp(x_in, cup, sections, group).backward(grads_hp[rank])
        assert torch.equal(x_in.grad, thd_hp2cp_reference(grads_hp, cup, local, world, rank)), case
        y_in = y_all[rank].double().requires_grad_()
        thd_hp2cp(y_in, cup, local, group).backward(shard_thd(grad_x, cup, world, rank))
        assert torch.equal(y_in.grad, thd_cp2hp_reference(grad_x, sections, world, rank)), case

        # the overlapped form: same values; the gradient sums both paths (exchange and overlap work)
        x_in = x_cp.detach().to(torch.float64, copy=True).requires_grad_()  # a leaf of its own
        x_hp, extra = thd_cp2hp_overlap(x_in, cup, sections, group, lambda: x_in * 3)
        assert torch.equal(x_hp, thd_cp2hp_reference(x, sections, world, rank).double()), case
        assert torch.equal(extra, x_in.detach() * 3), case
        grad_cp = shard_thd(grad_x, cup, world, rank)
        torch.autograd.backward((x_hp, extra), (grads_hp[rank], grad_cp))
        want = thd_hp2cp_reference(grads_hp, cup, local, world, rank) + 3 * grad_cp
        assert torch.equal(x_in.grad, want), case

        # the block forms: cp2hp from a send buffer laid out by the caller, hp2cp to the blocks
        # as received; values and gradients through the section <-> block passes
        x_in = x_cp.detach().to(torch.float64, copy=True).requires_grad_()
        x_hp, none = thd_cp2hp_blocks(sections_to_rank_blocks(x_in, sections, world), cup, group)
        assert none is None and torch.equal(x_hp, thd_cp2hp_reference(x, sections, world, rank).double()), case
        x_hp.backward(grads_hp[rank])
        assert torch.equal(x_in.grad, thd_hp2cp_reference(grads_hp, cup, local, world, rank)), case
        # left in rank order: sequence row g is received row rank_to_seq_index(...)[g]
        send = sections_to_rank_blocks(x_cp.double(), sections, world)
        x_rank, _ = thd_cp2hp_blocks(send, cup, group, seq_order=False)
        assert torch.equal(x_rank[rank_to_seq_index(cup, world, x_rank.shape[0])], x_hp), case
        y_in = y_all[rank].detach().to(torch.float64, copy=True).requires_grad_()  # a leaf of its own
        # overlap gets this rank's own block (taken from the send buffer, before the exchange)
        blocks, extra = thd_hp2cp_blocks(y_in, cup, group, lambda own: own * 3)
        assert blocks.shape == (world, x_cp.shape[0]) + y_in.shape[1:], case
        assert torch.equal(extra, blocks[rank].detach() * 3), case
        y_cp = rank_blocks_to_sections(blocks, sections, world)
        assert torch.equal(y_cp, thd_hp2cp_reference(y_all, cup, local, world, rank).double()), case
        grad_own = random_tensor(extra.shape, torch.float64, generator=gen)
        torch.autograd.backward((y_cp, extra), (shard_thd(grad_x, cup, world, rank), grad_own))
        y_leaf = y_in.detach().requires_grad_()  # the own block's gradient lands on this rank's rows
        (shard_thd(y_leaf, cup, world, rank) * 3).backward(grad_own)
        want = thd_cp2hp_reference(grad_x, sections, world, rank) + y_leaf.grad
        assert torch.equal(y_in.grad, want), case


CP_SIZES = (1, 2, 3, 4)


def _check_cases_all_sizes(rank, num_ranks, cases):
    for world in CP_SIZES:
        group = dist.new_group(list(range(world)))  # every rank takes part in creating it
        if rank < world:
            _check_cases(rank, world, cases, group)


def _drawn_cases(limit: int | None = None) -> list:
    """The examples hypothesis generates for :func:`_case` under the active profile (its first
    example is the simplest one, so a single drawn list would be trivial): collected in the
    parent, then checked in one spawn. A failure names its case in the assertion message."""
    cases = []
    n = settings.default.max_examples if limit is None else min(limit, settings.default.max_examples)

    @settings(max_examples=n, database=None)
    @given(_case())
    def collect(case):
        cases.append(case)

    collect()
    return cases


@pytest.mark.dist
def test_matches_reference_round_trips_and_gradients():
    cases = _drawn_cases()
    assert len(cases) > 5 and any(len(c[0]) > 2 and len(c[1]) > 2 for c in cases)  # not just trivial layouts
    run_ranks(max(CP_SIZES), _check_cases_all_sizes, cases)


# --- compiled, one all-to-all, group forms, baseline, shims, bad input (one spawn) ------------------


def _all_to_all_counting_backend(counts):
    """An AOT backend that records how many all-to-alls each graph (forward, backward) holds."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(gm, example_inputs):
        a2a = torch.ops._c10d_functional.all_to_all_single.default
        counts.append(sum(node.target is a2a for node in gm.graph.nodes))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


@contextlib.contextmanager
def _counting_all_to_alls(calls):
    """Record every all-to-all issued at run time (inside the bodies of opaque ops too), from the
    profiler's record of the ops dispatched."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    calls.extend(e.name for e in prof.events() if e.name == "_c10d_functional::all_to_all_single")


def _compiled_case(rank, world):
    """``(group, sections, local sections, cup, x_cp, x_hp_ref, grad_hp, generator)`` of the
    two-rank compile tests."""
    case = ([37, 0, 8, 1, 64], [1, 2, 0, 4, 1], (), torch.float32, 1234)
    sections, cup, x, y_all, gen = _global_data(case, world)
    x_hp_ref = thd_cp2hp_reference(x, sections, world, rank)
    grad_hp = random_tensor(x_hp_ref.shape, torch.float32, generator=gen)
    x_cp = shard_thd(x, cup, world, rank)
    return dist.group.WORLD, sections, [s // world for s in sections], cup, x_cp, x_hp_ref, grad_hp, gen


def _check_compiled_and_extras(rank, world):
    from benchmarks.bench_cp2hp import cp2hp_per_sequence
    from torch.distributed.device_mesh import init_device_mesh

    group, sections, local, cup, x_cp, x_hp_ref, grad_hp, gen = _compiled_case(rank, world)

    # exactly one all-to-all per conversion, forward and backward, after AOT decomposition
    for fn, arg, out_ref in (
        (lambda a: thd_cp2hp(a, cup, sections, group), x_cp, x_hp_ref),
        (lambda a: thd_hp2cp(a, cup, local, group), x_hp_ref, x_cp),
    ):
        counts, calls = [], []
        compiled = torch.compile(fn, backend=_all_to_all_counting_backend(counts), fullgraph=True)
        inp = arg.clone().requires_grad_()
        with _counting_all_to_alls(calls):
            out = compiled(inp)
            assert torch.equal(out, out_ref)
            out.backward(random_tensor(out.shape, torch.float32, generator=gen))
        if kernels_visible_to_compiler():
            assert counts == [1, 1], counts  # in the graphs Inductor compiles
        else:  # opaque ops: the collective runs inside them
            assert counts == [0, 0] and len(calls) == 2, (counts, calls)

    _check_inductor(group, sections, local, cup, x_cp, x_hp_ref, grad_hp)

    # a 1-D DeviceMesh is the same group; a 2-D one is refused
    mesh = init_device_mesh("cpu", (world,))
    assert resolve_group(mesh) == resolve_group(group)
    assert torch.equal(thd_cp2hp(x_cp, cup, sections, mesh), x_hp_ref)
    if world % 2 == 0:
        mesh2d = init_device_mesh("cpu", (2, world // 2))
        with pytest.raises(ValueError, match="must be 1-D"):
            thd_cp2hp(x_cp, cup, sections, mesh2d)

    # the benchmark's per-sequence, per-section baseline computes the same thing
    assert torch.equal(cp2hp_per_sequence(x_cp, cup, sections, group), x_hp_ref)

    # opcheck at the half-precision dtypes (the test files of the layout ops run it at float32
    # and float64 on one process); every rank makes the same calls, so the collectives pair up
    name, _ = resolve_group(group)
    for dtype in (torch.bfloat16, torch.float16):
        a = x_cp.to(dtype).requires_grad_()
        torch.library.opcheck(torch.ops.cp_ops.thd_cp2hp.default, (a, cup, sections, name, world))
        torch.library.opcheck(torch.ops.cp_ops.thd_hp2cp.default, (x_hp_ref.to(dtype), cup, local, name, world))
    torch.library.opcheck(torch.ops.cp_ops.group_rank_tensor.default, (x_cp, name))

    # all-gather / reduce-scatter shims: values and gradients (each other's adjoint)
    assert group_size(name) == world
    with pytest.raises(TypeError, match="group name"):
        group_size(group)
    shards = [random_tensor((3, 5), torch.float64, generator=gen) for _ in range(world)]
    grads = [random_tensor((3 * world, 5), torch.float64, generator=gen) for _ in range(world)]
    mine = shards[rank].clone().requires_grad_()
    gathered = all_gather_rows(mine, name)
    assert torch.equal(gathered, torch.cat(shards))
    gathered.backward(grads[rank])
    assert torch.allclose(mine.grad, sum(grads).chunk(world)[rank], rtol=1e-12, atol=0)
    full = grads[rank].clone().requires_grad_()
    scattered = reduce_scatter_rows(full, name)
    assert torch.allclose(scattered, sum(grads).chunk(world)[rank], rtol=1e-12, atol=0)
    scattered.backward(shards[rank])
    assert torch.equal(full.grad, torch.cat(shards))

    # bad input: raised on every rank before any collective, so nothing hangs
    with pytest.raises(ValueError, match=f"not divisible by the CP group size = {world}"):
        thd_cp2hp(x_cp[..., : sum(sections) - 1], cup, sections[:-1] + [sections[-1] - 1], group)
    with pytest.raises(ValueError, match="sum to"):
        thd_cp2hp(x_cp, cup, sections + [world], group)
    with pytest.raises(ValueError, match="sum to"):
        thd_hp2cp(x_hp_ref, cup, local + [1], group)
    with pytest.raises(ValueError, match=f"not a multiple of 2\\*W = {2 * world}"):
        thd_hp2cp(x_hp_ref[: 2 * world - 2], cup, local, group)  # e.g. a layout built for another W
    with pytest.raises(ValueError, match="even number"):
        thd_cp2hp(x_cp[:-1], cup, sections, group)
    # the overlapped form checks the same things, before the overlap work and any collective
    ran = []
    with pytest.raises(ValueError, match="sum to"):
        thd_cp2hp_overlap(x_cp, cup, sections + [world], group, lambda: ran.append(1))
    with pytest.raises(ValueError, match="even number"):
        thd_cp2hp_overlap(x_cp[:-1], cup, sections, group, lambda: ran.append(1))
    assert not ran
    send = sections_to_rank_blocks(x_cp, sections, world)
    with pytest.raises(ValueError, match=f"with W = {world} \\(the CP group size\\) blocks"):
        thd_cp2hp_blocks(x_cp, cup, group)  # the section layout, not the send buffer
    with pytest.raises(ValueError, match="even number"):
        thd_cp2hp_blocks(send[:, :-1], cup, group, lambda: ran.append(1))
    with pytest.raises(ValueError, match=f"not a multiple of 2\\*W = {2 * world}"):
        thd_hp2cp_blocks(x_hp_ref[: 2 * world - 2], cup, group, lambda own: ran.append(1))
    with pytest.raises(TypeError, match="send must be a torch.Tensor"):
        thd_cp2hp_blocks(x_cp.tolist(), cup, group)
    assert not ran
    with pytest.raises(TypeError, match="must be int32 or int64"):
        thd_cp2hp(x_cp, cup.float(), sections, group)
    with pytest.raises(TypeError, match="ProcessGroup, a 1-D DeviceMesh or None"):
        thd_cp2hp(x_cp, cup, sections, "world")
    # the ops take W explicitly (it keys compiled graphs); it must be the group's size
    with pytest.raises(ValueError, match=f"cp_size = {world + 1} but the process group"):
        torch.ops.cp_ops.thd_cp2hp(x_cp, cup, sections, name, world + 1)
    with pytest.raises(ValueError, match=f"cp_size = {world + 1} but the process group"):
        torch.ops.cp_ops.thd_hp2cp(x_hp_ref, cup, local, name, world + 1)
    # total rows that do not match the layout need its values: validate_thd is where that is caught
    with pytest.raises(ValueError):
        validate_thd(cup, cup, world, (x_cp.shape[0] + 2) * world)


def _check_overlap_compiled(group, cup, sections, x_cp, x_hp_ref, gen):
    """thd_cp2hp_overlap compiled: the exchange is a graph node (one per direction, whether the
    layout ops are opaque or not), values and gradients match eager, and with COMPILE_OPTIONS
    the overlap work (a GEMM) sits between the exchange and its wait in the code Inductor
    generates, forward and backward."""
    from torch._inductor.utils import run_and_get_code

    weight = random_tensor((x_cp.shape[-1], 8), torch.float32, generator=gen)
    grad_hp = random_tensor(x_hp_ref.shape, torch.float32, generator=gen)
    grad_z = random_tensor((x_cp.shape[0], 8), torch.float32, generator=gen)

    def step(a, w):
        return thd_cp2hp_overlap(a, cup, sections, group, lambda: a @ w)

    def run(fn):
        a, w = x_cp.clone().requires_grad_(), weight.clone().requires_grad_()
        hp, z = fn(a, w)
        torch.autograd.backward((hp, z), (grad_hp, grad_z))
        return hp.detach(), z.detach(), a.grad, w.grad

    counts = []
    run(torch.compile(step, backend=_all_to_all_counting_backend(counts), fullgraph=True))
    assert counts == [1, 1], counts
    eager = run(step)
    assert torch.equal(eager[0], x_hp_ref)
    compiled = torch.compile(step, fullgraph=True, options=COMPILE_OPTIONS)
    got, codes = run_and_get_code(lambda: run(compiled))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)
    assert len(codes) == 2, len(codes)  # forward and backward
    for code in codes:
        (window,) = exchange_windows(code)
        assert "mm(" in window, f"no GEMM between the exchange and its wait:\n{window}"


def _check_overlap(rank, world):
    group, sections, local, cup, x_cp, x_hp_ref, grad_hp, gen = _compiled_case(rank, world)
    _check_overlap_compiled(group, cup, sections, x_cp, x_hp_ref, gen)


def _check_inductor(group, sections, local, cup, x_cp, x_hp_ref, grad_hp):
    # Inductor, fullgraph: same values and gradients as eager
    def step(a):
        hp = thd_cp2hp(a * 2, cup, sections, group)
        return thd_hp2cp(hp + 1, cup, local, group), hp

    compiled = torch.compile(step, fullgraph=True)
    inp = x_cp.clone().requires_grad_()
    back, hp = compiled(inp)
    assert torch.equal(hp, x_hp_ref * 2)
    assert torch.equal(back, x_cp * 2 + 1)
    (grad,) = torch.autograd.grad(hp, inp, grad_hp)
    assert torch.equal(grad, 2 * thd_hp2cp(grad_hp, cup, local, group))


@pytest.mark.dist
@pytest.mark.parametrize("world", [2])
def test_compiled_single_all_to_all_groups_baseline_shims_bad_input(world):
    """One all-to-all per conversion in the AOT graphs, forward and backward; Inductor over both
    conversions; DeviceMesh groups, the benchmark's baseline, opcheck at half precision, the
    collective shims and bad input."""
    run_ranks(world, _check_compiled_and_extras)


@pytest.mark.slow
@pytest.mark.dist
def test_overlapped_exchange_compiled_on_two_ranks():
    """The overlapped form compiled (the exchange in flight across a GEMM). The slow tier: the
    scheduling pass that places it is checked on hand-built graphs in the fast one."""
    run_ranks(2, _check_overlap)


# --- no CP (group=None): W = 1 semantics, no process group needed ------------------------------------


def test_no_group_is_the_identity_permutation():
    sections = [4, 0, 6]
    _, cup = pad_cu_seqlens([3, 5], 1)
    x = random_tensor((int(cup[-1]), 2, sum(sections)), torch.float32).requires_grad_()
    y = thd_cp2hp(x, cup, sections, None)
    assert torch.equal(y, x.detach()) and y.data_ptr() != x.data_ptr()
    assert torch.equal(thd_hp2cp(y, cup, sections, None), x.detach())
    grad = random_tensor(y.shape, torch.float32)
    y.backward(grad)
    assert torch.equal(x.grad, grad)
    assert resolve_group(None) == (None, 1)
    with pytest.raises(ValueError, match="sum to"):
        thd_cp2hp(x, cup, [4, 4], None)
    y2, extra = thd_cp2hp_overlap(x, cup, sections, None, lambda: "ran")
    assert torch.equal(y2, x.detach()) and extra == "ran"
    y3, extra = thd_cp2hp_blocks(x[None], cup, None, lambda: "ran")
    assert torch.equal(y3, x.detach()) and extra == "ran"
    blocks, extra = thd_hp2cp_blocks(x, cup, None)
    assert blocks.shape == (1,) + x.shape and torch.equal(blocks[0], x.detach()) and extra is None
    blocks, own = thd_hp2cp_blocks(x, cup, None, lambda own: own)
    assert own is x


# --- the GPU path's Triton kernels inside a real all-to-all (CPU tensors, TRITON_INTERPRET=1) --------


def _check_kernel_path(rank, num_ranks, cases):
    from custom_ops.testing import poisoned_allocations

    # TRITON_INTERPRET=1 is inherited from the parent, so the op bodies launch the kernels
    # (fused send buffer, receive-side reorder) exactly as on the GPU; fresh buffers are
    # poisoned so a row or column the kernels leave unwritten fails the comparison.
    with poisoned_allocations():
        for world in (2, 3):
            group = dist.new_group(list(range(world)))
            if rank < world:
                _check_cases(rank, world, cases, group)


@pytest.mark.dist
@pytest.mark.interpret
def test_kernel_path_matches_reference():
    run_ranks(3, _check_kernel_path, _drawn_cases(limit=3))


# --- the scheduling pass of COMPILE_OPTIONS, on a hand-built node list -------------------------------


class _Dep:
    def __init__(self, name, is_fake=False):
        self.name, self.is_fake = name, is_fake


class _Node:
    """The parts of an Inductor scheduler node the pass reads; ``kind`` is "comm", "wait" or ""."""

    def __init__(self, name, reads, kind="", size=1.0):
        self.name, self.kind, self.size = name, kind, size  # size: FLOPs of work, bytes of an exchange
        self.unmet_dependencies = {_Dep(r) for r in reads}
        self.ancestors = set()

    def get_name(self):
        return self.name

    def get_operation_names(self):
        return {self.name}

    def get_buffer_names(self):
        return {self.name}


def _schedule(nodes):
    by_name = {n.name: n for n in nodes}
    for n in nodes:  # ancestors: everything a node reads, transitively
        todo = [d.name for d in n.unmet_dependencies]
        while todo:
            a = todo.pop()
            if a not in n.ancestors:
                n.ancestors.add(a)
                todo += [d.name for d in by_name[a].unmet_dependencies]
    order = scheduling.issue_early_wait_late(
        nodes,
        node_work=lambda s: s.size,
        exchange_bytes=lambda s: s.size,
        is_collective=lambda s: s.kind == "comm",
        is_wait=lambda s: s.kind == "wait",
    )
    return [n.name for n in order]


def test_scheduling_pass_keeps_work_between_an_exchange_and_its_wait():
    """Forward of the GDN layer in miniature: the z projection recorded between the first
    exchange and its wait stays there, though that wait feeds the second exchange (Inductor's
    raise_comms would move the wait, an ancestor of a collective, ahead of z)."""
    nodes = [
        _Node("send", []),
        _Node("a2a0", ["send"], "comm"),
        _Node("z", []),
        _Node("wait0", ["a2a0"], "wait"),
        _Node("core", ["wait0"]),
        _Node("a2a1", ["core"], "comm"),
        _Node("wait1", ["a2a1"], "wait"),
        _Node("norm", ["wait1", "z"]),
    ]
    assert _schedule(nodes) == ["send", "a2a0", "z", "wait0", "core", "a2a1", "wait1", "norm"]


def test_scheduling_pass_issues_the_exchange_before_independent_work():
    """Backward in miniature: weight-gradient GEMMs that no collective needs come first in the
    original order, but the exchange and the work it needs go first, and the GEMMs run while
    it is in flight; the wait goes last among what is ready."""
    nodes = [
        _Node("dw1", []),
        _Node("dw2", []),
        _Node("grad", []),
        _Node("a2a", ["grad"], "comm"),
        _Node("wait", ["a2a"], "wait"),
        _Node("dx", ["wait", "dw1"]),
    ]
    assert _schedule(nodes) == ["grad", "a2a", "dw1", "dw2", "wait", "dx"]


def test_scheduling_pass_spreads_independent_work_over_the_windows():
    """The GDN layer's backward in miniature: three weight-gradient GEMMs no collective needs,
    a small exchange (1 byte) and one twice its size. The first window gets a third of the
    GEMMs, the second the rest (a greedy scheduler put all three in the first and left the
    second exchange alone). The input gradient, downstream of the last wait, neither counts
    towards a share nor moves into a window."""
    nodes = [
        _Node("dwo", []),
        _Node("grad_o", []),
        _Node("a2a0", ["grad_o"], "comm", 1.0),
        _Node("dwz", []),
        _Node("dxz", []),
        _Node("wait0", ["a2a0"], "wait"),
        _Node("core", ["wait0"]),
        _Node("a2a1", ["core"], "comm", 2.0),
        _Node("wait1", ["a2a1"], "wait"),
        _Node("dx", ["wait1", "dxz"], "", 5.0),
    ]
    want = ["grad_o", "a2a0", "dwo", "wait0", "core", "a2a1", "dwz", "dxz", "wait1", "dx"]
    assert _schedule(nodes) == want


def test_scheduling_pass_weighs_the_work():
    """Shares count work, not nodes: the first window's share is a third of the work (2 of 6,
    the exchanges weighing 1 and 2), so both small GEMMs run there and the large one in the
    second window (a share of a third of the nodes would be one small GEMM)."""
    nodes = [
        _Node("small1", [], "", 1.0),
        _Node("small2", [], "", 1.0),
        _Node("grad", []),
        _Node("a2a0", ["grad"], "comm", 1.0),
        _Node("big", [], "", 4.0),
        _Node("wait0", ["a2a0"], "wait"),
        _Node("a2a1", ["wait0"], "comm", 2.0),
        _Node("wait1", ["a2a1"], "wait"),
    ]
    got = _schedule(nodes)
    assert got == ["grad", "a2a0", "small1", "small2", "wait0", "a2a1", "big", "wait1"], got


def test_scheduling_pass_defers_work_one_window_at_most():
    """Three exchanges in a chain, the last one large (as in a model whose next layer exchanges
    more): four fillers ready before the first run in the first two windows, none in the
    third, which would keep their inputs alive across it. f5, ready after wait0 and before
    the second exchange, may wait for the third window, and does (its share is small)."""
    nodes = [
        _Node("f1", []),
        _Node("f2", []),
        _Node("f3", []),
        _Node("f4", []),
        _Node("grad", []),
        _Node("a2a0", ["grad"], "comm", 1.0),
        _Node("wait0", ["a2a0"], "wait"),
        _Node("f5", ["wait0"]),
        _Node("a2a1", ["wait0"], "comm", 1.0),
        _Node("wait1", ["a2a1"], "wait"),
        _Node("a2a2", ["wait1"], "comm", 100.0),
        _Node("wait2", ["a2a2"], "wait"),
    ]
    got = _schedule(nodes)
    want = ["grad", "a2a0", "f1", "f2", "wait0", "a2a1", "f3", "f4", "wait1", "a2a2", "f5", "wait2"]
    assert got == want, got


def test_scheduling_pass_counts_work_that_becomes_ready_in_the_window():
    """The GDN layer's forward: the own block's norm and out_proj GEMM, a chain that starts
    from the second exchange's send buffer, run while that exchange is in flight (the share
    counts the GEMM, which is not ready when the window opens); the received blocks' part
    comes after the wait."""
    nodes = [
        _Node("send0", []),
        _Node("a2a0", ["send0"], "comm", 2.0),
        _Node("z", []),
        _Node("wait0", ["a2a0"], "wait"),
        _Node("core", ["wait0"]),
        _Node("send1", ["core"]),
        _Node("a2a1", ["send1"], "comm", 1.0),
        _Node("own_norm", ["send1", "z"]),
        _Node("own_mm", ["own_norm"]),
        _Node("wait1", ["a2a1"], "wait"),
        _Node("norm", ["wait1", "z"]),
        _Node("out", ["own_mm", "norm"]),
    ]
    got = _schedule(nodes)
    want = ["send0", "a2a0", "z", "wait0", "core", "send1", "a2a1", "own_norm", "own_mm", "wait1", "norm", "out"]
    assert got == want, got


def _two_group_gathers():
    """Two head groups' all-gathers, the second with Inductor's fake dependency on the first's wait."""
    nodes = [
        _Node("kv0", []),
        _Node("ag0", ["kv0"], "comm"),
        _Node("wait0", ["ag0"], "wait"),
        _Node("attn0", ["wait0"]),
        _Node("kv1", []),
        _Node("ag1", ["kv1"], "comm"),
        _Node("wait1", ["ag1"], "wait"),
        _Node("attn1", ["wait1"]),
        _Node("out", ["attn0", "attn1"]),
    ]
    nodes[5].unmet_dependencies.add(_Dep("wait0", is_fake=True))
    return nodes


def test_scheduling_pass_pipelines_independent_collectives():
    """All-gather CP attention with two head groups: Inductor orders the second gather after
    the first one's wait (a fake dependency); the pass issues both gathers first, in graph
    order, and the first group's attention runs while the second gather is in flight."""
    nodes = _two_group_gathers()
    got = _schedule(nodes)
    assert got == ["kv0", "ag0", "kv1", "ag1", "wait0", "attn0", "wait1", "attn1", "out"], got
    # a real dependency on the wait still holds
    nodes[5].unmet_dependencies.add(_Dep("wait0"))
    got = _schedule(nodes)
    assert got.index("ag1") > got.index("wait0"), got


class _IRNode:
    def __init__(self, op, device):
        self.op_overload, self.device = op, torch.device(device)

    def get_device(self):
        return self.device


def test_scheduling_pass_keeps_cpu_all_gathers_one_at_a_time():
    """The graph of the test above on the CPU: gloo corrupted memory with functional
    all-gathers in flight side by side, so there the second gather keeps Inductor's fake
    dependency on the first one's wait (the first group's attention may still run while
    the second gather is in flight). On CUDA both are issued first."""
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    for device, want in [
        ("cpu", ["kv0", "ag0", "kv1", "wait0", "ag1", "attn0", "wait1", "attn1", "out"]),
        ("cuda", ["kv0", "ag0", "kv1", "ag1", "wait0", "attn0", "wait1", "attn1", "out"]),
    ]:
        nodes = _two_group_gathers()
        for i in (1, 5):
            nodes[i].node = _IRNode(gather, device)
        got = _schedule(nodes)
        assert got == want, (device, got)
    # an all-to-all on the CPU is not held back
    nodes = [_Node("x0", []), _Node("a0", ["x0"], "comm"), _Node("w0", ["a0"], "wait"),
             _Node("x1", []), _Node("a1", ["x1"], "comm"), _Node("w1", ["a1"], "wait")]  # fmt: skip
    nodes[4].unmet_dependencies.add(_Dep("w0", is_fake=True))
    for i in (1, 4):
        nodes[i].node = _IRNode(torch.ops._c10d_functional.all_to_all_single.default, "cpu")
    got = _schedule(nodes)
    assert got.index("a1") < got.index("w0"), got


def test_scheduling_pass_refuses_a_cycle():
    nodes = [_Node("a", ["b"]), _Node("b", ["a"])]
    for n in nodes:
        n.ancestors = {"a", "b"} - {n.name}
    with pytest.raises(RuntimeError, match="scheduled 0 of 2 nodes"):
        scheduling.issue_early_wait_late(nodes, is_collective=lambda s: False, is_wait=lambda s: False)
