"""Real vLLM workers (``engine = "vllm"`` in a cluster file): command lines for ``vllm serve`` in its own virtual
environment, NIXL over CPU memory between a prefill and a decode (``plan``), and the install (``install.sh``)."""
