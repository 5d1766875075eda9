"""TapChannel: taps from the stages that own tap layers to the draft on the last stage, beside the pipeline
schedule, which it leaves untouched (DESIGN.md, "The co-training step under PP and CP")."""

from __future__ import annotations

import logging
import platform
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from codraft.parallel.tapchannel.host_staging import HostStagingLink
from codraft.parallel.tapchannel.pg import PgLink
from codraft.parallel.tapchannel.protocol import SlotLayout, TapChannelError, TapSpec, required_depth, stamp
from codraft.parallel.tapchannel.shm import open_shm_links

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "shm", "pg", "host_staging")


def _side_group(group: dist.ProcessGroup, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of the channel's own over `group`'s ranks in stage order, so that setup collectives and tap
    traffic never interleave with the pipeline's messages.

    Collective over the whole job: every rank creates the side group of every pipeline group. Groups created by
    their members only (use_local_synchronization) take a name that repeats once an earlier one is destroyed, and
    gloo would then rendezvous on the stale store keys of the old group and hang."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tuple(dist.get_process_group_ranks(group)))
    pipelines = sorted(set(everyone))
    if sum(len(ranks) for ranks in pipelines) != len(everyone):
        raise ValueError(f"TapChannel: pipeline groups {pipelines} overlap; each rank belongs to one pipeline")
    mine = everyone[dist.get_rank()]
    groups = {ranks: dist.new_group(list(ranks), backend="gloo", sort_ranks=False, timeout=timedelta(seconds=timeout_s))
              for ranks in pipelines}
    return groups[mine]


class TapChannel:
    """Side path for detached taps. Construction is collective over the whole job: each rank builds the channel of
    its pipeline `group` (stage = rank in the group) at the same time; the stages of one pipeline pass the same
    arguments, which the channel checks.

    sources: {stage: [tap layer ids it owns]}; the draft stage's own taps stay local and are not listed.
    spec: the taps of one microbatch, per layer [tokens <= spec.max_tokens, spec.hidden] of spec.dtype.
    depth: slots per source; by default `required_depth(schedule, stage, pp, n_microbatches)`.
    transport: "auto" picks "shm" for a source on the draft stage's host (x86-64, CPU taps) and "pg" otherwise;
      "host_staging" is the blocking baseline (one slot, post waits for the receive).
    timeout_s: bound of every wait, at either end, and of the channel's own group; a dead or stalled peer raises
      TapChannelTimeout (or, when the transport notices a dead peer sooner, TapChannelError).

    Numbering: microbatches count from 0 in every training step; every stage calls reset() once its posts or
    fetches of the step are done (local, no communication). The stamp holds the step, so a slot left from an
    earlier step never passes for the current one.
    """

    def __init__(self, sources: dict[int, list[int]], spec: TapSpec, *, group: dist.ProcessGroup | None = None,
                 draft_stage: int | None = None, depth: int | None = None, schedule: str = "1F1B",
                 n_microbatches: int | None = None, transport: str = "auto", timeout_s: float = 60.0):
        group = group or dist.group.WORLD
        self.stage, self.pp = dist.get_rank(group), dist.get_world_size(group)
        self.draft_stage = self.pp - 1 if draft_stage is None else draft_stage
        self.spec, self.timeout_s = spec, timeout_s
        self.sources = {s: list(sources[s]) for s in sorted(sources)}
        self._check_args(depth, n_microbatches, transport)
        self.depths = {s: depth or required_depth(schedule, s, self.pp, n_microbatches) for s in self.sources}
        self._step = 0
        self._group = _side_group(group, timeout_s)
        try:
            self.transports = self._choose_transports(transport)
            self.depths.update({s: 1 for s, t in self.transports.items() if t == "host_staging"})
            self._links = self._open_links()
        except BaseException:
            dist.destroy_process_group(self._group)
            raise
        log.debug("TapChannel stage %d: transports %s, depths %s", self.stage, self.transports, self.depths)

    def _check_args(self, depth: int | None, n_microbatches: int | None, transport: str) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}: valid values are {TRANSPORTS}")
        if not 0 <= self.draft_stage < self.pp:
            raise ValueError(f"draft_stage={self.draft_stage} is outside the pipeline [0, {self.pp})")
        layer_ids = [layer for layers in self.sources.values() for layer in layers]
        if len(set(layer_ids)) != len(layer_ids) or any(not layers for layers in self.sources.values()):
            raise ValueError(f"sources={self.sources}: each source needs tap layers, and no layer has two sources")
        if any(not 0 <= s < self.pp or s == self.draft_stage for s in self.sources):
            raise ValueError(f"sources={self.sources}: stages must be in [0, {self.pp}) and not the draft stage "
                             f"{self.draft_stage}, whose taps stay local")
        if depth is None and n_microbatches is None:
            raise ValueError("TapChannel needs depth or n_microbatches (to derive the depth from the schedule)")
        if depth is not None and depth < 1:
            raise ValueError(f"depth={depth} must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0")

    def _choose_transports(self, transport: str) -> dict[int, str]:
        config = (self.spec, self.sources, self.depths, self.draft_stage, transport)
        everyone: list = [None] * self.pp
        dist.all_gather_object(everyone, (socket.gethostname(), config), group=self._group)
        if any(c != config for _, c in everyone):
            raise TapChannelError("TapChannel arguments differ between stages (spec, sources, depths, draft stage, "
                                  "transport): " + "; ".join(f"stage {r}: {c}" for r, (_, c) in enumerate(everyone)))
        hosts = [h for h, _ in everyone]
        shm_ok = platform.machine() in ("x86_64", "AMD64") and self.spec.device == "cpu"
        if transport == "shm" and not shm_ok:
            raise NotImplementedError("TapChannel transport='shm' exists for CPU taps on x86-64 only (the GPU path "
                                      "would use CUDA IPC handles; weakly ordered CPUs need fences): use 'pg'")
        if transport == "shm" and (far := [s for s in self.sources if hosts[s] != hosts[self.draft_stage]]):
            raise ValueError(f"transport='shm' but source stages {far} are not on the draft stage's host")
        if transport != "auto":
            return {s: transport for s in self.sources}
        return {s: "shm" if shm_ok and hosts[s] == hosts[self.draft_stage] else "pg" for s in self.sources}

    def _open_links(self) -> dict:
        layouts = {s: SlotLayout(self.spec, len(layers)) for s, layers in self.sources.items()}
        rings = {s: (layouts[s], self.depths[s]) for s, t in self.transports.items() if t == "shm"}
        links = open_shm_links(self._group, self.stage, self.draft_stage, rings, self.timeout_s) if rings else {}
        for s, t in self.transports.items():
            if self.stage not in (s, self.draft_stage) or t == "shm":
                continue
            if t == "pg":
                links[s] = PgLink(self._group, s, self.draft_stage, layouts[s], self.depths[s], self.timeout_s,
                                  is_writer=self.stage == s)
            else:
                links[s] = HostStagingLink(self._group, s, self.draft_stage, layouts[s], self.timeout_s,
                                           is_writer=self.stage == s)
        return links

    def post(self, microbatch: int, taps: dict[int, torch.Tensor]) -> None:
        """Source stage: hand over the taps of `microbatch`, {layer id: [tokens, hidden]}. Waits (bounded) only
        while the ring is full; host_staging returns once the draft stage has received them."""
        if self.stage not in self.sources:
            raise TapChannelError(f"TapChannel: stage {self.stage} posted taps but the sources are "
                                  f"{sorted(self.sources)}")
        tensors, tokens = self._check_taps(microbatch, taps)
        self._links[self.stage].post(microbatch % self.depths[self.stage], stamp(self._step, microbatch), tensors,
                                     tokens)

    def _check_taps(self, microbatch: int, taps: dict[int, torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        layers, spec = self.sources[self.stage], self.spec
        where = f"TapChannel: source stage {self.stage}, microbatch {microbatch}"
        if sorted(taps) != sorted(layers):
            raise TapChannelError(f"{where}: posted taps of layers {sorted(taps)}, the stage owns {layers}")
        tensors = [taps[layer].detach() for layer in layers]
        tokens = tensors[0].shape[0]
        for layer, t in zip(layers, tensors, strict=True):
            if t.shape != (tokens, spec.hidden) or tokens > spec.max_tokens or t.dtype != spec.dtype:
                raise TapChannelError(f"{where}: the tap of layer {layer} is {tuple(t.shape)} {t.dtype}, the slot "
                                      f"takes [tokens <= {spec.max_tokens}, {spec.hidden}] {spec.dtype}, with the "
                                      f"same tokens for every layer ({tokens} in layer {layers[0]})")
        return tensors, tokens

    def fetch(self, microbatch: int) -> dict[int, torch.Tensor]:
        """Draft stage: the taps of every source for `microbatch`, {layer id: [tokens, hidden]} on spec.device."""
        if self.stage != self.draft_stage:
            raise TapChannelError(f"TapChannel: stage {self.stage} fetched taps but the draft stage is "
                                  f"{self.draft_stage}")
        taps: dict[int, torch.Tensor] = {}
        for s, layers in self.sources.items():
            got = self._links[s].fetch(microbatch % self.depths[s], stamp(self._step, microbatch))  # [n, tokens, H]
            taps.update(zip(layers, got.to(self.spec.device).unbind(0), strict=True))
        return taps

    def reset(self) -> None:
        """End of a training step on this stage: microbatch numbering restarts at 0 under the next step's stamps."""
        self._step += 1

    def close(self) -> None:
        """Tear down (idempotent). A source first waits, bounded, until the draft stage has taken its posts."""
        self._close(drain=True)

    def _close(self, drain: bool) -> None:
        if self._links is None:
            return
        links, self._links = self._links, None
        try:
            if drain and self.stage in self.sources:
                links[self.stage].drain()
        finally:
            for link in links.values():
                link.close()
            dist.destroy_process_group(self._group)

    def __enter__(self) -> TapChannel:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close(drain=exc_type is None)  # after an error nobody may be left to take the posts
