"""The GPU check: every measurement and compiled test a GPU session owes, as one prepared command.

Why. GPU machines are lent to few sessions, for minutes (15 of device time, 10 per command). What a
session must do there is fixed in advance -- run the compiled kernel tests, time the Titans layer,
train each paper-scale Titans recipe 50+ steps -- so it is one script, in priority order, that
writes its results as it goes and stops starting phases when its time budget runs out. The results
of the phases that finished come back even when the command is killed.

What. ``PLAN`` lists the phases, most important first (after the guards: the Titans layer's fused prologue and output
stage and the fused RoPE, taken by every Titans recipe, and MAC's grouped weight gradients are tested compiled first,
and if one fails the later phases run with it off, a phase's ``on_failure_env``; issue 11: titans-170m-mac and
titans-400m-mag as they ship, MAC with the old backward beside them, the layer benchmark's target configuration,
titans-340m-mac and titans-760m-mal, titans-170m-mac with its blocks compiled and with them replayed as CUDA graphs,
the kernels' launch sweep, the compiled Titans kernels at the recipes' shapes), then the rest of the layer benchmark,
the whole kernel test file compiled, the GPU tier, the routed-attention kernels and the anchor's throughput). Each
phase is a subprocess in its own process group with its own timeout, clipped to what is left of ``--budget``; a phase
that times out is killed (SIGTERM, then SIGKILL) and the next starts. The training phases get ``--max-seconds``
(their timeout less ``CAP_MARGIN_S``) so they stop early and still report. After every phase ``OUT/gpu_check.json``
is rewritten (atomically) with every phase so far: status (``ok``, ``failed``, ``timeout``, ``skipped``), exit code,
seconds, the JSON lines the phase printed (benchmarks), the pytest summary line (tests) and the last lines of its
output; ``OUT/gpu_check.log`` holds each phase's full output, ``OUT/triton-cache.tar.gz`` the kernels the phases
compiled and Inductor's graph caches they wrote (``--prepare --device-cache`` carries both to the next run). A short
table is printed last. Exit status 0 when every phase ran and passed.

How, on a lent GPU machine (see ``../shared/gpu/README.md``; here first: ``make install``,
``bash ../shared/gpu/make-bundle.sh --titans-pytorch`` and ``.venv/bin/python tools/gpu_check.py --prepare``, which
adds pytest's wheels to ``.gpu/extra`` for an image without pytest and compiles the Titans scan kernels the plan
launches for the GPU's architecture and Triton into ``.gpu/triton-cache``, which the run there installs as Triton's
cache for its phases; then carry ``.gpu``)::

    source .gpu/setup.sh && python3 tools/gpu_check.py --out $OUT --budget 555     # timeout_s 600
    python3 tools/gpu_check.py --list                     # the plan, with its commands
    python3 tools/gpu_check.py --out DIR --phases recipe_  # only phases whose name starts so

Torch-free itself (it only starts processes), so it runs wherever Python does; ``--list`` checks that
every script, test file and recipe the plan names exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # memtrain.kernels.precompile (torch-free) for the Triton cache
    sys.path.insert(0, str(ROOT))
PY = sys.executable
EXTRA = ROOT / ".gpu" / "extra"  # pytest's wheels (--prepare), for a GPU image without pytest
EXTRA_SITE = Path(tempfile.gettempdir()) / "memtrain-gpu-check-site"
# The lent GPU machines (../shared/gpu/README.md): Python 3.12, Triton 3.6, an H100 or H200 (sm_90).
GPU_PYTHON, GPU_TRITON, GPU_TARGET = "3.12", "3.6.0", "cuda:90"
TRITON_HERE = ROOT / ".triton36"  # GPU_TRITON for this machine's Python (--prepare installs it; git-ignored)
TRITON_CACHE = ROOT / ".gpu" / "triton-cache"  # the kernels --prepare compiled for GPU_TARGET (carried with .gpu)
DEVICE_TRITON_CACHE = Path(tempfile.gettempdir()) / "memtrain-triton-cache"  # TRITON_CACHE_DIR of the phases there
# Inductor's caches (flex attention's kernels, compiled blocks): --prepare --device-cache puts those a GPU run brought
# back here (carried with .gpu); the run there installs them as its phases' TORCHINDUCTOR_CACHE_DIR. Only the graph
# caches travel: their entries hold the generated code and (Inductor's Triton bundling) its compiled kernels.
INDUCTOR_CACHE = ROOT / ".gpu" / "inductor-cache"
DEVICE_INDUCTOR_CACHE = Path(tempfile.gettempdir()) / "memtrain-inductor-cache"
INDUCTOR_PARTS, INDUCTOR_ARC = ("fxgraph", "aotautograd"), "inductor"  # the parts kept; their folder in the tar
RETURNED_CACHE_BYTES = 32 << 20  # of the kernels compiled there, unpacked, brought back (save_compiled)
RETURNED_FILE_BYTES = 15 << 20  # ... packed in OUT/triton-cache.tar.gz: the device tool returns files up to 16 MiB
# What titans_kernel_tune times, and so what --prepare compiles ahead (mag launches the same kernels as mac).
TUNE_SHAPES, TUNE_WARPS = "mac,mag,layer", "16"
TEST_TOOLS = ("pytest", "pytest-timeout")  # pinned by constraints.txt; their dependencies come along
TAIL_CHARS = 4000  # of each phase's output, kept in the JSON
LOG_CHARS = 400_000  # of each phase's output, kept in the log (the device returns files up to 16 MiB)


@dataclasses.dataclass
class Phase:
    """One command of the plan. ``kind``: ``jsonl`` (a benchmark printing JSON lines on stdout) or
    ``pytest`` (its summary line is read)."""

    name: str
    argv: list[str]
    timeout_s: float
    kind: str = "jsonl"
    about: str = ""
    capped: bool = False  # takes ``--max-seconds`` (train_throughput.py): given its timeout less CAP_MARGIN_S
    env: dict = dataclasses.field(default_factory=dict)  # set for this phase's process only
    # set for every later phase when this one does not pass (a guard: e.g. turn off a code path that failed here)
    on_failure_env: dict = dataclasses.field(default_factory=dict)


CAP_MARGIN_S = 30.0  # a capped phase's process start (imports) and last step after its cap, before its timeout


# Every paper-scale Titans recipe has run 52 finite steps on an H200 (the last, 400m-mag, on 2026-11-27); the plan
# now times them, the two with a throughput target first.
TITANS_RECIPES = ("titans-170m-mac", "titans-400m-mag", "titans-340m-mac", "titans-760m-mal")


# titans-170m-mac's structure (12 blocks, 8 MAC segments of one memory chunk each) at tiny widths:
# benchmarks/op_count.py counts and times its host cost on a CPU (the same 5,289 device ops per micro-batch as the
# recipe).
HOST_TWIN = ("model.d_model=32", "model.n_heads=2", "model.titans.memory_heads=2", "model.titans.memory_head_dim=16",
             "model.ffn_dim=64", "model.vocab_size=256", "data.tokenizer.vocab_size=256", "data.seq_len=128",
             "model.titans.segment_len=16", "model.titans.kernel=triton")


def _pytest(*args: str) -> list[str]:
    return [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *args]


def _throughput(recipe: str, *overrides: str, steps: int = 50, warmup: int = 2, micro_batches: int = 1,
                docs: int = 4, extra: tuple[str, ...] = ()) -> list[str]:
    return [PY, "benchmarks/train_throughput.py", f"recipes/{recipe}.yaml", *overrides,
            "--micro-batches", str(micro_batches), "--warmup", str(warmup), "--steps", str(steps),
            "--docs", str(docs), *extra]


def _recipe_phase(recipe: str, timeout_s: float, steps: int = 20, why: str = "", overrides: tuple[str, ...] = ()
                  ) -> Phase:
    micro = next((o.split("=", 1)[1] for o in overrides if o.startswith("train.micro_batch_size=")), None)
    return Phase(f"recipe_{recipe.removeprefix('titans-').replace('-', '_')}",
                 _throughput(recipe, "train.schedule.warmup=2", *overrides, steps=steps, extra=("--profile", "25")),
                 timeout_s, capped=True,
                 about=f"{recipe}: {steps + 2} optimizer steps of one micro-batch ("
                       + (f"{micro} sequences, not the recipe's" if micro else "the recipe's")
                       + ", of 4096-token sequences with 4 documents each) at lr 4e-4 after a 2-step warm-up; "
                       "tokens/s, MFU, peak memory, every loss finite; then one profiled step (device-busy fraction, "
                       f"top 25 kernels){why}")


def _form_phase(recipe: str, form: str, timeout_s: float, why: str) -> Phase:
    """``recipe``'s phase with the scan kernels' ``form`` (:func:`memtrain.kernels.titans.form_env`: ``shipped`` the
    one-program-per-sequence forward and backward, ``split`` both split; unpipelined), beside the default's phase."""
    name = recipe.removeprefix('titans-').replace('-', '_')
    env = {"MEMTRAIN_TITANS_FORWARD": "split" if form == "split" else "shipped", "MEMTRAIN_TITANS_BACKWARD": form,
           "MEMTRAIN_TITANS_STAGES": "1"}
    return Phase(f"recipe_{name}_{form}",
                 _throughput(recipe, "train.schedule.warmup=2", steps=20, extra=("--profile", "25")), timeout_s,
                 capped=True, env=env, about=f"{recipe} with {', '.join(f'{k}={v}' for k, v in env.items())}, beside "
                                             f"recipe_{name} (the shipped forward, the split backward): {why}")


