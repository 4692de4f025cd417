"""For the GPU tests that prove a path never waits for the device."""
from contextlib import contextmanager

import torch


@contextmanager
def syncs_raise():
    """Inside, any blocking device-to-host copy or stream synchronisation raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def queue_busy_work(num_matmuls: int) -> None:
    """Heavy work on the stream: a call after it that waited for the GPU would block behind it."""
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(num_matmuls):
        busy = busy @ busy / 64
