"""`shoal router`: one OpenAI-compatible front for several `shoal serve` groups, sending each
request where its prompt's prefix is already cached and the load is light (docs/router.md).

    picker.py    the pure choice: score = prefix_weight x matched fraction - load_weight x load
    backends.py  one Backend per group, its poller (GET /kv/blocks) and the readiness waiters
    hashing.py   a request body -> its prompt's block hashes (the servers' tokenizer and hash)
    forward.py   one request to one backend, streaming passed through; retries before the first byte
    app.py       the routes, the held requests (scale from zero), the metrics
    args.py      the CLI flags and the process entry

The router talks HTTP only: it imports no engine, executor or model code (tests/router check).
"""
