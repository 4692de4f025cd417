"""Joining a Ray cluster for the commands' ``--ray-address`` (Serve and Data alike)."""
from __future__ import annotations


def connect(address: str, num_cpus: int | None = None):
    """``ray.init`` for ``--ray-address``: ``local`` starts a cluster in this process, ``auto``
    joins the one on this machine, anything else is a cluster address (``ray://host:10001`` or
    ``host:6379``). Raises ValueError when Ray is missing or cannot connect."""
    try:
        import ray
    except ImportError:
        raise ValueError('--ray-address needs Ray: pip install "enc2dec[ray]"') from None
    if ray.is_initialized():
        return ray
    try:
        if address == "local":
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError) as e:
        raise ValueError(f"--ray-address {address}: cannot connect to a Ray cluster: {e}") from None
    return ray


def gpus_per_engine(llm_args) -> float:
    """The GPUs one engine (a Serve replica, a Data actor) asks Ray for: its tensor-parallel size on
    CUDA, none on the CPU. ``device="auto"`` follows the cluster (this process may be a CPU-only
    head node, so its own CUDA says nothing)."""
    device = str(getattr(llm_args, "device", "auto") or "auto")
    if device.startswith("cpu"):
        return 0
    if device == "auto":
        import ray

        if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) == 0:
            return 0
    return llm_args.tensor_parallel_size
