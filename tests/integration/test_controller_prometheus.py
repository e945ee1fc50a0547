"""The operator's observe step against a REAL Prometheus (Debian ``prometheus``) on 127.0.0.1.

Prometheus scrapes a prometheus-client exporter that publishes the router's own metrics
(``fulcrum.router.metrics.RouterMetrics``, the names the router exports) every 0.5 s; the test admits requests
through those metrics and checks what :class:`fulcrum.controller.observe.PrometheusObserver` reads back.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("prometheus_api_client")

from prometheus_api_client import PrometheusConnect  # noqa: E402
from prometheus_client import start_http_server  # noqa: E402

from fulcrum.cluster import ObservationError  # noqa: E402
from fulcrum.controller.observe import Q_ARRIVALS, PrometheusObserver, Selectors  # noqa: E402
from fulcrum.observation import ReadyCounts  # noqa: E402
from fulcrum.router.metrics import RouterMetrics  # noqa: E402

from .servers import _http_ok, find_binary, free_port  # noqa: E402

SCRAPE_S = 0.5
SCRAPE = "500ms"


@pytest.fixture
def exporter() -> Iterator[tuple[RouterMetrics, int]]:
    metrics = RouterMetrics()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    yield metrics, port
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture
def prometheus(exporter: tuple[RouterMetrics, int]) -> Iterator[str]:
    binary = find_binary("prometheus", "FULCRUM_PROMETHEUS_BIN")
    if binary is None:
        pytest.skip("prometheus is not installed (apt-get install -y prometheus)")
    _, target_port = exporter
    work = Path(tempfile.mkdtemp(prefix="fulcrum-prom-"))
    (work / "prometheus.yml").write_text(f"""
global: {{scrape_interval: {SCRAPE}, evaluation_interval: 1s}}
scrape_configs:
  - job_name: llama-router
    scrape_interval: {SCRAPE}
    static_configs:
      - targets: ["127.0.0.1:{target_port}"]
        labels: {{namespace: prod}}
