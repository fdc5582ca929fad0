"""Build hook (the rest of the metadata is in pyproject.toml): the gRPC modules
(slora/v1/*_pb2*.py) are generated from proto/ while the package is built, so a wheel carries
them although git does not (DESIGN section 2: generated code is a build product)."""

import sys
from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent

# The registry's Alembic folder lives at the top level (migrations/, as DESIGN lays the tree out)
# and ships inside the services package, so an installed slora finds it without a checkout
# (services/control_plane/store/db.py looks in both places).
MIGRATIONS = {
    "services.control_plane.migrations": "migrations",
    "services.control_plane.migrations.versions": "migrations/versions",
}
PACKAGES = find_namespace_packages(
    where=str(HERE), include=["slora*", "slora_core*", "slora_kernels*", "services*", "devtools*"]
) + list(MIGRATIONS)


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        super().run()
        sys.path.insert(0, str(HERE))
        from services.codegen import generate

        # An editable install imports from the source tree, a wheel from build_lib.
        generate(HERE, HERE if getattr(self, "editable_mode", False) else Path(self.build_lib))


setup(packages=PACKAGES, package_dir=MIGRATIONS, cmdclass={"build_py": BuildPyWithProtos})
