"""A real `shoal serve` subprocess with the built-in model, started once per session.

Every test here talks HTTP to it over loopback (the official `openai` client, httpx), the
way users and probes do. Tests that need a server of their own (draining, the watchdog,
the API key, a tiny queue) start a second one with `server_helpers.start_server`.
"""

from __future__ import annotations

import httpx
import pytest

from server_helpers import start_server


@pytest.fixture(scope="session")
def server():
    s = start_server()
    yield s
    rc = s.stop()
    assert rc == 0, f"server exited with {rc}:\n{s.log()[-3000:]}"


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        yield c
