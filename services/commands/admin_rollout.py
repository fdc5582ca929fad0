"""`slora admin policy` and `slora admin status`: canary policies and rollout visibility."""

from __future__ import annotations

import argparse
from typing import Any

from services.commands.admin_calls import adapter_text, call_command, table


def add_rollout_commands(cmds: argparse._SubParsersAction) -> None:
    p = cmds.add_parser("policy", help="set or clear an adapter's canary policy")
    p.add_argument("adapter_id")
    p.add_argument("--window", type=float, help="analysis window in seconds")
    p.add_argument("--min-requests", type=int, help="canary requests a window needs to decide")
    p.add_argument("--max-error-rate-increase", type=float, default=None,
                   help="canary failure rate minus stable's, e.g. 0.05")
    p.add_argument("--max-ttft-ratio", type=float, default=None, help="canary/stable mean TTFT")
    p.add_argument("--max-tpot-ratio", type=float, default=None, help="canary/stable mean TPOT")
    p.add_argument("--max-feedback-drop", type=float, default=None,
                   help="stable minus canary mean feedback score")
    p.add_argument("--min-feedback", type=int, default=0, help="scores each side needs (default 1)")
    p.add_argument("--steps", default="", help="traffic ratios to climb, e.g. 0.05,0.25,0.5")
    p.add_argument("--clear", action="store_true", help="remove the policy")
    p.add_argument("--etag", default=None)
    p.add_argument("--reason", default="")
    p.set_defaults(func=call_command(_set_policy, adapter_text))
    s = cmds.add_parser("status", help="route, live figures per version, canary analysis")
    s.add_argument("adapter_id")
    s.set_defaults(func=call_command(lambda c, a: c.status(a.adapter_id), status_text))


def _set_policy(client: Any, args: argparse.Namespace) -> Any:
    from slora.v1 import admin_pb2 as pb

    if args.clear:
        return client.set_policy(args.adapter_id, None, args.etag, args.reason)
    if args.window is None or args.min_requests is None:
        raise SystemExit("policy: --window and --min-requests are required (or --clear)")
    policy = pb.CanaryPolicy(window_seconds=args.window, min_requests=args.min_requests,
                             min_feedback=args.min_feedback,
                             steps=[float(x) for x in args.steps.split(",") if x.strip()])
    for name in ("max_error_rate_increase", "max_ttft_ratio", "max_tpot_ratio",
                 "max_feedback_drop"):
        value = getattr(args, name)
        if value is not None:
            setattr(policy, name, value)
    return client.set_policy(args.adapter_id, policy, args.etag, args.reason)


def policy_text(p: Any) -> str:
    checks = []
    if p.HasField("max_error_rate_increase"):
        checks.append(f"failure rate +{p.max_error_rate_increase:g}")
    if p.HasField("max_ttft_ratio"):
        checks.append(f"ttft x{p.max_ttft_ratio:g}")
    if p.HasField("max_tpot_ratio"):
        checks.append(f"tpot x{p.max_tpot_ratio:g}")
    if p.HasField("max_feedback_drop"):
        checks.append(f"feedback -{p.max_feedback_drop:g} (min {p.min_feedback})")
    steps = " -> ".join([*(f"{s:.0%}" for s in p.steps), "promote"]) if p.steps else \
        "none (rollback only)"
    return (f"policy: window {p.window_seconds:g}s, min {p.min_requests} requests; "
            f"{', '.join(checks)}; steps {steps}")


def _ms(seconds: float, count: int) -> str:
    return f"{seconds * 1000:.1f}ms" if count else "-"


def _figure_row(f: Any, span: str, e: Any) -> list[Any]:
    feedback = f"{e.feedback_mean:+.2f} ({e.feedback_count})" if e.feedback_count else "-"
    return [f.version, f.role or "-", _state(f.state), span, e.requests,
            f"{e.failure_rate:.1%}" if e.requests else "-",
            _ms(e.ttft_mean_s, e.ttft.count), _ms(e.ttft_p90_s, e.ttft.count),
            _ms(e.tpot_mean_s, e.tpot.count), feedback, e.routed, e.fallbacks]


def _state(number: int) -> str:
    from slora.v1 import admin_pb2 as pb

    return pb.VersionState.Name(number).removeprefix("VERSION_STATE_").lower()


def status_text(st: Any) -> str:
    parts = [adapter_text(st.adapter, versions=False)]
    if st.adapter.HasField("canary_policy"):
        parts.append(policy_text(st.adapter.canary_policy))
    rows = []
    for f in st.figures:
        if f.HasField("window"):
            rows.append(_figure_row(f, "window", f.window))
        rows.append(_figure_row(f, "total", f.total))
    headers = ("VERSION", "ROLE", "STATE", "SPAN", "REQS", "FAIL", "TTFT", "TTFT_P90", "TPOT",
               "FEEDBACK", "ROUTED", "FALLBACKS")
    parts.append("\n" + table(headers, rows) if rows else "\n(no evidence yet)")
    if st.HasField("analysis"):
        parts.append("\n" + _analysis_text(st.analysis))
    return "\n".join(parts)


def _analysis_text(a: Any) -> str:
    lines = []
    if a.canary_version:
        window = (f"window {a.window_elapsed_seconds:.1f}s" if a.HasField("window_started_at")
                  else "no window yet")
        lines.append(f"analysis: canary {a.canary_version}, {window}, "
                     f"{a.windows_passed} window(s) passed"
                     + (f", waiting for {a.waiting_for}" if a.waiting_for else ""))
    else:
        lines.append("analysis: no canary running")
    if a.last_decision:
        at = a.last_decision_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S")
        lines.append(f"last decision: {a.last_decision} {a.last_version} at {at}: "
                     f"{a.last_reason}")
    return "\n".join(lines)
