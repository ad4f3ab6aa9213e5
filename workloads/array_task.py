"""What every job-array workload reads first: the plan its stage wrote, and which of the plan's tasks is this one.

The index comes from ``--array-index`` or, in an array job, from $NEMOFLOW_ARRAY_INDEX (the backends set it).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from pydantic import BaseModel

from infra import storage
from infra.jobs import ARRAY_INDEX_ENV

Plan = TypeVar("Plan", bound=BaseModel)


def read_array_task(
    argv: Sequence[str] | None, description: str | None, plan_type: type[Plan], size: Callable[[Plan], int], unit: str
) -> tuple[Plan, int] | None:
    """The plan (``--plan``) and this task's index in it; None, after one line on stderr, when the index is not
    one of the plan's ``size(plan)`` ``unit``s."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True, help="plan JSON written by the data stage (path or gs:// URI)")
    parser.add_argument("--array-index", type=int, default=None, help=f"{unit} to run (default: ${ARRAY_INDEX_ENV})")
    args = parser.parse_args(argv)
    index = args.array_index if args.array_index is not None else int(os.environ.get(ARRAY_INDEX_ENV, "0"))
    plan = plan_type.model_validate(storage.read_json(args.plan))
    if not 0 <= index < size(plan):
        print(f"array index {index} out of range: the plan {args.plan} has {size(plan)} {unit}(s)", file=sys.stderr)
        return None
    return plan, index
