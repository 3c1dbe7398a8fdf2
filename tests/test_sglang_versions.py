"""The SGLang version pins and the start-up check that refuses an engine speaking an SGLang version outside them."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import threading

import pytest
from aiohttp import web

from slime.backends.sglang_utils import engine_api
from slime.utils import sglang_versions as versions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("dockerfile", ["docker/Dockerfile", "docker/Dockerfile.rocm"])
def test_dockerfiles_build_the_pinned_version(dockerfile):
    text = open(os.path.join(REPO, dockerfile)).read()
    assert re.search(r"^ARG SGLANG_VERSION=(\S+)$", text, re.M).group(1) == versions.SGLANG_PINNED
    assert "slime/utils/sglang_versions.py" in text  # the build checks the image against the range


def test_setup_extra_is_the_supported_range():
    import runpy

    text = open(os.path.join(REPO, "setup.py")).read()
    assert '"sglang": [_versions["sglang_requirement"]()]' in text
    assert runpy.run_path(os.path.join(REPO, "slime/utils/sglang_versions.py"))["sglang_requirement"]() \
        == f"sglang>={versions.SGLANG_OLDEST},<={versions.SGLANG_PINNED}"


def test_every_contract_version_has_its_packages_and_is_supported():
    assert set(versions.CONTRACT_VERSIONS) == {versions.SGLANG_PINNED, versions.SGLANG_OLDEST}
    for v in versions.CONTRACT_VERSIONS:
        assert versions.is_supported(v) and v in versions.CONTRACT_VERSION_PACKAGES


@pytest.mark.parametrize("version,ok", [
    ("0.5.15.post1", True), ("0.5.15", False), ("0.5.16", True), ("0.5.20", True), ("0.5.23", True),
    ("0.5.23.post1", False), ("0.5.24", False), ("0.4.10", False), ("0.6.0", False), ("v0.5.21", True),
    ("0.5.22rc1", True), ("dev", False), ("", False),
])
def test_supported_range(version, ok):
    assert versions.is_supported(version) is ok


def _serve(routes: dict[str, dict]):
    """A server answering GET `path` with the JSON of `routes[path]` (404 elsewhere), on a thread."""
    app = web.Application()
    for path, body in routes.items():
        app.router.add_get(path, lambda request, body=body: web.json_response(body))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return f"http://127.0.0.1:{port}", lambda: loop.call_soon_threadsafe(loop.stop)


def test_an_unsupported_engine_fails_naming_its_version_and_what_we_support():
    # SGLang's /server_info: the server args, scheduler info, internal_states and "version": sglang.__version__
    old, stop_old = _serve({"/server_info": {"model_path": "m", "internal_states": [{}], "version": "0.5.9"}})
    good, stop_good = _serve({"/server_info": {"model_path": "m", "version": versions.SGLANG_PINNED}})
    try:
        with pytest.raises(engine_api.UnsupportedEngineVersion) as err:
            engine_api.check_engine_versions([good, old])
        msg = str(err.value)
        assert f"{old} runs SGLang 0.5.9" in msg and good not in msg
        assert versions.SGLANG_OLDEST in msg and versions.SGLANG_PINNED in msg
        assert engine_api.check_engine_versions([good]) == {good: versions.SGLANG_PINNED}
    finally:
        stop_old()
        stop_good()


def test_the_version_is_read_from_get_server_info_where_server_info_is_missing():
    url, stop = _serve({"/get_server_info": {"version": versions.SGLANG_OLDEST}})
    try:
        assert engine_api.engine_version(url) == versions.SGLANG_OLDEST
    finally:
        stop()


def test_an_engine_that_reports_no_version_is_refused():
    url, stop = _serve({"/server_info": {"model_path": "m"}})
    try:
        with pytest.raises(engine_api.UnsupportedEngineVersion, match="reports no SGLang version"):
            engine_api.check_engine_versions([url])
    finally:
        stop()


def test_an_unsupported_engine_stops_the_run_in_one_line():
    from slime.ray.train_loop import STOPS

    assert issubclass(engine_api.UnsupportedEngineVersion, STOPS)
