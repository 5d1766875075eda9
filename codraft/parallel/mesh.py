"""The device mesh: dp x pp x cp ranks, their process groups, and the process-group setup from torchrun.

Rank layout (the one place it is written down; everything else asks `ParallelDims`):

    rank = ((dp_i * pp) + pp_i) * cp + cp_i

cp is innermost, so the CP peers of a rank are its neighbours (same node, fastest links, where the
ring's traffic is heaviest), then pp, then dp outermost. Inside one CP group of size cp = u * R, the
USP baseline splits again with Ulysses innermost: ulysses_i = cp_i % u, ring_i = cp_i // u.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from codraft.config import ConfigError
from codraft.parallel.rollcall import RankTimeout, RollCall, is_peer_fault

log = logging.getLogger(__name__)

DIMS = ("dp", "pp", "cp")


def init_distributed(timeout_s: float) -> tuple[int, int]:
    """Initialise the default process group from torchrun's env vars; returns (rank, world_size).

    Without WORLD_SIZE (a plain `python` run) nothing is initialised and (0, 1) is returned. NCCL on
    CUDA (each process on cuda:LOCAL_RANK), gloo on CPU. The rendezvous and every collective are bounded
    by timeout_s (parallel.timeout_s): a rank that died or stalled fails its peers with a timeout error
    instead of hanging them (NCCL needs TORCH_NCCL_ASYNC_ERROR_HANDLING, on by default in recent torch).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except dist.DistStoreError as e:  # "Timed out after 5 seconds waiting for clients. 1/2 clients joined."
        raise RankTimeout(f"rank {rank}: the process group of {world_size} ranks did not form within "
                          f"parallel.timeout_s={timeout_s:g} s: {' '.join(str(e).split())}") from e
    log.info("rank %d/%d initialised (%s, collective timeout %.0fs)", rank, world_size, backend, timeout_s)
    return rank, world_size


