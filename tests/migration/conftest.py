"""One intra-op thread: the migration scripts train tiny models on a shared 2-core machine."""

from tests.helpers import single_thread  # noqa: F401  (autouse)
