"""One intra-op thread for these tests: the models are tiny, and on a shared 2-core machine two
spinning OpenMP threads per process cost several times the work (measured: 26 s against 151 s)."""

from tests.helpers import single_thread  # noqa: F401  (autouse)
