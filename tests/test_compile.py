"""Regional compilation of the blocks (model.compile): one Dynamo frame for every block of the anchor (no
recompilation per block), and compiled = eager outputs and gradients through inductor on CPU (float64,
document mask, grouped-query attention, a tied head, checkpointing every second block and the fused loss).
Titans blocks likewise, with the memory's inner loop left eager (the only graph break): every variant
traced with no other break and no frame per block, MAC and MAG through inductor equal to eager
(outputs, gradients and the memory states returned), and the Triton kernel running inside a compiled
block."""

from __future__ import annotations

import shutil

import pytest
import torch

from memtrain.config import MemoryConfig, ModelConfig, compile_enabled, recipe_from_dict
from memtrain.model import build

CFG = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16, attention="sdpa")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 64, (2, 16), generator=g)
    labels = torch.randint(0, 64, (2, 16), generator=g)
    labels[0, :3] = -100
    doc = torch.tensor([[0] * 9 + [1] * 7, [0] * 16])
    return x, labels, doc


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("n_layers", [2, 5])
def test_one_frame_serves_every_block(n_layers):
    """Dynamo compiles the block's code once, whatever the number of blocks; a second forward with
    another batch of the same shape compiles nothing new."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = build(ModelConfig(n_layers=n_layers, **CFG))
    counter = CompileCounter()
    assert model.compile_blocks(backend=counter) == n_layers
    x, labels, doc = _batch()
    model(x, doc_ids=doc).logits.sum().backward()
    assert counter.frame_count == 1
    model(x.flip(0), doc_ids=doc.flip(0)).logits.sum().backward()
    assert counter.frame_count == 1


def test_memory_layers_add_one_variant_not_one_per_block():
    """FFN memories on some layers: blocks with and without a memory are two variants of one code."""
    from torch._dynamo.testing import CompileCounter

    from memtrain.model.hierarchical import FetchedMemory
    from memtrain.parallel.bank import MemoryBank

    frames = []
    for layers in (4, 6):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build(ModelConfig(n_layers=layers, **CFG),
                      MemoryConfig(type="ffn", levels=[1, 1], placement_layers=2), branching=2)
        bank = MemoryBank(model.memory_layout, seed=0)
        counter = CompileCounter()
        model.compile_blocks(backend=counter)
        x, _, doc = _batch()
        memory = bank.fetch(torch.tensor([[0, 1], [1, 3]]))
        assert isinstance(memory, FetchedMemory)
        model(x, doc_ids=doc, memory=memory).logits.sum().backward()
        frames.append(counter.frame_count)
    assert frames[0] == frames[1] <= 2


def test_compiled_blocks_match_eager_outputs_and_gradients():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("inductor on CPU needs a C++ compiler (none on PATH)")
    cfg = ModelConfig(n_layers=3, tie_embeddings=True, **CFG)
    torch.manual_seed(0)
    eager = build(cfg).double()
    compiled = build(cfg).double()
    compiled.load_state_dict(eager.state_dict())
    compiled.set_activation_checkpointing(2)
    compiled.set_fused_loss(7)
    assert compiled.compile_blocks() == 3
    x, labels, doc = _batch()
    results = []
    for model in (eager, compiled):
        out = model(x, doc_ids=doc, labels=labels)
        out.loss_sum.backward()
        with torch.no_grad():
            logits = model.eval()(x, doc_ids=doc).logits
        model.train()
        results.append((out.loss_sum.detach(), logits, {n: p.grad for n, p in model.named_parameters()}))
    (loss_e, logits_e, grads_e), (loss_c, logits_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits_c, logits_e, rtol=1e-12, atol=1e-12)
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-10, atol=1e-12, msg=name)


def _recipe(**model):
    return recipe_from_dict({"model": {"vocab_size": 320, "d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64,
                                       "max_seq_len": 32, **model},
                             "data": {"seq_len": 32, "tokenizer": {"vocab_size": 320}},
                             "train": {"global_batch_tokens": 256, "micro_batch_size": 2}})


def test_model_compile_key():
    assert _recipe().model.compile == "auto"
    assert not compile_enabled(_recipe(), "cpu") and compile_enabled(_recipe(), "cuda")
    assert compile_enabled(_recipe(compile=True), "cpu") and not compile_enabled(_recipe(compile=False), "cuda")
    zero3 = recipe_from_dict({**_recipe().to_dict(), "parallel": {"zero_stage": 3}})
    assert not compile_enabled(zero3, "cuda")
    from memtrain.config import RecipeError

    with pytest.raises(RecipeError, match=r"^recipe error: model\.compile: .*ZeRO 3"):
        recipe_from_dict({**_recipe().to_dict(), "parallel": {"zero_stage": 3}}, ["model.compile=true"])
    titans = recipe_from_dict({**_recipe().to_dict()}, ["model.compile=true", "model.type=titans"])
    assert compile_enabled(titans, "cpu") and not compile_enabled(_recipe(type="titans"), "cuda")  # auto: eager
    with pytest.raises(RecipeError, match=r"^recipe error: model\.compile: .*'decoder' and 'titans' only"):
        recipe_from_dict({**_recipe().to_dict()}, ["model.compile=true", "model.type=hf", "model.pretrained=x"])
    with pytest.raises(RecipeError, match=r"^recipe error: model\.compile: expected"):
        _recipe(compile="yes")


def test_compile_mode_reaches_every_block_and_cuda_graph_modes_start_a_step_per_forward(monkeypatch):
    """``model.compile_mode`` is torch.compile's mode for every compiled block (the default mode passes nothing,
    as before the key); under the CUDA-graph modes every forward of the model first starts a new generation of
    the graphs (``cudagraph_mark_step_begin``), and the options line says so. A mode without compiled blocks is
    one recipe error."""
    from memtrain.config import RecipeError
    from memtrain.launcher.train import configure_model, training_options_line

    with pytest.raises(RecipeError, match=r"^recipe error: model\.compile_mode: 'reduce-overhead' applies to "
                                          r"compiled blocks, and model\.compile is false; set model\.compile: true"):
        _recipe(compile=False, compile_mode="reduce-overhead")
    with pytest.raises(RecipeError, match=r"^recipe error: model\.compile_mode: must be one of .*; got 'fast'"):
        _recipe(compile=True, compile_mode="fast")
    with pytest.raises(RecipeError, match=r"^recipe error: model\.compile_mode: 'max-autotune' \(CUDA graphs\) with "
                                          r"activation checkpointing is not supported"):
        recipe_from_dict(_recipe().to_dict(), ["model.compile_mode=max-autotune",
                                               "parallel.activation_checkpointing=2"])
    calls, steps = [], []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append(kw))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    x = torch.randint(0, 320, (1, 8))
    no_graphs = "max-autotune-no-cudagraphs"
    for mode, kwargs, marks in [("default", {}, 0), (no_graphs, {"mode": no_graphs}, 0),
                                ("reduce-overhead", {"mode": "reduce-overhead"}, 2)]:
        recipe = _recipe(compile=True, compile_mode=mode)
        model = build(recipe.model)
        calls.clear(), steps.clear()
        options = configure_model(model, recipe, torch.device("cpu"))
        assert calls == [kwargs] * 2 and options["compiled_blocks"] == 2 and options["compile_mode"] == mode
        model(x)
        model(x)
        assert len(steps) == marks, mode
    assert "2 block(s) compiled (torch.compile, regional, mode reduce-overhead: CUDA graphs on a GPU)" in \
        training_options_line(options, 2)
    eager = configure_model(build(_recipe().model), _recipe(compile_mode="reduce-overhead"), torch.device("cpu"))
    assert eager["compiled_blocks"] == 0 and eager["compile_mode"] is None  # auto on CPU: nothing compiled


# -- Titans ----------------------------------------------------------------------------------------


def _titans(variant: str, n_layers: int = 2, **titans):
    from memtrain.config import TitansConfig

    t = dict(variant=variant, memory_heads=2, memory_chunk_size=4, segment_len=8, window=6, persistent_tokens=3,
             memory_max_lr=0.1, memory_init_lr=0.02, kernel="torch")
    t.update(titans)
    torch.manual_seed(0)
    return build(ModelConfig(type="titans", n_layers=n_layers, tie_embeddings=False, titans=TitansConfig(**t),
                             **{**CFG, "max_seq_len": 32}))


def _titans_batch(T: int = 21):  # 21 tokens: 2 full MAC segments and a partial one, a partial memory chunk
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 64, (2, T), generator=g)
    doc = torch.zeros(2, T, dtype=torch.long)
    doc[0, 11:] = 1
    return x, doc


def _graph_breaks() -> dict:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


@pytest.mark.parametrize("variant", ["mac", "mag", "mal", "lmm"])
def test_titans_blocks_trace_with_the_inner_loop_as_the_only_graph_break(variant):
    """Every variant: the only graph break is the memory's scan (run_scan under torch.compiler.disable);
    the frames do not grow with the number of blocks nor on a second batch; the traced model computes the
    eager function exactly (Dynamo's graphs run eagerly under the counting backend)."""
    from torch._dynamo.testing import CompileCounter

    frames, breaks = [], set()
    for n_layers in (2, 4):
        torch._dynamo.reset()
        eager, traced = _titans(variant, n_layers).double(), _titans(variant, n_layers).double()
        counter = CompileCounter()
        assert traced.compile_blocks(backend=counter) == n_layers
        x, doc = _titans_batch()
        out_e, out_t = eager(x, doc_ids=doc), traced(x, doc_ids=doc)
        torch.testing.assert_close(out_t.logits, out_e.logits, rtol=0, atol=1e-12)
        out_t.logits.square().mean().backward()
        out_e.logits.square().mean().backward()
        for (name, p), q in zip(traced.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)
        first = counter.frame_count
        traced(x.flip(0), doc_ids=doc.flip(0)).logits.sum().backward()
        assert counter.frame_count == first, "a second batch of the same shape recompiled"
        frames.append(first)
        breaks |= set(_graph_breaks())
    assert frames[0] == frames[1] > 0, f"frames grew with the blocks: {frames}"
    assert breaks and all("compiler.disable" in b and "run_scan" in b for b in breaks), breaks


@pytest.mark.parametrize("variant,backend", [("mac", "aot_eager"), ("mag", "inductor")])
def test_titans_compiled_blocks_match_eager_outputs_gradients_and_states(variant, backend):
    """Float64: logits, the loss, every gradient and the returned memory states of compiled blocks
    (checkpointing every second block, the fused loss) equal the eager model's. MAG through inductor on CPU
    (its generated C++ included); MAC, whose segment loop splits each block into one graph per segment plus
    resume functions (at 16 tokens 10 graphs, 40 s of C++ compiles on 2 cores), through ``aot_eager``: the
    same Dynamo graphs, graph breaks and AOTAutograd joint graphs, partitioned and run eagerly."""
    if backend == "inductor" and shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("inductor on CPU needs a C++ compiler (none on PATH)")
    eager, compiled = _titans(variant, 3).double(), _titans(variant, 3).double()
    compiled.set_activation_checkpointing(2)
    compiled.set_fused_loss(7)
    assert compiled.compile_blocks(backend=backend) == 3
    x, doc = _titans_batch()
    labels = x.roll(-1, 1)
    results = []
    for model in (eager, compiled):
        out = model(x, doc_ids=doc, labels=labels)
        out.loss_sum.backward()
        states = [w.detach() for s in out.memory for w in (*s.weights, *s.momentum)]
        results.append((out.loss_sum.detach(), {n: p.grad for n, p in model.named_parameters()}, states))
    (loss_e, grads_e, states_e), (loss_c, grads_c, states_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-12, atol=1e-12)
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-9, atol=1e-12, msg=name)
    for a, b in zip(states_c, states_e):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _kernel_ops(graphs) -> set[str]:
    return {str(n.target) for g in graphs for n in g.graph.nodes if "memtrain" in str(n.target)}


