"""How an LLM front (``LLM``, ``ProcessLLM``, ``DataParallelLLM``) ends: a ``with`` block's end
and the last reference's collection both call its ``shutdown()``, which must be idempotent."""
from __future__ import annotations


class ShutdownOnExit:
    def shutdown(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown, or a constructor that failed half-way
            pass
