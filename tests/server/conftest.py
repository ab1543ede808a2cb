"""A real `shoal serve` subprocess with the built-in model, started once per session.

Every test here talks HTTP to it over loopback (the official `openai` client, httpx), the
way users and probes do. Tests that need a server of their own (draining, the watchdog,
the API key, a tiny queue) start a second one with `server_helpers.served(args)`.
"""

from __future__ import annotations

import pytest

from server_helpers import served


@pytest.fixture(scope="session")
def server():
    with served() as s:
        yield s


@pytest.fixture(scope="session")
def client(server):
    return server.openai(timeout=300)


@pytest.fixture(scope="session")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture
def http(server):
    with server.http(timeout=300) as c:
        yield c
