"""Training and validation batches from a prepared data folder, via MosaicML Streaming.

:func:`build_loader` wraps ``<data_dir>/<split>`` in a ``streaming.StreamingDataset`` and a
``streaming.StreamingDataLoader``. The distributed layout comes from the launcher's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), which Streaming reads itself; with
several ranks it synchronises them through ``torch.distributed`` (initialising a gloo group from
``MASTER_ADDR``/``MASTER_PORT`` itself if the trainer has not done so yet).

Sample order. Within an epoch Streaming fixes one global order of samples that depends only on the
data, ``run.seed``, the epoch and ``data.num_canonical_nodes``; at micro-step ``i`` the ranks
together hold positions ``[i*W*B, (i+1)*W*B)`` of it (``W`` ranks, micro-batch ``B``), each rank a
disjoint part. So the samples of one optimizer step (a global batch of ``G`` sequences, split into
micro-batches and accumulation steps) are the same whatever ``W`` and ``B`` are, provided every epoch
holds a whole number of global batches. For the training split :func:`build_loader` makes that true
by setting Streaming's ``epoch_size`` to the number of samples rounded down to a multiple of ``G``
(and of ``num_canonical_nodes``): each epoch leaves out fewer than ``G`` samples, a different
random subset each epoch when shuffling. (Streaming also requires the number of nodes and
``num_canonical_nodes`` to divide one another.)

Resumption. :class:`LoaderIterator` yields batches forever, starting the next epoch when one ends;
its :meth:`~LoaderIterator.state_dict` (JSON-serialisable) lets a fresh iterator continue with exactly
the batches the original would have produced, also across epoch boundaries and world-size changes.

Shared memory. Streaming coordinates the ranks of a node through shared memory registered under a
new numeric prefix per dataset; with local-only data (``remote=None``) several datasets, including
two on the same folder, coexist in one process, and segments leaked by a killed run are skipped,
never reused (Streaming also leaves small ``NNNNNN_*_filelock`` files in the temporary directory,
whose prefixes it skips likewise; :func:`sweep_orphan_filelocks` removes those of prefixes no dataset
holds). :func:`clean_stale_shared_memory` removes leaked segments but also destroys those of live
datasets on the same host, so call it only at start-up, before any dataset exists, and only when no
other job on the node uses Streaming.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import numpy as np
import torch

from memtrain.config import Recipe
from memtrain.data.clustered import affine_groups
from memtrain.data.prepare import FORMAT_VERSION, META
from memtrain.errors import DataError
from memtrain.locking import exclusive_nowait, hold_shared

if TYPE_CHECKING:
    from streaming import StreamingDataLoader

SPLITS = ("train", "val")
IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default


def data_location(recipe: Recipe) -> tuple[Path, Optional[str]]:
    """(local folder with meta.json and the shard folders or their cache, remote root or None).

    Without ``data.remote`` the shards are read in place from ``data.dir``. With it, meta.json is
    fetched from the remote into this run's cache folder (``data.cache_dir``, default
    ``<run.dir>/data-cache``) and Streaming downloads shards on demand into the cache's folder for that
    meta.json, ``data-<xxh64 of its bytes>``; a cache per run keeps concurrent jobs on one host from sharing
    (and corrupting) a Streaming cache. meta.json is fetched afresh every call (it is small): when the remote
    was prepared again, its shards go to a new folder instead of mixing with the old ones (Streaming would
    take the cached shards and index as they were), and the folders of older data that no process reads any
    more are deleted (see :func:`_hold_cache`).
    """
    if not recipe.data.remote:
        return recipe.data_dir, None
    remote = recipe.data.remote.rstrip("/")
    cache = Path(recipe.data.cache_dir) if recipe.data.cache_dir else recipe.run_dir / "data-cache"
    cache.mkdir(parents=True, exist_ok=True)
    import xxhash

    fetched = fetch_file(remote, META, cache).read_bytes()
    root = cache / f"{_CACHE_PREFIX}{xxhash.xxh64(fetched).hexdigest()}"
    _hold_cache(root, fetched)
    return root, remote


_CACHE_PREFIX = "data-"
# The remote data folders of the cache this process reads: a shared flock on their meta.json, held until it exits
_HELD_CACHES: dict[str, int] = {}


def _hold_cache(root: Path, fetched: bytes) -> None:
    """Make ``root`` the cache folder of the remote data whose meta.json holds ``fetched``, and hold a shared lock on
    its meta.json for the rest of the process, so that no other process deletes it while Streaming reads it. Then
    delete the cache's other data folders that nobody holds: those of data the remote held before. Where the
    filesystem has no locks nothing is deleted."""
    if str(root) in _HELD_CACHES:
        return
    meta = root / META
    for _ in range(3):  # a prune may delete the folder between its creation and the lock: create it again
        root.mkdir(exist_ok=True)
        if not meta.is_file():
            tmp = root / f".{META}.{os.getpid()}"
            tmp.write_bytes(fetched)
            os.replace(tmp, meta)
        fd = hold_shared(meta)  # waits only while a prune deletes this very folder
        if fd is not None:
            _HELD_CACHES[str(root)] = fd
            break
    else:
        raise DataError(f"the data cache {root} was deleted while it was being set up, three times; is another "
                        "run using the same data.cache_dir? Give each run its own")
    for other in root.parent.glob(f"{_CACHE_PREFIX}*"):
        if other != root and other.is_dir():
            _remove_unheld_cache(other)


def _remove_unheld_cache(folder: Path) -> None:
    """Delete the cache folder of older remote data unless a process holds its meta.json (:func:`_hold_cache`): take
    an exclusive lock without waiting, then delete. A folder without meta.json (one being set up) stays, and so does
    every folder where the filesystem has no locks (a running reader may use it) or a lock fails otherwise."""
    try:
        with exclusive_nowait(folder / META) as state:
            if state == "locked":
                shutil.rmtree(folder, ignore_errors=True)
    except OSError:  # clean-up is best effort
        pass


def fetch_file(remote: str, name: str, cache: Path) -> Path:
    """Download ``<remote>/<name>`` to ``cache/name`` through a private name, so concurrent ranks never read a
    half-written file; :class:`DataError` naming the remote file when the download fails."""
    from streaming.base.storage.download import CloudDownloader

    remote = remote.rstrip("/")
    target = Path(cache) / name
    tmp = target.parent / f".{target.name}.{os.getpid()}"
    try:
        CloudDownloader.direct_download(f"{remote}/{name}", str(tmp))
    except Exception as e:  # each storage backend raises its own types
        tmp.unlink(missing_ok=True)
        raise DataError(f"cannot fetch {remote}/{name} ({type(e).__name__}: {e}); check data.remote and "
                        "credentials, or prepare the data there with `memtrain prepare`") from None
    os.replace(tmp, target)
    return target


def recipe_meta(recipe: Recipe) -> dict[str, Any]:
    """meta.json of the recipe's prepared data, wherever it lives (see :func:`data_location`)."""
    return read_meta(data_location(recipe)[0], recipe)


