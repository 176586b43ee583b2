"""Real SGLang PD workers: command lines (``plan``), kernel profiles, and the patched worker entrypoint.

Only ``engine.sglang.worker`` imports sglang (the optional extra); planning and the patch
logic import nothing heavy.
"""
