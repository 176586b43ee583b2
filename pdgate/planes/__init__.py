"""The planes on top: the server (front door and admin plane), the admin and dashboard endpoints, the
peers' fan-out, the control loops, the multi-process supervisor, ``pdgate up`` and the CLI."""
