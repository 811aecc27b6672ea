"""API keys: one set for inference, one for reward posting and admin (`service.api_keys`,
`service.admin_keys`, or the env vars ``SERVE_RFT_API_KEYS`` / ``SERVE_RFT_ADMIN_KEYS``,
comma-separated). Clients send ``Authorization: Bearer <key>`` (what the openai SDK sends).

With no key configured the service is open. With keys configured: ``/health`` stays open,
``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models[/{id}]`` take an inference or an
admin key, every other
``/v1`` endpoint (rewards, experiences, status, sync events) takes an admin key only. A request
without the right key gets 401 with the OpenAI error JSON.
"""

from __future__ import annotations

import hmac

from serve_rft.explorer.protocol import ApiError

INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
OPEN_PATHS = ("/health",)


def _inference(path: str) -> bool:
    """Inference endpoints: generation and the model list (``/v1/models/{id}`` too)."""
    return path in INFERENCE_PATHS or path.startswith("/v1/models/")


class ApiKeys:
    """The configured keys and the scope of each path.

    Args:
        inference: keys that may call inference endpoints.
        admin: keys that may call every endpoint.
    """

    def __init__(self, inference: list[str], admin: list[str]):
        self.inference = [k for k in inference if k]
        self.admin = [k for k in admin if k]

    @property
    def enabled(self) -> bool:
        return bool(self.inference or self.admin)

    @staticmethod
    def _matches(key: str, keys: list[str]) -> bool:
        return any(hmac.compare_digest(key.encode(), k.encode()) for k in keys)

    def check(self, path: str, authorization: str | None) -> None:
        """Allow or refuse a request for ``path`` with this ``Authorization`` header.

        Raises:
            ApiError: 401 missing, unknown, or an inference key on an admin endpoint.
        """
        if not self.enabled or path in OPEN_PATHS:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        key = key.strip()
        if self._matches(key, self.admin):
            return
        if _inference(path) and self._matches(key, self.inference):
            return
        if self._matches(key, self.inference):
            raise ApiError(401, f"an inference key cannot call {path}; use an admin key",
                           code="invalid_api_key")
        raise ApiError(401, "incorrect API key provided", code="invalid_api_key")
