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
