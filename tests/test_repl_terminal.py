"""The interactive `lmserve run` in a real terminal (pexpect), against a real server and the real model."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pexpect
import pytest

from tests.test_server import MODEL, Server


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("-np", "1", "-c", "1024")
    yield srv
    srv.stop()


def test_chat_set_show_clear_and_bye(server: Server) -> None:
    env = {**os.environ, "LMSERVE_HOST": f"127.0.0.1:{server.port}", "TERM": "dumb"}
    child = pexpect.spawn(sys.executable, ["-m", "lmserve", "run", MODEL], env=env, encoding="utf-8", timeout=90)
    try:
        child.expect_exact(">>> ")
        child.sendline("/set parameter temperature 0")
        child.expect_exact(">>> ")
        child.sendline("What is the capital of France? Answer in one word.")
        child.expect("Paris")
        child.expect_exact(">>> ")
        child.sendline("/show modelfile")
        child.expect("FROM ")
        child.expect_exact(">>> ")
        child.sendline('"""Name two colours.')
        child.sendline('Answer briefly."""')
        child.expect_exact(">>> ")
        child.sendline("/clear")
        child.expect_exact(">>> ")
        child.sendline("/?")
        child.expect("/bye")
        child.expect_exact(">>> ")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
