"""The Grafana dashboard (grafana/ffstate-dashboard.json) against a real Prometheus server (Debian's `prometheus`):
Prometheus scrapes the two daemons of a torchrun job (2 ranks as 2 nodes, a rank killed and restored, the persistent
tier on) while it trains, and every query of every panel returns data."""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

from ffstate.bench._report import free_ports

pytestmark = pytest.mark.timeout(300)
DASHBOARD = Path(__file__).resolve().parents[2] / "grafana" / "ffstate-dashboard.json"
PROMETHEUS = shutil.which("prometheus")


def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, the job variable set to every job."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"].replace("$job", ".*")) for p in dash["panels"] for t in p["targets"]]


def test_the_dashboard_is_valid_json_with_a_query_in_every_panel():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "ffstate" and dash["panels"]
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in dash["panels"])
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "job"}


@pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus is not installed (make test installs it where it "
                                               "runs as root with apt-get)")
def test_every_panel_s_query_returns_data_from_a_real_prometheus_scraping_a_job(tmp_path):
    base = free_ports(5)  # one range, its parts apart: the daemons' 2 ports, their metrics' 2, Prometheus's
    metrics, web = base + 2, base + 4
    (tmp_path / "prometheus.yml").write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 900ms
scrape_configs:
  - job_name: ffstate
    honor_labels: true
    static_configs:
      - targets: ['127.0.0.1:{metrics}', '127.0.0.1:{metrics + 1}']
""")
    prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
                                  stdout=open(tmp_path / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    out = tmp_path / "job"
    out.mkdir()
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_SIMULATED_NODES": "2",
           "FFSTATE_JOB_ID": f"dash{uuid.uuid4().hex[:6]}", "FFSTATE_TOKEN": uuid.uuid4().hex,
           "FFSTATE_BASE_PORT": str(base), "FFSTATE_METRICS_PORT": str(metrics),
           "FFSTATE_PERSIST_DIR": str(tmp_path / "persist"), "FFSTATE_PERSIST_EVERY": "3", "OMP_NUM_THREADS": "1",
           "TMPDIR": str(out)}
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "--max-restarts", "1", "-m", "ffstate.bench._downtime_worker", str(out), "400", "--mode",
                            "torchrun", "--kill", "1:6", "--step-seconds", "0.1"],
                           env=env, stdout=open(out / "job.log", "w"), stderr=subprocess.STDOUT)
    missing = queries()
    try:
        deadline = time.monotonic() + 200
        while missing and time.monotonic() < deadline:
            assert job.poll() is None, (out / "job.log").read_text()[-3000:]
            time.sleep(2)
            missing = [(title, q) for title, q in missing if not result(web, q)]
    finally:
        job.terminate()  # torchrun's agent stops its workers (each in a session of its own) before it exits
        try:
            job.wait(60)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait(30)
        prometheus.terminate()
        prometheus.wait(30)
        for pid_file in out.glob("ffstate-*/daemon-*.pid"):
            try:
                os.kill(int(pid_file.read_text()), 9)
            except (OSError, ValueError):
                pass
    assert not missing, f"panels whose queries returned nothing: {missing}"


def result(port: int, query: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        got = json.loads(urllib.request.urlopen(url, timeout=5).read())
    except OSError:  # not up yet
        return []
    assert got["status"] == "success", (query, got)
    return got["data"]["result"]