def phase_argv(phase: Phase, timeout_s: float) -> list[str]:
    """The command run for ``phase`` under ``timeout_s``: a capped phase stops starting steps ``CAP_MARGIN_S``
    before it, so it reports (``steps_done``) rather than being killed."""
    if not phase.capped:
        return list(phase.argv)
    return [*phase.argv, "--max-seconds", f"{max(timeout_s - CAP_MARGIN_S, 1.0):.0f}"]


PLAN: list[Phase] = [
    # A drawn session has 15 minutes of device time, machine start included (about 35 s on 2026-11-27): the
    # first command (555 s) takes the guards, the two recipes with a throughput target as they ship now (micro-batch
    # 8, the split backward, the fused kernels on for the first time in a recipe), MAC's old backward beside them,
    # the layer target and the other two recipes; a second (250 s) continues where it stopped.
    Phase("env", [PY, "tools/gpu_check.py", "--env"], 60, about="device, driver, torch / triton versions"),
    # Every Titans recipe runs the fused prologue and output stage and every model the fused RoPE: their tests
    # first, compiled, and if they fail the later phases run with them off (PyTorch's forms) rather than every
    # recipe failing the same way. On an H200, 31 of 32 passed twice (2026-11-27): the RoPE-in-models test failed
    # first on rounding (it compared float32 with float32), then because its float64 model's flex attention does
    # not compile for float64 on CUDA (that model runs on the CPU since); so every recipe so far ran with all three
    # off.
    Phase("fused_kernels", _pytest("tests/test_titans_kernel.py", "tests/test_rope_kernel.py", "-k",
                                   "(prologue or output or rope) and not compiles and not conv_"), 100, "pytest",
          "the memory layer's fused prologue (q/k/v, gates) and output stage and the fused RoPE against float64, "
          "compiled; on failure the later phases set MEMTRAIN_TITANS_FUSED_PROLOGUE=0, "
          "MEMTRAIN_TITANS_FUSED_OUTPUT=0 and MEMTRAIN_FUSED_ROPE=0",
          on_failure_env={"MEMTRAIN_TITANS_FUSED_PROLOGUE": "0", "MEMTRAIN_TITANS_FUSED_OUTPUT": "0",
                          "MEMTRAIN_FUSED_ROPE": "0"}),
    # The convolution fused into the q/k/v kernels (memtrain.kernels.titans.prologue.conv_qkv_heads / conv_queries,
    # 2026-11-27, not yet run on a GPU) has its own guard, so that its failure -- or its tests' compiles (about 30
    # specialisations: dtypes, widths, one and three parts) running past the timeout -- turns off the convolution's
    # fusion alone, not the q/k/v and gate kernels that ran before it.
    Phase("fused_conv", _pytest("tests/test_titans_kernel.py", "-k", "prologue and conv_"), 100, "pytest",
          "the convolution fused into the q/k/v kernels (writes and MAC's retrieval queries) against float64 and "
          "opcheck, compiled; on failure the later phases set MEMTRAIN_TITANS_FUSED_CONV=0",
          on_failure_env={"MEMTRAIN_TITANS_FUSED_CONV": "0"}),
    # MAC's fused retrieval (memtrain.kernels.titans.read, 2026-11-27, not yet run on a GPU) has its own guard, so that
    # its failure -- or its tests' compiles running past the timeout -- turns off the retrieval alone.
    Phase("fused_read", _pytest("tests/test_titans_kernel.py", "-k", "kernel_read or fused_read"), 120, "pytest",
          "MAC's fused retrieval against float64 (float32, float16 and bf16 products), opcheck and a float16 MAC model, "
          "compiled; on failure the later phases set MEMTRAIN_TITANS_FUSED_READ=0",
          on_failure_env={"MEMTRAIN_TITANS_FUSED_READ": "0"}),
    # Eager MAC computes its per-segment weight gradients once (memtrain.model.grouped_linear): checked in bf16
    # against the per-use sums and fp32 (passed on an H200 three times, 2026-11-27, 28 s); if that fails the later
    # phases run without it. A guard, so before MAC.
    Phase("grouped_wgrad", _pytest("-m", "gpu", "tests/test_gpu.py", "-k", "grouped_weight_gradients"), 90,
          "pytest", "eager MAC's grouped per-segment weight gradients in bf16 (Triton kernels) against autograd's "
          "per-use sums and fp32; on failure the later phases set MEMTRAIN_GROUPED_WGRAD=0",
          on_failure_env={"MEMTRAIN_GROUPED_WGRAD": "0"}),
    # The 50K tokens/s target. On an H200 (2026-11-27, fused kernels off, the shipped backward): 23,291 tokens/s at
    # micro-batch 4, 36,775 at 8 (the recipe's since). The first recipe phase compiles flex attention (Inductor)
    # and the fused kernels in its first step (400m-mag's took 52 s there, the scan kernels found in the cache): 130 s.
    _recipe_phase("titans-170m-mac", 130, why="; as it ships: micro-batch 8, the split backward, the fused kernels"),
    # 33,872 tokens/s and 8.1% MFU at micro-batch 8 on the H200 (shipped backward); with both split at
    # micro-batch 4, 25,030 against the shipped kernels' 22,562
    _recipe_phase("titans-400m-mag", 120, why="; as it ships: micro-batch 8, the split backward"),
    # The split loops pipelined (MEMTRAIN_TITANS_STAGES=2, 2026-11-29, not yet run on a GPU): the split forward and
    # backward with and without, the scan kernels alone at the recipes' shapes and the layer target's, from the cache
    Phase("titans_kernel_pipelined", [PY, "benchmarks/titans_kernels.py", "--shapes", TUNE_SHAPES, "--forms",
                                      "split,pipelined"], 90,
          about="the split forward and backward against the same with their loops over chunks software-pipelined in "
                "2 stages (MEMTRAIN_TITANS_STAGES=2: the next chunk's loads issued while the current one computes; "
                "the carried loop at chunk 16 only), the scan kernels alone at the mac, mag and layer shapes: time per "
                "chunk forward and backward, loops and frames, error against the unpipelined form"),
    # The split backward was chosen from the kernels alone at MAC's shape (29% less time per chunk) and from
    # 400m-mag; this is MAC's recipe-level check, on the same machine as recipe_170m_mac
    _form_phase("titans-170m-mac", "shipped", 110, "what the split backward gains where the host's dispatch "
                "bounds part of the step (the GPU idled a quarter of a timed step on the H200)"),
    Phase("titans_layer", [PY, "benchmarks/titans.py", "--configs", "0", "--no-any-depth", "--profile", "15"], 180,
          about="the layer target: B4 T2048 d512 8 heads depth 2 chunk 64, kernel vs torch chunked vs "
                "sequential vs titans-pytorch (target: kernel >= 1M tokens/s, >= 10x titans-pytorch), the shipped "
                "form's columns beside the default (at chunk 64 both split forms since 2026-11-28), the layer in bf16 "
                "weights without autocast as memtrain trains it (kernel_bf16_weights: the fused output stage too), "
                "and one profiled forward+backward (on an H200, 2026-11-27, under autocast with the fused kernels "
                "off: 659,734 tokens/s with the shipped forms, 765,170 with both split)"),
    # At the recipe's micro-batch of 4 it ran in all three H200 runs (52 finite steps in the last two; 16,620 tokens/s,
    # 4.2% MFU, 48.0 GiB, shipped backward, fused kernels off). The likeliest lever toward its 10% MFU is micro-batch
    # 8, as for 170m-mac and 400m-mag: 8 x 16 memory heads = 128 scan programs, one per SM of an H100 / H200
    # (400m-mag's backward took 127 us per chunk for 128 programs against 87 for 64, +50% tokens/s in the recipe), at
    # an estimated 53.1 GiB on this one GPU with the fused kernels and the SwiGLU's recomputation (`memtrain recipe show
    # ... train.micro_batch_size=8 --world-size 1`; 48.7 on the recipe's 8 ranks; 76.3 on one without the fused kernels,
    # past an H100's 80 GB once the measured peaks' ~20% above the estimate are added). So the phase measures 8, the
    # candidate.
    _recipe_phase("titans-340m-mac", 110, overrides=("train.micro_batch_size=8",),
                  why="; at micro-batch 8, the candidate for the recipe (4 ran 52 finite steps on an H200, 16,620 "
                      "tokens/s, 4.2% MFU, 48.0 GiB, shipped backward, fused kernels off): 128 scan programs in one "
                      "wave, an estimated 53.1 GiB on one GPU (fits an 80 GB H100 if the peak is within 50% of it)"),
    _recipe_phase("titans-760m-mal", 110, why="; 52 finite steps on an H200 (17,885 tokens/s, 8.0% MFU, shipped "
                  "backward, fused kernels off): the recipe nearest 10% MFU"),
    # the pipelined loops in a recipe as it ships otherwise (chunk 16: the shipped forward, the split backward, whose
    # recompute and carried loops take 2 stages), beside recipe_170m_mac
    Phase("recipe_170m_mac_pipelined",
          _throughput("titans-170m-mac", "train.schedule.warmup=2", steps=20, extra=("--profile", "25")), 110,
          capped=True, env={"MEMTRAIN_TITANS_STAGES": "2"},
          about="titans-170m-mac with MEMTRAIN_TITANS_STAGES=2 (the split backward's recompute and carried loops "
                "software-pipelined in 2 stages), beside recipe_170m_mac: whether the recipes should take it"),
    Phase("recipe_170m_mac_compiled",
          _throughput("titans-170m-mac", "train.schedule.warmup=2", "model.compile=true", steps=20), 180,
          capped=True,
          about="titans-170m-mac with model.compile: true (regional compile: each block one graph, the kernels "
                "custom operators in it, MAC's 8 segments unrolled), beside recipe_170m_mac: whether "
                "model.compile: auto should compile Titans blocks. The first H200 run "
                "failed in step 1 with 'CUDA error: misaligned address': the blocks share one compiled graph and "
                "its 12-head memory's 36-element gate bias put every other block's parameters 8 bytes off in "
                "DeepSpeed's flat buffer; the optimizer groups are cut for alignment since"),
    Phase("recipe_170m_mac_cudagraphs",
          _throughput("titans-170m-mac", "train.schedule.warmup=2", "model.compile=true",
                      "model.compile_mode=reduce-overhead", steps=20), 180, capped=True,
          about="titans-170m-mac with its compiled blocks replayed as CUDA graphs (model.compile_mode: "
                "reduce-overhead: one launch per block forward and backward), beside recipe_170m_mac and "
                "recipe_170m_mac_compiled: what is left of the host's dispatch cost"),
    # MAG and MAL are device-bound and the scan's backward is half their device time; the other half (0.33 of
    # 400m-mag's 0.71 s) is the rest of the block, run eagerly, where compiled blocks fuse the elementwise work
    Phase("recipe_400m_mag_compiled",
          _throughput("titans-400m-mag", "train.schedule.warmup=2", "model.compile=true", steps=20,
                      extra=("--profile", "25")), 180, capped=True,
          about="titans-400m-mag with model.compile: true (each block one graph, the scan kernels custom operators "
                "in it), beside recipe_400m_mag: what compiling the half of MAG's device time that is not the scan's "
                "backward gains, and the profiled step's kernels"),
    # The host's own cost of one eager titans-170m-mac micro-batch, on the GPU machine's CPU: the model's structure
    # (12 blocks of 8 segments, 5,289 device ops) at tiny widths and 16-token segments, the launches stubbed (op_count
    # --time; 262 ms on the 2-core CPU used for development, 2026-11-28). Set against recipe_170m_mac's host_forward_s
    # and host_backward_s it says how much of the step the host bounds.
    Phase("host_time", [PY, "benchmarks/op_count.py", "recipes/titans-170m-mac.yaml", *HOST_TWIN, "--time", "7"], 90,
          about="the host's time for one eager titans-170m-mac micro-batch (its structure at tiny widths, launches "
                "stubbed, on the CPU): the floor under an eager step where the device is faster than the host"),
    Phase("recipe_170m_mac_dispatch",
          _throughput("titans-170m-mac", "train.schedule.warmup=2", steps=20), 110, capped=True,
          env={"MEMTRAIN_KERNEL_OPS": "dispatch"},
          about="titans-170m-mac with every memtrain kernel's custom operator called through torch's dispatcher "
                "(MEMTRAIN_KERNEL_OPS=dispatch), as before 2026-11-28, beside recipe_170m_mac (the eager "
                "autograd.Function path, memtrain.kernels.op): what the 720 operator pairs per micro-batch cost the "
                "host on a GPU (49 us each on the 2-core CPU used for development)"),
    Phase("recipe_170m_mac_ungrouped",
          _throughput("titans-170m-mac", "train.schedule.warmup=2", steps=20, extra=("--profile", "25")), 110,
          capped=True, env={"MEMTRAIN_GROUPED_WGRAD": "0"},
          about="titans-170m-mac with autograd's per-use weight gradients (MEMTRAIN_GROUPED_WGRAD=0: one GEMM per "
                "segment and projection and their sums, 7,521 ops per sequence instead of 6,309), beside "
                "recipe_170m_mac: what computing each per-segment projection's weight gradient once "
                "(memtrain.model.grouped_linear) gains on a GPU"),
    # Decided on the H200 (2026-11-27), so last among the Titans measurements: the scan kernels alone (warps, the
    # lean backward, the split forms, the any-depth kernels) at the recipes' shapes and the layer target's
    Phase("titans_kernel_tune", [PY, "benchmarks/titans_kernels.py", "--shapes", TUNE_SHAPES, "--warps", TUNE_WARPS],
          150,
          about="the scan kernels alone at the recipes' shapes (mac and mag share compiled kernels) and the layer "
                "target under the shipped num_warps and 16, the backward's lean form, the split forward and "
                "backward and the any-depth kernels (state in memory) beside them: time, registers, spills, each "
                "loop's local-memory traffic as the device's Triton compiled it, error against the shipped launch. "
                "On an H200 (2026-11-27) the split backward took 29%, 27% and 28% less time per chunk than the "
                "shipped one at the mac, mag and layer shapes"),
    # 95 s on an H200 for the first two cases, mostly compiling; the split case compiles its five kernels in
    # float32 and bf16 besides
    Phase("titans_kernel_gpu", _pytest("-m", "gpu", "tests/test_titans_kernel.py"), 240, "pytest",
          "the compiled Titans kernels at the recipes' shapes (depth 2 and 3, chunk 16; the split forward and "
          "backward at depth 2) against the float64 PyTorch form, and bf16 against float32 forward and backward "
          "(the first two passed on an H200, 2026-11-26)"),
    Phase("titans_layer_rest", [PY, "benchmarks/titans.py", "--configs", "1,2,3,4"], 240,
          about="the layer at T8192, at d768 chunk 16, and at depth 3 and 4 (the any-depth kernels)"),
    Phase("titans_kernel_all", _pytest("tests/test_titans_kernel.py", "-m", "not gpu"), 300, "pytest",
          "every Titans kernel test (odd shapes, depth 1-4) compiled"),
    Phase("gpu_tier", _pytest("-m", "gpu", "tests/test_gpu.py"), 300, "pytest",
          "the GPU tier: flex attention, bf16 steps of every memory family, compile vs eager"),
    Phase("routed_attention", [PY, "benchmarks/routed_attention.py", "--quick"], 150,
          about="the routed cross-attention kernels' TFLOP/s and memory"),
    Phase("anchor_160m", _throughput("openlm-160m", steps=10, micro_batches=2, docs=1, extra=("--compare-hf",)),
          240, capped=True, about="the OpenLM-160M anchor against a compiled Hugging Face Llama of its shape"),
]


