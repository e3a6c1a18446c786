"""docs/operations.md, docs/configuration.md and deploy/ against the code: the generated configuration and metric tables
are current, every configuration key has a meaning, every metric a served gateway exports is
documented, and every Grafana query names series that really exist (the gateway's /metrics,
the metric names vLLM 0.32 defines, a real mooncake_master's /metrics)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import vllm
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import load_config
from gateway.local.mooncake import MooncakeMaster
from scripts import docs_config
from tests.conftest import ServedGateway

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "operations.md"
CONFIG_DOC = ROOT / "docs" / "configuration.md"
GRAFANA = ROOT / "deploy" / "grafana" / "agentgw.json"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"

# labels Prometheus adds or histogram_quantile needs, on top of each metric's own
SCRAPE_LABELS = {"job", "instance", "le"}


def series_of(text: str) -> dict[str, set[str]]:
    """Series name -> label names, from Prometheus exposition text (families without a sample
    yet count too: a counter is exposed as ``<name>_total``, a histogram as ``_bucket`` /
    ``_sum`` / ``_count``)."""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        labels = {k for s in fam.samples for k in s.labels} - {"le"}
        for name in docs_config.sample_names(fam.name, fam.type):
            out.setdefault(name, set()).update(labels)
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


@pytest.fixture(scope="module")
def gateway_series() -> Iterator[dict[str, set[str]]]:
    """What a served gateway's /metrics exports (no engines needed for the names)."""
    with ServedGateway({}) as gw:
        text = httpx.get(gw.url + "/metrics", timeout=10).text
    series = series_of(text)
    # label names of families with no sample yet, from the registry the gateway serves
    for name, kind, labels, _ in docs_config.exported_metrics():
        for s in docs_config.sample_names(name, kind):
            series.setdefault(s, set()).update(labels)
    yield series


def vllm_series() -> set[str]:
    """Series names of every metric vLLM 0.32's Prometheus logger defines (read from its source)."""
    src = (Path(vllm.__file__).parent / "v1" / "metrics" / "loggers.py").read_text()
    out: set[str] = set()
    for kind, name in re.findall(r"_(counter|gauge|histogram)_cls\(\s*name=\"(vllm:[a-z0-9_:]+)\"", src):
        out.update(docs_config.sample_names(name, kind))
    assert "vllm:prompt_tokens_total" in out and "vllm:kv_cache_usage_perc" in out  # the parse worked
    return out


def panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(GRAFANA.read_text())["panels"] if p["type"] != "row"]


def exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels() for t in p["targets"]]


# -- the generated reference sections --------------------------------------------------------------
def test_the_generated_reference_sections_are_current() -> None:
    for doc in (DOC, CONFIG_DOC):
        text = doc.read_text()
        assert docs_config.render(text) == text, f"{doc.name}: run python -m scripts.docs_config"
    assert docs_config.main(["--check"]) == 0


