"""A tiny torch.distributed workload for backend tests: ``python -m tests.support.ranks OUT_DIR``.

Each rank joins the process group (gloo), all-reduces its rank and writes ``rank-<r>.json`` with
what it saw, so a test can check that the backend started every rank with a working rendezvous.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank])
    dist.all_reduce(total)
    out = os.path.join(sys.argv[1], f"rank-{rank}.json")
    with open(out, "w") as fh:
        json.dump({"rank": rank, "world": world, "sum": int(total.item()), "local_rank": os.environ["LOCAL_RANK"]}, fh)
    print(f"rank {rank}/{world} sum {int(total.item())}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