def read_meta(data_dir: str | Path, recipe: Optional[Recipe] = None) -> dict[str, Any]:
    """meta.json of a prepared data folder; checks it against ``recipe.data.seq_len`` when given."""
    data_dir = Path(data_dir)
    path = data_dir / META
    if not path.is_file():
        raise DataError(f"no prepared data in {data_dir}; run `memtrain prepare RECIPE` first (or set data.dir "
                        "to a prepared folder)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({e}); run `memtrain prepare RECIPE --force`") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{data_dir} was prepared in data format {meta.get('format_version')}, this memtrain "
                        f"reads format {FORMAT_VERSION}; run `memtrain prepare RECIPE --force`")
    seq_len = recipe.data.seq_len if recipe is not None else None
    if seq_len is not None and meta["seq_len"] != seq_len:
        raise DataError(f"{data_dir} holds sequences of {meta['seq_len']} tokens but data.seq_len is {seq_len}; "
                        f"set data.seq_len: {meta['seq_len']}, or prepare the data again for {seq_len} "
                        "(another data.dir, or `memtrain prepare RECIPE --force`)")
    return meta


def check_clustering(meta: dict[str, Any], recipe: Recipe) -> None:
    """The prepared tree must be the one the recipe describes (memories are sized by it)."""
    cl, want = meta.get("clustering") or {}, recipe.data.clustering
    if not cl:
        if want.enabled:
            raise DataError(f"{recipe.data_dir} was prepared without clustering but data.clustering.enabled is "
                            "true; prepare it again (`memtrain prepare RECIPE --force`) or use another data.dir")
        return
    for key in ("branching", "depth"):
        if want.enabled and cl[key] != getattr(want, key):
            raise DataError(f"{recipe.data_dir} holds a cluster tree with {key} {cl[key]} but data.clustering.{key} "
                            f"is {getattr(want, key)}; set it to {cl[key]}, or prepare the data again")


