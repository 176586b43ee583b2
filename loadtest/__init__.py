"""Load tests for any OpenAI-compatible PD gateway: bench (side-by-side numbers)."""
