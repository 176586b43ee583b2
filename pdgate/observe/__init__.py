"""What watches requests: metrics, the access log, OpenTelemetry and the live/finished records (``traces``).
Nothing here decides anything on the request path."""