def document_ids(input_ids: torch.Tensor, eot_id: int) -> torch.Tensor:
    """Document index per position: the number of EOT tokens strictly before it.

    An EOT token belongs to the document it ends. ``[..., T]`` -> LongTensor ``[..., T]``. The loader
    computes these for every batch (``batch["doc_ids"]``); the models consume them as tensors (document
    masks, per-document positions) and never see the EOT id.
    """
    is_eot = (input_ids == eot_id).long()
    return is_eot.cumsum(-1) - is_eot


class Collate:
    """Turns samples ``{"tokens": uint array [seq_len + 1]}`` into a training batch of LongTensors.

    ``input_ids`` and ``labels`` are the tokens without their last and first position; ``doc_ids[b, t]``
    counts the end-of-text tokens strictly before ``t`` in ``input_ids[b]``, so an end-of-text token
    belongs to the document it ends.
    """

    def __init__(self, eot_id: int, branching: Optional[int] = None, depth: Optional[int] = None):
        self.eot_id = eot_id
        self.branching, self.depth = branching, depth

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        tokens = torch.from_numpy(np.stack([s["tokens"] for s in samples]).astype(np.int64))
        batch: dict[str, torch.Tensor] = {}
        if self.depth is not None:
            # Cluster-prefixed data: [leaf, t_0 .. t_seq_len]; every level's id follows from the leaf.
            leaf, tokens = tokens[:, 0], tokens[:, 1:]
            n_leaves = self.branching**self.depth
            if int(leaf.min()) < 0 or int(leaf.max()) >= n_leaves:
                bad = int(leaf[(leaf < 0) | (leaf >= n_leaves)][0])
                raise DataError(f"a sample's cluster id {bad} lies outside [0, {n_leaves}) = [0, k^p) for "
                                f"branching {self.branching} and depth {self.depth}; the shards do not belong to "
                                "this clustering: prepare the data again")
            batch["cluster_ids"] = levels_from_leaf(leaf, self.branching, self.depth)
        input_ids, labels = tokens[:, :-1], tokens[:, 1:].clone()
        # EOT -> EOT never occurs in text (empty documents are skipped): it is padding at a cluster's end.
        labels[(input_ids == self.eot_id) & (labels == self.eot_id)] = IGNORE_INDEX
        batch.update({"input_ids": input_ids.contiguous(), "labels": labels,
                      "doc_ids": document_ids(input_ids, self.eot_id)})
        if samples and "sample_index" in samples[0]:  # each sample's global index (memtrain.data.indexed)
            batch["sample_index"] = torch.tensor([int(s["sample_index"]) for s in samples], dtype=torch.long)
        return batch


def levels_from_leaf(leaf: torch.Tensor, branching: int, depth: int) -> torch.Tensor:
    """Global cluster index at every level, ``[..., depth]``: ``id_l = leaf // k^(depth - l)``."""
    powers = torch.tensor([branching ** (depth - 1 - level) for level in range(depth)], dtype=torch.long)
    return leaf[..., None] // powers


