"""Triton kernels compiled for a GPU on a machine without one, into Triton's own cache, by the code that launches them.

Why. A Triton kernel compiles at its first launch: the Titans scan's backward takes 8 s at the recipes' chunk of 16
and 30 s at chunk 64 on one CPU core (sm_90, Triton 3.6), and a GPU that starts a job, or a benchmark that tries
four launch variants, spends minutes of its time compiling before it computes. What a launch compiles depends only
on the kernel's source, its constexprs and launch options, the types of its arguments, which integers are 1 or
divisible by 16 and which pointers are 16-byte aligned -- not on the values -- so the same launch code, run on CPU
tensors of the same dtypes and layouts, compiles the same binaries, and Triton keeps them in its cache
(``TRITON_CACHE_DIR``) under the same keys. Copied to the GPU machine's cache, its first launch finds them there.

How. Inside :func:`compile_only`, Triton's active driver reports the target GPU (``cuda:90``: an H100 or H200) and
every ``@triton.jit`` launch compiles -- with Triton's own ``ptxas``, no GPU needed -- and returns without
launching: the kernels' outputs stay as allocated (uninitialised), so only the launches matter, not the results.
Launch code that refuses CPU tensors (:func:`memtrain.kernels.titans.use_triton`) allows them while
:data:`ACTIVE` is set. Triton's cache key holds a digest of the Triton build (:func:`triton.runtime.cache.triton_key`),
which differs between the wheels of one Triton version for two Pythons only in ``libtriton``'s native library:
``libtriton`` (a wheel of the same version built for the GPU machine's Python) makes the keys that machine computes.

    with compile_only("cuda:90", cache_dir) as report:    # TRITON_INTERPRET unset, so @triton.jit is compiled
        ...launch the kernels on CPU tensors...
    report.compiled, report.cached                      # kernel names compiled now / found in the cache

On the GPU machine, :func:`install_cache` copies such a cache into place (rewriting the absolute paths Triton records
in each entry) and :func:`cache_kernels` lists a cache's kernels, so what was compiled there after all shows. Only
the Triton version and build the cache was made with will find its entries: another one misses and compiles as
before, nothing worse.

Torch-free; Triton is imported inside the functions that use it, so :func:`install_cache` and :func:`cache_kernels` run
without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Iterator, Optional, Union

ACTIVE = False  # True inside compile_only(): launch code may take CPU tensors, nothing is launched


@dataclasses.dataclass
class Report:
    """What one :func:`compile_only` block did: the kernels it compiled and those the cache already held (names, in
    launch order), the target, the cache directory, the Triton version, the digest of the cache key's Triton part
    (``triton_key``: its sha256, as :func:`triton_key_digest` gives it on the GPU machine) and its compiler part
    (``backend``: ptxas's version and the architecture, as :func:`backend_key` gives it there)."""

    target: str
    cache_dir: str
    triton_version: str
    triton_key: str
    backend: str
    events: list = dataclasses.field(default_factory=list)  # (kernel name, found in the cache), as compile_events

    @property
    def compiled(self) -> list:
        return [name for name, hit in self.events if not hit]

    @property
    def cached(self) -> list:
        return [name for name, hit in self.events if hit]


@contextlib.contextmanager
def compile_events() -> Iterator[list]:
    """``[(kernel name, found in Triton's cache)]`` of every compilation Triton does within the block, through its
    compilation listener (chained to one already set); empty under the interpreter, which compiles nothing, or with
    a Triton that has no listeners."""
    events: list = []
    try:
        from triton import knobs

        before = knobs.compilation.listener
    except (ImportError, AttributeError):
        yield events
        return

    def listener(src, metadata, metadata_group, times, cache_hit):
        events.append((getattr(src, "name", "?"), bool(cache_hit)))
        if before is not None:
            before(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    knobs.compilation.listener = listener
    try:
        yield events
    finally:
        knobs.compilation.listener = before


def parse_target(target: str):
    """``"cuda:90"`` (backend and architecture: compute capability 9.0, an H100 / H200) as Triton's ``GPUTarget``."""
    from triton.backends.compiler import GPUTarget

    backend, sep, arch = target.partition(":")
    if not sep or backend != "cuda" or not arch.isdigit():
        raise ValueError(f"target must be 'cuda:<compute capability>' such as 'cuda:90' (an H100 / H200), got {target!r}")
    return GPUTarget("cuda", int(arch), 32)


class _CompileOnlyDriver:
    """What :meth:`triton.runtime.jit.JITFunction.run` asks of Triton's driver before it compiles: the device (0),
    its stream (0, never used: nothing launches) and the target."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: Optional[int] = None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _own_libtriton() -> Path:
    import sysconfig

    import triton

    ext = sysconfig.get_config_var("EXT_SUFFIX").split(".")[-1]
    return Path(triton.__file__).parent / "_C" / f"libtriton.{ext}"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def libtriton_digest(wheel: Union[str, Path]) -> str:
    """The sha256 of ``triton/_C/libtriton.so`` in a Triton wheel -- the part of Triton's cache key
    (:func:`triton.runtime.cache.triton_key`) that differs between one version's wheels for two Pythons. The wheel must
    be of the Triton version imported here, with the same Python files (ValueError otherwise: its keys would differ
    in more than that)."""
    import triton

    root = Path(triton.__file__).parent
    if not Path(wheel).is_file():
        raise ValueError(f"no Triton wheel at {wheel}: pass the path of the GPU machine's triton-*.whl "
                         "(pip download triton==VERSION --python-version X.Y --only-binary=:all: --no-deps)")
    if not zipfile.is_zipfile(wheel):
        raise ValueError(f"{wheel} is not a wheel (not a zip archive): download it again")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
        version = next((line.split(":", 1)[1].strip() for line in zf.read(meta).decode().splitlines()
                        if line.startswith("Version:")), None) if meta else None
        if version != triton.__version__:
            raise ValueError(f"{wheel} is Triton {version}, this is Triton {triton.__version__}: install the wheel's "
                             f"version here first (pip install --target DIR triton=={version}, DIR first on PYTHONPATH)")
        differ = []
        for name in names:
            if name.startswith("triton/") and name.endswith(".py"):
                local = root / name[len("triton/"):]
                if not local.is_file() or hashlib.sha256(zf.read(name)).hexdigest() != _sha256_file(local):
                    differ.append(name)
        if differ:
            raise ValueError(f"{wheel} and the Triton imported here ({root}) differ in {len(differ)} Python file(s) "
                             f"({', '.join(differ[:3])}): not one Triton build for two Pythons")
        member = next((n for n in names if n.startswith("triton/_C/libtriton.") and n.endswith(".so")), None)
        if member is None:
            raise ValueError(f"{wheel} holds no triton/_C/libtriton.so")
        h = hashlib.sha256()
        with zf.open(member) as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()


def _retargeted_triton_key(libtriton: Optional[str]) -> str:
    """Triton's ``triton_key()`` as the build whose ``libtriton`` has the sha256 ``libtriton`` computes it (this
    build's own when None)."""
    from triton.runtime import cache

    key = cache.triton_key()
    if libtriton is None:
        return key
    own = _sha256_file(_own_libtriton())
    if own not in key:
        raise RuntimeError(f"this Triton's cache key does not hold its libtriton's digest ({own[:12]}...): cannot "
                           "compute another build's key")
    return key.replace(own, libtriton)


def backend_key(target) -> str:
    """The compiler part of every cache key for ``target`` (a ``GPUTarget``, or ``"cuda:90"``): for CUDA, the version
    of the ``ptxas`` Triton runs and the architecture. Equal here and on the GPU machine, or its kernels miss."""
    from triton.compiler.compiler import make_backend

    return make_backend(parse_target(target) if isinstance(target, str) else target).hash()


def triton_key_digest(libtriton: Optional[str] = None) -> str:
    """sha256 of the Triton part of every cache key this Triton computes (with ``libtriton``: as the build with that
    native library computes it). Equal on two machines, and the kernels' launches compile to the same entries."""
    return hashlib.sha256(_retargeted_triton_key(libtriton).encode()).hexdigest()


@contextlib.contextmanager
def compile_only(target: str, cache_dir: Union[str, Path], libtriton: Optional[str] = None) -> Iterator[Report]:
    """Within the block, every ``@triton.jit`` launch compiles for ``target`` (``"cuda:90"``) into ``cache_dir`` (only
    each kernel's binary and metadata) and launches nothing; ``libtriton``: the digest (:func:`libtriton_digest`) of
    the GPU machine's Triton build when it is not this one (another Python), so the entries carry its keys. Yields a
    :class:`Report` filled as the block runs. Needs ``TRITON_INTERPRET`` unset when the kernels were defined (the
    interpreter compiles nothing). Everything is restored on exit."""
    global ACTIVE
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_only compiles kernels for a GPU: unset TRITON_INTERPRET (the interpreter compiles "
                           "nothing)")
    import triton
    from triton import knobs
    from triton.runtime import cache
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    gpu = parse_target(target)
    cache_dir = Path(cache_dir).resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = _retargeted_triton_key(libtriton)
    report = Report(target=target, cache_dir=str(cache_dir), triton_version=triton.__version__,
                    triton_key=hashlib.sha256(key.encode()).hexdigest(), backend=backend_key(gpu))

    run = JITFunction.run
    touched: list = []

    def compile_without_launch(self, *args, grid, warmup, **kwargs):
        touched.append(self)
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    saved = (driver._active, knobs.cache.dir, knobs.compilation.store_binary_only, cache.triton_key)
    driver.set_active(_CompileOnlyDriver(gpu))
    knobs.cache.dir = str(cache_dir)
    knobs.compilation.store_binary_only = True
    cache.triton_key = lambda: key
    JITFunction.run = compile_without_launch
    ACTIVE = True
    try:
        with compile_events() as report.events:
            yield report
    finally:
        ACTIVE = False
        JITFunction.run = run
        driver._active, knobs.cache.dir, knobs.compilation.store_binary_only, cache.triton_key = saved
        for fn in touched:  # the binaries for the target GPU must not serve a later launch in this process
            fn.device_caches.clear()


def cache_kernels(cache_dir: Union[str, Path]) -> dict:
    """``{entry: kernel name}`` of a Triton cache directory: each entry (a directory named by its key's hash) holding a
    kernel's metadata (``<name>.json`` listed by its group file ``__grp__<name>.json``)."""
    out = {}
    root = Path(cache_dir)
    if not root.is_dir():
        return out
    for entry in sorted(p for p in root.iterdir() if p.is_dir()):
        for grp in entry.glob("__grp__*.json"):
            name = grp.name[len("__grp__"):-len(".json")]
            if (entry / f"{name}.json").is_file() and any(entry.glob(f"{name}.*bin")):
                out[entry.name] = name
    return out


def install_cache(src: Union[str, Path], dest: Union[str, Path]) -> dict:
    """Copy the kernels of the Triton cache ``src`` into ``dest`` (Triton's cache directory on this machine,
    ``TRITON_CACHE_DIR``), rewriting the absolute file paths each entry's group file records (Triton finds an entry's
    files through them) to their new place. An entry whose group file does not parse is left out (Triton would
    compile that kernel again). Returns :func:`cache_kernels` of what was installed."""
    src, dest = Path(src), Path(dest).resolve()
    installed = {}
    for entry, name in cache_kernels(src).items():
        groups = {}
        for grp in (src / entry).glob("__grp__*.json"):
            try:
                data = json.loads(grp.read_text())
                groups[grp.name] = {k: Path(v).name for k, v in data["child_paths"].items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                break
        else:
            target = dest / entry
            shutil.copytree(src / entry, target, dirs_exist_ok=True)
            for grp_name, children in groups.items():
                (target / grp_name).write_text(json.dumps(
                    {"child_paths": {k: str(target / v) for k, v in children.items()}}))
            installed[entry] = name
    return installed
