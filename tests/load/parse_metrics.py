#!/usr/bin/env python3
"""Parses a running node's /metrics in both formats with the Prometheus Python client.

    parse_metrics.py http://127.0.0.1:28100/metrics

Asks once for Prometheus' classic text format (what a scraper without OpenMetrics sends) and
once for OpenMetrics, checks each answer's Content-Type, parses each with prometheus_client's
own parser for it (the OpenMetrics one is strict: it refuses a page without `# EOF`, with a
counter lacking `_total`, …) and checks that the families a dashboard charts are there with
their types. Exits non-zero, saying why, on any mismatch.
"""
import sys
import urllib.request

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_classic

WANT = {
    "kvmesh_requests": "counter",
    "kvmesh_replica_requests": "counter",
    "kvmesh_decision_latency_seconds": "histogram",
    "kvmesh_replica_ttft_seconds": "histogram",
    "kvmesh_replica_e2e_seconds": "histogram",
    "kvmesh_replica_status": "gauge",
    "kvmesh_replica_queued_prefill_tokens": "gauge",
    "kvmesh_event_lag_seconds": "histogram",
}


def fetch(url, accept):
    req = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.headers.get("Content-Type", ""), r.read().decode()


def check(name, families, content_type, want_type):
    if not content_type.startswith(want_type):
        sys.exit(f"{name}: Content-Type {content_type!r}, expected {want_type}")
    kinds = {f.name: f.type for f in families}
    for family, kind in WANT.items():
        if kinds.get(family) != kind:
            sys.exit(f"{name}: {family} is {kinds.get(family)!r}, expected {kind}")
    print(f"{name}: {len(kinds)} families parsed, {len(WANT)} checked")


def main():
    url = sys.argv[1]
    ct, text = fetch(url, "text/plain;version=0.0.4;q=1,*/*;q=0.1")
    check("classic text 0.0.4", list(parse_classic(text)), ct, "text/plain")
    ct, text = fetch(url, "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5")
    check("OpenMetrics 1.0.0", list(parse_openmetrics(text)), ct, "application/openmetrics-text")


if __name__ == "__main__":
    main()
