"""``python -m workloads.train``: see the package's docstring."""

from infra.processes import exit_now
from workloads.train.run import main

if __name__ == "__main__":
    exit_now(main())  # without the interpreter's teardown (CUDA, NCCL, compiled kernels): see exit_now
