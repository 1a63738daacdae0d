"""A test OTLP/HTTP collector: decodes what it receives with the official
protobuf definitions (PyPI's opentelemetry-proto) and prints each request
as one JSON line on stdout, after a first line with its port.

    python collector.py            # 200 to every export
"""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

SIGNALS = {
    "/v1/traces": ("traces", ExportTraceServiceRequest, ExportTraceServiceResponse),
    "/v1/metrics": ("metrics", ExportMetricsServiceRequest, ExportMetricsServiceResponse),
}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        found = SIGNALS.get(self.path)
        if found is None or self.headers.get("content-type") != "application/x-protobuf":
            self.answer(404, b"")
            return
        name, request, response = found
        msg = request()
        msg.ParseFromString(body)  # raises on a malformed message: the test sees no line
        line = {
            "signal": name,
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": MessageToDict(msg),
        }
        print(json.dumps(line), flush=True)
        self.answer(200, response().SerializeToString())

    def answer(self, status, payload):
        self.send_response(status)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
try:
    server.serve_forever()
except KeyboardInterrupt:
    sys.exit(0)
