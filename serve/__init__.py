"""enc2dec serve: an OpenAI-compatible HTTP server over the engine's async API.

FastAPI, uvicorn and prometheus-client (the ``serve`` extra) are imported only by the
modules that need them (``app``, ``server`` and the route modules), so importing this
package, ``config`` or the CLI costs nothing on machines without them.

    from enc2dec.serve.config import ServeConfig, build_llm_args
    from enc2dec.serve.server import run_server
    run_server(ServeConfig(model="google/flan-t5-small"), build_llm_args("google/flan-t5-small"))
"""
