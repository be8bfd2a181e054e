"""torch's tensor-in, tensor-out collectives under their name in this torch: torch 2.13 renamed them
(`all_gather_single`, `reduce_scatter_single`; the old names warn once per call site and process), torch
2.11 and 2.12 have only the old ones. Every plait call goes through here."""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
