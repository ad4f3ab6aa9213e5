"""A flow small enough to check the control plane, not the pipeline (tests/devtools/test_prefect_local.py)."""

from prefect import flow, get_run_logger


@flow(name="auth-check")
def auth_check() -> int:
    get_run_logger().info("the flow run reached the API")
    return 42
