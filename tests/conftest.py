import os

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("full", max_examples=600, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def run_cli(capsys):
    """Run the CLI in-process: returns (exit code, stdout, stderr)."""
    from megatron_prt.cli import main

    def run(*argv):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse errors
            code = exc.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