@pytest.mark.parametrize("variant,depth", [("mac", 2), ("mag", 2), ("mal", 1), ("lmm", 2)])
def test_titans_compiled_blocks_with_the_triton_kernels_are_one_graph(variant, depth):
    """kernel: triton (the interpreter on CPU, float32): the kernels are custom operators, so Dynamo traces the
    whole block, MAC's loop over segments included, into one graph with the scan as nodes: no graph break, one
    frame for both blocks (memory depth 1 and 2; the any-depth kernels' operators pass opcheck's AOTAutograd
    test in tests/test_titans_kernel.py, and run 7 s per step here). The traced model (Dynamo's graph run
    eagerly) equals the eager kernel model in the compiled blocks' form, and the PyTorch form to the kernels'
    float32 rounding, outputs and every gradient."""
    from torch._dynamo.testing import CompileCounterWithBackend, EagerAndRecordGraphs
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # torch 2.11's reset keeps the graph-break counts of earlier tests
    torch_model, eager, traced = (_titans(variant, kernel=k, memory_depth=depth) for k in ("torch", "triton", "triton"))
    for block in eager.blocks:  # compiled blocks' form of MAC (per-segment output stage, autograd's per-use sums)
        block.compiled = True
    record = EagerAndRecordGraphs()
    counter = CompileCounterWithBackend(record)
    traced.compile_blocks(backend=counter)
    x, doc = _titans_batch(16 if variant == "mac" else 8)  # MAC: two segments; the interpreter is slow
    outs = [m(x, doc_ids=doc).logits for m in (torch_model, eager, traced)]
    assert not _graph_breaks(), _graph_breaks()
    assert counter.frame_count == 1 and len(record.graphs) == 1
    assert _kernel_ops(record.graphs) == {"memtrain.titans_coef_fwd.default", "memtrain.titans_scan_fwd.default"}
    torch.testing.assert_close(outs[2], outs[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(outs[2], outs[0], rtol=1e-4, atol=1e-5)
    for out in outs:
        out.square().mean().backward()
    for (name, p), q, r in zip(traced.named_parameters(), eager.parameters(), torch_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8, msg=name)
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-3, atol=1e-6, msg=name)


@pytest.mark.parametrize("compiled", [False, True])
def test_titans_mac_never_asks_a_projection_its_truth_value(monkeypatch, compiled):
    """The GPU machines' torch 2.11 Dynamo cannot take the truth value of a function. ``out_proj or self.wo`` in
    ``PrefixAttention.attend_heads``, where a compiled MAC block's ``wo`` is one (``grouped_linear`` gives
    ``F.linear`` in a lambda there), broke the graph inside the loop over segments, and Dynamo then ran the block's
    whole forward eagerly (under torch 2.11 ``test_titans_compiled_blocks_with_the_triton_kernels_are_one_graph``
    failed on it; torch 2.14 takes it). So no MAC forward asks a projection (``grouped_linear``'s, the memory's
    ``Projections``) whether it is true: here each raises if asked, eager blocks and blocks in the compiled form
    alike, and the outputs are those of the plain model."""
    from memtrain.model.titans import arch, memory

    class Refuses:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, *args):
            return self.fn(*args)

        def __bool__(self):
            raise AssertionError("a projection was asked its truth value")

    class RefusingProjections(memory.Projections):
        def __bool__(self):
            raise AssertionError("the memory's projections were asked their truth value")

    x, doc = _titans_batch()
    plain, model = _titans("mac"), _titans("mac")
    for block in (*plain.blocks, *model.blocks):
        block.compiled = compiled
    expected = plain(x, doc_ids=doc).logits
    monkeypatch.setattr(arch, "grouped_linear", lambda *a, _f=arch.grouped_linear, **k: Refuses(_f(*a, **k)))
    monkeypatch.setattr(memory.NeuralMemory, "projections",
                        lambda self, *a, _f=memory.NeuralMemory.projections, **k: RefusingProjections(*_f(self, *a, **k)))
    torch.testing.assert_close(model(x, doc_ids=doc).logits, expected, rtol=0, atol=0)