# -- running ----------------------------------------------------------------------------------------


def _tail(text: str, n: int) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def _json_lines(text: str) -> list:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


_PYTEST_SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b.*? in "
                             r"[\d.]+s.*?)\s*=*$")


def pytest_summary(text: str) -> Optional[str]:
    """The final ``N passed, M failed ... in Xs`` line of a pytest run, or None."""
    found = None
    for line in text.splitlines():
        m = _PYTEST_SUMMARY.match(line.strip())
        if m:
            found = m.group(1)
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(proc: subprocess.Popen) -> None:
    """An overrunning phase: SIGTERM to its process group (the trainer checkpoints and exits on it), up to
    10 s for the leader, then SIGKILL to whatever of the group is left."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def run_phase(phase: Phase, timeout_s: float, log, env: Optional[dict] = None) -> dict:
    """Run one phase in its own process group (environment ``env``, default this process's); returns its
    record (without writing anything else)."""
    argv = phase_argv(phase, timeout_s)
    rec = {"name": phase.name, "about": phase.about, "argv": argv, "timeout_s": round(timeout_s, 1)}
    if phase.env:  # what it set (the forms, waves, switches) beside the command that ran
        rec["env"] = dict(phase.env)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.monotonic()
        try:
            if phase.env:
                env = {**(os.environ if env is None else env), **phase.env}
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env)
        except OSError as e:
            rec.update(status="failed", rc=None, seconds=0.0, error=f"{type(e).__name__}: {e}")
            return rec
        try:
            rc = proc.wait(timeout_s)
            status = "ok" if rc == 0 else "failed"
            _signal_group(proc.pid, signal.SIGKILL)  # a child the phase left behind must not hold the GPU
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc, status = proc.returncode, "timeout"
        rec["seconds"] = round(time.monotonic() - t0, 1)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    rec.update(status=status, rc=rc)
    if phase.kind == "pytest":
        rec["summary"] = pytest_summary(stdout)
    else:
        rec["results"] = _json_lines(stdout)
    rec["tail"] = _tail((stdout + ("\n--- stderr ---\n" + stderr if stderr.strip() else "")).strip(), TAIL_CHARS)
    log.write(f"\n===== {phase.name}: {status} (rc {rc}, {rec['seconds']} s) : {' '.join(argv)}\n")
    log.write(_tail(stdout, LOG_CHARS))
    if stderr.strip():
        log.write("\n----- stderr -----\n" + _tail(stderr, LOG_CHARS))
    log.flush()
    return rec


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_plan(phases: list[Phase], out_dir: Path, budget_s: float, min_start_s: float = 20.0,
             env: Optional[dict] = None, notes: Optional[dict] = None) -> dict:
    """Run ``phases`` in order within ``budget_s`` seconds; a phase starts only with ``min_start_s``
    left and runs at most its own timeout or what is left. ``OUT/gpu_check.json`` is rewritten after
    every phase; returns the final report (``notes`` added to it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": _commit(), "budget_s": budget_s,
              **(notes or {}), "phases": []}
    path = out_dir / "gpu_check.json"
    t0 = time.monotonic()
    with open(out_dir / "gpu_check.log", "w") as log:
        for phase in phases:
            left = budget_s - (time.monotonic() - t0)
            if left < min_start_s:
                report["phases"].append({"name": phase.name, "about": phase.about, "argv": phase.argv,
                                         "status": "skipped", "reason": f"{max(left, 0):.0f} s of the budget left"})
            else:
                rec = run_phase(phase, min(phase.timeout_s, left), log, env)
                if rec["status"] != "ok" and phase.on_failure_env:
                    env = {**(os.environ if env is None else env), **phase.on_failure_env}
                    rec["set_for_later_phases"] = phase.on_failure_env
                report["phases"].append(rec)
            report["elapsed_s"] = round(time.monotonic() - t0, 1)
            _write_json(path, report)
    return report


# -- pytest on a GPU image without it ----------------------------------------------------------------


def _pins() -> list[str]:
    """``TEST_TOOLS`` at the versions constraints.txt pins (unpinned where it names none)."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            pins[name.lower()] = version
    return [f"{t}=={pins[t]}" if t in pins else t for t in TEST_TOOLS]


def prepare(dest: Path = EXTRA) -> int:
    """Here, after ``make-bundle.sh``: download pytest, pytest-timeout and their dependencies as Python 3.12
    wheels into ``.gpu/extra`` (the GPU image has no registry access and may lack pytest)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux2014_x86_64", "-d", str(dest), *_pins()]
    rc = subprocess.run(cmd).returncode
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    print(f"gpu_check --prepare: {len(wheels)} wheel(s) in {dest}: {', '.join(wheels)}" if rc == 0 else
          f"gpu_check --prepare: pip download failed (exit {rc}); the pytest phases need pytest on the GPU image")
    return rc


def precompile_kernels(dest: Path = TRITON_CACHE, triton_here: Path = TRITON_HERE,
                       device_cache: Optional[Path] = None) -> int:
    """Here, after ``make-bundle.sh``: compile the Titans kernels that the recipes, the layer benchmark and
    ``titans_kernel_tune`` launch on the GPU machine, for ``GPU_TARGET`` with ``GPU_TRITON``, into ``dest`` (a Triton
    cache carried in ``.gpu``; ``benchmarks/titans_kernels.py --precompile``, :mod:`memtrain.kernels.precompile`): the
    scan kernels at the sweep's shapes, and one block of each of ``TITANS_RECIPES`` (``--recipes``: the coefficients,
    fused prologue, output stage, retrieval and RoPE as each recipe's first step launches them). On an H200 they
    compiled at their first launch, inside the timed phases (the layer benchmark's first call took 87 s).
    ``GPU_TRITON`` for this Python goes into ``triton_here`` (once); the GPU Python's wheel of it is downloaded for its
    cache keys and deleted after. ``device_cache``: a GPU run's ``OUT/triton-cache.tar.gz`` (:func:`save_compiled`),
    whose kernels are added, and its Inductor graph caches to ``INDUCTOR_CACHE``."""
    if not (triton_here / "triton").is_dir():
        rc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(triton_here),
                             f"triton=={GPU_TRITON}"]).returncode
        if rc != 0:
            print(f"gpu_check --prepare: pip install of triton=={GPU_TRITON} into {triton_here} failed (exit {rc}); "
                  "the kernels will compile on the GPU")
            return rc
    with tempfile.TemporaryDirectory() as tmp:
        rc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--no-deps",
                             "--python-version", GPU_PYTHON, "--implementation", "cp",
                             "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
                             "--platform", "manylinux2014_x86_64", "-d", tmp, f"triton=={GPU_TRITON}"]).returncode
        wheels = sorted(Path(tmp).glob("triton-*.whl"))
        if rc != 0 or not wheels:
            print(f"gpu_check --prepare: no triton=={GPU_TRITON} wheel for Python {GPU_PYTHON} (pip exit {rc}); the "
                  "kernels will compile on the GPU")
            return rc or 1
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(triton_here), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        shutil.rmtree(dest, ignore_errors=True)
        rc = subprocess.run([sys.executable, "benchmarks/titans_kernels.py", "--precompile", str(dest), "--target",
                             GPU_TARGET, "--libtriton-from", str(wheels[0]), "--shapes", TUNE_SHAPES, "--warps",
                             TUNE_WARPS, "--recipes", ",".join(f"recipes/{r}.yaml" for r in TITANS_RECIPES)],
                            cwd=ROOT, env=env).returncode
    from memtrain.kernels.precompile import cache_kernels

    n = len(cache_kernels(dest))
    print(f"gpu_check --prepare: {n} kernel(s) compiled for {GPU_TARGET} with Triton {GPU_TRITON} in {dest}"
          if rc == 0 else f"gpu_check --prepare: precompiling the kernels failed (exit {rc}); they will compile on the GPU")
    if device_cache is not None:
        added = add_device_cache(device_cache, dest)
        graphs = add_device_inductor_cache(device_cache, INDUCTOR_CACHE)
        print(f"gpu_check --prepare: {len(added)} kernel(s) and {graphs} Inductor cache file(s) a GPU run compiled "
              f"added from {device_cache} (the latter to {INDUCTOR_CACHE})")
    return rc


