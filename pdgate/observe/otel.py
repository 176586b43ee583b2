"""OpenTelemetry (optional extra ``otel``): a span per request, a child per attempt and, under it, one per leg,
with the record's phases and the attempt's events (sent, first token, aborts, errors) as span events.

The client's W3C ``traceparent`` is the request span's parent; both engine legs carry the attempt span's
``traceparent``, so an engine that traces (SGLang's ``--enable-trace``) joins the same trace. The request and
attempt spans run live; the leg spans are made when the attempt ends, from its event times (a leg has no
work of its own on the gateway to wrap). Off unless ``[otel] enabled = true``: the request path then costs
one ``is None``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from pdgate.core.config import ConfigError, OtelConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

    from pdgate.core.record import Attempt, Record

log = logging.getLogger("pdgate.otel")
LEG_END = {"prefill": ("prefill_done",), "decode": ("decode_done",)}
EXPORT_TIMEOUT_S = 2.0  # one export to the collector
SHUTDOWN_S = 3.0  # at stop: what is batched goes out within this, or is dropped


class Otel:
    def __init__(self, cfg: OtelConfig, exporter: SpanExporter | None = None) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            raise ConfigError("otel.enabled", True, "needs the otel extra: pip install -e '.[otel]'") from None
        self.provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}))
        if exporter is None:  # a collector that is down costs a stop at most SHUTDOWN_S, never the request path
            self.provider.add_span_processor(BatchSpanProcessor(
                OTLPSpanExporter(endpoint=cfg.endpoint, timeout=EXPORT_TIMEOUT_S),
                export_timeout_millis=int(EXPORT_TIMEOUT_S * 1000), max_queue_size=8192))
        else:  # tests: spans reach the exporter when they end
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("pdgate")
        self.propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind
        self._status = (Status, StatusCode)
        self._in_context = set_span_in_context

    @staticmethod
    def _ns(rec: Record, t: float) -> int:
        return int((rec.created_wall + (t - rec.created)) * 1e9)

    def request(self, rec: Record, headers: Any) -> Span:
        carrier = {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}
        parent = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(f"pdgate {rec.route}", context=parent, kind=self._kind.SERVER,
                                      start_time=self._ns(rec, rec.created))
        span.set_attributes({"pdgate.request_id": rec.id, "http.route": rec.route, "pdgate.stream": rec.stream,
                             "gen_ai.request.model": rec.model or ""})
        if rec.tenant:
            span.set_attribute("pdgate.tenant", rec.tenant)
        return span

    def attempt(self, parent: Span, rec: Record, att: Attempt, now: float) -> Span:
        span = self.tracer.start_span(f"attempt {att.n}", context=self._in_context(parent), kind=self._kind.INTERNAL,
                                      start_time=self._ns(rec, now))
        span.set_attributes({"pdgate.attempt": att.n, "pdgate.rid": att.rid, "pdgate.prefill": att.prefill,
                             "pdgate.decode": att.decode})
        return span

    def traceparent(self, span: Span) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self._in_context(span))
        return carrier

    def end_attempt(self, span: Span, rec: Record, att: Attempt, now: float) -> None:
        Status, StatusCode = self._status
        span.set_attributes({f"pdgate.{k}": v for k, v in att.drawn.items()})  # what its adapter drew (SGLang's room)
        sent = next((t for t, name, _ in att.events if name == "sent"), None)
        for t, name, info in att.events:
            span.add_event(name, {"info": str(info)} if info is not None else {}, timestamp=self._ns(rec, t))
        if sent is not None:  # the legs: from the send to each one's answer (or the attempt's end)
            ctx = self._in_context(span)
            for role, worker in (("prefill", att.prefill), ("decode", att.decode)):
                end = next((t for t, name, _ in att.events if name in LEG_END[role]), now)
                leg = self.tracer.start_span(f"{role} leg", context=ctx, kind=self._kind.CLIENT,
                                             start_time=self._ns(rec, sent))
                leg.set_attributes({"pdgate.worker": worker, "pdgate.role": role})
                leg.end(end_time=self._ns(rec, max(end, sent)))
        if att.error:
            span.set_status(Status(StatusCode.ERROR, att.error))
        span.end(end_time=self._ns(rec, now))

    def finish(self, span: Span, rec: Record) -> None:
        Status, StatusCode = self._status
        for t, phase in rec.history:
            span.add_event(f"phase {phase}", timestamp=self._ns(rec, t))
        span.set_attributes({"pdgate.outcome": rec.phase.value, "http.response.status_code": rec.status or 0,
                             "gen_ai.usage.output_tokens": rec.completion_tokens if rec.completion_tokens is not None
                             else rec.chunks})
        if rec.prompt_tokens is not None:
            span.set_attribute("gen_ai.usage.input_tokens", rec.prompt_tokens)
        if rec.reason:
            span.set_attribute("pdgate.reason", rec.reason)
        if rec.phase.value != "completed":
            span.set_status(Status(StatusCode.ERROR, rec.reason or rec.phase.value))
        span.end(end_time=self._ns(rec, rec.finished_at or rec.created))

    async def shutdown(self) -> None:
        """Flush and stop, waiting at most ``SHUTDOWN_S`` (in a daemon thread: a collector that is down never holds
        the process after that)."""
        import asyncio
        import threading

        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def run() -> None:
            try:
                self.provider.force_flush(timeout_millis=int(SHUTDOWN_S * 1000))
                self.provider.shutdown()
            except Exception:  # the SDK's own failure at exit: nothing to keep
                log.exception("OpenTelemetry shutdown failed")
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
                    loop.call_soon_threadsafe(settle)

        def settle() -> None:
            if not done.done():
                done.set_result(None)

        threading.Thread(target=run, name="otel-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done, SHUTDOWN_S + 0.5)
        except TimeoutError:
            log.warning("OpenTelemetry: spans still batched after %.1fs were dropped (the collector did not take them)",
                        SHUTDOWN_S)


def make(cfg: OtelConfig) -> Otel | None:
    return Otel(cfg) if cfg.enabled else None
