import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Two threads everywhere: CI has two cores, and a fixed count keeps CPU reductions in one order.
    torch.set_num_threads(2)
    yield


@pytest.fixture(scope="session")
def postgres_server():
    """One throwaway PostgreSQL server for the session, started on first use."""
    from tests.postgres import PostgresServer

    server = PostgresServer()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """A fresh, empty job-store database: a SQLite file, or a PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'megaslide.db'}"
    return request.getfixturevalue("postgres_server").database()
