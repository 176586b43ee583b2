"""Wire constants shared by the gateway and the engines.

This is the one module that both ``pdgate`` and ``engine`` may import (``docs/architecture.md``, "Parts"); in
``pdgate`` only the SGLang adapter (``pdgate/adapters/sglang.py``) and the config's default bootstrap port use it.
It holds names only: paths, field names, queue names.
"""

from __future__ import annotations

# Fields the router adds to both legs of a PD request (SGLang 0.5.x).
BOOTSTRAP_HOST = "bootstrap_host"
BOOTSTRAP_PORT = "bootstrap_port"
BOOTSTRAP_ROOM = "bootstrap_room"
RID = "rid"
DEFAULT_BOOTSTRAP_PORT = 8998

# Generation routes forwarded to both legs, same path and body.
GENERATE_ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions")

# Engine endpoints.
ABORT_PATH = "/abort_request"
HEALTH_PATH = "/health"
SERVER_INFO_PATH = "/server_info"
LOADS_PATH = "/v1/loads"
METRICS_PATH = "/metrics"

# The pdgate engine extension (docs/engines.md).
EXT_REQUESTS_PATH = "/pdgate/v1/requests"
EXT_FAULTS_PATH = "/pdgate/v1/faults"
# Identity and fixes of a real SGLang worker started by engine/sglang (its /server_info is SGLang's own).
EXT_INFO_PATH = "/pdgate/v1/info"
# Field of /server_info that changes each time an engine process starts.
IDENTITY_FIELD = "pdgate_identity"
# Field of /server_info that lists the engine-side fixes in force.
FIXES_FIELD = "pdgate_fixes"

# SGLang gauge names for the PD queues (prefix "sglang:"; newer releases "sglang_").
GAUGE_PREFILL_BOOTSTRAP = "num_prefill_bootstrap_queue_reqs"
GAUGE_PREFILL_BOOTSTRAP_OLD = "num_prefill_prealloc_queue_reqs"
GAUGE_PREFILL_INFLIGHT = "num_prefill_inflight_queue_reqs"
GAUGE_DECODE_PREALLOC = "num_decode_prealloc_queue_reqs"
GAUGE_DECODE_TRANSFER = "num_decode_transfer_queue_reqs"
GAUGE_RUNNING = "num_running_reqs"
GAUGE_QUEUE = "num_queue_reqs"
