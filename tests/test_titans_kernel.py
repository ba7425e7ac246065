"""The Titans inner-loop Triton kernels (memtrain.kernels.titans.triton_kernels) against the PyTorch chunked form.

Run on CPU under ``TRITON_INTERPRET=1`` (conftest sets it when there is no CUDA). Every test draws fresh random
inputs; shapes are small and odd (head size, hidden width and chunk size not powers of two, sequences that end
inside a chunk, shorter than a chunk, exactly one chunk) so the masking of every tile is exercised. The
reference runs in float64, the kernels in float32 (IEEE dot products): outputs, the carried state (weights,
momentum, chunk-start weights) and the gradients of every input (q, k, v, the three gates, the initial weights
and momentum) agree to a relative error below 1e-4. Every buffer the kernels write starts as NaN.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from memtrain.errors import SettingError
from memtrain.kernels import titans as titans_kernels
from memtrain.kernels.titans import reference, triton_kernels
from memtrain.model.titans import NeuralMemory
from memtrain.model.titans.memory import run_scan

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled on a GPU, interpreted on CPU


@pytest.fixture(autouse=True)
def poisoned_buffers(poison_empty):
    poison_empty(triton_kernels)


def _inputs(gen, N, T, D, hidden, depth, dtype=torch.float64):
    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(DEVICE)

    q = F.normalize(randn(N, T, D), dim=-1)
    k = F.normalize(randn(N, T, D), dim=-1)
    v = randn(N, T, D)
    lr = 0.1 * torch.rand(N, T, generator=gen, dtype=dtype).to(DEVICE)
    log_eta = F.logsigmoid(randn(N, T))
    log_keep = F.logsigmoid(randn(N, T) + 3.0)
    sizes = [D] + [hidden] * (depth - 1) + [D]
    w = [randn(N, o, i) / i ** 0.5 for i, o in zip(sizes[:-1], sizes[1:])]
    s = [0.1 * randn(*x.shape) for x in w]
    return [q, k, v, lr, log_eta, log_keep, *w, *s]


def _run(impl, ins, depth, pos, chunk):
    q, k, v, lr, log_eta, log_keep, *state = ins
    w, s = list(state[:depth]), list(state[depth:])
    if impl == "reference":
        y, w, s, wg = reference.scan(q, k, v, lr, log_eta, log_keep, w, s, w, pos, chunk)
    else:
        f32 = [x.float() for x in (q, k, v, lr, log_eta, log_keep)]
        y, w, s, wg = titans_kernels.scan(*f32, [x.float() for x in w], [x.float() for x in s],
                                          [x.float() for x in w], pos, chunk, kernel="triton")
    return [y, *w, *s, *wg]


def _both(gen, N, T, D, hidden, depth, chunk):
    """Fresh inputs (leaves that require gradients) and the reference's and the kernels' outputs on them."""
    ins = _inputs(gen, N, T, D, hidden, depth)
    for x in ins:
        x.requires_grad_(True)
    return ins, _run("reference", ins, depth, 0, chunk), _run("kernel", ins, depth, 0, chunk)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


CASES = [  # (N, T, D, hidden, depth, chunk)
    (3, 11, 5, 9, 2, 4),     # ends inside a chunk, two save groups
    (2, 7, 6, 11, 2, 7),     # exactly one chunk
    (1, 3, 7, 5, 2, 5),      # shorter than a chunk
    (2, 13, 5, 5, 1, 3),     # matrix memory
    (3, 9, 17, 19, 2, 3),    # head size above one 16-wide block
    (1, 40, 4, 6, 2, 2),     # many chunks: several recompute groups in the backward
    (2, 11, 5, 9, 3, 4),     # depth 3 (the any-depth kernels): ends inside a chunk
    (1, 17, 6, 7, 4, 3),     # depth 4, hidden wider than the head
    (1, 30, 9, 4, 3, 2),     # depth 3, hidden narrower than the head, several recompute groups
    (2, 5, 17, 18, 3, 7),    # depth 3, shorter than a chunk, head size above one 16-wide block
]


@pytest.mark.parametrize("N,T,D,hidden,depth,chunk", CASES)
def test_kernel_matches_reference_forward_and_backward(monkeypatch, N, T, D, hidden, depth, chunk):
    """The cases' save groups at the smallest spacing, ``ceil(sqrt(n_chunks))`` chunks (no scratch budget);
    the default spacing in :func:`test_kernel_backward_at_every_checkpoint_spacing`."""
    monkeypatch.setattr(triton_kernels, "SCRATCH_BYTES", 0)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ins, ref, out = _both(gen, N, T, D, hidden, depth, chunk)
    names = ["y"] + [f"w{i}" for i in range(depth)] + [f"s{i}" for i in range(depth)] + [f"wg{i}" for i in range(depth)]
    for name, a, b in zip(names, out, ref):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert torch.isfinite(a).all(), f"{name}: unwritten (NaN) elements"
        assert _rel(a, b) < 1e-4, (name, _rel(a, b))
    cots = [torch.randn(r.shape, generator=gen, dtype=torch.float64).to(DEVICE) for r in ref]
    g_ref = torch.autograd.grad(sum((r * c).sum() for r, c in zip(ref, cots)), ins)
    g_out = torch.autograd.grad(sum((o.double() * c).sum() for o, c in zip(out, cots)), ins)
    grad_names = ["q", "k", "v", "lr", "log_eta", "log_keep"] + names[1:1 + 2 * depth]
    for name, a, b in zip(grad_names, g_out, g_ref):
        assert torch.isfinite(a).all(), f"d{name}: non-finite"
        assert _rel(a, b) < 1e-4, (f"d{name}", _rel(a, b))


class _LaunchSpy:
    """Stands in for one of ``triton_kernels``' backward kernels: records each launch's grid, the constexprs ``keys``
    (``LEAN`` and ``HAS_WG`` of ``_bwd_kernel``) and which tensor arguments are 16-byte aligned, and runs it."""

    def __init__(self, kernel, keys=("LEAN", "HAS_WG")):
        self.kernel, self.keys, self.forms, self.grids, self.aligned = kernel, keys, [], [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.forms.append(tuple(kwargs[k] for k in self.keys))
            self.grids.append(grid)
            self.aligned.append(tuple(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor)))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("form", ["shipped", "lean", "split"])
@pytest.mark.parametrize("N,T,D,hidden,depth,chunk", [(3, 11, 5, 9, 2, 4), (2, 13, 5, 5, 1, 3), (1, 40, 4, 6, 2, 2),
                                                     (3, 9, 17, 19, 2, 3)])
def test_kernel_backward_forms_with_and_without_the_chunk_weights_gradient(monkeypatch, form, N, T, D, hidden, depth,
                                                                           chunk):
    """The three forms of the depth-1/2 backward (``LEAN_BACKWARD``, ``SPLIT_BACKWARD``) against the PyTorch form
    in float64, for a loss on the outputs and the end state only (what every call that ends on a chunk boundary
    gives, in every recipe) and one that also reaches the last chunk's start weights ``wg``: ending inside a chunk,
    depth 1 and 2, several recompute groups. The lean and split forms are compiled without wg's gradient where
    the loss does not reach it (``HAS_WG=False``); the shipped one always reads it (zeros where missing). The
    split form launches its three kernels once per recompute group, last group first, the chunks' own part with
    one program per chunk of the group."""
    monkeypatch.delenv(titans_kernels.BACKWARD_ENV, raising=False)
    monkeypatch.setattr(triton_kernels, "SCRATCH_BYTES", 0)
    monkeypatch.setattr(triton_kernels, "LEAN_BACKWARD", form == "lean")
    monkeypatch.setattr(triton_kernels, "SPLIT_BACKWARD", form == "split")
    spy = _LaunchSpy(triton_kernels._bwd_kernel)
    monkeypatch.setattr(triton_kernels, "_bwd_kernel", spy)
    carry = _LaunchSpy(triton_kernels._bwd_carry_kernel, ("HAS_WG",))
    monkeypatch.setattr(triton_kernels, "_bwd_carry_kernel", carry)
    local = _LaunchSpy(triton_kernels._bwd_local_kernel, ())
    monkeypatch.setattr(triton_kernels, "_bwd_local_kernel", local)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ins, ref, out = _both(gen, N, T, D, hidden, depth, chunk)
    cots = [torch.randn(r.shape, generator=gen, dtype=torch.float64).to(DEVICE) for r in ref]
    for reach_wg in (False, True):
        used = len(ref) if reach_wg else 1 + 2 * depth  # y, the end weights and momentum (and wg)
        g_ref = torch.autograd.grad(sum((r * c).sum() for r, c in zip(ref[:used], cots)), ins, retain_graph=True)
        g_out = torch.autograd.grad(sum((o.double() * c).sum() for o, c in zip(out[:used], cots)), ins,
                                    retain_graph=True)
        for name, a, b in zip(["q", "k", "v", "lr", "log_eta", "log_keep", "w", "s"], g_out, g_ref):
            assert torch.isfinite(a).all(), f"d{name}: non-finite"
            assert _rel(a, b) < 1e-4, (f"d{name}", reach_wg, _rel(a, b))
    NC = -(-T // chunk)
    R, nsave = triton_kernels._checkpoints(NC, 0)
    groups = [min(R, NC - g * R) for g in reversed(range(nsave))]  # chunks per group, in launch order
    if form == "split":
        assert spy.forms == [] and carry.forms == [(False,)] * nsave + [(True,)] * nsave
        assert local.grids == [(N, n) for n in groups] * 2 and nsave > 1
    else:
        assert carry.forms == [] and local.forms == []
        assert spy.forms == ([(True, False), (True, True)] if form == "lean" else [(False, True), (False, True)])


def test_kernel_backward_form_from_the_environment(monkeypatch):
    """``MEMTRAIN_TITANS_BACKWARD`` picks the depth-1/2 backward's form over the module's flags (a recipe timed with
    each form on a GPU, unchanged code); unset, the flags decide. Another value is one error naming the variable
    and the choices (a user's error: the command line prints it on one line), raised when a memory that may run the
    kernels is built (before a run's first step), not by one that runs PyTorch's form; the kernel launched follows
    the variable."""
    env = titans_kernels.BACKWARD_ENV
    monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(triton_kernels, "SPLIT_BACKWARD", False)
    monkeypatch.setattr(triton_kernels, "LEAN_BACKWARD", True)
    assert triton_kernels.backward_form() == "lean"
    monkeypatch.setattr(triton_kernels, "SPLIT_BACKWARD", True)
    assert triton_kernels.backward_form() == "split"
    for form in titans_kernels.BACKWARD_FORMS:
        monkeypatch.setenv(env, form)
        assert triton_kernels.backward_form() == form
    monkeypatch.setenv(env, "fast")
    with pytest.raises(SettingError, match=r"^MEMTRAIN_TITANS_BACKWARD='fast': expected one of shipped, lean, split "
                                         r"\(or unset it\)$"):
        NeuralMemory(16, heads=2, kernel="auto")
    NeuralMemory(16, heads=2, kernel="torch")  # never runs the kernels: the variable is not its concern
    fwd = titans_kernels.FORWARD_ENV  # the forward's form the same way
    monkeypatch.delenv(fwd, raising=False)
    monkeypatch.setattr(triton_kernels, "SPLIT_FORWARD", True)
    assert triton_kernels.forward_form(16) == "split"
    monkeypatch.setattr(triton_kernels, "SPLIT_FORWARD", False)
    assert triton_kernels.forward_form(64) == "shipped"
    for form in titans_kernels.FORWARD_FORMS:
        monkeypatch.setenv(fwd, form)
        assert triton_kernels.forward_form(16) == triton_kernels.forward_form(64) == form
    monkeypatch.setenv(fwd, "fast")
    monkeypatch.setenv(env, "split")
    with pytest.raises(SettingError, match=r"^MEMTRAIN_TITANS_FORWARD='fast': expected one of shipped, split "
                                         r"\(or unset it\)$"):
        NeuralMemory(16, heads=2, kernel="triton")
    NeuralMemory(16, heads=2, kernel="torch")
    monkeypatch.setenv(fwd, "shipped")
    monkeypatch.setenv(env, "shipped")  # over SPLIT_BACKWARD
    spy = _LaunchSpy(triton_kernels._bwd_kernel)
    monkeypatch.setattr(triton_kernels, "_bwd_kernel", spy)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ins = [x.float().requires_grad_(True) for x in _inputs(gen, 1, 5, 4, 6, 2)]
    y, *_ = titans_kernels.scan(*ins[:6], ins[6:8], ins[8:], ins[6:8], 0, 2, kernel="triton")
    y.sum().backward()
    assert spy.forms == [(False, True)]


def test_kernel_forward_form_follows_the_chunk_size(monkeypatch):
    """By default (``SPLIT_FORWARD`` None) the depth-1/2 forward's form follows the chunk size: the one-program
    forward below ``SPLIT_FORWARD_MIN_CHUNK`` (64) tokens per chunk, where an H200 timed the split one 12-56% slower
    (the recipes' chunk 16), and the split forward from 64 on (19% faster at the layer target's chunk 64).
    ``SPLIT_FORWARD`` True / False and ``MEMTRAIN_TITANS_FORWARD`` override it. The launches follow: a chunk-64 call
    runs the split forward's two kernels, a chunk-4 call the one-program forward, both against the float64 reference
    (outputs, end state and every input's gradient, ending inside a chunk)."""
    fwd_env = titans_kernels.FORWARD_ENV
    monkeypatch.delenv(fwd_env, raising=False)
    monkeypatch.delenv(titans_kernels.BACKWARD_ENV, raising=False)
    assert triton_kernels.SPLIT_FORWARD is None and triton_kernels.SPLIT_FORWARD_MIN_CHUNK == 64
    assert [triton_kernels.forward_form(c) for c in (2, 16, 32, 63, 64, 128)] == ["shipped"] * 4 + ["split"] * 2
    monkeypatch.setattr(triton_kernels, "SPLIT_FORWARD", False)
    assert triton_kernels.forward_form(64) == "shipped"
    monkeypatch.setattr(triton_kernels, "SPLIT_FORWARD", True)
    assert triton_kernels.forward_form(16) == "split"
    monkeypatch.setattr(triton_kernels, "SPLIT_FORWARD", None)
    monkeypatch.setenv(fwd_env, "shipped")
    assert triton_kernels.forward_form(64) == "shipped"
    monkeypatch.setenv(fwd_env, "split")
    assert triton_kernels.forward_form(16) == "split"
    monkeypatch.delenv(fwd_env)

    spies = {name: _LaunchSpy(getattr(triton_kernels, name), ()) for name in
             ("_fwd_kernel", "_fwd_advance_kernel", "_fwd_read_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(triton_kernels, name, spy)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for T, chunk, ran in ((70, 64, {"_fwd_advance_kernel", "_fwd_read_kernel"}), (11, 4, {"_fwd_kernel"})):
        for spy in spies.values():
            spy.grids.clear()
        ins, ref, out = _both(gen, 1, T, 4, 6, 2, chunk)
        assert {name for name, spy in spies.items() if spy.grids} == ran, (chunk, ran)
        for a, b in zip(out, ref):
            assert _rel(a, b) < 1e-4, chunk
        cots = [torch.randn(r.shape, generator=gen, dtype=torch.float64).to(DEVICE) for r in ref]
        g_ref = torch.autograd.grad(sum((r * c).sum() for r, c in zip(ref, cots)), ins)
        g_out = torch.autograd.grad(sum((o.double() * c).sum() for o, c in zip(out, cots)), ins)
        for i, (a, b) in enumerate(zip(g_out, g_ref)):
            assert _rel(a, b) < 1e-4, (chunk, i, _rel(a, b))


@pytest.mark.parametrize("depth,form", [(2, "shipped"), (1, "lean")])
def test_kernel_waves_run_the_one_launchs_programs_bit_for_bit(monkeypatch, depth, form):
    """``MEMTRAIN_TITANS_WAVE=8``: the kernels with one program per sequence and head through every chunk (the
    shipped forward, the shipped and lean backward) launch at most 8 programs at a time. With 17 sequences and heads
    that is three launches each way, of 8, 8 and 1 programs; outputs, end state and every input's gradient equal the
    one launch's bit for bit (every buffer poisoned first: a wave that wrote another's rows, or none, would show).
    Depth 2 and 1, ending inside a chunk, several recompute groups. A wave of at least N programs is one launch."""
    monkeypatch.setenv(titans_kernels.BACKWARD_ENV, form)
    monkeypatch.delenv(titans_kernels.FORWARD_ENV, raising=False)
    monkeypatch.setattr(triton_kernels, "SCRATCH_BYTES", 0)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ins = [x.requires_grad_(True) for x in _inputs(gen, 17, 8, 5, 6, depth)]
    cots = None

    def run():
        nonlocal cots
        out = _run("kernel", ins, depth, 0, 3)
        cots = cots or [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(DEVICE) for o in out]
        return [*out, *torch.autograd.grad(sum((o.double() * c).sum() for o, c in zip(out, cots)), ins)]

    fwd = _LaunchSpy(triton_kernels._fwd_kernel, ())
    bwd = _LaunchSpy(triton_kernels._bwd_kernel)
    monkeypatch.setattr(triton_kernels, "_fwd_kernel", fwd)
    monkeypatch.setattr(triton_kernels, "_bwd_kernel", bwd)
    monkeypatch.delenv(titans_kernels.WAVE_ENV, raising=False)
    whole = run()
    monkeypatch.setenv(titans_kernels.WAVE_ENV, "8")
    waved = run()
    assert fwd.grids == [(17,), (8,), (8,), (1,)] and bwd.grids == [(17,), (8,), (8,), (1,)], (fwd.grids, bwd.grids)
    # Triton specialises a pointer on its 16-byte alignment: every wave's pointers are aligned as the one launch's
    # are, so the waves run its compiled binary
    for spy in (fwd, bwd):
        assert all(a == spy.aligned[0] for a in spy.aligned) and all(spy.aligned[0]), spy.aligned
    assert len(waved) == len(whole) == 3 * depth + 1 + 6 + 2 * depth
    for i, (a, b) in enumerate(zip(waved, whole)):
        assert torch.isfinite(b).all() and torch.equal(a, b), i
    monkeypatch.setenv(titans_kernels.WAVE_ENV, "24")
    run()
    assert fwd.grids[4:] == [(17,)] and bwd.grids[4:] == [(17,)]


def test_kernel_wave_from_the_environment(monkeypatch):
    """``MEMTRAIN_TITANS_WAVE`` is 0 (one launch) where unset or 0, else programs per launch, a multiple of 8 (each
    wave's tensors as aligned as the whole's). Another value is one error naming the variable and what it takes,
    raised when a memory that may run the kernels is built; a launch whose tensors are not indexed by its programs
    is refused rather than run in waves."""
    env = titans_kernels.WAVE_ENV
    monkeypatch.delenv(env, raising=False)
    assert titans_kernels.requested_wave() == 0 and triton_kernels._waves(5) == [slice(0, 5)]
    for raw, wave in (("0", 0), ("16", 16), (" 8 ", 8)):
        monkeypatch.setenv(env, raw)
        assert titans_kernels.requested_wave() == wave
    assert triton_kernels._waves(20) == [slice(0, 8), slice(8, 16), slice(16, 20)]
    assert triton_kernels._waves(8) == [slice(0, 8)]
    for raw in ("12", "-8", "x", "8.0"):
        monkeypatch.setenv(env, raw)
        with pytest.raises(SettingError, match=rf"^MEMTRAIN_TITANS_WAVE='{re.escape(raw)}': expected programs per "
                                               r"launch, a multiple of 8 \(or 0 or unset for one launch\)$"):
            NeuralMemory(16, heads=2, kernel="auto")
        NeuralMemory(16, heads=2, kernel="torch")  # never runs the kernels
    monkeypatch.setenv(env, "8")
    with titans_kernels.kernel_form("lean", 16):  # how the benchmarks set it, restored after
        assert titans_kernels.requested_wave() == 16 and triton_kernels.backward_form() == "lean"
    assert titans_kernels.requested_wave() == 8
    with pytest.raises(ValueError, match=r"shape \(4, 3\) is not indexed by the 9 programs"):
        triton_kernels._launch_per_sequence(None, 9, torch.zeros(9, 2), 3, torch.zeros(4, 3))


def test_kernel_pipelined_stages_from_the_environment_reach_the_split_loops(monkeypatch):
    """``MEMTRAIN_TITANS_STAGES`` is 1 (no software pipelining, as shipped) where unset, else 1 to 3; another value
    is one error naming the variable and what it takes, raised when a memory that may run the kernels is built. It
    reaches the split kernels' loops over chunks only (the forward's recurrence, the backward's recompute and carried
    loops), the carried one in at most 2 stages and at chunks of up to 16 tokens, and only at tiles up to the
    recipes' (head size 64 x hidden 128), where their shared memory was compiled and fits; every other kernel stays
    unpipelined. The ``pipelined`` form sets it to 2 with the split forward and backward. The interpreter ignores the
    stages, so the launches are what is checked here (the compiled kernels against float64 are in the GPU tier:
    ``test_kernel_at_recipe_shapes_on_gpu``; their shared memory in ``test_kernel_compiles_for_an_h100_...``)."""
    env = titans_kernels.STAGES_ENV
    monkeypatch.delenv(env, raising=False)
    assert titans_kernels.requested_stages() == 1
    for raw, stages in (("1", 1), ("2", 2), (" 3 ", 3)):
        monkeypatch.setenv(env, raw)
        assert titans_kernels.requested_stages() == stages
    for raw in ("0", "4", "x", "2.0", "-1"):
        monkeypatch.setenv(env, raw)
        with pytest.raises(SettingError, match=rf"^MEMTRAIN_TITANS_STAGES='{re.escape(raw)}': expected the split "
                                               r"kernels' pipelining stages, 1 to 3 \(or unset it for 1\)$"):
            NeuralMemory(16, heads=2, kernel="auto")
        NeuralMemory(16, heads=2, kernel="torch")  # never runs the kernels
    stages = triton_kernels.loop_stages
    kernels = ("fwd_advance", "bwd_recompute", "bwd_carry", "bwd_local", "fwd_read", "fwd", "bwd")
    assert [stages(k, 64, 128, 16, 3) for k in kernels] == [3, 3, 2, 1, 1, 1, 1]
    assert [stages(k, 64, 128, 64, 2) for k in kernels] == [2, 2, 1, 1, 1, 1, 1]  # the carried loop: 249 KiB
    assert stages("bwd_carry", 64, 128, 32, 2) == 1 and stages("bwd_carry", 64, 64, 8, 2) == 2
    assert [stages(k, 128, 128, 16, 2) for k in kernels[:3]] == [1, 1, 1]  # tiles above the recipes'
    assert [stages(k, 64, 128, 16, 1) for k in kernels[:3]] == [1, 1, 1]
    monkeypatch.setenv(env, "3")
    assert stages("bwd_recompute", 64, 128, 16) == 3  # the environment's by default
    with titans_kernels.kernel_form("pipelined"):  # how the benchmarks set it, restored after
        assert titans_kernels.requested_stages() == 2 and triton_kernels.backward_form() == "split"
        assert triton_kernels.forward_form(16) == "split"
    with titans_kernels.kernel_form("split"):
        assert titans_kernels.requested_stages() == 1
    assert titans_kernels.requested_stages() == 3

    names = ("_fwd_advance_kernel", "_fwd_read_kernel", "_bwd_recompute_kernel", "_bwd_local_kernel",
             "_bwd_carry_kernel")
    spies = {name: _LaunchSpy(getattr(triton_kernels, name), ("num_stages",)) for name in names}
    for name, spy in spies.items():
        monkeypatch.setattr(triton_kernels, name, spy)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for form, want in (("pipelined", (2, 1, 2, 1, 2)), ("split", (1, 1, 1, 1, 1))):
        for spy in spies.values():
            spy.forms.clear()
        with titans_kernels.kernel_form(form):
            ins, ref, out = _both(gen, 2, 11, 5, 9, 2, 4)
            g_ref = torch.autograd.grad(sum(r.square().sum() for r in ref), ins)
            g_out = torch.autograd.grad(sum(o.double().square().sum() for o in out), ins)
        assert tuple(set(spies[name].forms) for name in names) == tuple({(x,)} for x in want), form
        for a, b in zip([*out, *g_out], [*ref, *g_ref]):
            assert _rel(a, b) < 1e-4, form
    for var, value in titans_kernels.form_env("split").items():  # the split forms with 3 stages asked for
        monkeypatch.setenv(var, value)
    monkeypatch.setenv(env, "3")
    for spy in spies.values():
        spy.forms.clear()
    ins, ref, out = _both(gen, 1, 7, 5, 9, 2, 4)
    torch.autograd.grad(sum(o.double().sum() for o in out), ins)
    assert tuple(set(spies[name].forms) for name in names) == ({(3,)}, {(1,)}, {(3,)}, {(1,)}, {(2,)})


@pytest.mark.parametrize("N,T,D,hidden,depth,chunk", [(3, 11, 5, 9, 2, 4), (2, 13, 5, 5, 1, 3), (1, 40, 4, 6, 2, 2),
                                                     (3, 9, 17, 19, 2, 3), (1, 3, 7, 5, 2, 5)])
def test_kernel_split_forward_matches_reference(monkeypatch, N, T, D, hidden, depth, chunk):
    """The split forward (``MEMTRAIN_TITANS_FORWARD=split``: per recompute group the recurrence in one program per
    sequence and head, then the reads in one program per chunk) against the float64 PyTorch form: outputs, end
    state, the last chunk's start weights, and every gradient through the states it saves for the backward (the
    first from the initial state, each next one written by the group before; poisoned buffers would show a missing
    one). Depth 1 and 2, ending inside a chunk, shorter than one, several groups. Its two kernels launch once per
    group, first group first, the reads with one program per chunk of the group; the one-program forward not at
    all."""
    monkeypatch.setenv(titans_kernels.FORWARD_ENV, "split")
    monkeypatch.delenv(titans_kernels.BACKWARD_ENV, raising=False)
    monkeypatch.setattr(triton_kernels, "SCRATCH_BYTES", 0)
    whole = _LaunchSpy(triton_kernels._fwd_kernel, ())
    monkeypatch.setattr(triton_kernels, "_fwd_kernel", whole)
    advance = _LaunchSpy(triton_kernels._fwd_advance_kernel, ())
    monkeypatch.setattr(triton_kernels, "_fwd_advance_kernel", advance)
    read = _LaunchSpy(triton_kernels._fwd_read_kernel, ())
    monkeypatch.setattr(triton_kernels, "_fwd_read_kernel", read)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ins, ref, out = _both(gen, N, T, D, hidden, depth, chunk)
    for i, (a, b) in enumerate(zip(out, ref)):
        assert torch.isfinite(a).all() and _rel(a, b) < 1e-4, (i, _rel(a, b))
    cots = [torch.randn(r.shape, generator=gen, dtype=torch.float64).to(DEVICE) for r in ref]
    g_ref = torch.autograd.grad(sum((r * c).sum() for r, c in zip(ref, cots)), ins)
    g_out = torch.autograd.grad(sum((o.double() * c).sum() for o, c in zip(out, cots)), ins)
    for name, a, b in zip(["q", "k", "v", "lr", "log_eta", "log_keep", "w", "s"], g_out, g_ref):
        assert torch.isfinite(a).all() and _rel(a, b) < 1e-4, (f"d{name}", _rel(a, b))
    NC = -(-T // chunk)
    R, nsave = triton_kernels._checkpoints(NC, 0)
    assert whole.grids == [] and advance.grids == [(N,)] * nsave
    assert read.grids == [(N, min(R, NC - g * R)) for g in range(nsave)]


@pytest.mark.parametrize("form", ["lean", "split"])
def test_kernel_lean_backward_through_aot_autograd(monkeypatch, form):
    """The lean and split backwards' operator takes ``None`` for a gradient the loss does not reach (the last
    chunk's start weights): traced by AOTAutograd (``aot_eager``, as compiled Titans blocks run it) its gradients
    equal the eager ones, and the traced backward launched the form without that gradient."""
    monkeypatch.delenv(titans_kernels.BACKWARD_ENV, raising=False)
    monkeypatch.setattr(triton_kernels, "LEAN_BACKWARD", form == "lean")
    monkeypatch.setattr(triton_kernels, "SPLIT_BACKWARD", form == "split")
    if form == "lean":
        spy = _LaunchSpy(triton_kernels._bwd_kernel)
        monkeypatch.setattr(triton_kernels, "_bwd_kernel", spy)
    else:
        spy = _LaunchSpy(triton_kernels._bwd_carry_kernel, ("HAS_WG",))
        monkeypatch.setattr(triton_kernels, "_bwd_carry_kernel", spy)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ins = [x.float().requires_grad_(True) for x in _inputs(gen, 2, 11, 5, 7, 2)]

    def loss(q, k, v, lr, log_eta, log_keep, w1, w2, s1, s2):
        y, w, s, _ = titans_kernels.scan(q, k, v, lr, log_eta, log_keep, [w1, w2], [s1, s2], [w1, w2], 0, 4,
                                         kernel="triton")
        return (y * y).sum() + (w[0] * w[1].transpose(1, 2)).sum()

    eager = torch.autograd.grad(loss(*ins), ins)
    torch._dynamo.reset()
    traced = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(*ins), ins)
    for a, b in zip(traced, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert spy.forms == ([(True, False), (True, False)] if form == "lean" else [(False,), (False,)])


@pytest.mark.parametrize("N,NC,C", [(3, 2, 4), (2, 3, 7), (1, 2, 16), (2, 1, 19)])
def test_kernel_coefficients_match_reference_forward_and_backward(N, NC, C):
    """The chunk coefficients in Triton (one program per chunk) against :func:`reference.chunk_coefficients` in
    float64: every output and the gradients of the three gates from random cotangents on all five outputs (chunk
    sizes below, at and above one 16-wide block, not powers of two)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    lr = 0.1 * torch.rand(N, NC, C, generator=gen, dtype=torch.float64)
    log_eta = F.logsigmoid(torch.randn(N, NC, C, generator=gen, dtype=torch.float64))
    log_keep = F.logsigmoid(torch.randn(N, NC, C, generator=gen, dtype=torch.float64) + 1.0)
    gates = [x.to(DEVICE).requires_grad_(True) for x in (lr, log_eta, log_keep)]
    ref = reference.chunk_coefficients(*gates)
    out = triton_kernels.triton_chunk_coefficients(*(g.float() for g in gates))
    names = ["decay", "carry", "mix", "momentum_decay_end", "momentum_mix_end"]
    for name, a, b in zip(names, out, ref):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert torch.isfinite(a).all(), f"{name}: unwritten (NaN) elements"
        assert _rel(a, b) < 1e-5, (name, _rel(a, b))
    cots = [torch.randn(r.shape, generator=gen, dtype=torch.float64).to(DEVICE) for r in ref]
    g_ref = torch.autograd.grad(sum((r * c).sum() for r, c in zip(ref, cots)), gates, retain_graph=True)
    g_out = torch.autograd.grad(sum((o.double() * c).sum() for o, c in zip(out, cots)), gates, retain_graph=True)
    for name, a, b in zip(["lr", "log_eta", "log_keep"], g_out, g_ref):
        assert torch.isfinite(a).all(), f"d{name}: unwritten (NaN) elements"
        assert _rel(a, b) < 1e-5, (f"d{name}", _rel(a, b))
    for i, name in enumerate(names):  # each output's own gradient path (the others' cotangents absent)
        only = torch.autograd.grad((out[i].double() * cots[i]).sum(), gates, allow_unused=True, retain_graph=True)
        want = torch.autograd.grad((ref[i] * cots[i]).sum(), gates, allow_unused=True, retain_graph=True)
        for g, r in zip(only, want):
            r = torch.zeros_like(gates[0]) if r is None else r
            assert _rel(g, r) < 1e-5 or (r.abs().max() == 0 and g.abs().max() == 0), name


@pytest.mark.parametrize("depth,split", [(1, False), (2, False), (3, False), (1, True), (2, True)])
def test_kernel_backward_at_every_checkpoint_spacing(monkeypatch, depth, split):
    """The backward restarts from every R-th chunk's saved state (R from the scratch budget, at least
    ceil(sqrt(n_chunks))): 7 chunks at R = 3 (the smallest; a partial last group), 5 (partial), 7 (one group,
    the default here: only the first chunk's state saved) against the float64 reference, outputs and every
    gradient; at depth 1-2 also the split forward and backward (``SPLIT_FORWARD``, ``SPLIT_BACKWARD``)."""
    from memtrain.kernels.titans import triton_deep

    monkeypatch.setattr(triton_kernels, "SPLIT_BACKWARD", split)
    monkeypatch.setattr(triton_kernels, "SPLIT_FORWARD", split)
    monkeypatch.delenv(titans_kernels.BACKWARD_ENV, raising=False)
    monkeypatch.delenv(titans_kernels.FORWARD_ENV, raising=False)

    N, T, D, hidden, chunk = 1, 13, 5, 7, 2  # 7 chunks, the last partial
    state = 8 * N * (D * hidden + hidden * D if depth == 2 else D * D if depth == 1 else 3 * 16 * 16)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ins = [x.requires_grad_(True) for x in _inputs(gen, N, T, D, hidden, depth)]
    ref = _run("reference", ins, depth, 0, chunk)
    cots = [torch.randn(r.shape, generator=gen, dtype=torch.float64).to(DEVICE) for r in ref]
    g_ref = torch.autograd.grad(sum((r * c).sum() for r, c in zip(ref, cots)), ins)
    default = triton_kernels.SCRATCH_BYTES
    for budget, R in ((0, 3), (5 * state, 5), (default, 7)):
        monkeypatch.setattr(triton_kernels, "SCRATCH_BYTES", budget)
        shape = (N, 1, 3, 16, 16) if depth == 3 else None  # the deep kernels' packed state
        got = triton_deep._deep_checkpoints(7, shape[:1] + shape[2:]) if depth == 3 else \
            triton_kernels._checkpoints(7, state)
        assert got == (R, -(-7 // R)), (budget, got)
        out = _run("kernel", ins, depth, 0, chunk)
        for a, b in zip(out, ref):
            assert _rel(a, b) < 1e-4, R
        g_out = torch.autograd.grad(sum((o.double() * c).sum() for o, c in zip(out, cots)), ins)
        for i, (a, b) in enumerate(zip(g_out, g_ref)):
            assert torch.isfinite(a).all() and _rel(a, b) < 1e-4, (R, i, _rel(a, b))


def test_kernel_custom_operators_pass_opcheck():
    """The kernels' autograd is six custom operators (torch.library; compiled Titans blocks trace each as one
    node): ``torch.library.opcheck`` checks the coefficients' and the scans' forward operators at depth 1 and 2
    and the any-depth one at depth 3 -- the schemas (no output aliases an input, no input is written), the fake
    implementations (shape, dtype and strides of every output), the autograd registration, and that the
    forward and backward traced by AOTAutograd equal eager's (which runs the backward operators). Inputs with
    other strides give the same results as dense ones."""
    from memtrain.kernels.titans import triton_deep

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    N, T, D, H, C = 2, 11, 5, 7, 4
    NC = -(-T // C)
    ins = _inputs(gen, N, NC * C, D, H, 2, dtype=torch.float32)
    q, k, v, lr, log_eta, log_keep = (x.requires_grad_(True) for x in ins[:6])
    gates = [x.detach().reshape(N, NC, C).requires_grad_(True) for x in (lr, log_eta, log_keep)]
    torch.library.opcheck(triton_kernels._coef_fwd.op, gates)
    coef = [c.detach().requires_grad_(True) for c in triton_kernels._coef_fwd(*gates)]
    for depth in (1, 2):
        state = [x.requires_grad_(True) for x in _inputs(gen, N, NC * C, D, H, depth, dtype=torch.float32)[6:]]
        w, s = state[:depth], state[depth:]
        for split in (False, True):  # the forward's two forms (SPLIT_FORWARD)
            torch.library.opcheck(triton_kernels._scan_fwd.op, (q, k, v, *coef, w[0], s[0], w[-1], s[-1], T, C, depth,
                                                             split))
    # Other strides than dense row-major (what a compiled graph may hand an operator): the same results.

    def scan(q, k, v, mix, e_end, w1, w2, s1, s2, split=False):
        return triton_kernels._scan_fwd(q, k, v, coef[0], coef[1], mix, e_end, coef[4], w1, s1, w2, s2, T, C, 2,
                                        split)

    dense = [x.detach() for x in (q, k, v, coef[2], coef[3], *w, *s)]
    strided = [x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in dense]  # same values, column-major
    assert not any(x.is_contiguous() for x in strided)
    for a, b in zip(scan(*dense), scan(*strided)):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
    for a, b in zip(scan(*dense), scan(*dense, split=True)):  # the forms agree to rounding
        assert _rel(b, a) < 1e-5
    state = _inputs(gen, N, NC * C, D, H, 3, dtype=torch.float32)[6:]
    wc, sc = (triton_deep._pack(x, 16).requires_grad_(True) for x in (state[:3], state[3:]))
    torch.library.opcheck(triton_deep._deep_fwd.op, (q, k, v, *coef, wc, sc, T, C))


@pytest.mark.parametrize("depth", [1, 2])
def test_kernel_any_depth_kernels_at_depth_one_and_two(monkeypatch, depth):
    """The any-depth kernels (memory state in a per-program scratch) also run depth 1 and 2 when asked (the
    benchmark times them there against the register-resident kernels): same result as the reference."""
    monkeypatch.setattr(titans_kernels, "DEEP_KERNEL_MIN_DEPTH", 1)
    test_kernel_matches_reference_forward_and_backward(monkeypatch, 2, 10, 6, 7, depth, 3)


@pytest.mark.parametrize("depth", [2, 3])
def test_kernel_second_order_terms_through_chunk_start_weights(depth):
    """Only the path through the per-token gradients (u_i at the chunk-start weights) reaches ``w`` when the
    coefficients that carry ``w`` forward are zero: keep = 0 removes B_t W; the kernel's weight gradient must
    then still match, i.e. it includes the second-order terms."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ins = _inputs(gen, 2, 6, 5, 7, depth)
    ins[5] = torch.full_like(ins[5], -30.0)  # log(1 - alpha): alpha ~ 1, decay ~ 0 after the first token
    for x in ins:
        x.requires_grad_(True)
    ref = _run("reference", ins, depth, 0, 6)
    out = _run("kernel", ins, depth, 0, 6)
    g_ref = torch.autograd.grad(ref[0].sum(), ins[6:6 + depth])
    g_out = torch.autograd.grad(out[0].double().sum(), ins[6:6 + depth])
    for a, b in zip(g_out, g_ref):
        assert b.abs().max() > 1e-5  # the path exists (a dropped term gives a relative error near 1)
        assert _rel(a, b) < 1e-4


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_kernel_carries_state_across_calls_at_any_split(depth):
    """Calls split inside a chunk (the first ``pos % chunk`` tokens of a call go through PyTorch, the rest
    through the kernels) give the one-pass result, values and gradients."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    T, chunk = 14, 4
    ins = _inputs(gen, 2, T, 5, 6, depth)
    for x in ins:
        x.requires_grad_(True)
    ref = _run("reference", ins, depth, 0, chunk)
    q, k, v, lr, log_eta, log_keep, *state = ins
    w, s, wg, ys, pos = [x.float() for x in state[:depth]], [x.float() for x in state[depth:]], None, [], 0
    wg = w
    for cut in (5, 3, 6):  # 0-5 (ends mid-chunk), 5-8 (starts and ends mid-chunk), 8-14
        sl = slice(pos, pos + cut)
        y, w, s, wg = titans_kernels.scan(q[:, sl].float(), k[:, sl].float(), v[:, sl].float(), lr[:, sl].float(),
                                          log_eta[:, sl].float(), log_keep[:, sl].float(), w, s, wg, pos, chunk,
                                          kernel="triton")
        ys.append(y)
        pos += cut
    out = [torch.cat(ys, 1), *w, *s]
    for a, b in zip(out, ref):
        assert _rel(a, b) < 1e-4
    g_ref = torch.autograd.grad(ref[0].sum() + ref[1].sum(), ins)
    g_out = torch.autograd.grad(out[0].double().sum() + out[1].double().sum(), ins)
    for a, b in zip(g_out, g_ref):
        assert _rel(a, b) < 1e-4


@pytest.mark.parametrize("depth", [2, 3])
def test_kernel_missing_output_gradients_read_shared_zeros(depth, monkeypatch):
    """A loss that reads only ``y`` leaves the end state's and the chunk-start weights' gradients missing: eagerly
    the backward operators read one shared zero tensor per shape (no zero-fill per call), which stays zero after
    repeated backwards, and the gradients equal those with the missing ones given as explicit zeros."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ins = [x.float().requires_grad_(True) for x in _inputs(gen, 2, 9, 5, 6, depth)]
    q, k, v, lr, log_eta, log_keep, *state = ins
    w, s = state[:depth], state[depth:]
    shared, handed = triton_kernels._shared_zeros, []
    monkeypatch.setattr(triton_kernels, "_shared_zeros", lambda *key: handed.append(shared(*key)) or handed[-1])
    grads = []
    for _ in range(2):
        y, w_end, s_end, wg = titans_kernels.scan(q, k, v, lr, log_eta, log_keep, w, s, w, 0, 4, kernel="triton")
        grads.append(torch.autograd.grad((y * y).sum(), ins))
    per_backward = len(handed) // 2
    assert per_backward >= 2 and len(handed) == 2 * per_backward  # the end state and chunk-start weights at least
    assert [id(t) for t in handed[:per_backward]] == [id(t) for t in handed[per_backward:]]  # the same tensors
    assert all(t.dtype == torch.float32 and not t.any() for t in handed)  # still zero after two backwards
    y, w_end, s_end, wg = titans_kernels.scan(q, k, v, lr, log_eta, log_keep, w, s, w, 0, 4, kernel="triton")
    explicit = torch.autograd.grad((y * y).sum() + sum((0 * t).sum() for t in (*w_end, *s_end, *wg)), ins)
    for a, b, c in zip(*grads, explicit):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_kernel_half_precision_inputs_close_to_float32():
    """Half-precision q, k, v: half-precision dot products with float32 accumulation and state, within rounding.
    float16 here: the same code path as bfloat16 but for the cast, and the Triton interpreter computes bfloat16
    dot products wrongly (a plain 16 x 16 ``tl.dot`` of bf16 tiles is off by 1e10 in Triton 3.8's interpreter)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ins = _inputs(gen, 2, 10, 16, 32, 2, dtype=torch.float32)
    q, k, v, lr, log_eta, log_keep, *state = ins
    w, s = list(state[:2]), list(state[2:])
    y_ref, w_ref, _, _ = reference.scan(q, k, v, lr, log_eta, log_keep, w, s, w, 0, 4)
    y, w_out, _, _ = titans_kernels.scan(q.half(), k.half(), v.half(), lr, log_eta, log_keep, w, s, w, 0,
                                         4, kernel="triton")
    assert y.dtype == torch.float32 and w_out[0].dtype == torch.float32
    assert _rel(y, y_ref) < 1e-2 and _rel(w_out[0], w_ref[0]) < 1e-2


def test_kernel_half_precision_layer_hands_the_kernels_half_precision_qkv(monkeypatch):
    """With half-precision activations and the kernels running, the layer lays q, k, v out per head in the
    activations' dtype in the same (fused) kernel as the convolution before them (contiguous, what the kernels
    read; nothing left for run_scan to cast), the gates in another fused kernel, the output stage in a third, and
    the whole layer stays within rounding of its float32 form with the PyTorch inner loop; each switch turns its
    kernels off: the convolution's alone (the q/k/v kernel without it), then the prologue's."""
    torch.manual_seed(torch.seed() % 2**31)
    mem = NeuralMemory(24, heads=3, depth=2, chunk_size=4, kernel="triton").to(DEVICE)
    ref = NeuralMemory(24, heads=3, depth=2, chunk_size=4, kernel="torch").to(DEVICE)
    ref.load_state_dict(mem.state_dict())
    mem = mem.half()
    seen = []

    def spy(q, k, v, *args):
        seen.append([(t.dtype, t.is_contiguous()) for t in (q, k, v)])
        return run_scan(q, k, v, *args)

    mem.scan = spy
    from memtrain.kernels.titans import prologue

    from memtrain.kernels.titans import output

    fused = []
    for mod, name in ((prologue, "conv_qkv_heads"), (prologue, "qkv_heads"), (prologue, "gates"),
                      (output, "gated_norm")):
        monkeypatch.setattr(mod, name, lambda *a, _f=getattr(mod, name), _n=name: fused.append(_n) or _f(*a))
    x = torch.randn(2, 11, 24, device=DEVICE)
    y, _ = mem(x.half())
    # the fused prologue (with the convolution) and output stage
    assert seen == [[(torch.float16, True)] * 3] and fused == ["conv_qkv_heads", "gates", "gated_norm"]
    assert y.dtype == torch.float16 and _rel(y.float(), ref(x)[0]) < 2e-2
    fused.clear()
    mem.gate_mode = ref.gate_mode = "chunk"  # the gates of a chunk's first token: PyTorch's form (one fused kernel)
    y2, _ = mem(x.half())
    assert fused == ["conv_qkv_heads", "gated_norm"] and _rel(y2.float(), ref(x)[0]) < 2e-2
    fused.clear()
    monkeypatch.setenv("MEMTRAIN_TITANS_FUSED_CONV", "0")  # the switches: PyTorch's form, the same function
    y3, _ = mem(x.half())
    assert fused == ["qkv_heads", "gated_norm"] and _rel(y3.float(), y2.float()) < 5e-3
    fused.clear()
    monkeypatch.setenv("MEMTRAIN_TITANS_FUSED_PROLOGUE", "0")
    y3, _ = mem(x.half())
    assert fused == ["gated_norm"] and seen[-1] == [(torch.float16, True)] * 3 and _rel(y3.float(), y2.float()) < 5e-3
    fused.clear()
    monkeypatch.setenv("MEMTRAIN_TITANS_FUSED_OUTPUT", "0")
    y4, _ = mem(x.half())
    assert fused == [] and _rel(y4.float(), y2.float()) < 5e-3


@pytest.mark.parametrize("depth,gate_mode", [(2, "token"), (1, "chunk"), (3, "token")])
def test_kernel_neural_memory_layer_matches_torch(depth, gate_mode):
    """The whole layer (projections, convolutions, gates, output norm and gate) with ``kernel="triton"`` equals
    ``kernel="torch"``: outputs, the state after a call split mid-chunk, and every parameter's gradient."""
    torch.manual_seed(torch.seed() % 2**31)
    mems = {}
    for kernel in ("torch", "triton"):
        torch.manual_seed(7)
        mems[kernel] = NeuralMemory(24, heads=3, depth=depth, chunk_size=4, gate_mode=gate_mode,
                                    kernel=kernel).to(DEVICE)
    x = torch.randn(2, 11, 24, device=DEVICE)
    results = {}
    for kernel, mem in mems.items():
        y1, st = mem(x[:, :6])
        y2, st = mem(x[:, 6:], st)
        loss = (y1 ** 2).sum() + (y2 ** 2).sum() + st.weights[0].sum()
        grads = torch.autograd.grad(loss, list(mem.parameters()))
        results[kernel] = (torch.cat([y1, y2], 1), st, grads)
    (y_t, st_t, g_t), (y_k, st_k, g_k) = results["torch"], results["triton"]
    assert _rel(y_k, y_t) < 1e-4
    for a, b in zip((*st_k.weights, *st_k.momentum), (*st_t.weights, *st_t.momentum)):
        assert _rel(a, b) < 1e-4
    for (name, _), a, b in zip(mems["torch"].named_parameters(), g_k, g_t):
        assert _rel(a, b) < 1e-4, name


# -- the memory layer's prologue (memtrain.kernels.titans.prologue) ---------------------------------------------


@pytest.fixture
def poisoned_prologue(poison_empty):
    from memtrain.kernels.titans import prologue

    return poison_empty(prologue)


def _qkv_reference(x, heads, norm_v):
    """NeuralMemory._qkv_heads' formula in float64 from ``x``'s SiLU as ``F.silu`` rounds it: [3, B, H, T, hd]."""
    B, T, C = x.shape
    a = F.silu(x).double().view(B, T, 3, heads, C // (3 * heads))
    a = torch.cat([F.normalize(a[:, :, :2], dim=-1), F.normalize(a[:, :, 2:], dim=-1) if norm_v else a[:, :, 2:]], 2)
    return a.permute(2, 0, 3, 1, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm_v", [False, True])
def test_kernel_prologue_qkv_heads_matches_torch(poisoned_prologue, dtype, norm_v, op_names):
    """The fused q/k/v prologue (SiLU, L2 norm per head, layout, cast) against its PyTorch formula in float64: odd
    head size and head count, a length across the 32-token blocks, the convolution's transposed strides; outputs
    in ``dtype`` within its rounding, every element written; the gradient of the input within half-precision
    rounding of float64 autograd (the kernel's backward is float32 throughout), in the input's layout."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, T, H, hd = 2, 37, 3, 5
    x = (2 * torch.randn(B, 3 * H * hd, T, generator=gen)).to(DEVICE, dtype).transpose(1, 2)  # conv1d's layout
    x.requires_grad_(True)
    q, k, v = poisoned_prologue.qkv_heads(x, H, norm_v, dtype)
    ref = _qkv_reference(x.detach(), H, norm_v)
    tol = 4e-3 if dtype == torch.float16 else 2e-2
    for got, want in zip((q, k, v), ref):
        assert got.dtype == dtype and got.shape == (B, H, T, hd) and got.is_contiguous()
        assert torch.isfinite(got).all() and _rel(got, want) < tol, _rel(got, want)
    cot = torch.randn(3, B, H, T, hd, generator=gen).to(DEVICE)
    x64 = x.detach().double().requires_grad_(True)
    B_, T_, C_ = x64.shape
    a = F.silu(x64).view(B_, T_, 3, H, hd)
    a = torch.cat([F.normalize(a[:, :, :2], dim=-1), F.normalize(a[:, :, 2:], dim=-1) if norm_v else a[:, :, 2:]], 2)
    a = a.permute(2, 0, 3, 1, 4)
    for used in ((0, 1, 2), (0,), (1,), (2,)):  # all three outputs reach the loss, or one (the others' are zeros)
        with op_names() as ops:
            (dx,) = torch.autograd.grad(sum((q, k, v)[i].float().mul(cot[i]).sum() for i in used), x,
                                        retain_graph=True)
        assert "stack" not in ops.names and ops.names.count("titans_qkv_heads_bwd") == 1, ops.names
        (dx_ref,) = torch.autograd.grad(sum((a[i] * cot[i].double()).sum() for i in used), x64, retain_graph=True)
        assert dx.dtype == dtype and torch.isfinite(dx).all() and _rel(dx, dx_ref) < tol, (used, _rel(dx, dx_ref))
        assert dx.stride() == x.stride()  # the convolution's layout: its backward takes the gradient without a copy


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid at |g| >> 1: 0 or 1
@pytest.mark.parametrize("dtype, strided", [(torch.float32, False), (torch.float16, False), (torch.bfloat16, False),
                                            (torch.bfloat16, True)])
def test_kernel_prologue_gates_match_torch(poisoned_prologue, dtype, strided, op_names):
    """The fused gate prologue (theta = max_lr sigmoid, log eta = logsigmoid + log max_momentum, log(1 - alpha) =
    logsigmoid(-g), the per-head layout) against float64: pre-activations up to +-40 (logsigmoid's tails), a
    length across the 32-token blocks, ``strided``: the columns of a wider projection (as eager MAC's stacked
    q/k/v and gate projection gives them); float32 outputs to 1e-5, the gradient to 1e-5 (float32 input) or within
    the input dtype's rounding."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, T, H = 3, 45, 5
    g = (torch.randn(B, T, 3 * H, generator=gen) * torch.tensor([1.0, 8.0, 40.0]).repeat_interleave(T * 3 * H // 3)
         .view(1, T, 3 * H)[:, :, torch.randperm(3 * H, generator=gen)]).to(DEVICE, dtype)
    if strided:
        g = torch.cat([torch.randn(B, T, 7, dtype=dtype, device=DEVICE), g], dim=-1).requires_grad_(True)[..., 7:]
        assert not g.is_contiguous()
    else:
        g.requires_grad_(True)
    max_lr, max_m = 0.003, 0.95
    lr, log_eta, log_keep = poisoned_prologue.gates(g, H, max_lr, max_m)
    g64 = g.detach().double().requires_grad_(True)
    r = g64.view(B, T, 3, H).permute(2, 0, 3, 1)
    ref = (max_lr * torch.sigmoid(r[0]), F.logsigmoid(r[1]) + math.log(max_m), F.logsigmoid(-r[2]))
    for got, want in zip((lr, log_eta, log_keep), ref):
        assert got.dtype == torch.float32 and got.shape == (B, H, T) and got.is_contiguous()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    cot = torch.randn(3, B, H, T, generator=gen, dtype=torch.float64).to(DEVICE)
    out = (lr, log_eta, log_keep)
    for used in ((0, 1, 2), (0,), (1,), (2,)):  # all three gates reach the loss, or one (the others' are zeros)
        with op_names() as ops:
            (dg,) = torch.autograd.grad(sum((out[i] * cot[i].float()).sum() for i in used), g, retain_graph=True)
        assert "stack" not in ops.names and ops.names.count("titans_gates_bwd") == 1, ops.names
        if strided:  # the kernels read the slice where it lies (no copy of it either way)
            assert not [n for n in ops.names if n in ("clone", "contiguous", "copy_")], ops.names
        (dg_ref,) = torch.autograd.grad(sum((ref[i] * cot[i]).sum() for i in used), g64, retain_graph=True)
        assert dg.dtype == dtype and torch.isfinite(dg).all()
        assert _rel(dg, dg_ref) < (1e-5 if dtype == torch.float32 else 1e-2), (used, _rel(dg, dg_ref))


@pytest.mark.parametrize("dtype, width, T", [(torch.float16, 4, 45), (torch.bfloat16, 4, 37), (torch.float32, 4, 2),
                                             (torch.float16, 1, 19), (torch.float32, 3, 70)])
def test_kernel_prologue_conv_qkv_heads_matches_torch(poisoned_prologue, dtype, width, T, op_names):
    """The convolution fused into the q/k/v prologue against the layer's PyTorch form (the causal depthwise
    ``F.conv1d`` over the cache and the input, rounded to ``dtype``, then SiLU, L2 norm per head, layout) in
    float64: odd head size and count, the input a column slice of a wider projection (as MAC's stacked one), a
    random cache, widths 4 (the recipes'), 1 (no left context) and 3, lengths across the backward's overlapping
    32-row tiles and one shorter than the cache; every element written; the next cache exactly the last rows of the
    cache and the input. The gradients of the input, cache, weight and bias against float64 autograd, with q/k/v
    and the next cache in the loss, q/k/v alone and the next cache alone: one backward operator and no
    convolution, stack or zero-filled slice gradient."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, H, hd = 2, 3, 5
    C = 3 * H * hd
    wide = (2 * torch.randn(B, T, C + 7, generator=gen)).to(DEVICE, dtype).requires_grad_(True)
    x = wide[..., 7:]
    cache = (2 * torch.randn(B, width - 1, C, generator=gen)).to(DEVICE, dtype).requires_grad_(True)
    weight = (torch.randn(C, 1, width, generator=gen) / width ** 0.5).to(DEVICE, dtype).requires_grad_(True)
    bias = (0.3 * torch.randn(C, generator=gen)).to(DEVICE, dtype).requires_grad_(True)
    q, k, v, new_cache = poisoned_prologue.conv_qkv_heads(x, cache, weight, bias, H, False, dtype)
    assert new_cache.is_contiguous() and torch.equal(new_cache, torch.cat([cache, x], 1)[:, T:].detach())
    ins64 = [t.detach().double().requires_grad_(True) for t in (x, cache, weight, bias)]

    def torch_form(x, cache, weight, bias, rounded):
        pre = F.conv1d(torch.cat([cache, x], 1).transpose(1, 2), weight, bias, groups=C).transpose(1, 2)
        a = F.silu(pre.to(dtype)).double() if rounded else F.silu(pre)  # F.conv1d's and F.silu's roundings
        a = a.view(B, T, 3, H, hd)
        return torch.cat([F.normalize(a[:, :, :2], dim=-1), a[:, :, 2:]], 2).permute(2, 0, 3, 1, 4)

    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    with torch.no_grad():
        ref = torch_form(*ins64, rounded=True)
    for got, want in zip((q, k, v), ref):
        assert got.dtype == dtype and got.shape == (B, H, T, hd) and got.is_contiguous()
        assert torch.isfinite(got).all() and _rel(got, want) < tol, _rel(got, want)
    cot = torch.randn(3, B, H, T, hd, generator=gen).to(DEVICE)
    cot_cache = torch.randn(new_cache.shape, generator=gen).to(DEVICE)
    for used in (("qkv", "cache"), ("qkv",), ("cache",)):
        loss = sum(((o.float() * c).sum() for o, c in zip((q, k, v), cot)) if "qkv" in used else ())
        if "cache" in used:
            loss = loss + (new_cache.float() * cot_cache).sum()
        with op_names() as ops:
            grads = torch.autograd.grad(loss, (x, cache, weight, bias), retain_graph=True)
        assert ops.names.count("titans_conv_qkv_heads_bwd") == 1, ops.names
        assert not [n for n in ops.names if "conv" in n and "titans" not in n or n in ("stack", "slice_backward")]
        loss64 = sum(((torch_form(*ins64, rounded=False) * cot.double()).sum(),) if "qkv" in used else ())
        if "cache" in used:
            loss64 = loss64 + (torch.cat(ins64[1::-1], 1)[:, T:] * cot_cache.double()).sum()
        refs = torch.autograd.grad(loss64, ins64, allow_unused=True, materialize_grads=True)
        for name, g, want, inp in zip(("x", "cache", "weight", "bias"), grads, refs, (x, cache, weight, bias)):
            assert g.dtype == dtype and g.shape == inp.shape and torch.isfinite(g).all(), (used, name)
            if want.count_nonzero():
                assert _rel(g, want) < tol, (used, name, _rel(g, want))
            else:  # the next cache alone: no gradient reaches the weight and bias
                assert not g.count_nonzero(), (used, name)


@pytest.mark.parametrize("dtype, width, T, segment", [(torch.float16, 4, 45, 16), (torch.float32, 4, 37, 37),
                                                      (torch.float32, 4, 23, 3), (torch.bfloat16, 3, 70, 32),
                                                      (torch.float32, 1, 19, 4)])
def test_kernel_prologue_conv_queries_match_torch(poisoned_prologue, dtype, width, T, segment, op_names):
    """MAC's retrieval queries with the convolution fused (``conv_queries``) against ``segment_queries``' PyTorch
    form in float64: the convolution restarting with zero left context every ``segment`` rows (segments across the
    backward's overlapping tiles, shorter than the width, the last one short, one segment), rounded to ``dtype``,
    then SiLU and L2 norm per head, float32 out; the input a column slice; every element written; the gradients of
    the input, weight and bias against float64 autograd, one backward operator and no convolution."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, H, hd = 2, 3, 5
    C = H * hd
    wide = (2 * torch.randn(B, T, C + 4, generator=gen)).to(DEVICE, dtype).requires_grad_(True)
    x = wide[..., 4:]
    weight = (torch.randn(C, 1, width, generator=gen) / width ** 0.5).to(DEVICE, dtype).requires_grad_(True)
    bias = (0.3 * torch.randn(C, generator=gen)).to(DEVICE, dtype).requires_grad_(True)
    q = poisoned_prologue.conv_queries(x, weight, bias, H, segment, torch.float32)
    ins64 = [t.detach().double().requires_grad_(True) for t in (x, weight, bias)]

    def torch_form(x, weight, bias, rounded):  # NeuralMemory.segment_queries
        n = -(-T // segment)
        xp = F.pad(F.pad(x, (0, 0, 0, n * segment - T)).reshape(B * n, segment, C), (0, 0, width - 1, 0))
        pre = F.conv1d(xp.transpose(1, 2), weight, bias, groups=C).transpose(1, 2).reshape(B, n * segment, C)[:, :T]
        a = F.silu(pre.to(dtype)).double() if rounded else F.silu(pre)
        return F.normalize(a.view(B, T, H, hd), dim=-1).transpose(1, 2)

    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    with torch.no_grad():
        ref = torch_form(*ins64, rounded=True)
    assert q.dtype == torch.float32 and q.shape == (B, H, T, hd) and q.is_contiguous()
    assert torch.isfinite(q).all() and _rel(q, ref) < tol, _rel(q, ref)
    cot = torch.randn(B, H, T, hd, generator=gen).to(DEVICE)
    with op_names() as ops:
        grads = torch.autograd.grad((q * cot).sum(), (x, weight, bias))
    assert ops.names.count("titans_conv_queries_bwd") == 1, ops.names
    assert not [n for n in ops.names if "conv" in n and "titans" not in n], ops.names
    refs = torch.autograd.grad((torch_form(*ins64, rounded=False) * cot.double()).sum(), ins64)
    for name, g, want, inp in zip(("x", "weight", "bias"), grads, refs, (x, weight, bias)):
        assert g.dtype == dtype and g.shape == inp.shape and torch.isfinite(g).all(), name
        assert _rel(g, want) < tol, (name, _rel(g, want))


def test_kernel_prologue_conv_qkv_heads_refuses_a_cache_that_does_not_fit():
    """One clear error for a cache whose rows are not the convolution's width - 1, or a width the kernels do not
    take."""
    from memtrain.kernels.titans import prologue

    x = torch.randn(1, 5, 9, device=DEVICE)
    with pytest.raises(ValueError, match="the cache has 2 rows; a width-4 convolution needs 3"):
        prologue.conv_qkv_heads(x, x[:, :2], torch.randn(9, 1, 4), torch.randn(9), 1, False, torch.float32)
    with pytest.raises(ValueError, match="a width-17 convolution; the kernels take widths 1 to 16"):
        prologue.conv_qkv_heads(x, torch.zeros(1, 16, 9), torch.randn(9, 1, 17), torch.randn(9), 1, False,
                                torch.float32)


def test_kernel_prologue_custom_operators_pass_opcheck():
    """The prologue's two custom operators without the convolution: schemas, fake implementations, autograd
    registration, AOTAutograd against eager (``torch.library.opcheck``), with the convolution's transposed
    strides."""
    from memtrain.kernels.titans import prologue

    x = torch.randn(2, 30, 9, device=DEVICE).transpose(1, 2).requires_grad_(True)  # [2, 9, 30]: 3 heads of 3
    torch.library.opcheck(prologue._qkv_fwd.op, (x.transpose(1, 2), 3, False, torch.float32))
    g = torch.randn(2, 19, 12, device=DEVICE, requires_grad=True)
    torch.library.opcheck(prologue._gates_fwd.op, (g, 4, 0.01, math.log(0.9)))


def test_kernel_prologue_conv_custom_operators_pass_opcheck():
    """The convolution's two custom operators (q/k/v after the cache; the retrieval queries in segments of 7):
    ``torch.library.opcheck`` with a column-sliced input."""
    from memtrain.kernels.titans import prologue

    x = torch.randn(2, 19, 16, device=DEVICE)[..., 1:].requires_grad_(True)  # a column slice: 5 heads of 3
    cache, weight, bias = (torch.randn(*shape, device=DEVICE, requires_grad=True) for shape in ((2, 3, 15),
                                                                                                (15, 1, 4), (15,)))
    torch.library.opcheck(prologue._conv_qkv_fwd.op, (x, cache, weight, bias, 5, True, torch.float32))
    torch.library.opcheck(prologue._conv_queries_fwd.op, (x, weight, bias, 5, 7, torch.float32))


# -- the memory layer's output stage (memtrain.kernels.titans.output) --------------------------------------------


@pytest.fixture
def poisoned_output(poison_empty):
    from memtrain.kernels.titans import output

    return poison_empty(output)


def _gated_output_torch(y, w, gate):
    """NeuralMemory.gated_output's PyTorch form up to the projection."""
    n = F.rms_norm(y.transpose(1, 2), (y.shape[-1],)) * w.to(y.dtype)
    return n.flatten(2).to(gate.dtype) * gate


@pytest.mark.parametrize("y_dtype,gate_dtype,w_dtype", [
    (torch.float32, torch.float32, torch.float32), (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("hd", [5, 17])
def test_kernel_output_gated_norm_matches_torch(poisoned_output, y_dtype, gate_dtype, w_dtype, hd):
    """The fused output stage (per-head RMSNorm, gain, cast, gate) against PyTorch's form in the same dtypes (to one
    rounding of the output dtype) and float64 (within it), odd head size and count, a length across the 32-token
    blocks, retrievals in MAC's transposed layout and a gate sliced from a longer one; the gradients of the
    retrievals, the gain and the gate against float64 autograd within the dtypes' rounding; every element of every
    output (the gain's per-program partial sums included) written."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, H, T = 2, 3, 37
    y = (3 * torch.randn(B, T, H, hd, generator=gen)).to(DEVICE, y_dtype).transpose(1, 2)
    y[0, 1, 2] *= 1e-4  # a row whose RMS is near the epsilon: where its value shows
    y.requires_grad_(True)
    w = (1 + 0.5 * torch.randn(H, hd, generator=gen)).to(DEVICE, w_dtype).requires_grad_(True)
    gate_full = torch.sigmoid(torch.randn(B, T + 5, H * hd, generator=gen)).to(DEVICE, gate_dtype)
    gate = gate_full[:, 5:].requires_grad_(True)
    z = poisoned_output.gated_norm(y, w, gate)
    assert z.dtype == gate_dtype and z.shape == (B, T, H * hd) and z.is_contiguous() and torch.isfinite(z).all()
    eps_out = torch.finfo(gate_dtype).eps
    ulps = 2 if y_dtype == torch.float32 else 4  # roundings to the output dtype: two, or three with a bf16 norm
    torch.testing.assert_close(z, _gated_output_torch(y.detach(), w.detach(), gate.detach()), rtol=ulps * eps_out,
                               atol=ulps * eps_out)
    y64, w64, g64 = (t.detach().double().requires_grad_(True) for t in (y, w, gate))
    eps = torch.finfo(torch.float32).eps  # F.rms_norm's default for float32 and half-precision inputs alike
    z64 = (F.rms_norm(y64.transpose(1, 2), (hd,), eps=eps) * w64).flatten(2) * g64
    tol = 4 * max(eps_out, torch.finfo(y_dtype).eps)  # three roundings at most, element by element
    torch.testing.assert_close(z.double(), z64.detach(), rtol=tol, atol=tol)
    dz = torch.randn(B, H * hd, T, generator=gen).to(DEVICE, gate_dtype).transpose(1, 2)  # strided, as any
    grads = torch.autograd.grad(z, (y, w, gate), dz)
    refs = torch.autograd.grad(z64, (y64, w64, g64), dz.double())
    for name, got, want, t in zip("ywg", grads, refs, (y, w, gate)):
        assert got.dtype == t.dtype and got.shape == t.shape and torch.isfinite(got).all(), name
        # float32 sums over the tokens (the gain's) and the head (the norm's): 1e-5 at float32
        assert _rel(got, want) < max(tol, 1e-5), (name, _rel(got, want))


def test_kernel_output_custom_operators_pass_opcheck():
    """The output stage's custom operator and its backward: schemas, fake implementations, autograd registration,
    AOTAutograd against eager (``torch.library.opcheck``), with strided retrievals and gate; shapes that do not
    fit are one error."""
    from memtrain.kernels.titans import output

    y = torch.randn(2, 9, 3, 6, device=DEVICE).transpose(1, 2).requires_grad_(True)
    w = torch.randn(3, 6, device=DEVICE, requires_grad=True)
    g = torch.rand(2, 12, 18, device=DEVICE)[:, 3:].requires_grad_(True)
    torch.library.opcheck(output._out_fwd.op, (y, w, g, 1e-6))
    with pytest.raises(ValueError, match="do not match"):
        output.gated_norm(y, w[:, :5], g)


# -- MAC's retrieval (memtrain.kernels.titans.read) ---------------------------------------------------------------


@pytest.fixture
def poisoned_read(poison_empty):
    from memtrain.kernels.titans import read

    return poison_empty(read)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("weights", ["per-sequence", "broadcast", "expanded"])
def test_kernel_read_matches_reference(poisoned_read, depth, weights):
    """The fused retrieval ``M(q)`` against the PyTorch form (``reference.mlp_forward``) in float64: odd head size and
    hidden width, lengths across two 64-token blocks and shorter than one, queries in MAC's transposed layout, weights
    per sequence (a state's), broadcast over the batch (the initial weights) or expanded to it (``init_state``'s); the
    output and the gradients of the queries and every weight within 1e-4 with float32 products, within float16's
    rounding with float16 operands (``dot`` 2; bfloat16's ``dot`` 1 is the same code, but Triton's interpreter
    computes bfloat16 products wrong, so it is checked compiled only). Every buffer the kernels write starts as NaN."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, H, D, hidden = 3, 2, 11, 19
    sizes = [D] + [hidden] * (depth - 1) + [D]
    for T in (77, 5):
        q64 = F.normalize(torch.randn(B, T, H, D, generator=gen, dtype=torch.float64), dim=-1).to(DEVICE)
        q64 = q64.transpose(1, 2).requires_grad_(True)
        leaves = [(torch.randn(B if weights == "per-sequence" else 1, H, o, i, generator=gen, dtype=torch.float64)
                   / i ** 0.5).to(DEVICE).requires_grad_(True) for i, o in zip(sizes[:-1], sizes[1:])]
        dy = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64).to(DEVICE)

        def run(dtype, fn):
            q = q64.detach().to(dtype).requires_grad_(True)
            ws = [w.detach().to(dtype).requires_grad_(True) for w in leaves]
            used = [w.expand(B, *w.shape[1:]) if weights == "expanded" else w for w in ws]
            y = fn(used, q)
            return y, torch.autograd.grad(y, [q, *ws], dy.to(y.dtype))

        y64, g64 = run(torch.float64, reference.mlp_forward)
        for dot, tol in ((0, 1e-4), (2, 1e-2), *([(1, 3e-2)] if DEVICE.type == "cuda" else [])):
            y, grads = run(torch.float32, lambda ws, q: poisoned_read.read(ws, q, dot))
            assert y.dtype == torch.float32 and y.shape == (B, H, T, D) and torch.isfinite(y).all()
            assert _rel(y, y64) < tol, (T, dot, _rel(y, y64))
            for name, got, want in zip(["q", *(f"w{i}" for i in range(depth))], grads, g64):
                assert got.shape == want.shape and got.dtype == torch.float32 and torch.isfinite(got).all(), name
                assert _rel(got, want) < tol, (T, dot, name, _rel(got, want))


def test_kernel_read_custom_operators_pass_opcheck():
    """The retrieval's custom operator and its backward, depth 1 and 2: schemas, fake implementations, autograd
    registration, AOTAutograd against eager (``torch.library.opcheck``), with transposed queries and broadcast
    weights; weights that do not fit the queries are one error."""
    from memtrain.kernels.titans import read

    q = torch.randn(2, 9, 3, 6, device=DEVICE).transpose(1, 2).requires_grad_(True)
    w1 = torch.randn(1, 3, 10, 6, device=DEVICE, requires_grad=True)
    w2 = torch.randn(2, 3, 6, 10, device=DEVICE, requires_grad=True)
    torch.library.opcheck(read._read_fwd.op, (q, w1, w2, 2, 0))
    w = torch.randn(2, 3, 6, 6, device=DEVICE, requires_grad=True)
    torch.library.opcheck(read._read_fwd.op, (q, w, w, 1, 0))
    with pytest.raises(ValueError, match="do not match"):
        read.read([w1[:, :2], w2], q)
    with pytest.raises(ValueError, match="depth 1 or 2"):
        read.read([w1, w2, w1], q)
    with pytest.raises(ValueError, match="float32 queries and weights"):
        read.read([w1, w2], q.double())


def test_kernel_mac_reads_its_memory_with_the_fused_read_in_half_precision(monkeypatch, tiny_titans_recipe):
    """A half-precision MAC model whose kernels run retrieves each segment with the fused read (one call per block and
    segment, float16 products as the scan's reads) and each block's retrieval queries with the fused convolution (one
    call per block), within float16's rounding of the PyTorch forms they replace: the loss and every parameter's
    gradient. ``MEMTRAIN_TITANS_FUSED_READ=0`` and ``MEMTRAIN_TITANS_FUSED_CONV=0`` turn them off; float32 models
    keep PyTorch's."""
    from memtrain.kernels.titans import prologue, read
    from memtrain.model import build

    r = tiny_titans_recipe()
    torch.manual_seed(torch.seed() % 2**31)
    model = build(r.model, r.memory).to(DEVICE)
    x = torch.randint(0, 40, (2, 19)).to(DEVICE)
    calls, queries = [], []
    monkeypatch.setattr(read, "read", lambda *a, _f=read.read: calls.append(a[2]) or _f(*a))
    monkeypatch.setattr(prologue, "conv_queries", lambda *a, _f=prologue.conv_queries: queries.append(a[4]) or _f(*a))

    def step(m):
        m.zero_grad()
        loss = F.cross_entropy(m(x).logits[:, :-1].float().reshape(-1, 40), x[:, 1:].reshape(-1))
        loss.backward()
        return float(loss.detach()), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}

    step(model)
    assert calls == queries == []  # float32 activations: PyTorch's read and queries
    half = model.half()
    fused = step(half)
    assert calls == [2] * (2 * 3)  # 2 blocks x 3 segments (8, 8, 3 tokens), float16 products
    assert queries == [8, 8]  # each block's segments' queries at once, the convolution fused (segments of 8)
    monkeypatch.setenv("MEMTRAIN_TITANS_FUSED_READ", "0")
    monkeypatch.setenv("MEMTRAIN_TITANS_FUSED_CONV", "0")
    plain = step(half)
    assert len(calls) == 6 and len(queries) == 2 and fused[0] == pytest.approx(plain[0], rel=1e-2)
    assert fused[1].keys() == plain[1].keys()
    # float16 rounding: all gradients together within 1e-2, each parameter's within 1e-1 of its largest entry. The fused
    # read rounds the weights to float16 for its products where PyTorch's multiplies float32. Over 24 seeds the largest
    # per-parameter difference was 0.5-5.2% (median 1.0%); at seeds 1 and 11 (3.1%, 5.2%) it was the second block's
    # gate bias, 6 sums over 38 tokens that cancel, and all gradients together differed by 0.18% and 0.20%. A read
    # that returns zeros or another token's retrieval fails both bounds.
    names = sorted(plain[1])
    together = [torch.cat([grads[1][n].flatten() for n in names]) for grads in (fused, plain)]
    assert _rel(*together) < 1e-2, _rel(*together)
    for name, g in plain[1].items():
        assert _rel(fused[1][name], g) < 1e-1, (name, _rel(fused[1][name], g))


def _unspecialised(kernel) -> set:
    """The argument names a ``@triton.jit`` kernel leaves unspecialised (compiled, or under the interpreter)."""
    if hasattr(kernel, "params"):
        return {p.name for p in kernel.params if p.do_not_specialize}
    return set(kernel.kwargs["do_not_specialize"] or ())


@pytest.mark.parametrize("split", [False, True])
def test_kernel_lengths_share_one_compiled_binary(monkeypatch, split):
    """Triton compiles one binary per specialisation of a kernel's integer arguments (equal to 1, divisible by
    16) and per constexpr value. Calls of a model differ in length (a MAC segment, a whole MAG sequence, a
    benchmark's warm-up), so every argument that changes with the length must be left unspecialised and every
    constexpr must not change with it; else each new length costs another 10-30 s compile of each kernel (the
    layer benchmark ran out of time on an H200 recompiling). Launches are recorded, not run. ``split``: the
    split backward's three kernels and the split forward's two (launched per recompute group) in place of
    ``_bwd_kernel`` and ``_fwd_kernel``."""
    import inspect

    from memtrain.kernels.titans import triton_deep

    monkeypatch.setattr(triton_kernels, "SPLIT_BACKWARD", split)
    monkeypatch.setattr(triton_kernels, "SPLIT_FORWARD", split)
    monkeypatch.delenv(titans_kernels.BACKWARD_ENV, raising=False)
    monkeypatch.delenv(titans_kernels.FORWARD_ENV, raising=False)
    monkeypatch.setattr(triton_kernels, "SCRATCH_BYTES", 0)  # several recompute groups per call
    calls: dict = {}

    class Record:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.setdefault(self.name, []).append((args, kwargs))
            return launch

    backward = ["_bwd_recompute_kernel", "_bwd_local_kernel", "_bwd_carry_kernel"] if split else ["_bwd_kernel"]
    backward += ["_fwd_advance_kernel", "_fwd_read_kernel"] if split else ["_fwd_kernel"]  # with the forward's
    kernels = {*((triton_kernels, name) for name in backward),
               (triton_deep, "_fwd_deep_kernel"), (triton_deep, "_bwd_deep_kernel")}
    unspecialised = {name: _unspecialised(getattr(mod, name)) for mod, name in kernels}
    arg_names = {name: list(inspect.signature(getattr(mod, name).fn).parameters) for mod, name in kernels}
    for mod, name in kernels:
        monkeypatch.setattr(mod, name, Record(name))
    gen = torch.Generator().manual_seed(0)
    C, D, hidden = 16, 8, 16
    for depth in (2, 3):
        for T in (3 * C, 3 * C + 5, 16 * C, 17 * C - 1, 1):  # NC 3, 4, 16, 17, 1; last chunk full or not
            q, k, v, lr, log_eta, log_keep, *state = _inputs(gen, 2, T, D, hidden, depth, torch.float32)
            q.requires_grad_(True)
            y, *_ = titans_kernels.scan(q, k, v, lr, log_eta, log_keep, state[:depth], state[depth:],
                                        state[:depth], 0, C, kernel="triton")
            y.sum().backward()
    assert set(calls) == {name for _, name in kernels}
    for name, launches in calls.items():
        assert len(launches) == 5 or split and name in backward and len(launches) > 5, name  # split: per group
        first_args, first_kwargs = launches[0]
        positional = [n for n in arg_names[name] if n not in first_kwargs]
        varying = {positional[i] for i, a in enumerate(first_args)
                   if isinstance(a, int) and any(args[i] != a for args, _ in launches[1:])}
        assert {"NC", "N_LAST"} <= varying, (name, varying)  # the lengths above do vary them
        assert varying <= unspecialised[name], (name, varying - unspecialised[name])
        assert all(kw == first_kwargs for _, kw in launches[1:]), name  # constexprs and launch options
        assert not {"C", "D"} & unspecialised[name], name  # widths stay specialised (aligned loads)


def test_kernel_dispatch():
    q = torch.zeros(1, 4, 8, device=DEVICE)
    assert titans_kernels.use_triton("auto", q.bfloat16(), 2) == q.is_cuda  # CPU tensors: the PyTorch form
    assert not titans_kernels.use_triton("auto", q, 2)  # float32 and float64 stay in PyTorch under auto
    assert not titans_kernels.use_triton("auto", q.double(), 2)
    assert not titans_kernels.use_triton("torch", q, 2)
    assert titans_kernels.use_triton("triton", q, 2)  # compiled on CUDA; TRITON_INTERPRET=1 on CPU
    assert titans_kernels.use_triton("triton", q, 4)  # the any-depth kernels
    assert titans_kernels.use_triton("auto", q.bfloat16(), 3) == q.is_cuda
    with pytest.raises(ValueError, match="chunked algorithm, got algorithm 'sequential'"):
        titans_kernels.use_triton("triton", q, 2, algorithm="sequential")
    with pytest.raises(ValueError, match="must be one of"):
        titans_kernels.use_triton("cuda", q, 2)
    with pytest.raises(ValueError, match="unknown kernel"):
        NeuralMemory(16, heads=2, kernel="fast")


@pytest.mark.parametrize("variant", ["mac", "mag"])
def test_kernel_in_the_titans_model_equals_the_torch_path(variant, tiny_titans_recipe):
    """``model.titans.kernel`` triton vs torch in a whole Titans LM: the same loss and every parameter's gradient."""
    from memtrain.model import build

    def model(kernel: str):
        r = tiny_titans_recipe(variant, window=8, kernel=kernel)
        torch.manual_seed(0)
        return build(r.model, r.memory).to(DEVICE)

    x = torch.randint(0, 40, (2, 19), generator=torch.Generator().manual_seed(torch.seed() % 2**31)).to(DEVICE)
    results = []
    for kernel in ("triton", "torch"):
        m = model(kernel)
        out = m(x)
        loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, 40), x[:, 1:].reshape(-1))
        loss.backward()
        results.append((float(loss.detach()), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (loss_k, grads_k), (loss_t, grads_t) = results
    assert loss_k == pytest.approx(loss_t, rel=1e-6)
    assert grads_k.keys() == grads_t.keys() and any("init_weights" in n for n in grads_k)
    for name in grads_t:
        torch.testing.assert_close(grads_k[name], grads_t[name], rtol=1e-4, atol=1e-6, msg=name)


def test_kernel_recipe_key_forcing_triton_where_it_cannot_run_is_one_recipe_error(monkeypatch):
    from memtrain.config import recipe_from_dict
    from memtrain.errors import MemtrainError
    from memtrain.launcher.train import check_kernels

    def recipe(**titans):
        return recipe_from_dict({"model": {"type": "titans", "titans": {"kernel": "triton", **titans}}})

    with pytest.raises(MemtrainError, match="model.titans.kernel: .*up to 128 at depth 3.*depth 3, head size 64, "
                                            "hidden 256.*kernel: auto"):
        check_kernels(recipe(memory_depth=3, memory_head_dim=64, expansion=4.0), torch.device("cpu"))
    check_kernels(recipe(memory_depth=2), DEVICE)  # compiled on CUDA, interpreted on CPU
    check_kernels(recipe(memory_depth=4, memory_head_dim=64), DEVICE)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(MemtrainError, match="model.titans.kernel: .*TRITON_INTERPRET=1.*kernel: auto"):
        check_kernels(recipe(), torch.device("cpu"))
    with pytest.raises(MemtrainError, match="model.titans.kernel: must be one of"):
        recipe_from_dict({"model": {"type": "titans", "titans": {"kernel": "cuda"}}})


@pytest.mark.gpu
@pytest.mark.parametrize("chunk,depth,form", [(16, 2, "shipped"), (16, 3, "shipped"), (16, 2, "split"),
                                              (16, 2, "pipelined")])
def test_kernel_at_recipe_shapes_on_gpu(monkeypatch, chunk, depth, form):
    """Compiled at the recipes' shapes (head size 64, hidden 128, depth 2, and depth 3 for the any-depth kernels,
    1000 tokens: a partial last chunk; at depth 2 also the split forward and backward, whose kernels hand their
    results to each other through memory, and the same with their loops software-pipelined, ``pipelined``):
    float32 inputs against float64 within 1e-4 (outputs, state, input gradients), and bf16 inputs (bf16 dot
    products) against float32 within bf16 rounding. Chunk 16 only: the IEEE float32 backward at chunk 64 takes
    over ten minutes to compile (bf16 at chunk 64 is covered by the benchmark's error column)."""
    for var, value in titans_kernels.form_env(form).items():
        monkeypatch.setenv(var, value)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ins = _inputs(gen, 3, 1000, 64, 128, depth)
    ins[3] = ins[3] * 0.1  # theta ~ 0.005, as the recipes' initialisation
    for x in ins:
        x.requires_grad_(True)
    ref = _run("reference", ins, depth, 0, chunk)
    out = _run("kernel", ins, depth, 0, chunk)
    for a, b in zip(out, ref):
        assert _rel(a, b) < 1e-4
    g_ref = torch.autograd.grad(ref[0].square().sum() + ref[1].sum(), ins)
    g_out = torch.autograd.grad(out[0].double().square().sum() + out[1].double().sum(), ins)
    for a, b in zip(g_out, g_ref):
        assert _rel(a, b) < 1e-4
    q, k, v, lr, log_eta, log_keep, *state = (x.detach().float() for x in ins)
    w, s = state[:depth], state[depth:]
    y32 = titans_kernels.scan(q, k, v, lr, log_eta, log_keep, w, s, w, 0, chunk, kernel="triton")[0]
    half = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    y16 = titans_kernels.scan(q.to(half), k.to(half), v.to(half), lr, log_eta, log_keep, w, s, w, 0, chunk,
                              kernel="triton")[0]
    assert _rel(y16, y32) < 3e-2
    # the bf16 backward (what training runs) against the float32 one, within bf16 rounding
    grads = []
    for dt in (torch.float32, half):
        qkv = [x.to(dt).requires_grad_(True) for x in (q, k, v)]
        y = titans_kernels.scan(*qkv, lr, log_eta, log_keep, w, s, w, 0, chunk, kernel="triton")[0]
        grads.append(torch.autograd.grad(y.float().square().sum(), qkv))
    for a, b in zip(grads[1], grads[0]):
        assert torch.isfinite(a).all() and _rel(a, b) < 3e-2, _rel(a, b)


def test_kernel_refuses_memories_too_wide_for_its_tiles():
    """MemoryLlama-sized heads (one 2048-wide head) stay in PyTorch under ``auto``; ``triton`` says why. Depth
    1-2 takes head size x hidden up to 128 x 256, depth 3+ both up to 128."""
    q = torch.zeros(1, 4, 8, device=DEVICE)
    assert not titans_kernels.use_triton("auto", q, 2, head_dim=2048, hidden=4096)
    assert titans_kernels.kernel_fits(128, 256) and not titans_kernels.kernel_fits(256, 256)
    assert titans_kernels.kernel_fits(128, 128, depth=3) and titans_kernels.kernel_fits(100, 65, depth=4)
    assert not titans_kernels.kernel_fits(64, 256, depth=3) and not titans_kernels.kernel_fits(129, 64, depth=3)
    with pytest.raises(ValueError, match="head size 2048, hidden 4096"):
        titans_kernels.use_triton("triton", q, 2, head_dim=2048, hidden=4096)
    with pytest.raises(ValueError, match="kernel 'triton': .* up to 32768 at depth 1-2, got depth 2, head size 256"):
        NeuralMemory(512, heads=2, kernel="triton")
    with pytest.raises(ValueError, match="kernel 'triton': .* up to 128 at depth 3\\+, got depth 3, head size 64, "
                                         "hidden 256"):
        NeuralMemory(128, heads=2, depth=3, expansion=4.0, kernel="triton")


_AOT = r"""
import json, multiprocessing
from memtrain.kernels.titans.aot import compile_kernel


def compile_one(spec):
    kernel, depth, C, *stages = spec
    return compile_kernel(kernel, depth, head_dim=64, hidden=128, chunk=C, stages=stages[0] if stages else 1)


# The backward kernels first (ptxas takes 10-30 s each, the forwards a few): two at a time on two cores. The scans at
# chunk 64 only: a kernel's tiles grow with the chunk, and so does its shared memory (docs/titans-kernels.md: 61 / 139
# KB for the depth-2 backward at chunk 16 / 64, 2.1 / 33 KB and 3.1 / 49 KB for the coefficients'); the coefficients (a
# second each) also at the recipes' 16; the split backward's three kernels (SPLIT_BACKWARD) and the split forward's
# two next; last the split loops pipelined as MEMTRAIN_TITANS_STAGES=3 gives them where they fit (the carried loop in
# 2 stages at chunk 16, the recompute loop in 3 at chunk 64).
specs = [("bwd", 2, 64), ("bwd", 4, 64), ("fwd", 2, 64), ("fwd", 4, 64), ("coef_bwd", 0, 64), ("coef_fwd", 0, 64),
         ("coef_bwd", 0, 16), ("coef_fwd", 0, 16), ("bwd_local", 2, 64), ("bwd_carry", 2, 64),
         ("bwd_recompute", 2, 64), ("fwd_advance", 2, 64), ("fwd_read", 2, 64), ("bwd_carry", 2, 16, 3),
         ("bwd_recompute", 2, 64, 3)]
with multiprocessing.get_context("fork").Pool(2) as pool:
    print(json.dumps(pool.map(compile_one, specs, chunksize=1)))
"""


def test_kernel_compiles_for_an_h100_within_its_shared_memory():
    """Compiled ahead of time for sm_90 (no GPU needed: Triton's own ptxas), the kernels at the recipes' shapes
    (head size 64, hidden 128, bf16, chunk 64, the largest; depth 2 -- the split backward's three kernels and the
    split forward's two too --, and depth 4 for the any-depth kernels, and the coefficients') fit an H100's 227 KB
    of shared memory per block. With Triton's default software pipelining
    the depth-2 backward needed 337-438 KB and would not launch; the split loops pipelined where
    ``MEMTRAIN_TITANS_STAGES`` asks for it fit an A100's 163 KiB. :func:`memtrain.kernels.titans.aot.compile_kernel`
    also reads ptxas's registers and spills (``benchmarks/titans_kernels.py --static`` tabulates them): the
    coefficients' kernels spill nothing."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = json.loads(run.stdout.strip().splitlines()[-1])
    assert [(r["kernel"], r["any_depth"], r["chunk"]) for r in compiled] == [
        ("bwd", False, 64), ("bwd", True, 64), ("fwd", False, 64), ("fwd", True, 64), ("coef_bwd", None, 64),
        ("coef_fwd", None, 64), ("coef_bwd", None, 16), ("coef_fwd", None, 16), ("bwd_local", False, 64),
        ("bwd_carry", False, 64), ("bwd_recompute", False, 64), ("fwd_advance", False, 64), ("fwd_read", False, 64),
        ("bwd_carry", False, 16), ("bwd_recompute", False, 64)]
    compiled, pipelined = compiled[:13], compiled[13:]
    for r in compiled:
        assert r["shared"] <= 232448, r
        assert 0 < r["registers"] <= 255 and r["spill_stores"] >= 0 and r["spill_loads"] >= 0, r
    # ptxas's figures (read by memtrain.kernels.titans.aot): the coefficients' kernels at the recipes' chunk of 16
    # spill nothing; at chunk 64 their launch (16 warps) keeps the backward's spills to about 1 KB per thread, where
    # 4 warps spilled 24.9 KB (the scan kernels spill at these widths; docs/titans-kernels.md, "Registers and spills")
    assert [r["spill_stores"] for r in compiled[6:8]] == [0, 0], compiled[6:8]
    assert [r["num_warps"] for r in compiled[4:6]] == [16, 16] and compiled[4]["spill_stores"] <= 2048, compiled[4:6]
    # the compiled code's innermost loops (aot.sass_loops): the depth-2 forward loops over chunks once, the backward
    # twice (recomputing a group's chunk-start states, then the chunks in reverse), and their spills run there, per
    # chunk; the coefficients' kernels (one chunk per program) have no loop
    bwd, fwd = compiled[0]["loops"], compiled[2]["loops"]
    assert len(bwd) == 2 and len(fwd) == 1, (bwd, fwd)
    for loop in bwd + fwd:
        assert 0 < loop["local_loads"] + loop["local_stores"] < loop["instructions"], loop
        assert 4 * (loop["local_loads"] + loop["local_stores"]) <= loop["local_bytes"], loop
        assert loop["local_kib_per_program"] == round(loop["local_bytes"] * 32 * 8 / 1024, 1), loop  # 8 warps
        assert loop["mma"] > 0 and loop["shared"] > 0, loop
    assert compiled[6]["loops"] == [] and compiled[7]["loops"] == []
    # the stack frame the spills live in (cuobjdump -res-usage, aot.cubin_frame): none without spills, and per
    # program the frame times the threads (the depth-2 backward's: about 2.3 MB per program at chunk 64, more than
    # an SM's L1 holds)
    assert [r["stack_frame"] for r in compiled[6:8]] == [0, 0], compiled[6:8]
    for r in compiled[:2] + compiled[8:]:
        assert r["frame_kib_per_program"] == round(r["stack_frame"] * 32 * r["num_warps"] / 1024, 1), r
    assert all(r["stack_frame"] >= 4 * 255 for r in compiled[:2] + compiled[8:11]), compiled  # the backwards spill
    # the split backward: the chunk-local kernel (one chunk per program) has no loop, its whole program is counted;
    # the carried part and the recompute loop over a group's chunks once each
    local, carry, recompute, advance, read = compiled[8:]
    assert local["loops"] == [] and local["program"]["mma"] > 0 and local["program"]["instructions"] > 0, local
    assert len(carry["loops"]) == 1 and len(recompute["loops"]) == 1, (carry["loops"], recompute["loops"])
    # the split forward: the recurrence loops over a group's chunks, the reads (one chunk per program) do not
    assert len(advance["loops"]) == 1 and read["loops"] == [] and read["program"]["mma"] > 0, (advance, read)
    # pipelined (MEMTRAIN_TITANS_STAGES=3, triton_kernels.loop_stages): the carried loop in 2 stages at chunk 16 and
    # the recompute loop in 3 at chunk 64, each within an A100's 163 KiB per block (and so an H100's), with more shared
    # memory than unpipelined (the next chunk's tiles' buffers: 66 against 32 KiB for the recompute loop, Triton 3.6)
    assert [r["num_stages"] for r in compiled[:4] + compiled[8:]] == [1] * 9, compiled  # the scan kernels
    assert [r["num_stages"] for r in pipelined] == [2, 3], pipelined
    for r in pipelined:
        assert r["shared"] <= 166912 and len(r["loops"]) == 1 and r["loops"][0]["mma"] > 0, r
    assert pipelined[1]["shared"] > recompute["shared"], (pipelined[1], recompute)


_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDL.LU R4, [R1+0x10] ;
.L_x_1:
        /*0020*/                   FFMA R4, R4, R4, R2 ;
        /*0030*/                   STL.128 [R1+0x20], R8 ;
        /*0038*/                   LDSM.16.M88.4 R12, [R3] ;
        /*003c*/                   HMMA.16816.F32.BF16 R16, R12, R8, R16 ;
        /*0040*/              @!P0 BRA `(.L_x_1) ;
        /*0050*/                   LDL R5, [R1+0x30] ;
        /*0060*/               @P1 BRA `(.L_x_0) ;
.L_x_2:
        /*0070*/                   HFMA2.MMA R6, -RZ, RZ, 0, 0 ;
        /*0080*/                   STL [R1], R6 ;
        /*0088*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*008c*/                   STS [R3], R6 ;
        /*0090*/                   LDL.LU.64 R6, [R1+0x8] ;
        /*00a0*/                   BRA `(.L_x_2);
        /*00b0*/              @!P2 BRA `(.L_x_3) ;
.L_x_3:
        /*00c0*/                   EXIT ;
.L_x_4:
        /*00d0*/                   BRA `(.L_x_4);
"""


def test_kernel_sass_loops_counts_each_innermost_loops_local_memory():
    """:func:`memtrain.kernels.titans.aot.sass_loops` on SASS text as ``nvdisasm -c`` prints it: a back edge (to a
    label at or before the branch) closes a loop; the outer loop at 0x10-0x60 holds the loop at 0x20-0x40, so only
    that one and the loop at 0x70-0xa0 are innermost; a forward branch and the one-instruction trap at the end are
    not loops. ``LDL.LU``, ``STL.128`` (16 bytes), ``STL`` (4) and ``LDL.LU.64`` (8) are local-memory accesses;
    ``LDSM`` and ``STS`` shared-memory ones; ``HMMA`` runs on the tensor cores, ``HFMA2.MMA`` (a move) does not."""
    from memtrain.kernels.titans.aot import sass_loops, sass_program

    assert sass_loops(_SASS) == [
        {"instructions": 5, "local_loads": 0, "local_stores": 1, "local_bytes": 16, "shared": 1, "barriers": 0,
         "mma": 1},
        {"instructions": 6, "local_loads": 1, "local_stores": 1, "local_bytes": 12, "shared": 1, "barriers": 1,
         "mma": 0}]
    assert sass_loops("") == []
    # the whole kernel, each instruction once (the split backward's chunk-local kernel has no loop)
    assert sass_program(_SASS) == {"instructions": 18, "local_loads": 3, "local_stores": 2, "local_bytes": 36,
                                   "shared": 2, "barriers": 1, "mma": 1}


def test_kernel_stack_frame_is_read_from_cuobjdumps_resource_usage():
    """:func:`memtrain.kernels.titans.aot.stack_frame` on ``cuobjdump -res-usage`` as Triton's own cuobjdump prints
    it for a compiled kernel (here the split backward's recompute kernel at chunk 16, Triton 3.6, sm_90: 824 bytes per
    thread, as ptxas's ``bytes stack frame``)."""
    from memtrain.kernels.titans.aot import stack_frame

    report = ("\nResource usage:\n Common:\n  GLOBAL:0\n Function _bwd_recompute_kernel:\n"
              "  REG:255 STACK:824 SHARED:1024 LOCAL:0 CONSTANT[0]:712 TEXTURE:0 SURFACE:0 SAMPLER:0\n")
    assert stack_frame(report) == 824
    assert stack_frame(report.replace("STACK:824", "STACK:0")) == 0
    assert stack_frame("") is None


def test_kernel_prologue_compiles_for_an_h100_without_spills():
    """The prologue's kernels (q/k/v with and without the width-4 convolution, MAC's retrieval queries with it, its
    weight gradients' sum, the gates) and the output stage's two compiled ahead of time for sm_90 (bf16 at head size
    64, the gates of 12 heads, as the recipes): within an H100's shared memory, no register spilled (each program
    holds a 32-token tile; the backwards with the convolution launch 8 warps)."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json; from memtrain.kernels.titans.aot import compile_kernel; print(json.dumps([compile_kernel(k, "
            "head_dim=64, half='bf16') for k in ('qkv_fwd', 'qkv_bwd', 'conv_qkv_fwd', 'conv_qkv_bwd', "
            "'conv_queries_fwd', 'conv_queries_bwd', 'conv_grad', 'gates_fwd', 'gates_bwd', 'out_fwd', 'out_bwd')]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for r in json.loads(run.stdout.strip().splitlines()[-1]):
        assert r["shared"] <= 232448 and 0 < r["registers"] <= 255, r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
