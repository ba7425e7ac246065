"""memtrain's custom operators' eager path (memtrain.kernels.op): every operator, called eagerly, runs as an
``autograd.Function`` without the dispatcher and computes what the dispatcher's path computes, bit for bit; where
something traces (a dispatch mode, fake tensors, Dynamo) the call goes to the operator.

Run on CPU under ``TRITON_INTERPRET=1`` (conftest sets it), small odd shapes, fresh random inputs per test."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from memtrain.kernels import op as kernel_ops
from memtrain.kernels import rope
from memtrain.kernels import titans as titans_kernels
from memtrain.kernels.titans import output, prologue, read, triton_deep, triton_kernels  # noqa: F401 (registers)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _gen():
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _leaf(gen, *shape, grad=True, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE).requires_grad_(grad)


def _scan_case(depth):
    def case(gen):
        N, T, D, H, C = 2, 11, 5, 7, 4
        q, k = (F.normalize(torch.randn(N, T, D, generator=gen), dim=-1).to(DEVICE).requires_grad_(True)
                for _ in range(2))
        v = _leaf(gen, N, T, D)
        lr = (0.1 * torch.rand(N, T, generator=gen)).to(DEVICE).requires_grad_(True)
        log_eta = F.logsigmoid(torch.randn(N, T, generator=gen)).to(DEVICE).requires_grad_(True)
        log_keep = F.logsigmoid(torch.randn(N, T, generator=gen) + 3).to(DEVICE).requires_grad_(True)
        sizes = [D] + [H] * (depth - 1) + [D]
        w = [_leaf(gen, N, o, i, scale=i ** -0.5) for i, o in zip(sizes[:-1], sizes[1:])]
        s = [_leaf(gen, *x.shape, scale=0.1) for x in w]

        def run(q, k, v, lr, log_eta, log_keep, *state):
            ws, ss = list(state[:depth]), list(state[depth:])
            y, w_end, s_end, wg = titans_kernels.scan(q, k, v, lr, log_eta, log_keep, ws, ss, ws, 0, C,
                                                      kernel="triton")
            return [y, *w_end, *s_end, *wg]
        return run, [q, k, v, lr, log_eta, log_keep, *w, *s]
    return case


def _rope_case(gen):
    x = _leaf(gen, 2, 5, 3, 8)
    cos, sin = (_leaf(gen, 1, 5, 1, 8, grad=False) for _ in range(2))
    return (lambda x, cos, sin: [rope.rope(x.transpose(1, 2).transpose(1, 2), cos, sin)]), [x, cos, sin]


def _qkv_case(gen):
    x = _leaf(gen, 2, 30, 9)
    return (lambda x: list(prologue.qkv_heads(x.transpose(1, 2).transpose(1, 2), 3, True, torch.float32))), [x]


def _conv_qkv_case(gen):
    x = _leaf(gen, 2, 19, 16)
    cache, weight, bias = _leaf(gen, 2, 3, 15), _leaf(gen, 15, 1, 4), _leaf(gen, 15)
    return (lambda x, c, w, b: list(prologue.conv_qkv_heads(x[..., 1:], c, w, b, 5, True, torch.float32)),
            [x, cache, weight, bias])


def _conv_queries_case(gen):
    x, weight, bias = _leaf(gen, 2, 19, 15), _leaf(gen, 15, 1, 4), _leaf(gen, 15)
    return (lambda x, w, b: [prologue.conv_queries(x, w, b, 5, 7, torch.float32)]), [x, weight, bias]


def _gates_case(gen):
    g = _leaf(gen, 2, 19, 16)
    return (lambda g: list(prologue.gates(g[..., 1:13], 4, 0.01, 0.9))), [g]


def _gated_norm_case(gen):
    y, w, g = _leaf(gen, 2, 9, 3, 6), _leaf(gen, 3, 6), _leaf(gen, 2, 12, 18)
    return (lambda y, w, g: [output.gated_norm(y.transpose(1, 2), w, g[:, 3:])]), [y, w, g]


def _read_case(gen):
    q, w1, w2 = _leaf(gen, 2, 9, 3, 6), _leaf(gen, 1, 3, 10, 6), _leaf(gen, 2, 3, 6, 10)
    return (lambda q, w1, w2: [read.read([w1, w2], q.transpose(1, 2), 0)]), [q, w1, w2]


CASES = {  # each covers the operators it names (forward and backward)
    "scan depth 1": (_scan_case(1), ("titans_coef_fwd", "titans_coef_bwd", "titans_scan_fwd", "titans_scan_bwd")),
    "scan depth 2": (_scan_case(2), ("titans_coef_fwd", "titans_coef_bwd", "titans_scan_fwd", "titans_scan_bwd")),
    "scan depth 3": (_scan_case(3), ("titans_coef_fwd", "titans_coef_bwd", "titans_deep_fwd", "titans_deep_bwd")),
    "rope": (_rope_case, ("rope", "rope_bwd")),
    "qkv_heads": (_qkv_case, ("titans_qkv_heads", "titans_qkv_heads_bwd")),
    "conv_qkv_heads": (_conv_qkv_case, ("titans_conv_qkv_heads", "titans_conv_qkv_heads_bwd")),
    "conv_queries": (_conv_queries_case, ("titans_conv_queries", "titans_conv_queries_bwd")),
    "gates": (_gates_case, ("titans_gates", "titans_gates_bwd")),
    "gated_norm": (_gated_norm_case, ("titans_gated_norm", "titans_gated_norm_bwd")),
    "read": (_read_case, ("titans_read", "titans_read_bwd")),
}


@pytest.fixture
def dispatched(monkeypatch):
    """Counts, per operator, the calls that went through torch's dispatcher (``KernelOp.op``)."""
    counts: dict[str, int] = {}
    for name, kop in kernel_ops.OPS.items():
        def counted(*args, _op=kop.op, _name=name.split("::")[-1], **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _op(*args, **kwargs)
        monkeypatch.setattr(kop, "op", counted)
    return counts


def test_kernel_op_cases_cover_every_operator():
    """A new operator gets a case here, or this fails."""
    covered = {name for _, names in CASES.values() for name in names}
    assert {name.split("::")[-1] for name in kernel_ops.OPS} == covered


def _forward_backward(fn, leaves, gen_seed):
    outs = fn(*leaves)
    gen = torch.Generator().manual_seed(gen_seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
               for o in outs if o.numel())
    wanted = [x for x in leaves if x.requires_grad]
    return [o.detach() for o in outs], torch.autograd.grad(loss, wanted, allow_unused=True)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_op_eager_path_equals_the_dispatcher_bit_for_bit(case, dispatched, monkeypatch):
    """Eagerly every operator's forward and backward run without the dispatcher (no call reaches ``.op``), and
    outputs and every input's gradient equal, bit for bit, what the same call gives through the dispatcher
    (``MEMTRAIN_KERNEL_OPS=dispatch``: each operator called, forward and backward)."""
    make, names = CASES[case]
    fn, leaves = make(_gen())
    seed = torch.seed() % 2**31

    def fresh():
        return [x.detach().clone().requires_grad_(x.requires_grad) for x in leaves]

    monkeypatch.setenv(kernel_ops.DISPATCH_ENV, "dispatch")
    want_out, want_grads = _forward_backward(fn, fresh(), seed)
    assert set(dispatched) == set(names), dispatched
    dispatched.clear()
    monkeypatch.delenv(kernel_ops.DISPATCH_ENV)
    got_out, got_grads = _forward_backward(fn, fresh(), seed)
    assert dispatched == {}, dispatched
    assert len(got_out) == len(want_out)
    for a, b in zip(got_out, want_out):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    for a, b in zip(got_grads, want_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


class _Watch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_kernel_op_goes_through_the_dispatcher_where_something_traces(dispatched):
    """Under a dispatch mode (what fake tensors, AOTAutograd and benchmarks/op_count.py's counter are), with fake
    tensors, and without gradients, the call is routed as it must be: the operator under a mode or fake tensors
    (which see one node), the implementation itself without gradients (nothing to record)."""
    fn, leaves = _rope_case(_gen())
    with _Watch():
        fn(*leaves)[0].sum().backward()
    assert dispatched == {"rope": 1, "rope_bwd": 1}
    dispatched.clear()
    with torch.no_grad():
        fn(*leaves)
    assert dispatched == {}
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) for x in leaves]
        assert fn(*fake)[0].shape == leaves[0].shape
    assert dispatched == {"rope": 1}


