"""Point-to-point transport between explicit pipeline ranks.

Every message is one tensor identified by :func:`megatron_prt.core.lower.message_key`
``(kind, from_stage, to_stage, mb)``. Peers are any ranks of the pipeline group (not only
prev/next). Message order per peer pair follows the lowered plan on both sides, which is
all NCCL matches on; gloo additionally gets a tag per edge.

Shapes are exchanged once: the first message on an edge ``(kind, from, to)`` is preceded by
a small int64 header carrying its shape; later messages on that edge reuse it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

_HEADER_LEN = 9  # ndim + up to 8 dims


class Transport:
    """Issues isend/irecv to pipeline ranks; ``rank_of_stage`` maps stage -> group rank."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank_of_stage: Callable[[int], int],
        device: torch.device,
        dtype: torch.dtype,
        timeout_s: float,
    ) -> None:
        self.group = group
        self.rank_of_stage = rank_of_stage
        self.device = device
        self.dtype = dtype
        self.timeout = timedelta(seconds=timeout_s)
        self.shapes: dict[tuple, torch.Size] = {}  # edge -> shape
        self._global = {}

    def global_rank(self, group_rank: int) -> int:
        if group_rank not in self._global:
            self._global[group_rank] = (
                group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)
            )
        return self._global[group_rank]

    @staticmethod
    def edge(key: tuple) -> tuple:
        return key[:3]

    def knows(self, key: tuple) -> bool:
        return self.edge(key) in self.shapes

    def send_ops(self, key: tuple, tensor: torch.Tensor) -> list[dist.P2POp]:
        """P2P ops sending ``tensor`` (header first if the edge is new)."""
        peer = self.global_rank(self.rank_of_stage(key[2]))
        ops = []
        if not self.knows(key):
            self.shapes[self.edge(key)] = tensor.shape
            ops.append(dist.P2POp(dist.isend, self._header(tensor.shape), peer, self.group))
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, self.group))
        return ops

    def recv_header(self, key: tuple) -> None:
        """Blocking receive of a new edge's shape (first use of the edge only)."""
        peer = self.global_rank(self.rank_of_stage(key[1]))
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        work = dist.irecv(header, peer, self.group)
        self.wait(work)
        ndim = int(header[0])
        self.shapes[self.edge(key)] = torch.Size(int(d) for d in header[1 : 1 + ndim])

    def recv_op(self, key: tuple) -> tuple[dist.P2POp, torch.Tensor]:
        peer = self.global_rank(self.rank_of_stage(key[1]))
        buf = torch.empty(self.shapes[self.edge(key)], dtype=self.dtype, device=self.device)
        return dist.P2POp(dist.irecv, buf, peer, self.group), buf

    def _header(self, shape: torch.Size) -> torch.Tensor:
        if len(shape) > _HEADER_LEN - 1:
            raise ValueError(f"pipeline tensors may have at most {_HEADER_LEN - 1} dims: {shape}")
        values = [len(shape), *shape] + [0] * (_HEADER_LEN - 1 - len(shape))
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def wait(self, work) -> None:
        work.wait(self.timeout)

    @staticmethod
    def start(ops: list[dist.P2POp]) -> list:
        return dist.batch_isend_irecv(ops) if ops else []
