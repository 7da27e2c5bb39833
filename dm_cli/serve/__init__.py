"""`dmap serve`: one planned pipeline kept loaded behind an HTTP API (OpenAI's images shape), for many clients.

- `requests`: a request's JSON body to queue items (`dm_cli.run.sessions.queue.queue_item`, the code a `--prompts` JSONL
  line goes through) and the settled jobs (`Session.job_for`, as the queue settles its items), every refusal one
  sentence (a 400);
- `worker`: the bounded queue and the one thread that runs the session, batching what arrived together
  stage-major (`Session.generate`), in arrival order; under torchrun the other ranks compute their share;
- `app`: the Starlette application (routes, API key, body bounds, disconnects, metrics);
- `connections`: connections bounded below the file limit, request heads and bodies timed, the accept loop, a log
  that says a repeated line once with a count (no client can lock the others out);
- `server`: the session loaded once, the worker, uvicorn, and SIGTERM (the running batch finishes, then it stops).

Starlette and uvicorn are imported inside functions: `dmap --help` imports neither.
"""
