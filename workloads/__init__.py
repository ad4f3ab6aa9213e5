"""Code that runs inside jobs: every job entry point is ``python -m workloads.MODULE``.

Importing this package therefore comes first in every job process (each torchrun rank too), which
makes it the one place that sets how the files a job writes on shared storage are created, by
whichever library writes them (AutoModel's checkpoints, megatron's caches): the umask from
NEMOFLOW_UMASK (default 027: files 0640, directories 0750), see infra/permissions.py.
"""

from infra.permissions import apply_umask_at_start

apply_umask_at_start()
