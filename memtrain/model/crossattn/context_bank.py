"""The dynamic inference-time context bank (crossattn-memory-banks paper, Section 2 "Future extension
(dynamic inference-time context bank)" and Section 7.1-7.3, eq. 22-24).

The learned memory bank ``M`` (:mod:`.bank`) is fixed after training. The context bank
``C`` (``N_ct x d``) is a separate store (Section 7.2: "distinct from the memory bank", so what is
written at inference never overwrites training-time knowledge) that grows while the model runs:

- :class:`ContextEncoder` (eq. 22) compresses a processed prompt: the first- and last-layer hidden
  states ``[E^(1); E^(L_max)]`` (``[L, 2d]``) become ``L_c = ceil(L / r)`` latent vectors of width
  ``d``. It is a strided (kernel = stride = ``r``) convolutional autoencoder, the "convolutional
  encoder" of Section 7.2's time-series alternative: each latent summarises ``r`` consecutive tokens
  (an MLP over the chunk's ``r * 2d`` standardised numbers, then a parameter-free LayerNorm), and a
  mirrored MLP reconstructs the chunk from it. Why this and not learned latent queries
  (Perceiver-style): the compression rate is fixed (``L_c << L`` for any ``L``), every latent stands
  for one contiguous span, so averaging two of them (eq. 23) merges two span summaries as RAG merges
  chunk embeddings (the paper's own justification of eq. 23), and it costs two small matmuls per
  chunk, so it fits in a few hundred CPU steps. It is trained to reconstruct the concatenated states
  (:func:`fit_context_encoder`, MSE on per-feature standardised states so that early and late layers
  count equally, "ensuring that both raw semantic information and processed information are preserved").
- :class:`ContextBank` stores the latents with per-vector metadata (reference frequency, summed
  attention weight, age in inference runs), merges under capacity pressure by importance (Section
  7.3, eq. 23-24) and clusters itself for router-free retrieval (Section 7.2, "Retrieval": k-means,
  online updates between re-clusterings).
- :class:`ContextRead` lets the memory cross-attention layers (:class:`.layer.MemoryCrossAttention`)
  read the bank: the layer's own ``W_Q`` makes the queries, its ``W_K`` / ``W_V`` project the
  retrieved context vectors and its ``W_O`` maps the result back; the result is added to the memory
  read's output. It is attached with forward hooks, so a model without an attached (or with an
  empty) context bank runs exactly the code it was trained with.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.config import RecipeError
from memtrain.model.crossattn.layer import MemoryCrossAttention

# --------------------------------------------------------------------------------------------------
# Compression (eq. 22)


def hidden_states(model: nn.Module, input_ids: torch.Tensor, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[E^(1); E^(L_max)]`` of eq. 22 for ``input_ids`` ``[B, L]``: the residual stream after the first
    and after the last transformer block of a memtrain decoder (``model.blocks``), concatenated to
    ``[B, L, 2d]``. Run with any context read paused (:meth:`ContextRead.paused`): the bank stores what
    the prompt itself produced, in the distribution the encoder was fitted on."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or len(blocks) == 0:
        raise RecipeError("model.type", "the context encoder reads a memtrain decoder's first and last block "
                          "(model.type: decoder)")
    got: dict[str, torch.Tensor] = {}
    hooks = [blocks[0].register_forward_hook(lambda m, a, o: got.__setitem__("first", o)),
             blocks[-1].register_forward_hook(lambda m, a, o: got.__setitem__("last", o))]
    try:
        model(input_ids, doc_ids=doc_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat([got["first"], got["last"]], dim=-1)


class ContextEncoder(nn.Module):
    """Eq. 22: ``z = Encoder([E^(1); E^(L_max)])``, ``[L, 2d] -> [ceil(L / r), d]`` (module docstring).

    ``tokens_per_vector`` is ``r`` (the compression rate ``L / L_c``); ``hidden`` the MLPs' width
    (default ``2 d``). Inputs are standardised per feature with the ``mean`` / ``std`` buffers
    (:meth:`set_statistics`, from the fitting data); a prompt's last, partial chunk is zero-padded
    (the feature mean) and its padding is left out of the loss."""

    def __init__(self, d_model: int, tokens_per_vector: int = 8, hidden: Optional[int] = None):
        super().__init__()
        if d_model < 1 or tokens_per_vector < 1:
            raise RecipeError("", f"the context encoder needs d_model >= 1 and tokens per vector >= 1, got "
                              f"{d_model} and {tokens_per_vector}")
        self.d_model, self.r = d_model, tokens_per_vector
        self.hidden = hidden or 2 * d_model
        chunk = tokens_per_vector * 2 * d_model
        self.register_buffer("mean", torch.zeros(2 * d_model))
        self.register_buffer("std", torch.ones(2 * d_model))
        self.encoder = nn.Sequential(nn.Linear(chunk, self.hidden), nn.GELU(), nn.Linear(self.hidden, d_model))
        self.decoder = nn.Sequential(nn.Linear(d_model, self.hidden), nn.GELU(), nn.Linear(self.hidden, chunk))

    @torch.no_grad()
    def set_statistics(self, states: torch.Tensor) -> None:
        """Per-feature mean and standard deviation of ``states`` ``[..., 2d]`` (the fitting data)."""
        flat = states.reshape(-1, 2 * self.d_model).float()
        self.mean.copy_(flat.mean(0))
        self.std.copy_(flat.std(0, unbiased=False).clamp_min(1e-6))

    def chunks(self, states: torch.Tensor, lengths: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``states`` ``[B, L, 2d]`` (``lengths`` ``[B]`` valid tokens, default ``L``) -> standardised,
        zero-padded chunks ``[B, n, r * 2d]`` and the valid-token mask ``[B, n, r]``, ``n = ceil(L / r)``."""
        B, L, width = states.shape
        if width != 2 * self.d_model:
            raise RecipeError("", f"the context encoder takes [E^(1); E^(L_max)] of width {2 * self.d_model}, "
                              f"got {width}")
        n = max(1, math.ceil(L / self.r))
        x = (states.float() - self.mean) / self.std
        valid = torch.arange(n * self.r, device=states.device)[None] < (
            torch.full((B,), L, device=states.device) if lengths is None else lengths.to(states.device))[:, None]
        x = F.pad(x, (0, 0, 0, n * self.r - L)) * valid[..., None]
        return x.reshape(B, n, self.r * width), valid.view(B, n, self.r)

    def encode(self, states: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[B, L, 2d] -> [B, ceil(L / r), d]``: the latents, LayerNorm-ed without gain or bias (unit RMS)."""
        x, _ = self.chunks(states, lengths)
        return F.layer_norm(self.encoder(x), (self.d_model,))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """``[B, n, d] -> [B, n * r, 2d]``: the reconstruction, in standardised units."""
        B, n, _ = z.shape
        return self.decoder(z).view(B, n * self.r, 2 * self.d_model)

    def loss(self, states: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Reconstruction MSE over the valid tokens, in standardised units (1.0 = predicting the mean)."""
        x, valid = self.chunks(states, lengths)
        B, n, _ = x.shape
        recon = self.decode(F.layer_norm(self.encoder(x), (self.d_model,)))
        target = x.view(B, n * self.r, 2 * self.d_model)
        mask = valid.reshape(B, n * self.r, 1).float()
        return ((recon - target) ** 2 * mask).sum() / (mask.sum() * 2 * self.d_model).clamp_min(1.0)

    @torch.no_grad()
    def compress(self, states: torch.Tensor) -> torch.Tensor:
        """One prompt's states ``[L, 2d]`` -> its latents ``[ceil(L / r), d]`` (float32)."""
        return self.encode(states[None].float())[0]

    def config(self) -> dict[str, int]:
        return {"d_model": self.d_model, "tokens_per_vector": self.r, "hidden": self.hidden}


def fit_context_encoder(encoder: ContextEncoder, states: torch.Tensor, steps: int = 300, lr: float = 3e-3,
                        batch_chunks: int = 256, partial: float = 0.25, seed: int = 0,
                        progress: Optional[Callable[[int, float], None]] = None) -> list[float]:
    """Fit ``encoder`` to reconstruct ``states`` ``[N, T, 2d]`` (hidden states of some text,
    :func:`hidden_states`): sets the standardisation statistics, then ``steps`` Adam steps on batches
    of ``batch_chunks`` random ``r``-token chunks, a share ``partial`` of them cut short (as a prompt's
    last chunk is). The encoder reads chunks independently, so random chunks are exactly its training
    distribution. Returns the loss of every step (standardised MSE; 1.0 = predicting the mean)."""
    if steps < 0:
        raise RecipeError("", f"encoder steps must be >= 0, got {steps}")
    states = states.detach().float()
    N, T, width = states.shape
    encoder.set_statistics(states)
    r = encoder.r
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(encoder.parameters(), lr=lr)
    span = min(r, T)
    losses: list[float] = []
    encoder.train()
    for step in range(steps):
        seq = torch.randint(N, (batch_chunks,), generator=gen)
        start = torch.randint(T - span + 1, (batch_chunks,), generator=gen)
        idx = start[:, None] + torch.arange(span)[None]
        chunk = states[seq[:, None], idx]  # [batch, span, 2d]
        lengths = torch.full((batch_chunks,), span)
        cut = torch.rand(batch_chunks, generator=gen) < partial
        lengths[cut] = torch.randint(1, span + 1, (int(cut.sum()),), generator=gen)
        loss = encoder.loss(chunk, lengths)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step, losses[-1])
    encoder.eval()
    return losses


