"""The `rlsched` command line: one module per command group (`sim`, `sim_search`, `executor`,
`analysis`), the app, shared options and `main` in `common`. Importing this package registers
every command."""

from rlsched.cli import analysis, executor, sim, sim_search  # noqa: F401  (each registers its commands on the app)
from rlsched.cli.common import app, main

__all__ = ["app", "main"]
