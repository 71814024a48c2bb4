"""`qic serve`: the OpenAI images API over a loaded bundle (FastAPI on uvicorn).

runner.py wraps the runtime's `generate` (one bundle, one worker thread); queue.py is the bounded
queue that groups compatible requests; app.py the HTTP routes, errors and access log; cli.py loads,
binds and drains.
"""
