"""OpenTelemetry traces of requests: a span per request in the server and in the gateway, joined by W3C trace context.

Off unless an OTLP endpoint is given (`inferd serve --otlp-traces-endpoint URL`, vLLM's flag; the gateway's
`tracing.otlp_endpoint`). Spans go out over OTLP/HTTP (protobuf) from the SDK's batch processor, on its own thread:
a request never waits for the collector, and a collector that is down loses spans, not requests.

- **The server** (`RequestTracer`): one span per engine request, vLLM's `llm_request` with its `gen_ai.*` attributes
  (so what reads vLLM's traces reads inferd's), from the request's arrival to its end, parented on the `traceparent`
  header it came with. Its children say where the time went, from the engine's own timestamps: `queue` (arrival to
  first scheduled), `prefill` (to the first token: chunks, cached and loaded prompt tokens, preemptions) and `decode`
  (to the last token: steps). The spans are made when the request ends, with their real start and end times,
  from the step thread's hook: nothing is added to the step for a request in flight.
- **The gateway** (`inferd.gateway`): a `gateway_request` span per request, parented on the client's `traceparent`,
  with one child per upstream attempt (a retry, or a resumed stream, is another child); the attempt's context goes
  to the replica in `traceparent`, so the replica's `llm_request` hangs under the attempt that carried it. A gateway
  without tracing passes the client's `traceparent` on unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

    from inferd.outputs import RequestOutput

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context


def make_tracer(service_name: str, endpoint: str, headers: Mapping[str, str] | None = None) -> tuple[Tracer, Any]:
    """A tracer exporting to the OTLP/HTTP `endpoint` (a collector's `/v1/traces` URL, or its base URL), and
    its provider (to shut down: flushes what is queued)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url, headers=dict(headers or {}))))
    return provider.get_tracer("inferd"), provider


def extract(headers: Mapping[str, str]) -> Context:
    """The trace context a request came with (W3C `traceparent`/`tracestate`); an empty one without."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({k: headers[k] for k in TRACE_HEADERS if k in headers})


def inject(span: Span) -> dict[str, str]:
    """The `traceparent` (and `tracestate`) headers that make `span` the parent of the receiver's spans."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def wall_ns(monotonic_s: float, now_monotonic: float, now_ns: int) -> int:
    """A `time.monotonic()` reading as Unix nanoseconds, by its distance from a pair of readings taken together."""
    return now_ns - int((now_monotonic - monotonic_s) * 1e9)


@dataclass
class _Pending:
    parent: Context
    attributes: dict[str, Any]