def install_triton_cache(env: dict, src: Optional[Path] = None, dest: Optional[Path] = None) -> dict:
    """There: the kernels ``--prepare`` compiled (``src``) into ``dest``, Triton's cache for the phases
    (``TRITON_CACHE_DIR`` in ``env``). Returns, for the report, how many were installed and which."""
    from memtrain.kernels.precompile import cache_kernels, install_cache

    src, dest = src or TRITON_CACHE, dest or DEVICE_TRITON_CACHE
    if not cache_kernels(src):
        return {"installed": 0, "why": f"no precompiled kernels in {src} (run --prepare here first)"}
    kernels = install_cache(src, dest)
    env["TRITON_CACHE_DIR"] = str(dest)
    made = src / "precompiled.json"  # what --prepare's compile printed last: Triton version, target, triton_key
    try:
        made_with = json.loads(made.read_text()) if made.is_file() else None
    except ValueError:
        made_with = None
    return {"installed": len(kernels), "dir": str(dest), "entries": sorted(kernels), "made_with": made_with,
            "unreadable": sorted(set(cache_kernels(src)) - set(kernels))}


def inductor_files(root: Path) -> list[str]:
    """The files of Inductor's graph caches under ``root`` (its ``INDUCTOR_PARTS``), relative to it, sorted."""
    return sorted(str(p.relative_to(root)) for part in INDUCTOR_PARTS if (root / part).is_dir()
                  for p in (root / part).rglob("*") if p.is_file() and not p.is_symlink())