""")
    port = free_port()
    log = open(work / "prometheus.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _http_ok(f"{url}/-/ready"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("prometheus did not start:\n" + (work / "prometheus.log").read_text()[-2000:])
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def _wait_for(client: PrometheusConnect, query: str, pred, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        res = client.custom_query(query)
        if res and pred(float(res[0]["value"][1])):
            return
        time.sleep(0.2)
    pytest.fail(f"Prometheus never answered {query} as expected")


def test_the_observer_reads_admitted_load_and_latency_from_a_real_prometheus(
        exporter: tuple[RouterMetrics, int], prometheus: str) -> None:
    metrics, _ = exporter
    admitted = metrics.admitted.labels("completions")
    admitted.inc(0)
    client = PrometheusConnect(url=prometheus, disable_ssl=True)
    _wait_for(client, 'count(fulcrum_router_requests_admitted_total{job="llama-router"})', lambda v: v >= 1)
    time.sleep(2 * SCRAPE_S)  # a zero sample before the load, so increase() sees all of it
    for i in range(40):
        admitted.inc()
        metrics.input_tokens.observe(900 if i % 2 else 1100)
        metrics.predicted_output_tokens.observe(150)
    for _ in range(30):
        metrics.output_tokens.observe(100)
        metrics.ttft.observe(0.3)
        metrics.tpot.observe(0.02)
        metrics.e2e.observe(2.0)
    for _ in range(10):
        metrics.ttft.observe(4.0)  # misses a 2 s TTFT SLO
        metrics.tpot.observe(0.02)
        metrics.e2e.observe(5.0)
    _wait_for(client, 'sum(fulcrum_router_requests_admitted_total{job="llama-router"})', lambda v: v >= 40)
    time.sleep(2 * SCRAPE_S)
    sel = Selectors.for_llmserve("llama", "prod")
    obs = PrometheusObserver(client, sel, ttft_slo_s=2.0, tpot_slo_s=0.05, percentile=90).observe(
        100.0, 30.0, ReadyCounts(2, 1, 0))
    print(f"observed: arrivals={obs.arrivals} mean_isl={obs.mean_isl:.1f} mean_osl={obs.mean_osl:.1f} "
          f"ttft_att={obs.ttft_attainment:.3f} tpot_att={obs.tpot_attainment:.3f} ttft_p90={obs.ttft_p_s:.2f}s "
          f"isl_p50={obs.isl_quantiles[2]:.0f}")
    # increase() extrapolates to the window's edges, so counts are close to, not exactly, what was admitted
    assert 35 <= obs.arrivals <= 60
    assert obs.mean_isl == pytest.approx(1000.0, rel=0.01)
    assert obs.mean_osl == pytest.approx(100.0, rel=0.01)
    assert obs.ttft_attainment == pytest.approx(0.75, abs=0.02)
    assert obs.tpot_attainment == pytest.approx(1.0)
    assert obs.slo_attainment == pytest.approx(0.75, abs=0.02)
    assert 2.5 <= obs.ttft_p_s <= 5.0
    assert 512 <= obs.isl_quantiles[2] <= 2048
    assert obs.ready == ReadyCounts(2, 1, 0)
    assert obs.prefill_queue == 0 and math.isfinite(obs.kv_utilisation)

    other = Selectors.for_llmserve("nobody", "prod")
    with pytest.raises(ObservationError, match="no router series"):
        PrometheusObserver(client, other, ttft_slo_s=2.0, tpot_slo_s=0.05, percentile=90).observe(
            100.0, 30.0, ReadyCounts())


def test_history_reads_past_intervals_that_match_instant_queries_at_the_same_times(
        exporter: tuple[RouterMetrics, int], prometheus: str) -> None:
    """The warm start's range queries (``PrometheusObserver.history``) against a real Prometheus: one
    Observation per 2 s interval, the load admitted over them, and each interval's arrivals equal to the
    instant query evaluated at that interval's end.

    The load is steady (one request every 50 ms for 6 s), not bursts: ``increase(x[2s])`` evaluated every 2 s
    only sees differences between samples inside each window, so a burst that lands between a window's last
    scrape and the next window's first is in neither (Prometheus' semantics, not the observer's)."""
    metrics, _ = exporter
    admitted = metrics.admitted.labels("completions")
    admitted.inc(0)
    client = PrometheusConnect(url=prometheus, disable_ssl=True)
    _wait_for(client, 'count(fulcrum_router_requests_admitted_total{job="llama-router"})', lambda v: v >= 1)
    time.sleep(2 * SCRAPE_S)
    for _ in range(120):
        admitted.inc()
        metrics.input_tokens.observe(500)
        metrics.predicted_output_tokens.observe(100)
        time.sleep(0.05)
    _wait_for(client, 'sum(fulcrum_router_requests_admitted_total{job="llama-router"})', lambda v: v >= 120)
    time.sleep(2 * SCRAPE_S)
    sel = Selectors.for_llmserve("llama", "prod")
    observer = PrometheusObserver(client, sel, ttft_slo_s=2.0, tpot_slo_s=0.05, percentile=90)
    end = float(int(time.time()))
    hist = observer.history(end, 2.0, 12, ReadyCounts(1, 1, 0))
    print("history:", [(round(o.time_s - end, 1), o.arrivals, round(o.mean_isl)) for o in hist])
    assert 4 <= len(hist) <= 12 and [o.time_s for o in hist] == sorted(o.time_s for o in hist)
    assert all(b.time_s - a.time_s == pytest.approx(2.0) for a, b in zip(hist, hist[1:]))
    assert hist[-1].time_s == pytest.approx(end)
    # about 40 requests per 2 s window while the load ran; increase() extrapolates to the window's edges
    assert sum(1 for o in hist if o.arrivals >= 10) >= 2
    assert 60 <= sum(o.arrivals for o in hist) <= 180
    assert all(o.mean_isl == pytest.approx(500.0, rel=0.01) for o in hist if o.arrivals > 0)
    assert all(o.mean_osl == pytest.approx(100.0, rel=0.01) for o in hist if o.arrivals > 0)
    arrivals_q = Q_ARRIVALS.format(router=sel.router, prefill_pods=sel.prefill_pods, decode_pods=sel.decode_pods,
                                   window="2s")
    for o in hist:  # a range query evaluates exactly what an instant query at that time does
        at = client.custom_query(arrivals_q, params={"time": o.time_s})
        assert o.arrivals == int(round(float(at[0]["value"][1])))


def test_a_stopped_prometheus_is_an_observation_error() -> None:
    from urllib3.util.retry import Retry

    client = PrometheusConnect(url=f"http://127.0.0.1:{free_port()}", disable_ssl=True, retry=Retry(total=0))
    with pytest.raises(ObservationError, match="Prometheus query failed"):
        PrometheusObserver(client, Selectors.for_llmserve("llama", "prod"), ttft_slo_s=2.0, tpot_slo_s=0.05,
                           percentile=90).observe(100.0, 30.0, ReadyCounts())