class RequestTracer:
    """The server's spans: `started` when a request is submitted (its parent context and request attributes),
    `finished`/`aborted` from the step thread's hook."""

    def __init__(self, tracer: Tracer, provider: Any, model_name: str):
        self.tracer = tracer
        self.provider = provider
        self.model_name = model_name
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()  # the event loop adds, the step thread takes

    def started(self, request_id: str, headers: Mapping[str, str], attributes: dict[str, Any]) -> None:
        pending = _Pending(extract(headers), {"gen_ai.request.id": request_id, **attributes})
        with self._lock:
            self._pending[request_id] = pending

    def forget(self, request_ids: list[str]) -> None:
        """Requests that were refused before the engine took them: no span."""
        with self._lock:
            for rid in request_ids:
                self._pending.pop(rid, None)

    def finished(self, out: RequestOutput) -> None:
        with self._lock:
            pending = self._pending.pop(out.request_id, None)
        if pending is None or out.metrics is None:
            return
        try:
            self._spans(pending, out)
        except Exception:  # a hook never raises: a span lost is better than a step lost
            logger.exception("could not record the trace of %s", out.request_id)

    def aborted(self, request_id: str) -> None:
        """A request that ended before it finished (a client gone, an abort): a span with an error status, from
        its submission's context, ending now (the engine kept no timestamps for it)."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        span = self.tracer.start_span("llm_request", pending.parent, SpanKind.SERVER, pending.attributes)
        span.set_status(Status(StatusCode.ERROR, "aborted"))
        span.end()

    def _spans(self, pending: _Pending, out: RequestOutput) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        m, t = out.metrics, out.metrics.times
        now_m, now_ns = time.monotonic(), time.time_ns()
        ns = lambda s: wall_ns(s, now_m, now_ns)  # noqa: E731
        end = t.finished if t.finished is not None else now_m
        secs = lambda a, b: None if a is None or b is None else b - a  # noqa: E731
        attributes = {
            **pending.attributes,
            "gen_ai.response.model": self.model_name,
            "gen_ai.usage.prompt_tokens": m.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": m.num_generation_tokens,
            "gen_ai.usage.num_sequences": len(out.outputs),
            "gen_ai.response.finish_reasons": [c.finish_reason or "abort" for c in out.outputs],
            "gen_ai.latency.time_in_queue": secs(t.arrival, t.first_scheduled),
            "gen_ai.latency.time_to_first_token": secs(t.arrival, t.first_token),
            "gen_ai.latency.e2e": secs(t.arrival, end),
            "gen_ai.latency.time_in_model_prefill": secs(t.first_scheduled, t.first_token),
            "gen_ai.latency.time_in_model_decode": secs(t.first_token, t.last_token),
            "inferd.prefill_chunks": m.num_prefill_chunks,
            "inferd.decode_steps": m.num_decode_steps,
            "inferd.preemptions": m.num_preemptions,
            "inferd.cached_prompt_tokens": m.num_cached_tokens,
            "inferd.kv_loaded_tokens": m.num_loaded_tokens,
            "inferd.kv_load_seconds": m.kv_load_seconds,
        }
        attributes = {k: v for k, v in attributes.items() if v is not None}
        start = ns(t.arrival)
        root = self.tracer.start_span("llm_request", pending.parent, SpanKind.SERVER, attributes, start_time=start)
        inside = trace.set_span_in_context(root)
        phases: list[tuple[str, float | None, float | None, dict[str, Any]]] = [
            ("queue", t.arrival, t.first_scheduled, {}),
            ("prefill", t.first_scheduled, t.first_token, {
                "inferd.prefill_chunks": m.num_prefill_chunks, "inferd.cached_prompt_tokens": m.num_cached_tokens,
                "inferd.kv_loaded_tokens": m.num_loaded_tokens, "inferd.preemptions": m.num_preemptions,
            }),
            ("decode", t.first_token, t.last_token, {"inferd.decode_steps": m.num_decode_steps}),
        ]  # fmt: skip
        for name, a, b, attrs in phases:
            if a is not None and b is not None:
                child = self.tracer.start_span(name, inside, SpanKind.INTERNAL, attrs, start_time=ns(a))
                child.end(end_time=ns(b))
        root.end(end_time=ns(end))

    def shutdown(self) -> None:
        self.provider.shutdown()


@dataclass
class TraceStart:
    """What a request's spans start from: the tracer, the request's headers (its trace context) and attributes
    (handed to `inferd.server.streams.submit`, which starts them before the engine can finish the request)."""

    tracer: RequestTracer
    headers: Mapping[str, str]
    attributes: dict[str, Any]

    def start(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.tracer.started(rid, self.headers, self.attributes)

    def forget(self, request_ids: list[str]) -> None:
        self.tracer.forget(request_ids)


def wrap_hook(
    hook: Callable[[Any, list[RequestOutput]], None] | None, tracer: RequestTracer
) -> Callable[[Any, list[RequestOutput]], None]:
    """An `on_step` hook that also ends the finished requests' traces."""

    def on_step(stats, outputs: list[RequestOutput]) -> None:
        if hook is not None:
            hook(stats, outputs)
        for out in outputs:
            if out.finished:
                tracer.finished(out)

    return on_step


def wrap_abort(hook: Callable[[str], None] | None, tracer: RequestTracer) -> Callable[[str], None]:
    """An `on_abort` hook that also ends the aborted request's trace."""

    def on_abort(request_id: str) -> None:
        if hook is not None:
            hook(request_id)
        tracer.aborted(request_id)

    return on_abort