def _copy_files(src: Path, dest: Path, files: list[str]) -> None:
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dest / rel)


def install_inductor_cache(env: dict, src: Optional[Path] = None, dest: Optional[Path] = None) -> dict:
    """There: the Inductor graph caches earlier GPU runs brought back (``src``, carried in ``.gpu``) copied into
    ``dest``, the phases' ``TORCHINDUCTOR_CACHE_DIR`` (set in ``env`` with or without them, so that what the phases
    add can be brought back). On the H200, titans-400m-mag's first step took 52 s and 80 s, most of it compiling flex
    attention; a second process on the same machine, with that compile in this cache, took 3.6 s. Returns, for the
    report, how many files were installed and (``files``) which."""
    src, dest = src or INDUCTOR_CACHE, dest or DEVICE_INDUCTOR_CACHE
    env["TORCHINDUCTOR_CACHE_DIR"] = str(dest)
    files = inductor_files(src) if src.is_dir() else []
    _copy_files(src, dest, files)
    return {"installed": len(files), "dir": str(dest), "files": files}


def compiled_on_device(cache: dict, dest: Optional[Path] = None) -> list[str]:
    """The kernels the phases compiled into ``dest`` after all (not among the ``cache["entries"]`` installed): those
    the precompiled cache did not hold, or all of them when its keys did not match this machine's Triton."""
    from memtrain.kernels.precompile import cache_kernels

    installed = set(cache.get("entries", ()))
    return sorted(name for entry, name in cache_kernels(dest or DEVICE_TRITON_CACHE).items() if entry not in installed)


