"""The backends (one `shoal serve` group each) and what the router knows of them.

Each backend has a poller: every --poll-interval it GETs /kv/blocks?since=SEQ&epoch=E and
applies the reply (docs/router.md): the block hashes its prefix cache holds, its load
(running, waiting, KV usage) and whether it is ready. A connection refused marks it down at
once (a killed group); a slow reply three times running does too. Requests held while no
backend is ready wait on `any_ready`, which the poller sets the moment one turns ready.
"""

from __future__ import annotations

import asyncio
import logging
import time

from shoal.runtime.router.picker import View

logger = logging.getLogger("shoal.router")

EXPECT_S = 5.0  # a prefix just sent to a backend counts as held there this long (until its poll says so)
MAX_SLOW_POLLS = 3


class Backend:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.name = self.url
        self.ready = False
        self.blocks: set[int] = set()
        self.expected: dict[int, float] = {}  # hash -> until when (monotonic)
        self.epoch: str | None = None
        self.seq = 0
        self.block_size: int | None = None
        self.max_model_len: int | None = None
        self.running = self.waiting = 0
        self.kv_usage = 0.0
        self.adapters: set[str] = set()  # LoRA adapters in its device slots
        self.base_model: str | None = None  # its base model's name, where it serves adapters
        self.in_flight = 0  # requests this router has sent and not seen end
        self.slow_polls = 0
        self.last_error = ""

    def has(self, h: int) -> bool:
        if h in self.blocks:
            return True
        until = self.expected.get(h)
        return until is not None and until > time.monotonic()

    def view(self) -> View:
        return View(self.name, self.ready, self.running, self.waiting, self.in_flight, self.kv_usage, self.has,
                    frozenset(self.adapters))

    def expect(self, hashes: list[int]) -> None:
        """The request just sent will cache these blocks here: count them before the next poll does."""
        until = time.monotonic() + EXPECT_S
        for h in hashes:
            if h not in self.blocks:
                self.expected[h] = until

    def apply(self, reply: dict) -> None:
        """One /kv/blocks reply."""
        if reply.get("reset"):
            self.blocks = set(reply.get("stored") or ())
        else:
            self.blocks.update(reply.get("stored") or ())
        self.blocks.difference_update(reply.get("removed") or ())
        self.epoch, self.seq = reply.get("epoch"), int(reply.get("seq", 0))
        self.block_size = int(reply.get("block_size") or 16)
        self.max_model_len = int(reply["max_model_len"]) if reply.get("max_model_len") else None
        load = reply.get("load") or {}
        self.running, self.waiting = int(load.get("running", 0)), int(load.get("waiting", 0))
        self.kv_usage = float(load.get("kv_cache_usage", 0.0))
        lora = reply.get("lora")
        self.adapters = set((lora or {}).get("slots") or ())
        self.base_model = (lora or {}).get("base")  # None: it serves no adapters
        if self.expected:
            now = time.monotonic()
            self.expected = {h: t for h, t in self.expected.items() if t > now and h not in self.blocks}
        self.ready = bool(reply.get("ready", True))
        self.slow_polls = 0


