"""`shoal serve` moves what start-up made to the garbage collector's permanent generation
once the model is loaded (ServerState(freeze_gc=True)), so that a full collection in the
steady state walks only what serving made; other users of ServerState (tests, embedders)
keep their collector as it was. Run in a fresh interpreter: freezing is process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import asyncio, gc, sys
from shoal.runtime.config import EngineConfig
from shoal.runtime.entrypoints.state import ServerState

async def main():
    state = ServerState(EngineConfig(kv_cache_memory=2**26, max_model_len=256, max_num_seqs=4), log_stats_interval=0,
                        freeze_gc=sys.argv[1] == "1")
    loaded = asyncio.Event()
    def on_loaded():
        state.on_loaded()
        loaded.set()
    state.engine.start(asyncio.get_running_loop(), on_loaded=on_loaded)
    await asyncio.wait_for(loaded.wait(), 300)
    print(state.engine.state, gc.get_freeze_count())
    state.engine.stop()

asyncio.run(main())
"""


@pytest.mark.parametrize("freeze", [True, False])
def test_serve_freezes_start_up_objects_once_loaded(freeze):
    out = subprocess.run([sys.executable, "-c", SCRIPT, "1" if freeze else "0"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    state, frozen = out.stdout.split()[-2:]
    assert state == "ready"
    if freeze:
        assert int(frozen) > 10_000  # the interpreter, torch, transformers, the tokenizer...
    else:
        assert int(frozen) == 0
