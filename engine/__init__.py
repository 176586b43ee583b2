"""Engine workers that pdgate drives: ``engine.sim`` (CPU) and, later, ``engine.sglang``."""