def save_compiled(cache: dict, out: Path, src: Optional[Path] = None, limit_bytes: Optional[int] = None,
                  file_limit_bytes: Optional[int] = None, inductor_installed: Optional[list] = None,
                  inductor_src: Optional[Path] = None) -> dict:
    """There, after the plan: what the phases compiled, packed into one gzipped tar ``out``, so that ``--prepare
    --device-cache OUT/triton-cache.tar.gz`` here adds it to the next caches carried. First Inductor's graph-cache
    files in ``inductor_src`` (default ``DEVICE_INDUCTOR_CACHE``) that were not installed (``inductor_installed``),
    under ``inductor/``; then the Triton kernels in ``src`` not among ``cache["entries"]``, the precompiled ones (the
    prologue, output-stage and RoPE kernels, Inductor's, and any precompiled one whose key did not match) -- each
    entry's metadata, binary and source IR. Within each part smallest first, up to ``limit_bytes`` unpacked (default
    ``RETURNED_CACHE_BYTES``) and ``file_limit_bytes`` packed (default ``RETURNED_FILE_BYTES``; the last taken are
    dropped until it fits). One file, because the device tool brings back at most 8 files from OUT (the folder of the
    third H200 run came back as 6 of its 416 files). Their keys are that machine's own."""
    import tarfile

    from memtrain.kernels.precompile import cache_kernels

    installed = set(cache.get("entries", ()))
    src = src or DEVICE_TRITON_CACHE
    inductor_src = inductor_src or DEVICE_INDUCTOR_CACHE
    limit_bytes = RETURNED_CACHE_BYTES if limit_bytes is None else limit_bytes
    file_limit_bytes = RETURNED_FILE_BYTES if file_limit_bytes is None else file_limit_bytes
    graphs = {}  # Inductor: one file per unit
    old = set(inductor_installed or ())
    for rel in inductor_files(inductor_src) if inductor_src.is_dir() else []:
        if rel not in old:
            path = inductor_src / rel
            graphs[rel] = (path.stat().st_size, [(path, f"{INDUCTOR_ARC}/{rel}")])
    kernels = {}
    for entry, name in cache_kernels(src).items():
        if entry not in installed:
            files = [p for p in (src / entry).iterdir() if p.name.startswith(f"__grp__{name}.")
                     or p.suffix in (".json", ".cubin", ".source")]
            kernels[entry] = (sum(p.stat().st_size for p in files), [(p, f"{entry}/{p.name}") for p in files])
    chosen, total = [], 0  # (part, key, size, files), in priority order
    for part, units in (("inductor", graphs), ("triton", kernels)):
        for key, (size, files) in sorted(units.items(), key=lambda kv: kv[1][0]):
            if total + size <= limit_bytes:
                chosen.append((part, key, size, files))
                total += size
    out.parent.mkdir(parents=True, exist_ok=True)
    while True:  # the packed size is known only once written: drop the last taken until it fits
        with tarfile.open(out, "w:gz") as tar:
            for _, _, _, files in chosen:
                for path, arcname in files:
                    tar.add(path, arcname=arcname)
        if out.stat().st_size <= file_limit_bytes or not chosen:
            break
        total -= chosen.pop()[2]
    saved = [part for part, *_ in chosen]
    return {"saved": saved.count("triton"), "of": len(kernels), "inductor_saved": saved.count("inductor"),
            "inductor_of": len(graphs), "bytes": total, "file": str(out), "file_bytes": out.stat().st_size}


