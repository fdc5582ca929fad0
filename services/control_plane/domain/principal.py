"""Who is calling the control plane: a principal and its scope, as a plain value."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import PermissionDenied

ADMIN, TENANT = "admin", "tenant"
SCOPES = (ADMIN, TENANT)


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key's id (recorded as the actor), its scope and, for tenant keys,
    the one tenant it may see."""

    key_id: str
    scope: str
    tenant: str | None = None
    kind: str = "key"  # "system" for changes the control plane makes on its own

    @property
    def is_admin(self) -> bool:
        return self.scope == ADMIN

    @property
    def actor(self) -> str:
        return f"{self.kind}:{self.key_id}"

    def check_tenant(self, tenant: str | None) -> None:
        """Raise PermissionDenied unless this principal may see `tenant`'s records."""
        if not self.is_admin and tenant != self.tenant:
            raise PermissionDenied(f"key {self.key_id} may not access tenant {tenant!r}")

    def require_admin(self) -> None:
        if not self.is_admin:
            raise PermissionDenied(f"key {self.key_id} has scope {self.scope!r}; admin needed")


# The principal recorded for changes made by the control plane itself (bootstrap, migrations).
SYSTEM = Principal(key_id="system", scope=ADMIN)