def test_docs_config_check_fails_on_a_diverged_doc(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(CONFIG_DOC.read_text().replace("`listen.port`", "`listen.prt`"))
    assert docs_config.main(["--check", "--doc", str(stale)]) == 1
    assert docs_config.main(["--doc", str(stale)]) == 0  # rewrites it
    assert docs_config.main(["--check", "--doc", str(stale)]) == 0
    assert stale.read_text() == CONFIG_DOC.read_text()


def test_every_config_key_has_a_meaning_and_no_note_is_stale() -> None:
    keys = docs_config.config_keys()
    assert [k for k, meaning in keys if not meaning] == []
    assert set(docs_config.NOTES) - {k for k, _ in keys} == set()
    text = CONFIG_DOC.read_text()
    assert [k for k, _ in keys if f"| `{k}` |" not in text] == []


def test_the_configuration_docs_example_loads(tmp_path: Path) -> None:
    """The YAML example in docs/configuration.md, as written, is a valid configuration."""
    blocks = re.findall(r"```yaml\n(.*?)```", CONFIG_DOC.read_text(), flags=re.S)
    assert blocks
    for block in blocks:
        path = tmp_path / "agentgw.yaml"
        path.write_text(block)
        config = load_config(str(path))
        assert [p.name for p in config.pools] == ["first_turn", "warm"]
        assert config.models[0].block_size == 128  # the engines' blocks


def test_every_exported_metric_is_documented(gateway_series: dict[str, set[str]]) -> None:
    text = DOC.read_text()
    agentgw = {s for s in gateway_series if s.startswith("agentgw_") and not s.endswith("_created")}
    assert agentgw, "the gateway exported no agentgw_ series"
    assert sorted(s for s in agentgw if f"`{s}`" not in text) == []
    families = {name for name, *_ in docs_config.exported_metrics()}
    documented = set(re.findall(r"`(agentgw_[a-z0-9_]+)`", text))
    assert sorted(documented - agentgw - families) == []  # nothing documented that is not exported


# -- Grafana and Prometheus --------------------------------------------------------------------------
_NAME = re.compile(r"\b(agentgw_[a-z0-9_]+|vllm:[a-z0-9_:]+|master_[a-z0-9_]+)")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"(agentgw_[a-z0-9_]+)\{([^}]*)\}")


def test_grafana_queries_name_exported_series(gateway_series: dict[str, set[str]]) -> None:
    vllm_names = vllm_series()
    bad = []
    for title, expr in exprs():
        for name in _NAME.findall(expr):
            known = (
                name in gateway_series
                if name.startswith("agentgw_")
                else name in vllm_names
                if name.startswith("vllm:")
                else True  # master_*: checked against a real mooncake_master below
            )
            if not known:
                bad.append(f"{title}: {name}")
    assert bad == []
    assert {n for _, e in exprs() for n in _NAME.findall(e) if n.startswith("agentgw_")}, "no gateway panel"


def test_grafana_gateway_queries_use_labels_the_metrics_have(gateway_series: dict[str, set[str]]) -> None:
    bad = []
    for title, expr in exprs():
        names = [n for n in _NAME.findall(expr) if n.startswith("agentgw_")]
        if not names:
            continue
        allowed = set.union(*(gateway_series.get(n, set()) for n in names)) | SCRAPE_LABELS
        for group in _BY.findall(expr):
            bad += [
                f"{title}: by {lab}" for lab in (x.strip() for x in group.split(",")) if lab not in allowed
            ]
        for name, sel in _SELECTOR.findall(expr):
            for lab in re.findall(r"([a-z_]+)\s*=~?", sel):
                if lab not in gateway_series.get(name, set()) | SCRAPE_LABELS:
                    bad.append(f"{title}: {name}{{{lab}}}")
    assert bad == []


@pytest.mark.store
def test_grafana_store_queries_name_series_a_real_mooncake_master_exports(mooncake: MooncakeMaster) -> None:
    text = httpx.get(f"http://127.0.0.1:{mooncake.metrics_port}/metrics", timeout=10).text
    exported = series_of(text)
    used = {n for _, e in exprs() for n in _NAME.findall(e) if n.startswith("master_")}
    assert used, "no Mooncake panel"
    assert sorted(used - set(exported)) == []


def test_grafana_dashboard_is_well_formed() -> None:
    d = json.loads(GRAFANA.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in d["templating"]["list"]}
    for p in panels():
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert set(re.findall(r"\$([a-z_]+)", t["expr"])) <= variables | {"__rate_interval"}, t["expr"]


def test_prometheus_example_scrapes_the_jobs_the_dashboard_selects() -> None:
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    d = json.loads(GRAFANA.read_text())
    defaults = {v["name"]: v["query"] for v in d["templating"]["list"] if v["type"] == "custom"}
    assert set(defaults.values()) <= set(jobs)
    assert all(j["metrics_path"] == "/metrics" and j["static_configs"][0]["targets"] for j in jobs.values())
