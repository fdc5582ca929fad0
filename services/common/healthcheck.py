"""`python -m services.common.healthcheck HOST:PORT [SERVICE]`: exit 0 when the server reports
SERVING (grpc.health.v1), 1 otherwise. The compose health checks run this."""

from __future__ import annotations

import sys

from services.common.processes import is_serving


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        sys.stderr.write("usage: python -m services.common.healthcheck HOST:PORT [SERVICE]\n")
        return 2
    return 0 if is_serving(argv[0], argv[1] if len(argv) == 2 else "", timeout_s=3.0) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