class Backends:
    """Every backend, their pollers, and the readiness event held requests wait on."""

    def __init__(self, urls: list[str], *, poll_interval: float = 0.2, dns: str | None = None, client=None):
        self.poll_interval = poll_interval
        self.dns = dns  # NAME:PORT of a headless Service: the backends are its addresses
        self.by_url: dict[str, Backend] = {}
        self._client = client
        self._tasks: dict[str, asyncio.Task] = {}
        self._dns_task: asyncio.Task | None = None
        self.any_ready = asyncio.Event()
        self.on_change = None  # called with the backend after every poll (metrics)
        self.on_forget = None  # called with the name of a backend gone from DNS
        for url in urls:
            self.by_url[url.rstrip("/")] = Backend(url)

    @property
    def all(self) -> list[Backend]:
        return list(self.by_url.values())

    def ready(self) -> list[Backend]:
        return [b for b in self.by_url.values() if b.ready]

    def block_size(self) -> int:
        """The block size the ready backends report (they share one model and flags)."""
        for b in self.by_url.values():
            if b.block_size:
                return b.block_size
        return 16

    def max_model_len(self) -> int | None:
        """The context the backends report (None until one has): prompts past it are refused there."""
        for b in self.by_url.values():
            if b.max_model_len:
                return b.max_model_len
        return None

    # -- life ------------------------------------------------------------------------------
    async def start(self) -> None:
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(max(1.0, 5 * self.poll_interval), connect=1.0))
        for b in self.all:
            self._start_poller(b)
        if self.dns:
            self._dns_task = asyncio.ensure_future(self._resolve_forever())

    async def stop(self) -> None:
        tasks = list(self._tasks.values()) + ([self._dns_task] if self._dns_task else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        await self._client.aclose()

    def _start_poller(self, b: Backend) -> None:
        self._tasks[b.url] = asyncio.ensure_future(self._poll_forever(b))

    # -- readiness -------------------------------------------------------------------------
    def refresh(self) -> None:
        if any(b.ready for b in self.by_url.values()):
            self.any_ready.set()
        else:
            self.any_ready.clear()

    def mark_down(self, b: Backend, why: str) -> None:
        if b.ready:
            logger.warning("backend %s down: %s", b.name, why)
        b.ready, b.last_error = False, why
        self.refresh()

    async def wait_ready(self, timeout: float) -> bool:
        """Until some backend is ready (True) or `timeout` seconds pass (False)."""
        if self.any_ready.is_set():
            return True
        try:
            await asyncio.wait_for(self.any_ready.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    # -- polling ---------------------------------------------------------------------------
    async def poll_once(self, b: Backend) -> None:
        import httpx

        was = b.ready
        try:
            r = await self._client.get(b.url + "/kv/blocks", params={"since": b.seq, "epoch": b.epoch or ""})
            if r.status_code == 200:
                b.apply(r.json())
                b.last_error = ""
            else:
                self.mark_down(b, f"/kv/blocks answered {r.status_code}")
        except httpx.TimeoutException:
            b.slow_polls += 1  # busy, perhaps: down only when it stays silent
            if b.slow_polls >= MAX_SLOW_POLLS:
                self.mark_down(b, f"{b.slow_polls} polls timed out")
        except (httpx.TransportError, OSError) as e:  # refused, reset: the process is gone
            self.mark_down(b, f"{type(e).__name__}: {e}")
        except (ValueError, KeyError, TypeError) as e:
            self.mark_down(b, f"bad /kv/blocks reply: {e}")
        if b.ready and not was:
            logger.info("backend %s ready (%d cached blocks)", b.name, len(b.blocks))
        self.refresh()
        if self.on_change is not None:
            self.on_change(b)

    async def _poll_forever(self, b: Backend) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await self.poll_once(b)
            except Exception:  # noqa: BLE001 - a poller never dies
                logger.exception("polling %s failed", b.name)
            await asyncio.sleep(max(0.0, self.poll_interval - (time.monotonic() - t0)))

    # -- a headless Service's addresses ------------------------------------------------------
    async def _resolve_forever(self) -> None:
        import socket

        host, _, port = self.dns.rpartition(":")
        loop = asyncio.get_running_loop()
        while True:
            try:
                infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                addrs = sorted({i[4][0] for i in infos})
                self.set_urls([f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in addrs])
            except OSError as e:
                logger.debug("resolving %s: %s", self.dns, e)  # none yet (scaled to zero): keep what we have
            await asyncio.sleep(max(1.0, 5 * self.poll_interval))

    def set_urls(self, urls: list[str]) -> None:
        """The backends are now exactly `urls` (pollers started and stopped to match)."""
        want = {u.rstrip("/") for u in urls}
        for url in list(self.by_url):
            if url not in want:
                logger.info("backend %s gone from %s", url, self.dns)
                del self.by_url[url]
                task = self._tasks.pop(url, None)
                if task is not None:
                    task.cancel()
                if self.on_forget is not None:
                    self.on_forget(url)
        for url in sorted(want - set(self.by_url)):
            logger.info("backend %s found", url)
            b = self.by_url[url] = Backend(url)
            self._start_poller(b)
        self.refresh()
