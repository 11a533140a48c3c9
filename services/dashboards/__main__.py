"""python -m services.dashboards: put the Ray Core, Ray Data, Ray Train and Ray Serve dashboards into Grafana,
and "maze-grpo training" (the trainer's step metrics, which it exports as Ray metrics).

    make dashboards                      # GRAFANA_URL, GRAFANA_TOKEN, PROMETHEUS_URL from the environment
    python -m services.dashboards --grafana-url URL --token TOKEN --prometheus-url URL
    python -m services.dashboards --amp-workspace-url URL --region us-west-2   # Amazon Managed Prometheus (SigV4)
    python -m services.dashboards --out DIR     # write the five dashboard JSON files instead
    python -m services.dashboards monitor       # a local Prometheus on loopback scraping Ray (make monitor)

Idempotent: a second run updates the folder, data source and dashboards in place.
"""

from __future__ import annotations

import logging
import sys
import time

from shared.config import command_line, config_from_args, reveal, subcommand

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    command, argv = subcommand(argv, ("provision", "monitor"), "provision")
    args = dashboards_parser(command).parse_args(argv)
    cfg = config_from_args(args)
    if command == "monitor":
        from services.dashboards.monitor import start_prometheus

        url = start_prometheus(cfg.shared_path() / "prometheus", args.port)
        log.info(f"Prometheus on {url}, scraping Ray's service-discovery file; dashboards: make dashboards PROMETHEUS_URL={url}")
        return
    if args.out:
        from services.dashboards.provision import write_files

        try:
            paths = write_files(args.out)
        except OSError as exc:
            sys.exit(f"error: cannot write the dashboards to --out {args.out}: {exc.strerror}; pick a folder you can write to")
        for path in paths:
            log.info(f"wrote {path}")
        return
    provision_grafana(cfg, args)


def dashboards_parser(command: str):
    """Returns the parser of `python -m services.dashboards [monitor]`."""
    parser = command_line("python -m services.dashboards" + ("" if command == "provision" else f" {command}"), __doc__,
                          config=False)
    parser.add_argument("--config", default=None, help="run profile (default: configs/tiny-cpu.yaml): its dashboards section")
    parser.add_argument("--grafana-url", default=None, help="Grafana base URL (default: dashboards.grafana_url, GRAFANA_URL)")
    parser.add_argument("--token", default=None, help="service-account token (default: dashboards.grafana_token, GRAFANA_TOKEN)")
    parser.add_argument("--prometheus-url", default=None,
                        help="the data source URL (default: dashboards.prometheus_url, PROMETHEUS_URL, else http://127.0.0.1:9090)")
    parser.add_argument("--amp-workspace-url", default=None, help="Amazon Managed Service for Prometheus query URL (SigV4)")
    parser.add_argument("--region", default=None, help="AWS region for SigV4 (default: cluster.region, AWS_REGION)")
    parser.add_argument("--sigv4-auth", default="ec2_iam_role", choices=["ec2_iam_role", "default", "credentials"],
                        help="how Grafana signs its requests to --amp-workspace-url: ec2_iam_role (Amazon Managed "
                             "Grafana's workspace IAM role; the default), default (the AWS SDK chain of a Grafana you "
                             "run yourself) or credentials (its credentials file)")
    parser.add_argument("--out", default=None, help="write the dashboard JSON files here instead of provisioning")
    parser.add_argument("--wait", type=float, default=0, help="seconds to wait for Grafana to come up")
    parser.add_argument("--port", type=int, default=9090, help="monitor: Prometheus port on 127.0.0.1")
    return parser


def provision_grafana(cfg, args) -> None:
    """Provisions the folder, the Prometheus (or AMP) data source and the dashboards into Grafana (in place)."""
    from services.dashboards.provision import ProvisionError, provision

    grafana_url = args.grafana_url or cfg.dashboards.grafana_url
    token = args.token or reveal(cfg.dashboards.grafana_token)
    prometheus_url = args.prometheus_url or cfg.dashboards.prometheus_url
    region = args.region or cfg.cluster.region
    if not grafana_url:
        sys.exit("no Grafana URL: pass --grafana-url or set GRAFANA_URL (or use --out DIR to write JSON files)")
    if args.amp_workspace_url and not region:
        sys.exit("--amp-workspace-url needs --region (or AWS_REGION) for SigV4")

    api = reachable_grafana(grafana_url, token, args.wait)
    try:
        done = provision(api, args.amp_workspace_url or prometheus_url,
                         sigv4_region=region if args.amp_workspace_url else None, sigv4_auth_type=args.sigv4_auth)
    except ProvisionError as exc:
        sys.exit(f"error: {exc}")
    except Exception as exc:
        sys.exit(f"error: provisioning Grafana at {grafana_url} failed ({type(exc).__name__}: {exc})")
    log.info(f"done: folder {done['folder']}, data source {done['datasource']}, {len(done) - 2} dashboards provisioned")


def reachable_grafana(grafana_url: str, token: str | None, wait_s: float):
    """Returns a Grafana API client once its health check answers (waiting up to wait_s); exits with one line if not."""
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(grafana_url, credential=token, timeout=10.0)
    deadline = time.time() + wait_s
    while True:
        try:
            api.health.check()
            return api
        except Exception as exc:
            if time.time() >= deadline:
                sys.exit(f"Grafana at {grafana_url} is not reachable ({type(exc).__name__}: {exc}); "
                         "check GRAFANA_URL and that Grafana is running")
            time.sleep(2)


if __name__ == "__main__":
    main()
