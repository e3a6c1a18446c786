"""The larger schemathesis run against `openapi/agentgw.yaml` (CI runs a bounded one:
tests/gateway/test_schemathesis.py).

Starts two stand-in engines (`testing.fake_engine`) and a gateway (`python -m gateway serve`)
on loopback, then `schemathesis run` with a fixed seed: every operation, ``--max-examples`` per
operation, the examples, coverage, fuzzing and stateful phases, and every check by default
(``--checks``). Prints schemathesis' report and exits with its status (0: no failure).

    python -m benchmarks.fuzz --max-examples 200 --seed 1
    python -m benchmarks.fuzz --checks not_a_server_error,response_schema_conformance

The contract documents 501 for the two Responses routes vLLM 0.32 does not serve, so a
`schemathesis.toml` written for the run tells ``not_a_server_error`` to expect it on those two
operations only (the CI test does the same).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from benchmarks._common import ManagedProcess, free_port, wait_http_ok

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "openapi" / "agentgw.yaml"
MODEL = "bench-model"
# the two operations the contract answers with a documented 501 (not served by vLLM 0.32)
SCHEMATHESIS_TOML = """
[[operations]]
include-path = "/v1/responses/{response_id}"
include-method = "DELETE"
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "501"]

[[operations]]
include-path = "/v1/responses/{response_id}/input_items"
include-method = "GET"
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "501"]
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-examples", type=int, default=100, help="examples per operation and phase")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--checks", default="all", help="schemathesis checks (comma-separated, or all)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--max-time", type=float, default=None, help="time budget for the whole run (s)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="agentgw-fuzz-") as tmp:
        work = Path(tmp)
        procs: list[ManagedProcess] = []
        try:
            urls = []
            for name in ("a", "b"):
                port = free_port()
                p = ManagedProcess(
                    f"engine-{name}",
                    [sys.executable, "-m", "testing.fake_engine", "--port", str(port), "--model", MODEL],
                    work,
                )
                procs.append(p)
                urls.append(f"http://127.0.0.1:{port}")
                wait_http_ok(urls[-1] + "/health", 15, p.proc)
            gw_port = free_port()
            config = {
                "listen": {"host": "127.0.0.1", "port": gw_port},
                "pools": [
                    {
                        "name": "p",
                        "role": "any",
                        "engines": [
                            {"name": n, "url": u, "model": MODEL} for n, u in zip("ab", urls, strict=True)
                        ],
                    }
                ],
            }
            (work / "gateway.yaml").write_text(yaml.safe_dump(config))
            gw = ManagedProcess(
                "gateway",
                [sys.executable, "-m", "gateway", "serve", "--config", str(work / "gateway.yaml")],
                work,
            )
            procs.append(gw)
            url = f"http://127.0.0.1:{gw_port}"
            wait_http_ok(url + "/ready", 60, gw.proc)
            (work / "schemathesis.toml").write_text(SCHEMATHESIS_TOML)
            cmd = [
                str(Path(sys.executable).parent / "schemathesis"),
                "--config-file",
                str(work / "schemathesis.toml"),
                "run",
                str(SPEC),
                "--url",
                url,
                "--max-examples",
                str(args.max_examples),
                "--seed",
                str(args.seed),
                "--checks",
                args.checks,
                "--workers",
                str(args.workers),
                "--request-timeout",
                "30",
                "--continue-on-failure",
            ]
            if args.max_time is not None:
                cmd += ["--max-time", str(args.max_time)]
            print("$", " ".join(cmd), flush=True)
            return subprocess.call(cmd, cwd=work)  # its crash cache stays out of the tree
        finally:
            for p in reversed(procs):
                p.stop()


if __name__ == "__main__":
    sys.exit(main())
