"""SGLang's weight-update session around the buckets of one update: since SGLang 0.5.21 the scheduler refuses
tensor and distributed updates unless `POST /begin_weight_update` opened one (a server without the route, 404,
needs none). A session left open by a killed trainer is closed and opened again, with a warning."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from slime.backends.sglang_utils import http_client

logger = logging.getLogger(__name__)

BEGIN = "/begin_weight_update"
END = "/end_weight_update"


def _post(url: str, path: str, timeout: float):
    return http_client.post_json(http_client.join_url(url, path), {}, timeout=timeout)


def _begin(url: str, timeout: float) -> bool:
    """Open a session on `url`; False where the server has no sessions (404)."""
    try:
        _post(url, BEGIN, timeout)
        return True
    except http_client.EngineHTTPError as e:
        if e.status == 404:
            return False
        if e.status == 400 and "already open" in e.message:
            logger.warning("%s: a weight-update session was left open (an earlier update did not finish); closing "
                           "it and opening a new one", url)
            _post(url, END, timeout)
            _post(url, BEGIN, timeout)
            return True
        raise


class WeightUpdateSessions:
    """The sessions of one update, on every engine it reaches (trainer rank 0 opens and closes them)."""

    def __init__(self, pool: ThreadPoolExecutor, timeout: float):
        self.pool = pool
        self.timeout = timeout
        self.open_on: list[str] = []

    def open(self, urls: list[str]) -> None:
        """Open a session on every engine in `urls` (at once); raises naming each engine that refused."""
        futures = {u: self.pool.submit(_begin, u, self.timeout) for u in urls}
        errors = []
        for url, fut in futures.items():
            try:
                if fut.result(timeout=self.timeout + 5):
                    self.open_on.append(url)
            except Exception as e:  # noqa: BLE001 - every engine's answer is collected first
                errors.append(f"{url}: {e}")
        if errors:
            self.close(quiet=True)
            raise RuntimeError(f"weight update: {BEGIN} failed on {len(errors)} engine(s): " + "; ".join(errors))

    def close(self, quiet: bool = False) -> None:
        """Close every session this object opened; raises (unless `quiet`) naming each engine that refused."""
        urls, self.open_on = self.open_on, []
        futures = {u: self.pool.submit(_post, u, END, self.timeout) for u in urls}
        errors = []
        for url, fut in futures.items():
            try:
                fut.result(timeout=self.timeout + 5)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{url}: {e}")
        if errors and quiet:
            logger.warning("weight update: %s failed after a failed update: %s", END, "; ".join(errors))
        elif errors:
            raise RuntimeError(f"weight update: {END} failed on {len(errors)} engine(s): " + "; ".join(errors))
