"""Prometheus metrics served by the supervisor: computed at scrape time from the workers'
stats slots, the capture arena, the rings and the supervisor's own view of its workers
(``collector``); totals carried across worker restarts (``carry``); the HTTP endpoint with
``/metrics`` and ``/healthz`` (``server``). docs/metrics.md lists every metric."""