def _readable_tar(path: Path) -> bool:
    """Whether ``path`` is a tar file read to its end (a gzipped one cut short on its way back is not)."""
    import tarfile

    try:
        with tarfile.open(path) as tar:
            tar.getmembers()
        return True
    except (tarfile.TarError, OSError, EOFError):
        return False


def add_device_cache(path: Path, dest: Path) -> dict:
    """``--device-cache``: the kernels of a GPU run's ``OUT/triton-cache.tar.gz`` (:func:`save_compiled`; only plain
    files and folders are unpacked) or of such a folder, installed into ``dest``, the cache carried next. Returns
    :func:`memtrain.kernels.precompile.install_cache`'s record of them."""
    import tarfile

    from memtrain.kernels.precompile import install_cache

    if path.is_dir():
        return install_cache(path, dest)
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(path) as tar:
        tar.extractall(tmp, filter="data")
        return install_cache(Path(tmp), dest)


def add_device_inductor_cache(path: Path, dest: Path) -> int:
    """``--device-cache``: the Inductor graph-cache files of a GPU run's tar (its ``inductor/`` folder,
    :func:`save_compiled`) or of such a folder, added to ``dest``, the Inductor cache carried next. Returns how many."""
    import tarfile

    with tempfile.TemporaryDirectory() as tmp:
        root = path
        if not path.is_dir():
            with tarfile.open(path) as tar:
                tar.extractall(tmp, members=[m for m in tar.getmembers() if m.name.startswith(f"{INDUCTOR_ARC}/")],
                               filter="data")
            root = Path(tmp)
        src = root / INDUCTOR_ARC
        files = inductor_files(src) if src.is_dir() else []
        _copy_files(src, dest, files)
        return len(files)


def ensure_test_tools(env: dict, extra: Path = EXTRA, site: Path = EXTRA_SITE) -> str:
    """There: make pytest importable by the phases. Each wheel in ``extra`` whose module this interpreter lacks
    (nothing it has is shadowed) is installed into ``site``, which goes first on the phases' PYTHONPATH
    (``env`` is updated). Returns what was done, for the report."""
    import importlib.util

    wheels = {p.name.split("-")[0].lower(): p for p in sorted(extra.glob("*.whl"))} if extra.is_dir() else {}
    missing = [m for m in ("pytest", "pytest_timeout", *wheels) if importlib.util.find_spec(m) is None]
    missing = list(dict.fromkeys(missing))
    if not missing:
        return "pytest present"
    lacking = [m for m in missing if m not in wheels]
    if lacking:
        return f"missing {', '.join(lacking)} and no wheel for it in {extra} (run --prepare here first)"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target",
           str(site), *(str(wheels[m]) for m in missing)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return f"pip install of {', '.join(missing)} failed: {r.stderr.strip()[-300:]}"
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    return f"installed {', '.join(missing)} into {site}"


# -- reading the results ----------------------------------------------------------------------------


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)


def _top_op(top: Optional[list]) -> str:
    """The profile's costliest op, for a phase line: its name, self seconds and launches (empty without one)."""
    if not top:
        return ""
    op = top[0]
    return f", top op {op['name'][:48]} {_fmt(op['self_s'])} s x{op['count']}"


def _busy(row: dict) -> str:
    """A recipe's device-busy figures: its profiled kernel time over a timed step (the profiler stretches the
    profiled step by its cost per op, so that step's own fraction reads low for many small ops: eager MAC)."""
    if "busy_of_timed_step" in row:
        return (f", device busy {_fmt(row['busy_of_timed_step'])} of a timed step, "
                f"{_fmt(row.get('profile_busy_fraction'))} of the profiled one")
    return f", device busy {_fmt(row['profile_busy_fraction'])}" if "profile_busy_fraction" in row else ""


def phase_line(rec: dict) -> str:
    """One line of the closing table: the phase, its status and time, and its key numbers."""
    head = f"{rec['name']:<22} {rec['status']:<8} {_fmt(rec.get('seconds')):>6} s  "
    if rec["status"] == "skipped":
        return head + rec.get("reason", "")
    if "summary" in rec:
        return head + (rec["summary"] or "no pytest summary (see the log)")
    parts = []
    for row in rec.get("results", []):
        if "tokens_per_s" in row and "mfu" in row:  # train_throughput
            parts.append(f"{row.get('kind', '')} {_fmt(row['tokens_per_s'])} tok/s, MFU {_fmt(row.get('mfu'))}, "
                         f"{_fmt(row.get('peak_memory_gib'))} GiB, loss {_fmt(row.get('loss_first'))}->"
                         f"{_fmt(row.get('loss_last'))}, all finite {row.get('loss_all_finite')}, "
                         f"{row.get('steps_done')} timed steps, fwd/bwd {_fmt(row.get('forward_s'))}/"
                         f"{_fmt(row.get('backward_s'))} s (host {_fmt(row.get('host_forward_s'))}/"
                         f"{_fmt(row.get('host_backward_s'))})"
                         + _busy(row) + _top_op(row.get("profile_top")))
        elif "host_ms_per_micro_batch" in row:  # benchmarks/op_count.py --time
            parts.append(f"{row['ops_total']} ops per micro-batch, host {_fmt(row['host_ms_per_micro_batch'])} ms "
                         f"(fwd/bwd {_fmt(row.get('host_forward_ms'))}/{_fmt(row.get('host_backward_ms'))} ms, "
                         f"{_fmt(row.get('host_us_per_op'))} us per op)")
        elif "chunked_tokens_per_s" in row:  # benchmarks/titans.py
            parts.append(f"T{row['seq_len']} d{row['dim']} L{row['depth']} C{row['chunk_size']}: kernel "
                         f"{_fmt(row.get('kernel_bf16_tokens_per_s'))} tok/s (err "
                         f"{_fmt(row.get('kernel_max_rel_err_vs_torch'))}), bf16 weights "
                         f"{_fmt(row.get('kernel_bf16_weights_tokens_per_s'))} tok/s, torch "
                         f"{_fmt(row['chunked_tokens_per_s'])}" + _top_op(row.get("kernel_profile_top")))
        elif "fwd_bwd_ms" in row and "backward" in row:  # benchmarks/titans_kernels.py, one launch variant
            parts.append(f"{row.get('shape')} {row['kernels']} {row['backward']} w{row.get('num_warps')} wave "
                         f"{row.get('wave')}/{row.get('N')}: fwd {_fmt(row.get('fwd_us_per_chunk'))} / bwd "
                         f"{_fmt(row.get('bwd_us_per_chunk'))} us per chunk, err "
                         f"{_fmt(row.get('max_rel_err_vs_default'))}")
        elif "error" in row and "backward" in row:  # a sweep variant that failed
            parts.append(f"{row.get('shape')} {row['backward']} w{row.get('num_warps')} wave {row.get('wave')}: "
                         f"{row['error'][:80]}")
        elif "device" in row and "torch" in row:  # env
            parts.append(f"{row['device']}, torch {row['torch']}, triton {row.get('triton')}")
        else:
            parts.append(", ".join(f"{k} {_fmt(v)}" for k, v in list(row.items())[:4]))
    return head + ("; ".join(parts) if parts else f"rc {rec.get('rc')}")