class ParallelDims:
    """dp x pp x cp over `world_size` ranks: validation, the rank layout, and (after `build`) the groups.

    The constructor only validates (pure, so every rank raises the same error for the same config);
    `build()` creates one process group per dimension and coordinate (a collective on all ranks).
    """

    def __init__(self, dp: int, pp: int, cp: int, world_size: int):
        for name, n in zip(DIMS, (dp, pp, cp), strict=True):
            if not isinstance(n, int) or n < 1:
                raise ConfigError(f"config key 'parallel.{name}' must be an int >= 1 (got {n!r})")
        if dp * pp * cp != world_size:
            raise ConfigError(
                f"parallel.dp * parallel.pp * parallel.cp must equal the world size: "
                f"{dp} * {pp} * {cp} = {dp * pp * cp} != {world_size} (world size)"
            )
        self.dp, self.pp, self.cp, self.world_size = dp, pp, cp, world_size
        self.local = False  # one process on its own, whatever the launched world (see `single`)
        self._groups: dict[str, dist.ProcessGroup | None] | None = None
        self.roll_call: RollCall | None = None  # after build(), with more than one rank
        self._usp: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}

    def __repr__(self) -> str:
        return f"ParallelDims(dp={self.dp}, pp={self.pp}, cp={self.cp}, world_size={self.world_size})"

    @classmethod
    def single(cls) -> ParallelDims:
        """One process computing everything on its own, even inside a launched world (tests compare with it)."""
        dims = cls(1, 1, 1, 1)
        dims.local, dims._groups = True, dict.fromkeys(DIMS)
        return dims

    # --- the layout (pure) ---

    def rank_of(self, dp_i: int, pp_i: int, cp_i: int) -> int:
        return (dp_i * self.pp + pp_i) * self.cp + cp_i

    def coords(self, rank: int) -> dict[str, int]:
        """{'dp': dp_i, 'pp': pp_i, 'cp': cp_i} of a global rank."""
        assert 0 <= rank < self.world_size, (rank, self.world_size)
        return {"dp": rank // (self.pp * self.cp), "pp": rank // self.cp % self.pp, "cp": rank % self.cp}

    def peers(self, dim: str, rank: int) -> list[int]:
        """Global ranks of `rank`'s group along `dim`, in group-rank order (rank's coordinate varies, others fixed)."""
        c = self.coords(rank)
        return [self.rank_of(*({**c, dim: i}[d] for d in DIMS)) for i in range(getattr(self, dim))]

    def all_groups(self, dim: str) -> list[list[int]]:
        """Every group along `dim`, in a fixed order (the order all ranks create them in)."""
        return sorted({tuple(self.peers(dim, r)) for r in range(self.world_size)})

    # --- the groups (collective) ---

    def build(self, timeout_s: float | None = None) -> ParallelDims:
        """Create the dp, pp and cp process groups and the roll call's (rollcall.py). Every rank must call it;
        the default group must exist unless world_size == 1 (then every group is None and every rank 0)."""
        if self.world_size == 1 and not dist.is_initialized():
            self._groups = dict.fromkeys(DIMS)
            return self
        if dist.get_world_size() != self.world_size:
            raise ConfigError(f"{self} does not match the launched world size {dist.get_world_size()}")
        timeout_s = dist.default_pg_timeout.total_seconds() if timeout_s is None else timeout_s
        me = dist.get_rank()
        self._groups = {}
        try:
            for dim in DIMS:
                for ranks in self.all_groups(dim):  # new_group is collective: all ranks create all groups, same order
                    group = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
                    if me in ranks:
                        self._groups[dim] = group
            self.roll_call = RollCall(timeout_s)
        except RuntimeError as e:  # DistStoreError "wait timeout after 3000ms, keys: ...", or gloo's connect
            if not (isinstance(e, dist.DistStoreError) or is_peer_fault(e)):
                raise
            raise RankTimeout(f"rank {me}: the mesh's process groups did not form within parallel.timeout_s="
                              f"{timeout_s:g} s (a rank did not reach ParallelDims.build): "
                              f"{' '.join(str(e).split())}") from e
        log.info("%s: rank %d is %s", self, me, self.coords(me))
        return self

    def _group(self, dim: str) -> dist.ProcessGroup | None:
        assert self._groups is not None, "ParallelDims.build() must run before asking for process groups"
        return self._groups[dim]

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() and not self.local else 0

    @property
    def is_writer(self) -> bool:
        """Global rank 0 alone writes metrics, checkpoints and the run directory."""
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self._group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self._group("pp")

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self._group("cp")

    @property
    def dp_rank(self) -> int:
        return self.coords(self.rank)["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords(self.rank)["pp"]

    @property
    def cp_rank(self) -> int:
        return self.coords(self.rank)["cp"]

    @property
    def dp_ranks(self) -> list[int]:
        return self.peers("dp", self.rank)

    @property
    def pp_ranks(self) -> list[int]:
        return self.peers("pp", self.rank)

    @property
    def cp_ranks(self) -> list[int]:
        return self.peers("cp", self.rank)

    def usp_groups(self, ulysses_degree: int, timeout_s: float | None = None) -> tuple[dist.ProcessGroup, ...]:
        """(ulysses_group, ring_group) splitting this rank's CP group as cp = ulysses_degree x ring degree,
        Ulysses innermost (consecutive CP ranks). Collective on first use for a degree; cached after."""
        u = ulysses_degree
        if u < 1 or self.cp % u:
            raise ConfigError(f"ulysses_degree must divide parallel.cp={self.cp} (got {u})")
        if u not in self._usp:
            timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
            me, mine = self.rank, {}
            for cp_ranks in self.all_groups("cp"):
                splits = {
                    "ulysses": [cp_ranks[i : i + u] for i in range(0, self.cp, u)],
                    "ring": [cp_ranks[j::u] for j in range(u)],
                }
                for kind, groups in splits.items():
                    for ranks in groups:
                        group = dist.new_group(list(ranks), timeout=timeout)
                        if me in ranks:
                            mine[kind] = group
            self._usp[u] = (mine["ulysses"], mine["ring"])
        return self._usp[u]


def parallel_dims(cfg) -> ParallelDims:
    """The built mesh of `parallel.*` over the launched world (torchrun's env, or one process)."""
    p = cfg.parallel
    _, world_size = init_distributed(p.timeout_s)
    return ParallelDims(p.dp, p.pp, p.cp, world_size).build(p.timeout_s)  # same error on every rank for a bad layout
