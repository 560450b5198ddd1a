"""The `segue` command line: flag errors are reported like argparse's, not as tracebacks."""
from __future__ import annotations

import pytest

from segue.cli import main


@pytest.mark.parametrize("flag, value, message", [
    ("--latency-capacity-tokens", "0", "latency_capacity_tokens must be >= 1"),
    ("--watermark", "2", "watermark must be in [0, 1)"),
])
def test_bad_engine_flag_is_a_clear_cli_error(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exc:
        main(["--log-level", "WARNING", "generate", flag, value, "hi"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