# --------------------------------------------------------------------------------------------------
# The bank (Section 7.2 storage and retrieval, Section 7.3 consolidation)


@dataclass(frozen=True)
class Merge:
    """One consolidation step (eq. 23): vector ``victim`` (the lowest importance, eq. 24) was averaged
    into ``into`` (its most cosine-similar neighbour), which keeps its id; ``victim`` is gone."""

    victim: int
    into: int
    importance: float
    similarity: float


def _kmeans(x: torch.Tensor, k: int, gen: torch.Generator, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means (k-means++ seeding, Lloyd iterations) of ``x`` ``[N, d]`` into ``k <= N`` clusters, none
    empty; returns (centroids ``[k, d]``, each the mean of its members; assignment ``[N]``)."""
    N = x.shape[0]
    first = int(torch.randint(N, (1,), generator=gen))
    chosen = [first]
    d2 = ((x - x[first]) ** 2).sum(-1)
    for _ in range(1, k):
        if float(d2.sum()) > 0:
            i = int(torch.multinomial(d2 / d2.sum(), 1, generator=gen))
        else:  # every point sits on a chosen centre: take the first point not yet chosen
            i = next(j for j in range(N) if j not in chosen)
        chosen.append(i)
        d2 = torch.minimum(d2, ((x - x[i]) ** 2).sum(-1))
    centroids = x[chosen].clone()
    assign = torch.cdist(x, centroids).argmin(-1)
    for _ in range(iters):
        for c in range(k):
            members = assign == c
            if members.any():
                centroids[c] = x[members].mean(0)
        new = torch.cdist(x, centroids).argmin(-1)
        if torch.equal(new, assign):
            break
        assign = new
    # No cluster may be empty (retrieval reads the members of the chosen clusters): an empty one takes
    # a point from the largest cluster.
    counts = torch.bincount(assign, minlength=k)
    for c in range(k):
        if counts[c] == 0:
            big = int(counts.argmax())
            victim = int((assign == big).nonzero()[-1])
            assign[victim] = c
            counts[big] -= 1
            counts[c] += 1
    for c in range(k):
        centroids[c] = x[assign == c].mean(0)
    return centroids, assign


class ContextBank:
    """``C`` (``N_ct x width``) with per-vector metadata, consolidation and clustering (module docstring).

    Metadata of every vector (``ids`` are stable through merges; ``slot`` is the row in ``vectors``):

    - ``freq``: reference frequency, the number of inference runs (prompts) in which it was attended,
      in the same unit as ``age``, so that ``freq <= age + 1`` for an unmerged vector and the terms of
      eq. 24 stay comparable however many forwards a run makes;
    - ``reads``: the reads that attended to it (a read is one memory layer's forward over one sequence
      in which one of its query tokens selected the vector's cluster); ``attn_sum``: the sum over those
      reads of its mean softmax weight (over the heads and the query tokens that selected its
      cluster); ``avg_attn = attn_sum / reads`` (0 when never attended);
    - ``age``: inference runs (prompts processed, :meth:`end_run`) since it was added; ``recency =
      1 / (1 + age)``;
    - ``mass``: how many added vectors it stands for, ``sources``: the runs (prompt numbers) they came from.

    Importance (eq. 24): ``alpha * freq + beta * avg_attn + gamma * recency``. The defaults (0.25, 1, 1)
    give new vectors the paper's "benefit of doubt": a fresh vector (importance 1) outlasts one attended
    in each of the one or two runs since it was added (0.85 and 0.93 at an average weight of 0.1), not
    one attended in each of three or more (1.1); vectors never attended go first, the oldest first.

    Capacity (Section 7.3): :meth:`add` appends; while more than ``capacity`` vectors are held, the one
    of lowest importance (ties: the earliest stored) is averaged with its most cosine-similar other
    vector (eq. 23: ``(c_i + c_j) / 2``; ties: the earliest stored), which keeps its id and slot and takes
    the sums of ``freq``, ``reads`` and ``attn_sum`` (the merged vector answers for both vectors'
    references, and its ``avg_attn`` is their read-weighted mean), ``min(age_i, age_j)`` (the newer
    part keeps its benefit of the doubt), ``mass_i + mass_j`` and the union of the sources. Importance
    is recomputed after every merge.

    Clusters (Section 7.2, "Retrieval" and "Online k-means"): ``k = ceil(N / cluster_size)`` (or
    ``min(N, clusters)`` when ``clusters`` is set). Every centroid is the mean of its members. A full
    k-means (k-means++ seeding, seeded, so deterministic) runs when ``k`` changes and after merges;
    otherwise added vectors join their nearest centroid, which moves to the new mean (online k-means).
    Retrieval (:class:`ContextRead`) selects the ``top_k`` clusters per query token by the dot product
    of the query with the centroids, and attends to those clusters' members only.
    """

    def __init__(self, width: int, capacity: int, *, alpha: float = 0.25, beta: float = 1.0, gamma: float = 1.0,
                 cluster_size: int = 8, clusters: Optional[int] = None, top_k: int = 2, seed: int = 0,
                 kmeans_iters: int = 25):
        for name, value in (("width", width), ("capacity", capacity), ("cluster_size", cluster_size),
                            ("top_k", top_k)):
            if value < 1:
                raise RecipeError("", f"context bank {name} must be >= 1, got {value}")
        if clusters is not None and clusters < 1:
            raise RecipeError("", f"context bank clusters must be >= 1, got {clusters}")
        self.width, self.capacity = width, capacity
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self.cluster_size, self.clusters, self.top_k = cluster_size, clusters, top_k
        self.kmeans_iters = kmeans_iters
        self.gen = torch.Generator().manual_seed(seed)
        self.vectors = torch.zeros(0, width)
        self.ids = torch.zeros(0, dtype=torch.long)
        self.freq = torch.zeros(0, dtype=torch.float64)
        self.reads = torch.zeros(0, dtype=torch.float64)
        self.attn_sum = torch.zeros(0, dtype=torch.float64)
        self.age = torch.zeros(0, dtype=torch.long)
        self.mass = torch.zeros(0, dtype=torch.long)
        self.sources: list[frozenset[int]] = []
        self.centroids = torch.zeros(0, width)
        self.assign = torch.zeros(0, dtype=torch.long)
        self.run_attention = torch.zeros(0, dtype=torch.float64)  # attention weight this run (display)
        self.run_reads = torch.zeros(0, dtype=torch.float64)  # reads this run (freq counts runs)
        self.next_id = 0
        self.runs = 0
        self.merges: list[Merge] = []
        self.reclusters = 0

    # -- state ----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.vectors.shape[0]

    @property
    def n_clusters(self) -> int:
        return self.centroids.shape[0]

    @property
    def avg_attn(self) -> torch.Tensor:
        return torch.where(self.reads > 0, self.attn_sum / self.reads.clamp_min(1), torch.zeros_like(self.attn_sum))

    @property
    def recency(self) -> torch.Tensor:
        return 1.0 / (1.0 + self.age.double())

    def importance(self) -> torch.Tensor:
        """Eq. 24 for every vector (``[N]``, float64)."""
        return self.alpha * self.freq + self.beta * self.avg_attn + self.gamma * self.recency

    def slot(self, vector_id: int) -> int:
        hit = (self.ids == vector_id).nonzero()
        if hit.numel() == 0:
            raise KeyError(f"no context vector with id {vector_id}")
        return int(hit[0])

    def cluster_sizes(self) -> list[int]:
        return torch.bincount(self.assign, minlength=self.n_clusters).tolist() if len(self) else []

    # -- writing --------------------------------------------------------------------------------------

    def add(self, latents: torch.Tensor, source: Optional[int] = None, *, metadata: Optional[dict[str, Any]] = None
            ) -> list[Merge]:
        """Append ``latents`` ``[n, width]`` (age 0, never attended; ``metadata`` may set ``freq``,
        ``reads`` (default: ``freq``), ``attn_sum`` and ``age`` per vector, e.g. in tests), consolidate
        down to ``capacity`` and update the clusters. Returns the merges this call made."""
        latents = latents.detach().float().cpu().reshape(-1, self.width)
        n = latents.shape[0]
        meta = metadata or {}
        self.vectors = torch.cat([self.vectors, latents])
        self.ids = torch.cat([self.ids, torch.arange(self.next_id, self.next_id + n)])
        self.next_id += n
        freq = torch.as_tensor(meta.get("freq", torch.zeros(n)), dtype=torch.float64)
        self.freq = torch.cat([self.freq, freq])
        self.reads = torch.cat([self.reads, torch.as_tensor(meta.get("reads", freq), dtype=torch.float64)])
        self.attn_sum = torch.cat([self.attn_sum, torch.as_tensor(meta.get("attn_sum", torch.zeros(n)),
                                                                  dtype=torch.float64)])
        self.age = torch.cat([self.age, torch.as_tensor(meta.get("age", torch.zeros(n)), dtype=torch.long)])
        self.mass = torch.cat([self.mass, torch.ones(n, dtype=torch.long)])
        self.sources += [frozenset() if source is None else frozenset([source])] * n
        self.run_attention = torch.cat([self.run_attention, torch.zeros(n, dtype=torch.float64)])
        self.run_reads = torch.cat([self.run_reads, torch.zeros(n, dtype=torch.float64)])
        merges = self.consolidate()
        if merges or self._target_clusters() != self.n_clusters:
            self.recluster()
        else:  # online k-means: the new vectors join their nearest centroid, which moves to the new mean
            for slot in range(len(self) - n, len(self)):
                c = int(torch.cdist(self.vectors[slot:slot + 1], self.centroids).argmin())
                members = int((self.assign == c).sum())
                self.centroids[c] += (self.vectors[slot] - self.centroids[c]) / (members + 1)
                self.assign = torch.cat([self.assign, torch.tensor([c])])
        return merges

    def consolidate(self) -> list[Merge]:
        """Section 7.3: merge until at most ``capacity`` vectors remain (class docstring)."""
        out = []
        while len(self) > self.capacity:
            score = self.importance()
            i = int(torch.argmin(score))  # the first of equal minima: the earliest stored
            unit = F.normalize(self.vectors, dim=-1)
            sims = unit @ unit[i]
            sims[i] = -math.inf
            j = int(torch.argmax(sims))
            merge = Merge(int(self.ids[i]), int(self.ids[j]), float(score[i]), float(sims[j]))
            self.vectors[j] = (self.vectors[i] + self.vectors[j]) / 2  # eq. 23
            self.freq[j] += self.freq[i]
            self.reads[j] += self.reads[i]
            self.attn_sum[j] += self.attn_sum[i]
            self.age[j] = torch.minimum(self.age[i], self.age[j])
            self.mass[j] += self.mass[i]
            self.run_attention[j] += self.run_attention[i]
            self.run_reads[j] += self.run_reads[i]
            self.sources[j] = self.sources[j] | self.sources[i]
            keep = torch.arange(len(self)) != i
            for name in ("vectors", "ids", "freq", "reads", "attn_sum", "age", "mass", "run_attention", "run_reads"):
                setattr(self, name, getattr(self, name)[keep])
            del self.sources[i]
            if self.assign.numel() > i:  # drop its row; the clusters are rebuilt after merging
                self.assign = self.assign[torch.arange(self.assign.numel()) != i]
            out.append(merge)
        self.merges += out
        return out

    def end_run(self) -> None:
        """One inference run (prompt) is over: every stored vector ages by one; the per-run counts (reads
        this run, the attention :meth:`attention_by_source` shows) restart."""
        self.age += 1
        self.runs += 1
        self.run_attention.zero_()
        self.run_reads.zero_()

    def record(self, slots: torch.Tensor, weights: torch.Tensor, counts: Optional[torch.Tensor] = None) -> None:
        """Attention statistics of reads: vector ``slots[k]`` (distinct) was attended in ``counts[k]``
        reads (default 1) with summed mean softmax weight ``weights[k]`` (:class:`ContextRead` calls
        this). ``freq`` counts the first attended read of a run only (class docstring)."""
        slots = slots.detach().cpu().long()
        weights = weights.detach().cpu().double()
        counts = torch.ones_like(weights) if counts is None else counts.detach().cpu().double()
        first = slots[(self.run_reads[slots] == 0) & (counts > 0)]
        self.freq[first] += 1
        self.run_reads.index_add_(0, slots, counts)
        self.reads.index_add_(0, slots, counts)
        self.attn_sum.index_add_(0, slots, weights)
        self.run_attention.index_add_(0, slots, weights)

    # -- clusters -------------------------------------------------------------------------------------

    def _target_clusters(self) -> int:
        n = len(self)
        if n == 0:
            return 0
        return min(n, self.clusters) if self.clusters is not None else math.ceil(n / self.cluster_size)

    def recluster(self) -> None:
        """Full k-means of the bank (class docstring)."""
        k = self._target_clusters()
        if k == 0:
            self.centroids, self.assign = torch.zeros(0, self.width), torch.zeros(0, dtype=torch.long)
            return
        self.centroids, self.assign = _kmeans(self.vectors, k, self.gen, self.kmeans_iters)
        self.reclusters += 1

    # -- display --------------------------------------------------------------------------------------

    def attention_by_source(self) -> dict[int, float]:
        """This run's attention weight per source run, as shares of the total (a merged vector's weight
        is split evenly among its sources)."""
        out: dict[int, float] = {}
        for w, srcs in zip(self.run_attention.tolist(), self.sources):
            for s in srcs:
                out[s] = out.get(s, 0.0) + w / len(srcs)
        total = sum(out.values())
        return {s: v / total for s, v in sorted(out.items())} if total > 0 else {}

    def summary(self) -> dict[str, Any]:
        imp = self.importance()
        per_source: dict[int, int] = {}
        for srcs in self.sources:
            for s in srcs:
                per_source[s] = per_source.get(s, 0) + 1
        return {"vectors": len(self), "capacity": self.capacity, "clusters": self.n_clusters,
                "cluster_sizes": self.cluster_sizes(), "merges": len(self.merges), "reclusters": self.reclusters,
                "runs": self.runs, "vectors_by_source": dict(sorted(per_source.items())),
                "attention_by_source": self.attention_by_source(),
                "importance": [round(float(v), 4) for v in imp],
                "freq": self.freq.tolist(), "reads": self.reads.tolist(),
                "avg_attn": [round(float(v), 4) for v in self.avg_attn],
                "age": self.age.tolist()}


# --------------------------------------------------------------------------------------------------
# Reading the bank from the memory cross-attention layers


RMS_SAMPLE = 4096  # learned-bank tokens whose RMS scales the context vectors (ContextRead)


class ContextRead:
    """The context bank read by the memory cross-attention layers of ``model`` (every
    :class:`MemoryCrossAttention` in it; Section 7.2).

    For a layer with normalised input ``h`` (what its memory read sees), learned bank ``M`` and context
    bank ``C`` (clusters with centroids ``mu``): ``q = h W_Q`` (eq. 1); each query token scores the
    clusters by ``mean over heads of q . (mu W_K) / sqrt(D)`` (the dot product of the query with the
    centroids, in the layer's key space, which equals the mean attention logit over a cluster's
    members) and keeps its ``top_k``; it attends (eq. 4) to the members of those clusters only, with
    keys ``C W_K`` and values ``C W_V`` (eq. 2-3 applied to ``C``), and ``W_O`` maps the result back;
    it is added to the memory read's output. Selection is per token, so it is causal (Section 4.4:
    token-wise routing is affordable at generation time).

    Why the layer's own projections: the paper gives the context bank the same width ``d`` as the
    memory bank and reads it with the same layers, and Section 3.4 argues that per-layer ``W_K`` / ``W_V``
    align a bank's space with the layer's; there is nothing to train at inference ("requires no
    training at inference time"), where separate projections would need a training signal this
    checkpoint never had. The context vectors are unit-RMS latents; they are scaled by the layer's
    learned bank's RMS so that ``W_K`` / ``W_V`` see inputs at the scale they were trained on.

    Statistics: every read records, for every retrieved vector, one attended read and its mean
    softmax weight (:meth:`ContextBank.record`), unless ``record`` is off. With an empty bank, or after
    :meth:`detach`, the layers' outputs are exactly those of the model alone.
    """

    def __init__(self, model: nn.Module, bank: ContextBank, record: bool = True):
        self.layers = [m for m in model.modules() if isinstance(m, MemoryCrossAttention)]
        if not self.layers:
            raise RecipeError("memory.type", "the context bank is read by the memory cross-attention layers; it "
                              "needs a model with memory.type: crossattn")
        for layer in self.layers:
            if layer.wk_in != bank.width:
                raise RecipeError("memory.crossattn.dim", f"the memory layers read {layer.wk_in}-wide bank tokens, "
                                  f"but the context vectors are {bank.width} wide (d_model); the context bank needs "
                                  "memory.crossattn.dim unset")
        self.bank, self.recording, self.active = bank, record, True
        self._scales: dict[int, float] = {}
        self._handles: list[Any] = []
        self.attach()

    def attach(self) -> None:
        if not self._handles:
            self._handles = [layer.register_forward_hook(self._hook) for layer in self.layers]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "ContextRead":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The model without its context bank (bank off) inside the block."""
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

    @contextlib.contextmanager
    def not_recording(self) -> Iterator[None]:
        """Reads inside the block leave the bank's statistics alone (e.g. scoring)."""
        recording, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = recording

    def _scale(self, layer: MemoryCrossAttention, bank: Any) -> float:
        """The RMS of the layer's learned bank tokens (from at most ``RMS_SAMPLE`` evenly spaced tokens of
        a large bank), once per layer: the bank is fixed at inference."""
        key = id(layer)
        if key not in self._scales:
            n = int(getattr(bank, "tokens", 0))
            with torch.no_grad():
                if n > RMS_SAMPLE:
                    held = [*bank.parameters(), *bank.buffers()]
                    device = held[0].device if held else torch.device("cpu")
                    tokens = bank.rows(torch.linspace(0, n - 1, RMS_SAMPLE, device=device).long(), torch.float32)
                else:
                    tokens = bank.all(torch.float32)
                self._scales[key] = float(tokens.pow(2).mean().sqrt())
        return self._scales[key]

    def _hook(self, layer: MemoryCrossAttention, args: tuple, output: tuple) -> Optional[tuple]:
        if not self.active or len(self.bank) == 0:
            return None  # the memory read's own output, untouched
        out, loss = output
        return out + self.read(layer, args[0], self._scale(layer, args[1])), loss

    def read(self, layer: MemoryCrossAttention, h: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """The context read of ``layer`` for normalised input ``h`` ``[B, T, d]``: ``[B, T, d]``."""
        bank = self.bank
        B, T, _ = h.shape
        H, D = layer.heads, layer.head_dim
        q = layer.wq(h).view(B, T, H, D).float()
        vectors = bank.vectors.to(h.device, h.dtype) * scale
        centroids = bank.centroids.to(h.device, h.dtype) * scale
        K = centroids.shape[0]
        kc = layer.wk(centroids).view(K, H, D).float()
        scores = torch.einsum("bthd,khd->btk", q, kc) / (H * math.sqrt(D))
        top = scores.topk(min(bank.top_k, K), dim=-1).indices
        chosen = torch.zeros(B, T, K, dtype=torch.bool, device=h.device).scatter_(-1, top, True)
        member = chosen[..., bank.assign.to(h.device)]  # [B, T, N]: which vectors each token may read
        used = member.any(0).any(0).nonzero().squeeze(1)  # only these are projected and attended
        mask = member[..., used]  # [B, T, U]
        keys = layer.wk(vectors[used]).view(-1, H, D).float()
        values = layer.wv(vectors[used]).view(-1, H, D).float()
        logits = torch.einsum("bthd,uhd->bhtu", q, keys) / math.sqrt(D)
        probs = torch.softmax(logits.masked_fill(~mask[:, None], float("-inf")), dim=-1)
        out = torch.einsum("bhtu,uhd->bthd", probs, values).reshape(B, T, H * D).to(h.dtype)
        if self.recording:
            with torch.no_grad():
                readers = mask.sum(1).double()  # [B, U]: query tokens that selected the vector's cluster
                weight = probs.detach().double().sum((1, 2)) / (H * readers.clamp_min(1))  # mean softmax weight
                attended = readers > 0
                bank.record(used, (weight * attended).sum(0), attended.sum(0))
        return layer.wo(out)


__all__ = ["ContextBank", "ContextEncoder", "ContextRead", "Merge", "fit_context_encoder", "hidden_states"]
