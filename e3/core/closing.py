"""A holder of one tritonclient connection that is its own context manager.

The client SDK (:class:`e3.client.sdk.E3Client`) and the controller's model
control (:class:`e3.controller.triton_api.TritonControl`) each hold one
tritonclient client in ``_client``; ``with`` closes it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ClosingClient"]


class ClosingClient:
    """Mixin: ``close()`` closes ``self._client``; ``with obj:`` closes it on leaving."""

    _client: Any

    def close(self) -> None:
        """Closes the connection."""
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
