"""A lean HTTP/1.1 server and client on asyncio protocols and httptools (llhttp).

Shared by the gateway (``pdgate``) and the simulated engines (``engine.sim``), which must not
import each other (``docs/architecture.md``, "Parts"): it knows nothing of either. ``errors`` holds the root of the
error tree whose instances the server answers as OpenAI error objects; pdgate extends it.
Not called ``h1``: a PyPI package of that name (a HackerOne client) installs a top-level ``h1``.
"""
