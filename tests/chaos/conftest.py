"""The chaos suite reuses the e2e fixtures (a redis-server per session, process nodes)."""

from tests.e2e.conftest import e2e_redis  # noqa: F401
