"""One `tokenmill serve` on SmolLM2 shared by the server-test modules that need nothing of their own (a start
takes ~20 s on a small CPU machine). Modules with flags of their own, or that stop or kill their server, start
their own RemoteServer. Tests on the shared server must leave it idle and read counters as before/after deltas:
other modules' traffic comes before theirs."""

from __future__ import annotations

import pytest
from server_harness import SHARED_SERVER_API_KEY, SHARED_SERVER_MODEL, RemoteServer

_FIXTURE = "shared_server"
_last_user = pytest.StashKey[tuple[pytest.Item, RemoteServer]]()
"""The last test that uses the shared server, and the server."""


SHARED_SERVER_CONFIG = """
trust-request-chat-template: true
enable_server_load_tracking: true
default-chat-template-kwargs: {tm_default: server, tm_other: server}
max-model-len: 4096
"""
"""Some of the shared server's flags, given through vLLM's --config YAML file (its max-model-len overridden on the
command line)."""


@pytest.fixture(scope="session")
def shared_server(smollm2_path, request, tmp_path_factory):
    """Started on first use; stopped after the last test that uses it (pytest_runtest_teardown below), not at
    the session's end, so that it holds no memory through the rest of the run."""
    # What its users need together: an API key (test_cli_errors), request chat templates, load tracking and default
    # chat template variables (test_server_validation), and no tool or reasoning flags (test_server_tools' plain
    # client, test_server_structured_outputs).
    config = tmp_path_factory.mktemp("shared_server") / "serve.yaml"
    config.write_text(SHARED_SERVER_CONFIG)
    server = RemoteServer(smollm2_path, "--served-model-name", SHARED_SERVER_MODEL, "--kv-cache-space", "0.25",
                          "--config", str(config), "--max-model-len", "1024", api_key=SHARED_SERVER_API_KEY)
    users = [item for item in request.session.items if _FIXTURE in item.fixturenames]
    request.config.stash[_last_user] = (users[-1], server)
    yield server
    server.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    last, server = item.config.stash.get(_last_user, (None, None))
    if item is last:
        server.stop()
    return result


@pytest.fixture
def unmeasured_step_cost(monkeypatch):
    """test_spec_decode.skip_step_cost_measurement, for the test's engines."""
    from tests.e2e.test_spec_decode import skip_step_cost_measurement

    skip_step_cost_measurement(monkeypatch)