def test_titans_compiled_half_precision_blocks_take_the_fused_prologue():
    """In half precision (bf16 training; float16 here, the interpreter's bf16 dot products being wrong) the layer's
    prologue is two more custom operators (memtrain.kernels.titans.prologue; the convolution in the first), its
    output stage a third (memtrain.kernels.titans.output), MAC's retrieval a fourth (memtrain.kernels.titans.read)
    and its queries a fifth (the prologue's, with the convolution): a compiled MAC block traces them into its one graph beside the scan's, and runs
    what the eager block runs -- outputs and every gradient equal to the eager kernel model's."""
    from torch._dynamo.testing import CompileCounterWithBackend, EagerAndRecordGraphs
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, traced = (_titans("mac", kernel="triton", memory_depth=2).half() for _ in range(2))
    for block in eager.blocks:  # compiled blocks' form of MAC (the write's output stage per segment)
        block.compiled = True
    record = EagerAndRecordGraphs()
    counter = CompileCounterWithBackend(record)
    traced.compile_blocks(backend=counter)
    x, doc = _titans_batch(16)
    outs = [m(x, doc_ids=doc).logits for m in (eager, traced)]
    assert not _graph_breaks(), _graph_breaks()
    assert counter.frame_count == 1 and len(record.graphs) == 1
    assert _kernel_ops(record.graphs) == {f"memtrain.titans_{op}.default" for op in ("coef_fwd", "scan_fwd",
                                                                                      "conv_qkv_heads", "gates",
                                                                                      "gated_norm", "read",
                                                                                      "conv_queries")}
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for out in outs:
        out.float().square().mean().backward()
    for (name, p), q in zip(traced.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_titans_compiled_mac_with_the_triton_kernels_through_aot_autograd():
    """The kernels' custom operators through AOTAutograd (``aot_eager``: the joint graph of the whole MAC
    block partitioned into forward and backward, run eagerly), the block checkpointed: the loss,
    every gradient and the returned memory states equal the eager kernel model's."""
    eager, compiled = _titans("mac", 1, kernel="triton"), _titans("mac", 1, kernel="triton")
    for block in eager.blocks:  # compiled blocks' form of MAC (the write's output stage per segment)
        block.compiled = True
    compiled.set_activation_checkpointing(2)
    compiled.compile_blocks(backend="aot_eager")
    x, doc = _titans_batch(16)
    results = []
    for model in (eager, compiled):
        out = model(x, doc_ids=doc, labels=x.roll(-1, 1))
        out.loss_sum.backward()
        states = [w.detach() for s in out.memory for w in (*s.weights, *s.momentum)]
        results.append((out.loss_sum.detach(), [p.grad for p in model.parameters()], states))
    (loss_e, grads_e, states_e), (loss_c, grads_c, states_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=0)
    for (name, _), a, b in zip(eager.named_parameters(), grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8, msg=name)
    for a, b in zip(states_c, states_e):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