def test_kernel_op_compiled_graph_holds_the_operator():
    """Dynamo traces the operator, not the eager Function: a compiled function calling RoPE holds one
    ``memtrain.rope`` node and gives the eager result."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn, leaves = _rope_case(_gen())
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    got = compiled(*leaves)[0]
    torch.testing.assert_close(got, fn(*leaves)[0], rtol=0, atol=0)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert targets.count("memtrain.rope.default") == 1, targets


def test_kernel_op_fills_defaults_and_routes_keyword_calls():
    """A call that leaves trailing defaulted arguments out gets them filled before its autograd set-up reads them
    (as the dispatcher fills them); a keyword call goes to the operator."""
    calls = []

    def impl(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return x * scale

    kop = kernel_ops.KernelOp("memtrain_test::scaled", impl)
    kop.register_fake(lambda x, scale=2.0: torch.empty_like(x))

    def setup(ctx, inputs, output):
        calls.append(inputs)
        ctx.scale = inputs[1]

    kop.register_autograd(lambda ctx, g: (g * ctx.scale, None), setup_context=setup)
    try:
        x = torch.randn(3, requires_grad=True)
        (g,) = torch.autograd.grad(kop(x).sum(), x)
        assert calls[-1][1] == 2.0 and torch.equal(g, torch.full((3,), 2.0))
        assert math.isclose(kop(x, scale=3.0).sum().item(), 3 * x.sum().item(), rel_tol=1e-6)
    finally:
        kernel_ops.OPS.pop("memtrain_test::scaled")


def test_kernel_op_mac_model_trains_the_same_through_either_path(dispatched, monkeypatch, tiny_titans_recipe):
    """A float16 MAC language model whose kernels all run (the scan, coefficients, fused prologue with its
    convolution, read, output stage and RoPE; DeepSpeed's bf16 training takes the same paths on a GPU), every block's
    activations recomputed in backward (``torch.utils.checkpoint``, so each operator's forward runs twice, once
    inside the backward): the same loss and every parameter's gradient bit for bit through the eager path as through
    the dispatcher, and no eager call reaching the dispatcher. (Both paths failed here before 2026-11-28: the fused
    convolution's backward unpacked its saved tensors twice, which non-reentrant checkpointing refuses.)"""
    from memtrain.model import anchor, build

    monkeypatch.setattr(anchor, "FUSED_ROPE_DEVICES", ("cpu", "cuda"))  # the fused RoPE, as on a GPU
    r = tiny_titans_recipe(n_layers=1)
    torch.manual_seed(torch.seed() % 2**31)
    model = build(r.model, r.memory).to(DEVICE).half()
    model.set_activation_checkpointing(True)
    x = torch.randint(0, 40, (2, 19)).to(DEVICE)

    def step():
        model.zero_grad()
        loss = F.cross_entropy(model(x).logits[:, :-1].float().reshape(-1, 40), x[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    monkeypatch.setenv(kernel_ops.DISPATCH_ENV, "dispatch")
    want = step()
    ran = set(dispatched)
    assert {"titans_scan_fwd", "titans_scan_bwd", "titans_conv_qkv_heads_bwd", "titans_conv_queries", "titans_gates",
            "titans_read_bwd", "titans_gated_norm", "rope_bwd"} <= ran, ran
    dispatched.clear()
    monkeypatch.delenv(kernel_ops.DISPATCH_ENV)
    got = step()
    assert dispatched == {}, dispatched
    assert torch.equal(got[0], want[0]) and got[1].keys() == want[1].keys()
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=0, atol=0, equal_nan=True, msg=name)


def test_kernel_op_mode_from_the_environment_and_a_bad_value_refused(monkeypatch):
    """``MEMTRAIN_KERNEL_OPS``: unset or ``eager`` takes the eager path, ``dispatch`` the dispatcher; another value (a
    typo would otherwise run as ``eager``) is one error naming the variable and the choices, raised before a run
    starts (``check_kernels``, for every model) and when a Titans memory that may run the kernels is built."""
    from memtrain.config import recipe_from_dict
    from memtrain.errors import SettingError
    from memtrain.launcher.train import check_kernels
    from memtrain.model.titans import NeuralMemory

    recipe = recipe_from_dict({"model": {"type": "decoder", "vocab_size": 40, "d_model": 16, "n_layers": 1,
                                         "n_heads": 2, "ffn_dim": 32, "max_seq_len": 16},
                               "data": {"seq_len": 16, "tokenizer": {"vocab_size": 40}}})
    env = kernel_ops.DISPATCH_ENV
    for raw, mode in (("", "eager"), ("eager", "eager"), ("dispatch", "dispatch")):
        monkeypatch.setenv(env, raw)
        assert kernel_ops.requested_mode() == mode
        check_kernels(recipe, torch.device("cpu"))
        NeuralMemory(16, heads=2, kernel="auto")
    monkeypatch.setenv(env, "dispach")
    message = r"^MEMTRAIN_KERNEL_OPS='dispach': expected one of eager, dispatch \(or unset it\)$"
    with pytest.raises(SettingError, match=message):
        check_kernels(recipe, torch.device("cpu"))
    with pytest.raises(SettingError, match=message):
        NeuralMemory(16, heads=2, kernel="auto")
    NeuralMemory(16, heads=2, kernel="torch")  # never runs the kernels