def collate(samples: list[dict[str, Any]], eot_id: int, branching: Optional[int] = None,
            depth: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Functional form of :class:`Collate`."""
    return Collate(eot_id, branching, depth)(samples)


def train_epoch_size(num_samples: int, sequences_per_step: int, num_canonical_nodes: int) -> int:
    """Samples per training epoch: ``num_samples`` rounded down to whole global batches (see module doc)."""
    unit = math.lcm(sequences_per_step, num_canonical_nodes)
    if num_samples < unit:
        # Fewer samples than one global batch: every epoch repeats some of them (Streaming upsamples).
        return unit
    return num_samples // unit * unit


def build_loader(recipe: Recipe, split: str, micro_batch_size: int,
                 shuffle: Optional[bool] = None) -> "StreamingDataLoader":
    """A ``StreamingDataLoader`` over ``<data_dir>/<split>`` yielding :class:`Collate` batches.

    ``shuffle`` defaults to ``data.shuffle`` for ``"train"`` and False for ``"val"``. Training batches
    always hold ``micro_batch_size`` sequences; the last validation batch may be smaller.
    """
    from streaming import Stream, StreamingDataLoader

    from memtrain.data.indexed import IndexedStreamingDataset as StreamingDataset

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root, remote = data_location(recipe)
    meta = read_meta(root, recipe)
    if meta["vocab_size"] > recipe.model.vocab_size:
        raise DataError(f"the data in {recipe.data_dir} uses {meta['vocab_size']} token ids but model.vocab_size "
                        f"is {recipe.model.vocab_size}; set model.vocab_size to at least {meta['vocab_size']}")
    local = (root / split).resolve()
    n = meta[f"{split}_samples"]
    if n == 0 or not (remote or (local / "index.json").is_file() or meta.get("streams", {}).get(split)):
        hint = "data.val_fraction is 0" if split == "val" else "it is empty"
        raise DataError(f"{recipe.data_dir} has no {split} split ({hint}); prepare it again with "
                        f"{'data.val_fraction > 0' if split == 'val' else 'more data'}")
    if shuffle is None:
        shuffle = recipe.data.shuffle if split == "train" else False
    epoch_size = None
    if split == "train":
        epoch_size = train_epoch_size(n, recipe.sequences_per_step, recipe.data.num_canonical_nodes)
    clustering = meta.get("clustering")
    stripe = None
    if clustering:
        check_clustering(meta, recipe)
        streams = meta["streams"][split]
        collate_fn = Collate(meta["eot_id"], clustering["branching"], clustering["depth"])
        if recipe.data.placement == "affine" and split == "train":
            # This rank's group reads only its subtrees' streams, as a world of its own; the group's
            # ranks take turns on its batches (rank j of s: rows j*B..(j+1)*B of every s*B batch).
            world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
            groups, per_group = affine_groups({s["subtree"]: s["samples"] for s in streams}, world)
            mine = set(groups[rank // per_group])
            streams = [s for s in streams if s["subtree"] in mine]
            stripe = (rank % per_group, per_group)
            n = sum(s["samples"] for s in streams)
            epoch_size = train_epoch_size(n, micro_batch_size * per_group * recipe.grad_accum_steps(world),
                                          recipe.data.num_canonical_nodes)
        # One stream per level-1 subtree; the shuffle mixes them.
        source = {"streams": [Stream(local=str((root / s["dir"]).resolve()),
                                     remote=f"{remote}/{s['dir']}" if remote else None) for s in streams]}
    else:
        source = {"local": str(local), "remote": f"{remote}/{split}" if remote else None}
        collate_fn = Collate(meta["eot_id"])
    batch_size = micro_batch_size * (stripe[1] if stripe else 1)
    construct = dict(**source, shuffle=shuffle, shuffle_seed=recipe.run.seed, batch_size=batch_size,
                     num_canonical_nodes=recipe.data.num_canonical_nodes, replication=None, epoch_size=epoch_size)
    if stripe:
        with _world_of_one(), _host_prefix_lock(every_rank=True):
            dataset = StreamingDataset(**construct)
        # Every rank must be past its turn at the host lock before any rank builds another dataset:
        # a global one holds the lock through Streaming's barriers, which would wait for a rank still
        # queued for the lock here.
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        collate_fn = _Stripe(collate_fn, stripe[0], micro_batch_size)
    else:
        with _host_prefix_lock(), _leaders_prefix():
            dataset = StreamingDataset(**construct)
    loader = StreamingDataLoader(
        dataset, batch_size=batch_size, num_workers=recipe.data.num_workers,
        collate_fn=collate_fn, drop_last=split == "train",
        persistent_workers=False, pin_memory=torch.cuda.is_available(),
    )
    loader.memtrain_meta = meta  # for LoaderIterator's consistency check
    loader.memtrain_subtrees = sorted(int(s["subtree"]) for s in streams) if clustering else None
    loader.memtrain_world_of_one = stripe is not None  # Streaming re-reads the layout in state_dict()
    return loader


class ValidationSet:
    """The validation sequences of every evaluation, split over the ranks; iterate it for this rank's
    micro-batches (a fresh pass each time).

    ``batches`` > 0 selects ``batches * micro_batch_size`` sequences of the split evenly spaced over it
    (sample ``floor(i * N / n)`` for ``i < n``, so every level-1 subtree's stream is represented);
    0 selects the whole split. The selection depends only on the data and the recipe, never on the
    number of ranks: rank ``r`` of ``W`` evaluates selected sequences ``r, r + W, ...`` by their global
    index (Streaming's random access, so none is repeated or dropped to even out the ranks), and every
    rank runs the same number of micro-batches (a collective forward such as ZeRO-3's needs that): a
    rank left without sequences runs one more batch whose labels are all ignored. The validation loss
    is then the sum of token losses over all ranks divided by the number of scored tokens, the same on
    any world size (``memtrain.launcher.train.evaluate``).
    """

    def __init__(self, recipe: Recipe, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                 batches: int = 0):
        loader = build_loader(recipe, "val", micro_batch_size, shuffle=False)
        self.dataset, self.collate = loader.dataset, loader.collate_fn
        total = int(self.dataset.num_samples)
        count = total if batches <= 0 else min(total, batches * micro_batch_size)
        self.indices = [i * total // count for i in range(count)]
        self.mine = self.indices[rank::world_size]
        self.micro = micro_batch_size
        self.num_batches = math.ceil(math.ceil(count / world_size) / micro_batch_size) if count else 0

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for b in range(self.num_batches):
            chosen = self.mine[b * self.micro:(b + 1) * self.micro]
            batch = self.collate([self.dataset[i] for i in chosen or self.indices[:1]])
            if not chosen:
                batch["labels"].fill_(IGNORE_INDEX)
            yield batch


def affine_subtree_ranks(recipe: Recipe, world_size: int) -> list[list[int]]:
    """For cluster-affine placement: the ranks that read each level-1 subtree (the same groups the
    train loader forms with :func:`affine_groups`), for owning the subtree's memory rows."""
    meta = recipe_meta(recipe)
    streams = meta["streams"]["train"]
    groups, per_group = affine_groups({s["subtree"]: s["samples"] for s in streams}, world_size)
    out: list[list[int]] = [[] for _ in range(recipe.data.clustering.branching)]
    for g, subtrees in enumerate(groups):
        for st in subtrees:
            out[st] = list(range(g * per_group, (g + 1) * per_group))
    empty = [i for i, r in enumerate(out) if not r]
    for i in empty:  # a subtree without training data: any group (its rows are never fetched in training)
        out[i] = list(range((i % len(groups)) * per_group, (i % len(groups) + 1) * per_group))
    return out


class _Stripe:
    """Collate a group batch and keep this rank's rows."""

    def __init__(self, collate_fn: "Collate", index: int, micro_batch_size: int):
        self.collate_fn, self.index, self.micro = collate_fn, index, micro_batch_size

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = samples[self.index * self.micro:(self.index + 1) * self.micro]
        return self.collate_fn(rows)


@contextlib.contextmanager
def _world_of_one() -> Iterator[None]:
    """Let StreamingDataset see a single-process world while it is constructed.

    Streaming reads the layout from RANK / WORLD_SIZE / LOCAL_* once, in the constructor, and calls
    ``torch.distributed.barrier()`` there whenever a process group exists. Affine groups read
    different streams, so their datasets are built one at a time (host lock) and without barriers,
    which would otherwise pair up with the construction of another group.
    """
    import streaming.base.dataset as sd
    import streaming.base.shared.prefix as sp

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved_env = {k: os.environ.get(k) for k in keys}
    saved_dist = (sd.dist, sp.dist)
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    sd.dist = sp.dist = _NoProcessGroup()
    try:
        yield
    finally:
        sd.dist, sp.dist = saved_dist
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _NoProcessGroup:
    """Stands in for ``torch.distributed`` inside Streaming while an affine dataset is built."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return False


@contextlib.contextmanager
def _leaders_prefix() -> Iterator[None]:
    """Every rank of a node takes its local leader's shared-memory prefix, not its own scan's.

    Streaming has every rank scan ``/dev/shm`` for the first free prefix on its own; the local leader then
    registers that prefix and the other ranks attach to the one *they* found. The host lock
    (:func:`_host_prefix_lock`) keeps other jobs from *creating* segments meanwhile, but not from freeing them
    (a dataset of another job or test collected, a process ending): a rank that scans after such a release
    finds a lower prefix and fails with ``shared memory prefix=N was not registered by local leader``
    (seen with three 2-rank Slurm jobs and other tests on one host). So, where a process group exists, the ranks
    all-gather their scans (one per shared-memory name Streaming checks, the same number on every rank) and
    each keeps its leader's: global rank ``rank - rank % LOCAL_WORLD_SIZE``, the node layout Streaming itself
    reads from the environment. Without a process group (a world of one, or Streaming's stand-in in
    :func:`_world_of_one`) the scan is used as it is."""
    import streaming.base.shared.prefix as sp

    scan = sp._check_and_find_retrying

    def leaders_scan(*args, **kwargs) -> int:
        mine = scan(*args, **kwargs)
        dist = sp.dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return mine
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        rank = int(os.environ.get("RANK", dist.get_rank()))
        return every[rank - rank % int(os.environ.get("LOCAL_WORLD_SIZE", "1"))]

    sp._check_and_find_retrying = leaders_scan
    try:
        yield
    finally:
        sp._check_and_find_retrying = scan


_SHM = Path("/dev/shm")  # where Linux keeps POSIX shared memory: Streaming's segments, named by prefix


def _prefix_lock_path() -> Path:
    """The host lock's file: in ``/dev/shm``, beside the shared memory it guards and the same for every process of
    the host. Not under ``TMPDIR``: memtrain's sbatch gives each job its own (``/tmp/memtrain-$SLURM_JOB_ID``), so the
    lock there was one per job, and two jobs starting on one node could take the same prefix (a fresh-clone CI run,
    2026-11-27: three 2-rank Slurm jobs started together and one failed with ``FileExistsError: '/000001_locals'``).
    ``TMPDIR``'s where there is no ``/dev/shm``."""
    return (_SHM if _SHM.is_dir() else Path(tempfile.gettempdir())) / "memtrain-streaming-prefix.lock"


_FILELOCK = re.compile(r"(\d{6})_(?:barrier|cache)_filelock")


def sweep_orphan_filelocks(tmp: Optional[Path] = None, shm: Path = _SHM) -> int:
    """Remove Streaming's filelock files whose prefix no dataset holds any more; returns how many.

    Each StreamingDataset leaves ``NNNNNN_barrier_filelock`` and ``NNNNNN_cache_filelock`` in the temporary
    folder, and Streaming never deletes them. Its prefix scan skips every prefix with such a file, so prefixes
    were never reused: each dataset on a host took the next number, and each scan stat'ed two files per earlier
    dataset for every shared-memory name it checks (this machine, 2026-11-29: 4,978 prefixes after two days of
    test runs; one scan took 23 ms at 5,000, and a one-rank training run makes 18, nine per dataset).

    A prefix is alive while its node leader's ``NNNNNN_locals`` segment exists (Streaming creates it before the
    filelocks, and it lives as long as the leader's dataset; a killed run leaks it, and its prefix stays
    skipped), so a filelock without one belongs to no dataset. Called by the process that holds the host lock
    (:func:`_host_prefix_lock`), before its job's ranks scan, so no memtrain dataset is created meanwhile. Does
    nothing where there is no ``/dev/shm`` to tell live prefixes by; leaves files it may not delete (another
    user's) alone."""
    if not shm.is_dir():
        return 0
    removed = 0
    try:
        entries = list(os.scandir(tmp or tempfile.gettempdir()))
    except OSError:
        return 0
    for entry in entries:
        match = _FILELOCK.fullmatch(entry.name)
        if match and not (shm / f"{match.group(1)}_locals").exists():
            with contextlib.suppress(OSError):
                os.remove(entry.path)
                removed += 1
    return removed


@contextlib.contextmanager
def _host_prefix_lock(every_rank: bool = False) -> Iterator[None]:
    """Serialise StreamingDataset construction among the jobs of one host.

    Streaming picks a free shared-memory prefix by looking at ``/dev/shm`` and then creates it; two
    processes doing so at the same moment can pick the same prefix and one fails with
    ``FileExistsError``. The local leader holds a host-wide file lock while all ranks of the job build
    their dataset (they synchronise inside Streaming), so concurrent jobs on the host take turns.
    Multi-node jobs skip the lock: holding per-host locks across nodes could deadlock two jobs that
    share nodes in opposite order; such jobs should run on exclusive nodes (the sbatch default).
    """
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world != local_world and not every_rank:
        yield
        return
    # With every_rank (affine groups built as worlds of one, no barriers inside) each rank takes the
    # lock for its own construction; that is safe across nodes too, since no rank waits for another.
    synced = dist.is_available() and dist.is_initialized() and world > 1 and not every_rank
    fd = None
    if every_rank or int(os.environ.get("LOCAL_RANK", "0")) == 0:
        # read-only: another user's jobs lock the same file (flock needs no write access; created 0644)
        fd = os.open(_prefix_lock_path(), os.O_RDONLY | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        sweep_orphan_filelocks()
    try:
        if synced:
            dist.barrier()
        yield
        if synced:
            dist.barrier()
    finally:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class LoaderIterator:
    """Endless batches from a ``StreamingDataLoader``, epoch after epoch, with checkpointable state.

    Create it on a fresh loader; call :meth:`load_state_dict` before the first ``next()``.
    """

    STATE_VERSION = 1

    def __init__(self, loader: "StreamingDataLoader"):
        self.loader = loader
        self._it: Optional[Iterator[dict[str, torch.Tensor]]] = None
        self._started = False
        self.epochs_started = 0  # in this process

    def __iter__(self) -> "LoaderIterator":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        self._started = True
        for _ in range(2):  # an epoch resumed at its very end yields nothing; the next one must not
            if self._it is None:
                self._it = iter(self.loader)
                self.epochs_started += 1
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
            except DataError:
                raise
            except (ValueError, OSError, EOFError, KeyError, IndexError) as e:
                # A truncated or overwritten shard surfaces deep inside Streaming's readers.
                where = getattr(self.loader, "memtrain_meta", {}).get("fingerprint", "?")
                raise DataError(f"cannot read a sample of the prepared data (fingerprint {where}): "
                                f"{type(e).__name__}: {e}; a shard is damaged. Prepare the data again with "
                                "`memtrain prepare RECIPE --force` (or point data.dir at a good copy)") from None
        raise DataError("the data loader produced no batch in a whole epoch; the split has fewer samples than "
                        "one micro-batch per rank: add data, or lower train.micro_batch_size")

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from: Streaming's epoch and global sample offset, plus checks."""
        meta = getattr(self.loader, "memtrain_meta", {})
        return {
            "version": self.STATE_VERSION,
            "data_fingerprint": meta.get("fingerprint"),
            "epoch_size": self.loader.dataset.epoch_size,
            "streaming": self._streaming(self.loader.state_dict),
        }

    def _streaming(self, call, *args):
        if getattr(self.loader, "memtrain_world_of_one", False):
            with _world_of_one():
                return call(*args)
        return call(*args)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._started:
            # Streaming would treat the state as stale once this loader has begun an epoch.
            raise RuntimeError("LoaderIterator.load_state_dict must be called before the first batch")
        meta = getattr(self.loader, "memtrain_meta", {})
        if state.get("version") != self.STATE_VERSION:
            raise DataError(f"data loader state version {state.get('version')} is not {self.STATE_VERSION}; this "
                            "checkpoint was written by another memtrain version")
        if state.get("data_fingerprint") != meta.get("fingerprint"):
            raise DataError("the checkpoint was trained on different data than data.dir now holds (data "
                            f"fingerprint {state.get('data_fingerprint')} vs {meta.get('fingerprint')}); restore the "
                            "original data, or start a new run (run.dir) instead of resuming")
        self._streaming(self.loader.load_state_dict, state["streaming"])


def clean_stale_shared_memory() -> None:
    """Remove Streaming shared memory leaked by killed runs on this host.

    Call once per node at start-up, before any dataset exists: it also unlinks the segments of
    datasets that are alive (in this or another job on the host).
    """
    from streaming.base.util import clean_stale_shared_memory as clean

    clean()


__all__ = ["Collate", "IGNORE_INDEX", "ValidationSet", "affine_groups", "fetch_file", "LoaderIterator", "check_clustering", "data_location", "levels_from_leaf", "recipe_meta", "build_loader", "clean_stale_shared_memory", "collate", "sweep_orphan_filelocks",
           "read_meta", "train_epoch_size"]