def env_record() -> dict:
    """The device and library versions (run as the ``env`` phase, in its own process)."""
    rec = {"python": sys.version.split()[0], "commit": _commit()}
    try:
        rec["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        rec["nvidia_smi"] = f"unavailable: {type(e).__name__}"
    import torch

    rec["torch"] = torch.__version__
    rec["cuda"] = torch.version.cuda
    rec["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no CUDA)"
    rec["capability"] = list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None
    try:
        import triton

        rec["triton"] = triton.__version__
    except ImportError:
        rec["triton"] = None
    else:  # equal to the precompiled cache's (gpu_check --prepare prints them) when its entries can be found here
        from memtrain.kernels.precompile import backend_key, triton_key_digest

        rec["triton_key"] = triton_key_digest()
        if torch.cuda.is_available():
            rec["triton_backend"] = backend_key(triton.runtime.driver.active.get_current_target())
    return rec


def select(phases: list[Phase], names: Optional[str]) -> list[Phase]:
    """The phases whose name equals or starts with one of the comma-separated ``names`` (all if None)."""
    if not names:
        return list(phases)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    chosen = [p for p in phases if any(p.name == w or p.name.startswith(w) for w in wanted)]
    unknown = [w for w in wanted if not any(p.name == w or p.name.startswith(w) for p in phases)]
    if unknown:
        raise SystemExit(f"gpu_check: no phase named {', '.join(unknown)}; the phases are "
                         f"{', '.join(p.name for p in phases)}")
    return chosen


def missing_paths(phases: list[Phase]) -> list[str]:
    """Scripts, test files and recipes a plan names that do not exist (what ``--list`` checks)."""
    missing = []
    for p in phases:
        for arg in p.argv[1:]:
            if arg.endswith((".py", ".yaml")) and not arg.startswith("-") and not (ROOT / arg).exists():
                missing.append(f"{p.name}: {arg}")
    return missing


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for gpu_check.json and gpu_check.log ($OUT on the device)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole plan (default 540)")
    ap.add_argument("--phases", default=None, help="comma-separated phase names or name prefixes (default: all)")
    ap.add_argument("--list", action="store_true", help="print the plan and check its paths; run nothing")
    ap.add_argument("--prepare", action="store_true",
                    help="here, after make-bundle.sh: download pytest's wheels into .gpu/extra; run nothing else")
    ap.add_argument("--device-cache", default=None, metavar="FILE",
                    help="with --prepare: a GPU run's OUT/triton-cache.tar.gz, whose kernels join .gpu/triton-cache "
                         "and its Inductor graph caches .gpu/inductor-cache")
    ap.add_argument("--env", action="store_true", help=argparse.SUPPRESS)  # the env phase itself
    args = ap.parse_args(argv)
    if args.env:
        print(json.dumps(env_record()), flush=True)
        return 0
    if args.device_cache is not None:  # checked before minutes of compiling, not after
        if not args.prepare:
            ap.error("--device-cache goes with --prepare")
        dc = Path(args.device_cache)
        if not (dc.is_dir() or (dc.is_file() and _readable_tar(dc))):
            ap.error(f"--device-cache {dc}: not a folder or a whole tar file; pass a GPU run's "
                     "OUT/triton-cache.tar.gz")
    if args.prepare:  # both, whatever the first gives: each alone still saves the GPU time
        rc = prepare()
        return precompile_kernels(device_cache=Path(args.device_cache) if args.device_cache else None) or rc
    phases = select(PLAN, args.phases)
    if args.list:
        for p in phases:
            print(f"{p.name:<22} {p.timeout_s:>4.0f} s  {' '.join(p.argv[1:])}\n{'':<30}{p.about}")
        missing = missing_paths(phases)
        for m in missing:
            print(f"missing: {m}")
        return 1 if missing else 0
    if not args.out:
        ap.error("--out DIR is required (or --list)")
    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"gpu_check: cannot create --out {args.out}: {e.strerror}; pass a writable folder ($OUT)")
    env = dict(os.environ)
    tools = ensure_test_tools(env) if any(p.kind == "pytest" for p in phases) else "not needed"
    cache = install_triton_cache(env)
    env["TRITON_CACHE_DIR"] = str(DEVICE_TRITON_CACHE)  # with or without precompiled kernels: save_compiled reads it
    inductor = install_inductor_cache(env)
    inductor_installed = inductor.pop("files")
    report = run_plan(phases, Path(args.out), args.budget, env=env, notes={"test_tools": tools,
                                                                        "triton_cache": cache,
                                                                        "inductor_cache": inductor})
    cache["returned"] = save_compiled(cache, Path(args.out) / "triton-cache.tar.gz",
                                      inductor_installed=inductor_installed)
    inductor["compiled_on_device"] = len(set(inductor_files(DEVICE_INDUCTOR_CACHE)) - set(inductor_installed))
    _write_json(Path(args.out) / "gpu_check.json", report)
    if cache["installed"]:
        cache["compiled_on_device"] = compiled_on_device(cache)
        env_row = next((row for rec in report["phases"] if rec["name"] == "env" for row in rec.get("results", [])),
                       {})
        made = cache.get("made_with") or {}
        for part in ("triton_key", "backend"):  # the entries can be found only where both parts of the keys agree
            here = env_row.get("triton_backend" if part == "backend" else part)
            if here is not None:
                cache[f"{part}_matches"] = here == made.get(part)
        _write_json(Path(args.out) / "gpu_check.json", report)
    print(f"\ngpu_check: {len(report['phases'])} phase(s) in {report['elapsed_s']} s of a {args.budget:.0f} s budget; "
          f"full results in {Path(args.out) / 'gpu_check.json'}; test tools: {tools}; precompiled kernels: "
          f"{cache['installed']}" + (f" (Triton key matches: {cache.get('triton_key_matches', 'not checked')}, "
                                     f"backend matches: {cache.get('backend_matches', 'not checked')}), "
                                     f"compiled here after all: {', '.join(cache['compiled_on_device']) or 'none'}"
                                     if cache["installed"] else "")
          + f"; Inductor cache files: {inductor['installed']} carried, {inductor['compiled_on_device']} added here")
    for rec in report["phases"]:
        print(phase_line(rec))
    return 0 if all(r["status"] == "ok" for r in report["phases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
