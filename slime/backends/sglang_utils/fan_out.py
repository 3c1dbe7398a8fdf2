"""One call to every worker the router lists (sglang-router 0.3.2 routes generation only: aborts, pauses, weight
updates and load reports go to each worker), answered by URL; a failure names every worker that failed."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from slime.backends.sglang_utils import http_client


class EngineGroupError(RuntimeError):
    """A fan-out call failed on one or more workers; the message names each."""


class FanOut:
    def __init__(self, worker_urls: Callable[[], list[str]], workers: int):
        self.worker_urls = worker_urls
        self.pool = ThreadPoolExecutor(max_workers=max(4, workers), thread_name_prefix="engine-group")

    def submit(self, method: str, path: str, json=None, timeout: float = 60.0, urls: list[str] | None = None,
               payloads: list | None = None) -> dict[str, Future]:
        """`method path` to each of `urls` (default every worker), `payloads[i]` to the i-th if given; {url: Future}."""
        urls = self.worker_urls() if urls is None else urls
        if not urls:
            raise EngineGroupError(f"{method} {path}: the router lists no workers")
        call = http_client.post_json if method == "POST" else (lambda u, _j, timeout: http_client.get_json(u, timeout))
        return {url: self.pool.submit(call, http_client.join_url(url, path), payloads[i] if payloads else json, timeout)
                for i, url in enumerate(urls)}

    def wait(self, futures: dict[str, Future], what: str, timeout: float | None = None,
             check_success: bool = False) -> dict[str, object]:
        """Results by worker URL; raises EngineGroupError naming every worker that failed (or said success=false)."""
        results, failures = {}, []
        deadline = None if timeout is None else time.monotonic() + timeout
        for url, fut in futures.items():
            try:
                res = fut.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except Exception as e:
                failures.append(f"{url}: {type(e).__name__}: {e}")
                continue
            if check_success and not (isinstance(res, dict) and res.get("success")):
                failures.append(f"{url}: {res!r}")
            results[url] = res
        if failures:
            raise EngineGroupError(f"{what} failed on {len(failures)}/{len(futures)} worker(s):\n" + "\n".join(failures))
        return results

    def call(self, method: str, path: str, json=None, timeout: float = 60.0, urls: list[str] | None = None,
             check_success: bool = False) -> dict[str, object]:
        return self.wait(self.submit(method, path, json, timeout, urls), f"{method} {path}", timeout + 5, check_success)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
