"""``tiered-kv demo restart --store URL`` whose store cannot be reached (Redis down, a wrong
password): the engine only counts a down tier's misses and failed saves, so the demo ran on,
restored nothing, said "outputs identical: yes" and exited 0. The README's exit codes say 3."""

from __future__ import annotations

from tests.cli.test_bad_input_files import one_error_line, run
from tests.redis_server import free_port

SECRET = "S3cretPw9demo"


def test_regression_a_demo_against_a_redis_that_refuses_connections_exited_0(tmp_path):
    url = f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"  # nothing listens there
    code, out, err = run("demo", "restart", "--dir", tmp_path / "demo", "--store", url,
                         "--model-size", "tiny", "--prompt-tokens", "700", "--json")
    message = one_error_line(code, out, err, exit_code=3)
    assert message.startswith("the demo's store (remote) refused ") and "saves" in message
    assert SECRET not in out + err
